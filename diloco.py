"""diloco.py: synchronise every H steps. Local SGD, DiLoCo and Streaming DiLoCo, written by hand.

dp.py is one end of data parallelism's trade-off (every rank agrees after every step) and its
parameter server the other (nobody waits). This is the middle, the one that trains across poorly
connected islands of GPUs: each of M workers (one process each, its own slice of every global batch)
trains its own copy of the model for H inner steps with its own AdamW, and only then do they talk.

1. Local SGD / DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
   Models", 2023, Algorithm 1). Every worker starts a round from the same global weights theta;
   after H inner steps worker m holds theta_m. The *pseudo-gradient* Delta = theta - mean_m(theta_m)
   (the average change, sign flipped, so that it points uphill like a gradient) is the only thing
   exchanged, with one all-reduce; an *outer* optimizer steps theta with it, and every worker
   restarts from the new theta:
       theta <- OuterOpt(theta, Delta)        Nesterov momentum, lr 0.7, momentum 0.9 (the paper's)
   Each worker keeps its inner AdamW state across rounds; all start from rank 0's weights (a
   broadcast at a fresh run's first inner step, not at construction: a resumed worker keeps its own,
   mid-round). --outer sgd --outer-lr 1 is theta <- mean(theta_m): local SGD / federated averaging
   (McMahan et al. 2017). With plain SGD inside, H = 1 and that outer step, it is synchronous data
   parallel SGD exactly (a test): the averaged weights are the averaged gradient step.

       worker 0   theta --[H AdamW steps on its slice]--> theta_0   --+
       worker 1   theta --[H AdamW steps on its slice]--> theta_1   --+-- all-reduce theta - theta_m: the
       ...                                                            |   only traffic; then on every worker
       worker M-1 theta --[H AdamW steps on its slice]--> theta_M-1 --+   theta' = OuterOpt(theta, Delta)
   The paper: on C4, 8 workers with H = 500 match fully synchronous training while communicating
   500x less. Memory: theta and the outer momentum are two more copies of the model on every worker.
2. Streaming DiLoCo (Douillard et al., "Streaming DiLoCo with overlapping communication", 2025):
   a. --fragments F: the blocks are dealt into F fragments (strided: fragment f holds blocks f, f+F,
   ...;
      the embeddings ride with fragment 0, the head with the last block's). Fragment f is synced
      every H steps, but at its own offset, (f+1) H/F: the same bytes per round, spread out, so the
      peak bandwidth is F times lower.
   b. --overlap TAU: a fragment's exchange is launched asynchronously and its outer update lands TAU
   inner
      steps later; meanwhile the workers keep training. On landing the worker's fragment becomes mix
      * (its own, TAU steps further) + (1 - mix) * (the new global one) (--mix; torchft's
      fragment_update_alpha; 0 drops the TAU local steps of that fragment). The exchange runs on a
      group of its own: on NCCL its own communicator and stream, so the loss's all-reduce (on WORLD)
      does not queue behind it, and the step is timed on the host after the loss's .item() (its
      compute stream), not with a device-wide synchronize that would wait for the exchange. The run
      prints how long training stalled on each exchange at its landing (exposed: on CUDA between two
      events around the wait, since NCCL's wait() returns at once) beside the exchange's own time
      (launch to completion). Where the schedule differs from torchft's Streaming DiLoCo:
      - launched at the sync point, landed TAU steps later; torchft launches TAU steps early and
        lands on it;
      - TAU may be up to H - 1 (exchanges of several fragments then overlap); torchft requires TAU <
        H/F;
      - the average is over the fixed world; torchft's is over the live quorum of replicas.
   c. --outer-dtype bfloat16 (float16, float8_e4m3fn; float32 under float64): pseudo-gradients
   travel in
      low precision. An all-reduce in bfloat16 would round every partial sum in an order only the
      backend knows; here each worker's rounded pseudo-gradient is all-gathered and summed in rank
      order in the parameter dtype, on every rank: exact, and --check's reference rounds and sums
      the same way. float8 is scaled first (one scale per fragment and worker, so that its largest
      element is float8's largest; a pseudo-gradient of 1e-3 would otherwise flush to 0) and travels
      as bytes, scale appended. It costs bytes: an all-gather hands over n x b B per rank but a ring
      sends (M-1) n x b B, against 2 (M-1)/M n x 4 B for a float32 all-reduce: for bfloat16 cheaper
      below M = 4, dearer beyond (the paper quantises to 4 bits; exactness against a reference is
      what this file chose).

      step    1 2 3 4 5 6 7 8 9 10 11 12      H = 4, F = 2, TAU = 1 (each fragment syncs every 4 steps)
      frag 0  . S L . . S L . . S  L  .       S: its all-reduce is launched after that inner step
      frag 1  . . . S L . . S L .  .  S       L: it lands one step later: outer step, merge
      bytes   . n . n . n . n . n  .  n       n = half the model (the pseudo-gradient of one fragment)

Bytes per inner step: DDP all-reduces every gradient every step (P x 4 B in float32); DiLoCo P x b /
H (b: bytes per element on the wire), measured at the dispatcher below: the ratio is H (x 4/b).

Loss gap to the entropy floor against bytes, DDP beside H = 5, 20 and 50 at world 4 (600 steps):
docs/diloco.md. In that run H = 20 and 50 reach DDP's training loss with 20x and 50x fewer bytes.

Run:
    python diloco.py --check                                      # world 1: one worker
    torchrun --nproc_per_node=4 diloco.py --inner-steps 10 --check
    torchrun --nproc_per_node=4 diloco.py --inner-steps 10 --fragments 2 --overlap 2 --mix 0.5 \
        --outer-dtype bfloat16 --check                            # Streaming DiLoCo
    torchrun --nproc_per_node=2 --max-restarts=1 diloco.py --inner-steps 4 --fragments 2 --overlap 1 \
        --ckpt-dir D --save-every 3 --fail-at-step 5               # a worker dies; the rerun ends as if not
In production: torchft's DiLoCo / LocalSGD, or OpenDiLoCo (Prime Intellect).
"""

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from common import (
    DTYPES,
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
    Run,
    StepTimer,
    check_against_reference,
    check_common_args,
    env_world_size,
    parse_args,
    peak_memory_bytes,
    state_bytes,
)

