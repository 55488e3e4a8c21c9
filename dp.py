"""dp.py: naive data parallelism, written by hand, three ways to synchronise.

Every rank holds the whole model and a slice of the data. They differ in *when* ranks agree:

1. --mode sync (bulk synchronous; the idea behind PyTorch DDP, Horovod, Li et al. 2020)
   Broadcast the weights from rank 0 once, then every step: each rank runs forward + backward on its
   slice of the global batch, the gradients are summed over ranks (one all-reduce per parameter; see
   ddp_bucketed.py for the bucketed, overlapped version), and every rank takes the same optimizer
   step. Trade-off: the whole job runs at the speed of the slowest rank, and it equals one-process
   training.

       rank 0  [fwd b0|bwd b0]--all-reduce--[step]   every rank waits for the last one,
       rank 1  [fwd b1|bwd b1]--all-reduce--[step]   then all take the same step

2. --accum K (gradient accumulation: "synchronise every K micro-batches")
   Each rank runs K micro-batches, letting gradients add up in .grad, and all-reduces once after the
   last: K times fewer all-reduces for the same global batch, and activations for only B/(world*K)
   sequences alive at a time. The catch that two widely read repos get wrong: if each micro-batch
   loss is a *mean over its own tokens*, micro-batches with fewer real tokens (padding,
   ignore_index) weigh as much as full ones and the sum is not the full-batch gradient. Here every
   loss is a sum over tokens divided by the token count of the *whole global batch*
   (common.lm_loss), so the gradients of all micro-batches on all ranks simply add up, and the
   all-reduce is a SUM. (tests/dp_checks.py runs the wrong way on purpose and shows that --check
   catches it.)

3. --mode async (asynchronous parameter server; Dean et al. 2012 "Downpour SGD", Li et al. 2014)
   Rank 0 is the server: it holds the weights and the optimizer. Workers (ranks 1..N-1) pull
   weights, compute a gradient on a whole batch, push it, and never wait for each other; the server
   applies each gradient the moment it arrives, so it was computed on weights some versions old
   (stale). Trade-off: no worker waits for a straggler, but the update is W_{t+1} = W_t - lr *
   g(W_{t - s_t}) with staleness s_t, which is not one-process training. --max-staleness S enforces
   s_t <= S, in the spirit of stale-synchronous parallel (Ho et al. 2013, which bounds clocks; here
   the bound is on versions, the "bounded delay" of Li et al. 2014): a worker is handed new weights
   only if every gradient in flight can still be applied within S (at most S + 1 in flight), and an
   arrived gradient is applied only if the others still can; otherwise the server waits for the
   slowest. Workers report the version they computed on, and the run prints the staleness they saw
   (min / mean / max). --staleness D runs the same protocol in lockstep, so update t uses the
   gradient of batch t computed on W_{max(t-D, 0)} exactly; --check then equals the one-process
   delayed-update reference in this file, and --ckpt-dir resumes it exactly (the server saves the
   last D weight versions too; workers hold no state). Free-running, the arrival order is a race, so
   --ckpt-dir is refused there. On NCCL a receive posted for a worker still computing would spin on
   the GPU, one per pull in flight on as many communicators, with no progress guarantee: each worker
   first reports on a gloo side group (host memory), received from any source, and the server posts
   that worker's gradient receive only then, so at most one short receive is live at a time (and the
   server needs no thread or polling).

       server  W0 W0 ... apply g(W0) -> W1 -> send W1 | apply g(W0) -> W2 -> send W2 | apply g(W1) ...
       worker1   pull W0 ...compute... push ----------^                 pull W1 ...
       worker2   pull W0 ......compute...... push ---------------------^   pull W2 ...

Run:
    python dp.py --check                                   # world 1: the reference against itself
    torchrun --nproc_per_node=4 dp.py --check              # bulk synchronous
    torchrun --nproc_per_node=4 dp.py --accum 4 --ragged --batch-size 16 --check
    torchrun --nproc_per_node=4 dp.py --mode async --steps 40
    torchrun --nproc_per_node=3 dp.py --mode async --staleness 1 --check
    torchrun --max-restarts=1 --nproc_per_node=3 dp.py --mode async --staleness 1 --steps 8 --ckpt-dir D \
        --save-every 2 --fail-at-step 5                     # a worker dies; the rerun ends as if it had not
In production, use torch.nn.parallel.DistributedDataParallel (or ddp_bucketed.py to see how it
works).
"""

