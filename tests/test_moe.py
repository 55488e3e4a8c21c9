"""moe.py: layer-level checks in one 4-rank launch (EP 1/2/4 parity for every router, dispatch/combine,
hand-written routing, load balancing, training toward the floor: tests/moe_checks.py); the command line
at EP 2 with replicas and at EP 2 after a restart, both equal to the one-process reference with the same
routing groups, and to a plain world-1 run; the summary's figures beside their theory; bad input exits 2."""
import json

import pytest

import helpers
from helpers import (TINY, assert_bad_input, assert_each_rank_fails, assert_matches_reference, run_python, run_ranks,
                     torchrun)


def test_layer_checks(tmp_path):
    _, out = torchrun("tests/moe_checks.py", 4, tmp_path=tmp_path, name="checks", timeout=400)
    assert "ALL CHECKS PASSED" in out and "FAIL" not in out, out[-6000:]
    assert out.count("PASS  parity") == 12, out[-6000:]  # 4 routers x EP 1, 2, 4


def test_replicas_x_ep_gshard_figures(tmp_path):
    """World 4 = 2 replicas x EP 2, MoE in every other block, 4 routing groups: equals the one-process
    reference, and the summary's numbers agree with each other and with their theory."""
    s, out = torchrun("moe.py", 4, *TINY, "--router", "gshard", "--ep", "2", "--moe-every", "2",
                      "--capacity-factor", "1.0", "--check", tmp_path=tmp_path, name="gshard")
    assert_matches_reference(s)
    f, cfg = s["figures"], s["config"]
    assert (f["ep"], f["replicas"], f["groups"], f["tokens_per_group"], f["capacity"]) == (2, 2, 4, 24, 12), f
    assert len(f["expert_load"]) == 1  # 2 layers, MoE in block 1 only
    load = f["expert_load"][0]
    tokens = cfg["batch_size"] * cfg["seq_len"]
    assert all(0 <= l <= f["groups"] * f["capacity"] for l in load), f  # never past G x C slots
    assert f["expert_load_theory_balanced"] == tokens * 2 / cfg["experts"]
    # a token with no expert lost at least one of its (at most 2) wanted assignments
    assert 0 <= f["dropped_frac"] < 1 and f["tokens_without_expert_frac"] <= 2 * f["dropped_frac"], f
    # 4 all-to-alls per MoE layer per step (dispatch, combine, and their backward), each sending the
    # (E, G/W, C, D) buffer's other-rank half: 4 x 1 x (1/2) x 4 x 1 x 12 x 16 x 8 bytes.
    assert s["comm_bytes"] == f["alltoall_bytes_per_step"] == f["alltoall_bytes_theory"] == 4 * 4 * 12 * 16 * 8 // 2
    for total, lm, aux in zip(s["losses"], f["lm_losses"], f["aux_losses"]):
        assert abs(total - (lm + cfg["aux_weight"] * aux)) < 1e-12 and aux > 0
    assert "expert load, MoE layer 0" in out and "all-to-all bytes sent / step / rank" in out


def test_ep2_restart_equals_one_process(tmp_path, monkeypatch):
    """noisy_topk (random noise from (seed, step, layer, row)) with padding, killed at step 2 and resumed
    from its checkpoints, at EP 2 with 4 routing groups: equals the reference, and a plain world-1 run with
    --groups 4 gives the same losses."""
    # torchrun's agent keeps one TCPStore across restarts, so the restarted gloo ranks can read the dead
    # attempt's addresses (connection refused, or a hang). With this set, every attempt gets a fresh store.
    monkeypatch.setitem(helpers.ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    s, out = torchrun("moe.py", 2, *TINY, "--router", "noisy_topk", "--groups", "4", "--ragged", "--check",
                      "--ckpt-dir", tmp_path / "ckpt", "--save-every", "1", "--fail-at-step", "2",
                      tmp_path=tmp_path, max_restarts=1, name="ep2")
    assert_matches_reference(s)
    assert "simulated failure at step 2" in out and "resumed from" in out
    one = tmp_path / "one.json"
    p = run_python("moe.py", *TINY, "--router", "noisy_topk", "--groups", "4", "--ragged", "--json", one, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    ref = json.loads(one.read_text())
    assert ref["world_size"] == 1 and ref["figures"]["alltoall_bytes_per_step"] == 0
    assert max(abs(a - b) / b for a, b in zip(s["losses"], ref["losses"])) < 1e-12, (s["losses"], ref["losses"])
    assert s["figures"]["aux_losses"] and abs(s["figures"]["aux_losses"][-1] - ref["figures"]["aux_losses"][-1]) < 1e-12


@pytest.mark.parametrize("flags, words", [
    (["--experts", "6", "--ep", "4"], ["--experts 6", "--ep 4"]),
    (["--router", "noisy_topk", "--top-k", "5", "--experts", "4"], ["top-k 5", "--experts 4"]),
    (["--capacity-factor", "0"], ["--capacity-factor", "> 0"]),
    (["--router", "switch", "--top-k", "2"], ["top-1"]),
])
def test_bad_input_world1(flags, words):
    p = run_python("moe.py", *flags)
    assert_bad_input(p, 1, words)


def test_bad_input_every_rank():
    """Each rank of a world of 2, started alone (torchrun's environment but no rendezvous: a check placed
    after init_dist would crash instead), says the same one line and exits 2. Through torchrun, the agent
    SIGTERMs the slower rank once the first exits, so its own exit code is not always observable."""
    # ep = world size by default
    assert_each_rank_fails(run_ranks("moe.py", 2, "--experts", "3"), ["--experts 3 is not divisible by --ep 2"])
