"""ddp_bucketed.py: parity with the one-process reference at world 1-4, the layer-level checks against torch's
DDP (tests/ddp_bucketed_checks.py, one launch per world size: gradients, bucket layout, overlap, gradients as
bucket views, and the core applied to a model that is not the GPT), compression, and bad input."""

import json
import re
import sys

import pytest
import torch

from helpers import (
    ROOT,
    TINY,
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
from common import GPT, GPTConfig  # noqa: E402

BUCKETS = [
    "--bucket-cap-mb",
    "0.01",
    "--first-bucket-mb",
    "0.002",
]  # MiB: several buckets for the TINY model
TINY_CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
PARAM_BYTES = sum(p.numel() for p in GPT(TINY_CFG).parameters()) * 8  # float64


@pytest.mark.parametrize("nproc,extra", [(1, []), (2, []), (3, ["--ragged"]), (4, ["--ragged"])])
def test_matches_reference(tmp_path, nproc, extra):
    """Global batch 12 split 12/6/4/3 per rank; ragged targets give the ranks unequal token counts, which
    only the global-token-count loss (backpropagated N * L_r, then averaged) gets exactly right."""
    args = [*TINY, *BUCKETS, *extra, "--check"]
    if nproc == 1:  # plain `python ddp_bucketed.py`, no torchrun
        p = run_python("ddp_bucketed.py", *args, "--json", tmp_path / "w1.json", timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        summary, out = json.loads((tmp_path / "w1.json").read_text()), p.stdout
    else:
        summary, out = torchrun("ddp_bucketed.py", nproc, *args, tmp_path=tmp_path)
    assert_matches_reference(summary)
    f = summary["figures"]
    assert f["buckets"] >= 3 and sum(f["bucket_bytes"]) == PARAM_BYTES, f
    assert summary["comm_bytes"] == f["allreduce_payload_bytes_per_step"] == PARAM_BYTES, f
    # the last bucket can never overlap
    assert f["ring_bytes_sent_per_rank_theory"] == pytest.approx(
        2 * (nproc - 1) / nproc * PARAM_BYTES
    )
    assert 1 <= f["launched_before_backward_end"] < f["buckets"], f
    # timing-dependent: see the checks script
    assert 0 <= f["completed_before_backward_end"] <= f["buckets"], f
    assert summary["losses"][-1] < summary["losses"][0]
    assert "theory" in out and "launched before backward finished" in out


def test_compress_bf16(tmp_path):
    """Gradients travel in bf16; --check compares with a one-process run of the same recipe (rounded to bf16,
    divided, summed in bf16), exact on 2 ranks. Dropping any one bucket fails it: ddp_bucketed_checks.py."""
    summary, out = torchrun(
        "ddp_bucketed.py", 2, *TINY, *BUCKETS, "--compress", "bf16", "--check", tmp_path=tmp_path
    )
    assert_matches_reference(summary)  # 1e-9: the same arithmetic
    assert summary["comm_bytes"] * 4 == PARAM_BYTES  # 2 bytes on the wire per float64 gradient
    assert summary["losses"][-1] < summary["losses"][0]


def test_restart_rebuilds_the_same_buckets(tmp_path):
    """A rank dies at step 3 of 6 (world 2, the arrival-order buckets built after step 0): the restarted run
    resumes from step 2 with the same bucket layout at every step, and ends with the uninterrupted run's
    losses and final parameters, bit for bit."""
    args = [*TINY, *BUCKETS, "--ragged", "--steps", "6"]
    full, _ = torchrun(
        "ddp_bucketed.py", 2, *args, "--ckpt-dir", tmp_path / "full", tmp_path=tmp_path, name="full"
    )
    rs, out = torchrun(
        "ddp_bucketed.py",
        2,
        *args,
        "--ckpt-dir",
        tmp_path / "rs",
        "--save-every",
        "2",
        "--fail-at-step",
        "3",
        tmp_path=tmp_path,
        name="rs",
        max_restarts=1,
    )
    assert "simulated failure at step 3" in out and "at step 2" in out, out[-3000:]
    assert rs["losses"] == full["losses"]
    layouts = full["figures"]["bucket_order_per_step"]
    assert layouts[0] != layouts[1]  # the rebuild after step 0 changed the layout...
    # ...and the restart kept the rebuilt one
    assert rs["figures"]["bucket_order_per_step"] == layouts[2:]
    # the bucket layout, checkpointed beside the model
    a, b = (
        torch.load(tmp_path / k / "rank0" / "step6.pt", weights_only=False) for k in ("full", "rs")
    )
    assert a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][n], b["model"][n]) for n in a["model"]
    )
    assert a["buckets"] == b["buckets"] and a["buckets"]["order"]


@pytest.fixture(scope="module", params=[2, 3])
def checks(request):
    """tests/ddp_bucketed_checks.py at world 2 and 3, once each for the tests below: its "ok ..." lines."""
    return check_lines("tests/ddp_bucketed_checks.py", request.param, timeout=240)


