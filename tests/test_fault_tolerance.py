"""fault_tolerance.py: a replica killed before its check-in, during its step, or after its all-reduce (R = 2,
3, 4); the others go on, and the run equals the one-process reference replaying the membership it had
(float64, 1e-9 relative; it comes out near 1e-16). A killed replica rejoins and recovers live; spikes are
skipped and rolled back; a corrupted replica is found and repaired; the restart-from-checkpoint recipe is
measured beside it and, with every replica in every step, equals plain one-process training
(common.reference_train, not this file's reference). Each check is shown to fail on a mutant
(tests/fault_tolerance_checks.py runs the file with one function replaced). No process is left after any
launch; a lost coordinator ends every replica with one line; bad input is one line, exit 2. Every launch
is one `python fault_tolerance.py --replicas R` (the launcher, its coordinator, R processes). The launcher is
forked from the warm interpreter of tests/forkserver.py (run_python), as `python fault_tolerance.py` would
start it, which saves one import of torch per launch; it starts its replicas itself, as real `python`
processes (the lost-coordinator test starts the launcher as a plain subprocess too). The technique section
alone (section.load) runs on another model in three forked processes (tests/fault_tolerance_checks.py), and
each core refuses what it cannot do before it touches the coordinator or a group (in this process).
Issue 39: no split brain (a straggler paused in bursts from outside, a kill just after a round closed: every
replica ends equal to the replay, checked here from each replica's own file; the two rules' mutants, on the
cores, let a round of one through), and a replica hung by SIGSTOP (NCCL's way: nothing raises) during the
all-reduce, the group's creation or the vote is left behind within --timeout (a wait without a deadline is
caught)."""

import dataclasses
import json
import math
import os
import re
import signal
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

import section
from helpers import ENV, ROOT, TINY, check_lines, passed, run_python

sys.path.insert(0, str(ROOT))
from common import reference_train  # noqa: E402  (plain one-process training, not fault_tolerance.py's)

# --timeout bounds every wait; it is long because a restarted replica must import torch on a loaded machine
# before the others (waiting for --min-replicas) can go on. Detection of a death does not wait for it.
SLOW_OK = ["--timeout", "120"]


def processes_of(marker):
    """Pids of live processes whose command line contains `marker` (this launch's --json path)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            pass
    return pids


def launch(tmp_path, *args, mutant="", name="run", timeout=900):
    """One run (with a mutant: through tests/fault_tolerance_checks.py). Returns (process, summary)."""
    out = tmp_path / f"{name}.json"
    script, first = (
        ("tests/fault_tolerance_checks.py", [mutant]) if mutant else ("fault_tolerance.py", [])
    )
    p = run_python(script, *first, *TINY, *args, "--json", out, timeout=timeout)
    p.output = p.stdout + p.stderr
    assert processes_of(str(out)) == [], f"processes left behind\n{p.output[-3000:]}"
    summary = json.loads(out.read_text()) if out.exists() else None
    if summary:  # every process the launcher started is gone too (the pids it recorded)
        pids = [summary["launcher"]["pid"]] + [
            q for ps in summary["launcher"]["pids"].values() for q in ps
        ]
        assert not [q for q in pids if os.path.exists(f"/proc/{q}")], pids
    return p, summary


def exact(p, s):
    assert p.returncode == 0 and s is not None, p.output[-4000:]
    c = s["check"]
    assert c["passed"] and c["max_loss_diff"] <= 1e-9 and c["max_param_diff"] <= 1e-9, c
    assert s["figures"]["replicas_identical"]
    f = s["figures"]
    print(
        f"\nR {s['config']['replicas']} {s['config']['recipe']}: loss diff {c['max_loss_diff']:.1e}, "
        f"param diff {c['max_param_diff']:.1e}, goodput {f['goodput']:.3f}, failures {f['failures']}, "
        f"recoveries {f['recoveries']}"
    )


def caught(p, s):
    """A mutant's run: its --check FAILED (exit 1), or the run could not finish at all; never a pass."""
    assert p.returncode != 0, p.output[-3000:]
    assert s is None or not s["check"]["passed"], s["check"]


def pids(s):
    return {int(r): ps for r, ps in s["launcher"]["pids"].items()}


def measured_failure(s, replica, step):
    (f,) = s["figures"]["failures"]
    assert f["replica"] == replica and f["step"] == step, f
    # measured from the kill's timestamp to the commit
    assert 0 < f["ms_to_next_commit"] < 600_000, f
    return f


# ----------------------------------------------------------------------------- R = 2: before its check-in
SPIKES = ["--inject-spike", "4,7,8", "--max-skips", 2, "--snapshot-every", 4]
R2 = [
    "--replicas",
    2,
    "--steps",
    9,
    "--kill-replica",
    1,
    "--at-step",
    2,
    "--phase",
    "before",
    "--max-restarts",
    0,
    *SPIKES,
    *SLOW_OK,
    "--check",
]


def test_r2_kill_before_checkin_then_spike_skip_and_rollback(tmp_path):
    """Replica 1 dies before checking in to step 2 (not restarted): replica 0 goes on alone from step 2, its
    process never restarted. Batch 4 spikes: skipped. Batches 7 and 8 spike: skipped, and on the second
    (--max-skips 2) everyone rolls back to the step-4 snapshot and goes on from batch 9, so steps 4..8 train
    on batches 9..13 (the rule, as a closed form). Exact against the reference replaying that."""
    p, s = launch(tmp_path, *R2)
    exact(p, s)
    f = s["figures"]
    assert f["members"] == [[0, 1]] * 2 + [[0]] * 7, f["members"]
    assert f["batches"] == [0, 1, 2, 3, 9, 10, 11, 12, 13], f["batches"]
    assert f["skips"] == ["4 4", "6 7"] and f["rollbacks"] == ["6 8"], (f["skips"], f["rollbacks"])
    assert len(pids(s)[0]) == 1 and s["launcher"]["restarts"] == 0
    measured_failure(s, 1, 2)
    assert "SIGKILL at step 2" in p.output and "flagged as a spike" in p.output


@pytest.mark.parametrize("mutant", ["old-membership", "no-detector", "rollback-keeps-adam"])
def test_r2_mutants_are_caught(tmp_path, mutant):
    """The gradient averaged over the old membership after the loss, a detector that never fires, a rollback
    that keeps AdamW's moments: each FAILS the same run's --check."""
    caught(*launch(tmp_path, *R2, mutant=mutant))


# ----------------------------------------------------------------------------- R = 3: during, rejoin
R3 = [
    "--replicas",
    3,
    "--steps",
    6,
    "--kill-replica",
    1,
    "--at-step",
    3,
    "--phase",
    "during",
    "--min-replicas",
    3,
    *SLOW_OK,
    "--check",
]