import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    close_dist,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import (
    Checkpointer,
    CommCounter,
    CommonArgs,
    LiveStorages,
    Run,
    SavedActivations,
    StepTimer,
    check_against_reference,
    check_common_args,
    env_world_size,
    maybe_fail,
    parse_args,
    peak_memory_bytes,
    state_bytes,
)


@dataclass
class Args(CommonArgs):
    mode: Literal["sync", "async"] = "sync"  # sync: bulk synchronous; async: parameter server
    accum: int = 1  # sync: micro-batches per rank per step, one all-reduce after the last
    staleness: int = -1  # async: run in lockstep with exactly this staleness D (-1: free-running)
    max_staleness: int = 4  # async, free-running: bound on versions a gradient may lag (SSP)
    delay_ms: float = 0.0  # async: worker r computes r * delay_ms ms longer (a straggler)


# -------------------------------------------------------------------------- 1 + 2: bulk synchronous
def clip_and_step(params, opt, clip):
    """torch's clipping rule by the norm of the whole gradient, then the step; returns the norm
    (get_total_norm takes each tensor's norm in its own dtype: no float64 copies of the
    gradients)."""
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
    opt.step()
    return norm


def sync_step(model, opt, micro_batches, loss_fn, clip=0.0, group=None):
    """One optimizer step of bulk-synchronous data parallel. Every rank of `group` starts from the
    same weights and passes its share of the global batch as `micro_batches`, (x, y) pairs on the
    device. loss_fn(model, x, y) is a micro-batch's loss: a *sum* over its examples divided by the
    size of the whole global batch, so that the gradients of all micro-batches on all ranks add up
    to the full-batch gradient. Returns (this rank's loss over its micro-batches, float64 on the
    device; the norm before clipping)."""
    opt.zero_grad(set_to_none=True)
    total = 0
    for x, y in micro_batches:  # (B/(N*K), T) each
        loss = loss_fn(model, x, y)
        loss.backward()  # gradients add up in .grad across micro-batches: no communication yet
        total = total + loss.detach().double()  # on the device: no host sync per micro-batch
    params = [p for p in model.parameters() if p.requires_grad]
    if not torch.is_tensor(total) or any(p.grad is None for p in params):  # no all-reduce could run
        raise ValueError(
            "sync_step: no micro-batches, or a parameter they gave no gradient: pass at least "
            "one (x, y) pair and make every trainable parameter part of the loss (or freeze it)"
        )
    # The one synchronisation of the step: SUM (not average) over ranks, because each rank's loss
    # was already divided by the global count. One all-reduce per parameter: the naive version.
    for p in params:
        # (param shape) the full gradient, replicated
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=group)
    return total, clip_and_step(params, opt, clip)  # the gradients agree: the local norm is global


# ---------------------------------------------------------------------------- 3: a parameter server
# Messages. Server -> worker, on the device: a header (version of the weights, batch id; batch id -1
# = stop) and the flat weights. Worker -> server: a report (loss, version it computed on, batch id)
# in float64, then the flat gradient on the device. Every server <-> worker pair talks on its own
# two-rank group (`groups[w]`): under NCCL, point-to-point ops on one group run in order on one
# communicator, so one slow worker would hold up the server's traffic with every other (round robin,
# not asynchrony). The report travels first, on a gloo group of every rank (`side`, host memory: no
# GPU kernel), received from any source: NCCL has no receive from any source, and a receive posted
# on the GPU for every worker still computing would leave up to S + 1 kernels spinning on as many
# communicators at once, for which NCCL guarantees no progress (and which take SMs from the server's
# step). So the server posts a gradient's receive only once its report is in, the gradient then
# already sent: one short receive at a time, and no thread or polling.
def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])  # (P,) a copy


def load_flat_(model, flat):
    for p, piece in zip(model.parameters(), flat.split([p.numel() for p in model.parameters()])):
        p.data.copy_(piece.view_as(p))


