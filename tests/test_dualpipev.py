"""dualpipev.py: DualPipeV (DeepSeek-V3), two chunks per rank in a V, F&B slots, the backward cut into B and W.

The generated schedule equals torch's ScheduleDualPipeV slot for slot (its OVERLAP_F_B = an F&B slot, its
FULL_BACKWARD = B then W in one slot) at 2 <= p <= 6 over several m; a mutant with two slots swapped is caught
by that comparison and by the closed forms of DeepSeek-V3's Table 2 for DualPipeV, computed here with an
independent timeline: idle (PP/2-1)(F&B+B-3W) per rank with PP = 2p stages, activations PP+1 = 2p+1 chunk
micro-batches alive per rank. The communication plans never deadlock under NCCL's semantics (simulated).
Parity with one-process training (float64, 1e-9) at pp 2 x dp 2 ragged, p 2 (through the copy-out check),
p 3 (7 blocks in 6 uneven chunks, m 7) and p 4 (--stage-ms); the executed order (measured events) is
torch's; micro-batches alive, counted and recounted from the events, are 2p+1; bytes sent m (b, T, D) per
neighbour and way as theory says. The core copied onto another model (the section alone, group [1, 0])
equals one-process training (W never run: caught); each core refuses what it cannot do before any
transfer; bad input exits 2 with one line on every rank.
Launches: 4 torchrun (one also runs the copy-out check), 1 plain python, 3 bad-input cases."""

import json
import sys

import pytest

from helpers import (
    ROOT,
    TINY,
    assert_each_rank_fails,
    assert_matches_reference,
    run_python,
    run_ranks,
    simulate_p2p_plans,
    torchrun,
)

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import dualpipev as dpv  # noqa: E402  (importing must not run main())
import pipeline_checks  # noqa: E402

