"""fault_tolerance.py: data parallel training that goes on when a replica is lost, hangs or is
corrupted.

Per-step fault tolerance: a quorum per step, live recovery from a peer, loss-spike skip and
rollback, silent-corruption checks. The 2020 way to survive a failure is to stop: torchrun kills
every worker, restarts them all, they reload the last checkpoint from disk and train the steps since
it again. On 16K GPUs that is the dominant loss (Llama 3 405B: 419 unexpected interruptions in 54
days, Dubey et al. 2024, Sec. 3.3.4). Per-step fault tolerance on the replicated dimension (torchft,
PyTorch Conference 2024; used in torchtitan) lets the healthy replicas go on:

1. Replicas, a coordinator, leases, a quorum per step. R replicas each hold the whole model (each
   would be
   an FSDP/TP group in production). torchrun's agent stops every worker of a job when one dies, so
   each replica is its own process, started by a plain supervisor (ft_launcher.py, which `python
   fault_tolerance.py --replicas R` starts), which restarts a dead one (as that replica's own
   `torchrun --max-restarts` would). They meet at a coordinator: a torch TCPStore server held by the
   supervisor (torchft's lighthouse; the one single point of the design: if it goes, every replica
   says so in one line and exits; --host binds it where other nodes reach it). Each replica owns its
   failure detection: a thread keeps its lease on the coordinator fresh (torchft's heartbeats), and
   a replica whose lease is older than --lease-ms (killed, or frozen) is gone for its peers at once.
   Before each step every live replica checks in to round k with its state version; the first to see
   every replica holding a lease checked in, or its --join-ms window pass with a strict majority of
   them (torchft's rule: no split brain), closes the round: one compare_set of its size n, the first
   n check-ins (a later check-in sees it closed and tries round k+1, where it waits for the others).
   It never closes with fewer than --min-replicas (torchft's min_replica_size): they wait (bounded)
   for a restarted one.
2. A group per quorum, every wait with a deadline. The step's collectives run on the group the
   members
   still share when the membership is unchanged, else on a new one under the fresh store prefix
   `g{k}`: never on a group with a dead member. On CPU gloo; with CUDA each replica on cuda:(id %
   GPUs) and a non-blocking ProcessGroupNCCL, connected as soon as it is made, inside the round (a
   member lost in NCCL's bootstrap fails the round; torch waits for that init by
   TORCH_NCCL_NONBLOCKING_TIMEOUT alone, which the supervisor sets to --timeout: its default is 30
   minutes). NCCL reports no dead or frozen peer, it waits: so the host polls every collective, and
   as soon as a member's lease lapses, or past the --timeout deadline (a member alive but stuck
   keeps its lease), it aborts the group (pg.abort() ends its pending kernels; destroy_process_group
   would wait for them) and votes no (torchft's ProcessGroupNCCL). The supervisor sets
   TORCH_NCCL_ASYNC_ERROR_HANDLING=0 and TORCH_NCCL_ENABLE_MONITORING=0 for the replicas: the
   watchdog, which by default takes the *healthy* process down at the group's timeout, must not
   decide; the group's own timeout, 2 x --timeout, only bounds how long pg.abort() waits for NCCL's
   abort. An ncclCommAbort that hangs holds the replica that long (torchft's ProcessGroupBabyNCCL
   runs NCCL in a subprocess it can kill, for this).
3. The batch rule. Replica r always owns shard r of every global batch (rows r*B/R..(r+1)*B/R), as
   torchft's replica groups own their data. A step's loss is the sum over the participants' tokens
   divided by the participants' token count, so the gradient is the mean over the tokens that took
   part: with all R it is plain one-process training; with fewer, one-process training on the
   participants' shards.
4. Commit or discard. After its all-reduce each member votes on the coordinator; the first to see
   every
   "yes", or a "no", or a member whose lease lapsed, or the --timeout pass, writes the decision
   (compare_set: there is exactly one). Rounds decide in order, each decision carrying the committed
   version, and a round commits only from the newest one: at most one quorum commits each step,
   whatever the timing. Only on "commit" does anyone take the optimizer step. Otherwise the gradient
   (maybe holding a dead replica's partial work) is thrown away and the same step is retried with
   the next quorum: no restart of the healthy processes, no checkpoint read.
5. Live recovery. A restarted replica checks in with version -1; the quorum's lowest member with the
   newest
   version broadcasts its whole state (weights, AdamW moments and steps, rollback snapshot: one
   broadcast per tensor, in its own dtype, one tensor at a time, so that a member holds one extra
   tensor, never a second state; step, data cursor and loss history in one small float64 tensor) and
   it takes part at once.
6. Loss spikes (PaLM's rollback-and-skip, Chowdhery et al. 2022, Sec. 5.1). A non-finite loss or
   gradient
   norm, or a loss above the mean of the last 16 by --spike-sigma standard deviations, is flagged;
   one all-reduce of the flag makes every member agree; the step is skipped (its batch consumed).
   After --max-skips in a row all roll back to the in-memory snapshot (taken every --snapshot-every
   steps) and go on from the next batch, so the batches that caused it are skipped.
7. Silent data corruption, forks. Every --verify-every steps, and whenever the membership changed,
   the
   members all-reduce an exact checksum of their weights' bytes; one that differs from the majority
   (same version, other weights) is reported and repaired by the same broadcast before it trains.
The code's sections 1-4 are the whole protocol (quorum, group, recovery, step and commit); its
sections 5 and 6 add the loss-spike guard (6. above) and the corruption check (7.), each readable
alone.

       supervisor: TCPStore (coordinator)   restarts replica 1 -------------.
       replica 0  [join k][fwd|bwd|AR  X  vote: no ][join k+1][fwd|bwd|AR][commit]   [join k+2] [recv state]..
       replica 1  [join k][fwd|bwd|  killed                                          [start][join k+2][recv]..
       replica 2  [join k][fwd|bwd|AR  X  vote: no ][join k+1][fwd|bwd|AR][commit]   [join k+2] [send state]..
                            step s discarded          step s again, 2 replicas          3 again from s+1

Run (one command starts the coordinator and the replicas; R in one place, no torchrun):
    python fault_tolerance.py --replicas 3 --check
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --check  # the others go on without it
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --min-replicas 3 --check  # it rejoins
    python fault_tolerance.py --replicas 3 --freeze-replica 1 --at-step 5 --check  # frozen: its lease lapses
    python fault_tolerance.py --replicas 3 --inject-spike 4,8,9 --max-skips 2 --check  # skip; roll back
    python fault_tolerance.py --replicas 3 --verify-every 2 --corrupt-replica 2 --at-step 6 --check
    python fault_tolerance.py --replicas 3 --kill-replica 1 --at-step 5 --recipe restart --ckpt-dir D \
        --save-every 4        # the 2020 recipe on the same run: every replica restarts, reloads from disk
Measured and printed: per failure, the ms from the kill (its timestamp on the coordinator) to the
next commit of the step it interrupted, the steps trained again, the ms until the replica is back in
a quorum; goodput (the time of the rounds whose updates are in the final model over the wall time).
--recipe restart runs the same kill the 2020 way for the same figures side by side. Goodput at scale
(the arithmetic; the run prints its own measured figures beside it). N GPUs failing at lambda per
GPU-hour give a failure every M = 1 / (N lambda) hours: Llama 3's 419 in 54 days on 16,384 GPUs is
lambda = 2.0e-5, M = 3.1 h. Restart-from-checkpoint with checkpoint cost C and restart cost T_r
loses, per failure, T_r plus on average half an interval tau, and C every tau: lost fraction ~ C/tau
+ (tau/2 + T_r)/M, least at Young/Daly's tau = sqrt(2 C M): C = 1 min gives tau = 19 min, and with
T_r = 10 min a loss of 0.05 + 0.11 = 16% (goodput 84%). Per-step recovery loses one step t plus the
lost replica's share while it restarts: ~ (t + T_r/R) / M per failure: t = 10 s, T_r = 10 min, R = 8
replicas is 85 s / 3.1 h = 0.8%. In production, use torchft (its Manager, ProcessGroupBabyNCCL and
lighthouse) with torchtitan.
"""

