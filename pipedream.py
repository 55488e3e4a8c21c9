"""pipedream.py: one-forward-one-backward (1F1B) pipelines: PipeDream-flush, PipeDream,
PipeDream-2BW.

As in gpipe.py the GPT is cut into p stages, one per rank (embedding + first blocks on stage 0, last
blocks + final norm + head + loss on stage p-1), and the global batch into m micro-batches. What
changes is the order of work on a stage (PipeDream: Narayanan, Harlap, Phanishayee, Seshadri,
Devanur, Ganger, Gibbons, Zaharia, SOSP 2019): p-s-1 warm-up forwards fill the stages after s, then
stage s alternates one forward (F) and one backward (B), so each micro-batch's activations are freed
as early as the pipeline allows: at most p - s micro-batches are alive on stage s, where GPipe keeps
all m.

    1F1B, p = 4, m = 8 (B drawn as long as F)                                    time ->
    stage 0   F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7   warm-up 3, alive <= 4
    stage 1   .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..   warm-up 2, alive <= 3
    stage 2   .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..   warm-up 1, alive <= 2
    stage 3   .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..   alive 1
              idle ("..") = 6 of 22 slots = (p-1)/(m+p-1): the same bubble as GPipe, if the pipeline
              drains

--mode says when the weights change (flush, stash, 2bw: the three systems differ only there):
1. flush (PipeDream-flush; Narayanan, Phanishayee, Shi, Chen, Zaharia, "Memory-Efficient
   Pipeline-Parallel
   DNN Training", ICML 2021; the 1F1B of Megatron-LM and DeepSpeed): the picture above once per
   step, then one optimizer step on the drained pipeline. Synchronous: exactly one-process training
   (--check).
2. stash (PipeDream 2019): never drain. Micro-batches stream through one long 1F1B schedule, and
   every stage
   steps its optimizer after every backward, with that one micro-batch's gradient. Micro-batch k's
   forward on stage s therefore reads the stage's weights after max(0, k - (p-s-1)) updates; weight
   stashing keeps that version until k's backward, so the gradient belongs to the weights that
   produced it (--clip 0 only: k's whole-model norm exists once stage 0 ends B_k, after the later
   stages stepped):
       micro-batch k           0  1  2  3  4  5  6  7      (p = 4)
       stage 0 reads version   0  0  0  0  1  2  3  4      max(0, k-3)   versions kept <= p - s
       stage 3 reads version   0  1  2  3  4  5  6  7      k
   --vertical-sync: every stage reads the version stage 0 read (the number travels with the
   activation), so a micro-batch sees one consistent model; a later stage then keeps p versions, not
   p - s.
3. 2bw (PipeDream-2BW, 2021): never drain either, but a stage sums the gradient over a batch's m
   micro-batches and steps once per batch. Batch t runs on the weights of update t-1, and its
   gradient updates the newest: W_{t+1} = AdamW(W_t, clip(grad at W_{t-1})) (the paper's W_t -
   lr*grad f(W_{t-1})). Two versions alive per stage, ever (the double buffer). Needs m >= p, as in
   the paper. Clipping needs batch t's whole-model norm, complete only on stage 0 (last to finish
   the batch): it rides back down with an activation, before any stage needs W_{t+1}.
stash and 2bw are meant to differ from synchronous training: --check compares each with a
one-process simulation of its own rule (simulate_rule, at the end of the file). Measured from
outside the schedule, each beside its theory: the bubble, micro-batches alive, weight versions kept,
bytes sent; an ASCII timeline.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 pipedream.py --microbatches 8 --stage-ms 30 --steps 3  # simulated compute
    torchrun --nproc_per_node=4 pipedream.py --mode stash --clip 0 --vertical-sync --dtype float64 --check
Zero-bubble pipelines (the backward cut in two, ZB-H1, ZB-V) are zero_bubble.py. In production, use
torch.distributed.pipelining (Schedule1F1B) or the pipelines of Megatron-LM or DeepSpeed.
"""

import collections
import contextlib
import copy
import sys
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
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
    microbatches: int = 4  # m: micro-batches per global batch (dividing --batch-size)
    mode: Literal["flush", "stash", "2bw"] = "flush"  # flush: 1F1B (PipeDream-flush); stash; 2bw
    vertical_sync: bool = False  # stash: every stage runs a micro-batch on stage 0's version
    trace: str = ""  # write the measured F/B events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute time: each F also waits this many ms, each B twice


