"""fp8.py: the FP8 GEMM against a closed form, the FP8 linear and recipes copied out onto a model that is not
the GPT, parity of every recipe at world 2 and 3 with its mutants caught (tests/fp8_checks.py), the file's own
--check with --fp8-all-gather at world 3, the all-gather bytes, bad input, and the fence contract."""

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import section
from helpers import ENV, ROOT, check_lines, passed, run_python, torchrun

sys.path.insert(0, str(ROOT))  # section.refused counts collectives with harness.CommCounter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
core = section.load(
    "fp8.py"
)  # what a copier takes: the technique section alone, torch and einops only


def dequant(t, fmt, tile=None, block=False):
    """The test's own quantizer (float64): t -> FP8 values times their scale amax / fp8_max, per tensor or
    per 1 x tile (tile x tile with `block`) along the last dim."""
    fmax = torch.finfo(fmt).max
    if tile is None:
        s = t.abs().max().float() / fmax
        return (t / s).clamp(-fmax, fmax).to(fmt).double() * s
    r, c = t.shape
    v = t.reshape(r // (tile if block else 1), tile if block else 1, c // tile, tile)
    s = v.abs().amax(dim=(1, 3), keepdim=True).float() / fmax
    return ((v / s).clamp(-fmax, fmax).to(fmt).double() * s).reshape(r, c)


@pytest.mark.parametrize("tile", [None, 128])
def test_scaled_mm_is_the_dequantized_product(tile):
    """scaled_mm of two quantized operands == the float64 product of the dequantized operands, to float32
    accumulation (1e-6 relative); per-tensor scales go through one torch._scaled_mm, tile scales through the
    blocked GEMM (one FP8 GEMM per 128 of K, scaled in FP32). Mutant: the tile scales ignored fails."""
    g = torch.Generator().manual_seed(0)
    spread = torch.logspace(-2, 2, 384, dtype=torch.float64)  # columns of very different sizes
    a = torch.randn(64, 384, dtype=torch.float64, generator=g) * spread
    b = torch.randn(128, 384, dtype=torch.float64, generator=g)
    r = core["FineGrained"]() if tile else core["Current"]()
    sa, sb = r.scale(a, E4M3, "a", None), r.scale(b, E4M3, "b", None, block=True)
    qa, qb = core["quantize"](a, sa, E4M3), core["quantize"](b, sb, E4M3)
    got = core["scaled_mm"](qa, sa, qb, core["per_row"](sb, 128))
    assert got.dtype == torch.float32 and qa.dtype == E4M3
    got = got.double()
    want = dequant(a, E4M3, tile) @ dequant(b, E4M3, tile, block=True).t()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 1e-6, err
    if (
        tile
    ):  # the mutant: one scale for the whole tensor in place of the tiles' (the same FP8 numbers)
        wrong = core["scaled_mm"](qa, sa.mean(), qb, sb.mean()).double()
        assert ((wrong - want).abs().max() / want.abs().max()).item() > 1e-2


class Foreign(nn.Module):
    """Not the GPT: a residual MLP on vectors, a bias-free projection, a tanh, a scalar head (kept as is)."""

    def __init__(self, d, h):
        super().__init__()
        self.up, self.down, self.out = nn.Linear(d, h), nn.Linear(h, d, bias=False), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(x + self.down(torch.tanh(self.up(x)))).squeeze(-1)


@pytest.mark.parametrize("recipe", ["current", "delayed", "fine-grained"])
def test_copy_out_fp8_linear_on_a_foreign_model(recipe):
    """The section's to_fp8 turns the foreign model's linears (not its head) into Fp8Linear, no group.
    Each layer's weight gradient and input gradient, from the input and output gradient it saw (module hooks),
    == the test's own closed form (float64 operands quantized as the recipe says: E4M3 forward, E5M2 gradients
    but fine-grained's E4M3, tiles along each GEMM's inner dimension, 128x128 weight blocks), to float32
    accumulation (1e-5 relative); with the two formats swapped (the mutant) they differ. 6 AdamW steps then
    lower the loss."""
    d, h, m = (128, 256, 256) if recipe == "fine-grained" else (48, 80, 64)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(m, d, dtype=torch.float64, generator=g)
    target = torch.randn(m, dtype=torch.float64, generator=g)
    torch.manual_seed(2)
    model = Foreign(d, h).double()
    weights = {n: getattr(model, n).weight.detach().clone() for n in ("up", "down")}
    r = core["make_recipe"](recipe, 4)
    assert core["to_fp8"](model, r, skip=("out",)) == ["up", "down"]
    seen = {}
    for n in ("up", "down"):
        layer = getattr(model, n)
        assert type(layer).__name__ == "Fp8Linear" and layer.weight.dtype == torch.float64
        layer.register_forward_hook(
            lambda mod, i, o, n=n: seen.__setitem__(n + ".x", i[0].detach())
        )
        layer.register_full_backward_hook(
            lambda mod, gi, go, n=n: seen.update({n + ".dy": go[0], n + ".dx": gi[0]})
        )
    loss = (model(x) - target).pow(2).mean()
    loss.backward()
    t, bwd = (128, E4M3) if recipe == "fine-grained" else (None, E5M2)
    rel = lambda got, want: ((got - want).abs().max() / want.abs().max()).item()  # noqa: E731

    def closed_form(n, fwd, bwd):  # dW = dy^T x (inner dim: tokens), dx = dy W (inner dim: N)
        xs, dy, w = seen[n + ".x"], seen[n + ".dy"], weights[n]
        dw = dequant(dy.t().contiguous(), bwd, t) @ dequant(xs.t().contiguous(), fwd, t).t()
        return dw, dequant(dy, bwd, t) @ dequant(w.t().contiguous(), fwd, t, block=True).t()

    for n in ("up", "down"):
        dw, dx = closed_form(n, E4M3, bwd)
        assert rel(getattr(model, n).weight.grad, dw) < 1e-5, n
        if seen[n + ".dx"] is not None:  # "up" takes the data, which needs no gradient
            assert rel(seen[n + ".dx"], dx) < 1e-5, n
        wrong = closed_form(
            n, E5M2, E5M2 if bwd == E4M3 else E4M3
        )  # the mutant: the formats swapped
        assert rel(getattr(model, n).weight.grad, wrong[0]) > 1e-3, n
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = loss.item()
    for _ in range(6):
        opt.step()
        opt.zero_grad()
        loss = (model(x) - target).pow(2).mean()
        loss.backward()
    assert loss.item() < first


def test_core_refuses_what_it_cannot_do_before_any_collective():
    """From the section alone: a dimension the 128-tile does not divide, a shard of W that is not whole
    128-row blocks, an uneven split of W's rows, a non-float8 format, an empty amax history: each a
    ValueError naming what would work, no collective sent (harness.CommCounter)."""
    w, fg, cur = torch.zeros(256, 100), core["FineGrained"](), core["Current"]()
    cases = {
        "in_features 100": (lambda: core["Fp8Linear"](w, None, fg), ["in_features = 100", "128"]),
        "shard of 64 rows at world 2": (
            lambda: core["check_fp8_linear"](fg, 128, 128, 2),
            ["128-row blocks", "multiple of 256"],
        ),
        "48 rows over 5 ranks": (
            lambda: core["check_fp8_linear"](cur, 48, 48, 5),
            ["5 shards", "multiple of 80"],
        ),
        "tokens 100": (
            lambda: core["check_fp8_linear"](fg, 128, 128, 1, 100),
            ["tokens per rank = 100"],
        ),
        "bf16 format": (lambda: core["Current"](fwd=torch.bfloat16), ["float8_e4m3fn", "bfloat16"]),
        "int8 format": (lambda: core["FineGrained"](bwd=torch.int8), ["FP8 format", "int8"]),
        "history 0": (lambda: core["Delayed"](0), ["history of at least 1"]),
    }
    for what, (call, words) in cases.items():
        ok, seen = section.refused(call, words)
        assert ok, (what, seen)
    tokens = torch.zeros(
        100, 128
    )  # a forward with 100 tokens: refused as it starts, before any all-gather
    lin = core["Fp8Linear"](torch.zeros(128, 128), None, fg)
    assert section.refused(lambda: lin(tokens), ["tokens per rank = 100"])[0]


_CHECKS = {}  # world: the launch's "ok" lines; "run": the file's run; for the session (tests/test_plan.py)


def shared_checks(world):
    if world not in _CHECKS:
        _CHECKS[world] = check_lines("tests/fp8_checks.py", world, timeout=400)
    return _CHECKS[world]


@pytest.fixture(scope="module")
def checks2():
    """tests/fp8_checks.py at world 2: parity of all six (recipe x gather dtype), bytes, mutants."""
    return shared_checks(2)


@pytest.fixture(scope="module")
def checks3():
    """tests/fp8_checks.py at world 3: parity of the three recipes and bytes, the weights gathered in FP8."""
    return shared_checks(3)


def test_every_recipe_matches_its_one_process_reference(checks2, checks3):
    """fp8.py's pieces on the group == fp8.reference (float64 masters: 1e-9, measured ~1e-16) for current,
    delayed and fine-grained at world 2 and 3, the weights gathered in FP8, and at world 2 in bf16 too."""
    for recipe in ("current", "delayed", "fine-grained"):
        for world, checks, hows in ((2, checks2, ("bf16", "FP8")), (3, checks3, ("FP8",))):
            for how in hows:
                assert passed(checks, f"{recipe}, weights gathered in {how}, world {world}: =="), (
                    checks
                )


def test_mutants_are_caught(checks2):
    """Each rank scaling by its own amax, and E4M3 in place of E5M2 gradients, fail the same comparison."""
    assert passed(checks2, "negative: current with each rank's own amax: differs"), checks2
    assert passed(checks2, "negative: delayed with the E5M2 gradient format forgotten: differs"), (
        checks2
    )


def test_fp8_all_gather_moves_half_of_bf16s_bytes(checks2):
    """Bytes handed to the all-gather per rank and step (counted at the dispatcher) == 2 x shard elements x 2
    bytes in bf16, x 1 in FP8 (+ the fine-grained block scales): a ratio in [0.5, 0.51)."""
    for recipe in ("current", "delayed", "fine-grained"):
        assert passed(checks2, f"{recipe}, FP8 all-gather:", "counted =="), checks2
        assert passed(checks2, f"{recipe}, bf16 all-gather:", "counted =="), checks2
        assert passed(checks2, f"{recipe}: FP8 all-gather bytes / bf16's"), checks2


def shared_file_run(tmp_path_factory):
    """torchrun --nproc_per_node=3 fp8.py --recipe current --fp8-all-gather --check (float64), once a session:
    (summary, output); tests/test_plan.py reads its counted bytes too."""
    if "run" not in _CHECKS:
        args = [
            "--recipe",
            "current",
            "--fp8-all-gather",
            "--check",
            "--dtype",
            "float64",
            "--vocab",
            "32",
            "--seq-len",
            "8",
            "--d-model",
            "48",
            "--n-heads",
            "2",
            "--n-layers",
            "2",
            "--batch-size",
            "12",
            "--steps",
            "3",
        ]
        _CHECKS["run"] = torchrun("fp8.py", 3, *args, tmp_path=tmp_path_factory.mktemp("fp8"))
    return _CHECKS["run"]


def test_file_check_with_fp8_all_gather_at_world_3(tmp_path_factory):
    """The file itself: torchrun --nproc_per_node=3 fp8.py --recipe current --fp8-all-gather --check, float64:
    its --check passes at 1e-9, and its summary's counted all-gather bytes equal the closed form here."""
    summary, out = shared_file_run(tmp_path_factory)
    c = summary["check"]
    assert c["passed"] and c["max_loss_diff"] <= 1e-9 and c["max_param_diff"] <= 1e-9, c
    shard_elements = (
        2 * (4 * 48 * 48 + 2 * 4 * 48 * 48) // 3
    )  # per block: q, k, v, proj; fc, proj (4x)
    assert summary["figures"]["shard_elements"] == shard_elements
    assert (
        summary["comm_bytes"] == summary["figures"]["all_gather_bytes_theory"] == 2 * shard_elements
    )
    assert "theory" in out and summary["losses"][-1] < summary["losses"][0]


BAD = [  # (world, flags, words): each on every rank, in one process (tests/bad_input_matrix.py)
    (
        1,
        ["--recipe", "fine-grained"],
        ["--recipe fine-grained", "in_features = 16", "multiple of 128"],
    ),
    (
        2,
        ["--recipe", "fine-grained", "--d-model", "128", "--seq-len", "64"],
        ["128-row blocks", "multiple of 256"],
    ),
    (
        3,
        ["--d-model", "32", "--batch-size", "6", "--seq-len", "16"],
        ["3 shards", "multiple of 48"],
    ),
    (1, ["--seq-len", "7"], ["tokens per rank = 84", "multiple of 16"]),
    (1, ["--recipe", "delayed", "--amax-history", "0"], ["amax history of at least 1"]),
    (1, ["--dtype", "bfloat16"], ["master weights in --dtype"]),
    (1, ["--check", "--dtype", "float32"], ["--check compares", "use --dtype float64"]),
    (1, ["--recipe", "bf16"], ["casts float32 only"]),
    (2, ["--batch-size", "5"], ["--batch-size 5 is not divisible by the world size 2"]),
]
TINY = [
    "--vocab",
    "32",
    "--seq-len",
    "8",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-layers",
    "2",
    "--batch-size",
    "12",
    "--steps",
    "2",
]


def test_bad_input_exits_2_with_one_line(tmp_path):
    """Validation once: check_args calls the core's own check_fp8_linear and recipe constructors and turns
    their ValueError into fail()'s one line, exit 2, on every rank, before any collective."""
    cases = [
        dict(file="fp8.py", world=w, rank=r, argv=[*TINY, *a], words=words)
        for w, a, words in BAD
        for r in range(w)
    ]
    cases.append(
        dict(file="fp8.py", world=2, rank=1, argv=TINY, words=[])
    )  # the control: reaches rendezvous
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    runner = [
        sys.executable,
        str(ROOT / "tests" / "bad_input_matrix.py"),
        str(tmp_path / "cases.json"),
    ]
    p = subprocess.run(runner, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(cases), p.stdout[-2000:] + p.stderr[-2000:]
    control = results.pop()
    assert control["code"] == "crash" and "MASTER_ADDR" in control["stderr"], control
    for c, r in zip(cases, results):
        lines = r["stderr"].strip().splitlines()
        assert r["code"] == 2 and len(lines) == 1 and f"error (rank {c['rank']})" in lines[0], (
            c,
            r,
        )
        assert all(w in lines[0] for w in c["words"]), (c, lines[0])


def test_fence_contract():
    """Every function and class below `# --- measurement ---` replaced by a no-op: the run's losses are the
    same (it may crash in the summary, after training). 2 steps of delayed scaling at world 1."""
    runs = []
    for noop in ([], ["noop"]):
        p = run_python(
            "tests/fp8_checks.py", "fence", *noop, *TINY, "--recipe", "delayed", timeout=120
        )
        runs.append(re.findall(r"step +\d+ \| loss ([\d.]+)", p.stdout))
        assert len(runs[-1]) == 2 and p.returncode == 0, p.stdout + p.stderr
    assert "after training" in p.stdout and runs[0] == runs[1], runs
