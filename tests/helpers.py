"""Launch technique files the way a user does (torchrun on gloo + CPU), always with a timeout, and read
the --json summary they write."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The suite is the CPU suite, as CI runs it: gloo, with any GPUs hidden (a 4-process launch on a machine with
# fewer GPUs would be refused). tests/gpu_check.sh is the one for GPUs. OMP_NUM_THREADS=1: several
# processes share a few cores, as the README says.
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
# A tiny model: the checks are about exact arithmetic, not about learning.
TINY = [
    "--vocab",
    "32",
    "--seq-len",
    "8",
    "--d-model",
    "16",
    "--n-heads",
    "2",
    "--n-layers",
    "2",
    "--batch-size",
    "12",
    "--steps",
    "4",
    "--dtype",
    "float64",
]


def torchrun(
    script, nproc, *args, tmp_path, timeout=240, max_restarts=0, expect_rc=0, name="run", real=False
):
    """`torchrun --standalone --nproc_per_node=nproc script args --json ...`; returns (summary, output).
    The workers are forked from a warm interpreter (tests/forkserver.py: the same environment, argv and
    rendezvous as torchrun's, without N + 1 imports of torch); `real=True` runs torchrun itself."""
    out_json = Path(tmp_path) / f"{name}.json"
    args = [*map(str, args), "--json", str(out_json)]
    if real:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
            str(ROOT / script),
            *args,
        ]
        p = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, output = p.returncode, p.stdout + p.stderr
    else:
        cmd = [
            "torchrun",
            f"--nproc_per_node={nproc}",
            f"--max-restarts={max_restarts}",
            script,
            *args,
        ]
        rc, output = forked(script, nproc, *args, timeout=timeout, max_restarts=max_restarts)
    assert rc == expect_rc, (
        f"exit {rc} (expected {expect_rc}) from {' '.join(cmd)}\n{output[-6000:]}"
    )
    summary = json.loads(out_json.read_text()) if out_json.exists() else None
    return summary, output


def check_lines(script, nproc, timeout=240):
    """A checks script (`tests/*_checks.py`, one line "ok ..." or "FAIL ..." per check, then "ALL CHECKS
    PASSED") launched as `torchrun --standalone --nproc_per_node=nproc` would (forked, as torchrun() is):
    its "ok" lines, once every check passed."""
    rc, out = forked(script, nproc, timeout=timeout)
    assert rc == 0 and "ALL CHECKS PASSED" in out and not re.search(r"^FAIL", out, re.M), out[
        -6000:
    ]
    return [l for l in out.splitlines() if l.startswith("ok ")]


_server = None


def forked(script, nproc, *args, timeout=240, max_restarts=0, mode="torchrun"):
    """Run `script args` in nproc workers forked by tests/forkserver.py, as torchrun would start them
    (workers stopped when one fails, restarted up to max_restarts times); returns (exit code, stdout + stderr).
    A launch past `timeout` is killed and fails the test, like subprocess.run's timeout. mode "plain" is
    `python script args`, "ranks" run_ranks()'s workers: those return (reply, read: a file name -> its text)."""
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "forkserver.py")],
            env=ENV,
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
    d = Path(tempfile.mkdtemp())
    req = dict(
        mode=mode,
        script=str(ROOT / script),
        args=list(map(str, args)),
        nproc=nproc,
        env=ENV,
        cwd=str(ROOT),
        out=str(d / "out"),
        err=str(d / "err"),
        timeout=timeout,
        max_restarts=max_restarts,
    )
    _server.stdin.write(json.dumps(req) + "\n")
    _server.stdin.flush()
    line = _server.stdout.readline()
    assert line, "tests/forkserver.py died"
    reply, texts = json.loads(line), {f.name: f.read_text() for f in d.iterdir()}
    shutil.rmtree(d)
    read = lambda name: texts.get(name, "")
    if reply["timed_out"]:
        raise subprocess.TimeoutExpired([script, *args], timeout, output=read("out") + read("err"))
    if mode != "torchrun":
        return reply, read
    return reply["rc"], read("out") + read("err")


