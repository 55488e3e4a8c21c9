"""megatron_tp.py: its layers copied into a model that is not the GPT, layer-level checks at t = 2 and 4 (one
launch each, saved activations per block included), model-level parity with the one-process reference at
t = 1, 2, 4 with and without sequence parallelism and with 2-way data parallelism, collectives counted at the
dispatcher against the paper's count, dropout, a restart with dropout, two "nodes" against one launch, and
bad input."""

import json
import subprocess
import sys

import pytest
import torch

from helpers import (
    ENV,
    ROOT,
    TINY,
    assert_each_rank_fails,
    assert_matches_reference,
    free_port,
    run_python,
    run_ranks,
    torchrun,
)

SCRIPT = "megatron_tp.py"
MODEL = [
    *TINY,
    "--n-heads",
    "4",
]  # 4 heads so that t = 4 gets whole heads; the same model for every t
L, B, S, H = 2, 12, 8, 16  # TINY's layers, global batch, sequence, width


@pytest.mark.parametrize("nproc", [2, 4])
def test_copy_out_and_layer_checks(tmp_path, nproc):
    """The core copied out (t = 2 in the launch of 2; t = 3, mixed biases, on global ranks 1-3 of the launch of
    4, group ranks 0-2): megatron_tp.py's technique section run alone (section.load: torch and einops only),
    its ColumnParallelLinear (gate and up fused) and RowParallelLinear, or their SP subclasses, put into a
    SwiGLU net that is not the GPT (a root parameter, nested modules, odd sizes, a Huber loss), with biases on
    both, on up only and on gate only (issue 30: the fused layer dropped up's bias, or raised), with and
    without SP, trained beside the unsharded net in plain torch (AdamW, clip_grad_norm_): every step's loss
    and every final parameter equal within 1e-12, the bias-free part still exactly zero; SP without the
    section's sum of the replicated gradients, and the mixed bias without its mask, are caught
    (megatron_tp_checks.py: copy_out). Bad sizes (fused parts, heads, SP's T, a vocabulary slice that t
    does not divide): each layer raises a ValueError naming what would work, and the counter saw no
    collective before it.
    Layer checks (t = 2 and 4): column / row / MLP / attention / embedding outputs and gradients vs unsharded
    modules, the vocab-parallel loss vs F.cross_entropy (padded and unpadded; ignore_index -100 and 3), the
    MLP vs torch's DTensor TP, dropout masks, the RNG tracker's nested fork and SPGPT drawing every mask from
    the per-rank stream, each layer's collectives as harness.CommCounter sees them, the gradient norm of a
    bfloat16 model vs its closed form, SP's GatherGEMM (f_sp inside the column GEMM) vs torch's
    _fused_all_gather_matmul, and the mutants (each of f, g, f_sp (GatherGEMM's dL/dX reduce-scatter), g_sp
    broken; the gathered input saved; biases or the padding mask dropped; a bfloat16 sum; a flat fork;
    SPGPT without its fork; the default ignore index) caught: all asserted in the check script.
    --overlap's ring layers (issue 51): the same layer checks (their sends and receives counted), the block's
    saved bytes 1/t, each fused operation's forward vs torch's own (_fused_all_gather_matmul and
    _fused_matmul_reduce_scatter, their collective fallbacks: gloo), the copy-out at t = 2 and 3, a ring step's chunk index off by one caught in each fused
    operation (t = 2), the ring row layer refusing a T it cannot split before any exchange; and at t = 2 the
    overlap shown with every exchange slowed to 20 ms (diloco's method): by the recorded order a GEMM runs
    between each exchange's launch and its wait, none when the wait is put first (the mutant); exposed vs
    total communication printed, never asserted (wall time)."""
    _, out = torchrun("tests/megatron_tp_checks.py", nproc, tmp_path=tmp_path, timeout=240)
    assert "ALL CHECKS PASSED" in out, out[-6000:]
    assert "DTensor reference skipped" not in out, out[-3000:]
    # t = 2: both biases, gate's only, up's only; t = 3: mixed
    t, layouts = (2, 3) if nproc == 2 else (3, 2)
    assert out.count(f"copy-out: SwiGLU net at t = {t}") == 3 * layouts, out[
        -3000:
    ]  # x SP off / on / overlapped (ring)
    assert out.count("copy-out: SwiGLU net") == 3 * layouts, out[-3000:]
    assert out.count(", SP overlapped (ring), ") == layouts, out[-3000:]
    if nproc == 2:  # the mutants run at t = 2, each bias layout
        for what in (
            "gather_gemm's chunk index off by one",
            "gemm_scatter's chunk index off by one",
        ):
            assert out.count(f"copy-out mutant caught: {what} (t = 2)") == 3, out[-3000:]
        for name in (
            "--overlap's ring",
            "mutant: wait, then GEMM",
        ):  # the slowed exchange, reported
            assert f"{name}, each exchange slowed to 20 ms: GEMMs in flight" in out, out[-3000:]


