"""ptdp.py: PTD-P, pipeline x tensor x data parallelism with the interleaved 1F1B schedule.

Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC 2021).
Three ways to split one GPT, composed on one grid of ranks:

    grid = torch.arange(world).view(pp, dp, tp)     e.g. pp 2 x dp 2 x tp 2 = 8 ranks:
                    tp 0  tp 1
      pp 0   dp 0 [   0     1  ]   chunks 0 and 2 (v = 2): embedding + blocks 0, 2; ...
             dp 1 [   2     3  ]
      pp 1   dp 0 [   4     5  ]   chunks 1 and 3: ... blocks 1, 3 + final norm + head + loss
             dp 1 [   6     7  ]
    a TP group is a row, grid[i, j, :]  adjacent ranks, one node: two all-reduces per layer and pass
    a DP group is grid[i, :, k]         the same shard of the same chunks: one gradient all-reduce per batch
    a pipeline is grid[:, j, k]         point-to-point activations forward, gradients backward

1. Tensor parallel (Megatron-LM, Shoeybi et al. 2019, Sec. 3), innermost, so a TP group sits inside a node
   where links are fastest (the PTD-P paper's Takeaway #1): q, k, v and the MLP's fc are split by output
   features (column-parallel; rank k owns heads k*H/t .. (k+1)*H/t - 1), both output projections by input
   features (row-parallel). f (identity forward, all-reduce backward) opens each split region and g
   (all-reduce forward, identity backward) closes it. LayerNorms, the row-parallel biases, the embedding and
   the head are replicated over the TP group (the head computes all logits on every TP rank: simple, and the
   vocabulary is small here; megatron_tp.py shows the vocab-parallel version).
2. Pipeline parallel: the n_layers blocks are cut into p*v chunks of equal size. Rank i of a pipeline holds
   the v non-contiguous chunks i, i+p, i+2p, ... (the paper's "virtual stages"), so a micro-batch
   visits every rank v times and the bubble shrinks v-fold: (p-1)/(v*m) of the ideal compute time. The
   schedule is Megatron's interleaved 1F1B: warm-up forwards, then one forward and one backward in turn, then
   the cool-down backwards, then a flush. With v = 1 it is plain 1F1B (PipeDream-flush). Forwards run in
   groups of p micro-batches per chunk, so like Megatron we require m to be a multiple of p when v > 1.
   Picture, p = 2, v = 2, m = 4 (capitals: a rank's first chunk, lower case: its second; B takes twice F's
   time; idle ".."), the ideal timeline that ideal_timeline() computes (the run draws the measured one):

      rank 0  F0F1f0f1F2..b0b0F3b1b1f2B0B0f3B1B1..b2b2..b3b3B2B2B3B3      idle 3 slots per 24 busy
      rank 1  ..F0F1f0b0b0f1b1b1F2B0B0F3B1B1f2b2b2f3b3b3B2B2B3B3....      = (p-1)/(v*m) = 1/8
    v = 1, the same work per micro-batch (a rank's one chunk holds both layers: F two slots, B four):
      rank 0  F0F0F1F1........B0B0B0B0F2F2B1B1B1B1F3F3B2B2B2B2....B3B3B3B3  idle 6 per 24 busy
      rank 1  ....F0F0B0B0B0B0F1F1B1B1B1B1F2F2B2B2B2B2F3F3B3B3B3B3........  = (p-1)/m = 1/4
   The price: (v*p-1)*m messages per direction instead of (p-1)*m, and more chunks in flight on early ranks.
3. Data parallel outermost: each of the dp replicas runs its pipelines on its own slice of the global batch
   and, after the flush, all-reduces the summed micro-batch gradients once per batch. Then the gradients are
   clipped by the norm of the whole model, over all three axes: TP-split pieces are disjoint (each counted
   where it lives), TP-replicated tensors are counted once (on TP rank 0), the pp ranks hold disjoint chunks,
   and the dp replicas identical copies (counted on dp rank 0): one all-reduce of two numbers over the world,
   which also sums the loss.

Messages: each activation and gradient is one tensor in a batch_isend_irecv. comm_plan() gives each one moment
of the ideal timeline at which both its ranks post it, so every rank posts its batches in one global order and
no batch waits on a later one (NCCL deadlocks otherwise; the tests simulate that). Measured: every F and B
(start, end, when its input arrived); the bubble beside (p-1)/(v*m); chunks in flight beside the schedule's
bound; messages and bytes counted at the send beside theory ((v*p-1)*m forward messages per batch and
pipeline); TP and DP collectives counted; an ASCII timeline; --trace PATH (Chrome trace JSON). --stage-ms F
simulates compute time: each chunk's forward also waits F/v ms and its backward 2F/v ms, so a rank does 3F ms
of simulated work per micro-batch whatever v (the paper's comparison: same work, v-fold smaller bubble); the
numbers computed are unchanged.

Run (2 processes at least: a pipeline of 2; --dp 0 = world / (pp * tp)):
    torchrun --nproc_per_node=2 ptdp.py --pp 2 --virtual-stages 2 --dtype float64 --check
    torchrun --nproc_per_node=8 ptdp.py --pp 2 --tp 2 --dp 2 --virtual-stages 2 --dtype float64 --check
    torchrun --nproc_per_node=4 ptdp.py --pp 4 --n-layers 8 --microbatches 8 --virtual-stages 2 --stage-ms 50 --steps 2
2 nodes x 8 GPUs: torchrun --nnodes=2 --nproc_per_node=8 ... ptdp.py --tp 8 --pp 2 (tp inside a node, where
NVLink carries its per-layer all-reduces; only point-to-point activations cross the slower inter-node links).
In production, use Megatron-Core, or torch.distributed.pipelining (ScheduleInterleaved1F1B) with DTensor TP.
"""
import collections
import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData)
from harness import (assemble_full, check_against_reference, check_common_args, Checkpointer, CommonArgs,
                     env_world_size, gather_rows, log_step, maybe_fail, parse_args, peak_memory_bytes,
                     SavedActivations, state_bytes, StepTimer, write_summary)


