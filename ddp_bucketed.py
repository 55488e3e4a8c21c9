"""ddp_bucketed.py: data parallel as torch's DistributedDataParallel does it, written out: gradients
that live in flat buckets, each bucket all-reduced the moment its last gradient lands, overlapping
the rest of backward.

Every rank holds the whole model and runs forward + backward on its slice of the global batch; the
gradients are then averaged over ranks, so every replica takes the same optimizer step. dp.py
averages every gradient after backward has finished; the network then idles during backward and
compute idles during the all-reduce. Here (Li et al., "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training", VLDB 2020, Sec. 3.2):
  1. Bucketing (Sec. 3.2.2): one all-reduce of a few MB costs about as much as one of a few KB
     (latency
     dominates small messages), so gradients live in a few flat buffers and each is reduced as one.
     DDP's cut rule: walk the parameters, add each to the open bucket, and close the bucket as soon
     as it holds at least the cap (so a bucket passes the cap by up to one parameter, and there are
     fewer of them).
  2. Gradients live in the buckets (DDP's gradient_as_bucket_view): each parameter's .grad is a view
     into
     its bucket, so the all-reduce's result *is* the gradient, never copied back. With
     zero_grad(set_to_none=False) the views survive and autograd adds into them: no copy at all.
     With set_to_none=True (used here: on a CPU one pass costs less than zeroing and adding) .grad
     starts as None and each hook writes the new gradient / N into its slot in one pass, then points
     .grad at it.
  3. Overlap (Sec. 3.2.3): backward produces gradients from the last layer to the first. A hook on
     every
     parameter marks its gradient ready; when a bucket is full, its async all-reduce starts while
     autograd is still computing the earlier layers. The end of backward waits for all of them.
  4. Bucket order: first the reverse of registration (a guess at backward order); after the first
     iteration,
     rebuilt once from the order gradients *actually* arrived, so bucket 0 fills first. Buckets are
     launched in index order only: every rank must issue the same collectives in the same order
     (NCCL matches by order). Where torch differs: without find_unused_parameters its first
     iteration uses ONE bucket (no overlap until the rebuild; registration order may be far from
     backward order); here the first iteration already uses capped reverse-registration buckets, so
     the rebuild's gain is visible in the summary. With find_unused_parameters=True torch never
     rebuilds (the set of gradients can change every iteration), and neither does this file: its
     buckets stay in reverse registration order.
  5. no_sync() (Sec. 3.2.4): gradient accumulation; inside it the hooks only note which parameters
     were
     used, and gradients add up locally in .grad. The next synced backward reduces the accumulated
     .grad.
  6. A parameter that gets no gradient would leave its bucket waiting forever: an error names it, or
     find_unused_parameters=True fills its slot with its .grad (what no_sync() accumulated) or
     zeros, and all-reduces a used-map (used in any backward since the last sync) to tell "unused
     here" from "unused everywhere": the latter keep their .grad untouched (torch DDP's
     local_used_map, the same rule).
  7. --compress bf16|fp16: each bucket travels as a 16-bit copy (half the bytes of fp32, a quarter of fp64),
     copied back into the bucket when it lands: gradient compression in its simplest form (torch's
     fp16_compress_hook / bf16_compress_hook). fp16 can underflow tiny gradients; bf16 keeps fp32's
     range. --check then compares with a one-process run of the same recipe (compressed_reference),
     exact on 2 ranks.
  8. The bucket layout is checkpointed beside the model (BucketLayout, below the fence): a restarted
     run
     keeps the rebuilt buckets.
Ring all-reduce (Patarasuk & Yuan, 2009; Sergeev & Del Balso, "Horovod", 2018) sends 2(N-1)/N of the
payload per rank, whatever N: adding ranks does not add bytes per rank.

    python ddp_bucketed.py --check                                      # world 1 (still buckets, no peers)
    torchrun --nproc_per_node=4 ddp_bucketed.py --check
    torchrun --nproc_per_node=2 ddp_bucketed.py --compress bf16 --check
    torchrun --nproc_per_node=4 ddp_bucketed.py --bucket-cap-mb 0.25 --first-bucket-mb 0.05

  backward, time ->   | head ln_f | block 3 | block 2 | block 1 | block 0 | emb |
  bucket 0 (small)               [AR 0 ....]
  bucket 1                                  [AR 1 ..........]
  bucket 2                                                    [AR 2 .........]
  bucket 3                                                                  [AR 3]  wait all: .grad is ready
                                                                                  ^ loss.backward()
                                                                                  returns
In production, use torch.nn.parallel.DistributedDataParallel (or FSDP's fully_shard when the model
does not fit).
"""

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import (
    CommCounter,
    CommonArgs,
    Run,
    SavedActivations,
    check_against_reference,
    check_common_args,
    env_world_size,
    parse_args,
    peak_memory_bytes,
    tensor_bytes,
    tolerance,
)

