"""gpipe.py: GPipe pipeline parallelism: p stages, m micro-batches, all forwards, then all backwards.

GPipe (Huang et al., "GPipe: Efficient Training of Giant Neural Networks using Pipeline Parallelism",
NeurIPS 2019) cuts the model into p consecutive stages, one per device, and the global batch into m
micro-batches. Every stage runs the forward (F) of all m micro-batches, handing activations to the next
stage, then the backward (B) of all m, handing gradients back; the m micro-batch gradients add up to the
full-batch gradient, so the one optimizer step after this "flush" is exactly one-process training
(Sec. 2.2). The price is the bubble: with equal F and B times a stage idles (p-1)/(m+p-1) of the step
(Sec. 2.3). B runs here in the order F ran; any order gives the same sum and the same bubble.

    p = 4, m = 4 (B drawn as long as F)                       time ->
    stage 0   F0 F1 F2 F3 .. .. .. .. .. .. B0 B1 B2 B3     embedding + blocks
    stage 1   .. F0 F1 F2 F3 .. .. .. .. B0 B1 B2 B3 ..     blocks
    stage 2   .. .. F0 F1 F2 F3 .. .. B0 B1 B2 B3 .. ..     blocks
    stage 3   .. .. .. F0 F1 F2 F3 B0 B1 B2 B3 .. .. ..     blocks + final norm + head + loss
              idle ("..") = 6 of 14 slots per stage = (p-1)/(m+p-1), the bubble; then one optimizer step

Between its F and its B a micro-batch's activations stay alive, so a stage holds all m of them at the flush.
--recompute is the paper's re-materialisation (Sec. 2.3, after Chen et al. 2016): F keeps only the stage
input of each micro-batch, and B reruns the stage's forward from it first: the same numbers for about one
extra forward, with m stage inputs plus one micro-batch's activations alive instead of m full sets.

The run measures every F and B (start, end) on every stage, prints the bubble beside its theory, the peak
number of micro-batches alive, the activation bytes held for backward, and an ASCII timeline of the last step
drawn from the measured events; --trace writes the same events for Perfetto / chrome://tracing. On a laptop,
processes that share a few cores time the operating system's scheduling, not the schedule: --stage-ms F
simulates compute time (each F also waits F ms, each B 2F ms; the numbers computed are unchanged), so the
measured bubble approaches its theory and the timeline looks like the picture above.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --stage-ms 30 --steps 3   # simulated compute: the bubble
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --recompute --trace gpipe_trace.json
    torchrun --nproc_per_node=3 gpipe.py --n-layers 4 --dtype float64 --check   # uneven split: 2 + 1 + 1 blocks
In production, use torch.distributed.pipelining (ScheduleGPipe), or DeepSpeed's / Megatron-LM's pipelines.
"""
import json
import sys
import time
import weakref
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData)
from harness import (assemble_full, check_against_reference, check_common_args, Checkpointer, CommonArgs,
                     env_world_size, gather_rows, log_step, maybe_fail, parse_args, peak_memory_bytes,
                     state_bytes, StepTimer, tensor_bytes, write_summary)


@dataclass
class Args(CommonArgs):
    microbatches: int = 4  # m: micro-batches per global batch (--batch-size must be divisible by it)
    recompute: bool = False  # re-materialisation: keep each micro-batch's stage input only, rerun F during B
    trace: str = ""  # write the last step's measured F/B events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute time: each F of a micro-batch also waits this many ms, each B twice that


# ----------------------------------------------------------------------------- the stages
def split_layers(n_layers, p):
    """Blocks [start, end) of each of p stages, as even as possible; when p does not divide n_layers the
    earlier stages take one block more (the last stage already carries the head and the loss)."""
    base, extra = divmod(n_layers, p)
    bounds, start = [], 0
    for s in range(p):
        end = start + base + (s < extra)
        bounds.append((start, end))
        start = end
    return bounds


class Stage(nn.Module):
    """Stage s of p: blocks [start, end) of the GPT, the embedding on the first stage, the final LayerNorm and
    LM head on the last. Taken from the full seeded model, so every stage starts from the reference's numbers;
    the ModuleDict keeps the GPT's own names (`blocks.3.mlp.fc.weight`), so the stages' parameters put
    together are exactly `GPT.named_parameters()`."""

    def __init__(self, gpt, s, bounds):
        super().__init__()
        (start, end), self.first, self.last = bounds[s], s == 0, s == len(bounds) - 1
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(start, end)})
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h):  # first stage: (b, T) token ids; others: (b, T, D) from the stage before
        if self.first:  # = GPT.embed
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V); others: (b, T, D)


