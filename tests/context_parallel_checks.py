"""Checks of context_parallel.py that need a process group, many per launch:

    torchrun --nproc_per_node=4 tests/context_parallel_checks.py [--runs RUNS.json OUTDIR] --layers [OUTDIR]

--layers   (world 4) each attention, each layout, at cp 2 (two groups), cp 3 (ranks 0-2; rank 3 idles) and
           cp 4, on its own against one-process causal attention (F.scaled_dot_product_attention on the whole
           sequence): the output and dQ/dK/dV, 1e-12 in float64; the bytes handed to each collective and the
           direction of every ring send against the closed form written here; the ring's computed blocks.
           Negatives: the three broken pieces below must change the output or the gradients. At cp 2, each
           core given a shape it cannot split must raise a clear ValueError before any collective. Then the copy-out
           check: the attention functions on a model that is not the GPT, trained with Adam, against plain
           one-process training of the same model. Prints ALL CHECKS PASSED and exits 0, else the failures
           and exits 1; given OUTDIR, writes each rank's checks to OUTDIR/layers-rank{r}.json and exits 0.
--runs     context_parallel.py's own main() once per entry of RUNS.json ({"name", "argv", "mutant"}), in this
           process group, each writing OUTDIR/NAME.json, and OUTDIR/NAME.events.json: the order in which main()
           read the peak and ran report()'s unsplit GPT; the test reads them. A mutant breaks one piece of the
           file for its run (monkeypatched here, put back after):
             plain-sum   the log-sum-exp merge replaced by a plain sum of the block outputs
             stale-kv    the ring's backward keeps computing on the K/V block it holds, ignoring the new one
             dkv-kept    the ring's backward never sends dK/dV on: each rank keeps only its own queries' share
"""

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))  # section.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from einops import rearrange  # noqa: E402

import context_parallel as cpm  # noqa: E402
import harness  # noqa: E402
import section  # noqa: E402
from common import close_dist, init_dist  # noqa: E402
from harness import CommCounter  # noqa: E402

TOL, ES = 1e-12, 8  # float64
results = []  # {"kind": attention | copy-out | mutant, "name", "ok", "what"}, this rank's
real_merge, real_exchange = cpm.merge, cpm.ring_exchange


def record(kind, name, ok, what):
    results.append(dict(kind=kind, name=name, ok=bool(ok), what=what))


def close(kind, name, got, want, tol=TOL):
    diff = (
        (got.detach() - want.detach()).abs().max().item()
        if got.shape == want.shape
        else float("inf")
    )
    record(kind, name, diff <= tol, f"max diff {diff:.2e} (tolerance {tol:.0e})")


def differs(kind, name, got, want, at_least=1e-6):
    diff = (got.detach() - want.detach()).abs().max().item()
    record(kind, name, diff >= at_least, f"must differ: max diff {diff:.2e}")


def equal(kind, name, got, want):
    record(kind, name, got == want, f"{got} vs {want}")


def in_backward():
    return torch._C._current_graph_task_id() != -1


# ----------------------------------------------------------------------------- the mutants
def plain_sum(out, lse, block_out, block_lse):
    return out + block_out, torch.logaddexp(lse, block_lse)


def stale_kv(send, group, to, frm):
    # the exchange still happens (the pairing holds) ...
    got, wait = real_exchange(send, group, to, frm)
    if in_backward() and "kv" in got:
        got["kv"] = send["kv"]  # ... but the block received is never used
    return got, wait


def dkv_kept(send, group, to, frm):
    got, wait = real_exchange(send, group, to, frm)
    if in_backward() and "dkv" in got:
        got["dkv"] = torch.zeros_like(got["dkv"])  # nothing of the other ranks' shares arrives
    return got, wait


MUTANTS = {
    "plain-sum": ("merge", plain_sum),
    "stale-kv": ("ring_exchange", stale_kv),
    "dkv-kept": ("ring_exchange", dkv_kept),
}


def mutate(name):
    cpm.merge, cpm.ring_exchange = real_merge, real_exchange
    if name:
        setattr(cpm, *MUTANTS[name])


