"""zero.py: ZeRO stages 0-3 (stage 3 = FSDP) on the data-parallel group, written out, and HSDP (ZeRO
inside groups, replicated across them), with prefetching all-gathers, asynchronous reductions, CPU
offload, mixed precision with dynamic loss scaling, and a sharded checkpoint that reshards to
another world size. (The memory savers beside ZeRO, activation recomputation, activation compression
and Adafactor, are in memory_savers.py.)

ZeRO (Rajbhandari, Rasley, Ruwase, He, 2020) removes the redundancy of data parallelism: each of N
ranks holds the whole model state, yet only 1/N of the update work needs to happen on it.
  stage 0  plain data parallel: all-reduce the gradients, every rank runs the whole AdamW step.
  stage 1  P_os: optimizer state sharded. Reduce-scatter the gradients, each rank updates its shard of the
           parameters with its shard of the Adam moments, then all-gather the parameters. Both
           overlap with compute: each unit's reduce-scatter starts as soon as the last micro-batch's
           backward has produced its gradient (as DDP's buckets do), each unit's all-gather is
           waited for only just before the unit's next forward. (main's log line sums the loss on a
           group of its own, so it waits for none of them; its step timer's torch.cuda.synchronize
           does wait for them on a GPU.)
  stage 2  P_os+g: gradients sharded too: each unit's gradient is reduce-scattered as soon as backward has
           produced it (every micro-batch, asynchronously) and only this rank's shard of it is kept.
  stage 3  P_os+g+p: parameters sharded too (FSDP, Zhao et al. 2023). A unit (a transformer block; what is
           left of the model is the root unit) is all-gathered just before its forward, freed after
           it, all-gathered again for its backward, and its gradient reduce-scattered. As in FSDP
           (Sec. 3.3) the all-gather of the next unit is launched asynchronously before the current
           one computes, in forward and in backward, at most one ahead (FSDP's rate limiter):
           besides the root, only the unit running and the unit arriving are gathered at any time.
  HSDP   --replicate R, hybrid sharding (FSDP paper, Sec. 3.2.2; torchtitan's dp_replicate x
         dp_shard; FSDP2's fully_shard on a 2-D mesh): the world is one grid,
         torch.arange(world).view(R, N), N = world / R. A row is a shard group, one copy of the
         model ZeRO-sharded over its N ranks (stage 1, 2 or 3); a column is a replicate group, the R
         ranks that hold the same shard. A unit's gradient is reduce-scattered inside the shard
         group, then its shard all-reduced across the replicate group; every all-gather stays inside
         the shard group. On a cluster a row is a node: the all-gathers and reduce-scatters ride
         NVLink, and only g Psi/N per reduction crosses nodes. Stage 0 shards nothing and so has
         nothing to replicate: refused. Per rank and step, the shard group hands over what ZeRO at
         world N does, the replicate group g Psi/N once (stage 1) or per micro-batch (stages 2-3):

             R = 2, N = 4      shard 0   shard 1   shard 2   shard 3
               copy 0        [ rank 0 | rank 1  | rank 2  | rank 3 ]  <- shard group: all-gather,
               copy 1        [ rank 4 | rank 5  | rank 6  | rank 7 ]     reduce-scatter, the norm
                                 ^ replicate group (0, 4): all-reduce of shard 0's gradient
  Reductions are launched in one fixed unit order on every rank (the reverse of forward's, the root
  last), each once it and the units before it are ready, as ddp_bucketed.py's buckets: NCCL matches
  collectives by order, so a graph that depends on the data (a unit one rank skips) must not reorder
  them; a unit this rank's backward did not reach takes its turn with zeros. That holds for stages
  0-2. Stage 3 interleaves its gathers with the reductions in the order the units run, so every rank
  must run every unit once per forward, in `units` order (as FSDP assumes): a unit run out of turn,
  or one skipped, is refused with a ValueError before its all-gather is issued. A weight tied inside
  a unit is one flat slot that each of its names reads; a tie across units is refused (it would be
  cut in two). The core (Zero) is complete in one dtype, on the device; two variants follow it, each
  a subclass:
  --mixed-precision MixedPrecisionZero (Micikevicius et al. 2018): forward and backward on a
                    bf16/fp16 copy of the parameters; the master shard (--dtype, fp32), the gradient
                    accumulators, their reductions and AdamW stay in full precision. fp16 adds
                    dynamic loss scaling (Sec. 3.2): the loss times a scale, so that small gradients
                    survive in fp16, the gradients divided by it before the norm; an overflow (a
                    non-finite norm, all-reduced: one decision on every rank) skips the step and
                    halves the scale, --scale-window clean steps in a row double it.
  --offload         OffloadZero: ZeRO-Offload (Ren et al. 2021), the GeePS idea (Cui et al. 2016) of keeping
                    off the GPU what is not in use. On mixed precision (or in full precision): the
                    master shard and the Adam moments live in CPU memory, and so does a buffer for
                    the gradient shard; each step the device's gradient shard is copied into it,
                    clipping and AdamW run on the host, and the new parameters are copied back into
                    the device's compute copy. On a GPU the host buffers are page-locked (pinned),
                    so both copies are asynchronous: the gradients' copies are queued and waited for
                    once, before AdamW reads them; the copies back are not waited for (the host
                    writes the master again only after the next step's wait). On a CPU-only machine
                    the same code path runs.

Flat shards: each unit's parameters are flattened into one vector, padded to N*S elements, S =
ceil(P/N), and rank r owns elements [r*S, (r+1)*S), so any parameter count works at any world size:

    unit, P = 15, N = 4      [ w (3x4) ........... | b (3) | pad ]       16 = 4 * 4 elements
    owner                    [ rank 0 | rank 1 | rank 2 | rank 3 ]
    stage 3, per micro-batch (=> launch an async all-gather, <= wait for it; RS = reduce-scatter)
      fwd: gather root, =>u0 | <=u0, =>u1, run u0, free u0 | <=u1, run u1, free u1 | loss
      bwd: gather root (head), =>u1 | <=u1, =>u0, grad u1, RS u1, free | <=u0, grad u0, RS u0 (waits RS u1),
           free | grad root, RS root; backward ends: wait the last RS

What rank 0 of N = 4 holds (# = held), and the model-state bytes per rank (Psi parameters; p and g
bytes per parameter and gradient element, K bytes of optimizer state per parameter; the paper's Fig.
1 uses fp16 Adam: p = g = 2, K = 12 = fp32 master + m + v):
               parameters   gradients    Adam state
    stage 0   [########]   [########]   [########]      (p+g+K) Psi
    stage 1   [########]   [########]   [##      ]      (p+g) Psi + K Psi/N
    stage 2   [########]   [##      ]   [##      ]      p Psi + (g+K) Psi/N
    stage 3   [##      ]   [##      ]   [##      ]      (p+g+K) Psi/N   (+ root and two units gathered)

    python zero.py --stage 3 --check                                        # world 1: a shard is the whole
    torchrun --nproc_per_node=4 zero.py --stage 3 --accum 2 --check
    torchrun --nproc_per_node=4 zero.py --stage 3 --replicate 2 --check                 # HSDP, 2 x 2
    torchrun --nproc_per_node=4 zero.py --stage 2 --offload --mixed-precision bf16 --check
    torchrun --nproc_per_node=4 zero.py --stage 1 --ckpt-dir ckpt --save-every 5 --steps 10
    torchrun --nproc_per_node=2 zero.py --stage 3 --ckpt-dir ckpt --steps 20    # resumes at world 2

In production, use torch.distributed.fsdp.fully_shard (FSDP2) or DeepSpeed ZeRO.
"""

