"""zero_bubble.py: zero-bubble pipelines: the backward cut in two (B and W), ZB-H1 and ZB-V.

Qi, Wan, Huang, Lin, "Zero Bubble Pipeline Parallelism" (ICLR 2024). A backward does two things: B,
the gradient of the stage's input, which the stage before waits for; and W, the gradient of the
stage's weights, which nobody waits for until the optimizer step. Cut apart, W can run wherever a
stage would sit idle.
1. ZB-H1 (Sec. 3.1), one stage per rank as in 1F1B (pipedream.py): 1F1B's order of F and B, each B
   followed
   by a W, except that stage s holds back its first s W's; its last s W's fill the cool-down, where
   1F1B's stage s waits. The same activation memory as 1F1B: at most p micro-batches alive (F to W)
   per stage.

    ZB-H1, p = 4, m = 8 (F, B, W one slot each)                                                 time ->
    stage 0   F0 F1 F2 F3 .. .. .. B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7
    stage 1   .. F0 F1 F2 .. .. B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7
    stage 2   .. .. F0 F1 .. B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7
    stage 3   .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7
              idle (p-1)(T_F+T_B-T_W) = 3 slots per stage, a third of 1F1B's (p-1)(T_F+T_B+T_W) = 9:
              bubble = idle / busy = (p-1)/(3m) at T_F = T_B = T_W (1F1B: (p-1)/m)

2. ZB-V (Sec. 6): the model in 2p chunks, two per rank in a V: rank r holds chunk r (down) and chunk
   2p-1-r
   (back up), so rank 0 holds the embedding and the head, and the turn of the V (chunk p-1 to p)
   stays on rank p-1. The order is torch's ScheduleZBVZeroBubble (m >= 2p-1). p = 2, m = 4, F, B and
   W one slot each of a half-stage chunk (capitals: down the V, lower case: back up):

      rank 0  F0F1F2f0b0w0f1b1w1F3B0W0f2b2w2B1W1f3b3w3B2W2B3W3..      idle 1 slot per 24 busy
      rank 1  ..F0f0F1f1b0w0F2B0W0f2b1w1F3B1W1f3b2w2B2b3B3W2w3W3      = (p-1)/(6m): the paper's "about 0"
   At most 2p chunks of micro-batches alive per rank (p micro-batches of a whole stage, as 1F1B),
   for twice 1F1B's messages: 2(p-1)m per direction and pipeline.
Both are synchronous: B then W is one backward bit for bit, every step drains before one optimizer
step, so --check compares with one-process training. Data parallel (--dp) wraps the pipelines: each
replica runs its pipeline on its slice of the batch, then one gradient all-reduce per step.
Outermost in the step, it is the innermost axis in rank order: grid = arange(world).view(p, dp), a
replica group is a row grid[i, :] of adjacent ranks, a pipeline a column grid[:, j].

Messages: every activation and gradient is one tensor in a batch_isend_irecv, posted at the moment
of the ideal timeline that comm_plan() gives it, so that no batch waits on a later one (NCCL
deadlocks otherwise; the tests simulate it). Measured from outside, each beside its theory: the
bubble, micro-batches alive, bytes held and sent; an ASCII timeline.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 zero_bubble.py --microbatches 8 --stage-ms 30 --steps 3      # ZB-H1
    torchrun --nproc_per_node=4 zero_bubble.py --schedule zbv --n-layers 8 --microbatches 8 --stage-ms 30 \\
        --steps 3                                                                            # ZB-V
    torchrun --nproc_per_node=4 zero_bubble.py --pp 2 --dp 2 --schedule zbv --dtype float64 --check
In production, use torch.distributed.pipelining (ScheduleInterleavedZeroBubble,
ScheduleZBVZeroBubble).
"""

import collections
import contextlib
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (
    DTYPES,
    GPT,
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
    PipelineWatch,
    Run,
    assemble_full,
    busy_ms,
    check_against_reference,
    check_common_args,
    draw_timeline,
    env_world_size,
    gather_rows,
    parse_args,
    peak_memory_bytes,
    state_bytes,
    write_trace,
)


