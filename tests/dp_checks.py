"""Checks of dp.py inside one process group (launched once by tests/test_dp.py, at world 3):

    torchrun --standalone --nproc_per_node=3 tests/dp_checks.py

The cores (parts 1, 2, 5) come from dp.py's technique section alone (tests/section.py: what a copier takes,
run with torch and nothing of this repo); parts 3 and 4 run dp.py's main.
1. copy-out, bulk synchronous: sync_step on a model that is not the GPT (nested modules, a parameter on
   the root module, odd sizes, a Huber loss, two micro-batches per rank) equals plain one-process training
   written here; negative: the same step whose all-reduce only reaches this rank differs.
2. copy-out, parameter server: Server + worker_loop on that model. BoundedStaleness(0) equals plain
   one-process training (one gradient in flight: every batch computed on the newest weights); Lockstep(1)
   equals the one-step-delayed update written here; negative: Lockstep(1) differs from plain training.
3. dp.py's own --check (main() run here, as torchrun runs it): --accum 2 --ragged passes, one all-reduce per
   tensor; the per-micro-batch mean (a wrong sync_step, monkeypatched from here) FAILS it on ragged data
   and passes without padding, where every micro-batch has the same token count.
4. dp.py --mode async: the sent weight copies alive on the server stay at one per pull in flight (measured
   from outside, the figure sent_weight_copies_alive_max); a server that keeps every send (monkeypatched)
   is caught by that figure, which then grows with the updates.
5. bad input: each core refuses what it cannot do with a ValueError naming what would work, before any
   collective (harness.CommCounter saw none): sync_step without micro-batches or with a parameter the loss
   does not reach; a staleness bound < 0; a Server without enough workers for its policy (a world of 1);
   worker_loop on a group that is not two ranks. Negatives: a valid call seen by the same counter sends;
   the section with its checks taken out lets the bad input through.
A failed check is recorded and the script goes on; it prints ALL CHECKS PASSED or exits 1 at the end.
"""

import functools
import os
import sys
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dp
import harness
import section
from common import GPT, GPTConfig, count_tokens, init_dist, lm_loss
from dp_common import Checks, SmallNet, check_refused, check_unchecked_lets_through, net_batch

# the technique section alone, as a copier takes it
core = types.SimpleNamespace(**section.load("dp.py"))

d = init_dist(60)
F64, B, STEPS, CLIP = torch.float64, 12, 5, 0.05  # clip low enough that every step clips
check = Checks(d)  # check(ok, what); check.finish() at the end


# ----------------------------------------------------------------------------- a model that is not the GPT
Net = functools.partial(SmallNet, 5, d.device)  # nested modules, a root parameter, odd sizes
# batch(step): (B, 7), (B, 3)
batch = functools.partial(net_batch, rows=B, seed=100, device=d.device)


def huber(m, x, y):  # a sum over the rows given, divided by the rows of the whole batch
    return F.huber_loss(m(x), y, reduction="sum", delta=0.5) / B


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def plain_training(batch_of_update, weights_of_update):
    """One process: update t steps on the gradient of batch batch_of_update(t), computed on the weights of
    version weights_of_update(t) (t: plain training); torch's clipping. Returns (losses, final parameters)."""
    model, stale = Net(), Net()
    opt, versions, losses = adamw(model), [[p.detach().clone() for p in model.parameters()]], []
    for t in range(STEPS):
        with torch.no_grad():
            for q, v in zip(stale.parameters(), versions[weights_of_update(t)]):
                q.copy_(v)
        x, y = batch(batch_of_update(t))
        loss = huber(stale, x, y)
        for p, g in zip(model.parameters(), torch.autograd.grad(loss, list(stale.parameters()))):
            p.grad = g
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        versions.append([p.detach().clone() for p in model.parameters()])
        losses.append(loss.item())
    return losses, versions[-1]


def max_diff(params, ref):
    return max((p.detach() - r).abs().max().item() for p, r in zip(params, ref))


def spread(t):
    """Largest difference of `t` between any rank and this one, seen on every rank (0: they agree)."""
    every = [torch.empty_like(t) for _ in range(d.world)]
    dist.all_gather(every, t)
    return max((e - t).abs().max().item() for e in every)


# ----------------------------------------------------------------------------- 1. copy-out: sync_step
ref_losses, ref_params = plain_training(lambda t: t, lambda t: t)
singletons = [
    dist.new_group([r]) for r in range(d.world)
]  # every rank makes every group, in one order
for group, what in ((None, "all ranks"), (singletons[d.rank], "negative: this rank alone")):
    model = Net()
    opt, rows, losses = adamw(model), B // d.world, []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = (
            x[d.rank * rows : (d.rank + 1) * rows],
            y[d.rank * rows : (d.rank + 1) * rows],
        )  # this rank's slice
        loss, norm = core.sync_step(model, opt, zip(x.chunk(2), y.chunk(2)), huber, CLIP, group)
        dist.all_reduce(loss)
        losses.append(loss.item())
    diff = max_diff(model.parameters(), ref_params)
    loss_diff = max(abs(a - b) / b for a, b in zip(losses, ref_losses))
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    if group is None:
        check(
            diff <= 1e-12 and loss_diff <= 1e-12 and spread(flat) == 0.0,
            f"copy-out sync_step, world {d.world} x 2 micro-batches, Huber loss, a root parameter: == "
            f"plain one-process training (params {diff:.1e}, losses {loss_diff:.1e}), replicas identical",
        )
    else:
        check(
            d.world == 1 or diff > 1e-6,
            f"copy-out sync_step, {what}: differs from plain training ({diff:.1e})",
        )