@dataclass
class Args(CommonArgs):
    pp: int = 2  # pipeline-parallel degree p (ranks per pipeline)
    tp: int = 1  # tensor-parallel degree t (innermost: adjacent ranks)
    dp: int = 0  # data-parallel degree (0 = world / (pp * tp))
    virtual_stages: int = 1  # v: model chunks per pipeline rank (1 = plain 1F1B)
    microbatches: int = 4  # m: micro-batches per replica and batch (a multiple of --pp when v > 1)
    trace: str = ""  # write the measured F/B events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute time: each chunk's F also waits stage_ms/v ms, its B 2*stage_ms/v


# ----------------------------------------------------------------------------- tensor parallel: f, g, the layers
COUNT = collections.Counter()  # what this rank hands to collectives and sends (see the measurement section)


def all_reduce(x, group, key):
    if dist.get_world_size(group) > 1:  # a group of one (t = 1, dp = 1): nothing to do
        COUNT[key + "_calls"] += 1
        COUNT[key + "_bytes"] += x.numel() * x.element_size()
        dist.all_reduce(x, group=group)
    return x


class f(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce backward. It opens a TP region: every rank multiplies the
    same X by its own shard, so each rank's dL/dX is a partial sum, completed here."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # (b, T, D) partial -> summed over the TP group
        return all_reduce(grad.clone(), ctx.group, "tp"), None


class g(torch.autograd.Function):
    """Megatron's g: all-reduce forward (sum the row-parallel partial products), identity backward."""

    @staticmethod
    def forward(ctx, x, group):  # (b, T, D) partial -> summed, replicated
        return all_reduce(x.clone(), group, "tp")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def tp_dim(name):
    """The dimension of GPT parameter `name` split over the TP group (None: replicated). Column-parallel
    weights (out, in) split dim 0, with their biases; row-parallel weights split dim 1, their bias is whole."""
    if name.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight", "mlp.fc.bias")):
        return 0
    return 1 if name.endswith(("attn.proj.weight", "mlp.proj.weight")) else None


class TPBlock(nn.Module):
    """common.Block with Megatron's split, keeping its parameter names; its own forward: f, local matmuls, g.

        q, k, v, fc  (out, in) = [W_0; W_1; ..]  rows: rank k computes its heads / its 4D/t hidden features
        proj         (out, in) = [W_0 | W_1 ..]  columns: rank k's partial product; g sums, then the bias
    """

    def __init__(self, full, group):
        super().__init__()
        t, r = dist.get_world_size(group), dist.get_rank(group)
        self.ln1, self.attn, self.ln2, self.mlp = full.ln1, full.attn, full.ln2, full.mlp
        for name, w in list(self.named_parameters()):
            if tp_dim(name) is not None:
                owner, leaf = name.rsplit(".", 1)
                setattr(self.get_submodule(owner), leaf, nn.Parameter(w.detach().chunk(t, tp_dim(name))[r].clone()))
        self.group, self.heads = group, full.attn.n_heads // t

    def forward(self, x):  # (b, T, D) replicated on the TP group
        a, mlp, grp = self.attn, self.mlp, self.group
        h = f.apply(self.ln1(x), grp)
        q, k, v = (rearrange(F.linear(h, lin.weight), "b t (h e) -> b h t e", h=self.heads)
                   for lin in (a.q, a.k, a.v))  # (b, H/t, T, E) each: this rank's heads
        y = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True), "b h t e -> b t (h e)")  # (b, T, D/t)
        x = x + g.apply(F.linear(y, a.proj.weight), grp) + a.proj.bias  # bias after g: added once, not t times
        h = F.gelu(F.linear(f.apply(self.ln2(x), grp), mlp.fc.weight, mlp.fc.bias))  # (b, T, 4D/t) local
        return x + g.apply(F.linear(h, mlp.proj.weight), grp) + mlp.proj.bias  # (b, T, D) replicated


