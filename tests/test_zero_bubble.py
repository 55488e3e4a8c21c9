"""zero_bubble.py: ZB-H1 and ZB-V (Qi et al. 2024), the backward cut into B and W.

Parity with one-process training (float64, 1e-9): ZB-H1 at p 2 (m 4, through the copy-out check), p 3 over 5
layers (uneven chunks) and p 4 (m 8, --stage-ms); ZB-V at pp 2 x dp 2 ragged (m 4 >= 2p-1) and p 4 (m 8 = 2p,
--stage-ms). The executed schedule (measured events) obeys the pipeline's rules (one F, B, W per chunk and
micro-batch, W after its B and before the next step, inputs received between their producer and their use)
and is exactly the schedule, which equals torch's ScheduleInterleavedZeroBubble (one stage per rank) and
ScheduleZBVZeroBubble orders; the ideal timelines have the paper's bubbles, (p-1)/(3m) and (p-1)/(6m); the
communication plans cannot deadlock under NCCL's semantics (simulated) and hand on the exact messages; under
--stage-ms the measured bubble is near theory, ZB-H1 idles under 0.6 of 1F1B's (p-1)(T_F+T_B+T_W) and ZB-V
less than ZB-H1; micro-batches alive p (ZB-H1) and 2p chunks (ZB-V), counted and recounted from the events;
bytes and messages sent = m (b, T, D) per neighbour and way; B then W is one backward bit for bit; the core
copied onto another model (the section alone, in the group [1, 0]) equals one-process training (W never run,
or on the wrong micro-batch: caught); each core refuses what it cannot do before any transfer; a
killed and restarted run continues to the same losses; bad input exits 2 with one line on every rank.
Launches: 6 torchrun (one restarts once, one also runs the copy-out check), 3 plain python, and 4 bad-input
cases of 2-4 plain python ranks each."""

import collections
import copy
import json
import sys
from types import SimpleNamespace

import pytest
import torch

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
import pipeline_checks  # noqa: E402
import zero_bubble as zb  # noqa: E402  (importing must not run main())
from common import GPTConfig, build_gpt, lm_loss  # noqa: E402

CFG = [*TINY, "--n-layers", "4", "--batch-size", "16", "--steps", "3"]
STAGE_MS = ["--n-layers", "8", "--microbatches", "8", "--stage-ms", "50"]
LAUNCHES = {  # name: (nproc, flags)
    "zbh1 p2": (2, []),  # through tests/pipeline_checks.py zb-copy-out: the copied core first
    "zbh1 p3 5 layers": (3, ["--n-layers", "5"]),
    "zbv pp2 dp2 ragged": (4, ["--pp", "2", "--dp", "2", "--schedule", "zbv", "--ragged"]),
    "zbh1 p4 stage-ms": (4, STAGE_MS),
    "zbv p4 stage-ms": (4, [*STAGE_MS, "--schedule", "zbv"]),
}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """torchrun zero_bubble.py once per configuration, with --check and --trace; tests share the runs."""
    runs = {}

    def get(name):
        if name not in runs:
            nproc, flags = LAUNCHES[name]
            tmp = tmp_path_factory.mktemp("zb")
            head = (
                ["tests/pipeline_checks.py", nproc, "zb-copy-out", tmp / "copy_out.json"]
                if name == "zbh1 p2"
                else ["zero_bubble.py", nproc]
            )
            summary, out = torchrun(
                *head,
                *CFG,
                *flags,
                "--check",
                "--trace",
                tmp / "trace.json",
                tmp_path=tmp,
                timeout=300,
            )
            copy_out = None
            if (tmp / "copy_out.json").exists():  # and each rank's bad inputs beside it
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


# ----------------------------------------------------------------------------- the rules, from measured events
def holder(c, p, schedule):
    """The pp rank that must hold chunk c: chunk c on rank c (zbh1), a V for zbv (0 .. p-1, then p-1 .. 0)."""
    return c if schedule == "zbh1" or c < p else 2 * p - 1 - c


def inflight(events):
    """Most (chunk, micro-batch) pairs between F's start and the end of their W at once, swept over events."""
    marks = sorted(
        [(e["start"], 1) for e in events if e["kind"] == "F"]
        + [(e["end"], -1) for e in events if e["kind"] == "W"]
    )
    now = peak = 0
    for _, step in marks:
        now += step
        peak = max(peak, now)
    return peak


