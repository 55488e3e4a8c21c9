"""What the tests of the two MoE files share, written once:

- for tests/moe_checks.py and tests/moe_deepseek_checks.py (4-rank launches): a check's verdict agreed over
  every rank, relative differences, a refusal watched by the collective counter, one layout's parity against
  the one-process reference, and the end of the run (ALL CHECKS PASSED, or exit 1);
- for tests/test_moe.py and tests/test_moe_deepseek.py: the module's one launch of its checks, the reading of
  their PASS lines, and the copy-out check: a technique section's MoE layer in a residual stack that is not
  the GPT, trained expert parallel against the same stack trained by plain torch in one process.
"""

import importlib
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from common import MarkovData, close_dist, init_dist
from harness import CommCounter

TOL = 1e-9
results = []  # every check's verdict, agreed over the ranks


def start(script, make_layout):
    """The checks' process group (world 1, 2 or 4; else the command that runs them), the rank's seed, the
    data, and the layouts: EP 1, 2 and 4 wherever they divide the world."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = init_dist(120)
    if d.world not in (1, 2, 4):  # 4 checks every EP degree; 1 and 2 (one GPU, two) check what fits
        print(f"run me as: torchrun --nproc_per_node=4 {script}", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(d.rank)
    return d, MarkovData(32, 0), {ep: make_layout(d, ep) for ep in (1, 2, 4) if d.world % ep == 0}


def gmax(d, x):
    """The largest value over ranks (every rank gets it), through a tensor on the device (NCCL needs it)."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check(d, name, ok, detail=""):
    ok = gmax(d, 0.0 if ok else 1.0) == 0.0  # passed on every rank
    results.append(ok)
    d.log(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check_parity(d, name, ref_first, ref, first, trained):
    """One layout against the one-process reference: step 0's outputs, aux loss and gradients (`first`, this
    rank's rows: logits, aux, full gradients, row0, rows; `ref_first` the one process's) and, after training,
    the losses and full parameters (`trained`; `ref`: the file's moe_reference), each within TOL relative over
    every rank, and the same parameter names. Returns the full parameters."""
    (ref_logits, ref_aux, ref_grads), (logits, aux, grads, row0, rows) = ref_first, first
    losses, full = trained
    out_diff = rel(logits, ref_logits[row0 : row0 + rows])
    grad_diff = max(rel(grads[n], g) for n, g in ref_grads.items())
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
    param_diff = max((full[n] - p).abs().max().item() for n, p in ref["params"].items())
    aux_diff = abs(aux - ref_aux) / max(abs(ref_aux), 1e-300)
    diffs = [gmax(d, v) for v in (out_diff, aux_diff, grad_diff, loss_diff, param_diff)]
    check(
        d,
        name,
        max(diffs) <= TOL and set(full) == set(ref["params"]),
        "rel diff: outputs {:.1e}, aux {:.1e}, grads {:.1e}, losses after 3 steps {:.1e}; params {:.1e}".format(
            *diffs
        ),
    )
    return full


def refusal(call, axes):
    """The message of the ValueError `call()` raises (None: none) and the collectives seen meanwhile."""
    with CommCounter(axes=axes) as comm:
        try:
            call()
            msg = None
        except ValueError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 (another error is a failure, reported)
            msg = f"not a ValueError: {type(e).__name__}: {e}"
    return msg, dict(comm.calls)


def sections(file):
    """`file`'s technique section run alone (tests/section.py), and the same with every check a no-op."""
    import section

    mutant = (section.ROOT / file).read_text().replace("raise ValueError(", "str(")
    return section.load(file), section.load(file, mutant)


def check_builds(d, what, builds, layer, core, mutant, axes):
    """builds: name -> (keywords, words). layer(ns, **keywords) built from the section `core` must raise a
    ValueError containing the words before any collective; from the `mutant` (its checks turned into no-ops)
    it is built silently, or fails otherwise: never with the clear message."""
    for name, (kw, words) in builds.items():
        msg, calls = refusal(lambda: layer(core, **kw), axes)
        check(
            d,
            f"bad input: {what}({name}) refused before any collective",
            msg is not None and all(w in msg for w in words) and not calls,
            f"{msg}; collectives {calls}",
        )
        msg, _ = refusal(lambda: layer(mutant, **kw), axes)  # built silently, or another error
        check(
            d,
            f"bad input mutant: without its check, {what}({name}) is not refused clearly",
            msg is None or msg.startswith("not a ValueError"),
            "built silently" if msg is None else msg,
        )


def check_all_to_all(d, cases, good, control, axes):
    """cases: [(name, call, words)], AllToAll calls refused before the collective; good(): one that goes
    through, its one forward all-to-all seen by the same counter (`control` says which)."""
    for name, call, words in cases:
        msg, calls = refusal(call, axes)
        check(
            d,
            f"bad input: AllToAll of {name} refused before the collective",
            msg is not None and all(w in msg for w in words) and not calls,
            f"{msg}; collectives {calls}",
        )
    msg, calls = refusal(good, axes)
    check(
        d,
        f"bad input control: {control} goes through, seen by the counter",
        msg is None and calls.get("all_to_all/ep/fwd") == 1,
        f"{msg}; collectives {calls}",
    )


def finish(d, layouts, test_module, bad_input):
    """At EP 2: the copy-out check written in `test_module` (in a world of 4: EP 2 x 2 replicas), then the
    cores' refusals (bad_input); then the verdict of every check: ALL CHECKS PASSED, or exit 1."""
    if 2 in layouts and d.world == 4:
        for name, ok, detail in importlib.import_module(test_module).copy_out(d, layouts[2]):
            check(d, name, ok, detail)
    if 2 in layouts:
        bad_input(d, layouts[2])
    passed = all(results)
    d.log("ALL CHECKS PASSED" if passed else f"{results.count(False)} CHECKS FAILED")
    close_dist(ok=passed)


# ----------------------------------------------------------------------------- for the test modules
def launch_checks(script, tmp_path_factory):
    """`script` (tests/moe_checks.py, tests/moe_deepseek_checks.py) at world 4, once a module: its output."""
    from helpers import torchrun

    _, out = torchrun(
        script, 4, tmp_path=tmp_path_factory.mktemp("checks"), name="checks", timeout=600
    )
    return out


def assert_all_pass(out, marker, n):
    """The checks' output has n lines containing `marker`, and every one of them passed."""
    lines = [l for l in out.splitlines() if marker in l]
    assert len(lines) == n and all(l.startswith("PASS") for l in lines), (
        "\n".join(lines) or out[-3000:]
    )


def rel_diff(got, want):
    want = torch.as_tensor(want, dtype=torch.float64)
    return ((got.detach().reshape(want.shape) - want).abs().max() / want.abs().max()).item()


# The copy-out: a model that is not the GPT (a parameter on the root module, nested modules, odd sizes: width
# 6, expert width 10, 6 experts, 5 positions, 3 input features; an MSE loss), expert parallel at EP 2 x 2
# replicas, against the same model with every expert local trained by plain torch in one process.
D, EXPERTS, HIDDEN, FEATURES, SEQ, ROWS = 6, 6, 10, 3, 5, 8


class ResidualMoEStack(nn.Module):
    """Two residual blocks LayerNorm -> MoE; layer(i, gen) makes block i's MoE from the experts' generator."""

    def __init__(self, layer):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(D))  # on the root module
        self.inp = nn.Linear(FEATURES, D)
        # the experts' initial weights: the same whatever the layout
        gen = torch.Generator().manual_seed(5)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(D), layer(i, gen)) for i in range(2))

    def forward(self, x):  # (b, SEQ, FEATURES) -> (b, SEQ, D)
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return h * self.gain


