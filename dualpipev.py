r"""dualpipev.py: DualPipeV, DeepSeek-V3's DualPipe folded into a V, the backward cut into B and W.

DeepSeek-AI, "DeepSeek-V3 Technical Report" (2024), Sec. 3.2.1; the schedule as
deepseek-ai/DualPipe's DualPipeV runs it. The model in 2p chunks, two per rank in a V as in ZB-V
(zero_bubble.py): rank r holds chunk r (down) and chunk 2p-1-r (back up), so rank 0 holds the
embedding and the head and the turn of the V stays on rank p-1. Its new object is the F&B slot: the
forward of one micro-batch on one chunk and the full backward (B then W) of another micro-batch on
the other chunk, run as one unit, both inputs received before it and both outputs sent after it. In
DeepSeek-V3 the pair overlaps the forward's MoE all-to-all with the backward's compute and back (a
model hook, overlapped_forward_backward); this dense GPT has no all-to-all, so here the pair runs F
then B then W, as torch's ScheduleDualPipeV does without a custom OVERLAP_F_B. Backward is split as
in Zero Bubble (Qi et al. 2024): B, the input's gradient, which the chunk before waits for; W, the
weights' gradient, which nobody waits for, deferred where a rank would otherwise idle.

    DualPipeV, p = 3, m = 6 (F, B, W one slot each; capitals: down the V, lower case: back up;
    \____/ an F&B slot)                                                                      time ->
    rank 0  F0F1F2F3F4f0b0w0f1b1w1f2F5b2w2....f3B0W0b3w3..f4B1W1b4w4..f5B2W2b5w5B3W3B4W4B5W5
                                    \____/    \____/      \____/      \____/
    rank 1  ..F0F1F2f0F3f1b0w0f2F4b1w1..f3B0W0F5b2w2f4B1W1b3w3..f5B2W2b4w4B3W3..b5B4w5B5W4W5
                                \____/  \____/\____/\____/      \____/
    rank 2  ....F0f0F1f1F2f2F3b0w0f3B0W0F4b1w1f4B1W1F5b2w2f5B2W2b3w3B3W3..b4w4B4..b5B5W4w5W5
                                  \____/\____/\____/\____/\____/
The schedule, generated for any p >= 2 and m >= 2p (dualpipev() below; equal to torch's
ScheduleDualPipeV):
1. warm-up: 2(p-r-1) F down; r+1 times F down, F up; p-r-1 times B up, W (the oldest held), F up
2. steady: m-2p+r+1 times the two F&B slots F down & B up, F up & B down (rank p-1's first pair
   split)
3. cool-down: p-r-1 times B up, F up & B down; r+1 times B up, B down, their W's held from the
   middle on;
   p-r-1 times W, B down; then the W's left
DeepSeek-V3's Table 2 (per rank, PP = 2p stages in all, F&B the time of an F&B slot, B a full
backward): bubble (PP/2-1)(F&B+B-3W), p-1 times (T_F+2T_B-T_W) here, where the pair runs
unoverlapped, = 2(p-1) slots of 6m at one slot per F, B, W: bubble (p-1)/(3m), ZB-H1's (ZB-V:
(p-1)/(6m)): the gain of DualPipeV is the hidden all-to-all, not the bubble. Activations PP+1 = 2p+1
chunk micro-batches alive (F to W) per rank, one more than ZB-V; parameters per rank 2x a stage of
the 2p (the table's 2x): as 1F1B over p ranks, where the two-way DualPipe holds every stage twice.
m(2 - [r = 0] - [r = p-1]) messages each way. Synchronous: every step drains before one optimizer
step, so --check compares with one-process training. Data parallel outermost (--dp): each replica
runs its pipeline on its slice of the batch, then one gradient all-reduce per step.

Messages: every activation and gradient is one tensor in a batch_isend_irecv, posted by both ranks
at the moment of the ideal timeline its slot ends (comm_plan()), so that no batch waits on a later
one (NCCL deadlocks otherwise; the tests simulate it). Measured from outside, each beside its
theory: the bubble, micro-batches alive, bytes held and sent; an ASCII timeline.

Run (one process per rank of the V; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 dualpipev.py --n-layers 8 --microbatches 8 --stage-ms 30 --steps 3
    torchrun --nproc_per_node=4 dualpipev.py --pp 2 --dp 2 --dtype float64 --check
In production, use torch.distributed.pipelining.ScheduleDualPipeV (or deepseek-ai/DualPipe with the
model's overlapped_forward_backward).
"""

