"""Sliding-window and hybrid (local/global) models: HF config rules, a test-written
checkpoint with mixed layers against the float64 numpy forward (HF's window mask), and
per-KV-group block tables whose released (out-of-window) slots point at the padding page."""
import numpy as np
import pytest

from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import (
    ModelConfig,
    load_hf_checkpoint,
    make_kv_caches,
    make_step_fn,
    save_hf_checkpoint,
)

BS = 8
W = 8  # window of the test checkpoints: a 40-token prompt spans 5 windows


def _hybrid_cfg(hf_helpers, variant):
    if variant == "qwen2_max_window_layers":  # layers 0, 1 full; 2, 3 sliding (HF rule)
        return hf_helpers.qwen2_hf_config(num_hidden_layers=4, use_sliding_window=True,
                                          sliding_window=W, max_window_layers=2)
    if variant == "qwen2_layer_types":  # explicit list: S, F, S, S
        return hf_helpers.qwen2_hf_config(
            num_hidden_layers=4, use_sliding_window=True, sliding_window=W,
            max_window_layers=4,  # ignored: layer_types wins
            layer_types=["sliding_attention", "full_attention", "sliding_attention",
                         "sliding_attention"])
    assert variant == "mistral"  # every layer sliding
    return hf_helpers.llama_hf_config(architectures=["MistralForCausalLM"],
                                      model_type="mistral", sliding_window=W,
                                      rope_scaling=None)


def _per_group(config, seqs, stride):
    """`seqs` as one ScheduledSeq list per KV group (a tuple), group g's block ids moved
    by g * stride (the groups share KV arrays: their blocks must differ); `seqs` itself
    for a one-group model."""
    if len(config.kv_groups) == 1:
        return seqs
    return tuple([ScheduledSeq([b + g * stride for b in s.block_ids], s.num_computed_tokens,
                               s.token_ids) for s in seqs]
                 for g in range(len(config.kv_groups)))


def _run(config, model, steps, *, num_blocks=32, kv=None, step=None):
    """Runs `steps` (each: a list of per-group ScheduledSeq lists, or one list) in order on
    one KV; returns the last step's logits and the KV."""
    builder = MetadataBuilder(block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                              max_num_tokens=64, max_pages_per_seq=8,
                              token_buckets=[64], seq_buckets=[4], page_buckets=[8])
    kv = make_kv_caches(config, num_blocks=num_blocks, block_size=BS) if kv is None else kv
    step = make_step_fn(model) if step is None else step
    for seqs in steps:
        if isinstance(seqs, tuple):  # one ScheduledSeq list per KV group
            built = [builder.build(s) for s in seqs]
            md = tuple(b.metadata for b in built)
            inputs = built[0]
        else:
            inputs = builder.build(seqs)
            md = inputs.metadata
        logits, kv = step(kv, inputs.input_ids, md, inputs.logits_indices)
    return np.asarray(logits), kv


@pytest.mark.parametrize("variant", ["qwen2_max_window_layers", "qwen2_layer_types",
                                     "mistral"])
