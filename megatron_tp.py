"""megatron_tp.py: Megatron-LM tensor (intra-layer) model parallelism, every split and collective written out.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using Model
Parallelism" (Sec. 3): each transformer block's matmuls are split across the t ranks of a TP group, so
that a block needs only two all-reduces forward and two backward. Plus --sequence-parallel from
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models" (Sec. 4.2.2):
the LayerNorm / dropout / residual regions are split along the sequence instead of being replicated.

    python megatron_tp.py --check                                     # t = 1: the same code, no communication
    torchrun --nproc_per_node=4 megatron_tp.py --check                # t = 4, the whole world
    torchrun --nproc_per_node=4 megatron_tp.py --sequence-parallel --check
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

Attention is the same pattern over heads: q, k, v column-split, so rank r owns heads [rH/t, (r+1)H/t);
the output projection row-split. The token embedding is split over the vocabulary (each rank looks up the
ids it owns, zeros elsewhere, g sums), and the LM head is column-split over the vocabulary feeding a
cross-entropy that combines max and sum(exp) across ranks: the (B, T, V) logits never exist anywhere.

--sequence-parallel: f / g become all-gather / reduce-scatter along T (a ring all-reduce IS a reduce-scatter
then an all-gather), and LayerNorm, dropout and the residual add run on (B, T/t, D) chunks:

    (B,T/t,D) -LN-> all-gather T -> [column .. row] -> reduce-scatter T -> (B,T/t,D) -dropout, + residual->

The column layers keep only the (B, T/t, D) chunk for backward and all-gather it again there (Sec. 4.2.2),
so every activation a block saves is 1/t of the unsharded block's, at the price of one more all-gather.

Groups come from one grid, arange(world).view(dp, tp): a row is a TP group (adjacent ranks, one node), a
column a data-parallel group.
In production, use Megatron-Core (megatron.core.tensor_parallel) or torch.distributed.tensor.parallel.
"""
import math
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (DTYPES, IGNORE, Block, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig,
                    init_dist, make_optimizer, MarkovData)
from harness import (check_against_reference, check_common_args, Checkpointer, CommonArgs, env_world_size,
                     log_step, maybe_fail, parse_args, peak_memory_bytes, SavedActivations, state_bytes,
                     StepTimer, tensor_bytes, write_summary)


@dataclass
class Args(CommonArgs):
    tp: int = 0  # tensor-parallel degree t (0 = the whole world); data parallel over world / t
    sequence_parallel: bool = False  # split LayerNorm / dropout regions along the sequence (Korthikanti et al.)


# ----------------------------------------------------------------------------- collectives (counted by COMM, below)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_reduce(x, group, phase, op=dist.ReduceOp.SUM):  # in place, any shape
    if dist.get_world_size(group) > 1:  # a group of one: nothing to say (t = 1 or dp = 1)
        COMM.add("all_reduce", group, phase, x, x)
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x, dim, group, phase):  # (.., n, ..) local -> (.., t*n, ..) replicated, rank r's chunk r-th
    t = dist.get_world_size(group)
    if t == 1:
        return x
    out = torch.empty(t * x.numel(), dtype=x.dtype, device=x.device)  # flat: every backend takes 1-D
    local = x.contiguous().view(-1)
    COMM.add("all_gather", group, phase, out, local)
    _all_gather_flat(out, local, group=group)
    return torch.cat(out.view(t, *x.shape).unbind(0), dim)


def reduce_scatter(x, dim, group, phase):  # (.., t*n, ..) partial sums -> (.., n, ..) summed, chunk r
    t = dist.get_world_size(group)
    if t == 1:
        return x
    whole = torch.stack(x.chunk(t, dim)).contiguous()  # (t, .., n, ..): slot r goes to rank r
    out = torch.empty(whole.shape[1:], dtype=x.dtype, device=x.device)
    COMM.add("reduce_scatter", group, phase, whole, whole)
    _reduce_scatter_flat(out.view(-1), whole.view(-1), group=group)
    return out


