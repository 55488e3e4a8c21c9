"""bench.py: torch's side of every pair trains exactly what the one-process reference trains,
harness.CommCounter counts what closed forms say (and a counter blind to all-reduces fails that check), the
stage hooks see every F, B and W the schedules run; the interval and the verdict hold against closed forms and
synthetic timings, the alternation keeps the interval's level and shares the budget between groups (a verdict
that ignores the interval, a normal quantile for Student's, a spread re-estimated every round, a loop that
stops before its interval narrows are caught); one pair end to end writes well-formed rows with a verdict, a
pair whose file lacks the mode it needs is skipped with one line, bad input exits 2, and a launch past its
timeout leaves no worker running. No real timing is asserted."""

import dataclasses
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import types

import pytest

from helpers import ROOT, forked, run_python

sys.path.insert(0, str(ROOT))
import bench  # noqa: E402

TINY = [
    "--vocab",
    "32",
    "--seq-len",
    "8",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-layers",
    "4",
    "--batch-size",
    "8",
]

# Run under torchrun at world 2: every torch-side worker of bench.py, in float64, against common's one-process
# trainer; the byte counter and the timeline against closed forms; and breakages that the checks must catch.
CHECKS = r'''
import contextlib, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import bench, harness
from common import init_dist, reference_train, GPT, GPTConfig

d = init_dist(120)
args = bench.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=4, batch_size=8, steps=3,
                  dtype="float64", microbatches=4, bucket_cap_mb=0.01)
ref = reference_train(args)["losses"] if d.rank == 0 else None
bad = []

def run(name, steps=3, counted_step=1):
    """bench's worker loop: the side's train(i) between zero_grad and the optimizer step; CommCounter around
    one step after the first (lazy initialisation done). Returns (losses, counter, train)."""
    comm = harness.CommCounter()
    params, opt, train = bench.WORKERS[name][0](d, args, name, comm)
    losses = []
    for i in range(steps):
        with comm if i == counted_step else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            losses.append(train(i)[0])
            opt.step()
    return losses, comm, train

def compare(name, losses, expect_equal=True, against=None):
    """against: rank 0's reference losses (default: one-process training, `ref`)"""
    t = torch.zeros(1, dtype=torch.float64, device=d.device)
    if d.rank == 0:
        t[0] = max(abs(a - b) / abs(b) for a, b in zip(losses, against or ref))
        print(f"{name}: max rel loss diff vs one-process reference {t.item():.2e}", flush=True)
    dist.broadcast(t, 0)
    if (t.item() <= 1e-9) != expect_equal:
        bad.append(name)

m, p, comms = args.microbatches, d.world, {}
# float8 differs by design (below); tp_overlap's fused ops run on CUDA only (test_tp_overlap_skipped_on_cpu)
for name in [w for w in bench.WORKERS if w not in ("single", "float8", "tp_overlap")]:
    losses, comms[name], train = run(name)
    compare(name, losses)
    if name in bench.SCHEDULES:  # every F, B and W each rank's stages ran in the last step, seen from outside
        ops, v = train.figures()["ops"], 1 + (bench.SCHEDULES[name][1] != "one")
        w = p * v * m if "Bubble" in bench.SCHEDULES[name][0] else 0  # zero-bubble: B and W are split
        if name == "dualpipev":  # W apart where dualpipev.py's generator defers it: its [W] slots (5 here)
            import dualpipev
            orders = [dualpipev.dualpipev(p, m, r) for r in range(p)]
            w = sum(len(slot) == 1 and slot[0][0] == "W" for order in orders for slot in order)
        d.log(f"{name}: ops seen {ops}, expected F = B = {p * v * m}, W = {w}")
        if ops != dict(F=p * v * m, B=p * v * m, W=w):
            bad.append(f"ops {name}")

# tp_overlap's torch side on CPU, where bench skips it: its autograd around torch's fused ops, the ops replaced
# by torch's own reference implementations of them (symm_mem's fallbacks: all-gather then matmul, matmul then
# reduce-scatter), to hold the wrapper's math; the CUDA kernels themselves need a GPU
import types
import torch.distributed._symmetric_memory as sm
real_ops = torch.ops.symm_mem
torch.ops.symm_mem = types.SimpleNamespace(
    fused_all_gather_matmul=sm._fused_all_gather_matmul_fallback,
    fused_matmul_reduce_scatter=sm._fused_matmul_reduce_scatter_fallback,
)
compare("tp_overlap torch side on symm_mem's fallbacks", run("tp_overlap")[0])
torch.ops.symm_mem = real_ops

# our side of every paired pair, built by bench.py from the file's core (as the paired launch runs it)
def run_ours(name, steps=3):
    step = bench.OURS[name](d, args, name)
    return [step(i) for i in range(steps)]

# fp8 against fp8.py's own one-process reference for --check (written apart from its core: its own
# quantizer, each GEMM a float32 matmul of the FP8 values), at the recipe the pair runs
import dataclasses, fp8
shared = {f.name: getattr(args, f.name) for f in dataclasses.fields(harness.CommonArgs)}
fp8_args = fp8.Args(**shared, recipe="current", fp8_all_gather=True)
fp8_ref = fp8.reference(fp8_args, d.world, d.device)["losses"] if d.rank == 0 else None
for name in bench.OURS:
    compare(f"ours {name}", run_ours(name), against=fp8_ref if name == "fp8" else None)
orig_amax = fp8.global_amax  # each rank scales by its own amax (torchao's way): fp8.py's must differ
fp8.global_amax = lambda t, group: orig_amax(t, None)
compare("ours fp8 with a rank's own amax (must differ)", run_ours("fp8", steps=2), expect_equal=False,
        against=fp8_ref)
fp8.global_amax = orig_amax
import zero_bubble  # a ZB-H1 whose W adds nothing (the Linear weights never learn): ours must differ too

def no_w(saved):
    for layer, x, dy in saved:
        for q in (layer.weight, layer.bias):
            if q is not None and q.grad is None:
                q.grad = torch.zeros_like(q)

orig_bw = zero_bubble.SplitBackward.backward_weight
zero_bubble.SplitBackward.backward_weight = staticmethod(no_w)
compare("ours zb with W adding nothing (must differ)", run_ours("zb", steps=2), expect_equal=False)
zero_bubble.SplitBackward.backward_weight = orig_bw
import zero  # HSDP without its all-reduce across the replicas: each copy trains on its half of the batch
orig_init = zero.Zero.__init__

def no_replicas(self, *a, **k):
    orig_init(self, *a, **k)
    self.replicate_group = None

zero.Zero.__init__ = no_replicas
compare("ours hsdp without the all-reduce across replicas (must differ)", run_ours("hsdp", steps=2),
        expect_equal=False)
zero.Zero.__init__ = orig_init

# break it on purpose: torch's default scale_grads=True divides every gradient by m once more
import torch.distributed.pipelining as pl
orig = pl.ScheduleGPipe.__init__
pl.ScheduleGPipe.__init__ = lambda self, *a, **k: orig(self, *a, **dict(k, scale_grads=True))
compare("gpipe with scale_grads=True (must differ)", run("gpipe")[0], expect_equal=False)
pl.ScheduleGPipe.__init__ = orig
# a zero-bubble schedule whose weight gradients (W) never run: the check must see the split is real
orig_w = pl.PipelineStage.backward_weight_one_chunk
pl.PipelineStage.backward_weight_one_chunk = lambda self, *a, **k: None
compare("zbv with W never run (must differ)", run("zbv", steps=2)[0], expect_equal=False)
pl.PipelineStage.backward_weight_one_chunk = orig_w

# CommCounter: DDP hands every gradient to all-reduce once per step (payload = parameter bytes); a pipeline
# stage sends m activations (forward) or their gradients (backward) of (b, T, D) float64 per step; a counter
# whose op table misses the all-reduces counts nothing for DDP and fails the closed form.
param_bytes = sum(p.numel() for p in GPT(GPTConfig(32, 8, 16, 2, 4)).parameters()) * 8
real, harness._OPS = harness._OPS, {k: v for k, v in harness._OPS.items() if v != "all_reduce"}
blind = run("ddp", steps=2)[1]
harness._OPS = real
for comm, must_pass in ((comms["ddp"], True), (blind, False)):
    got = comm.total(op="all_reduce")
    d.log(f"DDP all-reduce payload counted {got} B, expected {param_bytes} B (a counter "
          f"{'blind to' if comm is blind else 'that knows'} all-reduce)")
    if (got == param_bytes) != must_pass:
        bad.append(f"count ddp (must pass: {must_pass})")
sends = comms["gpipe"].total(op="send")
expect = m * (args.batch_size // m) * args.seq_len * args.d_model * 8
print(f"gpipe rank {d.rank} sent {sends} B, expected {expect}", flush=True)
if sends != expect:
    bad.append(f"count gpipe rank {d.rank}")
print("FAILED: " + ", ".join(bad) if bad else "ALL CHECKS PASSED", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if bad else 0)
'''


