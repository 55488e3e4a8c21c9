"""zero.py: ZeRO stages 0-3 (stage 3 = FSDP) on the data-parallel group, written out, with CPU offload,
activation recomputation, mixed precision with dynamic loss scaling, and a sharded checkpoint that
reshards to another world size.

ZeRO (Rajbhandari, Rasley, Ruwase, He, 2020) removes the redundancy of data parallelism: each of N ranks
holds the whole model state, yet only 1/N of the update work needs to happen on it.
  stage 0  plain data parallel: all-reduce the gradients, every rank runs the whole AdamW step.
  stage 1  P_os: optimizer state sharded. Reduce-scatter the gradients, each rank updates its shard of the
           parameters with its shard of the Adam moments, then all-gather the parameters.
  stage 2  P_os+g: gradients sharded too: each unit's gradient is reduce-scattered as soon as backward has
           produced it (every micro-batch, asynchronously) and only this rank's shard of it is kept.
  stage 3  P_os+g+p: parameters sharded too (FSDP, Zhao et al. 2023). A unit (a transformer block; what is
           left of the model is the root unit) is all-gathered just before its forward, freed after it,
           all-gathered again for its backward, and its gradient reduce-scattered. As in FSDP (Sec. 3.3) the
           all-gather of the next unit is launched asynchronously before the current one computes, in
           forward and in backward, at most one ahead (FSDP's rate limiter): besides the root, only the unit
           running and the unit arriving are gathered at any time.
  --offload         ZeRO-Offload (Ren et al. 2021), the GeePS idea (Cui et al. 2016) of keeping off the GPU
                    what is not in use: the fp32 master shard and Adam moments live in CPU memory and the
                    optimizer step runs there. On a CPU-only machine the same code path runs.
  --recompute       activation recomputation per block (Chen et al. 2016), via torch.utils.checkpoint.
  --mixed-precision fp32 master shard, bf16/fp16 compute copy, gradients reduced in fp32 (Micikevicius et
                    al. 2018); fp16 adds dynamic loss scaling, with one skip decision for every rank.
  --optimizer adafactor   Adafactor (Shazeer & Stern 2018): factored second moments, a row and a column
                    vector per matrix instead of a matrix, no first moment; exact on flat shards that cut
                    through matrices (each rank sums its own squares, one all-reduce of the small vectors).
  --compress-activations  Gist (Jain et al. 2018): each activation autograd saves for backward is encoded
                    when forward saves it (bf16: a cast; int8: one absmax scale per row) and decoded when
                    backward needs it. Lossy by design: it trades gradient accuracy for activation memory.

Flat shards: each unit's parameters are flattened into one vector, padded to N*S elements, S = ceil(P/N),
and rank r owns elements [r*S, (r+1)*S), so any parameter count works at any world size:

    unit, P = 15, N = 4      [ w (3x4) ........... | b (3) | pad ]       16 = 4 * 4 elements
    owner                    [ rank 0 | rank 1 | rank 2 | rank 3 ]
    stage 3, per micro-batch (=> launch an async all-gather, <= wait for it; RS = async reduce-scatter)
      fwd: gather root, =>u0 | <=u0, =>u1, run u0, free u0 | <=u1, run u1, free u1 | loss
      bwd: gather root (head), =>u1 | <=u1, =>u0, grad u1, RS u1, free | <=u0, grad u0, RS u0 (waits RS u1),
           free | grad root, RS root; backward ends: wait the last RS

What rank 0 of N = 4 holds (# = held), and the model-state bytes per rank (Psi parameters; p and g bytes
per parameter and gradient element, K bytes of optimizer state per parameter; the paper's Fig. 1 uses
fp16 Adam: p = g = 2, K = 12 = fp32 master + m + v):
               parameters   gradients    Adam state
    stage 0   [########]   [########]   [########]      (p+g+K) Psi
    stage 1   [########]   [########]   [##      ]      (p+g) Psi + K Psi/N
    stage 2   [########]   [##      ]   [##      ]      p Psi + (g+K) Psi/N
    stage 3   [##      ]   [##      ]   [##      ]      (p+g+K) Psi/N   (+ root and two units gathered)

    python zero.py --stage 3 --check                                        # world 1: a shard is the whole
    torchrun --nproc_per_node=4 zero.py --stage 3 --accum 2 --check
    torchrun --nproc_per_node=4 zero.py --stage 2 --offload --recompute --mixed-precision bf16 --check
    torchrun --nproc_per_node=4 zero.py --stage 1 --ckpt-dir ckpt --save-every 5 --steps 10
    torchrun --nproc_per_node=2 zero.py --stage 3 --ckpt-dir ckpt --steps 20    # resumes at world 2
    torchrun --nproc_per_node=2 zero.py --stage 3 --optimizer adafactor --check  # vs torch's Adafactor
    torchrun --nproc_per_node=2 zero.py --stage 3 --compress-activations int8 --check  # bytes; loss vs plain

In production, use torch.distributed.fsdp.fully_shard (FSDP2) or DeepSpeed ZeRO.
"""
import copy, os
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.func import functional_call
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.checkpoint import checkpoint

from common import (DTYPES, GPTConfig, MarkovData, build_gpt, clip_grads_, close_dist, count_tokens, fail,
                    init_dist, lm_loss, make_optimizer)
from harness import (CommonArgs, StepTimer, check_against_reference, check_common_args, env_world_size,
                     gather_rows, log_step, maybe_fail, parse_args, peak_memory_bytes, tensor_bytes,
                     write_summary)

LOW = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# torch 2.13 renamed the flat collectives; older releases have only the *_into_tensor / *_tensor names
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Args(CommonArgs):
    stage: int = 0  # ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 +gradients, 3 +parameters (FSDP)
    accum: int = 1  # micro-batches per rank per optimizer step (gradient accumulation)
    offload: bool = False  # keep the master shard and Adam moments in CPU memory and step there (ZeRO-Offload)
    recompute: bool = False  # recompute each block's activations in backward (torch.utils.checkpoint)
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"  # low-precision compute copy; master stays --dtype
    loss_scale: float = 65536.0  # fp16: initial dynamic loss scale
    scale_window: int = 1000  # fp16: double the loss scale after this many clean steps in a row
    inject_overflow: int = -1  # fp16 test: put an inf into the last rank's gradient at this step
    compress_activations: Literal["none", "bf16", "int8"] = "none"  # encode the activations saved for backward
    optimizer: Literal["adamw", "adafactor"] = "adamw"  # adafactor: factored second moments, no first moment