import importlib
import itertools
import math
import os
import signal
import statistics
import sys
import threading
import time
from dataclasses import astuple, dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from common import (
    DTYPES,
    Dist,
    GPTConfig,
    MarkovData,
    build_gpt,
    count_tokens,
    fail,
    lm_loss,
    make_optimizer,
)
from harness import (
    BaseArgs,
    check_common_args,
    env_world_size,
    log_step,
    parse_args,
    tolerance,
    write_summary,
)


@dataclass
class Args(BaseArgs):
    batch_size: int = 12  # global batch, in sequences: R shards of B/R (divisible by 2, 3, 4)
    replicas: int = 3  # R replica processes, each holding the whole model
    join_ms: float = 300.0  # a round closes when all live replicas are in, or this long after one
    min_replicas: int = 1  # a smaller quorum does not train: it waits for replicas to come back
    kill_replica: int = -1  # SIGKILL this replica (first life only) at --at-step, in --phase
    at_step: int = -1  # the step of --kill-replica and of --corrupt-replica
    freeze_replica: int = -1  # SIGSTOP this replica (first life only) at --at-step, in --phase
    # where a kill or freeze strikes: before check-in, after the round closed, before group/AR/vote
    phase: Literal["before", "join", "group", "during", "after"] = "during"
    max_restarts: int = 1  # restarts of a killed replica (--recipe restart: of the job)
    recipe: Literal["live", "restart"] = "live"  # live recovery, or a restart from --ckpt-dir
    spike_sigma: float = 6.0  # a spike: a loss above the mean of the last 16 by this many stdevs
    max_skips: int = 2  # after this many skipped steps in a row, roll back to the snapshot
    snapshot_every: int = 4  # take the in-memory rollback snapshot every N steps
    inject_spike: str = ""  # comma-separated batch ids whose loss is multiplied by 1e4 (for tests)
    verify_every: int = 0  # compare the replicas' weight checksums every N steps (0: never)
    corrupt_replica: int = -1  # perturb this replica's weights at --at-step (first life only)
    host: str = "127.0.0.1"  # the coordinator binds here (an address the replicas' nodes reach)
    ckpt_dir: str = ""  # --recipe restart only: the job's one state.pt (live recovery reads none)
    save_every: int = 0  # --recipe restart: write the state every N steps
    timeout: int = 120  # seconds: every wait's deadline (a collective, a round, a vote)
    lease_ms: float = 5000.0  # a replica whose lease is older is dropped (killed or frozen)
    coordinator: str = ""  # (set by the launcher) host:port of the coordinator's store
    replica: int = -1  # (set by the launcher) this process's replica id; -1: be the launcher
    life: int = 0  # (set by the launcher) how many times this replica was started before
    # out of --help: a replica's identity, given by the launcher on its command line (as torchrun
    # gives a worker its RANK), never typed
    HIDDEN = ("coordinator", "replica", "life")


# ---------------------------------------------------------------------- 1. the lease and the quorum
@dataclass
class Member:
    rid: int  # replica id: it owns shard rid of every batch
    life: int  # restarts so far: a restarted replica is a new member
    version: int  # committed rounds its state has seen; -1: it has no state and must recover
    step: int  # its step (the quorum's step is the newest member's)
    gid: int  # the round whose process group it still holds (-1: none)


class Lease:
    """Each replica owns its failure detection (torchft's heartbeats to its lighthouse): a thread
    writes `lease/{rid}` = "life time" every lease_s / 5, and a peer whose lease is older than
    lease_s, or held by another life of its replica (it was restarted), is gone: the round, the vote
    and the group decide from it at once. A replica killed, or frozen (SIGSTOP stops the thread
    too), is dropped within lease_s; one alive but stuck in a collective keeps its lease, and the
    collective's deadline leaves it behind. `store`: a connection of the lease's own (a get that
    waits on another must not hold up the heartbeat). The replicas' clocks must agree to well within
    lease_s (one host here; NTP across nodes)."""

    def __init__(self, store, me, lease_s):
        if lease_s <= 0:
            raise ValueError(f"Lease needs lease_s > 0, got {lease_s}")
        self.store = store
        self.lease_s = lease_s
        self.beat(me)  # (held before this replica checks in anywhere)
        threading.Thread(target=self.beat_until_gone, args=(me,), daemon=True).start()

    def beat(self, me):
        self.store.set(f"lease/{me.rid}", f"{me.life} {time.time()!r}")

    def beat_until_gone(self, me):
        try:
            while True:
                time.sleep(self.lease_s / 5)
                self.beat(me)
        except Exception:  # the coordinator is gone: the main thread says so in one line
            return

    def read(self, rid):  # (life, seconds since its last heartbeat)
        if not self.store.check([f"lease/{rid}"]):
            return -1, math.inf
        life, t = self.store.get(f"lease/{rid}").split()
        return int(life), time.time() - float(t)

    def live(self, m):
        life, age = self.read(m.rid)
        return life == m.life and age < self.lease_s

    def count(self, replicas):  # the replicas holding a live lease, whatever their life
        return sum(self.read(r)[1] < self.lease_s for r in range(replicas))


