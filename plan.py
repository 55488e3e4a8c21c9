"""plan.py: before a run, what fits and what it costs (memory, bytes, bubble, time), any layout, any
scale.

The technique files print measured figures beside theory for the tiny model they train; this is that
theory for your model and cluster, small functions with their formulas, then a search over every
legal layout. tests/test_plan.py launches the files at many layouts and holds these predictions to
each run's counted memory and collective bytes exactly, and to its bubble under --stage-ms. Time,
tokens/s, MFU: predictions.

L layers, h width, a heads, s sequence, V vocabulary, b sequences per micro-batch, m micro-batches
per step and replica, t tensor-, p pipeline-, d data-parallel degree, v chunks per pipeline rank, e
bytes per activation element, Psi parameters of one rank (its pipeline stage, its 1/t).
  model state  ZeRO (Rajbhandari et al. 2020, Sec. 5, Fig. 1), p, g, K bytes per parameter (mixed-precision
               Adam 2, 2, 12): stage 0 (p+g+K) Psi, 1 (p+g) Psi + K Psi/d, 2 p Psi + (g+K) Psi/d, 3
               (p+g+K) Psi/d; units (each block, the rest) padded to d ceil(P/d) as zero.py's and
               FSDP's flat parameters; stage 3 also holds p (root + 2 largest units) gathered. HSDP
               (--replicate R, zero.py; FSDP's hybrid sharding): ZeRO at d = dp x cp / R, the shard
               group.
  activations  saved for backward per layer and micro-batch (Korthikanti et al. 2022, Table 2: eager
               attention, fp16, dropout): sbh(34 + 5as/h), TP sbh(10 + 24/t + 5as/(ht)), TP+SP sbh/t
               (34 + 5as/h); selective recomputation drops 5as/h, full keeps 2sbh. layer_items sums
               the same tensor by tensor, here as this repo's GPT saves them: flash attention (a
               logsumexp per head, no s x s terms), norm statistics, no dropout. Micro-batches alive
               on pipeline rank r: GPipe m, 1F1B p - r, interleaved its warm-up + 1 chunks; zero
               bubble (ZB-H1, ZB-V, DualPipeV) the schedule walked, each micro-batch until its W,
               from its B holding each linear's input and output gradient (ZB-H1: p on every rank,
               DualPipeV 2p+1 chunks); with
               Layout.outputs also each stage's output, which this repo's pipelines hold to its
               backward. Chunks: the files' cut (earlier ones one block more) or --stage-layers;
               ZB-V and DualPipeV put chunks r and 2p-1-r on rank r.
  bytes        handed to collectives per rank and step, as harness.CommCounter counts (an all-reduce's tensor,
               an all-gather's local input, a reduce-scatter's or all-to-all's whole input, a send):
               TP (Shoeybi et al. 2019, Sec. 3) 2 all-reduces of bsh forward, 2 backward per layer;
               SP (Korthikanti Sec. 4.2.2) each an all-gather + reduce-scatter, + 1 re-gather per
               column layer; PP a bsh message per chunk boundary, micro-batch and direction; ZeRO 0
               all-reduce g Psi, 1 reduce-scatter g Psi + all-gather p Psi/d, 2 the reduce-scatter
               per micro-batch, 3 per micro-batch 2 all-gathers p Psi/d (fp8: its GEMM weights at 1
               byte, forward's + 4 per 128x128 block) + a reduce-scatter; HSDP those in its shard
               group of d, then each reduced shard g Psi/d all-reduced across the R replicas, once
               per step at stage 1, per micro-batch at 2-3; MoE (Lepikhin et al. 2020) 4 all-to-alls
               of E C h e per MoE layer and micro-batch, C = ceil(cf k bs / E). On the wire (ring):
               all-reduce 2(n-1)/n, others (n-1)/n of the whole; NVLink when the group fits in a
               node of the grid arange(world).view(pp, dp, cp, tp) (tp innermost, ep inside dp, an
               HSDP shard group d consecutive of dp x cp), else InfiniBand, where NCCL's ring waits
               14 us at each step from a node to the next (its tuning model; ZeRO's once a unit).
  bubble       idle share of the step (Narayanan et al. 2021, PTD-P, Sec. 2.2): GPipe, 1F1B (p-1)/(m+p-1);
               interleaved (p-1)/(vm) of ideal compute; with backward split into B and W of a
               forward's time each (Qi et al. 2023, Zero Bubble): ZB-H1 (p-1)(T_F + T_B - T_W), a
               third of 1F1B's; ZB-V (p-1) T_F, its ramp (the paper's 0 bypasses the optimizer's
               synchronisation); both their orders walked at the layout's own F, B (attention's
               backward all here) and W; DualPipeV (DeepSeek-V3 2024, Table 2) ZB-H1's, its F&B
               pair's all-to-all overlap left out (dualpipev.py runs the pair F, B, W in turn).
  context      cp ranks share each sequence (context_parallel.py; Liu et al. 2023 ring, Jacobs et al. 2023
               Ulysses): activations of s/cp tokens, + the all-gather's other K, V and (s/cp, s)
               mask, or Ulysses' head-sharded output; per layer and micro-batch the ring sends cp-1
               K/V blocks forward, as many + fp32 dK/dV backward, all-gather K, V in and a
               reduce-scatter of cp x theirs back, Ulysses 2 all-to-alls each way; gradients summed
               (ZeRO: sharded) over dp x cp.
  time         forward FLOPs per layer 24bsh^2 + 4bs^2h, head 2bshV; training 3x, full recomputation 4x the
               blocks: PTD-P's 96Bslh^2(1 + s/(6h) + V/(16lh)). Seconds per micro-batch: each GEMM's
               FLOPs at --efficiency of peak (fp8: the blocks' projections at the FP8 peak, 2x
               bf16's on an H100; MFU still of bf16's) + its operands and result at HBM speed (so a
               GEMM reaches eff / (1 + eff peak / (HBM x FLOPs per byte)): thin ones less),
               attention per head (eager: s x s scores through HBM; flash: one pass), norms,
               residuals and activations at HBM speed. A step: (m + bubble slots) micro-batch times
               of the slowest stage, + TP (exposed, as Megatron-LM and torchtitan run it unless
               --tp-overlap says), CP (the ring behind attention) and all-to-all time, + what cannot
               hide: the data-parallel reduction beyond the last micro-batch's backward (ZeRO-2:
               each one's; ZeRO-3: all its traffic beyond each micro-batch), the all-gather of
               stages 1-2, a pipeline message (1/t of it per TP rank) per chunk boundary in and out;
               and one NIC a GPU: what the axes across nodes hide (ring, data-parallel, pipeline),
               together, beyond the step's compute (counted with the data-parallel part). The GEMM
               ceiling is the stack's per GPU, fitted on published runs; the band beside each MFU is
               the jackknife's over its leave-one-out errors, about 80% of new runs inside (STACKS,
               docs/plan.md). MFU: model FLOPs (3x) / (step x GPUs x peak).
  the run      --tokens: wall time = tokens / tokens/s, with failures (rate per GPU-hour, a checkpoint every
               tau, Young/Daly's sqrt(2 delta M) by default) to first order; a budget (--gpu-hours,
               --days, --flops) gives N and D by --law: Chinchilla's compute-optimal (Hoffmann et
               al. 2022, Approach 3, Besiroglu et al. 2024's refit), Llama 3's D = A C^alpha (Dubey
               et al. 2024, Sec. 3.2.1), or D = R N (--tokens-per-param); Chinchilla's final loss.
               DiLoCo (--inner-steps): the pseudo-gradient's all-reduce every H steps beside DDP's
               every step. docs/plan.md: examples.

    python plan.py --model gpt3-6.7b --nodes 1 --search             # a 7B model on one node of 8 H100s
    python plan.py --model llama3-70b --nodes 8 --batch-size 256 --search
    python plan.py --model llama3-70b --nodes 8 --tp 8 --pp 4 --virtual-stages 2 --microbatches 256
    python plan.py --model llama3-70b --days 30 --nodes 64 --failures-per-gpu-hour 2e-5  # the whole run
    python plan.py --model llama3-405b --flops 3.8e25 --law llama3 --nodes 2048 --precision fp8
    python plan.py --model llama3-8b --nodes 2 --tp 8 --cp 2 --sequence-parallel --stage 1 --microbatches 64 \
        --batch-size 64
    python -m pytest -q -s tests/test_plan.py -k "paper_rows or zz"  # each paper's figure beside plan's
"""

import itertools
import math
import re
from collections import namedtuple
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Literal

from common import fail
from harness import parse_args

GB = 1e9


# --------------------------------------------------------------------------- model, cluster, layout
class Model(
    namedtuple(
        "Model",
        "layers d heads vocab seq kv_heads ffn arch experts top_k capacity moe_every",
        defaults=(0, 0, "gpt", 0, 1, 1.25, 1),
    )
):
    """L, h, a, V, s; kv_heads (grouped-query attention, 0: a), ffn (MLP width, 0: 4h), arch (gpt:
    common.GPT, LayerNorm, learned positions, biases; llama: RMSNorm, RoPE, SwiGLU); MoE: experts in
    every moe_every-th block (0: dense), top_k per token, capacity factor."""

    kv = property(lambda M: M.kv_heads or M.heads)
    f = property(lambda M: M.ffn or 4 * M.d)


# GPT-3 Table 2.1, Llama 3 Table 3, PTD-P Table 1; harness.CommonArgs, tests/helpers.TINY
PRESETS = {
    "repo": Model(4, 64, 4, 64, 32),
    "tiny": Model(2, 16, 2, 32, 8),
    "gpt3-6.7b": Model(32, 4096, 32, 50257, 2048),
    "gpt3-175b": Model(96, 12288, 96, 50257, 2048),
    "llama3-8b": Model(32, 4096, 32, 128256, 8192, 8, 14336, "llama"),
    "llama3-70b": Model(80, 8192, 64, 128256, 8192, 8, 28672, "llama"),
    "llama3-405b": Model(126, 16384, 128, 128256, 8192, 8, 53248, "llama"),
    "ptdp-1t": Model(128, 25600, 160, 51200, 2048),
}


# per GPU: memory GB, peak dense bf16 TFLOP/s, GB/s per direction inside a node (NVLink) and across
# nodes (its share of the node's InfiniBand), GB/s of its memory (HBM), dense FP8 peak / bf16's (0:
# no FP8)
Cluster = namedtuple(
    "Cluster", "nodes gpus_per_node mem_gb tflops intra_gbs inter_gbs hbm_gbs fp8", defaults=(0,)
)
CLUSTERS = {
    "a100-80g": Cluster(1, 8, 80, 312, 300, 25, 2039),  # NVSwitch 600 GB/s both ways, 8 x 200 Gb/s
    "h100-80g": Cluster(1, 8, 80, 989, 450, 50, 3350, 2),
}  # 900 GB/s, 8 x 400 Gb/s; FP8 1979 TFLOP/s
NO_FP8 = (
    "--precision fp8 needs FP8 tensor cores (H100 and later); this cluster's GPUs have none: "
    "use bf16"
)
EFFICIENCY = 0.7147  # the GEMMs' ceiling: megatron-2021's on A100, fitted on 15 rows (STACKS)


# The software stack of published runs, as flags: attention, dropout, the TP and DP overlaps
# (exposed_s) its software runs by default (docs/plan.md cites each); per GPU {cluster: (GEMM
# ceiling, band, which rows)}: the ceiling the mean of the ceilings that put each fitted row at its
# published figure, the band the jackknife's: of the n leave-one-out errors over those rows, the
# ceil(0.8 (n + 1))-th smallest (points of peak), what about 80% of new runs' errors stay
# within; about a third of each GPU's rows never fitted (held out; docs/plan.md counts those inside
# the band).
# tests/test_plan.py refits both.
Stack = namedtuple("Stack", "attention dropout tp_overlap dp_overlap ceilings")
STACKS = {
    "megatron-2021": Stack(
        "eager",
        True,
        "none",
        "none",
        {  # Megatron-LM of PTD-P: TP all-reduces exposed, gradients reduced after the flush
            "a100-80g": (
                EFFICIENCY,
                3.7,
                "PTD-P Tables 1 and 2, Korthikanti et al. 2022: 15 rows fitted, 6 held out",
            ),
        },
    ),
    "2024": Stack(
        "flash",
        False,
        "none",
        "full",
        {  # TP overlap opt-in in Megatron-LM and torchtitan; FSDP's and DDP's reduction overlapped
            "h100-80g": (
                0.5465,
                11.6,
                "Llama 3 Table 4, MPT's H100 tables: 49 rows fitted, 24 held out",
            ),
            "a100-80g": (
                0.6492,
                9.2,
                "torchtitan's, MPT's A100 tables: 42 rows fitted, 20 held out",
            ),
        },
    ),
}


