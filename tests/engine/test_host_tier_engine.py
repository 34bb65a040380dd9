"""The engine side of the host tier (issue 16 item 1).

Unit level: `HostPages` applies an ordered list of `HostTransfer` tuples to real KV
arrays exactly as sequential page copies would (a numpy reference walks them one by
one), with one device_put and at most one device_get per batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from prefixcache.engine.host_pages import HostPages, plan_host_transfers

L, NB, NH, PAGE = 2, 6, 5, (4, 2, 8)  # layers, device blocks, host slots, page shape


def _kv(seed: int, dtype=np.float32):
    rng = np.random.default_rng(seed)
    # NB + 1 pages: the last one is the padding page.
    return [jnp.asarray(rng.standard_normal((NB + 1, *PAGE)).astype(dtype)) for _ in range(L)]


def _reference(dev: list[np.ndarray], host: list[np.ndarray], transfers):
    """Sequential page copies, one at a time (the semantics the plan must keep)."""
    dev = [d.copy() for d in dev]
    host = [h.copy() for h in host]
    for kind, b, s in transfers:
        for d, h in zip(dev, host):
            if kind == "store":
                h[s] = d[b]
            else:
                d[b] = h[s]
    return dev, host


def _random_transfers(rng, n):
    return [("store" if rng.random() < 0.5 else "load", int(rng.integers(NB)),
             int(rng.integers(NH))) for _ in range(n)]


def _run(pages: HostPages, kv, transfers):
    kv = pages.apply(kv, transfers)
    pages.finish()
    return kv


@pytest.mark.parametrize("seed", range(40))
def test_batch_equals_sequential_copies(seed):
    rng = np.random.default_rng(seed)
    kv = _kv(seed)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    for p in pages.pages:  # distinct host contents too
        p[:] = rng.standard_normal(p.shape)
    dev0 = [np.asarray(x) for x in kv]
    host0 = [p.copy() for p in pages.pages]
    transfers = _random_transfers(rng, int(rng.integers(1, 12)))
    want_dev, want_host = _reference(dev0, host0, transfers)
    kv = _run(pages, kv, transfers)
    for l in range(L):
        # Exact: copies, no arithmetic. The padding page (id NB) may hold anything.
        np.testing.assert_array_equal(np.asarray(kv[l])[:NB], want_dev[l][:NB])
        np.testing.assert_array_equal(pages.pages[l], want_host[l])
    assert pages.num_h2d <= 1 and pages.num_d2h <= 1


def test_store_after_load_of_same_block_takes_the_loaded_page():
    kv = _kv(1)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    pages.pages[0][3] = 7.0
    pages.pages[1][3] = 8.0
    # load slot 3 -> block 2, then store block 2 -> slot 0: slot 0 gets slot 3's data
    # (not block 2's content before the batch).
    plan = plan_host_transfers([("load", 2, 3), ("store", 2, 0)], num_blocks=NB,
                               num_host_blocks=NH)
    assert plan.num_gather == 0 and plan.host_dst.tolist() == [0]
    assert plan.host_src.tolist() == [3]
    kv = _run(pages, kv, [("load", 2, 3), ("store", 2, 0)])
    assert np.all(pages.pages[0][0] == 7.0) and np.all(pages.pages[1][0] == 8.0)
    assert np.all(np.asarray(kv[0])[2] == 7.0) and np.all(np.asarray(kv[1])[2] == 8.0)
    assert (pages.num_h2d, pages.num_d2h) == (1, 0)


def test_load_of_a_slot_stored_in_the_same_batch_is_a_device_copy():
    kv = _kv(2)
    before = [np.asarray(x) for x in kv]
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    t = [("store", 4, 1), ("load", 0, 1)]
    plan = plan_host_transfers(t, num_blocks=NB, num_host_blocks=NH)
    # one gathered page (block 4), written to slot 1 and to block 0; nothing staged.
    assert plan.gather_ids.tolist() == [4] and plan.staged_slots.size == 0
    assert plan.scatter_ids.tolist() == [0] and plan.scatter_src.tolist() == [0]
    kv = _run(pages, kv, t)
    for l in range(L):
        np.testing.assert_array_equal(pages.pages[l][1], before[l][4])
        np.testing.assert_array_equal(np.asarray(kv[l])[0], before[l][4])
    assert (pages.num_h2d, pages.num_d2h) == (1, 1)
    assert (pages.num_pages_loaded, pages.num_pages_stored) == (1, 1)


def test_padding_to_powers_of_two_bounds_programs():
    kv = _kv(3)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    plan = plan_host_transfers([("store", b, b) for b in range(3)]
                               + [("load", 5, 4)], num_blocks=NB, num_host_blocks=NH)
    # 3 gathered rows -> 4 (padding page NB), 1 staged, 1 scattered.
    assert plan.gather_ids.tolist() == [0, 1, 2, NB]
    assert plan.num_staged_padded == 1 and plan.scatter_ids.tolist() == [5]
    assert plan.scatter_src.tolist() == [4]  # staged row 0 after 4 gathered rows
    for n in (3, 4):
        kv = _run(pages, kv, [("store", b, b) for b in range(n)])
    assert pages.compiled_shapes == {(4, 0, 0)}


def test_bfloat16_pages_keep_their_bits():
    kv = _kv(4, dtype=jnp.bfloat16)
    before = [np.asarray(x) for x in kv]
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    assert pages.dtype == np.dtype(jnp.bfloat16)
    assert pages.nbytes == NH * L * int(np.prod(PAGE)) * 2
    kv = _run(pages, kv, [("store", 1, 0), ("store", 2, 4)])
    kv = _run(pages, kv, [("load", 5, 0), ("load", 3, 4)])
    for l in range(L):
        got = np.asarray(kv[l])
        assert got[5].tobytes() == before[l][1].tobytes()
        assert got[3].tobytes() == before[l][2].tobytes()


def test_bad_transfers_raise_before_any_copy():
    kv = _kv(5)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    for bad in ([("store", NB, 0)], [("load", 0, NH)], [("move", 0, 0)],
                [("load", -1, 0)]):
        with pytest.raises(ValueError, match="host transfer"):
            pages.apply(kv, bad)
    assert pages.num_h2d == 0 and not any(p.any() for p in pages.pages)


def test_apply_runs_clean_under_transfer_guard_disallow():
    kv = _kv(6)
    pages = HostPages(kv, num_blocks=NB, num_host_blocks=NH)
    with jax.transfer_guard("disallow"):
        kv = pages.apply(kv, [("store", 1, 0), ("load", 2, 3)])
        pages.finish()
    assert (pages.num_h2d, pages.num_d2h) == (1, 1)
