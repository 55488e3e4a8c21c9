"""Checks of diloco.py inside one process group (launched once by tests/test_diloco.py, at world 3):

    torchrun --standalone --nproc_per_node=3 tests/diloco_checks.py

The cores (parts 1, 1b, 5) come from diloco.py's technique section alone (tests/section.py: what a copier
takes, run with torch and nothing of this repo); parts 2-4 run diloco.py's main.
1. copy-out: DiLoCo on a model that is not the GPT (nested modules, a root parameter, odd sizes, a
   Huber loss), each rank a worker with plain SGD inside, H = 1: outer SGD lr 1 == plain one-process SGD on
   the whole batch; outer Nesterov (lr a, momentum mu) == one-process Nesterov SGD with lr a x the inner lr
   (both written here with torch.optim.SGD); negative: H = 2 differs.
1b. copy-out: StreamingDiLoCo on that model (2 fragments, H 4, overlap 1, mix 0.5, bfloat16 on the wire, AdamW
   inside, Nesterov outside) == the M workers simulated in one process here (their own AdamW, the fragment
   schedule, the rounding, the rank-order sum, torch's Nesterov rule written out); negative: against the same
   simulation without the rounding it differs.
2. diloco.py's main (run here as torchrun runs it), --check against its own reference: DiLoCo (AdamW inside,
   Nesterov outside) and Streaming DiLoCo (2 fragments, overlap 1, mix 0.5, bfloat16 on the wire) pass; the
   bytes handed to collectives per inner step, counted at the dispatcher, are P x b / H exactly (closed
   form from the parameter count here), and the largest single exchange (measured) is the largest fragment's;
   negative: a reference that skips the wire's rounding FAILS the streaming run's --check.
3. The equivalence that needs no reference of its own: inner SGD, H = 1, outer SGD lr 1 == synchronous data
   parallel SGD, a one-process full-batch SGD trainer written here (plugged in as --check's reference);
   negative: H = 2 FAILS that check.
4. Mutants, each FAILS --check: the outer step applied to the workers' weights instead of the global ones
   (DiLoCo, H 3); fragment 1 synced one inner step late (Streaming DiLoCo).
5. bad input: each core refuses what it cannot do with a ValueError naming what would work, before any
   collective (harness.CommCounter saw none): DiLoCo with H < 1, outer lr <= 0, Nesterov momentum 0 or 1;
   StreamingDiLoCo without fragments, with an empty or a shared one, an integer wire dtype, H not a multiple
   of F, overlap >= H, mix 1; gpt_fragments asked for more fragments than blocks, or none. Negatives: a
   valid sync under the same counter all-reduces; the section with its checks taken out lets them through.
1c. a fresh start from other seeds: every worker holds rank 0's weights after the first inner step's sync;
   negative: without the broadcast they differ.
1d. a resume in either order: DiLoCo and StreamingDiLoCo cut after inner step 5 (an exchange in flight) and
   continued by fresh objects from their state dicts, the model loaded before or after the wrapper is
   built, at worlds 2 (ranks 0, 1) and 3: bit for bit the uninterrupted run; negative: with the start sync
   back in the constructor, the model-first order ends elsewhere.
6. the overlap, slowed on purpose (InOrder): TAU inner steps between each exchange's launch and its wait.
7. the exposed time where NCCL makes it: exchanges whose wait() returns at once and whose work completes
   50 ms later are reported >= 50 ms exposed; the host's time in wait() (the rule before) is caught.
A failed check is recorded and the script goes on; it prints ALL CHECKS PASSED or exits 1 at the end.
"""

import copy
import functools
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn.functional as F

import diloco
import harness
import section
from common import GPT, GPTConfig, MarkovData, build_gpt, count_tokens, init_dist, lm_loss
from dp_common import Checks, SmallNet, check_refused, check_unchecked_lets_through, net_batch

# the technique section alone, as a copier takes it
core = types.SimpleNamespace(**section.load("diloco.py"))

