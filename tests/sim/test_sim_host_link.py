"""Host -> device links of the cost model: presets, load_time units, bad input."""

import json
import math
import pathlib

import pytest

from prefixcache.sim import cost_model as cm
from prefixcache.sim import des
from prefixcache.sim import workloads as wl

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def test_presets_are_effective_bandwidths_with_cited_peaks():
    h200 = cm.HOST_LINKS["h200_pcie5"]
    # PCIe Gen5 x16: 32 GT/s x 16 lanes x 128/130 / 8 bits = 63.0 GB/s per direction.
    assert h200.peak_bandwidth == pytest.approx(63.015e9, rel=1e-4)
    assert h200.efficiency == 0.85
    assert h200.effective_bandwidth == pytest.approx(53.56e9, rel=1e-3)
    assert h200.latency_s == 10e-6
    v5e = cm.get_host_link("tpu_v5e_host")
    assert (v5e.peak_bandwidth, v5e.efficiency, v5e.latency_s) == (15e9, 0.9, 30e-6)
    assert v5e.effective_bandwidth == pytest.approx(13.5e9)
    assert cm.HOST_LINKS["tpu_v6e_host"].peak_bandwidth == 32e9
    for name, link in cm.HOST_LINKS.items():
        assert link.name == name and link.effective_bandwidth < link.peak_bandwidth


def test_load_time_units():
    link = cm.HostLink("toy", peak_bandwidth=2e9, efficiency=0.5, latency_s=1e-3)
    # 1 GB at 1 GB/s effective = 1 s, plus 1 ms of latency; nothing to load costs nothing.
    assert link.load_time(1e9) == pytest.approx(1.001)
    assert link.load_time(0) == 0.0
    assert link.load_time(1e9, num_chips=4) == pytest.approx(0.251)  # 4 links in parallel
    # The cost model: bytes of whole blocks of the model's KV over all chips' links.
    model = cm.CostModel.create("llama_3_1_8b", "h200", num_chips=8, host_link="h200_pcie5")
    assert model.host_link is cm.HOST_LINKS["h200_pcie5"]
    block = model.block_bytes(512)
    assert block == 512 * 128 * 1024 == 64 * 2**20  # 128 KiB per token (32 layers, 8 KV heads)
    expected = 10e-6 + block / (8 * cm.HOST_LINKS["h200_pcie5"].effective_bandwidth)
    assert model.load_time(block) == pytest.approx(expected)
    assert model.load_time(block) * 1e3 == pytest.approx(0.1666, rel=1e-3)  # ms
    assert model.host_bytes_per_s == pytest.approx(8 * 53.563e9, rel=1e-4)
    assert model.load_time(2 * block) - model.load_time(block) == pytest.approx(
        block / model.host_bytes_per_s)  # latency once per transfer
    # An infinitely fast link costs only its latency; with none, nothing.
    assert cm.HostLink("inf", math.inf).load_time(1e12) == 0.0
    assert cm.HostLink("inf", math.inf, latency_s=2e-6).load_time(1) == 2e-6


@pytest.mark.parametrize("kwargs, match", [
    (dict(peak_bandwidth=0), "peak_bandwidth must be a number > 0"),
    (dict(peak_bandwidth=-1e9), "peak_bandwidth must be a number > 0"),
    (dict(peak_bandwidth="fast"), "peak_bandwidth must be a number > 0"),
    (dict(peak_bandwidth=1e9, efficiency=0), r"efficiency must be in \(0, 1\]"),
    (dict(peak_bandwidth=1e9, efficiency=1.5), r"efficiency must be in \(0, 1\]"),
    (dict(peak_bandwidth=1e9, latency_s=-1e-6), "latency_s must be a finite number >= 0"),
    (dict(peak_bandwidth=1e9, latency_s=math.inf), "latency_s must be a finite number >= 0"),
])
def test_bad_links_raise(kwargs, match):
    with pytest.raises(ValueError, match=match):
        cm.HostLink("bad", **kwargs)


def test_bad_load_inputs_raise():
    link = cm.HOST_LINKS["h200_pcie5"]
    for bad in (-1, math.inf, math.nan, "1", True):
        with pytest.raises(ValueError, match="num_bytes must be a finite number >= 0"):
            link.load_time(bad)
    with pytest.raises(ValueError, match="num_chips must be a positive int"):
        link.load_time(1, num_chips=0)
    with pytest.raises(ValueError, match="unknown host link 'nvlink9'"):
        cm.get_host_link("nvlink9")
    with pytest.raises(ValueError, match="unknown host link 'nvlink9'"):
        cm.CostModel.create("tiny", "h200", host_link="nvlink9")
    with pytest.raises(ValueError, match="host_link must be a HostLink"):
        cm.CostModel.create("tiny", "h200", host_link=53e9)
    no_link = cm.CostModel.create("tiny", "h200")
    with pytest.raises(ValueError, match="no host_link"):
        no_link.load_time(1)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        no_link.block_bytes(0)


def _pinned_run(**kwargs):
    reqs = wl.generate("multi_turn", seed=3, num_conversations=12, num_turns=4,
                       new_tokens=(40, 120), output_len=(4, 16), vocab=500)
    cost = cm.CostModel.create("llama_3_1_8b", "h200", **kwargs)
    return des.simulate(reqs, cost_model=cost, num_blocks=48, block_size=16,
                        arrival_rate=20.0, seed=1)


def test_host_tier_off_is_todays_des_exactly():
    # The summary this run gave before the host tier existed (commit 6dd8082): with the
    # tier off -- and a host link on the cost model, which then goes unused -- every
    # figure is the same to the last bit, and no host field appears.
    pinned = json.loads((DATA / "des_pinned_6dd8082.json").read_text())
    assert json.loads(json.dumps(_pinned_run())) == pinned
    assert json.loads(json.dumps(_pinned_run(host_link="h200_pcie5"))) == pinned
    assert pinned["evictions"] > 0 and pinned["preemptions"] > 0  # under memory pressure
