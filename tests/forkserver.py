"""What `torchrun --standalone --nproc_per_node=N script args` does for a test, from one warm interpreter.

torchrun's agent does two things a worker can see: it sets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT (and TORCHELASTIC_RESTART_COUNT on a restart), and it starts N fresh Python processes
that run the script. On a 2-core machine most of a tiny launch is those N + 1 interpreters importing torch
(about 3.5 CPU-seconds each). This server imports torch once, then forks each worker from itself: the worker
sees the same environment variables, the same `sys.argv` and `__main__` as under torchrun, imports the repo's
own modules fresh, and rendezvous the same way (`common.init_dist`: rank 0 hosts the TCPStore, as it does
under torchrun without the agent's store). The agent's other behaviour is kept too: when a worker fails the
others are stopped (SIGTERM, then SIGKILL) and the launch exits 1; with `max_restarts` every worker is
started again with TORCHELASTIC_RESTART_COUNT one higher. `tests/test_forkserver.py` launches one configuration
both ways and requires the same summary to the bit.

Protocol: one JSON request per line on stdin {mode, script, args, nproc, env, cwd, out, err, timeout,
max_restarts}; one JSON reply per line on stdout {rc, codes, timed_out}. Mode "torchrun" is the above, its
workers writing to the files `out` and `err` (appended, as torchrun's workers share its terminal); "plain" is
`python script args` (nproc 1, no torchrun variables); "ranks" sets the variables for nproc workers but
stops none when one fails, and each writes to `out.RANK` / `err.RANK`."""

import json
import os
import signal
import socket
import sys
import time

import torch
import torch.distributed  # noqa: F401  (the imports every worker would repeat)
import torch.distributed.fsdp
import torch.distributed.pipelining
import torch.distributed.tensor  # noqa: F401
import torch.nn.parallel
import torch.optim  # noqa: F401


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(req, rank, attempt, port):
    """Fork one worker; in the child, run the script as `__main__` and never return."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    try:
        os.setpgid(0, 0)
        os.close(REPLY_FD)
        null = os.open(os.devnull, os.O_RDONLY)
        # each rank's own output, or one shared
        suffix = f".{rank}" if req["mode"] == "ranks" else ""
        out = os.open(req["out"] + suffix, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        err = os.open(req["err"] + suffix, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.environ.clear()
        os.environ.update(req["env"])
        # what torchrun's agent sets ("ranks": the same, with no rendezvous behind it)
        if req["mode"] != "plain":
            os.environ.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                GROUP_RANK="0",
                WORLD_SIZE=str(req["nproc"]),
                LOCAL_WORLD_SIZE=str(req["nproc"]),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                TORCHELASTIC_RESTART_COUNT=str(attempt),
                TORCHELASTIC_RUN_ID=f"forkserver{port}",
            )
        os.chdir(req["cwd"])
        script = os.path.abspath(req["script"])
        sys.argv = [script, *req["args"]]
        sys.path[0] = os.path.dirname(script)
        sys.stdin = open(os.devnull)
        sys.stdout = open(1, "w", buffering=1, closefd=False)
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        import runpy

        code = 0
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
        except BaseException:
            import traceback

            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException:
        code = 1
    os._exit(code)


def stop(pids, sig):
    for p in pids:
        try:
            os.killpg(p, sig)
        except ProcessLookupError:
            pass


def launch(req):
    """Start the workers, wait for them all; on a failure stop the rest and, if restarts remain, start over."""
    deadline = time.monotonic() + req["timeout"]
    for attempt in range(req.get("max_restarts", 0) + 1):
        port = free_port()
        pids = [start_worker(req, r, attempt, port) for r in range(req["nproc"])]
        codes, failed_at = {}, None
        while len(codes) < len(pids):
            for p in pids:
                if p not in codes:
                    done, status = os.waitpid(p, os.WNOHANG)
                    if done:
                        codes[p] = os.waitstatus_to_exitcode(status)
                        if codes[p] != 0 and failed_at is None and req["mode"] == "torchrun":
                            failed_at = time.monotonic()
                            stop([q for q in pids if q not in codes], signal.SIGTERM)
            if time.monotonic() > deadline or (failed_at and time.monotonic() - failed_at > 5):
                stop([q for q in pids if q not in codes], signal.SIGKILL)
                for p in pids:
                    if p not in codes:
                        codes[p] = os.waitstatus_to_exitcode(os.waitpid(p, 0)[1])
                if time.monotonic() > deadline:
                    return {"rc": 1, "codes": [codes[p] for p in pids], "timed_out": True}
            time.sleep(0.01)
        result = [codes[p] for p in pids]
        if all(c == 0 for c in result):
            return {"rc": 0, "codes": result, "timed_out": False}
    return {"rc": 1, "codes": result, "timed_out": False}


if __name__ == "__main__":
    REPLY_FD = os.dup(1)
    reply = os.fdopen(REPLY_FD, "w", buffering=1)
    os.dup2(2, 1)  # nothing but replies on the reply pipe
    for line in sys.stdin:
        reply.write(json.dumps(launch(json.loads(line))) + "\n")
