"""An OpenAI-compatible HTTP server over the engine.

    prefixcache serve tiny --port 8000            # or: python -m prefixcache.serve tiny

Modules: `cli` (the command and its vLLM-named flags), `app` (`build_app`: the FastAPI
endpoints), `engine_loop` (`ServingEngine`: the one engine thread), `protocol` (request
validation, OpenAI-style `APIError`), `metrics` (`ServerMetrics`: Prometheus, vLLM's
names with prefix `prefixcache:`), `kv_events` (`KVEventPublisher`: vLLM 0.33's ZMQ
wire format). Needs the `serve` extra (fastapi, uvicorn, prometheus_client; pyzmq and
msgspec for KV events). Binds 127.0.0.1 unless told otherwise.
"""

__all__ = ["build_app", "ServingEngine", "main"]


def __getattr__(name):
    # NOTE: lazy, so `prefixcache serve --help` and bad flags answer before fastapi,
    # uvicorn or jax are imported.
    if name == "build_app":
        from prefixcache.serve.app import build_app
        return build_app
    if name == "ServingEngine":
        from prefixcache.serve.engine_loop import ServingEngine
        return ServingEngine
    if name == "main":
        from prefixcache.serve.cli import main
        return main
    raise AttributeError(f"module 'prefixcache.serve' has no attribute {name!r}")
