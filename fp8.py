"""fp8.py: training in 8-bit floats as the large runs of 2024-26 do it: the GEMMs of every
transformer block (forward, and both GEMMs of backward) run through torch._scaled_mm on float8
operands, while the master weights, their gradients and AdamW stay in --dtype (float32). torch
2.14's _scaled_mm runs on CPU too, so everything here is real FP8 arithmetic, not an emulation, on a
laptop as on an H100.

An FP8 number has 8 bits: E4M3 (4 exponent bits, 3 mantissa: max 448, ~2 significant digits) or E5M2
(max 57344, 1.5 digits, more range). A tensor fits in FP8 only after it is scaled: q = fp8(t / s),
with s = amax / fp8_max chosen so that the largest element lands on the format's largest value; a
GEMM of two quantized operands is (q_a @ q_b^T) * s_a * s_b. Where the amax comes from is the
recipe:
  current       per-tensor current scaling: the amax of the tensor as it is now (torchao's default).
  delayed       TransformerEngine's delayed scaling (Micikevicius et al., "FP8 Formats for Deep Learning",
                2022): the scale comes from the max of the last --amax-history amaxes, so it is
                known before the tensor is (no extra pass over it); E4M3 forward, E5M2 for the
                gradients (their range). Each layer keeps its own histories (a buffer, saved and
                moved with the model). torchao has deleted its delayed scaling (dynamic scaling
                only); TransformerEngine keeps it.
  fine-grained  DeepSeek-V3 (Tech. Report 2024, Sec. 3.3): one scale per 1x128 tile of an activation or
                gradient and per 128x128 block of a weight, E4M3 everywhere, so an outlier spoils
                128 numbers, not the tensor; and "promotion": the tensor cores' partial sums are
                moved to FP32 every 128 elements of K, where the tile scales are applied (Sec.
                3.3.2). torch 2.14's _scaled_mm takes 1x128 / 128x128 scales on CUDA sm90 only
                (cuBLASLt >= 12.9, no fast accumulation), not on sm100 nor on the CPU, so the
                blocked GEMM is written out, portable: one FP8 GEMM per 128 of K (per-tensor scales,
                which run everywhere), scaled in FP32.
The GEMMs of y = x W^T (x: M tokens x K, W: N x K) and the formats of their operands:
    forward   y  (M, N) = x (M, K)  @ W^T          x, W: E4M3                inner dim K
    dgrad     dx (M, K) = dy (M, N) @ W            dy: E5M2 (fine-grained E4M3)   inner dim N
    wgrad     dW (N, K) = dy^T (N, M) @ x          dy, x as above            inner dim M (tokens)
Every GEMM dimension is padded with zeros to whole tiles, M', N', K' (16: cuBLASLt's FP8 rule; 128
where fine-grained tiles run): zeros change no amax and add nothing to a product, and the padding is
cut from every result, so it reaches neither the loss nor the optimizer, and any size trains. On the
data-parallel axis (the other files' group of n ranks, each with its own M tokens):
  1. amax all-reduced (MAX) over the group, per GEMM: x's in forward, dy's in backward, and with
     --fp8-all-gather the weight shard's: two or three blocking all-reduces of 4 bytes per layer and
     step, so that every rank scales as one process seeing the whole batch would
     (TransformerEngine's amax reduction) and --check is exact. torchao scales x and dy by each
     rank's own amax instead, and reduces all the weights' amaxes in one all-reduce after the
     optimizer step. Per-tensor recipes only: fine-grained tiles never cross a rank (each rank's
     tokens are padded to whole tiles).
  2. ZeRO-3 sharding of the FP8 layers' weights by rows (a row is one output feature, so a shard is
     whole
     rows and whole 128x128 blocks; zero.py shards any module): W is padded with zero rows to n
     shards of whole tiles, as zero.py pads its flat shards, the last shards short or empty.
     Gathered before forward and again for backward, the weight gradient reduce-scattered. By
     default the gather moves bf16 (FSDP2's mixed precision), then each rank quantizes the whole
     weight; --fp8-all-gather quantizes the shard first (amax all-reduced) and gathers FP8 bytes and
     the block scales: half of bf16's bytes (torchao's float8 all-gather for FSDP2).

        rank r:  W shard (N'/n, K') fp32 --quantize--> fp8 shard --all-gather (uint8)--> W fp8 (N', K')
                 backward: dW (N', K') from my tokens --reduce-scatter (sum)--> dW shard (N'/n, K')
                 fp32

Embeddings, LayerNorms, attention, the LM head and the biases stay in --dtype and replicated
(DeepSeek-V3 keeps these in high precision too); their gradients are all-reduced. --recipe none and
--recipe bf16 (torch autocast, --dtype float32) are the baselines. docs/fp8.md: what FP8 costs in
loss (600 steps) and saves in bytes. The masters default to float64 here: --check then holds at 1e-9
(float32's roundoff, moved across an FP8 rounding boundary, grows chaotically; docs/fp8.md says how
far). On CUDA the FP8 GEMMs need compute capability 8.9 or more (Ada, Hopper, Blackwell): an older
GPU is refused in one line.

    python fp8.py --recipe current --check
    torchrun --nproc_per_node=2 fp8.py --recipe current --check
    torchrun --nproc_per_node=2 fp8.py --recipe delayed --amax-history 16 --check
    torchrun --nproc_per_node=4 fp8.py --recipe fine-grained --check
    torchrun --nproc_per_node=3 fp8.py --recipe current --fp8-all-gather --batch-size 6 --check

In production, use torchao.float8 (with FSDP2) or NVIDIA TransformerEngine.
"""

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn

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
    Run,
    check_against_reference,
    check_common_args,
    env_world_size,
    parse_args,
    peak_memory_bytes,
    state_bytes,
)


