"""megatron_tp.py: Megatron-LM tensor (intra-layer) model parallelism, every split and collective
written out.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (Sec. 3): each transformer block's matmuls are split across the t ranks of a TP group,
so that a block needs only two all-reduces forward and two backward. Plus --sequence-parallel from
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (Sec.
4.2.2): the LayerNorm / dropout / residual regions are split along the sequence instead of being
replicated. Plus --overlap (implies --sequence-parallel) from Wang et al. 2023, "Overlap
Communication with Dependent Computation via Decomposition in Large Deep Learning Models": each
all-gather + GEMM and GEMM + reduce-scatter cut into t ring steps of point-to-point exchange, each
step's GEMM on one chunk of T while the next chunk travels (torchtitan's async TP; torch's
_fused_all_gather_matmul and _fused_matmul_reduce_scatter).

    python megatron_tp.py --check                                     # t = 1: the same code, no communication
    torchrun --nproc_per_node=4 megatron_tp.py --check                # t = 4, the whole world
    torchrun --nproc_per_node=4 megatron_tp.py --sequence-parallel --check
    torchrun --nproc_per_node=4 megatron_tp.py --overlap --check      # SP's collectives as ring steps
    torchrun --nproc_per_node=4 megatron_tp.py --tp 2 --check         # t = 2, data parallel over 2 replicas

The MLP, column-then-row, so the GeLU needs no communication (Sec. 3, Fig. 3a), here for t = 2:

            X (B,T,D) replicated
                 |
                 f                   identity forward, all-reduce backward
           /           \\
     X A_0^T          X A_1^T         fc weight A (4D, D) split by output rows: A_r (4D/t, D)
     GeLU             GeLU            elementwise on this rank's own columns: no communication
     Y_0 B_0^T        Y_1 B_1^T       proj weight B (D, 4D) split by input columns: B_r (D, 4D/t)
           \\           /
                 g                   all-reduce forward (sum of partial products), identity backward
                 |
            Z (B,T,D) replicated  (+ the proj bias, replicated, added once after g)

Attention is the same pattern over heads. The LM head, column-split over the vocabulary, feeds a
cross-entropy that combines max and sum(exp) across ranks: the (B, T, V) logits never exist
anywhere. Layer by layer (column: output features split; row: input features split):

    common.GPT          split                  rank r holds                       enters / leaves the region
    tok_emb             vocabulary (rows)      ids [r V/t, (r+1) V/t)             -  / g     (SP: g_sp)
    attn.q, .k, .v      column, one GEMM       heads [r H/t, (r+1) H/t)           f  / -     (SP: f_sp)
    attn.proj           row                    those heads' input columns         -  / g     (SP: g_sp)
    mlp.fc              column                 4D/t hidden features               f  / -     (SP: f_sp)
    mlp.proj            row                    those 4D/t input features          -  / g     (SP: g_sp)
    head                column (vocabulary)    V/t logits, for the parallel loss  f  / -     (SP: f_sp)
    ln1, ln2, ln_f, pos_emb, row biases        replicated (SP: their gradients summed over the TP group)

--sequence-parallel: f / g become f_sp / g_sp, an all-gather / reduce-scatter along T (a ring
all-reduce IS a reduce-scatter then an all-gather), and LayerNorm, dropout and the residual add run
on (B, T/t, D) chunks:

    (B,T/t,D) -LN-> all-gather T -> [column .. row] -> reduce-scatter T -> (B,T/t,D) -dropout, +
    residual->

    operator  forward                  backward                  stands
    f         identity                 all-reduce dL/dX          before a column layer, X replicated
    g         all-reduce               identity                  after a row layer: sums the partial products
    f_sp      all-gather along T       reduce-scatter along T    before a column layer, X split along T
    g_sp      reduce-scatter along T   all-gather along T        after a row layer, back to T/t positions

The column layers keep only the (B, T/t, D) chunk for backward and all-gather it again there (Sec.
4.2.2), so every activation a block saves is 1/t of the unsharded block's, at the price of one more
all-gather: f_sp is therefore written inside the column layer's GEMM (GatherGEMM), as Megatron-Core
writes it. The file reads as Megatron-LM's TP complete first (f and g, the layers, the RNG tracker,
the sharded GPT, gradients and clipping); the "sequence parallelism" heading then adds g_sp, f_sp
inside the GEMM that saves the chunk, the SP layers and SPGPT as subclasses, and the sum of the
replicated gradients; the "overlapped TP" heading then runs f_sp + column GEMM and row GEMM + g_sp
as one ring, written once and used forward and backward (RingGPT: GatherGEMM's ring mode, and
GEMMScatter). The ring sends what the collectives' ring algorithms send: t - 1 chunks of (B, T/t, D)
per rank and operation. Backward is decomposed too: a column layer's dL/dW over its input's chunks
gathered again by the ring and its dL/dX reduce-scattered by it; a row layer's dL/dY gathered by it.
On NCCL the GEMM overlaps the transfer only if the exchange runs on its own stream, which NCCL's
point-to-point does; on gloo (CPU) each exchange is a host thread's work, and the GEMM runs
meanwhile.

Groups come from one grid, arange(world).view(dp, tp): a row is a TP group (adjacent ranks, one
node), a column a data-parallel group. In production, use Megatron-Core
(megatron.core.tensor_parallel) or torch.distributed.tensor.parallel.
"""

import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (
    DTYPES,
    IGNORE,
    Block,
    GPTConfig,
    MarkovData,
    build_gpt,
    clip_grads_,
    count_tokens,
    fail,
    init_dist,
    make_optimizer,
)
from harness import (
    CommCounter,
    CommonArgs,
    Run,
    SavedActivations,
    check_against_reference,
    check_common_args,
    env_world_size,
    parse_args,
    peak_memory_bytes,
    state_bytes,
    tensor_bytes,
)