def assert_tp_run(s, t, dp, sp, overlap=False, S=S, H=H):
    """Parity; collectives counted at the dispatcher against the closed-form count, and against the paper's count
    written here (calls, elements, bytes handed per rank; under SP the bytes on the wire per phase, the same
    with --overlap); parameters per rank; replicas identical; one block's saved activations vs the unsharded
    block's."""
    assert_matches_reference(s)
    f = s["figures"]
    assert (f["tp"], f["dp"], f["sequence_parallel"], f["overlap"]) == (t, dp, sp, overlap)
    counted, theory = f["collectives_per_step"], f["collectives_per_step_theory"]
    assert counted == {k: v[:3] for k, v in theory.items()}, (
        counted,
        theory,
    )  # measured vs the file's closed form
    assert s["comm_bytes"] == sum(c[2] for c in counted.values())
    bsh, es, n = (
        B // dp * S * H,
        8,
        2 * L + 1,
    )  # per layer 2 (attention, MLP), + embedding / LM head
    if t > 1 and sp:  # on the wire: AG (t-1) x its chunk, RS (t-1)/t x its input, a send its tensor
        # per layer 2 AG + 2 RS forward (+ LM head AG, embedding RS); 2 RS + 4 AG backward (+ 3)
        wire = {
            "fwd": (4 * L + 2) * (t - 1) * bsh * es // t,
            "bwd": (6 * L + 3) * (t - 1) * bsh * es // t,
        }
        assert f["tp_wire_bytes"] == wire, (f["tp_wire_bytes"], wire)
    # each column / row layer's collective as t - 1 sends of a (b, S/t, H) chunk
    if t > 1 and overlap:
        for phase, rings in (("fwd", 4 * L + 1), ("bwd", 6 * L + 2)):  # bwd: column 2, row 1
            steps = rings * (t - 1)
            assert counted[f"send/tp/{phase}"] == [steps, steps * bsh // t, steps * bsh // t * es]
            assert counted[f"recv/tp/{phase}"] == [steps, steps * bsh // t, 0]
        assert counted["reduce_scatter/tp/fwd"] == [1, bsh, bsh * es]  # the embedding's g_sp
        assert counted["all_gather/tp/bwd"] == [1, bsh, bsh * es // t]
        assert not {"all_gather/tp/fwd", "reduce_scatter/tp/bwd"} & counted.keys(), counted
    # the paper's count, written here independently; bytes handed: an all-gather gets its 1/t chunk
    elif t > 1:
        if sp:
            assert counted["all_gather/tp/fwd"] == [n, n * bsh, n * bsh * es // t], counted
            assert (
                counted["reduce_scatter/tp/fwd"]
                == counted["reduce_scatter/tp/bwd"]
                == [n, n * bsh, n * bsh * es]
            )
            # + re-gathers
            assert counted["all_gather/tp/bwd"] == [2 * n, 2 * n * bsh, 2 * n * bsh * es // t], (
                counted
            )
            assert "all_reduce/tp/bwd" not in counted
        else:
            assert counted["all_reduce/tp/bwd"] == [n, n * bsh, n * bsh * es], counted
            loss = 3 * B // dp * S  # max, target logit, sum of exp per token
            assert counted["all_reduce/tp/fwd"] == [n + 3, n * bsh + loss, (n * bsh + loss) * es], (
                counted
            )
    else:
        assert not any("/tp/" in k for k in counted), counted
    assert f["param_bytes_per_rank"] == f["param_bytes_per_rank_theory"]
    mine, whole = f["param_bytes_per_rank"], f["param_bytes_full_model"]
    assert mine * t >= whole and (mine < whole if t > 1 else mine == whole), (
        mine,
        whole,
    )  # ~1/t, + replicated
    assert f["replicated_param_spread_across_tp"] == 0.0
    block, unsharded = f["activation_bytes_per_block"], f["activation_bytes_per_block_unsharded"]
    assert block * t == unsharded if sp or t == 1 else block * t > unsharded, (block, unsharded)


def test_world1_is_the_reference(tmp_path):
    out = tmp_path / "t1.json"
    p = run_python(SCRIPT, *MODEL, "--check", "--json", out, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert_tp_run(json.loads(out.read_text()), 1, 1, False)


@pytest.mark.parametrize(
    "nproc,extra,t,dp,sp",
    [
        (2, ["--ragged"], 2, 1, False),
        (4, ["--vocab", "30"], 4, 1, False),  # 30 is padded to 32 over 4 ranks
        (2, ["--sequence-parallel"], 2, 1, True),
        (4, ["--sequence-parallel", "--vocab", "30", "--ragged"], 4, 1, True),
    ],
    ids=["t2", "t4-padded-vocab", "t2-sp", "t4-sp-padded"],
)
def test_matches_reference(tmp_path, nproc, extra, t, dp, sp):
    s, _ = torchrun(SCRIPT, nproc, *MODEL, *extra, "--check", tmp_path=tmp_path, timeout=240)
    assert_tp_run(s, t, dp, sp)


OVERLAP_T3 = ["--seq-len", "12", "--d-model", "24", "--n-heads", "6"]  # T and heads split 3 ways


@pytest.mark.parametrize(
    "nproc,extra,t,S,H",
    [
        (2, ["--ragged"], 2, S, H),
        (3, [*OVERLAP_T3, "--ragged"], 3, 12, 24),
        (4, ["--vocab", "30"], 4, S, H),
        (4, ["--tp", "2", "--clip", "0.5"], 2, S, H),
    ],
    ids=["t2", "t3", "t4-padded-vocab", "t2-dp2"],
)
def test_overlap_matches_reference(tmp_path, nproc, extra, t, S, H):
    """--overlap (Wang et al. 2023): sequence parallelism's all-gather + column GEMM and row GEMM + reduce-scatter
    as t - 1 ring steps of batch_isend_irecv. One-process parity in float64 at t = 2, 3, 4; the sends and
    receives counted at the dispatcher against the count written here; the bytes each rank puts on the TP
    wire per phase (sends as handed; the remaining collectives by their ring algorithm) equal to the plain SP
    path's closed form; saved activations 1/t; and beside 2-way data parallelism. At t = 3 the plain SP path runs beside it: the same losses
    (1e-9 relative) and the same measured bytes on the wire."""
    args = [*MODEL, *extra, "--check"]  # --overlap implies --sequence-parallel
    s, _ = torchrun(SCRIPT, nproc, *args, "--overlap", tmp_path=tmp_path, name="ring", timeout=240)
    assert_tp_run(s, t, nproc // t, True, overlap=True, S=S, H=H)
    if nproc == 3:
        plain, _ = torchrun(
            SCRIPT,
            nproc,
            *args,
            "--sequence-parallel",
            tmp_path=tmp_path,
            name="plain",
            timeout=240,
        )
        assert_tp_run(plain, nproc, 1, True, S=S, H=H)
        assert plain["figures"]["tp_wire_bytes"] == s["figures"]["tp_wire_bytes"]
        for a, b in zip(s["losses"], plain["losses"], strict=True):
            assert abs(a - b) <= 1e-9 * abs(b), (s["losses"], plain["losses"])


def test_dropout(tmp_path):
    """With dropout (replicated regions on the shared RNG stream, TP regions on the per-rank one) the
    replicated LayerNorms / biases / positions stay bit-identical across TP ranks; and dropout did act:
    --check now fails, since the one-process reference draws other masks."""
    s, _ = torchrun(
        SCRIPT,
        2,
        *MODEL,
        "--dropout",
        "0.2",
        "--check",
        tmp_path=tmp_path,
        timeout=240,
        expect_rc=1,
    )
    assert s["figures"]["replicated_param_spread_across_tp"] == 0.0
    assert not s["check"]["passed"] and s["check"]["max_loss_diff"] > 1e-4, s["check"]


def final_params(ckpt_dir, world, steps):
    """Each rank's model state dict from the checkpoint written after the last step."""
    return [
        torch.load(
            ckpt_dir / f"rank{r}" / f"step{steps}.pt", map_location="cpu", weights_only=False
        )["model"]
        for r in range(world)
    ]


def test_restart_with_dropout_is_bit_identical(tmp_path):
    """--fail-at-step kills a rank at step 3; torchrun restarts both from the step-2 checkpoint, and the run
    ends with exactly the uninterrupted losses and parameters (float64, bit for bit). Dropout acts in
    replicated regions (the default RNG stream, saved by common.Checkpointer) and in TP regions (the
    tracker's per-rank stream): a restart that forgets the tracker's stream (monkeypatched in the check
    script) gives other losses, so the comparison can fail."""
    args = [*MODEL, "--steps", "5", "--dropout", "0.1", "--save-every", "2"]
    full, _ = torchrun(
        SCRIPT, 2, *args, "--ckpt-dir", tmp_path / "a", tmp_path=tmp_path, name="full"
    )
    again, out = torchrun(
        SCRIPT,
        2,
        *args,
        "--ckpt-dir",
        tmp_path / "b",
        "--fail-at-step",
        "3",
        tmp_path=tmp_path,
        name="restarted",
        max_restarts=1,
    )
    assert "simulated failure at step 3" in out and "rank0 at step 2" in out, out[-3000:]
    assert again["losses"] == full["losses"]
    for a, b in zip(final_params(tmp_path / "a", 2, 5), final_params(tmp_path / "b", 2, 5)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    forgot, out = torchrun(
        "tests/megatron_tp_checks.py",
        2,
        "--forget-tp-rng",
        *args,
        "--ckpt-dir",
        tmp_path / "c",
        "--fail-at-step",
        "3",
        tmp_path=tmp_path,
        name="forgot",
        max_restarts=1,
    )
    assert (
        forgot["losses"][:2] == full["losses"][:2] and forgot["losses"][2] != full["losses"][2]
    ), out[-3000:]


def test_two_nodes_equal_one(tmp_path):
    """tp 2 x dp 2 as one 4-process launch (parity with the reference), and as two 2-process "nodes" joined
    by a c10d rendezvous (each TP group inside one node): exactly the same losses."""
    args = [*MODEL, "--tp", "2", "--ragged"]
    one, _ = torchrun(SCRIPT, 4, *args, "--check", tmp_path=tmp_path, name="one")
    assert_tp_run(one, 2, 2, False)
    port, out_json = free_port(), tmp_path / "two.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        f"--rdzv-id=tp-two-nodes-{port}",
        str(ROOT / SCRIPT),
        *args,
        "--json",
        out_json,
    ]
    nodes = [
        subprocess.Popen(
            [*cmd[:3], f"--node-rank={i}", *cmd[3:]],
            env=ENV,
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for i in range(2)
    ]
    try:
        outs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        for p in nodes:
            p.kill()
    assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    two = json.loads(out_json.read_text())
    assert two["world_size"] == 4 and two["losses"] == one["losses"], (two["losses"], one["losses"])


@pytest.mark.parametrize(
    "nproc,args,words",
    [
        (1, ["--tp", "2"], ["world size 1 is not divisible by --tp 2"]),
        (2, ["--n-heads", "1"], ["--n-heads 1 is not divisible by the TP degree 2"]),
        (
            2,
            ["--n-heads", "4", "--seq-len", "7", "--sequence-parallel"],
            ["--sequence-parallel", "--seq-len 7", "divisible"],
        ),
        (
            2,
            ["--n-heads", "4", "--seq-len", "7", "--overlap"],
            ["--overlap", "--seq-len 7", "divisible"],
        ),
    ],
    ids=["world1-tp2", "heads", "sp-seq-len", "overlap-seq-len"],
)
def test_bad_input(nproc, args, words):
    """Each rank says one line naming the problem and exits 2, before any collective."""
    assert_each_rank_fails(run_ranks(SCRIPT, nproc, *TINY, *args, timeout=120), words)