d = init_dist(60)
F64, B, STEPS = torch.float64, 12, 5
check = Checks(d)  # check(ok, what); check.finish() at the end


# ----------------------------------------------------------------------------- 1. copy-out on another model
Net = functools.partial(SmallNet, 5, d.device)  # nested modules, a root parameter, odd sizes
# batch(step): (B, 7), (B, 3)
batch = functools.partial(net_batch, rows=B, seed=100, device=d.device)


def huber(m, x, y):  # the mean over the rows given
    return F.huber_loss(m(x), y, reduction="sum", delta=0.5) / x.shape[0]


def flat(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def plain_sgd(lr, momentum=0.0):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, nesterov=momentum > 0)
    for step in range(STEPS):
        opt.zero_grad()
        huber(model, *batch(step)).backward()
        opt.step()
    return flat(model)


def train_workers(model, inner, outer, steps):
    """This worker's inner steps on its rows of each batch, the outer step's after each: the final theta."""
    for step in range(steps):
        x, y = batch(step)
        outer.before_inner_step()
        inner.zero_grad()
        huber(
            model, x[d.rank * rows : (d.rank + 1) * rows], y[d.rank * rows : (d.rank + 1) * rows]
        ).backward()
        inner.step()
        outer.after_inner_step(step)
    outer.finish()
    return torch.cat([g.flatten() for g in outer.global_params()])


rows, LR = B // d.world, 0.1
for H, outer_lr, mu, what in (
    (1, 1.0, 0.0, "outer SGD lr 1 == plain SGD"),
    (1, 0.7, 0.9, "outer Nesterov 0.7/0.9 == one-process Nesterov SGD, lr 0.07"),
    (2, 1.0, 0.0, "negative: H = 2 differs from plain SGD"),
):
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    outer = core.DiLoCo(model.parameters(), H, outer_lr, mu, nesterov=mu > 0)
    theta = train_workers(model, inner, outer, STEPS)
    diff = (theta - plain_sgd(LR * outer_lr, mu)).abs().max().item()
    if H == 1:
        check(
            diff <= 1e-12 and (flat(model) - theta).abs().max().item() == 0,
            f"copy-out DiLoCo, {d.world} workers, Huber loss, a root parameter, inner SGD, H 1: {what} "
            f"(params {diff:.1e}); the workers restart from theta",
        )
    else:
        check(diff > 1e-6, f"copy-out DiLoCo: {what} ({diff:.1e})")


# ------------------------------------------------------------------------- 1c. every worker starts from theta
def starts_agree(c):
    """Workers whose weights differ (rank r adds r to each) wrap them in c.DiLoCo: do all hold rank 0's?"""
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.add_(d.rank)
    c.DiLoCo(net.parameters(), 2).before_inner_step()  # a fresh run's first step
    every = torch.empty(d.world * flat(net).numel(), dtype=F64, device=d.device)
    dist.all_gather_single(every, flat(net), group=dist.group.WORLD)
    return all(torch.equal(w, flat(Net())) for w in every.view(d.world, -1))


check(
    starts_agree(core),
    f"copy-out DiLoCo: {d.world} workers built with different weights all start from "
    f"rank 0's (broadcast at the first inner step)",
)
no_broadcast = types.SimpleNamespace(
    **section.load(
        "diloco.py",
        (section.ROOT / "diloco.py")
        .read_text()
        .replace("dist.broadcast(p, group_src=0, group=self.group)", "pass"),
    )
)
check(
    not starts_agree(no_broadcast),
    "copy-out DiLoCo: negative: without the broadcast the workers' starts differ",
)


def started(outer):
    outer.before_inner_step()
    return outer


# ----------------------------------------------------------------------------- 1b. copy-out: Streaming DiLoCo
def fragments_of(net):  # fragment 0: the encoder; fragment 1: the root gain and the head
    return [list(net.enc.parameters()), [net.gain, *net.head.parameters()]]


def adamw(net):
    return torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


SH, TAU, MIX, OLR, MU, WIRE, SSTEPS = (
    4,
    1,
    0.5,
    0.7,
    0.9,
    torch.bfloat16,
    8,
)  # fragment 1's last: drained


