"""The paged step: several calls (prefill, prefill over a shared cached prefix, decode) give
the logits of one dense float64 forward pass; multimodal rows change KV and logits."""
import jax
import numpy as np
import pytest

from prefixcache.metadata import MetadataBuilder, ScheduledSeq
from prefixcache.model import load_hf_checkpoint, make_kv_caches, make_step_fn

BS = 8
NUM_BLOCKS = 32
TOL = dict(rtol=2e-4, atol=2e-4)


def builder():
    # One bucket per axis: every step below runs the same compiled program.
    return MetadataBuilder(block_size=BS, num_blocks=NUM_BLOCKS, max_num_seqs=4,
                           max_num_tokens=64, max_pages_per_seq=8, token_buckets=[64],
                           seq_buckets=[4], page_buckets=[8])


def load_model(tmp_path, hf_helpers, **cfg_changes):
    hf_cfg = hf_helpers.llama_hf_config(**cfg_changes)
    weights = hf_helpers.random_hf_weights(hf_cfg, seed=5)
    hf_helpers.write_hf_checkpoint(tmp_path, hf_cfg, weights)
    config, model = load_hf_checkpoint(str(tmp_path))
    return hf_cfg, weights, config, model


def test_multi_step_paged_equals_dense(tmp_path, hf_helpers):
    hf_cfg, weights, config, model = load_model(tmp_path, hf_helpers)
    rng = np.random.default_rng(6)
    V = hf_cfg["vocab_size"]
    A = rng.integers(0, V, 40).tolist()
    B = rng.integers(0, V, 8).tolist()
    C = A[:16] + rng.integers(0, V, 15).tolist()  # shares A's first two full blocks
    blocks_a, blocks_b, blocks_c = [0, 1, 2, 3, 4], [5], [0, 1, 6, 7]
    dense = {name: hf_helpers.np_forward(hf_cfg, weights, toks)
             for name, toks in (("A", A), ("B", B), ("C", C))}
    b = builder()
    kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS)
    step = make_step_fn(model)
    schedule = [
        # step 1: two fresh prefills (A chunked: its first 24 tokens)
        [("A", ScheduledSeq(blocks_a, 0, A[:24])), ("B", ScheduledSeq(blocks_b, 0, B[:5]))],
        # step 2: A's next chunk over its 24 cached tokens, B decodes, C prefills over the
        # 16 tokens A already wrote into blocks 0 and 1 (a prefix-cache hit: shared pages)
        [("A", ScheduledSeq(blocks_a, 24, A[24:37])), ("B", ScheduledSeq(blocks_b, 5, B[5:6])),
         ("C", ScheduledSeq(blocks_c, 16, C[16:30]))],
        # step 3: decodes only
        [("C", ScheduledSeq(blocks_c, 30, C[30:31])), ("A", ScheduledSeq(blocks_a, 37, A[37:38])),
         ("B", ScheduledSeq(blocks_b, 6, B[6:7]))],
    ]
    for i, batch in enumerate(schedule):
        si = b.build([s for _, s in batch])
        logits, kv = step(kv, si.input_ids, si.metadata, si.logits_indices)
        logits = np.asarray(logits)
        assert logits.shape == (4, V) and logits.dtype == np.float32
        for row, (name, s) in enumerate(batch):
            last = s.num_computed_tokens + len(s.token_ids) - 1
            np.testing.assert_allclose(logits[row], dense[name][last], **TOL,
                                       err_msg=f"step {i + 1}, seq {name} at position {last}")
    # Only the scheduled blocks 0..7 were written: unallocated blocks 8..31 stay zero.
    assert np.asarray(kv[0][:8]).any(axis=(1, 2, 3)).all()
    assert not np.asarray(kv[0][8:NUM_BLOCKS]).any()


def test_step_has_no_hidden_transfers_and_donates(tmp_path, hf_helpers):
    _, _, config, model = load_model(tmp_path, hf_helpers, num_hidden_layers=1)
    b = builder()
    kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS)
    step = make_step_fn(model)
    si = jax.device_put(b.build([ScheduledSeq([3, 4], 0, list(range(1, 12)))]))
    step(make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS), si.input_ids,
         si.metadata, si.logits_indices)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        logits, new_kv = step(kv, si.input_ids, si.metadata, si.logits_indices)
    assert kv[0].is_deleted()  # donated
    k = np.asarray(new_kv[0])
    assert k[3].any() and k[4, :3].any() and not k[4, 3:].any()  # 11 tokens: 8 + 3 slots


