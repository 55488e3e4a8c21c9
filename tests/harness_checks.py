"""The shared counters of harness.py against what each collective hands over, on a real process group:

    torchrun --standalone --nproc_per_node=N tests/harness_checks.py OUT.json

Rank 0 writes {"table": CommCounter's table, "log": its per-call log, "naive": the table of a counter that
counts every tensor argument (outputs and receive buffers included: the usual mistake), "events": a Timeline's
gathered events, "rest" and "rest_log": the table and log of every other form of op (coalesced, functional,
any source), "watch": a PipelineWatch's (saved, events, last), and a mutant's}. tests/test_harness.py
computes what the table must be from the shapes alone."""

import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import harness  # noqa: E402
from common import close_dist, init_dist  # noqa: E402

d = init_dist(60)
W, r = d.world, d.rank
pair = dist.new_group([0, 1])  # every rank creates every group; ranks 0 and 1 are "pair"
f64 = dict(dtype=torch.float64, device=d.device)


def traffic():
    x = torch.ones(10, **f64)
    dist.all_reduce(x)  # 80 B handed
    if r < 2:
        out = torch.empty(20, **f64)
        dist.all_gather_into_tensor(out, x, group=pair)  # hands its 80 B, whole 20 elements
        dist.reduce_scatter_tensor(torch.empty(10, **f64), out, group=pair)  # hands the whole 160 B
    rows = [3 + q for q in range(W)]  # uneven all-to-all: this rank sends q+3 rows to rank q
    inp = torch.ones(sum(rows), 2, **f64)
    got = [3 + r] * W
    dist.all_to_all_single(
        torch.empty(sum(got), 2, **f64), inp, output_split_sizes=got, input_split_sizes=rows
    )
    dist.broadcast(x, src=W - 1)  # hands 80 B at the root only
    peer_next, peer_prev = (r + 1) % W, (r - 1) % W
    reqs = dist.batch_isend_irecv(
        [
            dist.P2POp(dist.isend, torch.ones(7, **f64), peer_next, tag=1),
            dist.P2POp(dist.irecv, torch.empty(7, **f64), peer_prev, tag=1),
        ]
    )
    for q in reqs:
        q.wait()

    class AllReduceInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g)  # 3 elements, inside backward: phase "bwd"
            return g

    AllReduceInBackward.apply(torch.ones(3, requires_grad=True, **f64)).sum().backward()


def the_rest():
    """Every other form the counter must handle: coalesced (a list of tensors), functional (DTensor's: the
    output returned), a batch of functional sends and receives, a receive from any source, the list forms."""
    F, g = torch.ops._c10d_functional, dist.group.WORLD.group_name
    a, b = torch.ones(5, **f64), torch.ones(3, **f64)
    waits = [
        *F.all_reduce_coalesced([a, b], "sum", g),  # 8 elements, 64 B
        *F.all_gather_into_tensor_coalesced([a, b], W, g),  # hands 64 B, 8 W elements gathered
        # hands 24 W B
        *F.reduce_scatter_tensor_coalesced(
            [torch.ones(2 * W, **f64), torch.ones(W, **f64)], "sum", W, g
        ),
        F.all_reduce_(a, "sum", g),
        F.broadcast(b, 0, g),
    ]  # 40 B; rank 0 is the root: hands 24 B
    # c10d's own coalesced all-reduce: 8 elements
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    if r == 0:  # W - 1 receives from any source, 3 elements each
        for _ in range(W - 1):
            dist.recv(torch.empty(3, **f64), tag=5)
    else:
        dist.send(torch.ones(3, **f64), 0, tag=5)
    waits += F.batch_p2p_ops(
        ["isend", "irecv"],
        [(r + 1) % W, (r - 1) % W],
        [0, 0],
        [torch.ones(4, **f64), torch.empty(4, **f64)],
        g,
    )
    for t in waits:
        F.wait_tensor(t)
    dist.all_gather([torch.empty(2, **f64) for _ in range(W)], torch.ones(2, **f64))  # hands 16 B
    dist.all_to_all(
        [torch.empty(2, **f64) for _ in range(W)], [torch.ones(2, **f64) for _ in range(W)]
    )
    dist.gather(
        torch.ones(2, **f64), [torch.empty(2, **f64) for _ in range(W)] if r == 0 else None, dst=0
    )
    dist.scatter(
        torch.empty(2, **f64), [torch.ones(2, **f64) for _ in range(W)] if r == 0 else None, src=0
    )
    dist.reduce(b, dst=0)


comm = harness.CommCounter(axes={"pair": pair}, log=True)
with comm:
    traffic()
    with comm.phase("step"):
        dist.all_reduce(torch.ones(4, **f64))
    with comm.paused():
        dist.all_reduce(torch.ones(100, **f64))  # not counted


class Naive(harness.CommCounter):
    """The mutant: bytes of every tensor argument, outputs and receive buffers included."""

    def _count(self, op, name, ns, args):
        key = f"{op}/-/-"
        every = [a for a in harness._flat(args) if torch.is_tensor(a)]
        self.bytes[key] = self.bytes.get(key, 0) + harness._nbytes(every)


naive = Naive()
with naive:
    traffic()
rest = harness.CommCounter(log=True)
with rest:
    the_rest()

tl = harness.Timeline(d, simulate={"F": 30, "B": 60}, tags=("chunk", "note"))
for i in range(2):
    with tl.span("F", i, chunk=r):
        torch.ones(100).sum()
for i in range(2):
    with tl.span("B", i, chunk=r, note=None):
        pass
events = tl.gather()


def watched(watch):
    """One F and its B of a tanh(Linear) under a PipelineWatch, its input stamped as arrived by a p2p op:
    (.saved, the gathered events, .last)."""
    watch.step, w = 3, torch.nn.Linear(4, 4, **f64)
    with watch("p2p", None, recvs=[("F", 1, 0)]):
        x = torch.ones(2, 4, **f64)
    with watch("F", 0, chunk=1):
        y = torch.tanh(w(x))  # saves x (2 x 4 float64, the weight excluded) and its output (2 x 4)
    with watch("B", 0, chunk=1):
        y.sum().backward()
    return {str(k): v for k, v in watch.saved.items()}, watch.timeline.gather(), watch.last


class Unsaving(harness.PipelineWatch):  # a mutant: F not under SavedActivations
    def saving(self, kind):
        return contextlib.nullcontext()


pw = [
    watched(cls(d, {"F": 1}, tags=("chunk", "step", "pp", "recv"), coords=dict(pp=r)))
    for cls in (harness.PipelineWatch, Unsaving)
]
if r == 0:
    Path(sys.argv[1]).write_text(
        json.dumps(
            dict(
                table=comm.table(),
                log=comm.calls_log,
                events=events,
                naive=naive.bytes,
                world=W,
                rest=rest.table(),
                rest_log=rest.calls_log,
                watch=pw,
            )
        )
    )
close_dist()
