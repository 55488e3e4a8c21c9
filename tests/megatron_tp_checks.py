"""Layer-level checks of megatron_tp.py, all in one process group (t = world size), float64.

    torchrun --nproc_per_node=2 tests/megatron_tp_checks.py      (and 4; copy-out at t = 2, and t = 3 in 4)
    torchrun ... tests/megatron_tp_checks.py --forget-tp-rng ARGS  megatron_tp.py ARGS with a broken resume

Each sharded layer is built from an unsharded one, fed the same input, and its output, input gradient and
weight gradients must equal the unsharded layer's (weight gradients: this rank's slice). Independent
references: the plain torch modules of common.py, F.cross_entropy, torch's own DTensor tensor parallel
(ColwiseParallel / RowwiseParallel) for the MLP, and closed forms computed here (collective counts and
bytes, as harness.CommCounter sees them at the dispatcher; a gradient norm). Negative checks show that what
must differ, differs, and that the checks catch the defects they guard against (put back on purpose by
monkeypatching): each of the four conjugate operators broken, the column layer saving the gathered input,
the q/k/v biases dropped, the padding mask dropped, a bfloat16 norm summed in bfloat16, a flat
(non-re-entrant) RNG fork, SPGPT's forward without its fork, the default ignore index where another is given.

copy_out() is the check to copy for your own trainer: megatron_tp.py's technique section, run alone as a
copier takes it (tests/section.py), applied to a model that is not the GPT, trained beside the unsharded
model in one process, every step's loss and every final parameter compared. Every module and tensor lives on d.device, so the same checks run on NCCL. Prints ALL CHECKS
PASSED and exits 0, else lists failures and exits 1.
"""

import contextlib
import copy
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from einops import rearrange  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import megatron_tp as mt  # noqa: E402
import section  # noqa: E402  (tests/section.py: a file's technique section alone)
from common import IGNORE, MLP, Attention, Block, GPTConfig, build_gpt, close_dist, init_dist  # noqa: E402
from harness import CommCounter, SavedActivations  # noqa: E402

TOL = 1e-12
failures, passed = [], []


def close(name, got, want, tol=TOL):
    diff = (
        (got.detach() - want.detach()).abs().max().item()
        if got.shape == want.shape
        else float("inf")
    )
    (passed if diff <= tol else failures).append(f"{name}: max diff {diff:.2e}")


def differs(name, a, b, at_least=1e-6):
    """A negative check: these two MUST differ (else the positive checks could not fail)."""
    diff = (a.detach() - b.detach()).abs().max().item() if a.shape == b.shape else float("inf")
    (passed if diff >= at_least else failures).append(f"{name} (must differ): max diff {diff:.2e}")


def counts(name, comm, want, handed=None):
    """Collective calls per key (and, given `handed`, the bytes handed to them) against values from here."""
    (passed if comm.calls == want else failures).append(
        f"{name}: counted {comm.calls}, theory {want}"
    )
    if handed is not None:
        (passed if comm.bytes == handed else failures).append(
            f"{name}: bytes handed {comm.bytes}, from the shapes {handed}"
        )


def equal(name, got, want):
    (passed if got == want else failures).append(f"{name}: {got} vs {want}")