# ----------------------------------------------------------------------------- attention on its own
def attention_checks(d, group, members):
    cp, r = len(members), members.index(d.rank)
    B, H, E, T = (
        2,
        12,
        3,
        6 * cp,
    )  # 12 heads: ulysses at cp 2, 3, 4; chunks of 3 tokens under zig-zag
    t, blk = T // cp, B * H * T // cp * E  # elements of one (B, H, t, E) block
    g = torch.Generator().manual_seed(7)  # the same full tensors on every rank
    q, k, v, dout = (
        torch.randn(B, H, T, E, generator=g, dtype=torch.float64).to(d.device) for _ in range(4)
    )
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = F.scaled_dot_product_attention(*leaves, is_causal=True)
    ref.backward(dout)
    nxt, prv = members[(r + 1) % cp], members[(r - 1) % cp]
    for attention in ("allgather", "ring", "ulysses"):
        for zigzag in (False, True):
            tag = f"cp {cp} rank {r} {attention} {'zigzag' if zigzag else 'contiguous'}"
            mine = lambda x: cpm.shard_sequence(x, r, cp, zigzag, dim=2)  # noqa: E731
            local = [mine(x).detach().clone().requires_grad_() for x in (q, k, v)]
            comm = CommCounter(axes={"cp": group}, log=True)
            with (
                comm,
                cpm.CountBlocks() as counted,
            ):  # the blocks: every call of cpm.attend (the ring's)
                out = cpm.ATTENTIONS[attention](*local, group, zigzag)
                out.backward(mine(dout))
            computed = counted.blocks
            close("attention", f"{tag}: output", out, mine(ref))
            for name, x, full in zip("qkv", local, leaves):
                close("attention", f"{tag}: d{name}", x.grad, mine(full.grad))
            want = {
                "ring": {
                    "send/cp/fwd": 2 * (cp - 1) * blk * ES,
                    "send/cp/bwd": 4 * (cp - 1) * blk * ES,
                },
                "allgather": {
                    "all_gather/cp/fwd": 2 * blk * ES,
                    "reduce_scatter/cp/bwd": 2 * cp * blk * ES,
                },
                "ulysses": {"all_to_all/cp/fwd": 4 * blk * ES, "all_to_all/cp/bwd": 4 * blk * ES},
            }[attention]
            got = {k_: b_ for k_, b_ in comm.bytes.items() if b_}
            equal("attention", f"{tag}: bytes handed", got, want)
            # forward to r+1, backward the other way; blocks as the mask allows
            if attention == "ring":
                peers = {(c["phase"], c["peer"]) for c in comm.calls_log if c["op"] == "send"}
                equal(
                    "attention",
                    f"{tag}: ring sends (phase, peer)",
                    peers,
                    {("fwd", nxt), ("bwd", prv)},
                )
                equal(
                    "attention", f"{tag}: blocks computed", len(computed), cp if zigzag else r + 1
                )
                equal(
                    "attention",
                    f"{tag}: scores computed",
                    sum(a * b for a, b in computed),
                    t * t + (cp - 1) * t * t // 2 if zigzag else (r + 1) * t * t,
                )
    if cp == 2:
        bad_input_checks(d, group, r)
    # negatives: each broken piece changes what the checks above compare (on the ranks it can reach)
    for mutant, part in (("plain-sum", "output"), ("stale-kv", "dk"), ("dkv-kept", "dk")):
        mutate(mutant)
        local = [
            cpm.shard_sequence(x, r, cp, True, 2).detach().clone().requires_grad_()
            for x in (q, k, v)
        ]
        out = cpm.ring_attention(*local, group, True)
        out.backward(cpm.shard_sequence(dout, r, cp, True, dim=2))
        mutate(None)
        got = out if part == "output" else local[1].grad
        want = cpm.shard_sequence(ref if part == "output" else leaves[1].grad, r, cp, True, dim=2)
        err = torch.stack([(got - want).abs().max()])
        # some ranks may be untouched: the worst one
        dist.all_reduce(err, op=dist.ReduceOp.MAX, group=group)
        differs(
            "mutant", f"cp {cp} rank {r} ring zigzag, {mutant}: {part}", err, torch.zeros_like(err)
        )