import os
import shutil
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.func import functional_call

from common import (
    DTYPES,
    GPTConfig,
    MarkovData,
    build_gpt,
    clip_grads_,
    close_dist,
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
    check_against_reference,
    check_common_args,
    env_world_size,
    gather_rows,
    parse_args,
    peak_memory_bytes,
    tensor_bytes,
    write_summary,
)

LOW = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Args(CommonArgs):
    # ZeRO stage: 0 data parallel, 1 shard optimizer state, 2 +gradients, 3 +parameters
    stage: int = 0
    replicate: int = 1  # HSDP: R copies of the model, each sharded over world/R ranks (stages 1-3)
    accum: int = 1  # micro-batches per rank per optimizer step (gradient accumulation)
    offload: bool = False  # master shard, Adam moments and AdamW in CPU memory (ZeRO-Offload)
    # compute copy's dtype; master: --dtype
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    loss_scale: float = 65536.0  # fp16: initial dynamic loss scale
    scale_window: int = 1000  # fp16: double the loss scale after this many clean steps in a row


# ============================================================================= the ZeRO core
# ZeRO's two collectives, on flat vectors, asynchronous: a ring all-gather or reduce-scatter
# (Zero.reduce_grad) moves (N-1)/N of the vector over each link. `group`: the N ranks that split it.
def all_gather_(full, shard, group):  # (S,) local -> (N*S,) global, into `full`; returns its work
    return dist.all_gather_single(full, shard, group=group, async_op=True)


class GatherParams(torch.autograd.Function):
    """Stage 3 (FSDP): forward all-gathers a unit (Zero.acquire), backward reduce-scatters its
    gradient."""

    @staticmethod
    def forward(ctx, shard, unit):  # shard (S,) local -> (N*S,) global
        ctx.unit = unit
        return unit.zero.acquire(unit)

    @staticmethod
    def backward(ctx, grad_full):
        # (N*S,) global: this rank's micro-batch gradient of the whole unit
        ctx.unit.zero.reduce_grad(ctx.unit, grad_full)
        # the copy gathered again for backward is no longer needed: free it
        ctx.unit.gathered = None
        return None, None