# ----------------------------------------------------------------------------- stage 3: gather and release
class GatherParams(torch.autograd.Function):
    """Stage 3 (FSDP). Forward: the unit's flat parameters all-gathered from the N shards (prefetched by
    Zero.acquire). Backward: the gradient of the whole flat vector is reduce-scattered (asynchronously, in
    the master dtype: fp32 under mixed precision) into this rank's gradient shard; autograd gets None."""

    @staticmethod
    def forward(ctx, shard, unit):  # shard (S,) local -> (N*S,) global
        ctx.unit = unit
        return unit.zero.acquire(unit)

    @staticmethod
    def backward(ctx, grad_full):  # (N*S,) global, this rank's micro-batch gradient of the whole unit
        ctx.unit.zero.reduce_scatter_grad(ctx.unit, grad_full)
        ctx.unit.gathered = None  # the copy gathered again for backward is no longer needed: free it
        return None, None


class FlatUnit(nn.Module):
    """One unit: `module`'s own parameters flattened into one vector padded to N*S elements. Stages 0-2 hold
    the whole vector (`full`, the leaf autograd accumulates into); stage 3 holds only this rank's S
    elements (`shard`) and all-gathers the whole just before each use. The module keeps no parameters:
    each forward hands it views of the flat vector (torch.func.functional_call). The flat vector is made
    on the CPU, where the model was built; only what this rank keeps moves to the device."""

    def __init__(self, zero, module, prefix):
        super().__init__()
        self.zero, self.module = zero, module
        named = list(module.named_parameters())  # units inside `module` were replaced already: only its own
        self.names = [prefix + n for n, _ in named]  # names in the original model, for full_state_dict()
        self.local = [n for n, _ in named]  # names inside `module`, for functional_call
        self.shapes = [p.shape for _, p in named]
        self.offsets = [0]
        for _, p in named:
            self.offsets.append(self.offsets[-1] + p.numel())
        self.numel = self.offsets[-1]
        N, r, z = zero.world, zero.rank, zero
        self.S = -(-self.numel // N)  # shard length ceil(P / N); the last shards hold the padding
        self.padded, self.lo = self.S * N, r * self.S  # this rank owns flat elements [lo, lo + S)
        self.valid = max(0, min(self.S, self.numel - self.lo))  # real (not padding) elements in my shard
        flat = torch.zeros(self.padded, dtype=z.master_dtype)  # (N*S,) global, on the CPU
        if named:
            flat[:self.numel] = torch.cat([p.detach().cpu().flatten() for _, p in named])
        for n, _ in named:  # from here on the parameters exist only as (slices of) the flat vector
            owner, _, attr = n.rpartition(".")
            del module.get_submodule(owner)._parameters[attr]
        mine = flat if z.stage == 0 else flat[self.lo:self.lo + self.S]  # what this rank's optimizer updates
        if z.stage < 3:
            self.full = flat.to(z.device, z.compute_dtype, copy=True).requires_grad_()  # (N*S,) global, a leaf
            self.full.register_post_accumulate_grad_hook(self._grad_ready)
            self.compute = self.full.detach() if z.stage == 0 else self.full.detach()[self.lo:self.lo + self.S]
        else:
            # (S,) local. requires_grad only so that autograd runs GatherParams.backward.
            self.full, self.shard = None, mine.to(z.device, z.compute_dtype, copy=True).requires_grad_()
            self.compute = self.shard.detach()
        if z.separate_master:  # mixed precision or offload: the optimizer's own copy, in --dtype
            self.master = mine.to(z.master_device, copy=True)
            if z.offload:  # the gradient shard is copied into a host buffer and the step runs on the CPU
                self.master.grad = torch.zeros_like(self.master)
        else:
            self.master = self.compute  # the same storage: AdamW updates the parameters in place
        # the gradient accumulator, in the master dtype: whole (N*S,) in stages 0-1, this rank's (S,) in 2-3
        self.grad = torch.zeros(self.padded if z.stage <= 1 else self.S, dtype=z.master_dtype, device=z.device)
        self.in_forward = None  # stage 3: where the gathered flat vector lies while this unit runs forward
        self.gathered = None  # stage 3: the flat vector gathered again for this unit's backward

    def views(self, full):  # {name inside module: view of the flat vector with the parameter's shape}
        # One split, not a slice per parameter: each slice's backward would build a zero tensor the size of
        # the whole unit (bench.py measured 150-180 ms vs 30 ms for one block's backward on CPU).
        a, b = self.offsets[0], self.offsets[-1]
        parts = full[a:b].split([hi - lo for lo, hi in zip(self.offsets, self.offsets[1:])])
        return {n: p.view(s) for n, p, s in zip(self.local, parts, self.shapes)}

    def forward(self, *args):
        if self.zero.recompute and self.module is not self.zero.model:
            # Keep only the block input; in backward torch.utils.checkpoint (non-reentrant) re-runs _run,
            # which in stage 3 all-gathers the unit again: that is the backward's gather.
            for a in args:
                self.zero.meter.count_saved(a)
            return checkpoint(self._run, *args, use_reentrant=False)
        return self._run(*args)

    def _run(self, *args):
        if self.zero.stage < 3 or not self.numel:  # (a root unit may have no parameters of its own)
            return functional_call(self.module, self.views(self.full), args)
        full = GatherParams.apply(self.shard, self)  # (N*S,) global: all-gathered just before use
        self.in_forward = full.untyped_storage().data_ptr()  # where it lies, for Zero._pack (not a reference)
        try:
            return functional_call(self.module, self.views(full), args)
        finally:
            self.in_forward = None  # `full` dies here: saved views of it were packed as positions (Zero._pack)

    def _grad_ready(self, full):  # stages 0-2: autograd has accumulated this micro-batch's gradient
        g = full.grad
        full.grad = None
        if self.zero.stage <= 1:
            self.grad += g  # keep the whole gradient; reduced once per step (DDP's no_sync accumulation)
        else:
            self.zero.reduce_scatter_grad(self, g)  # stage 2: reduce-scatter now (async), keep only my shard


# ----------------------------------------------------------------------------- the wrapper
class Zero:
    """ZeRO around any nn.Module (built on the CPU; `device` defaults to its parameters' device). `units`
    names submodules, in the order forward runs them, that become FlatUnits (in stage 3 gathered one at a
    time); the parameters left over form the root unit. Per step: zero(x) and zero.backward(loss) for each
    micro-batch, then zero.step(). Parameters only: buffers stay in the module, replicated. No parameter
    may be shared between units (no tied weights across units)."""

    def __init__(self, model, args, units=(), group=None, device=None):
        self.group = group or dist.group.WORLD
        self.rank, self.world = dist.get_rank(self.group), dist.get_world_size(self.group)
        self.stage, self.clip, self.recompute, self.offload = args.stage, args.clip, args.recompute, args.offload
        p0 = next(model.parameters())
        self.device, self.master_dtype = torch.device(device or p0.device), p0.dtype
        self.compute_dtype = LOW[args.mixed_precision] or self.master_dtype
        self.master_device = torch.device("cpu") if self.offload else self.device
        self.separate_master = self.offload or self.compute_dtype != self.master_dtype
        self.fp16 = args.mixed_precision == "fp16"  # dynamic loss scale, clean steps in a row, growth window
        self.scale, self.clean, self.window = args.loss_scale if self.fp16 else 1.0, 0, args.scale_window
        self.meter = Meter()  # the measurement section below: bytes handed to collectives, gathered, saved
        self.compress, self._encoded = args.compress_activations, {}
        self.model, self.units = model, []
        for path in units:  # each named submodule becomes a unit, in its parent's place
            unit = FlatUnit(self, model.get_submodule(path), path + ".")
            parent, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent), child, unit)
            self.units.append(unit)
        self.root = FlatUnit(self, model, "")  # whatever parameters are left
        self.units.append(self.root)
        model.to(self.device)  # the buffers (no parameters are left in the modules)
        self.opt = FlatAdafactor(self, args) if args.optimizer == "adafactor" else \
            make_optimizer([u.master for u in self.units], args)  # AdamW on the flat fp32 shards
        # stage 3: the order units are first needed in, forward and backward (the root is in use at both ends)
        blocks = [u for u in self.units[:-1] if u.numel]
        self.forward_order = [self.root] * bool(self.root.numel) + blocks
        self.backward_order = [self.root] * bool(self.root.numel) + blocks[::-1]
        self.order, self.prefetched, self.pending = self.forward_order, {}, None

    # --- collectives; the meter records the bytes of each tensor handed to one ---------------------------
    def all_gather(self, out, shard, async_op=False, count=True):  # (S,) local -> (N*S,) global
        if count:
            self.meter.handed(shard)
        return all_gather_single(out, shard, group=self.group, async_op=async_op)

    def reduce_scatter(self, out, full, async_op=False):  # (N*S,) global -> (S,) local, summed over ranks
        self.meter.handed(full)
        return reduce_scatter_single(out, full, group=self.group, async_op=async_op)

    def all_reduce(self, t):
        self.meter.handed(t)
        dist.all_reduce(t, group=self.group)

    # --- stage 3: prefetching all-gathers (FSDP's forward and backward prefetch) ---------------------------
    def acquire(self, u):
        """Stage 3: u's whole flat vector (N*S,). Its all-gather was launched when the unit before it in
        this pass was acquired: wait for it (or gather now), then launch the next unit's, and return at
        once so that it travels while u computes. One ahead, no more: besides the root, at most the unit
        running and the unit arriving are gathered (FSDP's rate limiter)."""
        work, buf = self.prefetched.pop(u, None) or self._launch_gather(u)
        work.wait()
        later = self.order[self.order.index(u) + 1:]
        if later and later[0] not in self.prefetched:
            self.prefetched[later[0]] = self._launch_gather(later[0])
        return buf

    def _launch_gather(self, u):  # (S,) local -> a new (N*S,) buffer; returns (work, buffer)
        buf = torch.empty(u.padded, dtype=self.compute_dtype, device=self.device)
        work = self.all_gather(buf, u.shard.detach(), async_op=True)
        self.meter.gathered(buf)
        return work, buf

    def _new_pass(self, order):  # a prefetch the last pass did not use (a forward without its units) ends
        for work, _ in self.prefetched.values():
            work.wait()
        self.order, self.prefetched = order, {}

    # --- stages 2-3: asynchronous reduce-scatter, one in flight --------------------------------------------
    def reduce_scatter_grad(self, u, g):
        """Launch the reduce-scatter of u's micro-batch gradient (N*S,) global -> (S,) local, in the master
        dtype (fp32 under mixed precision), and let backward go on. It is finished (waited for, added into
        u.grad) where its result is needed: before the next one is launched, or when backward ends."""
        self.finish_reduce()
        out = torch.empty(u.S, dtype=self.master_dtype, device=self.device)
        g = g.to(self.master_dtype).contiguous()
        self.pending = (u, self.reduce_scatter(out, g, async_op=True), out, g)  # g referenced until done

    def finish_reduce(self):
        if self.pending:
            u, work, out, _ = self.pending
            work.wait()
            u.grad += out
            self.pending = None

    # --- what autograd saves: activations counted, stage-3 parameter views kept as positions only ----------
    # One pair of saved_tensors_hooks around the whole forward does both jobs: nested hooks would hide from
    # an outer counter (common.SavedActivations) whatever these pack, since only the innermost pair runs.
    # Inside a --recompute block torch.utils.checkpoint's own pair takes over: it keeps nothing there.
    def _pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        for u in self.units:
            if ptr == (u.full.untyped_storage().data_ptr() if self.stage < 3 else u.in_forward):
                if self.stage < 3:
                    return t  # a view of a persistent parameter vector: held anyway, not an activation
                # Stage 3: holding the view would keep the whole gathered unit alive until backward; keep
                # where it lies instead, and gather the unit again when backward first needs it.
                return (u, t.storage_offset(), t.shape, t.stride())
        if self.compress == "none" or not t.is_floating_point() or t.dim() == 0:
            self.meter.count_saved(t)
            return t
        # one tensor saved by several ops (the input of q, k and v) is encoded once, while it is alive
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())
        alive, e = self._encoded.get(key, (None, None))
        if alive is None or alive.expired():
            e = encode(t, self.compress)
            self._encoded[key] = (StorageWeakRef(t.untyped_storage()), e)
            self.meter.count_saved(e.data)
            self.meter.count_saved(e.scale)
        return e

    def _unpack(self, x):
        if isinstance(x, Encoded):
            return decode(x)
        if not isinstance(x, tuple):
            return x
        u, offset, shape, stride = x
        if u.gathered is None:
            u.gathered = self.acquire(u)  # stage 3: all-gathered again for its backward (prefetched)
        return u.gathered.as_strided(shape, stride, offset)

    # --- training ---------------------------------------------------------------------------------------
    def __call__(self, *args):
        self.meter.new_forward()  # saved bytes are counted per micro-batch forward
        self._encoded = {}
        self._new_pass(self.forward_order)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return self.root(*args)

    def backward(self, loss):  # fp16: scale the loss so small gradients survive in half precision
        self._new_pass(self.backward_order)
        (loss * self.scale if self.fp16 else loss).backward()
        self.finish_reduce()  # the last unit's reduce-scatter

    def _reduced(self, u):
        """Finish the reduction; return (gradient the optimizer reads, the slice of it this rank norms)."""
        if self.stage == 0:  # (N*S,) global: all-reduce, every rank holds the sum; norm only my slice
            self.all_reduce(u.grad)
            return u.grad, u.grad[u.lo:u.lo + u.valid]
        if self.stage == 1:  # (N*S,) global -> (S,) local
            g = torch.empty(u.S, dtype=u.grad.dtype, device=u.grad.device)
            self.reduce_scatter(g, u.grad)
            return g, g[:u.valid]
        return u.grad, u.grad[:u.valid]  # stages 2-3: reduced during backward already

    def step(self, inject_inf=False):
        """1. finish the reduction 2. fp16: unscale 3. global norm from every rank's shard, padding excluded,
        clip 4. AdamW on the master shard (on the CPU with offload) 5. publish the new parameters."""
        self.finish_reduce()
        grads, parts = zip(*(self._reduced(u) for u in self.units))
        if self.fp16:
            for g in grads:
                g.mul_(1.0 / self.scale)
        if inject_inf:  # test hook: an overflow on this rank only
            next(p for p in parts if p.numel())[0] = float("inf")
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for p in parts:
            sq += torch.linalg.vector_norm(p, dtype=torch.float64) ** 2
        self.all_reduce(sq)  # each element is in exactly one rank's slice: no replica counted twice
        norm = sq.sqrt()
        # The norm is all-reduced, so an inf/nan anywhere makes it non-finite on every rank: one decision.
        skipped = self.fp16 and not bool(torch.isfinite(norm))
        if skipped:
            self.scale, self.clean = self.scale / 2, 0  # back off and skip the step
        else:
            clip_grads_(grads, norm, self.clip)
            for u, g in zip(self.units, grads):
                if self.offload:
                    u.master.grad.copy_(g)  # device -> host
                else:
                    u.master.grad = g
            self.opt.step()
            self.publish()
            self.clean += 1
            if self.fp16 and self.clean == self.window:
                self.scale, self.clean = self.scale * 2, 0  # a run of clean steps: try a larger scale
        for u in self.units:
            u.grad.zero_()
            if not self.offload:
                u.master.grad = None
        return dict(norm=float(norm), skipped=skipped, scale=self.scale)

    def publish(self):
        """Master -> compute copy (host fp32 -> device bf16); stages 1-2 then all-gather the whole vector."""
        for u in self.units:
            if self.separate_master:
                u.compute.copy_(u.master)
            if self.stage in (1, 2):
                self.all_gather(u.full.detach(), u.compute.clone())  # (S,) local -> (N*S,) global

    def full_state_dict(self):
        """The whole unsharded model on every rank, {name in the original model: tensor}, master dtype."""
        out = {}
        for u in self.units:
            flat = u.master.to(self.device)
            if self.stage > 0 and u.numel:
                flat = torch.empty(u.padded, dtype=u.master.dtype, device=self.device)
                self.all_gather(flat, u.master.to(self.device), count=False)
            out.update({n: v.detach().cpu().clone() for n, v in zip(u.names, u.views(flat).values())})
        return out

    # --- sharded checkpoint ------------------------------------------------------------------------------
    def save(self, ckpt_dir, step, history):
        """Each rank writes only the real elements of its shard (master, Adam moments) and its RNG states
        (dropout masks continue exactly); rank 0 then writes meta.pt, which marks the step complete.
        Temporary file + rename: never a half-written file. Everything is saved from the CPU."""
        path = os.path.join(ckpt_dir, f"step{step}")
        os.makedirs(path, exist_ok=True)
        shards = []
        for u in self.units:
            st = self.opt.state.get(u.master, {})  # empty if every step so far was skipped (fp16)
            first = u.lo if self.stage == 0 else 0  # stage 0 holds the whole vector: save only my part
            shards.append({k: st.get(k, torch.zeros_like(u.master)).detach()[first:first + u.valid].cpu().clone()
                           for k in ("exp_avg", "exp_avg_sq")})
            shards[-1]["master"] = u.master.detach()[first:first + u.valid].cpu().clone()
        rng = dict(rng_cpu=torch.get_rng_state())  # a CPU byte tensor, as torch.set_rng_state wants it
        if self.device.type == "cuda":
            rng["rng_cuda"] = torch.cuda.get_rng_state(self.device)  # also a CPU byte tensor
        adam_step = float(self.opt.state.get(self.units[0].master, {}).get("step", 0))
        _atomic_save(dict(units=shards, **rng), os.path.join(path, f"rank{self.rank}.pt"))
        dist.barrier(group=self.group)  # every shard is on disk before the step is marked complete
        if self.rank == 0:
            meta = dict(world=self.world, numels=[u.numel for u in self.units], adam_step=adam_step,
                        scale=self.scale, clean=self.clean, history=history)
            _atomic_save(meta, os.path.join(path, "meta.pt"))
            for old in _complete_steps(ckpt_dir)[:-2]:  # keep the last two
                for f in os.listdir(os.path.join(ckpt_dir, f"step{old}")):
                    os.remove(os.path.join(ckpt_dir, f"step{old}", f))
                os.rmdir(os.path.join(ckpt_dir, f"step{old}"))

    def _read_meta(self, path):
        """A step's meta.pt, checked against this run: one clear line (exit 2) for a damaged file or
        another model; another world size is fine (load reshards)."""
        try:
            meta = torch.load(os.path.join(path, "meta.pt"), map_location="cpu", weights_only=False)
            numels = meta["numels"]
        except Exception as e:
            fail(f"cannot read checkpoint {path}/meta.pt ({type(e).__name__}): delete it or use another --ckpt-dir")
        if numels != [u.numel for u in self.units]:
            fail(f"checkpoint {path} holds another model (unit sizes {numels}, this run "
                 f"{[u.numel for u in self.units]}): use another --ckpt-dir")
        return meta

    def load(self, ckpt_dir):
        """Resume from the newest complete step, whatever world size wrote it: each rank reads, from the
        old ranks' files, the pieces that overlap the flat elements it owns now, and at the same world size
        its own RNG states. Returns (step, history)."""
        steps = _complete_steps(ckpt_dir) if ckpt_dir else []
        if ckpt_dir and os.path.isdir(ckpt_dir) and any(f.startswith("rank") for f in os.listdir(ckpt_dir)):
            fail(f"--ckpt-dir {ckpt_dir} holds another file's rank-local checkpoints (rank*/), not zero.py's "
                 f"sharded steps (step*/): use another --ckpt-dir")  # checked before any collective
        if steps:
            self._read_meta(os.path.join(ckpt_dir, f"step{steps[-1]}"))
        t = torch.tensor([steps[-1] if steps else 0], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)  # every rank sees the same directory
        if not t.item():
            return 0, {}
        path = os.path.join(ckpt_dir, f"step{int(t.item())}")
        meta = self._read_meta(path)
        old_n, files = meta["world"], {}

        def rank_file(q):
            if q not in files:
                files[q] = torch.load(os.path.join(path, f"rank{q}.pt"), map_location="cpu", weights_only=True)
            return files[q]

        for i, u in enumerate(self.units):
            lo, hi = (0, u.numel) if self.stage == 0 else (u.lo, u.lo + u.valid)  # elements I need
            old_s = -(-u.numel // old_n)
            pieces = {k: [] for k in ("master", "exp_avg", "exp_avg_sq")}
            for q in range(lo // old_s, -(-hi // old_s)) if hi > lo else ():  # old ranks that overlap
                for k in pieces:  # old rank q saved flat elements [q*old_s, q*old_s + len)
                    pieces[k].append(rank_file(q)["units"][i][k][max(lo - q * old_s, 0):hi - q * old_s])
            state = {k: torch.cat(v).to(u.master) if v else u.master.new_zeros(0) for k, v in pieces.items()}
            with torch.no_grad():  # stage 0: the whole vector; stages 1-3: my shard; either way from 0
                u.master.zero_()[:hi - lo] = state["master"]
            self.opt.state[u.master] = dict(step=torch.tensor(meta["adam_step"]),
                                            exp_avg=torch.zeros_like(u.master), exp_avg_sq=torch.zeros_like(u.master))
            self.opt.state[u.master]["exp_avg"][:hi - lo] = state["exp_avg"]
            self.opt.state[u.master]["exp_avg_sq"][:hi - lo] = state["exp_avg_sq"]
        if old_n == self.world:  # at another world size the ranks' RNG streams cannot continue exactly
            torch.set_rng_state(rank_file(self.rank)["rng_cpu"])
            if self.device.type == "cuda":
                torch.cuda.set_rng_state(rank_file(self.rank)["rng_cuda"], self.device)
        self.scale, self.clean = meta["scale"], meta["clean"]
        self.publish()  # master -> compute copy (and the all-gather of stages 1-2)
        dist.barrier(group=self.group)
        return int(t.item()), meta["history"]


# ----------------------------------------------------------------------------- --compress-activations
class Encoded(NamedTuple):
    """An activation as kept for backward: bf16 (scale None), or int8 with one scale per row (last dim)."""
    data: torch.Tensor
    scale: Optional[torch.Tensor]
    dtype: torch.dtype


def encode(t, how):  # (..., C) -> bf16 (..., C), or int8 (..., C) and scales (..., 1)
    t = t.detach()
    if how == "bf16":
        return Encoded(t.to(torch.bfloat16), None, t.dtype)
    scale = t.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(t.dtype).tiny) / 127  # row absmax -> 127
    return Encoded(torch.round(t / scale).to(torch.int8), scale, t.dtype)


def decode(e):  # back to the dtype forward saved it in; error <= half a step: |x| u, u = 2^-9 or absmax/254
    x = e.data.to(e.dtype)
    return x if e.scale is None else x * e.scale


# ----------------------------------------------------------------------------- --optimizer adafactor
class FlatAdafactor:
    """Adafactor (Shazeer & Stern 2018) on ZeRO's flat shards, computed as torch.optim.Adafactor does:
    beta1 = 0, 1 - beta2_t = t^-0.8, update clipping at RMS d = 1, decoupled weight decay, and torch's
    relative step alpha = max(1e-3, RMS(X)) min(lr, 1/sqrt t) (torch has no switch for it; keeping it makes
    torch's optimizer an independent reference). An (R, C) matrix keeps mean squared gradients per row (R,)
    and per column (C,), whole on every rank. A shard cuts through matrices, so:
      1. each rank adds the squares of its own gradient elements into those vectors (and each parameter's
         sum of squared weights, for RMS(X)); one all-reduce of all of them makes them exact;
      2. each rank computes the update of its own elements, v = row[i] col[j] / mean(row), u = g / sqrt(v);
      3. one all-reduce of each parameter's sum of u^2 gives the clip, max(1, RMS(u) / d); step.
    A vector (bias, LayerNorm) keeps an unfactored second moment of this rank's elements only."""

    def __init__(self, zero, args):
        self.zero, self.lr, self.wd, self.t, self.state, self.pieces = zero, args.lr, args.weight_decay, 0, {}, []
        for u in zero.units:
            lo, hi = (0, u.numel) if zero.stage == 0 else (u.lo, u.lo + u.valid)  # flat elements I update
            st, mine = {}, []
            for k, (a, b, shape) in enumerate(zip(u.offsets, u.offsets[1:], u.shapes)):
                s, e = max(a, lo), min(b, hi)  # my elements of parameter k: flat [s, e), maybe none
                i = torch.arange(s, max(s, e), device=u.master.device) - a  # positions inside the parameter
                if len(shape) == 2:
                    st[f"row{k}"], st[f"col{k}"] = (u.master.new_zeros(n) for n in shape)
                    mine.append((k, slice(s - lo, max(s, e) - lo), i // shape[1], i % shape[1], shape, b - a))
                else:
                    st[f"var{k}"] = u.master.new_zeros(max(e - s, 0))
                    mine.append((k, slice(s - lo, max(s, e) - lo), None, None, shape, b - a))
            self.state[u.master] = st
            self.pieces.append(mine)

    def _all_reduce(self, parts):  # stage 0 holds whole vectors: nothing to add up
        flat = torch.cat(parts).to(self.zero.device)
        if self.zero.stage > 0:
            self.zero.all_reduce(flat)
            self.sent += flat.nbytes  # its extra traffic, for the summary
        return flat.to(parts[0].device).split([p.numel() for p in parts])

    def step(self):
        self.t, self.sent = self.t + 1, 0
        beta, rho = self.t ** -0.8, min(self.lr, self.t ** -0.5)
        todo = [(u.master, u.master.grad, self.state[u.master], p) for u, mine in zip(self.zero.units, self.pieces)
                for p in mine]
        parts = []  # 1. my squares, into the (R,) and (C,) vectors of each matrix, and sum X^2 per parameter
        for x, g, st, (k, sl, r, c, shape, n) in todo:
            if r is not None:
                parts += [x.new_zeros(shape[0]).index_add_(0, r, g[sl] ** 2),
                          x.new_zeros(shape[1]).index_add_(0, c, g[sl] ** 2)]
            parts.append((x[sl] ** 2).sum().view(1))
        stats, updates = iter(self._all_reduce(parts)), []
        for x, g, st, (k, sl, r, c, shape, n) in todo:  # 2. the update of my elements
            eps1 = torch.finfo(x.dtype).eps
            if r is not None:
                st[f"row{k}"].lerp_(next(stats) / shape[1], beta)  # mean over the row's C elements
                st[f"col{k}"].lerp_(next(stats) / shape[0], beta)
                v = st[f"row{k}"][r] * st[f"col{k}"][c] / st[f"row{k}"].mean().clamp(min=eps1)
            else:
                v = st[f"var{k}"].lerp_(g[sl] ** 2, beta).clone()
            alpha = (next(stats) / n).sqrt().clamp(min=1e-3) * rho  # (1,), on the device: no host sync
            updates.append((v.clamp_(min=eps1 * eps1).rsqrt_() * g[sl], alpha))
        sq = self._all_reduce([(u ** 2).sum().view(1) for u, _ in updates])  # 3. clip by RMS(u), whole parameter
        for (x, g, st, (k, sl, r, c, shape, n)), (u, alpha), s in zip(todo, updates, sq):
            x[sl].mul_(1 - self.lr * self.wd).sub_(u * (alpha / (s / n).sqrt().clamp(min=1.0)))


def _atomic_save(obj, path):
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def _complete_steps(ckpt_dir):
    if not os.path.isdir(ckpt_dir):
        return []
    return sorted(int(f[4:]) for f in os.listdir(ckpt_dir)
                  if f.startswith("step") and f[4:].isdigit() and os.path.exists(os.path.join(ckpt_dir, f, "meta.pt")))


def train_step(zero, x, y, n_tok, accum, loss_fn, inject_inf=False):
    """One optimizer step on this rank's rows of the global batch (x, y), in `accum` micro-batches.
    Returns the loss of the whole global batch (the ranks' pieces summed) and zero.step()'s info."""
    rows = x.shape[0] // zero.world
    x, y = (t[zero.rank * rows:(zero.rank + 1) * rows] for t in (x, y))  # (B/N, ...) local
    local = torch.zeros(1, dtype=torch.float64, device=zero.device)  # summed on the device: no sync per micro-batch
    for xm, ym in zip(x.chunk(accum), y.chunk(accum)):  # (B/(N*accum), ...) each
        loss = loss_fn(zero(xm.to(zero.device)), ym.to(zero.device), n_tok)  # / tokens of the global batch
        zero.backward(loss)
        local += loss.detach()
    info = zero.step(inject_inf)
    dist.all_reduce(local, group=zero.group)  # for the log line only; not counted as technique traffic
    return local.item(), info


# ----------------------------------------------------------------------------- the reference for --mixed-precision
def reference_mixed(args, world, device="cpu"):
    """What --check compares a --mixed-precision run with: one process, the same precision recipe, written
    plainly with nn.Module parameters. A low-precision copy of the model computes each of the world x accum
    micro-batches the ranks compute (the same rows and shapes, so the same bf16/fp16 arithmetic); each
    micro-batch's gradient is cast to --dtype and summed there; clipping and AdamW run on --dtype master
    weights, which are then rounded into the copy. fp16 scales the loss and skips a non-finite step."""
    data, rows = MarkovData(args.vocab, args.seed), args.batch_size // world
    master = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    low = copy.deepcopy(master).to(LOW[args.mixed_precision])
    opt = make_optimizer(master.parameters(), args)
    scale, clean, losses = (args.loss_scale if args.mixed_precision == "fp16" else 1.0), 0, []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        n_tok, total = count_tokens(y), 0.0
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for r in range(world):
            for xm, ym in zip(x[r * rows:(r + 1) * rows].chunk(args.accum), y[r * rows:(r + 1) * rows].chunk(args.accum)):
                low.zero_grad(set_to_none=True)
                loss = lm_loss(low(xm), ym, n_tok)
                (loss * scale).backward()
                for g, p in zip(grads, low.parameters()):
                    g += p.grad.to(g.dtype)
                total += loss.item()
        losses.append(total)
        if step == args.inject_overflow:
            grads[0][0] = float("inf")
        for g in grads:
            g.mul_(1.0 / scale)
        norm = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).norm()
        if args.mixed_precision == "fp16" and not torch.isfinite(norm):
            scale, clean = scale / 2, 0
            continue
        clip_grads_(grads, norm, args.clip)
        for p, g in zip(master.parameters(), grads):
            p.grad = g
        opt.step()
        with torch.no_grad():
            for q, p in zip(low.parameters(), master.parameters()):
                q.copy_(p)
        clean += 1
        if args.mixed_precision == "fp16" and clean == args.scale_window:
            scale, clean = scale * 2, 0
    return dict(losses=losses, params={n: p.detach().clone() for n, p in master.named_parameters()})


def reference_adafactor(args, device="cpu"):
    """What --check compares an --optimizer adafactor run with: plain one-process training, as
    common.reference_train does it, with torch.optim.Adafactor in AdamW's place (foreach=False)."""
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt = torch.optim.Adafactor(model.parameters(), lr=args.lr, weight_decay=args.weight_decay, foreach=False)
    losses = []
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


def check_mixed(d, args, losses, params):
    """--check for --mixed-precision, against reference_mixed on rank 0. The two do the same arithmetic up to
    the order of a few fp32 operations, and agree bit for bit until one such rounding sends a master weight
    to the neighbouring bf16/fp16 value; from then on they differ as two runs of the same recipe do: the
    losses by about the compute dtype's unit roundoff u at most (2^-8 bf16, 2^-11 fp16), and a few single
    weights, whose gradient is mostly rounding noise that AdamW normalises to a full step, by up to ~lr per
    step, so the largest elementwise difference says little. What does not drift is each tensor's path: the
    difference of a tensor relative to how far training moved it, |X - X_ref| / |X_ref - X_0| (L2), stays
    a few percent (measured 2e-2 after 20 bf16 steps on 4 ranks), while a missing reduction makes it O(1)
    (measured 1.3 after 4 steps). Tolerances: u on the losses, 0.1 on that ratio."""
    t = torch.zeros(3, dtype=torch.float64, device=d.device)
    if d.rank == 0:
        ref = reference_mixed(args, d.world, d.device)
        init = dict(build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype]).named_parameters())
        u = torch.finfo(LOW[args.mixed_precision]).eps / 2  # unit roundoff: half the spacing at 1
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"]))
        path_diff = max(((params[n] - r.cpu()).norm() / (init[n].detach() - r.cpu()).norm().clamp_min(1e-30)).item()
                        for n, r in ref["params"].items())
        passed = len(losses) == len(ref["losses"]) and loss_diff <= u and path_diff <= 0.1
        d.log(f"check vs one-process reference, same precision recipe: max rel loss diff {loss_diff:.3e} (tolerance "
              f"{u:.0e} = u), max param diff relative to training's move {path_diff:.3e} (0.1) -> "
              f"{'PASSED' if passed else 'FAILED'}")
        t = torch.tensor([loss_diff, path_diff, float(passed)], dtype=torch.float64, device=d.device)
    dist.broadcast(t, src=0)  # rank 0's verdict for every rank, as numbers in a tensor
    return dict(max_loss_diff=t[0].item(), max_param_diff=t[1].item(), passed=bool(t[2].item()))


