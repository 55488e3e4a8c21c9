"""fp8.py: the FP8 GEMM against a closed form, the FP8 linear and recipes copied out onto a model that is not
the GPT, parity of every recipe at world 2 and 3 with its mutants caught (tests/fp8_checks.py), the file's own
--check with --fp8-all-gather at world 3, the all-gather bytes, bad input, and the fence contract."""

import json
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import section
from helpers import ENV, ROOT, check_lines, passed, run_python, torchrun

sys.path.insert(0, str(ROOT))  # section.refused counts collectives with harness.CommCounter

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# what a copier takes: the technique section alone, torch and einops only
core = section.load("fp8.py")


def dequant(t, fmt, tile=None, block=False):
    """The test's own quantizer (float64): t -> FP8 values times their scale amax / fp8_max, per tensor or
    per 1 x tile (tile x tile with `block`) along the last dim."""
    fmax = torch.finfo(fmt).max
    if tile is None:
        s = t.abs().max().float() / fmax
        return (t / s).clamp(-fmax, fmax).to(fmt).double() * s
    r, c = t.shape  # a last tile or block shorter than `tile`: as if padded with zeros
    rp, cp = (-(-r // tile) * tile if block else r), -(-c // tile) * tile
    v = torch.zeros(rp, cp, dtype=t.dtype)
    v[:r, :c] = t
    v = v.reshape(rp // (tile if block else 1), tile if block else 1, cp // tile, tile)
    s = v.abs().amax(dim=(1, 3), keepdim=True).float().clamp_min(1e-12) / fmax
    return ((v / s).clamp(-fmax, fmax).to(fmt).double() * s).reshape(rp, cp)[:r, :c]


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
    # the mutant: one scale for the whole tensor in place of the tiles' (the same FP8 numbers)
    if tile:
        wrong = core["scaled_mm"](qa, sa.mean(), qb, sb.mean()).double()
        assert ((wrong - want).abs().max() / want.abs().max()).item() > 1e-2


class Foreign(nn.Module):
    """Not the GPT: a residual MLP on vectors, a bias-free projection, a tanh, a scalar head (kept as is)."""

    def __init__(self, d, h):
        super().__init__()
        self.up, self.down, self.out = nn.Linear(d, h), nn.Linear(h, d, bias=False), nn.Linear(d, 1)

    def forward(self, x):
        return self.out(x + self.down(torch.tanh(self.up(x)))).squeeze(-1)


@pytest.mark.parametrize("odd", [False, True])
@pytest.mark.parametrize("recipe", ["current", "delayed", "fine-grained"])
def test_copy_out_fp8_linear_on_a_foreign_model(recipe, odd):
    """The section's to_fp8 turns the foreign model's linears (not its head) into Fp8Linear, no group.
    Each layer's weight gradient and input gradient, from the input and output gradient it saw (module hooks),
    == the test's own closed form (float64 operands quantized as the recipe says: E4M3 forward, E5M2 gradients
    but fine-grained's E4M3, tiles along each GEMM's inner dimension, 128x128 weight blocks), to float32
    accumulation (1e-5 relative); with the two formats swapped (the mutant) they differ. 6 AdamW steps then
    lower the loss. `odd`: every GEMM dimension a multiple of neither 16 nor 128 (40, 72, 50 tokens): padded
    with zeros inside the layer, a short last tile or block in the closed form."""
    d, h, m = (128, 256, 256) if recipe == "fine-grained" else (48, 80, 64)
    d, h, m = (40, 72, 50) if odd else (d, h, m)
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
        # the mutant: the formats swapped
        wrong = closed_form(n, E5M2, E5M2 if bwd == E4M3 else E4M3)
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
    """From the section alone: a non-float8 format, an empty amax history, a weight tied to another module's:
    each a ValueError naming what is wrong, no collective sent (harness.CommCounter). Sizes are no longer
    refused: every GEMM dimension and shard is padded to whole tiles (the odd-size copy-out test above, and
    the default width at world 3 below, with ranks whose shard is empty)."""

    def tied():
        m = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32, bias=False))
        m[1].weight = m[0].weight
        core["to_fp8"](m, core["Current"](), dist.group.WORLD)  # refused before it asks the group

    cases = {
        "bf16 format": (lambda: core["Current"](fwd=torch.bfloat16), ["float8_e4m3fn", "bfloat16"]),
        "int8 format": (lambda: core["FineGrained"](bwd=torch.int8), ["FP8 format", "int8"]),
        "history 0": (lambda: core["Delayed"](0), ["history of at least 1"]),
        "tied weight": (tied, ["'1'", "'0'", "tied"]),
    }
    for what, (call, words) in cases.items():
        ok, seen = section.refused(call, words)
        assert ok, (what, seen)


_CHECKS = {}  # world: the launch's "ok" lines; "run": the file's run; for the session (tests/test_plan.py)


def shared_checks(world):
    if world not in _CHECKS:
        _CHECKS[world] = check_lines("tests/fp8_checks.py", world, timeout=600)
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
    # per block: q, k, v, proj; fc, proj (4x)
    shard_elements = 2 * (4 * 48 * 48 + 2 * 4 * 48 * 48) // 3
    assert summary["figures"]["shard_elements"] == shard_elements
    assert (
        summary["comm_bytes"] == summary["figures"]["all_gather_bytes_theory"] == 2 * shard_elements
    )
    assert "theory" in out and summary["losses"][-1] < summary["losses"][0]


BAD = [  # (world, flags, words): each on every rank, in one process (tests/bad_input_matrix.py)
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
    # the control: reaches rendezvous
    cases.append(dict(file="fp8.py", world=2, rank=1, argv=TINY, words=[]))
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


# ----------------------------------------------------------------------------- copied out (issue 48)
def test_copy_out_a_tied_weight_stays_one_parameter_or_is_refused():
    """An embedding tied to its head (the commonest tie), and one linear reused under two names: to_fp8
    keeps the tie (one parameter) or raises a ValueError naming both names before converting anything. Today's
    mutant, a clone per layer, leaves two parameters that drift apart (issue 48's one-liner)."""
    m = nn.Module()
    m.emb = nn.Embedding(48, 80)
    m.out = nn.Linear(80, 48, bias=False)
    m.out.weight = m.emb.weight
    try:
        core["to_fp8"](m, core["Current"]())
    except ValueError as e:
        assert "emb" in str(e) and "out" in str(e), e
        # nothing converted
        assert type(m.out).__name__ == "Linear" and m.out.weight is m.emb.weight
    else:
        assert m.out.weight is m.emb.weight
    m = nn.Module()
    m.a = nn.Linear(32, 32)
    m.b = m.a
    try:
        core["to_fp8"](m, core["Current"]())
    except ValueError as e:
        assert "'a'" in str(e) and "'b'" in str(e), e
        assert type(m.a).__name__ == "Linear"
    else:
        assert m.a.weight is m.b.weight


def test_copy_out_hand_built_layers_keep_their_own_delayed_history():
    """Two Fp8Linear built by hand on one Delayed recipe, without naming them: the second layer's output
    over 3 steps == the same layer built alone on a recipe of its own (its own amax history). A shared
    history (today's default key "") scales the second by the first's amax: outputs off by 4-5x."""
    g = torch.Generator().manual_seed(3)
    wa = torch.randn(16, 16, generator=g)
    wb = 100 * torch.randn(16, 16, generator=g)
    xs = [torch.randn(16, 16, generator=g) * (1 + i) for i in range(3)]
    r = core["Delayed"](4)
    a = core["Fp8Linear"](wa, None, r)
    b = core["Fp8Linear"](wb, None, r)
    alone = core["Fp8Linear"](wb, None, core["Delayed"](4))
    for x in xs:
        h = a(x).detach()
        assert torch.equal(b(h), alone(h))


def test_copy_out_fine_grained_under_a_float64_default_dtype():
    """torch.set_default_dtype(torch.float64): every scale handed to torch._scaled_mm is float32 (CUDA's
    _scaled_mm refuses others; CPU's takes double, so the test records them), and the fine-grained layer's
    output == the test's float64 closed form (1e-6 relative)."""
    w = torch.randn(128, 256, dtype=torch.float64)
    x = torch.randn(128, 256, dtype=torch.float64)
    real, seen = torch._scaled_mm, set()

    def spy(a, b, scale_a, scale_b, **kw):
        seen.update((scale_a.dtype, scale_b.dtype))
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kw)

    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    torch._scaled_mm = spy
    try:
        y = core["Fp8Linear"](w, None, core["FineGrained"]())(x)
    finally:
        torch.set_default_dtype(old)
        torch._scaled_mm = real
    assert seen == {torch.float32}, seen
    want = dequant(x, E4M3, 128) @ dequant(w, E4M3, 128, block=True).t()
    assert ((y - want).abs().max() / want.abs().max()).item() < 1e-6


class Frozen(nn.Module):
    """Foreign, with a frozen LayerNorm (no gradient) and a parameter forward never uses; or, with
    `as_buffers`, those two as buffers: the run in which they are not parameters at all."""

    def __init__(self, d, h, as_buffers=False):
        super().__init__()
        torch.manual_seed(4)
        self.up, self.down = nn.Linear(d, h), nn.Linear(h, d, bias=False)
        self.norm, self.out = nn.LayerNorm(d), nn.Linear(d, 1)
        self.norm.weight.requires_grad_(False)
        self.unused = nn.Parameter(torch.ones(3))
        if as_buffers:
            w = self.norm.weight.detach()
            del self.norm.weight, self.unused
            self.norm.register_buffer("weight", w)
            self.register_buffer("unused", torch.ones(3))

    def forward(self, x):
        return self.out(self.norm(x + self.down(torch.tanh(self.up(x))))).squeeze(-1)


def test_copy_out_frozen_and_unused_parameters_are_skipped():
    """train_step (one-rank gloo group, in this process) on a model with a frozen LayerNorm weight and an
    unused parameter: no crash; both unchanged; every other parameter after 3 steps == the run in which those
    two are buffers (torch's optimizers and clip_grad_norm_ skip a parameter without a gradient)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(32, 48, dtype=torch.float64, generator=g)
        y = torch.randn(32, dtype=torch.float64, generator=g)
        runs = []
        for as_buffers in (False, True):
            model = Frozen(48, 80, as_buffers).double()
            core["to_fp8"](model, core["Current"](), skip=("out",))
            opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
            for _ in range(3):
                core["train_step"](
                    model, opt, x, y, lambda o, t: (o - t).pow(2).mean(), dist.group.WORLD, 0.5
                )
            runs.append(dict(model.named_parameters()) | dict(model.named_buffers()))
        assert torch.equal(runs[0]["norm.weight"], torch.ones(48, dtype=torch.float64))
        assert torch.equal(runs[0]["unused"], torch.ones(3, dtype=torch.float64))
        for n, p in runs[1].items():
            assert torch.equal(runs[0][n], p), n
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:for .*copying from a non-meta")
def test_delayed_history_resumes_on_the_models_device():
    """N4-1: a delayed run checkpointed (saved, then loaded with map_location="cpu" as harness.Checkpointer
    does) and resumed on another device (meta, standing in for a GPU): the first forward and backward after
    the load run there. Today the loaded history stays on the CPU: torch.cat with the device's amax fails."""
    import io

    states = []
    for device in ("cpu", "meta"):
        model = Foreign(48, 80).double()
        r = core["Delayed"](4)
        core["to_fp8"](model, r, skip=("out",))
        model.to(device)
        x = torch.randn(64, 48, dtype=torch.float64, device=device)
        if device == "cpu":
            model(x).sum().backward()
            buf = io.BytesIO()
            recipe = getattr(r, "state_dict", dict)()  # fp8.py now keeps it in the model's buffers
            torch.save({"model": model.state_dict(), "recipe": recipe}, buf)
            buf.seek(0)
            states = torch.load(buf, map_location="cpu", weights_only=False)
            continue
        model.load_state_dict(states["model"])
        if states["recipe"]:
            r.load_state_dict(states["recipe"])
        model(x).sum().backward()  # after the load, on the model's device


def test_fp8_refused_below_sm89_on_every_rank(monkeypatch, capsys):
    """N4-7: on a CUDA GPU below compute capability 8.9 (an A100's 8.0) every FP8 recipe is refused by
    check_args in one line, exit 2 (not _scaled_mm's crash at the first GEMM on every rank); the baselines
    (none, bf16) and an sm89 / sm90 GPU pass."""
    sys.path.insert(0, str(ROOT))
    import fp8

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(sys, "argv", ["fp8.py"])
    for cap, recipe, refused in (
        ((8, 0), "current", True),
        ((8, 0), "fine-grained", True),
        ((8, 0), "none", False),
        ((8, 9), "delayed", False),
        ((9, 0), "current", False),
    ):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, cap=cap: cap)
        dtype = ["--dtype", "float32"] if recipe in ("none", "bf16") else []
        args = fp8.parse_args(fp8.Args, ["--recipe", recipe, *dtype])
        try:
            fp8.check_args(args)
            code = None
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip().splitlines()
        assert (code == 2) == refused, (cap, recipe, code, err)
        if refused:
            assert len(err) == 1 and "8.9" in err[0] and f"{cap[0]}.{cap[1]}" in err[0], err