def rule_errors(events, p, m, schedule):
    """Each pipeline (step, dp) of the measured events against the rules: one F, B and W per (chunk,
    micro-batch), chunk c on its pp rank; a micro-batch's F runs the chunks in order and B in reverse (each
    starts after the chunk before ended it); F before its B, W after its B; an input received from another rank
    arrived after its producer ended and before its op started (one from the same rank is no message); no two
    ops at once on a rank; at most p (zbh1) or 2p (zbv) in flight; every W of a step ends before the next
    step starts anywhere (the optimizer steps in between)."""
    n, errors = p * (2 if schedule == "zbv" else 1), []
    pipes = collections.defaultdict(dict)
    for e in events:
        pipes[e["step"], e["dp"]][e["kind"], e["chunk"], e["mb"]] = e
    for key, ev in pipes.items():
        if len(ev) != 3 * n * m or set(ev) != {
            (k, c, j) for k in "FBW" for c in range(n) for j in range(m)
        }:
            errors.append(f"{key}: not one F/B/W per chunk and micro-batch")
            continue
        for (kind, c, k), e in ev.items():
            if e["pp"] != holder(c, p, schedule):
                errors.append(f"{key}: chunk {c} ran on pp rank {e['pp']}")
            src = (
                ("F", c - 1, k)
                if kind == "F" and c > 0
                else ("B", c + 1, k)
                if kind == "B" and c < n - 1
                else None
            )
            if src and e["start"] < ev[src]["end"]:
                errors.append(f"{key}: {kind}{k} of chunk {c} starts before chunk {src[1]} ends it")
            if (
                src
                and ev[src]["pp"] != e["pp"]
                and not (e["recv"] is not None and ev[src]["end"] <= e["recv"] <= e["start"])
            ):
                errors.append(
                    f"{key}: {kind}{k} of chunk {c}: input not received between its producer and its use"
                )
            if kind == "B" and e["start"] < ev["F", c, k]["end"]:
                errors.append(f"{key}: B{k} of chunk {c} starts before its F ends")
            if kind == "W" and e["start"] < ev["B", c, k]["end"]:
                errors.append(f"{key}: W{k} of chunk {c} starts before its B ends")
        for r in range(p):
            mine = sorted((e for e in ev.values() if e["pp"] == r), key=lambda e: e["start"])
            errors += [
                f"{key} rank {r}: {b['kind']}{b['mb']} overlaps"
                for a, b in zip(mine, mine[1:])
                if b["start"] < a["end"]
            ]
            bound = min(p, m) if schedule == "zbh1" else 2 * p
            if inflight(mine) > bound:
                errors.append(f"{key} rank {r}: {inflight(mine)} in flight > {bound}")
    steps = sorted({e["step"] for e in events})
    for s, nxt in zip(steps, steps[1:]):
        if max(e["end"] for e in events if e["step"] == s) > min(
            e["start"] for e in events if e["step"] == nxt
        ):
            errors.append(f"step {s}: an op ends after step {nxt} started")
    return errors


def executed(events, step, r, dp=0):
    return [
        (e["kind"], e["chunk"], e["mb"])
        for e in sorted(events, key=lambda e: e["start"])
        if (e["step"], e["pp"], e["dp"]) == (step, r, dp)
    ]


# ----------------------------------------------------------------------------- schedule level (no processes)
def torch_zbh1_order(p, m, r):
    """torch's ScheduleInterleavedZeroBubble with one stage per rank (F, I = B, W), its own planner."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    rounds = max(1, m // p)
    me = SimpleNamespace(
        n_local_stages=1, pp_group_size=p, microbatches_per_round=m // rounds, _n_microbatches=m
    )
    names = {"F": "F", "I": "B", "W": "W"}
    return [
        (names[a.computation_type.value], r, a.microbatch_index)
        for a in ScheduleInterleavedZeroBubble._calculate_single_rank_operations(me, r)
        if a is not None
    ]


def torch_zbv_order(p, m, r):
    """torch's ScheduleZBVZeroBubble order for rank r (F, I = B, W), from its own per-rank planner."""
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    me = SimpleNamespace(pp_group_size=p, _n_microbatches=m, num_stages=2 * p)
    kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    return [
        (kind[a.computation_type.name], a.stage_index, a.microbatch_index)
        for a in ScheduleZBVZeroBubble._calculate_single_rank_operations(me, r)
        if a
    ]


