"""Miss accounting moved to ``prefixcache.core.misses`` (it is the cache's own
bookkeeping, read by the engine and the server as well as the simulators); this name
stays importable for existing code and is the same module object, so
``prefixcache.sim.misses is prefixcache.core.misses``."""

import sys

from prefixcache.core import misses as _misses

sys.modules[__name__] = _misses
