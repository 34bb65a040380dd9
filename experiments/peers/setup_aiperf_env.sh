#!/usr/bin/env bash
# AIPerf (NVIDIA's benchmark client, PyPI `aiperf`) in its own virtual environment, for
# experiments.serve_trace: it pins its own transformers / pydantic / pyzmq, so it never
# shares a venv with prefixcache. No torch: it installs in a few minutes.
#
#   bash experiments/peers/setup_aiperf_env.sh [VENV_DIR]
#       (default VENV_DIR: ~/.cache/prefixcache-peers/aiperf-venv)
#   python -m experiments.serve_trace --config=configs/serve_trace.py:quick --workdir=/tmp/stq \
#       --config.aiperf="$(bash experiments/peers/setup_aiperf_env.sh | tail -1)"
#
# Prints the path of the `aiperf` executable last.
set -euo pipefail
VENV="${1:-$HOME/.cache/prefixcache-peers/aiperf-venv}"
if [ ! -x "$VENV/bin/aiperf" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check 'aiperf>=0.13'
fi
"$VENV/bin/aiperf" --version >/dev/null 2>&1 || "$VENV/bin/aiperf" --help >/dev/null
echo "$VENV/bin/aiperf"