# --- measurement --- (counters and the summary: the technique above never reads them back) ---------------
class Meter:
    """What zero.py measures, apart from the technique: the bytes of every tensor this rank hands to a
    collective, the stage-3 gathered buffers alive (by their storages: a view or a handle elsewhere keeps
    the bytes alive too) and their peak, and the activation bytes autograd saves per micro-batch."""

    def __init__(self):
        self.sent, self.alive, self.peak_gathered = 0, [], 0
        self.new_forward()

    def handed(self, t):  # one tensor handed to a collective (an all-gather's input, a reduce-scatter's input)
        self.sent += t.numel() * t.element_size()

    def gathered(self, buf):  # a new gathered buffer: gathered memory only grows here, so the peak is seen here
        self.alive.append((StorageWeakRef(buf.untyped_storage()), buf.untyped_storage().nbytes()))
        self.peak_gathered = max(self.peak_gathered, self.live_gathered())

    def live_gathered(self):  # bytes of the gathered storages still alive (not yet freed by anyone)
        self.alive = [(w, n) for w, n in self.alive if not w.expired()]
        return sum(n for _, n in self.alive)

    def new_forward(self):
        self.saved_bytes, self._seen = 0, set()

    def count_saved(self, t):  # an activation kept for backward; a storage saved twice counts once
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self._seen:
            self._seen.add(t.untyped_storage().data_ptr())
            self.saved_bytes += t.untyped_storage().nbytes()


