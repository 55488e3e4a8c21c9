"""Break ptdp.py on purpose, or apply its core to another model, under torchrun:

    torchrun --nproc_per_node=4 tests/ptdp_checks.py BREAK [ptdp.py flags]
    torchrun --nproc_per_node=4 tests/ptdp_checks.py [copy-out OUT.json] runs RUNS.json OUTDIR

BREAK is a mutant name of MUTANTS (below): ptdp.py's text with one line changed, run once.
copy-out first calls each core of ptdp.py's technique section, loaded alone as a copier takes it
(section.load("ptdp.py"): torch and einops only), with each input it cannot run, under harness.CommCounter:
a ValueError and nothing sent. Then it trains a model that is not the GPT (nested modules, parameters on the
root module, one 0-dim, odd sizes, a squared-error loss) with the section's pieces (f and g around a split
MLP, PipelineRank and its comm_plan, finish_batch's clipping by the whole model's norm), pp 2 x tp 2, v = 2,
on a layout unlike main's grid: TP groups {0, 1} and {2, 3}, pipelines {0, 3} and {1, 2} (so a pipeline's
ranks are not 0..p-1 and its two stages' TP ranks differ), against plain one-process training written here
(torch's clip_grad_norm_). Then the four-axis pieces (issue 41): TPBlock with its zig-zag ring attention and
ShardedOptimizer (ZeRO-1) on a foreign attention model (continuous inputs, width 6, 2 heads of 3, MLP width
10, a 0-dim parameter, 407 elements per TP rank: ZeRO-1 pads them to 2 shards, squared error), tp 2 x
cp 2 on groups unlike main's: TP {0, 2} and {1, 3}, CP {0, 1} and {2, 3} (cp innermost), optimizer state
sharded over the CP group, against one-process AdamW with torch's clip_grad_norm_; and the same with the
optimizer shard updated from its neighbour's slice (must fail).
It writes the errors to OUT.json.
runs: ptdp.py's own main() once per entry of RUNS.json ({"name", "argv", "mutant"}), in these processes
and this process group, each writing OUTDIR/NAME.json (a launch costs no new processes per run).
"""

import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import section  # noqa: E402
from common import GPTConfig, build_gpt, init_dist  # noqa: E402
from harness import CommCounter  # noqa: E402
from pipeline_checks import ToyChunk, toy_batch  # noqa: E402  (the toy model zero_bubble.py's check uses)

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
        # shape (): a 0-dim gradient to clip (issue 30, defect 4)
        self.temp = nn.Parameter(torch.tensor(1.5))
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


# its forward: inp * scale on the first chunk, the blocks, out * temp on the last
class NetChunk(ToyChunk):
    def __init__(self, full, c, n, group):
        super().__init__()
        self.first, self.last = c == 0, c == n - 1
        if self.first:
            self.scale, self.inp = full.scale, full.inp
        # one block each
        self.blocks = nn.ModuleList(TPResidual(full.blocks[i], group) for i in (c,))
        if self.last:
            self.out, self.temp = full.out, full.temp


def batch(step):
    return toy_batch(step, B, IN, OUT)


