"""GGUF loading (prefixcache.model.gguf): tiny random files written with gguf's own
GGUFWriter (tests/data/tiny_gguf/, Q4_1 / Q8_0 / Q4_0 / F16 / F32 tensors, tied and
untied, llama and qwen2) give transformers' logits and greedy tokens
(tests/data/tiny_gguf_golden.*, experiments/peers/hf_reference.py); malformed files are
refused with a ValueError naming the problem; load_pretrained / Engine.from_pretrained."""
import ast
import json
import os
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")

from experiments.peers import tiny_gguf  # noqa: E402
from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.metadata import MetadataBuilder, ScheduledSeq  # noqa: E402
from prefixcache.model import (Pretrained, load_pretrained, make_kv_caches,  # noqa: E402
                               make_step_fn)
from prefixcache.model import gguf as pgguf  # noqa: E402
from prefixcache.model.gguf import gguf_config, load_gguf, read_gguf  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((DATA / "tiny_gguf_golden.json").read_text())
ARRAYS = dict(np.load(DATA / "tiny_gguf_golden.npz"))
NAMES = sorted(GOLDEN["models"])
SPECS = {s.name: s for s in tiny_gguf.TINY_SPECS}
RTOL = 1e-3


def _file(name):
    return str(DATA / GOLDEN["models"][name]["file"])


