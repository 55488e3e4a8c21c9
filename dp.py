"""dp.py: naive data parallelism, written by hand, three ways to synchronise.

Every rank holds the whole model and a slice of the data. They differ in *when* ranks agree:

1. --mode sync (bulk synchronous; the idea behind PyTorch DDP, Horovod, Li et al. 2020)
   Broadcast the weights from rank 0 once, then every step: each rank runs forward + backward on its
   slice of the global batch, the gradients are summed over ranks (one all-reduce per parameter; see
   ddp_bucketed.py for the bucketed, overlapped version), and every rank takes the same optimizer step.
   Trade-off: the whole job runs at the speed of the slowest rank, and it equals one-process training.

       rank 0  [fwd b0|bwd b0]--all-reduce--[step]   every rank waits for the last one,
       rank 1  [fwd b1|bwd b1]--all-reduce--[step]   then all take the same step

2. --accum K (gradient accumulation: "synchronise every K micro-batches")
   Each rank runs K micro-batches, letting gradients add up in .grad, and all-reduces once after the
   last: K times fewer all-reduces for the same global batch, and activations for only B/(world*K)
   sequences alive at a time. The catch that two widely read repos get wrong: if each micro-batch loss is
   a *mean over its own tokens*, micro-batches with fewer real tokens (padding, ignore_index) weigh as much
   as full ones and the sum is not the full-batch gradient. Here every loss is a sum over tokens divided
   by the token count of the *whole global batch* (common.lm_loss), so the gradients of all micro-batches
   on all ranks simply add up, and the all-reduce is a SUM. (`--loss-norm per_microbatch` runs the wrong
   way on purpose, so the tests can show that --check catches it.)

3. --mode async (asynchronous parameter server; Dean et al. 2012 "Downpour SGD", Li et al. 2014)
   Rank 0 is the server: it holds the weights and the optimizer. Workers (ranks 1..N-1) pull weights,
   compute a gradient on a whole batch, push it, and never wait for each other; the server applies each
   gradient the moment it arrives, so it was computed on weights some versions old (stale).
   Trade-off: no worker waits for a straggler, but the update is W_{t+1} = W_t - lr * g(W_{t - s_t}) with
   staleness s_t, which is not one-process training. --max-staleness S enforces s_t <= S, in the spirit of
   stale-synchronous parallel (Ho et al. 2013, which bounds clocks; here the bound is on versions, the
   "bounded delay" of Li et al. 2014): a worker is handed new weights only if every gradient in flight can
   still be applied within S (at most S + 1 in flight), and an arrived gradient is applied only if the
   others still can; otherwise the server waits for the slowest. Workers report the version they computed
   on, and the run prints the staleness they saw (min / mean / max).
   --staleness D runs the same protocol in lockstep, so update t uses the gradient of batch t computed on
   W_{max(t-D, 0)} exactly; --check then equals the one-process delayed-update reference in this file, and
   --ckpt-dir resumes it exactly (the server saves the last D weight versions too; workers hold no state).
   Free-running, the arrival order is a race, so --ckpt-dir is refused there.

       server  W0 W0 ... apply g(W0) -> W1 -> send W1 | apply g(W0) -> W2 -> send W2 | apply g(W1) ...
       worker1   pull W0 ...compute... push ----------^                 pull W1 ...
       worker2   pull W0 ......compute...... push ---------------------^   pull W2 ...

Run:
    python dp.py --check                                   # world 1: the reference against itself
    torchrun --nproc_per_node=4 dp.py --check              # bulk synchronous
    torchrun --nproc_per_node=4 dp.py --accum 4 --ragged --check
    torchrun --nproc_per_node=4 dp.py --mode async --steps 40
    torchrun --nproc_per_node=3 dp.py --mode async --staleness 1 --check
    torchrun --max-restarts=1 --nproc_per_node=3 dp.py --mode async --staleness 1 --steps 8 --ckpt-dir D \
        --save-every 2 --fail-at-step 5                     # a worker dies; the rerun ends as if it had not
In production, use torch.nn.parallel.DistributedDataParallel (or ddp_bucketed.py to see how it works).
"""
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData)
from harness import (check_against_reference, check_common_args, Checkpointer, CommonArgs, env_world_size,
                     log_step, maybe_fail, parse_args, peak_memory_bytes, SavedActivations, state_bytes,
                     StepTimer, write_summary)


