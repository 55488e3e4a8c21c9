"""gpipe.py: GPipe pipeline parallelism: p stages, m micro-batches, all forwards, then all
backwards.

GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism", NeurIPS 2019) cuts the model into p consecutive stages, one per device, and the global
batch into m micro-batches. Every stage runs the forward (F) of all m micro-batches, handing
activations to the next stage, then the backward (B) of all m, handing gradients back; the m
micro-batch gradients add up to the full-batch gradient, so the one optimizer step after this
"flush" is exactly one-process training (Sec. 2.2). The price is the bubble: with equal F and B
times a stage idles (p-1)/(m+p-1) of the step (Sec. 2.3). B runs here in the order F ran; any order
gives the same sum and the same bubble.

    p = 4, m = 4 (B drawn as long as F)                       time ->
    stage 0   F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3     embedding + blocks
    stage 1   .. F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3 ..     blocks
    stage 2   .. .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 .. ..     blocks
    stage 3   .. .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. .. ..     blocks + final norm + head + loss
              idle ("..") = 6 of 14 slots per stage = (p-1)/(m+p-1), the bubble; then one optimizer
              step

Between its F and its B a micro-batch's activations stay alive, so a stage holds all m of them at
the flush. --recompute is the paper's re-materialisation (Sec. 2.3, after Chen et al. 2016): F keeps
only the stage input of each micro-batch, and B reruns the stage's forward from it first: the same
numbers for about one extra forward, with m stage inputs plus one micro-batch's activations alive
instead of m full sets.

The schedule, `gpipe_step`, runs any stage module over any list of micro-batches and counts nothing
itself: it enters one callback, `observe(kind, mb)`, around every F and B. Through it the run
measures, from outside, every F and B (start, end) on every stage, and prints the bubble beside its
theory, the peak number of micro-batches alive, the activation bytes held for backward (the live
storages), the bytes sent, and an ASCII timeline of the last step; --trace writes the same events
for Perfetto / chrome://tracing. On a laptop, processes that share a few cores time the operating
system's scheduling, not the schedule: --stage-ms F simulates compute time (each F also waits F ms,
each B 2F ms; the numbers computed are unchanged), so the measured bubble approaches its theory and
the timeline looks like the picture above.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --stage-ms 30 --steps 3   # simulated compute
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --recompute --trace gpipe_trace.json
    torchrun --nproc_per_node=3 gpipe.py --n-layers 4 --dtype float64 --check   # uneven split: 2 + 1 + 1
In production, use torch.distributed.pipelining (ScheduleGPipe), or DeepSpeed's / Megatron-LM's
pipelines.
"""

import contextlib
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    clip_grads_,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import (
    CommCounter,
    CommonArgs,
    LiveStorages,
    PipelineWatch,
    Run,
    assemble_full,
    busy_ms,
    check_against_reference,
    check_common_args,
    draw_timeline,
    env_world_size,
    gather_rows,
    is_parameter,
    parse_args,
    peak_memory_bytes,
    state_bytes,
    tensor_bytes,
    write_trace,
)


@dataclass
class Args(CommonArgs):
    # m: micro-batches per global batch (--batch-size must be divisible by it)
    microbatches: int = 4
    # re-materialisation: keep each micro-batch's stage input only, rerun F during B
    recompute: bool = False
    # write the last step's measured F/B events as a Chrome trace (JSON) to this path
    trace: str = ""
    # simulate compute time: each F of a micro-batch also waits this many ms, each B 2x
    stage_ms: float = 0.0


# ----------------------------------------------------------------------------- the stages
def split_layers(n_layers, p, what="n_layers"):
    """Blocks [start, end) of each of p stages, as even as possible; when p does not divide n_layers
    the earlier stages take one block more (the last stage already carries the head and the loss).
    `what` names n_layers in the error: check_args gives the flag's name."""
    if not 1 <= p <= n_layers:
        raise ValueError(
            f"{p} stages but {what} {n_layers}: {p} stages of {n_layers} blocks leave a "
            f"stage without one; use 1 to {n_layers} stages, or {what} {p} or more"
        )
    base, extra = divmod(n_layers, p)
    bounds, start = [], 0
    for s in range(p):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


