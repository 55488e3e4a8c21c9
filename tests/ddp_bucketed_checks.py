"""Layer-level checks of ddp_bucketed.BucketedDDP, all inside one process group (launched by
tests/test_ddp_bucketed.py at world 2 and 3):

    torchrun --standalone --nproc_per_node=2 tests/ddp_bucketed_checks.py

References: torch's own DistributedDataParallel on the same model and inputs (its gradients, its bucket
layout as its reducer reports it), and the one-process full-batch gradient; part 10 applies BucketedDDP, taken
from ddp_bucketed.py's technique section alone (tests/section.py: what a copier takes, run with torch and
nothing of this repo), to a model that is not the GPT and holds it against plain one-process training
written here (copy-out); part 11 gives that core what it cannot do (each refused before any collective).
Every check has a negative twin (something that must differ, differs). A failed check is recorded and the
script goes on (so every rank keeps issuing the same collectives); it exits 1 at the end.
Prints ALL CHECKS PASSED on success. Device-correct: models and inputs live on the rank's device, so the
same checks run on NCCL (torchrun on a GPU machine) as on gloo; only tensors cross the wire.
"""

import contextlib
import functools
import os
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import TorchDispatchMode

import ddp_bucketed
import dp_common
import harness
import section
from common import (
    GPTConfig,
    MarkovData,
    build_gpt,
    count_tokens,
    init_dist,
    lm_loss,
    make_optimizer,
)
from ddp_bucketed import BucketedDDP, MiB, Overlap
from dp_common import Checks, SmallNet, check_refused, check_unchecked_lets_through
from harness import CommonArgs, gather_rows

CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
B, SEED, F64 = 12, 0, torch.float64
CAP, FIRST = 0.01, 0.002  # MiB: several buckets for this ~60 KB model
d = init_dist(60)
data = MarkovData(CFG.vocab, SEED)
check = Checks(d)  # check(ok, what); check.finish() at the end


def gpt():
    return build_gpt(CFG, SEED, F64, d.device)


def rel(a, b):
    """max |a - b| / max |b| over all tensors of two {name: grad} dicts (None must match None)."""
    if a.keys() != b.keys() or any((a[n] is None) != (b[n] is None) for n in a):
        return float("inf")
    num = max((a[n] - b[n]).abs().max().item() for n in a if a[n] is not None)
    return num / max(max(b[n].abs().max().item() for n in b if b[n] is not None), 1e-300)


def grads(model):
    return {
        n: None if p.grad is None else p.grad.detach().clone() for n, p in model.named_parameters()
    }


def spread_over_ranks(g):
    """Largest difference between this rank's gradients and rank 0's (0 = replicated)."""
    flat = torch.cat([t.flatten() for t in g.values() if t is not None])
    every = [torch.empty_like(flat) for _ in range(d.world)]
    dist.all_gather(every, flat)
    t = torch.tensor(
        [max((e - every[0]).abs().max().item() for e in every)], dtype=F64, device=d.device
    )
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def batch(step):
    """Global batch of `step`, this rank's slice, and the global token count (tensors on the device)."""
    x, y = (t.to(d.device) for t in data.batch(step, B, CFG.seq_len))
    b = B // d.world
    return x, y, x[d.rank * b : (d.rank + 1) * b], y[d.rank * b : (d.rank + 1) * b], count_tokens(y)


def backward(model, x, y, n_tok, scale):
    lm_loss(model(x), y, n_tok).mul(scale).backward()


def full_batch_grads(steps):
    """The one-process answer: gradient of the global loss summed over the given steps' global batches."""
    m = gpt()
    for s in steps:
        x, y, _, _, n = batch(s)
        backward(m, x, y, n, 1.0)
    return grads(m)


# 1. vs torch DDP and the full-batch gradient, over 3 iterations (the 2nd and 3rd after the rebuild), with AdamW
m_ours, m_ref = gpt(), gpt()
ours, ref = BucketedDDP(m_ours, CAP, FIRST), DDP(m_ref)
watch = Overlap(ours)  # the file's own measurement, watching from outside
first_layout = ddp_bucketed.bucket_layout(ours)
arrived = []  # an independent observer of gradient arrival, registered after BucketedDDP's hooks
for n, p in m_ours.named_parameters():
    p.register_post_accumulate_grad_hook(lambda p, n=n: arrived.append(n))
launched_mid_backward = []  # buckets launched when the gradient reaches block 0's input (embeddings still to come)


