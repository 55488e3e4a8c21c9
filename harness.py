"""harness.py: what every technique file runs with and no reader needs in order to learn a
technique.

Read common.py to learn what the lessons stand on (the model, the data, process groups, the
reference). This module holds the bookkeeping that wraps each lesson, kept out of the technique
files so that they read as their technique:

    flags        CommonArgs + parse_args(): an Args dataclass becomes the command line; check_common_args()
    the loop     Run: resume from --ckpt-dir, --fail-at-step, the step timer, the log line, checkpoints, the
                 --json summary (Checkpointer, maybe_fail, StepTimer, log_step, write_summary
                 underneath)
    --check      check_against_reference(): per-step losses and final parameters against
                 common.reference_train (or a file's own reference), one verdict on every rank;
                 assemble_full(), gather_rows()
    counters     watching from outside, never called by a technique:
                   CommCounter      bytes and calls handed to every collective and send, at the dispatcher
                   SavedActivations bytes autograd saves for backward (saved-tensor hooks)
                   LiveStorages     bytes of given storages still alive, and their peak (weak references)
                   Timeline         every F / B / W a pipeline runs: one `span` per op, bubble, picture, trace
                   PipelineWatch    a pipeline schedule's observe callback: Timeline spans, bytes held
Only tensors cross the wire here too: no object collectives.
"""

import argparse
import contextlib
import inspect
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields
from typing import Literal, get_args, get_origin, get_type_hints

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from common import close_dist, fail, reference_train


# ----------------------------------------------------------------------------- flags
@dataclass
class BaseArgs:
    """The flags every file shares. fault_tolerance.py takes these alone: its replayed reference
    draws no dropout masks, and its replicas die by --kill-replica, not by --fail-at-step."""

    steps: int = 20  # optimizer steps to run (in total, counting resumed ones)
    batch_size: int = 8  # global batch, in sequences
    seq_len: int = 32  # tokens per sequence
    vocab: int = 64  # vocabulary size (= states of the Markov chain)
    d_model: int = 64  # model width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads
    lr: float = 3e-3  # AdamW learning rate
    weight_decay: float = 0.1  # AdamW weight decay
    clip: float = 1.0  # clip gradients to this global norm (0 = off)
    seed: int = 0  # one seed for weights, data and everything random
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"  # parameter and compute dtype
    ragged: bool = False  # mask each sequence's targets after a random length (padding)
    check: bool = False  # also train the one-process reference here and compare
    json: str = ""  # write the run summary to this path
    ckpt_dir: str = ""  # save rank-local checkpoints here and resume from the latest
    save_every: int = 0  # checkpoint every N steps (and at the end) when --ckpt-dir is set
    timeout: int = 120  # process-group timeout in seconds: a desynchronised rank fails, never hangs


@dataclass
class CommonArgs(BaseArgs):
    """BaseArgs and the two flags every file but fault_tolerance.py takes."""

    dropout: float = 0.0  # dropout probability (0 keeps runs comparable across layouts)
    fail_at_step: int = -1  # kill the last rank at this step, on the first attempt only


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line and exit 2, not a usage wall
        fail(message)


def parse_args(cls, argv=None):
    """Turn an Args dataclass into flags: `n_layers: int = 4  # help` becomes `--n-layers 4`; a help
    too long for the field's line stands in the comment lines right above it. The fields named in
    the class attribute HIDDEN (a launcher's own, or flags the file refuses) parse, unlisted."""
    helps = {}
    for klass in reversed(cls.__mro__):
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        above = []  # the comment lines since the last field
        for line in src.splitlines():
            comment = re.match(r"^\s+#\s*(.*)$", line)
            field = re.match(r"^\s+(\w+):[^#]*?(?:#\s*(.*))?$", line)
            if comment:
                above.append(comment.group(1))
            elif field:
                helps[field.group(1)] = field.group(2) or " ".join(above)
                above = []
            else:
                above = []
    doc = sys.modules[cls.__module__].__doc__ or ""
    parser = _Parser(description=doc.split("\n\n")[0])  # the docstring's first paragraph, whole
    hints = get_type_hints(cls)
    for f in fields(cls):
        flag = "--" + f.name.replace("_", "-")
        typ = hints[f.name]
        h = helps.get(f.name, "")
        h = argparse.SUPPRESS if f.name in getattr(cls, "HIDDEN", ()) else h
        if typ is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=h
            )
        elif get_origin(typ) is Literal:
            parser.add_argument(flag, choices=get_args(typ), default=f.default, help=h)
        else:
            parser.add_argument(flag, type=typ, default=f.default, help=h)
    return cls(**vars(parser.parse_args(argv)))