def passed(lines, *words):
    """The checks' lines that name all `words` (each line "ok ..." or the launch would have failed)."""
    return [l for l in lines if all(w in l for w in words)]


def free_port():
    """A port nobody listens on now, for a rendezvous endpoint a test picks itself (two "nodes")."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_python(script, *args, timeout=60):
    """Plain `python script args` (world size 1): for exit codes, which torchrun would rewrite. Forked from
    the warm interpreter too; returns what subprocess.run would (returncode, stdout, stderr)."""
    reply, read = forked(script, 1, *args, timeout=timeout, mode="plain")
    return subprocess.CompletedProcess([script, *args], reply["codes"][0], read("out"), read("err"))


def torchrun_bad_input(script, nproc, *args, timeout=60):
    """A bad-input launch: returns the completed process; each worker must say one line and exit 2
    (torchrun itself reports the failure as exit 1)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(ROOT / script),
        *map(str, args),
    ]
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def run_ranks(script, nproc, *args, timeout=60):
    """The workers of a would-be `torchrun --nproc_per_node=nproc` launch, with RANK and WORLD_SIZE set but
    no rendezvous: a collective would crash them, so a clean exit 2 proves each rank checked its input first.
    Unlike a torchrun launch, where the agent SIGTERMs the slower workers once the first exits, every rank's
    own exit code is observable. Returns [(returncode, stdout + stderr)]."""
    reply, read = forked(script, nproc, *args, timeout=timeout, mode="ranks")
    return [(c, read(f"out.{r}") + read(f"err.{r}")) for r, c in enumerate(reply["codes"])]


def assert_each_rank_fails(results, words):
    """Every rank of run_ranks() printed exactly one line, naming its rank and the problem, and exited 2."""
    for r, (rc, out) in enumerate(results):
        lines = out.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and f"error (rank {r})" in lines[0], (rc, out)
        assert all(w in lines[0] for w in words), lines[0]


def assert_bad_input(p, nproc, words):
    """Every rank printed one `error` line naming the problem and exited 2 (torchrun's report lists each
    worker's exit code; torchrun itself exits 1), with no Python traceback from a worker."""
    out = p.stdout + p.stderr
    lines = [l for l in out.splitlines() if "error (rank" in l]
    # every rank checks before any collective; under torchrun the first to exit may get the others
    # killed before they print, so at least one line, and all the lines say the same thing
    assert 1 <= len(lines) <= nproc and len({l.split("): ", 1)[1] for l in lines}) == 1, out
    assert all(w.lower() in lines[0].lower() for w in words), lines[0]
    if nproc == 1 and "torch.distributed.elastic" not in out:
        assert p.returncode == 2, out
    else:
        # once one worker exits 2, torchrun may SIGTERM the others before they exit 2 themselves (-15)
        codes = re.findall(r"exitcode\s*:\s*(-?\d+) ", out)
        assert p.returncode == 1 and "2" in codes and set(codes) <= {"2", "-15"}, out
    worker_text = out.split("torch/distributed/elastic")[0]
    assert "Traceback" not in worker_text, out


def assert_matches_reference(summary, tol=1e-9):
    c = summary["check"]
    assert c is not None and c["passed"], c
    assert c["max_loss_diff"] <= tol and c["max_param_diff"] <= tol, c


