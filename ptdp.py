"""ptdp.py: PTD-P, pipeline x tensor x data parallelism with the interleaved 1F1B schedule, plus
context parallelism and a sharded optimizer: the four axes Llama 3 405B trained on (Dubey et al.
2024, Sec. 3.3).

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
(SC 2021). Four ways to split one GPT, composed on one grid of ranks:

    grid = torch.arange(world).view(pp, dp, cp, tp)     e.g. pp 2 x dp 1 x cp 2 x tp 2 = 8 ranks:
                         tp 0  tp 1
      pp 0  dp 0  cp 0 [   0     1  ]   chunks 0 and 2 (v = 2): embedding + blocks 0, 2; tokens of
                  cp 1 [   2     3  ]     zig-zag chunks {0, 3} on cp 0, {1, 2} on cp 1
      pp 1  dp 0  cp 0 [   4     5  ]   chunks 1 and 3: ... blocks 1, 3 + final norm + head + loss
                  cp 1 [   6     7  ]
    a TP group is a row, grid[i, j, c, :]  adjacent ranks, one node: two all-reduces per layer and pass
    a CP group is grid[i, j, :, k]         one sequence's tokens: K/V round a ring, per layer and pass
    a DP x CP group is grid[i, :, :, k]    the same shard of the same chunks: its gradients summed (ZeRO-1:
                                           reduce-scattered, optimizer state sharded) once per batch
    a pipeline is grid[:, j, c, k]         point-to-point activations forward, gradients backward
Why this order (Megatron-Core's, tp-cp-dp-pp): TP sends the most, two all-reduces of every
activation per layer that nothing overlaps, so it gets the fastest links; CP next, a K/V block per
layer that can overlap the block's attention; DP once per batch; PP least, one activation per
micro-batch and chunk: it may cross nodes.

1. Tensor parallel (Megatron-LM, Shoeybi et al. 2019, Sec. 3), innermost, so a TP group sits inside
   a node
   where links are fastest (the PTD-P paper's Takeaway #1): q, k, v and the MLP's fc are split by
   output features (column-parallel; rank k owns heads k*H/t .. (k+1)*H/t - 1), both output
   projections by input features (row-parallel). f (identity forward, all-reduce backward) opens
   each split region and g (all-reduce forward, identity backward) closes it. LayerNorms, the
   row-parallel biases, the embedding and the head are replicated over the TP group (megatron_tp.py
   shows the vocab-parallel head).
2. Context parallel (--cp; Liu et al. 2023, "Ring Attention"; Llama 3 Sec. 3.3.2): every sequence is
   cut into
   2cp chunks and CP rank r holds chunks r and 2cp-1-r (zig-zag: an early and a late one, so under
   the causal mask every rank does equal work) through the whole model: every tensor between layers
   is (b, T/cp, D), the positions are the rank's own. Only attention looks across tokens: inside
   each TP rank's heads, K/V blocks go round the CP group's ring, cp - 1 hops, each block's partial
   attention merged by its log-sum-exp; the backward recomputes the ring and sends each dK/dV block
   back the way it came. A CP rank holds the same weights as its DP peers; its loss covers its
   tokens, divided by the global token count as everywhere.
3. Pipeline parallel: the n_layers blocks are cut into p*v chunks of equal size. Rank i of a
   pipeline holds
   the v non-contiguous chunks i, i+p, i+2p, ... (the paper's "virtual stages"), so a micro-batch
   visits every rank v times and the bubble shrinks v-fold: (p-1)/(v*m) of the ideal compute time.
   The schedule is Megatron's interleaved 1F1B: warm-up forwards, then one forward and one backward
   in turn, then the cool-down backwards, then a flush; with v = 1 it is plain 1F1B
   (PipeDream-flush). Forwards run in groups of p micro-batches per chunk, so like Megatron we
   require m to be a multiple of p when v > 1. Picture, p = 2, v = 2, m = 4 (capitals: a rank's
   first chunk, lower case: its second; B takes twice F's time; idle ".."), the ideal timeline that
   ideal_timeline() computes (the run draws the measured one):

      rank 0  F0F1f0f1F2..b0b0F3b1b1f2B0B0f3B1B1..b2b2..b3b3B2B2B3B3      idle 3 slots per 24 busy
      rank 1  ..F0F1f0b0b0f1b1b1F2B0B0F3B1B1f2b2b2f3b3b3B2B2B3B3....      = (p-1)/(v*m) = 1/8
    v = 1, the same work per micro-batch (a rank's one chunk holds both layers: F two slots, B
    four):
      rank 0  F0F0F1F1........B0B0B0B0F2F2B1B1B1B1F3F3B2B2B2B2....B3B3B3B3  idle 6 per 24 busy
      rank 1  ....F0F0B0B0B0B0F1F1B1B1B1B1F2F2B2B2B2B2F3F3B3B3B3B3........  = (p-1)/m = 1/4
   The price: (v*p-1)*m messages per direction instead of (p-1)*m, and more chunks in flight on
   early ranks. schedule() for r = 0, p = 2, v = 2, m = 4 (warm-up 4), chunk = global index l*p + r
   of local chunk l:
        k                              0  1  2  3  4  5  6  7
        forward chunk  (k%pv)//p*p+r   0  0  2  2  0  0  2  2
        micro-batch    k//pv*p + k%p   0  1  0  1  2  3  2  3
        backward chunk (v-1-l)*p+r     2  2  0  0  2  2  0  0     (l = k%pv//p, the forward's local chunk)
        ops  F0 F1 f0 f1 | F2 b0 F3 b1 f2 B0 f3 B1 | b2 b3 B2 B3   (capitals chunk 0, lower case chunk 2)
4. Data parallel: each replica runs its pipelines on its slice of the global batch; after the flush
   the
   gradients are summed over the dp x cp ranks holding the same chunk shard, once per batch:
   all-reduced, or with --zero 1 (ZeRO-1, Rajbhandari et al. 2020; Megatron's distributed optimizer)
   reduce-scattered, each rank updating only its 1/(dp cp) of the flat parameters with its share of
   AdamW's state, then all-gathering them. The gradients are clipped by the norm of the whole model,
   every piece counted once: TP-split pieces where they live, TP-replicated ones on TP rank 0, the
   pp ranks' disjoint chunks, of the dp x cp copies one (rank 0 of the group), or each shard where
   it lives: one all-reduce of two numbers over the world, which also sums the loss.

Messages: each activation and gradient is one tensor in a batch_isend_irecv, posted at the moment of
the ideal timeline that comm_plan() gives it, so that no batch waits on a later one (NCCL deadlocks
otherwise; the tests simulate it). Measured from outside, each beside its theory: every F and B, the
bubble, chunks in flight and saved activations alive, messages and bytes sent, bytes per axis (tp,
cp, pp, dp), model state and optimizer-state bytes per rank; an ASCII timeline.

Run (--dp 0 = world / (pp * cp * tp); --pp 1 runs the other three axes, its "pipeline" one rank):
    torchrun --nproc_per_node=2 ptdp.py --pp 2 --virtual-stages 2 --dtype float64 --check
    torchrun --nproc_per_node=8 ptdp.py --pp 2 --tp 2 --dp 2 --virtual-stages 2 --dtype float64 --check
    torchrun --nproc_per_node=8 ptdp.py --pp 2 --dp 2 --cp 2 --zero 1 --dtype float64 --check
    torchrun --nproc_per_node=4 ptdp.py --pp 4 --n-layers 8 --microbatches 8 --virtual-stages 2 \\
        --stage-ms 50 --steps 2
The zero-bubble schedules (ZB-H1, ZB-V) are zero_bubble.py. In production, use Megatron-Core, or
torch.distributed.pipelining (ScheduleInterleaved1F1B) with DTensor TP.
"""

