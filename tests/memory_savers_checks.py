"""Layer-level checks of memory_savers.py inside one process group (launched once by tests/test_memory_savers.py):

    torchrun --nproc_per_node=3 tests/memory_savers_checks.py

1. Recomputation, full (Recompute, the file's own) and selective (torch's policy), with dropout 0.1: one
   micro-batch's gradients equal plain autograd's bit for bit (backward replays forward's RNG state: the
   same masks; a recomputation that does not is caught); composed with zero.py's Zero (both technique
   sections loaded alone) after Zero, on its units: full at stages 0-3, selective at 1, two steps at world
   3 bit for bit equal to Zero without it (a rerun without the replay is caught); applied before Zero,
   refused with a ValueError before any collective; the bytes the blocks keep equal L b T D e (full) and
   10 L b T D e (selective), counted from the storages alive after forward (a selective policy that keeps
   every op is caught); without savers, those storages plus the token ids' are exactly what
   harness.SavedActivations sees autograd save.
2. Gist, float32: bf16 / int8 keep about 1/2 / 1/4 of the bytes; the gradients lie within a few units of
   the encoding's rounding of the exact ones (a decoder returning zeros is caught); the loss after 3
   steps of data parallel training within 1e-2 of plain training, and not equal to it (lossy).
3. Adafactor on data parallel at world 1, 2 and 3 (subgroups of the launch), accumulation 2 and clipping,
   equals torch.optim.Adafactor on the whole batch in one process (float64); its state bytes equal the
   closed form e (R + C) per matrix + e per vector element, against AdamW's 2 e Psi; a second-moment
   estimate without its row factor is caught.
4. Bad input to dp_step, from memory_savers.py's technique section alone: a parameter the forward does not use,
   or no micro-batch at all: a ValueError before any collective (harness.CommCounter saw none; without the
   unused parameter it sees one all-reduce per parameter). The mutant (the check a no-op) fails with torch's
   own error, not the clear one. (recompute, Gist and Adafactor refuse theirs in tests/test_memory_savers.py.)
Every tensor and model lives on the process group's device (gloo + CPU here, NCCL + GPU elsewhere).
Prints ALL CHECKS PASSED and exits 0, or names each failed check and exits 1.
"""