def members_of(store, k):
    """Round k's members, sorted by replica id (get() waits for a slot written late)."""
    members = {}
    for i in range(1, int(store.get(f"q{k}/size")) + 1):
        m = Member(*map(int, store.get(f"q{k}/slot{i}").split()))
        # a replica restarted after checking in: its newer life replaces the dead one
        members[m.rid] = m
    return sorted(members.values(), key=lambda m: m.rid)


def check_round(k, window_s, timeout_s):
    if k < 0 or window_s <= 0 or timeout_s <= 0:
        raise ValueError(
            f"join_round needs k >= 0, window_s, timeout_s > 0, got {k, window_s, timeout_s}"
        )


def join_round(store, k, me, expected, window_s, timeout_s, min_size=1):
    """Check in to round k. Returns its members, or None when the round had closed before this
    check-in (try k + 1). `expected()`: the replicas alive. The round closes when all of them
    checked in, or once the window passed with a strict majority of them (torchft's lighthouse: more
    than half the known alive): a replica that missed a round waits in the next one for the others,
    it never opens a quorum of its own. Never with fewer than `min_size` (torchft's
    min_replica_size): then the round waits (bounded) for a replica to come back."""
    check_round(k, window_s, timeout_s)
    slot = store.add(f"q{k}/n", 1)  # check-ins are numbered in arrival order
    store.set(f"q{k}/slot{slot}", " ".join(map(str, astuple(me))))
    t0 = time.monotonic()
    while not store.check([f"q{k}/size"]):
        n = store.add(f"q{k}/n", 0)
        alive = expected()
        waited = time.monotonic() - t0
        if n >= min_size and (n >= alive or waited > window_s and 2 * n > alive):
            # the first n check-ins are its members: compare_set keeps the first close, the one
            store.compare_set(f"q{k}/size", "", str(n))
            store.set("round", str(k))  # where a newly started replica begins to look
        elif waited > window_s + 4 * timeout_s:
            # (the others may still be ending a round: its group, collectives and vote wait
            # timeout_s each)
            raise TimeoutError(
                f"round {k}: {n} of {alive} live replicas checked in (a round needs a majority "
                f"of them, and {min_size})"
            )
        time.sleep(0.001)
    # None: it checked in after the close
    return None if slot > int(store.get(f"q{k}/size")) else members_of(store, k)


def rank_in(members, me):
    """me's rank in the quorum's group: its place among the members (sorted by id, as
    join_round's)."""
    rids = [m.rid for m in members]
    if me.rid not in rids or rids != sorted(set(rids)):
        raise ValueError(
            f"replica {me.rid} must be one of the members {rids}, each once, sorted by id"
        )
    return rids.index(me.rid)


def decided_before(store, k, timeout_s, live):
    """Rounds decide in order: wait until round k - 1 has its decision, and return the version
    committed before round k (each decision carries the one after it: "commit 7", "abort 6"). A
    round whose members all lost their lease, or undecided past the deadline, is decided "abort"
    here (the same compare_set). `live(member)`: whether it holds its lease (Lease.live)."""
    if k == 0:
        return 0
    key, t0 = f"q{k - 1}/decision", time.monotonic()
    while not store.check([key]):
        gone = not any(map(live, members_of(store, k - 1)))
        if gone or time.monotonic() - t0 > timeout_s:
            store.compare_set(key, "", f"abort {decided_before(store, k - 1, timeout_s, live)}")
        time.sleep(0.001)
    return int(store.get(key).split()[1])


def vote(store, k, members, me, ok, timeout_s, live):
    """Two-phase commit on the coordinator: each member says whether its collectives succeeded; the
    first to see every "yes", any "no", a member without its lease (`live`), or the deadline,
    proposes the decision, and compare_set keeps only the first proposal: every member reads the
    same one. A round commits only with every vote "yes" and a member holding the version committed
    before it (one commit per version: a quorum holding an older state, or open beside another, can
    never commit)."""
    rank_in(members, me)  # (refuses a `me` outside the members)
    if timeout_s <= 0:
        raise ValueError(
            f"vote needs timeout_s > 0 (else it aborts before the others vote), got {timeout_s}"
        )
    base = decided_before(store, k, timeout_s, live)  # (rounds decide in order: one in flight)
    store.add(f"q{k}/yes" if ok else f"q{k}/no", 1)  # (each member votes once)
    current, t0 = max(m.version for m in members) >= base, time.monotonic()
    while not store.check([f"q{k}/decision"]):
        every_yes = store.add(f"q{k}/yes", 0) == len(members)
        if (
            every_yes
            or store.add(f"q{k}/no", 0)
            or not all(map(live, members))
            or time.monotonic() - t0 > timeout_s
        ):
            commit = every_yes and current
            store.compare_set(
                f"q{k}/decision", "", f"commit {base + 1}" if commit else f"abort {base}"
            )
        time.sleep(0.001)
    return store.get(f"q{k}/decision").startswith(b"commit")


# -------------------------------------------------------------------- 2. the group, with a deadline
def wait_for(done, lost, timeout_s, what):
    """Poll `done()` on the host until it holds (never a blocking wait: on NCCL a dead or frozen
    peer raises nothing); raise as soon as `lost()` (a member's lease lapsed), or past timeout_s (a
    member alive but stuck keeps its lease)."""
    t0 = time.monotonic()
    while not done():
        if lost():
            raise RuntimeError(f"{what}: a member lost its lease")
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{what} took over {timeout_s} s")
        time.sleep(0.001)


@dataclass
class Bounded:
    """The quorum's group, every collective of it waited for on the host (torchft's
    _WorkCUDATimeout): by polling is_completed(), which never blocks, on NCCL either. On NCCL a dead
    or frozen peer raises nothing (wait() only orders the stream); as soon as a member loses its
    lease (`lost()`), or past the deadline (a member alive but stuck), this member aborts the group
    itself (pg.abort(): ends its pending kernels; never shutdown() or destroy_process_group(), which
    wait for them) and raises: it votes no."""

    pg: object
    gid: int  # the round that made it
    timeout_s: float
    lost: object

    def __post_init__(self):
        self.n = self.pg.size()

    def size(self):
        return self.n

    def allreduce(self, tensors):  # (SUM)
        return Deadline(self, self.pg.allreduce(tensors))

    def broadcast(self, tensor, src):
        return Deadline(self, self.pg.broadcast(tensor, src))

    def abort(self):
        if self.pg is None:  # (aborted once)
            return
        # NCCL: abort() ends the kernels. gloo: only freeing the group closes its connections (a
        # peer waiting on this member is let go), and that waits for the hung work: freed on a
        # thread of its own
        self.pg.abort()
        dropped, self.pg = [self.pg], None
        threading.Thread(target=dropped.clear, daemon=True).start()


@dataclass
class Deadline:
    group: Bounded
    work: object

    def wait(self):
        try:
            wait_for(self.work.is_completed, self.group.lost, self.group.timeout_s, "a collective")
            self.work.wait()  # (gloo: raises a failed collective's error; NCCL: orders the stream)
        except Exception:
            self.group.abort()
            raise