def test_torch_sides_match_reference_and_counts(tmp_path):
    """Every torch side (zero-bubble ZB1P, ZB-V and DualPipeV, and HSDP on a (2, 1) mesh, included; not
    torchao's FP8, held to fp8.py by test_fp8_pair_against_torchao where torchao is installed, nor the
    CUDA-only fused TP ops, whose autograd wrapper is held there on torch's CPU fallbacks of the ops),
    and our side of every paired pair as bench.py builds it from the file's core
    (hsdp: zero.Zero on a 2 x 1 grid; dualpipev; tp_overlap: megatron_tp.RingGPT), reproduces one-process
    training in float64 (1e-9), and fp8 (fp8.to_fp8 + train_step, FP8 all-gather) the one-process training
    fp8.py defines, its --check reference; ScheduleGPipe's default scale_grads=True, a ZB-V whose W never
    runs (torch's) or adds nothing (ours, ZB-H1), an HSDP without its all-reduce across replicas, an fp8
    whose ranks scale by their own amax would not, and the check sees it; CommCounter equals the closed
    forms, and misses DDP's bytes with all-reduce dropped from its op table; the stage hooks see m F, m B
    (and m W when split; DualPipeV: the W its [W] slots defer, as dualpipev.py generates them) per stage."""
    script = tmp_path / "bench_checks.py"
    script.write_text(CHECKS)
    rc, out = forked(script, 2, str(ROOT), timeout=300)
    assert rc == 0 and "ALL CHECKS PASSED" in out, out[-6000:]
    assert out.count("must differ): max rel loss diff") == 5, out[-6000:]
    assert all(f"ours {name}: max rel loss diff" in out for name in bench.OURS), out[-6000:]
    assert "tp_overlap torch side on symm_mem's fallbacks: max rel loss diff" in out, out[-6000:]
    assert "(a counter blind to all-reduce)" in out, out[-6000:]


# ----------------------------------------------------------------------------- the interval and the verdict
def rounds(ratio, noise, n, rng, drift=0.5):
    """n synthetic rounds of median step ms (ours, torch): a base time scaled by a load factor the round's two
    runs share (up to e^+-drift: a busy machine), each run with its own log-normal noise; ours = ratio x."""
    out = []
    for _ in range(n):
        load = 100 * math.exp(rng.uniform(-drift, drift))
        out.append(
            (ratio * load * math.exp(rng.gauss(0, noise)), load * math.exp(rng.gauss(0, noise)))
        )
    return out


def judged(pairs, precision=0.05):
    return bench.judge([a / b for a, b in pairs], precision)


