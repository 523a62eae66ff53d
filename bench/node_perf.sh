#!/bin/bash
# Issue 38's table on a real node, in one call: the benchmarks with the GPU hidden (16 ranks, one
# per core, 3 repeats, medians), then the same on the GPU while time is left, all under a total
# timeout (9 minutes by default); results and a summary table under $OUT.
#
#     bash bench/node_perf.sh [--wheels DIR] [--quick] [--no-gpu] [--budget SECONDS]
#
# --wheels DIR  Open MPI and mpi4py wheels to install first (default: .whl/ if it holds any), for
#               a machine with no MPI: installed with pip --no-index under $MPI_PREFIX (/tmp/mpi).
#               Without them (or with --wheels none), the mpirun on PATH and the mpi4py of
#               $PYTHON are used.
# --quick       4 ranks, one repeat, few steps and small buffers: checks the script end to end.
# --no-gpu      skip the runs with --device cuda (they are skipped anyway without a GPU).
# --budget S    the whole script's limit in seconds (default 540); each run gets what is left,
#               less 25 s kept for the summary, at most its share (its cap, scaled by S / 540);
#               a run that would not fit is skipped and listed. On the 2-core machine,
#               `--no-gpu --budget 1800` gives the CPU-seconds comparison of issue 38.
#
# Writes at most 8 files into $OUT (default /tmp/node_perf), as the device tool brings back:
# throughput_{cpu,cuda}.json, sync_overhead_{cpu,cuda}.json, startup_{cpu,cuda}.json,
# node_perf.log (every run's output) and summary.md (bench/node_perf_table.py's table).
# PYTHON (default python3) is the interpreter with torch. See bench/results/README.md.
set -u
START=$(date +%s)
QUICK=0 GPU=1 BUDGET=540 WHEELS=""
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) QUICK=1 ;;
    --no-gpu) GPU=0 ;;
    --budget) BUDGET=$2; shift ;;
    --wheels) WHEELS=$2; shift ;;
    *) echo "node_perf: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done
# The safety net: the whole script, whatever hangs, ends within the budget.
if [ -z "${NODE_PERF_INNER:-}" ]; then
  NODE_PERF_INNER=$START exec timeout -k 5 "$BUDGET" bash "$0" \
    $([ $QUICK = 1 ] && echo --quick) $([ $GPU = 0 ] && echo --no-gpu) \
    --budget "$BUDGET" ${WHEELS:+--wheels "$WHEELS"}
fi
START=$NODE_PERF_INNER
DEADLINE=$((START + BUDGET - 25))  # 25 s kept for the summary
OUT=${OUT:-/tmp/node_perf}
mkdir -p "$OUT"
LOG=$OUT/node_perf.log
PY=${PYTHON:-python3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
export PYTHONUNBUFFERED=1 HOME=${HOME:-/root} OMP_NUM_THREADS=1
exec > >(tee -a "$LOG") 2>&1
echo "== node_perf $(date -u +%FT%TZ): quick=$QUICK gpu=$GPU budget=${BUDGET}s, $(nproc --all) CPUs"

# ---- MPI: the carried wheels, else what is installed
if [ -z "$WHEELS" ] && compgen -G ".whl/*.whl" >/dev/null; then WHEELS=.whl; fi
if [ -n "$WHEELS" ] && [ "$WHEELS" != none ]; then
  PREFIX=${MPI_PREFIX:-/tmp/mpi}
  if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
    echo "node_perf: no wheels in $WHEELS"; exit 1
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --ignore-installed \
    --prefix "$PREFIX" "$WHEELS"/*.whl || { echo "node_perf: pip install failed"; exit 1; }
  SITE=$(echo "$PREFIX"/lib/python3*/site-packages)
  export PATH=$PREFIX/bin:$PATH LD_LIBRARY_PATH=$PREFIX/lib:${LD_LIBRARY_PATH:-}
  export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
