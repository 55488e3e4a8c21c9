"""dp.py: bulk-synchronous and accumulated data parallel equal one-process training; the asynchronous
parameter server equals its own delayed-update reference; bad input fails fast; a resumed run continues
to exactly the losses of an uninterrupted one. tests/dp_checks.py (one launch at world 3) applies the cores
to a model that is not the GPT, and holds the negatives that need code from tests/."""

import copy
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    ROOT,
    TINY,
    assert_bad_input,
    assert_each_rank_fails,
    assert_matches_reference,
    check_lines,
    passed,
    run_python,
    run_ranks,
    torchrun,
    torchrun_bad_input,
)

sys.path.insert(0, str(ROOT))
from common import GPT, GPTConfig, MarkovData, build_gpt  # noqa: E402  (the model and data, not dp.py)

TINY_CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
PARAM_BYTES = sum(p.numel() for p in GPT(TINY_CFG).parameters()) * 8  # float64


def test_sync_world_1_with_ragged_accumulation():
    # world 1: the plain `python dp.py` path, 3 micro-batches of unequal token counts
    p = run_python("dp.py", *TINY, "--accum", "3", "--ragged", "--check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASSED" in p.stdout


@pytest.mark.parametrize("world, accum", [(4, 3)])  # world 3, accum 2: tests/dp_checks.py
def test_sync_matches_reference(tmp_path, world, accum):
    s, _ = torchrun(
        "dp.py", world, *TINY, "--accum", accum, "--ragged", "--check", tmp_path=tmp_path
    )
    assert_matches_reference(s)
    n_tensors = len(list(GPT(TINY_CFG).parameters()))
    # counted at the calls: one per tensor, the naive way
    assert s["figures"]["all_reduces_per_step"] == n_tensors


def test_world_2_ragged_accumulation_resume_and_restart(tmp_path):
    """One 10-step run is the reference for parity, for a stop-and-resume, and for a crash-and-restart."""
    common = [*TINY, "--accum", "2", "--ragged"]
    args = [*common, "--steps", "10"]
    full, _ = torchrun("dp.py", 2, *args, "--check", tmp_path=tmp_path, name="full")
    assert_matches_reference(full)
    # stop after step 6, then restart with --steps 10 from the checkpoint
    ck = tmp_path / "ck"
    torchrun(
        "dp.py",
        2,
        *common,
        "--steps",
        "6",
        "--ckpt-dir",
        ck,
        "--save-every",
        "3",
        tmp_path=tmp_path,
        name="first6",
    )
    resumed, out = torchrun("dp.py", 2, *args, "--ckpt-dir", ck, tmp_path=tmp_path, name="resumed")
    assert "resumed from" in out and "at step 6" in out
    assert resumed["losses"] == full["losses"]  # exactly: the same arithmetic, the same data
    # a rank dies at step 5 on the first attempt; torchrun restarts every rank from the step-4 checkpoint
    ck2 = tmp_path / "ck2"
    restarted, out = torchrun(
        "dp.py",
        2,
        *args,
        "--ckpt-dir",
        ck2,
        "--save-every",
        "2",
        "--fail-at-step",
        "5",
        tmp_path=tmp_path,
        name="restarted",
        max_restarts=1,
    )
    assert "simulated failure at step 5" in out and "at step 4" in out
    assert restarted["losses"] == full["losses"]


@pytest.fixture(scope="module")
def checks():
    """tests/dp_checks.py at world 3, once for the tests below: its lines "ok ..." / "FAIL ..."."""
    return check_lines("tests/dp_checks.py", 3, timeout=300)


def test_copy_out_sync_step(checks):
    """sync_step, from dp.py's technique section run alone (section.load), on a model that is not the GPT
    (nested modules, a root parameter, odd sizes, a Huber loss, 2 micro-batches per rank at world 3) == plain
    one-process training written in the checks (1e-12); the same step whose all-reduce reaches only its own
    rank differs (the comparison can fail)."""
    assert passed(
        checks, "copy-out sync_step", "== plain one-process training", "replicas identical"
    ), checks
    assert passed(checks, "copy-out sync_step", "negative", "differs"), checks


def test_copy_out_parameter_server(checks):
    """Server + worker_loop (the section alone) on that model: bound 0 == plain training, lockstep 1 == the
    one-step-delayed update, both written in the checks (1e-12); lockstep 1 differs from plain training.
    Review R3: the server's receives, logged in order, post each gradient's receive only after that worker's
    report arrived on the side group (so on NCCL at most one receive is live); the order check rejects a
    gradient received before its report."""
    assert passed(checks, "BoundedStaleness(0): each of the", "after its worker's report ([])"), (
        checks
    )
    assert passed(checks, "Lockstep(1): each of the", "after its worker's report ([])"), checks
    assert passed(checks, "negative: a gradient received before its report"), checks
    assert passed(
        checks, "BoundedStaleness(0)", "[0.0, 1.0, 2.0, 3.0, 4.0]", "== plain one-process training"
    ), checks
    assert passed(
        checks, "Lockstep(1)", "[0.0, 0.0, 1.0, 2.0, 3.0]", "== the one-step-delayed update"
    ), checks
    assert passed(checks, "Lockstep(1)", "negative", "differs"), checks


def test_per_microbatch_mean_is_caught(checks):
    """The widespread bug (mean over each micro-batch's own tokens, a sync_step monkeypatched in the checks)
    must FAIL dp.py's --check on ragged data (loss diff > 1e-3), and be harmless without padding only up to
    roundoff (every micro-batch then has the same count); the right step passes at world 3, accum 2, ragged,
    with one all-reduce per tensor."""
    assert passed(
        checks, "--accum 2 --ragged --check: PASSED", "all-reduces per step (one per tensor"
    ), checks
    line = passed(checks, "negative: the per-micro-batch mean on ragged data FAILS --check")
    assert line and float(re.search(r"loss diff ([\d.e+-]+)\)", line[0]).group(1)) > 1e-3, checks
    assert passed(checks, "per-micro-batch mean without padding passes --check"), checks


def test_server_keeps_one_sent_copy_per_worker(checks):
    """The weight copies a server has sent and still holds, counted from outside (weak references to every
    tensor handed to a send): one per pull in flight, not one per update (a kept send is caught)."""
    assert passed(
        checks, "--staleness 1: sent weight copies alive at most 2 (one per pull in flight: 2)"
    ), checks
    assert passed(
        checks, "negative: a server that keeps every send is caught: 8 weight copies alive"
    ), checks


def test_cores_refuse_bad_input_before_any_collective(checks):
    """Each core of dp.py's technique section (run alone) given what it cannot do raises a ValueError that says
    what would work, with no collective seen by harness.CommCounter; a valid call under the same counter is
    seen sending, and the section with its checks taken out lets every bad call through."""
    for what in (
        "sync_step, no micro-batches",
        "sync_step, a parameter the loss does not reach",
        "Lockstep(-1)",
        "BoundedStaleness(-1)",
        "Server, no workers (a world of 1)",
        "Server, Lockstep(2) on 2 workers",
        "worker_loop on the whole world",
        "worker_loop on a one-rank group",
    ):
        assert passed(
            checks, f"bad input: {what}: refused before any collective", "collectives: {}"
        ), (what, checks)
    assert passed(
        checks, "bad input: negative: a valid sync_step under the same counter sends", "all_reduce"
    ), checks
    assert passed(
        checks, "bad input: negative: the section without its checks lets 6/6 of them through"
    ), checks


@pytest.mark.parametrize("world, D", [(2, 0), (3, 1), (4, 2)])
def test_async_lockstep_equals_delayed_update_reference(tmp_path, world, D):
    """World 3 also restarts: a worker dies at step 5 of 8, and the server resumes from its step-4 checkpoint
    (the model, AdamW, and the last D weight versions still in flight) to the uninterrupted run's losses
    and final parameters, bit for bit."""
    steps = ["--steps", "8" if world == 3 else "6"]
    ck = ["--ckpt-dir", tmp_path / "full"] if world == 3 else []
    s, _ = torchrun(
        "dp.py",
        world,
        *TINY,
        *steps,
        "--mode",
        "async",
        "--staleness",
        D,
        "--check",
        *ck,
        tmp_path=tmp_path,
    )
    assert_matches_reference(s)
    f = s["figures"]
    n = len(s["losses"])
    assert f["used_versions"] == [
        max(t - D, 0) for t in range(n)
    ]  # exactly D stale after the start
    assert f["staleness_max"] == D
    # measured at the sends: the weights, at least
    assert f["server_bytes_sent_per_update"] >= PARAM_BYTES
    assert f["sent_weight_copies_alive_max"] == min(world - 1, D + 1)  # one per pull in flight
    if world == 3:
        rs, out = torchrun(
            "dp.py",
            3,
            *TINY,
            *steps,
            "--mode",
            "async",
            "--staleness",
            D,
            "--ckpt-dir",
            tmp_path / "rs",
            "--save-every",
            "2",
            "--fail-at-step",
            "5",
            tmp_path=tmp_path,
            name="rs",
            max_restarts=1,
        )
        assert "simulated failure at step 5" in out and "at step 4" in out, out[-3000:]
        assert rs["losses"] == s["losses"] and rs["figures"]["used_versions"] == f["used_versions"]
        a, b = (
            torch.load(tmp_path / k / "rank0" / "step8.pt", weights_only=False)["model"]
            for k in ("full", "rs")
        )
        assert all(torch.equal(a[k], b[k]) for k in a)
    # stale gradients are not synchronous training: the one-process sync reference differs
    if D > 0:
        sync, _ = torchrun("dp.py", 1, *TINY, "--steps", "6", tmp_path=tmp_path, name="sync")
        assert sync["losses"][0] == pytest.approx(s["losses"][0], rel=1e-12)  # both start from W_0
        assert max(abs(a - b) for a, b in zip(sync["losses"], s["losses"])) > 1e-4


def replay_async(used, batch_ids, lr):
    """The update rule, written here from torch alone: W_{t+1} = AdamW(W_t, clip(grad of batch b_t at W_{used_t}));
    returns the loss of each gradient. Independent of dp.py's code and of its --check."""
    data, model, stale = (
        MarkovData(32, 0),
        build_gpt(TINY_CFG, 0, torch.float64),
        build_gpt(TINY_CFG, 0, torch.float64),
    )
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False
    )
    versions, losses = [copy.deepcopy(model.state_dict())], []
    for v, b in zip(used, batch_ids):
        stale.load_state_dict(versions[v])
        x, y = data.batch(b, 12, 8)
        # no padding: the mean over tokens
        loss = F.cross_entropy(stale(x).flatten(0, 1), y.flatten())
        for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(stale.parameters()))):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        versions.append(copy.deepcopy(model.state_dict()))
        losses.append(loss.item())
    return losses