def streaming_by_hand(rounding=True):
    """The M workers in one process: own AdamW on own rows; fragment f's exchange after inner step t with
    t + 1 = (f + 1) H / F (mod H), each worker's theta - theta_m rounded to the wire dtype and back, summed in
    rank order, / M; it lands TAU steps later: torch's Nesterov rule (buf = g, then mu buf + g; theta -= lr
    (g + mu buf)), then each worker's fragment = mix * its own + (1 - mix) * theta. Returns (theta, workers)."""
    workers = [Net() for _ in range(d.world)]
    opts = [adamw(w) for w in workers]
    frags = [fragments_of(w) for w in workers]  # frags[m][f]: worker m's parameters of fragment f
    theta = [[p.detach().clone() for p in f] for f in frags[0]]
    buf, in_flight = {}, []
    for t in range(SSTEPS):
        x, y = batch(t)
        for m, (w, opt) in enumerate(zip(workers, opts)):
            opt.zero_grad()
            huber(w, x[m * rows : (m + 1) * rows], y[m * rows : (m + 1) * rows]).backward()
            opt.step()
        for f in range(2):
            if (t + 1) % SH == (f + 1) * SH // 2 % SH:
                mean = []
                for k, th in enumerate(theta[f]):
                    deltas = [th - frags[m][f][k].detach() for m in range(d.world)]
                    deltas = [dm.to(WIRE).to(F64) if rounding else dm for dm in deltas]
                    total = deltas[0]
                    for dm in deltas[1:]:
                        total = total + dm
                    mean.append(total / d.world)
                in_flight.append((t + TAU, f, mean))
        while in_flight and (in_flight[0][0] <= t or t == SSTEPS - 1):
            _, f, mean = in_flight.pop(0)
            with torch.no_grad():
                for k, g in enumerate(mean):
                    buf[f, k] = g.clone() if (f, k) not in buf else MU * buf[f, k] + g
                    theta[f][k] = theta[f][k] - OLR * (g + MU * buf[f, k])
                    for m in range(d.world):
                        frags[m][f][k].copy_(MIX * frags[m][f][k] + (1 - MIX) * theta[f][k])
    return torch.cat([g.flatten() for f in theta for g in f]), [flat(w) for w in workers]


model = Net()
inner = adamw(model)
stream = core.StreamingDiLoCo(fragments_of(model), SH, OLR, MU, True, TAU, MIX, WIRE)
theta = train_workers(model, inner, stream, SSTEPS)
for rounding in (True, False):
    ref_theta, ref_workers = streaming_by_hand(rounding)
    diff = max(
        (theta - ref_theta).abs().max().item(),
        (flat(model) - ref_workers[d.rank]).abs().max().item(),
    )
    if rounding:
        check(
            diff <= 1e-12,
            f"copy-out StreamingDiLoCo, {d.world} workers, 2 fragments, H {SH}, overlap {TAU}, "
            f"mix {MIX}, bfloat16 wire, AdamW in, Nesterov out, Huber loss: theta and this worker == the "
            f"workers simulated by hand ({diff:.1e})",
        )
    else:
        check(
            diff > 1e-6,
            f"copy-out StreamingDiLoCo: negative: the simulation without the wire's rounding "
            f"differs ({diff:.1e})",
        )