def at_block0_input_grad(g):
    """Mid-backward (block 0's input gradient; the embeddings' still to come): count the buckets launched,
    then give bucket 0's all-reduce up to 10 s to complete, so that its completion is measurable."""
    launched_mid_backward.append(len(ours.works))
    deadline = time.monotonic() + 10
    while ours.works and not ours.works[0].is_completed() and time.monotonic() < deadline:
        time.sleep(1e-3)


def watch_block0_input(module, args):  # forward pre-hook: put a gradient hook on block 0's input
    args[0].register_hook(at_block0_input_grad)


m_ours.blocks[0].register_forward_pre_hook(watch_block0_input)
opt_ours, opt_ref = (
    make_optimizer(m_ours.parameters(), CommonArgs()),
    make_optimizer(m_ref.parameters(), CommonArgs()),
)
for step in range(3):
    x, y, xl, yl, n_tok = batch(step)
    for model, opt in ((ours, opt_ours), (ref, opt_ref)):
        opt.zero_grad(set_to_none=True)
        # N * L_r, averaged by DDP = grad of the global loss
        backward(model, xl, yl, n_tok, d.world)
    g_ours, g_ref, g_full = grads(m_ours), grads(m_ref), full_batch_grads([step])
    local = gpt()
    local.load_state_dict(m_ours.state_dict())
    backward(local, xl, yl, n_tok, d.world)
    check(
        rel(g_ours, g_ref) <= 1e-12,
        f"step {step}: grads == torch DDP (rel diff {rel(g_ours, g_ref):.1e})",
    )
    if step == 0:  # same parameters as the fresh one-process model only before the first update
        g_full0 = g_full
        check(
            rel(g_ours, g_full) <= 1e-10,
            f"step 0: grads == one-process full-batch grad ({rel(g_ours, g_full):.1e})",
        )
    check(spread_over_ranks(g_ours) == 0.0, f"step {step}: grads identical on every rank")
    check(
        d.world == 1 or rel(grads(local), g_ours) > 1e-6,
        f"step {step}: negative: this rank's own gradient differs from the average ({rel(grads(local), g_ours):.1e})",
    )
    if step == 0:
        first_arrival = list(arrived)
    opt_ours.step()
    opt_ref.step()
p_diff = max((a - b).abs().max().item() for a, b in zip(m_ours.parameters(), m_ref.parameters()))
check(p_diff <= 1e-12, f"after 3 AdamW steps: parameters == torch DDP's (max diff {p_diff:.1e})")


def in_bucket(ddp):
    """Parameters whose .grad shares its storage with its own bucket's buffer (DDP's gradient_as_bucket_view)."""
    return sum(
        p.grad is not None
        and p.grad.untyped_storage().data_ptr()
        == ddp.bucket_of[i].buffer.untyped_storage().data_ptr()
        for i, p in enumerate(ddp.params)
    )


check(
    in_bucket(ours) == len(ours.params),
    f"gradients live in the buckets: {in_bucket(ours)}/{len(ours.params)} "
    f".grad share storage with their bucket's buffer",
)

# 2. bucket layout: same on every rank, within the caps, reverse registration first, then arrival order
names = [n for n, _ in m_ours.named_parameters()]
layout = ddp_bucketed.bucket_layout(ours)
rows = [
    [b, names.index(n), nb, wire] for b, (ns, nb, wire) in enumerate(layout) for n in ns
]  # (P, 4) numbers
every = gather_rows(d, rows)  # every rank's layout, as tensors
check(
    all(torch.equal(e, every[d.rank]) for e in every),
    f"layout identical on every rank ({len(layout)} buckets)",
)
check(len(layout) >= 3, f"several buckets: {[nb for _, nb, _ in layout]} bytes")
check(
    sorted(n for ns, _, _ in layout for n in ns) == sorted(names),
    "every parameter in exactly one bucket",
)
nbytes = {n: p.numel() * 8 for n, p in m_ours.named_parameters()}
cut = all(
    nb >= cap > nb - nbytes[ns[-1]]
    for (ns, nb, _), cap in zip(layout[:-1], [int(FIRST * MiB)] + [int(CAP * MiB)] * len(layout))
)
check(
    cut,
    f"DDP's cut rule: each bucket but the last closed as its last parameter took it to its cap or past "
    f"(bucket 0: {FIRST * MiB:.0f} B, others {CAP * MiB:.0f} B): {[nb for _, nb, _ in layout]} B",
)
check(
    [n for ns, _, _ in first_layout for n in ns] == names[::-1],
    "first layout: reverse of registration",
)
check(
    [n for ns, _, _ in layout for n in ns] == first_arrival,
    f"rebuilt layout: the order gradients arrived (first: {first_arrival[0]})",
)
steps = watch.per_step()
check(
    steps[-1]["payload_bytes"] == sum(p.numel() for p in m_ours.parameters()) * 8,
    f"all-reduce payload counted = parameter bytes ({steps[-1]['payload_bytes']} B)",
)

