"""KV cache group kinds: one spec class and one single-type manager class per kind.

vLLM 0.33's ``single_type_kv_cache_manager`` shape. Each kind lives in one file of this
package and is registered once, by name, in ``kv_groups.GROUP_KINDS`` (a lazy
``"module:Class"`` string: a kind's file is imported when a layout uses it):

    full_attention.py   FullAttentionSpec  + FullAttentionManager   (vLLM's FullAttentionManager)
    sliding_window.py   SlidingWindowSpec  + SlidingWindowManager   (vLLM's SlidingWindowManager)
    mamba.py            MambaSpec          + MambaManager           (vLLM's MambaManager, "align")

``base.SingleTypeManager`` is the per-kind interface the coordinator
(``core.hybrid.HybridKVCacheManager``, vLLM's ``HybridKVCacheCoordinator``) calls: the
longest hit of the kind, the blocks a step needs, the blocks it adopts, allocates, caches
and releases, the decode fast path's bound, and the per-table invariants. The coordinator
has no per-kind branch.
"""
