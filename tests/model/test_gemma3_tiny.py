"""Gemma 3 on a tiny random GGUF file (tests/data/tiny_gguf/tiny_gemma3.gguf, written by
experiments/peers/tiny_gguf.py: six layers, five with a sliding window of 8 and one full,
q/k norms, (1 + w) norms stored + 1 as llama.cpp writes them, Q8_0 / Q5_0 / Q4_1 / Q5_1
tensors, a SentencePiece-style vocabulary) against transformers' own GGUF loading of the
same file (tests/data/tiny_gemma3_golden.*, experiments/peers/hf_gemma3_reference.py):
logits of every prompt position, greedy tokens through the engine's hybrid KV cache
groups, the HF-directory form (transformers' config.json), the tokenizer and the chat
template. The full model: tests/model/test_gemma3.py."""
import json
import pathlib

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")

from experiments.peers import tiny_gguf  # noqa: E402
from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.metadata import MetadataBuilder, ScheduledSeq  # noqa: E402
from prefixcache.model import (ModelConfig, load_pretrained, make_kv_caches,  # noqa: E402
                               make_step_fn)
from prefixcache.model.gguf import load_gguf  # noqa: E402
from prefixcache.model.loading import hf_param_map  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((DATA / "tiny_gemma3_golden.json").read_text(encoding="utf-8"))
ARRAYS = dict(np.load(DATA / "tiny_gemma3_golden.npz"))
FILE = str(DATA / GOLDEN["file"])
SPEC = tiny_gguf.TINY_GEMMA3
RTOL = 1e-3  # (measured: 4.5e-7 of the row's largest logit)
# One compiled program per engine: one token / sequence / page bucket each.
ENGINE = dict(block_size=8, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4,
              token_buckets=(64,), seq_buckets=(4,), page_buckets=(16,))


@pytest.fixture(scope="module")
def loaded():
    return load_gguf(FILE, progress=False)


