"""AIPerf replays the Mooncake conversation trace against `prefixcache serve tiny`.

Runs experiments.serve_trace: the first 40 requests of the Mooncake conversation trace
(prefixcache.sim.datasets `mooncake_conversation`; point $PREFIXCACHE_DATA at a local
copy), each hash id standing for 16 tokens instead of 512 (prompts of 2-2,700 tokens),
outputs capped at 16 tokens, the trace's timestamps kept; one tiny-model server with
512 blocks of 16 tokens and 8 sequences at once; AIPerf (bash
experiments/peers/setup_aiperf_env.sh) as the client. Prediction:
prefixcache.sim.replay.replay of the same rewritten trace, 8 at a time.

Command:
  python -m experiments.serve_trace --config=configs/serve_trace.py --workdir=/tmp/st
  python -m experiments.serve_trace --config=configs/serve_trace.py:quick --workdir=/tmp/stq

Expected: the served hit rate within a few points of the predicted one, below it where
the tiny tokenizer's merges cross hash-id block boundaries (served_prompt_tokens differs
from predicted_prompt_tokens by those merges); AIPerf's TTFT / ITL / throughput of this
machine in the row. Quick variant (`:quick`: the first 12 requests, outputs of 4 tokens,
timestamps x 0.1) is what the tests run.
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.requests_config("shared_system_prompt", dataset="mooncake_conversation")
    c.max_requests = 40
    c.serve_model = "tiny"  # MODEL_OR_PATH of `prefixcache serve`
    c.served_model_name = "tiny"
    c.tokens_per_hash_id = 16  # tokens each 512-token hash id stands for when served
    c.max_output_tokens = 16
    c.time_scale = 1.0  # multiplies the trace's timestamps
    c.num_blocks = 512
    # The server's KV block (the trace's own 512-token hash-id blocks are rescaled to
    # tokens_per_hash_id, which it must divide).
    c.server_block_size = 16
    c.max_num_seqs = 8
    c.max_model_len = 4096
    c.serve_flags = "--max-num-batched-tokens 512"  # more `prefixcache serve` flags
    c.aiperf = ""  # the aiperf executable ("": on PATH or the peer venv)
    c.aiperf_flags = ""  # more `aiperf profile` flags
    c.startup_timeout_s = 1800.0
    c.request_timeout_s = 600.0
    c.aiperf_timeout_s = 1800.0
    if quick:
        c.max_requests = 12
        c.max_output_tokens = 4
        c.time_scale = 0.1
        c.num_blocks = 256
        c.max_num_seqs = 4
        c.serve_flags = "--max-num-batched-tokens 256"
    return c
