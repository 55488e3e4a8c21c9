"""Layer-level checks of megatron_tp.py, all in one process group (t = world size), float64.

    torchrun --nproc_per_node=2 tests/megatron_tp_checks.py      (and 4)
    torchrun ... tests/megatron_tp_checks.py --forget-tp-rng ARGS  megatron_tp.py ARGS with a broken resume

Each sharded layer is built from an unsharded one (`from_full`), fed the same input, and its output,
input gradient and weight gradients must equal the unsharded layer's (weight gradients: this rank's
slice). Independent references: the plain torch modules of common.py, F.cross_entropy, and torch's own
DTensor tensor parallel (ColwiseParallel / RowwiseParallel) for the MLP. A block's saved activations are
counted against the unsharded block's. Negative checks show that what must differ, differs, and that the
checks catch the defects they guard against (put back on purpose by monkeypatching). Every module and
tensor lives on d.device, so the same checks run on NCCL. Prints ALL CHECKS PASSED and exits 0, else lists
failures and exits 1.
"""
import copy
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from einops import rearrange  # noqa: E402

import megatron_tp as mt  # noqa: E402
from common import IGNORE, MLP, Attention, Block, GPTConfig, build_gpt, close_dist, init_dist  # noqa: E402
from harness import SavedActivations  # noqa: E402

TOL = 1e-12
failures, passed = [], []


def close(name, got, want, tol=TOL):
    diff = (got.detach() - want.detach()).abs().max().item() if got.shape == want.shape else float("inf")
    (passed if diff <= tol else failures).append(f"{name}: max diff {diff:.2e}")


def differs(name, a, b, at_least=1e-6):
    """A negative check: these two MUST differ (else the positive checks could not fail)."""
    diff = (a.detach() - b.detach()).abs().max().item()
    (passed if diff >= at_least else failures).append(f"{name} (must differ): max diff {diff:.2e}")


def counts(name, want, handed=None):
    """Collective calls per key (and, given `handed`, the bytes handed to them) against values computed here."""
    got = dict(mt.COMM.calls)
    (passed if got == want else failures).append(f"{name}: counted {got}, theory {want}")
    if handed is not None:
        got = dict(mt.COMM.bytes)
        (passed if got == handed else failures).append(f"{name}: bytes handed {got}, from the shapes {handed}")


def equal(name, got, want):
    (passed if got == want else failures).append(f"{name}: {got} vs {want}")