@pytest.fixture(scope="module")
def logits_of(loaded):
    """`logits_of(tokens, params=None)`: f32 logits of every position of `tokens` (one
    sequence, one step, one KV array per layer: the sliding layers mask their window over
    the whole table); `params` another state of the same model. One compiled program."""
    config, model = loaded
    step = make_step_fn(model)
    bs = 16
    builder = MetadataBuilder(block_size=bs, num_blocks=8, max_num_seqs=1,
                              max_num_tokens=64, max_pages_per_seq=8,
                              token_buckets=[64], seq_buckets=[1], page_buckets=[8])

    def run(tokens, params=None):
        n = len(tokens)
        step_in = builder.build([ScheduledSeq(list(range(-(-n // bs))), 0, tokens)])
        kv = make_kv_caches(config, num_blocks=8, block_size=bs, per_layer=True)
        rows = jnp.minimum(jnp.arange(64, dtype=jnp.int32), n - 1)
        logits, _ = step.jitted(step.params if params is None else params, kv,
                                step_in.input_ids, step_in.metadata, rows)
        return np.asarray(logits)[:n]

    return run


@pytest.fixture(scope="module")
def engine(loaded):
    config, model = loaded
    return Engine(config, model=model, num_blocks=96, **ENGINE)


def _assert_close(got, want, what):
    err = (np.abs(got - want) / np.abs(want).max(axis=-1, keepdims=True)).max()
    assert err <= RTOL, f"{what}: max relative logits error {err:.2e} > {RTOL}"


def test_config_from_metadata(loaded):
    config, _ = loaded
    assert config == ModelConfig.tiny_gemma3(
        vocab_size=512, d_model=64, num_heads=2, head_dim=256, mlp_dim=256,
        sliding_window=8, query_pre_attn_scalar=256.0, rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=256)
    assert config.attention_types == tuple(GOLDEN["layer_types"])
    assert config.layer_rope_thetas == (10000.0,) * 5 + (1000000.0,)
    assert GOLDEN["config"]["rope_parameters"]["sliding_attention"]["rope_theta"] == 10000.0
    # vLLM's grouping: five sliding groups and one full group of one layer each.
    assert config.kv_groups == tuple((8, (i,)) for i in range(5)) + ((None, (5,)),)


def test_prompt_logits_equal_transformers(logits_of):
    for j, p in enumerate(GOLDEN["prompts"]):
        _assert_close(logits_of(p["prompt"]), ARRAYS[f"{j}/prompt_logits"],
                      f"prompt {j} ({len(p['prompt'])} tokens)")


def test_scanned_engine_equals_unrolled(loaded, engine):
    """The default scanned engine (one unit of 5 sliding + 1 full layer, stacked weights)
    and the unrolled one over a per-layer load: the same greedy tokens and logits."""
    config, model = loaded
    _, per_layer = load_gguf(FILE, progress=False, stacked=False)
    unrolled = Engine(config, model=per_layer, num_blocks=96, scan_layers=False, **ENGINE)
    prompts = [p["prompt"] for p in GOLDEN["prompts"][:2]]
    out = {}
    for name, e in (("scanned", engine), ("unrolled", unrolled)):
        e.record_logits, e.step_logits = True, []
        got = e.generate(prompts, SamplingParams(max_tokens=4))
        e.record_logits = False
        out[name] = ([list(o.token_ids) for o in got],
                     np.stack([row for s in e.step_logits for row in s.values()]))
    assert out["scanned"][0] == out["unrolled"][0]
    np.testing.assert_allclose(out["scanned"][1], out["unrolled"][1], rtol=1e-5, atol=1e-5)


def test_engine_greedy_tokens_and_logits_equal_transformers(engine):
    """Through the engine: six KV cache groups (each sliding group holds only its window's
    blocks), block size 8, the 40-token prompt spanning five windows."""
    engine.record_logits = True
    outs = engine.generate([p["prompt"] for p in GOLDEN["prompts"]],
                           SamplingParams(max_tokens=8))
    for j, (p, out) in enumerate(zip(GOLDEN["prompts"], outs)):
        assert list(out.token_ids) == p["tokens"], f"prompt {j}"
        rows = np.stack([s[out.request_id] for s in engine.step_logits
                         if out.request_id in s])
        _assert_close(rows, ARRAYS[f"{j}/gen_logits"], f"prompt {j} decode")
    engine.record_logits = False


def test_cache_on_off_identical_and_hits_past_the_window(loaded, engine):
    """A conversation whose prompts outgrow the window: with the cache on each turn hits
    the previous turn's blocks under the hybrid rule (a hit needs the full group's blocks
    and the sliding groups' last window), and the tokens equal the cache-off run."""
    config, model = loaded
    on = Engine(config, model=model, num_blocks=96, share_programs_with=engine, **ENGINE)
    off = Engine(config, model=model, num_blocks=96, enable_caching=False,
                 share_programs_with=engine, **ENGINE)
    rng = np.random.default_rng(0)
    history, cached = [], []
    params = SamplingParams(max_tokens=6)
    for turn in range(4):
        history += rng.integers(0, SPEC.vocab_size, 13).tolist()
        [a] = on.generate([history], params)
        [b] = off.generate([history], params)
        assert list(a.token_ids) == list(b.token_ids), f"turn {turn}"
        cached.append(a.metrics.num_cached_tokens)
        history += list(a.token_ids)
    assert cached[0] == 0 and min(cached[1:]) >= 16, cached
    assert off.metrics().num_cached_tokens == 0


def test_hf_directory_equals_transformers(loaded, logits_of, tmp_path):
    """The HF directory form: transformers' config.json for this model (as it saves it)
    and its state dict's names, with the GGUF file's dequantized values (norms - 1, as
    transformers stores Gemma's), loads to the same logits."""
    import safetensors.numpy  # noqa: PLC0415

    config, _ = loaded
    names = GOLDEN["hf_shapes"]
    assert sorted(names) == sorted(hf for hf, *_ in hf_param_map(config).values())
    deq = tiny_gguf.dequantized_tensors(FILE)
    by_hf = {}
    for g, arr in deq.items():
        hf = _gguf_to_hf(g)
        by_hf[hf] = arr - np.float32(1) if g.endswith("norm.weight") else arr
        assert list(by_hf[hf].shape) == names[hf], hf
    d = tmp_path / "tiny_gemma3_hf"
    d.mkdir()
    (d / "config.json").write_text((DATA / GOLDEN["hf_dir"] / "config.json").read_text())
    safetensors.numpy.save_file(by_hf, str(d / "model.safetensors"))
    pre = load_pretrained(d)
    assert pre.format == "hf" and pre.config == config
    p = GOLDEN["prompts"][2]
    _assert_close(logits_of(p["prompt"], make_step_fn(pre.model).params),
                  ARRAYS["2/prompt_logits"], "HF directory")
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def _gguf_to_hf(name: str) -> str:
    from prefixcache.model import gguf as pgguf  # noqa: PLC0415

    if name in pgguf._GLOBAL:
        return pgguf._GLOBAL[name]
    _, i, rest = name.split(".", 2)
    return f"model.layers.{i}.{pgguf._GEMMA3_PER_LAYER[rest]}"


def test_the_norm_offset_matters(loaded, logits_of):
    """Without the - 1 on the stored norms the logits are far off (the goldens check the
    conventions, not only the dequantization; the 40-token prompt checks the windows)."""
    import jax  # noqa: PLC0415

    _, model = loaded

    def plus_one(path, leaf):
        keys = [str(getattr(k, "key", "")) for k in path]
        return leaf + 1 if any(k.endswith("norm") for k in keys) else leaf

    state = jax.tree_util.tree_map_with_path(plus_one, make_step_fn(model).params)
    got, want = logits_of(GOLDEN["prompts"][2]["prompt"], state), ARRAYS["2/prompt_logits"]
    assert (np.abs(got - want) / np.abs(want).max(-1, keepdims=True)).max() > 0.05


# ---------------------------------------------------------------------- tokenizer
def test_tokenizer_equals_transformers():
    pytest.importorskip("tokenizers", reason="the text extra is not installed")
    pytest.importorskip("jinja2", reason="the text extra is not installed")
    from prefixcache.text import GEMMA3_CHAT_TEMPLATE, Tokenizer  # noqa: PLC0415

    tok = Tokenizer.from_pretrained(FILE)
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (512, 2, 1)
    assert tok.token_to_id("<end_of_turn>") in tok.stop_token_ids
    for e in GOLDEN["tokenizer"]:
        assert tok.encode(e["text"]) == e["ids"], e["text"]
        ids = tok.encode(e["text"], add_special_tokens=False)
        assert ids == e["ids_no_special"], e["text"]
        assert tok.decode(ids, skip_special_tokens=False) == e["decoded"], e["text"]
    # The file has no chat template: Gemma 3's, the one transformers rendered with.
    assert tok.chat_template == GEMMA3_CHAT_TEMPLATE == GOLDEN["chat_template"]
    for c in GOLDEN["chat"]:
        assert tok.apply_chat_template(c["messages"]) == c["text"]
        assert tok.apply_chat_template(c["messages"], tokenize=True) == c["ids"]


def test_sentencepiece_vocabulary_of_another_architecture_is_refused(tmp_path):
    pytest.importorskip("tokenizers", reason="the text extra is not installed")
    import gguf  # noqa: PLC0415

    from prefixcache.text import Tokenizer  # noqa: PLC0415

    path = str(tmp_path / "spm_llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    tokens, scores, types = tiny_gguf.tiny_gemma3_vocab(300)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="SentencePiece.*general.architecture='llama'"):
        Tokenizer.from_gguf(path)
