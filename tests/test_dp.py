"""dp.py: bulk-synchronous and accumulated data parallel equal one-process training; the asynchronous
parameter server equals its own delayed-update reference; bad input fails fast; a resumed run continues
to exactly the losses of an uninterrupted one."""

import pytest

from helpers import TINY, assert_bad_input, assert_matches_reference, run_python, torchrun, torchrun_bad_input


def test_sync_world_1_with_ragged_accumulation():
    # world 1: the plain `python dp.py` path, 3 micro-batches of unequal token counts
    p = run_python("dp.py", *TINY, "--accum", "3", "--ragged", "--check")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASSED" in p.stdout


@pytest.mark.parametrize("world, accum", [(3, 2), (4, 3)])
def test_sync_matches_reference(tmp_path, world, accum):
    s, _ = torchrun("dp.py", world, *TINY, "--accum", accum, "--ragged", "--check", tmp_path=tmp_path)
    assert_matches_reference(s)
    assert s["figures"]["all_reduces_per_step"] == 2 + 2 * 13 + 3  # one per parameter tensor: the naive way


def test_world_2_ragged_accumulation_resume_and_restart(tmp_path):
    """One 10-step run is the reference for parity, for a stop-and-resume, and for a crash-and-restart."""
    common = [*TINY, "--accum", "2", "--ragged"]
    args = [*common, "--steps", "10"]
    full, _ = torchrun("dp.py", 2, *args, "--check", tmp_path=tmp_path, name="full")
    assert_matches_reference(full)
    # stop after step 6, then restart with --steps 10 from the checkpoint
    ck = tmp_path / "ck"
    torchrun("dp.py", 2, *common, "--steps", "6", "--ckpt-dir", ck, "--save-every", "3",
             tmp_path=tmp_path, name="first6")
    resumed, out = torchrun("dp.py", 2, *args, "--ckpt-dir", ck, tmp_path=tmp_path, name="resumed")
    assert "resumed from" in out and "at step 6" in out
    assert resumed["losses"] == full["losses"]  # exactly: the same arithmetic, the same data
    # a rank dies at step 5 on the first attempt; torchrun restarts every rank from the step-4 checkpoint
    ck2 = tmp_path / "ck2"
    restarted, out = torchrun("dp.py", 2, *args, "--ckpt-dir", ck2, "--save-every", "2", "--fail-at-step", "5",
                              tmp_path=tmp_path, name="restarted", max_restarts=1)
    assert "simulated failure at step 5" in out and "at step 4" in out
    assert restarted["losses"] == full["losses"]


def test_per_microbatch_mean_is_caught(tmp_path):
    """The widespread bug (mean over each micro-batch's own tokens) must FAIL the check on ragged data,
    and be harmless without padding only up to roundoff (every micro-batch then has the same count)."""
    s, out = torchrun("dp.py", 2, *TINY, "--accum", "2", "--ragged", "--loss-norm", "per_microbatch", "--check",
                      tmp_path=tmp_path, expect_rc=1, name="bug")
    assert s["check"]["passed"] is False and s["check"]["max_loss_diff"] > 1e-3, s["check"]
    s, _ = torchrun("dp.py", 2, *TINY, "--accum", "2", "--loss-norm", "per_microbatch", "--check",
                    tmp_path=tmp_path, name="nobug")
    assert_matches_reference(s)


@pytest.mark.parametrize("world, D", [(2, 0), (3, 1), (4, 2)])
def test_async_lockstep_equals_delayed_update_reference(tmp_path, world, D):
    s, _ = torchrun("dp.py", world, *TINY, "--steps", "6", "--mode", "async", "--staleness", D, "--check",
                    tmp_path=tmp_path)
    assert_matches_reference(s)
    f = s["figures"]
    assert f["used_versions"] == [max(t - D, 0) for t in range(6)]  # exactly D stale after the start
    assert f["staleness_max"] == D
    if D > 0:  # stale gradients are not synchronous training: the one-process sync reference differs
        sync, _ = torchrun("dp.py", 1, *TINY, "--steps", "6", tmp_path=tmp_path, name="sync")
        assert sync["losses"][0] == pytest.approx(s["losses"][0], rel=1e-12)  # both start from W_0
        assert max(abs(a - b) for a, b in zip(sync["losses"], s["losses"])) > 1e-4


def test_async_free_running_trains_within_staleness_bound(tmp_path):
    s, _ = torchrun("dp.py", 4, *TINY, "--steps", "30", "--lr", "1e-2", "--mode", "async", "--max-staleness", "3",
                    "--delay-ms", "15", "--check", tmp_path=tmp_path)
    f = s["figures"]
    assert 0 <= f["staleness_min"] <= f["staleness_mean"] <= f["staleness_max"] <= 3 == f["staleness_bound"]
    assert f["staleness_max"] >= 1  # three workers: gradients do arrive stale
    assert sorted(f["batch_ids"]) == list(range(30))  # every batch applied exactly once
    assert_matches_reference(s)  # replaying the staleness it saw, in one process, gives the same run
    first, last = sum(s["losses"][:5]) / 5, sum(s["losses"][-5:]) / 5
    assert last < first - 0.2, s["losses"]


def test_bad_input_exits_2_with_one_line():
    for args, words in [(["--accum", "0"], ["--accum"]), (["--mode", "nope"], ["--mode", "nope"]),
                        (["--mode", "async"], ["async", "nproc_per_node"])]:
        p = run_python("dp.py", *args, timeout=30)
        assert_bad_input(p, 1, words)
    p = torchrun_bad_input("dp.py", 2, "--batch-size", "7")
    assert_bad_input(p, 2, ["--batch-size 7", "divisible"])
