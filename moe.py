"""moe.py: mixture-of-experts layers with expert parallelism, the 2017-2022 line: noisy top-k,
GShard, Switch, expert choice (the 2024 line, DeepSeek's fine-grained, shared, loss-free and
dropless MoE: moe_deepseek.py).

The GPT of common.py with the MLP of every block (or every --moe-every'th, as GShard's every other
one) replaced by E expert MLPs and a router that sends each token to a few of them. With expert
parallelism (--ep ranks) each rank holds E/ep experts, and two all-to-alls per layer carry the
tokens to the rank that owns their expert and back (GShard, Lepikhin et al. 2020; Switch
Transformer, Fedus et al. 2021).

Routers (--router), each a small module that returns the slots its tokens take:
  noisy_topk     Shazeer et al. 2017 (the base, read first): the top k of x W_g + noise, softmax over them;
                 aux loss CV(importance)^2 + CV(load)^2, load by the paper's smooth estimator
                 (normal CDF).
  gshard         Lepikhin et al. 2020: top-2; the 2nd expert is kept with probability 2 * g2 (random
                 routing); aux loss E * sum_e f_e P_e (f_e: share of first choices, P_e: mean gate).
  switch         Fedus et al. 2021: top-1; the same aux loss.
  expert_choice  Zhou et al. 2022: each expert takes its own top-C tokens, so every expert is exactly full;
                 a token gets 0..E experts; no aux loss is needed.
Total loss = LM loss + --aux-weight x aux (aux: mean over routing groups and MoE layers; Switch's
alpha). Exact ties in every top-k and in expert choice's order go to the lower expert index (the
earlier token): a stable sort, where torch.topk leaves the order of equal values to the kernel, and
CPU and CUDA differ.

Capacity is per routing group (GShard's "groups"): the global batch is cut into --groups groups of
whole sequences, T = batch/groups x seq_len tokens each, routed on their own with C slots per
expert:
    token choice:  C = ceil(cf x k x T / E)      expert choice:  C = ceil(cf x T / E)      (both <= T)
An assignment that finds its expert full is dropped: the token keeps only its residual path. Every
token's 1st choice is served before any 2nd choice (GShard Alg. 1), so whether a 2nd choice gets a
slot depends on the 1st choices of *later* tokens, its own sequence's future included: information
from the future, as in expert choice's top-C (fine for training, not for causal decoding). A 1st
choice sees only earlier tokens.

    EP = 2, E = 4: rank 0 owns experts e0 e1, rank 1 owns e2 e3 (picture of rank 0; rank 1 mirrors
    it)
      my groups (G, T, D) --dispatch einsum--> (E, G, C, D) = [ e0 e1 | e2 e3 ]
                                                              keep  |  send to rank 1
      all-to-all -->  (ep x E/ep, G, C, D) = [ e0 e1 from rank 0 | e0 e1 from rank 1 ]
      my experts run on (E/ep, ep x G x C, D) --> all-to-all back --> (E, G, C, D)
      --combine einsum (gate weights)--> (G, T, D), added to the residual stream
Every size comes from the command line (C included): every rank builds the same buffers, and nothing
syncs.

Ranks form the grid torch.arange(world).view(world // ep, ep): a row is an EP group (together all E
experts), a column holds copies of the same E/ep experts (their gradients summed over it); the rest
is data parallel.

Reading order: the base layer first, complete with one router (Shazeer's noisy top-k: the router,
capacity, the slots, the all-to-all exchange, the MoE module); then the other routers, plugged into
the same MoE (GShard, Switch, expert choice); then expert parallelism's step (the grid, the expert +
data parallel gradients, the global norm). That is the technique section (torch and einops only);
after check_args, this repo's run of it: the GPT with MoE blocks (build_moe_gpt) and one optimizer
step (train_step).

Run:
    python moe.py --router switch --check                            # world 1: all experts local
    torchrun --nproc_per_node=4 moe.py --router gshard --check       # EP 4, 4 routing groups
    torchrun --nproc_per_node=4 moe.py --router expert_choice --ep 2 --check    # 2 replicas x EP 2
    python moe.py --router noisy_topk --groups 4 --check             # the one-process twin of EP 4
In production, use a fused MoE (Megatron-Core, DeepSpeed-MoE, torchtitan): grouped GEMMs and
index-based dispatch instead of the dense (T, E, C) one-hot tensors written out here for clarity.

Legend (einsum letters and shape comments): G routing groups on this rank, T tokens per group
(GShard's S), E experts, C capacity (slots per expert per group), K choices per token, D model
width, H expert hidden width (4D), r ranks of the EP group. A token-choice router picks expert,
gate, keep (G, T, K): each token's k-th choice, its gate weight, and 1 if it is wanted (0: gshard's
dropped 2nd choice); fill_slots turns them into dispatch and combine (G, T, E, C): token t sits in
slot c of expert e, and comes back with that gate weight. Expert choice returns dispatch and combine
itself.
"""

