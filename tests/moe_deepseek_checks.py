"""Layer-level checks of moe_deepseek.py (fine-grained + shared experts, sigmoid gates, loss-free balancing,
dropless dispatch), all in one process group:

    torchrun --nproc_per_node=4 tests/moe_deepseek_checks.py   (prints ALL CHECKS PASSED, exits 1 otherwise)
    python tests/moe_deepseek_checks.py                        (world 1, e.g. one GPU: EP 1 and the local checks)

Every model and every tensor of a collective lives on the run's device (cuda:LOCAL_RANK under NCCL).

1. EP = 1, 2 and 4 (the last two inside the same world of 4: 4 replicas x EP 1, 2 x 2, 1 x 4) give the
   outputs, aux loss, gradients, and after several steps losses, parameters and the loss-free bias of the
   one-process model with every expert local (float64): sigmoid gates, granularity 4, two shared experts and
   top-4; softmax gates with the sequence-wise loss, top-3 and no shared expert.
2. Dropless: identity experts with unit gates return the input times its choices; experts that scale by
   (i+1) show each token reached the experts it chose, across the all-to-all; the layer equals a per-token
   loop over each token's chosen experts with the full expert weights; the uneven all-to-all's splits are
   the routed counts, and the bytes it hands to other ranks are 2 x (pairs out + pairs in) x D x 8.
3. One process: the loss-free bias lowers MaxVio against --bias-rate 0 from a deliberately sharp router, and
   training lowers the LM loss toward the Markov floor; a model saved after 2 steps and loaded into a fresh
   one resumes bit for bit (the bias is in the state_dict).
4. The copy-out check of tests/test_moe_deepseek.py (DeepSeekMoE in a model that is not the GPT, at EP 2 x 2).
5. Bad input at EP 2 with the technique section alone: a layer built with what it cannot do (experts not
   divisible by EP, a top-k of 0 or past E, an unknown score), an all-to-all whose splits do not fit: a
   ValueError naming what would work, before any collective (harness.CommCounter saw none; good input shows
   it would have). Mutant: the section with its checks turned into no-ops builds such a layer silently.
Negative checks: a bias updated from one rank's counts (caught by --check's own verdict), a copied-out model
without gradient sync: both differ.
"""

import copy
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch
import torch.distributed as dist
import torch.nn.functional as F

import moe_deepseek as ds
from common import MarkovData, count_tokens, lm_loss, make_optimizer
from harness import CommCounter, check_against_reference
from moe_common import (
    check,
    check_all_to_all,
    check_builds,
    check_parity,
    finish,
    refusal,
    rel,
    sections,
    start,
)


def tiny(**kw):
    base = dict(
        vocab=32,
        seq_len=8,
        d_model=16,
        n_heads=2,
        n_layers=2,
        batch_size=12,
        steps=3,
        dtype="float64",
        experts=8,
        top_k=2,
        granularity=2,
        shared_experts=1,
        bias_rate=0.02,
        seq_aux_weight=0.0,
    )
    base.update(kw)
    return ds.Args(**base)


def gathered(p, lay):
    parts = [torch.empty_like(p) for _ in range(lay.ep)]
    dist.all_gather(parts, p.detach().contiguous(), group=lay.ep_group)
    return parts


def first_step(d, args, data, lay=None):
    """Forward + backward of step 0 on d.device. One process (lay None) on the whole batch, else this rank's rows:
    (logits, global aux, full gradients by name[, row0, rows])."""
    x, y = (t.to(d.device) for t in data.batch(0, args.batch_size, args.seq_len))
    n_tok = count_tokens(y)
    model = ds.build_moe_gpt(args, None if lay is None else lay.ep_group, d.device)
    rows = args.batch_size if lay is None else args.batch_size // d.world
    row0 = 0 if lay is None else d.rank * rows
    logits = model(x[row0 : row0 + rows])
    aux = ds.aux_share(model, args.batch_size)
    (lm_loss(logits, y[row0 : row0 + rows], n_tok) + args.seq_aux_weight * aux).backward()
    if lay is None:
        return logits.detach(), aux.item(), {n: p.grad for n, p in model.named_parameters()}
    ds.sync_grads(model, lay.ep_group, lay.replica_group, dist.group.WORLD)
    _, expert = ds.split_params(model)
    ids = {id(p) for p in expert}
    grads = {
        n: torch.cat(gathered(p.grad, lay)) if id(p) in ids and lay.ep > 1 else p.grad
        for n, p in model.named_parameters()
    }
    aux_t = aux.detach().clone().view(1)
    dist.all_reduce(aux_t)
    return logits.detach(), aux_t.item(), grads, row0, rows