CFG = [*TINY, "--batch-size", "16", "--steps", "3"]
LAUNCHES = {  # name: (nproc, flags)
    "p2": (
        2,
        ["--n-layers", "4"],
    ),  # through tests/dualpipev_checks.py copy-out: the copied core first
    "pp2 dp2": (4, ["--pp", "2", "--dp", "2", "--n-layers", "4", "--ragged"]),
    "p3 uneven": (3, ["--n-layers", "7", "--microbatches", "7", "--batch-size", "14"]),
    "p4 stage-ms": (4, ["--n-layers", "8", "--microbatches", "8", "--stage-ms", "20"]),
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """torchrun dualpipev.py once per configuration, with --check and --trace; tests share the runs."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, flags = LAUNCHES[name]
            tmp = tmp_path_factory.mktemp("dpv")
            head = ["dualpipev.py", nproc]
            if name == "p2":
                head = ["tests/dualpipev_checks.py", nproc, "copy-out", tmp / "copy_out.json"]
            summary, out = torchrun(
                *head,
                *CFG,
                *flags,
                "--check",
                "--trace",
                tmp / "trace.json",
                tmp_path=tmp,
                timeout=400,
            )
            copy_out = None
            if (tmp / "copy_out.json").exists():
                copy_out = dict(
                    json.loads((tmp / "copy_out.json").read_text()),
                    bad=[
                        json.loads((tmp / f"copy_out.json.bad-rank{r}").read_text())
                        for r in range(nproc)
                    ],
                )
            runs[name] = (summary, out, json.loads((tmp / "trace.json").read_text()), copy_out)
        return runs[name]

    return get


# ----------------------------------------------------------------------------- torch's order, slot for slot
def torch_slots(p, m, r):
    """torch's ScheduleDualPipeV, rank r, from its own per-rank planner, as slots of (kind, chunk, mb):
    FORWARD [F], BACKWARD_INPUT [B], BACKWARD_WEIGHT [W], FULL_BACKWARD [B, W], OVERLAP_F_B its two."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}

    def ops(a):
        name = a.computation_type.name
        if name == "OVERLAP_F_B":
            return [op for sub in a.sub_actions for op in ops(sub)]
        if name == "FULL_BACKWARD":
            return [
                ("B", a.stage_index, a.microbatch_index),
                ("W", a.stage_index, a.microbatch_index),
            ]
        return [(kind[name], a.stage_index, a.microbatch_index)]

    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    return [ops(a) for a in ScheduleDualPipeV._calculate_single_rank_operations(me, r) if a]


def swapped(slots, i):
    """The mutant: slots i and i+1 of one rank's order exchanged."""
    return slots[:i] + [slots[i + 1], slots[i]] + slots[i + 2 :]


PM = [(p, m) for p in range(2, 7) for m in (2 * p, 2 * p + 1, 3 * p + 1)]


@pytest.mark.parametrize("p, m", PM)
def test_schedule_is_torchs_slot_for_slot(p, m):
    """Every rank's generated slots are torch's; every (kind, chunk, mb) of its two chunks once; B after
    F, W after B; m < 2p refused."""
    for r in range(p):
        slots = dpv.dualpipev(p, m, r)
        assert slots == torch_slots(p, m, r), (p, m, r)
        ops = [op for s in slots for op in s]
        assert sorted(ops) == sorted(
            (k, c, j) for k in "FBW" for c in (r, 2 * p - 1 - r) for j in range(m)
        )
        assert all(
            ops.index(("W", c, j)) > ops.index(("B", c, j)) > ops.index(("F", c, j))
            for c in (r, 2 * p - 1 - r)
            for j in range(m)
        )
    with pytest.raises(ValueError, match=f"m >= 2p = {2 * p}"):
        dpv.dualpipev(p, 2 * p - 1, 0)


# ----------------------------------------------------------------------------- DeepSeek-V3's Table 2
def timeline(orders, n, length):
    """An independent replay (not dualpipev.ideal_timeline): each rank runs its slots in order, a slot once
    every input from outside it is done (F: chunk c-1's F; B: chunk c+1's B and its own F; W: its B), for
    length(slot) time units. Returns (idle, busy) per rank over the whole step."""
    p = len(orders)
    end_of = {}
    free = [0] * p
    pos = [0] * p
    while any(pos[r] < len(orders[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while pos[r] < len(orders[r]):
                slot = orders[r][pos[r]]
                wants = []
                for kind, c, k in slot:
                    if kind == "F" and c > 0:
                        wants.append(("F", c - 1, k))
                    if kind == "B":
                        wants += [("F", c, k)] + ([("B", c + 1, k)] if c < n - 1 else [])
                    if kind == "W":
                        wants.append(("B", c, k))
                wants = [w for w in wants if w not in slot]
                if any(w not in end_of for w in wants):
                    break
                start = max([free[r]] + [end_of[w] for w in wants])
                free[r] = start + length(slot)
                end_of.update((op, free[r]) for op in slot)
                pos[r] += 1
                progressed = True
        assert progressed, "the schedule waits on itself"
    busy = [sum(length(s) for s in order) for order in orders]
    return [max(free) - b for b in busy], busy


def peak_alive(slots):
    """Most (chunk, micro-batch) pairs between their F and their W at once on one rank."""
    alive = peak = 0
    for kind, _, _ in (op for s in slots for op in s):
        alive += {"F": 1, "B": 0, "W": -1}[kind]
        peak = max(peak, alive)
    return peak


def table2_errors(orders, p):
    """The schedule against DeepSeek-V3's Table 2 for DualPipeV, PP = 2p stages: idle per rank (PP/2-1)
    (F&B+B-3W), B a full backward (B then W here), F&B an F&B slot, at T_F = T_B (the table's setting),
    W = T_W, F&B = T_F+T_B+T_W (the pair unoverlapped, as here); activations PP+1 alive per rank."""
    errors = []
    for t_f, t_w in ((1, 1), (2, 1), (3, 2)):
        t_b = t_f
        cost = {"F": t_f, "B": t_b, "W": t_w}
        idle, _ = timeline(orders, 2 * p, lambda s: sum(cost[k] for k, _, _ in s))
        f_and_b = t_f + t_b + t_w
        want = (2 * p // 2 - 1) * (f_and_b + (t_b + t_w) - 3 * t_w)
        if idle != [want] * p:
            errors.append(f"T_F {t_f}, T_W {t_w}: idle {idle}, Table 2 {want}")
    peaks = [peak_alive(slots) for slots in orders]
    if peaks != [2 * p + 1] * p:
        errors.append(f"alive {peaks}, Table 2 PP+1 = {2 * p + 1}")
    return errors


@pytest.mark.parametrize("p, m", PM)
def test_bubble_and_activations_are_table_2(p, m):
    """The closed forms of the table, and the file's own ideal timeline and theory() agree: 2(p-1) idle
    slots of 6m (bubble (p-1)/(3m)), 2p+1 alive, m(2 - [r = 0] - [r = p-1]) messages each way."""
    orders = [dpv.dualpipev(p, m, r) for r in range(p)]
    assert table2_errors(orders, p) == []
    at = dpv.ideal_timeline(orders, 2 * p)
    end = max(e for _, _, e in at.values())
    idle = [end - sum(1 for q, _, _ in at.values() if q == r) for r in range(p)]
    assert idle == [2 * (p - 1)] * p
    bubble, alive, fwd, bwd = dpv.theory(p, m)
    assert bubble == pytest.approx(2 * (p - 1) / (6 * m)) and alive == [2 * p + 1] * p
    assert fwd == bwd == [m * (2 - (r == 0) - (r == p - 1)) for r in range(p)]


@pytest.mark.parametrize("p, m, uncaught", [(2, 4, []), (3, 7, []), (4, 8, [(1, 15)])])
def test_two_slots_swapped_are_caught(p, m, uncaught):
    """The mutant: on some rank, two neighbouring slots exchanged. Every such swap is caught by the
    comparison with torch (which the launches apply to the executed order). Swaps of two neighbouring
    F&B slots are also caught by the Table 2 check (or the replay finds them waiting on itself), all but
    one at p 4, m 8 (rank 1's slots 15 and 16, which idle and hold the same: an equally good order)."""
    orders = [dpv.dualpipev(p, m, r) for r in range(p)]
    missed = []
    for r in range(p):
        for i in range(len(orders[r]) - 1):
            if orders[r][i] == orders[r][i + 1]:
                continue
            mutant = orders[:r] + [swapped(orders[r], i)] + orders[r + 1 :]
            assert mutant[r] != torch_slots(p, m, r)
            if len(orders[r][i]) == len(orders[r][i + 1]) == 3:  # two F&B slots
                try:
                    errors = table2_errors(mutant, p)
                except AssertionError:  # waits on itself: a deadlock
                    errors = ["deadlock"]
                if not errors:
                    missed.append((r, i))
    assert missed == uncaught


def test_plans_never_deadlock():
    """The plans of comm_plan, under NCCL's strictest semantics (helpers.simulate_p2p_plans, a slot's
    ops one after another), never deadlock, hand on the exact messages, never wait beyond the ideal
    timeline of one unit an op; the V's turn (chunk p-1 to p on rank p-1) is no message. The negative:
    a rank posting its batches in reverse order."""
    for p, m in PM:
        orders = [dpv.dualpipev(p, m, r) for r in range(p)]
        n = 2 * p
        plans = [expand(dpv.comm_plan(orders, n, r)) for r in range(p)]
        idle, fwd = simulate_p2p_plans(
            plans,
            lambda op: needs(op, n),
            producer,
            {"F": 1, "B": 1, "W": 1},
            lambda msg: msg[:2] in (("F", p), ("B", p - 1)),
        )
        assert fwd == dpv.theory(p, m)[2]
        assert idle == [2 * (p - 1)] * p  # the ideal timeline's: messages never delay a slot
    reverse = [p2p for p2p in plans[0] if p2p[0] == "p2p"][::-1]
    broken = [[s for s in plans[0] if s[0] != "p2p"] + reverse] + plans[1:]
    with pytest.raises(AssertionError):
        simulate_p2p_plans(broken, lambda op: needs(op, n), producer, dict(F=1, B=1, W=1))


def needs(op, n):
    """The message an op (kind, c, k) of n chunks waits for, named as the op: F's activation from chunk
    c-1, B's gradient from chunk c+1; None for chunk 0's F (tokens), chunk n-1's B (its loss) and W."""
    kind, c, _ = op
    return None if kind == "W" or (kind, c) in (("F", 0), ("B", n - 1)) else op


def producer(msg):
    """The op that makes message (kind, c, k): the same kind on chunk c-1 (F) or c+1 (B)."""
    kind, c, k = msg
    return (kind, c - 1 if kind == "F" else c + 1, k)


def expand(plan):
    """A plan's slots as single ops, the form helpers.simulate_p2p_plans reads."""
    return [
        s if s[0] == "p2p" else ("op", op) for s in plan for op in (s[1] if s[0] == "slot" else [0])
    ]


# ----------------------------------------------------------------------------- parity and the measured schedule
def executed(events, step, r, dp=0):
    return [
        (e["kind"], e["chunk"], e["mb"])
        for e in sorted(events, key=lambda e: e["start"])
        if (e["step"], e["pp"], e["dp"]) == (step, r, dp)
    ]


def inflight(events):
    """Most (chunk, micro-batch) pairs between F's start and the end of their W at once, over events."""
    marks = sorted(
        [(e["start"], 1) for e in events if e["kind"] == "F"]
        + [(e["end"], -1) for e in events if e["kind"] == "W"]
    )
    now = peak = 0
    for _, step in marks:
        now += step
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_matches_reference_and_runs_torchs_order(launch, name):
    summary, out, trace, _ = launch(name)
    assert_matches_reference(summary)
    f = summary["figures"]
    cfg = summary["config"]
    p = f["pp"]
    dp = f["dp"]
    m = f["microbatches"]
    assert summary["world_size"] == p * dp == LAUNCHES[name][0]
    assert f["split"] == [list(b) for b in dpv.split_layers(cfg["n_layers"], 2 * p)]
    events = f["events"]
    for s in range(cfg["steps"]):
        for r in range(p):
            want = [op for slot in torch_slots(p, m, r) for op in slot]
            for j in range(dp):
                assert executed(events, s, r, j) == want, (s, r, j)
                assert all(  # chunk c on the rank of the V
                    dpv.holder(e["chunk"], p) == r for e in events if (e["pp"], e["dp"]) == (r, j)
                )
    last = cfg["steps"] - 1
    alive = [
        inflight([e for e in events if e["step"] == last and e["pp"] == r and e["dp"] == 0])
        for r in range(p)
    ]
    assert f["peak_alive_microbatches"] == f["peak_alive_theory"] == alive == [2 * p + 1] * p
    b_bytes = cfg["batch_size"] // (dp * m) * cfg["seq_len"] * cfg["d_model"] * 8
    msgs = [m * (2 - (r == 0) - (r == p - 1)) for r in range(p)]
    assert f["fwd_msgs_per_rank"] == f["bwd_msgs_per_rank"] == msgs
    assert f["sent_bytes_per_rank"] == [2 * k * b_bytes for k in msgs] == f["sent_bytes_theory"]
    assert summary["comm_bytes"] == max(f["sent_bytes_per_rank"])
    for key, row in f["counts_per_rank"].items():  # every pipeline, not only dp 0's
        assert row["sent_bytes"] == f["sent_bytes_per_rank"][int(key[2])], key
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(events) == 3 * 2 * p * m * cfg["steps"] * dp
    assert f["bubble_theory"] == pytest.approx((p - 1) / (3 * m))
    assert "timeline of the last step, measured" in out and f"rank {p - 1} |" in out


def test_stage_ms_replayed_order_is_table_2(launch):
    """p 4, m 8, --stage-ms 20: every op lasted at least its simulated time (what load cannot move); the
    order each rank ran in the last step, regrouped into torch's slots and replayed by the independent
    timeline above, idles (PP/2-1)(F&B+B-3W) per rank; wall-time bubbles are printed, not asserted."""
    f = launch("p4 stage-ms")[0]["figures"]
    assert f["stage_ms"] == 20 and all(e["end"] - e["start"] >= 20 for e in f["events"])
    last = max(e["step"] for e in f["events"])
    orders = []
    for r in range(4):
        ran = iter(executed(f["events"], last, r))
        orders.append([[next(ran) for _ in slot] for slot in torch_slots(4, 8, r)])
    assert orders == [torch_slots(4, 8, r) for r in range(4)]
    assert table2_errors(orders, 4) == []


def test_copy_out_core_on_another_model(launch):
    """SplitBackward, dualpipev, comm_plan, PipelineRank and finish_batch as a reader copies them
    (dualpipev.py's technique section alone, tests/section.py), on pipeline_checks.ZBNet over 2 ranks in
    the group [1, 0]: the first step's clipped gradients, the losses and the final parameters equal
    one-process training's (torch's clip_grad_norm_) within 1e-12; W never run: caught."""
    got = launch("p2")[3]
    assert min(got["reference_norms"]) > pipeline_checks.ZB["clip"], got["reference_norms"]
    case = got["dualpipev"]
    assert case["max_diff"] < 1e-12 and case["max_loss_diff"] < 1e-12, case
    assert case["losses"] == pytest.approx(got["reference_losses"], rel=1e-12)
    assert got["dualpipev, W never run"]["max_diff"] > 1e-3


BAD = {  # what a core of the section is given -> words its ValueError must say
    "split_layers, 5 chunks of 4 blocks": ["5 chunks of 4 blocks", "use 1 to 4 chunks"],
    "dualpipev, m 3 at p 2": ["m >= 2p = 4", "with 3 micro-batches"],
    "dualpipev, p 1": ["pp >= 2"],
    "ideal_timeline, ranks' slots of two schedules": ["waits on itself"],
    "PipelineRank, a plan for p 3 in a group of 2": ["are not in the group", "p = its size"],
    "PipelineRank, a rank outside the group": ["are not in the group"],
    "PipelineRank.run, 3 micro-batches for a plan of 4": ["m = 4 micro-batches", "got 3 inputs"],
    "PipelineRank.run, unequal micro-batches": ["of one shape", "(2, 5), (3, 5)"],
}


def test_cores_refuse_what_they_cannot_do(launch):
    """Each core of the section, given what it cannot do, raises a ValueError saying what is wrong and
    what would work, before any collective or transfer (a harness.CommCounter saw none; the control, a
    valid finish_batch, is seen)."""
    bad = launch("p2")[3]["bad"]
    for rank, cases in enumerate(bad):
        control = cases.pop("control: finish_batch")
        assert control[0] == "no error" and sum(control[1].values()) == 2, (rank, control)
        assert sorted(cases) == sorted(w for w in BAD if rank == 1 or "outside" not in w)
        for what, (error, calls) in cases.items():
            assert error.startswith("ValueError") and all(w in error for w in BAD[what]), (
                rank,
                what,
                error,
            )
            assert calls == {}, (rank, what, calls)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "nproc, flags, words",
    [
        (
            2,
            ["--microbatches", "3", "--n-layers", "4"],
            ["DualPipeV at pp 2 with 3 micro-batches", "--microbatches 4 or more"],
        ),
        (2, ["--n-layers", "2"], ["cuts the model into 4 chunks but --n-layers is 2"]),
        (4, ["--pp", "3"], ["world size 4 != pp 3 x dp 1", "--nproc_per_node=3"]),
    ],
)
def test_bad_input_exits_2_on_every_rank(nproc, flags, words):
    assert_each_rank_fails(run_ranks("dualpipev.py", nproc, *TINY, *flags), words)


def test_world_of_one_and_help():
    p = run_python("dualpipev.py", *TINY)
    assert p.returncode == 2 and "at least 2" in p.stderr and "--nproc_per_node=2" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    help_text = run_python("dualpipev.py", "--help").stdout
    assert "2p chunks" in help_text and "simulate compute" in help_text


def test_no_object_collectives():
    import re

    assert not re.search(r"_object(_list)?\(", (ROOT / "dualpipev.py").read_text())


def test_a_swapped_pair_in_the_source_is_caught():
    """The mutant in dualpipev.py's own text (its technique section loaded alone, tests/section.py): the
    steady step's two F&B slots written the other way round. Its orders are not torch's, and the Table 2
    check (or the replay, waiting on itself) fails at every p tested."""
    import section

    text = (ROOT / "dualpipev.py").read_text()
    old = "            slots.append(f(down) + b(up))\n        slots.append(f(up) + b(down))\n"
    new = "            slots.append(f(up) + b(down))\n        slots.append(f(down) + b(up))\n"
    assert text.count(old) == 1
    mutant = section.load("dualpipev.py", text.replace(old, new))["dualpipev"]
    for p, m in [(2, 4), (3, 7), (4, 8)]:
        orders = [mutant(p, m, r) for r in range(p)]
        assert any(orders[r] != torch_slots(p, m, r) for r in range(p))
        try:
            errors = table2_errors(orders, p)
        except AssertionError:  # waits on itself
            errors = ["deadlock"]
        assert errors, (p, m)