def worker_loop(model, loss_of_batch, group, side, server=0):
    """A worker: pull weights and a batch id from the server (global rank `server`), push the
    gradient of loss_of_batch(model, batch id) on those weights, until told to stop. It holds no
    state. `group`: its two-rank group with the server; `side`: the gloo group of every rank that
    the reports travel on."""
    if dist.get_world_size(group) != 2:
        raise ValueError(
            f"worker_loop: `group` must be this worker's two-rank group with the server, not "
            f"{dist.get_world_size(group)} rank(s): new_group([server, worker]) on every rank"
        )
    device = next(model.parameters()).device
    header = torch.zeros(2, dtype=torch.long, device=device)  # (version, batch id)
    weights = flat_params(model)
    while True:
        dist.recv(header, src=server, group=group)
        # the worker must know its batch: a host sync, off the server's path
        batch_id = int(header[1])
        if batch_id < 0:
            return
        dist.recv(weights, src=server, group=group)
        load_flat_(model, weights)
        model.zero_grad(set_to_none=True)
        loss = loss_of_batch(model, batch_id)
        loss.backward()
        # (loss, version, batch id): what this gradient is, said first, on the host
        meta = torch.cat([loss.detach().double().reshape(1), header.double()])
        dist.send(meta.cpu(), dst=server, group=side)
        grad = torch.cat([p.grad.flatten() for p in model.parameters()])  # (P,)
        dist.send(grad, dst=server, group=group)


def within_bound(version, pulled, bound):
    """Can gradients pulled at these versions all still be applied with staleness <= bound? Oldest
    first is the best order: the k-th oldest lands at version + k, so it needs version + k -
    pulled_k <= bound."""
    return all(version + k - v <= bound for k, v in enumerate(sorted(pulled)))


@dataclass
class Lockstep:
    """Update u applies the gradient of batch u, computed by worker u mod W on W_{max(u-D, 0)}:
    exactly D versions stale, D + 1 pulls in flight (so at least D + 1 workers)."""

    D: int

    def __post_init__(self):
        if self.D < 0:
            raise ValueError(
                f"Lockstep: staleness D must be >= 0 (0: the newest weights), got {self.D}"
            )

    def next_pull(self, s):  # (worker, weights version) for batch u = s.handed, once W_{u-D} exists
        u = s.handed
        return (
            (s.workers[u % len(s.workers)], max(u - self.D, 0)) if u <= s.version + self.D else None
        )

    def pick(self, s):  # only the gradient of batch s.version may land now
        w = s.workers[s.version % len(s.workers)]
        return w if w in s.arrived else None


@dataclass
class BoundedStaleness:
    """Stale-synchronous parallel on versions: hand the newest weights to an idle worker only while
    every gradient in flight can still land within S versions; apply an arrived gradient, oldest
    first, only if the others still can. Otherwise wait for the slowest."""

    S: int

    def __post_init__(self):
        if self.S < 0:
            raise ValueError(
                f"BoundedStaleness: S must be >= 0 (0: one gradient in flight), got {self.S}"
            )

    def next_pull(self, s):
        in_flight = [v for v, *_ in s.pending.values()] + [s.version]
        return (
            (s.idle[0], s.version)
            if s.idle and within_bound(s.version, in_flight, self.S)
            else None
        )

    def pick(self, s):
        for w in sorted(s.arrived, key=lambda k: s.pending[k][0]):
            if within_bound(
                s.version + 1, [v for k, (v, *_) in s.pending.items() if k != w], self.S
            ):
                return w
        return None


def check_workers(policy, n_workers):
    """Lockstep at staleness D keeps D + 1 workers busy at once (one pull each); any policy needs
    one."""
    need = policy.D + 1 if isinstance(policy, Lockstep) else 1
    if n_workers < need:
        raise ValueError(
            f"Server: {policy} needs at least {need} worker(s), got {n_workers}: a world of at "
            f"least {need + 1} ranks (torchrun --nproc_per_node={need + 1}), a two-rank group "
            "per worker"
        )


