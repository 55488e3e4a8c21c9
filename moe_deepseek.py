"""moe_deepseek.py: mixture of experts the 2024 way, as DeepSeek trains it: fine-grained and shared
experts, sigmoid gates, loss-free balancing, dropless dispatch, on expert parallelism (the 2017-2022
line: moe.py).

The GPT of common.py with the MLP of every block (or every --moe-every'th) replaced by a DeepSeekMoE
layer (Dai et al. 2024, "DeepSeekMoE"; DeepSeek-V3, 2024, Sec. 2.1.2):
  fine-grained experts  each expert of a dense-equivalent MoE cut into --granularity m narrower ones (hidden
                        4D/m): E and k count the fine experts, so more combinations at the same
                        compute.
  shared experts        --shared-experts S experts of the same width that every token goes through beside its
                        routed ones: common knowledge stays out of the routed ones. Replicated, data
                        parallel.
  sigmoid gates         affinities s = sigmoid(x W_g) (--score softmax: DeepSeek-V2's); the gates are the
                        chosen s normalised over the k (V3 eq. 12-16).
  loss-free balancing   Wang et al. 2024: the top k of s + b choose, the gates are the chosen s alone, so the
                        bias b chooses but never weighs. After each step b_e += u sign(mean c - c_e)
                        from the whole batch's counts c (--bias-rate u); no auxiliary loss pulls on
                        the router, except V3's small sequence-wise balance loss (--seq-aux-weight;
                        0: off).
  dropless dispatch     no capacity and nothing dropped (as MegaBlocks, Gale et al. 2023; V3 drops no token):
                        each rank sorts its (token, choice) pairs by expert and sends every EP rank
                        exactly its experts' tokens in one uneven all-to-all:
      rank 0 chose  e0 e0 e0 e1 | e2 e3 e3     counts [3 1 | 1 2]: keeps 4, sends 3 to rank 1
      rank 1 chose  e0 e1 e1 | e2 e2 e2 e3     counts [1 2 | 3 1]: sends 3 to rank 0, keeps 4
      all-gather the counts, so every rank knows every split; all_to_all_single(out, in, recv,
      send);
      rank 0 then runs e0 on [3 own | 1 from rank 1], e1 on [1 | 2]; the way back swaps the splits.
The splits must reach the host to size the buffers: one host sync per layer (Megatron-Core's
dropless dispatcher has it too). Total loss = LM loss + --seq-aux-weight x the sequence-wise loss
(mean over sequences and MoE layers). Exact ties in the top k go to the lower expert index (a stable
sort, not torch.topk, whose order for equal values is the kernel's, and CPU and CUDA differ).

Ranks form the grid torch.arange(world).view(world // ep, ep): a row is an EP group (together all E
experts), a column holds copies of the same E/ep experts (their gradients summed over it); the rest
is data parallel.

Reading order: the layer first, complete (the gates, the routed and shared experts, the dropless
all-to-all exchange); then the balancing (the loss-free bias update and the sequence-wise loss);
then expert parallelism's step (the grid, the expert + data parallel gradients, the global norm).
That is the technique section (torch and einops only); after check_args, this repo's run of it: the
GPT with DeepSeekMoE blocks (build_moe_gpt) and one optimizer step (train_step: LM loss, sync,
clipping, the step, the bias update).

What repeats moe.py, on purpose, so that this file reads alone (each marked "as in moe.py" where it
stands): the same code in init, top_k, mlps, make_layout, split_params and sync_grads
(tests/test_moe_deepseek.py holds them identical, and no other function); AllToAll, here with uneven
splits; moe_layers and aux_share for DeepSeekMoE; check_args, build_moe_gpt, train_step and main in
moe.py's shape. New here: route, DeepSeekMoE (affinities, dropless, the shared experts),
update_biases and seq_balance_loss.

Run:
    python moe_deepseek.py --check                                   # world 1: all experts local
    torchrun --nproc_per_node=4 moe_deepseek.py --check              # EP 4
    torchrun --nproc_per_node=4 moe_deepseek.py --ep 2 --experts 16 --top-k 4 --granularity 4 --check
In production, use a fused MoE (Megatron-Core, DeepSpeed-MoE, torchtitan): grouped GEMMs over the
sorted tokens instead of the loop over experts written out here for clarity, and DeepEP's all-to-all
kernels.

Legend (shape comments): N tokens on this rank (b sequences of n), E routed experts, El = E/ep of
them on this rank, K choices per token, S shared experts, D model width, H expert width (4D/m), r
ranks of the EP group.
"""

