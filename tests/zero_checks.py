"""Layer-level checks of zero.py inside one process group (launched once by tests/test_zero.py):

    torchrun --nproc_per_node=3 tests/zero_checks.py

1. The Zero wrapper around a model with awkward shapes (7x5 and 5x3 linears, a bias-free layer, a bare
   parameter; flat units of 40, 15 and 35 elements, so world 3 pads two of them) against one-process
   training, torch's ZeroRedundancyOptimizer (stage 1) and fully_shard (FSDP2, stage 3), in float64.
2. The GPT at stages 0-3 (gradient accumulation, clipping) against common.reference_train and each other;
   counted memory per stage against the ZeRO formulas; counted bytes per step against the ring volumes;
   stage 3 frees each unit after use (peak gathered = root + one block); recomputation saves less.
Prints ALL CHECKS PASSED and exits 0, or names each failed check and exits 1.
"""
import os, sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer

import zero as Z
from common import (GPTConfig, MarkovData, build_gpt, close_dist, count_tokens, init_dist, lm_loss, make_optimizer,
                    reference_train)

FAILED = []


def check(d, name, ok, detail=""):
    d.log(f"{'ok  ' if ok else 'FAIL'} {name} {detail}")
    if not ok:
        FAILED.append(name)
        if d.rank:  # rank 0 speaks for the job; another rank's own failure is printed by that rank
            print(f"FAIL (rank {d.rank}) {name} {detail}", flush=True)


def max_diff(a, b):
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[n] - b[n]).abs().max().item() for n in a)


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


def awkward():
    torch.manual_seed(1)
    return Awkward().double()


def batch(step):  # the global batch of a step, (12, 7) inputs and targets
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 7, generator=g, dtype=torch.float64), torch.randn(12, 7, generator=g, dtype=torch.float64)


def mse(out, y, n):  # sum over this piece / elements of the whole global batch, like common.lm_loss
    return ((out - y) ** 2).sum() / n


def local_pieces(d, x, y, accum):  # this rank's rows, in accum micro-batches
    rows = x.shape[0] // d.world
    return zip(x[d.rank * rows:(d.rank + 1) * rows].chunk(accum), y[d.rank * rows:(d.rank + 1) * rows].chunk(accum))


def check_awkward(d, args, steps=3):
    init = dict(awkward().named_parameters())
    plain = awkward()  # one process, the whole global batch
    opt = make_optimizer(plain.parameters(), args)
    norms = []
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        mse(plain(x), y, y.numel()).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(plain.parameters(), args.clip)))
        opt.step()
    want = {n: p.detach() for n, p in plain.named_parameters()}

    z1 = awkward()  # torch's ZeRO-1: gradients summed by hand (our loss is already divided globally)
    opt = ZeroRedundancyOptimizer(z1.parameters(), optimizer_class=torch.optim.AdamW, lr=args.lr,
                                  betas=(0.9, 0.95), weight_decay=args.weight_decay, foreach=False)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        for xm, ym in local_pieces(d, x, y, args.accum):
            mse(z1(xm), ym, y.numel()).backward()
        for p in z1.parameters():
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(z1.parameters(), args.clip)
        opt.step()
    torch_zero1 = {n: p.detach() for n, p in z1.named_parameters()}

    f = awkward()  # torch's FSDP2, the same units; it averages gradients over ranks, so the loss is x N
    for unit in (f.a, f.b, f):
        fully_shard(unit)
    opt = make_optimizer(f.parameters(), args)
    for s in range(steps):
        x, y = batch(s)
        opt.zero_grad()
        for xm, ym in local_pieces(d, x, y, args.accum):
            (mse(f(xm), ym, y.numel()) * d.world).backward()
        torch.nn.utils.clip_grad_norm_(f.parameters(), args.clip)
        opt.step()
    torch_fsdp = {n: p.full_tensor().detach() for n, p in f.named_parameters()}
    check(d, "awkward: torch ZeRO-1 == one process", max_diff(torch_zero1, want) < 1e-12)
    check(d, "awkward: torch FSDP2 == one process", max_diff(torch_fsdp, want) < 1e-12)
    check(d, "awkward: training moved the parameters (parity is not vacuous)", max_diff(want, init) > 1e-3)
    check(d, "awkward: clipping was active", max(norms) > args.clip, f"(max norm {max(norms):.3f} > {args.clip})")

    def run(stage, **kw):
        a = replace(args, stage=stage, **kw)
        zero = Z.Zero(awkward(), a, units=["a", "b"])
        for s in range(steps):
            x, y = batch(s)
            Z.train_step(zero, x, y, y.numel(), a.accum, mse)
        return zero.full_state_dict()

    for stage in range(4):
        got = run(stage)
        diff = max_diff(got, want)
        check(d, f"awkward: Zero stage {stage} == one process", diff < 1e-12, f"({diff:.1e})")
        if stage == 1:
            diff = max_diff(got, torch_zero1)
            check(d, "awkward: Zero stage 1 == torch ZeroRedundancyOptimizer", diff < 1e-12, f"({diff:.1e})")
        if stage == 3:
            check(d, "awkward: Zero stage 3 == torch fully_shard (FSDP2)", max_diff(got, torch_fsdp) < 1e-12,
                  f"({max_diff(got, torch_fsdp):.1e})")
    got = run(3, offload=True, recompute=True)
    check(d, "awkward: stage 3 + offload + recompute == FSDP2", max_diff(got, torch_fsdp) < 1e-12)
    got = run(3, clip=0.0)  # negative: the same run without clipping must differ
    check(d, "awkward: without clipping it differs (negative)", max_diff(got, want) > 1e-6,
          f"({max_diff(got, want):.1e})")