def test_interval_against_closed_forms():
    """Student's quantile against its closed forms at 1 and 2 degrees of freedom and the normal's at many; the
    interval at 2 and 3 rounds against exp(mean log +- t s / sqrt n) computed here from those closed forms."""
    p = 0.975
    t1, t2 = (
        math.tan(math.pi * (p - 0.5)),
        (2 * p - 1) / math.sqrt(2 * p * (1 - p)),
    )  # 12.706, 4.303
    assert abs(bench.t_quantile(p, 1) - t1) < 1e-9 and abs(bench.t_quantile(p, 2) - t2) < 1e-9
    assert abs(bench.t_quantile(p, 10**5) - statistics.NormalDist().inv_cdf(p)) < 1e-3
    a, b = 0.8, 1.1  # two rounds: mean of logs +- t1 x |log a - log b| / 2
    m, half = (math.log(a) + math.log(b)) / 2, t1 * abs(math.log(a / b)) / 2
    got = bench.ratio_interval([a, b])
    want = math.exp(m), math.exp(m - half), math.exp(m + half)
    assert all(abs(x / y - 1) < 1e-9 for x, y in zip(got, want))
    logs = [math.log(r) for r in (0.9, 1.0, 1.2)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    lo, hi = math.exp(m - t2 * sd / math.sqrt(3)), math.exp(m + t2 * sd / math.sqrt(3))
    got = bench.ratio_interval([0.9, 1.0, 1.2])
    assert (
        abs(got[1] / lo - 1) < 1e-9
        and abs(got[2] / hi - 1) < 1e-9
        and bench.ratio_interval([1.3]) is None
    )


def test_coverage_over_synthetic_benches(monkeypatch):
    """4000 synthetic 3-round benches of a true ratio 0.9: the 95% interval holds 0.9 in 93.5-96.5% of them
    (binomial sd 0.34%); with the normal's 1.96 in place of Student's 4.30 it would hold it in ~82%, and the
    extreme rounds (all a percentile bootstrap can reach) hold it in 75% = 1 - 2 x 2^-3, as bench.py says."""
    rng, n = random.Random(1), 4000
    benches = [[a / b for a, b in rounds(0.9, 0.1, 3, rng)] for _ in range(n)]

    def coverage():
        return sum(iv[1] <= 0.9 <= iv[2] for iv in map(bench.ratio_interval, benches)) / n

    assert 0.935 <= coverage() <= 0.965
    assert 0.73 <= sum(min(r) <= 0.9 <= max(r) for r in benches) / n <= 0.77
    monkeypatch.setattr(bench, "t_quantile", lambda p, df: statistics.NormalDist().inv_cdf(p))
    assert coverage() < 0.88  # the mutant: a normal quantile on 3 rounds


def claims_on_equal_sides(benches=1500, noise=0.07):
    """bench_group's rule on equal sides (per-round log-normal noise): from 3 rounds, on while the interval is
    wider than +-5%, at most 30 rounds; the share of benches that end calling a difference."""
    rng, claims = random.Random(4), 0
    for _ in range(benches):
        ratios, n = [math.exp(rng.gauss(0, noise)) for _ in range(30)], 3
        while n < 30 and bench.judge(ratios[:n], 0.05, 3)["noisy"]:
            n += 1
        claims += bench.judge(ratios[:n], 0.05, 3)["verdict"] != "no difference measurable"
    return claims / benches


def test_alternation_keeps_the_level(monkeypatch):
    """Rounds added while the interval is wide keep its 95%: with the spread of the first 3 rounds (Stein's
    two-stage interval) equal sides at 7% noise are called different in at most 6.7% of 1500 benches (5% + 3
    binomial sd of 0.56%); a spread re-estimated every round stops when it happens to be low, and claims more
    (the mutant: 8.7% here)."""
    assert claims_on_equal_sides() <= 0.067
    real = bench.ratio_interval
    monkeypatch.setattr(bench, "ratio_interval", lambda ratios, first=None: real(ratios))
    assert claims_on_equal_sides() > 0.067


def verdict_errors():
    """What a verdict must say on synthetic timings (a list of the expectations it broke)."""
    rng, bad = random.Random(2), []
    same = [
        (100.0 * (1 + i / 7), 100.0 * (1 + i / 7)) for i in range(3)
    ]  # identical streams, drifting
    j = judged(same)
    if (j["verdict"], j["interval"], j["noisy"]) != ("no difference measurable", [1.0, 1.0], False):
        bad.append(f"identical streams: {j}")
    for ratio, word in (
        (2.0, "slower"),
        (0.5, "faster"),
    ):  # 2x apart, 2% noise, a load swinging 1.6x
        j = judged(rounds(ratio, 0.02, 3, rng))
        if j["verdict"] != word or not j["interval"][0] <= ratio <= j["interval"][1]:
            bad.append(f"{ratio}x: {j}")
        if not bench.say(j).startswith(f"{word}: {j['ratio']:.2f} ["):
            bad.append(f"{ratio}x said {bench.say(j)!r}")
    # no difference, 10% noise per run: a difference claimed in about 5% of 3-round benches
    claims = 0
    for _ in range(400):
        j = judged(rounds(1.0, 0.1, 3, rng))
        claims += j["verdict"] != "no difference measurable"
        said = bench.say(j)
        if (
            j["verdict"][0] == "n"
            and f"{j['ratio']:.2f} [" in said
            or j["noisy"] != ("noisy" in said)
        ):
            bad.append(f"a ratio beside no difference, or noise unsaid: {said!r}")
    if not claims <= 400 * 0.09:  # binomial(400, 0.05): mean 20, sd 4.4
        bad.append(f"{claims} of 400 equal pairs called faster or slower")
    return bad


def test_verdicts_on_synthetic_timings(monkeypatch):
    """Identical streams: no difference measurable, a zero-width interval; 2x apart with small noise under a
    drifting load: slower / faster with the ratio inside; equal sides under 10% noise: a difference claimed in
    at most 9% of 400 benches (5% expected), no ratio printed beside "no difference", "noisy" said where the
    interval is over +-5%. A verdict from the ratio alone, ignoring the interval, is caught."""
    assert verdict_errors() == []
    point = lambda iv: (
        "faster" if iv[0] < 1 else "slower" if iv[0] > 1 else "no difference measurable"
    )
    monkeypatch.setattr(bench, "verdict", point)  # the ratio alone
    assert any("equal pairs called" in e for e in verdict_errors())


def alternate(monkeypatch, ratio, noise, share_s=600.0, seed=3):
    """bench_group on one pair (gpipe) with synthetic launches, each 10 s on a fake clock: (rounds run,
    the row)."""
    clock, rng, args = (
        [0.0],
        random.Random(seed),
        bench.Args(rounds=3, precision=0.05, steps=4, warmup=2),
    )
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(time=lambda: clock[0]))

    def launch(args, pair, tag, worker=None):
        clock[0] += 10.0
        base = 100 * math.exp(rng.gauss(0, noise)) * (1 if worker else ratio)
        return dict(rc=0, summary=None, ms=[base] * args.steps, cmd=tag, load=1.0)

    monkeypatch.setattr(bench, "launch", launch)
    row = bench.bench_group(args, ["gpipe"], None, share_s)[0]
    return row["rounds"], row