class FlatUnit(nn.Module):
    """One unit: `module`'s own parameters flattened into one vector padded to N*S elements. Stages
    0-2 hold the whole (`full`, the leaf autograd accumulates into), stage 3 only this rank's S
    elements (`shard`), all-gathered just before each use. The module keeps no parameters: forward
    hands it views of the flat vector (functional_call). Made on the CPU; only what this rank keeps
    moves to the device."""

    def __init__(self, zero, module, prefix):
        super().__init__()
        self.zero = zero
        self.module = module
        self.path = prefix[:-1] or "(root)"
        # its own parameters (a unit inside it is replaced already), each tensor once, under its
        # first name
        named = list(module.named_parameters())
        for n, p in named:
            if id(p) in zero.taken:
                raise ValueError(
                    f"{prefix + n} is {zero.taken[id(p)]} of another unit: a tie across units "
                    "would be "
                    "cut in two; put both in one unit (inside a unit a tie is shared) or untie them"
                )
        zero.taken.update({id(p): prefix + n for n, p in named})
        for n, m in module.named_modules(prefix=prefix[:-1]):
            if "forward" in vars(m):
                raise ValueError(
                    f"{n or 'the model'}.forward was replaced before Zero (recomputation?): rerun "
                    "in backward it would miss the parameters Zero moves into the flat vector; "
                    "wrap the unit after Zero"
                )
        # every name -> the first name of its tensor: a tied weight is one slot, read by each name
        every = module.named_parameters(remove_duplicate=False)
        self.tied = {n: next(m for m, q in named if q is p) for n, p in every}
        self.prefix = prefix  # + a name inside `module`: its name in the original model
        # {name inside `module`: shape}, in the flat vector's order
        self.shapes = {n: p.shape for n, p in named}
        self.numel = sum(p.numel() for _, p in named)  # P
        # shard length ceil(P / N); the last shards hold the padding
        self.S = -(-self.numel // zero.world)
        self.padded = self.S * zero.world
        self.lo = zero.rank * self.S  # this rank owns flat elements [lo, lo + S)
        flat = torch.cat(
            [p.detach().cpu().flatten() for _, p in named]  # (N*S,) global, on the CPU
            + [torch.zeros(self.padded - self.numel, dtype=zero.master_dtype)]
        )
        # from here on the parameters exist only as (slices of) the flat vector
        for owner, _, attr in (n.rpartition(".") for n in self.tied):
            del module.get_submodule(owner)._parameters[attr]
        # what this rank's optimizer updates: stage 0 the whole vector, stages 1-3 my shard
        own = slice(None) if zero.stage == 0 else slice(self.lo, self.lo + self.S)
        if zero.stage < 3:
            # the whole vector, a leaf: autograd accumulates each micro-batch's gradient into it
            self.full = flat.to(zero.device, zero.compute_dtype, copy=True).requires_grad_()
            self.full.register_post_accumulate_grad_hook(self._grad_ready)
            self.compute = self.full.detach()[own]
        else:
            # (S,) local. requires_grad only so that autograd runs GatherParams.backward.
            self.shard = flat[own].to(zero.device, zero.compute_dtype, copy=True).requires_grad_()
            self.compute = self.shard.detach()
        self.master = zero.new_master(self, flat[own])  # what the optimizer updates
        # the gradient accumulator, in the master dtype: whole (N*S,) in stages 0-1, this rank's
        # (S,) in 2-3
        self.grad = torch.zeros(
            self.padded if zero.stage < 2 else self.S, dtype=zero.master_dtype, device=zero.device
        )
        self.has_grad = False  # grad holds this step's (else a stale one)
        self.reduced = None  # stages 0-1: the reduced sum
        self.in_forward = None  # stage 3: where the gathered vector lies
        self.gathered = None  # stage 3: the copy gathered again for backward

    def views(self, full):
        # {name inside module: view of the flat vector with the parameter's shape} one split,
        # padding last (a slice per parameter: each slice's backward zero-fills the unit: 5x)
        parts = full.split([s.numel() for s in self.shapes.values()] + [self.padded - self.numel])
        slots = dict(zip(self.shapes, parts))  # {name inside module: its slice}
        # a tied weight: its one slot, under each of its names
        return {n: slots[first].view(self.shapes[first]) for n, first in self.tied.items()}

    def forward(self, *args):
        if self.zero.stage < 3:
            self.zero.wait_published(self)  # stages 1-2: the all-gather of the last step's update
            return functional_call(self.module, self.views(self.full), args)
        if not self.numel:  # (a root unit may have no parameters of its own: nothing to gather)
            return self.module(*args)
        self.zero.check_order(self)  # the unit next in order, or refused before its all-gather
        full = GatherParams.apply(self.shard, self)  # (N*S,) global: all-gathered just before use
        self.in_forward = full.untyped_storage().data_ptr()  # for Zero._pack (not a reference)
        try:
            return functional_call(self.module, self.views(full), args)
        finally:
            self.in_forward = None  # `full` dies here: saved views of it were packed as positions

    def _grad_ready(self, full):  # stages 0-2: autograd has accumulated this micro-batch's gradient
        g, full.grad = full.grad, None
        if self.zero.stage == 2:  # reduce-scatter every micro-batch's (async), keep only my shard
            return self.zero.reduce_grad(self, g)
        # stages 0-1 keep the whole gradient, summed over micro-batches (no_sync), and reduce it
        # once per step, as soon as the last backward made it
        self.accumulate(g)
        if self.zero.last_microbatch:
            self.zero.reduce_grad(self, self.grad)

    def accumulate(self, g):
        # into the step's gradient; the first micro-batch copies: nothing to zero stages 0-1,
        # reduced already (last=True before the last micro-batch): wait, then keep of the sum only
        # my shard, zeros elsewhere, so that the next reduction adds it once (HSDP: on one replica)
        if self.reduced is not None:
            self.zero.finish_reductions()
            mine = self.reduced if self.zero.stage else self.reduced[self.lo : self.lo + self.S]
            mine = mine.clone()  # (stage 0 reduced in place, into grad)
            self.grad.zero_()
            if self.zero.replica == 0:
                self.grad[self.lo : self.lo + self.S] = mine
            self.reduced = None
            self.has_grad = True
        (self.grad.add_ if self.has_grad else self.grad.copy_)(g)
        self.has_grad = True
        return self.grad


def check_stage(stage, replicas=1, names=("stage", "replicas")):
    """Zero's checks, pure: before any collective. `names`: what the messages call the two
    (check_args passes the flags)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(
            f"{names[0]} must be 0, 1, 2 or 3 (ZeRO's stages: 0 is DDP, 3 is FSDP), got {stage}"
        )
    if replicas > 1 and stage == 0:
        raise ValueError(
            f"{names[1]} {replicas} needs {names[0]} 1, 2 or 3 (HSDP replicates the shards of "
            f"ZeRO; {names[0]} 0 shards nothing)"
        )


def check_split(rows, world, accum):  # a remainder would be dropped, the loss silently wrong
    if accum < 1 or rows % (world * accum):
        raise ValueError(
            f"{rows} rows must split into {world} ranks x {accum} micro-batches (accum >= 1): "
            f"pass a multiple of {world * max(accum, 1)}"
        )


class Zero:
    """ZeRO around any nn.Module built on the CPU, in the model's one dtype. `units`: submodules, in
    forward's order, that become FlatUnits; what is left is the root unit. Per step: zero(x) and
    zero.backward(loss) per micro-batch, zero.step(). `optimizer(flat masters)`; `clip`: the global
    norm (0: off). `group`: the N ranks that shard the model. HSDP: `replicate_group`, the R ranks
    (this one among them) that hold this rank's shard, one in each copy of `group`; the batch splits
    over all R*N ranks."""

    compute_dtype = None  # None: the model's dtype (MixedPrecisionZero sets a lower one)

    def __init__(
        self,
        model,
        units=(),
        stage=0,
        optimizer=torch.optim.AdamW,
        clip=0.0,
        group=None,
        replicate_group=None,
        device=None,
    ):
        replicas = dist.get_world_size(replicate_group) if replicate_group else 1
        check_stage(stage, replicas)
        self.group = group or dist.group.WORLD
        self.replicate_group = replicate_group
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.replica = dist.get_rank(replicate_group) if replicate_group else 0
        # which rows of the batch are this rank's
        self.dp_rank = self.replica * self.world + self.rank
        self.dp_world = replicas * self.world
        self.stage = stage
        self.clip = clip
        p0 = next(model.parameters())
        self.device = torch.device(device or p0.device)
        self.master_dtype = p0.dtype  # the optimizer's dtype
        self.compute_dtype = self.compute_dtype or self.master_dtype
        self.units = []
        self.taken = {}  # id of each parameter -> its name
        for path in units:  # each named submodule becomes a unit, in its parent's place
            self.units.append(FlatUnit(self, model.get_submodule(path), path + "."))
            model.set_submodule(path, self.units[-1])
        self.root = FlatUnit(self, model, "")  # whatever parameters are left
        self.units.append(self.root)
        model.to(self.device)  # the buffers (no parameters are left in the modules)
        self.opt = optimizer([u.master for u in self.units])  # on the flat master shards
        # stage 3's order of use: the root around the units; a unit without parameters gathers
        # nothing
        root = [self.root] if self.root.numel else []
        blocks = [u for u in self.units[:-1] if u.numel]
        self.forward_order = root + blocks
        self.backward_order = root + blocks[::-1]
        self.prefetched = {}  # stage 3: unit -> (its all-gather in flight, its buffer)
        self.pending = []  # reductions in flight
        self.reduce_order = self.units[-2::-1] + [self.root]  # (reduce_grad)
        self.waiting = list(self.reduce_order)  # this round's units not yet reduced, in turn
        self.ready = {}
        self.publishing = {}  # stages 1-2: unit -> (all-gather in flight, its input)

    # --- stage 3: prefetching all-gathers (FSDP's forward and backward prefetch) ------------------
    def acquire(self, u):
        # stage 3: wait for u's all-gather (N*S,), launch the next unit's (one ahead)
        work, buf = self.prefetched.pop(u, None) or self._launch_gather(u)
        work.wait()
        later = self.order[self.order.index(u) + 1 :]
        if later and later[0] not in self.prefetched:
            self.prefetched[later[0]] = self._launch_gather(later[0])
        return buf

    def _launch_gather(self, u):  # (S,) local -> a new (N*S,) buffer; returns (work, buffer)
        buf = torch.empty(u.padded, dtype=self.compute_dtype, device=self.device)
        return all_gather_(buf, u.shard.detach(), self.group), buf

    def check_order(self, u=None):
        # u: the unit forward runs now (None: forward ended). The top says why
        want = self.to_run.pop(0) if self.to_run else None
        # (backward may rerun a unit: recomputation)
        if u is not want and self.order is self.forward_order:
            raise ValueError(
                f"stage 3: {f'unit {u.path} ran' if u else 'forward ended'} where unit "
                f"{getattr(want, 'path', 'none')} was next: every rank must run every unit once "
                "per forward, in `units` order (collectives pair by order); stages 0-2 take any "
                "graph"
            )

    def _new_pass(self, order):
        # a prefetch the last pass did not use (a forward without its units) ends
        for work, _ in self.prefetched.values():
            work.wait()
        self.order = order
        self.prefetched = {}
        self.to_run = list(order)  # (check_order)

    # --- the gradient reductions, launched during backward ----------------------------------------
    def reduce_grad(self, u, g):
        """u's gradient g (N*S,) is ready: launch each reduction whose turn in `reduce_order` came
        (top)."""
        self.ready[u] = g
        while self.waiting and self.waiting[0] in self.ready:
            u = self.waiting.pop(0)
            g = self.ready.pop(u)
            if self.stage >= 2:
                self.finish_reductions()
                g = g.to(self.master_dtype).contiguous()
            if self.stage == 0:  # (in place)
                work, out = dist.all_reduce(g, group=self.group, async_op=True), g
            else:  # (N*S,) global -> (S,) local: my shard of the sum, once work is done
                out = g.new_empty(u.S)
                work = dist.reduce_scatter_single(out, g, group=self.group, async_op=True)
            if self.replicate_group:  # HSDP: then sum the shard over the replicas
                work.wait()  # (on NCCL: the next collective's stream waits, the host does not)
                work = dist.all_reduce(out, group=self.replicate_group, async_op=True)
            self.pending.append((u, work, out, g))  # g referenced until done
            if self.stage <= 1:  # the step's sum, once work is done
                u.reduced = out

    def end_round(self):
        # backward ended (stages 0-1: the step's last): units it did not reach, zeros
        # (each call launches its unit and the ready ones after it)
        while self.waiting:
            u = self.waiting[0]
            zeros = torch.zeros(u.padded, dtype=self.compute_dtype, device=self.device)
            # stages 0-1: with what it has
            self.reduce_grad(u, zeros if self.stage >= 2 else u.accumulate(zeros))

    def finish_reductions(self):
        # wait for the reductions in flight; stages 2-3 add each shard to u.grad
        for u, work, out, _ in self.pending:
            work.wait()
            if self.stage >= 2:
                u.accumulate(out)
        self.pending = []

    # --- what autograd saves: stage-3 parameter views kept as positions only ----------------------
    def _pack(self, t):
        # (one pair of saved_tensors_hooks around the whole forward; all else kept as it is) stage
        # 3: a view of the gathered unit would keep it alive until backward, so keep where it lies
        # and gather it again
        for u in self.units:
            if t.untyped_storage().data_ptr() == u.in_forward:
                return u, t.storage_offset(), t.shape, t.stride()
        return t

    def _unpack(self, x):
        # stage 3: a position in a unit, all-gathered again for its backward (prefetched)
        if not isinstance(x, tuple):
            return x
        u, offset, shape, stride = x
        if u.gathered is None:  # (the unit's first saved view in this backward)
            u.gathered = self.acquire(u)
        return u.gathered.as_strided(shape, stride, offset)

    # --- training ---------------------------------------------------------------------------------
    def __call__(self, *args):
        self._new_pass(self.forward_order)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.root(*args)
        if self.stage == 3:  # a unit skipped last: refused before backward
            self.check_order()
        return out

    def backward(self, loss, last=True):
        """One micro-batch's backward. last=False on all but the step's last: stages 0-1 reduce once
        per step (DDP's no_sync); any other pattern is right too, with more reductions."""
        self._new_pass(self.backward_order)
        self.last_microbatch = last
        self.waiting = list(self.reduce_order)  # a new round of reductions (stages 0-1: if last)
        loss.backward()
        if last or self.stage >= 2:
            self.end_round()
            # (stages 2-3: the last unit's reduce-scatter; 0-1: for step to read)
            self.finish_reductions()

    def step(self):
        # 1. the reduced gradients 2. their global norm 3. clip, AdamW, publish. Returns the norm.
        grads = self.gradients()
        norm = self.global_norm(grads)
        self.update(grads, norm)
        return norm

    def gradients(self):
        # wait for every reduction; returns what AdamW reads (stages 1-3: my shards)
        self.wait_published()  # (a unit the forward did not use: its shard is about to change)
        self.end_round()  # (stages 0-1 when no backward said last=True, or none ran: reduce now)
        self.finish_reductions()
        grads = [u.reduced if self.stage <= 1 else u.grad for u in self.units]
        self.waiting = list(self.reduce_order)
        for u in self.units:  # the next step's backward starts a new sum
            u.has_grad, u.reduced = False, None
        return grads

    def global_norm(self, grads):
        # the L2 norm of the whole gradient: each element in one rank's slice (the padding's
        # gradient is zero: it adds nothing)
        parts = [g[u.lo : u.lo + u.S] if self.stage == 0 else g for u, g in zip(self.units, grads)]
        # each slice's norm in its own dtype, as clip_grad_norm_ (a float64 norm: 18x slower on CPU)
        sq = torch.stack([torch.linalg.vector_norm(p).double() for p in parts]).square().sum()
        dist.all_reduce(sq, group=self.group)  # (HSDP: each replica holds the same shards)
        return sq.sqrt()

    def update(self, grads, norm):
        # clip (torch's clip_grad_norm_ rule), AdamW on the masters, publish
        coef = torch.clamp(self.clip / (norm + 1e-6), max=1.0) if self.clip > 0 else None
        for u, g in zip(self.units, grads):
            u.master.grad = g if coef is None else g.mul_(coef.to(g))
        self.opt.step()
        self.opt.zero_grad()  # (set to None: stage 1's reduced shards are freed)
        self.publish()

    def new_master(self, u, mine):  # what AdamW updates: the compute copy itself, in place
        return u.compute

    def publish(self):
        # the master into the compute copy: MixedPrecisionZero's rounds fp32 to bf16, OffloadZero's
        # on a GPU comes from pinned host memory, async (Zero's is one tensor: nothing to copy)
        for u in self.units:
            u.compute.copy_(u.master, non_blocking=True)
        # stages 1-2: all-gather each unit's updated shards, async, waited for at its forward
        for u in self.forward_order if self.stage in (1, 2) else ():
            # the input is a copy: my shard is a slice of `full`, the output
            shard = u.compute.clone()
            self.publishing[u] = all_gather_(u.full.detach(), shard, self.group), shard

    def wait_published(self, u=None):
        # stages 1-2: unit u's all-gather from publish() (None: every unit's)
        for v in [v for v in self.publishing if u in (None, v)]:
            self.publishing.pop(v)[0].wait()


def full_state_dict(zero):
    """The whole unsharded model on every rank, {name in the original model: tensor (CPU)}, master
    dtype: what a copier saves for inference or compares with plain training. Collective: every rank
    calls it."""
    zero.wait_published()
    out = {}
    for u in zero.units:
        flat = u.master.to(zero.device)  # stage 0: the whole vector already
        if zero.stage > 0 and u.numel:  # stages 1-3: my (S,) shard -> (N*S,)
            shard = flat
            flat = shard.new_empty(u.padded)
            all_gather_(flat, shard, zero.group).wait()
        out.update({u.prefix + n: v.to("cpu", copy=True) for n, v in u.views(flat).items()})
    return out


def to_device(t, device):
    # one host-to-device copy (a GPU: from pinned memory, async: the host goes on)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


def train_step(zero, x, y, n_tok, accum, loss_fn):
    """One optimizer step on this rank's rows of (x, y), copied to the device once, in `accum`
    micro-batches; returns this rank's loss (on the device) and the global norm. loss_fn(out, y,
    n_tok): sum / global count."""
    check_split(x.shape[0], zero.dp_world, accum)  # before any collective
    # (B/(R*N), ...) this rank's rows
    x, y = (to_device(t.chunk(zero.dp_world)[zero.dp_rank], zero.device) for t in (x, y))
    local = torch.zeros((), dtype=torch.float64, device=zero.device)
    for i, (xm, ym) in enumerate(zip(x.chunk(accum), y.chunk(accum))):  # (B/(R*N*accum), ...) each
        loss = loss_fn(zero(xm), ym, n_tok)
        zero.backward(loss, last=i == accum - 1)
        local += loss.detach()
    return local, zero.step()


# ============================================================================= mixed precision
class MixedPrecisionZero(Zero):
    """Zero with forward and backward on a `compute_dtype` copy (--mixed-precision, see the top):
    master shards, gradients, reductions and AdamW in the model's dtype. float16: dynamic loss
    scaling."""

    def __init__(
        self, *args, compute_dtype=torch.bfloat16, loss_scale=65536.0, scale_window=1000, **kw
    ):
        self.compute_dtype = compute_dtype  # (read by Zero)
        self.scaling = compute_dtype == torch.float16
        self.scale = loss_scale if self.scaling else 1.0
        self.window = scale_window
        self.clean = 0
        super().__init__(*args, **kw)

    def new_master(self, u, mine):  # a copy of its own, in the model's dtype
        return mine.to(self.device, copy=True)

    def backward(self, loss, last=True):
        super().backward(loss * self.scale if self.scaling else loss, last)

    def gradients(self):  # Zero's, unscaled (fp16: divided by the loss scale)
        grads = super().gradients()
        for g in grads if self.scaling else ():
            g.mul_(1.0 / self.scale)
        return grads

    def update(self, grads, norm):
        # fp16: an overflow (a non-finite norm, the same on every rank: one host sync per step)
        # skips the step and halves the scale; `window` clean steps in a row double it
        self.skipped = self.scaling and not bool(torch.isfinite(norm))
        if self.skipped:
            self.scale /= 2
            self.clean = 0
            return
        super().update(grads, norm)
        self.clean += 1
        if self.scaling and self.clean == self.window:
            self.scale *= 2
            self.clean = 0


# ============================================================================= CPU offload
class OffloadZero(MixedPrecisionZero):
    """ZeRO-Offload (--offload, see the top) on mixed precision (compute_dtype=None: full
    precision): master shards, Adam moments and AdamW's step on the host; the device hands over the
    gradient shards each step."""

    def new_master(self, u, mine):  # on the host, with a host buffer for u's gradient shard
        # on a GPU both page-locked: the copies to and from it are async
        pin = self.device.type == "cuda"
        u.host_grad = torch.zeros(mine.shape, dtype=mine.dtype, pin_memory=pin)
        # (mine: on the CPU, where Zero builds it)
        return mine.pin_memory() if pin else mine.clone()

    def update(self, grads, norm):
        # device -> host (every shard's copy queued, then one wait): AdamW there
        host = [u.host_grad.copy_(g, non_blocking=True) for u, g in zip(self.units, grads)]
        # AdamW on the host reads them next (publish's copies back are not waited for: the top says
        # why)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        super().update(host, norm)


# ----------------------------------------------------------------------------- main
def check_args(args, world):
    check_common_args(args)
    if args.replicate < 1 or world % args.replicate:
        fail(
            f"--replicate {args.replicate} must divide the world of {world} ranks (R copies of the "
            "model, each sharded over world/R ranks)"
        )
    try:  # the core's own checks, each message as one line, its parameters named as the flags
        check_stage(args.stage, args.replicate, ("--stage", "--replicate"))
    except ValueError as e:
        fail(str(e))
    try:
        check_split(args.batch_size, world, args.accum)
    except ValueError as e:
        fail(f"--batch-size, --accum: {e}")
    if args.offload and args.stage == 0:
        fail(
            "--offload moves the sharded optimizer state to the CPU: use it with --stage 1, 2 or 3"
        )
    if args.mixed_precision != "none" and args.dtype == "bfloat16":
        fail(
            "--mixed-precision keeps the master weights in --dtype: use --dtype float32 (or "
            "float64)"
        )
    if args.scale_window < 1:
        fail(f"--scale-window must be >= 1, got {args.scale_window}")


def train_zero(d, args):  # build, train, report, check; returns the --json summary
    data = MarkovData(args.vocab, args.seed)
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])  # whole, on the CPU
    shard_group = replicate_group = None  # R = 1: ZeRO over the whole world
    if args.replicate > 1:
        # HSDP's grid (the top): row i is copy i of the model, column j the R copies of shard j
        grid = torch.arange(d.world).view(args.replicate, -1)  # (R, N)
        shard_group, _ = dist.new_subgroups_by_enumeration(grid.tolist())
        replicate_group, _ = dist.new_subgroups_by_enumeration(grid.T.tolist())
    kind = Zero
    low = {}
    if args.offload or args.mixed_precision != "none":
        kind = OffloadZero if args.offload else MixedPrecisionZero
        low = dict(
            compute_dtype=LOW[args.mixed_precision],
            loss_scale=args.loss_scale,
            scale_window=args.scale_window,
        )
    zero = kind(
        model,
        [f"blocks.{i}" for i in range(args.n_layers)],
        stage=args.stage,
        clip=args.clip,
        optimizer=lambda ps: make_optimizer(ps, args),
        group=shard_group,
        replicate_group=replicate_group,
        device=d.device,
        **low,
    )
    # dropout masks (if any) differ per rank; a resume restores them
    torch.manual_seed(args.seed + d.rank)
    run = Run(d, args, zero, ckpt=ZeroCheckpoint(d, args, zero))  # resumes from --ckpt-dir
    # below the fence: the figures, and the log line's loss summed on a group of its own (the top
    # says why)
    watch = LoopWatch(zero, run, data)
    for step in run.steps():
        # (B, T) global, on the CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        with run.watching(step, watch.comm):  # the bytes of the last step, seen at the dispatcher
            local, _ = train_step(zero, x, y, count_tokens(y), args.accum, lm_loss)
        watch.end_step(step, local)  # the global batch's loss, the log line, the checkpoint
    return watch.finish()  # the closing table, --check, the --json summary