# ----------------------------------------------------------------------------- 2. the GPT, stages 0-3
def check_gpt(d, args):
    ref = reference_train(args)
    data = MarkovData(args.vocab, args.seed)
    results = {}
    for stage in (0, 1, 2, 3, "3+offload+recompute"):
        a = replace(args, stage=3, offload=True, recompute=True) if stage == "3+offload+recompute" else \
            replace(args, stage=stage)
        model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
        zero = Z.Zero(model, a, units=[f"blocks.{i}" for i in range(a.n_layers)])
        losses, sent = [], []
        for s in range(a.steps):
            x, y = data.batch(s, a.batch_size, a.seq_len)
            before = zero.sent
            losses.append(Z.train_step(zero, x, y, count_tokens(y), a.accum, lm_loss)[0])
            sent.append(zero.sent - before)
        saved = zero.saved_bytes
        if a.stage == 3:  # one more forward, no backward: every gathered unit must be freed after it
            zero(x[:2])
            check(d, f"stage {stage}: no gathered parameters live after a forward", zero.live_gathered == 0,
                  f"({zero.live_gathered} B live)")
        full = zero.full_state_dict()
        pdiff = max_diff(full, ref["params"])
        ldiff = max(abs(p - q) / abs(q) for p, q in zip(losses, ref["losses"]))
        check(d, f"stage {stage}: losses and params == reference", pdiff < 1e-10 and ldiff < 1e-10,
              f"(params {pdiff:.1e}, losses {ldiff:.1e})")
        results[stage] = (zero, full, sent[-1], saved)

    for stage in (1, 2, 3):
        diff = max_diff(results[stage][1], results[0][1])
        check(d, f"stage {stage} == stage 0", diff < 1e-12, f"({diff:.1e})")

    totals = []
    for stage in (0, 1, 2, 3):  # memory, counted from the tensors, against the ZeRO formulas
        zero = results[stage][0]
        mem, th, thp = zero.memory(), zero.theory(), zero.theory(padded=True)
        ok = all(th[k] <= mem[k] == thp[k] for k in ("params", "grads", "optim"))
        check(d, f"stage {stage}: counted memory == ZeRO formula (padded), >= formula (unpadded)", ok,
              f"({ {k: (mem[k], round(th[k])) for k in ('params', 'grads', 'optim')} })")
        totals.append(mem["params"] + mem["grads"] + mem["optim"])
    check(d, "model-state bytes fall stage by stage", totals[0] > totals[1] > totals[2] > totals[3], f"{totals}")
    N = d.world
    psi = results[0][0].theory()["psi"]
    check(d, "stage 3 holds about 1/N of stage 0", abs(totals[3] * N / totals[0] - 1) < 0.01, f"(Psi = {psi})")

    for stage in (0, 1, 2, 3):  # bytes per step: ring volumes of the padded vectors + the 8-byte norm
        zero, _, sent, _ = results[stage]
        f = zero.theory(padded=True)["psi"] * (N - 1) / N * 8  # float64: 8 bytes per element
        want = {0: 2 * f, 1: 2 * f, 2: (args.accum + 1) * f, 3: 3 * args.accum * f}[stage] + 2 * (N - 1) / N * 8
        check(d, f"stage {stage}: counted bytes per step == ring formula", abs(sent - want) < 1e-6, f"({sent:.0f} B)")

    zero3 = results[3][0]
    unit_bytes = [u.padded * 8 for u in zero3.units]
    want = unit_bytes[-1] + max(unit_bytes[:-1])  # the root stays gathered while one block is in use
    check(d, "stage 3: peak gathered == root + largest block", zero3.peak_gathered == want,
          f"({zero3.peak_gathered} B, all units {sum(unit_bytes)} B)")
    rec = results["3+offload+recompute"]
    check(d, "recompute saves fewer activation bytes", rec[3] < results[3][3] / 2, f"({rec[3]} vs {results[3][3]} B)")
    check(d, "offload: optimizer state on the CPU", all(u.master.device.type == "cpu" for u in rec[0].units))


def main():
    d = init_dist(60)
    base = Z.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, batch_size=12, steps=3,
                  dtype="float64", accum=2, clip=0.5, lr=1e-2)
    check_awkward(d, base)
    check_gpt(d, base)
    bad = torch.tensor([float(len(FAILED))], device=d.device)
    dist.all_reduce(bad)
    d.log("ALL CHECKS PASSED" if bad.item() == 0 else f"FAILED: {FAILED}")
    close_dist(ok=bad.item() == 0)


if __name__ == "__main__":
    main()
