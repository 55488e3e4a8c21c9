"""memory_savers.py: the memory savers that sit beside ZeRO (zero.py), each on plain data parallel,
each beside what it saves, measured.

ZeRO shards the model states (parameters, gradients, optimizer state). What is left per rank is the
activations autograd keeps from forward for backward, and the optimizer state itself. Three designs
of the literature cut those, and any of them composes with any data-parallel layout:

  --recompute full       activation recomputation (Chen, Xu, Zhang, Guestrin 2016): keep only each block's
                         input; backward re-runs the block's forward (the same dropout masks: the
                         RNG state is replayed) and takes its gradient from that. One extra forward
                         per block.
  --recompute selective  selective recomputation (Korthikanti et al. 2022): keep what is costly to compute,
                         the outputs of the linear layers (the matmuls: most of the FLOPs), and
                         recompute what is cheap and large: layer norms, the attention core (QK^T,
                         softmax, dropout, x V: the paper's 5 a s / h term), GELU, dropout. torch's
                         selective checkpointing.
  --compress-activations bf16|int8   Gist (Jain et al. 2018): each activation autograd saves is encoded
                         when forward saves it (bf16: a cast; int8: one absmax scale per row) and
                         decoded when backward needs it. Lossy by design: a gradient of slightly
                         wrong activations.
  --optimizer adafactor  Adafactor (Shazeer & Stern 2018): second moments factored into a row vector and a
                         column vector per matrix, no first moment: e (R + C) bytes per (R, C)
                         matrix, where AdamW keeps 2 e R C.

What one block keeps for backward (b sequences of T tokens, width D, e bytes per element; measured
in the summary, theory beside it):
    plain                        [ln1 | q k v | scores, softmax | proj | ln2 | fc | gelu | proj]  everything
    --recompute full             [x]                                                          1 b T D e
    --recompute selective        [x | q k v | proj | fc (4D) | proj]                          10 b T D e
    --compress-activations int8  [every saved tensor at 1 byte per element (+ a scale per row)]  ~ 1/e plain

    python memory_savers.py --recompute full --check                             # world 1
    torchrun --nproc_per_node=4 memory_savers.py --recompute selective --accum 2 --check
    torchrun --nproc_per_node=2 memory_savers.py --compress-activations int8 --check  # vs the same encoding
    torchrun --nproc_per_node=2 memory_savers.py --optimizer adafactor --check   # vs torch.optim.Adafactor
    torchrun --nproc_per_node=2 memory_savers.py --recompute full --dropout 0.1 --ckpt-dir ckpt --steps 10

In production: torch.utils.checkpoint (and its selective policies), torch.optim.Adafactor.
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    count_tokens,
    fail,
    init_dist,
    lm_loss,
    make_optimizer,
)
from harness import (
    CommCounter,
    CommonArgs,
    LiveStorages,
    Run,
    SavedActivations,
    check_against_reference,
    check_common_args,
    env_world_size,
    parse_args,
    peak_memory_bytes,
    state_bytes,
    tensor_bytes,
)


@dataclass
class Args(CommonArgs):
    accum: int = 1  # micro-batches per rank per optimizer step (gradient accumulation)
    recompute: Literal["none", "full", "selective"] = "none"  # recompute activations in backward
    # encode activations saved for backward
    compress_activations: Literal["none", "bf16", "int8"] = "none"
    # adafactor: factored second moments, no first moment
    optimizer: Literal["adamw", "adafactor"] = "adamw"


# ============================================================================= the base: data
# parallel
def dp_step(model, opt, micro_batches, loss_fn, clip=0.0, group=None, saver=None):
    """One step of plain data parallel (dp.py's sync_step): each rank's micro-batches (x, y) on the
    device, forward and backward, the gradients summed over `group`, clipping by the global norm,
    the step. `saver`: a context around each forward (Gist's saved-tensor hooks); recomputation
    lives in the model. loss_fn(out, y) sums over its rows and divides by the global batch's count.
    Returns this rank's loss (float64, on the device: no host sync per micro-batch)."""
    opt.zero_grad(set_to_none=True)
    total = 0
    for x, y in micro_batches:  # (B/(N*accum), T) each
        with saver or contextlib.nullcontext():
            out = model(x)  # what autograd keeps from here is what the savers cut
        loss = loss_fn(out, y)
        loss.backward()
        total = total + loss.detach().double()
    params = list(model.parameters())
    # checked before the collectives: a None cannot be all-reduced
    if any(p.grad is None for p in params):
        raise ValueError(
            "a parameter got no gradient: give each rank micro-batches; freeze what is unused"
        )
    for p in params:  # SUM: each rank's loss is already divided by the global token count
        dist.all_reduce(p.grad, group=group)
    if clip > 0:
        # the gradients agree everywhere: local norm = global
        torch.nn.utils.clip_grad_norm_(params, clip)
    opt.step()
    return total


# ============================================================================= 1. activation
# recomputation where the RNG stands (the CPU's, and the GPU's on one): dropout draws from it
def rng_state(
    device,
):
    return torch.get_rng_state(), torch.cuda.get_rng_state(
        device
    ) if device.type == "cuda" else None


@contextlib.contextmanager
# run the block under the RNG state `rng` saved; the RNG is left as it was
def replayed(rng, device):
    cpu, gpu = rng
    with torch.random.fork_rng(devices=[device] if gpu is not None else []):
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, device)
        yield


class Recompute(torch.autograd.Function):
    """Full recomputation (Chen et al. 2016, Sec. 3), as gpipe.py's --recompute: forward runs the
    block under no_grad, keeping only its input x (b, T, D) and the RNG state; backward reruns it
    from them with the graph (the same dropout masks) and backpropagates through it. Its parameters'
    gradients accumulate into their .grad there (a backward inside backward); x's is returned. The
    parameters are inputs too, only so that autograd calls backward when x needs no gradient (a
    first block fed the data itself)."""

    @staticmethod
    def forward(ctx, run, x, *params):
        ctx.run, ctx.rng = run, rng_state(x.device)
        ctx.save_for_backward(x)
        with torch.no_grad():
            return run(x)

    @staticmethod
    def backward(ctx, grad):  # grad: d loss / d block output (b, T, D)
        x = ctx.saved_tensors[0].detach().requires_grad_(ctx.needs_input_grad[1])
        with replayed(ctx.rng, x.device), torch.enable_grad():
            out = ctx.run(x)
        torch.autograd.backward(out, grad)
        return None, x.grad, *[None] * (len(ctx.needs_input_grad) - 2)

    @staticmethod
    def wrap(run, params, x):  # block.forward under full recomputation
        return Recompute.apply(run, x, *params)


# Selective: torch's selective activation checkpointing (SAC) policy keeps the outputs of the linear
# layers (MUST_SAVE); every other op of the block is run again in backward (PREFER_RECOMPUTE). On a
# GPU the attention core is one fused op; it is recomputed too.
KEEP = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in KEEP else CheckpointPolicy.PREFER_RECOMPUTE


def recompute(blocks, how):
    """Each block's forward (one input, one output) runs inside Recompute (full), or inside torch's
    checkpoint with its selective policy (selective: torch's mechanism, replaying the RNG as
    Recompute does). Parameter names and state_dict stay the model's own. With zero.py's Zero, apply
    it after Zero, to its units (full: any stage; selective: 0-2); before, Zero refuses it (the
    rerun would miss the parameters)."""
    if how not in ("none", "full", "selective"):
        raise ValueError(f"recompute {how!r}: use 'none', 'full' or 'selective'")
    sac = functools.partial(create_selective_checkpoint_contexts, keep_matmuls)
    for block in blocks if how != "none" else ():
        if how == "full":
            block.forward = functools.partial(
                Recompute.wrap, block.forward, tuple(block.parameters())
            )
        # (respect_saved_tensors_hooks=False: an outer pair of hooks is not the recomputation's)
        else:
            block.forward = functools.partial(
                checkpoint,
                block.forward,
                use_reentrant=False,
                context_fn=sac,
                respect_saved_tensors_hooks=False,
            )


# ============================================================================= 2. activation
# compression
class Encoded(NamedTuple):
    """An activation as kept for backward: bf16 (scale None), or int8 with one scale per row (last
    dim)."""

    data: torch.Tensor
    scale: Optional[torch.Tensor]
    dtype: torch.dtype


def encode(t, how):  # (..., C) -> bf16 (..., C), or int8 (..., C) and scales (..., 1)
    t = t.detach()
    if how == "bf16":
        return Encoded(t.to(torch.bfloat16), None, t.dtype)
    # row absmax -> 127
    scale = t.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny) / 127
    return Encoded(torch.round(t / scale).to(torch.int8), scale, t.dtype)