import math
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
    router: Literal["noisy_topk", "gshard", "switch", "expert_choice"] = "switch"  # the router
    experts: int = 4  # experts per MoE layer (E)
    # noisy_topk: experts per token (0 = 2); gshard is top-2, switch top-1, expert choice none
    top_k: int = 0
    capacity_factor: float = 1.25  # slots/expert: cf x k x group tokens / E (expert_choice: k = 1)
    aux_weight: float = 1e-2  # loss = LM loss + aux_weight x load-balancing loss (Switch's alpha)
    moe_every: int = 1  # an MoE layer in every n-th block (2: as GShard), dense MLPs between
    ep: int = 0  # expert-parallel degree: ranks that split one set of experts (0 = world size)
    groups: int = 0  # routing groups in the global batch; capacity is per group (0 = world size)


# ------------------------------------ the base layer: noisy top-k routing, capacity, the all-to-all
def check_layer(experts, ep, capacity_factor):
    """What the layer relies on (MoE and check_args both call it, before any collective)."""
    if experts < 1 or experts % ep:
        raise ValueError(
            f"experts = {experts} is not divisible by ep = {ep} (each rank holds experts/ep "
            f">= 1): try experts = {ep * max(1, -(-experts // ep))}"
        )
    if not capacity_factor > 0:
        raise ValueError(
            f"capacity_factor must be > 0, got {capacity_factor} (1: each expert's fair share "
            "of slots); dropless routing is moe_deepseek.py's"
        )


def check_top_k(k, experts):
    if not 1 <= k <= experts:
        raise ValueError(f"k = {k} with {experts} experts: noisy_topk takes 1..{experts}")


def init(generator, dtype, *shape):
    """N(0, 0.02) weights drawn in float64 from the MoE weights' one generator (the same at any
    EP)."""
    return (0.02 * torch.randn(*shape, generator=generator, dtype=torch.float64)).to(dtype)


def capacity(capacity_factor, k, tokens_per_group, experts):
    """Slots per expert per group (expert choice, k = 0: cf T / E, Zhou et al. Sec. 3.1), from the
    command line only: every rank gets the same C, so the (E, G, C, D) all-to-all buffers match
    (else it hangs)."""
    return max(
        1, min(tokens_per_group, math.ceil(capacity_factor * (k or 1) * tokens_per_group / experts))
    )


