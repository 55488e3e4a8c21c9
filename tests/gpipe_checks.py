"""gpipe.py's core used on a model that is not the GPT, and gpipe.py broken on purpose: what
tests/test_gpipe.py checks under torchrun. The cases run in the order given, in one launch:

    copy-out:DIR   gpipe.py's technique section alone (tests/section.py: executed with torch and einops only,
                   as a copier takes it): gpipe_step on Net below, a stack of nested MLP blocks with odd
                   widths and parameters on the root module (one 0-dim), an MSE loss, 3 micro-batches, one
                   stage per rank, clipped by the whole model's norm as gpipe.main does (the section's
                   squared_norm, one all-reduce, torch's clip_grads_with_norm_); trained 3 steps as is, with
                   recompute=True, in a pipeline group whose ranks are the global ones reversed (stage s on
                   global rank 2 - s: prev and nxt are ranks within the group), and broken on purpose (an
                   observe callback that zeroes the stage's gradients before every B, so only the last
                   micro-batch's gradient is left). Each rank writes its parameters (by Net's names) and the
                   losses to DIR/rank{r}.pt, and for "plain" and "reversed" the transfers its first step posted,
                   in order (seen by a harness.CommCounter, peers as global ranks), and where each F and B
                   started among them; the test trains Net in one process itself and compares. Then each core
                   given what it cannot do (issue 30, deliver 2): the ValueError's text and the collectives the
                   counter saw before it, in DIR/rank{r}.pt's "bad".
    leak           gpipe.py --recompute whose stage forward keeps its graph alive (a buffer kept by mistake):
                   the arithmetic is unchanged, only the measured "held for B" bytes can notice. Runs
                   gpipe.main().

Run: torchrun --standalone --nproc_per_node=P tests/gpipe_checks.py copy-out:DIR,leak [gpipe.py's flags]"""

import contextlib
import os
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpipe  # noqa: E402  (the leak case runs its main)
import section  # noqa: E402
from harness import CommCounter  # noqa: E402

CORE = section.load("gpipe.py")  # the technique section alone, as a copier takes it

WIDTHS = (5, 7, 3, 6, 2)  # the features between Net's 4 blocks
BATCH, M, STEPS, LR, CLIP = 6, 3, 3, 0.05, 0.3  # 3 micro-batches of 2 samples


class Block(nn.Module):
    def __init__(self, a, b):
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(a, b), nn.Tanh(), nn.Linear(b, b))  # nested modules
        self.skip = nn.Linear(a, b, bias=False)

    def forward(self, x):
        return self.inner(x) + self.skip(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))
        # a parameter on the root module
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, WIDTHS[-1]))
        # shape (): a 0-dim gradient to clip (issue 30, defect 4)
        self.temp = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x * self.gain * self.temp


def build_net():
    torch.manual_seed(0)
    return Net().double()


def batch(step):
    """(BATCH, 5) inputs and (BATCH, 2) targets of `step`, float64."""
    g = torch.Generator().manual_seed(100 + step)
    return (
        torch.randn(BATCH, WIDTHS[0], generator=g, dtype=torch.float64),
        torch.randn(BATCH, WIDTHS[-1], generator=g, dtype=torch.float64),
    )


class StageOf(nn.Module):
    """Blocks [a, b) of a Net, and its root parameters on the last stage."""

    def __init__(self, net, a, b):
        super().__init__()
        self.blocks = net.blocks[a:b]
        self.gain, self.temp = (net.gain, net.temp) if b == len(net.blocks) else (None, None)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x if self.gain is None else x * self.gain * self.temp


