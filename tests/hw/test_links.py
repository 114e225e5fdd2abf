"""The all-reduce cost model."""

from __future__ import annotations

import pytest

from tessera.hw.devices import H200_SXM
from tessera.hw.links import DEVICE_LINKS, NVLINK4, all_reduce_seconds, fit_link


def test_ring_all_reduce_formula():
    assert all_reduce_seconds(NVLINK4, 1 << 20, 1) == 0.0
    # 8 ranks: 14 hops of latency, 14/8 of the message over one link
    expected = 14 * NVLINK4.latency_s + 14 / 8 * (1 << 20) / NVLINK4.bandwidth
    assert all_reduce_seconds(DEVICE_LINKS[H200_SXM.name], 1 << 20, 8) == pytest.approx(expected)
    with pytest.raises(ValueError, match="world must be >= 1"):
        all_reduce_seconds(NVLINK4, 10, 0)


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1_000, 100_000, 10_000_000]
    times = [2 * 50e-6 + 1.0 * n / 2e9 for n in sizes]
    link = fit_link("loopback", sizes, times, 2)
    assert link.latency_s == pytest.approx(50e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-6)


def test_all_gather_and_summed_collectives():
    from tessera.hw.links import LOOPBACK_GLOO, all_gather_seconds, collective_seconds

    # 4 ranks: 3 hops, 3/4 of the gathered buffer over one link
    assert all_gather_seconds(NVLINK4, 4000, 4) == pytest.approx(3 * 5e-6 + 0.75 * 4000 / 450e9)
    assert all_gather_seconds(NVLINK4, 4000, 1) == 0.0
    # linear in bytes: 3 calls moving 6 KB in all cost 3 latencies' worth plus the bytes once
    assert collective_seconds(LOOPBACK_GLOO, "all_reduce", 3, 6000, 2) == pytest.approx(
        3 * all_reduce_seconds(LOOPBACK_GLOO, 2000, 2))
    with pytest.raises(ValueError, match="kind must be"):
        collective_seconds(NVLINK4, "broadcast", 1, 10, 2)