def train(d, args, lay, data):
    """args.steps steps of ds.train_step at this layout: (losses of the global batch, full parameters)."""
    model = ds.build_moe_gpt(args, lay.ep_group, d.device)
    opt = make_optimizer(model.parameters(), args)
    rows = args.batch_size // d.world
    losses = []
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, args.seq_len)
        parts = torch.stack(
            ds.train_step(
                args,
                lay,
                model,
                opt,
                x[d.rank * rows :][:rows].to(d.device),
                y[d.rank * rows :][:rows].to(d.device),
                count_tokens(y),
            )
        )
        dist.all_reduce(parts)
        losses.append((parts[0] + args.seq_aux_weight * parts[1]).item())
    return losses, ds.full_params(lay, model)


PARITY = [
    dict(granularity=4, top_k=4, shared_experts=2, seq_aux_weight=0.01),
    dict(score="softmax", seq_aux_weight=0.1, top_k=3, shared_experts=0, granularity=1, experts=4),
]


def parity(d, data, layouts):
    for kw in PARITY:
        args = tiny(**kw)
        ref_first = first_step(d, args, data)
        ref = ds.moe_reference(args, d.device)
        for ep, lay in layouts.items():
            flags = " ".join(f"{k}={v}" for k, v in kw.items())
            name = f"parity {flags} EP {ep} ({d.world // ep} replicas) vs one process"
            first = first_step(d, args, data, lay)
            full = check_parity(d, name, ref_first, ref, first, train(d, args, lay, data))
            bias = torch.cat([v.flatten() for n, v in full.items() if n.endswith("expert_bias")])
            top = bias.clone()
            dist.all_reduce(top, op=dist.ReduceOp.MAX)
            check(
                d,
                f"loss-free bias moved and is the same on every rank, EP {ep}",
                bias.abs().max() > 0 and torch.equal(top, bias),
                str(bias.tolist()),
            )
    # Negative: the bias updated from one rank's counts alone (no all-reduce) at EP 2 x 2 replicas, judged by
    # --check's own verdict (harness.check_against_reference), which passes the real update.
    if 2 in layouts and d.world == 4:
        args = tiny(steps=4)
        ref = ds.moe_reference(args, d.device) if d.rank == 0 else None
        quiet = copy.copy(d)
        quiet.log = lambda *a: None  # its FAILED line would read as a failed check here
        real = ds.update_biases
        verdicts = []
        for local in (False, True):
            if local:
                ds.update_biases = lambda layers, rate, group: real(layers, rate, None)
            try:
                losses, full = train(d, args, layouts[2], data)
            finally:
                ds.update_biases = real
            verdicts.append(check_against_reference(quiet, args, losses, full, ref=ref)["passed"])
        check(
            d,
            "negative: a loss-free bias from one rank's counts (no all-reduce) fails --check at EP 2; "
            "the all-reduced one passes",
            verdicts == [True, False],
            str(verdicts),
        )


