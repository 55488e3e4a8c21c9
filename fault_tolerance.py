"""fault_tolerance.py: data parallel training that goes on when a replica is lost (per-step fault tolerance
with a quorum per step, live recovery from a peer, loss-spike skip and rollback, silent-corruption checks).

The 2020 way to survive a failure is to stop: torchrun kills every worker, restarts them all, they reload the
last checkpoint from disk and train the steps since it again. On 16K GPUs that is the dominant loss (Llama 3
405B: 419 unexpected interruptions in 54 days, Dubey et al. 2024, Sec. 3.3.4). Per-step fault tolerance on the
replicated dimension (torchft, PyTorch Conference 2024; used in torchtitan) lets the healthy replicas go on:

1. Replicas, a coordinator, a quorum per step. R replicas each hold the whole model (each would be an FSDP/TP
   group in production). torchrun's agent stops every worker of a job when one dies, so each replica is its
   own process, started by the launcher (`python fault_tolerance.py --replicas R`), which restarts a dead one
   (as that replica's own `torchrun --max-restarts` would). They meet at a coordinator: a torch TCPStore
   server held by the launcher process (torchft's lighthouse; the one single point of the design: if it
   goes, every replica says so in one line and exits). Before each step every live replica checks in to
   round k with its state version; the first to see every live replica checked in, or its --join-ms
   window pass, closes the round by one atomic add (a later check-in sees it closed and tries round k+1).
   The members are who checked in before the close; with fewer than --min-replicas (torchft's
   min_replica_size) nobody trains, and they wait (bounded) for a restarted replica.
2. A group per quorum. The step's collectives run on the group the members still share when the membership
   is unchanged, else on a new gloo group under the fresh store prefix `g{k}`: never on a group with a dead
   member. On NCCL: ProcessGroupNCCL(PrefixStore(f"g{k}", store), rank, size, opts) the same way; a failed
   or timed-out communicator is aborted (pg.abort(), which ends its pending kernels so the stream does not
   hang) and dropped, and the next quorum builds a new one (ncclCommInitRank under the new prefix).
3. The batch rule. Replica r always owns shard r of every global batch (rows r*B/R..(r+1)*B/R), as
   torchft's replica groups own their data. A step's loss is the sum over the participants' tokens divided
   by the participants' token count, so the gradient is the mean over the tokens that took part: with all
   R it is plain one-process training; with fewer, one-process training on the participants' shards.
4. Commit or discard. After its all-reduce each member votes on the coordinator; the first to see every
   "yes", or a "no", or a member the coordinator knows is dead, or the --timeout pass, writes the decision
   (compare_set: there is exactly one). Only on "commit" does anyone take the optimizer step. Otherwise the
   gradient (maybe holding a dead replica's partial work) is thrown away and the same step is retried with
   the next quorum: no restart of the healthy processes, no checkpoint read.
5. Live recovery. A restarted replica checks in with version -1; the quorum's lowest member with the newest
   version broadcasts its whole state (weights, AdamW moments and steps, step, data cursor, loss history,
   rollback snapshot: one flat float64 tensor, exact for float32/bfloat16 too) and it takes part at once.
6. Loss spikes (PaLM's rollback-and-skip, Chowdhery et al. 2022, Sec. 5.1). A non-finite loss or gradient
   norm, or a loss above the mean of the last 16 by --spike-sigma standard deviations, is flagged; one
   all-reduce of the flag makes every member agree; the step is skipped (its batch consumed). After
   --max-skips in a row all roll back to the in-memory snapshot (taken every --snapshot-every steps) and go
   on from the next batch, so the batches that caused it are skipped.
7. Silent data corruption. Every --verify-every steps the members all-reduce an exact checksum of their
   weights' bytes; a member that differs from the majority is reported and repaired by the same broadcast.

       launcher: TCPStore (coordinator)   restarts replica 1 ---------------.
       replica 0  [join k][fwd|bwd|AR  X  vote: no ][join k+1][fwd|bwd|AR][commit]   [join k+2] [recv state]..
       replica 1  [join k][fwd|bwd|  killed                                          [start][join k+2][recv]..
       replica 2  [join k][fwd|bwd|AR  X  vote: no ][join k+1][fwd|bwd|AR][commit]   [join k+2] [send state]..
                            step s discarded          step s again, 2 replicas          3 again from s+1

Run (one command starts the coordinator and the replicas; R in one place, no torchrun):
    python fault_tolerance.py --replicas 3 --check
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --check  # the others go on without it
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --min-replicas 3 --check  # it rejoins
    python fault_tolerance.py --replicas 3 --inject-spike 4,8,9 --max-skips 2 --check  # skip; roll back
    python fault_tolerance.py --replicas 3 --verify-every 2 --corrupt-replica 2 --at-step 6 --check
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --recipe restart --ckpt-dir D \
        --save-every 4        # the 2020 recipe on the same run: every replica restarts, reloads from disk
Measured and printed: per failure, the ms from the kill (its timestamp on the coordinator) to the next commit
of the step it interrupted, the steps trained again, the ms until the replica is back in a quorum; goodput
(the time of the rounds whose updates are in the final model over the wall time). --recipe restart runs the
same kill the 2020 way for the same figures side by side.
Goodput at scale (the arithmetic; the run prints its own measured figures beside it). N GPUs failing at
lambda per GPU-hour give a failure every M = 1 / (N lambda) hours: Llama 3's 419 in 54 days on 16,384 GPUs is
lambda = 2.0e-5, M = 3.1 h. Restart-from-checkpoint with checkpoint cost C and restart cost T_r loses, per
failure, T_r plus on average half an interval tau, and C every tau: lost fraction ~ C/tau + (tau/2 + T_r)/M,
least at Young/Daly's tau = sqrt(2 C M): C = 1 min gives tau = 19 min, and with T_r = 10 min a loss of
0.05 + 0.11 = 16% (goodput 84%). Per-step recovery loses one step t plus the lost replica's share while it
restarts: ~ (t + T_r/R) / M per failure: t = 10 s, T_r = 10 min, R = 8 replicas is 85 s / 3.1 h = 0.8%.
In production, use torchft (its Manager, ProcessGroupBabyNCCL and lighthouse) with torchtitan.
"""
import math, os, signal, statistics, subprocess, sys, time
from collections import Counter
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from common import DTYPES, Dist, GPTConfig, MarkovData, build_gpt, count_tokens, fail, lm_loss, make_optimizer
from harness import CommonArgs, check_common_args, log_step, parse_args, tolerance, write_summary