def memory(zero):
    """Model-state bytes of this rank, counted from the tensors themselves."""
    params = tensor_bytes([u.full if zero.stage < 3 else u.shard for u in zero.units])
    moments = [v for u in zero.units for v in zero.opt.state.get(u.master, {}).values()
               if torch.is_tensor(v) and v.dim() > 0]
    optim = tensor_bytes(moments + ([u.master for u in zero.units] if zero.separate_master else []))
    host_grads = tensor_bytes([u.master.grad for u in zero.units]) if zero.offload else 0
    return dict(params=params, grads=tensor_bytes([u.grad for u in zero.units]), optim=optim,
                host_grad_copy=host_grads)


def theory(zero, padded=False):
    """ZeRO's formulas with the bytes of the dtypes actually run: p (compute copy), g (gradient accumulator,
    master dtype), K = 2 Adam moments (+ the master copy when separate)."""
    psi = sum(u.padded if padded else u.numel for u in zero.units)
    p, m = torch.finfo(zero.compute_dtype).bits // 8, torch.finfo(zero.master_dtype).bits // 8
    N, s = zero.world, zero.stage
    K = 2 * m + (m if zero.separate_master else 0)
    if isinstance(zero.opt, FlatAdafactor):  # m (R + C) per matrix, whole; m per vector element, sharded
        shapes = [sh for u in zero.units for sh in u.shapes]
        factored = m * sum(sh[0] + sh[1] for sh in shapes if len(sh) == 2)
        vectors = m * sum(sh.numel() for sh in shapes if len(sh) != 2)
        master = m * psi / (N if s >= 1 else 1) if zero.separate_master else 0
        return dict(params=p * psi / (N if s == 3 else 1), grads=m * psi / (N if s >= 2 else 1),
                    optim=factored + vectors / (N if s >= 1 else 1) + master, psi=psi, p=p, g=m, K=None)
    return dict(params=p * psi / (N if s == 3 else 1), grads=m * psi / (N if s >= 2 else 1),
                optim=K * psi / (N if s >= 1 else 1), psi=psi, p=p, g=m, K=K)