# ----------------------------------------------------------------------------- point-to-point
def p2p(sends=(), recvs=()):
    """Send [(tensor, peer)] and receive [(tensor, peer)] as one batch_isend_irecv, and wait. Batched, a send
    and a receive between the same two ranks cannot deadlock under NCCL. GPipe never needs both at once (each
    phase flows one way), but every transfer goes through here so the rule holds everywhere."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    for req in dist.batch_isend_irecv(ops):
        req.wait()  # on a GPU: the compute stream waits for the transfer; the host does not


# ----------------------------------------------------------------------------- the GPipe schedule
def run_forward(forward, i, recompute):
    """F of micro-batch i: with its graph, which the caller keeps until B; or, with re-materialisation, under
    no_grad, so nothing is saved for backward and B reruns it from the stage input."""
    with torch.no_grad() if recompute else nullcontext():
        return forward(i)


def gpipe_step(d, stage, xs, ys, n_tok, act_shape, args, clock):
    """One global batch on this stage: F of micro-batches 0..m-1, then B of 0..m-1 (the flush), leaving the
    whole batch's gradient summed in .grad. xs, ys: m x (b, T) micro-batches (b = B/m), global on CPU.
    Returns (the sum of this stage's micro-batch losses, 0 except on the last stage; events; stats)."""
    prev, nxt, m, recompute = d.rank - 1, d.rank + 1, len(xs), args.recompute
    cuda, dtype = d.device.type == "cuda", next(stage.parameters()).dtype
    inputs, outputs, rng = [None] * m, [None] * m, [None] * m
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    events, held = [], HeldBytes()  # held: every activation saved for backward in this step, measured alive
    stats = dict(peak_alive=0, peak_bytes=0, input_bytes=0, full_bytes=0, sent_bytes=0)

    def forward(i):  # the stage's forward of micro-batch i; on the last stage, its loss
        out = stage(inputs[i])
        if not stage.last:
            return out  # (b, T, D)
        y = ys[i].to(d.device, copy=True)  # (b, T) its own storage, not a view of the whole batch's
        return lm_loss(out, y, n_tok)  # sum over the micro-batch's tokens / tokens of the global batch

    # 1. all forwards. F of micro-batch i starts when its input has arrived from stage s-1.
    for i in range(m):
        if stage.first:
            inputs[i] = xs[i].to(d.device, copy=True)  # (b, T) token ids, its own storage like a received input
        else:
            inputs[i] = torch.empty(act_shape, dtype=dtype, device=d.device)  # (b, T, D) from stage s-1
            p2p(recvs=[(inputs[i], prev)])
            inputs[i].requires_grad_()  # a leaf: its .grad is what B sends back to stage s-1
        if recompute:  # where the RNG stood, so that B's rerun draws the same dropout masks
            rng[i] = (torch.get_rng_state(), torch.cuda.get_rng_state(d.device) if cuda else None)
        start, mine = clock.now(), HeldBytes()
        with mine.saving():
            out = run_forward(forward, i, recompute)
        simulate_compute(args.stage_ms)
        events.append(dict(kind="F", mb=i, start=start, end=clock.now()))
        if stage.last:
            loss_sum += out.detach()
        else:
            p2p(sends=[(out.detach(), nxt)])  # (b, T, D) to stage s+1
            stats["sent_bytes"] += out.numel() * out.element_size()
        outputs[i] = None if recompute else out  # micro-batch i keeps its graph until B, or only its input
        held.add(mine)
        stats.update(peak_alive=max(stats["peak_alive"], sum(t is not None for t in inputs)),
                     input_bytes=max(stats["input_bytes"], tensor_bytes([inputs[i]])),
                     peak_bytes=max(stats["peak_bytes"], held.alive(*inputs, *outputs)))
        if not recompute:
            stats["full_bytes"] = max(stats["full_bytes"], mine.alive(inputs[i], out))  # one micro-batch's set

    # 2. all backwards, in the same order. B of micro-batch i starts when d loss / d output has arrived.
    for i in range(m):
        grad = None  # last stage: B starts from the loss itself (d loss / d loss = 1)
        if not stage.last:
            grad = torch.empty(act_shape, dtype=dtype, device=d.device)  # (b, T, D) from stage s+1
            p2p(recvs=[(grad, nxt)])
        start = clock.now()
        out = outputs[i]
        if recompute:  # Sec. 2.3: rerun F from the kept input, this time keeping the graph, with the same
            # dropout masks: replay the RNG state F started from (as torch.utils.checkpoint does)
            mine = HeldBytes()
            with torch.random.fork_rng(devices=[d.device] if cuda else []), mine.saving():
                torch.set_rng_state(rng[i][0])
                if cuda:
                    torch.cuda.set_rng_state(rng[i][1], d.device)
                out = forward(i)
            held.add(mine)  # measured now: the kept inputs and this one rerun graph are alive
            stats["peak_bytes"] = max(stats["peak_bytes"], held.alive(*inputs, out))
            stats["full_bytes"] = max(stats["full_bytes"], mine.alive(inputs[i], out))
        torch.autograd.backward(out, grad)  # adds micro-batch i's gradient into every .grad of the stage
        simulate_compute(2 * args.stage_ms)
        events.append(dict(kind="B", mb=i, start=start, end=clock.now()))
        if not stage.first:
            g = inputs[i].grad  # (b, T, D) d loss / d input, to stage s-1
            p2p(sends=[(g, prev)])
            stats["sent_bytes"] += g.numel() * g.element_size()
        inputs[i] = outputs[i] = rng[i] = out = None  # the graph and all of micro-batch i's activations go now
    return loss_sum, events, stats


# --- measurement ---
class Clock:
    """Times of F and B in ms since one zero common to all stages. CPU: the wall clock, zeroed at the wall time
    the last rank arrived (perf_counter's origin differs per process; a barrier's exit skew, milliseconds on a
    busy host, would draw a receive before its send). CUDA: events recorded on the stream, so timing never
    stops the host or the stream; the zero is an event right after an all-reduce, which ends at about the same
    moment on every GPU. `read` turns a step's stamps into ms: one synchronize per step, none per op."""

    def __init__(self, d):
        self.d, self.cuda = d, d.device.type == "cuda"

    def start(self):
        t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=self.d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # also lines the ranks up, like a barrier
        if self.cuda:
            self.zero = self.now()
        else:
            self.t0 = t.item()

    def now(self):
        if not self.cuda:
            return time.time() * 1e3 - self.t0
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self, events):
        if self.cuda:
            torch.cuda.synchronize(self.d.device)
            for e in events:
                e["start"], e["end"] = (self.zero.elapsed_time(e[k]) for k in ("start", "end"))
        return events


