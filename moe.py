"""moe.py: mixture-of-experts layers with expert parallelism, and four routers.

The GPT of common.py with the MLP of every block (or every --moe-every'th, as GShard's every other one)
replaced by E expert MLPs and a router that sends each token to a few of them. With expert parallelism
(--ep ranks) each rank holds E/ep experts, and two all-to-alls per layer carry the tokens to the rank that
owns their expert and back (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Routers (--router):
  noisy_topk     Shazeer et al. 2017: H = x W_g + N(0,1) * softplus(x W_noise), keep the top k, softmax.
                 Aux loss CV(importance)^2 + CV(load)^2, load by the paper's smooth estimator (normal CDF).
  gshard         Lepikhin et al. 2020: top-2; the 2nd expert is kept with probability 2 * g2 (random
                 routing); aux loss E * sum_e f_e P_e (f_e: share of first choices, P_e: mean gate).
  switch         Fedus et al. 2021: top-1; the same aux loss, weighted by alpha = --aux-weight (1e-2).
  expert_choice  Zhou et al. 2022: each expert takes its own top-C tokens, so every expert is exactly full;
                 a token gets 0..E experts; no aux loss is needed.
Total loss = LM loss + --aux-weight x aux loss (aux = mean over routing groups and MoE layers).

Capacity is per routing group (GShard's "groups"): the global batch is cut into --groups groups of whole
sequences, T = batch/groups x seq_len tokens each, routed on their own with C slots per expert:
    token choice:  C = ceil(cf x k x T / E)      expert choice:  C = ceil(cf x T / E)      (both <= T)
An assignment that finds its expert full is dropped: the token keeps only its residual path. Slots go
choice by choice: every token's 1st choice is served before any 2nd choice (GShard Alg. 1), so whether a
token's 2nd choice is dropped depends on the 1st choices of *later* tokens of its group, its own sequence's
future positions included: information from the future, as expert choice's top-C is (fine for training,
not for causal decoding). A 1st choice depends only on earlier tokens of the group. Each rank
routes whole groups of its own slice, so the one-process model with the same --groups (all experts local)
computes exactly what any EP degree computes; --check compares with that reference.

    EP = 2, E = 4: rank 0 owns experts e0 e1, rank 1 owns e2 e3 (picture of rank 0; rank 1 mirrors it)
      my groups (G, T, D) --dispatch einsum--> (E, G, C, D) = [ e0 e1 | e2 e3 ]
                                                              keep  |  send to rank 1
      all-to-all -->  (ep x E/ep, G, C, D) = [ e0 e1 from rank 0 | e0 e1 from rank 1 ]
      my experts run on (E/ep, ep x G x C, D) --> all-to-all back --> (E, G, C, D)
      --combine einsum (gate weights)--> (G, T, D), added to the residual stream

Ranks form the grid torch.arange(world).view(world // ep, ep): a row is an EP group (together it holds all
E experts), a column holds copies of the same E/ep experts. Expert gradients arrive through the backward
all-to-all, already summed over the tokens of the EP group, and are summed over the column; every other
parameter is data parallel (summed over the world). Router noise and random routing are drawn from
(seed, step, layer, global row), never from a rank's RNG, so the EP degree does not change them.

Run:
    python moe.py --router switch --check                            # world 1: all experts local
    torchrun --nproc_per_node=4 moe.py --router gshard --check       # EP 4, 4 routing groups
    torchrun --nproc_per_node=4 moe.py --router expert_choice --ep 2 --check    # 2 replicas x EP 2
    python moe.py --router noisy_topk --groups 4 --check             # the one-process twin of EP 4
In production, use a fused MoE (Megatron-Core, DeepSpeed-MoE, torchtitan): grouped GEMMs and index-based
dispatch instead of the dense (T, E, C) one-hot tensors written out here for clarity.
"""
import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData, reference_train)
from harness import (check_against_reference, check_common_args, Checkpointer, CommonArgs, env_world_size,
                     log_step, maybe_fail, parse_args, peak_memory_bytes, SavedActivations, state_bytes,
                     StepTimer, write_summary)

ROUTERS = ("noisy_topk", "gshard", "switch", "expert_choice")