from dataclasses import dataclass
from types import SimpleNamespace
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
    clip_grads_,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
    reference_train,
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
    experts: int = 8  # routed experts per MoE layer (E), each 4 x d_model / granularity wide
    top_k: int = 2  # routed experts per token (K)
    granularity: int = 2  # DeepSeekMoE's m: an expert's hidden width is 4 x d_model / m
    shared_experts: int = 1  # always-on experts per MoE layer beside the routed ones, as wide
    score: Literal["sigmoid", "softmax"] = "sigmoid"  # the affinity function (sigmoid: DeepSeek-V3)
    bias_rate: float = 1e-3  # loss-free balancing: the bias's step (Wang et al.'s u)
    seq_aux_weight: float = 0.0  # weight of DeepSeek-V3's sequence-wise balance loss (0 = off)
    moe_every: int = 1  # an MoE layer in every n-th block, dense MLPs between
    ep: int = 0  # expert-parallel degree: ranks that split one set of experts (0 = world size)


# ------------------------------------ the DeepSeekMoE layer: gates, fine + shared experts, dropless
def check_layer(experts, ep, top_k, score):
    """What the layer relies on (DeepSeekMoE and check_args both call it, before any collective)."""
    if experts < 1 or experts % ep:
        raise ValueError(
            f"experts = {experts} is not divisible by ep = {ep} (each rank holds experts/ep "
            f">= 1): try experts = {ep * max(1, -(-experts // ep))}"
        )
    if not 1 <= top_k <= experts:
        raise ValueError(
            f"top_k = {top_k} with {experts} experts: a token takes 1..{experts} routed experts"
        )
    if score not in ("sigmoid", "softmax"):
        raise ValueError(f"score = {score!r}: use sigmoid (DeepSeek-V3) or softmax (DeepSeek-V2)")


# as in moe.py: the same code
def init(generator, dtype, *shape):
    """N(0, 0.02) weights drawn in float64 from the MoE weights' one generator (the same at any
    EP)."""
    return (0.02 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)