@dataclass
class Args(CommonArgs):
    batch_size: int = 12  # global batch, in sequences: R shards of B/R (divisible by 2, 3, 4)
    replicas: int = 3  # R replica processes, each holding the whole model
    join_ms: float = 300.0  # a quorum closes when every live replica checked in, or this long after one did
    min_replicas: int = 1  # a smaller quorum does not train: its members wait for replicas to come back
    kill_replica: int = -1  # SIGKILL this replica (first life only) at --at-step, in --phase
    at_step: int = -1  # the step of --kill-replica and of --corrupt-replica
    phase: Literal["before", "during", "after"] = "during"  # before check-in / the all-reduce / the vote
    max_restarts: int = 1  # the launcher restarts a killed replica (or, --recipe restart, the job) this often
    recipe: Literal["live", "restart"] = "live"  # live recovery, or the whole job restarts from --ckpt-dir
    spike_sigma: float = 6.0  # a loss above the mean of the last 16 by this many standard deviations
    max_skips: int = 2  # after this many skipped steps in a row, roll back to the snapshot
    snapshot_every: int = 4  # take the in-memory rollback snapshot every N steps
    inject_spike: str = ""  # comma-separated batch ids whose loss is multiplied by 1e4 (a spike, for tests)
    verify_every: int = 0  # compare the replicas' weight checksums every N steps (0: never)
    corrupt_replica: int = -1  # perturb this replica's weights at the start of --at-step (first life only)
    coordinator: str = ""  # (set by the launcher) host:port of the coordinator's store
    replica: int = -1  # (set by the launcher) this process's replica id; -1: be the launcher
    life: int = 0  # (set by the launcher) how many times this replica was started before


# ----------------------------------------------------------------------------- 1. the quorum
CLOSED = 1 << 20  # added to a round's check-in count to close it: a later check-in sees a count above it


@dataclass
class Member:
    rid: int  # replica id: it owns shard rid of every batch
    life: int  # restarts so far: a restarted replica is a new member
    version: int  # committed rounds its state has seen; -1: it has no state and must recover
    step: int  # its step (the quorum's step is the newest member's)
    gid: int  # the round whose process group it still holds (-1: none)
    gsize: int  # that group's size


def join_round(store, k, me, expected, window_s, timeout_s):
    """Check in to round k. Returns its members (sorted by replica id), or None when the round had closed
    before this check-in (try k + 1). `expected()`: how many check-ins to wait for before closing."""
    if k < 0 or window_s <= 0 or timeout_s <= 0:
        raise ValueError(f"join_round needs k >= 0, window_s, timeout_s > 0, got {k, window_s, timeout_s}")
    slot = store.add(f"q{k}/n", 1)
    if slot > CLOSED:
        return None
    store.set(f"q{k}/slot{slot}", " ".join(map(str, astuple(me))))
    t0 = time.monotonic()
    while not store.check([f"q{k}/size"]):
        if store.add(f"q{k}/n", 0) >= expected() or time.monotonic() - t0 > window_s:
            n = store.add(f"q{k}/n", CLOSED)  # atomic: whoever gets n < 2 * CLOSED closed it, at n - CLOSED
            if n < 2 * CLOSED:
                store.set(f"q{k}/size", str(n - CLOSED))
                store.set("round", str(k))  # where a newly started replica begins to look
        elif time.monotonic() - t0 > window_s + timeout_s:
            raise TimeoutError(f"round {k} never closed")
        time.sleep(0.001)
    members = {}
    for i in range(1, int(store.get(f"q{k}/size")) + 1):  # get() waits for a slot written late
        m = Member(*map(int, store.get(f"q{k}/slot{i}").split()))
        members[m.rid] = m  # a replica restarted after checking in: its newer life replaces the dead one
    return sorted(members.values(), key=lambda m: m.rid)


