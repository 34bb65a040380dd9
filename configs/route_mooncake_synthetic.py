"""Routing the real Mooncake synthetic trace across 4, 8 and 16 replicas.

The Mooncake FAST'25 synthetic trace (3,993 requests with its own timestamps; 512-token
hash blocks expanded to tokens), 512-token blocks, Llama-3.1-8B on one H100 per replica
(all HBM left after the weights), all six routing policies.

Command:
  python -m experiments.route --config=configs/route_mooncake_synthetic.py \
      --workdir=/tmp/route_ms

Expected: see WORKSPACE_NOTES.md ("Routing"). Quick variant (`:quick`: the first 300
requests on 2 and 4 replicas): 21 s wall on the shared 2-core dev machine (load average ~8).
"""

from configs import _base


def get_config(arg=None):
    quick = _base.variant(arg)
    c = _base.route_config(dataset="mooncake_synthetic")
    c.trace_format = "mooncake"
    c.replicas = "4,8,16"
    c.block_size = 512
    if quick:  # the first 300 requests on 2 and 4 replicas
        c.max_requests = 300
        c.replicas = "2,4"
    return c