# ----------------------------------------------------------------------------- pipelines (gpipe.py, pipedream.py)
def pipeline_schedule_errors(events, p, n):
    """Measured events `{rank, kind: F|B, mb, start, end}` against every pipeline's rules for micro-batches
    0..n-1: one F and one B per (stage, micro-batch), never two at once on a stage, F before B, F flows down
    (stage s+1 starts F_k after stage s ended it), B flows back up (stage s starts B_k after stage s+1 ended
    it), and B runs in F's order. Returns the broken rules (empty: all kept)."""
    ev = {(e["rank"], e["kind"], e["mb"]): e for e in events}
    if len(events) != 2 * p * n or set(ev) != {
        (r, k, i) for r in range(p) for k in "FB" for i in range(n)
    }:
        return ["not exactly one F and one B per stage and micro-batch"]
    errors = []
    for r in range(p):
        mine = sorted((e for e in events if e["rank"] == r), key=lambda e: e["start"])
        errors += [
            f"stage {r}: {b['kind']}{b['mb']} overlaps {a['kind']}{a['mb']}"
            for a, b in zip(mine, mine[1:])
            if b["start"] < a["end"]
        ]
        bs = [e["mb"] for e in mine if e["kind"] == "B"]
        if bs != sorted(bs):
            errors.append(f"stage {r}: backwards out of order")
        for i in range(n):
            f, b = ev[r, "F", i], ev[r, "B", i]
            if not f["start"] <= f["end"] <= b["start"] <= b["end"]:
                errors.append(f"stage {r}: B{i} starts before F{i} ends")
            if r > 0 and f["start"] < ev[r - 1, "F", i]["end"]:
                errors.append(f"stage {r}: F{i} starts before stage {r - 1} ends it")
            if r < p - 1 and b["start"] < ev[r + 1, "B", i]["end"]:
                errors.append(f"stage {r}: B{i} starts before stage {r + 1} ends it")
    return errors


def simulate_p2p_plans(plans, needs, producer, slots, local=lambda msg: False):
    """Run every rank's communication plan (steps ("op", op) and ("p2p", sends, recvs), each a list of (peer,
    message)) under NCCL's strictest semantics: a batch completes only once every send and receive in it meets
    its partner in a batch the peer has posted; each directed pair is one FIFO channel (messages received in
    the order sent). An op takes slots[kind]; `needs(op)` is the message it waits for (None: none), made by
    the op `producer(msg)`; an input made on the same rank (`local(msg)`, the turn of a V) must have been made
    earlier by that rank. Returns (idle slots per rank, forward messages sent per rank), or raises
    AssertionError on a deadlock or a mismatched message (ptdp.py's and zero_bubble.py's plans)."""
    p, sends, recvs = len(plans), {}, {}
    for r, plan in enumerate(plans):
        for i, (kind, *what) in enumerate(plan):
            if kind == "p2p":
                for q, msg in what[0]:
                    sends.setdefault((r, q), []).append((msg, i))
                for q, msg in what[1]:
                    recvs.setdefault((q, r), []).append((msg, i))
    partner = {}
    for (a, b), out in sends.items():
        if [msg for msg, _ in out] != [msg for msg, _ in recvs.get((a, b), [])]:
            raise AssertionError(
                f"channel {a}->{b}: sent {out} but received {recvs.get((a, b), [])}"
            )
        for (msg, i), (_, j) in zip(out, recvs[a, b]):
            partner[a, i, msg], partner[b, j, msg] = (b, j), (a, i)
    posted, pos, busy, done, ran = [{0: 0} for _ in range(p)], [0] * p, [0] * p, set(), set()
    while True:
        moved = False
        for r in range(p):
            if pos[r] == len(plans[r]):
                continue
            kind, *what = plans[r][pos[r]]
            t = posted[r][pos[r]]
            if kind == "p2p":
                peers = [partner[r, pos[r], msg] for _, msg in what[0] + what[1]]
                if any(j not in posted[q] for q, j in peers):
                    continue
                t = max([t] + [posted[q][j] for q, j in peers])
                done.update(msg for _, msg in what[1])
            else:
                op = what[0]
                need = needs(op)
                if need is not None and local(need):
                    assert (r, producer(need)) in ran, (
                        f"rank {r}: {op} runs before its own producer"
                    )
                else:
                    assert need is None or need in done, (
                        f"rank {r}: {op} runs before its input arrived"
                    )
                t += slots[op[0]]
                busy[r] += slots[op[0]]
                ran.add((r, op))
            posted[r][pos[r] + 1], pos[r], moved = t, pos[r] + 1, True
        if not moved:
            break
    if pos != [len(plan) for plan in plans]:
        raise AssertionError(f"deadlock: ranks stopped at steps {pos} of {[len(x) for x in plans]}")
    end = max(posted[r][len(plans[r])] for r in range(p))
    fwd = [
        sum(1 for k, *w in plans[r] if k == "p2p" for _, msg in w[0] if msg[0] == "F")
        for r in range(p)
    ]
    return [end - b for b in busy], fwd
