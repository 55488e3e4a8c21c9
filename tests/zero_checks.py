"""Layer-level checks of zero.py inside one process group (launched once by tests/test_zero.py):

    torchrun --nproc_per_node=3 tests/zero_checks.py

1. The Zero wrapper around a model with awkward shapes (7x5 and 5x3 linears, a bias-free layer, a bare
   parameter; flat units of 40, 15 and 35 elements, so world 3 pads two of them) against one-process
   training, torch's ZeroRedundancyOptimizer (stage 1) and fully_shard (FSDP2, stage 3), in float64.
2. The GPT at stages 0-3 (gradient accumulation, clipping) against common.reference_train and each other;
   counted memory per stage against the ZeRO formulas; bytes handed to collectives per step against a
   closed form from the model's own parameter counts; stage 3 frees each gathered storage after use and
   its peak stays within root + 2 blocks; its all-gathers are prefetched (forward and backward) and its
   reduce-scatters still in flight while the next block computes; offload keeps master and moments on the
   CPU in storages of their own.
3. --mixed-precision bf16 --check (zero.train_zero, in-process) passes, and FAILS when any one unit's
   gradient is not reduced across ranks.
4. What a GPU would show (issue 21): one host-to-device copy of a step's batch; the reported peak is the
   training steps' (states + gathered peak + saved), read before --check trains the reference (issue 31);
   stages 0-1 reduce each unit during the last backward, stages 1-2 wait for each unit's all-gather of the
   update only at its next forward.
5. fp16: an overflow injected into one rank's gradient (a monkeypatch, the test hook the file no longer
   has) is skipped on every rank, with the loss scale's back-off and growth, and --check passes.
6. ZeroCheckpoint on node-local disks (rank 0's .metadata on its node only): every rank refuses the
   resume (exit 2, one line) where the old code restarted from step 0; one shared directory resumes.
(Recomputation, activation compression and Adafactor: tests/memory_savers_checks.py.)
Each check is also run against code broken on purpose (a gathered unit kept alive, prefetch off, offload
aliasing the compute copy, a dropped reduction, a copy per micro-batch, reductions or all-gathers waited
for at once, the peak read after the reference), and must catch it.
Every tensor and model lives on the process group's device (gloo + CPU here, NCCL + GPU elsewhere).
Prints ALL CHECKS PASSED and exits 0, or names each failed check and exits 1.
"""

import contextlib
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import zero as Z
from common import (
    GPTConfig,
    MarkovData,
    build_gpt,
    close_dist,
    count_tokens,
    init_dist,
    lm_loss,
    make_optimizer,
    reference_train,
)
from harness import CommCounter

FAILED = []


def check(d, name, ok, detail=""):
    d.log(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILED.append(name)
        if d.rank:  # rank 0 speaks for the job; another rank's own failure is printed by that rank
            print(f"FAIL (rank {d.rank}) {name} {detail}", flush=True)


def max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[n].cpu() - b[n].cpu()).abs().max().item() for n in a)


def make_zero(model, a, units, device, group=None):
    """The class an Args asks for, built as zero.train_zero builds it: Zero, or (--offload) OffloadZero."""
    kw = dict(
        stage=a.stage,
        optimizer=lambda ps: make_optimizer(ps, a),
        clip=a.clip,
        group=group,
        device=device,
    )
    if a.offload or a.mixed_precision != "none":
        kind = Z.OffloadZero if a.offload else Z.MixedPrecisionZero
        return kind(model, units, compute_dtype=Z.LOW[a.mixed_precision], **kw)
    return Z.Zero(model, units, **kw)


def step_loss(zero, x, y, n_tok, accum, loss_fn, comm=None):
    """One train_step; its bytes seen by `comm` (a CommCounter) when given; the global batch's loss."""
    with comm if comm is not None else contextlib.nullcontext():
        local, _ = Z.train_step(zero, x, y, n_tok, accum, loss_fn)
    dist.all_reduce(local, group=zero.group)
    return local.item()


# ----------------------------------------------------------------------------- 1. awkward shapes
class Awkward(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 5)  # 35 + 5 = 40 elements: padded to 42 at world 3
        self.b = nn.Linear(5, 3, bias=False)  # 15
        self.c = nn.Linear(3, 7)  # root unit: c (21 + 7) and gain (7) = 35, padded to 36
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 7))

    def forward(self, x):  # (B, 7) -> (B, 7)
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))) * self.gain


def awkward(device="cpu"):
    torch.manual_seed(1)
    return Awkward().double().to(device)


