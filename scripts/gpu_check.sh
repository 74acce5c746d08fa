#!/usr/bin/env bash
# One GPU check of the working tree: install the pinned TorchRec stack (from an offline bundle where
# there is no network), build the extension, then run the steps asked for.
#
#   bash scripts/gpu_check.sh [--bundle DIR] [--out DIR] STEPS [benchmark args]
#
#   --bundle DIR  offline bundle for air-gapped GPU machines: a folder whose install_on_device.sh SITE
#                 installs the pinned TorchRec and FBGEMM wheels into SITE (here /tmp/site, put on
#                 PYTHONPATH) without a network. Also PGAS_OFFLINE_BUNDLE=DIR. Default: the git-ignored
#                 bundle folder at the tree's root when it exists (see BUNDLE below); with none, the
#                 Python environment is used as it is.
#   --out DIR     logs and results (default: the OUT environment variable, else /tmp/out): summary.txt
#                 (commit, GPUs, every step's exit status and headline lines) and one log per step.
#
# STEPS is a comma list, or a name for one:
#   tests      every GPU test (tests/ -m gpu; TEST_FILES: some files) at PGAS_TEST_WORLD ranks, over TEST_SHARDS pytest
#              processes side by side (default 1, at most 2); quick-tests: a few
#   bench-rw   benchmarks.embedding, stock row_wise vs pgas_row_wise   (args, default --preset quick)
#   bench-tw   the same for table_wise vs pgas_table_wise (both: BENCH_WORLDS="8 4 2" runs them at each size)
#   bench-twrw the same for table_row_wise vs pgas_table_row_wise, nodes of NODE_SIZE ranks (default 2); training:
#              bench-train with TRAIN_PAIRS=twrw and TRAIN_ARGS holding --node-size
#   bench-train benchmarks.embedding --mode train, TRAIN_PAIRS (default both), with each of TRAIN_OWNER_BACKWARDS (default
#              "fbgemm pgas": PgasConfig.owner_backward), at each of TRAIN_WORLDS (default 1) GPUs, into
#              train-<pair>-<owner backward>-w<n>; TRAIN_ARGS (default s004, s000-weak, s000-strong, 50 steps,
#              no graph)
#   scaling    s000-weak and s000-strong, both pairs, at 1..PGAS_TEST_WORLD GPUs
#   sanitizer  compute-sanitizer memcheck of a small 2-rank training case (on a one-GPU machine both ranks share
#              it; SANITIZER_OWNER_BACKWARD: pgas, the default, or fbgemm), then of the owner update op's tests
#   demo       the `make demo` job on nvshmem
#   dlrm       the DLRM example through torchx local_cwd: nccl, pgas and auto sharding, --validate; then training
#              with --sharding pgas --validate (its stock twin on the same batches) into <out>/dlrm_torchx_train.json
#   dlrm-train the DLRM example training with --sharding pgas --validate through DLRM_PIPELINE (default sparse_dist:
#              TorchRec's TrainPipelineSparseDist; replay: ReplayTrainPipeline; the stock twin trained on the same
#              batches through TrainPipelineSparseDist) at each of DLRM_WORLDS (default "1 2"; ranks share GPUs when
#              they outnumber them) and DLRM_BATCH (default 2048; a list sweeps), DLRM_STEPS (50) steps, DLRM_ARGS
#              more arguments, DLRM_TORCHRUN_ARGS torchrun's (e.g. "--numa-binding exclusive": each rank on its own
#              cores); each run's loss trajectories and both samples/s in
#              <out>/dlrm_train_<DLRM_NAME, default the pipeline>_w<W>_b<batch>.json
#   virtual    benchmarks.virtual_ranks on GPU 0: each rank's stage kernels of a W-rank step, all ranks on one
#              GPU (VIRTUAL_ARGS, default s000-weak and s000-strong at W = 1 and 2, both pairs); with
#              AB_VARIANTS="dir ...", again for each dir: a scratch copy of the tree (/tmp/ab-<dir name>)
#              with that dir's csrc/ files copied over its csrc/, built and run there. The working tree
#              is never changed.
#   compare    this tree against an older one (COMPARE_TREE=<dir>: a `git archive` of that commit, exported
#              beforehand since op names change, built in a scratch copy): benchmarks.embedding at each of
#              COMPARE_WORLDS (default 1) GPUs (COMPARE_BENCH, default s000-weak and s000-strong; COMPARE_PAIRS,
#              default "rw tw") and benchmarks.virtual_ranks (COMPARE_VIRTUAL, default the same at W = 2; empty:
#              none), in the order of
#              COMPARE_ROUNDS (default "tree old tree2": the tree, the older one, the tree again to show the
#              drift; numbered rounds, "tree old tree2 old2 tree3 old3", alternate the builds);
#              scripts/compare_runs.py prints every step and stage time side by side into <out>/compare.txt
#              (each tree round against the old round of its number, and against the first tree round), each
#              round's results packed into <out>/compare/<round>.json; compare_rounds.txt: the verdict over the
#              rounds (scripts/compare_runs.py rounds)
#   owner-op   benchmarks.owner_op on GPU 0: the owner_update op against FBGEMM's backward on the same ids
#              (OWNER_OP_ARGS, default s000-weak and s000-strong, 20 steps), for the tree and each of AB_VARIANTS
#              (as virtual's), in OWNER_OP_ROUNDS alternating rounds (default 1); OWNER_OP_NCU=1 adds ncu of
#              the walk with every section (--set full), of OWNER_OP_NCU_PRESET's walk launch OWNER_OP_NCU_SKIP
#              (default 1: the first workload's timed one; a workload launches it twice, so 5 is a
#              three-workload preset's third), or of every kernel of OWNER_OP_NCU_SIDE's (pgas: its owner_
#              kernels; fbgemm) timed step of the workload named OWNER_OP_NCU_WORKLOAD, into
#              ncu/ncu_owner_op[_OWNER_OP_NCU_NAME]_*
#   ceiling    benchmarks/gather_ceiling.cu on GPU 0: random-row gather, streaming read and copy bandwidth
#   profile    ncu of the stage kernels (default: the fused kernels, index_dist|pooled_lookup|combine_partials,
#              on one GPU; NCU_* variables: what, where, NCU_NPROC=2: rank 0 of two, NCU_VIRTUAL: virtual
#              ranks, NCU_BENCH_ARGS: more benchmark arguments, e.g. NCU_KERNELS=owner_update NCU_PRESET=s000-weak
#              NCU_BENCH_ARGS="--mode train --owner-backward pgas"), into <out>/ncu (details, per-line source
#              counters, run log; the report stays in /tmp)
#   full       tests,bench-rw (s004, s000-weak, s000-strong, skew),sanitizer,demo
#
# The benchmark keeps results.json (and --host-profile's folder; benchmarks.plots rebuilds the CSV); logs go to one file
# per step. What to commit from a run: benchmarks/results/README.md. GIT_COMMIT=<commit> names the commit
# in summary.txt when the tree's .git is missing or stale. NVLink multicast stays off. The script writes
# only under <out>, /tmp and the tree's git-ignored build outputs: it never deletes or rewrites a
# tracked file.
set -uo pipefail
BUNDLE=${PGAS_OFFLINE_BUNDLE:-}
OUT=${OUT:-/tmp/out}
while [ $# -gt 0 ]; do
  case $1 in
    --bundle) BUNDLE=${2:?--bundle needs a folder}; shift 2 ;;
    --bundle=*) BUNDLE=${1#*=}; shift ;;
    --out) OUT=${2:?--out needs a folder}; shift 2 ;;
    --out=*) OUT=${1#*=}; shift ;;
    *) break ;;
  esac
