r"""context_parallel.py: context parallelism: each rank holds T/cp tokens of every sequence, in
every layer.

Data parallelism splits the batch, tensor parallelism the matrices, a pipeline the layers; context
parallelism splits the *sequence*. The embedding (at the tokens' global positions), LayerNorms,
MLPs, head and loss work per token, so they run on a rank's T/cp tokens alone; attention is where
tokens meet, the one place where ranks exchange anything: keys and values. The weights stay whole on
every rank; a rank's gradient is its tokens' share of the global loss's, and one all-reduce over dp
x cp sums them. Three attentions, one answer:

  allgather  gather K and V of the whole sequence once per layer; backward reduce-scatters dK/dV to their
             owners (the form Llama 3 trains with, Dubey et al. 2024): simple, but K/V memory x cp
  ring       K/V blocks go round the ring by batch_isend_irecv while the block in hand is computed, partial
             softmaxes merged by their log-sum-exp; backward runs the ring the other way, a dK/dV
             accumulator travelling with each block (Liu, Zaharia, Abbeel 2023, "Ring Attention with
             Blockwise Transformers for Near-Infinite Context"). Blocks that the causal mask hides
             are skipped.
  ulysses    all-to-all from sequence-sharded to head-sharded, attention over the whole sequence for H/cp
             heads, all-to-all back (Jacobs et al. 2023, "DeepSpeed Ulysses"); cp must divide the
             heads

The split, T = 16, cp = 4 (c0 .. c7: 2cp chunks of T/2cp tokens):
    --layout contiguous   rank 0: t0-t3    rank 1: t4-t7    rank 2: t8-t11   rank 3: t12-t15
    --layout zigzag       rank 0: c0 c7    rank 1: c1 c6    rank 2: c2 c5    rank 3: c3 c4
The ring, contiguous: rank r's queries (rows) against rank s's keys (columns). At step j rank r
holds block s = r - j, sends it on to r + 1 and receives block r - j - 1 from r - 1. \ the diagonal
block (causal mask), # a whole block, . hidden by the mask: skipped, not computed.
              s=0 s=1 s=2 s=3
        r=0    \   .   .   .        contiguous: rank r computes r + 1 of the cp blocks (rank 3: 4x rank 0)
        r=1    #   \   .   .        zigzag: the diagonal, then half a block per other rank, so every rank
        r=2    #   #   \   .        computes the same cp blocks (Brandon et al. 2023, "Striped Attention",
        r=3    #   #   #   \        balance the ring so; the chunks are Llama 3's and Megatron-Core's)
Groups come from one grid, arange(world).view(dp, cp): a row is a sequence's cp group (neighbours:
one node), a column a data-parallel group.

    python context_parallel.py --check                                           # cp = 1: no exchange
    torchrun --nproc_per_node=4 context_parallel.py --check                      # ring, zigzag, cp = 4
    torchrun --nproc_per_node=4 context_parallel.py --attention ulysses --check
    torchrun --nproc_per_node=4 context_parallel.py --cp 2 --dp 2 --layout contiguous --dtype float64 --check
In production, use torch.distributed.tensor.experimental.context_parallel, or Megatron-Core's.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
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
    gather_rows,
    parse_args,
    peak_memory_bytes,
    state_bytes,
)


@dataclass
class Args(CommonArgs):
    cp: int = 0  # context-parallel degree: ranks that share each sequence (0 = world / dp)
    dp: int = 0  # data-parallel degree: replicas, each with batch / dp sequences (0 = world / cp)
    # how a sequence's ranks exchange K and V
    attention: Literal["allgather", "ring", "ulysses"] = "ring"
    # rank r holds chunk r of cp, or r and 2cp-1-r of 2cp
    layout: Literal["contiguous", "zigzag"] = "zigzag"


# ---------------------------------------------------------------------- the split of every sequence
def chunk_ids(rank, cp, zigzag):
    """The chunks of every sequence that rank `rank` of cp holds. Contiguous: chunk r of cp.
    Zig-zag: chunks r and 2cp-1-r of 2cp, an early one and a late one, so that under the causal mask
    all ranks do equal work."""
    return [rank, 2 * cp - 1 - rank] if zigzag else [rank]


def check_split(T, cp, zigzag, heads=None, what=("T =", "heads =", "cp =")):
    """What the split and the attentions rely on, raised before any exchange (else gloo aborts, NCCL
    hangs): T tokens in cp equal chunks (zig-zag: 2cp); for Ulysses, heads that cp divides. That
    every rank holds as many tokens (as shard_sequence cuts them), no rank can see alone. `what`
    names T, heads and cp in the error: check_args gives the flags' names."""
    n = 2 * cp if zigzag else cp
    if T % n:
        raise ValueError(
            f"{what[0]} {T} is not divisible by {'2 x ' * zigzag}cp = {n}: {T} tokens do not "
            f"cut into {n} equal chunks; use {what[0]} {(T // n + 1) * n} (divisible by {n})"
        )
    if heads is not None and heads % cp:
        raise ValueError(
            f"{what[1]} {heads} is not divisible by {what[2]} {cp}: ulysses gives each of cp = "
            f"{cp} ranks whole heads, {heads} heads do not split; use a multiple of {cp} heads, or "
            "ring / allgather attention"
        )


