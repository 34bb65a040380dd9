#!/usr/bin/env bash
# Install vLLM's real v1 KV cache manager, CPU only, into its own virtual environment,
# so that experiments/peers/vllm_replay.py can replay traces through it for side-by-side
# comparison (experiments.bench_manager --vllm_python=..., the replay goldens).
#
#   bash experiments/peers/setup_vllm_env.sh [VENV_DIR]
#       (default VENV_DIR: ~/.cache/prefixcache-peers/vllm-venv)
#
# vLLM is installed without its dependency resolver (its pinned CUDA build of torch is
# several GB); only the modules that the KV cache manager imports are installed, with the
# CPU build of torch (from the PyTorch CPU index, TORCH_INDEX_URL; offline with a local
# wheel, TORCH_INDEX_URL=file:///some/empty/dir skips the unreachable index). Versions are pinned by
# vllm-constraints.txt beside this script (the venv the published figures were measured
# with); PEER_CONSTRAINTS=other.txt replaces it ("" = unpinned), VLLM_VERSION picks
# another vLLM (then also change or drop the constraints). Prints the python path to
# pass as --vllm_python (last line).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="${1:-$HOME/.cache/prefixcache-peers/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
CONSTRAINTS="${PEER_CONSTRAINTS-$HERE/vllm-constraints.txt}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
if [ -n "$CONSTRAINTS" ]; then
  PIP+=(-c "$CONSTRAINTS")
fi
# NOTE: torch==X also matches the CPU index's X+cpu, which pip prefers (a higher version).
"${PIP[@]}" --extra-index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" numpy packaging psutil pyzmq urllib3 regex msgspec pydantic cbor2 xxhash \
  transformers aiohttp requests openai-harmony openai pillow pybase64 cachetools \
  cloudpickle uvloop py-cpuinfo prometheus_client xgrammar fastapi partial_json_parser \
  llguidance
# The client side of `vllm bench serve` (experiments/peers/run_bench_serve.sh): the CLI
# imports the server stack (uvicorn, watchfiles, orjson) and the model executor (einops);
# gguf lets transformers read a GGUF's tokenizer. No torch/CUDA packages (--no-deps).
"${PIP[@]}" --no-deps uvicorn watchfiles orjson einops gguf
# NOTE: -I (isolated): the check sees this venv's packages only, not the checkout's.
"$VENV/bin/python" -I - <<'PY'
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
import torch
import vllm
print("vLLM", vllm.__version__, "torch", torch.__version__, "- KV cache manager importable")
PY
echo "$VENV/bin/python"