def train_copied_out(how, group=None):
    """Net trained by the section's gpipe_step over the stages of `group` (stage s on its rank s; None: the
    world's): how = "plain", "recompute", "reversed" (group: the world's ranks reversed) or "broken"."""
    net, rank, world = build_net(), dist.get_rank(group), dist.get_world_size(group)
    a, b = CORE["split_layers"](len(net.blocks), world)[rank]
    stage = StageOf(net, a, b)
    opt = torch.optim.AdamW(stage.parameters(), lr=LR, foreach=False)
    prev, nxt = (
        (rank - 1 if rank > 0 else None),
        (rank + 1 if rank < world - 1 else None),
    )  # within the group

    @contextlib.contextmanager
    def forgetful(kind, mb):  # the bug: .grad zeroed before every B
        if kind == "B":
            stage.zero_grad(set_to_none=True)
        yield

    comm, starts = (
        CommCounter(log=True),
        [],
    )  # what "plain" posts in its first step, and where each op starts

    @contextlib.contextmanager
    def marking(kind, mb):
        starts.append((kind, mb, len(comm.calls_log)))
        yield

    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss_fn = lambda out, target: ((out - target) ** 2).sum() / y.numel()  # noqa: E731  (the batch's MSE)
        observe = (
            forgetful
            if how == "broken"
            else marking
            if how in ("plain", "reversed") and step == 0
            else None
        )
        with comm if observe is marking else contextlib.nullcontext():
            loss = CORE["gpipe_step"](
                stage,
                list(x.chunk(M)),
                list(y.chunk(M)),
                loss_fn,
                prev,
                nxt,
                (BATCH // M, WIDTHS[a]),
                recompute=how == "recompute",
                observe=observe,
                group=group,
            )
        grads = [
            q.grad for q in stage.parameters()
        ]  # then gpipe.main's clipping: a () norm of the whole model
        sq = CORE["squared_norm"](grads)
        dist.all_reduce(sq, group=group)
        torch.nn.utils.clip_grads_with_norm_(stage.parameters(), CLIP, sq.sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    names = {id(q): n for n, q in net.named_parameters()}
    return dict(
        params={names[id(q)]: q.detach().clone() for q in stage.parameters()},
        losses=losses,
        posted=[(c["op"], c["peer"]) for c in comm.calls_log],
        starts=starts,
    )


def bad_inputs():
    """Each core given what it cannot do: {what: (error, collectives the counter saw)}. The group of ranks
    [1, 0] (rank 2 outside it): this rank's group rank r, its peer 1 - r."""
    g = dist.new_group([1, 0], sort_ranks=False)
    me, x = dist.get_rank(g), torch.zeros(6, WIDTHS[0], dtype=torch.float64)
    stage = StageOf(build_net(), 0, 2)

    def step(xs, ys=None, prev=None, nxt="peer", group=g):
        nxt = 1 - me if nxt == "peer" else nxt
        return CORE["gpipe_step"](
            stage, xs, ys or [None] * len(xs), None, prev, nxt, (2, 7), group=group
        )

    cases = {
        "split_layers, 3 stages of 2 blocks": lambda: CORE["split_layers"](2, 3),
        "micro_batches, 7 rows into 2": lambda: CORE["micro_batches"](
            x.new_zeros(7, 4), 2, x.device
        ),
        "gpipe_step, no micro-batch": lambda: step([]),
        "gpipe_step, 3 inputs, 2 targets": lambda: step(list(x.chunk(3)), [None, None]),
        "gpipe_step, nxt a global rank past the group": lambda: step(list(x.chunk(3)), nxt=2),
        "gpipe_step, nxt this rank": lambda: step(list(x.chunk(3)), nxt=me),
        "gpipe_step, unequal micro-batches": lambda: step([x[:2], x[2:5], x[5:]]),
        "gpipe_step, a rank outside the group": lambda: step(list(x.chunk(3)), nxt=0),
    }
    out = {}
    for what, call in cases.items():
        if "outside" in what and me >= 0 or "outside" not in what and me < 0:
            continue  # the group's two ranks meet every case but the last; rank 2 only the last
        out[what] = section.attempt(call)  # (error, collectives counted)
    return out


def unwatched_registers():
    """gpipe.HeldForB is built once, before the loop, and observes only the last step: the forwards of the
    steps before it must register nothing (an entry for a storage freed long ago could stand in for a watched
    step's storage at the same address, which the allocator hands out again, and the entries would grow with
    the run). Returns (entries after 3 unobserved forwards, entries after one observed F)."""
    d = types.SimpleNamespace(
        device=torch.device("cpu"), rank=dist.get_rank(), world=dist.get_world_size()
    )
    args = types.SimpleNamespace(stage_ms=0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double()
    held = gpipe.HeldForB(d, args, net)
    for _ in range(3):
        net(torch.randn(2, 4, dtype=torch.float64))
    before, x = len(held.live.refs), torch.randn(2, 4, dtype=torch.float64)
    with held("F", 0):
        out = net(x)
    return before, len(held.live.refs), out.shape


def copy_out(out_dir):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # stage s: 2 - s
    backwards = dist.new_group(list(range(dist.get_world_size()))[::-1], sort_ranks=False)
    runs = {
        how: train_copied_out(how, backwards if how == "reversed" else None)
        for how in ("plain", "recompute", "reversed", "broken")
    }
    runs["bad"] = bad_inputs()
    runs["unwatched"] = unwatched_registers()[:2]
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def leak():
    real_forward, kept = gpipe.Stage.forward, []

    def keeps_its_graph(self, h):
        with torch.enable_grad():  # even inside F's no_grad under --recompute ...
            out = real_forward(self, h)
        kept.append(out)  # ... and kept until the end of the run
        return out

    gpipe.Stage.forward = keeps_its_graph
    gpipe.main()


if __name__ == "__main__":
    cases = sys.argv.pop(1).split(",")
    for case in cases:
        name, _, arg = case.partition(":")
        if name == "copy-out":
            copy_out(arg)
        elif name == "leak":
            leak()
        else:
            sys.exit(f"unknown case {case!r}")
