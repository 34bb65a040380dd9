"""Host-memory KV pages of the host tier and the per-step copies to and from the device.

The manager (`prefixcache.core`, host tier on: `num_host_blocks > 0`) decides which
cached blocks move between tiers and records the copies as an ordered list of
`HostTransfer(kind, block_id, host_slot)` ("store": device page `block_id` -> host slot;
"load": host slot -> device page `block_id`); their meaning is that of sequential
copies. The engine hands each step's list to `HostPages.apply` BEFORE the step computes.

How one batch runs (`plan_host_transfers` resolves it on the host, in numpy):
  1. the ops are walked in order over symbolic contents: after the walk every page
     written (host slot or device page) is known as a copy of the ORIGINAL content
     (before the batch) of one device page or one host slot. So a store that reads a
     device page an earlier load of the batch wrote takes that load's host data, and a
     load of a slot an earlier store of the batch wrote takes that store's device data
     (host -> host and device -> device copies are what such pairs reduce to);
  2. ONE `jax.device_put` moves the index arrays and the staged host pages (one row per
     device page written from host data, in scatter order) to the device;
  3. ONE jitted function, KV donated, gathers the device pages the stores read (original
     content), then scatters the staged pages / gathered pages into the KV arrays;
  4. the step is dispatched (the copies precede it on the device stream; nothing waits);
  5. ONE `jax.device_get` of the gathered pages, after the step's dispatch
     (`finish`), writes them into the host slots.
Sizes are padded to powers of two (at least `MIN_ROWS`) so the number of compiled
programs stays small: padded gather rows read the padding page (id `num_blocks`) and are
dropped on the host; padded scatter rows write the padding page (read by no sequence:
every kv_len masks it).

Quantized KV (`kv_dtype` float8_e4m3fn / int8): a layer's cache is the pair (pages,
scales f32[num_pages, 2K]) and a page's scales are part of it: every copy above moves
a page's values AND its scales (host slots keep both), in the same two transfers and
the same jitted program (each of the two arrays of a layer gathered and scattered
with the same indices).

The disk tier (`files`: a `prefixcache.engine.page_files.PageFiles`): the manager's
list then mixes `HostTransfer`s with `TierTransfer(kind, src, src_id, dst, dst_id, key,
group)`s touching "disk" (a device page or a host slot -> the file of key `dst_id`; the
file of key `src_id` -> a device page), still sequential copies. `apply` gives each disk
key the batch touches a scratch host slot (rows after the host tier's slots) and
rewrites the list into the host copies above: a file read into its scratch slot
before the batch (its original content), "store" device page -> scratch slot,
"host_copy" host slot -> scratch slot, "load" scratch slot -> device page. So the disk
copies run in the same one device_put / one jitted program / one device_get (the
programs warm-up builds for the host tier serve them); `finish`, after the step's
dispatch, hands a copy of each stored key's scratch slot to one writer thread, which
writes its file (temp file, fsync, rename: never a partial page; ~10 ms a 512 KiB page
here, so not on the engine thread); a read of a key waits for its pending write. A file is read and checksummed once per batch: `validate` (the core
disk tier's validator at lookup) keeps what it read for the batch's loads.

Nothing else crosses the host/device boundary; the two transfers run inside a scoped
`jax.transfer_guard("allow")`, so the engine step stays clean under
`jax.transfer_guard("disallow")`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import logging
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

_I32 = np.int32
_log = logging.getLogger(__name__)


# Smallest padded row count of a non-empty gather / scatter (fewer compiled programs;
# 4 pages of Llama-3.2-1B are 2 MiB).
MIN_ROWS = 4


def _bucket(n: int) -> int:
    """Smallest power of two >= max(n, MIN_ROWS); 0 stays 0."""
    return 0 if n == 0 else max(MIN_ROWS, 1 << (n - 1).bit_length())


class HostTransferPlan(NamedTuple):
    """One batch of host-tier copies resolved to original contents (all numpy).

    Attributes:
      gather_ids: i32[Gp] device pages read (original content), padded with the padding
        page; the first `num_gather` are real.
      store_slots: i32[n] host slots written from gathered pages ...
      store_rows: i32[n] ... row of `gather_ids` each takes.
      staged_slots: i32[h] host slots whose original content is staged for the device,
        one per device page written from host data, in scatter order (h <= Hp, the
        staged buffer's padded row count, always Sp; h == number of real scatter rows
        when nothing is gathered).
      scatter_ids: i32[Sp] device pages written, padded with the padding page.
      scatter_src: i32[Sp] row of concat(gathered[Gp], staged[Hp]) each takes.
      host_dst, host_src: i32[m] host slot -> host slot copies (original content).
      num_gather, num_staged_padded: G and Hp.
    """

    gather_ids: np.ndarray
    store_slots: np.ndarray
    store_rows: np.ndarray
    staged_slots: np.ndarray
    scatter_ids: np.ndarray
    scatter_src: np.ndarray
    host_dst: np.ndarray
    host_src: np.ndarray
    num_gather: int
    num_staged_padded: int

    @property
    def touches_device(self) -> bool:
        return self.gather_ids.size > 0 or self.scatter_ids.size > 0


def plan_host_transfers(transfers: Sequence, *, num_blocks: int,
                        num_host_blocks: int) -> HostTransferPlan:
    """Resolves an ordered list of `HostTransfer`s (sequential copy semantics).

    Args:
      transfers: (kind, block_id, host_slot) tuples, kind "store" or "load"; the
        engine's disk copies add ("host_copy", dst_slot, src_slot) (host slot ->
        host slot, `HostPages.apply`).
      num_blocks: allocatable device pages (the padding page is `num_blocks`).
      num_host_blocks: host slots.

    Raises:
      ValueError: an unknown kind or an id out of range (a manager bug: fail loudly).
    """
    dev: dict[int, tuple[bool, int]] = {}   # device page -> (from_device, id) original
    host: dict[int, tuple[bool, int]] = {}  # host slot -> (from_device, id) original
    for t in transfers:
        kind, b, s = t
        if kind == "host_copy":  # (engine-internal) host slot s -> host slot b
            if not (0 <= b < num_host_blocks and 0 <= s < num_host_blocks):
                raise ValueError(f"host copy {tuple(t)!r} out of range (host slots "
                                 f"[0, {num_host_blocks}))")
            host[b] = host.get(s, (False, s))
            continue
        if not (0 <= b < num_blocks and 0 <= s < num_host_blocks):
            raise ValueError(f"host transfer {tuple(t)!r} out of range (device blocks "
                             f"[0, {num_blocks}), host slots [0, {num_host_blocks}))")
        if kind == "store":
            host[s] = dev.get(b, (True, b))
        elif kind == "load":
            dev[b] = host.get(s, (False, s))
        else:
            raise ValueError(f"host transfer {tuple(t)!r}: kind must be 'store' or 'load'")
    gather: dict[int, int] = {}   # device page -> row in the gathered buffer
    # NOTE: one staged row per device page written from host data, in scatter order
    # (a slot read twice is staged twice): without gathered rows the staged buffer is
    # then the scatter's source as is (`_copy_pages` skips the row gather).
    staged: list[int] = []        # host slot of each staged row
    store_slots, store_rows, host_dst, host_src = [], [], [], []
    for s, (from_dev, src) in host.items():
        if from_dev:
            store_slots.append(s)
            store_rows.append(gather.setdefault(src, len(gather)))
        elif src != s:
            host_dst.append(s)
            host_src.append(src)
    scatter = []  # (device page, from_device, row)
    for b, (from_dev, src) in dev.items():
        if from_dev:
            if src != b:
                scatter.append((b, True, gather.setdefault(src, len(gather))))
        else:
            scatter.append((b, False, len(staged)))
            staged.append(src)
    # NOTE: the staged buffer has as many rows as the scatter (padded alike): programs
    # are keyed by (Gp, Sp) only, at most (log2(max rows) + 1)^2 of them.
    g, gp, sp = len(gather), _bucket(len(gather)), _bucket(len(scatter))
    hp = sp
    gather_ids = np.full(gp, num_blocks, _I32)
    gather_ids[:g] = list(gather)
    scatter_ids = np.full(sp, num_blocks, _I32)
    scatter_src = np.zeros(sp, _I32)
    for i, (b, from_dev, row) in enumerate(scatter):
        scatter_ids[i] = b
        scatter_src[i] = row if from_dev else gp + row
    return HostTransferPlan(
        gather_ids, np.asarray(store_slots, _I32), np.asarray(store_rows, _I32),
        np.asarray(staged, _I32), scatter_ids, scatter_src,
        np.asarray(host_dst, _I32), np.asarray(host_src, _I32), g, hp)


def _as_bits(x):
    """`x` viewed as unsigned ints of its width (exact)."""
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _needs_bits(kv) -> bool:
    """Whether `_copy_pages` should move `kv`'s pages as unsigned ints.

    NOTE: XLA's CPU backend widens a 16-bit float scatter to float32 over the WHOLE
    operand (Llama-3.2-1B's 134 MB pool of 256 pages: ~420 ms to write 4 pages, vs
    ~110 ms through uint16, the bitcast's own copy of the pool; an f32 pool: ~1 ms),
    and a float8_e4m3fn scatter to float16 alike (convert, scatter, convert back: exact
    but three passes over the pool; 4 loads into a 16-layer x 256-page fp8 pool of
    Llama-3.2-1B pages: 5.7x the time of the uint8 path, in-process ratio), so both go
    through uint16 / uint8. int8 pages and
    f32 scales scatter natively (no convert in the compiled program). Accelerators
    scatter 16-bit and 8-bit floats natively, and there a bitcast of the pool could
    cost a copy of it: the bits path is for CPU only.
    """
    dtype = jnp.dtype(kv.dtype)
    platform = next(iter(kv.devices())).platform
    return platform == "cpu" and dtype.itemsize < 4 and jnp.issubdtype(dtype, jnp.floating)


def _is_stacked(kv_caches) -> bool:
    from prefixcache.model.llama import is_stacked  # noqa: PLC0415

    return is_stacked(kv_caches)


def _part_specs(kv_caches) -> tuple[int, tuple]:
    """(arrays A, per part (one array of it, page shape, dtype)) of either KV layout."""
    if _is_stacked(kv_caches):
        parts = kv_caches if isinstance(kv_caches, tuple) else (kv_caches,)
        return parts[0].shape[0], tuple((a, tuple(a.shape[2:]), np.dtype(a.dtype))
                                        for a in parts)
    return len(kv_caches), tuple((part[0], tuple(part[0].shape[1:]), np.dtype(part[0].dtype))
                                 for part in _parts(kv_caches))


def _parts(kv_caches) -> tuple[list, ...]:
    """Layer-major KV -> its parts, each a list over layers: (pages,) or, quantized
    (layers are (pages, scales) pairs), (pages, scales). The stacked layout
    (`make_kv_caches(stacked=True)`): its parts as they are, (pages [A, ...],) or
    (pages, scales)."""
    if _is_stacked(kv_caches):
        return kv_caches if isinstance(kv_caches, tuple) else (kv_caches,)
    if isinstance(kv_caches[0], tuple):
        return tuple(list(part) for part in zip(*kv_caches))
    return (list(kv_caches),)


def _layers(parts) -> list:
    """Inverse of `_parts`."""
    if len(parts) == 1:
        return list(parts[0])
    return [tuple(layer) for layer in zip(*parts)]


def _copy_pages(kv_caches, gather_ids, scatter_ids, scatter_src, staged, *,
                bits: tuple[bool, ...]):
    """gathered = pages `gather_ids` of every layer (original content); then page
    `scatter_ids[i]` of every layer <- row `scatter_src[i]` of concat(gathered, staged).
    Done for each part of the KV (`_parts`: the pages, and the scales of quantized KV)
    with the same indices.

    Args:
      kv_caches: L arrays [num_pages, page, 2K, H], or L pairs (pages, scales
        f32[num_pages, 2K]) (donated); or the stacked layout, pages [L, num_pages, page,
        2K, H] (and scales [L, num_pages, 2K]): copied the same way, page axis 1.
      gather_ids: i32[Gp]; scatter_ids, scatter_src: i32[Sp].
      staged: one array per part: [L, Hp, page, 2K, H] (and [L, Hp, 2K]).
      bits: per part, move it as unsigned ints (`_needs_bits`).

    Returns:
      (new kv_caches, gathered: one array per part, [L, Gp, page, 2K, H] (and
      [L, Gp, 2K])).
    """
    stacked = _is_stacked(kv_caches)
    new_parts, gathered_parts = [], []
    for arrays, stage, as_bits in zip(_parts(kv_caches), staged, bits):
        dtype = arrays.dtype if stacked else arrays[0].dtype
        if as_bits:
            arrays = _as_bits(arrays) if stacked else [_as_bits(kv) for kv in arrays]
            stage = _as_bits(stage)
        gathered = arrays[:, gather_ids] if stacked else jnp.stack(
            [kv[gather_ids] for kv in arrays])
        if gather_ids.shape[0] == 0:
            # NOTE: loads only (the common case): the staged rows ARE the scatter's
            # source rows, in order (`plan_host_transfers`); no row gather of them.
            assert stage.shape[1] == scatter_ids.shape[0], (stage.shape, scatter_ids.shape)
            src = stage
        else:
            src = jnp.concatenate([gathered, stage], axis=1)[:, scatter_src]
        if stacked:
            new = arrays.at[:, scatter_ids].set(src)
            if as_bits:
                new = jax.lax.bitcast_convert_type(new, dtype)
        else:
            new = [kv.at[scatter_ids].set(src[l]) for l, kv in enumerate(arrays)]
            if as_bits:
                new = [jax.lax.bitcast_convert_type(x, dtype) for x in new]
        if as_bits:
            gathered = jax.lax.bitcast_convert_type(gathered, dtype)
        new_parts.append(new)
        gathered_parts.append(gathered)
    if stacked:
        return (tuple(new_parts) if len(new_parts) > 1 else new_parts[0]), tuple(gathered_parts)
    return _layers(new_parts), tuple(gathered_parts)


class HostPages:
    """The host tier's KV pages (numpy) and the batched copies of one step.

    Invariants:
      - `pages[l]` is layer l's host pages, [num_host_blocks, page, 2K, H], the device
        KV arrays' page shape and dtype (bfloat16 / float8_e4m3fn as ml_dtypes' numpy
        dtypes); with quantized KV, `scales[l]` is layer l's host page scales,
        f32[num_host_blocks, 2K] (else `scales` is None): slot s holds a page's values
        in `pages[l][s]` and its scales in `scales[l][s]`, always written together;
      - at most one batch is pending (`apply` done, `finish` not yet): its gathered
        pages are written into their host slots by `finish` (called after the step's
        dispatch, and at the latest by the next `apply`), then its disk stores into
        their files;
      - with `files`, the host arrays have scratch rows after the host tier's slots
        (`pages` / `scales` show the slots only): the disk keys of the batch being
        applied; nothing is kept in them between batches.

    Args:
      kv_caches: the device KV arrays: L arrays, or L (pages, scales) pairs for a
        quantized KV, or the stacked layout (one array [L, ...] or one pair, the
        scanned step's; `make_kv_caches(stacked=True)`) (shapes, dtypes and sharding
        are taken from them; the host slots are per layer either way).
      num_blocks: allocatable device pages (padding page id = num_blocks).
      num_host_blocks: host slots (> 0; 0 with `files`: a disk tier right under the
        device).
      mesh: the runner's mesh (KV sharded over kv heads) or None.
      files: the disk tier's page files (`PageFiles` of the KV arrays' page shapes and
        dtypes), or None (no disk tier).

    Attributes:
      num_h2d, num_d2h: `jax.device_put` / `jax.device_get` calls made (one each at
        most per batch: tests assert it).
      num_pages_loaded, num_pages_stored: device pages written from host data / host
        slots written from device data (batch-resolved, padding excluded).
      compiled_shapes: (Gp, Hp, Sp) of every copy program run.
      num_loaded_by_tier, num_stored_by_tier: device pages loaded from each lower tier's
        pages / pages written to each (Counters by tier name); num_disk_loaded,
        num_disk_stored: the disk's (page files read into device pages / written);
      num_disk_write_errors: pages whose file could not be written (OSError: a full
        disk; logged, and those blocks are misses when looked up).
    """

    def __init__(self, kv_caches, *, num_blocks: int, num_host_blocks: int, mesh=None,
                 files=None):
        self.num_layers, specs = _part_specs(kv_caches)
        self.stacked = _is_stacked(kv_caches)
        self.page_shape = specs[0][1]
        self.dtype = specs[0][2]
        self.num_blocks = int(num_blocks)
        self.num_host_blocks = int(num_host_blocks)
        self.files = None
        # Scratch slots (rows after the host tier's) of the disk keys of one batch.
        self._num_scratch = 0
        # One list of per-layer host arrays per part (pages, and scales if quantized).
        self._host = tuple(
            [np.zeros((self.num_host_blocks + self._num_scratch, *shape), dtype)
             for _ in range(self.num_layers)] for _, shape, dtype in specs)
        self._validated: dict[tuple[int, int], tuple] = {}  # (key, group) -> part arrays
        # (tier, key, group) -> scratch slot of the batch's stores to a lower tier
        self._pending_files: dict[tuple[str, int, int], int] = {}
        self._writing: dict[tuple[int, int], concurrent.futures.Future] = {}
        self._writer = None
        self.stores: dict = {}  # lower tier name -> its page store ("disk": the files)
        self.num_loaded_by_tier: collections.Counter = collections.Counter()
        self.num_stored_by_tier: collections.Counter = collections.Counter()
        self.num_disk_write_errors = 0
        if files is not None:
            self.attach_files(files)
        self.num_h2d = self.num_d2h = 0
        self.num_pages_loaded = self.num_pages_stored = 0
        self.compiled_shapes: set[tuple[int, int, int]] = set()
        self._pending: tuple | None = None  # (gathered device arrays, store slots, rows)
        if mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec as P
            from prefixcache.model import kv_cache_sharding
            # stacked pages [L, n, page, 2K, H] (scales [L, n, 2K]): kv heads over
            # "model", as the KV.
            self._staged_sharding = (NamedSharding(mesh, P(None, None, None, "model", None)),
                                     NamedSharding(mesh, P(None, None, "model")))[:len(specs)]
            self._index_sharding = NamedSharding(mesh, P())
            kv_sharding = kv_cache_sharding(mesh, self.dtype, stacked=self.stacked)
            out = (kv_sharding if self.stacked else [kv_sharding] * self.num_layers,
                   self._staged_sharding)
        else:
            self._staged_sharding = self._index_sharding = None
            out = None
        bits = tuple(_needs_bits(a) for a, _, _ in specs)
        self._copy = jax.jit(functools.partial(_copy_pages, bits=bits),
                             donate_argnums=0, out_shardings=out)

    @property
    def pages(self) -> list:
        """Layer l's host pages, [num_host_blocks, page, 2K, H] (views: writable)."""
        return [p[:self.num_host_blocks] for p in self._host[0]]

    @property
    def scales(self) -> list | None:
        """Layer l's host page scales, f32[num_host_blocks, 2K] (quantized KV), or None."""
        if len(self._host) < 2:
            return None
        return [p[:self.num_host_blocks] for p in self._host[1]]

    @property
    def page_parts(self) -> tuple[tuple[tuple[int, ...], np.dtype], ...]:
        """(page shape, dtype) of each part of one layer's page: the pages, then the
        scales of a quantized KV (the layout of `PageFiles`)."""
        return tuple((tuple(part[0].shape[1:]), part[0].dtype) for part in self._host)

    @property
    def num_programs_built(self) -> int:
        """Executables of the copy program (one per padded (Gp, Hp, Sp)), from jax's
        cache."""
        return self._copy._cache_size()

    @property
    def page_bytes(self) -> int:
        """Bytes of one block's pages over all layers, scales included (quantized KV:
        `prefixcache.kv_dtypes.kv_bytes_per_block`)."""
        return self.num_layers * sum(int(np.prod(part[0].shape[1:])) * part[0].dtype.itemsize
                                     for part in self._host)

    @property
    def nbytes(self) -> int:
        """Bytes of the host pages (scales included)."""
        return self.page_bytes * self.num_host_blocks

    def apply(self, kv_caches, transfers: Sequence) -> list:
        """Dispatches one batch of copies (sequential semantics, see the module doc).

        Args:
          kv_caches: the device KV arrays (donated when the batch touches the device).
          transfers: the manager's ordered `HostTransfer`s (non-empty).

        Returns:
          The KV arrays to use from now on.
        """
        self.finish()
        if self.stores:
            transfers = self._lower_to_host_copies(transfers)
        plan = plan_host_transfers(transfers, num_blocks=self.num_blocks,
                                   num_host_blocks=self.num_host_blocks + self._num_scratch)
        h = plan.staged_slots.size
        staged = []
        # Original host contents are read (staged) before any host slot is written.
        for part in self._host:
            stage = np.empty((self.num_layers, plan.num_staged_padded, *part[0].shape[1:]),
                             part[0].dtype)
            stage[:, h:] = 0  # padding rows (they write the padding page)
            if h:
                for l, p in enumerate(part):
                    # NOTE: `take(..., out=)`: one pass over the bytes (no temporary).
                    np.take(p, plan.staged_slots, axis=0, out=stage[l, :h])
            staged.append(stage)
        if plan.host_dst.size:  # host -> host (fancy indexing reads all sources first)
            for part in self._host:
                for p in part:
                    p[plan.host_dst] = p[plan.host_src]
        if not plan.touches_device:
            return kv_caches
        host = (plan.gather_ids, plan.scatter_ids, plan.scatter_src, tuple(staged))
        with jax.transfer_guard("allow"):
            if self._staged_sharding is None:
                dev = jax.device_put(host)
            else:
                i = self._index_sharding
                dev = jax.device_put(host, (i, i, i, self._staged_sharding))
        self.num_h2d += 1
        self.compiled_shapes.add((plan.gather_ids.size, plan.num_staged_padded,
                                  plan.scatter_ids.size))
        kv_caches, gathered = self._copy(kv_caches, *dev)
        self.num_pages_loaded += int(np.count_nonzero(plan.scatter_ids != self.num_blocks))
        if plan.store_slots.size:
            self._pending = (gathered, plan.store_slots, plan.store_rows)
        return kv_caches

    def finish(self) -> None:
        """Writes the pending batch's gathered pages (and scales) into their host slots
        (ONE `jax.device_get`), then its disk stores into their files; nothing when
        none is pending."""
        if self._pending is not None:
            gathered, slots, rows = self._pending
            self._pending = None
            with jax.transfer_guard("allow"):
                data = jax.device_get(gathered)
            self.num_d2h += 1
            for part, got in zip(self._host, data):
                for l, p in enumerate(part):
                    p[slots] = got[l][rows]
            self.num_pages_stored += int(np.count_nonzero(slots < self.num_host_blocks))
        pending, self._pending_files = self._pending_files, {}
        if pending:
            self._writing = {k: f for k, f in self._writing.items() if not f.done()}
        for (tier, key, group), slot in pending.items():
            # (copies of the scratch rows: the next batch may reuse them at once)
            arrays = [np.stack([p[slot] for p in part]) for part in self._host]
            if tier == "disk":
                k = (key, group)
                self._writing[k] = self._writer.submit(self._write_page, k, arrays)
            else:
                self.stores[tier].write(key, group, arrays)
                self.num_stored_by_tier[tier] += 1

    def _write_page(self, k: tuple[int, int], arrays: list) -> None:
        """Writes one page file (on the writer thread)."""
        try:
            self.files.write(*k, arrays)
        except OSError as e:
            # NOTE: a page that could not be written (disk full, I/O error) is not an
            # engine failure: the core tier still lists the block, its lookup finds no
            # valid file and the block is a miss (never wrong KV).
            self.num_disk_write_errors += 1
            if self.num_disk_write_errors == 1 or self.num_disk_write_errors % 1000 == 0:
                _log.warning("disk tier: page of key %#x not written (%s); %d so far: such "
                             "blocks are misses", k[0], e, self.num_disk_write_errors)
            return
        self.num_stored_by_tier["disk"] += 1

    def _wait_written(self, k: tuple[int, int]) -> None:
        """Waits for the pending write of page `k`, if any (a read sees the last store)."""
        f = self._writing.pop(k, None)
        if f is not None:
            f.result()

    def flush_files(self) -> None:
        """Waits until every page file stored so far is written (or failed: counted)."""
        writing, self._writing = self._writing, {}
        for f in writing.values():
            f.result()

    def discard_pending(self) -> None:
        """Drops a pending batch (after a failed step: the prefix cache, every tier, is
        reset, so no host slot or page file can be served before a new store writes
        it)."""
        self._pending = None
        self._pending_files = {}
        self._validated.clear()

    # -- the disk tier ----------------------------------------------------------------

    def attach_files(self, files) -> None:
        """Serves the disk tier's copies from `files` (a `PageFiles` whose pages have
        the KV arrays' page shapes and dtypes, every layer).

        Raises:
          ValueError: `files` of another page layout.
        """
        if self.files is not None:
            raise ValueError("files: this HostPages already has its page files")
        want = self.page_parts
        if files.parts != want or files.num_layers != self.num_layers:
            raise ValueError(f"files: pages {files.num_layers} x {files.parts}, the KV "
                             f"arrays' {self.num_layers} x {want}")
        self.files = files
        self.attach_store("disk", files)
        # NOTE: one writer thread, first in first out: two stores of one key land in
        # order. A file write with its fsync takes ~10 ms per 512 KiB page here; on
        # the engine thread it would hold up the next step.
        self._writer = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="prefixcache-disk-writer")

    def attach_store(self, tier: str, store) -> None:
        """Serves the copies of the lower tier named `tier` from `store` (read(key,
        group) -> part arrays or None, write(key, group, arrays): `PageFiles` for the
        disk, `MemoryPages` for a tier of one's own)."""
        if tier in ("device", "host") or tier in self.stores:
            raise ValueError(f"tier {tier!r}: already served or not a lower tier")
        self.stores[tier] = store
        self._grow_scratch(2 * MIN_ROWS)

    @property
    def num_disk_loaded(self) -> int:
        return self.num_loaded_by_tier["disk"]

    @property
    def num_disk_stored(self) -> int:
        return self.num_stored_by_tier["disk"]

    def validate(self, key: int, group: int = 0) -> bool:
        """Whether block `key`'s page file of `group` is there and passes every check
        (`PageFiles.read`; a failing file is counted and deleted): the core disk tier's
        validator. The page read is kept for this batch's load of it."""
        k = (int(key), int(group))
        if k in self._validated:
            return True
        self._wait_written(k)
        got = self.files.read(*k)
        if got is None:
            return False
        self._validated[k] = got
        return True

    def forget_validated(self) -> None:
        """Drops the pages `validate` read and no batch loaded (called before each
        schedule, so pages checked for requests that were not admitted are not held)."""
        self._validated.clear()

    def _lower_to_host_copies(self, transfers: Sequence) -> list:
        """The batch's list as host copies over scratch slots (module doc), with the
        pages its loads read (files, or a tier's memory pages) staged into their slots
        and the stores recorded for `finish`."""
        base = self.num_host_blocks
        slots: dict[tuple[str, int, int], int] = {}   # (tier, key, group) -> scratch slot
        reads: list[tuple[tuple[str, int, int], int]] = []
        ops = []

        def host_slot(i, t):
            if not 0 <= i < base:
                raise ValueError(f"tier transfer {tuple(t)!r}: host slot out of range "
                                 f"[0, {base})")
            return i

        def lower_slot(tier, key, group, t, *, read: bool) -> int:
            if tier not in self.stores:
                raise ValueError(f"tier transfer {tuple(t)!r}: the engine copies pages "
                                 f"between device, host and {', '.join(self.stores)} only")
            k = (tier, int(key), int(group))
            if k not in slots:
                slots[k] = base + len(slots)
                if read:  # (its content before the batch)
                    reads.append((k, slots[k]))
            return slots[k]

        for t in transfers:
            if len(t) != 7:  # a HostTransfer: (kind, block_id, host_slot)
                ops.append(t)
                continue
            kind, src, src_id, dst, dst_id, _key, group = t
            if kind not in ("store", "load") or src == dst:
                raise ValueError(f"tier transfer {tuple(t)!r}: kind must be 'store' or "
                                 "'load', between two tiers")
            if dst == "device":
                if src == "host":
                    ops.append(("load", dst_id, src_id))
                else:
                    ops.append(("load", dst_id,
                                lower_slot(src, src_id, group, t, read=True)))
                    self.num_loaded_by_tier[src] += 1
                continue
            if src == "device":
                if dst == "host":
                    ops.append(("store", src_id, dst_id))
                    continue
                slot = lower_slot(dst, dst_id, group, t, read=False)
                ops.append(("store", src_id, slot))
            else:
                src_slot = (host_slot(src_id, t) if src == "host"
                            else lower_slot(src, src_id, group, t, read=True))
                if dst == "host":
                    ops.append(("host_copy", host_slot(dst_id, t), src_slot))
                    continue
                slot = lower_slot(dst, dst_id, group, t, read=False)
                ops.append(("host_copy", slot, src_slot))
            self._pending_files[(dst, int(dst_id), int(group))] = slot
        self._grow_scratch(len(slots))
        for (tier, key, group), slot in reads:
            got = None
            if tier == "disk":
                got = self._validated.pop((key, group), None)
                if got is None:
                    self._wait_written((key, group))
            if got is None:
                got = self.stores[tier].read(key, group)
            if got is None:
                # NOTE: the manager promised this page (validated at lookup, or preloaded
                # and never checked): fail loudly, the step's recovery resets the cache.
                raise RuntimeError(f"{tier} page of key {key:#x} (group {group}) is gone "
                                   "or corrupt at load")
            for part, arr in zip(self._host, got):
                for l, p in enumerate(part):
                    p[slot] = arr[l]
        self._validated.clear()
        return ops

    def _grow_scratch(self, n: int) -> None:
        """At least `n` scratch slots (doubling; the host slots are copied once)."""
        if n <= self._num_scratch:
            return
        new = max(n, 2 * self._num_scratch)
        self._host = tuple(
            [np.concatenate([p, np.zeros((new - self._num_scratch, *p.shape[1:]), p.dtype)])
             for p in part] for part in self._host)
        self._num_scratch = new