class Server:
    """The parameter server: holds the weights and the optimizer, hands out pulls (weights, and the
    batch to compute on them) and applies the workers' gradients in the order `policy` allows.
    `groups`: a worker's global rank -> its two-rank group with this rank; `side`: the gloo group of
    every rank (the reports). `version`: updates applied so far (a resumed run); `old`: {version:
    flat weights} of earlier versions that the pulls in flight at a resume were sent."""

    def __init__(self, model, opt, groups, side, policy, updates, clip=0.0, version=0, old=None):
        check_workers(policy, len(groups))
        self.model = model
        self.opt = opt
        self.groups = groups
        self.side = side
        self.policy = policy
        self.workers = sorted(groups)
        self.updates = updates
        self.version = version
        self.handed = version
        self.clip, self.old = clip, old or {}
        self.pending = {}  # worker -> (weights version, batch id) of its pull in flight
        self.sends = {}  # worker -> the works of its pull in flight: nothing older is kept alive
        self.idle = list(self.workers)
        self.arrived = {}  # worker -> its report, gradient not read
        self.flat = flat_params(model)  # (P,) the layout of a flat gradient

    def hand_out(self):
        """Send every pull the policy allows now."""
        while self.handed < self.updates and (pull := self.policy.next_pull(self)) is not None:
            w, v = pull
            header = torch.tensor([v, self.handed], device=self.flat.device)
            self._send(w, header, flat_params(self.model) if v == self.version else self.old[v])
            self.pending[w] = (v, self.handed)
            self.idle.remove(w)
            self.handed += 1

    def _send(self, w, *tensors):
        self.sends[w] = [dist.isend(t, dst=w, group=self.groups[w]) for t in tensors]

    def next_to_apply(self):
        """The worker whose gradient the policy applies next; blocks until its report has arrived
        (the side group's timeout bounds the wait)."""
        while (w := self.policy.pick(self)) is None:
            report = torch.empty(3, dtype=torch.float64)  # (loss, version, batch id), on the host
            w = dist.recv(report, group=self.side)  # from any source: returns who
            self.arrived[w] = report
        return w

    def apply(self, w):
        """W_{version+1} = AdamW(W_version, clip(g_w)). Returns w's report (loss, the version it
        computed on, batch id), float64 on the host."""
        self.pending.pop(w)
        grad = torch.empty_like(self.flat)  # (P,) posted now: w sent it after its report
        dist.recv(grad, src=w, group=self.groups[w])  # NCCL: only the server's stream waits
        for work in self.sends.pop(w):  # w answered its pull: the send is complete, the copy can go
            work.wait()
        self.idle.append(w)
        params = list(self.model.parameters())
        for p, g in zip(params, grad.split([p.numel() for p in params])):
            p.grad = g.view_as(p)  # views into the received buffer: no copy
        clip_and_step(params, self.opt, self.clip)
        self.version += 1
        return self.arrived.pop(w)

    def stop(self):
        """Every gradient handed out has been applied: tell every worker to stop."""
        for w in self.workers:
            self._send(w, torch.tensor([-1, -1], device=self.flat.device))
        for work in [k for works in self.sends.values() for k in works]:
            work.wait()


def check_args(args):
    world, k = env_world_size(), env_world_size() * args.accum
    check_common_args(args)
    if args.mode == "sync":
        if args.accum < 1:
            fail(f"--accum must be >= 1, got {args.accum}")
        if args.batch_size % k:
            fail(
                f"--batch-size {args.batch_size} must be divisible by world size x --accum = "
                f"{world} x {args.accum}; try --batch-size {k * max(1, args.batch_size // k)}"
            )
        return
    if args.accum != 1:
        fail("--mode async does not support --accum (each worker computes a whole batch)")
    if args.ckpt_dir and args.staleness < 0:
        fail(
            "--mode async --ckpt-dir needs --staleness D (lockstep): free-running, the order in "
            "which gradients arrive is a race, so no resumed run can repeat the uninterrupted one"
        )
    if args.staleness < -1:
        fail(f"--staleness must be -1 (free-running) or >= 0, got {args.staleness}")
    try:  # the cores' own checks: the policy's bound, and the workers it keeps busy
        check_workers(make_policy(args), world - 1)
    except ValueError as e:
        fail(f"--mode async --staleness {args.staleness} --max-staleness {args.max_staleness}: {e}")


def make_policy(args):
    return Lockstep(args.staleness) if args.staleness >= 0 else BoundedStaleness(args.max_staleness)


def to_device(device, *tensors):
    """A step's batch onto the device, one copy per tensor: pinned and non-blocking on CUDA (a copy
    from pageable memory makes the host wait for the stream)."""
    if device.type != "cuda":
        return tensors
    return tuple(t.pin_memory().to(device, non_blocking=True) for t in tensors)