def test_alternation_stops_when_narrow_or_spent(monkeypatch):
    """At least --rounds 3, then on while the interval is wider than +-5% and one more 20 s round ends within
    the 600 s share: 2x apart with 1% noise stops at 3, slower; equal sides with 30% noise run the whole
    share, 20 (r + 1) > 600 -> 30 rounds, flagged noisy; 3% noise stops between, at the first round whose
    interval (the spread of the first 3 rounds) is narrow. A loop blind to the interval (never noisy) stops
    the noisy pair at 3."""
    n, row = alternate(monkeypatch, 2.0, 0.01)
    assert n == 3 and row["verdict"] == "slower" and not row["noisy"], row
    n, row = alternate(monkeypatch, 1.0, 0.3)
    assert (
        n == 30
        and row["noisy"]
        and bench.verdict([row["ratio"], *row["interval"]]) == row["verdict"]
    ), row
    n, row = alternate(monkeypatch, 1.0, 0.03)
    assert (
        3 < n < 30
        and not row["noisy"]
        and bench.judge(row["ratio_per_round"][:-1], 0.05, 3)["noisy"]
    ), row
    assert row["verdict"] == "no difference measurable" and "+-" not in bench.say(row), row
    per = row["ratio_per_round"]  # the spread of the first 3 rounds, not of all n
    assert (
        row["interval"]
        == bench.judge(per, 0.05, 3)["interval"]
        != bench.judge(per, 0.05)["interval"]
    )
    real = bench.judge
    monkeypatch.setattr(bench, "judge", lambda *a: dict(real(*a), noisy=False))
    assert alternate(monkeypatch, 1.0, 0.3)[0] == 3  # the mutant


def test_budget_shared_between_groups(tmp_path, monkeypatch, capsys):
    """`--pairs zb,zbv --budget-min 10`, both taken out of OURS so that they run in rounds (two groups, no
    one-process launch for pipelines), each launch 10 s on a fake clock: zb, 1% noise, is narrow at its
    3 rounds (60 s), so zbv, 30% noise, gets the 540 s left, 20 (r + 1) > 540 -> 27 rounds, where
    halving the budget up front would give it 15; the bench's last line says one interval stayed noisy."""
    clock, rng = [0.0], random.Random(5)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(time=lambda: clock[0]))
    monkeypatch.delitem(bench.OURS, "zb")
    monkeypatch.delitem(bench.OURS, "zbv")

    def launch(args, pair, tag, worker=None):
        clock[0] += 10.0
        ms = 100 * math.exp(rng.gauss(0, 0.01 if pair == "zb" else 0.3))
        return dict(rc=0, summary=None, ms=[ms] * args.steps, cmd=tag, load=1.0)

    monkeypatch.setattr(bench, "launch", launch)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench.py",
            "--pairs",
            "zb,zbv",
            *TINY,
            "--budget-min",
            "10",
            "--out",
            str(tmp_path / "b"),
        ],
    )
    with pytest.raises(SystemExit) as e:
        bench.main()
    rows, out = json.loads((tmp_path / "b.json").read_text()), capsys.readouterr().out
    assert e.value.code == 0, out
    assert [(r["pair"], r["rounds"], r["noisy"]) for r in rows] == [
        ("zb", 3, False),
        ("zbv", 27, True),
    ]
    # ----------------------------------------------------------------------------- paired in one launch
    assert out.rstrip().endswith(
        "noisy machine: 1 interval(s) wider than +-5% when the budget ran out"
    ), out


