"""Layer-level checks of moe.py, all in one process group:

    torchrun --nproc_per_node=4 tests/moe_checks.py        (prints ALL CHECKS PASSED, exits 1 otherwise)
    python tests/moe_checks.py                             (world 1, e.g. one GPU: EP 1 and the local checks)

Every model and every tensor of a collective lives on the run's device (cuda:LOCAL_RANK under NCCL).

1. EP = 1, 2 and 4 (the last two inside the same world of 4: 4 replicas x EP 1, 2 x 2, 1 x 4) give the
   outputs, aux loss, gradients, and after several steps losses and parameters (the loss-free bias included)
   of the one-process model with every expert local and the same 4 routing groups, for every router, and
   for loss_free and gshard also dropless and with shared experts (float64).
2. Dispatch -> combine with identity experts and unit gates returns the input; experts that scale by
   (i+1) show that each token reached the experts the router chose, across the all-to-all (capacity and
   dropless).
3. Dropless: the layer equals a per-token loop over each token's chosen experts (every choice served), and
   a capacity large enough to drop nothing; the uneven all-to-all's splits are the routed counts, and the
   bytes it hands to other ranks are 2 x (pairs out + pairs in) x D x 8, counted from the choices here.
4. Hand-written logits: assignment, capacity and drops of switch and gshard; switch's weighted aux loss is
   alpha under uniform routing; expert choice fills every expert with exactly C tokens; noisy top-k's
   smooth load equals a Monte-Carlo estimate of its definition.
5. One process, one router per rank: the balancing loss evens the load against aux weight 0, the loss-free
   bias lowers MaxVio against --bias-rate 0, and training lowers the LM loss toward the Markov floor; a
   loss-free model saved after 2 steps and loaded into a fresh one resumes bit for bit.
6. The copy-out check of tests/test_moe.py (moe.MoE in a model that is not the GPT, at EP 2 x 2 replicas).
7. Bad input, at EP 2 (groups [0, 1] and [2, 3]), with the cores of moe.py's technique section alone: MoE built
   with what it cannot do (experts not divisible by EP, an unknown router or score, a top-k its router does not
   take or past E, a negative capacity factor, expert choice dropless), a forward given sequences that do not
   cut into whole routing groups, an all-to-all of rows that do not split: a ValueError naming what would work,
   and harness.CommCounter saw no collective (the same calls given good input show it would have). Mutants:
   the section with its checks turned into no-ops builds such a layer silently (an unknown router: a
   TypeError), and the forward fails with einops' error instead of the clear one.
Negative checks: random numbers keyed by a rank's local position, other routing groups, a bias updated from
one rank's counts (caught by --check's own verdict), a copied-out model without gradient sync: all differ.
"""
import copy
import math
import os
import sys
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT_PATH = Path(ROOT)
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe
from common import MarkovData, close_dist, count_tokens, init_dist, lm_loss, make_optimizer
from harness import check_against_reference, CommCounter

TOL = 1e-9
results = []


def tiny(router, **kw):
    base = dict(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, batch_size=12, steps=3, dtype="float64",
                experts=4, capacity_factor=1.0, router=router, aux_weight=0.1, bias_rate=0.02)
    base.update(kw)
    return moe.Args(**base)


def gmax(d, x):
    """The largest value over ranks (every rank gets it), through a tensor on the device (NCCL needs it)."""
    t = torch.tensor([float(x)], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check(d, name, ok, detail=""):
    ok = gmax(d, 0.0 if ok else 1.0) == 0.0  # passed on every rank
    results.append(ok)
    d.log(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}")


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def gather_grads(lay, model):
    """Full gradients by name: expert shards all-gathered over the EP group."""
    _, expert = moe.split_params(model)
    ids, out = {id(p) for p in expert}, {}
    for name, p in model.named_parameters():
        if id(p) in ids and lay.ep > 1:
            parts = [torch.empty_like(p.grad) for _ in range(lay.ep)]
            dist.all_gather(parts, p.grad.contiguous(), group=lay.ep_group)
            out[name] = torch.cat(parts)
        else:
            out[name] = p.grad
    return out


def first_step(d, args, data, groups, lay=None, row_key_offset=True):
    """Forward + backward of step 0 on d.device. One process (lay None) on the whole batch, else this rank's rows."""
    x, y = (t.to(d.device) for t in data.batch(0, args.batch_size, args.seq_len))
    n_tok = count_tokens(y)
    if lay is None:
        model, row0, rows = moe.build_moe_gpt(args, groups, device=d.device), 0, args.batch_size
    else:
        model = moe.build_moe_gpt(args, groups, lay.ep_group, d.device)
        rows = args.batch_size // d.world
        row0 = d.rank * rows
    moe.set_step(model, 0, row0 if row_key_offset else 0)
    logits = model(x[row0:row0 + rows])
    aux = moe.aux_share(model, groups)
    (lm_loss(logits, y[row0:row0 + rows], n_tok) + moe.aux_weight(args) * aux).backward()
    if lay is None:
        return logits.detach(), aux.item(), {n: p.grad for n, p in model.named_parameters()}
    moe.sync_grads(model, lay.ep_group, lay.replica_group, dist.group.WORLD)
    aux_t = aux.detach().clone().view(1)
    dist.all_reduce(aux_t)
    return logits.detach(), aux_t.item(), gather_grads(lay, model), row0, rows


def train(d, args, lay, data, groups):
    """args.steps steps of moe.train_step at this layout: (losses of the global batch, full parameters)."""
    model = moe.build_moe_gpt(args, groups, lay.ep_group, d.device)
    opt = make_optimizer(model.parameters(), args)
    rows = args.batch_size // d.world
    losses = []
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, args.seq_len)
        parts = torch.stack(moe.train_step(args, lay, model, opt, x[d.rank * rows:][:rows].to(d.device),
                                           y[d.rank * rows:][:rows].to(d.device), count_tokens(y), step,
                                           d.rank * rows, groups))
        dist.all_reduce(parts)
        losses.append((parts[0] + moe.aux_weight(args) * parts[1]).item())
    return losses, moe.full_params(lay, model)


