"""plan.py against this repo's runs and against the papers.

1. Measured: each technique file is launched at the layouts of RUNS (tiny model, float64) and every figure it
   counts (model-state bytes, bytes saved for backward, bytes handed to collectives, the bubble under
   --stage-ms) is compared with plan.py's prediction for the same sizes: memory and bytes equal to the byte,
   the bubble of the order each run recorded, replayed at --stage-ms's op times, exactly (the measured
   bubble, which load moves, reported beside it). Where a file counts something plan.py leaves out
   (its bookkeeping all-reduces of the loss and the clipping norm, pipedream's message tags, the storage of a
   whole batch behind micro-batch views, zero_bubble's received inputs kept to W, ZB-V's turn held once, the
   V's gradients not yet made at its peak), the test adds it, named, as that file does it.
2. Papers: ZeRO Fig. 1, Korthikanti et al. Table 2, the PTD-P bubble and FLOPs, the ZB bubbles, DeepSeek-V3's
   DualPipeV bubble and activations (Table 2), PTD-P's 1T layout in the top five of --search.
3. The README's worked examples, against closed forms written here.
Each check is shown to fail when plan.py drops a term of its model (monkeypatched here).

--json keys read: zero.py figures.memory.{params,grads,optim}.counted, gathered_peak_bytes,
saved_activation_bytes, comm_bytes, (HSDP) comm_by_group.{shard,replicate}.counted; megatron_tp.py figures.collectives_per_step, param_bytes_per_rank,
activation_bytes_per_block, activation_bytes_saved, peak_mem_bytes; gpipe.py figures.saved_activation_bytes,
state_bytes, sent_bytes_per_rank, bubble_mean; pipedream.py figures.mem_bytes_per_rank, sent_bytes_per_rank,
bubble_mean; ptdp.py figures.counts_per_rank (named figures per rank, over one step), bubble_mean,
peak_mem_bytes; zero_bubble.py figures.mem_bytes_per_rank, peak_alive_microbatches, sent_bytes_per_rank,
bubble_mean (idle / busy), peak_mem_bytes; dualpipev.py the same, and fwd_msgs_per_rank, bwd_msgs_per_rank,
peak_alive_theory, bubble_theory; moe.py figures.alltoall_bytes_per_step, capacity.
"""

import contextlib
import io
import json
import math
import re
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pytest

from helpers import ROOT, TINY, run_python, torchrun

sys.path.insert(0, str(ROOT))
import plan  # noqa: E402
from harness import CommonArgs  # noqa: E402

T = [*TINY, "--steps", "2"]  # vocab 32, seq 8, width 16, 2 heads, 2 layers, batch 12, float64
TINY_MODEL = plan.Model(layers=2, d=16, heads=2, vocab=32, seq=8)
E = 8  # float64
PIPE = ["--n-layers", "4", "--batch-size", "16", "--microbatches", "8", "--stage-ms", "50"]
RUNS = {  # name: (file, processes, flags)
    "zero stage 0, d 2": ("zero.py", 2, [*T, "--stage", "0"]),
    "zero stage 1, d 3": ("zero.py", 3, [*T, "--stage", "1"]),
    "zero stage 2, d 4, accum 2": (
        "zero.py",
        4,
        [*T, "--stage", "2", "--batch-size", "16", "--accum", "2"],
    ),
    "zero stage 3, d 4, accum 2": (
        "zero.py",
        4,
        [*T, "--stage", "3", "--batch-size", "16", "--accum", "2"],
    ),
    # HSDP (zero.py --replicate R): R x N, ZeRO over each row of N, the shard summed down each column
    "hsdp 2 x 2 stage 3, accum 2": (
        "zero.py",
        4,
        [*T, "--stage", "3", "--replicate", "2", "--batch-size", "16", "--accum", "2"],
    ),
    "hsdp 3 x 2 stage 1": ("zero.py", 6, [*T, "--stage", "1", "--replicate", "3"]),
    "megatron tp 1": ("megatron_tp.py", 1, T),
    "megatron tp 2 x dp 2": ("megatron_tp.py", 4, [*T, "--tp", "2"]),
    "megatron tp 4 + SP": (
        "megatron_tp.py",
        4,
        [*T, "--tp", "4", "--n-heads", "4", "--sequence-parallel"],
    ),
    "gpipe p 4 m 8": ("gpipe.py", 4, [*T, *PIPE]),
    "gpipe p 4 m 8, 6 blocks 2/2/1/1": ("gpipe.py", 4, [*T, *PIPE, "--n-layers", "6"]),  # uneven
    "1f1b p 4 m 8": ("pipedream.py", 4, [*T, *PIPE, "--mode", "flush"]),
    "zb-h1 p 4 m 8": (
        "zero_bubble.py",
        4,
        [*T, *PIPE, "--schedule", "zbh1", "--pp", "4", "--stage-ms", "100"],
    ),
    "ptdp 2x2x2 v 2": (
        "ptdp.py",
        8,
        [
            *T,
            "--pp",
            "2",
            "--tp",
            "2",
            "--dp",
            "2",
            "--virtual-stages",
            "2",
            "--n-layers",
            "4",
            "--batch-size",
            "16",
            "--microbatches",
            "4",
            "--stage-ms",
            "50",
        ],
    ),
    "zbv p 3 m 6": (
        "zero_bubble.py",
        3,
        [
            *T,
            "--pp",
            "3",
            "--schedule",
            "zbv",
            "--n-layers",
            "6",
            "--microbatches",
            "6",
            "--stage-ms",
            "200",
        ],
    ),
    # DualPipeV: a dp axis at p 2; the V over 4 ranks (8 chunks)
    "dualpipev p 2 x dp 2 m 4": (
        "dualpipev.py",
        4,
        [
            *T,
            "--pp",
            "2",
            "--dp",
            "2",
            "--n-layers",
            "4",
            "--batch-size",
            "16",
            "--microbatches",
            "4",
        ],
    ),
    "dualpipev p 4 m 8": (
        "dualpipev.py",
        4,
        [*T, "--pp", "4", "--n-layers", "8", "--batch-size", "16", "--microbatches", "8"],
    ),
    "moe ep 1": ("moe.py", 1, [*T, "--router", "switch"]),
    "moe ep 2": ("moe.py", 2, [*T, "--router", "switch", "--ep", "2"]),
    "moe ep 4": ("moe.py", 4, [*T, "--router", "switch", "--ep", "4"]),
}
CP = [*T, "--n-heads", "4"]  # 4 heads: Ulysses at cp 4
CP_RUNS = {  # context_parallel.py's main() three times in one launch of 4 (tests/context_parallel_checks.py)
    "cp 4 ring zigzag": CP + ["--attention", "ring", "--layout", "zigzag"],
    "cp 2 x dp 2 allgather": CP
    + ["--cp", "2", "--dp", "2", "--attention", "allgather", "--layout", "contiguous"],
    "cp 4 ulysses zigzag": CP + ["--attention", "ulysses", "--layout", "zigzag"],
}
RUNS.update({name: ("context_parallel.py", 4, argv) for name, argv in CP_RUNS.items()})
# launched together: one launch of 4 runs each file's main() in turn (fold(), at the end of this file)
FOLDED = (
    "zero stage 2, d 4, accum 2",
    "zero stage 3, d 4, accum 2",
    "hsdp 2 x 2 stage 3, accum 2",
    "megatron tp 2 x dp 2",
    "megatron tp 4 + SP",
    "moe ep 4",
    "gpipe p 4 m 8, 6 blocks 2/2/1/1",
    "dualpipev p 2 x dp 2 m 4",
    "dualpipev p 4 m 8",
)
TABLE, _done = [], {}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    def get(name):  # each launch once per session, on first use
        if name not in _done:
            file, n, flags = RUNS[name]
            tmp = tmp_path_factory.mktemp("plan")
            if name in FOLDED:
                spec = tmp / "runs.json"
                spec.write_text(
                    json.dumps([dict(name=k, file=RUNS[k][0], argv=RUNS[k][2]) for k in FOLDED])
                )
                torchrun(
                    "tests/test_plan.py",
                    4,
                    "--fold",
                    spec,
                    tmp,
                    tmp_path=tmp,
                    timeout=600,
                    name="unused",
                )
                _done.update(
                    {k: json.loads((tmp / f"{FOLDED.index(k)}.json").read_text()) for k in FOLDED}
                )
            elif name in CP_RUNS:  # all of them in one launch
                spec = tmp / "runs.json"
                spec.write_text(json.dumps([dict(name=k, argv=v) for k, v in CP_RUNS.items()]))
                torchrun(
                    "tests/context_parallel_checks.py",
                    4,
                    "--runs",
                    spec,
                    tmp,
                    tmp_path=tmp,
                    timeout=400,
                    name="unused",
                )
                _done.update({k: json.loads((tmp / f"{k}.json").read_text()) for k in CP_RUNS})
            elif n == 1:  # plain python: world 1
                p = run_python(file, *flags, "--json", tmp / "run.json", timeout=240)
                assert p.returncode == 0, p.stdout + p.stderr
                _done[name] = json.loads((tmp / "run.json").read_text())
            else:
                _done[name], _ = torchrun(file, n, *flags, tmp_path=tmp, timeout=400)
        return _done[name]

    return get


def replayed(events, n, times, chunk_of, idle_over_busy=False):
    """The bubble of the order a run recorded, replayed as its own ideal (what load cannot move: which op each
    rank ran after which): each rank's ops in the order of their measured starts, each taking times[kind]
    (--stage-ms's F 1, B 2; zero_bubble.py's F = B = W), messages free. An op starts when its rank is free
    and its input is ready: F of micro-batch k on chunk c after F k on c-1; B k after B k on c+1 (the last
    chunk: after its F); W after its B. The mean over ranks of idle / step (idle / busy)."""
    order = {}
    for e in sorted(events, key=lambda e: e["start"]):
        order.setdefault(e["rank"], []).append((e["kind"], chunk_of(e), e["mb"]))
    done, free, at = {}, dict.fromkeys(order, 0.0), dict.fromkeys(order, 0)
    while any(at[r] < len(ops) for r, ops in order.items()):
        moved = False
        for r, ops in order.items():
            while at[r] < len(ops):
                kind, c, k = ops[at[r]]
                need = {
                    "F": [("F", c - 1, k)] if c else [],
                    "W": [("B", c, k)],
                    "B": [("B", c + 1, k)] if c < n - 1 else [("F", c, k)],
                }[kind]
                if any(x not in done for x in need):
                    break
                start = max([free[r]] + [done[x] for x in need])
                done[kind, c, k] = free[r] = start + times[kind]
                at[r], moved = at[r] + 1, True
        assert moved, "the recorded order deadlocks"
    step = max(free.values())
    busy = {r: sum(times[kind] for kind, _, _ in ops) for r, ops in order.items()}
    return sum((step - x) / (x if idle_over_busy else step) for x in busy.values()) / len(busy)


def clear_caches():  # plan's memoised figures, recomputed after (and before) a mutant changes its terms
    plan.memory.cache_clear()
    plan._microbatch_bytes.cache_clear()
    getattr(plan.alive_patterns, "cache_clear", lambda: None)()  # a mutant may stand in for it


def flag(name, key):  # the value of a flag in RUNS[name] (the last one given wins, as in argparse)
    flags = RUNS[name][2]
    return int(flags[len(flags) - flags[::-1].index(key)])


def model_of(name, **kw):
    return TINY_MODEL._replace(layers=flag(name, "--n-layers"), heads=flag(name, "--n-heads"), **kw)


def state(mem):
    return mem["params"] + mem["grads"] + mem["optim"]


def batch_storage(M, B, b, alive, tokens, targets):
    """Bytes a file's count adds when its micro-batches' token ids (targets) are views of the step's whole
    (B, s+1) token ((B, s) target) storage: a saved view holds the whole storage, which the file's live
    storages count once however many views are alive, where plan.py counts each alive micro-batch's b x s."""
    # ----------------------------------------------------------------------------- what each file counts
    return 8 * (
        (B * (M.seq + 1) - alive * b * M.seq) * tokens + (B * M.seq - alive * b * M.seq) * targets
    )


def zero_rows(s, name):
    """zero.py: model state, stage 3's gathered peak, saved bytes of one micro-batch's forward (embedding,
    blocks, final norm and head input; the loss runs outside its hooks), bytes handed per step; HSDP
    (--replicate R): those at shard world N = d / R, and the bytes of each group (figures.comm_by_group):
    the shard group's (ZeRO's at N, + the norm's 8) and the replicate group's all-reduces."""
    M, d, stage = model_of(name), RUNS[name][1], flag(name, "--stage")
    given = lambda key: flag(name, key) if key in RUNS[name][2] else 1  # noqa: E731
    B, accum, R = flag(name, "--batch-size"), given("--accum"), given("--replicate")
    lay = plan.Layout(
        dp=d, zero=stage, m=accum, precision="fp64", vocab_parallel=False, replicate=R
    )
    mem, f, b = plan.memory(M, lay, B, 0), s["figures"], B // (d * accum)
    rows = [(f"{k} bytes", f["memory"][k]["counted"], mem[k]) for k in ("params", "grads", "optim")]
    if stage == 3:
        rows.append(("gathered peak bytes", f["gathered_peak_bytes"], mem["gathered"]))
    part = plan.microbatch_bytes(M, lay, b, E, 0)
    rows.append(
        (
            "saved bytes per micro-batch",
            f["saved_activation_bytes"],
            part["embedding"] + part["blocks"] + part["final"] + batch_storage(M, B, b, 1, 1, 0),
        )
    )
    comm = plan.collectives(M, lay, B)
    handed = sum(x[1] for x in comm.values())
    # + the norm, one float64, on the shard group
    rows.append(("bytes handed per step", s["comm_bytes"], handed + 8))
    if R > 1:
        groups = f["comm_by_group"]
        across = sum(x[1] for k, x in comm.items() if "/replicate/" in k)
        rows.append(("shard group bytes", groups["shard"]["counted"], handed - across + 8))
        rows.append(("replicate group bytes", groups["replicate"]["counted"], across))
    return rows