def top_k(scores, k):
    """torch.topk with exact ties broken by the lower index: a stable descending sort (topk leaves
    the order of equal values to the kernel: a CPU rank and a GPU one could route differently). (..,
    n) -> (.., k)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True)
    return order.values[..., :k], order.indices[..., :k]


def fill_slots(expert, gate, keep, C, E):
    """Token choice -> slots: dispatch, combine (G, T, E, C). Slots go choice by choice (GShard Alg.
    1), tokens in order within a choice; an assignment whose expert already has C earlier ones is
    dropped."""
    K = expert.shape[-1]
    want = F.one_hot(expert, E) * keep[..., None].long()  # (G, T, K, E) requested assignments
    order = rearrange(want, "g t k e -> g (k t) e")  # priority order: choice-major, then token
    # earlier requests, same expert
    ahead = rearrange(order.cumsum(1) - order, "g (k t) e -> g t k e", k=K)
    slot = (ahead * want).sum(-1)  # (G, T, K): the slot this assignment gets in its expert
    # (G, T, K, E): the wanted ones that got a slot
    e_hot = (want * (slot < C)[..., None]).to(gate.dtype)
    c_hot = F.one_hot(slot.clamp(max=C - 1), C).to(gate.dtype)  # (G, T, K, C)
    # (G, T, E, C); a token's K experts are distinct
    dispatch = torch.einsum("gtke,gtkc->gtec", e_hot, c_hot)
    return dispatch, torch.einsum("gtke,gtkc,gtk->gtec", e_hot, c_hot, gate)


def token_choice(expert, gate, keep, aux, C, E):
    """A token-choice router's picks (G, T, K) -> what MoE takes from every router: dispatch,
    combine (G, T, E, C), aux (G,), and wanted (E,), the choices per expert before capacity (read by
    the summary)."""
    wanted = (F.one_hot(expert, E) * keep[..., None]).detach().sum((0, 1, 2))
    return *fill_slots(expert, gate, keep, C, E), aux, wanted


def router_logits(xg, w_gate):
    """x W_g (G, T, E) in float32 or wider (Switch Sec. 2.4: bf16 routing is unstable), and that
    x."""
    x = xg.to(torch.promote_types(xg.dtype, torch.float32))
    return x @ w_gate.to(x.dtype), x


def cv_squared(v):
    """CV^2 = variance / mean^2 over experts (population variance), per group: (G, E) -> (G,)."""
    return v.var(-1, correction=0) / (v.mean(-1) ** 2 + 1e-10)


def smooth_load(clean, noise_std, H, k):
    """Shazeer et al. 2017, Appendix A: P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) /
    noise_std_i), the chance that expert i is in the top k if only its own noise were drawn again: a
    differentiable load. For an expert inside the top k, the k-th largest of the others is the
    (k+1)-th overall; outside, the k-th."""
    # k = E: every expert always chosen, a load of 1 (a margin of inf has no gradient)
    if k >= H.shape[-1]:
        return torch.ones_like(clean)
    top = H.topk(k + 1, dim=-1).values  # (G, T, k+1): values only, so ties cannot reorder anything
    kth, k1th = top[..., k - 1 : k], top[..., k : k + 1]
    return torch.special.ndtr((clean - torch.where(H >= kth, k1th, kth)) / noise_std)  # (G, T, E)


def route_noisy_topk(clean, noise_std, eps, k):
    """Shazeer et al. 2017, Sec. 2.1 and 4: H = clean + eps * noise_std (clean = x W_g, noise_std =
    softplus(x W_noise), eps ~ N(0, 1)), gates = softmax over the top k of H; aux = CV(importance)^2
    + CV(load)^2."""
    H = clean + eps * noise_std  # (G, T, E)
    values, expert = top_k(H, k)  # (G, T, K)
    gate = values.softmax(-1)  # (G, T, K)
    importance = torch.zeros_like(clean).scatter(-1, expert, gate).sum(1)  # (G, E)
    load = smooth_load(clean, noise_std, H, k).sum(1)  # (G, E)
    return expert, gate, torch.ones_like(gate), cv_squared(importance) + cv_squared(load)


class NoisyTopK(nn.Module):
    """Shazeer et al. 2017's gating network: W_g and W_noise (D, E), replicated (data parallel, as
    attention). A router takes this rank's groups xg (G, T, D), the capacity C and the layer's
    noise(sampler, like), and returns token_choice's four: dispatch, combine, aux, wanted. Noise
    only while training."""

    def __init__(self, d_model, experts, k=2, generator=None, dtype=torch.float64):
        super().__init__()
        check_top_k(k, experts)
        self.E = experts
        self.k = k
        self.w_gate = nn.Parameter(init(generator, dtype, d_model, experts))  # W_g
        self.w_noise = nn.Parameter(init(generator, dtype, d_model, experts))  # W_noise

    def forward(self, xg, C, noise):
        logits, x = router_logits(xg, self.w_gate)
        eps = noise(torch.randn, logits) if self.training else torch.zeros_like(logits)
        # the floor keeps Phi's argument finite
        std = F.softplus(x @ self.w_noise.to(x.dtype)) + 1e-2
        return token_choice(*route_noisy_topk(logits, std, eps, self.k), C, self.E)


class AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0, even: block j of the rows to rank j, block i of the output from
    rank i (every buffer here is (E, G, C, D): equal blocks). Its backward is the same exchange: the
    gradient of the block I sent to j comes from j. moe_deepseek.py's takes uneven splits."""

    @staticmethod
    def forward(ctx, x, group):
        r = dist.get_world_size(group)
        if x.shape[0] % r:  # checked: rows that do not split abort the collective
            raise ValueError(
                f"{x.shape[0]} rows do not split over {r} ranks: use a multiple of {r}"
            )
        ctx.group = group
        out = x.new_empty(x.shape)
        dist.all_to_all_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group), None


def mlps(h, w1, b1, w2, b2):
    """gelu(h w1 + b1) w2 + b2 for X experts at once as batched matmuls: w1 (X, D, H), b1 (X, H),
    w2 (X, H, D), b2 (X, D); h (X, N, D) -> (X, N, D)."""
    return F.gelu(h @ w1 + b1[..., None, :]) @ w2 + b2[..., None, :]


