"""moe.py: mixture-of-experts layers with expert parallelism: five routers, shared experts, dropless routing.

The GPT of common.py with the MLP of every block (or every --moe-every'th, as GShard's every other one)
replaced by E expert MLPs and a router that sends each token to a few of them. With expert parallelism
(--ep ranks) each rank holds E/ep experts, and two all-to-alls per layer carry the tokens to the rank that
owns their expert and back (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021).

Routers (--router), each a route_* function below:
  noisy_topk     Shazeer et al. 2017: the top k of x W_g + noise, softmax over them; aux loss CV(importance)^2
                 + CV(load)^2, load by the paper's smooth estimator (normal CDF).
  gshard         Lepikhin et al. 2020: top-2; the 2nd expert is kept with probability 2 * g2 (random
                 routing); aux loss E * sum_e f_e P_e (f_e: share of first choices, P_e: mean gate).
  switch         Fedus et al. 2021: top-1; the same aux loss, weighted by alpha = --aux-weight (1e-2).
  expert_choice  Zhou et al. 2022: each expert takes its own top-C tokens, so every expert is exactly full;
                 a token gets 0..E experts; no aux loss is needed.
  loss_free      Wang et al. 2024 (DeepSeek-V3 trains with it): affinities s = sigmoid(x W_g) (or --score
                 softmax); the top k of s + b choose, the gates are the chosen s alone, so the bias b chooses
                 but never weighs. After each step b moves by --bias-rate towards balance, from the whole
                 batch's counts; DeepSeek-V3's sequence-wise balance loss is there too (--seq-aux-weight).
Total loss = LM loss + weight x aux (aux: mean over routing groups and MoE layers; weight: --aux-weight, or
--seq-aux-weight for loss_free). --shared-experts S adds S expert MLPs that every token goes through beside
its routed ones (DeepSeek-MoE, Dai et al. 2024): replicated on every rank, data parallel like attention.

Capacity is per routing group (GShard's "groups"): the global batch is cut into --groups groups of whole
sequences, T = batch/groups x seq_len tokens each, routed on their own with C slots per expert:
    token choice:  C = ceil(cf x k x T / E)      expert choice:  C = ceil(cf x T / E)      (both <= T)
An assignment that finds its expert full is dropped: the token keeps only its residual path. Every token's
1st choice is served before any 2nd choice (GShard Alg. 1), so whether a 2nd choice gets a slot depends on
the 1st choices of *later* tokens, its own sequence's future included: information from the future, as in
expert choice's top-C (fine for training, not for causal decoding). A 1st choice sees only earlier tokens.

    EP = 2, E = 4: rank 0 owns experts e0 e1, rank 1 owns e2 e3 (picture of rank 0; rank 1 mirrors it)
      my groups (G, T, D) --dispatch einsum--> (E, G, C, D) = [ e0 e1 | e2 e3 ]
                                                              keep  |  send to rank 1
      all-to-all -->  (ep x E/ep, G, C, D) = [ e0 e1 from rank 0 | e0 e1 from rank 1 ]
      my experts run on (E/ep, ep x G x C, D) --> all-to-all back --> (E, G, C, D)
      --combine einsum (gate weights)--> (G, T, D), added to the residual stream

Dropless (--capacity-factor 0, token choice; as MegaBlocks, Gale et al. 2023): no slots, nothing dropped.
Each rank sorts its (token, choice) pairs by expert and sends every EP rank exactly its experts' tokens:
      rank 0 chose  e0 e0 e0 e1 | e2 e3 e3     counts [3 1 | 1 2]: keeps 4, sends 3 to rank 1
      rank 1 chose  e0 e1 e1 | e2 e2 e2 e3     counts [1 2 | 3 1]: sends 3 to rank 0, keeps 4
      all-gather the counts, so every rank knows every split; all_to_all_single(out, in, recv, send);
      rank 0 then runs e0 on [3 own | 1 from rank 1], e1 on [1 | 2]; the way back swaps the splits.
The splits must reach the host to size the buffers: one host sync per dropless layer (Megatron-Core's
dropless dispatcher has it too). With a capacity every size comes from the command line: nothing syncs.

Ranks form the grid torch.arange(world).view(world // ep, ep): a row is an EP group (together all E experts),
a column holds copies of the same E/ep experts (their gradients summed over it); the rest is data parallel.

Reading order: the base layer first, complete through sync_grads (Switch routing, capacity, the all-to-all
exchange, the MoE module, the expert + data parallel gradients); then the other routers (GShard, Shazeer's
noisy top-k, expert choice), then loss-free balancing. Dropless routing and shared experts are branches of
MoE. That is the technique section (torch and einops only); after check_args, this repo's run of it: the
GPT with MoE blocks (build_moe_gpt) and one optimizer step (train_step: LM loss, sync, clipping, the step).

Run:
    python moe.py --router switch --check                            # world 1: all experts local
    torchrun --nproc_per_node=4 moe.py --router gshard --check       # EP 4, 4 routing groups
    torchrun --nproc_per_node=4 moe.py --router expert_choice --ep 2 --check    # 2 replicas x EP 2
    python moe.py --router noisy_topk --groups 4 --check             # the one-process twin of EP 4
    torchrun --nproc_per_node=4 moe.py --router loss_free --shared-experts 1 --capacity-factor 0 --check
In production, use a fused MoE (Megatron-Core, DeepSpeed-MoE, torchtitan): grouped GEMMs and index-based
dispatch instead of the dense (T, E, C) one-hot tensors written out here for clarity.

Legend (einsum letters and shape comments): G routing groups on this rank, T tokens per group (GShard's S),
E experts, C capacity (slots per expert per group), K choices per token, D model width, H expert hidden width
(4D), r ranks of the EP group. A token-choice router returns expert, gate, keep (G, T, K): each token's k-th
choice, its gate weight, and 1 if it is wanted (0: gshard's dropped 2nd choice); and aux (G,): the balancing
loss per group. Capacity comes after it (fill_slots), or never (dropless). Expert choice returns dispatch and
combine (G, T, E, C) itself: token t sits in slot c of expert e, and comes back with that gate weight.
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

from common import (DTYPES, build_gpt, clip_grads_, count_tokens, fail, GPTConfig, init_dist, lm_loss,
                    make_optimizer, MarkovData, reference_train)
from harness import (check_against_reference, check_common_args, CommCounter, CommonArgs, env_world_size,
                     gather_rows, parse_args, peak_memory_bytes, Run, SavedActivations, state_bytes)

ROUTERS = ("noisy_topk", "gshard", "switch", "expert_choice", "loss_free")


@dataclass
class Args(CommonArgs):
    router: Literal["noisy_topk", "gshard", "switch", "expert_choice", "loss_free"] = "switch"  # the router
    experts: int = 4  # routed experts per MoE layer (E)
    top_k: int = 0  # noisy_topk, loss_free: experts per token (0 = 2); gshard is top-2, switch top-1
    capacity_factor: float = 1.25  # slots/expert: cf x k x group tokens / E (expert_choice: k=1); 0: dropless
    aux_weight: float = 1e-2  # total loss = LM loss + aux_weight x load-balancing loss (Switch's alpha)
    score: Literal["sigmoid", "softmax"] = "sigmoid"  # loss_free: affinity function (sigmoid: DeepSeek-V3)
    bias_rate: float = 1e-3  # loss_free: each step the expert bias moves by this much (Wang et al.'s u)
    seq_aux_weight: float = 0.0  # loss_free: weight of DeepSeek-V3's sequence-wise balance loss (0 = off)
    shared_experts: int = 0  # always-on expert MLPs per MoE layer beside the routed ones (DeepSeek-MoE)
    moe_every: int = 1  # an MoE layer in every n-th block (2: every other one, as GShard), dense MLPs between
    ep: int = 0  # expert-parallel degree: ranks that split one set of experts (0 = world size)
    groups: int = 0  # routing groups in the global batch; capacity is per group (0 = world size)


# --------------------------------------------------- the base layer: Switch routing, capacity, the all-to-all
def experts_per_token(router, top_k=0):  # None: not a router
    return dict(noisy_topk=top_k or 2, loss_free=top_k or 2, gshard=2, switch=1, expert_choice=0).get(router)


def capacity(capacity_factor, k, tokens_per_group, experts):
    """Slots per expert per group (expert choice, k = 0: cf T / E, Zhou et al. Sec. 3.1), from the command
    line only: every rank gets the same C, so the (E, G, C, D) all-to-all buffers match (else it hangs)."""
    return max(1, min(tokens_per_group, math.ceil(capacity_factor * (k or 1) * tokens_per_group / experts)))


def fill_slots(expert, gate, keep, C, E):
    """Token choice -> slots: dispatch, combine (G, T, E, C). Slots go choice by choice (GShard Alg. 1),
    tokens in order within a choice; an assignment whose expert already has C earlier ones is dropped."""
    K = expert.shape[-1]
    want = F.one_hot(expert, E) * keep[..., None].long()  # (G, T, K, E) requested assignments
    order = rearrange(want, "g t k e -> g (k t) e")  # priority order: choice-major, then token
    ahead = rearrange(order.cumsum(1) - order, "g (k t) e -> g t k e", k=K)  # earlier requests, same expert
    slot = (ahead * want).sum(-1)  # (G, T, K): the slot this assignment gets in its expert
    e_hot = (want * (slot < C)[..., None]).to(gate.dtype)  # (G, T, K, E): the wanted ones that got a slot
    c_hot = F.one_hot(slot.clamp(max=C - 1), C).to(gate.dtype)  # (G, T, K, C)
    dispatch = torch.einsum("gtke,gtkc->gtec", e_hot, c_hot)  # (G, T, E, C); a token's K experts are distinct
    return dispatch, torch.einsum("gtke,gtkc,gtk->gtec", e_hot, c_hot, gate)


def balance_loss(probs, top1):
    """GShard / Switch's E * sum_e f_e P_e per group (see the top; f_e is not differentiable, P_e is): 1 under
    uniform routing. GShard Alg. 1 writes mean_e(f_e P_e), this / E^2, and folds the E^2 into the weight."""
    E = probs.shape[-1]
    f = F.one_hot(top1, E).to(probs.dtype).mean(1)  # (G, E)
    return E * (f * probs.mean(1)).sum(-1)  # (G,)


def route_switch(logits):
    """Switch (Fedus et al. 2021, Sec. 2.1-2.2): top-1; the gate is the router probability itself, so
    the router learns through it; overflow beyond C is dropped (by fill_slots)."""
    probs = logits.softmax(-1)  # (G, T, E)
    gate, top1 = probs.max(-1)  # (G, T)
    return top1[..., None], gate[..., None], torch.ones_like(gate[..., None]), balance_loss(probs, top1)


class AllToAll(torch.autograd.Function):
    """all_to_all_single over dim 0: in_splits[j] rows to rank j, out_splits[i] rows from rank i (None: even).
    Its backward is the same exchange, splits swapped: the gradient of the rows I sent to j comes from j."""

    @staticmethod
    def forward(ctx, x, group, out_splits=None, in_splits=None):
        r, n = dist.get_world_size(group), x.shape[0]  # checked: rows that do not split abort the collective
        if n % r if in_splits is None else (sum(in_splits), len(in_splits), len(out_splits)) != (n, r, r):
            raise ValueError(f"{n} rows, {r} ranks: {r} in/out splits (in: sum {n}) or rows divisible by {r}")
        ctx.group, ctx.swapped = group, (in_splits, out_splits)
        out = x.new_empty((x.shape[0] if out_splits is None else sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return AllToAll.apply(grad, ctx.group, *ctx.swapped), None, None, None


def mlps(h, w1, b1, w2, b2):
    """gelu(h w1 + b1) w2 + b2: one expert (h (N, D), w1 (D, H), b1 (H,)), or X experts at once as batched
    matmuls (w1 (X, D, H), b1 (X, H); h (X, N, D), or (N, D) for all X) -> (X, N, D)."""
    return F.gelu(h @ w1 + b1[..., None, :]) @ w2 + b2[..., None, :]


class MoE(nn.Module):
    """Replaces an MLP: route -> dispatch -> all-to-all -> experts -> all-to-all -> combine (+ shared ones).
    x (b, n, D) -> (b, n, D), cut into routing groups of `group_rows` whole sequences; ep_group: the ranks
    that split the E experts (None: all local). A forward leaves `aux` (G,), the balancing loss per group,
    and `wanted` (E,), this rank's choices per expert before capacity (update_biases reads it)."""

    def __init__(self, d_model, experts, router="switch", top_k=0, capacity_factor=1.25, group_rows=1,
                 ep_group=None, shared=0, score="sigmoid", hidden=None, dropout=0.0, seed=0, layer=0,
                 generator=None, dtype=torch.float64):
        super().__init__()
        D, H, E = d_model, hidden or 4 * d_model, experts
        self.kind, self.k, self.cf, self.E = router, experts_per_token(router, top_k), capacity_factor, E
        self.score, self.n_shared, self.group_rows = score, shared, group_rows
        self.seed, self.layer, self.step, self.row0 = seed, layer, 0, 0
        self.ep_group, self.ep = ep_group, 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank, self.El = 0 if ep_group is None else dist.get_rank(ep_group), E // self.ep
        if self.k is None or score not in ("sigmoid", "softmax"):  # what it cannot do, before any collective
            raise ValueError(f"router {router!r}, score {score!r}: use noisy_topk, gshard, switch, "
                             "expert_choice or loss_free; score sigmoid or softmax")
        if E < 1 or E % self.ep:
            raise ValueError(f"{E} experts over EP {self.ep} ranks: use a multiple of {self.ep} experts")
        if top_k not in (0, self.k) or not (1 <= self.k <= E or router == "expert_choice"):
            raise ValueError(f"top-k {top_k or self.k} for {router} over {E} experts: noisy_topk and "
                             f"loss_free take 1..{E}; gshard is top-2, switch top-1, expert_choice none (0)")
        if capacity_factor < 0 or capacity_factor == 0 and router == "expert_choice":
            raise ValueError(f"capacity_factor {capacity_factor}: use > 0, or 0 (dropless) for token choice")
        gen, f64 = generator, torch.float64
        full = lambda *s: (0.02 * torch.randn(*s, generator=gen, dtype=f64)).to(dtype)  # noqa: E731
        zeros = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=dtype))  # noqa: E731
        self.w_gate = nn.Parameter(full(D, E))  # W_g: replicated, data parallel
        self.w_noise = nn.Parameter(full(D, E)) if router == "noisy_topk" else None  # W_noise
        if router == "loss_free":  # b: a buffer (so checkpointed), moved by update_biases, never by autograd;
            b_dtype = torch.promote_types(dtype, torch.float32)  # bf16 would round its --bias-rate steps away
            self.register_buffer("expert_bias", torch.zeros(E, dtype=b_dtype))
        # All E experts drawn from one generator, my slice kept: every EP degree starts from the same numbers.
        mine = slice(self.ep_rank * self.El, (self.ep_rank + 1) * self.El)
        self.w1, self.b1 = nn.Parameter(full(E, D, H)[mine].clone()), zeros(self.El, H)
        self.w2, self.b2 = nn.Parameter(full(E, H, D)[mine].clone()), zeros(self.El, D)
        if shared:  # S always-on experts: replicated, data parallel like the router
            self.shared_w1, self.shared_b1 = nn.Parameter(full(shared, D, H)), zeros(shared, H)
            self.shared_w2, self.shared_b2 = nn.Parameter(full(shared, H, D)), zeros(shared, D)
        self.drop, self.dispatch, self.wanted, self.aux = nn.Dropout(dropout), None, None, None

    def draw(self, like):
        """Normals (noisy_topk) or uniforms (gshard) like `like`, (G, T, E) or (G, T), one generator per
        (seed, step, layer, global group): the same numbers whatever the EP degree or the data split."""
        group0, out = self.row0 // self.group_rows, []
        sample = torch.randn if self.kind == "noisy_topk" else torch.rand
        for g in range(group0, group0 + like.shape[0]):
            seed = (((self.seed * 1_000_003 + self.step) * 1_009 + self.layer) * 1_000_000_007 + g) % 2 ** 63
            gen = torch.Generator(like.device).manual_seed(seed)
            out.append(sample(like.shape[1:], generator=gen, device=like.device, dtype=like.dtype))
        return torch.stack(out)

    def logits(self, xg):
        """x W_g (G, T, E) in float32 or wider (Switch Sec. 2.4: bf16 routing is unstable), and that x."""
        x = xg.to(torch.promote_types(xg.dtype, torch.float32))
        return x @ self.w_gate.to(x.dtype), x

    def choose(self, xg, n):
        """Token choice: xg (G, T, D) -> expert, gate, keep (G, T, K), aux (G,). Noise only while training."""
        logits, x = self.logits(xg)
        if self.kind == "switch":
            return route_switch(logits)
        if self.kind == "loss_free":
            scores = logits.sigmoid() if self.score == "sigmoid" else logits.softmax(-1)
            return route_loss_free(scores, self.expert_bias.to(x.dtype), self.k, n)
        if self.kind == "noisy_topk":
            eps = self.draw(logits) if self.training else torch.zeros_like(logits)
            std = F.softplus(x @ self.w_noise.to(x.dtype)) + 1e-2  # the floor keeps Phi's argument finite
            return route_noisy_topk(logits, std, eps, self.k)
        u = self.draw(logits[..., 0]) if self.training else torch.zeros_like(logits[..., 0])
        return route_gshard(logits, u)

    def exchange(self, xg, dispatch, combine):
        """Tokens to their experts' slots and back: xg (G, T, D), this rank's groups -> (G, T, D)."""
        G = xg.shape[0]
        buf = torch.einsum("gtec,gtd->egcd", dispatch.to(xg.dtype), xg)  # (E, G, C, D): all E experts' slots
        if self.ep > 1:  # block j (EP rank j's experts) -> rank j; I get every rank's slots for my experts
            buf = AllToAll.apply(buf, self.ep_group)  # (r * El, G, C, D), block i from rank i
        h = mlps(rearrange(buf, "(r e) g c d -> e (r g c) d", r=self.ep), self.w1, self.b1, self.w2, self.b2)
        out = rearrange(h, "e (r g c) d -> (r e) g c d", r=self.ep, g=G)  # (r * El, G, C, D): block j for j
        if self.ep > 1:
            out = AllToAll.apply(out, self.ep_group)  # (E, G, C, D): all experts' outputs, my tokens
        return torch.einsum("gtec,egcd->gtd", combine.to(xg.dtype), out)  # empty / dropped slots weigh 0

    def dropless(self, xg, expert, gate, keep):
        """No capacity, every wanted choice served: xg (G, T, D), expert/gate/keep (G, T, K) -> (G, T, D)."""
        (G, T, K), D, E, El, r, me = expert.shape, xg.shape[-1], self.E, self.El, self.ep, self.ep_rank
        dest = torch.where(keep > 0, expert, E).flatten()  # (N = G T K,): each pair's expert; E = unwanted
        counts = dest.new_zeros(E + 1).scatter_add_(0, dest, torch.ones_like(dest))  # (E + 1,): pairs each
        if r > 1:  # every rank's counts, so that each knows what it gets from whom
            every = counts.new_empty(r * (E + 1))
            dist.all_gather_single(every, counts, group=self.ep_group)
            counts = every
        sizes = rearrange(counts, "(r e) -> r e", r=r)[:, :E].tolist()  # (r, E): the one host sync (see top)
        mine = [row[me * El:(me + 1) * El] for row in sizes]  # (r, El): rank i's pairs for each of my experts
        send = [sum(sizes[me][j * El:(j + 1) * El]) for j in range(r)]  # pairs I send to rank j
        recv = [sum(row) for row in mine]  # pairs I get from rank i
        pairs = torch.argsort(dest, stable=True)[:sum(send)]  # wanted pairs, by expert then token
        h = rearrange(xg, "g t d -> (g t) d")[pairs // K]  # (sum send, D): each pair's token (j's: a block)
        if r > 1:
            h = AllToAll.apply(h, self.ep_group, recv, send)  # (sum recv, D): from each rank, by my expert
        pieces = h.split([c for row in mine for c in row])  # piece (i, e): rank i's tokens for my expert e
        ws = self.w1, self.b1, self.w2, self.b2
        outs = [mlps(torch.cat(pieces[e::El]), *(w[e] for w in ws)) for e in range(El)]  # e on all its tokens
        back = [o.split([mine[i][e] for i in range(r)]) for e, o in enumerate(outs)]
        h = torch.cat([back[e][i] for i in range(r) for e in range(El)])  # back in (rank i, expert e) order
        if r > 1:
            h = AllToAll.apply(h, self.ep_group, send, recv)  # (sum send, D): my pairs' outputs, sorted
        w = gate.flatten()[pairs].to(xg.dtype)  # (sum send,): each pair's gate weight
        return xg.new_zeros(G * T, D).index_add(0, pairs // K, h * w[:, None]).view_as(xg)  # summed per token

    def forward(self, x):
        """x (b, n, D): this rank's b sequences of n positions, global rows self.row0 .. -> (b, n, D)."""
        n = x.shape[1]
        if x.shape[0] % self.group_rows:  # every EP rank must also route as many groups of as many tokens
            raise ValueError(f"{x.shape[0]} sequences: use a multiple of group_rows = {self.group_rows}")
        xg = rearrange(x, "(g b) n d -> g (b n) d", b=self.group_rows)  # (G, T, D), T = group_rows * n
        G, T = xg.shape[:2]
        if self.kind == "expert_choice":
            dispatch, combine = route_expert_choice(self.logits(xg)[0], capacity(self.cf, 1, T, self.E))
            self.aux, self.wanted = dispatch.new_zeros(G), dispatch.detach().sum((0, 1, 3))
        else:
            expert, gate, keep, self.aux = self.choose(xg, n)
            self.wanted = (F.one_hot(expert, self.E) * keep[..., None]).detach().sum((0, 1, 2))  # (E,)
            if self.cf > 0:
                C = capacity(self.cf, self.k, T, self.E)
                dispatch, combine = fill_slots(expert, gate, keep, C, self.E)
        y = self.exchange(xg, dispatch, combine) if self.cf > 0 else self.dropless(xg, expert, gate, keep)
        self.dispatch = dispatch.detach() if self.cf > 0 else None  # the slots taken (None when dropless)
        if self.n_shared:  # every token through each of the S shared experts: (S, G T, D), summed over S
            ws = self.shared_w1, self.shared_b1, self.shared_w2, self.shared_b2
            y = y + mlps(rearrange(xg, "g t d -> (g t) d"), *ws).sum(0).view_as(xg)
        return self.drop(rearrange(y, "g (b n) d -> (g b) n d", n=n))


def moe_layers(model):
    return [m for m in model.modules() if isinstance(m, MoE)]


def set_step(model, step, row0):
    """Before each forward: the step and this rank's first global row (they key the routers' noise)."""
    for m in moe_layers(model):
        m.step, m.row0 = step, row0


def aux_share(model, groups):
    """This rank's share of the aux loss averaged over all `groups` routing groups and every MoE layer."""
    layers = moe_layers(model)
    return sum(m.aux.sum() for m in layers) / (groups * len(layers))


# ----------------------------------------------------------------------------- expert + data parallel step
def make_layout(d, ep):
    """The grid of the module docstring: my row is my EP group, my column my expert replicas."""
    grid = torch.arange(d.world).view(d.world // ep, ep)
    ep_groups = [dist.new_group(row) for row in grid.tolist()]  # every rank creates every group, in one order
    replica_groups = [dist.new_group(col) for col in grid.T.tolist()]
    replica, ep_rank = divmod(d.rank, ep)
    return SimpleNamespace(ep=ep, ep_rank=ep_rank, ep_group=ep_groups[replica],
                           replica_group=replica_groups[ep_rank], replicas=d.world // ep)


def split_params(model):
    """(dense, expert) parameters: the routed experts are sharded over the EP group, the rest replicated."""
    expert = {id(p) for m in moe_layers(model) for p in (m.w1, m.b1, m.w2, m.b2)}
    params = list(model.parameters())
    return [p for p in params if id(p) not in expert], [p for p in params if id(p) in expert]


def sync_grads(model, ep_group, replica_group, dense_group):
    """Make every gradient the gradient of the global loss; return the global gradient norm. Each rank's loss
    is already its share (token sums / global token count, aux / total groups), so all reductions are SUMs."""
    dense, expert = split_params(model)
    # 1. Dense parameters: data parallel over every rank (dense_group; one flat bucket, as ddp_bucketed.py).
    flat = torch.cat([p.grad.flatten() for p in dense])  # (n_dense,)
    dist.all_reduce(flat, group=dense_group)
    for p, g in zip(dense, flat.split([p.numel() for p in dense])):
        p.grad.copy_(g.view_as(p))
    # 2. Expert parameters: the all-to-all backward already brought the gradient of every token of my EP
    #    group that was routed to my experts; the other replicas of my experts saw other tokens.
    if dist.get_world_size(replica_group) > 1:
        for p in expert:
            dist.all_reduce(p.grad, group=replica_group)
    # 3. Global norm for clipping: dense gradients are identical everywhere (count once); expert shards are
    #    distinct within an EP group (sum their squares over it), identical over replicas. bf16: float32 sums.
    sq_dense, sq_expert = (sum(torch.linalg.vector_norm(p.grad, dtype=torch.promote_types(p.grad.dtype,
                           torch.float32)).double() ** 2 for p in ps) for ps in (dense, expert))
    if dist.get_world_size(ep_group) > 1:
        dist.all_reduce(sq_expert, group=ep_group)
    return (sq_dense + sq_expert).sqrt()


# -------------------------------------- more routers: GShard's top-2, Shazeer's noisy top-k, expert choice
def route_gshard(logits, uniform):
    """GShard (Lepikhin et al. 2020, Alg. 1): top-2, gates renormalised over the two; the 2nd expert is
    used only if 2 * g2 > uniform (random routing: a small g2 is rarely worth a slot)."""
    probs = logits.softmax(-1)  # (G, T, E)
    top = probs.topk(2, dim=-1)  # (G, T, 2)
    gate = top.values / top.values.sum(-1, keepdim=True)  # g1, g2 with g1 + g2 = 1
    keep = torch.stack([torch.ones_like(uniform), (2 * gate[..., 1] > uniform).to(uniform.dtype)], -1)
    return top.indices, gate, keep, balance_loss(probs, top.indices[..., 0])


def cv_squared(v):
    """CV^2 = variance / mean^2 over experts (population variance), per group: (G, E) -> (G,)."""
    return v.var(-1, correction=0) / (v.mean(-1) ** 2 + 1e-10)


def smooth_load(clean, noise_std, H, k):
    """Shazeer et al. 2017, Appendix A: P(x, i) = Phi((clean_i - kth_excluding(H, k, i)) / noise_std_i), the
    chance that expert i is in the top k if only its own noise were drawn again: a differentiable load. For
    an expert inside the top k, the k-th largest of the others is the (k+1)-th overall; outside, the k-th."""
    if k >= H.shape[-1]:  # k = E: every expert always chosen, a load of 1 (a margin of inf has no gradient)
        return torch.ones_like(clean)
    top = H.topk(k + 1, dim=-1).values  # (G, T, k+1)
    kth, k1th = top[..., k - 1:k], top[..., k:k + 1]
    return torch.special.ndtr((clean - torch.where(H >= kth, k1th, kth)) / noise_std)  # (G, T, E)


def route_noisy_topk(clean, noise_std, eps, k):
    """Shazeer et al. 2017, Sec. 2.1 and 4: H = clean + eps * noise_std (clean = x W_g, noise_std = softplus(x
    W_noise), eps ~ N(0, 1)), gates = softmax over the top k of H; aux = CV(importance)^2 + CV(load)^2."""
    H = clean + eps * noise_std  # (G, T, E)
    top = H.topk(k, dim=-1)  # (G, T, K)
    gate = top.values.softmax(-1)  # (G, T, K)
    importance = torch.zeros_like(clean).scatter(-1, top.indices, gate).sum(1)  # (G, E)
    load = smooth_load(clean, noise_std, H, k).sum(1)  # (G, E)
    return top.indices, gate, torch.ones_like(gate), cv_squared(importance) + cv_squared(load)


def route_expert_choice(logits, C):
    """Expert choice (Zhou et al. 2022, Sec. 3.1): token-to-expert affinities softmax(x W_g) (softmax over
    experts), then each expert takes its C highest-affinity tokens of the group, later ones included."""
    T = logits.shape[1]
    probs = logits.softmax(-1)  # (G, T, E)
    # A stable sort, not topk: identical tokens (same prefix) tie exactly, and the earlier one must win
    # whatever the layout, or EP degrees would disagree.
    order = torch.sort(rearrange(probs, "g t e -> g e t"), dim=-1, descending=True, stable=True)
    picked, gate = order.indices[..., :C], order.values[..., :C]  # (G, E, C): the token in expert e's slot c
    dispatch = rearrange(F.one_hot(picked, T).to(probs.dtype), "g e c t -> g t e c")  # (G, T, E, C)
    return dispatch, dispatch * rearrange(gate, "g e c -> g 1 e c")


# -------------------------------------------------------------------------- loss-free balancing (DeepSeek-V3)
def seq_balance_loss(scores, expert, n):
    """DeepSeek-V3's sequence-wise balance loss (Sec. 2.1.2, eq. 17-20) of scores (G, T, E), expert (G, T, K):
    per sequence of n tokens sum_e f_e P_e, f_e = E / (K n) x (tokens choosing e: top k of s + b), P_e = mean
    over the sequence of s_e / sum_j s_j; 1 under uniform routing. -> (G,): the mean over the sequences."""
    E, K = scores.shape[-1], expert.shape[-1]
    per_seq = lambda t: rearrange(t, "g (b n) e -> g b n e", n=n)  # noqa: E731
    f = per_seq(F.one_hot(expert, E).sum(2).to(scores.dtype)).sum(2) * E / (K * n)  # (G, b, E)
    P = per_seq(scores / scores.sum(-1, keepdim=True)).mean(2)  # (G, b, E)
    return (f * P).sum(-1).mean(-1)


def route_loss_free(scores, bias, k, n):
    """Wang et al. 2024 (Alg. 1), as DeepSeek-V3 uses it (Sec. 2.1.2, eq. 12-16), gates normalised over the k:
    only the indices of the top k see b: no gradient reaches it. scores (G, T, E), bias (E,); n: seq_len."""
    expert = (scores + bias).topk(k, dim=-1).indices  # (G, T, K): the bias only chooses ...
    s = scores.gather(-1, expert)  # (G, T, K): ... the gates are the scores without it
    return expert, s / s.sum(-1, keepdim=True), torch.ones_like(s), seq_balance_loss(scores, expert, n)


def update_biases(layers, rate, group):
    """Wang et al. 2024, Alg. 1, after each step: b_e += u * sign(mean_e c - c_e), c_e = tokens that chose
    expert e in the whole batch, summed over `group` (None: one process) by one all-reduce of (L, E)."""
    counts = torch.stack([m.wanted for m in layers]).to(torch.float64)  # (L, E), exact integers
    if group is not None:
        dist.all_reduce(counts, group=group)
    for m, c in zip(layers, counts):
        m.expert_bias += rate * torch.sign(c.mean() - c).to(m.expert_bias.dtype)


# ------------------------------------ main: the checks, the GPT with MoE blocks, one training step
def check_args(args, world):
    ep, groups, E = args.ep or world, args.groups or world, args.experts
    k, cf = experts_per_token(args.router, args.top_k), args.capacity_factor
    if cf < 0 or cf == 0 and args.router == "expert_choice":
        fail(f"--capacity-factor must be >= 0, got {cf} (1: each expert's fair share of slots, 0: dropless); "
             "> 0 for --router expert_choice, which has no dropless form (an expert takes C)")
    if args.top_k not in (0, k) or not (1 <= k <= E or args.router == "expert_choice"):
        fail(f"top-k {args.top_k or k} with --router {args.router} and --experts {E}: noisy_topk and "
             f"loss_free take 1..{E}; gshard is top-2, switch top-1, expert_choice has no k; drop --top-k")
    for name in ("aux_weight", "seq_aux_weight", "bias_rate", "shared_experts"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if args.seq_aux_weight and args.router != "loss_free":
        fail("--seq-aux-weight weighs loss_free's sequence-wise loss; the other routers' is --aux-weight")
    if not 1 <= args.moe_every <= args.n_layers:
        fail(f"--moe-every must be in 1..--n-layers {args.n_layers}, got {args.moe_every}")
    if E < 1 or ep < 1 or E % ep:
        fail(f"--experts {E} is not divisible by --ep {ep} (each rank holds experts/ep >= 1); "
             f"try --experts {ep * max(1, -(-E // ep))}")
    if world % ep:
        fail(f"world size {world} must be a multiple of --ep {ep} (world = replicas x ep)")
    if groups < 1 or groups % world:
        fail(f"--groups {groups} must be a multiple of the world size {world}: each rank routes whole groups")
    if args.batch_size % groups:
        fail(f"--batch-size {args.batch_size} must be divisible by --groups {groups} (whole sequences each)")
    return ep, groups


def build_moe_gpt(args, groups, ep_group=None, device="cpu"):
    """common's GPT (same seed, same dense weights) with the MLP of every moe_every-th block replaced."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    gen = torch.Generator().manual_seed(args.seed + 7919)  # the MoE weights: one stream, same on every rank
    for i, block in enumerate(model.blocks):
        if i % args.moe_every == args.moe_every - 1:
            block.mlp = MoE(args.d_model, args.experts, args.router, args.top_k, args.capacity_factor,
                            args.batch_size // groups, ep_group, args.shared_experts, args.score,
                            dropout=args.dropout, seed=args.seed, layer=i, generator=gen,
                            dtype=DTYPES[args.dtype])
    return model.to(device)


def train_step(args, lay, model, opt, x, y, n_tok, step, row0, groups):
    """One optimizer step. x, y (b, n): this rank's rows row0.. of the global batch, on the device; n_tok:
    the global batch's token count. Returns this rank's shares of the LM and aux losses (device scalars)."""
    set_step(model, step, row0)
    opt.zero_grad(set_to_none=True)
    lm = lm_loss(model(x), y, n_tok)  # common.GPT's forward, unchanged: the MoE layers sit in its blocks
    aux = aux_share(model, groups)  # my share of the mean over groups and layers
    (lm + (args.seq_aux_weight if args.router == "loss_free" else args.aux_weight) * aux).backward()
    norm = sync_grads(model, lay.ep_group, lay.replica_group, dist.group.WORLD)
    clip_grads_([p.grad for p in model.parameters()], norm, args.clip)
    opt.step()
    if args.router == "loss_free":  # after the step: the next one routes with the new bias
        update_biases(moe_layers(model), args.bias_rate, dist.group.WORLD)
    return lm.detach(), aux.detach()


def main():
    args = parse_args(Args)
    check_common_args(args)
    ep, groups = check_args(args, env_world_size())  # every rank, before any collective
    d = init_dist(args.timeout)
    data, lay = MarkovData(args.vocab, args.seed), make_layout(d, ep)
    torch.manual_seed(args.seed + d.rank)  # dropout only; routing randomness comes from MoE.draw
    model = build_moe_gpt(args, groups, lay.ep_group, d.device)
    opt = make_optimizer(model.parameters(), args)
    run = Run(d, args, {"model": model, "optim": opt})  # resumes from --ckpt-dir (the loss-free bias too)
    watch = Watch(d, args, lay, groups, model, run, data)  # measurement: the banner, hooks, counters
    rows = args.batch_size // d.world
    row0 = d.rank * rows  # my slice (B/W, n): routing groups row0 / rows_per_group ... of the global batch
    for step in run.steps():
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, n) global batch, CPU
        n_tok = count_tokens(y)  # counted on the CPU: no device sync
        x, y = x[row0:row0 + rows], y[row0:row0 + rows]
        if d.device.type == "cuda":  # the one host-to-device copy, pinned: not waited for (pageable would be)
            x, y = (t.pin_memory().to(d.device, non_blocking=True) for t in (x, y))
        with run.watching(step, watch.comm, watch.acts):
            lm, aux = train_step(args, lay, model, opt, x, y, n_tok, step, row0, groups)
        watch.end_step(step, lm, aux)  # the global batch's losses, the log line, the checkpoint
    watch.finish(model, opt)  # the summary and --check


# --- measurement ---
def aux_weight(args):
    """Total loss = LM + this x aux: Switch's alpha, or loss_free's sequence-wise weight (DeepSeek-V3)."""
    return args.seq_aux_weight if args.router == "loss_free" else args.aux_weight


class Watch:
    """What the summary prints, watched from outside the technique: a forward hook on every MoE layer keeps,
    per step, each expert's choices and served assignments and the tokens no expert served (device tensors,
    summed over ranks once, at the end); a CommCounter entered on the last step sees each all-to-all at the
    dispatcher; SavedActivations the bytes autograd saves for backward in that step."""

    def __init__(self, d, args, lay, groups, model, run, data):
        self.d, self.args, self.lay, self.groups, self.run = d, args, lay, groups, run
        self.layers, self.rows = moe_layers(model), []
        self.lms, self.auxes = run.history.get("lm", []), run.history.get("aux", [])
        self.comm = CommCounter(axes={"ep": lay.ep_group, "replicas": lay.replica_group}, log=True)
        self.acts = SavedActivations()
        for m in self.layers:
            m.register_forward_hook(self.hook)
        E, T, cf, ep = args.experts, args.batch_size // groups * args.seq_len, args.capacity_factor, lay.ep
        k = experts_per_token(args.router, args.top_k)
        slots = f"capacity C={capacity(cf, k, T, E)}" if cf else "dropless"
        d.log(f"moe.py --router {args.router}: world {d.world} = {lay.replicas} replicas x ep {ep} on "
              f"{d.backend}; {E} experts ({E // ep} per rank) + {args.shared_experts} shared, {groups} "
              f"routing groups of T={T} tokens, {slots}; entropy floor {data.entropy:.4f} nats/token")

    def end_step(self, step, lm, aux):
        """The global batch's LM and aux losses for the log line (one all-reduce, one host sync per step)."""
        parts = torch.stack([lm.double(), aux.double()])
        dist.all_reduce(parts)
        lm, aux = parts.tolist()
        self.lms.append(lm), self.auxes.append(aux)
        self.run.end_step(step, lm + aux_weight(self.args) * aux, lm=self.lms, aux=self.auxes)

    def finish(self, model, opt):
        """The summary; the technique's own peak, read before --check trains the one-process reference on rank
        0's device; --check; the --json summary. Exits."""
        d, args, lay, groups, run = self.d, self.args, self.lay, self.groups, self.run
        f = self.summarize(d, args, lay, groups, self.lms, self.auxes)
        peak = peak_memory_bytes(d, state_bytes(model, opt) + self.acts.bytes)
        full = full_params(lay, model) if args.check else None  # a collective: every rank
        ref = moe_reference(args, groups, d.device) if args.check and d.rank == 0 else None
        check = check_against_reference(d, args, run.losses, full, ref=ref) if args.check else None
        run.finish(f"moe-{args.router}", peak, f["alltoall_bytes_per_step"], check, f)

    def hook(self, m, inputs, output):
        dispatch = m.dispatch  # None when dropless: every wanted choice is served, every token its 1st
        load = m.wanted if dispatch is None else dispatch.sum((0, 1, 3))
        idle = load.new_zeros(1) if dispatch is None else (dispatch.sum((2, 3)) == 0).sum().view(1)
        self.rows.append(torch.cat([m.wanted.double(), load.double(), idle.double()]))  # (2E + 1,)

    def summarize(self, d, args, lay, groups, lms, auxes):
        """Every step's routing summed over all ranks (one all-reduce), the last step's bytes; and theory."""
        E, L, ep, D, cf, k = args.experts, len(self.layers), lay.ep, args.d_model, args.capacity_factor, \
            experts_per_token(args.router, args.top_k)
        T, tokens, nbytes = args.batch_size // groups * args.seq_len, args.batch_size * args.seq_len, \
            torch.finfo(DTYPES[args.dtype]).bits // 8
        C = capacity(cf, k, T, E) if cf else None
        rows = self.rows or [torch.zeros(L * (2 * E + 1), device=d.device)]  # none: resumed at the end
        mine = torch.stack(rows).view(-1, L, 2 * E + 1)  # (steps, L, 2E + 1): my tokens
        every = mine.clone()
        dist.all_reduce(every)  # the global batch's routing, every step of this run
        wanted, load, idle = every[..., :E], every[..., E:2 * E], every[..., 2 * E]
        fair = tokens * k / E if k else groups * C  # tokens per expert per layer when perfectly balanced
        drop_theory = max(0.0, 1 - C / (k * T / E)) if k and C else 0.0
        # All-to-all bytes handed to other ranks in the last step, 4 exchanges per layer (dispatch, combine
        # and their backward): with a capacity the (E, G/W, C, D) buffers less the block that stays home;
        # dropless, what the counts send: 2 x (my pairs for other ranks + their pairs for me) x D x bytes.
        sent = sum(c["to_others"] for c in self.comm.calls_log if c["op"] == "all_to_all")
        if cf:
            expected = 4 * L * (ep - 1) * (E // ep) * (groups // d.world) * C * D * nbytes
        else:
            pairs = mine[-1, :, :E].contiguous()  # (L, E): my pairs per expert, last step
            got = torch.empty(ep * L * E, dtype=pairs.dtype, device=d.device)
            dist.all_gather_single(got, pairs.flatten(), group=lay.ep_group)
            got, me = got.view(ep, L, E), slice(lay.ep_rank * (E // ep), (lay.ep_rank + 1) * (E // ep))
            out, into = pairs.sum() - pairs[:, me].sum(), got[:, :, me].sum() - got[lay.ep_rank, :, me].sum()
            expected = int(2 * (out + into).item() * D * nbytes)
        per_rank = [r[0].long().tolist() for r in gather_rows(d, [[sent, expected]])]
        biases = [m.expert_bias.tolist() for m in self.layers if m.kind == "loss_free"]
        f = dict(capacity=C, tokens_per_group=T, groups=groups, ep=ep, replicas=lay.replicas,
                 expert_load=load[-1].tolist(), expert_load_theory_balanced=fair,
                 load_cv=(load[-1].std(-1, correction=0) / load[-1].mean(-1)).mean().item(),
                 dropped_frac=(1 - load[-1].sum() / wanted[-1].sum()).item(),
                 dropped_frac_theory_balanced=drop_theory,
                 tokens_without_expert_frac=(idle[-1].sum() / (tokens * L)).item(),
                 lm_loss=lms[-1], aux_loss=auxes[-1], lm_losses=lms, aux_losses=auxes,
                 alltoall_bytes_per_step=sent, alltoall_bytes_theory=expected,
                 alltoall_bytes_per_rank=[r[0] for r in per_rank],
                 alltoall_bytes_expected_per_rank=[r[1] for r in per_rank],
                 counts_bytes_per_step=self.comm.total("all_gather", "ep"),
                 expert_load_per_step=load.tolist(),
                 maxvio_per_step=(load.amax(-1) / load.mean(-1) - 1).mean(-1).tolist(), expert_bias=biases)
        rule = "4 x layers x (ep-1)/ep x E x G/W x C x D x bytes" if cf else \
            "2 x (pairs to other ranks + pairs from them) x D x bytes, from the routed counts"
        d.log("summary (last step, all ranks)          measured   | theory\n"
              + (f"  capacity C per expert per group      {C:<10} | ceil(cf x {k or 1} x T / E), <= T = {T}\n"
                 if cf else "  capacity                             dropless   | every choice served\n")
              + "".join(f"  expert load, MoE layer {i}           {[int(v) for v in l]} | {fair:g} each if "
                        "balanced\n" for i, l in enumerate(f["expert_load"]))
              + f"  dropped assignments                  {f['dropped_frac']:<10.2%} | {drop_theory:.2%} if "
              f"balanced (max(0, 1 - C E / (k T)))\n"
              f"  tokens with no expert                {f['tokens_without_expert_frac']:<10.2%} |\n"
              f"  MaxVio per step (max/mean load - 1)  {' '.join(f'{v:.3f}' for v in f['maxvio_per_step'])}\n"
              + "".join(f"  expert bias, MoE layer {i}           {[round(v, 4) for v in b]}\n"
                        for i, b in enumerate(biases))
              + f"  LM loss, aux loss (x {aux_weight(args):g})  {lms[-1]:.6f}, {auxes[-1]:.6f}\n"
              f"  all-to-all bytes sent / step / rank  {f['alltoall_bytes_per_rank']} | "
              f"{f['alltoall_bytes_expected_per_rank']} = {rule}"
              + (f"\n  counts all-gathered / step / rank    {f['counts_bytes_per_step']:<10} | "
                 f"{L * (E + 1) * 8} = layers x (E+1) x 8" if not cf and ep > 1 else ""))
        return f


# --- reference for --check ---
def full_params(lay, model):
    """The whole model by name (expert shards all-gathered over the EP group) and its buffers (the loss-free
    bias), for --check on rank 0."""
    _, expert = split_params(model)
    ids, out = {id(p) for p in expert}, {}
    for name, p in [*model.named_parameters(), *model.named_buffers()]:
        if id(p) in ids and lay.ep > 1:
            parts = [torch.empty_like(p) for _ in range(lay.ep)]
            dist.all_gather(parts, p.detach().contiguous(), group=lay.ep_group)
            out[name] = torch.cat(parts)  # (E, ...) in expert order: EP rank j holds block j
        else:
            out[name] = p.detach()
    return out


def moe_reference(args, groups, device):
    """The one-process answer: every expert local, the same routing groups, the same random numbers, the
    loss-free bias moved by the whole batch's counts (one process routes them all: nothing to all-reduce)."""
    model = build_moe_gpt(args, groups, device=device)
    layers, steps = moe_layers(model), iter(range(args.steps))  # reference_train calls loss_of once per step

    def loss_of(m, x, y, n_tok):
        step = next(steps)
        if step > 0 and args.router == "loss_free":
            update_biases(layers, args.bias_rate, None)  # the update after step - 1, before this step routes
        set_step(m, step, 0)
        return lm_loss(m(x), y, n_tok) + aux_weight(args) * aux_share(m, groups)

    ref = reference_train(args, device, model=model, loss_of=loss_of)
    if args.router == "loss_free" and args.steps:
        update_biases(layers, args.bias_rate, None)
    ref["params"].update({n: b.detach().clone() for n, b in model.named_buffers()})
    return ref


if __name__ == "__main__":
    main()
