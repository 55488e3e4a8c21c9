"""zero.py: ZeRO stages 0-3 match the one-process reference (float64, accumulation, clipping) at world sizes
2, 3 and 4; the wrapper matches torch's ZeroRedundancyOptimizer and fully_shard; memory falls as the ZeRO
formulas say; stage 3 prefetches and frees its gathered storages; bytes handed to collectives equal a closed
form from the model's parameter counts; offload and bf16 train correctly (bf16 against a one-process
reference with the same precision recipe); fp16 skips an injected overflow on every rank
(tests/zero_checks.py); a checkpoint saved at world 4 resumes at world 2; a run killed and restarted by
torchrun at each stage, with dropout, equals the uninterrupted run bit for bit; bad input exits 2; and the
technique, copied out of zero.py with nothing but torch, trains a model that is not the GPT exactly as plain
one-process training does (test_copy_out_zero_on_another_model: the way to check your own trainer)."""
import ast, json, sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from helpers import (ROOT, TINY, assert_bad_input, assert_matches_reference, run_python, torchrun,
                     torchrun_bad_input)

sys.path.insert(0, str(ROOT))
from common import GPTConfig, build_gpt, close_dist, reference_train  # noqa: E402
import zero as Z  # noqa: E402  (importing must not run main())


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
    return {0: whole, 1: whole + whole / N, 2: accum * whole + whole / N, 3: accum * (2 * whole / N + whole)}[stage] + 8


def assert_figures(s):
    """Counted memory equals the ZeRO formula at the padded size and is at least the unpadded one; bytes
    handed to collectives per step equal the closed form."""
    f, c = s["figures"], s["config"]
    for k, m in f["memory"].items():
        assert m["theory"] <= m["counted"] == m["theory_padded"], (k, m)
    assert s["comm_bytes"] == handed_bytes(c["stage"], s["world_size"], c["accum"]), (s["comm_bytes"], f)


def test_stage0_world2_accum(tmp_path):
    s, _ = torchrun("zero.py", 2, *TINY, "--stage", "0", "--accum", "2", "--clip", "0.5", "--check",
                    tmp_path=tmp_path, name="s0")
    assert_matches_reference(s)
    assert_figures(s)


def test_stage2_world3_offload(tmp_path):
    s, out = torchrun("zero.py", 3, *TINY, "--stage", "2", "--accum", "2", "--clip", "0.5", "--offload",
                      "--check", tmp_path=tmp_path, name="s2")
    assert_matches_reference(s)
    assert_figures(s)
    f = s["figures"]
    assert f["saved_activation_bytes"] > 0, f
    # the peak (counted on CPU): the states on the device (offload: not the optimizer's) + the saved bytes
    m = f["memory"]
    assert s["peak_mem_bytes"] == m["params"]["counted"] + m["grads"]["counted"] + f["saved_activation_bytes"], s
    # offload: the optimizer state is on the host (on a CPU-only machine that is trivially so, and says so;
    # tests/zero_checks.py checks the placement and the storages), and so is a copy of the gradient shard
    assert "optimizer (master, m, v) on host (= the device here: trivially true on CPU)" in out
    assert f["host_grad_copy_bytes"] == f["memory"]["grads"]["counted"] > 0, f


def test_checkpoint_world4_resumes_at_world2(tmp_path):
    ckpt = tmp_path / "ckpt"
    a, _ = torchrun("zero.py", 4, *TINY, "--stage", "1", "--accum", "3", "--clip", "0.5", "--check",
                    "--ckpt-dir", ckpt, "--save-every", "2", tmp_path=tmp_path, name="w4")
    assert_matches_reference(a)  # stage 1 at world 4
    assert sorted(p.name for p in (ckpt / "step4").iterdir()) == ["meta.pt"] + [f"rank{r}.pt" for r in range(4)]
    # resume at world 2 (and stage 3: the shard layout on disk is the same for every stage)
    b, out = torchrun("zero.py", 2, *TINY, "--steps", "6", "--stage", "3", "--accum", "2", "--clip", "0.5",
                      "--check", "--ckpt-dir", ckpt, tmp_path=tmp_path, name="w2")
    assert "at step 4 (saved at world size 4; RNG streams start afresh)" in out, out[-3000:]
    assert b["figures"]["resumed_from_step"] == 4 and b["losses"][:4] == a["losses"]
    assert_matches_reference(b)  # all 6 losses and the final parameters == one uninterrupted run
    assert_figures(b)