def rank_in(members, me):
    """me's rank in the quorum's group: its place among the members (sorted by id, as join_round's)."""
    rids = [m.rid for m in members]
    if me.rid not in rids or rids != sorted(set(rids)):
        raise ValueError(f"replica {me.rid} must be one of the members {rids}, each once, sorted by id")
    return rids.index(me.rid)


def quorum_group(store, k, members, me, held, timeout_s):
    """The quorum's process group: the one all members still hold when they hold the same one and nobody
    left (unchanged membership), else a new gloo group under the fresh prefix g{k}. `held`: (gid, pg)."""
    if held and {m.gid for m in members} == {held[0]} and members[0].gsize == len(members):
        return held
    rank = rank_in(members, me)
    return k, dist.ProcessGroupGloo(dist.PrefixStore(f"g{k}", store), rank, len(members),
                                    timedelta(seconds=timeout_s))


def vote(store, k, members, me, ok, timeout_s):
    """Two-phase commit on the coordinator: each member says whether its collectives succeeded; the first
    to see every "yes", any "no", a member the coordinator marked dead, or the deadline, proposes the
    decision, and compare_set keeps only the first proposal: every member reads the same one."""
    rank_in(members, me)  # (refuses a `me` outside the members)
    if timeout_s <= 0:
        raise ValueError(f"vote needs timeout_s > 0 (else it aborts before the others vote), got {timeout_s}")
    store.set(f"q{k}/vote{me.rid}", "yes" if ok else "no")
    keys, dead = [f"q{k}/vote{m.rid}" for m in members], [f"dead/{m.rid}.{m.life}" for m in members]
    t0 = time.monotonic()
    while not store.check([f"q{k}/decision"]):
        votes = [store.get(key) for key in keys if store.check([key])]
        if (len(votes) == len(keys) or b"no" in votes or any(store.check([d]) for d in dead)
                or time.monotonic() - t0 > timeout_s):
            store.compare_set(f"q{k}/decision", "", "commit" if votes.count(b"yes") == len(keys) else "abort")
        time.sleep(0.001)
    return store.get(f"q{k}/decision") == b"commit"


# ----------------------------------------------------------------------------- 2. the state and its recovery
class Replica:
    """One replica's state; its flat float64 form (exact for float32/bfloat16 too) is what recovery sends."""

    def __init__(self, model, opt, steps):
        if type(opt).__name__ not in ("Adam", "AdamW") or any(g["amsgrad"] for g in opt.param_groups):
            raise ValueError(f"Replica sends Adam(W)'s exp_avg, exp_avg_sq, step, not {type(opt).__name__}'s "
                             "or amsgrad's: give it torch.optim.AdamW, or Adam without amsgrad")
        self.model, self.opt, self.steps = model, opt, steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        for p in self.params:  # AdamW's state, made now as its first step() would: one form at every step
            opt.state[p] = dict(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p),
                                exp_avg_sq=torch.zeros_like(p))
        self.tensors = self.params + [opt.state[p][key] for key in ("exp_avg", "exp_avg_sq", "step")
                                      for p in self.params]  # everything that a step changes in place
        self.version, self.step, self.batch, self.skips = 0, 0, 0, 0
        self.losses = []  # the loss of every applied update: the spike detector's history
        self.snapshot = self.core()  # what a rollback restores (a copy of a recent step's core)

    def core(self):
        """(3P + n_params + 5 + steps,) weights | exp_avg | exp_avg_sq | AdamW steps | counters, losses."""
        meta = [self.version, self.step, self.batch, self.skips, len(self.losses)]
        meta += self.losses + [math.nan] * (self.steps - len(self.losses))
        flat = [t.detach().double().reshape(-1) for t in self.tensors]
        return torch.cat(flat + [torch.tensor(meta, dtype=torch.float64, device=flat[0].device)])

    def load_core(self, flat):
        sizes = [t.numel() for t in self.tensors]
        for t, v in zip(self.tensors, flat[:sum(sizes)].split(sizes)):
            t.detach().copy_(v.view_as(t))
        meta = flat[sum(sizes):].tolist()
        self.version, self.step, self.batch, self.skips, n_losses = map(int, meta[:5])
        self.losses = meta[5:5 + n_losses]

    def full(self):  # core | snapshot: everything a recovering replica needs
        return torch.cat([self.core(), self.snapshot])

    def load_full(self, flat):
        self.load_core(flat[:flat.numel() // 2])
        self.snapshot = flat[flat.numel() // 2:].clone()


def checksum(params):
    """An exact fingerprint of the weights' bytes (a position-weighted byte sum: any changed byte shows)."""
    b = torch.cat([p.detach().reshape(-1).view(torch.uint8) for p in params]).long()  # (bytes,)
    return (b * (torch.arange(b.numel(), device=b.device) % 251 + 1)).sum()


def sync_state(pg, members, me, rep, verify):
    """Before the step every member holds the same state. 1. With `verify`, the newest members all-reduce
    their checksums (one slot each): one that differs from the majority is corrupt. 2. The lowest newest
    member with the majority checksum broadcasts its whole state to the members behind (a restarted replica
    recovers live) and the corrupt (repaired). Returns (corrupt ids, receiving ids, bytes broadcast)."""
    i_me, newest = rank_in(members, me), max(m.version for m in members)
    if pg.size() != len(members):
        raise ValueError(f"sync_state needs the quorum's group, of {len(members)} members: got {pg.size()}")
    if newest < 0:
        raise RuntimeError("no member of the quorum holds a state to recover from")  # (a later quorum may)
    up = [i for i, m in enumerate(members) if m.version == newest]
    sums = torch.zeros(len(members), dtype=torch.long, device=rep.params[0].device)
    if verify:
        if i_me in up:
            sums[i_me] = checksum(rep.params)
        pg.allreduce([sums]).wait()  # (members,) every member's checksum, everywhere
    votes = Counter(sums[i].item() for i in up)
    best = max(votes, key=lambda c: (votes[c], -min(i for i in up if sums[i] == c)))  # majority, then lowest
    bad = [i for i in up if sums[i] != best]
    src = min(i for i in up if sums[i] == best)
    receivers = [i for i, m in enumerate(members) if m.version < newest or i in bad]
    if not receivers:
        return [], [], 0
    flat = rep.full() if i_me == src else torch.empty_like(rep.full())
    pg.broadcast(flat, src).wait()  # (state,) the source's whole state
    if i_me in receivers:
        rep.load_full(flat)
    nbytes = flat.numel() * flat.element_size()
    return [members[i].rid for i in bad], [members[i].rid for i in receivers], nbytes


# ----------------------------------------------------------------------------- 3. the step
def shard(x, y, rid, replicas):
    if x.shape[0] % replicas or not 0 <= rid < replicas:
        raise ValueError(f"replica {rid} of {replicas} needs an id in 0..{replicas - 1} and a batch of rows "
                         f"divisible by {replicas}, got {x.shape[0]}")
    rows = x.shape[0] // replicas  # replica rid always owns these rows of the global batch
    return x[rid * rows:(rid + 1) * rows], y[rid * rows:(rid + 1) * rows]  # (B/R, T) each


def local_grads(model, x, y, members, me, replicas, loss_fn, count, loss_scale=1.0):
    """Forward + backward on this replica's shard; `loss_fn(out, y, n)` sums over its shard and divides by
    n = `count` of *all participants'* shards, so the all-reduced sum is the mean over who took part."""
    n_tok = sum(count(shard(x, y, m.rid, replicas)[1]) for m in members)
    xs, ys = shard(x, y, me.rid, replicas)
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model(xs), ys, n_tok) * loss_scale
    loss.backward()
    return loss.detach()


def allreduce_grads(pg, params, loss):
    """One all-reduce of the flat gradient and the loss over the quorum; returns the participants' loss."""
    if any(p.grad is None for p in params):
        raise ValueError("a parameter has no gradient: every replica's loss must reach every parameter")
    flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.reshape(1).to(params[0].grad.dtype)])
    pg.allreduce([flat]).wait()  # (P + 1,) SUM over the members
    for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    return flat[-1].item()