@dataclass
class Args(CommonArgs):
    # bf16, none: baselines
    recipe: Literal["current", "delayed", "fine-grained", "bf16", "none"] = "current"
    amax_history: int = 16  # delayed: amaxes kept per tensor; the scale comes from their max
    # all-gather the sharded weights as FP8 + scales (default: as bf16)
    fp8_all_gather: bool = False
    # master weights (--check: float64 only)
    dtype: Literal["float32", "float64", "bfloat16"] = "float64"


# ============================================================================= FP8 numbers and the
# GEMM
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
# DeepSeek-V3's tile: 1x128 of activations and gradients, 128x128 of weights, promotion every 128
TILE = 128


def check_format(fmt):
    if fmt not in (E4M3, E5M2):
        raise ValueError(f"FP8 format must be torch.float8_e4m3fn or torch.float8_e5m2, got {fmt}")


def scale_of(amax, fmt):
    """s = amax / fp8_max: the largest element lands on the format's largest value (torchao stores
    the inverse, fp8_max / amax, and multiplies). float32 whatever the default dtype: _scaled_mm's
    scales are."""
    return amax.float().clamp_min(1e-12) / torch.finfo(fmt).max


def quantize(t, s, fmt):
    """t (R, C) high precision -> FP8 (R, C): t / s, saturated at the format's largest value
    (delayed scaling can meet an amax above its history's). `s`: a scalar, or one per tile, (R, C/T)
    or (R/T, C/T)."""
    if s.dim():  # one scale per tile: (R', C') -> (R, C)
        s = s.repeat_interleave(t.shape[0] // s.shape[0], 0).repeat_interleave(
            t.shape[1] // s.shape[1], 1
        )
    fmax = torch.finfo(fmt).max
    return (t / s).clamp(-fmax, fmax).to(fmt)


