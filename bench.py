"""bench.py: every technique of this repo beside PyTorch's own, on the same model, data and machine.

    python bench.py                                  # every pair, world 2, one thread per rank, 10.6 M params
    python bench.py --pairs ddp,zero1 --budget-min 3 # some pairs: a paired launch each, more while 3 min last
    python bench.py --world 4 --d-model 1024 --batch-size 16 --n-layers 8   # GPUs: NCCL, cuda:LOCAL_RANK

Every pair is paired: one `torchrun bench.py --worker paired` launch builds both sides in its
processes, ours from the technique file's core (OURS, below), torch's own (WORKERS), and runs them
in blocks of --block-steps steps, A B, B A, ..., so that whatever the machine does hits neighbouring
blocks alike. A block's ratio ours / torch, of wall time per step and of process CPU time (user +
system, all threads, summed over ranks), is a sample; over the blocks a 95% interval (Student's t on
their logs, below) says "faster" or "slower" if it excludes 1, else "no difference measurable" (no
ratio printed). The verdict rests on wall time, or on CPU time where the 1-minute load average
passed the core count at a block (the pair's line says so). Another launch (starting with the other
side) while the interval is wider than ratio x (1 +- --precision) and one fits in the pair's share
of --budget-min; one still wider is "noisy". Then each side runs once in a launch of its own for its
peak memory, bytes and bubble, measured apart. A pair given no builder in OURS would alternate
whole launches instead (`torchrun FILE`, then `torchrun bench.py --worker W`), A B: a round's ratio
is of the median steps after --warmup, the rounds are the samples (at least --rounds). Both sides
train the same GPT from one seed on one global batch (float32, AdamW, clipping at the global norm),
made in the step:

    pair      ours                               torch's own
    ddp       ddp_bucketed.py                    DistributedDataParallel, the same bucket cap
    dp_sync   dp.py --mode sync (no overlap)     DistributedDataParallel, the same bucket cap
    zero1     zero.py --stage 1                  DDP + ZeroRedundancyOptimizer
    zero2     zero.py --stage 2                  fully_shard(reshard_after_forward=False) per block, then root
    zero3     zero.py --stage 3                  fully_shard per block, then root
    gpipe     gpipe.py                           pipelining PipelineStage + ScheduleGPipe, same layer bounds
    1f1b      pipedream.py --mode flush          pipelining Schedule1F1B
    zb        zero_bubble.py (ZB-H1)             ScheduleInterleavedZeroBubble on one stage per rank (ZB1P:
                                                 the nearest zero-bubble schedule torch ships to
                                                 ZB-H1)
    tp        megatron_tp.py                     DTensor ColwiseParallel / RowwiseParallel, parallelize_module
    ptdp      ptdp.py --virtual-stages 2         ScheduleInterleaved1F1B, 2 stages per rank, looped
    zbv       zero_bubble.py --schedule zbv      ScheduleZBVZeroBubble, 2 stages per rank in a V
    fp8       fp8.py --recipe current            torchao's float8 training (convert_to_float8_training, its
              --fp8-all-gather                   default: tensorwise current scaling) on fully_shard, weights
                                                 all-gathered in FP8 (torchao, if installed; not
                                                 required)
    hsdp      zero.py --stage 3 --replicate 2    fully_shard per block, then root, on a (replicate 2, shard
                                                 world/2) DeviceMesh (at world 2: 2 x 1, replication
                                                 only)
    dualpipev dualpipev.py                       ScheduleDualPipeV, 2 stages per rank in a V (m >= 2 x world)
    tp_overlap megatron_tp.py --overlap          symm_mem fused_all_gather_matmul, fused_matmul_reduce_scatter
                                                 in megatron_tp's SP layers (CUDA, >= 2
                                                 peer-connected GPUs)
A pair whose file does not offer the mode it needs yet (its Args, as its --help shows), whose torch
side needs a package not installed here (torchao), or whose layout or kernels this world and machine
lack (hsdp at an odd world, dualpipev where m < 2 x world, tp_overlap without CUDA peers) is
skipped, one line.

Per pair (OUT.json, OUT.md): the verdict and interval (paired: wall and CPU time, the one it rests
on), the ratio per block (`ratio_per_round`) or round, the load at each, step time, tokens/s, peak
memory and bytes handed to collectives per rank and step (torch's side counted at the dispatcher by
harness.CommCounter), the pipelines' bubble beside theory, data parallel's scaling efficiency, the
two sides' loss difference, and for ddp the share of all-reduce hidden behind backward. --profile
DIR: a Chrome trace of every run and rank (not of the paired launches), and each run's biggest
top-level ops printed.
"""

import collections
import contextlib
import dataclasses
import functools
import importlib
import itertools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import harness
from common import (
    DTYPES,
    IGNORE,
    GPTConfig,
    MarkovData,
    build_gpt,
    clip_grads_,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import (
    CommCounter,
    CommonArgs,
    LiveStorages,
    SavedActivations,
    StepTimer,
    Timeline,
    busy_ms,
    check_common_args,
    log_step,
    parse_args,
    peak_memory_bytes,
    tensor_bytes,
    write_summary,
)

ROOT, MiB = Path(__file__).resolve().parent, 1024 * 1024


@dataclass
class Args(CommonArgs):
    steps: int = 6  # optimizer steps per run (the first --warmup are not timed)
    batch_size: int = 8  # global batch, in sequences
    seq_len: int = 64  # tokens per sequence
    # vocabulary size (every launch computes the chain's stationary law: eig of V x V)
    vocab: int = 1024
    d_model: int = 448  # model width (with the defaults: 10.6 M parameters)
    n_layers: int = 4  # transformer blocks (a multiple of world x 2 for the ptdp and zbv pairs)
    n_heads: int = 8  # attention heads
    # comma-separated names of PAIRS (ddp, zero3, hsdp, tp, zbv, fp8, ...), or all
    pairs: str = "all"
    world: int = 2  # processes per run (on GPUs: GPUs)
    rounds: int = 3  # at least this many alternations A B per pair (2 or more give an interval)
    # whole bench: go on alternating while an interval is wide, until this is spent
    budget_min: float = 20.0
    precision: float = 0.05  # an interval is narrow enough within ratio x (1 +- this)
    warmup: int = 2  # steps per run left out of the step time
    microbatches: int = 4  # pipelines: micro-batches per step
    bucket_cap_mb: float = 4.0  # ddp, dp_sync, zero1: bucket cap in MiB on both sides
    threads: int = 1  # OMP_NUM_THREADS of every rank
    # data-parallel pairs: also time one-process training, for the scaling efficiency
    scaling: bool = True
    out: str = "bench"  # writes OUT.json and OUT.md
    # write a torch.profiler Chrome trace of every run and rank into this directory
    profile: str = ""
    launch_timeout: int = 600  # seconds one torchrun launch may take
    blocks: int = 10  # paired pairs: timed blocks per side in the first launch (A B, B A, ...)
    block_steps: int = 2  # paired pairs: steps per block
    worker: str = ""  # (internal) run torch's side of a pair, or both (paired), under torchrun
    flip: int = 0  # (internal) paired: 1 starts the first block with torch's side


# ptdp.py as a pure pipeline
PTDP = "--pp {world} --tp 1 --dp 1 --virtual-stages 2 --microbatches {m}"
PAIRS = {  # pair -> (our file, its flags, torch's worker, kind)
    "ddp": ("ddp_bucketed.py", "--bucket-cap-mb {cap} --first-bucket-mb {cap}", "ddp", "dp"),
    "dp_sync": ("dp.py", "--mode sync", "ddp", "dp"),
    "zero1": ("zero.py", "--stage 1", "zero1", "dp"),
    "zero2": ("zero.py", "--stage 2", "fsdp_noreshard", "dp"),
    "zero3": ("zero.py", "--stage 3", "fsdp", "dp"),
    "gpipe": ("gpipe.py", "--microbatches {m}", "gpipe", "pp"),
    "1f1b": ("pipedream.py", "--mode flush --microbatches {m}", "1f1b", "pp"),
    "zb": ("zero_bubble.py", "--schedule zbh1 --microbatches {m}", "zb", "pp"),
    "tp": ("megatron_tp.py", "", "tp", "tp"),
    "ptdp": ("ptdp.py", PTDP, "interleaved", "pp"),
    "zbv": ("zero_bubble.py", "--schedule zbv --microbatches {m}", "zbv", "pp"),
    "fp8": ("fp8.py", "--recipe current --fp8-all-gather", "float8", "fp8"),
    "hsdp": ("zero.py", "--stage 3 --replicate 2", "hsdp", "dp"),
    "dualpipev": ("dualpipev.py", "--microbatches {m}", "dualpipev", "pp"),
    "tp_overlap": ("megatron_tp.py", "--overlap", "tp_overlap", "tp"),
}
NEEDS = {
    "zb": ("--schedule", "zbh1"),
    "zbv": ("--schedule", "zbv"),
}  # pair -> a choice its file must offer
IMPORTS = {"fp8": "torchao"}  # pair -> a package its torch side needs beyond requirements.txt
MODEL = (
    "steps batch_size seq_len vocab d_model n_layers n_heads lr weight_decay clip seed dtype "
    "timeout"
)


def gpt(args, device="cpu"):  # the pair's GPT from the one seed, in --dtype
    return build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)