def batch_seed(args, batch_id):
    """Dropout on a worker depends only on (seed, batch): workers hold no state a restart could
    lose."""
    return 7_919 * args.seed + batch_id


def global_batch_loss(model, batch_id, data, args, device):
    """What a worker computes for a batch id: the loss of that whole global batch (B, T); its
    dropout a function of (seed, batch) only, so that no worker holds state a restart could lose."""
    x, y = data.batch(batch_id, args.batch_size, args.seq_len, args.ragged)  # (B, T) whole, CPU
    n_tok = count_tokens(y)
    x, y = to_device(device, x, y)
    torch.manual_seed(batch_seed(args, batch_id))
    return lm_loss(model(x), y, n_tok)


def main():
    args = parse_args(Args)
    check_args(args)
    d = init_dist(args.timeout)
    watch = Watch(d, args)  # the resume's history, the counters, the summaries: below the fence
    data = MarkovData(args.vocab, args.seed)
    d.log(
        f"dp.py --mode {args.mode}: world {d.world} on {d.backend}, "
        f"entropy floor {data.entropy:.4f} nats/token"
    )
    torch.manual_seed(args.seed + d.rank)  # dropout differs across ranks, as on different data
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    if args.mode == "sync":
        # 1 + 2: everyone starts from rank 0's weights (they agree already: one seed)
        for p in model.parameters():
            dist.broadcast(p.data, src=0, group=dist.group.WORLD)
        opt = make_optimizer(model.parameters(), args)
        run = Run(d, args, {"model": model, "optim": opt})  # resume, log
        rows = args.batch_size // d.world
        watch.refuse_checkpoint(run.start and "used" in run.history, "async", "sync")
        comm = CommCounter()
        at = min(max(run.start, 1), args.steps - 1)  # measured: a step bench.py skips
        # The loss for the log line on a group of its own: on NCCL its own communicator, never
        # queued with the gradients' all-reduces (nanoGPT logs rank 0's own loss instead).
        log = dist.new_group()
        for step in run.steps():
            x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T), CPU
            # tokens of the whole global batch: every micro-batch loss divides by it
            n_tok = count_tokens(y)
            mine = (t[d.rank * rows : (d.rank + 1) * rows] for t in (x, y))
            x, y = to_device(d.device, *mine)  # (B/N, T)
            micro = zip(x.chunk(args.accum), y.chunk(args.accum))  # K micro-batches of (B/(N*K), T)
            with run.watching(step, comm, at=at):
                loss, _ = sync_step(
                    model, opt, micro, lambda m, xm, ym: lm_loss(m(xm), ym, n_tok), args.clip
                )
            dist.all_reduce(loss, group=log)  # the global batch's loss, for the log line only
            run.end_step(step, loss.item())
        return watch.sync_summary(run, model, opt, comm, data, at)
    # 3: a parameter server on rank 0, a worker on every other rank, each pair on its own group (see
    # above)
    groups = {w: dist.new_group([0, w]) for w in range(1, d.world)}  # every rank, in one order
    side = dist.new_group(backend="gloo", timeout=timedelta(seconds=args.timeout))  # the reports
    if d.rank > 0:
        # a worker holds no state: it only agrees with the server on the step it resumes from
        watch.agree_on_resume()

        def loss_of_batch(m, batch_id):
            if batch_id >= args.fail_at_step >= 0:  # --fail-at-step: the last worker dies here
                maybe_fail(d, args, args.fail_at_step)
            time.sleep(d.rank * args.delay_ms / 1e3)  # --delay-ms: a straggler, if asked for
            return global_batch_loss(m, batch_id, data, args, d.device)

        worker_loop(model, loss_of_batch, groups[d.rank], side)
        return watch.worker_summary(model)
    opt = make_optimizer(model.parameters(), args)
    run = Run(d, args, {"model": model, "optim": opt})  # resumes: the version, the history
    # A host timer: the report's .tolist() below has waited for this update on the server's own
    # stream, while StepTimer's device-wide synchronize would also wait for the receives posted for
    # other workers.
    run.timer = StepTimer(torch.device("cpu"))
    policy = make_policy(args)  # lockstep at staleness D, or free-running within --max-staleness
    old = watch.resumed_versions(run)  # a resume: the weights the pulls then in flight were sent
    server = Server(model, opt, groups, side, policy, args.steps, args.clip, run.start, old)
    sent = watch.sends(server)  # measurement: the bytes handed to its sends, the sent copies alive
    server.hand_out()
    for step in run.steps():
        watch.keep_versions(run, model)  # --ckpt-dir in lockstep: the weights pulls in flight got
        report = server.apply(server.next_to_apply())
        server.hand_out()  # the next pulls leave before the host reads anything back
        loss, version, batch_id = report.tolist()  # as the worker reports it
        watch.record(run, int(version), int(batch_id))  # used versions, batch ids: figures, resume
        run.end_step(step, loss)
    server.stop()
    watch.server_summary(run, model, opt, sent)