# ----------------------------------------------------------------------------- the stages
def split_layers(n_layers, p):
    """Blocks [start, end) of each of p stages, as even as possible; the earlier ones take the
    extras."""
    if not 1 <= p <= n_layers:
        raise ValueError(
            f"{p} stages of {n_layers} blocks leave a stage without one: use 1 to {n_layers} "
            f"stages, or {p} blocks or more"
        )
    base, extra = divmod(n_layers, p)
    return [(s * base + min(s, extra), (s + 1) * base + min(s + 1, extra)) for s in range(p)]


class Stage(nn.Module):
    """Blocks [start, end) of the seeded GPT, plus the embedding on the first stage and ln_f + head
    on the last. The GPT's parameter names are kept ("blocks.2.attn.q.weight"): together the stages
    are the GPT."""

    def __init__(self, gpt, s, bounds):
        super().__init__()
        start, end = bounds[s]
        self.first = s == 0
        self.last = s == len(bounds) - 1
        if self.first:
            self.tok_emb = gpt.tok_emb
            self.pos_emb = gpt.pos_emb
            self.drop = gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(start, end)})
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h):  # first stage: (b, T) token ids; others: (b, T, D) from the stage before
        if self.first:  # = GPT.embed
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


# ----------------------------------------------------------------------------- the schedules
def one_f_one_b(n, p, s):
    """Stage s's ops for a stream of n micro-batches: p-s-1 warm-up Fs, then F and B in turn, then
    Bs."""
    if not 0 <= s < p or n < 1:
        raise ValueError(f"stage {s} of {p}, {n} micro-batches: give a stage 0..p-1 and n >= 1")
    warm = min(p - s - 1, n)
    # warm-up: forwards only, enough to fill the stages after this one
    ops = [("F", k) for k in range(warm)]
    # steady state: one forward, then the backward of the oldest micro-batch still held (1F1B)
    for i in range(n - warm):
        ops += [("F", warm + i), ("B", i)]
    # cool-down: the backwards of the micro-batches still held, oldest first
    return ops + [("B", k) for k in range(n - warm, n)]


def split_at_step_ends(ops, m):
    """Cut a stage's ops after the B of each step's last micro-batch: chunk t is what it runs in
    step t. Without a flush (stash, 2bw), chunk t already holds forwards of step t+1."""
    ends = [i + 1 for i, (kind, k) in enumerate(ops) if kind == "B" and k % m == m - 1]
    return [ops[a:z] for a, z in zip([0] + ends, ends)]


def p2p(sends, recvs, group):
    """One batch_isend_irecv of [(tensor, peer: a rank within group)] sends and receives, then wait.
    Two blocking sends facing each other deadlock under NCCL; sends and receives in one batch
    cannot."""
    ops = [dist.P2POp(dist.isend, t, group=group, group_peer=peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, group=group, group_peer=peer) for t, peer in recvs]
    for req in dist.batch_isend_irecv(ops) if ops else []:
        req.wait()


def check_microbatches(rows, m):
    """A batch of `rows` cuts into m equal micro-batches (to_device's check, check_args's too)."""
    if m < 1:
        raise ValueError(f"m must be >= 1, got {m}")
    if rows % m:
        fit = max(k for k in range(1, m) if rows % k == 0)
        raise ValueError(
            f"a batch of {rows} does not cut into m = {m} equal micro-batches: use m = {fit}"
        )


def to_device(m, device, *batch):
    """A step's global (B, ...) tensors as m micro-batches (m, B/m, ...), copied to the device once
    per step (pinned and non-blocking on a GPU), never once per micro-batch in the middle of the
    schedule."""
    for t in batch:
        check_microbatches(len(t), m)
    batch = [rearrange(t, "(m b) ... -> m b ...", m=m) for t in batch]
    if device.type == "cuda":
        batch = [t.pin_memory() for t in batch]
    return [t.to(device, non_blocking=True) for t in batch]


# ------------------------------------------------------------------------ one stage running its ops
# Every activation and gradient travels with a 4-number float64 tag (float64: a loss is exact), on
# the device:
#   forward  [micro-batch k, weight version, 2bw: newest batch whose whole-model norm is known,
#             its norm^2]
#   backward [micro-batch k, weight version, loss of k (from the last stage), 2bw: partial grad
#             norm^2]
# The host never reads one while the pipeline runs (on a GPU that would stop the stream at every
# message).
TAG = 4