# 3. overlap: buckets launched while backward was still computing (seen from inside backward), and
# all-reduces that had *completed* when backward ended, measured from the works themselves
hidden = [h["hidden"] for h in steps]
check(
    min(launched_mid_backward) >= 1 and steps[-1]["launched_early"] >= 1,
    f"overlap: {launched_mid_backward} buckets launched before the embedding grads existed; "
    f"{steps[-1]['launched_early']}/{len(layout)} launched before backward finished",
)
check(
    min(hidden) >= 1,
    f"overlap: all-reduces complete when backward ended, per step: {hidden} (work.is_completed)",
)


class LaunchAtEnd(BucketedDDP):
    """Negative twin: every bucket waits for the end of backward (dp.py's naive way)."""

    def _launch_ready(self):
        if getattr(self, "_at_end", False):
            super()._launch_ready()

    def _finish_backward(self):
        self._at_end = True  # _fill_missing launches every bucket now, in order
        super()._finish_backward()
        self._at_end = False


late = LaunchAtEnd(gpt(), CAP, FIRST)
late_watch = Overlap(late)
x, y, xl, yl, n_tok = batch(0)
backward(late, xl, yl, n_tok, d.world)
h = late_watch.per_step()[-1]
check(
    h["hidden"] == 0 and h["launched_early"] == 0 and rel(grads(late.module), g_full0) <= 1e-10,
    f"negative: buckets launched at the end of backward: {h['hidden']} complete when it ended",
)


