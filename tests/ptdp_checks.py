"""Break ptdp.py on purpose, or apply its core to another model, under torchrun:

    torchrun --nproc_per_node=4 tests/ptdp_checks.py BREAK [ptdp.py flags]
    torchrun --nproc_per_node=4 tests/ptdp_checks.py copy-out OUT.json [ptdp.py flags]

BREAK is one of
    norm-counts-replicas  every TP rank adds its copy of the replicated tensors to the clipping norm (t times)
    no-dp-all-reduce      the data-parallel gradient all-reduce after the flush is skipped
copy-out first calls each core of ptdp.py's technique section, loaded alone as a copier takes it
(section.load("ptdp.py"): torch and einops only), with each input it cannot run, under harness.CommCounter:
a ValueError and nothing sent. Then it trains a model that is not the GPT (nested modules, parameters on the
root module, one 0-dim, odd sizes, a squared-error loss) with the section's pieces (f and g around a split
MLP, PipelineRank and its comm_plan, finish_batch's clipping by the whole model's norm), pp 2 x tp 2, v = 2,
on a layout unlike main's grid: TP groups {0, 1} and {2, 3}, pipelines {0, 3} and {1, 2} (so a pipeline's
ranks are not 0..p-1 and its two stages' TP ranks differ), against plain one-process training written here
(torch's clip_grad_norm_); it writes the errors to OUT.json and then runs ptdp.py's own main (the same
processes, so the check costs no launch).
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import ptdp  # noqa: E402  (its main, run after the copy-out check)
import section  # noqa: E402
from common import build_gpt, GPTConfig, init_dist  # noqa: E402
from harness import CommCounter  # noqa: E402

core = section.load("ptdp.py")  # the technique section alone: what the copy-out check runs

D, HIDDEN, IN, OUT, BLOCKS, B, M, STEPS, LR, CLIP = 6, 10, 5, 3, 4, 12, 4, 3, 0.1, 0.3


class Residual(nn.Module):
    """x + W2 tanh(W1 LayerNorm(x) + b1) + b2: nested modules, a hidden width of 10 (5 per TP rank)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, D))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, D))  # a parameter on the root module
        self.temp = nn.Parameter(torch.tensor(1.5))  # shape (): a 0-dim gradient to clip (issue 30, defect 4)
        self.inp = nn.Linear(IN, D)
        self.blocks = nn.ModuleList(Residual() for _ in range(BLOCKS))
        self.out = nn.Linear(D, OUT)

    def forward(self, x):  # (b, IN) -> (b, OUT)
        h = self.inp(x) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temp


class TPResidual(nn.Module):
    """Residual with its MLP split over `group` the Megatron way, copied from ptdp's pieces: f, a
    column-parallel W1 (and b1), a row-parallel W2, g, then the whole b2."""

    def __init__(self, full, group):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        fc, proj = full.mlp[0], full.mlp[2]
        self.norm, self.group = full.norm, group
        self.w1 = nn.Parameter(fc.weight.detach().chunk(t, 0)[r].clone())  # (HIDDEN/t, D)
        self.b1 = nn.Parameter(fc.bias.detach().chunk(t, 0)[r].clone())
        self.w2 = nn.Parameter(proj.weight.detach().chunk(t, 1)[r].clone())  # (D, HIDDEN/t)
        self.b2 = proj.bias
        for q in (self.w1, self.b1, self.w2):
            q.tp_split = True  # a shard: finish_batch's norm counts it on every TP rank

    def forward(self, x):
        h = torch.tanh(F.linear(core["f"].apply(self.norm(x), self.group), self.w1, self.b1))
        return x + core["g"].apply(F.linear(h, self.w2), self.group) + self.b2


class NetChunk(nn.Module):
    def __init__(self, full, c, n, group):
        super().__init__()
        self.first, self.last = c == 0, c == n - 1
        if self.first:
            self.scale, self.inp = full.scale, full.inp
        self.blocks = nn.ModuleList(TPResidual(full.blocks[i], group) for i in (c,))  # one block each
        if self.last:
            self.out, self.temp = full.out, full.temp

    def forward(self, h):
        if self.first:
            h = self.inp(h) * self.scale
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temp if self.last else h


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(B, IN, generator=g, dtype=torch.float64)
    return x, torch.sin(x[:, :OUT] * 3) + 0.1 * torch.randn(B, OUT, generator=g, dtype=torch.float64)


def loss_of(out, y):  # squared error summed, over the whole batch's elements: micro-batch losses add up
    return ((out - y) ** 2).sum() / (B * OUT)