class Stage(nn.Module):
    """Stage s of p: blocks [start, end) of the GPT, the embedding on the first stage, the final
    LayerNorm and LM head on the last. Taken from the full seeded model, so every stage starts from
    the reference's numbers; the ModuleDict keeps the GPT's own names (`blocks.3.mlp.fc.weight`), so
    the stages' parameters put together are exactly `GPT.named_parameters()`."""

    def __init__(self, gpt, s, bounds):
        super().__init__()
        start, end = bounds[s]
        self.first = s == 0
        self.last = s == len(bounds) - 1
        if self.first:
            self.tok_emb = gpt.tok_emb
            self.pos_emb = gpt.pos_emb
            self.drop = gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(start, end)})
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h):  # first stage: (b, T) token ids; others: (b, T, D) from the stage before
        if self.first:  # = GPT.embed
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        # last: logits (b, T, V); others: (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h


def check_microbatches(rows, m, what=("rows", "m")):
    """What cutting a batch of `rows` sequences into m micro-batches relies on (ValueError: what
    works). `what` names rows and m in the error: check_args gives the flags' names."""
    if m < 1:
        raise ValueError(f"{what[1]} must be >= 1, got {m}")
    if rows % m:
        fit = max(k for k in range(1, m) if rows % k == 0)
        raise ValueError(
            f"{what[0]} {rows} is not divisible by {what[1]} {m}: a batch of {rows} "
            f"does not cut into m = {m} equal micro-batches; use {what[1]} {fit} (an m "
            f"that divides {rows}) or {what[0]} {(rows // m + 1) * m}"
        )


def micro_batches(batch, m, device):
    """The step's (B, T) batch on the device in one copy (on CUDA from pinned memory, non-blocking:
    the host goes on), cut into m micro-batches (B/m, T), each in its own storage like a received
    input."""
    check_microbatches(len(batch), m)
    if device.type == "cuda":
        batch = batch.pin_memory()
    return [mb.clone() for mb in batch.to(device, non_blocking=True).chunk(m)]


# ----------------------------------------------------------------------------- the GPipe schedule
def post(op, tensor, peer, group):
    """Start one transfer (op: dist.isend or dist.irecv) with peer, a rank within group; return its
    request, through batch_isend_irecv even alone: on NCCL every transfer then runs on the group's
    one communicator, in the order posted. A request's wait() makes the host wait on gloo; on NCCL
    the stream, not the host."""
    return dist.batch_isend_irecv([dist.P2POp(op, tensor, group=group, group_peer=peer)])[0]


