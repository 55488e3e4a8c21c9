"""ft_launcher.py: the supervisor of fault_tolerance.py's replicas, a tool apart from the lesson.

`python fault_tolerance.py --replicas R ...` starts it (the file's one-line default when it is not a
replica): it holds the coordinator, a torch TCPStore server (torchft's lighthouse, which torchft
runs apart from the trainers: the single point of the design), and starts R replica processes, each
`python fault_tolerance.py ... --coordinator host:port --replica r --life n`, as torchrun's agent (a
cluster's scheduler in production) would. It restarts a replica killed by a signal (`--recipe
restart`: it kills and restarts all of them, the 2020 way), and adds its own record (every pid it
started, the restarts, the exit codes) to the run's --json. It decides nothing about the protocol:
each replica's lease on the coordinator is what the rounds, the votes and the groups read. It
records each death it sees (`died/n` on the coordinator) only for the recovery figures the run
prints.

The replicas' environment: TORCH_NCCL_ASYNC_ERROR_HANDLING=0 and TORCH_NCCL_ENABLE_MONITORING=0 (the
watchdog, which by default takes the *healthy* process down at the group's timeout, and the
heartbeat monitor, which would kill one whose watchdog hangs in an abort, must not decide);
TORCH_NCCL_NONBLOCKING_TIMEOUT=--timeout (torch waits for a non-blocking NCCL communicator's init by
it alone, 30 minutes by default: NCCL review 4, N4-2); torch's C++ warnings (a 14-line stack per
peer gone) quieted: a failure is the one line the replica prints.
"""

import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from common import fail


def environment(timeout_s):
    """What the replicas run with, beside the launcher's own environment (the docstring says
    why)."""
    return dict(
        TORCH_NCCL_ASYNC_ERROR_HANDLING="0",
        TORCH_NCCL_ENABLE_MONITORING="0",
        TORCH_NCCL_NONBLOCKING_TIMEOUT=str(int(timeout_s)),
        TORCH_CPP_LOG_LEVEL="ERROR",
    )


def stop_all(lives, r, store):
    """--recipe restart: replica r died; the launcher kills every other one too. Returns whom to
    restart. The dead job's undecided rounds are closed and aborted for it: one killed between
    counting itself in and writing its slot would leave a round whose members no one can read, and
    the restarted job reads the decision before its first round."""
    for q, procs in lives.items():
        if q != r and procs[-1].poll() is None:
            procs[-1].kill()
            procs[-1].wait()
    k = 0
    while store.check([f"q{k}/decision"]):  # rounds decide in order
        k += 1
    version = int(store.get(f"q{k - 1}/decision").split()[1]) if k else 0
    while store.check([f"q{k}/n"]):  # every round the dead job checked in to, undecided
        store.compare_set(f"q{k}/size", "", "0")  # (closed with none, where it had not closed)
        store.compare_set(f"q{k}/decision", "", f"abort {version}")
        k += 1
    return list(lives)


def launch(args, script=None):
    """The coordinator and R replica processes of `script` (by default this process's own,
    sys.argv[0], with its own flags): restarts a replica killed by a signal, up to --max-restarts;
    returns the run's exit code (a replica's error, or 1 when the run did not finish)."""
    if args.max_restarts < 0:  # (its own flag: fault_tolerance.check_args checks the replicas')
        fail(f"--max-restarts must be >= 0, got {args.max_restarts}")
    print(
        f"fault_tolerance.py: {args.replicas} replicas, recipe {args.recipe}, coordinator in this "
        f"process (pid {os.getpid()}) on {args.host}",
        flush=True,
    )
    store = dist.TCPStore(
        args.host,
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=args.timeout),
    )
    store.set("round", "0")  # the newest round closed: where a replica begins to look
    cmd = [sys.executable, script or sys.argv[0], *sys.argv[1:]]
    cmd += ["--coordinator", f"{args.host}:{store.port}"]
    env = dict(os.environ, **environment(args.timeout))

    def spawn(r, life):
        return subprocess.Popen(cmd + ["--replica", str(r), "--life", str(life)], env=env)

    R = args.replicas
    lives = {r: [spawn(r, 0)] for r in range(R)}
    codes = {}
    restarts = 0
    t0 = time.time()
    done_at = None
    limit_s = 300 + args.timeout * (args.steps + 10)  # (every wait of a replica is bounded: a net)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` kills the children
    try:
        while len(codes) < R and (done_at or time.time() - t0 < limit_s):
            for r, procs in lives.items():
                code = procs[-1].poll()
                if code is None or r in codes:
                    continue
                finished = store.check(["finished"])
                if code != 0 and not finished:  # every death seen, for the figures
                    store.set(f"died/{store.add('died', 1)}", f"{r} {time.time()!r}")
                if code < 0 and restarts < args.max_restarts and not finished:
                    restarts += 1
                    for q in [r] if args.recipe == "live" else stop_all(lives, r, store):
                        lives[q].append(spawn(q, len(lives[q])))
                else:
                    codes[r] = code
            done_at = done_at or (time.time() if store.check(["finished"]) else None)
            # a frozen replica: the run is over
            if done_at and time.time() - done_at > args.timeout:
                for r in [r for r in lives if r not in codes]:
                    print(
                        f"fault_tolerance.py: replica {r} still running {args.timeout:g} s after "
                        "the run finished (frozen?): stopped",
                        flush=True,
                    )
                    lives[r][-1].kill()
                    codes[r] = lives[r][-1].wait()
            time.sleep(0.01)
    finally:
        for p in [p for procs in lives.values() for p in procs if p.poll() is None]:
            p.kill()
            p.wait()
    if len(codes) < R:
        print(
            f"fault_tolerance.py: error: over {limit_s} s; every replica stopped", file=sys.stderr
        )
    finished = store.check(["finished"])  # (a replica killed and not restarted is no failure)
    rc = max([c for c in codes.values() if c > 0], default=0)
    rc = rc or (0 if finished and len(codes) == R else 1)
    add_launcher_figures(args, lives, codes, restarts, time.time() - t0)
    return rc


def add_launcher_figures(args, lives, codes, restarts, wall_s):
    """The launcher's own record in --json: every process it started (the healthy ones keep one
    pid)."""
    if not args.json or not os.path.exists(args.json):
        return
    with open(args.json) as f:
        summary = json.load(f)
    summary["launcher"] = dict(
        pid=os.getpid(),
        pids={r: [p.pid for p in ps] for r, ps in lives.items()},
        restarts=restarts,
        exit_codes=codes,
        wall_s=wall_s,
    )
    with open(args.json + ".tmp", "w") as f:
        json.dump(summary, f, indent=1)
    os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":  # the same as `python fault_tolerance.py ...`
    import fault_tolerance

    args = fault_tolerance.parse_args(fault_tolerance.Args)
    fault_tolerance.check_args(args)
    sys.exit(
        launch(args, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fault_tolerance.py"))
    )