# as in moe.py: the same code
def top_k(scores, k):
    """torch.topk with exact ties broken by the lower index: a stable descending sort (topk leaves
    the order of equal values to the kernel: a CPU rank and a GPU one could route differently). (..,
    n) -> (.., k)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def route(scores, bias, k):
    """Wang et al. 2024 (Alg. 1), as DeepSeek-V3 uses it (Sec. 2.1.2, eq. 12-16): scores (N, E),
    bias (E,) -> expert, gate (N, K). Only the indices of the top k see b (no gradient reaches it);
    the gates are the chosen scores, normalised over the k."""
    expert = top_k(scores + bias, k)[1]  # (N, K): the bias only chooses ...
    s = scores.gather(-1, expert)  # (N, K): ... the gates are the scores without it
    return expert, s / s.sum(-1, keepdim=True)


# as in moe.py, with uneven splits (moe.py's exchange is even)
class AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0: in_splits[j] rows to rank j, out_splits[i] rows from rank i.
    Its backward is the same exchange, splits swapped: the gradient of the rows I sent to j comes
    from j."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits):
        # checked: splits that do not fit abort the collective
        r = dist.get_world_size(group)
        n = x.shape[0]
        if (sum(in_splits), len(in_splits), len(out_splits)) != (n, r, r):
            raise ValueError(
                f"{n} rows, {r} ranks: {r} in and {r} out splits, the in splits summing to {n}"
            )
        ctx.group = group
        ctx.swapped = (in_splits, out_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group, *ctx.swapped), None, None, None


# as in moe.py: the same code
def mlps(h, w1, b1, w2, b2):
    """gelu(h w1 + b1) w2 + b2: one expert (h (N, D), w1 (D, H), b1 (H,)), or X experts at once as
    batched matmuls (w1 (X, D, H), b1 (X, H); h (N, D) for all X) -> (X, N, D)."""
    return F.gelu(h @ w1 + b1[..., None, :]) @ w2 + b2[..., None, :]


class DeepSeekMoE(nn.Module):
    """Replaces an MLP: gates -> sort by expert -> all-to-all -> routed experts -> all-to-all ->
    weighted sum, plus the shared experts. x (b, n, D) -> (b, n, D); ep_group: the ranks that split
    the E routed experts (None: all local). A forward leaves `aux` (b,), the sequence-wise balance
    loss per sequence, and `wanted` (E,), this rank's choices per expert (update_biases reads
    it)."""

    def __init__(
        self,
        d_model,
        experts,
        top_k=2,
        hidden=None,
        shared=1,
        score="sigmoid",
        ep_group=None,
        dropout=0.0,
        generator=None,
        dtype=torch.float64,
    ):
        super().__init__()
        D = d_model
        H = hidden or 4 * d_model
        E = experts
        self.E = E
        self.k = top_k
        self.score = score
        self.n_shared = shared
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.El = E // max(1, self.ep)  # experts on this rank
        check_layer(E, self.ep, top_k, score)  # what it cannot do, before any collective
        self.w_gate = nn.Parameter(init(generator, dtype, D, E))  # W_g: replicated, data parallel
        # b: a buffer (so checkpointed), moved by update_biases, never by autograd; float32 at least
        # (bf16 would round its --bias-rate steps away) All E experts drawn from one generator, my
        # slice kept: every EP degree starts from the same numbers.
        self.register_buffer(
            "expert_bias", torch.zeros(E, dtype=torch.promote_types(dtype, torch.float32))
        )
        mine = slice(self.ep_rank * self.El, (self.ep_rank + 1) * self.El)
        self.w1 = nn.Parameter(init(generator, dtype, E, D, H)[mine].clone())
        self.b1 = nn.Parameter(torch.zeros(self.El, H, dtype=dtype))
        self.w2 = nn.Parameter(init(generator, dtype, E, H, D)[mine].clone())
        self.b2 = nn.Parameter(torch.zeros(self.El, D, dtype=dtype))
        if shared:  # S always-on experts: replicated, data parallel like the router
            self.shared_w1 = nn.Parameter(init(generator, dtype, shared, D, H))
            self.shared_b1 = nn.Parameter(torch.zeros(shared, H, dtype=dtype))
            self.shared_w2 = nn.Parameter(init(generator, dtype, shared, H, D))
            self.shared_b2 = nn.Parameter(torch.zeros(shared, D, dtype=dtype))
        self.drop = nn.Dropout(dropout)
        self.wanted = None
        self.aux = None

    def affinities(self, xt):
        """s (N, E): sigmoid (or softmax) of x W_g in float32 or wider (Switch Sec. 2.4: bf16
        routing is unstable)."""
        x = xt.to(torch.promote_types(xt.dtype, torch.float32))
        logits = x @ self.w_gate.to(x.dtype)
        return logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)

    def dropless(self, xt, expert, gate):
        """Every choice served: xt (N, D), expert and gate (N, K) -> (N, D), gate-weighted sums per
        token."""
        N, K = expert.shape
        D = xt.shape[-1]
        E = self.E
        El = self.El
        r = self.ep
        me = self.ep_rank
        dest = expert.flatten()  # (N K,): each (token, choice) pair's expert
        # (E,): pairs per expert
        counts = dest.new_zeros(E).scatter_add_(0, dest, torch.ones_like(dest))
        if r > 1:  # every rank's counts, so that each knows what it gets from whom
            every = counts.new_empty(r * E)
            dist.all_gather_single(every, counts, group=self.ep_group)
            counts = every
        # (r, E): the one host sync (see top)
        sizes = rearrange(counts, "(r e) -> r e", r=r).tolist()
        # (r, El): rank i's pairs for each of my experts
        mine = [row[me * El : (me + 1) * El] for row in sizes]
        send = [sum(sizes[me][j * El : (j + 1) * El]) for j in range(r)]  # pairs I send to rank j
        recv = [sum(row) for row in mine]  # pairs I get from rank i
        pairs = torch.argsort(dest, stable=True)  # (N K,): by expert, then token
        h = xt[pairs // K]  # (N K, D): each pair's token, rank j's block j-th
        if r > 1:
            # (sum recv, D): from each rank, by my expert
            h = AllToAll.apply(h, self.ep_group, recv, send)
        # piece (i, e): rank i's tokens for my expert e
        pieces = h.split([c for row in mine for c in row])
        ws = self.w1, self.b1, self.w2, self.b2
        # e on all its tokens
        outs = [mlps(torch.cat(pieces[e::El]), *(w[e] for w in ws)) for e in range(El)]
        back = [o.split([mine[i][e] for i in range(r)]) for e, o in enumerate(outs)]
        # back in (rank i, expert e) order
        h = torch.cat([back[e][i] for i in range(r) for e in range(El)])
        if r > 1:
            h = AllToAll.apply(h, self.ep_group, send, recv)  # (N K, D): my pairs' outputs, sorted
        w = gate.flatten()[pairs].to(xt.dtype)  # (N K,): each pair's gate weight
        return xt.new_zeros(N, D).index_add(0, pairs // K, h * w[:, None])  # summed per token

    def forward(self, x):
        """x (b, n, D): this rank's b sequences of n positions -> (b, n, D)."""
        b, n, D = x.shape
        xt = rearrange(x, "b n d -> (b n) d")  # (N, D)
        scores = self.affinities(xt)  # (N, E)
        expert, gate = route(scores, self.expert_bias.to(scores.dtype), self.k)  # (N, K)
        self.aux = seq_balance_loss(scores, expert, n)  # (b,): the balancing section below
        self.wanted = F.one_hot(expert, self.E).detach().sum((0, 1))  # (E,)
        y = self.dropless(xt, expert, gate)
        # every token through each of the S shared experts: (S, N, D), summed over S
        if self.n_shared:
            ws = self.shared_w1, self.shared_b1, self.shared_w2, self.shared_b2
            y = y + mlps(xt, *ws).sum(0)
        return self.drop(rearrange(y, "(b n) d -> b n d", n=n))