WIRES = Literal["same", "float32", "bfloat16", "float16", "float8_e4m3fn"]


@dataclass
class Args(CommonArgs):
    inner_steps: int = 10  # H: inner steps per worker between two syncs of a fragment
    inner: Literal["adamw", "sgd"] = "adamw"  # inner optimizer, one per worker (sgd: no momentum)
    outer: Literal["nesterov", "sgd"] = "nesterov"  # outer optimizer on the global weights
    outer_lr: float = 0.7  # outer learning rate (the paper's 0.7; sgd at 1.0: federated averaging)
    outer_momentum: float = 0.9  # Nesterov momentum of the outer optimizer (the paper's 0.9)
    fragments: int = 1  # F: Streaming DiLoCo's fragments, synced at staggered steps (1: DiLoCo)
    overlap: int = 0  # TAU: inner steps between a fragment's exchange starting and its outer update
    mix: float = 0.0  # on landing, worker fragment = mix * local + (1 - mix) * new global
    outer_dtype: WIRES = "same"  # the pseudo-gradients' dtype on the wire


# ------------------------------------------------------------------------ 1: DiLoCo (and local SGD)
def check_outer(inner_steps, outer_lr, outer_momentum, nesterov):
    """What DiLoCo relies on (check_args calls it too): a ValueError naming what would work."""
    if inner_steps < 1:
        raise ValueError(f"DiLoCo: inner_steps must be >= 1, got {inner_steps}")
    if not outer_lr > 0 or nesterov and not 0 < outer_momentum < 1:  # written so that nan fails too
        raise ValueError(
            f"DiLoCo: the outer step needs outer_lr > 0 and, with nesterov, 0 < outer_momentum "
            f"< 1 (the paper: 0.7, 0.9; none: plain SGD), not {outer_lr} and {outer_momentum}"
        )