def bad_input_checks(d, group, r):
    """Each core given a shape it cannot split, at cp 2: a ValueError that names what would work, raised
    before any collective (the counter saw none). Today's code aborted inside gloo or raised einops' error."""

    def rand(*shape):
        return torch.randn(*shape, dtype=torch.float64, device=d.device)

    odd = [rand(2, 4, 3, 2) for _ in range(3)]  # t = 3 tokens a rank: T = 6, not 2cp = 4 chunks
    bad = {
        "shard_sequence, T = 7, contiguous": (
            lambda: cpm.shard_sequence(rand(2, 7, 4), r, 2, False),
            ["T = 7 is not", "7 tokens", "divisible by 2", "use T = 8"],
        ),
        "shard_sequence, T = 6, zig-zag": (
            lambda: cpm.shard_sequence(rand(2, 6, 4), r, 2, True),
            ["T = 6 is not", "6 tokens", "4 equal chunks", "use T = 8"],
        ),
        "ulysses, 3 heads": (
            lambda: cpm.ulysses_attention(*[rand(2, 3, 4, 2) for _ in range(3)], group, False),
            ["heads = 3 is not divisible by cp = 2", "3 heads", "multiple of 2"],
        ),
    }
    for attention in ("allgather", "ring", "ulysses"):
        bad[f"{attention}, zig-zag, t = 3"] = (
            lambda a=attention: cpm.ATTENTIONS[a](*odd, group, True),
            ["6 tokens", "4 equal chunks"],
        )
    for what, (call, words) in bad.items():
        with CommCounter(axes={"cp": group}) as comm:
            try:
                call()
                msg = "no error"
            except Exception as e:  # noqa: BLE001 (any other error is a failure, reported)
                msg = f"{type(e).__name__}: {e}"
        # a copier calls the core: it names its parameters, never a command-line flag
        named = "--" not in msg
        ok = (
            msg.startswith("ValueError")
            and named
            and all(w in msg for w in words)
            and not comm.calls
        )
        record("bad-input", f"rank {r}: {what}", ok, f"{msg}; collectives before it: {comm.calls}")