def test_async_free_running_holds_a_staleness_bound_below_workers(tmp_path):
    """Three workers, the slowest 3x slower than the fastest, bound 1 < W - 1 = 2: three workers pulling the
    same weights at once would already reach staleness 2, so the server must make workers wait (SSP)."""
    s, _ = torchrun(
        "dp.py",
        4,
        *TINY,
        "--steps",
        "30",
        "--lr",
        "1e-2",
        "--mode",
        "async",
        "--max-staleness",
        "1",
        "--delay-ms",
        "15",
        "--check",
        tmp_path=tmp_path,
    )
    f = s["figures"]
    stale = [
        t - v for t, v in enumerate(f["used_versions"])
    ]  # versions reported by the workers themselves
    assert max(stale) <= 1 == f["staleness_bound"] and f["staleness_max"] == max(stale), stale
    assert max(stale) == 1  # two in flight: gradients do arrive stale
    assert sorted(f["batch_ids"]) == list(range(30))  # every batch applied exactly once
    # at most S + 1 pulls in flight, measured from outside
    assert f["sent_weight_copies_alive_max"] <= 2
    assert_matches_reference(s)  # dp.py's own replay
    replay = replay_async(f["used_versions"], f["batch_ids"], 1e-2)
    # each loss was computed on W_used
    assert max(abs(a - b) / b for a, b in zip(s["losses"], replay)) <= 1e-9
    # negative: every gradient on the newest weights
    fresh = replay_async(list(range(30)), f["batch_ids"], 1e-2)
    assert max(abs(a - b) / b for a, b in zip(s["losses"], fresh)) > 1e-6
    first, last = sum(s["losses"][:5]) / 5, sum(s["losses"][-5:]) / 5
    assert last < first - 0.2, s["losses"]