@dataclass
class Args(CommonArgs):
    router: Literal["noisy_topk", "gshard", "switch", "expert_choice"] = "switch"  # routing algorithm
    experts: int = 4  # experts per MoE layer (E)
    top_k: int = 0  # noisy_topk: experts per token (0 = 2); gshard is top-2 and switch top-1 by definition
    capacity_factor: float = 1.25  # slots per expert = cf x k x tokens per group / experts (k = 1: expert_choice)
    aux_weight: float = 1e-2  # total loss = LM loss + aux_weight x load-balancing loss (Switch's alpha)
    moe_every: int = 1  # an MoE layer in every n-th block (2 = every other block, as GShard), dense MLP elsewhere
    ep: int = 0  # expert-parallel degree: ranks that split one set of experts (0 = world size)
    groups: int = 0  # routing groups in the global batch; capacity is per group (0 = world size)


def experts_per_token(args):
    return {"noisy_topk": args.top_k or 2, "gshard": 2, "switch": 1, "expert_choice": 0}[args.router]


def capacity(args, tokens_per_group):
    """Slots per expert per group. A pure function of the command line, never of the data: every rank gets
    the same C, so the (E, G, C, D) all-to-all buffers match everywhere (a mismatch would hang the collective)."""
    k = experts_per_token(args) or 1  # expert choice: C = cf * T / E tokens per expert (Zhou et al., Sec. 3.1)
    return max(1, min(tokens_per_group, math.ceil(args.capacity_factor * k * tokens_per_group / args.experts)))


# ----------------------------------------------------------------------------- the routers
# Legend (einsum letters and shape comments from here on):
#   G routing groups on this rank   T tokens per group (GShard's S)   E experts   C capacity (slots per expert
#   per group)   K choices per token   D model width   H expert hidden width (4D)   r ranks of the EP group
# Every router returns dispatch (G, T, E, C) in {0, 1}: token t sits in slot c of expert e; combine
# (G, T, E, C): the gate weight that slot's output comes back with; aux (G,): the balancing loss per group;
# wanted (G, E): assignments the router asked for before capacity (for the drop statistics).
def fill_slots(expert, gate, keep, C, E):
    """Token choice -> slots. expert, gate, keep: (G, T, K), the k-th choice of each token. Slots are handed
    out choice by choice (every token's 1st choice before any 2nd choice: GShard Alg. 1), tokens in order
    within a choice; an assignment whose expert already has C earlier ones is dropped. So a 2nd choice
    queues behind the 1st choices of later tokens too (see the docstring: information from the future)."""
    K = expert.shape[-1]
    want = F.one_hot(expert, E) * keep[..., None].long()  # (G, T, K, E) requested assignments
    order = rearrange(want, "g t k e -> g (k t) e")  # priority order: choice-major, then token
    ahead = rearrange(order.cumsum(1) - order, "g (k t) e -> g t k e", k=K)  # earlier requests, same expert
    slot = (ahead * want).sum(-1)  # (G, T, K): the slot this assignment gets in its expert
    kept = (want.sum(-1) * (slot < C)).to(gate.dtype)  # (G, T, K): 1 = it has a slot, 0 = dropped
    e_hot = F.one_hot(expert, E).to(gate.dtype) * kept[..., None]  # (G, T, K, E)
    c_hot = F.one_hot(slot.clamp(max=C - 1), C).to(gate.dtype)  # (G, T, K, C)
    dispatch = torch.einsum("gtke,gtkc->gtec", e_hot, c_hot)  # (G, T, E, C); a token's K experts are distinct
    combine = torch.einsum("gtke,gtkc,gtk->gtec", e_hot, c_hot, gate)
    return dispatch, combine, want.sum((1, 2))


def balance_loss(probs, top1):
    """GShard / Switch: E * sum_e f_e P_e, f_e = fraction of tokens whose first choice is e (not
    differentiable), P_e = mean router probability (differentiable). Equals 1 under uniform routing; GShard
    Alg. 1 writes mean_e(f_e P_e), i.e. this divided by E^2, and folds the E^2 into the weight."""
    E = probs.shape[-1]
    f = F.one_hot(top1, E).to(probs.dtype).mean(1)  # (G, E)
    return E * (f * probs.mean(1)).sum(-1)  # (G,)


