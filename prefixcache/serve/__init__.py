"""An OpenAI-compatible HTTP server over the engine (issue 23); ``kv_events``: the
manager's KV cache events on the wire, as vLLM 0.33's ``ZmqEventPublisher``."""