fi
command -v mpirun >/dev/null || { echo "node_perf: no mpirun (give --wheels DIR)"; exit 1; }
# One machine, as root: allow it, and more ranks than cores (as the Makefile and tests do).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_osc=rdma OMPI_MCA_pml=ob1
export OMPI_MCA_btl=self,sm,tcp OMPI_MCA_mpi_yield_when_idle=1
"$PY" -c "import mpi4py, torch; from mpi4py import MPI
print('mpi4py', mpi4py.__version__, mpi4py.__file__); print(MPI.Get_library_version().splitlines()[0].rstrip(chr(0)))
print('torch', torch.__version__, 'cuda', torch.version.cuda)" || { echo "node_perf: no mpi4py"; exit 1; }
mpirun --version | head -1
command -v nvidia-smi >/dev/null && nvidia-smi -L
grep -m1 "model name" /proc/cpuinfo
command -v lscpu >/dev/null && lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA node\(s\))"

# ---- the runs
if [ $QUICK = 1 ]; then
  RANKS=4
  TP="--steps 32 --warmup 16 --reps 1"
  SO="--sizes 0.25,1 --reps 3 --runs 1"
  SO_GPU=$SO
  ST="--repeat 1"
else
  RANKS=16
  TP="--steps 160 --warmup 16 --reps 3"
  SO="--sizes 1,25,100 --reps 11 --runs 3"
  SO_GPU="--sizes 1,25 --reps 11 --runs 3"
  ST="--repeat 3"
fi
SKIPPED=()
# run NAME NEED CAP CMD...: CMD under the time left (at most CAP s), unless less than NEED s is.
run() {
  local name=$1 need=$2 cap=$(($3 * BUDGET / 540)); shift 3
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt "$need" ]; then
    echo "== $name: skipped (${left}s left, needs ${need}s)"; SKIPPED+=("$name"); return
  fi
  [ "$left" -gt "$cap" ] && left=$cap
  echo "== $name (limit ${left}s): $*"
  local t0=$(date +%s)
  timeout -k 5 "$left" "$@"
  local rc=$?
  echo "== $name: exit $rc after $(($(date +%s) - t0))s"
  [ $rc = 0 ] || SKIPPED+=("$name (exit $rc)")
}
MPI_RUN=(mpirun -n "$RANKS" "$PY")
# The GPU hidden: the benchmarks' --device cpu sets CUDA_VISIBLE_DEVICES="" in every rank before
# torch loads; it is set here as well, so that nothing in the job sees the GPU.
CPU_ENV=(env CUDA_VISIBLE_DEVICES= GEOMPI_DEVICE=cpu)
run throughput_cpu 60 200 "${CPU_ENV[@]}" "${MPI_RUN[@]}" bench/throughput.py $TP \
  --device cpu --out "$OUT/throughput_cpu.json"
run sync_overhead_cpu 60 200 "${CPU_ENV[@]}" "${MPI_RUN[@]}" bench/sync_overhead.py $SO \
  --device cpu --out "$OUT/sync_overhead_cpu.json"
run startup_cpu 40 120 "${CPU_ENV[@]}" "$PY" bench/startup.py --ranks "$RANKS" $ST \
  --device cpu --out "$OUT/startup_cpu.json"
if [ $GPU = 1 ] && "$PY" -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  run throughput_cuda 90 200 "${MPI_RUN[@]}" bench/throughput.py $TP \
    --device cuda --out "$OUT/throughput_cuda.json"
  run sync_overhead_cuda 60 150 "${MPI_RUN[@]}" bench/sync_overhead.py $SO_GPU \
    --device cuda --out "$OUT/sync_overhead_cuda.json"
  run startup_cuda 50 100 "$PY" bench/startup.py --ranks "$RANKS" $ST \
    --device cuda --out "$OUT/startup_cuda.json"
else
  echo "== GPU runs: skipped (--no-gpu, or torch sees no GPU)"
fi

# ---- the summary
"$PY" bench/node_perf_table.py "$OUT" --skipped "$(IFS=';'; echo "${SKIPPED[*]:-}")" \
  --out "$OUT/summary.md"
echo "== node_perf: done in $(($(date +%s) - START))s; files in $OUT:"
ls -la "$OUT"