class MoE(nn.Module):
    """Replaces an MLP: route -> dispatch -> all-to-all -> experts -> all-to-all -> combine. x (b,
    n, D) -> (b, n, D), cut into routing groups of `group_rows` whole sequences; router: a module
    built for the same E (NoisyTopK above, or one of the routers after it); ep_group: the ranks that
    split the E experts (None: all local). A forward leaves `aux` (G,), the balancing loss per
    group, and for the summary `wanted` (E,), this rank's choices per expert before capacity, and
    `dispatch`, the slots taken."""

    def __init__(
        self,
        d_model,
        experts,
        router,
        capacity_factor=1.25,
        group_rows=1,
        ep_group=None,
        hidden=None,
        dropout=0.0,
        seed=0,
        layer=0,
        generator=None,
        dtype=torch.float64,
    ):
        super().__init__()
        D = d_model
        H = hidden or 4 * d_model
        E = experts
        self.router = router
        self.cf = capacity_factor
        self.E = E
        self.group_rows = group_rows
        # the noise's key (set_step)
        self.seed = seed
        self.layer = layer
        self.step = 0
        self.row0 = 0
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.El = E // max(1, self.ep)  # experts on this rank
        check_layer(E, self.ep, capacity_factor)  # what it cannot do, before any collective
        if router.E != E:
            # All E experts drawn from one generator, my slice kept: every EP degree starts from the
            # same numbers.
            raise ValueError(
                f"a router for {router.E} experts in a layer of {E}: build both for the same E"
            )
        mine = slice(self.ep_rank * self.El, (self.ep_rank + 1) * self.El)
        self.w1 = nn.Parameter(init(generator, dtype, E, D, H)[mine].clone())
        self.b1 = nn.Parameter(torch.zeros(self.El, H, dtype=dtype))
        self.w2 = nn.Parameter(init(generator, dtype, E, H, D)[mine].clone())
        self.b2 = nn.Parameter(torch.zeros(self.El, D, dtype=dtype))
        self.drop = nn.Dropout(dropout)
        self.dispatch = None
        self.wanted = None
        self.aux = None

    def noise(self, sample, like):
        """Normals (noisy_topk) or uniforms (gshard) like `like`, (G, T, E) or (G, T), one generator
        per (seed, step, layer, global group): the same numbers whatever the EP degree or the data
        split."""
        group0 = self.row0 // self.group_rows
        out = []
        for g in range(group0, group0 + like.shape[0]):
            seed = (
                ((self.seed * 1_000_003 + self.step) * 1_009 + self.layer) * 1_000_000_007 + g
            ) % 2**63
            gen = torch.Generator(like.device).manual_seed(seed)
            out.append(sample(like.shape[1:], generator=gen, device=like.device, dtype=like.dtype))
        return torch.stack(out)

    def exchange(self, xg, dispatch, combine):
        """Tokens to their experts' slots and back: xg (G, T, D), this rank's groups -> (G, T,
        D)."""
        G = xg.shape[0]
        # (E, G, C, D): all E experts' slots
        buf = torch.einsum("gtec,gtd->egcd", dispatch.to(xg.dtype), xg)
        # block j (EP rank j's experts) -> rank j; I get every rank's slots for my experts
        if self.ep > 1:
            buf = AllToAll.apply(buf, self.ep_group)  # (r * El, G, C, D), block i from rank i
        h = mlps(
            rearrange(buf, "(r e) g c d -> e (r g c) d", r=self.ep),
            self.w1,
            self.b1,
            self.w2,
            self.b2,
        )
        # (r * El, G, C, D): block j for j
        out = rearrange(h, "e (r g c) d -> (r e) g c d", r=self.ep, g=G)
        if self.ep > 1:
            # (E, G, C, D): all experts' outputs, my tokens
            out = AllToAll.apply(out, self.ep_group)
        # empty / dropped slots weigh 0
        return torch.einsum("gtec,egcd->gtd", combine.to(xg.dtype), out)

    def forward(self, x):
        """x (b, n, D): this rank's b sequences of n positions, global rows self.row0 .. -> (b, n,
        D)."""
        n = x.shape[1]
        # every EP rank must also route as many groups of as many tokens
        if x.shape[0] % self.group_rows:
            # (G, T, D), T = group_rows * n
            raise ValueError(
                f"{x.shape[0]} sequences: use a multiple of group_rows = {self.group_rows}"
            )
        xg = rearrange(x, "(g b) n d -> g (b n) d", b=self.group_rows)
        C = capacity(self.cf, self.router.k, xg.shape[1], self.E)
        dispatch, combine, self.aux, self.wanted = self.router(xg, C, self.noise)
        self.dispatch = dispatch.detach()
        return self.drop(
            rearrange(self.exchange(xg, dispatch, combine), "g (b n) d -> (g b) n d", n=n)
        )


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_step(model, step, row0):
    """Before each forward: the step and this rank's first global row (they key the routers'
    noise)."""
    for m in moe_layers(model):
        m.step = step
        m.row0 = row0