# ----------------------------------------------------------------------------- the conjugate operators
class ColumnParallelGEMM(torch.autograd.Function):
    """Y_i = X W_i^T + b_i for one or more column-parallel layers reading the same X (attention's q, k, v:
    Megatron fuses them into one GEMM), with the operator that opens the TP region built in:

      plain TP  Megatron-LM's f (Sec. 3): identity forward, all-reduce backward. Every rank multiplies the
                same X by its own shards, so its dL/dX is a partial sum that backward adds up.
      SP        Korthikanti et al.'s g (Sec. 4.2.2): all-gather X along T forward, reduce-scatter dL/dX
                backward (each rank keeps its own T/t rows of the sum). Only this rank's (B, T/t, D) chunk
                is saved; backward all-gathers it again for the weight gradients, so the saved activation
                is 1/t of X, as every other saved tensor of the block (Megatron-Core overlaps that
                re-gather with the dL/dX GEMM; here it simply runs first)."""

    @staticmethod
    def forward(ctx, x, group, sp, *params):  # x (B, T, D) replicated, or (B, T/t, D) chunk; params w0, b0, ..
        ctx.group, ctx.sp = group, sp
        weights, biases = params[0::2], params[1::2]
        ctx.has_bias = [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)  # under SP: the chunk, not the gathered X
        full = all_gather(x, 1, group, "fwd") if sp else x  # (B, T, D)
        return tuple(F.linear(full, w, b) for w, b in zip(weights, biases))  # each (B, T, out_i/t) local

    @staticmethod
    def backward(ctx, *grads):  # each (B, T, out_i/t)
        x, *weights = ctx.saved_tensors
        full = all_gather(x, 1, ctx.group, "bwd") if ctx.sp else x  # (B, T, D): the re-gather
        dx = sum(g @ w for g, w in zip(grads, weights))  # (B, T, D) partial: through this rank's shards only
        dx = reduce_scatter(dx, 1, ctx.group, "bwd") if ctx.sp else all_reduce(dx, ctx.group, "bwd")
        dparams = []
        for g, has_bias in zip(grads, ctx.has_bias):
            dparams += [g.flatten(0, -2).T @ full.flatten(0, -2), g.flatten(0, -2).sum(0) if has_bias else None]
        return dx, None, None, *dparams  # dW_i (out_i/t, D), db_i (out_i/t)


class g(torch.autograd.Function):
    """Megatron-LM's g, f's conjugate: all-reduce forward, identity backward. It closes a TP region: the
    row-parallel partial products are summed; the gradient of a sum reaches every term unchanged."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, D) partial -> summed, replicated
        return all_reduce(x.clone(), group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ReduceScatterSeq(torch.autograd.Function):
    """Korthikanti et al.'s g-bar, replacing g: reduce-scatter along T forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):  # (B, T, D) partial -> (B, T/t, D) summed chunk
        ctx.group = group
        return reduce_scatter(x, 1, group, "fwd")

    @staticmethod
    def backward(ctx, grad):  # (B, T/t, D) -> (B, T, D): every position's gradient, for every rank's shard
        return all_gather(grad, 1, ctx.group, "bwd"), None


class GatherLastDim(torch.autograd.Function):
    """ColumnParallelLinear(gather_output=True): all-gather the feature shards; backward keeps its own."""

    @staticmethod
    def forward(ctx, x, group):  # (.., n/t) -> (.., n)
        ctx.group = group
        return all_gather(x, -1, group, "fwd")

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), -1)[dist.get_rank(ctx.group)].contiguous(), None


