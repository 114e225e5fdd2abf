"""A communication cost model: how long an all-reduce takes over a link, per link type.

The ring all-reduce of ``n`` bytes over ``p`` ranks sends ``2 (p - 1) / p * n`` bytes per rank in ``2 (p - 1)``
sequential hops, so ``t = 2 (p - 1) * latency + 2 (p - 1) / p * n / bandwidth`` (the alpha-beta model). The GPU
links take their bandwidth from datasheets; their per-hop latency is an assumption stated in ``source`` (NCCL's
small-message all-reduce on NVLink is a few microseconds). The loopback gloo link of this machine is measured by
``benchmarks/tensor_parallel.py`` and fitted with :func:`fit_link`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    """One link type between ranks.

    Attributes
    ----------
    name : what it is.
    latency_s : seconds per hop of a small message.
    bandwidth : bytes/s one direction of one rank's link.
    source : where the numbers come from.
    """

    name: str
    latency_s: float
    bandwidth: float
    source: str = ""


# NVLink 4 (H100 / H200 SXM): 900 GB/s per GPU, both directions together
NVLINK4 = Link("NVLink 4 (H100/H200 SXM)", 5e-6, 450e9,
               "NVIDIA H100/H200 datasheets: 900 GB/s NVLink per GPU (450 GB/s each way); 5 us per hop assumed")
# PCIe 5.0 x16: 64 GB/s each way; GPUs without NVLink (H100 PCIe) reduce over it
PCIE5_X16 = Link("PCIe 5.0 x16", 10e-6, 64e9, "PCIe 5.0 x16: 64 GB/s each way; 10 us per hop assumed")

# gloo over this machine's loopback interface, two CPU processes: the fit (fit_link) of the all-reduce times that
# benchmarks/tensor_parallel.py measured on 2026-12-04 (benchmarks/results/tensor-parallel-2026-12-04.json). The
# two ranks shared two cores with other work, so the per-hop latency is mostly scheduling delay, not the wire.
LOOPBACK_GLOO = Link("gloo loopback (this machine, 2 processes)", 759e-6, 2.48e9,
                     "fitted to benchmarks/results/tensor-parallel-2026-12-04.json (AMD EPYC, 2 vCPUs, shared)")

#: the link between two devices of a kind (by Device.name)
DEVICE_LINKS = {"NVIDIA H100 SXM": NVLINK4, "NVIDIA H200 SXM": NVLINK4}


def all_reduce_seconds(link: Link, nbytes: int, world: int) -> float:
    """Predicted seconds of a ring all-reduce of ``nbytes`` over ``world`` ranks on ``link`` (0 for one rank)."""
    if world < 1 or nbytes < 0:
        raise ValueError(f"all_reduce_seconds: world must be >= 1 and nbytes >= 0, got {world} and {nbytes}")
    if world == 1:
        return 0.0
    hops = 2 * (world - 1)
    return hops * link.latency_s + hops / world * nbytes / link.bandwidth


def all_gather_seconds(link: Link, nbytes: int, world: int) -> float:
    """Predicted seconds of a ring all-gather whose gathered result is ``nbytes`` (each rank contributes
    ``nbytes / world``) over ``world`` ranks on ``link``: ``(p - 1)`` hops, each passing one piece along, so
    ``(p - 1) * latency + (p - 1) / p * nbytes / bandwidth`` (0 for one rank)."""
    if world < 1 or nbytes < 0:
        raise ValueError(f"all_gather_seconds: world must be >= 1 and nbytes >= 0, got {world} and {nbytes}")
    if world == 1:
        return 0.0
    hops = world - 1
    return hops * link.latency_s + hops / world * nbytes / link.bandwidth


def collective_seconds(link: Link, kind: str, calls: int, nbytes: float, world: int) -> float:
    """Predicted seconds of ``calls`` collectives of one ``kind`` (``"all_reduce"`` or ``"all_gather"``) that
    moved ``nbytes`` in total (result-buffer bytes summed over the calls) over ``world`` ranks.

    The alpha-beta model is linear in the bytes, so the sum over calls needs only their count and total bytes:
    ``calls * hops * latency + hops / world * nbytes / bandwidth``.
    """
    if kind not in ("all_reduce", "all_gather"):
        raise ValueError(f"collective_seconds: kind must be 'all_reduce' or 'all_gather', got {kind!r}")
    if world < 1 or calls < 0 or nbytes < 0:
        raise ValueError(f"collective_seconds: world >= 1, calls >= 0 and nbytes >= 0 needed, got {world}, {calls}, "
                         f"{nbytes}")
    if world == 1:
        return 0.0
    hops = 2 * (world - 1) if kind == "all_reduce" else world - 1
    return calls * hops * link.latency_s + hops / world * nbytes / link.bandwidth


def fit_link(name: str, sizes: list[int], seconds: list[float], world: int, source: str = "") -> Link:
    """A :class:`Link` fitted to measured all-reduce times (least squares on the alpha-beta model)."""
    import numpy as np

    hops = 2 * (world - 1)
    a = np.array([[hops, hops / world * n] for n in sizes], dtype=np.float64)
    (alpha, inv_beta), *_ = np.linalg.lstsq(a, np.array(seconds, dtype=np.float64), rcond=None)
    return Link(name, max(float(alpha), 0.0), 1.0 / max(float(inv_beta), 1e-15), source)