def env_world_size():
    """The world size torchrun will give init_dist, known before any collective (1 without
    torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_common_args(args):
    """The checks every file needs; each technique file adds its own before init_dist()."""
    positive = (
        "steps",
        "batch_size",
        "seq_len",
        "vocab",
        "d_model",
        "n_layers",
        "n_heads",
        "timeout",
    )
    for name in positive:
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.n_heads:
        fail(f"--d-model {args.d_model} is not divisible by --n-heads {args.n_heads}")
    if not 0 <= getattr(args, "dropout", 0.0) < 1:  # (BaseArgs has none)
        fail(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.save_every and not args.ckpt_dir:
        fail("--save-every needs --ckpt-dir")
    if args.ckpt_dir and os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
        fail(f"--ckpt-dir {args.ckpt_dir} is a file, not a directory")


# ----------------------------------------------------------------------------- the loop's edges
class StepTimer:
    """Wall time of each step (CUDA-synchronised on a GPU, so it measures the work, not the
    launch)."""

    def __init__(self, device):
        self.device, self.ms = device, []

    def start(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.t0 = time.perf_counter()

    def stop(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.ms.append(1e3 * (time.perf_counter() - self.t0))
        return self.ms[-1]

    def median(self):
        return statistics.median(self.ms) if self.ms else 0.0


def log_step(d, step, loss, ms, tokens):
    d.log(
        f"step {step:4d} | loss {loss:.6f} | {ms:8.1f} ms | {tokens / max(ms, 1e-9) * 1e3:10.0f} "
        "tok/s"
    )


def maybe_fail(d, args, step):
    """--fail-at-step: the last rank dies at the start of `step`, on torchrun's first attempt
    only."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    if step == args.fail_at_step and d.rank == d.world - 1 and first_attempt:
        print(f"rank {d.rank}: simulated failure at step {step}", file=sys.stderr, flush=True)
        os._exit(13)


class Run:
    """The edges of a training loop that every file shares: resume from --ckpt-dir, --fail-at-step,
    time the step, print its line, save checkpoints, and at the end the --json summary. The loop
    stays in the file:

        run = Run(d, args, {"model": model, "optim": opt})     # resumes: run.start, run.losses, run.history
        for step in run.steps():                               # --fail-at-step, then the timer starts
            loss = ...                                         # the technique's step
            run.end_step(step, loss)                           # timer, log line, checkpoint
        run.finish("name", peak, comm_bytes, check, figures)   # summary; exits (1 if --check failed)
    `state` maps names to objects with state_dict / load_state_dict (saved every --save-every
    steps). `ckpt`: another checkpointer, with load(state) -> (step, history) and maybe_save(step,
    state, history), e.g. zero.py's ZeroCheckpoint; `state` is then what it takes (the Zero)."""

    def __init__(self, d, args, state, ckpt=None):
        self.d = d
        self.args = args
        self.state = state
        self.ckpt = ckpt or Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
        self.start, self.history = self.ckpt.load(state)
        self.losses = self.history.get("losses", [])
        self.timer, self.tokens = StepTimer(d.device), args.batch_size * args.seq_len

    def steps(self):
        for step in range(self.start, self.args.steps):
            maybe_fail(self.d, self.args, step)
            self.timer.start()
            yield step

    def end_step(self, step, loss, **history):
        """`loss` of the global batch (a float); `history`: more per-run lists to checkpoint and
        resume."""
        ms = self.timer.stop()
        self.losses.append(loss)
        self.history.update(history, losses=self.losses)
        log_step(self.d, step, loss, ms, self.tokens)
        self.ckpt.maybe_save(step + 1, self.state, self.history)

    @contextlib.contextmanager
    def watching(self, step, *counters, at=None):
        """Enter `counters` (a CommCounter, ...) during one step only (`at`; default the run's last,
        the step whose figures the summary reports): a dispatcher counter sends every op through
        Python, so the other steps run without it. `with run.watching(step, comm):` around the
        step's work."""
        with contextlib.ExitStack() as stack:
            if step == (self.args.steps - 1 if at is None else at):
                for c in counters:
                    stack.enter_context(c)
            yield

    def tokens_per_s(self):
        return self.tokens / max(self.timer.median(), 1e-9) * 1e3

    def finish(self, technique, peak_mem_bytes, comm_bytes, check=None, figures=None):
        write_summary(
            self.d,
            self.args,
            technique,
            self.losses,
            self.timer.median(),
            self.tokens_per_s(),
            peak_mem_bytes,
            comm_bytes,
            check,
            figures,
        )
        close_dist(ok=check is None or check["passed"])


def write_summary(
    d,
    args,
    technique,
    losses,
    step_ms,
    tokens_per_s,
    peak_mem_bytes,
    comm_bytes,
    check=None,
    figures=None,
):
    """The --json summary (rank 0). Every figure in it was measured in this run."""
    summary = dict(
        technique=technique,
        world_size=d.world,
        config=asdict(args),
        losses=losses,
        step_ms=step_ms,
        tokens_per_s=tokens_per_s,
        peak_mem_bytes=peak_mem_bytes,
        comm_bytes=comm_bytes,
        check=check,
        figures=figures or {},
    )
    # CUDA's peak above, the bytes the file counted beside it
    if d.device.type == "cuda" and _counted:
        summary["counted_mem_bytes"] = _counted["bytes"]
    if d.rank == 0 and args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return summary