# (router, extra flags): the four classic routers, then loss-free (capacity, dropless, shared experts, softmax)
# and gshard dropless with shared experts (its random routing leaves unwanted 2nd choices out of the exchange)
PARITY = [("noisy_topk", dict(top_k=2)), ("gshard", {}), ("switch", {}), ("expert_choice", {}), ("loss_free", {}),
          ("loss_free", dict(capacity_factor=0, shared_experts=1)),
          ("loss_free", dict(capacity_factor=0, score="softmax", seq_aux_weight=0.1, top_k=3)),
          ("gshard", dict(capacity_factor=0, shared_experts=2))]


def parity(d, data, layouts):
    groups = 4
    for router, kw in PARITY:
        args = tiny(router, **kw)
        ref_logits, ref_aux, ref_grads = first_step(d, args, data, groups)
        ref = moe.moe_reference(args, groups, d.device)
        for ep, lay in layouts.items():
            logits, aux, grads, row0, rows = first_step(d, args, data, groups, lay)
            out_diff = rel(logits, ref_logits[row0:row0 + rows])
            grad_diff = max(rel(grads[n], g) for n, g in ref_grads.items())
            losses, full = train(d, args, lay, data, groups)
            loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref["losses"]))
            param_diff = max((full[n] - p).abs().max().item() for n, p in ref["params"].items())
            aux_diff = abs(aux - ref_aux) / max(abs(ref_aux), 1e-300)
            diffs = [gmax(d, v) for v in (out_diff, aux_diff, grad_diff, loss_diff, param_diff)]
            flags = " ".join(f"{k}={v}" for k, v in kw.items())
            check(d, f"parity {router:13s} {flags} EP {ep} ({d.world // ep} replicas) vs one process, 4 groups",
                  max(diffs) <= TOL and set(full) == set(ref["params"]),
                  "rel diff: outputs {:.1e}, aux {:.1e}, grads {:.1e}, losses after 3 steps {:.1e}; params {:.1e}"
                  .format(*diffs))
            if router == "loss_free":  # the bias did move, and every rank holds the same one
                bias = torch.cat([v.flatten() for n, v in full.items() if n.endswith("expert_bias")])
                top = bias.clone()
                dist.all_reduce(top, op=dist.ReduceOp.MAX)
                check(d, f"loss_free bias moved and is the same on every rank, EP {ep}",
                      bias.abs().max() > 0 and torch.equal(top, bias), str(bias.tolist()))
    # Negative: the noise keyed by a rank's *local* group (as a per-rank RNG would do) changes the answer.
    if d.world > 1:  # at world 1 local and global groups coincide
        args = tiny("noisy_topk")
        ref_logits, _, _ = first_step(d, args, data, groups)
        logits, _, _, row0, rows = first_step(d, args, data, groups, layouts[d.world], row_key_offset=False)
        check(d, "negative: noise keyed by local instead of global group differs from the reference",
              gmax(d, rel(logits, ref_logits[row0:row0 + rows])) > 1e-6)
    # Negative: one routing group instead of 4 gives other capacities, other drops, other outputs.
    args = tiny("switch")
    one = first_step(d, args, data, 1)[0]
    four = first_step(d, args, data, 4)[0]
    check(d, "negative: 1 routing group vs 4 changes the output (capacity is per group)", rel(one, four) > 1e-6,
          f"rel diff {rel(one, four):.2e}")
    # Negative: the loss-free bias updated from one rank's counts alone (no all-reduce) at EP 2 x 2 replicas,
    # judged by --check's own verdict (harness.check_against_reference), which passes the real update.
    if 2 in layouts and d.world == 4:
        args = tiny("loss_free", capacity_factor=0, steps=4)
        ref = moe.moe_reference(args, groups, d.device) if d.rank == 0 else None
        quiet = copy.copy(d)
        quiet.log = lambda *a: None  # its FAILED line would read as a failed check here
        real = moe.update_biases
        verdicts = []
        for local in (False, True):
            if local:
                moe.update_biases = lambda layers, rate, group: real(layers, rate, None)
            try:
                losses, full = train(d, args, layouts[2], data, groups)
            finally:
                moe.update_biases = real
            verdicts.append(check_against_reference(quiet, args, losses, full, ref=ref)["passed"])
        check(d, "negative: a loss-free bias from one rank's counts (no all-reduce) fails --check at EP 2; "
                 "the all-reduced one passes", verdicts == [True, False], str(verdicts))


