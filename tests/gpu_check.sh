#!/usr/bin/env bash
# The check for a machine with GPUs (the pytest suite always runs on CPU), sized to the GPUs and the minutes
# at hand; one line per run, exit 1 if any fails, 2 on a bad flag. The plan and its flags: tests/gpu_check.py.
#   bash tests/gpu_check.sh --one-gpu      # one GPU: the CUDA-only paths at world 1 (43 launches, 7-9 min)
#   bash tests/gpu_check.sh                # N GPUs: world N's plan, then the one-GPU plan (~34 min at 8)
#   bash tests/gpu_check.sh --minutes 14   # N GPUs in a 15-minute lease: the runs covering the most first
#   bash tests/gpu_check.sh --world 4 --only zero.py,moe.py --minutes 10    # a slice, within a budget
#   bash tests/gpu_check.sh --cpu --one-gpu    # the same plan on gloo + CPU (no GPU, no --cpu: skipped)
cd "$(dirname "$0")/.." || exit 1
exec "${PYTHON:-python}" tests/gpu_check.py "$@"