@dataclass
class Args(CommonArgs):
    tp: int = 0  # tensor-parallel degree t (0 = the whole world); data parallel over world / t
    # split LayerNorm / dropout regions along the sequence (Korthikanti)
    sequence_parallel: bool = False
    overlap: bool = False  # implies --sequence-parallel: its AG / RS as ring steps under the GEMMs


# ---------------------------------------------------------------------- f and g, the conjugate pair
def all_reduce(x, group, op=dist.ReduceOp.SUM):  # in place, any shape
    if dist.get_world_size(group) > 1:  # a group of one has nothing to add (t = 1 or dp = 1)
        dist.all_reduce(x, op=op, group=group)
    return x


class f(torch.autograd.Function):
    """Each rank multiplies X by its own shard, so its dL/dX is a partial sum: backward adds them
    up."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, D) replicated
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        # (B, T, D) partial -> summed; a copy: autograd may hold on to its own buffer
        return all_reduce(grad.clone(), ctx.group), None


class g(torch.autograd.Function):
    """The row-parallel partial products are summed; a sum's gradient reaches every term
    unchanged."""

    @staticmethod
    def forward(ctx, x, group):
        # (B, T, D) partial -> summed, replicated (not in place on the graph's input)
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


# ----------------------------------------------------------------------------- parallel layers
# the layers' check, and check_args's with the flag's name for `what`
def check_tp_split(n, t, what):
    if n % t:
        raise ValueError(f"{what} {n} is not divisible by the TP degree {t}: use a multiple of {t}")


def shard(parts, dim, group):
    """This rank's slice along `dim` of the full tensors `parts` (several: their slices stacked), as
    one Parameter marked tp_dim (split along it), so that clipping knows. A single tensor that t
    does not divide is zero-padded to a multiple of t (only the vocabulary ever needs it)."""
    t = dist.get_world_size(group)
    if len(parts) > 1 and any(x.shape[dim] % t for x in parts):
        raise ValueError(
            f"fused parts of sizes {[x.shape[dim] for x in parts]} must each split evenly over "
            f"t = {t} (only a single layer is zero-padded): use sizes divisible by {t}"
        )
    slices = []
    for x in parts:
        pad = list(x.shape)
        pad[dim] = -x.shape[dim] % t
        slices.append(
            torch.cat([x.detach(), x.new_zeros(pad)], dim).chunk(t, dim)[dist.get_rank(group)]
        )
    p = nn.Parameter(torch.cat(slices, dim).clone())
    p.tp_dim = dim
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output features split (the paper's "A split along its columns": A =
    W^T).

        W (out, in)               rank r holds W_r (out/t, in) and b_r (out/t)
        +---------------+
        |  W_0  rank 0  |         Y_r = f(X) W_r^T + b_r : (B, T, out/t), this rank's output features
        +---------------+
        |  W_1  rank 1  |
        +---------------+
    Built from one nn.Linear, or from several that read the same X (attention's q, k, v): rank r
    then holds [W_q,r; W_k,r; W_v,r] as one weight, so one GEMM behind one f serves all three
    (Megatron fuses them so), and its output is their outputs side by side."""

    def __init__(self, linears, group):
        super().__init__()
        linears = linears if isinstance(linears, (list, tuple)) else [linears]
        self.weight, self.group = shard([lin.weight for lin in linears], 0, group), group
        # may differ by part (SwiGLU: gate without, up with)
        has = [lin.bias is not None for lin in linears]
        bias = [
            lin.bias if h else lin.weight.new_zeros(len(lin.weight)) for lin, h in zip(linears, has)
        ]
        self.bias = shard(bias, 0, group) if any(has) else None
        # 1: a real bias
        mask = shard([torch.full_like(b, h) for b, h in zip(bias, has)], 0, group).detach()
        self.register_buffer(
            "bias_mask", None if all(has) or not any(has) else mask, persistent=False
        )

    def masked_bias(self):  # a missing bias stays zero
        return self.bias if self.bias_mask is None else self.bias * self.bias_mask

    def forward(self, x):  # (B, T, in) replicated
        # (B, T, out/t) local
        return F.linear(f.apply(x, self.group), self.weight, self.masked_bias())


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input features split (the paper's "A split along its rows"):

        W (out, in)
        +---------+---------+     rank r holds W_r (out, in/t); the bias (out) is replicated
        |   W_0   |   W_1   |
        +---------+---------+     Y = g(X_0 W_0^T + X_1 W_1^T) + b : one all-reduce sums the partial
        X = [ X_0 | X_1 ]         products; the bias is added once, after it (else it would count t times)
    X_r is (B, T, in/t): a column layer's output, this rank's features."""

    leave = g  # the operator that closes the region (sequence parallelism, below, swaps in its own)

    def __init__(self, linear, group):
        super().__init__()
        self.weight, self.group = shard([linear.weight], 1, group), group
        # replicated
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):  # (B, T, in/t) local
        y = self.leave.apply(F.linear(x, self.weight), self.group)  # (B, T, out) summed
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token table E (V_pad, D) split over the vocabulary: rank r holds E_r (V_pad/t, D), the
    rows of ids [r V_pad/t, (r+1) V_pad/t) (V_pad: V rounded up to a multiple of t, rows no id
    reaches). Each rank looks up the ids it owns, writes zeros for the others; one rank holds each
    row, so g's sum is the lookup."""

    leave = g

    def __init__(self, embedding, group):
        super().__init__()
        self.weight, self.group = shard([embedding.weight], 0, group), group
        self.start = dist.get_rank(group) * self.weight.shape[0]

    def forward(self, idx):  # (B, T) global token ids
        local = idx - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # (B, T): ids this rank owns
        e = F.embedding(torch.where(mine, local, 0), self.weight)  # (B, T, D) local rows
        # others' ids: zero output and zero gradient to row 0
        e = e.masked_fill(~mine[..., None], 0.0)
        return self.leave.apply(e, self.group)  # (B, T, D) replicated


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split over the vocabulary (Megatron-LM Sec. 3: fuse the
    output GEMM with the loss). loss = log sum_v exp(z_v - m) - (z_target - m), with m the global
    max; the three numbers per token (m, z_target - m, sum exp) are combined across ranks by three
    all-reduces of N values instead of an all-gather of N * V logits. Backward is local: dL/dz =
    softmax(z) - onehot(target)."""

    @staticmethod
    def forward(ctx, logits, target, vocab, group, ignore_index=-100):
        # (N, V_pad/t) local, (N,) global ids
        n_local, t = logits.shape[-1], dist.get_world_size(group)
        # VocabParallelEmbedding's split; else some targets go unseen
        if n_local != math.ceil(vocab / t):
            raise ValueError(
                f"vocab {vocab} over t = {t}: give each rank ceil(V/t) logits, not {n_local}"
            )
        start = dist.get_rank(group) * n_local
        padded = torch.arange(start, start + n_local, device=logits.device) >= vocab  # (V_pad/t,)
        # padded entries get probability 0: never predicted
        z = logits.masked_fill(padded, float("-inf"))
        # (N,) 1. global max, for a stable exp
        m = all_reduce(z.max(-1).values, group, op=dist.ReduceOp.MAX)
        z = z - m[:, None]
        # (N,) this rank holds the target's logit
        mine = (target >= start) & (target < start + n_local)
        local_t = torch.where(mine, target - start, 0)
        # 2. z_t - m
        picked = all_reduce(torch.where(mine, z.gather(1, local_t[:, None])[:, 0], 0.0), group)
        e = z.exp()  # (N, V_pad/t)
        sum_e = all_reduce(e.sum(-1), group)  # 3. sum of exp over the whole vocabulary
        # as F.cross_entropy: such a target (padding) carries no loss
        valid = target != ignore_index
        ctx.save_for_backward(e / sum_e[:, None], local_t, mine & valid, valid)
        return torch.where(valid, sum_e.log() - picked, 0.0)  # (N,), identical on every TP rank

    @staticmethod
    def backward(ctx, grad):  # (N,)
        softmax, local_t, hit, valid = ctx.saved_tensors
        # (N, V_pad/t): softmax - onehot(target), the 1 subtracted where this rank holds the
        # target's logit
        d = softmax.scatter_add(1, local_t[:, None], -hit[:, None].to(softmax.dtype))
        return d * (grad * valid)[:, None], None, None, None, None


# ----------------------------------------------------------------------------- dropout RNG
class RNGTracker:
    """Megatron's RNG states tracker (megatron.core.tensor_parallel.random): two streams of the
    device's generator. The default one, seeded alike on every TP rank of a replica, drives dropout
    in replicated regions, which so stay identical; fork() runs a block on the second, seeded per TP
    rank, for dropout in TP regions, where each rank holds other heads and equal masks would
    correlate. Both differ by replica."""

    def __init__(self, device, seed, dp_rank, tp_rank):
        base = 100_003 * seed + 7_919 * dp_rank + 1
        torch.manual_seed(base)  # the default stream: the same across TP ranks
        self.forked = False
        self.gen = torch.default_generator  # the generator dropout draws from on the CPU
        if device.type == "cuda":  # or on cuda:i (init fills torch.cuda.default_generators)
            torch.cuda.init()
            self.gen = torch.cuda.default_generators[device.index]
        tp_gen = torch.Generator(device=device).manual_seed(base + 2_719 + tp_rank)
        self.tp_state = tp_gen.get_state()

    @contextmanager
    def fork(self):
        # a fork inside a fork stays on this stream (SP runs a whole forward forked)
        if self.forked:
            yield
            return
        outside, self.forked = self.gen.get_state(), True
        self.gen.set_state(self.tp_state)
        try:
            yield
        finally:
            self.tp_state, self.forked = self.gen.get_state(), False
            self.gen.set_state(outside)


# ----------------------------------------------------------------------------- the sharded GPT
class ParallelAttention(nn.Module):
    """common.Attention with heads split: q, k, v one column-parallel layer (the features are
    head-major, so rank r owns heads [rH/t, (r+1)H/t)); proj row-parallel. One all-reduce forward
    (g), one backward (f)."""

    def __init__(self, full, group, tracker, Column=ColumnParallelLinear, Row=RowParallelLinear):
        super().__init__()
        t = dist.get_world_size(group)
        # a head cut across ranks would be silently wrong
        check_tp_split(full.n_heads, t, "n_heads")
        self.qkv, self.proj = Column([full.q, full.k, full.v], group), Row(full.proj, group)
        self.heads = full.n_heads // t
        self.p = full.p
        self.tracker = tracker

    def forward(self, x):  # (B, T, D) replicated
        # each (B, H/t, T, E)
        q, k, v = rearrange(self.qkv(x), "b t (n h e) -> n b h t e", n=3, h=self.heads)
        # attention dropout: inside the TP region, on this rank's own stream
        with self.tracker.fork():
            y = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, dropout_p=self.p * self.training
            )
        y = self.proj(rearrange(y, "b h t e -> b t (h e)"))  # (B, T, D/t) local -> (B, T, D) summed
        # replicated region: the default stream, one mask for all
        return F.dropout(y, self.p, self.training)


class ParallelMLP(nn.Module):
    """common.MLP as column-then-row: f, fc shard, GeLU, proj shard, g (Megatron-LM Fig. 3a)."""

    def __init__(self, full, group, Column=ColumnParallelLinear, Row=RowParallelLinear):
        super().__init__()
        self.fc = Column(full.fc, group)
        self.proj = Row(full.proj, group)
        self.drop = nn.Dropout(full.drop.p)  # replicated region: the default stream

    def forward(self, x):  # (B, T, D) replicated
        y = self.proj(F.gelu(self.fc(x)))  # fc: (B, T, 4D/t) local; proj: (B, T, D) summed
        return self.drop(y)


class ParallelGPT(nn.Module):
    """common.GPT sharded by the docstring's table, from the full model (one seed: any t starts from
    the same numbers), which it consumes. Names stay common.GPT's, but for the fused attn.qkv
    (attn.q, .k, .v)."""

    # SPGPT: its own
    Column = ColumnParallelLinear
    Row = RowParallelLinear
    Embedding = VocabParallelEmbedding

    def __init__(self, full, group, tracker):
        super().__init__()
        # keeps its forward and LayerNorms: x + attn(ln1(x)), then + mlp(ln2(x))
        for block in full.blocks:
            block.attn = ParallelAttention(block.attn, group, tracker, self.Column, self.Row)
            block.mlp = ParallelMLP(block.mlp, group, self.Column, self.Row)
        self.tok_emb = self.Embedding(full.tok_emb, group)
        # replicated
        self.pos_emb = full.pos_emb
        self.blocks = full.blocks
        self.ln_f = full.ln_f
        self.head = self.Column(full.head, group)  # untied, no bias
        self.drop = full.drop
        self.group = group
        self.tracker = tracker

    # (B, T) global ids -> (B, T, V_pad/t) logits, this rank's vocabulary slice
    def forward(self, idx):
        h = self.tok_emb(idx)  # (B, T, D) replicated
        h = self.drop(h + self.pos_emb(self.positions(h)))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # head: f then (B, T, V_pad/t) local

    def positions(self, h):  # (T,): the positions h holds
        return torch.arange(h.shape[1], device=h.device)


# --------------------------------------------------------------------------- gradients and clipping
def flat_all_reduce(tensors, group):
    """One all-reduce of many tensors through a flat buffer (a single bucket)."""
    if dist.get_world_size(group) == 1 or not tensors:
        return
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group)
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


def global_grad_norm(model, tp_group):
    """The norm of the whole model's gradient: squares of split parameters summed over the TP group
    (each rank holds a different piece), replicated ones added once (every TP rank holds the same
    copy). Summed in float32 at least: in bfloat16 (8 significant bits) a sum stops growing once it
    is 256 times a term."""
    params = list(model.parameters())
    acc = torch.promote_types(params[0].dtype, torch.float32)
    # the two sums: tensors, even if nothing is added to one
    split = torch.zeros((), dtype=acc, device=params[0].device)
    replicated = torch.zeros_like(split)
    for p in params:
        square = torch.linalg.vector_norm(p.grad, dtype=acc) ** 2
        if hasattr(p, "tp_dim"):
            split += square
        else:
            replicated += square
    return (all_reduce(split, tp_group) + replicated).sqrt()


# ============================================================================= sequence parallelism
# Korthikanti et al. 2022 Sec. 4.2.2: the regions replicated above (LayerNorm, dropout, residual)
# are split along T; f and g become f_sp and g_sp (the paper's g and g-bar), as the docstring draws.
def all_gather(x, dim, group):
    """(.., n, ..) this rank's chunk -> (.., t*n, ..), rank r's chunk r-th."""
    t = dist.get_world_size(group)
    if t == 1:
        return x
    out = x.new_empty(t, *x.shape)  # (t, .., n, ..): slot r from rank r
    # flat: every backend takes 1-D
    dist.all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
    return torch.cat(out.unbind(0), dim)


def reduce_scatter(x, dim, group):  # (.., t*n, ..) partial sums -> (.., n, ..) summed, chunk r
    t = dist.get_world_size(group)
    # uneven chunks would abort the collective
    check_tp_split(x.shape[dim], t, "sequence parallelism's T =")
    if t == 1:
        return x
    whole = torch.stack(x.chunk(t, dim))  # (t, .., n, ..), contiguous: slot r goes to rank r
    out = x.new_empty(whole.shape[1:])
    dist.reduce_scatter_single(out.view(-1), whole.view(-1), group=group)
    return out


class g_sp(torch.autograd.Function):
    """The partial products are summed, each rank keeping its T/t positions; backward gathers all T
    again."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, D) partial -> (B, T/t, D) summed chunk
        ctx.group = group
        return reduce_scatter(x, 1, group)

    @staticmethod
    def backward(ctx, grad):  # (B, T/t, D) -> (B, T, D)
        return all_gather(grad, 1, ctx.group), None