def test_delayed_kill_and_restart_at_world_2(tmp_path):
    """N4-1: torchrun --nproc_per_node=2 fp8.py --recipe delayed, killed at step 3 and restarted by torchrun
    from its step-2 checkpoint: the losses and the final checkpoint (weights, AdamW, the amax histories) ==
    the uninterrupted run's, exactly."""
    args = [
        *TINY,
        "--steps",
        "4",
        "--recipe",
        "delayed",
        "--amax-history",
        "2",
        "--save-every",
        "2",
    ]
    full, _ = torchrun("fp8.py", 2, *args, "--ckpt-dir", tmp_path / "full", tmp_path=tmp_path)
    rs, out = torchrun(
        "fp8.py",
        2,
        *args,
        "--ckpt-dir",
        tmp_path / "rs",
        "--fail-at-step",
        "3",
        tmp_path=tmp_path,
        name="rs",
        max_restarts=1,
    )
    assert "simulated failure at step 3" in out, out[-3000:]
    assert rs["losses"] == full["losses"] and len(full["losses"]) == 4
    for r in range(2):
        a, b = (
            torch.load(tmp_path / k / f"rank{r}" / "step4.pt", weights_only=False)
            for k in ("full", "rs")
        )
        hist = [k for k in a["model"] if "amax" in k] + list(a.get("recipe", {}))
        assert hist, a["model"].keys()
        for key in ("model", "optim"):
            assert str(a[key]) == str(b[key]), key