class Reversed(nn.Module):
    """Layers registered in the reverse of their use: the first-guess buckets are exactly backward-ordered
    wrong, so nothing can launch early until the arrival-order rebuild fixes it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.c, self.b, self.a = (
            nn.Linear(64, 64, bias=False, dtype=F64, device=d.device) for _ in range(3)
        )

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


# 33 KB weight: one layer per bucket
rv = BucketedDDP(Reversed(), bucket_cap_mb=0.03, first_bucket_mb=0.03)
rv_watch = Overlap(rv)
for _ in range(2):
    rv(torch.randn(4, 64, dtype=F64, device=d.device)).square().sum().backward()
e0, e1 = (h["launched_early"] for h in rv_watch.per_step())
check(
    e0 == 0 and e1 == len(rv.buckets) - 1 >= 2,
    f"negative: registration-ordered buckets launch {e0} early; after the rebuild {e1}/{len(rv.buckets)}",
)

# 4. no_sync: local accumulation (differs between ranks), then a synced step = torch DDP's no_sync
m_ours, m_ref = gpt(), gpt()
ours, ref = BucketedDDP(m_ours, CAP, FIRST), DDP(m_ref)
xa, ya, xal, yal, na = batch(10)
xb, yb, xbl, ybl, nb = batch(11)
for model in (ours, ref):
    with model.no_sync():
        backward(model, xal, yal, na, d.world)
local = gpt()
backward(local, xal, yal, na, d.world)
check(rel(grads(m_ours), grads(local)) == 0.0, "no_sync: grads are exactly this rank's own")
check(
    d.world == 1 or spread_over_ranks(grads(m_ours)) > 1e-6, "no_sync: grads differ between ranks"
)
for model in (ours, ref):
    backward(model, xbl, ybl, nb, d.world)
g_ours, g_ref, g_full = grads(m_ours), grads(m_ref), full_batch_grads([10, 11])
check(
    rel(g_ours, g_ref) <= 1e-12,
    f"no_sync + synced step: grads == torch DDP's ({rel(g_ours, g_ref):.1e})",
)
check(
    rel(g_ours, g_full) <= 1e-10,
    f"no_sync + synced step: grads == one-process sum of both batches ({rel(g_ours, g_full):.1e})",
)
check(spread_over_ranks(g_ours) == 0.0, "no_sync + synced step: grads identical on every rank")


# 5. parameters that get no gradient
class WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = gpt()
        self.spare = nn.Linear(3, 3, dtype=F64, device=d.device)  # never used
        self.gain = nn.Parameter(torch.ones((), dtype=F64, device=d.device))  # used on rank 0 only

    def forward(self, x):
        out = self.gpt(x)
        return out * self.gain if d.rank == 0 else out


x, y, xl, yl, n_tok = batch(20)
strict = BucketedDDP(WithUnused(), CAP, FIRST)
try:
    backward(strict, xl, yl, n_tok, 1.0)
    msg = ""
except RuntimeError as e:
    msg = str(e)
check(
    "spare.weight" in msg and "spare.bias" in msg and "find_unused_parameters" in msg,
    f"unused parameter: clear error naming it: {msg[:110]}...",
)
m_ours, m_ref = WithUnused(), WithUnused()
ours, ref = (
    BucketedDDP(m_ours, CAP, FIRST, find_unused_parameters=True),
    DDP(m_ref, find_unused_parameters=True),
)
for step in (20, 21):  # no rebuild with find_unused_parameters (torch neither)
    x, y, xl, yl, n_tok = batch(step)
    for model in (m_ours, m_ref):
        model.zero_grad(set_to_none=True)
    for model in (ours, ref):
        backward(model, xl, yl, n_tok, d.world)
    g_ours, g_ref = grads(m_ours), grads(m_ref)
    check(
        rel(g_ours, g_ref) <= 1e-12
        and g_ours["spare.weight"] is None
        and g_ours["gain"] is not None,
        f"step {step}: find_unused_parameters == torch DDP's (rel {rel(g_ours, g_ref):.1e}; unused everywhere "
        f"-> grad None, used on rank 0 only -> averaged on all)",
    )


# 5b. no_sync() + find_unused_parameters: a parameter whose use changes between the accumulated micro-batch
# and the synced one. torch DDP reduces every defined .grad and skips only those unused on every rank in
# every backward since the last sync (its local_used_map); BucketedDDP must give the same gradients.
class Extra(nn.Module):
    def __init__(self):
        super().__init__()
        self.gpt = gpt()
        self.extra = nn.Parameter(torch.linspace(-1, 1, CFG.vocab, dtype=F64, device=d.device))
        self.ranks = ()  # ranks that use `extra` in the next forward

    def forward(self, x):
        out = self.gpt(x)
        return out * self.extra if d.rank in self.ranks else out


m_ours, m_ref = Extra(), Extra()
ours, ref = (
    BucketedDDP(m_ours, CAP, FIRST, find_unused_parameters=True),
    DDP(m_ref, find_unused_parameters=True),
)
everyone, rank0 = tuple(range(d.world)), (0,)
for k, (in_no_sync, in_synced, what) in enumerate(
    [
        (everyone, (), "used in no_sync, unused in the synced step"),
        (everyone, rank0, "used in no_sync, on rank 0 only when synced"),
        (rank0, (), "used on rank 0 in no_sync only"),
        ((), (), "unused everywhere"),
    ]
):
    (xa, ya, xal, yal, na), (xb, yb, xbl, ybl, nb) = batch(40 + 2 * k), batch(41 + 2 * k)
    for model, m in ((ours, m_ours), (ref, m_ref)):
        m.zero_grad(set_to_none=True)
        m.ranks = in_no_sync
        with model.no_sync():
            backward(model, xal, yal, na, d.world)
        m.ranks = in_synced
        backward(model, xbl, ybl, nb, d.world)
    g_ours, g_ref = grads(m_ours), grads(m_ref)
    check(
        rel(g_ours, g_ref) <= 1e-12
        and spread_over_ranks({n: g for n, g in g_ours.items() if g is not None}) == 0.0,
        f"no_sync + find_unused, {what}: grads == torch DDP's, replicated (rel {rel(g_ours, g_ref):.1e}; "
        f"extra.grad {'None' if g_ours['extra'] is None else 'averaged'})",
    )
check(
    g_ours["extra"] is None,
    "no_sync + find_unused: unused on every rank in every backward -> .grad stays None",
)

# 6. compression: close to the exact average and equal to torch DDP with a compress hook, but not exact


def bf16_hook(state, bucket):
    """default_hooks.bf16_compress_hook's arithmetic (torch allows that one on NCCL only): cast, divide, sum."""
    buf = bucket.buffer()
    fut = dist.all_reduce(buf.to(torch.bfloat16).div_(d.world), async_op=True).get_future()
    return fut.then(lambda f: buf.copy_(f.value()[0]))


