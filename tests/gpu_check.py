"""The check for a machine with GPUs (the pytest suite always runs on CPU): every file's every mode at world 1
and at world N = the number of GPUs, with --check, one line per run; exit 1 if any run fails.

    bash tests/gpu_check.sh                # N = every visible GPU (NCCL); without a GPU: says so, exits 0
    bash tests/gpu_check.sh --cpu          # the same plan on gloo + CPU at worlds 1 and 2, and the straggler
                                           # check at world 3 (to try the script itself; about 7 minutes)
    python tests/gpu_check.py --list 6     # print the plan for 6 GPUs, run nothing

What it runs at world w (the flags are derived from w, so any GPU count works: heads 2*max(2, w), width 16 x
heads, 2w blocks, 2w micro-batches, 16w sequences of 32 tokens, or 16w tokens when 2w does not divide 32):
  every mode of every file in float32 with --check (dp sync / accumulation / async lockstep, ddp with and
  without gradient compression, gpipe with and without recompute, pipedream flush / stash / 2bw, zero_bubble
  ZB-H1 / ZB-V, megatron tp and sequence parallel and tp x dp, ptdp 1F1B / interleaved / tp x pp, moe's five
  routers and dropless loss-free with a shared expert, zero stages 0-3, offload + bf16 mixed precision, fp16
  loss scaling, memory_savers' full and selective recomputation, activation compression and Adafactor, context
  parallel's three attentions in both layouts);
  each file's default mode in bfloat16 under TORCH_DISTRIBUTED_DEBUG=DETAIL (every collective's kind, shape
  and order checked across ranks before it runs);
  at w >= 3, an async parameter server with stragglers (--delay-ms) whose update loop must take well under
  that of the same run in lockstep, where the workers take turns (free-running, they overlap);
  five files killed at step 3 and restarted by torchrun, against their uninterrupted run.
About 10 minutes on 8 GPUs (about 85 runs at worlds 1 and 8)."""
import json, os, re, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^step\s+(\d+) \| loss ([\d.naninf]+) \|\s+([\d.]+) ms", re.M)


def model_flags(w):
    heads = 2 * max(2, w)
    seq = 32 if 32 % (2 * w) == 0 else 16 * w  # context parallel's zig-zag needs 2w | T
    return ["--steps", 4, "--vocab", 64, "--n-heads", heads, "--d-model", 16 * heads, "--n-layers", 2 * w,
            "--batch-size", 16 * w, "--seq-len", seq]