TORCH = {"zbh1": torch_zbh1_order, "zbv": torch_zbv_order}


def eager(ops):
    """The negative: the same F and B with each W right after its own B (no W held back)."""
    return [op for o in ops if o[0] != "W" for op in [o] + ([("W", *o[1:])] if o[0] == "B" else [])]


def test_zbh1_is_torchs_zero_bubble_order():
    """Every m torch takes (2 <= p <= 6, m <= 12): ZB-H1 equals torch's order; it keeps 1F1B's F and B, every W
    after its B, at most min(p, m) alive (F to W) on every stage; the eager order is not torch's."""
    for p in range(2, 7):
        for m in range(1, 13):
            if m % max(1, m // p):
                continue  # torch refuses this m
            for r in range(p):
                ops = zb.zbh1(p, m, r)
                assert ops == torch_zbh1_order(p, m, r), (p, m, r)
                assert sorted(ops) == sorted((k, r, j) for k in "FBW" for j in range(m))
                assert all(
                    ops.index(("W", r, j)) > ops.index(("B", r, j)) > ops.index(("F", r, j))
                    for j in range(m)
                )
                alive = peak = 0
                for kind, _, _ in ops:
                    alive += {"F": 1, "B": 0, "W": -1}[kind]
                    peak = max(peak, alive)
                assert peak == min(p, m)
            if m > 1:
                assert any(eager(zb.zbh1(p, m, r)) != torch_zbh1_order(p, m, r) for r in range(p))


@pytest.mark.parametrize("p, m", [(2, 3), (2, 4), (3, 5), (3, 9), (4, 7), (4, 8), (5, 12)])
def test_zbv_is_torchs_order(p, m):
    for r in range(p):
        ops = zb.zbv(p, m, r)
        assert ops == torch_zbv_order(p, m, r)
        assert sorted(ops) == sorted(
            (k, c, j) for k in "FBW" for c in (r, 2 * p - 1 - r) for j in range(m)
        )
        alive = peak = 0
        for kind, _, _ in ops:
            alive += {"F": 1, "B": 0, "W": -1}[kind]
            peak = max(peak, alive)
        assert peak == 2 * p
    assert any(eager(zb.zbv(p, m, r)) != torch_zbv_order(p, m, r) for r in range(p))


def simulate_plan(plans, n, local):
    """zero_bubble.py's plans under NCCL's strictest semantics (helpers.simulate_p2p_plans), F, B and W one slot
    each: (idle slots per rank, forward messages sent per rank), or AssertionError on a deadlock or mismatch."""
    return simulate_p2p_plans(
        plans, lambda op: zb.needs(op, n), zb.producer, {"F": 1, "B": 1, "W": 1}, local
    )


def plans_of(schedule, p, m):
    order, n_chunks, _ = zb.SCHEDULES[schedule]
    n, orders = n_chunks(p), [order(p, m, r) for r in range(p)]
    local = (
        (lambda msg: msg[:2] in (("F", p), ("B", p - 1)))
        if schedule == "zbv"
        else (lambda msg: False)
    )
    return [zb.comm_plan(orders, n, r) for r in range(p)], n, local, orders


@pytest.mark.parametrize(
    "schedule, p, m",
    [("zbh1", p, m) for p in (2, 3, 4) for m in (p, p + 1, 2 * p + 1)]
    + [("zbv", p, m) for p in (2, 3, 4) for m in (2 * p - 1, 2 * p, 3 * p + 1)]
    + [("zbh1", 8, 16), ("zbv", 8, 16)],
)
def test_ideal_bubble_messages_and_no_deadlock(schedule, p, m):
    """F, B, W one slot each. ZB-H1: every rank idles p-1 slots of its 3m, (p-1)(T_F+T_B-T_W) (the paper's
    Table 2; 1F1B: 3(p-1)), bubble (p-1)/(3m), m messages to each neighbour and way. ZB-V: p-1 slots of its 6m,
    (p-1)/(6m), m(2 - [r = 0] - [r = p-1]) each way: 2(p-1)m per pipeline. The plans, run under rendezvous
    semantics, never deadlock and never wait beyond the ideal timeline; theory() says the same."""
    plans, n, local, orders = plans_of(schedule, p, m)
    at = zb.ideal_timeline(orders, n)
    end = max(e for _, _, e in at.values())
    idle = [end - sum(e - s for q, s, e in at.values() if q == r) for r in range(p)]
    slots = 3 * m * n // p
    assert idle == [p - 1] * p and zb.theory(p, m, schedule)[0] == pytest.approx((p - 1) / slots)
    idle_sim, fwd = simulate_plan(plans, n, local)
    assert idle_sim == idle  # messages never delay an op
    want = (
        [m * (r < p - 1) for r in range(p)]
        if schedule == "zbh1"
        else [m * (2 - (r == 0) - (r == p - 1)) for r in range(p)]
    )
    assert fwd == want == zb.theory(p, m, schedule)[2] and sum(fwd) == (p - 1) * m * n // p


def test_simulator_catches_a_deadlock():
    """The negatives: a V whose turn is sent as a message instead of handed on within the rank never gets its
    input; a rank that posts its batches in reverse order deadlocks (or mismatches its channel)."""
    plans, n, _, _ = plans_of("zbv", 2, 4)
    with pytest.raises(AssertionError, match="before its input arrived"):
        simulate_plan(plans, n, lambda msg: False)
    plans, n, local, _ = plans_of("zbh1", 3, 6)
    batches = [i for i, s in enumerate(plans[1]) if s[0] == "p2p"]
    swapped = list(plans[1])
    swapped[batches[0]], swapped[batches[-1]] = swapped[batches[-1]], swapped[batches[0]]
    with pytest.raises(AssertionError):
        simulate_plan([plans[0], swapped, plans[2]], n, local)


# ----------------------------------------------------------------------------- the B/W split, in one process
def gradients(model):
    return {n: None if q.grad is None else q.grad.clone() for n, q in model.named_parameters()}


def test_split_backward_is_one_backward_bit_for_bit():
    """B then W gives the gradients of one autograd backward, bit for bit in float64, summed over two
    micro-batches, on a GPT (Linears with and without bias, LayerNorm, embeddings) and on the copy-out's
    ZBNet (root parameters, one 0-dim; 2-D inputs); after B alone only the Linears lack theirs; the input's gradient
    is B's. The negatives: a W never run, or run on the wrong micro-batch, gives other gradients."""
    gpt = build_gpt(
        GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), 0, torch.float64
    )
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, 32, (3, 8), generator=g) for _ in range(2)]
    xs = [torch.randn(3, 5, dtype=torch.float64, generator=g) for _ in range(2)]
    cases = [
        (gpt, [(x, lambda out, x=x: lm_loss(out, x, 48)) for x in tokens]),
        (pipeline_checks.ZBNet(), [(x, lambda out: (out**2).sum()) for x in xs]),
    ]
    for model, mbs in cases:
        plain = copy.deepcopy(model)
        for x, loss in mbs:
            loss(plain(x)).backward()
        ref = gradients(plain)
        for variant in ("right", "never", "wrong"):
            split_model = copy.deepcopy(model)
            split = zb.SplitBackward(split_model)
            saved = [split.backward_input(loss(split_model(x))) for x, loss in mbs]  # B, B
            linears = [lin for lin in split_model.modules() if isinstance(lin, torch.nn.Linear)]
            deferred = {
                n
                for n, q in split_model.named_parameters()
                if any(q is lin.weight or q is lin.bias for lin in linears)
            }
            after_b = gradients(split_model)
            # B left the Linears' to W
            assert deferred and all(after_b[n] is None for n in deferred)
            assert all(torch.equal(after_b[n], ref[n]) for n in ref if n not in deferred)
            for w in {"right": saved, "never": saved[:1], "wrong": [saved[0], saved[0]]}[variant]:
                # W, W (or one W never run, or on the wrong one)
                zb.SplitBackward.backward_weight(w)
            got = gradients(split_model)
            same = all(got[n] is not None and torch.equal(got[n], ref[n]) for n in ref)
            assert same == (variant == "right"), (type(model).__name__, variant)
    # the input's gradient, through a chunk that receives one
    block = pipeline_checks.ZBResidual().double()
    h = torch.randn(3, 6, dtype=torch.float64, generator=g)
    a, b = h.clone().requires_grad_(), h.clone().requires_grad_()
    split_block = copy.deepcopy(block)
    block(a).pow(2).sum().backward()
    saved = zb.SplitBackward(split_block).backward_input(split_block(b).pow(2).sum())
    assert torch.equal(a.grad, b.grad) and len(saved) == 2  # two Linears deferred