def paired_bench(
    monkeypatch, ratio, drift, load=1.0, cpu_ratio=None, seed=7, noise=0.03, seen=None
):
    """bench_paired on one pair (ddp) whose launches run paired_worker's loop in this process on synthetic
    sides, no torchrun: a step advances a fake wall clock by its work (100 ms, ours x ratio, 3% log-normal
    noise) times the machine's load at that moment, exp(drift x t / 1 s), which slows both sides alike, and
    a fake CPU clock by the work alone (ours x cpu_ratio: what load cannot take). 10 blocks of 2 steps per
    launch; more launches while noisy, within 60 s; the separate launches for peaks and bytes return
    nothing. Returns the pair's row."""
    wall, cpu, rng = [0.0], [0.0], random.Random(seed)

    def side(r_wall, r_cpu):
        def step(i):
            jitter = math.exp(rng.gauss(0, noise))
            wall[0] += 0.1 * r_wall * jitter * math.exp(drift * wall[0])
            cpu[0] += 0.1 * r_cpu * jitter
            return 1.0

        return step

    clocks = dict(perf_counter=lambda: wall[0], process_time=lambda: cpu[0], time=lambda: wall[0])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(**clocks))
    one = types.SimpleNamespace(world=1, rank=0, device=bench.torch.device("cpu"))
    monkeypatch.setattr(bench, "init_dist", lambda timeout: one)
    monkeypatch.setattr(bench, "dist", types.SimpleNamespace(all_reduce=lambda t, **k: None))
    monkeypatch.setattr(bench.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(bench, "harness", types.SimpleNamespace(close_dist=lambda: None))
    monkeypatch.setattr(bench, "load", lambda: load)
    opt = types.SimpleNamespace(zero_grad=lambda **k: None, step=lambda: None)
    theirs = side(1.0, 1.0)
    torch_side = lambda d, a, name, comm: (None, opt, lambda i: (theirs(i), 0))  # noqa: E731
    monkeypatch.setitem(bench.WORKERS, "ddp", (torch_side, "DDP"))
    monkeypatch.setitem(bench.OURS, "ddp", lambda d, a, pair: side(ratio, cpu_ratio or ratio))
    summary = {}

    def write_summary(d, args, name, losses, *rest, figures):
        summary.update(losses=losses, figures=figures)

    def launch(args, pair, tag, worker=None):
        if worker != "paired":
            return dict(rc=1, summary=None, ms=[], cmd=tag, load=load)
        bench.paired_worker(dataclasses.replace(args, pairs=pair))
        (seen if seen is not None else []).append(args.blocks)
        return dict(rc=0, summary=dict(summary), ms=[], cmd=tag, load=load)

    monkeypatch.setattr(bench, "write_summary", write_summary)
    monkeypatch.setattr(bench, "launch", launch)
    args = bench.Args(blocks=10, block_steps=2, warmup=1, world=1)
    return bench.bench_paired(args, ["ddp"], None, 60.0)[0]


def test_block_pairing_cancels_drift(monkeypatch):
    """Both sides in one launch, blocks A B, B A, ...: a load that rises 15% a second (about 2x over the
    launch) slows both sides alike and cancels: equal sides are "no difference measurable" within +-5% from
    one launch; a side truly 10% slower under the same drift is called slower, its interval holding 1.1.
    Blocks always A B (the mutant) put ours always first, earlier on the rising load: a difference that is
    not there (faster) is claimed."""
    row = paired_bench(monkeypatch, 1.0, 0.15)
    assert row["verdict"] == "no difference measurable" and not row["noisy"], row
    assert row["rounds"] == 10 and row["rests_on"] == "wall time", row  # one launch was enough
    row = paired_bench(monkeypatch, 1.1, 0.15)
    assert row["verdict"] == "slower" and row["interval"][0] <= 1.1 <= row["interval"][1], row
    monkeypatch.setattr(bench, "first_in_block", lambda j, flip: 0)  # the mutant
    assert paired_bench(monkeypatch, 1.0, 0.15)["verdict"] == "faster"


def test_second_stage_runs_the_blocks_the_first_launch_asks(monkeypatch):
    """Stein's second stage in blocks: at 12% noise per step the first launch's 10 blocks leave both
    intervals wider than +-5%; one more launch runs exactly the blocks that the first 10 blocks' spread
    asks for, (t s / log 1.05)^2 in all (t at 9 degrees of freedom, computed here), and both intervals,
    wall and CPU, end within +-5%. Launches of a fixed 10 blocks (the mutant: the second stage not
    sized) take more launches and end at a multiple of 10."""
    seen = []
    row = paired_bench(monkeypatch, 1.0, 0.0, noise=0.12, seen=seen)
    for r in (row["wall"], row["cpu"]):
        logs = [math.log(x) for x in r["ratio_per_round"][:10]]
        t = bench.t_quantile(0.975, 9)
        assert abs(t - 2.262) < 1e-3
        need = math.ceil((t * statistics.stdev(logs) / math.log(1.05)) ** 2)
        assert need > 10 and r["rounds"] == need and not r["noisy"], (need, r)
    assert seen == [10, row["rounds"] - 10], seen  # one more launch, sized
    monkeypatch.setattr(bench, "samples_needed", lambda ratios, first, p: len(ratios) + 10)
    seen = []
    row = paired_bench(monkeypatch, 1.0, 0.0, noise=0.12, seen=seen)
    assert len(seen) > 2 and row["rounds"] % 10 == 0, seen


def test_verdict_rests_on_cpu_time_above_the_core_count(monkeypatch):
    """A side that spends 10% more CPU time (user + system, all threads) but no more wall time: at a load
    under the core count the verdict rests on wall time (no difference), above it on CPU time (slower), and
    the pair's line says the load passed the cores; both ratios are in the row either way."""
    row = paired_bench(monkeypatch, 1.0, 0.0, load=0.5, cpu_ratio=1.1)
    assert (row["rests_on"], row["verdict"], row["cpu"]["verdict"]) == (
        "wall time",
        "no difference measurable",
        "slower",
    ), row
    busy = os.cpu_count() + 1.0
    row = paired_bench(monkeypatch, 1.0, 0.0, load=busy, cpu_ratio=1.1)
    assert (row["rests_on"], row["verdict"], row["wall"]["verdict"]) == (
        "CPU time",
        "slower",
        "no difference measurable",
    ), row
    assert row["note"].endswith(f"load {busy:.1f}-{busy:.1f} > {os.cpu_count()} cores"), row


def fork_launches(monkeypatch):
    """bench.py's torchrun commands run by tests/forkserver.py, as torchrun would run them; returns a dict
    script -> the script to run in its place."""
    swap = {}

    def torchrun(cmd, env, timeout):
        nproc = int(next(a for a in cmd if a.startswith("--nproc_per_node=")).split("=")[1])
        script, *args = cmd[cmd.index("--standalone") + 2 :]
        rc, out = forked(swap.get(script, script), nproc, *args, timeout=timeout)
        return out, rc

    monkeypatch.setattr(bench, "torchrun", torchrun)
    return swap


def refuse_launch(
    args, pair, tag, worker=None
):  # in place of bench.launch: a pair must launch nothing
    raise RuntimeError(f"launched {tag}")


def test_one_pair_end_to_end(tmp_path, monkeypatch, capsys):
    """`python bench.py --pairs dualpipev,hsdp,zb` at tiny size within a 6 s budget: dualpipev and hsdp each
    paired in one launch (3 blocks of 1 step per side; dualpipev.PipelineRank beside ScheduleDualPipeV, and
    zero.Zero on a 2 x 1 grid beside fully_shard on a (2, 1) mesh, in the same processes; they took gpipe's
    place here, whose sides test_torch_sides_match_reference_and_counts holds), then each side
    in a launch of its own for its peak, bytes and bubble: its row of the documented shape, with a wall and
    a CPU-time interval over the blocks, a verdict that agrees with the one it rests on, the load, printed and
    in the table; the two sides' losses equal in the paired launch as in their own (float32). zb pointed at a
    file that will never offer `--schedule zbh1` (gpipe.py) is skipped with one line, no launch, and a choice
    the file does offer (pipedream.py --mode flush) is not. The torchrun commands bench.py builds are run by
    tests/forkserver.py, as torchrun would run them."""
    fork_launches(monkeypatch)
    monkeypatch.setitem(bench.NEEDS, "1f1b", ("--mode", "flush"))  # offered: not skipped
    assert bench.why_skipped("1f1b") == "", bench.why_skipped("1f1b")
    monkeypatch.setitem(bench.PAIRS, "zb", ("gpipe.py", *bench.PAIRS["zb"][1:]))
    out = tmp_path / "b"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench.py",
            "--pairs",
            "dualpipev,hsdp,zb",
            *TINY,
            "--no-scaling",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--blocks",
            "3",
            "--block-steps",
            "1",
            "--budget-min",
            "0.1",
            "--microbatches",
            "4",
            "--out",
            str(out),
            "--launch-timeout",
            "150",
        ],
    )
    with pytest.raises(SystemExit) as e:
        bench.main()
    stdout = capsys.readouterr().out
    assert e.value.code == 0, stdout
    skip = [line for line in stdout.splitlines() if line.startswith("zb:")]
    assert skip == [
        "zb: pair skipped, gpipe.py has no --schedule zbh1 yet (--schedule offers [])"
    ], stdout
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["pair"] for r in rows] == ["dualpipev", "hsdp", "zb"], rows
    assert rows[2]["skipped"] and rows[2]["ours"] is None, rows
    md = (tmp_path / "b.md").read_text()
    assert "| zb | skipped: gpipe.py has no --schedule zbh1" in md, md
    heads = (
        "dualpipev.py vs pipelining ScheduleDualPipeV",
        "zero.py vs fully_shard on a (replicate 2",
    )
    for r, head in zip(rows, heads):
        for side in ("ours", "torch"):
            s = r[side]
            assert s["name"] and s["step_ms"] > 0 and s["tokens_per_s"] > 0, s
            assert s["peak_mem_bytes"] > 0 and s["sent_bytes_per_rank"] > 0, s
            # (p-1)/(3m) idle / busy (dualpipev.py) as a share of the step
            if r["pair"] == "dualpipev":
                assert (
                    0 <= s["bubble"] <= 1 and abs(s["bubble_theory"] - 1 / (3 * 4 + 1)) < 1e-12
                ), s
        (lo, hi), per = r["interval"], r["ratio_per_round"]
        assert r["rounds"] == len(per) >= 3 and lo <= r["ratio"] <= hi and r["unit"] == "block", r
        assert r[{"wall time": "wall", "CPU time": "cpu"}[r["rests_on"]]]["interval"] == [lo, hi], r
        assert len(r["cpu"]["ratio_per_round"]) == len(per) == len(r["load"]), r
        # the geometric mean
        assert abs(math.log(r["ratio"]) - sum(map(math.log, per)) / len(per)) < 1e-12, r
        word = "faster" if hi < 1 else "slower" if lo > 1 else "no difference measurable"
        assert r["verdict"] == word, r
        line = f"{r['pair']}: {head}"
        assert any(
            x.startswith(line)
            and f"{word}: " in x
            and f"[{lo:.2f}, {hi:.2f}], {len(per)} blocks" in x
            for x in stdout.splitlines()
        ), stdout
        # both sides trained the same model on the same data (float32), in one launch and apart
        assert r["max_loss_diff"] <= 1e-4 and r["paired_loss_diff"] <= 1e-4, r
        assert f"| {r['pair']} | `{r['ours']['name']}` | {r['torch']['name']} |" in md, md