# f_sp is written inside the column layer's GEMM (GatherGEMM, as Megatron-Core's
# LinearWithGradAccumulationAndAsyncCommunication does), so that the layer saves only its (B, T/t,
# D) chunk of X: F.linear on f_sp's output would keep the whole gathered X. The GEMM is handed over
# as gemm(c, x_c), c the chunk of T that x_c holds; SP runs it once on all T, one chunk (c = 0);
# --overlap runs it on each rank's chunk as it arrives by the ring (`ring`, the next heading's).
def gather_gemm(x, group, gemm, overlap):
    """f_sp's all-gather of X's chunks x along T, then the GEMM after it: [gemm(c, x_c)] in the
    order of T. --overlap: by the ring, each chunk's GEMM as it arrives; after s steps rank r holds
    rank r + s's chunk."""
    if not overlap:
        return [gemm(0, all_gather(x, 1, group))]  # (B, T, in): all T, one chunk
    t = dist.get_world_size(group)
    r = dist.get_rank(group)
    out = [None] * t

    def work(s, x_c):
        out[(r + s) % t] = gemm((r + s) % t, x_c)

    work(t - 1, ring(x.contiguous(), group, work))  # the last chunk to arrive
    return out


def gemm_scatter(gemm, group, overlap):
    """The GEMM, then g_sp's reduce-scatter along T of its partial sums: this rank's (B, T/t, ..)
    summed. --overlap: by the ring, gemm(c) this rank's partial sum of chunk c of T; the sum of
    chunk r + 1 starts here and travels to r - 1, r - 2, ..., each rank adding its own, and arrives
    whole at rank r + 1."""
    if not overlap:
        return reduce_scatter(gemm(0), 1, group)
    t = dist.get_world_size(group)
    r = dist.get_rank(group)
    return ring(gemm((r + 1) % t), group, lambda s, _: gemm((r + s + 2) % t))


