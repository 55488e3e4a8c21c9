"""The counters every technique file measures with (harness.py), against closed forms computed here from the
shapes alone: CommCounter on a real gloo group at worlds 2 and 3, SavedActivations and LiveStorages in one
process, the Timeline's gathered events. Each check is shown to fail on a broken counter."""

import inspect
import json
import re
import sys
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn

from helpers import ROOT, forked

sys.path.insert(0, str(ROOT))
import harness  # noqa: E402


def expected_table(W):
    """What rank 0 hands over in tests/harness_checks.py's traffic(), by "op/axis/phase": [calls, elems,
    bytes]."""
    rows = [3 + q for q in range(W)]
    return {
        "all_reduce/world/fwd": [1, 10, 80],
        "all_gather/pair/fwd": [1, 20, 80],  # hands its 10 elements; the whole output is 20
        "reduce_scatter/pair/fwd": [1, 20, 160],  # hands the whole input
        "all_to_all/world/fwd": [1, 2 * sum(rows), 8 * 2 * sum(rows)],
        "broadcast/world/fwd": [
            1,
            10,
            80 if W == 1 else 0,
        ],  # root W-1 hands it; rank 0 only receives
        "send/world/fwd": [1, 7, 56],
        "recv/world/fwd": [1, 7, 0],  # a receive hands nothing over
        "all_reduce/world/bwd": [1, 3, 24],  # inside an autograd backward
        "all_reduce/world/step": [
            1,
            4,
            32,
        ],  # under comm.phase("step"); the paused one is not counted
    }


def expected_rest(W):
    """The same for tests/harness_checks.py's the_rest(): coalesced, functional and any-source ops."""
    return {
        "all_reduce/world/fwd": [
            3,
            8 + 5 + 8,
            8 * 21,
        ],  # functional coalesced (5 + 3), in place (5), c10d's
        "all_gather/world/fwd": [
            2,
            8 * W + 2 * W,
            64 + 16,
        ],  # coalesced [5, 3] and a list of W pieces of 2
        "reduce_scatter/world/fwd": [
            1,
            3 * W,
            8 * 3 * W,
        ],  # coalesced [2W, W]: hands both whole inputs
        "broadcast/world/fwd": [1, 3, 24],  # rank 0 is the root
        "recv/world/fwd": [
            W,
            3 * (W - 1) + 4,
            0,
        ],  # W - 1 from any source, one in the functional batch
        "send/world/fwd": [
            1,
            4,
            32,
        ],  # the functional batch's send (rank 0 sends nothing to any source)
        "all_to_all/world/fwd": [1, 2 * W, 16 * W],
        "gather/world/fwd": [1, 2 * W, 16],
        "scatter/world/fwd": [1, 2 * W, 16 * W],  # the root hands every piece
        "reduce/world/fwd": [1, 3, 24],
    }