def test_r3_kill_during_step_discards_it_and_the_replica_rejoins_live(tmp_path):
    """Replica 1 dies after its backward, before the all-reduce: the others' all-reduce fails, step 3 is
    discarded (a "no" vote), the launcher restarts replica 1, and (--min-replicas 3) it rejoins at step 3 with
    the weights, AdamW state and step broadcast by replica 0: the whole state, its bytes (each tensor in
    its own dtype) a closed form. The healthy processes never restart; every step has all three replicas;
    exact."""
    p, s = launch(tmp_path, *R3)
    exact(p, s)
    f = s["figures"]
    assert f["members"] == [[0, 1, 2]] * 6, f["members"]
    assert len(pids(s)[0]) == len(pids(s)[2]) == 1 and len(pids(s)[1]) == 2, pids(s)
    assert "round" in p.output and "failed" in p.output and "discarded" in p.output
    (rec,) = f["recoveries"]  # "round receivers bytes"
    _, receivers, nbytes = rec.split()
    params = reference_train(tiny(steps=1))["params"].values()
    P, n = sum(t.numel() for t in params), len(params)
    # weights and 2 AdamW moments (float64), n step counts (float32), 5 + 6 counters and losses (float64), and
    # the snapshot the same again: each in its own dtype (one float64 copy would be 2 x 8 (3P + n + 11))
    assert receivers == "1" and int(nbytes) == 2 * (8 * 3 * P + 4 * n + 8 * (5 + 6)), (nbytes, P, n)
    fail = measured_failure(s, 1, 3)
    assert fail["steps_redone"] == 0 and math.isfinite(fail["ms_to_rejoin"])
    pytest.r3_ms = fail["ms_to_next_commit"]


def test_r3_mutant_is_caught(tmp_path):
    """Committing a failed round (its partial gradient) FAILS the same run's --check."""
    caught(*launch(tmp_path, *R3, mutant="commit-anyway"))


def test_restart_recipe_on_the_same_kill_is_measured_and_equals_one_process_training(tmp_path):
    """The same kill under the 2020 recipe: every replica is killed and restarted, all reload the step-2
    checkpoint from disk and train step 2 again (1 step redone, the closed form at-step - last save), and
    with all three in every step the run equals plain one-process training (common.reference_train)."""
    p, s = launch(
        tmp_path, *R3, "--recipe", "restart", "--ckpt-dir", tmp_path / "ck", "--save-every", 2
    )
    exact(p, s)
    assert s["figures"]["members"] == [[0, 1, 2]] * 6
    assert all(len(ps) == 2 for ps in pids(s).values())  # every process restarted
    ref = reference_train(tiny(steps=6))
    assert max(abs(a - b) / b for a, b in zip(s["losses"], ref["losses"])) < 1e-12
    fail = measured_failure(s, 1, 3)
    assert fail["steps_redone"] == 1
    print(
        f"restart-from-checkpoint: {fail['ms_to_next_commit']:.0f} ms to the next commit of step 3; live "
        f"recovery on the same kill: {getattr(pytest, 'r3_ms', float('nan')):.0f} ms"
    )


def test_restart_recipe_survives_a_kill_between_check_in_and_slot(tmp_path):
    """The launcher stops the job while replica 0 has counted itself in to round 4 but not written its
    slot (tests/fault_tolerance_checks.py's fault killed-mid-check-in): the restarted job still equals
    one-process training, because the launcher closes and aborts the dead job's undecided rounds. Before
    it did, every restarted replica waited on the missing slot and the run ended "coordinator gone"
    (exit 3), as CI once saw in the test above when the launcher's kill fell there by chance."""
    p, s = launch(
        tmp_path,
        *R3,
        *("--recipe", "restart", "--ckpt-dir", tmp_path / "ck", "--save-every", 2),
        mutant="killed-mid-check-in",
    )
    exact(p, s)


# ----------------------------------------------------------------------------- R = 4: after, corruption
R4 = [
    "--replicas",
    4,
    "--steps",
    6,
    "--kill-replica",
    1,
    "--at-step",
    3,
    "--phase",
    "after",
    "--min-replicas",
    3,
    "--max-restarts",
    0,
    "--verify-every",
    3,
    "--corrupt-replica",
    3,
    *SLOW_OK,
    "--check",
]


def test_r4_kill_after_allreduce_and_a_corrupted_replica_repaired(tmp_path):
    """Step 3: replica 3's weights are silently perturbed; the checksum all-reduce finds it (3 against 1) and
    replica 0's state repairs it. Then replica 1 dies after its all-reduce succeeded, before voting: the
    others discard the step anyway (it never said yes) and redo step 3 with three replicas; exact."""
    p, s = launch(tmp_path, *R4)
    exact(p, s)
    f = s["figures"]
    assert f["members"] == [[0, 1, 2, 3]] * 3 + [[0, 2, 3]] * 3, f["members"]
    assert f["corruptions"] == ["3 3"]
    assert "replica 3's weights differ from the majority at step 3" in p.output
    assert measured_failure(s, 1, 3)["steps_redone"] == 0
    assert 0 < f["goodput"] <= 1


@pytest.mark.parametrize("mutant", ["no-checksum", "recover-weights-only"])
def test_r4_mutants_are_caught(tmp_path, mutant):
    """A checksum that is always 0 (the corruption is never found), and a repair from a peer that sends only
    the weights (the repaired replica starts AdamW from scratch, the same load_full as a live rejoin's): each
    FAILS the same run's --check."""
    caught(*launch(tmp_path, *R4, mutant=mutant))


# ----------------------------------------------------------------------------- every phase at every R
@pytest.mark.parametrize(
    "replicas, phase, victim",
    [
        (3, "before", 0),
        (4, "before", 3),
        (2, "during", 0),
        (4, "during", 2),
        (2, "after", 1),
        (3, "after", 2),
    ],
)
def test_plain_kill_in_each_phase_at_each_r(tmp_path, replicas, phase, victim):
    """The (phase, R) pairs the tests above leave out, as plain kills (no restart, no extras; the victim
    varies, replica 0 included, the one that logs and sends state): replica `victim` dies in step 1 of 3, the
    others never restart and train steps 1 and 2 without it (a round it was in is discarded, redone);
    exact against the one-process replay of that membership. --join-ms 2000: a round closes when every live
    replica checked in (counted by their leases), and a healthy replica descheduled for 300 ms on a loaded
    machine is not left out of a round (it would rejoin live, exact too, but the membership asserted here
    would differ)."""
    p, s = launch(
        tmp_path,
        "--replicas",
        replicas,
        "--steps",
        3,
        "--kill-replica",
        victim,
        "--at-step",
        1,
        "--phase",
        phase,
        "--max-restarts",
        0,
        "--join-ms",
        2000,
        *SLOW_OK,
        "--check",
    )
    exact(p, s)
    everyone, rest = list(range(replicas)), [r for r in range(replicas) if r != victim]
    m = s["figures"]["members"]
    assert m[0] == everyone and m[2] == rest and set(m[1]) <= set(rest), m
    # Everyone healthy takes part in step 1. (During at R 4, a healthy replica's all-reduce can wait on a
    # healthy peer that the dead one's error freed: it was freed only when that peer dropped the old group,
    # once the next round had closed on --join-ms without it. A voted-down round's group is dropped at once.)
    assert m[1] == rest, m
    assert s["figures"]["recoveries"] == [], s["figures"]["recoveries"]  # nobody fell behind
    assert s["figures"]["batches"] == [0, 1, 2] and s["launcher"]["restarts"] == 0
    assert all(len(ps) == 1 for ps in pids(s).values()), pids(s)  # the healthy keep their one pid
    assert (
        s["launcher"]["exit_codes"][str(victim)] == -9 and f"SIGKILL at step 1 ({phase}" in p.output
    )
    assert measured_failure(s, victim, 1)["steps_redone"] == 0
    # (after: its all-reduce had succeeded, and still step 1 committed without it: that round was voted down)
    assert ("the step is discarded" in p.output) == (phase == "during"), p.output[-3000:]


