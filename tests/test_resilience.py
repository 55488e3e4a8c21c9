"""Resilience shared by every file (common.py): bad input is one line and exit 2 before any collective, a
crash in the middle of a save loses nothing, two "nodes" equal one, a dead rank never leaves a hang, and
the CPU suite stays on CPU on a GPU machine."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from helpers import ENV, ROOT, TINY, free_port, torchrun

sys.path.insert(0, str(ROOT))
import common  # noqa: E402


def test_more_processes_than_gpus_is_refused_and_the_suite_hides_gpus():
    why = common.gpu_layout_error(n_gpus=1, local_world=4)
    assert "4 processes" in why and "1 GPU" in why and "--nproc_per_node=1" in why, why
    assert common.gpu_layout_error(n_gpus=8, local_world=8) is None
    assert ENV["CUDA_VISIBLE_DEVICES"] == ""  # gloo + CPU, as CI runs it, even where GPUs exist
    p = subprocess.run(
        ["bash", str(ROOT / "tests" / "gpu_check.sh")],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0 and "skipped" in p.stdout, p.stdout + p.stderr


# --------------------------------------------------------------------------- the bad-input matrix
T = TINY  # 2 layers, 2 heads, d_model 16, batch 12, float64

# (file, world, flags, words the one line must contain). Each case runs on every rank of its world.
MATRIX = [
    ("dp.py", 1, ["--steps", "0"], ["--steps must be >= 1"]),
    ("dp.py", 1, [*T, "--d-model", "30", "--n-heads", "4"], ["not divisible by --n-heads"]),
    ("dp.py", 1, [*T, "--save-every", "2"], ["--save-every needs --ckpt-dir"]),
    ("dp.py", 1, [*T, "--mode", "bogus"], ["invalid choice", "bogus"]),
    ("dp.py", 2, [*T, "--batch-size", "7"], ["divisible"]),
    ("dp.py", 1, [*T, "--mode", "async"], ["async", "nproc_per_node=2"]),
    ("ddp_bucketed.py", 3, [*T, "--batch-size", "8"], ["not divisible by the world size 3"]),
    ("gpipe.py", 1, T, ["one process per stage"]),
    ("gpipe.py", 2, [*T, "--microbatches", "5"], ["not divisible by --microbatches 5"]),
    ("gpipe.py", 4, T, ["4 stages but --n-layers 2"]),
    ("pipedream.py", 2, [*T, "--mode", "bogus"], ["invalid choice"]),
    (
        "pipedream.py",
        2,
        [*T, "--microbatches", "5"],
        ["--microbatches 5", "does not cut into m = 5"],
    ),
    ("pipedream.py", 2, [*T, "--vertical-sync"], ["--vertical-sync"]),
    (
        "pipedream.py",
        2,
        [*T, "--mode", "2bw", "--microbatches", "1"],
        ["--mode 2bw", "2bw needs m >= p = 2 micro-batches, got 1"],
    ),
    ("megatron_tp.py", 4, [*T, "--tp", "3"], ["not divisible by --tp 3"]),
    ("megatron_tp.py", 4, [*T, "--tp", "4"], ["--n-heads 2 is not divisible by the TP degree 4"]),
    (
        "moe.py",
        4,
        [*T, "--experts", "6", "--ep", "4"],
        ["--experts 6", "experts = 6 is not divisible by ep = 4"],
    ),
    ("moe.py", 1, [*T, "--router", "bogus"], ["invalid choice"]),
    ("zero.py", 2, [*T, "--stage", "5"], ["--stage must be 0, 1, 2 or 3"]),
    ("zero.py", 2, [*T, "--stage", "0", "--offload"], ["--offload"]),
    (
        "memory_savers.py",
        2,
        [*T, "--recompute", "full", "--compress-activations", "int8"],
        ["pick one"],
    ),
    ("memory_savers.py", 3, [*T, "--accum", "5"], ["--accum 5", "must split"]),
    ("dp.py", 3, [*T, "--mode", "async", "--ckpt-dir", "unused"], ["--ckpt-dir"]),
    (
        "ptdp.py",
        4,
        [*T, "--pp", "2", "--tp", "1", "--dp", "1"],
        ["world size 4 != pp 2 x tp 1 x dp 1"],
    ),
    (
        "ptdp.py",
        4,
        [*T, "--pp", "2", "--tp", "2", "--n-heads", "1", "--d-model", "16"],
        ["--n-heads 1 is not divisible by --tp = 2"],
    ),
    (
        "ptdp.py",
        2,
        [*T, "--pp", "2", "--virtual-stages", "2", "--microbatches", "3", "--n-layers", "4"],
        ["--microbatches 3", "m 3 is not divisible by p = 2"],
    ),
    (
        "ptdp.py",
        2,
        [*T, "--pp", "2", "--virtual-stages", "2", "--microbatches", "2", "--n-layers", "3"],
        ["--n-layers 3 is not divisible by --pp x --virtual-stages = 4"],
    ),
    (
        "context_parallel.py",
        4,
        [*T, "--attention", "ulysses"],
        ["--n-heads 2 is not divisible by --cp 4"],
    ),
    (
        "context_parallel.py",
        2,
        [*T, "--seq-len", "6"],
        ["--seq-len 6 is not divisible by 2 x cp = 4"],
    ),
    (
        "context_parallel.py",
        3,
        [*T, "--layout", "contiguous"],
        ["--seq-len 8 is not divisible by cp = 3"],
    ),
    ("context_parallel.py", 4, [*T, "--cp", "3"], ["world size 4 != dp 1 x cp 3"]),
    ("context_parallel.py", 4, [*T, "--cp", "2", "--batch-size", "7"], ["not divisible by --dp 2"]),
    ("context_parallel.py", 1, [*T, "--dropout", "0.1"], ["--dropout 0.1", "use --dropout 0"]),
    (
        "zero_bubble.py",
        2,
        [*T, "--schedule", "zbv", "--microbatches", "2", "--n-layers", "4"],
        ["--schedule zbv", "needs m >= 2p-1 = 3 micro-batches, got 2"],
    ),
    ("zero_bubble.py", 2, [*T, "--schedule", "bogus"], ["invalid choice"]),
    ("zero_bubble.py", 4, [*T, "--schedule", "zbv"], ["--n-layers 2", "8 chunks of 2 blocks"]),
    (
        "plan.py",
        1,
        ["--model", "llama3-70b", "--tp", "8", "--pp", "2"],
        ["16 GPUs, the cluster has 8"],
    ),
    (
        "plan.py",
        1,
        ["--model", "gpt3-6.7b", "--batch-size", "100", "--microbatches", "3"],
        ["not divisible by dp"],
    ),
]
# checkpoint directories (made in the test): another file's, another model size, damaged, another world
CKPT_CASES = [
    (
        "ddp_bucketed.py",
        [*T, "--ckpt-dir", "{A}"],
        ["written by dp.py at world 1", "this run is ddp_bucketed.py"],
    ),
    ("moe.py", [*T, "--ckpt-dir", "{A}"], ["written by dp.py at world 1"]),
    ("megatron_tp.py", [*T, "--ckpt-dir", "{A}"], ["written by dp.py at world 1"]),
    ("zero.py", [*T, "--ckpt-dir", "{A}"], ["another file's rank-local checkpoints"]),
    ("zero.py", [*T, "--d-model", "32", "--ckpt-dir", "{Z}"], ["holds another model"]),
    ("memory_savers.py", [*T, "--ckpt-dir", "{A}"], ["written by dp.py at world 1"]),
    (
        "dp.py",
        [*T, "--d-model", "32", "--ckpt-dir", "{A}"],
        ["does not fit this model", "size mismatch"],
    ),
    (
        "dp.py",
        [*T, "--n-layers", "3", "--ckpt-dir", "{A}"],
        ["does not fit this model", "Missing key"],
    ),
    ("dp.py", [*T, "--ckpt-dir", "{damaged}"], ["cannot read checkpoint"]),
    ("dp.py", [*T, "--ckpt-dir", "{world2}"], ["holds checkpoints of 2 ranks, this run has 1"]),
    ("dp.py", [*T, "--ckpt-dir", "{file}"], ["is a file, not a directory"]),
]


def test_bad_input_matrix(tmp_path):
    """Every case: exit 2, exactly one line on stderr naming the rank and the problem, on every rank."""
    A = tmp_path / "A"  # a real dp.py checkpoint at world 1, step 2
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "dp.py"),
            *T,
            "--steps",
            "2",
            "--ckpt-dir",
            str(A),
            "--save-every",
            "2",
        ],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and (A / "rank0" / "step2.pt").exists(), p.stdout + p.stderr
    Z = tmp_path / "Z"  # a zero.py (sharded) checkpoint at world 1, step 2
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "zero.py"),
            *T,
            "--steps",
            "2",
            "--ckpt-dir",
            str(Z),
            "--save-every",
            "2",
        ],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and (Z / "step2" / ".metadata").exists(), p.stdout + p.stderr
    dirs = dict(
        A=A, Z=Z, damaged=tmp_path / "damaged", world2=tmp_path / "world2", file=tmp_path / "file"
    )
    shutil.copytree(A, dirs["damaged"])
    (dirs["damaged"] / "rank0" / "step2.pt").write_bytes(b"not a checkpoint")
    for r in range(2):  # as if written by a world of 2
        shutil.copytree(A / "rank0", dirs["world2"] / f"rank{r}")
    dirs["file"].write_text("x")
    cases = [
        dict(file=f, world=w, rank=r, argv=a, words=words)
        for f, w, a, words in MATRIX
        if (ROOT / f).exists()
        for r in range(w)
    ]
    cases += [
        dict(
            file=f,
            world=1,
            rank=0,
            argv=[x.format(**{k: str(v) for k, v in dirs.items()}) for x in a],
            words=words,
        )
        for f, a, words in CKPT_CASES
    ]
    # the control: a valid configuration at world 2 passes every check and reaches the rendezvous, which
    # this harness does not provide, so it crashes there: a case whose check were missing shows up so
    cases.append(dict(file="dp.py", world=2, rank=1, argv=T, words=[], control=True))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bad_input_matrix.py"), str(tmp_path / "cases.json")],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    results = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(results) == len(cases), p.stdout[-2000:] + p.stderr[-3000:]
    wrong = []
    control = results.pop()
    assert control["code"] == "crash" and "MASTER_ADDR" in control["stderr"], control
    for c, r in zip(cases, results):
        lines = r["stderr"].strip().splitlines()
        ok = (
            r["code"] == 2
            and len(lines) == 1
            and f"error (rank {c['rank']})" in lines[0]
            and all(w in lines[0] for w in c["words"])
            and "Traceback" not in r["stdout"]
        )
        if not ok:
            wrong.append(
                f"{c['file']} world {c['world']} rank {c['rank']} {' '.join(c['argv'])}: exit {r['code']}, "
                f"stderr {r['stderr'].strip()!r}"
            )
    assert not wrong, f"{len(wrong)} of {len(cases)} cases wrong:\n" + "\n".join(wrong)
    print(
        f"bad-input matrix: {len(cases)} rank-cases ({len(MATRIX)} configurations, {len(CKPT_CASES)} checkpoint "
        f"directories) over {len({c['file'] for c in cases})} files"
    )


def test_gpu_check_plans_a_legal_run_for_any_gpu_count(tmp_path):
    """tests/gpu_check.py derives every run's flags from the GPU count: at 1 to 8 GPUs each planned run (the
    --check runs, the DETAIL pass, both sides of every restart and dropout comparison, the one-GPU plan at
    world 1) passes its file's argument checks and reaches the rendezvous (the matrix runner has none, so it
    crashes there), where an illegal one would exit 2. The control: the plan for 6 GPUs launched at world 4
    is refused."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(ROOT))
    import bench
    import gpu_check

    runs = {}  # (file, world, argv) -> name; the DETAIL pass's runs are the plan's with --dtype bfloat16
    for w in range(1, 9):
        for j in gpu_check.jobs(w, False, w):
            sides = [j["flags"]] if "flags" in j else [j["a"], *j["b"]] if "a" in j else []
            # our side of each pair, as bench.py launches it with gpu_check's flags
            if j["kind"] == "bench":
                pairs = list(bench.PAIRS) if j["pairs"] == "all" else j["pairs"].split(",")
                # bench.py skips hsdp at an odd world (2 replicas), in one line, launching nothing
                pairs = [q for q in pairs if not (q == "hsdp" and w % 2)]
                sides = [
                    [
                        *gpu_check.bench_flags(w)[:-4],
                        *bench.PAIRS[q][1].format(m=2 * w, world=w, cap=4.0).split(),
                    ]
                    for q in pairs
                ]  # the model; not --microbatches, --warmup
                files = [bench.PAIRS[q][0] for q in pairs]
            else:
                files = [j["file"]] * len(sides)
            for f, flags in zip(files, sides) if not j.get("env") else ():
                runs.setdefault((f, w, tuple(map(str, flags))), j["name"])
    cases = [
        dict(file=f, world=w, rank=w - 1, argv=list(argv), torchrun=True, name=name)
        for (f, w, argv), name in runs.items()
    ]
    kinds = {name.split(" (")[0] for name, _, _ in gpu_check.plan(8) + gpu_check.extra_plan(8)}
    assert len(kinds) >= 40 and {f for _, f, _ in gpu_check.plan(8)} == {
        "dp.py",
        "ddp_bucketed.py",
        "gpipe.py",
        "pipedream.py",
        "zero_bubble.py",
        "megatron_tp.py",
        "ptdp.py",
        "moe.py",
        "moe_deepseek.py",
        "zero.py",
        "memory_savers.py",
        "context_parallel.py",
    }, kinds
    wrong_world = [
        dict(file=f, world=4, rank=0, argv=list(map(str, flags)), torchrun=True, name=name)
        for name, f, flags in gpu_check.plan(6)
        if f in ("ptdp.py", "megatron_tp.py", "moe.py")
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases + wrong_world))
    p = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "bad_input_matrix.py"), str(tmp_path / "cases.json")],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    assert len(results) == len(cases) + len(wrong_world), p.stdout[-2000:] + p.stderr[-3000:]
    bad = [
        f"{c['name']} world {c['world']}: {r['code']} {r['stderr'].strip()[-200:]}"
        for c, r in zip(cases, results)
        if not (r["code"] == "crash" and "MASTER_ADDR" in r["stderr"])
    ]
    assert not bad, f"{len(bad)} of {len(cases)} planned runs are refused:\n" + "\n".join(bad[:20])
    refused = [r for r in results[len(cases) :] if r["code"] == 2]
    assert len(refused) == len(wrong_world), results[len(cases) :]