def route_switch(logits, C):
    """Switch (Fedus et al. 2021, Sec. 2.1-2.2): top-1; the gate is the router probability itself, so
    the router learns through it; overflow beyond C is dropped."""
    probs = logits.softmax(-1)  # (G, T, E)
    gate, top1 = probs.max(-1)  # (G, T)
    dispatch, combine, wanted = fill_slots(top1[..., None], gate[..., None], torch.ones_like(gate[..., None]), C,
                                           probs.shape[-1])
    return dispatch, combine, balance_loss(probs, top1), wanted


def route_gshard(logits, uniform, C):
    """GShard (Lepikhin et al. 2020, Alg. 1): top-2, gates renormalised over the two; the 2nd expert is
    used only if 2 * g2 > uniform (random routing: a small g2 is rarely worth a slot)."""
    probs = logits.softmax(-1)  # (G, T, E)
    top = probs.topk(2, dim=-1)  # (G, T, 2)
    gate = top.values / top.values.sum(-1, keepdim=True)  # g1, g2 with g1 + g2 = 1
    keep = torch.stack([torch.ones_like(uniform), (2 * gate[..., 1] > uniform).to(uniform.dtype)], -1)
    dispatch, combine, wanted = fill_slots(top.indices, gate, keep, C, probs.shape[-1])
    return dispatch, combine, balance_loss(probs, top.indices[..., 0]), wanted


def cv_squared(v):
    """CV^2 = variance / mean^2 over experts (population variance), per group: (G, E) -> (G,)."""
    return v.var(-1, correction=0) / (v.mean(-1) ** 2 + 1e-10)


def smooth_load(clean, noise_std, H, k):
    """Shazeer et al. 2017, Appendix A: P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_std_i), the
    chance that expert i is in the top k if only its own noise were drawn again: a differentiable load.
    For an expert inside the top k, the k-th largest of the others is the (k+1)-th overall; outside, the k-th."""
    E = H.shape[-1]
    top = H.topk(min(k + 1, E), dim=-1).values  # (G, T, k+1)
    kth = top[..., k - 1:k]
    k1th = top[..., k:k + 1] if k < E else torch.full_like(kth, -math.inf)  # k = E: always chosen
    return torch.special.ndtr((clean - torch.where(H >= kth, k1th, kth)) / noise_std)  # (G, T, E)


def route_noisy_topk(clean, noise_std, eps, k, C):
    """Shazeer et al. 2017, Sec. 2.1. clean = x W_g, noise_std = softplus(x W_noise), eps ~ N(0, 1):
    H = clean + eps * noise_std; gates = softmax over the top k of H (-inf elsewhere). Aux loss (Sec. 4):
    CV(importance)^2 + CV(load)^2, importance = sum of gates per expert, load = sum of smooth_load."""
    H = clean + eps * noise_std  # (G, T, E)
    top = H.topk(k, dim=-1)  # (G, T, K)
    gate = top.values.softmax(-1)  # (G, T, K)
    dispatch, combine, wanted = fill_slots(top.indices, gate, torch.ones_like(gate), C, H.shape[-1])
    importance = torch.zeros_like(clean).scatter(-1, top.indices, gate).sum(1)  # (G, E)
    load = smooth_load(clean, noise_std, H, k).sum(1)  # (G, E)
    return dispatch, combine, cv_squared(importance) + cv_squared(load), wanted


def route_expert_choice(logits, C):
    """Expert choice (Zhou et al. 2022, Sec. 3.1): token-to-expert affinities softmax(x W_g) (softmax over
    experts), then each expert takes its C highest-affinity tokens of the group: every expert is exactly
    full, no token is ever 'dropped' for capacity, and a token gets 0..E experts. The top-C looks at
    every token of the group, including later ones: fine for training, not for causal decoding."""
    G, T, E = logits.shape
    probs = logits.softmax(-1)  # (G, T, E)
    # A stable sort, not topk: identical tokens (same prefix) tie exactly, and the earlier one must win
    # whatever the layout, or EP degrees would disagree.
    order = torch.sort(rearrange(probs, "g t e -> g e t"), dim=-1, descending=True, stable=True)
    picked, gate = order.indices[..., :C], order.values[..., :C]  # (G, E, C): expert e's slot c holds token picked
    dispatch = rearrange(F.one_hot(picked, T).to(probs.dtype), "g e c t -> g t e c")  # (G, T, E, C)
    combine = dispatch * rearrange(gate, "g e c -> g 1 e c")
    return dispatch, combine, torch.zeros(G, dtype=probs.dtype, device=probs.device), dispatch.sum((1, 3))


