#!/usr/bin/env bash
# The GEMMs of all-gather-matmul and matmul-reduce-scatter alone on one GPU, in one go (at most 8
# minutes): the single-GPU tests of both kernels' GEMM alone (the table's config and every swept config
# against torch.matmul, bf16), then both benchmarks' --gemm-alone with their sweeps. Each step is bounded
# by a timeout and logged; a failing step is reported and the next one run anyway. Results land in
# benchmarks/results/ (<op>_gemm-<device>, <op>_gemm_sweep-<device>) and are copied with the logs to $OUT.
#
#   OUT=/tmp/gemm benchmarks/run_gemm_alone.sh            # tests, ag, rs
#   benchmarks/run_gemm_alone.sh ag                      # the named steps, in the order given
#
# Steps: tests, ag, rs (the default), and shared: the all-gather-matmul's two-rank GPU tests (the
# flattened loop's wait under real copies included) with both ranks on this GPU (parallel/shared_gpu.py).
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
OUT=${OUT:-runs/gemm_alone}
ITERS=${ITERS:-30}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
failed=0

step() {  # name, seconds, command...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc after $((SECONDS - start)) s (log $OUT/$name.log)" | tee -a "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || failed=1
}

nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,memory.total --format=csv >"$OUT/gpu.csv" 2>&1
for name in "${@:-tests ag rs}"; do
  for s in $name; do
    case "$s" in
      tests) step tests 150 "$PY" -m pytest -q -p no:cacheprovider -m gpu -k gemm_alone \
               tests/test_ag_matmul.py tests/test_matmul_rs.py ;;
      ag) step ag 180 "$PY" -m benchmarks.bench_ag_matmul --gemm-alone --sweep --iters "$ITERS" ;;
      rs) step rs 150 "$PY" -m benchmarks.bench_matmul_rs --gemm-alone --sweep --iters "$ITERS" ;;
      shared) step shared 240 "$PY" -m parallel.shared_gpu --ranks 2 -- "$PY" -m pytest -q -p no:cacheprovider \
                -m multigpu -k "test_ag_matmul_gpu and 2" tests/test_ag_matmul.py ;;
      *) echo "unknown step $s (tests, ag, rs, shared)"; exit 2 ;;
    esac
  done
done
cp benchmarks/results/ag_matmul_gemm*-* benchmarks/results/matmul_rs_gemm*-* "$OUT"/ 2>/dev/null
cat "$OUT/summary.txt"
exit "$failed"