def quorum_group(store, k, members, me, held, timeout_s, live, device=torch.device("cpu")):
    """The quorum's process group (a Bounded, its gid the round k that made it): the one all members
    still hold when they hold the same one and nobody left (unchanged membership), else a new one
    under the fresh prefix g{k}, made once every member said it is there (a member lost before that
    is found by its lease or the deadline, not by a hung rendezvous). `held`: the group this member
    holds, or None. On CUDA: ProcessGroupNCCL, non-blocking, connected at once (a member lost during
    NCCL's bootstrap raises here, inside the round, bounded by TORCH_NCCL_NONBLOCKING_TIMEOUT, which
    the launcher sets to timeout_s: torch waits for a non-blocking init by it alone, 30 min by
    default). Its own timeout, 2 x ours, is a backstop: the watchdog must not decide, and it bounds
    pg.abort()'s wait for NCCL's abort (an ncclCommAbort that hangs holds the replica that long:
    torchft's ProcessGroupBabyNCCL runs NCCL in a subprocess it can kill)."""
    if held and {m.gid for m in members} == {held.gid} and held.size() == len(members):
        return held
    rank = rank_in(members, me)
    prefix = dist.PrefixStore(f"g{k}", store)
    prefix.set(f"here{me.rid}", "1")
    here = [f"here{m.rid}" for m in members]
    lost = lambda: not all(map(live, members))  # (checked in, then lost)
    wait_for(lambda: prefix.check(here), lost, timeout_s, f"group g{k}'s creation")
    if store.check([f"q{k}/decision"]):  # this member came late: the others gave up on the group
        raise RuntimeError(f"round {k} was decided without this member")
    backstop = timedelta(seconds=2 * timeout_s)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.blocking = False
        opts._timeout = backstop
        pg = dist.ProcessGroupNCCL(prefix, rank, len(members), opts)
        pg.eager_connect_single_device(device)
    else:
        pg = dist.ProcessGroupGloo(prefix, rank, len(members), backstop)
    return Bounded(pg, k, timeout_s, lost)


def replica_device(rid):
    """cuda:(rid % device_count), made current before any CUDA work (the launcher starts the
    replicas, not torchrun: there is no LOCAL_RANK, and NCCL refuses two ranks of one communicator
    on one GPU); else CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", rid % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


# -------------------------------------------------------------------- 3. the state and its recovery
class Replica:
    """One replica's state. Recovery sends it tensor by tensor, each in its own dtype and shape (a
    receiver allocates them from its own model and optimizer: same shapes, same dtypes, same order
    on every member). The loss history, the skips in a row and the rollback snapshot are the
    loss-spike guard's (section 5): they travel with the state, so that a recovered replica guards
    as its peers do."""

    def __init__(self, model, opt, steps):
        # (AdamW is an Adam)
        if not isinstance(opt, torch.optim.Adam) or any(g["amsgrad"] for g in opt.param_groups):
            raise ValueError(
                f"Replica sends Adam(W)'s exp_avg, exp_avg_sq, step, not {type(opt).__name__}'s "
                "or amsgrad's: give it torch.optim.AdamW, or Adam without amsgrad"
            )
        self.model = model
        self.opt = opt
        self.steps = steps
        self.params = [p for p in model.parameters() if p.requires_grad]
        # AdamW's state, made now as its first step() would: one form at every step
        for p in self.params:
            opt.state[p] = dict(
                step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p)
            )
        self.tensors = [p.detach() for p in self.params] + [
            opt.state[p][key] for key in ("exp_avg", "exp_avg_sq", "step") for p in self.params
        ]  # everything that a step changes in place
        self.version = 0
        self.step = 0
        self.batch = 0
        self.skips = 0
        self.losses = []  # the loss of every applied update: the spike detector's history
        self.snapshot = self.on_host()  # what a rollback restores (a recent step's core, on host)

    def core(self):
        """weights, exp_avg, exp_avg_sq, AdamW steps (the live tensors), then the counters and the
        losses as one (5 + steps,) float64 tensor (the losses are Python floats: float64 holds them
        exactly)."""
        meta = [self.version, self.step, self.batch, self.skips, len(self.losses)]
        meta += self.losses + [math.nan] * (self.steps - len(self.losses))
        return self.tensors + [torch.tensor(meta, dtype=torch.float64)]

    def on_host(self):
        return [t.to("cpu", copy=True) for t in self.core()]

    def load_core(self, core):
        for t, v in zip(self.tensors, core):
            t.copy_(v)
        meta = core[-1].tolist()
        self.version, self.step, self.batch, self.skips, n_losses = map(int, meta[:5])
        self.losses = meta[5 : 5 + n_losses]

    def full(self):  # core + snapshot: everything a recovering replica needs
        return self.core() + self.snapshot

    def load_full(self, tensors):
        self.load_core(tensors[: len(tensors) // 2])
        self.snapshot = tensors[len(tensors) // 2 :]  # (on the host)


def check_group(pg, members, me):
    """me's rank in the quorum's group, which must have one rank per member, and the members'
    newest version."""
    if pg.size() != len(members):
        raise ValueError(
            f"pg must be the quorum's group, of {len(members)} members: got {pg.size()}"
        )
    return rank_in(members, me), max(m.version for m in members)


def recover(pg, members, me, rep, bad=()):
    """Before the step every member holds the same state: the lowest member with the newest version
    (and not in `bad`, section 6) broadcasts its whole state to the members behind (a restarted
    replica recovers live) and to `bad` (repaired). Returns (receiving ids, bytes broadcast)."""
    i_me, newest = check_group(pg, members, me)
    if newest < 0:  # (a later quorum may have one)
        raise RuntimeError("no member of the quorum holds a state to recover from")
    src = min(i for i, m in enumerate(members) if m.version == newest and m.rid not in bad)
    receivers = [m.rid for m in members if m.version < newest or m.rid in bad]
    if not receivers:
        return [], 0
    # one broadcast per tensor, in its dtype, on the device (NCCL's: the snapshot and AdamW's step
    # counts live on the host), one at a time: the extra memory is one tensor, never the whole state
    # (NCCL review 4, N4-6); a receiver copies each into its own state (its own shapes), then loads
    # the counters
    device = rep.params[0].device
    state = rep.full()
    nbytes = 0
    for t in state:
        buf = t.to(device) if i_me == src else torch.empty_like(t, device=device)
        pg.broadcast(buf, src).wait()
        if me.rid in receivers:
            t.copy_(buf)
        nbytes += buf.nbytes
        del buf  # (before the next is allocated)
    if me.rid in receivers:
        rep.load_full(state)
    return receivers, nbytes


# ----------------------------------------------------------------------- 4. the step and its commit
def check_shard(rows, rid, replicas):
    if replicas < 1 or rows % replicas or not 0 <= rid < replicas:
        raise ValueError(
            f"replica {rid} of {replicas} needs an id in 0..{replicas - 1} and a batch of rows "
            f"divisible by {replicas} (each owns a shard), got {rows}"
        )


def shard(x, y, rid, replicas):
    check_shard(x.shape[0], rid, replicas)
    # replica rid always owns rows rid * B/R .. (rid + 1) * B/R of the global batch
    return x.chunk(replicas)[rid], y.chunk(replicas)[rid]  # (B/R, T) each


def local_grads(model, x, y, members, me, replicas, loss_fn, count):
    """Forward + backward on this replica's shard; `loss_fn(out, y, n)` sums over its shard and
    divides by n = `count` of *all participants'* shards, so the all-reduced sum is the mean over
    who took part."""
    n_tok = sum(count(shard(x, y, m.rid, replicas)[1]) for m in members)
    xs, ys = shard(x, y, me.rid, replicas)
    model.zero_grad()  # (grads set to None)
    loss = loss_fn(model(xs), ys, n_tok)
    loss.backward()
    return loss.detach()


def allreduce_grads(pg, params, loss):
    """One all-reduce of the flat gradient and the loss over the quorum; returns the participants'
    loss."""
    if any(p.grad is None for p in params):
        raise ValueError(
            "a parameter has no gradient: every replica's loss must reach every parameter"
        )
    flat = torch.cat(
        [p.grad.reshape(-1) for p in params] + [loss.reshape(1).to(params[0].grad.dtype)]
    )
    pg.allreduce([flat]).wait()  # (P + 1,) SUM over the members
    for p, g in zip(params, flat[:-1].split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    return flat[-1].item()


def update(rep, norm, clip):
    """The committed step (after the vote, section 1): clip by the whole gradient's `norm`, the
    optimizer step; the state is one step further (apply_update, below, counts the round's version
    and batch: every decided round has them, whether it updates or not)."""
    if clip > 0:
        torch.nn.utils.clip_grads_with_norm_(rep.params, clip, norm)
    rep.opt.step()
    rep.step += 1


# --------------------------------------------------------------------------- 5. loss spikes (added)
def is_spike(loss, norm, history, sigma):
    """Non-finite, or above the mean of the last 16 losses by `sigma` standard deviations."""
    if not (math.isfinite(loss) and math.isfinite(norm)):
        return True
    h = history[-16:]
    return len(h) >= 4 and loss > statistics.mean(h) + sigma * statistics.stdev(h)


def agree(pg, flag, device):
    """Every member's flag, summed: all agree to skip if any saw a spike (one all-reduce)."""
    t = torch.tensor([float(flag)], dtype=torch.float64, device=device)
    pg.allreduce([t]).wait()
    return t.item() > 0