# ----------------------------------------------------------------------------- dispatch, experts, combine
class AllToAll(torch.autograd.Function):
    """Equal-split all_to_all_single over the EP group: block j of dim 0 goes to rank j, block i of the
    output came from rank i. Its backward is the same exchange: the gradient of the block I sent to rank j
    comes back from rank j. `sent` counts the bytes that leave this rank."""

    @staticmethod
    def forward(ctx, x, group, sent):
        ctx.group, ctx.sent = group, sent
        return AllToAll.exchange(x, group, sent)

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.exchange(grad, ctx.group, ctx.sent), None, None

    @staticmethod
    def exchange(x, group, sent):
        x, r = x.contiguous(), dist.get_world_size(group)
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=group)
        sent[0] += x.numel() * x.element_size() * (r - 1) // r  # the block to myself stays home
        return out


def position_seed(seed, step, layer, row):
    """A seed for the random numbers of one sequence (global row) of one step and layer: any rank that
    holds that row draws the same numbers, so neither the EP degree nor the data split changes them."""
    return (((seed * 1_000_003 + step) * 1_009 + layer) * 1_000_000_007 + row) % 2 ** 63


class MoE(nn.Module):
    """Replaces a block's MLP: route -> dispatch -> all-to-all -> experts -> all-to-all -> combine."""

    def __init__(self, args, layer, groups, ep, ep_rank, ep_group, gen):
        super().__init__()
        D, H, E = args.d_model, 4 * args.d_model, args.experts
        self.router_kind, self.layer, self.seed, self.E, self.El = args.router, layer, args.seed, E, E // ep
        self.k, self.ep, self.ep_group, self.n_groups = experts_per_token(args), ep, ep_group, groups
        self.rows_per_group = args.batch_size // groups  # whole sequences: a group never splits one
        self.C = capacity(args, self.rows_per_group * args.seq_len)
        full = lambda *shape: 0.02 * torch.randn(*shape, generator=gen, dtype=torch.float64)
        self.w_gate = nn.Parameter(full(D, E))  # W_g: replicated, data parallel
        self.w_noise = nn.Parameter(full(D, E)) if args.router == "noisy_topk" else None  # W_noise
        # Every rank draws all E experts from the one generator and keeps its slice, so any EP degree starts
        # from the same numbers: model expert e = local expert e - ep_rank * El on EP rank e // El.
        mine = slice(ep_rank * self.El, (ep_rank + 1) * self.El)
        self.w1 = nn.Parameter(full(E, D, H)[mine].clone())  # (El, D, H)
        self.b1 = nn.Parameter(torch.zeros(self.El, H, dtype=torch.float64))
        self.w2 = nn.Parameter(full(E, H, D)[mine].clone())  # (El, H, D)
        self.b2 = nn.Parameter(torch.zeros(self.El, D, dtype=torch.float64))
        self.drop = nn.Dropout(args.dropout)
        self.sent = [0]  # all-to-all bytes this rank sent, forward and backward
        self.stats = torch.zeros(2 * E + 1)  # last step: load (E), wanted (E), tokens with no expert

    def draw(self, step, row0, rows, n, normal):
        """(rows, n, E) standard normals or (rows, n) uniforms for global rows row0.. of `step`."""
        out = []
        for row in range(row0, row0 + rows):
            g = torch.Generator().manual_seed(position_seed(self.seed, step, self.layer, row))
            out.append(torch.randn(n, self.E, generator=g, dtype=torch.float64) if normal
                       else torch.rand(n, generator=g, dtype=torch.float64))
        return torch.stack(out)

    def route(self, xg, step, row0, n):
        """xg (G, T, D) -> dispatch, combine, aux, wanted. Router math in float32 or wider (Switch Sec. 2.4)."""
        rdt = torch.float64 if xg.dtype == torch.float64 else torch.float32
        x, dev, G = xg.to(rdt), xg.device, xg.shape[0]
        logits = x @ self.w_gate.to(rdt)  # (G, T, E)
        if self.router_kind == "switch":
            return route_switch(logits, self.C)
        if self.router_kind == "expert_choice":
            return route_expert_choice(logits, self.C)
        noisy = self.router_kind == "noisy_topk"  # both others need random numbers while training
        r = self.draw(step, row0, G * self.rows_per_group, n, noisy) if self.training else None
        if noisy:
            eps = torch.zeros_like(logits) if r is None else rearrange(r, "(g b) n e -> g (b n) e", g=G)
            std = F.softplus(x @ self.w_noise.to(rdt)) + 1e-2  # the floor keeps Phi's argument (and grad) finite
            return route_noisy_topk(logits, std, eps.to(dev, rdt), self.k, self.C)
        u = torch.zeros_like(logits[..., 0]) if r is None else rearrange(r, "(g b) n -> g (b n)", g=G)
        return route_gshard(logits, u.to(dev, rdt), self.C)

    def experts(self, h):
        """El independent expert MLPs as batched matmuls: (El, N, D) -> (El, N, H) -> (El, N, D)."""
        h = F.gelu(torch.einsum("end,edh->enh", h, self.w1) + self.b1[:, None])
        return torch.einsum("enh,ehd->end", h, self.w2) + self.b2[:, None]

    def exchange(self, xg, dispatch, combine):
        """Tokens to their experts and back: xg (G, T, D), this rank's groups -> (G, T, D)."""
        G = xg.shape[0]
        buf = torch.einsum("gtec,gtd->egcd", dispatch.to(xg.dtype), xg)  # (E, G, C, D): slots of all E experts
        if self.ep > 1:  # block j (EP rank j's experts) -> rank j; I get every rank's slots for my experts
            buf = AllToAll.apply(buf, self.ep_group, self.sent)  # (r * El, G, C, D), block i from rank i
        h = self.experts(rearrange(buf, "(r e) g c d -> e (r g c) d", r=self.ep))  # (El, r * G * C, D)
        out = rearrange(h, "e (r g c) d -> (r e) g c d", r=self.ep, g=G)  # (r * El, G, C, D), block j for rank j
        if self.ep > 1:
            out = AllToAll.apply(out, self.ep_group, self.sent)  # (E, G, C, D): all experts' outputs, my tokens
        return torch.einsum("gtec,egcd->gtd", combine.to(xg.dtype), out)  # empty / dropped slots weigh 0

    def forward(self, x, step, row0):
        """x (b, n, D): this rank's b sequences of n positions, global rows row0.. Returns y (b, n, D) and
        this rank's share of the aux loss (its groups' sum / all groups of the global batch)."""
        b, n, D = x.shape
        xg = rearrange(x, "(g b) n d -> g (b n) d", b=self.rows_per_group)  # (G, T, D), T = rows_per_group * n
        dispatch, combine, aux, wanted = self.route(xg, step, row0, n)
        with torch.no_grad():
            self.stats = torch.cat([dispatch.sum((0, 1, 3)), wanted.sum(0).to(dispatch.dtype),
                                    (dispatch.sum((2, 3)) == 0).sum().to(dispatch.dtype).view(1)])  # (2E + 1,)
        y = self.exchange(xg, dispatch, combine)
        return self.drop(rearrange(y, "g (b n) d -> (g b) n d", n=n)), aux.sum() / self.n_groups