class DiLoCo:
    """The outer loop of DiLoCo around any model and inner optimizer: on every worker (every rank of
    `group`) call before_inner_step() before and after_inner_step(t) after each inner step t
    (0-based); every H-th one syncs. This holds the global weights theta (a copy of `params`, the
    worker's own parameters) and the outer optimizer's state. Outer SGD with lr 1 and no momentum
    (nesterov=False, outer_momentum=0) is local SGD."""

    def __init__(
        self, params, inner_steps, outer_lr=0.7, outer_momentum=0.9, nesterov=True, group=None
    ):
        check_outer(inner_steps, outer_lr, outer_momentum, nesterov)
        self.H = inner_steps
        self.group = group
        self.M = dist.get_world_size(group)
        self.local = [list(params)]  # one fragment: the whole model (Streaming DiLoCo has several)
        self.glob = [[p.detach().clone() for p in frag] for frag in self.local]  # theta
        self.outer = torch.optim.SGD(
            [g for frag in self.glob for g in frag],
            lr=outer_lr,
            foreach=False,
            momentum=outer_momentum if nesterov else 0.0,
            nesterov=nesterov,
        )
        # Not synced here: a worker whose model was loaded before this was built holds its own
        # weights, which differ from rank 0's mid-round. The first inner step of a fresh run syncs
        # (torchft's Manager does so too); a resumed run's state says it has started.
        self.started = False

    def before_inner_step(self):
        if not self.started:
            self.start()

    @torch.no_grad()
    def start(self):
        """Every worker starts from the group's rank 0's theta, as DDP and torchft do: workers built
        from other seeds would otherwise train apart, silently."""
        for frag, glob in zip(self.local, self.glob):
            for p, g in zip(frag, glob):
                dist.broadcast(p, group_src=0, group=self.group)
                g.copy_(p)
        self.started = True

    def after_inner_step(self, t):
        if not self.started:
            raise RuntimeError("DiLoCo: call before_inner_step() before each inner step")
        if (t + 1) % self.H == 0:
            self.sync()

    @torch.no_grad()
    def sync(self):
        # 1. this worker's pseudo-gradient Delta_m = theta - theta_m, flat: one all-reduce for the
        #   model
        delta = torch.cat([(g - p).flatten() for g, p in zip(self.glob[0], self.local[0])])  # (P,)
        dist.all_reduce(delta, group=self.group)  # (P,) sum over workers, the same on every rank
        self.outer_step(0, delta / self.M)  # 2. Delta = mean_m Delta_m: the outer step on theta
        self.restart(0)  # 3. every worker continues from the new theta

    def outer_step(self, f, mean):
        """theta <- OuterOpt(theta, Delta) for fragment f; `mean`: (n,) its Delta, flat."""
        glob = self.glob[f]
        for g, piece in zip(glob, mean.split([g.numel() for g in glob])):
            g.grad = piece.view_as(g)  # Delta plays the gradient
        self.outer.step()  # steps only the parameters that have a .grad: this fragment's
        for g in glob:
            g.grad = None

    def restart(self, f):
        for g, p in zip(self.glob[f], self.local[f]):
            p.copy_(g)

    def finish(self):  # nothing in flight here (Streaming DiLoCo lands its exchanges)
        pass

    def global_params(self):
        return [g for frag in self.glob for g in frag]

    # For a restart, besides the worker's model and inner optimizer: theta and the outer momentum.
    def state_dict(self):
        return dict(
            glob=[[g.detach().clone() for g in frag] for frag in self.glob],
            outer=self.outer.state_dict(),
            started=self.started,
        )

    @torch.no_grad()
    def load_state_dict(self, state):
        for frag, saved in zip(self.glob, state["glob"]):
            for g, s in zip(frag, saved):
                g.copy_(s)
        self.outer.load_state_dict(state["outer"])
        self.started = state["started"]


# ----------------------------------------------------------------------------- 2: Streaming DiLoCo
@dataclass
class Exchange:
    """One fragment's pseudo-gradient in flight."""

    fragment: int
    lands: int  # the inner step after which its outer update is applied
    out: torch.Tensor  # (n,) the sum over workers (all-reduce), or (M, n) every worker's
    work: object = None  # the asynchronous collective; None once waited


def check_schedule(inner_steps, n_fragments, overlap, mix):
    """What Streaming DiLoCo's schedule relies on (check_args calls it too)."""
    H, F = inner_steps, n_fragments
    if H % F:
        raise ValueError(
            f"StreamingDiLoCo: need inner_steps % fragments == 0 (got {H} % {F}): fragments "
            "sync H/F steps apart"
        )
    if not 0 <= overlap < H:
        raise ValueError(
            f"StreamingDiLoCo: need 0 <= overlap < inner_steps = {H} (got {overlap}): an update "
            "lands before its fragment's next sync"
        )
    if not 0 <= mix < 1:
        raise ValueError(f"StreamingDiLoCo: need 0 <= mix < 1 (got {mix})")