def report(d, args, zero, saved, without, sent):
    """Rank 0's closing table: each figure counted in this run beside its ZeRO theory value."""
    mem, th, thp = memory(zero), theory(zero), theory(zero, padded=True)
    N, s, psi, p, g, K = d.world, args.stage, th["psi"], th["p"], th["g"], th["K"]
    formula = {0: "(p+g+K) Psi", 1: "(p+g) Psi + K Psi/N", 2: "p Psi + (g+K) Psi/N", 3: "(p+g+K) Psi/N"}[s]
    paper = {0: 16, 1: 4 + 12 / N, 2: 2 + 14 / N, 3: 16 / N}[s] * psi  # fp16 Adam: p = g = 2, K = 12
    # bytes handed to collectives per step: an all-reduce or reduce-scatter takes the whole vector, an
    # all-gather this rank's 1/N of it; a ring then puts (N-1)/N of the first (twice for an all-reduce)
    # and N-1 times the second on this rank's link
    comm, comm_formula = {0: (g * psi, "g Psi: all-reduce"),
                          1: (psi * (g + p / N), "Psi (g + p/N): reduce-scatter + all-gather"),
                          2: (psi * (args.accum * g + p / N), "Psi (accum g + p/N): reduce-scatter per "
                              "micro-batch + all-gather"),
                          3: (args.accum * psi * (2 * p / N + g), "accum Psi (2p/N + g): 2 all-gathers + "
                              "reduce-scatter per micro-batch")}[s]
    blocks = sorted((u.padded for u in zero.units[:-1]), reverse=True)[:2]
    gathered = p * (zero.root.padded + sum(blocks))
    d.log(f"\nmemory per rank, counted from the tensors | ZeRO theory, Psi={psi}, N={N}, p={p} g={g} K={K} bytes")
    host = ""
    if args.offload:
        host = " on host" + (" (= the device here: trivially true on CPU)" if zero.device.type == "cpu" else "")
    for k, label in (("params", "parameters (compute copy)"), ("grads", "gradients (accumulator)"),
                     ("optim", f"optimizer (master, {'row/col/var' if K is None else 'm, v'})" + host)):
        d.log(f"  {label:32s} {mem[k]:>10,d} B | theory {th[k]:>12,.0f} B")
    if K is None:
        d.log(f"  {'(AdamW moments would take)':32s} {2 * g * psi / (N if s >= 1 else 1):>10,.0f} B = 2 g Psi/N")
        shapes = [sh for u in zero.units for sh in u.shapes]
        extra = g * (sum(sh[0] + sh[1] for sh in shapes if len(sh) == 2) + 2 * len(shapes)) * (s > 0)
        d.log(f"  Adafactor's own all-reduces: counted {zero.opt.sent:,d} B/step | theory {extra:,d} B = g (sum of R + C "
              f"over matrices + 2 per parameter), none at stage 0")
    d.log(f"  {'model states':32s} {mem['params'] + mem['grads'] + mem['optim']:>10,d} B | theory "
          f"{th['params'] + th['grads'] + th['optim']:>12,.0f} B = {formula}  (paper, fp16 Adam: {paper:,.0f} B)")
    if s == 3:
        d.log(f"  {'peak gathered parameters':32s} {zero.meter.peak_gathered:>10,d} B | bound {gathered:>12,.0f} B"
              " = p (root + 2 largest units: the one running, the one prefetched)")
    d.log(f"  {'saved activations/micro-batch':32s} {saved:>10,d} B" +
          (f" | without --recompute/--compress-activations {without:,d} B" if without is not None else ""))
    if args.compress_activations != "none" and not args.recompute:
        elem = torch.finfo(zero.compute_dtype).bits // 8
        d.log(f"  {'compressed / plain':32s} {saved / without:>10.3f}   | theory {({'bf16': 2, 'int8': 1}[args.compress_activations] / elem):.3f}"
              f" = {args.compress_activations} bytes / {elem} (+ int8's scales, + integer tensors kept as they are)")
    d.log(f"bytes handed to collectives per rank per step: counted {sent:,.0f} B | theory {comm:,.0f} B = "
          f"{comm_formula} (counted: padded vectors + the 8-byte norm all-reduce{' + Adafactor' if K is None else ''})")
    memory_ = {k: dict(counted=mem[k], theory=th[k], theory_padded=thp[k]) for k in ("params", "grads", "optim")}
    return dict(memory=memory_,
                host_grad_copy_bytes=mem["host_grad_copy"], psi=psi, psi_padded=thp["psi"],
                bytes_per_elem=dict(p=p, g=g, K=K), model_state_formula=formula,
                gathered_peak_bytes=zero.meter.peak_gathered, gathered_bound_bytes=gathered,
                saved_activation_bytes=saved, saved_activation_bytes_without_recompute=without,
                comm_theory_bytes=comm, comm_formula=comm_formula)


