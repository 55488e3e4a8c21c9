"""What tests/dp_checks.py, tests/diloco_checks.py and tests/ddp_bucketed_checks.py share, written once: a
check recorded on the rank that saw it (the script goes on, so every rank keeps issuing the same collectives)
and the verdict agreed over the ranks at the end; the small net that is not the GPT, on which each file's core
is copied out, and its batches; the bad-input round of a technique section's cores."""

import types

import torch
import torch.distributed as dist
import torch.nn as nn

import section
from common import close_dist

F64 = torch.float64


class Checks:
    """check(ok, what): a failure is recorded and printed by the rank that saw it, a pass by rank 0; finish()
    prints ALL CHECKS PASSED, or how many failed over every rank, and exits 1 then."""

    def __init__(self, d):
        self.d, self.failures = d, []

    def __call__(self, ok, what):
        if not ok:
            self.failures.append(what)
        if self.d.rank == 0 or not ok:  # a failure is printed by the rank that saw it
            print(f"{'ok  ' if ok else 'FAIL'} (rank {self.d.rank}) {what}", flush=True)

    def finish(self):
        # each rank printed its own above
        n_failed = torch.tensor([len(self.failures)], device=self.d.device)
        dist.all_reduce(n_failed)
        self.d.log(f"{int(n_failed)} CHECK(S) FAILED" if int(n_failed) else "ALL CHECKS PASSED")
        close_dist(ok=int(n_failed) == 0)


class SmallNet(nn.Module):
    """Nested modules, a parameter on the root module, odd sizes: (b, 7) -> (b, 3), in float64 on `device`,
    the same weights on every rank (drawn after torch.manual_seed(seed))."""

    def __init__(self, seed, device):
        super().__init__()
        torch.manual_seed(seed)  # the same weights on every rank
        inner = nn.Sequential(nn.Linear(13, 5), nn.LayerNorm(5))
        self.enc = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), inner)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.head = nn.Linear(5, 3)
        self.to(device=device, dtype=F64)

    def forward(self, x):  # (b, 7) -> (b, 3)
        return self.head(self.enc(x) * self.gain)


def net_batch(step, rows, seed, device):
    """Step `step`'s (rows, 7) inputs and (rows, 3) targets, drawn from seed + step: alike on every rank."""
    g = torch.Generator().manual_seed(seed + step)
    x, y = (
        torch.randn(rows, 7, generator=g, dtype=F64),
        torch.randn(rows, 3, generator=g, dtype=F64),
    )
    return x.to(device), y.to(device)


def check_refused(check, bad_calls, core, label=""):
    """bad_calls(ns): name -> (call, words). Each call on the section `core` raises a ValueError with the
    words before any collective (section.refused)."""
    for what, (call, words) in bad_calls(core).items():
        ok, seen = section.refused(call, words)
        check(ok, f"bad input: {label}{what}: refused before any collective ({seen})")


def check_unchecked_lets_through(check, file, bad_calls, core):
    """The negative: `file`'s section with its checks taken out (each raise ValueError a no-op) lets every one
    of bad_calls through."""
    unchecked = types.SimpleNamespace(
        **section.load(file, (section.ROOT / file).read_text().replace("raise ValueError(", "("))
    )
    through = [
        what
        for what, (call, words) in bad_calls(unchecked).items()
        if not section.refused(call, words)[0]
    ]
    check(
        len(through) == len(bad_calls(core)),
        f"bad input: negative: the section without its checks lets "
        f"{len(through)}/{len(bad_calls(core))} of them through",
    )
