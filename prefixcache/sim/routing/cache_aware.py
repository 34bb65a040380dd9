"""``cache_aware``: SGLang router's cache-aware policy over approximate radix trees.

The router does not see the replicas' caches: it remembers what it *routed* where, in
one token-level radix tree whose nodes carry, per replica ("tenant"), the time that
replica last got a request through the node (SGLang router's multi-tenant tree). Per
request (SGLang's defaults):

1. If the load is imbalanced -- ``max - min > balance_abs_threshold`` and
   ``max > min * balance_rel_threshold`` over outstanding requests -- route to the
   least-loaded replica.
2. Else match the prompt in the tree: if the matched fraction exceeds
   ``cache_threshold``, route to the replica at the deepest matched node (the most
   recent one there); otherwise to the replica whose tree is smallest (most room).
3. Insert the prompt under the chosen replica.

Each replica's part of the tree is capped at ``max_tree_size`` tokens: past it, its
least recently used leaves are dropped (SGLang evicts on a timer; here every
``eviction_interval`` requests, so runs are deterministic).
"""

from __future__ import annotations

import numpy as np

from prefixcache.sim.routing.base import Router, least_loaded


class _Node:
    __slots__ = ("edge", "children", "tenants", "parent")

    def __init__(self, edge: np.ndarray, parent: "_Node | None"):
        self.edge = edge  # u64[n]: the tokens on the edge into this node
        self.children: dict[int, _Node] = {}
        self.tenants: dict[int, int] = {}  # replica -> last access (router clock)
        self.parent = parent


class ApproxTree:
    """A token radix tree shared by all replicas, each node tagged with its replicas.

    Invariants (``check``): a replica on a node is on all its ancestors; ``size[r]`` is
    the sum of the edge lengths of the nodes tagged with ``r``; every non-root node has
    at least one replica and a non-empty edge whose first token keys it in its parent.
    """

    def __init__(self, num_tenants: int):
        self.root = _Node(np.zeros(0, np.uint64), None)
        self.size = [0] * num_tenants
        self.clock = 0

    def match(self, toks: np.ndarray) -> tuple[int, int | None]:
        """``(matched tokens, replica at the deepest matched node or None)``."""
        node = self.root
        pos = 0
        n = len(toks)
        best = None
        while pos < n:
            child = node.children.get(int(toks[pos]))
            if child is None:
                break
            edge = child.edge
            m = min(len(edge), n - pos)
            eq = edge[:m] == toks[pos:pos + m]
            k = m if eq.all() else int(np.argmin(eq))
            pos += k
            best = child
            if k < len(edge):
                break
            node = child
        if best is None or not best.tenants:
            return pos, None
        # The most recent replica at the deepest node (lowest index among equals).
        tenant = max(best.tenants.items(), key=lambda kv: (kv[1], -kv[0]))[0]
        return pos, tenant

    def insert(self, toks: np.ndarray, tenant: int) -> None:
        self.clock += 1
        now = self.clock
        node = self.root
        pos = 0
        n = len(toks)
        while pos < n:
            t = int(toks[pos])
            child = node.children.get(t)
            if child is None:
                leaf = _Node(toks[pos:].copy(), node)
                leaf.tenants[tenant] = now
                node.children[t] = leaf
                self.size[tenant] += n - pos
                return
            edge = child.edge
            m = min(len(edge), n - pos)
            eq = edge[:m] == toks[pos:pos + m]
            k = m if eq.all() else int(np.argmin(eq))
            if k < len(edge):  # split the edge at k
                mid = _Node(edge[:k].copy(), node)
                mid.tenants = dict(child.tenants)
                child.edge = edge[k:].copy()
                child.parent = mid
                mid.children[int(child.edge[0])] = child
                node.children[t] = mid
                child = mid
            if tenant not in child.tenants:
                self.size[tenant] += len(child.edge)
            child.tenants[tenant] = now
            pos += k
            node = child

    def smallest(self) -> int:
        """The replica with the fewest tokens in the tree (lowest index among equals)."""
        size = self.size
        return min(range(len(size)), key=size.__getitem__)

    def evict(self, tenant: int, max_size: int) -> None:
        """Drop ``tenant``'s least recently used leaves until its size <= ``max_size``."""
        if self.size[tenant] <= max_size:
            return
        leaves = []
        stack = [self.root]
        while stack:
            node = stack.pop()
            kids = [c for c in node.children.values() if tenant in c.tenants]
            if node is not self.root and not kids:
                leaves.append((node.tenants[tenant], id(node), node))
            stack.extend(kids)
        import heapq  # noqa: PLC0415

        heapq.heapify(leaves)
        while leaves and self.size[tenant] > max_size:
            _, _, node = heapq.heappop(leaves)
            del node.tenants[tenant]
            self.size[tenant] -= len(node.edge)
            parent = node.parent
            if not node.tenants:
                del parent.children[int(node.edge[0])]
            if parent is not self.root and not any(
                    tenant in c.tenants for c in parent.children.values()):
                heapq.heappush(leaves, (parent.tenants[tenant], id(parent), parent))

    def check(self) -> None:
        size = [0] * len(self.size)
        stack = [self.root]
        while stack:
            node = stack.pop()
            for t, child in node.children.items():
                assert len(child.edge) and int(child.edge[0]) == t, "edge keyed by its first token"
                assert child.tenants, "a node without replicas"
                assert child.parent is node, "broken parent link"
                if node is not self.root:
                    assert set(child.tenants) <= set(node.tenants), "replica missing on an ancestor"
                for r in child.tenants:
                    size[r] += len(child.edge)
                stack.append(child)
        assert size == self.size, f"tree sizes {self.size} != recount {size}"


class CacheAwareRouter(Router):
    name = "cache_aware"

    def __init__(self, num_replicas: int, *, block_size: int, seed: int = 0,
                 cache_threshold: float = 0.5, balance_abs_threshold: int = 32,
                 balance_rel_threshold: float = 1.0001, max_tree_size: int = 1 << 24,
                 eviction_interval: int = 1000):
        super().__init__(num_replicas, block_size=block_size, seed=seed)
        if not 0.0 <= float(cache_threshold) <= 1.0:
            raise ValueError(f"cache_aware: cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 1.0:
            raise ValueError("cache_aware: balance_abs_threshold must be >= 0 and "
                             "balance_rel_threshold >= 1")
        if max_tree_size < 1 or eviction_interval < 1:
            raise ValueError("cache_aware: max_tree_size and eviction_interval must be >= 1")
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.max_tree_size = int(max_tree_size)
        self.eviction_interval = int(eviction_interval)
        self.tree = ApproxTree(num_replicas)
        self._routed = 0

    def route(self, request, loads, now):
        # NOTE: the ids' u64 bytes viewed as an array (one copy, no Python ints).
        toks = np.frombuffer(request.token_bytes(0, request.num_prompt_tokens), np.uint64)
        hi = max(ld.outstanding for ld in loads)
        lo = min(ld.outstanding for ld in loads)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            r = least_loaded(loads)
        else:
            matched, tenant = self.tree.match(toks)
            if tenant is not None and matched / max(len(toks), 1) > self.cache_threshold:
                r = tenant
            else:
                r = self.tree.smallest()
        self.tree.insert(toks, r)
        self._routed += 1
        if self._routed % self.eviction_interval == 0:
            for t in range(self.num_replicas):
                self.tree.evict(t, self.max_tree_size)
        return r

    def check_invariants(self) -> None:
        self.tree.check()