class StageRunner:
    """One pipeline stage running its ops ("F", k), ("B", k) in order, for any stage module; when
    the weights change is the policy's (Flush, Stash, TwoBW). source(k): (stage 0's input, the last
    stage's target) of micro-batch k, for loss_fn(output, target); in_shape / out_shape: what
    arrives from prev / leaves for next, its neighbours in `group` (the pipeline's ranks in stage
    order; None: the default group); observe(kind, k, **tags): a context around every op. NCCL wants
    a collective on the group first."""

    def __init__(
        self,
        policy,
        source,
        loss_fn,
        in_shape,
        out_shape,
        dtype,
        device,
        group=None,
        observe=lambda kind, k, **tags: contextlib.nullcontext(),
    ):
        self.policy = policy
        self.source = source
        self.loss_fn = loss_fn
        self.shape = {"F": in_shape, "B": out_shape}
        self.dtype = dtype
        self.device = device
        s = dist.get_rank(group)
        p = dist.get_world_size(group)
        self.group = group
        self.observe = observe
        if s < 0:
            # ranks in the group
            raise ValueError(
                "this rank is not in the pipeline's group: make StageRunners on its ranks only"
            )
        self.prev, self.next = (
            s - 1 if s > 0 else None,
            s + 1 if s < p - 1 else None,
        )
        # alive: k -> (input, output, version), F to B
        self.alive = {}
        self.outbox = []
        self.losses = {}

    # (TAG,) on the device, from numbers or 0-d device tensors: no host round trip
    def tag(self, *xs):
        t = torch.zeros(TAG, dtype=torch.float64, device=self.device)
        for i, x in enumerate(xs):
            t[i] = x
        return t

    def run(self, ops):
        for kind, k in ops:  # the last op's message leaves with this op's receive
            x, tag = self.exchange(kind, k)
            (self.forward if kind == "F" else self.backward)(k, x, tag)

    def exchange(self, kind, k):
        """The last op's message and this op's receive in one batch: F's output leaves with the next
        B's gradient receive, B's with the next F's activation receive (Megatron's
        send_forward_recv_backward)."""
        peer = {"F": self.prev, "B": self.next}.get(kind)
        x = None
        tag = None
        if peer is not None:  # (none: stage 0 reads tokens, the last stage starts B from its loss)
            x, tag = torch.empty(self.shape[kind], dtype=self.dtype, device=self.device), self.tag()
        p2p(self.outbox, [] if peer is None else [(x, peer), (tag, peer)], self.group)
        self.outbox = []
        return x, tag

    def forward(self, k, x, tag):
        riding = self.policy.pass_on(k, tag)  # 2bw: the whole-model norm rides on the activations
        weights, v = self.policy.weights(k)  # the version micro-batch k reads on this stage
        inp, target = self.source(k)
        # a leaf: its .grad is what B sends back
        inp = inp if self.prev is None else x.requires_grad_()
        with self.observe("F", k, version=v):
            out = weights(inp)  # GPT: (b, T, D); last stage: logits (b, T, V) ...
            if self.next is None:
                # ... and the loss: sum over tokens / global token count
                out = self.loss_fn(out, target)
        self.alive[k] = (inp, out, v)
        if self.next is None:
            self.losses[k] = out.detach()
        else:  # (b, T, D) and its tag, leaving with the next op's receive
            self.outbox = [(out.detach(), self.next), (self.tag(k, v, *riding), self.next)]

    def backward(self, k, grad, tag):
        inp, out, v = self.alive[k]
        with self.observe("B", k, version=v):
            torch.autograd.backward(out, grad)  # last stage: from the loss itself
        del self.alive[k]
        # on the device
        loss, partial = (self.losses.pop(k), 0.0) if self.next is None else (tag[2], tag[3])
        if self.prev is None:
            self.losses[k] = loss  # stage 0 holds k's loss once k's gradient is back
        partial = self.policy.on_backward(k, v, partial)
        if self.prev is not None:
            # (b, T, D)
            self.outbox = [
                (inp.grad, self.prev),
                (self.tag(k, v, loss, partial), self.prev),
            ]

    def drain(self, t):
        """The end of step t (flush) or of a stream's segment: send what the last op left, then the
        policy's end of batch (flush: the optimizer step; 2bw: the last batch's norm, which no
        activation carries)."""
        self.exchange("end", None)
        self.policy.drain(t)


# -------------------------------------------------------------------- policies: when weights change
def squared_norm(grads):  # in float64, without a float64 copy of each gradient (the norm's dtype=)
    return (
        torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads])
        .square()
        .sum()
    )


