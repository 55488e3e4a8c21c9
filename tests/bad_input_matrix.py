"""Run many bad-input cases of the technique files in one process, each as its own rank would meet it:

    python tests/bad_input_matrix.py CASES.json  ->  one JSON line per case: {"code", "stderr", "stdout"}

A case is {"file", "world", "rank", "argv"} (and "torchrun": true to set RANK etc. at world 1 too). With world > 1, RANK/WORLD_SIZE/LOCAL_RANK are set but there is
no rendezvous (no MASTER_ADDR): a rank that reached a collective, or init_dist, would crash instead of
exiting 2, so exit code 2 with one line proves the check came first. With world 1 there is no RANK, so a
case may get as far as init_dist (a one-process group) and the checkpoint checks behind it."""

import contextlib
import importlib.util
import io
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
modules = {}


def load(file):
    if file not in modules:
        name = "matrix_" + Path(file).stem
        spec = importlib.util.spec_from_file_location(name, ROOT / file)
        mod = importlib.util.module_from_spec(spec)
        # parse_args reads the module's docstring and its Args source through it
        sys.modules[name] = mod
        spec.loader.exec_module(mod)

        def no_exit(ok=True):  # a case that passed every check must not os._exit this runner
            raise RuntimeError("the run went through: no error was raised")

        mod.close_dist = no_exit
        sys.modules["harness"].close_dist = no_exit  # harness.Run.finish ends a run through it
        modules[file] = mod
    return modules[file]


for case in json.load(open(sys.argv[1])):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    # as torchrun starts it (torchrun sets them at world 1 too)
    if case["world"] > 1 or case.get("torchrun"):
        os.environ.update(
            RANK=str(case["rank"]), LOCAL_RANK=str(case["rank"]), WORLD_SIZE=str(case["world"])
        )
    mod = load(case["file"])
    sys.argv = [str(ROOT / case["file"]), *case["argv"]]
    out, err, code = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            mod.main()
            code = 0
        except SystemExit as e:
            code = e.code
        except BaseException as e:  # noqa: BLE001 - reported, the test fails on it
            code, _ = "crash", err.write(f"crash: {type(e).__name__}: {e}\n")
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(dict(code=code, stderr=err.getvalue(), stdout=out.getvalue())), flush=True)
