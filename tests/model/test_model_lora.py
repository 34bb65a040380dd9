"""LoRA adapters in the model: the engine's logits with adapters (several in one batch)
equal a float64 forward with each adapter merged into the weights; the PEFT loader and
the device slots reject bad input with errors naming the problem."""
import json
import math
import os

import numpy as np
import pytest

from prefixcache.core import LoRARequest
from prefixcache.engine import Engine, SamplingParams
from prefixcache.model import ModelConfig, load_hf_checkpoint
from prefixcache.model.lora import LoRASlots, load_lora_adapter

TOL = dict(rtol=2e-4, atol=2e-4)


def test_logits_match_merged_f64_oracle(tmp_path, hf_helpers, lora_helpers):
    hf_cfg = hf_helpers.llama_hf_config()
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=5)
    hf_helpers.write_hf_checkpoint(tmp_path / "ckpt", hf_cfg, weights)
    config, model = load_hf_checkpoint(str(tmp_path / "ckpt"))
    # "qv": attention only, rank 4, alpha/r = 2. "all": every projection, rank 8 (the
    # maximum), rsLoRA scaling alpha/sqrt(r). "l1": layer 1's MLP only (layers_to_transform).
    specs = {"qv": dict(rank=4, alpha=8.0, targets=("q_proj", "v_proj"), seed=1),
             "all": dict(rank=8, alpha=4.0, use_rslora=True, seed=2),
             "l1": dict(rank=2, alpha=2.0, targets=("gate_proj", "up_proj", "down_proj"),
                        layers=[1], seed=3)}
    scaling = {"qv": 8.0 / 4, "all": 4.0 / math.sqrt(8), "l1": 2.0 / 2}
    merged = {None: weights}
    for name, kw in specs.items():
        tensors = lora_helpers.write_peft_adapter(tmp_path / name, config, **kw)
        merged[name] = lora_helpers.merge_lora(weights, tensors, scaling[name])
    engine = Engine(config, model=model, num_blocks=64, block_size=8, max_num_seqs=4,
                    max_num_batched_tokens=64, max_model_len=64, enable_lora=True, max_loras=3,
                    max_lora_rank=8, token_buckets=(64,), seq_buckets=(4,),
                    page_buckets=(8,))
    engine.record_logits = True
    rng = np.random.default_rng(6)
    prompt = rng.integers(1, hf_cfg["vocab_size"], 21).tolist()
    names = ["qv", "all", None, "l1"]
    loras = [None if n is None else LoRARequest(n, str(tmp_path / n)) for n in names]
    # The same prompt under three adapters and none, in one batch. 4 x 21 tokens > the
    # 64-token budget: step 1 runs the 4th prompt's first token, a one-token row that the
    # metadata builder sorts first, so token rows are not in scheduled order.
    outs = engine.generate([prompt] * 4, SamplingParams(max_tokens=3), lora_request=loras)
    rows = {}
    for step in engine.step_logits:
        for rid, row in step.items():
            rows.setdefault(rid, []).append(row)
    first = {}
    for out, name in zip(outs, names):
        assert out.error is None and len(out.token_ids) == 3
        seq = prompt + out.token_ids
        dense = hf_helpers.np_forward(hf_cfg, merged[name], seq)
        got = np.stack(rows[out.request_id])  # logits at positions 20, 21, 22
        np.testing.assert_allclose(got, dense[20:23], **TOL, err_msg=f"adapter {name}")
        assert out.token_ids == np.argmax(dense[20:23], -1).tolist()
        first[name] = got[0]
    # Different adapters, different outputs for the same prompt.
    for a in names:
        for b in names:
            if a != b:
                assert np.abs(first[a] - first[b]).max() > 1e-2, (a, b)


@pytest.fixture
def tiny():
    return ModelConfig.tiny()


