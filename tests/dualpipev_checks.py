"""torchrun helper for tests/test_dualpipev.py (2 ranks):

    torchrun --nproc_per_node=2 tests/dualpipev_checks.py copy-out OUT [dualpipev.py flags]

dualpipev.py's technique section alone (tests/section.py), as a copier takes it: SplitBackward + dualpipev +
comm_plan + PipelineRank + finish_batch (clipped by the whole model's norm) on pipeline_checks.ZBNet (not the
GPT: nested modules, root parameters, one 0-dim, 2-D inputs, squared error), 4 chunks in a V over 2 ranks in
the group [1, 0] (pp rank r on global rank 1 - r), plain SGD, against one-process training of the same net
with torch's clip_grad_norm_: the first step's clipped gradients, the losses and the final parameters. The
negative: W never run. Then each core given what it cannot do (a ValueError before any collective), and
dualpipev.py's own main in the same processes (no extra launch). Writes OUT and OUT.bad-rank{r}."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
import section  # noqa: E402
from pipeline_checks import ZB, ZBChunk, ZBNet, zb_batch, zb_loss  # noqa: E402


def copy_out(d, out_path):
    dpv = SimpleNamespace(**section.load("dualpipev.py"))  # the section alone
    pp = dist.new_group([1, 0], sort_ranks=False)  # the pipeline: pp rank 0 on global rank 1
    p = dist.get_world_size(pp)
    m = ZB["m"]
    steps = ZB["steps"]
    r = dist.get_rank(pp)
    n = 2 * p
    ref = ZBNet()
    losses_ref, norms_ref, grads0 = [], [], None
    opt = torch.optim.SGD(ref.parameters(), lr=ZB["lr"])
    for step in range(steps):
        x, y = zb_batch(step)
        loss = zb_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        norms_ref.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), ZB["clip"]).item())
        grads0 = grads0 or {nm: q.grad.clone() for nm, q in ref.named_parameters()}
        opt.step()
        losses_ref.append(loss.item())
    alone = [dist.new_group([q]) for q in range(p)][d.rank]  # no data parallelism
    final = {nm: q.detach() for nm, q in ref.named_parameters()}
    results = {}
    for case in ("dualpipev", "dualpipev, W never run"):
        net = ZBNet()
        chunks = {c: ZBChunk(net, c, n) for c in range(n) if dpv.holder(c, p) == r}
        split = dpv.SplitBackward(nn.ModuleList(chunks.values()))
        plan = dpv.comm_plan([dpv.dualpipev(p, m, q) for q in range(p)], n, r)
        runner = dpv.PipelineRank(
            chunks, n, plan, split, pp, (ZB["b"] // m, ZB["width"]), torch.float64, d.device
        )
        if "never" in case:
            split.backward_weight = lambda saved: None
        params = list({id(q): q for q in nn.ModuleList(chunks.values()).parameters()}.values())
        opt = torch.optim.SGD(params, lr=ZB["lr"])
        losses, err = [], 0.0
        names = {id(q): nm for nm, q in net.named_parameters()}
        for step in range(steps):
            x, y = zb_batch(step)
            loss = runner.run(
                list(x.view(m, -1, ZB["n_in"])), list(y.view(m, -1, ZB["n_out"])), zb_loss
            )
            missing = [q for q in params if q.grad is None]  # W never run: no Linear gradient
            for q in missing:
                q.grad = torch.zeros_like(q)
            loss, _ = dpv.finish_batch(params, loss, alone, pp, ZB["clip"])
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
    Path(f"{out_path}.bad-rank{d.rank}").write_text(json.dumps(bad_inputs(dpv, pp, r)))
    if d.rank == 0:
        Path(out_path).write_text(
            json.dumps(dict(results, reference_losses=losses_ref, reference_norms=norms_ref))
        )


def bad_inputs(dpv, pp, r):
    """Each dualpipev core given what it cannot do: {case: [error, collectives the counter saw]}."""
    plan = dpv.comm_plan([dpv.dualpipev(2, 4, q) for q in range(2)], 4, r)  # valid: p 2, m 4
    net = ZBNet()
    split = dpv.SplitBackward(nn.Linear(2, 2))
    net.temp.grad = torch.ones_like(net.temp)  # for the control
    chunks = {c: ZBChunk(net, c, 4) for c in (r, 3 - r)}
    x = torch.zeros(4, 3, ZB["n_in"], dtype=torch.float64)

    def runner(plan=plan, group=pp):
        return dpv.PipelineRank(
            chunks, 4, plan, split, group, (3, ZB["width"]), torch.float64, "cpu"
        )

    outside = dist.new_group([0])  # rank 1 is not in it
    cases = {
        "split_layers, 5 chunks of 4 blocks": lambda: dpv.split_layers(4, 5),
        "dualpipev, m 3 at p 2": lambda: dpv.dualpipev(2, 3, 0),
        "dualpipev, p 1": lambda: dpv.dualpipev(1, 4, 0),
        "ideal_timeline, ranks' slots of two schedules": lambda: dpv.ideal_timeline(
            [dpv.dualpipev(2, 4, 0), dpv.dualpipev(2, 5, 1)], 4
        ),
        "PipelineRank, a plan for p 3 in a group of 2": lambda: runner(
            dpv.comm_plan([dpv.dualpipev(3, 6, q) for q in range(3)], 6, 1)
        ),
        "PipelineRank, a rank outside the group": lambda: runner(group=outside),
        "PipelineRank.run, 3 micro-batches for a plan of 4": lambda: runner().run(
            list(x[:3]), [None] * 3, None
        ),
        "PipelineRank.run, unequal micro-batches": lambda: runner().run(
            [x[0], x[1], x[2], x[3, :2]], [None] * 4, None
        ),
        "control: finish_batch":  # valid: two all-reduces
        lambda: dpv.finish_batch([net.temp], torch.zeros((), dtype=torch.float64), pp, pp, 0.0),
    }
    out = {}
    for what, call in cases.items():
        if "outside" in what and dist.get_rank(outside) >= 0:
            continue  # rank 1 only
        out[what] = section.attempt(call)  # (error, collectives counted)
    return out


if __name__ == "__main__":
    case = sys.argv.pop(1)
    if case != "copy-out":
        sys.exit(f"unknown case {case!r}")
    import dualpipev
    from common import init_dist

    d = init_dist()
    copy_out(d, sys.argv.pop(1))
    dualpipev.init_dist = lambda timeout: d
    dualpipev.main()
