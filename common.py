"""common.py: what every technique file stands on, and nothing technique-specific. Read it first.

    setup      init_dist(): NCCL + cuda:LOCAL_RANK with CUDA, gloo + CPU without; `python file.py` = world 1;
               fail(): bad input, one line and exit 2 on every rank, before any collective
    model      GPTConfig, build_gpt(): a small GPT whose weights come from one seed
    data       MarkovData: a random sparse Markov chain with an exact entropy floor; batch(step) is a pure
               function of (seed, step), so any rank can make any step's global batch without
               talking
    training   lm_loss() (sum over tokens / tokens of the *global* batch), make_optimizer() (AdamW),
               clip_grads_() (torch's clipping rule), reference_train(): the one-process trainer
               that every --check compares with
The bookkeeping around a lesson (flags, --check's verdict, checkpoints, counters, timelines, the
summary) is in harness.py, which no reader needs in order to learn a technique.
"""

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

IGNORE = -100  # target id that carries no loss (padding); F.cross_entropy's default ignore_index
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------- setup (same in every file)
def fail(msg):
    """Bad input: one line on stderr and exit code 2, on every rank, before any collective."""
    rank = os.environ.get("RANK", "0")  # one write, so the lines of two ranks never interleave
    sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error (rank {rank}): {msg}\n")
    sys.stderr.flush()
    sys.exit(2)


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
    """Why `local_world` processes per node cannot each take their own GPU, or None when they
    can."""
    if local_world > n_gpus:
        return (
            f"{local_world} processes on this node but {n_gpus} GPU(s) found (NCCL cannot put two "
            f"ranks on one GPU): launch torchrun --nproc_per_node={n_gpus}, or run on CPU with "
            "gloo by hiding the GPUs (CUDA_VISIBLE_DEVICES=)"
        )
    return None


def init_dist(timeout_s=120):
    """NCCL on cuda:LOCAL_RANK when CUDA is there, gloo on CPU otherwise. Without torchrun: a world
    of 1."""
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cuda and (why := gpu_layout_error(torch.cuda.device_count(), local_world)):
        fail(why)  # before any collective, on every rank
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)  # the peak a summary reports is this run's own
    timeout = timedelta(seconds=timeout_s)
    # launched by torchrun: rendezvous through the store at MASTER_ADDR:MASTER_PORT
    if "RANK" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        # torchrun's agent hosts that store and keeps it across restarts (--max-restarts), so the
        # keys a dead attempt wrote (gloo's and NCCL's addresses) are still there and a restarted
        # worker may connect to a dead peer (pytorch/pytorch#135712). Each attempt therefore
        # rendezvous under its own prefix; the attempt number is the same for every worker, since
        # the agents restart all of them.
        agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=rank == 0 and not agent_hosts,
            timeout=timeout,
            multi_tenant=True,
        )
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # device_id binds the group to this rank's GPU: NCCL's communicator is created now (eager),
        # not at the first collective, and nothing has to guess the device "under current context".
        store = dist.PrefixStore(
            f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/attempt{attempt}", store
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world,
            timeout=timeout,
            device_id=device if cuda else None,
        )
    else:  # plain `python file.py`: one process, an in-memory store, no port
        dist.init_process_group(
            backend,
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device if cuda else None,
        )
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def close_dist(ok=True):
    """End the run: barrier (nobody tears down the group while a peer still uses it), destroy the
    group, exit 0 (or 1 when `ok` is false, e.g. a failed --check). os._exit skips the interpreter's
    teardown, in which gloo's worker threads may still hold tensors and abort the process (see
    pytorch/pytorch#179291)."""
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
        return cls(
            args.vocab,
            args.seq_len,
            args.d_model,
            args.n_heads,
            args.n_layers,
            getattr(args, "dropout", 0.0),  # (harness.BaseArgs has none: no dropout)
        )


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.n_heads = cfg.n_heads
        self.p = cfg.dropout
        # No bias on q/k/v: a key bias gets an exactly-zero gradient (softmax ignores a per-query
        # shift), and Adam would turn the roundoff in that zero into lr-sized noise that differs
        # between layouts.
        self.q, self.k, self.v = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):  # (B, T, D)
        q, k, v = (
            rearrange(lin(x), "b t (h e) -> b h t e", h=self.n_heads)
            for lin in (self.q, self.k, self.v)
        )  # (B, H, T, E) each
        p = self.p if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, H, T, E)
        return self.drop(self.proj(rearrange(y, "b h t e -> b t (h e)")))  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc, self.proj = (
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )
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
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f, self.head = (
            nn.LayerNorm(cfg.d_model),
            nn.Linear(cfg.d_model, cfg.vocab, bias=False),
        )

    def embed(self, idx):  # (B, T) token ids -> (B, T, D)
        return self.drop(
            self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        )

    def forward(self, idx):  # (B, T) -> logits (B, T, V)
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))


def build_gpt(cfg, seed, dtype=torch.float32, device="cpu"):
    """The full model from one seed, on CPU first, so every layout (any TP/PP/EP/DP degree, any
    device) starts from identical numbers; sharded layouts slice these tensors, they never seed a
    shard."""
    g = torch.Generator().manual_seed(seed)
    model = GPT(cfg)
    for (
        name,
        p,
    ) in model.named_parameters():  # nanoGPT's init: N(0, 0.02), zero biases, unit LayerNorm
        if name.startswith("ln") or ".ln" in name:
            nn.init.ones_(p) if name.endswith("weight") else nn.init.zeros_(p)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, 0.0, 0.02, generator=g)
    return model.to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------- data
class MarkovData:
    """Tokens from a fixed random sparse Markov chain: each state moves to `branching` successors
    with random probabilities. The entropy rate sum_s pi(s) H(P[s, :]) (pi = stationary
    distribution) is the lowest mean loss any model can reach; sequences start from pi, so it holds
    at every position."""

    def __init__(self, vocab, seed, branching=4):
        g = torch.Generator().manual_seed(10_007 * seed + 1)
        P = torch.zeros(vocab, vocab, dtype=torch.float64)
        for s in range(vocab):
            nxt = torch.randperm(vocab, generator=g)[:branching]
            nxt[0] = (s + 1) % vocab  # a ring through every state keeps the chain irreducible
            # Dirichlet(1)
            P[s, nxt] = -torch.rand(branching, generator=g, dtype=torch.float64).log()
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


# ------------------------------------------------------------------------ loss, optimizer, clipping
def count_tokens(targets):
    return int((targets != IGNORE).sum())


def lm_loss(logits, targets, n_tokens):
    """Sum of token losses divided by the token count of the *whole global batch*: then micro-batch
    and per-rank losses (and gradients) simply add up to the full-batch ones, whatever the split."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # softmax in low precision loses the small probabilities
    total = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    return total / n_tokens


def make_optimizer(params, args):
    # foreach=False: the per-tensor code path, elementwise, so a shard of a tensor updates exactly
    # as the same elements of the whole tensor would.
    return torch.optim.AdamW(
        params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, foreach=False
    )


def clip_grads_(grads, total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s rule, given the norm of the *whole* model (all shards)."""
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        # in the gradient's dtype, as torch does (a float64 coef would take a slow path)
        for g in grads:
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