class Flush:
    """PipeDream-flush: one version of the weights; once the pipeline has drained, one optimizer
    step."""

    def __init__(self, stage, opt, clip, group=None):
        self.stage = stage
        self.opt = opt
        self.clip = clip
        self.group = group
        self.version = 0

    def weights(self, k):  # -> (the module micro-batch k runs on, its version)
        return self.stage, self.version

    # 2bw: learns from F's tag (None on stage 0); returns what rides on with F
    def pass_on(self, k, tag):
        return ()

    # after B of k on version v; returns the partial norm^2 going up
    def on_backward(self, k, v, partial):
        return partial

    def drain(self, t):
        grads = [q.grad for q in self.stage.parameters() if q.grad is not None]
        # () this stage's squared norm; a (1,) norm could not scale a 0-dim grad
        sq = squared_norm(grads)
        dist.all_reduce(sq, group=self.group)  # () summed over stages: the whole model's
        self.step(sq)

    # one update of the live weights, clipped by the whole model's norm^2 (or not)
    def step(self, sq):
        # torch's clip_grad_norm_ rule, by the whole model's norm
        if sq is not None and self.clip > 0:
            torch.nn.utils.clip_grads_with_norm_(self.stage.parameters(), self.clip, sq.sqrt())
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1


# ---------------------------------------------------------------------- PipeDream and 2BW: no flush
class Stash(Flush):
    """PipeDream (2019), weight stashing: a forward never reads the live weights the optimizer steps
    (the next step would change, in place, tensors autograd saved for a backward still to come);
    each version is a frozen copy, made right after its step, kept while a micro-batch in flight or
    still to come reads it."""

    def __init__(self, stage, opt, lag):
        super().__init__(stage, opt, clip=0)
        # version -> frozen copy of the stage
        self.lag, self.versions = (
            lag,
            {0: copy.deepcopy(stage)},
        )
        # version -> micro-batches F to B; the next F
        self.in_flight, self.next_f = (
            collections.Counter(),
            0,
        )

    # the rule of one uninterrupted stream: a drain changes timing, never versions
    def version_for(self, k):
        return max(0, k - self.lag)

    def weights(self, k):
        v, self.next_f = self.version_for(k), k + 1
        self.in_flight[v] += 1
        return self.versions[v], v

    def on_backward(self, k, v, partial):
        self.in_flight[v] -= 1
        self.update(self.take_grads(v), None)
        return partial

    # move the gradient out of version v: the next micro-batch on v starts from 0
    def take_grads(self, v):
        grads = [q.grad for q in self.versions[v].parameters()]
        self.versions[v].zero_grad(set_to_none=True)
        return grads

    # one step of the live weights with these gradients, frozen as a new version
    def update(self, grads, sq):
        for q, g in zip(self.stage.parameters(), grads):
            q.grad = g
        self.step(sq)
        self.drop_unused()  # first, so that a real system could reuse a dropped version's buffer
        # 2bw: the double buffer's other half
        self.versions[self.version] = copy.deepcopy(self.stage)
        self.drop_unused()

    def drop_unused(self):  # versions older than the floor serve no forward still to come
        floor = min(self.version, self.version_for(self.next_f))
        for v in [v for v in self.versions if v < floor and not self.in_flight[v]]:
            del self.versions[v]

    def drain(self, t):  # every update is applied as soon as its gradient (and norm) is complete
        pass


def check_2bw(m, p):  # TwoBW's invariant (learn_norm), which check_args checks too
    if m < p:
        raise ValueError(
            f"2bw needs m >= p = {p} micro-batches, got {m}: batch t's norm rides "
            "on micro-batch (t+1)m+p-1's forward, after batch t+2 starts if m < p-1; at m = p-1 "
            f"the second-to-last norm has no forward left to ride on; use m = {p}"
        )


