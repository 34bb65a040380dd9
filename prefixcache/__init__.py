"""prefixcache: automatic prefix caching of LLM KV caches (vLLM-compatible)."""