done
[ -z "$BUNDLE" ] && [ -f .devbundle/install_on_device.sh ] && BUNDLE=.devbundle
STEPS=${1:-full}
shift || true
FULL=0
[ "$STEPS" = full ] && FULL=1 && STEPS=tests,bench-rw,sanitizer,demo
FULL_PRESETS=(--preset s004 --preset s000-weak --preset s000-strong --preset skew)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the A/B variants run from their scratch copies
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
# GPU tests and benchmarks use every GPU of the machine (sanitizer and demo: 2 ranks).
GPUS=$(nvidia-smi -L | wc -l)
export PGAS_TEST_WORLD=${PGAS_TEST_WORLD:-$GPUS}
PY=/opt/torch/.venv/bin/python3
[ -x "$PY" ] || PY=$(command -v python3)
log() { echo "== $(date +%T) $*" | tee -a "$OUT/summary.txt"; }
has() { [[ ",$STEPS," == *",$1,"* ]]; }

{
  echo "commit: ${GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "steps: $STEPS $*"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nvidia-smi topo -m 2>/dev/null | head -$((GPUS + 2))
} | tee "$OUT/summary.txt"

: > /tmp/setup.log
if [ -n "$BUNDLE" ]; then
  log "install offline bundle ($BUNDLE)"
  bash "$BUNDLE/install_on_device.sh" /tmp/site > /tmp/setup.log 2>&1 || { cp /tmp/setup.log "$OUT/"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  log "no offline bundle: the installed TorchRec and FBGEMM"
fi

# Builds the tree's extension (an editable install; its outputs are git-ignored), once per content of its
# sources: a later call of this script on the same machine skips the ~75 s pip round (the stamp in /tmp), as
# long as the built extension still imports from this tree.
build() { "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . >> /tmp/setup.log 2>&1; }
STAMP=$(cat setup.py csrc/* | sha1sum | cut -c1-16)
if [ "$(cat /tmp/pgas_build.stamp 2>/dev/null)" = "$STAMP:$(pwd)" ] && "$PY" -c "import torchrec_pgas._C" 2> /dev/null; then
  log "extension already built from these sources"
else
  log "build extension"
  build || { cp /tmp/setup.log "$OUT/"; tail -30 /tmp/setup.log | tee -a "$OUT/summary.txt"; exit 1; }
  echo "$STAMP:$(pwd)" > /tmp/pgas_build.stamp
fi
"$PY" -c "import torchrec_pgas._C, torch; print('ops:', len([o for o in dir(torch.ops.torchrec_pgas)]))" | tee -a "$OUT/summary.txt"

# benchmarks.embedding on $1 GPUs into $OUT/$2 (results.json kept), logged to $OUT/bench.log.
bench() {
  local n=$1 name=$2
  shift 2
  log "benchmark $name ($n GPUs): $*"
  timeout "${BENCH_TIMEOUT:-420}" "$PY" -m torch.distributed.run --nproc_per_node="$n" \
    -m benchmarks.embedding --out "/tmp/bench/$name" "$@" > /tmp/bench.log 2>&1
  echo "benchmark $name exit $?" | tee -a "$OUT/summary.txt"
  { echo "### $name: $*"; cat /tmp/bench.log; } >> "$OUT/bench.log"
  sed -n '/^measured:/,$p' /tmp/bench.log | grep -v "^results:" | tail -16 | tee -a "$OUT/summary.txt"
  grep -E "Error|error" /tmp/bench.log | tail -5 | tee -a "$OUT/summary.txt"
  mkdir -p "$OUT/$name" && cp "/tmp/bench/$name/results.json" "$OUT/$name/" 2>/dev/null
  [ -d "/tmp/bench/$name/host_profile" ] && cp -r "/tmp/bench/$name/host_profile" "$OUT/$name/"
}

if has ceiling; then
  log "gather ceiling (GPU 0)"
  nvcc -O3 -std=c++17 -arch=sm_90a benchmarks/gather_ceiling.cu -o /tmp/gather_ceiling >> /tmp/setup.log 2>&1 \
    && CUDA_VISIBLE_DEVICES=0 timeout 120 /tmp/gather_ceiling > "$OUT/gather_ceiling.txt" 2>&1
  echo "gather ceiling exit $?" | tee -a "$OUT/summary.txt"
  tee -a "$OUT/summary.txt" < "$OUT/gather_ceiling.txt"
fi

# A/B builds never touch the tree: scratch_copy DIR copies the tree's files (tracked, and untracked ones
# git does not ignore) into DIR; ab_build DIR builds torchrec_pgas._C in place there.
scratch_copy() {
  local dst=$1
  rm -rf "$dst" && mkdir -p "$dst" || return 1
  if git rev-parse --git-dir > /dev/null 2>&1; then
    # -c and -o together: every file even when the index is stale (a listed file that is gone is skipped)
    git ls-files -z -co --exclude-standard | xargs -0 cp --parents -t "$dst" 2> /dev/null
  else
    tar -cf - --exclude=.git --exclude=build --exclude=.venv --exclude=.devbundle --exclude='*.egg-info' \
      --exclude='*.so' . | tar -xf - -C "$dst"
  fi
  [ -f "$dst/setup.py" ] && [ -d "$dst/csrc" ]
}
ab_build() { (cd "$1" && "$PY" setup.py -q build_ext --inplace) >> /tmp/setup.log 2>&1; }

# variant_dir VARIANT: where a step runs for VARIANT ("tree": the tree itself; else a scratch copy of the tree,
# /tmp/ab-<name>, with VARIANT's csrc/ files copied over its csrc/, and its tests/ files over tests/ where it has
# some, built there once per content of the tree's and the variant's files); fails if the build does.
variant_dir() {
  if [ "$1" = tree ]; then echo .; return; fi
  local dir=/tmp/ab-$(basename "$1") stamp
  stamp=$(cat setup.py csrc/* "$1"/csrc/* "$1"/tests/* 2> /dev/null | sha1sum | cut -c1-16)
  if [ "$(cat "$dir/.variant_stamp" 2>/dev/null)" != "$stamp" ]; then
    { scratch_copy "$dir" && cp "$1"/csrc/* "$dir/csrc/" && { [ ! -d "$1/tests" ] || cp "$1"/tests/* "$dir/tests/"; } \
        && ab_build "$dir" && echo "$stamp" > "$dir/.variant_stamp"; } \
      || { echo "build of $1 failed" | tee -a "$OUT/summary.txt" >&2; tail -20 /tmp/setup.log >> "$OUT/summary.txt"; return 1; }
  fi
  echo "$dir"
}
# prebuild_variants: every AB_VARIANTS build at once (each ~1.3 min alone, mostly one nvcc process), so a step's
# loop over them finds them built; a failed build is reported again by variant_dir in that loop.
prebuild_variants() {
  local variant
  for variant in ${AB_VARIANTS:-}; do variant_dir "$variant" > /dev/null & done
  wait
}
variant_name() { if [ "$2" = tree ]; then echo "$1"; else echo "$1-$(basename "$2")"; fi; }

# ncu_export REPORT NAME KERNELS: an ncu report's details and per-line source counters into
# $OUT/ncu/NAME_details.txt and NAME_source.csv, its headline lines (KERNELS: a grep pattern of the kernel
# names) into summary.txt.
NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
ncu_export() {
  "$NCU" --import "$1" --page details > "$OUT/ncu/$2_details.txt" 2>&1
  "$NCU" --import "$1" --page source --csv --print-source cuda,sass > "$OUT/ncu/$2_source.csv" 2>&1
  grep -E "$3|DRAM Throughput|Memory Throughput|L2 Hit Rate|L1/TEX Hit|Achieved Occupancy|Registers Per|Duration|Theoretical Occupancy|Block Limit Registers|No Eligible|Issued Warp|Executed Instructions  " \
    "$OUT/ncu/$2_details.txt" | cut -c1-150 | tee -a "$OUT/summary.txt"
}

if has virtual; then
  # One results.json per variant (the tree's first) under $OUT/virtual[-variant], their logs in virtual.log.
  prebuild_variants
  read -r -a VARGS <<< "${VIRTUAL_ARGS:---preset s000-weak --preset s000-strong --world 1 --world 2 --pair rw --pair tw}"
  for variant in tree ${AB_VARIANTS:-}; do
    name=$(variant_name virtual "$variant")
    dir=$(variant_dir "$variant") || continue
    log "virtual ranks ($variant, in $dir): ${VARGS[*]}"
    mkdir -p "$OUT/$name"
    (cd "$dir" && PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES=0 timeout "${VIRTUAL_TIMEOUT:-300}" \
      "$PY" -m benchmarks.virtual_ranks "${VARGS[@]}" --out "$OUT/$name") > /tmp/virtual.log 2>&1
    echo "virtual $variant exit $?" | tee -a "$OUT/summary.txt"
    { echo "### $variant"; cat /tmp/virtual.log; } >> "$OUT/virtual.log"
    grep -E "^W=|Error" /tmp/virtual.log | tee -a "$OUT/summary.txt"
  done
fi

if has owner-op; then
  # benchmarks.owner_op on GPU 0 for the tree and each of AB_VARIANTS (results under $OUT/owner-op[-variant]),
  # then, with OWNER_OP_NCU=1, ncu of the tree's walk (every section: the op alone fits ncu's memory save).
  prebuild_variants
  read -r -a OARGS <<< "${OWNER_OP_ARGS:---preset s000-weak --preset s000-strong --steps 20}"
  # OWNER_OP_ROUNDS rounds alternate the builds (tree, variants, tree, ...; round k > 1 into <name>-r<k>): the
  # second build of a lease ran the same sort up to 9% shorter than the first, so small effects need both orders.
  for round in $(seq 1 "${OWNER_OP_ROUNDS:-1}"); do
    for variant in tree ${AB_VARIANTS:-}; do
      name=$(variant_name owner-op "$variant")
      [ "$round" -gt 1 ] && name=$name-r$round
      dir=$(variant_dir "$variant") || continue
      log "owner op against FBGEMM ($variant, round $round, in $dir): ${OARGS[*]}"
      (cd "$dir" && PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES=0 timeout "${OWNER_OP_TIMEOUT:-300}" \
        "$PY" -m benchmarks.owner_op "${OARGS[@]}" --out "$OUT/$name") > /tmp/owner_op.log 2>&1
      echo "owner-op $variant round $round exit $?" | tee -a "$OUT/summary.txt"
      { echo "### $variant, round $round"; cat /tmp/owner_op.log; } >> "$OUT/owner_op.log"
      sed -n '/^measured:/,$p' /tmp/owner_op.log | grep -v "^results:" | tee -a "$OUT/summary.txt"
      grep -E "Error" /tmp/owner_op.log | tail -3 | tee -a "$OUT/summary.txt"
    done
  done
  if [ -n "${OWNER_OP_NCU:-}" ]; then
    # Which launches: OWNER_OP_NCU_WORKLOAD names a workload (run alone; benchmarks.owner_op's NVTX start/end
    # range "<side>:<name>" picks its timed step), else OWNER_OP_NCU_SKIP picks the walk's launch.
    side=${OWNER_OP_NCU_SIDE:-pgas}
    only=()
    if [ -n "${OWNER_OP_NCU_WORKLOAD:-}" ]; then
      pick=(--nvtx --nvtx-include "$side:$OWNER_OP_NCU_WORKLOAD" --launch-count "${OWNER_OP_NCU_COUNT:-40}")
      [ "$side" = pgas ] && pick+=(-k regex:owner_)
      only=(--only "$OWNER_OP_NCU_WORKLOAD")
    else
      pick=(-k regex:owner_walk --launch-skip "${OWNER_OP_NCU_SKIP:-1}" --launch-count 1)
    fi
    name=ncu_owner_op${OWNER_OP_NCU_NAME:+_$OWNER_OP_NCU_NAME}
    log "ncu: benchmarks.owner_op --side $side (${OWNER_OP_NCU_PRESET:-s000-weak}): ${pick[*]}"
    mkdir -p "$OUT/ncu"
    CUDA_VISIBLE_DEVICES=0 timeout "${NCU_TIMEOUT:-400}" "$NCU" -f --import-source yes "${pick[@]}" --set full \
      ${NCU_EXTRA:-} -o "/tmp/$name" "$PY" -m benchmarks.owner_op --side "$side" \
      --preset "${OWNER_OP_NCU_PRESET:-s000-weak}" "${only[@]}" --steps 1 --warmup 1 --min-timed-ms 0 \
      --out "/tmp/${name}_run" \
      > "$OUT/ncu/${name}_run.log" 2>&1
    echo "ncu owner-op exit $?" | tee -a "$OUT/summary.txt"
    ncu_export "/tmp/$name.ncu-rep" "$name" "owner_|backward|Sort|sort|Stall"
  fi
fi

if has compare; then
  read -r -a CBENCH <<< "${COMPARE_BENCH:---preset s000-weak --preset s000-strong --steps 50 --no-graph --no-single-gpu}"
  read -r -a CVIRT <<< "${COMPARE_VIRTUAL---preset s000-weak --preset s000-strong --world 2 --pair rw --pair tw --steps 20}"
  mkdir -p "$OUT/compare"
  # The tree's rounds run in place (built above). The older tree runs from a scratch copy built there, imported
  # from there (the planner package linked into place, as installed); a COMPARE_TREE already built (its
  # .compare_built written by an earlier call) runs as it is.
  old=${COMPARE_TREE:?compare needs COMPARE_TREE}
  if [ ! -f "$old/.compare_built" ]; then
    { rm -rf /tmp/ab-old && cp -r "$old" /tmp/ab-old && ln -sfn ../planner /tmp/ab-old/torchrec_pgas/planner \
        && ab_build /tmp/ab-old && touch /tmp/ab-old/.compare_built; } \
      || { echo "compare: build failed" | tee -a "$OUT/summary.txt"; tail -20 /tmp/setup.log >> "$OUT/summary.txt"; }
    old=/tmp/ab-old
  fi
  for build in ${COMPARE_ROUNDS:-tree old tree2}; do
    dir=$(pwd); [ "${build%%[0-9]*}" = old ] && dir=$old  # tree, tree2, ... run the tree; old, old2, ... the other
    log "compare: $build ($dir)"
    for n in ${COMPARE_WORLDS:-1}; do
      for pair in ${COMPARE_PAIRS:-rw tw}; do
        (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} timeout "${BENCH_TIMEOUT:-420}" "$PY" -m torch.distributed.run \
          --nproc_per_node="$n" -m benchmarks.embedding --pair $pair "${CBENCH[@]}" --out /tmp/cmp-$build/bench-$pair-w$n) \
          > /tmp/cmp.log 2>&1
        echo "$build bench-$pair-w$n exit $?" | tee -a "$OUT/summary.txt"
        { echo "### $build bench-$pair-w$n"; cat /tmp/cmp.log; } >> "$OUT/compare.log"
        grep -E "Error|error" /tmp/cmp.log | tail -3 | tee -a "$OUT/summary.txt"
      done
    done
    if [ ${#CVIRT[@]} -gt 0 ]; then  # COMPARE_VIRTUAL="" leaves the virtual ranks out
      (cd "$dir" && PYTHONPATH=$dir${PYTHONPATH:+:$PYTHONPATH} CUDA_VISIBLE_DEVICES=0 timeout "${VIRTUAL_TIMEOUT:-300}" \
        "$PY" -m benchmarks.virtual_ranks "${CVIRT[@]}" --out /tmp/cmp-$build/virtual) > /tmp/cmp.log 2>&1
      echo "$build virtual exit $?" | tee -a "$OUT/summary.txt"
      grep -E "^W=|Error" /tmp/cmp.log | tee -a "$OUT/summary.txt"
    fi
    "$PY" scripts/compare_runs.py pack /tmp/cmp-$build "$OUT/compare/$build.json"
    "$PY" scripts/compare_runs.py rounds "$OUT/compare" > "$OUT/compare_rounds.txt" 2>&1  # after every round
  done
  c="$PY scripts/compare_runs.py diff"
  { for round in "" 2 3 4; do  # each tree round against the old round of its number (or the first old one)
      [ -f "$OUT/compare/tree$round.json" ] || continue
      old=$OUT/compare/old$round.json; [ -f "$old" ] || old=$OUT/compare/old.json
      echo "### tree$round against $(basename "$old" .json)"; $c "$OUT/compare/tree$round.json" "$old"
      [ -n "$round" ] && { echo "### tree$round against tree (drift)"; $c "$OUT/compare/tree$round.json" "$OUT/compare/tree.json"; }
    done; } > "$OUT/compare.txt" 2>&1
  grep -E "^###|within|outside|nothing" "$OUT/compare.txt" | tee -a "$OUT/summary.txt"
  tee -a "$OUT/summary.txt" < "$OUT/compare_rounds.txt"
fi

if has profile; then
  # By default on one GPU (world 1): our fused lookup next to FBGEMM's TBE forward on the same gather.
  NCU_K=${NCU_KERNELS:-index_dist|pooled_lookup|combine_partials}
  log "ncu: $NCU_K (${NCU_NPROC:-1} GPUs, ${NCU_PRESET:-profile}, pair ${NCU_PAIR:-rw})"
  mkdir -p "$OUT/ncu"
  # NCU_NPROC=2 profiles rank 0 only, with real NVLink stores and a live peer: ncu attached to every rank
  # serialized their kernels, and a rank's lookup spinning on its peer blocked the peer's index dist (one
  # such run timed out, one hung). Replays of rank 0's kernels rewrite the same data and epochs into the
  # peer. NCU_EXTRA: more ncu arguments (e.g. --metrics sm__cycles_active.min,sm__cycles_active.max).
  cat > /tmp/ncu_rank0.sh <<NCUEOF
#!/usr/bin/env bash
[ "\${LOCAL_RANK:-0}" = 0 ] || exec "\$@"
exec "$NCU" -f -k regex:"$NCU_K" --import-source yes \\
  --launch-skip "${NCU_SKIP:-3}" --launch-count "${NCU_COUNT:-3}" --section SpeedOfLight --section Occupancy \\
  --section MemoryWorkloadAnalysis --section WarpStateStats --section LaunchStats --section SchedulerStats \\
  --section SourceCounters --section InstructionStats ${NCU_EXTRA:-} -o /tmp/ncu_report "\$@"
NCUEOF
  if [ -n "${NCU_VIRTUAL:-}" ]; then
    # NCU_VIRTUAL="--world 2 ...": benchmarks.virtual_ranks (one step after 3 warm-ups; ranks launch in
    # order: with NCU_KERNELS naming one stage, NCU_SKIP = 3 * W + r picks rank r's kernel of the timed step;
    # the default matches all three stages, 3 W kernels a step).
    CUDA_VISIBLE_DEVICES=0 timeout "${NCU_TIMEOUT:-400}" bash /tmp/ncu_rank0.sh "$PY" -m benchmarks.virtual_ranks \
      --preset "${NCU_PRESET:-profile}" --pair "${NCU_PAIR:-rw}" --steps 1 --sets 1 $NCU_VIRTUAL > "$OUT/ncu/ncu_run.log" 2>&1
  else
    timeout "${NCU_TIMEOUT:-400}" "$PY" -m torch.distributed.run --nproc_per_node="${NCU_NPROC:-1}" --no-python bash /tmp/ncu_rank0.sh \
      "$PY" -m benchmarks.embedding --pair "${NCU_PAIR:-rw}" --preset "${NCU_PRESET:-profile}" --steps 3 \
      --warmup 1 --stage-steps 1 --sets 1 --no-graph --no-single-gpu ${NCU_BENCH_ARGS:-} --out /tmp/ncu_profile \
      > "$OUT/ncu/ncu_run.log" 2>&1
  fi
  echo "ncu exit $?" | tee -a "$OUT/summary.txt"
  ncu_export /tmp/ncu_report.ncu-rep ncu "pooled_lookup_kernel|index_dist_kernel|combine_partials_kernel|split_embedding"
fi

if has tests || has quick-tests; then
  # TEST_FILES: a part of the suite (the whole took over 10 minutes with two ranks sharing one H200)
  ALL_GPU_TESTS=tests  # every file's tests marked gpu
  # shellcheck disable=SC2206  # the file list splits on blanks and newlines
  TESTS=(${TEST_FILES:-$ALL_GPU_TESTS} -m gpu)
  K=${TEST_K:-}  # e.g. TEST_K="table_wise or comm"; with quick-tests, both must match
  has quick-tests && K="(out_of_range or mismatch or ignore or graph or bit_exact or comm)${K:+ and ($K)}"
  [ -n "$K" ] && TESTS+=(-k "$K")
  SHARDS=${TEST_SHARDS:-1}
  # More than two side by side start their ranks' NVSHMEM at once: six did (12 ranks on two H200s) and 19 tests
  # timed out building their models (gloo's 120 s), a harness failure, not the code's.
  [ "$SHARDS" -gt 2 ] && { echo "TEST_SHARDS=$SHARDS: capped at 2" | tee -a "$OUT/summary.txt"; SHARDS=2; }
  log "GPU tests at world size $PGAS_TEST_WORLD ($SHARDS pytest processes side by side)"
  # Per-test limits (tests use short PGAS wait timeouts), so a stuck test still leaves its traceback.
  # The whole suite took 8-12 minutes with the ranks sharing one GPU, ~25 with a rank per GPU (375 tests, ~20 s a
  # multi-process test, most of it process start): TEST_SHARDS=2 deals the collected tests over two pytest processes
  # side by side (each test's ranks still a GPU each; correctness only), each with its own log and report folder
  # (PGAS_TEST_REPORT: training_diffs.json, failures.log): gpu_tests.log, or gpu_tests_<k>.log with shards.
  pt() {  # pt LOG REPORT_DIR ARGS...
    local log=$1 report=$2; shift 2
    mkdir -p "$report"
    PGAS_TEST_REPORT=$report PYTHONDONTWRITEBYTECODE=1 timeout "${TEST_TIMEOUT:-780}" "$PY" -m pytest -v \
      -p no:cacheprovider -W ignore::DeprecationWarning --tb=short --timeout "${PER_TEST_TIMEOUT:-400}" "$@" > "$log" 2>&1
    local rc=$?  # before any expansion: a command substitution in the message would set $? to its own status
    echo "pytest $(basename "$log" .log) exit $rc" | tee -a "$OUT/summary.txt"
  }
  if [ "$SHARDS" -le 1 ]; then
    pt "$OUT/gpu_tests.log" "$OUT" "${TESTS[@]}"
  else
    "$PY" -m pytest --collect-only -q -p no:cacheprovider "${TESTS[@]}" 2> /dev/null | grep "::" > /tmp/gpu_test_ids.txt
    for k in $(seq 0 $((SHARDS - 1))); do
      mapfile -t ids < <(awk -v n="$SHARDS" -v k="$k" '(NR - 1) % n == k' /tmp/gpu_test_ids.txt)
      # TEST_SHARD_GPUS=1: shard k sees GPU k alone, its tests' ranks sharing it (gloo; the suite in 8-12 minutes
      # a GPU); the tests that need a GPU per rank (NCCL captures) skip there: run them apart with TEST_FILES.
      [ ${#ids[@]} -gt 0 ] && ( [ "${TEST_SHARD_GPUS:-0}" = 1 ] && export CUDA_VISIBLE_DEVICES=$k
                                pt "$OUT/gpu_tests_$k.log" "$OUT/tests_$k" "${ids[@]}" ) &
    done
    wait
  fi
  grep -hE "PASSED|FAILED|ERROR|passed|failed" "$OUT"/gpu_tests*.log | tail -30 | tee -a "$OUT/summary.txt"
fi

if has scaling; then
  # Largest world first (what the run is for, if time runs short); the 1-GPU TBE reference runs
  # once, in the 1-GPU pass; graphs are timed at every size. Each run's rows are merged into
  # $OUT/scaling/results.json as soon as it ends (one file for the whole sweep).
  for n in $(seq "$PGAS_TEST_WORLD" -1 1); do
    for pair in rw tw; do
      extra=(--no-single-gpu)
      [ "$n" = 1 ] && [ "$pair" = rw ] && extra=()
      bench "$n" "scaling-$pair-$n" --pair "$pair" --preset s000-weak --preset s000-strong \
        --steps "${SCALING_STEPS:-50}" "${extra[@]}"
      "$PY" - "$OUT" "scaling-$pair-$n" <<'PYEOF'
import json, os, shutil, sys
out, run = sys.argv[1], sys.argv[2]
src, dst = os.path.join(out, run, "results.json"), os.path.join(out, "scaling", "results.json")
if os.path.exists(src):
    new = json.load(open(src))
    merged = json.load(open(dst)) if os.path.exists(dst) else {"meta": dict(new["meta"], world_size="1-N"),
                                                                "rows": [], "single_gpu": []}
    merged["meta"].setdefault("runs", []).append(new["meta"])  # a copy: the merged meta is its own dict
    merged["rows"] += new["rows"]
    merged["single_gpu"] += new.get("single_gpu", [])
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    json.dump(merged, open(dst, "w"), indent=1)
shutil.rmtree(os.path.join(out, run), ignore_errors=True)
PYEOF
    done
  done
fi

[ $# -eq 0 ] && [ "$FULL" = 1 ] && set -- "${FULL_PRESETS[@]}"
[ $# -eq 0 ] && set -- --preset quick
# BENCH_WORLDS="8 4 2": the pairs at each of these world sizes (GPUs 0..n-1, largest first), into
# bench-rw-w8, bench-rw-w4, ... (one results.json each); by default once, at every GPU.
for n in ${BENCH_WORLDS:-$PGAS_TEST_WORLD}; do
  suffix=""
  [ -n "${BENCH_WORLDS:-}" ] && suffix="-w$n"
  has bench-rw && bench "$n" "bench-rw$suffix" --pair rw "$@"
  has bench-tw && bench "$n" "bench-tw$suffix" --pair tw "$@"
  # table-row-wise: the job as nodes of NODE_SIZE ranks (default 2: 2 x 2 on four GPUs)
  has bench-twrw && bench "$n" "bench-twrw$suffix" --pair twrw --node-size "${NODE_SIZE:-2}" "$@"
done

if has bench-train; then
  read -r -a TRAIN_ARGV <<< "${TRAIN_ARGS:---preset s004 --preset s000-weak --preset s000-strong --steps 50 --stage-steps 10 --no-graph --no-single-gpu}"
  for n in ${TRAIN_WORLDS:-1}; do
    for pair in ${TRAIN_PAIRS:-rw tw}; do
      for ob in ${TRAIN_OWNER_BACKWARDS:-fbgemm pgas}; do
        bench "$n" "train-$pair-$ob-w$n" --mode train --pair "$pair" --owner-backward "$ob" "${TRAIN_ARGV[@]}"
      done
    done
  done
fi

if has sanitizer; then
  log "compute-sanitizer memcheck, 2 ranks"
  # API errors are NCCL probing kernel images of other archs at init; count memory errors. Memcheck slows
  # the kernels (and ranks sharing a GPU take turns): a long PGAS wait.
  SANITIZER_WAIT_S=${SANITIZER_WAIT_S:-600} timeout "${SANITIZER_TIMEOUT:-480}" compute-sanitizer --tool memcheck --report-api-errors no --target-processes all \
    --error-exitcode 9 "$PY" -m torch.distributed.run --nproc_per_node=2 scripts/sanitizer_case.py > "$OUT/sanitizer.log" 2>&1
  echo "sanitizer exit $?" | tee -a "$OUT/summary.txt"
  grep -E "ERROR SUMMARY|sanitizer_case" "$OUT/sanitizer.log" | tail -6 | tee -a "$OUT/summary.txt"
  log "compute-sanitizer memcheck, the owner update op's GPU tests (every optimizer, dtype, a hot row, dim 512)"
  timeout "${SANITIZER_TIMEOUT:-480}" compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 \
    "$PY" -m pytest -q -p no:cacheprovider -W ignore::DeprecationWarning -m gpu tests/test_owner_update_op.py \
    > "$OUT/sanitizer_op.log" 2>&1
  echo "sanitizer op exit $?" | tee -a "$OUT/summary.txt"
  grep -E "ERROR SUMMARY|passed|failed" "$OUT/sanitizer_op.log" | tail -3 | tee -a "$OUT/summary.txt"
fi

if has demo; then
  log "demo (the make demo job) on nvshmem"
  timeout 120 "$PY" examples/demo.py > "$OUT/demo.log" 2>&1
  echo "demo exit $?" | tee -a "$OUT/summary.txt"
  sed -n '/^pgas_row_wise vs stock/,$p' "$OUT/demo.log" | tee -a "$OUT/summary.txt"
fi

if has dlrm; then
  # torchx launches torchrun from PATH; torchx 0.7.0 (the pinned stack's) runs local_cwd.
  for sharding in nccl pgas auto; do
    log "torchx DLRM inference, --sharding $sharding"
    timeout 150 "$PY" -m torchx.cli.main run -s local_cwd torchrec_pgas/components.py:dlrm --nproc_per_node 2 \
      --gpus_per_node 2 -- --sharding "$sharding" --batch-size 4096 --steps 50 --max-rows 1000000 --validate \
      > /tmp/dlrm.log 2>&1
    echo "torchx dlrm $sharding exit $?" | tee -a "$OUT/summary.txt"
    { echo "### torchx dlrm --sharding $sharding"; cat /tmp/dlrm.log; } >> "$OUT/torchx_dlrm.log"
    grep -E "DLRM|validate|job finished|Error" /tmp/dlrm.log | tail -6 | tee -a "$OUT/summary.txt"
  done
  log "torchx DLRM training, --sharding pgas --pipeline sparse_dist --validate (the stock twin on the same batches)"
  timeout "${DLRM_TIMEOUT:-240}" "$PY" -m torchx.cli.main run -s local_cwd torchrec_pgas/components.py:dlrm \
    --nproc_per_node 2 --gpus_per_node 2 -- --sharding pgas --train --pipeline sparse_dist --batch-size \
    "${DLRM_BATCH:-2048}" --steps "${DLRM_STEPS:-50}" --max-rows 1000000 --validate \
    --report "$OUT/dlrm_torchx_train.json" > /tmp/dlrm.log 2>&1
  echo "torchx dlrm train exit $?" | tee -a "$OUT/summary.txt"
  { echo "### torchx dlrm --sharding pgas --train"; cat /tmp/dlrm.log; } >> "$OUT/torchx_dlrm.log"
  grep -E "DLRM|^samples/s|validate|job finished|Error" /tmp/dlrm.log | tail -6 | tee -a "$OUT/summary.txt"
fi
if has dlrm-train; then
  read -r -a DLRM_ARGV <<< "${DLRM_ARGS:-}"  # e.g. "--owner-backward auto --warmup 10"
  read -r -a DLRM_RUN_ARGV <<< "${DLRM_TORCHRUN_ARGS:-}"
  pipe=${DLRM_PIPELINE:-sparse_dist}
  for n in ${DLRM_WORLDS:-1 2}; do
    for batch in ${DLRM_BATCH:-2048}; do
      name=dlrm_train_${DLRM_NAME:-$pipe}_w${n}_b$batch
      log "DLRM training, --sharding pgas --pipeline $pipe --validate, $n ranks, batch $batch: ${DLRM_ARGV[*]}"
      timeout "${DLRM_TIMEOUT:-240}" "$PY" -m torch.distributed.run --nproc_per_node="$n" "${DLRM_RUN_ARGV[@]}" \
        -m examples.dlrm.run \
        --sharding pgas --train --pipeline "$pipe" --batch-size "$batch" --steps "${DLRM_STEPS:-50}" \
        --max-rows 1000000 --validate --report "$OUT/$name.json" "${DLRM_ARGV[@]}" > /tmp/dlrm.log 2>&1
      echo "$name exit $?" | tee -a "$OUT/summary.txt"
      { echo "### $name: ${DLRM_ARGV[*]}"; cat /tmp/dlrm.log; } >> "$OUT/dlrm_train.log"
      grep -E "DLRM|^samples/s|validate|Error|off the graph" /tmp/dlrm.log | tail -8 | tee -a "$OUT/summary.txt"
    done
  done
fi
log "done"