class GatherGEMM(torch.autograd.Function):
    """f_sp + the column GEMM Y = X W^T (the bias is added outside), saving only X's chunk: backward
    gathers it again for dL/dW = dY^T X (Sec. 4.2.2; Megatron-Core overlaps that with the dL/dX
    GEMM), and reduce-scatters dL/dX = dY W (f_sp's backward)."""

    @staticmethod
    def forward(ctx, x, weight, group, overlap):  # x (B, T/t, in) chunk -> (B, T, out/t) local
        ctx.save_for_backward(x, weight)
        ctx.group = group
        ctx.overlap = overlap
        return torch.cat(gather_gemm(x, group, lambda c, x_c: x_c @ weight.T, overlap), 1)

    @staticmethod
    def backward(ctx, dy):  # (B, T, out/t)
        x, weight = ctx.saved_tensors
        # dY's chunks of T, as gather_gemm hands X's over: t with the ring, else one
        dys = dy.chunk(dist.get_world_size(ctx.group) if ctx.overlap else 1, 1)
        # dL/dW (out/t, in): each chunk's term over X gathered again (first, as Megatron-Core, which
        # runs the gather under the dL/dX GEMM)
        dws = gather_gemm(
            x, ctx.group, lambda c, x_c: torch.einsum("bto,bti->oi", dys[c], x_c), ctx.overlap
        )
        dx = gemm_scatter(lambda c: dys[c] @ weight, ctx.group, ctx.overlap)  # (B, T/t, in) summed
        return dx, sum(dws), None, None