# --------------------------------------------------------------------------- faults
def launch(tmp_path, nproc, *args, max_restarts=0, timeout=240):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={max_restarts}",
        *map(str, args),
    ]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    return p, time.monotonic() - t0


def orphans(marker):
    """Processes still running whose command line names this test's temporary folder."""
    p = subprocess.run(["pgrep", "-f", str(marker)], capture_output=True, text=True)
    return p.stdout.split()


def test_crash_in_the_middle_of_a_save_resumes_from_the_last_complete_step(tmp_path):
    """The last rank dies after writing step 4's checkpoint to its temporary file, before the rename. The
    restarted run must resume from step 2 (the newest step *every* rank has), with dropout on (the RNG
    state is in the checkpoint), and give the uninterrupted losses bit for bit."""
    args = [*T, "--steps", "6", "--dropout", "0.1", "--ragged"]
    full, _ = torchrun("dp.py", 2, *args, tmp_path=tmp_path, name="full")
    ck, js = tmp_path / "ck", tmp_path / "crashed.json"
    p, _ = launch(
        tmp_path,
        2,
        ROOT / "tests" / "fault_wrapper.py",
        "die-mid-save:4",
        "dp.py",
        *args,
        "--ckpt-dir",
        ck,
        "--save-every",
        "2",
        "--json",
        js,
        max_restarts=1,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert "before renaming it" in out and "resumed from" in out and "at step 2" in out, out[-4000:]
    crashed = json.loads(js.read_text())
    assert crashed["losses"] == full["losses"], (crashed["losses"], full["losses"])
    # the dead rank's half-finished save is a temporary file, never a step file
    assert not (ck / "rank1" / "step4.pt").exists() or (ck / "rank1" / "step6.pt").exists()


@pytest.mark.parametrize(
    "script,fault,extra",
    [
        (
            "zero.py",
            "raise-collective:6",
            ["--stage", "3"],
        ),  # collective-heavy: a rank raises inside training
        (
            "gpipe.py",
            "kill-p2p:5",
            ["--microbatches", "4"],
        ),  # a pipeline: a stage is SIGKILLed mid-exchange
    ],
)
def test_a_dead_rank_brings_the_job_down_without_a_hang(tmp_path, script, fault, extra):
    """The peers are inside a collective or a point-to-point exchange with the dead rank. torchrun must see
    the death, stop the others and exit non-zero, well inside the launch's timeout (a hang would run into
    it), leaving no process behind."""
    js = tmp_path / "run.json"
    p, took = launch(
        tmp_path,
        2,
        ROOT / "tests" / "fault_wrapper.py",
        fault,
        script,
        *T,
        "--steps",
        "4",
        *extra,
        "--json",
        js,
        timeout=200,
    )
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "fault_wrapper:" in out, out[-4000:]
    assert took < 150, f"took {took:.0f} s: the job hung until a timeout"
    time.sleep(1)
    assert not orphans(tmp_path), orphans(tmp_path)


@pytest.mark.parametrize(
    "script,layout",
    [
        ("zero.py", ["--stage", "3"]),  # every collective spans both nodes
        (
            "ptdp.py",
            ["--pp", "2", "--tp", "2", "--dp", "1"],
        ),  # a TP group inside each node, the pipeline across
    ],
)
def test_two_nodes_on_one_machine_equal_one_node(tmp_path, script, layout):
    """Two `torchrun --nnodes=2` launches of 2 processes each, meeting through a c10d rendezvous, give
    exactly the losses of one 4-process launch. (megatron_tp.py's twin is in test_megatron_tp.py.)"""
    args = [script, *T, *layout]
    one, _ = torchrun(*args[:1], 4, *args[1:], tmp_path=tmp_path, name="one")
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={n}",
                "--nproc_per_node=2",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                f"--rdzv-id=two-nodes-{port}",
                str(ROOT / args[0]),
                *args[1:],
                "--json",
                str(tmp_path / f"node{n}.json"),
            ],
            env=ENV,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    two = json.loads((tmp_path / "node0.json").read_text())  # global rank 0 lives on node 0
    assert two["world_size"] == 4 and two["losses"] == one["losses"], (two["losses"], one["losses"])


def test_gpu_check_straggler_verdict(monkeypatch, capsys):
    """gpu_check's straggler check compares two measured update loops (bash tests/gpu_check.sh --cpu runs it
    for real at world 3: 0.52). Here its verdict on the step times a launch prints: workers that overlap
    (half the lockstep loop) pass; a server that serialises them (the loop of lockstep, issue 21's NCCL bug)
    fails, and so does a run that did not finish."""
    sys.path.insert(0, str(ROOT / "tests"))
    import gpu_check

    def verdict(free_ms, lockstep_ms, steps=24, rc=0):
        def launch(w, f, flags, cpu, **kw):
            ms = lockstep_ms if "--staleness" in flags else free_ms
            return rc, "".join(
                f"step {s:4d} | loss 4.0 | {ms:8.1f} ms | 1 tok/s\n" for s in range(steps)
            )

        monkeypatch.setattr(gpu_check, "launch", launch)
        monkeypatch.setattr(gpu_check, "FAILED", [])
        gpu_check.stragglers(3, True)
        capsys.readouterr()
        return not gpu_check.FAILED

    assert verdict(110, 220) and not verdict(220, 220) and not verdict(110, 220, steps=3)
    assert not verdict(110, 220, rc=1)
