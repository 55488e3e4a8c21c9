"""ddp_bucketed.py: data parallel as torch's DistributedDataParallel does it, written out: gradients packed
into flat buckets, each bucket all-reduced the moment its last gradient lands, overlapping the rest of backward.

Every rank holds the whole model and runs forward + backward on its slice of the global batch; the gradients
are then averaged over ranks, so every replica takes the same optimizer step. dp.py averages every gradient
after backward has finished; the network then idles during backward and compute idles during the
all-reduce. Here (Li et al., "PyTorch Distributed: Experiences on Accelerating Data Parallel
Training", VLDB 2020, Sec. 3.2):
  1. Bucketing (Sec. 3.2.2): one all-reduce of a few MB costs about as much as one of a few KB (latency
     dominates small messages), so gradients are copied into a few flat buffers and each is reduced as one.
  2. Overlap (Sec. 3.2.3): backward produces gradients from the last layer to the first. A hook on every
     parameter copies its gradient into its bucket; when a bucket is full, its async all-reduce starts while
     autograd is still computing the earlier layers. The end of backward waits for all of them.
  3. Bucket order: first the reverse of registration (a guess at backward order); after the first iteration,
     rebuilt once from the order gradients *actually* arrived, so bucket 0 fills first. Buckets are launched
     in index order only: every rank must issue the same collectives in the same order (NCCL matches by order).
     Where torch differs: without find_unused_parameters its first iteration uses ONE bucket (no overlap
     until the rebuild; registration order may be far from backward order); here the first iteration
     already uses capped reverse-registration buckets, so the rebuild's gain is visible in the summary.
     With find_unused_parameters=True torch never rebuilds (the set of gradients can change every
     iteration), and neither does this file: its buckets stay in reverse registration order.
  4. no_sync() (Sec. 3.2.4): gradient accumulation; inside it the hooks only note which parameters were
     used, and gradients add up locally in .grad. The next synced backward reduces the accumulated .grad.
  5. A parameter that gets no gradient would leave its bucket waiting forever: an error names it, or
     find_unused_parameters=True fills its slot with its .grad (what no_sync() accumulated) or zeros, and
     all-reduces a used-map (used in any backward since the last sync) to tell "unused here" from "unused
     everywhere": the latter keep their .grad untouched (torch DDP's local_used_map, the same rule).
  6. --compress bf16|fp16: buckets travel in 16 bits (half the bytes of fp32, a quarter of fp64) and are
     copied back into the parameter dtype: gradient compression in its simplest form (torch's
     fp16_compress_hook / bf16_compress_hook). fp16 can underflow tiny gradients; bf16 keeps fp32's range.
     --check then compares with a one-process run of the same recipe (compressed_reference), exact on 2 ranks.
  7. --ckpt-dir saves the bucket layout with the model (BucketLayout): a restarted run keeps the rebuilt buckets.
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
  bucket 3                                                                  [AR 3]  wait all, copy to .grad
                                                                                  ^ loss.backward() returns
In production, use torch.nn.parallel.DistributedDataParallel (or FSDP's fully_shard when the model does not fit).
"""
import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (DTYPES, build_gpt, close_dist, count_tokens, fail, GPTConfig, init_dist, lm_loss,
                    make_optimizer, MarkovData)
from harness import (check_against_reference, check_common_args, Checkpointer, CommonArgs, env_world_size,
                     log_step, maybe_fail, parse_args, peak_memory_bytes, SavedActivations, state_bytes,
                     StepTimer, tensor_bytes, tolerance, write_summary)

MiB = 1024 * 1024
WIRE = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Args(CommonArgs):
    bucket_cap_mb: float = 0.1  # bucket capacity in MiB (torch: 25, which would be one bucket for this model)
    first_bucket_mb: float = 0.02  # capacity of bucket 0, the first to launch (torch: 1); small = starts early
    compress: Literal["none", "bf16", "fp16"] = "none"  # dtype the gradients travel in


