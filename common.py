"""common.py: the little that every technique file shares, and nothing technique-specific.

    setup      init_dist() (NCCL + cuda:LOCAL_RANK with CUDA, gloo + CPU without; `python file.py` = world 1)
    model      GPTConfig, build_gpt(): a small GPT whose weights come from one seed
    data       MarkovData: a random sparse Markov chain with an exact entropy floor; batch(step) is a pure
               function of (seed, step), so any rank can make any step's global batch without talking
    training   lm_loss() (sum over tokens / tokens of the *global* batch), make_optimizer() (AdamW),
               clip_grads_() (torch's clipping rule), reference_train(): the one-process trainer
    plumbing   CommonArgs + parse_args(), fail() (exit 2), Dist.log(), StepTimer, memory counting,
               Checkpointer (rank-local, atomic, resumable, refuses a mismatched directory), maybe_fail(),
               check_against_reference(), gather_rows() / assemble_full() (tensors only, never objects),
               write_summary() (--json)
"""
import argparse, inspect, json, os, re, statistics, sys, time
from dataclasses import asdict, dataclass, fields
from datetime import timedelta
from typing import Literal, get_args, get_origin, get_type_hints

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

IGNORE = -100  # target id that carries no loss (padding); F.cross_entropy's default ignore_index
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- command line
@dataclass
class CommonArgs:
    steps: int = 20  # optimizer steps to run (in total, counting resumed ones)
    batch_size: int = 8  # global batch, in sequences
    seq_len: int = 32  # tokens per sequence
    vocab: int = 64  # vocabulary size (= states of the Markov chain)
    d_model: int = 64  # model width
    n_layers: int = 4  # transformer blocks
    n_heads: int = 4  # attention heads
    dropout: float = 0.0  # dropout probability (0 keeps runs comparable across layouts)
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
    fail_at_step: int = -1  # kill the last rank at this step, on the first attempt only
    timeout: int = 120  # process-group timeout in seconds: a desynchronised rank fails, never hangs


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one clear line and exit 2, not a usage wall
        fail(message)


def parse_args(cls, argv=None):
    """Turn an Args dataclass into flags: `n_layers: int = 4  # help` becomes `--n-layers 4`."""
    helps = {}
    for klass in reversed(cls.__mro__):
        try:
            src = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        helps.update(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", src, re.M))
    parser = _Parser(description=(sys.modules[cls.__module__].__doc__ or "").split("\n")[0])
    hints = get_type_hints(cls)
    for f in fields(cls):
        flag, typ, h = "--" + f.name.replace("_", "-"), hints[f.name], helps.get(f.name, "")
        if typ is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=h)
        elif get_origin(typ) is Literal:
            parser.add_argument(flag, choices=get_args(typ), default=f.default, help=h)
        else:
            parser.add_argument(flag, type=typ, default=f.default, help=h)
    return cls(**vars(parser.parse_args(argv)))