# ------------------------------------------------------------------ 1d. a resume, in either order of loading
def resumed(c, kind, group, order, stop=None):
    """Streaming DiLoCo (2 fragments, H 4, overlap 1, mix 0.5, bfloat16 wire) or DiLoCo (H 4) on the net,
    over `group`, SSTEPS inner steps. With `stop`, the run is cut after inner step stop - 1 (its state
    dicts kept, as a checkpoint keeps them) and continued by fresh objects, loaded in `order`: "model
    first" loads the model and the inner optimizer, then builds the wrapper and loads its state (torch's
    usual recipe); "wrapper first" builds it before. Returns (theta, this worker's weights), flat."""
    M = dist.get_world_size(group)
    me = dist.get_rank(group)
    part = B // M

    def build(net):
        if kind == "DiLoCo":
            return c.DiLoCo(net.parameters(), SH, OLR, MU, group=group)
        return c.StreamingDiLoCo(fragments_of(net), SH, OLR, MU, True, TAU, MIX, WIRE, group)

    def train(net, opt, outer, steps):
        for t in steps:
            x, y = batch(t)
            outer.before_inner_step()
            opt.zero_grad()
            huber(net, x[me * part : (me + 1) * part], y[me * part : (me + 1) * part]).backward()
            opt.step()
            outer.after_inner_step(t)

    net = Net()
    opt = adamw(net)
    outer = build(net)
    train(net, opt, outer, range(stop or SSTEPS))
    if stop:
        saved = copy.deepcopy(
            dict(model=net.state_dict(), inner=opt.state_dict(), outer=outer.state_dict())
        )
        net = Net()  # a new process: fresh objects, the saved state
        opt = adamw(net)
        if order == "wrapper first":
            outer = build(net)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["inner"])
        if order == "model first":
            outer = build(net)
        outer.load_state_dict(saved["outer"])
        train(net, opt, outer, range(stop, SSTEPS))
    outer.finish()
    return torch.cat([g.flatten() for g in outer.global_params()]), flat(net)


def check_resumes(c, label="", expect=True):
    """Cut after inner step 5 (Streaming: fragment 0's exchange in flight, every worker mid-round), at
    worlds 2 (ranks 0, 1) and 3: both orders end where the uninterrupted run ends, bit for bit."""
    worst = []
    for M, group in ((2, pair), (3, dist.group.WORLD)):
        for kind in ("StreamingDiLoCo", "DiLoCo"):
            for order in ("model first", "wrapper first"):
                if d.rank >= M:
                    continue
                full = resumed(c, kind, group, order)
                cut = resumed(c, kind, group, order, stop=6)
                diff = max((a - b).abs().max().item() for a, b in zip(full, cut))
                worst.append((diff, f"{kind} world {M} {order}"))
                if expect:
                    check(
                        diff == 0,
                        f"{label}resume: {kind}, world {M}, cut after step 5 "
                        f"{'with an exchange in flight' if kind != 'DiLoCo' else 'mid-round'}, "
                        f"{order}: theta and the worker == the uninterrupted run ({diff:.1e})",
                    )
    return worst


pair = dist.new_group([0, 1])
check_resumes(core)
worst = check_resumes(
    types.SimpleNamespace(
        **section.load(
            "diloco.py",
            (section.ROOT / "diloco.py")
            .read_text()
            .replace(
                "        self.started = False\n",
                "        self.started = False\n        self.start()\n",
            ),
        )
    ),
    expect=False,
)
if d.rank < 2:
    caught = [what for diff, what in worst if diff > 1e-6]
    check(
        "StreamingDiLoCo world 2 model first" in caught and "DiLoCo world 2 model first" in caught,
        f"resume: negative: with the start sync in the constructor (as before), the model-first order "
        f"ends away from the uninterrupted run: {', '.join(caught)} "
        f"(max {max(diff for diff, _ in worst):.1e})",
    )


# ----------------------------------------------------------------------------- 2-4: diloco.py's main, patched
summaries = []
write_summary = harness.write_summary
harness.write_summary = lambda *a, **k: summaries.append(write_summary(*a, **k)) or summaries[-1]
harness.close_dist = lambda ok=True: None  # main() returns instead of ending the process
diloco.init_dist = lambda timeout=120: d
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
    "6",
    "--dtype",
    "float64",
]
CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
P = sum(p.numel() for p in GPT(CFG).parameters())
gpt = GPT(CFG)
frag_sizes = [
    sum(p.numel() for p in f)
    for f in (
        [gpt.tok_emb.weight, gpt.pos_emb.weight, *gpt.blocks[0].parameters()],
        [*gpt.blocks[1].parameters(), *gpt.ln_f.parameters(), gpt.head.weight],
    )
]