def main():
    args = parse_args(Args)
    check_args(args, env_world_size())
    d = init_dist(args.timeout)
    check = train_zero(d, args)["check"]
    close_dist(ok=check is None or check["passed"])


# --- measurement --- (what the summary prints, watching Zero from outside) ------------------------
class LoopWatch:
    """train_zero's bookkeeping around the loop: the opening line, the bytes handed to each group
    (one CommCounter at the dispatcher, `comm`, entered by run.watching for the last step), Watch,
    the log line's loss summed on a group of its own (NCCL: the training group's stream stays free
    for the overlap), then the closing table, --check and the --json summary."""

    def __init__(self, zero, run, data):
        self.zero = zero
        self.run = run
        d = run.d
        d.log(
            f"ZeRO stage {zero.stage} on {d.world} ranks ({d.backend}); entropy floor "
            f"{data.entropy:.4f}"
        )
        self.comm = CommCounter(dict(shard=zero.group, replicate=zero.replicate_group))
        self.watch = Watch(zero)
        self.log_group = dist.new_group()

    def end_step(self, step, local):
        dist.all_reduce(local, group=self.log_group)  # the global batch's loss
        # fp16: the loss scale; a skipped step, logged
        self.watch.end_step(self.run.d, step, getattr(self.zero, "skipped", False))
        self.run.end_step(step, local.item())  # the timer, the log line, the checkpoint

    def finish(self):
        run = self.run
        return summary(run.d, run.args, self.zero, run, self.watch, self.comm)


