"""``dfs_weight``: SGLang's depth-first order over the cached-prefix tree, heavy first.

Each waiting request's cached prefix is a path of block hashes. The paths form a tree;
a node's weight is the number of waiting requests whose cached path passes through it.
Requests are emitted by a depth-first walk that visits heavier children first (equal
weights: the child whose first request came first) and emits a node's own requests
after its children's (SGLang's ``_get_dfs_priority``: post-order, so requests with
nothing cached come last), FCFS within a node. Requests that share the most cached blocks run
together, the largest groups first, before their common prefix can be evicted.
"""

from __future__ import annotations

from prefixcache.scheduling.base import WaitingPolicy


class DFSWeightPolicy(WaitingPolicy):
    name = "dfs_weight"

    def prioritize(self, items, request_of, manager):
        peek = manager.peek_computed_tokens
        bs = manager.block_size
        # node = [weight, first index, own items, children dict]
        root = [0, -1, [], {}]
        for i, x in enumerate(items):
            req = request_of(x)
            n = peek(req) // bs
            node = root
            node[0] += 1
            for h in (req.block_hashes[:n] if n else ()):
                child = node[3].get(h)
                if child is None:
                    child = node[3][h] = [0, i, [], {}]
                child[0] += 1
                node = child
            node[2].append(x)
        out: list = []
        # NOTE: iterative post-order (cached paths can be thousands of blocks deep).
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(node[2])
                continue
            stack.append((node, True))
            kids = sorted(node[3].values(), key=lambda c: (-c[0], c[1]))
            stack.extend((k, False) for k in reversed(kids))
        return out
