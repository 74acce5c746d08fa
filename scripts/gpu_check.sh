#!/usr/bin/env bash
# One device call: install the TorchRec bundle, build the extension, run the GPU
# tests, compute-sanitizer on a small 2-rank case, and the first timing table.
#
#   bash scripts/gpu_check.sh [quick|full|dlrm|profile|bench [benchmark args]]   # logs, results under $OUT
#
# quick: a few GPU tests; full: all GPU tests, the benchmark presets s004,
# s000-weak, s000-strong and skew, compute-sanitizer, the demo; dlrm: only the
# DLRM example through torchx (stock vs PGAS inference samples/s); bench: quick
# GPU tests, then benchmarks.embedding with the given args (default --preset
# quick); profile: ncu of the fused lookup and FBGEMM's TBE forward on one GPU.
#
# Carry .devbundle (../shared/devbundle, git-ignored). NVLink multicast stays off.
set -uo pipefail
MODE=${1:-full}
shift || true
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
# GPU tests and benchmarks use every GPU of the machine (sanitizer and demo: 2 ranks).
export PGAS_TEST_WORLD=${PGAS_TEST_WORLD:-$(nvidia-smi -L | wc -l)}
PY=/opt/torch/.venv/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }

{
  echo "commit: ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -4
} | tee "$OUT/summary.txt"

# One setup log: a call brings back at most 8 files (full mode writes exactly 8).
log "install devbundle"
bash .devbundle/install_on_device.sh /tmp/site > "$OUT/setup.log" 2>&1 || { tail "$OUT/setup.log"; exit 1; }
export PYTHONPATH=/tmp/site

log "build extension"
"$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . >> "$OUT/setup.log" 2>&1 \
  || { tail -30 "$OUT/setup.log" | tee -a "$OUT/summary.txt"; exit 1; }
"$PY" -c "import torchrec_pgas._C, torch; print('ops:', len([o for o in dir(torch.ops.torchrec_pgas)]))" | tee -a "$OUT/summary.txt"

if [ "$MODE" = profile ]; then
  # ncu on one GPU (world 1): our fused lookup next to FBGEMM's TBE forward on the same gather.
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  log "ncu: rw_lookup vs TBE forward"
  # NCU_NPROC=2 profiles a kernel that needs no peer signal (the index dist) with real NVLink stores.
  timeout 400 "$NCU" --target-processes all -k regex:"${NCU_KERNELS:-rw_}" --import-source yes \
    --launch-skip "${NCU_SKIP:-3}" --launch-count "${NCU_COUNT:-3}" --section SpeedOfLight --section Occupancy \
    --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section SchedulerStats \
    --section SourceCounters --section InstructionStats -o "$OUT/lookup" \
    "$PY" -m torch.distributed.run --nproc_per_node="${NCU_NPROC:-1}" -m benchmarks.embedding \
    --preset "${NCU_PRESET:-profile}" --steps 3 \
    --warmup 1 --stage-steps 1 --sets 1 --no-graph --no-single-gpu --out "$OUT/profile" > "$OUT/ncu_run.log" 2>&1
  echo "ncu exit $?" | tee -a "$OUT/summary.txt"
  "$NCU" --import "$OUT/lookup.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
  "$NCU" --import "$OUT/lookup.ncu-rep" --page source --csv --print-source cuda,sass > "$OUT/ncu_source.csv" 2>&1
  grep -E "rw_lookup_kernel|rw_index_dist|split_embedding|DRAM Throughput|Memory Throughput|L2 Hit Rate|L1/TEX Hit|Achieved Occupancy|Registers Per|Duration|Theoretical Occupancy|Block Limit Registers|No Eligible|Issued Warp" \
    "$OUT/ncu_details.txt" | cut -c1-150 | tee -a "$OUT/summary.txt"
  log "done"
  exit 0
fi

if [ "$MODE" = dlrm ]; then
  # torchx launches torchrun from PATH; the bundle's torchx (0.7.0) runs local_cwd.
  for sharding in nccl pgas auto; do
    log "torchx DLRM inference, --sharding $sharding"
    timeout 150 "$PY" -m torchx.cli.main run -s local_cwd torchrec_pgas/components.py:dlrm --nproc_per_node 2 \
      --gpus_per_node 2 -- --sharding "$sharding" --batch-size 4096 --steps 50 --max-rows 1000000 --validate \
      > "$OUT/torchx_dlrm_$sharding.log" 2>&1
    echo "torchx dlrm $sharding exit $?" | tee -a "$OUT/summary.txt"
    grep -E "DLRM|validate|job finished|Error" "$OUT/torchx_dlrm_$sharding.log" | tail -6 | tee -a "$OUT/summary.txt"
  done
  log "done"
  exit 0
fi

TESTS=(tests/test_gpu.py)
[ "$MODE" != full ] && TESTS+=(-k "out_of_range or mismatch or ignore or graph")
log "GPU tests ($MODE)"
timeout "${TEST_TIMEOUT:-300}" "$PY" -m pytest -v -p no:cacheprovider -W ignore::DeprecationWarning "${TESTS[@]}" > "$OUT/gpu_tests.log" 2>&1
echo "pytest exit $?" | tee -a "$OUT/summary.txt"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -20 | tee -a "$OUT/summary.txt"

if [ "$MODE" = full ] || [ "$MODE" = bench ]; then
  if [ $# -eq 0 ]; then
    if [ "$MODE" = full ]; then set -- --preset s004 --preset s000-weak --preset s000-strong --preset skew
    else set -- --preset quick; fi
  fi
  log "benchmark: $*"
  timeout "${BENCH_TIMEOUT:-420}" "$PY" -m torch.distributed.run --nproc_per_node="$PGAS_TEST_WORLD" \
    -m benchmarks.embedding --out "$OUT/bench" "$@" > "$OUT/bench.log" 2>&1
  echo "benchmark exit $?" | tee -a "$OUT/summary.txt"
  sed -n '/^measured:/,$p' "$OUT/bench.log" | tail -16 | tee -a "$OUT/summary.txt"
  grep -E "Error|error" "$OUT/bench.log" | tail -5 | tee -a "$OUT/summary.txt"
fi

if [ "$MODE" = full ]; then
  log "compute-sanitizer memcheck, 2 ranks"
  # API errors are NCCL probing kernel images of other archs at init; count memory errors.
  timeout "${SANITIZER_TIMEOUT:-240}" compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    --error-exitcode 9 "$PY" -m torch.distributed.run --nproc_per_node=2 scripts/sanitizer_case.py > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer exit $?" | tee -a "$OUT/summary.txt"
  grep -E "ERROR SUMMARY|sanitizer_case" "$OUT/sanitizer.log" | tail -6 | tee -a "$OUT/summary.txt"

  log "demo (the make demo job) on nvshmem"
  timeout 120 "$PY" examples/demo.py > "$OUT/demo.log" 2>&1
  echo "demo exit $?" | tee -a "$OUT/summary.txt"
  sed -n '/^pgas_row_wise vs stock/,$p' "$OUT/demo.log" | tee -a "$OUT/summary.txt"
fi
log "done"