class Watch:
    """What zero.py measures, through Zero's plain attributes and methods (Zero counts nothing).
    saved activations  a wrapper around Zero's own pack hook (the innermost pair of saved-tensor hooks,
                       which would hide an outer harness.SavedActivations): the bytes of what it
                       keeps per micro-batch forward, each storage once (not parameter views, not
                       stage-3 positions)
    gathered buffers   each stage-3 all-gather's output, held weakly (harness.LiveStorages); their peak"""

    def __init__(self, zero):
        self.zero = zero
        self.gathered = LiveStorages()
        self.saved = 0
        self.saved_peak = 0
        self._seen = set()
        # fp16: the loss scale after each step, the steps skipped
        self.scales, self.skipped = (
            [],
            [],
        )
        pack, launch = zero._pack, zero._launch_gather
        zero._pack = lambda t: self._kept(pack(t))
        zero._launch_gather = lambda u: self._gathered(*launch(u))
        zero.root.register_forward_pre_hook(self._new_forward)
        zero.root.register_forward_hook(self._end_forward)

    def end_step(self, d, step, skipped):
        # (MixedPrecisionZero's; fp16 changes it)
        self.scales.append(getattr(self.zero, "scale", 1.0))
        if skipped:
            self.skipped.append(step)
            d.log(
                f"step {step:4d} | overflow: step skipped on every rank, loss scale -> "
                f"{self.scales[-1]:g}"
            )

    def _new_forward(self, *_):
        self.saved, self._seen = 0, set()

    def _end_forward(self, *_):
        self.saved_peak = max(self.saved_peak, self.saved)

    def _add(self, t):  # a storage saved twice counts once
        if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in self._seen:
            self._seen.add(t.untyped_storage().data_ptr())
            self.saved += t.untyped_storage().nbytes()

    def _kept(self, kept):  # what _pack kept: a tensor, or a stage-3 position (not a tensor)
        params = (
            {u.full.untyped_storage().data_ptr() for u in self.zero.units}
            if self.zero.stage < 3
            else ()
        )
        if torch.is_tensor(kept) and kept.untyped_storage().data_ptr() not in params:
            self._add(kept)
        return kept

    def _gathered(self, work, buf):  # gathered memory only grows here, so the peak is seen here
        self.gathered.add(buf)
        self.gathered.alive()
        return work, buf