def is_spike(loss, norm, history, sigma, window=16):
    """Non-finite, or above the mean of the last `window` losses by `sigma` standard deviations."""
    if not (math.isfinite(loss) and math.isfinite(norm)):
        return True
    h = history[-window:]
    return len(h) >= 4 and loss > statistics.mean(h) + sigma * statistics.stdev(h)


def agree(pg, flag, device):
    """Every member's flag, summed: all agree to skip if any saw a spike (one all-reduce)."""
    t = torch.tensor([float(flag)], dtype=torch.float64, device=device)
    pg.allreduce([t]).wait()
    return t.item() > 0


def apply_update(rep, loss, spike, norm, clip, max_skips, snapshot_every):
    """The committed step: the optimizer step, or a skip (the batch is consumed, the weights stay), or after
    `max_skips` skips in a row a rollback to the snapshot, going on from the next batch. Returns which."""
    if max_skips < 1 or snapshot_every < 1:
        raise ValueError(f"max_skips and snapshot_every must be >= 1, got {max_skips} and {snapshot_every}")
    rep.version, rep.batch = rep.version + 1, rep.batch + 1
    if not spike:
        if clip > 0:
            torch.nn.utils.clip_grads_with_norm_(rep.params, clip, norm)
        rep.opt.step()
        rep.step, rep.skips = rep.step + 1, 0
        rep.losses.append(loss)
        if rep.step % snapshot_every == 0:
            rep.snapshot = rep.core()
        return "update"
    rep.skips += 1
    if rep.skips < max_skips:
        return "skip"
    version, batch = rep.version, rep.batch
    rep.load_core(rep.snapshot)  # weights, AdamW, step and loss history of the snapshot's step
    rep.version, rep.batch, rep.skips = version, batch, 0  # but the data goes on: the bad batches are skipped
    return "rollback"