# ----------------------------------------------------------------------------- test-only operators
class GatherLastDim(torch.autograd.Function):
    """A column layer's output gathered (Megatron's gather_output=True): all-gather the feature shards;
    backward keeps this rank's own."""

    @staticmethod
    def forward(ctx, x, group):  # (.., n/t) -> (.., n)
        ctx.group = group
        return mt.all_gather(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(dist.get_world_size(ctx.group), -1)[
            dist.get_rank(ctx.group)
        ].contiguous(), None


class SplitLastDim(torch.autograd.Function):
    """A row layer fed a replicated X (Megatron's input_is_parallel=False): keep this rank's feature slice;
    backward all-gathers."""

    @staticmethod
    def forward(ctx, x, group):  # (.., n) replicated -> (.., n/t)
        ctx.group = group
        return x.chunk(dist.get_world_size(group), -1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return mt.all_gather(grad, -1, ctx.group), None


LAYERS = {  # sp: False (TP), True (TP + SP), "ring" (TP + SP, --overlap's ring steps)
    False: (mt.ColumnParallelLinear, mt.RowParallelLinear),
    True: (mt.SPColumnParallelLinear, mt.SPRowParallelLinear),
    "ring": (mt.RingColumnParallelLinear, mt.RingRowParallelLinear),
}


def build_layer(Layer, full, group, sp, tracker):
    """mt.ParallelAttention or mt.ParallelMLP from `full`, with the TP layers, or the SP ones as mt.SPGPT builds,
    or the ring ones as mt.RingGPT builds."""
    layers = LAYERS[sp]
    return (
        Layer(full, group, tracker, *layers)
        if Layer is mt.ParallelAttention
        else Layer(full, group, *layers)
    )


def parallel_block(block, group, sp, tracker):
    """mt.ParallelGPT's (sp: mt.SPGPT's) treatment of one common.Block, on a copy: attention and MLP replaced."""
    block = copy.deepcopy(block)
    block.attn = build_layer(mt.ParallelAttention, block.attn, group, sp, tracker)
    block.mlp = build_layer(mt.ParallelMLP, block.mlp, group, sp, tracker)
    return block


# ----------------------------------------------------------------------------- the core, copied out
class SwiGLUNet(nn.Module):
    """Not the GPT: a parameter on the root module, nested modules, odd sizes (7 in, 5 hidden per rank, 3
    out), a gated MLP (SwiGLU, as in Llama) whose gate and up projections read the same input, each with or
    without a bias (mixed biases in one fused layer)."""

    def __init__(self, t=2, gate_bias=True, up_bias=True):
        super().__init__()
        self.gain = nn.Parameter(torch.tensor(0.5))
        self.stem = nn.Linear(7, 6)
        self.mlp = nn.ModuleDict(
            dict(
                gate=nn.Linear(6, 5 * t, bias=gate_bias),
                up=nn.Linear(6, 5 * t, bias=up_bias),
                down=nn.Linear(5 * t, 6),
            )
        )
        self.head = nn.Linear(6, 3, bias=False)

    def forward(self, x):  # (N, T, 7) -> (N, T, 3)
        h = torch.tanh(self.stem(x))
        return self.head(h + self.gain * self.mlp.down(F.silu(self.mlp.gate(h)) * self.mlp.up(h)))


class TPSwiGLUNet(nn.Module):
    """SwiGLUNet with its MLP tensor-parallel, built from megatron_tp.py's technique section alone (`S`, as a
    copier takes it): gate and up one column-parallel layer (one GEMM), down row-parallel; the rest replicated.
    Under SP (the section's SP layers), x is this rank's T/t positions."""

    def __init__(self, S, net, group, sp):
        super().__init__()
        self.gain, self.stem, self.head = (copy.deepcopy(m) for m in (net.gain, net.stem, net.head))
        prefix = {False: "", True: "SP", "ring": "Ring"}[sp]
        self.gate_up = S[f"{prefix}ColumnParallelLinear"]([net.mlp.gate, net.mlp.up], group)
        self.down = S[f"{prefix}RowParallelLinear"](net.mlp.down, group)

    def forward(self, x):  # (N, T, 7), or (N, T/t, 7)
        h = torch.tanh(self.stem(x))
        gate, up = self.gate_up(h).chunk(2, -1)  # each (N, T, 5): this rank's hidden features
        return self.head(h + self.gain * self.down(F.silu(gate) * up))


def unsharded(S, tp, group, net):
    """The trained TPSwiGLUNet's parameters under SwiGLUNet's names: split ones all-gathered, the fused
    gate_up (rank-major [gate_0; up_0; gate_1; up_1; ...]) split back into gate and up. The bias part of a
    linear that `net` built without one is returned apart, under its name: it must still be zero."""
    t, out, absent = dist.get_world_size(group), {}, {}
    for kind in ("weight", "bias"):
        # None: the layer dropped every bias (the old defect): count zeros
        mine = getattr(tp.gate_up, kind)
        mine = (
            tp.gate_up.weight.new_zeros(len(tp.gate_up.weight)) if mine is None else mine.detach()
        )
        both = S["all_gather"](mine, 0, group)
        for part, w in zip(("gate", "up"), rearrange(both, "(t n o) ... -> n (t o) ...", t=t, n=2)):
            has = getattr(net.mlp[part], kind) is not None
            (out if has else absent)[f"mlp.{part}.{kind}"] = w
    out["mlp.down.weight"] = S["all_gather"](tp.down.weight.detach(), 1, group)
    out["mlp.down.bias"] = tp.down.bias.detach()
    replicated = ("gain", "stem", "head")
    out.update({n: p.detach() for n, p in tp.named_parameters() if n.split(".")[0] in replicated})
    return out, absent


RING_MUTANTS = {  # a ring step's chunk index off by one, in each of the two fused operations
    "gather_gemm's chunk index off by one": (
        "out[(r + s) % t] = gemm((r + s) % t, x_c)",
        "out[(r + s + 1) % t] = gemm((r + s + 1) % t, x_c)",
    ),
    "gemm_scatter's chunk index off by one": (
        "lambda s, _: gemm((r + s + 2) % t)",
        "lambda s, _: gemm((r + s + 1) % t)",
    ),
}


def ring_mutant(what):
    """megatron_tp.py's technique section with one ring step's chunk index off by one (tests/section.py)."""
    old, new = RING_MUTANTS[what]
    text = open(os.path.join(ROOT, "megatron_tp.py")).read()
    assert text.count(old) == 1, old
    return section.load("megatron_tp.py", text.replace(old, new))


def copy_out(d, group, gate_bias=True, up_bias=True, mutants=True, steps=5, clip=0.05):
    """TPSwiGLUNet against SwiGLUNet trained in plain torch, one process's way: AdamW, clipping by the
    global norm (torch.nn.utils.clip_grad_norm_), a Huber loss summed over tokens / all tokens. Every core
    comes from megatron_tp.py's technique section run alone (section.load: torch and einops, nothing of
    common.py, harness.py or the rest of the file). Under SP each rank holds T/t positions: the replicated
    parameters' gradients are then partial and are summed over the group (the section's sum_replicated_grads).
    With sum_replicated=False that sum is skipped, on purpose: the check must fail. With mixed biases (one of
    gate, up without), the fused layer's mask dropped on purpose must fail too: the bias-free part would then
    train. mutants=False: the exact runs only. `group` may hold other global ranks than its group ranks."""
    S = section.load("megatron_tp.py")
    t, r, dev = dist.get_world_size(group), dist.get_rank(group), d.device
    torch.manual_seed(99)  # the same model and data on every rank
    net = SwiGLUNet(t, gate_bias, up_bias).to(dev)
    batches = [
        (torch.randn(3, 6, 7, device=dev), torch.randn(3, 6, 3, device=dev)) for _ in range(steps)
    ]
    ref = copy.deepcopy(net)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.02, foreach=False)
    ref_losses = []
    for x, y in batches:
        loss = F.smooth_l1_loss(ref(x), y, reduction="sum") / y[..., 0].numel()
        ref_opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_opt.step()
        ref_losses.append(loss.detach())
    mixed = gate_bias != up_bias
    broken = [(True, False, True) if not mixed else (False, True, False)] if mutants else []
    rings = [("ring", True, True, None)]  # --overlap's layers; then each ring mutant
    if mutants and t > 1:
        rings += [("ring", True, True, what) for what in RING_MUTANTS]
    layouts = [(False, True, True, None), (True, True, True, None), *rings]
    for sp, sum_replicated, masked, mutant in layouts + [(*b, None) for b in broken]:
        tp = TPSwiGLUNet(ring_mutant(mutant) if mutant else S, net, group, sp)
        if not masked:  # the defect, put back: the bias-free part's zeros train like a bias
            tp.gate_up.bias_mask = None
        opt = torch.optim.AdamW(tp.parameters(), lr=0.02, foreach=False)
        losses = []
        for x, y in batches:
            if sp:  # this rank's positions of every sequence: (N, T/t, ..)
                x, y = x.chunk(t, 1)[r], y.chunk(t, 1)[r]
            loss = F.smooth_l1_loss(tp(x), y, reduction="sum") / (
                y[..., 0].numel() * (t if sp else 1)
            )
            opt.zero_grad()
            loss.backward()
            if sp and sum_replicated:
                S["sum_replicated_grads"](tp, group)
            norm = S["global_grad_norm"](tp, group)
            for p in tp.parameters():
                p.grad.mul_(torch.clamp(clip / (norm + 1e-6), max=1.0))  # clip_grad_norm_'s rule
            opt.step()
            losses.append(S["all_reduce"](loss.detach().clone(), group) if sp else loss.detach())
        trained, absent = unsharded(S, tp, group, net)
        assert trained.keys() == dict(ref.named_parameters()).keys(), trained.keys()
        got = torch.cat(
            [
                torch.stack(losses),
                *(trained[n].flatten() for n, _ in ref.named_parameters()),
                *(w.flatten() for w in absent.values()),
            ]
        )  # a missing bias: zeros, still
        want = torch.cat(
            [
                torch.stack(ref_losses),
                *(p.detach().flatten() for p in ref.parameters()),
                *(torch.zeros_like(w).flatten() for w in absent.values()),
            ]
        )
        layout = {False: "", True: ", SP", "ring": ", SP overlapped (ring)"}[sp]
        tag = (
            f"copy-out: SwiGLU net at t = {t}{layout}, biases gate {gate_bias} up {up_bias}, "
            "losses and trained weights vs plain torch"
        )
        if mutant:
            differs(f"{tag}, mutant: {mutant}", got, want)
            if r == 0 and (got - want).abs().max().item() >= 1e-6:
                print(f"copy-out mutant caught: {mutant} (t = {t})", flush=True)
        elif not sum_replicated:
            differs(f"{tag}, the replicated gradients not summed", got, want)
        elif not masked:
            differs(f"{tag}, the bias-free part not masked", got, want)
        else:
            close(tag, got, want)
            if r == 0:  # group rank 0, which need not be global rank 0
                print(f"{tag}: max diff {(got - want).abs().max().item():.1e}", flush=True)


# ----------------------------------------------------------------------------- the overlap, slowed on purpose
class SlowedRing(TorchDispatchMode):
    """diloco_checks.py's method for a ring: every batch_isend_irecv exchange is made to complete `delay` s after
    its launch (a slow link), and the order of what happens is recorded, which load cannot move: ("launch", k)
    as exchange k is handed over, ("gemm",) for every matrix product at the dispatcher, ("wait", k) as the host
    waits for it. Per exchange: the time the host blocked in wait(), the exposed communication, of the link's
    `delay`."""

    GEMMS = {"mm", "addmm", "bmm", "baddbmm"}

    def __init__(self, delay):
        super().__init__()
        self.delay = delay
        self.events = []
        self.blocked = []
        self.real = dist.batch_isend_irecv

    def __enter__(self):
        dist.batch_isend_irecv = self.launch
        return super().__enter__()

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self.real
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.GEMMS:
            self.events.append(("gemm",))
        return func(*args, **(kwargs or {}))

    def launch(self, ops):
        k = len(self.blocked)
        start = time.perf_counter()
        self.events.append(("launch", k))
        self.blocked.append(0.0)
        works = self.real(ops)
        return [self.Work(self, k, w, start) for w in works]

    class Work:
        def __init__(self, ring, k, work, start):
            self.ring = ring
            self.k = k
            self.work = work
            self.start = start

        def wait(self):
            t0 = time.perf_counter()
            self.ring.events.append(("wait", self.k))
            self.work.wait()
            time.sleep(max(0.0, self.start + self.ring.delay - time.perf_counter()))
            t1 = time.perf_counter()
            self.ring.blocked[self.k] += t1 - t0
            return True

    def gemms_in_flight(self):
        """For each exchange: the matrix products between its launch and the host's first wait for it."""
        at = {}
        for i, e in enumerate(self.events):
            if e[0] in ("launch", "wait"):
                at.setdefault(e, i)
        return [
            sum(e == ("gemm",) for e in self.events[at["launch", k] : at["wait", k]])
            for k in range(len(self.blocked))
        ]


def slowed_overlap(d, group, delay=0.02):
    """--overlap's ring MLP (column, GeLU, row: 2 rings forward, 3 backward), each exchange slowed to `delay` s:
    every exchange has a GEMM running between its launch and its wait (by the recorded order); the ring with
    the wait put before the GEMM (the mutant) has none. Exposed vs total communication printed, not asserted."""
    t = dist.get_world_size(group)
    torch.manual_seed(5)
    ref = MLP(GPTConfig(vocab=12, seq_len=64 * t, d_model=192, n_heads=4, n_layers=1)).to(d.device)
    x = torch.randn(4, 64, 192, device=d.device)  # (B, T/t, D): this rank's chunk
    text = open(os.path.join(ROOT, "megatron_tp.py")).read()
    overlapped = "        partial = work(s, carry)  # the GEMM, while `carry` travels\n"
    waits = "        for w in works:\n            w.wait()\n"
    assert text.count(overlapped + waits) == 1
    serial = section.load("megatron_tp.py", text.replace(overlapped + waits, waits + overlapped))
    for name, S in (
        ("--overlap's ring", section.load("megatron_tp.py")),
        ("mutant: wait, then GEMM", serial),
    ):
        mlp = S["ParallelMLP"](
            ref, group, S["RingColumnParallelLinear"], S["RingRowParallelLinear"]
        )
        with SlowedRing(delay) as slow:
            mlp(x.clone().requires_grad_()).square().sum().backward()
        flying = slow.gemms_in_flight()
        exposed = 1e3 * sum(slow.blocked)
        own = 1e3 * delay * len(flying)  # the slowed link's time
        line = (
            f"{name}, each exchange slowed to {1e3 * delay:.0f} ms: GEMMs in flight per exchange {flying}; "
            f"exposed communication {exposed:.0f} ms of {own:.0f} ms (measured, reported)"
        )
        if S is serial:
            equal(f"overlap, {line}: caught", any(flying), False)
        else:
            equal(f"overlap, {line}", (len(flying), min(flying)), (5 * (t - 1), 1))
        d.log(line)


def main():
    d = init_dist()
    torch.set_default_dtype(torch.float64)
    t, r, dev = d.world, d.rank, d.device
    es = 8  # float64 bytes
    group = dist.new_group(list(range(t)))  # the TP group: the whole world here
    tracker = mt.RNGTracker(dev, 0, 0, r)
    torch.manual_seed(1234)  # the same inputs and full weights on every rank
    B, T, D, H = 2, 8, 16, 4

    def counter():
        return CommCounter(axes={"tp": group})

    def shard_of(x, dim):  # this rank's slice of a full tensor, padded like mt.shard
        n = x.shape[dim]
        if n % t:
            pad = list(x.shape)
            pad[dim] = -n % t
            x = torch.cat([x, x.new_zeros(pad)], dim)
        return x.chunk(t, dim)[r]

    # --- ColumnParallelLinear, alone and with its output gathered ---
    full = nn.Linear(D, 12).to(dev)
    x, w = torch.randn(B, T, D, device=dev, requires_grad=True), torch.randn(B, T, 12, device=dev)
    (full(x) * w).sum().backward()
    for gather in (True, False):
        col = mt.ColumnParallelLinear(full, group)
        x2 = x.detach().clone().requires_grad_()
        with counter() as comm:
            y = GatherLastDim.apply(col(x2), group) if gather else col(x2)
            want, wt = (full(x), w) if gather else (shard_of(full(x), -1), shard_of(w, -1))
            (y * wt).sum().backward()
        close(f"column(gathered={gather}) output", y, want)
        close(f"column(gathered={gather}) input grad", x2.grad, x.grad)
        close(
            f"column(gathered={gather}) weight grad", col.weight.grad, shard_of(full.weight.grad, 0)
        )
        close(f"column(gathered={gather}) bias grad", col.bias.grad, shard_of(full.bias.grad, 0))
        counts(
            f"column(gathered={gather}) collectives",
            comm,
            {"all_reduce/tp/bwd": 1, **({"all_gather/tp/fwd": 1} if gather else {})},
            {
                "all_reduce/tp/bwd": B * T * D * es,
                **({"all_gather/tp/fwd": B * T * 12 // t * es} if gather else {}),
            },
        )

    # --- RowParallelLinear, input already parallel or split here from a replicated X ---
    full = nn.Linear(12, D).to(dev)
    x, w = torch.randn(B, T, 12, device=dev, requires_grad=True), torch.randn(B, T, D, device=dev)
    (full(x) * w).sum().backward()
    for parallel in (False, True):
        row = mt.RowParallelLinear(full, group)
        x2 = (shard_of(x, -1) if parallel else x).detach().clone().requires_grad_()
        y = row(x2 if parallel else SplitLastDim.apply(x2, group))
        close(f"row(input parallel={parallel}) output", y, full(x))
        (y * w).sum().backward()
        close(
            f"row(input parallel={parallel}) input grad",
            x2.grad,
            shard_of(x.grad, -1) if parallel else x.grad,
        )
        close(
            f"row(input parallel={parallel}) weight grad",
            row.weight.grad,
            shard_of(full.weight.grad, 1),
        )
        close(f"row(input parallel={parallel}) bias grad", row.bias.grad, full.bias.grad)
    differs(
        "row partial product before g vs full output",
        F.linear(shard_of(x, -1), row.weight) + row.bias,
        full(x),
    )

    # --- MLP and attention, plain and sequence parallel; then each conjugate operator broken ---
    cfg = GPTConfig(vocab=12, seq_len=T, d_model=D, n_heads=H, n_layers=1, dropout=0.0)

    # output, input grad, {name: gradient}, the counter of its collectives
    def run_layer(par, x, w, sp):
        # (B, T/t, D) chunk under SP
        x2 = (shard_of(x, 1) if sp else x).detach().clone().requires_grad_()
        with counter() as comm:
            y = par(x2)
            (y * (shard_of(w, 1) if sp else w)).sum().backward()
        grads = {}
        for n, p in par.named_parameters():
            if p.grad is None:  # a parameter the forward never used
                failures.append(f"{n}: no gradient")
                continue
            grads[n] = p.grad.clone()
            if sp and not hasattr(p, "tp_dim"):  # a replicated bias saw only this rank's positions
                mt.all_reduce(grads[n], group)
        return y, x2.grad, grads, comm

    # the unsharded output, input grad and this rank's slice of its grads
    def expected(par, ref, x, w, sp):
        ref.zero_grad()
        x = x.detach().clone().requires_grad_()
        y = ref(x)
        (y * w).sum().backward()
        full, grads = {n: p.grad for n, p in ref.named_parameters()}, {}
        for n, p in par.named_parameters():
            if n.startswith("qkv."):  # one fused column layer: rank r holds [q_r; k_r; v_r]
                grads[n] = torch.cat([shard_of(full[f"{c}.{n[4:]}"], 0) for c in "qkv"])
            else:
                grads[n] = shard_of(full[n], p.tp_dim) if hasattr(p, "tp_dim") else full[n]
        return (shard_of(y, 1) if sp else y), (shard_of(x.grad, 1) if sp else x.grad), grads

    def mine(x):  # this rank's T/t positions of a (B, T, D) partial sum, without the sum
        return x.chunk(t, 1)[r].clone()

    def f_no_all_reduce(ctx, grad):
        return grad, None

    def g_no_all_reduce(ctx, x, group):
        return x.clone()

    def f_sp_no_reduce_scatter(gemm, group, overlap):  # GatherGEMM's dL/dX: SP's path, not summed
        return mine(gemm(0))

    def g_sp_no_reduce_scatter(ctx, x, group):
        ctx.group = group
        return mine(x)

    breaks = {  # each operator broken on purpose: its collective dropped
        "f without its backward all-reduce": (mt.f, "backward", f_no_all_reduce),
        "g without its forward all-reduce": (mt.g, "forward", g_no_all_reduce),
        "f_sp without its backward reduce-scatter (GatherGEMM's dL/dX)": (
            mt,
            "gemm_scatter",
            f_sp_no_reduce_scatter,
        ),
        "g_sp without its forward reduce-scatter": (mt.g_sp, "forward", g_sp_no_reduce_scatter),
    }
    for name, Full, Par in (
        ("mlp", MLP, mt.ParallelMLP),
        ("attention", Attention, mt.ParallelAttention),
    ):
        ref = Full(cfg)
        # biased q, k, v (common.Attention has none): a dropped bias would show
        if name == "attention":
            ref.q, ref.k, ref.v = (nn.Linear(D, D) for _ in range(3))
        for p in ref.parameters():  # nonzero biases, so a bias added t times would show
            nn.init.normal_(p, 0.0, 0.3)
        ref.to(dev)
        x, w = torch.randn(B, T, D, device=dev), torch.randn(B, T, D, device=dev)
        for sp in (False, True, "ring"):
            par = build_layer(Par, ref, group, sp, tracker)
            tag = f"{name}{({False: '', True: ' (SP)', 'ring': ' (SP, ring)'})[sp]}"
            y, dx, grads, comm = run_layer(par, x, w, sp)
            want_y, want_dx, want_g = expected(par, ref, x, w, sp)
            close(f"{tag} output", y, want_y)
            close(f"{tag} input grad", dx, want_dx)
            for n in grads:
                close(f"{tag} grad {n}", grads[n], want_g[n])
            # one all-reduce per direction; under SP one AG + RS pair per direction, + the re-gather backward
            one = (
                {
                    "all_gather/tp/fwd": 1,
                    "reduce_scatter/tp/fwd": 1,
                    "reduce_scatter/tp/bwd": 1,
                    "all_gather/tp/bwd": 2,
                }
                if sp
                else {"all_reduce/tp/fwd": 1, "all_reduce/tp/bwd": 1}
            )
            # bytes of one (B, T, D) activation; an all-gather is handed 1/t of it
            bsd = B * T * D * es
            handed = (
                {
                    "all_gather/tp/fwd": bsd // t,
                    "reduce_scatter/tp/fwd": bsd,
                    "reduce_scatter/tp/bwd": bsd,
                    "all_gather/tp/bwd": 2 * bsd // t,
                }
                if sp
                else {"all_reduce/tp/fwd": bsd, "all_reduce/tp/bwd": bsd}
            )
            if sp == "ring":  # t - 1 steps per ring: fwd column + row, bwd column dW + dX, row
                steps = {"fwd": 2 * (t - 1), "bwd": 3 * (t - 1)}
                one = {f"{op}/tp/{ph}": n for ph, n in steps.items() for op in ("send", "recv")}
                handed = {
                    f"{op}/tp/{ph}": n * bsd // t * (op == "send")
                    for ph, n in steps.items()
                    for op in ("send", "recv")
                }
            counts(f"{tag} collectives", comm, one, handed)
            for what, (op, method, broken) in breaks.items():
                if sp != what.startswith(("f_sp", "g_sp")):
                    continue
                real = op.__dict__[method]
                setattr(op, method, staticmethod(broken))
                try:
                    y, dx, grads, _ = run_layer(build_layer(Par, ref, group, sp, tracker), x, w, sp)
                finally:
                    setattr(op, method, real)
                worst = max((y - want_y).abs().max(), (dx - want_dx).abs().max())
                differs(
                    f"{tag} with {what}: output or input grad vs unsharded",
                    worst[None],
                    torch.zeros(1),
                )
        # an old forward, F.linear(x, weight), dropped the q/k/v biases (par: the SP one)
        if name == "attention":

            def weights_only(self, x):
                x = mt.all_gather(x, 1, group)
                qkv = F.linear(x, self.qkv.weight)  # no bias
                q, k, v = rearrange(qkv, "b t (n h e) -> n b h t e", n=3, h=self.heads)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.proj(rearrange(y, "b h t e -> b t (h e)"))

            with torch.no_grad():
                differs(
                    "attention with q/k/v biases dropped (the old forward) vs unsharded",
                    weights_only(par, shard_of(x, 1)),
                    shard_of(ref(x), 1),
                )

    # --- the ring's fused operations vs torch's own (torch.distributed._symmetric_memory's fallbacks, which run
    # the same operations as a functional collective + one matmul on any backend; the fused CUDA kernels are
    # bench.py's) ---
    from torch.distributed import _symmetric_memory as symm

    x_full, w_col, w_row = (
        torch.randn(*shape, device=dev) for shape in ((B, T, D), (12, D), (D, 12))
    )
    mine_x = x_full.chunk(t, 1)[r].contiguous()  # (B, T/t, D)
    _, (want,) = symm._fused_all_gather_matmul_fallback(mine_x, [w_col.T], 1, group.group_name)
    for overlap in (False, True):  # SP's all-gather then GEMM, and the ring's steps
        close(
            f"{'ring ' if overlap else ''}all-gather + GEMM vs torch's _fused_all_gather_matmul",
            mt.GatherGEMM.apply(mine_x, w_col, group, overlap),
            want,
        )
    x_local = torch.randn(B, T, 12, device=dev)  # (B, T, in/t): this rank's features
    want = symm._fused_matmul_reduce_scatter_fallback(x_local, w_row.T, "sum", 1, group.group_name)
    close(
        "ring GEMM + reduce-scatter vs torch's _fused_matmul_reduce_scatter",
        mt.GEMMScatter.apply(x_local, w_row, group),
        want,
    )

    # --- activations one block saves for backward: under SP exactly 1/t of the unsharded block's ---
    def saved_by(block, x):  # contiguous: a chunk view would count the whole storage it views
        with SavedActivations() as saved:
            block(x.detach().contiguous().requires_grad_())
        return saved.bytes

    blk, x = Block(cfg).to(dev), torch.randn(B, T, D, device=dev)
    whole = saved_by(blk, x)
    tp_only = saved_by(parallel_block(blk, group, False, tracker), x)
    with_sp = saved_by(parallel_block(blk, group, True, tracker), shard_of(x, 1))
    equal("block saved bytes under SP, times t, vs the unsharded block's", with_sp * t, whole)
    with_ring = saved_by(parallel_block(blk, group, "ring", tracker), shard_of(x, 1))
    equal(
        "block saved bytes with --overlap's ring layers, times t, vs the unsharded block's",
        with_ring * t,
        whole,
    )
    equal(
        "block saved bytes with TP alone exceed 1/t (replicated LN / residual)",
        tp_only * t > whole,
        True,
    )

    # the defect, put back: F.linear on the gathered X (f_sp's output) keeps the gathered X
    def saves_gathered(self, x):
        return F.linear(mt.all_gather(x.detach(), 1, self.group), self.weight, self.bias)

    real, mt.SPColumnParallelLinear.forward = mt.SPColumnParallelLinear.forward, saves_gathered
    try:
        gathered = saved_by(parallel_block(blk, group, True, tracker), shard_of(x, 1))
    finally:
        mt.SPColumnParallelLinear.forward = real
    equal(
        "the check fails when the column layers save the gathered input",
        gathered * t != whole,
        True,
    )
    d.log(
        f"saved per block: unsharded {whole} B; TP {tp_only} B ({tp_only / whole:.3f}); TP + SP {with_sp} B "
        f"({with_sp / whole:.3f}, 1/t = {1 / t:.3f}); SP saving the gathered input {gathered} B "
        f"({gathered / whole:.3f})"
    )

    # --- torch's DTensor tensor parallel as an independent reference for the MLP ---
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        ref = MLP(cfg).to(dev)
        dt = parallelize_module(
            copy.deepcopy(ref),
            init_device_mesh(d.device.type, (t,)),
            {"fc": ColwiseParallel(), "proj": RowwiseParallel()},
        )
        par = mt.ParallelMLP(ref, group)
        x, w = torch.randn(B, T, D, device=dev), torch.randn(B, T, D, device=dev)
        xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
        ya, yb = dt(xa), par(xb)
        close("mlp vs DTensor output", yb, ya)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        close("mlp vs DTensor input grad", xb.grad, xa.grad)
        for n, p in par.named_parameters():
            g = dt.get_parameter(n).grad
            close(f"mlp vs DTensor grad {n}", p.grad, g.to_local() if hasattr(g, "to_local") else g)
    except Exception as e:  # only if torch's DTensor TP does not run on this backend
        d.log(f"DTensor reference skipped: {type(e).__name__}: {e}")

    # --- ParallelGPT built from a CPU model, then moved: the shards keep their marks (on a GPU, a new
    # Parameter from .to() would lose tp_dim, and clipping would then count a shard as replicated) ---
    gpt = mt.ParallelGPT(build_gpt(cfg, 0, torch.float64), group, tracker)
    marks = [(n, getattr(p, "tp_dim", None)) for n, p in gpt.named_parameters()]
    gpt.to(dev)
    equal(
        "split marks after .to(device)",
        [(n, getattr(p, "tp_dim", None)) for n, p in gpt.named_parameters()],
        marks,
    )
    # --- the gradient norm across shards, against its closed form; bfloat16 squares summed in float32 ---
    # 300 replicated scalars with gradient 1 and one split tensor with gradient 1 in each of its 64 elements
    equal(
        "every parameter on the device", {p.device for p in gpt.parameters()}, {torch.device(dev)}
    )
    # per rank: norm^2 = 300 + 64 t, exact in float32. Summed in bfloat16, 256 + 1 rounds back to 256.
    bf = nn.ParameterList(
        nn.Parameter(torch.zeros((), dtype=torch.bfloat16, device=dev)) for _ in range(300)
    )
    bf.append(nn.Parameter(torch.zeros(64, dtype=torch.bfloat16, device=dev)))
    bf[-1].tp_dim = 0
    for p in bf:
        p.grad = torch.ones_like(p)
    want = torch.tensor(300.0 + 64 * t).float().sqrt()  # float32, as the norm is taken
    # the defect, put back: squares summed in the gradients' own dtype
    close(
        "bfloat16 gradient norm vs sqrt(300 + 64 t)", mt.global_grad_norm(bf, group).cpu(), want, 0
    )

    def bf16_sum(model, tp_group):
        params = list(model.parameters())
        split = mt.all_reduce(
            sum(p.grad.pow(2).sum() for p in params if hasattr(p, "tp_dim")), tp_group
        )
        return (split + sum(p.grad.pow(2).sum() for p in params if not hasattr(p, "tp_dim"))).sqrt()

    differs(
        "bfloat16 gradient norm summed in bfloat16 vs sqrt(300 + 64 t)",
        bf16_sum(bf, group).float().cpu(),
        want,
        0.5,
    )

    # --- VocabParallelEmbedding: unpadded and padded vocabularies ---
    for V in (12, 11, 9):
        full = nn.Embedding(V, D).to(dev)
        idx = torch.randint(0, V, (B, T), device=dev)
        w = torch.randn(B, T, D, device=dev)
        (full(idx) * w).sum().backward()
        for sp in (False, True):
            emb = (mt.SPVocabParallelEmbedding if sp else mt.VocabParallelEmbedding)(full, group)
            y = emb(idx)
            tag = f"embedding V={V} (pad {-V % t}){' SP' if sp else ''}"
            close(f"{tag} output", y, shard_of(full(idx), 1) if sp else full(idx))
            (y * (shard_of(w, 1) if sp else w)).sum().backward()
            close(f"{tag} weight grad", emb.weight.grad, shard_of(full.weight.grad, 0))

    # --- vocab-parallel cross-entropy vs F.cross_entropy, with ignored targets: IGNORE (-100, the default), and
    # at V = 11 class 3 passed as ignore_index (the section takes it as an argument, not from common.py) ---
    N = 24
    for V in (12, 11, 9):
        logits = torch.randn(N, V, device=dev, requires_grad=True) * 3
        target = torch.randint(0, V, (N,), device=dev)
        ignore, extra = (3, (3,)) if V == 11 else (IGNORE, ())
        target[::5] = ignore
        want = F.cross_entropy(logits, target, ignore_index=ignore, reduction="none")
        gw = torch.randn(N, device=dev)
        (grad_full,) = torch.autograd.grad((want * gw).sum(), logits)
        V_pad = V + (-V % t)
        # big logits in the padding
        junk = torch.cat([logits.detach(), torch.full((N, V_pad - V), 50.0, device=dev)], 1)
        local = junk.chunk(t, 1)[r].clone().requires_grad_()
        got = mt.VocabParallelCrossEntropy.apply(local, target, V, group, *extra)
        tag = f"cross-entropy V={V} (pad {V_pad - V}, ignore {ignore})"
        close(f"{tag} loss", got, want)
        (got * gw).sum().backward()
        close(f"{tag} logits grad", local.grad, shard_of(grad_full, 1))
        # the padding is predictable if the mask is dropped: it must be what the mask does
        if V_pad > V:
            unmasked = mt.VocabParallelCrossEntropy.apply(local, target, V_pad, group, *extra)
            differs(f"{tag} loss without the padding mask", unmasked, want)
        # the argument must be what ignores class 3: the default (-100) counts those targets
        if extra:
            default = mt.VocabParallelCrossEntropy.apply(local, target, V, group)
            differs(f"{tag} loss with the default ignore index", default, want)

    # --- dropout masks: TP regions differ across TP ranks, replicated regions agree, replicas differ ---
    for dp in (1, 2):  # t = world as one TP group, and the grid (2, t/2): two replicas
        tp = t // dp
        dp_rank, tp_rank = divmod(r, tp)
        tr = mt.RNGTracker(dev, 0, dp_rank, tp_rank)
        rep = F.dropout(torch.ones(512, device=dev), 0.5) != 0
        with tr.fork():
            inside = F.dropout(torch.ones(512, device=dev), 0.5) != 0
        masks = torch.stack([rep, inside]).to(torch.float64)
        everyone = mt.all_gather(masks[None], 0, group)  # (t, 2, 512)
        for other in range(t):
            if other == r:
                continue
            o_dp, o_tp = divmod(other, tp)
            tag = f"dropout dp={dp} tp={tp}: rank {r} vs {other}"
            if o_dp == dp_rank:
                close(f"{tag} replicated-region mask (same replica)", everyone[other, 0], masks[0])
                differs(f"{tag} TP-region mask (other TP rank)", everyone[other, 1], masks[1])
            else:
                differs(
                    f"{tag} replicated-region mask (other replica)", everyone[other, 0], masks[0]
                )
                differs(f"{tag} TP-region mask (other replica)", everyone[other, 1], masks[1])
    # and inside a module: with dropout, a TP MLP's output is still replicated (its dropout is outside the TP
    # region, on the default stream); its attention's probability dropout uses the TP stream
    cfg_p = GPTConfig(vocab=12, seq_len=T, d_model=D, n_heads=H, n_layers=1, dropout=0.5)
    tracker = mt.RNGTracker(dev, 0, 0, r)
    for name, Full, Par in (
        ("mlp", MLP, mt.ParallelMLP),
        ("attention", Attention, mt.ParallelAttention),
    ):
        par = build_layer(Par, Full(cfg_p).to(dev), group, False, tracker).train()
        x_p = torch.randn(B, T, D, device=dev)
        y = par(x_p)
        ys = mt.all_gather(y.detach()[None], 0, group)
        close(
            f"{name} with dropout: output identical on every TP rank",
            ys.max(0).values,
            ys.min(0).values,
        )
        differs(f"{name} with dropout vs without", y, par.eval()(x_p))

    # the fork is re-entrant (SPGPT runs its whole forward forked, and attention forks inside it): a nested fork
    # continues the per-rank stream and leaves the default one as it was; a flat fork (put back) restarts it
    # 64 draws in a fork, 64 in a nested one, then 64 from the default stream
    def draws(tr, nested):
        with tr.fork():
            a = torch.rand(64, device=dev)
            with tr.fork() if nested else contextlib.nullcontext():
                b = torch.rand(64, device=dev)
        return torch.cat([a, b, torch.rand(64, device=dev)])

    @contextlib.contextmanager
    def flat_fork(self):
        outside = self.gen.get_state()
        self.gen.set_state(self.tp_state)
        try:
            yield
        finally:
            self.tp_state = self.gen.get_state()
            self.gen.set_state(outside)

    one_fork = draws(mt.RNGTracker(dev, 0, 0, r), nested=False)
    close(
        "a fork inside a fork vs one fork: the same draws",
        draws(mt.RNGTracker(dev, 0, 0, r), nested=True),
        one_fork,
    )
    real, mt.RNGTracker.fork = mt.RNGTracker.fork, flat_fork
    try:
        differs(
            "a flat fork inside a fork vs one fork",
            draws(mt.RNGTracker(dev, 0, 0, r), nested=True),
            one_fork,
        )
    finally:
        mt.RNGTracker.fork = real
    # under SP no region is replicated: SPGPT's dropouts all draw from the per-rank stream, none from the default
    # one; ParallelGPT's forward run on the same model without SPGPT's fork (the defect) draws from the default
    tr = mt.RNGTracker(dev, 0, 0, r)
    sp_gpt = mt.SPGPT(build_gpt(cfg_p, 0, torch.float64), group, tr).to(dev).train()

    # (default stream advanced, per-rank stream advanced) by one forward
    def streams_drawn(
        forward,
    ):
        default, mine = tr.gen.get_state(), tr.tp_state
        forward(torch.zeros(B, T, dtype=torch.long, device=dev))
        return not torch.equal(tr.gen.get_state(), default), not torch.equal(tr.tp_state, mine)

    equal(
        "SPGPT with dropout: (default stream advanced, per-rank stream advanced)",
        streams_drawn(sp_gpt),
        (False, True),
    )
    equal(
        "SPGPT with dropout, its forward without the fork (ParallelGPT.forward): the default stream advanced",
        streams_drawn(lambda idx: mt.ParallelGPT.forward(sp_gpt, idx))[0],
        True,
    )

    # --- each layer given a size it cannot split: a ValueError naming what would work, before any collective
    # (SP's T, cut across ranks, would abort inside gloo; heads or a vocabulary cut wrongly, silently wrong) ---
    n = t + 1  # divisible by no t > 1
    bad = {
        "fused column layer, parts of t + 1 features": (
            lambda: mt.ColumnParallelLinear([nn.Linear(D, n), nn.Linear(D, n)], group),
            [f"divisible by {t}"],
        ),
        "attention with t + 1 heads": (
            lambda: mt.ParallelAttention(
                Attention(GPTConfig(vocab=12, seq_len=T, d_model=2 * n, n_heads=n, n_layers=1)),
                group,
                tracker,
            ),
            [f"n_heads {n}", f"divisible by the TP degree {t}"],
        ),
        "row layer under SP, T = t + 1 positions": (
            lambda: mt.SPRowParallelLinear(nn.Linear(4 * t, D), group)(
                torch.randn(B, n, 4, device=dev)
            ),
            [f"T = {n}", f"divisible by the TP degree {t}"],
        ),
        "ring row layer, T = t + 1 positions": (
            lambda: mt.RingRowParallelLinear(nn.Linear(4 * t, D), group)(
                torch.randn(B, n, 4, device=dev)
            ),
            [f"T = {n}", f"divisible by the TP degree {t}"],
        ),
        "embedding under SP, T = t + 1 positions": (
            lambda: mt.SPVocabParallelEmbedding(nn.Embedding(12, D), group)(
                torch.zeros(B, n, dtype=torch.long, device=dev)
            ),
            [f"T = {n}", f"divisible by the TP degree {t}"],
        ),
        "cross-entropy, a rank's logits not ceil(V / t)": (
            lambda: mt.VocabParallelCrossEntropy.apply(
                torch.randn(5, 12 // t - 1, device=dev),
                torch.zeros(5, dtype=torch.long, device=dev),
                12,
                group,
            ),
            ["vocab 12", "ceil(V/t)"],
        ),
    }
    for what, (call, words) in bad.items():
        with counter() as comm:
            try:
                call()
                msg = "no error"
            except Exception as e:  # noqa: BLE001 (any other error is a failure, reported)
                msg = f"{type(e).__name__}: {e}"
        equal(
            f"bad input, {what}: a ValueError naming {words}, before any collective ({msg})",
            (msg.startswith("ValueError") and all(w in msg for w in words), comm.calls),
            (True, {}),
        )

    # --- the core, copied out: at t = 2, and at t = 3 on global ranks 1-3 of a launch of 4 (rank 0 waits), whose
    # group ranks 0-2 are not their global ranks: there the mixed biases only, without the mutants (both biases
    # and the mutants ran at t = 2) ---
    sub = dist.new_group([1, 2, 3]) if t == 4 else group  # every rank makes every group
    if t == 2 or (t == 4 and r > 0):
        for gate_bias, up_bias in ((True, True), (False, True), (True, False))[
            0 if t == 2 else 1 :
        ]:
            copy_out(d, sub, gate_bias, up_bias, mutants=t == 2)
    if t == 2:
        slowed_overlap(d, group)

    for line in failures:
        print(f"rank {r} FAILED {line}", flush=True)
    n_bad = torch.tensor([len(failures)], device=dev)
    dist.all_reduce(n_bad)
    for line in passed if os.environ.get("VERBOSE") else []:
        d.log(f"ok {line}")
    d.log(f"{len(passed)} checks passed on rank 0 (t = {t})")
    if n_bad.item() == 0:
        d.log("ALL CHECKS PASSED")
    close_dist(ok=n_bad.item() == 0)


if __name__ == "__main__":
    if sys.argv[1:2] == [
        "--forget-tp-rng"
    ]:  # `... --forget-tp-rng MEGATRON_ARGS`: a broken resume, on purpose
        del sys.argv[
            1
        ]  # the tracker's TP-region stream is not restored: a restarted run redraws its masks
        mt.TrackerState.load_state_dict = lambda self, state: None
        mt.main()
    else:
        main()