# ----------------------------------------------------------------------------- the coordinator is lost
def test_lost_coordinator_ends_every_replica_with_one_line(tmp_path):
    """The coordinator is the single point of the design: SIGKILL the launcher that holds it in the middle of
    a run, and every replica says so in one line and exits (3) within --timeout; no process is left, and
    nothing else is printed (torch's C++ warnings, 14 lines each, are quieted for the replicas)."""
    marker = str(tmp_path / "gone.json")
    p = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "fault_tolerance.py"),
            *TINY,
            "--replicas",
            "2",
            "--steps",
            "500",
            "--timeout",
            "20",
            "--json",
            marker,
        ],
        env=ENV,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in p.stdout:
            if line.startswith("step    1 "):
                break
        p.kill()  # the launcher, and with it the coordinator's store
        # returns once every replica (holding the pipes) has exited
        out, err = p.communicate(timeout=180)
    finally:
        for q in processes_of(marker):
            os.kill(q, 9)
    assert processes_of(marker) == []
    gone = [l for l in err.splitlines() if "is gone" in l]
    assert len(gone) == 2 and all("single point" in l for l in gone), err[-3000:]
    assert err.strip().splitlines() == gone, err[
        -3000:
    ]  # one line each: no C++ warning with its frames


# ----------------------------------------------------------------------------- the section alone (issue 30)
def test_copy_out_section_alone_on_another_model():
    """tests/fault_tolerance_checks.py (no NAME): the technique section as a copier takes it,
    section.load("fault_tolerance.py"), driven by a copier's loop on a model that is not the GPT in three
    processes: a replica leaves and comes back with no state (live recovery, snapshot included), a spike is
    skipped and the next rolls back, a silent corruption is found and repaired; every replica ends equal to
    plain one-process torch training replaying the membership (float64, 1e-12), and three mutants of the
    section (the gradient over all R shards, recovery without AdamW's state, a checksum always 0) fail it."""
    lines = check_lines("tests/fault_tolerance_checks.py", 3)
    assert len(passed(lines, "copy-out story", "[('4', '-', '2'), ('6', '1', '1')]")) == 1, lines
    assert len(passed(lines, "every replica vs one-process torch training")) == 1, lines
    assert len(passed(lines, "mutant caught")) == 3, lines
    print("\n".join(lines))


class Counted:
    """A store or process group whose every call is recorded: a refusal must come before the first."""

    def __init__(self, real):
        self.real, self.calls = real, []

    def __getattr__(self, name):
        def call(*a, **k):
            if name != "size":  # (asking a group's size sends nothing)
                self.calls.append(name)
            return getattr(self.real, name)(*a, **k)

        return call


class Group:
    """A process group of n that only counts: an all-reduce in a group of one leaves the tensor as it is."""

    def __init__(self, n):
        self.n = n

    def size(self):
        return self.n

    def allreduce(self, tensors):
        return SimpleNamespace(wait=lambda: None)


def test_cores_refuse_what_they_cannot_do_before_communicating():
    """Issue 30, deliver 2: each core of the section (loaded alone) given what it cannot do raises a
    ValueError saying what would work, with no call on the coordinator's store or the group before it
    (counted); the same cores with good input do call them (so the count can see a call)."""
    ft = section.load("fault_tolerance.py")
    M = ft["Member"]
    m0, m1, m2, m3 = (M(r, 0, 0, 0, -1) for r in range(4))
    store, pg = Counted(dist.HashStore()), Counted(Group(2))
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2).double()
    rep = ft["Replica"](model, torch.optim.AdamW(model.parameters()), 4)
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    sq = lambda out, y, n: ((out - y) ** 2).sum() / n  # noqa: E731
    up = lambda m: True  # noqa: E731  (every member holds its lease)
    model.weight.grad = torch.zeros_like(model.weight)  # (the bias has none)
    bad = [
        (lambda: ft["join_round"](store, -1, m0, lambda: 1, 1.0, 1.0), "k >= 0"),
        (lambda: ft["join_round"](store, 0, m0, lambda: 1, 0.0, 1.0), "window_s"),
        (lambda: ft["join_round"](store, 0, m0, lambda: 1, 1.0, -1.0), "timeout_s > 0"),
        (
            lambda: ft["quorum_group"](store, 0, [m0, m1], m2, None, 1.0, up),
            "replica 2 must be one",
        ),
        (lambda: ft["quorum_group"](store, 0, [m1, m0], m0, None, 1.0, up), "sorted by id"),
        (
            lambda: ft["vote"](store, 0, [m0, m1], m2, True, 1.0, up),
            "must be one of the members [0, 1]",
        ),
        (lambda: ft["vote"](store, 0, [m0, m1], m0, True, 0.0, up), "timeout_s > 0"),
        (lambda: ft["Lease"](store, m0, 0.0), "lease_s > 0"),
        (lambda: ft["sync_state"](pg, [m0, m1], m3, rep, True), "must be one of the members"),
        (lambda: ft["sync_state"](pg, [m0, m1, m2], m0, rep, True), "group, of 3 members: got 2"),
        (lambda: ft["recover"](pg, [m0, m1, m2], m0, rep), "group, of 3 members: got 2"),
        (lambda: ft["recover"](pg, [m0, m1], m3, rep), "must be one of the members"),
        (lambda: ft["shard"](x[:5], y[:5], 0, 3), "divisible by 3 (each owns a shard), got 5"),
        (lambda: ft["shard"](x, y, 3, 3), "id in 0..2"),
        (lambda: ft["shard"](x, y, -1, 3), "id in 0..2"),
        (lambda: ft["local_grads"](model, x, y, [m0, m3], m3, 3, sq, len), "replica 3 of 3"),
        (lambda: ft["allreduce_grads"](pg, rep.params, torch.tensor(1.0)), "no gradient"),
        (lambda: ft["apply_update"](rep, 1.0, False, torch.tensor(0.0), 1.0, 0, 4), "max_skips"),
        (
            lambda: ft["apply_update"](rep, 1.0, False, torch.tensor(0.0), 1.0, 2, 0),
            "snapshot_every",
        ),
        (lambda: ft["Replica"](model, torch.optim.SGD(model.parameters(), lr=0.1), 4), "not SGD's"),
        (
            lambda: ft["Replica"](model, torch.optim.Adam(model.parameters(), amsgrad=True), 4),
            "amsgrad",
        ),
    ]
    for call, words in bad:
        with pytest.raises(ValueError, match=re.escape(words)):
            call()
        assert store.calls == [] and pg.calls == [], (words, store.calls, pg.calls)
    assert rep.version == 0 and rep.step == 0  # apply_update refused before it changed anything
    # the same cores with good input reach the store and the group: the counts above could see a call
    assert ft["join_round"](store, 0, m0, lambda: 1, 1.0, 1.0) == [m0] and "add" in store.calls
    assert ft["vote"](store, 0, [m0], m0, True, 1.0, up) and "compare_set" in store.calls
    model.bias.grad = torch.zeros_like(model.bias)
    ft["allreduce_grads"](pg, rep.params, torch.tensor(1.0, dtype=torch.float64))
    assert pg.calls == ["allreduce"]