@pytest.mark.parametrize("world", [2, 3])
def test_comm_counter_sees_what_each_collective_hands_over(tmp_path, world):
    out = tmp_path / "h.json"
    rc, output = forked("tests/harness_checks.py", world, out, timeout=120)
    assert rc == 0, output[-6000:]
    got = json.loads(out.read_text())
    assert got["table"] == expected_table(world), got["table"]
    # every other form of op (issue 31: the coalesced functional ops and recv_any_source crashed the counter)
    assert got["rest"] == expected_rest(world), got["rest"]
    rest = [(c["op"], c["peer"], c["tag"]) for c in got["rest_log"] if c["op"] in ("send", "recv")]
    ring = [("send", 1, 0), ("recv", world - 1, 0)]  # peers as global ranks; None: from any source
    assert rest == [("recv", None, 5)] * (world - 1) + ring, rest
    assert [c["to_others"] for c in got["rest_log"] if c["op"] == "all_to_all"] == [
        16 * (world - 1)
    ]
    # the per-call log: peers as global ranks, the tag, and the all-to-all bytes that leave the rank
    log = {c["op"] + "/" + c["phase"]: c for c in got["log"]}
    assert log["send/fwd"]["peer"] == 1 and log["send/fwd"]["tag"] == 1
    assert log["recv/fwd"]["peer"] == world - 1
    rows = [3 + q for q in range(world)]
    # the block to itself stays
    assert log["all_to_all/fwd"]["to_others"] == 8 * 2 * (sum(rows) - rows[0])
    # the check can fail: a counter that adds up every tensor argument gets other numbers
    real = {k.split("/")[0]: 0 for k in expected_table(world)}
    for k, v in expected_table(world).items():
        real[k.split("/")[0]] += v[2] if not k.endswith("/step") else 0
    assert {k.split("/")[0]: v for k, v in got["naive"].items()} != real, got["naive"]
    assert got["naive"]["recv/-/-"] == 56 and got["naive"]["all_gather/-/-"] == 80 + 160
    # the timeline: every span on every rank, simulated time inside it, kinds and tags kept
    ev = got["events"]
    assert sorted((e["rank"], e["kind"], e["mb"]) for e in ev) == sorted(
        (q, k, i) for q in range(world) for k in "FB" for i in range(2)
    )
    assert all(e["end"] - e["start"] >= (30 if e["kind"] == "F" else 60) * 0.99 for e in ev), ev
    assert all(e["chunk"] == e["rank"] for e in ev) and all(
        e["note"] == -1 for e in ev if e["kind"] == "B"
    )
    assert all(a["end"] <= b["start"] + 1e-6 for a, b in zip(ev, ev[1:]) if a["rank"] == b["rank"])
    # harness.PipelineWatch, the four pipeline files' observe callback: F's saved bytes per chunk (x and
    # tanh's output, 2 x 4 float64 each; the weight excluded), its tags (step, grid coordinates, when the
    # input arrived, stamped by the p2p op before F; none for B); a watcher without SavedActivations is caught
    (saved, ev, last), (unsaved, _, _) = got["watch"]
    assert saved == {"1": 2 * 2 * 4 * 8} and unsaved == {} and last == "B", (saved, unsaved)
    assert sorted((e["rank"], e["kind"], e["chunk"], e["step"], e["pp"]) for e in ev) == sorted(
        (q, k, 1, 3, q) for q in range(world) for k in "FB"
    ), ev
    assert all((e["recv"] >= 0 and e["recv"] <= e["start"]) == (e["kind"] == "F") for e in ev), ev