def shards(ckpt, step, world):
    """Every tensor of a step's checkpoint, by (rank, unit, name): master, Adam moments, RNG state."""
    out = {}
    for r in range(world):
        state = torch.load(ckpt / f"step{step}" / f"rank{r}.pt", weights_only=True)
        out[r, "rng"] = state["rng_cpu"]
        for i, u in enumerate(state["vectors"]):
            out.update({(r, i, k): v for k, v in u.items()})
    return out


def test_restart_each_stage_dropout_bitwise(tmp_path):
    """--dropout 0.1, killed at step 3 and restarted by torchrun from the step-2 checkpoint, at each stage:
    the losses, the final sharded state (master, Adam moments) and the RNG state equal the uninterrupted
    run bit for bit. At world 2 without accumulation every stage does the same arithmetic (a sum of two
    terms does not depend on its order), so one uninterrupted run is the answer for all four; its
    dropout masks depend on the RNG, so a resume that lost the RNG state would differ."""
    args = [*TINY, "--dropout", "0.1", "--clip", "0.5"]
    base, _ = torchrun("zero.py", 2, *args, "--stage", "0", "--ckpt-dir", tmp_path / "base",
                       tmp_path=tmp_path, name="base")
    want = shards(tmp_path / "base", 4, 2)
    for stage in (0, 1, 2, 3):
        ckpt = tmp_path / f"s{stage}"
        s, out = torchrun("zero.py", 2, *args, "--stage", stage, "--ckpt-dir", ckpt, "--save-every", "2",
                          "--fail-at-step", "3", max_restarts=1, tmp_path=tmp_path, name=f"s{stage}")
        assert "simulated failure at step 3" in out and f"resumed from {ckpt} at step 2" in out, out[-3000:]
        assert s["figures"]["resumed_from_step"] == 2 and s["losses"] == base["losses"], (stage, s["losses"])
        got = shards(ckpt, 4, 2)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), stage


def test_bf16_stage3(tmp_path):
    s, out = torchrun("zero.py", 2, *TINY, "--dtype", "float32", "--mixed-precision", "bf16", "--stage", "3",
                      "--check", tmp_path=tmp_path, name="bf16")
    c = s["check"]
    # against the one-process reference with the same recipe: losses within bf16's unit roundoff, each
    # tensor within 10% of how far training moved it (zero.check_mixed; a dropped reduction gives O(1),
    # tests/zero_checks.py)
    assert c["passed"] and c["max_loss_diff"] <= 2 ** -8 and c["max_param_diff"] <= 0.1, c
    assert "same precision recipe" in out and "(tolerance 4e-03 = u)" in out, out[-3000:]
    # yet not the float32 run: the compute really ran in bf16
    ref = reference_train(Z.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, batch_size=12, steps=4))
    assert max(abs(a - b) for a, b in zip(s["losses"], ref["losses"])) > 1e-5, (s["losses"], ref["losses"])
    assert s["figures"]["bytes_per_elem"] == dict(p=2, g=4, K=12), s["figures"]  # the paper's K for Adam


def test_bad_input():
    p = run_python("zero.py", "--stage", "4")
    assert p.returncode == 2 and "--stage must be 0, 1, 2 or 3" in p.stderr, p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    p = run_python("zero.py", "--batch-size", "12", "--accum", "5")
    assert p.returncode == 2 and "--accum 5" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert_bad_input(torchrun_bad_input("zero.py", 2, "--offload", "--stage", "0"), 2, ["offload", "stage 1, 2 or 3"])


# ----------------------------------------------------------------------------- copy-out: check your own trainer
class Mix(nn.Module):  # a nested unit: a norm without bias and an MLP inside a Sequential
    def __init__(self, d, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(d, bias=False)
        self.inner = nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))

    def forward(self, x):
        return x + self.inner(self.norm(x))