def check_update(max_skips, snapshot_every):
    if max_skips < 1 or snapshot_every < 1:
        raise ValueError(
            f"max_skips and snapshot_every must be >= 1, got {max_skips} and {snapshot_every}"
        )


def apply_update(rep, loss, spike, norm, clip, max_skips, snapshot_every):
    """Section 4's update, guarded: without a spike, the update (its loss joins the history, a
    snapshot every `snapshot_every` steps); with one, a skip (the batch is consumed, the weights
    stay), or after `max_skips` skips in a row a rollback to the snapshot, going on from the next
    batch. Returns which."""
    check_update(max_skips, snapshot_every)
    rep.version += 1  # an update, a skip or a rollback: one version further, its batch consumed
    rep.batch += 1
    if not spike:
        update(rep, norm, clip)
        rep.skips = 0
        rep.losses.append(loss)
        if rep.step % snapshot_every == 0:
            rep.snapshot = rep.on_host()
        return "update"
    rep.skips += 1
    if rep.skips < max_skips:
        return "skip"
    version, batch = rep.version, rep.batch
    # weights, AdamW, step, loss history and skips (0: a snapshot follows an update) of the
    # snapshot's step
    rep.load_core(rep.snapshot)
    # but the data goes on: the bad batches are skipped
    rep.version = version
    rep.batch = batch
    return "rollback"


# --------------------------------------------------------------------- 6. silent corruption (added)
def checksum(params):
    """An exact fingerprint of the weights' bytes (a position-weighted byte sum: any changed byte
    shows), 1 MiB at a time (an int64 per byte of the whole model at once would be 8x its size)."""
    total, at = 0, 0  # (total: an int64 tensor on the weights' device from the first chunk on)
    for p in params:
        for b in p.detach().reshape(-1).view(torch.uint8).split(1 << 20):  # (<= 1 MiB,) bytes
            total += (
                b.long() * (torch.arange(at, at + b.numel(), device=b.device) % 251 + 1)
            ).sum()
            at += b.numel()
    return total


def sync_state(pg, members, me, rep, verify):
    """Section 3's recovery, verified: with `verify`, the members all-reduce their checksums (one
    slot each) first, and a member of the newest version whose checksum differs from the majority of
    that version's is corrupt: it is repaired by the same broadcast, from the lowest member of the
    majority. Returns (corrupt ids, receiving ids, bytes)."""
    i_me, newest = check_group(pg, members, me)
    up = [i for i, m in enumerate(members) if m.version == newest]
    sums = torch.zeros(len(members), dtype=torch.long, device=rep.params[0].device)
    if verify:  # (newest < 0: recover refuses, after)
        sums[i_me] = checksum(rep.params)
        pg.allreduce([sums]).wait()  # (members,) every member's checksum, everywhere
    seen = sums[up].tolist()  # the newest members' checksums, lowest member first
    best = max(seen, key=seen.count)  # the majority's (a tie: the first, the lowest member's)
    bad = [members[i].rid for i, c in zip(up, seen) if c != best]
    return bad, *recover(pg, members, me, rep, bad)


def check_args(args):
    check_common_args(args)
    R = args.replicas
    # the cores' own checks: --batch-size and --replicas, --join-ms, --max-skips, --snapshot-every
    try:
        check_shard(args.batch_size, 0, R)
        check_round(0, args.join_ms / 1e3, args.timeout)
        check_update(args.max_skips, args.snapshot_every)
    except ValueError as e:
        fail(e)
    # below the fence: how it is started (the launcher), the faults the tests inject, the recipe
    # measured beside
    check_outside(args)
    if args.lease_ms <= 0:
        fail(f"--lease-ms must be > 0, got {args.lease_ms}")
    if args.spike_sigma <= 0:
        fail(f"--spike-sigma must be > 0, got {args.spike_sigma}")
    if not 1 <= args.min_replicas <= R:
        fail(f"--min-replicas must be in 1..--replicas {R}, got {args.min_replicas}")
    if args.verify_every < 0:
        fail(f"--verify-every must be >= 0, got {args.verify_every}")