# as in moe.py, for DeepSeekMoE
def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, DeepSeekMoE)]


# as in moe.py, over sequences instead of routing groups
def aux_share(model, sequences):
    """This rank's share of the sequence-wise loss averaged over the global batch's sequences and
    layers."""
    layers = moe_layers(model)
    return sum(m.aux.sum() for m in layers) / (sequences * len(layers))


# ---------------------------------------------------- balancing: loss-free bias, sequence-wise loss
def update_biases(layers, rate, group):
    """Wang et al. 2024, Alg. 1, after each step: b_e += u * sign(mean_e c - c_e), c_e = tokens that
    chose expert e in the whole batch, summed over `group` (None: one process) by one all-reduce of
    (L, E)."""
    counts = torch.stack([m.wanted for m in layers]).to(torch.float64)  # (L, E), exact integers
    if group is not None:
        dist.all_reduce(counts, group=group)
    for m, c in zip(layers, counts):
        m.expert_bias += rate * torch.sign(c.mean() - c).to(m.expert_bias.dtype)


def seq_balance_loss(scores, expert, n):
    """DeepSeek-V3's sequence-wise balance loss (Sec. 2.1.2, eq. 17-20) of scores (N, E), expert (N,
    K), per sequence of n tokens: sum_e f_e P_e, f_e = E / (K n) x (tokens choosing e: top k of s +
    b), P_e = mean over the sequence of s_e / sum_j s_j; 1 under uniform routing. -> (N / n,)."""
    E, K = scores.shape[-1], expert.shape[-1]
    f = (
        rearrange(F.one_hot(expert, E).sum(1).to(scores.dtype), "(b n) e -> b n e", n=n).sum(1)
        * E
        / (K * n)
    )
    P = rearrange(scores / scores.sum(-1, keepdim=True), "(b n) e -> b n e", n=n).mean(1)  # (b, E)
    return (f * P).sum(-1)


