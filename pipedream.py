"""pipedream.py: one-forward-one-backward (1F1B) pipelines: PipeDream-flush, PipeDream, PipeDream-2BW.

As in gpipe.py the GPT is cut into p stages, one per rank (embedding + first blocks on stage 0, last blocks +
final norm + head + loss on stage p-1), and the global batch into m micro-batches. What changes is the order
of work on a stage (PipeDream: Narayanan, Harlap, Phanishayee, Seshadri, Devanur, Ganger, Gibbons, Zaharia,
SOSP 2019): p-s-1 warm-up forwards fill the stages after s, then stage s alternates one forward (F) and one
backward (B), so each micro-batch's activations are freed as early as the pipeline allows: at most p - s
micro-batches are alive on stage s, where GPipe keeps all m.

    1F1B, p = 4, m = 8 (B drawn as long as F)                                    time ->
    stage 0   F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7   warm-up 3, alive <= 4
    stage 1   .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..   warm-up 2, alive <= 3
    stage 2   .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..   warm-up 1, alive <= 2
    stage 3   .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..   alive 1
              idle ("..") = 6 of 22 slots = (p-1)/(m+p-1): the same bubble as GPipe, if the pipeline drains

--mode says when the weights change (the three systems differ only there):
1. flush (PipeDream-flush; Narayanan, Phanishayee, Shi, Chen, Zaharia, "Memory-Efficient Pipeline-Parallel
   DNN Training", ICML 2021; the 1F1B of Megatron-LM and DeepSpeed): the picture above once per step, then
   one optimizer step on the drained pipeline. Synchronous: exactly one-process training (--check).
2. stash (PipeDream 2019): never drain (but see checkpoints below). Micro-batches stream through one long 1F1B schedule, and every stage
   steps its optimizer after every backward, with that one micro-batch's gradient. Micro-batch k's forward on
   stage s therefore reads the stage's weights after max(0, k - (p-s-1)) updates; weight stashing keeps that
   version until k's backward, so the gradient belongs to the weights that produced it (--clip 0 only: the
   whole model's norm of k's gradient exists once stage 0 ends B_k, after the later stages have stepped):
       micro-batch k           0  1  2  3  4  5  6  7      (p = 4)
       stage 0 reads version   0  0  0  0  1  2  3  4      max(0, k-3)   versions kept <= p - s
       stage 3 reads version   0  1  2  3  4  5  6  7      k
   --vertical-sync: every stage reads the version stage 0 read (the number travels with the activation), so
   a micro-batch sees one consistent model; a later stage then keeps p versions, not p - s.
   Words: step t = micro-batches t*m .. t*m+m-1 of the stream = m updates of every stage. Its loss is the
   sum of those m micro-batch losses (each over the step's global token count), each computed with the
   weights its forward read: a running loss, not the loss of any one set of weights.
3. 2bw (PipeDream-2BW, 2021): never drain either, but a stage sums the gradient over a batch's m
   micro-batches and steps once per batch. Batch t runs on the weights of update t-1, and its gradient
   updates the newest: W_{t+1} = AdamW(W_t, clip(grad at W_{t-1})) (the paper's W_t - lr*grad f(W_{t-1})).
   Two versions alive per stage, ever (the double buffer). Needs m >= p, as in the paper. Step t's loss is
   batch t's loss at W_{t-1}. Clipping needs the whole model's norm of batch t, complete only on stage 0
   (last to finish the batch): it rides back up with an activation, before any stage needs W_{t+1}.
   Here the newest version also lives in the master weights the optimizer steps, so a stage holds one buffer
   more than the versions it counts (autograd must never see a tensor it saved change in place).
stash and 2bw are meant to differ from synchronous training: --check compares each with a one-process
simulation of its own rule, without a pipeline (simulate_stash, simulate_2bw, at the end of the file).
Checkpoints (--ckpt-dir): a stream has no consistent step boundary, so stash and 2bw drain the pipeline at each
save step (one more fill and drain there: the schedule changes only there) and save the weight versions that
later micro-batches still read. Every micro-batch reads the version the uninterrupted stream gives it, so a run
killed and resumed ends with the uninterrupted run's losses and parameters, bit for bit.

Measured on every rank: each F and B (start, end, weight version, and for B which weights its gradient landed
on), the bubble (idle / total) beside its theory, micro-batches alive, weight versions kept, bytes sent; an ASCII
timeline drawn from the events and --trace PATH (Chrome trace JSON for https://ui.perfetto.dev). --stage-ms F
simulates compute time (each F also waits F ms, each B 2F ms; the numbers computed are unchanged), so that on
a few shared cores the schedule, not the operating system's scheduling, sets the measured bubble.

Run (one process per stage; a world of 1 is not a pipeline):
    torchrun --nproc_per_node=4 pipedream.py --microbatches 8 --trace pipedream_trace.json
    torchrun --nproc_per_node=4 pipedream.py --microbatches 8 --stage-ms 30 --steps 3  # simulated compute: the bubble
    torchrun --nproc_per_node=3 pipedream.py --n-layers 4 --dtype float64 --check       # uneven: 2 + 1 + 1 blocks
    torchrun --nproc_per_node=4 pipedream.py --mode stash --clip 0 --vertical-sync --dtype float64 --check
    torchrun --nproc_per_node=4 pipedream.py --mode 2bw --microbatches 4 --dtype float64 --check
In production, use torch.distributed.pipelining (Schedule1F1B) or Megatron-LM's / DeepSpeed's pipelines.
"""
import collections
import copy
import json
import sys
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn as nn
from einops import rearrange
from torch.func import functional_call