# ----------------------------------------------------------------------------- checkpoints
class Checkpointer:
    """Rank-local checkpoints `DIR/rank{r}/step{s}.pt`, written to a temporary file and renamed
    (atomic), the last two kept. At start every rank resumes from the newest step that *all* ranks
    have. Each file records which script wrote it and at what world size; a directory from another
    file, another world size, another model size or layout, or a damaged file is refused with one
    line (exit 2)."""

    def __init__(self, d, ckpt_dir, save_every, steps):
        self.d = d
        self.save_every = save_every
        self.steps = steps
        self.root = ckpt_dir
        self.dir = os.path.join(ckpt_dir, f"rank{d.rank}") if ckpt_dir else ""
        self.meta = dict(file=os.path.basename(sys.argv[0]), world=d.world)

    def _steps_on_disk(self):
        if not self.dir or not os.path.isdir(self.dir):
            return []
        names = (re.fullmatch(r"step(\d+)\.pt", f) for f in os.listdir(self.dir))
        return sorted(int(m.group(1)) for m in names if m)

    def _read(self, step):
        """One checkpoint file, checked against this run; a bad one ends the run with one clear
        line."""
        path = os.path.join(self.dir, f"step{step}.pt")
        try:  # on CPU: the RNG states must be CPU byte tensors; load_state_dict moves the rest
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            fail(
                f"cannot read checkpoint {path} ({type(e).__name__}): delete it or use another "
                "--ckpt-dir"
            )
        meta = state.get("meta") if isinstance(state, dict) else None
        if meta != self.meta:
            # noqa: E731
            what = lambda m: f"{m['file']} at world {m['world']}" if m else "an unknown writer"
            fail(
                f"checkpoint {path} was written by {what(meta)}, this run is {what(self.meta)}: "
                "use another --ckpt-dir"
            )
        return state

    def load(self, objects):
        """Restore `objects` (name -> thing with load_state_dict) and RNG; return (step,
        history)."""
        if not self.dir:
            return 0, {}
        # 1. checks that need no other rank, before any collective
        ranks = [
            int(m.group(1))
            for f in (os.listdir(self.root) if os.path.isdir(self.root) else [])
            if (m := re.fullmatch(r"rank(\d+)", f))
        ]
        if ranks and max(ranks) >= self.d.world:
            fail(
                f"--ckpt-dir {self.root} holds checkpoints of {max(ranks) + 1} ranks, this run has "
                f"{self.d.world}: resume at the same world size, or use another --ckpt-dir"
            )
        mine = self._steps_on_disk()
        if mine:
            self._read(mine[-1])
        # 2. the newest step every rank has: a rank that died mid-save holds one step less
        t = torch.tensor([mine[-1] if mine else 0], device=self.d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        step = int(t.item())
        if step == 0:
            return 0, {}
        state = self._read(step)
        try:
            for name, obj in objects.items():
                obj.load_state_dict(state[name])
        except Exception as e:  # another model size or layout: shapes or names differ
            why = " ".join(str(e).replace("Error(s) in loading state_dict for", "").split())[:160]
            fail(
                f"checkpoint in {self.dir} does not fit this model or layout ({why}...): use "
                "another --ckpt-dir"
            )
        torch.set_rng_state(state["rng_cpu"])
        if self.d.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.d.device)
        self.d.log(f"resumed from {self.dir} at step {step}")
        return step, state["history"]

    def maybe_save(self, step, objects, history):
        """`step` = steps completed. Saves every `save_every` steps and after the last one."""
        if not self.dir or not (
            step == self.steps or (self.save_every and step % self.save_every == 0)
        ):
            return
        os.makedirs(self.dir, exist_ok=True)
        state = {name: obj.state_dict() for name, obj in objects.items()}
        state.update(step=step, history=history, meta=self.meta, rng_cpu=torch.get_rng_state())
        if self.d.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.d.device)
        tmp = os.path.join(self.dir, f".step{step}.pt.tmp")
        torch.save(state, tmp)
        # atomic: never a half-written file
        os.replace(tmp, os.path.join(self.dir, f"step{step}.pt"))
        for old in self._steps_on_disk()[:-2]:
            os.remove(os.path.join(self.dir, f"step{old}.pt"))


# ----------------------------------------------------------------------------- --check
def tolerance(dtype):
    """--check's tolerance on the relative difference of per-step losses (see
    check_against_reference)."""
    return {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}[dtype]