# ----------------------------------------------------------------------------- parity and the measured schedule
@pytest.mark.parametrize("name", list(LAUNCHES))
def test_matches_reference_and_runs_the_schedule(launch, name):
    summary, out, trace, _ = launch(name)
    assert_matches_reference(summary)
    f, cfg = summary["figures"], summary["config"]
    p, dp, m, steps, schedule = f["pp"], f["dp"], f["microbatches"], cfg["steps"], f["schedule"]
    n = p * (2 if schedule == "zbv" else 1)
    assert summary["world_size"] == p * dp == LAUNCHES[name][0]
    assert f["split"] == [list(b) for b in zb.split_layers(cfg["n_layers"], n)]
    events = f["events"]
    assert rule_errors(events, p, m, schedule) == []
    for s in range(steps):
        for r in range(p):
            for j in range(dp):
                # exactly torch's order
                assert executed(events, s, r, j) == TORCH[schedule](p, m, r)
    alive = [
        inflight([e for e in events if e["step"] == steps - 1 and e["pp"] == r and e["dp"] == 0])
        for r in range(p)
    ]
    assert (
        f["peak_alive_microbatches"]
        == f["peak_alive_theory"]
        == alive
        == [min(p, m) if schedule == "zbh1" else 2 * p] * p
    )
    # one (b, T, D) float64 message
    b_bytes = cfg["batch_size"] // (dp * m) * cfg["seq_len"] * cfg["d_model"] * 8
    msgs = [
        (m * (r < p - 1), m * (r > 0))
        if schedule == "zbh1"
        else (m * (2 - (r == 0) - (r == p - 1)),) * 2
        for r in range(p)
    ]
    assert [(f["fwd_msgs_per_rank"][r], f["bwd_msgs_per_rank"][r]) for r in range(p)] == msgs
    assert (
        f["sent_bytes_per_rank"] == [(a + b) * b_bytes for a, b in msgs] == f["sent_bytes_theory"]
    )
    assert summary["comm_bytes"] == max(f["sent_bytes_per_rank"])
    for key, row in f["counts_per_rank"].items():  # every pipeline, not only dp 0's
        assert row["sent_bytes"] == f["sent_bytes_per_rank"][int(key[2])], key
    state = sum(
        q.numel() for q in build_gpt(GPTConfig.from_args(SimpleNamespace(**cfg)), 0).parameters()
    )
    assert sum(f["mem_bytes_per_rank"]) > 3 * 8 * state  # params, 2 AdamW moments, and activations
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(events) == 3 * n * m * steps * dp and f"wrote {len(xs)} events" in out
    assert {e["cat"] for e in xs if e["name"].startswith("W")} == {"backward (weights)"}
    assert "timeline of the last step, measured" in out and f"rank {p - 1} |" in out


