"""Watch or break pipedream.py on purpose, then run it as usual (each case patches one piece and calls the file's
own main()), and run its core (and zero_bubble.py's) on a model that is not the GPT:

    watch           nothing broken, only watched: where each backward's gradient lands (right after B, before
                    the policy takes it: which stashed version holds a gradient, and whether the live weights got
                    any), written into that B's event as grad_version / live_grad, so the --json events carry it;
                    every received tag checked against the schedule once per chunk; the host-to-device copies
                    of the batches counted. Every case below but copy-out runs with it.
    stash-newest    --mode stash whose backward runs on the newest weights instead of the version its forward read
                    (no weight stashing): the gradients land on the wrong tensors
    2bw-fewer       --mode 2bw with its m >= p guard lifted, so the drain would skip a norm
    resume-newest   resumed from a checkpoint with every stashed version replaced by the live weights (the
                    checkpoint's versions ignored): the run goes on, on the wrong weights
    copy-out OUT    pipedream.py's technique section alone (tests/section.py: executed with torch and einops
                    only, as a copier takes it): StageRunner + Flush under 1F1B, clipped, on three toy stages
                    that are not the GPT (nested modules, parameters on root modules, a 0-dim one, odd widths,
                    2-D and 3-D inputs to Linears, a smooth-L1 loss), plain torch.distributed on gloo; once more
                    with the optimizer's zero_grad dropped; then on two stages (the first two toy stages as one)
                    in the group of global ranks [2, 0] (stage 0 on rank 2, stage 1 on rank 0; rank 1 sits
                    out), the runner's and the norm's group. Writes OUT/{1f1b,1f1b-no-zero-grad,1f1b-2-stages}-
                    stage{s}.pt (the stage's parameters, stage 0's losses); tests/test_pipedream.py trains the
                    same model in one process. Then each core given what it cannot do (issue 30, deliver 2):
                    OUT/bad-rank{r}.pt, {case: (the error, the collectives a CommCounter saw before it)}.
    zb-copy-out OUT zero_bubble.py's technique section alone (tests/section.py): SplitBackward + comm_plan +
                    PipelineRank + finish_batch (clipped) on a ZBNet (not the GPT; a 0-dim parameter) over 2
                    ranks in the group [1, 0] (pp rank 0 on global rank 1), ZB-H1 and ZB-V, against one-process
                    training (and two broken W's), then each core given what it cannot do; OUT as JSON; then
                    zero_bubble.py's own main in the same processes (tests/test_zero_bubble.py).

Run: torchrun --standalone --nproc_per_node=P tests/pipeline_checks.py CASE [the file's flags]"""

import copy
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/section.py