def main():
    d = init_dist()
    torch.set_default_dtype(torch.float64)
    t, r, dev = d.world, d.rank, d.device
    es = 8  # float64 bytes
    group = dist.new_group(list(range(t)))  # the TP group: the whole world here
    tracker = mt.RNGTracker(dev, 0, 0, r)
    torch.manual_seed(1234)  # the same inputs and full weights on every rank
    B, T, D, H = 2, 8, 16, 4

    def shard_of(x, dim):  # this rank's slice of a full tensor, padded like mt.shard
        n = x.shape[dim]
        if n % t:
            pad = list(x.shape)
            pad[dim] = -n % t
            x = torch.cat([x, x.new_zeros(pad)], dim)
        return x.chunk(t, dim)[r]

    # --- ColumnParallelLinear, with and without gather_output ---
    full = nn.Linear(D, 12).to(dev)
    x, w = torch.randn(B, T, D, device=dev, requires_grad=True), torch.randn(B, T, 12, device=dev)
    (full(x) * w).sum().backward()
    for gather in (True, False):
        col = mt.ColumnParallelLinear.from_full(full, group, gather_output=gather)
        x2 = x.detach().clone().requires_grad_()
        mt.COMM.reset()
        y = col(x2)
        want, wt = (full(x), w) if gather else (shard_of(full(x), -1), shard_of(w, -1))
        close(f"column(gather_output={gather}) output", y, want)
        (y * wt).sum().backward()
        close(f"column(gather_output={gather}) input grad", x2.grad, x.grad)
        close(f"column(gather_output={gather}) weight grad", col.weight.grad, shard_of(full.weight.grad, 0))
        close(f"column(gather_output={gather}) bias grad", col.bias.grad, shard_of(full.bias.grad, 0))
        counts(f"column(gather_output={gather}) collectives",
               {"all_reduce/tp/bwd": 1, **({"all_gather/tp/fwd": 1} if gather else {})},
               {"all_reduce/tp/bwd": B * T * D * es, **({"all_gather/tp/fwd": B * T * 12 // t * es} if gather else {})})

    # --- RowParallelLinear, input split here or already parallel ---
    full = nn.Linear(12, D).to(dev)
    x, w = torch.randn(B, T, 12, device=dev, requires_grad=True), torch.randn(B, T, D, device=dev)
    (full(x) * w).sum().backward()
    for parallel in (False, True):
        row = mt.RowParallelLinear.from_full(full, group, input_is_parallel=parallel)
        x2 = (shard_of(x, -1) if parallel else x).detach().clone().requires_grad_()
        y = row(x2)
        close(f"row(input_is_parallel={parallel}) output", y, full(x))
        (y * w).sum().backward()
        close(f"row(input_is_parallel={parallel}) input grad", x2.grad, shard_of(x.grad, -1) if parallel else x.grad)
        close(f"row(input_is_parallel={parallel}) weight grad", row.weight.grad, shard_of(full.weight.grad, 1))
        close(f"row(input_is_parallel={parallel}) bias grad", row.bias.grad, full.bias.grad)
    differs("row partial product before g vs full output", F.linear(shard_of(x, -1), row.weight) + row.bias, full(x))

    # --- MLP and attention, plain and sequence parallel ---
    cfg = GPTConfig(vocab=12, seq_len=T, d_model=D, n_heads=H, n_layers=1, dropout=0.0)
    for name, Full, Par in (("mlp", MLP, mt.ParallelMLP), ("attention", Attention, mt.ParallelAttention)):
        ref = Full(cfg)
        if name == "attention":  # biased q, k, v (common.Attention has none): a dropped bias would show
            ref.q, ref.k, ref.v = (nn.Linear(D, D) for _ in range(3))
        for p in ref.parameters():  # nonzero biases, so a bias added t times would show
            nn.init.normal_(p, 0.0, 0.3)
        ref.to(dev)
        x, w = torch.randn(B, T, D, device=dev, requires_grad=True), torch.randn(B, T, D, device=dev)
        (ref(x) * w).sum().backward()
        grads = {n: p.grad for n, p in ref.named_parameters()}
        for sp in (False, True):
            par = Par(ref, group, sp, tracker)
            x2 = (shard_of(x, 1) if sp else x).detach().clone().requires_grad_()  # (B, T/t, D) chunk under SP
            mt.COMM.reset()
            y = par(x2)
            tag = f"{name}{' (SP)' if sp else ''}"
            close(f"{tag} output", y, shard_of(ref(x), 1) if sp else ref(x))
            (y * (shard_of(w, 1) if sp else w)).sum().backward()
            close(f"{tag} input grad", x2.grad, shard_of(x.grad, 1) if sp else x.grad)
            for n, p in par.named_parameters():
                if p.grad is None:  # a layer the forward never ran (the old attention's q/k/v biases)
                    failures.append(f"{tag} grad {n}: none")
                    continue
                g = p.grad.clone()
                if sp and not mt.is_split(p):  # a replicated bias saw only this rank's positions
                    mt.all_reduce(g, group, "test")
                close(f"{tag} grad {n}", g, shard_of(grads[n], p.tp_dim) if mt.is_split(p) else grads[n])
            mt.COMM.calls.pop("all_reduce/tp/test", None)
            mt.COMM.bytes.pop("all_reduce/tp/test", None)
            # one all-reduce per direction; under SP one AG + RS pair per direction, + the re-gather backward
            one = {"all_gather/tp/fwd": 1, "reduce_scatter/tp/fwd": 1, "reduce_scatter/tp/bwd": 1,
                   "all_gather/tp/bwd": 2} if sp else {"all_reduce/tp/fwd": 1, "all_reduce/tp/bwd": 1}
            bsd = B * T * D * es  # bytes of one (B, T, D) activation; an all-gather is handed 1/t of it
            handed = {"all_gather/tp/fwd": bsd // t, "reduce_scatter/tp/fwd": bsd, "reduce_scatter/tp/bwd": bsd,
                      "all_gather/tp/bwd": 2 * bsd // t} if sp else {"all_reduce/tp/fwd": bsd, "all_reduce/tp/bwd": bsd}
            counts(f"{tag} collectives", one, handed)
        if name == "attention":  # the old forward, F.linear(x, lin.weight), dropped the q/k/v biases
            def weights_only(self, x):
                x = (mt.all_gather(x, 1, self.group, "test") if self.sp else x)
                q, k, v = (rearrange(F.linear(x, lin.weight), "b t (h e) -> b h t e", h=self.heads)
                           for lin in (self.q, self.k, self.v))
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                return self.proj(rearrange(y, "b h t e -> b t (h e)"))
            with torch.no_grad():
                differs("attention with q/k/v biases dropped (the old forward) vs unsharded",
                        weights_only(par, shard_of(x, 1)), shard_of(ref(x), 1))

    # --- activations one block saves for backward: under SP exactly 1/t of the unsharded block's ---
    def saved_by(block, x):  # contiguous: a chunk view would count the whole storage it views
        with SavedActivations() as saved:
            block(x.detach().contiguous().requires_grad_())
        return saved.bytes

    blk, x = Block(cfg).to(dev), torch.randn(B, T, D, device=dev)
    whole = saved_by(blk, x)
    tp_only = saved_by(mt.ParallelBlock(blk, group, False, tracker), x)
    with_sp = saved_by(mt.ParallelBlock(blk, group, True, tracker), shard_of(x, 1))
    equal("block saved bytes under SP, times t, vs the unsharded block's", with_sp * t, whole)
    equal("block saved bytes with TP alone exceed 1/t (replicated LN / residual)", tp_only * t > whole, True)

    def saves_gathered(self, x, *shared):  # the defect, put back: autograd keeps the all-gathered (B, T, D) X
        with torch.no_grad():  # forward only (bytes are counted, no backward): F.linear still saves its input
            full = mt.all_gather(x.detach(), 1, self.group, "test") if self.sp else x
        ys = tuple(F.linear(full, lin.weight, lin.bias) for lin in (self, *shared))
        return ys if shared else ys[0]
    real, mt.ColumnParallelLinear.forward = mt.ColumnParallelLinear.forward, saves_gathered
    try:
        gathered = saved_by(mt.ParallelBlock(blk, group, True, tracker), shard_of(x, 1))
    finally:
        mt.ColumnParallelLinear.forward = real
    equal("the check fails when the column layers save the gathered input", gathered * t != whole, True)
    d.log(f"saved per block: unsharded {whole} B; TP {tp_only} B ({tp_only / whole:.3f}); TP + SP {with_sp} B "
          f"({with_sp / whole:.3f}, 1/t = {1 / t:.3f}); SP saving the gathered input {gathered} B "
          f"({gathered / whole:.3f})")

    # --- torch's DTensor tensor parallel as an independent reference for the MLP ---
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        ref = MLP(cfg).to(dev)
        dt = parallelize_module(copy.deepcopy(ref), init_device_mesh(d.device.type, (t,)),
                                {"fc": ColwiseParallel(), "proj": RowwiseParallel()})
        par = mt.ParallelMLP(ref, group, False, tracker)
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
    gpt = mt.ParallelGPT(build_gpt(cfg, 0, torch.float64), group, False, tracker)
    marks = [(n, getattr(p, "tp_dim", None)) for n, p in gpt.named_parameters()]
    gpt.to(dev)
    equal("split marks after .to(device)", [(n, getattr(p, "tp_dim", None)) for n, p in gpt.named_parameters()], marks)
    equal("every parameter on the device", {p.device for p in gpt.parameters()}, {torch.device(dev)})

    # --- VocabParallelEmbedding: unpadded and padded vocabularies ---
    for V in (12, 11, 9):
        full = nn.Embedding(V, D).to(dev)
        idx = torch.randint(0, V, (B, T), device=dev)
        w = torch.randn(B, T, D, device=dev)
        (full(idx) * w).sum().backward()
        for sp in (False, True):
            emb = mt.VocabParallelEmbedding.from_full(full, group, sequence_parallel=sp)
            y = emb(idx)
            tag = f"embedding V={V} (pad {-V % t}){' SP' if sp else ''}"
            close(f"{tag} output", y, shard_of(full(idx), 1) if sp else full(idx))
            (y * (shard_of(w, 1) if sp else w)).sum().backward()
            close(f"{tag} weight grad", emb.weight.grad, shard_of(full.weight.grad, 0))

    # --- vocab-parallel cross-entropy vs F.cross_entropy, with IGNORE targets ---
    N = 24
    for V in (12, 11, 9):
        logits = torch.randn(N, V, device=dev, requires_grad=True) * 3
        target = torch.randint(0, V, (N,), device=dev)
        target[::5] = IGNORE
        want = F.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
        gw = torch.randn(N, device=dev)
        grad_full, = torch.autograd.grad((want * gw).sum(), logits)
        V_pad = V + (-V % t)
        junk = torch.cat([logits.detach(), torch.full((N, V_pad - V), 50.0, device=dev)], 1)  # big logits in the padding
        local = junk.chunk(t, 1)[r].clone().requires_grad_()
        got = mt.vocab_parallel_cross_entropy(local, target, V, group)
        tag = f"cross-entropy V={V} (pad {V_pad - V})"
        close(f"{tag} loss", got, want)
        (got * gw).sum().backward()
        close(f"{tag} logits grad", local.grad, shard_of(grad_full, 1))
        if V_pad > V:  # the padding is predictable if the mask is dropped: it must be what the mask does
            unmasked = mt.vocab_parallel_cross_entropy(local, target, V_pad, group)
            differs(f"{tag} loss without the padding mask", unmasked, want)

    # --- dropout masks: TP regions differ across TP ranks, replicated regions agree, replicas differ ---
    for dp in (1, 2):  # t = world as one TP group, and the grid (2, t/2): two replicas
        tp = t // dp
        dp_rank, tp_rank = divmod(r, tp)
        tr = mt.RNGTracker(dev, 0, dp_rank, tp_rank)
        rep = F.dropout(torch.ones(512, device=dev), 0.5) != 0
        with tr.fork():
            inside = F.dropout(torch.ones(512, device=dev), 0.5) != 0
        masks = torch.stack([rep, inside]).to(torch.float64)
        everyone = mt.all_gather(masks[None], 0, group, "test")  # (t, 2, 512)
        for other in range(t):
            if other == r:
                continue
            o_dp, o_tp = divmod(other, tp)
            tag = f"dropout dp={dp} tp={tp}: rank {r} vs {other}"
            if o_dp == dp_rank:
                close(f"{tag} replicated-region mask (same replica)", everyone[other, 0], masks[0])
                differs(f"{tag} TP-region mask (other TP rank)", everyone[other, 1], masks[1])
            else:
                differs(f"{tag} replicated-region mask (other replica)", everyone[other, 0], masks[0])
                differs(f"{tag} TP-region mask (other replica)", everyone[other, 1], masks[1])
    # and inside a module: with dropout, a TP MLP's output is still replicated (its dropout is outside the TP
    # region, on the default stream); its attention's probability dropout uses the TP stream
    cfg_p = GPTConfig(vocab=12, seq_len=T, d_model=D, n_heads=H, n_layers=1, dropout=0.5)
    tracker = mt.RNGTracker(dev, 0, 0, r)
    for name, Full, Par in (("mlp", MLP, mt.ParallelMLP), ("attention", Attention, mt.ParallelAttention)):
        par = Par(Full(cfg_p).to(dev), group, False, tracker).train()
        x_p = torch.randn(B, T, D, device=dev)
        y = par(x_p)
        ys = mt.all_gather(y.detach()[None], 0, group, "test")
        close(f"{name} with dropout: output identical on every TP rank", ys.max(0).values, ys.min(0).values)
        differs(f"{name} with dropout vs without", y, par.eval()(x_p))

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
    if sys.argv[1:2] == ["--forget-tp-rng"]:  # `... --forget-tp-rng MEGATRON_ARGS`: a broken resume, on purpose
        del sys.argv[1]  # the tracker's TP-region stream is not restored: a restarted run redraws its masks
        mt.RNGTracker.load_state_dict = lambda self, state: None
        mt.main()
    else:
        main()