# ----------------------------------------------------------------------------- the technique
class BucketedDDP(nn.Module):
    """Drop-in for torch.nn.parallel.DistributedDataParallel: when loss.backward() returns, every .grad
    holds the average over the ranks of `group`.

    Why post-accumulate-grad hooks + queue_callback: `Tensor.register_post_accumulate_grad_hook` runs right
    after autograd has written a parameter's .grad (including what no_sync() accumulated before), which is
    exactly "this gradient is final"; torch DDP hooks the same spot in C++ (the AccumulateGrad node). A plain
    `p.register_hook` would fire *before* accumulation and see only this backward's part, not the sum. The
    end-of-backward wait must run once, after the *whole* graph, before backward() returns:
    `Variable._execution_engine.queue_callback`, queued from the first hook of each backward, is that
    moment (torch DDP's Reducer queues its finalize_backward the same way). Waiting in the hook of the
    last bucket instead would hang on a parameter that gets no gradient; the callback can name it.
    Left out of torch DDP: gradient_as_bucket_view (.grad living inside the bucket: one copy less),
    re-broadcasting buffers every forward (the GPT has none), static_graph, general comm hooks."""

    def __init__(self, module, bucket_cap_mb=25, first_bucket_mb=1, group=None, find_unused_parameters=False,
                 compress=None):
        super().__init__()
        self.module, self.group, self.find_unused, self.wire_dtype = module, group, find_unused_parameters, compress
        self.world = dist.get_world_size(group)
        self.src = dist.get_global_rank(group, 0) if group is not None else 0
        self.caps = (int(first_bucket_mb * MiB), int(bucket_cap_mb * MiB))  # bytes of bucket 0, of the others
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.device = self.params[0].device
        with torch.no_grad():  # 1. one starting point: rank 0's weights (torch DDP broadcasts them too)
            for t in list(module.parameters()) + list(module.buffers()):
                dist.broadcast(t, src=self.src, group=group)
        self._build_buckets(list(reversed(range(len(self.params)))))  # 2. first guess: reverse registration
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda p, i=i: self._grad_ready(i))
        self.require_sync = True  # no_sync() turns it off
        self._sync = False  # decided at forward, as torch DDP does: a backward syncs if its forward did
        self._used = [False] * len(self.params)  # got a gradient since the last synced backward (no_sync too)
        # order gradients arrive in the first synced backward (None: never rebuild, or rebuilt already);
        # torch rebuilds only without find_unused_parameters, and so does this file
        self._arrival = None if find_unused_parameters else []
        self._rebuild_pending = False
        self.history = []  # one record per synced backward: overlap and bytes, measured

    def _build_buckets(self, order):
        """Pack parameters greedily in `order`: at most caps[0] bytes in bucket 0, caps[1] in the others (in
        the parameter dtype, as torch DDP counts); a parameter bigger than its cap gets a bucket of its own."""
        self.buckets, cur, size = [], [], 0
        for i in order:
            p = self.params[i]
            nbytes = p.numel() * p.element_size()
            if cur and (size + nbytes > self.caps[min(len(self.buckets), 1)] or p.dtype != self.params[cur[0]].dtype):
                self.buckets.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += nbytes
        self.buckets.append(cur)
        self.bucket_of, self.views, self.buffers = {}, {}, []
        for b, idx in enumerate(self.buckets):
            dtype = self.wire_dtype or self.params[idx[0]].dtype
            buf = torch.zeros(sum(self.params[i].numel() for i in idx), dtype=dtype, device=self.device)  # (n_b,)
            off = 0
            for i in idx:  # each parameter's gradient has a fixed slice of the flat buffer, shaped like it
                n = self.params[i].numel()
                self.views[i], self.bucket_of[i] = buf[off:off + n].view_as(self.params[i]), b
                off += n
            self.buffers.append(buf)

    def layout(self):
        """[(parameter names, bytes in the parameter dtype, bytes on the wire)] per bucket, in launch order."""
        return [([self.names[i] for i in idx], sum(self.params[i].numel() * self.params[i].element_size() for i in idx),
                 buf.numel() * buf.element_size()) for idx, buf in zip(self.buckets, self.buffers)]

    @contextlib.contextmanager
    def no_sync(self):
        """Forward and backward inside: gradients accumulate in .grad, locally; the next synced backward
        reduces the accumulated sum (torch DDP's no_sync)."""
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
            if self._arrival is not None:  # (re)start recording: the first backward that completes counts
                self._arrival = []
            self._pending = [len(idx) for idx in self.buckets]  # gradients each bucket still waits for
            self._arrived, self._n_arrived = [False] * len(self.params), 0
            self._works, self._launched_at, self._next, self._queued = [], [], 0, False
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
        self._arrived[i] = True
        self._n_arrived += 1
        self.views[i].copy_(self.params[i].grad)  # into the flat buffer (casts to the wire dtype)
        self._pending[self.bucket_of[i]] -= 1
        self._launch_ready()

    def _launch_ready(self):
        """Launch every bucket that is full, in index order only (a full bucket waits for the earlier ones)."""
        while self._next < len(self.buckets) and self._pending[self._next] == 0:
            buf = self.buffers[self._next]  # (n_b,) this rank's gradients, wire dtype
            buf.div_(self.world)  # average = sum of grad/N (torch DDP divides before the sum too)
            self._works.append(self._reduce(self._next, buf))
            self._launched_at.append(self._n_arrived)  # gradients arrived by now: fewer than at the end = overlap
            self._next += 1

    def _reduce(self, b, buf):
        """Start bucket b's all-reduce: (n_b,) this rank's gradients / N -> their sum over ranks, in place."""
        return dist.all_reduce(buf, group=self.group, async_op=True)

    def _finish_backward(self):
        """Autograd-engine callback, after the whole graph ran and before backward() returns."""
        # measured, before anything else launches: all-reduces already complete while autograd still ran
        hidden = sum(w.is_completed() for w in self._works)
        missing = [i for i, got in enumerate(self._arrived) if not got]
        for i in missing:  # every bucket is still launched, in the same order on every rank; the slot holds
            g = self.params[i].grad  # what no_sync() accumulated (torch reduces a defined .grad), else zeros
            self.views[i].copy_(g) if g is not None else self.views[i].zero_()
            self._pending[self.bucket_of[i]] -= 1
        self._launch_ready()
        early = [b for b in range(len(self._works)) if self._launched_at[b] < self._n_arrived]  # compute followed
        if missing and not self.find_unused:
            for w in self._works:  # the group stays consistent: this rank took part in every collective
                w.wait()
            self._sync, self._used = False, [False] * len(self.params)
            raise RuntimeError(f"BucketedDDP: {len(missing)} parameter(s) got no gradient in this backward: "
                               f"{', '.join(self.names[i] for i in missing)}. Make them part of the loss, set "
                               f"requires_grad=False, or pass find_unused_parameters=True")
        if self.find_unused:  # which parameters some rank used: unused here != unused everywhere
            used = torch.tensor(self._used, dtype=torch.int32, device=self.device)  # (P,) 1 = got a gradient
            dist.all_reduce(used, group=self.group)  # (P,) ranks that used each parameter
            unused_everywhere = {i for i, u in enumerate(used.tolist()) if u == 0}
        for idx, buf, w in zip(self.buckets, self.buffers, self._works):
            w.wait()
            for i in idx:
                p = self.params[i]
                if self.find_unused and i in unused_everywhere:
                    continue  # unused on every rank: .grad is left alone, as torch DDP leaves it
                if p.grad is None:  # unused here, used elsewhere: it gets the average too
                    p.grad = torch.empty_like(p)
                p.grad.copy_(self.views[i])  # back into the parameter dtype
        nbytes = [buf.numel() * buf.element_size() for buf in self.buffers]
        self.history.append(dict(buckets=len(self.buckets), launched_early=len(early),
                                 bytes_early=sum(nbytes[b] for b in early), hidden=hidden, payload_bytes=sum(nbytes),
                                 order=[i for idx in self.buckets for i in idx]))
        if self._arrival is not None:
            self._rebuild_pending = True  # the next forward rebuilds the buckets from this arrival order
        self._sync, self._used = False, [False] * len(self.params)

    def _rebuild(self):
        """After the first iteration: buckets in the order gradients arrived (torch DDP's rebuild_buckets).
        Rank 0's order is broadcast, so the layout (and so the collectives) is the same on every rank."""
        seen = set(self._arrival)
        order = self._arrival + [i for i in reversed(range(len(self.params))) if i not in seen]
        t = torch.tensor(order, dtype=torch.int64, device=self.device)  # (P,)
        dist.broadcast(t, src=self.src, group=self.group)
        self._build_buckets(t.tolist())
        self._arrival, self._rebuild_pending = None, False