class StreamingDiLoCo(DiLoCo):
    """DiLoCo with the model in `fragments` (lists of the worker's parameters, disjoint, covering
    it), fragment f synced after the inner steps t with t + 1 = (f + 1) H / F (mod H); each exchange
    launched asynchronously and landed `overlap` inner steps later, the worker's fragment then mixed
    with the new theta by `mix`. wire_dtype: None = all-reduce in the parameters' dtype; else
    all-gather in wire_dtype and sum in rank order in the parameters' dtype (exact). Every rank
    makes the same calls in the same order, so the same collectives are issued in the same order, as
    NCCL requires."""

    def __init__(
        self,
        fragments,
        inner_steps,
        outer_lr=0.7,
        outer_momentum=0.9,
        nesterov=True,
        overlap=0,
        mix=0.0,
        wire_dtype=None,
        group=None,
    ):
        H = inner_steps
        F = len(fragments)
        every = [p for frag in fragments for p in frag]
        if not fragments or not all(fragments):
            raise ValueError(
                f"StreamingDiLoCo: need at least one fragment and a parameter in each, got "
                f"fragment sizes {[len(f) for f in fragments]}: non-empty lists of parameters"
            )
        if len({id(p) for p in every}) < len(every):
            raise ValueError(
                "StreamingDiLoCo: a parameter is in two fragments: deal each to exactly one"
            )
        if wire_dtype is not None and not wire_dtype.is_floating_point:
            raise ValueError(
                f"StreamingDiLoCo: wire_dtype must be a float dtype (torch.bfloat16, ...), "
                f"not {wire_dtype}"
            )
        check_schedule(H, F, overlap, mix)
        super().__init__(every, H, outer_lr, outer_momentum, nesterov, group)
        theta = iter(self.glob[0])  # the same copies, the outer optimizer's, dealt out
        self.local, self.glob = fragments, [[next(theta) for _ in frag] for frag in fragments]
        self.overlap = overlap
        self.mix = mix
        self.wire = wire_dtype
        self.offsets = [(f + 1) * H // F % H for f in range(F)]  # t + 1 = offset (mod H): a sync
        # Exchanges in flight, in launch order (= landing order: TAU is one number)
        self.pending = []

    def syncs_after(self, t):
        """The fragments whose exchange starts after inner step t (0-based)."""
        return [f for f, off in enumerate(self.offsets) if (t + 1) % self.H == off]

    def after_inner_step(self, t):
        if not self.started:
            raise RuntimeError("StreamingDiLoCo: call before_inner_step() before each inner step")
        for f in self.syncs_after(t):
            self.pending.append(self.send(f, t + self.overlap))
        while self.pending and self.pending[0].lands <= t:  # TAU = 0: the one just sent lands now
            self.land(self.pending.pop(0))

    @torch.no_grad()
    def send(self, f, lands):
        """1. Delta_m for fragment f, flat; start its exchange; do not wait for it."""
        pairs = zip(self.glob[f], self.local[f])
        delta = torch.cat([(g - p).flatten() for g, p in pairs])  # (n,) mine
        if self.wire is None:  # the sum over workers, in place, in an order that is the backend's
            return Exchange(
                f, lands, delta, dist.all_reduce(delta, group=self.group, async_op=True)
            )
        low = self.encode(delta)  # (k,) rounded once, here, by this worker
        out = low.new_empty(self.M * low.numel())  # (M k,) every worker's, in rank order
        work = dist.all_gather_single(out, low, group=self.group, async_op=True)
        return Exchange(f, lands, out.view(self.M, -1), work)

    def encode(self, delta):
        """(n,) -> what travels. float8: scaled so its largest element is float8's largest (else a
        pseudo-gradient of ~1e-3 would flush to 0), as bytes, with the scale's bytes appended."""
        if self.wire.itemsize > 1:
            return delta.to(self.wire)  # (n,)
        scale = delta.abs().max().clamp_min(1e-30) / torch.finfo(self.wire).max  # () param dtype
        q = (delta / scale).to(self.wire)  # (n,) float8
        # (n + 8,) for float64
        return torch.cat([q.view(torch.uint8), scale.reshape(1).view(torch.uint8)])

    def decode(self, row, dtype):
        """One worker's wire row -> (n,) in the parameters' dtype."""
        if self.wire.itemsize > 1:
            return row.to(dtype)
        # the scale's bytes, at the end: copied out before the view, since a row of n + k bytes puts
        # them at an offset k need not divide
        k = torch.finfo(dtype).bits // 8
        scale = row[-k:].clone().view(dtype)
        return row[:-k].view(self.wire).to(dtype) * scale

    @torch.no_grad()
    def land(self, ex):
        """2. Wait for the exchange (TAU steps later), the outer step on fragment f of theta; 3. the
        worker's fragment = mix * its own (TAU steps further) + (1 - mix) * the new theta."""
        self.wait(ex)
        dtype = self.glob[ex.fragment][0].dtype
        if self.wire is None:
            total = ex.out  # (n,)
        else:  # sum in rank order, in the parameters' dtype: the same bits on every rank
            total = self.decode(ex.out[0], dtype)
            for m in range(1, self.M):
                total = total + self.decode(ex.out[m], dtype)
        self.outer_step(ex.fragment, total / self.M)
        self.restart(ex.fragment)

    def restart(self, f):
        for g, p in zip(self.glob[f], self.local[f]):
            p.mul_(self.mix).add_(g, alpha=1 - self.mix) if self.mix else p.copy_(g)

    @staticmethod
    def wait(ex):
        if ex.work is not None:
            ex.work.wait()
            ex.work = None

    def finish(self):
        """Land every exchange still in flight (the end of training)."""
        while self.pending:
            self.land(self.pending.pop(0))

    # The exchanges in flight too: waited here, so their results are saved and nothing is sent
    # twice.
    def state_dict(self):
        for ex in self.pending:
            self.wait(ex)
        pending = [(ex.fragment, ex.lands, ex.out.clone()) for ex in self.pending]
        return dict(super().state_dict(), pending=pending)

    def load_state_dict(self, state):
        super().load_state_dict(state)
        dev = self.glob[0][0].device
        self.pending = [Exchange(f, lands, out.to(dev)) for f, lands, out in state["pending"]]


def check_fragment_count(n, n_blocks):
    if not 1 <= n <= n_blocks:
        raise ValueError(
            f"gpt_fragments: {n} fragments of {n_blocks} blocks: a fragment holds whole blocks, "
            f"so 1 <= n <= {n_blocks}"
        )


def gpt_fragments(model, n):
    """Streaming DiLoCo's fragments of the repo's GPT: block i in fragment i mod n (strided, which
    the paper found a little better than contiguous); the embeddings join fragment 0, ln_f and the
    head the fragment of the last block."""
    check_fragment_count(n, len(model.blocks))
    frags = [list(b.parameters()) for b in model.blocks[:n]]
    for i, b in enumerate(model.blocks[n:], n):
        frags[i % n] += list(b.parameters())
    frags[0] = [model.tok_emb.weight, model.pos_emb.weight] + frags[0]
    frags[(len(model.blocks) - 1) % n] += list(model.ln_f.parameters()) + list(
        model.head.parameters()
    )
    return frags


# ---------------------------------------------------------------------------- argument checks, main
def check_args(args):
    check_common_args(args)
    world = env_world_size()
    if args.batch_size % world:
        fail(
            f"--batch-size {args.batch_size} is not divisible by the {world} workers; try "
            f"--batch-size {world * max(1, args.batch_size // world)}"
        )
    try:  # the cores' own checks, before any process group exists (--inner-steps, --fragments, ...)
        check_outer(args.inner_steps, args.outer_lr, args.outer_momentum, args.outer == "nesterov")
        check_fragment_count(args.fragments, args.n_layers)
        check_schedule(args.inner_steps, args.fragments, args.overlap, args.mix)
    except ValueError as e:
        fail(str(e))
    if args.check and args.dropout > 0:
        fail(
            f"--check needs --dropout 0 (got {args.dropout}): the reference cannot replay every "
            "worker's dropout stream"
        )
    if (
        args.outer_dtype != "same"
        and torch.finfo(getattr(torch, args.outer_dtype)).bits
        > torch.finfo(DTYPES[args.dtype]).bits
    ):
        fail(
            f"--outer-dtype {args.outer_dtype} is wider than --dtype {args.dtype}: use "
            "--outer-dtype same"
        )


def make_inner(model, args):
    if args.inner == "sgd":  # plain SGD: the equivalence with synchronous data parallel SGD
        return torch.optim.SGD(model.parameters(), lr=args.lr, foreach=False)
    return make_optimizer(model.parameters(), args)  # the repo's AdamW, this worker's own state


def inner_step(model, opt, x, y, clip):
    """One inner step of this worker on its own slice (b, T): the loss is the mean over *its* tokens
    (a worker trains alone), clipped by the norm of its own gradient. No communication."""
    loss = lm_loss(model(x), y, count_tokens(y))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return loss.detach()


def wire_dtype(args):
    same = args.outer_dtype in ("same", args.dtype)
    return None if same else DTYPES.get(args.outer_dtype) or getattr(torch, args.outer_dtype)


def train_diloco(d, args, data, model):
    inner = make_inner(model, args)
    outer = (args.outer_lr, args.outer_momentum, args.outer == "nesterov")
    # The exchange on a group of its own: on NCCL its own communicator, hence its own stream, so
    # that the loss's all-reduce on WORLD below is not queued behind an exchange in flight (work on
    # one communicator runs in issue order) and the exchange overlaps the next inner steps for real.
    exchange = dist.new_group(list(range(d.world)))
    if args.fragments == 1 and args.overlap == 0 and args.mix == 0 and wire_dtype(args) is None:
        diloco = DiLoCo(model.parameters(), args.inner_steps, *outer, group=exchange)
    else:
        diloco = StreamingDiLoCo(
            gpt_fragments(model, args.fragments),
            args.inner_steps,
            *outer,
            args.overlap,
            args.mix,
            wire_dtype(args),
            group=exchange,
        )
    run = Run(d, args, {"model": model, "inner": inner, "diloco": diloco})
    # A host timer: loss.item() below has waited for the step's compute stream; StepTimer's
    # device-wide synchronize would also wait for the exchange on its own stream, exposing it.
    run.timer = StepTimer(torch.device("cpu"))
    watch = ExchangeWatch(diloco)  # measurement, below
    comm = CommCounter({"exchange": exchange}, log=True)
    rows = args.batch_size // d.world
    counted = range(max(run.start, args.steps - args.inner_steps), args.steps)  # one period
    for step in run.steps():
        x, y = data.batch(step, args.batch_size, args.seq_len, args.ragged)  # (B, T) global, CPU
        x, y = (t[d.rank * rows : (d.rank + 1) * rows].to(d.device) for t in (x, y))  # (B/M, T)
        diloco.before_inner_step()  # a fresh run's first step: every worker from rank 0's weights
        with comm if step in counted else contextlib.nullcontext():
            loss = inner_step(model, inner, x, y, args.clip)
            diloco.after_inner_step(step)
        # the workers' mean loss, for the log line only, on WORLD: not behind the exchange's stream
        dist.all_reduce(loss, group=dist.group.WORLD)
        run.end_step(step, loss.item() / d.world)
    diloco.finish()
    peak = peak_memory_bytes(d, state_bytes(model, inner) + state_bytes_of(diloco))  # first
    figures = figures_of(d, args, model, diloco, comm, len(counted), data)
    figures.update(watch.figures(d, run.start, run.timer.ms))
    check = None
    if args.check:
        # theta and every worker's own weights, against the one-process simulation of M workers
        mine = final_params(d, model, diloco)
        ref = reference(args, d.world, d.device) if d.rank == 0 else None
        check = check_against_reference(d, args, run.losses, mine, ref=ref)
    run.finish("diloco", peak, figures["bytes_per_inner_step"], check, figures)


def main():
    args = parse_args(Args)
    check_args(args)
    d = init_dist(args.timeout)  # --- setup (same in every file) ---
    data = MarkovData(args.vocab, args.seed)
    d.log(
        f"diloco.py: {d.world} workers, H {args.inner_steps}, {args.fragments} fragment(s), "
        f"overlap {args.overlap}, outer {args.outer} lr {args.outer_lr}, wire {args.outer_dtype}; "
        f"entropy floor {data.entropy:.4f} nats/token"
    )
    torch.manual_seed(args.seed + d.rank)  # dropout differs across workers, as on other data
    model = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    train_diloco(d, args, data, model)


# --- measurement ---
class ExchangeWatch:
    """Streaming DiLoCo's exchanges, watched from outside through this instance's send and wait
    (wrapped here): when each was launched (after which inner step), when its work completed (a
    thread polls is_completed(), which waits for nothing), and how long training stalled on it at
    landing: the exposed communication. On NCCL wait() only makes the compute stream wait for the
    exchange's and returns at once, so the host's time in wait() says nothing there: on CUDA the
    stall is the time between two events recorded on the current stream around the wait; elsewhere,
    from the wait's start to the completion the poller saw (gloo's wait() blocks until then).
    DiLoCo's all-reduce is blocking: all of it is exposed, and nothing is recorded here."""

    def __init__(self, diloco):
        self.done = {}  # id(Exchange) -> perf_counter when its work was first seen complete
        # [launched after step, landed in step, launch time, wait start, wait end, Exchange, CUDA
        # events]
        self.rows = []
        self.poll = []  # (Exchange, work) not yet seen complete
        self.step = None
        self.thread = None
        if isinstance(diloco, StreamingDiLoCo):
            send = diloco.send
            wait = diloco.wait
            after = diloco.after_inner_step
            diloco.send = lambda f, lands: self._sent(send(f, lands))
            diloco.wait = lambda ex: self._waited(wait, ex)
            diloco.after_inner_step = lambda t: self._step(after, t)

    def _step(self, after, t):
        self.step = t
        after(t)

    def _sent(self, ex):
        self.rows.append([self.step, None, time.perf_counter(), None, None, ex, None])
        if ex.work is not None:
            self.poll.append((ex, ex.work))
            if len(self.poll) == 1:
                self.thread = threading.Thread(target=self._poller, daemon=True)
                self.thread.start()
        return ex

    def _poller(self):
        while self.poll:
            for ex, work in list(self.poll):
                if work.is_completed():
                    self.done.setdefault(id(ex), time.perf_counter())
                    self.poll.remove((ex, work))
            time.sleep(5e-4)

    def _waited(self, wait, ex):
        work = ex.work
        events = None
        if ex.out.is_cuda:
            events = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            events[0].record()
        t0 = time.perf_counter()
        wait(ex)
        t1 = time.perf_counter()
        if events:
            events[1].record()
        if work is not None and work.is_completed():  # gloo: wait() returned once it completed
            self.done.setdefault(id(ex), t1)
        for row in self.rows:
            if row[5] is ex and row[1] is None:
                row[1] = self.step
                row[3:5] = [t0, t1]
                row[6] = events

    def exposed_ms(self, row):
        """The stall of one exchange at its landing, in ms (measured)."""
        if row[6] is not None:
            row[6][1].synchronize()
            return row[6][0].elapsed_time(row[6][1])  # the compute stream's, between two events
        return 1e3 * max(0.0, self.done[id(row[5])] - row[3])  # from the wait to the completion

    def figures(self, d, start, step_ms):
        """Per exchange: its own time (launch to completion), the stall it caused at landing
        (exposed) and the host's time in wait(); per step: exposed time over the run; and the median
        step time while an exchange is in flight (strictly between its launch and its landing step)
        beside the other steps'."""
        if self.thread is not None:
            # the poller sees every work complete (all were waited for)
            self.thread.join(timeout=60)
        rows = [r for r in self.rows if r[1] is not None and id(r[5]) in self.done]
        if not rows:
            return {}
        own = [1e3 * (self.done[id(r[5])] - r[2]) for r in rows]
        exposed = [self.exposed_ms(r) for r in rows]
        blocked = [1e3 * (r[4] - r[3]) for r in rows]
        flying = {t for r in rows for t in range(r[0] + 1, r[1])}
        ms = {start + i: m for i, m in enumerate(step_ms)}
        med = lambda xs: statistics.median(xs) if xs else float("nan")
        in_flight = med([m for t, m in ms.items() if t in flying])
        other = med([m for t, m in ms.items() if t not in flying])
        per_step = sum(exposed) / max(len(step_ms), 1)
        where = "CUDA events around the wait" if rows[0][6] else "from the wait to its completion"
        d.log(
            f"summary: exchange time {sum(own) / len(own):.1f} ms (measured, launch to completion, "
            f"mean of {len(own)}); exposed {sum(exposed) / len(exposed):.1f} ms per exchange, "
            f"{per_step:.2f} ms per inner step (measured: {where}; the host blocked in wait() "
            f"{sum(blocked) / len(blocked):.1f} ms); median step {in_flight:.1f} ms with an "
            f"exchange in flight, {other:.1f} ms otherwise"
        )
        return dict(
            exchange_ms=own,
            exchange_exposed_ms=exposed,
            exchange_host_wait_ms=blocked,
            exposed_ms_per_step=per_step,
            exchange_steps=[[r[0], r[1]] for r in rows],
            step_ms_in_flight=in_flight,
            step_ms_other=other,
        )


def state_bytes_of(diloco):
    """The global copy and the outer momentum: DiLoCo's memory on top of plain training (2 models
    more)."""
    held = diloco.global_params() + [
        v for s in diloco.outer.state.values() for v in s.values() if torch.is_tensor(v)
    ]
    return sum(t.numel() * t.element_size() for t in held)


def figures_of(d, args, model, diloco, comm, counted_steps, data):
    """Bytes handed to collectives per inner step, counted at the dispatcher over the last H steps
    (one period: every fragment once), beside theory and beside DDP's (theory: every gradient, every
    step)."""
    n_params = sum(p.numel() for p in model.parameters())
    elem = next(model.parameters()).element_size()
    wire = torch.finfo(wire_dtype(args)).bits // 8 if wire_dtype(args) else elem
    per_step = comm.total() / max(counted_steps, 1)
    scales = args.fragments * elem if wire == 1 else 0  # float8: one scale per fragment
    theory = (n_params * wire + scales) / args.inner_steps
    ddp = n_params * elem
    # measured: the largest one call
    peak_sync = max((c["bytes"] for c in comm.calls_log), default=0)
    peak_theory = max(sum(p.numel() for p in f) for f in diloco.local) * wire + (
        elem if wire == 1 else 0
    )
    op = "all_gather" if wire_dtype(args) else "all_reduce"
    ring = (d.world - 1) * per_step if wire_dtype(args) else 2 * (d.world - 1) / d.world * per_step
    glob = build_gpt(GPTConfig.from_args(args), args.seed, DTYPES[args.dtype], d.device)
    with torch.no_grad():
        for n, p in glob.named_parameters():
            p.copy_(theta_by_name(model, diloco)[n])
        # held out
        x, y = (t.to(d.device) for t in data.batch(10**6, args.batch_size, args.seq_len))
        held_out = lm_loss(glob(x), y, count_tokens(y)).item()
    d.log(
        f"summary: {per_step:.0f} B handed to {op} per inner step (measured over {counted_steps} "
        f"steps); theory P x {wire} B / H = {theory:.0f}; DDP all-reduces P x {elem} B = {ddp} B "
        f"per step (theory): {ddp / max(per_step, 1e-9):.1f}x more; one exchange hands over at "
        f"most {peak_sync} B (measured; the largest fragment, theory {peak_theory} B); ring bytes "
        f"sent per inner step {ring:.0f} (theory); the final global weights' loss on a held-out "
        f"batch {held_out:.4f} (floor {data.entropy:.4f})"
    )
    return dict(
        bytes_per_inner_step=per_step,
        bytes_per_inner_step_theory=theory,
        ddp_bytes_per_step_theory=ddp,
        ratio_vs_ddp=ddp / max(per_step, 1e-9),
        bytes_per_sync_max=peak_sync,
        bytes_per_sync_max_theory=peak_theory,
        ring_bytes_sent_per_inner_step_theory=ring,
        comm_table=comm.table(),
        held_out_loss=held_out,
        entropy_floor=data.entropy,
    )


def theta_by_name(model, diloco):
    """The global weights by the model's parameter names (fragments deal the parameters out of
    order)."""
    by_param = dict(zip((id(p) for f in diloco.local for p in f), diloco.global_params()))
    return {n: by_param[id(p)].detach() for n, p in model.named_parameters()}


def final_params(d, model, diloco):
    """{"global.<name>": theta, "worker<m>": worker m's flat weights}, on every rank (one
    all-gather)."""
    out = {f"global.{n}": g for n, g in theta_by_name(model, diloco).items()}
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])  # (P,)
    every = flat.new_empty(d.world * flat.numel())
    dist.all_gather_single(every, flat, group=dist.group.WORLD)
    out.update({f"worker{m}": w for m, w in enumerate(every.view(d.world, -1))})
    return out


