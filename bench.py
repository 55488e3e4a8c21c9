"""bench.py: every technique of this repo beside PyTorch's own, on the same model, data and machine, in one run.

    python bench.py                                  # every pair, world 2, one thread per rank, 10.6 M params
    python bench.py --pairs ddp,zero3 --rounds 5     # some pairs, more alternations
    python bench.py --world 4 --d-model 1024         # GPUs: the same command, NCCL on cuda:LOCAL_RANK

Each pair runs our file (`torchrun FILE.py ... --json`) and torch's built-in (`torchrun bench.py --worker
NAME`, the code below) alternately, A B A B, so that drift on a busy machine hits both sides; the step time
is the median over every step after --warmup of every round. Both sides train the same GPT from the same
seed on the same global batch (float32, AdamW, clipping at the global norm), and both make their batch
inside the timed step, as every technique file does:

    pair      ours                               torch's own
    ddp       ddp_bucketed.py                    DistributedDataParallel, the same bucket cap
    dp_sync   dp.py --mode sync (no overlap)     DistributedDataParallel, the same bucket cap
    zero1     zero.py --stage 1                  DDP + ZeroRedundancyOptimizer
    zero2     zero.py --stage 2                  fully_shard(reshard_after_forward=False) per block, then root
    zero3     zero.py --stage 3                  fully_shard per block, then root
    gpipe     gpipe.py                           pipelining PipelineStage + ScheduleGPipe, same layer bounds
    1f1b      pipedream.py --mode flush          pipelining Schedule1F1B
    tp        megatron_tp.py                     DTensor ColwiseParallel / RowwiseParallel (parallelize_module)
    ptdp      ptdp.py --virtual-stages 2         ScheduleInterleaved1F1B, 2 stages per rank (if ptdp.py exists)

Figures per pair: step time, tokens/s, peak memory per rank, bytes handed to collectives and sends per rank
and step (counted), the pipelines' bubble beside (p-1)/(m+p-1), data parallel's scaling efficiency
(tokens/s at world N over N x tokens/s of one process), and for ddp_bucketed the share of all-reduce time
hidden behind backward against the same buckets reduced after backward. Writes --out.json (a list of rows
with `ours`, `torch`, `ratio`) and --out.md. --profile DIR runs both sides under torch.profiler, writes a
Chrome trace per run and rank, and prints each run's biggest top-level ops (where a slower side loses time).
"""
import contextlib, json, os, re, statistics, subprocess, sys, time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData)
from harness import (check_common_args, CommonArgs, gather_rows, log_step, parse_args, peak_memory_bytes,
                     SavedActivations, StepTimer, tensor_bytes, write_summary)

ROOT = Path(__file__).resolve().parent
MiB = 1024 * 1024


@dataclass
class Args(CommonArgs):
    steps: int = 6  # optimizer steps per run (the first --warmup are not timed)
    batch_size: int = 8  # global batch, in sequences
    seq_len: int = 64  # tokens per sequence
    vocab: int = 1024  # vocabulary size (every launch computes the chain's stationary law: eig of V x V)
    d_model: int = 448  # model width (with the defaults: 10.6 M parameters)
    n_layers: int = 4  # transformer blocks (a multiple of world x 2 for the ptdp pair)
    n_heads: int = 8  # attention heads
    pairs: str = "all"  # comma-separated pairs: ddp,dp_sync,zero1,zero2,zero3,gpipe,1f1b,tp,ptdp (or all)
    world: int = 2  # processes per run (on GPUs: GPUs)
    rounds: int = 3  # alternations A B per pair (a busy machine swings a round by 2x: the median needs several)
    warmup: int = 2  # steps per run left out of the step time
    microbatches: int = 4  # pipelines: micro-batches per step
    bucket_cap_mb: float = 4.0  # ddp, dp_sync, zero1: bucket cap in MiB on both sides
    threads: int = 1  # OMP_NUM_THREADS of every rank
    scaling: bool = True  # data-parallel pairs: also time plain one-process training, for the scaling efficiency
    out: str = "bench"  # writes OUT.json and OUT.md
    profile: str = ""  # write a torch.profiler Chrome trace of every run and rank into this directory
    launch_timeout: int = 600  # seconds one torchrun launch may take
    worker: str = ""  # (internal) run torch's side of a pair under torchrun


PAIRS = {  # pair -> (our file, its flags, torch's worker, kind)
    "ddp": ("ddp_bucketed.py", lambda a: ["--bucket-cap-mb", a.bucket_cap_mb, "--first-bucket-mb", a.bucket_cap_mb],
            "ddp", "dp"),
    "dp_sync": ("dp.py", lambda a: ["--mode", "sync"], "ddp", "dp"),
    "zero1": ("zero.py", lambda a: ["--stage", 1], "zero1", "dp"),
    "zero2": ("zero.py", lambda a: ["--stage", 2], "fsdp_noreshard", "dp"),
    "zero3": ("zero.py", lambda a: ["--stage", 3], "fsdp", "dp"),
    "gpipe": ("gpipe.py", lambda a: ["--microbatches", a.microbatches], "gpipe", "pp"),
    "1f1b": ("pipedream.py", lambda a: ["--mode", "flush", "--microbatches", a.microbatches], "1f1b", "pp"),
    "tp": ("megatron_tp.py", lambda a: [], "tp", "tp"),
    "ptdp": ("ptdp.py", lambda a: ["--pp", a.world, "--tp", 1, "--dp", 1, "--virtual-stages", 2,
                                   "--microbatches", a.microbatches], "interleaved", "pp"),
}
TORCH_NAME = {"ddp": "DistributedDataParallel", "zero1": "DDP + ZeroRedundancyOptimizer",
              "fsdp_noreshard": "fully_shard(reshard_after_forward=False)", "fsdp": "fully_shard",
              "gpipe": "pipelining ScheduleGPipe", "1f1b": "pipelining Schedule1F1B",
              "tp": "DTensor Colwise/RowwiseParallel", "interleaved": "pipelining ScheduleInterleaved1F1B"}