class BucketLayout:
    """Checkpoint adapter (state_dict / load_state_dict) for a BucketedDDP's bucket order: a restarted run
    rebuilds exactly these buckets, not the first-iteration guess, so it issues the same all-reduces with
    the same elements in them (on 3+ ranks the layout decides the order of each element's sum)."""

    def __init__(self, ddp):
        self.ddp = ddp

    def state_dict(self):
        dd = self.ddp
        return dict(order=[i for idx in dd.buckets for i in idx], arrival=dd._arrival, pending=dd._rebuild_pending)

    def load_state_dict(self, state):
        self.ddp._build_buckets(state["order"])
        self.ddp._arrival, self.ddp._rebuild_pending = state["arrival"], state["pending"]


def compressed_reference(args, world, wire, device):
    """--check's answer for --compress: one process, no buckets, no communication, the same precision recipe.
    Per step, each rank r's gradient of N * L_r (its slice) is rounded to the wire dtype and divided by N
    there; the N terms are summed in the wire dtype (one rounding per addition, as the all-reduce does),
    then cast back to the parameter dtype, clipped and stepped (AdamW). On 1 or 2 ranks this is exactly the
    run's arithmetic (round(a + b) = round(b + a)); on 3 or more the collective picks the order of the sum."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, params, b, losses = make_optimizer(model.parameters(), args), list(model.parameters()), args.batch_size // world, []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        n_tok, total, summed = count_tokens(y), 0.0, None
        for r in range(world):
            loss = lm_loss(model(x[r * b:(r + 1) * b]), y[r * b:(r + 1) * b], n_tok)  # L_r on rank r's slice
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
    """(loss, parameter) tolerances of --check with --compress. On <= 2 ranks the reference is the run's own
    arithmetic: the dtype's tolerance. On N >= 3 the collective's order of the sum changes each summed
    gradient by up to N - 2 roundings, relative u (2^-8 in bf16, 2^-11 in fp16), so each AdamW step (which
    moves a weight by about lr) by up to that fraction: loss tolerance steps * lr * (N - 2) * u, relative.
    The parameters then get AdamW's largest possible move, 2 * lr * steps: an element whose sum is
    roundoff-sized can flip sign and step the other way, so only the losses stay a tight check there."""
    if world <= 2:
        return tolerance(args.dtype), tolerance(args.dtype)
    u = torch.finfo(WIRE[args.compress]).eps / 2
    return max(tolerance(args.dtype), args.steps * args.lr * (world - 2) * u), 2 * args.lr * args.steps


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    world = env_world_size()
    check_common_args(args)  # every rank checks, before any collective
    if args.batch_size % world:
        fail(f"--batch-size {args.batch_size} is not divisible by the world size {world}: each rank takes an "
             f"equal slice; use a multiple of {world}, e.g. {world * max(1, args.batch_size // world)}")
    for flag in ("bucket_cap_mb", "first_bucket_mb"):
        if not getattr(args, flag) * MiB >= 1:  # also catches nan
            fail(f"--{flag.replace('_', '-')} must be a positive size in MiB (fractions allowed, e.g. 0.05), "
                 f"got {getattr(args, flag)}")
    d = init_dist(args.timeout)  # --- setup (same in every file) ---
    summary = train(d, args)
    close_dist(ok=summary["check"] is None or summary["check"]["passed"])


def train(d, args):
    """Train (resuming from --ckpt-dir), --check, print and return the --json summary."""
    data = MarkovData(args.vocab, args.seed)
    d.log(f"ddp_bucketed: world {d.world}, {args.batch_size // d.world} sequences per rank, "
          f"entropy floor {data.entropy:.4f} nats/token")
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    ddp = BucketedDDP(model, args.bucket_cap_mb, args.first_bucket_mb, compress=WIRE[args.compress])
    opt = make_optimizer(model.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    state = {"model": model, "optim": opt, "buckets": BucketLayout(ddp)}
    start, hist = ckpt.load(state)
    losses = hist.get("losses", [])
    timer, b, peak = StepTimer(d.device), args.batch_size // d.world, 0
    # --- the training loop ---
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor on every rank
        x, y = x[d.rank * b:(d.rank + 1) * b].to(d.device), y[d.rank * b:(d.rank + 1) * b].to(d.device)  # (B/N, T)
        opt.zero_grad(set_to_none=True)
        with SavedActivations() as acts:
            loss = lm_loss(ddp(x), y, n_tok)  # this rank's share L_r of the global loss L = sum_r L_r
        # DDP *averages*: backpropagate N * L_r, so mean_r grad(N L_r) = grad L exactly, ragged targets too
        (loss * d.world).backward()  # returns with every .grad averaged over ranks
        if args.clip > 0:  # grads are now replicated, so this local norm is the global norm
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        total = loss.detach().clone().reshape(1)  # (1,) logging only: not counted in comm_bytes
        dist.all_reduce(total)
        ms = timer.stop()
        losses.append(total.item())
        peak = max(peak, state_bytes(model, opt) + tensor_bytes(ddp.buffers) + acts.bytes)
        log_step(d, step, losses[-1], ms, args.batch_size * args.seq_len)
        ckpt.maybe_save(step + 1, state, {"losses": losses})
    # --- the summary ---
    peak_mem = peak_memory_bytes(d, peak)  # the technique's own peak: read before --check trains a reference
    check = None
    if args.check:
        ref, (tol, ptol) = None, (None, None)  # None: common's float reference and tolerances
        if args.compress != "none":
            tol, ptol = compress_tolerance(args, d.world)
            ref = compressed_reference(args, d.world, WIRE[args.compress], d.device) if d.rank == 0 else None
        check = check_against_reference(d, args, losses, dict(model.named_parameters()), ref=ref, tol=tol, ptol=ptol)
    figures = summary_figures(ddp, d.world)
    summary = write_summary(d, args, "ddp_bucketed", losses, timer.median(),
                            args.batch_size * args.seq_len / max(timer.median(), 1e-9) * 1e3, peak_mem,
                            figures["allreduce_payload_bytes_per_step"], check, figures)
    print_summary(d, figures)
    return summary


# --- measurement ---
def summary_figures(ddp, world):
    """Measured numbers beside their theory values."""
    none = dict(launched_early=0, bytes_early=0, hidden=0, payload_bytes=0)  # a resumed, finished run
    last, first = (ddp.history or [none])[-1], (ddp.history or [none])[0]
    payload = last["payload_bytes"]
    return dict(
        buckets=len(ddp.buckets), bucket_bytes=[wire for _, _, wire in ddp.layout()],
        bucket_params=[len(names) for names, _, _ in ddp.layout()],
        allreduce_payload_bytes_per_step=payload,  # counted at launch: what each rank hands to all-reduce
        ring_bytes_sent_per_rank_theory=2 * (world - 1) / world * payload,  # theory: 2(N-1)/N * payload
        launched_before_backward_end=last["launched_early"], bytes_launched_before_backward_end=last["bytes_early"],
        launched_before_backward_end_first_step=first["launched_early"],  # before the arrival-order rebuild
        # measured from the works (is_completed) as the backward's callback starts: fully hidden all-reduces
        completed_before_backward_end=last["hidden"],
        bucket_order_per_step=[h["order"] for h in ddp.history],  # parameter indices, bucket by bucket
    )


def print_summary(d, f):
    d.log(f"--- summary (rank 0 of {d.world}) ---")
    d.log(f"buckets                          {f['buckets']}: {f['bucket_bytes']} bytes on the wire, "
          f"{f['bucket_params']} parameters")
    d.log(f"all-reduce payload per rank/step {f['allreduce_payload_bytes_per_step']} bytes (counted)")
    d.log(f"ring all-reduce sent per rank    {f['ring_bytes_sent_per_rank_theory']:.0f} bytes (theory: 2(N-1)/N * payload)")
    d.log(f"overlap, last step               {f['launched_before_backward_end']}/{f['buckets']} buckets "
          f"({f['bytes_launched_before_backward_end']} bytes) launched before backward finished; "
          f"{f['completed_before_backward_end']} had completed when it did (measured from the works)")
    d.log(f"overlap, first step              {f['launched_before_backward_end_first_step']}/{f['buckets']} buckets "
          f"launched early (registration-order buckets, before the rebuild)")


if __name__ == "__main__":
    main()