def build_moe_gpt(args, groups, ep=1, ep_rank=0, ep_group=None, device="cpu"):
    """common's GPT (same seed, same dense weights) with the MLP of every moe_every-th block replaced."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, torch.float64)
    gen = torch.Generator().manual_seed(args.seed + 7919)  # the MoE weights: one stream, same on every rank
    for i, block in enumerate(model.blocks):
        if i % args.moe_every == args.moe_every - 1:
            block.mlp = MoE(args, i, groups, ep, ep_rank, ep_group, gen)
    return model.to(device=device, dtype=DTYPES[args.dtype])


def moe_layers(model):
    return [b.mlp for b in model.blocks if isinstance(b.mlp, MoE)]


def forward(model, idx, step, row0):
    """common.GPT's forward, with the step and global row offset handed to the MoE layers. idx (b, n) ->
    (logits (b, n, V), aux): this rank's share of the aux loss averaged over groups and MoE layers."""
    h, aux = model.embed(idx), 0.0
    for block in model.blocks:
        h = h + block.attn(block.ln1(h))
        if isinstance(block.mlp, MoE):
            y, a = block.mlp(block.ln2(h), step, row0)
            h, aux = h + y, aux + a
        else:
            h = h + block.mlp(block.ln2(h))
    return model.head(model.ln_f(h)), aux / len(moe_layers(model))