import collections
import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (
    DTYPES,
    GPT,
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
    CommonArgs,
    Run,
    check_common_args,
    env_world_size,
    parse_args,
)


@dataclass
class Args(CommonArgs):
    pp: int = 2  # pipeline-parallel degree p (ranks per pipeline)
    tp: int = 1  # tensor-parallel degree t (innermost: adjacent ranks)
    dp: int = 0  # data-parallel degree (0 = world / (pp * cp * tp))
    cp: int = 1  # context-parallel degree: sequences split over cp ranks (zig-zag), K/V in a ring
    zero: int = 0  # 1: ZeRO-1, AdamW's state and update sharded over the dp x cp ranks
    virtual_stages: int = 1  # v: model chunks per pipeline rank (1 = plain 1F1B)
    microbatches: int = 4  # m: micro-batches per replica and batch (a multiple of --pp when v > 1)
    trace: str = ""  # write the measured F/B events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute time: a chunk's F waits stage_ms/v ms, B twice that


# ---------------------------------------------------------------- tensor parallel: f, g, the layers
class f(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. It opens a TP region: every rank
    multiplies the same X by its own shard, so each rank's dL/dX is a partial sum, completed
    here."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    # (b, T, D) partial -> summed over the TP group: f's backward is g's forward
    @staticmethod
    def backward(ctx, grad):
        return g.forward(None, grad, ctx.group), None


class g(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum the row-parallel partial products), identity
    backward."""

    @staticmethod
    def forward(ctx, x, group):  # (b, T, D) partial -> summed, replicated
        x = x.clone()  # a new tensor: autograd's tensors are not ours to change in place
        if dist.get_world_size(group) > 1:  # a group of one (t = 1): nothing to add
            dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def check_split(n, k, what, by):
    """The cores' check that `by` = k divides `what` = n; check_args's too, with the flags'
    names."""
    if n % k:
        raise ValueError(f"{what} {n} is not divisible by {by} = {k}: use a multiple of {k}")


def tp_dim(name):
    """The dimension of GPT parameter `name` split over the TP group (None: replicated).
    Column-parallel weights (out, in) split dim 0, with their biases; row-parallel ones split dim 1,
    their bias is whole."""
    if name.endswith(
        ("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight", "mlp.fc.bias")
    ):
        return 0
    return 1 if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else None


class TPBlock(nn.Module):
    """common.Block with Megatron's split, keeping its parameter names; its own forward: f, local
    matmuls, g. Split parameters are marked `tp_split` (the clipping norm counts them on every TP
    rank).

        q, k, v, fc  (out, in) = [W_0; W_1; ..]  rows: rank k computes its heads / its 4D/t hidden features
        proj         (out, in) = [W_0 | W_1 ..]  columns: rank k's partial product; g sums, then the bias"""

    def __init__(self, full, group, cp_group=None):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        check_split(full.attn.n_heads, t, "heads", "t")
        for name, part in full.named_children():  # ln1, attn, ln2, mlp: the block's own, shared
            self.add_module(name, part)
        for name, w in list(self.named_parameters()):
            if tp_dim(name) is not None:
                owner, leaf = name.rsplit(".", 1)
                shard = nn.Parameter(w.detach().chunk(t, tp_dim(name))[r].clone())
                shard.tp_split = True
                setattr(self.get_submodule(owner), leaf, shard)
        self.group = group
        self.heads = full.attn.n_heads // t
        self.cp_group = cp_group  # None: no context parallelism

    def forward(self, x):  # (b, T, D) replicated on the TP group
        a = self.attn
        mlp = self.mlp
        grp = self.group
        h = f.apply(self.ln1(x), grp)
        # (b, H/t, T, E) each: this rank's heads
        q, k, v = (
            rearrange(lin(h), "b t (h e) -> b h t e", h=self.heads) for lin in (a.q, a.k, a.v)
        )
        # CP: T is this rank's T/cp tokens; the others' K/V of these heads come round the CP ring
        if self.cp_group:
            y = RingAttention.apply(q, k, v, self.cp_group)  # (b, H/t, T, E)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = rearrange(y, "b h t e -> b t (h e)")  # (b, T, D/t)
        x = x + g.apply(F.linear(y, a.proj.weight), grp) + a.proj.bias  # bias after g: added once
        # (b, T, 4D/t) local
        h = F.gelu(mlp.fc(f.apply(self.ln2(x), grp)))
        # (b, T, D) replicated
        return x + g.apply(F.linear(h, mlp.proj.weight), grp) + mlp.proj.bias


# --------------------------------------------------------------- context parallel: the zig-zag ring
def zigzag(x, cp, r, dim=1):
    """(.., T, ..) whole sequences -> (.., T/cp, ..) CP rank r's tokens: chunks r and 2cp-1-r of
    2cp, an early one and a late one, so that under the causal mask every rank does the same work
    (Llama 3, Sec. 3.3.2)."""
    if cp == 1:
        return x  # one rank holds whole sequences, in order
    check_split(x.shape[dim], 2 * cp, "tokens", "2 x cp")
    pieces = x.chunk(2 * cp, dim)
    return torch.cat([pieces[r], pieces[-1 - r]], dim)  # chunks r and 2cp-1-r


class Pass(torch.autograd.Function):
    """One step of the ring: x to rank r+1 of the group, rank r-1's in, paired in one
    batch_isend_irecv (NCCL safe). Its adjoint runs the ring backwards: the gradient of what came
    from r-1 goes back to r-1."""

    @staticmethod
    def forward(ctx, x, group, step=1):  # x (2, b, H/t, T/cp, E): a block of keys and values
        cp = dist.get_world_size(group)
        r = dist.get_rank(group)
        got = torch.empty_like(x)
        ctx.group = group
        for req in dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, x.contiguous(), group=group, group_peer=(r + step) % cp),
                dist.P2POp(dist.irecv, got, group=group, group_peer=(r - step) % cp),
            ]
        ):
            req.wait()
        return got

    @staticmethod
    def backward(ctx, grad):
        return Pass.forward(ctx, grad, ctx.group, -1), None, None


