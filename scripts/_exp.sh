set -u
OUT=${OUT:-/tmp/out}
bash scripts/gpu_check.sh bench --preset quick --preset s000-strong --preset s000-weak --steps 30 --stage-steps 5 --no-single-gpu --no-graph > /dev/null 2>&1
echo "== MB2"; sed -n '/^measured:/,$p' $OUT/bench.log | tail -12
grep -E "pytest exit|passed|failed" $OUT/summary.txt | tail -2
export PYTHONPATH=/tmp/site NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PGAS_EXP_MB3=1 timeout 200 /opt/torch/.venv/bin/python3 -m torch.distributed.run --nproc_per_node=2 -m benchmarks.embedding --out $OUT/bench_mb3 --preset quick --preset s000-strong --preset s000-weak --steps 30 --stage-steps 5 --no-single-gpu --no-graph > $OUT/bench_mb3.log 2>&1
echo "== MB3"; sed -n '/^measured:/,$p' $OUT/bench_mb3.log | tail -12
