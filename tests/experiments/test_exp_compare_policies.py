"""experiments.compare_policies: the grid, its rows, the executors, bad input."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from experiments import _parallel
from experiments import compare_policies as cp
from prefixcache.sim import compare
from prefixcache.sim import workloads as wl
from prefixcache.sim.replay import replay
from prefixcache.sim.trace import write_trace

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_cfg_{name}", ROOT / "configs" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def _requests():
    return wl.rag(num_requests=30, num_documents=6, doc_len=(20, 80), system_len=32,
                  output_len=(2, 6), seed=4)


@pytest.fixture
def config(tmp_path):
    trace = tmp_path / "rag.jsonl"
    write_trace(trace, _requests())
    cfg = _load("compare_policies")
    cfg.trace, cfg.workdir = str(trace), str(tmp_path / "work")
    cfg.block_size, cfg.capacities, cfg.concurrency, cfg.workers = 8, "40,80,400", 2, 2
    cfg.policies, cfg.indexes = "lru", "hash"
    return cfg


def _strip(rows):
    """Rows without what may differ between runs (timings, provenance)."""
    drop = {"provenance", *compare.TIMING_FIELDS}
    return [{k: v for k, v in r.items() if k not in drop} for r in rows]


def _read(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def test_local_grid_rows_equal_direct_replays(config, capsys):
    out = cp.run(config)
    rows = _read(out["rows"])
    assert pathlib.Path(out["png"]).stat().st_size > 0
    all_cells = [r for r in rows if r["record"] == "cell"]
    ideal = [r for r in rows if r["record"] == "ideal"]
    # belady_bound adds the offline bound beside the configured policies.
    assert sorted((r["policy"], r["index"], r["num_blocks"]) for r in all_cells) == sorted(
        [(p, "hash", n) for p in ("lru", "belady") for n in (40, 80, 400)])
    cells = [r for r in all_cells if r["policy"] == "lru"]
    bound = {r["num_blocks"]: r for r in all_cells if r["policy"] == "belady"}
    for r in cells:
        assert bound[r["num_blocks"]]["hit_tokens"] >= r["hit_tokens"]
    reqs = _requests()
    for r in cells:
        s = replay(reqs, num_blocks=r["num_blocks"], block_size=8, concurrency=2,
                   free_order="unhashed_first", hash_algo="sha256")
        for k in ("requests", "prompt_tokens", "hit_tokens", "hit_rate_tokens",
                  "requests_with_hit", "evictions", "failed"):
            assert r[k] == s[k], (k, r, s)
        assert (r["block_size"], r["concurrency"], r["model"]) == (8, 2, "llama_3_1_8b")
        assert r["loop_s"] > 0 and r["cell_s"] >= r["loop_s"]
        prov = r["provenance"]
        assert prov["cache_state"] == "cold" and "lru" in prov["policies"]
        assert prov["config"]["trace"] == config.trace
    assert cells[0]["evictions"] > 0 and cells[0]["hit_tokens"] < cells[1]["hit_tokens"]
    (ideal,) = ideal
    assert ideal["evictions"] == 0 and ideal["num_blocks"] == compare.ideal_num_blocks(reqs, 8)
    assert ideal["hit_tokens"] >= max(r["hit_tokens"] for r in cells) > 0
    assert out["ideal_hit_rate_tokens"] == ideal["hit_rate_tokens"]
    table = capsys.readouterr().out
    assert "hash/lru" in table and f"{cells[0]['hit_rate_tokens']:.4f}" in table
    for field in ("stranded_blocks", "peak_cached_blocks", "peak_cached_bytes"):
        assert isinstance(cells[0][field], int), field  # reported by the replay now
    # Miss reasons per row (the replay's totals), and the distance to belady.
    for r in all_cells + [ideal]:
        s = replay(reqs, num_blocks=r["num_blocks"], block_size=8, concurrency=2,
                   free_order="unhashed_first", eviction=r["policy"], miss_reasons=True)
        assert r["miss_reasons"] == s["miss_reasons"]["reasons"]
        assert r["missed_blocks"] == sum(r["miss_reasons"][k] for k in
                                         ("cold", "evicted", "isolated", "partial",
                                          "last_token"))
        assert r["evicted_blocks"] == r["miss_reasons"]["evicted"]
    assert ideal["evicted_blocks"] == 0 and cells[0]["evicted_blocks"] > 0
    for r in all_cells:
        b = bound[r["num_blocks"]]
        assert r["belady_gap_tokens"] == b["hit_tokens"] - r["hit_tokens"]
        assert r["belady_gap_evicted_blocks"] == r["evicted_blocks"] - b["evicted_blocks"]
    assert "belady_gap_tokens" not in ideal
    assert "evicted_blocks by capacity" in table


@pytest.mark.parametrize("field, value, match", [
    ("policies", "lru,mru", "unknown eviction policy 'mru'"),
    ("indexes", "btree", "unknown index 'btree'"),
    ("capacities", "10,ten", "capacities"),
    ("executor", "dask", "unknown executor 'dask'"),
    ("hash_algo", "md5", "unknown hash_algo 'md5'"),
    ("free_order", "lifo", "unknown free_order 'lifo'"),
    ("model", "gpt5", "unknown model preset 'gpt5'"),
    ("trace", "/nonexistent/t.jsonl", "does not exist"),
])
def test_bad_input_is_refused_before_anything_runs(config, field, value, match):
    setattr(config, field, value)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        cp.run(config)
    assert not (pathlib.Path(config.workdir) / cp.ROWS_FILE).exists()


def test_belady_bound_joins_the_grid_when_registered(config, monkeypatch):
    monkeypatch.setattr(compare, "policy_names", lambda: ("lru", "lfu", "belady"))
    monkeypatch.setattr(compare, "check_replay_supports", lambda *a, **k: None)
    config.policies = "lfu,lru"
    assert cp.resolve_grid(config)["policies"] == ("lfu", "lru", "belady")
    config.policies = "belady,lru"
    assert cp.resolve_grid(config)["policies"] == ("belady", "lru")
    config.policies, config.belady_bound = "lru", False
    assert cp.resolve_grid(config)["policies"] == ("lru",)
    monkeypatch.setattr(compare, "policy_names", lambda: ("lru",))  # not registered: no bound
    config.belady_bound = True
    assert cp.resolve_grid(config)["policies"] == ("lru",)


def test_ray_executor_without_ray(config, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    config.executor = "ray"
    with pytest.raises(ValueError, match=r'needs Ray.*pip install -e "\.\[ray\]"'):
        cp.run(config)


def test_cli_last_line_and_error_line(config, tmp_path):
    base = [sys.executable, "-m", "experiments.compare_policies", f"--trace={config.trace}",
            "--block_size=8", "--capacities=40", "--policies=lru", "--indexes=hash",
            "--concurrency=2", "--workers=1", "--noprogress"]
    proc = subprocess.run([*base, f"--workdir={tmp_path / 'cli'}"], cwd=ROOT,
                          capture_output=True, text=True, check=True)
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert pathlib.Path(last["rows"]).exists() and pathlib.Path(last["png"]).exists()
    assert "hash/lru" in proc.stdout
    assert len(_read(last["rows"])) == 3  # lru, the belady bound (belady_bound) + the ideal
    bad = subprocess.run([*base, "--policies=lru,mru", f"--workdir={tmp_path / 'bad'}"],
                         cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and "unknown eviction policy 'mru'" in bad.stderr
    assert not (tmp_path / "bad" / cp.ROWS_FILE).exists()


def test_ray_and_local_executors_give_identical_rows(config, tmp_path):
    ray = pytest.importorskip("ray")
    local = _read(cp.run(config)["rows"])
    config.workdir, config.executor = str(tmp_path / "ray"), "ray"
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        remote = _read(cp.run(config)["rows"])
        assert ray.is_initialized()  # a Ray the caller started is left running
    finally:
        ray.shutdown()
    assert _strip(remote) == _strip(local)
    assert remote[0]["provenance"]["config"]["executor"] == "ray"


def test_map_cells_keeps_order_and_raises():
    assert _parallel.map_cells(abs, [-3, 1, -2], workers=2) == [3, 1, 2]
    with pytest.raises(TypeError):
        _parallel.map_cells(abs, [1, "x"], workers=1)
    with pytest.raises(ValueError, match="workers must be an int >= 0"):
        _parallel.map_cells(abs, [1], workers=-1)


@pytest.mark.parametrize("name, hits", [("compare_policies_mooncake_conversation", True),
                                        ("compare_policies_mooncake_synthetic", False)])
def test_mooncake_configs_reduced(name, hits, tmp_path, local_datasets):
    from experiments import _common

    cfg = _load(name)
    assert (cfg.block_size, cfg.concurrency, cfg.free_order) == (512, 1, "unhashed_first")
    assert compare.parse_capacities(cfg.capacities) == (1000, 3000, 10000, 30000, 50000,
                                                         100000, 200000)
    assert cfg.dataset and not cfg.trace  # named by dataset (its verified local copy here)
    src = pathlib.Path(_common.trace_path(cfg))
    small = tmp_path / src.name
    with open(src) as f:
        small.write_text("".join(next(f) for _ in range(6)))
    cfg.dataset = ""
    cfg.trace, cfg.workdir, cfg.capacities, cfg.workers = str(small), str(tmp_path / "w"), "20", 1
    rows = _read(cp.run(cfg)["rows"])
    assert {r["policy"] for r in rows if r["record"] == "cell"} == set(compare.policy_names())
    ideal = rows[-1]
    assert ideal["record"] == "ideal" and ideal["requests"] == 6 and ideal["evictions"] == 0
    # The conversation trace's first lines share hash id 0; the synthetic one's do not.
    assert (ideal["hit_tokens"] > 0) == hits


@pytest.mark.parametrize("name", ["bailian_to_c"])  # (claude_code: same path, 64)
def test_dataset_configs_run_at_the_dataset_block_size(name, tmp_path, monkeypatch):
    # A small file in the dataset's format placed in the data directory (trusted on first
    # use: its checksum is recorded), then the config's quick grid at tiny capacities.
    from prefixcache.sim import datasets

    from tests.sim.test_sim_replay_hash_ids import _bailian_and_claude_code_files

    bl, cc = _bailian_and_claude_code_files(tmp_path, n=40)
    d = datasets.get(name)
    dest = tmp_path / "data" / name / d.filename
    dest.parent.mkdir(parents=True)
    dest.write_bytes((bl if d.trace_format == "bailian" else cc).read_bytes())
    monkeypatch.setenv(datasets.ENV_VAR, str(tmp_path / "data"))
    cfg = _load(f"compare_policies_{name}")
    assert cfg.block_size == d.block_size and cfg.trace_tokens == "lazy"
    cfg.workdir, cfg.capacities, cfg.workers, cfg.policies = str(tmp_path / "w"), "24", 1, \
        "lru,queue_aware"
    rows = _read(cp.run(cfg)["rows"])
    assert datasets.recorded_sha256(dest) == datasets.sha256_of(dest)
    assert rows[0]["provenance"]["trace_checksum"] == {
        "dataset": name, "trace": None, "sha256": datasets.recorded_sha256(dest)}
    cells = {r["policy"]: r for r in rows if r["record"] == "cell"}
    assert set(cells) == {"lru", "queue_aware", "belady"}
    assert cells["lru"]["evicted_blocks"] > 0 and cells["lru"]["hit_tokens"] > 0
    assert cells["queue_aware"]["queue_depth"] == 8
    cfg.block_size = 32
    with pytest.raises(ValueError, match=f"must use block_size={d.block_size}, not 32"):
        cp.run(cfg)


def test_policy_variants_run_with_their_options_and_rows_carry_them(config):
    # A variant is a label -> (policy, options): checked before any cell, replayed with
    # those options, published under its label.
    # (the grid's cells run in this process: the executors are tested above)
    config.policies, config.belady_bound = "lru,ttl2,lfu", False
    config.capacities, config.miss_reasons = "40", False
    config.policy_variants = {"ttl2": {"eviction": "ttl_lru", "options": {"ttl": 2}}}
    cells = cp.make_cells(config, cp.resolve_grid(config))
    rows = [cp.run_cell(c) for c in cells if c["num_blocks"]]  # (not the ideal)
    by = {r["policy"]: r for r in rows}
    assert set(by) == {"lru", "ttl2", "lfu"}
    assert (by["ttl2"]["eviction"], by["ttl2"]["eviction_options"]) == ("ttl_lru", {"ttl": 2})
    assert (by["lfu"]["eviction"], by["lfu"]["eviction_options"]) == ("lfu", {})
    s = replay(_requests(), num_blocks=40, block_size=8, concurrency=2,
               free_order="unhashed_first", eviction="ttl_lru", eviction_options={"ttl": 2})
    assert by["ttl2"]["hit_tokens"] == s["hit_tokens"]


@pytest.mark.parametrize("variants,match", [
    ({"v": {"eviction": "ttl_lru", "options": {"ttl": 0}}}, r"policy_variants\['v'\].*ttl"),
    ({"v": {"eviction": "ttl_lru", "options": {"tll": 5}}}, r"policy_variants\['v'\].*tll"),
    ({"v": {"options": {}}}, r"policy_variants\['v'\] must be"),
    ({"v": {"eviction": "nope"}}, "unknown eviction policy 'nope'"),
    ({"v": {"eviction": "belady", "options": {"x": 1}}}, "future"),
    ({"v": {"eviction": "lru"}, "lru": {"eviction": "lfu"}}, "registered policy's name"),
])
def test_bad_policy_variants_are_refused_before_any_cell(config, variants, match):
    config.policies = "lru,v"
    config.policy_variants = variants
    with pytest.raises(ValueError, match=match):
        cp.run(config)
    assert not (pathlib.Path(config.workdir) / cp.ROWS_FILE).exists()
    assert not (pathlib.Path(config.workdir) / "compare_policies.cells.jsonl").exists()