def layer_of(args, lay, d, groups=4):
    return moe.moe_layers(moe.build_moe_gpt(args, groups, lay.ep_group, d.device))[0]


def route(layer, xg):
    """The layer's routing decision for xg (G, T, D): (dispatch, combine), the capacity's or dropless's
    stand-in (one slot per pair, C = T K)."""
    if layer.kind == "expert_choice":
        return moe.route_expert_choice(xg @ layer.w_gate, moe.capacity(layer.cf, 1, xg.shape[1], layer.E))
    expert, gate, keep, _ = layer.choose(xg, xg.shape[1])
    return moe.fill_slots(expert, gate, keep, moe.capacity(layer.cf, layer.k, xg.shape[1], layer.E), layer.E)


def dispatch_combine(d, data, layouts):
    real_mlps = moe.mlps
    for router in moe.ROUTERS:
        for ep in [ep for ep in (2, 4) if ep in layouts]:
            lay = layouts[ep]
            layer = layer_of(tiny(router), lay, d)
            g = torch.Generator().manual_seed(100 + d.rank)
            xg = torch.randn(1, layer.group_rows * 8, 16, generator=g, dtype=torch.float64).to(d.device)
            layer.row0 = d.rank * layer.group_rows
            dispatch, combine = route(layer, xg)
            n_assigned = dispatch.sum((2, 3))[..., None]  # (1, S, 1)
            scale = torch.arange(1, layer.E + 1, dtype=torch.float64, device=d.device)  # expert i: x (i + 1)
            with torch.no_grad():  # my expert e's w1[e, 0, 0] holds its scale, read by the stand-in below
                layer.w1[:, 0, 0] = scale[lay.ep_rank * layer.El:(lay.ep_rank + 1) * layer.El]
            identity, scaled = (lambda h, *w: h), (lambda h, w1, *w: h * w1[..., :1, :1])  # one or X experts
            try:
                moe.mlps = identity  # identity experts, unit gates
                y_id = layer.exchange(xg, dispatch, dispatch)
                moe.mlps = scaled
                y_sc = layer.exchange(xg, dispatch, dispatch)
            finally:
                moe.mlps = real_mlps
            want_sc = torch.einsum("gsec,e->gs", dispatch, scale)[..., None] * xg
            remote = dispatch.sum((0, 1, 3))  # tokens sent to each expert; some must live on other ranks
            remote = remote.sum() - remote[lay.ep_rank * layer.El:(lay.ep_rank + 1) * layer.El].sum()
            ok = (torch.equal(y_id, n_assigned * xg) and torch.allclose(y_sc, want_sc, rtol=1e-15, atol=0)
                  and remote > 0 and not torch.allclose(y_sc, y_id))
            if router != "expert_choice":  # the dropless exchange: the same identities, every choice served
                expert, gate, keep, _ = layer.choose(xg, 8)
                try:
                    moe.mlps = identity
                    y_id2 = layer.dropless(xg, expert, torch.ones_like(gate), keep)
                    moe.mlps = scaled
                    y_sc2 = layer.dropless(xg, expert, torch.ones_like(gate), keep)
                finally:
                    moe.mlps = real_mlps
                served = keep.sum(-1)[..., None]
                want_sc2 = torch.einsum("gtke,e->gt", F.one_hot(expert, layer.E) * keep[..., None], scale)[..., None]
                ok = ok and torch.equal(y_id2, served * xg) and torch.allclose(y_sc2, want_sc2 * xg, rtol=1e-15, atol=0)
            check(d, f"dispatch/combine {router:13s} EP {ep}: identity returns the input "
                     f"(x #assignments), experts x(i+1) give sum_i (i+1) x over the router's choices"
                     + (", with a capacity and dropless" if router != "expert_choice" else ""), ok)
    # With enough capacity for everything, switch's round trip returns exactly the input.
    ep = max(layouts)
    lay = layouts[ep]
    layer = layer_of(tiny("switch", capacity_factor=4.0), lay, d)
    xg = torch.randn(1, layer.group_rows * 8, 16, dtype=torch.float64).to(d.device)
    dispatch, _ = route(layer, xg)
    try:
        moe.mlps = lambda h, *w: h
        ok = torch.equal(layer.exchange(xg, dispatch, dispatch), xg)
    finally:
        moe.mlps = real_mlps
    check(d, "dispatch/combine switch, C = S: identity experts + unit gates return exactly the input",
          ok, f"C = {moe.capacity(layer.cf, 1, xg.shape[1], layer.E)}")