import collections
import contextlib
import itertools
import sys
from dataclasses import dataclass

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
    pp: int = 0  # pipeline ranks p (0 = world / dp); the model is cut in 2p chunks
    dp: int = 1  # data-parallel replicas, outermost
    microbatches: int = 4  # m: micro-batches per replica and step, at least 2p
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
        dx = dy.matmul(weight) if ctx.needs_input_grad[0] else None  # (..., in)
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

    def backward_input(self, out, grad):
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
            f"{n} chunks of {n_layers} blocks: this cuts the model into {n} chunks but "
            f"--n-layers is {n_layers}; use 1 to {n_layers} chunks, or --n-layers {n} or more"
        )
    base, extra = divmod(n_layers, n)
    return [(c * base + min(c, extra), (c + 1) * base + min(c + 1, extra)) for c in range(n)]


class Chunk(nn.Module):
    """Blocks [start, end) of the GPT (names kept); the first chunk adds the embedding, the last
    ln_f+head."""

    def __init__(self, gpt, c, bounds):
        super().__init__()
        self.first = c == 0
        self.last = c == len(bounds) - 1
        if self.first:
            self.tok_emb = gpt.tok_emb
            self.pos_emb = gpt.pos_emb
            self.drop = gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(*bounds[c])})
        if self.last:
            self.ln_f = gpt.ln_f
            self.head = gpt.head

    def forward(self, h):  # first chunk: (b, T) token ids; others: (b, T, D) from the chunk before
        if self.first:  # = GPT.embed
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


# -------------------------------------------------------------------------- DualPipeV: the schedule
def dualpipev(p, m, r):
    """Rank r's slots in order, each a list of ops (kind, chunk, micro-batch) run as one unit: [F],
    [B], [W], a full backward [B, W], an F&B slot [F, B, W]. Down is chunk r, up chunk 2p-1-r. The
    steps of deepseek-ai/DualPipe's DualPipeV (torch's ScheduleDualPipeV the same); m >= 2p."""
    if p < 2 or m < 2 * p:  # rank 0's warm-up and its first pairs need 2p micro-batches
        raise ValueError(
            f"DualPipeV at pp {p} with {m} micro-batches: it needs pp >= 2 and m >= 2p = {2 * p} "
            f"micro-batches; use --microbatches {2 * p} or more"
        )
    down = r
    up = 2 * p - 1 - r
    after = p - r - 1  # ranks after this one down the V
    slots = []
    nxt = collections.defaultdict(itertools.count)  # (kind, chunk) -> its next micro-batch
    held = []  # [W] slots of B's run alone, oldest first

    def f(c):
        return [("F", c, next(nxt["F", c]))]

    def b(c, hold=False):  # B, then its W at once (a full backward) or, held, in a later slot
        k = next(nxt["B", c])
        if hold:
            held.append([("W", c, k)])
            return [("B", c, k)]
        return [("B", c, k), ("W", c, k)]

    slots += [f(down) for _ in range(2 * after)]  # 1. warm-up
    for _ in range(r + 1):
        slots += [f(down), f(up)]
    for _ in range(after):
        slots += [b(up, hold=True), held.pop(0), f(up)]
    for i in range(m - 2 * p + r + 1):  # 2. steady: F&B slots
        if i == 0 and r == p - 1:  # not paired, to shorten the bubble (DeepSeek's DualPipeV)
            slots += [f(down), b(up)]
        else:
            slots.append(f(down) + b(up))
        slots.append(f(up) + b(down))
    for _ in range(after):  # 3. cool-down
        slots += [b(up), f(up) + b(down)]
    half = (r + 1) // 2  # from the middle on, W's are held to fill the drain (odd r: from B up)
    for i in range(r + 1):
        slots += [b(up, hold=i >= half + (r % 2 == 0)), b(down, hold=i >= half)]
    for _ in range(after):
        slots += [held.pop(0), b(down, hold=True)]
    return slots + held  # the W's still held