def per_row(s, rows):
    """Scales of an operand (rows, K) as one per row and K-tile, (rows, K/T): a block's scale for
    each of its rows. A scalar stays a scalar."""
    return s.repeat_interleave(rows // s.shape[0], 0) if s.dim() else s


def whole(n, tile):  # n rounded up to whole tiles
    return -(-n // tile) * tile


def pad(t, rows, cols):
    """t (R, C) -> (rows, cols), zeros after: they change no amax and add nothing to a product."""
    return nn.functional.pad(t, (0, cols - t.shape[1], 0, rows - t.shape[0]))


def scaled_mm(a, sa, b, sb):
    """a (M, K) and b (N, K) in FP8 with their scales -> a @ b^T (M, N) in float32. Per-tensor
    scales: one FP8 GEMM, the scales applied to its FP32 sum, as cuBLASLt's epilogue applies scale_a
    and scale_b (the CPU kernel given them dequantizes first, in an order of its own). Tile scales,
    sa (M, K/T) and sb (N, K/T): the blocked GEMM of DeepSeek-V3 Sec. 3.3.2, one FP8 GEMM per 128 of
    K, its partial sum promoted to FP32 where the two tiles' scales multiply it."""
    one = torch.ones((), dtype=torch.float32, device=a.device)
    # noqa: E731  cuBLASLt's layout: a row-major, b column-major
    mm = lambda a, b: torch._scaled_mm(
        a.contiguous(), b.contiguous().t(), scale_a=one, scale_b=one, out_dtype=torch.float32
    )
    if not sa.dim():
        return mm(a, b) * (sa * sb)
    acc = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32, device=a.device)  # (M, N) FP32
    for k in range(a.shape[1] // TILE):
        cols = slice(k * TILE, (k + 1) * TILE)
        acc += mm(a[:, cols], b[:, cols]) * sa[:, k, None] * sb[None, :, k]
    return acc


# ============================================================================= the scaling recipes
def global_amax(t, group):
    """max |t| over the tensor's pieces on every rank of `group` (None: t is whole here): one all-reduce
    (MAX) of one number, so each rank scales as one process with the whole batch would."""
    amax = t.detach().abs().amax().float().reshape(1)  # (1,)
    if group is not None:
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    return amax[0]


class Current:
    """Per-tensor current scaling: s = amax(t) / fp8_max, the amax of the tensor now, reduced over
    `group`. E4M3 for the forward operands, E5M2 for the gradients (TransformerEngine's HYBRID
    formats)."""

    fwd = E4M3
    bwd = E5M2
    tile = None

    def __init__(self, fwd=None, bwd=None):
        self.fwd, self.bwd = fwd or self.fwd, bwd or self.bwd
        check_format(self.fwd), check_format(self.bwd)

    def scale(self, t, fmt, history, group, block=False):
        return scale_of(global_amax(t, group), fmt)


class Delayed(Current):
    """TransformerEngine's delayed scaling: s = max(the last `history` amaxes of this tensor) /
    fp8_max, known before the tensor is; the amax of the tensor now (reduced over the group) joins
    the history for the steps after. The first step has no history (all 0) and scales by its own
    amax (TE starts from s = 1). Each history is its layer's own buffer (Fp8Linear.amax_history),
    saved and moved with the model."""

    def __init__(self, history=16, fwd=None, bwd=None):
        super().__init__(fwd, bwd)
        if history < 1:
            raise ValueError(f"delayed scaling needs an amax history of at least 1, got {history}")
        self.history = history

    # history (n,) this tensor's, newest first
    def scale(self, t, fmt, history, group, block=False):
        amax = global_amax(t, group)
        past = history.max()
        s = scale_of(torch.where(past > 0, past, amax), fmt)  # no host sync
        history.copy_(torch.cat([amax.reshape(1), history[:-1]]))
        return s


class FineGrained:
    """DeepSeek-V3's fine-grained scaling: one scale per 1x128 tile along the GEMM's inner dimension
    (per 128x128 block for a weight: `block`), E4M3 for all. A tile lies within a rank's rows, so no
    reduction."""

    tile = TILE

    def __init__(self, fwd=E4M3, bwd=E4M3):
        self.fwd, self.bwd = fwd, bwd
        check_format(fwd), check_format(bwd)

    # t (R, C) -> (R, C/128), or (R/128, C/128)
    def scale(self, t, fmt, history, group, block=False):
        amax = t.detach().abs().unflatten(1, (-1, TILE)).amax(2).float()  # (R, C/128)
        if block:
            amax = amax.unflatten(0, (-1, TILE)).amax(1)  # (R/128, C/128)
        return scale_of(amax, fmt)


# ============================================================================= the FP8 linear,
# ZeRO-3-sharded
class Fp8Matmul(torch.autograd.Function):
    """x (M, K) @ W^T -> (M, N), the three GEMMs in FP8; W is gathered from its shards for forward
    and again for backward (ZeRO-3: it is not kept in between), its gradient reduce-scattered back
    to the shards. Every operand is padded with zeros to whole tiles ('), and the padding cut off
    each result."""

    @staticmethod
    def forward(ctx, x, w_shard, layer):
        r = layer.recipe
        m = x.shape[0]
        x = pad(x, whole(m, layer.tile), layer.k)  # (M', K')
        w, sw = layer.gather_weight(w_shard)  # (N', K') FP8, its scale(s)
        sx = r.scale(x, r.fwd, layer.amax_history[0], layer.group)  # () or (M', K'/128)
        y = scaled_mm(quantize(x, sx, r.fwd), sx, w, per_row(sw, w.shape[0]))  # (M', N')
        ctx.save_for_backward(x, w_shard, sx, sw)
        ctx.layer = layer
        return y[:m, : layer.out_features].to(x.dtype)  # (M, N)

    @staticmethod
    def backward(ctx, dy):  # dy (M, N)
        x, w_shard, sx, sw = ctx.saved_tensors
        layer = ctx.layer
        r = layer.recipe
        m = dy.shape[0]
        w, _ = layer.gather_weight(w_shard, sw)  # (N', K') FP8, quantized with forward's scale(s)
        dy = pad(dy, x.shape[0], w.shape[0])  # (M', N')
        # dgrad: dx (M, K) = dy (M, N) @ W (N, K); inner dim N, so W enters as W^T (K, N)
        sg = r.scale(dy, r.bwd, layer.amax_history[2], layer.group)  # () or (M', N'/128)
        # wgrad: dW (N, K) = dy^T (N, M) @ x (M, K); inner dim M. Per-tensor scales are the same as
        # above;
        dx = scaled_mm(
            quantize(dy, sg, r.bwd), sg, w.t(), per_row(sw.t() if sw.dim() else sw, layer.k)
        )
        # tiles now run along the tokens (DeepSeek-V3's 128x1 tiles of dy and x): quantized again.
        sgt, sxt = sg, sx
        if r.tile:
            sgt = r.scale(dy.t(), r.bwd, None, None)  # (N', M'/128)
            sxt = r.scale(x.t(), r.fwd, None, None)  # (K', M'/128)
        # (N', K')
        dw = scaled_mm(quantize(dy.t(), sgt, r.bwd), sgt, quantize(x.t(), sxt, r.fwd), sxt)
        # summed over ranks in the master dtype (exact in float64 for float32 partials: any order,
        # one answer)
        dx = dx[:m, : layer.in_features].to(x.dtype)  # (M, K)
        return dx, layer.reduce_scatter(dw.to(w_shard.dtype)), None


class Fp8Linear(nn.Module):
    """nn.Linear's y = x W^T + b with the GEMMs in FP8 (Fp8Matmul). `weight`, `bias`: the whole
    layer's. With a `group` of n ranks, W's rows are sharded (ZeRO-3: the weight is the big tensor;
    its rows are the GEMM's output features, so a shard is whole rows and whole 128-row blocks;
    zero.py shards any module) and b is kept as it is, replicated. Every GEMM dimension is padded
    with zeros to whole tiles, 16 (cuBLASLt's FP8 rule) or 128 (fine-grained tiles), and W to n
    shards of `rows` rows each, as zero.py pads its flat shards: the last shards are short or empty.
    The padding is never a parameter: it reaches neither the loss nor the optimizer. `amax_history`:
    the delayed recipe's history of x, W and dy, this layer's."""

    def __init__(self, weight, bias, recipe, group=None, fp8_all_gather=False):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.world = 1 if group is None else dist.get_world_size(group)
        rank = 0 if group is None else dist.get_rank(group)
        self.recipe = recipe
        self.group = group
        self.fp8_all_gather = fp8_all_gather
        self.tile = recipe.tile or 16
        self.k = whole(self.in_features, self.tile)  # K'
        self.rows = whole(self.out_features, self.world * self.tile) // self.world  # N' / n
        # (<= rows, K) my rows of W: short or empty in the last shards
        mine = weight.detach()[rank * self.rows : (rank + 1) * self.rows]
        self.weight = nn.Parameter(mine.clone())
        self.bias = bias  # (N,) the same parameter, replicated
        n = getattr(recipe, "history", 0)
        self.register_buffer("amax_history", torch.zeros(3, n, device=weight.device))  # x, W, dy

    def forward(self, x):  # (..., K) -> (..., N)
        y = Fp8Matmul.apply(x.reshape(-1, self.in_features), self.weight, self)  # (M, N)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def gather_weight(self, shard, s=None):
        """The whole W (N', K') in FP8, its scale: () or (N'/128, K'/128) blocks; `s`: forward's,
        for backward."""
        r = self.recipe
        history = self.amax_history[1]
        given = s
        shard = pad(shard, self.rows, self.k)  # (N'/n, K') my rows, padded
        if self.group is None:  # not sharded: quantize W as it is
            s = r.scale(shard, r.fwd, history, None, block=True) if s is None else s
            return quantize(shard, s, r.fwd), s
        # FSDP2's mixed precision: gather bf16, then quantize the whole W
        if not self.fp8_all_gather:
            full = all_gather_rows(shard.to(torch.bfloat16), self.group).to(shard.dtype)  # (N', K')
            s = r.scale(full, r.fwd, history, None, block=True) if s is None else s
            return quantize(full, s, r.fwd), s
        # torchao's float8 all-gather: per tensor, the amax is reduced over the shards first;
        # fine-grained, a shard holds whole 128x128 blocks. Either way the quantized shard is my
        # rows of the quantized W. () or blocks
        s = r.scale(shard, r.fwd, history, self.group, block=True) if s is None else s
        rank = dist.get_rank(self.group)
        mine = s.chunk(self.world)[rank] if s.dim() and given is not None else s  # my rows' blocks
        q = quantize(shard, mine, r.fwd)  # (N'/n, K') FP8
        # gloo has no float8 type: the bytes travel as uint8 (NCCL's FP8 all-gather moves the same
        # bytes)
        w = all_gather_rows(q.view(torch.uint8), self.group).view(r.fwd)  # (N', K') FP8
        # the block scales travel with their rows: (N'/n/128, K'/128) each
        if s.dim() and given is None:
            s = all_gather_rows(s, self.group)  # (N'/128, K'/128)
        return w, s

    # (N', K') float32, this rank's tokens -> my rows of the sum, unpadded
    def reduce_scatter(self, dw):
        if self.group is not None:
            out = torch.empty(self.rows, self.k, dtype=dw.dtype, device=dw.device)  # (N'/n, K')
            dist.reduce_scatter_single(out, dw, op=dist.ReduceOp.SUM, group=self.group)
            dw = out
        return dw[: self.weight.shape[0], : self.in_features]


def all_gather_rows(shard, group):  # (R, C) on each rank -> (n R, C), rank 0's rows first
    out = torch.empty(
        shard.shape[0] * dist.get_world_size(group),
        *shard.shape[1:],
        dtype=shard.dtype,
        device=shard.device,
    )
    dist.all_gather_single(out, shard.contiguous(), group=group)
    return out


def to_fp8(model, recipe, group=None, fp8_all_gather=False, skip=("head",)):
    """Every nn.Linear of `model` but those named in `skip` becomes an Fp8Linear (sharded over
    `group`). Returns the names of the FP8 layers. A weight tied to another module's (an embedding
    and its head, one linear under two names) is refused before anything changes: an Fp8Linear keeps
    its own rows of W."""
    names = [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and n.split(".")[-1] not in skip
    ]
    held = [
        (n, p)
        for n, m in model.named_modules(remove_duplicate=False)
        for p in m.parameters(recurse=False)
    ]
    for name in names:
        weight = model.get_submodule(name).weight
        tied = [n for n, p in held if p is weight and n != name]
        if tied:
            raise ValueError(
                f"to_fp8: {name!r}'s weight is tied to {tied[0]!r} (one parameter), and an "
                "Fp8Linear "
                f"keeps its own copy of it: untie them, or put {name.split('.')[-1]!r} in skip"
            )
    for name in names:
        parent, _, attr = name.rpartition(".")
        lin = model.get_submodule(name)
        setattr(
            model.get_submodule(parent),
            attr,
            Fp8Linear(lin.weight, lin.bias, recipe, group, fp8_all_gather),
        )
    return names


def make_recipe(name, amax_history=16):
    return (
        {"current": Current, "fine-grained": FineGrained}[name]()
        if name != "delayed"
        else Delayed(amax_history)
    )


# ============================================================================= data parallel
# training step
def train_step(model, opt, x, y, loss_fn, group, clip, autocast=False):
    """One step on this rank's rows of the global batch. Sharded weights got their gradient (the sum
    over ranks) from Fp8Matmul's reduce-scatter; the replicated rest is all-reduced (sum) here.
    Clipping by the norm of the whole model: the shards' squares summed over ranks, the replicas'
    counted once. A parameter without a gradient (frozen, unused: the same on every rank) is
    skipped, as torch's optimizers skip it."""
    opt.zero_grad(set_to_none=True)
    # --recipe bf16's baseline
    with torch.autocast(x.device.type, torch.bfloat16, enabled=autocast):
        loss = loss_fn(model(x), y)  # this rank's share L_r of the global loss L = sum_r L_r
    loss.backward()
    params = [p for p in model.parameters() if p.grad is not None]
    fp8 = [
        m.weight for m in model.modules() if isinstance(m, Fp8Linear) and m.weight.grad is not None
    ]
    rest = [p for p in params if all(p is not w for w in fp8)]
    flat = torch.cat([p.grad.reshape(-1) for p in rest])  # (P_rest,) one all-reduce for all of them
    dist.all_reduce(flat, group=group)
    for p, g in zip(rest, flat.split([p.numel() for p in rest])):
        p.grad.copy_(g.view_as(p))
    sq = torch.stack([(w.grad**2).sum() for w in fp8] or [flat.new_zeros(())]).sum()  # () my shards
    dist.all_reduce(sq, group=group)
    norm = (sq + sum((p.grad**2).sum() for p in rest)).sqrt()
    if clip > 0:  # torch.nn.utils.clip_grad_norm_'s rule, with the whole model's norm
        coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
        for p in params:
            p.grad.mul_(coef.to(p.grad.dtype))
    opt.step()
    return loss.detach()


def check_args(args):
    world = env_world_size()
    check_common_args(args)
    if args.batch_size % world:
        fail(
            f"--batch-size {args.batch_size} is not divisible by the world size {world}: each rank "
            f"takes an equal slice; use a multiple of {world}"
        )
    if args.check and args.dtype != "float64":
        fail(
            f"--check compares with the reference at 1e-9 in float64 masters; in {args.dtype} FP8 "
            "rounding turns roundoff chaotic (docs/fp8.md): use --dtype float64 (the default) or "
            "drop --check"
        )
    if args.recipe == "bf16" and args.dtype != "float32":
        fail("--recipe bf16 (autocast) casts float32 only: use --dtype float32")
    if args.recipe in ("bf16", "none"):
        return
    if args.dtype == "bfloat16":
        fail("FP8 training keeps the master weights in --dtype: use --dtype float32 (or float64)")
    try:
        make_recipe(args.recipe, args.amax_history)
    except ValueError as e:
        fail(f"--recipe {args.recipe}: {e}")
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
        cap = "%d.%d" % torch.cuda.get_device_capability()
        fail(
            "FP8 GEMMs (torch._scaled_mm) need a GPU of compute capability 8.9 or more (Ada, "
            f"Hopper, Blackwell); this one is {cap}: use --recipe bf16 or none"
        )


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    check_args(args)
    d = init_dist(args.timeout)  # --- setup (same in every file) ---
    group = dist.group.WORLD
    data = MarkovData(args.vocab, args.seed)
    b = args.batch_size // d.world
    d.log(
        f"fp8: recipe {args.recipe}, world {d.world}, {b} sequences per rank, "
        f"entropy floor {data.entropy:.4f} nats/token"
    )
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    if args.recipe not in ("bf16", "none"):  # the delayed histories are the model's buffers
        to_fp8(model, make_recipe(args.recipe, args.amax_history), group, args.fp8_all_gather)
    opt = make_optimizer(model.parameters(), args)
    run = Run(d, args, {"model": model, "optim": opt})  # resumes from --ckpt-dir
    comm = CommCounter()
    # The log line's loss on a group of its own: on NCCL its own communicator, never queued behind
    # the amaxes' and the gradients' all-reduces.
    log_group = dist.new_group()
    for step in run.steps():
        # (B, T) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor on every rank
        x, y = (t[d.rank * b : (d.rank + 1) * b].to(d.device) for t in (x, y))  # (B/N, T) mine
        with run.watching(step, comm):
            loss = train_step(
                model,
                opt,
                x,
                y,
                lambda logits, y: lm_loss(logits, y, n_tok),
                group,
                args.clip,
                autocast=args.recipe == "bf16",
            )
        dist.all_reduce(loss, group=log_group)  # the global batch's loss, for the log line only
        run.end_step(step, loss.item())
    figures = summary(d, args, model, comm)
    peak = peak_memory_bytes(d, state_bytes(model, opt))
    full, check = full_params(model, group), None
    if args.check:
        ref = reference(args, d.world, d.device) if d.rank == 0 else None
        check = check_against_reference(d, args, run.losses, full, ref=ref, tol=1e-9, ptol=1e-9)
    run.finish("fp8", peak, figures["all_gather_bytes_per_step"], check, figures)


# --- measurement ---
def summary(d, args, model, comm):
    """Bytes per rank and step handed to each collective (counted at the dispatcher), the all-gather
    beside theory: every sharded weight gathered twice (forward, backward), its padded shard (rows x
    K', whole tiles: Fp8Linear), 1 byte an element in FP8, 2 in bf16, and with --fp8-all-gather
    fine-grained, its fp32 block scales once (backward reuses forward's)."""
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    elem, tiles = (1, args.recipe == "fine-grained") if args.fp8_all_gather else (2, False)
    theory = sum(
        2 * m.rows * m.k * elem + (4 * m.rows * m.k // TILE**2 if tiles else 0) for m in layers
    )
    f = dict(
        all_gather_bytes_per_step=comm.total("all_gather"),
        all_gather_bytes_theory=theory,
        reduce_scatter_bytes_per_step=comm.total("reduce_scatter"),
        all_reduce_bytes_per_step=comm.total("all_reduce"),
        all_reduce_calls_per_step=comm.total("all_reduce", what="calls"),
        fp8_layers=len(layers),
        shard_elements=sum(m.weight.numel() for m in layers),
        comm=comm.table(),
    )
    d.log(
        f"--- summary (rank 0 of {d.world}) ---\n"
        f"FP8 layers                       {len(layers)} ({args.recipe}), {f['shard_elements']} "
        "weight "
        f"elements in this rank's shards\n"
        f"all-gather per rank/step         {f['all_gather_bytes_per_step']} bytes (counted), "
        f"{theory} "
        f"(theory: 2 x padded shard elements x {elem}{' + block scales' if tiles else ''})\n"
        f"reduce-scatter per rank/step     {f['reduce_scatter_bytes_per_step']} bytes (counted)\n"
        f"all-reduce per rank/step         {f['all_reduce_bytes_per_step']} bytes in "
        f"{f['all_reduce_calls_per_step']} calls (counted: amaxes, replicated gradients, the norm)"
    )
    return f


def full_params(model, group):
    """The whole model by name (the Fp8Linear shards gathered in their dtype), as the reference
    names it."""
    layers = {id(m.weight): m for m in model.modules() if isinstance(m, Fp8Linear)}
    full = {}
    for n, p in model.named_parameters():
        m = layers.get(id(p))
        if m is not None:  # padded to whole shards, gathered, the padding cut
            p = all_gather_rows(pad(p.detach(), m.rows, m.in_features), group)[: m.out_features]
        full[n] = p.detach()
    return full


# --- reference for --check ---
# One process on the whole global batch, written apart from the technique: its own quantizer,
# formats and amax history, and each GEMM a plain float32 matmul of the FP8 values computed as the
# ranks compute it (rows cut into the ranks' rows; the sum scaled; fine-grained: per 128 of K, each
# partial sum scaled; the weight gradient per rank's tokens, summed in the master dtype). The amaxes
# are the whole batch's, as the run's all-reduced ones. With float64 masters everything outside the
# FP8 GEMMs is float64, the FP8 numbers are then the same, and the check holds at 1e-9 (measured
# 1e-16; it needs torch's float32 matmul and its FP8 GEMM to sum in one order, as they do on this
# CPU up to K = 256 at least: a different order moves a value across an FP8 rounding boundary now
# and then, and the runs then part as chaotically as in float32). With float32 masters, float32 sums
# in another order (the all-reduces, torch's own kernels on fewer rows) move values by a roundoff, a
# value a roundoff from an FP8 rounding boundary lands on the other side (1/16 of it), and roundoff
# grows chaotically (2e-2 in 20 steps): check_args refuses that.
REF_E4M3, REF_E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def ref_quant(t, fmt, tile=None, block=False, amax=None):
    """t (R, C) -> (its FP8 values as floats, scale): one scale (from `amax`, else |t|'s max), or
    one per 1 x tile (tile x tile with `block`) along the last dim, given per row: (R,
    ceil(C/tile)). A last tile or block shorter than `tile` has the amax of what it holds."""
    fmax = torch.finfo(fmt).max
    if tile is None:
        s = (t.abs().max().float() if amax is None else amax).clamp_min(1e-12) / fmax
        return (t / s).clamp(-fmax, fmax).to(fmt).float(), s
    r, c = t.shape
    rt = tile if block else 1
    v = torch.zeros(-(-r // rt) * rt, -(-c // tile) * tile, dtype=t.dtype, device=t.device)
    v[:r, :c] = t
    v = v.reshape(v.shape[0] // rt, rt, v.shape[1] // tile, tile)
    s = v.abs().amax(dim=(1, 3), keepdim=True).float().clamp_min(1e-12) / fmax  # (R', 1, C', 1)
    q = (v / s).clamp(-fmax, fmax).to(fmt).float().flatten(2).flatten(0, 1)[:r, :c]
    return q, s[:, 0, :, 0].repeat_interleave(rt, 0)[:r]  # (R, C')


def ref_mm(a, sa, b, sb, world, tile):
    """(a, sa) @ (b, sb)^T as the ranks compute it: a's rows split into the ranks' rows, each a
    float32 GEMM: per tensor, of the dequantized operands; with tiles, per 128 of K, each partial
    sum scaled and added."""
    out = []
    for rows, srows in zip(a.chunk(world), sa.chunk(world) if tile else [sa] * world):
        if not tile:  # the scales on the float32 sum, as cuBLASLt applies them
            out.append((rows @ b.t()) * (sa * sb))
            continue
        out.append(
            sum(
                (rows[:, k * tile : (k + 1) * tile] @ b[:, k * tile : (k + 1) * tile].t())
                * srows[:, k, None]
                * sb[None, :, k]
                for k in range(-(-a.shape[1] // tile))
            )
        )
    return torch.cat(out)


class RefQuant:
    """The recipe, as the reference applies it to whole tensors: delayed keeps its own amax
    history."""

    def __init__(self, args, world):
        self.recipe = args.recipe
        self.hist = {}
        self.n = args.amax_history
        self.world = world
        self.bf16_gather = not args.fp8_all_gather
        self.tile = 128 if args.recipe == "fine-grained" else None
        self.fmt = dict(fwd=REF_E4M3, bwd=REF_E4M3 if self.tile else REF_E5M2)

    def __call__(self, t, role, key, block=False):
        if self.tile:
            return ref_quant(t, self.fmt[role], self.tile, block)
        amax = t.abs().max().float()
        if self.recipe == "delayed":
            past = self.hist.get(key, [])
            self.hist[key] = ([amax] + past)[: self.n]
            # the scale the history gave before this amax joined it
            amax = max(past) if past else amax
        return ref_quant(t, self.fmt[role], amax=amax)


class RefFp8(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, q, key):  # x (M, K): the global batch's tokens; w (N, K) whole
        w_in = w.to(torch.bfloat16).to(w.dtype) if q.bf16_gather else w  # the run's bf16 all-gather
        xq, sx = q(x, "fwd", key + ".x")
        wq, sw = q(w_in, "fwd", key + ".w", block=True)
        ctx.save_for_backward(x, xq, sx, wq, sw)
        ctx.q, ctx.key = q, key
        return ref_mm(xq, sx, wq, sw, q.world, q.tile).to(x.dtype)

    @staticmethod
    def backward(ctx, dy):  # dy (M, N)
        x, xq, sx, wq, sw = ctx.saved_tensors
        q = ctx.q
        key = ctx.key
        t = ctx.q.tile
        gq, sg = q(dy, "bwd", key + ".dy")
        # W^T's rows are K: (K, ceil(N/128)) block scales
        swt = sw[::t].t().repeat_interleave(t, 0)[: x.shape[1]] if t else sw
        dx = ref_mm(gq, sg, wq.t(), swt, q.world, t).to(x.dtype)
        parts = []
        # each rank's tokens: a float32 GEMM; their sum in the master dtype
        for r in range(q.world):
            a, sa = gq.chunk(q.world)[r].t(), sg  # (N, M/n)
            b, sb = xq.chunk(q.world)[r].t(), sx  # (K, M/n)
            if t:  # the weight gradient's tiles run along this rank's tokens
                a, sa = ref_quant(dy.chunk(q.world)[r].t(), q.fmt["bwd"], t)
                b, sb = ref_quant(x.chunk(q.world)[r].t(), q.fmt["fwd"], t)
            parts.append(ref_mm(a, sa, b, sb, 1, t).to(x.dtype))
        return dx, sum(parts), None, None


class RefLinear(nn.Module):
    def __init__(self, lin, q, key):
        super().__init__()
        self.weight = lin.weight
        self.bias = lin.bias
        self.q = q
        self.key = key

    def forward(self, x):  # (..., K) -> (..., N)
        y = RefFp8.apply(x.reshape(-1, x.shape[-1]), self.weight, self.q, self.key)
        return y.view(*x.shape[:-1], -1) + (0 if self.bias is None else self.bias)


def reference(args, world, device):
    """One-process training on the global batch; the block linears quantized as the recipe says."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    if args.recipe not in ("bf16", "none"):
        q = RefQuant(args, world)
        lins = [
            n
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not n.endswith("head")
        ]
        for name in lins:
            parent, _, attr = name.rpartition(".")
            setattr(
                model.get_submodule(parent), attr, RefLinear(model.get_submodule(name), q, name)
            )
    opt, losses = make_optimizer(model.parameters(), args), []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        loss = lm_loss(model(x), y, count_tokens(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        losses.append(loss.item())
    return dict(losses=losses, params={n: p.detach().clone() for n, p in model.named_parameters()})


if __name__ == "__main__":
    main()
