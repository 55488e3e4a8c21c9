"""Two things. 1. copy-out: fault_tolerance.py's technique section alone (tests/section.py: what a copier
takes, run with torch and nothing else of this repo) on a model that is not the GPT, in three processes:

    torchrun --nproc_per_node=3 tests/fault_tolerance_checks.py

A copier's loop over the cores (Lease, join_round, quorum_group, sync_state, local_grads, allreduce_grads,
is_spike, agree, vote, apply_update) runs a scripted 8-step story: replica 2 leaves before step 2 (its
lease stops) and comes back as a new life with no state (other weights, fresh AdamW) before step 4,
recovering the whole state live from replica 0, snapshot included; batches 5 and 6 spike, the second rolls
everyone back to the step-4 snapshot (the update of batch 4 is undone); replica 1's weights are silently
perturbed before step 6, and the checksums of step 6 find and repair it. Every replica must end equal to
plain one-process torch training (AdamW, clip_grad_norm_) replaying who took part in which step, on which
batch (float64, 1e-12), and the membership, batches and recoveries must be the closed form of the story.
Then the same story with three mutants of the section (gradient divided by all R shards' rows, recovery
sending the weights but not AdamW's state, a checksum that is always 0): each must fail that comparison.

2. A mutant of the whole file (the GPT launches of tests/test_fault_tolerance.py):

    python tests/fault_tolerance_checks.py NAME ARGS...     (ARGS: fault_tolerance.py's flags)

NAME goes to the environment (FT_MUTANT), and the launcher starts every replica with this same script and
environment, so the launcher and every replica run the mutant. NAME is one of
    old-membership      each replica divides its loss by the tokens of all R shards, not the participants'
                        (the gradient is averaged over the old membership after a replica is lost)
    commit-anyway       a round is committed whatever the vote says: a failed all-reduce's partial gradient
                        (this replica's own, or a half-reduced sum) is applied
    no-detector         the spike detector never fires: a spiking batch is trained on
    rollback-keeps-adam a rollback restores the weights and counters but keeps AdamW's current moments
    no-checksum         every checksum is 0: a corrupted replica is never found
    recover-weights-only  a replica repaired or recovering from a peer loads its weights but starts AdamW
                        from scratch
    no-deadline         a collective is waited for without the host's deadline (as NCCL's wait() would):
                        only the group's own timeout, the backstop, ends it
    no-lease            a lease never lapses: a replica killed or frozen is found only by the deadline
and one fault (not a mutant):
    killed-mid-check-in replica 0 counts itself in to round 4 and stops before writing its slot, and the
                        launcher (slowed 5 s) stops the job there (--recipe restart)
"""