def check_args(args):
    check_common_args(args)
    R = args.replicas
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        fail("start it with python fault_tolerance.py --replicas R, not torchrun: it starts its own replicas")
    if R < 1 or args.batch_size % R:
        fail(f"--batch-size {args.batch_size} must be divisible by --replicas {R} (each owns a shard); "
             f"try --batch-size {R * max(1, args.batch_size // max(R, 1))}")
    for name in ("kill_replica", "corrupt_replica"):
        v = getattr(args, name)
        if v >= 0 and not (v < R and 0 <= args.at_step < args.steps):
            fail(f"--{name.replace('_', '-')} {v} needs a replica in 0..{R - 1} and --at-step in "
                 f"0..{args.steps - 1}, got --at-step {args.at_step}")
    if args.kill_replica >= 0 and R < 2:
        fail("--kill-replica needs --replicas 2 or more: someone must go on")
    if args.dropout:
        fail("--dropout must be 0: the replayed reference draws no dropout masks")
    if args.fail_at_step >= 0:
        fail("--fail-at-step is torchrun's restart test: here use --kill-replica R --at-step S")
    if args.recipe == "restart" and not (args.ckpt_dir and args.save_every > 0):
        fail("--recipe restart needs --ckpt-dir DIR and --save-every N (it restarts from disk)")
    if args.recipe == "live" and args.ckpt_dir:
        fail("--ckpt-dir is for --recipe restart: live recovery reads no disk")
    if not all(b.strip().isdigit() for b in args.inject_spike.split(",") if b):
        fail(f"--inject-spike takes comma-separated batch ids, got {args.inject_spike!r}")
    for name in ("max_skips", "snapshot_every", "join_ms", "spike_sigma"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if not 1 <= args.min_replicas <= R:
        fail(f"--min-replicas must be in 1..--replicas {R}, got {args.min_replicas}")
    if args.max_restarts < 0 or args.verify_every < 0:
        fail("--max-restarts and --verify-every must be >= 0")
    if args.replica >= R or (args.replica >= 0 and ":" not in args.coordinator):
        fail("--replica and --coordinator are the launcher's: run python fault_tolerance.py --replicas N")


# ----------------------------------------------------------------------------- 4. this repo's run of it
# One replica: the GPT and its data on the cores above, the faults the tests inject, the log. The launcher
# (below the measurement fence) starts it, and on its death marks it on the coordinator (dead/{rid}.{life})
# and counts it out ("alive"): what a vote and the next quorum see.
def train_replica(args):
    host, port = args.coordinator.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=args.timeout))
    device = torch.device("cpu")  # gloo; on GPUs: cuda:LOCAL_RANK and ProcessGroupNCCL (see the docstring)
    data, R, B = MarkovData(args.vocab, args.seed), args.replicas, args.batch_size
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    rep = Replica(model, make_optimizer(model.parameters(), args), args.steps)
    rep.version = -1 if args.life > 0 else 0  # restarted: no state until a peer gives it
    load_checkpoint(args, rep)  # (--recipe restart only: the 2020 way, from disk)
    me, started = Member(args.replica, args.life, rep.version, 0, -1, 0), False
    store.add("alive", 1)
    # Until its first commit a replica waits for all R (a run starts, or the whole job restarts, together);
    # afterwards only for the replicas alive now, as the launcher counts them (torchft's heartbeats).
    expected = lambda: int(store.add("alive", 0)) if started else R  # noqa: E731
    held, k = None, int(store.get("round")) if store.check(["round"]) else 0
    inject = {int(b) for b in args.inject_spike.split(",") if b}
    log, short_since = Log(store, args, me, rep), None
    while rep.step < args.steps and not store.check(["finished"]):
        inject_faults(args, store, rep, "before")
        me.version, me.step = rep.version, rep.step
        me.gid, me.gsize = (held[0], held[1].size()) if held else (-1, 0)
        t_start = time.time()
        window = args.join_ms / 1e3 if started else max(60, args.timeout)  # (a start waits for everyone)
        members = join_round(store, k, me, expected, window, args.timeout)
        k += 1
        if members is None:
            continue
        if len(members) < args.min_replicas:  # too few: wait (bounded) for a restarted replica to join
            short_since = short_since or time.monotonic()
            if time.monotonic() - short_since > max(60, args.timeout):
                raise TimeoutError(f"fewer than --min-replicas {args.min_replicas} replicas for too long")
            time.sleep(args.join_ms / 1e3)
            continue
        if rep.batch > 4 * args.steps + 16:  # every loop is bounded, a spike that never ends too
            raise TimeoutError(f"{rep.batch} batches used for {rep.step} steps: the loss keeps spiking")
        ok, spike, loss, norm, short_since = False, False, math.nan, torch.tensor(math.nan), None
        step, batch = rep.step, rep.batch
        try:
            held = quorum_group(store, k - 1, members, me, held, args.timeout)
            pg, newest = held[1], max(members, key=lambda m: m.version)
            verify = args.verify_every > 0 and newest.step % args.verify_every == 0
            log.synced(k - 1, members, newest.step, *sync_state(pg, members, me, rep, verify))
            step, batch = rep.step, rep.batch
            x, y = data.batch(batch, B, args.seq_len, args.ragged)  # (B, T) the global batch, CPU
            scale = 1e4 if batch in inject else 1.0  # (--inject-spike: a spike, for the tests)
            mine = local_grads(model, x, y, members, me, R, lm_loss, count_tokens, scale)
            inject_faults(args, store, rep, "during")
            loss = allreduce_grads(pg, rep.params, mine)
            norm = torch.nn.utils.get_total_norm([p.grad for p in rep.params])  # of the whole gradient
            spike = agree(pg, is_spike(loss, norm.item(), rep.losses, args.spike_sigma), device)
            inject_faults(args, store, rep, "after")
            ok = True
        except (RuntimeError, TimeoutError, dist.DistError) as e:
            log.failed(k - 1, e)
        if not vote(store, k - 1, members, me, ok, args.timeout):
            held = pg = None  # may hold a dead member: dropped now (NCCL: pg.abort()), which frees a member
            continue  # still waiting in it for us (it joins the next round in time); rebuilt next round
        what = apply_update(rep, loss, spike, norm, args.clip, args.max_skips, args.snapshot_every)
        started = True
        log.committed(k - 1, members, t_start, step, batch, what, loss)  # (--recipe restart: and saves)
    if rep.step < args.steps:
        return 0  # the run ended without this replica (it came back after the last step)
    code = log.finish(members, held[1])  # (the members compare their weights by one all-reduce; the --check)
    store.set("finished", "1")  # a replica restarted now exits at once
    return code