x, y, xl, yl, n_tok = batch(30)
exact = full_batch_grads([30])
for name, dtype, hook in (
    ("bf16", torch.bfloat16, bf16_hook),
    ("fp16", torch.float16, default_hooks.fp16_compress_hook),
):
    m_ours, m_ref = gpt(), gpt()
    ours, ref = BucketedDDP(m_ours, CAP, FIRST, compress=dtype), DDP(m_ref)
    watch = Overlap(ours)
    ref.register_comm_hook(None, hook)
    for model in (ours, ref):
        backward(model, xl, yl, n_tok, d.world)
    g_ours, g_ref = grads(m_ours), grads(m_ref)
    eps = torch.finfo(dtype).eps
    check(
        rel(g_ours, g_ref) <= 2 * eps,
        f"{name}: grads ~ torch DDP's {name}_compress_hook ({rel(g_ours, g_ref):.1e})",
    )
    check(
        4 * eps >= rel(g_ours, exact) > 1e-9,
        f"{name}: close to but not equal to the exact average ({rel(g_ours, exact):.1e})",
    )
    sent = watch.per_step()[-1]["payload_bytes"]
    check(
        sent * 4 == sum(p.numel() for p in m_ours.parameters()) * 8,
        f"{name}: a quarter of the fp64 bytes travel ({sent} B)",
    )

# 7. --check with --compress cannot miss a reduction: drop any one bucket's all-reduce (the bucket is reduced
# into a copy, so every rank still issues the same collectives) and the run's own --check must FAIL.
# ddp_bucketed.py's main runs here, as torchrun runs it: it returns instead of ending the process, and its
# --check verdict is read from its call
verdicts, check_against_reference = [], ddp_bucketed.check_against_reference
ddp_bucketed.check_against_reference = lambda *a, **k: (
    verdicts.append(check_against_reference(*a, **k)) or verdicts[-1]
)
ddp_bucketed.init_dist, harness.close_dist = (lambda timeout=120: d), (lambda ok=True: None)
argv = [
    "ddp_bucketed.py",
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
    str(B),
    "--steps",
    "4",
    "--dtype",
    "float64",
    "--bucket-cap-mb",
    str(CAP),
    "--first-bucket-mb",
    str(FIRST),
    "--compress",
    "bf16",
    "--check",
]
reduce = BucketedDDP._reduce
n_buckets = len(layout)
for drop in [None] + (list(range(n_buckets)) if d.world == 2 else [0, n_buckets - 1]):
    BucketedDDP._reduce = lambda self, b, buf, drop=drop: reduce(
        self, b, buf.clone() if b == drop else buf
    )
    sys.argv = argv
    ddp_bucketed.main()
    c = verdicts[-1]
    ok = c["passed"] if drop is None else not c["passed"]
    check(
        ok,
        f"--compress bf16 --check {'PASSES' if drop is None else f'FAILS without bucket {drop}'} "
        f"(loss {c['max_loss_diff']:.1e}, params {c['max_param_diff']:.1e})",
    )
BucketedDDP._reduce = reduce


# 8. DDP's bucket cut rule: our rebuilt layout has torch DDP's buckets, the same parameters in the same order,
# read from DDP's own reducer (a comm hook sees its GradBucket objects; its logging data their sizes)
def ddp_buckets(cap):
    """torch DDP's buckets after its rebuild, read from DDP itself: the parameter names of each GradBucket its
    reducer hands to a comm hook, and the sizes and parameter indices its logging data reports."""
    m = gpt()
    ddp, seen, name_of = DDP(m, bucket_cap_mb=cap), {}, {id(p): n for n, p in m.named_parameters()}

    def record(state, bucket):
        seen[bucket.index()] = [name_of[id(p)] for p in bucket.parameters()]
        return default_hooks.allreduce_hook(None, bucket)

    ddp.register_comm_hook(None, record)
    for step in range(3):  # rebuilt before the 2nd forward; the logging data has it after the 3rd
        _, _, xl, yl, n_tok = batch(step)
        backward(ddp, xl, yl, n_tok, d.world)
    log = ddp._get_ddp_logging_data()
    sizes = [int(s) for s in str(log["rebuilt_bucket_sizes"]).split(",")]
    indices = [
        [int(i) for i in b.split()] for b in str(log["rebuilt_per_bucket_param_indices"]).split(",")
    ]
    return [seen[b] for b in sorted(seen)], sizes, indices


