"""The check for a machine with GPUs (the pytest suite always runs on CPU): each file's modes with --check,
one line per run, sized to the GPUs and the minutes at hand; exit 1 if any run fails, 2 on a bad flag.

    bash tests/gpu_check.sh --one-gpu           # one GPU: the CUDA-only paths, world 1 (50 launches,
                                                # 8-10 min)
    bash tests/gpu_check.sh                     # N = every visible GPU: world N's plan, then the one-GPU plan
    bash tests/gpu_check.sh --minutes 14        # N GPUs in a 15-minute lease: the runs covering most first
    bash tests/gpu_check.sh --world 4 --only zero.py,moe.py --minutes 10   # a slice, within a budget
    bash tests/gpu_check.sh --cpu --one-gpu     # the same plan on gloo + CPU (to try the script itself)
    python tests/gpu_check.py --dry-run --for-gpus 8 --minutes 15   # print the plan, its launches and
                                                    # estimated time, and what the budget would skip

--only FILE[,FILE]  only the runs of these files (bench.py included)
--world N           only world N's plan (N = 1: the one-GPU plan); default: N = the GPUs, then world 1
--minutes M         launch nothing whose estimate does not fit in what is left of M minutes (each skipped run
                    is printed, with why); a run still going when the budget is spent is stopped (FAILED).
                    The plan runs in the order a budget should cut from the end of: first the runs the
                    fourth NCCL review found never run on several GPUs (ptdp's CP ring inside pipeline
                    stages and its ZeRO-1, diloco's exchange between ranks on both wires, fp8's delayed
                    and fine-grained recipes at world N and a delayed restart, zero.py's checkpoint
                    resumed at half the world), then greedily the run adding the most paths not yet
                    covered (a file at a world, a kind of run, a mode's value, a layout flag)
--for-gpus N        with --dry-run or --cpu: plan for N GPUs (default: the visible GPUs; --cpu: 2)

The one-GPU plan (world 1; what differs on CUDA from the CPU suite, every group being of one rank):
  bf16 and fp16 mixed precision (zero.py), a bfloat16 GPT (SDPA's flash kernels), the offload's pinned
  non-blocking copies, ddp_bucketed's overlap timed by CUDA events, recompute's RNG replay with dropout
  (memory_savers.py full and selective against the same run without recompute: equal losses), activation
  compression and Adafactor on CUDA, context parallel at cp 1, the five MoE routers and dropless with a shared
  expert, a kill-and-restart with dropout and Adafactor, and bench.py's pairs that exist at world 1 (ddp,
  dp_sync, zero1-3, tp; a pipeline needs two stages). Each --check run prints CUDA's peak memory beside the
  bytes the file counted.
World N's plan (N >= 2; flags derived from N, so any count works: heads 2 max(2, N), width 16 x heads, 2N
blocks, 2N micro-batches, 16N sequences of 32 tokens, or 16N tokens when 2N does not divide 32):
  every mode of every file with --check in float32 (dp sync / accumulation / async lockstep, ddp with and
  without compression, gpipe with and without recompute, pipedream flush / stash / 2bw, ZB-H1 / ZB-V, megatron
  tp and sequence parallel and tp x dp (at even N >= 4: the overlapped ring), ptdp 1F1B /
  interleaved / tp x pp, the routers, zero stages 0-3 (at even N >= 4: HSDP, stage 3 x 2 copies),
  offload + bf16, fp16 loss scaling, memory_savers' four savers, context parallel's attentions and layouts);
  each file's default mode in bfloat16 under TORCH_DISTRIBUTED_DEBUG=DETAIL; the modes review 2 found never
  run on a GPU: free-running dp.py --mode async, ptdp.py with dp > 1, ZB-V with dp > 1 (zero_bubble.py has no
  tp), moe.py with ep < world, recompute with dropout under data parallel (zero.py no longer recomputes:
  memory_savers.py does, on any layout), context parallel with dp > 1, megatron tp with dropout (restarted:
  the CUDA RNG tracker's state must resume); kill-and-restarts; at N >= 3 the async server's stragglers;
  bench.py's every pair at world N.
Restarts and recompute's RNG replay compare losses bit for bit, with cuBLAS's workspace fixed
(CUBLAS_WORKSPACE_CONFIG=:4096:8) and torch.use_deterministic_algorithms(True, warn_only=True). If a pair
differs, a second uninterrupted run measures CUDA's run-to-run spread: a pair that differs while the two
uninterrupted runs agree bit for bit fails; otherwise it must lie within 10 x the measured spread.
The one-GPU plan also runs diloco.py's bf16 and float8 wire with an exchange in flight, megatron_tp's and
zero.py's restarts with dropout (the CUDA generator in their checkpoints), the 2024 MoE (moe_deepseek.py),
fault_tolerance.py through its own launcher (R = 1, and the restart recipe), fp8.py's three recipes (the
loss falls, finite: its --check reference is FP32 arithmetic, not the tensor cores' FP8 GEMM) and a delayed
restart (the amax history resumed on the device). Its time: 8-10 min on a freshly started GPU, assuming 10 s
per warm launch and 20-30 s of cold imports and CUDA context on the first ones.
World N's plan also runs ptdp's context parallel and ZeRO-1, Streaming DiLoCo (bfloat16 and float8 wires),
fp8.py's delayed and fine-grained recipes (d_model 128 N: whole 128-row blocks per shard) and zero.py's
stage-2 checkpoint saved at world N and resumed at world N / 2 (--check over every step). The whole plan at
N GPUs takes about 41 min (bench.py's pairs take three launches each: both sides in one, then each
side apart for its peak); --minutes 14 keeps the runs that cover the most.
Estimated time: launches x 10 s at world 1, 15 s at world >= 2 (see docs/gpus.md); --minutes rescales the
estimates of what is left by the measured time of what ran."""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step\s+(\d+) \| loss ([\d.naninf]+) \|\s+([\d.]+) ms", re.M)
FILES = (
    "dp.py",
    "ddp_bucketed.py",
    "diloco.py",
    "fault_tolerance.py",
    "gpipe.py",
    "pipedream.py",
    "zero_bubble.py",
    "megatron_tp.py",
    "ptdp.py",
    "moe.py",
    "moe_deepseek.py",
    "zero.py",
    "memory_savers.py",
    "fp8.py",
    "context_parallel.py",
    "bench.py",
)
# Seconds per launch on a GPU machine (an estimate: interpreter + torch import, CUDA context, NCCL
# communicators, the tiny model and its --check reference, teardown); --cpu: measured on 2 shared cores
# under load, the workers forked from a warm interpreter, except bench.py's (its own torchrun launches).
PER_LAUNCH = {"gpu": {1: 10, 2: 15}, "cpu": {1: 12, 2: 20, "bench": 40}}
DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def model_flags(w):
    heads = 2 * max(2, w)
    seq = 32 if 32 % (2 * w) == 0 else 16 * w  # context parallel's zig-zag needs 2w | T
    return [
        "--steps",
        4,
        "--vocab",
        64,
        "--n-heads",
        heads,
        "--d-model",
        16 * heads,
        "--n-layers",
        2 * w,
        "--batch-size",
        16 * w,
        "--seq-len",
        seq,
    ]