def _bad_adapters(tmp_path, w, config):
    """(name, writer, error pattern) of each malformed adapter."""
    full = "base_model.model.model.layers.{}.self_attn.q_proj.lora_{}.weight"
    return [
        ("missing", lambda p: None, "does not exist"),
        ("a_file", lambda p: open(p, "w").close(), "not a directory"),
        ("no_config", lambda p: (w(p), os.remove(os.path.join(p, "adapter_config.json"))),
         "no adapter_config.json"),
        ("no_weights", lambda p: (w(p), os.remove(os.path.join(p, "adapter_model.safetensors"))),
         "no adapter_model.safetensors"),
        ("bad_json", lambda p: (w(p), open(os.path.join(p, "adapter_config.json"), "w").write("{")),
         "unreadable adapter_config.json"),
        ("rank", lambda p: w(p, rank=32), r"rank r=32 exceeds max_lora_rank=16"),
        ("r_zero", lambda p: w(p, config_changes={"r": 0}), "'r' must be a positive int"),
        ("alpha", lambda p: w(p, config_changes={"lora_alpha": None}), "lora_alpha"),
        ("target", lambda p: w(p, config_changes={"target_modules": ["q_proj", "c_attn"]}),
         "target module 'c_attn' is not a module of the model"),
        ("embed", lambda p: w(p, config_changes={"target_modules": ["embed_tokens"]}),
         "embeddings"),
        ("regex", lambda p: w(p, config_changes={"target_modules": ".*proj"}),
         "target_modules"),
        ("bias", lambda p: w(p, config_changes={"bias": "all"}), "bias='all'"),
        ("dora", lambda p: w(p, config_changes={"use_dora": True}), "DoRA"),
        ("save", lambda p: w(p, config_changes={"modules_to_save": ["lm_head"]}),
         "modules_to_save"),
        ("pattern", lambda p: w(p, config_changes={"rank_pattern": {"q_proj": 8}}),
         "rank_pattern"),
        ("peft", lambda p: w(p, config_changes={"peft_type": "IA3"}), "peft_type 'IA3'"),
        ("shape", lambda p: w(p, targets=("q_proj",), extra_tensors={
            full.format(0, "A"): np.zeros((4, config.d_model + 1), np.float32)}),
         r"shape \(4, 129\), expected \(4, 128\)"),
        ("layer", lambda p: w(p, targets=("q_proj",), extra_tensors={
            full.format(7, "A"): np.zeros((4, config.d_model), np.float32),
            full.format(7, "B"): np.zeros((256, 4), np.float32)}),
         "layer 7 out of range"),
        ("untargeted", lambda p: w(p, targets=("q_proj",), extra_tensors={
            full.format(0, "A").replace("q_proj", "k_proj"): np.zeros((4, 128), np.float32)}),
         "'k_proj' is not in target_modules"),
        ("missing_b", lambda p: w(p, targets=("q_proj",), drop=(full.format(1, "B"),)),
         "1 tensors missing"),
        ("stray", lambda p: w(p, extra_tensors={"base_model.model.lm_head.weight":
                                                np.zeros((2, 2), np.float32)}),
         "unexpected tensor"),
        ("embedding_t", lambda p: w(p, extra_tensors={
            "base_model.model.model.embed_tokens.lora_embedding_A": np.zeros((4, 2), np.float32)}),
         "embeddings"),
        ("nan", lambda p: w(p, targets=("q_proj",), extra_tensors={
            full.format(0, "A"): np.full((4, config.d_model), np.nan, np.float32)}),
         "non-finite"),
    ]


def test_bad_adapters_are_refused_by_name(tmp_path, tiny, lora_helpers):
    def w(p, **kw):
        return lora_helpers.write_peft_adapter(p, tiny, **kw)

    bad = _bad_adapters(tmp_path, w, tiny)
    for name, write, pattern in bad:
        p = str(tmp_path / name)
        write(p)
        with pytest.raises(ValueError, match=pattern):
            load_lora_adapter(p, tiny, max_lora_rank=16)
    # A good one loads: scaling alpha / r, A transposed to [L, in, r].
    good = lora_helpers.write_peft_adapter(tmp_path / "good", tiny, rank=4, alpha=8.0)
    ad = load_lora_adapter(str(tmp_path / "good"), tiny, max_lora_rank=16, name="g")
    assert (ad.name, ad.rank, ad.scaling) == ("g", 4, 2.0)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    np.testing.assert_array_equal(ad.a["down_proj"][1], good[key].T)


