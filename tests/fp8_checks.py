"""Checks of fp8.py inside one process group (launched by tests/test_fp8.py at world 2 and 3):

    torchrun --standalone --nproc_per_node=2 tests/fp8_checks.py

1. Parity: each recipe (current, delayed, fine-grained), its weights gathered in FP8 (--fp8-all-gather) and,
   at world 2, in bf16, trained with fp8.py's own pieces on this group == fp8.reference (one process, its own
   quantizer; float64 masters, so the only roundoff left is float64's: 1e-9).
2. Mutants (world 2), each against the same reference: every rank scaling by its own amax (no MAX
   all-reduce), and the E5M2 gradient format forgotten (E4M3 gradients). Both must fail the 1e-9 check by far.
3. Bytes (world 2; at world 3 the FP8 gathers): all-gather bytes handed per rank in one step
   (harness.CommCounter, at the dispatcher) == the closed form computed here from the layer shapes: 2 gathers
   x shard elements x 2 bytes (bf16) or 1 byte (FP8) (+ 4 bytes per 128x128 block scale, once, fine-grained);
   FP8 about half of bf16. Each line names the model's shape (tests/test_plan.py reads them).
4. The file's default width (d_model 64: no dimension a multiple of 128, W's rows uneven over 3 ranks,
   some shards empty), each recipe: == fp8.reference at 1e-9, and the all-gather bytes of the padded
   shards == their closed form (rows a rank in whole tiles x K in whole tiles).
`python tests/fp8_checks.py fence [noop] ARGS` instead runs fp8.py's main() with ARGS, with every function and
class below its measurement fence replaced by a no-op when `noop` is given (tests/test_fp8.py compares the
losses of the two).
Prints "ok ..." / "FAIL ..." lines and ALL CHECKS PASSED; exits 1 if any check failed.
"""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

if sys.argv[1:2] == ["fence"]:  # the fence contract's two runs (see the docstring)
    import ast
    import types

    noop, argv = sys.argv[2:3] == ["noop"], [a for a in sys.argv[2:] if a != "noop"]
    sys.argv = [os.path.join(ROOT, "fp8.py"), *argv]
    text = open(os.path.join(ROOT, "fp8.py")).read()
    below = ast.parse(text[text.index("# --- measurement ---") :]).body
    mod = types.ModuleType("fp8_fenced")
    sys.modules["fp8_fenced"] = mod
    exec(
        compile(text.replace('if __name__ == "__main__":', "if False:"), "fp8.py", "exec"),
        mod.__dict__,
    )
    for node in below if noop else []:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            setattr(mod, node.name, lambda *a, **k: None)
    try:
        mod.main()
    except BaseException as e:  # noqa: BLE001  a no-op summary crashes after training: allowed
        print(f"after training: {type(e).__name__}", flush=True)
        os._exit(0)

import torch
import torch.distributed as dist

import fp8
from common import (
    GPTConfig,
    MarkovData,
    build_gpt,
    close_dist,
    count_tokens,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import CommCounter, parse_args

d = init_dist(60)
group, failures = dist.group.WORLD, []


def check(ok, what):
    if not ok:
        failures.append(what)
    if d.rank == 0 or not ok:
        print(f"{'ok  ' if ok else 'FAIL'} (rank {d.rank}) {what}", flush=True)


def config(recipe, gather):
    """Tiny, but every GEMM dimension legal: tokens per rank 32 (16s), or 128 and 128-row shards (tiles)."""
    if recipe == "fine-grained":
        shape = [
            "--d-model",
            128 * d.world,
            "--n-layers",
            1,
            "--seq-len",
            64,
            "--batch-size",
            2 * d.world,
        ]
    else:
        shape = [
            "--d-model",
            16 * d.world,
            "--n-layers",
            2,
            "--seq-len",
            8,
            "--batch-size",
            4 * d.world,
        ]
    argv = [
        "--recipe",
        recipe,
        "--vocab",
        32,
        "--n-heads",
        2,
        "--steps",
        2,
        "--dtype",
        "float64",
        *shape,
    ]
    return parse_args(fp8.Args, [str(a) for a in argv + (["--fp8-all-gather"] if gather else [])])


def train(args, comm=None):
    """fp8.py's main loop without the harness: (losses, the whole model's parameters on every rank)."""
    data, b = MarkovData(args.vocab, args.seed), args.batch_size // d.world
    model = build_gpt(GPTConfig.from_args(args), args.seed, torch.float64, d.device)
    fp8.to_fp8(model, fp8.make_recipe(args.recipe, args.amax_history), group, args.fp8_all_gather)
    opt, losses = make_optimizer(model.parameters(), args), []
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, args.seq_len)
        n_tok = count_tokens(y)
        x, y = (t[d.rank * b : (d.rank + 1) * b].to(d.device) for t in (x, y))
        loss_fn = lambda logits, y: lm_loss(logits, y, n_tok)  # noqa: E731
        if comm is not None and step == 1:
            with comm:
                loss = fp8.train_step(model, opt, x, y, loss_fn, group, args.clip)
        else:
            loss = fp8.train_step(model, opt, x, y, loss_fn, group, args.clip)
        dist.all_reduce(loss, group=group)
        losses.append(loss.item())
    return losses, fp8.full_params(model, group), model