class SplitLastDim(torch.autograd.Function):
    """RowParallelLinear(input_is_parallel=False): keep this rank's feature slice; backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):  # (.., n) replicated -> (.., n/t)
        ctx.group = group
        return x.chunk(dist.get_world_size(group), -1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather(grad, -1, ctx.group, "bwd"), None


def exit_tp(x, group, sp):  # out of it: g, or under SP reduce-scatter the sequence
    return ReduceScatterSeq.apply(x, group) if sp else g.apply(x, group)


# ----------------------------------------------------------------------------- parallel layers
def shard(full, dim, group):
    """This rank's slice of a full tensor along `dim`, as a Parameter, zero-padded to a multiple of t (only
    the vocabulary ever needs it). Marked with tp_dim so clipping and gathering know it is split."""
    t, n = dist.get_world_size(group), full.shape[dim]
    if n % t:
        pad = list(full.shape)
        pad[dim] = -n % t
        full = torch.cat([full, full.new_zeros(pad)], dim)
    p = nn.Parameter(full.detach().chunk(t, dim)[dist.get_rank(group)].clone())
    p.tp_dim, p.tp_full = dim, n
    return p


class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W's output features split (the paper's "A split along its columns": A = W^T).

        W (out, in)               rank r holds W_r (out/t, in) and b_r (out/t)
        +---------------+
        |  W_0  rank 0  |         Y_r = f(X) W_r^T + b_r : (B, T, out/t), this rank's output features
        +---------------+
        |  W_1  rank 1  |         gather_output: all-gather the slices -> (B, T, out) replicated
        +---------------+
    """

    def __init__(self, weight, bias, group, gather_output=False, sequence_parallel=False):
        super().__init__()
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.group, self.gather_output, self.sp = group, gather_output, sequence_parallel

    @classmethod
    def from_full(cls, linear, group, gather_output=False, sequence_parallel=False):
        bias = None if linear.bias is None else shard(linear.bias, 0, group)
        return cls(shard(linear.weight, 0, group), bias, group, gather_output, sequence_parallel)

    def forward(self, x, *shared):
        """x: (B, T, in) replicated, or (B, T/t, in) this rank's chunk under SP. `shared`: other column layers
        reading the same x (attention's k and v beside q), computed behind the same f / all-gather; their
        outputs follow this layer's."""
        layers = (self, *shared)
        ys = ColumnParallelGEMM.apply(x, self.group, self.sp, *[p for l in layers for p in (l.weight, l.bias)])
        if self.gather_output:  # each (B, T, out/t) local -> (B, T, out) replicated
            ys = tuple(GatherLastDim.apply(y, self.group) for y in ys)
        return ys if shared else ys[0]


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W's input features split (the paper's "A split along its rows"):

        W (out, in)
        +---------+---------+     rank r holds W_r (out, in/t); the bias (out) is replicated
        |   W_0   |   W_1   |
        +---------+---------+     Y = g(X_0 W_0^T + X_1 W_1^T) + b : one all-reduce sums the partial
        X = [ X_0 | X_1 ]         products; the bias is added once, after it (else it would count t times)
    X_r is (B, T, in/t): a column layer's output (input_is_parallel) or sliced here from a replicated X.
    """

    def __init__(self, weight, bias, group, input_is_parallel=True, sequence_parallel=False):
        super().__init__()
        self.register_parameter("weight", weight)
        self.register_parameter("bias", bias)
        self.group, self.input_is_parallel, self.sp = group, input_is_parallel, sequence_parallel

    @classmethod
    def from_full(cls, linear, group, input_is_parallel=True, sequence_parallel=False):
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # replicated
        return cls(shard(linear.weight, 1, group), bias, group, input_is_parallel, sequence_parallel)

    def forward(self, x):  # (B, T, in/t) local, or (B, T, in) replicated without input_is_parallel
        if not self.input_is_parallel:
            x = SplitLastDim.apply(x, self.group)  # (B, T, in/t) local
        y = exit_tp(F.linear(x, self.weight), self.group, self.sp)  # (B, T, out) summed; SP: (B, T/t, out)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The token table split over the vocabulary: rank r owns ids [r V_pad/t, (r+1) V_pad/t), where V_pad
    rounds V up to a multiple of t with rows no id ever reaches. Each rank looks up the ids it owns and
    writes zeros for the others; exactly one rank holds each row, so g's sum is the full lookup.

        E (V_pad, D) = [ rows of rank 0 ; rows of rank 1 ; ... ]      E_r (V_pad/t, D)
    """

    def __init__(self, weight, group, sequence_parallel=False):
        super().__init__()
        self.weight, self.group, self.sp = weight, group, sequence_parallel
        self.start = dist.get_rank(group) * weight.shape[0]

    @classmethod
    def from_full(cls, embedding, group, sequence_parallel=False):
        return cls(shard(embedding.weight, 0, group), group, sequence_parallel)

    def forward(self, idx):  # (B, T) global token ids
        local = idx - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])  # (B, T): ids this rank owns
        e = F.embedding(torch.where(mine, local, 0), self.weight)  # (B, T, D) local rows
        e = e.masked_fill(~mine[..., None], 0.0)  # others' ids: zero output and zero gradient to row 0
        return exit_tp(e, self.group, self.sp)  # (B, T, D) replicated, or (B, T/t, D) chunk under SP


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from logits split over the vocabulary (Megatron-LM Sec. 3: fuse the output
    GEMM with the loss). loss = log sum_v exp(z_v - m) - (z_target - m), with m the global max; the three
    numbers per token (m, z_target - m, sum exp) are combined across ranks by three all-reduces of N values
    instead of an all-gather of N * V logits. Backward is local: dL/dz = softmax(z) - onehot(target)."""

    @staticmethod
    def forward(ctx, logits, target, vocab, group):  # logits (N, V_pad/t) local, target (N,) global ids
        n_local = logits.shape[-1]
        start = dist.get_rank(group) * n_local
        padded = torch.arange(start, start + n_local, device=logits.device) >= vocab  # (V_pad/t,)
        z = logits.masked_fill(padded, float("-inf"))  # padded entries get probability 0: never predicted
        m = z.max(-1).values  # (N,)
        all_reduce(m, group, "fwd", op=dist.ReduceOp.MAX)  # 1. global max, for a stable exp
        z = z - m[:, None]
        mine = (target >= start) & (target < start + n_local)  # (N,) this rank holds the target's logit
        local_t = torch.where(mine, target - start, 0)
        picked = torch.where(mine, z.gather(1, local_t[:, None])[:, 0], 0.0)
        all_reduce(picked, group, "fwd")  # 2. z_target - m, from whichever rank holds it
        e = z.exp()  # (N, V_pad/t)
        sum_e = e.sum(-1)
        all_reduce(sum_e, group, "fwd")  # 3. sum of exp over the whole vocabulary
        valid = target != IGNORE
        ctx.save_for_backward(e / sum_e[:, None], local_t, mine & valid, valid)
        return torch.where(valid, sum_e.log() - picked, 0.0)  # (N,), identical on every TP rank

    @staticmethod
    def backward(ctx, grad):  # (N,)
        softmax, local_t, hit, valid = ctx.saved_tensors
        d = softmax.clone()  # (N, V_pad/t) this rank's slice of softmax - onehot
        d[torch.arange(d.shape[0], device=d.device), local_t] -= hit.to(d.dtype)
        return d * (grad * valid)[:, None], None, None, None


def vocab_parallel_cross_entropy(logits, target, vocab, group):
    return VocabParallelCrossEntropy.apply(logits, target, vocab, group)


# ----------------------------------------------------------------------------- dropout RNG
class RNGTracker:
    """Megatron's RNG states tracker (Megatron-LM Sec. 3; megatron.core.tensor_parallel.random): two RNG
    streams. The default one drives dropout in replicated regions: seeded the same on every TP rank of a
    replica, so the replicated activations (and parameters) stay identical. fork() switches to a second
    stream, seeded per TP rank, for dropout inside TP regions, where each rank holds different heads (or,
    under SP, different positions) and same masks would correlate. Both streams differ across replicas."""

    def __init__(self, device, seed, dp_rank, tp_rank):
        self.device = device
        base = 100_003 * seed + 7_919 * dp_rank + 1
        torch.manual_seed(base)  # the default stream: same across TP ranks
        self.tp_state = torch.Generator(device=device).manual_seed(base + 2_718 + 1 + tp_rank).get_state()

    def _get(self):
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state):
        torch.cuda.set_rng_state(state, self.device) if self.device.type == "cuda" else torch.set_rng_state(state)

    @contextmanager
    def fork(self, active=True):
        if not active:
            yield
            return
        saved = self._get()
        self._set(self.tp_state)
        try:
            yield
        finally:
            self.tp_state = self._get()
            self._set(saved)

    def dropout(self, x, p, training, tp_region):
        if not training or p == 0:
            return x
        with self.fork(tp_region):
            return F.dropout(x, p)

    def state_dict(self):  # the checkpointer saves the default stream; this is the other one
        return {"tp_state": self.tp_state}

    def load_state_dict(self, state):
        self.tp_state = state["tp_state"].cpu()


# ----------------------------------------------------------------------------- the sharded GPT
class ParallelAttention(nn.Module):
    """common.Attention with heads split: q, k, v column-parallel (rank r owns heads [rH/t, (r+1)H/t), as the
    features are head-major), proj row-parallel. q's forward runs k and v behind the same f (Megatron fuses
    them into one GEMM), so the block has one all-reduce forward (proj's g) and one backward (this f)."""

    def __init__(self, full, group, sp, tracker):
        super().__init__()
        self.q, self.k, self.v = (ColumnParallelLinear.from_full(lin, group, sequence_parallel=sp)
                                  for lin in (full.q, full.k, full.v))
        self.proj = RowParallelLinear.from_full(full.proj, group, input_is_parallel=True, sequence_parallel=sp)
        self.heads, self.p = full.n_heads // dist.get_world_size(group), full.p
        self.group, self.sp, self.tracker = group, sp, tracker

    def forward(self, x):  # (B, T, D) replicated, or (B, T/t, D) chunk under SP
        q, k, v = (rearrange(y, "b t (h e) -> b h t e", h=self.heads)
                   for y in self.q(x, self.k, self.v))  # (B, H/t, T, E) this rank's heads, biases included
        with self.tracker.fork(self.training and self.p > 0):  # attention dropout: inside the TP region
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        y = self.proj(rearrange(y, "b h t e -> b t (h e)"))  # (B, T, D/t) local -> (B, T, D) or (B, T/t, D)
        return self.tracker.dropout(y, self.p, self.training, tp_region=self.sp)


class ParallelMLP(nn.Module):
    """common.MLP as column-then-row: f, fc shard, GeLU, proj shard, g (Megatron-LM Fig. 3a)."""

    def __init__(self, full, group, sp, tracker):
        super().__init__()
        self.fc = ColumnParallelLinear.from_full(full.fc, group, sequence_parallel=sp)
        self.proj = RowParallelLinear.from_full(full.proj, group, input_is_parallel=True, sequence_parallel=sp)
        self.p, self.sp, self.tracker = full.drop.p, sp, tracker

    def forward(self, x):  # (B, T, D) replicated, or (B, T/t, D) under SP
        y = self.proj(F.gelu(self.fc(x)))  # fc: (B, T, 4D/t) local; proj: back to x's shape, summed
        return self.tracker.dropout(y, self.p, self.training, tp_region=self.sp)


class ParallelBlock(nn.Module):
    def __init__(self, full, group, sp, tracker):
        super().__init__()
        self.ln1, self.attn = full.ln1, ParallelAttention(full.attn, group, sp, tracker)  # LayerNorms replicated
        self.ln2, self.mlp = full.ln2, ParallelMLP(full.mlp, group, sp, tracker)

    def forward(self, x):  # (B, T, D) replicated, or (B, T/t, D): LN and residual act on the chunk
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelGPT(nn.Module):
    """common.GPT sharded: built from the full model (one seed), so any t starts from the same numbers.
    Parameter names are common.GPT's, so a gathered state dict compares with the reference by name."""

    def __init__(self, full, group, sp, tracker):
        super().__init__()
        self.tok_emb = VocabParallelEmbedding.from_full(full.tok_emb, group, sp)
        self.pos_emb = full.pos_emb  # replicated: seq_len x D is small
        self.blocks = nn.ModuleList(ParallelBlock(b, group, sp, tracker) for b in full.blocks)
        self.ln_f = full.ln_f
        self.head = ColumnParallelLinear.from_full(full.head, group, sequence_parallel=sp)  # untied, no bias
        self.p, self.group, self.sp, self.tracker = full.cfg.dropout, group, sp, tracker

    def forward(self, idx):  # (B, T) global ids -> (B, T, V_pad/t) logits, this rank's vocabulary slice
        h = self.tok_emb(idx)  # (B, T, D) replicated, or (B, T/t, D) chunk under SP
        first = dist.get_rank(self.group) * h.shape[1] if self.sp else 0  # this chunk's first position
        h = h + self.pos_emb(torch.arange(first, first + h.shape[1], device=idx.device))
        h = self.tracker.dropout(h, self.p, self.training, tp_region=self.sp)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # head: f (or all-gather T) then (B, T, V_pad/t) local


# ----------------------------------------------------------------------------- gradients and clipping
def is_split(p):
    return hasattr(p, "tp_dim")


def flat_all_reduce(tensors, group):
    """One all-reduce of many tensors through a flat buffer (a single bucket)."""
    if dist.get_world_size(group) == 1 or not tensors:
        return
    flat = all_reduce(torch.cat([t.reshape(-1) for t in tensors]), group, "step")
    for t, v in zip(tensors, flat.split([t.numel() for t in tensors])):
        t.copy_(v.view_as(t))


def sync_grads(model, sp, tp_group, dp_group):
    params = list(model.parameters())
    if sp:  # 1. replicated parameters (LN, row biases, positions) saw only this rank's T/t positions:
        flat_all_reduce([p.grad for p in params if not is_split(p)], tp_group)  # sum them (Korthikanti 4.2.2)
    # 2. data parallel: each replica's loss is divided by the *global* token count, so the SUM over the dp
    #    group is the full-batch gradient (the average of the usual per-replica mean-loss gradients).
    flat_all_reduce([p.grad for p in params], dp_group)


def global_grad_norm(model, tp_group):
    """The norm of the whole model's gradient: squares of split parameters summed over the TP group (each
    rank holds a different piece), replicated ones added once (every TP rank holds the same copy)."""
    params = list(model.parameters())
    split = sum(p.grad.pow(2).sum() for p in params if is_split(p))
    all_reduce(split, tp_group, "step")
    return (split + sum(p.grad.pow(2).sum() for p in params if not is_split(p))).sqrt()


def gather_full(model, group):
    """The unsharded model as {common.GPT name: tensor}: split parameters all-gathered, padding cut off."""
    out = {}
    for name, p in model.named_parameters():
        w = all_gather(p.detach(), p.tp_dim, group, "end").narrow(p.tp_dim, 0, p.tp_full) if is_split(p) else p
        out[name] = w.detach().clone()
    return out


# --- measurement ---
# Counters, closed forms and the summary, apart so that the technique above reads without them.
class Comm:
    """Counts every collective of this file per 'op/axis/phase': calls, elements of the full-size tensor (the
    paper's unit: b*s*h for a block's all-reduce; the un-split tensor of an all-gather or reduce-scatter), and
    the bytes of the tensors this rank hands to the collective, read off them at the call (an all-reduce's
    tensor, an all-gather's local chunk, a reduce-scatter's whole input). A counter only: each collective
    still names its group where it is called."""

    def __init__(self):
        self.axis, self.calls, self.elems, self.bytes = {}, Counter(), Counter(), Counter()

    def add(self, op, group, phase, whole, handed):  # whole: the full-size tensor; handed: this rank's input
        key = f"{op}/{self.axis.get(id(group), 'tp')}/{phase}"
        self.calls[key] += 1
        self.elems[key] += whole.numel()
        self.bytes[key] += handed.numel() * handed.element_size()

    def reset(self):
        self.calls, self.elems, self.bytes = Counter(), Counter(), Counter()

    def table(self):
        return {k: [self.calls[k], self.elems[k], self.bytes[k]] for k in sorted(self.calls)}


COMM = Comm()


def replicated_spread(model, group):
    """max |a - b| of any replicated parameter between TP ranks: 0 when they stayed identical."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters() if not is_split(p)])
    hi = all_reduce(flat.clone(), group, "end", dist.ReduceOp.MAX)
    lo = all_reduce(flat.clone(), group, "end", dist.ReduceOp.MIN)
    return (hi - lo).abs().max().item()


def saved_bytes_per_block(block, x):
    """Bytes autograd saves for backward in one forward of `block` on x, counted by SavedActivations."""
    with SavedActivations() as saved:
        block(x.detach().requires_grad_())
    return saved.bytes


def params_per_rank(args, t):
    """Closed form: (split elements on one rank, replicated elements)."""
    D, L, V_pad = args.d_model, args.n_layers, math.ceil(args.vocab / t) * t
    # q, k, v; attention proj; fc weight + bias; MLP proj; token embedding and LM head
    split = L * (3 * D * D + D * D + 4 * D * D + 4 * D + 4 * D * D) + 2 * V_pad * D
    repl = L * (2 * 2 * D + D + D) + args.seq_len * D + 2 * D  # ln1, ln2, two row biases; positions; ln_f
    return split // t, repl


RING = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}  # ring algorithm: sends = RING * (n-1)/n * whole


def theory_collectives(args, t, dp):
    """What one step must hand to collectives, from the shapes alone: {op/axis/phase: [calls, elements,
    bytes handed, ring bytes sent]}. Per layer (Megatron-LM Sec. 3): 2 all-reduces forward (attention's and
    the MLP's g) and 2 backward (their f), each of b*s*h elements; under SP each becomes an all-gather +
    reduce-scatter pair of the same size, plus one all-gather backward per column layer, the re-gather of
    its saved chunk (Korthikanti Sec. 4.2.2). Plus: embedding g forward, head f backward, the loss's 3
    all-reduces of b*s, the norm; SP adds one bucket of replicated grads. Bytes handed: an all-reduce's
    tensor, an all-gather's 1/n chunk, a reduce-scatter's whole input. Ring bytes sent per rank (the ring
    algorithm's formula, never measured here): all-reduce 2(n-1)/n, all-gather, reduce-scatter (n-1)/n."""
    b, s, h, L = args.batch_size // dp, args.seq_len, args.d_model, args.n_layers
    es = DTYPES[args.dtype].itemsize
    ce_es = 4 if args.dtype == "bfloat16" else es  # the loss runs in float32 for bfloat16
    split, repl = params_per_rank(args, t)
    table = {}

    def add(op, axis, phase, calls, n, size):  # `calls` collectives of n elements of `size` bytes each
        group = t if axis == "tp" else dp
        c = table.setdefault(f"{op}/{axis}/{phase}", [0, 0, 0, 0])
        c[0], c[1] = c[0] + calls, c[1] + calls * n
        c[2] += calls * (n // group if op == "all_gather" else n) * size
        c[3] += calls * (RING[op] * (group - 1) * n * size // group)

    if t > 1:
        if args.sequence_parallel:
            for op, phase in [("all_gather", "fwd"), ("reduce_scatter", "fwd"), ("reduce_scatter", "bwd"),
                              ("all_gather", "bwd")]:
                add(op, "tp", phase, 2 * L + 1, b * s * h, es)  # per layer 2; + LM head / embedding
            add("all_gather", "tp", "bwd", 2 * L + 1, b * s * h, es)  # the re-gathers: qkv, fc, LM head
            add("all_reduce", "tp", "step", 1, repl, es)  # replicated grads, partial over positions
        else:
            add("all_reduce", "tp", "fwd", 2 * L + 1, b * s * h, es)  # per layer 2 g; + embedding g
            add("all_reduce", "tp", "bwd", 2 * L + 1, b * s * h, es)  # per layer 2 f; + LM head f
        add("all_reduce", "tp", "fwd", 3, b * s, ce_es)  # the loss: max, target logit, sum of exp
        if args.clip > 0:
            add("all_reduce", "tp", "step", 1, 1, es)  # the gradient norm
    if dp > 1:
        add("all_reduce", "dp", "step", 1, split + repl, es)  # gradients
        add("all_reduce", "dp", "step", 1, 1, ce_es)  # the loss, for the log line
    return dict(sorted(table.items()))


def report(d, args, model, tp_group, counted, full_bytes, acts, t, dp):
    """Print each measured figure beside its theory; returns the summary's figures."""
    theory = theory_collectives(args, t, dp)
    split, repl = params_per_rank(args, t)
    param_bytes, es = tensor_bytes(model.parameters()), DTYPES[args.dtype].itemsize
    spread = replicated_spread(model, tp_group)
    d.log(f"{'collective per step (op/axis/phase)':36s} {'calls':>5s} {'theory':>6s} {'elements':>9s} "
          f"{'theory':>9s} {'bytes handed':>12s} {'theory':>9s} {'ring sends (theory)':>19s}")
    for k in sorted(set(counted) | set(theory)):
        m, th = counted.get(k, [0, 0, 0]), theory.get(k, [0, 0, 0, 0])
        d.log(f"{k:36s} {m[0]:5d} {th[0]:6d} {m[1]:9d} {th[1]:9d} {m[2]:12d} {th[2]:9d} {th[3]:19d}")
    d.log(f"theory per layer: 2 all-reduces forward + 2 backward of b*s*h = {args.batch_size // dp}*{args.seq_len}*"
          f"{args.d_model} elements (SP: as many all-gather + reduce-scatter pairs, + 1 re-gather per column "
          f"layer); ring sends per rank, a formula: all-reduce 2(n-1)/n, all-gather / reduce-scatter (n-1)/n")
    # one block's saved activations, sharded vs an unsharded common.Block on the same (b, T, D) batch
    b, T, D = args.batch_size // dp, args.seq_len, args.d_model
    x = torch.randn(b, T, D, dtype=DTYPES[args.dtype], device=d.device)
    mine = x.chunk(t, 1)[dist.get_rank(tp_group)].contiguous() if args.sequence_parallel else x  # (b, T/t, D) SP
    block_saved = saved_bytes_per_block(model.blocks[0], mine)
    full_block = Block(GPTConfig.from_args(args)).to(d.device, DTYPES[args.dtype]).train(model.training)
    block_full = saved_bytes_per_block(full_block, x)
    d.log(f"activations saved per block {block_saved} B, unsharded block {block_full} B, ratio "
          f"{block_saved / block_full:.3f} (1/t = {1 / t:.3f}: every saved tensor sharded, as with SP)")
    d.log(f"parameters per rank {param_bytes} B (theory split/t + replicated = {(split + repl) * es} B), full model "
          f"{full_bytes} B, ratio {param_bytes / full_bytes:.3f} (1/t = {1 / t:.3f}); replicated params spread "
          f"across TP ranks {spread:.1e}")
    return dict(tp=t, dp=dp, sequence_parallel=args.sequence_parallel, collectives_per_step=counted,
                collectives_per_step_theory=theory, param_bytes_per_rank=param_bytes,
                param_bytes_per_rank_theory=(split + repl) * es, param_bytes_full_model=full_bytes,
                replicated_param_spread_across_tp=spread, activation_bytes_saved=acts,
                activation_bytes_per_block=block_saved, activation_bytes_per_block_unsharded=block_full,
                theory_formula="per layer 2 all-reduce fwd + 2 bwd of b*s*h (SP: AG+RS pairs + 1 AG re-gather per "
                               "column layer); + embedding g, head f, 3 loss all-reduces of b*s, norm; bytes handed: "
                               "AR tensor, AG chunk, RS input; ring sends AR 2(n-1)/n, AG/RS (n-1)/n")


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    world = env_world_size()
    check_common_args(args)
    if args.tp < 0:
        fail(f"--tp must be >= 0 (0 = the whole world), got {args.tp}")
    t = args.tp or world
    if world % t:
        fail(f"world size {world} is not divisible by --tp {args.tp}: use a --tp that divides {world} (or 0 = all)")
    dp = world // t
    if args.n_heads % t:
        fail(f"--n-heads {args.n_heads} is not divisible by the TP degree {t}: each rank needs whole heads")
    if 4 * args.d_model % t:  # implied by the heads check while the MLP is 4x; kept for a copier who changes it
        fail(f"MLP width 4 x --d-model = {4 * args.d_model} is not divisible by the TP degree {t}")
    if args.sequence_parallel and args.seq_len % t:
        fail(f"--sequence-parallel needs --seq-len {args.seq_len} divisible by the TP degree {t}")
    if args.batch_size % dp:
        fail(f"--batch-size {args.batch_size} is not divisible by the data-parallel degree {dp} (= world / tp)")

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    grid = torch.arange(d.world).view(dp, t)  # rows: TP groups (adjacent ranks); columns: DP groups
    tp_groups = [dist.new_group(row) for row in grid.tolist()]  # every rank creates every group, same order
    dp_groups = [dist.new_group(col) for col in grid.T.tolist()]
    dp_rank, tp_rank = divmod(d.rank, t)
    tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
    COMM.axis.update({id(tp_group): "tp", id(dp_group): "dp"})
    d.log(f"megatron_tp.py: world {d.world} = dp {dp} x tp {t} on {d.backend}, sequence parallel "
          f"{args.sequence_parallel}, entropy floor {data.entropy:.4f} nats/token")

    # --- the model: the full GPT from one seed, on the CPU; sliced there, and only the slices go to the device ---
    tracker = RNGTracker(d.device, args.seed, dp_rank, tp_rank)
    full = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])  # CPU
    full_bytes = tensor_bytes(full.parameters())
    model = ParallelGPT(full, tp_group, args.sequence_parallel, tracker).to(d.device)  # shards + replicated
    del full
    opt = make_optimizer(model.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": model, "optim": opt, "rng": tracker})
    losses = hist.get("losses", [])
    timer, b, acts, counted = StepTimer(d.device), args.batch_size // dp, 0, {}
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        COMM.reset()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor on every rank
        x, y = x[dp_rank * b:(dp_rank + 1) * b].to(d.device), y[dp_rank * b:(dp_rank + 1) * b].to(d.device)
        with SavedActivations() as saved:
            logits = model(x)  # (b, T, V_pad/t) this rank's vocabulary slice
            if logits.dtype == torch.bfloat16:
                logits = logits.float()  # as common.lm_loss: softmax in low precision loses small probabilities
            token_losses = vocab_parallel_cross_entropy(logits.flatten(0, 1), y.flatten(), args.vocab, tp_group)
            loss = token_losses.sum() / n_tok  # (b*T,) per token, identical on every TP rank -> this replica's piece
        acts = max(acts, saved.bytes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        sync_grads(model, args.sequence_parallel, tp_group, dp_group)
        if args.clip > 0:
            clip_grads_([p.grad for p in model.parameters()], global_grad_norm(model, tp_group), args.clip)
        opt.step()
        global_loss = all_reduce(loss.detach().clone(), dp_group, "step").item()  # sum of the replicas' pieces
        counted = COMM.table()
        losses.append(global_loss)
        log_step(d, step, global_loss, timer.stop(), args.batch_size * args.seq_len)
        ckpt.maybe_save(step + 1, {"model": model, "optim": opt, "rng": tracker}, {"losses": losses})

    # --- summary: the technique's own peak first, then each measured figure beside its theory, then --check ---
    peak = peak_memory_bytes(d, state_bytes(model, opt) + acts)
    figures = report(d, args, model, tp_group, counted, full_bytes, acts, t, dp)
    check = check_against_reference(d, args, losses, gather_full(model, tp_group)) if args.check else None
    tokens_per_s = args.batch_size * args.seq_len / max(timer.median(), 1e-9) * 1e3
    write_summary(d, args, "megatron_tp", losses, timer.median(), tokens_per_s, peak,
                  sum(c[2] for c in counted.values()), check, figures)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
