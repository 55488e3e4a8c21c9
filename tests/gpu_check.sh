#!/usr/bin/env bash
# The check for a machine with GPUs (the pytest suite always runs on CPU): every technique file at world 1
# on CUDA, and at world = number of GPUs where there are at least 2, in float32 and bfloat16 with --check;
# then a run killed at step 5 and restarted by torchrun, against the uninterrupted run. One line per run
# with its check figures; exit 1 if any run fails. About 2-4 minutes on one GPU.
#   bash tests/gpu_check.sh          # on a GPU machine; without a GPU it says so and exits 0
#   bash tests/gpu_check.sh --cpu    # the same runs on gloo + CPU at worlds 1 and 2 (to try the script itself)
set -u
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
py=${PYTHON:-python}
if [ "${1:-}" = "--cpu" ]; then
  export CUDA_VISIBLE_DEVICES=""
  worlds="1 2"
else
  n=$($py -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
  if [ "$n" = 0 ]; then
    echo "gpu_check: no CUDA GPU visible to torch: nothing to check (skipped)"
    exit 0
  fi
  $py -c "import torch; print('gpu_check:', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0), '| torch', torch.__version__)"
  worlds="1"; [ "$n" -ge 2 ] && worlds="1 $n"
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
failed=0
# a small model that every layout below can split (4 layers, 4 heads, batch 8 = 8 micro-batches)
small="--steps 10 --batch-size 16 --seq-len 32 --d-model 64 --n-heads 4 --n-layers 4 --vocab 64"

flags_for() {  # per-file flags that make a world of $2 legal (pipelines need >= 2 ranks: "" = skip)
  local w=$2 h=$(( $2 > 4 ? $2 : 4 ))
  case "$1" in
    gpipe.py|pipedream.py|ptdp.py) [ "$w" -lt 2 ] && { echo skip; return; } ;;
  esac
  case "$1" in
    ptdp.py) echo "--pp $w --tp 1 --dp 1 --virtual-stages 1 --microbatches 4 --n-layers $((2 * w))" ;;
    gpipe.py|pipedream.py) echo "--microbatches 4 --n-layers $((2 * w))" ;;
    megatron_tp.py) echo "--tp $w --n-heads $h" ;;
    moe.py) echo "--ep $w --experts $((2 * w))" ;;
    zero.py) echo "--stage 3" ;;
    *) echo "" ;;
  esac
}

run() {  # run NAME CMD...: one line with the check figures, the tail of the output on failure
  local name=$1; shift
  local out rc
  out=$(timeout 300 "$@" 2>&1); rc=$?
  local check
  check=$(grep -o "max rel loss diff.*" <<<"$out" | tail -n 1)
  printf '%-44s %s  %s\n' "$name" "$([ $rc = 0 ] && echo ok || echo "FAILED (exit $rc)")" "$check"
  if [ $rc != 0 ]; then failed=1; tail -n 15 <<<"$out" | sed 's/^/    | /'; fi
}

for f in dp.py ddp_bucketed.py gpipe.py pipedream.py megatron_tp.py ptdp.py moe.py zero.py; do
  [ -f "$f" ] || { echo "$f: not in this checkout (skipped)"; continue; }
  for w in $worlds; do
    flags=$(flags_for "$f" $w)
    if [ "$flags" = skip ]; then
      printf '%-44s %s\n' "$f world $w" "skipped: a pipeline needs one GPU per stage, at least 2"
      continue
    fi
    for dt in float32 bfloat16; do
      run "$f world $w $dt" $py -m torch.distributed.run --standalone --nproc_per_node=$w "$f" $small $flags \
        --dtype "$dt" --check
    done
  done
done
# moe.py's layer checks (dispatch/combine, EP invariance) on the device, world 1
[ -f tests/moe_checks.py ] && run "tests/moe_checks.py world 1" $py tests/moe_checks.py

# resume after a kill: torchrun restarts the killed run from its step-4 checkpoint; its losses must equal
# an uninterrupted run's (float32 on the GPU: equal to a few ulps at most, printed)
for f in dp.py zero.py; do
  run "$f uninterrupted" $py -m torch.distributed.run --standalone --nproc_per_node=1 "$f" $small $(flags_for "$f" 1) \
    --steps 8 --json "$tmp/$f.full.json"
  run "$f killed at 5, restarted" $py -m torch.distributed.run --standalone --nproc_per_node=1 --max-restarts=1 "$f" \
    $small $(flags_for "$f" 1) --steps 8 --ckpt-dir "$tmp/ck-$f" --save-every 2 --fail-at-step 5 --json "$tmp/$f.restart.json"
  $py - "$tmp/$f.full.json" "$tmp/$f.restart.json" "$f" <<'PY' || failed=1
import json, sys
a, b = (json.load(open(p))["losses"] if __import__("os").path.exists(p) else None for p in sys.argv[1:3])
ok = a is not None and b is not None and len(a) == len(b)
diff = max(abs(x - y) / abs(x) for x, y in zip(a, b)) if ok else float("nan")
ok = ok and diff <= 1e-5
print(f"{sys.argv[3] + ' restart == uninterrupted':44s} {'ok' if ok else 'FAILED'}  max rel loss diff {diff:.3e} (tolerance 1e-05)")
sys.exit(0 if ok else 1)
PY
done

[ $failed = 0 ] && echo "gpu_check: all runs passed" || echo "gpu_check: SOME RUNS FAILED"
exit $failed