def batch(d, step):  # the global batch of a step, (12, 7) inputs and targets, on the device
    g = torch.Generator().manual_seed(100 + step)
    x, y = (torch.randn(12, 7, generator=g, dtype=torch.float64) for _ in range(2))
    return x.to(d.device), y.to(d.device)


def mse(out, y, n):  # sum over this piece / elements of the whole global batch, like common.lm_loss
    return ((out - y) ** 2).sum() / n


def local_pieces(d, x, y, accum):  # this rank's rows, in accum micro-batches
    rows = x.shape[0] // d.world
    return zip(
        x[d.rank * rows : (d.rank + 1) * rows].chunk(accum),
        y[d.rank * rows : (d.rank + 1) * rows].chunk(accum),
    )


def check_awkward(d, args, steps=3):
    init = {n: p.detach().cpu() for n, p in awkward().named_parameters()}
    plain = awkward(d.device)  # one process, the whole global batch
    opt = make_optimizer(plain.parameters(), args)
    norms = []
    for s in range(steps):
        x, y = batch(d, s)
        opt.zero_grad()
        mse(plain(x), y, y.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip)))
        opt.step()
    want = {n: p.detach().cpu() for n, p in plain.named_parameters()}

    # torch's ZeRO-1: gradients summed by hand (our loss is already divided globally)
    z1 = awkward(d.device)
    opt = ZeroRedundancyOptimizer(
        z1.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=args.lr,
        betas=(0.9, 0.95),
        weight_decay=args.weight_decay,
        foreach=False,
    )
    for s in range(steps):
        x, y = batch(d, s)
        opt.zero_grad()
        for xm, ym in local_pieces(d, x, y, args.accum):
            mse(z1(xm), ym, y.numel()).backward()
        for p in z1.parameters():
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(z1.parameters(), args.clip)
        opt.step()
    torch_zero1 = {n: p.detach().cpu() for n, p in z1.named_parameters()}

    # torch's FSDP2, the same units; it averages gradients over ranks, so the loss is x N
    f = awkward(d.device)
    for unit in (f.a, f.b, f):
        fully_shard(unit)
    opt = make_optimizer(f.parameters(), args)
    for s in range(steps):
        x, y = batch(d, s)
        opt.zero_grad()
        for xm, ym in local_pieces(d, x, y, args.accum):
            (mse(f(xm), ym, y.numel()) * d.world).backward()
        torch.nn.utils.clip_grad_norm_(f.parameters(), args.clip)
        opt.step()
    torch_fsdp = {n: p.full_tensor().detach().cpu() for n, p in f.named_parameters()}
    check(d, "awkward: torch ZeRO-1 == one process", max_diff(torch_zero1, want) < 1e-12)
    check(d, "awkward: torch FSDP2 == one process", max_diff(torch_fsdp, want) < 1e-12)
    check(
        d,
        "awkward: training moved the parameters (parity is not vacuous)",
        max_diff(want, init) > 1e-3,
    )
    check(
        d,
        "awkward: clipping was active",
        max(norms) > args.clip,
        f"(max norm {max(norms):.3f} > {args.clip})",
    )

    def run(stage, **kw):
        a = replace(args, stage=stage, **kw)
        # built on the CPU, sharded to the device
        zero = make_zero(awkward(), a, ["a", "b"], d.device)
        for s in range(steps):
            x, y = batch(d, s)
            Z.train_step(zero, x, y, y.numel(), a.accum, mse)
        return Z.full_state_dict(zero)

    for stage in range(4):
        got = run(stage)
        diff = max_diff(got, want)
        check(d, f"awkward: Zero stage {stage} == one process", diff < 1e-12, f"({diff:.1e})")
        if stage == 1:
            diff = max_diff(got, torch_zero1)
            check(
                d,
                "awkward: Zero stage 1 == torch ZeroRedundancyOptimizer",
                diff < 1e-12,
                f"({diff:.1e})",
            )
        if stage == 3:
            check(
                d,
                "awkward: Zero stage 3 == torch fully_shard (FSDP2)",
                max_diff(got, torch_fsdp) < 1e-12,
                f"({max_diff(got, torch_fsdp):.1e})",
            )
    got = run(3, offload=True)
    check(d, "awkward: stage 3 + offload == FSDP2", max_diff(got, torch_fsdp) < 1e-12)
    got = run(3, clip=0.0)  # negative: the same run without clipping must differ
    check(
        d,
        "awkward: without clipping it differs (negative)",
        max_diff(got, want) > 1e-6,
        f"({max_diff(got, want):.1e})",
    )