# --- measurement ---
class Watch:
    """What main's loops are watched with (harness.Run does the resume, --fail-at-step, the step's
    timer and log line, checkpoints): the resume's extra history, the counters, the summaries and
    --check."""

    def __init__(self, d, args):
        self.d = d
        self.args = args

    def refuse_checkpoint(self, refuse, theirs, ours):
        if refuse:
            fail(
                f"--ckpt-dir {self.args.ckpt_dir} holds a --mode {theirs} checkpoint, this run is "
                f"--mode {ours}: use another --ckpt-dir"
            )

    def sync_summary(self, run, model, opt, comm, data, at):
        """The sync run's summary: the all-reduces counted on step `at`; the activations one
        micro-batch saves for backward, measured after training on a forward of step `at`'s first
        micro-batch (no backward, no step: nothing of training changes); the peak before --check
        trains the reference."""
        d = self.d
        args = self.args
        rows = args.batch_size // d.world
        x, y = data.batch(at, args.batch_size, args.seq_len, args.ragged)
        x, y = (
            t[d.rank * rows : (d.rank + 1) * rows].chunk(args.accum)[0].to(d.device) for t in (x, y)
        )
        with SavedActivations() as acts:
            lm_loss(model(x), y, count_tokens(y))
        figures = sync_figures(d, comm, acts.bytes)
        peak = peak_memory_bytes(d, state_bytes(model, opt) + acts.bytes)
        full = dict(model.named_parameters())
        check = check_against_reference(d, args, run.losses, full) if args.check else None
        run.finish("dp-sync", peak, figures["allreduce_payload_bytes"], check, figures)

    def agree_on_resume(self):
        """A worker agrees with the server on the step it resumes from (reading the server's rank0
        files, so the --ckpt-dir must be shared): the newest step is all-reduced over every rank, as
        the server's Run does."""
        args = self.args
        ckpt = Checkpointer(self.d, args.ckpt_dir, args.save_every, args.steps)
        ckpt.dir = ckpt.dir and os.path.join(args.ckpt_dir, "rank0")
        start, history = ckpt.load({})
        self.refuse_checkpoint(start and "used" not in history, "sync", "async")

    def resumed_versions(self, run):
        """The server's resume: {version: flat weights} that the pulls in flight at the checkpoint
        were sent."""
        self.refuse_checkpoint(run.start and "used" not in run.history, "sync", "async")
        recent = run.history.setdefault("recent", [])
        return {run.start - len(recent) + i: t.to(self.d.device) for i, t in enumerate(recent)}

    def keep_versions(self, run, model):
        """In lockstep with --ckpt-dir, a restart needs the weights the last D pulls in flight were
        sent."""
        D = self.args.staleness
        if D > 0 and self.args.ckpt_dir:
            run.history["recent"] = (run.history.get("recent", []) + [flat_params(model)])[-D:]

    def record(self, run, version, batch_id):
        """The version each applied gradient was computed on and its batch id, kept in the run's
        history."""
        run.history["used"] = run.history.get("used", []) + [version]
        run.history["batches"] = run.history.get("batches", []) + [batch_id]

    def sends(self, server):
        """Count what server.hand_out and server.stop hand to their sends, and the sent copies
        alive."""
        sent = SentCopies()

        def counted(method):
            def call(*a):
                with sent:
                    return method(*a)

            return call

        server.hand_out, server.stop = counted(server.hand_out), counted(server.stop)
        return sent

    def server_summary(self, run, model, opt, sent):
        d = self.d
        args = self.args
        D = args.staleness
        used = run.history.get("used", [])
        batches = run.history.get("batches", [])
        figures = async_figures(d, args, run, sent, used, batches, model)
        peak = peak_memory_bytes(d, state_bytes(model, opt))  # before --check trains the reference
        check = None
        # replay the versions the run used; in lockstep, the ones the rule prescribes
        if args.check:
            ref = delayed_reference(
                args,
                [max(t - D, 0) for t in range(args.steps)] if D >= 0 else used,
                list(range(args.steps)) if D >= 0 else batches,
                d.device,
            )
            check = check_against_reference(
                d, args, run.losses, dict(model.named_parameters()), ref=ref
            )
        run.finish("dp-async", peak, figures["server_bytes_sent_per_update"], check, figures)

    def worker_summary(self, model):
        """A worker joins the collectives of the server's summary and --check."""
        peak_memory_bytes(self.d, state_bytes(model))
        check = check_against_reference(self.d, self.args, [], {}) if self.args.check else None
        close_dist(ok=check is None or check["passed"])


