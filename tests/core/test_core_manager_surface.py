"""``KVCacheManager`` is a real class: every public method and attribute of every
implementation is defined (and documented) on it, no ``__getattr__``; the calls still
reach the implementation's own bound methods (the one fast path)."""

import inspect
import pydoc
import typing

import pytest

from prefixcache._validate import ArgumentTypeError
from prefixcache.core import KVCacheManager, Request
from prefixcache.core.kv_cache_blocks import KVCacheBlocks
from prefixcache.core.kv_cache_manager import HashKVCacheManager
from prefixcache.core.kv_groups import parse_kv_groups

BS = 4

# One manager per implementation (and the host tier, which swaps private methods).
CONFIGS = {
    "hash": dict(),
    "hash_host": dict(num_host_blocks=4),
    "radix": dict(index="radix"),
    "radix_host": dict(index="radix", num_host_blocks=4),
    "hybrid": dict(kv_cache_groups=parse_kv_groups("full,sw8")),
    "hybrid_mamba": dict(kv_cache_groups=parse_kv_groups("full,mamba")),
    "radix_hybrid": dict(index="radix", kv_cache_groups=parse_kv_groups("full,sw8")),
}
IMPLEMENTATIONS = {"HashKVCacheManager", "RadixKVCacheManager", "HybridKVCacheManager",
                   "RadixHybridKVCacheManager"}


def _make(name):
    return KVCacheManager(16, BS, **CONFIGS[name])


def _public(obj) -> set[str]:
    """Public names (class constants such as INDEX_NAME, read on the index class, left
    out)."""
    return {n for n in dir(obj) if not n.startswith("_") and not n.isupper()}


def _class_attr(cls, name):
    for klass in cls.__mro__:
        if name in klass.__dict__:
            return klass.__dict__[name]
    return None


def test_configs_cover_every_implementation():
    assert {type(_make(c).implementation).__name__ for c in CONFIGS} == IMPLEMENTATIONS


def test_no_attribute_forwarding():
    assert "__getattr__" not in vars(KVCacheManager)
    assert KVCacheManager.__getattribute__ is object.__getattribute__
    assert KVCacheManager.__setattr__ is object.__setattr__


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_public_name_of_the_implementation_is_defined_and_documented(config):
    # Fails when an implementation grows a public method or attribute this class does
    # not define: add it to KVCacheManager, with a docstring.
    m = _make(config)
    impl = m.implementation
    for name in sorted(_public(impl)):
        mine = vars(KVCacheManager).get(name)
        assert mine is not None, f"KVCacheManager does not define {name!r}"
        theirs = _class_attr(type(impl), name)
        if callable(theirs) and not isinstance(theirs, (property, type)):
            assert inspect.isfunction(mine), name
            assert mine.__doc__ and mine.__doc__.strip(), name
            # The fast path: the instance holds the implementation's bound method (its
            # instance-level swap included: the radix index's host-tier lookup).
            bound = vars(m)[name]
            assert bound.__self__ is impl and bound == getattr(impl, name), name
        else:
            assert isinstance(mine, property) and mine.__doc__, name
            assert getattr(m, name) is getattr(impl, name) or getattr(m, name) == getattr(
                impl, name), name


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_attributes_the_implementation_lacks_raise_attribute_error(config):
    m = _make(config)
    impl = m.implementation
    props = {n for n, v in vars(KVCacheManager).items() if isinstance(v, property)}
    for name in sorted(props - _public(impl) - {"implementation"}):
        with pytest.raises(AttributeError):
            getattr(m, name)
        assert not hasattr(m, name)


def test_help_lists_every_method_with_its_docstring():
    text = pydoc.plain(pydoc.render_doc(KVCacheManager))
    methods = [n for n, v in vars(KVCacheManager).items()
               if inspect.isfunction(v) and not n.startswith("_")]
    assert {"get_computed_blocks", "allocate_slots", "free", "get_block_ids",
            "reset_prefix_cache", "take_events", "make_prefix_cache_stats"} <= set(methods)
    for name in methods:
        assert f"{name}(self" in text, name
        first = vars(KVCacheManager)[name].__doc__.strip().splitlines()[0]
        assert first.split()[0] in text, name


