"""The engine's default scanned step (stacked params and KV): the same greedy tokens and
logits as the unrolled engine (`scan_layers=False`), prefix-cache hits included, with the
host tier too; the host tier's page copies over the stacked KV layout equal those over
the list of arrays."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine import Engine, SamplingParams
from prefixcache.engine.host_pages import HostPages
from prefixcache.model import ModelConfig

# One bucket per axis: one compiled program per engine.
COMMON = dict(num_blocks=32, block_size=8, seed=0, max_num_seqs=2, max_num_batched_tokens=64,
              max_model_len=128, token_buckets=(64,), seq_buckets=(2,), page_buckets=(16,))


def test_scanned_engine_matches_unrolled_with_prefix_hits():
    config = ModelConfig.tiny(num_layers=3)
    unrolled = Engine(config, scan_layers=False, **COMMON)
    scanned = Engine(config, model=unrolled.model, **COMMON)  # (the default)
    assert scanned.runner.kv_caches.shape[0] == 3  # one stacked array
    rng = np.random.default_rng(0)
    shared = rng.integers(1, config.vocab_size, 24).tolist()
    prompts = [shared + rng.integers(1, config.vocab_size, 5).tolist() for _ in range(2)]
    params = SamplingParams(max_tokens=6, temperature=0.0)
    for engine in (unrolled, scanned):
        engine.record_logits = True
    outs = {}
    for name, engine in (("unrolled", unrolled), ("scanned", scanned)):
        first = engine.generate(prompts[:1], params)
        second = engine.generate(prompts[1:], params)  # hits the first's 3 full blocks
        assert second[0].metrics.num_cached_tokens == 24, name
        logits = [row for step in engine.step_logits for row in step.values()]
        outs[name] = ([o.token_ids for o in first + second], np.stack(logits))
    assert outs["scanned"][0] == outs["unrolled"][0]
    np.testing.assert_allclose(outs["scanned"][1], outs["unrolled"][1], rtol=1e-5, atol=1e-5)


def test_engine_holds_its_own_random_weights_stacked():
    engine = Engine(ModelConfig.tiny(num_layers=3), **COMMON)
    assert engine.model.stacked
    assert Engine(ModelConfig.tiny(num_layers=3), scan_layers=False, **COMMON).model.stacked \
        is False


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_host_pages_copy_the_stacked_layout_as_the_list(kv_dtype):
    # the same random batches of stores and loads through a list of 2 arrays and
    # through their stack: the same device pages and the same host slots
    rng = np.random.default_rng(0)
    nb, nh, shape = 6, 5, (7, 4, 2, 8)  # 6 blocks + the padding page

    def kv(seed):
        r = np.random.default_rng(seed)
        if kv_dtype is None:
            return [jnp.asarray(r.standard_normal(shape).astype(np.float32)) for _ in range(2)]
        return [(jnp.asarray(r.integers(-100, 100, shape).astype(np.int8)),
                 jnp.asarray(r.random(shape[:1] + shape[2:3]).astype(np.float32)))
                for _ in range(2)]

    listed = kv(1)
    stacked = (jnp.stack(listed) if kv_dtype is None
               else (jnp.stack([p for p, _ in listed]), jnp.stack([s for _, s in listed])))
    a = HostPages(listed, num_blocks=nb, num_host_blocks=nh)
    b = HostPages(stacked, num_blocks=nb, num_host_blocks=nh)
    assert a.page_parts == b.page_parts and a.num_layers == b.num_layers == 2
    for _ in range(4):
        transfers = [("store" if rng.random() < 0.5 else "load", int(rng.integers(nb)),
                      int(rng.integers(nh))) for _ in range(6)]
        listed = a.apply(listed, transfers)
        a.finish()
        stacked = b.apply(stacked, transfers)
        b.finish()
    for part_a, part_b in zip(a._host, b._host):
        for x, y in zip(part_a, part_b):
            np.testing.assert_array_equal(x, y)
    for i, layer in enumerate(listed):
        for j, arr in enumerate(jax.tree.leaves(layer)):
            np.testing.assert_array_equal(np.asarray(jax.tree.leaves(stacked)[j][i]),
                                          np.asarray(arr))


def test_scanned_engine_with_the_host_tier_matches_unrolled():
    # 12 device blocks: the second round's prompts come back from the host tier
    config = ModelConfig.tiny(num_layers=2)
    common = dict(COMMON, num_blocks=12, num_host_blocks=16)
    unrolled = Engine(config, scan_layers=False, **common)
    scanned = Engine(config, model=unrolled.model, **common)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, config.vocab_size, 33).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=3, temperature=0.0)
    outs = {}
    for name, engine in (("unrolled", unrolled), ("scanned", scanned)):
        first = [engine.generate([p], params)[0] for p in prompts]
        again = [engine.generate([p], params)[0] for p in prompts]
        assert sum(o.metrics.num_cached_tokens for o in again) > 0, name
        assert engine.runner.host_pages.num_pages_loaded > 0, name
        outs[name] = [(o.token_ids, o.metrics.num_cached_tokens) for o in first + again]
    assert outs["scanned"] == outs["unrolled"]


def test_disk_fingerprint_is_the_same_for_either_weight_layout():
    # a disk tier's pages stay reusable whether the model's layers are stacked or not
    from flax import nnx

    from prefixcache.engine.engine import disk_fingerprint
    from prefixcache.model import Transformer
    from prefixcache.model.llama import stack_layers

    config = ModelConfig.tiny(num_layers=3)
    model = Transformer(config, rngs=nnx.Rngs(5))
    kw = dict(kv_dtype=None, block_size=8, hash_algo="sha256", hash_seed=None)
    per_layer = disk_fingerprint(model, config, **kw)
    other = disk_fingerprint(Transformer(config, rngs=nnx.Rngs(6)), config, **kw)
    assert disk_fingerprint(stack_layers(model), config, **kw) == per_layer != other


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_one_token_decode_steps_match_the_padded_ones(kv_dtype):
    """Buckets from one token and one sequence (a batch-1 decode step writes one K/V row
    into the scanned step's pool: `write_kv`'s one-row path) give the tokens and logits
    of the padded 64-token steps."""
    config = ModelConfig.tiny(num_layers=3)
    padded = Engine(config, kv_dtype=kv_dtype, **COMMON)
    small = Engine(config, model=padded.model, kv_dtype=kv_dtype,
                   **{**COMMON, "token_buckets": (1, 64), "seq_buckets": (1, 2)})
    prompt = np.random.default_rng(1).integers(1, config.vocab_size, 13).tolist()
    params = SamplingParams(max_tokens=5, temperature=0.0)
    outs = {}
    for name, engine in (("padded", padded), ("small", small)):
        engine.record_logits = True
        tokens = engine.generate([prompt], params)[0].token_ids
        outs[name] = (tokens, np.stack([row for step in engine.step_logits
                                        for row in step.values()]))
    assert small.runner.program.num_programs_built >= 2  # the 1-token decode program ran
    assert outs["small"][0] == outs["padded"][0]
    np.testing.assert_allclose(outs["small"][1], outs["padded"][1], rtol=1e-5, atol=1e-5)