# back to the dtype forward saved it in; error <= half a step: |x| u, u = 2^-9 or absmax/254
def decode(
    e,
):
    x = e.data.to(e.dtype)
    return x if e.scale is None else x * e.scale


class Gist(torch.autograd.graph.saved_tensors_hooks):
    """Gist (Jain et al. 2018) as a pair of saved-tensor hooks: `with gist: out = model(x)`. Each
    floating- point activation autograd saves is encoded when forward saves it and decoded when
    backward needs it. The parameters (`keep`: held anyway) and integer tensors (token ids) are kept
    as they are. A tensor saved by several ops (the input of q, k and v) is encoded once while it is
    alive: the cache, cleared at every forward, remembers it (the graph holds the encodings
    themselves)."""

    def __init__(self, how, keep=()):
        if how not in ("bf16", "int8"):
            raise ValueError(f"Gist encoding {how!r}: use 'bf16' or 'int8'")
        self.how, self.cache = how, {}
        self.keep = {p.untyped_storage().data_ptr() for p in keep}
        super().__init__(self.pack, self.unpack)

    def __enter__(self):
        self.cache.clear()
        return super().__enter__()

    def pack(self, t):
        if not t.is_floating_point() or t.dim() == 0 or t.untyped_storage().data_ptr() in self.keep:
            return t
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        alive, e = self.cache.get(key, (None, None))
        if alive is None or alive.expired():
            e = encode(t, self.how)
            self.cache[key] = (StorageWeakRef(t.untyped_storage()), e)
        return e

    def unpack(self, x):
        return decode(x) if isinstance(x, Encoded) else x


