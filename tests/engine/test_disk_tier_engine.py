"""The disk tier end to end in the Engine: pages go device -> host -> disk -> back and
the outputs equal a cache-off engine's; a corrupted page file is a miss, never wrong KV;
a restart over the directory reuses its pages; bad disk options fail before anything
is built."""

from __future__ import annotations

import os

import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig

BS = 16
# A device pool far smaller than the working set and a host tier of 4 blocks: five
# families of requests share a 96-token (6-block) prefix each; a family's prefix is
# pushed off the device and out of the host (to disk) by the next four before it is
# revisited. One shape bucket each: one compiled step program.
COMMON = dict(num_blocks=20, block_size=BS, seed=0, max_num_seqs=2,
              max_num_batched_tokens=64, max_model_len=256, token_buckets=(64,),
              seq_buckets=(2,), page_buckets=(16,))
PARAMS = SamplingParams(max_tokens=4)
PAGE_BYTES = 2 * BS * 2 * 2 * 64 * 4  # layers x page x 2K x head_dim x f32 (tiny)
DISK = dict(num_host_blocks=4, disk_bytes=64 * PAGE_BYTES)


def _rounds(visits=2):
    rng = np.random.default_rng(11)
    prefixes = [rng.integers(1, 512, 6 * BS).tolist() for _ in range(5)]
    rounds = []
    for visit in range(visits):
        for f, prefix in enumerate(prefixes):
            rounds.append([(f"f{f}v{visit}r{k}", prefix + rng.integers(1, 512, n).tolist())
                           for k, n in enumerate((5, 21))])
    return rounds


def _serve(engine, rounds):
    tokens, logits = {}, {}
    engine.record_logits = True
    engine.step_logits.clear()
    for batch in rounds:
        for rid, prompt in batch:
            engine.add_request(prompt, PARAMS, request_id=rid)
        while engine.has_unfinished_requests():
            for out in engine.step():
                assert out.error is None, out.error
                tokens[out.request_id] = out.token_ids
    for step in engine.step_logits:
        for rid, row in step.items():
            logits.setdefault(rid, []).append(row)
    return tokens, {k: np.stack(v) for k, v in logits.items()}


