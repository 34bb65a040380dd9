#!/usr/bin/env bash
# One-call GPU check (the device machine): compiled Pallas GPU kernel tests, the
# paged-attention benchmark in bf16 with the decode tile sweep and jax's own GPU decode
# kernel side by side, and the main job (engine + Pallas GPU kernel) end to end.
#
# Usage (repo root, on a machine with a CUDA jax; logs go to LOG_DIR):
#   bash experiments/gpu_check.sh LOG_DIR [STEP ...]
# STEPs: pytest bench bench_small quickstart (default: pytest bench quickstart).
# Missing cbor2 / ml-collections can be carried as wheels in .whl/ (installed to /tmp/site).
set -u
LOG="${1:?usage: gpu_check.sh LOG_DIR [STEP ...]}"
shift
STEPS="${*:-pytest bench quickstart}"
mkdir -p "$LOG"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
# cpu too: the TPU kernel's interpret mode (a test) calls back to the host.
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu TF_CPP_MIN_LOG_LEVEL=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOG/env.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  2>&1 | tee -a "$LOG/env.txt"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" >"$LOG/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - t0)) s" | tee -a "$LOG/env.txt"
  grep -v "^[IW][0-9]" "$LOG/$name.log" | tail -n 25 | cut -c1-400
}
for s in $STEPS; do
  case $s in
    pytest) step pytest_gpu 150 python3 -m pytest -q -p no:cacheprovider tests/kernels \
              -k "(TestPallasGPU and not Interpret) or gpu_decode or Reference" ;;
    bench) step bench_bf16 240 python3 -m experiments.bench_kernels --dtype=bfloat16 --tile_sweep ;;
    bench_small) step bench_small 120 python3 -m experiments.bench_kernels --sizes=small \
                   --dtype=bfloat16 --tile_sweep ;;
    quickstart) step quickstart 150 python3 -m experiments.quickstart --workdir=/tmp/qs
                cp /tmp/qs/results.jsonl "$LOG/quickstart_results.jsonl" 2>/dev/null ;;
    *) echo "unknown step $s"; exit 2 ;;
  esac
done
exit 0