# ----------------------------------------------------------------------- 7. this repo's run of it
# One replica: the GPT and its data on the cores above, and its log (built below the fence), whose
# one hook `log.on(phase)` on the way is where the tests inject their faults. ft_launcher.py starts
# the replicas and restarts a dead one; it decides nothing: each replica's lease is what a round's
# close, a vote and a group read.
def train_replica(args, connect):
    store = connect()  # the coordinator
    device = replica_device(args.replica)
    data = MarkovData(args.vocab, args.seed)
    R = args.replicas
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    rep = Replica(model, make_optimizer(model.parameters(), args), args.steps)
    rep.version = -1 if args.life > 0 else 0  # restarted: no state until a peer gives it
    me = Member(args.replica, args.life, rep.version, 0, -1)
    lease = Lease(connect(), me, args.lease_ms / 1e3)  # (a connection of its own)
    load_checkpoint(args, rep, store, lease.live)  # (--recipe restart only: the 2020 way)
    log = Log(store, args, me, rep)
    started = False
    # Until its first round a replica waits for all R (a run starts, or the whole job restarts,
    # together); afterwards only for the replicas holding a lease now (torchft's lighthouse counts
    # heartbeats).
    expected = lambda: lease.count(R) if started else R
    group = None
    # a new replica begins to look at the newest round closed (the coordinator starts at 0)
    for k in itertools.count(int(store.get("round"))):
        if store.check(["finished"]):  # the run ended without it
            return log.left_out()
        log.on("before")
        me.version, me.step = rep.version, rep.step
        me.gid = group.gid if group else -1
        # a start waits for everyone; so does the end (every live replica ends with the final state;
        # "ending": set by the members that committed the last update)
        window = (
            args.join_ms / 1e3 if started and not store.check(["ending"]) else max(60, args.timeout)
        )
        members = join_round(store, k, me, expected, window, args.timeout, args.min_replicas)
        if members is None:  # closed before this check-in: try the next round
            continue
        started = True
        log.on("join")
        if rep.batch > 4 * args.steps + 16:  # every loop is bounded, a spike that never ends too
            raise TimeoutError(
                f"{rep.batch} batches used for {rep.step} steps: the loss keeps spiking"
            )
        # A round that fails anywhere in here is voted down: nothing after the vote reads what the
        # try did not reach.
        ok = False
        try:
            log.on("group")
            group = quorum_group(store, k, members, me, group, args.timeout, lease.live, device)
            newest = max(members, key=lambda m: m.version).step
            # compare weights when due, and whenever the membership changed (a fork shows there)
            verify = group.gid == k or args.verify_every > 0 and newest % args.verify_every == 0
            log.synced(k, members, *sync_state(group, members, me, rep, verify))
            last = rep.step >= args.steps
            if not last:  # (the last round: every member now holds the final state)
                x, y = data.batch(rep.batch, args.batch_size, args.seq_len, args.ragged)  # (B, T)
                mine = local_grads(
                    model, x.to(device), y.to(device), members, me, R, lm_loss, count_tokens
                )
                log.on("during", mine)  # (--inject-spike scales the loss here)
                loss = allreduce_grads(group, rep.params, mine)
                norm = torch.nn.utils.get_total_norm([p.grad for p in rep.params])  # (whole model)
                spike = agree(
                    group, is_spike(loss, norm.item(), rep.losses, args.spike_sigma), device
                )
                log.on("after")
            ok = True
        except (RuntimeError, TimeoutError) as e:  # (torch.distributed's errors are RuntimeErrors)
            log.failed(k, e)
        if not vote(store, k, members, me, ok, args.timeout, lease.live):
            if group:  # it may hold a lost member: its pending work ends, never waited for
                group.abort()
            group = None
            continue
        if last:
            break
        what = apply_update(rep, loss, spike, norm, args.clip, args.max_skips, args.snapshot_every)
        log.committed(k, members, what, loss)  # (restart: and saves)
        if rep.step >= args.steps:
            store.set("ending", "1")
    code = log.finish(members, group)  # (the members compare their weights: the --check)
    store.set("finished", "1")  # a replica restarted now exits at once
    return code


def main():
    args = parse_args(Args)
    check_args(args)
    if args.replica < 0:  # the command a user types: ft_launcher.py, a tool apart, starts them
        sys.exit(importlib.import_module("ft_launcher").launch(args))
    try:
        host, port = args.coordinator.rsplit(":", 1)
        # (a client: the launcher holds the store)
        connect = lambda: dist.TCPStore(host, int(port), timeout=timedelta(seconds=args.timeout))
        code = train_replica(args, connect)
    except (TimeoutError, dist.DistStoreError, dist.DistNetworkError, ConnectionError) as e:
        code = ended_by(args, e)  # (its one line, below the fence)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter teardown, in which gloo's threads may still hold tensors


# --- measurement ---
# The log: its one hook on the technique's path (where the tests inject their faults: their flags'
# checks too), what it records and prints, the figures; and the checkpoint of the recipe measured
# beside live recovery (--recipe restart).
def ended_by(args, e):
    """A replica ended by a wait past its deadline (exit 1), or by the loss of the coordinator (exit
    3), says so in one line."""
    if isinstance(e, TimeoutError):
        sys.stderr.write(f"fault_tolerance.py: error (replica {args.replica}): {e}\n")
        return 1
    sys.stderr.write(
        f"fault_tolerance.py: error (replica {args.replica}): the coordinator at "
        f"{args.coordinator} is gone ({type(e).__name__}); it is the single point of this "
        "design, as torchft's lighthouse is: restart the run\n"
    )
    return 3