class SPColumnParallelLinear(ColumnParallelLinear):
    overlap = False  # RingColumnParallelLinear: the ring's steps under the GEMM

    def forward(self, x):  # (B, T/t, in) this rank's chunk -> (B, T, out/t) local
        y = GatherGEMM.apply(x, self.weight, self.group, self.overlap)
        return y if self.bias is None else y + self.masked_bias()


class SPRowParallelLinear(RowParallelLinear):
    leave = g_sp  # (B, T, out) partial -> (B, T/t, out) summed, this rank's positions


class SPVocabParallelEmbedding(VocabParallelEmbedding):
    leave = g_sp  # (B, T, D) partial -> (B, T/t, D) summed


class SPGPT(ParallelGPT):
    """ParallelGPT with LayerNorm, dropout, residual on (B, T/t, D): every dropout on the per-rank
    stream."""

    Column = SPColumnParallelLinear
    Row = SPRowParallelLinear
    Embedding = SPVocabParallelEmbedding

    # (B, T) global ids -> (B, T, V_pad/t) logits, this rank's vocabulary slice
    def forward(self, idx):
        with self.tracker.fork():
            return super().forward(idx)

    def positions(self, h):  # (T/t,): this rank's chunk of the sequence
        return dist.get_rank(self.group) * h.shape[1] + super().positions(h)


def sum_replicated_grads(model, tp_group):
    """Replicated parameters (LN, row biases, positions) saw only my T/t positions: sum over the TP
    group."""
    flat_all_reduce([p.grad for p in model.parameters() if not hasattr(p, "tp_dim")], tp_group)


# ============================================================================= overlapped TP:
# --overlap Wang et al. 2023, "Overlap Communication with Dependent Computation via Decomposition in
# Large Deep Learning Models" (ASPLOS '23); torch's _fused_all_gather_matmul /
# _fused_matmul_reduce_scatter, torchtitan's async TP. Under SP the column GEMM waits for f_sp's
# all-gather and g_sp's reduce-scatter for the row GEMM. Cut both into ring steps: each step's GEMM
# on one chunk of T runs while the next chunk travels.
#
#     all-gather + GEMM on rank r (t = 3)
#     step  computes             meanwhile
#     0     Y_r   = X_r W^T      X_r   -> r-1
#     1     Y_r+1 = X_r+1 W^T    X_r+1 -> r-1
#     2     Y_r+2 = X_r+2 W^T    -
#
#     GEMM + reduce-scatter on rank r
#     step  computes             meanwhile
#     0     P = X[r+1] W^T       -
#     1     Q = X[r+2] W^T       P -> r-1, P' <- r+1; P' + Q
#     2     R = X[r] W^T         P'+Q -> r-1, ... + R: chunk r
#
# gather_gemm and gemm_scatter, above, run these steps when given overlap; ring is their step loop.
# t - 1 sends of one (B, T/t, D) chunk: the bytes the ring algorithms of both collectives send.
def ring(carry, group, work):
    """t - 1 steps round `group`'s ring: each rank sends `carry` to rank r - 1 and receives rank r +
    1's, while work(s, carry) runs, the GEMM that the exchange hides behind; what arrives, plus what
    work returned (None: nothing), is carried on. Returns the last carry. Written once: both
    directions, both passes."""
    t = dist.get_world_size(group)
    r = dist.get_rank(group)
    for s in range(t - 1):
        got = torch.empty_like(carry)
        send = dist.P2POp(dist.isend, carry, group=group, group_peer=(r - 1) % t)
        recv = dist.P2POp(dist.irecv, got, group=group, group_peer=(r + 1) % t)
        works = dist.batch_isend_irecv([send, recv])
        partial = work(s, carry)  # the GEMM, while `carry` travels
        for w in works:
            w.wait()
        carry = got if partial is None else got + partial
    return carry


class RingColumnParallelLinear(SPColumnParallelLinear):
    overlap = True  # GatherGEMM's all-gathers and its reduce-scatter as the ring's steps