def my_rows(d, *batches):  # this rank's B/N rows of each (B, T) batch, on the device
    b = batches[0].shape[0] // d.world
    return [t[d.rank * b : (d.rank + 1) * b].to(d.device) for t in batches]


def torch_ddp(model, d, args):  # torch's DDP at --bucket-cap-mb, as torch documents it
    from torch.nn.parallel import DistributedDataParallel as DDP

    gpu = [d.local_rank] if d.device.type == "cuda" else None
    return DDP(model, device_ids=gpu, bucket_cap_mb=args.bucket_cap_mb)


# ----------------------------------------------------------------------------- torch's side
# Each side returns (this rank's parameters, its optimizer, train(i)); train runs step i's forward,
# backward and clipping and returns the global batch's loss and the bytes it held beyond parameters,
# grads, state.
def data_parallel_side(d, args, name, comm):
    """DDP (+ ZeroRedundancyOptimizer) or FSDP2 over the whole world, each used as torch documents
    it; or ("single") plain one-process training on the whole batch, the baseline of the scaling
    efficiency; or ("float8") torchao's float8 training on FSDP2, as torchao's README sets it up."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    fsdp = name.startswith("fsdp") or name in ("float8", "hsdp")
    model = net = gpt(args, "cpu" if fsdp else d.device)  # FSDP2 moves its units there
    if name == "float8":  # torchao's default: tensorwise current scaling, E4M3 input and weight,
        # E5M2 grad_output; the head kept in --dtype, as in fp8.py; shards quantized, then gathered
        ao = importlib.import_module("torchao.float8")
        config = ao.Float8LinearConfig(enable_fsdp_float8_all_gather=True)
        ao.convert_to_float8_training(
            model, config=config, module_filter_fn=lambda m, fqn: fqn != "head"
        )
    if fsdp:  # each block its own unit, then the root, as torch's docs do; hsdp: a 2-D mesh, R = 2
        shape = (2, d.world // 2) if name == "hsdp" else (d.world,)
        names = ("replicate", "shard")[-len(shape) :]
        mesh = dist.device_mesh.init_device_mesh(d.device.type, shape, mesh_dim_names=names)
        for unit in [*model.blocks, model]:
            net = fully_shard(unit, mesh=mesh, reshard_after_forward=name != "fsdp_noreshard")
        gathered = gathered_bytes(model)
    elif name != "single":
        net = torch_ddp(model, d, args)
    opt = make_optimizer(model.parameters(), args)
    if name == "zero1":  # AdamW's state sharded over ranks; every rank broadcasts its updated shard
        opt = ZeroRedundancyOptimizer(
            model.parameters(),
            torch.optim.AdamW,
            lr=args.lr,
            betas=(0.9, 0.95),
            weight_decay=args.weight_decay,
            foreach=False,
        )
    data = MarkovData(args.vocab, args.seed)

    def train(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)
        x, y = my_rows(d, x, y)  # (B/N, T) this rank's, to the device: one copy per step
        # after the last update: every FP8 weight's amax over the shards, one all-reduce
        if name == "float8":
            ao.precompute_float8_dynamic_scale_for_fsdp(model)
        with LocalSaved() as acts:
            loss = lm_loss(net(x), y, n_tok)  # its share of the loss
        # DDP and FSDP average over ranks: N x share, averaged = the global grad
        (loss * d.world).backward()
        # FSDP: DTensor grads, a global norm
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        total = loss.detach().reshape(1)
        with comm.paused():
            # logging only (the technique files leave it out of their count too)
            dist.all_reduce(total)
        held = gathered.peak if fsdp else sum(ddp_bucket_sizes(net)) if name != "single" else 0
        return total.item(), acts.bytes + held

    return list(model.parameters()), opt, train


def ddp_bucket_sizes(net):
    """The bytes of each of DDP's gradient buckets, as its C++ reducer reports them (rebuilt after
    step 1)."""
    data = net._get_ddp_logging_data()
    return [
        int(s)
        for s in re.findall(r"\d+", str(data.get("rebuilt_bucket_sizes") or data["bucket_sizes"]))
    ]


def gathered_bytes(model):
    """FSDP2 on CPU: the bytes of all-gathered (unsharded) parameters alive, sampled as each unit
    starts its forward and its backward (on a GPU, CUDA's peak covers them); `.peak` is the largest.
    FSDP2 frees them by resizing the storage to 0, which a weak reference cannot see: `alive(*held)`
    reads the size now."""
    units, live = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")], LiveStorages()

    def sample(*_):
        groups = [getattr(m._get_fsdp_state(), "_fsdp_param_group", None) for m in units]
        params = [
            w._unsharded_param
            for g in groups
            for w in getattr(g, "fsdp_params", [])
            if hasattr(w, "_unsharded_param")
        ]
        # torchao's FP8 weights: their FP8 data
        live.alive(*[t for w in params for t in unwrapped(w)])

    for m in units:
        for hook in (
            m.register_forward_pre_hook,
            m.register_forward_hook,
            m.register_full_backward_pre_hook,
        ):
            hook(sample)
    return live


class PipeStage(nn.Module):
    """Blocks [a, z) of the GPT; the embedding on the first stage, final norm + head on the last."""

    def __init__(self, gpt, a, z, first, last):
        super().__init__()
        self.first = first
        self.last = last
        self.blocks = nn.ModuleList(gpt.blocks[a:z])
        self.tok_emb, self.pos_emb = (gpt.tok_emb, gpt.pos_emb) if first else (None, None)
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if last else (None, None)

    def forward(self, h):  # first: (b, T) ids; else (b, T, D)
        if self.first:
            h = self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)) if self.last else h  # last: (b, T, V) logits


# worker -> (torch's schedule, stages of a rank, k: bubble theory (p-1)/(k*m+p-1) when T_F = T_B =
# T_W)
SCHEDULES = {
    "gpipe": ("ScheduleGPipe", "one", 1),
    "1f1b": ("Schedule1F1B", "one", 1),
    "zb": (
        "ScheduleInterleavedZeroBubble",
        "one",
        3,
    ),  # each W in a slot 1F1B leaves idle: ZB-H1's theory
    "interleaved": (
        "ScheduleInterleaved1F1B",
        "looped",
        2,
    ),  # stages r and r + p: (p-1)/(v*m+p-1), v = 2
    "zbv": ("ScheduleZBVZeroBubble", "v", 0),  # stages r and 2p-1-r; ZB-V's bubble: about 0
    # DualPipeV's (p-1)/(3m) idle / busy (DeepSeek-V3's Table 2, the F&B slot unoverlapped) as a
    # share
    "dualpipev": ("ScheduleDualPipeV", "v", 3),
}


def pipeline_side(d, args, name, comm):
    """torch.distributed.pipelining: a PipelineStage per stage, the blocks split as gpipe.py splits
    them (evenly, the earlier stages take the extra block)."""
    from torch.distributed import pipelining

    cls, placement, k = SCHEDULES[name]
    r = d.rank
    p = d.world
    m = args.microbatches
    ids = {"one": [r], "looped": [r, r + p], "v": [r, 2 * p - 1 - r]}[placement]
    n = len(ids) * p  # stages in all
    ends = [
        0,
        *itertools.accumulate(args.n_layers // n + (s < args.n_layers % n) for s in range(n)),
    ]
    full = gpt(args)  # CPU; a rank moves its stages
    mods = [PipeStage(full, ends[s], ends[s + 1], s == 0, s == n - 1).to(d.device) for s in ids]
    stages = [pipelining.PipelineStage(mod, s, n, d.device) for mod, s in zip(mods, ids)]
    timeline = Timeline(d)
    live = LiveStorages()
    n_tok = [1]
    watch_stages(stages, timeline, live)
    schedule = getattr(pipelining, cls)
    multi = issubclass(schedule, pipelining.schedules.PipelineScheduleMulti)
    # scale_grads=False: each micro-batch loss is already divided by the global token count
    # (common.lm_loss)
    sched = schedule(
        stages if multi else stages[0],
        m,
        loss_fn=lambda out, y: lm_loss(out, y, n_tok[0]),
        scale_grads=False,
    )
    params, data = [w for mod in mods for w in mod.parameters()], MarkovData(args.vocab, args.seed)

    def train(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok[0], losses = count_tokens(y), []
        timeline.events.clear()
        with comm.paused():
            timeline.zero()  # one zero for every rank: the wall time the last rank arrived
        kwargs = dict(target=y.to(d.device), losses=losses) if n - 1 in ids else {}
        # the schedule splits the batch into m
        sched.step(*([x.to(d.device)] if 0 in ids else []), **kwargs)
        grads = [w.grad for w in params if w.grad is not None]
        # this rank's part of the squared norm:
        zero = torch.zeros((), dtype=torch.float64, device=d.device)
        sq = sum((torch.linalg.vector_norm(g, dtype=torch.float64) ** 2 for g in grads), zero)
        both = torch.stack([sq, sum(losses, zero).double()])  # (2,)
        dist.all_reduce(both)  # squared norm of the whole model, batch loss (as gpipe.py does)
        with torch.no_grad():  # ScheduleDualPipeV leaves grads that are views made under no_grad
            clip_grads_(grads, both[0].sqrt(), args.clip)
        return both[1].item(), live.peak

    def figures():  # the last step's bubble per rank: 1 - busy / (the last op's end anywhere)
        events = timeline.gather()
        end = max(e["end"] for e in events)
        bubble = [1 - busy_ms(events, rank, 0.0, end) / end for rank in range(p)]
        return dict(
            bubble=bubble,
            bubble_mean=sum(bubble) / p,
            bubble_theory=k and (p - 1) / (k * m + p - 1),
            bubble_theory_formula=f"(p-1)/({k}m+p-1)".replace("1m", "m") if k else "about 0",
            ops={kind: sum(e["kind"] == kind for e in events) for kind in "FBW"},
        )  # on all ranks

    train.figures = figures
    return params, make_optimizer(params, args), train


def watch_stages(stages, timeline, live):
    """From outside: each forward_one_chunk (F), backward_one_chunk (B: the whole backward, or in a
    zero-bubble schedule the input gradient only) and backward_weight_one_chunk (W) of a stage runs
    in Timeline.span, one micro-batch's compute (sends and receives run outside). What each F saves
    for backward is held weakly in `live`, sampled after every op: its peak is the saved
    activations' peak."""

    def observed(fn, kind):
        def run(chunk, *a, **kw):
            saved = SavedActivations(live) if kind == "F" else contextlib.nullcontext()
            with timeline.span(kind, chunk), saved:
                out = fn(chunk, *a, **kw)
            live.alive()
            return out

        return run

    for st in stages:
        for kind, op in zip(
            "FBW", ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
        ):
            setattr(st, op, observed(getattr(st, op), kind))


def tensor_parallel_side(d, args, name, comm):
    """DTensor: Megatron's layout via parallelize_module, over the whole world (tp = world, no data
    parallel): q, k, v and fc column-wise, the projections row-wise, the embedding split over the
    vocabulary, the head column-wise into loss_parallel's vocabulary-parallel cross-entropy."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel as Col,
    )
    from torch.distributed.tensor.parallel import RowwiseParallel as Row
    from torch.distributed.tensor.parallel import (
        loss_parallel,
        parallelize_module,
    )

    mesh = dist.device_mesh.init_device_mesh(d.device.type, (d.world,))
    model = gpt(args, d.device)  # as megatron_tp.py
    plan = dict(
        tok_emb=Row(input_layouts=Replicate()),
        head=Col(output_layouts=Shard(-1), use_local_output=False),
    )  # into loss_parallel
    for i, block in enumerate(model.blocks):
        block.attn.n_heads //= d.world  # a rank's q, k, v hold n_heads / tp whole heads
        plan.update({f"blocks.{i}.{w}": Col() for w in ("attn.q", "attn.k", "attn.v", "mlp.fc")})
        plan.update({f"blocks.{i}.{w}": Row() for w in ("attn.proj", "mlp.proj")})
    parallelize_module(model, mesh, plan)
    params, data = list(model.parameters()), MarkovData(args.vocab, args.seed)
    local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731

    def train(i):
        # (B, T) on every rank
        x, y = (t.to(d.device) for t in data.batch(i, args.batch_size, args.seq_len))
        with LocalSaved() as acts, loss_parallel():
            loss = lm_loss(model(x), y, count_tokens(y))  # logits (B, T, V/tp) never gathered
            loss.backward()
        # global norm: sharded gradients' squares summed over ranks, replicated ones (LayerNorms,
        # biases of row-wise layers, position embedding) counted once
        sq = torch.zeros(2, dtype=torch.float64, device=d.device)
        for w in params:
            sharded = isinstance(w.grad, DTensor) and w.grad.placements[0].is_shard()
            sq[0 if sharded else 1] += (
                torch.linalg.vector_norm(local(w.grad), dtype=torch.float64) ** 2
            )
        dist.all_reduce(sq[:1])
        clip_grads_([local(w.grad) for w in params], sq.sum().sqrt(), args.clip)
        return float(local(loss.detach())), acts.bytes

    return params, make_optimizer(params, args), train


def fused_tp_side(d, args, name, comm):
    """torch's fused_all_gather_matmul and fused_matmul_reduce_scatter (symmetric memory: CUDA,
    peer-connected GPUs) in place of megatron_tp's ring: megatron_tp.SPGPT's layers (sequence
    parallel, tp = world), each all-gather + column GEMM and row GEMM + reduce-scatter one torch op,
    forward and backward."""
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    tp = importlib.import_module("megatron_tp")
    ops = torch.ops.symm_mem
    group = dist.group.WORLD.group_name
    enable_symm_mem_for_group(group)

    class GatherGEMM(torch.autograd.Function):  # (B, T/t, in) -> (B, T, out/t); keeps X gathered
        @staticmethod
        def forward(ctx, x, weight):
            whole, (y,) = ops.fused_all_gather_matmul(x, [weight.T], 1, group)
            ctx.save_for_backward(whole, weight)
            return y

        @staticmethod
        def backward(ctx, dy):  # dL/dX = RS(dY W); dL/dW = dY^T X
            whole, weight = ctx.saved_tensors
            dx = ops.fused_matmul_reduce_scatter(dy, weight, "sum", 1, group)
            return dx, torch.einsum("bto,bti->oi", dy, whole)

    class GEMMScatter(torch.autograd.Function):  # (B, T, in/t) -> (B, T/t, out) summed
        @staticmethod
        def forward(ctx, x, weight):
            ctx.save_for_backward(x, weight)
            return ops.fused_matmul_reduce_scatter(x, weight.T, "sum", 1, group)

        @staticmethod
        def backward(ctx, dy):  # dL/dX = AG(dY) W; dL/dW = AG(dY)^T X
            x, weight = ctx.saved_tensors
            whole, (dx,) = ops.fused_all_gather_matmul(dy, [weight], 1, group)
            return dx, torch.einsum("bto,bti->oi", whole, x)

    class Column(tp.SPColumnParallelLinear):
        def forward(self, x):
            y = GatherGEMM.apply(x, self.weight)
            return y if self.bias is None else y + self.masked_bias()

    class Row(tp.SPRowParallelLinear):
        def forward(self, x):
            y = GEMMScatter.apply(x, self.weight)
            return y if self.bias is None else y + self.bias

    step = our_tensor_parallel(
        d, args, name, type("FusedGPT", (tp.SPGPT,), dict(Column=Column, Row=Row))
    )
    # step ran them
    done = types.SimpleNamespace(zero_grad=lambda **k: None, step=lambda: None, state={})
    return step.params, done, lambda i: (step(i), 0)


class LocalSaved(SavedActivations):
    """harness.SavedActivations, counting the tensors inside a wrapper subclass, which itself has no
    storage: a DTensor's local shard, torchao's Float8TrainingTensor's FP8 data and scale."""

    def _pack(self, t):
        if not isinstance(t, nn.Parameter):
            for inner in unwrapped(t):
                super()._pack(inner)
        return t