def shard_sequence(x, rank, cp, zigzag, dim=1):
    """(.., T, ..) whole sequences -> (.., T/cp, ..) this rank's tokens, its chunks in sequence
    order."""
    check_split(x.shape[dim], cp, zigzag)
    chunks = x.chunk(2 * cp if zigzag else cp, dim)
    return torch.cat([chunks[c] for c in chunk_ids(rank, cp, zigzag)], dim)


def positions(rank, cp, zigzag, seq_len, device=None):
    """(T/cp,) the global positions of this rank's tokens, for the position embedding and the causal
    mask."""
    return shard_sequence(torch.arange(seq_len, device=device), rank, cp, zigzag, 0)


def reorder(x, cp, zigzag, dim, to_sequence=True):
    """(.., T, ..) every rank's tokens, rank 0's first (as a gather or an all-to-all leaves them) ->
    the sequence's own order; to_sequence=False: back. Contiguous: the two orders are one."""
    ranked = [c for r in range(cp) for c in chunk_ids(r, cp, zigzag)]  # chunk ids, in rank order
    have, want = (ranked, sorted(ranked)) if to_sequence else (sorted(ranked), ranked)
    pieces = dict(zip(have, x.chunk(len(have), dim)))
    return torch.cat([pieces[c] for c in want], dim)


# ----------------------------------------------------------------------------- all-gather attention
class GatherSequence(torch.autograd.Function):
    """All-gather forward; backward reduce-scatter: the gradients every rank computed for its
    gathered copy of rank j's tokens are summed onto rank j (each rank's queries looked at them)."""

    @staticmethod
    def forward(ctx, x, group):  # (..) this rank's -> (cp, ..) every rank's, rank j's at [j]
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group), *x.shape)
        # flat: any backend
        dist.all_gather_single(out.view(-1), x.contiguous().view(-1), group=group)
        return out

    @staticmethod
    # (cp, ..) every rank's share of the gradient -> (..) their sum, for my tokens
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[1:])
        dist.reduce_scatter_single(out.view(-1), grad.contiguous().view(-1), group=ctx.group)
        return out, None


def allgather_attention(q, k, v, group, zigzag):
    """Causal attention of this rank's queries q (B, H, t, E), t = T/cp, over the keys and values of
    the whole sequence, gathered once: every rank holds, and saves for backward, K and V of all T
    tokens."""
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    check_split(cp * q.shape[2], cp, zigzag)
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # (cp, 2, B, H, t, E): every rank's tokens
    kv = GatherSequence.apply(torch.stack([k, v]), group)
    # (2, B, H, T, E) in order
    kv = reorder(rearrange(kv, "n s b h t e -> s b h (n t) e"), cp, zigzag, 3)
    T = kv.shape[3]
    # (t, T) causal
    sees = positions(r, cp, zigzag, T, q.device)[:, None] >= torch.arange(T, device=q.device)
    return F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=sees)  # (B, H, t, E)


# ----------------------------------------------------------------------------- ring attention
def attend(q, k, v, causal):
    """Exact attention of queries q (B, H, tq, E) over one block of keys and values (B, H, tk, E):
    the output (B, H, tq, E) and each query's log-sum-exp over the block (B, H, tq), by which
    partial results merge. `causal`: the diagonal block (tq = tk), query i sees keys <= i. Softmax
    in float32 at least (as flash)."""
    acc = torch.promote_types(q.dtype, torch.float32)
    s = q.to(acc) @ k.to(acc).transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, tq, tk)
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    lse = s.logsumexp(-1)  # (B, H, tq)
    return torch.exp(s - lse[..., None]) @ v.to(acc), lse


