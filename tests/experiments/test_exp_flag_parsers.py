"""The experiments' session-7 flag parsers (--kv_bytes, --kv_dtype, --host_multiples,
--host_weight) on values of any type: a ValueError naming the flag, never another
exception. Regression (round 4, s7-fuzz-new): a config value that is not a string or a
list (None, a bool, a number) raised ``TypeError: ... is not iterable``; a single number
is now one value.
"""
import ml_collections
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from experiments import _kv_budget as kb
from experiments import host_tier as ht
from experiments import route

ANY = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**70), st.floats(),
                st.text(max_size=10),
                st.lists(st.one_of(st.text(max_size=4), st.integers(), st.none()), max_size=3),
                st.sampled_from(["1e400", "1e400,2", "int8,fp8", "2GiB,", ",", "auto"]))
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(v=ANY)
def test_kv_dtype_flag(v):
    try:
        got = kb.parse_kv_dtypes(v)
    except ValueError as e:
        assert "kv_dtype" in str(e)
    else:
        assert got and all(isinstance(x, str) for x in got)


@FAST
@given(v=ANY)
def test_kv_bytes_flag(v):
    try:
        got = kb.parse_budgets(v)
    except ValueError as e:
        assert "byte" in str(e)
    else:
        assert all(type(b) is int and b >= 1 for b in got)


@FAST
@given(v=ANY)
def test_kv_bytes_resolve(v):
    try:
        rows = kb.resolve(capacities="", kv_bytes=v, kv_dtype="int8", model="llama_3_2_1b",
                          block_size=16)
    except ValueError as e:
        assert "byte" in str(e) or "capacities" in str(e) or "block" in str(e)
    else:
        assert all(n >= 1 for _, n, _, _ in rows)


@FAST
@given(v=ANY)
def test_host_multiples_flag(v):
    try:
        got = ht.parse_multiples(v)
    except ValueError as e:
        assert "host_multiples" in str(e)
    else:
        assert got and all(0 < m < float("inf") for m in got)


@FAST
@given(v=ANY)
def test_host_weight_flag(v):
    config = ml_collections.ConfigDict({"host_weight": v, "block_size": 16})
    if isinstance(v, str) and v.strip() == "auto":
        return  # needs a cost model
    try:
        w = route.host_weight(config, None)
    except ValueError as e:
        assert "host_weight" in str(e)
    else:
        assert 0.0 <= w <= 1.0


@pytest.mark.parametrize("fn", [kb.parse_kv_dtypes, kb.parse_budgets, ht.parse_multiples])
@pytest.mark.parametrize("bad", [None, True, 0.0, -3])
def test_non_string_non_list_values_are_value_errors(fn, bad):
    with pytest.raises(ValueError):
        fn(bad)


def test_one_number_is_one_value():
    assert ht.parse_multiples(2) == (2.0,)
    assert kb.parse_budgets(1024) == (1024,)
    assert kb.parse_kv_dtypes(("int8", "int8")) == ("int8",)