def simulate_compute(ms):
    """--stage-ms: wait, not compute, so that the schedule sets the timing rather than processes competing for
    a few cores. On a GPU the host waits before the end event is recorded, so the stream's span covers it."""
    if ms > 0:
        time.sleep(ms / 1e3)


class HeldBytes:
    """Activation bytes alive for backward, measured: a pack hook (autograd passes every tensor it saves
    through it) keeps a weak reference to each saved activation (parameters and views of them excluded). A
    graph freed by its B, or never built (--recompute's F), drops out by itself; `alive(*held)` counts the
    storages still referenced, plus the tensors the schedule holds itself (inputs, outputs), each once."""

    def __init__(self):
        self.refs = []

    def _pack(self, t):
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)):
            self.refs.append(weakref.ref(t))
        return t

    def saving(self):
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self, other):
        self.refs += other.refs

    def alive(self, *held):
        saved = [t for t in (r() for r in self.refs) if t is not None]
        self.refs = [weakref.ref(t) for t in saved]
        return tensor_bytes(saved + [t for t in held if t is not None])

def draw_timeline(events, p, max_cols=150):
    """One row per stage, to scale, from the measured events: `F3` / `B3` where micro-batch 3's forward /
    backward ran (then blank to its end), `.` where the stage sat idle."""
    end = max(e["end"] for e in events)
    shortest = max(min(e["end"] - e["start"] for e in events), 1e-6)
    cols = max(40, min(max_cols, int(3 * end / shortest)))  # the shortest event gets about 3 columns
    ms_per_col = end / cols
    rows = []
    for r in range(p):
        row = ["."] * cols
        for e in sorted((e for e in events if e["rank"] == r), key=lambda e: e["start"]):
            a = min(int(e["start"] / ms_per_col), cols - 1)
            b = max(a + 1, min(cols, round(e["end"] / ms_per_col)))
            row[a:b] = list(f"{e['kind']}{e['mb']}".ljust(b - a)[:b - a])
        rows.append(f"stage {r} |{''.join(row)}|")
    rows.append(f"{'':8}0 ms{f'{end:.1f} ms':>{cols - 2}}")
    return "\n".join(rows)


