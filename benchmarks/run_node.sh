#!/usr/bin/env bash
# Every GPU test and benchmark of weft on the GPUs of this node, in the order a fresh node should run
# them: each step bounded by a timeout and logged, a failing step reported and the next one run anyway,
# a summary of the steps (exit status, seconds) at the end. Results land in benchmarks/results/.
#
#   benchmarks/run_node.sh                    # every step
#   benchmarks/run_node.sh tests ag rs        # the named steps, in the order given
#   STEP_TIMEOUT=300 LOG_DIR=/tmp/logs benchmarks/run_node.sh a2a
#   TEST_TIMEOUT=120 benchmarks/run_node.sh tests      # per test, where pytest-timeout is installed
#   DEADLINE=570 OUT=/tmp/out benchmarks/run_node.sh tests ag rs a2a ar   # one call of at most 10 minutes
#
# DEADLINE (seconds from the start): no step runs past it (each step's timeout is cut to what is left, a
# step with under a minute left is skipped), so a machine lent by the call never outlives its limit.
# OUT: a folder that receives node-results.tar, the result files this run wrote and its logs.
# On a lent 4-GPU machine, calls of at most 10 minutes take the four-GPU run in five. On 4x H200
# (2026-11-26) ag took 19 s, rs 17 s, a2a 34 s, ar 34 s, train 37 s and decode 325 s; on 4x H100
# (2026-11-26/27) ag 25 s, rs 25-28 s, a2a 106 s, train 48-52 s, decode 369 s, the torchrun tests
# 340-480 s, the TP model test 47 s, the kernel tests 356 s and the one-GPU tests 267 s (all of tests: past
# 16 minutes), so they go apart:
#   DEADLINE=570 OUT=$OUT benchmarks/run_node.sh ag rs a2a ar train tp-tests
#   DEADLINE=570 OUT=$OUT benchmarks/run_node.sh decode
#   DEADLINE=570 OUT=$OUT benchmarks/run_node.sh torchrun-tests
#   DEADLINE=570 OUT=$OUT benchmarks/run_node.sh kernel-tests
#   DEADLINE=570 OUT=$OUT benchmarks/run_node.sh gpu-tests
#
# Steps (N = the GPUs visible here; the comm steps need N >= 2):
#   tests     pytest of everything marked multigpu (kernels on 2, 4 and 8 GPUs, TP, Ulysses), then of
#             everything marked gpu (one GPU): the next four steps in one
#   torchrun-tests  the multigpu tests of train.py / serve.py under torchrun
#   tp-tests      the multigpu test of the TP model
#   kernel-tests  the other multigpu tests: each comm kernel at 2, 4 and 8 ranks
#   gpu-tests     everything marked gpu but not multigpu (one GPU)
#   ag        all-gather + matmul against NCCL + cuBLAS, torch's fused op and cuBLAS alone, and the GPU
#             activities of one call of ours per shape (ag_matmul_timeline-*)
#   rs        matmul + reduce-scatter against cuBLAS + NCCL, torch's fused op and the matmul alone, and
#             the GPU activities of one call of ours per shape (matmul_rs_timeline-*)
#   a2a       the Ulysses all-to-all against the stock path and bare all_to_all_single, and the node's
#             floor for its traffic (bench_push_floor: pushes to every peer at once, nothing else)
#   ar        the decode all-reduce size sweep against NCCL and torch's one-/two-shot, and the push
#             kernels' launch sweep (the source of their LAUNCH rows, measured on 4x H100 and 4x H200)
#   train     tensor + sequence parallel training throughput of Llama-3-8B shapes, every comm path, and
#             the per-step losses of 53 steps on each (the same weights and tokens on every path)
#   fsdp      FSDP2 training throughput and memory of the same shapes (8 layers, tp = 1, dp = N), the
#             blocks' weights gathered in bf16 (train.py's) and in fp32 (the weights' own)
#   cp        Ulysses loss curves (debug model) at cp = 1, 2, 4 on the triton path
#   decode    tensor-parallel decode of llama3_70b at tp = N on every comm path, bf16 and FP8, compiled
#             (weft's path first: one process runs them all, and a path that crashes it ends the rest)
#   fp8       the FP8 kernels, their bandwidth floors, and the FP8 vs bf16 decode of llama3_8b on one GPU
#             (eager and compiled: the README's two decode tables)
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
N=$($PY -c "import torch; print(torch.cuda.device_count())")
LOG_DIR=${LOG_DIR:-runs/node}
STEP_TIMEOUT=${STEP_TIMEOUT:-900}
DEADLINE=${DEADLINE:-0}
OUT=${OUT:-}
mkdir -p "$LOG_DIR"
stamp=$(mktemp)  # result files newer than this are this run's
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
RUN=("$PY" -m torch.distributed.run --nproc_per_node="$N")
# Each test named as it runs and each failure's reason printed as it fails (tests/conftest.py), so a
# step cut at its timeout still says which test it was in and why earlier ones failed; with
# pytest-timeout a hung test fails alone and the rest run. The slowest 20 durations size the next calls.
PYTEST="$PY -m pytest -v -rfE --tb=short --failures-at-once --durations=20 -p no:cacheprovider"
if $PY -c "import pytest_timeout" 2>/dev/null; then PYTEST="$PYTEST --timeout=${TEST_TIMEOUT:-300}"; fi
TORCHRUN_TESTS=tests/test_torchrun_gpu.py
TP_TESTS=tests/test_tp_gpu.py