def dropless(d, layouts):
    """The dropless exchange (E = 8, top-3, a bias that changes the choices) against identity and scaled
    experts, against a per-token loop with the full expert weights; its splits and bytes against the counts."""
    real_mlps = ds.mlps
    for ep in [ep for ep in (2, 4) if ep in layouts]:
        lay = layouts[ep]
        args = tiny(experts=8, top_k=3, shared_experts=0)
        layer = ds.moe_layers(ds.build_moe_gpt(args, lay.ep_group, d.device))[0]
        with torch.no_grad():  # a bias that changes the choices
            layer.expert_bias.copy_(torch.linspace(-0.02, 0.02, 8, dtype=torch.float64))
        g = torch.Generator().manual_seed(7 + d.rank)
        x = torch.randn(2, 8, 16, generator=g, dtype=torch.float64).to(d.device).requires_grad_()
        xt = x.detach().view(-1, 16)
        expert, gate = ds.route(layer.affinities(xt), layer.expert_bias, 3)
        # identity experts with unit gates; experts that scale by (i + 1) (read from w1[e, 0, 0])
        scale = torch.arange(1, 9, dtype=torch.float64, device=d.device)
        saved = layer.w1.detach().clone()
        with torch.no_grad():
            layer.w1[:, 0, 0] = scale[lay.ep_rank * layer.El : (lay.ep_rank + 1) * layer.El]
        try:
            ds.mlps = lambda h, *w: h
            y_id = layer.dropless(xt, expert, torch.ones_like(gate))
            ds.mlps = lambda h, w1, *w: h * w1[..., :1, :1]
            y_sc = layer.dropless(xt, expert, torch.ones_like(gate))
        finally:
            ds.mlps = real_mlps
            with torch.no_grad():
                layer.w1.copy_(saved)
        want_sc = torch.einsum("nke,e->n", F.one_hot(expert, 8).double(), scale)[:, None] * xt
        identities = torch.equal(y_id, 3 * xt) and torch.allclose(y_sc, want_sc, rtol=1e-15, atol=0)
        # the layer against a per-token loop, its splits and bytes
        splits, real = [], ds.AllToAll.apply  # the forward's two exchanges, then the backward's
        ds.AllToAll.apply = lambda t, grp, o, i: splits.append((o, i)) or real(t, grp, o, i)
        comm = CommCounter(axes={"ep": lay.ep_group}, log=True)
        try:
            with comm:
                y = layer(x)
                y.square().sum().backward()
        finally:
            del ds.AllToAll.apply  # the inherited torch.autograd.Function.apply again
        full = {n: torch.cat(gathered(getattr(layer, n), lay)) for n in ("w1", "b1", "w2", "b2")}
        want = torch.zeros_like(xt)
        pairs = [0] * 8
        for t in range(xt.shape[0]):
            for j in range(3):
                e = int(expert[t, j])
                pairs[e] += 1
                h = F.gelu(xt[t] @ full["w1"][e] + full["b1"][e]) @ full["w2"][e] + full["b2"][e]
                want[t] += gate[t, j] * h
        loop_diff = rel(y.detach().view(-1, 16), want)
        every = torch.tensor(pairs, device=d.device)
        counts = [torch.empty_like(every) for _ in range(lay.ep)]
        dist.all_gather(counts, every, group=lay.ep_group)
        El, me = 8 // ep, lay.ep_rank
        send = [sum(pairs[j * El : (j + 1) * El]) for j in range(ep)]
        recv = [int(c[me * El : (me + 1) * El].sum()) for c in counts]
        out, into = sum(send) - send[me], sum(recv) - recv[me]
        sent = sum(c["to_others"] for c in comm.calls_log if c["op"] == "all_to_all")
        ok = (
            identities
            and loop_diff < 1e-12
            and splits[0] == (recv, send)
            and splits[1] == (send, recv)
            and sent == 2 * (out + into) * 16 * 8
            and len(set(send + recv)) > 1
        )
        check(
            d,
            f"dropless EP {ep}: identity experts return x (x choices), x(i+1) experts sum over the choices; "
            "= per-token loop over the chosen experts; splits = routed counts, bytes = 2 x (pairs out + in) "
            "x D x 8",
            ok,
            f"loop {loop_diff:.1e}, send {send} recv {recv}, {sent} B",
        )


def balance(d):
    """One process each, rank 0 at bias rate 0 and rank 1 (rank 0 at world 1) at 0.01: train from a deliberately
    sharp router (x50); MaxVio over the last 10 of 30 steps. 0.01 moves the bias across the score gaps within
    30 steps, while 0.1 overshoots them every step and oscillates. The LM loss falls toward the Markov floor."""
    # first, last LMs; MaxVio at 0 and 0.01
    out = torch.zeros(2 + 2 * 30, dtype=torch.float64, device=d.device)
    args = dict(
        vocab=32,
        seq_len=16,
        d_model=32,
        n_heads=2,
        n_layers=2,
        batch_size=8,
        steps=30,
        dtype="float32",
        experts=8,
        top_k=2,
        granularity=1,
        shared_experts=0,
        lr=1e-2,
        seed=1,
    )
    data = MarkovData(args["vocab"], args["seed"])
    mine = [rate for i, rate in enumerate((0.0, 0.01)) if i % d.world == d.rank]
    if mine:
        vios, lms_of = {0.0: [0.0] * 30, 0.01: [0.0] * 30}, {0.0: [0.0] * 30}
        for rate in mine:
            a = ds.Args(**args, bias_rate=rate)
            torch.manual_seed(0)
            model = ds.build_moe_gpt(a, device=d.device)
            layers = ds.moe_layers(model)
            for layer in layers:
                layer.w_gate.data.mul_(50.0)
            opt = make_optimizer(model.parameters(), a)
            vio, lms = [], []
            for step in range(a.steps):
                x, y = (t.to(d.device) for t in data.batch(step, a.batch_size, a.seq_len))
                lm = lm_loss(model(x), y, count_tokens(y))
                opt.zero_grad()
                lm.backward()
                opt.step()
                ds.update_biases(layers, a.bias_rate, None)
                load = torch.stack([m.wanted for m in layers]).double()
                vio.append((load.amax(-1) / load.mean(-1) - 1).mean().item())
                lms.append(lm.item())
            vios[rate], lms_of[rate] = vio, lms
        lms = lms_of[0.0]
        out = torch.tensor(
            [lms[0], sum(lms[-5:]) / 5, *vios[0.0], *vios[0.01]],
            dtype=torch.float64,
            device=d.device,
        )
    dist.all_reduce(out)  # each number comes from one rank, the others add zeros
    first, last, without, with_bias = *out[:2].tolist(), out[2:32].tolist(), out[32:].tolist()
    cv0, cv1 = sum(without[-10:]) / 10, sum(with_bias[-10:]) / 10
    check(
        d,
        "balance: bias rate 0.01 lowers MaxVio vs rate 0 (mean of the last 10 of 30 steps, and the last step)",
        cv1 < 0.8 * cv0 and with_bias[-1] < without[-1],
        f"MaxVio {cv0:.3f} -> {cv1:.3f}",
    )
    d.log("      MaxVio per step, bias rate 0:    " + " ".join(f"{v:.2f}" for v in without))
    d.log("      MaxVio per step, bias rate 0.01: " + " ".join(f"{v:.2f}" for v in with_bias))
    gap0, gap1 = first - data.entropy, last - data.entropy
    check(
        d,
        f"training lowers the LM loss toward the floor {data.entropy:.3f}",
        gap1 < 0.4 * gap0,
        f"{first:.3f} -> {last:.3f} (gap {gap0:.3f} -> {gap1:.3f})",
    )


