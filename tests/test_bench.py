"""bench.py: torch's side of every pair trains exactly what the one-process reference trains,
harness.CommCounter counts what closed forms say (and a counter blind to all-reduces fails that check), the
stage hooks see every F, B and W the schedules run, one pair end to end writes well-formed rows, a pair whose
file lacks the mode it needs is skipped with one line, and bad input exits 2. No timing is asserted."""
import json, subprocess, sys

from helpers import ENV, ROOT, run_python

TINY = ["--vocab", "32", "--seq-len", "8", "--d-model", "16", "--n-heads", "2", "--n-layers", "4",
        "--batch-size", "8"]

# Run under torchrun at world 2: every torch-side worker of bench.py, in float64, against common's one-process
# trainer; the byte counter and the timeline against closed forms; and breakages that the checks must catch.
CHECKS = r'''
import contextlib, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
import bench, harness
from common import init_dist, reference_train, GPT, GPTConfig

d = init_dist(120)
args = bench.Args(vocab=32, seq_len=8, d_model=16, n_heads=2, n_layers=4, batch_size=8, steps=3,
                  dtype="float64", microbatches=4, bucket_cap_mb=0.01)
ref = reference_train(args)["losses"] if d.rank == 0 else None
bad = []

def run(name, steps=3, counted_step=1):
    """bench's worker loop: the side's train(i) between zero_grad and the optimizer step; CommCounter around
    one step after the first (lazy initialisation done). Returns (losses, counter, train)."""
    comm = harness.CommCounter()
    params, opt, train = bench.WORKERS[name][0](d, args, name, comm)
    losses = []
    for i in range(steps):
        with comm if i == counted_step else contextlib.nullcontext():
            opt.zero_grad(set_to_none=True)
            losses.append(train(i)[0])
            opt.step()
    return losses, comm, train

def compare(name, losses, expect_equal=True):
    t = torch.zeros(1, dtype=torch.float64, device=d.device)
    if d.rank == 0:
        t[0] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        print(f"{name}: max rel loss diff vs one-process reference {t.item():.2e}", flush=True)
    dist.broadcast(t, 0)
    if (t.item() <= 1e-9) != expect_equal:
        bad.append(name)

m, p, comms = args.microbatches, d.world, {}
for name in [w for w in bench.WORKERS if w != "single"]:
    losses, comms[name], train = run(name)
    compare(name, losses)
    if name in bench.SCHEDULES:  # every F, B and W each rank's stages ran in the last step, seen from outside
        ops, v = train.figures()["ops"], 1 + (bench.SCHEDULES[name][1] != "one")
        w = p * v * m if "Bubble" in bench.SCHEDULES[name][0] else 0  # zero-bubble: B and W are split
        d.log(f"{name}: ops seen {ops}, expected F = B = {p * v * m}, W = {w}")
        if ops != dict(F=p * v * m, B=p * v * m, W=w):
            bad.append(f"ops {name}")

# break it on purpose: torch's default scale_grads=True divides every gradient by m once more
import torch.distributed.pipelining as pl
orig = pl.ScheduleGPipe.__init__
pl.ScheduleGPipe.__init__ = lambda self, *a, **k: orig(self, *a, **dict(k, scale_grads=True))
compare("gpipe with scale_grads=True (must differ)", run("gpipe")[0], expect_equal=False)
pl.ScheduleGPipe.__init__ = orig
# a zero-bubble schedule whose weight gradients (W) never run: the check must see the split is real
orig_w = pl.PipelineStage.backward_weight_one_chunk
pl.PipelineStage.backward_weight_one_chunk = lambda self, *a, **k: None
compare("zbv with W never run (must differ)", run("zbv", steps=2)[0], expect_equal=False)
pl.PipelineStage.backward_weight_one_chunk = orig_w

# CommCounter: DDP hands every gradient to all-reduce once per step (payload = parameter bytes); a pipeline
# stage sends m activations (forward) or their gradients (backward) of (b, T, D) float64 per step; a counter
# whose op table misses the all-reduces counts nothing for DDP and fails the closed form.
param_bytes = sum(p.numel() for p in GPT(GPTConfig(32, 8, 16, 2, 4)).parameters()) * 8
real, harness._OPS = harness._OPS, {k: v for k, v in harness._OPS.items() if v != "all_reduce"}
blind = run("ddp", steps=2)[1]
harness._OPS = real
for comm, must_pass in ((comms["ddp"], True), (blind, False)):
    got = comm.total(op="all_reduce")
    d.log(f"DDP all-reduce payload counted {got} B, expected {param_bytes} B (a counter "
          f"{'blind to' if comm is blind else 'that knows'} all-reduce)")
    if (got == param_bytes) != must_pass:
        bad.append(f"count ddp (must pass: {must_pass})")
sends = comms["gpipe"].total(op="send")
expect = m * (args.batch_size // m) * args.seq_len * args.d_model * 8
print(f"gpipe rank {d.rank} sent {sends} B, expected {expect}", flush=True)
if sends != expect:
    bad.append(f"count gpipe rank {d.rank}")
print("FAILED: " + ", ".join(bad) if bad else "ALL CHECKS PASSED", flush=True)
dist.barrier()
dist.destroy_process_group()
sys.exit(1 if bad else 0)
'''