@dataclass
class Args(CommonArgs):
    mode: Literal["sync", "async"] = "sync"  # sync: bulk synchronous; async: parameter server
    accum: int = 1  # sync: micro-batches per rank per step, one all-reduce after the last
    loss_norm: Literal["global", "per_microbatch"] = "global"  # per_microbatch: the common bug, on purpose
    staleness: int = -1  # async: run in lockstep with exactly this staleness D (-1: free-running)
    max_staleness: int = 4  # async, free-running: bound on versions a gradient may lag (SSP)
    delay_ms: float = 0.0  # async: extra compute time of worker r is r * delay_ms (makes stragglers)


def grad_norm(params):
    """Global L2 norm of the gradients, the way clip_grad_norm_ computes it (norm of per-tensor norms)."""
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))


# ----------------------------------------------------------------------------- 1 + 2: bulk synchronous
def sync_step(d, args, model, opt, x, y, n_tok):
    """One optimizer step on this rank's slice of the global batch, in `args.accum` micro-batches.
    Returns (global loss, gradient norm, bytes this rank handed to all-reduce, activation bytes saved, number
    of gradient all-reduces)."""
    rows = args.batch_size // d.world
    x, y = x[d.rank * rows:(d.rank + 1) * rows], y[d.rank * rows:(d.rank + 1) * rows]  # (B/N, T) local slice
    opt.zero_grad(set_to_none=True)
    local_loss, saved = 0.0, 0
    for xm, ym in zip(x.chunk(args.accum), y.chunk(args.accum)):  # (B/(N*K), T) micro-batches
        xm, ym = xm.to(d.device), ym.to(d.device)
        if args.loss_norm == "global":
            divisor = n_tok  # every token of the global batch weighs the same
        else:  # the bug: a mean over this micro-batch's own tokens, then a plain average over K * N of them
            divisor = count_tokens(ym) * args.accum * d.world
        with SavedActivations() as acts:
            loss = lm_loss(model(xm), ym, divisor)
        saved = max(saved, acts.bytes)
        loss.backward()  # gradients add up in .grad across micro-batches: no communication yet
        local_loss += loss.item()
    # The one synchronisation of the step: SUM (not average) over ranks, because each rank's loss was
    # already divided by the global token count. One all-reduce per parameter: the naive version.
    sent, calls = 0, 0
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)  # (param shape) full gradient, replicated
        sent += p.grad.numel() * p.grad.element_size()  # measured: the bytes handed to the all-reduce
        calls += 1
    loss_t = torch.tensor([local_loss], dtype=torch.float64, device=d.device)
    dist.all_reduce(loss_t)  # for the log line only (8 bytes; not counted as training traffic)
    params = list(model.parameters())
    norm = grad_norm(params)  # gradients are identical on every rank now, so this is the global norm
    clip_grads_([p.grad for p in params], norm, args.clip)
    opt.step()
    return loss_t.item(), norm.item(), sent, saved, calls


# ----------------------------------------------------------------------------- 3: asynchronous parameter server
# Messages, all tensors on the device. Server -> worker: a header (version of the weights, batch id; batch id
# -1 = stop) and the flat weights. Worker -> server: the flat gradient, then (loss, version it computed on,
# batch id) in float64. Every server <-> worker pair talks on its own two-rank group (`groups[w]`): under
# NCCL with eager init, point-to-point ops on one group are issued in order on one communicator, so the
# server's posted receive from a slow worker would block its sends to every other worker (round robin,
# not asynchrony). One communicator per worker lets each pair's traffic proceed independently.
def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def load_flat_(model, flat):
    i = 0
    for p in model.parameters():
        p.data.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()


def batch_seed(args, batch_id):
    """Dropout on a worker depends only on (seed, batch): workers hold no state a restart could lose."""
    return 7_919 * args.seed + batch_id