def dropless(d, layouts):
    """A dropless layer (E = 8, top-3 loss-free, and gshard with its unwanted 2nd choices) against a per-token
    loop over every token's choices with the full expert weights; its splits and bytes against the counts."""
    for router, k in (("loss_free", 3), ("gshard", 0)):
        for ep in [ep for ep in (2, 4) if ep in layouts]:
            lay = layouts[ep]
            args = tiny(router, experts=8, top_k=k, capacity_factor=0)
            layer = layer_of(args, lay, d)
            layer.row0, layer.step = d.rank * layer.group_rows, 1
            with torch.no_grad():  # a bias that changes the choices
                if router == "loss_free":
                    layer.expert_bias.copy_(torch.linspace(-0.02, 0.02, 8, dtype=torch.float64))
            g = torch.Generator().manual_seed(7 + d.rank)
            x = torch.randn(layer.group_rows, 8, 16, generator=g, dtype=torch.float64).to(d.device).requires_grad_()
            splits, real = [], moe.AllToAll.apply  # the forward's two exchanges, then the backward's
            moe.AllToAll.apply = lambda t, grp, o=None, i=None: splits.append((o, i)) or real(t, grp, o, i)
            comm = CommCounter(axes={"ep": lay.ep_group}, log=True)
            try:
                with comm:
                    y = layer(x)
                    y.square().sum().backward()
            finally:
                del moe.AllToAll.apply  # the inherited torch.autograd.Function.apply again
            expert, gate, keep, _ = layer.choose(x.detach().view(1, -1, 16), 8)
            # the loop: full expert weights, each token's wanted choices, in Python
            full = {n: torch.cat([t for t in gathered(getattr(layer, n), lay)]) for n in ("w1", "b1", "w2", "b2")}
            want = torch.zeros(x.shape[0] * 8, 16, dtype=torch.float64, device=d.device)
            xt = x.detach().view(-1, 16)
            pairs = [0] * 8
            for t in range(xt.shape[0]):
                for j in range(expert.shape[-1]):
                    if keep[0, t, j] > 0:
                        e = int(expert[0, t, j])
                        pairs[e] += 1
                        h = F.gelu(xt[t] @ full["w1"][e] + full["b1"][e]) @ full["w2"][e] + full["b2"][e]
                        want[t] += gate[0, t, j] * h
            loop_diff = rel(y.detach().view(-1, 16), want)
            # a capacity large enough to drop nothing (C = T) computes the same
            layer.cf = 100.0
            big_diff = rel(y.detach(), layer(x.detach()))
            layer.cf = 0
            # splits: what I send to rank j = my pairs for j's experts; what I get = rank i's pairs for mine
            every = torch.tensor(pairs, device=d.device)
            counts = [torch.empty_like(every) for _ in range(lay.ep)]
            dist.all_gather(counts, every, group=lay.ep_group)
            El, me = 8 // ep, lay.ep_rank
            send = [sum(pairs[j * El:(j + 1) * El]) for j in range(ep)]
            recv = [int(c[me * El:(me + 1) * El].sum()) for c in counts]
            fwd = splits[0]  # the dispatch: (out_splits, in_splits) = (recv, send)
            out, into = sum(send) - send[me], sum(recv) - recv[me]
            sent = sum(c["to_others"] for c in comm.calls_log if c["op"] == "all_to_all")
            ok = (loop_diff < 1e-12 and big_diff < 1e-12 and fwd == (recv, send) and splits[1] == (send, recv)
                  and sent == 2 * (out + into) * 16 * 8 and len(set(send + recv)) > 1)
            check(d, f"dropless {router:9s} EP {ep}: = per-token loop over the chosen experts, = capacity C = T; "
                     "splits = routed counts, bytes = 2 x (pairs out + in) x D x 8",
                  ok, f"loop {loop_diff:.1e}, C=T {big_diff:.1e}, send {send} recv {recv}, {sent} B")


def gathered(p, lay):
    parts = [torch.empty_like(p) for _ in range(lay.ep)]
    dist.all_gather(parts, p.detach().contiguous(), group=lay.ep_group)
    return parts