def test_comm_counter_knows_every_communication_op_of_this_torch():
    """Each op torch registers in the two namespaces the counter watches is counted (harness._OPS) or moves
    no data (barriers, waits): an op added by a later torch fails here, not silently uncounted in a run."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers its ops: the same set in any run)

    names = [n.split("::") for n in torch._C._dispatch_get_all_op_names()]
    ops = {name for ns, name in names if ns in ("c10d", "_c10d_functional")}
    # the check can fail
    assert len(ops) >= 35 and ops <= set(harness._OPS) | harness._NOT_TRAFFIC, ops - set(
        harness._OPS
    )
    assert not ops <= set(harness._OPS) - {"recv_any_source_"} | harness._NOT_TRAFFIC


def test_saved_activations_and_live_storages():
    lin = nn.Linear(5, 3).double()
    x = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    with harness.SavedActivations() as saved:
        y = torch.tanh(lin(x))  # Linear saves its input (not its weight); tanh saves its output
    assert saved.bytes == 8 * (4 * 5 + 4 * 3), saved.bytes
    assert saved.live.alive() == saved.bytes
    y.sum().backward()  # backward frees what the graph saved ...
    del y
    assert saved.live.alive(x) == 8 * 4 * 5  # ... but x is still held by the caller, counted once
    assert saved.live.peak == saved.bytes
    # the check can fail: without the parameter filter the weight (a parameter) would be counted too
    real = harness.is_parameter
    harness.is_parameter = lambda t: False
    try:
        with harness.SavedActivations() as wrong:
            torch.tanh(lin(x))
    finally:
        harness.is_parameter = real
    assert wrong.bytes > 8 * (4 * 5 + 4 * 3)
    live = harness.LiveStorages()
    kept, dropped = torch.zeros(10), torch.zeros(20)
    live.add(kept), live.add(dropped), live.add(kept[2:])  # a view: the same storage, counted once
    assert live.alive() == 4 * 30
    del dropped
    assert live.alive() == 4 * 10 and live.peak == 4 * 30


# --------------------------------------------------------------------------- tests/gpu_check.py, sized
def gpu_check_main(capsys, *argv):
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check

    gpu_check.FAILED.clear()
    rc = gpu_check.main(list(argv))
    return rc, capsys.readouterr().out


def planned(out):
    """The runs a dry run lists: {name: launches}; and those it skips for the budget."""
    runs = {
        m[0].strip(): int(m[1])
        for m in re.findall(r"^(.+?\(world \d+\))\s+(\d+) launch", out, re.M)
    }
    return runs, re.findall(r"^(.+?\(world \d+\))\s+skipped", out, re.M)


def test_gpu_check_one_gpu_plan_only_world_and_minutes(capsys):
    rc, out = gpu_check_main(capsys, "--dry-run", "--one-gpu")
    runs, skipped = planned(out)
    assert rc == 0 and not skipped and all(n.endswith("(world 1)") for n in runs), out
    for path in (
        "offload bf16",
        "fp16 loss scaling",
        "CUDA events",
        "bfloat16",
        "compress int8",
        "adafactor",
        "cp 1",
        "dropout 0.1, vs none",
        "restart",
        "bench",
        *(f"moe {r} " for r in ("switch", "gshard", "noisy_topk", "expert_choice", "loss_free")),
    ):
        assert any(path in n for n in runs), (
            path,
            out,
        )  # every CUDA-only path of issue 31 is planned
    # the launch count printed is the sum of the runs' launches; at 10 s each, under 8.5 min (the fp8
    # delayed restart of the fourth NCCL review added 2 launches to 41; bench.py's six world-1 pairs take
    # three launches each since both sides run in one launch and each side apart for its peak: 50)
    n = sum(runs.values())
    assert f"{len(runs)} runs ({n} launches)" in out and 10 * n <= 8.5 * 60, out
    # --only: just those files' runs; a file that is not in the plan is one line and exit 2
    rc, out = gpu_check_main(capsys, "--dry-run", "--for-gpus", "4", "--only", "zero.py,moe.py")
    files = set(re.findall(r"launch\(es\), ~\d+ s  (\S+)", out))
    assert rc == 0 and files == {"zero.py", "moe.py"}, out
    rc, out = gpu_check_main(capsys, "--dry-run", "--only", "zero.py,nope.py")
    assert rc == 2 and out.strip().splitlines() == [out.strip()] and "nope.py" in out, out
    # --world: that world's plan alone; beyond the GPUs at hand it is refused
    rc, out = gpu_check_main(capsys, "--dry-run", "--for-gpus", "8", "--world", "4")
    runs, _ = planned(out)
    assert rc == 0 and runs and all(n.endswith("(world 4)") for n in runs), out
    assert any("ptdp pp 2 x dp 2" in n for n in runs) and any("moe ep 2 of 4" in n for n in runs), (
        out
    )
    assert gpu_check_main(capsys, "--dry-run", "--for-gpus", "2", "--world", "4")[0] == 2
    # --minutes: in order, a run is skipped when its estimate does not fit in what is left (10 s per launch
    # at world 1 on a GPU), and every later run that fits still runs
    full, _ = planned(gpu_check_main(capsys, "--dry-run", "--one-gpu")[1])
    rc, out = gpu_check_main(capsys, "--dry-run", "--one-gpu", "--minutes", "1.5")
    runs, skipped = planned(out)
    left, expect_run, expect_skip = 90, [], []
    for name, launches in full.items():
        (expect_run if 10 * launches <= left else expect_skip).append(name)
        left -= 10 * launches if 10 * launches <= left else 0
    assert list(runs) == expect_run and skipped == expect_skip and expect_skip, out
    assert f"{len(expect_skip)} skipped for the budget" in out


N4_5 = {  # what the fourth NCCL review (N4-5) found never run on several GPUs: run name -> a flag it needs
    "ptdp pp 2 x cp 2": "--cp",
    "ptdp cp ": "--cp",
    " zero 1 (": "--zero",
    "diloco streaming overlap bfloat16": "--outer-dtype bfloat16",
    "diloco streaming overlap float8_e4m3fn": "--outer-dtype float8_e4m3fn",
    "fp8 delayed loss falls": "--recipe delayed",
    "fp8 fine-grained loss falls": "--recipe fine-grained",
    "zero 2 saved at world": "--stage 2",
}


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_gpu_check_n_gpu_plan_fits_14_minutes_with_review_4s_runs(capsys, gpus):
    """`gpu_check.py --dry-run --for-gpus N --minutes 14`: at 2, 4 and 8 GPUs the plan at world N holds
    ptdp's context parallel and ZeRO-1, diloco on both wires, fp8 delayed and fine-grained, zero.py's
    checkpoint resumed at N / 2, and the one-GPU plan's fp8 delayed restart, none of them skipped, listed
    first; the estimate printed fits the 14 minutes; the whole plan does not (so the budget chose)."""
    rc, whole = gpu_check_main(capsys, "--dry-run", "--for-gpus", str(gpus))
    rc14, out = gpu_check_main(capsys, "--dry-run", "--for-gpus", str(gpus), "--minutes", "14")
    runs, skipped = planned(out)
    minutes = float(re.search(r"planned: .* estimated ([\d.]+) min", out).group(1))
    assert rc == rc14 == 0 and minutes <= 14, out
    names = list(runs)
    restart = "fp8 delayed restart (world 1)"
    assert restart in names and "fp8.py" in out.split(restart)[1].splitlines()[0], out
    if gpus == 1:
        assert not skipped and float(re.search(r"estimated ([\d.]+) min", whole).group(1)) <= 14
        return
    ours = [n for n in names if n.endswith(f"(world {gpus})") and any(k in n for k in N4_5)]
    for key, flag in N4_5.items():
        if key == ("ptdp cp " if gpus % 4 == 0 else "ptdp pp 2 x cp 2"):
            continue  # at 4 and 8 GPUs the ring inside pipeline stages; at 2, pp 1
        found = [n for n in ours if key in n]
        assert found, (key, out)
        listed = out.split(found[0])[1].splitlines()[0]  # the run's own line: its file and flags
        assert all(w in listed for w in flag.split()), (key, listed)
    assert len(ours) == 7 and names[:8] == ours + [restart], names[
        :10
    ]  # first: a budget cuts the end
    assert skipped and float(re.search(r"estimated ([\d.]+) min", whole).group(1)) > 14, whole[
        -300:
    ]


def test_gpu_check_reshard_verdict(capsys, monkeypatch, tmp_path):
    """zero.py's checkpoint saved at world N and resumed at N / 2: the second launch gets the first's
    --ckpt-dir at world N / 2, and passes only when its --check passes and it says it resumed from world
    N's checkpoint (a run that started afresh fails)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check

    job = next(j for j in gpu_check.jobs(4, False, 4) if j["kind"] == "reshard")
    for said, ok in (("(saved at world size 4)", True), ("", False)):
        calls = []

        def launch(w, f, flags, cpu, env=None, restarts=0, timeout=300):
            calls.append((w, f, flags[flags.index("--ckpt-dir") + 1]))
            return 0, f"resumed {said if len(calls) == 2 else ''} -> PASSED"

        monkeypatch.setattr(gpu_check, "launch", launch)
        gpu_check.FAILED.clear()
        gpu_check.run_reshard(job, True, tmp_path, 10)
        capsys.readouterr()
        assert [c[:2] for c in calls] == [(4, "zero.py"), (2, "zero.py")] and calls[0][2] == calls[
            1
        ][2]
        assert (not gpu_check.FAILED) == ok, said