def check_node_local_ckpt(d, args):
    """ZeroCheckpoint on two nodes with node-local disks (nccl-review-3 N3-7): rank 0 writes .metadata on
    its node only, so the last rank (on the other node) sees no complete step. Every rank refuses the resume
    (exit 2), where the old MIN over the ranks' newest steps restarted every rank from step 0; the same save
    in one shared directory resumes at its step."""
    zero = make_zero(awkward(), replace(args, stage=1), ["a", "b"], d.device)
    x, y = batch(d, 0)
    Z.train_step(zero, x, y, y.numel(), args.accum, mse)
    # the same on every rank
    tmp = os.path.join(tempfile.gettempdir(), f"zero_checks_{os.environ['MASTER_PORT']}")
    shared, node = (
        os.path.join(tmp, "shared"),
        os.path.join(tmp, "node1" if d.rank == d.world - 1 else "node0"),
    )
    got = []
    for root in (shared, node):
        flags = replace(args, ckpt_dir=root, save_every=1, steps=1)
        Z.ZeroCheckpoint(d, flags, zero).maybe_save(1, zero, {})
        dist.barrier()  # (rank 0 writes .metadata last: in a real restart the saving job has ended)
        try:
            got.append(Z.ZeroCheckpoint(d, flags, zero).load(zero)[0])
        except SystemExit as e:
            got.append(f"exit {e.code}")
    dist.barrier()
    if d.rank == 0:
        shutil.rmtree(tmp)
    check(
        d,
        "checkpoint: shared dir resumes at step 1; node-local disks (.metadata on rank 0's node) refused",
        got == [1, "exit 2"],
        f"{got}",
    )


# ----------------------------------------------------------------------------- 2. the GPT, stages 0-3
def gpt_zero(d, a, dtype=torch.float64):
    model = build_gpt(GPTConfig.from_args(a), a.seed, dtype)  # on the CPU; Zero moves the shards
    return make_zero(model, a, [f"blocks.{i}" for i in range(a.n_layers)], d.device)


def live_after(watch, wait_s=2.0):
    """Gathered bytes still alive; a storage a collective's worker thread holds a moment longer is waited
    for (briefly), one that our code keeps alive never goes."""
    deadline = time.time() + wait_s
    while watch.gathered.alive() and time.time() < deadline:
        time.sleep(0.01)
    return watch.gathered.alive()


def stage3_memory_problems(d, a, data):
    """Stage 3, one step: what is wrong with the gathered memory (empty: nothing). The storages holding
    gathered bytes must all be freed after a forward and after a backward, and their peak must stay within
    the root plus the two largest blocks (the one running, the one prefetched)."""
    zero = gpt_zero(d, a)
    watch = Z.Watch(zero)
    x, y = data.batch(0, a.batch_size, a.seq_len)
    rows = a.batch_size // d.world
    x, y = (
        x[d.rank * rows : (d.rank + 1) * rows].to(d.device),
        y[d.rank * rows : (d.rank + 1) * rows].to(d.device),
    )
    problems = []
    loss = lm_loss(zero(x), y, count_tokens(y))
    if live_after(watch):
        problems.append(f"{watch.gathered.alive()} B gathered still alive after forward")
    zero.backward(loss)
    del loss
    if live_after(watch):
        problems.append(f"{watch.gathered.alive()} B gathered still alive after backward")
    blocks = sorted((u.padded * 8 for u in zero.units[:-1]), reverse=True)
    bound = zero.root.padded * 8 + sum(blocks[:2])
    if watch.gathered.peak > bound:
        problems.append(f"peak gathered {watch.gathered.peak} B > bound {bound} B")
    return problems, watch.gathered.peak, bound


def keep_alive(stash):
    """A broken stage 3 that keeps one parameter *view* of every gathered unit (as a careless cache would):
    the view holds the gathered storage, so its bytes never come back."""
    acquire = Z.Zero.acquire

    def acquire_and_keep(self, u):
        buf = acquire(self, u)
        stash.append(next(iter(u.views(buf).values())))
        return buf

    return mock.patch.object(Z.Zero, "acquire", acquire_and_keep)