def hand_written(d):
    # Switch, S = 6 tokens, E = 3, cf 1.0 -> C = 2. First choices 0 0 0 1 0 2: expert 0 takes tokens 0 and 1,
    # tokens 2 and 4 find it full and are dropped; token 3 -> expert 1 slot 0, token 5 -> expert 2 slot 0.
    C = moe.capacity(1.0, moe.experts_per_token("switch"), 6, 3)
    logits = 4.0 * torch.nn.functional.one_hot(torch.tensor([[0, 0, 0, 1, 0, 2]]), 3).double()
    expert, gate, keep, _ = moe.route_switch(logits)
    dispatch, combine = moe.fill_slots(expert, gate, keep, C, 3)
    want = torch.zeros(1, 6, 3, 2, dtype=torch.float64)
    for s, e, c in [(0, 0, 0), (1, 0, 1), (3, 1, 0), (5, 2, 0)]:
        want[0, s, e, c] = 1
    p = logits.softmax(-1).max(-1).values[..., None, None]
    wanted = (F.one_hot(expert, 3) * keep[..., None]).sum((1, 2))
    check(d, "switch hand-written: C = 2, tokens 2 and 4 dropped, slots in token order, gate = router prob",
          C == 2 and torch.equal(dispatch, want) and torch.allclose(combine, want * p, rtol=0, atol=1e-15)
          and wanted.tolist() == [[4, 1, 1]], f"capacity {C}")
    caps = [moe.capacity(1.25, moe.experts_per_token("switch"), 24, 4),
            moe.capacity(1.0, moe.experts_per_token("gshard"), 24, 4),
            moe.capacity(2.0, moe.experts_per_token("expert_choice"), 24, 4),
            moe.capacity(9, moe.experts_per_token("switch"), 24, 4)]
    check(d, "capacity: switch ceil(1.25*24/4)=8, gshard 2*24/4=12, expert choice 2*24/4=12, capped at S=24",
          caps == [8, 12, 12, 24], str(caps))
    # GShard, S = 4, E = 3, cf 0.75 -> C = ceil(0.75 * 2 * 4 / 3) = 2. (1st, 2nd) choices: (0,1) (0,2) (0,1) (1,0).
    # All first choices before any second: e0 <- t0, t1 (t2 dropped); e1 <- t3. Then seconds: t0 -> e1 slot 1,
    # t1 -> e2 slot 0, t2 -> e1 full (dropped: token 2 gets nothing), t3 -> e0 full (dropped).
    C = moe.capacity(0.75, moe.experts_per_token("gshard"), 4, 3)
    logits = torch.tensor([[[3.0, 2, 0], [3, 0, 2], [3, 2, 0], [2, 3, 0]]], dtype=torch.float64)
    dispatch, combine = moe.fill_slots(*moe.route_gshard(logits, torch.zeros(1, 4, dtype=torch.float64))[:3], C, 3)
    want = torch.zeros(1, 4, 3, 2, dtype=torch.float64)
    for s, e, c in [(0, 0, 0), (1, 0, 1), (3, 1, 0), (0, 1, 1), (1, 2, 0)]:
        want[0, s, e, c] = 1
    g = logits.softmax(-1).topk(2).values
    g = g / g.sum(-1, keepdim=True)
    token_gates = torch.tensor([[1.0, 1.0, 0.0, g[0, 3, 0].item()]], dtype=torch.float64)  # token 3: its g1 only
    gates_ok = torch.allclose(combine.sum((2, 3)), token_gates, atol=1e-15)
    expert, gate, keep, _ = moe.route_gshard(logits, torch.ones(1, 4, dtype=torch.float64))
    dispatch_u1, _ = moe.fill_slots(expert, gate, keep, C, 3)
    wanted_u1 = (F.one_hot(expert, 3) * keep[..., None]).sum((1, 2))
    want_u1 = torch.zeros(1, 4, 3, 2, dtype=torch.float64)
    for s, e, c in [(0, 0, 0), (1, 0, 1), (3, 1, 0)]:
        want_u1[0, s, e, c] = 1
    check(d, "gshard hand-written: C = 2, 2nd choices queue behind all 1st choices, token 2 dropped entirely; "
             "uniform = 1 drops every 2nd choice (random routing keeps it with prob 2*g2 <= 1)",
          C == 2 and torch.equal(dispatch, want) and gates_ok and torch.equal(dispatch_u1, want_u1)
          and wanted_u1.tolist() == [[3, 1, 0]])
    # Random routing frequency: 2 * g2 = 0.5 for every token, uniforms from a generator: ~half kept.
    n = 20000
    lg = torch.tensor([math.log(3.0), 0.0, -30.0], dtype=torch.float64).expand(1, n, 3)  # g1, g2 = 3/4, 1/4
    u = torch.rand(1, n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kept = moe.route_gshard(lg, u)[2][0, :, 1].sum().item() / n  # wanted 2nd choices (all on expert 1)
    check(d, "gshard random routing keeps the 2nd expert with probability 2*g2 = 0.5", abs(kept - 0.5) < 0.02,
          f"kept {kept:.3f}")
    # Switch aux under perfectly uniform routing (token s prefers expert s mod E, symmetric probabilities):
    # E * sum f_i P_i = E * E * (1/E)(1/E) = 1, so the weighted aux loss is alpha exactly.
    a = tiny("switch", experts=4, aux_weight=1e-2)
    logits = 3.0 * torch.nn.functional.one_hot(torch.arange(8) % 4, 4).double()[None]
    aux = moe.route_switch(logits)[3].item()
    skew = moe.route_switch(3.0 * torch.nn.functional.one_hot(torch.zeros(8, dtype=torch.long), 4).double()[None])[3]
    check(d, "switch aux loss x alpha = alpha under uniform routing; all tokens on one expert give more",
          abs(a.aux_weight * aux - 1e-2) < 1e-15 and skew.item() > 3.0,
          f"alpha*aux {a.aux_weight * aux:.17f}, skewed aux {skew.item():.3f}")
    # Expert choice: every expert exactly C tokens, every slot filled once; a token may get 0..E experts.
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 24, 4, generator=g, dtype=torch.float64)
    C = moe.capacity(1.0, moe.experts_per_token("expert_choice"), 24, 4)
    dispatch, combine = moe.route_expert_choice(logits, C)
    per_token = dispatch.sum((2, 3))
    check(d, "expert choice: every expert takes exactly C = 6 tokens, each slot once, tokens get 0..E experts",
          C == 6 and (dispatch.sum((1, 3)) == C).all() and (dispatch.sum(1) == 1).all() and (per_token >= 2).any()
          and (per_token == 0).any(), f"experts per token: {per_token[0].int().tolist()}")
    # Noisy top-k's smooth load against its definition: redraw only expert i's noise, count how often i is
    # in the top k (Monte Carlo, 40000 draws), for every token and expert of a small example.
    g = torch.Generator().manual_seed(3)
    clean = torch.randn(1, 3, 4, generator=g, dtype=torch.float64)
    std = 0.2 + torch.rand(1, 3, 4, generator=g, dtype=torch.float64)
    H = clean + torch.randn(1, 3, 4, generator=g, dtype=torch.float64) * std
    P = moe.smooth_load(clean, std, H, 2)
    mc = torch.zeros_like(P)
    draws = torch.randn(40000, generator=g, dtype=torch.float64)
    for s in range(3):
        for i in range(4):
            others = torch.cat([H[0, s, :i], H[0, s, i + 1:]])
            kth_other = others.topk(2).values[-1]  # i is in the top 2 iff it beats the 2nd best of the others
            mc[0, s, i] = ((clean[0, s, i] + draws * std[0, s, i]) > kth_other).double().mean()
    check(d, "noisy top-k smooth load = Monte-Carlo of 'expert i stays in the top k when its noise is redrawn'",
          (P - mc).abs().max() < 0.015, f"max |P - MC| {(P - mc).abs().max():.4f}")