def memory(zero):
    """Model-state bytes of this rank, counted from the tensors themselves."""
    moments = [
        v
        for u in zero.units
        for v in zero.opt.state.get(u.master, {}).values()
        if torch.is_tensor(v) and v.dim() > 0
    ]
    masters = [u.master for u in zero.units] if separate_master(zero) else []
    host_grads = [u.host_grad for u in zero.units] if isinstance(zero, OffloadZero) else []
    return dict(
        params=tensor_bytes([u.full if zero.stage < 3 else u.shard for u in zero.units]),
        grads=tensor_bytes([u.grad for u in zero.units]),
        optim=tensor_bytes(moments + masters),
        host_grad_copy=tensor_bytes(host_grads),
    )


def separate_master(zero):
    # MixedPrecisionZero and OffloadZero keep one; Zero steps the compute copy
    return isinstance(zero, MixedPrecisionZero)


def theory(zero, padded=False):
    """ZeRO's formulas with the bytes of the dtypes actually run: p (compute copy), g (gradient
    accumulator, master dtype), K = 2 Adam moments (+ the master copy when separate)."""
    psi = sum(u.padded if padded else u.numel for u in zero.units)
    p, m = torch.finfo(zero.compute_dtype).bits // 8, torch.finfo(zero.master_dtype).bits // 8
    N = zero.world
    s = zero.stage
    K = 2 * m + (m if separate_master(zero) else 0)
    return dict(
        params=p * psi / (N if s == 3 else 1),
        grads=m * psi / (N if s >= 2 else 1),
        optim=K * psi / (N if s >= 1 else 1),
        psi=psi,
        p=p,
        g=m,
        K=K,
    )


def report(d, args, zero, watch, comm, resumed_from):
    """Rank 0's closing table: each figure counted in this run beside its ZeRO theory value. Returns
    the peak memory (read first, right after training: on a GPU, --check's reference would be the
    peak after) and the figures."""
    top = peak(d, args, zero, watch)
    mem = memory(zero)
    th = theory(zero)
    thp = theory(zero, padded=True)
    N = zero.world  # the ranks that shard the model (HSDP: world / R)
    R = zero.dp_world // N
    s = args.stage
    psi = th["psi"]
    p = th["p"]
    g = th["g"]
    K = th["K"]
    A = args.accum
    keys = ("params", "grads", "optim")
    saved = watch.saved_peak
    sent = comm.total()
    formula = {
        0: "(p+g+K) Psi",
        1: "(p+g) Psi + K Psi/N",
        2: "p Psi + (g+K) Psi/N",
        3: "(p+g+K) Psi/N",
    }[s]
    paper = {0: 16, 1: 4 + 12 / N, 2: 2 + 14 / N, 3: 16 / N}[
        s
    ] * psi  # fp16 Adam: p = g = 2, K = 12
    # bytes handed to collectives per step: an all-reduce or reduce-scatter takes the whole vector,
    # an all-gather this rank's 1/N of it; a ring then puts (N-1)/N of the first (twice for an
    # all-reduce) and N-1 times the second on this rank's link
    comm_, comm_formula = {
        0: (g * psi, "g Psi: all-reduce"),
        1: (psi * (g + p / N), "Psi (g + p/N): reduce-scatter + all-gather"),
        2: (
            psi * (A * g + p / N),
            "Psi (accum g + p/N): reduce-scatter per micro-batch + all-gather",
        ),
        3: (
            A * psi * (2 * p / N + g),
            "accum Psi (2p/N + g): 2 all-gathers + reduce-scatter per micro-batch",
        ),
    }[s]
    # HSDP: each reduction's shard (Psi/N) then all-reduced across the R replicas: once per step at
    # stage 1, once per micro-batch at stages 2-3 (as each reduce-scatter)
    across = 0 if R == 1 else g * psi / N * (1 if s == 1 else A)
    gathered = p * (
        zero.root.padded + sum(sorted((u.padded for u in zero.units[:-1]), reverse=True)[:2])
    )
    on_cpu = " (= the device here: trivially true on CPU)" if zero.device.type == "cpu" else ""
    d.log(
        f"\nmemory per rank, counted from the tensors | ZeRO theory, Psi={psi}, N={N}, p={p} g={g} "
        f"K={K} "
        "bytes"
    )
    for k, label in (
        ("params", "parameters (compute copy)"),
        ("grads", "gradients (accumulator)"),
        ("optim", "optimizer (master, m, v)" + (" on host" + on_cpu if args.offload else "")),
    ):
        d.log(f"  {label:32s} {mem[k]:>10,d} B | theory {th[k]:>12,.0f} B")
    d.log(
        f"  {'model states':32s} {sum(mem[k] for k in keys):>10,d} B | theory "
        f"{sum(th[k] for k in keys):>12,.0f} B = {formula}  (paper, fp16 Adam: {paper:,.0f} B)"
    )
    if s == 3:
        d.log(
            f"  {'peak gathered parameters':32s} {watch.gathered.peak:>10,d} B | bound "
            f"{gathered:>12,.0f} B"
            " = p (root + 2 largest units: the one running, the one prefetched)"
        )
    d.log(f"  {'saved activations/micro-batch':32s} {saved:>10,d} B (memory_savers.py cuts these)")
    d.log(
        f"bytes handed to collectives per rank per step: counted {sent:,.0f} B | theory "
        f"{comm_ + across:,.0f} B = {comm_formula}{' + HSDP' if R > 1 else ''} (counted: padded "
        "vectors + the 8-byte norm all-reduce)"
    )
    groups = dict(
        shard=dict(counted=comm.total(axis="shard"), theory=comm_),
        replicate=dict(counted=comm.total(axis="replicate"), theory=across),
    )
    if R > 1:
        d.log(
            f"  shard group ({N} ranks: all-gathers, reduce-scatters, the norm): counted "
            f"{groups['shard']['counted']:,.0f} B | theory {comm_:,.0f} B = {comm_formula}\n"
            f"  replicate group ({R} ranks: all-reduce of each reduced shard): counted "
            f"{groups['replicate']['counted']:,.0f} B | theory {across:,.0f} B = g Psi/N x "
            f"{'1' if s == 1 else 'accum'}"
        )
    return top, dict(
        memory={k: dict(counted=mem[k], theory=th[k], theory_padded=thp[k]) for k in keys},
        host_grad_copy_bytes=mem["host_grad_copy"],
        psi=psi,
        psi_padded=thp["psi"],
        bytes_per_elem=dict(p=p, g=g, K=K),
        model_state_formula=formula,
        gathered_peak_bytes=watch.gathered.peak,
        gathered_bound_bytes=gathered,
        saved_activation_bytes=saved,
        comm_theory_bytes=comm_ + across,
        comm_by_group=groups,
        replicate=R,
        comm_formula=comm_formula,
        loss_scale=watch.scales,
        per_rank=per_rank(d, zero, watch.skipped),
        resumed_from_step=resumed_from,
    )