class GEMMScatter(torch.autograd.Function):
    """The row GEMM + g_sp by the ring. Backward gathers dY by the ring: for each chunk as it
    arrives, dL/dX_c = dY_c W and its term dY_c^T X_c of dL/dW."""

    @staticmethod
    def forward(ctx, x, weight, group):  # (B, T, in/t) local -> (B, T/t, out) summed
        t = dist.get_world_size(group)
        check_tp_split(x.shape[1], t, "the ring's T =")  # before any exchange
        ctx.save_for_backward(x, weight)
        ctx.group = group
        return gemm_scatter(lambda c: x.chunk(t, 1)[c] @ weight.T, group, overlap=True)

    @staticmethod
    def backward(ctx, dy):  # (B, T/t, out)
        x, weight = ctx.saved_tensors
        xs = x.chunk(dist.get_world_size(ctx.group), 1)
        # each chunk of dY as it arrives: dL/dX_c = dY_c W (B, T/t, in/t), dY_c^T X_c (out, in/t) of
        # dL/dW
        grads = gather_gemm(
            dy,
            ctx.group,
            lambda c, d: (d @ weight, torch.einsum("bto,bti->oi", d, xs[c])),
            overlap=True,
        )
        dx, dw = zip(*grads)
        return torch.cat(dx, 1), sum(dw), None


class RingRowParallelLinear(SPRowParallelLinear):
    def forward(self, x):  # (B, T, in/t) local -> (B, T/t, out) summed
        y = GEMMScatter.apply(x, self.weight, self.group)
        return y if self.bias is None else y + self.bias


class RingGPT(SPGPT):
    """SPGPT with every column and row GEMM overlapped (the embedding's g_sp has no GEMM to hide
    behind)."""

    Column = RingColumnParallelLinear
    Row = RingRowParallelLinear


def check_args(args):  # bad input: one line and exit 2, on every rank, before any collective
    check_common_args(args)
    world = env_world_size()
    if args.tp < 0:
        fail(f"--tp must be >= 0 (0 = the whole world), got {args.tp}")
    t = args.tp or world
    if world % t:
        # --overlap is SP with its collectives cut into ring steps
        fail(
            f"world size {world} is not divisible by --tp {args.tp}: use a --tp dividing {world} "
            "(0 = all)"
        )
    args.sequence_parallel |= args.overlap
    # the layers' own check (ParallelAttention's heads, SP's reduce_scatter), as fail's one line
    try:
        check_tp_split(args.n_heads, t, "--n-heads")
        if args.sequence_parallel:
            check_tp_split(args.seq_len, t, "--sequence-parallel (or --overlap): --seq-len")
    except ValueError as e:
        fail(str(e))
    if args.batch_size % (world // t):
        fail(
            f"--batch-size {args.batch_size} is not divisible by the data-parallel degree "
            f"{world // t}"
        )
    return t, world // t


def main():
    args = parse_args(Args)
    t, dp = check_args(args)

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    grid = torch.arange(d.world).view(dp, t)  # rows: TP groups (adjacent ranks); columns: DP groups
    # every rank creates every group, same order, and gets the one it is in
    tp_group, _ = dist.new_subgroups_by_enumeration(grid.tolist())
    dp_group, _ = dist.new_subgroups_by_enumeration(grid.T.tolist())
    # the same replicas again, for the log line's loss only: on NCCL its own communicator, so that
    # the loss's all-reduce and .item() never queue behind the training's collectives (DESIGN.md)
    log_group, _ = dist.new_subgroups_by_enumeration(grid.T.tolist())
    dp_rank, tp_rank = divmod(d.rank, t)
    d.log(
        f"megatron_tp.py: world {d.world} = dp {dp} x tp {t} on {d.backend}, sequence parallel "
        f"{args.sequence_parallel}, overlap {args.overlap}, entropy floor {data.entropy:.4f} "
        "nats/token"
    )

    # --- the model: the full GPT from one seed on the CPU, sliced there; slices to the device
    tracker = RNGTracker(d.device, args.seed, dp_rank, tp_rank)
    full = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])  # CPU
    GPT = RingGPT if args.overlap else SPGPT if args.sequence_parallel else ParallelGPT
    model = GPT(full, tp_group, tracker).to(d.device)  # shards
    del full
    opt = make_optimizer(model.parameters(), args)
    # resumes: --ckpt-dir
    run = Run(d, args, {"model": model, "optim": opt, "rng": TrackerState(tracker)})
    # the last step's collectives and saved activations
    comm = CommCounter(axes={"tp": tp_group, "dp": dp_group})
    saved = SavedActivations()
    for step in run.steps():
        # (B, T) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor on every rank
        x = x.chunk(dp)[dp_rank].to(d.device)  # (b, T): my replica's
        y = y.chunk(dp)[dp_rank].to(d.device)
        with run.watching(step, comm, saved):
            logits = model(x)  # (b, T, V_pad/t), b = B/dp: this rank's vocabulary slice
            if logits.dtype == torch.bfloat16:
                # as common.lm_loss: a bf16 softmax loses small probabilities
                logits = logits.float()
            # (b*T,), identical on every TP rank
            per_tok = VocabParallelCrossEntropy.apply(
                logits.flatten(0, 1), y.flatten(), args.vocab, tp_group, IGNORE
            )
            loss = per_tok.sum() / n_tok  # this replica's piece of the global batch's loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grads = [p.grad for p in model.parameters()]
            with comm.phase("step"):
                if args.sequence_parallel:
                    sum_replicated_grads(model, tp_group)
                # data parallel: losses divide by the *global* token count, so the SUM is the
                # batch's gradient
                flat_all_reduce(grads, dp_group)
                if args.clip > 0:
                    clip_grads_(grads, global_grad_norm(model, tp_group), args.clip)
                opt.step()
        # the global batch's loss, for the log line: the sum of the replicas' pieces
        run.end_step(step, all_reduce(loss.detach(), log_group).item())

    # the summary and --check
    summarize(d, args, run, model, opt, tp_group, comm, saved)