# ----------------------------------------------------------------------------- what recovery sends
def float64_flattening(ft):
    """The mutant: the state sent as one flat float64 tensor (this file before issue 39), still exact."""
    Replica = ft["Replica"]
    full, load_full = Replica.full, Replica.load_full

    def full64(self):
        return [torch.cat([t.double().reshape(-1) for t in full(self)])]

    def load64(self, state):
        mine = full(self)
        flat = state[0].split([t.numel() for t in mine])  # (numel of the whole state,) float64
        load_full(self, [v.view_as(t).to(t.dtype) for t, v in zip(mine, flat)])

    Replica.full, Replica.load_full = full64, load64


def recovery_wire(ft, steps=5):
    """Replica 0 (version 3, after an AdamW step; float32 weights and a bfloat16 gain) recovers replica 1
    (version -1, other weights) through sync_state on a real gloo group of two (one thread each, in this
    process). Returns (every broadcast's (dtype, shape) as each member handed it, the bytes sync_state
    reports, the source's and the receiver's Replica after)."""
    import threading

    store, M, sent, reps = dist.HashStore(), ft["Member"], {0: [], 1: []}, {}
    members = [M(0, 0, 3, 1, -1), M(1, 1, -1, 0, -1)]

    class Seen:  # the group, recording every tensor handed to its broadcast
        def __init__(self, pg, rank):
            self.pg, self.rank = pg, rank

        def size(self):
            return self.pg.size()

        def broadcast(self, tensor, src):
            sent[self.rank].append((tensor.dtype, tuple(tensor.shape)))
            return self.pg.broadcast(tensor, src)

    def member(rank, out):
        torch.manual_seed(rank)
        model = torch.nn.Linear(3, 2)
        model.gain = torch.nn.Parameter(torch.tensor(1.5, dtype=torch.bfloat16))
        rep = ft["Replica"](model, torch.optim.AdamW(model.parameters(), foreach=False), steps)
        if rank == 0:  # a state with moments, a step count, a loss history and its own snapshot
            for p in rep.params:
                p.grad = torch.randn_like(p)
            rep.opt.step()
            rep.snapshot = rep.on_host()
            rep.opt.step()
            rep.version, rep.step, rep.batch, rep.losses = 3, 1, 2, [0.25]
        gloo = dist.ProcessGroupGloo(dist.PrefixStore("g", store), rank, 2, timedelta(seconds=60))
        pg = ft["Bounded"](gloo, 0, 60.0, lambda: False)
        out[rank] = ft["sync_state"](Seen(pg, rank), members, members[rank], rep, False)
        reps[rank] = rep

    out = {}
    threads = [threading.Thread(target=member, args=(r, out)) for r in (0, 1)]
    [t.start() for t in threads]
    [t.join(120) for t in threads]
    assert out[0][1] == out[1][1] == [1], out
    return sent, out[0][2], reps[0], reps[1]


def test_recovery_sends_each_tensor_in_its_own_dtype():
    """Issue 39: what sync_state hands to the recovery broadcast, observed at the group: one tensor per state
    tensor, in its own dtype and shape, on both members (the receiver's from its own model and optimizer):
    weights, exp_avg, exp_avg_sq (float32 and bfloat16 here, as the parameters), AdamW's step counts
    (float32, 0-dim), the counters and losses (float64, 5 + steps), then the snapshot's the same again. The
    bytes are the state's own (closed form from the shapes), and the receiver ends bit for bit equal to the
    source. The mutant sending one float64 copy (the file before) is as exact, and is caught by the wire."""
    import itertools

    steps = 5
    params = [
        ((2, 3), torch.float32),
        ((2,), torch.float32),
        ((), torch.bfloat16),
    ]  # weight, bias, gain
    one = (
        [(d, s) for s, d in params] * 3
        + [(torch.float32, ())] * 3
        + [(torch.float64, (5 + steps,))]
    )
    size = {torch.float32: 4, torch.bfloat16: 2, torch.float64: 8}
    state_bytes = 2 * sum(size[d] * math.prod(s) for d, s in one)  # 2 x (3 x 34 + 12 + 80) = 388
    wire_ok = lambda sent, nbytes: sent[0] == sent[1] == one * 2 and nbytes == state_bytes  # noqa: E731
    sent, nbytes, src, dst = recovery_wire(section.load("fault_tolerance.py"), steps)
    assert wire_ok(sent, nbytes) and state_bytes == 388, (sent, nbytes)
    # (bit for bit, dtype too; the NaN padding)
    for a, b in itertools.zip_longest(src.full(), dst.full()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    assert (dst.version, dst.step, dst.batch, dst.losses) == (3, 1, 2, [0.25])
    # (the rollback snapshot stays on the host)
    assert all(t.device.type == "cpu" for t in dst.snapshot)
    mutant = section.load("fault_tolerance.py")
    float64_flattening(mutant)
    sent64, nbytes64, src, dst = recovery_wire(mutant, steps)
    for a, b in zip(src.full(), dst.full()):  # exact too: parity cannot see it
        torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
    assert not wire_ok(sent64, nbytes64) and nbytes64 == 8 * 80, (
        sent64,
        nbytes64,
    )  # 80 elements, 8 B each
    print(
        f"\nrecovery wire: {len(sent[0])} tensors, {nbytes} B (float32, bfloat16, float64 as the state); "
        f"the mutant's one float64 copy: {nbytes64} B"
    )


NO_FREE = ("        del buf  # (before the next is allocated)\n", "")


def test_recovery_holds_one_extra_tensor_at_a_time(monkeypatch):
    """NCCL review 4, N4-6: recovery allocates its buffers one tensor at a time (allocate, broadcast, wait,
    copy into the live tensor or the host snapshot, free), never the whole state at once (24 extra bytes per
    fp32 parameter on every member's GPU, an OOM for a model that fills it). Observed: every buffer made by
    torch.empty_like during recovery_wire's sync_state is followed by a weak reference, and at each new one
    the buffers still alive are counted: at most one, the new one. The mutant keeping the last buffer while
    the next is allocated (its `del` removed) holds two: caught."""
    import weakref

    real = torch.empty_like
    made = []
    most = [0]

    def counted(*args, **kwargs):
        t = real(*args, **kwargs)
        made.append(weakref.ref(t))
        most[0] = max(most[0], sum(r() is not None for r in made))
        return t

    monkeypatch.setattr(torch, "empty_like", counted)
    text = (ROOT / "fault_tolerance.py").read_text()
    assert text.count(NO_FREE[0]) == 1
    result = {}
    for name, ns in [
        ("file", section.load("fault_tolerance.py")),
        ("mutant", section.load("fault_tolerance.py", text.replace(*NO_FREE))),
    ]:
        made.clear()
        most[0] = 0
        _, nbytes, src, dst = recovery_wire(ns)
        for a, b in zip(src.full(), dst.full()):  # (the recovery itself is exact either way)
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True)
        result[name] = (len(made), most[0])
    assert result["file"] == (26, 1), result  # 2 x 13 tensors (as the wire test), one at a time
    assert result["mutant"][1] == 2, result
    print(f"\nrecovery buffers (made, most alive at once): {result}")