# ---------------------------------------------------------------------- expert + data parallel step
# as in moe.py: the same code
def make_layout(d, ep):
    """The grid of the module docstring: my row is my EP group, my column my expert replicas."""
    grid = torch.arange(d.world).view(d.world // ep, ep)
    # every rank creates every group, in one order
    ep_groups = [dist.new_group(row) for row in grid.tolist()]
    replica_groups = [dist.new_group(col) for col in grid.T.tolist()]
    replica, ep_rank = divmod(d.rank, ep)
    return SimpleNamespace(
        ep=ep,
        ep_rank=ep_rank,
        ep_group=ep_groups[replica],
        replica_group=replica_groups[ep_rank],
        replicas=d.world // ep,
    )


# as in moe.py: the same code
def split_params(model):
    """(dense, expert) parameters: the routed experts are sharded over the EP group, the rest (the
    shared experts and the gate included) replicated."""
    expert = {id(p) for m in moe_layers(model) for p in (m.w1, m.b1, m.w2, m.b2)}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert], [p for p in params if id(p) in expert]


# as in moe.py: the same code
def sync_grads(model, ep_group, replica_group, dense_group):
    """Make every gradient the gradient of the global loss; return the global gradient norm. Each
    rank's loss is already its share (token sums / global token count, aux / all sequences): all
    reductions are SUMs."""
    dense, expert = split_params(model)
    # 1. Dense parameters: data parallel over every rank (dense_group; one flat bucket, as
    #   ddp_bucketed.py).
    flat = torch.cat([p.grad.flatten() for p in dense])  # (n_dense,)
    dist.all_reduce(flat, group=dense_group)
    for p, g in zip(dense, flat.split([p.numel() for p in dense])):
        p.grad.copy_(g.view_as(p))
    # 2. Routed experts: the all-to-all backward already brought the gradient of every token of my
    #    EP group that was routed to my experts; the other replicas of my experts saw other tokens.
    if dist.get_world_size(replica_group) > 1:
        for p in expert:
            dist.all_reduce(p.grad, group=replica_group)

    # 3. Global norm for clipping: dense gradients are identical everywhere (count once); expert
    #    shards are distinct within an EP group (sum their squares over it), identical over
    #    replicas. bf16: float32 sums.
    def squared_norm(ps):  # summed in float32 at least (bf16 gradients)
        return sum(
            torch.linalg.vector_norm(p.grad, dtype=torch.promote_types(p.grad.dtype, torch.float32))
            .double()
            .square()
            for p in ps
        )

    sq_dense = squared_norm(dense)
    sq_expert = squared_norm(expert)
    if dist.get_world_size(ep_group) > 1:
        dist.all_reduce(sq_expert, group=ep_group)
    return (sq_dense + sq_expert).sqrt()