def rng_state(device):
    """Where the random generators stand (the CPU's, and the device's on CUDA): what dropout draws
    from."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(
        device
    ) if device.type == "cuda" else None


def gpipe_step(
    stage, xs, ys, loss_fn, prev, nxt, recv_shape, recompute=False, observe=None, group=None
):
    """One global batch through this rank's stage: F of micro-batches 0..m-1, then B of 0..m-1 (the
    flush), leaving the whole batch's gradient summed in the stage's .grad. Returns the sum of the m
    micro-batch losses (0-dim, float64; 0 except on the last stage).
      stage       this rank's nn.Module; what crosses a boundary has its first parameter's dtype and device
      xs, ys      the m micro-batches' inputs and targets, on the device; only the first stage reads xs, only
                  the last ys (the others may pass Nones)
      loss_fn     loss_fn(output, target): the micro-batch's share of the batch loss (a sum over its samples
                  divided by the whole batch's count, so that the m gradients add up to the batch's)
      prev, nxt   ranks within `group` (the pipeline's; None: the default group) of the stages before and
                  after this one, None at the ends
      recv_shape  shape of the activation received from prev, the same for every micro-batch: (b, T, D) here
      recompute   re-materialisation: F keeps only its input, B reruns F first
      observe     observe(kind, mb): a context manager entered around every F and B, to time or measure it
    Each transfer is posted as soon as its buffer exists and waited only where its data is needed: a
    receive one micro-batch ahead (it arrives while this stage computes), a send when the next is
    posted (the stage computes on while it travels). On NCCL those waits hold the stream: the host
    queues ahead of the GPU. NCCL wants one collective on the group before its first
    batch_isend_irecv: the caller runs it (see main). What the schedule relies on is checked before
    any transfer (ValueError)."""
    observe = observe or (lambda kind, mb: contextlib.nullcontext())
    m = len(xs)
    first = prev is None
    last = nxt is None
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if m < 1 or len(ys) != m:
        raise ValueError(
            f"{m} micro-batch inputs, {len(ys)} targets: give m >= 1 of each (None: unread)"
        )
    if me < 0 or any(q is not None and (q == me or not 0 <= q < size) for q in (prev, nxt)):
        raise ValueError(
            f"prev {prev}, nxt {nxt}: give other ranks within the group (0..{size - 1}; this is "
            f"{me}), not global ranks, on a rank of the group"
        )
    # the next stage receives every micro-batch into one shape
    if first and len({x.shape for x in xs}) > 1:
        raise ValueError(
            f"micro-batches of shapes {sorted({tuple(x.shape) for x in xs})}: cut equal ones"
        )
    like = next(stage.parameters())  # dtype and device of what is received
    inputs = [None] * m
    outputs = [None] * m
    rng = [None] * m
    loss_sum = torch.zeros((), dtype=torch.float64, device=like.device)
    sending = []  # the send in flight, with its tensor (kept referenced until it is done)

    def recv(shape, peer):  # an empty buffer and the posted receive that fills it
        buf = torch.empty(shape, dtype=like.dtype, device=like.device)
        return buf, post(dist.irecv, buf, peer, group)

    def finish_sends():
        while sending:
            sending.pop()[0].wait()

    def send(t, peer):
        finish_sends()
        sending.append((post(dist.isend, t, peer, group), t))

    def forward(i):  # the stage's forward of micro-batch i; on the last stage, its loss
        out = stage(inputs[i])
        return loss_fn(out, ys[i]) if last else out

    # 1. all forwards. F of micro-batch i starts when its input has arrived from stage s-1.
    pending = None if first else recv(recv_shape, prev)
    for i in range(m):
        if first:
            inputs[i] = xs[i]  # (b, T) token ids here
        else:
            inputs[i], req = pending  # (b, T, D) from stage s-1
            if i + 1 < m:
                pending = recv(recv_shape, prev)  # micro-batch i+1's, before F(i) runs
            req.wait()
            inputs[i].requires_grad_()  # a leaf: its .grad is what B sends back to stage s-1
        if recompute:  # where the RNG stood, so that B's rerun draws the same dropout masks
            rng[i] = rng_state(like.device)
        with observe("F", i), torch.no_grad() if recompute else contextlib.nullcontext():
            out = forward(i)  # with --recompute under no_grad: nothing is saved for backward
        if last:
            loss_sum += out.detach()
        else:
            send(out.detach(), nxt)  # (b, T, D) to stage s+1
            out_shape = out.shape
        # micro-batch i keeps its graph until B, or only its input
        outputs[i] = None if recompute else out
    finish_sends()  # under --recompute, then, only the m inputs are left

    # 2. all backwards, in the same order. B of micro-batch i starts when d loss / d output has
    #   arrived.
    pending = None if last else recv(out_shape, nxt)
    for i in range(m):
        grad = None  # last stage: B starts from the loss itself (d loss / d loss = 1)
        if not last:
            grad, req = pending  # (b, T, D) from stage s+1
            if i + 1 < m:
                pending = recv(out_shape, nxt)  # micro-batch i+1's, before B(i) runs
            req.wait()
        with observe("B", i):
            out = outputs[i]
            # Sec. 2.3: rerun F from the kept input, this time keeping the graph, with the same
            if recompute:
                # dropout masks: replay the RNG state F started from (as torch.utils.checkpoint
                # does)
                cpu_state, device_state = rng[i]
                with torch.random.fork_rng(
                    devices=[like.device] if device_state is not None else []
                ):
                    torch.set_rng_state(cpu_state)
                    if device_state is not None:
                        torch.cuda.set_rng_state(device_state, like.device)
                    out = forward(i)
            # adds micro-batch i's gradient into every .grad of the stage
            torch.autograd.backward(out, grad)
        if not first:
            send(inputs[i].grad, prev)  # (b, T, D) d loss / d input, to stage s-1
        # the graph and micro-batch i's activations go now
        inputs[i] = outputs[i] = rng[i] = out = None
    finish_sends()
    return loss_sum


def squared_norm(grads):
    """This stage's part of the whole model's squared gradient norm, in float64, with no float64
    copy of a gradient (the norm's dtype=float64 would cast its input first): each tensor's norm in
    its own dtype (bf16 / fp16 accumulated as float32, which CUDA reads in place), the few norms
    squared in float64."""
    low = (torch.float16, torch.bfloat16)
    return sum(
        torch.linalg.vector_norm(g, dtype=torch.float32 if g.dtype in low else None).double() ** 2
        for g in grads
    )


def check_args(args, p):
    """The cores' own checks (check_microbatches, split_layers), their ValueError as fail's one
    line."""
    check_common_args(args)
    try:
        check_microbatches(args.batch_size, args.microbatches, ("--batch-size", "--microbatches"))
        if p == 1:
            fail(
                f"gpipe.py needs one process per stage, at least 2: torchrun --nproc_per_node="
                f"{max(2, min(4, args.n_layers))} gpipe.py {' '.join(sys.argv[1:])}".rstrip()
            )
        split_layers(args.n_layers, p, "--n-layers")
    except ValueError as e:
        fail(str(e))


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    p, m = env_world_size(), args.microbatches  # p: stages = processes; m: micro-batches
    check_args(args, p)

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, p)
    d.log(
        f"gpipe.py: {p} stages x {m} micro-batches of {args.batch_size // m} sequences on "
        f"{d.backend}"
        f"{', --recompute' if args.recompute else ''}; entropy floor {data.entropy:.4f} nats/token"
    )
    d.log(
        "split: "
        + " | ".join(
            f"stage {s}: {'embedding + ' if s == 0 else ''}blocks {a}..{b - 1}"
            f"{' + norm + head + loss' if s == p - 1 else ''}"
            for s, (a, b) in enumerate(bounds)
        )
    )
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per stage
    dtype = DTYPES[args.dtype]
    # the whole model on CPU; a stage takes part
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    shapes = {n: q.shape for n, q in gpt.named_parameters()}
    stage = Stage(gpt, d.rank, bounds).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    run = Run(d, args, {"model": stage, "optim": opt})
    prev, nxt = (d.rank - 1 if d.rank > 0 else None), (d.rank + 1 if d.rank < p - 1 else None)
    act_shape = (
        args.batch_size // m,
        args.seq_len,
        args.d_model,
    )  # (b, T, D): what crosses a stage boundary
    comm = CommCounter()
    held = HeldForB(d, args, stage)
    count_at = max(run.start, args.steps - 2)
    # NCCL sets up its communicator at the first collective; batched point-to-point must not come
    # first
    dist.all_reduce(torch.zeros(1, device=d.device))
    for step in run.steps():
        # (B, T) global batch, on CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        # tokens of the global batch (on CPU): every micro-batch loss divides by it
        n_tok = count_tokens(y)
        # m x (b, T), b = B/m: first stage
        xs = micro_batches(x, m, d.device) if prev is None else [None] * m
        # their targets: last stage
        ys = micro_batches(y, m, d.device) if nxt is None else [None] * m
        opt.zero_grad(set_to_none=True)
        watched = step == args.steps - 1  # the last step is timed and its bytes held for B measured
        with run.watching(step, comm, at=count_at):
            loss = gpipe_step(
                stage,
                xs,
                ys,
                lambda logits, targets: lm_loss(logits, targets, n_tok),
                prev,
                nxt,
                act_shape,
                args.recompute,
                observe=held if watched else None,
            )
        # 3. after the flush, one optimizer step: the norm of the whole model from every stage's
        #   squared norm, and the batch loss that only the last stage knows, in one all-reduce of
        #   two numbers
        grads = [q.grad for q in stage.parameters()]
        both = torch.stack([squared_norm(grads), loss])  # (2,) this stage's part
        dist.all_reduce(both)  # (2,) sums over stages: squared norm of the whole model, batch loss
        clip_grads_(grads, both[0].sqrt(), args.clip)
        opt.step()
        run.end_step(step, both[1].item())

    # --- report: the last step's figures; the peak is read before --check trains ---
    counted = state_bytes(stage, opt)
    figures, sent = report(d, args, bounds, act_shape, dtype, held, comm.total(op="send"), counted)
    figures.update(split=bounds, stages=p, microbatches=m, recompute=args.recompute)
    peak = peak_memory_bytes(d, counted + held.live.peak)
    check = None
    if args.check:  # the full model, by name, from every stage's parameters (one all-reduce)
        full = assemble_full(d, dict(stage.named_parameters()), shapes, dtype)
        check = check_against_reference(d, args, run.losses, full)
    run.finish("gpipe", peak, max(sent), check, figures)


# --- measurement ---
# The last step is the one reported: timed and its bytes held for B measured (HeldForB, the
# schedule's observe callback in it only). The bytes sent are counted by harness.CommCounter, which
# sends every op through Python: one step earlier when there is one, to keep that cost out of the
# timed step (every step sends the same).
class HeldForB(PipelineWatch):
    """harness.PipelineWatch (--stage-ms: each F waits that, each B twice) that also measures the
    activation bytes held for B: saved-tensor hooks around every op register what autograd saves
    (parameters excluded), module hooks each stage input and output (what the schedule holds itself;
    the last stage's 0-dim loss, one number, is not seen), weakly, per micro-batch (LiveStorages): a
    graph freed by its B, or never built (a recomputing F), drops out by itself. Sampled as each F
    ends and as each B first unpacks a saved tensor, when its whole graph is alive: .live.peak
    (bytes), .full_bytes (the most one op registered: one micro-batch's input, saved tensors and
    output), .input_bytes (the largest stage input), .alive (micro-batches whose F's storages are
    alive)."""

    def __init__(self, d, args, stage):
        super().__init__(d, {"F": args.stage_ms, "B": 2 * args.stage_ms})
        self.of_mb, self.mine = (
            {},
            None,
        )  # what each micro-batch's F registered; the observed op's (or None)
        self.input_bytes = 0
        self.full_bytes = 0
        self.in_b = False

        def pre(_, args):  # a stage input: (b, T) token ids or (b, T, D)
            self.input_bytes = max(self.input_bytes, tensor_bytes(args[:1]))
            self.hold(args[0])

        stage.register_forward_pre_hook(pre)
        stage.register_forward_hook(lambda _, args, out: self.hold(out))

    def hold(self, t):  # inside an observed op only: the hooks stay on the stage for every step
        if self.mine is not None:
            self.live.add(t)
            self.mine.add(t)

    def saving(self, kind):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, t):
        if not is_parameter(t):
            self.hold(t)
        return t

    def unpack(self, t):
        if self.in_b:  # this B's first
            self.sample()
        return t

    # the peak (kept in self.live.peak), one op's full set, the micro-batches alive
    def sample(
        self,
    ):
        self.live.alive()
        self.full_bytes, self.in_b = max(self.full_bytes, self.mine.alive()), False
        self.alive = max(self.alive, sum(s.alive() > 0 for s in self.of_mb.values()))

    def before(self, kind, mb):
        self.mine, self.in_b = LiveStorages(), kind == "B"
        if kind == "F":
            self.of_mb[mb] = self.mine

    def after(self, kind, mb):
        if kind == "F":
            self.sample()
        self.mine = None  # (between ops, and in the steps not observed, nothing is registered)


def report(d, args, bounds, act_shape, dtype, held, sent, counted):
    """Every rank's last-step figures and events on every rank (rows of numbers: no object
    collective); rank 0 prints them beside their theory. Returns (figures, bytes sent per rank)."""
    p, m = d.world, args.microbatches
    mine = [held.alive, held.live.peak, held.input_bytes, held.full_bytes]
    rows = gather_rows(d, [mine + [sent, counted]])
    alive, peak, inp, full, sent, state = (
        list(c) for c in zip(*(map(int, r[0].tolist()) for r in rows))
    )
    events = held.timeline.gather()
    if not events:  # a resumed run that had no step left to run
        return {}, sent
    lo = min(e["start"] for e in events)  # the step's first F: its time 0
    events = [dict(e, start=e["start"] - lo, end=e["end"] - lo) for e in events]
    end = max(e["end"] for e in events)  # the flush: the last B anywhere
    busy = [busy_ms(events, r, 0, end) for r in range(p)]
    bubble, theory = [1 - b / end for b in busy], (p - 1) / (m + p - 1)
    # Theory, a formula on measured parts: held for B per stage, m full sets without
    # re-materialisation, m stage inputs + one full set (during its B) with it; sent, one (b, T, D)
    # per micro-batch and direction.
    without, with_rc = [m * f for f in full], [m * i + f - i for i, f in zip(inp, full)]
    one = torch.Size(act_shape).numel() * dtype.itemsize
    sent_theory = [m * one * ((r > 0) + (r < p - 1)) for r in range(p)]
    mean = sum(bubble) / p
    figures = dict(
        events=events,
        bubble=bubble,
        bubble_mean=mean,
        bubble_theory=theory,
        bubble_theory_formula="(p-1)/(m+p-1)",
        stage_ms=args.stage_ms,
        peak_alive_microbatches=alive,
        peak_alive_theory=m,
        saved_activation_bytes=peak,
        saved_activation_bytes_without_recompute=without,
        saved_activation_bytes_with_recompute=with_rc,
        sent_bytes_per_rank=sent,
        sent_bytes_theory=sent_theory,
        busy_ms=busy,
        step_ms_last=end,
        state_bytes=state,
    )
    d.log(
        "\nlast step, measured per stage (theory: bubble (p-1)/(m+p-1), alive m, sent m x (b, T, "
        "D) a way)\nstage | blocks | busy ms | bubble | theory | alive | theory | held for B | "
        "sent bytes | theory"
    )
    for r, (a, z) in enumerate(bounds):
        d.log(
            f"{r:5d} | {a:2d}..{z - 1:<2d} | {busy[r]:7.2f} | {bubble[r]:6.3f} | {theory:6.3f} | "
            f"{alive[r]:5d} | {m:6d} | {peak[r]:10d} | {sent[r]:10d} | {sent_theory[r]:6d}"
        )
    ms = args.stage_ms
    why = (
        f"--stage-ms {ms:g}: compute time simulated, each F waits {ms:g} ms, each B {2 * ms:g} ms"
        if ms
        else "real compute only: on shared cores this times the OS scheduler; try --stage-ms"
    )
    d.log(
        f"bubble, mean over stages: measured {mean:.3f}, theory (p-1)/(m+p-1) = {theory:.3f}, "
        f"difference {mean - theory:+.3f} ({why})"
    )
    d.log(
        f"activation bytes held for B per stage, peak, measured from the live storages: {peak}; "
        f"theory from the measured parts: without --recompute m x full set = {without}, with it m "
        f"x input + one full set = {with_rc}"
    )
    label = lambda e: f"{e['kind']}{e['mb']}"  # noqa: E731
    d.log(
        f"\ntimeline of the last step, measured ({m} micro-batches, {p} stages):\n"
        + draw_timeline(events, p, 0, end, label)
    )
    if args.trace and d.rank == 0:
        write_trace(args.trace, events, label)
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return figures, sent


if __name__ == "__main__":
    main()