def _same(got, want):
    assert got[0] == {k: want[0][k] for k in got[0]}
    for rid, rows in got[1].items():
        np.testing.assert_allclose(rows, want[1][rid], atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def off():
    """The cache-off engine and its outputs (the reference)."""
    eng = Engine(ModelConfig.tiny(), enable_caching=False, **COMMON)
    return eng, _serve(eng, _rounds())


def _disk_engine(off_engine, disk_dir, **kw):
    return Engine(ModelConfig.tiny(), share_programs_with=off_engine, **COMMON, **DISK,
                  disk_dir=disk_dir, **kw)


def test_device_host_disk_and_back_equals_cache_off(off, tmp_path):
    eng = _disk_engine(off[0], tmp_path)
    programs = eng.num_programs_built
    _same(_serve(eng, _rounds()), off[1])
    eng.runner.host_pages.flush_files()  # (page files are written on a writer thread)
    m = eng.metrics()
    assert m.disk_blocks_stored > 0 and m.disk_blocks_loaded > 0
    assert m.hit_tokens_by_tier["disk"] == m.disk_blocks_loaded * BS
    assert m.hit_tokens_by_tier["device"] > 0 and m.hit_tokens_by_tier["host"] >= 0
    assert sum(m.hit_tokens_by_tier.values()) == m.num_cached_tokens
    assert m.disk_bytes_stored == m.disk_blocks_stored * PAGE_BYTES
    assert m.disk_corrupt == 0 and m.disk_write_errors == 0
    files = eng.disk_files
    assert m.disk_used_bytes == files.nbytes == sum(
        os.path.getsize(os.path.join(tmp_path, n)) for n in os.listdir(tmp_path))
    # The page files on disk are exactly the blocks the core disk tier holds.
    tier = eng.kv_cache_manager.tier_chain.get("disk")
    assert {k.to_bytes(tier.key_bytes, "big") for k, _ in files.keys()} >= set(tier.entries)
    eng.kv_cache_manager.check_invariants()
    # The disk copies ran in the host tier's copy programs: no new step program.
    assert eng.num_programs_built - programs == len(eng.runner.host_pages.compiled_shapes)


def test_radix_index_with_the_disk_tier_equals_cache_off(off, tmp_path):
    eng = _disk_engine(off[0], tmp_path, index="radix")
    _same(_serve(eng, _rounds()), off[1])
    m = eng.metrics()
    assert m.disk_blocks_loaded > 0 and m.hit_tokens_by_tier["disk"] == m.disk_blocks_loaded * BS
    eng.kv_cache_manager.check_invariants()


def test_a_tier_of_ones_own_and_a_remote_store_keep_pages_in_memory(off):
    # A toy tier (a KeyTier subclass, no edit of prefixcache/) under a 4-slot host tier,
    # then a remote store: the engine keeps their pages in host memory.
    from prefixcache.core.tiers import KeyTier, TierLink

    class SlowMemory(KeyTier):
        name, medium, link = "slow", "SLOW", TierLink(1e9, 1e-3)

    eng = Engine(ModelConfig.tiny(), share_programs_with=off[0], **COMMON,
                 num_host_blocks=4, manager_kwargs={
                     "tiers": ({"tier": SlowMemory, "num_blocks": 12},),
                     "remote_bytes": 64 * PAGE_BYTES})
    _same(_serve(eng, _rounds()), off[1])
    by_tier = eng.metrics().hit_tokens_by_tier
    assert by_tier["slow"] > 0 and by_tier["remote"] > 0
    pages = eng.runner.host_pages
    assert pages.num_loaded_by_tier["slow"] * BS == by_tier["slow"]
    assert set(pages.stores) == {"slow", "remote"} and eng.disk_files is None
    chain = eng.kv_cache_manager.tier_chain
    for name in ("slow", "remote"):  # every block a tier holds has its page
        held = {k for k, _ in pages.stores[name].keys()}
        assert held >= {int.from_bytes(h, "big") for h in chain.get(name).entries}
    eng.kv_cache_manager.check_invariants()


def test_a_full_disk_evicts_and_its_files_stay_bounded(off, tmp_path):
    eng = Engine(ModelConfig.tiny(), share_programs_with=off[0], **COMMON,
                 num_host_blocks=4, disk_bytes=6 * PAGE_BYTES, disk_dir=tmp_path)
    _same(_serve(eng, _rounds()), off[1])
    eng.runner.host_pages.flush_files()
    tier = eng.kv_cache_manager.tier_chain.get("disk")
    assert tier.num_blocks == 6 and len(tier) <= 6 and tier.num_evicted > 0
    files = eng.disk_files
    eng._maybe_collect_disk()  # (what the next step does, its writes landed)
    assert files.nbytes <= eng._disk_collect_bytes
    assert len(files) <= eng._disk_collect_bytes // PAGE_BYTES  # 6 pages x 5/4 (+ headers)
    held = {k.to_bytes(tier.key_bytes, "big") for k, _ in files.keys()}
    assert held >= set(tier.entries)  # every block the tier holds has its file


def test_corrupt_page_files_are_misses_never_wrong_kv(off, tmp_path):
    eng = _disk_engine(off[0], tmp_path)
    rounds = _rounds()
    _serve(eng, rounds[:5])  # the first visit: the prefixes reach the disk
    eng.runner.host_pages.flush_files()
    names = [n for n in os.listdir(tmp_path) if n.endswith(".kvpage")]
    assert names
    corrupted = {}
    for n in names:  # one flipped bit in each page's payload
        with open(os.path.join(tmp_path, n), "r+b") as f:
            f.seek(-7, 2)
            b = f.read(1)
            f.seek(-7, 2)
            f.write(bytes([b[0] ^ 0x10]))
            f.seek(0)
            corrupted[n] = f.read()
    read = eng.disk_files.read
    served = []

    def spy_read(key, group=0):
        got = read(key, group)
        if got is not None:
            served.append(eng.disk_files.path(key, group))
        return got

    eng.disk_files.read = spy_read
    got = _serve(eng, rounds[5:])
    want = ({k: v for k, v in off[1][0].items() if "v1" in k},
            {k: v for k, v in off[1][1].items() if "v1" in k})
    _same(got, want)
    m = eng.metrics()
    assert m.disk_corrupt > 0 and eng._disk_tier().num_corrupt == m.disk_corrupt
    # Every page read and served since was written after the corruption (none of the
    # corrupted files passed a check), and the corrupted files that were found are gone.
    assert served and m.disk_blocks_loaded > 0
    for path in served:
        with open(path, "rb") as f:
            assert f.read() != corrupted.get(os.path.basename(path))
    # (recomputed after the miss, such a block is demoted again: its file is rewritten)
    still = [n for n in names if os.path.exists(os.path.join(tmp_path, n))
             and open(os.path.join(tmp_path, n), "rb").read() == corrupted[n]]
    assert len(names) - len(still) >= m.disk_corrupt


def test_failed_step_resets_the_disk_tier_and_serves_no_stale_page(off, tmp_path):
    from prefixcache.engine.faults import StepFault

    eng = _disk_engine(off[0], tmp_path)
    rounds = _rounds()
    for batch in rounds[:5]:  # the first visit: the disk tier fills
        for rid, prompt in batch:
            eng.add_request(prompt, PARAMS, request_id=rid)
        while eng.has_unfinished_requests():
            eng.step()
    tier = eng.kv_cache_manager.tier_chain.get("disk")
    assert len(tier) > 0
    fault = StepFault(1, kind="kv_lost").attach(eng)
    for rid, prompt in rounds[5]:
        eng.add_request(prompt, PARAMS, request_id=rid)
    while eng.has_unfinished_requests():
        eng.step()
        if fault.fired:
            eng.fault_injector = None
    assert fault.fired
    # Every tier was reset: what the disk holds now was stored after the fault.
    written = set()
    write = eng.disk_files.write

    def spy_write(key, group, arrays):
        written.add(key)
        write(key, group, arrays)

    eng.disk_files.write = spy_write
    loaded = []
    read = eng.disk_files.read

    def spy_read(key, group=0):
        got = read(key, group)
        if got is not None:
            loaded.append(key)
        return got

    eng.disk_files.read = spy_read
    for i, batch in enumerate(rounds[1:5] + rounds[:5]):
        for rid, prompt in batch:
            eng.add_request(prompt, PARAMS, request_id=f"{rid}:{i}")
        while eng.has_unfinished_requests():
            for o in eng.step():
                assert o.error is None
                assert o.token_ids == off[1][0][o.request_id.split(":")[0]]
    assert loaded and set(loaded) <= written  # no page of before the reset was served
    eng.kv_cache_manager.check_invariants()


def test_restart_reuses_the_pages_of_the_same_model(off, tmp_path):
    first = _disk_engine(off[0], tmp_path)
    _serve(first, _rounds(visits=1))
    first.runner.host_pages.flush_files()
    kept = first.disk_files.keys()
    assert kept
    # A second engine over the directory (same model, block size, hash): preloaded.
    again = _disk_engine(off[0], tmp_path, disk_reuse=True)
    assert again.disk_fingerprint == first.disk_fingerprint
    assert len(again._disk_tier()) == len(kept)
    got = _serve(again, _rounds(visits=1))  # the first visit again: the same prompts
    _same(got, off[1])
    assert again.metrics().hit_tokens_by_tier["disk"] > 0
    # Without reuse the directory's pages of this fingerprint are deleted at start.
    fresh = _disk_engine(off[0], tmp_path)
    assert fresh.disk_files.keys() == [] and len(fresh._disk_tier()) == 0
    # Another model (other weights): its fingerprint differs, nothing is reused.
    from prefixcache.engine.engine import _init_model, disk_fingerprint

    def fingerprint(model, **kw):
        kw = {"kv_dtype": first.kv_dtype, "block_size": BS, "hash_algo": "sha256",
              "hash_seed": None, **kw}
        return disk_fingerprint(model, first.model_config, **kw)

    assert fingerprint(first.model) == first.disk_fingerprint
    assert fingerprint(_init_model(ModelConfig.tiny(), 1)) != first.disk_fingerprint
    assert fingerprint(first.model, block_size=8) != first.disk_fingerprint
    assert fingerprint(first.model, hash_seed=3) != first.disk_fingerprint


@pytest.mark.parametrize("kw, match", [
    (dict(num_host_blocks=4, disk_bytes=1 << 20), "disk_dir"),
    (dict(num_host_blocks=4, disk_dir="d"), "disk_bytes"),
    (dict(num_host_blocks=4, disk_dir="d", disk_bytes=0, disk_reuse=True), "disk_bytes"),
    (dict(disk_dir="d", disk_bytes=1 << 20), "num_host_blocks"),
    (dict(num_host_blocks=4, disk_dir="d", disk_bytes="lots"), "disk_bytes='lots'"),
    (dict(num_host_blocks=4, disk_dir="d", disk_bytes=1 << 20, disk_reuse="yes"),
     "disk_reuse"),
    (dict(num_host_blocks=4, disk_dir="d", disk_bytes=1 << 20, disk_eviction="belady"),
     "disk_eviction"),
    (dict(num_host_blocks=4, disk_dir="d", disk_bytes=1 << 20, disk_reuse=True,
          hash_algo="xxhash"), "hash_seed"),
])
def test_bad_disk_options_fail_before_anything_is_built(kw, match, tmp_path, monkeypatch):
    import prefixcache.engine.engine as engine_mod

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(engine_mod, "_init_model", lambda *a: pytest.fail("model built"))
    with pytest.raises(ValueError, match=match):
        Engine(ModelConfig.tiny(), num_blocks=8, **kw)
    assert not os.path.exists(tmp_path / "d")


@pytest.mark.parametrize("cfg, match", [
    (dict(disk_bytes=1 << 20, page_bytes=1000), "page_bytes=1000"),
])
def test_cache_config_tiers_the_engine_cannot_serve_are_refused(cfg, match, monkeypatch):
    import prefixcache.engine.engine as engine_mod
    from prefixcache.core.cache_config import CacheConfig

    monkeypatch.setattr(engine_mod, "_init_model", lambda *a: pytest.fail("model built"))
    with pytest.raises(ValueError, match=match):
        Engine(ModelConfig.tiny(), disk_dir="unused",
               cache_config=CacheConfig(num_blocks=8, num_host_blocks=4, **cfg))


def test_cache_config_disk_fields_reach_the_engine(tmp_path):
    from prefixcache.core.cache_config import CacheConfig

    cfg = CacheConfig(num_blocks=8, block_size=BS, num_host_blocks=4,
                      disk_bytes=8 * PAGE_BYTES, disk_eviction="fifo", page_bytes=PAGE_BYTES)
    eng = Engine(ModelConfig.tiny(), cache_config=cfg, disk_dir=tmp_path)
    tier = eng.kv_cache_manager.tier_chain.get("disk")
    assert tier.num_blocks == 8 and tier.eviction == "fifo"
    assert tier.validator == eng.runner.host_pages.validate


def test_disk_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        Engine(ModelConfig.tiny(), num_blocks=8, num_host_blocks=4, disk_bytes=1 << 20,
               disk_dir=tmp_path / "f")