def check_against_reference(d, args, losses, params, ref=None, tol=None, ptol=None):
    """Rank 0 trains the reference (or takes `ref`) and compares per-step losses (relative, within
    `tol`) and final parameters (max abs difference by name, within `ptol`; `tol` when only that is
    given). `params`: the full, unsharded model on rank 0."""
    result = None
    if d.rank == 0:
        ref = ref or reference_train(args, d.device)
        # Parameters get the loss tolerance, but 10x by default in float32: AdamW divides each
        # gradient by its own RMS, so an element whose gradient is mostly roundoff still moves by up
        # to lr, either way.
        ptol = ptol or tol or (10 if args.dtype == "float32" else 1) * tolerance(args.dtype)
        tol = tol or tolerance(args.dtype)
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"]))
        missing = sorted(set(ref["params"]) ^ set(params))
        param_diff = max(
            (params[n].to(p) - p).abs().max().item()
            for n, p in ref["params"].items()
            if n in params
        )
        passed = (
            len(losses) == len(ref["losses"])
            and not missing
            and loss_diff <= tol
            and param_diff <= ptol
        )
        d.log(
            f"check vs one-process reference: max rel loss diff {loss_diff:.3e} (tolerance "
            f"{tol:.0e}), max param diff {param_diff:.3e} "
            f"({ptol:.0e}){', missing ' + str(missing) if missing else ''} -> "
            f"{'PASSED' if passed else 'FAILED'}"
        )
        result = [loss_diff, param_diff, float(passed)]
    # Rank 0's verdict for every rank, as three numbers in a tensor (no object collective: those
    # pickle through numpy and, on NCCL, take a host round trip through the GPU).
    t = torch.tensor(result or [0.0, 0.0, 0.0], dtype=torch.float64, device=d.device)
    dist.broadcast(t, src=0)
    return dict(max_loss_diff=t[0].item(), max_param_diff=t[1].item(), passed=bool(t[2].item()))


def gather_rows(d, rows):
    """Every rank's (n_r, k) rows of numbers (events, counters), on every rank, as a list of (n_r,
    k) float64 CPU tensors: the row counts first, then the rows padded to the longest, two
    all_gathers of tensors on the device."""
    rows = torch.as_tensor(rows, dtype=torch.float64).to(d.device)
    n = torch.tensor([rows.shape[0]], device=d.device)
    counts = [torch.zeros_like(n) for _ in range(d.world)]
    dist.all_gather(counts, n)
    counts = [int(c) for c in counts]
    padded = torch.zeros(max(counts), rows.shape[1], dtype=torch.float64, device=d.device)
    padded[: rows.shape[0]] = rows
    every = [torch.empty_like(padded) for _ in range(d.world)]
    dist.all_gather(every, padded)
    return [e[:c].cpu() for e, c in zip(every, counts)]


def assemble_full(d, owned, shapes, dtype):
    """The full model, by name, on every rank, from the disjoint pieces the ranks own (a pipeline
    stage's blocks, say). `owned`: full-model name -> tensor this rank holds; `shapes`: every name
    -> shape, the same on every rank. Each rank writes its pieces into a zero vector of the whole
    model and one all-reduce adds them up: exact, since x + 0 = x. A name owned by no rank or by two
    is an error."""
    names = list(shapes)
    sizes = [torch.Size(shapes[n]).numel() for n in names]
    flat = torch.zeros(sum(sizes), dtype=dtype, device=d.device)
    owners = torch.zeros(len(names), dtype=torch.float64, device=d.device)
    for i, (part, n) in enumerate(zip(flat.split(sizes), names)):
        if n in owned:
            part.copy_(owned[n].detach().reshape(-1))
            owners[i] = 1
    dist.all_reduce(flat)
    dist.all_reduce(owners)
    wrong = [n for n, c in zip(names, owners.tolist()) if c != 1]
    if wrong:
        raise RuntimeError(f"assemble_full: not owned by exactly one rank: {wrong}")
    return {n: part.view(shapes[n]).cpu() for part, n in zip(flat.split(sizes), names)}