def resume_bias(d, data):
    """Rank 0 alone: a model whose state_dict (the bias in it) is saved after 2 of 4 steps and loaded into a
    freshly built model goes on bit for bit as the uninterrupted one: losses, parameters and bias."""
    ok, detail = True, ""
    if d.rank == 0:
        args = tiny(steps=4)

        def steps(model, opt, lo, hi):
            losses = []
            for step in range(lo, hi):
                x, y = (t.to(d.device) for t in data.batch(step, args.batch_size, args.seq_len))
                loss = lm_loss(model(x), y, count_tokens(y))
                opt.zero_grad()
                loss.backward()
                opt.step()
                ds.update_biases(ds.moe_layers(model), args.bias_rate, None)
                losses.append(loss.item())
            return losses

        def fresh():
            model = ds.build_moe_gpt(args, device=d.device)
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
        ok = (
            first + rest == whole
            and a.keys() == b.keys()
            and all(torch.equal(a[k], b[k]) for k in a)
            and any(k.endswith("expert_bias") and a[k].abs().max() > 0 for k in a)
        )
        detail = (
            f"bias {[round(v, 3) for k in a if k.endswith('expert_bias') for v in a[k].tolist()]}"
        )
    check(
        d,
        "loss-free: the bias is in the state_dict; saved after 2 steps and loaded, it resumes bit for bit",
        ok,
        detail,
    )


def bad_input(d, lay):
    """5 of the docstring: each bad input refused before any collective, at EP 2."""
    core, mutant = sections("moe_deepseek.py")  # the mutant: every check a no-op
    g, axes = lay.ep_group, {"ep": lay.ep_group}

    def layer(ns, experts=4, **kw):
        return ns["DeepSeekMoE"](
            6, experts, ep_group=g, generator=torch.Generator().manual_seed(0), **kw
        ).to(d.device)

    builds = {
        "3 experts at EP 2": (
            dict(experts=3),
            ["experts = 3 is not divisible by ep = 2", "try experts = 4"],
        ),
        "top_k 5 of 4 experts": (dict(top_k=5), ["top_k = 5 with 4 experts", "1..4"]),
        "top_k 0": (dict(top_k=0), ["top_k = 0 with 4 experts", "1..4"]),
        "score 'tanh'": (dict(score="tanh"), ["'tanh'", "sigmoid (DeepSeek-V3) or softmax"]),
    }
    check_builds(d, "DeepSeekMoE", builds, layer, core, mutant, axes)
    good = layer(core)
    msg, calls = refusal(
        lambda: good(torch.randn(2, 3, 6, dtype=torch.float64, device=d.device)), axes
    )
    check(
        d,
        "bad input control: a forward goes through, and the counter sees its all-to-alls",
        msg is None and calls.get("all_to_all/ep/fwd") == 2,
        f"{msg}; collectives {calls}",
    )
    A = core["AllToAll"].apply
    rows = torch.randn(4, 2, dtype=torch.float64, device=d.device)
    cases = [
        ("splits summing to 3 of 4 rows", lambda: A(rows, g, [2, 2], [1, 2]), ["summing to 4"]),
        ("3 splits for 2 ranks", lambda: A(rows, g, [2, 1, 1], [2, 1, 1]), ["2 in and 2 out"]),
    ]
    fitting = lambda: A(rows, g, [2, 2], [2, 2])  # noqa: E731
    check_all_to_all(d, cases, fitting, "an AllToAll of 4 rows in splits of 2", axes)


def main():
    d, data, layouts = start("tests/moe_deepseek_checks.py", ds.make_layout)
    parity(d, data, layouts)
    dropless(d, layouts)
    balance(d)
    resume_bias(d, data)
    # the copy-out check is written in the test module
    finish(d, layouts, "test_moe_deepseek", bad_input)


if __name__ == "__main__":
    main()