def megatron_rows(s, name):
    """megatron_tp.py: collectives per key [calls, bytes], parameters per rank, one block's saved bytes, the
    whole forward + loss's, the peak (parameters, gradients, AdamW moments + saved)."""
    M, n = model_of(name), RUNS[name][1]
    t = flag(name, "--tp") if "--tp" in RUNS[name][2] else n
    lay = plan.Layout(dp=n // t, tp=t, sp="--sequence-parallel" in RUNS[name][2], precision="fp64")
    B, f = flag(name, "--batch-size"), s["figures"]
    want = {k: [c, x] for k, (c, x, _) in plan.collectives(M, lay, B).items()}
    # bookkeeping: the clipping norm all-reduced over tp, one value (the log line's loss is summed on a
    # group of its own after the watched step, so the counter does not see it)
    for key, on in (("all_reduce/tp/step", t > 1),):
        if on:
            c, x = want.get(key, [0, 0])
            want[key] = [c + 1, x + E]
    got = {k: [c, x] for k, (c, _, x) in f["collectives_per_step"].items()}
    b, mem = B // lay.dp, plan.memory(M, lay, B, 0)
    saved = sum(plan.microbatch_bytes(M, lay, b, E, 0).values())
    return [
        ("collectives per step {key: [calls, bytes]}", got, want),
        ("parameter bytes per rank", f["param_bytes_per_rank"], mem["params"]),
        ("saved bytes per block", f["activation_bytes_per_block"], plan.layer_bytes(M, lay, b, E)),
        ("saved bytes, forward + loss", f["activation_bytes_saved"], saved),
        ("peak bytes (state + saved)", s["peak_mem_bytes"], state(mem) + saved),
    ]


def pipeline_rows(s, name):
    """gpipe.py, pipedream.py (flush): per stage the bytes held for backward at the peak (gpipe) or with the
    model state (pipedream), the model state (gpipe), bytes sent; the bubble (idle share of the last step)."""
    M, p, B, m = (
        model_of(name),
        RUNS[name][1],
        flag(name, "--batch-size"),
        flag(name, "--microbatches"),
    )
    gpipe = RUNS[name][0] == "gpipe.py"
    lay = plan.Layout(
        pp=p,
        m=m,
        schedule="gpipe" if gpipe else "1f1b",
        precision="fp64",
        vocab_parallel=False,
        outputs=True,
    )  # it holds each stage output until its backward
    f, b, rows = s["figures"], B // m, []
    for r in range(p):
        mem, comm = plan.memory(M, lay, B, r), plan.collectives(M, lay, B, r)
        sends = sum(c for k, (c, _, _) in comm.items() if k.startswith("send"))
        sent = sum(x for k, (_, x, _) in comm.items() if k.startswith("send"))
        if gpipe:  # gpipe.py copies each micro-batch's tokens and targets: its own storage
            # (its watcher takes the schedule's loss function from main() and so does not see the last
            # stage's 0-dim loss, 8 bytes per micro-batch, which plan counts as that stage's output)
            loss_seen = 8 * m if r == p - 1 else 0
            rows += [
                (
                    f"stage {r} held for backward",
                    f["saved_activation_bytes"][r],
                    mem["activations"] - loss_seen,
                ),
                (f"stage {r} model state", f["state_bytes"][r], state(mem)),
                (f"stage {r} bytes sent", f["sent_bytes_per_rank"][r], sent),
            ]
        else:  # pipedream.py's micro-batches are views of the step's batch, alive through the step (its
            # storage once: pipedream counts live storages); each message carries a 4-float64 tag
            held = (
                state(mem)
                + mem["activations"]
                + batch_storage(M, B, b, min(p - r, m), r == 0, r == p - 1)
            )
            rows += [
                (f"stage {r} state + held, peak", f["mem_bytes_per_rank"][r], held),
                (f"stage {r} bytes sent", f["sent_bytes_per_rank"][r], sent + sends * 8 * 4),
            ]
    # pipedream numbers micro-batches through the run: the last step's
    steps = flag(name, "--steps")
    events = [e for e in f["events"] if gpipe or e["mb"] // m == steps - 1]
    order = replayed(events, p, dict(F=1, B=2), lambda e: e["rank"])
    return rows + [
        (
            "bubble, idle share of the step (measured: reported)",
            f["bubble_mean"],
            plan.bubble(lay)[0],
        ),
        ("bubble of the recorded order, replayed at F 1, B 2", order, plan.bubble(lay)[0]),
    ]


def ptdp_rows(s, name):
    """ptdp.py: per pipeline rank (dp 0, tp 0) the point-to-point, TP, DP and world bytes of the counted step,
    the peak bytes saved for backward by the micro-batch chunks alive; the peak over all ranks (model state +
    what is held to B: saved tensors and each chunk's output); the bubble (idle / busy)."""
    M, B, m = model_of(name), flag(name, "--batch-size"), flag(name, "--microbatches")
    p, t, d, v = (flag(name, k) for k in ("--pp", "--tp", "--dp", "--virtual-stages"))
    lay = plan.Layout(
        dp=d,
        tp=t,
        pp=p,
        v=v,
        m=m,
        schedule="interleaved",
        precision="fp64",
        vocab_parallel=False,
        outputs=True,
    )  # holds each chunk's output to B
    f, b, rows, peaks, n = s["figures"], B // (d * m), [], [], p * v
    for r in range(p):
        got = f["counts_per_rank"][f"pp{r} dp0 tp0"]  # over one step (the first)
        comm, mem = plan.collectives(M, lay, B, r), plan.memory(M, lay, B, r)
        for k, axis in (("p2p", "pp"), ("tp", "tp"), ("dp", "dp")):
            rows.append(
                (
                    f"rank {r} {k} bytes per step",
                    got[f"{k}_bytes"],
                    sum(x for key, (_, x, _) in comm.items() if f"/{axis}/" in key),
                )
            )
        rows.append((f"rank {r} world bytes per step", got["world_bytes"], 16))  # loss, norm^2
        mine = plan.mine(lay, r)
        first, last = (
            mine.index(0) if 0 in mine else None,
            mine.index(n - 1) if n - 1 in mine else None,
        )

        # the largest sum over the alive patterns of the chunks' bytes per micro-batch
        def alive_peak(
            held,
        ):
            per = [sum(plan.microbatch_bytes(M, held, b, E, c).values()) for c in mine]

            # chunk 0's tokens and the last chunk's targets: views of the replica's batch, its
            def batch(
                k,
            ):
                # storage once
                return (batch_storage(M, B, b, k[first], 1, 0) if first is not None else 0) + (
                    batch_storage(M, B, b, k[last], 0, 1) if last is not None else 0
                )

            return max(
                sum(map(int.__mul__, k, per)) + batch(k)
                for k in plan.alive_patterns(p, v, m, r, "interleaved")
            )

        rows.append(
            (
                f"rank {r} peak bytes saved by chunks alive",
                got["act_peak"],
                alive_peak(replace(lay, outputs=False)),
            )
        )
        peaks.append(state(mem) + alive_peak(lay))
    rows.append(("peak bytes, any rank (state + saved + outputs)", s["peak_mem_bytes"], max(peaks)))
    # Reported, not asserted: ptdp.py posts each message batch at a fixed moment of the ideal timeline and
    # waits for it, so a rank also waits for its partner's next op boundary; replaying its comm_plan with
    # exact op times (F 1, B 2) gives 0.208 here, beside PTD-P's (p-1)/(vm) = 0.125 (measured 0.23 to 0.26
    # at --stage-ms 50 to 100, at world 2 or 8).
    return rows + [("bubble, idle / busy (reported)", f["bubble_mean"], plan.bubble(lay)[1])]


def zero_bubble_rows(s, name):
    """zero_bubble.py (--schedule zbh1, zbv) and dualpipev.py (dp 0's pipeline): per rank the model state + bytes held, at its
    peak after a forward (what forwards saved, each chunk's input and output held to B, W's x and dy held
    from B to W, the batch's storage), the most micro-batch chunks between F and W, bytes sent per step; the
    bubble, idle / busy. Terms plan.py leaves out, named:
      input  W's x, unpacked from autograd's saved tensors, keeps its history back to the chunk's received
             input (a leaf that requires grad): b x s x h bytes per micro-batch between B and W on every chunk
             but chunk 0 (the one that reads tokens)
      turn   ZB-V on rank p-1: chunk p's input is chunk p-1's output, one storage, which plan counts twice
             (chunk p-1's output to its B, chunk p's input to its B and to its W): once per micro-batch alive
             on both
      grads  the V's walk: the files set gradients to None after each step and count the state as it stands,
             so until a chunk's first B its gradients do not exist yet (plan counts them allocated, as DDP's and
             Megatron's buffers are): DualPipeV's rank 0 peaks with every micro-batch of chunk 0 forward and
             none backward
    DualPipeV: the same terms (its V and its split backward are ZB-V's), walked over plan's DualPipeV order;
    its messages each way, and plan's bubble and alive beside the file's theory (Table 2). Its recorded order
    replayed op by op (reported) idles (p-1)/(6m), half of Table 2's: there F&B slots run as units."""
    M, B, m, p = (
        model_of(name),
        flag(name, "--batch-size"),
        flag(name, "--microbatches"),
        flag(name, "--pp"),
    )
    dp = flag(name, "--dp") if "--dp" in RUNS[name][2] else 1
    sched = (
        "dualpipev"
        if name.startswith("dualpipev")
        else "zb-v"
        if "zbv" in RUNS[name][2]
        else "zb-h1"
    )
    zbv = sched in plan.V_SHAPED
    lay = plan.Layout(
        dp=dp,
        pp=p,
        v=1 + zbv,
        m=m,
        schedule=sched,
        precision="fp64",
        vocab_parallel=False,
        outputs=True,
    )
    f, b, n, rows, peaks = s["figures"], B // (dp * m), p * lay.v, [], []
    bsh = b * M.seq * M.d * E
    for r in range(p):
        mem, comm, mine = (
            plan.memory(M, lay, B, r),
            plan.collectives(M, lay, B, r),
            plan.mine(lay, r),
        )
        per = [sum(plan.microbatch_bytes(M, lay, b, E, c).values()) for c in mine]  # F to B
        pend = [
            sum(plan.pending_bytes(M, lay, b, E, c)) + bsh * (c > 0) for c in mine
        ]  # B to W, + input

        # k: micro-batch chunks between F and B per local chunk, then between B and W
        def held(k, turn=0):
            x = sum(map(int.__mul__, k, per + pend)) - turn * bsh
            # tokens, targets: views
            x += batch_storage(M, B, b, k[mine.index(0)], 1, 0) if 0 in mine else 0
            return x + (batch_storage(M, B, b, k[mine.index(n - 1)], 0, 1) if n - 1 in mine else 0)

        if zbv:  # walked over plan's order, after each forward (where the file looks)
            done, peak = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}, 0
            for kind, c in plan.zero_bubble_ops(p, m, r, sched):
                done[kind, c] += 1
                F, B_, W = ([done[x, c] for c in (0, 1)] for x in "FBW")
                # k in [B, F) down, [W, F) up
                turn = max(0, min(F) - max(B_[0], W[1])) if r == p - 1 else 0
                no_grads = sum(E * chunk_params(M, lay, g) for g, b_ in zip(mine, B_) if not b_)
                peak = max(
                    peak,
                    held([F[c] - B_[c] for c in (0, 1)] + [B_[c] - W[c] for c in (0, 1)], turn)
                    - no_grads
                    if kind == "F"
                    else 0,
                )
        else:
            peak = max(held(k) for k in plan.alive_patterns(p, 1, m, r, "zb-h1"))
        peaks.append(state(mem) + peak)
        alive = max(sum(k) for k in plan.alive_patterns(p, lay.v, m, r, lay.schedule))
        rows += [
            (f"rank {r} state + held, peak (+ input, turn)", f["mem_bytes_per_rank"][r], peaks[-1]),
            (
                f"rank {r} micro-batch chunks alive, F to W",
                f["peak_alive_microbatches"][r],
                alive,
            ),
            (
                f"rank {r} bytes sent",
                f["sent_bytes_per_rank"][r],
                sum(x for k, (_, x, _) in comm.items() if k.startswith("send")),
            ),
        ]
        if sched == "dualpipev":  # its messages each way, its own theory of the alive
            rows += [
                (
                    f"rank {r} {phase} messages",
                    f[f"{phase}_msgs_per_rank"][r],
                    comm.get(f"send/pp/{phase}", [0])[0],
                )
                for phase in ("fwd", "bwd")
            ]
            rows.append(
                (f"rank {r} alive, the file's theory 2p+1", f["peak_alive_theory"][r], alive)
            )
    rows.append(("peak bytes, any rank", s["peak_mem_bytes"], max(peaks)))
    # three ops per micro-batch (per chunk), each with its host overhead and message waits beside --stage-ms:
    # under a load of 7 on 2 cores ZB-H1 measured 0.22-0.23 at --stage-ms 50, 0.170-0.178 at 100 (theory
    # 0.125); ZB-V 0.120 at 50, 0.107 at 100, 0.071 at 200 (theory 0.056): reported; the recorded order,
    # replayed, is asserted
    last = [
        dict(e, rank=e["pp"])
        for e in f["events"]
        if e["dp"] == 0 and e["step"] == f["events"][-1]["step"]
    ]
    # chunks numbered on each rank: its own, in pipeline order
    local = max(e["chunk"] for e in last) < lay.v

    def chunk_of(e):
        return plan.mine(lay, e["rank"])[e["chunk"]] if local else e["chunk"]

    order = replayed(last, n, dict(F=1, B=1, W=1), chunk_of, idle_over_busy=True)
    return (
        rows
        + [
            (
                "bubble, idle / busy (measured: reported)",
                f["bubble_mean"],
                plan.bubble(lay)[1],
            ),
            (
                "bubble of the recorded order, replayed at F = B = W"
                + " (reported: per op)" * (sched == "dualpipev"),
                order,
                plan.bubble(lay)[1],
            ),
        ]
        + [("bubble, the file's theory", f.get("bubble_theory"), plan.bubble(lay)[1])]
        * (sched == "dualpipev")
    )


def chunk_params(M, lay, c):
    """Parameter elements of chunk c (tp 1, embedding and head replicated): its blocks, the embedding and
    positions on chunk 0, the final norm and the head on the last."""
    blocks = sum(
        k * sum(plan.layer_params(M, moe)[:2])
        for moe, k in zip((False, True), plan.kinds(M, lay, c))
    )
    last = c == lay.pp * lay.v - 1
    return blocks + (M.vocab + M.seq) * M.d * (c == 0) + (M.vocab + 2) * M.d * last


def moe_rows(s, name):
    """moe.py (switch, E 4, cf 1.25): all-to-all bytes that leave the rank per step, and the capacity C."""
    n = RUNS[name][1]
    ep = flag(name, "--ep") if "--ep" in RUNS[name][2] else n
    M, B = model_of(name, experts=4, top_k=1, capacity=1.25), flag(name, "--batch-size")
    lay = plan.Layout(dp=n, ep=ep, precision="fp64", vocab_parallel=False)
    leaving = sum(
        c * (x // c * (ep - 1) // ep)
        for k, (c, x, _) in plan.collectives(M, lay, B).items()
        if k.startswith("all_to_all")
    )  # moe.py counts each call's bytes x (ep-1) // ep
    return [
        (
            "all-to-all bytes leaving the rank per step",
            s["figures"]["alltoall_bytes_per_step"],
            leaving,
        ),
        ("capacity C", s["figures"]["capacity"], plan.capacity(M, B // n * M.seq)),
    ]


def cp_rows(s, name):
    """context_parallel.py (dp x cp, every rank the whole model): per rank the bytes handed to the cp group
    per layer, forward and backward (plan's cp collectives / L), the bytes its forward saves for backward
    (embedding, blocks, final norm and head input), the peak (state + saved + the loss's: the file reads it
    after the last step's forward and loss, as megatron_tp.py does), and the bytes handed per step
    (the exchanges of every layer and the gradients' all-reduce over dp x cp)."""
    argv, f = CP_RUNS[name], s["figures"]
    M, B, L = model_of(name), flag(name, "--batch-size"), flag(name, "--n-layers")
    cp, dp = f["cp"], f["dp"]
    lay = plan.Layout(
        dp=dp,
        cp=cp,
        cp_attention=argv[argv.index("--attention") + 1],
        precision="fp64",
        vocab_parallel=False,
    )
    comm, mem, b = plan.collectives(M, lay, B), plan.memory(M, lay, B, 0), B // dp
    fwd, bwd = (
        sum(x for k, (_, x, _) in comm.items() if k.endswith(f"/cp/{ph}")) // L
        for ph in ("fwd", "bwd")
    )
    part = plan.microbatch_bytes(M, lay, b, E, 0)
    saved = part["embedding"] + part["blocks"] + part["final"]
    return [
        (
            "bytes to the cp group per layer, forward (every rank)",
            f["bytes_per_layer_fwd"],
            [fwd] * 4,
        ),
        (
            "bytes to the cp group per layer, backward (every rank)",
            f["bytes_per_layer_bwd"],
            [bwd] * 4,
        ),
        ("saved bytes, forward (every rank)", f["saved_activation_bytes"], [saved] * 4),
        (
            "peak bytes (state + saved + loss)",
            s["peak_mem_bytes"],
            state(mem) + saved + part["loss"],
        ),
        ("bytes handed per step", s["comm_bytes"], sum(x for _, x, _ in comm.values())),
    ]


ROWS = {
    "zero": zero_rows,
    "hsdp": zero_rows,
    "megatron": megatron_rows,
    "gpipe": pipeline_rows,
    "1f1b": pipeline_rows,
    "zb-h1": zero_bubble_rows,
    "ptdp": ptdp_rows,
    "zbv": zero_bubble_rows,
    "dualpipev": zero_bubble_rows,
    "moe": moe_rows,
    "cp": cp_rows,
}
FAMILIES = {
    "zero": ("zero", "hsdp"),
    "megatron": ("megatron",),
    "pipelines": ("gpipe", "1f1b", "ptdp"),
    "zero bubble": ("zb-h1", "zbv", "dualpipev"),
    "moe": ("moe",),
    "context parallel": ("cp",),
}


def rows_of(run, name):
    return ROWS[name.split()[0]](run(name), name)


def mismatches(rows, name):
    return [
        (what, got, want)
        for what, got, want in rows
        if "reported" not in what and (abs(got - want) > 1e-9 if "bubble" in what else got != want)
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_plan_equals_what_the_files_count(run, family):
    """Every layout of the family: each counted figure equals plan.py's prediction (the bubble: of the
    recorded order, replayed; the measured one reported)."""
    bad = []
    for name in [n for n in RUNS if n.split()[0] in FAMILIES[family]]:
        rows = rows_of(run, name)
        TABLE.extend((name, *row) for row in rows)
        bad += [(name, *x) for x in mismatches(rows, name)]
    assert not bad, bad


# ----------------------------------------------------------------------------- a dropped term is caught
def drop_gathered(mp):
    mp.setattr(plan, "gathered", lambda units, d, p, gemms=None: 0)


def drop_padding(mp):
    mp.setattr(plan, "padded", lambda units, d: sum(units))


# every 1F1B-like schedule as if one micro-batch were alive (no warm-up forwards)
def drop_warmup(
    mp,
):
    real = plan.alive_patterns

    def one(p, v, m, r, s):
        got = real(p, v, m, r, s)
        return got if s == "gpipe" else frozenset({(1,) + (0,) * (len(next(iter(got))) - 1)})

    mp.setattr(plan, "alive_patterns", one)


# interleaved 1F1B as if it held plain 1F1B's p - r micro-batches, on one chunk
def drop_interleaving(
    mp,
):
    real = plan.alive_patterns
    mp.setattr(
        plan,
        "alive_patterns",
        lambda p, v, m, r, s: (
            frozenset({(min(p - r, m),) + (0,) * (v - 1)}) if v > 1 else real(p, v, m, r, s)
        ),
    )


def drop_logsumexp(mp):
    real = plan.layer_items
    mp.setattr(
        plan, "layer_items", lambda *a, **k: [x for x in real(*a, **k) if x[0] != "logsumexp"]
    )


def drop_regathers(mp):  # SP's backward all-gathers without each column layer's re-gather
    real = plan.collectives

    def fewer(M, lay, B, r=0):
        out = real(M, lay, B, r)
        if lay.sp and "all_gather/tp/bwd" in out:
            c, x, n = out["all_gather/tp/bwd"]
            k = (2 * M.layers + 1) * lay.m  # q/k/v and fc per layer, and the head
            out["all_gather/tp/bwd"] = [c - k, x - x // c * k, n]
        return out

    mp.setattr(plan, "collectives", fewer)


def zb_h1_as_1f1b(mp):  # ZB-H1 holding 1F1B's p - r micro-batches and nothing for W
    real = plan.alive_patterns
    mp.setattr(
        plan,
        "alive_patterns",
        lambda p, v, m, r, s: (
            frozenset({(min(p - r, m), 0)}) if s == "zb-h1" else real(p, v, m, r, s)
        ),
    )


def zb_v_as_a_loop(mp):  # ZB-V's chunks placed as interleaving's, c % p
    mp.setattr(plan, "mine", lambda lay, r: tuple(range(r, lay.pp * lay.v, lay.pp)))
    mp.setattr(plan, "owner", lambda lay, c: c % lay.pp)


def dualpipev_as_zb_v(mp):  # DualPipeV run in ZB-V's order (the same V, no F&B pairs)
    real = plan.zero_bubble_ops
    mp.setattr(
        plan, "zero_bubble_ops", lambda p, m, r, s: real(p, m, r, "zb-v" if s == "dualpipev" else s)
    )


def ring_blocks_only(mp):  # the ring's backward as its forward: K/V blocks, no dK/dV accumulators
    real = plan.collectives

    def fewer(M, lay, B, r=0):
        out = real(M, lay, B, r)
        if "send/cp/bwd" in out:
            out["send/cp/bwd"] = list(out["send/cp/fwd"])
        return out

    mp.setattr(plan, "collectives", fewer)


def whole_sequence(mp):  # each block's saved bytes as if the rank held every token
    real = plan.layer_bytes
    mp.setattr(
        plan, "layer_bytes", lambda M, lay, b, e, **k: real(M, replace(lay, cp=1), b, e, **k)
    )


def drop_replicas(mp):  # HSDP's shard never summed across the replicas
    real = plan.collectives
    mp.setattr(
        plan,
        "collectives",
        lambda *a: {k: x for k, x in real(*a).items() if "/replicate/" not in k},
    )


def replicas_once(mp):  # HSDP's all-reduce once per step at every stage, not per micro-batch at 2-3
    real = plan.collectives

    def once(M, lay, B, r=0):
        out = real(M, lay, B, r)
        for k in [k for k in out if "/replicate/" in k]:
            out[k] = [1, out[k][1] // out[k][0], out[k][2]]
        return out

    mp.setattr(plan, "collectives", once)


# HSDP's model state and ZeRO collectives over another group than its rows of N
def shard_as(
    shard,
):
    return lambda mp: mp.setattr(plan.Layout, "shard", property(shard))


MUTANTS = {  # what plan.py forgets -> a launch whose figures must then disagree
    "ZB-H1 holds 1F1B's p - r": (zb_h1_as_1f1b, "zb-h1 p 4 m 8"),
    "ZB-V chunks in a loop": (zb_v_as_a_loop, "zbv p 3 m 6"),
    "DualPipeV in ZB-V's order": (dualpipev_as_zb_v, "dualpipev p 4 m 8"),
    "DualPipeV's bubble as ZB-V's": (
        lambda mp: mp.setattr(plan, "bubble_slots", lambda lay, *fbw: 0),
        "dualpipev p 2 x dp 2 m 4",
    ),
    "stage 3 forgets its gathered units": (drop_gathered, "zero stage 3, d 4, accum 2"),
    "sharded units without padding": (drop_padding, "zero stage 1, d 3"),
    "HSDP without its all-reduce across replicas": (drop_replicas, "hsdp 3 x 2 stage 1"),
    "HSDP sharded over every rank": (shard_as(lambda lay: lay.grad_group), "hsdp 3 x 2 stage 1"),
    "HSDP sharded over R, not N": (shard_as(lambda lay: lay.replicate), "hsdp 3 x 2 stage 1"),
    "HSDP stage 3's all-reduce once a step": (replicas_once, "hsdp 2 x 2 stage 3, accum 2"),
    "1F1B without its p-r-1 warm-up": (drop_warmup, "1f1b p 4 m 8"),
    "interleaving holds no more than 1F1B": (drop_interleaving, "ptdp 2x2x2 v 2"),
    "no logsumexp saved by attention": (drop_logsumexp, "megatron tp 2 x dp 2"),
    "SP without the re-gathers": (drop_regathers, "megatron tp 4 + SP"),
    "MoE capacity without its factor": (
        lambda mp: mp.setattr(plan, "capacity", lambda M, n: math.ceil(M.top_k * n / M.experts)),
        "moe ep 2",
    ),
    "no bubble": (
        lambda mp: mp.setattr(plan, "bubble_slots", lambda lay, *fbw: 0),
        "gpipe p 4 m 8",
    ),
    "ZB-V's bubble the paper's 0": (
        lambda mp: mp.setattr(plan, "walked", lambda *a: 0),
        "zbv p 3 m 6",
    ),
    "ZB-H1's bubble as 1F1B's": (
        lambda mp: mp.setattr(plan, "bubble_slots", lambda lay, *fbw: lay.pp - 1),
        "zb-h1 p 4 m 8",
    ),
    "all-gather CP keeps only its own K, V": (
        lambda mp: mp.setattr(plan, "cp_extra", lambda *a: 0),
        "cp 2 x dp 2 allgather",
    ),
    "Ulysses keeps no head-sharded output": (
        lambda mp: mp.setattr(plan, "cp_extra", lambda *a: 0),
        "cp 4 ulysses zigzag",
    ),
    "the ring's backward sends no dK/dV": (ring_blocks_only, "cp 4 ring zigzag"),
    "CP activations of the whole sequence": (whole_sequence, "cp 4 ring zigzag"),
}


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_dropped_term_fails_the_comparison(run, monkeypatch, mutant):
    drop, name = MUTANTS[mutant]
    assert not mismatches(rows_of(run, name), name)
    clear_caches()
    drop(monkeypatch)
    try:
        assert mismatches(rows_of(run, name), name), f"{mutant}: still matches {name}"
    finally:
        clear_caches()


def test_hsdp_gathers_inside_a_node_and_sums_across():
    """HSDP of Llama 3 70B on 8 nodes, a replica per node (R 8, N 8): the model state of ZeRO-3 at N = 8, its
    all-gathers and reduce-scatters on NVLink, the replicas' all-reduce g Psi'/N per micro-batch (closed form
    here: Psi' the units padded to N) on InfiniBand; plain ZeRO-3 over 64 gathers across the nodes."""
    M, C = plan.PRESETS["llama3-70b"], plan.CLUSTERS["h100-80g"]._replace(nodes=8)
    lay = plan.Layout(dp=64, zero=3, m=4, replicate=8, recompute="full")
    flat = replace(lay, replicate=1)
    units = plan.rank_units(M, lay, 0)
    psi = sum(-(-u // 8) * 8 for u in units)
    assert plan.memory(M, lay, 256, 0)["optim"] == 12 * psi // 8
    comm = plan.collectives(M, lay, 256)
    # [calls, bytes handed over them, group size]
    assert comm["all_reduce/replicate/bwd"] == [4, 4 * 2 * psi // 8, 8]
    assert comm["reduce_scatter/dp/bwd"] == [4, 4 * 2 * psi, 8]
    assert [plan.link(C, lay, a) for a in ("dp", "replicate")] == ["nvlink", "ib"]
    assert plan.link(C, flat, "dp") == "ib"
    got = {x: plan.predict(M, C, x, 256) for x in (lay, flat)}
    assert got[lay]["exposed"]["dp"][0] < got[flat]["exposed"]["dp"][0] / 2
    assert "replicate 8" in str(lay)


def test_moe_model_state_equals_the_files_parameters(monkeypatch):
    """moe.py's own model at EP 1, 2, 4, every EP rank, built in this process: MoE's constructor asks its EP
    group only for its size and this rank's place in it, so a stand-in group answers (no collective). Its
    parameter bytes equal plan's, and plan's AdamW state is twice that."""
    import moe  # noqa: E402

    class EPGroup:  # EP rank `rank` of `size`
        def __init__(self, size, rank):
            self.size, self.rank = size, rank

    size, rank = moe.dist.get_world_size, moe.dist.get_rank
    monkeypatch.setattr(
        moe.dist, "get_world_size", lambda g=None: g.size if isinstance(g, EPGroup) else size(g)
    )
    monkeypatch.setattr(
        moe.dist, "get_rank", lambda g=None: g.rank if isinstance(g, EPGroup) else rank(g)
    )
    args = moe.Args(
        vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=2, batch_size=12, dtype="float64"
    )
    M = TINY_MODEL._replace(experts=4)
    for ep in (1, 2, 4):
        want = plan.memory(
            M, plan.Layout(dp=ep, ep=ep, precision="fp64", vocab_parallel=False), 12, 0
        )
        for r in range(ep):
            model = moe.build_moe_gpt(args, ep, EPGroup(ep, r))
            assert [x.ep_rank for x in moe.moe_layers(model)] == [r] * 2, (ep, r)
            assert sum(q.numel() * 8 for q in model.parameters()) == want["params"], (ep, r)
        assert want["optim"] == 2 * want["params"]


# ----------------------------------------------------------------------------- the papers
def paper_rows(with_search=True, table=False):
    """Each paper's figure beside plan.py's: (paper, what, the paper's value, plan's). The closed forms are
    the papers', written here; plan.py computes its side tensor by tensor and step by step."""
    rows = [
        (
            "ZeRO Fig. 1",
            f"Psi 7.5B, d 64, stage {k}, GB",
            x,
            sum(plan.model_state([7.5e9], 64, k, 2, 2, 12).values()) / 1e9,
        )
        for k, x in enumerate((120, 31.4, 16.6, 1.9))
    ]
    M, s, b, h, a, t, L = plan.PRESETS["gpt3-175b"], 2048, 1, 12288, 96, 8, plan.Layout
    for what, lay, x in [
        ("no parallelism", L(), s * b * h * (34 + 5 * a * s / h)),
        ("TP", L(tp=t), s * b * h * (10 + 24 / t + 5 * a * s / (h * t))),
        ("TP + SP", L(tp=t, sp=True), s * b * h / t * (34 + 5 * a * s / h)),
        ("TP + selective", L(tp=t, recompute="selective"), s * b * h * (10 + 24 / t)),
        ("TP + SP + selective", L(tp=t, sp=True, recompute="selective"), s * b * h * 34 / t),
        ("full recomputation", L(recompute="full"), 2 * s * b * h),
    ]:
        ours = plan.layer_bytes(M, lay, b, 2, attention="eager", dropout=True, stats=False)
        rows.append(("Korthikanti Table 2", f"GPT-3 175B layer, t 8, {what}, bytes", x, ours))
    for p, v, m in [(8, 1, 32), (8, 2, 32), (64, 2, 512)]:
        lay = L(pp=p, v=v, m=m, schedule="interleaved" if v > 1 else "1f1b")
        rows.append(
            ("PTD-P (p-1)/(vm)", f"p {p} v {v} m {m}", (p - 1) / (v * m), plan.bubble(lay)[1])
        )
    # ZB's table at T_F = T_B = T_W. Its ZB-V 0 bypasses the optimizer's synchronisation (Qi et al. Sec. 4:
    # the next step's F's fill the V's ramp); torch's ScheduleZBVZeroBubble and zero_bubble.py step after
    # the flush, so the last rank's first F waits for p - 1 chunk F's: (p-1) / (6m) of a rank's 6m chunk ops
    for sched, x in [("1f1b", 7 / 32), ("zb-h1", 7 / 96), ("zb-v", 7 / 192)]:
        lay = L(pp=8, m=32, schedule=sched, v=1 + (sched == "zb-v"))
        rows.append(("ZB bubble rate", f"{sched}, p 8, m 32", x, plan.bubble(lay)[1]))
    # DeepSeek-V3 Table 2, DualPipeV (PP = 2p stages): bubble (PP/2-1)(F&B+B-3W) at T_F = T_B = T_W, F&B = 3,
    # B = 2 (B and W) of a rank's 6m chunk ops; PP+1 chunk micro-batches alive on every rank
    lay = L(pp=8, v=2, m=32, schedule="dualpipev")
    rows.append(
        (
            "DeepSeek-V3 Table 2",
            "DualPipeV bubble, p 8, m 32",
            7 * 2 / (6 * 32),
            plan.bubble(lay)[1],
        )
    )
    alive = [max(map(sum, plan.alive_patterns(8, 2, 32, r, "dualpipev"))) for r in range(8)]
    for what, x in (("fewest", min(alive)), ("most", max(alive))):
        rows.append(
            ("DeepSeek-V3 Table 2", f"DualPipeV p 8, m 32: alive, {what} over ranks", 17, x)
        )
    M, B = plan.PRESETS["ptdp-1t"], 3072
    paper = (
        96
        * B
        * M.seq
        * M.layers
        * M.d**2
        * (1 + M.seq / (6 * M.d) + M.vocab / (16 * M.layers * M.d))
    )
    rows.append(
        (
            "PTD-P FLOPs",
            "1T, batch 3072, full recomputation",
            paper,
            plan.chunk_flops(M, L(recompute="full"), B, 0),
        )
    )

    # Table 1's 1T row: t 8, p 64 (d 6) on 3072 A100s (384 nodes of 8), batch 3072 of 2048 tokens; then with
    # only the options of 2021's Megatron-LM (no ZeRO, SP or selective recomputation; 1F1B or interleaved)
    def of_2021(lay):
        return (
            not lay.zero
            and not lay.sp
            and lay.recompute != "selective"
            and lay.schedule in ("1f1b", "interleaved")
        )

    C = plan.CLUSTERS["a100-80g"]._replace(nodes=384)
    searched = search_both(M, C, B, of_2021) if with_search else ()
    for what, want, ranked in zip(("", ", 2021's options"), (5, 1), searched):
        at = [i for i, x in enumerate(ranked) if (x["layout"].tp, x["layout"].pp) == (8, 64)]
        rows.append(
            (
                "PTD-P Table 1",
                f"1T on 384 x 8 A100{what}: rank of t 8 p 64 in --search",
                want,
                at[0] + 1 if at else None,
            )
        )
        if at and table:
            top = "\n".join(
                f"{i + 1}. {x['tokens_per_s']:,.0f} tok/s  {x['layout']}"
                for i, x in enumerate(ranked[:6])
            )
            TABLE.append(
                (
                    "1T search",
                    top,
                    plan.why_faster(ranked[at[0]], ranked[at[0] + 1]),
                    plan.why_faster(ranked[0], ranked[at[0]]) if at[0] else "(first)",
                )
            )
    return rows


def search_both(M, C, B, keep):
    """plan.search's ranking, and the one it gives with `keep` (a subset of the options): one enumeration for
    both, the second taken from every prediction the first made, by search's own rule (the fastest of each
    grid dp, tp, pp, ep; the first of equals), as plan.search(M, C, B, keep=keep) would rank them."""
    seen, real = [], plan.predict

    def spy(*a, **k):
        seen.append(real(*a, **k))
        return seen[-1]

    plan.predict = spy
    try:
        ranked = plan.search(M, C, B)[0]
    finally:
        plan.predict = real
    best = {}
    for x in (x for x in seen if keep(x["layout"])):
        key = (x["layout"].dp, x["layout"].tp, x["layout"].pp, x["layout"].ep)
        if key not in best or x["tokens_per_s"] > best[key]["tokens_per_s"]:
            best[key] = x
    return ranked, sorted(best.values(), key=lambda x: -x["tokens_per_s"])


def paper_checks(with_search=True, table=False):
    rows, bad = paper_rows(with_search, table), []
    for paper, what, theirs, ours in rows:
        if paper == "ZeRO Fig. 1":
            ok = round(ours, 1) == theirs  # the figure prints one decimal
        elif paper == "PTD-P Table 1":  # in the top five; first with 2021's options
            ok = ours is not None and ours <= theirs
        else:
            ok = math.isclose(ours, theirs, rel_tol=1e-12, abs_tol=1e-12)
        bad += [] if ok else [(paper, what, theirs, ours)]
    return rows, bad


def test_one_enumeration_ranks_as_two_searches():
    """search_both's second ranking equals plan.search with keep (a 7B model on one node, 2021's options)."""
    M, C = plan.PRESETS["gpt3-6.7b"], plan.CLUSTERS["h100-80g"]
    keep = lambda lay: not lay.zero and lay.schedule in ("1f1b", "interleaved")  # noqa: E731
    both = search_both(M, C, 512, keep)
    assert [x["layout"] for x in both[1]] == [
        x["layout"] for x in plan.search(M, C, 512, keep=keep)[0]
    ]
    assert [x["layout"] for x in both[0]] != [x["layout"] for x in both[1]]


def test_paper_rows():
    """ZeRO Fig. 1 (120, 31.4, 16.6, 1.9 GB); Korthikanti's six rows for a GPT-3 175B layer; PTD-P's bubble
    (p-1)/(vm) and FLOPs 96Bslh^2(1 + s/6h + V/16lh); the ZB bubbles; DeepSeek-V3's DualPipeV bubble and
    activations (Table 2); PTD-P's 1T layout (t 8, p 64) in the top five of --search on 384 nodes of 8 A100s
    at batch 3072 x 2048, and first with 2021's options."""
    rows, bad = paper_checks(table=True)
    TABLE.extend(("paper", f"{p}: {w}", theirs, ours) for p, w, theirs, ours in rows)
    assert not bad and len(rows) == 22, bad


def drop_optimizer_state(mp):
    real = plan.model_state
    mp.setattr(plan, "model_state", lambda *a: dict(real(*a), optim=0))


def drop_dropout_masks(mp):
    real = plan.layer_items
    mp.setattr(
        plan, "layer_items", lambda *a, **k: [x for x in real(*a, **k) if x[0] != "dropout masks"]
    )


def drop_attention_flops(mp):
    real = plan.layer_flops
    mp.setattr(
        plan, "layer_flops", lambda M, b, moe=False: real(M, b, moe) - 4 * b * M.seq**2 * M.d
    )


PAPER_MUTANTS = {
    "ZeRO without K": (drop_optimizer_state, "ZeRO Fig. 1"),
    "Korthikanti without masks": (drop_dropout_masks, "Korthikanti Table 2"),
    "PTD-P bubble without v": (
        lambda mp: mp.setattr(plan, "bubble_slots", lambda lay, *fbw: lay.pp - 1),
        "PTD-P (p-1)/(vm)",
    ),
    "FLOPs without attention": (drop_attention_flops, "PTD-P FLOPs"),
    "DualPipeV in ZB-V's order": (dualpipev_as_zb_v, "DeepSeek-V3 Table 2"),
    "1F1B without warm-up, 1T search": (drop_warmup, "PTD-P Table 1"),
}


@pytest.mark.parametrize("mutant", PAPER_MUTANTS)
def test_a_dropped_term_fails_a_paper_row(monkeypatch, mutant):
    drop, paper = PAPER_MUTANTS[mutant]
    clear_caches()
    drop(monkeypatch)
    try:
        _, bad = paper_checks(with_search=paper == "PTD-P Table 1")
        assert any(x[0] == paper for x in bad), (mutant, bad)
    finally:
        clear_caches()


# ----------------------------------------------------------------------------- the time model, PTD-P Table 1
# Narayanan et al. 2021, Table 1 (weak scaling on Selene, A100 80 GB, fp16, V 51200, s 2048, full activation
# recomputation): billions of parameters, heads a, width h, layers L, t, p, GPUs, batch, the share of peak
# (312 TFLOP/s) achieved, in %, counted by the paper's 96 B s L h^2 (1 + s/6h + V/16Lh) per step
PTDP_TABLE_1 = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 44),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 44),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 46),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 43),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 44),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 45),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 47),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 50),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 52),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 52),
]
CALIBRATION = tuple(r[0] for i, r in enumerate(PTDP_TABLE_1) if i % 3 != 2)  # the fit's 7 rows
# points of peak: the issue's goal; the published shares are whole percents (+-0.5), and
HELD_OUT_TOL = 5
# one fitted constant against three rows it never saw, over 1.7B to 530B, t 1 to 8, p 1 to 35