# ----------------------------- main: the checks, the GPT with DeepSeekMoE blocks, one training step
def check_args(args, world):
    ep = args.ep or world
    try:  # the layer's own checks
        check_layer(args.experts, max(ep, 1), args.top_k, args.score)
    except ValueError as e:  # as one line, with the flags they were given
        fail(
            f"--experts {args.experts}, --ep {ep}, --top-k {args.top_k}, --score {args.score}: {e}"
        )
    for name in ("seq_aux_weight", "bias_rate", "shared_experts"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.granularity < 1 or 4 * args.d_model % args.granularity:
        fail(
            f"--granularity {args.granularity} must divide 4 x --d-model = {4 * args.d_model} (the "
            "width)"
        )
    if not 1 <= args.moe_every <= args.n_layers:
        fail(f"--moe-every must be in 1..--n-layers {args.n_layers}, got {args.moe_every}")
    if ep < 1 or world % ep:
        fail(f"world size {world} must be a multiple of --ep {ep} (world = replicas x ep)")
    if args.batch_size % world:
        fail(
            f"--batch-size {args.batch_size} must be divisible by the world size {world} (whole "
            "sequences)"
        )
    return ep


def build_moe_gpt(args, ep_group=None, device="cpu"):
    """common's GPT (same seed, same dense weights) with the MLP of every moe_every-th block
    replaced."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    # the MoE weights: one stream, same on every rank
    gen = torch.Generator().manual_seed(args.seed + 7919)
    for i, block in enumerate(model.blocks):
        if i % args.moe_every == args.moe_every - 1:
            # fine-grained: m experts in one MLP's width
            hidden = 4 * args.d_model // args.granularity
            block.mlp = DeepSeekMoE(
                args.d_model,
                args.experts,
                args.top_k,
                hidden,
                args.shared_experts,
                args.score,
                ep_group,
                args.dropout,
                gen,
                DTYPES[args.dtype],
            )
    return model.to(device)


def train_step(args, layout, model, opt, x, y, n_tok):
    """One optimizer step. x, y (b, n): this rank's rows of the global batch, on the device; n_tok:
    the global batch's token count. Returns this rank's shares of the LM and sequence-wise losses
    (device scalars)."""
    opt.zero_grad(set_to_none=True)
    # common.GPT's forward, unchanged: the MoE layers sit in its blocks
    lm = lm_loss(model(x), y, n_tok)
    aux = aux_share(model, args.batch_size)  # my share of the mean over sequences and layers
    (lm + args.seq_aux_weight * aux).backward()
    norm = sync_grads(model, layout.ep_group, layout.replica_group, dist.group.WORLD)
    clip_grads_([p.grad for p in model.parameters()], norm, args.clip)
    opt.step()
    # the next step routes with the new b
    update_biases(moe_layers(model), args.bias_rate, dist.group.WORLD)
    return lm.detach(), aux.detach()


# as in moe.py's main, without routing groups or the noise's step
def main():
    args = parse_args(Args)
    check_common_args(args)
    ep = check_args(args, env_world_size())  # every rank, before any collective
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    layout = make_layout(d, ep)  # this rank's EP group and expert replicas
    torch.manual_seed(args.seed + d.rank)  # dropout only; the routing has no randomness
    model = build_moe_gpt(args, layout.ep_group, d.device)
    opt = make_optimizer(model.parameters(), args)
    # resumes from --ckpt-dir (the bias too: a buffer)
    run = Run(d, args, {"model": model, "optim": opt})
    watch = Watch(d, args, layout, model, run, data)  # measurement: the banner, hooks, counters
    rows = args.batch_size // d.world
    row0 = d.rank * rows  # my slice (B/W, n) of the global batch
    for step in run.steps():
        # (B, n) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # counted on the CPU: no device sync
        x, y = x[row0 : row0 + rows], y[row0 : row0 + rows]
        # the one host-to-device copy, pinned: not waited for (pageable would be)
        if d.device.type == "cuda":
            x, y = (t.pin_memory().to(d.device, non_blocking=True) for t in (x, y))
        with run.watching(step, watch.comm, watch.acts):
            lm, aux = train_step(args, layout, model, opt, x, y, n_tok)
        watch.end_step(step, lm, aux)  # the global batch's losses, the log line, the checkpoint
    watch.finish(model, opt)  # the summary and --check


# --- measurement ---
class Watch:
    """What the summary prints, watched from outside the technique: a forward hook on every MoE
    layer keeps, per step, each expert's load (device tensors, summed over ranks once, at the end);
    a CommCounter entered on the last step sees each all-to-all at the dispatcher; SavedActivations
    the bytes autograd saves for backward in that step."""

    def __init__(self, d, args, layout, model, run, data):
        self.d = d
        self.args = args
        self.layout = layout
        self.run = run
        self.layers, self.rows = moe_layers(model), []
        self.lms, self.auxes = run.history.get("lm", []), run.history.get("aux", [])
        self.comm = CommCounter(
            axes={"ep": layout.ep_group, "replicas": layout.replica_group}, log=True
        )
        self.acts = SavedActivations()
        for m in self.layers:
            m.register_forward_hook(lambda m, i, o: self.rows.append(m.wanted.double()))
        E, ep = args.experts, layout.ep
        d.log(
            f"moe_deepseek.py: world {d.world} = {layout.replicas} replicas x ep {ep} on "
            f"{d.backend}; {E} routed experts ({E // ep} per rank, width "
            f"{4 * args.d_model // args.granularity}), top-{args.top_k}, {args.shared_experts} "
            f"shared, {args.score} gates, bias rate {args.bias_rate:g}, dropless; entropy floor "
            f"{data.entropy:.4f} nats/token"
        )

    def end_step(self, step, lm, aux):
        """The global batch's LM and aux losses for the log line (one all-reduce, one host sync per
        step)."""
        parts = torch.stack([lm.double(), aux.double()])
        dist.all_reduce(parts)
        lm, aux = parts.tolist()
        self.lms.append(lm)
        self.auxes.append(aux)
        self.run.end_step(step, lm + self.args.seq_aux_weight * aux, lm=self.lms, aux=self.auxes)

    def finish(self, model, opt):
        """The summary; the technique's own peak, read before --check trains the one-process
        reference on rank 0's device; --check; the --json summary. Exits."""
        d = self.d
        args = self.args
        layout = self.layout
        run = self.run
        f = self.summarize(d, args, layout, self.lms, self.auxes)
        peak = peak_memory_bytes(d, state_bytes(model, opt) + self.acts.bytes)
        full = full_params(layout, model) if args.check else None  # a collective: every rank
        ref = moe_reference(args, d.device) if args.check and d.rank == 0 else None
        check = check_against_reference(d, args, run.losses, full, ref=ref) if args.check else None
        run.finish("moe-deepseek", peak, f["alltoall_bytes_per_step"], check, f)

    def summarize(self, d, args, layout, lms, auxes):
        """Every step's routing summed over all ranks (one all-reduce), the last step's bytes; and
        theory."""
        E = args.experts
        L = len(self.layers)
        ep = layout.ep
        D = args.d_model
        k = args.top_k
        tokens, nbytes = args.batch_size * args.seq_len, torch.finfo(DTYPES[args.dtype]).bits // 8
        rows = self.rows or [torch.zeros(L * E, device=d.device)]  # none: resumed at the end
        mine = torch.stack(rows).view(-1, L, E)  # (steps, L, E): my tokens' choices
        load = mine.clone()
        dist.all_reduce(load)  # the global batch's routing, every step of this run
        # All-to-all bytes handed to other ranks in the last step, 4 exchanges per layer (dispatch,
        # combine and their backward), from the routed counts: 2 x (my pairs for others + theirs for
        # me) x D x bytes.
        sent = sum(c["to_others"] for c in self.comm.calls_log if c["op"] == "all_to_all")
        pairs = mine[-1].contiguous()  # (L, E): my pairs per expert, last step
        got = torch.empty(ep * L * E, dtype=pairs.dtype, device=d.device)
        dist.all_gather_single(got, pairs.flatten(), group=layout.ep_group)
        got, me = (
            got.view(ep, L, E),
            slice(layout.ep_rank * (E // ep), (layout.ep_rank + 1) * (E // ep)),
        )
        out, into = (
            pairs.sum() - pairs[:, me].sum(),
            got[:, :, me].sum() - got[layout.ep_rank, :, me].sum(),
        )
        expected = int(2 * (out + into).item() * D * nbytes)
        per_rank = [r[0].long().tolist() for r in gather_rows(d, [[sent, expected]])]
        biases = [m.expert_bias.tolist() for m in self.layers]
        f = dict(
            ep=ep,
            replicas=layout.replicas,
            capacity=None,
            expert_load=load[-1].tolist(),
            expert_load_theory_balanced=tokens * k / E,
            expert_load_per_step=load.tolist(),
            maxvio_per_step=(load.amax(-1) / load.mean(-1) - 1).mean(-1).tolist(),
            expert_bias=biases,
            lm_loss=lms[-1],
            aux_loss=auxes[-1],
            lm_losses=lms,
            aux_losses=auxes,
            alltoall_bytes_per_step=sent,
            alltoall_bytes_theory=expected,
            alltoall_bytes_per_rank=[r[0] for r in per_rank],
            alltoall_bytes_expected_per_rank=[r[1] for r in per_rank],
            counts_bytes_per_step=self.comm.total("all_gather", "ep"),
        )
        d.log(
            "summary (last step, all ranks)          measured   | theory\n"
            + "".join(
                f"  expert load, MoE layer {i}           {[int(v) for v in l]} | "
                f"{tokens * k / E:g} "
                "each if balanced (nothing dropped)\n"
                for i, l in enumerate(f["expert_load"])
            )
            + "  MaxVio per step (max/mean load - 1)  "
            f"{' '.join(f'{v:.3f}' for v in f['maxvio_per_step'])}"
            + "\n"
            + "".join(
                f"  expert bias, MoE layer {i}           {[round(v, 4) for v in b]}\n"
                for i, b in enumerate(biases)
            )
            + f"  LM loss, seq aux loss (x {args.seq_aux_weight:g})  {lms[-1]:.6f}, "
            f"{auxes[-1]:.6f}\n"
            f"  all-to-all bytes sent / step / rank  {f['alltoall_bytes_per_rank']} | "
            f"{f['alltoall_bytes_expected_per_rank']} = 2 x (pairs to others + pairs from them) x "
            "D x bytes"
            + (
                f"\n  counts all-gathered / step / rank    {f['counts_bytes_per_step']:<10} | "
                f"{L * E * 8} = layers x E x 8"
                if ep > 1
                else ""
            )
        )
        return f


# --- reference for --check ---
def full_params(layout, model):
    """The whole model by name (routed expert shards all-gathered over the EP group) and its buffers
    (the loss-free bias), for --check on rank 0."""
    _, expert = split_params(model)
    ids, out = {id(p) for p in expert}, {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if id(p) in ids and layout.ep > 1:
            parts = [torch.empty_like(p) for _ in range(layout.ep)]
            dist.all_gather(parts, p.detach().contiguous(), group=layout.ep_group)
            out[name] = torch.cat(parts)  # (E, ...) in expert order: EP rank j holds block j
        else:
            out[name] = p.detach()
    return out


def moe_reference(args, device):
    """The one-process answer: every expert local, the bias moved by the whole batch's counts (one
    process routes them all: nothing to all-reduce)."""
    model = build_moe_gpt(args, device=device)
    layers, steps = (
        moe_layers(model),
        iter(range(args.steps)),
    )  # reference_train calls loss_of once per step

    def loss_of(m, x, y, n_tok):
        if next(steps) > 0:
            # the update after step - 1, before this step routes
            update_biases(layers, args.bias_rate, None)
        return lm_loss(m(x), y, n_tok) + args.seq_aux_weight * aux_share(m, args.batch_size)

    ref = reference_train(args, device, model=model, loss_of=loss_of)
    if args.steps:
        update_biases(layers, args.bias_rate, None)
    ref["params"].update({n: b.detach().clone() for n, b in model.named_buffers()})
    return ref


if __name__ == "__main__":
    main()