cp_degrees() {
  local d=1 out=""
  while [ "$d" -le "$N" ] && [ "$d" -le 4 ]; do out="$out $d"; d=$((d * 2)); done
  echo "$out"
}

step_command() {
  case "$1" in
    tests) echo "$PYTEST -m multigpu tests; m=\$?; $(step_command gpu-tests) && exit \$m" ;;
    torchrun-tests) echo "$PYTEST -m multigpu $TORCHRUN_TESTS" ;;
    tp-tests) echo "$PYTEST -m multigpu $TP_TESTS" ;;
    kernel-tests) echo "$PYTEST -m multigpu tests --ignore=$TORCHRUN_TESTS --ignore=$TP_TESTS" ;;
    gpu-tests) echo "$PYTEST -m 'gpu and not multigpu' tests" ;;
    ag) echo "${RUN[*]} benchmarks/bench_ag_matmul.py --timeline" ;;
    rs) echo "${RUN[*]} benchmarks/bench_matmul_rs.py --timeline" ;;
    a2a) echo "${RUN[*]} benchmarks/bench_all_to_all.py && ${RUN[*]} benchmarks/bench_push_floor.py" ;;
    ar) echo "${RUN[*]} -m benchmarks.bench_all_reduce --sweep --sweep-algos one_shot_push,two_shot_push" ;;
    train) echo "${RUN[*]} -m benchmarks.bench_train_tp --steps 50" ;;
    fsdp) echo "${RUN[*]} -m benchmarks.bench_train_tp --tp 1 --comms torch --layers 8 --fsdp-gather bfloat16 float32" ;;
    cp) echo "$PY -m benchmarks.loss_curves --device cuda --dim cp --degrees$(cp_degrees) parallel.comm=triton" ;;
    decode) echo "${RUN[*]} -m benchmarks.bench_decode --model llama3_70b --batch-sizes 1 8 --fp8 --compile --comms triton torch symm_mem" ;;
    fp8) echo "$PY -m benchmarks.bench_fp8 && $PY -m benchmarks.bench_fp8_floors && $PY -m benchmarks.bench_decode --model llama3_8b --fp8 && $PY -m benchmarks.bench_decode --model llama3_8b --batch-sizes 1 8 --fp8 --compile" ;;
    *) return 1 ;;
  esac
}

steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests ag rs a2a ar train fsdp cp decode fp8)
for s in "${steps[@]}"; do
  step_command "$s" >/dev/null || { echo "unknown step '$s': see the list at the top of $0" >&2; exit 2; }
done

echo "weft node run: $N GPU(s), steps: ${steps[*]}, logs in $LOG_DIR"
summary=()
for s in "${steps[@]}"; do
  cmd=$(step_command "$s")
  limit=$STEP_TIMEOUT
  if [ "$DEADLINE" -gt 0 ]; then
    left=$((DEADLINE - SECONDS - 30))  # 30 s for the kill and the packing
    if [ "$left" -lt 60 ]; then
      summary+=("$(printf '%-7s skipped: the deadline' "$s")")
      continue
    fi
    [ "$left" -lt "$limit" ] && limit=$left
  fi
  echo "=== $s ($limit s at most): $cmd"
  start=$(date +%s)
  timeout --signal=TERM --kill-after=20 "$limit" bash -c "$cmd" 2>&1 | tee "$LOG_DIR/$s.log"
  rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-7s exit %-3s %5ss' "$s" "$rc" "$(($(date +%s) - start))")")
done
echo "=== summary"
printf '%s\n' "${summary[@]}" | tee "$LOG_DIR/summary.txt"
if [ -n "$OUT" ]; then
  mkdir -p "$OUT"
  find benchmarks/results -type f -newer "$stamp" >"$LOG_DIR/results.txt"
  tar cf "$OUT/node-results.tar" -T "$LOG_DIR/results.txt" "$LOG_DIR"
  echo "packed $(wc -l <"$LOG_DIR/results.txt") result files and the logs into $OUT/node-results.tar"
fi
rm -f "$stamp"