def balance(d):
    """One process per rank, one router each: train from a deliberately sharp router (x50) with and without
    the balancing loss (loss_free: with and without the bias, dropless); compare the load's coefficient of
    variation (loss_free: MaxVio) over the last 10 steps. Noisy top-k gets weight 1: its loss is two CV^2 of
    smooth quantities (importance, Phi-estimated load), and at 0.1 it halves (0.66 -> 0.33) while 30 steps
    move the capacity-clipped hard load only 11% (CV 0.29 -> 0.26)."""
    # loss_free: the bias rate; 0.01 moves the bias across the score gaps within 30 steps, while 0.1 overshoots
    # them every step and oscillates (MaxVio 0.60 over the last 10 steps vs 0.37 at 0.01, 0.65 at 0)
    weight = {"noisy_topk": 1.0, "loss_free": 0.01}
    args = dict(vocab=32, seq_len=16, d_model=32, n_heads=2, n_layers=2, batch_size=8, steps=30, dtype="float32",
                experts=8, capacity_factor=1.0, lr=1e-2, seed=1)
    data = MarkovData(args["vocab"], args["seed"])
    owner = dict(noisy_topk=0, gshard=1, switch=2, expert_choice=3, loss_free=3)  # loss_free beside the cheapest
    mine = [r for r in moe.ROUTERS if owner[r] % d.world == d.rank]
    for router in moe.ROUTERS:
        out = torch.zeros(4 + 60, dtype=torch.float64, device=d.device)  # cv without, with, first LM, last LMs
        if router in mine:
            cvs, lms_of, vios = {}, {}, {}
            for w in (0.0, weight.get(router, 0.1)):
                free = router == "loss_free"
                a = moe.Args(**{**args, "capacity_factor": 0.0 if free else 1.0}, router=router,
                             aux_weight=0.0 if free else w, bias_rate=w if free else 0.0)
                torch.manual_seed(0)
                model = moe.build_moe_gpt(a, 1, device=d.device)
                layers = moe.moe_layers(model)
                for layer in layers:
                    layer.w_gate.data.mul_(50.0)
                opt = make_optimizer(model.parameters(), a)
                cv, vio, lms = [], [], []
                for step in range(a.steps):
                    x, y = (t.to(d.device) for t in data.batch(step, a.batch_size, a.seq_len))
                    moe.set_step(model, step, 0)
                    lm = lm_loss(model(x), y, count_tokens(y))
                    opt.zero_grad()
                    (lm + moe.aux_weight(a) * moe.aux_share(model, 1)).backward()
                    opt.step()
                    if free:
                        moe.update_biases(layers, a.bias_rate, None)
                    load = torch.stack([m.wanted if m.dispatch is None else m.dispatch.sum((0, 1, 3))
                                        for m in layers]).double()
                    cv.append((load.std(-1, correction=0) / load.mean(-1)).mean().item())
                    vio.append((load.amax(-1) / load.mean(-1) - 1).mean().item())
                    lms.append(lm.item())
                cvs[w], lms_of[w], vios[w] = sum((vio if free else cv)[-10:]) / 10, lms, vio
            lms = lms_of[0.0]  # the LM alone learns (noisy top-k at aux weight 1 trades LM loss for balance)
            out = torch.tensor([cvs[0.0], cvs[w], lms[0], sum(lms[-5:]) / 5, *vios[0.0], *vios[w]],
                               dtype=torch.float64, device=d.device)
        dist.all_reduce(out)  # only the owner's numbers are nonzero
        cv0, cv1, first, last = out[:4].tolist()
        if router == "expert_choice":
            check(d, "balance expert_choice: load perfectly even by construction, with or without aux",
                  cv0 == 0 and cv1 == 0, f"CV {cv0:.3f} / {cv1:.3f}")
        elif router == "loss_free":
            without, with_bias = out[4:34].tolist(), out[34:].tolist()
            check(d, f"balance loss_free : bias rate {weight[router]:g} lowers MaxVio vs rate 0 (mean of the last "
                     "10 of 30 steps, and the last step)", cv1 < 0.8 * cv0 and with_bias[-1] < without[-1],
                  f"MaxVio {cv0:.3f} -> {cv1:.3f}")
            d.log("      MaxVio per step, bias rate 0:    " + " ".join(f"{v:.2f}" for v in without))
            d.log(f"      MaxVio per step, bias rate {weight[router]:g}: " + " ".join(f"{v:.2f}" for v in with_bias))
        else:
            check(d, f"balance {router:10s}: aux weight {weight.get(router, 0.1):g} evens the load vs 0 "
                     "(CV of load, last 10 of 30 steps)",
                  cv1 < 0.8 * cv0, f"CV {cv0:.3f} -> {cv1:.3f}")
        gap0, gap1 = first - data.entropy, last - data.entropy
        check(d, f"training {router:13s} (aux weight 0) lowers the LM loss toward the floor {data.entropy:.3f}",
              gap1 < 0.4 * gap0, f"{first:.3f} -> {last:.3f} (gap {gap0:.3f} -> {gap1:.3f})")