# ---------------------------------------------------------------------------- 2. copy-out: a parameter server
groups = {w: dist.new_group([0, w]) for w in range(1, d.world)}
side = dist.new_group(backend="gloo")  # the reports' group
real_recv, received = dist.recv, []


def logged_recv(tensor, src=None, group=None, **k):
    """The server's receives in order: ("report", from whom) on the side group, ("gradient", w) on w's."""
    who = real_recv(tensor, src=src, group=group, **k)
    received.append(("report" if src is None else "gradient", who if src is None else src))
    return who


def receive_order_errors(log):
    """R3: a gradient's receive posted only after its worker's report arrived, one report per gradient."""
    reported, errors = [], []
    for kind, w in log:
        if kind == "report":
            reported.append(w)
        elif w in reported:
            reported.remove(w)
        else:
            errors.append(f"gradient of {w} received before its report")
    return errors


for name, policy, delay in (
    ("BoundedStaleness(0)", core.BoundedStaleness(0), 0),
    ("Lockstep(1)", core.Lockstep(1), 1),
):
    model = Net()
    if d.rank > 0:
        core.worker_loop(model, lambda m, b: huber(m, *batch(b)), groups[d.rank], side)
        continue
    server = core.Server(model, adamw(model), groups, side, policy, STEPS, CLIP)
    server.hand_out()
    reports, received[:] = [], []
    dist.recv = logged_recv
    for _ in range(STEPS):
        reports.append(server.apply(server.next_to_apply()).tolist())
        server.hand_out()
    dist.recv = real_recv
    server.stop()
    errors = receive_order_errors(received)
    check(
        not errors and sum(k == "gradient" for k, _ in received) == STEPS,
        f"copy-out Server, {name}: each of the {STEPS} gradient receives posted after its worker's report "
        f"({errors}): one live receive at a time",
    )
    check(
        receive_order_errors([("gradient", 1), ("report", 1)]) != [],
        "negative: a gradient received before its report (the old server's receives posted at the pull) "
        "is caught",
    )
    losses, used, ids = ([r[k] for r in reports] for k in range(3))
    # what the rule says
    ref_l, ref_p = plain_training(lambda t: int(ids[t]), lambda t: max(t - delay, 0))
    diff, loss_diff = (
        max_diff(model.parameters(), ref_p),
        max(abs(a - b) / b for a, b in zip(losses, ref_l)),
    )
    rule = used == [max(t - delay, 0) for t in range(STEPS)] and ids == list(range(STEPS))
    check(
        rule and diff <= 1e-12 and loss_diff <= 1e-12,
        f"copy-out Server + worker_loop, {name}: versions used {used}, == "
        f"{'plain one-process training' if delay == 0 else 'the one-step-delayed update'} written here "
        f"(params {diff:.1e}, losses {loss_diff:.1e})",
    )
    if delay:
        far = max_diff(model.parameters(), ref_params)
        check(far > 1e-6, f"copy-out {name}: negative: differs from plain training ({far:.1e})")

# ----------------------------------------------------------------------------- 5. the cores refuse bad input
refused = section.refused  # (call, words) -> (refused before any collective, what happened)


def unused_param_net():
    net = Net()
    # trainable, never in the loss
    net.spare = nn.Parameter(torch.zeros(2, dtype=F64, device=d.device))
    return net


def bad_calls(c):
    """name -> (call, words), each on a fresh model; none communicates before its check."""
    x, y = batch(0)
    return {
        "sync_step, no micro-batches": (
            lambda: c.sync_step(Net(), adamw(Net()), [], huber),
            ["no micro-batches", "at least one (x, y) pair"],
        ),
        "sync_step, a parameter the loss does not reach": (
            lambda: (m := unused_param_net()) and c.sync_step(m, adamw(m), [(x, y)], huber),
            ["no gradient", "freeze it"],
        ),
        "Lockstep(-1)": (lambda: c.Lockstep(-1), ["D must be >= 0", "got -1"]),
        "BoundedStaleness(-1)": (lambda: c.BoundedStaleness(-1), ["S must be >= 0", "got -1"]),
        "Server, no workers (a world of 1)": (
            lambda: c.Server(Net(), adamw(Net()), {}, side, c.BoundedStaleness(0), STEPS),
            ["at least 1 worker(s), got 0", "at least 2 ranks"],
        ),
        f"Server, Lockstep({d.world - 1}) on {d.world - 1} workers": (
            lambda: c.Server(Net(), adamw(Net()), groups, side, c.Lockstep(d.world - 1), STEPS),
            [f"at least {d.world} worker(s), got {d.world - 1}"],
        ),
    }