def worker_loop(d, args, model, data, group):
    """Pull weights, compute the gradient of the batch named in the header, push it; until told to stop."""
    header = torch.zeros(2, dtype=torch.long, device=d.device)
    weights = flat_params(model)
    while True:
        dist.recv(header, src=0, group=group)
        version, batch_id = header.tolist()
        if batch_id < 0:
            return
        if batch_id >= args.fail_at_step >= 0:
            maybe_fail(d, args, args.fail_at_step)  # the last worker dies at its first batch >= --fail-at-step
        dist.recv(weights, src=0, group=group)
        load_flat_(model, weights)
        x, y = (t.to(d.device) for t in data.batch(batch_id, args.batch_size, args.seq_len, args.ragged))
        torch.manual_seed(batch_seed(args, batch_id))
        model.zero_grad(set_to_none=True)
        loss = lm_loss(model(x), y, count_tokens(y))
        loss.backward()
        time.sleep(d.rank * args.delay_ms / 1e3)  # a straggler, if asked for
        dist.send(torch.cat([p.grad.flatten() for p in model.parameters()]), dst=0, group=group)  # (P,)
        meta = torch.tensor([loss.item(), version, batch_id], dtype=torch.float64, device=d.device)
        dist.send(meta, dst=0, group=group)  # what this gradient is: measured here, where it was computed


def within_bound(version, pulled, bound):
    """Can gradients pulled at these versions all still be applied with staleness <= bound? Oldest first is
    the best order: the k-th oldest lands at version + k, so it needs version + k - pulled_k <= bound."""
    return all(version + k - v <= bound for k, v in enumerate(sorted(pulled)))


def server_loop(d, args, model, opt, timer, groups, ckpt, log, recent):
    """Rank 0: apply gradients as they arrive. `log` (one (loss, version used, batch id, ms) per update) and
    `recent` (lockstep: the last D weight versions) come from a checkpoint, or are empty. Returns the bytes
    the server handed to sends."""
    workers = list(range(1, d.world))
    n_params = sum(p.numel() for p in model.parameters())
    version = len(log)
    outstanding = {}  # worker -> (version of the weights it was sent, batch id, gradient buffer, meta buffer)
    pending_sends, arrivals, arrived, sent = [], queue.Queue(), set(), [0]

    def send_pull(w, batch_id, weights=None, weights_version=None):
        """Send weights (default: the current ones) or a stop to worker w, and post receives for its gradient."""
        v = version if weights_version is None else weights_version
        header = torch.tensor([v, batch_id], dtype=torch.long, device=d.device)
        out = [header] if batch_id < 0 else [header, flat_params(model) if weights is None else weights]
        for t in out:  # a copy of the weights: they change while the send may still be running
            pending_sends.append(dist.isend(t, dst=w, group=groups[w]))
            sent[0] += t.numel() * t.element_size()  # measured: the bytes handed to the send
        if batch_id < 0:
            return
        grad = torch.empty(n_params, dtype=out[1].dtype, device=d.device)
        meta = torch.empty(3, dtype=torch.float64, device=d.device)
        works = [dist.irecv(grad, src=w, group=groups[w]), dist.irecv(meta, src=w, group=groups[w])]
        outstanding[w] = (v, batch_id, grad, meta)
        # A thread per pending gradient reports its arrival: there is no receive-from-any-source in NCCL,
        # and gloo completes a receive only inside wait(), so neither polling nor any-source works for both.
        threading.Thread(target=lambda: ([wait_arrival(k) for k in works], arrivals.put(w)), daemon=True).start()

    lockstep, D, S = args.staleness >= 0, args.staleness, args.max_staleness
    idle = list(workers)
    if lockstep:  # update u's gradient: worker 1 + u % W, batch u, weights W_{max(u-D, 0)}; pulls u = v..v+D
        for u in range(version, min(version + D + 1, args.steps)):  # in flight (resent after a restart)
            v = max(u - D, 0)
            send_pull(workers[u % len(workers)], u, None if v == version else recent[v - version + len(recent)], v)
    handed_out = version
    if not lockstep:  # bounded staleness: hand out pulls only while all in flight can land within S
        while idle and handed_out < args.steps and within_bound(version, [o[0] for o in outstanding.values()] + [version], S):
            send_pull(idle.pop(0), handed_out)
            handed_out += 1
    timer.start()
    while version < args.steps:
        if lockstep:
            w = workers[version % len(workers)]
            while w not in arrived:
                arrived.add(arrivals.get(timeout=args.timeout))
        else:  # SSP-style wait: apply an arrived gradient, oldest first, only if the rest still fit the bound
            w = None
            while w is None:
                for c in sorted(arrived, key=lambda k: outstanding[k][0]):
                    rest = [o[0] for k, o in outstanding.items() if k != c]
                    if within_bound(version + 1, rest, S):
                        w = c
                        break
                else:
                    arrived.add(arrivals.get(timeout=args.timeout))
        arrived.discard(w)
        pulled, batch_id, grad, meta = outstanding.pop(w)
        loss, used, batch = meta.tolist()  # as the worker reports it
        if lockstep and D:
            recent = (recent + [flat_params(model)])[-D:]  # versions version+1-D .. version, for a restart
        load_grad_and_step(args, model, opt, grad)
        log.append((loss, int(used), int(batch), timer.stop()))
        version += 1
        ckpt.maybe_save(version, {"model": model, "optim": opt}, {"log": log, "recent": recent})
        timer.start()
        if lockstep:  # the pull that makes update u = version + D see exactly W_{version}
            if version + D < args.steps:
                send_pull(workers[(version + D) % len(workers)], version + D)
        else:
            idle.append(w)
            while idle and handed_out < args.steps and within_bound(version, [o[0] for o in outstanding.values()] + [version], S):
                send_pull(idle.pop(0), handed_out)
                handed_out += 1
    for w in workers:  # every gradient handed out has been applied: tell every worker to stop
        send_pull(w, -1)
    for s in pending_sends:
        s.wait()
    return sent[0]


