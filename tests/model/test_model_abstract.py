"""`abstract_transformer`: the tree `nnx.eval_shape` of the initializer gives (same module
structure, param paths, shapes and dtypes), built without tracing."""
import jax
import pytest
from flax import nnx

from prefixcache.model import ModelConfig, Transformer
from prefixcache.model.llama import abstract_transformer


@pytest.mark.parametrize("config", [ModelConfig.tiny(dtype="bfloat16"),
                                    ModelConfig.tiny_hybrid(o_bias=True),
                                    ModelConfig.tiny_gemma3(num_layers=2,
                                                            layer_types=None)],
                         ids=["llama-bf16", "qwen2-hybrid", "gemma3"])
def test_abstract_transformer_is_eval_shape_of_init(config):
    got_def, got = nnx.split(abstract_transformer(config))
    want_def, want = nnx.split(nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0))))
    assert got_def == want_def
    got, want = jax.tree.leaves_with_path(got), jax.tree.leaves_with_path(want)
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, g), (_, w) in zip(got, want):
        assert isinstance(g, jax.ShapeDtypeStruct), path
        assert (g.shape, g.dtype) == (w.shape, w.dtype), path
