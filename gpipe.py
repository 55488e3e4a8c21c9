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
drawn from the measured events; --trace writes the same events for Perfetto / chrome://tracing.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8
    torchrun --nproc_per_node=4 gpipe.py --microbatches 8 --recompute --trace gpipe_trace.json
    torchrun --nproc_per_node=3 gpipe.py --n-layers 4 --dtype float64 --check   # uneven split: 2 + 1 + 1 blocks
In production, use torch.distributed.pipelining (ScheduleGPipe), or DeepSpeed's / Megatron-LM's pipelines.
"""
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (DTYPES, build_gpt, check_against_reference, check_common_args, Checkpointer, clip_grads_,
                    close_dist, CommonArgs, count_tokens, env_world_size, fail, GPTConfig, init_dist, lm_loss,
                    log_step, make_optimizer, MarkovData, maybe_fail, parse_args, peak_memory_bytes,
                    SavedActivations, state_bytes, StepTimer, write_summary)


@dataclass
class Args(CommonArgs):
    microbatches: int = 4  # m: micro-batches per global batch (--batch-size must be divisible by it)
    recompute: bool = False  # re-materialisation: keep each micro-batch's stage input only, rerun F during B
    trace: str = ""  # write the last step's measured F/B events as a Chrome trace (JSON) to this path


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


# ----------------------------------------------------------------------------- measuring
class HeldBytes(SavedActivations):
    """common.SavedActivations (the bytes autograd saves for backward, parameters excluded, each storage once),
    plus `total(*tensors)`: the same with the stage input and output added, each storage still counted once."""

    def total(self, *tensors):
        extra = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
        return self.bytes + sum(n for ptr, n in extra.items() if ptr not in self._seen)


def common_start(d):
    """One zero (ms) for every rank's clock: the wall time at which the last rank arrived, so nothing can start
    before it. (A barrier followed by each rank's own perf_counter leaves the zeros apart by the barrier's exit
    skew, milliseconds on a busy host: enough to draw a receive before its send. perf_counter's origin also
    differs between hosts; wall clocks agree to within NTP's accuracy.)"""
    t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # also lines the ranks up, like a barrier
    return t.item()


def clock(d, t0):
    """ms since the common start; on a GPU after the queued kernels finish, so an event ends when its work did."""
    if d.device.type == "cuda":
        torch.cuda.synchronize(d.device)
    return time.time() * 1e3 - t0


# ----------------------------------------------------------------------------- point-to-point
def p2p(sends=(), recvs=()):
    """Send [(tensor, peer)] and receive [(tensor, peer)] as one batch_isend_irecv, and wait. Batched, a send
    and a receive between the same two ranks cannot deadlock under NCCL. GPipe never needs both at once (each
    phase flows one way), but every transfer goes through here so the rule holds everywhere."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    for req in dist.batch_isend_irecv(ops):
        req.wait()


# ----------------------------------------------------------------------------- the GPipe schedule
def gpipe_step(d, stage, xs, ys, n_tok, act_shape, recompute, t0):
    """One global batch on this stage: F of micro-batches 0..m-1, then B of 0..m-1 (the flush), leaving the
    whole batch's gradient summed in .grad. xs, ys: m x (b, T) micro-batches (b = B/m), global on CPU.
    Returns (the sum of this stage's micro-batch losses, 0 except on the last stage; events; stats)."""
    prev, nxt, m = d.rank - 1, d.rank + 1, len(xs)
    params, cuda = list(stage.parameters()), d.device.type == "cuda"
    dtype = params[0].dtype
    inputs, outputs, rng, held = [None] * m, [None] * m, [None] * m, [0] * m
    loss_sum = torch.zeros((), dtype=torch.float64, device=d.device)
    events, alive, alive_bytes = [], 0, 0
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
        start = clock(d, t0)
        with torch.no_grad() if recompute else nullcontext(), HeldBytes() as saved:
            out = forward(i)
        events.append(dict(rank=d.rank, kind="F", mb=i, start=start, end=clock(d, t0)))
        if stage.last:
            loss_sum += out.detach()
        else:
            p2p(sends=[(out.detach(), nxt)])  # (b, T, D) to stage s+1
            stats["sent_bytes"] += out.numel() * out.element_size()
        # What micro-batch i holds until its B: everything (input, saved tensors, output), or only its input.
        outputs[i] = None if recompute else out
        held[i] = saved.total(inputs[i]) if recompute else saved.total(inputs[i], out)
        alive, alive_bytes = alive + 1, alive_bytes + held[i]
        stats["peak_alive"] = max(stats["peak_alive"], alive)
        stats["peak_bytes"] = max(stats["peak_bytes"], alive_bytes)
        stats["input_bytes"] = max(stats["input_bytes"], inputs[i].untyped_storage().nbytes())

    # 2. all backwards, in the same order. B of micro-batch i starts when d loss / d output has arrived.
    for i in range(m):
        grad = None  # last stage: B starts from the loss itself (d loss / d loss = 1)
        if not stage.last:
            grad = torch.empty(act_shape, dtype=dtype, device=d.device)  # (b, T, D) from stage s+1
            p2p(recvs=[(grad, nxt)])
        start = clock(d, t0)
        out = outputs[i]
        if recompute:  # Sec. 2.3: rerun F from the kept input, this time keeping the graph, with the same
            # dropout masks: replay the RNG state F started from (as torch.utils.checkpoint does)
            with torch.random.fork_rng(devices=[d.device] if cuda else []), HeldBytes() as saved:
                torch.set_rng_state(rng[i][0])
                if cuda:
                    torch.cuda.set_rng_state(rng[i][1], d.device)
                out = forward(i)
            full = saved.total(inputs[i], out)  # what F would have kept without re-materialisation
            stats["peak_bytes"] = max(stats["peak_bytes"], alive_bytes - held[i] + full)  # held[i]: the input
            stats["full_bytes"] = max(stats["full_bytes"], full)
        torch.autograd.backward(out, grad)  # adds micro-batch i's gradient into every .grad of the stage
        events.append(dict(rank=d.rank, kind="B", mb=i, start=start, end=clock(d, t0)))
        if not stage.first:
            g = inputs[i].grad  # (b, T, D) d loss / d input, to stage s-1
            p2p(sends=[(g, prev)])
            stats["sent_bytes"] += g.numel() * g.element_size()
        inputs[i] = outputs[i] = rng[i] = None  # the graph and all of micro-batch i's activations go now
        alive, alive_bytes = alive - 1, alive_bytes - held[i]
    if not recompute:
        stats["full_bytes"] = max(held)
    return loss_sum, events, stats


# ----------------------------------------------------------------------------- the picture and the trace
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
    stage = Stage(build_gpt(GPTConfig.from_args(args), args.seed, dtype), d.rank, bounds).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": stage, "optim": opt})
    losses, events, stats = hist.get("losses", []), [], None
    act_shape = (args.batch_size // m, args.seq_len, args.d_model)  # (b, T, D): what crosses a stage boundary
    timer, tokens = StepTimer(d.device), args.batch_size * args.seq_len

    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, on CPU
        n_tok = count_tokens(y)  # tokens of the whole global batch: every micro-batch loss divides by it
        opt.zero_grad(set_to_none=True)
        t0 = common_start(d)  # the timeline's zero; a collective before any point-to-point, as NCCL's batched p2p asks
        loss, events, stats = gpipe_step(d, stage, x.chunk(m), y.chunk(m), n_tok, act_shape, args.recompute, t0)
        # 3. after the flush, one optimizer step: the norm of the whole model from every stage's squared norm,
        # and the batch loss that only the last stage knows, in one all-reduce of two numbers
        grads = [q.grad for q in stage.parameters()]
        both = torch.stack([sum((g.double() ** 2).sum() for g in grads), loss])  # (2,) this stage's part
        dist.all_reduce(both)  # (2,) sums over stages: squared norm of the whole model, batch loss
        clip_grads_(grads, both[0].sqrt(), args.clip)
        opt.step()
        losses.append(both[1].item())
        log_step(d, step, losses[-1], timer.stop(), tokens)
        ckpt.maybe_save(step + 1, {"model": stage, "optim": opt}, {"losses": losses})

    # --- gather the last step's timeline and figures (every rank gets all; rank 0 prints) ---
    mine = dict(events=events, stats=stats, state_bytes=state_bytes(stage, opt))
    every = [None] * p
    dist.all_gather_object(every, mine)
    all_events = [e for r in every for e in r["events"]]
    figures, counted = dict(split=bounds, stages=p, microbatches=m, recompute=args.recompute), mine["state_bytes"]
    # comm bytes: what each rank's point-to-point sends carried in the step (activations down, gradients up);
    # the two-number all-reduce is not counted. comm_bytes in the summary is the largest, a middle stage's.
    sent = [r["stats"]["sent_bytes"] if r["stats"] else 0 for r in every]
    if all_events:  # (none when a resumed run had no step left)
        end = max(e["end"] for e in all_events)  # the flush: the last B anywhere
        busy = [sum(e["end"] - e["start"] for e in all_events if e["rank"] == r) for r in range(p)]
        bubble, theory = [1 - b / end for b in busy], (p - 1) / (m + p - 1)
        st = [r["stats"] for r in every]
        # Activation bytes a stage holds for backward, from its measured parts: m full sets without
        # re-materialisation; m stage inputs + one full set (during its B) with it.
        without = [m * s["full_bytes"] for s in st]
        with_rc = [m * s["input_bytes"] + s["full_bytes"] - s["input_bytes"] for s in st]
        b = act_shape[0] * act_shape[1] * act_shape[2] * torch.tensor([], dtype=dtype).element_size()
        sent_theory = [m * b * ((r > 0) + (r < p - 1)) for r in range(p)]  # one (b, T, D) per micro-batch, direction
        figures.update(
            events=all_events, bubble=bubble, bubble_mean=sum(bubble) / p, bubble_theory=theory,
            bubble_theory_formula="(p-1)/(m+p-1)", peak_alive_microbatches=[s["peak_alive"] for s in st],
            peak_alive_theory=m, saved_activation_bytes=[s["peak_bytes"] for s in st],
            saved_activation_bytes_without_recompute=without, saved_activation_bytes_with_recompute=with_rc,
            sent_bytes_per_rank=sent, sent_bytes_theory=sent_theory, busy_ms=busy, step_ms_last=end)
        counted += mine["stats"]["peak_bytes"]
        d.log("\nlast step, measured per stage (theory: bubble (p-1)/(m+p-1), alive m, sent m x (b, T, D) each way)")
        d.log("stage | blocks | busy ms | bubble | theory | alive | theory | held for B, bytes | sent bytes | theory")
        for r, (a, z) in enumerate(bounds):
            d.log(f"{r:5d} | {a:2d}..{z - 1:<2d} | {busy[r]:7.2f} | {bubble[r]:6.3f} | {theory:6.3f} | "
                  f"{st[r]['peak_alive']:5d} | {m:6d} | {st[r]['peak_bytes']:17d} | {sent[r]:10d} | "
                  f"{sent_theory[r]:6d}")
        d.log(f"activation bytes held for B per stage, peak: measured {figures['saved_activation_bytes']}; from the "
              f"measured parts: without --recompute m x full set = {without}, with it m x input + one full set = "
              f"{with_rc}")
        d.log(f"\ntimeline of the last step, measured ({m} micro-batches, {p} stages):")
        d.log(draw_timeline(all_events, p))
        if args.trace and d.rank == 0:
            write_trace(args.trace, all_events, p)
            d.log(f"wrote {len(all_events)} events to {args.trace} (open in https://ui.perfetto.dev)")

    check = None
    if args.check:  # the full model on rank 0, by name, from every stage's parameters
        parts = [None] * p if d.rank == 0 else None
        dist.gather_object({n: q.detach().cpu() for n, q in stage.named_parameters()}, parts, dst=0)
        full = {n: t for part in parts for n, t in part.items()} if d.rank == 0 else None
        check = check_against_reference(d, args, losses, full)
    write_summary(d, args, "gpipe", losses, timer.median(), tokens / max(timer.median(), 1e-9) * 1e3,
                  peak_memory_bytes(d, counted), max(sent), check, figures)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
