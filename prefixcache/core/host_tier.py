"""The host-memory tier, re-exported: it lives in ``prefixcache.core.tiers.host``
(one tier of the chain under the device pool, ``prefixcache.core.tiers``)."""

from prefixcache.core.tiers.host import (  # noqa: F401 - the old import path
    HOST_LOAD,
    HOST_STORE,
    GroupHostTier,
    GroupHostTransfer,
    HostBlock,
    HostHit,
    HostTier,
    HostTierAPI,
    HostTransfer,
    check_host_args,
    check_tier_args,
    make_host_tier,
)