WIRE = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Args(CommonArgs):
    # bucket capacity in MiB (torch: 25, which would be one bucket for this model)
    bucket_cap_mb: float = 0.1
    # capacity of bucket 0, the first to launch (torch: 1): small starts early
    first_bucket_mb: float = 0.02
    compress: Literal["none", "bf16", "fp16"] = "none"  # dtype the gradients travel in


# ----------------------------------------------------------------------------- the technique
MiB = 1024 * 1024  # bucket caps are given in MiB, as torch DDP's bucket_cap_mb


def check_cap(mb, what):
    """What the buckets rely on: a positive cap, in MiB (fractions allowed). Written so that nan
    fails too. `what` names the cap: the parameter's name here, the flag's in check_args."""
    if not mb * MiB >= 1:
        raise ValueError(
            f"BucketedDDP: bucket caps must be positive sizes in MiB, fractions too (0.05), "
            f"not {what}={mb}"
        )


class Bucket:
    """One bucket (picotron's Bucket): the parameters `idx` (indices into the module's), their
    gradients in one flat `buffer` in the parameter dtype, each a fixed slice of it shaped like its
    parameter (`views`), and `pending`, the gradients it still waits for in this backward."""

    def __init__(self, idx, params):
        self.idx = idx
        sizes = [params[i].numel() for i in idx]
        like = params[idx[0]]
        self.buffer = torch.zeros(sum(sizes), dtype=like.dtype, device=like.device)  # (n_b,)
        self.views = {i: v.view_as(params[i]) for i, v in zip(idx, self.buffer.split(sizes))}
        self.pending = len(idx)