def write_trace(path, events, p):
    """Chrome trace format: one complete event ("ph": "X", times in microseconds) per F and B, one process per
    stage. Open in https://ui.perfetto.dev or chrome://tracing."""
    trace = [dict(name=f"{e['kind']}{e['mb']}", cat="forward" if e["kind"] == "F" else "backward", ph="X",
                  ts=1e3 * e["start"], dur=1e3 * (e["end"] - e["start"]), pid=e["rank"], tid=0, args=dict(mb=e["mb"]))
             for e in events]
    trace += [dict(name="process_name", ph="M", pid=r, tid=0, args=dict(name=f"stage {r}")) for r in range(p)]
    with open(path, "w") as f:
        json.dump(dict(traceEvents=trace, displayTimeUnit="ms"), f)


def report(d, args, events, stats, counted, bounds, act_shape, dtype):
    """Every rank's last-step events and counters, gathered as rows of numbers (no object collective), on
    every rank; rank 0 prints them beside their theory. Returns (figures, bytes sent per rank)."""
    p, m = d.world, args.microbatches
    rows = [[d.rank, e["kind"] == "B", e["mb"], e["start"], e["end"]] for e in events]
    ev = gather_rows(d, rows if rows else torch.zeros(0, 5))  # per rank: (2m, 5) rows, or none after a resume
    keys = ["peak_alive", "peak_bytes", "input_bytes", "full_bytes", "sent_bytes"]
    st = [dict(zip(keys + ["state"], map(int, r[0].tolist())))
          for r in gather_rows(d, [[(stats or {}).get(k, 0) for k in keys] + [counted]])]
    sent, figures = [s["sent_bytes"] for s in st], {}
    all_events = [dict(rank=int(r), kind="FB"[int(b)], mb=int(i), start=a, end=z)
                  for rank_rows in ev for r, b, i, a, z in rank_rows.tolist()]
    if not all_events:
        return figures, sent
    end = max(e["end"] for e in all_events)  # the flush: the last B anywhere
    busy = [sum(e["end"] - e["start"] for e in all_events if e["rank"] == r) for r in range(p)]
    bubble, theory = [1 - b / end for b in busy], (p - 1) / (m + p - 1)
    # Theory (a formula on measured parts, not a measurement): held for B per stage, m full sets without
    # re-materialisation, m stage inputs + one full set (during its B) with it.
    without = [m * s["full_bytes"] for s in st]
    with_rc = [m * s["input_bytes"] + s["full_bytes"] - s["input_bytes"] for s in st]
    b = act_shape[0] * act_shape[1] * act_shape[2] * torch.tensor([], dtype=dtype).element_size()
    sent_theory = [m * b * ((r > 0) + (r < p - 1)) for r in range(p)]  # one (b, T, D) per micro-batch, direction
    mean = sum(bubble) / p
    figures.update(
        events=all_events, bubble=bubble, bubble_mean=mean, bubble_theory=theory,
        bubble_theory_formula="(p-1)/(m+p-1)", stage_ms=args.stage_ms,
        peak_alive_microbatches=[s["peak_alive"] for s in st], peak_alive_theory=m,
        saved_activation_bytes=[s["peak_bytes"] for s in st], saved_activation_bytes_without_recompute=without,
        saved_activation_bytes_with_recompute=with_rc, sent_bytes_per_rank=sent, sent_bytes_theory=sent_theory,
        busy_ms=busy, step_ms_last=end, state_bytes=[s["state"] for s in st])
    d.log("\nlast step, measured per stage (theory: bubble (p-1)/(m+p-1), alive m, sent m x (b, T, D) each way)")
    d.log("stage | blocks | busy ms | bubble | theory | alive | theory | held for B, bytes | sent bytes | theory")
    for r, (a, z) in enumerate(bounds):
        d.log(f"{r:5d} | {a:2d}..{z - 1:<2d} | {busy[r]:7.2f} | {bubble[r]:6.3f} | {theory:6.3f} | "
              f"{st[r]['peak_alive']:5d} | {m:6d} | {st[r]['peak_bytes']:17d} | {sent[r]:10d} | {sent_theory[r]:6d}")
    d.log(f"bubble, mean over stages: measured {mean:.3f}, theory (p-1)/(m+p-1) = {theory:.3f}, difference "
          f"{mean - theory:+.3f}" + (f" (--stage-ms {args.stage_ms:g}: compute time simulated, each F waits "
                                     f"{args.stage_ms:g} ms, each B {2 * args.stage_ms:g} ms)" if args.stage_ms else
                                     " (real compute only: on shared cores this times the OS scheduler; try --stage-ms)"))
    d.log(f"activation bytes held for B per stage, peak, measured from the live storages: "
          f"{figures['saved_activation_bytes']}; theory from the measured parts: without --recompute m x full set = "
          f"{without}, with it m x input + one full set = {with_rc}")
    d.log(f"\ntimeline of the last step, measured ({m} micro-batches, {p} stages):")
    d.log(draw_timeline(all_events, p))
    if args.trace and d.rank == 0:
        write_trace(args.trace, all_events, p)
        d.log(f"wrote {len(all_events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return figures, sent


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    p, m = env_world_size(), args.microbatches  # p: stages = processes; m: micro-batches
    check_common_args(args)
    if m < 1:
        fail(f"--microbatches must be >= 1, got {m}")
    if args.batch_size % m:
        fit = max(k for k in range(1, m) if args.batch_size % k == 0)
        fail(f"--batch-size {args.batch_size} is not divisible by --microbatches {m}: use --microbatches {fit} "
             f"or --batch-size {(args.batch_size // m + 1) * m}")
    if p == 1:
        nproc = max(2, min(4, args.n_layers))
        fail(f"gpipe.py needs one process per stage, at least 2: torchrun --nproc_per_node={nproc} gpipe.py "
             f"{' '.join(sys.argv[1:])}".rstrip())
    if p > args.n_layers:
        fewer = f", or torchrun --nproc_per_node={args.n_layers}" if args.n_layers >= 2 else ""
        fail(f"{p} stages but --n-layers {args.n_layers}: every stage needs at least one block; use --n-layers {p} "
             f"or more{fewer}")

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, p)
    d.log(f"gpipe.py: {p} stages x {m} micro-batches of {args.batch_size // m} sequences on {d.backend}"
          f"{', --recompute' if args.recompute else ''}; entropy floor {data.entropy:.4f} nats/token")
    d.log("split: " + " | ".join(f"stage {s}: {'embedding + ' if s == 0 else ''}blocks {a}..{b - 1}"
                                 f"{' + norm + head + loss' if s == p - 1 else ''}" for s, (a, b) in enumerate(bounds)))
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per stage
    dtype = DTYPES[args.dtype]
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)  # the full model on CPU; a stage moves its part
    shapes = {n: q.shape for n, q in gpt.named_parameters()}
    stage = Stage(gpt, d.rank, bounds).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": stage, "optim": opt})
    losses, events, stats = hist.get("losses", []), [], None
    act_shape = (args.batch_size // m, args.seq_len, args.d_model)  # (b, T, D): what crosses a stage boundary
    timer, tokens, clock = StepTimer(d.device), args.batch_size * args.seq_len, Clock(d)

    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, on CPU
        n_tok = count_tokens(y)  # tokens of the whole global batch: every micro-batch loss divides by it
        opt.zero_grad(set_to_none=True)
        clock.start()  # the timeline's zero; a collective before any point-to-point, as NCCL's batched p2p asks
        loss, events, stats = gpipe_step(d, stage, x.chunk(m), y.chunk(m), n_tok, act_shape, args, clock)
        # 3. after the flush, one optimizer step: the norm of the whole model from every stage's squared norm,
        # and the batch loss that only the last stage knows, in one all-reduce of two numbers
        grads = [q.grad for q in stage.parameters()]
        both = torch.stack([sum((g.double() ** 2).sum() for g in grads), loss])  # (2,) this stage's part
        dist.all_reduce(both)  # (2,) sums over stages: squared norm of the whole model, batch loss
        clip_grads_(grads, both[0].sqrt(), args.clip)
        opt.step()
        losses.append(both[1].item())
        events = clock.read(events)
        log_step(d, step, losses[-1], timer.stop(), tokens)
        ckpt.maybe_save(step + 1, {"model": stage, "optim": opt}, {"losses": losses})

    # --- measurement: the last step's timeline and figures; the peak is read before --check trains ---
    counted = state_bytes(stage, opt)
    figures, sent = report(d, args, events, stats, counted, bounds, act_shape, dtype)
    figures.update(split=bounds, stages=p, microbatches=m, recompute=args.recompute)
    peak = peak_memory_bytes(d, counted + (stats["peak_bytes"] if stats else 0))
    check = None
    if args.check:  # the full model, by name, from every stage's parameters (one all-reduce)
        full = assemble_full(d, dict(stage.named_parameters()), shapes, dtype)
        check = check_against_reference(d, args, losses, full)
    write_summary(d, args, "gpipe", losses, timer.median(), tokens / max(timer.median(), 1e-9) * 1e3,
                  peak, max(sent), check, figures)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