def unwrapped(t):
    """The plain tensors inside a traceable wrapper subclass (its __tensor_flatten__), or [t]."""
    if not hasattr(t, "__tensor_flatten__"):
        return [t]
    inner = [getattr(t, name) for name in t.__tensor_flatten__()[0]]  # DTensor's: its mesh too
    return [x for i in inner if torch.is_tensor(i) for x in unwrapped(i)]


# ------------------------------------------------------------------------- our side, from the cores
# Built as a copier builds it: the core a file teaches (BucketedDDP, sync_step, Zero, the Megatron
# layers, gpipe_step, StageRunner + Flush, zero_bubble's and ptdp's PipelineRank, fp8's to_fp8 and
# train_step) in a loop like its file's main, on the same GPT, data and AdamW. Each returns step(i):
# trains step i whole (forward, backward, clipping, the update) and returns the global batch's loss.
# paired_worker runs it beside torch's side in the same processes.
def our_data_parallel(d, args, pair):
    """ddp_bucketed.BucketedDDP at --bucket-cap-mb (its first bucket too), dp.sync_step, zero.Zero
    at the pair's stage with a unit per block (as zero.py builds it, on the CPU first); hsdp: stage
    3 on zero.py's (replicate, shard) grid with R = 2, sharded in rows of world / 2 ranks,
    replicated down columns; fp8: fp8.to_fp8 (the current recipe, each FP8 weight's rows sharded
    over the world and gathered in FP8) and fp8.train_step on this rank's rows, as fp8.py's main."""
    zero = pair.startswith("zero") or pair == "hsdp"
    core = importlib.import_module(PAIRS[pair][0].removesuffix(".py"))
    model = gpt(args, "cpu" if zero else d.device)
    data = MarkovData(args.vocab, args.seed)
    if pair == "fp8":  # fp8.py --recipe current --fp8-all-gather: the blocks' Linears in FP8
        core.to_fp8(model, core.make_recipe("current"), dist.group.WORLD, fp8_all_gather=True)
    opt = make_optimizer(model.parameters(), args)
    if zero:
        units = [f"blocks.{i}" for i in range(args.n_layers)]
        groups = {}
        if pair == "hsdp":
            grid = torch.arange(d.world).view(2, d.world // 2)
            groups["group"] = dist.new_subgroups_by_enumeration(grid.tolist())[0]
            groups["replicate_group"] = dist.new_subgroups_by_enumeration(grid.T.tolist())[0]
        opt = core.Zero(
            model,
            units,
            stage=3 if pair == "hsdp" else int(pair[-1]),
            optimizer=lambda ps: make_optimizer(ps, args),
            clip=args.clip,
            device=d.device,
            **groups,
        )
    elif pair == "ddp":
        net = core.BucketedDDP(model, args.bucket_cap_mb, args.bucket_cap_mb)

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)
        if zero:  # this rank's rows, one micro-batch
            loss = core.train_step(opt, x, y, n_tok, 1, lm_loss)[0]
            return reduced(loss)
        x, y = my_rows(d, x, y)  # (B/N, T)
        if pair == "dp_sync":
            loss_fn = lambda m, xm, ym: lm_loss(m(xm), ym, n_tok)  # noqa: E731
            loss = core.sync_step(model, opt, [(x, y)], loss_fn, args.clip)[0]
        elif pair == "fp8":  # amaxes, replicated gradients and the norm reduced over the world
            loss_fn = lambda logits, t: lm_loss(logits, t, n_tok)
            loss = core.train_step(model, opt, x, y, loss_fn, dist.group.WORLD, args.clip)
        else:
            opt.zero_grad(set_to_none=True)
            loss = lm_loss(net(x), y, n_tok)
            (loss * d.world).backward()  # every .grad averaged over ranks
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
        return reduced(loss)

    return step