from common import (DTYPES, build_gpt, clip_grads_, close_dist, count_tokens, fail, GPTConfig, init_dist,
                    lm_loss, make_optimizer, MarkovData)
from harness import (assemble_full, check_against_reference, check_common_args, Checkpointer, CommonArgs,
                     env_world_size, gather_rows, log_step, maybe_fail, parse_args, peak_memory_bytes,
                     SavedActivations, state_bytes, StepTimer, tensor_bytes, write_summary)


@dataclass
class Args(CommonArgs):
    microbatches: int = 4  # m: micro-batches per global batch (--batch-size must be divisible by it)
    mode: Literal["flush", "stash", "2bw"] = "flush"  # flush: synchronous 1F1B; stash: PipeDream; 2bw: PipeDream-2BW
    vertical_sync: bool = False  # stash: every stage uses the weight version stage 0 used for the micro-batch
    trace: str = ""  # write the measured F/B events as a Chrome trace (JSON) to this path
    stage_ms: float = 0.0  # simulate compute time: each F of a micro-batch also waits this many ms, each B twice that


# ----------------------------------------------------------------------------- the stages
def split_layers(n_layers, p):
    """Blocks [start, end) of each of p stages, as even as possible; the earlier stages take the extra block
    (the last stage carries the head and the loss already)."""
    base, extra = divmod(n_layers, p)
    bounds, start = [], 0
    for s in range(p):
        bounds.append((start, start + base + (s < extra)))
        start = bounds[-1][1]
    return bounds


class Stage(nn.Module):
    """Blocks [start, end) of the seeded GPT, plus the embedding on the first stage and ln_f + head on the last.
    The GPT's own parameter names are kept ("blocks.2.attn.q.weight"): the stages together are the GPT."""

    def __init__(self, gpt, s, bounds):
        super().__init__()
        (start, end), self.first, self.last = bounds[s], s == 0, s == len(bounds) - 1
        if self.first:
            self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in range(start, end)})
        if self.last:
            self.ln_f, self.head = gpt.ln_f, gpt.head

    def forward(self, h):  # first stage: (b, T) token ids; others: (b, T, D) from the stage before
        if self.first:  # = GPT.embed
            h = self.drop(self.tok_emb(h) + self.pos_emb(torch.arange(h.shape[1], device=h.device)))
        for block in self.blocks.values():
            h = block(h)  # (b, T, D)
        return self.head(self.ln_f(h)) if self.last else h  # last: logits (b, T, V)


def stage_of(name, bounds):
    """Which stage holds the GPT parameter `name`."""
    if name.startswith(("tok_emb", "pos_emb")):
        return 0
    if name.startswith("blocks."):
        i = int(name.split(".")[1])
        return next(s for s, (a, z) in enumerate(bounds) if a <= i < z)
    return len(bounds) - 1


# ----------------------------------------------------------------------------- the 1F1B schedule
def one_f_one_b(n, p, s):
    """Stage s's order of work for a stream of n micro-batches: p-s-1 warm-up forwards (as many as the stages
    after s need to fill), then one F and one B in turn, then the cool-down backwards. B runs in F's order."""
    warm = min(p - s - 1, n)
    ops = [("F", k) for k in range(warm)]
    for i in range(n - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", k) for k in range(n - warm, n)]


def split_at_step_ends(ops, m):
    """Cut a stage's ops after the backward of each step's last micro-batch: chunk t is what it runs in step t.
    Without a flush (stash, 2bw), chunk t already holds some forwards of step t+1."""
    chunks = [[]]
    for kind, k in ops:
        chunks[-1].append((kind, k))
        if kind == "B" and k % m == m - 1:
            chunks.append([])
    return chunks[:-1]


def p2p(sends, recvs):
    """One batch_isend_irecv of [(tensor, peer)] sends and receives, then wait. A stage sends each result
    together with the receive its next op needs, and its neighbour posts the mirror pair: after F(k) stage s
    sends k's activation and receives the gradient for its next B(j); after B(j) stage s+1 sends that gradient
    and receives k's activation. Two blocking sends facing each other deadlock under NCCL; one batch cannot
    (Megatron-LM's send_forward_recv_backward). Returns the bytes sent."""
    ops = [dist.P2POp(dist.isend, t, peer) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer) for t, peer in recvs]
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return sum(t.numel() * t.element_size() for t, _ in sends)


# Every activation and gradient travels with a 4-number float64 tag (kept in float64 so a loss is exact):
#   forward  [micro-batch k, weight version, 2bw: newest batch whose whole-model grad norm is known, its norm^2]
#   backward [micro-batch k, weight version, loss of k (from the last stage), 2bw: partial grad norm^2]
# The host never reads a tag while the pipeline runs (on a GPU that would stop the stream at every message): the
# numbers it needs to decide (k, versions, which norm is known) follow from the schedule; the tags carry them
# too, and verify_tags() checks them against the schedule once per step. Losses and norms stay on the device.
TAG = 4