def diff(args, losses, params):
    """(max relative loss difference, max parameter difference) against fp8.reference, on every rank."""
    ref = fp8.reference(args, d.world, d.device)
    loss = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    par = max((params[n] - p).abs().max().item() for n, p in ref["params"].items())
    return loss, par


# 1. parity, and 3. bytes
gathered = {}
for recipe in ("current", "delayed", "fine-grained"):
    for gather in (False, True) if d.world == 2 else (True,):
        args, comm = config(recipe, gather), CommCounter()
        losses, params, model = train(args, comm)
        loss, par = diff(args, losses, params)
        how = "FP8" if gather else "bf16"
        check(
            loss <= 1e-9 and par <= 1e-9,
            f"{recipe}, weights gathered in {how}, world {d.world}: == "
            f"one-process reference (loss {loss:.1e}, params {par:.1e})",
        )
        shards = [m.weight.numel() for m in model.modules() if isinstance(m, fp8.Fp8Linear)]
        scales = sum(n // 128**2 * 4 for n in shards) if gather and recipe == "fine-grained" else 0
        theory = sum(2 * n * (1 if gather else 2) for n in shards) + scales
        got = comm.total("all_gather")
        gathered[recipe, gather] = got
        plus = " + block scales" if scales else ""
        check(
            got == theory,
            f"{recipe}, {how} all-gather: {got} bytes per rank and step counted == {theory} "
            f"(2 x shard elements x {1 if gather else 2}{plus}), d_model {args.d_model}, "
            f"{args.n_layers} layers, world {d.world}",
        )
    if d.world == 2:
        ratio = gathered[recipe, True] / gathered[recipe, False]
        check(0.5 <= ratio < 0.51, f"{recipe}: FP8 all-gather bytes / bf16's = {ratio:.4f}")

# 4. the file's default width (d_model 64, 4 heads): no dimension a multiple of 128, W's rows uneven at
# world 3 (ranks with an empty shard), 32 tokens a rank; weights gathered in bf16 at world 2, FP8 at 3
for recipe in ("current", "delayed", "fine-grained"):
    gather = d.world == 3
    argv = ["--recipe", recipe, "--n-layers", "1", "--seq-len", "16", "--steps", "2"]
    argv += ["--batch-size", str(2 * d.world)]
    args = parse_args(fp8.Args, argv + (["--fp8-all-gather"] if gather else []))
    comm = CommCounter()
    losses, params, model = train(args, comm)
    loss, par = diff(args, losses, params)
    # padded: K to whole tiles, W's rows to whole tiles a rank
    t = 128 if recipe == "fine-grained" else 16
    shapes = [(64, 64)] * 4 + [(256, 64), (64, 256)]  # (N, K): q, k, v, attn proj; mlp fc, proj
    rows = [-(-n // (d.world * t)) * t for n, _ in shapes]
    ks = [-(-k // t) * t for _, k in shapes]
    scales = sum(r * k // 128**2 * 4 for r, k in zip(rows, ks)) if gather and t == 128 else 0
    theory = sum(2 * r * k * (1 if gather else 2) for r, k in zip(rows, ks)) + scales
    got = comm.total("all_gather")
    check(
        loss <= 1e-9 and par <= 1e-9 and got == theory,
        f"default width, {recipe}, {'FP8' if gather else 'bf16'} gather at world {d.world}: == one-process "
        f"reference (loss {loss:.1e}, params {par:.1e}); padded shards' all-gather {got} bytes == {theory}",
    )

# 2. mutants: each must be caught by the same comparison
mutants = {
    "each rank's own amax": (
        "current",
        lambda: setattr(fp8, "global_amax", lambda t, g: own(t, None)),
    ),
    "the E5M2 gradient format forgotten": (
        "delayed",
        lambda: setattr(fp8.Current, "bwd", fp8.E4M3),
    ),
}
own, bwd = fp8.global_amax, fp8.Current.bwd
for what, (recipe, mutate) in mutants.items() if d.world == 2 else ():
    mutate()
    args = config(recipe, True)
    loss, par = diff(args, *train(args)[:2])
    fp8.global_amax, fp8.Current.bwd = own, bwd  # undone
    check(
        loss > 1e-6,
        f"negative: {recipe} with {what}: differs from the reference (loss {loss:.1e}, "
        f"params {par:.1e}), caught by the 1e-9 check",
    )

n_failed = torch.tensor([len(failures)], device=d.device)
dist.all_reduce(n_failed, group=group)
d.log(f"{int(n_failed)} CHECK(S) FAILED" if int(n_failed) else "ALL CHECKS PASSED")
close_dist(ok=int(n_failed) == 0)