def overlap_events(d, a, data):
    """Stage 3, one micro-batch, recording what is in flight when each block starts computing: the
    all-gathers launched and not yet waited for, and the reduce-scatter not yet waited for.
    Returns (forward, backward), each {block index: (set of block indices gathering, block reducing)}."""
    zero = gpt_zero(d, a)
    index = {u: i for i, u in enumerate(zero.units[:-1])}
    fwd, bwd = {}, {}

    def record(events, i):  # (returns None: a pre-hook's return value would replace the inputs)
        events.setdefault(
            i,
            (
                {index.get(v) for v in zero.prefetched},
                index.get(zero.pending[0][0]) if zero.pending else None,
            ),
        )

    for u, i in index.items():
        u.module.register_forward_pre_hook(lambda m, args, i=i: record(fwd, i))
        u.module.register_full_backward_pre_hook(lambda m, g, i=i: record(bwd, i))
    x, y = data.batch(0, a.batch_size, a.seq_len)
    x, y = x[:2].to(d.device), y[:2].to(d.device)
    zero.backward(lm_loss(zero(x), y, count_tokens(y)))
    return fwd, bwd


def no_prefetch():
    """A broken stage 3 without prefetch: each all-gather starts only when its unit is needed."""

    def acquire_now(self, u):
        work, buf = self._launch_gather(u)
        work.wait()
        return buf

    return mock.patch.object(Z.Zero, "acquire", acquire_now)


def overlap_ok(fwd, bwd, L):
    """Forward: while block i computes, block i+1's all-gather is in flight. Backward: block i's all-gather
    was launched before its backward began (during block i+1's), and block i+1's reduce-scatter is still
    in flight while block i computes (it is waited for only when block i's is launched)."""
    f = all(fwd[i][0] == ({i + 1} if i + 1 < L else set()) for i in range(L))
    b = all(bwd[i][0] == {i} and bwd[i][1] == (i + 1 if i + 1 < L else None) for i in range(L))
    return f, b