def our_buckets(cls, cap):
    m = gpt()
    ddp = cls(m, cap, cap)  # first bucket = cap: what DDP does when bucket_cap_mb is given
    for step in range(3):
        _, _, xl, yl, n_tok = batch(step)
        backward(ddp, xl, yl, n_tok, d.world)
        m.zero_grad(set_to_none=True)
    buckets = ddp_bucketed.bucket_layout(ddp)
    return (
        [names for names, _, _ in buckets],
        [nb for _, nb, _ in buckets],
        [b.idx for b in ddp.buckets],
    )


class CloseBefore(BucketedDDP):
    """Negative twin: the cut rule before issue 21, a bucket closed *before* a parameter would pass the cap."""

    def _assign(self, order):
        buckets, size = [[]], 0
        for i in order:
            nbytes = self.params[i].numel() * self.params[i].element_size()
            if buckets[-1] and size + nbytes > self.caps[min(len(buckets) - 1, 1)]:
                buckets, size = buckets + [[]], 0
            buckets[-1].append(i)
            size += nbytes
        return buckets


for cap in (CAP, 0.004):
    (theirs, their_sizes, their_idx), (mine, my_sizes, my_idx) = (
        ddp_buckets(cap),
        our_buckets(BucketedDDP, cap),
    )
    check(
        mine == theirs and my_sizes == their_sizes and my_idx == their_idx,
        f"cap {cap} MiB: {len(mine)} buckets, the same parameters in the same order as torch DDP's rebuilt "
        f"buckets ({len(theirs)}; sizes {their_sizes} B, from its reducer)",
    )
    old = our_buckets(CloseBefore, cap)[0]
    check(
        len(old) != len(theirs),
        f"cap {cap} MiB: negative: closing a bucket before it passes the cap gives "
        f"{len(old)} buckets, not DDP's {len(theirs)}",
    )


# 9. gradients live in the buckets: with zero_grad(set_to_none=False) backward adds into the bucket views and
# nothing is moved into a bucket; with set_to_none=True each gradient is moved in once (divided by N on the
# way); a BucketedDDP that copies out of the bucket (a .grad of its own, as before issue 21) fails the check
class Copies(TorchDispatchMode):
    """Gradients moved into ddp's bucket buffers, seen at the dispatcher: a copy_, or a div with out=, from a
    tensor outside the buffers into one of them (the buffers as they are at the call). Autograd's own add_
    into a .grad that is already a bucket view is the accumulation, not a move."""

    def __init__(self, ddp):
        super().__init__()
        self.ddp, self.n = ddp, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        dst, src = (args[0], args[1]) if name == "aten::copy_" else (kwargs.get("out"), args[0])
        if name in ("aten::copy_", "aten::div") and torch.is_tensor(dst) and torch.is_tensor(src):
            ptrs = {b.buffer.untyped_storage().data_ptr() for b in self.ddp.buckets}
            self.n += (
                dst.untyped_storage().data_ptr() in ptrs
                and src.untyped_storage().data_ptr() not in ptrs
            )
        return func(*args, **kwargs)


class CopyOut(BucketedDDP):
    def _wait(self, unused_everywhere=()):
        for b, work in enumerate(self.works):
            work.wait()
            for i in self.buckets[b].idx:
                self.params[i].grad = self.buckets[b].views[i].clone()


for cls in (BucketedDDP, CopyOut):
    m = gpt()
    ddp, opt, copies = cls(m, CAP, FIRST), make_optimizer(m.parameters(), CommonArgs()), []
    # the rebuild comes before step 1
    for step, set_to_none in enumerate((True, True, False, False)):
        opt.zero_grad(set_to_none=set_to_none)
        _, _, xl, yl, n_tok = batch(50 + step)
        with Copies(ddp) as c:
            backward(ddp, xl, yl, n_tok, d.world)
        opt.step()
        copies.append(c.n)
    if cls is BucketedDDP:
        check(
            in_bucket(ddp) == len(ddp.params) and copies[1:] == [len(ddp.params), 0, 0],
            f"gradients live in the buckets: {in_bucket(ddp)}/{len(ddp.params)} share their bucket's storage; "
            f"copies into the buckets per backward {copies} (set_to_none True, True, False, False)",
        )
    else:
        check(
            in_bucket(ddp) == 0,
            f"negative: gradients copied out of the buckets: {in_bucket(ddp)} share storage",
        )