def test_bad_input_exits_2_with_one_line():
    for args, words in [
        (["--accum", "0"], ["--accum"]),
        (["--mode", "nope"], ["--mode", "nope"]),
        (["--mode", "async"], ["async", "nproc_per_node"]),
    ]:
        # a bound against a hang; 30 s timed out at load 25
        p = run_python("dp.py", *args, timeout=120)
        assert_bad_input(p, 1, words)
    p = torchrun_bad_input("dp.py", 2, "--batch-size", "7", timeout=120)
    assert_bad_input(p, 2, ["--batch-size 7", "divisible"])
    # free-running cannot resume exactly
    p = torchrun_bad_input("dp.py", 2, "--mode", "async", "--ckpt-dir", "unused", timeout=120)
    assert_bad_input(p, 2, ["--ckpt-dir", "--staleness", "race"])
    # the cores' own messages (check_args calls check_workers and the policy's constructor), on every rank
    for args, words in [
        (["--staleness", "2"], ["Lockstep(D=2) needs at least 3 worker(s)", "nproc_per_node=4"]),
        (["--max-staleness", "-1"], ["BoundedStaleness: S must be >= 0", "got -1"]),
    ]:
        assert_each_rank_fails(run_ranks("dp.py", 3, "--mode", "async", *args, timeout=120), words)