def test_rule_checks_catch_broken_schedules(launch):
    events = launch("zbv pp2 dp2 ragged")[0]["figures"]["events"]
    assert rule_errors(events, 2, 4, "zbv") == []
    one = [e for e in events if e["step"] == 0 and e["dp"] == 0]
    # noqa
    pick = lambda kind, c, k: next(
        e for e in one if (e["kind"], e["chunk"], e["mb"]) == (kind, c, k)
    )
    w = pick("W", 3, 2)
    before = [dict(e, start=pick("B", 3, 2)["start"] - 1e-3) if e is w else e for e in one]
    assert any(
        "W2 of chunk 3 starts before its B ends" in x for x in rule_errors(before, 2, 4, "zbv")
    )
    assert rule_errors([e for e in one if e is not w], 2, 4, "zbv")
    late_recv = [dict(e, recv=e["start"] + 1) if e is pick("B", 2, 1) else e for e in one]
    assert any("input not received" in x for x in rule_errors(late_recv, 2, 4, "zbv"))
    step1 = min(e["start"] for e in events if e["step"] == 1)
    late = [dict(e, end=step1 + 1) if e is w else e for e in events]
    assert any("ends after step 1 started" in x for x in rule_errors(late, 2, 4, "zbv"))
    h1 = [e for e in launch("zbh1 p2")[0]["figures"]["events"] if e["step"] == 0]
    # wrong holder, wrong counts
    assert rule_errors(h1, 2, 4, "zbh1") == [] and rule_errors(h1, 2, 4, "zbv")


