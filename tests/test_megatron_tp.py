"""megatron_tp.py: layer-level checks at t = 2 and 4 (one launch each), model-level parity with the
one-process reference at t = 1, 2, 4 with and without sequence parallelism and with 2-way data
parallelism, counted collectives against the closed-form count, dropout, and bad input."""
import json

import pytest

from helpers import TINY, assert_each_rank_fails, assert_matches_reference, run_python, run_ranks, torchrun

SCRIPT = "megatron_tp.py"
MODEL = [*TINY, "--n-heads", "4"]  # 4 heads so that t = 4 gets whole heads; the same model for every t
L, B, S, H = 2, 12, 8, 16  # TINY's layers, global batch, sequence, width


@pytest.mark.parametrize("nproc", [2, 4])
def test_layer_checks(tmp_path, nproc):
    """Column / row / MLP / attention / embedding outputs and gradients vs unsharded modules, the
    vocab-parallel loss vs F.cross_entropy (padded and unpadded), the MLP vs torch's DTensor TP, dropout
    masks, and each layer's collective count: all asserted inside tests/megatron_tp_checks.py."""
    _, out = torchrun("tests/megatron_tp_checks.py", nproc, tmp_path=tmp_path, timeout=240)
    assert "ALL CHECKS PASSED" in out, out[-6000:]
    assert "DTensor reference skipped" not in out, out[-3000:]


def assert_tp_run(s, t, dp, sp):
    """Parity, counted collectives == the closed-form count, parameters per rank, replicas identical."""
    assert_matches_reference(s)
    f = s["figures"]
    assert (f["tp"], f["dp"], f["sequence_parallel"]) == (t, dp, sp)
    counted, theory = f["collectives_per_step"], f["collectives_per_step_theory"]
    assert counted == theory, (counted, theory)
    assert s["comm_bytes"] == sum(c[2] for c in theory.values())
    bsh = B // dp * S * H
    if t > 1:  # the paper's count, written here independently: per layer 2 + 2 of b*s*h, plus embedding / head
        if sp:
            for key in ("all_gather/tp/fwd", "reduce_scatter/tp/fwd", "reduce_scatter/tp/bwd", "all_gather/tp/bwd"):
                assert counted[key][:2] == [2 * L + 1, (2 * L + 1) * bsh], (key, counted)
            assert "all_reduce/tp/bwd" not in counted
        else:
            assert counted["all_reduce/tp/bwd"][:2] == [2 * L + 1, (2 * L + 1) * bsh], counted
            assert counted["all_reduce/tp/fwd"][:2] == [2 * L + 1 + 3, (2 * L + 1) * bsh + 3 * B // dp * S], counted
    else:
        assert not any("/tp/" in k for k in counted), counted
    assert f["param_bytes_per_rank"] == f["param_bytes_per_rank_theory"]
    mine, whole = f["param_bytes_per_rank"], f["param_bytes_full_model"]
    assert mine * t >= whole and (mine < whole if t > 1 else mine == whole), (mine, whole)  # ~1/t, + replicated
    assert f["replicated_param_spread_across_tp"] == 0.0


def test_world1_is_the_reference(tmp_path):
    out = tmp_path / "t1.json"
    p = run_python(SCRIPT, *MODEL, "--check", "--json", out, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_tp_run(json.loads(out.read_text()), 1, 1, False)


@pytest.mark.parametrize("nproc,extra,t,dp,sp", [
    (2, ["--ragged"], 2, 1, False),
    (4, ["--vocab", "30"], 4, 1, False),  # 30 is padded to 32 over 4 ranks
    (2, ["--sequence-parallel"], 2, 1, True),
    (4, ["--sequence-parallel", "--vocab", "30", "--ragged"], 4, 1, True),
    (4, ["--tp", "2", "--ragged"], 2, 2, False),  # 2-way data parallel
], ids=["t2", "t4-padded-vocab", "t2-sp", "t4-sp-padded", "tp2-dp2"])
def test_matches_reference(tmp_path, nproc, extra, t, dp, sp):
    s, _ = torchrun(SCRIPT, nproc, *MODEL, *extra, "--check", tmp_path=tmp_path, timeout=240)
    assert_tp_run(s, t, dp, sp)


def test_dropout(tmp_path):
    """With dropout (replicated regions on the shared RNG stream, TP regions on the per-rank one) the
    replicated LayerNorms / biases / positions stay bit-identical across TP ranks; and dropout did act:
    --check now fails, since the one-process reference draws other masks."""
    s, _ = torchrun(SCRIPT, 2, *MODEL, "--dropout", "0.2", "--check", tmp_path=tmp_path, timeout=240, expect_rc=1)
    assert s["figures"]["replicated_param_spread_across_tp"] == 0.0
    assert not s["check"]["passed"] and s["check"]["max_loss_diff"] > 1e-4, s["check"]


@pytest.mark.parametrize("nproc,args,words", [
    (1, ["--tp", "2"], ["world size 1 is not divisible by --tp 2"]),
    (2, ["--n-heads", "1"], ["--n-heads 1 is not divisible by the TP degree 2"]),
    (2, ["--n-heads", "4", "--seq-len", "7", "--sequence-parallel"],
     ["--sequence-parallel", "--seq-len 7", "divisible"]),
], ids=["world1-tp2", "heads", "sp-seq-len"])
def test_bad_input(nproc, args, words):
    """Each rank says one line naming the problem and exits 2, before any collective."""
    assert_each_rank_fails(run_ranks(SCRIPT, nproc, *TINY, *args, timeout=120), words)
