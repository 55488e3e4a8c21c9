"""zero.py: ZeRO stages 0-3 match the one-process reference (float64, accumulation, clipping) at world sizes
2, 3 and 4; the wrapper matches torch's ZeroRedundancyOptimizer and fully_shard; memory falls as the ZeRO
formulas say; stage 3 prefetches and frees its gathered storages; bytes handed to collectives equal a closed
form from the model's parameter counts; offload and bf16 train correctly (bf16 against a one-process
reference with the same precision recipe); fp16 skips an injected overflow on every rank
(tests/zero_checks.py); a checkpoint (torch.distributed.checkpoint) saved at world 4 resumes at worlds 2 and
3, and the same directory as a node without rank 0's .metadata sees it (node-local disks) is refused in one
line; a run killed and restarted by
torchrun at each stage, with dropout, equals the uninterrupted run bit for bit; bad input exits 2; and the
technique section, run alone with nothing but torch, trains a model that is not the GPT exactly as plain
one-process training does, at worlds 3 and 2, with a weight tied inside a unit, a copier's loop that never
passes last=, and a unit only one rank runs (stages 0-2: its reductions in the same order on every rank;
stage 3: refused before the all-gather) (test_copy_out_zero_on_another_model: the way to check your own
trainer, read back with the section's own full_state_dict). HSDP (--replicate R): exact at world 4 (2 x 2,
stage 3, its checkpoint resumed at world 2) and world 6 (3 x 2, 2 x 3), bytes per group equal to a closed
form, a mutant without the all-reduce across the replicate group caught, bad input refused on every rank
before any collective, and the copied core with HSDP on the Tower at world 4 (2 x 2)."""

import json
import shutil
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import section
from helpers import (
    ROOT,
    TINY,
    assert_bad_input,
    assert_each_rank_fails,
    assert_matches_reference,
    run_python,
    run_ranks,
    torchrun,
    torchrun_bad_input,
)

sys.path.insert(0, str(ROOT))
import zero as Z  # noqa: E402  (importing must not run main())
from common import GPTConfig, build_gpt, close_dist, reference_train  # noqa: E402
from harness import CommCounter  # noqa: E402


def test_layer_checks_world3(tmp_path):
    # awkward shapes vs ZeroRedundancyOptimizer and FSDP2; GPT stages 0-3 vs reference and each other;
    # counted memory and bytes vs formulas; stage 3 frees its storages and prefetches; offload placement; bf16 --check catches a dropped reduce-scatter; each check against a mutant too
    _, out = torchrun("tests/zero_checks.py", 3, tmp_path=tmp_path, name="checks", timeout=400)
    assert "ALL CHECKS PASSED" in out and "FAIL " not in out, out[-4000:]