def reference():
    """Plain one-process training: the whole batch, one backward, torch's clip_grad_norm_, SGD."""
    torch.manual_seed(0)
    net = Net().double()
    opt, losses, norms, grads0 = torch.optim.SGD(net.parameters(), lr=LR), [], [], None
    for step in range(STEPS):
        x, y = batch(step)
        loss = loss_of(net(x), y)
        opt.zero_grad()
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), CLIP).item())
        grads0 = grads0 or {n: q.grad.clone() for n, q in net.named_parameters()}
        opt.step()
        losses.append(loss.item())
    return net, losses, norms, grads0


def refusals(pp_group, tp_group, alone, pp_rank):
    """Each core given what it cannot run: {case: (the error as "Type: message", the counter's calls)}; and the
    negatives: the TP block and the chunk with their checks cut out of the section's text take the bad sizes
    without an error (the heads or the layers silently wrong)."""
    tiny = build_gpt(GPTConfig(vocab=8, seq_len=4, d_model=6, n_heads=3, n_layers=2), 0, torch.float64)
    blocks = {c: NetChunk(Net().double(), c, BLOCKS, tp_group) for c in range(pp_rank, BLOCKS, 2)}

    def runner(group=pp_group, m=M):
        return core["PipelineRank"](blocks, group, m, (B // M, D), torch.float64, torch.device("cpu"))
    x, y = batch(0)
    cases = {
        "schedule, v 2, m 3 not a multiple of p 2": lambda: core["comm_plan"](2, 2, 3, pp_rank),
        "schedule, rank 2 of p 2": lambda: core["schedule"](2, 1, 4, 2),
        "schedule, m 0": lambda: core["schedule"](2, 1, 0, 0),
        "PipelineRank, m 3 not a multiple of p 2": lambda: runner(m=3),
        "PipelineRank, 2 chunks in a group of 4": lambda: runner(group=dist.group.WORLD),
        "PipelineRank, 2 chunks of a pipeline of 2 in a group of 1": lambda: runner(group=alone),
        "PipelineRank.run, m - 1 micro-batches": lambda: runner().run(list(x.view(M, -1, IN))[1:],
                                                                       list(y.view(M, -1, OUT))[1:], loss_of),
        "TPBlock, 3 heads over t 2": lambda: core["TPBlock"](tiny.blocks[0], tp_group),
        "Chunk, 2 layers in 4 chunks": lambda: core["Chunk"](tiny, 0, 4, tp_group),
        "Chunk, chunk 2 of 2": lambda: core["Chunk"](tiny, 2, 2, tp_group),
    }
    out, mutants = {}, {}
    for case, call in cases.items():
        out[case] = section.attempt(call)  # (error, collectives counted)
    for case, text in (("TPBlock, 3 heads over t 2", "if full.attn.n_heads % t:"),
                       ("Chunk, 2 layers in 4 chunks", "if full.cfg.n_layers % n or not 0 <= c < n:")):
        mutant = section.load("ptdp.py", (section.ROOT / "ptdp.py").read_text().replace(text, "if False:"))
        try:  # the negative: without its check the core takes the bad size silently (no error at all)
            (mutant["TPBlock"](tiny.blocks[0], tp_group) if "TPBlock" in case else mutant["Chunk"](tiny, 0, 4,
                                                                                                     tp_group))
            mutants[case] = "no error"
        except Exception as e:  # noqa: BLE001
            mutants[case] = f"{type(e).__name__}: {e}"
    return out, mutants


def copy_out(out_path):
    d = init_dist()
    p, t = 2, 2
    # not main's grid: TP groups {0, 1} and {2, 3}, pipelines {0, 3} and {1, 2}. Every rank creates every group
    # in the same order; a group numbers its ranks in global order, so pp and tp ranks come from the groups.
    tp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    pp_groups = [dist.new_group(r) for r in ([0, 3], [1, 2])]
    tp_group, pp_group = tp_groups[d.rank // 2], pp_groups[int(d.rank in (1, 2))]
    pp_rank, tp_rank = dist.get_rank(pp_group), dist.get_rank(tp_group)
    # the collective NCCL wants in a group before its first point-to-point
    dist.all_reduce(torch.zeros(1, device=d.device), group=pp_group)
    alone = [dist.new_group([r]) for r in range(4)][d.rank]  # no data parallelism: each rank its own replica
    bad, mutants = refusals(pp_group, tp_group, alone, pp_rank)
    net, ref_losses, ref_norms, ref_grads0 = reference()
    errors, counted = {}, {}
    real_f = vars(core["f"])["backward"]  # the staticmethod itself
    for order in ("interleaved", "interleaved, f without its all-reduce"):  # the second must fail
        core["f"].backward = staticmethod(lambda ctx, grad: (grad, None)) if "f without" in order else real_f
        torch.manual_seed(0)
        full = Net().double()
        mine = list(range(pp_rank, BLOCKS, p))
        chunks = {c: NetChunk(full, c, BLOCKS, tp_group) for c in mine}
        runner = core["PipelineRank"](chunks, pp_group, M, (B // M, D), torch.float64, d.device)
        params = [q for c in mine for q in chunks[c].parameters()]
        opt, losses, err = torch.optim.SGD(params, lr=LR), [], 0.0
        for step in range(STEPS):
            x, y = batch(step)
            with CommCounter(axes={"pp": pp_group, "tp": tp_group}) as comm:
                loss = runner.run(list(x.view(M, -1, IN)), list(y.view(M, -1, OUT)), loss_of)
                loss, _ = core["finish_batch"](params, loss, alone, tp_rank, 0, CLIP, dist.group.WORLD)  # clipped
            counted = counted or dict(comm.calls)  # the positive control: the counter sees this code's traffic
            losses.append(loss)
            if step == 0:  # every local gradient against the same slice of the one-process gradient
                err = max(err, max(diff(n, q.grad, ref_grads0, c, tp_rank, t) for c in mine
                                   for n, q in chunks[c].named_parameters()))
            opt.step()
            opt.zero_grad()
        final = {n: q.detach() for n, q in net.named_parameters()}
        mine_final = [diff(n, q, final, c, tp_rank, t) for c in mine for n, q in chunks[c].named_parameters()]
        err = max([err] + mine_final)
        err = torch.tensor([err, max(abs(a - b) for a, b in zip(losses, ref_losses))], dtype=torch.float64)
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[order] = dict(max_grad_or_param_diff=err[0].item(), max_loss_diff=err[1].item(), losses=losses)
    core["f"].backward = real_f
    # to rank 0, one row per rank: its pp rank, tp rank, the global ranks of its pipeline (pp rank order), and
    # per case 1 if the core raised a ValueError with nothing counted
    row = [pp_rank, tp_rank, *(dist.get_global_rank(pp_group, i) for i in range(p))]
    row += [v[0].startswith("ValueError") and not v[1] for v in bad.values()]
    rows = [torch.zeros(1, len(row), dtype=torch.float64) for _ in range(4)]
    dist.all_gather(rows, torch.tensor([row], dtype=torch.float64))
    rows = [[int(x) for x in r[0]] for r in rows]
    if d.rank == 0:
        Path(out_path).write_text(json.dumps(dict(
            errors, reference_losses=ref_losses, reference_norms=ref_norms, clip=CLIP, refusals=bad, mutants=mutants,
            refused_on_every_rank={case: all(r[4 + i] == 1 for r in rows) for i, case in enumerate(bad)},
            counted_step=counted, layout=[dict(pp=r[0], tp=r[1], pipeline=r[2:4]) for r in rows])))  # by rank
    return d


def diff(name, mine, ref, c, tp_rank, t):
    """|mine - the reference's slice|: a chunk's names map back to Net's (blocks.0 of chunk c is blocks.c)."""
    if mine is None:  # a gradient that never came
        return float("inf")
    full = {"scale": "scale", "temp": "temp", "inp.weight": "inp.weight", "inp.bias": "inp.bias", "out.weight": "out.weight",
            "out.bias": "out.bias"}.get(name)
    if full is None:
        leaf = name.split(".", 2)[2]  # "blocks.0.w1" -> "w1"
        full = {"w1": "mlp.0.weight", "b1": "mlp.0.bias", "w2": "mlp.2.weight", "b2": "mlp.2.bias",
                "norm.weight": "norm.weight", "norm.bias": "norm.bias"}[leaf]
        full = f"blocks.{c}.{full}"
        want = ref[full]
        if leaf in ("w1", "b1"):
            want = want.chunk(t, 0)[tp_rank]
        elif leaf == "w2":
            want = want.chunk(t, 1)[tp_rank]
    else:
        want = ref[full]
    return (mine - want).abs().max().item()


BREAK = sys.argv.pop(1)
if BREAK == "copy-out":
    d = copy_out(sys.argv.pop(1))
    ptdp.init_dist = lambda timeout: d  # ptdp.main runs in the same processes and process group
elif BREAK == "norm-counts-replicas":
    ptdp.squared_norm_piece = lambda params, tp_rank: sum((q.grad.double() ** 2).sum() for q in params)
elif BREAK == "no-dp-all-reduce":
    ptdp.sum_gradients = lambda params, group: None
else:
    sys.exit(f"unknown break {BREAK!r}")
ptdp.main()