class Chunk(nn.Module):
    """Model chunk c of n: blocks [c*L/n, (c+1)*L/n), plus the embedding on chunk 0 and ln_f + head on chunk
    n-1. Parameter names are common.GPT's, so the chunks together name the whole GPT."""

    def __init__(self, full, c, n, group):
        super().__init__()
        per, self.first, self.last = full.cfg.n_layers // n, c == 0, c == n - 1
        if self.first:
            self.tok_emb, self.pos_emb = full.tok_emb, full.pos_emb
        self.blocks = nn.ModuleDict({str(i): TPBlock(full.blocks[i], group) for i in range(c * per, (c + 1) * per)})
        if self.last:
            self.ln_f, self.head = full.ln_f, full.head

    def forward(self, h):  # chunk 0: (b, T) token ids; others: (b, T, D) from the chunk before
        if self.first:
            h = self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device))
        for block in self.blocks.values():
            h = block(h)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


# ----------------------------------------------------------------------------- the interleaved 1F1B schedule
def warmup(p, v, m, r):
    """Forwards pipeline rank r runs before its first backward. v = 1: plain 1F1B fills the p-r-1 ranks after
    it. v > 1 (Megatron's interleaved schedule): (v-1)*p to get the first micro-batch group through the rank's
    earlier chunks, plus 2 per rank downstream, so that neighbours alternate F and B in step."""
    return min(p - r - 1, m) if v == 1 else min(2 * (p - r - 1) + (v - 1) * p, v * m)