# ----------------------------------------------------------------------------- memory
def tensor_bytes(tensors):
    """Bytes held by these tensors (each storage counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def state_bytes(model, optimizer=None):
    """Parameters + gradients + optimizer state of this rank, counted from the tensors
    themselves."""
    ts = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    if optimizer is not None:
        ts += [
            v
            for s in optimizer.state.values()
            for v in s.values()
            if torch.is_tensor(v) and v.dim() > 0
        ]
    return tensor_bytes(ts)


# the largest counted bytes over ranks, as of the last peak_memory_bytes (for the summary)
_counted = {}


def peak_memory_bytes(d, counted_bytes):
    """Largest over ranks: CUDA's own peak on a GPU, else the bytes the file counted itself (on a
    GPU those go into the summary beside CUDA's peak, as counted_mem_bytes)."""
    cuda = d.device.type == "cuda"
    own = [torch.cuda.max_memory_allocated(d.device), counted_bytes] if cuda else [counted_bytes]
    t = torch.tensor([float(x) for x in own], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    _counted["bytes"] = int(t[-1].item())
    return int(t[0].item())


def is_parameter(t):
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class LiveStorages:
    """Bytes of the storages handed to `add` that are still alive, and the peak seen by `alive`.
    Held weakly (StorageWeakRef): registering keeps nothing alive, so a storage freed by anyone (a
    graph freed by its backward, a gathered buffer dropped) drops out by itself, and one kept by
    mistake stays counted."""

    def __init__(self):
        self.refs, self.peak = {}, 0

    def add(self, t):
        if torch.is_tensor(t):
            s = t.untyped_storage()
            self.refs.setdefault(StorageWeakRef(s), s.nbytes())

    def alive(self, *held):
        """Bytes alive now: the registered storages not yet freed, plus `held` tensors (each storage
        once)."""
        self.refs = {w: n for w, n in self.refs.items() if not w.expired()}
        extra = {
            StorageWeakRef(t.untyped_storage()): t.untyped_storage().nbytes()
            for t in held
            if t is not None
        }
        now = sum({**extra, **self.refs}.values())
        self.peak = max(self.peak, now)
        return now


class SavedActivations:
    """Counts the bytes autograd saves for backward inside the `with` block: activations, not
    parameters (nor views of them, such as the transposed weight a Linear saves).
    `saved_tensors_hooks` sees every tensor autograd packs. A storage saved by several ops (one
    input feeding q, k and v) counts once. `.bytes` is what the block saved; `.live` keeps them
    weakly, so `.live.alive()` later says how much of it is still held (backward frees a graph's
    saved tensors). Wrap a forward: what it saves stays alive until backward, so no address is
    reused inside. Nested saved-tensor hooks hide outer ones: wrap outside them."""

    def __init__(self, live=None):
        self.bytes = 0
        self._seen = set()
        self.live = live if live is not None else LiveStorages()

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if not is_parameter(t) and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
            self.live.add(t)
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


# -------------------------------------------------------------- collectives, seen at the dispatcher
# Every communication op of c10d (torch.distributed's process-group ops) and of _c10d_functional
# (DTensor's, returning its output) by name: the kind it is counted as. tests/test_harness.py checks
# that the installed torch has no other op in these two namespaces that moves data.
_OPS = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_out": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "isend": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "irecv": "recv",
    "batch_p2p_ops": "send/recv",
    "reduce_": "reduce",
    "gather_": "gather",
    "gather_into_tensor_": "gather",
    "scatter_": "scatter",
}
# seen, moves no data (_wrap_tensor_autograd: registered when
# torch.distributed._functional_collectives loads)
_NOT_TRAFFIC = {
    "barrier",
    "monitored_barrier_",
    "wait_tensor",
    "check_for_nan",
    "_wrap_tensor_autograd",
}
# c10d ops' arguments: (tensors, pg, ...) but for these, (outputs, inputs, pg, ...): what is handed
# is inputs
_OUT_IN = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")
# where the peer (a rank in the op's group) and the tag are, and the root of a broadcast or scatter
_PEER_TAG = {
    ("c10d", "send"): (2, 3),
    ("c10d", "recv_"): (2, 3),
    ("c10d", "recv_any_source_"): (None, 2),
    ("_c10d_functional", "isend"): (1, 2),
    ("_c10d_functional", "irecv"): (1, 2),
}
_ROOT = {
    ("c10d", "broadcast_"): 2,
    ("c10d", "scatter_"): 3,
    ("_c10d_functional", "broadcast"): 1,
    ("_c10d_functional", "broadcast_"): 1,
}


def _flat(xs):
    for x in xs:
        if isinstance(x, (list, tuple)):
            yield from _flat(x)
        else:
            yield x


def _tensors(x):  # a tensor, or a list (of lists) of them, as a flat list
    return list(_flat([x]))


def _nbytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