check_refused(check, bad_calls, core)
for what, group in (("the whole world", None), ("a one-rank group", singletons[d.rank]))[
    d.world == 2 :
]:
    ok, seen = refused(
        lambda: core.worker_loop(Net(), huber, group, side), ["two-rank group", "new_group"]
    )
    check(ok, f"bad input: worker_loop on {what}: refused before any collective ({seen})")
ok, seen = refused(
    lambda: core.sync_step(Net(), adamw(Net()), [batch(0)], huber, group=singletons[d.rank]), []
)
check(
    not ok and seen.startswith("no error") and "'all_reduce/" in seen,
    f"bad input: negative: a valid sync_step under the same counter sends ({seen})",
)
check_unchecked_lets_through(check, "dp.py", bad_calls, core)

# ----------------------------------------------------------------------------- 3 + 4: dp.py's main, patched
summaries = []
write_summary = harness.write_summary
harness.write_summary = lambda *a, **k: summaries.append(write_summary(*a, **k)) or summaries[-1]
# main() returns instead of ending the process
harness.close_dist = dp.close_dist = lambda ok=True: None
dp.init_dist = lambda timeout=120: d
TINY = [
    "--vocab",
    "32",
    "--seq-len",
    "8",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-layers",
    "2",
    "--batch-size",
    "12",
    "--steps",
    "4",
    "--dtype",
    "float64",
]


def run_main(*flags):
    """dp.py's main on these flags; its --json summary (None on an async worker, which writes none)."""
    sys.argv, n = ["dp.py", *TINY, *flags], len(summaries)
    dp.main()
    return summaries[-1] if len(summaries) > n else None


real_step = dp.sync_step


def per_microbatch_mean(model, opt, micro_batches, loss_fn, clip=0.0, group=None):
    """The common bug: each micro-batch's loss a mean over its own tokens, then a plain average over the
    K x N micro-batches (right only when every micro-batch has as many real tokens as every other)."""
    micro_batches = list(micro_batches)
    k = len(micro_batches) * dist.get_world_size(group)
    own_mean = lambda m, x, y: lm_loss(m(x), y, count_tokens(y)) / k  # noqa: E731
    return real_step(model, opt, micro_batches, own_mean, clip, group)


s = run_main("--accum", "2", "--ragged", "--check")
n_tensors = len(
    list(GPT(GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)).parameters())
)
calls = s["figures"]["all_reduces_per_step"]
check(
    s["check"]["passed"] and s["check"]["max_loss_diff"] <= 1e-9 and calls == n_tensors,
    f"dp.py --accum 2 --ragged --check: PASSED ({s['check']['max_loss_diff']:.1e}), "
    f"{calls} all-reduces per step (one per tensor: {n_tensors})",
)
dp.sync_step = per_microbatch_mean
s = run_main("--accum", "2", "--ragged", "--check")
check(
    not s["check"]["passed"] and s["check"]["max_loss_diff"] > 1e-3,
    f"negative: the per-micro-batch mean on ragged data FAILS --check (loss diff "
    f"{s['check']['max_loss_diff']:.1e})",
)
s = run_main("--accum", "2", "--check")
check(
    s["check"]["passed"] and s["check"]["max_loss_diff"] <= 1e-9,
    f"the per-micro-batch mean without padding passes --check ({s['check']['max_loss_diff']:.1e}): "
    f"equal counts",
)
dp.sync_step = real_step

workers, steps = d.world - 1, 8
s = run_main("--mode", "async", "--staleness", "1", "--steps", str(steps), "--check")
f = (s or {}).get("figures", {})
check(
    d.rank > 0 or s["check"]["passed"] and f["sent_weight_copies_alive_max"] == workers,
    f"dp.py --mode async --staleness 1: sent weight copies alive at most "
    f"{f.get('sent_weight_copies_alive_max')} "
    f"(one per pull in flight: {workers}), --check PASSED",
)
kept, real_send = [], dp.Server._send


def keep_every_send(self, w, *tensors):
    real_send(self, w, *tensors)
    # the bug: every send's work (and so its tensor) stays alive to the end
    kept.extend(self.sends[w])


dp.Server._send = keep_every_send
s = run_main("--mode", "async", "--staleness", "1", "--steps", str(steps))
dp.Server._send = real_send
f = (s or {}).get("figures", {})
check(
    d.rank > 0 or f["sent_weight_copies_alive_max"] == steps > workers,
    f"negative: a server that keeps every send is caught: {f.get('sent_weight_copies_alive_max')} weight "
    f"copies alive (one per update: {steps})",
)

check.finish()