def full_state(model, MoE, ep_group):
    """Parameters and buffers by name, each MoE layer's expert shards all-gathered over the EP group (written
    here: each file's full_params knows only its own GPT's layers)."""
    out = dict(model.named_parameters()) | dict(model.named_buffers())
    ep = dist.get_world_size(ep_group)
    for prefix, m in ((n, m) for n, m in model.named_modules() if isinstance(m, MoE)):
        for w in ("w1", "b1", "w2", "b2"):
            parts = [torch.empty_like(getattr(m, w)) for _ in range(ep)]
            dist.all_gather(parts, getattr(m, w).detach().contiguous(), group=ep_group)
            out[f"{prefix}.{w}"] = torch.cat(parts)  # (E, ...): EP rank j holds experts j E/ep ..
    return out


def copy_out_case(
    d,
    lay,
    name,
    build,
    MoE,
    sync_grads,
    aux_share,
    steps=3,
    aux_weight=0.1,
    on_step=lambda model, step, row0: None,
    ref_update=lambda layers: None,
    ep_update=lambda model: None,
):
    """[(name, ok, detail)] twice: build(ep_group) -> (a ResidualMoEStack of the section's class MoE, its
    AdamW), trained on my rows at EP with sync_grads, equals it trained on the whole batch in one process
    (losses and every parameter and buffer within 1e-9); the negative: without sync_grads the parameters
    differ. aux_share(model): my share of the mean aux loss. on_step(model, step, row0) runs before each
    forward, ref_update(layers) and ep_update(model) after each optimizer step of the reference and of the
    EP run."""
    rows = ROWS // d.world
    row0 = d.rank * rows
    g = torch.Generator().manual_seed(11)
    data = [
        (
            torch.randn(ROWS, SEQ, FEATURES, generator=g, dtype=torch.float64).to(d.device),
            torch.randn(ROWS, SEQ, D, generator=g, dtype=torch.float64).to(d.device),
        )
        for _ in range(steps)
    ]
    # 1. the reference: plain torch, one process, the whole batch, every expert local
    ref, opt = build(None)
    ref_losses, layers = [], [m for m in ref.modules() if isinstance(m, MoE)]
    assert len(layers) == 2  # the section's own class
    for step, (x, t) in enumerate(data):
        on_step(ref, step, 0)
        mse = F.mse_loss(ref(x), t, reduction="sum") / t.numel()
        loss = mse + aux_weight * sum(m.aux.mean() for m in layers) / len(layers)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ref_update(layers)
        ref_losses.append(loss.item())
    want = dict(ref.named_parameters()) | dict(ref.named_buffers())
    # 2. expert parallel: my rows, my experts; gradients synced by sync_grads (or not: the negative)
    verdicts = []
    for synced in (True, False):
        model, opt = build(lay.ep_group)
        losses = []
        for step, (x, t) in enumerate(data):
            on_step(model, step, row0)
            mse = (
                F.mse_loss(model(x[row0 : row0 + rows]), t[row0 : row0 + rows], reduction="sum")
                / t.numel()
            )
            loss = mse + aux_weight * aux_share(model)
            opt.zero_grad()
            loss.backward()
            if synced:
                sync_grads(model, lay.ep_group, lay.replica_group, dist.group.WORLD)
            opt.step()
            ep_update(model)
            total = loss.detach().clone()
            dist.all_reduce(total)
            losses.append(total.item())
        got = full_state(model, MoE, lay.ep_group)
        loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
        param_diff = max((got[n] - p).abs().max().item() for n, p in want.items())
        detail = f"rel loss diff {loss_diff:.1e}, param diff {param_diff:.1e}"
        if synced:
            ok = got.keys() == want.keys() and max(loss_diff, param_diff) < 1e-9
            what = "EP 2 x 2 replicas = one-process torch training of a residual MoE stack"
            verdicts.append((f"{name}: {what}", ok, detail))
        else:
            verdicts.append(
                (
                    f"{name}: negative: without sync_grads the parameters differ",
                    param_diff > 1e-6,
                    detail,
                )
            )
    return verdicts