# --- measurement ---
# Closed forms and the summary, apart so that the technique above reads without them. The
# collectives were counted by harness.CommCounter at the dispatcher, per "op/axis/phase", during the
# last step.
FORMULA = (
    "per layer 2 all-reduce fwd + 2 bwd of b*s*h (SP: AG+RS pairs + 1 AG re-gather per column "
    "layer; overlap: each as t-1 sends of b*s*h/t); + embedding g, head f, 3 loss all-reduces of "
    "b*s, norm; bytes handed: AR tensor, AG chunk, RS input, send tensor; ring sends AR 2(n-1)/n, "
    "AG/RS (n-1)/n"
)
RING = {
    "all_reduce": 2,
    "all_gather": 1,
    "reduce_scatter": 1,
}  # ring sends = RING * (n-1)/n * whole


class TrackerState:
    """An RNGTracker's TP-region stream as checkpoint state (the checkpointer saves the default
    stream itself): a restart draws the same dropout masks inside TP regions as the uninterrupted
    run."""

    def __init__(self, tracker):
        self.tracker = tracker

    def state_dict(self):
        return {"tp_state": self.tracker.tp_state}

    def load_state_dict(self, state):
        self.tracker.tp_state = state["tp_state"].cpu()


def params_per_rank(args, t):
    """Closed form: (split elements on one rank, replicated elements)."""
    D = args.d_model
    L = args.n_layers
    V_pad = math.ceil(args.vocab / t) * t
    # q, k, v; attention proj; fc weight + bias; MLP proj; token embedding and LM head
    split = L * (3 * D * D + D * D + 4 * D * D + 4 * D + 4 * D * D) + 2 * V_pad * D
    # ln1, ln2, two row biases; positions; ln_f
    repl = L * (2 * 2 * D + D + D) + args.seq_len * D + 2 * D
    return split // t, repl


