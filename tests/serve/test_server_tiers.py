"""The server with the host and disk tiers: `/metrics` splits the prefix-cache hits by
tier (`prefixcache:prefix_cache_hits_total{tier=...}`, vLLM's series kept), the
`--disk-*` flags reach the Engine, and KV events carry each tier's `medium`."""

from __future__ import annotations

import collections

import httpx
import numpy as np
import openai
import pytest

from prefixcache.engine import Engine
from prefixcache.model import ModelConfig
from prefixcache.serve import cli
from prefixcache.serve.app import build_app

from serve_support import ServerThread  # noqa: E402  (tests/serve on sys.path)

BS = 16
PAGE_BYTES = 2 * BS * 2 * 2 * 64 * 4  # tiny: layers x page x 2K x head_dim x f32


def _hits(url) -> dict:
    """prefix_cache_hits_total by tier ("" for vLLM's series without one)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            if s.name == "prefixcache:prefix_cache_hits_total":
                assert s.labels["model_name"] == "tiny"
                out[s.labels.get("tier", "")] = s.value
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_tokenizer):
    # Device pool of 20 blocks, host tier of 4, disk of 64 pages: five 6-block prefixes
    # visited twice go device -> host -> disk -> back (as tests/engine's disk test).
    eng = Engine(ModelConfig.tiny(), num_blocks=20, block_size=BS, seed=0, max_num_seqs=2,
                 max_num_batched_tokens=64, max_model_len=256, token_buckets=(64,),
                 seq_buckets=(2,), page_buckets=(16,), num_host_blocks=4,
                 disk_dir=tmp_path_factory.mktemp("disk"), disk_bytes=64 * PAGE_BYTES)
    srv = ServerThread(build_app(eng, served_model_name="tiny", tokenizer=tiny_tokenizer))
    yield srv
    srv.close()


def test_metrics_split_hits_by_tier(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(3, 500, 6 * BS).tolist() for _ in range(5)]
    cached = 0
    for visit in range(2):
        for prefix in prefixes:
            r = client.completions.create(model="tiny", max_tokens=2, temperature=0,
                                          prompt=prefix + rng.integers(3, 500, 5).tolist())
            cached += r.usage.prompt_tokens_details.cached_tokens
    server.wait_idle()
    hits = _hits(server.url)
    by_tier = server.on_engine(lambda e: dict(e.kv_cache_manager.hit_tokens_by_tier))
    assert hits[""] == cached > 0  # vLLM's series, as before
    assert hits["disk"] > 0 and hits["disk"] == by_tier["disk"]
    assert {k: v for k, v in hits.items() if k} == {k: v for k, v in by_tier.items() if v}
    assert sum(v for k, v in hits.items() if k) == cached


def test_disk_flags_reach_the_engine(tmp_path, monkeypatch):
    seen = {}

    class FakeEngine:
        def __init__(self, config, **kw):
            seen.update(kw)

    import prefixcache.engine as engine_pkg

    monkeypatch.setattr(engine_pkg, "Engine", FakeEngine)
    args = cli.parse_args(["serve", "tiny", "--num-host-blocks", "8", "--disk-dir", str(tmp_path),
                           "--disk-bytes", "64MiB", "--disk-eviction", "fifo",
                           "--disk-reuse", "--no-warmup"])
    cli._build_engine(args)
    assert (seen["disk_dir"], seen["disk_bytes"], seen["disk_eviction"],
            seen["disk_reuse"]) == (str(tmp_path), 64 << 20, "fifo", True)
    seen.clear()
    cli._build_engine(cli.parse_args(["serve", "tiny", "--no-warmup"]))
    assert "disk_bytes" not in seen


@pytest.mark.parametrize("argv, match", [
    (["--num-host-blocks", "8", "--disk-bytes", "1MiB"], "--disk-bytes needs --disk-dir"),
    (["--num-host-blocks", "8", "--disk-dir", "d"], "need --disk-bytes"),
    (["--disk-dir", "d", "--disk-bytes", "1MiB"], "needs --num-host-blocks"),
])
def test_bad_disk_flags_are_named(argv, match, capsys):
    with pytest.raises(SystemExit):
        cli.parse_args(["serve", "tiny", *argv])
    assert match in capsys.readouterr().err


def test_kv_events_carry_the_disk_medium():
    # The publisher takes the manager's events after every step, as the server does.
    from prefixcache.core import KVCacheManager
    from prefixcache.core.request import Request
    from prefixcache.serve import kv_events as kv

    # Device 8 blocks of 4 tokens, host 2, disk 16: cached blocks move down the chain.
    m = KVCacheManager(8, 4, enable_events=True, num_host_blocks=2, disk_bytes=16 * 100,
                       page_bytes=100)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(1, 500, 12).tolist() for _ in range(4)]
    held = collections.defaultdict(collections.Counter)
    for i in range(16):
        req = Request(f"r{i}", prefixes[i % 4] + [1000 + i])
        blocks, hit = m.get_computed_blocks(req)
        assert m.allocate_slots(req, req.num_tokens - hit, hit, blocks) is not None
        req.num_computed_tokens = req.num_tokens
        m.free(req)
        m.take_tier_transfers()
        payload = kv.encode_batch([kv.to_wire(e) for e in m.take_events()], ts=0.0)
        for ev in kv.decode_batch(payload).events:
            if isinstance(ev, kv.BlockStored):
                held[ev.medium].update(ev.block_hashes)
            elif isinstance(ev, kv.BlockRemoved):
                held[ev.medium].subtract(ev.block_hashes)
    disk = m.tier_chain.get("disk")
    assert len(disk) > 0 and m.hit_tokens_by_tier["disk"] > 0
    mask = (1 << 64) - 1
    assert +held["DISK"] == collections.Counter(
        int.from_bytes(h, "big") & mask for h in disk.entries)