def fail(msg):
    """Bad input: one line on stderr and exit code 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", "0")  # one write, so the lines of two ranks never interleave
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error (rank {rank}): {msg}\n")
    sys.stderr.flush()
    sys.exit(2)


def env_world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_common_args(args):
    """The checks every file needs; each technique file adds its own before init_dist()."""
    positive = ("steps", "batch_size", "seq_len", "vocab", "d_model", "n_layers", "n_heads", "timeout")
    for name in positive:
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.d_model % args.n_heads:
        fail(f"--d-model {args.d_model} is not divisible by --n-heads {args.n_heads}")
    if not 0 <= args.dropout < 1:
        fail(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.save_every and not args.ckpt_dir:
        fail("--save-every needs --ckpt-dir")
    if args.ckpt_dir and os.path.exists(args.ckpt_dir) and not os.path.isdir(args.ckpt_dir):
        fail(f"--ckpt-dir {args.ckpt_dir} is a file, not a directory")


# ----------------------------------------------------------------------------- setup (same in every file)
@dataclass
class Dist:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str

    def log(self, *msg):  # rank 0 speaks for the job
        if self.rank == 0:
            print(*msg, flush=True)


def gpu_layout_error(n_gpus, local_world):
    """Why `local_world` processes per node cannot each take their own GPU, or None when they can."""
    if local_world > n_gpus:
        return (f"{local_world} processes on this node but {n_gpus} GPU(s) found (NCCL cannot put two ranks on "
                f"one GPU): launch torchrun --nproc_per_node={n_gpus}, or run on CPU with gloo by hiding the GPUs "
                f"(CUDA_VISIBLE_DEVICES=)")
    return None


def init_dist(timeout_s=120):
    """NCCL on cuda:LOCAL_RANK when CUDA is there, gloo on CPU otherwise. Without torchrun: a world of 1."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda and (why := gpu_layout_error(torch.cuda.device_count(), int(os.environ.get("LOCAL_WORLD_SIZE", "1")))):
        fail(why)  # before any collective, on every rank
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)  # the peak a summary reports is this run's own
    timeout = timedelta(seconds=timeout_s)
    if "RANK" in os.environ:  # launched by torchrun: rendezvous through the store at MASTER_ADDR:MASTER_PORT
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun's agent hosts that store and keeps it across restarts (--max-restarts), so the keys a
        # dead attempt wrote (gloo's and NCCL's addresses) are still there and a restarted worker may
        # connect to a dead peer (pytorch/pytorch#135712). Each attempt therefore rendezvous under its own
        # prefix; the attempt number is the same for every worker, since the agents restart all of them.
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                              is_master=rank == 0 and not agent_hosts, timeout=timeout, multi_tenant=True)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        store = dist.PrefixStore(f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{attempt}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if cuda else None)
    else:  # plain `python file.py`: one process, an in-memory store, no port
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def close_dist(ok=True):
    """End the run: barrier (nobody tears down the group while a peer still uses it), destroy the group,
    exit 0 (or 1 when `ok` is false, e.g. a failed --check). os._exit skips the interpreter's teardown, in
    which gloo's worker threads may still hold tensors and abort the process (see pytorch/pytorch#179291)."""
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