def test_gpu_check_budget_and_rerun_verdicts(capsys, monkeypatch):
    """A real (non-dry) run under --minutes launches nothing that does not fit and gives each launch no more
    than the time left; the restart verdict: bit for bit when reruns agree bit for bit, else within 10 x
    their measured spread (a restart that differs while the runs are deterministic fails)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check

    timeouts = []
    monkeypatch.setattr(
        gpu_check,
        "launch",
        lambda w, f, flags, cpu, env=None, restarts=0, timeout=300: (
            timeouts.append(timeout),
            (0, "check vs one-process reference: max rel loss diff 0 -> PASSED"),
        )[1],
    )
    monkeypatch.setattr(gpu_check, "run_bench", lambda *a: timeouts.append("bench"))
    # zero.py's restart pair: recorded here, its verdict is checked below
    run_same = gpu_check.run_same
    monkeypatch.setattr(
        gpu_check, "run_same", lambda job, cpu, tmp, deadline: timeouts.append("same")
    )
    rc, out = gpu_check_main(
        capsys, "--cpu", "--one-gpu", "--only", "zero.py,bench.py", "--minutes", "0.4"
    )
    monkeypatch.setattr(gpu_check, "run_same", run_same)
    assert (
        rc == 0
        and "bench world 1 (world 1)" in out
        and "skipped" in out
        and "bench" not in timeouts
    ), out
    checks = [t for t in timeouts if t != "same"]
    # 2 zero.py runs, each <= 0.4 min
    assert len(checks) == 2 and all(t <= 24 for t in checks), timeouts
    job = dict(name="x", world=1, file="dp.py", a=[], b=[[]], restart=True)

    def verdict(a, b, again, killed=True):
        runs = iter([a, b, again])
        said = "simulated failure at step 3 ... resumed from" if killed else ""
        monkeypatch.setattr(gpu_check, "losses", lambda *args, **kw: (next(runs), said))
        gpu_check.FAILED.clear()
        gpu_check.run_same(job, True, None, 1e18)
        capsys.readouterr()
        return not gpu_check.FAILED

    assert verdict([4.0, 3.0], [4.0, 3.0], None)  # bit for bit: no third run
    # reruns agree bit for bit: it may not
    assert not verdict([4.0, 3.0], [4.0, 3.0 + 1e-9], [4.0, 3.0])
    # within 10 x a measured spread
    assert verdict([4.0, 3.0], [4.0, 3.0 + 1e-7], [4.0, 3.0 + 3e-8])
    assert not verdict([4.0, 3.0], [4.0, 3.1], [4.0, 3.0 + 3e-8])  # far outside it
    assert not verdict([4.0, 3.0], None, [4.0, 3.0])  # a restart that failed
    assert not verdict([4.0, 3.0], [4.0, 3.0], None, killed=False)  # equal, but nothing was killed


# ----------------------------------------------------------------------------- flags: HIDDEN
@dataclass
class Shown:
    width: int = 3  # a flag every file lists
    port: int = -1  # set by a launcher


class Hidden(Shown):
    HIDDEN = ("port",)


def help_of(parse_args, cls, capsys):
    with pytest.raises(SystemExit):
        parse_args(cls, ["--help"])
    return capsys.readouterr().out


HIDE = '        h = argparse.SUPPRESS if f.name in getattr(cls, "HIDDEN", ()) else h\n'


def test_hidden_flags_parse_but_are_not_listed(capsys):
    """parse_args leaves out of --help the fields a class names in HIDDEN (fault_tolerance.py's launcher-
    internal flags) and still parses them. A class without HIDDEN lists every field as
    before, and only fault_tolerance.py's Args has one: every other file's --help is unchanged. The mutant
    without the HIDDEN line (parse_args before issue 43) lists the hidden flag: caught."""
    shown, hidden = (
        help_of(harness.parse_args, Shown, capsys),
        help_of(harness.parse_args, Hidden, capsys),
    )
    port = next(line + "\n" for line in shown.splitlines() if line.startswith("  --port PORT"))
    assert "set by a launcher" in port and "--width" in hidden
    assert hidden == shown.replace(" [--port PORT]", "").replace(port, ""), hidden
    assert harness.parse_args(Hidden, ["--port", "5"]) == Hidden(3, 5)
    with_hidden = [
        f.name
        for f in sorted(ROOT.glob("*.py"))
        if re.search(r"^    HIDDEN = ", f.read_text(), re.M)
    ]
    assert with_hidden == ["fault_tolerance.py"], with_hidden
    src = inspect.getsource(harness.parse_args)
    assert src.count(HIDE) == 1
    before = dict(vars(harness))
    exec(src.replace(HIDE, ""), before)
    assert "--port" in help_of(before["parse_args"], Hidden, capsys)  # caught