def check_gpt(d, args):
    ref = reference_train(args)
    data = MarkovData(args.vocab, args.seed)
    results = {}
    for stage in (0, 1, 2, 3, "3+offload"):
        a = (
            replace(args, stage=3, offload=True)
            if stage == "3+offload"
            else replace(args, stage=stage)
        )
        zero, comm = gpt_zero(d, a), CommCounter()  # the bytes of the last step, at the dispatcher
        watch, losses = Z.Watch(zero), []
        for s in range(a.steps):
            x, y = data.batch(s, a.batch_size, a.seq_len)
            losses.append(
                step_loss(
                    zero,
                    x,
                    y,
                    count_tokens(y),
                    a.accum,
                    lm_loss,
                    comm if s == a.steps - 1 else None,
                )
            )
        sent, saved = comm.total(), watch.saved  # (saved: the last micro-batch's forward)
        full = Z.full_state_dict(zero)
        pdiff = max_diff(full, ref["params"])
        ldiff = max(abs(p - q) / abs(q) for p, q in zip(losses, ref["losses"]))
        check(
            d,
            f"stage {stage}: losses and params == reference",
            pdiff < 1e-10 and ldiff < 1e-10,
            f"(params {pdiff:.1e}, losses {ldiff:.1e})",
        )
        results[stage] = (zero, full, sent, saved)

    for stage in (1, 2, 3):
        diff = max_diff(results[stage][1], results[0][1])
        check(d, f"stage {stage} == stage 0", diff < 1e-12, f"({diff:.1e})")

    totals = []
    for stage in (0, 1, 2, 3):  # memory, counted from the tensors, against the ZeRO formulas
        zero = results[stage][0]
        mem, th, thp = Z.memory(zero), Z.theory(zero), Z.theory(zero, padded=True)
        ok = all(th[k] <= mem[k] == thp[k] for k in ("params", "grads", "optim"))
        check(
            d,
            f"stage {stage}: counted memory == ZeRO formula (padded), >= formula (unpadded)",
            ok,
            f"({ {k: (mem[k], round(th[k])) for k in ('params', 'grads', 'optim')} })",
        )
        totals.append(mem["params"] + mem["grads"] + mem["optim"])
    check(
        d,
        "model-state bytes fall stage by stage",
        totals[0] > totals[1] > totals[2] > totals[3],
        f"{totals}",
    )
    N = d.world
    check(
        d,
        "stage 3 holds about 1/N of stage 0",
        abs(totals[3] * N / totals[0] - 1) < 0.01,
        f"{totals}",
    )

    # bytes handed to collectives per step, against a closed form from a fresh model's own parameter counts:
    # every unit is padded to a multiple of N; an all-reduce / reduce-scatter takes the whole padded vector,
    # an all-gather this rank's 1/N; plus the 8-byte norm all-reduce
    model = build_gpt(GPTConfig.from_args(args), args.seed, torch.float64)
    sizes = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    sizes.append(sum(p.numel() for p in model.parameters()) - sum(sizes))
    whole = sum(-(-n // N) * N for n in sizes) * 8  # float64
    want = {
        0: whole,
        1: whole + whole / N,
        2: args.accum * whole + whole / N,
        3: args.accum * (2 * whole / N + whole),
    }
    for stage in (0, 1, 2, 3):
        sent = results[stage][2]
        check(
            d,
            f"stage {stage}: bytes handed to collectives per step == closed form",
            sent == want[stage] + 8,
            f"({sent:.0f} B, want {want[stage] + 8:.0f} B)",
        )

    # stage 3: gathered storages freed and within the bound; a unit kept alive by a view must be caught
    a3 = replace(args, stage=3)
    # gloo's worker thread drops its reference to a finished all-gather's output a moment after the wait
    # returns; on a loaded machine that can show once as a storage still alive. Up to 3 tries, decided
    # together (every rank runs the same collectives); a storage our code keeps shows every time.
    for _attempt in range(3):
        problems, peak, bound = stage3_memory_problems(d, a3, data)
        good = torch.tensor([float(not problems and peak == bound)], device=d.device)
        dist.all_reduce(good, op=dist.ReduceOp.MIN)
        if good.item():
            break
    check(
        d,
        "stage 3: gathered storages all freed, peak within root + 2 blocks",
        not problems,
        f"(peak {peak} B, bound {bound} B) {problems}",
    )
    check(
        d,
        "stage 3: the peak reaches the bound (a unit is prefetched while one runs)",
        peak == bound,
        f"({peak} vs {bound} B)",
    )
    stash = []
    with keep_alive(stash):
        problems, peak, bound = stage3_memory_problems(d, a3, data)
    stash.clear()
    check(
        d,
        "stage 3 mutant (a view of each gathered unit kept alive) is caught",
        any("after forward" in p for p in problems) and any("peak" in p for p in problems),
        f"{problems}",
    )

    # stage 3 overlap, observed: what is in flight when each block starts its forward and its backward
    L = args.n_layers
    fwd, bwd = overlap_events(d, a3, data)
    f, b = overlap_ok(fwd, bwd, L)
    check(
        d,
        "stage 3 forward: the next block's all-gather is in flight while a block computes",
        f,
        f"{fwd}",
    )
    check(
        d,
        "stage 3 backward: all-gather prefetched, the later block's reduce-scatter in flight",
        b,
        f"{bwd}",
    )
    with no_prefetch():
        fwd, bwd = overlap_events(d, a3, data)
    f, b = overlap_ok(fwd, bwd, L)
    check(
        d,
        "stage 3 mutant (no prefetch) is caught, forward and backward",
        not f and not b,
        f"{fwd} {bwd}",
    )

    problems = offload_problems(results["3+offload"][0], d.device)
    check(
        d,
        "offload: master and Adam moments on the CPU, compute copy on the device, distinct storages",
        not problems,
        f"{problems}"
        + (" (CPU only here: on/off device is trivially true)" if d.device.type == "cpu" else ""),
    )
    # negative: without offload the master IS the compute copy
    problems = offload_problems(results[3][0], d.device)
    check(
        d,
        "offload check catches a master that shares the compute copy's storage (no offload)",
        any("shares" in p for p in problems),
        f"{problems}",
    )


def offload_problems(zero, device):
    """What is wrong with --offload's placement (empty: nothing): the master shard, both Adam moments and the
    gradient's host buffer live in CPU memory, the compute copy on the model's device, and none of them shares
    the compute copy's storage (on a CPU-only machine the placement is trivially right; the storages are still
    checked)."""
    problems = []
    for i, u in enumerate(zero.units):
        st = zero.opt.state[u.master]
        host = {
            "master": u.master,
            "exp_avg": st["exp_avg"],
            "exp_avg_sq": st["exp_avg_sq"],
            **({"gradient buffer": u.host_grad} if hasattr(u, "host_grad") else {}),
        }
        problems += [
            f"unit {i}: {k} on {t.device}" for k, t in host.items() if t.device.type != "cpu"
        ]
        if u.compute.device != torch.device(device):
            problems.append(f"unit {i}: compute copy on {u.compute.device}")
        ptr = u.compute.untyped_storage().data_ptr()
        problems += [
            f"unit {i}: {k} shares the compute copy's storage"
            for k, t in host.items()
            if t.untyped_storage().data_ptr() == ptr
        ]
    return problems


# ----------------------------------------------------------------------------- 3. --mixed-precision --check
def check_mixed(d, args):
    """zero.train_zero with bf16 compute at stage 2 (accumulation, clipping) against zero.reference: passes
    as written, fails when any one unit's micro-batch gradient is kept local instead of reduce-scattered."""
    a = replace(args, dtype="float32", mixed_precision="bf16", stage=2, check=True, steps=4)
    ok = Z.train_zero(d, a)["check"]
    check(d, "bf16 stage 2 --check passes", ok["passed"], f"({ok})")
    n_units = a.n_layers + 1
    for target in range(n_units):
        rs = Z.Zero.reduce_grad

        # this unit's gradient is never summed over the ranks
        def dropped(self, u, g, target=target):
            if u is self.units[target]:
                # kept local; its turn taken with zeros
                u.accumulate(g.to(u.grad.dtype)[u.lo : u.lo + u.S])
                g = torch.zeros_like(g)
            rs(self, u, g)

        with mock.patch.object(Z.Zero, "reduce_grad", dropped):
            bad = Z.train_zero(d, a)["check"]
        check(
            d,
            f"bf16 --check FAILS with unit {target}'s reduce-scatter dropped",
            not bad["passed"],
            f"(param diff {bad['max_param_diff']:.1e}, loss diff {bad['max_loss_diff']:.1e})",
        )


# ----------------------------------------------------------------------------- 4. what the GPU would show
def reduction_events(d, a, data):
    """Stages 0-1, one step of `a.accum` micro-batches: the units whose reduction has been launched when
    each block starts its backward, per micro-batch. {(micro-batch, block index): set of unit indices}."""
    zero = gpt_zero(d, a)
    index, events, mb = {u: i for i, u in enumerate(zero.units)}, {}, [0]

    def record(i):  # (returns None: a backward pre-hook's return value would replace the gradients)
        events.setdefault((mb[0], i), {index[p[0]] for p in zero.pending})

    for u, i in index.items():
        if u is not zero.root:
            u.module.register_full_backward_pre_hook(lambda m, g, i=i: record(i))
    x, y = data.batch(0, a.batch_size, a.seq_len)
    rows = a.batch_size // (d.world * a.accum)
    for k in range(a.accum):
        mb[0] = k
        xm, ym = (
            x[k * rows : (k + 1) * rows].to(d.device),
            y[k * rows : (k + 1) * rows].to(d.device),
        )
        zero.backward(lm_loss(zero(xm), ym, count_tokens(y)), last=k == a.accum - 1)
    zero.step()
    return events


def check_gpu_defects(d, args):
    """Issue 21, on CPU: (2) train_step copies a step's batch to the device once, whatever --accum;
    (4) the reported peak is the training steps' (no measurement forward runs before them; the one of
    memory_savers.py is checked in its own tests); (7) stages 0-1 launch
    each unit's reduction during the last micro-batch's backward, as soon as the unit's gradient is
    complete (the later blocks' are in flight when a block starts its backward), not after backward (a
    run that defers them to the step is caught)."""
    data, L = MarkovData(args.vocab, args.seed), args.n_layers
    copies = []
    with mock.patch.object(Z, "to_device", lambda t, dev: copies.append(t) or t.to(dev)):
        zero = gpt_zero(d, replace(args, stage=1))
        x, y = data.batch(0, args.batch_size, args.seq_len)
        step_loss(zero, x, y, count_tokens(y), args.accum, lm_loss)
    check(
        d,
        f"train_step: one host-to-device copy of the batch per step (inputs, targets) at --accum {args.accum}",
        len(copies) == 2,
        f"({len(copies)} copies)",
    )
    copies.clear()
    with (
        mock.patch.object(Z, "to_device", lambda t, dev: copies.append(t) or t.to(dev)),
        mock.patch.object(Z, "train_step", per_microbatch_copies),
    ):
        step_loss(zero, x, y, count_tokens(y), args.accum, lm_loss)
    check(
        d,
        "train_step mutant (a copy per micro-batch) is caught",
        len(copies) != 2,
        f"({len(copies)} copies)",
    )

    a = replace(args, stage=3, steps=2, check=True)
    with peak_then_reference() as order:
        s = Z.train_zero(d, a)
    check(
        d,
        "the peak is read after training, before --check trains the reference (issue 31)",
        order == ["peak", "reference"],
        f"({order})",
    )
    with (
        peak_then_reference() as order,
        mock.patch.object(Z, "write_summary", peak_read_in_summary),
    ):
        Z.train_zero(d, replace(a, steps=1))
    check(
        d,
        "mutant (the peak read in write_summary's call, after --check) is caught",
        order != ["peak", "reference"],
        f"({order})",
    )
    f, m = s["figures"], s["figures"]["memory"]
    states = sum(m[k]["counted"] for k in ("params", "grads", "optim"))
    want = states + f["gathered_peak_bytes"] + f["saved_activation_bytes"]
    check(
        d,
        "the peak comes from the training steps (states + gathered peak + saved)",
        s["peak_mem_bytes"] == want,
        f"({s['peak_mem_bytes']} B, want {want} B)",
    )

    for stage in (1, 2):
        a = replace(args, stage=stage)
        ok, ev = publish_deferred(d, a, data)
        check(
            d,
            f"stage {stage}: the all-gather of the update is waited for at each unit's next forward",
            ok,
            f"{ev}",
        )
        with mock.patch.object(Z.Zero, "publish", publish_and_wait):
            ok, ev = publish_deferred(d, a, data)
        check(
            d,
            f"stage {stage} mutant (publish waits for its all-gathers) is caught",
            not ok,
            f"{ev}",
        )
    for stage in (0, 1):
        a = replace(args, stage=stage)
        ev = reduction_events(d, a, data)
        early = all(ev[k, i] == set() for k in range(a.accum - 1) for i in range(L))
        last = all(ev[a.accum - 1, i] == set(range(i + 1, L)) for i in range(L))
        check(
            d,
            f"stage {stage}: each unit's reduction launched during the last backward, none before",
            early and last,
            f"{ev}",
        )
        backward = Z.Zero.backward
        with mock.patch.object(
            Z.Zero, "backward", lambda self, loss, last=True: backward(self, loss, last=False)
        ):
            ev = reduction_events(d, a, data)
        check(
            d,
            f"stage {stage} mutant (reductions deferred to the step) is caught",
            any(ev[a.accum - 1, i] != set(range(i + 1, L)) for i in range(L - 1)),
            f"{ev}",
        )


@contextlib.contextmanager
def peak_then_reference():
    """The order zero.train_zero reads the peak memory and trains --check's reference in, observed."""
    order, peak, check_run = [], Z.peak_memory_bytes, Z.check_run
    with (
        mock.patch.object(Z, "peak_memory_bytes", lambda *a: order.append("peak") or peak(*a)),
        mock.patch.object(Z, "check_run", lambda *a: order.append("reference") or check_run(*a)),
    ):
        yield order


def peak_read_in_summary(d, args, name, losses, ms, tok_s, top, *rest):
    """zero.train_zero's tail as before issue 31: the peak (on a GPU, CUDA's) read in the write_summary call."""
    return WRITE_SUMMARY(d, args, name, losses, ms, tok_s, Z.peak_memory_bytes(d, top), *rest)


WRITE_SUMMARY = Z.write_summary


def per_microbatch_copies(zero, x, y, n_tok, accum, loss_fn):
    """A broken train_step that copies each micro-batch to the device on its own (issue 21's defect)."""
    rows = x.shape[0] // zero.world
    x, y = (t[zero.rank * rows : (zero.rank + 1) * rows] for t in (x, y))
    local = torch.zeros((), dtype=torch.float64, device=zero.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        loss = loss_fn(zero(Z.to_device(xm, zero.device)), Z.to_device(ym, zero.device), n_tok)
        zero.backward(loss, last=i == accum - 1)
        local += loss.detach()
    return local, zero.step()


def publish_deferred(d, a, data):
    """Stages 1-2, after one step: the units whose publishing all-gather has not been waited for yet when
    each block starts its next forward. True when that is every later unit (each is waited for just
    before its own forward), and nothing is left after the forward."""
    zero = gpt_zero(d, a)
    x, y = data.batch(0, a.batch_size, a.seq_len)
    step_loss(zero, x, y, count_tokens(y), a.accum, lm_loss)
    index, ev = {u: i for i, u in enumerate(zero.units)}, {}

    def record(i):  # (returns None: a pre-hook's return value would replace the inputs)
        ev.setdefault(i, {index[v] for v in zero.publishing})

    for u, i in index.items():
        if u is not zero.root:
            u.module.register_forward_pre_hook(lambda m, args, i=i: record(i))
    zero(x[:2].to(d.device))
    L = len(zero.units) - 1
    return all(ev[i] == set(range(i + 1, L)) for i in range(L)) and not zero.publishing, ev


PUBLISH = Z.Zero.publish


def publish_and_wait(self):
    """A publish that waits for its all-gathers at once, as before issue 21."""
    PUBLISH(self)
    self.wait_published()


class InfGrad(torch.autograd.Function):
    """The identity forward; backward makes the gradient infinite (an fp16 overflow, on purpose)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def inject_overflow(step, rank):
    """fp16: an inf in one rank's gradient shard at `step`, after the reduction, so that only the norm's
    all-reduce carries it to the other ranks; the one-process reference (zero.reference) gets an
    infinite gradient at the same step, through the loss of that step's first micro-batch."""
    norm, reference = Z.Zero.global_norm, Z.reference
    calls = []

    def global_norm(self, grads):
        if len(calls) == step and self.rank == rank:  # the first real element of this rank's slice
            u, g = next((u, g) for u, g in zip(self.units, grads) if u.numel > u.lo)
            g[u.lo if self.stage == 0 else 0] = float("inf")
        calls.append(step)
        return norm(self, grads)

    def reference_with_inf(args, world, device="cpu"):
        n, loss = [], Z.lm_loss

        def lm_loss_inf(logits, targets, n_tokens):
            n.append(1)
            first = (len(n) - 1) % (world * args.accum) == 0 and (len(n) - 1) // (
                world * args.accum
            ) == step
            return (
                InfGrad.apply(loss(logits, targets, n_tokens))
                if first
                else loss(logits, targets, n_tokens)
            )

        with mock.patch.object(Z, "lm_loss", lm_loss_inf):
            return reference(args, world, device)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(Z.Zero, "global_norm", global_norm))
    stack.enter_context(mock.patch.object(Z, "reference", reference_with_inf))
    return stack


def check_fp16_overflow(d, args):
    """--mixed-precision fp16 at stage 2 with an overflow injected into the last rank's gradient at step 2:
    every rank skips that step (the all-reduced norm makes rank 0 skip it too), AdamW runs 4 of 5 steps,
    the loss scale grows after 2 clean steps, halves on the overflow and grows again, the losses stay finite
    and training, and --check (the same recipe, the skip included, in one process) passes."""
    a = replace(
        args,
        dtype="float32",
        mixed_precision="fp16",
        stage=2,
        accum=1,
        clip=1.0,
        lr=3e-3,
        steps=5,
        loss_scale=1024,
        scale_window=2,
        check=True,
    )
    with inject_overflow(step=2, rank=d.world - 1):
        s = Z.train_zero(d, a)
    f = s["figures"]
    check(
        d,
        "fp16: the overflow of one rank skipped on every rank",
        [r["skipped"] for r in f["per_rank"]] == [[2]] * d.world,
        f"{f['per_rank']}",
    )
    check(
        d,
        "fp16: AdamW ran 4 of 5 steps on every rank",
        [r["adam_step"] for r in f["per_rank"]] == [4.0] * d.world,
    )
    check(
        d,
        "fp16: loss scale grows after 2 clean steps, halves on the overflow",
        f["loss_scale"] == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0],
        f"{f['loss_scale']}",
    )
    check(
        d,
        "fp16: losses finite and training",
        all(l == l and l < 3.6 for l in s["losses"]),
        f"{s['losses']}",
    )
    check(
        d,
        "fp16: --check (the same recipe and skip in one process) passes",
        s["check"]["passed"],
        f"{s['check']}",
    )


def main():
    d = init_dist(60)
    base = Z.Args(
        vocab=32,
        seq_len=8,
        d_model=16,
        n_heads=2,
        n_layers=3,
        batch_size=12,
        steps=3,
        dtype="float64",
        accum=2,
        clip=0.5,
        lr=1e-2,
    )
    check_awkward(d, base)
    check_node_local_ckpt(d, base)
    check_gpt(d, base)
    check_mixed(d, base)
    check_gpu_defects(d, base)
    check_fp16_overflow(d, base)
    bad = torch.tensor([float(len(FAILED))], device=d.device)
    dist.all_reduce(bad)
    d.log("ALL CHECKS PASSED" if bad.item() == 0 else f"FAILED: {FAILED}")
    close_dist(ok=bad.item() == 0)


if __name__ == "__main__":
    main()