# ----------------------------------------------------------------------------- model
@dataclass
class GPTConfig:
    vocab: int = 64
    seq_len: int = 32
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.0

    @classmethod
    def from_args(cls, args):
        return cls(args.vocab, args.seq_len, args.d_model, args.n_heads, args.n_layers, args.dropout)


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, self.n_heads, self.p = cfg.d_model, cfg.n_heads, cfg.dropout
        # No bias on q/k/v: a key bias gets an exactly-zero gradient (softmax ignores a per-query shift),
        # and Adam would turn the roundoff in that zero into lr-sized noise that differs between layouts.
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, D)
        q, k, v = (rearrange(lin(x), "b t (h e) -> b h t e", h=self.n_heads) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.p if self.training else 0.0)
        return self.drop(self.proj(rearrange(y, "b h t e -> b t (h e)")))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc, self.proj = nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, D) -> (B, T, 4D) -> (B, T, D)
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln1(x)), then + mlp(ln2(x))."""

    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(cfg.d_model), Attention(cfg)
        self.ln2, self.mlp = nn.LayerNorm(cfg.d_model), MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + position embedding, n_layers blocks, final LayerNorm, untied LM head."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.tok_emb, self.pos_emb = nn.Embedding(cfg.vocab, cfg.d_model), nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f, self.head = nn.LayerNorm(cfg.d_model), nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def embed(self, idx):  # (B, T) token ids -> (B, T, D)
        return self.drop(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device)))

    def forward(self, idx):  # (B, T) -> logits (B, T, V)
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_gpt(cfg, seed, dtype=torch.float32, device="cpu"):
    """The full model from one seed, on CPU first, so every layout (any TP/PP/EP/DP degree, any device)
    starts from identical numbers; sharded layouts slice these tensors, they never seed a shard."""
    g = torch.Generator().manual_seed(seed)
    model = GPT(cfg)
    for name, p in model.named_parameters():  # nanoGPT's init: N(0, 0.02), zero biases, unit LayerNorm
        if name.startswith("ln") or ".ln" in name:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, 0.0, 0.02, generator=g)
    return model.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- data
class MarkovData:
    """Tokens from a fixed random sparse Markov chain: each state moves to `branching` successors with
    random probabilities. The entropy rate sum_s pi(s) H(P[s, :]) (pi = stationary distribution) is
    the lowest mean loss any model can reach; sequences start from pi, so it holds at every position."""

    def __init__(self, vocab, seed, branching=4):
        g = torch.Generator().manual_seed(10_007 * seed + 1)
        P = torch.zeros(vocab, vocab, dtype=torch.float64)
        for s in range(vocab):
            nxt = torch.randperm(vocab, generator=g)[:branching]
            nxt[0] = (s + 1) % vocab  # a ring through every state keeps the chain irreducible
            P[s, nxt] = -torch.rand(branching, generator=g, dtype=torch.float64).log()  # Dirichlet(1)
        self.P = P / P.sum(1, keepdim=True)
        evals, evecs = torch.linalg.eig(self.P.T)  # pi P = pi: the left eigenvector of eigenvalue 1
        pi = evecs[:, (evals - 1).abs().argmin()].real
        self.pi = pi / pi.sum()
        row_h = -(self.P * self.P.clamp_min(1e-300).log()).sum(1)
        self.entropy = float((self.pi * row_h).sum())  # nats per token: the loss floor
        self.seed = seed

    def batch(self, step, batch_size, seq_len, ragged=False):
        """The global batch of `step`: inputs and targets (B, T), int64 on CPU. A pure function of
        (seed, step). With `ragged`, targets after a random length per sequence are IGNORE."""
        g = torch.Generator().manual_seed(1_000_003 * self.seed + step)
        tok = torch.empty(batch_size, seq_len + 1, dtype=torch.long)
        tok[:, 0] = torch.multinomial(self.pi, batch_size, replacement=True, generator=g)
        for t in range(seq_len):
            tok[:, t + 1] = torch.multinomial(self.P[tok[:, t]], 1, generator=g)[:, 0]
        x, y = tok[:, :-1], tok[:, 1:].clone()
        if ragged:
            length = torch.randint(1, seq_len + 1, (batch_size, 1), generator=g)
            y[torch.arange(seq_len) >= length] = IGNORE
        return x, y


# ----------------------------------------------------------------------------- loss, optimizer, clipping
def count_tokens(targets):
    return int((targets != IGNORE).sum())


def lm_loss(logits, targets, n_tokens):
    """Sum of token losses divided by the token count of the *whole global batch*: then micro-batch and
    per-rank losses (and gradients) simply add up to the full-batch ones, whatever the split."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax in low precision loses the small probabilities
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum") / n_tokens


def make_optimizer(params, args):
    # foreach=False: the per-tensor code path, elementwise, so a shard of a tensor updates exactly as
    # the same elements of the whole tensor would.
    return torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, foreach=False)


def clip_grads_(grads, total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule, given the norm of the *whole* model (all shards)."""
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:  # in the gradient's dtype, as torch does (a float64 coef would take a slow path)
            g.mul_(coef.to(device=g.device, dtype=g.dtype))
    return total_norm


def reference_train(args, device="cpu", model=None, loss_of=None):
    """Plain one-process training on the whole global batch: the answer every --check compares with.
    `model` / `loss_of(model, x, y, n_tokens)` let a file (MoE) plug in its own model and loss."""
    data = MarkovData(args.vocab, args.seed)
    if model is None:
        model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    loss_of = loss_of or (lambda m, x, y, n: lm_loss(m(x), y, n))
    opt = make_optimizer(model.parameters(), args)
    losses, norms = [], []
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        loss = loss_of(model, x, y, count_tokens(y))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)))
        opt.step()
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return dict(losses=losses, grad_norms=norms, params=params)


def tolerance(dtype):
    """--check's tolerance on the relative difference of per-step losses (see check_against_reference)."""
    return {"float64": 1e-9, "float32": 1e-4, "bfloat16": 5e-2}[dtype]


def check_against_reference(d, args, losses, params, ref=None, tol=None, ptol=None):
    """Rank 0 trains the reference (or takes `ref`) and compares per-step losses (relative, within `tol`)
    and final parameters (max abs difference by name, within `ptol`; `tol` when only that is given).
    `params`: the full, unsharded model on rank 0."""
    result = None
    if d.rank == 0:
        ref = ref or reference_train(args, d.device)
        # Parameters get the loss tolerance, but 10x by default in float32: AdamW divides each gradient by
        # its own RMS, so an element whose gradient is mostly roundoff still moves by up to lr, either way.
        ptol = ptol or tol or (10 if args.dtype == "float32" else 1) * tolerance(args.dtype)
        tol = tol or tolerance(args.dtype)
        loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref["losses"]))
        missing = sorted(set(ref["params"]) ^ set(params))
        param_diff = max((params[n].to(ref["params"][n]) - p).abs().max().item() for n, p in ref["params"].items()
                         if n in params)
        passed = len(losses) == len(ref["losses"]) and not missing and loss_diff <= tol and param_diff <= ptol
        d.log(f"check vs one-process reference: max rel loss diff {loss_diff:.3e} (tolerance {tol:.0e}), max param "
              f"diff {param_diff:.3e} ({ptol:.0e}){', missing ' + str(missing) if missing else ''}"
              f" -> {'PASSED' if passed else 'FAILED'}")
        result = [loss_diff, param_diff, float(passed)]
    # Rank 0's verdict for every rank, as three numbers in a tensor (no object collective: those pickle
    # through numpy and, on NCCL, take a host round trip through the GPU).
    t = torch.tensor(result or [0.0, 0.0, 0.0], dtype=torch.float64, device=d.device)
    dist.broadcast(t, src=0)
    return dict(max_loss_diff=t[0].item(), max_param_diff=t[1].item(), passed=bool(t[2].item()))