import contextlib
import os
import sys
from dataclasses import replace
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import memory_savers as M
import section  # noqa: E402  (tests/section.py)
from common import (
    GPTConfig,
    MarkovData,
    build_gpt,
    close_dist,
    count_tokens,
    init_dist,
    lm_loss,
    make_optimizer,
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


def micro_batch(d, a, rank_rows=True):
    x, y = MarkovData(a.vocab, a.seed).batch(0, a.batch_size, a.seq_len)
    rows = a.batch_size // d.world
    x, y = (t[d.rank * rows : (d.rank + 1) * rows] for t in (x, y))
    return x.to(d.device), y.to(d.device)


def grads(d, a, x, y, how="none", gist=None, dtype=torch.float64, seed=5):
    """One micro-batch's gradient on this rank (no reduction), by name, with the savers asked for."""
    model = build_gpt(GPTConfig.from_args(a), a.seed, dtype, d.device)
    M.recompute(model.blocks, how)
    saver = M.Gist(gist, model.parameters()) if gist else None
    torch.manual_seed(seed)  # the dropout masks
    with saver or contextlib.nullcontext():
        out = model(x)
    lm_loss(out, y, count_tokens(y)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------- 1. recomputation
def no_replay(rng, device):  # mutant: the rerun draws fresh dropout masks
    return contextlib.nullcontext()


def check_recompute(d, args):
    a = replace(args, dropout=0.1)
    x, y = micro_batch(d, a)
    plain = grads(d, a, x, y)
    for how in ("full", "selective"):
        diff = max_diff(grads(d, a, x, y, how), plain)
        check(
            d,
            f"recompute {how}, dropout 0.1: gradients == plain autograd, bit for bit",
            diff == 0,
            f"({diff:.1e})",
        )
        forgetful = lambda *p, **k: checkpoint(*p, **{**k, "preserve_rng_state": False})  # noqa: E731
        with (
            mock.patch.object(M, "checkpoint", forgetful),
            mock.patch.object(M, "replayed", no_replay),
        ):
            diff = max_diff(grads(d, a, x, y, how), plain)
        check(
            d,
            f"recompute {how} mutant (dropout masks not replayed) is caught",
            diff > 1e-6,
            f"({diff:.1e})",
        )

    a = replace(args, dropout=0.0)
    b, T, D, L, e = x.shape[0], a.seq_len, a.d_model, a.n_layers, 8
    model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
    plain = M.activations(model, x)
    # (a view of the step's (B, T+1) tokens: the whole storage)
    token_ids = x.untyped_storage().nbytes()
    check(
        d,
        "plain: storages alive after forward + the token ids == harness.SavedActivations",
        plain["alive"] + token_ids == plain["saved"],
        f"({plain['alive']} + {token_ids} vs {plain['saved']} B)",
    )
    for how, k in (("full", 1), ("selective", 10)):
        model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
        M.recompute(model.blocks, how)
        got = M.activations(model, x)
        check(
            d,
            f"recompute {how}: the blocks keep {k} L b T D e, counted",
            got["blocks"] == k * L * b * T * D * e and got["rest"] == plain["rest"],
            f"({got['blocks']} B vs {k * L * b * T * D * e} B; plain {plain['blocks']} B)",
        )
    model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
    with mock.patch.object(M, "keep_matmuls", lambda *_a, **_k: CheckpointPolicy.MUST_SAVE):
        M.recompute(model.blocks, "selective")
    got = M.activations(model, x)
    check(
        d,
        "recompute selective mutant (keeps every op) is caught",
        got["blocks"] != 10 * L * b * T * D * e,
        f"({got['blocks']} B)",
    )


def check_with_zero(d, args):
    """Recomputation composed with zero.py's Zero, both technique sections loaded alone (tests/section.py):
    full recomputation applied after Zero, to its units, with dropout 0.1 at world 3, trains as Zero without
    it at every stage, bit for bit (the masks replayed; a rerun that draws fresh ones is caught); selective
    (torch's policy) too, at stage 1 (it works at 0-2; at 3 torch's replay meets the unit's all-gather);
    applied before Zero it is refused with a ValueError naming the block, before any collective."""
    ms, zs, a = (
        section.load("memory_savers.py"),
        section.load("zero.py"),
        replace(args, dropout=0.1),
    )
    data, units = MarkovData(a.vocab, a.seed), [f"blocks.{i}" for i in range(a.n_layers)]

    def train(stage, how, before=False):  # (losses, the whole trained model)
        model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64)
        if before:
            ms["recompute"](model.blocks, how)
        zero = zs["Zero"](
            model,
            units,
            stage=stage,
            optimizer=lambda ps: make_optimizer(ps, a),
            clip=a.clip,
            device=d.device,
        )
        ms["recompute"](model.blocks, how)  # on the units now
        torch.manual_seed(a.seed + d.rank)  # the dropout masks
        losses = []
        for step in range(2):
            x, y = data.batch(step, a.batch_size, a.seq_len)
            local, _ = zs["train_step"](zero, x, y, count_tokens(y), a.accum, lm_loss)
            dist.all_reduce(local)
            losses.append(local.item())
        return losses, zs["full_state_dict"](zero)

    for stage in range(4):
        want = train(stage, "none")
        # (selective: torch's; not at stage 3)
        for how in ("full", "selective") if stage == 1 else ("full",):
            got = train(stage, how)
            diff = max_diff(got[1], want[1])
            check(
                d,
                f"recompute {how} on Zero's units, stage {stage}, dropout 0.1: == Zero alone, bit for bit",
                diff == 0 and got[0] == want[0],
                f"({diff:.1e}; losses equal: {got[0] == want[0]})",
            )
    ms["replayed"] = no_replay  # (the section's own global: Recompute.backward reads it there)
    diff = max_diff(train(3, "full")[1], want[1])
    check(
        d,
        "recompute full on Zero's units mutant (dropout masks not replayed) is caught",
        diff > 1e-6,
        f"({diff:.1e})",
    )
    with CommCounter() as comm:
        try:
            train(3, "full", before=True)
            msg = "accepted"
        except ValueError as e:
            msg = str(e)
    check(
        d,
        "recompute before Zero: refused with a ValueError naming the block, before any collective",
        "blocks.0.forward was replaced before Zero" in msg and not comm.calls,
        f"({msg}; {comm.calls})",
    )


# ----------------------------------------------------------------------------- 2. Gist
def check_compression(d, args):
    a = replace(args, dtype="float32", accum=1)
    x, y = micro_batch(d, a)
    exact = grads(d, a, x, y, dtype=torch.float32)
    flat = lambda g: torch.cat([v.flatten() for v in g.values()])  # noqa: E731
    model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float32, d.device)
    plain_bytes = M.activations(model, x)["alive"]
    bound = {"bf16": 2.0**-8, "int8": 1 / 254}
    for how, lo, hi in (("bf16", 0.5, 0.56), ("int8", 0.25, 0.36)):
        saved = M.activations(model, x, M.Gist(how, model.parameters()))["alive"]
        check(
            d,
            f"compress {how}: saved bytes {lo} to {hi} of plain",
            lo <= saved / plain_bytes <= hi,
            f"({saved} / {plain_bytes} = {saved / plain_bytes:.3f})",
        )
        err = (
            (flat(grads(d, a, x, y, gist=how, dtype=torch.float32)) - flat(exact)).norm()
            / flat(exact).norm()
        ).item()
        check(
            d,
            f"compress {how}: gradient within 4 x the encoding's rounding",
            0 < err <= 4 * bound[how],
            f"(relative error {err:.1e}, bound {4 * bound[how]:.1e})",
        )
        zeros = lambda e: torch.zeros(e.data.shape, dtype=e.dtype, device=e.data.device)  # noqa: E731
        with mock.patch.object(M, "decode", zeros):
            g = grads(d, a, x, y, gist=how, dtype=torch.float32)
        err = ((flat(g) - flat(exact)).norm() / flat(exact).norm()).item()
        check(
            d,
            f"compress {how} mutant (decode returns zeros) is caught",
            err > 4 * bound[how],
            f"({err:.1e})",
        )
    losses = {}  # training: the loss after the same steps, compressed against plain (a figure, loosely bounded)
    for how in ("none", "bf16", "int8"):
        model, data = (
            build_gpt(GPTConfig.from_args(a), a.seed, torch.float32, d.device),
            MarkovData(a.vocab, a.seed),
        )
        opt, gist = (
            make_optimizer(model.parameters(), a),
            how != "none" and M.Gist(how, model.parameters()),
        )
        for s in range(a.steps):
            xs, ys = data.batch(s, a.batch_size, a.seq_len)
            n, rows = count_tokens(ys), a.batch_size // d.world
            xs, ys = (t[d.rank * rows : (d.rank + 1) * rows].to(d.device) for t in (xs, ys))
            loss = M.dp_step(
                model,
                opt,
                [(xs, ys)],
                lambda out, ym: lm_loss(out, ym, n),
                a.clip,
                saver=gist or None,
            )
        dist.all_reduce(loss)
        losses[how] = loss.item()
    for how in ("bf16", "int8"):
        diff = abs(losses[how] - losses["none"]) / losses["none"]
        check(
            d,
            f"compress {how}: loss after {a.steps} steps within 1e-2 of plain, and not equal (lossy)",
            0 < diff < 1e-2,
            f"(relative {diff:.1e})",
        )


