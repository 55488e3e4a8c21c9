"""plan.py against ptdp.py on its four axes (issue 41): per rank, byte for byte, the bytes handed to each
axis's collectives in a step (tp, cp, pp, dp x cp), the model state (parameters, gradients, optimizer state),
the peak bytes saved for backward and with each chunk's output held to its B, at three 4D layouts of world 8:
pp 2 x cp 2 x tp 2 (v 2), pp 2 x dp 2 x cp 2 with ZeRO-1, dp 2 x cp 2 x tp 2 with ZeRO-1 (pp 1). The runs are
tests/test_ptdp.py's (one launch; run alone, this file launches them). Each comparison is shown to fail when
plan.ptdp_4d_figures drops a term: the ring's backward dK/dV, the ZeRO-1 shard's own copy of its parameters,
the log-sum-exp the ring does not save."""

import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT))
import plan  # noqa: E402
import test_ptdp  # noqa: E402  (its launches, shared when both files run in one session)

LAYOUTS = ["pp2 cp2 tp2 v2", "pp2 dp2 cp2 zero1 clip", "dp2 cp2 tp2"]
KEYS = [
    "p2p_bytes",
    "tp_bytes",
    "cp_bytes",
    "dp_bytes",
    "world_bytes",
    "param_bytes",
    "grad_bytes",
    "optim_bytes",
    "act_peak",
    "held_peak",
]


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    return test_ptdp.shared_launch(tmp_path_factory)


def layout(summary):
    f, cfg = summary["figures"], summary["config"]
    M = plan.Model(
        layers=cfg["n_layers"],
        d=cfg["d_model"],
        heads=cfg["n_heads"],
        vocab=cfg["vocab"],
        seq=cfg["seq_len"],
    )
    lay = plan.Layout(
        dp=f["dp"],
        tp=f["tp"],
        pp=f["pp"],
        cp=f["cp"],
        v=f["virtual_stages"],
        m=f["microbatches"],
        zero=f["zero"],
        schedule="interleaved",
        precision="fp64",
        vocab_parallel=False,
        cp_attention="ring",
        outputs=True,
    )
    return M, lay, cfg["batch_size"]


def mismatches(summary):
    """[(rank, key, measured, planned)] over every rank of the run."""
    M, lay, B = layout(summary)
    out = []
    for key, got in summary["figures"]["counts_per_rank"].items():
        want = plan.ptdp_4d_figures(M, lay, B, int(key[2]))
        out += [(key, k, got[k], want[k]) for k in KEYS if got[k] != want[k]]
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_plan_equals_ptdp_byte_for_byte(launch, name):
    summary = launch(name)[0]
    assert not summary["config"]["ragged"]
    assert mismatches(summary) == []
    peaks = [
        sum(r[k] for k in ("param_bytes", "grad_bytes", "optim_bytes", "held_peak"))
        for r in summary["figures"]["counts_per_rank"].values()
    ]
    assert summary["peak_mem_bytes"] == max(peaks)


@pytest.mark.parametrize(
    "name, term, key",
    [
        ("pp2 cp2 tp2 v2", "ring dK/dV", "cp_bytes"),
        ("pp2 dp2 cp2 zero1 clip", "shard copy", "optim_bytes"),
        ("dp2 cp2 tp2", "log-sum-exp", "act_peak"),
    ],
)
def test_each_term_matters(launch, monkeypatch, name, term, key):
    """plan without one term differs from the measurement: the comparison can fail."""
    summary = launch(name)[0]
    real = plan.ptdp_4d_figures

    def dropped(M, lay, B, r):
        got = real(M, lay, B, r)
        if term == "ring dK/dV":
            got["cp_bytes"] = got["cp_bytes"] * 2 // 3
        elif term == "shard copy":
            got["optim_bytes"] -= 8 * (got["optim_bytes"] // 24)
        return got

    if term == "log-sum-exp":
        monkeypatch.setattr(plan, "ptdp_ring_unsaved", lambda *a: 0)
    else:
        monkeypatch.setattr(plan, "ptdp_4d_figures", dropped)
    assert any(k == key for _, k, _, _ in mismatches(summary))