def test_engine_refuses_bad_adapters_before_anything_runs(tmp_path, tiny, lora_helpers):
    engine = Engine(tiny, num_blocks=16, block_size=16, enable_lora=True, max_loras=2,
                    max_lora_rank=4)
    lora_helpers.write_peft_adapter(tmp_path / "ok", tiny, rank=4)
    lora_helpers.write_peft_adapter(tmp_path / "big", tiny, rank=8)
    lora_helpers.write_peft_adapter(tmp_path / "odd", tiny, config_changes={
        "target_modules": ["q_proj", "w1"]})
    ok = LoRARequest("ok", str(tmp_path / "ok"))
    cases = [(LoRARequest("big", str(tmp_path / "big")), "rank r=8 exceeds max_lora_rank=4"),
             (LoRARequest("odd", str(tmp_path / "odd")), "'w1' is not a module"),
             (LoRARequest("gone", str(tmp_path / "gone")), "does not exist")]
    for lora, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            engine.add_request([1, 2, 3], lora_request=lora)
        # One bad adapter in a batch: nothing of the batch runs.
        with pytest.raises(ValueError, match=pattern):
            engine.generate([[1, 2, 3], [4, 5, 6]], lora_request=[ok, lora])
    assert not engine.has_unfinished_requests() and engine.metrics().num_steps == 0
    assert engine.runner.lora_slots.num_loads == 0
    with pytest.raises(ValueError, match="not both"):
        engine.add_request([1, 2], lora=ok, lora_request=ok)
    with pytest.raises(ValueError, match="lora_requests for 2 prompts"):
        engine.generate([[1], [2]], lora_request=[ok])
    # Without enable_lora: rejected unless only a cache key; not both flags.
    plain = Engine(tiny, num_blocks=16, block_size=16, share_programs_with=engine)
    with pytest.raises(ValueError, match="enable_lora=True"):
        plain.add_request([1, 2, 3], lora_request=ok)
    with pytest.raises(ValueError, match="not both"):
        Engine(tiny, num_blocks=16, enable_lora=True, lora_cache_key_only=True)
    for kw in (dict(max_loras=0), dict(max_lora_rank=-1), dict(max_loras=1.5)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            Engine(tiny, num_blocks=16, enable_lora=True, **kw)


def test_slots_are_reused_least_recently_used_first(tmp_path, tiny, lora_helpers):
    ads = {}
    for i, n in enumerate("abc"):
        lora_helpers.write_peft_adapter(tmp_path / n, tiny, rank=2 + i, seed=i,
                                        targets=("q_proj", "down_proj"))
        ads[n] = load_lora_adapter(str(tmp_path / n), tiny, max_lora_rank=4, name=n)
    slots = LoRASlots(tiny, max_loras=2, max_lora_rank=4)
    assert slots.activate([ads["a"], None, ads["a"]]) == [1, 0, 1]
    assert slots.activate([ads["b"]]) == [2]
    assert slots.activate([ads["a"]]) == [1]  # a is now the most recently used
    assert slots.activate([ads["c"], ads["a"]]) == [2, 1]  # c takes b's slot (LRU)
    assert list(slots.resident) == [("c", str(tmp_path / "c")), ("a", str(tmp_path / "a"))]
    assert slots.num_loads == 3
    with pytest.raises(ValueError, match="3 distinct LoRA adapters in one step, but "
                                         "max_loras=2"):
        slots.activate([ads["a"], ads["b"], ads["c"]])
    assert slots.num_loads == 3
    # Slot contents: zero slot 0, A padded to rank 4, scaling folded into B.
    a, b = (np.asarray(x) for x in slots.weights["down_proj"])
    assert a.shape == (3, 2, tiny.mlp_dim, 4) and b.shape == (3, 2, 4, tiny.d_model)
    assert not a[0].any() and not b[0].any()
    c = ads["c"]  # rank 4
    np.testing.assert_allclose(a[2], c.a["down_proj"])
    np.testing.assert_allclose(b[2], c.b["down_proj"] * c.scaling, rtol=1e-6)
    aa = ads["a"]  # rank 2: columns 2, 3 are zero padding
    np.testing.assert_allclose(a[1][:, :, :2], aa.a["down_proj"])
    assert not a[1][:, :, 2:].any() and not b[1][:, 2:].any()
    assert not np.asarray(slots.weights["k_proj"][0]).any()  # not targeted: zeros


def test_step_rejects_malformed_lora_inputs(tiny):
    from flax import nnx

    from prefixcache.metadata import MetadataBuilder, ScheduledSeq
    from prefixcache.model import Transformer, make_kv_caches, make_step_fn
    from prefixcache.model.lora import LoRABatch

    step = make_step_fn(Transformer(tiny, rngs=nnx.Rngs(0)))
    b = MetadataBuilder(block_size=16, num_blocks=8, max_num_seqs=2, max_num_tokens=16,
                        max_pages_per_seq=2, token_buckets=[16], seq_buckets=[2],
                        page_buckets=[2])
    si = b.build([ScheduledSeq([0], 0, [1, 2, 3])])
    kv = make_kv_caches(tiny, num_blocks=8, block_size=16)
    weights = LoRASlots(tiny, max_loras=1, max_lora_rank=2).weights
    cases = [(LoRABatch(np.zeros(15, np.int32), weights), r"lora.slots must be i32\[16\]"),
             (LoRABatch(np.zeros(16, np.float32), weights), "lora.slots"),
             (LoRABatch(np.zeros(16, np.int32), {"q_proj": weights["q_proj"]}), "modules"),
             (LoRABatch(np.zeros(16, np.int32), dict(weights, o_proj=weights["q_proj"])),
              r"lora.weights\['o_proj'\] shapes"),
             ((np.zeros(16, np.int32), weights), "must be a LoRABatch")]
    for lora, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            step(kv, si.input_ids, si.metadata, si.logits_indices, lora=lora)