def attend(q, k, v, causal=False):
    """Attention of q (b, h, tq, E) over one block k, v (b, h, tk, E): (output, log-sum-exp (b, h,
    tq, 1))."""
    s = q @ k.mT * q.shape[-1] ** -0.5  # (b, h, tq, tk)
    # the diagonal block: my two chunks are in sequence order, so a causal mask over T/cp is right
    if causal:
        s = s + torch.full_like(s[0, 0], float("-inf")).triu(1)  # -inf above the diagonal
    lse = s.logsumexp(-1, keepdim=True)
    return torch.exp(s - lse) @ v, lse


def ring(q, k, v, group):
    """CP rank r's queries (b, h, T/cp, E) over the whole sequence (Liu et al. 2023, "Ring
    Attention"): cp - 1 steps pass the K/V block on, each block's result merged by its log-sum-exp
    (online softmax). Zig-zag: all my queries see src < r's early chunk (not its late one); only my
    late chunk sees src > r's two."""
    cp = dist.get_world_size(group)
    r = dist.get_rank(group)
    half = q.shape[2] // 2
    # softmax in float32 at least, as flash attention
    acc = torch.promote_types(q.dtype, torch.float32)
    q = q.to(acc)
    kv = torch.stack([k, v]).to(acc)  # (2, b, h, T/cp, E): the block that travels
    out, lse = attend(q, *kv, causal=True)
    for i in range(1, cp):
        kv = Pass.apply(kv, group)  # now holding rank r-i's block
        early = (r - i) % cp < r
        lo = 0 if early else half  # my rows lo.. see it
        o, l = attend(q[:, :, lo:], *(kv[:, :, :, :half] if early else kv))
        # the rows before lo see nothing of it: output 0, log-sum-exp -inf, which the merge below
        # leaves as they were (exactly: logaddexp(x, -inf) = x)
        o = F.pad(o, (0, 0, lo, 0))  # (b, h, T/cp, E)
        l = F.pad(l, (0, 0, lo, 0), value=float("-inf"))  # (b, h, T/cp, 1)
        new = torch.logaddexp(lse, l)  # the union's exp-sum
        out = out * torch.exp(lse - new) + o * torch.exp(l - new)
        lse = new
    return out.to(k.dtype)  # in the inputs' dtype (k: not cast above)


class RingAttention(torch.autograd.Function):
    """ring() saving only q, k, v (b, h, T/cp, E); backward runs it again under autograd and back
    through it (K/V go round twice, each dK/dV block returns one hop per step): recomputation,
    exact."""

    @staticmethod
    def forward(ctx, q, k, v, group):
        cp = dist.get_world_size(group)
        ctx.group = group
        check_split(cp * q.shape[2], 2 * cp, "tokens", "2 x cp")  # zigzag's check, before any send
        ctx.save_for_backward(q, k, v)
        return ring(q, k, v, group)

    @staticmethod
    def backward(ctx, dout):  # (b, h, T/cp, E)
        q, k, v = (x.detach().requires_grad_() for x in ctx.saved_tensors)
        with torch.enable_grad():
            out = ring(q, k, v, ctx.group)
        return *torch.autograd.grad(out, (q, k, v), dout), None


class Chunk(nn.Module):
    """Model chunk c of n: blocks [c*L/n, (c+1)*L/n), plus the embedding on chunk 0 and ln_f + head
    on chunk n-1. Parameter names are common.GPT's, so the chunks together name the whole GPT. With
    a CP group of cp ranks every tensor holds the rank's T/cp tokens (zigzag()), the position
    embedding their positions."""

    def __init__(self, full, c, n, group, cp_group=None):
        super().__init__()
        per = full.cfg.n_layers // n
        self.first = c == 0
        self.last = c == n - 1
        check_split(full.cfg.n_layers, n, "layers", "n chunks")
        if not 0 <= c < n:
            raise ValueError(f"chunk {c} of {n}: need 0 <= c < n")
        if self.first:
            self.tok_emb = full.tok_emb
            self.pos_emb = full.pos_emb
        self.blocks = nn.ModuleDict(
            {
                str(i): TPBlock(full.blocks[i], group, cp_group)
                for i in range(c * per, (c + 1) * per)
            }
        )
        self.cp = (dist.get_world_size(cp_group), dist.get_rank(cp_group)) if cp_group else (1, 0)
        if self.last:
            self.ln_f = full.ln_f
            self.head = full.head

    # chunk 0: (b, T/cp) token ids; others: (b, T/cp, D) from the chunk before
    def forward(self, h):
        if self.first:
            # (T/cp,): this rank's positions, of the T = cp * T/cp of its sequences
            pos = zigzag(torch.arange(h.shape[1] * self.cp[0], device=h.device), *self.cp, 0)
            h = self.tok_emb(h) + self.pos_emb(pos)
        for block in self.blocks.values():
            h = block(h)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


# ------------------------------------------------------------------------- the schedules
def warmup(p, v, m, r):
    """Forwards rank r runs before its first backward. v = 1: 1F1B fills the p-r-1 ranks after it. v
    > 1: (v-1)*p to get the first micro-batch group through its earlier chunks, + 2 per rank
    downstream."""
    return min(p - r - 1, m) if v == 1 else min(2 * (p - r - 1) + (v - 1) * p, v * m)