# ============================================================================= 3. Adafactor
class Adafactor(torch.optim.Optimizer):
    """Adafactor (Shazeer & Stern 2018), computed as torch.optim.Adafactor does: beta1 = 0 (no first
    moment), 1 - beta2_t = t^-0.8, update clipping at RMS d = 1, decoupled weight decay, and the
    relative step alpha = max(1e-3, RMS(X)) min(lr, 1/sqrt t). Per step and parameter X with
    gradient G:
      matrix (R, C)  row <- lerp(row, mean_j G^2, 1 - beta2_t)  (R,);  col <- ... mean_i G^2  (C,)
                     V = row col^T / mean(row)   the rank-1 estimate of the second moment, never stored
      vector         V <- lerp(V, G^2, 1 - beta2_t)   (unfactored, as small as the vector)
      U = G / sqrt(V);  X <- X (1 - lr wd) - alpha U / max(1, RMS(U))"""

    def __init__(self, params, lr, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        big = [
            tuple(p.shape) for group in self.param_groups for p in group["params"] if p.dim() > 2
        ]
        # torch factors their last two dims; this one would keep a whole second moment instead
        if big:
            raise ValueError(
                f"shapes {big}: this Adafactor factors 2-D only; use torch.optim.Adafactor"
            )

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for x in (p for p in group["params"] if p.grad is not None):
                g = x.grad
                st = self.state[x]
                eps1 = torch.finfo(x.dtype).eps
                if not st:  # a plain number for the step: no host sync to read it
                    st["step"] = 0
                    st.update(
                        row=x.new_zeros(x.shape[0]), col=x.new_zeros(x.shape[1])
                    ) if g.dim() == 2 else st.update(var=torch.zeros_like(x))
                st["step"] = t = st["step"] + 1
                beta, rho = t**-0.8, min(lr, t**-0.5)
                alpha = x.square().mean().sqrt().clamp(min=1e-3) * rho  # (), on the device
                if g.dim() == 2:
                    st["row"].lerp_(g.square().mean(1), beta)  # (R,)
                    st["col"].lerp_(g.square().mean(0), beta)  # (C,)
                    # (R, C)
                    v = torch.outer(st["row"], st["col"]) / st["row"].mean().clamp(min=eps1)
                else:
                    v = st["var"].lerp_(g.square(), beta).clone()
                u = v.clamp_(min=eps1 * eps1).rsqrt_() * g
                x.mul_(1 - lr * wd).sub_(u * (alpha / u.square().mean().sqrt().clamp(min=1.0)))


# ----------------------------------------------------------------------------- main
def check_args(args, world):
    check_common_args(args)
    if args.accum < 1 or args.batch_size % (world * args.accum):
        fail(
            f"--batch-size {args.batch_size} must split into {world} ranks x --accum {args.accum} "
            f"micro-batches (--accum >= 1; e.g. --batch-size {world * max(args.accum, 1)})"
        )
    if args.recompute != "none" and args.compress_activations != "none":
        fail(
            "--recompute and --compress-activations: pick one (a recomputed block keeps little to "
            "compress)"
        )
    if args.compress_activations == "bf16" and args.dtype == "bfloat16":
        # (recomputation's exactness with dropout: memory_savers_checks.py)
        fail(
            "--compress-activations bf16 with --dtype bfloat16 saves nothing: use int8, or --dtype "
            "float32"
        )
    if args.check and args.dropout > 0:
        fail(
            f"--check needs --dropout 0 (got {args.dropout}): the one-process reference cannot "
            "replay the ranks' dropout streams"
        )


def main():
    args = parse_args(Args)
    check_args(args, env_world_size())
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    d.log(
        f"memory_savers.py on {d.world} ranks ({d.backend}): recompute {args.recompute}, compress "
        f"{args.compress_activations}, {args.optimizer}; entropy floor {data.entropy:.4f} "
        "nats/token"
    )
    # whole, one seed
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    rows = args.batch_size // d.world
    recompute(model.blocks, args.recompute)
    how = args.compress_activations
    # Gist's hooks go around each forward
    gist = Gist(how, model.parameters()) if how != "none" else None
    opt = (
        make_optimizer(model.parameters(), args)
        if args.optimizer == "adamw"
        else Adafactor(model.parameters(), args.lr, args.weight_decay)
    )
    acts = savers_measured(d, args, data, model, gist)  # one forward without the savers, one with
    torch.manual_seed(args.seed + d.rank)  # dropout masks differ per rank; a resume restores them
    run, comm = Run(d, args, {"model": model, "optim": opt}), CommCounter()
    # The log line's loss on a group of its own: on NCCL its own communicator, never queued behind
    # the gradients' all-reduces.
    log_group = dist.new_group()
    for step in run.steps():
        # (B, T) global, on the CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)
        # (B/N, T) mine
        x, y = (t[d.rank * rows : (d.rank + 1) * rows].to(d.device) for t in (x, y))
        with run.watching(step, comm):  # the bytes of the last step, seen at the dispatcher
            loss = dp_step(
                model,
                opt,
                zip(x.chunk(args.accum), y.chunk(args.accum)),
                lambda out, ym: lm_loss(out, ym, n_tok),
                args.clip,
                saver=gist,
            )
        dist.all_reduce(loss, group=log_group)  # the global batch's loss, for the log line only
        run.end_step(step, loss.item())
    figures = report(d, args, model, opt, acts, comm)
    # before --check trains
    peak = peak_memory_bytes(d, state_bytes(model, opt) + acts["saved"]["alive"])
    check = check_run(d, args, run.losses, dict(model.named_parameters())) if args.check else None
    run.finish("memory_savers", peak, comm.total(), check, figures)


# --- measurement --- (two extra forwards before training, watched from outside) ------------------
class MadeStorages(TorchDispatchMode):
    """Every storage an op makes inside the `with` block, held weakly (harness.LiveStorages), told
    apart by whether a transformer block made it. After a forward, `.alive()` is what is still held
    for backward, whoever holds it: autograd's saved tensors, a checkpoint's block inputs, the
    selective policy's cache, Gist's encodings. Storages that existed before (parameters, the token
    ids) are not counted."""

    def __init__(self, model, x):
        super().__init__()
        self.before = {t.untyped_storage().data_ptr() for t in [x, *model.parameters()]}
        self.blocks = LiveStorages()
        self.rest = LiveStorages()
        self.depth = 0
        self.hooks = [
            h
            for b in model.blocks
            for h in (
                b.register_forward_pre_hook(lambda *_: self._in(1)),
                b.register_forward_hook(lambda *_: self._in(-1)),
            )
        ]

    # (returns None: a hook's return value would replace the inputs or the output)
    def _in(self, k):
        self.depth += k

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self.before:
                (self.blocks if self.depth else self.rest).add(t)
        return out


def activations(model, x, saver=None):
    """One forward of micro-batch x (and no backward), drawing no RNG the run would see: the bytes
    of the storages it made that are alive when it returns (blocks, and the rest: embedding, final
    norm, head), and, without savers, what harness.SavedActivations sees autograd save (each storage
    once). CUDA's peak is reset after it, so that the peak the summary reports comes from the
    training steps."""
    devices = [x.device] if x.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), SavedActivations() as acts:
        with MadeStorages(model, x) as made, saver or contextlib.nullcontext():
            graph = model(x).grad_fn  # the graph stays alive, the logits themselves do not
        blocks, rest = made.blocks.alive(), made.rest.alive()
    del graph
    if x.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(x.device)
    return dict(blocks=blocks, rest=rest, alive=blocks + rest, saved=acts.bytes)