def routed(f):
    """Review 2 (R4): a router near a tie (top-k, capacity, gshard's 2 g2 > u) can flip when cuBLAS picks
    another kernel for a rank's M tokens than the reference's, a discrete change of the loss: a false
    FAILED. The routers' --check runs in float64, where such a flip needs a tie within ~1e-16, not 1e-7;
    the bfloat16 DETAIL pass still runs their 16-bit path (its 5e-2 tolerance absorbs roundoff, not a
    flip)."""
    return ["--dtype", "float64"] if f in ("moe.py", "moe_deepseek.py") else []


def plan(w):
    """[(name, file, flags)] for world w: every run checks itself (--check), in float32."""
    m = ["--microbatches", 2 * w]
    runs = [
        ("dp sync", "dp.py", []),
        ("dp accum 2 ragged", "dp.py", ["--accum", 2, "--ragged"]),
        ("ddp", "ddp_bucketed.py", []),
        ("ddp compress bf16", "ddp_bucketed.py", ["--compress", "bf16"]),
        ("megatron tp", "megatron_tp.py", ["--tp", w]),
        ("megatron tp sequence parallel", "megatron_tp.py", ["--tp", w, "--sequence-parallel"]),
        *[
            (f"moe {r}", "moe.py", ["--router", r, "--ep", w, "--experts", 2 * w])
            for r in ("switch", "gshard", "noisy_topk", "expert_choice")
        ],
        (
            "moe loss_free",
            "moe_deepseek.py",
            ["--ep", w, "--experts", 2 * w, "--shared-experts", 0],
        ),
        ("moe loss_free dropless shared", "moe_deepseek.py", ["--ep", w, "--experts", 2 * w]),
        *[(f"zero stage {s}", "zero.py", ["--stage", s, "--accum", 2]) for s in range(4)],
        (
            "zero 2 offload bf16",
            "zero.py",
            ["--stage", 2, "--offload", "--mixed-precision", "bf16"],
        ),
        ("zero 3 fp16 loss scaling", "zero.py", ["--stage", 3, "--mixed-precision", "fp16"]),
        ("savers recompute full", "memory_savers.py", ["--recompute", "full", "--accum", 2]),
        ("savers recompute selective", "memory_savers.py", ["--recompute", "selective"]),
        ("savers compress int8", "memory_savers.py", ["--compress-activations", "int8"]),
        ("savers adafactor", "memory_savers.py", ["--optimizer", "adafactor"]),
        *[
            (f"cp {a} {lay}", "context_parallel.py", ["--cp", w, "--attention", a, "--layout", lay])
            for a, lay in (
                ("ring", "zigzag"),
                ("ring", "contiguous"),
                ("allgather", "zigzag"),
                ("ulysses", "contiguous"),
            )
        ],
    ]
    if w % 2 == 0 and w >= 4:
        runs += [
            ("megatron tp x dp 2", "megatron_tp.py", ["--tp", w // 2]),
            # HSDP (two copies, each ZeRO-3 over w / 2 ranks) and the TP ring under the GEMMs on NCCL
            ("zero 3 hsdp", "zero.py", ["--stage", 3, "--replicate", 2]),
            ("megatron tp overlap", "megatron_tp.py", ["--tp", w, "--overlap"]),
            (
                "ptdp pp 2 x tp v 2",
                "ptdp.py",
                ["--pp", 2, "--tp", w // 2, "--virtual-stages", 2, *m],
            ),
        ]
    if w >= 2:  # a pipeline needs one GPU per stage; a parameter server a worker beside it
        D = min(1, w - 2)  # staleness D needs D + 1 workers
        runs += [
            (f"dp async lockstep D={D}", "dp.py", ["--mode", "async", "--staleness", D]),
            ("gpipe", "gpipe.py", m),
            ("gpipe recompute", "gpipe.py", [*m, "--recompute"]),
            *[
                (f"pipedream {mode}", "pipedream.py", ["--mode", mode, *m, *clip])
                for mode, clip in (("flush", []), ("stash", ["--clip", 0]), ("2bw", []))
            ],
            ("zero_bubble zbh1", "zero_bubble.py", m),
            ("zero_bubble zbv", "zero_bubble.py", ["--schedule", "zbv", *m]),
            ("ptdp 1f1b", "ptdp.py", ["--pp", w, *m]),
            ("ptdp interleaved v 2", "ptdp.py", ["--pp", w, "--virtual-stages", 2, *m]),
        ]
    return [(name, f, [*model_flags(w), *flags, *routed(f), "--check"]) for name, f, flags in runs]


def bf16_plan(w):
    """Each file's default mode in bfloat16, under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    firsts = {}
    for _name, f, flags in plan(w):
        firsts.setdefault(f, (f"{f[:-3]} bf16 DETAIL", f, [*flags, "--dtype", "bfloat16"]))
    return list(firsts.values())


def restart_plan(w):
    """Files killed at step 3 and restarted (--max-restarts=1), each against its uninterrupted run."""
    keep = {
        "dp sync",
        "zero stage 3",
        "moe loss_free",
        "megatron tp",
        "pipedream stash" if w >= 2 else "cp ring zigzag",
    }
    return [
        (f"{name} restart", f, [x for x in flags if x != "--check"] + ["--steps", 6])
        for name, f, flags in plan(w)
        if name in keep
    ]


# Streaming DiLoCo with two fragments and an exchange in flight for one step: its own group, the async
# exchange, the wire's rounding (bf16; float8 with the scale beside the payload) on CUDA.
DILOCO = ["--inner-steps", 2, "--fragments", 2, "--overlap", 1]


def extra_plan(w):
    """The modes review 2 (issue 31) found never run on a GPU, at world w >= 2: [(name, file, flags)]."""
    # the largest proper divisor: w / 2 when w is even
    half = max(q for q in range(1, w) if w % q == 0)
    runs = [
        ("dp async free-running", "dp.py", ["--mode", "async"]),
        (
            f"moe ep {half} of {w}",
            "moe.py",
            ["--router", "gshard", "--ep", half, "--experts", 2 * half],
        ),
        (f"cp {half} x dp {w // half}", "context_parallel.py", ["--cp", half, "--dp", w // half]),
    ]
    m = ["--microbatches", 2 * w]
    if w % 4 == 0:  # review 4 (N4-5): the CP ring on its own communicator inside pipeline stages
        runs += [
            (
                f"ptdp pp 2 x cp 2 x tp {w // 4} v 2",
                "ptdp.py",
                ["--pp", 2, "--cp", 2, "--tp", w // 4, "--virtual-stages", 2, *m],
            ),
            (
                f"ptdp pp 2 x dp {w // 4} x cp 2 zero 1",
                "ptdp.py",
                ["--pp", 2, "--dp", w // 4, "--cp", 2, "--zero", 1, *m],
            ),
        ]
    else:
        runs += [
            (f"ptdp cp {w}", "ptdp.py", ["--pp", 1, "--cp", w]),
            (f"ptdp dp {w} zero 1", "ptdp.py", ["--pp", 1, "--dp", w, "--zero", 1]),
        ]
    runs += [  # the exchange's own communicator between ranks, in flight for a step, both wires
        (f"diloco streaming overlap {wire}", "diloco.py", DILOCO + ["--outer-dtype", wire])
        for wire in ("bfloat16", "float8_e4m3fn")
    ]
    if w >= 4 and w % 2 == 0:
        runs += [
            (f"ptdp pp 2 x dp {half}", "ptdp.py", ["--pp", 2, "--dp", half, "--microbatches", 4]),
            (
                f"zero_bubble zbv pp {half} x dp 2",
                "zero_bubble.py",
                ["--schedule", "zbv", "--pp", half, "--dp", 2, "--microbatches", 2 * half],
            ),
        ]
    return [(name, f, [*model_flags(w), *flags, *routed(f), "--check"]) for name, f, flags in runs]


def ft_plan(w):
    """fault_tolerance.py starts its own replicas (`python fault_tolerance.py --replicas R`, one GPU each):
    [(name, flags)] with --check. One GPU: R = 1 (the quorum, the per-step group on NCCL) and the restart
    recipe (a replica killed, every replica reloaded from disk with map_location); N GPUs: R = N, a replica
    killed during a step and recovered live from a peer."""
    runs = [
        (f"fault_tolerance R {w}", ["--replicas", w]),
        (
            f"fault_tolerance R {w} restart recipe",
            [
                "--replicas",
                w,
                "--kill-replica",
                0,
                "--at-step",
                3,
                "--recipe",
                "restart",
                "--save-every",
                2,
            ],
        ),
    ]
    if w >= 2:
        runs.append(
            (
                f"fault_tolerance R {w} kill, live recovery",
                ["--replicas", w, "--kill-replica", w - 1, "--at-step", 3, "--min-replicas", w - 1],
            )
        )
    return [(name, [*model_flags(w), "--steps", 6, *flags, "--check"]) for name, flags in runs]


def fp8_plan(w):
    """fp8.py on CUDA: [(name, flags)] of runs whose loss must fall, finite (no --check: the reference
    multiplies the dequantized operands in FP32, while the tensor cores' FP8 GEMM accumulates in its own
    order, and an FP8 rounding boundary crossed turns that roundoff chaotic; docs/fp8.md). Fine-grained
    runs at d_model 128 (128 w at world w): whole 128-tiles in every shard, with no padding; fp8.py pads
    any other size (checked on CPU by the suite)."""
    steps = ["--steps", 20]
    if w > 1:  # fine-grained: each rank's shard of a weight whole 128-row blocks at d_model 128 w
        fine = ["--d-model", 128 * w, "--n-layers", 2]
        return [
            (
                "fp8 current fp8-all-gather loss falls",
                [*model_flags(w), *steps, "--recipe", "current", "--fp8-all-gather"],
            ),
            ("fp8 delayed loss falls", [*model_flags(w), *steps, "--recipe", "delayed"]),
            (
                "fp8 fine-grained loss falls",
                [*model_flags(w), *steps, "--recipe", "fine-grained", *fine],
            ),
        ]
    return [
        (f"fp8 {r} loss falls", [*model_flags(1), *steps, "--recipe", r, *extra])
        for r, extra in (
            ("current", []),
            ("delayed", ["--amax-history", 4]),
            ("fine-grained", ["--d-model", 128]),
        )
    ]


def one_gpu_plan():
    """World 1: the CUDA-only paths, [(name, file, flags)] with --check (jobs() adds the pairs compared bit
    for bit and bench.py)."""
    fp16 = ["--stage", 3, "--mixed-precision", "fp16", "--accum", 2]
    runs = [
        (
            "zero 2 offload bf16",
            "zero.py",
            ["--stage", 2, "--offload", "--mixed-precision", "bf16"],
        ),
        ("zero 3 fp16 loss scaling", "zero.py", fp16),
        ("ddp overlap (CUDA events)", "ddp_bucketed.py", []),
        ("ddp bfloat16", "ddp_bucketed.py", ["--dtype", "bfloat16"]),
        ("savers compress int8", "memory_savers.py", ["--compress-activations", "int8"]),
        ("savers adafactor", "memory_savers.py", ["--optimizer", "adafactor"]),
        ("cp 1 ring zigzag", "context_parallel.py", ["--cp", 1]),
        *[
            (f"diloco streaming overlap {wire}", "diloco.py", DILOCO + ["--outer-dtype", wire])
            for wire in ("bfloat16", "float8_e4m3fn")
        ],
        *[
            (f"moe {r}", "moe.py", ["--router", r, "--ep", 1, "--experts", 4])
            for r in ("switch", "gshard", "noisy_topk", "expert_choice")
        ],
        ("moe loss_free", "moe_deepseek.py", ["--ep", 1, "--experts", 4, "--shared-experts", 0]),
        ("moe loss_free dropless shared", "moe_deepseek.py", ["--ep", 1, "--experts", 4]),
    ]
    return [(name, f, [*model_flags(1), *flags, *routed(f), "--check"]) for name, f, flags in runs]


def jobs(w, cpu, gpus):
    """Every job of world w's plan: dicts with name, kind, file, world, launches, and what the kind needs."""
    out = []
    add = lambda kind, name, f, launches, **kw: out.append(  # noqa: E731
        dict(kind=kind, name=f"{name} (world {w})", file=f, world=w, launches=launches, **kw)
    )
    if w == 1:
        for name, f, flags in one_gpu_plan():
            add("check", name, f, 1, flags=flags)
        drop = [*model_flags(1), "--dropout", 0.1, "--steps", 6]
        add(
            "same",
            "savers recompute full / selective, dropout 0.1, vs none",
            "memory_savers.py",
            3,
            a=drop,
            b=[[*drop, "--recompute", "full"], [*drop, "--recompute", "selective"]],
            restart=False,
        )
        kill = [*drop, "--optimizer", "adafactor", "--recompute", "full"]
        add(
            "same",
            "savers dropout adafactor restart",
            "memory_savers.py",
            2,
            a=kill,
            b=[kill],
            restart=True,
        )
        # the CUDA generator's state in a checkpoint: megatron's RNG tracker, zero.py's sharded checkpoint
        add(
            "same",
            "megatron tp 1 dropout 0.1 restart",
            "megatron_tp.py",
            2,
            a=[*drop, "--tp", 1],
            b=[[*drop, "--tp", 1]],
            restart=True,
        )
        add(
            "same",
            "zero 3 dropout 0.1 restart",
            "zero.py",
            2,
            a=[*drop, "--stage", 3],
            b=[[*drop, "--stage", 3]],
            restart=True,
        )
        for name, flags in ft_plan(1):
            add("ft", name, "fault_tolerance.py", 1 + ("restart" in name), argv=flags)
        for name, flags in fp8_plan(1):
            add("falls", name, "fp8.py", 1, flags=flags)
        # delayed scaling's amax history in the checkpoint, resumed on the device (review 4, N4-1)
        fp8 = [*model_flags(1), "--recipe", "delayed", "--amax-history", 4, "--steps", 6]
        add("same", "fp8 delayed restart", "fp8.py", 2, a=fp8, b=[fp8], restart=True, first=True)
        add("bench", "bench world 1", "bench.py", 18, pairs="ddp,dp_sync,zero1,zero2,zero3,tp")
        return out
    for name, f, flags in plan(w) + extra_plan(w):
        first = f == "diloco.py" or f == "ptdp.py" and ("--cp" in flags or "--zero" in flags)
        add("check", name, f, 1, flags=flags, first=first)
    for name, f, flags in bf16_plan(w):
        add("check", name, f, 1, flags=flags, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    drop = [*model_flags(w), "--dropout", 0.1, "--steps", 6]
    add(
        "same",
        "savers recompute full, dropout 0.1, vs none",
        "memory_savers.py",
        2,
        a=drop,
        b=[[*drop, "--recompute", "full"]],
        restart=False,
    )
    add(
        "same",
        "megatron tp dropout 0.1 restart",
        "megatron_tp.py",
        2,
        a=[*drop, "--tp", w],
        b=[[*drop, "--tp", w]],
        restart=True,
    )
    for name, f, flags in restart_plan(w):
        add("same", name, f, 2, a=flags, b=[flags], restart=True)
    for name, flags in ft_plan(w):
        add("ft", name, "fault_tolerance.py", 1 + ("restart" in name), argv=flags)
    for name, flags in fp8_plan(w):
        add("falls", name, "fp8.py", 1, flags=flags, first="current" not in flags)
    # zero.py's sharded checkpoint (torch.distributed.checkpoint) saved at world w, resumed at w // 2
    zero = [*model_flags(w), "--stage", 2, "--check"]
    add(
        "reshard",
        f"zero 2 saved at world {w}, resumed at {w // 2}",
        "zero.py",
        2,
        a=zero,  # run_reshard adds --ckpt-dir and --save-every 2
        b=[[*zero, "--steps", 6]],
        to=w // 2,
        first=True,
    )
    if w >= 3:
        add("stragglers", "dp async stragglers overlap", "dp.py", 2)
    add("bench", f"bench world {w}", "bench.py", 45, pairs="all")
    return out


def estimate(job, where):
    per = PER_LAUNCH[where][min(job["world"], 2)]
    per = PER_LAUNCH[where].get("bench", per) if job["kind"] == "bench" else per
    return job["launches"] * per + (4 if job["kind"] == "stragglers" else 0)


# ----------------------------------------------------------------------------- launching
def launch(w, f, flags, cpu, env=None, restarts=0, timeout=300):
    """torchrun --standalone (on --cpu: forked from tests/forkserver.py's warm interpreter, which starts the
    workers with torchrun's environment; the import of torch is most of a tiny launch on a few cores)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        **(env or {}),
        **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}),
    )
    flags = list(map(str, flags))
    if cpu:
        sys.path.insert(0, str(ROOT / "tests"))
        import helpers

        # the environment of this request (the server keeps the one it started with)
        helpers.ENV = env
        try:
            return helpers.forked(f, w, *flags, timeout=timeout, max_restarts=restarts)
        except subprocess.TimeoutExpired as e:
            return -1, f"{e.output or ''}\nstopped after {timeout:.0f} s"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={w}",
        f"--max-restarts={restarts}",
        str(ROOT / f),
        *flags,
    ]
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return -1, f"{e.stdout or ''}{e.stderr or ''}\nstopped after {timeout:.0f} s"


FAILED, STARTED = [], [time.time()]  # the runs that failed; when the current run started


def line(name, ok, detail, out=""):
    print(
        f"{name:52s} {'ok' if ok else 'FAILED'}  [{time.time() - STARTED[0]:.0f} s] {detail}",
        flush=True,
    )
    if not ok:
        FAILED.append(name)
        print("\n".join("    | " + l for l in out.strip().splitlines()[-15:]), flush=True)


def check_line(out):
    found = re.findall(r"max rel loss diff.*", out)
    return found[-1] if found else ""


def memory(path):
    """CUDA's peak beside the bytes the file counted (harness.write_summary writes both)."""
    s = json.loads(path.read_text()) if path.exists() else {}
    peak, counted = s.get("peak_mem_bytes"), s.get("counted_mem_bytes")
    if peak is None or counted is None or peak == counted:
        return ""
    return f" | peak {peak / 2**20:.1f} MiB (CUDA) vs {counted / 2**20:.1f} MiB counted"


def run_check(job, cpu, tmp, timeout):
    out_json = tmp / "run.json"
    out_json.unlink(missing_ok=True)
    rc, out = launch(
        job["world"],
        job["file"],
        [*job["flags"], "--json", out_json],
        cpu,
        job.get("env"),
        timeout=timeout,
    )
    line(job["name"], rc == 0 and "PASSED" in out, check_line(out) + memory(out_json), out)


def losses(job, flags, cpu, tmp, tag, timeout, restart=False):
    """One run under the deterministic settings; its per-step losses (None if it failed)."""
    # each job its own checkpoints: never another job's resumed
    tmp = tmp / re.sub(r"\W+", "_", job["name"])
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / f"{tag}.json"
    extra = (
        ["--ckpt-dir", tmp / f"ck-{tag}", "--save-every", 2, "--fail-at-step", 3] if restart else []
    )
    rc, out = launch(
        job["world"],
        "tests/gpu_check.py",
        ["--deterministic-run", job["file"], *flags, *extra, "--json", path],
        cpu,
        DETERMINISTIC,
        restarts=1 if restart else 0,
        timeout=timeout,
    )
    return (json.loads(path.read_text())["losses"] if rc == 0 and path.exists() else None), out


def rel(a, b):
    return max(abs(x - y) / abs(x) for x, y in zip(a, b))


def run_same(job, cpu, tmp, deadline):
    """B (a restarted run, or the same model recomputed) must equal A as A's own rerun does: bit for bit when
    two uninterrupted runs agree bit for bit, else within 10 x their measured spread."""
    left = lambda: max(1, deadline - time.time())  # noqa: E731
    a, out = losses(job, job["a"], cpu, tmp, "a", left())
    if a is None:
        return line(job["name"], False, "the uninterrupted run failed", out)
    diffs, outs = [], out
    for i, flags in enumerate(job["b"]):
        b, out = losses(job, flags, cpu, tmp, f"b{i}", left(), restart=job["restart"])
        outs += out
        if b is None or len(b) != len(a):
            return line(job["name"], False, "the compared run failed", outs)
        if job["restart"] and not ("simulated failure at step 3" in out and "resumed from" in out):
            return line(job["name"], False, "the run was not killed at step 3 and resumed", outs)
        diffs.append(rel(a, b))
    if max(diffs) == 0:
        return line(job["name"], True, f"losses equal bit for bit ({len(a)} steps)")
    again, out = losses(job, job["a"], cpu, tmp, "a2", left())
    if again is None:
        return line(job["name"], False, "the second uninterrupted run failed", out)
    spread = rel(a, again)
    ok = spread > 0 and max(diffs) <= 10 * spread
    line(
        job["name"],
        ok,
        f"max rel loss diff {max(diffs):.3e} vs uninterrupted; two uninterrupted runs "
        f"differ by {spread:.3e} (tolerance 10 x that)",
        outs + out,
    )


def stragglers(w, cpu, delay=40, steps=24, timeout=300):
    """Worker r computes r x delay ms longer. Free-running, the workers overlap, so the server's update loop
    takes about half as long as in lockstep with staleness 0 (each update waits for the one before it: one
    worker at a time), whatever a step's own compute costs; both are measured here. A server whose waits
    serialise the workers (issue 21's NCCL bug: work.wait() on the shared stream) comes out near 1."""
    loop = {}
    for mode, extra in (("free", []), ("lockstep", ["--staleness", 0])):
        flags = [*model_flags(w), "--mode", "async", "--delay-ms", delay, "--steps", steps, *extra]
        rc, out = launch(w, "dp.py", flags, cpu, timeout=timeout)
        ms = [float(x[2]) for x in STEP.findall(out)]
        loop[mode] = sum(ms) if rc == 0 and len(ms) == steps else float("nan")
    ratio = loop["free"] / loop["lockstep"]
    line(
        f"dp async stragglers overlap (world {w})",
        ratio < 0.75,
        f"update loop free-running "
        f"{loop['free']:.0f} ms vs lockstep D=0 {loop['lockstep']:.0f} ms: {ratio:.2f} (must be < 0.75; "
        "ideal about 0.5)",
        out,
    )


def run_ft(job, cpu, tmp, timeout):
    """`python fault_tolerance.py --replicas R ...`: the file's own launcher starts the replicas (each on
    cuda:(replica % GPUs)); --check replays who took part in which step in one process."""
    ckpt = tmp / re.sub(r"\W+", "_", job["name"])
    argv = [*job["argv"], *(["--ckpt-dir", ckpt] if "restart" in job["argv"] else [])]
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}),
    )
    try:
        p = subprocess.run(
            [sys.executable, str(ROOT / job["file"]), *map(str, argv)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"{e.stdout or ''}{e.stderr or ''}\nstopped after {timeout:.0f} s"
    line(job["name"], rc == 0 and "PASSED" in out, check_line(out), out)


def run_reshard(job, cpu, tmp, timeout):
    """A checkpoint saved at the job's world, resumed at world job["to"]: the resumed run's --check covers
    every step, before and after the resume, against one uninterrupted run."""
    ckpt = ["--ckpt-dir", tmp / re.sub(r"\W+", "_", job["name"])]
    rc, out = launch(
        job["world"], job["file"], [*job["a"], *ckpt, "--save-every", 2], cpu, timeout=timeout
    )
    if rc != 0 or "PASSED" not in out:
        return line(job["name"], False, "the run that saves failed", out)
    rc, out = launch(job["to"], job["file"], [*job["b"][0], *ckpt], cpu, timeout=timeout)
    resumed = f"(saved at world size {job['world']}" in out
    line(job["name"], rc == 0 and "PASSED" in out and resumed, check_line(out), out)


def run_falls(job, cpu, tmp, timeout):
    """A run without a reference on CUDA: every loss finite, and the last three below the first."""
    rc, out = launch(job["world"], job["file"], job["flags"], cpu, timeout=timeout)
    loss = [float(x[1]) for x in STEP.findall(out)]
    ok = rc == 0 and len(loss) > 3 and all(x == x and abs(x) != float("inf") for x in loss)
    ok = ok and max(loss[-3:]) < loss[0]
    line(
        job["name"],
        ok,
        f"loss {loss[0]:.3f} -> {loss[-1]:.3f} over {len(loss)} steps" if loss else "",
        out,
    )


def bench_flags(w):
    """The plan's model; 2w micro-batches (ZB-V needs m >= 2p - 1) of 2 sequences per rank."""
    return [*model_flags(w), "--batch-size", 4 * w * w, "--microbatches", 2 * w, "--warmup", 2]


def bench_command(w, pairs, out_prefix):
    """bench.py's pairs at world w, one launch each (--budget-min 0: no more launches for an interval; two
    blocks of one step per side where a pair runs both sides in one launch)."""
    return [
        sys.executable,
        str(ROOT / "bench.py"),
        "--world",
        str(w),
        "--pairs",
        pairs,
        "--rounds",
        "1",
        "--budget-min",
        "0",
        "--no-scaling",
        "--blocks",
        "2",
        "--block-steps",
        "1",
        "--out",
        str(out_prefix),
        *map(str, bench_flags(w)),
    ]


def run_bench(job, cpu, tmp, timeout):
    """bench.py's pairs at this world: every pair runs on both sides and trains alike."""
    w, out_prefix = job["world"], tmp / f"bench{job['world']}"
    cmd = bench_command(w, job["pairs"], out_prefix)
    env = dict(os.environ, PYTHONUNBUFFERED="1", **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}))
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"{e.stdout or ''}{e.stderr or ''}\nstopped after {timeout:.0f} s"
    path = Path(f"{out_prefix}.json")
    rows = json.loads(path.read_text()) if rc == 0 and path.exists() else []
    rows = [
        r for r in rows if not r.get("skipped")
    ]  # a pair bench.py cannot run here (torchao absent)
    # each side's own launch, and the two sides inside the paired launch (where bench pairs them)
    diffs = {
        r["pair"]: max(r.get("max_loss_diff") or 0, r.get("paired_loss_diff") or 0) for r in rows
    }
    diffs.update({r["pair"]: None for r in rows if r.get("max_loss_diff") is None})
    ok = bool(rows) and all(d is not None and d <= 1e-3 for d in diffs.values())
    line(
        job["name"],
        ok,
        f"{len(rows)} pairs, ours vs torch max rel loss diff "
        f"{max((d for d in diffs.values() if d is not None), default=float('nan')):.1e} (sanity bound 1e-3)",
        out,
    )


# ----------------------------------------------------------------------------- the plan, the budget
def build(args, gpus):
    worlds = (
        [args.world] if args.world else ([1] if args.one_gpu else sorted({gpus, 1}, reverse=True))
    )
    todo = [j for w in worlds for j in jobs(w, args.cpu, gpus)]
    # the straggler check tried on CPU too
    if args.cpu and not args.world and not args.one_gpu and gpus < 3:
        todo.append(
            dict(
                kind="stragglers",
                name="dp async stragglers overlap (world 3)",
                file="dp.py",
                world=3,
                launches=2,
            )
        )
    if args.only:
        todo = [j for j in todo if j["file"] in args.only]
    return by_coverage(todo)


# What a run exercises, for the order under a budget: a mode flag with its value, a layout flag set.
MODE = {
    "--mode",
    "--router",
    "--attention",
    "--layout",
    "--schedule",
    "--recipe",
    "--outer-dtype",
    "--compress",
    "--compress-activations",
    "--optimizer",
    "--mixed-precision",
    "--stage",
    "--recompute",
    "--dtype",
}
LAYOUT = {
    "--tp",
    "--pp",
    "--dp",
    "--cp",
    "--ep",
    "--zero",
    "--virtual-stages",
    "--overlap",
    "--fragments",
    "--sequence-parallel",
    "--offload",
    "--fp8-all-gather",
    "--accum",
    "--ragged",
    "--staleness",
    "--dropout",
    "--shared-experts",
}


def paths(job):
    """The paths a job covers: its file at its world (> 1: NCCL between ranks; 1: one-rank groups), its
    kind there (check, restart, reshard, DETAIL, ...), each mode flag's value and each layout flag."""
    many = job["world"] > 1
    flags = list(map(str, job.get("flags") or job.get("a") or job.get("argv") or []))
    kind = "DETAIL" if job.get("env") else job["kind"]
    out = {(many, job["file"]), (many, job["file"], kind)}
    for i, x in enumerate(flags):
        if x in MODE:
            out.add((many, job["file"], x, flags[i + 1]))
        elif x in LAYOUT:
            out.add((many, job["file"], x))
    return out


def by_coverage(todo):
    """The order a budget cuts from the end of: first the runs the fourth NCCL review found never run on
    several GPUs (N4-5), then, greedily, the run that adds the most paths not yet covered (ties: plan
    order, world N before world 1)."""
    first = [j for j in todo if j.get("first")]
    rest = [j for j in todo if not j.get("first")]
    seen = set().union(*(paths(j) for j in first)) if first else set()
    ordered = list(first)
    while rest:
        best = max(range(len(rest)), key=lambda i: (len(paths(rest[i]) - seen), -i))
        seen |= paths(rest[best])
        ordered.append(rest.pop(best))
    return ordered


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit 2, as every file of the repo
        sys.exit(bad(message))


def parse(argv):
    p = Parser(prog="gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu", action="store_true", help="gloo + CPU, GPUs hidden")
    p.add_argument("--one-gpu", action="store_true", help="the one-GPU plan (world 1)")
    p.add_argument("--world", type=int, default=0, help="only this world's plan")
    p.add_argument(
        "--for-gpus", type=int, default=0, help="with --dry-run or --cpu: plan for this many GPUs"
    )
    p.add_argument("--only", default="", help="FILE[,FILE]: only these files' runs")
    p.add_argument("--minutes", type=float, default=0, help="time budget (0: none)")
    p.add_argument(
        "--dry-run", action="store_true", help="print the plan and its estimate; launch nothing"
    )
    args = p.parse_args(argv)
    args.only = [f for f in args.only.split(",") if f]
    return args


def bad(why):
    print(f"gpu_check: error: {why}", flush=True)
    return 2


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [
        "--deterministic-run"
    ]:  # (internal) a file under torch's deterministic algorithms
        return deterministic_run(argv[1], argv[2:])
    if argv[:1] == ["--list"]:  # the earlier spelling: the plan for N GPUs
        argv = ["--dry-run", "--for-gpus", *argv[1:2]]
    args = parse(argv)
    unknown = sorted(set(args.only) - set(FILES))
    if unknown:
        return bad(f"--only: unknown {', '.join(unknown)}; choose from {', '.join(FILES)}")
    if args.minutes < 0 or args.world < 0 or args.for_gpus < 0:
        return bad("--minutes, --world and --for-gpus must be >= 0")
    if args.one_gpu and args.world not in (0, 1):
        return bad(f"--one-gpu is world 1; --world {args.world} contradicts it")
    where = "cpu" if args.cpu else "gpu"
    if args.dry_run or args.cpu:
        gpus = args.for_gpus or args.world or (1 if args.one_gpu else 2)
    else:
        gpus = 0
        # set and empty: every GPU hidden, no import needed
        if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
            import torch

            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            print("gpu_check: no CUDA GPU visible to torch: nothing to check (skipped)")
            return 0
        print(
            f"gpu_check: {gpus} x {torch.cuda.get_device_name(0)} | torch {torch.__version__}",
            flush=True,
        )
    if args.world > gpus and not args.cpu:
        return bad(
            f"--world {args.world} needs {args.world} GPUs; {gpus} "
            f"{'planned' if args.dry_run else 'visible'}"
        )
    todo = build(args, args.world or gpus)
    if not todo:
        return bad(f"no run of {', '.join(args.only)} in this plan (world {args.world or gpus})")
    total = sum(estimate(j, where) for j in todo)
    print(
        f"gpu_check: {len(todo)} runs, {sum(j['launches'] for j in todo)} launches, estimated "
        f"{total / 60:.1f} min on {'CPU' if args.cpu else 'GPUs'}"
        + (f" (budget {args.minutes:g} min)" if args.minutes else ""),
        flush=True,
    )
    budget = args.minutes * 60 if args.minutes else float("inf")
    t0, ran_est, skipped, tmp = time.time(), 0.0, [], Path(tempfile.mkdtemp(prefix="gpu_check"))
    for j in todo:
        spent = ran_est if args.dry_run else time.time() - t0
        # measured / estimated so far
        scale = spent / ran_est if ran_est and not args.dry_run else 1.0
        est = estimate(j, where) * max(scale, 0.5)
        if spent + est > budget:
            skipped.append(j)
            print(
                f"{j['name']:52s} skipped  estimated {est:.0f} s; {max(0, budget - spent):.0f} s left of "
                f"the {args.minutes:g} min budget",
                flush=True,
            )
            continue
        if args.dry_run:
            flags = " ".join(map(str, j.get("flags", j.get("a", j.get("argv", [])))))
            print(
                f"{j['name']:52s} {j['launches']:2d} launch(es), ~{est:.0f} s  {j['file']} {flags}"
            )
            ran_est += est
            continue
        deadline, STARTED[0] = min(t0 + budget, time.time() + 900), time.time()
        timeout = max(1, deadline - time.time())
        if j["kind"] == "check":
            run_check(j, args.cpu, tmp, min(timeout, 300))
        elif j["kind"] == "same":
            run_same(j, args.cpu, tmp, deadline)
        elif j["kind"] == "ft":
            run_ft(j, args.cpu, tmp, min(timeout, 300))
        elif j["kind"] == "falls":
            run_falls(j, args.cpu, tmp, min(timeout, 300))
        elif j["kind"] == "reshard":
            run_reshard(j, args.cpu, tmp, min(timeout, 300))
        elif j["kind"] == "stragglers":
            stragglers(j["world"], args.cpu, timeout=min(timeout, 300))
        else:
            run_bench(j, args.cpu, tmp, timeout)
        ran_est += estimate(j, where)
    shutil.rmtree(tmp, ignore_errors=True)
    ran = len(todo) - len(skipped)
    verdict = (
        "planned"
        if args.dry_run
        else "all runs passed"
        if not FAILED
        else f"{len(FAILED)} RUNS FAILED"
    )
    launches = sum(j["launches"] for j in todo if j not in skipped)
    print(
        f"gpu_check: {verdict}: {ran} runs ({launches} launches), "
        f"{len(skipped)} skipped for the budget, "
        + (
            f"estimated {ran_est / 60:.1f} min"
            if args.dry_run
            else f"{(time.time() - t0) / 60:.1f} min"
        ),
        flush=True,
    )
    return 1 if FAILED else 0


def deterministic_run(f, argv):
    """Run FILE argv as its own __main__ with deterministic algorithms on (warn_only: an op with no
    deterministic CUDA kernel warns instead of stopping the run; the spread measured beside it covers the
    rest)."""
    import runpy

    import torch

    torch.use_deterministic_algorithms(True, warn_only=True)
    sys.argv, sys.path[0] = [str(ROOT / f), *argv], str(ROOT)
    runpy.run_path(str(ROOT / f), run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