def schedule(p, v, m, r):
    """Interleaved 1F1B: rank r's ops in order, (kind, chunk, micro-batch). Groups of p
    micro-batches sweep the rank's chunks in order forwards (fwd), in reverse backwards (bwd), as
    the docstring's table shows."""

    def fwd(k):  # the k-th forward: ("F", chunk, micro-batch), the docstring's table
        return "F", k % (p * v) // p * p + r, k // (p * v) * p + k % p

    def bwd(k):  # the k-th backward: the k-th forward's micro-batch, the chunks in reverse
        _, c, mb = fwd(k)
        return "B", (v - 1 - c // p) * p + r, mb

    if min(p, v, m) < 1 or not 0 <= r < p:
        raise ValueError(
            f"schedule of p = {p}, v = {v}, m = {m}, r = {r}: need p, v, m >= 1 and 0 <= r < p"
        )
    if v > 1 and m % p:  # interleaving runs groups of p micro-batches
        raise ValueError(
            f"interleaved (v > 1): m {m} is not divisible by p = {p}: use a multiple of p"
        )
    w = warmup(p, v, m, r)
    n = v * m
    # warm-up: w forwards, enough to fill the ranks downstream (and, v > 1, this rank's later
    # chunks)
    ops = [fwd(k) for k in range(w)]
    # steady state: one forward, then the backward of the oldest chunk-micro-batch still held
    for i in range(n - w):
        ops += [fwd(w + i), bwd(i)]
    # cool-down: the backwards still held; then the flush
    return ops + [bwd(i) for i in range(n - w, n)]


def needs(op, n):
    """The message op (kind, c, k) waits for (from chunk c-1 for F, c+1 for B); None: tokens or its
    loss."""
    return None if op[:2] in (("F", 0), ("B", n - 1)) else op  # op[:2]: its kind and chunk


def producer(msg):
    kind, c, k = msg
    return ("F", c - 1, k) if kind == "F" else ("B", c + 1, k)


def ideal_timeline(p, v, m):
    """Every rank's ops at their earliest start when each takes its slots (F 1, B 2) and messages
    are free: {op: (rank, start, end)}. Its idle slots are the schedule's bubble."""
    todo = [collections.deque(schedule(p, v, m, r)) for r in range(p)]  # each rank's ops to place
    at = {}
    free = [0] * p  # when each rank's last placed op ends
    while any(todo):
        moved = False
        for r, ops in enumerate(todo):
            while ops:
                op = ops[0]
                # its input's producer, if another chunk made it; the last chunk's B waits for its
                # own F (its loss), so no B runs before its micro-batch's forwards
                dep = producer(op) if needs(op, p * v) else ("F", *op[1:]) if op[0] == "B" else None
                if dep and dep not in at:
                    break  # not made yet: the rank waits
                start = max(free[r], at[dep][2] if dep else 0)
                free[r] = start + (1 if op[0] == "F" else 2)
                at[ops.popleft()] = (r, start, free[r])
                moved = True
        if not moved:
            raise RuntimeError(f"schedule ({p}, {v}, {m}) waits on itself")
    return at


def comm_plan(p, v, m, r):
    """Rank r's steps for one batch: ("op", op) and ("p2p", sends, recvs) with [(peer pp rank,
    message)]. Each message travels at one moment G of the ideal timeline, the first between its
    making and its use at which both ranks are between ops (else right after it is made); both post
    it in their batch of G. So all ranks post their batches in order of G and none waits for a later
    one: no cycle (NCCL deadlocks on a send whose receive is posted behind a wait on the sender)."""
    at = ideal_timeline(p, v, m)
    steps = [((at[op][1], 1), ("op", op)) for op in schedule(p, v, m, r)]  # (moment, 1): an op
    # moment G -> rank r's batch of G: ("p2p", its sends, its recvs), each [(peer, message)] in the
    # order of `at`, the same on both ranks of a pair
    batches = collections.defaultdict(lambda: ("p2p", [], []))
    for msg, (dst, used, _) in at.items():  # a message is named by the op that waits for it
        if not needs(msg, p * v):
            continue  # tokens or its loss: nothing travels
        src, _, made = at[producer(msg)]
        if src == dst:
            continue  # made on the same rank (p = 1)
        both = [
            (a, z) for x, a, z in at.values() if x in (src, dst)
        ]  # both ranks' ops: (start, end)
        # the first moment from made to used at which neither rank is inside an op (ops start and
        # end on whole slots, so the moments to try are whole too)
        when = next((x for x in range(made, used + 1) if not any(a < x < z for a, z in both)), made)
        if src == r:
            batches[when][1].append((dst, msg))
        if dst == r:
            batches[when][2].append((src, msg))
    steps += [((when, 0), batch) for when, batch in batches.items()]  # (moment, 0): a batch
    # keys are distinct: a rank's ops start at distinct moments, one batch per moment, batches first
    return [step for _, step in sorted(steps)]


class PipelineRank:
    """Rank r of the p in a pipeline's `group`: runs comm_plan's steps over its chunks {global
    index: module}, r, r + p, ... of n = p * v, for a batch of m micro-batches to the flush; each
    message: a msg_shape tensor. Chunk 0 takes inputs[k]; chunk n-1's output goes to loss_fn(output,
    targets[k]). `observe`: a context manager around each F and B, observe(kind, k, chunk=c), and
    each exchange, observe("p2p", None, recvs=[(peer, message)]). NCCL: the caller runs one
    collective in `group` first (main)."""

    TAG = {"F": 0, "B": 1}  # a point-to-point tag per direction (NCCL ignores tags)

    def __init__(self, chunks, group, m, msg_shape, dtype, device, observe=None):
        p = dist.get_world_size(group)
        r = dist.get_rank(group)
        v = len(chunks)
        # also: the chunks' count p * v, the group's size p
        if sorted(chunks) != list(range(r, p * v, p)):
            raise ValueError(
                f"rank {r} of {p} holds chunks {list(range(r, p * v, p))}, not {sorted(chunks)}"
            )
        self.chunks = chunks
        self.last = p * v - 1  # the last chunk, n - 1
        self.group = group
        self.m = m
        self.plan = comm_plan(p, v, m, r)
        # each message's buffer: torch.empty(**buffer)
        self.buffer = dict(size=msg_shape, dtype=dtype, device=device)
        self.observe = observe or (lambda *a, **k: contextlib.nullcontext())
        # (kind, chunk, micro-batch) -> tensor: each message made here (to send, or for a chunk here
        # when p = 1) or received, until its op takes it
        self.messages = {}
        self.alive = {}

    def run(self, inputs, targets, loss_fn):
        """inputs, targets: m micro-batches each. Returns the summed loss of those scored here
        (0-dim)."""
        if len(inputs) != self.m or len(targets) != self.m:
            raise ValueError(
                f"m = {self.m} micro-batches, got {len(inputs)} inputs, {len(targets)} targets"
            )
        self.loss = torch.zeros((), dtype=torch.float64, device=self.buffer["device"])
        for step, *what in self.plan:
            if step == "p2p":
                with self.observe("p2p", None, recvs=what[1]):
                    self.exchange(*what)
                continue
            kind, c, k = what[0]
            with self.observe(kind, k, chunk=c):
                if kind == "F":
                    self.forward(c, k, inputs, targets, loss_fn)
                else:
                    self.backward(c, k)
        return self.loss

    def exchange(self, sends, recvs):
        """One batch_isend_irecv: sends [(peer, message)] out of `messages`, receives into it."""
        ops = [
            dist.P2POp(
                dist.isend,
                self.messages.pop(msg).contiguous(),
                group=self.group,
                group_peer=q,
                tag=self.TAG[msg[0]],
            )
            for q, msg in sends
        ]
        # each receive: a new buffer under the message's name, filled when the batch completes
        for q, msg in recvs:
            self.messages[msg] = torch.empty(**self.buffer)
            ops.append(
                dist.P2POp(
                    dist.irecv,
                    self.messages[msg],
                    group=self.group,
                    group_peer=q,
                    tag=self.TAG[msg[0]],
                )
            )
        # never empty: comm_plan makes a step only for a message
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    def forward(self, c, k, inputs, targets, loss_fn):
        # (b, T) ids or (b, T, D)
        inp = inputs[k] if c == 0 else self.messages.pop(("F", c, k)).requires_grad_()
        out = self.chunks[c](inp)  # (b, T, D); last chunk: logits (b, T, V) ...
        if c == self.last:
            out = loss_fn(out, targets[k])  # ... and its loss
            self.loss += out.detach()
        else:
            self.messages["F", c + 1, k] = out.detach()  # (b, T, D) to chunk c+1, on the next rank
        self.alive[c, k] = inp, out

    def backward(self, c, k):
        inp, out = self.alive.pop((c, k))
        grad = (
            None if c == self.last else self.messages.pop(("B", c, k))
        )  # last chunk: from its loss
        torch.autograd.backward(out, grad)  # grads add up
        if c > 0:
            self.messages["B", c - 1, k] = inp.grad  # (b, T, D) to chunk c-1, on the rank before


# ------------------------------------------------------- after the flush: DP x CP, ZeRO-1, clipping
def flatten(tensors):  # -> (their elements,): the tensors in order, one buffer for one collective
    return torch.cat([x.reshape(-1) for x in tensors])


def unflatten(flat, tensors):
    """flatten's inverse: flat's elements copied back into `tensors`, in order (padding left)."""
    i = 0
    for x in tensors:
        x.copy_(flat[i : i + x.numel()].view_as(x))
        i += x.numel()


class ShardedOptimizer:
    """ZeRO-1 (Rajbhandari et al. 2020; Megatron's distributed optimizer) over `group`, R ranks
    holding the same parameters: rank i keeps a copy `shard` of shard i of their flat vector (padded
    to R shards of S) and its optimizer, make_opt([shard]) (elementwise, as AdamW: exact)."""

    def __init__(self, params, group, make_opt):
        self.params = list(params)
        self.group = group
        R = dist.get_world_size(group)
        S = -(-sum(q.numel() for q in self.params) // R)  # elements per shard
        self.total = R * S  # R*S: the flat vector, zero-padded to R shards
        i = dist.get_rank(group)
        self.mine = slice(i * S, (i + 1) * S)
        self.shard = nn.Parameter(self.flat(self.params)[self.mine].detach().clone())
        self.opt = make_opt([self.shard])

    def flat(self, tensors):  # -> (R*S,): the tensors in order, zero-padded
        flat = flatten(tensors)
        return F.pad(flat, (0, self.total - flat.numel()))

    def reduce_scatter(self):  # flat gradients (R*S,) -> shard.grad (S,): my shard of their sum
        self.shard.grad = torch.empty_like(self.shard)
        # this rank's gradients (R*S,) -> (S,) my shard of the sum
        dist.reduce_scatter_tensor(
            self.shard.grad, self.flat([q.grad for q in self.params]), group=self.group
        )

    def step(self):  # update my shard, all-gather the R shards (R*S,), every parameter written back
        self.opt.step()
        full = self.shard.new_empty(self.total)  # (R*S,)
        dist.all_gather_into_tensor(full, self.shard.detach(), group=self.group)
        with torch.no_grad():
            unflatten(full, self.params)


def squared_norm(grads):
    """Summed in float32 at least (float64 for a float64 model) by the norm's dtype=, not float64
    copies."""
    acc = torch.promote_types(grads[0].dtype, torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(x, dtype=acc) for x in grads])
    return norms.square().sum().double()


def finish_batch(params, loss, group, tp_rank, max_norm, world, zero=None):
    """After the flush: 1. gradients summed over `group`, the dp x cp ranks holding the same
    parameters (a CP rank's weights are its DP peers'), all-reduced whole or reduce-scattered
    (ZeRO-1); 2. the squared norm and loss in one all-reduce over `world`, each piece counted once;
    3. clip as torch does. -> (loss, norm)"""
    counted = [getattr(q, "tp_split", False) or tp_rank == 0 for q in params]
    if not zero:  # one all-reduce, flat: each rank's loss is already / the global token count
        grads = [q.grad for q in params]
        if dist.get_world_size(group) > 1:  # (a group of one: nothing to add)
            flat = flatten(grads)  # (this rank's elements,)
            dist.all_reduce(flat, group=group)
            unflatten(flat, grads)
        sq = squared_norm([x for x, c in zip(grads, counted) if c]) * (dist.get_rank(group) == 0)
    else:  # ZeRO-1: reduce-scattered
        zero.reduce_scatter()
        # (S,): my shard of the summed gradient; the others' are theirs to count
        weights = zero.flat([torch.full_like(q.grad, c) for q, c in zip(params, counted)])
        sq = squared_norm([zero.shard.grad * weights[zero.mine]])
    total = torch.stack([loss * (tp_rank == 0), sq])
    # (2,): this rank's piece of the loss, of the squared norm -> sums
    dist.all_reduce(total, group=world)
    norm = total[1].sqrt()
    # torch's own clipping, given the whole model's norm (ZeRO-1: of my shard's gradient)
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(
            params if zero is None else [zero.shard], max_norm, norm
        )
    return total[0].item(), norm.item()


# ------------------------------------------------------------------------- argument checks, main
def check_args(args):
    world = env_world_size()
    p = args.pp
    t = args.tp
    cp = args.cp
    check_common_args(args)
    for name in ("pp", "tp", "cp", "virtual_stages", "microbatches"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dropout > 0:
        fail(
            "ptdp.py runs without dropout (TP regions would need Megatron's RNG tracker: "
            "megatron_tp.py)"
        )
    if args.zero not in (0, 1):
        fail(
            f"--zero {args.zero}: ptdp.py shards the optimizer state (ZeRO-1) or nothing: use "
            "--zero 0 or 1"
        )
    dp = args.dp or world // (p * cp * t)
    if dp < 1 or p * cp * t * dp != world:  # (a negative --dp is dp < 1 too)
        fail(
            f"world size {world} != pp {p} x tp {t} x dp {args.dp or '(world / pp / tp / cp)'} x "
            f"cp {cp}: launch torchrun --nproc_per_node={p * cp * t * max(args.dp, 1)} or change "
            "--pp/--tp/--dp/--cp"
        )
    if args.stage_ms < 0:
        fail(f"--stage-ms must be >= 0, got {args.stage_ms}")
    try:  # validation once: the cores' check with the flags' names, its ValueError as fail's line
        check_split(args.n_heads, t, "--n-heads", "--tp")
        check_split(args.n_layers, p * args.virtual_stages, "--n-layers", "--pp x --virtual-stages")
        check_split(args.seq_len, 2 * cp, "--seq-len", "2 x --cp")
        check_split(args.batch_size, dp * args.microbatches, "--batch-size", "dp x --microbatches")
    except ValueError as e:
        fail(str(e))
    try:  # the schedule's own check (self-contained: copied out alone), with the flags
        schedule(p, args.virtual_stages, args.microbatches, 0)
    except ValueError as e:
        fail(
            f"--pp {p}, --virtual-stages {args.virtual_stages}, "
            f"--microbatches {args.microbatches}: {e}"
        )
    return world, dp


def main():
    args = parse_args(Args)
    world, dp = check_args(args)
    p = args.pp
    t = args.tp
    cp = args.cp
    n = p * args.virtual_stages  # chunks in a pipeline, v per rank
    m = args.microbatches

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)

    # --- the grid: tp innermost, then cp, dp, pp (the docstring's picture) ---
    grid = torch.arange(world).view(p, dp, cp, t)
    coords = pp_rank, dp_rank, cp_rank, tp_rank = [int(i) for i in (grid == d.rank).nonzero()[0]]

    # a group per row of `rows` (groups, ranks): every rank makes every group, in the same order
    # (new_group is a collective over the world), and keeps the one it is in
    def new_groups(rows):
        return dist.new_subgroups_by_enumeration(rows.tolist())[0]

    # where each axis acts: tp_group in TPBlock (f and g, two all-reduces per layer and pass);
    # cp_group in RingAttention (K/V round the ring); pp_group in PipelineRank (activations
    # forward, gradients back); dp_cp_group after the flush, in finish_batch or ShardedOptimizer
    # (the gradients, once per batch)
    tp_group = new_groups(rearrange(grid, "p d c t -> (p d c) t"))  # grid[i, j, c, :]
    cp_group = new_groups(rearrange(grid, "p d c t -> (p d t) c"))  # grid[i, j, :, k]
    # grid[:, j, c, k], in pp order: a pipeline's group rank is its pp rank
    pp_group = new_groups(rearrange(grid, "p d c t -> (d c t) p"))
    dp_cp_group = new_groups(rearrange(grid, "p d c t -> (p t) (d c)"))  # grid[i, :, :, k]

    # --- the model: the full GPT on CPU from one seed, this rank's chunks TP-sliced, to the device
    dtype = DTYPES[args.dtype]
    full = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    # chunk c on pp rank c % p: a loop
    mine = {
        c: Chunk(full, c, n, tp_group, cp_group if cp > 1 else None) for c in range(pp_rank, n, p)
    }
    # one module of them all, for the optimizer and the checkpoint (its names: "i." + GPT's)
    chunks = nn.ModuleList(mine.values()).to(d.device)
    del full
    params = list(chunks.parameters())
    zero = None
    if args.zero:
        zero = ShardedOptimizer(params, dp_cp_group, lambda ps: make_optimizer(ps, args))
    opt = zero.opt if zero else make_optimizer(params, args)
    # ZeRO-1's copy of its shard, checkpointed too
    shard = nn.ParameterList([zero.shard] if zero else [])
    run = Run(d, args, {"model": chunks, "optim": opt, "zero": shard})
    norms = run.history.get("norms", [])
    # measured from outside: each F, B and exchange (the runner's observe), each collective by axis
    watch = Watch(d, args, coords, tp=tp_group, cp=cp_group, dp_cp=dp_cp_group, pp=pp_group)
    # every message between chunks, an activation or a gradient: (b, T/cp, D)
    msg_shape = (args.batch_size // (dp * m), args.seq_len // cp, args.d_model)
    runner = PipelineRank(mine, pp_group, m, msg_shape, dtype, d.device, observe=watch)
    watch.runner = runner  # what it holds to B, for the counted peak
    # NCCL: a group's first collective (its set-up) must not be p2p
    for group in (pp_group, cp_group):
        dist.all_reduce(torch.zeros(1, device=d.device), group=group)

    def split(z):  # (B, T) global batch -> (m, b, T/cp): this replica's rows, this CP rank's tokens
        z = zigzag(z.chunk(dp)[dp_rank], cp, cp_rank)  # (cp = 1: all its tokens)
        return rearrange(z, "(m b) n -> m b n", m=m).to(d.device)

    for step in run.steps():
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global, CPU
        n_tok = count_tokens(y)  # the whole global batch's: every micro-batch loss divides by it
        watch.step = step
        # gradients freed as the step begins: the last step's stay for the summary to count
        chunks.zero_grad(set_to_none=True)
        opt.zero_grad(set_to_none=True)
        # the first step counted (slower), the last one timed
        with run.watching(step, watch.comm, at=run.start):
            loss = runner.run(split(x), split(y), lambda logits, tgt: lm_loss(logits, tgt, n_tok))
            loss, norm = finish_batch(
                params, loss, dp_cp_group, tp_rank, args.clip, dist.group.WORLD, zero
            )
            (zero or opt).step()
        norms.append(norm)
        run.end_step(step, loss, norms=norms)

    summarize(run, watch, opt, zero)  # the summary, then --check


# --- measurement ---
# Its tools, imported where they are used: the imports above are the lesson's.
from harness import (  # noqa: E402
    CommCounter,
    PipelineWatch,
    assemble_full,
    busy_ms,
    check_against_reference,
    draw_timeline,
    gather_rows,
    peak_memory_bytes,
    tensor_bytes,
    write_trace,
)


class Watch(PipelineWatch):
    """harness.PipelineWatch (--stage-ms: the stage's F time split over its v chunks, B twice F),
    tagged with the step, the rank's grid coordinates and when its input arrived; it counts the
    micro-batch chunks between F and B, and after each op the saved activations alive plus the
    outputs the runner holds to B. Its `comm` counts every collective and message by its group
    (`axes`: name -> group) at the dispatcher."""

    def __init__(self, d, args, coords, **axes):
        f_ms = args.stage_ms / args.virtual_stages
        pp, dp, cp, tp = coords
        super().__init__(
            d,
            dict(F=f_ms, B=2 * f_ms),
            ("chunk", "step", "pp", "dp", "cp", "tp", "recv"),
            dict(pp=pp, dp=dp, cp=cp, tp=tp),
        )
        self.d = d
        self.args = args
        dp = d.world // (args.pp * args.cp * args.tp)
        m = args.microbatches
        d.log(
            f"ptdp.py: world {d.world} = pp {args.pp} x dp {dp} x cp {args.cp} x tp {args.tp}, "
            f"interleaved 1F1B, v = {args.virtual_stages}, m = {m} micro-batches of "
            f"{args.batch_size // (dp * m)} x {args.seq_len // args.cp} tokens, ZeRO-{args.zero}, "
            f"on {d.backend}"
        )
        self.comm = CommCounter(axes=axes, log=True)  # log: each send's tag, for its direction
        self.state = {}  # state bytes by kind (summarize counts them after the last step)
        self.inflight = [0, 0]  # micro-batch chunks between F and B: now, peak
        self.runner = None  # main sets it: what it holds to B, outputs (the last chunk's: losses)
        self.held_peak = 0

    def __call__(self, kind, mb, recvs=(), **tags):  # recvs: the runner's [(peer, message)]
        return super().__call__(kind, mb, recvs=[msg for _, msg in recvs], **tags)

    def before(self, kind, mb):
        self.inflight[0] += kind == "F"
        self.inflight[1] = max(self.inflight)

    def after(self, kind, mb):
        self.inflight[0] -= kind == "B"
        from torch.multiprocessing.reductions import StorageWeakRef  # (measurement only)

        now = self.live.alive()  # the peak of saved activations alive
        outs = (
            {
                StorageWeakRef(o.untyped_storage()): o.untyped_storage().nbytes()
                for _, o in self.runner.alive.values()
            }
            if self.runner
            else {}
        )
        self.held_peak = max(
            self.held_peak, now + sum(n for w, n in outs.items() if w not in self.live.refs)
        )


def summarize(run, watch, opt, zero):
    """Each measured figure beside its theory, the peak (counted; CUDA's own on a GPU) read before
    --check trains the reference, then the verdict."""
    d = watch.d
    args = watch.args
    dp = d.world // (args.pp * args.cp * args.tp)
    coords = tuple(watch.coords.values())  # pp, dp, cp, tp ranks
    chunks = nn.ModuleList(watch.runner.chunks.values())  # this rank's, as main holds them
    norms = run.history.get("norms", [])  # every step's, resumed ones too
    # this rank's parameters, gradients and optimizer state as the last step left them
    watch.state = held_bytes(chunks, opt, zero)
    figures, comm_bytes = report(d, args, dp, watch, watch.comm)
    figures.update(
        pp=args.pp,
        tp=args.tp,
        dp=dp,
        cp=args.cp,
        zero=args.zero,
        schedule="interleaved",
        virtual_stages=args.virtual_stages,
        microbatches=args.microbatches,
        grad_norms=norms,
    )
    peak = peak_memory_bytes(d, sum(watch.state.values()) + watch.held_peak)
    check = (
        check_against_reference(d, args, run.losses, full_model(d, args, chunks, coords))
        if args.check
        else None
    )
    run.finish("ptdp", peak, comm_bytes, check, figures)


def held_bytes(chunks, opt, zero):
    """This rank's model state, counted from the tensors: parameters; gradients (ZeRO-1: + the
    reduced shard); optimizer state: AdamW's moments (ZeRO-1: of the shard, + the shard's own copy
    of its parameters)."""
    params = list(chunks.parameters())
    moments = [
        x for st in opt.state.values() for x in st.values() if torch.is_tensor(x) and x.dim() > 0
    ]
    return dict(
        param_bytes=tensor_bytes(params),
        grad_bytes=tensor_bytes([q.grad for q in params] + ([zero.shard.grad] if zero else [])),
        optim_bytes=tensor_bytes(moments + ([zero.shard] if zero else [])),
    )


def theory(p, v, m):
    """Per pp rank: the bubble (idle / busy of the ideal timeline), (p-1)/(v*m); the most
    micro-batch chunks between F and B, warm-up + 1; the forward and backward messages per batch,
    m(v - 1 if the last rank) and m(v - 1 if rank 0), none at p = 1 (the messages stay on the
    rank)."""
    return (
        (p - 1) / (v * m),
        [min(warmup(p, v, m, r) + 1, v * m) for r in range(p)],
        [m * (v - (r == p - 1)) * (p > 1) for r in range(p)],
        [m * (v - (r == 0)) * (p > 1) for r in range(p)],
    )


def inflight_bound(p, v, m, r):
    return theory(p, v, m)[1][r]


def report(d, args, dp, watch, comm):
    """All ranks: gather events and this rank's counts of the counted step, its sends told apart by
    their tag (one per way); tensors only. Rank 0: each figure beside its theory."""
    p = args.pp
    v = args.virtual_stages
    m = args.microbatches
    counted = comm.total
    cp = args.cp
    tags = [c["tag"] for c in comm.calls_log if c["op"] == "send" and c["axis"] == "pp"]
    tag = PipelineRank.TAG  # one per direction
    mine = dict(
        fwd_msgs=tags.count(tag["F"]),
        bwd_msgs=tags.count(tag["B"]),
        p2p_bytes=counted("send", "pp"),
        tp_calls=counted("all_reduce", "tp", what="calls"),
        tp_fwd=counted("all_reduce", "tp", "fwd", "calls"),
        tp_bwd=counted("all_reduce", "tp", "bwd", "calls"),
        dp_calls=counted(None, "dp_cp", what="calls"),
        tp_bytes=counted("all_reduce", "tp"),
        dp_bytes=counted(None, "dp_cp"),
        cp_bytes=counted("send", "cp"),
        cp_fwd_bytes=counted("send", "cp", "fwd"),
        cp_calls=counted("send", "cp", what="calls"),
        world_bytes=counted("all_reduce", "world"),
        comm_bytes=counted(),
        inflight=watch.inflight[1],
        act_peak=watch.live.peak,
        act_per_microbatch=sum(watch.saved.values()),
        held_peak=watch.held_peak,
        **watch.state,
    )
    events = watch.timeline.gather()
    rows = gather_rows(d, [[*watch.coords.values(), *mine.values()]])
    per_rank = {
        tuple(int(x) for x in r[0, :4]): dict(zip(mine, (int(x) for x in r[0, 4:]))) for r in rows
    }
    # bytes handed per step, the busiest rank
    comm_bytes = max(c["comm_bytes"] for c in per_rank.values())
    if d.rank != 0 or not events:
        return {}, comm_bytes
    for e in events:
        # -1: the op started from tokens, its loss or its B
        e["recv"] = None if e["recv"] < 0 else e["recv"]
    last = [
        e for e in events if e["step"] == events[-1]["step"] and e["dp"] == e["cp"] == e["tp"] == 0
    ]
    lo, hi = min(e["start"] for e in last), max(e["end"] for e in last)
    bub = [(hi - lo - x) / x for x in (busy_ms(last, r, lo, hi, key="pp") for r in range(p))]
    bub_theory, bound, f_theory, b_theory = theory(p, v, m)
    pipe = [per_rank[r, 0, 0, 0] for r in range(p)]  # the pipeline of dp 0, cp 0, tp 0
    f_msgs, b_msgs, sent, inflight = (
        [c[k] for c in pipe] for k in ("fwd_msgs", "bwd_msgs", "p2p_bytes", "inflight")
    )
    alive = [c["act_peak"] / max(c["act_per_microbatch"], 1) for c in pipe]
    d.log(
        f"\nsummary, pipeline dp 0 tp 0 (interleaved, p {p}, v {v}, m {m}): bubble = idle / busy "
        "in the "
        "last "
        "step, in flight = micro-batch chunks between F and their last op, alive = saved "
        "activations at "
        "their peak in micro-batches of the rank's chunks, messages and bytes handed to the sends; "
        "each "
        "measured | theory\nrank | chunks | bubble | theory | in flight | bound | alive | theory | "
        "fwd msgs | theory | bwd msgs | theory | bytes sent"
    )
    for r in range(p):
        held = ",".join(str(c) for c in range(r, p * v, p))
        d.log(
            f"{r:4d} | {held:6s} | {bub[r]:6.3f} | {bub_theory:6.3f} | {inflight[r]:9d} | "
            f"{bound[r]:5d} | {alive[r]:5.2f} | {bound[r] / v:6.2f} | {f_msgs[r]:8d} | "
            f"{f_theory[r]:6d} | {b_msgs[r]:8d} | {b_theory[r]:6d} | {sent[r]}"
        )
    mean = sum(bub) / p
    c0 = pipe[0]
    tp_theory = 4 * m * args.n_layers // p if args.tp > 1 else 0
    formula = "(p-1)/(v*m)"
    per_pipe = "(v*p-1)*m"
    dp_theory = (1 + args.zero) * (dp * cp > 1)
    waits = ", ".join(f"{k} waits {x:g} ms" for k, x in watch.timeline.simulate.items())
    d.log(
        f"bubble mean {mean:.3f} vs theory {formula} = {bub_theory:.3f} "
        f"({mean - bub_theory:+.3f}); "
        + (
            f"--stage-ms {args.stage_ms:g}: compute simulated, a chunk's {waits}"
            if args.stage_ms
            else "real compute only: on shared cores this times the OS scheduler; try --stage-ms"
        )
    )
    d.log(
        f"forward messages per batch and pipeline {sum(f_msgs)} = {per_pipe} = {sum(f_theory)}, "
        f"each {sent[0] // max(f_msgs[0] + b_msgs[0], 1)} B = (b, T/cp, D); rank 0 collectives per "
        f"batch: TP all-reduces {c0['tp_calls']} ({c0['tp_fwd']} forward, {c0['tp_bwd']} "
        f"backward), theory {tp_theory} (g twice forward, f twice backward, per layer and "
        f"micro-batch); DP x CP collectives {c0['dp_calls']}, theory {dp_theory}"
    )
    # noqa: E731
    label = lambda e: (e["kind"] if e["chunk"] < p else e["kind"].lower()) + str(e["mb"])
    d.log(
        "\ntimeline of the last step, measured (Fk Bk: chunk < p, fk bk: the later chunks):\n"
        + draw_timeline(last, p, lo, hi, label, row_key="pp", row_name="rank")
    )
    if args.trace:
        write_trace(
            args.trace,
            events,
            lambda e: f"{e['kind']}{e['mb']} chunk {e['chunk']}",
            row_name="rank",
        )
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return dict(
        events=events,
        bubble=bub,
        bubble_mean=mean,
        bubble_theory=bub_theory,
        stage_ms=args.stage_ms,
        bubble_definition="idle / busy per rank over the last step (relative to ideal compute)",
        bubble_minus_theory=mean - bub_theory,
        fwd_msgs_per_rank=f_msgs,
        fwd_msgs_theory=f_theory,
        bwd_msgs_per_rank=b_msgs,
        bwd_msgs_theory=b_theory,
        fwd_msgs_per_pipeline=sum(f_msgs),
        fwd_msgs_per_pipeline_theory=sum(f_theory),
        p2p_bytes_per_rank=sent,
        inflight=inflight,
        inflight_theory=bound,
        microbatches_alive=alive,
        tp_calls_per_batch=c0["tp_calls"],
        microbatches_alive_theory=[x / v for x in bound],
        tp_calls_theory=tp_theory,
        dp_calls_per_batch=c0["dp_calls"],
        dp_calls_theory=dp_theory,
        counts_per_rank={
            f"pp{a} dp{b}{f' cp{c}' * (cp > 1)} tp{k}": x for (a, b, c, k), x in per_rank.items()
        },
    ), comm_bytes


# --- reference for --check ---
def full_model(d, args, chunks, coords):
    """The whole GPT by name on every rank (for --check), exactly: TP shard k of `name` travels as
    `name#k`, a replicated tensor once (from TP rank 0), all from DP rank 0; harness.assemble_full
    adds them up."""
    _, dp_rank, cp_rank, tp_rank = coords
    t = args.tp
    dtype = DTYPES[args.dtype]
    with torch.device("meta"):  # the names and shapes of the whole GPT, no storage
        shapes = {n: list(q.shape) for n, q in GPT(GPTConfig.from_args(args)).named_parameters()}
    owned, pieces = {}, {}
    for n, q in chunks.named_parameters():
        if dp_rank == cp_rank == 0 and (getattr(q, "tp_split", False) or tp_rank == 0):
            # "3.blocks.."
            owned[n.split(".", 1)[1] + (f"#{tp_rank}" if tp_dim(n) is not None else "")] = q
    for n, shape in shapes.items():
        k = tp_dim(n)
        pieces.update(
            {n: shape}
            if k is None
            else {
                f"{n}#{j}": [z // t if i == k else z for i, z in enumerate(shape)] for j in range(t)
            }
        )
    got = assemble_full(d, owned, pieces, dtype)
    return {
        n: got[n]
        if tp_dim(n) is None
        else torch.cat([got[f"{n}#{j}"] for j in range(t)], tp_dim(n))
        for n in shapes
    }


if __name__ == "__main__":
    main()