class BucketedDDP(nn.Module):
    """Drop-in for torch.nn.parallel.DistributedDataParallel(gradient_as_bucket_view=True): when
    loss.backward() returns, every .grad holds the average over the ranks of `group`, as a view into
    its bucket.

    Why post-accumulate-grad hooks + queue_callback: `Tensor.register_post_accumulate_grad_hook`
    runs right after autograd has written a parameter's .grad (including what no_sync() accumulated
    before), which is exactly "this gradient is final"; torch DDP hooks the same spot in C++ (the
    AccumulateGrad node). A plain `p.register_hook` would fire *before* accumulation and see only
    this backward's part, not the sum. The end-of-backward wait must run once, after the *whole*
    graph, before backward() returns: `Variable._execution_engine.queue_callback`, queued from the
    first hook of each backward, is that moment (torch DDP's Reducer queues its finalize_backward
    the same way). Waiting in the hook of the last bucket instead would hang on a parameter that
    gets no gradient; the callback can name it. Left out of torch DDP: re-broadcasting buffers every
    forward (the GPT has none), static_graph, general comm hooks."""

    def __init__(
        self,
        module,
        bucket_cap_mb=25,
        first_bucket_mb=1,
        group=None,
        find_unused_parameters=False,
        compress=None,
    ):
        super().__init__()
        check_cap(bucket_cap_mb, "bucket_cap_mb")
        check_cap(first_bucket_mb, "first_bucket_mb")
        if compress is not None and not compress.is_floating_point:
            raise ValueError(
                f"BucketedDDP: compress must be a float dtype (torch.bfloat16, torch.float16), "
                f"got {compress}"
            )
        self.module = module
        self.group = group
        self.find_unused = find_unused_parameters
        self.wire_dtype, self.world = compress, dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.caps = (
            int(first_bucket_mb * MiB),
            int(bucket_cap_mb * MiB),
        )  # bytes of bucket 0, of the others
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        if not self.params:
            raise ValueError(
                "BucketedDDP: no parameter of the module requires grad: nothing to average"
            )
        self.device = self.params[0].device
        # 1. one starting point: rank 0's weights (torch DDP broadcasts them too)
        with torch.no_grad():
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self.src, group=group)
        # 2. first guess: reverse registration
        self._build_buckets(list(reversed(range(len(self.params)))))
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        self.require_sync = True  # no_sync() turns it off
        # decided at forward, as torch DDP does: a backward syncs if its forward did
        self._sync = False
        # got a gradient since the last synced backward (no_sync too)
        self._used = [False] * len(self.params)
        # order gradients arrive in the first synced backward (None: never rebuild, or rebuilt
        # already); torch rebuilds only without find_unused_parameters, and so does this file
        self._arrival = None if find_unused_parameters else []
        self._rebuild_pending = False
        self.works, self._wires = (
            [],
            [],
        )  # this backward's all-reduces (and 16-bit copies), bucket by bucket

    def _assign(self, order):
        """DDP's cut rule (compute_bucket_assignment_by_size in its reducer): walk `order`, add each
        parameter to the open bucket of its dtype, and close that bucket once it holds at least its
        cap (caps[0] for the first bucket of each dtype, caps[1] after). Returns the buckets, as
        lists of parameter indices."""
        buckets = []
        open_ = {}
        closed = {}
        for i in order:
            p = self.params[i]
            idx, size = open_.setdefault(p.dtype, ([], [0]))
            idx.append(i)
            size[0] += p.numel() * p.element_size()
            if size[0] >= self.caps[min(closed.get(p.dtype, 0), 1)]:
                buckets.append(open_.pop(p.dtype)[0])
                closed[p.dtype] = closed.get(p.dtype, 0) + 1
        return buckets + [idx for idx, _ in open_.values()]

    def _build_buckets(self, order):
        """The buckets of `order`, cut by DDP's rule, and each parameter's bucket."""
        self.buckets = [Bucket(idx, self.params) for idx in self._assign(order)]
        self.bucket_of = {i: bucket for bucket in self.buckets for i in bucket.idx}

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside: gradients accumulate in .grad, locally; the next synced
        backward reduces the accumulated sum (torch DDP's no_sync)."""
        old, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = old

    def forward(self, *args, **kwargs):
        if self._rebuild_pending:
            self._rebuild()
        self._sync = self.require_sync and torch.is_grad_enabled()
        if self._sync:  # fresh per-backward state
            # (re)start recording: the first backward that completes counts
            if self._arrival is not None:
                self._arrival = []
            for bucket in self.buckets:
                bucket.pending = len(bucket.idx)
            self.arrived = [False] * len(self.params)  # got its gradient in this backward
            self.works = []
            self._wires = []
            self._next = 0
            self._queued = False
        return self.module(*args, **kwargs)

    def _grad_ready(self, i):
        """Post-accumulate-grad hook of parameter i: its .grad is final for this backward."""
        self._used[i] = True  # torch's local_used_map: a no_sync() backward marks it used too
        if not self._sync:
            return  # inside no_sync(): the gradient stays local, accumulating in .grad
        if not self._queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._queued = True
        if self._arrival is not None:
            self._arrival.append(i)
        self.arrived[i] = True
        bucket = self.bucket_of[i]
        self._into_bucket(i)
        self.params[i].grad = bucket.views[i]  # .grad lives in its bucket from now on
        bucket.pending -= 1
        self._launch_ready()

    def _into_bucket(self, i):
        """Slot i of its bucket := .grad / N in one pass (the average is a sum of grad/N; torch DDP
        divides before the sum too; compressed, the 16-bit copy is divided instead, as torch's hook
        does); zeros for no .grad. A .grad that already is the slot (zero_grad(set_to_none=False)
        kept it, and autograd added into it in place): divided where it is, no copy."""
        g = self.params[i].grad
        view = self.bucket_of[i].views[i]
        n = 1 if self.wire_dtype else self.world
        if g is None:
            view.zero_()
        elif g.data_ptr() == view.data_ptr():
            view.div_(n)
        else:
            torch.div(g, n, out=view)

    def _launch_ready(self):
        """Launch every full bucket, in index order only (a full bucket waits for the earlier
        ones)."""
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            buf = self.buckets[self._next].buffer  # (n_b,) this rank's gradients / N
            # a 16-bit copy travels: rounded, then divided (torch's hook)
            if self.wire_dtype is not None:
                buf = buf.to(self.wire_dtype).div_(self.world)
                self._wires.append(buf)
            self.works.append(self._reduce(self._next, buf))
            self._next += 1

    def _reduce(self, b, buf):
        """Start bucket b's all-reduce: (n_b,) this rank's gradients / N -> their sum over ranks, in
        place."""
        return dist.all_reduce(buf, group=self.group, async_op=True)

    def _finish_backward(self):
        """Autograd-engine callback, after the whole graph ran and before backward() returns."""
        missing = self._fill_missing()
        if missing and not self.find_unused:
            # the group stays consistent: this rank took part in every collective
            for work in self.works:
                work.wait()
            self._sync, self._used = False, [False] * len(self.params)
            raise RuntimeError(
                f"BucketedDDP: {len(missing)} parameter(s) got no gradient in this backward: "
                f"{', '.join(self.names[i] for i in missing)}. Make them part of the loss, "
                f"set requires_grad=False, or pass find_unused_parameters=True"
            )
        self._wait(self._unused_everywhere() if self.find_unused else set())
        if self._arrival is not None:
            # the next forward rebuilds the buckets from this arrival order
            self._rebuild_pending = True
        self._sync, self._used = False, [False] * len(self.params)

    def _fill_missing(self):
        """Slots of parameters that got no gradient in this backward: what no_sync() accumulated in
        .grad (torch reduces a defined .grad), else zeros; so every bucket still launches, in the
        same order on every rank. Returns those parameters."""
        missing = [i for i, got in enumerate(self.arrived) if not got]
        for i in missing:
            self._into_bucket(i)
            self.bucket_of[i].pending -= 1
        self._launch_ready()
        return missing

    def _unused_everywhere(self):
        """The parameters no rank used since the last sync: unused here is not unused everywhere."""
        # (P,) 1 = got a gradient
        used = torch.tensor(self._used, dtype=torch.int32, device=self.device)
        dist.all_reduce(used, group=self.group)  # (P,) ranks that used each parameter
        return {i for i, u in enumerate(used.tolist()) if u == 0}

    def _wait(self, unused_everywhere=()):
        """Wait for every bucket; .grad = its view (the average), but where no rank used the
        parameter: its .grad is left alone, as torch DDP leaves it."""
        for b, work in enumerate(self.works):
            work.wait()
            bucket = self.buckets[b]
            if self.wire_dtype is not None:
                bucket.buffer.copy_(self._wires[b])  # back into the parameter dtype
            for i in bucket.idx:
                if i not in unused_everywhere:
                    self.params[i].grad = bucket.views[i]

    def _rebuild(self):
        """After the first iteration: buckets in the order gradients arrived (torch DDP's
        rebuild_buckets). Rank 0's order is broadcast, so the layout (and so the collectives) is the
        same on every rank."""
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.device)  # (P,)
        dist.broadcast(t, src=self.src, group=self.group)
        self._build_buckets(t.tolist())
        self._arrival, self._rebuild_pending = None, False