# ----------------------------------------------------------------------------- main
def check_args(args, world):
    check_common_args(args)
    if args.stage not in (0, 1, 2, 3):
        fail(f"--stage must be 0, 1, 2 or 3 (ZeRO stages; 3 is FSDP), got {args.stage}")
    if args.offload and args.stage == 0:
        fail("--offload moves the sharded optimizer state to the CPU: use it with --stage 1, 2 or 3")
    if args.accum < 1 or args.batch_size % (world * args.accum):
        fail(f"--batch-size {args.batch_size} must split into {world} ranks x --accum {args.accum} micro-batches "
             f"(--accum >= 1; e.g. --batch-size {world * max(args.accum, 1)})")
    if args.mixed_precision != "none" and args.dtype == "bfloat16":
        fail("--mixed-precision keeps the master weights in --dtype: use --dtype float32 (or float64)")
    if args.optimizer == "adafactor" and args.ckpt_dir:
        fail("--optimizer adafactor does not checkpoint its factored state yet: drop --ckpt-dir, or use adamw")
    if args.optimizer == "adafactor" and args.check and args.mixed_precision != "none":
        fail("--check of --optimizer adafactor has a full-precision reference only: drop --mixed-precision")
    if args.inject_overflow >= 0 and args.mixed_precision != "fp16":
        fail("--inject-overflow tests fp16 loss scaling: add --mixed-precision fp16")
    if args.compress_activations != "none" and args.check and args.optimizer == "adafactor":
        fail("--check of --compress-activations compares with uncompressed AdamW training: drop --optimizer adafactor")
    if args.scale_window < 1:
        fail(f"--scale-window must be >= 1, got {args.scale_window}")