def savers_measured(d, args, data, model, gist):
    """What one micro-batch's forward keeps (activations): `plain` on a twin of the model (the same
    seed, no savers), `saved` on the model with its savers (recompute applied, Gist's hooks around
    it)."""
    mb = args.batch_size // (d.world * args.accum)
    x0 = data.batch(0, args.batch_size, args.seq_len)[0][:mb].to(d.device)  # (b, T)
    twin = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    return dict(plain=activations(twin, x0), saved=activations(model, x0, gist))


def optimizer_state(model, opt):
    """Bytes of the optimizer's state tensors, counted, and the closed forms of AdamW and
    Adafactor."""
    e, shapes = next(model.parameters()).element_size(), [p.shape for p in model.parameters()]
    psi = sum(s.numel() for s in shapes)
    counted = tensor_bytes(
        [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()]
    )
    factored = e * sum(s[0] + s[1] if len(s) == 2 else s.numel() for s in shapes)
    return dict(counted=counted, adamw_theory=2 * e * psi, adafactor_theory=factored, psi=psi)


def report(d, args, model, opt, acts, comm):
    """Rank 0's closing table: each figure counted in this run beside its theory value."""
    plain, saved = acts["plain"], acts["saved"]
    b = args.batch_size // (d.world * args.accum)
    T = args.seq_len
    D = args.d_model
    L = args.n_layers
    e = next(model.parameters()).element_size()
    per_block = {"none": None, "full": 1, "selective": 10}[
        args.recompute
    ]  # b T D elements kept per block
    theory = per_block and L * per_block * b * T * D * e
    ratio = {"none": None, "bf16": 2 / e, "int8": 1 / e}[args.compress_activations]
    st = optimizer_state(model, opt)
    d.log(
        f"\nactivations one micro-batch's forward keeps for backward (b={b}, T={T}, D={D}, L={L}, "
        f"e={e})"
    )
    d.log(f"  saved, plain (harness.SavedActivations)    {plain['saved']:>10,d} B")
    d.log(
        f"  alive after forward, plain: blocks {plain['blocks']:>10,d} B + rest {plain['rest']:,d} "
        "B"
    )
    d.log(
        f"  alive after forward, with savers: blocks {saved['blocks']:>10,d} B + rest "
        f"{saved['rest']:,d} B"
    )
    if theory:
        d.log(
            f"  --recompute {args.recompute}: blocks keep {saved['blocks']:,d} B | theory "
            f"{theory:,d} B = L x {per_block} b T D e"
        )
    if ratio:
        d.log(
            f"  --compress-activations {args.compress_activations}: with / plain "
            f"{saved['alive'] / plain['alive']:.3f} | theory {ratio:.3f} = "
            f"{args.compress_activations} "
            f"bytes / {e} (+ int8's scales per row, + integer tensors kept as they are)"
        )
    d.log(
        f"optimizer state: counted {st['counted']:,d} B | theory {args.optimizer} "
        f"{st[args.optimizer + '_theory']:,d} B (AdamW 2 e Psi = {st['adamw_theory']:,d} B; "
        f"Adafactor e (R + C) per matrix + e per vector element = {st['adafactor_theory']:,d} B)"
    )
    psi_bytes = st["psi"] * e
    d.log(
        f"bytes handed to collectives per rank per step: counted {comm.total():,d} B | theory "
        f"{psi_bytes:,d} B = e Psi: one all-reduce of every gradient"
    )
    return dict(
        activations=dict(
            plain=plain,
            with_savers=saved,
            recompute_theory_bytes=theory,
            compress_theory_ratio=ratio,
        ),
        saved_activation_bytes=saved["alive"],
        saved_activation_bytes_without_savers=plain["alive"],
        optimizer_state=st,
        comm_theory_bytes=psi_bytes,
    )