# squared error summed, over the whole batch's elements: micro-batch losses add up
def loss_of(out, y):
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
    tiny = build_gpt(
        GPTConfig(vocab=8, seq_len=4, d_model=6, n_heads=3, n_layers=2), 0, torch.float64
    )
    blocks = {c: NetChunk(Net().double(), c, BLOCKS, tp_group) for c in range(pp_rank, BLOCKS, 2)}

    def runner(group=pp_group, m=M):
        return core["PipelineRank"](
            blocks, group, m, (B // M, D), torch.float64, torch.device("cpu")
        )

    x, y = batch(0)
    cases = {
        "schedule, v 2, m 3 not a multiple of p 2": lambda: core["comm_plan"](2, 2, 3, pp_rank),
        "schedule, rank 2 of p 2": lambda: core["schedule"](2, 1, 4, 2),
        "schedule, m 0": lambda: core["schedule"](2, 1, 0, 0),
        "PipelineRank, m 3 not a multiple of p 2": lambda: runner(m=3),
        "PipelineRank, 2 chunks in a group of 4": lambda: runner(group=dist.group.WORLD),
        "PipelineRank, 2 chunks of a pipeline of 2 in a group of 1": lambda: runner(group=alone),
        "PipelineRank.run, m - 1 micro-batches": lambda: runner().run(
            list(x.view(M, -1, IN))[1:], list(y.view(M, -1, OUT))[1:], loss_of
        ),
        "TPBlock, 3 heads over t 2": lambda: core["TPBlock"](tiny.blocks[0], tp_group),
        "Chunk, 2 layers in 4 chunks": lambda: core["Chunk"](tiny, 0, 4, tp_group),
        "Chunk, chunk 2 of 2": lambda: core["Chunk"](tiny, 2, 2, tp_group),
    }
    out, mutants = {}, {}
    for case, call in cases.items():
        out[case] = section.attempt(call)  # (error, collectives counted)
    for case, text in (
        ("TPBlock, 3 heads over t 2", "if n % k:"),  # check_split's test, cut
        ("Chunk, 2 layers in 4 chunks", "if n % k:"),
    ):
        mutant = section.load(
            "ptdp.py", (section.ROOT / "ptdp.py").read_text().replace(text, "if False:")
        )
        try:  # the negative: without its check the core takes the bad size silently (no error at all)
            (
                mutant["TPBlock"](tiny.blocks[0], tp_group)
                if "TPBlock" in case
                else mutant["Chunk"](tiny, 0, 4, tp_group)
            )
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
    alone = [dist.new_group([r]) for r in range(4)][
        d.rank
    ]  # no data parallelism: each rank its own replica
    bad, mutants = refusals(pp_group, tp_group, alone, pp_rank)
    four_axes = cp_copy_out(d)
    net, ref_losses, ref_norms, ref_grads0 = reference()
    errors, counted = {}, {}
    real_f = vars(core["f"])["backward"]  # the staticmethod itself
    for order in ("interleaved", "interleaved, f without its all-reduce"):  # the second must fail
        core["f"].backward = (
            staticmethod(lambda ctx, grad: (grad, None)) if "f without" in order else real_f
        )
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
                # clipped
                loss, _ = core["finish_batch"](params, loss, alone, tp_rank, CLIP, dist.group.WORLD)
            # the positive control: the counter sees this code's traffic
            counted = counted or dict(comm.calls)
            losses.append(loss)
            if step == 0:  # every local gradient against the same slice of the one-process gradient
                err = max(
                    err,
                    max(
                        diff(n, q.grad, ref_grads0, c, tp_rank, t)
                        for c in mine
                        for n, q in chunks[c].named_parameters()
                    ),
                )
            opt.step()
            opt.zero_grad()
        final = {n: q.detach() for n, q in net.named_parameters()}
        mine_final = [
            diff(n, q, final, c, tp_rank, t) for c in mine for n, q in chunks[c].named_parameters()
        ]
        err = max([err] + mine_final)
        err = torch.tensor(
            [err, max(abs(a - b) for a, b in zip(losses, ref_losses))], dtype=torch.float64
        )
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        errors[order] = dict(
            max_grad_or_param_diff=err[0].item(), max_loss_diff=err[1].item(), losses=losses
        )
    core["f"].backward = real_f
    # to rank 0, one row per rank: its pp rank, tp rank, the global ranks of its pipeline (pp rank order), and
    # per case 1 if the core raised a ValueError with nothing counted
    row = [pp_rank, tp_rank, *(dist.get_global_rank(pp_group, i) for i in range(p))]
    row += [v[0].startswith("ValueError") and not v[1] for v in bad.values()]
    rows = [torch.zeros(1, len(row), dtype=torch.float64) for _ in range(4)]
    dist.all_gather(rows, torch.tensor([row], dtype=torch.float64))
    rows = [[int(x) for x in r[0]] for r in rows]
    if d.rank == 0:
        Path(out_path).write_text(
            json.dumps(
                dict(
                    errors,
                    reference_losses=ref_losses,
                    reference_norms=ref_norms,
                    clip=CLIP,
                    refusals=bad,
                    mutants=mutants,
                    refused_on_every_rank={
                        case: all(r[4 + i] == 1 for r in rows) for i, case in enumerate(bad)
                    },
                    four_axes=four_axes,
                    counted_step=counted,
                    layout=[dict(pp=r[0], tp=r[1], pipeline=r[2:4]) for r in rows],
                )
            )
        )  # by rank
    return d


# ----------------------------------------------------------------------------- four axes: CP in TP, ZeRO-1
H4, T4, B4, HID4, LR4, CLIP4 = (
    2,
    8,
    3,
    10,
    0.05,
    0.5,
)  # 2 heads of 3 over tp 2, 8 tokens over cp 2 (4 each)


# the attribute names TPBlock reads (common.Block's), in a model that is not the GPT
class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.proj, self.n_heads = nn.Linear(D, D), H4


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.proj = nn.Linear(D, HID4), nn.Linear(HID4, D)


class AttnBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attn(), nn.LayerNorm(D), Mlp()

    def forward(self, x):  # (b, T, D), the whole sequence: the one-process reference
        a = self.attn
        q, k, v = (
            rearrange(lin(self.ln1(x)), "b t (h e) -> b h t e", h=H4) for lin in (a.q, a.k, a.v)
        )
        x = x + a.proj(
            rearrange(
                F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h t e -> b t (h e)"
            )
        )
        return x + self.mlp.proj(F.gelu(self.mlp.fc(self.ln2(x))))


class SeqNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.out = nn.Linear(IN, D), nn.Linear(D, OUT)
        self.blocks = nn.ModuleList(AttnBlock() for _ in range(2))
        self.temp = nn.Parameter(torch.tensor(1.5))  # 0-dim
        # 3 more: a TP rank's 407 elements, which 2 shards do not divide (ZeRO-1 pads its flat vector)
        self.shift = nn.Parameter(torch.linspace(-0.1, 0.1, OUT))

    def forward(self, x):  # (b, T, IN) -> (b, T, OUT)
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h) * self.temp + self.shift