def test_copy_out_core_on_another_model(launch):
    """SplitBackward, comm_plan, PipelineRank and finish_batch as a reader copies them (zero_bubble.py's
    technique section alone, tests/section.py), on a model that is not the GPT (tests/pipeline_checks.py
    zb-copy-out: nested modules, root parameters, one 0-dim, 2-D inputs, squared error, clipping by the whole
    model's norm, SGD) over 2 ranks in the group [1, 0] (pp rank 0 on global rank 1), both schedules: the first
    step's clipped gradients and the final parameters equal one-process training's (torch's clip_grad_norm_,
    which clips every step: the norm is above the threshold) within 1e-12; with W never run, or W on the
    previous micro-batch, the comparison fails. Issue 30, defect 4: the 0-dim parameter in the clip path."""
    got = launch("zbh1 p2")[3]
    assert min(got["reference_norms"]) > pipeline_checks.ZB["clip"], got["reference_norms"]
    for case in ("zbh1", "zbv"):
        assert got[case]["max_diff"] < 1e-12 and got[case]["max_loss_diff"] < 1e-12, got[case]
        assert got[case]["losses"] == pytest.approx(got["reference_losses"], rel=1e-12)
    assert got["zbh1, W never run"]["max_diff"] > 1e-3
    assert got["zbv, W on the previous micro-batch"]["max_diff"] > 1e-3


BAD = {  # what a core of the section is given -> words its ValueError must say
    "split_layers, 5 chunks of 4 blocks": ["5 chunks of 4 blocks", "use 1 to 4 chunks"],
    "zbv, m 2 at p 2": ["zbv at p = 2 needs m >= 2p-1 = 3 micro-batches, got 2"],
    "ideal_timeline, ranks' orders of two schedules": ["waits on itself"],
    "PipelineRank, a plan for p 3 in a group of 2": [
        "peers [0, 2] are not in the group",
        "p = its size",
    ],
    "PipelineRank, a rank outside the group": ["are not in the group"],
    "PipelineRank.run, 3 micro-batches for a plan of 4": ["m = 4 micro-batches", "got 3 inputs"],
    "PipelineRank.run, unequal micro-batches": ["of one shape", "(2, 5), (3, 5)"],
}


def test_cores_refuse_what_they_cannot_do(launch):
    """Issue 30, deliver 2: each core of the section, given what it cannot do, raises a ValueError saying what is
    wrong and what would work, before any collective or transfer (a harness.CommCounter saw none). Rank 1, outside
    the group [0], meets the outsider's case; the PipelineRank cases are on the copy-out's own pipeline group."""
    bad = launch("zbh1 p2")[3]["bad"]
    for rank, cases in enumerate(bad):
        # a valid call: the same counter sees its two all-reduces
        control = cases.pop("control: finish_batch")
        assert control[0] == "no error" and sum(control[1].values()) == 2, (rank, control)
        assert sorted(cases) == sorted(w for w in BAD if rank == 1 or "outside" not in w), (
            rank,
            sorted(cases),
        )
        for what, (error, calls) in cases.items():
            assert error.startswith("ValueError") and all(w in error for w in BAD[what]), (
                rank,
                what,
                error,
            )
            assert calls == {}, (rank, what, calls)


def test_stage_ms_bubbles(launch):
    """p 4, m 8, --stage-ms 50: every F, B, W of a chunk waits 50 ms. Asserted is what load cannot move (issue
    43: on a few shared cores a stalled process only adds idle time, so wall-time bubbles are reported, beside
    their theory, not asserted): every op lasted at least its simulated time; the printed ZB-H1 theory is
    (p-1)(T_F+T_B-T_W) at the measured op times; and the order each rank ran its ops in, in the last step,
    replayed with one slot per op and free messages (zb.ideal_timeline), idles p-1 slots of its 3m (ZB-H1: a
    third of 1F1B's 3(p-1)) or of its 6m (ZB-V): the bubbles (p-1)/(3m) = 1/8 and (p-1)/(6m) = 1/16 of the
    theory, ZB-V's below ZB-H1's."""
    h1, v = (launch(name)[0]["figures"] for name in ("zbh1 p4 stage-ms", "zbv p4 stage-ms"))
    for f in (h1, v):
        assert f["stage_ms"] == 50 and min(f["op_ms"].values()) >= 50 and f["bubble_mean"] > 0
        assert all(e["end"] - e["start"] >= 50 for e in f["events"])
    assert h1["bubble_theory"] == pytest.approx(3 / 24) and v["bubble_theory"] == pytest.approx(
        3 / 48
    )
    ops = h1["op_ms"]
    assert h1["idle_ms_theory"] == pytest.approx(3 * (ops["F"] + ops["B"] - ops["W"]))

    # per rank: (idle slots, busy slots) of the last step's recorded order, replayed
    def replayed(f, n):
        last = max(e["step"] for e in f["events"])
        at = zb.ideal_timeline([executed(f["events"], last, r) for r in range(4)], n)
        end = max(e for _, _, e in at.values())
        busy = [sum(e - s for q, s, e in at.values() if q == r) for r in range(4)]
        return [end - b for b in busy], busy

    assert replayed(h1, 4) == ([3] * 4, [24] * 4)  # 1F1B at one slot per F, B, W: 3(p-1) = 9 idle
    assert replayed(v, 8) == ([3] * 4, [48] * 4)
    assert [i / b for i, b in zip(*replayed(h1, 4))] == [h1["bubble_theory"]] * 4
    assert [i / b for i, b in zip(*replayed(v, 8))] == [v["bubble_theory"]] * 4