def run_main(*flags):
    """diloco.py's main on these flags: its --json summary (every rank gets one)."""
    sys.argv = ["diloco.py", *TINY, *flags]
    diloco.main()
    return summaries[-1]


def passed(s):
    c = s["check"]
    return c["passed"] and c["max_loss_diff"] <= 1e-9 and c["max_param_diff"] <= 1e-9


s = run_main("--inner-steps", "3", "--check")
f = s["figures"]
only_all_reduce = list(f["comm_table"]) == ["all_reduce/exchange/fwd"]  # on its own group
check(
    passed(s) and f["bytes_per_inner_step"] == P * 8 / 3 and only_all_reduce,
    f"diloco.py --inner-steps 3 --check (AdamW in, Nesterov out): PASSED "
    f"({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e}); "
    f"{f['bytes_per_inner_step']:.1f} B all-reduced per inner "
    f"step (measured) == P x 8 / H = {P * 8 / 3:.1f}",
)
STREAM = [
    "--inner-steps",
    "4",
    "--fragments",
    "2",
    "--overlap",
    "1",
    "--mix",
    "0.5",
    "--outer-dtype",
    "bfloat16",
    "--steps",
    "9",
]
s = run_main(*STREAM, "--check")
f = s["figures"]
check(
    passed(s)
    and f["bytes_per_inner_step"] == P * 2 / 4
    and f["bytes_per_sync_max"] == max(frag_sizes) * 2
    and list(f["comm_table"]) == ["all_gather/exchange/fwd"],
    f"diloco.py streaming (F 2, overlap 1, mix 0.5, bfloat16 wire) --check: PASSED "
    f"({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e}); "
    f"{f['bytes_per_inner_step']:.1f} B all-gathered per inner step (measured) == P x 2 / H = "
    f"{P * 2 / 4:.1f}; "
    f"one exchange hands over at most {f['bytes_per_sync_max']} B (measured) == the largest fragment x 2 = "
    f"{max(frag_sizes) * 2}",
)

real_rounded = diloco.rounded
# negative: a reference that does not round as the wire does
diloco.rounded = lambda delta, wire: delta
s = run_main(*STREAM, "--check")
diloco.rounded = real_rounded
check(
    not s["check"]["passed"] and s["check"]["max_param_diff"] > 1e-6,
    f"negative: against a reference that skips the bfloat16 rounding, --check FAILS (params "
    f"{s['check']['max_param_diff']:.1e}): the exactness is the rounding's, not a loose tolerance's",
)