def seq_batch(step):
    g = torch.Generator().manual_seed(200 + step)
    x = torch.randn(B4, T4, IN, generator=g, dtype=torch.float64)
    return x, torch.sin(x[..., :OUT] * 3).cumsum(1) / 4  # targets that need the tokens before


# summed over this rank's elements / the whole batch's count: the ranks' losses add up
def seq_loss(out, y):
    return ((out - y) ** 2).sum() / (B4 * T4 * OUT)


def cp_copy_out(d):
    """TPBlock (its ring attention) + ShardedOptimizer + finish_batch from the section alone, tp 2 x cp 2 on
    TP groups {0, 2}, {1, 3} and CP groups {0, 1}, {2, 3}, against one-process AdamW + clip_grad_norm_."""
    tp_groups = [dist.new_group(r) for r in ([0, 2], [1, 3])]
    cp_groups = [dist.new_group(r) for r in ([0, 1], [2, 3])]
    tp_group, cp_group = tp_groups[d.rank % 2], cp_groups[d.rank // 2]
    tp_rank, cp_rank, t, cp = dist.get_rank(tp_group), dist.get_rank(cp_group), 2, 2
    for group in (cp_group,):  # NCCL: a collective before the first point-to-point
        dist.all_reduce(torch.zeros(1, device=d.device), group=group)
    torch.manual_seed(1)
    ref = SeqNet().double()
    ref_state = {n: q.detach().clone() for n, q in ref.named_parameters()}
    opt, ref_losses = torch.optim.AdamW(ref.parameters(), lr=LR4, foreach=False), []
    for step in range(STEPS):
        x, y = seq_batch(step)
        loss = seq_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP4)
        opt.step()
        ref_losses.append(loss.item())
    out = {}
    for name, mod in (
        ("zero-1", core),
        (
            "zero-1, shard from the wrong slice",
            section.load("ptdp.py", TEXT.replace(*MUTANTS["shard-wrong-slice"])),
        ),
    ):
        torch.manual_seed(1)
        net = SeqNet().double()
        net.load_state_dict(ref_state)
        blocks = [mod["TPBlock"](b, tp_group, cp_group) for b in net.blocks]
        params = [
            *net.inp.parameters(),
            *(q for b in blocks for q in b.parameters()),
            *net.out.parameters(),
            net.temp,
            net.shift,
        ]
        zero = mod["ShardedOptimizer"](
            params, cp_group, lambda ps: torch.optim.AdamW(ps, lr=LR4, foreach=False)
        )
        losses = []
        for step in range(STEPS):
            # (b, T/cp, ..) my tokens
            x, y = (mod["zigzag"](z, cp, cp_rank) for z in seq_batch(step))
            with CommCounter(axes={"tp": tp_group, "cp": cp_group}) as comm:
                h = net.inp(x)
                for b in blocks:
                    h = b(h)
                loss = seq_loss(net.out(h) * net.temp + net.shift, y)
                loss.backward()
                loss, _ = mod["finish_batch"](
                    params, loss.detach(), cp_group, tp_rank, CLIP4, dist.group.WORLD, zero
                )
                zero.step()
            for q in params:
                q.grad = None
            losses.append(loss)
        err = max(
            _block_diff(n, q, ref, i, tp_rank, t)
            for i, b in enumerate(blocks)
            for n, q in b.named_parameters()
        )
        err = max(
            [err]
            + [
                (q - ref.get_parameter(n)).abs().max().item()
                for n, q in net.named_parameters()
                if not n.startswith("blocks")
            ]
        )
        e = torch.tensor(
            [err, max(abs(a - b) for a, b in zip(losses, ref_losses))], dtype=torch.float64
        )
        dist.all_reduce(e, op=dist.ReduceOp.MAX)
        out[name] = dict(
            max_param_diff=e[0].item(),
            max_loss_diff=e[1].item(),
            losses=losses,
            counted=dict(comm.calls),
        )
    out["reference_losses"] = ref_losses
    tiny = AttnBlock().double()
    tiny.attn.n_heads = 3  # 3 heads of 2 over tp 2
    cases = {
        "TPBlock, 3 heads over t 2": lambda: core["TPBlock"](tiny, tp_group, cp_group),
        "zigzag, 6 tokens over cp 2": lambda: core["zigzag"](torch.zeros(B4, 6, IN), cp, cp_rank),
        "RingAttention, 3 tokens per rank": lambda: core["RingAttention"].apply(
            *torch.zeros(3, B4, 1, 3, 3, dtype=torch.float64), cp_group
        ),
    }
    out["refusals"] = {case: section.attempt(call) for case, call in cases.items()}
    return out


