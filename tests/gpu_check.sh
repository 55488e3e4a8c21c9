#!/usr/bin/env bash
# The check for a machine with GPUs (the pytest suite always runs on CPU): every mode of every file at world 1
# and at world = number of GPUs, with --check, a bf16 pass under TORCH_DISTRIBUTED_DEBUG=DETAIL, restarts, and
# the async parameter server's overlap; one line per run, exit 1 if any fails. The plan: tests/gpu_check.py.
#   bash tests/gpu_check.sh          # on a GPU machine (about 10 minutes on 8 GPUs); no GPU: skipped, exit 0
#   bash tests/gpu_check.sh --cpu    # the same plan on gloo + CPU at worlds 1 and 2, stragglers at world 3
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python}" tests/gpu_check.py "$@"
