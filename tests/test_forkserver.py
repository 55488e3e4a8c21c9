"""The suite's launcher (tests/forkserver.py) against torchrun itself: a launch forked from the warm interpreter
must be indistinguishable, to the file it runs, from `torchrun --standalone`, and must keep torchrun's agent
behaviour the tests rely on (a failed worker stops the rest, restarts, a bounded wait)."""

import os
import subprocess
import time

import pytest

from helpers import TINY, forked, torchrun

TIMING = {"step_ms", "tokens_per_s"}


def same_run(a, b):
    """Two --json summaries of one configuration, without the wall-clock figures and the path they went to."""
    strip = lambda s: (
        {k: v for k, v in s.items() if k not in TIMING | {"config"}}
        | {"config": {k: v for k, v in s["config"].items() if k != "json"}}
    )
    return strip(a) == strip(b)


def test_forked_launch_equals_torchrun(tmp_path):
    """dp.py at world 3 with accumulation on ragged data and --check: the same summary, to the bit (losses,
    the counted bytes and all-reduces, the live-storage peak, the check's differences), from torchrun and
    from the fork server. A different configuration (world 2) is told apart, so the comparison can fail."""
    args = [*TINY, "--accum", "2", "--ragged", "--check"]
    real, _ = torchrun("dp.py", 3, *args, tmp_path=tmp_path, real=True, name="real")
    fork, _ = torchrun("dp.py", 3, *args, tmp_path=tmp_path, name="fork")
    other, _ = torchrun("dp.py", 2, *args, tmp_path=tmp_path, name="other")
    assert real["world_size"] == fork["world_size"] == 3 and real["check"]["passed"]
    assert same_run(real, fork), (real, fork)
    assert not same_run(real, other)


AGENT = """
import os, sys, time
rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"pid {os.getpid()} rank {rank}/{os.environ['WORLD_SIZE']} attempt {attempt} argv {sys.argv[1:]}", flush=True)
if sys.argv[1] == "hang" or (rank == 0 and attempt == 0):
    time.sleep(60)
sys.exit(3 if rank == 1 and attempt == 0 else 0)
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return open(f"/proc/{pid}/stat").read().split()[2] != "Z"


def pids(out):
    return [int(l.split()[1]) for l in out.splitlines() if l.startswith("pid ")]


def test_forkserver_keeps_torchrun_agent_behaviour(tmp_path):
    """Rank 1 exits 3 while rank 0 sleeps: the launch ends at once with exit 1 and rank 0 stopped (as
    torchrun's agent does); with one restart both run again with TORCHELASTIC_RESTART_COUNT 1 and succeed;
    a worker that never ends is killed at the timeout. No worker is left behind in any case."""
    script = tmp_path / "agent.py"
    script.write_text(AGENT)
    t = time.monotonic()
    rc, out = forked(str(script), 2, "fail", timeout=30)
    assert rc == 1 and time.monotonic() - t < 15 and "rank 1/2 attempt 0 argv ['fail']" in out, out
    rc, out2 = forked(str(script), 2, "fail", timeout=30, max_restarts=1)
    assert rc == 0 and "rank 0/2 attempt 1" in out2 and "rank 1/2 attempt 1" in out2, out2
    with pytest.raises(subprocess.TimeoutExpired) as e:
        forked(str(script), 2, "hang", timeout=3)
    assert not any(alive(p) for p in pids(out) + pids(out2) + pids(e.value.output)), (out, out2)