def schedule(p, v, m, r):
    """Rank r's ops in order: (kind, chunk, micro-batch), chunk = global index l*p + r of local chunk l. The
    k-th forward runs micro-batch (k // pv)*p + k % p on local chunk (k % pv) // p: groups of p micro-batches
    sweep the rank's chunks in order; backwards sweep them in reverse."""
    def fwd(k):
        return ((k % (p * v)) // p) * p + r, (k // (p * v)) * p + k % p

    def bwd(k):
        c, mb = fwd(k)
        return (v - 1 - c // p) * p + r, mb
    w, n = warmup(p, v, m, r), v * m
    ops = [("F", *fwd(k)) for k in range(w)]
    for i in range(n - w):
        ops += [("F", *fwd(w + i)), ("B", *bwd(i))]
    return ops + [("B", *bwd(i)) for i in range(n - w, n)]


def needs(op, n):
    """The message op (kind, c, k) waits for: ("F", c, k) = its input activation, from chunk c-1; ("B", c, k)
    = the gradient of its output, from chunk c+1; None when it starts from tokens (chunk 0's F) or from its
    own loss (the last chunk's B)."""
    kind, c, _ = op
    return None if (kind, c) in (("F", 0), ("B", n - 1)) else op


def producer(msg):
    kind, c, k = msg
    return ("F", c - 1, k) if kind == "F" else ("B", c + 1, k)


def ideal_timeline(p, v, m, f_slots=1, b_slots=2):
    """Every rank's ops at their earliest start when each takes f_slots (F) or b_slots (B) and messages are
    free: {op: (rank, start, end)}. Its idle slots are the schedule's bubble, (p-1)*(f_slots+b_slots)."""
    ops, n, at = [schedule(p, v, m, r) for r in range(p)], p * v, {}
    nxt, free = [0] * p, [0] * p
    while any(nxt[r] < len(ops[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(ops[r]):
                op = ops[r][nxt[r]]
                deps = [producer(op)] if needs(op, n) else []
                deps += [("F", op[1], op[2])] if op[0] == "B" else []
                if any(dep not in at for dep in deps):
                    break
                start = max([free[r]] + [at[dep][2] for dep in deps])
                free[r] = start + (f_slots if op[0] == "F" else b_slots)
                at[op], nxt[r], moved = (r, start, free[r]), nxt[r] + 1, True
        if not moved:
            raise RuntimeError(f"schedule ({p}, {v}, {m}) waits on itself")
    return at


def comm_plan(p, v, m, r):
    """Rank r's steps for one batch: ("op", op) and ("p2p", sends, recvs) with [(peer pp rank, message)].
    Each message travels at one moment G of the ideal timeline, between the end of the op that makes it and
    the start of the op that uses it: the first such moment at which both ranks are between ops (else right
    after it is made, when the sender is). Both post it in their batch of G, which comes after their ops that
    start before G and before those that start at or after it. All ranks thus post their batches in order of
    G and a batch's partners are batches of the same G: none can wait for a later one, so no cycle (NCCL
    deadlocks on a send whose receive is posted behind a wait on the sender). Within a batch, messages are
    sorted the same way on both sides: per pair of ranks, one FIFO order."""
    at, n, items = ideal_timeline(p, v, m), p * v, collections.defaultdict(lambda: ([], []))
    spans = collections.defaultdict(list)  # pp rank -> (start, end) of its ops
    for q, start, end in at.values():
        spans[q].append((start, end))
    for msg in (needs(op, n) for op in at):
        if msg is not None:
            (src, _, made), (dst, used, _) = at[producer(msg)], at[msg]
            edges = {x for q in (src, dst) for span in spans[q] for x in span if made <= x <= used}
            times = sorted(edges | {made, used})
            between = [x for x in times if all(not a < x < z for q in (src, dst) for a, z in spans[q])]
            when = between[0] if between else made
            if src == r:
                items[when][0].append((dst, msg))
            if dst == r:
                items[when][1].append((src, msg))
    steps = [((at[op][1], 1), ("op", op)) for op in schedule(p, v, m, r)]
    steps += [((when, 0), ("p2p", sorted(s), sorted(rv))) for when, (s, rv) in items.items()]
    return [step for _, step in sorted(steps, key=lambda x: x[0])]


def p2p(sends, recvs):
    """One batch_isend_irecv of [(tensor, global peer)] sends and receives, then wait."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


class PipelineRank:
    """One rank's part of one pipeline: its v chunks, the plan, and what lives between ops."""

    def __init__(self, d, args, chunks, coords, peers, act_shape, clock):
        self.d, self.args, self.chunks, self.peers, self.clock = d, args, chunks, peers, clock
        self.act_shape = act_shape  # (b, T, D): every message, activation or gradient
        self.pp_rank, self.dp_rank, self.tp_rank = coords
        self.p, self.v, self.m = args.pp, args.virtual_stages, args.microbatches
        self.n, self.dtype = self.p * self.v, next(chunks.parameters()).dtype
        self.plan = comm_plan(self.p, self.v, self.m, self.pp_rank)
        self.inbox, self.outbox, self.arrived, self.alive = {}, {}, {}, {}
        self.events, self.peak_inflight, self.peak_act_bytes = [], 0, 0

    def run(self, step, tokens, targets, n_tok):
        """One batch: the plan's ops and messages, then the pipeline is empty. Returns the summed loss of the
        micro-batches whose last chunk lives here (a tensor; zero elsewhere)."""
        self.loss = torch.zeros((), dtype=torch.float64, device=self.d.device)
        for kind, *what in self.plan:
            if kind == "p2p":
                self.exchange(*what)
            elif what[0][0] == "F":
                self.forward(step, *what[0][1:], tokens, targets, n_tok)
            else:
                self.backward(step, *what[0][1:])
        return self.loss

    def exchange(self, sends, recvs):
        out = [(self.outbox.pop(msg).contiguous(), self.peers[q]) for q, msg in sends]
        into = [(torch.empty(self.act_shape, dtype=self.dtype, device=self.d.device), self.peers[q]) for q, _ in recvs]
        p2p(out, into)
        stamp = self.clock.stamp()
        for (_, msg), (t, _) in zip(recvs, into):
            self.inbox[msg], self.arrived[msg] = t, stamp
        count_sent(out, [msg for _, msg in sends])

    def forward(self, step, c, k, tokens, targets, n_tok):
        chunk = self.chunks[c // self.p]
        inp = tokens[k] if c == 0 else self.inbox.pop(("F", c, k)).requires_grad_()  # (b, T) ids or (b, T, D)
        start = self.clock.stamp()
        with SavedActivations() as saved:
            out = chunk(inp)  # (b, T, D); last chunk: logits (b, T, V) ...
            if chunk.last:
                out = lm_loss(out, targets[k], n_tok)  # ... and the loss: sum over tokens / global token count
        simulate_compute(self.args.stage_ms / self.v)
        self.record(step, "F", c, k, start)
        if chunk.last:
            self.loss += out.detach()
        else:
            self.outbox["F", c + 1, k] = out.detach()  # (b, T, D) to chunk c+1, on pp rank (c+1) % p
        self.alive[c, k] = (inp, out, saved.bytes + out.numel() * out.element_size())
        self.peak_inflight = max(self.peak_inflight, len(self.alive))
        self.peak_act_bytes = max(self.peak_act_bytes, sum(a[2] for a in self.alive.values()))

    def backward(self, step, c, k):
        inp, out, _ = self.alive.pop((c, k))
        start = self.clock.stamp()
        torch.autograd.backward(out, None if c == self.n - 1 else self.inbox.pop(("B", c, k)))  # grads accumulate
        simulate_compute(2 * self.args.stage_ms / self.v)
        self.record(step, "B", c, k, start)
        if c > 0:
            self.outbox["B", c - 1, k] = inp.grad  # (b, T, D) to chunk c-1, on pp rank (c-1) % p

    def record(self, step, kind, c, k, start):
        arrived = self.arrived.pop((kind, c, k), None)
        self.events.append([step, self.pp_rank, self.dp_rank, self.tp_rank, kind == "B", c, k, start,
                            self.clock.stamp(), arrived])


def squared_norm_piece(params, tp_rank):
    """This rank's share of the whole model's squared gradient norm: its TP shards always, the tensors every
    TP rank holds a copy of (LayerNorms, row-parallel biases, embedding, head) on TP rank 0 only."""
    return sum((q.grad.double() ** 2).sum() for q in params if q.tp_split or tp_rank == 0)


def finish_batch(d, args, chunks, loss, coords, dp_group):
    """After the flush: 1. one all-reduce of all gradients over the DP group (each replica's loss is already
    divided by the global token count, so the sum is the full-batch gradient); 2. the whole model's squared
    norm and the batch loss in one all-reduce over the world, each piece counted once; 3. clip. Returns
    (loss, norm) as floats."""
    pp_rank, dp_rank, tp_rank = coords
    params = [q for q in chunks.parameters()]
    if dist.get_world_size(dp_group) > 1:
        flat = all_reduce(torch.cat([q.grad.reshape(-1) for q in params]), dp_group, "dp")  # (this rank's elements,)
        for q, part in zip(params, flat.split([q.numel() for q in params])):
            q.grad.copy_(part.view_as(q))
    sq = squared_norm_piece(params, tp_rank)
    mine = torch.stack([loss if pp_rank == args.pp - 1 and tp_rank == 0 else torch.zeros_like(loss),
                        sq if dp_rank == 0 else torch.zeros_like(sq)])  # (2,): loss piece, norm^2 piece
    total = all_reduce(mine, dist.group.WORLD, "world")
    norm = total[1].sqrt()
    clip_grads_([q.grad for q in params], norm, args.clip)
    return total[0].item(), norm.item()


def full_model(d, chunks, shapes, coords, t, dtype):
    """The whole GPT by name on every rank (for --check), exactly: TP shard k of `name` travels as `name#k`,
    a replicated tensor once (from TP rank 0), all from DP rank 0; common.assemble_full adds the pieces up."""
    _, dp_rank, tp_rank = coords
    owned = {}
    for n, q in chunks.named_parameters():
        if dp_rank == 0 and (q.tp_split or tp_rank == 0):
            owned[n.split(".", 1)[1] + (f"#{tp_rank}" if q.tp_split else "")] = q  # "3.blocks.." -> "blocks.."
    pieces = {}
    for n, shape in shapes.items():
        k = tp_dim(n)
        pieces.update({n: shape} if k is None else {f"{n}#{j}": [z // t if i == k else z for i, z in enumerate(shape)]
                                                    for j in range(t)})
    got = assemble_full(d, owned, pieces, dtype)
    return {n: got[n] if tp_dim(n) is None else torch.cat([got[f"{n}#{j}"] for j in range(t)], tp_dim(n))
            for n in shapes}


# --- measurement ---
class Clock:
    """Stamps in ms from one common zero. On CPU the wall clock (one clock for the ranks of a host); on a GPU
    CUDA events, resolved after the step (no host sync per op), offset by the wall time of the zero."""

    def __init__(self, d):
        t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=dist.group.WORLD)  # the last rank's arrival: zero for all
        self.t0, self.cuda = t.item(), d.device.type == "cuda"
        if self.cuda:
            self.zero = self.event()

    def event(self):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def stamp(self):
        return self.event() if self.cuda else time.time() * 1e3 - self.t0

    def resolve(self, rows):  # the event objects of the rows into ms (after StepTimer.stop synchronised)
        if self.cuda:
            for row in rows:
                row[7:10] = [self.zero.elapsed_time(e) if e is not None else None for e in row[7:10]]
        return rows


def simulate_compute(ms):
    """--stage-ms: wait, not compute, so the schedule and not the competition for a few cores sets the
    timing (on a GPU the host waits before the end event is recorded, so the stream's span covers it)."""
    if ms > 0:
        time.sleep(ms / 1e3)


def count_sent(out, msgs):
    for (t, _), (kind, *_) in zip(out, msgs):
        COUNT[f"p2p_{kind}_msgs"] += 1
        COUNT["p2p_bytes"] += t.numel() * t.element_size()


COUNT_COLUMNS = ["fwd_msgs", "bwd_msgs", "p2p_bytes", "peak_inflight", "peak_act_bytes", "tp_calls", "tp_bytes",
                 "dp_calls", "dp_bytes", "world_bytes"]


def inflight_bound(p, v, m, r):
    """Micro-batch chunks between their F and B at most: the warm-up plus the first steady forward."""
    return min(warmup(p, v, m, r) + 1, v * m)


def bubble(events, p, lo, hi):
    """Per pp rank: idle time in [lo, hi] / busy time (the paper's bubble relative to ideal compute)."""
    busy = [sum(e["end"] - e["start"] for e in events if e["pp"] == r) for r in range(p)]
    return [(hi - lo - b) / b for b in busy]


def draw_timeline(events, p, lo, hi, cols=120):
    """One row per pp rank, to scale: Fk/Bk on a rank's first chunk, fk/bk on the others, '.' idle."""
    per, rows = (hi - lo) / cols, []
    for r in range(p):
        row = ["."] * cols
        for e in sorted((e for e in events if e["pp"] == r), key=lambda e: e["start"]):
            a = min(int((e["start"] - lo) / per), cols - 1)
            z = max(a + 1, min(cols, round((e["end"] - lo) / per)))
            name = (e["kind"] if e["chunk"] < p else e["kind"].lower()) + str(e["mb"])
            row[a:z] = list(name.ljust(z - a)[:z - a])
        rows.append(f"rank {r} |{''.join(row)}|")
    return "\n".join(rows + [f"{'':7}{lo:.1f} ms{f'{hi:.1f} ms':>{cols - 3}}"])


def write_trace(path, events):
    trace = [dict(name=f"{e['kind']}{e['mb']} chunk {e['chunk']}", ph="X", ts=1e3 * e["start"],
                  dur=1e3 * (e["end"] - e["start"]), pid=e["rank"], tid=0, args=dict(step=e["step"])) for e in events]
    ranks = sorted({(e["rank"], e["pp"], e["dp"], e["tp"]) for e in events})
    trace += [dict(name="process_name", ph="M", pid=q, args=dict(name=f"rank {q} (pp {a} dp {b} tp {c})"))
              for q, a, b, c in ranks]
    with open(path, "w") as fh:
        json.dump(dict(traceEvents=trace, displayTimeUnit="ms"), fh)


def report(d, args, dp, rows, counts, steps_run, act_bytes):
    """Rank 0: every measured figure beside its theory, the timeline of the last step; returns the figures."""
    p, v, m = args.pp, args.virtual_stages, args.microbatches
    keys = ("step", "pp", "dp", "tp", "kind", "chunk", "mb", "start", "end", "recv")
    events = [dict(zip(keys, row), rank=r, kind="B" if row[4] else "F") for r, rs in enumerate(rows) for row in rs]
    for e in events:
        e.update({k: int(e[k]) for k in ("step", "pp", "dp", "tp", "chunk", "mb")})
        e["recv"] = None if e["recv"] < 0 else e["recv"]  # -1: the op started from tokens or its own loss
    last = [e for e in events if e["step"] == max(x["step"] for x in events) and e["dp"] == 0 and e["tp"] == 0]
    lo, hi = min(e["start"] for e in last), max(e["end"] for e in last)
    bub = bubble(last, p, lo, hi)
    theory = (p - 1) / (v * m)
    c = {(int(x[1]), int(x[2]), int(x[3])): x for x in counts}  # (pp, dp, tp) -> that rank's counters
    mine = [c[r, 0, 0] for r in range(p)]  # pipeline dp 0, tp 0
    f_msgs, b_msgs = [int(x[4]) // steps_run for x in mine], [int(x[5]) // steps_run for x in mine]
    f_theory, b_theory = [m * (v - (r == p - 1)) for r in range(p)], [m * (v - (r == 0)) for r in range(p)]
    sent = [int(x[6]) // steps_run for x in mine]
    inflight, inflight_th = [int(x[7]) for x in mine], [inflight_bound(p, v, m, r) for r in range(p)]
    d.log(f"\nsummary, pipeline dp 0 tp 0 (p = {p}, v = {v}, m = {m}), each measurement beside its theory: bubble = "
          f"idle / busy over the last step, theory (p-1)/(v*m); messages counted at the send, theory per batch "
          f"m*(v - 1 if last rank) forward, m*(v - 1 if rank 0) backward")
    d.log("rank | chunks | bubble | theory | in flight | bound | fwd msgs | theory | bwd msgs | theory | bytes sent")
    for r in range(p):
        d.log(f"{r:4d} | {','.join(str(r + j * p) for j in range(v)):6s} | {bub[r]:6.3f} | {theory:6.3f} | "
              f"{inflight[r]:9d} | {inflight_th[r]:5d} | {f_msgs[r]:8d} | {f_theory[r]:6d} | {b_msgs[r]:8d} | "
              f"{b_theory[r]:6d} | {sent[r]}")
    mean = sum(bub) / p
    note = (f"--stage-ms {args.stage_ms:g}: compute time simulated, each chunk's F waits {args.stage_ms / v:g} ms, "
            f"B {2 * args.stage_ms / v:g} ms" if args.stage_ms else "real compute only: on shared cores this "
            "times the OS scheduler; try --stage-ms")
    d.log(f"bubble mean {mean:.3f} vs theory (p-1)/(v*m) = {theory:.3f} ({mean - theory:+.3f}); {note}")
    d.log(f"forward messages per batch and pipeline {sum(f_msgs)} = (v*p-1)*m = {(v * p - 1) * m}; "
          f"each {act_bytes} B = (b, T, D)")
    tp_calls, dp_calls = int(mine[0][9]) // steps_run, int(mine[0][11]) // steps_run
    tp_theory, dp_theory = 4 * m * args.n_layers // p if args.tp > 1 else 0, int(dp > 1)
    d.log(f"rank 0 collectives per batch: TP all-reduces {tp_calls}, theory {tp_theory} (g twice forward, f twice "
          f"backward, per layer and micro-batch); DP gradient all-reduces {dp_calls}, theory {dp_theory}")
    d.log("\ntimeline of the last step, measured (Fk / Bk: a rank's first chunk, fk / bk: its later ones):")
    d.log(draw_timeline(last, p, lo, hi))
    if args.trace:
        write_trace(args.trace, events)
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return dict(events=events, bubble=bub, bubble_mean=mean, bubble_theory=theory,
                bubble_definition="idle / busy per rank over the last step (relative to ideal compute)",
                bubble_minus_theory=mean - theory, stage_ms=args.stage_ms,
                fwd_msgs_per_rank=f_msgs, fwd_msgs_theory=f_theory, bwd_msgs_per_rank=b_msgs, bwd_msgs_theory=b_theory,
                fwd_msgs_per_pipeline=sum(f_msgs), fwd_msgs_per_pipeline_theory=(v * p - 1) * m,
                p2p_bytes_per_rank=sent, inflight=inflight, inflight_theory=inflight_th, tp_calls_per_batch=tp_calls,
                tp_calls_theory=tp_theory, dp_calls_per_batch=dp_calls, dp_calls_theory=dp_theory,
                counts_per_rank={f"pp{int(x[1])} dp{int(x[2])} tp{int(x[3])}": [int(y) for y in x[4:]] for x in counts},
                counts_columns=COUNT_COLUMNS)


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    world, p, t, v, m = env_world_size(), args.pp, args.tp, args.virtual_stages, args.microbatches
    check_common_args(args)
    for name in ("pp", "tp", "virtual_stages", "microbatches"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.dropout > 0:
        fail("ptdp.py runs without dropout (TP regions would need Megatron's RNG tracker, see megatron_tp.py)")
    if args.n_heads % t:
        fail(f"--n-heads {args.n_heads} is not divisible by --tp {t}: each TP rank needs whole heads")
    if p < 2:
        fail("--pp must be >= 2: ptdp.py is a pipeline (for tensor x data parallel alone, use megatron_tp.py)")
    dp = args.dp or world // (p * t)
    if args.dp < 0 or dp < 1 or p * t * dp != world:
        fail(f"world size {world} != pp {p} x tp {t} x dp {args.dp or '(world / pp / tp)'}: launch torchrun "
             f"--nproc_per_node={p * t * max(args.dp, 1)} or change --pp / --tp / --dp")
    if v > 1 and m % p:
        fail(f"--microbatches {m} is not a multiple of --pp {p}, as the interleaved schedule (v = {v}) needs: "
             f"use --microbatches {(m // p + 1) * p}")
    if args.n_layers % (p * v):
        fail(f"--n-layers {args.n_layers} is not divisible by pp x virtual stages = {p * v} chunks")
    if args.batch_size % (dp * m):
        fail(f"--batch-size {args.batch_size} is not divisible by dp x microbatches = {dp * m}")
    if args.stage_ms < 0:
        fail(f"--stage-ms must be >= 0, got {args.stage_ms}")

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    grid = torch.arange(world).view(p, dp, t)  # tp innermost: a TP group is adjacent ranks, one node
    coords = pp_rank, dp_rank, tp_rank = [int(i) for i in (grid == d.rank).nonzero()[0]]
    # every rank creates every group, in the same order (new_group is a collective over the world)
    tp_groups = {(i, j): dist.new_group(grid[i, j, :].tolist()) for i in range(p) for j in range(dp)}
    dp_groups = {(i, k): dist.new_group(grid[i, :, k].tolist()) for i in range(p) for k in range(t)}
    tp_group, dp_group = tp_groups[pp_rank, dp_rank], dp_groups[pp_rank, tp_rank]
    peers = grid[:, dp_rank, tp_rank].tolist()  # pp rank -> global rank of this pipeline
    d.log(f"ptdp.py: world {world} = pp {p} x dp {dp} x tp {t}, v = {v} chunks per rank, m = {m} micro-batches of "
          f"{args.batch_size // (dp * m)} per replica, on {d.backend}; entropy floor {data.entropy:.4f} nats/token")

    # --- the model: the full GPT on CPU from one seed, then this rank's chunks, TP-sliced, to the device ---
    dtype = DTYPES[args.dtype]
    full = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    shapes = {n: list(q.shape) for n, q in full.named_parameters()}
    chunks = nn.ModuleList(Chunk(full, pp_rank + j * p, p * v, tp_group) for j in range(v)).to(d.device)
    for name, q in chunks.named_parameters():
        q.tp_split = tp_dim(name) is not None
    del full
    opt = make_optimizer(chunks.parameters(), args)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": chunks, "optim": opt})
    losses, norms = hist.get("losses", []), hist.get("norms", [])
    b = args.batch_size // (dp * m)
    act_shape = (b, args.seq_len, args.d_model)  # (b, T, D): what crosses a chunk boundary
    clock, timer = Clock(d), StepTimer(d.device)  # Clock: an all-reduce first, before any point-to-point (NCCL)
    runner, held = PipelineRank(d, args, chunks, coords, peers, act_shape, clock), 0
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global batch, CPU
        n_tok = count_tokens(y)  # the whole global batch's: every micro-batch loss divides by it
        mine = slice(dp_rank * b * m, (dp_rank + 1) * b * m)  # this replica's rows
        split = lambda z: rearrange(z[mine], "(m b) n -> m b n", m=m).to(d.device)  # noqa: E731  (m, b, T)
        loss = runner.run(step, split(x), split(y), n_tok)
        loss, norm = finish_batch(d, args, chunks, loss, coords, dp_group)
        opt.step()
        held = max(held, state_bytes(chunks, opt))  # parameters, gradients, AdamW state: all alive here
        opt.zero_grad(set_to_none=True)
        ms = timer.stop()
        clock.resolve(runner.events[-2 * v * m:])
        losses.append(loss)
        norms.append(norm)
        log_step(d, step, loss, ms, args.batch_size * args.seq_len)
        ckpt.maybe_save(step + 1, {"model": chunks, "optim": opt}, {"losses": losses, "norms": norms})

    # --- gather the events and counters of every rank (tensors only), then the summary on rank 0 ---
    peak = peak_memory_bytes(d, held + runner.peak_act_bytes)  # counted; CUDA's own peak on a GPU
    steps_run = max(args.steps - start, 1)
    rows = gather_rows(d, [[-1 if z is None else z for z in e] for e in runner.events] or [[0] * 10])
    counts = gather_rows(d, [[d.rank, pp_rank, dp_rank, tp_rank, COUNT["p2p_F_msgs"], COUNT["p2p_B_msgs"],
                              COUNT["p2p_bytes"], runner.peak_inflight, runner.peak_act_bytes, COUNT["tp_calls"],
                              COUNT["tp_bytes"], COUNT["dp_calls"], COUNT["dp_bytes"], COUNT["world_bytes"]]])
    counts = [r[0].tolist() for r in counts]  # per rank: rank, pp, dp, tp, then COUNT_COLUMNS
    figures = dict(pp=p, tp=t, dp=dp, virtual_stages=v, microbatches=m, grad_norms=norms)
    if d.rank == 0 and args.steps > start:
        figures.update(report(d, args, dp, [r.tolist() for r in rows], counts, steps_run, b * args.seq_len *
                              args.d_model * dtype.itemsize))
    comm = max((x[6] + x[10] + x[12] + x[13]) / steps_run for x in counts)  # bytes sent or handed, per step
    check = None
    if args.check:
        full_params = full_model(d, chunks, shapes, coords, t, dtype)
        check = check_against_reference(d, args, losses, full_params)
    tokens_per_s = args.batch_size * args.seq_len / max(timer.median(), 1e-9) * 1e3
    write_summary(d, args, "ptdp", losses, timer.median(), tokens_per_s, peak, comm, check, figures)
    close_dist(ok=check is None or check["passed"])


if __name__ == "__main__":
    main()