# ----------------------------------------------------------------------------- goodput, from the records
def test_goodput_counts_overlapping_rounds_once():
    """recovery_figures: each committed round's span is timed by its own lowest member, from before its
    check-in, so when the lowest member changes (a replica left out, or recovering) two spans can overlap;
    the useful time is their union, and goodput can never pass 1 (it once read 1.014). Closed form: committed
    rounds 0, 1, 3 spanning [0, 2], [1, 3], [4, 5] s (round 2, [3, 4], discarded): 4 s useful of 5 s wall."""
    import fault_tolerance as ft

    s = dist.HashStore()
    for k, (t0, t1) in enumerate([(0, 2), (1, 3), (3, 4), (4, 5)]):
        s.set(f"t/{k}", f"{100.0 + t0!r} {100.0 + t1!r} {min(k, 2)} update")
    f = ft.recovery_figures(
        s, SimpleNamespace(replicas=2, phase="during", recipe="live"), [0, 1, 3]
    )
    assert f["wall_s"] == 5.0 and f["useful_s"] == 4.0 and f["goodput"] == 0.8, f


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "flags, words",
    [
        (["--replicas", 5], ["a batch of rows divisible by 5 (each owns a shard), got 12"]),
        (["--max-skips", 0], ["max_skips and snapshot_every must be >= 1, got 0 and 4"]),
        (
            ["--kill-replica", 3, "--replicas", 3, "--at-step", 1],
            ["--kill-replica 3 needs a replica in 0..2"],
        ),
        (
            ["--recipe", "restart", "--replica", 1, "--coordinator", "127.0.0.1:1"],
            ["--recipe restart needs --ckpt-dir"],
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(flags, words):
    """The launcher, and a replica as the launcher starts it (before it touches the coordinator)."""
    p = run_python("fault_tolerance.py", *TINY, *flags)
    lines = (p.stdout + p.stderr).strip().splitlines()
    # One use of every flag `--help` lists (with the companions it needs), each accepted by check_args.
    assert p.returncode == 2 and len(lines) == 1 and all(w in lines[0] for w in words), (
        p.stdout + p.stderr
    )


USES = """--steps 5|--batch-size 6|--seq-len 9|--vocab 40|--d-model 32|--n-layers 3|--n-heads 4|--lr 0.01
|--weight-decay 0|--clip 0|--seed 1|--dtype float32|--ragged|--no-ragged|--check|--no-check|--json x.json
|--ckpt-dir D --recipe restart --save-every 2|--save-every 2 --ckpt-dir D --recipe restart|--timeout 30
|--replicas 2|--join-ms 50|--min-replicas 2|--kill-replica 1 --at-step 2|--at-step 2 --corrupt-replica 0
|--freeze-replica 1 --at-step 1|--phase join|--max-restarts 0|--recipe restart --ckpt-dir D --save-every 2
|--spike-sigma 3|--max-skips 1|--snapshot-every 2|--inject-spike 3,5|--verify-every 2
|--corrupt-replica 2 --at-step 1|--host 0.0.0.0|--lease-ms 3000"""
HIDDEN = ["--coordinator", "--replica", "--life"]  # parsed, not listed: the launcher gives them
ABSENT = ["--fail-at-step", "--dropout"]  # not flags of this file at all (harness.BaseArgs)


def test_help_lists_only_what_the_file_accepts(tmp_path, capsys):
    """Issue 43 deliver 5, issue 47 item 4: `python fault_tolerance.py --help` lists no launcher-internal flag
    (--coordinator, --replica, --life: they still parse, so a user who types one gets the file's own refusal),
    and its Args does not inherit --fail-at-step or --dropout (harness.BaseArgs, not CommonArgs: HIDDEN no
    longer needs them), so either is refused in one line as an unknown flag. Every flag it lists is accepted
    (one use of each, checked by check_args here; the table must name exactly the listed flags), and the
    description is the docstring's whole first paragraph."""
    import fault_tolerance as ft

    p = run_python("fault_tolerance.py", "--help")
    assert p.returncode == 0, p.stderr
    uses = [u.split() for u in USES.replace("\n", "").split("|")]
    as_used = lambda text: (
        sorted(listed(text)) == sorted(u[0] for u in uses)
        and not [  # noqa: E731
            f for f in HIDDEN + ABSENT if re.search(f"{f}\\b(?!-)", text)
        ]
    )
    assert as_used(p.stdout), sorted(set(listed(p.stdout)) ^ {u[0] for u in uses})

    class Unhidden(ft.Args):  # the mutant: no HIDDEN (this file before issue 43)
        HIDDEN = ()

    with pytest.raises(SystemExit):
        ft.parse_args(Unhidden, ["--help"])
    assert not as_used(capsys.readouterr().out)  # caught
    for use in uses:
        a = ft.parse_args(ft.Args, [*TINY, *[str(tmp_path / w) if w == "D" else w for w in use]])
        ft.check_args(a)  # (a refusal would exit 2 here)
    assert not {"dropout", "fail_at_step"} & {f.name for f in dataclasses.fields(ft.Args)}
    refusals = [
        ("--fail-at-step", 2, "unrecognized arguments: --fail-at-step 2"),
        ("--dropout", 0.1, "unrecognized arguments: --dropout 0.1"),
        ("--replica", 1, "the launcher's"),
    ]
    for flag, value, words in refusals:
        with pytest.raises(SystemExit) as refused:
            ft.check_args(ft.parse_args(ft.Args, [*TINY, flag, str(value)]))
        assert refused.value.code == 2 and words in capsys.readouterr().err, flag
    description = p.stdout.split("\n\n")[1]  # (between the usage and the options)
    assert description.split() == ft.__doc__.split("\n\n")[0].split(), description  # word for word


def listed(help_text):
    """The flags an argparse --help lists in its options (both forms of a boolean; not -h/--help)."""
    return [
        o.split()[0]
        for line in help_text.split("options:")[1].splitlines()
        if re.match(r"  --", line) and "--help" not in line
        for o in re.split(r"\s{2,}", line.strip())[0].split(", ")
    ]


def tiny(steps):
    """TINY as the args reference_train takes."""
    it = iter(TINY)
    a = {k.lstrip("-").replace("-", "_"): v for k, v in zip(it, it)}
    return SimpleNamespace(
        vocab=int(a["vocab"]),
        seq_len=int(a["seq_len"]),
        d_model=int(a["d_model"]),
        n_heads=int(a["n_heads"]),
        n_layers=int(a["n_layers"]),
        dropout=0.0,
        batch_size=int(a["batch_size"]),
        steps=steps,
        dtype=a["dtype"],
        seed=0,
        lr=3e-3,
        weight_decay=0.1,
        clip=1.0,
        ragged=False,
    )


# ----------------------------------------------------------------------------- no split brain (issue 39)
def in_thread(fn, *args):
    """fn(*args) in a thread; returns a handle whose .result() waits for it (and re-raises)."""
    import concurrent.futures

    return concurrent.futures.ThreadPoolExecutor(1).submit(fn, *args)


NO_MAJORITY = (
    "2 * n > alive",
    "True",
)  # today's rule before issue 39: the window alone closes a round
NO_FENCE = ("commit = every_yes and current", "commit = every_yes")


def split_brain(ft):
    """The two ways a minority quorum could commit beside the majority, on the section's cores (in this
    process, one thread per replica, one in-memory store). 1. Replica 2 missed round 0's window (0 and 1
    closed it as a majority of 3): alone in round 1, it must wait for the others, not close a round of one.
    2. Were a round of one to form anyway (round 1 = {2}, written by hand, beside round 0 = {0, 1}, both at
    version 0), its vote must not commit: one commit per version. Returns (round 1's members as replica 2
    saw them once the others came, whether it had closed alone, whether the lone round committed)."""
    M, store = ft["Member"], dist.HashStore()
    m = [M(r, 0, 0, 0, -1) for r in range(3)]
    three = lambda: 3  # noqa: E731  (three replicas alive, as their leases count them)
    first = [in_thread(ft["join_round"], store, 0, m[r], three, 0.05, 5.0) for r in (0, 1)]
    assert [f.result() for f in first] == [m[:2]] * 2
    assert ft["join_round"](store, 0, m[2], three, 0.05, 5.0) is None  # late: round 0 had closed
    lone = in_thread(ft["join_round"], store, 1, m[2], three, 0.05, 5.0)
    import time

    time.sleep(0.5)  # ten windows: a round of one closes in 0.05 s
    alone = lone.done()
    if not alone:
        others = [in_thread(ft["join_round"], store, 1, m[r], three, 0.05, 5.0) for r in (0, 1)]
        seen = lone.result()  # a majority with replica 2: whoever came before its window had passed
        assert all(f.result() in (seen, None) for f in others) and len(seen) >= 2
    seen = lone.result()
    s2 = dist.HashStore()  # 2. a round of one beside a majority round, both from version 0
    for k, members in [(0, m[:2]), (1, m[2:])]:
        for i, x in enumerate(members, 1):
            s2.set(
                f"q{k}/slot{i}",
                " ".join(map(str, (x.rid, x.life, x.version, x.step, x.gid))),
            )
        s2.set(f"q{k}/size", str(len(members)))
    up = lambda m: True  # noqa: E731  (every member holds its lease)
    lone_vote = in_thread(ft["vote"], s2, 1, m[2:], m[2], True, 5.0, up)  # waits for round 0's
    assert all(
        f.result()
        for f in [in_thread(ft["vote"], s2, 0, m[:2], m[r], True, 5.0, up) for r in (0, 1)]
    )
    return seen, alone, lone_vote.result()


def test_no_minority_round_closes_or_commits():
    """Issue 39 deliver 0, on the cores (tests/section.py's copy-out form): the straggler waits and joins the
    majority (round 1 has it and another), and a lone round of the same version is voted down (round 0
    committed version 1 first). Each rule's mutant, the window alone closing a round / a vote without the
    version fence, lets a round of one through: caught."""
    ft = section.load("fault_tolerance.py")
    seen, alone, lone_committed = split_brain(ft)
    assert not alone and 2 in [x.rid for x in seen] and len(seen) >= 2 and not lone_committed
    text = (ROOT / "fault_tolerance.py").read_text()
    for old, new in (NO_MAJORITY, NO_FENCE):
        assert text.count(old) == 1, old
        # ----------------------------------------------------------------------------- signals sent from outside
        seen, alone, lone_committed = split_brain(
            section.load("fault_tolerance.py", text.replace(old, new))
        )
        assert (
            (alone and [x.rid for x in seen] == [2]) if old == NO_MAJORITY[0] else lone_committed
        ), old


def replica_pid(marker, r):
    """The pid of replica r's live process in the launch whose --json is `marker` (None: there is none)."""
    for pid in processes_of(marker):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        if b"--replica" in argv and argv[argv.index(b"--replica") + 1] == str(r).encode():
            return pid
    return None


class Live:
    """`python fault_tolerance.py ARGS --json tmp/NAME.json` started as a user would, its output read as it
    comes (`lines`, `wait_for(text)`) while the test sends signals by pid; `finish()` waits for it. Whatever
    happens, `close()` resumes and kills every process of the launch: nothing is left running."""

    def __init__(self, tmp_path, *args, name="live", script=""):
        import threading

        self.marker = str(tmp_path / f"{name}.json")
        # (a mutant's NAME comes before the flags)
        first = list(map(str, args[:1])) if script else []
        argv = [
            str(ROOT / (script or "fault_tolerance.py")),
            *first,
            *TINY,
            *map(str, args[len(first) :]),
        ]
        self.p = subprocess.Popen(
            [sys.executable, *argv, "--json", self.marker],
            env=ENV,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines, self.seen = [], threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.p.stdout:
            with self.seen:
                self.lines.append(line.rstrip("\n"))
                self.seen.notify_all()

    def wait_for(self, text, within):
        """Seconds until a line containing `text` came (from now), or None past `within` s."""
        import time

        t0 = time.monotonic()
        with self.seen:
            while not any(text in l for l in self.lines):
                left = within - (time.monotonic() - t0)
                if left <= 0 or self.p.poll() is not None and not self.seen.wait(0.5):
                    return None if not any(text in l for l in self.lines) else time.monotonic() - t0
                self.seen.wait(min(left, 0.5))
        return time.monotonic() - t0

    def signal(self, r, sig):
        pid = replica_pid(self.marker, r)
        if pid:
            os.kill(pid, sig)
        return pid

    def finish(self, within=600):
        self.p.wait(timeout=within)
        self.output = "\n".join(self.lines)
        return json.loads(open(self.marker).read()) if os.path.exists(self.marker) else None

    def close(self):
        for pid in processes_of(self.marker):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
        self.p.kill()
        self.p.wait()
        assert processes_of(self.marker) == []


def every_replica_equals_the_replay(marker, s, args):
    """Checked here, not by the run's --check: the final weights of every replica that ended the run (each
    writes its own) equal each other and the one-process replay of what was committed, computed here."""
    import fault_tolerance as ft

    a = ft.parse_args(ft.Args, [*TINY, *map(str, args)])
    ref = ft.replay_reference(a, s["figures"]["batches"], s["figures"]["members"])["params"]
    finals = [torch.load(f"{marker}.replica{r}.pt") for r in s["figures"]["final_members"]]
    worst = max((f[n] - p).abs().max().item() for f in finals for n, p in ref.items())
    # (float64: every replica is the replay, so each equals the others)
    assert worst <= 1e-12, worst
    return worst


STRAGGLER = ["--replicas", 3, "--steps", 10, "--join-ms", 50, "--timeout", 20, "--check"]


# (one in the suite, for its time; six runs passed by hand)
@pytest.mark.parametrize("run", range(1))
def test_a_straggler_in_bursts_never_forks_the_replicas(tmp_path, run):
    """Issue 39's fork, sent from outside: replica 2 paused and resumed in short bursts (SIGSTOP 60-150 ms,
    SIGCONT 30 ms, by pid) so that it misses --join-ms 50 windows by a little, round after round, for the
    first steps. It may be left out of rounds and come back (recovered from a peer), but it never trains a
    step alone: every replica ends with the same weights, equal to the one-process replay of what was
    committed (checked here from each replica's own file), and the run's --check passes."""
    import random
    import time

    live, rng = Live(tmp_path, *STRAGGLER), random.Random(run)
    try:
        assert live.wait_for("step    1 ", 300) is not None, live.lines[-20:]
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 and live.p.poll() is None:
            live.signal(2, signal.SIGSTOP)
            time.sleep(rng.uniform(0.06, 0.15))
            live.signal(2, signal.SIGCONT)
            time.sleep(0.03)
        s = live.finish()
    finally:
        live.close()
    exact(SimpleNamespace(returncode=live.p.returncode, output=live.output), s)
    assert sorted(s["figures"]["final_members"]) == [0, 1, 2]
    worst = every_replica_equals_the_replay(live.marker, s, STRAGGLER)
    print(
        f"straggler run {run}: members {s['figures']['members']}, recoveries {s['figures']['recoveries']}, "
        f"replicas vs replay {worst:.1e}"
    )


JOIN_KILL = [
    "--replicas",
    3,
    "--steps",
    5,
    "--kill-replica",
    1,
    "--at-step",
    2,
    "--phase",
    "join",
    "--timeout",
    20,
    "--check",
]


@pytest.mark.parametrize("restarts", [0])  # (1 passed too: the R 3 test covers a restarted rejoin)
def test_a_kill_at_the_moment_of_the_join_never_forks(tmp_path, restarts):
    """Replica 1 is killed just after a round closed with it (a member, its group not yet used): the others
    find it gone (its lapsed lease, or the broken group), vote the round down and go on as a majority of two;
    restarted (restarts 1, --min-replicas 3: the others wait for it), it comes back with no state and
    recovers live. Every replica's weights equal the
    replay, checked here; the run's --check passes; the death is in the recovery figures."""
    args = [*JOIN_KILL, "--max-restarts", restarts, "--min-replicas", 3 if restarts else 1]
    p, s = launch(tmp_path, *args)
    exact(p, s)
    assert measured_failure(s, 1, 2)["injected"]
    assert sorted(s["figures"]["final_members"]) == ([0, 1, 2] if restarts else [0, 2])
    every_replica_equals_the_replay(str(tmp_path / "run.json"), s, args)


# ----------------------------------------------------------------------------- a hung replica (NCCL's way)
FREEZE = [
    "--replicas",
    3,
    "--steps",
    5,
    "--freeze-replica",
    1,
    "--join-ms",
    300,
    "--timeout",
    2,
    "--check",
]
# The others must commit the frozen step within BOUND_S (--timeout 2 plus rounds: 3.6-4.3 s seen at load 30
# with --timeout 3; 2.3-2.5 s with leases at load 14). The lease (5 s by default) is not what ends these.
BOUND_S = 16


def frozen_run(tmp_path, phase, step, mutant="", flags=FREEZE, bound_s=BOUND_S):
    """Replica 1 freezes itself (SIGSTOP) at `step` in `phase`; the test waits for the others to commit that
    step without it (up to bound_s), then resumes it (SIGCONT, by pid). Returns (s to commit or None, live)"""
    args = [*flags, "--at-step", step, "--phase", phase]
    script = "tests/fault_tolerance_checks.py" if mutant else ""
    live = Live(tmp_path, *([mutant] if mutant else []), *args, script=script)
    try:
        assert live.wait_for(f"SIGSTOP at step {step}", 300) is not None, live.lines[-20:]
        took = live.wait_for(f"step {step:4d} |", bound_s)
        live.signal(1, signal.SIGCONT)
        live.summary = live.finish(300) if took is not None else None
    finally:
        live.close()
    return took, live


@pytest.mark.parametrize("phase, step", [("during", 2), ("group", 0), ("after", 2)])
def test_a_frozen_replica_is_left_behind_within_the_deadline(tmp_path, phase, step):
    """Issue 39 deliver 1: a replica hung (SIGSTOP) just before the step's all-reduce (its peers wait in it),
    while its round's group is being made (step 0, the first group), or before its vote: the others give up
    on it at --timeout 2 (the host's deadline on the collective, the group's arrival, the vote), abort, vote
    the round down and commit the step as a majority of two within BOUND_S, their pids unchanged; resumed,
    the frozen one rejoins live (recovered from a peer) or exits with one line. Exact against the replay,
    every replica that ended equal to it (checked here); nothing left running."""
    took, live = frozen_run(tmp_path, phase, step)
    assert took is not None, f"step {step} not committed within {BOUND_S} s\n" + "\n".join(
        live.lines[-30:]
    )
    s = live.summary
    exact(SimpleNamespace(returncode=live.p.returncode, output=live.output), s)
    assert len(pids(s)[0]) == len(pids(s)[2]) == 1, pids(s)
    assert [0, 2] in s["figures"]["members"]
    assert (
        1 in s["figures"]["final_members"]
        or "replica 1: the run finished without it" in live.output
    )
    every_replica_equals_the_replay(live.marker, s, [*FREEZE, "--at-step", step, "--phase", phase])
    print(
        f"frozen {phase} at step {step}: the others committed it {took:.1f} s after the SIGSTOP line"
    )


def test_a_wait_without_deadline_is_caught(tmp_path):
    """The mutant whose collectives are waited for as NCCL's wait() would, by work.wait() with neither our
    deadline nor the leases polled (gloo's own timeout, 2 x --timeout = 240 s, stands in for the watchdog):
    frozen during the all-reduce (the lease test's run), the others do not commit within LEASE_BOUND_S. The
    test ends at its own bound, and leaves nothing running. (The deadline alone, for a member stuck with its
    lease held, and its mutant: test_the_cuda_branch_runs_here_with_the_backend_stubbed.)"""
    took, live = frozen_run(
        tmp_path, "during", 2, mutant="no-deadline", flags=LEASE, bound_s=LEASE_BOUND_S
    )
    assert took is None, live.lines[-20:]


# ----------------------------------------------------------------------------- the lease (issue 47 item 4)
LEASE = [
    "--replicas",
    3,
    "--steps",
    5,
    "--freeze-replica",
    1,
    "--join-ms",
    300,
    "--lease-ms",
    3000,
    "--timeout",
    120,
    "--check",
]
# The others must commit the frozen step within LEASE_BOUND_S: the lease (3 s), then a round and a step (a
# few seconds on a loaded machine); without leases they would wait out the 120 s deadline.
LEASE_BOUND_S = 40


def test_a_frozen_replica_is_dropped_by_its_lease_not_the_deadline(tmp_path):
    """Issue 47 item 4 (NCCL review 4, N4-3): each replica owns its failure detection, a lease on the
    coordinator refreshed by a thread. Replica 1 is frozen (SIGSTOP: its lease thread stops too) just before
    the step's all-reduce, which its peers enter and where gloo, like NCCL, waits for it; with --timeout 120
    the others learn of it by its lease (3 s: their failure line says the member lost its lease, not that
    the collective timed out), abort the group, vote the round down and commit step 2 as a majority of two
    well within LEASE_BOUND_S, their pids unchanged; exact against the replay. The mutant whose leases never
    lapse waits out the deadline: caught by the same bound."""
    took, live = frozen_run(tmp_path, "during", 2, flags=LEASE, bound_s=LEASE_BOUND_S)
    assert took is not None, f"step 2 not committed within {LEASE_BOUND_S} s\n" + "\n".join(
        live.lines[-30:]
    )
    s = live.summary
    exact(SimpleNamespace(returncode=live.p.returncode, output=live.output), s)
    assert len(pids(s)[0]) == len(pids(s)[2]) == 1, pids(s)
    assert s["figures"]["members"][2] == [0, 2], s["figures"]["members"]
    lost = [l for l in live.lines if "failed" in l and "lost its lease" in l]
    # both survivors failed the round on the lease; the frozen replica, once resumed, may find its own
    # lease lapsed too (whether its heartbeat or its wait runs first is the scheduler's choice)
    assert {l.split(":")[0] for l in lost} >= {"replica 0", "replica 2"}, live.lines[-30:]
    assert not [l for l in live.lines if "took over 120" in l]
    every_replica_equals_the_replay(live.marker, s, [*LEASE, "--at-step", 2, "--phase", "during"])
    print(
        f"lease 3 s, --timeout 120: step 2 committed without replica 1 {took:.1f} s after its SIGSTOP"
    )
    took, live = frozen_run(
        tmp_path, "during", 2, mutant="no-lease", flags=LEASE, bound_s=LEASE_BOUND_S
    )
    assert took is None, live.lines[-20:]


def test_the_replicas_environment_bounds_nccl_init_by_the_timeout():
    """NCCL review 4, N4-2: torch waits for a non-blocking NCCL communicator's init by
    TORCH_NCCL_NONBLOCKING_TIMEOUT alone (30 min by default): the launcher sets it to --timeout for the
    replicas, beside the two that keep the watchdog from deciding; and the docstring no longer claims that
    the first collective's deadline bounds the init."""
    import fault_tolerance as ft
    import ft_launcher

    env = ft_launcher.environment(37)
    assert env["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "37"
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == env["TORCH_NCCL_ENABLE_MONITORING"] == "0"
    doc = " ".join((ft.__doc__ + ft.quorum_group.__doc__).split())
    assert "deadline bounds it" not in doc and "TORCH_NCCL_NONBLOCKING_TIMEOUT" in doc


NO_DEADLINE = ("if time.monotonic() - t0 > timeout_s:", "if False:")


def test_the_cuda_branch_runs_here_with_the_backend_stubbed(monkeypatch):
    """Issue 39 deliver 1, the code a GPU would run, run without one (so a typo in it cannot wait for a GPU):
    the device choice (cuda:(replica % GPUs), made current), the group's construction (ProcessGroupNCCL under
    the round's prefix, the member's rank, non-blocking, connected at once on the device, inside the round
    (NCCL review 4, N4-2), its own timeout 2 x ours, N4-8), and the wait: by polling is_completed(), which
    never blocks on NCCL; past the deadline it aborts the group once, lets it go, and raises; and as soon as
    a member loses its lease it raises without waiting out the deadline (N4-3: 120 s here), on the section's
    cores, NCCL and CUDA stubbed. The mutant without the deadline still waits after four deadlines: caught."""
    import time

    ft, made, current = section.load("fault_tolerance.py"), [], []
    released = []  # (once the test appends to it, every collective has completed)

    class NCCL:  # records what it was built with; its collectives never finish (a peer frozen)
        Options = dist.ProcessGroupNCCL.Options

        def __init__(self, store, rank, size, opts):
            self.store = store
            self.rank = rank
            self.n = size
            self.opts = opts
            self.aborts = 0
            self.connected = []
            made.append(self)

        def size(self):
            return self.n

        def eager_connect_single_device(self, device):
            self.connected.append(device)

        def allreduce(self, tensors):
            return SimpleNamespace(is_completed=lambda: bool(released), wait=lambda: None)

        def abort(self):
            self.aborts += 1

    monkeypatch.setattr(dist, "ProcessGroupNCCL", NCCL)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    device = ft["replica_device"](3)
    assert device == torch.device("cuda", 1) and current == [device]
    store, M = dist.HashStore(), ft["Member"]
    store.set("g5/here0", "1")  # replica 0 is there already
    m0, m1 = M(0, 0, 0, 0, -1), M(1, 0, 0, 0, -1)
    lost = []  # the members without a lease, as the test says
    live = lambda m: m.rid not in lost  # noqa: E731
    group = ft["quorum_group"](store, 5, [m0, m1], m1, None, 0.5, live, device)
    (pg,) = made
    assert group.gid == 5 and (pg.rank, pg.n) == (1, 2) and not pg.opts.config.blocking, (
        pg.rank,
        pg.n,
    )
    assert pg.opts._timeout.total_seconds() == 1.0 and pg.connected == [device]
    pg.store.set("probe", "1")
    assert store.check(["g5/probe"])  # the round's prefix
    for work in [group.allreduce([torch.zeros(1)]) for _ in range(2)]:  # (two in flight)
        with pytest.raises(TimeoutError, match="took over 0.5 s"):
            work.wait()
    assert pg.aborts == 1 and group.pg is None
    made.clear()
    store.set("g6/here0", "1")
    group = ft["quorum_group"](store, 6, [m0, m1], m1, None, 120.0, live, device)
    work = group.allreduce([torch.zeros(1)])
    lost.append(0)  # replica 0's lease lapses while the all-reduce waits on it
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="lost its lease"):
        work.wait()
    took = time.monotonic() - t0
    assert made[0].aborts == 1 and took < 60, took  # (not the 120 s deadline)
    print(f"\nlease lost: the wait raised after {1e3 * took:.1f} ms (deadline 120 s)")
    # the mutant without the deadline: a member alive but stuck (its lease held) is waited for forever
    text = (ROOT / "fault_tolerance.py").read_text()
    assert text.count(NO_DEADLINE[0]) == 1
    mutant = section.load("fault_tolerance.py", text.replace(*NO_DEADLINE))
    store.set("g7/here0", "1")
    group = mutant["quorum_group"](store, 7, [m0, m1], m1, None, 0.5, lambda m: True, device)
    waiting = in_thread(group.allreduce([torch.zeros(1)]).wait)
    time.sleep(2.0)  # four deadlines
    caught = not waiting.done()
    released.append(True)
    waiting.result()  # (it ends once the collective completes)
    assert caught