# --- reference for --check ---
def reference(args, M, device="cpu"):
    """One process, no communication: the M workers in turn, each with its own model and inner
    optimizer, the global weights and a Nesterov / SGD outer step written out here, the same
    fragment schedule and delay, and the same rounding and rank-order sum of a low-precision
    exchange."""
    data, dt = MarkovData(args.vocab, args.seed), DTYPES[args.dtype]
    cfg = GPTConfig.from_args(args)
    H = args.inner_steps
    F = args.fragments
    tau = args.overlap
    workers = [build_gpt(cfg, args.seed, dt, device) for _ in range(M)]
    opts = [make_inner(w, args) for w in workers]
    names = [n for n, _ in workers[0].named_parameters()]
    # parameter name -> fragment, from the block index (the same dealing, written again)
    frag_of = {}
    for n in names:
        if n.startswith("blocks."):
            frag_of[n] = int(n.split(".")[1]) % F
        else:
            frag_of[n] = 0 if n.split(".")[0] in ("tok_emb", "pos_emb") else (args.n_layers - 1) % F
    theta = {n: p.detach().clone() for n, p in workers[0].named_parameters()}
    buf = {}  # outer momentum
    wire = wire_dtype(args)
    in_flight, losses = [], []  # (lands, fragment, {name: mean Delta})
    for t in range(args.steps):
        x, y = data.batch(t, args.batch_size, args.seq_len, args.ragged)
        rows, step_loss = args.batch_size // M, 0.0
        for m in range(M):
            xm, ym = (v[m * rows : (m + 1) * rows].to(device) for v in (x, y))
            loss = lm_loss(workers[m](xm), ym, count_tokens(ym))
            opts[m].zero_grad(set_to_none=True)
            loss.backward()
            if args.clip > 0:
                torch.nn.utils.clip_grad_norm_(workers[m].parameters(), args.clip)
            opts[m].step()
            step_loss += loss.item()
        losses.append(step_loss / M)
        for f in range(F):
            # fragment f syncs: every worker's Delta, summed
            if (t + 1) % H == (f + 1) * H // F % H:
                mine = [n for n in names if frag_of[n] == f]
                deltas = [
                    {n: theta[n] - p.detach() for n, p in w.named_parameters() if n in mine}
                    for w in workers
                ]
                if wire is not None:
                    deltas = [rounded(dm, wire) for dm in deltas]
                mean = {}
                for n in mine:
                    total = deltas[0][n]
                    for dm in deltas[1:]:
                        total = total + dm[n]
                    mean[n] = total / M
                in_flight.append((t + tau, f, mean))
        while in_flight and in_flight[0][0] <= t:
            outer_update(args, theta, buf, workers, *in_flight.pop(0)[1:])
    while in_flight:
        outer_update(args, theta, buf, workers, *in_flight.pop(0)[1:])
    params = {f"global.{n}": v for n, v in theta.items()}
    params.update(
        {
            f"worker{m}": torch.cat([p.detach().flatten() for p in w.parameters()])
            for m, w in enumerate(workers)
        }
    )
    return dict(losses=losses, params=params)


def rounded(delta, wire):
    """A worker's pseudo-gradient of one fragment {name: tensor} as the wire rounds it; float8 with
    one scale per fragment and worker, its largest element at float8's largest."""
    if wire.itemsize > 1:
        return {n: v.to(wire).to(v.dtype) for n, v in delta.items()}
    scale = max(v.abs().max() for v in delta.values()).clamp_min(1e-30) / torch.finfo(wire).max
    return {n: (v / scale).to(wire).to(v.dtype) * scale for n, v in delta.items()}


@torch.no_grad()
def outer_update(args, theta, buf, workers, f, mean):
    """theta <- theta - lr (g + mu buf') with buf' = mu buf + g (torch's Nesterov SGD); plain: - lr
    g. Then every worker's fragment: mix * its own + (1 - mix) * theta."""
    for n, g in mean.items():
        if args.outer == "nesterov":
            buf[n] = g.clone() if n not in buf else args.outer_momentum * buf[n] + g
            g = g + args.outer_momentum * buf[n]
        theta[n] = theta[n] - args.outer_lr * g
        for w in workers:
            p = dict(w.named_parameters())[n]
            p.copy_(args.mix * p + (1 - args.mix) * theta[n] if args.mix else theta[n])


if __name__ == "__main__":
    main()