def sgd_trainer(args, M, device="cpu"):
    """Synchronous data parallel SGD as one process: the whole global batch, torch's SGD, no clipping. Keys
    as diloco's reference names them (theta and every worker: all the same weights)."""
    data, model = MarkovData(args.vocab, args.seed), build_gpt(CFG, args.seed, F64, device)
    opt, losses = torch.optim.SGD(model.parameters(), lr=args.lr), []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len))
        loss = lm_loss(model(x), y, count_tokens(y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    params = {f"global.{n}": p.detach().clone() for n, p in model.named_parameters()}
    params.update({f"worker{m}": flat(model) for m in range(M)})
    return dict(losses=losses, params=params)


real_reference = diloco.reference
diloco.reference = sgd_trainer
EQUIV = [
    "--inner",
    "sgd",
    "--outer",
    "sgd",
    "--outer-lr",
    "1",
    "--clip",
    "0",
    "--lr",
    "0.5",
    "--check",
]
s = run_main("--inner-steps", "1", *EQUIV)
check(
    passed(s),
    f"inner SGD, H 1, outer SGD lr 1 == synchronous data parallel SGD (one-process trainer "
    f"written here): PASSED ({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e})",
)
s = run_main("--inner-steps", "2", *EQUIV)
check(
    not s["check"]["passed"] and s["check"]["max_param_diff"] > 1e-6,
    f"negative: H 2 against synchronous SGD FAILS (params {s['check']['max_param_diff']:.1e})",
)
diloco.reference = real_reference

real_outer = diloco.DiLoCo.outer_step


def outer_on_workers(self, f, mean):
    """The bug: the outer step starts from the worker's own weights instead of the global ones."""
    with torch.no_grad():
        for g, p in zip(self.glob[f], self.local[f]):
            g.copy_(p)
    real_outer(self, f, mean)


def fragment_1_late(self, t):
    """The bug: fragment 1 synced one inner step after its turn."""
    return [f for f, off in enumerate(self.offsets) if (t + 1 - (f == 1)) % self.H == off]


for name, cls, attr, mutant, flags in (
    (
        "the outer step applied to the workers' weights",
        diloco.DiLoCo,
        "outer_step",
        outer_on_workers,
        ["--inner-steps", "3"],
    ),
    (
        "fragment 1 synced one step late",
        diloco.StreamingDiLoCo,
        "syncs_after",
        fragment_1_late,
        STREAM,
    ),
):
    real = getattr(cls, attr)
    setattr(cls, attr, mutant)
    s = run_main(*flags, "--check")
    setattr(cls, attr, real)
    c = s["check"]
    check(
        not c["passed"] and max(c["max_loss_diff"], c["max_param_diff"]) > 1e-6,
        f"mutant: {name}: FAILS --check (losses {c['max_loss_diff']:.1e}, "
        f"params {c['max_param_diff']:.1e})",
    )


# ------------------------------------------------------------------------- 6. the overlap, slowed on purpose
class InOrder:
    """NCCL's semantics stood in for on gloo: an asynchronous collective (the exchange) is slowed by `delay`
    s, a slow network, and holds its group's communicator until it is waited for; a blocking collective
    issued on that group meanwhile would queue behind it on NCCL's one stream per communicator: it is
    recorded as a stall and made to wait. `events` is the order of what happened, which load cannot move:
    ("inner", k) as inner step k starts, ("launch", n), ("wait", n) for exchange n, ("stall", op)."""

    def __init__(self, delay):
        self.delay, self.events, self.busy, self.steps = (
            delay,
            [],
            {},
            0,
        )  # busy: id(group) -> [done times]
        self.real = {name: getattr(dist, name) for name in ("all_reduce", "all_gather_single")}
        self.inner = diloco.inner_step

    def __enter__(self):
        for name, fn in self.real.items():
            setattr(dist, name, self.wrap(name, fn))
        diloco.inner_step = self.step
        return self

    def __exit__(self, *exc):
        for name, fn in self.real.items():
            setattr(dist, name, fn)
        diloco.inner_step = self.inner

    def step(self, *a):
        self.events.append(("inner", self.steps))
        self.steps += 1
        return self.inner(*a)

    def wrap(self, name, fn):
        def call(*a, group=None, async_op=False, **k):
            key = id(group if group is not None else dist.group.WORLD)
            if not async_op:
                if self.busy.get(key):
                    self.events.append(("stall", name))
                    time.sleep(max(0.0, max(self.busy[key]) - time.perf_counter()))
                return fn(*a, group=group, **k)
            n, done = sum(e[0] == "launch" for e in self.events), time.perf_counter() + self.delay
            self.events.append(("launch", n))
            self.busy.setdefault(key, []).append(done)
            return Slowed(self, n, fn(*a, group=group, async_op=True, **k), done, key)

        return call


class Slowed:
    """The exchange's work: complete `delay` s after its launch (and once the real collective is)."""

    def __init__(self, stream, n, work, done, key):
        self.stream, self.n, self.work, self.done, self.key = stream, n, work, done, key

    def is_completed(self):
        return self.work.is_completed() and time.perf_counter() >= self.done

    def wait(self):
        self.stream.events.append(("wait", self.n))
        self.work.wait()
        time.sleep(max(0.0, self.done - time.perf_counter()))
        self.stream.busy[self.key].remove(self.done)
        return True


def steps_in_flight(events):
    """For each exchange: the inner steps that started between its launch and its wait."""
    at = {
        ("launch", e[1]) if e[0] == "launch" else ("wait", e[1]): i
        for i, e in enumerate(events)
        if e[0] in ("launch", "wait")
    }
    return [
        sum(e[0] == "inner" for e in events[at["launch", n] : at["wait", n]])
        for n in range(sum(e[0] == "launch" for e in events))
    ]


OVERLAP = [
    "--inner-steps",
    "4",
    "--fragments",
    "2",
    "--overlap",
    "2",
    "--outer-dtype",
    "bfloat16",
    "--steps",
    "8",
    "--check",
]
with InOrder(0.3) as slow:
    s = run_main(*OVERLAP)
f, flying = s["figures"], steps_in_flight(slow.events)
stalls = [e for e in slow.events if e[0] == "stall"]
# exchanges after steps 1, 3, 5 land TAU = 2 steps later; the one after step 7 is drained by finish()
check(
    passed(s) and flying == [2, 2, 2, 0] and not stalls and len(f["exchange_ms"]) == 4,
    f"overlap 2, each exchange slowed to 300 ms: the inner steps between launch and landing per exchange "
    f"{flying} (TAU, the last drained at the end), no collective queued behind an exchange "
    f"({len(stalls)}); "
    f"--check PASSED; exposed {f['exposed_ms_per_step']:.1f} ms per inner step, per exchange "
    f"{[round(x) for x in f['exchange_exposed_ms']]} ms of its own "
    f"{[round(x) for x in f['exchange_ms']]} ms "
    f"(measured); median step {f['step_ms_in_flight']:.1f} ms in flight, {f['step_ms_other']:.1f} ms "
    f"otherwise (reported, not asserted)",
)
real_send = diloco.StreamingDiLoCo.send


def send_and_wait(self, f, lands):
    """The bug: the exchange is waited for where it is launched."""
    ex = real_send(self, f, lands)
    self.wait(ex)
    return ex


real_new_group = dist.new_group
for what, cls, attr, mutant in (
    ("waits for the exchange at launch", diloco.StreamingDiLoCo, "send", send_and_wait),
    (
        "the exchange on WORLD, with the loss's all-reduce",
        dist,
        "new_group",
        lambda *a, **k: dist.group.WORLD,
    ),
):
    real = getattr(cls, attr)
    setattr(cls, attr, mutant)
    with InOrder(0.3) as slow:
        s = run_main(*OVERLAP)
    setattr(cls, attr, real)
    flying, stalls = steps_in_flight(slow.events), [e for e in slow.events if e[0] == "stall"]
    check(
        flying != [2, 2, 2, 0] or stalls,
        f"mutant: {what}: caught (inner steps in flight {flying}, "
        f"{len(stalls)} collective(s) queued behind an exchange)",
    )


# ------------------------------------------------------------- 7. exposed time where NCCL makes it (N4-4)
class Late:
    """A Work that behaves as NCCL's: wait() returns at once (on NCCL it only makes the compute stream
    wait), and is_completed() turns True 50 ms after that wait began. (The real gloo work under it was
    waited for at launch, so no wait here depends on how busy the machine is.)"""

    def __init__(self):
        self.waited = None

    def wait(self):
        self.waited = time.perf_counter()
        return True

    def is_completed(self):
        return self.waited is not None and time.perf_counter() >= self.waited + 0.05


def exposed_with_late_work(exposed_ms=None):
    """StreamingDiLoCo (2 fragments, H 2, overlap 0: each exchange lands right after its launch) whose
    exchanges complete 50 ms after their wait, watched by diloco.ExchangeWatch: its figures."""
    net = Net()
    stream = diloco.StreamingDiLoCo(fragments_of(net), 2, OLR, MU, True, 0, 0.0, None)
    real = stream.send

    def send(f, lands):
        ex = real(f, lands)
        ex.work.wait()
        ex.work = Late()
        return ex

    stream.send = send
    watch = diloco.ExchangeWatch(stream)
    if exposed_ms is not None:
        watch.exposed_ms = types.MethodType(exposed_ms, watch)
    train_workers(net, adamw(net), stream, 4)
    return watch.figures(d, 0, [1.0] * 4)


f = exposed_with_late_work()
check(
    len(f["exchange_exposed_ms"]) == 4 and min(f["exchange_exposed_ms"]) >= 50,
    f"exposed time: exchanges whose work completes 50 ms after a wait() that returns at once (NCCL's): "
    f"exposed {[round(x, 1) for x in f['exchange_exposed_ms']]} ms (>= 50), the host in wait() "
    f"{[round(x, 2) for x in f['exchange_host_wait_ms']]} ms",
)
f = exposed_with_late_work(lambda self, row: 1e3 * (row[4] - row[3]))
check(
    min(f["exchange_exposed_ms"]) < 50,
    f"exposed time: negative: the host's time in wait() as the figure (the rule before) reports "
    f"{[round(x, 2) for x in f['exchange_exposed_ms']]} ms: caught",
)

# ----------------------------------------------------------------------------- 5. the cores refuse bad input
refused = section.refused  # (call, words) -> (refused before any collective, what happened)


def bad_calls(c):
    """name -> (call, words), each on a fresh model."""
    ps, fr = lambda: Net().parameters(), lambda: fragments_of(Net())
    return {
        "DiLoCo, H 0": (lambda: c.DiLoCo(ps(), 0), ["inner_steps must be >= 1", "got 0"]),
        "DiLoCo, outer lr 0": (
            lambda: c.DiLoCo(ps(), 2, outer_lr=0.0),
            ["outer_lr > 0", "not 0.0"],
        ),
        "DiLoCo, Nesterov momentum 1": (
            lambda: c.DiLoCo(ps(), 2, outer_momentum=1.0),
            ["0 < outer_momentum < 1"],
        ),
        "DiLoCo, Nesterov momentum 0": (
            lambda: c.DiLoCo(ps(), 2, outer_momentum=0.0),
            ["0 < outer_momentum < 1"],
        ),
        "StreamingDiLoCo, no fragments": (
            lambda: c.StreamingDiLoCo([], 2),
            ["at least one fragment"],
        ),
        "StreamingDiLoCo, an empty fragment": (
            lambda: c.StreamingDiLoCo([fr()[0], []], 2),
            ["a parameter in each"],
        ),
        "StreamingDiLoCo, a shared parameter": (
            lambda: c.StreamingDiLoCo([(f := fr()[0]), f[:1]], 2),
            ["in two fragments"],
        ),
        "StreamingDiLoCo, int8 wire": (
            lambda: c.StreamingDiLoCo(fr(), 2, wire_dtype=torch.int8),
            ["float dtype"],
        ),
        "StreamingDiLoCo, H 3, F 2": (
            lambda: c.StreamingDiLoCo(fr(), 3),
            ["inner_steps % fragments", "3 % 2"],
        ),
        "StreamingDiLoCo, overlap 4 = H": (
            lambda: c.StreamingDiLoCo(fr(), 4, overlap=4),
            ["(got 4)"],
        ),
        "StreamingDiLoCo, mix 1": (
            lambda: c.StreamingDiLoCo(fr(), 4, mix=1.0),
            ["0 <= mix < 1 (got 1.0)"],
        ),
        "gpt_fragments, 3 of 2 blocks": (
            lambda: c.gpt_fragments(GPT(CFG), 3),
            ["3 fragments of 2 blocks"],
        ),
        "gpt_fragments, 0": (lambda: c.gpt_fragments(GPT(CFG), 0), ["0 fragments of 2 blocks"]),
    }


check_refused(check, bad_calls, core)
ok, seen = refused(lambda: started(core.DiLoCo(Net().parameters(), 1)).after_inner_step(0), [])
check(
    seen.startswith("no error") and "'all_reduce/" in seen,
    f"bad input: negative: a valid DiLoCo's sync under the same counter all-reduces ({seen})",
)
check_unchecked_lets_through(check, "diloco.py", bad_calls, core)

check.finish()