def reduced(loss):  # this rank's share of the loss summed over ranks: the global batch's loss
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total)
    return total.item()


def our_tensor_parallel(d, args, pair, GPT=None):
    """megatron_tp.ParallelGPT (tp_overlap: RingGPT, sequence parallelism's all-gather + column GEMM
    and row GEMM + reduce-scatter as ring steps; or `GPT`) over the whole world (tp = world), its
    vocabulary-parallel cross-entropy and its global norm, as megatron_tp.py's main at --dp 1."""
    tp = importlib.import_module("megatron_tp")
    GPT = GPT or (tp.RingGPT if pair == "tp_overlap" else tp.ParallelGPT)
    world = dist.group.WORLD
    tracker = tp.RNGTracker(d.device, args.seed, 0, d.rank)
    full = gpt(args)  # CPU, sliced there
    model = GPT(full, world, tracker).to(d.device)
    data = MarkovData(args.vocab, args.seed)
    opt = make_optimizer(model.parameters(), args)

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) on every rank
        n_tok = count_tokens(y)
        logits = model(x.to(d.device))  # (B, T, V/tp) this rank's vocabulary slice
        flat = logits.flatten(0, 1), y.to(d.device).flatten()
        loss = tp.VocabParallelCrossEntropy.apply(*flat, args.vocab, world, IGNORE).sum() / n_tok
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if issubclass(GPT, tp.SPGPT):  # LayerNorms, biases, positions saw T/t positions each
            tp.sum_replicated_grads(model, world)
        grads = [w.grad for w in model.parameters()]
        clip_grads_(grads, tp.global_grad_norm(model, world), args.clip)
        opt.step()
        return loss.item()  # the same on every rank

    step.params = list(model.parameters())
    return step