# ----------------------------------------------------------------------------- the tags, from the schedule
def version_of(mode, vertical_sync, p, m, r, k):
    """The weight version stage r reads for micro-batch k, from each mode's rule (the docstring's tables)."""
    if mode == "flush":
        return k // m  # one update per step, after the drain
    if mode == "2bw":
        return max(k // m - 1, 0)
    return max(0, k - (p - 1 if vertical_sync else p - r - 1))


def expected_tag(mode, vertical_sync, p, m, s, kind, k, drained_norm):
    """{slot: value} that stage s's received tag for op (kind, k) must hold: the micro-batch, the sender's
    weight version and, for 2bw's forward, the newest batch whose norm the sender (stage 0's knowledge) knows."""
    sender = s - 1 if kind == "F" else s + 1
    expect = {0: k, 1: version_of(mode, vertical_sync, p, m, sender, k)}
    if kind == "F" and mode == "2bw":
        expect[2] = max((k - p + 1) // m - 1, drained_norm)
    return expect


def tag_errors(received):
    """[(expected {slot: value}, tag on the device)] -> the mismatches, with one host read for all of them."""
    if not received:
        return []
    rows = torch.stack([t for _, t in received]).cpu().tolist()
    return [
        f"tag {row} is not the schedule's {expect}"
        for (expect, _), row in zip(received, rows)
        if any(row[i] != v for i, v in expect.items())
    ]


def watch(pipedream, harness):
    args = pipedream.parse_args(pipedream.Args, sys.argv[1:])
    p, s, m = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), args.microbatches
    timelines, received, counts = [], [], dict(tags=0, landings=0, copies=0)

    class WatchedTimeline(harness.Timeline):
        def __init__(self, d, simulate=None, tags=()):
            super().__init__(d, simulate, tags=(*tags, "grad_version", "live_grad"))
            timelines.append(self)

    harness.Timeline = WatchedTimeline  # the one harness.PipelineWatch (pipedream.Observer) builds

    def landing(cls):
        on_backward = cls.on_backward

        def watched(self, k, v, partial):
            holding = [
                u
                for u, w in self.versions.items()
                if any(q.grad is not None for q in w.parameters())
            ]
            event = timelines[0].events[-1]
            assert (event["kind"], event["mb"]) == ("B", k), event
            event.update(
                grad_version=holding[0] if len(holding) == 1 else -2 if holding else -1,
                live_grad=int(any(q.grad is not None for q in self.stage.parameters())),
            )
            counts["landings"] += 1
            return on_backward(self, k, v, partial)

        cls.on_backward = watched

    landing(pipedream.Stash)
    landing(pipedream.TwoBW)
    exchange, run = pipedream.StageRunner.exchange, pipedream.StageRunner.run

    def watched_exchange(self, kind, k):
        drained = getattr(self.policy, "drained_norm", -1)  # read before the message can change it
        x, tag = exchange(self, kind, k)
        if tag is not None:
            received.append(
                (expected_tag(args.mode, args.vertical_sync, p, m, s, kind, k, drained), tag)
            )
        return x, tag

    def watched_run(self, ops):
        run(self, ops)
        errors, counts["tags"] = tag_errors(received), counts["tags"] + len(received)
        received.clear()
        if errors:
            raise RuntimeError(f"stage {s}: {errors[0]} ({len(errors)} such)")

    pipedream.StageRunner.exchange, pipedream.StageRunner.run = watched_exchange, watched_run
    to_device = pipedream.to_device

    def counted_to_device(m, device, *batch):
        # check_args's call, on a batch of no data, copies none
        counts["copies"] += any(t.numel() for t in batch)
        return to_device(m, device, *batch)

    pipedream.to_device = counted_to_device
    close = harness.close_dist

    def close_dist(ok=True):
        print(
            f"watch: stage {s} checked {counts['tags']} tags against the schedule and placed "
            f"{counts['landings']} backwards' gradients; copied {counts['copies']} batches",
            flush=True,
        )
        close(ok)

    harness.close_dist = close_dist


# ----------------------------------------------------------------------------- a model that is not the GPT
class Scaled(nn.Module):  # a parameter on the root module, the Linear nested below it
    def __init__(self, d_in, d):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.inner = nn.Sequential(nn.Linear(d_in, d), nn.Tanh())

    def forward(self, x):
        return self.inner(x) * self.gain


class Residual(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.mix = nn.Sequential(nn.Linear(d, d, bias=False), nn.GELU(), nn.Linear(d, d))

    def forward(self, x):
        return x + self.mix(self.norm(x))


# (b, T, d) -> (b, out): a 2-D input into a Linear, root parameters, one of them 0-dim
class Head(nn.Module):
    def __init__(self, d, out):
        super().__init__()
        self.shift = nn.Parameter(torch.full((out,), 0.1))
        # shape (): its gradient is 0-dim too (issue 30, defect 4)
        self.temp = nn.Parameter(torch.tensor(1.5))
        self.proj = nn.Linear(d, out, bias=False)

    def forward(self, x):
        return (self.proj(x.mean(1)) + self.shift) * self.temp


# 3 stages, batch m * b = 12
TOY = dict(widths=(5, 7, 11, 3), T=4, b=3, m=4, steps=3, lr=1e-2, clip=0.3)


def toy_stages(dtype=torch.float64):
    """Three stages, widths 5 -> 7 -> 11 -> 3, the same numbers on every call."""
    torch.manual_seed(1234)
    w = TOY["widths"]
    stages = [
        Scaled(w[0], w[1]),
        nn.Sequential(nn.Linear(w[1], w[2]), Residual(w[2])),
        Head(w[2], w[3]),
    ]
    return [s.to(dtype) for s in stages]


def toy_data(dtype=torch.float64):
    """Per step: inputs (m*b, T, 5) and targets (m*b, 3)."""
    g = torch.Generator().manual_seed(99)
    n = TOY["m"] * TOY["b"]
    return [
        (
            torch.randn(n, TOY["T"], TOY["widths"][0], generator=g, dtype=dtype),
            torch.randn(n, TOY["widths"][-1], generator=g, dtype=dtype),
        )
        for _ in range(TOY["steps"])
    ]


# not a cross-entropy: smooth L1, summed, over the global batch's element count
def toy_loss(out, y, n):
    return F.smooth_l1_loss(out, y, reduction="sum") / n


def toy_optimizer(params):
    return torch.optim.AdamW(params, lr=TOY["lr"], weight_decay=0.1, foreach=False)


def copy_out(out_dir):
    """The runner needs only torch: a process group, a stage module, an optimizer, a micro-batch source."""
    import torch.distributed as dist

    import section

    core = section.load("pipedream.py")  # the technique section alone, as a copier takes it
    dist.init_process_group("gloo")
    m, b, T, w = TOY["m"], TOY["b"], TOY["T"], TOY["widths"]
    assert dist.get_world_size() == 3, "copy-out runs three stages"
    data = toy_data()

    # micro-batch k: (b, T, 5) inputs for stage 0; (b, 3) targets and the global count for the last
    def source(
        k,
    ):
        x, y = data[k // m]
        j = slice(k % m * b, (k % m + 1) * b)
        return x[j], (y[j], y.numel())

    # the two-stage pipeline: stage 0 on rank 2, 1 on rank 0
    pair = dist.new_group([2, 0], sort_ranks=False)
    for name in ("1f1b", "1f1b-no-zero-grad", "1f1b-2-stages"):
        group, cuts = (pair, [0, 2, 3]) if "2-stages" in name else (None, [0, 1, 2, 3])
        r, n = dist.get_rank(group), dist.get_world_size(group)  # this rank's stage, the stages
        if r < 0:  # rank 1 sits out the two-stage pipeline
            continue
        # the collective NCCL wants before batched point-to-point
        dist.all_reduce(torch.zeros(1), group=group)
        whole = nn.Sequential(*toy_stages())
        stage, ins, outs = (
            whole[cuts[r] : cuts[r + 1]],
            w[cuts[r]],
            w[cuts[r + 1]],
        )  # toy stages [cut, next cut)
        policy = core["Flush"](stage, toy_optimizer(stage.parameters()), TOY["clip"], group=group)
        # broken on purpose: each step's gradient adds to the last one's
        if name == "1f1b-no-zero-grad":
            policy.opt.zero_grad = lambda set_to_none=True: None
        runner = core["StageRunner"](
            policy,
            source,
            lambda out, target: toy_loss(out, *target),
            (b, T, ins),
            (b, T, outs),
            torch.float64,
            torch.device("cpu"),
            group=group,
        )
        losses = []
        for step in range(TOY["steps"]):
            runner.run([(kind, step * m + k) for kind, k in core["one_f_one_b"](m, n, r)])
            runner.drain(step)
            assert not runner.alive, "a micro-batch left over"
            if r == 0:
                losses.append(sum(runner.losses.pop(step * m + j) for j in range(m)).item())
        names = {
            id(q): nm for nm, q in whole.named_parameters()
        }  # the whole model's names ("2.temp")
        torch.save(
            dict(params={names[id(q)]: q.detach() for q in stage.parameters()}, losses=losses),
            Path(out_dir) / f"{name}-stage{r}.pt",
        )
    torch.save(bad_inputs(core, pair), Path(out_dir) / f"bad-rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


def bad_inputs(core, pair):
    """Each core given what it cannot do: {case: (error, collectives the counter saw)}; pair: ranks [2, 0]."""
    import torch.distributed as dist

    import section

    stage = nn.Sequential(*toy_stages())
    opt = toy_optimizer(stage.parameters())
    cases = {
        "split_layers, 3 stages of 2 blocks": lambda: core["split_layers"](2, 3),
        "one_f_one_b, stage 2 of 2": lambda: core["one_f_one_b"](4, 2, 2),
        "to_device, 7 rows into 2": lambda: core["to_device"](
            2, torch.device("cpu"), torch.zeros(7, 3)
        ),
        "TwoBW, m 2 < p 3": lambda: core["TwoBW"](stage, opt, 2, 0.0),
        "StageRunner, a rank outside the group": lambda: core["StageRunner"](
            None, None, None, (1,), (1,), torch.float64, "cpu", group=pair
        ),
        "control: TwoBW, m 3 = p, drained": lambda: core["TwoBW"](stage, opt, 3, 0.0).drain(-1),
    }  # broadcasts
    out = {}
    for what, call in cases.items():
        if "outside" in what and dist.get_rank(pair) >= 0:
            continue  # rank 1 only
        out[what] = section.attempt(call)  # (error, collectives counted)
    return out


# ----------------------------------------------------------------------------- zero_bubble.py's core, copied out
ZB = dict(width=6, hidden=10, n_in=5, n_out=3, blocks=4, b=12, m=4, steps=3, lr=0.1, clip=0.3)


class ZBResidual(nn.Module):
    """x + W2 tanh(W1 LayerNorm(x) + b1) + b2: nested modules, a hidden width of 10."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(ZB["width"])
        self.mlp = nn.Sequential(
            nn.Linear(ZB["width"], ZB["hidden"]), nn.Tanh(), nn.Linear(ZB["hidden"], ZB["width"])
        )

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class ZBNet(nn.Module):
    """(b, 5) -> (b, 3): parameters on the root module (one 0-dim), an input Linear, 4 residual blocks, an
    output Linear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, ZB["width"]))
        # shape (): a 0-dim gradient to clip (issue 30, defect 4)
        self.temp = nn.Parameter(torch.tensor(1.5))
        self.inp = nn.Linear(ZB["n_in"], ZB["width"])
        self.blocks = nn.ModuleList(ZBResidual() for _ in range(ZB["blocks"]))
        self.out = nn.Linear(ZB["width"], ZB["n_out"])
        self.double()

    def forward(self, x):
        h = self.inp(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temp


class ToyChunk(nn.Module):
    """A chunk of a toy net: on the first, inp(x) * scale; its blocks; on the last, out(h) * temp. Its
    subclasses here and in tests/ptdp_checks.py set first, last, blocks and those modules."""

    def forward(self, h):
        if self.first:
            h = self.inp(h) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temp if self.last else h


def toy_batch(step, b, n_in, n_out):
    """(b, n_in) inputs and (b, n_out) regression targets of step `step`, float64, from one seed per step."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(b, n_in, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :n_out] * 3) + 0.1 * torch.randn(
        b, n_out, generator=g, dtype=torch.float64
    )


class ZBChunk(ToyChunk):
    """Chunk c of n of a ZBNet (4 blocks cut evenly), sharing its modules."""

    def __init__(self, net, c, n):
        super().__init__()
        self.first, self.last = c == 0, c == n - 1
        self.blocks = nn.ModuleList(
            net.blocks[i] for i in range(c * ZB["blocks"] // n, (c + 1) * ZB["blocks"] // n)
        )
        if self.first:
            self.scale, self.inp = net.scale, net.inp
        if self.last:
            self.out, self.temp = net.out, net.temp


def zb_batch(step):
    return toy_batch(step, ZB["b"], ZB["n_in"], ZB["n_out"])


# squared error summed, over the whole batch's elements: micro-batch losses add up
def zb_loss(out, y):
    return ((out - y) ** 2).sum() / (ZB["b"] * ZB["n_out"])


def zb_copy_out(d, out_path):
    """SplitBackward + comm_plan + PipelineRank + finish_batch (clipping by the whole model's norm), as a reader
    copies them (the technique section alone), on a ZBNet over 2 ranks in the group [1, 0] (pp rank r on global
    rank 1 - r; ZB-H1: 2 chunks; ZB-V: 4, two per rank in a V), plain SGD, against one-process training of the
    same net with torch's clip_grad_norm_: the first step's clipped gradients, the losses and the final
    parameters. Then the negatives: W never run; W of micro-batch k on micro-batch k-1's saved inputs. Writes
    {case: {max_diff, losses}}, the reference's losses and norms, and the bad inputs' errors."""
    import torch.distributed as dist

    import section

    # the section alone, as a copier takes it
    zero_bubble = SimpleNamespace(**section.load("zero_bubble.py"))
    pp = dist.new_group([1, 0], sort_ranks=False)  # the pipeline: pp rank 0 on global rank 1
    p, m, steps, r = dist.get_world_size(pp), ZB["m"], ZB["steps"], dist.get_rank(pp)
    ref, losses_ref, norms_ref, grads0 = ZBNet(), [], [], None
    opt = torch.optim.SGD(ref.parameters(), lr=ZB["lr"])
    for step in range(steps):
        x, y = zb_batch(step)
        loss = zb_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), ZB["clip"]).item())
        grads0 = grads0 or {n: q.grad.clone() for n, q in ref.named_parameters()}
        opt.step()
        losses_ref.append(loss.item())
    alone = [dist.new_group([q]) for q in range(p)][
        d.rank
    ]  # no data parallelism: each rank its own replica
    final = {n: q.detach() for n, q in ref.named_parameters()}
    results, real_w = {}, zero_bubble.SplitBackward.backward_weight
    for case in ("zbh1", "zbv", "zbh1, W never run", "zbv, W on the previous micro-batch"):
        schedule = case.split(",")[0]
        order, n_chunks, holder = zero_bubble.SCHEDULES[schedule]
        n = n_chunks(p)
        net = ZBNet()
        mine = [c for c in range(n) if holder(c, p) == r]  # by pp rank
        chunks = {c: ZBChunk(net, c, n) for c in mine}
        split = zero_bubble.SplitBackward(nn.ModuleList(chunks.values()))
        plan = zero_bubble.comm_plan([order(p, m, q) for q in range(p)], n, r)
        runner = zero_bubble.PipelineRank(
            chunks, n, plan, split, pp, (ZB["b"] // m, ZB["width"]), torch.float64, d.device
        )
        if "never" in case:
            split.backward_weight = lambda saved: None
        # W of micro-batch k on k-1's saved (x, dy): k-1's weight gradient twice, k's never
        if "previous" in case:

            def previous(saved, seen=[]):  # noqa: B006  (a memo kept across calls, on purpose)
                real_w(seen[-1] if seen else saved)
                seen.append(saved)

            split.backward_weight = previous
        params = list(nn.ModuleList(chunks.values()).parameters())
        params = list({id(q): q for q in params}.values())
        opt, losses, err = torch.optim.SGD(params, lr=ZB["lr"]), [], 0.0
        names = {id(q): nm for nm, q in net.named_parameters()}
        for step in range(steps):
            x, y = zb_batch(step)
            loss = runner.run(
                list(x.view(m, -1, ZB["n_in"])), list(y.view(m, -1, ZB["n_out"])), zb_loss
            )
            missing = [
                q for q in params if q.grad is None
            ]  # a W never run leaves its Linears without one:
            for q in missing:  # zeros, so that finish_batch runs and the comparison sees them
                q.grad = torch.zeros_like(q)
            # summed loss; clipped
            loss, _ = zero_bubble.finish_batch(params, loss, alone, pp, ZB["clip"])
            losses.append(loss)
            if step == 0:
                err = max(
                    [err, float("inf") if missing else 0.0]
                    + [(q.grad - grads0[names[id(q)]]).abs().max().item() for q in params]
                )
            opt.step()
            opt.zero_grad()
        err = max([err] + [(q.detach() - final[names[id(q)]]).abs().max().item() for q in params])
        err = torch.tensor(
            [err, max(abs(a - b) for a, b in zip(losses, losses_ref))], dtype=torch.float64
        )
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        results[case] = dict(max_diff=err[0].item(), max_loss_diff=err[1].item(), losses=losses)
    import json

    Path(f"{out_path}.bad-rank{d.rank}").write_text(json.dumps(zb_bad_inputs(zero_bubble, pp, r)))
    if d.rank == 0:
        Path(out_path).write_text(
            json.dumps(dict(results, reference_losses=losses_ref, reference_norms=norms_ref))
        )


def zb_bad_inputs(zb, pp, r):
    """Each zero_bubble core given what it cannot do: {case: [error, collectives the counter saw]}."""
    import torch.distributed as dist

    import section

    plan = zb.comm_plan([zb.zbh1(2, 4, q) for q in range(2)], 2, r)  # a valid ZB-H1 plan, p 2, m 4
    net, split = ZBNet(), zb.SplitBackward(nn.Linear(2, 2))
    net.temp.grad = torch.ones_like(net.temp)  # for the control
    chunks = {r: ZBChunk(net, r, 2)}
    x = torch.zeros(4, 3, ZB["n_in"], dtype=torch.float64)

    def runner(plan=plan, group=pp):
        return zb.PipelineRank(
            chunks, 2, plan, split, group, (3, ZB["width"]), torch.float64, "cpu"
        )

    outside = dist.new_group([0])  # rank 1 is not in it
    cases = {
        "split_layers, 5 chunks of 4 blocks": lambda: zb.split_layers(4, 5),
        "zbv, m 2 at p 2": lambda: zb.zbv(2, 2, 0),
        "ideal_timeline, ranks' orders of two schedules": lambda: zb.ideal_timeline(
            [zb.zbh1(2, 4, 0), zb.zbh1(2, 3, 1)], 2
        ),
        "PipelineRank, a plan for p 3 in a group of 2": lambda: runner(
            zb.comm_plan([zb.zbh1(3, 4, q) for q in range(3)], 3, 1)
        ),
        "PipelineRank, a rank outside the group": lambda: runner(group=outside),
        "PipelineRank.run, 3 micro-batches for a plan of 4": lambda: runner().run(
            list(x[:3]), [None] * 3, None
        ),
        "PipelineRank.run, unequal micro-batches": lambda: runner().run(
            [x[0], x[1], x[2], x[3, :2]], [None] * 4, None
        ),
        "control: finish_batch":  # valid: two all-reduces
        lambda: zb.finish_batch([net.temp], torch.zeros((), dtype=torch.float64), pp, pp, 0.0),
    }
    out = {}
    for what, call in cases.items():
        if "outside" in what and dist.get_rank(outside) >= 0:
            continue  # rank 1 only
        out[what] = section.attempt(call)  # (error, collectives counted)
    return out


if __name__ == "__main__":
    case = sys.argv.pop(1)
    # then zero_bubble.py's own main, in the same processes (no extra launch)
    if case == "zb-copy-out":
        import zero_bubble
        from common import init_dist

        d = init_dist()
        zb_copy_out(d, sys.argv.pop(1))
        zero_bubble.init_dist = lambda timeout: d
        zero_bubble.main()
        sys.exit(0)
    import harness
    import pipedream

    if case == "copy-out":
        copy_out(sys.argv.pop(1))
        sys.exit(0)
    watch(pipedream, harness)
    if case == "stash-newest":
        stashed_backward = pipedream.StageRunner.backward

        def backward_on_newest(self, k, grad, tag):
            inp, out, v = self.alive[k]
            newest = self.policy.versions[
                max(self.policy.versions)
            ]  # the latest update's, not version v
            x, target = self.source(k)
            out = newest(x if self.prev is None else inp)
            if self.next is None:
                out = self.loss_fn(out, target)
            self.alive[k] = (inp, out, v)
            stashed_backward(self, k, grad, tag)

        pipedream.StageRunner.backward = backward_on_newest
    elif case == "2bw-fewer":  # both guards lifted: check_args's and TwoBW's own ValueError
        real_fail, real_init = pipedream.fail, pipedream.TwoBW.__init__
        pipedream.fail = lambda msg: None if "2bw needs m >= p" in msg else real_fail(msg)

        def unguarded(self, stage, opt, m, clip, group=None):
            # passes the guard
            real_init(self, stage, opt, max(m, int(os.environ["WORLD_SIZE"])), clip, group)
            self.m = m  # ... and then runs with m < p

        pipedream.TwoBW.__init__ = unguarded
    elif case == "resume-newest":
        load_with_versions = pipedream.PolicyState.load_state_dict

        def load_live_only(self, state):
            load_with_versions(self, state)
            pol = self.policy  # each kept version = the live weights
            pol.versions = {v: copy.deepcopy(pol.stage) for v in pol.versions}

        pipedream.PolicyState.load_state_dict = load_live_only
    elif case != "watch":
        sys.exit(f"unknown case {case!r}")
    pipedream.main()