def summary(d, args, zero, run, watch, comm):
    """The closing table, then --check, then the --json summary (returned)."""
    # the peak first: before --check trains
    top, figures = report(d, args, zero, watch, comm, run.start)
    check = check_run(d, args, run.losses, full_state_dict(zero)) if args.check else None
    steps = (run.losses, run.timer.median(), run.tokens_per_s())
    return write_summary(d, args, "zero", *steps, top, comm.total(), check, figures)


def peak(d, args, zero, watch):
    """Largest over ranks: CUDA's own peak on a GPU, else the bytes counted: the model states on the
    device, the gathered peak and the saved activations of the training forwards."""
    mem = memory(zero)
    counted = mem["params"] + mem["grads"] + (0 if args.offload else mem["optim"])
    return peak_memory_bytes(d, counted + watch.gathered.peak + watch.saved_peak)


def adam_step(zero):  # AdamW's step count (fp16 skips steps); 0 before the first step
    return float(zero.opt.state.get(zero.units[0].master, {}).get("step", 0))


def per_rank(d, zero, skipped):
    """What each rank decided on its own: the steps it skipped, its optimizer's step count (as
    tensors)."""
    every_skipped = gather_rows(d, torch.tensor(skipped, dtype=torch.float64).view(-1, 1))
    every_adam = gather_rows(d, [[adam_step(zero)]])
    return [
        dict(skipped=[int(s) for s in sk[:, 0].tolist()], adam_step=a[0, 0].item())
        for sk, a in zip(every_skipped, every_adam)
    ]


# --- reference for --check --- (mixed precision: one process, the same recipe) --------------------
def check_run(d, args, losses, full):
    """--check against the one-process reference that fits the run (`full`: the whole model on rank
    0)."""
    if args.mixed_precision != "none":
        return check_mixed(d, args, losses, full)
    return check_against_reference(d, args, losses, full)  # common.reference_train


def reference(args, world, device="cpu"):
    """What --check compares a --mixed-precision run with: one process, the same recipe, written
    plainly with nn.Module parameters. A low-precision copy of the model (none: the model itself)
    computes each of the world x accum micro-batches the ranks compute (the same rows and shapes, so
    the same bf16/fp16 arithmetic); each micro-batch's gradient is cast to --dtype and summed there;
    clipping and AdamW run on --dtype master weights, which are then rounded into the copy. fp16
    scales the loss and skips a non-finite step."""
    data, rows = MarkovData(args.vocab, args.seed), args.batch_size // world
    master = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    low = (
        master
        if LOW[args.mixed_precision] is None
        else build_gpt(GPTConfig.from_args(args), args.seed, LOW[args.mixed_precision], device)
    )
    opt = make_optimizer(master.parameters(), args)
    scale = args.loss_scale if args.mixed_precision == "fp16" else 1.0
    clean = 0
    losses = []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        n_tok, total = count_tokens(y), 0.0
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for r in range(world):
            mine = slice(r * rows, (r + 1) * rows)  # rank r's rows, in the same micro-batches
            for xm, ym in zip(x[mine].chunk(args.accum), y[mine].chunk(args.accum)):
                low.zero_grad(set_to_none=True)
                loss = lm_loss(low(xm), ym, n_tok)
                (loss * scale).backward()
                for g, p in zip(grads, low.parameters()):
                    g += p.grad.to(g.dtype)
                total += loss.item()
        losses.append(total)
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
                q.copy_(p)  # (a copy onto itself without mixed precision)
        clean += 1
        if args.mixed_precision == "fp16" and clean == args.scale_window:
            scale, clean = scale * 2, 0
    return dict(losses=losses, params={n: p.detach().clone() for n, p in master.named_parameters()})


def check_mixed(d, args, losses, params):
    """--check for --mixed-precision, against reference() on rank 0. The two do the same arithmetic
    up to the order of a few fp32 operations, and agree bit for bit until one such rounding sends a
    master weight to the neighbouring bf16/fp16 value; from then on they differ as two runs of the
    same recipe do: the losses by about the compute dtype's unit roundoff u at most (2^-8 bf16,
    2^-11 fp16), and a few single weights, whose gradient is mostly rounding noise that AdamW
    normalises to a full step, by up to ~lr per step, so the largest elementwise difference says
    little. What does not drift is each tensor's path: the difference of a tensor relative to how
    far training moved it, |X - X_ref| / |X_ref - X_0| (L2), stays a few percent (measured 2e-2
    after 20 bf16 steps on 4 ranks), while a missing reduction makes it O(1) (measured 1.3 after 4
    steps). Tolerances: u on the losses, 0.1 on that ratio."""
    t = torch.zeros(3, dtype=torch.float64, device=d.device)
    if d.rank == 0:
        ref = reference(args, d.world, d.device)
        init = dict(
            build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype]).named_parameters()
        )
        u = torch.finfo(LOW[args.mixed_precision]).eps / 2  # unit roundoff: half the spacing at 1
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"]))
        path_diff = max(
            (
                (params[n] - r.cpu()).norm() / (init[n].detach() - r.cpu()).norm().clamp_min(1e-30)
            ).item()
            for n, r in ref["params"].items()
        )
        passed = len(losses) == len(ref["losses"]) and loss_diff <= u and path_diff <= 0.1
        d.log(
            "check vs one-process reference, same precision recipe: max rel loss diff "
            f"{loss_diff:.3e} (tolerance {u:.0e} = u), max param diff relative to training's move "
            f"{path_diff:.3e} (0.1) -> {'PASSED' if passed else 'FAILED'}"
        )
        t = torch.tensor(
            [loss_diff, path_diff, float(passed)], dtype=torch.float64, device=d.device
        )
    dist.broadcast(t, src=0)  # rank 0's verdict for every rank, as numbers in a tensor
    return dict(max_loss_diff=t[0].item(), max_param_diff=t[1].item(), passed=bool(t[2].item()))