def holder(c, p):  # the pp rank holding chunk c of 2p: the V
    return min(c, 2 * p - 1 - c)


# ------------------------------------------------------------------------- messages, placed in time
def waits_for(op, n):
    """The ops that op (kind, c, k), on one of n chunks, waits for: F the F of chunk c-1 (chunk 0
    reads tokens); B its own F and the B of chunk c+1 (chunk n-1 starts from its loss); W its B. One
    run on another rank is a message, named by the op that reads it: an activation (F) or a
    gradient (B) for chunk c."""
    kind, c, k = op
    if kind == "F":
        return [("F", c - 1, k)] if c > 0 else []
    if kind == "B":
        return [("F", c, k)] + ([("B", c + 1, k)] if c < n - 1 else [])
    return [("B", c, k)]


def ideal_timeline(orders, n):
    """Every rank's slots (orders[r], n chunks in all) at their earliest start when F, B, W take one
    time unit each, a slot the sum of its ops, and messages are free: {op: (rank, slot start, slot
    end)}. A slot starts once all it waits for from outside it is done. Its idle units are the
    schedule's bubble."""
    at = {}
    left = [collections.deque(order) for order in orders]  # each rank's slots still to place
    free = [0] * len(orders)  # when each rank's last placed slot ends
    while any(left):
        moved = False
        for r, todo in enumerate(left):
            while todo:
                slot = todo[0]
                deps = [dep for op in slot for dep in waits_for(op, n) if dep not in slot]
                if any(dep not in at for dep in deps):
                    break
                start = max([free[r]] + [at[dep][2] for dep in deps])
                free[r] = start + len(slot)
                at.update((o, (r, start, free[r])) for o in slot)
                todo.popleft()
                moved = True
        if not moved:
            raise ValueError(
                "the schedule waits on itself: give every rank's slots of one schedule, in order"
            )
    return at