@dataclass
class Args(CommonArgs):
    schedule: Literal["zbh1", "zbv"] = "zbh1"  # zbh1: one stage per rank; zbv: two chunks in a V
    pp: int = 0  # pipeline ranks p (0 = world / dp)
    dp: int = 1  # data-parallel replicas (adjacent ranks: grid = arange(world).view(p, dp))
    microbatches: int = 4  # m: micro-batches per replica and step (zbv: at least 2p-1)
    trace: str = ""  # write the measured F/B/W events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute: each F, B and W of a chunk also waits this many ms


# --------------------------------------------------------------------- B and W: one backward in two
class _LinearDeferringW(torch.autograd.Function):
    """F.linear whose backward returns dx only and keeps (x, dy), what W needs, in split.saved."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, split):
        # x for W, the weight for dx: what nn.Linear's own backward keeps
        ctx.save_for_backward(x, weight)
        ctx.layer = layer
        ctx.split = split
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):  # dy: (..., out)
        x, weight = ctx.saved_tensors  # x: (..., in)
        ctx.split.saved.append((ctx.layer, x, dy))
        dx = (
            dy.reshape(-1, dy.shape[-1]).mm(weight).view(x.shape)
            if ctx.needs_input_grad[0]
            else None
        )
        return dx, None, None, None, None  # no weight or bias gradient now: W adds it


class SplitBackward:
    """Zero Bubble's B and W for `module` (Qi et al. 2024, Sec. 2): every nn.Linear inside defers
    its weight gradient. backward_input(out, grad), B: one autograd backward, the input's gradient
    and every non-Linear parameter's (LayerNorm, embeddings: small beside the products); returns
    what W needs. backward_weight (that), W: dW = dy^T x, db = sum(dy) per Linear, autograd's
    products: B then W is one backward bitwise."""

    def __init__(self, module):
        self.saved = []  # (layer, x, dy), appended by the B in progress
        for layer in module.modules():
            if isinstance(layer, nn.Linear):
                layer.forward = lambda x, layer=layer: _LinearDeferringW.apply(
                    x, layer.weight, layer.bias, layer, self
                )

    def backward_input(self, out, grad=None):
        torch.autograd.backward(out, grad)
        saved, self.saved = self.saved, []
        return saved

    @staticmethod
    def backward_weight(saved):
        for layer, x, dy in saved:
            x2 = x.detach().reshape(-1, x.shape[-1])  # (N, in)
            dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
            # autograd's addmm / mm backward products, same layout and bits; x detached: W builds no
            # graph
            grads = [(layer.weight, dy2.t().mm(x2))]  # (out, in)
            if layer.bias is not None:
                grads.append((layer.bias, dy2.sum(0)))  # (out,)
            for q, g in grads:
                q.grad = g if q.grad is None else q.grad.add_(g)


# -------------------------------------------------------------------------- the chunks of the model
def split_layers(n_layers, n):
    """Blocks [start, end) of each of n chunks, as even as possible; the earlier chunks take the
    extras."""
    if not 1 <= n <= n_layers:
        raise ValueError(
            f"{n} chunks of {n_layers} blocks: use 1 to {n_layers} chunks, or {n} blocks or more"
        )
    base, extra = divmod(n_layers, n)
    return [(c * base + min(c, extra), (c + 1) * base + min(c + 1, extra)) for c in range(n)]


class Chunk(nn.Module):
    """Blocks [start, end) of the GPT (names kept); the first chunk adds the embedding, the last
    ln_f+head."""

    def __init__(self, gpt, c, bounds):
        super().__init__()
        start, end = bounds[c]
        self.first = c == 0
        self.last = c == len(bounds) - 1
        if self.first:
            self.tok_emb = gpt.tok_emb
            self.pos_emb = gpt.pos_emb
            self.drop = gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(start, end)})
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h):  # first chunk: (b, T) token ids; others: (b, T, D) from the chunk before
        if self.first:  # = GPT.embed (written out: the section needs only torch)
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


# ----------------------------------------------------------------------------- ZB-H1: the schedule
def zbh1(p, m, r):
    """ZB-H1 on rank r (chunk r of p): ops (kind, chunk, micro-batch). 1F1B's F and B: p-r-1 warm-up
    forwards, then one F and one B in turn, then the cool-down B's; each B followed by the oldest W
    still to run, but the first r B's: their W's end it (torch's ScheduleInterleavedZeroBubble, one
    stage per rank)."""
    warm = min(p - r - 1, m)
    # warm-up: forwards only, enough to fill the ranks after this one
    ops = [("F", r, k) for k in range(warm)]
    # steady state: one forward, then the backward B k (input gradient) of the oldest micro-batch
    # held; once every forward ran, the cool-down: the backwards of the micro-batches still held ...
    for k in range(m):
        if warm + k < m:
            ops.append(("F", r, warm + k))
        ops.append(("B", r, k))
        # ... each followed by the oldest weight gradient waiting, r behind: the first r W's are
        # held back
        if k >= r:
            ops.append(("W", r, k - r))
    # the r W's held back fill the cool-down's end, where 1F1B's stage r waits
    return ops + [("W", r, k) for k in range(max(m - r, 0), m)]


# ------------------------------------------------------------------------- messages, placed in time
def needs(op, n):
    """The message op (kind, c, k) waits for, from chunk c-1 (F) or c+1 (B); None: tokens, a loss, a
    B (W)."""
    kind, c, _ = op
    return None if kind == "W" or (kind, c) in (("F", 0), ("B", n - 1)) else op


# the op that makes message (kind, c, k): the same kind on the chunk before (F) or after (B)
def producer(msg):
    kind, c, k = msg
    return (kind, c - 1 if kind == "F" else c + 1, k)


def ideal_timeline(orders, n):
    """Every rank's ops (orders[r], n chunks in all) at their earliest start when F, B, W take one
    slot each and messages are free: {op: (rank, start, end)}. Its idle slots are the schedule's
    bubble."""
    p = len(orders)
    at = {}
    nxt = [0] * p
    free = [0] * p
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                op = orders[r][nxt[r]]
                deps = [producer(op)] if needs(op, n) else []
                before = {"B": "F", "W": "B"}.get(op[0])  # B waits for its F, W for its B
                if before:
                    deps.append((before, *op[1:]))
                if any(dep not in at for dep in deps):
                    break
                start = max([free[r]] + [at[dep][2] for dep in deps])
                at[op] = (r, start, start + 1)
                free[r] = start + 1
                nxt[r] += 1
                moved = True
        if not moved:
            raise ValueError(
                "the schedule waits on itself: give every rank's ops of one schedule, in order"
            )
    return at


def comm_plan(orders, n, r):
    """Rank r's steps for one batch: ("op", op) and ("p2p", sends, recvs) with [(peer pp rank,
    message)]. Each message travels at one moment G of the ideal timeline between the op that makes
    it and the one that uses it: the first at which both ranks are between ops (else when made).
    Both post it in their batch of G, so all post batches in order of G, none waiting for a later
    one: no cycle (NCCL deadlocks on a send whose receive is posted behind a wait on the sender).
    Sorted alike on both sides; none within a rank."""
    at = ideal_timeline(orders, n)
    items = collections.defaultdict(lambda: ([], []))
    spans = collections.defaultdict(list)  # pp rank -> (start, end) of its ops
    for q, start, end in at.values():
        spans[q].append((start, end))
    for msg in (needs(op, n) for op in at):
        if msg is not None and at[producer(msg)][0] != at[msg][0]:
            src, _, made = at[producer(msg)]
            dst, used, _ = at[msg]
            both = spans[src] + spans[dst]
            # the ends of both ranks' ops from made to used (made and used among them) ...
            edges = {x for span in both for x in span if made <= x <= used}
            # ... the first at which neither rank is inside an op
            when = next((x for x in sorted(edges) if not any(a < x < z for a, z in both)), made)
            if src == r:
                items[when][0].append((dst, msg))
            if dst == r:
                items[when][1].append((src, msg))
    steps = [((at[op][1], 1), ("op", op)) for op in orders[r]]
    steps += [((when, 0), ("p2p", sorted(s), sorted(rv))) for when, (s, rv) in items.items()]
    # keys are distinct: a rank's ops start at distinct moments, one batch per moment, batches first
    return [step for _, step in sorted(steps)]


# ------------------------------------------------------------------------ one rank running its plan
# a point-to-point tag per direction: activations 0, gradients 1 (NCCL ignores tags)
TAG = {"F": 0, "B": 1}


class PipelineRank:
    """One rank of one pipeline: runs `plan` (comm_plan's steps) over its chunks for one batch, to
    the flush.
    chunks   {global chunk index: module} of n; chunk 0 reads inputs[k], chunk n-1 loss_fn(., targets[k])
    split    a SplitBackward over this rank's chunks: B keeps what W needs, W adds the weight gradients
    group    the pipeline's ranks in pp rank order; every message is one tensor of msg_shape and dtype
    observe  a context around every F, B, W (observe(kind, mb, chunk=c)) and p2p (observe("p2p", None,
             recvs=[message, ...])). NCCL wants a collective on the group first: the caller runs
             it."""

    def __init__(self, chunks, n, plan, split, group, msg_shape, dtype, device, observe=None):
        self.chunks = chunks
        self.n = n
        self.plan = plan
        self.split = split
        self.group = group
        self.msg_shape = msg_shape
        self.dtype = dtype
        self.device = device
        self.observe = observe or (lambda *a, **k: contextlib.nullcontext())
        self.inbox = {}
        self.outbox = {}
        self.alive = {}
        self.waiting = {}
        peers = {q for step, *what in plan if step == "p2p" for q, _ in what[0] + what[1]}
        if dist.get_rank(group) < 0 or not peers <= set(range(dist.get_world_size(group))):
            # micro-batches the plan runs
            raise ValueError(
                f"the plan's peers {sorted(peers)} are not in the group: plan for p = its size"
            )
        self.m = 1 + max(op[2] for step, op, *_ in plan if step == "op")

    def run(self, inputs, targets, loss_fn):
        """inputs, targets: m micro-batches each. Returns the summed loss of those scored here
        (0-dim)."""
        if len(inputs) != self.m or len(targets) != self.m or len({x.shape for x in inputs}) > 1:
            raise ValueError(
                f"the plan runs m = {self.m} micro-batches of one shape: got {len(inputs)} "
                f"inputs {sorted({tuple(x.shape) for x in inputs})}, {len(targets)} targets"
            )
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for step, *what in self.plan:
            if step == "p2p":
                with self.observe("p2p", None, recvs=[msg for _, msg in what[1]]):
                    self.exchange(*what)
                continue
            kind, c, k = what[0]
            with self.observe(kind, k, chunk=c):
                if kind == "F":
                    self.forward(c, k, inputs, targets, loss_fn)
                elif kind == "B":
                    self.backward(c, k)
                else:  # W: the weight gradients its B left
                    self.split.backward_weight(self.waiting.pop((c, k)))
        return self.loss

    def exchange(self, sends, recvs):
        """One batch_isend_irecv: sends [(pp rank, message)] from the outbox, receives into the
        inbox."""
        into = {
            msg: torch.empty(self.msg_shape, dtype=self.dtype, device=self.device)
            for _, msg in recvs
        }
        out = [(dist.isend, self.outbox.pop(msg).contiguous(), q, msg) for q, msg in sends]
        ops = [
            dist.P2POp(op, t, group=self.group, group_peer=q, tag=TAG[msg[0]])  # q: a pp rank
            for op, t, q, msg in out + [(dist.irecv, into[msg], q, msg) for q, msg in recvs]
        ]
        # never empty: comm_plan makes a step only for a message
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        self.inbox.update(into)

    def hand_on(self, msg, t):
        """To the chunk that waits for `msg`: here when this rank holds it (the V's turn), else a
        message."""
        (self.inbox if msg[1] in self.chunks else self.outbox)[msg] = t

    def forward(self, c, k, inputs, targets, loss_fn):
        # (b, T) ids or (b, T, D)
        inp = inputs[k] if c == 0 else self.inbox.pop(("F", c, k)).requires_grad_()
        out = self.chunks[c](inp)  # (b, T, D); last chunk: logits (b, T, V) ...
        if c == self.n - 1:
            out = loss_fn(out, targets[k])  # ... and its loss
            self.loss += out.detach()
        else:
            self.hand_on(("F", c + 1, k), out.detach())  # (b, T, D) to chunk c+1
        self.alive[c, k] = inp, out

    # B: the input's gradient now; the Linears' weight gradients wait for W
    def backward(self, c, k):
        inp, out = self.alive.pop((c, k))
        grad = None if c == self.n - 1 else self.inbox.pop(("B", c, k))  # last chunk: from its loss
        self.waiting[c, k] = self.split.backward_input(out, grad)
        if c > 0:
            self.hand_on(("B", c - 1, k), inp.grad)  # (b, T, D) to chunk c-1


# -------------------------------------------------------------------- after the flush: DP, clipping
def finish_batch(params, loss, dp_group, group, max_norm):
    """1. Data parallel: every gradient summed over the replicas in one all-reduce (micro-batch
    losses are divided by the global token count: the sum is the batch's gradient). 2. The squared
    norm and the loss in one all-reduce over `group`, all pipelines (norm from dp rank 0). 3. Clip
    (0: none). -> (loss, norm)"""
    if dist.get_world_size(dp_group) > 1:
        flat = torch.cat([q.grad.reshape(-1) for q in params])  # (this rank's elements,)
        dist.all_reduce(flat, group=dp_group)
        for q, part in zip(params, flat.split([q.numel() for q in params])):
            q.grad.copy_(part.view_as(q))
    acc = torch.promote_types(params[0].dtype, torch.float32)
    norms = torch.stack([torch.linalg.vector_norm(q.grad, dtype=acc) for q in params])
    sq = norms.square().sum().double() * (dist.get_rank(dp_group) == 0)  # counted on dp rank 0
    total = torch.stack([loss, sq])
    dist.all_reduce(total, group=group)  # (2,) the batch loss, the whole model's squared norm
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total[1].sqrt())
    return total[0].item(), total[1].sqrt().item()


# -------------------------------------------------------------------------- ZB-V: two chunks in a V
def zbv(p, m, r):
    """ZB-V, rank r's ops in order (torch's ScheduleZBVZeroBubble; m >= 2p-1). Down is chunk r, up
    2p-1-r.
    1. warm-up: 2(p-r)-1 F down; then r times F up, F down; then p-r times F up, B up, W up
    2. steady: F down (while micro-batches remain), B down, W down, F up, B up, W up, until every F
       ran
    3. cool-down: r times B down, B up; p-r times B down, W down (the oldest); then the W's left, up
       first."""
    if m < 2 * p - 1:  # rank 0's warm-up alone runs 2p-1 forwards
        raise ValueError(f"zbv at p = {p} needs m >= 2p-1 = {2 * p - 1} micro-batches, got {m}")
    down, up = r, 2 * p - 1 - r
    ops, done = [], collections.Counter()

    def run(kind, c):
        ops.append((kind, c, done[kind, c]))
        done[kind, c] += 1

    # 1. warm-up: forwards down the V, then up and down in turn, then the first backwards at its tip
    for _ in range(2 * (p - r) - 1):
        run("F", down)
    for _ in range(r):
        for c in (up, down):
            run("F", c)
    for _ in range(p - r):
        for kind in "FBW":
            run(kind, up)
    # 2. steady state: a forward, backward and weight gradient on each leg of the V
    while done["F", up] < m:
        if done["F", down] < m:
            run("F", down)
        for kind, c in (("B", down), ("W", down), ("F", up), ("B", up), ("W", up)):
            run(kind, c)
    # 3. cool-down: the backwards left, then the weight gradients held back, up first
    for _ in range(r):
        for c in (down, up):
            run("B", c)
    for _ in range(p - r):
        for kind in "BW":
            run(kind, down)
    for c in (up, down):
        while done["W", c] < done["B", c]:
            run("W", c)
    return ops


SCHEDULES = {  # name -> (rank r's ops, chunks in all, the pp rank holding chunk c)
    "zbh1": (zbh1, lambda p: p, lambda c, p: c),
    "zbv": (zbv, lambda p: 2 * p, lambda c, p: min(c, 2 * p - 1 - c)),
}


# ---------------------------------------------------------------------------- argument checks, main
def check_args(args):
    world = env_world_size()
    m = args.microbatches
    check_common_args(args)
    for name in ("dp", "microbatches"):
        if getattr(args, name) < 1:
            fail(f"--{name} must be >= 1, got {getattr(args, name)}")
    p = args.pp or world // args.dp
    if args.pp < 0 or p * args.dp != world:
        fail(
            f"world size {world} != pp {args.pp or '(world / dp)'} x dp {args.dp}: launch torchrun "
            f"--nproc_per_node={max(p, 2) * args.dp} or change --pp / --dp"
        )
    if p < 2:
        fail(
            "zero_bubble.py needs one process per pipeline stage, at least 2: torchrun "
            f"--nproc_per_node={2 * args.dp} zero_bubble.py {' '.join(sys.argv[1:])}".rstrip()
        )
    order, n_chunks, _ = SCHEDULES[args.schedule]
    try:  # the cores' own checks, the model's cut and the schedule's order
        split_layers(args.n_layers, n_chunks(p))
        order(p, m, 0)
    except ValueError as e:  # as fail's one line, with the flags they came from
        fail(
            f"--n-layers {args.n_layers}, --schedule {args.schedule}, --pp {p}, "
            f"--microbatches {m}: {e}"
        )
    if args.batch_size % (args.dp * m):
        fail(
            f"--batch-size {args.batch_size} is not divisible by dp x microbatches = "
            f"{args.dp * m}: use "
            f"--batch-size {(args.batch_size // (args.dp * m) + 1) * args.dp * m}"
        )
    if args.stage_ms < 0:
        fail(f"--stage-ms must be >= 0, got {args.stage_ms}")
    return world, p


def main():
    args = parse_args(Args)
    world, p = check_args(args)
    # b: micro-batch
    dp = args.dp
    m = args.microbatches
    b = args.batch_size // (dp * m)
    order, n_chunks, holder = SCHEDULES[args.schedule]

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, n_chunks(p))
    # data parallel outermost in the step, innermost in rank order: a replica group is a row
    # grid[i, :] of adjacent ranks, a pipeline a column grid[:, j]
    grid = torch.arange(world).view(p, dp)
    pp_rank, dp_rank = [int(i) for i in (grid == d.rank).nonzero()[0]]
    # every rank makes each group (new_group: a collective over the world), keeps its own
    dp_group = [dist.new_group(grid[i, :].tolist()) for i in range(p)][pp_rank]
    pp_group = [dist.new_group(grid[:, j].tolist()) for j in range(dp)][dp_rank]  # pp rank order
    d.log(
        f"zero_bubble.py --schedule {args.schedule}: pp {p} x dp {dp}, {len(bounds)} chunks, m = "
        f"{m} micro-batches of {b} per replica, on {d.backend}; entropy floor {data.entropy:.4f} "
        "nats/token"
    )
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per rank
    dtype = DTYPES[args.dtype]
    # the whole GPT, on CPU; a rank takes its chunks
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    mine = {c: Chunk(gpt, c, bounds) for c in range(len(bounds)) if holder(c, p) == pp_rank}
    # one module of them all, for the optimizer, the checkpoint and the names; moved in place
    chunks = nn.ModuleDict({str(c): chunk for c, chunk in mine.items()}).to(d.device)
    del gpt
    # every Linear of this rank's chunks defers its weight gradient to W
    split = SplitBackward(chunks)
    params = list(chunks.parameters())
    opt = make_optimizer(params, args)
    run = Run(d, args, {"model": chunks, "optim": opt})
    orders = [order(p, m, r) for r in range(p)]
    plan = comm_plan(orders, len(bounds), pp_rank)
    # NCCL sets up a group's communicator at its first collective; batched point-to-point must not
    # come first
    dist.all_reduce(torch.zeros(1, device=d.device), group=pp_group)
    watch = Watch(d, args, (pp_rank, dp_rank))
    comm = CommCounter(log=True)
    runner = PipelineRank(
        mine,
        len(bounds),
        plan,
        split,
        pp_group,
        (b, args.seq_len, args.d_model),
        dtype,
        d.device,
        observe=watch,
    )
    watch.runner = runner
    watch.state = lambda: state_bytes(chunks, opt)
    for step in run.steps():
        # (B, T) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # the whole global batch's: every micro-batch loss divides by it
        # (m, b, T) each: this replica's rows, cut into micro-batches
        mbs = [
            rearrange(z, "(dp m b) t -> dp m b t", dp=dp, m=m)[dp_rank].to(d.device) for z in (x, y)
        ]
        watch.step = step
        # count the sends of the step before last (counting slows ops; the last step's bubble is
        # reported)
        with run.watching(step, comm, at=max(run.start, args.steps - 2)):
            loss = runner.run(*mbs, lambda logits, tgt: lm_loss(logits, tgt, n_tok))
            loss, _ = finish_batch(params, loss, dp_group, dist.group.WORLD, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.end_step(step, loss)

    # the summary, then --check
    summarize(d, args, p, run, watch, comm, bounds, holder, chunks, dp_rank)


# --- measurement --- (from outside the schedule: its observe callback, the counter, the report)
class Watch(PipelineWatch):
    """harness.PipelineWatch (--stage-ms: each F, B, W waits that), tagged with the step, the rank's
    grid coordinates and when its input arrived, reading the runner's attributes as each op begins:
    micro-batch chunks alive (F to W); after a forward, the bytes alive: what forwards saved for
    backward, the inputs and outputs held to B, what B left for W, and the state."""

    def __init__(self, d, args, coords):
        ms = args.stage_ms
        pp, dp = coords
        super().__init__(
            d, dict(F=ms, B=ms, W=ms), ("chunk", "step", "pp", "dp", "recv"), dict(pp=pp, dp=dp)
        )
        self.runner, self.state = None, None

    def before(self, kind, mb):
        r = self.runner
        self.alive = max(self.alive, len(set(r.alive) | set(r.waiting)))
        if self.last == "F":  # activations peak after a forward
            held = [t for a in r.alive.values() for t in a]  # inputs and outputs until B
            held += [
                t for w in r.waiting.values() for _, x, dy in w for t in (x, dy)
            ]  # what W needs
            self.bytes = max(self.bytes, self.live.alive(*held) + self.state())


def theory(p, m, schedule):
    """Per pp rank: the bubble (idle / busy at T_F = T_B = T_W), the most micro-batch chunks between
    F and W, the messages per step each way.
        zbh1  (p-1)/(3m): p-1 idle slots of 3m; p (or m if fewer), as 1F1B's stage 0; m to each neighbour
        zbv   (p-1)/(6m): p-1 chunk ops of 6m idle (the paper: about 0); 2p, p micro-batches of a whole
              stage as in 1F1B; m(2 - 1 if rank 0 - 1 if rank p-1) each way (the V's turn is
              local)"""
    if schedule == "zbh1":
        return (
            (p - 1) / (3 * m),
            [min(p, m)] * p,
            [m * (r < p - 1) for r in range(p)],
            [m * (r > 0) for r in range(p)],
        )
    msgs = [m * (2 - (r == 0) - (r == p - 1)) for r in range(p)]
    return (p - 1) / (6 * m), [2 * p] * p, msgs, msgs


def summarize(d, args, p, run, watch, comm, bounds, holder, chunks, dp_rank):
    """The report, the peak (counted; CUDA's own on a GPU), then --check: the full model, by name,
    from the chunks of dp replica 0 (one all-reduce)."""
    figures = report(d, args, p, watch, comm, bounds, holder)
    peak = peak_memory_bytes(d, watch.bytes)
    check = None
    if args.check:
        dtype = DTYPES[args.dtype]
        with torch.device("meta"):  # the names and shapes of the whole GPT, no storage
            shapes = {n: q.shape for n, q in GPT(GPTConfig.from_args(args)).named_parameters()}
        owned = (
            {n.split(".", 1)[1]: q for n, q in chunks.named_parameters()} if dp_rank == 0 else {}
        )
        check = check_against_reference(d, args, run.losses, assemble_full(d, owned, shapes, dtype))
    run.finish(
        f"zero-bubble-{args.schedule}",
        peak,
        max(figures.get("sent_bytes_per_rank", [0])),
        check,
        figures,
    )


def report(d, args, p, watch, comm, bounds, holder):
    """Every rank's events and counts, gathered (tensors only); rank 0: each figure beside its
    theory, the table, the timeline of the last step of pipeline 0, --trace."""
    m, schedule = args.microbatches, args.schedule
    tags = [c["tag"] for c in comm.calls_log if c["op"] == "send"]  # one tag per direction
    events = watch.timeline.gather()
    rows = gather_rows(
        d,
        [
            [
                *watch.coords.values(),
                watch.alive,
                comm.total(op="send"),
                watch.bytes,
                tags.count(TAG["F"]),
                tags.count(TAG["B"]),
            ]
        ],
    )
    per_rank = {(int(r[0, 0]), int(r[0, 1])): [int(x) for x in r[0, 2:]] for r in rows}
    counts = [per_rank[r, 0] for r in range(p)]  # the pipeline of dp replica 0
    sent, f_msgs, b_msgs = ([c[i] for c in counts] for i in (1, 3, 4))
    figures = dict(
        split=bounds,
        pp=p,
        dp=args.dp,
        microbatches=m,
        schedule=schedule,
        sent_bytes_per_rank=sent,
        fwd_msgs_per_rank=f_msgs,
        bwd_msgs_per_rank=b_msgs,
    )
    if d.rank != 0 or not events:
        return figures
    for e in events:
        # -1: the op started from tokens, its loss or its B
        e["recv"] = None if e["recv"] < 0 else e["recv"]
    last = [e for e in events if e["step"] == events[-1]["step"] and e["dp"] == 0]
    lo, hi = min(e["start"] for e in last), max(e["end"] for e in last)
    busy = [busy_ms(last, r, lo, hi, key="pp") for r in range(p)]
    bub, idle = [(hi - lo - x) / x for x in busy], [hi - lo - x for x in busy]
    bub_theory, alive_theory, f_theory, b_theory = theory(p, m, schedule)
    op_ms = {
        k: sum(e["end"] - e["start"] for e in es) / len(es)
        for k in "FBW"
        if (es := [e for e in last if e["kind"] == k])
    }  # mean measured T_F, T_B, T_W of a chunk
    idle_theory = (p - 1) * (op_ms["F"] + op_ms["B"] - op_ms["W"])  # Table 2 of ZB; zbv: of a chunk
    b_bytes = (
        args.batch_size // (args.dp * m) * args.seq_len * args.d_model * DTYPES[args.dtype].itemsize
    )
    sent_theory = [(f + g) * b_bytes for f, g in zip(f_theory, b_theory)]
    formula = "(p-1)/(3m)" if schedule == "zbh1" else "(p-1)/(6m)"
    d.log(
        f"\nsummary ({schedule}, pp {p}, dp {args.dp}, m {m}), pipeline of dp 0: bubble = idle / "
        "busy "
        f"over the last step, theory {formula}; idle ms, theory (p-1)(T_F+T_B-T_W) at the measured "
        + ", ".join(f"T_{k} {x:.1f}" for k, x in op_ms.items())
        + " ms; alive = micro-batch chunks between "
        "F and W; bytes sent per step (b, T, D) per message; mem B: state + held, after a forward"
    )
    d.log(
        "rank | chunks | bubble | theory | idle ms | theory | alive | theory | sent B/step | "
        "theory | mem B"
    )
    for r in range(p):
        held = ",".join(str(c) for c in range(len(bounds)) if holder(c, p) == r)
        d.log(
            f"{r:4d} | {held:6s} | {bub[r]:6.3f} | {bub_theory:6.3f} | {idle[r]:7.1f} | "
            f"{idle_theory:6.1f} | {counts[r][0]:5d} | {alive_theory[r]:6d} | {sent[r]:11d} | "
            f"{sent_theory[r]:6d} | {counts[r][2]}"
        )
    mean = sum(bub) / p
    d.log(
        f"bubble, mean over ranks: measured {mean:.3f}, theory {bub_theory:.3f}, difference "
        f"{mean - bub_theory:+.3f}"
        + (
            f" (--stage-ms {args.stage_ms:g}: compute simulated, each F, B, W waits that long)"
            if args.stage_ms
            else " (real compute only: on shared cores this times the OS scheduler; try --stage-ms)"
        )
    )
    # noqa: E731
    label = lambda e: (e["kind"] if e["chunk"] < p else e["kind"].lower()) + str(e["mb"])
    d.log(
        "\ntimeline of the last step, measured (Fk Bk Wk: chunk < p, fk bk wk: the later chunks):\n"
        + draw_timeline(last, p, lo, hi, label, row_key="pp", row_name="rank")
    )
    if args.trace:
        write_trace(
            args.trace,
            events,
            lambda e: f"{e['kind']}{e['mb']} chunk {e['chunk']}",
            row_key="pp",
            row_name="rank",
        )
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return dict(
        figures,
        events=events,
        bubble=bub,
        bubble_mean=mean,
        bubble_theory=bub_theory,
        bubble_definition="idle / busy per rank over the last step (relative to ideal compute)",
        bubble_theory_formula=formula,
        stage_ms=args.stage_ms,
        idle_ms=idle,
        idle_ms_theory=idle_theory,
        op_ms=op_ms,
        peak_alive_microbatches=[c[0] for c in counts],
        peak_alive_theory=alive_theory,
        fwd_msgs_theory=f_theory,
        bwd_msgs_theory=b_theory,
        sent_bytes_theory=sent_theory,
        mem_bytes_per_rank=[c[2] for c in counts],
        counts_per_rank={
            f"pp{a} dp{b}": dict(
                zip(("alive", "sent_bytes", "mem_bytes", "fwd_msgs", "bwd_msgs"), c)
            )
            for (a, b), c in per_rank.items()
        },
    )


if __name__ == "__main__":
    main()