def test_annotations_resolve_and_allocate_slots_takes_and_returns_kvcacheblocks():
    for name, fn in vars(KVCacheManager).items():
        if inspect.isfunction(fn):
            typing.get_type_hints(fn)  # every annotation names a real type
    hints = typing.get_type_hints(KVCacheManager.allocate_slots)
    assert KVCacheBlocks in typing.get_args(hints["new_computed_blocks"])
    assert hints["return"] == KVCacheBlocks | None
    assert typing.get_type_hints(KVCacheManager.get_computed_blocks)["return"] == tuple[
        KVCacheBlocks, int]
    # The implementations say the same.
    for config in CONFIGS:
        cls = type(_make(config).implementation)
        assert typing.get_type_hints(cls.allocate_slots)["return"] == KVCacheBlocks | None
        assert typing.get_type_hints(cls.find_longest_cache_hit)["return"] == tuple[
            tuple[list, ...], int]
        # One class defines the lookup's API (the implementations answer the hit).
        assert "get_computed_blocks" not in {n for k in cls.__mro__ for n in vars(k)}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_class_signatures_match_the_implementations(config):
    cls = type(_make(config).implementation)
    for name in sorted(_public(cls)):
        theirs = _class_attr(cls, name)
        if not inspect.isfunction(theirs):
            continue
        mine = inspect.signature(vars(KVCacheManager)[name]).parameters
        assert [(p.name, p.default, p.kind) for p in mine.values()] == [
            (p.name, p.default, p.kind)
            for p in inspect.signature(theirs).parameters.values()], name


class _Recorder:
    """Stands in for an implementation: every method records its arguments."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        def method(*args):
            self.calls.append((name, args))
            return (name, args)
        return method


# The methods the manager class itself implements over its index (the rest forward).
OWN_METHODS = {"get_computed_blocks", "peek_computed_tokens"}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_get_computed_blocks_is_the_managers_own_and_counts_one_lookup(config):
    # One class defines get_computed_blocks: it asks the index for the hit
    # (find_longest_cache_hit, which counts nothing), counts the lookup and wraps it.
    m = _make(config)
    impl = m.implementation
    assert "get_computed_blocks" not in vars(m)  # the class's method, not a bound one
    r = Request("r", list(range(1, 40)))
    before = (impl.num_lookups, impl.num_lookup_tokens, impl.num_hit_tokens)
    raw, raw_hit = m.find_longest_cache_hit(r)
    assert (impl.num_lookups, impl.num_lookup_tokens, impl.num_hit_tokens) == before
    blocks, hit = m.get_computed_blocks(r)
    assert hit == raw_hit and blocks.blocks == tuple(raw)
    assert type(blocks) is impl._hit_blocks_class
    assert (impl.num_lookups, impl.num_lookup_tokens) == (before[0] + 1, before[1] + 39)
    with pytest.raises(ArgumentTypeError, match="request must be a prefixcache Request"):
        m.get_computed_blocks(object())
    assert impl.num_lookups == before[0] + 1


def test_the_class_methods_forward_every_argument_in_order():
    # The class's methods are what KVCacheManager.method(manager, ...) and help() see;
    # each hands its arguments to the implementation's method of the same name.
    m = object.__new__(KVCacheManager)
    m._impl = rec = _Recorder()
    for name, fn in vars(KVCacheManager).items():
        if not inspect.isfunction(fn) or name.startswith("_") or name in OWN_METHODS:
            continue
        params = list(inspect.signature(fn).parameters)[1:]
        args = tuple(object() for _ in params)
        assert fn(m, *args) == (name, args), name
        assert rec.calls[-1] == (name, args), name


@pytest.mark.parametrize("config", ["hash", "radix"])
def test_one_group_managers_answer_the_layout_methods(config):
    m = _make(config)
    r = Request("r", list(range(1, 11)))
    blocks, hit = m.get_computed_blocks(r)
    assert m.prefill_chunks(r, hit) == [10]  # one chunk: no group asks for stops
    m.allocate_slots(r, 10 - hit, hit, blocks)
    assert m.num_held_blocks("r") == (len(m.get_block_ids("r")),) == (3,)
    hashes = r.block_hashes[:2]
    assert m.waiting_keys(hashes) == list(hashes)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        m.prefill_chunks(r, 10)
    with pytest.raises(ArgumentTypeError, match="block_hashes"):
        m.waiting_keys(b"abc")
    with pytest.raises(ValueError, match="unknown request id"):
        m.num_held_blocks("nobody")


def test_the_layout_methods_agree_with_the_hybrid_manager_on_one_group_shape():
    # Two full-attention groups (the hybrid manager) hold the same blocks per group as
    # one group does: num_held_blocks per group, one prefill chunk.
    h = KVCacheManager(32, BS, kv_cache_groups=parse_kv_groups("full,full"))
    f = KVCacheManager(32, BS)
    for m in (h, f):
        r = Request("r", list(range(1, 11)))
        blocks, hit = m.get_computed_blocks(r)
        assert m.prefill_chunks(r, hit) == [10]
        m.allocate_slots(r, 10, hit, blocks)
    assert h.num_held_blocks("r") == f.num_held_blocks("r") * 2


def test_attributes_are_read_only_and_instance_writes_stay_local():
    m = _make("hash")
    with pytest.raises(AttributeError):
        m.num_blocks = 3
    assert m.num_blocks == 16
    assert type(m.implementation) is HashKVCacheManager
    # A spy on a hook (what tests do) replaces the bound method on this object only.
    calls = []
    m.on_waiting = lambda rid, hashes: calls.append(rid)
    m.on_waiting("x", [])
    assert calls == ["x"] and "on_waiting" not in vars(m.implementation)