class Tower(nn.Module):
    """Not the GPT: nested modules (a Sequential, a ModuleDict), parameters on the root module (a vector and
    a 0-dim scalar), sizes that do not divide by 3 (units of 35 and 179 elements, a root of 25)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(4, 7), nn.Tanh())
        self.body = nn.ModuleDict(dict(mix=Mix(7, 11), out=nn.Linear(7, 3, bias=False)))
        self.temperature = nn.Parameter(torch.tensor([0.5, 1.0, 2.0]))
        self.offset = nn.Parameter(torch.tensor(0.1))

    def forward(self, x):  # (B, 4) -> (B, 3)
        return self.body["out"](self.body["mix"](self.stem(x))) * self.temperature + self.offset


def tower():
    torch.manual_seed(3)
    return Tower().double()


def huber(out, y, n):  # not cross-entropy; summed over the piece, divided by the global batch's count
    return F.huber_loss(out, y, reduction="sum", delta=0.5) / n


def copied_out():
    """zero.py's technique section (the ZeRO core, loss scaling, the gloo note: from its first heading to
    check_args) run with zero.py's imports minus common.py and harness.py: what a reader copies."""
    text = (ROOT / "zero.py").read_text()
    imports = [ast.get_source_segment(text, n) for n in ast.parse(text).body
               if isinstance(n, (ast.Import, ast.ImportFrom)) and getattr(n, "module", None) not in ("common", "harness")]
    core = text[text.index("# ====="):text.index("\ndef check_args")]
    namespace = {}
    exec(compile("\n".join(imports) + "\n" + core, "zero.py (technique section)", "exec"), namespace)
    return namespace


def copy_out_worker(json_path, steps=3, accum=2, clip=0.2):
    """torchrun --nproc_per_node=3 tests/test_zero.py copy-out --json PATH"""
    dist.init_process_group("gloo")
    core = copied_out()
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(12, 4, generator=g, dtype=torch.float64), torch.randn(12, 3, generator=g, dtype=torch.float64))
               for _ in range(steps)]
    adamw = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)  # noqa: E731
    plain, norms = tower(), []  # plain one-process training on the whole global batch
    opt = adamw(plain.parameters())
    for x, y in batches:
        opt.zero_grad()
        huber(plain(x), y, y.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), clip)))
        opt.step()
    want = {n: p.detach() for n, p in plain.named_parameters()}

    def trained(**kw):
        zero = core["Zero"](tower(), ["stem", "body.mix"], optimizer=adamw, clip=clip, **kw)
        for x, y in batches:  # every rank passes the global batch; train_step takes its own rows
            core["train_step"](zero, x, y, y.numel(), accum, huber)
        got = Z.full_state_dict(zero)
        return max((got[n] - p).abs().max().item() for n, p in want.items())

    configs = {f"stage {s}": dict(stage=s) for s in range(4)}
    configs["stage 3 offload"] = dict(stage=3, offload=True)
    out = dict(diff={name: trained(**kw) for name, kw in configs.items()}, clipped=max(norms) > clip,
               moved=max((p - q).abs().max().item() for p, q in zip(want.values(), tower().parameters())))
    keep_local = lambda self, u, g: u.grad.add_(g[u.lo:u.lo + u.S])  # noqa: E731  (a broken stage 2)
    core["Zero"].reduce_grad = keep_local
    out["local_gradients"] = trained(stage=2)
    if dist.get_rank() == 0:
        with open(json_path, "w") as f:
            json.dump(out, f)
    close_dist()  # (gloo's threads may abort an interpreter's teardown: common.close_dist says why)


def test_copy_out_zero_on_another_model(tmp_path):
    """Check your own implementation: Zero and train_step, copied out of zero.py with nothing but torch, on a
    model that is not the GPT, at world 3, stages 0-3 (and 3 with offload), accumulation 2 and
    clipping, equal plain one-process AdamW training written above (float64); a stage 2 whose gradients are
    never reduced across ranks is caught."""
    s, _ = torchrun("tests/test_zero.py", 3, "copy-out", tmp_path=tmp_path, name="copy_out")
    assert s["moved"] > 1e-3 and s["clipped"], s  # parity is not vacuous, and clipping was active
    assert all(diff < 1e-12 for diff in s["diff"].values()), s["diff"]
    assert s["local_gradients"] > 1e-6, s


if __name__ == "__main__" and sys.argv[1:2] == ["copy-out"]:
    copy_out_worker(sys.argv[sys.argv.index("--json") + 1])