def _all_logits(config, model, tokens, *, scan_layers=True):
    """f32 logits of every position of `tokens` (one sequence, one step; the default
    scanned step, or the unrolled one)."""
    bs, n = 16, len(tokens)
    builder = MetadataBuilder(block_size=bs, num_blocks=8, max_num_seqs=1,
                              max_num_tokens=64, max_pages_per_seq=8,
                              token_buckets=[64], seq_buckets=[1], page_buckets=[8])
    step_in = builder.build([ScheduledSeq(list(range(-(-n // bs))), 0, tokens)])
    kv = make_kv_caches(config, num_blocks=8, block_size=bs)
    logits, _ = make_step_fn(model, scan_layers=scan_layers)(
        kv, step_in.input_ids, step_in.metadata, jnp.arange(n, dtype=jnp.int32))
    return np.asarray(logits)


def _assert_close(got, want, what):
    # relative to the row's scale: |got - want| <= RTOL * max|want|
    scale = np.abs(want).max(axis=-1, keepdims=True)
    err = (np.abs(got - want) / scale).max()
    assert err <= RTOL, f"{what}: max relative logits error {err:.2e} > {RTOL}"


@pytest.fixture(scope="module")
def loaded():
    return {name: load_gguf(_file(name), progress=False) for name in NAMES}


def test_tiny_files_cover_the_types_and_layouts():
    assert set(NAMES) == set(SPECS)
    types = set()
    for name in NAMES:
        types |= {t.tensor_type.name for t in read_gguf(_file(name)).tensors}
        assert os.path.getsize(_file(name)) < 200_000
    assert {"Q4_1", "Q8_0", "Q4_0", "F16", "F32"} <= types  # (F32: the norms)
    tied = {GOLDEN["models"][n]["tied"] for n in NAMES}
    assert tied == {True, False}


@pytest.mark.parametrize("name", NAMES)
def test_config_from_metadata(name, loaded):
    spec, (config, _) = SPECS[name], loaded[name]
    assert (config.num_layers, config.d_model, config.num_heads, config.num_kv_heads,
            config.head_dim, config.mlp_dim, config.vocab_size) == (
        spec.num_layers, spec.d_model, spec.num_heads, spec.num_kv_heads,
        spec.d_model // spec.num_heads, spec.mlp_dim, spec.vocab_size)
    assert config.rope_theta == spec.rope_theta
    assert config.rms_norm_eps == pytest.approx(spec.rms_norm_eps, rel=1e-6)
    assert config.tie_embeddings == spec.tied
    assert config.qkv_bias == (spec.arch == "qwen2")
    assert config.max_position_embeddings == spec.context_length
    assert config.dtype == "float32"


@pytest.mark.parametrize("name", NAMES)
def test_prompt_logits_equal_transformers(name, loaded):
    config, model = loaded[name]
    for j, p in enumerate(GOLDEN["models"][name]["prompts"]):
        want = ARRAYS[f"{name}/{j}/prompt_logits"]
        _assert_close(_all_logits(config, model, p["prompt"]), want, f"{name} prompt {j}")


@pytest.mark.parametrize("name", NAMES)
def test_engine_greedy_tokens_and_logits_equal_transformers(name, loaded):
    config, model = loaded[name]
    prompts = GOLDEN["models"][name]["prompts"]
    engine = Engine(config, model=model, num_blocks=32, block_size=8)
    engine.record_logits = True
    outs = engine.generate([p["prompt"] for p in prompts], SamplingParams(max_tokens=8))
    for j, (p, out) in enumerate(zip(prompts, outs)):
        assert list(out.token_ids) == p["tokens"], f"{name} prompt {j}"
        rows = np.stack([s[out.request_id] for s in engine.step_logits
                         if out.request_id in s])
        _assert_close(rows, ARRAYS[f"{name}/{j}/gen_logits"], f"{name} prompt {j} decode")


def test_scanned_stacked_load_equals_unrolled_per_layer_load(loaded):
    # the SmolLM2-shaped file (llama, tied, Q4_1): loaded into the stacked layout and run
    # scanned (the defaults) == loaded per layer and run unrolled (the plain path)
    name = "tiny_llama_q4_1"
    config, stacked = loaded[name]
    _, per_layer = load_gguf(_file(name), progress=False, stacked=False)
    assert stacked.stacked and not per_layer.stacked
    tokens = GOLDEN["models"][name]["prompts"][0]["prompt"]
    np.testing.assert_allclose(
        _all_logits(config, stacked, tokens),
        _all_logits(config, per_layer, tokens, scan_layers=False), rtol=1e-5, atol=1e-5)


def test_the_rope_permutation_matters(loaded, monkeypatch):
    """Without undoing llama.cpp's Q/K permutation the logits are far off (the goldens
    check the layout, not only the dequantization)."""
    name = "tiny_llama_q4_1"
    monkeypatch.setattr(pgguf, "_unpermute", lambda w, n_head: w)
    config, model = load_gguf(_file(name), progress=False)
    p = GOLDEN["models"][name]["prompts"][2]
    got = _all_logits(config, model, p["prompt"])
    want = ARRAYS[f"{name}/2/prompt_logits"]
    assert (np.abs(got - want) / np.abs(want).max(-1, keepdims=True)).max() > 0.05


def test_weights_are_the_dequantized_values(loaded):
    config, model = loaded["tiny_llama_untied"]
    deq = tiny_gguf.dequantized_tensors(_file("tiny_llama_untied"))
    np.testing.assert_array_equal(np.asarray(model.embedding[...]), deq["token_embd.weight"])
    np.testing.assert_array_equal(np.asarray(model.lm_head[...]), deq["output.weight"])
    np.testing.assert_array_equal(np.asarray(model.final_norm.scale[...]),
                                  deq["output_norm.weight"])
    # v is not permuted: [K*H, D] -> [D, K, H] (layer 0 of the stacked layout)
    assert model.stacked
    np.testing.assert_array_equal(
        np.asarray(model.layer_stack.attn.v_proj[...])[0],
        deq["blk.0.attn_v.weight"].T.reshape(config.d_model, config.num_kv_heads,
                                             config.head_dim))


def test_bfloat16_dtype(loaded):
    config, model = load_gguf(_file("tiny_llama_q4_1"), dtype="bfloat16", progress=False)
    assert config.dtype == "bfloat16" and model.embedding[...].dtype == jnp.bfloat16


# ------------------------------------------------------------------ malformed files
SPEC = SPECS["tiny_llama_q4_1"]


def _write(tmp_path, fname="m.gguf", **kw):
    path = str(tmp_path / fname)
    tiny_gguf.write_tiny_gguf(path, SPEC, **kw)
    return path


def test_wrong_magic(tmp_path):
    path = tmp_path / "x.gguf"
    data = bytearray(pathlib.Path(_file("tiny_llama_q4_1")).read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="not a GGUF file.*magic"):
        load_gguf(str(path), progress=False)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_pretrained(str(path))


@pytest.mark.parametrize("keep", [3, 20, 600, 0.5, -10])
def test_truncated(tmp_path, keep):
    data = pathlib.Path(_file("tiny_llama_q4_1")).read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path = tmp_path / "t.gguf"
    path.write_bytes(data[:n])
    with pytest.raises(ValueError, match="truncated|not a GGUF file"):
        load_gguf(str(path), progress=False)


def test_unknown_architecture(tmp_path):
    path = _write(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="architecture 'gpt2' not supported"):
        load_gguf(path, progress=False)


def test_wrong_tensor_shape(tmp_path):
    path = _write(tmp_path, shape_override={"blk.1.attn_k.weight": (128, 128)})
    with pytest.raises(ValueError, match=r"blk\.1\.attn_k\.weight: \(128, 128\) != "
                                         r"expected \(64, 128\)"):
        load_gguf(path, progress=False)


def test_missing_and_unexpected_tensors(tmp_path):
    tensors = tiny_gguf.random_tensors(SPEC)
    del tensors["blk.0.ffn_up.weight"]
    with pytest.raises(ValueError, match=r"lacks tensors \['blk\.0\.ffn_up\.weight'\]"):
        load_gguf(_write(tmp_path, "a.gguf", tensors=tensors), progress=False)
    tensors = tiny_gguf.random_tensors(SPEC)
    tensors["blk.2.attn_norm.weight"] = tensors["blk.0.attn_norm.weight"]
    with pytest.raises(ValueError, match=r"unexpected tensors.*blk\.2\.attn_norm\.weight"):
        load_gguf(_write(tmp_path, "b.gguf", tensors=tensors), progress=False)


def test_unsupported_quantization_type(tmp_path):
    """A type gguf.quants cannot dequantize (Q8_1: llama.cpp's activation type) is named."""
    path = str(tmp_path / "q81.gguf")
    src = read_gguf(_file("tiny_llama_q4_1"))
    w = gguf.GGUFWriter(path, "llama")
    for f in src.fields.values():
        if f.name.startswith("llama.") or f.name == "general.file_type":
            w.add_key_value(f.name, f.contents(), f.types[0])
    for t in src.tensors:
        if t.name == "blk.0.ffn_gate.weight":
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
            rows, cols = int(t.shape[1]), int(t.shape[0])
            w.add_tensor(t.name, np.zeros((rows, cols // block * size), np.uint8),
                         raw_dtype=gguf.GGMLQuantizationType.Q8_1)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"'blk\.0\.ffn_gate\.weight' has quantization type "
                                         r"Q8_1"):
        load_gguf(path, progress=False)


def test_unsupported_rope_scaling(tmp_path):
    path = str(tmp_path / "rs.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="rope.scaling.type 'linear' not supported"):
        gguf_config(read_gguf(path))


def test_no_such_file(tmp_path):
    with pytest.raises(ValueError, match="no such checkpoint"):
        load_pretrained(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="no such GGUF file"):
        load_gguf(str(tmp_path / "nope.gguf"))


# ------------------------------------------------------- load_pretrained / Engine
def test_load_pretrained_gguf_and_hf(tmp_path, hf_helpers):
    pre = load_pretrained(_file("tiny_llama_q4_1"), progress=False)
    assert isinstance(pre, Pretrained) and pre.format == "gguf"
    assert pre.tokenizer_path is None  # the tiny files carry no tokenizer
    assert pre.source == _file("tiny_llama_q4_1") and pre.config.vocab_size == 64
    with pytest.raises(AttributeError):
        pre.format = "hf"
    hf_cfg = hf_helpers.qwen2_hf_config()
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, hf_helpers.random_hf_weights(hf_cfg, 0))
    pre = load_pretrained(tmp_path)
    assert pre.format == "hf" and pre.tokenizer_path is None
    assert pre.config.architecture == "Qwen2ForCausalLM"
    (tmp_path / "tokenizer.json").write_text("{}")
    assert load_pretrained(str(tmp_path)).tokenizer_path == str(tmp_path)


def test_engine_from_pretrained():
    name = "tiny_llama_untied"
    engine = Engine.from_pretrained(_file(name), num_blocks=16, block_size=8)
    assert engine.pretrained.format == "gguf" and engine.max_model_len == 256
    p = GOLDEN["models"][name]["prompts"][1]
    out = engine.generate([p["prompt"]], SamplingParams(max_tokens=8))[0]
    assert list(out.token_ids) == p["tokens"]
    with pytest.raises(ValueError, match="do not pass"):
        Engine.from_pretrained(_file(name), num_blocks=16, model=engine.model)
    with pytest.raises(ValueError, match="unknown|not supported|no such"):
        Engine.from_pretrained("/nonexistent/x.gguf", num_blocks=16)


def test_model_package_has_no_import_cycle():
    """issue 24: llama -> lora -> loading -> llama is gone (module-level imports)."""
    root = pathlib.Path(__file__).resolve().parents[2] / "prefixcache" / "model"
    graph = {}
    for f in root.glob("*.py"):
        mod = f"prefixcache.model.{f.stem}"
        deps = set()
        for node in ast.parse(f.read_text()).body:  # top level only (lazy imports are fine)
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                    "prefixcache.model."):
                deps.add(node.module)
        graph[mod] = deps
    state = {}

    def visit(m, stack):
        state[m] = "open"
        for d in graph.get(m, ()):
            if state.get(d) == "open":
                raise AssertionError(f"import cycle: {' -> '.join(stack + [m, d])}")
            if d not in state:
                visit(d, stack + [m])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [])


def test_bench_real_model_runs_on_a_tiny_file(tmp_path):
    from experiments import bench_real_model
    from configs.bench_real_model import get_config

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.checkpoint = _file("tiny_llama_q4_1")
    cfg.dtypes = "float32"
    cfg.prompt_len, cfg.decode_batches, cfg.decode_tokens, cfg.repeats = 16, "2", 2, 1
    cfg.num_blocks = 16
    cfg.min_token_bucket = cfg.min_seq_bucket = 1  # (decode b2 runs 2 token rows)
    (rec,) = bench_real_model.run(cfg)["results"]
    assert rec["format"] == "gguf" and rec["prompt_len"] == 16
    assert {"load_s", "prefill_tok_s", "decode_b2_tok_s", "first_prefill_s"} <= set(rec)
    line = json.loads((tmp_path / "bench_real_model.jsonl").read_text())
    assert line["provenance"]["config"]["checkpoint"] == cfg.checkpoint


def test_bench_real_model_refuses_a_missing_peer_before_loading(tmp_path):
    from experiments import bench_real_model
    from configs.bench_real_model import get_config

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.checkpoint = _file("tiny_llama_q4_1")
    cfg.peer_python = str(tmp_path / "no-python")
    with pytest.raises(ValueError, match="config.peer_python: no such file"):
        bench_real_model.run(cfg)
    assert not (tmp_path / "bench_real_model.jsonl").exists()


def test_bench_real_model_refuses_a_negative_bucket_before_loading(tmp_path):
    from experiments import bench_real_model
    from configs.bench_real_model import get_config

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.checkpoint = _file("tiny_llama_q4_1")
    cfg.min_token_bucket = -1
    with pytest.raises(ValueError, match="config.min_token_bucket must be >= 0"):
        bench_real_model.run(cfg)
    assert not (tmp_path / "bench_real_model.jsonl").exists()


def test_engine_from_pretrained_tokenizer_false_and_bad_kwargs():
    engine = Engine.from_pretrained(_file("tiny_qwen2"), tokenizer=False, num_blocks=8,
                                    block_size=16)
    assert engine.model_config.qkv_bias and engine.pretrained.tokenizer_path is None
    with pytest.raises(ValueError, match="do not pass"):
        Engine.from_pretrained(_file("tiny_qwen2"), num_blocks=8,
                               model_config=engine.model_config)


def test_profile_decode_runs_on_a_tiny_file(tmp_path):
    from experiments import profile_decode
    from configs.profile_decode import get_config

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.checkpoint = _file("tiny_llama_q4_1")
    cfg.decode_batches, cfg.prompt_len, cfg.decode_tokens, cfg.repeats = "2", 8, 2, 1
    cfg.num_blocks, cfg.bandwidth_mib = 32, 4
    (rec,) = profile_decode.run(cfg)["results"]
    assert rec["batch"] == 2 and rec["weight_bytes"] > 0 and rec["read_gb_s"] > 0
    assert {"lm_head", "sampler_greedy", "sampler_random"} <= set(rec["pieces"])
    assert any(k.startswith("attention_") for k in rec["pieces"])
    assert {"schedule_ms", "prepare_ms", "device_ms", "update_ms"} <= set(rec["step"])


def test_bench_load_runs_on_a_tiny_file(tmp_path):
    # ours alone (no transformers venv), two processes: the converted cache cold, warm
    from experiments import bench_load
    from configs.bench_load import get_config

    cfg = get_config()
    cfg.workdir = str(tmp_path)
    cfg.checkpoint = _file("tiny_llama_q4_1")
    cfg.modes = "cold_cache,warm_cache"
    recs = bench_load.run(cfg)["results"]
    assert [r["converted_cache"] for r in recs] == ["cold_cache", "warm_cache"]
    assert all(r["load_wall_s"] > 0 and r["peak_rss_mb"] > 0 for r in recs)