def merge(out, lse, block_out, block_lse):
    """Online softmax (Milakov & Gimelshein 2018, as ring attention merges its blocks): two
    attentions over disjoint sets of keys, each normalised over its own set -> the attention over
    their union, each weighted by its share exp(lse_i - lse) of the total exp-sum. (B, H, tq, E) and
    (B, H, tq) each."""
    new = torch.logaddexp(lse, block_lse)
    return out * torch.exp(lse - new)[..., None] + block_out * torch.exp(block_lse - new)[
        ..., None
    ], new


def attend_backward(q, k, v, dout, lse, delta, causal):
    """One block's gradients from every query's *final* log-sum-exp (so exp(s - lse) is this block's
    share of the softmax over all keys) and delta = rowsum(dout * out): flash attention's backward,
    block by block (Dao et al. 2022, "FlashAttention", App. B). Returns dq (B, H, tq, E), dk and dv
    (B, H, tk, E)."""
    scale = q.shape[-1] ** -0.5
    q, k, v, dout = (x.to(lse.dtype) for x in (q, k, v, dout))
    s = q @ k.transpose(-2, -1) * scale  # (B, H, tq, tk), recomputed rather than saved
    if causal:
        s = s.masked_fill(torch.ones_like(s[0, 0], dtype=torch.bool).triu(1), float("-inf"))
    p = torch.exp(s - lse[..., None])  # the probabilities; 0 where masked
    ds = p * (dout @ v.transpose(-2, -1) - delta[..., None])  # back through the softmax
    return ds @ k * scale, ds.transpose(-2, -1) @ q * scale, p.transpose(-2, -1) @ dout


def ring_block(rank, src, cp, zigzag, t):
    """The part of (this rank's queries) x (rank src's keys) that causal attention needs, as (query
    rows, key rows, causal), or None when the mask hides all of it: skipped. t: tokens per rank.
    Zig-zag (chunks r, 2cp-1-r): src < rank, every query against src's early chunk (its late one
    follows both of mine); src > rank, only my late chunk, against both of src's. Half a block each:
    cp blocks on every rank."""
    whole, half = slice(None), t // 2
    # zig-zag too: my two chunks are in sequence order, so a causal mask over t is right
    if src == rank:
        return whole, whole, True
    if not zigzag:
        return (whole, whole, False) if src < rank else None
    return (whole, slice(0, half), False) if src < rank else (slice(half, None), whole, False)