def our_pipeline(d, args, pair):
    """gpipe.gpipe_step, or pipedream's StageRunner with the Flush policy (one 1F1B schedule per
    step, drained before the update), on a Stage per rank at the files' layer bounds."""
    core = importlib.import_module(PAIRS[pair][0].removesuffix(".py"))
    p = d.world
    s = d.rank
    m = args.microbatches
    stage = core.Stage(gpt(args), s, core.split_layers(args.n_layers, p)).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    act = (args.batch_size // m, args.seq_len, args.d_model)  # (b, T, D) crossing a boundary
    prev = s - 1 if s > 0 else None
    nxt = s + 1 if s < p - 1 else None
    data = MarkovData(args.vocab, args.seed)
    batches = {}  # 1f1b: step -> (m, b, T) tokens and targets on the device, the token count

    def source(k):  # micro-batch k: stage 0's tokens, the last stage's targets and token count
        x, y, n_tok = batches[k // m]
        return x[k % m], (y[k % m], n_tok)

    if pair == "1f1b":
        flush = core.Flush(stage, opt, args.clip)
        loss_fn = lambda logits, y: lm_loss(logits, *y)  # noqa: E731
        runner = core.StageRunner(flush, source, loss_fn, act, act, DTYPES[args.dtype], d.device)

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)
        if pair == "1f1b":
            batches[i] = (*core.to_device(m, d.device, x, y), n_tok)
            runner.run([(kind, i * m + k) for kind, k in core.one_f_one_b(m, p, s)])
            runner.drain(i)  # the whole model's norm, clipping, the update
            del batches[i]
            mine = [runner.losses.pop(i * m + j) for j in range(m)] if s == 0 else []
            return reduced(sum(mine, torch.zeros((), device=d.device)))  # stage 0's, to every rank
        xs = core.micro_batches(x, m, d.device) if prev is None else [None] * m
        ys = core.micro_batches(y, m, d.device) if nxt is None else [None] * m
        opt.zero_grad(set_to_none=True)
        loss_fn = lambda logits, t: lm_loss(logits, t, n_tok)  # noqa: E731
        loss = core.gpipe_step(stage, xs, ys, loss_fn, prev, nxt, act)
        grads = [w.grad for w in stage.parameters()]
        both = torch.stack([core.squared_norm(grads), loss])  # (2,) this stage's part
        dist.all_reduce(both)  # the whole model's squared norm, the batch loss
        clip_grads_(grads, both[0].sqrt(), args.clip)
        opt.step()
        return both[1].item()

    return step


def our_zero_bubble(d, args, pair):
    """zero_bubble.PipelineRank running comm_plan's steps for ZB-H1 (zb) or ZB-V (zbv), every
    Linear's weight gradient deferred to W by SplitBackward, then finish_batch: as zero_bubble.py's
    main at --dp 1; dualpipev: dualpipev.py's own PipelineRank, comm_plan, SplitBackward and
    finish_batch on its dualpipev() orders."""
    core = importlib.import_module(PAIRS[pair][0].removesuffix(".py"))
    p = d.world
    if pair == "dualpipev":  # 2p chunks in a V, as ZB-V's
        order = core.dualpipev
        holder = core.holder
        n = 2 * p
    else:
        order, n_chunks, holder = core.SCHEDULES[NEEDS[pair][1]]
        n = n_chunks(p)
    m = args.microbatches
    bounds = core.split_layers(args.n_layers, n)
    full = gpt(args)  # CPU; a rank takes its chunks
    mine = [c for c in range(len(bounds)) if holder(c, p) == d.rank]
    chunks = nn.ModuleDict({str(c): core.Chunk(full, c, bounds) for c in mine}).to(d.device)
    params = list(chunks.parameters())
    opt = make_optimizer(params, args)
    plan = core.comm_plan([order(p, m, r) for r in range(p)], len(bounds), d.rank)
    # data parallel of 1: every rank makes each
    alone = [dist.new_group([r]) for r in range(p)][d.rank]
    runner = core.PipelineRank(
        {c: chunks[str(c)] for c in mine},
        len(bounds),
        plan,
        # every Linear of this rank's chunks defers its weight gradient to W
        core.SplitBackward(chunks),
        dist.group.WORLD,
        (args.batch_size // m, args.seq_len, args.d_model),  # (b, T, D): every message
        DTYPES[args.dtype],
        d.device,
    )
    finish = lambda loss: core.finish_batch(params, loss, alone, dist.group.WORLD, args.clip)
    return rank_step(d, args, runner, opt, finish)


def rank_step(d, args, runner, opt, finish):
    """step(i) of a PipelineRank (zero_bubble's, dualpipev's, ptdp's), as its file's main runs it:
    the global batch as m micro-batches through the rank's plan, then `finish(loss)`, the file's
    finish_batch (gradients summed, the whole model's norm, clipping: -> (loss, norm)), the
    update."""
    data = MarkovData(args.vocab, args.seed)
    m = args.microbatches

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)
        mbs = [z.reshape(m, -1, args.seq_len).to(d.device) for z in (x, y)]  # (m, b, T) each
        loss = finish(runner.run(*mbs, lambda logits, t: lm_loss(logits, t, n_tok)))[0]
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step


def our_interleaved(d, args, pair):
    """ptdp.PipelineRank running interleaved 1F1B over 2 chunks per rank (r and r + p, a loop), tp,
    cp and dp of 1, then finish_batch: as ptdp.py's main at --pp world --tp 1 --dp 1
    --virtual-stages 2."""
    ptdp = importlib.import_module("ptdp")
    p = d.world
    m = args.microbatches
    alone = [dist.new_group([r]) for r in range(p)][d.rank]  # tp and dp of 1: every rank makes each
    full = gpt(args)  # CPU, one seed
    mine = [d.rank, d.rank + p]  # chunk c on rank c % p
    chunks = nn.ModuleDict({str(c): ptdp.Chunk(full, c, 2 * p, alone) for c in mine}).to(d.device)
    params = list(chunks.parameters())
    opt = make_optimizer(params, args)
    runner = ptdp.PipelineRank(
        {c: chunks[str(c)] for c in mine},
        dist.group.WORLD,
        m,
        (args.batch_size // m, args.seq_len, args.d_model),  # (b, T, D): every message
        DTYPES[args.dtype],
        d.device,
    )
    finish = lambda loss: ptdp.finish_batch(params, loss, alone, 0, args.clip, dist.group.WORLD)
    return rank_step(d, args, runner, opt, finish)


OURS = {  # pair -> our side, for the pairs paired in one launch
    **dict.fromkeys(
        ("ddp", "dp_sync", "zero1", "zero2", "zero3", "hsdp", "fp8"), our_data_parallel
    ),
    **dict.fromkeys(("tp", "tp_overlap"), our_tensor_parallel),
    **dict.fromkeys(("gpipe", "1f1b"), our_pipeline),
    **dict.fromkeys(("zb", "zbv", "dualpipev"), our_zero_bubble),
    "ptdp": our_interleaved,
}


# --------------------------------------------------------------------- the workers (under torchrun)
WORKERS = {  # worker -> (torch's side, its name in the table)
    **{
        w: (data_parallel_side, name)
        for w, name in (
            ("single", "one process"),
            ("ddp", "DistributedDataParallel"),
            ("fsdp", "fully_shard"),
            ("zero1", "DDP + ZeroRedundancyOptimizer"),
            ("fsdp_noreshard", "fully_shard(reshard_after_forward=False)"),
            ("hsdp", "fully_shard on a (replicate 2, shard) mesh"),
        )
    },
    **{
        w: (pipeline_side, f"pipelining {cls}" + " (1 stage/rank)" * (w == "zb"))
        for w, (cls, *_) in SCHEDULES.items()
    },
    "tp": (tensor_parallel_side, "DTensor Colwise/RowwiseParallel"),
    "tp_overlap": (fused_tp_side, "symm_mem fused_all_gather_matmul / fused_matmul_reduce_scatter"),
    "float8": (data_parallel_side, "torchao float8 + fully_shard (FP8 all-gather)"),
}


def run_worker(args):
    """`torchrun bench.py --worker NAME`: torch's side of a pair. The last untimed step runs under
    harness.CommCounter (lazy initialisation is done by then); the summary is
    harness.write_summary's."""
    d, comm = init_dist(args.timeout), CommCounter()
    torch.set_num_threads(args.threads)
    params, opt, train = WORKERS[args.worker][0](d, args, args.worker, comm)
    timer = StepTimer(d.device)
    losses = []
    counted = 0
    with profiled(args.profile, Path(args.json).stem):
        for i in range(args.steps):
            timer.start()
            with comm if i == max(args.warmup - 1, 0) else contextlib.nullcontext():
                opt.zero_grad(set_to_none=True)
                loss, held = train(i)
                opt.step()
            # then, untimed: parameters, gradients and optimizer state (ZeRO's in .optim)
            ms = timer.stop()
            state = [v for s in getattr(opt, "optim", opt).state.values() for v in s.values()]
            state = [
                x
                for t in [*params, *(w.grad for w in params), *state]  # DTensor: its local shard
                if torch.is_tensor(t) and t.dim()
                for x in unwrapped(t)
            ]
            counted = max(counted, held + tensor_bytes(state))
            losses.append(loss)
            log_step(d, i, loss, ms, args.batch_size * args.seq_len)
    sent = torch.tensor([comm.total()], dtype=torch.float64, device=d.device)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # the busiest rank, as the technique files report
    figures = dict(
        comm_ops_rank0=comm.table(), step_ms_all=timer.ms, **getattr(train, "figures", dict)()
    )
    write_summary(
        d,
        args,
        f"torch-{args.worker}",
        losses,
        timer.median(),
        args.batch_size * args.seq_len / max(timer.median(), 1e-9) * 1e3,
        peak_memory_bytes(d, counted),
        sent.item(),
        None,
        figures,
    )
    harness.close_dist()


def paired_worker(args):
    """`torchrun bench.py --worker paired --pairs NAME`: both sides of one pair in these processes,
    each its own model, on the same data: --warmup steps of each (untimed), then --blocks blocks of
    --block-steps steps per side in the order A B, B A, A B, ... (A: ours; --flip 1 starts with
    torch's), so that whatever the machine does hits two neighbouring blocks alike, and a drift
    across the launch cancels in the mean of the blocks' log ratios. Each block starts once every
    rank has arrived and ends at the loss of its last step (.item(): the device is done). Per block
    and side: wall ms per step (mean over ranks) and process CPU ms per step (user + system, all
    threads, summed over ranks); the 1-minute load average. Peaks and bytes are not counted here:
    each side's are from a launch of its own (bench_paired)."""
    d = init_dist(args.timeout)
    torch.set_num_threads(args.threads)
    worker = PAIRS[args.pairs][2]
    _, opt, train = WORKERS[worker][0](d, args, worker, CommCounter())

    def theirs(i):
        opt.zero_grad(set_to_none=True)
        loss = train(i)[0]
        opt.step()
        return loss

    sides = (OURS[args.pairs](d, args, args.pairs), theirs)
    losses = ([], [])
    blocks = []
    for j in range(-1, args.blocks):  # j = -1: the warm-up
        ours_first = first_in_block(j, args.flip) == 0
        # wall ours, torch; CPU ours, torch
        clock = torch.zeros(4, dtype=torch.float64, device=d.device)
        for side in (0, 1) if ours_first else (1, 0):
            arrived = torch.zeros(1, device=d.device)
            dist.all_reduce(arrived)
            arrived.item()  # every rank is here
            wall = time.perf_counter()
            cpu = time.process_time()
            for _ in range(args.warmup if j < 0 else args.block_steps):
                losses[side].append(sides[side](len(losses[side])))
            clock[side] = time.perf_counter() - wall
            clock[2 + side] = time.process_time() - cpu
        dist.all_reduce(clock)  # summed over ranks
        ms = (clock * 1e3 / args.block_steps).tolist()
        wall_ms = [ms[0] / d.world, ms[1] / d.world]
        if j >= 0:
            blocks.append(dict(wall_ms=wall_ms, cpu_ms=ms[2:], ours_first=ours_first, load=load()))
    figures = dict(blocks=blocks, torch_losses=losses[1])
    write_summary(d, args, "paired", losses[0], None, None, None, None, figures=figures)
    harness.close_dist()


# 0: ours first. A B, B A, ...: a steady drift cancels in pairs of blocks
def first_in_block(j, flip):
    return (j + flip) % 2


def load():  # the machine's 1-minute load average (runnable processes), where the OS reports it
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def overlap_worker(d, args):
    """`torchrun bench.py --worker overlap`: how much of the gradient all-reduce backward hides, for
    ddp_bucketed.BucketedDDP and torch's DDP at --bucket-cap-mb. Each step times, whole (StepTimer:
    on a GPU synchronised at both ends), (1) backward with the buckets overlapped, as trained, (2)
    backward under no_sync (compute only), (3) the same bucket sizes all-reduced after it. Hidden
    share = (t2 + t3 - t1) / t3: 1 if the all-reduce cost nothing extra, 0 if overlapping saved
    nothing. No optimizer step needed."""
    from ddp_bucketed import BucketedDDP, bucket_layout

    torch.set_num_threads(args.threads)
    data = MarkovData(args.vocab, args.seed)
    out = {}
    timer = StepTimer(d.device)
    for impl in ("ours", "torch"):
        model = gpt(args, d.device)
        if impl == "ours":
            net = BucketedDDP(
                model, bucket_cap_mb=args.bucket_cap_mb, first_bucket_mb=args.bucket_cap_mb
            )
            sizes = lambda: [wire for *_, wire in bucket_layout(net)]  # noqa: E731
        else:
            net = torch_ddp(model, d, args)
            sizes = lambda: ddp_bucket_sizes(net)  # noqa: E731
        t = collections.defaultdict(list)

        def timed(key, fn):
            dist.barrier()
            timer.start()
            fn()
            t[key].append(timer.stop())

        def all_reduce_buckets():
            # the gradients, into buckets
            flat = torch.cat([w.grad.reshape(-1) for w in model.parameters()])
            bufs = flat.split([s // flat.element_size() for s in sizes()])
            for work in [dist.all_reduce(buf, async_op=True) for buf in bufs]:
                work.wait()

        # twice the steps: three short timings each, noisier than a step
        for i in range(2 * args.steps):
            x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch
            n_tok = count_tokens(y)  # of the global batch
            x, y = my_rows(d, x, y)  # (B/N, T)
            for key, sync in (("overlapped", contextlib.nullcontext), ("backward", net.no_sync)):
                model.zero_grad(set_to_none=True)
                with sync():  # the forward untimed, then its backward timed
                    timed(
                        key,
                        (lm_loss(net(x), y, n_tok) * d.world).backward,
                    )
            timed("allreduce", all_reduce_buckets)
        med = {key: statistics.median(v[args.warmup :]) for key, v in t.items()}
        hidden = (med["backward"] + med["allreduce"] - med["overlapped"]) / max(
            med["allreduce"], 1e-9
        )
        out[impl] = dict(med, hidden_share=hidden, buckets=len(sizes()))
        d.log(f"overlap {impl}: {out[impl]}")
    write_summary(d, args, "overlap", [], 0.0, 0.0, 0, 0, None, out)
    harness.close_dist()


@contextlib.contextmanager
def profiled(out_dir, stem):
    """--profile: the block under torch.profiler; writes OUT_DIR/STEM.rank<r>.json (a Chrome trace),
    and rank 0 prints the main thread's biggest top-level ops from the first batch on (set-up left
    out)."""
    if not out_dir:
        yield
        return
    kinds = torch.profiler.ProfilerActivity
    with torch.profiler.profile(
        activities=[kinds.CPU] + [kinds.CUDA] * torch.cuda.is_available(), record_shapes=True
    ) as p:
        yield
    rank, top = os.environ.get("RANK", "0"), [e for e in p.events() if e.cpu_parent is None]
    os.makedirs(out_dir, exist_ok=True)
    p.export_chrome_trace(os.path.join(out_dir, f"{stem}.rank{rank}.json"))
    main = statistics.mode(e.thread for e in top)
    # the first batch
    t0 = min((e.time_range.start for e in top if e.name == "aten::multinomial"), default=0)
    ms, calls = collections.Counter(), collections.Counter()
    for e in (e for e in top if e.thread == main and e.time_range.start >= t0):
        ms[e.name], calls[e.name] = ms[e.name] + e.cpu_time_total / 1e3, calls[e.name] + 1
    if rank == "0":
        print(
            "".join(f"profile {v:9.1f} ms {calls[k]:5d} x {k[:80]}\n" for k, v in ms.most_common(8))
        )


def profile_run(argv):
    """`torchrun bench.py --profile-run DIR FILE ARGS...`: one of our files as __main__ under the
    profiler, which stops when the file reaches close_dist. The files end through
    harness.Run.finish, which calls harness's close_dist (imported from common): both names are
    patched."""
    import runpy

    import common

    out_dir = argv[0]
    script = argv[1]
    rest = argv[2:]
    session, close = profiled(out_dir, Path(rest[rest.index("--json") + 1]).stem), common.close_dist

    def close_and_export(ok=True):
        session.__exit__(None, None, None)
        close(ok)

    common.close_dist = harness.close_dist = close_and_export
    sys.argv = [script, *rest]
    session.__enter__()
    runpy.run_path(str(ROOT / script), run_name="__main__")


# ------------------------------------------------------------------- how sure: an interval per pair
# Samples: the rounds' ratios ours / torch (a round's runs are neighbours in time: drift cancels in
# their ratio; one run's steps share its drift). Student's t on their logs (0.8 and 1.25 are as far
# from 1): exact for log-normal noise at any number of rounds, where a percentile bootstrap over 3
# rounds cannot reach past the extreme rounds, which hold the median between them 1 - 2 x 2^-3 = 75%
# of the time, not 95%. The spread is the first --rounds rounds' (Stein's two-stage interval,
# exact): rounds added because it was wide must not re-estimate it, or the alternation stops when it
# happens to be low, and undercovers (docs/bench.md).
LEVEL = 0.95


@functools.lru_cache(maxsize=None)
def t_quantile(p, df):
    """Student's t quantile, p > 1/2 (none in torch): bisection on 1/2 + Simpson's integral from
    0."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    lo = 0.0
    hi = 1e3
    for _ in range(50):
        u = torch.linspace(0, (lo + hi) / 2, 4001, dtype=torch.float64)
        f = c * (1 + u * u / df) ** (-(df + 1) / 2)
        below = 0.5 + (4 * torch.trapezoid(f, u) - torch.trapezoid(f[::2], u[::2])).item() / 3 < p
        lo, hi = ((lo + hi) / 2, hi) if below else (lo, (lo + hi) / 2)
    return (lo + hi) / 2


def ratio_interval(ratios, first=None, level=LEVEL):
    """(geometric mean, low, high) at `level`; the spread is the first `first` (>= 2) rounds'."""
    logs, k = [math.log(r) for r in ratios], min(max(first or len(ratios), 2), len(ratios))
    if k < 2:
        return None
    mean, sd = (
        statistics.fmean(logs),
        math.dist(logs[:k], [statistics.fmean(logs[:k])] * k) / (k - 1) ** 0.5,
    )
    half = t_quantile((1 + level) / 2, k - 1) * sd / len(logs) ** 0.5
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def verdict(iv):  # ours "faster" / "slower" only where the whole interval is below / above 1
    return (
        "faster"
        if iv and iv[2] < 1
        else "slower"
        if iv and iv[1] > 1
        else "no difference measurable"
    )


def judge(ratios, precision, first=None):
    """A pair's row from its rounds' ratios; noisy: a log half-width over log(1 + precision)."""
    iv = ratio_interval(ratios, first)
    noisy = iv is None or math.log(iv[2] / iv[1]) / 2 > math.log1p(precision)
    return dict(
        ratio=iv and iv[0],
        interval=iv and list(iv[1:]),
        rounds=len(ratios),
        verdict=verdict(iv),
        noisy=noisy,
        ratio_per_round=ratios,
    )


def say(row):
    """A pair's judgement in words: a ratio only beside a verdict the interval supports."""
    lo, hi = row["interval"] or (0, 0)
    n = row["rounds"]
    unit = row.get("unit", "round")
    ratio = "" if row["verdict"][0] == "n" else "%.2f "
    noise = f", noisy (+-{100 * (math.sqrt(hi / lo) - 1):.0f}%)" if row["noisy"] and lo else ""
    span = f"[{lo:.2f}, {hi:.2f}]" if lo else "no interval"
    return (
        f"{row['verdict']}: {ratio and ratio % row['ratio']}{span}, {n} "
        f"{unit}{'s' * (n != 1)}{noise}"
    )


# per round where both sides ran: median step ms of ours / of torch's
def paired(args, ours, torch_runs):
    # noqa: E731
    ok = lambda r: r["rc"] == 0 and statistics.median(r["ms"][args.warmup :] or [0]) > 0
    return [
        statistics.median(a["ms"][args.warmup :]) / statistics.median(b["ms"][args.warmup :])
        for a, b in zip(ours, torch_runs)
        if ok(a) and ok(b)
    ]


# ----------------------------------------------------------------------------- the driver: A B A B
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss .*?\|\s+([\d.]+) ms", re.M)


def launch(args, pair, tag, worker=None):
    """One torchrun launch of our file of `pair`, or of bench.py's `worker`: summary, step ms,
    command."""
    opts = lambda names: [
        str(x) for n in names.split() for x in ("--" + n.replace("_", "-"), vars(args)[n])
    ]
    if worker:
        tail = [
            "bench.py",
            "--worker",
            worker,
            *opts(MODEL + " microbatches bucket_cap_mb threads warmup blocks block_steps flip"),
            "--pairs",
            pair,
        ]
        tail += ["--profile", args.profile]
    else:
        flags = (
            PAIRS[pair][1]
            .format(m=args.microbatches, world=args.world, cap=args.bucket_cap_mb)
            .split()
        )
        profile = ["bench.py", "--profile-run", args.profile] if args.profile else []
        tail = [*profile, PAIRS[pair][0], *flags, *opts(MODEL)]
    out_json = Path(args.out).with_name(f"{Path(args.out).name}_runs") / f"{tag}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={1 if worker == 'single' else args.world}",
        *tail,
        "--json",
        str(out_json),
    ]
    env, t0 = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1"), time.time()
    output, rc = torchrun(cmd, env, args.launch_timeout)
    steps = {int(s): float(v) for s, v in STEP_LINE.findall(output)}
    ms = [steps[k] for k in sorted(steps)]
    timed = (
        f"  median step {statistics.median(ms[args.warmup :]):8.1f} ms" if ms[args.warmup :] else ""
    )
    print(f"  {tag:28s} rc {rc}  {time.time() - t0:5.1f} s wall{timed}", flush=True)
    shown = (
        output.splitlines()[-15:]
        if rc
        else [x for x in output.splitlines() if x.startswith("profile ")]
    )
    # why it failed, or its profile
    print("".join(f"    | {line}\n" for line in shown), end="", flush=True)
    summary = json.loads(out_json.read_text()) if rc == 0 and out_json.exists() else None
    return dict(rc=rc, summary=summary, ms=ms, cmd=" ".join(cmd[3:]), load=load())


def torchrun(cmd, env, timeout):
    """(output, exit code) of a torchrun command. Past `timeout` s the agent gets SIGTERM, on which
    it stops its workers (each in a session of its own) and exits; a SIGKILL, as subprocess.run's
    timeout sends, would leave the workers running, training on."""
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as p:
        try:
            return p.communicate(timeout=timeout)[0], p.returncode
        except subprocess.TimeoutExpired:
            p.terminate()
            return f"{p.communicate()[0]}\ntimed out after {timeout} s", -1


def side_row(args, pair, side, runs, one_ms, med=None):
    """A side's row from its runs; the step time `med`, else the median over its runs' timed
    steps."""
    ok = [r for r in runs if r["rc"] == 0 and len(r["ms"]) > args.warmup]
    if not ok:
        return dict(name=None, error=(runs[-1]["cmd"] if runs else "not run"))
    s, tokens = ok[-1]["summary"] or {}, args.batch_size * args.seq_len
    med = med or statistics.median(t for r in ok for t in r["ms"][args.warmup :])
    f = s.get("figures", {})
    # a file that reports one collective's bytes (fp8.py: its all-gather) and
    sent = s.get("comm_bytes")
    if isinstance(f.get("comm"), dict):  # CommCounter's table of all: the sum of the table
        sent = sum(handed for _, _, handed in f["comm"].values())
    row = dict(
        name=PAIRS[pair][0] if side == "ours" else WORKERS[PAIRS[pair][2]][1],
        step_ms=med,
        tokens_per_s=tokens / med * 1e3,
        peak_mem_bytes=s.get("peak_mem_bytes"),
        sent_bytes_per_rank=sent,
        losses=s.get("losses"),
        command=ok[-1]["cmd"],
    )
    # the idle share of the step; ptdp.py and zero_bubble.py report idle / busy
    if "bubble_mean" in f:
        share = (
            (lambda b: b / (1 + b))
            if "idle / busy" in f.get("bubble_definition", "")
            else (lambda b: b)
        )
        row.update(
            bubble=statistics.mean(map(share, f["bubble"])), bubble_theory=share(f["bubble_theory"])
        )
    if one_ms and PAIRS[pair][3] == "dp":  # tokens/s at world N / (N x tokens/s of one process)
        row.update(scaling_efficiency=(tokens / med) / (args.world * tokens / one_ms))
    return row


def bench_group(args, pairs, one_ms, share_s):
    """Pairs that share torch's side (ddp and dp_sync: both against DDP) run in one alternation, A C
    B: at least --rounds times, then on while an interval is wider than --precision and one more
    round (at the mean round's time) ends within share_s seconds of the start; a failed launch ends
    the extra rounds."""
    worker, runs = PAIRS[pairs[0]][2], {p: [] for p in [*pairs, "torch"]}
    print(f"{', '.join(PAIRS[p][0] for p in pairs)} vs {WORKERS[worker][1]}", flush=True)
    t0, judged = time.time(), {}
    for r in itertools.count():  # alternating: drift on the machine hits every side alike
        if r >= args.rounds and (
            not any(j["noisy"] for j in judged.values())
            or any(x[-1]["rc"] for x in runs.values())
            or (time.time() - t0) * (r + 1) / r > share_s
        ):
            break
        for p in pairs:
            runs[p].append(launch(args, p, f"{p}_ours_w{args.world}_r{r}"))
        runs["torch"].append(launch(args, pairs[0], f"{worker}_torch_w{args.world}_r{r}", worker))
        judged = {
            p: judge(paired(args, runs[p], runs["torch"]), args.precision, args.rounds)
            for p in pairs
        }
        print(
            f"  after round {r + 1}: " + "; ".join(f"{p} {say(judged[p])}" for p in pairs),
            flush=True,
        )
    rows = []
    for p in pairs:
        o, t = (
            side_row(args, p, "ours", runs[p], one_ms),
            side_row(args, p, "torch", runs["torch"], one_ms),
        )
        loss_diff = rel_diff(o.get("losses"), t.get("losses"))
        load = [r["load"] for r in runs["torch"] if r["load"] is not None] or [0.0]
        note = f"; on wall time of separate launches, load {min(load):.1f}-{max(load):.1f}"
        row = dict(pair=p, ours=o, torch=t, **judged[p], max_loss_diff=loss_diff, load=load)
        rows.append(dict(row, note=note))
    return with_overlap(args, pairs, rows)


def with_overlap(args, pairs, rows):  # ddp's row: the share of all-reduce hidden behind backward
    if "ddp" in pairs and args.world > 1:
        r = launch(args, "ddp", "ddp_overlap", "overlap")
        if r["summary"]:
            rows[pairs.index("ddp")]["overlap"] = r["summary"]["figures"]
    return rows


def samples_needed(ratios, first, precision, level=LEVEL):
    """Stein's second stage: the samples in all that bring the interval's log half-width, at the
    spread of the first `first`, to log(1 + precision)."""
    logs = [math.log(r) for r in ratios[:first]]
    t = t_quantile((1 + level) / 2, first - 1)
    return math.ceil((t * statistics.stdev(logs) / math.log1p(precision)) ** 2)


def bench_paired(args, pairs, one_ms, share_s):
    """A pair paired in one launch (paired_worker): a launch of --blocks blocks, then (each starting
    with the other side) the blocks that the first launch's spread says both intervals, wall and
    CPU, need to reach --precision (Stein's second stage), in as few launches as share_s holds;
    the samples are the blocks' ratios. The verdict rests on wall time, or on CPU time where the
    load passed the core count at some block (other processes then took time from both sides,
    which CPU time does not count). Then each side once in a launch of its own (our file, torch's
    worker): its peak memory, bytes sent, bubble and losses, measured apart."""
    pair = pairs[0]
    worker = PAIRS[pair][2]
    print(f"{PAIRS[pair][0]} vs {WORKERS[worker][1]}, paired in one launch", flush=True)
    t0 = time.time()
    runs = []
    k = args.blocks  # the first stage
    while True:
        tag = f"{pair}_paired_w{args.world}_l{len(runs)}"
        t1 = time.time()
        paired_args = dataclasses.replace(args, flip=len(runs) % 2, blocks=k)
        runs.append(launch(paired_args, pair, tag, "paired"))
        done = [r["summary"] for r in runs if r["summary"]]
        blocks = [b for s in done for b in s["figures"]["blocks"]]
        first = len(done[0]["figures"]["blocks"]) if done else None
        wall, cpu = (
            dict(judge([b[k][0] / b[k][1] for b in blocks], args.precision, first), unit="block")
            for k in ("wall_ms", "cpu_ms")
        )
        loads = [b["load"] for b in blocks if b["load"] is not None] or [0.0]
        busy = max(loads) > os.cpu_count()
        row = dict(cpu if busy else wall, rests_on="CPU time" if busy else "wall time")
        row.update(wall=wall, cpu=cpu, load=loads)
        row["note"] = f"; on {row['rests_on']}, load {min(loads):.1f}-{max(loads):.1f}" + (
            f" > {os.cpu_count()} cores" * busy
        )
        print(
            f"  after launch {len(runs)}: wall {say(wall)}; CPU {say(cpu)}{row['note']}", flush=True
        )
        noisy = [r for r in (wall, cpu) if r["noisy"]]
        if not noisy or runs[-1]["rc"] or not blocks:
            break
        # the next launch: its start-up (this one's, less its blocks) and k blocks, within share_s
        block_s = statistics.fmean(sum(b["wall_ms"]) * args.block_steps / 1e3 for b in blocks)
        start_s = max(time.time() - t1 - block_s * k, 0.0)
        need = max(samples_needed(r["ratio_per_round"], first, args.precision) for r in noisy)
        room = (t0 + share_s - time.time() - start_s) / block_s
        k = min(max(need - len(blocks), 2), int(room))
        if k < 2:
            break
    sides = []
    for side, tag, w in (("ours", pair, None), ("torch", worker, worker)):
        ms = statistics.median(b["wall_ms"][side == "torch"] for b in blocks) if blocks else None
        run = launch(args, pair, f"{tag}_{side}_w{args.world}", w)  # its peak and bytes, apart
        sides.append(side_row(args, pair, side, [run], one_ms, ms))
    last = done[-1] if done else {}
    return with_overlap(
        args,
        pairs,
        [
            dict(
                pair=pair,
                ours=sides[0],
                torch=sides[1],
                **row,
                max_loss_diff=rel_diff(sides[0].get("losses"), sides[1].get("losses")),
                paired_loss_diff=rel_diff(
                    last.get("losses"), last.get("figures", {}).get("torch_losses")
                ),
            )
        ],
    )


def rel_diff(ours, theirs):  # the largest relative difference of a step's loss between the sides
    return max((abs(x - y) / abs(y) for x, y in zip(ours or [], theirs or [])), default=None)


def markdown(args, rows, wall_s, one_ms):
    fmt = lambda x, f="%.0f", s=1: (f % (x / s)) if x is not None else "-"  # noqa: E731
    two = lambda o, t, k, *f: f"{fmt(o.get(k), *f)} / {fmt(t.get(k), *f)}"  # noqa: E731
    a, n = (
        args,
        sum(w.numel() for w in gpt(args).parameters()),
    )
    lines = [
        f"`python bench.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
        "",
        f"world {a.world} on {'NCCL' if torch.cuda.is_available() else 'gloo, CPU'}, {a.threads} "
        f"thread(s) per rank, {os.cpu_count()} CPU cores; GPT {n / 1e6:.1f} M parameters (vocab "
        f"{a.vocab}, width {a.d_model}, {a.n_layers} blocks, {a.seq_len} tokens x {a.batch_size} "
        f"sequences), {a.dtype}; paired pairs: {a.warmup} untimed steps per side, then {a.blocks} "
        f"blocks of {a.block_steps} steps per side in the first launch, A B, B A, ..., then in one "
        f"more the blocks its spread says wall and CPU time need; the others: {a.steps} steps per "
        f"run, the first {a.warmup} untimed, at least {a.rounds} rounds A B, more while an "
        f"interval was wider than +-{a.precision:.0%}; within --budget-min "
        f"{a.budget_min:g}; whole bench {wall_s / 60:.1f} min.",
        "",
        f"| pair | ours | torch | ours ms | torch ms | wall time: ours / torch [{LEVEL:.0%}] | CPU "
        f"time: ours / torch [{LEVEL:.0%}] | the verdict rests on, at load | tok/s ours / torch | "
        "peak MiB/rank ours / torch | sent MiB/rank/step ours / torch | bubble ours / torch "
        "(theory) | scaling eff. ours / torch | loss diff (apart / paired) |",
        "|---|---|---|---:|---:|---|---|---|---|---|---|---|---|---:|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['pair']} | skipped: {r['skipped']} |" + " |" * 12)
            continue
        o, t = r["ours"], r["torch"]
        theory = o.get("bubble_theory", t.get("bubble_theory"))
        cells = [
            r["pair"],
            f"`{o['name'] or 'failed'}`",
            t["name"] or "failed",
            fmt(o.get("step_ms")),
            fmt(t.get("step_ms")),
            say(r.get("wall", r)),
            say(r["cpu"]) if "cpu" in r else "-",
            r["note"].removeprefix("; on "),
            two(o, t, "tokens_per_s"),
            two(o, t, "peak_mem_bytes", "%.1f", MiB),
            two(o, t, "sent_bytes_per_rank", "%.1f", MiB),
            f"{two(o, t, 'bubble', '%.2f')} ({theory:.2f})" if theory is not None else "",
            two(o, t, "scaling_efficiency", "%.2f") if "scaling_efficiency" in {**o, **t} else "",
            fmt(r["max_loss_diff"], "%.0e")
            + (f" / {fmt(r['paired_loss_diff'], '%.0e')}" if "paired_loss_diff" in r else ""),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    hid = lambda x: (
        f"{x['overlapped']:.0f} / {x['backward']:.0f} + {x['allreduce']:.0f} ms = "  # noqa: E731
        f"{100 * x['hidden_share']:.0f}% hidden ({x['buckets']} buckets)"
    )
    lines += [
        f"\nAll-reduce hidden behind backward ({a.bucket_cap_mb} MiB buckets; median ms of "
        "backward "
        f"overlapped / backward alone + the same buckets reduced after it): ddp_bucketed "
        f"{hid(r['overlap']['ours'])}; torch DDP {hid(r['overlap']['torch'])}."
        for r in rows
        if "overlap" in r
    ]
    lines += [
        "",
        "Verdict: paired pairs (both sides in one launch): each block's ratio of wall time (or of "
        "process CPU time, user + system of all threads, summed over ranks) per step ours / torch "
        f"(< 1: ours faster); their geometric mean and {LEVEL:.0%} interval (Student's t on the "
        "logs, the first launch's blocks' spread); the verdict rests on wall time, or on CPU time "
        "where the 1-minute load average passed the core count at a block (load: its range over "
        "the blocks). Other pairs: each round's ratio of median step times of separate launches, "
        f"the first {a.rounds} rounds' spread. faster / slower: the whole interval below / above "
        "1; no difference measurable (no ratio printed): it holds 1; noisy: wider than "
        f"+-{a.precision:.0%} when the budget ran out. ms: median over all blocks (rounds' timed "
        "steps). Loss diff: the largest relative difference of a step's loss between the sides, "
        "each in a launch of its own (paired pairs: that launch also gives the peak, bytes and "
        "bubble). Peak memory: CUDA's peak on GPUs, on CPU counted from tensors (parameters, "
        "gradients, optimizer state, saved activations, DDP buckets / FSDP gathered parameters). "
        "Sent: bytes the busiest rank hands to collectives and sends in a step (ours counted by "
        "the file, torch's at the dispatcher by harness.CommCounter): an all-gather's shard, a "
        "reduce-scatter's whole input, a broadcast at its root. Bubble: idle share of the last "
        "step; theory with equal F, B (and W) times. Scaling efficiency: tokens/s at world "
        f"{a.world} / ({a.world} x tokens/s of one-process training on the whole batch"
        + (f", {a.batch_size * a.seq_len / one_ms * 1e3:.0f} tok/s here)." if one_ms else ")."),
    ]
    return "\n".join(lines) + "\n"


def why_skipped(pair):
    """'' when torch's side can import what it needs (IMPORTS) and our file offers the choice `pair`
    needs (NEEDS); else why not (a package outside requirements.txt, or a mode still being written
    in another branch). The choice is read from the file's Args, which its --help shows."""
    if pair in IMPORTS:
        try:
            importlib.import_module(IMPORTS[pair])
        except ImportError:
            return f"{IMPORTS[pair]} not installed: pip install {IMPORTS[pair]} to run this pair"
    if pair not in NEEDS:
        return ""
    flag, choice = NEEDS[pair]
    file = PAIRS[pair][0]
    hints = typing.get_type_hints(importlib.import_module(file.removesuffix(".py")).Args)
    offered = typing.get_args(hints.get(flag[2:].replace("-", "_")))
    return (
        ""
        if choice in offered
        else f"{file} has no {flag} {choice} yet ({flag} offers {list(offered)})"
    )


def cannot_run(pair, args):
    """'' where this world and machine have the pair's layout and torch's kernels; else why not."""
    if pair == "hsdp" and args.world % 2:
        return f"needs an even --world (2 replicas x world/2 shards), got {args.world}"
    if pair == "dualpipev" and not 2 <= args.world <= args.microbatches // 2:
        return f"needs 2 <= --world <= --microbatches / 2 (DualPipeV's m >= 2p), got {args.world}"
    cuda = torch.cuda.is_available() and 2 <= args.world <= torch.cuda.device_count()
    peers = cuda and all(
        torch.cuda.can_device_access_peer(i, j)
        for i in range(args.world)
        for j in range(args.world)
        if i != j
    )
    if pair == "tp_overlap" and not (peers and args.seq_len % args.world == 0):
        return (
            "torch's fused_all_gather_matmul / fused_matmul_reduce_scatter run on CUDA only, on "
            "--world "
            f">= 2 peer-connected GPUs dividing --seq-len; here {torch.cuda.device_count()} GPU(s)"
        )
    return ""


def check_bench_args(args):
    check_common_args(args)
    names = (
        list(PAIRS)
        if args.pairs == "all"
        else [p.strip() for p in args.pairs.split(",") if p.strip()]
    )
    if not names or set(names) - set(PAIRS):
        fail(
            f"--pairs: unknown {sorted(set(names) - set(PAIRS)) or repr(args.pairs)}; choose from "
            f"{','.join(PAIRS)} or all"
        )
    if not (0 < args.precision <= 1 and 0 <= args.budget_min <= 1e4):  # NaN fails both
        fail(
            f"need 0 < --precision <= 1, 0 <= --budget-min <= 1e4: got {args.precision}, "
            f"{args.budget_min}"
        )
    for flag in ("world", "rounds", "microbatches", "threads", "launch_timeout"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.warmup < args.steps:  # the last warm-up step counts the bytes sent, slowly
        fail(
            f"--warmup {args.warmup} must be >= 1 and leave a timed step: 1 <= --warmup < --steps "
            f"{args.steps}"
        )
    if args.batch_size % (args.world * args.microbatches):
        fail(
            f"--batch-size {args.batch_size} must divide by --world x --microbatches = "
            f"{args.world * args.microbatches}"
        )
    if (
        {"ptdp", "zbv", "dualpipev"} & set(names)
        and args.n_layers % (2 * args.world)
        or args.n_layers < args.world
    ):
        fail(
            f"--n-layers {args.n_layers} must be >= --world {args.world} (a block per stage) and, "
            "for ptdp, "
            f"zbv and dualpipev, divide by 2 x --world = {2 * args.world} (two stages per rank)"
        )
    if args.n_heads % args.world:
        fail(
            f"--n-heads {args.n_heads} must divide by --world {args.world} (the tp pair splits "
            "heads)"
        )
    if not args.bucket_cap_mb * MiB >= 1:
        fail(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    return names


def main():
    if sys.argv[1:2] == ["--profile-run"]:
        return profile_run(sys.argv[2:])
    args = parse_args(Args)
    if args.worker == "overlap":
        return overlap_worker(init_dist(args.timeout), args)
    if args.worker:
        return paired_worker(args) if args.worker == "paired" else run_worker(args)
    names = check_bench_args(args)
    t0 = time.time()
    rows = []
    one_ms = None
    groups = {}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for p in names:
        if why := why_skipped(p) or cannot_run(p, args):
            print(f"{p}: pair skipped, {why}", flush=True)
            rows.append(dict(pair=p, ours=None, torch=None, ratio=None, skipped=why))
        else:
            groups.setdefault(p if p in OURS else PAIRS[p][2], []).append(p)
    # the baseline:
    if args.scaling and any(PAIRS[p][3] == "dp" for ps in groups.values() for p in ps):
        ms = launch(args, names[0], "one_process", "single")["ms"][
            args.warmup :
        ]  # one-process training
        one_ms = statistics.median(ms) if ms else None
    # after each group what is done so far, then all
    for i, pairs in enumerate([*groups.values(), []]):
        # the budget left, shared
        share = (t0 + 60 * args.budget_min - time.time()) / max(len(groups) - i, 1)
        rows = sorted(
            rows
            + (
                (bench_paired if pairs[0] in OURS else bench_group)(args, pairs, one_ms, share)
                if pairs
                else []
            ),
            key=lambda r: names.index(r["pair"]),
        )
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))
        Path(args.out + ".md").write_text(md := markdown(args, rows, time.time() - t0, one_ms))
    print("\n" + md + f"\nwrote {args.out}.json and {args.out}.md\n", flush=True)
    judged = [r for r in rows if not r.get("skipped")]
    print(
        "".join(
            f"{r['pair']}: {PAIRS[r['pair']][0]} vs {r['torch']['name']}: {say(r)}{r['note']}\n"
            for r in judged
        )
    )
    if noisy := sum(r["noisy"] for r in judged):
        print(
            f"noisy machine: {noisy} interval(s) wider than +-{args.precision:.0%} when the budget "
            "ran out"
        )
    failed = [
        r["pair"]
        for r in rows
        if not r.get("skipped")
        and (None in (r["ours"]["name"], r["torch"]["name"]) or not r["rounds"])
    ]  # a side that failed, or no round or block timed (a paired launch that failed)
    if failed:
        print(f"failed runs: {failed}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