class SentCopies(CommCounter):
    """A CommCounter that also holds every tensor handed to a send, weakly (LiveStorages): `peak` is
    the most bytes of sent tensors still alive as a `with` block ends (kept copies grow by a model
    per update)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak = LiveStorages(), 0

    def _count(self, op, name, ns, args):
        super()._count(op, name, ns, args)
        if op == "send":
            self.live.add(args[0][0])

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.peak = max(self.peak, self.live.alive())


def sync_figures(d, comm, saved):
    sent, calls = comm.total("all_reduce"), comm.total("all_reduce", what="calls")
    ring = 2 * (d.world - 1) / d.world * sent
    d.log(
        f"summary: all-reduce payload {sent} B/step/rank (measured) in {calls} all-reduces; bytes "
        f"a rank sends in a ring all-reduce, theory 2(N-1)/N x payload = {ring:.0f} B; saved "
        f"activations per micro-batch {saved} B (measured)"
    )
    return dict(
        all_reduces_per_step=calls,
        allreduce_payload_bytes=sent,
        ring_bytes_sent_theory=ring,
        activation_bytes_saved_per_microbatch=saved,
    )


def async_figures(d, args, run, sent, used, batches, model):
    stale = [
        t - v for t, v in enumerate(used)
    ]  # versions reported by the workers that computed them
    bound = args.staleness if args.staleness >= 0 else args.max_staleness
    per_update = sent.total("send") // max(args.steps - run.start, 1)  # measured at the sends
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    copies = sent.peak // model_bytes  # weight copies (a header is 16 bytes)
    d.log(
        f"summary: staleness min {min(stale)} / mean {sum(stale) / len(stale):.2f} / max "
        f"{max(stale)} (bound {bound}); the server sent {per_update} B per update (measured; "
        f"weights {model_bytes} B + header); sent weight copies alive at most {copies} (measured; "
        f"theory: one per pull in flight, min(workers, bound + 1) = {min(d.world - 1, bound + 1)})"
    )
    return dict(
        staleness_min=min(stale),
        staleness_mean=sum(stale) / len(stale),
        staleness_max=max(stale),
        staleness_bound=bound,
        used_versions=used,
        batch_ids=batches,
        server_bytes_sent_per_update=per_update,
        sent_weight_copies_alive_max=copies,
        sent_bytes_alive_max=sent.peak,
    )


# --- reference for --check ---
def delayed_reference(args, used_versions, batch_ids, device="cpu"):
    """One process, no communication: update t applies the gradient of batch `batch_ids[t]` computed
    on the weights of version `used_versions[t]` (W_{t-D} in lockstep): W_{t+1} = AdamW(W_t,
    clip(g(W_used)))."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    # holds W_used
    stale = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt = make_optimizer(model.parameters(), args)
    history, losses = [flat_params(model).clone()], []
    for t in range(args.steps):
        load_flat_(stale, history[used_versions[t]])
        x, y = (
            v.to(device)
            for v in data.batch(batch_ids[t], args.batch_size, args.seq_len, args.ragged)
        )
        torch.manual_seed(batch_seed(args, batch_ids[t]))  # the worker's dropout
        loss = lm_loss(stale(x), y, count_tokens(y))
        grads = torch.autograd.grad(loss, list(stale.parameters()))
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        if args.clip > 0:
            # torch's clipping, independently
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        history.append(flat_params(model).clone())
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


if __name__ == "__main__":
    main()