def comm_plan(orders, n, r):
    """Rank r's steps for one batch: ("slot", ops) and ("p2p", sends, recvs) with [(peer pp rank,
    message)]. Each message travels at the moment G of the ideal timeline that the slot making it
    ends. Both ranks post it in their batch of G, after every slot that starts before G, so all post
    batches in order of G, none waiting for a later one: no cycle (NCCL deadlocks on a send whose
    receive is posted behind a wait on the sender). Both sides list a batch's messages in the same
    order: they walk the same timeline. (zero_bubble.py waits for a moment both ranks are between
    ops: fewer batches, more code.)"""
    at = ideal_timeline(orders, n)
    sends = collections.defaultdict(list)  # moment -> [(pp rank, message)]
    recvs = collections.defaultdict(list)
    for op, (dst, _, _) in at.items():
        # a message: what op waits for, made on another rank (the V's turn stays on rank p-1)
        for src, _, when in [at[dep] for dep in waits_for(op, n) if at[dep][0] != dst]:
            if src == r:
                sends[when].append((dst, op))
            if dst == r:
                recvs[when].append((src, op))
    steps = [((at[slot[0]][1], 1), ("slot", slot)) for slot in orders[r]]
    steps += [((when, 0), ("p2p", sends[when], recvs[when])) for when in {*sends, *recvs}]
    # keys are distinct: a rank's slots start at distinct moments, one batch per moment, batches
    # first
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
             it.
    Every activation and gradient waits in one box, keyed by the op that reads it (kind, chunk, mb):
    for a chunk here, made here (the V's turn) or received; for a chunk of another rank, to be sent
    by the plan's next batch."""

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
        self.box = {}
        self.alive = {}
        self.waiting = {}
        # pp ranks
        peers = {q for step, *what in plan if step == "p2p" for q, _ in what[0] + what[1]}
        if dist.get_rank(group) < 0 or not peers <= set(range(dist.get_world_size(group))):
            raise ValueError(
                f"the plan's peers {sorted(peers)} are not in the group: plan for p = its size"
            )
        # micro-batches the plan runs
        self.m = 1 + max(op[2] for step, slot, *_ in plan if step == "slot" for op in slot)

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
            for kind, c, k in what[0]:  # a slot: its ops in turn (an F&B slot: F, B, W)
                with self.observe(kind, k, chunk=c):
                    if kind == "F":
                        self.forward(c, k, inputs, targets, loss_fn)
                    elif kind == "B":
                        self.backward(c, k)
                    else:  # W: the weight gradients its B left
                        self.split.backward_weight(self.waiting.pop((c, k)))
        return self.loss

    def exchange(self, sends, recvs):
        """One batch_isend_irecv: sends [(pp rank, message)] out of the box, receives into it."""
        ops = [(dist.isend, self.box.pop(msg).contiguous(), q, msg) for q, msg in sends]
        for q, msg in recvs:
            self.box[msg] = torch.empty(self.msg_shape, dtype=self.dtype, device=self.device)
            ops.append((dist.irecv, self.box[msg], q, msg))
        p2p = [
            dist.P2POp(op, t, group=self.group, group_peer=q, tag=TAG[msg[0]])  # q: a pp rank
            for op, t, q, msg in ops
        ]
        # never empty: comm_plan makes a batch only for a message
        for req in dist.batch_isend_irecv(p2p):
            req.wait()

    def forward(self, c, k, inputs, targets, loss_fn):
        # (b, T) ids or (b, T, D)
        inp = inputs[k] if c == 0 else self.box.pop(("F", c, k)).requires_grad_()
        out = self.chunks[c](inp)  # (b, T, D); last chunk: logits (b, T, V) ...
        if c == self.n - 1:
            out = loss_fn(out, targets[k])  # ... and its loss
            self.loss += out.detach()
        else:
            self.box["F", c + 1, k] = out.detach()  # (b, T, D) to chunk c+1
        self.alive[c, k] = inp, out

    # B: the input's gradient now; the Linears' weight gradients wait for W
    def backward(self, c, k):
        inp, out = self.alive.pop((c, k))
        grad = None if c == self.n - 1 else self.box.pop(("B", c, k))  # last chunk: from its loss
        self.waiting[c, k] = self.split.backward_input(out, grad)
        if c > 0:
            self.box["B", c - 1, k] = inp.grad  # (b, T, D) to chunk c-1


# -------------------------------------------------------------------- after the flush: DP, clipping
def finish_batch(params, loss, dp_group, group, max_norm):
    """1. Data parallel: every gradient summed over the replicas in one all-reduce (micro-batch
    losses are divided by the global token count: the sum is the batch's gradient). 2. The squared
    norm and the loss in one all-reduce over `group`, all pipelines (norm from dp rank 0). 3. Clip
    (0: none). -> (loss, norm)"""
    if dist.get_world_size(dp_group) > 1:
        flat = torch.cat([q.grad.flatten() for q in params])  # (this rank's elements,)
        dist.all_reduce(flat, group=dp_group)
        for q, part in zip(params, flat.split([q.numel() for q in params])):
            q.grad.copy_(part.view_as(q))
    acc = torch.promote_types(params[0].dtype, torch.float32)
    # this rank's squared norm, summed in float64 (norms in float32 at least)
    sq = sum(torch.linalg.vector_norm(q.grad, dtype=acc).double() ** 2 for q in params)
    # (2,) pieces
    total = torch.stack([loss, sq if dist.get_rank(dp_group) == 0 else torch.zeros_like(sq)])
    dist.all_reduce(total, group=group)  # (2,) the batch loss, the whole model's squared norm
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total[1].sqrt())
    return total[0].item(), total[1].sqrt().item()