def ptdp_share(row, eff, cluster=None):
    """plan's share of peak for a Table 1 row, counted as the paper counts (its FLOPs formula over the
    predicted step). What the table does not say is taken from 2021's Megatron-LM: micro-batches of one
    sequence, 1F1B, eager attention with dropout, no SP, the gradients all-reduced after the flush."""
    _, a, h, L, t, p, G, B, _ = row
    M, d = plan.Model(L, h, a, 51200, 2048), G // (t * p)
    C = (cluster or plan.CLUSTERS["a100-80g"])._replace(nodes=G // 8)
    lay = plan.Layout(dp=d, tp=t, pp=p, m=B // d, recompute="full")
    step = plan.predict(M, C, lay, B, eff, attention="eager", dropout=True, overlap_dp=False)[
        "step_s"
    ]
    return paper_share(row, step)


def paper_share(row, step):  # % of peak of a Table 1 row at this step time, as the paper counts it
    _, _, h, L, _, _, G, B, _ = row
    flops = 96 * B * 2048 * L * h * h * (1 + 2048 / (6 * h) + 51200 / (16 * L * h))
    return 100 * flops / (step * G * 312e12)


def implied(share, target, lo=0.3, hi=1.0):
    """The GEMM ceiling at which share(ceiling) (% of peak, rising with it) is target, to 1e-4 points: false
    position inside the bracket (lo, hi), bisection where it stalls; hi where even that falls short."""
    flo, fhi = share(lo) - target, share(hi) - target
    while fhi > 0 and hi - lo > 1e-9:
        x = hi - fhi * (hi - lo) / (fhi - flo)
        x = x if lo + 0.01 * (hi - lo) < x < hi - 0.01 * (hi - lo) else (lo + hi) / 2
        fx = share(x) - target
        if abs(fx) < 1e-4:
            return x
        lo, flo, hi, fhi = (x, fx, hi, fhi) if fx < 0 else (lo, flo, x, fx)
    return hi


def fit_efficiency(rows, cluster=None):
    """The ceiling of these Table 1 rows: the mean of the ceilings that put each at its published share."""
    return sum(implied(lambda e: ptdp_share(r, e, cluster), r[-1]) for r in rows) / len(rows)


def ranks(xs):  # average ranks (ties share theirs), for Spearman's correlation
    order = sorted(range(len(xs)), key=xs.__getitem__)
    out = [0.0] * len(xs)
    for x in set(xs):
        at = [i for i, k in enumerate(order) if xs[k] == x]
        for i in at:
            out[order[i]] = sum(at) / len(at)
    return out


def spearman(xs, ys):
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def table_1_verdict(cluster=None):
    """(fitted ceiling, [(row, predicted share)], held-out rows off by more than the tolerance, Spearman)."""
    eff = fit_efficiency([r for r in PTDP_TABLE_1 if r[0] in CALIBRATION], cluster)
    got = [(r, ptdp_share(r, eff, cluster)) for r in PTDP_TABLE_1]
    off = [
        (r[0], round(x, 1), r[-1])
        for r, x in got
        if r[0] not in CALIBRATION and abs(x - r[-1]) > HELD_OUT_TOL
    ]
    return eff, got, off, spearman([x for _, x in got], [r[-1] for r, _ in got])


def test_time_model_follows_ptdp_table_1():
    """Fitted on three rows of PTD-P's Table 1 (1.7B, 18.4B, 1T), each of the seven other rows is predicted
    within 5 points of peak, and the trend is the paper's: the shares rise with size (Spearman > 0.7 over the
    ten rows; the 1T row above the 1.7B). With one efficiency for every GEMM and no memory-bound work (HBM
    taken as infinitely fast: the old model) the fit cannot. (plan.py's EFFICIENCY, megatron-2021's A100
    ceiling, is fitted on that stack's 15 rows: test_ceilings_and_bands_refit_from_the_published_rows.)"""
    eff, got, off, rho = table_1_verdict()
    TABLE.extend(
        (
            "PTD-P Table 1",
            f"{r[0]:g}B t {r[4]} p {r[5]}, % of peak" + " (calibration)" * (r[0] in CALIBRATION),
            r[-1],
            round(x, 1),
        )
        for r, x in got
    )
    TABLE.append(
        ("PTD-P Table 1", "fitted GEMM ceiling; Spearman over the ten rows", eff, round(rho, 2))
    )
    assert not off, (eff, off)
    assert rho > 0.7 and got[-1][1] > got[0][1], rho
    flat_eff, flat, flat_off, flat_rho = table_1_verdict(
        plan.CLUSTERS["a100-80g"]._replace(hbm_gbs=math.inf)
    )
    assert flat_off or flat_rho <= 0.7 or flat[-1][1] <= flat[0][1], (flat_eff, flat_off, flat_rho)


# ----------------------------------------------------------------------------- the stacks, through the CLI
def cli(argv, monkeypatch, capsys):
    """plan.py's output for argv, run in this process."""
    monkeypatch.setattr(sys, "argv", ["plan.py", *argv])
    plan.main()
    return capsys.readouterr().out


def printed(out, what):  # a percentage the CLI printed after `what`, and its band
    x = re.search(rf"{what} ([0-9.]+)%( \+- ([0-9.]+))?", out)
    return float(x[1]), x[3] and float(x[3])


def ptdp_argv(row, stack="megatron-2021"):
    """PTD-P Table 1's row as a command line (micro-batches of one sequence, full recomputation)."""
    _, a, h, L, t, p, G, B, _ = row
    return [
        "--stack",
        stack,
        "--cluster",
        "a100-80g",
        "--nodes",
        str(G // 8),
        "--n-layers",
        str(L),
        "--d-model",
        str(h),
        "--n-heads",
        str(a),
        "--vocab",
        "51200",
        "--seq-len",
        "2048",
        "--tp",
        str(t),
        "--pp",
        str(p),
        "--batch-size",
        str(B),
        "--microbatches",
        str(B // (G // (t * p))),
        "--recompute",
        "full",
    ]


def test_ptdp_table_1_through_the_cli(monkeypatch, capsys, source_once):
    """With --stack megatron-2021 (eager attention, dropout, no overlap of TP or of the gradients' reduction,
    the ceiling fitted on seven rows): every row of PTD-P Table 1 within 5 points of the paper's share of peak
    (HFU: PTD-P counts the recomputation), Spearman >= 0.8 over the ten, each printed with the stack's band
    (test_ceilings_and_bands_refit_from_the_published_rows refits it). The same rows under the 2024 stack
    (flash, no dropout, the gradients' reduction overlapped) with the same ceiling fail: the stack decides."""
    eff, held, _ = plan.ceiling("megatron-2021", "a100-80g")
    got, bands = {}, set()
    for st in ("megatron-2021", "2024"):
        got[st] = []
        for r in PTDP_TABLE_1:
            argv = ptdp_argv(r, st) + ["--efficiency", str(eff)] * (st != "megatron-2021")
            out = cli(argv, monkeypatch, capsys)
            got[st].append(printed(out, "HFU")[0])
            bands.add((st, printed(out, "MFU")[1]))
    assert bands == {("megatron-2021", held), ("2024", None)} and eff == plan.EFFICIENCY
    errors = [x - r[-1] for r, x in zip(PTDP_TABLE_1, got["megatron-2021"])]
    rho = spearman(got["megatron-2021"], [r[-1] for r in PTDP_TABLE_1])
    TABLE.extend(
        ("PTD-P Table 1, CLI --stack megatron-2021", f"{r[0]:g}B, HFU %", r[-1], x)
        for r, x in zip(PTDP_TABLE_1, got["megatron-2021"])
    )
    TABLE.append(
        ("PTD-P Table 1, CLI", "Spearman; the same under --stack 2024", round(rho, 2), got["2024"])
    )
    assert max(map(abs, errors)) <= HELD_OUT_TOL and rho >= 0.8, (errors, rho)
    wrong = [x - r[-1] for r, x in zip(PTDP_TABLE_1, got["2024"])]
    assert (
        max(map(abs, wrong)) > HELD_OUT_TOL
        or spearman(got["2024"], [r[-1] for r in PTDP_TABLE_1]) < 0.8
    )


def overlap_checks(mode):
    """TP at 8 without SP, 4 micro-batches: the seconds its all-reduces spend on NVLink, written here (4 of
    bsh per layer and micro-batch, the embedding's and head's, the vocab-parallel loss's 3 of bs fp32; ring
    2(t-1)/t), against predict's exposed["tp"] and the step, for each --tp-overlap mode."""
    M, C, (t, m, B) = plan.PRESETS["gpt3-6.7b"], plan.CLUSTERS["h100-80g"], (8, 4, 32)
    lay, b, L = plan.Layout(tp=t, m=m), B // m, M.layers
    handed = m * ((4 * L + 2) * b * M.seq * M.d * 2 + 3 * b * M.seq * 4)
    total = handed * 2 * (t - 1) / t / (C.intra_gbs * 1e9)
    none = plan.predict(M, C, lay, B, tp_overlap="none")
    got = plan.predict(M, C, lay, B, tp_overlap=mode)
    compute = got["compute_s"]
    want = {
        "none": total,
        "partial": total / 2,
        "0.25": total / 4,
        "full": max(0.0, total - compute),
    }[mode]
    return [
        math.isclose(none["exposed"]["tp"][0], total, rel_tol=1e-12),
        math.isclose(got["exposed"]["tp"][1], want, rel_tol=1e-12),
        math.isclose(none["step_s"] - got["step_s"], total - want, rel_tol=1e-9, abs_tol=1e-12),
    ]


def test_overlap_flags_state_the_exposed_communication(monkeypatch, capsys, source_once):
    """--tp-overlap none, partial, full, or a measured share: TP's exposed seconds and the step follow
    (overlap_checks); the CLI prints per axis the seconds on the links and exposed, with the overlap assumed.
    A plan that hides TP behind the GEMMs whatever the flag says (the old one, with SP) fails."""
    for mode in ("none", "partial", "0.25", "full"):
        assert all(overlap_checks(mode)), mode
    out = cli(
        [
            "--model",
            "gpt3-6.7b",
            "--tp",
            "8",
            "--dp",
            "1",
            "--batch-size",
            "32",
            "--microbatches",
            "4",
            "--tp-overlap",
            "0.25",
        ],
        monkeypatch,
        capsys,
    )
    assert re.search(r"tp [0-9.]+ / [0-9.]+ \(--tp-overlap 0.25\)", out), out
    monkeypatch.setattr(plan, "exposed_s", lambda comm, window, overlap: max(0.0, comm - window))
    assert not all(overlap_checks("0.25"))


# ----------------------------------------------------------------------------- published rows, each stack and GPU
# Every row: (source and row, published share of peak in %, plan's command line for its published layout).
# Llama 3 (Dubey et al. 2024): Table 4's three 405B rows on H100s (TP 8, PP 16, 16M tokens a step, MFU), on the
# layout Sec. 3.3.2 describes: interleaved 1F1B, the first and last stages one block short (here: an empty
# end chunk, 128 chunks of one block), no recomputation at 8K, gradients and optimizer sharded (ZeRO-2), SP,
# CP by all-gathering K and V. torchtitan's docs/performance.md (its A100 table, Llama 3 and Llama 2 on 64
# A100 80 GB, FSDP2, local batch 1 or 2, MFU counted as plan counts it: 6N + 12 L h s per token): the rows
# whose activation checkpointing plan can state (none, full); its "selective op" (every second matmul
# recomputed) and "selective layer" (every second block) are not plan's selective, and are left out.
# PTD-P's Table 2 (its PTD rows: GPT-3 175B at model-parallel size 96, t 8 x p 12, and Table 1's 530B at t 8
# x p 35, batch fixed while the GPUs double; achieved TFLOP/s per GPU by its equation (3), the share of 312
# TFLOP/s here), run as Table 1's rows are. Korthikanti et al. 2022 (Reducing Activation Recomputation):
# Table 3's four layouts and Table 5's MFU, then Sec. 6.3's 530B at 8-way data parallelism (2240 GPUs,
# 39.15 s, MFU 54.2%): Megatron-LM of 2022, SP and selective recomputation, the interleaved schedule with 3
# chunks for 175B and 530B (Sec. 6), the backward's TP all-reduces overlapped with the weight-gradient GEMMs
# (Sec. 6.2: --tp-overlap partial, half of TP's exchanges), no gradient all-reduce overlap (Sec. 6.3).
PTDP_TABLE_2 = [  # (parameters in billions, a, h, L, t, p, GPUs, batch, % of peak = TFLOP/s / 312)
    (174.6, 96, 12288, 96, 8, 12, 384, 1536, 100 * 153 / 312),
    (174.6, 96, 12288, 96, 8, 12, 768, 1536, 100 * 149 / 312),
    (174.6, 96, 12288, 96, 8, 12, 1536, 1536, 100 * 141 / 312),
    (529.6, 128, 20480, 105, 8, 35, 560, 2240, 100 * 171 / 312),
    (529.6, 128, 20480, 105, 8, 35, 1120, 2240, 100 * 167 / 312),
    (529.6, 128, 20480, 105, 8, 35, 2240, 2240, 100 * 159 / 312),
]


def sp_selective_argv(L, h, a, p, v, G, B, mb=1):
    """A row of Korthikanti et al.'s Table 3 (t 8, s 2048, V 51,200) as plan's command line."""
    return [
        *("--stack", "megatron-2021", "--cluster", "a100-80g", "--nodes", str(G // 8)),
        *("--n-layers", str(L), "--d-model", str(h), "--n-heads", str(a)),
        *("--vocab", "51200", "--seq-len", "2048", "--tp", "8", "--pp", str(p)),
        *("--virtual-stages", str(v), "--batch-size", str(B)),
        *("--microbatches", str(B // mb // (G // (8 * p))), "--sequence-parallel"),
        *("--recompute", "selective", "--tp-overlap", "partial"),
    ]


# MPT's benchmarks (mosaicml/llm-foundry, scripts/train/benchmarking/README.md as of 2024-04, its tables "H100
# 80GB BF16 (Large Scale, >= 128 GPUs)", "H100 80GB BF16" and "A100 80GB with 1600 Gbps node-node interconnect"):
# Composer and FSDP over every GPU (FULL_SHARD: ZeRO-3, SHARD_GRAD_OP: ZeRO-2), amp_bf16, block-wise activation
# checkpointing (True: full) or none, flash attention, no dropout; MPT's GPT (LayerNorm, learned positions, biases,
# GeLU 4h, V 50,368; L, h, a from scripts/train/yamls/pretrain/mpt-*.yaml, their NumParams matched exactly). Its
# MFU counts 6 x NumParams (the positions' table too) + 12 L h s a token; plan's published share is that MFU
# rescaled to plan's count, 6 (12 L h^2 + V h) + 12 L h s. Each row: (model, s, GPUs, MFU %, micro-batch,
# accumulation steps, batch, FULL_SHARD, checkpointing, NumParams), the tables' amp_bf16 rows in their order.
MPT = {  # L, h, a
    "125m": (12, 768, 12),
    "350m": (24, 1024, 16),
    "760m": (24, 1536, 12),
    "1b": (24, 2048, 16),
    "3b": (32, 2560, 20),
    "7b": (32, 4096, 32),
    "13b": (40, 5120, 40),
    "30b": (48, 7168, 56),
    "70b": (80, 8192, 64),
}
MPT_H100_LARGE = [
    ("70b", 2048, 512, 41.25, 8, 1, 4096, True, True, 64862437376),
    ("70b", 2048, 256, 42.42, 8, 1, 2048, True, True, 64862437376),
    ("70b", 2048, 128, 43.36, 8, 1, 1024, True, True, 64862437376),
    ("30b", 2048, 512, 40.27, 8, 1, 4096, True, True, 29975214080),
    ("30b", 2048, 256, 40.89, 8, 1, 2048, True, True, 29975214080),
    ("30b", 2048, 128, 41.85, 8, 1, 1024, True, True, 29975214080),
    ("13b", 2048, 512, 41.12, 16, 1, 8192, True, True, 12853954560),
    ("13b", 2048, 256, 41.42, 16, 1, 4096, True, True, 12853954560),
    ("13b", 2048, 128, 42.18, 16, 1, 2048, True, True, 12853954560),
    ("7b", 2048, 512, 42.2, 6, 1, 3072, True, False, 6658859008),
    ("7b", 2048, 256, 44.15, 6, 1, 1536, True, False, 6658859008),
    ("7b", 2048, 128, 45.71, 6, 1, 768, True, False, 6658859008),
    ("3b", 2048, 512, 39.24, 8, 1, 4096, False, False, 2651837440),
    ("3b", 2048, 256, 41.25, 8, 1, 2048, False, False, 2651837440),
    ("3b", 2048, 128, 42.43, 8, 1, 1024, False, False, 2651837440),
    ("1b", 2048, 512, 36.65, 12, 1, 6144, False, False, 1315950592),
    ("1b", 2048, 256, 39.15, 12, 1, 3072, False, False, 1315950592),
    ("1b", 2048, 128, 40.6, 12, 1, 1536, False, False, 1315950592),
]
MPT_H100 = [
    ("70b", 2048, 64, 42.57, 8, 4, 2048, True, True, 64862437376),
    ("70b", 2048, 32, 36.15, 2, 16, 1024, True, True, 64862437376),
    ("30b", 8192, 8, 29.92, 1, 21, 168, True, True, 30019254272),
    ("30b", 4096, 8, 35.86, 1, 21, 168, True, True, 29989894144),
    ("30b", 2048, 32, 43.92, 14, 3, 1344, True, True, 29975214080),
    ("30b", 2048, 16, 43.07, 10, 3, 480, True, True, 29975214080),
    ("30b", 2048, 8, 38.11, 3, 21, 504, True, True, 29975214080),
    ("30b", 1024, 8, 38.76, 6, 21, 1008, True, True, 29967874048),
    ("13b", 32768, 8, 31.68, 1, 3, 24, True, True, 13011240960),
    ("13b", 16384, 8, 35.55, 3, 3, 72, True, True, 12927354880),
    ("13b", 4096, 8, 41.6, 10, 3, 240, True, True, 12864440320),
    ("13b", 2048, 64, 39.86, 2, 1, 128, True, False, 12853954560),
    ("13b", 2048, 32, 39.95, 2, 1, 64, True, False, 12853954560),
    ("13b", 2048, 16, 39.58, 2, 1, 32, True, False, 12853954560),
    ("13b", 2048, 8, 39.79, 2, 1, 16, True, False, 12853954560),
    ("13b", 1024, 8, 44.27, 40, 3, 960, True, True, 12848711680),
    ("7b", 65536, 8, 28.59, 1, 2, 16, True, True, 6918905856),
    ("7b", 32768, 8, 30.94, 2, 2, 32, True, True, 6784688128),
    ("7b", 8192, 8, 37.14, 8, 2, 128, True, True, 6684024832),
    ("7b", 4096, 8, 40.42, 16, 2, 256, True, True, 6667247616),
    ("7b", 2048, 8, 46.44, 6, 1, 48, True, False, 6658859008),
    ("7b", 1024, 8, 42.83, 64, 2, 1024, True, True, 6654664704),
    ("3b", 65536, 8, 26.81, 1, 2, 16, True, True, 2814366720),
    ("3b", 32768, 8, 28.84, 3, 6, 144, True, True, 2730480640),
    ("3b", 16384, 8, 36.34, 1, 6, 48, True, False, 2688537600),
    ("3b", 8192, 8, 40.31, 3, 6, 144, True, False, 2667566080),
    ("3b", 4096, 8, 42.31, 5, 6, 240, True, False, 2657080320),
    ("3b", 2048, 64, 40.8, 6, 3, 1152, True, False, 2651837440),
    ("3b", 2048, 32, 41.7, 6, 3, 576, True, False, 2651837440),
    ("3b", 2048, 16, 43.73, 10, 3, 480, True, False, 2651837440),
    ("3b", 1024, 8, 46.2, 20, 6, 960, True, False, 2649216000),
    ("3b", 512, 8, 46.32, 40, 6, 1920, True, False, 2647905280),
    ("1b", 65536, 8, 26.34, 1, 2, 16, True, True, 1445974016),
    ("1b", 32768, 8, 33.54, 1, 4, 32, True, False, 1378865152),
    ("1b", 16384, 8, 35.22, 2, 4, 64, True, False, 1345310720),
    ("1b", 8192, 8, 37.73, 3, 4, 96, True, False, 1328533504),
    ("1b", 4096, 8, 40.26, 7, 4, 224, True, False, 1320144896),
    ("1b", 2048, 64, 40.85, 20, 1, 1280, True, False, 1315950592),
    ("1b", 2048, 32, 41.52, 20, 1, 640, True, False, 1315950592),
    ("1b", 2048, 16, 42.36, 20, 1, 320, True, False, 1315950592),
    ("1b", 2048, 8, 41.82, 14, 1, 112, True, False, 1315950592),
    ("1b", 1024, 8, 41.95, 18, 4, 576, True, False, 1313853440),
    ("1b", 512, 8, 43.21, 56, 4, 1792, True, False, 1312804864),
    ("760m", 32768, 8, 31.84, 1, 2, 16, True, False, 807656448),
    ("760m", 16384, 8, 33.57, 3, 2, 48, True, False, 782490624),
    ("760m", 8192, 8, 34.84, 6, 2, 96, True, False, 769907712),
    ("760m", 4096, 8, 35.83, 12, 2, 192, True, False, 763616256),
    ("760m", 2048, 32, 37.57, 24, 1, 768, True, False, 760470528),
    ("760m", 2048, 16, 37.89, 24, 1, 384, True, False, 760470528),
    ("760m", 2048, 8, 34.9, 24, 2, 384, True, False, 760470528),
    ("760m", 1024, 8, 39.76, 48, 2, 768, True, False, 758897664),
    ("760m", 512, 8, 40.42, 96, 2, 1536, True, False, 758111232),
]
MPT_A100 = [
    ("30b", 8192, 8, 39.38, 1, 21, 168, True, True, 30019254272),
    ("30b", 4096, 8, 51.37, 1, 21, 168, True, True, 29989894144),
    ("30b", 2048, 8, 55.3, 3, 21, 504, True, True, 29975214080),
    ("30b", 1024, 8, 55.82, 6, 21, 1008, True, True, 29967874048),
    ("30b", 512, 8, 56.4, 12, 21, 2016, True, True, 29964204032),
    ("13b", 32768, 8, 51.69, 1, 3, 24, True, True, 13011240960),
    ("13b", 16384, 8, 54.07, 3, 3, 72, True, True, 12927354880),
    ("13b", 8192, 8, 56.07, 5, 3, 120, True, True, 12885411840),
    ("13b", 4096, 8, 57.62, 10, 3, 240, True, True, 12864440320),
    ("13b", 2048, 8, 59.57, 2, 3, 48, True, False, 12853954560),
    ("13b", 1024, 8, 59.48, 40, 3, 960, True, True, 12848711680),
    ("7b", 65536, 8, 46.97, 1, 2, 16, True, True, 6918905856),
    ("7b", 32768, 8, 49.46, 2, 2, 32, True, True, 6784688128),
    ("7b", 16384, 8, 51.96, 4, 2, 64, True, True, 6717579264),
    ("7b", 8192, 8, 54.47, 8, 2, 128, True, True, 6684024832),
    ("7b", 4096, 8, 54.84, 16, 2, 256, True, True, 6667247616),
    ("7b", 2048, 8, 64.23, 6, 2, 96, True, False, 6658859008),
    ("7b", 1024, 8, 58.01, 64, 2, 1024, True, True, 6654664704),
    ("3b", 65536, 8, 46.05, 1, 2, 16, True, True, 2814366720),
    ("3b", 32768, 8, 47.18, 3, 6, 144, True, True, 2730480640),
    ("3b", 16384, 8, 57.13, 1, 6, 48, True, False, 2688537600),
    ("3b", 8192, 8, 59.34, 3, 6, 144, True, False, 2667566080),
    ("3b", 4096, 8, 60.53, 5, 6, 240, True, False, 2657080320),
    ("3b", 2048, 8, 62.11, 10, 2, 160, True, False, 2651837440),
    ("3b", 1024, 8, 62.73, 20, 6, 960, True, False, 2649216000),
    ("3b", 512, 8, 63.71, 40, 6, 1920, True, False, 2647905280),
    ("1b", 65536, 8, 46.18, 1, 2, 16, True, True, 1445974016),
    ("1b", 32768, 8, 55.52, 1, 4, 32, True, False, 1378865152),
    ("1b", 16384, 8, 56.6, 2, 4, 64, True, False, 1345310720),
    ("1b", 8192, 8, 56.69, 3, 4, 96, True, False, 1328533504),
    ("1b", 4096, 8, 59.0, 7, 4, 224, True, False, 1320144896),
    ("1b", 2048, 8, 59.86, 14, 4, 448, True, False, 1315950592),
    ("1b", 1024, 8, 60.15, 18, 4, 576, True, False, 1313853440),
    ("1b", 512, 8, 60.68, 56, 4, 1792, True, False, 1312804864),
    ("760m", 65536, 8, 45.34, 1, 2, 16, True, True, 857988096),
    ("760m", 32768, 8, 54.57, 1, 2, 16, True, False, 807656448),
    ("760m", 16384, 8, 54.64, 3, 2, 48, True, False, 782490624),
    ("760m", 8192, 8, 55.31, 6, 2, 96, True, False, 769907712),
    ("760m", 4096, 8, 56.05, 12, 2, 192, True, False, 763616256),
    ("760m", 2048, 8, 56.85, 24, 2, 384, True, False, 760470528),
    ("760m", 1024, 8, 47.76, 48, 2, 768, True, False, 758897664),
    ("760m", 512, 8, 45.07, 96, 2, 1536, True, False, 758111232),
    ("350m", 65536, 8, 52.7, 1, 2, 16, True, False, 420997120),
    ("350m", 32768, 8, 52.46, 2, 2, 32, True, False, 387442688),
    ("350m", 16384, 8, 53.28, 4, 2, 64, True, False, 370665472),
    ("350m", 8192, 8, 53.8, 8, 2, 128, True, False, 362276864),
    ("350m", 4096, 8, 53.31, 16, 2, 256, True, False, 358082560),
    ("350m", 2048, 8, 51.62, 32, 2, 512, True, False, 355985408),
    ("350m", 1024, 8, 50.51, 64, 2, 1024, True, False, 354936832),
    ("350m", 512, 8, 50.61, 128, 2, 2048, True, False, 354412544),
    ("125m", 65536, 8, 54.13, 1, 2, 16, True, False, 174070272),
    ("125m", 32768, 8, 52.71, 2, 2, 32, True, False, 148904448),
    ("125m", 16384, 8, 50.61, 4, 2, 64, True, False, 136321536),
    ("125m", 8192, 8, 48.85, 8, 2, 128, True, False, 130030080),
    ("125m", 4096, 8, 46.08, 16, 2, 256, True, False, 126884352),
    ("125m", 2048, 8, 44.79, 40, 2, 640, True, False, 125311488),
    ("125m", 2048, 8, 44.45, 32, 2, 512, True, False, 125311488),
    ("125m", 1024, 8, 43.15, 64, 2, 1024, True, False, 124525056),
    ("125m", 512, 8, 42.56, 128, 2, 2048, True, False, 124131840),
]


def mpt_row(source, cluster, row):
    """(name, MFU % as plan counts it, command line) of one MPT benchmark row."""
    model, s, gpus, mfu, mb, accum, B, full_shard, ckpt, n_params = row
    L, h, a = MPT[model]
    ours = 6 * (12 * L * h * h + 50368 * h) + 12 * L * h * s
    return (
        f"{source}, {model}, s {s}, {gpus} GPUs, batch {B}",
        mfu * ours / (6 * n_params + 12 * L * h * s),
        [
            *("--cluster", cluster, "--nodes", str(gpus // 8), "--dp", str(gpus)),
            *("--n-layers", str(L), "--d-model", str(h), "--n-heads", str(a), "--vocab", "50368"),
            *("--seq-len", str(s), "--batch-size", str(B), "--microbatches", str(accum)),
            *("--stage", "3" if full_shard else "2", "--recompute", "full" if ckpt else "none"),
        ],
    )


def llama3_argv(nodes, dp, s, B, m, cp=1):
    return [
        *("--model", "llama3-405b", "--nodes", str(nodes), "--seq-len", str(s)),
        *("--batch-size", str(B), "--tp", "8", "--pp", "16", "--cp", str(cp), "--dp", str(dp)),
        *("--virtual-stages", "8", "--stage-layers", "0," + "1," * 126 + "0"),
        *("--microbatches", str(m), "--stage", "2", "--sequence-parallel", "--recompute", "none"),
        *("--cp-attention", "allgather") * (cp > 1),
    ]


def titan_argv(model, B, recompute, *flags):  # 64 A100s, FSDP (ZeRO-3) over all, one micro-batch
    return [
        *("--cluster", "a100-80g", "--model", model, "--nodes", "8", "--dp", "64"),
        *("--batch-size", str(B), "--stage", "3", "--recompute", recompute, *flags),
    ]


LLAMA2 = ["--vocab", "32000", "--seq-len", "4096"]
LLAMA2_13B = [
    *LLAMA2,
    "--n-layers",
    "40",
    "--d-model",
    "5120",
    "--n-heads",
    "40",
    "--kv-heads",
    "40",
]
PUBLISHED = {
    ("megatron-2021", "a100-80g"): [
        *((f"PTD-P Table 1, {r[0]:g}B", r[-1], ptdp_argv(r)) for r in PTDP_TABLE_1),
        *((f"PTD-P Table 2, {r[0]:g}B, {r[6]} GPUs", r[-1], ptdp_argv(r)) for r in PTDP_TABLE_2),
        ("Korthikanti 2022, Table 5, 22B", 41.5, sp_selective_argv(48, 6144, 64, 1, 1, 8, 4, mb=4)),
        ("Korthikanti 2022, Table 5, 175B", 51.4, sp_selective_argv(96, 12288, 96, 8, 3, 64, 64)),
        (
            "Korthikanti 2022, Table 5, 530B",
            56.0,
            sp_selective_argv(105, 20480, 128, 35, 3, 280, 280),
        ),
        (
            "Korthikanti 2022, Table 5, 1T",
            56.3,
            sp_selective_argv(128, 25600, 160, 64, 1, 512, 512),
        ),
        (
            "Korthikanti 2022, Sec. 6.3, 530B at DP 8",
            54.2,
            sp_selective_argv(105, 20480, 128, 35, 3, 2240, 2240),
        ),
    ],
    ("2024", "h100-80g"): [
        ("Llama 3 Table 4, 8K, 8,192 GPUs", 43, llama3_argv(1024, 64, 8192, 2048, 32)),
        ("Llama 3 Table 4, 8K, 16,384 GPUs", 41, llama3_argv(2048, 128, 8192, 2048, 16)),
        ("Llama 3 Table 4, 128K, 16,384 GPUs", 38, llama3_argv(2048, 8, 131072, 128, 16, cp=16)),
        *(mpt_row("MPT H100 >= 128 GPUs", "h100-80g", r) for r in MPT_H100_LARGE),
        *(mpt_row("MPT H100", "h100-80g", r) for r in MPT_H100),
    ],
    ("2024", "a100-80g"): [
        ("torchtitan A100, Llama 3 70B, full", 51.7, titan_argv("llama3-70b", 64, "full")),
        (
            "torchtitan A100, Llama 2 13B, none",
            61.1,
            titan_argv("llama3-8b", 128, "none", *LLAMA2_13B, "--ffn", "13824"),
        ),
        (
            "torchtitan A100, Llama 2 70B, b 2, full",
            50.5,
            titan_argv("llama3-70b", 128, "full", *LLAMA2),
        ),
        *(mpt_row("MPT A100 80GB", "a100-80g", r) for r in MPT_A100),
    ],
}


def held_out(rows, i):
    """Every third row of each source (a name's text before its first comma), in its order."""
    source = rows[i][0].split(",")[0]
    return sum(r[0].split(",")[0] == source for r in rows[:i]) % 3 == 2


def run_plan(argv):
    """plan.main()'s prediction for a command line, its print discarded."""
    saved = sys.argv
    sys.argv = ["plan.py", *argv]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return plan.main()
    finally:
        sys.argv = saved


def share_of(stack, argv, eff):
    """% of peak plan predicts for a published row at GEMM ceiling eff, through the CLI: MFU; PTD-P's rows
    (Tables 1 and 2) as the paper counts them (its FLOPs formula over plan's step)."""
    got = run_plan(["--stack", stack, *argv, "--efficiency", repr(eff)])
    ptdp = [r for r in PTDP_TABLE_1 + PTDP_TABLE_2 if ptdp_argv(r) == argv]
    return paper_share(ptdp[0], got["step_s"]) if ptdp else 100 * got["mfu"]


def jackknife(errors, coverage=0.8):
    """The jackknife's prediction band (Barber et al. 2021, "Predictive inference with the jackknife+"): of n
    leave-one-out errors, the ceil(coverage (n + 1))-th smallest in size (the largest when n is too few), what
    a new row's error stays within about `coverage` of the time."""
    k = math.ceil(coverage * (len(errors) + 1))
    return sorted(map(abs, errors))[min(k, len(errors)) - 1]


def refit(stack, rows):
    """(ceiling, band, leave-one-out errors, held-out errors) of a stack's rows on one GPU: the ceiling the
    mean of the ceilings that put each fitted row at its published share; the band the jackknife's over the
    errors of each fitted row predicted at the mean of the others' (leave-one-out); the held-out rows at the
    ceiling."""
    share = [lambda e, a=argv: share_of(stack, a, e) for _, _, argv in rows]
    fit = [i for i in range(len(rows)) if not held_out(rows, i)]
    ceil = {i: implied(share[i], rows[i][1]) for i in fit}
    eff = sum(ceil.values()) / len(fit)
    loo = [share[i](sum(ceil[j] for j in fit if j != i) / (len(fit) - 1)) - rows[i][1] for i in fit]
    held = [share[i](eff) - rows[i][1] for i in range(len(rows)) if held_out(rows, i)]
    return eff, jackknife(loo), loo, held


def test_ceilings_and_bands_refit_from_the_published_rows(monkeypatch, capsys, source_once):
    """Each stack's ceiling and band on each GPU (plan.STACKS) are the refit of its published rows (the
    held-out third enters neither); the CLI prints that band beside each row's MFU and its step range beside
    the step; the held-out rows inside their band are docs/plan.md's count, at least 80% of them. A changed
    row changes the band; a GPU without rows prints no band."""
    inside = []
    for (stack, gpu), rows in PUBLISHED.items():
        eff, band, loo, held = refit(stack, rows)
        stored = plan.ceiling(stack, gpu)
        assert abs(eff - stored[0]) < 5e-4 and round(band, 1) == stored[1], (stack, gpu, eff, band)
        inside += [abs(x) <= stored[1] for x in held]
        errors = iter(held)
        for i, (name, pub, argv) in enumerate(rows):
            out = cli(["--stack", stack, *argv], monkeypatch, capsys)
            mfu, printed_band = printed(out, "MFU")
            mfu = printed(out, "HFU")[0] if name.startswith("PTD-P") else mfu  # as PTD-P counts
            step = re.search(r"predicted step ([0-9.]+) s \(([0-9.]+) to ([0-9.]+) s at MFU", out)
            assert printed_band == stored[1] and float(step[2]) < float(step[1]) < float(step[3])
            TABLE.append(
                (f"{stack} on {gpu}", f"{name}, %" + " (held out)" * held_out(rows, i), pub, mfu)
            )
            assert not held_out(rows, i) or abs(next(errors) - (mfu - pub)) < 0.5, (name, mfu)
        TABLE.append((f"{stack} on {gpu}", "ceiling, band; leave-one-out errors", (eff, band), loo))
    docs = (ROOT / "docs" / "plan.md").read_text()
    assert f"held-out rows inside their band: {sum(inside)} of {len(inside)}" in docs, inside
    assert sum(inside) >= 0.8 * len(inside), inside
    # changed rows: one published figure 2 points up moves the ceiling; every other one 5 points up, the band
    rows = list(PUBLISHED[("2024", "a100-80g")])
    one = [(rows[0][0], rows[0][1] + 2, rows[0][2]), *rows[1:]]
    assert round(refit("2024", one)[0], 4) != plan.ceiling("2024", "a100-80g")[0]
    rows = [(name, pub + 5 * (i % 2), argv) for i, (name, pub, argv) in enumerate(rows)]
    assert round(refit("2024", rows)[1], 1) != plan.ceiling("2024", "a100-80g")[1]
    out = cli(["--stack", "megatron-2021", "--cluster", "h100-80g"], monkeypatch, capsys)
    assert "no megatron-2021 rows on h100-80g" in out and "+-" not in out, out


def test_llama3_8k_cut_names_the_term(monkeypatch, capsys, source_once):
    """The issue's command, Llama 3's 8K interleaved cut (v 8, empty end chunks): plan says it does not fit and
    names the term in one line: the excess over 80 GB less the headroom, the worst rank's activations, and the
    chunk-micro-batches Megatron's interleaved order holds there, 2(p-r-1) + (v-1)p warm-up forwards + the one
    in flight (written here)."""
    argv = ["--stack", "2024", *PUBLISHED[("2024", "h100-80g")][0][2]]
    out = cli(argv, monkeypatch, capsys)
    got = run_plan(argv)
    r = got["worst"]
    mem = got["memory"][r]
    p, v = 16, 8
    over = (sum(mem.values()) - 0.9 * 80e9) / 1e9
    line = (
        f"over by {over:.1f} GB: the largest term is activations of pipeline rank {r} "
        f"({mem['activations'] / 1e9:.1f} GB, {2 * (p - r - 1) + (v - 1) * p + 1} chunk-micro-batches"
    )
    assert "does NOT fit" in out and line in out and r == 1 and over > 0, (line, out)


def interleaved_mismatches(grid):
    """(p, v, m, r) where plan's alive chunk-micro-batches (the maximal counts per local chunk) differ from
    ptdp.py's own interleaved schedule walked op by op (a pure function: ptdp.schedule, whose counted peak
    test_plan_equals_what_the_files_count holds to plan's at 2 x 2 x 2)."""
    import ptdp

    bad = []
    for p, v, m in grid:
        for r in range(p):
            alive = [0] * v
            seen = set()
            for kind, c, _ in ptdp.schedule(p, v, m, r):
                alive[c // p] += 1 if kind == "F" else -1
                seen.add(tuple(alive))
            if plan.maximal(seen) != plan.alive_patterns(p, v, m, r, "interleaved"):
                bad.append((p, v, m, r))
    return bad


def test_interleaved_warmup_is_the_repos_schedule_at_llama3_scale(monkeypatch):
    """Issue 49 item 5: the 141 chunk-micro-batches plan holds on rank 1 of Llama 3's 8K cut (p 16, v 8, m 32)
    are what the repo's interleaved schedule (Megatron's order, warm-up 2(p-r-1) + (v-1)p, capped by vm)
    holds: ptdp.schedule walked at that size and at small ones agrees chunk by chunk; plan does not
    over-count. Interleaving taken as plain 1F1B's p - r (a mutant) disagrees."""
    grid = [(2, 2, 4), (4, 2, 8), (4, 2, 4), (3, 4, 9), (4, 3, 16), (16, 8, 32)]
    assert not interleaved_mismatches(grid)
    assert max(map(sum, plan.alive_patterns(16, 8, 32, 1, "interleaved"))) == 2 * 14 + 7 * 16 + 1
    drop_interleaving(monkeypatch)
    assert interleaved_mismatches(grid)


# ----------------------------------------------------------------------------- worked examples, bad input
EXAMPLES = {
    "7B on one node": ["--model", "gpt3-6.7b", "--nodes", "1", "--search", "--top", "5"],
    "70B on 8 nodes": [
        "--model",
        "llama3-70b",
        "--nodes",
        "8",
        "--batch-size",
        "256",
        "--search",
        "--top",
        "5",
    ],
}


def closed_form_checks(M, lay, B, got):
    """The chosen layout's model state against ZeRO's closed form (mixed-precision Adam) on Psi written here,
    and, without SP, its TP bytes against 4 all-reduces of bsh per layer and micro-batch (+ embedding,
    head)."""
    h, L, V, s, t, d, p = M.d, M.layers, M.vocab, M.seq, lay.tp, lay.dp, lay.pp
    kv = M.kv * h // M.heads
    per_layer = (
        12 * h * h + 10 * h if M.arch == "gpt" else 2 * h * h + 2 * h * kv + 3 * h * M.f + 2 * h
    )
    psi = (L * per_layer + 2 * V * h) / (t * p)  # to 2%: positions and final norm left out
    k = {0: 16, 1: 4 + 12 / d, 2: 2 + 14 / d, 3: 16 / d}[lay.zero]
    ok = [math.isclose(state(got["memory"][0]), k * psi, rel_tol=0.02)]
    if t > 1 and not lay.sp:
        tp = sum(x for key, (_, x, _) in got["comm"].items() if "/tp/" in key and "step" not in key)
        ok.append(tp in [B // d * s * h * 2 * (4 * L // p + x) for x in (0, 1, 2)])  # m b = B / d
    return ok


@pytest.mark.parametrize("example", EXAMPLES)
def test_worked_example(example, monkeypatch, capsys):
    """As the README prints it (run in this process); the chosen layout's model state equals ZeRO's closed
    form, and a plan that drops the optimizer state fails that."""
    monkeypatch.setattr(sys, "argv", ["plan.py", *EXAMPLES[example]])
    plan.main()
    out = capsys.readouterr().out
    TABLE.append(("example", example, "python plan.py " + " ".join(EXAMPLES[example]), out))
    assert (
        re.search(r"--search: \d+ legal layouts on \d+ GPUs, \d+ fit", out)
        and "why 1 beats 2:" in out
    )
    args = dict(zip(EXAMPLES[example][::2], EXAMPLES[example][1::2]))
    M, B = plan.PRESETS[args["--model"]], int(args.get("--batch-size", 512))
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=int(args["--nodes"]))
    best = plan.search(M, C, B, plan.ceiling("2024", "h100-80g")[0])[0][
        0
    ]  # the CLI's default stack
    first = next(line for line in out.splitlines() if line.startswith("   1. "))
    assert str(best["layout"]) in first and f"{best['tokens_per_s']:,.0f}" in first
    assert all(closed_form_checks(M, best["layout"], B, best))
    clear_caches()
    drop_optimizer_state(monkeypatch)
    try:
        assert not all(
            closed_form_checks(M, best["layout"], B, plan.predict(M, C, best["layout"], B))
        )
    finally:
        clear_caches()


def bad_values():
    """For every flag of plan.Args, values it must refuse: a number out of range, NaN and the infinities for
    floats, a word for ints, an unknown choice, a value after a switch; and combinations that are wrong."""
    import typing
    from dataclasses import fields

    cases = []
    for f in fields(plan.Args):
        flag, hint = "--" + f.name.replace("_", "-"), typing.get_type_hints(plan.Args)[f.name]
        if hint is bool:
            cases.append(([flag, "yes"], ["unrecognized arguments"]))
        elif typing.get_origin(hint) is typing.Literal:
            cases.append(([flag, "bogus"], ["invalid choice", flag]))
        elif hint is int:
            cases += [([flag, "-1"], [flag]), ([flag, "nan"], [flag, "invalid int"])]
        else:
            cases += [([flag, x], [flag]) for x in ("-1", "nan", "inf", "-inf")]
    return cases + [
        (
            ["--model", "llama3-70b", "--nodes", "1", "--tp", "8", "--pp", "2"],
            ["16 GPUs, the cluster has 8"],
        ),
        (["--model", "gpt3-6.7b", "--tp", "3"], ["not divisible by --tp 3"]),
        (["--batch-size", "100", "--microbatches", "3"], ["not divisible by dp x microbatches"]),
        (["--pp", "2", "--dp", "4", "--virtual-stages", "3"], ["does not split into"]),
        (["--efficiency", "2"], ["--efficiency must be in (0, 1]"]),
        (["--experts", "4", "--capacity-factor", "0"], ["--capacity-factor must be > 0"]),
        (["--experts", "4", "--top-k", "5"], ["--top-k 5 must be at most --experts 4"]),
        (["--pp", "2", "--dp", "4", "--schedule", "zb-v"], ["zb-v with --virtual-stages 1"]),
        (
            [
                "--pp",
                "2",
                "--dp",
                "4",
                "--schedule",
                "zb-v",
                "--virtual-stages",
                "2",
                "--microbatches",
                "2",
            ],
            ["--microbatches >= 2p-1 = 3"],
        ),
        (
            ["--pp", "2", "--dp", "4", "--schedule", "dualpipev", "--virtual-stages", "2"],
            ["--schedule dualpipev needs --pp > 1 and --microbatches >= 2p = 4, got 1"],
        ),
        (
            [
                "--dp",
                "8",
                "--schedule",
                "dualpipev",
                "--virtual-stages",
                "2",
                "--microbatches",
                "4",
            ],
            ["--schedule dualpipev needs --pp > 1"],
        ),
        (["--stage", "4"], ["--stage must be 0, 1, 2 or 3"]),
        (["--replicate", "2"], ["--replicate 2 (HSDP) needs --stage 1, 2 or 3"]),
        (["--stage", "3", "--replicate", "3"], ["must divide dp x cp = 8"]),
        (
            ["--pp", "2", "--dp", "4", "--stage-layers", "1,2"],
            ["--stage-layers 1,2: pp x virtual stages = 2", "summing to --n-layers 32"],
        ),
        (
            ["--pp", "4", "--dp", "2", "--stage-layers", "16,0,8,8"],
            [">= 1 but for the first and last"],
        ),
        (
            ["--cp", "3", "--nodes", "3", "--gpus-per-node", "1", "--dp", "1"],
            ["--seq-len 2048 is not divisible by", "2 x --cp = 6"],
        ),
        (
            [
                "--model",
                "llama3-8b",
                "--nodes",
                "2",
                "--tp",
                "8",
                "--cp",
                "2",
                "--dp",
                "1",
                "--cp-attention",
                "ulysses",
            ],
            ["--cp-attention ulysses", "tp x cp = 16", "kv heads 8"],
        ),
        (["--days", "1", "--flops", "1e20"], ["give one of", "--days, --flops"]),
        (["--tokens", "1e9", "--gpu-hours", "10"], ["give one of"]),
        (["--flops", "1e22", "--tokens-per-param", "0"], ["--tokens-per-param must be > 0, got 0"]),
        (
            ["--tokens", "1e9", "--tokens-per-param", "20"],
            ["--tokens-per-param", "--tokens gives D"],
        ),
        (["--tokens-per-param", "20"], ["--tokens-per-param needs a budget"]),
        (
            ["--flops", "1e22", "--law", "llama3", "--tokens-per-param", "20"],
            ["replaces --law llama3"],
        ),
        (
            ["--tokens", "1e12", "--law", "llama3"],
            ["--law llama3 splits a budget", "--gpu-hours, --days"],
        ),
        (
            ["--cluster", "a100-80g", "--precision", "fp8"],
            ["--precision fp8 needs FP8 tensor cores"],
        ),
        (["--cluster", "a100-80g", "--precision", "fp8", "--search"], ["FP8 tensor cores"]),
    ]


BAD = bad_values()


@pytest.fixture(scope="module")
def source_once():
    """harness.parse_args reads Args' comments with inspect.getsource, which parses plan.py each call (0.3 s
    on a busy machine): read once for the module's many parses."""
    import functools
    import inspect

    real = inspect.getsource
    inspect.getsource = functools.lru_cache(maxsize=None)(real)
    yield
    inspect.getsource = real


@pytest.mark.parametrize("flags,words", BAD, ids=[" ".join(f) for f, _ in BAD])
def test_bad_input_is_one_line_and_exit_2(flags, words, monkeypatch, capsys, source_once):
    """Every flag, in this process; tests/test_resilience.py's matrix runs plan.py's cases as processes."""
    monkeypatch.setattr(sys, "argv", ["plan.py", *flags])
    with pytest.raises(SystemExit) as stop:
        plan.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(lines) == 1 and "plan.py: error" in lines[0], lines
    assert all(w in lines[0] for w in words), lines[0]


def test_bad_input_covers_every_flag():
    from dataclasses import fields

    named = {w for flags, _ in BAD for w in flags if w.startswith("--")}
    assert named >= {"--" + f.name.replace("_", "-") for f in fields(plan.Args)}


# ----------------------------------------------------------------------------- the whole run
# Hoffmann et al. 2022, Table 3 (Approach 1): parameters, compute-optimal FLOPs, tokens
CHINCHILLA_TABLE_3 = [
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12),
    (1e12, 1.27e26, 21.2e12),
    (10e12, 1.30e28, 216.2e12),
]
# the refit's exponent 0.513 against Approach 1's 0.50: 1-15% off to 1T, 23% at 10T
TABLE_3_TOL = 0.25


def table_3_errors(law):
    return [
        (n / N - 1, d / D - 1)
        for N, C, D in CHINCHILLA_TABLE_3
        for n, d in [plan.compute_optimal(C, law)]
    ]


def test_compute_optimal_sizes_follow_chinchilla_table_3():
    """plan's compute-optimal N and D for each FLOPs row of the paper's Table 3 within 25% (the paper's own
    Eq. 10 constants miss the table by up to 70%: that fit is caught); D = C / 6N exactly; the loss falls as
    the budget grows and stays above the fit's irreducible E."""
    errors = table_3_errors(plan.CHINCHILLA)
    TABLE.extend(
        (
            "chinchilla",
            f"Table 3 {N / 1e9:g}B at {C:.3g} FLOPs: N, D error",
            "",
            f"{e[0]:+.2f}, {e[1]:+.2f}",
        )
        for (N, C, D), e in zip(CHINCHILLA_TABLE_3, errors)
    )
    assert all(abs(x) <= TABLE_3_TOL for e in errors for x in e), errors
    assert not all(abs(x) <= TABLE_3_TOL for e in table_3_errors(plan.HOFFMANN) for x in e)
    losses = [plan.final_loss(*plan.compute_optimal(C)) for _, C, _ in CHINCHILLA_TABLE_3]
    assert losses == sorted(losses, reverse=True) and losses[-1] > plan.CHINCHILLA["E"]
    N, D = plan.compute_optimal(1e22)
    assert math.isclose(6 * N * D, 1e22, rel_tol=1e-12)


def test_failures_follow_a_simulated_run():
    """plan's wall time with failures (Young/Daly to first order) against a simulated run: exponential
    failures at the rate, a checkpoint every tau (writing delta), each failure losing the work since the last
    checkpoint and a restart R; the mean of 400 runs within 3%. Without the restart term it misses."""
    import random

    work, gpus, rate, delta, R = 30 * 86400.0, 16384, 2e-5, 60.0, 600.0
    wall, tau, fails = plan.with_failures(work, gpus, rate, delta, R)
    mtbf = 3600 / (rate * gpus)
    assert math.isclose(tau, math.sqrt(2 * delta * mtbf)) and math.isclose(fails, wall / mtbf)
    rng, walls = random.Random(0), []
    for _ in range(400):
        t, done, nxt = 0.0, 0.0, rng.expovariate(1 / mtbf)
        while done < work:
            # an interval, then its checkpoint
            seg = min(tau, work - done) + delta * (done + tau < work)
            if t + seg <= nxt:
                t, done = t + seg, done + min(tau, work - done)
            else:  # lost: the part of this interval run, then the restart
                t, nxt = nxt + R, nxt + R + rng.expovariate(1 / mtbf)
        walls.append(t)
    sim = sum(walls) / len(walls)
    TABLE.append(
        (
            "failures",
            "30 days of work, 16384 GPUs, 2e-5 per GPU-hour: wall days, plan vs simulated",
            wall / 86400,
            sim / 86400,
        )
    )
    assert abs(wall / sim - 1) < 0.03, (wall / 86400, sim / 86400)
    no_restart = plan.with_failures(work, gpus, rate, delta, 0.0)[0]
    assert abs(no_restart / sim - 1) >= 0.03


def test_whole_run_from_a_budget(monkeypatch, capsys):
    """`--days 30 --nodes 64` (Done when): the printed model, tokens, layout, wall time with failures,
    GPU-hours and loss; the wall time is the budget's 30 days, the tokens what the layout trains in them, the
    model the shape nearest Chinchilla's N."""
    argv = [
        "--model",
        "llama3-70b",
        "--days",
        "30",
        "--nodes",
        "64",
        "--failures-per-gpu-hour",
        "2e-5",
        "--usd-per-gpu-hour",
        "2",
    ]
    monkeypatch.setattr(sys, "argv", ["plan.py", *argv])
    got = plan.main()
    out = capsys.readouterr().out
    TABLE.append(("example", "the whole run", "python plan.py " + " ".join(argv), out))
    assert math.isclose(got["wall_s"], 30 * 86400, rel_tol=1e-9) and got["failures"] > 0
    for words in (
        "compute-optimal for C",
        "parameters: L",
        "wall time 30.00 days",
        "GPU-hours, $",
        "predicted final loss",
    ):
        assert words in out, (words, out)
    assert f"{got['loss']:.3f}" in out and 0.5 < got["N"] / 70e9 < 2
    C, law, N, D = law_line(out)  # the default law, Chinchilla's, as before --law
    assert law.startswith("Chinchilla Approach 3") and printed_as(N, D, *plan.compute_optimal(C)), (
        N,
        D,
    )


def law_line(out):
    """(C, the law, N, D) of a budget's line `compute-optimal for C = ... FLOPs (law): N ...B, D ...B`."""
    x = re.search(
        r"compute-optimal for C = ([0-9.e+]+) FLOPs \((.*)\): N ([0-9.,]+)B, D ([0-9,]+)B", out
    )
    return float(x[1]), x[2], float(x[3].replace(",", "")) * 1e9, float(x[4].replace(",", "")) * 1e9


def printed_as(N, D, n, d):  # N to 0.1B and D to 1B, as printed
    return abs(N - n) <= 0.05e9 and abs(D - d) <= 0.5e9


LLAMA3 = (3.8e25, 402e9, 16.55e12)  # Dubey et al. 2024, Sec. 3.2.1: C, the N and D its law chose


def llama3_misses(N, D):
    """Where a budget's (N, D) at 3.8e25 FLOPs leaves Llama 3's own choice: D beyond 3% of 16.55T (the
    law's alpha 0.537 to its last digit moves D by 10^(0.0005 x 25.6) = 1.03x), N beyond 5% of 402B (the
    paper's pair is 6ND = 3.99e25, 5% above its C: no N, D with 6ND = C meets both exactly)."""
    C, n, d = LLAMA3
    return [w for w, ok in (("D", abs(D / d - 1) <= 0.03), ("N", abs(N / n - 1) <= 0.05)) if not ok]


def test_budget_with_llama3s_law_through_the_cli(monkeypatch, capsys, source_once):
    """`--flops 3.8e25 --law llama3`: Llama 3's law (its Figure 3's fit, D = 0.299 C^0.537) gives 389B on
    16.3T tokens, its paper's choice (402B, 16.55T) within what the paper's figures allow (llama3_misses).
    Mutants, each through the CLI: the law with Chinchilla's exponent of D (alpha / (alpha + beta) = 0.487),
    and the text's rounding (0.53, 0.29), which gives 10.5T. `--tokens-per-param 38.5` (Llama 3 405B as
    trained, 15.6T / 405B) gives N = sqrt(C / 6R), D = R N: 406B on 15.6T. The layout search, the same for
    every run here, runs once."""
    real, ranked = plan.search, []
    monkeypatch.setattr(
        plan, "search", lambda *a, **k: ranked or ranked.extend(real(*a, **k)) or ranked
    )
    argv = ["--model", "llama3-405b", "--flops", "3.8e25", "--nodes", "256"]
    C, law, N, D = law_line(cli([*argv, "--law", "llama3"], monkeypatch, capsys))
    TABLE.append(
        (
            "budget",
            "Llama 3's law at 3.8e25 FLOPs: N, D (the paper: 402B, 16.55T)",
            f"{N / 1e9:.0f}B",
            f"{D / 1e12:.2f}T",
        )
    )
    assert C == LLAMA3[0] and law.startswith("Llama 3's fit") and not llama3_misses(N, D), (
        law,
        N,
        D,
    )
    assert printed_as(N, D, *plan.compute_optimal(C, plan.LAWS["llama3"]))
    ch = plan.CHINCHILLA
    for wrong in (
        dict(A=0.299, alpha=ch["alpha"] / (ch["alpha"] + ch["beta"])),
        dict(A=0.29, alpha=0.53),
    ):
        monkeypatch.setitem(plan.LAWS, "llama3", wrong)
        mutant = law_line(cli([*argv, "--law", "llama3"], monkeypatch, capsys))
        assert llama3_misses(*mutant[2:]), (wrong, mutant)
    assert abs(mutant[3] / 10.46e12 - 1) < 1e-3  # the text's constants: 10.5T, 605B
    C, law, N, D = law_line(cli([*argv, "--tokens-per-param", "38.5"], monkeypatch, capsys))
    assert law == "D = 38.5 N" and printed_as(
        N, D, math.sqrt(C / (6 * 38.5)), 38.5 * math.sqrt(C / 231)
    )
    assert abs(N / 405e9 - 1) < 0.01 and abs(D / 15.6e12 - 1) < 0.01, (N, D)


# ----------------------------------------------------------------------------- --precision fp8
def fp8_counted(tmp_path_factory):
    """fp8.py's all-gather bytes per rank and step, counted (harness.CommCounter): its training step in
    tests/fp8_checks.py's runs at world 2 (each recipe, weights gathered in bf16 and in FP8) and 3 (in FP8),
    and fp8.py's own --json at world 3 (current, FP8): {(recipe, how, world, source): (bytes, plan.Model of
    the run's shape)}. The launches are tests/test_fp8.py's (shared in one session)."""
    import test_fp8

    summary, _ = test_fp8.shared_file_run(tmp_path_factory)
    cfg, f = summary["config"], summary["figures"]
    M = plan.Model(cfg["n_layers"], cfg["d_model"], cfg["n_heads"], cfg["vocab"], cfg["seq_len"])
    got = {("current", "FP8", 3, "fp8.py --json"): (f["all_gather_bytes_per_step"], M)}
    for line in test_fp8.shared_checks(2) + test_fp8.shared_checks(3):
        x = re.search(
            r"\) (\S+), (FP8|bf16) all-gather: (\d+) bytes .* d_model (\d+), (\d+) layers, "
            r"world (\d+)",
            line,
        )
        if x:
            M = plan.Model(layers=int(x[5]), d=int(x[4]), heads=2, vocab=32, seq=8)
            got[x[1], x[2], int(x[6]), "fp8_checks"] = int(x[3]), M
        # the file's default width, 1 layer: no GEMM dimension a whole tile, W's rows uneven at world 3
        x = re.search(
            r"default width, (\S+), (FP8) gather at world (\d+): .* padded shards' all-gather (\d+) bytes",
            line,
        )
        if x:
            M = plan.Model(
                layers=1, d=CommonArgs.d_model, heads=CommonArgs.n_heads, vocab=32, seq=16
            )
            got[x[1], x[2], int(x[3]), "fp8_checks, default width"] = int(x[4]), M
    return got


def fp8_mismatches(got, with_step=True):
    """plan against fp8.py's counts: fp8.py shards only the blocks' GEMM weights (plan.gemm_units), gathered
    for forward and for backward: each == plan.weight_gather twice, forward's with the block scales
    (per-tensor recipes send their one scale by a 4-byte all-reduce: none in the gather), each weight's shard
    padded to whole tiles (128 fine-grained, 16 per tensor). And plan's own ZeRO-3 step (collectives, the
    CLI's) changes by what fp8.py's does: FP8 less bf16, one model, world 2 (unless with_step=False)."""
    bad = []
    for (recipe, how, world, _), (counted, M) in got.items():
        lay = plan.Layout(dp=world, zero=3, precision="fp8" if how == "FP8" else "bf16")
        # fp8.py's psi: its GEMM weights, in FP8 with --fp8-all-gather
        shapes = [x for unit in plan.gemm_units(M, lay, 0) for x in unit]
        g = sum(n * k for n, k in shapes)
        tile = 128 if recipe == "fine-grained" else 16
        want = sum(
            plan.weight_gather(g, shapes * (how == "FP8"), world, 2, s, tile)
            for s in (recipe == "fine-grained", False)
        )
        bad += [(recipe, how, world, counted, want)] * (counted != want)
    if not with_step:
        return bad
    (fp8, M), (bf16, _) = (got["fine-grained", how, 2, "fp8_checks"] for how in ("FP8", "bf16"))
    step = {
        p: sum(
            x[1]
            for k, x in plan.collectives(M, plan.Layout(dp=2, zero=3, precision=p), 4).items()
            if k.startswith("all_gather/dp")
        )
        for p in ("fp8", "bf16")
    }
    return bad + [("ZeRO-3 step", step, fp8 - bf16)] * (step["fp8"] - step["bf16"] != fp8 - bf16)


def test_fp8_gather_bytes_equal_fp8s_counts(monkeypatch, tmp_path_factory):
    """--precision fp8's all-gather bytes == fp8.py's counted, byte for byte, at world 2 (bf16 and FP8
    gathers of every recipe) and world 3 (FP8; and fp8.py's own --json), both with fine-grained block scales,
    and at the file's default width (d_model 64: no dimension a whole tile, W's rows uneven over 3 ranks; its
    FP8 gathers at world 3, each recipe); the ZeRO-3 step of the CLI changes by what fp8.py's counts change.
    Mutants caught: the block scales forgotten, the FP8 weights at bf16's 2 bytes, shards as if whole tiles
    (the flat 1/d of the old formula: caught at the default width, each recipe)."""
    got = fp8_counted(tmp_path_factory)
    assert {(r, h, w) for r, h, w, _ in got} >= {
        ("fine-grained", "FP8", 2),
        ("fine-grained", "FP8", 3),
        ("current", "bf16", 2),
        ("current", "FP8", 3),
    }, got
    assert not fp8_mismatches(got), fp8_mismatches(got)
    TABLE.append(
        (
            "fp8",
            "all-gather bytes per rank and step, plan == fp8.py counted",
            "",
            ", ".join(f"{r} {h} w{w} ({s}): {b}" for (r, h, w, s), (b, _) in sorted(got.items())),
        )
    )
    real = plan.weight_gather
    for mutant in (
        lambda psi, g, d, p, scales=True, tile=128: real(psi, g, d, p, False, tile),  # no scales
        lambda psi, g, d, p, scales=True, tile=128: real(psi, [], d, p, scales, tile),  # 2 bytes
    ):  # an FP8 element
        monkeypatch.setattr(plan, "weight_gather", mutant)
        assert fp8_mismatches(got)
    monkeypatch.setattr(plan, "weight_gather", real)
    # the padding: shards of whole tiles at the default width (FP8 at world 3), the shards as if whole
    padded = {k: x for k, x in got.items() if k[3].endswith("default width")}
    assert len(padded) == 3, got
    flat = lambda psi, g, d, p, scales=True, tile=128: (  # noqa: E731
        real(psi, [], d, 1, False) + 4 * sum(n * k for n, k in g) // (d * 128**2) * scales
    )
    monkeypatch.setattr(plan, "weight_gather", flat)
    assert len(fp8_mismatches(padded, with_step=False)) == 3
    monkeypatch.setattr(plan, "weight_gather", real)


def test_fp8_time_and_memory_closed_form():
    """--precision fp8 against bf16 on one layout (HBM taken as infinite, so a GEMM is its FLOPs at eff x
    peak): a block's forward is shorter by half its projections' GEMM time, 2 bs x 12h^2 FLOPs at eff x 989
    TFLOP/s, at FP8's 2x peak (the attention core stays bf16); model state and activations unchanged; ZeRO-3's
    gathered units smaller by a byte per GEMM weight, + 4 bytes a 128x128 block. Mutant: the FP8 peak
    ignored (the a100's factor 0 refused; 1 here) fails."""
    M, h, b, eff = plan.Model(layers=4, d=1024, heads=8, vocab=512, seq=256), 1024, 2, 0.7
    C = plan.CLUSTERS["h100-80g"]._replace(hbm_gbs=math.inf)
    lay = {p: plan.Layout(dp=4, zero=3, precision=p) for p in ("bf16", "fp8")}
    half = 0.5 * 2 * b * M.seq * 12 * h * h / (eff * C.tflops * 1e12)
    fwd = {p: plan.block_s(M, C, x, b, eff)[0] for p, x in lay.items()}
    assert math.isclose(fwd["bf16"] - fwd["fp8"], half, rel_tol=1e-12), (fwd, half)
    assert not math.isclose(
        plan.block_s(M, C._replace(fp8=1), lay["fp8"], b, eff)[0] + half, fwd["bf16"], rel_tol=1e-6
    )
    mem = {p: plan.memory(M, x, 16, 0) for p, x in lay.items()}
    # a block's GEMM weights; the two largest units gathered beside the root are blocks
    g = 12 * h * h
    assert {k: v for k, v in mem["fp8"].items() if k != "gathered"} == {
        k: v for k, v in mem["bf16"].items() if k != "gathered"
    }
    assert mem["bf16"]["gathered"] - mem["fp8"]["gathered"] == 2 * (g - 4 * g // 128**2), mem


def test_moe_under_full_recomputation_keeps_block_inputs():
    """Full recomputation keeps each block's input and rebuilds one layer at a time: an MoE model holds its
    expert dispatch buffers (E C slots of 2h + 2f) once, not per layer. A 70B model with 8 experts at tp 8,
    ZeRO-3 on 8192 GPUs fits; counting the buffers in every layer (the old plan) does not."""
    M = plan.PRESETS["llama3-70b"]._replace(experts=8, top_k=2)
    lay = plan.Layout(dp=1024, tp=8, ep=8, zero=3, recompute="full")
    bs, e = 2 * M.seq, 2
    extra = (8 * math.ceil(1.25 * 2 * bs / 8) * (2 * M.d + 2 * M.f) - bs * 2 * M.f) * e
    dense = plan.memory(M._replace(experts=0), lay, 2048, 0)["activations"]
    assert plan.memory(M, lay, 2048, 0)["activations"] == dense + extra
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=1024)
    assert plan.legal(M, C, lay, 2048) is None and sum(plan.memory(M, lay, 2048, 0).values()) < 72e9
    assert dense + M.layers * extra > 80e9


# ----------------------------------------------------------------------------- a Llama block's saved bytes
# No technique file trains a Llama block, so the test builds one (float64) and counts, with saved-tensor
# hooks, the storages autograd keeps for backward (each once, however many views of it are saved; parameters
# and RoPE's cos/sin tables left out: they do not grow with the tokens). The norm and the SwiGLU are written
# as the fused kernels of a 2024 stack save (Apex/TE RMSNorm: input and 1/rms; a fused SwiGLU: gate and up),
# each checked against torch's own unfused ops (same loss and gradients); the attention is torch's
# scaled_dot_product_attention with grouped K/V (enable_gqa), RoPE plain torch ops.
LLAMA_BLOCK = plan.Model(layers=1, d=16, heads=4, vocab=32, seq=8, kv_heads=2, ffn=40, arch="llama")


def llama_block(M, b, fused=True, seed=0):
    """(block(x) -> y, parameters) of one pre-norm Llama block: x + o(attn(rope(q), rope(k), v)) then
    x + down(silu(gate) up), each under an RMSNorm; fused=False: torch's F.rms_norm and F.silu, unfused."""
    import torch
    import torch.nn.functional as F

    h, kv, f, s, dh = M.d, M.kv, M.f, M.seq, M.d // M.heads
    g = torch.Generator().manual_seed(seed)
    W = {
        k: torch.randn(*shape, generator=g, dtype=torch.float64)
        .div(shape[-1] ** 0.5)
        .requires_grad_()
        for k, shape in dict(
            q=(h, h),
            k=(kv * dh, h),
            v=(kv * dh, h),
            o=(h, h),
            gate=(f, h),
            up=(f, h),
            down=(h, f),
            n1=(h,),
            n2=(h,),
        ).items()
    }
    pos = torch.arange(s, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, dh, 2) / dh)
    cos, sin = (
        torch.cat([pos.cos()] * 2, -1)[:, None],
        torch.cat([pos.sin()] * 2, -1)[:, None],
    )  # (s, 1, dh)

    class RMSNorm(torch.autograd.Function):  # keeps its input and 1/rms (fp32 at least)
        @staticmethod
        def forward(ctx, x, w):
            r = (x * x).mean(-1, keepdim=True).add(1e-6).rsqrt()
            ctx.save_for_backward(x, w, r)
            return x * r * w

        @staticmethod
        def backward(ctx, dy):
            x, w, r = ctx.saved_tensors
            n, dn = x * r, dy * w
            return r * (dn - n * (dn * n).mean(-1, keepdim=True)), (dy * n).flatten(0, -2).sum(0)

    class SwiGLU(torch.autograd.Function):  # keeps gate and up; silu(gate) recomputed in backward
        @staticmethod
        def forward(ctx, gate, up):
            ctx.save_for_backward(gate, up)
            return F.silu(gate) * up

        @staticmethod
        def backward(ctx, dy):
            gate, up = ctx.saved_tensors
            sg = torch.sigmoid(gate)
            return dy * up * sg * (1 + gate * (1 - sg)), dy * gate * sg

    norm = RMSNorm.apply if fused else lambda x, w: F.rms_norm(x, (h,), w, 1e-6)
    swiglu = SwiGLU.apply if fused else lambda gate, up: F.silu(gate) * up

    def rope(x):  # (b, s, heads, dh): rotate pairs (i, i + dh/2) by the position's angles
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def block(x, seen=None):
        mark = seen or (lambda name, t=None: t)
        mark("norm 1")
        n1 = mark("norm output", norm(mark("norm input", x), W["n1"]))
        mark("projections")
        q, k, v = (F.linear(n1, W[c]).view(b, s, -1, dh) for c in "qkv")
        mark("rope")
        q, k = mark("q, k, v", rope(q)), mark("q, k, v", rope(k))
        mark("attention")
        o = F.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, mark("q, k, v", v))),
            is_causal=True,
            enable_gqa=True,
        )
        # flash's (b, s, a, dh): a view
        o = mark("attention output", o.transpose(1, 2).reshape(b, s, h))
        mark("projections")
        x = x + F.linear(o, W["o"])
        mark("norm 2")
        n2 = mark("norm output", norm(mark("norm input", x), W["n2"]))
        mark("projections")
        gate, up = F.linear(n2, W["gate"]), F.linear(n2, W["up"])
        mark("swiglu")
        prod = mark("swiglu", swiglu(mark("swiglu", gate), mark("swiglu", up)))
        mark("projections")
        return x + F.linear(prod, W["down"])

    return block, list(W.values()), (cos, sin)


ITEM_OF = {
    "norm input": "norm inputs",
    "norm output": "norm outputs",
    "q, k, v": "q, k, v",
    "attention output": "attention output",
    "swiglu": "SwiGLU gate, up, product",
    "norm 1": "norm statistics",
    "norm 2": "norm statistics",
    "attention": "logsumexp",
}


def llama_saved(M, b, fused=True):
    """Bytes per token the block saves for backward, by plan's item: each saved storage once, named by the
    tensor it is (norm input, q, k, v, ...) or, when the block never sees it (1/rms, logsumexp), by the part
    that saved it."""
    import torch

    block, params, tables = llama_block(M, b, fused)
    skip = {t.untyped_storage().data_ptr() for t in [*params, *tables]}
    names, phase, kept = {}, ["input"], {}

    def mark(name, t=None):  # a named tensor, or (t None) the part of the block now running
        if t is None:
            phase[0] = name
        else:
            names.setdefault(t.untyped_storage().data_ptr(), name)
        return t

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in skip:
            kept.setdefault(st.data_ptr(), (st.nbytes(), phase[0]))
        return t

    x = torch.randn(b, M.seq, M.d, dtype=torch.float64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, mark)
    out = {}
    for ptr, (nbytes, where) in kept.items():
        item = ITEM_OF.get(names.get(ptr, where), f"unnamed, saved in {where}")
        out[item] = out.get(item, 0) + nbytes // (b * M.seq)
    return out


def test_llama_fused_ops_are_torchs():
    """The fused RMSNorm and SwiGLU give the loss and gradients of torch's F.rms_norm and F.silu (1e-12)."""
    import torch

    M, b = LLAMA_BLOCK, 2
    x = torch.randn(b, M.seq, M.d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for fused in (True, False):
        block, params, _ = llama_block(M, b, fused)
        loss = block(x).square().sum()
        grads.append([loss.detach()] + list(torch.autograd.grad(loss, params)))
    assert all(torch.allclose(p, q, rtol=1e-12, atol=1e-12) for p, q in zip(*grads))


def llama_mismatches(M, b=2):
    want = {k: n for k, n, _, _ in plan.layer_items(M, 8)}
    got = llama_saved(M, b)
    total = plan.layer_bytes(M, plan.Layout(precision="fp64"), b, 8)
    bad = [
        (k, got.get(k), want.get(k))
        for k in sorted(set(got) | set(want))
        if got.get(k) != want.get(k)
    ]
    return bad + (
        [("total", sum(got.values()) * b * M.seq, total)]
        if sum(got.values()) * b * M.seq != total
        else []
    ), got


def old_swiglu(mp):  # silu(gate) kept as well: torch's unfused F.silu(gate) * up
    real = plan.layer_items
    mp.setattr(
        plan,
        "layer_items",
        lambda M, e, **k: [
            (w, n * 4 // 3 if w.startswith("SwiGLU") else n, *r) for w, n, *r in real(M, e, **k)
        ],
    )


def pre_rope_qk(mp):  # q and k kept before the rotation too
    real = plan.layer_items
    mp.setattr(
        plan,
        "layer_items",
        lambda M, e, **k: (
            real(M, e, **k) + [("q, k before RoPE", (M.d + M.kv * M.d // M.heads) * e, True, True)]
        ),
    )


def no_gqa(mp):  # K and V of every head
    real = plan.layer_items
    mp.setattr(plan, "layer_items", lambda M, e, **k: real(M._replace(kv_heads=0), e, **k))


LLAMA_MUTANTS = {
    "unfused SwiGLU": old_swiglu,
    "q, k kept before RoPE": pre_rope_qk,
    "no GQA": no_gqa,
}


def test_llama_block_memory_equals_what_torch_saves(monkeypatch):
    """Each of plan's Llama items (norm inputs, outputs, statistics, q k v with kv heads, attention output,
    SwiGLU, logsumexp) equals the bytes per token torch saves for the block, and nothing unnamed is saved;
    each mutant (the old plan's unfused SwiGLU, q and k kept before RoPE; K/V of every head) fails."""
    bad, got = llama_mismatches(LLAMA_BLOCK)
    TABLE.append(("llama block", "bytes saved per token, by item (float64)", got, bad or "equal"))
    TABLE.append(
        (
            "llama block",
            "the same with torch's unfused rms_norm and silu (reported)",
            sum(llama_saved(LLAMA_BLOCK, 2, fused=False).values()),
            sum(got.values()),
        )
    )
    assert not bad and len(got) == 7, bad
    for name, mutant in LLAMA_MUTANTS.items():
        with monkeypatch.context() as mp:
            clear_caches()
            mutant(mp)
            assert llama_mismatches(LLAMA_BLOCK)[0], name
    clear_caches()


# ----------------------------------------------------------------------------- uneven stages, every pp and v
def test_uneven_gpipe_cut_the_loss_term():
    """Issue 49 item 6: gpipe.py at 3 stages of 4 blocks (2/1/1), m 6, b 2, float64, measured 252,720 bytes
    held for backward on stage 2 where plan said 252,768. The 48 bytes are the last stage's output, its 0-dim
    loss (8 bytes a micro-batch, m 6), which plan counts (Layout.outputs) and gpipe.py's watcher does not see
    (it takes the loss function from main()): pipeline_rows takes it out, and the folded launch "gpipe p 4 m
    8, 6 blocks 2/2/1/1" holds an uneven cut to the byte."""
    M = TINY_MODEL._replace(layers=4)
    lay = plan.Layout(
        pp=3, m=6, schedule="gpipe", precision="fp64", vocab_parallel=False, outputs=True
    )
    assert plan.memory(M, lay, 12, 2)["activations"] - 8 * 6 == 252_720
    assert [len(x) for x in plan.chunks(4, 3)] == [2, 1, 1]


def test_blocks_per_stage_as_the_files_split_them():
    """plan's cut of L blocks into p stages is gpipe.py's and pipedream.py's (imported here, in the test only)
    for every L up to 24 and p up to L."""
    import gpipe  # noqa: E401
    import pipedream

    for L in range(1, 25):
        for p in range(1, L + 1):
            want = [range(a, z) for a, z in gpipe.split_layers(L, p)]
            assert (
                list(plan.chunks(L, p))
                == want
                == [range(a, z) for a, z in pipedream.split_layers(L, p)]
            )


def test_stage_layers_a_hand_made_cut():
    """Llama 3 405B (126 blocks) cut 7 + 14 x 8 + 7 over 16 stages: rank 0 holds 7 blocks and the embedding,
    rank 15 7 blocks, the final norm and the head; parameters per rank and TP bytes against the closed form
    written here (GQA attention 2h^2 + 2h kv, SwiGLU 3hf, 2 norms h); the files' cut (8 on the first 14) is
    another layout; --search now offers pp 4 to 64 for it, where pp had to divide 126."""
    M, t, b = plan.PRESETS["llama3-405b"], 8, 1
    h, f, kvh, V = M.d, M.f, M.kv * M.d // M.heads, M.vocab
    split = (7,) + (8,) * 14 + (7,)
    lay = plan.Layout(dp=16, tp=t, pp=16, m=16, zero=1, split=split)
    block = (2 * h * h + 2 * h * kvh + 3 * h * f) // t + 2 * h
    assert plan.rank_units(M, lay, 0) == [block] * 7 + [V * h // t]
    assert plan.rank_units(M, lay, 15) == [block] * 7 + [V * h // t + h]
    assert plan.rank_units(M, lay, 5) == [block] * 8 + [0]
    files = plan.rank_units(M, plan.Layout(dp=16, tp=t, pp=16, m=16), 0)
    assert files == [block] * 8 + [V * h // t]
    bsh = b * M.seq * h * 2
    tp_fwd = plan.collectives(M, lay, 16 * 16 * b, 0)["all_reduce/tp/fwd"]
    assert tp_fwd[:2] == [
        16 * (2 * 7 + 1),
        16 * (2 * 7 + 1) * bsh,
    ]  # 2 per block, + the embedding's
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=256)
    assert {lay.pp for lay in plan.layouts(M, C, 2048)} == {1, 2, 4, 8, 16, 32, 64}
    assert (
        plan.legal(M, C, replace(lay, split=(8,) * 16), 2048)
        and plan.legal(M, C, lay, 2048) is None
    )


def test_stage_layers_empty_end_chunks(monkeypatch, capsys, source_once):
    """Llama 3's cut (Sec. 3.3.2): the first chunk the embedding alone, the last the head and loss alone,
    through the CLI (1F1B, 0/9x14/0; interleaved v 8, 0/1x126/0). Ranks 0 and 15 then hold no block, so the
    worst rank is one plan used not to look at: rank 1, 9 blocks x 15 micro-batches."""
    M, t = plan.PRESETS["llama3-405b"], 8
    h, V = M.d, M.vocab
    lay = plan.Layout(dp=64, tp=t, pp=16, m=32, zero=2, sp=True, split=(0,) + (9,) * 14 + (0,))
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=1024)
    assert plan.legal(M, C, lay, 2048) is None
    assert plan.rank_units(M, lay, 0) == [V * h // t] and plan.rank_units(M, lay, 15) == [
        V * h // t + h
    ]
    assert plan.chunk_s(M, C, lay, 1, 0, plan.EFFICIENCY) == (0.0, 0.0)
    got = plan.predict(M, C, lay, 2048)
    mem = {r: sum(plan.memory(M, lay, 2048, r).values()) for r in range(16)}
    assert got["worst"] == max(mem, key=mem.get) == 1 and mem[1] > 10 * mem[0]
    assert sum(got["memory"][got["worst"]].values()) == mem[1]
    base = [
        "plan.py",
        "--model",
        "llama3-405b",
        "--nodes",
        "1024",
        "--tp",
        "8",
        "--pp",
        "16",
        "--batch-size",
        "2048",
        "--microbatches",
        "32",
        "--sequence-parallel",
        "--stage",
        "2",
    ]
    for extra, blocks in [
        (["--stage-layers", ",".join(map(str, lay.split))], "blocks 0/9x14/0"),
        (
            ["--virtual-stages", "8", "--stage-layers", ",".join(["0"] + ["1"] * 126 + ["0"])],
            "interleaved v 8 zero 2 m 32 recompute none blocks 0/1x126/0",
        ),
    ]:
        monkeypatch.setattr(sys, "argv", base + extra)
        plan.main()
        out = capsys.readouterr().out
        assert blocks in out and "pipeline rank 1 " in out, out


def test_search_shares_long_sequences_over_cp(monkeypatch):
    """From plan.CP_FROM tokens --search tries cp of 2^k (the ring): Llama 3 8B at 128K tokens on 4 nodes,
    TP 8 without pipeline (keep, to stay small): its first layout shares the sequence over cp ranks and is
    within 10% of the fastest of the layouts written here by hand (cp 2 and 4, each ZeRO stage and
    recomputation); the old search, without cp, offers nothing within 10%."""
    M, C = (
        plan.PRESETS["llama3-8b"]._replace(seq=131072),
        plan.CLUSTERS["h100-80g"]._replace(nodes=4),
    )
    eff, keep = plan.ceiling("2024", "h100-80g")[0], lambda lay: lay.tp == 8 and lay.pp == 1
    hand = [
        plan.predict(M, C, lay, 8, eff)
        for lay in (
            plan.Layout(dp=4 // cp, tp=8, cp=cp, m=cp * 2, zero=z, sp=True, recompute=rc)
            for cp in (2, 4)
            for z in range(4)
            for rc in ("none", "selective", "full")
        )
    ]
    best = max(x["tokens_per_s"] for x in hand if x["fits"])
    first = plan.search(M, C, 8, eff, keep=keep)[0][0]
    TABLE.append(
        (
            "search over cp",
            "Llama 3 8B, 128K, 32 H100s: --search's first, tok/s; best by hand",
            f"{first['tokens_per_s']:,.0f} ({first['layout']})",
            f"{best:,.0f}",
        )
    )
    assert first["layout"].cp > 1 and first["tokens_per_s"] >= 0.9 * best
    monkeypatch.setattr(plan, "CP_FROM", math.inf)
    assert plan.search(M, C, 8, eff, keep=keep)[0][0]["tokens_per_s"] < 0.9 * best


def test_search_costs_what_it_exposes(monkeypatch, capsys, source_once):
    """--search cannot promise what its stack never reached (issue 49 item 4): every layout it ranks for
    Llama 3 8B at 128K tokens on 4 nodes (pp up to 2, to stay small) is at most the stack's ceiling in MFU,
    and the CLI prints the band beside each. The ring's exposed seconds are what the attention it hides
    behind leaves at that sequence length, max(0, ring - attention), recomputed here from chunk_s: hidden at
    128K on cp 2, shown at 32K on cp 32. Where no v cuts L into equal chunks, Llama 3's cut is offered
    (the first and last chunks one block short)."""
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=4)
    eff, band, _ = plan.ceiling("2024", "h100-80g")
    M = plan.PRESETS["llama3-8b"]._replace(seq=131072)
    ranked = plan.search(M, C, 8, eff, keep=lambda lay: lay.pp <= 2)[0]
    assert ranked and max(x["mfu"] for x in ranked) <= eff, max(x["mfu"] for x in ranked)
    exposed = []
    for s, cp in ((131072, 2), (32768, 32)):
        M = plan.PRESETS["llama3-8b"]._replace(seq=s)
        lay = plan.Layout(dp=32 // cp, cp=cp, m=2, zero=3, recompute="full")
        got = plan.predict(M, C, lay, 2 * 32 // cp, eff)
        ring, shown = got["exposed"]["cp"]
        attention = lay.m * plan.chunk_s(M, C, lay, 1, 0, eff)[1]
        assert math.isclose(shown, max(0.0, ring - attention), rel_tol=1e-12, abs_tol=1e-12)
        exposed.append(shown)
    assert exposed[0] == 0 < exposed[1], exposed
    argv = ["--model", "llama3-8b", "--seq-len", "32768", "--nodes", "1", "--batch-size", "8"]
    out = cli([*argv, "--search", "--top", "5"], monkeypatch, capsys)
    lines = [x for x in out.splitlines() if " tok/s  MFU " in x]
    assert len(lines) == 5 and all(f"+- {band:.1f}  step" in x for x in lines), out
    # 6 blocks on 4 stages: no equal cut; Llama 3's: 8 chunks of 0/1x6/0
    T = plan.Model(6, 16, 2, 32, 8)
    cuts = {lay.split for lay in plan.layouts(T, plan.CLUSTERS["h100-80g"], 16) if lay.pp == 4}
    assert cuts == {(), (0, 1, 1, 1, 1, 1, 1, 0)}, cuts


def wire_s(C, lay, comm):
    """Seconds of the cp and the data-parallel part's bytes on the wire at the link's bandwidth, the
    data-parallel part as plan groups it: the dp axis and every once-a-step reduction."""
    bw = {"nvlink": C.intra_gbs * 1e9, "ib": C.inter_gbs * 1e9}
    return {
        a: sum(
            plan.on_the_wire(k, *x) / bw[plan.link(C, lay, k.split("/")[1])]
            for k, x in comm.items()
            if f"/{a}/" in k or a == "dp" and k.endswith("/step")
        )
        for a in ("cp", "dp")
    }


def test_one_nic_shared_by_the_axes_across_nodes(monkeypatch):
    """Llama 3 405B at 128K on 16,384 H100s, dp 16 cp 128 tp 8 sp ZeRO-3: the ring's K/V blocks (cp spans 16
    nodes) and FSDP's traffic each hide behind the compute on their own, but they share each GPU's NIC, so
    their sum on InfiniBand past the step's compute shows (with the data-parallel part). Closed form here
    from the bytes plan hands, on the wire, at --inter-gbs; dropping the shared NIC leaves 0 exposed."""
    M = plan.PRESETS["llama3-405b"]._replace(seq=131072)
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=2048)
    lay = plan.Layout(dp=16, cp=128, tp=8, sp=True, zero=3, m=1)
    # bytes only: the rings' latency has its own test
    monkeypatch.setattr(plan, "ALPHA", 0.0)
    got = plan.predict(M, C, lay, 128, 0.5802, dp_overlap="full")
    # the data-parallel part: here with the TP group's replicated gradients, 3e-5 s on NVLink
    wire = wire_s(C, lay, got["comm"])
    assert max(wire.values()) < got["compute_s"] < sum(wire.values()), (wire, got["compute_s"])
    assert math.isclose(got["dp_s"], sum(wire.values()) - got["compute_s"], rel_tol=1e-9)
    assert got["exposed"]["dp"][1] == got["dp_s"] and got["exposed"]["cp"][1] == 0


def ring_latency_mismatches():
    """Llama 3 405B at 128K on 16,384 H100s, dp 128 cp 16 tp 8 sp ZeRO-3 m 1 (the first pick before NCCL's
    latency was counted): seconds each axis spends on its links, against bytes / bandwidth + NCCL's ring
    latency across nodes written here (src/graph/tuning.cc, Ring, Simple, network: 14 us a step from a node
    to the next): ZeRO-3's gather, re-gather and reduce-scatter once a unit (126 blocks and the root), each
    2,047 steps round 2,048 nodes, one GPU in each; each of the ring's K/V sends one step across nodes."""
    M = plan.PRESETS["llama3-405b"]._replace(seq=131072)
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=2048)
    lay = plan.Layout(dp=128, cp=16, tp=8, sp=True, zero=3, m=1)
    got = plan.predict(M, C, lay, 128, 0.5802)
    wire = wire_s(C, lay, got["comm"])
    sends = sum(x[0] for k, x in got["comm"].items() if k.startswith("send/cp/"))
    want = dict(cp=wire["cp"] + sends * 14e-6, dp=wire["dp"] + 3 * 127 * 2047 * 14e-6)
    bad = [a for a in want if not math.isclose(got["exposed"][a][0], want[a], rel_tol=1e-9)]
    return bad, got


def test_nccl_ring_latency_across_nodes(monkeypatch):
    """What a ring across 2,048 nodes waits past its bytes (ring_latency_mismatches): ZeRO-3's 381 collectives
    wait 10.9 s, more than its bytes take (6.1 s), and with the ring's sends past the step's compute: the
    layout that --search put first at 52.8% now shows data-parallel time. Without the latency (a mutant)
    the seconds differ and nothing shows."""
    bad, got = ring_latency_mismatches()
    assert not bad and got["dp_s"] > 1.0, (bad, got["dp_s"])
    monkeypatch.setattr(plan, "ALPHA", 0.0)
    bad, got = ring_latency_mismatches()
    assert bad == ["cp", "dp"] and got["dp_s"] == 0, (bad, got["dp_s"])


def test_search_tries_every_v():
    """Interleaved: every v > 1 cutting L into equal chunks (Megatron's condition), not only 2, 4, 8."""
    M, C = plan.PRESETS["gpt3-6.7b"], plan.CLUSTERS["h100-80g"]
    got = {(lay.pp, lay.v) for lay in plan.layouts(M, C, 512) if lay.schedule == "interleaved"}
    assert got == {(p, v) for p in (2, 4, 8) for v in range(2, 33) if 32 % (p * v) == 0}
    assert (2, 16) in got


def walked_here(p, m, sched, F, B, W):
    """plan's ZB-H1 or ZB-V order (zero_bubble_ops) replayed by this file's replay (replayed, which the files'
    recorded orders go through): idle time per step of a rank."""
    v = 1 + (sched == "zb-v")
    events = []
    for r in range(p):
        seen = Counter()
        for i, (kind, c) in enumerate(plan.zero_bubble_ops(p, m, r, sched)):
            chunk = r if c == 0 else 2 * p - 1 - r
            events.append(dict(rank=r, kind=kind, mb=seen[kind, c], start=i, chunk=chunk))
            seen[kind, c] += 1
    times = dict(F=F, B=B, W=W)
    idle = replayed(events, p * v, times, lambda e: e["chunk"], idle_over_busy=True)
    return idle * v * m * (F + B + W)


def walked_mismatches():
    """(p, m, schedule, F, B, W) where plan.walked differs from this file's replay or from a closed form."""
    bad = []
    for p, m in ((2, 4), (3, 7), (4, 8), (6, 12)):
        for F, B, W in ((1.0, 1.0, 1.0), (1.0, 1.7, 0.3), (2.0, 1.0, 0.5), (1.0, 1.0, 2.0)):
            for sched in ("zb-h1", "zb-v"):
                want = [walked_here(p, m, sched, F, B, W)]
                if sched == "zb-h1" and W <= min(F, B):
                    want.append((p - 1) * (F + B - W))
                if sched == "zb-v" and F == B == W:
                    want.append((p - 1) * F)
                got = plan.walked(p, m, sched, F, B, W)
                bad += [
                    (p, m, sched, F, B, W) for x in want if not math.isclose(got, x, abs_tol=1e-9)
                ]
    return bad


def test_zero_bubble_schedules_cost_their_orders_walked(monkeypatch):
    """Issue 49 item 4: ZB-H1's and ZB-V's bubbles are their orders walked at a chunk's F, B, W times
    (plan.walked), equal to this file's replay of the same orders at unequal times; closed forms: ZB-V at
    T_F = T_B = T_W idles the p - 1 F's its last rank waits for, ZB-H1 (p-1)(T_F + T_B - T_W) wherever W is
    the shortest (Qi et al. Sec. 3.1). At 128K tokens attention's backward is all B, so W is short: the
    ZB-V layout's bubble in predict is more than at equal times. The paper's 0 (a mutant) fails."""
    assert not walked_mismatches()
    M, C = (
        plan.PRESETS["llama3-8b"]._replace(seq=131072),
        plan.CLUSTERS["h100-80g"]._replace(nodes=4),
    )
    lay = plan.Layout(dp=4, cp=2, tp=2, pp=2, v=2, schedule="zb-v", m=8, sp=True, zero=1)
    got = plan.predict(M, C, lay, 32)
    per_mb = (got["compute_s"] + got["tp_ep_s"]) / lay.m
    assert got["bubble_s"] > per_mb * plan.bubble_slots(lay) > 0, (got["bubble_s"], per_mb)
    monkeypatch.setattr(plan, "walked", lambda *a: 0)
    assert walked_mismatches()


# ----------------------------------------------------------------------------- DiLoCo across a slow link
def test_diloco_bytes_and_exposed_time_closed_form():
    """GPT-3 6.7B at tp 8 on 8 nodes whose link is 1 GB/s: DiLoCo all-reduces the fp32 pseudo-gradient of a
    rank's Psi every H steps, DDP its bf16 gradient every step; Psi written here (12h^2 + 4h split over t,
    6h replicated per layer; the vocab-parallel embedding and head V'h/t, positions sh, final norm 2h); ring
    2(d-1)/d; Streaming DiLoCo's 4 fragments each overlapped with 2 inner steps. A ring without its factor
    fails."""
    M, h, L, t, d = plan.PRESETS["gpt3-6.7b"], 4096, 32, 8, 8
    C = plan.CLUSTERS["h100-80g"]._replace(nodes=8, inter_gbs=1)
    got = plan.predict(M, C, plan.Layout(dp=d, tp=t), 512)
    Vp = -(-M.vocab // t) * t
    psi = L * ((12 * h * h + 4 * h) // t + 6 * h) + 2 * Vp * h // t + M.seq * h + 2 * h
    ring = 2 * (d - 1) / d

    def closed(H, outer, F, tau):
        per_sync = ring * outer * psi / F / 1e9
        return dict(
            bytes=outer * psi / H,
            wire=ring * outer * psi / H,
            ddp_bytes=2 * psi,
            exposed_s=F * max(0.0, per_sync - tau * got["step_s"]) / H,
        )

    def agree():
        return all(
            math.isclose(
                plan.diloco(M, C, got, H, outer, F, tau)[k], x, rel_tol=1e-12, abs_tol=1e-15
            )
            for H, outer, F, tau in [(1, 4, 1, 0), (100, 4, 1, 0), (100, 2, 4, 2), (500, 4, 4, 0)]
            for k, x in closed(H, outer, F, tau).items()
        )

    x = plan.diloco(M, C, got, 100)
    TABLE.append(
        (
            "DiLoCo",
            "6.7B, tp 8, d 8 across 1 GB/s, H 100: GB per inner step, exposed s; DDP's",
            f"{x['bytes'] / 1e9:.3f}, {x['exposed_s']:.3f}",
            f"{x['ddp_bytes'] / 1e9:.3f}, {x['ddp_exposed_s']:.3f}",
        )
    )
    assert agree() and x["exposed_s"] < x["ddp_exposed_s"]
    real = plan.WIRE["all_reduce"]
    plan.WIRE["all_reduce"] = lambda n: 1
    try:
        assert not agree()
    finally:
        plan.WIRE["all_reduce"] = real


def test_search_lists_fitting_layouts_fastest_first():
    """Every layout --search ranks fits in memory and is legal; tokens/s never increase down the list; the
    enumeration covers every grid (dp, tp, pp) of 8 GPUs with tp dividing a node and pp dividing L."""
    M, C = plan.PRESETS["gpt3-6.7b"], plan.CLUSTERS["h100-80g"]
    ranked, n_legal, n_fit = plan.search(M, C, 512)
    speeds = [x["tokens_per_s"] for x in ranked]
    assert speeds == sorted(speeds, reverse=True) and 0 < len(ranked) <= n_fit <= n_legal
    for x in ranked:
        assert x["fits"] and plan.legal(M, C, x["layout"], 512) is None
        assert max(sum(m.values()) for m in x["memory"].values()) <= 0.9 * 80e9
    grids = {(x.dp, x.tp, x.pp) for x in plan.layouts(M, C, 512)}
    assert grids == {(8 // (t * p), t, p) for t in (1, 2, 4, 8) for p in (1, 2, 4, 8) if t * p <= 8}


def test_zz_print_table():
    """The predicted-vs-measured table and the paper rows, for the README (pytest -s prints them)."""
    for row in TABLE:
        print(
            f"\n{row[1]}\n{row[2]}\n{row[3]}"
            if row[0] in ("example", "1T search")
            else f"| {row[0]} | {row[1]} | {row[2]} | {row[3]} |"
        )


def fold(spec, outdir):
    """A worker of `torchrun --nproc_per_node=4 tests/test_plan.py --fold RUNS.json OUTDIR`: each run's file's
    own main() in turn on one process group (its init_dist hands it the group; its close_dist ends the run,
    not the process), as tests/context_parallel_checks.py --runs does for context_parallel.py."""
    import importlib

    import torch.distributed as dist

    import common
    import harness

    class Finished(Exception):
        pass

    def no_exit(ok=True):
        raise Finished(ok)

    real_close, d = common.close_dist, common.init_dist()
    for i, run in enumerate(json.loads(Path(spec).read_text())):
        mod = importlib.import_module(run["file"][:-3])
        harness.close_dist = mod.close_dist = no_exit
        mod.init_dist = lambda timeout_s=120: d
        sys.argv = [run["file"], *run["argv"], "--json", str(Path(outdir) / f"{i}.json")]
        try:
            mod.main()
        except Finished as done:
            assert done.args[0] is not False, run
        dist.barrier()
    real_close()


if __name__ == "__main__" and "--fold" in sys.argv:
    fold(*sys.argv[sys.argv.index("--fold") + 1 :][:2])