def resume_bias(d, data):
    """Rank 0 alone: a loss-free model whose state_dict (the bias in it) is saved after 2 of 4 steps and loaded
    into a freshly built model goes on bit for bit as the uninterrupted one: losses, parameters and bias."""
    ok, detail = True, ""
    if d.rank == 0:
        args = tiny("loss_free", capacity_factor=0, shared_experts=1, steps=4)

        def steps(model, opt, lo, hi):
            losses = []
            for step in range(lo, hi):
                x, y = (t.to(d.device) for t in data.batch(step, args.batch_size, args.seq_len))
                moe.set_step(model, step, 0)
                loss = lm_loss(model(x), y, count_tokens(y))
                opt.zero_grad()
                loss.backward()
                opt.step()
                moe.update_biases(moe.moe_layers(model), args.bias_rate, None)
                losses.append(loss.item())
            return losses

        def fresh():
            model = moe.build_moe_gpt(args, 4, device=d.device)
            return model, make_optimizer(model.parameters(), args)

        m1, o1 = fresh()
        whole = steps(m1, o1, 0, 4)
        m2, o2 = fresh()
        first = steps(m2, o2, 0, 2)
        saved = copy.deepcopy({"model": m2.state_dict(), "optim": o2.state_dict()})
        m3, o3 = fresh()
        m3.load_state_dict(saved["model"])
        o3.load_state_dict(saved["optim"])
        rest = steps(m3, o3, 2, 4)
        a, b = m1.state_dict(), m3.state_dict()
        ok = (first + rest == whole and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
              and any(k.endswith("expert_bias") and a[k].abs().max() > 0 for k in a))
        detail = f"bias {[round(v, 3) for k in a if k.endswith('expert_bias') for v in a[k].tolist()]}"
    check(d, "loss_free: the bias is in the state_dict; saved after 2 steps and loaded, it resumes bit for bit",
          ok, detail)


def refusal(call, axes):
    """The message of the ValueError `call()` raises (None: none raised) and the collectives seen meanwhile."""
    with CommCounter(axes=axes) as comm:
        try:
            call()
            msg = None
        except ValueError as e:
            msg = str(e)
        except Exception as e:  # noqa: BLE001 (another error is a failure, reported)
            msg = f"not a ValueError: {type(e).__name__}: {e}"
    return msg, dict(comm.calls)