# ---------------------------------------------------------------------------- argument checks, main
def check_args(args):
    world = env_world_size()
    check_common_args(args)
    if args.dp < 1:
        fail(f"--dp must be >= 1, got {args.dp}")
    p = args.pp or world // args.dp
    if args.pp < 0 or p * args.dp != world:
        fail(
            f"world size {world} != pp {args.pp or '(world / dp)'} x dp {args.dp}: launch torchrun "
            f"--nproc_per_node={max(p, 2) * args.dp} or change --pp / --dp"
        )
    if p < 2:
        fail(
            "dualpipev.py needs one process per rank of the V, at least 2: torchrun "
            f"--nproc_per_node={2 * args.dp} dualpipev.py {' '.join(sys.argv[1:])}".rstrip()
        )
    try:  # the cores' own checks, the model's cut and the schedule: their ValueError as fail's line
        split_layers(args.n_layers, 2 * p)
        dualpipev(p, args.microbatches, 0)
    except ValueError as e:
        fail(str(e))
    per = args.dp * args.microbatches
    if args.batch_size % per:
        fail(
            f"--batch-size {args.batch_size} is not divisible by dp x microbatches = {per}: use "
            f"--batch-size {(args.batch_size // per + 1) * per}"
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

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, 2 * p)
    # data parallel outermost: a pipeline is a column, grid[:, j]
    grid = torch.arange(world).view(p, dp)
    pp_rank, dp_rank = divmod(d.rank, dp)  # this rank's row and column in the grid
    # every rank makes each group
    dp_group = [dist.new_group(grid[i, :].tolist()) for i in range(p)][pp_rank]
    pp_group = [dist.new_group(grid[:, j].tolist()) for j in range(dp)][dp_rank]  # pp rank order
    d.log(
        f"dualpipev.py: pp {p} x dp {dp}, {len(bounds)} chunks in a V, m = {m} micro-batches of "
        f"{b} per replica, on {d.backend}; entropy floor {data.entropy:.4f} nats/token"
    )
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per rank
    dtype = DTYPES[args.dtype]
    # whole, on CPU; a rank takes its two chunks
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    mine = {c: Chunk(gpt, c, bounds) for c in range(2 * p) if holder(c, p) == pp_rank}
    # one module of them both, for the optimizer, the checkpoint and the names; moved in place
    chunks = nn.ModuleDict({str(c): chunk for c, chunk in mine.items()}).to(d.device)
    del gpt
    # every Linear of this rank's chunks defers its weight gradient to W
    split = SplitBackward(chunks)
    params = list(chunks.parameters())
    opt = make_optimizer(params, args)
    run = Run(d, args, {"model": chunks, "optim": opt})
    plan = comm_plan([dualpipev(p, m, r) for r in range(p)], 2 * p, pp_rank)
    # NCCL sets up a group's communicator at its first collective; batched point-to-point must not
    # come first
    dist.all_reduce(torch.zeros(1, device=d.device), group=pp_group)
    watch = Watch(d, args, (pp_rank, dp_rank), chunks, opt)
    runner = PipelineRank(
        mine,
        2 * p,
        plan,
        split,
        pp_group,
        (b, args.seq_len, args.d_model),
        dtype,
        d.device,
        observe=watch,
    )
    watch.runner = runner
    for step in run.steps():
        # (B, T) global batch, CPU
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok = count_tokens(y)  # the whole global batch's: every micro-batch loss divides by it
        # (m, b, T) each: this replica's rows, cut into micro-batches
        mbs = [
            rearrange(z, "(dp m b) t -> dp m b t", dp=dp, m=m)[dp_rank].to(d.device) for z in (x, y)
        ]
        # its events tagged with the step; the sends counted in the step before last
        with watch.watching(run, step):
            loss = runner.run(*mbs, lambda logits, tgt: lm_loss(logits, tgt, n_tok))
            loss, _ = finish_batch(params, loss, dp_group, dist.group.WORLD, args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        run.end_step(step, loss)

    # the summary, then --check
    summarize(d, args, p, run, watch, bounds, chunks)


# --- measurement --- (from outside the schedule: its observe callback, the counter, the report)
class Watch(PipelineWatch):
    """harness.PipelineWatch (--stage-ms: each F, B, W waits that), tagged with the step, the rank's
    grid coordinates and when its input arrived, reading the runner's attributes as each op begins:
    micro-batch chunks alive (F to W); after a forward, the bytes alive: what forwards saved for
    backward, the inputs and outputs held to B, what B left for W, and the state."""

    def __init__(self, d, args, coords, model, opt):
        ms = args.stage_ms
        pp, dp = coords
        super().__init__(
            d, dict(F=ms, B=ms, W=ms), ("chunk", "step", "pp", "dp", "recv"), dict(pp=pp, dp=dp)
        )
        self.runner = None
        self.state = lambda: state_bytes(model, opt)  # parameters, gradients, optimizer state
        self.comm = CommCounter(log=True)  # sends, at the dispatcher

    def before(self, kind, mb):
        r = self.runner
        self.alive = max(self.alive, len(set(r.alive) | set(r.waiting)))
        if self.last == "F":  # activations peak after a forward
            held = [t for a in r.alive.values() for t in a]  # inputs and outputs until B
            held += [
                t for w in r.waiting.values() for _, x, dy in w for t in (x, dy)
            ]  # what W needs
            self.bytes = max(self.bytes, self.live.alive(*held) + self.state())

    def watching(self, run, step):
        """Around one step's work: its events tagged with the step; the sends counted in the step
        before last only (counting slows ops; the last step's bubble is reported)."""
        self.step = step
        return run.watching(step, self.comm, at=max(run.start, run.args.steps - 2))


def theory(p, m):
    """Per pp rank, DeepSeek-V3's Table 2 for DualPipeV at PP = 2p stages, one slot per F, B, W (the
    F&B slot unoverlapped: F&B = 3, a full backward B = 2, W = 1): idle (PP/2-1)(F&B+B-3W) = 2(p-1)
    slots of 6m, bubble (p-1)/(3m); activations PP+1 = 2p+1 chunk micro-batches alive (F to W);
    messages each way m(2 - [r = 0] - [r = p-1]) (the V's turn is local)."""
    msgs = [m * (2 - (r == 0) - (r == p - 1)) for r in range(p)]
    return (p - 1) / (3 * m), [2 * p + 1] * p, msgs, msgs


def summarize(d, args, p, run, watch, bounds, chunks):
    """The report, the peak (counted; CUDA's own on a GPU), then --check: the full model, by name,
    from the chunks of dp replica 0 (one all-reduce)."""
    figures = report(d, args, p, watch, bounds)
    peak = peak_memory_bytes(d, watch.bytes)
    check = None
    if args.check:
        with torch.device("meta"):  # the names and shapes of the whole GPT, no storage
            shapes = {n: q.shape for n, q in GPT(GPTConfig.from_args(args)).named_parameters()}
        owned = {}
        if watch.coords["dp"] == 0:
            owned = {n.split(".", 1)[1]: q for n, q in chunks.named_parameters()}
        full = assemble_full(d, owned, shapes, DTYPES[args.dtype])
        check = check_against_reference(d, args, run.losses, full)
    run.finish("dualpipev", peak, max(figures.get("sent_bytes_per_rank", [0])), check, figures)


def report(d, args, p, watch, bounds):
    """Every rank's events and counts, gathered (tensors only); rank 0: each figure beside its
    theory, the table, the timeline of the last step of pipeline 0, --trace."""
    m = args.microbatches
    comm = watch.comm
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
        schedule="dualpipev",
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
    bub_theory, alive_theory, f_theory, b_theory = theory(p, m)
    op_ms = {
        k: sum(e["end"] - e["start"] for e in es) / len(es)
        for k in "FBW"
        if (es := [e for e in last if e["kind"] == k])
    }  # mean measured T_F, T_B, T_W of a chunk
    # DeepSeek-V3's Table 2: (PP/2-1)(F&B+B-3W), F&B = T_F+T_B+T_W unoverlapped, B = T_B+T_W
    idle_theory = (p - 1) * (op_ms["F"] + 2 * op_ms["B"] - op_ms["W"])
    b_bytes = (
        args.batch_size // (args.dp * m) * args.seq_len * args.d_model * DTYPES[args.dtype].itemsize
    )
    sent_theory = [(f + g) * b_bytes for f, g in zip(f_theory, b_theory)]
    formula = "(p-1)/(3m)"
    d.log(
        f"\nsummary (dualpipev, pp {p}, dp {args.dp}, m {m}), pipeline of dp 0: bubble = idle / "
        "busy "
        f"over the last step, theory {formula}; idle ms, theory (p-1)(T_F+2T_B-T_W) at the "
        "measured "
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