def ceiling(stack, cluster):
    """(GEMM ceiling, band or None, source) of a stack on a cluster preset; where the stack has no
    rows on that GPU, it says so and has no band (the A100 ceiling of 2021 stands in)."""
    return STACKS[stack].ceilings.get(cluster) or (
        EFFICIENCY,
        None,
        f"no {stack} rows on {cluster}: no ceiling of its own, no band",
    )


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    v: int = 1  # model chunks per pipeline rank (interleaved 1F1B; ZB-V: 2)
    ep: int = 1  # expert-parallel ranks, inside the data-parallel group
    zero: int = 0  # ZeRO stage over the data-parallel group
    m: int = 1  # micro-batches per step and replica (a pipeline's, or gradient accumulation)
    sp: bool = False  # sequence parallelism
    recompute: str = "none"  # none, selective (the attention core), full (keep each layer's input)
    precision: str = "bf16"
    schedule: str = "1f1b"  # gpipe, 1f1b, interleaved, zb-h1, zb-v, dualpipev
    # embedding and head split over V (megatron_tp.py), else replicated (ptdp.py)
    vocab_parallel: bool = True
    # also each stage's output, held to its backward as this repo's pipelines hold it (Megatron
    # frees its data once sent)
    outputs: bool = False
    split: tuple = ()  # blocks per chunk in pipeline order (--stage-layers); () the files' cut
    # context-parallel ranks sharing each sequence (context_parallel.py), between tp and dp
    cp: int = 1
    # allgather, ring, ulysses: how a sequence's cp ranks exchange K and V
    cp_attention: str = "ring"
    # eager: s x s scores saved, through HBM (2021's Megatron); flash: one pass
    attention: str = "flash"
    dropout: bool = False  # dropout after attention and MLP (its masks saved), as in PTD-P's GPT
    # HSDP (zero.py --replicate): R copies of the model, each ZeRO-sharded over dp x cp / R ranks
    replicate: int = 1
    gpus = property(lambda lay: lay.dp * lay.cp * lay.tp * lay.pp)
    # gradients are summed (ZeRO: sharded) over dp x cp
    grad_group = property(lambda lay: lay.dp * lay.cp)
    # the ranks that shard the model state: all of them, or one HSDP shard group
    shard = property(lambda lay: lay.grad_group // lay.replicate)

    def __str__(self):
        pipe = (
            f" pp {self.pp} {self.schedule}" + f" v {self.v}" * (self.v > 1) if self.pp > 1 else ""
        )
        cp = f" cp {self.cp} {self.cp_attention}" if self.cp > 1 else ""
        ep = f" ep {self.ep}" * (self.ep > 1)
        return (
            f"dp {self.dp}{cp} tp {self.tp}{' sp' if self.sp else ''}{pipe}{ep}"
            f" zero {self.zero}{f' replicate {self.replicate}' * (self.replicate > 1)} m {self.m}"
            f" recompute {self.recompute}"
            + (f" blocks {'/'.join(runs(self.split))}" if self.split else "")
            + f" attention {self.attention}" * (self.attention != "flash")
            + " dropout" * self.dropout
        )


def runs(split):  # 7/8/8/8/8/7 as 7/8x4/7 where a count repeats more than 3 times
    groups = [(x, len(list(g))) for x, g in itertools.groupby(split)]
    return [f"{x}x{k}" if k > 3 else "/".join([str(x)] * k) for x, k in groups]


# p, g, K (AdamW), e. fp8: the blocks' GEMMs in FP8 (fp8.py, DeepSeek-V3 Sec. 3.3), all else as
# bf16's: weights, gradients, fp32 master and moments, what backward saves (the bf16 inputs, as
# fp8.py keeps them)
PRECISION = {
    "bf16": (2, 2, 12, 2),
    "fp32": (4, 4, 8, 4),
    "fp64": (8, 8, 16, 8),
    "fp8": (2, 2, 12, 2),
}
# FP8 weights: one fp32 scale per 128x128 block (DeepSeek-V3; fp8.py --recipe fine-grained)
TILE = 128


def capacity(M, tokens):
    """Slots per expert for tokens routed together (GShard, moe.py): ceil(cf k tokens / E), at most
    tokens."""
    return min(tokens, math.ceil(M.capacity * M.top_k * tokens / M.experts))


# ----------------------------------------------------------------------------- parameters
@lru_cache(maxsize=None)
def layer_params(M, moe=False):
    """Elements of one block: (split over t, replicated, experts). common.Block: q, k, v, proj 4h^2
    + h, fc 4h^2 + 4h, proj 4h^2 + h, LayerNorms 4h: 12h^2 + 4h split (column layers, row weights),
    6h replicated. Llama: GQA q, k, v, o, SwiGLU 3hf, 2 RMSNorms. MoE (moe.py): the MLP becomes E of
    (2hf + f + h), a gate hE."""
    h = M.d
    f = M.f
    gpt = M.arch == "gpt"
    attn = 2 * h * h + 2 * h * M.kv * (h // M.heads)
    mlp, bias, repl = (2 * h * f, f, 6 * h) if gpt else (3 * h * f, 0, 2 * h)
    if moe:
        return attn, repl - h * gpt + h * M.experts, M.experts * (mlp + (f + h) * gpt)
    return attn + mlp + bias, repl, 0


@lru_cache(maxsize=None)
def chunks(layers, n, split=()):
    """Blocks of each of n chunks in pipeline order: `split` (blocks per chunk, a hand-made cut:
    fewer on the first and last stages, say), else the files' cut: when n does not divide L the
    earlier chunks take one more (gpipe.py's split)."""
    if split:
        ends = [sum(split[:c]) for c in range(n + 1)]
    else:
        base, extra = divmod(layers, n)
        ends = [c * base + min(c, extra) for c in range(n + 1)]
    return tuple(range(a, z) for a, z in zip(ends, ends[1:]))


def kinds(M, lay, c):
    """(dense blocks, MoE blocks) in chunk c of the layout's pp x v."""
    return _kinds(M, lay.pp * lay.v, lay.split, c)


@lru_cache(maxsize=None)
def _kinds(M, n, split, c):
    blocks = chunks(M.layers, n, split)[c]
    moe = sum(M.experts > 0 and i % M.moe_every == M.moe_every - 1 for i in blocks)
    return len(blocks) - moe, moe


# the schedules that place their 2p chunks in a V; those that split backward into B and W
V_SHAPED = ("zb-v", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", *V_SHAPED)


def mine(lay, r):
    """The chunks pipeline rank r holds, in pipeline order: c = r, r + p, ... (a loop); ZB-V and
    DualPipeV r and 2p-1-r (a V: down, then back up, so rank 0 holds the embedding and the head, and
    the turn stays on rank p-1)."""
    if lay.schedule in V_SHAPED:
        return (r, 2 * lay.pp - 1 - r)
    return tuple(range(r, lay.pp * lay.v, lay.pp))


def owner(lay, c):
    return min(c, 2 * lay.pp - 1 - c) if lay.schedule in V_SHAPED else c % lay.pp


def vocab_padded(M, lay):  # megatron_tp.py rounds V up to a multiple of t
    return -(-M.vocab // lay.tp) * lay.tp if lay.vocab_parallel else M.vocab


def rank_units(M, lay, r):
    """Parameter elements pipeline rank r holds, one per ZeRO unit: each block of its chunks (its
    1/t, its 1/ep of the experts), then the root: embedding (+ positions) on chunk 0, final norm,
    head on the last."""
    units = []
    n = lay.pp * lay.v
    gpt = M.arch == "gpt"
    for c in mine(lay, r):
        for moe, k in zip((False, True), kinds(M, lay, c)):
            split, repl, expert = layer_params(M, moe)
            units += [split // lay.tp + repl + expert // lay.ep] * k
    vh = vocab_padded(M, lay) * M.d // (lay.tp if lay.vocab_parallel else 1)
    return units + [
        (vh + M.seq * M.d * gpt) * (r == 0) + (vh + M.d * (1 + gpt)) * (r == owner(lay, n - 1))
    ]


def gemm_shapes(M, lay, moe=False):
    """(N, K) of each GEMM weight of one block on a TP rank, as nn.Linear holds it (out, in), what
    --precision fp8 runs in FP8: attention's q, k, v (column layers: N / t) and output (row: K / t),
    the MLP's fc (SwiGLU: gate and up) and proj, or this rank's E/ep experts' (whole); not biases,
    norms, gate, embedding, head (fp8.py keeps them as they are, as DeepSeek-V3 does)."""
    h = M.d
    t = lay.tp
    kvh = M.kv * (h // M.heads)
    f_rank = M.f if moe else M.f // t
    mlp = [(f_rank, h)] * (1 if M.arch == "gpt" else 2) + [(h, f_rank)]
    attn = [(h // t, h), (kvh // t, h), (kvh // t, h), (h, h // t)]
    return attn + mlp * (M.experts // lay.ep if moe else 1)


def gemm_units(M, lay, r):
    """The GEMM weights' shapes in each of rank_units' units (gemm_shapes); the root's none."""
    return [
        gemm_shapes(M, lay, moe)
        for c in mine(lay, r)
        for moe, k in zip((False, True), kinds(M, lay, c))
        for _ in range(k)
    ] + [[]]


def padded(units, d):
    return sum(-(-u // d) * d for u in units)


def weight_gather(psi, gemms, d, p, scales=True, tile=TILE):
    """Bytes a rank hands to one ZeRO-3 all-gather of psi elements (padded), `gemms` the (N, K) of
    the FP8 GEMM weights among them: p bytes an element of the rest; each GEMM weight as fp8.py
    shards it, its N rows padded to d shards of whole tiles, ceil(N / (d tile)) tile rows a rank, K
    padded to whole tiles, 1 byte an element, and with `scales` an fp32 scale per TILE x TILE block
    (--fp8-all-gather --recipe fine-grained: forward gathers them, backward reuses them); tile 16
    for fp8.py's per-tensor recipes (cuBLASLt's FP8 rule)."""
    shards = [(-(-n // (d * tile)) * tile, -(-k // tile) * tile) for n, k in gemms]
    rest = psi - sum(n * k for n, k in gemms)
    fp8 = sum(n * k for n, k in shards)
    return p * rest // d + fp8 + 4 * sum(n * k // TILE**2 for n, k in shards) * scales


def model_state(units, d, stage, p, g, K):
    """ZeRO per rank: parameters p Psi (/d at stage 3), gradients g Psi (/d from 2), optimizer K Psi
    (/d from 1); sharded stages pad each unit to d ceil(P/d) (zero.py pads at stage 0 too; DDP does
    not)."""
    psi = padded(units, d) if stage else sum(units)
    return dict(
        params=p * psi // (d if stage >= 3 else 1),
        grads=g * psi // (d if stage >= 2 else 1),
        optim=K * psi // (d if stage >= 1 else 1),
    )


def gathered(units, d, p, gemms=None):
    """ZeRO-3: the root and the two largest units gathered at once (zero.py's bound, FSDP's rate
    limiter); with `gemms` (fp8) their GEMM weights gathered as FP8 and block scales."""
    gemms, top = (
        gemms or [[]] * len(units),
        sorted(range(len(units) - 1), key=units.__getitem__)[-2:],
    )
    return sum(
        d * weight_gather(padded(units[i : i + 1], d), gemms[i], d, p)
        for i in [len(units) - 1, *top]
    )


# ----------------------------------------------------------------------------- activations
def layer_items(M, e, attention="flash", dropout=False, stats=True):
    """Bytes one block saves per token: (what, bytes, split by TP, kept by selective recomputation).
    Korthikanti's row is attention="eager", dropout=True, stats=False, e=2: norm inputs and outputs
    8, q, k, v 6, proj input 2, fc and GeLU outputs 16, two dropout masks 2 = 34 per h; softmax,
    mask, output 5as/h. Llama (tests/test_plan.py holds each term to the tensors a block saves):
    fused RMSNorm (input, 1/rms), RoPE, grouped-query K/V, fused SwiGLU."""
    # statistics: fp32 at least
    h = M.d
    f = M.f
    a = M.heads
    se = max(e, 4)
    kvh = M.kv * (M.d // M.heads)
    items = [
        ("norm inputs", 2 * h * e, False, True),
        ("norm outputs", 2 * h * e, False, True),
        ("q, k, v", (h + 2 * kvh) * e, True, True),
        ("attention output", h * e, True, True),
    ]
    if M.arch == "gpt":
        items += [("fc output, GeLU output", 2 * f * e, True, True)]
    # k, v of the kv heads only (GQA); RoPE's backward rotates the gradient back: it keeps none of
    # its
    else:
        # inputs (only the rotated q, k the attention saves); a fused SwiGLU keeps gate and up (silu
        # recomputed in its backward), the down projection its input silu(gate) x up: 3 of width f
        items += [("SwiGLU gate, up, product", 3 * f * e, True, True)]
    items += [("dropout masks", 2 * h, False, True)] * dropout
    items += [("norm statistics", (4 if M.arch == "gpt" else 2) * se, False, True)] * stats
    if attention == "flash":
        return items + [("logsumexp", a * se, True, False)]
    return items + [
        ("softmax", a * M.seq * (2 * e + dropout), True, False)
    ]  # + its mask, dropped output


def layer_bytes(M, lay, b, e, **kw):
    """One block, one micro-batch: the items x bs, / t where split by TP or SP; full: its input
    only. Under context parallelism s is the rank's s/cp, and the attention core keeps what its
    exchange adds (cp_extra). The layout's attention and dropout unless kw names them."""
    s, kw = M.seq // lay.cp, dict(dict(attention=lay.attention, dropout=lay.dropout), **kw)
    if lay.recompute == "full":
        return b * s * M.d * e // (lay.tp if lay.sp else 1)
    return cp_extra(M, lay, b, e) + sum(
        b * s * n // (lay.tp if split or lay.sp else 1)
        for _, n, split, keep in layer_items(M, e, **kw)
        if keep or lay.recompute == "none"
    )


def cp_extra(M, lay, b, e):
    """What one block's attention keeps beyond its s/cp tokens' own items (context_parallel.py):
    all-gather the other ranks' K and V and the (s/cp, s) causal mask (as the file's
    scaled_dot_product_attention saves it, e bytes each); Ulysses the heads' output beside the
    tokens' (b s/cp h/t); the ring nothing (its blocks pass through). Selective recomputation drops
    the core, and this with it."""
    s = M.seq // lay.cp
    t = lay.tp
    kvh = M.kv * (M.d // M.heads)
    if lay.cp == 1 or lay.recompute != "none":
        return 0
    return {
        "ring": 0,
        "ulysses": b * s * M.d // t,
        "allgather": 2 * b * (M.seq - s) * kvh // t + s * M.seq,
    }[lay.cp_attention] * e


def moe_extra(M, bs, e):
    return (M.experts * capacity(M, bs) * (2 * M.d + 2 * M.f) - bs * 2 * M.f) * e


def microbatch_bytes(M, lay, b, e, c):
    """What chunk c holds per micro-batch, by part: embedding (int64 token and position ids, the
    vocab-parallel mask), blocks, final norm and head input, loss (log-softmax or vocab-parallel
    softmax, int64 targets), and with lay.outputs its output, held until its backward (the last
    chunk's: the loss)."""
    # (for --search)
    return dict(_microbatch_bytes(M, replace(lay, dp=1, zero=0, m=1, ep=1), b, e, c))


@lru_cache(maxsize=None)
def _microbatch_bytes(M, lay, b, e, c):
    t = lay.tp
    n = lay.pp * lay.v
    bs = b * M.seq // lay.cp
    ce = max(e, 4)
    gpt = M.arch == "gpt"
    t_sp, vp = (t if lay.sp else 1), lay.vocab_parallel
    dense, moe = kinds(M, lay, c)
    out = dict(
        embedding=(8 * bs + bs * vp + 8 * M.seq // lay.cp // t_sp * gpt) * (c == 0),
        blocks=(dense + moe) * layer_bytes(M, lay, b, e),
        final=0,
        loss=0,
        out=(bs * M.d * e if c < n - 1 else ce) * lay.outputs,
    )
    # E C slots (dispatched input, fc and GeLU outputs, expert output)
    if moe and lay.recompute != "full":
        # for the MLP's 2f: not measured; full: the inputs only
        out["blocks"] += moe * moe_extra(M, bs, e)
    if c == n - 1:
        out["final"] = bs * (M.d * e + 2 * ce) // t_sp + bs * M.d * e // (t_sp if vp else 1)
        out["loss"] = (
            bs * (vocab_padded(M, lay) // t * ce + 10) if vp else bs * (M.vocab * ce + 8) + ce
        )
    return out


def pending_bytes(M, lay, b, e, c):
    """What a zero-bubble schedule keeps of chunk c's micro-batch from its B to its W (Qi et al.
    2023, Sec. 2): each linear's input x (a tensor its forward saved, kept alive) and output
    gradient dy, for W's dy^T x. Per token, a block's x: the two norm outputs (whole over TP), the
    attention output and the MLP's inner activation (/ t); dy: the column layers' outputs (/ t) and
    the two row layers' (whole); the head's x its input h, dy the logits' V (/ t when
    vocab-parallel). Experts' linears left out. (x bytes, dy bytes)."""
    h = M.d
    f = M.f
    t = lay.tp
    bs = b * M.seq // lay.cp
    kvh = M.kv * (M.d // M.heads)
    layers = sum(kinds(M, lay, c))
    last = c == lay.pp * lay.v - 1
    gpt = M.arch == "gpt"
    x = layers * (2 * h + (h + f) // t) + h * last
    dy = layers * ((h + 2 * kvh + (1 if gpt else 2) * f) // t + 2 * h)
    dy += (vocab_padded(M, lay) // t if lay.vocab_parallel else M.vocab) * last
    return x * bs * e, dy * bs * e


def spelled(ops):
    """Ops as the pictures write them, "F0 B1 W1", as (kind, local chunk) pairs."""
    return [(x[0], int(x[1:])) for x in ops.split()]


def zero_bubble_ops(p, m, r, schedule):
    """Rank r's ops in order, (kind, local chunk). ZB-H1 (Qi et al. Sec. 3.1): 1F1B's F and B, each
    B followed by the oldest W still to run, except rank r's first r B's: their W's end the step.
    ZB-V (Sec. 6, torch's ScheduleZBVZeroBubble; local chunk 0 is r, down the V, 1 is 2p-1-r, back
    up): 2(p-r)-1 F down; r times F up, F down; p-r times F, B, W up; then F down (while any
    remain), B, W down, F, B, W up until every F ran; then r times B down, B up; p-r times B down, W
    down; the W's left, up first. DualPipeV (DeepSeek-V3 Sec. 3.2.1, as deepseek-ai/DualPipe and
    torch's ScheduleDualPipeV order it; an F&B slot is its F, B, W in turn): 2(p-r-1) F down; r+1
    times F down, F up; p-r-1 times B up (its W held), the oldest W held, F up; m-2p+r+1 times F
    down, B and W up, F up, B and W down; p-r-1 times B and W up, F up, B and W down; r+1 times B
    up, B down, each W at once in the first half (B up's one more when r is even), else held;
    p-r-1 times the oldest W held, B down (its W held); the W's held, oldest first."""
    if schedule == "dualpipev":
        k = p - r - 1
        ops = spelled("F0") * 2 * k + spelled("F0 F1") * (r + 1) + spelled("B1 W1 F1") * k
        ops += spelled("F0 B1 W1 F1 B0 W0") * (m - 2 * p + r + 1) + spelled("B1 W1 F1 B0 W0") * k
        held = []
        for i in range(r + 1):  # the drain: from the middle on, W's held
            for c, now in ((1, i < (r + 1) // 2 + (r % 2 == 0)), (0, i < (r + 1) // 2)):
                ops.append(("B", c))
                (ops if now else held).append(("W", c))
        for _ in range(k):
            ops += [held.pop(0), ("B", 0)]
            held.append(("W", 0))
        return ops + held
    if schedule == "zb-h1":
        warm = min(p - r - 1, m)
        ones = spelled("F0") * warm + spelled("F0 B0") * (m - warm) + spelled("B0") * warm
        ops = []
        held = 0
        backwards = 0
        for op in ones:
            ops.append(op)
            if op[0] == "B":
                held, backwards = held + 1, backwards + 1
                if backwards > r:
                    ops.append(("W", 0))
                    held -= 1
        return ops + spelled("W0") * held
    ops = spelled("F0") * (2 * (p - r) - 1) + spelled("F1 F0") * r + spelled("F1 B1 W1") * (p - r)
    forwards = [2 * (p - r) - 1 + r, p]
    while forwards[1] < m:
        if forwards[0] < m:
            ops.append(("F", 0))
            forwards[0] += 1
        ops += spelled("B0 W0 F1 B1 W1")
        forwards[1] += 1
    ops += spelled("B0 B1") * r + spelled("B0 W0") * (p - r)
    for c in (1, 0):
        ops += [("W", c)] * (sum(o == ("B", c) for o in ops) - sum(o == ("W", c) for o in ops))
    return ops


def maximal(states):
    """The states no other state holds as much of, chunk by chunk (largest totals first: a state
    another holds as much of is held by one of the maximal ones kept before it)."""
    kept = []
    for x in sorted(set(states), key=sum, reverse=True):
        if not any(min(map(int.__sub__, y, x)) >= 0 for y in kept):
            kept.append(x)
    return frozenset(kept)


@lru_cache(maxsize=None)
def alive_patterns(p, v, m, r, schedule):
    """Rank r's micro-batch chunks alive after each op, as counts per local chunk (the maximal
    ones). GPipe: all m; 1F1B: p - r. Interleaved: Megatron's order walked, 2(p-r-1) + (v-1)p
    warm-up forwards, then forward k and backward k - warm-up in turn (forward on local chunk (k %
    pv) // p, backward on v-1 minus it); the order repeats every p micro-batches: 4p suffice. Zero
    bubble: their orders walked, and each count twice, (between F and B per local chunk, then
    between B and W): a micro-batch lives until its W, p on every ZB-H1 rank, not 1F1B's p - r."""
    if schedule in SPLIT_BACKWARD:
        full = [0] * v
        pend = [0] * v
        seen = set()
        for kind, c in zero_bubble_ops(p, m, r, schedule):
            full[c] += {"F": 1, "B": -1}.get(kind, 0)
            pend[c] += {"B": 1, "W": -1}.get(kind, 0)
            seen.add(tuple(full + pend))
        return maximal(seen)
    if v == 1 or schedule == "gpipe":
        return frozenset({(m if schedule == "gpipe" else min(p - r, m),)})
    m = min(m, 4 * p)
    warm = min(2 * (p - r - 1) + (v - 1) * p, v * m)
    alive = [0] * v
    seen = set()
    chunk = [(k % (p * v)) // p for k in range(v * m)]
    for k in range(v * m):
        alive[chunk[k]] += 1
        seen.add(tuple(alive))
        if k >= warm:
            alive[v - 1 - chunk[k - warm]] -= 1
    return maximal(seen)


def peak_activations(M, lay, b, e, r):
    """Most bytes rank r holds for backward at once: the largest sum of its alive chunks' bytes
    (zero bubble: and of what W needs); full recomputation adds one layer's whole set, rebuilt in
    its backward."""
    per = [sum(microbatch_bytes(M, lay, b, e, c).values()) for c in mine(lay, r)]
    if lay.schedule in SPLIT_BACKWARD:
        per += [sum(pending_bytes(M, lay, b, e, c)) for c in mine(lay, r)]
    peak = max(
        sum(map(int.__mul__, k, per)) for k in alive_patterns(lay.pp, lay.v, lay.m, r, lay.schedule)
    )
    if lay.recompute != "full":
        return peak
    moe = any(kinds(M, lay, c)[1] for c in mine(lay, r))  # the largest layer rebuilt
    rebuilt = layer_bytes(M, replace(lay, recompute="none"), b, e)
    return peak + rebuilt + (moe_extra(M, b * M.seq // lay.cp, e) if moe else 0)


@lru_cache(maxsize=None)
def memory(M, lay, B, r):
    """Bytes on pipeline rank r: parameters, gradients, optimizer state, activations, gathered
    (ZeRO-3)."""
    p, g, K, e = PRECISION[lay.precision]
    units = rank_units(M, lay, r)
    return dict(
        model_state(units, lay.shard, lay.zero, p, g, K),
        activations=peak_activations(M, lay, B // (lay.dp * lay.m), e, r),
        gathered=gathered(units, lay.shard, p, lay.precision == "fp8" and gemm_units(M, lay, r))
        if lay.zero == 3
        else 0,
    )


# ---------------------------------------------------------------------- bytes handed to collectives
WIRE = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: n - 1,
    "send": lambda n: 1,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}  # x bytes handed


def collectives(M, lay, B, r=0):
    """{"op/axis/phase": [calls, bytes handed, group size]} per step on pipeline rank r, as the
    docstring counts them; the bookkeeping each file does its own way (the loss for its log line,
    the clipping norm) is left out."""
    t = lay.tp
    d = lay.shard
    n = lay.pp * lay.v
    m = lay.m
    cp = lay.cp
    p, g, K, e = PRECISION[lay.precision]
    b, s = B // (lay.dp * m), M.seq // cp  # sequences per micro-batch, tokens of each on this rank
    bsh = b * s * M.d * e
    out = {}
    gpt = M.arch == "gpt"

    def add(key, calls, nbytes, size):
        if calls and size > 1:
            x = out.setdefault(key, [0, 0, size])
            x[0], x[1] = x[0] + calls, x[1] + calls * nbytes

    chunks_r = mine(lay, r)
    layers = sum(sum(kinds(M, lay, c)) for c in chunks_r)
    first = r == 0
    last = r == owner(lay, n - 1)
    emb = first and lay.vocab_parallel
    head = last and lay.vocab_parallel
    again = lay.recompute == "full"
    # all-gather before each column layer, reduce-scatter after each row layer; backward mirrors
    if lay.sp:
        k = 2 * layers
        add("all_gather/tp/fwd", m * (k + head), bsh // t, t)
        add("reduce_scatter/tp/fwd", m * (k + emb), bsh, t)
        add("reduce_scatter/tp/bwd", m * (k * (1 + again) + head), bsh, t)
        # + each column's re-gather
        add("all_gather/tp/bwd", m * (k * (2 + again) + emb + head), bsh // t, t)
        repl = sum(
            layer_params(M, moe)[1] * k
            for c in chunks_r
            for moe, k in zip((0, 1), kinds(M, lay, c))
        )
        # their gradients saw T/t positions
        repl += M.seq * M.d * (first and gpt) + M.d * (1 + gpt) * last
        add("all_reduce/tp/step", 1, e * repl, t)
    else:  # g forward, f backward, twice per layer; the vocab-parallel embedding's g and head's f
        add("all_reduce/tp/fwd", m * (2 * layers + emb), bsh, t)
        add("all_reduce/tp/bwd", m * (2 * layers * (1 + again) + head), bsh, t)
    # vocab-parallel loss: max, target, sum
    add("all_reduce/tp/fwd", 3 * m * head, b * s * max(e, 4), t)
    # an activation to chunk c+1, a gradient to chunk c-1, per micro-batch, off the rank
    for c in chunks_r:
        add("send/pp/fwd", m * (c < n - 1 and owner(lay, c + 1) != r), bsh, lay.pp)
        add("send/pp/bwd", m * (c > 0 and owner(lay, c - 1) != r), bsh, lay.pp)
    if M.experts:  # dispatch and combine, forward and backward: (E, C, h) slots each
        calls = 2 * m * sum(kinds(M, lay, c)[1] for c in chunks_r)
        add("all_to_all/ep/fwd", calls, M.experts * capacity(M, b * s) * M.d * e, lay.ep)
        add("all_to_all/ep/bwd", calls, M.experts * capacity(M, b * s) * M.d * e, lay.ep)
    # per layer and micro-batch (context_parallel.py); full recomputation runs the forward's again
    if cp > 1:
        kv, k = (
            2 * b * s * (M.kv * (M.d // M.heads)) // t * e,
            m * layers,
        )  # K and V of my tokens, stacked
        # each block on to the next rank; backward: blocks and dK/dV (fp32+)
        if lay.cp_attention == "ring":
            add("send/cp/fwd", k * (cp - 1), kv, cp)
            add("send/cp/bwd", k * (cp - 1) * (1 + again), kv, cp)
            add("send/cp/bwd", k * (cp - 1), kv // e * max(e, 4), cp)
        # my K, V to the gather; everyone's dK, dV to the scatter
        elif lay.cp_attention == "allgather":
            add("all_gather/cp/fwd", k, kv, cp)
            add("all_gather/cp/bwd", k * again, kv, cp)
            add("reduce_scatter/cp/bwd", k, kv * cp, cp)
        else:  # Ulysses: q, k, v to head-sharded, the output back; backward the same two
            qkv, o = b * s * (M.d + M.kv * (M.d // M.heads) * 2) // t * e, bsh // t
            for phase, calls in (("fwd", k), ("bwd", k * (1 + again))):
                add(f"all_to_all/cp/{phase}", calls, qkv, cp)
                add(f"all_to_all/cp/{phase}", calls, o, cp)
    units, z = rank_units(M, lay, r), lay.zero
    psi = padded(units, d) if z else sum(units)
    reduce = {0: "all_reduce/dp/step", 1: "reduce_scatter/dp/step"}.get(z, "reduce_scatter/dp/bwd")
    add(reduce, m if z > 1 else 1, g * psi, d)
    # its GEMM weights gathered as FP8
    fp8 = [x for u in gemm_units(M, lay, r) for x in u] if lay.precision == "fp8" else []
    add("all_gather/dp/step", z in (1, 2), p * psi // d, d)
    add("all_gather/dp/fwd", m * (z == 3), weight_gather(psi, fp8, d, p), d)
    add("all_gather/dp/bwd", m * (z == 3), weight_gather(psi, fp8, d, p, scales=False), d)
    # HSDP: each reduced shard then summed over the R replicas, as often as it is reduced
    add(
        reduce.replace("reduce_scatter/dp", "all_reduce/replicate"),
        m if z > 1 else 1,
        g * psi // d,
        lay.replicate,
    )
    return dict(sorted(out.items()))


def ptdp_4d_figures(M, lay, B, r):
    """ptdp.py's --json figures of pipeline rank r (figures.counts_per_rank, any dp, cp, tp
    coordinate) on its four axes, lay = Layout(pp, dp, cp, tp, v, m, zero 0 or 1,
    schedule="interleaved", precision="fp64", vocab_parallel=False, cp_attention="ring"), not
    ragged. Bytes handed per step, per axis: collectives()'s (its ring: K/V forward, K/V again and
    dK/dV backward, as ptdp's recomputing ring sends them), but the dp x cp gradients as ptdp.py
    flattens them, the rank's parameters in one vector padded to a multiple of dp x cp
    (collectives() pads each unit). Model state counted from ptdp's tensors: parameters; gradients
    (ZeRO-1: + the reduced shard); optimizer state, AdamW's two moments (ZeRO-1: of the shard, + the
    shard's own copy of its parameters, Megatron's main parameters). Saved for backward at the peak
    (act_peak) and with each chunk's output held to its B (held_peak): microbatch_bytes() of the
    alive patterns, less the log-sum-exp per block under CP (ptdp's ring saves q, k, v only and
    recomputes), plus the micro-batches' token ids and targets, views of one storage per step (cp 1:
    the global batch, (B, s+1) and (B, s); cp > 1: the replica's zig-zag copy, (m b, s/cp) each),
    counted whole however few micro-batches are alive."""
    p, g, K, e = PRECISION[lay.precision]
    d = lay.grad_group
    b = B // (lay.dp * lay.m)
    s = M.seq // lay.cp
    n = lay.pp * lay.v
    comm = collectives(M, lay, B, r)  # its dp keys left out: below, from ptdp's flat vector
    axis = {
        a: sum(x for key, (_, x, _) in comm.items() if f"/{a}/" in key) for a in ("tp", "cp", "pp")
    }
    N = sum(rank_units(M, lay, r))
    S = -(-N // d)  # elements per ZeRO-1 shard
    dp_bytes = (g * N if lay.zero == 0 else g * S * d + p * S) if d > 1 else 0
    state = dict(
        param_bytes=p * N,
        grad_bytes=g * N + g * S * (lay.zero > 0),
        optim_bytes=K * N if lay.zero == 0 else (K + p) * S,
    )
    mine_c = mine(lay, r)
    first, last = (mine_c.index(c) if c in mine_c else None for c in (0, n - 1))
    lse = ptdp_ring_unsaved(M, lay, b, e)

    def peak(held):
        per = [
            sum(microbatch_bytes(M, held, b, e, c).values()) - sum(kinds(M, lay, c)) * lse
            for c in mine_c
        ]

        # the storages behind the token ids (chunk 0) and targets (the last chunk), whole
        def batch(k):
            whole = (B * (M.seq + 1), B * M.seq) if lay.cp == 1 else (lay.m * b * s, lay.m * b * s)
            return sum(
                8 * (w - k[i] * b * s) for i, w in zip((first, last), whole) if i is not None
            )

        return max(
            sum(map(int.__mul__, k, per)) + batch(k)
            for k in alive_patterns(lay.pp, lay.v, lay.m, r, lay.schedule)
        )

    return dict(
        p2p_bytes=axis["pp"],
        tp_bytes=axis["tp"],
        cp_bytes=axis["cp"],
        dp_bytes=dp_bytes,
        world_bytes=16,
        act_peak=peak(replace(lay, outputs=False)),
        held_peak=peak(replace(lay, outputs=True)),
        **state,
    )


def ptdp_ring_unsaved(M, lay, b, e):
    """Per block and micro-batch, what ptdp.py's CP ring does not save of flash attention's set: the
    log-sum-exp (its backward recomputes the ring)."""
    return M.heads * max(e, 4) * b * (M.seq // lay.cp) // lay.tp * (lay.cp > 1)


def on_the_wire(key, calls, handed, n):
    return handed * WIRE[key.split("/")[0]](n)


def span(lay, axis):
    """GPUs from the first rank of one group of this axis to its last, in the grid
    arange(world).view(pp, dp, cp, tp)."""
    tc = lay.tp * lay.cp
    dp = tc * lay.dp
    return dict(
        tp=lay.tp, cp=tc, ep=tc * lay.ep, dp=dp // lay.replicate, replicate=dp, pp=lay.gpus
    )[axis]


def link(C, lay, axis):
    """'nvlink' when every group of this axis sits inside one node, else 'ib'."""
    return "nvlink" if span(lay, axis) <= C.gpus_per_node else "ib"


# s each step of a ring across nodes waits: NCCL's latency model, Ring / Simple on the network
# (src/graph/tuning.cc, hwLat). Its steps inside a node (at most 14 a collective, at 3.4 us) and its
# 8.4 us a call are left, like NVLink's achieved bandwidth, to the fitted ceiling.
ALPHA = 14e-6


def latency_s(C, lay, key, calls, units):
    """What NCCL's ring waits past the bytes across nodes, growing with them: ALPHA at each step
    from a node to the next, one a send, nodes - 1 a gather or scatter, twice that an all-reduce;
    ZeRO and DDP run theirs once a unit."""
    op, axis = key.split("/")[:2]
    nodes = span(lay, axis) // C.gpus_per_node
    steps = 1 if op == "send" else (nodes - 1) * (1 + (op == "all_reduce"))
    return calls * (units if axis in ("dp", "replicate") else 1) * steps * ALPHA * (nodes > 1)


# ----------------------------------------------------------------------------- bubble, FLOPs, time
def bubble_slots(lay, F=1.0, B=1.0, W=1.0):
    """Idle micro-batch times per step: GPipe, 1F1B p-1; interleaved (p-1)/v; ZB-H1 and ZB-V their
    orders walked at a chunk's F, B, W times; DualPipeV (p-1)/3, ZB-H1's (DeepSeek-V3 Table 2:
    (PP/2-1)(F&B+B-3W), 2(p-1) of a rank's 6m chunk ops at T_F = T_B = T_W, its F&B pair
    unoverlapped as this repo runs it)."""
    p = lay.pp
    if lay.schedule in ("zb-h1", "zb-v") and p > 1:
        return walked(p, lay.m, lay.schedule, F, B, W) / (lay.v * (F + B + W))
    slots = {
        "gpipe": p - 1,
        "1f1b": p - 1,
        "interleaved": (p - 1) / lay.v,
        "dualpipev": (p - 1) / 3,
    }
    return slots[lay.schedule] if p > 1 else 0


@lru_cache(maxsize=None)
def zero_bubble_graph(p, m, schedule):
    """ZB-H1's or ZB-V's ops (zero_bubble_ops) in the order a walk meets them, one order whatever
    the ops' times: (rank, kind, the index of the op it waits for or -1). An op runs when its
    rank's op before it ran and its input did: F after F on the chunk before, B after B on the
    chunk after, W after its B (on its rank, before it)."""
    n = p * (1 + (schedule == "zb-v"))
    ops = [zero_bubble_ops(p, m, r, schedule) for r in range(p)]
    index = {}  # (kind, chunk, micro-batch): its place in the order
    order = []
    at = [0] * p  # each rank's next op
    seen = [{} for _ in range(p)]  # each rank's ops met so far, per (kind, local chunk)
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while at[r] < len(ops[r]):
                kind, c = ops[r][at[r]]
                g = r if c == 0 else n - 1 - r  # down the V, then back up
                i = seen[r].get((kind, c), 0)  # the micro-batch
                need = {"F": ("F", g - 1, i), "B": ("B", g + 1, i)}.get(kind)
                if need and 0 <= need[1] < n and need not in index:
                    break
                index[kind, g, i] = len(order)
                order.append((r, kind, index.get(need, -1)))
                seen[r][kind, c] = i + 1
                at[r], moved = at[r] + 1, True
    return order


@lru_cache(maxsize=None)
def walked(p, m, schedule, F, B, W):
    """Idle time per step of ZB-H1's or ZB-V's order walked at these op times, messages free: each
    op starts when its rank is free and its input is done. ZB-V at T_F = T_B = T_W idles p-1 F's
    (the last rank's first F waits for them), not the paper's 0; where W is short (long sequences:
    attention's backward is all B) neither fills its gaps."""
    took = dict(F=F, B=B, W=W)
    free = [0.0] * p  # when each rank is free
    done = []  # when each op ends, in the graph's order
    for r, kind, need in zero_bubble_graph(p, m, schedule):
        free[r] = max(free[r], done[need] if need >= 0 else 0.0) + took[kind]
        done.append(free[r])
    return max(free) - m * (1 + (schedule == "zb-v")) * (F + B + W)


def bubble(lay):
    """(idle / step, idle / ideal compute): GPipe, 1F1B (p-1)/(m+p-1), (p-1)/m; interleaved
    ../(vm)."""
    k = bubble_slots(lay)
    return k / (lay.m + k), k / lay.m


def layer_flops(M, b, moe=False):
    """Forward FLOPs of one block on b sequences: 2 bs x its matmul weights + 4bs^2h (QK^T, AV); an
    MoE layer runs k cf slots per token through its experts, and the gate."""
    h, bs = M.d, b * M.seq
    mlp = (2 if M.arch == "gpt" else 3) * h * M.f
    attn = 2 * bs * (2 * h * h + 2 * h * M.kv * (h // M.heads)) + 4 * bs * M.seq * h
    return attn + 2 * bs * (mlp * M.capacity * M.top_k + h * M.experts if moe else mlp)


def chunk_flops(M, lay, b, c, recompute=None):
    """Training FLOPs one rank of chunk c runs per micro-batch: 3x forward, + the blocks' forward
    again under full recomputation or the attention core's (4bs^2h) under selective, / t; head 3 x
    2bshV (/ t when vocab-parallel: a replicated head runs whole on every TP rank)."""
    rc = lay.recompute if recompute is None else recompute
    core = 4 * b * M.seq**2 * M.d * (rc == "selective")
    blocks = sum(
        k * ((3 + (rc == "full")) * layer_flops(M, b, moe) + core)
        for moe, k in zip((False, True), kinds(M, lay, c))
    )
    head = 6 * b * M.seq * M.d * M.vocab * (c == lay.pp * lay.v - 1)
    # cp: s/cp queries
    return (blocks / lay.tp + head / (lay.tp if lay.vocab_parallel else 1)) / lay.cp


def gemm_s(C, eff, e, m, k, n, batch=1):
    """Seconds of `batch` products (m x k) @ (k x n): the FLOPs at eff of peak, plus the operands
    read and the result written once at memory speed (a roofline taken as a sum): a GEMM reaches eff
    / (1 + eff x peak / (HBM x its FLOPs per byte)) of peak, so small and thin ones (attention's per
    head, a micro-batch's against a wide weight) less than large square ones."""
    return batch * (
        2 * m * k * n / (eff * C.tflops * 1e12) + e * (m * k + k * n + m * n) / (C.hbm_gbs * GB)
    )


def block_s(M, C, lay, b, eff, moe=False, attention="flash", dropout=False):
    """(seconds, of which the attention core) of one block's forward on b sequences (s/cp tokens
    each) on one rank: each GEMM by gemm_s, the attention core per head (eager: QK^T and AV, its
    s/cp x s scores through HBM with a softmax, and dropout; flash: one pass, q, k, v, o read and
    written), and the memory-bound rest at HBM speed: two norms and two residual adds (read and
    write h; whole unless SP), the activation (GeLU 2f, SwiGLU 3f, / t)."""
    return _block_s(
        M,
        C,
        lay.tp,
        lay.sp,
        lay.cp,
        lay.ep,
        PRECISION[lay.precision][3],
        b,
        eff,
        moe,
        attention,
        dropout,
        C.fp8 if lay.precision == "fp8" else 1,
    )


# fp8: the GEMMs' peak x
@lru_cache(maxsize=None)
def _block_s(M, C, t, sp, cp, ep, e, b, eff, moe, attention, dropout, fp8=1):
    sq = M.seq // cp
    h = M.d
    f = M.f
    n = b * sq
    kvh = M.kv * (h // M.heads)
    tsp = t if sp else 1
    heads = b * M.heads // t
    mlp, gate = [(n, h, f // t * (1 if M.arch == "gpt" else 2)), (n, f // t, h)], 0
    if moe:  # this rank's E/ep experts, each on C ep slots; the gate
        slots, k = capacity(M, n) * ep, M.experts // ep
        mlp, gate = (
            [(slots, h, f // t, k), (slots, f // t, h, k)],
            gemm_s(C, eff, e, n, h, M.experts),
        )
    # FP8: gemm_units' GEMMs at its peak; attention, gate, head bf16
    G = C._replace(tflops=C.tflops * fp8)
    gemms = gate + sum(
        gemm_s(G, eff, e, *x) for x in [(n, h, (h + 2 * kvh) // t), (n, h // t, h), *mlp]
    )
    dh = h // M.heads
    if attention == "eager":
        core = gemm_s(C, eff, e, sq, dh, M.seq, heads) + gemm_s(C, eff, e, sq, M.seq, dh, heads)
        core += heads * sq * M.seq * (2 * e + (2 * e + 1) * dropout) / (C.hbm_gbs * GB)
    else:
        core = 4 * n * M.seq * h / t / (eff * C.tflops * 1e12) + e * n * (2 * h + 2 * kvh) / t / (
            C.hbm_gbs * GB
        )
    rest = n * e * (10 * h / tsp + f / t * (2 if M.arch == "gpt" else 3)) / (C.hbm_gbs * GB)
    return gemms + core + rest, core


def chunk_s(M, C, lay, b, c, eff, attention="flash", dropout=False):
    """(seconds, of which attention cores) one rank of chunk c computes per micro-batch: each
    block's forward (block_s) 3 times (a backward does twice a forward's work, both gradients of
    each product), 4 under full recomputation, + the core again under selective; the head 3 x (its
    GEMM + the softmax's read and write)."""
    rc = lay.recompute
    total = 0.0
    cores = 0.0
    for moe, k in zip((False, True), kinds(M, lay, c)):
        if k:
            fwd, core = block_s(M, C, lay, b, eff, moe, attention, dropout)
            total += k * ((3 + (rc == "full")) * fwd + core * (rc == "selective"))
            cores += k * (3 + (rc != "none")) * core
    if c == lay.pp * lay.v - 1:
        e, n = PRECISION[lay.precision][3], b * M.seq // lay.cp
        v = M.vocab // (lay.tp if lay.vocab_parallel else 1)
        total += 3 * (gemm_s(C, eff, e, n, M.d, v) + 2 * n * v * e / (C.hbm_gbs * GB))
    return total, cores


def exposed_s(comm_s, window_s, overlap):
    """Seconds of comm_s left on the critical path by an overlap: "full" hides it behind window_s
    (what is longer shows), "none" nothing, "partial" half of it; a number is the exposed share, as
    measured."""
    share = {"none": 1.0, "partial": 0.5, "full": None}.get(overlap, overlap)
    return max(0.0, comm_s - window_s) if share is None else comm_s * float(share)


def predict(
    M,
    C,
    lay,
    B,
    eff=EFFICIENCY,
    headroom=0.1,
    attention=None,
    dropout=None,
    overlap_dp=True,
    tp_overlap=None,
    dp_overlap=None,
):
    """Memory of the first and last pipeline rank (the most micro-batches; the head and loss; every
    rank under a hand-made cut), bytes per collective, bubble, and the predicted step, as the
    docstring composes it. The overlaps, stated (exposed_s): TP's exchanges (default: exposed, as
    Megatron-LM and torchtitan run them unless told; "full" only where the caller says), the ring's
    blocks behind attention, the gradients' reduction behind the backward (dp_overlap;
    overlap_dp=False: "none", as 2021's Megatron reduced after the flush). Attention and dropout:
    the layout's unless given. exposed: per axis, (seconds on its links per step, of which
    exposed)."""
    attention, dropout = attention or lay.attention, lay.dropout if dropout is None else dropout
    tp_overlap, dp_overlap = (
        tp_overlap or "none",
        dp_overlap or "full" * overlap_dp or "none",
    )
    # a hand-made cut: any rank the worst
    ranks = range(lay.pp) if lay.split else sorted({0, lay.pp - 1})
    b, n = B // (lay.dp * lay.m), lay.pp * lay.v
    mem, comm = (
        {r: memory(M, lay, B, r) for r in ranks},
        {r: collectives(M, lay, B, r) for r in ranks},
    )
    worst = max(ranks, key=lambda r: sum(mem[r].values()))
    bw = {"nvlink": C.intra_gbs * GB, "ib": C.inter_gbs * GB}
    units = {r: len(rank_units(M, lay, r)) for r in ranks}
    secs = {
        r: {
            k: on_the_wire(k, *x) / bw[link(C, lay, k.split("/")[1])]
            + latency_s(C, lay, k, x[0], units[r])
            for k, x in comm[r].items()
        }
        for r in ranks
    }
    work = {
        r: [
            sum(x)
            for x in zip(*(chunk_s(M, C, lay, b, c, eff, attention, dropout) for c in mine(lay, r)))
        ]
        for r in ranks
    }  # (s, of it attention) per mb

    # per micro-batch: (on the links, exposed on its critical path) of TP, CP, all-to-all
    def per_axis_mb(r):
        x = {
            a: sum(v for k, v in secs[r].items() if f"/{a}/" in k and "step" not in k) / lay.m
            for a in ("tp", "cp", "ep")
        }
        return dict(
            tp=(x["tp"], exposed_s(x["tp"], work[r][0], tp_overlap)),
            cp=(
                x["cp"],
                exposed_s(x["cp"], work[r][1], "full" if lay.cp_attention == "ring" else "none"),
            ),
            ep=(x["ep"], x["ep"]),
        )

    slow = max(ranks, key=lambda r: work[r][0] + sum(x for _, x in per_axis_mb(r).values()))
    axes = per_axis_mb(slow)
    compute, comm_mb = work[slow][0], sum(x for _, x in axes.values())
    per_mb = compute + comm_mb
    dp = {
        k: x
        for k, x in secs[slow].items()
        if k.endswith("step") or "/dp/" in k or "/replicate/" in k
    }
    gathers = sum(x for k, x in dp.items() if "all_gather" in k)
    reduce = sum(dp.values()) - gathers
    behind = 2 / 3 * compute  # one micro-batch's backward
    if lay.zero == 3:  # prefetched one unit ahead: hides behind each micro-batch
        exposed = lay.m * exposed_s((gathers + reduce) / lay.m, per_mb, dp_overlap)
    # each micro-batch's reduce-scatter behind its backward, the all-gather after
    elif lay.zero == 2:
        exposed = lay.m * exposed_s(reduce / lay.m, behind, dp_overlap) + gathers
    # the reduction behind the last micro-batch's backward (DDP's buckets); ZeRO-1's all-gather
    # after
    else:
        exposed = exposed_s(reduce, behind, dp_overlap) + gathers
    # a chunk's F, W and B: the forward; the weight gradients (the GEMMs' second product, no
    # attention); the rest of the backward (input gradients, all of attention's backward)
    k = 3 + (lay.recompute == "full")
    total, cores = work[slow]
    F = total / k
    W = (total - cores) / k
    fbw = F, total - F - W, W
    # one message's time: each TP rank sends 1/t of it across (Megatron's scatter/gather, SP's
    # shard)
    one = secs[0]["send/pp/fwd"] / comm[0]["send/pp/fwd"][0] / lay.tp if lay.pp > 1 else 0.0
    parts = dict(
        compute_s=compute * lay.m,
        tp_ep_s=comm_mb * lay.m,
        dp_s=exposed,
        bubble_s=per_mb * bubble_slots(lay, *fbw),
        pp_s=2 * (n - 1) * one,
    )
    model = chunk_flops(M, Layout(), B, 0, "none")
    hardware = chunk_flops(M, Layout(recompute=lay.recompute), B, 0)
    # the steady state's behind the compute
    pp = sum(x for k, x in secs[slow].items() if "/pp/" in k)
    axes = {a: (x * lay.m, e * lay.m) for a, (x, e) in axes.items()}
    axes.update(dp=(sum(dp.values()), exposed), pp=(pp, parts["pp_s"]))
    # one NIC a GPU: what the axes across nodes hide, together, past the compute shows (counted as
    # data-parallel)
    hidden = sum(x - e for a, (x, e) in axes.items() if link(C, lay, a) == "ib")
    parts["dp_s"] += max(0.0, hidden - parts["compute_s"])
    axes["dp"] = (axes["dp"][0], parts["dp_s"])
    step = sum(parts.values())
    return dict(
        parts,
        layout=lay,
        memory=mem,
        worst=worst,
        comm=comm[0],
        secs=secs[0],
        bubble=bubble(lay),
        step_s=step,
        fits=sum(mem[worst].values()) <= C.mem_gb * GB * (1 - headroom),
        over=sum(mem[worst].values()) - C.mem_gb * GB * (1 - headroom),
        model_flops=model,
        tokens_per_s=B * M.seq / step,
        mfu=model / (step * lay.gpus * C.tflops * 1e12),
        hfu=hardware / (step * lay.gpus * C.tflops * 1e12),
        exposed={a: x for a, x in axes.items() if x[0]},
        overlaps=dict(tp=tp_overlap, dp=dp_overlap),
    )


# ----------------------------------------------------------------------------- the search
def legal(M, C, lay, B):
    """Why this layout cannot run this model and batch on this cluster, or None."""
    # the V's micro-batches: ZB-V's warm-up, DualPipeV's warm-up and first pairs
    least = "2p-1" if lay.schedule == "zb-v" else "2p"
    fewest = 2 * lay.pp - (lay.schedule == "zb-v")
    for ok, why in [
        (
            lay.gpus <= C.nodes * C.gpus_per_node,
            f"dp x cp x tp x pp = {lay.gpus} GPUs, the cluster has {C.nodes * C.gpus_per_node}",
        ),
        (
            M.heads % lay.tp == M.kv % lay.tp == M.f % lay.tp == 0,
            f"--n-heads {M.heads}, kv heads {M.kv} or MLP width {M.f} not divisible by --tp "
            f"{lay.tp}",
        ),
        (
            not lay.sp or lay.tp > 1 and M.seq // lay.cp % lay.tp == 0,
            "--sequence-parallel needs --tp > 1 dividing --seq-len / --cp",
        ),
        (
            lay.cp == 1 or M.seq % (2 * lay.cp) == 0,
            f"--seq-len {M.seq} is not divisible by 2 x --cp = {2 * lay.cp} (zig-zag: 2cp chunks)",
        ),
        (
            lay.cp == 1
            or lay.cp_attention != "ulysses"
            or M.heads % (lay.tp * lay.cp) == 0
            and M.kv % (lay.tp * lay.cp) == 0,
            f"--cp-attention ulysses gives each of tp x cp = {lay.tp * lay.cp} ranks whole heads: "
            f"--n-heads {M.heads} and kv heads {M.kv} must divide by it",
        ),
        (
            lay.split
            or lay.pp * lay.v <= M.layers
            and (lay.schedule != "interleaved" or M.layers % (lay.pp * lay.v) == 0),
            f"--n-layers {M.layers} does not split into pp x virtual stages = {lay.pp * lay.v} "
            "chunks (of a "
            f"block at least; equal ones when interleaved, unless --stage-layers cuts them)",
        ),
        (
            not lay.split
            or len(lay.split) == lay.pp * lay.v
            and sum(lay.split) == M.layers
            and min(lay.split[1:-1], default=1)
            >= 1,  # the ends may hold the embedding, the head alone
            f"--stage-layers {','.join(map(str, lay.split))}: pp x virtual stages = "
            f"{lay.pp * lay.v} numbers summing to --n-layers {M.layers}, >= 1 but for the first "
            "and last (0: the embedding, the head and loss alone)",
        ),
        (
            B % (lay.dp * lay.m) == 0,
            f"--batch-size {B} is not divisible by dp x microbatches = {lay.dp} x {lay.m}",
        ),
        (
            lay.schedule != "interleaved" or lay.pp > 1 and lay.m % lay.pp == 0,
            "interleaving needs --pp > 1 dividing --microbatches",
        ),
        (
            lay.v == {"interleaved": max(lay.v, 2), "zb-v": 2, "dualpipev": 2}.get(lay.schedule, 1),
            f"--schedule {lay.schedule} with --virtual-stages {lay.v}: interleaved needs v > 1, "
            "zb-v and dualpipev 2, the others 1",
        ),
        (
            lay.schedule not in V_SHAPED or lay.pp > 1 and lay.m >= fewest,
            f"--schedule {lay.schedule} needs --pp > 1 and --microbatches >= {least} = {fewest}, "
            f"got {lay.m}",
        ),
        (
            lay.ep == 1 or M.experts % lay.ep == lay.dp % lay.ep == 0,
            f"--ep {lay.ep} must divide the experts and dp",
        ),
        (lay.zero in (0, 1, 2, 3), f"--stage must be 0, 1, 2 or 3, got {lay.zero}"),
        (
            lay.replicate == 1 or lay.zero and lay.grad_group % lay.replicate == 0,
            f"--replicate {lay.replicate} (HSDP) needs --stage 1, 2 or 3 and must divide dp x cp = "
            f"{lay.grad_group}",
        ),
        (lay.precision != "fp8" or C.fp8, NO_FP8),
    ]:
        if not ok:
            return why
    return None


CP_FROM = 32768  # tokens per sequence from which --search also shares each sequence over cp ranks


def layouts(M, C, B, precision="bf16"):
    """Every legal layout on all the cluster's GPUs: tp dividing a node, every pp up to L (the
    files' cut when it does not divide L), from CP_FROM tokens every cp of 2^k (the ring, zig-zag),
    b in 1, 2, 4, 8, each schedule and every v (interleaved: each v > 1 cutting L into equal chunks,
    as Megatron asks, and where none does, Llama 3's cut: L + 2 in equal chunks, the first and last
    one block short; ZB-V 2), ZeRO stage, SP, recomputation (GPipe left out: 1F1B's time, more
    memory)."""
    gpus = C.nodes * C.gpus_per_node
    cps = [2**k for k in range(gpus.bit_length()) if M.seq >= CP_FROM or k == 0]
    for tp, pp, cp in [
        (t, p, c)
        for t in range(1, C.gpus_per_node + 1)
        for p in range(1, M.layers + 1)
        for c in cps
        if C.gpus_per_node % t == 0 and gpus % (t * p * c) == 0
    ]:
        dp = gpus // (tp * pp * cp)
        even = [
            ("interleaved", v, ()) for v in range(2, M.layers // pp + 1) if M.layers % (pp * v) == 0
        ]
        # where none is, Llama 3's cut (Dubey et al. 2024, Sec. 3.3.2): k blocks a chunk, k - 1 at
        # the ends
        llama3 = [
            ("interleaved", v, (k - 1,) + (k,) * (pp * v - 2) + (k - 1,))
            for v in range(2, (M.layers + 2) // pp + 1)
            for k in [(M.layers + 2) // (pp * v)]
            if (M.layers + 2) % (pp * v) == 0
        ]
        scheds = [("1f1b", 1, ()), ("zb-h1", 1, ()), ("zb-v", 2, ())] + (even or llama3)
        scheds = scheds if pp > 1 else [("1f1b", 1, ())]
        eps = [k for k in range(1, dp + 1) if k == 1 or M.experts and dp % k == 0]
        bs = [b for b in (1, 2, 4, 8) if B % (dp * b) == 0]
        for b, (sched, v, cut), ep, zero, sp, rc in [
            (b, s, ep, z, sp, rc)
            for b in bs
            for s in scheds
            for ep in eps
            for z in range(4)
            for sp in (0, 1)
            for rc in ("none", "selective", "full")
        ]:
            lay = Layout(
                dp,
                tp,
                pp,
                v,
                ep,
                zero,
                B // (dp * b),
                bool(sp),
                rc,
                precision,
                sched,
                split=cut,
                cp=cp,
            )
            if legal(M, C, lay, B) is None:
                yield lay


def search(
    M,
    C,
    B,
    eff=EFFICIENCY,
    headroom=0.1,
    precision="bf16",
    keep=lambda lay: True,
    attention="flash",
    dropout=False,
    **overlaps,
):
    """The fastest layout that fits, of each grid (dp, cp, tp, pp, ep), ranked by predicted
    tokens/s; with the counts of legal and fitting layouts. `keep` limits the options (a paper's,
    say); attention, dropout and overlaps (tp_overlap, dp_overlap) as the stack's."""
    best = {}
    n_legal = 0
    n_fit = 0
    stack = (attention, dropout) != ("flash", False)
    for lay in filter(
        keep,
        (
            replace(x, attention=attention, dropout=dropout) if stack else x
            for x in layouts(M, C, B, precision)
        ),
    ):
        n_legal += 1
        # a hand-made cut: any rank may be the worst
        ranks = range(lay.pp) if lay.split else {0, lay.pp - 1}
        if max(sum(memory(M, lay, B, r).values()) for r in ranks) > C.mem_gb * GB * (1 - headroom):
            continue
        n_fit, key = n_fit + 1, (lay.dp, lay.cp, lay.tp, lay.pp, lay.ep)
        got = predict(M, C, lay, B, eff, headroom, **overlaps)
        if key not in best or got["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = got
    return sorted(best.values(), key=lambda x: -x["tokens_per_s"]), n_legal, n_fit


PARTS = dict(
    compute_s="compute",
    tp_ep_s="TP, CP and all-to-all",
    bubble_s="bubble",
    dp_s="exposed data-parallel",
    pp_s="pipeline messages",
)


def why_faster(a, b):
    """One line: where the predicted step of a is shorter than b's, and where longer, part by
    part."""
    d = sorted(((b[k] - a[k]) * 1e3, w) for k, w in PARTS.items() if abs(b[k] - a[k]) >= 5e-4)
    less = ", ".join(f"{w} {x:,.0f} ms" for x, w in d[::-1] if x > 0) or "nothing"
    more = ", ".join(f"{w} {-x:,.0f} ms" for x, w in d if x < 0)
    return (
        f"{a['tokens_per_s'] / b['tokens_per_s']:.3f}x the tokens/s of {b['layout']}: its step "
        f"spends less on {less}" + (f"; more on {more}" if more else "")
    )


# ----------------------------------------------------------------------------- the whole run
# Hoffmann et al. 2022 (Chinchilla), Approach 3: the final loss L(N, D) = E + A / N^alpha + B /
# D^beta of N parameters trained on D tokens, compute C = 6ND. Constants: Besiroglu et al. 2024's
# refit of the paper's own points; the paper's Eq. 10 (HOFFMANN) gives compute-optimal models 2-3x
# smaller than its Approaches 1 and 2 and its Table 3, which the refit matches within 15% up to 1T
# parameters (tests/test_plan.py checks it).
CHINCHILLA = dict(E=1.82, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
HOFFMANN = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
# Llama 3 (Dubey et al. 2024, Sec. 3.2.1): the compute-optimal TOKENS D*(C) = A C^alpha, fitted on
# IsoFLOP minima of 6e18 to 1e22 FLOPs; N = C / 6D. Figure 3's legend; the text rounds it to (0.53,
# 0.29), which gives 10.5T tokens at 3.8e25 FLOPs, not the text's 16.55T (a 0.007 in alpha is
# 10^(0.007 x 25.6) = 1.5x): the legend's give 16.3T and 389B, and the text's 402B x 16.55T is 6ND =
# 3.99e25 (tests/test_plan.py).
LAWS = {"chinchilla": CHINCHILLA, "llama3": dict(A=0.299, alpha=0.537)}


def compute_optimal(C, law=CHINCHILLA, ratio=0):
    """(N, D) at 6ND = C. Chinchilla: minimising L(N, D), N = G (C/6)^(beta/(alpha+beta)), G =
    (alpha A / (beta B))^(1/(alpha+beta)) (Hoffmann et al. Eq. 4); Llama 3: D = A C^alpha; `ratio`
    R: D = R N."""
    a, b = law["alpha"], law.get("beta")
    if ratio or not b:
        N = math.sqrt(C / (6 * ratio)) if ratio else C / (6 * law["A"] * C**a)
    else:
        N = (a * law["A"] / (b * law["B"])) ** (1 / (a + b)) * (C / 6) ** (b / (a + b))
    return N, C / (6 * N)


def final_loss(N, D, law=CHINCHILLA):
    return law["E"] + law["A"] / N ** law["alpha"] + law["B"] / D ** law["beta"]


def n_params(M):
    return sum(rank_units(M, Layout(), 0))


def shaped(P, N):
    """A model of about N parameters in preset P's proportions: its head width, MLP width / h, depth
    / h, vocabulary, sequence and kv heads; heads a multiple of 8 (so every tp up to 8 divides
    them)."""
    hd, best = P.d // P.heads, None
    for heads in range(8, 100000, 8):
        d = heads * hd
        kv = math.gcd(P.kv_heads, heads) if P.kv_heads else 0
        ffn = -(-round(P.f / P.d * d) // 256) * 256 if P.ffn else 0
        M = P._replace(
            layers=max(1, round(P.layers / P.d * d)), d=d, heads=heads, kv_heads=kv, ffn=ffn
        )
        n = n_params(M)
        if best is None or abs(math.log(n / N)) < abs(math.log(best[0] / N)):
            best = (n, M)
        if n > 2 * N:
            return best[1]


def with_failures(work_s, gpus, rate, write_s, restart_s, interval_s=0.0):
    """Wall time of work_s seconds of training on `gpus` GPUs that each fail at `rate` per GPU-hour
    (the job stops at the first: mean time between failures M = 3600 / (rate x gpus) s). A
    checkpoint every tau s (0: Young 1974 / Daly 2006's optimum sqrt(2 delta M)) costs delta =
    write_s; each failure a restart R and, on average, half an interval of work: wall = work (1 +
    delta/tau) / (1 - (tau/2 + R) / M), to first order. (wall s, tau s, expected failures); wall inf
    when failures come faster than the run recovers."""
    if rate == 0:
        return work_s, interval_s, 0.0
    mtbf = 3600 / (rate * gpus)
    tau = interval_s or math.sqrt(2 * write_s * mtbf)
    lost = (tau / 2 + restart_s) / mtbf
    wall = work_s * (1 + write_s / tau) / (1 - lost) if lost < 1 else math.inf
    return wall, tau, wall / mtbf


def work_in(wall_s, gpus, rate, write_s, restart_s, interval_s=0.0):
    """The training seconds a wall time holds, failures and checkpoints taken out: with_failures
    inverted."""
    wall, tau, _ = with_failures(1.0, gpus, rate, write_s, restart_s, interval_s)
    return wall_s / wall


# ------------------------------------------------------------------------- DiLoCo across slow links
def diloco(M, C, got, H, outer_bytes=4, fragments=1, overlap=0):
    """DiLoCo (Douillard et al. 2023) beside DDP for the layout of `got`, its data-parallel group
    across the slow link: every H inner steps one all-reduce of the pseudo-gradient (outer_bytes per
    parameter), where DDP all-reduces g bytes per parameter every step. Streaming DiLoCo (Douillard
    et al. 2025): F fragments, each synced once per H steps, staggered, its exchange overlapped with
    `overlap` inner steps. Per inner step: bytes handed, bytes on the wire (ring: 2(d-1)/d), and the
    exposed communication time; DDP's exposed time is what predict found beyond the backward.
    Theory: diloco.py measures its own bytes."""
    lay, d = got["layout"], got["layout"].dp
    g, psi = (
        PRECISION[lay.precision][1],
        sum(rank_units(M, lay, 0)),
    )  # pipeline rank 0's parameters (its 1/t)
    bw = (C.intra_gbs if link(C, lay, "dp") == "nvlink" else C.inter_gbs) * GB
    wire = WIRE["all_reduce"](d) * psi * outer_bytes
    per_sync = wire / fragments / bw  # one fragment's all-reduce, seconds
    exposed = fragments * max(0.0, per_sync - overlap * got["step_s"]) / H
    return dict(
        bytes=psi * outer_bytes / H,
        wire=wire / H,
        exposed_s=exposed,
        ddp_bytes=psi * g,
        ddp_wire=WIRE["all_reduce"](d) * psi * g,
        ddp_exposed_s=got["dp_s"],
        step_s=got["step_s"] - got["dp_s"] + exposed,
    )


# ----------------------------------------------------------------------------- report
def band(error, got=None):
    """The band beside an MFU (its stack's jackknife band, points of peak); with got, beside
    its step: the steps at that MFU less and more the band."""
    if error is None:
        return " (no band: see the stack line)"
    if got is None:
        return f" +- {error:.1f} points"
    mfu = 100 * got["mfu"]
    slow = got["step_s"] * mfu / (mfu - error) if mfu > error else math.inf
    return f" ({got['step_s'] * mfu / (mfu + error):.3f} to {slow:.3f} s at MFU{band(error)})"


def report(C, B, got, error=None):
    lay = got["layout"]
    mem = got["memory"]
    print(f"layout: {lay}, {lay.precision}, {B // (lay.dp * lay.m)} sequences per micro-batch")
    print("memory per rank, GB    params    grads    optim  activations  gathered     total")
    for r, x in [(r, x) for r, x in mem.items() if r in (0, got["worst"], lay.pp - 1)]:
        print(
            f"  pipeline rank {r:<5d}"
            + "".join(f"{x[k] / GB:9.2f}" for k in ("params", "grads", "optim"))
            + f"{x['activations'] / GB:13.2f}{x['gathered'] / GB:10.2f}{sum(x.values()) / GB:10.2f}"
        )
    print(f"  {'fits' if got['fits'] else 'does NOT fit'} in {C.mem_gb:g} GB less the headroom")
    if not got["fits"]:  # the term to cut: the worst rank's largest
        w = got["worst"]
        top = max(mem[w], key=mem[w].get)
        alive = max(map(sum, alive_patterns(lay.pp, lay.v, lay.m, w, lay.schedule)))
        print(
            f"  over by {got['over'] / GB:.1f} GB: the largest term is {top} of pipeline rank {w} "
            f"({mem[w][top] / GB:.1f} GB"
            + f", {alive} chunk-micro-batches alive at once)" * (top == "activations")
            + ")" * (top != "activations")
        )
    # ms: the bytes at the link's speed and NCCL's latency across nodes
    print("bytes per step, pipeline rank 0     calls  handed GB  on the wire GB  link       ms")
    for k, (calls, handed, n) in got["comm"].items():
        wire, where = on_the_wire(k, calls, handed, n), link(C, lay, k.split("/")[1])
        print(
            f"  {k:30s} {calls:7d} {handed / GB:10.3f} {wire / GB:15.3f}  {where:6s} "
            f"{got['secs'][k] * 1e3:8.1f}"
        )
    print(f"bubble: {got['bubble'][0]:.3f} of the step, {got['bubble'][1]:.3f} of ideal compute")
    print(
        f"predicted step {got['step_s']:.3f} s{band(error, got)} = "
        + " + ".join(f"{w} {got[k]:.3f}" for k, w in PARTS.items())
    )
    how = dict(
        tp=f"--tp-overlap {got['overlaps']['tp']}",
        dp=f"--dp-overlap {got['overlaps']['dp']}",
        pp="warm-up and drain messages",
        ep="none hidden",
        cp="behind attention" if lay.cp_attention == "ring" else "none hidden",
    )
    print(
        "communication per step, s on its links / exposed (the overlap assumed): "
        + ", ".join(f"{a} {x:.3f} / {e:.3f} ({how[a]})" for a, (x, e) in got["exposed"].items())
    )
    print(
        f"predicted {got['tokens_per_s']:,.0f} tokens/s, MFU {got['mfu']:.1%}{band(error)} (model "
        f"FLOPs {got['model_flops']:.3e} / the bf16 peak), HFU {got['hfu']:.1%} (with "
        "recomputation, as PTD-P counts)"
    )


# ----------------------------------------------------------------------------- main
@dataclass
class Args:
    # a preset shape (the model flags below override it)
    model: Literal[tuple(PRESETS)] = "gpt3-6.7b"
    n_layers: int = 0  # transformer blocks L (0: the preset's, as for every model flag)
    d_model: int = 0  # width h
    n_heads: int = 0  # attention heads a
    kv_heads: int = 0  # key/value heads (grouped-query attention)
    vocab: int = 0  # vocabulary V
    seq_len: int = 0  # tokens per sequence s
    ffn: int = 0  # MLP width
    experts: int = 0  # MoE: experts per MoE layer
    top_k: int = 1  # MoE: experts per token
    capacity_factor: float = 1.25  # MoE: slots per expert = cf x k x tokens / experts
    moe_every: int = 1  # MoE: an MoE layer every n-th block
    batch_size: int = 512  # global batch, in sequences
    # per-GPU figures (the cluster flags below override them)
    cluster: Literal[tuple(CLUSTERS)] = "h100-80g"
    nodes: int = 1  # nodes
    gpus_per_node: int = 0  # GPUs per node (0: the preset's, as for every cluster flag)
    gpu_mem_gb: float = 0  # memory per GPU, GB
    tflops: float = 0  # peak dense bf16 TFLOP/s per GPU
    intra_gbs: float = 0  # GB/s per GPU and direction inside a node
    inter_gbs: float = 0  # GB/s per GPU and direction across nodes
    hbm_gbs: float = 0  # GB/s of each GPU's memory (memory-bound work, each GEMM's operands)
    # the GEMMs' ceiling share of peak (0: the stack's, fitted on its published rows)
    efficiency: float = 0
    # a published stack: the next 4 flags' defaults, a ceiling
    stack: Literal[tuple(STACKS)] = "2024"
    # eager: the s x s scores (2021's); "": the stack's
    attention: Literal["", "eager", "flash"] = ""
    dropout: bool = None  # dropout after attention and MLP (--no-dropout: off); unset: the stack's
    # TP's exchanges behind the GEMMs: none, partial, full, or the exposed share
    tp_overlap: str = ""
    # gradients' reduction behind the backward: none (after the flush) ... as above
    dp_overlap: str = ""
    # share of GPU memory kept free for what is not counted (workspace, fragmentation)
    headroom: float = 0.1
    dp: int = 0  # data-parallel degree d (0: GPUs / (tp x pp))
    tp: int = 1  # tensor-parallel degree t
    cp: int = 1  # context-parallel degree: ranks sharing each sequence (context_parallel.py)
    # how they exchange keys and values
    cp_attention: Literal["ring", "allgather", "ulysses"] = "ring"
    pp: int = 1  # pipeline stages p
    virtual_stages: int = 1  # model chunks per pipeline rank v
    ep: int = 1  # expert-parallel degree, inside dp
    stage: int = 0  # ZeRO stage over the data-parallel group
    replicate: int = 1  # HSDP: R copies, each ZeRO-sharded over dp x cp / R ranks (a node, say)
    microbatches: int = 1  # m per step and replica
    sequence_parallel: bool = False  # split norm and dropout regions along the sequence (--tp > 1)
    recompute: Literal["none", "selective", "full"] = "none"  # activation recomputation
    # bf16: mixed-precision Adam, 2 + 2 + 12 bytes; fp8: as bf16, the blocks' GEMMs at the FP8 peak,
    # ZeRO-3 gathering their weights in FP8 + scales
    precision: Literal["bf16", "fp32", "fp64", "fp8"] = "bf16"
    # pipeline schedule
    schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v", "dualpipev"] = "1f1b"
    # split embedding and head over the vocabulary (else replicated over tp)
    vocab_parallel: bool = True
    # blocks per chunk in pipeline order, e.g. 7,8,...,8,7 or 0,9,...,9,0 (fewer on the first and
    # last; 0: a chunk of the embedding or the head and loss alone, as Llama 3's)
    stage_layers: str = ""
    search: bool = False  # rank every legal layout that fits by predicted tokens/s
    top: int = 10  # layouts --search prints
    tokens: float = 0  # the whole run: train on this many tokens (wall time, GPU-hours, cost)
    # a budget in GPU-hours: the compute-optimal model and tokens for it (--law)
    gpu_hours: float = 0
    days: float = 0  # a budget in days on this cluster, failures and checkpoints included
    flops: float = 0  # a budget in training FLOPs, C = 6ND
    # a budget's N and D: Chinchilla's Approach 3 or Llama 3's fit of the optimal tokens (D = 0.299
    # C^0.537: more tokens per parameter as C grows)
    law: Literal["chinchilla", "llama3"] = "chinchilla"
    # a budget's N and D at D = R N in place of --law (Llama 3 405B: 38.5)
    tokens_per_param: float = None
    usd_per_gpu_hour: float = 0  # price per GPU-hour, for the cost
    # interruptions per GPU-hour (Llama 3: 419 in 54 days on 16384: 2e-5)
    failures_per_gpu_hour: float = 0
    ckpt_minutes: float = 0  # checkpoint interval (0: Young/Daly's optimum for the failure rate)
    ckpt_write_s: float = 30  # seconds each checkpoint stops training
    # minutes from a failure to training again (detect, replace, reload)
    restart_minutes: float = 10
    # DiLoCo beside DDP: H inner steps per outer sync (0: off), dp across --inter-gbs
    inner_steps: int = 0
    fragments: int = 1  # Streaming DiLoCo: fragments synced in turn
    overlap: int = 0  # Streaming DiLoCo: inner steps each fragment's exchange overlaps
    # DiLoCo: the pseudo-gradient's type on the wire
    outer_dtype: Literal["float32", "bfloat16"] = "float32"


def check_args(a):
    """Every flag: numbers finite and in range; one budget at most; MoE flags that fit together."""
    for name, x in vars(a).items():
        if isinstance(x, float) and not math.isfinite(x):
            fail(f"--{name.replace('_', '-')} must be a finite number, got {x}")
    ones = (
        "batch_size nodes tp cp pp virtual_stages ep replicate microbatches top top_k moe_every "
        "fragments"
    ).split()
    zeros = (
        "n_layers d_model n_heads kv_heads vocab seq_len ffn experts dp gpus_per_node gpu_mem_gb "
        "tflops intra_gbs inter_gbs hbm_gbs stage tokens gpu_hours days flops usd_per_gpu_hour "
        "failures_per_gpu_hour ckpt_minutes ckpt_write_s restart_minutes inner_steps overlap"
    ).split()
    for name, low in [(n, 1) for n in ones] + [(n, 0) for n in zeros]:
        if getattr(a, name) < low:
            fail(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(a, name)}")
    if not 0 <= a.efficiency <= 1 or not 0 <= a.headroom < 1:
        fail(
            "--efficiency must be in (0, 1] (0: the stack's) and --headroom in [0, 1), got "
            f"{a.efficiency}, {a.headroom}"
        )
    for name in ("tp_overlap", "dp_overlap"):
        x = getattr(a, name)
        if x not in ("", "none", "partial", "full") and not (
            re.fullmatch(r"[0-9.]+", x) and x.count(".") < 2 and 0 <= float(x) <= 1
        ):
            fail(
                f"--{name.replace('_', '-')} must be none, partial, full or an exposed share in "
                f"[0, 1], got {x!r}"
            )
    if not a.capacity_factor > 0:
        fail(f"--capacity-factor must be > 0 (slots: cf x k x tokens / E), got {a.capacity_factor}")
    if a.experts and a.top_k > a.experts:
        fail(f"--top-k {a.top_k} must be at most --experts {a.experts}")
    if a.stage_layers and not re.fullmatch(r"\d+(,\d+)*", a.stage_layers):
        fail(f"--stage-layers must be numbers separated by commas, got {a.stage_layers!r}")
    budget = [f"--{n.replace('_', '-')}" for n in ("gpu_hours", "days", "flops") if getattr(a, n)]
    if len(budget) + (a.tokens > 0) > 1:
        given = budget + ["--tokens"] * (a.tokens > 0)
        fail(f"give one of --tokens, --gpu-hours, --days, --flops, got {', '.join(given)}")
    R = a.tokens_per_param
    if R is not None and (R <= 0 or not budget or a.law != "chinchilla"):
        why = (
            "must be > 0"
            if R <= 0
            else "sets a budget's D = R N, but --tokens gives D"
            if a.tokens
            else "needs a budget: --gpu-hours, --days or --flops"
            if not budget
            else "replaces --law llama3"
        )
        fail(f"--tokens-per-param {why}, got {R:g}")
    if a.law != "chinchilla" and not budget:
        fail(f"--law {a.law} splits a budget into N and D: give --gpu-hours, --days or --flops")


def run_report(M, C, got, D, a, optimal=None):
    """The whole run at the chosen layout: training D tokens, its checkpoints and failures,
    GPU-hours, cost, the fitted law's final loss (and the compute-optimal N, D the budget asked
    for)."""
    gpus, work = got["layout"].gpus, D / got["tokens_per_s"]
    wall, tau, fails = with_failures(
        work,
        gpus,
        a.failures_per_gpu_hour,
        a.ckpt_write_s,
        60 * a.restart_minutes,
        60 * a.ckpt_minutes,
    )
    N = n_params(M)
    day = 86400
    law = ", ".join(f"{k} {x:g}" for k, x in LAWS[a.law].items())
    law = (
        f"D = {a.tokens_per_param:g} N"
        if a.tokens_per_param
        else (
            f"Chinchilla Approach 3, L = E + A/N^alpha + B/D^beta, {law}"
            if a.law == "chinchilla"
            else f"Llama 3's fit, D = A C^alpha, {law}"
        )
    )
    print("the whole run (theory):")
    if optimal:
        print(
            f"  compute-optimal for C = {optimal[0]:.3e} FLOPs ({law}): N "
            f"{optimal[1] / 1e9:,.1f}B, D {optimal[2] / 1e9:,.0f}B tokens"
        )
    print(
        f"  model {N / 1e9:,.2f}B parameters: L {M.layers} h {M.d} a {M.heads} kv {M.kv} ffn {M.f} "
        f"V {M.vocab} s {M.seq}; {D / 1e9:,.0f}B tokens ({D / N:.1f} per parameter), 6ND = "
        f"{6 * N * D:.3e} FLOPs"
    )
    print(f"  layout {got['layout']}: {got['tokens_per_s']:,.0f} tokens/s, MFU {got['mfu']:.1%}")
    lost = (
        f", {fails:,.1f} failures expected, a checkpoint every {tau / 60:,.1f} min" if fails else ""
    )
    print(
        f"  wall time {wall / day:,.2f} days (training {work / day:,.2f}{lost}); "
        f"{gpus * wall / 3600:,.0f} GPU-hours"
        + (f", ${a.usd_per_gpu_hour * gpus * wall / 3600:,.0f}" if a.usd_per_gpu_hour else "")
    )
    print(
        f"  predicted final loss {final_loss(N, D):.3f} nats/token (Chinchilla's fit, on its "
        "MassiveText)"
    )
    return dict(
        wall_s=wall, work_s=work, tau_s=tau, failures=fails, N=N, D=D, loss=final_loss(N, D)
    )


def budget_model(P, C, B, a, stack):
    """The compute-optimal model for the budget: C from the budget's training seconds x GPUs x peak
    x MFU, the MFU of the best layout found for the model of the step before (twice, from
    --efficiency)."""
    gpus, mfu = C.nodes * C.gpus_per_node, a.efficiency
    wall = a.days * 86400 or a.gpu_hours * 3600 / gpus
    work = (
        work_in(
            wall,
            gpus,
            a.failures_per_gpu_hour,
            a.ckpt_write_s,
            60 * a.restart_minutes,
            60 * a.ckpt_minutes,
        )
        if wall
        else 0
    )
    for _ in range(2):
        flops = a.flops or work * gpus * C.tflops * 1e12 * mfu
        N, D = compute_optimal(flops, LAWS[a.law], a.tokens_per_param or 0)
        M = shaped(P, N)
        ranked = search(M, C, B, a.efficiency, a.headroom, a.precision, **stack)[0]
        if not ranked:
            fail(
                f"no layout of the compute-optimal {n_params(M) / 1e9:.1f}B model fits {gpus} GPUs "
                f"of {C.mem_gb:g} GB at --batch-size {B}"
            )
        mfu = ranked[0]["mfu"]
    tokens = flops / (6 * n_params(M)) if a.flops else work * ranked[0]["tokens_per_s"]
    return M, ranked, tokens, (flops, N, D)


def main():
    a = parse_args(Args)
    check_args(a)
    P, K = PRESETS[a.model], CLUSTERS[a.cluster]
    M = P._replace(
        layers=a.n_layers or P.layers,
        d=a.d_model or P.d,
        heads=a.n_heads or P.heads,
        kv_heads=a.kv_heads or P.kv_heads,
        vocab=a.vocab or P.vocab,
        seq=a.seq_len or P.seq,
        ffn=a.ffn or P.ffn,
        experts=a.experts or P.experts,
        top_k=a.top_k,
        capacity=a.capacity_factor,
        moe_every=a.moe_every,
    )
    if M.d % M.heads or M.heads % M.kv:
        fail(
            f"--d-model {M.d} must be divisible by --n-heads {M.heads}, and that by --kv-heads "
            f"{M.kv}"
        )
    C = Cluster(
        a.nodes,
        a.gpus_per_node or K.gpus_per_node,
        a.gpu_mem_gb or K.mem_gb,
        a.tflops or K.tflops,
        a.intra_gbs or K.intra_gbs,
        a.inter_gbs or K.inter_gbs,
        a.hbm_gbs or K.hbm_gbs,
        K.fp8,
    )
    gpus = C.nodes * C.gpus_per_node
    B = a.batch_size
    st = STACKS[a.stack]
    if a.precision == "fp8" and not C.fp8:
        fail(NO_FP8)
    eff, error, source = ceiling(a.stack, a.cluster)
    if a.efficiency or a.precision == "fp8":
        error, source = (
            None,
            (
                "--efficiency given"
                if a.efficiency
                else f"{source}; at the FP8 peak, fitted on no FP8 run"
            )
            + ": no band",
        )
    a.efficiency = a.efficiency or eff
    attention, dropout = a.attention or st.attention, st.dropout if a.dropout is None else a.dropout
    overlaps = dict(
        tp_overlap=a.tp_overlap or st.tp_overlap, dp_overlap=a.dp_overlap or st.dp_overlap
    )
    if (attention, dropout, *overlaps.values()) != st[:4] and error:
        source += f"; measured on {a.stack}'s own attention, dropout and overlaps, not these"
    stack = dict(attention=attention, dropout=dropout, **overlaps)
    print(
        f"plan (predictions): {a.model}, {n_params(M) / 1e9:.2f}B parameters, L {M.layers} h {M.d} "
        f"a {M.heads} V {M.vocab} s {M.seq}; batch {B} x {M.seq} tokens; {C.nodes} x "
        f"{C.gpus_per_node} GPUs of {C.mem_gb:g} GB, {C.tflops:g} TFLOP/s, {C.intra_gbs:g} / "
        f"{C.inter_gbs:g} GB/s in / across nodes, {C.hbm_gbs:g} GB/s memory"
    )
    print(
        f"  stack {a.stack}: {attention} attention, dropout {'on' if dropout else 'off'}, overlaps "
        f"tp {overlaps['tp_overlap']}, dp {overlaps['dp_overlap']}; GEMM ceiling {a.efficiency:g} "
        f"({source})"
    )
    if a.gpu_hours or a.days or a.flops:
        M, ranked, tokens, optimal = budget_model(P, C, B, a, stack)
        report(C, B, ranked[0], error)
        return run_report(M, C, ranked[0], tokens, a, optimal)
    if a.search:
        ranked, n_legal, n_fit = search(M, C, B, a.efficiency, a.headroom, a.precision, **stack)
        if not ranked:
            fail(f"no layout of {a.model} fits {gpus} GPUs of {C.mem_gb:g} GB at --batch-size {B}")
        # each MFU with its band (+- x.x), where there is one
        print(
            f"--search: {n_legal} legal layouts on {gpus} GPUs, {n_fit} fit; the fastest of each "
            "grid:"
        )
        beside = band(error).removesuffix(" points") if error is not None else ""
        for i, x in enumerate(ranked[: a.top]):
            print(
                f"  {i + 1:2d}. {x['tokens_per_s']:11,.0f} tok/s  MFU {x['mfu']:5.1%}{beside}"
                f"  step {x['step_s']:8.3f} s  {x['layout']}"
            )
        print(
            "why 1 beats 2: "
            + (why_faster(*ranked[:2]) if ranked[1:] else "it is the only one that fits")
        )
        got = ranked[0]
    else:
        v = a.virtual_stages
        lay = Layout(
            a.dp or max(1, gpus // (a.tp * a.pp * a.cp)),
            a.tp,
            a.pp,
            v,
            a.ep,
            a.stage,
            a.microbatches,
            a.sequence_parallel,
            a.recompute,
            a.precision,
            "interleaved" if v > 1 and a.schedule == "1f1b" else a.schedule,
            a.vocab_parallel,
            cp=a.cp,
            cp_attention=a.cp_attention,
            attention=attention,
            dropout=dropout,
            replicate=a.replicate,
        )
        if a.stage_layers:
            lay = replace(lay, split=tuple(map(int, a.stage_layers.split(","))))
        why = legal(M, C, lay, B)
        if why:
            fail(why)
        got = predict(M, C, lay, B, a.efficiency, a.headroom, **overlaps)
    report(C, B, got, error)
    if a.inner_steps:
        outer = {"float32": 4, "bfloat16": 2}[a.outer_dtype]
        x = diloco(M, C, got, a.inner_steps, outer, a.fragments, a.overlap)
        print(
            f"DiLoCo (theory), H {a.inner_steps}, {a.fragments} fragment(s), overlap {a.overlap}, "
            f"{a.outer_dtype}: per inner step {x['bytes'] / GB:.3f} GB handed "
            f"({x['wire'] / GB:.3f} on the wire), exposed {x['exposed_s'] * 1e3:.1f} ms; DDP "
            f"{x['ddp_bytes'] / GB:.3f} GB ({x['ddp_wire'] / GB:.3f}), exposed "
            f"{x['ddp_exposed_s'] * 1e3:.1f} ms: {x['ddp_bytes'] / x['bytes']:.0f}x fewer bytes"
        )
    if a.tokens:
        run_report(M, C, got, a.tokens, a)
    return got


if __name__ == "__main__":
    main()