def handed_bytes(stage, world, accum, n_layers=2, elem=8):
    """Bytes a rank hands to collectives per step, from a fresh model's own parameter counts (each unit
    padded to a multiple of the world size): an all-reduce / reduce-scatter takes the whole vector, an
    all-gather 1/N of it, and the norm all-reduce takes 8 bytes."""
    args = Z.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=n_layers)
    model = build_gpt(GPTConfig.from_args(args), 0)
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    sizes.append(sum(p.numel() for p in model.parameters()) - sum(sizes))
    whole, N = sum(-(-n // world) * world for n in sizes) * elem, world
    return {
        0: whole,
        1: whole + whole / N,
        2: accum * whole + whole / N,
        3: accum * (2 * whole / N + whole),
    }[stage] + 8


def assert_figures(s):
    """Counted memory equals the ZeRO formula at the padded size and is at least the unpadded one; bytes
    handed to collectives per step equal the closed form."""
    f, c = s["figures"], s["config"]
    for k, m in f["memory"].items():
        assert m["theory"] <= m["counted"] == m["theory_padded"], (k, m)
    assert s["comm_bytes"] == handed_bytes(c["stage"], s["world_size"], c["accum"]), (
        s["comm_bytes"],
        f,
    )


def test_stage0_world2_accum(tmp_path):
    s, _ = torchrun(
        "zero.py",
        2,
        *TINY,
        "--stage",
        "0",
        "--accum",
        "2",
        "--clip",
        "0.5",
        "--check",
        tmp_path=tmp_path,
        name="s0",
    )
    assert_matches_reference(s)
    assert_figures(s)


def test_stage2_world3_offload(tmp_path):
    s, out = torchrun(
        "zero.py",
        3,
        *TINY,
        "--stage",
        "2",
        "--accum",
        "2",
        "--clip",
        "0.5",
        "--offload",
        "--check",
        tmp_path=tmp_path,
        name="s2",
    )
    assert_matches_reference(s)
    assert_figures(s)
    f = s["figures"]
    assert f["saved_activation_bytes"] > 0, f
    # the peak (counted on CPU): the states on the device (offload: not the optimizer's) + the saved bytes
    m = f["memory"]
    assert (
        s["peak_mem_bytes"]
        == m["params"]["counted"] + m["grads"]["counted"] + f["saved_activation_bytes"]
    ), s
    # offload: the optimizer state is on the host (on a CPU-only machine that is trivially so, and says so;
    # tests/zero_checks.py checks the placement and the storages), and so is a copy of the gradient shard
    assert "optimizer (master, m, v) on host (= the device here: trivially true on CPU)" in out
    assert f["host_grad_copy_bytes"] == f["memory"]["grads"]["counted"] > 0, f


def test_checkpoint_world4_resumes_at_world2_and_3(tmp_path):
    ckpt = tmp_path / "ckpt"
    a, _ = torchrun(
        "zero.py",
        4,
        *TINY,
        "--stage",
        "1",
        "--accum",
        "3",
        "--clip",
        "0.5",
        "--check",
        "--ckpt-dir",
        ckpt,
        "--save-every",
        "2",
        tmp_path=tmp_path,
        name="w4",
    )
    assert_matches_reference(a)  # stage 1 at world 4
    # a torch.distributed.checkpoint: one file per rank, rank 0's .metadata last (the step is complete)
    assert sorted(p.name for p in (ckpt / "step4").iterdir()) == [".metadata"] + [
        f"__{r}_0.distcp" for r in range(4)
    ]
    shutil.copytree(ckpt, tmp_path / "ckpt3")
    # resume at world 2 at stage 3 (DCP reshards the same saved shards for every stage), and at world 3 at
    # stage 0 (each rank loads the whole vectors): 6 steps each, equal to one uninterrupted run
    for world, stage, root in ((2, "3", ckpt), (3, "0", tmp_path / "ckpt3")):
        b, out = torchrun(
            "zero.py",
            world,
            *TINY,
            "--steps",
            "6",
            "--stage",
            stage,
            "--accum",
            "2",
            "--clip",
            "0.5",
            "--check",
            "--ckpt-dir",
            root,
            tmp_path=tmp_path,
            name=f"w{world}",
        )
        assert "at step 4 (saved at world size 4; RNG streams start afresh)" in out, out[-3000:]
        assert b["figures"]["resumed_from_step"] == 4 and b["losses"][:4] == a["losses"]
        # all 6 losses and the final parameters == one uninterrupted run
        assert_matches_reference(b)
    assert_figures(b)
    # two nodes with node-local disks, as rank 1..3's node sees it: its files of steps 2 and 4, no .metadata
    # (rank 0 writes it on its own node). Refused in one line, not a silent restart from step 0 (N3-7).
    local = tmp_path / "node_local"
    shutil.copytree(ckpt, local)
    for meta in local.glob("step*/.metadata"):
        meta.unlink()
    p = run_python("zero.py", *TINY, "--ckpt-dir", local)
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, (
        p.returncode,
        p.stderr,
        p.stdout[-2000:],
    )
    assert (
        "the ranks see different checkpoints" in p.stderr and "shared by every node" in p.stderr
    ), p.stderr


def shards(ckpt, step):
    """Every tensor of a step's checkpoint, whole (torch.distributed.checkpoint's own converter): each unit's
    master and Adam moments, every rank's RNG row, AdamW's step and the loss scale, the losses."""
    dcp_to_torch_save(ckpt / f"step{step}", ckpt / "whole.pt")
    return torch.load(ckpt / "whole.pt", weights_only=True)


def test_restart_each_stage_dropout_bitwise(tmp_path):
    """--dropout 0.1, killed at step 3 and restarted by torchrun from the step-2 checkpoint, at each stage:
    the losses, the final sharded state (master, Adam moments, AdamW's step) and the RNG states equal the uninterrupted
    run bit for bit. At world 2 without accumulation every stage does the same arithmetic (a sum of two
    terms does not depend on its order), so one uninterrupted run is the answer for all four; its
    dropout masks depend on the RNG, so a resume that lost the RNG state would differ."""
    args = [*TINY, "--dropout", "0.1", "--clip", "0.5"]
    base, _ = torchrun(
        "zero.py",
        2,
        *args,
        "--stage",
        "0",
        "--ckpt-dir",
        tmp_path / "base",
        tmp_path=tmp_path,
        name="base",
    )
    want = shards(tmp_path / "base", 4)
    for stage in (0, 1, 2, 3):
        ckpt = tmp_path / f"s{stage}"
        s, out = torchrun(
            "zero.py",
            2,
            *args,
            "--stage",
            stage,
            "--ckpt-dir",
            ckpt,
            "--save-every",
            "2",
            "--fail-at-step",
            "3",
            max_restarts=1,
            tmp_path=tmp_path,
            name=f"s{stage}",
        )
        assert "simulated failure at step 3" in out and f"resumed from {ckpt} at step 2" in out, (
            out[-3000:]
        )
        assert s["figures"]["resumed_from_step"] == 2 and s["losses"] == base["losses"], (
            stage,
            s["losses"],
        )
        got = shards(ckpt, 4)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), stage


def test_bf16_stage3(tmp_path):
    s, out = torchrun(
        "zero.py",
        2,
        *TINY,
        "--dtype",
        "float32",
        "--mixed-precision",
        "bf16",
        "--stage",
        "3",
        "--check",
        tmp_path=tmp_path,
        name="bf16",
    )
    c = s["check"]
    # against the one-process reference with the same recipe: losses within bf16's unit roundoff, each
    # tensor within 10% of how far training moved it (zero.check_mixed; a dropped reduction gives O(1),
    # tests/zero_checks.py)
    assert c["passed"] and c["max_loss_diff"] <= 2**-8 and c["max_param_diff"] <= 0.1, c
    assert "same precision recipe" in out and "(tolerance 4e-03 = u)" in out, out[-3000:]
    # yet not the float32 run: the compute really ran in bf16
    ref = reference_train(
        Z.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, batch_size=12, steps=4)
    )
    assert max(abs(a - b) for a, b in zip(s["losses"], ref["losses"])) > 1e-5, (
        s["losses"],
        ref["losses"],
    )
    assert s["figures"]["bytes_per_elem"] == dict(p=2, g=4, K=12), s[
        "figures"
    ]  # the paper's K for Adam