def plan(w):
    """[(name, file, flags)] for world w: every run checks itself (--check), in float32."""
    m = ["--microbatches", 2 * w]
    runs = [("dp sync", "dp.py", []), ("dp accum 2 ragged", "dp.py", ["--accum", 2, "--ragged"]),
            ("ddp", "ddp_bucketed.py", []), ("ddp compress bf16", "ddp_bucketed.py", ["--compress", "bf16"]),
            ("megatron tp", "megatron_tp.py", ["--tp", w]),
            ("megatron tp sequence parallel", "megatron_tp.py", ["--tp", w, "--sequence-parallel"]),
            *[(f"moe {r}", "moe.py", ["--router", r, "--ep", w, "--experts", 2 * w])
              for r in ("switch", "gshard", "noisy_topk", "expert_choice", "loss_free")],
            ("moe loss_free dropless shared", "moe.py",
             ["--router", "loss_free", "--ep", w, "--experts", 2 * w, "--capacity-factor", 0,
              "--shared-experts", 1]),
            *[(f"zero stage {s}", "zero.py", ["--stage", s, "--accum", 2]) for s in range(4)],
            ("zero 2 offload bf16", "zero.py", ["--stage", 2, "--offload", "--mixed-precision", "bf16"]),
            ("zero 3 fp16 loss scaling", "zero.py", ["--stage", 3, "--mixed-precision", "fp16"]),
            ("savers recompute full", "memory_savers.py", ["--recompute", "full", "--accum", 2]),
            ("savers recompute selective", "memory_savers.py", ["--recompute", "selective"]),
            ("savers compress int8", "memory_savers.py", ["--compress-activations", "int8"]),
            ("savers adafactor", "memory_savers.py", ["--optimizer", "adafactor"]),
            *[(f"cp {a} {lay}", "context_parallel.py", ["--cp", w, "--attention", a, "--layout", lay])
              for a, lay in (("ring", "zigzag"), ("ring", "contiguous"), ("allgather", "zigzag"),
                             ("ulysses", "contiguous"))]]
    if w % 2 == 0 and w >= 4:
        runs += [("megatron tp x dp 2", "megatron_tp.py", ["--tp", w // 2]),
                 ("ptdp pp 2 x tp v 2", "ptdp.py", ["--pp", 2, "--tp", w // 2, "--virtual-stages", 2, *m])]
    if w >= 2:  # a pipeline needs one GPU per stage; a parameter server a worker beside it
        D = min(1, w - 2)  # staleness D needs D + 1 workers
        runs += [(f"dp async lockstep D={D}", "dp.py", ["--mode", "async", "--staleness", D]),
                 ("gpipe", "gpipe.py", m), ("gpipe recompute", "gpipe.py", [*m, "--recompute"]),
                 *[(f"pipedream {mode}", "pipedream.py", ["--mode", mode, *m, *clip])
                   for mode, clip in (("flush", []), ("stash", ["--clip", 0]), ("2bw", []))],
                 ("zero_bubble zbh1", "zero_bubble.py", m),
                 ("zero_bubble zbv", "zero_bubble.py", ["--schedule", "zbv", *m]),
                 ("ptdp 1f1b", "ptdp.py", ["--pp", w, *m]),
                 ("ptdp interleaved v 2", "ptdp.py", ["--pp", w, "--virtual-stages", 2, *m])]
    return [(name, f, [*model_flags(w), *flags, "--check"]) for name, f, flags in runs]


def bf16_plan(w):
    """Each file's default mode in bfloat16, under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
    firsts = {}
    for name, f, flags in plan(w):
        firsts.setdefault(f, (f"{f[:-3]} bf16 DETAIL", f, [*flags, "--dtype", "bfloat16"]))
    return list(firsts.values())


def restart_plan(w):
    """Files killed at step 3 and restarted (--max-restarts=1), each against its uninterrupted run."""
    keep = {"dp sync", "zero stage 3", "moe loss_free", "megatron tp",
            "pipedream stash" if w >= 2 else "cp ring zigzag"}
    return [(f"{name} restart", f, [x for x in flags if x != "--check"] + ["--steps", 6])
            for name, f, flags in plan(w) if name in keep]


def launch(w, f, flags, cpu, env=None, restarts=0, timeout=300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={w}",
           f"--max-restarts={restarts}", str(ROOT / f), *map(str, flags)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}),
               **({"CUDA_VISIBLE_DEVICES": ""} if cpu else {}))
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        return -1, f"{e.stdout or ''}{e.stderr or ''}\ntimed out after {timeout} s"


FAILED = []


def line(name, ok, detail, out=""):
    print(f"{name:46s} {'ok' if ok else 'FAILED'}  {detail}", flush=True)
    if not ok:
        FAILED.append(name)
        print("\n".join("    | " + l for l in out.strip().splitlines()[-15:]), flush=True)


def check_line(out):
    found = re.findall(r"max rel loss diff.*", out)
    return found[-1] if found else ""


def run_world(w, cpu):
    tmp = Path(tempfile.mkdtemp())
    for name, f, flags in plan(w):
        rc, out = launch(w, f, flags, cpu)
        line(f"{name} (world {w})", rc == 0 and "PASSED" in out, check_line(out), out)
    for name, f, flags in bf16_plan(w):
        rc, out = launch(w, f, flags, cpu, env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
        line(f"{name} (world {w})", rc == 0 and "PASSED" in out, check_line(out), out)
    for name, f, flags in restart_plan(w):
        full, ck = tmp / f"{name}.full.json", tmp / f"{name}.restart.json"
        rc1, out1 = launch(w, f, [*flags, "--json", full], cpu)
        rc2, out2 = launch(w, f, [*flags, "--ckpt-dir", tmp / f"ck-{name}", "--save-every", 2,
                                  "--fail-at-step", 3, "--json", ck], cpu, restarts=1)
        a, b = (json.loads(p.read_text())["losses"] if p.exists() else None for p in (full, ck))
        ok = rc1 == rc2 == 0 and a is not None and b is not None and len(a) == len(b)
        diff = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if ok else float("nan")
        line(f"{name} (world {w})", ok and diff <= 1e-5, f"max rel loss diff {diff:.3e} vs uninterrupted "
             "(tolerance 1e-05)", out1 + out2)
    if w >= 3:
        stragglers(w, cpu)


def stragglers(w, cpu, delay=40, steps=24):
    """Worker r computes r x delay ms longer. Free-running, the workers overlap, so the server's update loop
    takes about half as long as in lockstep with staleness 0 (each update waits for the one before it: one
    worker at a time), whatever a step's own compute costs; both are measured here. A server whose waits
    serialise the workers (issue 21's NCCL bug: work.wait() on the shared stream) comes out near 1."""
    loop = {}
    for mode, extra in (("free", []), ("lockstep", ["--staleness", 0])):
        flags = [*model_flags(w), "--mode", "async", "--delay-ms", delay, "--steps", steps, *extra]
        rc, out = launch(w, "dp.py", flags, cpu)
        ms = [float(x[2]) for x in STEP.findall(out)]
        loop[mode] = sum(ms) if rc == 0 and len(ms) == steps else float("nan")
    ratio = loop["free"] / loop["lockstep"]
    line(f"dp async stragglers overlap (world {w})", ratio < 0.75, f"update loop free-running "
         f"{loop['free']:.0f} ms vs lockstep D=0 {loop['lockstep']:.0f} ms: {ratio:.2f} (must be < 0.75; "
         "ideal about 0.5)", out)


def main():
    argv = sys.argv[1:]
    if argv[:1] == ["--list"]:
        w = int(argv[1])
        for name, f, flags in plan(w) + bf16_plan(w) + restart_plan(w):
            print(f"{f} {' '.join(map(str, flags))}    # {name}")
        return 0
    cpu = argv[:1] == ["--cpu"]
    if cpu:
        worlds = [1, 2]
    else:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            print("gpu_check: no CUDA GPU visible to torch: nothing to check (skipped)")
            return 0
        print(f"gpu_check: {n} x {torch.cuda.get_device_name(0)} | torch {torch.__version__}", flush=True)
        worlds = sorted({1, n})
    t0 = time.time()
    for w in worlds:
        run_world(w, cpu)
    if cpu:  # the smallest world with two workers, so the straggler check itself is tried on CPU too
        stragglers(3, cpu)
    print(f"gpu_check: {'all runs passed' if not FAILED else f'{len(FAILED)} RUNS FAILED'} "
          f"({(time.time() - t0) / 60:.1f} min)")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