def check_outside(args):
    """check_args' part for the flags of what stands outside the technique: how it is started (the
    launcher's), the faults of the hook below, --recipe restart's checkpoint (one line, exit 2, as
    every refusal)."""
    R = args.replicas
    if env_world_size() > 1:
        fail(
            "start it with python fault_tolerance.py --replicas R, not torchrun: it starts its own "
            "replicas"
        )
    if torch.cuda.is_available() and R > torch.cuda.device_count():
        fail(
            f"--replicas {R} needs a GPU each ({torch.cuda.device_count()} here): NCCL refuses two "
            "ranks of one group on one GPU"
        )
    if args.replica >= R or (args.replica >= 0 and ":" not in args.coordinator):
        fail(
            "--replica and --coordinator are the launcher's: run python fault_tolerance.py "
            "--replicas N"
        )
    for name in ("kill_replica", "corrupt_replica", "freeze_replica"):
        v = getattr(args, name)
        if v >= 0 and not (v < R and 0 <= args.at_step < args.steps):
            fail(
                f"--{name.replace('_', '-')} {v} needs a replica in 0..{R - 1} and --at-step in "
                f"0..{args.steps - 1}, got --at-step {args.at_step}"
            )
    if (args.kill_replica >= 0 and args.recipe == "live" or args.freeze_replica >= 0) and R < 2:
        fail(
            "--kill-replica (live) and --freeze-replica need --replicas 2 or more: someone must go "
            "on"
        )
    if not all(b.strip().isdigit() for b in args.inject_spike.split(",") if b):
        fail(f"--inject-spike takes comma-separated batch ids, got {args.inject_spike!r}")
    if args.recipe == "restart" and not (args.ckpt_dir and args.save_every > 0):
        fail("--recipe restart needs --ckpt-dir DIR and --save-every N (it restarts from disk)")
    if args.recipe == "live" and args.ckpt_dir:
        fail("--ckpt-dir is for --recipe restart: live recovery reads no disk")


def ckpt_path(args):
    return os.path.join(args.ckpt_dir, "state.pt")


def load_checkpoint(args, rep, store, live):
    """--recipe restart: a restarted replica reads the whole state from disk (live recovery reads
    none). The whole job restarted from it: it is the current state, whatever was committed
    since."""
    if args.recipe == "restart" and args.life > 0 and os.path.exists(ckpt_path(args)):
        rep.load_full(torch.load(ckpt_path(args), map_location="cpu"))
        rep.version = decided_before(store, int(store.get("round")) + 1, args.timeout, live)


def save_checkpoint(args, rep, writer):
    """--recipe restart: the lowest member writes the whole state (atomic: a temporary file,
    renamed)."""
    if writer:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        torch.save(rep.full(), ckpt_path(args) + ".tmp")
        os.replace(ckpt_path(args) + ".tmp", ckpt_path(args))