def aux_share(model, groups):
    """This rank's share of the aux loss averaged over all `groups` routing groups and every MoE
    layer."""
    layers = moe_layers(model)
    return sum(m.aux.sum() for m in layers) / (groups * len(layers))


# ---------------------------------------------- more routers: GShard's top-2, Switch, expert choice
def balance_loss(probs, top1):
    """GShard / Switch's E * sum_e f_e P_e per group (see the top; f_e is not differentiable, P_e
    is): 1 under uniform routing. GShard Alg. 1 writes mean_e(f_e P_e), this / E^2, and folds the
    E^2 into the weight."""
    E = probs.shape[-1]
    f = F.one_hot(top1, E).to(probs.dtype).mean(1)  # (G, E)
    return E * (f * probs.mean(1)).sum(-1)  # (G,)


def route_gshard(logits, uniform):
    """GShard (Lepikhin et al. 2020, Alg. 1): top-2, gates renormalised over the two; the 2nd expert
    is used only if 2 * g2 > uniform (random routing: a small g2 is rarely worth a slot)."""
    probs = logits.softmax(-1)  # (G, T, E)
    values, expert = top_k(probs, 2)  # (G, T, 2)
    gate = values / values.sum(-1, keepdim=True)  # g1, g2 with g1 + g2 = 1
    keep = torch.stack(
        [torch.ones_like(uniform), (2 * gate[..., 1] > uniform).to(uniform.dtype)], -1
    )
    return expert, gate, keep, balance_loss(probs, expert[..., 0])


def route_switch(logits):
    """Switch (Fedus et al. 2021, Sec. 2.1-2.2): top-1; the gate is the router probability itself,
    so the router learns through it; overflow beyond C is dropped (by fill_slots)."""
    probs = logits.softmax(-1)  # (G, T, E)
    gate, top1 = top_k(probs, 1)  # (G, T, 1)
    return top1, gate, torch.ones_like(gate), balance_loss(probs, top1[..., 0])


def route_expert_choice(logits, C):
    """Expert choice (Zhou et al. 2022, Sec. 3.1): token-to-expert affinities softmax(x W_g)
    (softmax over experts), then each expert takes its C highest-affinity tokens of the group, later
    ones included."""
    T = logits.shape[1]
    probs = logits.softmax(-1)  # (G, T, E)
    # (G, E, C): the token in expert e's slot c
    gate, picked = top_k(rearrange(probs, "g t e -> g e t"), C)
    dispatch = rearrange(F.one_hot(picked, T).to(probs.dtype), "g e c t -> g t e c")  # (G, T, E, C)
    return dispatch, dispatch * rearrange(gate, "g e c -> g 1 e c")


class GShard(nn.Module):
    """GShard's top-2 with random routing (uniforms from the layer's noise), plugged in like
    NoisyTopK."""

    k = 2

    def __init__(self, d_model, experts, generator=None, dtype=torch.float64):
        super().__init__()
        self.E = experts
        self.w_gate = nn.Parameter(init(generator, dtype, d_model, experts))

    def forward(self, xg, C, noise):
        logits = router_logits(xg, self.w_gate)[0]
        u = noise(torch.rand, logits[..., 0]) if self.training else torch.zeros_like(logits[..., 0])
        return token_choice(*route_gshard(logits, u), C, self.E)


class Switch(GShard):
    """Switch's top-1 (no noise): the same gate W_g, the same balancing loss."""

    k = 1

    def forward(self, xg, C, noise):
        return token_choice(*route_switch(router_logits(xg, self.w_gate)[0]), C, self.E)


class ExpertChoice(GShard):
    """Expert choice: the experts pick (C = cf T / E each, k = 0 in capacity); no balancing loss."""

    k = 0

    def forward(self, xg, C, noise):
        dispatch, combine = route_expert_choice(router_logits(xg, self.w_gate)[0], C)
        return dispatch, combine, dispatch.new_zeros(xg.shape[0]), dispatch.detach().sum((0, 1, 3))


ROUTERS = dict(noisy_topk=NoisyTopK, gshard=GShard, switch=Switch, expert_choice=ExpertChoice)


# ---------------------------------------------------------------------- expert + data parallel step
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


def split_params(model):
    """(dense, expert) parameters: the routed experts are sharded over the EP group, the rest
    replicated."""
    expert = {id(p) for m in moe_layers(model) for p in (m.w1, m.b1, m.w2, m.b2)}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert], [p for p in params if id(p) in expert]