def _block_diff(name, q, ref, i, tp_rank, t):
    want = ref.get_parameter(f"blocks.{i}.{name}")
    k = core["tp_dim"](name)
    return (q - (want if k is None else want.chunk(t, k)[tp_rank])).abs().max().item()


def diff(name, mine, ref, c, tp_rank, t):
    """|mine - the reference's slice|: a chunk's names map back to Net's (blocks.0 of chunk c is blocks.c)."""
    if mine is None:  # a gradient that never came
        return float("inf")
    full = {
        "scale": "scale",
        "temp": "temp",
        "inp.weight": "inp.weight",
        "inp.bias": "inp.bias",
        "out.weight": "out.weight",
        "out.bias": "out.bias",
    }.get(name)
    if full is None:
        leaf = name.split(".", 2)[2]  # "blocks.0.w1" -> "w1"
        full = {
            "w1": "mlp.0.weight",
            "b1": "mlp.0.bias",
            "w2": "mlp.2.weight",
            "b2": "mlp.2.bias",
            "norm.weight": "norm.weight",
            "norm.bias": "norm.bias",
        }[leaf]
        full = f"blocks.{c}.{full}"
        want = ref[full]
        if leaf in ("w1", "b1"):
            want = want.chunk(t, 0)[tp_rank]
        elif leaf == "w2":
            want = want.chunk(t, 1)[tp_rank]
    else:
        want = ref[full]
    return (mine - want).abs().max().item()


TEXT = (section.ROOT / "ptdp.py").read_text()
MUTANTS = {  # name: (a line of ptdp.py, what the mutant has instead)
    "norm-counts-replicas": (
        'counted = [getattr(q, "tp_split", False) or tp_rank == 0 for q in params]',
        "counted = [True for q in params]",
    ),  # every TP rank adds its replicated copies
    "no-dp-all-reduce": (
        "            dist.all_reduce(flat, group=group)\n",
        "            pass\n",
    ),  # the gradients never summed over dp x cp
    "kv-to-tp-peer": (
        "y = RingAttention.apply(q, k, v, self.cp_group)",  # K/V round the wrong ring: the TP
        "y = RingAttention.apply(q, k, v, self.group)",
    ),  # peer's (its other heads, my tokens)
    "grads-over-dp-not-cp": (  # the gradient group: dp alone
        '"p d c t -> (p t) (d c)"',
        '"p d c t -> (p c t) d"',
    ),
    "shard-wrong-slice": (
        "        i = dist.get_rank(group)\n",  # ZeRO-1: my shard's state and update taken
        "        i = (dist.get_rank(group) + 1) % R\n",
    ),  # from the next rank's slice
}


def mutated(name):
    """ptdp.py as a fresh module, with mutant `name` (None: as it is)."""
    text = TEXT
    if name:
        old, new = MUTANTS[name]
        assert text.count(old) == 1, name
        text = text.replace(old, new)
    mod = types.ModuleType(f"ptdp_{(name or 'run').replace('-', '_')}")
    sys.modules[mod.__name__] = mod
    exec(compile(text, str(section.ROOT / "ptdp.py"), "exec"), mod.__dict__)
    return mod


class Finished(Exception):
    pass


def runs(d, spec, outdir):
    # Run.finish ends a run through harness.close_dist: here the next run follows
    def no_exit(
        ok=True,
    ):
        raise Finished(ok)

    real_close, harness.close_dist = harness.close_dist, no_exit
    for run in json.loads(Path(spec).read_text()):
        mod = mutated(run.get("mutant"))
        mod.init_dist = lambda timeout=None: d
        sys.argv = [
            str(section.ROOT / "ptdp.py"),
            *run["argv"],
            "--json",
            str(Path(outdir) / f"{run['name']}.json"),
        ]
        try:
            mod.main()
        except Finished:
            pass
        dist.barrier()
        d.log(f"run {run['name']} done")
    harness.close_dist = real_close


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] in MUTANTS:
        sys.argv.pop(1)
        mutated(args[0]).main()
    d = None
    if args[0] == "copy-out":
        d = copy_out(args[1])
        args = args[2:]
    if args and args[0] == "runs":
        d = d or init_dist()
        runs(d, args[1], args[2])
    harness.close_dist()