# ----------------------------------------------------------------------------- expert parallel + data parallel step
@dataclass
class Layout:
    ep: int  # ranks in one EP group (together they hold all E experts)
    ep_rank: int  # my place in it: I own experts ep_rank * E/ep ... (ep_rank + 1) * E/ep - 1
    ep_group: object
    replica_group: object  # the ranks holding copies of my experts
    replicas: int


def make_layout(d, ep):
    """Grid torch.arange(world).view(world // ep, ep): a row is an EP group, a column a set of replicas."""
    grid = torch.arange(d.world).view(d.world // ep, ep)
    ep_group = replica_group = None
    for row in grid:  # every rank creates every group, in the same order
        g = dist.new_group(row.tolist())
        ep_group = g if d.rank in row.tolist() else ep_group
    for col in grid.T:
        g = dist.new_group(col.tolist())
        replica_group = g if d.rank in col.tolist() else replica_group
    return Layout(ep, d.rank % ep, ep_group, replica_group, d.world // ep)


def split_params(model):
    """(dense, expert) parameters: expert weights are sharded over the EP group, the rest replicated."""
    expert = {id(p) for m in moe_layers(model) for p in (m.w1, m.b1, m.w2, m.b2)}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert], [p for p in params if id(p) in expert]


def sync_grads(lay, model):
    """Make every gradient the gradient of the global loss; return the global gradient norm.
    Each rank's loss is already its share (token sums / global token count, aux / total groups), so all
    reductions are SUMs."""
    dense, expert = split_params(model)
    # 1. Dense parameters: data parallel over the whole world (one flat bucket; see ddp_bucketed.py for overlap).
    flat = torch.cat([p.grad.flatten() for p in dense])  # (n_dense,)
    dist.all_reduce(flat, group=dist.group.WORLD)
    i = 0
    for p in dense:
        p.grad.copy_(flat[i:i + p.numel()].view_as(p))
        i += p.numel()
    # 2. Expert parameters: the all-to-all backward already brought the gradient of every token of my EP
    #    group that was routed to my experts; the other replicas of my experts saw other tokens.
    if lay.replicas > 1:
        for p in expert:
            dist.all_reduce(p.grad, group=lay.replica_group)
    # 3. Global norm for clipping: dense gradients are identical everywhere (count once); expert shards are
    #    distinct within an EP group (sum their squares over it) and identical across replicas.
    sq_dense = sum(p.grad.double().pow(2).sum() for p in dense)
    sq_expert = sum(p.grad.double().pow(2).sum() for p in expert)
    if lay.ep > 1:
        dist.all_reduce(sq_expert, group=lay.ep_group)
    return (sq_dense + sq_expert).sqrt()


def train_step(d, args, lay, model, opt, x, y, step):
    """One optimizer step on the global batch x, y (B, T) on CPU. Returns (total, LM, aux) of the global batch."""
    rows = args.batch_size // d.world
    row0 = d.rank * rows  # my slice: (B/W, T), i.e. groups row0 / rows_per_group ... of the global batch
    n_tok = count_tokens(y)
    xl, yl = x[row0:row0 + rows].to(d.device), y[row0:row0 + rows].to(d.device)
    opt.zero_grad(set_to_none=True)
    logits, aux = forward(model, xl, step, row0)  # (B/W, T, V); aux: my share of the mean over groups, layers
    lm = lm_loss(logits, yl, n_tok)
    (lm + args.aux_weight * aux).backward()
    params = list(model.parameters())
    clip_grads_([p.grad for p in params], sync_grads(lay, model), args.clip)
    opt.step()
    parts = torch.stack([lm.detach().double(), aux.detach().double()])
    dist.all_reduce(parts, group=dist.group.WORLD)  # for the log (16 bytes; not counted as traffic)
    lm_g, aux_g = parts.tolist()
    return lm_g + args.aux_weight * aux_g, lm_g, aux_g


def full_params(lay, model):
    """The whole model by name (expert shards all-gathered over the EP group), for --check on rank 0."""
    _, expert = split_params(model)
    ids, out = {id(p) for p in expert}, {}
    for name, p in model.named_parameters():
        if id(p) in ids and lay.ep > 1:
            parts = [torch.empty_like(p) for _ in range(lay.ep)]
            dist.all_gather(parts, p.detach().contiguous(), group=lay.ep_group)
            out[name] = torch.cat(parts)  # (E, ...) in expert order: EP rank j holds block j
        else:
            out[name] = p.detach()
    return out


def moe_reference(args, groups, device):
    """The one-process answer: every expert local, the same routing groups, the same random numbers."""
    model = build_moe_gpt(args, groups, device=device)
    steps = iter(range(args.steps))  # reference_train calls loss_of once per step, in order

    def loss_of(m, x, y, n_tok):
        logits, aux = forward(m, x, next(steps), 0)
        return lm_loss(logits, y, n_tok) + args.aux_weight * aux

    return reference_train(args, device, model=model, loss_of=loss_of)


# --- measurement ---
def summarize(d, args, lay, layers, groups, sent, lms, auxes):
    """The last step's routing, summed over all ranks, printed beside theory; returns the --json figures."""
    E, T, k, ep = args.experts, args.batch_size // groups * args.seq_len, experts_per_token(args), lay.ep
    C, tokens = capacity(args, T), args.batch_size * args.seq_len
    stats = torch.stack([m.stats for m in layers]).to(d.device, torch.float64)  # (layers, 2E + 1)
    dist.all_reduce(stats, group=dist.group.WORLD)
    load, wanted, idle = stats[:, :E], stats[:, E:2 * E], stats[:, 2 * E]
    fair = tokens * k / E if k else groups * C  # tokens per expert per layer when perfectly balanced
    drop_theory = max(0.0, 1 - C / (k * T / E)) if k else 0.0
    a2a_theory = 4 * len(layers) * (ep - 1) * (E // ep) * (groups // d.world) * C * args.d_model * \
        (torch.finfo(DTYPES[args.dtype]).bits // 8)
    f = dict(capacity=C, tokens_per_group=T, groups=groups, ep=ep, replicas=lay.replicas,
             expert_load=load.tolist(), expert_load_theory_balanced=fair,
             load_cv=(load.std(-1, correction=0) / load.mean(-1)).mean().item(),
             dropped_frac=(1 - load.sum() / wanted.sum()).item(), dropped_frac_theory_balanced=drop_theory,
             tokens_without_expert_frac=(idle.sum() / (tokens * len(layers))).item(),
             lm_loss=lms[-1] if lms else None, aux_loss=auxes[-1] if auxes else None, lm_losses=lms,
             aux_losses=auxes, alltoall_bytes_per_step=sent, alltoall_bytes_theory=a2a_theory)
    d.log("summary (last step, all ranks)          measured   | theory\n"
          f"  capacity C per expert per group      {C:<10} | ceil(cf x {k or 1} x T / E), at most T = {T}\n"
          + "".join(f"  expert load, MoE layer {i}           {[int(v) for v in l]} | {fair:g} each if balanced\n"
                    for i, l in enumerate(load.tolist()))
          + f"  dropped assignments                  {f['dropped_frac']:<10.2%} | {drop_theory:.2%} if balanced "
          f"(max(0, 1 - C E / (k T)))\n"
          f"  tokens with no expert                {f['tokens_without_expert_frac']:<10.2%} |\n"
          f"  LM loss, aux loss (x {args.aux_weight:g})  {lms[-1] if lms else 0:.6f}, {auxes[-1] if auxes else 0:.6f}\n"
          f"  all-to-all bytes sent / step / rank  {sent:<10} | {a2a_theory} = "
          "4 x layers x (ep-1)/ep x E x G/W x C x D x bytes")
    return f


# ----------------------------------------------------------------------------- main
def check_moe_args(args, world):
    ep, groups, k, E = args.ep or world, args.groups or world, experts_per_token(args), args.experts
    if E < 1:
        fail(f"--experts must be >= 1, got {E}")
    if args.capacity_factor <= 0:
        fail(f"--capacity-factor must be > 0, got {args.capacity_factor} (1.0 = each expert's fair share of slots)")
    if args.router in ("gshard", "switch") and args.top_k not in (0, k):
        fail(f"--router {args.router} is top-{k} by definition; drop --top-k, or use --router noisy_topk")
    if args.router == "expert_choice" and args.top_k:
        fail("--router expert_choice has no per-token k (each expert takes cf x T / E tokens); drop --top-k")
    if args.top_k < 0 or k > E:
        fail(f"top-k {k} must be in 1..--experts {E}: a token cannot pick more experts than exist")
    if args.aux_weight < 0:
        fail(f"--aux-weight must be >= 0, got {args.aux_weight}")
    if not 1 <= args.moe_every <= args.n_layers:
        fail(f"--moe-every must be in 1..--n-layers {args.n_layers}, got {args.moe_every}")
    if ep < 1 or E % ep:
        fail(f"--experts {E} is not divisible by --ep {ep}: each rank holds experts/ep experts; "
             f"try --experts {ep * max(1, -(-E // ep))}")
    if world % ep:
        fail(f"world size {world} must be a multiple of --ep {ep} (world = replicas x ep)")
    if groups < 1 or groups % world:
        fail(f"--groups {groups} must be a multiple of the world size {world}: each rank routes whole groups")
    if args.batch_size % groups:
        fail(f"--batch-size {args.batch_size} must be divisible by --groups {groups} (whole sequences per group)")
    return ep, groups


def main():
    args = parse_args(Args)
    world = env_world_size()
    check_common_args(args)
    ep, groups = check_moe_args(args, world)  # every rank, before any collective
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    lay = make_layout(d, ep)
    E, T, k = args.experts, args.batch_size // groups * args.seq_len, experts_per_token(args)
    C = capacity(args, T)
    d.log(f"moe.py --router {args.router}: world {d.world} = {lay.replicas} replicas x ep {ep} on {d.backend}; "
          f"{E} experts ({E // ep} per rank), {groups} routing groups of T={T} tokens, capacity C={C}; "
          f"entropy floor {data.entropy:.4f} nats/token")
    torch.manual_seed(args.seed + d.rank)  # dropout only; routing randomness comes from position_seed
    model = build_moe_gpt(args, groups, ep, lay.ep_rank, lay.ep_group, d.device)
    layers = moe_layers(model)
    opt = make_optimizer(model.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": model, "optim": opt})
    losses, lms, auxes = hist.get("losses", []), hist.get("lm", []), hist.get("aux", [])
    timer, saved, sent = StepTimer(d.device), 0, 0
    tokens = args.batch_size * args.seq_len
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, n) global batch, CPU
        for m in layers:
            m.sent[0] = 0
        with SavedActivations() as acts:
            loss, lm, aux = train_step(d, args, lay, model, opt, x, y, step)
        saved, sent = max(saved, acts.bytes), sum(m.sent[0] for m in layers)
        losses.append(loss), lms.append(lm), auxes.append(aux)
        log_step(d, step, loss, timer.stop(), tokens)
        ckpt.maybe_save(step + 1, {"model": model, "optim": opt}, {"losses": losses, "lm": lms, "aux": auxes})

    f = summarize(d, args, lay, layers, groups, sent, lms, auxes)
    # The technique's own peak, read before --check trains the one-process reference on rank 0's device.
    peak = peak_memory_bytes(d, state_bytes(model, opt) + saved)
    check = None
    if args.check:
        full = full_params(lay, model)  # a collective: every rank
        ref = moe_reference(args, groups, d.device) if d.rank == 0 else None
        check = check_against_reference(d, args, losses, full, ref=ref)
    write_summary(d, args, f"moe-{args.router}", losses, timer.median(), tokens / max(timer.median(), 1e-9) * 1e3,
                  peak, sent, check, f)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