def test_bad_input():
    p = run_python("zero.py", "--stage", "4")
    assert p.returncode == 2 and "--stage must be 0, 1, 2 or 3" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run_python("zero.py", "--batch-size", "12", "--accum", "5")
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "--batch-size, --accum: 12 rows must split into 1 ranks x 5 micro-batches" in p.stderr, (
        p.stderr
    )
    assert_bad_input(
        torchrun_bad_input("zero.py", 2, "--offload", "--stage", "0"),
        2,
        ["offload", "stage 1, 2 or 3"],
    )


# ----------------------------------------------------------------------------- HSDP (--replicate R)
def hsdp_bytes(stage, world, R, accum, n_layers=2, elem=8):
    """Bytes a rank hands per step to each group of an R x N grid, N = world / R: the shard group as ZeRO at
    world N (handed_bytes, the norm's 8 bytes included); the replicate group an all-reduce of the reduced
    shard, 1/N of each padded vector, once per step at stage 1 and once per micro-batch at stages 2-3."""
    N = world // R
    args = Z.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=n_layers)
    model = build_gpt(GPTConfig.from_args(args), 0)
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    sizes.append(sum(p.numel() for p in model.parameters()) - sum(sizes))
    shard = sum(-(-n // N) for n in sizes) * elem  # S per unit: this rank's shard
    across = shard * (1 if stage == 1 else accum)
    return dict(shard=handed_bytes(stage, N, accum, n_layers, elem), replicate=across)


def assert_hsdp_bytes(s, R):
    c = s["config"]
    want = hsdp_bytes(c["stage"], s["world_size"], R, c["accum"])
    got = {k: v["counted"] for k, v in s["figures"]["comm_by_group"].items()}
    assert got == want and s["comm_bytes"] == sum(want.values()), (got, want, s["comm_bytes"])
    assert s["figures"]["replicate"] == R


def hsdp_args(steps=4):  # the tiny GPT, 24 rows: they split over worlds 2, 4 and 6 with accum 2
    return [*TINY[:-6], "--batch-size", 24, "--steps", steps, "--dtype", "float64", "--clip", 0.5]


def test_hsdp_world4_2x2_stage3_resumes_at_world2(tmp_path):
    """HSDP, R = 2 copies of a stage-3 model sharded over N = 2 ranks each: exact against one-process
    training (float64), bytes per group equal the closed form, and its checkpoint (each shard saved once)
    resumes at world 2 without replicas, exact again."""
    ckpt = tmp_path / "ckpt"
    a, out = torchrun(
        "zero.py",
        4,
        *hsdp_args(),
        "--stage",
        "3",
        "--replicate",
        "2",
        "--accum",
        "2",
        "--check",
        "--ckpt-dir",
        ckpt,
        "--save-every",
        "2",
        tmp_path=tmp_path,
        name="hsdp4",
    )
    assert_matches_reference(a)
    assert_hsdp_bytes(a, 2)
    assert "replicate group (2 ranks: all-reduce of each reduced shard)" in out, out[-3000:]
    b, out = torchrun(
        "zero.py",
        2,
        *hsdp_args(steps=6),
        "--stage",
        "3",
        "--accum",
        "2",
        "--check",
        "--ckpt-dir",
        ckpt,
        tmp_path=tmp_path,
        name="resume2",
    )
    assert "at step 4 (saved at world size 4; RNG streams start afresh)" in out, out[-3000:]
    assert b["figures"]["resumed_from_step"] == 4 and b["losses"][:4] == a["losses"]
    assert_matches_reference(b)  # all 6 losses and the final parameters == one uninterrupted run


def test_hsdp_restart_dropout_bitwise(tmp_path):
    """2 x 2 at stage 2 with --dropout 0.1, killed at step 3 and restarted by torchrun from the step-2
    checkpoint (at the same layout: each rank's RNG row restored from the 2-D mesh): the losses and the
    final sharded state equal the uninterrupted run bit for bit."""
    args = [*hsdp_args(), "--dropout", 0.1, "--stage", 2, "--replicate", 2]
    base, _ = torchrun(
        "zero.py", 4, *args, "--ckpt-dir", tmp_path / "base", tmp_path=tmp_path, name="base"
    )
    ckpt = tmp_path / "restarted"
    s, out = torchrun(
        "zero.py",
        4,
        *args,
        "--ckpt-dir",
        ckpt,
        "--save-every",
        "2",
        "--fail-at-step",
        "3",
        max_restarts=1,
        tmp_path=tmp_path,
        name="restarted",
    )
    assert "simulated failure at step 3" in out and f"resumed from {ckpt} at step 2" in out, out[
        -3000:
    ]
    assert s["losses"] == base["losses"], (s["losses"], base["losses"])
    want = shards(tmp_path / "base", 4)
    got = shards(ckpt, 4)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_hsdp_world6_3x2_and_2x3(tmp_path):
    """World 6 as 3 copies of 2 shards (stage 1) and 2 copies of 3 shards (stage 2, uneven shards): exact,
    bytes per group equal the closed form."""
    for R, stage in ((3, "1"), (2, "2")):
        s, _ = torchrun(
            "zero.py",
            6,
            *hsdp_args(),
            "--stage",
            stage,
            "--replicate",
            R,
            "--accum",
            "2",
            "--check",
            tmp_path=tmp_path,
            name=f"hsdp6_{R}",
        )
        assert_matches_reference(s)
        assert_hsdp_bytes(s, R)


# Mutants of zero.py's text, run whole by `tests/test_zero.py mutant NAME args` (each old line occurs once)
MUTANTS = {
    # HSDP without the all-reduce across the replicate group: each copy of the model trains on its rows only
    "hsdp_no_replicate_all_reduce": (
        "                work = dist.all_reduce(out, group=self.replicate_group, async_op=True)\n",
        "",
    ),
}


def test_hsdp_mutant_without_cross_group_all_reduce(tmp_path):
    """The same 2 x 2 stage-3 run with the replicate group's all-reduce dropped: --check fails, and the
    replicate group's bytes are not the closed form's."""
    s, out = torchrun(
        "tests/test_zero.py",
        4,
        "mutant",
        "hsdp_no_replicate_all_reduce",
        *hsdp_args(steps=2),
        "--stage",
        "3",
        "--replicate",
        "2",
        "--check",
        expect_rc=1,
        tmp_path=tmp_path,
        name="mutant",
    )
    c = s["check"]
    assert not c["passed"] and c["max_param_diff"] > 1e-6, c
    counted = s["figures"]["comm_by_group"]["replicate"]["counted"]
    assert counted == 0 != hsdp_bytes(3, 4, 2, 1)["replicate"], s["figures"]


def test_hsdp_bad_input():
    """--replicate that does not divide the world, or with stage 0 (nothing sharded to replicate): every
    rank says one line and exits 2 before any collective (the ranks have no rendezvous)."""
    assert_each_rank_fails(
        run_ranks("zero.py", 4, *TINY, "--stage", "3", "--replicate", "3"),
        ["--replicate 3 must divide the world of 4 ranks"],
    )
    assert_each_rank_fails(
        run_ranks("zero.py", 2, *TINY, "--replicate", "2"),
        ["--replicate 2 needs --stage 1, 2 or 3", "--stage 0 shards nothing"],
    )


# ----------------------------------------------------------------------------- copy-out: check your own trainer
# a nested unit: a norm without bias, an MLP inside a Sequential, and a tied pair
class Mix(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)
        self.inner = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
        self.gate, self.proj = nn.Linear(d, d, bias=False), nn.Linear(d, d)
        self.proj.weight = self.gate.weight  # tied inside the unit: one tensor, two modules read it

    def forward(self, x):
        return x + self.inner(self.norm(x)) + self.proj(torch.tanh(self.gate(x)))


class Tower(nn.Module):
    """Not the GPT: nested modules (a Sequential, a ModuleDict), parameters on the root module (a vector and
    a 0-dim scalar), a weight tied inside a unit, sizes that do not divide by 2 or 3 (units of 35, 56 and
    235 elements, a root of 25), and a unit whose use depends on the data: body.side runs only when a row of
    the micro-batch has x[:, 0] > 0, and adds only to those rows (so one process on the whole batch computes
    the same function as the ranks on their pieces)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 7), nn.Tanh())
        self.body = nn.ModuleDict(
            dict(side=nn.Linear(7, 7), mix=Mix(7, 11), out=nn.Linear(7, 3, bias=False))
        )
        self.temperature = nn.Parameter(torch.tensor([0.5, 1.0, 2.0]))
        self.offset = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):  # (B, 4) -> (B, 3)
        h, on = self.stem(x), x[:, :1] > 0  # (B, 7), (B, 1)
        if on.any():  # (a host sync: the graph depends on the data)
            h = h + on * torch.tanh(self.body["side"](h))
        return self.body["out"](self.body["mix"](h)) * self.temperature + self.offset


UNITS = ["stem", "body.side", "body.mix"]


def tower():
    torch.manual_seed(3)
    return Tower().double()


# not cross-entropy; summed over the piece, divided by the global batch's count
def huber(out, y, n):
    return F.huber_loss(out, y, reduction="sum", delta=0.5) / n


def copied_out():
    """zero.py's technique section, from its first heading to check_args (the ZeRO core, then the mixed
    precision and offload variants), executed with zero.py's imports minus common.py and harness.py and
    nothing else (tests/section.py): what a reader copies."""
    return section.load("zero.py")


def batches(world, steps, branch_on=None):
    """`steps` global batches, (12, 4) inputs and (12, 3) targets. x[:, 0] > 0 on every row (every piece runs
    body.side), or, with branch_on=world, only on the rows of group rank 0 (the others never run it)."""
    g, out = torch.Generator().manual_seed(7), []
    for _ in range(steps):
        x, y = (
            torch.randn(12, 4, generator=g, dtype=torch.float64),
            torch.randn(12, 3, generator=g, dtype=torch.float64),
        )
        sign = torch.ones(12, dtype=torch.float64)
        if branch_on:
            sign[12 // branch_on :] = -1
        x[:, 0] = x[:, 0].abs().clamp_min(0.1) * sign
        out.append((x, y))
    return out


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)


def bare():  # every parameter inside a unit: the root unit has none of its own
    torch.manual_seed(5)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def plain_training(data, clip, make=tower):
    """Plain one-process training on the whole global batch: the answer, and the largest gradient norm."""
    plain, norms = make(), []
    opt = adamw(plain.parameters())
    for x, y in data:
        opt.zero_grad()
        huber(plain(x), y, y.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)))
        opt.step()
    return {n: p.detach() for n, p in plain.named_parameters()}, max(norms)


def default_backward_step(zero, x, y, accum):
    """A copier's own loop, who never heard of last=: zero.backward(loss) after every micro-batch."""
    rows = x.shape[0] // zero.dp_world  # (all R x N ranks: R = 1 but with HSDP)
    x, y = (
        x[zero.dp_rank * rows : (zero.dp_rank + 1) * rows],
        y[zero.dp_rank * rows : (zero.dp_rank + 1) * rows],
    )
    for xm, ym in zip(x.chunk(accum), y.chunk(accum)):
        zero.backward(huber(zero(xm), ym, 12 * 3))
    zero.step()


# mutant: this rank's shard of its own gradient, never summed over the ranks
def keep_local(self, u, g):
    u.accumulate(g.to(u.grad.dtype)[u.lo : u.lo + u.S])
    self.waiting.remove(u)  # (its turn taken)


# mutant: accumulate as before issue 30, into a buffer a reduction may be
def accumulate_in_flight(self, g):
    if self.has_grad:  # reading (stage 1) or has summed over the ranks already (stage 0)
        self.grad += g
    else:
        self.grad.copy_(g)
    self.has_grad = True
    return self.grad


# mutant: publish without the master -> compute copy, Zero.publish's all-gathers of stages 1-2 only
def publish_without_copy(self):
    for u in self.forward_order if self.stage in (1, 2) else ():
        shard = u.compute.clone()
        work = dist.all_gather_single(u.full.detach(), shard, group=self.group, async_op=True)
        self.publishing[u] = work, shard


def copy_out_worker(json_path, steps=3, accum=2, clip=0.2):
    """torchrun --nproc_per_node=3 tests/test_zero.py copy-out --json PATH: every check at world 3 (the
    default group) and at world 2 (a group of ranks 0 and 1: the core on a group, as a copier passes one)."""
    from datetime import timedelta

    # a collective mismatch fails in bounded time
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    core, rank = copied_out(), dist.get_rank()
    pair, singles = (
        dist.new_group([0, 1]),
        [dist.new_group([r]) for r in range(3)],
    )  # (every rank makes each)
    plain = batches(3, steps)  # every piece runs body.side: the graph is the same on every rank
    want, top_norm = plain_training(plain, clip)
    out = dict(
        clipped=top_norm > clip,
        moved=max((want[n] - p).abs().max().item() for n, p in tower().named_parameters()),
    )

    # params, largest difference
    def trained(data, group, loop=None, make=tower, units=UNITS, kind="Zero", **kw):
        zero = core[kind](make(), units, optimizer=adamw, clip=clip, group=group, **kw)
        for x, y in data:  # every rank passes the global batch; train_step takes its own rows
            loop(zero, x, y, accum) if loop else core["train_step"](
                zero, x, y, y.numel(), accum, huber
            )
        got = core["full_state_dict"](zero)
        return got, max((got[n] - p).abs().max().item() for n, p in want_now.items())

    for world, group in ((3, None), (2, pair)):
        if rank >= world:
            continue
        want_now, diff = want, {}
        for s in range(4):
            got, diff[f"stage {s}"] = trained(plain, group, stage=s)
            # the tied pair: both names read the one trained tensor
            tied = got["body.mix.proj.weight"] - got["body.mix.gate.weight"]
            diff[f"stage {s}: tied names differ"] = tied.abs().max().item()
            # the variants in the model's own dtype (float64): a master copy of its own, on the device or the host
            _, diff[f"stage {s}, backward(loss) on every micro-batch"] = trained(
                plain, group, default_backward_step, stage=s
            )
        _, diff["stage 2 MixedPrecisionZero"] = trained(
            plain, group, stage=2, kind="MixedPrecisionZero", compute_dtype=None
        )
        _, diff["stage 3 OffloadZero"] = trained(
            plain, group, stage=3, kind="OffloadZero", compute_dtype=None
        )
        want_now, _ = plain_training(plain, clip, bare)
        _, diff["stage 3, a root without parameters"] = trained(
            plain, group, make=bare, units=["0", "2"], stage=3
        )
        branchy = batches(world, steps, branch_on=world)  # body.side runs on group rank 0 only
        want_now, _ = plain_training(branchy, clip)
        for s in range(3):
            _, diff[f"stage {s}, body.side on rank 0 only"] = trained(branchy, group, stage=s)
        out[f"world {world}"] = diff
        want_now = want  # mutants: each must be caught
        mixed = dict(kind="MixedPrecisionZero", compute_dtype=None)
        broken = {
            "local_gradients": (
                "Zero",
                "reduce_grad",
                2,
                keep_local,
                {},
            ),  # a stage 2 that never reduces
            "accumulate_during_reduction": ("FlatUnit", "accumulate", 0, accumulate_in_flight, {}),
            # a MixedPrecisionZero whose compute copy never takes the master's update (publish without
            # its copy: the all-gathers of stages 1-2 only)
            "stale_compute_copy": ("Zero", "publish", 2, publish_without_copy, mixed),
        }
        for name, (cls, attr, stage, fake, kw) in broken.items():
            real = getattr(core[cls], attr)
            setattr(core[cls], attr, fake)
            try:
                diff[f"mutant {name}"] = trained(
                    plain, group, default_backward_step, stage=stage, **kw
                )[1]
            finally:
                setattr(core[cls], attr, real)
        # bad input: a batch whose rows do not split over the ranks (11 at worlds 3 and 2) is refused with a
        # ValueError before any collective; the same step on 12 rows (the control) hands its collectives over
        zero, x, y = core["Zero"](tower(), UNITS, optimizer=adamw, group=group, stage=1), *plain[0]
        with CommCounter() as comm:
            try:
                core["train_step"](zero, x[:11], y[:11], 33, accum, huber)
                out[f"uneven rows, world {world}"] = ["accepted", comm.calls]
            except ValueError as e:
                out[f"uneven rows, world {world}"] = [str(e), comm.calls]
        with CommCounter() as comm:
            core["train_step"](zero, x, y, y.numel(), accum, huber)
        zero.wait_published()  # (stage 1's all-gathers of the update, still in flight)
        out[f"uneven rows, world {world}, control"] = comm.total(what="calls")

    # the order of the collectives each rank issues, each on a group of its own (nothing is matched across
    # ranks, so a mismatch cannot hang): one step of world 3's pieces, body.side on rank 0 only
    x, y = batches(3, 1, branch_on=3)[0]
    mine = slice(rank * 4, (rank + 1) * 4)

    # [(op, elements)] handed to collectives, in order, as a tensor (3 numbers per call)
    def issued(
        stage,
    ):
        zero = core["Zero"](
            tower(), UNITS, optimizer=adamw, clip=clip, group=singles[rank], stage=stage
        )
        comm = CommCounter(log=True)
        with comm:
            core["train_step"](zero, x[mine], y[mine], y.numel(), accum, huber)
        calls = [
            [float(c["op"] == "all_reduce"), float(c["op"] == "reduce"), float(c["elems"])]
            for c in comm.calls_log
        ]
        # padded: 40 calls
        return torch.tensor(calls + [[-1.0] * 3] * (40 - len(calls)), dtype=torch.float64)

    def same_everywhere(stage):
        seq = issued(stage)
        every = [torch.empty_like(seq) for _ in range(3)]
        dist.all_gather(every, seq)
        return all(torch.equal(e, every[0]) for e in every)

    out["same order"] = {s: same_everywhere(s) for s in range(3)}
    reduce_grad = core["Zero"].reduce_grad

    # the old rule: each unit reduced as soon as autograd finishes it
    def arrival_order(self, u, g):
        if u in self.waiting:  # (its turn moves up to the next one)
            self.waiting.remove(u)
            self.waiting.insert(0, u)
        reduce_grad(self, u, g)

    core["Zero"].reduce_grad = arrival_order
    out["same order, arrival-order mutant"] = {s: same_everywhere(s) for s in range(3)}
    core["Zero"].reduce_grad = reduce_grad

    # stage 3 with a unit one rank skips: refused (ValueError) before the all-gather of the unit that ran out
    # of turn (nccl-review-3 N3-5), each rank on a group of its own; here rank 0's rows skip body.side
    def stage3(x, units):
        zero, comm = (
            core["Zero"](tower(), units, optimizer=adamw, group=singles[rank], stage=3),
            CommCounter(log=True),
        )
        try:
            with comm:
                core["train_step"](zero, x, y[mine], y[mine].numel(), 1, huber)
            return ["accepted", [c["elems"] for c in comm.calls_log]]
        except ValueError as e:
            return [str(e), [c["elems"] for c in comm.calls_log]]

    skips = x[mine].clone()
    skips[:, 0] = -skips[:, 0].abs()  # x[:, 0] <= 0 on every row: body.side does not run
    out["stage 3, every unit runs"] = stage3(x[mine].abs(), UNITS)
    out["stage 3, body.side skipped"] = stage3(skips, UNITS)
    out["stage 3, the last unit skipped"] = stage3(skips, UNITS[:2])  # (body.mix in the root unit)

    # a tie across units: refused, naming both
    tied = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    tied[1].weight = tied[0].weight
    try:
        core["Zero"](tied, ["0"])
        out["tie across units"] = "accepted"
    except ValueError as e:
        out["tie across units"] = str(e)
    with CommCounter() as comm:  # a stage ZeRO does not have: refused before any collective
        try:
            core["Zero"](tower(), UNITS, optimizer=adamw, group=singles[rank], stage=4)
            out["stage 4"] = ["accepted", comm.calls]
        except ValueError as e:
            out["stage 4"] = [str(e), comm.calls]
    if rank == 0:
        with open(json_path, "w") as f:
            json.dump(out, f)
    close_dist()  # (gloo's threads may abort an interpreter's teardown: common.close_dist says why)


def copy_out_hsdp_worker(json_path, steps=3, accum=3, clip=0.2):
    """torchrun --nproc_per_node=4 tests/test_zero.py copy-out-hsdp --json PATH: the copied section's Zero
    with HSDP on a 2 x 2 grid a copier builds (rows: shard groups, columns: replicate groups), on Tower."""
    from datetime import timedelta

    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    core, rank = copied_out(), dist.get_rank()
    grid = torch.arange(4).view(2, 2)
    shard, _ = dist.new_subgroups_by_enumeration(grid.tolist())
    replicate, _ = dist.new_subgroups_by_enumeration(grid.T.tolist())
    plain = batches(4, steps)
    want, _ = plain_training(plain, clip)
    out = {}

    def trained(stage, loop, **broken):  # the largest difference from plain training
        zero = core["Zero"](
            tower(), UNITS, stage, adamw, clip, group=shard, replicate_group=replicate
        )
        for k, v in broken.items():  # a mutant: an attribute of the built Zero overwritten
            setattr(zero, k, v)
        for x, y in plain:
            if loop == "train_step":
                core["train_step"](zero, x, y, y.numel(), accum, huber)
            else:
                default_backward_step(zero, x, y, accum)
        got = core["full_state_dict"](zero)
        return max((got[n] - p).abs().max().item() for n, p in want.items())

    for s in (1, 2, 3):
        for loop in ("train_step", "backward(loss) on every micro-batch"):
            out[f"stage {s}, {loop}"] = trained(s, loop)
    # mutants: no all-reduce across the replicate group; at stage 1 with last=True on every micro-batch,
    # the step's sum so far kept on every replica (each a "replica 0"), so the next all-reduce adds it R times
    out["mutant: no replicate group"] = trained(3, "train_step", replicate_group=None)
    every = "backward(loss) on every micro-batch"
    out["mutant: sum kept on every replica"] = trained(1, every, replica=0)
    with CommCounter() as comm:  # stage 0 with replicas: refused before any collective
        try:
            core["Zero"](tower(), UNITS, 0, adamw, group=shard, replicate_group=replicate)
            out["stage 0"] = ["accepted", comm.calls]
        except ValueError as e:
            out["stage 0"] = [str(e), comm.calls]
    if rank == 0:
        with open(json_path, "w") as f:
            json.dump(out, f)
    close_dist()


def test_copy_out_hsdp_2x2_on_another_model(tmp_path):
    """The copied core with HSDP (2 copies x 2 shards) on the Tower at stages 1-3, through train_step and
    through a copier's loop that passes last=True on every micro-batch (at stage 1 the step's sum is then
    kept on one replica only, else the next all-reduce would count it twice): equal to plain one-process
    training (float64); stage 0 with a replicate group is refused (ValueError) before any collective.
    Mutants caught: no all-reduce across the replicate group; the step's sum kept on every replica."""
    s, _ = torchrun("tests/test_zero.py", 4, "copy-out-hsdp", tmp_path=tmp_path, name="hsdp")
    msg, calls = s.pop("stage 0")
    assert "replicas 2 needs stage 1, 2 or 3" in msg and calls == {}, (msg, calls)
    mutants = {k: s.pop(k) for k in list(s) if k.startswith("mutant")}
    assert len(s) == 6 and all(diff < 1e-12 for diff in s.values()), s
    assert len(mutants) == 2 and all(diff > 1e-3 for diff in mutants.values()), mutants


def test_copy_out_zero_on_another_model(tmp_path):
    """Check your own implementation: Zero and train_step, copied out of zero.py with nothing but torch, on a
    model that is not the GPT, at worlds 3 and 2 (a group of two ranks), stages 0-3, and the variants in the
    model's dtype (MixedPrecisionZero at stage 2, OffloadZero at stage 3: a master copy of their own),
    accumulation 2 and clipping, equal plain one-process AdamW training written above (float64). The
    section runs alone (tests/section.py: its source executed with torch and the standard library only):
    - a weight tied inside a unit trains as one tensor (both names equal the plain model's one);
    - a copier's loop calling zero.backward(loss) on every micro-batch (the default last=True) is exact too
      (no reduction is read while the next micro-batch writes its buffer, none counts a sum N times);
    - a unit run by one rank only (data-dependent graph): stages 0-2 are exact, and every rank issues the
      same collectives in the same order (each recorded on a group of its own, then compared); stage 3
      refuses it with a ValueError before the all-gather of the unit that ran out of turn (a unit skipped
      in the middle: gathered root, stem, side and not mix; the last unit skipped: at the end of forward),
      where a piece that runs every unit trains (nccl-review-3 N3-5; today's code accepted both);
    - a tie across two units is refused with a ValueError naming both parameters, a stage 4 with one naming
      ZeRO's stages (before any collective);
    - stage 3 with every parameter inside a unit (a root unit without parameters) trains exactly;
    - a batch whose rows do not split over the ranks is refused (ValueError) before any collective.
    Mutants caught: a stage 2 whose gradients are never reduced across ranks, stage 0 without waiting for the
    reduction before the next micro-batch writes into it, a MixedPrecisionZero whose compute copy is never
    refreshed from its master, reductions launched in the order autograd finishes the units (the ranks'
    orders differ)."""
    s, _ = torchrun("tests/test_zero.py", 3, "copy-out", tmp_path=tmp_path, name="copy_out")
    assert s["moved"] > 1e-3 and s["clipped"], s  # parity is not vacuous, and clipping was active
    for world in (3, 2):
        d = s[f"world {world}"]
        mutants = {k: d.pop(k) for k in list(d) if k.startswith("mutant")}
        assert len(d) == 4 * 3 + 2 + 1 + 3 and all(diff < 1e-12 for diff in d.values()), (world, d)
        assert all(diff > 1e-3 for diff in mutants.values()) and len(mutants) == 3, (world, mutants)
    assert all(s["same order"].values()) and len(s["same order"]) == 3, s["same order"]
    assert not any(s["same order, arrival-order mutant"].values()), s[
        "same order, arrival-order mutant"
    ]
    assert (
        "1.weight is 0.weight" in s["tie across units"] and "one unit" in s["tie across units"]
    ), s
    assert (
        "stage must be 0, 1, 2 or 3" in s["stage 4"][0]
        and "got 4" in s["stage 4"][0]
        and s["stage 4"][1] == {}
    ), s
    for world in (3, 2):
        msg, calls = s[f"uneven rows, world {world}"]
        assert f"11 rows must split into {world} ranks x 2 micro-batches" in msg and calls == {}, (
            msg,
            calls,
        )
        assert s[f"uneven rows, world {world}, control"] > 0, s
    # stage 3, a unit skipped: refused before the gather of the unit out of turn (mix, 235 elements) is issued
    assert s["stage 3, every unit runs"][0] == "accepted", s["stage 3, every unit runs"]
    msg, sizes = s["stage 3, body.side skipped"]
    assert "stage 3: unit body.mix ran where unit body.side was next" in msg and sizes == [
        25,
        35,
        56,
    ], (msg, sizes)
    msg, sizes = s[
        "stage 3, the last unit skipped"
    ]  # the root (25 + mix's 235) and stem gathered, side prefetched
    assert "stage 3: forward ended where unit body.side was next" in msg and sizes == [
        260,
        35,
        56,
    ], (msg, sizes)


if __name__ == "__main__" and sys.argv[1:2] == ["copy-out"]:
    copy_out_worker(sys.argv[sys.argv.index("--json") + 1])
if __name__ == "__main__" and sys.argv[1:2] == ["copy-out-hsdp"]:
    copy_out_hsdp_worker(sys.argv[sys.argv.index("--json") + 1])
# zero.py with one line changed (MUTANTS), run whole
if __name__ == "__main__" and sys.argv[1:2] == ["mutant"]:
    old, new = MUTANTS[sys.argv[2]]
    text = (ROOT / "zero.py").read_text()
    assert text.count(old) == 1, old
    sys.argv = [str(ROOT / "zero.py"), *sys.argv[3:]]
    exec(compile(text.replace(old, new), "zero.py (mutant)", "exec"), {"__name__": "__main__"})