def theory_collectives(args, t, dp):
    """What one step must hand to collectives, from the shapes alone: {op/axis/phase: [calls,
    elements, bytes handed, ring bytes sent]}, by the rule of FORMULA (Megatron-LM Sec. 3;
    Korthikanti Sec. 4.2.2); SP adds one bucket of replicated grads. Ring bytes sent per rank: the
    ring algorithm's, never measured."""
    b = args.batch_size // dp
    s = args.seq_len
    h = args.d_model
    L = args.n_layers
    es = DTYPES[args.dtype].itemsize
    f32_es = 4 if args.dtype == "bfloat16" else es  # the loss and the norm are float32 for bfloat16
    split, repl = params_per_rank(args, t)
    table = {}

    # `calls` collectives of n elements of `size` bytes each
    def add(op, axis, phase, calls, n, size):
        group = t if axis == "tp" else dp
        c = table.setdefault(f"{op}/{axis}/{phase}", [0, 0, 0, 0])
        c[0], c[1] = c[0] + calls, c[1] + calls * n
        c[2] += calls * (0 if op == "recv" else n // group if op == "all_gather" else n) * size
        c[3] += calls * (
            n * size if op == "send" else RING.get(op, 0) * (group - 1) * n * size // group
        )

    if t > 1:
        # each column / row GEMM's collective as t - 1 ring steps of one b*s*h/t chunk
        if args.overlap:
            for phase, rings in [
                ("fwd", 4 * L + 1),
                ("bwd", 6 * L + 2),
            ]:  # fwd 4 per layer + LM head;
                for op in ("send", "recv"):  # bwd 2 per column layer (dW, dX), 1 per row layer
                    add(op, "tp", phase, rings * (t - 1), b * s * h // t, es)
            # the embedding's g_sp, no GEMM to hide
            add("reduce_scatter", "tp", "fwd", 1, b * s * h, es)
            add("all_gather", "tp", "bwd", 1, b * s * h, es)  # and its backward
            add("all_reduce", "tp", "step", 1, repl, es)  # replicated grads, partial over positions
        elif args.sequence_parallel:
            for op, phase in [
                ("all_gather", "fwd"),
                ("reduce_scatter", "fwd"),
                ("reduce_scatter", "bwd"),
                ("all_gather", "bwd"),
            ]:
                add(op, "tp", phase, 2 * L + 1, b * s * h, es)  # per layer 2; + LM head / embedding
            # the re-gathers: qkv, fc, LM head
            add("all_gather", "tp", "bwd", 2 * L + 1, b * s * h, es)
            add("all_reduce", "tp", "step", 1, repl, es)  # replicated grads, partial over positions
        else:
            add("all_reduce", "tp", "fwd", 2 * L + 1, b * s * h, es)  # per layer 2 g; + embedding g
            add("all_reduce", "tp", "bwd", 2 * L + 1, b * s * h, es)  # per layer 2 f; + LM head f
        add("all_reduce", "tp", "fwd", 3, b * s, f32_es)  # the loss: max, target logit, sum of exp
        if args.clip > 0:
            add("all_reduce", "tp", "step", 1, 1, f32_es)  # the gradient norm's sum of squares
    if dp > 1:
        add("all_reduce", "dp", "step", 1, split + repl, es)  # gradients
    return dict(sorted(table.items()))


def tp_wire_bytes(counted, t):
    """Per phase, the bytes this rank puts on the TP group's wire for its all-gathers,
    reduce-scatters and sends, from the bytes counted at the dispatcher: a send's tensor as handed;
    an all-gather's or a reduce-scatter's by the ring algorithm, (t-1) x the chunk handed and
    (t-1)/t x the input handed. The same for the plain SP path and --overlap, if the ring steps move
    what the collectives would."""
    wire = {}
    per_op = {"send": (1, 1), "all_gather": (t - 1, 1), "reduce_scatter": (t - 1, t)}
    for key, (_, _, nbytes) in counted.items():
        op, axis, phase = key.split("/")
        if axis == "tp" and op in per_op:
            wire[phase] = wire.get(phase, 0) + nbytes * per_op[op][0] // per_op[op][1]
    return dict(sorted(wire.items()))


def report(d, args, model, tp_group, counted, full_bytes, acts, t, dp):
    """Print each measured figure beside its theory; returns the summary's figures."""
    theory = theory_collectives(args, t, dp)
    wire = tp_wire_bytes(counted, t)
    split, repl = params_per_rank(args, t)
    param_bytes = tensor_bytes(model.parameters())
    es = DTYPES[args.dtype].itemsize
    dtype = DTYPES[args.dtype]
    flat = torch.cat(
        [p.detach().reshape(-1) for p in model.parameters() if not hasattr(p, "tp_dim")]
    )
    # of replicated parameters across TP ranks: 0 if they stayed equal
    hi, lo = (
        all_reduce(flat.clone(), tp_group, op) for op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN)
    )
    spread = (hi - lo).abs().max().item()
    d.log(
        f"{'collective per step (op/axis/phase)':36s} {'calls':>5s} {'theory':>6s} "
        f"{'elements':>9s} "
        f"{'theory':>9s} {'bytes handed':>12s} {'theory':>9s} {'ring sends (theory)':>19s}"
    )
    for k in sorted(set(counted) | set(theory)):
        m, th = counted.get(k, [0, 0, 0]), theory.get(k, [0, 0, 0, 0])
        d.log(
            f"{k:36s} {m[0]:5d} {th[0]:6d} {m[1]:9d} {th[1]:9d} {m[2]:12d} {th[2]:9d} {th[3]:19d}"
        )
    b = args.batch_size // dp
    T = args.seq_len
    D = args.d_model
    d.log(f"theory: {FORMULA}; b*s*h = {b}*{T}*{D} elements")
    d.log(
        f"TP all-gather / reduce-scatter / send bytes on the wire per phase {wire} (from the bytes "
        "handed, "
        "a collective's by its ring algorithm: --overlap's and the plain SP path's are to be equal)"
    )

    def saved_by(block, x):  # bytes autograd saves for backward in one forward of `block` on x
        with SavedActivations() as saved:
            block(x.detach().requires_grad_())
        return saved.bytes

    # one block's saved activations, sharded vs an unsharded common.Block on the same (b, T, D)
    # batch
    x = torch.randn(b, T, D, dtype=dtype, device=d.device)
    # (b, T/t, D)
    mine = x.chunk(t, 1)[dist.get_rank(tp_group)].contiguous() if args.sequence_parallel else x
    block_saved = saved_by(model.blocks[0], mine)
    block_full = saved_by(
        Block(GPTConfig.from_args(args)).to(d.device, dtype).train(model.training), x
    )
    d.log(
        f"activations saved per block {block_saved} B, unsharded block {block_full} B, ratio "
        f"{block_saved / block_full:.3f} (1/t = {1 / t:.3f}: every saved tensor sharded, as with "
        "SP)"
    )
    d.log(
        f"parameters per rank {param_bytes} B (theory split/t + replicated = {(split + repl) * es} "
        f"B), full model {full_bytes} B, ratio {param_bytes / full_bytes:.3f} (1/t = {1 / t:.3f}); "
        f"replicated params spread across TP ranks {spread:.1e}"
    )
    return dict(
        tp=t,
        dp=dp,
        sequence_parallel=args.sequence_parallel,
        overlap=args.overlap,
        collectives_per_step=counted,
        tp_wire_bytes=wire,
        collectives_per_step_theory=theory,
        param_bytes_per_rank=param_bytes,
        param_bytes_per_rank_theory=(split + repl) * es,
        param_bytes_full_model=full_bytes,
        replicated_param_spread_across_tp=spread,
        activation_bytes_saved=acts,
        activation_bytes_per_block=block_saved,
        activation_bytes_per_block_unsharded=block_full,
        theory_formula=FORMULA,
    )


def summarize(d, args, run, model, opt, tp_group, comm, saved):
    """The technique's own peak first, each measured figure beside its theory, then --check."""
    peak = peak_memory_bytes(d, state_bytes(model, opt) + saved.bytes)
    t = dist.get_world_size(tp_group)
    # the unsharded model main sliced, built again from the same seed: its bytes and sizes
    full = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    full_bytes = tensor_bytes(full.parameters())
    figures = report(
        d, args, model, tp_group, comm.table(), full_bytes, saved.bytes, t, d.world // t
    )
    check = (
        check_against_reference(d, args, run.losses, gather_full(model, tp_group, full))
        if args.check
        else None
    )
    run.finish("megatron_tp", peak, comm.total(), check, figures)


def gather_full(model, group, full):
    """For --check: the unsharded model as {common.GPT name: tensor}: split parameters all-gathered,
    the fused attn.qkv, rank-major [q_0; k_0; v_0; q_1; ...], split back into q, k and v, and the
    padding cut off (each tensor to its size in `full`, the unsharded common.GPT)."""
    t, out = dist.get_world_size(group), {}
    for name, p in model.named_parameters():
        w = p.detach()
        if hasattr(p, "tp_dim"):
            w = all_gather(w, p.tp_dim, group)  # (.., t * n, ..): the padding, if any, at the end
        if ".qkv." in name:  # (t * 3 * D/t, ..) -> 3 x (D, ..)
            for part, w_i in zip("qkv", rearrange(w, "(t n o) ... -> n (t o) ...", t=t, n=3)):
                out[name.replace(".qkv.", f".{part}.")] = w_i
        else:
            out[name] = w
    sizes = {name: p.shape for name, p in full.named_parameters()}
    return {name: w[tuple(slice(n) for n in sizes[name])].clone() for name, w in out.items()}


if __name__ == "__main__":
    main()
