#!/usr/bin/env bash
# Install vLLM's real v1 KV cache manager, CPU only, into its own virtual environment,
# so that experiments/peers/vllm_replay.py can replay traces through it for side-by-side comparison.
#
#   bash experiments/peers/setup_vllm_env.sh [VENV_DIR]      (default: ~/.cache/prefixcache-peers/vllm-venv)
#
# vLLM is installed without its dependency resolver (its pinned CUDA build of torch is
# several GB); only the modules that the KV cache manager imports are installed, with the
# CPU build of torch. Prints the python path to pass as --vllm_python.
set -euo pipefail
VENV="${1:-$HOME/.cache/prefixcache-peers/vllm-venv}"
VLLM_VERSION="${VLLM_VERSION:-0.33.0}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" --no-deps "vllm==$VLLM_VERSION"
"${PIP[@]}" numpy packaging psutil pyzmq urllib3 regex msgspec pydantic cbor2 xxhash \
  transformers aiohttp requests openai-harmony openai pillow pybase64 cachetools \
  cloudpickle uvloop py-cpuinfo prometheus_client xgrammar fastapi partial_json_parser \
  llguidance
"$VENV/bin/python" - <<'PY'
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: F401
import vllm
print("vLLM", vllm.__version__, "KV cache manager importable")
PY
echo "$VENV/bin/python"