class CommCounter(TorchDispatchMode):
    """Every collective and point-to-point op this rank hands to c10d while the counter is entered
    (`with counter:`), seen at the dispatcher, where torch's own DDP, FSDP, pipelining and DTensor
    pass too. The technique code never calls it. Per key "op/axis/phase" it counts calls, the
    elements of the whole tensor (an all-reduce's tensor, an all-gather's output, a reduce-scatter's
    or all-to-all's input) and the bytes this rank hands over: an all-reduce's tensor, an
    all-gather's local input, a reduce-scatter's whole input, an all-to-all's input, a send's
    tensor, a broadcast's tensor at its root only; a receive hands nothing.
      axis   the name given to the op's group in `axes` ({"tp": tp_group, ...}); "world" for the default group
      phase  "bwd" inside an autograd backward (hooks and autograd.Functions included), else the innermost
             `with counter.phase(name)` ("fwd" when none)
    With `log=True` every call is also kept in `.calls_log` (op, axis, phase, bytes, elems, peer as
    a global rank for send/recv (None: a receive from any source), tag, and `to_others`: the bytes
    of an all-to-all that leave this rank). Coalesced ops count once, with all their tensors; a
    functional batch of sends and receives counts each. The counter makes every op pass through
    Python: enter it around the steps you report (one is enough), not the whole run when you time
    it. DTensor ops are passed on, so that the collectives they issue are seen instead."""

    def __init__(self, axes=None, log=False):
        super().__init__()
        self.names = {id(g): name for name, g in (axes or {}).items() if g is not None}
        self.log = log
        self.label = "fwd"
        self.off = False
        self.reset()

    def reset(self):
        self.calls = {}
        self.elems = {}
        self.bytes = {}
        self.calls_log = []

    @contextlib.contextmanager
    def phase(self, name):
        old, self.label = self.label, name
        try:
            yield
        finally:
            self.label = old

    @contextlib.contextmanager
    def paused(self):  # for what only feeds a log line or a report, not the technique's traffic
        old, self.off = self.off, True
        try:
            yield
        finally:
            self.off = old

    @staticmethod
    def _group(ns, args):
        """The op's process group: a boxed ProcessGroup (c10d ops), or the group's name (functional
        ops)."""
        for a in args:
            if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()):
                return dist.ProcessGroup.unbox(a)
        names = [a for a in args if isinstance(a, str)]
        if ns == "_c10d_functional" and names:
            return torch._C._distributed_c10d._resolve_process_group(names[-1])
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented
        name = func.__name__.split(".")[0]
        op = _OPS.get(name) if func.namespace in ("c10d", "_c10d_functional") else None
        if op is not None and not self.off:
            self._count(op, name, func.namespace, list(args))
        return func(*args, **(kwargs or {}))

    def _count(self, op, name, ns, args):
        pg = self._group(ns, args)
        # (["isend" | "irecv", ...], peers, tags, tensors, group): one call each
        if name == "batch_p2p_ops":
            for kind, peer, tag, t in zip(*args[:4]):
                self._add(
                    "send" if kind == "isend" else "recv", pg, [t], t.numel(), peer, tag, args
                )
            return
        size = pg.size() if pg is not None else dist.get_world_size()
        # (input or inputs, ...): the output is returned, not passed in
        if ns == "_c10d_functional":
            handed = whole = _tensors(args[0])
        # (outputs, inputs, pg, ...): a list per rank, or one tensor (the *_base_ forms)
        elif op in _OUT_IN:
            handed = _tensors(args[1])
            whole = _tensors(args[0] if op in ("all_gather", "scatter") else args[1])
        else:  # (tensors, pg, ...): all-reduce, broadcast, reduce, send, recv
            handed = whole = _tensors(args[0])
        elems = sum(t.numel() for t in whole)
        if op in ("gather", "scatter") or ns == "_c10d_functional" and op == "all_gather":
            # the whole is not an argument (or is at the root only): my piece x the group
            elems *= size
        peer_at, tag_at = _PEER_TAG.get((ns, name), (None, None))
        peer = args[peer_at] if peer_at is not None else None  # None: a receive from any source
        tag = args[tag_at] if tag_at is not None else None
        root_at = _ROOT.get((ns, name))
        if root_at is not None and args[root_at] != (
            pg.rank() if pg is not None else dist.get_rank()
        ):
            handed = []  # a broadcast or a scatter hands its tensors over at its root only
        self._add(op, pg, handed, elems, peer, tag, args)

    def _add(self, op, pg, handed, elems, peer, tag, args):
        if op == "recv":
            handed = []  # a receive hands nothing over
        if peer is not None and pg is not None and pg is not dist.group.WORLD:
            peer = dist.get_global_rank(pg, peer)  # the peer's rank in the group, made global
        nbytes = _nbytes(handed)
        unnamed = "world" if pg is None or pg is dist.group.WORLD else f"group{pg.size()}"
        axis = self.names.get(id(pg), unnamed)
        phase = "bwd" if torch._C._current_graph_task_id() != -1 else self.label
        key = f"{op}/{axis}/{phase}"
        self.calls[key] = self.calls.get(key, 0) + 1
        self.elems[key] = self.elems.get(key, 0) + elems
        self.bytes[key] = self.bytes.get(key, 0) + nbytes
        if self.log:
            to_others = nbytes
            if op == "all_to_all" and pg is not None and handed:
                r, n = pg.rank(), pg.size()
                if len(handed) == n and n > 1:  # alltoall_: one input tensor per rank
                    mine = _nbytes([handed[r]])
                else:  # one input, split by input_split_sizes (the last list of ints), else equally
                    splits = [
                        a
                        for a in args
                        if isinstance(a, (list, tuple)) and all(type(i) is int for i in a)
                    ]
                    rows = handed[0].shape[0]
                    mine = (
                        nbytes
                        * (splits[-1][r] if splits and splits[-1] else rows // n)
                        // max(rows, 1)
                    )
                to_others = nbytes - mine
            self.calls_log.append(
                dict(
                    op=op,
                    axis=axis,
                    phase=phase,
                    bytes=nbytes,
                    elems=elems,
                    peer=peer,
                    tag=tag,
                    to_others=to_others,
                )
            )

    def table(self):
        """{"op/axis/phase": [calls, elements, bytes handed]}, sorted by key."""
        return {k: [self.calls[k], self.elems[k], self.bytes[k]] for k in sorted(self.calls)}

    def total(self, op=None, axis=None, phase=None, what="bytes"):
        """Sum of bytes (or "calls", "elems") over the keys that match the given parts."""
        counts = {"bytes": self.bytes, "calls": self.calls, "elems": self.elems}[what]
        want = (op, axis, phase)
        return sum(
            v
            for k, v in counts.items()
            if all(w is None or w == x for w, x in zip(want, k.split("/")))
        )


# ----------------------------------------------------------------------------- pipeline timelines
class Timeline:
    """Every F, B (and W) a pipeline schedule runs, timed from one zero common to all ranks. A
    schedule takes one callback, `observe(kind, mb, **tags)`, and runs each op inside it;
    `Timeline.span` is that callback:

        with observe("F", i):          # the schedule's side: one line per op, nothing else
            out = stage(x)
    CPU: the wall clock, zeroed by `zero()` at the wall time the last rank arrived (an all-reduce of
    each rank's clock, its maximum: per-process perf_counter zeros after a barrier would differ by
    its exit skew). (The collective NCCL wants before a group's first batched point-to-point is the
    schedule's caller's: each pipeline file runs its own, before its loop.) CUDA: events recorded on
    the stream, so timing stops neither the host nor the stream; `resolve()` turns them into ms, one
    synchronize per step, none per op. `simulate` ({"F": ms, "B": ms, "W": ms}, --stage-ms): each
    span also waits that long before its end, so that on a few shared cores the schedule, not the
    operating system, sets the measured bubble (on a GPU the host waits before the end event is
    recorded, so the stream's span covers it). Events are dicts {rank, kind, mb, start, end,
    **tags}; tags are numbers named in `tags` (gathered as rows of numbers)."""

    KINDS = "FBW"

    def __init__(self, d, simulate=None, tags=()):
        self.d = d
        self.cuda = d.device.type == "cuda"
        self.simulate = simulate or {}
        self.events = []
        # the names of the numbers an event may carry besides rank, kind, mb, times
        self.tags = tuple(tags)
        self.zero()

    def zero(self):
        t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=self.d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        self.t0 = t.item()
        if self.cuda:
            self.zero_event = self.now()

    def now(self):
        """A stamp: ms since the zero on CPU; on a GPU a recorded CUDA event, turned into ms by
        resolve()."""
        if not self.cuda:
            return time.time() * 1e3 - self.t0
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @contextlib.contextmanager
    def span(self, kind, mb, **tags):
        if set(tags) - set(self.tags):
            unknown = sorted(set(tags) - set(self.tags))
            raise ValueError(f"Timeline: tags {unknown} not named in Timeline(tags=...)")
        start = self.now()
        yield
        if self.simulate.get(kind, 0) > 0:
            time.sleep(self.simulate[kind] / 1e3)
        self.events.append(
            dict(rank=self.d.rank, kind=kind, mb=mb, start=start, end=self.now(), **tags)
        )

    def resolve(self):
        """CUDA events into ms since the zero (one synchronize); nothing to do on CPU."""
        if self.cuda:
            torch.cuda.synchronize(self.d.device)
            for e in self.events:
                for k, v in e.items():
                    if isinstance(v, torch.cuda.Event):
                        e[k] = self.zero_event.elapsed_time(v)
        return self.events

    def gather(self, events=None):
        """Every rank's events (default: all of this rank's) on every rank, as dicts sorted by
        (rank, start), with the tags named in the constructor (a tag an event lacks, or None,
        travels as -1)."""
        events = self.resolve() if events is None else events
        rows = [
            [e["rank"], self.KINDS.index(e["kind"]), e["mb"], e["start"], e["end"]]
            + [-1 if e.get(k) is None else e[k] for k in self.tags]
            for e in events
        ]
        got = gather_rows(self.d, rows if rows else torch.zeros(0, 5 + len(self.tags)))
        out = []
        for rank_rows in got:
            for r in rank_rows.tolist():
                e = dict(
                    rank=int(r[0]), kind=self.KINDS[int(r[1])], mb=int(r[2]), start=r[3], end=r[4]
                )
                e.update(
                    {k: (int(x) if float(x).is_integer() else x) for k, x in zip(self.tags, r[5:])}
                )
                out.append(e)
        return sorted(out, key=lambda e: (e["rank"], e["start"]))


def busy_ms(events, rank, lo, hi, key="rank"):
    """Time `rank` spent inside ops within [lo, hi] ms."""
    return sum(max(0.0, min(e["end"], hi) - max(e["start"], lo)) for e in events if e[key] == rank)


def draw_timeline(events, rows, lo, hi, label, row_key="rank", row_name="stage", max_cols=160):
    """One line per pipeline rank, to scale, from the measured events in [lo, hi]: label(e) ("F3",
    "B3", ...) where an op ran (blank to its end), "." where the rank sat idle."""
    shown = [e for e in events if e["end"] > lo and e["start"] < hi]
    if not shown:
        return "(no events)"
    typical = sorted(e["end"] - e["start"] for e in shown)[len(shown) // 2]
    # a typical op gets ~3 columns
    cols = int(min(max_cols, max(60, 3 * (hi - lo) / max(typical, 1e-6))))
    per_col, lines = (hi - lo) / cols, []
    for r in range(rows):
        line = ["."] * cols
        for e in sorted((e for e in shown if e[row_key] == r), key=lambda e: e["start"]):
            a = min(max(int((e["start"] - lo) / per_col), 0), cols - 1)
            z = max(a + 1, min(cols, round((e["end"] - lo) / per_col)))
            line[a:z] = list(label(e).ljust(z - a)[: z - a])
        lines.append(f"{row_name} {r} |{''.join(line)}|")
    left, pad = f"{lo:.1f} ms", len(row_name) + len(str(rows - 1)) + 3
    lines.append(f"{'':{pad}}{left}{f'{hi:.1f} ms':>{cols + 2 - len(left)}}")
    return "\n".join(lines)


def write_trace(path, events, label, row_key="rank", row_name="stage"):
    """Chrome trace format: one complete event ("ph": "X", microseconds) per op, one process per
    row. Open in https://ui.perfetto.dev or chrome://tracing."""
    names = {
        "F": "forward",
        "B": "backward (input)" if any(e["kind"] == "W" for e in events) else "backward",
        "W": "backward (weights)",
    }
    trace = [
        dict(
            name=label(e),
            cat=names[e["kind"]],
            ph="X",
            ts=1e3 * e["start"],
            dur=1e3 * (e["end"] - e["start"]),
            pid=e[row_key],
            tid=0,
            args={k: v for k, v in e.items() if k not in ("start", "end")},
        )
        for e in events
    ]
    trace += [
        dict(name="process_name", ph="M", pid=r, tid=0, args=dict(name=f"{row_name} {r}"))
        for r in sorted({e[row_key] for e in events})
    ]
    with open(path, "w") as f:
        json.dump(dict(traceEvents=trace, displayTimeUnit="ms"), f)


class PipelineWatch:
    """A pipeline schedule's `observe(kind, mb, chunk=None, recvs=(), **tags)` callback, the one
    every pipeline file builds before its loop. Timeline.span times each F, B (and W), tagged with
    those of these that the Timeline names: the schedule's **tags, `chunk`, `.step` (the loop sets
    it), the grid `coords`, and `recv` (when the op's input arrived: a "p2p" op, not timed, stamps
    its `recvs` messages). Measured the same way for all: F runs under SavedActivations (`saving`),
    so what forwards save for backward is registered weakly in `.live`, and `.saved[chunk]` keeps
    one micro-batch's bytes. `.alive` and `.bytes` are peaks that a file fills from its runner's
    attributes in `before(kind, mb)`, as an op begins (`.last`: the kind of the op before), and
    `after(kind, mb)`; a file may replace `saving(kind)`, what runs inside the span."""

    def __init__(self, d, simulate, tags=(), coords=None):
        self.timeline, self.coords = Timeline(d, simulate, tags=tags), dict(coords or {})
        self.live = LiveStorages()
        self.saved = {}
        self.arrived = {}
        self.step = 0
        # peaks: micro-batches alive, bytes; the op before
        self.alive = 0
        self.bytes = 0
        self.last = None

    def saving(self, kind):
        return SavedActivations(self.live) if kind == "F" else contextlib.nullcontext()

    def before(self, kind, mb):
        pass

    def after(self, kind, mb):
        pass

    @contextlib.contextmanager
    def __call__(self, kind, mb, chunk=None, recvs=(), **tags):
        if kind == "p2p":
            yield
            self.arrived.update((msg, self.timeline.now()) for msg in recvs)
            return
        self.before(kind, mb)
        recv = self.arrived.pop((kind, chunk, mb), None)
        known = dict(chunk=chunk, step=self.step, recv=recv, **self.coords)
        tags.update((k, v) for k, v in known.items() if k in self.timeline.tags)
        with self.timeline.span(kind, mb, **tags), self.saving(kind) as saving:
            yield
        if kind == "F" and isinstance(saving, SavedActivations):
            self.saved.setdefault(chunk, saving.bytes)
        self.after(kind, mb)
        self.last = kind