def bad_input(d, lay):
    """7 of the docstring: each bad input refused before any collective, at EP 2."""
    import section
    text = (ROOT_PATH / "moe.py").read_text()
    core = section.load("moe.py")
    mutant = section.load("moe.py", text.replace("raise ValueError(", "str("))  # every check a no-op
    g, axes = lay.ep_group, {"ep": lay.ep_group}
    x = lambda b: torch.randn(b, 3, 6, dtype=torch.float64, device=d.device)  # noqa: E731  (b, n, D)

    def layer(MoE, **kw):
        return MoE(6, kw.pop("experts", 4), ep_group=g, group_rows=2, generator=torch.Generator().manual_seed(0),
                   **kw).to(d.device)
    builds = {"3 experts at EP 2": (dict(experts=3), ["3 experts over EP 2", "multiple of 2"]),
              "router 'top2'": (dict(router="top2"), ["'top2'", "noisy_topk, gshard"]),
              "loss_free, score 'tanh'": (dict(router="loss_free", score="tanh"), ["'tanh'", "sigmoid or softmax"]),
              "switch, top_k 2": (dict(router="switch", top_k=2), ["top-k 2", "switch top-1"]),
              "noisy_topk, top_k 5 of 4 experts": (dict(router="noisy_topk", top_k=5), ["top-k 5", "1..4"]),
              "expert_choice, top_k 1": (dict(router="expert_choice", top_k=1), ["expert_choice none"]),
              "capacity_factor -1": (dict(capacity_factor=-1.0), ["capacity_factor -1.0", "use > 0"]),
              "expert_choice dropless": (dict(router="expert_choice", capacity_factor=0.0), ["or 0 (dropless)"])}
    for name, (kw, words) in builds.items():
        msg, calls = refusal(lambda: layer(core["MoE"], **kw), axes)
        check(d, f"bad input: MoE({name}) refused before any collective", msg is not None
              and all(w in msg for w in words) and not calls, f"{msg}; collectives {calls}")
        msg, _ = refusal(lambda: layer(mutant["MoE"], **kw), axes)  # built silently, or another error
        check(d, f"bad input mutant: without its check, MoE({name}) is not refused clearly",
              msg is None or msg.startswith("not a ValueError"), "built silently" if msg is None else msg)
    good = layer(core["MoE"])
    msg, calls = refusal(lambda: good(x(3)), axes)  # 3 sequences, routing groups of 2
    check(d, "bad input: a forward of 3 sequences in groups of 2 refused before the all-to-all", msg is not None
          and "3 sequences" in msg and "group_rows = 2" in msg and not calls, f"{msg}; collectives {calls}")
    msg, calls = refusal(lambda: good(x(4)), axes)
    check(d, "bad input control: 4 sequences go through, and the counter sees their all-to-alls",
          msg is None and calls.get("all_to_all/ep/fwd") == 2, f"{msg}; collectives {calls}")
    msg, _ = refusal(lambda: layer(mutant["MoE"])(x(3)), axes)
    check(d, "bad input mutant: without the check, einops' error, not the clear one", msg is not None
          and msg.startswith("not a ValueError"), str(msg))
    A = core["AllToAll"].apply
    rows = torch.randn(4, 2, dtype=torch.float64, device=d.device)
    for name, call, words in [("3 rows, even split", lambda: A(rows[:3], g), ["3 rows, 2 ranks", "divisible by 2"]),
                              ("splits summing to 3 of 4 rows", lambda: A(rows, g, [2, 2], [1, 2]), ["(in: sum 4)"]),
                              ("3 splits for 2 ranks", lambda: A(rows, g, [2, 1, 1], [2, 1, 1]), ["2 in/out splits"])]:
        msg, calls = refusal(call, axes)
        check(d, f"bad input: AllToAll of {name} refused before the collective", msg is not None
              and all(w in msg for w in words) and not calls, f"{msg}; collectives {calls}")
    msg, calls = refusal(lambda: A(rows, g), axes)
    check(d, "bad input control: an AllToAll of 4 rows goes through, seen by the counter",
          msg is None and calls.get("all_to_all/ep/fwd") == 1, f"{msg}; collectives {calls}")


def main():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    d = init_dist(120)
    if d.world not in (1, 2, 4):  # 4 checks every EP degree; 1 and 2 (one GPU, two) check what fits
        print("run me as: torchrun --nproc_per_node=4 tests/moe_checks.py", file=sys.stderr)
        sys.exit(2)
    torch.manual_seed(d.rank)
    data = MarkovData(32, 0)
    layouts = {ep: moe.make_layout(d, ep) for ep in (1, 2, 4) if d.world % ep == 0}
    parity(d, data, layouts)
    dispatch_combine(d, data, layouts)
    dropless(d, layouts)
    hand_written(d)
    balance(d)
    resume_bias(d, data)
    if 2 in layouts and d.world == 4:
        import test_moe  # the copy-out check is written in the test module; it runs here, at EP 2 x 2 replicas
        for name, ok, detail in test_moe.copy_out(d, layouts[2]):
            check(d, name, ok, detail)
    if 2 in layouts:
        bad_input(d, layouts[2])
    passed = all(results)
    d.log("ALL CHECKS PASSED" if passed else f"{results.count(False)} CHECKS FAILED")
    close_dist(ok=passed)


if __name__ == "__main__":
    main()