def test_bad_input(capsys):
    """One line and exit 2: three launches, and --precision / --budget-min checked in-process (as fail())."""
    for argv, words in (
        (["--pairs", "nope"], "unknown"),
        (["--warmup", "0"], "--warmup"),
        (["--world", "2", "--n-heads", "3", "--d-model", "48"], "--n-heads"),
    ):
        p = run_python("bench.py", *argv)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], p.stderr
    for bad in (
        dict(precision=0.0),
        dict(precision=float("nan")),
        dict(budget_min=-1.0),
        dict(budget_min=float("inf")),
    ):
        with pytest.raises(SystemExit) as e:
            bench.check_bench_args(bench.Args(**bad))
        lines = capsys.readouterr().err.strip().splitlines()
        flag = "--" + next(iter(bad)).replace("_", "-")
        assert e.value.code == 2 and len(lines) == 1 and flag in lines[0], lines


def test_gpu_check_runs_each_pair_once_without_alternating(monkeypatch, tmp_path):
    """tests/gpu_check.py runs bench.py's pairs to see them train alike on a GPU, not to time them: its command
    asks for one round and no budget to alternate in (without --budget-min 0 the default 20 minutes of
    alternation for an interval ran past gpu_check's own timeout). Parsed as bench.py parses it."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check
    import harness

    for w in (1, 2):
        cmd = gpu_check.bench_command(w, "ddp", tmp_path / "b")
        monkeypatch.setattr(sys, "argv", ["bench.py", *cmd[2:]])
        args = harness.parse_args(bench.Args)
        # the check can fail: the command as it was, without the budget, keeps bench's default
        assert (
            args.rounds == 1 and args.budget_min == 0 and bench.check_bench_args(args) == ["ddp"]
        ), cmd
    monkeypatch.setattr(
        sys, "argv", ["bench.py", *[a for a in cmd[2:] if a not in ("--budget-min", "0")]]
    )
    assert harness.parse_args(bench.Args).budget_min > 0


def test_tp_overlap_skipped_on_cpu(tmp_path, monkeypatch, capsys):
    """torch's fused_all_gather_matmul / fused_matmul_reduce_scatter run on CUDA only (symmetric memory, >= 2
    peer-connected GPUs): on a CPU machine `--pairs tp_overlap` prints one line saying so, launches nothing
    (no torch side is faked), writes a skipped row and exits 0, as fp8 does without torchao. A bench that
    does not ask (cannot_run always '') launches the pair: caught."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(bench, "launch", refuse_launch)
    argv = ["bench.py", "--pairs", "tp_overlap", *TINY, "--out", str(tmp_path / "b")]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as e:
        bench.main()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tp_overlap")]
    why = "torch's fused_all_gather_matmul / fused_matmul_reduce_scatter run on CUDA only"
    assert e.value.code == 0 and len(lines) == 1, lines
    assert lines[0].startswith(f"tp_overlap: pair skipped, {why}"), lines
    rows = json.loads((tmp_path / "b.json").read_text())
    assert rows[0]["skipped"].startswith(why) and rows[0]["ours"] is None, rows
    assert f"| tp_overlap | skipped: {why}" in (tmp_path / "b.md").read_text()
    monkeypatch.setattr(bench, "cannot_run", lambda pair, args: "")  # the mutant
    with pytest.raises(RuntimeError, match="launched tp_overlap_paired"):
        bench.main()