def ring_exchange(send, group, to, frm):
    """Start sending the named tensors `send` to rank `to` of `group` and receiving as many (same
    names and shapes) from `frm`, in one batch_isend_irecv: paired, so that on NCCL no send waits on
    a receive posted later. Returns (received by name, wait); read them after wait(). On a GPU
    waiting makes the compute stream wait, not the host, so the block computed meanwhile overlaps
    the transfer."""
    got = {name: torch.empty_like(x) for name, x in send.items()}
    ops = [dist.P2POp(dist.isend, x, group=group, group_peer=to) for x in send.values()]
    ops += [dist.P2POp(dist.irecv, x, group=group, group_peer=frm) for x in got.values()]
    reqs = dist.batch_isend_irecv(ops) if ops else []
    return got, lambda: [req.wait() for req in reqs]


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, keys and values coming round
    the ring a block at a time (Liu et al. 2023, Sec. 3)."""

    @staticmethod
    def forward(ctx, q, k, v, group, zigzag):  # q, k, v (B, H, t, E): this rank's tokens
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        # kv (2, B, H, t, E): the block that travels
        kv = torch.stack([k, v])
        out = None
        lse = None
        for step in range(cp):
            src = (r - step) % cp  # whose keys and values we hold: our own, then r-1's, r-2's, ...
            if step < cp - 1:  # 1. pass them on to r+1, and take r-1's, while we compute
                got, wait = ring_exchange({"kv": kv}, group, to=(r + 1) % cp, frm=(r - 1) % cp)
            block = ring_block(r, src, cp, zigzag, q.shape[2])
            # 2. attend to this block, merge (step 0 is the diagonal: every row has it)
            if block is not None:
                rows, cols, causal = block
                k_b, v_b = kv[:, :, :, cols]  # (B, H, tk, E) each
                o, l = attend(q[:, :, rows], k_b, v_b, causal)
                if out is None:
                    out, lse = o, l
                else:
                    out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], o, l)
            if step < cp - 1:  # 3. the next block has arrived
                wait()
                kv = got["kv"]
        # (B, H, t, E) stored as (B, t, H, E), as flash attention stores it: the output projection's
        # b t (h e) is then a view of it, not a copy that would be saved a second time
        out = out.to(q.dtype).transpose(1, 2).contiguous().transpose(1, 2)
        # (B, H, t, E) x 4 and (B, H, t): 1/cp of the sequence's
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.zigzag = group, zigzag
        return out

    @staticmethod
    def backward(ctx, dout):  # (B, H, t, E)
        q, k, v, out, lse = ctx.saved_tensors
        group, zigzag = ctx.group, ctx.zigzag
        cp, r = dist.get_world_size(group), dist.get_rank(group)
        delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, H, t)
        dq = torch.zeros_like(q, dtype=lse.dtype)

        # adds my queries' part to dq; returns their dK/dV (2, B, H, t, E) for src
        def grads_from(src, kv):
            dkv = torch.zeros_like(kv, dtype=lse.dtype)
            block = ring_block(r, src, cp, zigzag, q.shape[2])
            if block is not None:  # the forward's blocks: the hidden ones cost nothing here either
                rows, cols, causal = block
                k_b, v_b = kv[:, :, :, cols]
                dq_b, dk_b, dv_b = attend_backward(
                    q[:, :, rows],
                    k_b,
                    v_b,
                    dout[:, :, rows],
                    lse[:, :, rows],
                    delta[:, :, rows],
                    causal,
                )
                dq[:, :, rows] += dq_b
                dkv[:, :, :, cols] += torch.stack([dk_b, dv_b])  # (2, B, H, tk, E)
            return dkv

        # The forward's ring run the other way (the adjoint of "send to r+1" is "receive from r+1"):
        # blocks go to r-1, so rank r sees its own, then r+1's, ..., r-1's. Block s's dK/dV
        # accumulator starts at rank s-1 and travels with the block, each rank adding its queries'
        # share, back to s on the last hop.
        kv = torch.stack([k, v])
        own = None
        acc = None
        for step in range(cp):
            src = (r + step) % cp
            # 1. the block, to r-1, who needs it next step
            send = {"kv": kv} if step < cp - 1 else {}
            if acc is not None:
                send["dkv"] = acc  # block src-1's accumulator (done last step), to its next visitor
            got, wait = ring_exchange(send, group, to=(r - 1) % cp, frm=(r + 1) % cp)
            dkv = grads_from(src, kv)  # 2. while they travel
            wait()
            if step == 0:
                # my queries' share of my own block's gradient: kept here, added at the end
                own = dkv
            else:  # 3. src's accumulator came from r+1 (none yet at step 1): add my share
                acc = dkv + got["dkv"] if "dkv" in got else dkv
            kv = got.get("kv")
        if cp > 1:  # the last hop: every accumulator goes home, holding all the other ranks' shares
            got, wait = ring_exchange({"dkv": acc}, group, to=(r - 1) % cp, frm=(r + 1) % cp)
            wait()
            own = own + got["dkv"]
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None


def ring_attention(q, k, v, group, zigzag):
    check_split(dist.get_world_size(group) * q.shape[2], dist.get_world_size(group), zigzag)
    return RingAttention.apply(q, k, v, group, zigzag)


# ----------------------------------------------------------------------------- Ulysses attention
class AllToAll(torch.autograd.Function):
    """(cp, ..) chunk j to rank j, and chunk j of the result from rank j. Its own adjoint: the
    gradient of what rank j received from me is sent back to me by the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, x = group, x.contiguous()
        out = torch.empty_like(x)  # of a contiguous x: empty_like keeps a permuted view's strides
        dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group), None