class Log:
    """What the run records on the coordinator (per committed round and per update, by the round's
    lowest member) and prints; at the end, the figures and the --check. Watches from outside the
    technique."""

    def __init__(self, store, args, me, rep):
        self.store = store
        self.args = args
        self.me = me
        self.rep = rep
        self.step_ms = []
        self.t_start = time.time()
        self.step = 0
        self.batch = 0

    def on(self, phase, loss=None):
        """The one hook on the technique's path: at "before" (each round's start) the time, for the
        round's span; and the tests' faults: --inject-spike multiplies a listed batch's loss by 1e4
        (in place); on a replica's first life at --at-step, --corrupt-replica perturbs one weight
        (before its check-in), and in --phase --kill-replica sends it SIGKILL, --freeze-replica
        SIGSTOP (hung: a peer as NCCL sees one that hangs)."""
        args = self.args
        rep = self.rep
        store = self.store
        if phase == "before":
            self.t_start = time.time()
        if loss is not None and str(rep.batch) in args.inject_spike.split(","):
            loss.mul_(1e4)
        if args.life > 0 or rep.step != args.at_step:
            return
        if (
            args.replica == args.corrupt_replica
            and phase == "before"
            and rep.version >= 0
            and not getattr(rep, "corrupted", False)
        ):
            # a silent flip of one weight: nothing fails, the numbers are wrong
            with torch.no_grad():
                rep.params[0].view(-1)[0] += 1e-3
            rep.corrupted = True  # once (a discarded step comes back to this point)
        for victim, sig, what in [
            (args.kill_replica, signal.SIGKILL, "killed"),
            (args.freeze_replica, signal.SIGSTOP, "frozen"),
        ]:
            if (
                args.replica == victim
                and phase == args.phase
                and not store.check([f"{what}/{victim}"])
            ):
                # when, for the recovery figures
                store.set(f"{what}/{victim}", f"{time.time()!r} {rep.step}")
                print(
                    f"replica {victim}: {signal.Signals(sig).name} at step {rep.step} ({phase})",
                    flush=True,
                )
                os.kill(os.getpid(), sig)

    def left_out(self):
        print(
            f"replica {self.me.rid}: the run finished without it (it was in no quorum since step "
            f"{self.rep.step})",
            flush=True,
        )
        return 0

    def failed(self, k, e):
        print(
            f"replica {self.me.rid}: round {k} failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0][:90]}); the step is discarded",
            flush=True,
        )

    def synced(self, k, members, bad, receivers, nbytes):
        # the round's step and batch (every member holds the newest state now), for committed()
        self.step = self.rep.step
        self.batch = self.rep.batch
        step = self.step
        if self.me.rid != members[0].rid:
            return
        for rid in bad:
            print(
                f"silent corruption: replica {rid}'s weights differ from the majority at step "
                f"{step}; repaired from a peer",
                flush=True,
            )
            self.store.set(f"sdc/{self.store.add('sdc', 1)}", f"{rid} {step}")
        if receivers:
            who = ",".join(map(str, receivers))
            self.store.set(f"recv/{self.store.add('recv', 1)}", f"{k} {who} {nbytes}")

    def committed(self, k, members, what, loss):
        a, writer = self.args, self.me.rid == members[0].rid
        step = self.step
        batch = self.batch
        if a.recipe == "restart" and what == "update" and self.rep.step % a.save_every == 0:
            save_checkpoint(a, self.rep, writer)
        if not writer:
            return
        s, t_end = self.store, time.time()
        rids = ",".join(str(m.rid) for m in members)
        s.set(f"t/{k}", f"{self.t_start!r} {t_end!r} {step} {what}")
        self.step_ms.append(1e3 * (t_end - self.t_start))
        if what == "update":
            log_step(
                Dist(0, 1, 0, self.rep.params[0].device, "gloo"),
                step,
                loss,
                self.step_ms[-1],
                a.batch_size * a.seq_len * len(members) // a.replicas,
            )
            s.set(f"upd/{step}", f"{k} {batch} {rids} {loss!r}")
        else:
            print(
                f"step {step:4d} | {what}: batch {batch} loss {loss:.4g} flagged as a spike "
                f"(replicas {rids})",
                flush=True,
            )
            s.set(f"{what}/{s.add(what, 1)}", f"{step} {batch}")

    def finish(self, members, pg):
        """The members of the last round end together: one all-reduce of their checksums shows
        whether they hold identical weights. The lowest then writes the figures and runs the
        --check."""
        s = self.store
        a = self.args
        rep = self.rep
        sums = torch.zeros(len(members), dtype=torch.long, device=rep.params[0].device)
        sums[[m.rid for m in members].index(self.me.rid)] = checksum(rep.params)
        pg.allreduce([sums]).wait()
        if a.json:  # every replica's final weights, for a test to compare them itself
            torch.save(
                {n: p.detach().cpu() for n, p in rep.model.named_parameters()},
                f"{a.json}.replica{self.me.rid}.pt",
            )
        if self.me.rid != members[0].rid:
            return 0
        identical = bool((sums == sums[0]).all())
        model = rep.model
        device = rep.params[0].device
        recs = [s.get(f"upd/{i}").decode().split() for i in range(a.steps)]
        rounds = [int(r[0]) for r in recs]
        batches = [int(r[1]) for r in recs]
        masks = [list(map(int, r[2].split(","))) for r in recs]
        losses = [float(r[3]) for r in recs]
        figures = recovery_figures(s, a, rounds)
        listed = lambda key: [s.get(f"{key}/{i}").decode() for i in range(1, s.add(key, 0) + 1)]
        figures.update(
            batches=batches,
            members=masks,
            replicas_identical=identical,
            final_members=[m.rid for m in members],
            corruptions=listed("sdc"),
            skips=listed("skip"),
            rollbacks=listed("rollback"),
            recoveries=listed("recv"),
        )
        print(
            f"summary: replicas identical at the end: {identical}; members per step {masks}",
            flush=True,
        )
        check = None
        if a.check:
            ref = replay_reference(a, batches, masks, device)
            params = {n: p.detach() for n, p in model.named_parameters()}
            loss_diff = max(abs(x - r) / max(abs(r), 1e-12) for x, r in zip(losses, ref["losses"]))
            param_diff = max((params[n] - p).abs().max().item() for n, p in ref["params"].items())
            # the repo's: 1e-9 in float64 (parameters: 10x in float32, as harness)
            tol = tolerance(a.dtype)
            ptol = (10 if a.dtype == "float32" else 1) * tol
            passed = identical and loss_diff <= tol and param_diff <= ptol
            print(
                f"check vs the one-process reference replaying the membership: max rel loss diff "
                f"{loss_diff:.3e} (tolerance {tol:.0e}), max param diff {param_diff:.3e} "
                f"({ptol:.0e}), "
                f"replicas identical {identical} -> {'PASSED' if passed else 'FAILED'}",
                flush=True,
            )
            check = dict(max_loss_diff=loss_diff, max_param_diff=param_diff, passed=passed)
        ms = sorted(self.step_ms)[len(self.step_ms) // 2] if self.step_ms else 0.0
        d = Dist(0, a.replicas, 0, device, "gloo")
        state = sum(t.numel() * t.element_size() for t in rep.core())
        write_summary(
            d,
            a,
            "fault-tolerance",
            losses,
            ms,
            a.batch_size * a.seq_len / max(ms, 1e-9) * 1e3,
            state,
            0,
            check,
            figures,
        )
        return 0 if check is None or check["passed"] else 1


def recovery_figures(s, a, rounds):
    """Per failure: ms and rounds from the kill to the next commit of the step it interrupted (or a
    later one); goodput: the time of the rounds whose updates are in the final model over the wall
    time."""
    t = {k: s.get(f"t/{k}").decode().split() for k in range(max(rounds) + 1) if s.check([f"t/{k}"])}
    t = {k: (float(v[0]), float(v[1]), int(v[2]), v[3]) for k, v in t.items()}
    wall = max(v[1] for v in t.values()) - min(v[0] for v in t.values())
    useful, until = (
        0.0,
        -math.inf,
    )  # the union of the committed rounds' spans: each is timed by its own
    # lowest member from before its check-in: they overlap
    for t0, t1 in sorted(t[k][:2] for k in rounds):
        useful, until = useful + max(0.0, t1 - max(t0, until)), max(until, t1)
    out = dict(goodput=useful / wall, wall_s=wall, useful_s=useful, failures=[])
    seen = set()
    for i in range(1, s.add("died", 0) + 1):  # every death the launcher saw, injected or not
        r, t_kill = s.get(f"died/{i}").decode().split()
        injected = s.check([f"killed/{r}"]) and int(r) not in seen
        r = int(r)
        t_kill = float(t_kill)
        seen.add(r)
        if injected:  # the replica's own timestamp and step, taken just before its SIGKILL
            t_kill, step = (
                f(x) for f, x in zip((float, int), s.get(f"killed/{r}").decode().split())
            )
        else:  # seen by the launcher: the first step not committed by then
            step = 1 + max(
                (v[2] for v in t.values() if v[1] <= t_kill and v[3] == "update"), default=-1
            )
        after = sorted(
            (v[1], k) for k, v in t.items() if v[1] > t_kill and v[2] >= step and v[3] == "update"
        )
        if not after:
            continue
        t_next, k_next = after[0]
        # redone: an update begun after the kill for a step the run had passed (a restart's
        # rollback); a round of an earlier step that was still ending when the kill came is not one
        redone = sum(
            1
            for k, v in t.items()
            if v[0] > t_kill and v[2] < step and k < k_next and v[3] == "update"
        )
        rejoin = min(
            (v[1] for k, v in t.items() if v[1] > t_kill and k in rounds and r in member_ids(s, k)),
            default=math.nan,
        )
        out["failures"].append(
            dict(
                replica=r,
                step=step,
                injected=injected,
                ms_to_next_commit=1e3 * (t_next - t_kill),
                steps_redone=redone,
                ms_to_rejoin=1e3 * (rejoin - t_kill),
            )
        )
        how = f"killed ({a.phase}" if injected else "died (seen by the launcher"
        print(
            f"summary: replica {r} {how}) at step {step}, recipe {a.recipe}: "
            f"{1e3 * (t_next - t_kill):.0f} ms to the next commit of step >= {step} (measured), "
            f"{redone} steps redone, back in a quorum after {1e3 * (rejoin - t_kill):.0f} ms",
            flush=True,
        )
    print(
        f"summary: goodput {out['goodput']:.3f} (committed steps' time {useful:.2f} s / wall "
        f"{wall:.2f} s, measured); theory at scale: see the docstring (Young/Daly)",
        flush=True,
    )
    return out


def member_ids(s, k):
    slots = int(s.get(f"q{k}/size")) if s.check([f"q{k}/size"]) else 0
    return {int(s.get(f"q{k}/slot{i}").split()[0]) for i in range(1, slots + 1)}


# --- reference for --check ---
def replay_reference(args, batches, members, device="cpu"):
    """One process, the membership the run had: update s trains on the shards of the replicas in
    members[s] of batch batches[s] (a skipped or rolled-back batch is simply absent), AdamW, torch's
    clipping."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt = make_optimizer(model.parameters(), args)
    losses = []
    rows = args.batch_size // args.replicas
    for b, ids in zip(batches, members):
        x, y = data.batch(b, args.batch_size, args.seq_len, args.ragged)
        # the participants' rows
        keep = torch.cat([torch.arange(r * rows, (r + 1) * rows) for r in ids])
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
