"""An OpenAI-compatible HTTP server over the engine.

    prefixcache serve tiny --port 8000            # or: python -m prefixcache.serve tiny

Modules: `cli` (the command and its vLLM-named flags), `app` (`build_app`: the FastAPI
endpoints), `engine_core` (`EngineCore` and its messages), `engine_loop`
(`EngineCoreClient`: the engine in its own process, the default; `ServingEngine`: on a
thread of this one), `protocol` (request validation, OpenAI-style `APIError`),
`metrics` (`ServerMetrics`: Prometheus, vLLM's names with prefix `prefixcache:`),
`kv_events` (`KVEventPublisher`: vLLM 0.33's ZMQ wire format). Needs the `serve` extra
(fastapi, uvicorn, prometheus_client, pyzmq, msgspec). Binds 127.0.0.1 unless told otherwise.
"""

__all__ = ["build_app", "EngineCoreClient", "ServingEngine", "main"]


def __getattr__(name):
    # NOTE: lazy, so `prefixcache serve --help` and bad flags answer before fastapi,
    # uvicorn or jax are imported.
    if name == "build_app":
        from prefixcache.serve.app import build_app
        return build_app
    if name == "ServingEngine":
        from prefixcache.serve.engine_loop import ServingEngine
        return ServingEngine
    if name == "EngineCoreClient":
        from prefixcache.serve.engine_loop import EngineCoreClient
        return EngineCoreClient
    if name == "main":
        from prefixcache.serve.cli import main
        return main
    raise AttributeError(f"module 'prefixcache.serve' has no attribute {name!r}")