def gather_rows(d, rows):
    """Every rank's (n_r, k) rows of numbers (events, counters), on every rank, as a list of (n_r, k)
    float64 CPU tensors: the row counts first, then the rows padded to the longest, two all_gathers of
    tensors on the device."""
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
    """The full model, by name, on every rank, from the disjoint pieces the ranks own (a pipeline stage's
    blocks, say). `owned`: full-model name -> tensor this rank holds; `shapes`: every name -> shape, the
    same on every rank. Each rank writes its pieces into a zero vector of the whole model and one
    all-reduce adds them up: exact, since x + 0 = x. A name owned by no rank or by two is an error."""
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


# ----------------------------------------------------------------------------- timing, memory, logging
class StepTimer:
    """Wall time of each step (CUDA-synchronised on a GPU, so it measures the work, not the launch)."""

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
    d.log(f"step {step:4d} | loss {loss:.6f} | {ms:8.1f} ms | {tokens / max(ms, 1e-9) * 1e3:10.0f} tok/s")


def tensor_bytes(tensors):
    """Bytes held by these tensors (each storage counted once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is not None and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def state_bytes(model, optimizer=None):
    """Parameters + gradients + optimizer state of this rank, counted from the tensors themselves."""
    ts = [p for p in model.parameters()] + [p.grad for p in model.parameters()]
    if optimizer is not None:
        ts += [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return tensor_bytes(ts)


class SavedActivations:
    """Counts the bytes autograd saves for backward inside the `with` block: activations, not parameters
    (nor views of them, such as the transposed weight a Linear saves). `saved_tensors_hooks` sees every
    tensor autograd packs. A storage saved by several ops (one input feeding q, k and v) counts once.
    Wrap a forward only: what it saves stays alive until backward, so no address is reused inside."""

    def __init__(self):
        self.bytes, self._seen = 0, set()

    def _pack(self, t):
        key = t.untyped_storage().data_ptr()
        if not (isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)) and key not in self._seen:
            self._seen.add(key)
            self.bytes += t.untyped_storage().nbytes()
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def peak_memory_bytes(d, counted_bytes):
    """Largest over ranks: CUDA's own peak on a GPU, else the bytes the file counted itself."""
    own = torch.cuda.max_memory_allocated(d.device) if d.device.type == "cuda" else counted_bytes
    t = torch.tensor([float(own)], dtype=torch.float64, device=d.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


# ----------------------------------------------------------------------------- checkpoints and faults
class Checkpointer:
    """Rank-local checkpoints `DIR/rank{r}/step{s}.pt`, written to a temporary file and renamed (atomic),
    the last two kept. At start every rank resumes from the newest step that *all* ranks have. Each file
    records which script wrote it and at what world size; a directory from another file, another world
    size, another model size or layout, or a damaged file is refused with one line (exit 2)."""

    def __init__(self, d, ckpt_dir, save_every, steps):
        self.d, self.save_every, self.steps, self.root = d, save_every, steps, ckpt_dir
        self.dir = os.path.join(ckpt_dir, f"rank{d.rank}") if ckpt_dir else ""
        self.meta = dict(file=os.path.basename(sys.argv[0]), world=d.world)

    def _steps_on_disk(self):
        if not self.dir or not os.path.isdir(self.dir):
            return []
        return sorted(int(m.group(1)) for f in os.listdir(self.dir) if (m := re.fullmatch(r"step(\d+)\.pt", f)))

    def _read(self, step):
        """One checkpoint file, checked against this run; a bad one ends the run with one clear line."""
        path = os.path.join(self.dir, f"step{step}.pt")
        try:  # on CPU: the RNG states must be CPU byte tensors; load_state_dict moves the rest
            state = torch.load(path, map_location="cpu", weights_only=False)
        except Exception as e:
            fail(f"cannot read checkpoint {path} ({type(e).__name__}): delete it or use another --ckpt-dir")
        meta = state.get("meta") if isinstance(state, dict) else None
        if meta != self.meta:
            what = lambda m: f"{m['file']} at world {m['world']}" if m else "an unknown writer"
            fail(f"checkpoint {path} was written by {what(meta)}, this run is {what(self.meta)}: use another --ckpt-dir")
        return state

    def load(self, objects):
        """Restore `objects` (name -> thing with load_state_dict) and RNG; return (step, history)."""
        if not self.dir:
            return 0, {}
        # 1. checks that need no other rank, before any collective
        ranks = [int(m.group(1)) for f in (os.listdir(self.root) if os.path.isdir(self.root) else [])
                 if (m := re.fullmatch(r"rank(\d+)", f))]
        if ranks and max(ranks) >= self.d.world:
            fail(f"--ckpt-dir {self.root} holds checkpoints of {max(ranks) + 1} ranks, this run has {self.d.world}: "
                 f"resume at the same world size, or use another --ckpt-dir")
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
            fail(f"checkpoint in {self.dir} does not fit this model or layout ({why}...): use another --ckpt-dir")
        torch.set_rng_state(state["rng_cpu"])
        if self.d.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng_cuda"], self.d.device)
        self.d.log(f"resumed from {self.dir} at step {step}")
        return step, state["history"]

    def maybe_save(self, step, objects, history):
        """`step` = steps completed. Saves every `save_every` steps and after the last one."""
        if not self.dir or not (step == self.steps or (self.save_every and step % self.save_every == 0)):
            return
        os.makedirs(self.dir, exist_ok=True)
        state = {name: obj.state_dict() for name, obj in objects.items()}
        state.update(step=step, history=history, meta=self.meta, rng_cpu=torch.get_rng_state())
        if self.d.device.type == "cuda":
            state["rng_cuda"] = torch.cuda.get_rng_state(self.d.device)
        tmp = os.path.join(self.dir, f".step{step}.pt.tmp")
        torch.save(state, tmp)
        os.replace(tmp, os.path.join(self.dir, f"step{step}.pt"))  # atomic: never a half-written file
        for old in self._steps_on_disk()[:-2]:
            os.remove(os.path.join(self.dir, f"step{old}.pt"))


def maybe_fail(d, args, step):
    """--fail-at-step: the last rank dies at the start of `step`, on torchrun's first attempt only."""
    if step == args.fail_at_step and d.rank == d.world - 1 and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        print(f"rank {d.rank}: simulated failure at step {step}", file=sys.stderr, flush=True)
        os._exit(13)


# ----------------------------------------------------------------------------- summary
def write_summary(d, args, technique, losses, step_ms, tokens_per_s, peak_mem_bytes, comm_bytes,
                  check=None, figures=None):
    """The --json summary (rank 0). Every figure in it was measured in this run."""
    summary = dict(technique=technique, world_size=d.world, config=asdict(args), losses=losses,
                   step_ms=step_ms, tokens_per_s=tokens_per_s, peak_mem_bytes=peak_mem_bytes,
                   comm_bytes=comm_bytes, check=check, figures=figures or {})
    if d.rank == 0 and args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1, default=str)
        os.replace(tmp, args.json)
    return summary