def ulysses_attention(q, k, v, group, zigzag):
    """Causal attention of this rank's tokens (B, H, t, E): an all-to-all trades my tokens of every
    head for every token of my H/cp heads, attention runs over the whole sequence for those heads,
    and a second all-to-all trades back (Jacobs et al. 2023, Sec. 3.1). Rank j takes heads [j H/cp,
    (j+1) H/cp)."""
    cp = dist.get_world_size(group)
    check_split(cp * q.shape[2], cp, zigzag, heads=q.shape[1])
    if cp == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    # chunk j: rank j's heads
    qkv = rearrange(torch.stack([q, k, v]), "s b (n h) t e -> n s b h t e", n=cp)
    # (cp, 3, B, H/cp, t, E): chunk j = rank j's tokens of my heads
    qkv = AllToAll.apply(qkv, group)
    # (3, B, H/cp, T, E)
    qkv = reorder(rearrange(qkv, "n s b h t e -> s b h (n t) e"), cp, zigzag, 3)
    y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)  # (B, H/cp, T, E)
    # j: rank j's tokens
    y = rearrange(reorder(y, cp, zigzag, 2, False), "b h (n t) e -> n b h t e", n=cp)
    y = AllToAll.apply(y, group)  # (cp, B, H/cp, t, E): chunk j = my tokens of rank j's heads
    return rearrange(y, "n b h t e -> b (n h) t e")  # (B, H, t, E)


ATTENTIONS = {
    "allgather": allgather_attention,
    "ring": ring_attention,
    "ulysses": ulysses_attention,
}


# --------------------------------------------------------------------------- the GPT on T/cp tokens
class ContextParallelAttention(nn.Module):
    """common.Attention (q, k, v, proj) on this rank's T/cp tokens: the same projections, per token,
    around one of the three attentions."""

    def __init__(self, attn, group, attention, zigzag):
        super().__init__()
        self.q = attn.q
        self.k = attn.k
        self.v = attn.v
        self.proj = attn.proj
        self.drop = attn.drop
        self.n_heads = attn.n_heads
        self.group = group
        self.attention = attention
        self.zigzag = zigzag

    def forward(self, x):  # (B, t, D) this rank's tokens
        q, k, v = (
            rearrange(f(x), "b t (h e) -> b h t e", h=self.n_heads)
            for f in (self.q, self.k, self.v)
        )
        y = ATTENTIONS[self.attention](q, k, v, self.group, self.zigzag)  # (B, H, t, E)
        return self.drop(self.proj(rearrange(y, "b h t e -> b t (h e)")))  # (B, t, D)


class ContextParallelGPT(nn.Module):
    """common.GPT on this rank's T/cp tokens of every sequence: the GPT's own modules (same names
    and weights: only the activations are split), embedding at global positions, each block's
    attention swapped."""

    def __init__(self, gpt, group, attention, zigzag):
        super().__init__()
        self.group, self.zigzag = group, zigzag
        self.tok_emb = gpt.tok_emb
        self.pos_emb = gpt.pos_emb
        self.drop = gpt.drop
        self.blocks = gpt.blocks
        self.ln_f, self.head = gpt.ln_f, gpt.head
        for block in self.blocks:
            block.attn = ContextParallelAttention(block.attn, group, attention, zigzag)

    def forward(self, idx):  # (B, t) token ids: this rank's tokens of every sequence
        cp, r = dist.get_world_size(self.group), dist.get_rank(self.group)
        pos = positions(r, cp, self.zigzag, cp * idx.shape[1], idx.device)  # (t,) global positions
        h = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, t, D)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # (B, t, V): logits of this rank's tokens