def train(d, args):
    """The run: train, report, check. Returns the summary (tests/zero_checks.py calls this in-process)."""
    data = MarkovData(args.vocab, args.seed)
    d.log(f"ZeRO stage {args.stage} on {d.world} ranks ({d.backend}); entropy floor {data.entropy:.4f} nats/token")

    # --- the technique: the whole GPT from one seed on the CPU, flattened and sharded, one unit per block ---
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])
    zero = Zero(model, args, units=[f"blocks.{i}" for i in range(args.n_layers)], device=d.device)
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per rank; a resume restores the stream
    start, history = zero.load(args.ckpt_dir)
    if start:
        d.log(f"resumed from {args.ckpt_dir} at step {start} (saved at world size {history['world']}"
              f"{'' if history['world'] == d.world else '; RNG streams start afresh'})")
    losses, skipped, scales, sent, saved, without = history.get("losses", []), [], [], [], 0, None
    if args.recompute or args.compress_activations != "none":  # one extra forward with neither memory saver,
        zero.recompute, zero.compress = False, "none"  # only to count what it would have saved
        x, _ = data.batch(start, args.batch_size, args.seq_len, args.ragged)
        with torch.random.fork_rng(devices=[d.device] if d.device.type == "cuda" else []):  # dropout: no RNG used
            zero(x[:args.batch_size // (d.world * args.accum)].to(d.device))  # one micro-batch
        without, zero.recompute, zero.compress = zero.meter.saved_bytes, args.recompute, args.compress_activations
    timer = StepTimer(d.device)
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global, on CPU
        n_tok = count_tokens(y)  # tokens of the whole global batch: the loss divisor everywhere
        before = zero.meter.sent
        loss, info = train_step(zero, x, y, n_tok, args.accum, lm_loss,
                                inject_inf=step == args.inject_overflow and d.rank == d.world - 1)
        ms = timer.stop()
        sent.append(zero.meter.sent - before)
        saved = max(saved, zero.meter.saved_bytes)
        losses.append(loss)
        scales.append(info["scale"])
        if info["skipped"]:
            skipped.append(step)
            d.log(f"step {step:4d} | overflow: step skipped on every rank, loss scale -> {info['scale']:g}")
        log_step(d, step, loss, ms, args.batch_size * args.seq_len)
        if args.ckpt_dir and (step + 1 == args.steps or args.save_every and (step + 1) % args.save_every == 0):
            zero.save(args.ckpt_dir, step + 1, dict(losses=losses, world=d.world))

    # --- summary: the technique's own peak first, then --check trains the reference ---
    figures = report(d, args, zero, saved, without, sent[-1] if sent else 0.0)
    mem = figures["memory"]
    counted = sum(mem[k]["counted"] for k in ("params", "grads") + (() if args.offload else ("optim",)))
    peak = peak_memory_bytes(d, counted + zero.meter.peak_gathered + saved)
    # what each rank decided on its own: the steps it skipped, AdamW's step count (as tensors, no objects)
    adam_step = float(zero.opt.state.get(zero.units[0].master, {}).get("step", 0))
    every_skipped = gather_rows(d, torch.tensor(skipped, dtype=torch.float64).view(-1, 1))
    every_adam = gather_rows(d, [[adam_step]])
    per_rank = [dict(skipped=[int(s) for s in sk[:, 0].tolist()], adam_step=a[0, 0].item())
                for sk, a in zip(every_skipped, every_adam)]
    figures.update(loss_scale=scales, per_rank=per_rank, resumed_from_step=start)
    check = None
    if args.check:
        full = zero.full_state_dict()
        if args.optimizer == "adafactor":
            ref = reference_adafactor(args, d.device) if d.rank == 0 else None
            check = check_against_reference(d, args, losses, full, ref=ref)
        elif args.compress_activations != "none":
            # lossy by design: --check reports the loss difference against uncompressed one-process training
            # after the same steps, bounded loosely (losses within 1e-2 relative, as tests/zero_checks.py
            # bounds it; parameters within AdamW's largest move, 2 lr per step)
            d.log(f"--check: --compress-activations {args.compress_activations} against the uncompressed run")
            check = check_against_reference(d, args, losses, full, tol=1e-2, ptol=2 * args.lr * args.steps)
        elif args.mixed_precision == "none":
            check = check_against_reference(d, args, losses, full)
        else:
            check = check_mixed(d, args, losses, full)
    ms = timer.median()
    return write_summary(d, args, "zero", losses, ms, args.batch_size * args.seq_len / max(ms, 1e-9) * 1e3,
                         peak, sent[-1] if sent else 0.0, check, figures)


def main():
    args = parse_args(Args)
    check_args(args, env_world_size())
    d = init_dist(args.timeout)
    summary = train(d, args)
    close_dist(ok=summary["check"] is None or summary["check"]["passed"])


if __name__ == "__main__":
    main()