# ----------------------------------------------------------------------------- 3. Adafactor
def check_adafactor(d, args):
    a = args
    data = MarkovData(a.vocab, a.seed)
    plain = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
    opt = torch.optim.Adafactor(
        plain.parameters(), lr=a.lr, weight_decay=a.weight_decay, foreach=False
    )
    for s in range(a.steps):
        x, y = (t.to(d.device) for t in data.batch(s, a.batch_size, a.seq_len))
        opt.zero_grad()
        lm_loss(plain(x), y, count_tokens(y)).backward()
        torch.nn.utils.clip_grad_norm_(plain.parameters(), a.clip)
        opt.step()
    want = {n: p.detach().cpu() for n, p in plain.named_parameters()}
    init = {
        n: p.detach()
        for n, p in build_gpt(GPTConfig.from_args(a), a.seed, torch.float64).named_parameters()
    }
    check(
        d,
        "adafactor: training moved the parameters (parity is not vacuous)",
        max_diff(want, init) > 1e-3,
    )
    shapes = [p.shape for p in plain.parameters()]
    closed = 8 * sum(sh[0] + sh[1] if len(sh) == 2 else sh.numel() for sh in shapes)

    def run(group, n):
        model = build_gpt(GPTConfig.from_args(a), a.seed, torch.float64, d.device)
        opt, rows = M.Adafactor(model.parameters(), a.lr, a.weight_decay), a.batch_size // n
        me = dist.get_rank(group)
        for s in range(a.steps):
            x, y = data.batch(s, a.batch_size, a.seq_len)
            n_tok = count_tokens(y)
            x, y = (t[me * rows : (me + 1) * rows].to(d.device) for t in (x, y))
            M.dp_step(
                model,
                opt,
                zip(x.chunk(a.accum), y.chunk(a.accum)),
                lambda out, ym: lm_loss(out, ym, n_tok),
                a.clip,
                group=group,
            )
        return model, opt, {n: p.detach() for n, p in model.named_parameters()}

    groups = {1: dist.new_group([0]), 2: dist.new_group([0, 1]), d.world: dist.group.WORLD}
    for n, group in groups.items():
        if d.rank >= n:
            continue  # not in this subgroup
        model, opt, got = run(group, n)
        diff = max_diff(got, want)
        check(d, f"adafactor: world {n} == torch.optim.Adafactor", diff < 1e-12, f"({diff:.1e})")
        if n == d.world:
            st = M.optimizer_state(model, opt)
            check(
                d,
                "adafactor: optimizer state bytes == 8 (R + C) per matrix + 8 per vector element",
                st["counted"] == closed == st["adafactor_theory"],
                f"({st['counted']} B, closed form {closed} B; AdamW's moments {st['adamw_theory']} B)",
            )
            with mock.patch("torch.outer", lambda r, c: torch.ones_like(r)[:, None] * c):
                _, _, got = run(group, n)
            check(
                d,
                "adafactor mutant (second moment without its row factor) is caught",
                max_diff(got, want) > 1e-6,
                f"({max_diff(got, want):.1e})",
            )
    dist.barrier()


