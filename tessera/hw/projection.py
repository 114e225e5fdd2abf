"""A model, not a measurement: the decode step of a dense transformer split tensor-parallel over GPUs, from weight
bytes, HBM bandwidth and the all-reduce cost model of :mod:`tessera.hw.links`.

A decode step reads every weight once, so on ``p`` ranks each layer costs its rank's weight bytes over the HBM
bandwidth (or its FLOPs over the peak, whichever is larger: the roofline), plus the two all-reduces of a
tensor-parallel layer (after attention's output projection and after the MLP's down projection), each of
``batch * hidden * bytes_per_value`` bytes. The output head adds its rows' read once per step::

    t_step = L * (max(W_layer / p / HBM, 2 * batch * P_layer / p / peak) + 2 * allreduce(batch * hidden * b, p))
             + max(W_head / p / HBM, 2 * batch * P_head / p / peak)

Not modelled: KV-cache reads (they grow with the context and the batch), attention FLOPs, the embedding lookup,
the logits' gather or the greedy exchange, kernel launch overheads, and overlap of communication with compute.

Examples
--------
>>> from tessera.hw import projection
>>> world, device = projection.parse_devices("8xH200")
>>> p = projection.project_decode(projection.LLAMA_70B, device, world, batch=1)
>>> round(p.tokens_per_s)
67
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tessera.hw import devices
from tessera.hw.links import DEVICE_LINKS, Link, all_reduce_seconds


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer (Llama-style: q/k/v/o attention, gated MLP, untied head).

    Attributes
    ----------
    name : short name.
    num_layers, hidden, num_heads, num_kv_heads, intermediate, vocab : the config's sizes.
    bytes_per_weight : bytes of one weight and of one activation value on the wire (2: bf16).
    """

    name: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    vocab: int
    bytes_per_weight: float = 2.0

    def __post_init__(self) -> None:
        for field in ("num_layers", "hidden", "num_heads", "num_kv_heads", "intermediate", "vocab"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape.{field} must be an int >= 1, got {value!r}")
        if self.hidden % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelShape: hidden ({self.hidden}) must divide by num_heads ({self.num_heads}) and "
                             f"num_heads by num_kv_heads ({self.num_kv_heads})")
        if not self.bytes_per_weight > 0:
            raise ValueError(f"ModelShape.bytes_per_weight must be > 0, got {self.bytes_per_weight!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    @property
    def layer_params(self) -> int:
        """Weights of one layer: q and o (``hidden x hidden``), k and v (``hidden x kv_heads * head_dim``), gate,
        up and down (``hidden x intermediate`` each). Norms are negligible and left out."""
        kv = self.num_kv_heads * self.head_dim
        return 2 * self.hidden * self.hidden + 2 * self.hidden * kv + 3 * self.hidden * self.intermediate

    @property
    def head_params(self) -> int:
        """Weights of the output head (``vocab x hidden``)."""
        return self.vocab * self.hidden


#: Llama 3 70B's sizes (config.json of meta-llama/Meta-Llama-3-70B), bf16 weights
LLAMA_70B = ModelShape("llama-70b", num_layers=80, hidden=8192, num_heads=64, num_kv_heads=8, intermediate=28672,
                       vocab=128256)
#: the shapes ``tessera profile --project`` knows
MODEL_SHAPES = {LLAMA_70B.name: LLAMA_70B}


@dataclass(frozen=True)
class DecodeProjection:
    """One projected decode step (all times in seconds, per step, on every rank alike).

    Attributes
    ----------
    shape, device, link, world, batch : what was projected.
    layer_compute_s : one layer's weight read (or FLOPs, when larger) on one rank.
    layer_comm_s : one layer's two all-reduces.
    head_compute_s : the output head's weight read (or FLOPs) on one rank.
    all_reduce_bytes : bytes of one all-reduce (``batch * hidden * bytes_per_weight``).
    """

    shape: ModelShape
    device: devices.Device
    link: Link
    world: int
    batch: int
    layer_compute_s: float
    layer_comm_s: float
    head_compute_s: float
    all_reduce_bytes: float

    @property
    def compute_s(self) -> float:
        return self.shape.num_layers * self.layer_compute_s + self.head_compute_s

    @property
    def comm_s(self) -> float:
        return self.shape.num_layers * self.layer_comm_s

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of the whole batch (one token per sequence per step)."""
        return self.batch / self.step_s

    @property
    def comm_share(self) -> float:
        return self.comm_s / self.step_s

    @property
    def all_reduces_per_step(self) -> int:
        return 2 * self.shape.num_layers


def project_decode(shape: ModelShape, device: devices.Device, world: int, batch: int, link: Link | None = None
                   ) -> DecodeProjection:
    """Project one decode step of ``shape`` split over ``world`` ``device``\\ s for ``batch`` sequences.

    Parameters
    ----------
    shape : the model's sizes.
    device : one rank's device (its ``mem_bw`` and its ``bf16`` peak are used).
    world : tensor-parallel ranks (>= 1); the weights are assumed split evenly.
    batch : sequences decoding together (>= 1).
    link : the link between ranks; default: ``DEVICE_LINKS[device.name]``.

    Returns
    -------
    DecodeProjection
    """
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"project_decode: world must be an int >= 1, got {world!r}")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"project_decode: batch must be an int >= 1, got {batch!r}")
    if link is None:
        if device.name not in DEVICE_LINKS:
            raise ValueError(f"project_decode: no link is known between two {device.name}; pass link= (devices with "
                             f"one: {sorted(DEVICE_LINKS)})")
        link = DEVICE_LINKS[device.name]
    peak = device.peak("bf16")
    b = shape.bytes_per_weight

    def roof(params: int) -> float:
        # decode multiplies each weight with `batch` rows: 2 * batch FLOPs per weight
        return max(params * b / world / device.mem_bw, 2.0 * batch * params / world / peak)

    nbytes = batch * shape.hidden * b
    return DecodeProjection(shape, device, link, world, batch, roof(shape.layer_params),
                            2 * all_reduce_seconds(link, nbytes, world), roof(shape.head_params), nbytes)


def parse_devices(text: str) -> tuple[int, devices.Device]:
    """``"8xH200"`` -> ``(8, H200_SXM)``: a count, ``x``, and a device name :func:`tessera.hw.devices.get` knows."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*([A-Za-z0-9_-]+)\s*", text)
    if m is None or int(m.group(1)) < 1:
        raise ValueError(f"devices must look like '8xH200' (a count >= 1, 'x', a device name), got {text!r}")
    name = m.group(2)
    if name.lower() in ("cpu", "npu"):
        raise ValueError(f"devices: a projection needs a GPU with a known link ('h100', 'h200'), got {name!r}")
    return int(m.group(1)), devices.get(name)