# ----------------------------------------------------------------------------- fp8 (torchao optional)
SKIP_LINE = "fp8: pair skipped, torchao not installed: pip install torchao to run this pair"


def test_fp8_pair_skipped_without_torchao(tmp_path, monkeypatch, capsys):
    """torchao is not a requirement: without it (blocked here; the suite's venv has none) `--pairs fp8`
    prints one line saying how to get it, launches nothing (nor the one-process baseline), writes a skipped
    row and exits 0. A bench that does not look for torchao (IMPORTS emptied) launches the pair: caught."""
    monkeypatch.setitem(sys.modules, "torchao", None)  # `import torchao` now raises ImportError
    monkeypatch.setattr(bench, "launch", refuse_launch)
    monkeypatch.setattr(
        sys, "argv", ["bench.py", "--pairs", "fp8", *TINY, "--out", str(tmp_path / "b")]
    )
    with pytest.raises(SystemExit) as e:
        bench.main()
    out = capsys.readouterr().out
    assert e.value.code == 0 and [x for x in out.splitlines() if x.startswith("fp8")] == [
        SKIP_LINE
    ], out
    why = SKIP_LINE.split(", ", 1)[1]
    rows = json.loads((tmp_path / "b.json").read_text())
    assert rows == [dict(pair="fp8", ours=None, torch=None, ratio=None, skipped=why)], rows
    assert f"| fp8 | skipped: {why} |" in (tmp_path / "b.md").read_text()
    monkeypatch.setattr(bench, "IMPORTS", {})  # the mutant
    with pytest.raises(RuntimeError, match="launched fp8_paired"):
        bench.main()


# Run in place of `bench.py --worker float8`: torchao broken on purpose, then bench.py as torchrun runs it.
MUTANT = """import runpy, sys, torch
sys.path.insert(0, {root!r})
import torchao.float8 as ao, torchao.float8.config as config
{patch}
runpy.run_path({bench!r}, run_name="__main__")
"""
MUTANTS = {  # torchao reads config.e5m2_dtype when a Float8LinearConfig is made
    "E4M3 gradients": "config.e5m2_dtype = torch.float8_e4m3fn",
    "float32 all-gather": "real = ao.Float8LinearConfig\nao.Float8LinearConfig = "
    "lambda **k: real(**dict(k, enable_fsdp_float8_all_gather=False))",
}


def fp8_bench(tmp_path, monkeypatch, world):
    """`python bench.py --pairs fp8 --world W` at tiny size, one paired launch (2 blocks of 1 step per side:
    fp8.py's core beside torchao in the same processes), then each side apart, its torchrun launches forked
    (as in test_one_pair_end_to_end). Returns (its row, the two sides' summaries, mutant: a name -> the summary of
    torch's side run broken that way)."""
    swap = fork_launches(monkeypatch)
    out = tmp_path / f"w{world}"
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "bench.py",
            "--pairs",
            "fp8",
            *TINY,
            "--world",
            str(world),
            "--steps",
            "3",
            "--warmup",
            "1",
            "--blocks",
            "2",
            "--block-steps",
            "1",
            "--budget-min",
            "0",
            "--out",
            str(out),
            "--launch-timeout",
            "300",
        ],
    )
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 0
    row = json.loads((tmp_path / f"w{world}.json").read_text())[0]
    sides = {
        side: json.loads((tmp_path / f"w{world}_runs" / f"{tag}_w{world}.json").read_text())
        for side, tag in (("ours", "fp8_ours"), ("torch", "float8_torch"))
    }

    def mutant(name):
        wrapper = tmp_path / "mutant.py"
        wrapper.write_text(
            MUTANT.format(root=str(ROOT), bench=str(ROOT / "bench.py"), patch=MUTANTS[name])
        )
        swap["bench.py"] = str(wrapper)
        tag = f"mutant_{name.replace(' ', '_')}_w{world}"
        return bench.launch(bench.parse_args(bench.Args), "fp8", tag, "float8")["summary"]

    return row, sides, mutant