# ----------------------------------------------------------------------------- 4. bad input
class Spare(nn.Module):
    """A model with a parameter its forward never uses."""

    def __init__(self, spare=True):
        super().__init__()
        self.used, self.spare = nn.Linear(4, 3), nn.Linear(4, 3) if spare else None

    def forward(self, x):
        return self.used(x)


def check_bad_input(d):
    text = open(os.path.join(ROOT, "memory_savers.py")).read()
    cores = {
        "": section.load("memory_savers.py"),
        "mutant ": section.load("memory_savers.py", text.replace("raise ValueError(", "str(")),
    }
    x = torch.randn(2, 4, dtype=torch.float64, device=d.device)
    for tag, core in cores.items():
        for what, spare, batches in (
            ("an unused parameter", True, [(x, None)]),
            ("no micro-batch", False, []),
            ("control: every parameter used", False, [(x, None)]),
        ):
            model = Spare(spare).double().to(d.device)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            with CommCounter() as comm:
                try:
                    core["dp_step"](model, opt, batches, lambda out, y: out.square().sum())
                    msg = None
                except Exception as e:  # noqa: BLE001
                    msg = f"{type(e).__name__}: {e}"
            calls = sum(comm.calls.values())
            if what.startswith("control"):
                ok = msg is None and calls == 2  # one all-reduce per parameter (weight, bias)
            elif tag:
                # torch's error, not the clear one
                ok = msg is not None and not msg.startswith("ValueError")
            else:
                ok = (
                    msg is not None
                    and msg.startswith("ValueError")
                    and "no gradient" in msg
                    and not calls
                )
            check(d, f"bad input {tag}dp_step: {what}", ok, f"({msg}; collectives {calls})")


def main():
    d = init_dist(60)
    base = M.Args(
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
    check_recompute(d, base)
    check_with_zero(d, base)
    check_compression(d, base)
    check_adafactor(d, base)
    check_bad_input(d)
    bad = torch.tensor([float(len(FAILED))], device=d.device)
    dist.all_reduce(bad)
    d.log("ALL CHECKS PASSED" if bad.item() == 0 else f"FAILED: {FAILED}")
    close_dist(ok=bad.item() == 0)


if __name__ == "__main__":
    main()