def test_every_recipe_trains_at_the_default_width_at_world_3(tmp_path):
    """The file's default model width (d_model 64, 4 heads: no GEMM dimension a multiple of 128, W's rows
    uneven over 3 ranks) trains with fine-grained tiles and the FP8 all-gather at world 3 (--batch-size 6:
    64 tokens a rank), --check exact at 1e-9; the counted all-gather bytes == the closed form of the padded
    shards: 2 gathers x (rows a rank, whole 128-row blocks) x (K padded to 128) x 1 byte + the block scales."""
    args = ["--recipe", "fine-grained", "--fp8-all-gather", "--check", "--batch-size", "6"]
    summary, _ = torchrun("fp8.py", 3, *args, "--n-layers", "1", "--steps", "2", tmp_path=tmp_path)
    c = summary["check"]
    assert c["passed"] and c["max_loss_diff"] <= 1e-9 and c["max_param_diff"] <= 1e-9, c
    rows = lambda n: -(-n // (3 * 128)) * 128  # noqa: E731  W's rows a rank, padded to whole blocks
    pad = lambda k: -(-k // 128) * 128  # noqa: E731
    shapes = [(64, 64)] * 4 + [(256, 64), (64, 256)]  # (N, K): q, k, v, attn proj; mlp fc, proj
    want = sum(2 * rows(n) * pad(k) + 4 * rows(n) // 128 * pad(k) // 128 for n, k in shapes)
    assert summary["figures"]["all_gather_bytes_per_step"] == want, (summary["figures"], want)