# ----------------------------------------------------------------------------- copy-out: a model not the GPT
class Mixer(nn.Module):
    """Not the GPT: q, k, v from one fused projection, a nested MLP, a gain on the root, a regression loss."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads, self.gain = heads, nn.Parameter(torch.linspace(0.5, 1.5, d))
        self.inner = nn.ModuleDict(
            {
                "qkv": nn.Linear(d, 3 * d),
                "mix": nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, d)),
            }
        )

    def forward(self, x, attend):  # (B, t, d) -> (B, t, d)
        q, k, v = rearrange(self.inner["qkv"](x), "b t (s h e) -> s b h t e", s=3, h=self.heads)
        y = rearrange(attend(q, k, v), "b h t e -> b t (h e)")
        return self.gain * self.inner["mix"](y) + x


def copy_out_checks(d, group, members):
    """The attentions and shard_sequence of context_parallel.py's technique section executed alone (torch and
    einops only, tests/section.py), in a group whose ranks need not be the global ones ([2, 3] at cp 2)."""
    core = section.load("context_parallel.py")
    cp, r = len(members), members.index(d.rank)
    B, T, D, heads = 3, 6 * cp, 12, 4 if cp == 4 else 6  # E = 3 or 2
    g = torch.Generator().manual_seed(11)
    xs, ys = (
        torch.randn(3, B, T, D, generator=g, dtype=torch.float64).to(d.device) for _ in range(2)
    )
    torch.manual_seed(3)
    base = Mixer(D, heads).double().to(d.device)
    ref = Mixer(D, heads).double().to(d.device)
    ref.load_state_dict(base.state_dict())
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    for x, y in zip(xs, ys):  # plain one-process training on whole sequences
        out = ref(x, lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        loss = ((out - y) ** 2).sum()
        opt.zero_grad()
        (loss / y.numel()).backward()
        opt.step()
    for attention in ("allgather", "ring", "ulysses"):
        for zigzag in (False, True):
            model = Mixer(D, heads).double().to(d.device)
            model.load_state_dict(base.state_dict())
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            attend = lambda q, k, v: core["ATTENTIONS"][attention](q, k, v, group, zigzag)  # noqa: E731
            for x, y in zip(xs, ys):  # my tokens only; gradients summed over the cp group
                mine = lambda a: core["shard_sequence"](a, r, cp, zigzag)  # noqa: E731
                loss = ((model(mine(x), attend) - mine(y)) ** 2).sum() / y.numel()
                opt.zero_grad()
                loss.backward()
                for p in model.parameters():
                    dist.all_reduce(p.grad, group=group)
                opt.step()
            tag = f"copy-out cp {cp} rank {r} {attention} {'zigzag' if zigzag else 'contiguous'}"
            flat = lambda m: torch.cat([p.reshape(-1) for p in m.parameters()])  # noqa: E731
            close(
                "copy-out",
                f"{tag}: parameters after 3 Adam steps",
                flat(model),
                flat(ref),
                tol=1e-10,
            )


def layer_checks(d):
    assert d.world == 4, "--layers runs at world 4 (cp 2 twice, cp 3 and cp 4 in one launch)"
    layouts = [[[0, 1], [2, 3]], [[0, 1, 2]], [[0, 1, 2, 3]]]
    for groups in layouts:  # every rank makes every group, in one order
        made = [(dist.new_group(m), m) for m in groups]
        for group, members in made:
            if d.rank in members:
                attention_checks(d, group, members)
                copy_out_checks(d, group, members)
        dist.barrier()


# ----------------------------------------------------------------------------- context_parallel.py's main
class Finished(Exception):
    pass


def runs(d, spec, outdir):
    # Run.finish ends a run through harness.close_dist: here the next run follows
    def no_exit(
        ok=True,
    ):
        raise Finished(ok)

    harness.close_dist, cpm.init_dist = no_exit, lambda timeout=120: d
    real_peak, real_build, events = cpm.peak_memory_bytes, cpm.build_gpt, []

    def peak(*a):  # the order in which main() reads the peak and runs the unsplit GPT beside it
        events.append("peak read")
        return real_peak(*a)

    # main's GPT lends its modules and never runs forward; report's unsplit one does
    def build(*a, **k):
        gpt = real_build(*a, **k)
        gpt.register_forward_pre_hook(lambda *_: events.append("unsplit GPT forward"))
        return gpt

    cpm.peak_memory_bytes, cpm.build_gpt = peak, build
    for run in json.loads(Path(spec).read_text()):
        events.clear()
        out = Path(outdir) / f"{run['name']}.json"
        sys.argv = [str(ROOT / "context_parallel.py"), *run["argv"], "--json", str(out)]
        mutate(run.get("mutant"))
        try:
            cpm.main()
        except Finished:
            pass
        finally:
            mutate(None)
        if d.rank == 0:
            (Path(outdir) / f"{run['name']}.events.json").write_text(json.dumps(events))
        dist.barrier()
        d.log(f"run {run['name']} done")
    cpm.peak_memory_bytes, cpm.build_gpt = real_peak, real_build


def main():
    d = init_dist()
    args = sys.argv[1:]
    if "--runs" in args:
        i = args.index("--runs")
        runs(d, args[i + 1], args[i + 2])
    if "--layers" not in args:
        close_dist()
    layer_checks(d)
    outdir = args[args.index("--layers") + 1] if args.index("--layers") + 1 < len(args) else ""
    if outdir.startswith("--"):
        outdir = ""
    if outdir:  # the test reads every rank's checks and decides
        (Path(outdir) / f"layers-rank{d.rank}.json").write_text(json.dumps(results))
    bad = torch.tensor([float(sum(not c["ok"] for c in results))], device=d.device)
    dist.all_reduce(bad)
    for c in results:
        if not c["ok"] or os.environ.get("CP_VERBOSE"):
            print(
                f"rank {d.rank} {'ok' if c['ok'] else 'FAILED'} {c['name']}: {c['what']}",
                flush=True,
            )
    d.log(f"{len(results)} checks on rank 0" + ("; ALL CHECKS PASSED" if not bad.item() else ""))
    close_dist(ok=bool(outdir) or not bad.item())


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