def test_hybrid_checkpoint_logits_match_numpy_forward(tmp_path, hf_helpers, variant):
    hf_cfg = _hybrid_cfg(hf_helpers, variant)
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=5)
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights)
    config, model = load_hf_checkpoint(str(tmp_path), dtype="float32")
    assert list(config.layer_windows) == hf_helpers.hf_layer_windows(hf_cfg)
    assert W in config.layer_windows
    tokens = np.random.default_rng(6).integers(0, hf_cfg["vocab_size"], 40).tolist()
    lengths = [W, W + 1, 40]
    seqs, nxt = [], 0
    for n in lengths:
        seqs.append(ScheduledSeq(list(range(nxt, nxt + -(-n // BS))), 0, tokens[:n]))
        nxt += -(-n // BS)
    # vLLM's layout (the groups' i-th layers share a KV array, per-group tables) and the
    # per-layer layout (one array per layer, one table) give the same logits.
    got, kv = _run(config, model, [_per_group(config, seqs, 8)], num_blocks=64)
    assert len(kv) == config.kv_group_size
    per_layer = make_kv_caches(config, num_blocks=64, block_size=BS, per_layer=True)
    got_per_layer, _ = _run(config, model, [seqs], num_blocks=64, kv=per_layer)
    np.testing.assert_allclose(got, got_per_layer, rtol=1e-5, atol=1e-5)
    want = hf_helpers.np_forward(hf_cfg, weights, tokens)
    for row, n in enumerate(lengths):
        np.testing.assert_allclose(got[row], want[n - 1], rtol=2e-4, atol=2e-4,
                                   err_msg=f"{variant}: prefix of {n} tokens")
    # Not vacuous: past the window the mask changes the logits (the oracle without any
    # window differs), within it the two agree.
    full_cfg = {**hf_cfg, "use_sliding_window": False, "sliding_window": None}
    full_cfg.pop("layer_types", None)
    dense = hf_helpers.np_forward(full_cfg, weights, tokens)
    assert np.abs(dense[39] - want[27]).max() > 0.1
    np.testing.assert_allclose(dense[W - 1], want[W - 1], rtol=1e-10, atol=1e-10)


def test_per_group_tables_with_released_blocks(hf_helpers, tmp_path):
    """Layers read their own group's block table; sliding layers' blocks wholly before the
    window are released (the padding page, filled with junk) and the logits still equal
    the float64 forward. vLLM's groups for S,F,S,S: three sliding groups and one full
    group of one layer each, all four sharing one KV array (disjoint block ids)."""
    hf_cfg = _hybrid_cfg(hf_helpers, "qwen2_layer_types")
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=7)
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights)
    config, model = load_hf_checkpoint(str(tmp_path), dtype="float32")
    assert config.kv_groups == ((W, (0,)), (W, (2,)), (W, (3,)), (None, (1,)))
    assert config.layer_kv_groups == (0, 3, 1, 2) and config.kv_group_size == 1
    tokens = np.random.default_rng(8).integers(0, hf_cfg["vocab_size"], 40).tolist()
    num_blocks = 64
    pad = num_blocks
    local = [[10 + 10 * g + k for k in range(5)] for g in range(3)]  # sliding groups
    full = [0, 1, 2, 3, 4]  # group 3: full attention
    tables = [*local, full]
    step1 = tuple([ScheduledSeq(t[:3], 0, tokens[:24])] for t in tables)
    step = make_step_fn(model)  # one program for both steps (same shapes)
    _, kv = _run(config, model, [step1], num_blocks=num_blocks, step=step)
    assert len(kv) == 1
    # Junk in the padding page and in the released blocks' pages: never read.
    for t in local:
        kv = [c.at[pad].set(1e4).at[t[0]].set(-1e4).at[t[1]].set(3e3) for c in kv]
    # Step 2: positions 24..27; the earliest key any of them sees is 24 - W + 1 = 17, so
    # blocks 0-1 (positions 0..15) of the sliding groups are released -> the padding page;
    # the last query (27) reads keys 20..23 written in step 1.
    builder = MetadataBuilder(block_size=BS, num_blocks=num_blocks, max_num_seqs=4,
                              max_num_tokens=64, max_pages_per_seq=8,
                              token_buckets=[64], seq_buckets=[4], page_buckets=[8])
    g_full = builder.build([ScheduledSeq(full, 24, tokens[24:28])])
    mds = []
    for t in local:
        g = builder.build([ScheduledSeq([0, 0] + t[2:], 24, tokens[24:28])])
        pi = np.array(g.metadata.page_indices)
        pi[0, :2] = pad
        mds.append(g.metadata._replace(page_indices=pi))
        np.testing.assert_array_equal(g.metadata.slot_mapping[:4] // BS, [t[3]] * 4)
    kv_copy = [c.copy() for c in kv]
    logits, _ = step(kv, g_full.input_ids, (*mds, g_full.metadata), g_full.logits_indices)
    want = hf_helpers.np_forward(hf_cfg, weights, tokens)
    np.testing.assert_allclose(np.asarray(logits)[0], want[27], rtol=2e-4, atol=2e-4)
    # Not vacuous: a sliding layer reading another sliding group's table (keys 20..23 of
    # another layer, in the shared array) gives other logits.
    wrong, _ = step(kv_copy, g_full.input_ids, (mds[0], mds[0], mds[2], g_full.metadata),
                    g_full.logits_indices)
    assert np.abs(np.asarray(wrong)[0] - want[27]).max() > 0.1


def test_step_rejects_wrong_number_of_group_metadata():
    from flax import nnx

    from prefixcache.model import Transformer
    config = ModelConfig.tiny_hybrid()
    model = Transformer(config, rngs=nnx.Rngs(0))
    builder = MetadataBuilder(block_size=BS, num_blocks=8, max_num_seqs=4, max_num_tokens=16,
                              max_pages_per_seq=2)
    inputs = builder.build([ScheduledSeq([0], 0, [1, 2, 3])])
    kv = make_kv_caches(config, num_blocks=8, block_size=BS)
    with pytest.raises(ValueError, match="a tuple of 4 \\(one per KV group\\)"):
        make_step_fn(model)(kv, inputs.input_ids, (inputs.metadata,), inputs.logits_indices)


def test_hybrid_save_load_round_trip(tmp_path):
    from flax import nnx

    from prefixcache.model import Transformer
    config = ModelConfig.tiny_hybrid()
    model = Transformer(config, rngs=nnx.Rngs(1))
    assert [layer.attn.sliding_window for layer in model.layers] == [16, 16, None, 16]
    save_hf_checkpoint(model, str(tmp_path))
    config2, _ = load_hf_checkpoint(str(tmp_path))
    assert config2 == config


# ----------------------------------------------------------------------- config rules
def _qwen2(**kw):
    return {**ModelConfig.qwen2_5_0_5b(num_layers=4).to_hf_config(), **kw}


def test_qwen2_sliding_window_follows_transformers():
    # Qwen2.5's published configs: a window given but use_sliding_window false -> plain.
    cfg = ModelConfig.from_hf_config(_qwen2(sliding_window=32768, max_window_layers=2))
    assert cfg.sliding_window is None and cfg.kv_groups == ((None, (0, 1, 2, 3)),)
    # use_sliding_window: layers i >= max_window_layers slide.
    cfg = ModelConfig.from_hf_config(_qwen2(use_sliding_window=True, sliding_window=64,
                                            max_window_layers=1))
    assert cfg.layer_windows == (None, 64, 64, 64)
    assert cfg.kv_groups == ((None, (0,)), (64, (1,)), (64, (2,)), (64, (3,)))
    # Defaults: sliding_window 4096, max_window_layers 28 (> 4 layers: all full).
    hf = _qwen2(use_sliding_window=True)
    assert "sliding_window" not in hf  # the default applies
    assert ModelConfig.from_hf_config({**hf, "max_window_layers": 0}).sliding_window == 4096
    assert ModelConfig.from_hf_config(hf).sliding_window is None  # no layer >= 28
    # layer_types beats max_window_layers.
    cfg = ModelConfig.from_hf_config(_qwen2(
        use_sliding_window=True, sliding_window=8, max_window_layers=0,
        layer_types=["full_attention", "sliding_attention"] * 2))
    assert cfg.layer_windows == (None, 8, None, 8) and cfg.layer_kv_groups == (0, 1, 0, 1)
    assert cfg.kv_groups == ((None, (0, 2)), (8, (1, 3))) and cfg.layer_kv_slots == (0, 0, 1, 1)
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_mistral_window_on_every_layer():
    hf = ModelConfig.tiny(architecture="MistralForCausalLM").to_hf_config()
    assert hf["sliding_window"] is None
    assert ModelConfig.from_hf_config(hf).sliding_window is None
    del hf["sliding_window"]  # transformers' default
    cfg = ModelConfig.from_hf_config(hf)
    assert cfg.layer_windows == (4096, 4096) and cfg.kv_groups == ((4096, (0, 1)),)
    assert cfg.layer_types is None and ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


def test_uniform_layer_types_are_stored_as_none():
    a = ModelConfig.tiny(sliding_window=8, layer_types=["sliding_attention"] * 2)
    assert a == ModelConfig.tiny(sliding_window=8) and a.layer_types is None
    assert ModelConfig.tiny(layer_types=("full_attention",) * 2) == ModelConfig.tiny()


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(sliding_window=0), "sliding_window must be a positive int or None, got 0"),
        (dict(sliding_window=8.0), "sliding_window must be a positive int or None, got 8.0"),
        (dict(sliding_window=True), "sliding_window must be a positive int"),
        (dict(layer_types=("full_attention",)), "layer_types has 1 entries for num_layers=2"),
        (dict(layer_types="full_attention"), "layer_types must be a tuple"),
        (dict(sliding_window=4, layer_types=("full_attention", "local")),
         r"unknown attention types \['local'\]"),
        (dict(layer_types=("full_attention", "sliding_attention")),
         "1 sliding_attention layers but sliding_window is None"),
        (dict(sliding_window=4, layer_types=("full_attention",) * 2),
         "no sliding_attention layer"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.tiny(**changes)


@pytest.mark.parametrize(
    "hf, match",
    [
        (_qwen2(use_sliding_window=True, sliding_window=0), "sliding_window must be a positive"),
        (_qwen2(use_sliding_window=True, sliding_window="4096"),
         "sliding_window must be a positive int or null, got '4096'"),
        (_qwen2(use_sliding_window=True, sliding_window=16, max_window_layers=-1),
         "max_window_layers must be an int >= 0"),
        (_qwen2(use_sliding_window="yes"), "use_sliding_window must be a bool"),
        (_qwen2(use_sliding_window=True, sliding_window=16,
                layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
        (_qwen2(use_sliding_window=True, sliding_window=16,
                layer_types=["full_attention", "chunked_attention"] * 2),
         r"unknown attention types \['chunked_attention'\]"),
        (_qwen2(layer_types=["sliding_attention"] * 4), "use_sliding_window is false"),
        (_qwen2(layer_types="sliding_attention"), "layer_types must be a list"),
        ({**ModelConfig.tiny().to_hf_config(), "sliding_window": 128},
         "LlamaForCausalLM has no sliding-window attention"),
        ({**ModelConfig.tiny(architecture="MistralForCausalLM").to_hf_config(),
          "layer_types": ["full_attention", "sliding_attention"]}, "layer_types not supported"),
    ],
)
def test_from_hf_config_rejects_bad_windows(hf, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(hf)


def test_to_hf_config_rejects_windows_the_architecture_lacks():
    with pytest.raises(ValueError, match="LlamaForCausalLM has no sliding-window"):
        ModelConfig.tiny(sliding_window=8).to_hf_config()
    with pytest.raises(ValueError, match="per-layer mix needs Qwen2ForCausalLM"):
        ModelConfig.tiny_hybrid(architecture="MistralForCausalLM", qkv_bias=False
                                ).to_hf_config()