class StageRunner:
    """One rank's stage: runs its ops in order, holding what lives between them: the micro-batches in flight,
    the message waiting to be sent with the next receive, the weight versions (stash, 2bw), the events."""

    def __init__(self, d, args, stage, opt, batch_of, act_shape, clock):
        self.d, self.args, self.mode, self.m = d, args, args.mode, args.microbatches
        self.s, self.p, self.stage, self.opt, self.batch_of, self.clock = d.rank, d.world, stage, opt, batch_of, clock
        self.act_shape, self.dtype = act_shape, next(stage.parameters()).dtype  # (b, T, D) crosses a boundary
        self.version = 0  # optimizer steps taken: `stage` (the master the optimizer steps) is this version
        # Weight stashing: a forward never reads the master. Autograd keeps the tensors a forward used, and
        # the next step() would change them in place under a micro-batch still waiting for its backward. So
        # every version a micro-batch may read is a frozen copy, taken right after the step that made it.
        self.snap = {} if self.mode == "flush" else {0: copy.deepcopy(stage)}  # version -> frozen Stage
        self.in_flight = collections.Counter()  # version -> micro-batches between their F and their B
        self.alive = {}  # k -> (input, output, version, bytes held for B)
        self.outbox = []  # the last op's message; it leaves with the next op's receive
        self.due = []  # [(gradient, whole-model norm^2 or None)]: updates to apply before the next op
        self.batch_grads = {}  # 2bw: batch -> its summed gradient, until the whole-model norm arrives
        self.known = (-1, self.tag()[0])  # 2bw: (newest batch whose whole-model norm^2 is known here, it on device)
        self.stage0_version = 0  # --vertical-sync: stage 0's version of the newest micro-batch received
        self.drained_norm = -1  # 2bw: the norm every stage knew at the last drain (see drain)
        self.next_f = 0  # the micro-batch of this stage's next forward
        self.losses = {}  # k -> loss (device): on the last stage from F to B; on stage 0 as its gradient arrives
        self.received = []  # [(what the schedule says the tag holds {index: value}, tag)], until verify_tags
        self.events, self.sent, self.peak_alive, self.peak_versions, self.peak_bytes = [], 0, 0, 1, 0

    def tag(self, *xs):  # (TAG,) on the device, from numbers or 0-d device tensors: no host round trip
        t = torch.zeros(TAG, dtype=torch.float64, device=self.d.device)
        for i, x in enumerate(xs):
            t[i] = x
        return t

    def run(self, ops):
        for kind, k in ops:
            received = self.exchange(kind, k)
            self.apply_due_updates()
            (self.forward if kind == "F" else self.backward)(k, *received)

    def exchange(self, kind, k):
        """Send the outbox and receive this op's input: an activation from s-1 for F, a gradient from s+1 for B."""
        peer = self.s - 1 if kind == "F" else self.s + 1
        if not 0 <= peer < self.p:  # stage 0 reads tokens; the last stage starts B from its own loss
            self.sent += p2p(self.outbox, [])
            self.outbox = []
            return None, None
        x, tag = torch.empty(self.act_shape, dtype=self.dtype, device=self.d.device), self.tag()
        self.sent += p2p(self.outbox, [(x, peer), (tag, peer)])
        self.outbox = []
        expect = {0: k}
        if kind == "F":
            # Stage 0 read version max(0, k-(p-1)) for micro-batch k: its warm-up forwards run before any update.
            self.stage0_version = max(0, k - (self.p - 1))
            expect.update({1: self.stage0_version} if self.args.vertical_sync else {})
            if self.mode == "2bw":  # stage 0 had run B up to k-p when it sent F_k: the norms of its full batches
                t = max((k - self.p + 1) // self.m - 1, self.drained_norm)
                expect[2] = t
                self.learn_norm(t, tag[3])
        self.received.append((expect, tag))
        return x, tag

    def version_for(self, k):
        """The weights micro-batch k reads here. Stash and 2bw name them by the rule of one uninterrupted 1F1B
        stream, so a drain (at a checkpoint) changes the timing only, never which version a micro-batch reads."""
        if self.mode == "2bw":
            return max(k // self.m - 1, 0)  # batch t reads the weights of update t-1
        if self.mode == "stash":  # stage s has had max(0, k - lag) updates when F_k comes (its warm-up: lag forwards)
            lag = self.p - 1 if self.args.vertical_sync else self.p - self.s - 1  # vertical sync: stage 0's lag
            return max(0, k - lag)
        return self.version  # flush: the only version

    def forward(self, k, x, tag):
        step, j = divmod(k, self.m)
        tokens, targets, n_tok = self.batch_of(step)  # (m, b, T) each: step's global batch, as micro-batches
        v = self.version_for(k)
        weights = self.stage if self.mode == "flush" else self.snap[v]
        inp = tokens[j] if self.s == 0 else x.requires_grad_()  # a leaf: its .grad is what B sends back
        start = self.clock.now()
        with SavedActivations() as saved:
            out = weights(inp)  # (b, T, D); last stage: logits (b, T, V) ...
            if self.stage.last:
                out = lm_loss(out, targets[j], n_tok)  # ... and the loss: sum over tokens / global token count
        simulate_compute(self.args.stage_ms)
        self.events.append(dict(rank=self.s, kind="F", mb=k, start=start, end=self.clock.now(), version=v))
        self.in_flight[v] += 1
        self.next_f = k + 1
        held = saved.bytes + out.numel() * out.element_size()  # + the output (the input is among the saved)
        self.alive[k] = (inp, out, v, held)
        self.peak_alive = max(self.peak_alive, len(self.alive))
        if self.stage.last:
            self.losses[k] = out.detach()
        else:
            self.outbox = [(out.detach(), self.s + 1), (self.tag(k, v, *self.known), self.s + 1)]
        self.count_bytes()

    def backward(self, k, grad, tag):
        inp, out, v, _ = self.alive.pop(k)
        start = self.clock.now()
        torch.autograd.backward(out, grad)  # last stage: from the loss itself; the gradients land on `weights`
        simulate_compute(2 * self.args.stage_ms)
        self.events.append(dict(rank=self.s, kind="B", mb=k, start=start, end=self.clock.now(), version=v))
        self.events[-1].update(zip(("grad_version", "live_grad"), grads_landed_on(self)))
        self.in_flight[v] -= 1
        loss, partial = (self.losses.pop(k), self.tag()[0]) if self.stage.last else (tag[2], tag[3])  # on device
        if self.s == 0:
            self.losses[k] = loss  # step t's loss is complete on stage 0 when B of its last micro-batch is
        if self.mode == "stash":  # PipeDream: every backward is an update of this stage
            self.due.append((self.take_grads(v), None))
        if self.mode == "2bw" and k % self.m == self.m - 1:  # the batch's gradient is complete on this stage
            t, grads = k // self.m, self.take_grads(v)
            self.batch_grads[t] = grads
            # The whole-model norm is the sum of every stage's squared norm; stage 0 finishes last, so the
            # partial sum rides down with the gradient, and the total rides back up with an activation.
            partial = partial + sum((g.double() ** 2).sum() for g in grads)
            if self.s == 0:
                self.learn_norm(t, partial)
        if self.s > 0:
            self.outbox = [(inp.grad, self.s - 1), (self.tag(k, v, loss, partial), self.s - 1)]  # (b, T, D)

    def take_grads(self, v):
        """Move micro-batch (stash) or batch (2bw) gradients out of version v: the next user of v starts from 0."""
        grads = [q.grad for q in self.snap[v].parameters()]
        for q in self.snap[v].parameters():
            q.grad = None
        return grads

    def learn_norm(self, t, sq):
        """2bw: batch t's whole-model squared gradient norm (sq, on the device) is known here now, so its update is
        due. It is first needed by batch t+2, which starts on this stage after the norm passes with micro-batch
        (t+1)m + p-1. A message carries only the newest norm its sender knows, so the drain's correctness rests on
        an invariant: every norm a stage learns is the next one it expects. Skipping one would leave that batch's
        gradient unapplied for ever (m < p breaks it: see the guard in main)."""
        if self.mode != "2bw" or t == self.known[0]:
            return  # nothing new
        if t != self.known[0] + 1 or t not in self.batch_grads:
            raise RuntimeError(f"stage {self.s}: 2bw learns the norm of batch {t}, but the next it expects is batch "
                               f"{self.known[0] + 1}'s (gradient held for {sorted(self.batch_grads)}): an update "
                               "would be skipped; the schedule needs --microbatches >= stages")
        self.known = (t, sq)
        self.due.append((self.batch_grads.pop(t), sq))

    def apply_due_updates(self):
        for grads, sq in self.due:
            for q, g in zip(self.stage.parameters(), grads):
                q.grad = g
            if sq is not None:
                clip_grads_(grads, sq.sqrt(), self.args.clip)
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.version += 1
            self.drop_unused_versions()  # first, so a real system could reuse a dropped version's buffer
            self.snap[self.version] = copy.deepcopy(self.stage)  # 2bw: the double buffer's other half
        self.due = []
        self.drop_unused_versions()
        self.peak_versions = max(self.peak_versions, len(self.snap))
        self.count_bytes()

    def drop_unused_versions(self):
        """Keep a version while a micro-batch in flight reads it or one still to come may read it."""
        if self.mode == "2bw":
            floor = max(self.next_f // self.m - 1, 0)  # the version of the next forward's batch
        elif self.args.vertical_sync and self.s > 0 and self.next_f < self.args.steps * self.m:
            floor = self.stage0_version  # stage 0's versions only grow
        else:  # flush, stash: the next forward reads the newest (older after a drain; see version_for)
            floor = min(self.version, self.version_for(self.next_f))
        for v in [v for v in self.snap if v < floor and not self.in_flight[v]]:
            del self.snap[v]

    def drain(self, last):
        """End of a flush step, of the stream, or (stash, 2bw) of a segment before a checkpoint, after batch `last`:
        send what the last op left, apply the updates still due. Then nothing is in flight, and the versions
        kept (self.snap) are all the state the rest of the run needs."""
        self.sent += p2p(self.outbox, [])
        self.outbox = []
        self.apply_due_updates()
        if self.mode == "2bw":
            # the last batch's norm has no activation left to ride on: stage 0 broadcasts it
            known = self.tag(*self.known)
            dist.broadcast(known, src=0)
            self.received.append(({0: last}, known))
            self.learn_norm(last, known[1])
            self.apply_due_updates()
            self.drained_norm = last  # the next segment's tags carry it until stage 0 knows a newer one
        self.verify_tags()

    def state_dict(self):  # for the checkpoint, after a drain: the step count, the versions kept, the known norm
        return dict(version=self.version, known=(self.known[0], self.known[1].cpu()), drained_norm=self.drained_norm,
                    snap={v: w.state_dict() for v, w in self.snap.items()})

    def load_state_dict(self, state):  # after the master `stage` itself is loaded
        self.version, self.drained_norm = state["version"], state["drained_norm"]
        self.known = (state["known"][0], state["known"][1].to(self.d.device))
        self.snap = {v: copy.deepcopy(self.stage) for v in state["snap"]}
        for v, w in self.snap.items():
            w.load_state_dict(state["snap"][v])

    def verify_tags(self):
        """Once per step, one host read for all the step's messages: each tag holds what the schedule says."""
        if self.received:
            got = torch.stack([t for _, t in self.received]).cpu()  # (messages, TAG)
            for (expect, _), row in zip(self.received, got.tolist()):
                if any(row[i] != v for i, v in expect.items()):
                    raise RuntimeError(f"stage {self.s}: a message's tag {row} is not the schedule's {expect}")
        self.received = []

    def flush_update(self):
        """PipeDream-flush: the pipeline is empty; one step with the whole model's norm, as one process would."""
        grads = [q.grad for q in self.stage.parameters()]
        sq = sum((g.double() ** 2).sum() for g in grads).view(1)  # (1,) this stage's squared norm
        dist.all_reduce(sq)  # (1,) summed over stages: the whole model's
        clip_grads_(grads, sq.sqrt(), self.args.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.version += 1

    def count_bytes(self):
        """Parameters, gradients and AdamW state, stashed versions and pending gradients, live activations."""
        extra = [t for w in self.snap.values() for q in w.parameters() for t in (q, q.grad)]
        extra += [g for grads in self.batch_grads.values() for g in grads] + [g for gs, _ in self.due for g in gs]
        now = state_bytes(self.stage, self.opt) + tensor_bytes(extra) + sum(a[3] for a in self.alive.values())
        self.peak_bytes = max(self.peak_bytes, now)


# --- measurement --- (the clock, the counters gathered, the picture, the trace) ----------------------------
class Clock:
    """Times of F and B in ms since one zero common to all stages. CPU: the wall clock, zeroed at the wall time
    the last rank arrived (an all-reduce, which also lines the ranks up; per-process perf_counter zeros after a
    barrier would differ by its exit skew). CUDA: events recorded on the stream, so timing never stops the host
    or the stream; the zero is an event right after the all-reduce, which ends at about the same moment on
    every GPU. `read` turns stamps into ms: one synchronize per step, none per op."""

    def __init__(self, d):
        self.d, self.cuda = d, d.device.type == "cuda"
        t = torch.tensor([time.time() * 1e3], dtype=torch.float64, device=d.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if self.cuda:
            self.zero = self.now()
        else:
            self.t0 = t.item()

    def now(self):
        if not self.cuda:
            return time.time() * 1e3 - self.t0
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def read(self, events):
        if self.cuda:
            torch.cuda.synchronize(self.d.device)
            for e in events:
                if not isinstance(e["start"], float):
                    e["start"], e["end"] = (self.zero.elapsed_time(e[k]) for k in ("start", "end"))
        return events


def simulate_compute(ms):
    """--stage-ms: wait, not compute, so that the schedule sets the timing rather than processes competing for
    a few cores. On a GPU the host waits before the end event is recorded, so the stream's span covers it."""
    if ms > 0:
        time.sleep(ms / 1e3)


def grads_landed_on(runner):
    """Weight stashing, seen from its effect: right after a backward, before its gradient is taken, which stashed
    version's tensors hold a gradient (-1: none, -2: more than one) and whether the live weights (the master the
    optimizer steps) got any (1) or not (0)."""
    holding = [v for v, w in runner.snap.items() if any(q.grad is not None for q in w.parameters())]
    live = any(q.grad is not None for q in runner.stage.parameters())
    return (holding[0] if len(holding) == 1 else -2 if holding else -1), int(live)


EVENT = ["rank", "kind", "mb", "start", "end", "version", "grad_version", "live_grad"]  # one row per F or B
COUNTS = ["alive", "versions", "sent", "bytes"]


def gather(d, runner):
    """Every rank's events and counters as rows of numbers (common.gather_rows: no object collective), on every
    rank: [{events, alive, versions, sent, bytes}] per rank, as the report reads them."""
    rows = [[d.rank, e["kind"] == "B", e["mb"], e["start"], e["end"], e["version"], e.get("grad_version", -1),
             e.get("live_grad", 0)] for e in runner.events]
    ev = gather_rows(d, rows if rows else torch.zeros(0, len(EVENT)))
    counts = gather_rows(d, [[runner.peak_alive, runner.peak_versions, runner.sent, runner.peak_bytes]])
    every = []
    for rank_rows, c in zip(ev, counts):
        events = [dict(zip(EVENT, [int(x) if n not in ("start", "end") else x for n, x in zip(EVENT, r)]))
                  for r in rank_rows.tolist()]
        for e in events:
            e["kind"] = "FB"[e["kind"]]
        every.append(dict(events=events, **dict(zip(COUNTS, map(int, c[0].tolist())))))
    return every


def bubble(events, p, lo, hi):
    """Per rank, the idle share of [lo, hi] ms: 1 - (time in F or B) / (hi - lo)."""
    busy = [0.0] * p
    for e in events:
        busy[e["rank"]] += max(0.0, min(e["end"], hi) - max(e["start"], lo))
    return [1 - b / (hi - lo) for b in busy]


def draw_timeline(events, p, lo, hi, label, max_cols=160):
    """One row per stage, to scale, from the measured events in [lo, hi]: `F3` / `B3` where that micro-batch's
    forward / backward ran (blank to its end), `.` where the stage sat idle."""
    shown = [e for e in events if e["end"] > lo and e["start"] < hi]
    typical = sorted(e["end"] - e["start"] for e in shown)[len(shown) // 2]
    cols = int(min(max_cols, max(60, 3 * (hi - lo) / max(typical, 1e-6))))  # a typical event gets ~3 columns
    per_col, rows = (hi - lo) / cols, []
    for r in range(p):
        row = ["."] * cols
        for e in sorted((e for e in shown if e["rank"] == r), key=lambda e: e["start"]):
            a = min(max(int((e["start"] - lo) / per_col), 0), cols - 1)
            z = max(a + 1, min(cols, round((e["end"] - lo) / per_col)))
            row[a:z] = list(f"{e['kind']}{label(e['mb'])}".ljust(z - a)[:z - a])
        rows.append(f"stage {r} |{''.join(row)}|")
    left = f"{lo:.1f} ms"
    rows.append(f"{'':8}{left}{f'{hi:.1f} ms':>{cols + 2 - len(left)}}")
    return "\n".join(rows)


def write_trace(path, events, p):
    """Chrome trace: one complete event ("ph": "X", microseconds) per F and B, one process per stage."""
    trace = [dict(name=f"{e['kind']}{e['mb']}", cat="forward" if e["kind"] == "F" else "backward", ph="X",
                  ts=1e3 * e["start"], dur=1e3 * (e["end"] - e["start"]), pid=e["rank"], tid=0,
                  args=dict(mb=e["mb"], version=e["version"])) for e in events]
    trace += [dict(name="process_name", ph="M", pid=r, tid=0, args=dict(name=f"stage {r}")) for r in range(p)]
    with open(path, "w") as f:
        json.dump(dict(traceEvents=trace, displayTimeUnit="ms"), f)


def report(d, args, every, bounds, b_bytes, steps_run, segments):
    """Rank 0: the figures of the summary from every rank's events and counts, each beside its theory; prints the
    table, the ASCII timeline, and writes --trace. b_bytes: one micro-batch's (b, T, D) activation in bytes;
    segments: the stretches of 1F1B between drains in this run (stash, 2bw: 1, or more with checkpoints)."""
    p, m = len(bounds), args.microbatches
    events = sorted((e for r in every for e in r["events"]), key=lambda e: (e["rank"], e["start"]))
    n = m if args.mode == "flush" else args.steps * m  # micro-batches between two drains
    if args.mode == "flush":  # the last step, as in gpipe.py
        last = [e for e in events if e["mb"] // m == args.steps - 1]
        lo, hi = min(e["start"] for e in last), max(e["end"] for e in last)
        theory, formula = (p - 1) / (m + p - 1), "(p-1)/(m+p-1), over the last step"
    else:  # the whole run: one fill and one drain per segment (one segment without checkpoints)
        lo, hi, idle = min(e["start"] for e in events), max(e["end"] for e in events), segments * (p - 1)
        theory = idle / (steps_run * m + idle)
        formula = "S(p-1)/(steps*m+S(p-1)) over the whole run, S segments between drains, -> 0 in steady state"
    bub, alive = bubble(events, p, lo, hi), [min(p - s, n) for s in range(p)]
    sent = [r["sent"] / steps_run for r in every]
    sent_theory = [m * (b_bytes + 8 * TAG) * ((s > 0) + (s < p - 1)) for s in range(p)]
    kept = {"flush": [1] * p, "2bw": [2] * p, "stash": [min(p, n)] * p if args.vertical_sync else alive}[args.mode]
    d.log(f"\nsummary ({args.mode}, {p} stages, m = {m}), theory beside each measurement: bubble {formula}; alive "
          f"p - s; weight versions kept; bytes sent per step m x ((b, T, D) + {8 * TAG} B tag) each way")
    d.log("stage | blocks | bubble | theory | alive | theory | versions | theory | sent B/step | theory | mem B")
    for s, (a, z) in enumerate(bounds):
        d.log(f"{s:5d} | {a:2d}..{z - 1:<2d} | {bub[s]:6.3f} | {theory:6.3f} | {every[s]['alive']:5d} | "
              f"{alive[s]:6d} | "
              f"{every[s]['versions']:8d} | {kept[s]:6d} | {sent[s]:11.0f} | {sent_theory[s]:6d} | {every[s]['bytes']}")
    mean = sum(bub) / p
    d.log(f"bubble, mean over stages: measured {mean:.3f}, theory {theory:.3f}, difference {mean - theory:+.3f}"
          + (f" (--stage-ms {args.stage_ms:g}: compute time simulated, each F waits {args.stage_ms:g} ms, each B "
             f"{2 * args.stage_ms:g} ms)" if args.stage_ms else
             " (real compute only: on shared cores this times the OS scheduler; try --stage-ms)"))
    if args.mode == "flush":
        d.log("\ntimeline of the last step, measured (micro-batch numbers within the step):")
        d.log(draw_timeline(events, p, lo, hi, lambda k: k % m))
    else:
        lo = min(e["start"] for e in events if e["mb"] >= max(args.steps - 2, 0) * m)
        d.log("\ntimeline of the last two steps, measured (micro-batches numbered from the start; no drain between "
              "but at a checkpoint):")
        d.log(draw_timeline(events, p, lo, hi, lambda k: k))
    if args.trace:
        write_trace(args.trace, events, p)
        d.log(f"wrote {len(events)} events to {args.trace} (open in https://ui.perfetto.dev)")
    return dict(events=events, bubble=bub, bubble_mean=mean, bubble_theory=theory,
                bubble_theory_formula=formula, stage_ms=args.stage_ms,
                peak_alive_microbatches=[r["alive"] for r in every], peak_alive_theory=alive,
                versions_kept=[r["versions"] for r in every], versions_kept_theory=kept, sent_bytes_per_rank=sent,
                sent_bytes_theory=sent_theory, mem_bytes_per_rank=[r["bytes"] for r in every])


# ----------------------------------------------------------------------------- main
def main():
    args = parse_args(Args)
    p, m = env_world_size(), args.microbatches  # p: stages = processes; m: micro-batches per step
    check_common_args(args)
    if m < 1:
        fail(f"--microbatches must be >= 1, got {m}")
    if args.batch_size % m:
        fit = max(k for k in range(1, m) if args.batch_size % k == 0)
        fail(f"--batch-size {args.batch_size} is not divisible by --microbatches {m}: use --microbatches {fit} "
             f"or --batch-size {(args.batch_size // m + 1) * m}")
    if args.vertical_sync and args.mode != "stash":
        fail(f"--vertical-sync belongs to --mode stash (--mode {args.mode} has no per-micro-batch versions)")
    if args.mode == "stash" and args.clip > 0:
        fail("--mode stash updates each stage right after its backward, before the whole-model gradient norm of "
             "that micro-batch exists (stage 0 finishes it last): pass --clip 0")
    if p == 1:
        fail(f"pipedream.py needs one process per stage, at least 2: torchrun --nproc_per_node="
             f"{max(2, min(4, args.n_layers))} pipedream.py {' '.join(sys.argv[1:])}".rstrip())
    if p > args.n_layers:
        fail(f"{p} stages but --n-layers {args.n_layers}: every stage needs at least one block; use --n-layers {p} "
             f"or more{f', or torchrun --nproc_per_node={args.n_layers}' if args.n_layers >= 2 else ''}")
    if args.mode == "2bw" and m < p:  # see StageRunner.learn_norm
        fail(f"--mode 2bw needs --microbatches >= stages ({p}), got {m}: batch t's gradient norm reaches the later "
             "stages only with the forward of micro-batch (t+1)m+p-1, so with m < p-1 batch t+2 would start before "
             "the update it reads, and with m = p-1 the last batch's forwards end before the second-to-last "
             f"norm can ride on one; use --microbatches {p}")

    # --- setup (same in every file) ---
    d = init_dist(args.timeout)
    data = MarkovData(args.vocab, args.seed)
    bounds = split_layers(args.n_layers, p)
    d.log(f"pipedream.py --mode {args.mode}{' --vertical-sync' if args.vertical_sync else ''}: {p} stages x {m} "
          f"micro-batches of {args.batch_size // m} sequences on {d.backend}; entropy floor {data.entropy:.4f} "
          "nats/token")
    d.log("split: " + " | ".join(f"stage {s}: {'embedding + ' if s == 0 else ''}blocks {a}..{z - 1}"
                                 f"{' + norm + head + loss' if s == p - 1 else ''}" for s, (a, z) in enumerate(bounds)))
    torch.manual_seed(args.seed + d.rank)  # dropout masks (if any) differ per stage
    dtype = DTYPES[args.dtype]
    gpt = build_gpt(GPTConfig.from_args(args), args.seed, dtype)  # the full model on CPU; a stage moves its part
    shapes = {n: q.shape for n, q in gpt.named_parameters()}
    stage = Stage(gpt, d.rank, bounds).to(d.device)
    opt = make_optimizer(stage.parameters(), args)
    timer, tokens = StepTimer(d.device), args.batch_size * args.seq_len
    act_shape = (args.batch_size // m, args.seq_len, args.d_model)  # (b, T, D): what crosses a stage boundary

    @lru_cache(maxsize=2)  # a stage works on at most two steps at once
    def batch_of(step):  # the step's global batch as m micro-batches: (m, b, T) tokens, targets; global n_tok
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global, on CPU
        split = lambda t: rearrange(t, "(m b) n -> m b n", m=m).to(d.device)  # noqa: E731
        return split(x), split(y), count_tokens(y)  # n_tok: tokens of the whole global batch

    clock = Clock(d)  # the timeline's zero; a collective before any point-to-point, as NCCL's batched p2p asks
    runner = StageRunner(d, args, stage, opt, batch_of, act_shape, clock)
    ckpt = Checkpointer(d, args.ckpt_dir, args.save_every, args.steps)
    start, hist = ckpt.load({"model": stage, "optim": opt, "pipe": runner})
    losses = hist.get("losses", [])
    # flush: every step its own 1F1B schedule, drained before the optimizer step. stash, 2bw: one schedule for
    # the run, cut only where a checkpoint is saved (--ckpt-dir): there the pipeline drains, so the checkpoint
    # is a consistent state. The drain adds a fill and a drain (bubble) there; the arithmetic stays that of the
    # uninterrupted stream, since version_for names each micro-batch's weights by the stream's rule.
    ends = [t for t in range(start + 1, args.steps + 1) if args.mode == "flush" or t == args.steps
            or (args.ckpt_dir and args.save_every and t % args.save_every == 0)]
    stream = [(kind, a * m + k) for a, z in zip([start] + ends, ends) for kind, k in one_f_one_b((z - a) * m, p, d.rank)]
    chunks = split_at_step_ends(stream, m)  # chunks[i]: what this stage runs in step start + i
    for step in range(start, args.steps):
        maybe_fail(d, args, step)
        timer.start()
        runner.run(chunks[step - start])
        if step + 1 in ends:
            runner.drain(step)
        if args.mode == "flush":
            runner.flush_update()
        runner.verify_tags()
        clock.read(runner.events)
        ms = timer.stop()
        # stage 0 has every loss of the step now (they came back with the gradients); other ranks log nothing
        losses.append(sum(runner.losses.pop(step * m + j) for j in range(m)).item() if d.rank == 0 else float("nan"))
        log_step(d, step, losses[-1], ms, tokens)
        ckpt.maybe_save(step + 1, {"model": stage, "optim": opt, "pipe": runner}, {"losses": losses})

    # --- measurement: every rank's events and counts; the peak is read before --check trains ---
    every = gather(d, runner)
    figures = dict(split=bounds, stages=p, microbatches=m, mode=args.mode)
    if d.rank == 0 and args.steps > start:
        figures.update(report(d, args, every, bounds, act_shape[0] * act_shape[1] * act_shape[2] *
                              torch.tensor([], dtype=dtype).element_size(), args.steps - start, len(ends)))
    peak = peak_memory_bytes(d, runner.peak_bytes)

    check = None
    if args.check:  # the full model, by name, from every stage's parameters (one all-reduce)
        full = assemble_full(d, dict(stage.named_parameters()), shapes, dtype)
        ref = None
        if d.rank == 0 and args.mode != "flush":
            d.log(f"--check: against the one-process simulation of the {args.mode} rule, not synchronous training")
            ref = simulate_stash(args, p, d.device) if args.mode == "stash" else simulate_2bw(args, d.device)
        check = check_against_reference(d, args, losses, full, ref=ref)
    write_summary(d, args, f"pipedream-{args.mode}", losses, timer.median(), tokens / max(timer.median(), 1e-9) * 1e3,
                  peak, max(figures.get("sent_bytes_per_rank", [0])), check, figures)
    close_dist(ok=check is None or check["passed"])


# ----------------------------------------------------------------------------- the rules in one process (--check)
def simulate_stash(args, p, device="cpu"):
    """PipeDream's rule without a pipeline: micro-batches in stream order k = step*m + j; k's forward and
    backward read, on stage s, the weights after max(0, k - lag_s) updates, lag_s = p-s-1 (p-1 everywhere
    with --vertical-sync); then every stage takes one AdamW step with k's gradient. One AdamW over the whole
    model equals one per stage: with foreach=False it updates each tensor on its own."""
    bounds, m = split_layers(args.n_layers, p), args.microbatches
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, data = make_optimizer(model.parameters(), args), MarkovData(args.vocab, args.seed)
    names = [n for n, _ in model.named_parameters()]
    lag = {n: p - 1 if args.vertical_sync else p - stage_of(n, bounds) - 1 for n in names}
    frozen = lambda: {n: q.detach().clone().requires_grad_() for n, q in model.named_parameters()}  # noqa: E731
    history, losses = {0: frozen()}, []  # history[v]: the weights after v updates
    for step in range(args.steps):
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)
        n_tok, step_loss = count_tokens(y), 0.0
        for j, (xj, yj) in enumerate(zip(x.chunk(m), y.chunk(m))):  # (b, T) micro-batches
            k = step * m + j
            w = {n: history[max(0, k - lag[n])][n] for n in names}
            loss = lm_loss(functional_call(model, w, (xj.to(device),)), yj.to(device), n_tok)
            for q, g in zip(model.parameters(), torch.autograd.grad(loss, [w[n] for n in names])):
                q.grad = g
            opt.step()
            history[k + 1] = frozen()
            history.pop(k + 1 - p, None)  # micro-batch k+1 and later read version k+2-p or newer
            step_loss += loss.item()
        losses.append(step_loss)
    return dict(losses=losses, params={n: q.detach().clone() for n, q in model.named_parameters()})


def simulate_2bw(args, device="cpu"):
    """PipeDream-2BW's rule on the whole model and the whole batch: the gradient of batch t at W_{max(t-1, 0)},
    clipped by torch's clip_grad_norm_, updates the newest weights: W_{t+1} = AdamW(W_t, clip(grad at W_{t-1}))."""
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], device)
    opt, data = make_optimizer(model.parameters(), args), MarkovData(args.vocab, args.seed)
    stale, losses = copy.deepcopy(model), []  # W_{t-1}; batches 0 and 1 both read W_0
    for step in range(args.steps):
        x, y = (t.to(device) for t in data.batch(step, args.batch_size, args.seq_len, args.ragged))
        loss = lm_loss(stale(x), y, count_tokens(y))
        grads = torch.autograd.grad(loss, list(stale.parameters()))
        stale = copy.deepcopy(model)  # W_t: what batch t+1 reads
        for q, g in zip(model.parameters(), grads):
            q.grad = g
        if args.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return dict(losses=losses, params={n: q.detach().clone() for n, q in model.named_parameters()})


if __name__ == "__main__":
    main()