class TwoBW(Stash):
    """PipeDream-2BW: two versions, ever (the newest also lives in the master weights the optimizer
    steps: autograd must never see a tensor it saved change in place). Batch t's whole-model norm:
    each stage adds its squared norm to the partial sum riding up with the gradients; stage 0 has
    the total."""

    def __init__(self, stage, opt, m, clip, group=None):  # group: the pipeline's, in stage order
        super().__init__(stage, opt, lag=None)
        self.m = m
        self.p = dist.get_world_size(group)
        self.clip = clip
        self.group = group
        check_2bw(m, self.p)
        self.first = dist.get_rank(group) == 0
        self.batch_grads = {}  # batch -> its summed gradient, until the whole-model norm arrives
        zero = torch.zeros((), dtype=torch.float64, device=next(stage.parameters()).device)
        # (newest batch whose whole-model norm^2 is known here, that norm^2)
        self.known = (
            -1,
            zero,
        )
        self.drained_norm = -1  # the norm every stage knew at the last drain

    def version_for(self, k):
        return max(k // self.m - 1, 0)  # batch t reads the weights of update t-1

    # stage 0 had run B up to k-p when it sent F_k: it knew the norms that far
    def pass_on(self, k, tag):
        if tag is not None:
            self.learn_norm(max((k - self.p + 1) // self.m - 1, self.drained_norm), tag[3])
        return self.known

    def on_backward(self, k, v, partial):
        self.in_flight[v] -= 1
        if k % self.m == self.m - 1:  # the batch's gradient is complete on this stage
            t, grads = k // self.m, self.take_grads(v)
            self.batch_grads[t] = grads
            partial = partial + squared_norm(grads)
            if self.first:
                self.learn_norm(t, partial)
        return partial

    def learn_norm(self, t, sq):
        """Batch t's whole-model squared norm (on the device) is known here now: its update is made,
        first needed by batch t+2, which starts here after the norm passes with micro-batch (t+1)m +
        p-1. A message carries its sender's newest norm only, so each norm learnt must be the next
        expected (m >= p)."""
        if t == self.known[0]:
            return  # nothing new
        if t != self.known[0] + 1 or t not in self.batch_grads:
            raise RuntimeError(
                f"2bw learns the norm of batch {t}, but the next it expects is batch "
                f"{self.known[0] + 1}'s: the schedule needs --microbatches >= stages"
            )
        self.known = (t, sq)
        self.update(self.batch_grads.pop(t), sq)

    def drain(self, t):
        sq = self.known[1].clone()  # () the last batch's norm has no activation left to ride on
        dist.broadcast(sq, group=self.group, group_src=0)
        self.learn_norm(t, sq)
        self.drained_norm = t  # the next segment's tags carry it until stage 0 knows a newer one


def check_args(args, p, m):
    check_common_args(args)
    if args.vertical_sync and args.mode != "stash":
        fail(
            f"--vertical-sync belongs to --mode stash (--mode {args.mode}: no per-micro-batch "
            "versions)"
        )
    if args.mode == "stash" and args.clip > 0:
        fail(
            "--mode stash updates each stage right after its backward, before the whole-model "
            "gradient norm of that micro-batch exists (stage 0 finishes it last): pass --clip 0"
        )
    try:  # the cores' own checks: the micro-batches, the split, 2bw's invariant
        check_microbatches(args.batch_size, m)
        if p == 1:
            fail(
                f"pipedream.py needs one process per stage, at least 2: torchrun --nproc_per_node="
                f"{max(2, min(4, args.n_layers))} pipedream.py {' '.join(sys.argv[1:])}".rstrip()
            )
        split_layers(args.n_layers, p)
        if args.mode == "2bw":
            check_2bw(m, p)
    except ValueError as e:  # as fail's one line, with the flags they were given
        fail(
            f"--batch-size {args.batch_size}, --microbatches {m}, --n-layers {args.n_layers}, "
            f"--mode {args.mode}, {p} stages (processes): {e}"
        )


def main():
    args = parse_args(Args)
    p, m = env_world_size(), args.microbatches  # p: stages = processes; m: micro-batches per step
    check_args(args, p, m)

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    s = d.rank
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, p)
    d.log(
        f"pipedream.py --mode {args.mode}{' --vertical-sync' * args.vertical_sync}: {p} stages x "
        f"{m} micro-batches of {args.batch_size // m} on {d.backend}; entropy floor "
        f"{data.entropy:.4f} nats"
    )
    d.log(
        "split: "
        + " | ".join(
            f"stage {r}: {'embedding + ' if r == 0 else ''}blocks {a}..{z - 1}"
            f"{' + norm + head + loss' if r == p - 1 else ''}"
            for r, (a, z) in enumerate(bounds)
        )
    )
    torch.manual_seed(args.seed + s)  # dropout masks (if any) differ per stage
    dtype = DTYPES[args.dtype]
    # whole, on CPU; a stage takes its part
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)
    stage = Stage(gpt, s, bounds).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    # one schedule per step, drained; stash, 2bw: one stream for the run
    sync = args.mode == "flush"
    # lag: warm-up p-s-1
    policy = (
        Flush(stage, opt, args.clip)
        if sync
        else TwoBW(stage, opt, m, args.clip)
        if args.mode == "2bw"
        else Stash(stage, opt, lag=p - 1 if args.vertical_sync else p - s - 1)
    )
    batches = {}  # step -> (m, b, T) tokens and targets on the device, the global token count

    # micro-batch k: stage 0's tokens (b, T); the last stage's targets (b, T) and token count
    def source(k):
        x, y, n_tok = batches[k // m]
        return x[k % m], (y[k % m], n_tok)

    # (b, T, D): what crosses a stage boundary
    act = (args.batch_size // m, args.seq_len, args.d_model)
    observer = Observer(d, args)
    comm = CommCounter()
    # the stages in the default group: stage s on rank s
    runner = StageRunner(
        policy,
        source,
        lambda logits, y: lm_loss(logits, *y),
        act,
        act,
        dtype,
        d.device,
        observe=observer,
    )
    observer.runner = runner
    run = Run(d, args, {"model": stage, "optim": opt, "pipe": PolicyState(policy)})
    # flush: a schedule per step, drained before the update. stash, 2bw: one, drained only at a
    # checkpoint
    ends = [
        t
        for t in range(run.start + 1, args.steps + 1)
        if sync or t == args.steps or (args.save_every and t % args.save_every == 0)
    ]
    stream = [
        (kind, a * m + k)
        for a, z in zip([run.start] + ends, ends)
        for kind, k in one_f_one_b((z - a) * m, p, s)
    ]
    chunks = split_at_step_ends(stream, m)  # chunks[i]: what this stage runs in step start + i
    # NCCL sets up its communicator at the first collective; batched point-to-point must not come
    # first
    dist.all_reduce(torch.zeros(1, device=d.device))
    for step in run.steps():
        chunk = chunks[step - run.start]
        # a stream reads ahead into later steps
        for t in sorted({k // m for _, k in chunk} - set(batches)):
            # (B, T) global, on CPU
            x, y = data.batch(t, args.batch_size, args.seq_len, args.ragged)
            # (m, b, T) each; count: on CPU
            batches[t] = (*to_device(m, d.device, x, y), count_tokens(y))
        # bytes sent, counted at the slow dispatcher: flush, in the step before the timed last; a
        # stream, all
        with run.watching(step, comm, at=max(run.start, args.steps - 2) if sync else step):
            runner.run(chunk)
            if step + 1 in ends:
                runner.drain(step)
        del batches[step]
        # stage 0 has every loss of the step now (they came back with the gradients); other ranks
        # log nothing
        loss = (
            sum(runner.losses.pop(step * m + j) for j in range(m)).item()
            if s == 0
            else float("nan")
        )
        run.end_step(step, loss)

    # the summary, then --check
    summarize(d, args, p, run, observer, comm, bounds, len(ends), stage)


# --- measurement --- (from outside the schedule: its observe callback, the counter, the report)
# A policy's checkpoint state (Run saves and loads it; no part of the schedule)
class PolicyState:
    """A stage policy's part of a checkpoint, saved after a drain: the updates taken, the versions
    kept (stash, 2bw), the whole-model norm known (2bw). Loaded after the live stage itself."""

    def __init__(self, policy):
        self.policy = policy

    def state_dict(self):
        pol = self.policy
        norm = (
            (pol.known[0], pol.known[1].cpu(), pol.drained_norm) if isinstance(pol, TwoBW) else None
        )
        return dict(
            version=pol.version,
            norm=norm,
            versions={v: w.state_dict() for v, w in getattr(pol, "versions", {}).items()},
        )

    def load_state_dict(self, state):
        pol = self.policy
        pol.version = state["version"]
        if isinstance(pol, Stash):
            pol.versions = {v: copy.deepcopy(pol.stage) for v in state["versions"]}
            for v, w in pol.versions.items():
                w.load_state_dict(state["versions"][v])
        if isinstance(pol, TwoBW):
            t, sq, pol.drained_norm = state["norm"]
            pol.known = (t, sq.to(pol.known[1].device))


class Observer(PipelineWatch):
    """harness.PipelineWatch (--stage-ms: each F waits that, each B twice), reading as each op
    begins this stage's peaks in the state the ops before it left, from the runner's and the
    policy's attributes: micro-batches alive (F to B), weight versions kept, bytes alive after a
    forward (what forwards saved for backward, plus inputs and outputs, and parameters, gradients
    and optimizer state of the live and the stashed versions)."""

    def __init__(self, d, args):
        super().__init__(d, {"F": args.stage_ms, "B": 2 * args.stage_ms}, tags=("version",))
        self.runner, self.versions = None, 0

    def before(self, kind, mb):
        r, pol = self.runner, self.runner.policy
        self.alive = max(self.alive, len(r.alive))
        self.versions = max(self.versions, len(getattr(pol, "versions", [pol.stage])))
        if self.last == "F":  # activations peak after a forward
            held = [t for a in r.alive.values() for t in a[:2]]  # inputs and outputs until B
            versions = getattr(pol, "versions", {}).values()
            model = state_bytes(pol.stage, pol.opt) + sum(state_bytes(w) for w in versions)
            self.bytes = max(self.bytes, self.live.alive(*held) + model)


def summarize(d, args, p, run, observer, comm, bounds, segments, stage):
    """The report, the peak (counted) read before --check trains, then --check: the full model, by
    name, from every stage's parameters (one all-reduce); stash and 2bw against their own rule
    (simulate_rule)."""
    figures = report(d, args, observer, comm, bounds, args.steps - run.start, segments)
    peak = peak_memory_bytes(d, observer.bytes)
    check = None
    if args.check:
        dtype = DTYPES[args.dtype]
        with torch.device("meta"):  # the names and shapes of the whole GPT, no storage
            shapes = {n: q.shape for n, q in GPT(GPTConfig.from_args(args)).named_parameters()}
        full = assemble_full(d, dict(stage.named_parameters()), shapes, dtype)
        sync = args.mode == "flush"
        ref = simulate_rule(args, p, d.device, d.log) if d.rank == 0 and not sync else None
        check = check_against_reference(d, args, run.losses, full, ref=ref)
    run.finish(
        f"pipedream-{args.mode}", peak, max(figures.get("sent_bytes_per_rank", [0])), check, figures
    )


def report(d, args, observer, comm, bounds, steps_run, segments):
    """Every rank's events and counts, gathered (tensors only); rank 0: the summary's figures, each
    beside its theory, the table, the timeline, --trace. segments: the schedules between drains in
    this run."""
    events = observer.timeline.gather()
    every = [
        r[0].tolist()
        for r in gather_rows(
            d, [[observer.alive, observer.versions, comm.total(op="send"), observer.bytes]]
        )
    ]
    p = len(bounds)
    m = args.microbatches
    mode = args.mode
    ms = args.stage_ms
    figures = dict(split=bounds, stages=p, microbatches=m, mode=mode)
    if d.rank != 0 or not steps_run:
        return figures
    sync = mode == "flush"
    # the last step, or all
    shown = [e for e in events if e["mb"] // m == args.steps - 1] if sync else events
    lo, hi = min(e["start"] for e in shown), max(e["end"] for e in shown)
    # micro-batches between drains; drains shown
    n, drains = (m, 1) if sync else (args.steps * m, segments)
    theory = drains * (p - 1) / ((m if sync else steps_run * m) + drains * (p - 1))
    formula = (
        "(p-1)/(m+p-1)" if sync else "S(p-1)/(steps*m+S(p-1)), S drains in the run (-> 0 steady)"
    )
    busy = [busy_ms(events, r, lo, hi) for r in range(p)]
    bub, idle = [1 - b / (hi - lo) for b in busy], [hi - lo - b for b in busy]
    op_ms = {
        k: sum(e["end"] - e["start"] for e in es) / len(es)
        for k in "FB"
        if (es := [e for e in shown if e["kind"] == k])
    }  # mean measured T_F, T_B
    # each stage waits p-1 F's and p-1 B's
    idle_theory = drains * (p - 1) * (op_ms["F"] + op_ms["B"])
    alive = [min(p - s, n) for s in range(p)]
    sent = [r[2] / (1 if sync else steps_run) for r in every]
    # (b, T, D)
    b_bytes = args.batch_size // m * args.seq_len * args.d_model * DTYPES[args.dtype].itemsize
    sent_theory = [m * (b_bytes + 8 * TAG) * ((s > 0) + (s < p - 1)) for s in range(p)]
    kept = {"2bw": [2] * p, "stash": [min(p, n)] * p if args.vertical_sync else alive}.get(
        mode, [1] * p
    )
    d.log(
        f"\nsummary ({mode}, {p} stages, m = {m}) over {'the last step' if sync else 'the run'}, "
        "theory "
        f"beside each measurement: bubble {formula}; idle ms (p-1)(T_F+T_B) per drain at the "
        "measured " + ", ".join(f"T_{k} {v:.1f}" for k, v in op_ms.items()) + " ms; alive p - s; "
        f"weight versions kept; bytes sent per step m x ((b, T, D) + {8 * TAG} B tag) each way"
    )
    d.log(
        "stage | blocks | bubble | theory | idle ms | theory | alive | theory | versions | theory "
        "| sent B/step | theory | mem B"
    )
    for s, (a, z) in enumerate(bounds):
        d.log(
            f"{s:5d} | {a:2d}..{z - 1:<2d} | {bub[s]:6.3f} | {theory:6.3f} | {idle[s]:7.1f} | "
            f"{idle_theory:6.1f} | {int(every[s][0]):5d} | {alive[s]:6d} | {int(every[s][1]):8d} | "
            f"{kept[s]:6d} | {sent[s]:11.0f} | {sent_theory[s]:6d} | {int(every[s][3])}"
        )
    mean = sum(bub) / p
    waits = ", ".join(f"each {k} waits {x:g} ms" for k, x in observer.timeline.simulate.items())
    d.log(
        f"bubble, mean over stages: measured {mean:.3f}, theory {theory:.3f}, difference "
        f"{mean - theory:+.3f}"
        + (
            f" (--stage-ms {ms:g}: compute time simulated, {waits})"
            if ms
            else " (real compute only: on shared cores this times the OS scheduler; try --stage-ms)"
        )
    )
    d.log(
        "\ntimeline of the last step, measured (micro-batch numbers within the step):"
        if sync
        else "\ntimeline of the last two steps, measured (micro-batches numbered from the start; "
        "no drain between but at a checkpoint):"
    )
    lo = lo if sync else min(e["start"] for e in events if e["mb"] >= max(args.steps - 2, 0) * m)
    d.log(
        draw_timeline(events, p, lo, hi, lambda e: f"{e['kind']}{e['mb'] % m if sync else e['mb']}")
    )
    if args.trace:
        write_trace(args.trace, events, lambda e: f"{e['kind']}{e['mb']}")
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return dict(
        figures,
        events=events,
        bubble=bub,
        bubble_mean=mean,
        bubble_theory=theory,
        bubble_theory_formula=formula,
        stage_ms=ms,
        idle_ms=idle,
        idle_ms_theory=idle_theory,
        op_ms=op_ms,
        peak_alive_microbatches=[int(r[0]) for r in every],
        peak_alive_theory=alive,
        versions_kept=[int(r[1]) for r in every],
        versions_kept_theory=kept,
        sent_bytes_per_rank=sent,
        sent_bytes_theory=sent_theory,
        mem_bytes_per_rank=[int(r[3]) for r in every],
    )


# --- reference for --check --- (the stash and 2bw rules in one process) ---------------------------
def simulate_rule(args, p, device="cpu", log=lambda line: None):
    """The stash or 2bw rule without a pipeline, on the whole model. stash: micro-batches in stream
    order k = step*m + j, whose forward and backward read, on stage s, the weights after max(0, k -
    lag_s) updates, lag_s = p-s-1 (p-1 everywhere with --vertical-sync); then one AdamW step with
    k's gradient. 2bw: whole batches t, reading W_{max(t-1, 0)}: W_{t+1} = AdamW(W_t, clip(grad at
    W_{t-1})), torch's clip_grad_norm_. One AdamW over the whole model equals one per stage: with
    foreach=False it updates each tensor alone."""
    log(
        f"--check: against the one-process simulation of the {args.mode} rule, not synchronous "
        "training"
    )
    stash, bounds = args.mode == "stash", split_layers(args.n_layers, p)
    m = args.microbatches if stash else 1  # updates per step
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, data = make_optimizer(model.parameters(), args), MarkovData(args.vocab, args.seed)
    owner = {
        n: s for s in range(p) for n, _ in Stage(model, s, bounds).named_parameters()
    }  # name -> stage
    names = [n for n, _ in model.named_parameters()]
    lag = {n: (p - 1 if args.vertical_sync else p - owner[n] - 1) if stash else 1 for n in names}
    # noqa
    frozen = lambda: {n: q.detach().clone().requires_grad_() for n, q in model.named_parameters()}
    history, losses = {0: frozen()}, []  # history[v]: the weights after v updates
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok, step_loss = count_tokens(y), 0.0
        # (b, T) micro-batches; 2bw: one (B, T)
        for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):
            k = step * m + j
            w = {n: history[max(0, k - lag[n])][n] for n in names}
            loss = lm_loss(
                torch.func.functional_call(model, w, (xj.to(device),)), yj.to(device), n_tok
            )
            for q, g in zip(model.parameters(), torch.autograd.grad(loss, [w[n] for n in names])):
                q.grad = g
            if args.clip > 0:  # 2bw only (stash refuses --clip)
                torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            history[k + 1] = frozen()
            history.pop(k + 1 - p, None)  # k+1 and later read version k+2-p or newer
            step_loss += loss.item()
        losses.append(step_loss)
    return dict(losses=losses, params={n: q.detach().clone() for n, q in model.named_parameters()})


if __name__ == "__main__":
    main()