def test_torch_sides_match_reference_and_counts(tmp_path):
    """Every torch side (zero-bubble ZB1P and ZB-V included) reproduces one-process training in float64
    (1e-9); ScheduleGPipe's default scale_grads=True, or a ZB-V whose W never runs, would not, and the check
    sees it; CommCounter equals the closed forms, and misses DDP's bytes with all-reduce dropped from its op
    table; the stage hooks see m F, m B (and m W when split) per stage."""
    script = tmp_path / "bench_checks.py"
    script.write_text(CHECKS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script),
           str(ROOT)]
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0 and "ALL CHECKS PASSED" in out, out[-6000:]
    assert out.count("must differ): max rel loss diff") == 2, out[-6000:]
    assert "(a counter blind to all-reduce)" in out, out[-6000:]


def test_one_pair_end_to_end(tmp_path):
    """`python bench.py --pairs gpipe,zb` at tiny size, 2 steps, one round: gpipe's row of the documented
    shape;
    zb pointed at a file that will never offer `--schedule zbh1` (gpipe.py) is skipped with one line, no
    launch, and a choice the file does offer (pipedream.py --mode flush) is not."""
    out, runner = tmp_path / "b", tmp_path / "bench_runner.py"
    runner.write_text(f"import sys; sys.path.insert(0, {str(ROOT)!r}); import bench\n"
                      "bench.NEEDS['1f1b'] = ('--mode', 'flush')  # offered: not skipped\n"
                      "assert bench.why_skipped('1f1b') == '', bench.why_skipped('1f1b')\n"
                      "bench.PAIRS['zb'] = ('gpipe.py', *bench.PAIRS['zb'][1:])\nbench.main()\n")
    argv = ["--pairs", "gpipe,zb", *TINY, "--steps", "2", "--warmup", "1", "--rounds", "1", "--microbatches",
            "2", "--out", str(out), "--launch-timeout", "150"]
    p = subprocess.run([sys.executable, str(runner), *argv], env=ENV, cwd=ROOT, capture_output=True,
                       text=True, timeout=330)
    assert p.returncode == 0, p.stdout + p.stderr
    skip = [line for line in p.stdout.splitlines() if line.startswith("zb:")]
    assert skip == ["zb: pair skipped, gpipe.py has no --schedule zbh1 yet (--schedule offers [])"], p.stdout
    rows = json.loads((tmp_path / "b.json").read_text())
    assert [r["pair"] for r in rows] == ["gpipe", "zb"] and rows[1]["skipped"] and rows[1]["ours"] is None
    r = rows[0]
    for side in ("ours", "torch"):
        s = r[side]
        assert s["name"] and s["step_ms"] > 0 and s["tokens_per_s"] > 0 and s["peak_mem_bytes"] > 0, s
        assert s["sent_bytes_per_rank"] > 0 and 0 <= s["bubble"] <= 1 and s["bubble_theory"] == 1 / 3, s
    assert r["ratio"] == r["ours"]["step_ms"] / r["torch"]["step_ms"] and len(r["ratio_per_round"]) == 1
    assert r["max_loss_diff"] <= 1e-4, r  # both sides trained the same model on the same data (float32)
    md = (tmp_path / "b.md").read_text()
    assert "| gpipe |" in md and "ratio" in md and "| zb | skipped: gpipe.py has no --schedule zbh1" in md


def test_bad_input():
    for argv, words in ((["--pairs", "nope"], "unknown"), (["--warmup", "0"], "--warmup"),
                        (["--world", "2", "--n-heads", "3", "--d-model", "48"], "--n-heads")):
        p = run_python("bench.py", *argv)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and words in lines[0], p.stderr