import os
import sys
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- 1. copy-out
class Net(torch.nn.Module):
    """Not the GPT: nested modules, odd sizes, a 0-dim parameter on the root module; a regression loss."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)
        )
        self.gain = torch.nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.gain * self.body(x)


def make(seed):
    torch.manual_seed(seed)
    model = Net().double()
    return model, torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, foreach=False)


def batch(b, rows=6):
    g = torch.Generator().manual_seed(1000 + b)
    return (
        torch.randn(rows, 5, generator=g, dtype=torch.float64),
        torch.randn(rows, 3, generator=g, dtype=torch.float64),
    )


def sq_loss(out, y, n):  # a sum over this replica's rows over n, the rows of every participant
    return ((out - y) ** 2).sum() / n


STEPS, R, SPIKES, CLIP, WAIT = 8, 3, {5, 6}, 1.0, 20.0


def story(ns, store, lease_store, rid):
    """The copier's loop (train_replica's shape) with the story's events scripted in. Returns the replica.
    Each member holds a Lease (its own connection, `lease_store`); who takes part in a round is scripted
    (`expected`, counted on the store), so that the story is fixed."""
    Member, store_wait = ns["Member"], lambda key: store.wait([key], timedelta(seconds=60))
    model, opt = make(0)
    rep, me = ns["Replica"](model, opt, STEPS), Member(rid, 0, 0, 0, -1)
    lease = ns["Lease"](lease_store, me, 10.0)
    live = lease.live
    store.add("alive", 1)
    expected = lambda: int(store.add("alive", 0))  # noqa: E731  (the replicas the story has in)
    store.set(f"up/{rid}", "1")
    # all three start together (fault_tolerance.py: a first round waits for all R)
    for r in range(R):
        store_wait(f"up/{r}")
    held, k, waited, corrupted = None, 0, False, False
    while rep.step < STEPS:
        if rid == 2 and me.life == 0 and rep.step == 2:  # leaves: the launcher would count it out
            store.add("alive", -1)
            store_wait("upd/3")
            model, opt = make(7)  # a new life: other weights, a fresh AdamW, no state (version -1)
            rep, me, held = ns["Replica"](model, opt, STEPS), Member(2, 1, -1, 0, -1), None
            lease.beat = lambda me: None  # life 0's process is gone: its heartbeat stops
            live = ns["Lease"](lease_store, me, 10.0).live  # (life 0's lease is no longer live)
            rep.version, k = -1, int(store.get("round"))  # where the rounds are now
            store.add("alive", 1)
            store.set("back", "1")
        # (so that step 4 has it back: the story is fixed)
        if rid != 2 and rep.step == 4 and not waited:
            store_wait("back")
            waited = True
        # silent corruption: one weight, nothing fails
        if rid == 1 and rep.step == 6 and not corrupted:
            with torch.no_grad():
                rep.params[0].view(-1)[0] += 1e-3
            corrupted = True
        me.version, me.step = rep.version, rep.step
        me.gid = held.gid if held else -1
        members = ns["join_round"](store, k, me, expected, WAIT, WAIT)
        k += 1
        if members is None:
            continue
        held = ns["quorum_group"](store, k - 1, members, me, held, WAIT, live)
        pg, newest = held, max(m.step for m in members)
        # verify at 0, 3, 6
        bad, receivers, _ = ns["sync_state"](pg, members, me, rep, newest % 3 == 0)
        step, b = rep.step, rep.batch
        x, y = batch(b)
        mine = ns["local_grads"](rep.model, x, y, members, me, R, sq_loss, len)
        if b in SPIKES:  # (a spike: the loss the detector sees, times 1e4)
            mine.mul_(1e4)
        loss = ns["allreduce_grads"](pg, rep.params, mine)
        norm = torch.nn.utils.get_total_norm([p.grad for p in rep.params])
        spike = ns["agree"](
            pg, ns["is_spike"](loss, norm.item(), rep.losses, 6.0), torch.device("cpu")
        )
        if not ns["vote"](store, k - 1, members, me, True, WAIT, live):
            held = None
            continue
        what = ns["apply_update"](rep, loss, spike, norm, CLIP, 2, 4)
        # the record the reference replays (the test's, as fault_tolerance's Log)
        if rid == members[0].rid:
            rids = ",".join(str(m.rid) for m in members)
            if what == "update":
                store.set(f"upd/{step}", f"{b} {rids} {loss!r}")
            store.set(
                f"event/{store.add('events', 1)}",
                f"{step} {b} {what} {rids} "
                f"{','.join(map(str, bad)) or '-'} {','.join(map(str, receivers)) or '-'}",
            )
    store.add("alive", -1)
    return rep


def reference(batches, members):
    """Plain one-process torch training on the participants' rows of each update's batch."""
    model, opt = make(0)
    losses = []
    for b, ids in zip(batches, members):
        x, y = batch(b)
        keep = torch.tensor([r * 2 + i for r in ids for i in range(2)])  # 2 rows per replica
        loss = sq_loss(model(x[keep]), y[keep], len(keep))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach() for p in model.parameters()]


def run_story(ns, store, lease_store, rid):
    """One run of the story; returns (records, max loss diff, max param diff over every replica)."""
    rep = story(ns, store, lease_store, rid)
    recs = [store.get(f"upd/{s}").decode().split() for s in range(STEPS)]
    batches, members = [int(r[0]) for r in recs], [list(map(int, r[1].split(","))) for r in recs]
    ref_losses, ref_params = reference(batches, members)
    loss_diff = max(abs(float(r[2]) - x) / abs(x) for r, x in zip(recs, ref_losses))
    param_diff = max((p.detach() - q).abs().max().item() for p, q in zip(rep.params, ref_params))
    store.set(f"diff/{rid}", repr(param_diff))
    # (get waits for each replica's)
    param_diff = max(float(store.get(f"diff/{r}")) for r in range(R))
    events = [store.get(f"event/{i}").decode() for i in range(1, store.add("events", 0) + 1)]
    return dict(batches=batches, members=members, events=events), loss_diff, param_diff


def old_membership(ns):
    real = ns["local_grads"]
    everyone = [ns["Member"](r, 0, 0, 0, -1) for r in range(R)]
    ns["local_grads"] = lambda model, x, y, members, me, *rest: real(
        model, x, y, everyone, me, *rest
    )


def weights_only(ns):
    real = ns["Replica"].load_full

    def load_full(self, state):  # (state: the list of tensors recovery broadcast)
        real(self, state)
        for t in self.tensors[len(self.params) :]:
            t.zero_()

    ns["Replica"].load_full = load_full


MUTANTS_OF_THE_SECTION = {
    "gradient over all R shards": old_membership,
    "recovery without AdamW's state": weights_only,
    "a checksum that is always 0": lambda ns: ns.update(
        checksum=lambda _: torch.zeros((), dtype=torch.long)
    ),
}


def copy_out():
    import section

    rid = int(os.environ["RANK"])
    assert int(os.environ["WORLD_SIZE"]) == R
    coordinator = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        R,
        rid == 0,
        timedelta(seconds=60),
    )
    say = print if rid == 0 else (lambda *a, **k: None)
    leases = dist.TCPStore(  # (a connection of the leases' own)
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), R, False, timedelta(seconds=60)
    )
    recs, loss_diff, param_diff = run_story(
        section.load("fault_tolerance.py"),
        dist.PrefixStore("honest", coordinator),
        dist.PrefixStore("honest", leases),
        rid,
    )
    everyone, kept = [0, 1, 2], [0, 1]
    story_ok = recs["members"] == [everyone] * 2 + [kept] * 2 + [everyone] * 4 and recs[
        "batches"
    ] == [0, 1, 2, 3, 7, 8, 9, 10]
    events = [e.split() for e in recs["events"]]
    recovered = [(e[0], e[4], e[5]) for e in events if e[5] != "-"]  # (step, corrupt, receivers)
    whats = [e[2] for e in events]
    story_ok = (
        story_ok
        and recovered == [("4", "-", "2"), ("6", "1", "1")]
        and whats.count("skip") == 1
        and whats.count("rollback") == 1
    )
    exact = loss_diff <= 1e-12 and param_diff <= 1e-12
    say(
        f"{'ok' if story_ok else 'FAIL'} copy-out story: members {recs['members']}, "
        f"batches {recs['batches']}, recovered (step, corrupt, receivers) {recovered}, "
        f"{whats.count('skip')} skip, {whats.count('rollback')} rollback",
        flush=True,
    )
    say(
        f"{'ok' if exact else 'FAIL'} copy-out section alone on another model: every replica vs one-process "
        f"torch training replaying the membership: max rel loss diff {loss_diff:.1e}, "
        f"max param diff {param_diff:.1e}",
        flush=True,
    )
    all_ok = story_ok and exact
    for i, (name, mutate) in enumerate(MUTANTS_OF_THE_SECTION.items()):
        ns = section.load("fault_tolerance.py")
        mutate(ns)
        _, ld, pd = run_story(
            ns,
            dist.PrefixStore(f"mutant{i}", coordinator),
            dist.PrefixStore(f"mutant{i}", leases),
            rid,
        )
        caught = ld > 1e-6 or pd > 1e-6
        all_ok = all_ok and caught
        say(
            f"{'ok' if caught else 'FAIL'} copy-out mutant caught: {name}: loss diff {ld:.1e}, "
            f"param diff {pd:.1e}",
            flush=True,
        )
    say("ALL CHECKS PASSED" if all_ok else "SOME CHECKS FAILED", flush=True)
    coordinator.set(f"done/{rid}", "1")
    if rid == 0:  # the coordinator's host stays until every replica has read what it needs
        coordinator.wait([f"done/{r}" for r in range(R)], timedelta(seconds=60))
    sys.exit(0 if all_ok else 1)


if len(sys.argv) == 1 and "FT_MUTANT" not in os.environ:  # (no NAME: the copy-out checks)
    copy_out()


# ----------------------------------------------------------------------------- 2. mutants of the whole file
import fault_tolerance as ft

local_grads, vote, apply_update, load_full = (
    ft.local_grads,
    ft.vote,
    ft.apply_update,
    ft.Replica.load_full,
)


def old_membership(model, x, y, members, me, replicas, *loss_and_scale):
    everyone = [ft.Member(r, 0, 0, 0, -1) for r in range(replicas)]
    return local_grads(model, x, y, everyone, me, replicas, *loss_and_scale)


def commit_anyway(store, k, members, me, ok, timeout_s, live):
    vote(store, k, members, me, ok, timeout_s, live)
    return True


def rollback_keeps_adam(rep, loss, spike, norm, clip, max_skips, snapshot_every):
    moments = [
        t.clone() for t in rep.tensors[len(rep.params) :]
    ]  # AdamW's moments and steps before it
    what = apply_update(rep, loss, spike, norm, clip, max_skips, snapshot_every)
    if what == "rollback":
        for t, m in zip(rep.tensors[len(rep.params) :], moments):
            t.copy_(m)
    return what


def weights_only(self, state):  # (state: the list of tensors recovery broadcast)
    load_full(self, state)
    for t in self.tensors[len(self.params) :]:  # AdamW from scratch: zero moments, step 0
        t.zero_()


def killed_mid_check_in():
    """A fault, not a mutant: replica 0's first life counts itself in to round 4 and stops there, as if
    killed before writing its slot; the launcher, slowed 5 s, stops the job while it sits there."""
    import time

    import ft_launcher

    join, stop = ft.join_round, ft_launcher.stop_all

    def join_round(store, k, me, *rest):
        if (me.rid, me.life, k) == (0, 0, 4):
            store.add(f"q{k}/n", 1)
            time.sleep(600)
        return join(store, k, me, *rest)

    def stop_all(*a):
        time.sleep(5)
        return stop(*a)

    ft.join_round, ft_launcher.stop_all = join_round, stop_all


MUTANTS = {
    "killed-mid-check-in": killed_mid_check_in,
    "old-membership": lambda: setattr(ft, "local_grads", old_membership),
    "commit-anyway": lambda: setattr(ft, "vote", commit_anyway),
    "no-detector": lambda: setattr(ft, "is_spike", lambda *a, **k: False),
    "rollback-keeps-adam": lambda: setattr(ft, "apply_update", rollback_keeps_adam),
    "no-checksum": lambda: setattr(
        ft, "checksum", lambda params: torch.zeros((), dtype=torch.long)
    ),
    "recover-weights-only": lambda: setattr(ft.Replica, "load_full", weights_only),
    "no-deadline": lambda: setattr(ft.Deadline, "wait", lambda self: self.work.wait()),
    "no-lease": lambda: (
        setattr(ft.Lease, "live", lambda self, m: True),
        setattr(ft.Lease, "count", lambda self, replicas: replicas),
    ),
}
if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # the launcher: NAME ARGS...
    os.environ["FT_MUTANT"] = sys.argv.pop(1)
MUTANTS[os.environ["FT_MUTANT"]]()
ft.main()
