"""Cost model sanity: hand-computed FLOPs/bytes and monotonicity in cached tokens."""

import dataclasses

import pytest

from prefixcache.sim import cost_model as cm

# A shape small enough to count by hand:
#   per layer: q = D*Hq*hd = 4*2*2 = 16, kv = 2*D*Hkv*hd = 2*4*1*2 = 16,
#   o = Hq*hd*D = 16, mlp = 3*D*F = 3*4*8 = 96 -> 144 weights.
TOY = cm.ModelShape(num_layers=1, d_model=4, num_q_heads=2, num_kv_heads=1, head_dim=2,
                    ffn_dim=8, vocab_size=10, dtype_bytes=2)
TOY_ACC = cm.Accelerator("toy", peak_flops=1000.0, hbm_bandwidth=100.0, hbm_bytes=1e6)


def test_hand_computed_flops_and_bytes():
    assert TOY.params_per_layer == 144
    # n=3 new tokens over c=2 cached:
    #   linear 2*n*144 = 864; attention 4*Hq*hd*(n*c + n(n+1)/2) = 16*(6+6) = 192;
    #   LM head of the last token 2*D*V = 80  -> 1136.
    assert cm.prefill_flops(TOY, 3, 2) == 1136.0
    assert cm.prefill_flops(TOY, 3, 2, lm_head=False) == 1056.0
    assert cm.prefill_flops(TOY, 0, 5) == 0.0
    # KV bytes/token = L*2*Hkv*hd*2B = 8; read c+n = 5 tokens, write n = 3 -> 64.
    assert TOY.kv_bytes_per_token == 8
    assert cm.kv_bytes(TOY, 3, 2) == 64.0
    # Weights read per step: (144 + V*D = 40) * 2 bytes = 368.
    assert TOY.weight_bytes_per_step == 368
    model = cm.CostModel(TOY, TOY_ACC)
    # max(1136 / 1000, (64 + 368) / 100) = 4.32 s: memory bound.
    assert model.prefill_time(3, 2) == pytest.approx(4.32)
    # Decode of two sequences with contexts 2 and 4:
    #   bytes = 368 + 8*(3+1) + 8*(5+1) = 448 -> 4.48 s.
    assert model.decode_step_time([2, 4]) == pytest.approx(4.48)
    assert cm.decode_bytes(TOY, [2, 4]) == 448.0
    assert model.step_time([], []) == 0.0


@pytest.mark.parametrize("acc", sorted(cm.ACCELERATORS))
def test_more_cached_tokens_lower_prefill_time(acc):
    model = cm.CostModel.create("llama_3_1_8b", acc)
    prompt = 8192
    times = [model.prefill_time(prompt - c, c) for c in (0, 1024, 4096, 8000)]
    assert all(a > b for a, b in zip(times, times[1:])), times
    # A hit never makes the step free: the new tokens attend to the cached ones.
    assert times[-1] > 0


def test_prefill_compute_bound_decode_memory_bound_on_h100():
    model = cm.CostModel.create("llama_3_1_8b", "h100")
    s = model.shape
    n = 4096
    assert cm.prefill_flops(s, n) / model.flops_per_s > (
        (cm.kv_bytes(s, n) + s.weight_bytes_per_step) / model.bytes_per_s)
    # Decode of one token is bandwidth bound: time == weights / bandwidth (+ KV).
    assert model.decode_step_time([0]) == pytest.approx(
        (s.weight_bytes_per_step + cm.kv_bytes(s, 1, 0)) / model.bytes_per_s)


def test_presets_and_duck_typed_configs():
    assert cm.ModelShape.llama_3_1_8b().num_params == pytest.approx(8.03e9, rel=0.01)
    assert cm.ModelShape.llama_3_2_1b().num_params == pytest.approx(1.24e9, rel=0.01)
    assert cm.ModelShape.qwen2_5_0_5b().num_params == pytest.approx(0.494e9, rel=0.01)

    @dataclasses.dataclass(frozen=True)
    class FakeConfig:  # prefixcache.model.ModelConfig-like
        num_layers: int = 2
        d_model: int = 64
        num_heads: int = 4
        num_kv_heads: int = 2
        head_dim: int = 16
        ffn_dim: int = 128
        vocab_size: int = 256
        dtype: str = "float32"

    shape = cm.ModelShape.from_config(FakeConfig())
    assert (shape.num_q_heads, shape.dtype_bytes, shape.vocab_size) == (4, 4, 256)
    hf = {"num_hidden_layers": 16, "hidden_size": 2048, "num_attention_heads": 32,
          "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256,
          "tie_word_embeddings": True}
    assert cm.ModelShape.from_config(hf) == cm.ModelShape.llama_3_2_1b()
    with pytest.raises(ValueError, match="lacks"):
        cm.ModelShape.from_config({"hidden_size": 8})


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="unknown accelerator"):
        cm.get_accelerator("tpu_v99")
    with pytest.raises(ValueError, match="unknown model preset"):
        cm.ModelShape.preset("gpt5")
    with pytest.raises(ValueError, match="multiple"):
        dataclasses.replace(TOY, num_kv_heads=3)
    with pytest.raises(ValueError, match=">= 0"):
        cm.prefill_flops(TOY, -1, 0)
    with pytest.raises(ValueError, match="efficiency"):
        cm.CostModel(TOY, TOY_ACC, flops_efficiency=0.0)


def test_kv_cache_blocks_fit_hbm():
    model = cm.CostModel.create("llama_3_1_8b", "h100")
    blocks = model.kv_cache_blocks(16, hbm_fraction=0.9)
    # 72 GB - 16 GB of weights = ~56 GB at 128 KiB/token -> ~26k blocks of 16.
    assert 20_000 < blocks < 30_000


def test_tiny_preset_matches_the_model_configs_tiny():
    from prefixcache.model import ModelConfig  # the test may import jax; the sim may not

    assert cm.ModelShape.from_config(ModelConfig.tiny()) == cm.ModelShape.tiny()
    assert cm.ModelShape.from_config(ModelConfig.llama_3_2_1b()) == cm.ModelShape.llama_3_2_1b()