def sync_grads(model, ep_group, replica_group, dense_group):
    """Make every gradient the gradient of the global loss; return the global gradient norm. Each
    rank's loss is already its share (token sums / global token count, aux / total groups), so all
    reductions are SUMs."""
    dense, expert = split_params(model)
    # 1. Dense parameters: data parallel over every rank (dense_group; one flat bucket, as
    #   ddp_bucketed.py).
    flat = torch.cat([p.grad.flatten() for p in dense])  # (n_dense,)
    dist.all_reduce(flat, group=dense_group)
    for p, g in zip(dense, flat.split([p.numel() for p in dense])):
        p.grad.copy_(g.view_as(p))
    # 2. Expert parameters: the all-to-all backward already brought the gradient of every token of
    #    my EP group that was routed to my experts; the other replicas of my experts saw other
    #    tokens.
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


# ------------------------------------ main: the checks, the GPT with MoE blocks, one training step
def check_args(args, world):
    ep = args.ep or world
    groups = args.groups or world
    E = args.experts
    k = args.top_k
    if k and args.router != "noisy_topk":
        fail(
            f"--top-k {k} with --router {args.router}: gshard is top-2, switch top-1, "
            "expert_choice has no k; only noisy_topk takes --top-k"
        )
    try:  # the cores' own checks
        check_layer(E, max(ep, 1), args.capacity_factor)
        if args.router == "noisy_topk":
            check_top_k(k or 2, E)
    except ValueError as e:  # as one line, with the flags they were given
        fail(
            f"--experts {E}, --ep {ep}, --capacity-factor {args.capacity_factor}, --top-k {k}: {e}"
        )
    if args.aux_weight < 0:
        fail(f"--aux-weight must be >= 0, got {args.aux_weight}")
    if not 1 <= args.moe_every <= args.n_layers:
        fail(f"--moe-every must be in 1..--n-layers {args.n_layers}, got {args.moe_every}")
    if ep < 1 or world % ep:
        fail(f"world size {world} must be a multiple of --ep {ep} (world = replicas x ep)")
    if groups < 1 or groups % world:
        fail(
            f"--groups {groups} must be a multiple of the world size {world}: each rank routes "
            "whole groups"
        )
    if args.batch_size % groups:
        fail(
            f"--batch-size {args.batch_size} must be divisible by --groups {groups} (whole "
            "sequences each)"
        )
    return ep, groups