def main():
    args = parse_args(Args)
    check_args(args)
    if args.replica < 0:
        print(f"fault_tolerance.py: {args.replicas} replicas, recipe {args.recipe}, coordinator in this "
              f"process (pid {os.getpid()})", flush=True)
        sys.exit(launch(args))
    try:
        code = train_replica(args)
    except TimeoutError as e:
        sys.stderr.write(f"fault_tolerance.py: error (replica {args.replica}): {e}\n")
        code = 1
    except (dist.DistStoreError, dist.DistNetworkError, ConnectionError) as e:
        sys.stderr.write(f"fault_tolerance.py: error (replica {args.replica}): the coordinator at "
                         f"{args.coordinator} is gone ({type(e).__name__}); it is the single point of this "
                         "design, as torchft's lighthouse is: restart the run\n")
        code = 3
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown, in which gloo's threads may still hold tensors


# --- measurement ---
# The faults the tests inject (--kill-replica, --corrupt-replica), and the checkpoint of the recipe measured
# beside live recovery (--recipe restart).
def inject_faults(args, store, rep, phase):
    """--kill-replica / --corrupt-replica, on the replica's first life only: the faults the tests inject."""
    if args.life > 0 or rep.step != args.at_step:
        return
    if args.replica == args.corrupt_replica and phase == "before" and rep.version >= 0 \
            and not getattr(rep, "corrupted", False):
        with torch.no_grad():  # a silent flip of one weight: nothing fails, the numbers are just wrong
            rep.params[0].view(-1)[0] += 1e-3
        rep.corrupted = True  # once (a discarded step comes back to this point)
    if args.replica == args.kill_replica and phase == args.phase:
        store.set(f"killed/{args.replica}", f"{time.time()!r} {rep.step}")  # when, for the recovery figures
        print(f"replica {args.replica}: SIGKILL at step {rep.step} ({phase} its all-reduce)", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


# The recipe measured beside live recovery (--recipe restart): the launcher stops every replica when one dies
# and restarts them all; they reload the newest checkpoint from disk and train the steps since it again.
def ckpt_path(args):
    return os.path.join(args.ckpt_dir, "state.pt")


def load_checkpoint(args, rep):
    """--recipe restart: a restarted replica reads the whole state from disk (live recovery reads none)."""
    if args.recipe == "restart" and args.life > 0 and os.path.exists(ckpt_path(args)):
        rep.load_full(torch.load(ckpt_path(args)))


def save_checkpoint(args, rep, writer):
    """--recipe restart: the lowest member writes the whole state (atomic: a temporary file, renamed)."""
    if writer:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save(rep.full(), ckpt_path(args) + ".tmp")
        os.replace(ckpt_path(args) + ".tmp", ckpt_path(args))


def stop_all(store, lives, r):
    """--recipe restart: replica r died; the launcher kills every other one too. Returns whom to restart."""
    for q, procs in lives.items():
        if q != r and procs[-1].poll() is None:
            procs[-1].kill()
            procs[-1].wait()
            store.set(f"dead/{q}.{len(procs) - 1}", "1")
            store.add("alive", -1)
    return list(lives)


# The launcher: torchrun's part (start the processes, watch them, restart a dead one), which a cluster's
# scheduler plays in production. It holds the coordinator and marks a death on it for the quorum and the vote.
def launch(args):
    """The coordinator (a TCPStore server: the single point of the design) and R replica processes. A
    replica killed by a signal is restarted (--recipe restart: all are); on any exit, all are killed."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=args.timeout))
    cmd = [sys.executable, sys.argv[0], *sys.argv[1:], "--coordinator", f"127.0.0.1:{store.port}"]
    spawn = lambda r, life: subprocess.Popen(cmd + ["--replica", str(r), "--life", str(life)])  # noqa: E731
    lives = {r: [spawn(r, 0)] for r in range(args.replicas)}
    codes, restarts, t0, R = {}, 0, time.time(), args.replicas
    limit_s = 300 + args.timeout * (args.steps + 10)  # (every wait of a replica is bounded: a safety net)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` kills the children
    try:
        while len(codes) < R and time.time() - t0 < limit_s:
            for r, procs in lives.items():
                code = procs[-1].poll()
                if code is None or r in codes:
                    continue
                store.set(f"dead/{r}.{len(procs) - 1}", "1")  # a vote waiting for it ends now
                store.add("alive", -1)
                if code < 0 and restarts < args.max_restarts and not store.check(["finished"]):
                    restarts += 1
                    for q in [r] if args.recipe == "live" else stop_all(store, lives, r):
                        lives[q].append(spawn(q, len(lives[q])))
                else:
                    codes[r] = code
            time.sleep(0.01)
    finally:
        for p in [p for procs in lives.values() for p in procs if p.poll() is None]:
            p.kill()
            p.wait()
    if len(codes) < R:
        print(f"fault_tolerance.py: error: over {limit_s} s; every replica stopped", file=sys.stderr)
    finished = store.check(["finished"])  # (a replica killed and not restarted is no failure of the run)
    rc = max([c for c in codes.values() if c > 0], default=0) or (0 if finished and len(codes) == R else 1)
    add_launcher_figures(args, lives, codes, restarts, time.time() - t0)
    return rc


class Log:
    """What the run records on the coordinator (per committed round and per update, by the round's lowest
    member) and prints; at the end, the figures and the --check. Watches from outside the technique."""

    def __init__(self, store, args, me, rep):
        self.store, self.args, self.me, self.rep = store, args, me, rep
        self.step_ms = []

    def failed(self, k, e):
        print(f"replica {self.me.rid}: round {k} failed ({type(e).__name__}: {str(e).splitlines()[0][:90]}); "
              "the step is discarded", flush=True)

    def synced(self, k, members, step, bad, receivers, nbytes):
        if self.me.rid != members[0].rid:
            return
        for rid in bad:
            print(f"silent corruption: replica {rid}'s weights differ from the majority at step {step}; "
                  f"repaired from a peer", flush=True)
            self.store.set(f"sdc/{self.store.add('sdc', 1)}", f"{rid} {step}")
        if receivers:
            who = ",".join(map(str, receivers))
            self.store.set(f"recv/{self.store.add('recv', 1)}", f"{k} {who} {nbytes}")

    def committed(self, k, members, t_start, step, batch, what, loss):
        a, writer = self.args, self.me.rid == members[0].rid
        if a.recipe == "restart" and what == "update" and self.rep.step % a.save_every == 0:
            save_checkpoint(a, self.rep, writer)
        if not writer:
            return
        s, t_end = self.store, time.time()
        rids = ",".join(str(m.rid) for m in members)
        s.set(f"t/{k}", f"{t_start!r} {t_end!r} {step} {what}")
        self.step_ms.append(1e3 * (t_end - t_start))
        if what == "update":
            s.set(f"upd/{step}", f"{k} {batch} {rids} {loss!r}")
            log_step(Dist(0, 1, 0, torch.device("cpu"), "gloo"), step, loss, 1e3 * (t_end - t_start),
                     a.batch_size * a.seq_len * len(members) // a.replicas)
        else:
            print(f"step {step:4d} | {what}: batch {batch} loss {loss:.4g} flagged as a spike "
                  f"(replicas {rids})", flush=True)
            s.set(f"{what}/{s.add(what, 1)}", f"{step} {batch}")

    def finish(self, members, pg):
        """The members of the last round end together: one all-reduce of their checksums shows whether they
        hold identical weights. The lowest then writes the figures and runs the --check."""
        s, a, rep = self.store, self.args, self.rep
        sums = torch.zeros(len(members), dtype=torch.long, device=rep.params[0].device)
        sums[[m.rid for m in members].index(self.me.rid)] = checksum(rep.params)
        pg.allreduce([sums]).wait()
        if self.me.rid != members[0].rid:
            return 0
        identical, model, device = bool((sums == sums[0]).all()), rep.model, rep.params[0].device
        recs = [s.get(f"upd/{i}").decode().split() for i in range(a.steps)]
        rounds = [int(r[0]) for r in recs]
        batches, masks, losses = [int(r[1]) for r in recs], [list(map(int, r[2].split(","))) for r in recs], \
            [float(r[3]) for r in recs]
        figures = recovery_figures(s, a, rounds)
        listed = lambda key: [s.get(f"{key}/{i}").decode() for i in range(1, s.add(key, 0) + 1)]  # noqa: E731
        figures.update(batches=batches, members=masks, replicas_identical=identical,
                       corruptions=listed("sdc"), skips=listed("skip"), rollbacks=listed("rollback"),
                       recoveries=listed("recv"))
        print(f"summary: replicas identical at the end: {identical}; members per step {masks}", flush=True)
        check = None
        if a.check:
            ref = replay_reference(a, batches, masks, device)
            params = {n: p.detach() for n, p in model.named_parameters()}
            loss_diff = max(abs(x - r) / max(abs(r), 1e-12) for x, r in zip(losses, ref["losses"]))
            param_diff = max((params[n] - p).abs().max().item() for n, p in ref["params"].items())
            tol = tolerance(a.dtype)  # the repo's: 1e-9 in float64 (parameters: 10x in float32, as harness)
            ptol = (10 if a.dtype == "float32" else 1) * tol
            passed = identical and loss_diff <= tol and param_diff <= ptol
            print(f"check vs the one-process reference replaying the membership: max rel loss diff "
                  f"{loss_diff:.3e} (tolerance {tol:.0e}), max param diff {param_diff:.3e} ({ptol:.0e}), "
                  f"replicas identical {identical} -> {'PASSED' if passed else 'FAILED'}", flush=True)
            check = dict(max_loss_diff=loss_diff, max_param_diff=param_diff, passed=passed)
        ms = sorted(self.step_ms)[len(self.step_ms) // 2] if self.step_ms else 0.0
        d = Dist(0, a.replicas, 0, device, "gloo")
        state = sum(t.numel() * t.element_size() for t in [rep.core()])
        write_summary(d, a, "fault-tolerance", losses, ms, a.batch_size * a.seq_len / max(ms, 1e-9) * 1e3,
                      state, 0, check, figures)
        return 0 if check is None or check["passed"] else 1


def recovery_figures(s, a, rounds):
    """Per failure: ms and rounds from the kill to the next commit of the step it interrupted (or a later
    one); goodput: the time of the rounds whose updates are in the final model over the wall time."""
    t = {k: s.get(f"t/{k}").decode().split() for k in range(max(rounds) + 1) if s.check([f"t/{k}"])}
    t = {k: (float(v[0]), float(v[1]), int(v[2]), v[3]) for k, v in t.items()}
    wall = max(v[1] for v in t.values()) - min(v[0] for v in t.values())
    useful, until = 0.0, -math.inf  # the union of the committed rounds' spans: each is timed by its own
    for t0, t1 in sorted(t[k][:2] for k in rounds):  # lowest member from before its check-in: they overlap
        useful, until = useful + max(0.0, t1 - max(t0, until)), max(until, t1)
    out = dict(goodput=useful / wall, wall_s=wall, useful_s=useful, failures=[])
    for r in range(a.replicas):
        if not s.check([f"killed/{r}"]):
            continue
        t_kill, step = (f(x) for f, x in zip((float, int), s.get(f"killed/{r}").decode().split()))
        after = sorted((v[1], k) for k, v in t.items() if v[1] > t_kill and v[2] >= step and v[3] == "update")
        if not after:
            continue
        t_next, k_next = after[0]
        # redone: an update begun after the kill for a step the run had passed (a restart's rollback); a
        # round of an earlier step that was still ending when the kill came is not one
        redone = sum(1 for k, v in t.items()
                     if v[0] > t_kill and v[2] < step and k < k_next and v[3] == "update")
        rejoin = min((v[1] for k, v in t.items() if v[1] > t_kill and k in rounds
                      and r in member_ids(s, k)), default=math.nan)
        out["failures"].append(dict(replica=r, step=step, ms_to_next_commit=1e3 * (t_next - t_kill),
                                    steps_redone=redone, ms_to_rejoin=1e3 * (rejoin - t_kill)))
        print(f"summary: replica {r} killed at step {step} ({a.phase} its all-reduce, recipe {a.recipe}): "
              f"{1e3 * (t_next - t_kill):.0f} ms to the next commit of step >= {step} (measured), "
              f"{redone} steps redone, back in a quorum after {1e3 * (rejoin - t_kill):.0f} ms", flush=True)
    print(f"summary: goodput {out['goodput']:.3f} (committed steps' time {useful:.2f} s / wall {wall:.2f} s, "
          "measured); theory at scale: see the docstring (Young/Daly)", flush=True)
    return out


def member_ids(s, k):
    slots = int(s.get(f"q{k}/size")) if s.check([f"q{k}/size"]) else 0
    return {int(s.get(f"q{k}/slot{i}").split()[0]) for i in range(1, slots + 1)}


def add_launcher_figures(args, lives, codes, restarts, wall_s):
    """The launcher's own record in --json: every process it started (the healthy ones keep one pid)."""
    import json
    if not args.json or not os.path.exists(args.json):
        return
    with open(args.json) as f:
        summary = json.load(f)
    summary["launcher"] = dict(pid=os.getpid(), pids={r: [p.pid for p in ps] for r, ps in lives.items()},
                               restarts=restarts, exit_codes=codes, wall_s=wall_s)
    with open(args.json + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(args.json + ".tmp", args.json)


# --- reference for --check ---
def replay_reference(args, batches, members, device="cpu"):
    """One process, the membership the run had: update s trains on the shards of the replicas in members[s]
    of batch batches[s] (a skipped or rolled-back batch is simply absent), AdamW, torch's clipping."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, losses, rows = make_optimizer(model.parameters(), args), [], args.batch_size // args.replicas
    for b, ids in zip(batches, members):
        x, y = data.batch(b, args.batch_size, args.seq_len, args.ragged)
        keep = torch.cat([torch.arange(r * rows, (r + 1) * rows) for r in ids])  # the participants' rows
        x, y = x[keep].to(device), y[keep].to(device)
        loss = lm_loss(model(x), y, count_tokens(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


if __name__ == "__main__":
    main()