def to_device(device, *tensors):
    """A step's batch onto the device, one copy per tensor: pinned and non-blocking on CUDA."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def check_args(args):
    world = env_world_size()
    check_common_args(args)  # every rank checks, before any collective
    if args.batch_size % world:
        fail(
            f"--batch-size {args.batch_size} is not divisible by the world size {world}: each rank "
            f"takes an equal slice; use a multiple of {world}, e.g. "
            f"{world * max(1, args.batch_size // world)}"
        )
    try:  # the core's own check, its ValueError as fail's one line
        check_cap(args.bucket_cap_mb, "--bucket-cap-mb")
        check_cap(args.first_bucket_mb, "--first-bucket-mb")
    except ValueError as e:
        fail(str(e))


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    check_args(args)
    d = init_dist(args.timeout)  # --- setup (same in every file) ---
    data = MarkovData(args.vocab, args.seed)
    d.log(
        f"ddp_bucketed: world {d.world}, {args.batch_size // d.world} sequences per rank, "
        f"entropy floor {data.entropy:.4f} nats/token"
    )
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    ddp = BucketedDDP(model, args.bucket_cap_mb, args.first_bucket_mb, compress=WIRE[args.compress])
    opt = make_optimizer(model.parameters(), args)
    # resumes: --ckpt-dir
    run = Run(d, args, {"model": model, "buckets": BucketLayout(ddp), "optim": opt})
    comm = CommCounter()
    overlap = Overlap(ddp)
    acts = SavedActivations()
    b = args.batch_size // d.world
    # measurement: the dispatcher counter sends every op through Python, so it watches one step, the
    # second (after the rebuild; bench.py times the steps after its warm-up, and counts torch's in
    # its last warm-up)
    count_at = min(max(run.start, 1), args.steps - 1)
    # The log line's loss on a group of its own: on NCCL its own communicator, never queued behind
    # the buckets' all-reduces, and never counted with them (it reduces outside the watched step).
    log_group = dist.new_group()
    for step in run.steps():
        # (B, T) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor on every rank
        # (B/N, T)
        x, y = to_device(
            d.device, x[d.rank * b : (d.rank + 1) * b], y[d.rank * b : (d.rank + 1) * b]
        )
        with run.watching(step, comm, acts, at=count_at):
            # backward's hooks copy each gradient into its bucket once
            opt.zero_grad(set_to_none=True)
            # this rank's share L_r of the global loss L = sum_r L_r
            loss = lm_loss(ddp(x), y, n_tok)
            # DDP *averages*: backpropagate N * L_r, so mean_r grad(N L_r) = grad L exactly, ragged
            # or not
            (loss * d.world).backward()  # returns with every .grad averaged over ranks
            if args.clip > 0:  # grads are now replicated, so this local norm is the global norm
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
        total = loss.detach().clone()  # this rank's share L_r
        dist.all_reduce(total, group=log_group)  # the global batch's loss, for the log line only
        run.end_step(step, total.item())
    figures = summary_figures(d, ddp, comm, overlap)
    held = [
        *model.parameters(),
        *(p.grad for p in model.parameters()),
        *(bucket.buffer for bucket in ddp.buckets),
        *ddp._wires,
        *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0),
    ]
    # read before --check trains a reference
    peak = peak_memory_bytes(d, tensor_bytes(held) + acts.bytes)
    check = None
    if args.check:
        # None: common's float reference and tolerances
        ref = None
        tol = ptol = None
        if args.compress != "none":
            tol, ptol = compress_tolerance(args, d.world)
            ref = (
                compressed_reference(args, d.world, WIRE[args.compress], d.device)
                if d.rank == 0
                else None
            )
        check = check_against_reference(
            d, args, run.losses, dict(model.named_parameters()), ref=ref, tol=tol, ptol=ptol
        )
    run.finish("ddp_bucketed", peak, figures["allreduce_payload_bytes_per_step"], check, figures)


# --- measurement ---
def bucket_layout(ddp):
    """[(parameter names, bytes in the parameter dtype, bytes on the wire)] per bucket, launch
    order."""
    out = []
    for bucket in ddp.buckets:
        buf = bucket.buffer
        wire = torch.finfo(ddp.wire_dtype).bits // 8 if ddp.wire_dtype else buf.element_size()
        out.append(
            (
                [ddp.names[i] for i in bucket.idx],
                buf.numel() * buf.element_size(),
                buf.numel() * wire,
            )
        )
    return out


class BucketLayout:
    """A BucketedDDP's bucket layout as checkpoint state, beside the model's: a restarted run
    rebuilds exactly these buckets, not the first guess, so it issues the same all-reduces with the
    same elements in them (on 3+ ranks the layout decides the order of each element's sum)."""

    def __init__(self, ddp):
        self.ddp = ddp

    def state_dict(self):
        ddp = self.ddp
        return dict(
            order=[i for bucket in ddp.buckets for i in bucket.idx],
            arrival=ddp._arrival,
            pending=ddp._rebuild_pending,
        )

    def load_state_dict(self, state):
        self.ddp._build_buckets(state["order"])
        self.ddp._arrival, self.ddp._rebuild_pending = state["arrival"], state["pending"]


class Overlap:
    """Watches a BucketedDDP, per synced backward: the buckets launched while gradients were still
    to come (fewer had arrived than at the end), and the all-reduces complete when backward ended.
    CPU: the works' is_completed() as the end-of-backward callback starts. A GPU's host runs ahead
    of the device, so there: a CUDA event on a side stream made to wait for each all-reduce, against
    one where backward's kernels end."""

    def __init__(self, ddp):
        self.ddp = ddp
        self.steps = []
        self.cuda = ddp.device.type == "cuda"
        self.side = torch.cuda.Stream(ddp.device) if self.cuda else None
        self.reduce, self.finish = ddp._reduce, ddp._finish_backward
        ddp._reduce, ddp._finish_backward = self._reduce, self._finish

    def _reduce(self, b, buf):
        self._begin()
        work, done = self.reduce(b, buf), None
        if self.cuda:  # the side stream waits for this all-reduce: its event marks when it ended
            with torch.cuda.stream(self.side):
                work.wait()
                done = self._event()
        self.now["launched"].append((sum(self.ddp.arrived), buf.numel() * buf.element_size(), done))
        return work

    def _finish(self):
        self._begin()
        arrived, works = sum(self.ddp.arrived), self.ddp.works
        ended = self._event() if self.cuda else [w.is_completed() for w in works]
        self.finish()
        # the first launch of a backward starts its record (on a GPU with an event: its zero)
        self.steps.append(
            dict(
                self.now,
                arrived=arrived,
                ended=ended,
                order=[i for b in self.ddp.buckets for i in b.idx],
            )
        )

    def _begin(
        self,
    ):
        if not self.ddp.works:
            self.now = dict(launched=[], zero=self._event() if self.cuda else None)

    def _event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def per_step(self):
        """Per synced backward: buckets, launched_early, bytes_early, hidden, payload_bytes,
        order."""
        if self.cuda:
            torch.cuda.synchronize(self.ddp.device)
        out = []
        for s in self.steps:
            early = [n for arrived, n, _ in s["launched"] if arrived < s["arrived"]]
            ms = s["zero"].elapsed_time if self.cuda else None
            hidden = (
                sum(ms(done) <= ms(s["ended"]) for *_, done in s["launched"])
                if ms
                else sum(s["ended"])
            )
            out.append(
                dict(
                    buckets=len(s["launched"]),
                    launched_early=len(early),
                    bytes_early=sum(early),
                    hidden=hidden,
                    payload_bytes=sum(n for _, n, _ in s["launched"]),
                    order=s["order"],
                )
            )
        return out


def summary_figures(d, ddp, comm, overlap):
    """Measured numbers beside their theory values."""
    steps = overlap.per_step()
    payload = comm.total("all_reduce")
    layout = bucket_layout(ddp)
    last, first = (
        (steps[-1], steps[0]) if steps else (dict(launched_early=0, bytes_early=0, hidden=0),) * 2
    )
    f = dict(
        buckets=len(layout),
        bucket_bytes=[wire for *_, wire in layout],
        bucket_params=[len(names) for names, *_ in layout],
        # counted at the dispatcher: what each rank hands over
        allreduce_payload_bytes_per_step=payload,
        ring_bytes_sent_per_rank_theory=2 * (d.world - 1) / d.world * payload,  # theory
        launched_before_backward_end=last["launched_early"],
        bytes_launched_before_backward_end=last["bytes_early"],
        launched_before_backward_end_first_step=first["launched_early"],  # before the rebuild
        completed_before_backward_end=last["hidden"],  # fully hidden all-reduces
        bucket_order_per_step=[s["order"] for s in steps],
    )  # parameter indices, bucket by bucket
    d.log(
        f"--- summary (rank 0 of {d.world}) ---\n"
        f"buckets                          {f['buckets']}: {f['bucket_bytes']} bytes on the wire, "
        f"{f['bucket_params']} parameters\n"
        f"all-reduce payload per rank/step {payload} bytes (counted)\n"
        f"ring all-reduce sent per rank    {f['ring_bytes_sent_per_rank_theory']:.0f} bytes "
        "(theory: "
        f"2(N-1)/N * payload)\n"
        f"overlap, last step               {last['launched_early']}/{f['buckets']} buckets "
        f"({last['bytes_early']} bytes) launched before backward finished; {last['hidden']} had "
        f"completed when it did (measured)\n"
        f"overlap, first step              {first['launched_early']}/{f['buckets']} buckets "
        "launched early "
        f"(registration-order buckets, before the rebuild)"
    )
    return f


# --- reference for --check ---
def compressed_reference(args, world, wire, device):
    """--check's answer for --compress: one process, no buckets, no communication, the same
    precision recipe: each rank r's gradient of N * L_r rounded to the wire dtype and divided by N
    there, the N terms summed in the wire dtype, cast back, clipped, stepped. Exactly the run's
    arithmetic on 1 or 2 ranks (a + b = b + a); on 3 or more the collective picks the order of the
    sum."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, params = make_optimizer(model.parameters(), args), list(model.parameters())
    b, losses = args.batch_size // world, []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        n_tok = count_tokens(y)
        total = 0.0
        summed = None
        for r in range(world):
            # L_r on rank r's slice
            loss = lm_loss(model(x[r * b : (r + 1) * b]), y[r * b : (r + 1) * b], n_tok)
            g = [t.to(wire).div_(world) for t in torch.autograd.grad(loss * world, params)]
            summed = g if summed is None else [s + t for s, t in zip(summed, g)]
            total += loss.item()
        for p, s in zip(params, summed):
            p.grad = s.to(p.dtype)
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.clip)
        opt.step()
        losses.append(total)
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


def compress_tolerance(args, world):
    """(loss, parameter) tolerances of --check with --compress: the dtype's on <= 2 ranks (the same
    arithmetic). On N >= 3 the order of the sum moves each summed gradient by up to N - 2 roundings
    of relative u, so each AdamW step (about lr) by that fraction: losses within steps * lr * (N -
    2) * u; parameters within AdamW's largest move, 2 * lr * steps (a roundoff-sized sum can flip
    sign)."""
    if world <= 2:
        return tolerance(args.dtype), tolerance(args.dtype)
    u = torch.finfo(WIRE[args.compress]).eps / 2
    return max(
        tolerance(args.dtype), args.steps * args.lr * (world - 2) * u
    ), 2 * args.lr * args.steps


if __name__ == "__main__":
    main()