def test_multimodal_rows_change_kv_and_logits(tmp_path, hf_helpers):
    hf_cfg, weights, config, model = load_model(tmp_path, hf_helpers, num_hidden_layers=1)
    rng = np.random.default_rng(7)
    D = config.d_model
    placeholder = 5
    toks = [11, 12, 13] + [placeholder] * 8 + [14, 15]  # image rows at positions 3..10
    img1 = rng.standard_normal((8, D)).astype(np.float32)
    img2 = rng.standard_normal((8, D)).astype(np.float32)
    b = builder()
    step = make_step_fn(model)

    def run(images):
        """One step: seq i (own blocks [2i, 2i+1]) carries images[i] behind the same ids."""
        seqs = [ScheduledSeq([2 * i, 2 * i + 1], 0, toks) for i in range(len(images))]
        si = b.build(seqs)
        T = si.input_ids.shape[0]
        mm = np.zeros((T, D), np.float32)
        mask = np.zeros(T, bool)
        for i, img in enumerate(images):
            if img is None:
                continue
            start = int(si.metadata.cu_q_lens[i])  # all prefills: sorted order = caller order
            mm[start + 3:start + 11] = img
            mask[start + 3:start + 11] = True
        kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS)
        logits, kv = step(kv, si.input_ids, si.metadata, si.logits_indices, mm, mask)
        return np.asarray(logits), np.asarray(kv[0])

    logits, kv = run([img1, img2, img1, None])
    # Different images behind identical placeholders: different layer-0 KV at the image
    # positions (block 0 slots 3..7 vs block 2 slots 3..7), identical before (slots 0..2).
    np.testing.assert_array_equal(kv[0, :3], kv[2, :3])
    assert np.abs(kv[0, 3:] - kv[2, 3:]).max() > 1e-3
    assert np.abs(logits[0] - logits[1]).max() > 1e-3
    # The same image: the same KV and logits.
    np.testing.assert_allclose(kv[0:2], kv[4:6], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(logits[0], logits[2], rtol=1e-6, atol=1e-6)
    # Against the dense oracle with the rows injected (and without, for seq 3).
    for row, img in ((0, img1), (1, img2)):
        want = hf_helpers.np_forward(hf_cfg, weights, toks,
                                     mm_rows={3 + j: img[j] for j in range(8)})
        np.testing.assert_allclose(logits[row], want[-1], **TOL)
    np.testing.assert_allclose(logits[3], hf_helpers.np_forward(hf_cfg, weights, toks)[-1],
                               **TOL)
    # mm path with an all-False mask == the no-mm program.
    si = b.build([ScheduledSeq([0, 1], 0, toks)])
    T = si.input_ids.shape[0]
    l_mm, _ = step(make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS), si.input_ids,
                   si.metadata, si.logits_indices, np.ones((T, D), np.float32),
                   np.zeros(T, bool))
    l_plain, _ = step(make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS),
                      si.input_ids, si.metadata, si.logits_indices)
    np.testing.assert_allclose(np.asarray(l_mm), np.asarray(l_plain), rtol=1e-6, atol=1e-6)


def test_step_argument_errors(tmp_path, hf_helpers):
    _, _, config, model = load_model(tmp_path, hf_helpers, num_hidden_layers=1)
    b = builder()
    step = make_step_fn(model)
    si = b.build([ScheduledSeq([0], 0, [1, 2])])
    T = si.input_ids.shape[0]
    kv = make_kv_caches(config, num_blocks=NUM_BLOCKS, block_size=BS)
    with pytest.raises(ValueError, match="mm_embeds and mm_mask go together"):
        step(kv, si.input_ids, si.metadata, si.logits_indices, np.zeros((T, 96), np.float32))
    with pytest.raises(ValueError, match=r"mm_embeds shape \(64, 7\)"):
        step(kv, si.input_ids, si.metadata, si.logits_indices, np.zeros((T, 7), np.float32),
             np.zeros(T, bool))
    with pytest.raises(ValueError, match="got 2 kv caches for 1 layers"):
        step(kv * 2, si.input_ids, si.metadata, si.logits_indices)
    with pytest.raises(ValueError, match="unknown attention_backend 'cuda'"):
        make_step_fn(model, attention_backend="cuda")
    with pytest.raises(ValueError, match="exactly one of num_pages"):
        make_kv_caches(config, num_pages=9, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        make_kv_caches(config, num_pages=9, page_size=0)
    kv = make_kv_caches(config, 9, 8, dtype="bfloat16")
    assert kv[0].shape == (9, 8, 2 * config.num_kv_heads, config.head_dim)
    assert str(kv[0].dtype) == "bfloat16"