def test_replayed_order_catches_a_wasteful_one():
    """The negative for the replay above: ZB-H1's stage 0 with its W's all moved to the end of the step (1F1B
    with a separate W: nothing fills the drain) idles more than p-1 slots."""
    p, m = 4, 8
    orders = [zb.zbh1(p, m, r) for r in range(p)]
    lazy = [
        [o for o in order if o[0] != "W"] + [o for o in order if o[0] == "W"] for order in orders
    ]
    at = zb.ideal_timeline(lazy, p)
    end = max(e for _, _, e in at.values())
    assert end - 3 * m > p - 1
    ideal = zb.ideal_timeline(orders, p)
    assert max(e for _, _, e in ideal.values()) - 3 * m == p - 1  # the control


# ----------------------------------------------------------------------------- restarts, bad input
def test_restart_continues_exactly(launch, tmp_path):
    """Killed at step 2 (after the checkpoint of step 2), restarted by torchrun: the same losses, bit for bit,
    as the uninterrupted run of the same layout."""
    summary, out = torchrun(
        "zero_bubble.py",
        2,
        *CFG,
        "--ckpt-dir",
        tmp_path / "ck",
        "--save-every",
        "2",
        "--fail-at-step",
        "2",
        tmp_path=tmp_path,
        max_restarts=1,
        timeout=300,
    )
    assert "simulated failure at step 2" in out and "resumed from" in out
    assert summary["losses"] == launch("zbh1 p2")[0]["losses"]


@pytest.mark.parametrize(
    "nproc, flags, words",
    [
        (
            2,
            ["--schedule", "zbv", "--microbatches", "2", "--n-layers", "4"],
            [
                "--schedule zbv, --pp 2, --microbatches 2: ",
                "zbv at p = 2 needs m >= 2p-1 = 3 micro-batches, got 2",
            ],
        ),
        (
            4,
            ["--schedule", "zbv", "--n-layers", "4"],
            [
                "--n-layers 4, --schedule zbv, --pp 4",
                "8 chunks of 4 blocks: use 1 to 4 chunks, or 8 blocks or more",
            ],
        ),
        (4, ["--pp", "3"], ["world size 4 != pp 3 x dp 1", "--nproc_per_node=3"]),
        (
            4,
            ["--microbatches", "4", "--dp", "2"],
            ["--batch-size 12 is not divisible by dp x microbatches = 8"],
        ),
    ],
)
def test_bad_input_exits_2_on_every_rank(nproc, flags, words):
    assert_each_rank_fails(run_ranks("zero_bubble.py", nproc, *TINY, *flags), words)


def test_world_of_one_and_help():
    p = run_python("zero_bubble.py", *TINY)
    assert p.returncode == 2 and "at least 2" in p.stderr and "--nproc_per_node=2" in p.stderr, (
        p.stderr
    )
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    bad = run_python("zero_bubble.py", *TINY, "--schedule", "1f1b")
    assert bad.returncode == 2 and "invalid choice: '1f1b'" in bad.stderr, bad.stderr
    help_text = run_python("zero_bubble.py", "--help").stdout
    assert "zbh1" in help_text and "zbv" in help_text and "simulate compute" in help_text


def test_no_object_collectives():
    """Only tensors cross the wire: no pickling collective (broadcast_object_list, gather_object, ...)."""
    import re

    assert not re.search(r"_object(_list)?\(", (ROOT / "zero_bubble.py").read_text())
