"""bench.py: torch's side of every pair trains exactly what the one-process reference trains, the byte
counter counts what closed forms say (and misses what a broken pattern misses), one pair end to end writes
well-formed rows, and bad input exits 2. No timing is asserted anywhere."""
import json, subprocess, sys

from helpers import ENV, ROOT, run_python

TINY = ["--vocab", "32", "--seq-len", "8", "--d-model", "16", "--n-heads", "2", "--n-layers", "4",
        "--batch-size", "8"]

# Run under torchrun at world 2: every torch-side worker of bench.py, in float64, against common's one-process
# trainer; CountComm against closed forms; and two breakages that the checks must catch.
CHECKS = r'''
import sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import bench
from common import init_dist, reference_train, GPT, GPTConfig

d = init_dist(120)
args = bench.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=4, batch_size=8, steps=3, dtype="float64",
                  microbatches=2, bucket_cap_mb=0.01)
ref = reference_train(args)["losses"] if d.rank == 0 else None
bad = []

def losses_of(side, name, steps=3):
    bench.COUNT = bench.CountComm(d.rank)
    step = side(d, args, name)
    return [step(i)[0] for i in range(steps)]

def compare(name, losses, expect_equal=True):
    t = torch.zeros(1, dtype=torch.float64, device=d.device)
    if d.rank == 0:
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        t[0] = diff
        print(f"{name}: max rel loss diff vs one-process reference {diff:.2e}", flush=True)
    dist.broadcast(t, 0)
    if (t.item() <= 1e-9) != expect_equal:
        bad.append(name)

sides = dict(ddp=bench.data_parallel_side, zero1=bench.data_parallel_side, fsdp_noreshard=bench.data_parallel_side,
             fsdp=bench.data_parallel_side, gpipe=bench.pipeline_side, **{"1f1b": bench.pipeline_side},
             interleaved=bench.pipeline_side, tp=bench.tensor_parallel_side)
for name, side in sides.items():
    compare(name, losses_of(side, name))

# break it on purpose: torch's default scale_grads=True divides every gradient by m once more
import torch.distributed.pipelining as pl
orig = pl.ScheduleGPipe.__init__
pl.ScheduleGPipe.__init__ = lambda self, *a, **k: orig(self, *a, **dict(k, scale_grads=True))
compare("gpipe with scale_grads=True (must differ)", losses_of(bench.pipeline_side, "gpipe"), expect_equal=False)
pl.ScheduleGPipe.__init__ = orig

# CountComm: DDP hands every gradient to all-reduce once per step (payload = parameter bytes); a pipeline
# stage 0 sends m activations of (b, T, D) float64 per step; a pattern without "reduce" misses DDP's.
param_bytes = sum(p.numel() for p in GPT(GPTConfig(32, 8, 16, 2, 4)).parameters()) * 8
broken = __import__("re").compile("gather|scatter")  # a counter that misses all-reduces must fail this check
for pattern, must_pass in ((bench.COLLECTIVE, True), (broken, False)):
    real, bench.COLLECTIVE = bench.COLLECTIVE, pattern
    bench.COUNT = comm = bench.CountComm(d.rank)
    step = bench.data_parallel_side(d, args, "ddp")
    step(0)
    with comm:
        step(1)
    got = sum(c[1] for k, c in comm.ops.items() if "allreduce" in k)
    print(f"DDP all-reduce payload counted {got} B, expected {param_bytes} B (pattern {pattern.pattern})", flush=True)
    if (got == param_bytes) != must_pass:
        bad.append(f"count ddp {pattern.pattern}")
    bench.COLLECTIVE = real
bench.COUNT = comm = bench.CountComm(d.rank)
step = bench.pipeline_side(d, args, "gpipe")
step(0)
with comm:
    step(1)
sends = comm.ops.get("c10d.send", [0, 0, 0])[1]
expect = args.microbatches * (args.batch_size // args.microbatches) * args.seq_len * args.d_model * 8
print(f"gpipe rank {d.rank} sent {sends} B, expected {expect if d.rank == 0 else 'the gradients, same size'}", flush=True)
if sends != expect:
    bad.append(f"count gpipe rank {d.rank}")
print("FAILED: " + ", ".join(bad) if bad else "ALL CHECKS PASSED", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if bad else 0)
'''


def test_torch_sides_match_reference_and_counts(tmp_path):
    """Every torch side reproduces one-process training in float64 (1e-9); ScheduleGPipe's default
    scale_grads=True would not, and the check sees it; CountComm equals the closed forms."""
    script = tmp_path / "bench_checks.py"
    script.write_text(CHECKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), str(ROOT)]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ALL CHECKS PASSED" in out, out[-6000:]
    assert "must differ): max rel loss diff" in out


def test_one_pair_end_to_end(tmp_path):
    """`python bench.py --pairs gpipe` at tiny size, 2 steps, one round: rows of the documented shape."""
    out = tmp_path / "b"
    p = run_python("bench.py", "--pairs", "gpipe", *TINY, "--steps", "2", "--warmup", "1", "--rounds", "1",
                   "--microbatches", "2", "--out", out, "--launch-timeout", "150", timeout=330)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["pair"] for r in rows] == ["gpipe"]
    r = rows[0]
    for side in ("ours", "torch"):
        s = r[side]
        assert s["name"] and s["step_ms"] > 0 and s["tokens_per_s"] > 0 and s["peak_mem_bytes"] > 0, s
        assert s["sent_bytes_per_rank"] > 0 and 0 <= s["bubble"] <= 1 and s["bubble_theory"] == 1 / 3, s
    assert r["ratio"] == r["ours"]["step_ms"] / r["torch"]["step_ms"] and len(r["ratio_per_round"]) == 1
    assert r["max_loss_diff"] <= 1e-4, r  # both sides trained the same model on the same data (float32)
    md = (tmp_path / "b.md").read_text()
    assert "| gpipe |" in md and "ratio" in md


def test_bad_input():
    for argv, words in ((["--pairs", "nope"], "unknown"), (["--warmup", "0"], "--warmup"),
                        (["--world", "2", "--n-heads", "3", "--d-model", "48"], "--n-heads")):
        p = run_python("bench.py", *argv)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], p.stderr