# --- reference for --check --- (one process, the same recipe) -------------------------------------
def check_run(d, args, losses, params):
    """Recomputation is exact: plain one-process training (common.reference_train). Compression and
    Adafactor have their own one-process reference, written independently below."""
    if args.compress_activations == "none" and args.optimizer == "adamw":
        return check_against_reference(d, args, losses, params)
    ref = reference(args, d.device) if d.rank == 0 else None
    return check_against_reference(d, args, losses, params, ref=ref)


def reference(args, device="cpu"):
    """One process, the whole global batch: torch.optim.Adafactor (foreach=False) for --optimizer
    adafactor; for --compress-activations, a forward whose saved tensors backward sees rounded
    exactly as the encoding rounds them (bf16: a round trip through bfloat16; int8: each row's
    absmax / 127 steps), written as a quantise-dequantise at save time: the same numbers, none of
    the memory saved."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt = (
        make_optimizer(model.parameters(), args)
        if args.optimizer == "adamw"
        else torch.optim.Adafactor(
            model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=False
        )
    )
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def rounded(t):
        if not t.is_floating_point() or t.dim() == 0 or t.untyped_storage().data_ptr() in params:
            return t
        if args.compress_activations == "bf16":
            return t.detach().to(torch.bfloat16).to(t.dtype)
        step = t.detach().abs().amax(-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny) / 127
        return torch.round(t.detach() / step) * step

    hooks = (
        torch.autograd.graph.saved_tensors_hooks(rounded, lambda t: t)
        if args.compress_activations != "none"
        else contextlib.nullcontext()
    )
    losses = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        with hooks:
            out = model(x)
        loss = lm_loss(out, y, count_tokens(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


if __name__ == "__main__":
    main()
