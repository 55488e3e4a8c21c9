"""Run a technique file with one fault injected into its last rank, on torchrun's first attempt only:

    torchrun ... tests/fault_wrapper.py FAULT FILE.py ARGS...

FAULT is one of
    die-mid-save:N        the checkpoint of step N is written to its temporary file, then the rank dies
                          before the rename (a crash in the middle of a save)
    kill-collective:K     the rank SIGKILLs itself on entering its K-th all_reduce (peers are inside it)
    raise-collective:K    the rank raises on entering its K-th all_reduce
    kill-p2p:K            the rank SIGKILLs itself on entering its K-th batch_isend_irecv
The file itself runs unchanged (runpy), so what is tested is the file's own checkpointing and shutdown."""

import os
import runpy
import signal
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
fault, script, args = sys.argv[1], sys.argv[2], sys.argv[3:]
kind, n = fault.split(":")
n = int(n)
victim = (
    int(os.environ.get("RANK", "0")) == int(os.environ.get("WORLD_SIZE", "1")) - 1
    and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
)

if victim and kind == "die-mid-save":
    real_replace = os.replace

    def replace(src, dst):
        if os.path.basename(str(dst)) == f"step{n}.pt":
            print(
                f"fault_wrapper: rank dies after writing {src}, before renaming it",
                file=sys.stderr,
                flush=True,
            )
            os._exit(13)
        return real_replace(src, dst)

    os.replace = replace
elif victim and kind in ("kill-collective", "raise-collective", "kill-p2p"):
    name = "batch_isend_irecv" if kind == "kill-p2p" else "all_reduce"
    real, calls = getattr(dist, name), [0]

    def faulty(*a, **k):
        calls[0] += 1
        if calls[0] == n:
            print(f"fault_wrapper: {kind} in call {n} of {name}", file=sys.stderr, flush=True)
            if kind == "raise-collective":
                raise RuntimeError(f"fault_wrapper: injected failure in {name}")
            os.kill(os.getpid(), signal.SIGKILL)
        return real(*a, **k)

    setattr(dist, name, faulty)

sys.path.insert(0, str(ROOT))
sys.argv = [str(ROOT / script), *args]
runpy.run_path(str(ROOT / script), run_name="__main__")