def test_layer_checks_vs_torch_ddp(checks):
    """vs torch DDP: gradients, AdamW steps, no_sync, bucket layout, rebuild, overlap (launched and
    completed), unused parameters (error, find_unused_parameters, and both with no_sync), fp16/bf16
    compression, and --compress --check failing with any one bucket dropped; see the checks script (every
    check there must pass for the fixture to return)."""
    assert passed(checks, "after 3 AdamW steps: parameters == torch DDP's"), checks
    assert passed(checks, "--compress bf16 --check FAILS without bucket 0"), checks


def test_buckets_are_torch_ddps(checks):
    """DDP's cut rule (close a bucket once it reaches the cap): at two caps, the same buckets as torch DDP's
    rebuilt ones, parameter for parameter, read from DDP's reducer (its comm hook's GradBucket objects and
    its logging data); the rule before issue 21 (close before passing the cap) gives other counts."""
    for cap in ("0.01", "0.004"):
        assert passed(
            checks, f"cap {cap} MiB:", "the same parameters in the same order as torch DDP's"
        ), checks
        assert passed(
            checks, f"cap {cap} MiB: negative: closing a bucket before it passes the cap"
        ), checks


def test_gradients_live_in_the_buckets(checks):
    """Every .grad shares its storage with its bucket's buffer (DDP's gradient_as_bucket_view); with
    zero_grad(set_to_none=False) no gradient is copied into a bucket (0 copy_ calls into the buffers, counted
    at the dispatcher), with set_to_none=True each once; gradients copied out of the buckets fail the check."""
    assert passed(
        checks,
        "gradients live in the buckets: 31/31 share their bucket's storage",
        "copies into the buckets per backward [31, 31, 0, 0]",
    ), checks
    assert passed(checks, "negative: gradients copied out of the buckets: 0 share storage"), checks


def test_copy_out_bucketed_ddp(checks):
    """BucketedDDP, from ddp_bucketed.py's technique section run alone (section.load), on a model that is not
    the GPT (nested modules, a root parameter, odd sizes, a Huber loss, gradient accumulation under no_sync,
    clipping) == plain one-process training written in the checks script (1e-12); the same model trained on
    one rank's rows alone differs (the comparison can fail)."""
    assert passed(
        checks, "copy-out: BucketedDDP on a non-GPT model", "== plain one-process training"
    ), checks
    assert passed(
        checks, "copy-out: negative: the same model trained on this rank's rows alone differs"
    ), checks


def test_core_refuses_bad_input_before_any_collective(checks):
    """BucketedDDP from the technique section alone, given a cap of 0, -1 or nan MiB, an integer wire dtype or a
    module with nothing to train: a ValueError saying what would work, no collective seen by
    harness.CommCounter; a valid one under the same counter broadcasts, and the section with its checks taken
    out lets all five through."""
    for what in (
        "bucket_cap_mb 0",
        "first_bucket_mb -1",
        "bucket_cap_mb nan",
        "compress int8",
        "no trainable parameter",
    ):
        assert passed(
            checks,
            f"bad input: BucketedDDP, {what}: refused before any collective",
            "collectives: {}",
        ), (what, checks)
    assert passed(checks, "bad input: the core's refusals name no command-line flag ([])"), checks
    assert passed(
        checks, "bad input: negative: a valid BucketedDDP under the same counter broadcasts"
    ), checks
    assert passed(
        checks, "bad input: negative: the section without its checks lets 5/5 of them through"
    ), checks


def test_bad_batch_split():
    assert_each_rank_fails(
        run_ranks("ddp_bucketed.py", 2, *TINY, "--batch-size", "7"),
        ["--batch-size 7", "world size 2"],
    )
    # the same through torchrun: its agent stops the slower workers once one exits (-15), so every rank's
    # own exit code is not always observable there; the first one is, and nothing prints a traceback
    p = torchrun_bad_input("ddp_bucketed.py", 2, *TINY, "--batch-size", "5", timeout=300)
    out = p.stdout + p.stderr
    codes = re.findall(r"exitcode\s*:\s*(-?\d+) ", out)
    assert p.returncode == 1 and "2" in codes and set(codes) <= {"2", "-15"}, out
    assert (
        "not divisible by the world size 2" in out
        and "Traceback" not in out.split("torch/distributed/elastic")[0]
    )


def test_bad_bucket_cap():
    assert_each_rank_fails(
        run_ranks("ddp_bucketed.py", 2, *TINY, "--bucket-cap-mb", "0"),
        ["--bucket-cap-mb=0", "positive"],
    )
    p = run_python("ddp_bucketed.py", *TINY, "--first-bucket-mb", "nan")
    assert (
        p.returncode == 2 and "--first-bucket-mb=nan" in p.stderr and "Traceback" not in p.stderr
    ), p.stderr