def sync_gradients(params, group=None):
    """Sum the gradients over the dp x cp ranks (here the world): each rank holds the gradient of
    its tokens' share of the global batch's loss, so the sum is the whole batch's, on every rank."""
    grads = [p.grad for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (P,): one all-reduce for the whole model
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(summed.view_as(g))


def check_args(args, world):
    """Bad input: one line and exit 2, on every rank, before any collective. Returns (dp, cp)."""
    check_common_args(args)
    if args.cp < 0 or args.dp < 0:
        fail(
            f"--cp and --dp must be >= 0 (0 = the rest of the world), got --cp {args.cp} --dp "
            f"{args.dp}"
        )
    cp = args.cp or world // max(args.dp, 1)
    dp = args.dp or world // max(cp, 1)
    if dp * cp != world or cp < 1:
        fail(
            f"world size {world} != dp {dp} x cp {cp}: launch dp x cp processes, or give --cp / "
            "--dp that divide the world"
        )
    try:  # the cores' own check, their ValueError as fail's one line
        # only ulysses splits the heads
        heads = args.n_heads if args.attention == "ulysses" else None
        flags = ("--seq-len", "--n-heads", "--cp")
        check_split(args.seq_len, cp, args.layout == "zigzag", heads, flags)
    except ValueError as e:
        fail(str(e))
    if args.batch_size % dp:
        fail(
            f"--batch-size {args.batch_size} is not divisible by --dp {dp}: use --batch-size "
            f"{(args.batch_size // dp + 1) * dp}"
        )
    if args.dropout:
        fail(
            f"--dropout {args.dropout}: context_parallel.py trains without dropout (one query's "
            "attention probabilities are spread over cp ranks); use --dropout 0"
        )
    return dp, cp


def main():
    args = parse_args(Args)
    dp, cp = check_args(args, env_world_size())
    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    # cp innermost: a sequence's ranks are neighbours (one node)
    grid = torch.arange(d.world).view(dp, cp)
    cp_groups = [
        dist.new_group(row.tolist()) for row in grid
    ]  # every rank makes every group, in one order
    dp_rank, cp_rank = divmod(d.rank, cp)  # my row and column of the grid
    cp_group = cp_groups[dp_rank]
    b = args.batch_size // dp
    zigzag = args.layout == "zigzag"
    data = MarkovData(args.vocab, args.seed)
    d.log(
        f"context_parallel.py --attention {args.attention} --layout {args.layout}: world {d.world} "
        f"= dp {dp} x cp {cp} on {d.backend}, a rank holds {args.seq_len // cp} of the "
        f"{args.seq_len} tokens of {b} sequences; entropy floor {data.entropy:.4f} nats/token"
    )
    # the full model, one seed
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    model = ContextParallelGPT(gpt, cp_group, args.attention, zigzag).to(d.device)
    opt = make_optimizer(model.parameters(), args)
    run, comm = Run(d, args, {"model": model, "optim": opt}), CommCounter(axes={"cp": cp_group})
    saved = SavedActivations()  # what the last step saves for backward, for the peak
    # The log line's loss on a group of its own: on NCCL its own communicator, never queued behind
    # the K/V exchanges and the gradients' all-reduces.
    log_group = dist.new_group()
    for step in run.steps():
        # (B, T) the global batch, on CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # of the whole global batch: every rank's loss divides by it
        # my replica's sequences, then my tokens of each
        mine = slice(dp_rank * b, (dp_rank + 1) * b)
        # (b, T/cp)
        x, y = (shard_sequence(t[mine], cp_rank, cp, zigzag).to(d.device) for t in (x, y))
        with run.watching(step, comm, saved):
            loss = lm_loss(model(x), y, n_tok)  # my tokens' share of the global batch's loss
            opt.zero_grad(set_to_none=True)
            loss.backward()  # attention's backward exchanges dK/dV; the rest is per token
            sync_gradients(list(model.parameters()))
        if args.clip > 0:  # every rank holds the whole gradient now: plain clipping
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        loss = loss.detach()
        dist.all_reduce(loss, group=log_group)  # the global batch's loss, for the log line only
        run.end_step(step, loss.item())

    # before report's unsplit GPT runs
    peak = peak_memory_bytes(d, state_bytes(model, opt) + saved.bytes)
    figures, comm_bytes = report(d, args, model, comm, dp_rank, cp_rank, dp, cp)
    # every rank holds the whole model, under the GPT's own names
    full = dict(model.named_parameters())
    check = check_against_reference(d, args, run.losses, full) if args.check else None
    run.finish("context_parallel", peak, comm_bytes, check, figures)


# --- measurement ---
THEORY = {
    "ring": "2(cp-1) K/V blocks of (b, T/cp, d) forward; as many and 2(cp-1) dK/dV blocks backward",
    "allgather": "K, V of T/cp tokens to the all-gather forward; dK, dV of all T to the "
    "reduce-scatter",
    "ulysses": "Q, K, V and the output, 4 (b, T/cp, d) blocks, to the all-to-all each way",
}
EXTRA = {
    "ring": "",
    "ulysses": " + per layer one (b, T/cp, d): the heads' output beside the tokens'",
    "allgather": " + per layer the other ranks' K, V and the (T/cp, T) mask",
}


class CountBlocks:
    """Inside the `with` block, every call of this module's `attend` (the ring's, one per block it
    computes) appends (query rows, key rows) to `.blocks`, by a wrapper around it: RingAttention is
    unchanged."""

    def __enter__(self):
        self.blocks, self.real = [], globals()["attend"]

        def counted(q, k, v, causal):
            self.blocks.append((q.shape[2], k.shape[2]))
            return self.real(q, k, v, causal)

        globals()["attend"] = counted
        return self

    def __exit__(self, *exc):
        globals()["attend"] = self.real


def report(d, args, model, comm, dp_rank, cp_rank, dp, cp):
    """The last step, watched from outside: bytes handed to the cp group per layer (the
    CommCounter); one more forward of the last batch: the activation bytes it saves for backward,
    beside the unsplit GPT's on the same sequences, and the ring's blocks (layer 0's calls of
    `attend`, which only the ring makes; CountBlocks)."""
    L = args.n_layers
    T = args.seq_len
    D = args.d_model
    b = args.batch_size // dp
    t = args.seq_len // cp
    es = DTYPES[args.dtype].itemsize
    zigzag = args.layout == "zigzag"
    ring = args.attention == "ring"
    x = MarkovData(args.vocab, args.seed).batch(args.steps - 1, args.batch_size, T, args.ragged)[0]
    # (b, T) my replica's sequences
    x = x[dp_rank * b : (dp_rank + 1) * b].contiguous().to(d.device)
    with SavedActivations() as split, CountBlocks() as counted:
        model(shard_sequence(x, cp_rank, cp, zigzag))
    computed = counted.blocks[: len(counted.blocks) // L]  # layer 0's
    # common's GPT on the same b whole sequences: 1/cp of it is the goal
    with SavedActivations() as whole:
        build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)(x)
    mine = [
        comm.total(axis="cp", phase="fwd") // L,
        comm.total(axis="cp", phase="bwd") // L,
        len(computed),
        sum(q * k for q, k in computed),
        split.bytes,
        whole.bytes,
        sum(comm.bytes.values()),
    ]
    rows = [r[0].tolist() for r in gather_rows(d, [mine])]  # one row per rank
    fwd, bwd, blocks, scores, saved, unsplit, total = ([int(v) for v in col] for col in zip(*rows))
    blk, acc_es = (
        b * t * D,
        max(es, 4),
    )  # elements of a (b, T/cp, d) block; the ring's dK/dV: >= float32
    theory = {
        "ring": (2 * (cp - 1) * blk * es, 2 * (cp - 1) * blk * (es + acc_es)),
        "allgather": (2 * blk * es, 2 * cp * blk * es),
        "ulysses": (4 * blk * es, 4 * blk * es),
    }
    theory = theory[args.attention] if cp > 1 else (0, 0)
    extra = (
        {"ring": 0, "ulysses": blk, "allgather": 2 * b * (T - t) * D + t * T}[args.attention]
        * L
        * es
    )
    saved_th = [u // cp + (extra if cp > 1 else 0) for u in unsplit]
    blocks_th = [cp if zigzag else c + 1 for c in range(cp)] if ring else []
    scores_th = (
        [t * t * (cp + 1) // 2 if zigzag else t * t * (c + 1) for c in range(cp)] if ring else []
    )
    d.log(
        "\nlast step, per rank and layer: bytes handed to the cp group (theory: "
        f"{THEORY[args.attention]}),"
        " the ring's blocks and query-key scores computed (theory: contiguous r + 1 blocks, "
        "zigzag cp),"
        " the activation bytes saved for backward (theory: the unsplit GPT's / "
        f"cp{EXTRA[args.attention]})"
    )
    d.log(
        "rank | dp cp | fwd bytes | theory | bwd bytes | theory | blocks | theory | scores | "
        "theory | saved, all layers | theory"
    )
    for r in range(d.world):
        c = r % cp
        ring_cols = [blocks[r], blocks_th[c], scores[r], scores_th[c]] if ring else ["-"] * 4
        d.log(
            f"{r:4d} | {r // cp:2d} {c:2d} | {fwd[r]:9d} | {theory[0]:6d} | {bwd[r]:9d} | "
            f"{theory[1]:6d} | "
            + " | ".join(f"{v:>6}" for v in ring_cols)
            + f" | {saved[r]:17d} | {saved_th[r]:d}"
        )
    figures = dict(
        cp=cp,
        dp=dp,
        attention=args.attention,
        layout=args.layout,
        collectives=comm.table(),
        bytes_per_layer_fwd=fwd,
        bytes_per_layer_bwd=bwd,
        bytes_per_layer_theory=list(theory),
        blocks=blocks,
        blocks_theory=blocks_th,
        scores=scores,
        scores_theory=scores_th,
        saved_activation_bytes=saved,
        saved_activation_bytes_theory=saved_th,
        saved_activation_bytes_unsplit=unsplit,
    )
    return figures, max(total)


if __name__ == "__main__":
    main()