# ----------------------------------------------------------------------------- torch's side: data parallel
def data_parallel_side(d, args, name):
    """DDP (+ ZeroRedundancyOptimizer) or FSDP2 over the whole world, each used as torch documents it."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])  # full model on CPU
    if name in ("ddp", "zero1"):
        model = model.to(d.device)
        net = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                  bucket_cap_mb=args.bucket_cap_mb)
        if name == "zero1":  # AdamW's state sharded over ranks; every rank broadcasts its updated shard
            opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr, betas=(0.9, 0.95),
                                          weight_decay=args.weight_decay, foreach=False)
        else:
            opt = make_optimizer(model.parameters(), args)
    else:  # FSDP2: each block its own unit, then the root (embeddings, final norm, head), as torch's docs do
        mesh = dist.device_mesh.init_device_mesh(d.device.type, (d.world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=name == "fsdp")
        net = fully_shard(model, mesh=mesh, reshard_after_forward=name == "fsdp")
        opt = make_optimizer(model.parameters(), args)
    data, b = MarkovData(args.vocab, args.seed), args.batch_size // d.world
    gathered = GatheredBytes(model) if name.startswith("fsdp") else None

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)
        x, y = x[d.rank * b:(d.rank + 1) * b].to(d.device), y[d.rank * b:(d.rank + 1) * b].to(d.device)  # (B/N, T)
        with SavedActivations() as acts:
            loss = lm_loss(net(x), y, n_tok)  # this rank's share of the global loss
        opt.zero_grad(set_to_none=True)
        (loss * d.world).backward()  # DDP and FSDP average over ranks: N x share, averaged = the global gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # FSDP: DTensor grads, a global norm
        opt.step()
        total = loss.detach().reshape(1)
        with COUNT.pause():
            dist.all_reduce(total)  # logging only
        optim_state = opt.optim.state if name == "zero1" else opt.state
        counted = state_tensor_bytes(model.parameters(), optim_state) + acts.bytes
        counted += sum(ddp_bucket_sizes(net)) if name in ("ddp", "zero1") else gathered.peak
        return total.item(), counted

    return step


def single_process_side(d, args, name):
    """Plain one-process training on the whole global batch (common.reference_train's loop): the baseline
    of data parallel's scaling efficiency."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    opt, data = make_optimizer(model.parameters(), args), MarkovData(args.vocab, args.seed)

    def step(i):
        x, y = (t.to(d.device) for t in data.batch(i, args.batch_size, args.seq_len))  # (B, T)
        with SavedActivations() as acts:
            loss = lm_loss(model(x), y, count_tokens(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        return loss.item(), state_tensor_bytes(model.parameters(), opt.state) + acts.bytes

    return step


def ddp_bucket_sizes(net):
    """The bytes of each of DDP's gradient buckets, as DDP reports them (its C++ reducer owns them); after the
    first step DDP rebuilds them in the order gradients arrived."""
    data = net._get_ddp_logging_data()
    return [int(s) for s in re.findall(r"\d+", str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")))]


class GatheredBytes:
    """FSDP2 on CPU: the bytes of all-gathered (unsharded) parameters alive, sampled as each unit starts its
    forward and its backward (torch's CUDA peak covers them on a GPU). Reads FSDP's own parameter objects."""

    def __init__(self, model):
        self.units, self.peak = [m for m in model.modules() if hasattr(m, "_get_fsdp_state")], 0
        for m in self.units:
            m.register_forward_pre_hook(lambda *_: self.sample())
            m.register_forward_hook(lambda *_: self.sample())
            m.register_full_backward_pre_hook(lambda *_: self.sample())

    def sample(self):
        alive = 0
        for m in self.units:
            group = getattr(m._get_fsdp_state(), "_fsdp_param_group", None)
            for fp in getattr(group, "fsdp_params", []):
                t = getattr(fp, "_unsharded_param", None)
                alive += t.untyped_storage().nbytes() if t is not None else 0
        self.peak = max(self.peak, alive)


def state_tensor_bytes(params, optim_state):
    """Parameters, gradients and optimizer state this rank holds (a DTensor counts its local shard)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    params = list(params)
    ts = [local(p) for p in params] + [local(p.grad) for p in params if p.grad is not None]
    ts += [local(v) for s in optim_state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensor_bytes(ts)


# ----------------------------------------------------------------------------- torch's side: pipelines
def split_layers(n_layers, stages):
    """The split of gpipe.py / pipedream.py: as even as possible, the earlier stages take the extra block."""
    base, extra = divmod(n_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        bounds.append((start, start + base + (s < extra)))
        start = bounds[-1][1]
    return bounds


class PipeStage(nn.Module):
    """Blocks [start, end) of the GPT; the embedding on the first stage, final norm + head on the last."""

    def __init__(self, gpt, s, bounds):
        super().__init__()
        (a, z), self.first, self.last = bounds[s], s == 0, s == len(bounds) - 1
        self.tok_emb, self.pos_emb = (gpt.tok_emb, gpt.pos_emb) if self.first else (None, None)
        self.blocks = nn.ModuleList(gpt.blocks[a:z])
        self.ln_f, self.head = (gpt.ln_f, gpt.head) if self.last else (None, None)

    def forward(self, h):  # first: (b, T) ids; else (b, T, D)
        if self.first:
            h = self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h)) if self.last else h  # last: (b, T, V) logits


def pipeline_side(d, args, name):
    """torch.distributed.pipelining: one PipelineStage per stage (two per rank, looped, for interleaved)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    v = 2 if name == "interleaved" else 1
    n_stages, m = d.world * v, args.microbatches
    bounds = split_layers(args.n_layers, n_stages)
    full = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype])  # CPU; a rank moves its stages
    ids = [d.rank + k * d.world for k in range(v)]  # looped placement: rank r holds stages r, r + p, ...
    mods = [PipeStage(full, s, bounds).to(d.device) for s in ids]
    stages = [PipelineStage(mod, s, n_stages, d.device) for mod, s in zip(mods, ids)]
    n_tok = [1]
    loss_fn = lambda logits, y: lm_loss(logits, y, n_tok[0])  # noqa: E731  sum / tokens of the global batch
    # scale_grads=False: each micro-batch loss is already divided by the global token count (common.lm_loss)
    if v == 1:
        sched = (ScheduleGPipe if name == "gpipe" else Schedule1F1B)(stages[0], m, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = ScheduleInterleaved1F1B(stages, m, loss_fn=loss_fn, scale_grads=False)
    params = [p for mod in mods for p in mod.parameters()]
    opt, data = make_optimizer(params, args), MarkovData(args.vocab, args.seed)
    timeline = StageTimeline(stages)
    first, last = 0 in ids, n_stages - 1 in ids

    def step(i):
        x, y = data.batch(i, args.batch_size, args.seq_len)  # (B, T) global batch, CPU
        n_tok[0] = count_tokens(y)
        opt.zero_grad(set_to_none=True)
        timeline.start(d)
        losses = []
        kwargs = dict(target=y.to(d.device), losses=losses) if last else {}
        sched.step(*([x.to(d.device)] if first else []), **kwargs)  # the schedule splits the batch into m
        loss = sum(losses) if losses else torch.zeros((), device=d.device)
        grads = [p.grad for p in params if p.grad is not None]
        both = torch.stack([sum((g.double() ** 2).sum() for g in grads), loss.double()])  # (2,) this rank's part
        dist.all_reduce(both)  # squared norm of the whole model, batch loss (as gpipe.py does)
        clip_grads_(grads, both[0].sqrt(), args.clip)
        opt.step()
        counted = state_tensor_bytes(params, opt.state) + timeline.saved_peak
        return both[1].item(), counted

    step.figures = lambda: timeline.figures(d, m, v)
    return step


class StageTimeline:
    """Times every forward_one_chunk / backward_one_chunk of this rank's stages (one micro-batch's compute;
    sends and receives run outside them), with CUDA events on a GPU (read once, after the step), and counts
    the activation bytes each forward saves for backward until that micro-batch's backward frees them."""

    def __init__(self, stages):
        self.events, self.saved_peak = [], 0
        for k, st in enumerate(stages):
            st.forward_one_chunk = self._timed(st.forward_one_chunk, 0, k)
            st.backward_one_chunk = self._timed(st.backward_one_chunk, 1, k)

    def _timed(self, fn, kind, stage):
        def run(chunk, *a, **k):
            start = self._now()
            with SavedActivations() if kind == 0 else _Null() as acts:
                out = fn(chunk, *a, **k)
            self.events.append((kind, start, self._now()))
            self.held[stage, chunk] = acts.bytes if kind == 0 else 0  # backward frees what forward saved
            self.saved_peak = max(self.saved_peak, sum(self.held.values()))
            return out
        return run

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.time() * 1e3

    def start(self, d):  # one zero for every rank: the wall time the last rank arrived (as gpipe.py does)
        self.cuda, self.events, self.held = d.device.type == "cuda", [], {}
        t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.t0 = self._now() if self.cuda else t.item()

    def figures(self, d, m, v):
        """The last step's bubble per rank: 1 - busy / (the last backward's end anywhere)."""
        if self.cuda:
            torch.cuda.synchronize(d.device)
        ms = (lambda e: self.t0.elapsed_time(e)) if self.cuda else (lambda t: t - self.t0)  # noqa: E731
        rows = gather_rows(d, [[kind, ms(a), ms(z)] for kind, a, z in self.events])  # every rank's (kind, start, end)
        end = max(float(r[:, 2].max()) for r in rows)
        bubble = [1 - float((r[:, 2] - r[:, 1]).sum()) / end for r in rows]
        p = d.world
        return dict(bubble=bubble, bubble_mean=sum(bubble) / p, bubble_theory=(p - 1) / (v * m + p - 1),
                    bubble_theory_formula="(p-1)/(v*m+p-1)" if v > 1 else "(p-1)/(m+p-1)")


class _Null:
    bytes = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


# ----------------------------------------------------------------------------- torch's side: tensor parallel
def tensor_parallel_side(d, args, name):
    """DTensor: Megatron's layout via parallelize_module, over the whole world (tp = world, no data parallel):
    q, k, v and fc column-wise, the projections row-wise, the embedding split over the vocabulary, the head
    column-wise into loss_parallel's vocabulary-parallel cross-entropy."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, loss_parallel, parallelize_module,
                                                   RowwiseParallel)
    mesh = dist.device_mesh.init_device_mesh(d.device.type, (d.world,))
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)  # as megatron_tp.py
    plan = {"tok_emb": RowwiseParallel(input_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i, block in enumerate(model.blocks):
        block.attn.n_heads //= d.world  # a rank's q, k, v hold n_heads / tp whole heads
        plan.update({f"blocks.{i}.attn.{w}": ColwiseParallel() for w in "qkv"})
        plan.update({f"blocks.{i}.attn.proj": RowwiseParallel(), f"blocks.{i}.mlp.fc": ColwiseParallel(),
                     f"blocks.{i}.mlp.proj": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    opt, data = make_optimizer(model.parameters(), args), MarkovData(args.vocab, args.seed)
    params = list(model.parameters())

    def step(i):
        x, y = (t.to(d.device) for t in data.batch(i, args.batch_size, args.seq_len))  # (B, T) on every rank
        with LocalSaved() as acts, loss_parallel():
            loss = lm_loss(model(x), y, count_tokens(y))  # logits (B, T, V/tp) never gathered
            opt.zero_grad(set_to_none=True)
            loss.backward()
        # global norm: sharded gradients' squares summed over ranks, replicated ones (LayerNorms, biases of
        # row-wise layers, position embedding) counted once
        local = lambda g: g.to_local() if isinstance(g, DTensor) else g  # noqa: E731
        sharded = [p.grad for p in params if isinstance(p.grad, DTensor) and p.grad.placements[0].is_shard()]
        sq = torch.stack([sum((local(g).double() ** 2).sum() for g in sharded),
                          sum((local(p.grad).double() ** 2).sum() for p in params
                              if not any(p.grad is g for g in sharded))])
        dist.all_reduce(sq[:1])
        clip_grads_([local(p.grad) for p in params], (sq.sum()).sqrt(), args.clip)
        opt.step()
        counted = state_tensor_bytes(params, opt.state) + acts.bytes
        return float(local(loss.detach())), counted

    return step


# ----------------------------------------------------------------------------- measurement
class LocalSaved(SavedActivations):
    """common.SavedActivations, counting a DTensor's local shard (the wrapper itself has no storage)."""

    def _pack(self, t):
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        if not isinstance(t, nn.Parameter):
            super()._pack(local)
        return t


class CountComm(torch.utils._python_dispatch.TorchDispatchMode):
    """Every collective and send this rank hands to c10d while active, seen at the dispatcher (DDP's C++
    reducer, FSDP, ZeroRedundancyOptimizer, pipelining and DTensor's functional collectives all pass there):
    calls and bytes handed over per op, as the technique files count theirs: an all-reduce's tensor, an
    all-gather's input shard, a reduce-scatter's whole input, a send's tensor, a broadcast's tensor on its
    root only; receives hand nothing over. DTensor ops are passed on (NotImplemented) so that the
    collectives DTensor issues underneath are seen instead."""

    def __init__(self, rank):
        super().__init__()
        self.rank, self.ops, self.paused = rank, {}, False

    @contextlib.contextmanager
    def pause(self):  # for the loss all-reduce that only feeds the log line (the technique files skip it too)
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        name, ns = func.__name__.split(".")[0], func.namespace
        if ns in ("c10d", "_c10d_functional") and COLLECTIVE.search(name) and not self.paused:
            tensors = [a for a in _flatten(args) if torch.is_tensor(a)]
            # c10d ops take (tensors, ...), the *_base_ ones (output, input); functional ones (input, ...)
            handed = tensors[1:2] if name.endswith("_base_") else tensors[:1] if ns == "_c10d_functional" else tensors
            if name.startswith("recv") or name.startswith("broadcast") and args[2] != self.rank:  # (t, pg, root, ..)
                handed = []
            c = self.ops.setdefault(f"{ns}.{name}", [0, 0])
            c[0], c[1] = c[0] + 1, c[1] + nbytes(handed)
        return func(*args, **(kwargs or {}))

    def sent(self):
        return sum(c[1] for c in self.ops.values())


COLLECTIVE = re.compile(r"reduce|gather|scatter|broadcast|send|recv|all_to_all|alltoall")
COUNT = None  # the worker's CountComm


def _flatten(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flatten(x)
        else:
            yield x


def nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


def run_worker(args):
    """`torchrun bench.py --worker NAME`: torch's side of a pair. The first step runs under CountComm (it is
    a warm-up step, never timed); the summary is common.write_summary's, plus every step's ms."""
    d = init_dist(args.timeout)
    torch.set_num_threads(args.threads)
    side = {"single": single_process_side, "ddp": data_parallel_side, "zero1": data_parallel_side, "fsdp_noreshard": data_parallel_side,
            "fsdp": data_parallel_side, "gpipe": pipeline_side, "1f1b": pipeline_side, "interleaved": pipeline_side,
            "tp": tensor_parallel_side}[args.worker]
    step = side(d, args, args.worker)
    global COUNT
    timer, losses, counted, comm = StepTimer(d.device), [], 0, CountComm(d.rank)
    COUNT = comm
    prof = start_profiler(args, d)
    for i in range(args.steps):
        timer.start()
        with comm if i == max(args.warmup - 1, 0) else _Null():  # the last untimed step: lazy init is done
            loss, mem = step(i)
        ms = timer.stop()
        losses.append(loss)
        counted = max(counted, mem)
        log_step(d, i, loss, ms, args.batch_size * args.seq_len)
    stop_profiler(prof, args, d)
    sent = torch.tensor([comm.sent()], dtype=torch.float64, device=d.device)
    dist.all_reduce(sent, op=dist.ReduceOp.MAX)  # the busiest rank, as the technique files report
    figures = dict(comm_ops_rank0={k: dict(calls=c[0], bytes_handed=c[1])
                                   for k, c in comm.ops.items()}, step_ms_all=timer.ms)
    if hasattr(step, "figures"):
        figures.update(step.figures())
    tokens_per_s = args.batch_size * args.seq_len / max(timer.median(), 1e-9) * 1e3
    write_summary(d, args, f"torch-{args.worker}", losses, timer.median(), tokens_per_s,
                  peak_memory_bytes(d, counted), sent.item(), None, figures)
    close_dist()


def start_profiler(args, d):
    if not args.profile:
        return None
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if d.device.type == "cuda"
                                                    else [])
    prof = torch.profiler.profile(activities=acts, record_shapes=True)
    prof.start()
    return prof


def stop_profiler(prof, args, d):
    if prof is not None:
        prof.stop()
        os.makedirs(args.profile, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.profile, f"{Path(args.json).stem}.rank{d.rank}.json"))


def clock_ms(device):  # the overlap worker times whole regions: one synchronisation at each end
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.time() * 1e3


def overlap_worker(d, args):
    """`torchrun bench.py --worker overlap`: how much of the gradient all-reduce backward hides, for
    ddp_bucketed.BucketedDDP and torch's DDP, both at --bucket-cap-mb. Every step measures (1) backward with
    the buckets overlapped, as trained; (2) backward under no_sync (compute only); (3) the same bucket sizes
    all-reduced after it. Hidden share = (t2 + t3 - t1) / t3: 1 if the all-reduce cost nothing extra, 0 if
    overlapping saved nothing. No optimizer step: the weights stay put, the timings do not need them to move."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    from ddp_bucketed import BucketedDDP
    torch.set_num_threads(args.threads)
    data, b, out = MarkovData(args.vocab, args.seed), args.batch_size // d.world, {}
    for impl in ("ours", "torch"):
        model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype]).to(d.device)
        if impl == "ours":
            net = BucketedDDP(model, args.bucket_cap_mb, args.bucket_cap_mb)
            sizes = lambda: [wire for _, _, wire in net.layout()]  # noqa: E731
        else:
            net = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None,
                      bucket_cap_mb=args.bucket_cap_mb)
            sizes = lambda: ddp_bucket_sizes(net)  # noqa: E731
        params = [p for p in model.parameters()]
        t = {"overlapped": [], "backward": [], "allreduce": []}

        def timed_backward(i, key):
            x, y = data.batch(i, args.batch_size, args.seq_len)
            n_tok = count_tokens(y)
            loss = lm_loss(net(x[d.rank * b:(d.rank + 1) * b].to(d.device)), y[d.rank * b:(d.rank + 1) * b].to(d.device), n_tok)
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = clock_ms(d.device)
            (loss * d.world).backward()
            t[key].append(clock_ms(d.device) - t0)

        for i in range(2 * args.steps):  # twice the steps: three short timings each, noisier than a step
            timed_backward(i, "overlapped")
            with net.no_sync():
                timed_backward(i, "backward")
            dist.barrier()
            t0 = clock_ms(d.device)
            flat = torch.cat([p.grad.reshape(-1) for p in params])  # the gradients, copied into buckets
            works = [dist.all_reduce(buf, async_op=True) for buf in flat.split([s // flat.element_size() for s in sizes()])]
            for w in works:
                w.wait()
            t["allreduce"].append(clock_ms(d.device) - t0)
        med = {k: statistics.median(v[args.warmup:]) for k, v in t.items()}
        med["hidden_share"] = (med["backward"] + med["allreduce"] - med["overlapped"]) / max(med["allreduce"], 1e-9)
        med["buckets"] = len(sizes())
        out[impl] = med
        d.log(f"overlap {impl}: {med}")
    write_summary(d, args, "overlap", [], 0.0, 0.0, 0, 0, None, out)
    close_dist()


def profile_run(argv):
    """`torchrun bench.py --profile-run DIR FILE ARGS...`: run one of our files as __main__ under
    torch.profiler and write DIR/<json stem>.rank<r>.json (Chrome trace) when it reaches common.close_dist."""
    import runpy
    import common
    out_dir, script, rest = argv[0], argv[1], argv[2:]
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True)
    close = common.close_dist
    stem = Path(rest[rest.index("--json") + 1]).stem if "--json" in rest else Path(script).stem

    def close_and_export(ok=True):
        prof.stop()
        os.makedirs(out_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(out_dir, f"{stem}.rank{os.environ.get('RANK', '0')}.json"))
        close(ok)

    common.close_dist = close_and_export  # the technique file imports it from common when it runs below
    sys.argv = [script, *rest]
    prof.start()
    runpy.run_path(str(ROOT / script), run_name="__main__")


def profile_top(path, n=8):
    """The main thread's top-level ops in a Chrome trace, from the first step's data on (setup skipped):
    where a step's time went, biggest first, as lines of text."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    ops = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    if not ops:
        return []
    main = statistics.mode(e["tid"] for e in ops if e.get("cat") == "cpu_op")
    ops = sorted((e for e in ops if e["tid"] == main), key=lambda e: e["ts"])
    t0 = next((e["ts"] for e in ops if e["name"] == "aten::multinomial"), ops[0]["ts"])  # MarkovData.batch
    total, calls, end = {}, {}, -1.0
    for e in ops:
        if e["ts"] >= max(t0, end):  # top level: not inside the op before it
            total[e["name"]] = total.get(e["name"], 0) + e["dur"] / 1e3
            calls[e["name"]] = calls.get(e["name"], 0) + 1
            end = e["ts"] + e["dur"]
    return [f"{ms:9.1f} ms {calls[k]:5d} x {k[:80]}" for k, ms in sorted(total.items(), key=lambda kv: -kv[1])[:n]]


# ----------------------------------------------------------------------------- the driver: A B A B
STEP_LINE = re.compile(r"^step\s+(\d+) \| loss .*?\|\s+([\d.]+) ms", re.M)


def launch(args, tag, cmd_tail, nproc):
    """One torchrun launch; returns its summary and every step's ms (from the rank-0 step lines)."""
    out_json = Path(args.out).with_name(f"{Path(args.out).name}_runs") / f"{tag}.json"
    out_json.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           *map(str, cmd_tail), "--json", str(out_json)]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    t0 = time.time()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.launch_timeout)
        output, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        output, rc = f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {args.launch_timeout} s", -1
    summary = json.loads(out_json.read_text()) if rc == 0 and out_json.exists() else None
    ms = {int(s): float(v) for s, v in STEP_LINE.findall(output)}
    timed = list(ms.values())[args.warmup:]
    print(f"  {tag:28s} rc {rc}  {time.time() - t0:5.1f} s wall" +
          (f"  median step {statistics.median(timed):8.1f} ms" if timed else ""), flush=True)
    if rc != 0:
        print("\n".join("    | " + line for line in output.strip().splitlines()[-15:]), flush=True)
    trace = Path(args.profile) / f"{tag}.rank0.json" if args.profile else None
    if trace and trace.exists():  # rank 0's biggest top-level ops over the run's steps
        print("\n".join("    profile " + line for line in profile_top(trace)), flush=True)
    return dict(rc=rc, summary=summary, ms=[ms[k] for k in sorted(ms)], cmd=" ".join(cmd[3:]))


def model_flags(args):
    names = ("steps", "batch_size", "seq_len", "vocab", "d_model", "n_layers", "n_heads", "lr", "weight_decay",
             "clip", "seed", "dtype", "timeout")
    return [x for n in names for x in ("--" + n.replace("_", "-"), getattr(args, n))]


def run_side(args, pair, side, world, tag):
    file, flags, worker, _ = PAIRS[pair]
    if side == "ours":
        head = ["bench.py", "--profile-run", args.profile, file] if args.profile else [file]
        return launch(args, tag, [*head, *flags(args), *model_flags(args)], world)
    own = ["--worker", worker, "--microbatches", args.microbatches, "--bucket-cap-mb", args.bucket_cap_mb,
           "--threads", args.threads] + (["--profile", args.profile] if args.profile else [])
    return launch(args, tag, ["bench.py", *own, *model_flags(args)], world)


def side_row(args, pair, side, runs, one_ms):
    ok = [r for r in runs if r["rc"] == 0 and len(r["ms"]) > args.warmup]
    if not ok:
        return dict(name=None, error=(runs[-1]["cmd"] if runs else "not run"))
    ms = [t for r in ok for t in r["ms"][args.warmup:]]
    s, tokens = ok[-1]["summary"], args.batch_size * args.seq_len
    med = statistics.median(ms)
    row = dict(name=PAIRS[pair][0] if side == "ours" else TORCH_NAME[PAIRS[pair][2]], step_ms=med,
               step_ms_per_round=[statistics.median(r["ms"][args.warmup:]) for r in ok], tokens_per_s=tokens / med * 1e3,
               peak_mem_bytes=s["peak_mem_bytes"] if s else None,
               sent_bytes_per_rank=s["comm_bytes"] if s else None,
               losses=s["losses"] if s else None, command=ok[-1]["cmd"])
    f = (s or {}).get("figures", {})
    if "bubble_mean" in f:  # the idle share of the step; ptdp.py reports idle / busy, the paper's (p-1)/(v*m)
        idle_per_busy = side == "ours" and pair == "ptdp"
        share = [b / (1 + b) for b in f["bubble"]] if idle_per_busy else None
        row.update(bubble=sum(share) / len(share) if idle_per_busy else f["bubble_mean"],
                   bubble_theory=f["bubble_theory"] / (1 + f["bubble_theory"]) if idle_per_busy else f["bubble_theory"])
    if one_ms and PAIRS[pair][3] == "dp":  # tokens/s at world N / (N x tokens/s of one process)
        row.update(scaling_efficiency=(tokens / med) / (args.world * tokens / one_ms))
    return row


def bench_group(args, pairs, one_ms):
    """Pairs that share torch's side (ddp and dp_sync: both against DDP) run as one alternation, A C B A C B."""
    worker = PAIRS[pairs[0]][2]
    print(f"{', '.join(PAIRS[p][0] for p in pairs)} vs {TORCH_NAME[worker]}", flush=True)
    runs = {p: [] for p in pairs}
    runs["torch"] = []
    for r in range(args.rounds):  # alternating: drift on the machine hits every side alike
        for p in pairs:
            runs[p].append(run_side(args, p, "ours", args.world, f"{p}_ours_w{args.world}_r{r}"))
        runs["torch"].append(run_side(args, pairs[0], "torch", args.world, f"{worker}_torch_w{args.world}_r{r}"))
    rows = []
    for p in pairs:
        row = dict(pair=p, ours=side_row(args, p, "ours", runs[p], one_ms),
                   torch=side_row(args, p, "torch", runs["torch"], one_ms))
        a, b = row["ours"].get("step_ms"), row["torch"].get("step_ms")
        row["ratio"] = a / b if a and b else None
        row["ratio_per_round"] = [x / y for x, y in zip(row["ours"].get("step_ms_per_round", []),
                                                          row["torch"].get("step_ms_per_round", []))]
        lo, lt = row["ours"].get("losses") or [], row["torch"].get("losses") or []  # the same training, both sides
        row["max_loss_diff"] = max((abs(x - y) / abs(y) for x, y in zip(lo, lt)), default=None)
        rows.append(row)
    if "ddp" in pairs and args.world > 1:
        r = launch(args, "ddp_overlap", ["bench.py", "--worker", "overlap", "--bucket-cap-mb", args.bucket_cap_mb,
                                         "--threads", args.threads, "--warmup", args.warmup, *model_flags(args)],
                   args.world)
        if r["summary"]:
            rows[pairs.index("ddp")]["overlap"] = r["summary"]["figures"]
    return rows


def markdown(args, rows, wall_s, one_ms):
    mb = lambda x: f"{x / MiB:.1f}" if x is not None else "-"  # noqa: E731
    fmt = lambda x, f: (f % x) if x is not None else "-"  # noqa: E731
    n = sum(p.numel() for p in build_gpt(GPTConfig.from_args(args), args.seed).parameters())
    lines = [f"`python bench.py {' '.join(sys.argv[1:])}`".replace(" `", "`"),
             "", f"world {args.world} on {'NCCL' if torch.cuda.is_available() else 'gloo, CPU'}, {args.threads} "
             f"thread(s) per rank, {os.cpu_count()} CPU cores; GPT {n / 1e6:.1f} M parameters (vocab {args.vocab}, "
             f"width {args.d_model}, {args.n_layers} blocks, {args.seq_len} tokens x {args.batch_size} sequences), "
             f"{args.dtype}; {args.steps} steps per run, the first {args.warmup} untimed, {args.rounds} rounds "
             f"A B; whole bench {wall_s / 60:.1f} min.", "",
             "| pair | ours | torch | ours ms | torch ms | ratio (per round) | tok/s ours / torch | peak MiB/rank ours / torch "
             "| sent MiB/rank/step ours / torch | bubble ours / torch (theory) | scaling eff. ours / torch | loss diff |",
             "|---|---|---|---:|---:|---:|---|---|---|---|---|---:|"]
    for r in rows:
        if r.get("skipped"):
            lines.append(f"| {r['pair']} | skipped: {r['skipped']} | | | | | | | | | | |")
            continue
        o, t = r["ours"], r["torch"]
        bub = (f"{fmt(o.get('bubble'), '%.2f')} / {fmt(t.get('bubble'), '%.2f')} ({o['bubble_theory']:.2f})"
               if "bubble_theory" in o else "")
        eff = (f"{fmt(o.get('scaling_efficiency'), '%.2f')} / {fmt(t.get('scaling_efficiency'), '%.2f')}"
               if "scaling_efficiency" in o or "scaling_efficiency" in t else "")
        lines.append(f"| {r['pair']} | `{o.get('name') or 'failed'}` | {t.get('name') or 'failed'} | "
                     f"{fmt(o.get('step_ms'), '%.0f')} | {fmt(t.get('step_ms'), '%.0f')} | {fmt(r['ratio'], '%.2f')} "
                     f"({', '.join(f'{x:.2f}' for x in r['ratio_per_round'])}) | "
                     f"{fmt(o.get('tokens_per_s'), '%.0f')} / {fmt(t.get('tokens_per_s'), '%.0f')} | "
                     f"{mb(o.get('peak_mem_bytes'))} / {mb(t.get('peak_mem_bytes'))} | "
                     f"{mb(o.get('sent_bytes_per_rank'))} / {mb(t.get('sent_bytes_per_rank'))} | {bub} | {eff} | "
                     f"{fmt(r.get('max_loss_diff'), '%.0e')} |")
    for r in rows:
        if r.get("overlap"):
            o, t = r["overlap"]["ours"], r["overlap"]["torch"]
            lines += ["", f"All-reduce hidden behind backward ({args.bucket_cap_mb} MiB buckets; median ms of "
                      "backward overlapped / backward alone + the same buckets reduced after it): ddp_bucketed "
                      f"{o['overlapped']:.0f} / {o['backward']:.0f} + {o['allreduce']:.0f} ms = "
                      f"{100 * o['hidden_share']:.0f}% hidden ({o['buckets']} buckets); torch DDP "
                      f"{t['overlapped']:.0f} / {t['backward']:.0f} + {t['allreduce']:.0f} ms = "
                      f"{100 * t['hidden_share']:.0f}% hidden ({t['buckets']} buckets)."]
    lines += ["", "ratio = ours / torch step time (median over the timed steps of every round; < 1: ours faster), "
              "then each round's own ratio. "
              "Loss diff: largest relative difference of a per-step loss between the two sides (same training). "
              "Peak memory: CUDA's peak on GPUs; on CPU counted from tensors (parameters, gradients, optimizer "
              "state, saved activations, DDP buckets / FSDP gathered parameters). Sent: bytes of the tensors the "
              "busiest rank hands to collectives and sends in one step, counted (ours by the file, torch's at the "
              "dispatcher): an all-gather's shard, a reduce-scatter's whole input, a broadcast at its root. "
              "Bubble: idle share of the last step. Scaling efficiency: tokens/s at "
              f"world {args.world} / ({args.world} x tokens/s of plain one-process training on the whole batch"
              + (f", {args.batch_size * args.seq_len / one_ms * 1e3:.0f} tok/s here)." if one_ms else ").")]
    return "\n".join(lines) + "\n"


def check_bench_args(args):
    check_common_args(args)
    names = list(PAIRS) if args.pairs == "all" else [p.strip() for p in args.pairs.split(",") if p.strip()]
    unknown = [p for p in names if p not in PAIRS]
    if unknown or not names:
        fail(f"--pairs: unknown {unknown or args.pairs!r}; choose from {','.join(PAIRS)} or all")
    for flag in ("world", "rounds", "microbatches", "threads", "launch_timeout"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 1 <= args.warmup < args.steps:  # the last warm-up step counts the bytes sent, slowly
        fail(f"--warmup {args.warmup} must be >= 1 and leave a timed step: 1 <= --warmup < --steps {args.steps}")
    if args.batch_size % (args.world * args.microbatches):
        fail(f"--batch-size {args.batch_size} must divide by --world x --microbatches = {args.world * args.microbatches}")
    if "ptdp" in names and args.n_layers % (2 * args.world) or args.n_layers < args.world:
        fail(f"--n-layers {args.n_layers} must be >= --world {args.world} (a block per stage) and, for ptdp, "
             f"divide by 2 x --world = {2 * args.world} (two stages per rank)")
    if args.n_heads % args.world:
        fail(f"--n-heads {args.n_heads} must divide by --world {args.world} (the tp pair splits heads)")
    if not args.bucket_cap_mb * MiB >= 1:
        fail(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
    return names


def main():
    if sys.argv[1:2] == ["--profile-run"]:
        return profile_run(sys.argv[2:])
    args = parse_args(Args)
    if args.worker == "overlap":
        return overlap_worker(init_dist(args.timeout), args)
    if args.worker:
        return run_worker(args)
    names = check_bench_args(args)
    t0, rows, one_ms = time.time(), [], None
    if args.scaling and any(PAIRS[p][3] == "dp" for p in names):  # plain one-process training: the baseline
        r = launch(args, "one_process", ["bench.py", "--worker", "single", "--threads", args.threads,
                                         *model_flags(args)], 1)
        one_ms = statistics.median(r["ms"][args.warmup:]) if r["rc"] == 0 and len(r["ms"]) > args.warmup else None
    groups = {}
    for p in names:
        if not (ROOT / PAIRS[p][0]).exists():
            print(f"{p}: {PAIRS[p][0]} does not exist here, pair skipped", flush=True)
            rows.append(dict(pair=p, ours=None, torch=None, ratio=None, skipped=f"{PAIRS[p][0]} not found"))
        else:
            groups.setdefault(PAIRS[p][2], []).append(p)
    for pairs in groups.values():
        rows += bench_group(args, pairs, one_ms)
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1))  # what is done so far, if interrupted
        Path(args.out + ".md").write_text(markdown(args, rows, time.time() - t0, one_ms))
    rows.sort(key=lambda r: names.index(r["pair"]))
    md = markdown(args, rows, time.time() - t0, one_ms)
    Path(args.out + ".md").write_text(md)
    print("\n" + md + f"\nwrote {args.out}.json and {args.out}.md", flush=True)
    failed = [r["pair"] for r in rows if not r.get("skipped") and (not r["ours"].get("name") or not r["torch"].get("name"))]
    if failed:
        print(f"failed runs: {failed}", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