def wait_arrival(work):
    work.wait()  # gloo: returns when the data is here; NCCL: only orders the streams, so poll as well
    while not work.is_completed():
        time.sleep(1e-4)


def load_grad_and_step(args, model, opt, flat_grad):
    i = 0
    for p in model.parameters():
        p.grad = flat_grad[i:i + p.numel()].view_as(p).clone()
        i += p.numel()
    params = list(model.parameters())
    clip_grads_([p.grad for p in params], grad_norm(params), args.clip)
    opt.step()


def delayed_reference(args, used_versions, batch_ids, device="cpu"):
    """One process, no communication: update t applies the gradient of batch `batch_ids[t]` computed on the
    weights of version `used_versions[t]` (W_{t-D} in lockstep): W_{t+1} = AdamW(W_t, clip(g(W_used)))."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    stale = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)  # holds W_used
    opt = make_optimizer(model.parameters(), args)
    history, losses = [flat_params(model).clone()], []
    for t in range(args.steps):
        load_flat_(stale, history[used_versions[t]])
        x, y = (v.to(device) for v in data.batch(batch_ids[t], args.batch_size, args.seq_len, args.ragged))
        torch.manual_seed(batch_seed(args, batch_ids[t]))  # the worker's dropout
        loss = lm_loss(stale(x), y, count_tokens(y))
        grads = torch.autograd.grad(loss, list(stale.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # torch's own clipping, independently
        opt.step()
        history.append(flat_params(model).clone())
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    world = env_world_size()
    check_common_args(args)
    if args.mode == "sync":
        if args.accum < 1:
            fail(f"--accum must be >= 1, got {args.accum}")
        if args.batch_size % (world * args.accum):
            fail(f"--batch-size {args.batch_size} must be divisible by world size x --accum = {world} x "
                 f"{args.accum}; try --batch-size {world * args.accum * max(1, args.batch_size // (world * args.accum))}")
    else:
        if world < 2:
            fail("--mode async needs a server and at least one worker: torchrun --nproc_per_node=2 (or more) dp.py --mode async")
        if args.accum != 1:
            fail("--mode async does not support --accum (each worker computes a whole batch)")
        if args.ckpt_dir and args.staleness < 0:
            fail("--mode async --ckpt-dir needs --staleness D (lockstep): free-running, the order in which gradients "
                 "arrive is a race, so no resumed run can repeat the uninterrupted one")
        if args.staleness > world - 2:
            fail(f"--staleness {args.staleness} needs at least {args.staleness + 1} workers, so that no worker is "
                 f"sent new weights while it still computes: torchrun --nproc_per_node={args.staleness + 2}")
        if args.max_staleness < 0:
            fail(f"--max-staleness must be >= 0, got {args.max_staleness}")
        if args.staleness < -1:
            fail(f"--staleness must be -1 (free-running) or >= 0, got {args.staleness}")
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    d.log(f"dp.py --mode {args.mode}: world {d.world} on {d.backend}, entropy floor {data.entropy:.4f} nats/token")
    torch.manual_seed(args.seed + d.rank)  # dropout differs across ranks, as it would on different data
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    for p in model.parameters():  # everyone starts from rank 0's weights (they agree already: one seed)
        dist.broadcast(p.data, src=0)
    opt = make_optimizer(model.parameters(), args)
    timer = StepTimer(d.device)
    tokens = args.batch_size * args.seq_len
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    if args.mode == "sync":
        start, hist = ckpt.load({"model": model, "optim": opt})
        if start and "losses" not in hist:
            fail(f"--ckpt-dir {args.ckpt_dir} holds a --mode async checkpoint, this run is --mode sync: use another --ckpt-dir")
        losses, sent, saved, calls = hist.get("losses", []), 0, 0, 0
        for step in range(start, args.steps):
            maybe_fail(d, args, step)
            timer.start()
            x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, CPU
            loss, norm, sent, saved, calls = sync_step(d, args, model, opt, x, y, count_tokens(y))
            losses.append(loss)
            log_step(d, step, loss, timer.stop(), tokens)
            ckpt.maybe_save(step + 1, {"model": model, "optim": opt}, {"losses": losses})
        # --- measurement ---
        ring = 2 * (d.world - 1) / d.world * sent
        figures = dict(all_reduces_per_step=calls, allreduce_payload_bytes=sent,
                       ring_bytes_sent_theory=ring, activation_bytes_saved_per_microbatch=saved)
        d.log(f"summary: all-reduce payload {sent} B/step/rank (measured) in {figures['all_reduces_per_step']} "
              f"all-reduces; bytes a rank sends in a ring all-reduce, theory 2(N-1)/N x payload = {ring:.0f} B; "
              f"saved activations per micro-batch {saved} B")
        peak = peak_memory_bytes(d, state_bytes(model, opt) + saved)  # before --check trains the reference
        full = {n: p.detach() for n, p in model.named_parameters()}
        check = check_against_reference(d, args, losses, full) if args.check else None
    else:
        # one two-rank group per worker (see the messages comment); every rank creates them, in one order
        groups = {w: dist.new_group([0, w]) for w in range(1, d.world)}
        if d.rank > 0:  # workers are stateless: they only agree with the server on where it resumes
            ckpt.dir = ckpt.dir and os.path.join(args.ckpt_dir, "rank0")  # (so the directory must be shared)
        start, hist = ckpt.load({"model": model, "optim": opt} if d.rank == 0 else {})
        if start and "log" not in hist:
            fail(f"--ckpt-dir {args.ckpt_dir} holds a --mode sync checkpoint, this run is --mode async: use another --ckpt-dir")
        figures, check, losses, sent = {}, None, [], 0
        if d.rank == 0:
            log = hist.get("log", [])
            recent = [t.to(d.device) for t in hist.get("recent", [])]  # a checkpoint may load to the CPU
            sent = server_loop(d, args, model, opt, timer, groups, ckpt, log, recent)
            # --- measurement ---
            losses, used, batch_ids = [l[0] for l in log], [l[1] for l in log], [l[2] for l in log]
            stale = [t - v for t, v in enumerate(used)]  # versions reported by the workers that computed them
            for t, (loss, v, b, ms) in enumerate(log[start:], start):
                d.log(f"update {t:4d} | loss {loss:.6f} | batch {b:3d} | weights v{v} (staleness {t - v}) | {ms:8.1f} ms")
            bound = args.staleness if args.staleness >= 0 else args.max_staleness
            sent //= max(args.steps - start, 1)  # per update, measured
            figures = dict(staleness_min=min(stale), staleness_mean=sum(stale) / len(stale), staleness_max=max(stale),
                           staleness_bound=bound, used_versions=used, batch_ids=batch_ids, server_bytes_sent_per_update=sent)
            d.log(f"summary: staleness min {min(stale)} / mean {sum(stale) / len(stale):.2f} / max {max(stale)} "
                  f"(bound {bound}); the server sent {sent} B per update (measured; weights {param_bytes} B + header)")
        else:
            worker_loop(d, args, model, data, groups[d.rank])
        peak = peak_memory_bytes(d, state_bytes(model, opt))  # before --check trains the reference
        if args.check:  # replay the versions the run used; in lockstep, the ones the rule prescribes
            ref = None
            if d.rank == 0:
                used = [max(t - args.staleness, 0) for t in range(args.steps)] if args.staleness >= 0 else used
                ids = list(range(args.steps)) if args.staleness >= 0 else batch_ids
                ref = delayed_reference(args, used, ids, d.device)
            full = {n: p.detach().cpu() for n, p in model.named_parameters()}
            check = check_against_reference(d, args, losses, full, ref=ref)

    write_summary(d, args, f"dp-{args.mode}", losses, timer.median(), tokens / max(timer.median(), 1e-9) * 1e3,
                  peak, sent, check, figures)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