# 10. copy-out: BucketedDDP on a model that is not the GPT (nested modules, a parameter on the root module,
# odd sizes, a Huber loss, gradient accumulation under no_sync, clipping) == plain one-process training
Net = functools.partial(SmallNet, 3, d.device)  # the same weights on every rank
# (B, 7), (B, 3)
net_batch = functools.partial(dp_common.net_batch, rows=B, seed=200, device=d.device)


def huber(model, x, y):  # a sum over the rows given / the rows of the whole batch
    return F.huber_loss(model(x), y, reduction="sum", delta=0.5) / B


core = types.SimpleNamespace(**section.load("ddp_bucketed.py"))  # the technique section alone
plain, rows = Net(), B // d.world
for model, distributed in ((plain, False), (Net(), True), (Net(), None)):
    net = (
        core.BucketedDDP(model, bucket_cap_mb=0.0005, first_bucket_mb=0.0002)
        if distributed
        else model
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
    for step in range(4):
        opt.zero_grad(set_to_none=step % 2 == 0)
        # two micro-batches
        for k, (x, y) in enumerate(zip(*(t.chunk(2) for t in net_batch(step)))):
            if distributed is not False:  # this rank's rows of each micro-batch
                x, y = (
                    x[d.rank * rows // 2 : (d.rank + 1) * rows // 2],
                    y[d.rank * rows // 2 : (d.rank + 1) * rows // 2],
                )
            with net.no_sync() if distributed and k == 0 else contextlib.nullcontext():
                # DDP averages: N x rank's share
                (huber(net, x, y) * (d.world if distributed else 1)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), plain.parameters()))
    if distributed:
        buckets = len(net.buckets)
        check(
            diff <= 1e-12 and buckets >= 3,
            f"copy-out: BucketedDDP on a non-GPT model ({buckets} buckets, Huber "
            f"loss, a root parameter, no_sync accumulation) == plain one-process training (params {diff:.1e})",
        )
    elif distributed is None:
        check(
            d.world == 1 or diff > 1e-6,
            f"copy-out: negative: the same model trained on this rank's rows alone "
            f"differs ({diff:.1e})",
        )

# 11. bad input: the core refuses what it cannot do, a ValueError that says what would work, before any collective
# (harness.CommCounter sees none: today's first collective is the broadcast of the weights). Negatives: a valid
# BucketedDDP under the same counter broadcasts; the section with its checks taken out lets every one through.
# Parameters that differ between ranks in number or shape cannot be seen without communicating (torch DDP
# spends a collective on it, _verify_param_shape_across_processes): not checked here.
refused = section.refused  # (call, words) -> (refused before any collective, what happened)


def frozen():
    net = Net()
    net.requires_grad_(False)
    return net


def bad_calls(c):
    return {
        "bucket_cap_mb 0": (
            lambda: c.BucketedDDP(Net(), bucket_cap_mb=0),
            ["bucket_cap_mb=0", "positive"],
        ),
        "first_bucket_mb -1": (
            lambda: c.BucketedDDP(Net(), first_bucket_mb=-1),
            ["first_bucket_mb=-1"],
        ),
        "bucket_cap_mb nan": (
            lambda: c.BucketedDDP(Net(), bucket_cap_mb=float("nan")),
            ["bucket_cap_mb=nan"],
        ),
        "compress int8": (
            lambda: c.BucketedDDP(Net(), compress=torch.int8),
            ["float dtype", "torch.int8"],
        ),
        "no trainable parameter": (
            lambda: c.BucketedDDP(frozen()),
            ["no parameter", "requires grad"],
        ),
    }


check_refused(check, bad_calls, core, "BucketedDDP, ")
# a copier calls the core, not the command line: its refusals name parameters (check_args adds the flags)
flagged = [w for w, (call, _) in bad_calls(core).items() if "--" in section.attempt(call)[0]]
check(not flagged, f"bad input: the core's refusals name no command-line flag ({flagged})")
ok, seen = refused(lambda: core.BucketedDDP(Net()), [])
check(
    seen.startswith("no error") and "'broadcast/" in seen,
    f"bad input: negative: a valid BucketedDDP under the same counter broadcasts ({seen})",
)
check_unchecked_lets_through(check, "ddp_bucketed.py", bad_calls, core)

check.finish()