# --- checkpoint --- (torch.distributed.checkpoint of a Zero: any world size resumes it) -----------
class ZeroCheckpoint:
    """DIR/step{s}/ is a torch.distributed.checkpoint (DCP): per unit, the master and the Adam
    moments as DTensors sharded Shard(0) over `group`. DCP cuts a (P,) vector as torch.chunk does,
    ceil(P/N) elements per rank, the last ranks' short or empty: zero.py's flat shards without their
    padding, so a resume at another world size is DCP's own resharding (stage 0 saves its slice [lo,
    lo + valid) and loads the whole vector, Replicate). Beside them AdamW's step, the fp16 loss
    scale, the losses, and each rank's RNG states as its row of a (world, L) tensor, restored at the
    same world size only. Every rank writes its file, then rank 0 DCP's .metadata (temporary file +
    rename): the step is complete; the last two are kept. A resume takes the newest complete step,
    checked by every rank before any collective: rank-local checkpoints (Checkpointer's rank*/), a
    damaged .metadata or another model are refused with one line (exit 2), and so are ranks that see
    different steps (node-local disks: .metadata on rank 0's node only). Run passes the Zero as
    `state`."""

    MOMENTS = ("exp_avg", "exp_avg_sq")

    def __init__(self, d, args, zero):
        # --ckpt-dir, --save-every, --steps; the groups are the Zero's
        self.d = d
        self.root = args.ckpt_dir
        self.save_every = args.save_every
        self.steps = args.steps
        self.group = zero.group
        replicate_group = zero.replicate_group
        # the mesh lays out CPU copies; a unit's vector is Shard(0) over `group`, and with HSDP also
        # Replicate() over `replicate_group` (DCP writes each shard once); DCP then talks to every
        # rank
        self.mesh = DeviceMesh.from_group(self.group, "cpu")
        self.place = [Shard(0)]
        if replicate_group is not None:
            grid = torch.arange(dist.get_world_size()).view(
                dist.get_world_size(replicate_group), -1
            )
            self.mesh = DeviceMesh.from_group(
                [replicate_group, self.group], "cpu", grid, mesh_dim_names=("replicate", "shard")
            )
            self.place = [Replicate(), Shard(0)]
            self.group = dist.group.WORLD
        self.world = dist.get_world_size(self.group)

    def _state(self, zero, loading):
        """What DCP saves or loads into: {key: DTensor}, this rank's shards (CPU copies) and RNG
        rows; and [(DTensor, the slice of the Zero's tensor it copies)] to copy a load back."""
        state, copies = {}, []
        rng = dict(rng_cpu=torch.get_rng_state())
        if self.d.device.type == "cuda":
            rng["rng_cuda"] = torch.cuda.get_rng_state(self.d.device)
        for k, v in rng.items():  # (world, L): row r is rank r's
            rows = [Shard(0)] * self.mesh.ndim  # (HSDP: grid[i, j] = rank i * N + j, row by row)
            state[k] = DTensor.from_local(v.view(1, -1), self.mesh, rows, run_check=False)
        for i, u in enumerate(zero.units):
            st = zero.opt.state.get(u.master) or {
                k: torch.zeros_like(u.master) for k in self.MOMENTS
            }
            whole = zero.stage == 0 and loading
            valid = max(0, min(u.S, u.numel - u.lo))  # real (not padding) elements in my shard
            lo, n = (0, u.numel) if whole else (u.lo if zero.stage == 0 else 0, valid)
            for k, v in (("master", u.master), *((k, st[k]) for k in self.MOMENTS)):
                part = v.detach()[lo : lo + n]
                place = [Replicate()] if whole else self.place
                state[f"unit{i}.{k}"] = DTensor.from_local(
                    part.cpu(), self.mesh, place, run_check=False, shape=(u.numel,), stride=(1,)
                )
                copies.append((state[f"unit{i}.{k}"], part))
        return state, copies

    def _steps(self, name=""):
        # the steps whose directory holds `name` (""; every step directory), in order
        if not self.root or not os.path.isdir(self.root):
            return []
        return sorted(
            int(f[4:])
            for f in os.listdir(self.root)
            if f.startswith("step")
            and f[4:].isdigit()
            and os.path.exists(os.path.join(self.root, f, name))
        )

    def _sizes(self, path, zero):  # DCP's .metadata, checked against this run: {key: global shape}
        try:
            sizes = {
                k: tuple(m.size)
                for k, m in dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
            }
        except Exception as e:
            fail(
                f"cannot read checkpoint {path}/.metadata ({type(e).__name__}): delete it or use "
                "another --ckpt-dir"
            )
        want = {f"unit{i}.master": (u.numel,) for i, u in enumerate(zero.units)}
        got = {k: s for k, s in sizes.items() if k.endswith(".master")}
        if got != want:
            fail(
                f"checkpoint {path} holds another model (flat sizes "
                f"{[s for (s,) in got.values()]}, this "
                f"run {[s for (s,) in want.values()]}): use another --ckpt-dir"
            )
        return sizes

    def load(self, zero):
        """Restore `zero` and the RNG from the newest complete step; return (step, history), (0, {})
        when there is nothing to resume."""
        if not self.root:
            return 0, {}
        if os.path.isdir(self.root) and any(f.startswith("rank") for f in os.listdir(self.root)):
            fail(
                f"--ckpt-dir {self.root} holds another file's rank-local checkpoints (rank*/), not "
                f"{os.path.basename(sys.argv[0])}'s sharded steps (step*/): use another --ckpt-dir"
            )
        steps = self._steps(".metadata")
        if steps:  # checked before the collective
            self._sizes(os.path.join(self.root, f"step{steps[-1]}"), zero)
        # Only rank 0 writes .metadata: on node-local disks the other nodes' ranks hold their files
        # without it Only the newest step may lack it (a save cut short); ranks that disagree see
        # different directories.
        orphans = [s for s in self._steps()[:-1] if s not in steps]
        newest = steps[-1] if steps else 0
        t = torch.tensor([newest, -newest, len(orphans)], device=self.d.device)
        # (the largest, -(the smallest), orphans)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        hi = int(t[0])
        lo = -int(t[1])
        orphans = int(t[2])
        if hi != lo or orphans:
            fail(
                f"--ckpt-dir {self.root}: the ranks see different checkpoints (newest complete "
                f"step {lo} to {hi}; {orphans} older steps with a piece but no .metadata): it must "
                "be shared by every node"
            )
        if not hi:
            return 0, {}
        path = os.path.join(self.root, f"step{hi}")
        sizes = self._sizes(path, zero)
        for u in zero.units:  # AdamW's state for DCP to load into
            zero.opt.state[u.master] = dict(
                step=torch.tensor(0.0), **{k: torch.zeros_like(u.master) for k in self.MOMENTS}
            )
        state, copies = self._state(zero, loading=True)
        saved_world = sizes["rng_cpu"][0]
        # at another world size the ranks' RNG streams cannot continue
        if saved_world != self.world:
            state = {k: v for k, v in state.items() if not k.startswith("rng")}
        # place, not plain values
        state.update(
            scalars=torch.zeros(3, dtype=torch.float64),  # tensors: dcp.load fills tensors in
            losses=torch.zeros(sizes["losses"], dtype=torch.float64),
        )
        # every rank reads what it owns now
        dcp.load(state, checkpoint_id=path, process_group=self.group)
        for t, part in copies:
            # (the CPU copy DCP filled -> the device's shard; on a CPU: itself)
            part.copy_(t.to_local())
        adam_step, scale, clean = state["scalars"].tolist()
        for u in zero.units:
            zero.opt.state[u.master]["step"].fill_(adam_step)
        if isinstance(zero, MixedPrecisionZero):
            zero.scale, zero.clean = scale, int(clean)
        zero.publish()  # master -> compute copy (and the all-gather of stages 1-2)
        if saved_world == self.world:
            torch.set_rng_state(state["rng_cpu"].to_local()[0])
            if self.d.device.type == "cuda":
                torch.cuda.set_rng_state(state["rng_cuda"].to_local()[0], self.d.device)
        self.d.log(
            f"resumed from {self.root} at step {hi} (saved at world size {saved_world}"
            f"{'' if saved_world == self.world else '; RNG streams start afresh'})"
        )
        return hi, dict(losses=state["losses"].tolist())

    def maybe_save(self, step, zero, history):
        """`step` = steps completed. Saves every `save_every` steps and after the last one."""
        if not self.root or not (
            step == self.steps or (self.save_every and step % self.save_every == 0)
        ):
            return
        # (stages 1-2, no separate master: the master is a view of the gathered vector)
        zero.wait_published()
        state, _ = self._state(zero, loading=False)
        scalars = [
            adam_step(zero),
            getattr(zero, "scale", 1.0),
            getattr(zero, "clean", 0),
        ]  # (fp16's scale)
        state.update(
            scalars=torch.tensor(scalars, dtype=torch.float64),
            losses=torch.tensor(history.get("losses", []), dtype=torch.float64),
        )
        dcp.save(
            state, checkpoint_id=os.path.join(self.root, f"step{step}"), process_group=self.group
        )
        if dist.get_rank(self.group) == 0:  # .metadata is written: the step is complete
            for old in self._steps(".metadata")[:-2]:  # keep the last two
                shutil.rmtree(os.path.join(self.root, f"step{old}"))


if __name__ == "__main__":
    main()