def build_moe_gpt(args, groups, ep_group=None, device="cpu"):
    """common's GPT (same seed, same dense weights) with the MLP of every moe_every-th block
    replaced."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(args.seed + 7919)  # the MoE weights' stream
    dtype = DTYPES[args.dtype]
    for i, block in enumerate(model.blocks):
        if i % args.moe_every == args.moe_every - 1:
            k = dict(k=args.top_k or 2) if args.router == "noisy_topk" else {}
            router = ROUTERS[args.router](
                args.d_model, args.experts, **k, generator=gen, dtype=dtype
            )
            block.mlp = MoE(
                args.d_model,
                args.experts,
                router,
                args.capacity_factor,
                args.batch_size // groups,
                ep_group,
                dropout=args.dropout,
                seed=args.seed,
                layer=i,
                generator=gen,
                dtype=dtype,
            )
    return model.to(device)


def train_step(args, layout, model, opt, x, y, n_tok, step, row0, groups):
    """One optimizer step. x, y (b, n): this rank's rows row0.. of the global batch, on the device;
    n_tok: the global batch's token count. Returns this rank's shares of the LM and aux losses
    (device scalars)."""
    set_step(model, step, row0)
    opt.zero_grad(set_to_none=True)
    # common.GPT's forward, unchanged: the MoE layers sit in its blocks
    lm = lm_loss(model(x), y, n_tok)
    aux = aux_share(model, groups)  # my share of the mean over groups and layers
    (lm + args.aux_weight * aux).backward()
    norm = sync_grads(model, layout.ep_group, layout.replica_group, dist.group.WORLD)
    clip_grads_([p.grad for p in model.parameters()], norm, args.clip)
    opt.step()
    return lm.detach(), aux.detach()


def main():
    args = parse_args(Args)
    check_common_args(args)
    ep, groups = check_args(args, env_world_size())  # every rank, before any collective
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    layout = make_layout(d, ep)  # this rank's EP group and expert replicas
    torch.manual_seed(args.seed + d.rank)  # dropout only; routing randomness comes from MoE.noise
    model = build_moe_gpt(args, groups, layout.ep_group, d.device)
    opt = make_optimizer(model.parameters(), args)
    run = Run(d, args, {"model": model, "optim": opt})  # resumes from --ckpt-dir
    # measurement: the banner, hooks, counters
    watch = Watch(d, args, layout, groups, model, run, data)
    rows = args.batch_size // d.world
    # my slice (B/W, n): routing groups row0 / rows_per_group ... of the global batch
    row0 = d.rank * rows
    for step in run.steps():
        # (B, n) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # counted on the CPU: no device sync
        x, y = x[row0 : row0 + rows], y[row0 : row0 + rows]
        # the one host-to-device copy, pinned: not waited for (pageable would be)
        if d.device.type == "cuda":
            x, y = (t.pin_memory().to(d.device, non_blocking=True) for t in (x, y))
        with run.watching(step, watch.comm, watch.acts):
            lm, aux = train_step(args, layout, model, opt, x, y, n_tok, step, row0, groups)
        watch.end_step(step, lm, aux)  # the global batch's losses, the log line, the checkpoint
    watch.finish(model, opt)  # the summary and --check


# --- measurement ---
class Watch:
    """What the summary prints, watched from outside the technique: a forward hook on every MoE
    layer keeps, per step, each expert's choices and served assignments and the tokens no expert
    served (device tensors, summed over ranks once, at the end); a CommCounter entered on the last
    step sees each all-to-all at the dispatcher; SavedActivations the bytes autograd saves for
    backward in that step."""

    def __init__(self, d, args, layout, groups, model, run, data):
        self.d = d
        self.args = args
        self.layout = layout
        self.groups = groups
        self.run = run
        self.layers, self.rows = moe_layers(model), []
        self.lms, self.auxes = run.history.get("lm", []), run.history.get("aux", [])
        self.comm = CommCounter(
            axes={"ep": layout.ep_group, "replicas": layout.replica_group}, log=True
        )
        self.acts = SavedActivations()
        for m in self.layers:
            m.register_forward_hook(self.hook)
        E = args.experts
        T = args.batch_size // groups * args.seq_len
        ep = layout.ep
        C = capacity(args.capacity_factor, self.layers[0].router.k, T, E)
        d.log(
            f"moe.py --router {args.router}: world {d.world} = {layout.replicas} replicas x ep "
            f"{ep} on {d.backend}; {E} experts ({E // ep} per rank), {groups} routing groups of "
            f"T={T} tokens, capacity C={C}; entropy floor {data.entropy:.4f} nats/token"
        )

    def end_step(self, step, lm, aux):
        """The global batch's LM and aux losses for the log line (one all-reduce, one host sync per
        step)."""
        parts = torch.stack([lm.double(), aux.double()])
        dist.all_reduce(parts)
        lm, aux = parts.tolist()
        self.lms.append(lm)
        self.auxes.append(aux)
        self.run.end_step(step, lm + self.args.aux_weight * aux, lm=self.lms, aux=self.auxes)

    def finish(self, model, opt):
        """The summary; the technique's own peak, read before --check trains the one-process
        reference on rank 0's device; --check; the --json summary. Exits."""
        d = self.d
        args = self.args
        layout = self.layout
        groups = self.groups
        run = self.run
        f = self.summarize(d, args, layout, groups, self.lms, self.auxes)
        peak = peak_memory_bytes(d, state_bytes(model, opt) + self.acts.bytes)
        full = full_params(layout, model) if args.check else None  # a collective: every rank
        ref = moe_reference(args, groups, d.device) if args.check and d.rank == 0 else None
        check = check_against_reference(d, args, run.losses, full, ref=ref) if args.check else None
        run.finish(f"moe-{args.router}", peak, f["alltoall_bytes_per_step"], check, f)

    def hook(self, m, inputs, output):
        load, idle = m.dispatch.sum((0, 1, 3)), (m.dispatch.sum((2, 3)) == 0).sum().view(1)
        self.rows.append(torch.cat([m.wanted.double(), load.double(), idle.double()]))  # (2E + 1,)

    def summarize(self, d, args, layout, groups, lms, auxes):
        """Every step's routing summed over all ranks (one all-reduce), the last step's bytes; and
        theory."""
        E = args.experts
        L = len(self.layers)
        ep = layout.ep
        D = args.d_model
        k = self.layers[0].router.k
        T = args.batch_size // groups * args.seq_len
        tokens = args.batch_size * args.seq_len
        nbytes = torch.finfo(DTYPES[args.dtype]).bits // 8
        C = capacity(args.capacity_factor, k, T, E)
        rows = self.rows or [
            torch.zeros(L * (2 * E + 1), device=d.device)
        ]  # none: resumed at the end
        every = torch.stack(rows).view(-1, L, 2 * E + 1)  # (steps, L, 2E + 1): my tokens
        dist.all_reduce(every)  # the global batch's routing, every step of this run
        wanted = every[..., :E]
        load = every[..., E : 2 * E]
        idle = every[..., 2 * E]
        # tokens per expert per layer when perfectly balanced
        fair = tokens * k / E if k else groups * C
        drop_theory = max(0.0, 1 - C / (k * T / E)) if k else 0.0
        # All-to-all bytes handed to other ranks in the last step, 4 exchanges per layer (dispatch,
        # combine and their backward): the (E, G/W, C, D) buffers less the block that stays home.
        sent = sum(c["to_others"] for c in self.comm.calls_log if c["op"] == "all_to_all")
        expected = 4 * L * (ep - 1) * (E // ep) * (groups // d.world) * C * D * nbytes
        per_rank = [r[0].long().tolist() for r in gather_rows(d, [[sent, expected]])]
        f = dict(
            capacity=C,
            tokens_per_group=T,
            groups=groups,
            ep=ep,
            replicas=layout.replicas,
            expert_load=load[-1].tolist(),
            expert_load_theory_balanced=fair,
            load_cv=(load[-1].std(-1, correction=0) / load[-1].mean(-1)).mean().item(),
            dropped_frac=(1 - load[-1].sum() / wanted[-1].sum()).item(),
            dropped_frac_theory_balanced=drop_theory,
            tokens_without_expert_frac=(idle[-1].sum() / (tokens * L)).item(),
            lm_loss=lms[-1],
            aux_loss=auxes[-1],
            lm_losses=lms,
            aux_losses=auxes,
            alltoall_bytes_per_step=sent,
            alltoall_bytes_theory=expected,
            alltoall_bytes_per_rank=[r[0] for r in per_rank],
            alltoall_bytes_expected_per_rank=[r[1] for r in per_rank],
            expert_load_per_step=load.tolist(),
            maxvio_per_step=(load.amax(-1) / load.mean(-1) - 1).mean(-1).tolist(),
        )
        d.log(
            "summary (last step, all ranks)          measured   | theory\n"
            f"  capacity C per expert per group      {C:<10} | ceil(cf x {k or 1} x T / E), <= T = "
            f"{T}\n"
            + "".join(
                f"  expert load, MoE layer {i}           {[int(v) for v in l]} | {fair:g} each if "
                "balanced\n"
                for i, l in enumerate(f["expert_load"])
            )
            + f"  dropped assignments                  {f['dropped_frac']:<10.2%} | "
            f"{drop_theory:.2%} if "
            f"balanced (max(0, 1 - C E / (k T)))\n"
            f"  tokens with no expert                {f['tokens_without_expert_frac']:<10.2%} |\n"
            "  MaxVio per step (max/mean load - 1)  "
            f"{' '.join(f'{v:.3f}' for v in f['maxvio_per_step'])}\n"
            f"  LM loss, aux loss (x {args.aux_weight:g})  {lms[-1]:.6f}, {auxes[-1]:.6f}\n"
            f"  all-to-all bytes sent / step / rank  {f['alltoall_bytes_per_rank']} | "
            f"{f['alltoall_bytes_expected_per_rank']} = 4 x layers x (ep-1)/ep x E x G/W x C x D x "
            "bytes"
        )
        return f


# --- reference for --check ---
def full_params(layout, model):
    """The whole model by name (expert shards all-gathered over the EP group), for --check on rank
    0."""
    _, expert = split_params(model)
    ids, out = {id(p) for p in expert}, {}
    for name, p in model.named_parameters():
        if id(p) in ids and layout.ep > 1:
            parts = [torch.empty_like(p) for _ in range(layout.ep)]
            dist.all_gather(parts, p.detach().contiguous(), group=layout.ep_group)
            out[name] = torch.cat(parts)  # (E, ...) in expert order: EP rank j holds block j
        else:
            out[name] = p.detach()
    return out


def moe_reference(args, groups, device):
    """The one-process answer: every expert local, the same routing groups, the same random
    numbers."""
    model = build_moe_gpt(args, groups, device=device)
    steps = iter(range(args.steps))  # reference_train calls loss_of once per step

    def loss_of(m, x, y, n_tok):
        set_step(m, next(steps), 0)
        return lm_loss(m(x), y, n_tok) + args.aux_weight * aux_share(m, groups)

    return reference_train(args, device, model=model, loss_of=loss_of)


if __name__ == "__main__":
    main()
