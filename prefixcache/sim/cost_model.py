"""The roofline cost model, re-exported: it lives in ``prefixcache.cost_model``.

The model sits below ``prefixcache.core`` (the ``cost`` eviction policy reads its
FLOPs), so ``core`` never imports ``prefixcache.sim``; this module keeps the old
import path (``from prefixcache.sim.cost_model import CostModel``) working.
"""

from prefixcache.cost_model import (  # noqa: F401 - the public names, re-exported
    ACCELERATORS,
    Accelerator,
    CostModel,
    HOST_LINKS,
    HostLink,
    MODEL_PRESETS,
    ModelShape,
    decode_bytes,
    get_accelerator,
    get_host_link,
    kv_bytes,
    prefill_flops,
)

__all__ = [
    "ACCELERATORS",
    "Accelerator",
    "CostModel",
    "HOST_LINKS",
    "HostLink",
    "MODEL_PRESETS",
    "ModelShape",
    "decode_bytes",
    "get_accelerator",
    "get_host_link",
    "kv_bytes",
    "prefill_flops",
]
