"""Checks of diloco.py inside one process group (launched once by tests/test_diloco.py, at world 3):

    torchrun --standalone --nproc_per_node=3 tests/diloco_checks.py

1. copy-out: diloco.DiLoCo on a model that is not the GPT (nested modules, a root parameter, odd sizes, a
   Huber loss), each rank a worker with plain SGD inside, H = 1: outer SGD lr 1 == plain one-process SGD on
   the whole batch; outer Nesterov (lr a, momentum mu) == one-process Nesterov SGD with lr a x the inner lr
   (both written here with torch.optim.SGD); negative: H = 2 differs.
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
A failed check is recorded and the script goes on; it prints ALL CHECKS PASSED or exits 1 at the end.
"""
import os, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import diloco
import harness
from common import GPT, GPTConfig, MarkovData, build_gpt, close_dist, count_tokens, init_dist, lm_loss

d = init_dist(60)
F64, B, STEPS = torch.float64, 12, 5
failures = []


def check(ok, what):
    if not ok:
        failures.append(what)
    if d.rank == 0 or not ok:  # a failure is printed by the rank that saw it
        print(f"{'ok  ' if ok else 'FAIL'} (rank {d.rank}) {what}", flush=True)


# ----------------------------------------------------------------------------- 1. copy-out on another model
class Net(nn.Module):
    """Nested modules, a parameter on the root module, odd sizes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(5)  # the same weights on every rank
        inner = nn.Sequential(nn.Linear(13, 5), nn.LayerNorm(5))
        self.enc = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), inner)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 5))
        self.head = nn.Linear(5, 3)
        self.to(device=d.device, dtype=F64)

    def forward(self, x):  # (b, 7) -> (b, 3)
        return self.head(self.enc(x) * self.gain)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(B, 7, generator=g, dtype=F64), torch.randn(B, 3, generator=g, dtype=F64)
    return x.to(d.device), y.to(d.device)


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


rows, LR = B // d.world, 0.1
for H, outer_lr, mu, what in ((1, 1.0, 0.0, "outer SGD lr 1 == plain SGD"),
                              (1, 0.7, 0.9, "outer Nesterov 0.7/0.9 == one-process Nesterov SGD, lr 0.07"),
                              (2, 1.0, 0.0, "negative: H = 2 differs from plain SGD")):
    model = Net()
    inner = torch.optim.SGD(model.parameters(), lr=LR)
    outer = diloco.DiLoCo(model.parameters(), H, outer_lr, mu, nesterov=mu > 0)
    for step in range(STEPS):
        x, y = batch(step)
        inner.zero_grad()
        huber(model, x[d.rank * rows:(d.rank + 1) * rows], y[d.rank * rows:(d.rank + 1) * rows]).backward()
        inner.step()
        outer.after_inner_step(step)
    outer.finish()
    theta = torch.cat([g.flatten() for g in outer.global_params()])
    diff = (theta - plain_sgd(LR * outer_lr, mu)).abs().max().item()
    if H == 1:
        check(diff <= 1e-12 and (flat(model) - theta).abs().max().item() == 0,
              f"copy-out DiLoCo, {d.world} workers, Huber loss, a root parameter, inner SGD, H 1: {what} "
              f"(params {diff:.1e}); the workers restart from theta")
    else:
        check(diff > 1e-6, f"copy-out DiLoCo: {what} ({diff:.1e})")

# ----------------------------------------------------------------------------- 2-4: diloco.py's main, patched
summaries = []
write_summary = harness.write_summary
harness.write_summary = lambda *a, **k: summaries.append(write_summary(*a, **k)) or summaries[-1]
harness.close_dist = lambda ok=True: None  # main() returns instead of ending the process
diloco.init_dist = lambda timeout=120: d
TINY = ["--vocab", "32", "--seq-len", "8", "--d-model", "16", "--n-heads", "2", "--n-layers", "2",
        "--batch-size", "12", "--steps", "6", "--dtype", "float64"]
CFG = GPTConfig(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
P = sum(p.numel() for p in GPT(CFG).parameters())
gpt = GPT(CFG)
frag_sizes = [sum(p.numel() for p in f) for f in ([gpt.tok_emb.weight, gpt.pos_emb.weight,
                                                   *gpt.blocks[0].parameters()],
                                                  [*gpt.blocks[1].parameters(), *gpt.ln_f.parameters(),
                                                   gpt.head.weight])]


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
only_all_reduce = list(f["comm_table"]) == ["all_reduce/world/fwd"]
check(passed(s) and f["bytes_per_inner_step"] == P * 8 / 3 and only_all_reduce,
      f"diloco.py --inner-steps 3 --check (AdamW in, Nesterov out): PASSED "
      f"({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e}); "
      f"{f['bytes_per_inner_step']:.1f} B all-reduced per inner "
      f"step (measured) == P x 8 / H = {P * 8 / 3:.1f}")
STREAM = ["--inner-steps", "4", "--fragments", "2", "--overlap", "1", "--mix", "0.5", "--outer-dtype",
          "bfloat16", "--steps", "9"]
s = run_main(*STREAM, "--check")
f = s["figures"]
check(passed(s) and f["bytes_per_inner_step"] == P * 2 / 4 and f["bytes_per_sync_max"] == max(frag_sizes) * 2
      and list(f["comm_table"]) == ["all_gather/world/fwd"],
      f"diloco.py streaming (F 2, overlap 1, mix 0.5, bfloat16 wire) --check: PASSED "
      f"({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e}); "
      f"{f['bytes_per_inner_step']:.1f} B all-gathered per inner step (measured) == P x 2 / H = "
      f"{P * 2 / 4:.1f}; "
      f"one exchange hands over at most {f['bytes_per_sync_max']} B (measured) == the largest fragment x 2 = "
      f"{max(frag_sizes) * 2}")

real_rounded = diloco.rounded
diloco.rounded = lambda delta, wire: delta  # negative: a reference that does not round as the wire does
s = run_main(*STREAM, "--check")
diloco.rounded = real_rounded
check(not s["check"]["passed"] and s["check"]["max_param_diff"] > 1e-6,
      f"negative: against a reference that skips the bfloat16 rounding, --check FAILS (params "
      f"{s['check']['max_param_diff']:.1e}): the exactness is the rounding's, not a loose tolerance's")


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
EQUIV = ["--inner", "sgd", "--outer", "sgd", "--outer-lr", "1", "--clip", "0", "--lr", "0.5", "--check"]
s = run_main("--inner-steps", "1", *EQUIV)
check(passed(s), f"inner SGD, H 1, outer SGD lr 1 == synchronous data parallel SGD (one-process trainer "
      f"written here): PASSED ({s['check']['max_loss_diff']:.1e}, params {s['check']['max_param_diff']:.1e})")
s = run_main("--inner-steps", "2", *EQUIV)
check(not s["check"]["passed"] and s["check"]["max_param_diff"] > 1e-6,
      f"negative: H 2 against synchronous SGD FAILS (params {s['check']['max_param_diff']:.1e})")
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
        ("the outer step applied to the workers' weights", diloco.DiLoCo, "outer_step", outer_on_workers,
         ["--inner-steps", "3"]),
        ("fragment 1 synced one step late", diloco.StreamingDiLoCo, "syncs_after", fragment_1_late, STREAM)):
    real = getattr(cls, attr)
    setattr(cls, attr, mutant)
    s = run_main(*flags, "--check")
    setattr(cls, attr, real)
    c = s["check"]
    check(not c["passed"] and max(c["max_loss_diff"], c["max_param_diff"]) > 1e-6,
          f"mutant: {name}: FAILS --check (losses {c['max_loss_diff']:.1e}, "
          f"params {c['max_param_diff']:.1e})")

n_failed = torch.tensor([len(failures)], device=d.device)  # each rank printed its own failures above
dist.all_reduce(n_failed)
d.log(f"{int(n_failed)} CHECK(S) FAILED" if int(n_failed) else "ALL CHECKS PASSED")
close_dist(ok=int(n_failed) == 0)