# bytes handed to all-gathers per rank in the counted step, either side's table
def all_gathered(
    summary,
):
    table = summary["figures"].get("comm") or summary["figures"]["comm_ops_rank0"]
    return sum(handed for key, (_, _, handed) in table.items() if key.startswith("all_gather/"))


def test_fp8_pair_against_torchao(tmp_path, monkeypatch):
    """Only where torchao imports (`pip install torchao`; not a requirement): fp8.py --recipe current
    --fp8-all-gather beside torchao's float8 training on fully_shard. World 1, where both quantize the same
    tensors by the same amaxes (E4M3 x and W, E5M2 dy): equal losses to float32 roundoff (1e-6 asked; the
    scale is amax / 448 here, 448 / amax in float64 there, an ulp apart); torchao with E4M3 gradients is
    caught. World 2: both all-gather the block weights in FP8, bytes per rank = 2 (forward, backward) x FP8
    weight elements / world (fp8.py: of its shards padded to whole 16-element tiles), plus on torch's side 4
    bytes for each element of what FSDP2 shards too (LayerNorms, biases, embeddings, head): a float32 weight
    all-gather is caught; losses within 1e-3 (torchao scales activations and gradients by each rank's own
    amax, fp8.py by the group's, as TransformerEngine). Both bounds hold the two sides in launches of their
    own and in the paired launch, where fp8.py's core and torchao train in the same processes."""
    pytest.importorskip("torchao.float8")
    row, sides, mutant = fp8_bench(tmp_path, monkeypatch, 1)
    diff = lambda a, b: max(abs(x - y) / abs(y) for x, y in zip(a, b))  # noqa: E731
    e4m3 = diff(sides["ours"]["losses"], mutant("E4M3 gradients")["losses"])
    print(
        f"world 1: max rel loss diff {row['max_loss_diff']:.1e} apart, {row['paired_loss_diff']:.1e} in the "
        f"paired launch; torchao with E4M3 gradients {e4m3:.1e}"
    )
    assert (
        max(row["max_loss_diff"], row["paired_loss_diff"]) <= 1e-6 < e4m3
        and len(row["torch"]["losses"]) == 3
    ), row

    w = 2
    row, sides, mutant = fp8_bench(tmp_path, monkeypatch, w)
    model = bench.build_gpt(bench.GPTConfig.from_args(bench.parse_args(bench.Args)), 0)
    linears = [
        m for n, m in model.named_modules() if isinstance(m, bench.nn.Linear) and n != "head"
    ]
    fp8 = sum(m.weight.numel() for m in linears)
    rest = sum(p.numel() for p in model.parameters()) - fp8  # float32 on torch's side
    # fp8.py pads every GEMM dimension to 16 (cuBLASLt's FP8 rule) and W to w shards of whole 16-row
    # tiles: a rank gathers w x (its padded rows x padded K) FP8 bytes, forward and backward
    up = lambda n, k: -(-n // k) * k  # noqa: E731
    padded = sum(2 * up(m.out_features, 16 * w) * up(m.in_features, 16) // w for m in linears)
    ours, theirs = all_gathered(sides["ours"]), all_gathered(sides["torch"])
    f32 = all_gathered(mutant("float32 all-gather"))
    print(
        f"world {w}: all-gather bytes per rank and step: fp8.py {ours} (theory {padded}: padded), torchao "
        f"{theirs} (theory {2 * fp8 // w} FP8 + {2 * rest * 4 // w} float32), torchao's weights gathered in "
        f"float32 {f32}; max rel loss diff {row['max_loss_diff']:.1e} apart, {row['paired_loss_diff']:.1e} "
        "in the paired launch\n" + (tmp_path / f"w{w}.md").read_text()
    )
    assert ours == padded and theirs == 2 * fp8 // w + 2 * rest * 4 // w != f32, (ours, theirs, f32)
    assert max(row["max_loss_diff"], row["paired_loss_diff"]) <= 1e-3, row
    assert row["ours"]["name"] == "fp8.py" and row["unit"] == "block", row


SLEEPER = "import os, sys, time\nopen(sys.argv[1], 'w').write(str(os.getpid()))\ntime.sleep(900)\n"


def test_a_launch_past_its_timeout_leaves_no_worker(tmp_path):
    """A torchrun launch past --launch-timeout: bench.torchrun stops the agent with SIGTERM, on which
    torchrun stops its worker (in a session of its own) and exits; subprocess.run's timeout, which bench.py
    used before, sends SIGKILL and leaves the worker running (the mutant, caught). No time is asserted: a
    launch whose worker had not started by the timeout is run again with a longer one."""
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)

    def alive(pid):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True

    def old(cmd, env, timeout):  # bench.launch as it was
        try:
            subprocess.run(cmd, env=env, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return "", -1

    left = {}
    for name, run in (("bench.torchrun", bench.torchrun), ("subprocess.run", old)):
        pid_file = tmp_path / name
        for timeout in (6, 30, 90, 270):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            run([*cmd, "--nproc_per_node=1", str(script), str(pid_file)], dict(os.environ), timeout)
            if pid_file.exists():  # the worker had started
                break
        pid = int(pid_file.read_text())
        for _ in range(30):  # the agent has stopped its worker; its exit is reaped within moments
            if not alive(pid):
                break
            time.sleep(0.1)
        left[name] = alive(pid)
        if left[name]:
            os.kill(pid, signal.SIGKILL)
    assert left == {"bench.torchrun": False, "subprocess.run": True}, left
