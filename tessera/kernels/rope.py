"""Rotary position embeddings: cos/sin tables built once per model, and ``apply_rope`` rotating q and k in place.

Conventions follow Hugging Face transformers: ``angle(p, i) = p * inv_freq[i]`` for ``i < rotary_dim / 2``, with
``inv_freq`` from the config's ``rope_type`` (:mod:`tessera.kernels.rope_scaling`); only the first ``rotary_dim``
dims of each head rotate (partial rotary), the rest pass through.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessera.dtypes import FLOAT_DTYPES
from tessera.kernels import registry
from tessera.kernels.rope_scaling import inv_freq_f64


@dataclass(frozen=True, eq=False)
class RotaryEmbedding:
    """The cos/sin tables of one model's RoPE. Build with :meth:`build` or :meth:`from_hf_config`.

    Attributes
    ----------
    head_dim, rotary_dim : int
        Dims per head, and how many of the leading ones rotate (even, ``<= head_dim``).
    max_position : int
        Table rows: valid positions are ``0 .. max_position - 1``.
    max_position_embeddings : int
        The config's value (the threshold of ``dynamic`` scaling, a fallback of several rules).
    base : float
        ``rope_theta``.
    params : dict
        The rope parameters (``rope_type`` and its keys), kept for :meth:`for_length`.
    seq_len : int or None
        Length the frequencies were computed for (``dynamic``/``longrope``), ``None`` as at model load.
    inv_freq : torch.Tensor float64 ``[rotary_dim // 2]``
        Exact frequencies (the tests' oracle reads these).
    attention_scaling : float
        Factor already folded into ``cos`` and ``sin`` (YaRN, LongRoPE; else 1).
    cos, sin : torch.Tensor float32 ``[max_position, rotary_dim // 2]``, CPU
        ``cos/sin(position * inv_freq) * attention_scaling``, computed in float64 then rounded.
    """

    head_dim: int
    rotary_dim: int
    max_position: int
    max_position_embeddings: int
    base: float
    params: dict
    seq_len: int | None
    inv_freq: torch.Tensor
    attention_scaling: float
    cos: torch.Tensor
    sin: torch.Tensor
    #: device -> (cos, sin) copies, and derived tables of for_length; caches, not state
    _on_device: dict = field(default_factory=dict, repr=False)
    _derived: dict = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, head_dim: int, max_position_embeddings: int, *, base: float = 10000.0,
              scaling: Mapping[str, Any] | None = None, partial_rotary_factor: float = 1.0,
              max_position: int | None = None, seq_len: int | None = None) -> RotaryEmbedding:
        """Tables for ``head_dim``-wide heads.

        Parameters
        ----------
        head_dim : int
        max_position_embeddings : int
            The model config's value; also the table length unless ``max_position`` is given.
        base : float
            ``rope_theta``.
        scaling : Mapping or None
            ``{"rope_type": "linear" | "dynamic" | "llama3" | "yarn" | "longrope", ...}`` with the keys of
            transformers' ``rope_parameters``; ``None`` is plain RoPE.
        partial_rotary_factor : float
            ``rotary_dim = int(head_dim * partial_rotary_factor)``.
        max_position : int or None
            Table rows, when serving a shorter (or longer) context than ``max_position_embeddings``.
        seq_len : int or None
            Build ``dynamic``/``longrope`` frequencies for this current length (see :meth:`for_length`).

        Example
        -------
        >>> rope = RotaryEmbedding.build(128, 8192, base=500000.0, scaling={"rope_type": "llama3", "factor": 8.0,
        ...     "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        >>> rope.cos.shape
        torch.Size([8192, 64])
        """
        rotary_dim = int(head_dim * partial_rotary_factor)
        if head_dim <= 0 or rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
            raise ValueError(f"rotary_dim = int(head_dim * partial_rotary_factor) must be even and in "
                             f"[2, head_dim]; got head_dim={head_dim}, partial_rotary_factor={partial_rotary_factor}")
        rows = max_position_embeddings if max_position is None else max_position
        if rows < 0 or max_position_embeddings <= 0:
            raise ValueError(f"max_position_embeddings must be > 0 and max_position >= 0, got "
                             f"{max_position_embeddings} and {max_position}")
        params = dict(scaling or {})
        params["rope_type"] = params.pop("type", None) or params.get("rope_type") or "default"
        inv, attention = inv_freq_f64(rotary_dim, base, params, max_position_embeddings, seq_len)
        angles = np.arange(rows, dtype=np.float64)[:, None] * inv[None, :]
        cos = torch.from_numpy((np.cos(angles) * attention).astype(np.float32))
        sin = torch.from_numpy((np.sin(angles) * attention).astype(np.float32))
        return cls(head_dim, rotary_dim, rows, max_position_embeddings, float(base), params, seq_len,
                   torch.from_numpy(inv), float(attention), cos, sin)

    @classmethod
    def from_hf_config(cls, config: Any, *, max_position: int | None = None) -> RotaryEmbedding:
        """Tables from a transformers config object or its ``config.json`` dict.

        Reads ``head_dim`` (else ``hidden_size // num_attention_heads``), ``max_position_embeddings``,
        ``rope_theta`` and ``partial_rotary_factor`` (top level or inside the rope dict), the rope dict from
        ``rope_parameters`` (transformers 5) or ``rope_scaling`` (4.x), and a top-level
        ``original_max_position_embeddings`` (Phi-3 keeps it there; it wins, as in transformers).
        """
        def get(key: str, default: Any = None) -> Any:
            value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
            return default if value is None else value

        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        if rope and all(isinstance(v, Mapping) for v in rope.values()):
            raise ValueError(f"per-layer-type rope parameters ({sorted(rope)}) are not supported; build one "
                             f"RotaryEmbedding per layer type with RotaryEmbedding.build")
        head_dim = get("head_dim") or get("hidden_size", 0) // max(get("num_attention_heads", 1), 1)
        if get("original_max_position_embeddings") is not None:
            rope["original_max_position_embeddings"] = get("original_max_position_embeddings")
        base = rope.pop("rope_theta", None) or get("rope_theta", 10000.0)
        partial = rope.pop("partial_rotary_factor", None) or get("partial_rotary_factor", 1.0)
        if get("max_position_embeddings") is None:
            raise ValueError("the config has no max_position_embeddings; pass a full model config")
        return cls.build(int(head_dim), int(get("max_position_embeddings")), base=float(base), scaling=rope,
                         partial_rotary_factor=float(partial), max_position=max_position)

    @property
    def rope_type(self) -> str:
        return self.params["rope_type"]

    def for_length(self, seq_len: int) -> RotaryEmbedding:
        """The tables to use while the sequence is ``seq_len`` long (``seq_len = max position + 1``).

        ``dynamic``: past ``max_position_embeddings`` the base grows with ``seq_len`` and new tables of
        ``seq_len`` rows are computed (O(seq_len * rotary_dim) work per new length; the last one is cached), else
        ``self``. ``longrope``: the long-factor tables (cached) past ``original_max_position_embeddings``, else
        ``self``. Other types: ``self``. Call it once per forward step and pass the result to every layer.
        """
        if seq_len <= 0:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        kind = self.rope_type
        if kind == "dynamic" and seq_len > self.max_position_embeddings:
            key, rows = ("dynamic", seq_len), max(seq_len, self.max_position)
        elif kind == "longrope" and seq_len > self.params.get("original_max_position_embeddings",
                                                               self.max_position_embeddings):
            key, rows = ("long",), self.max_position
        else:
            return self
        if key not in self._derived:
            if kind == "dynamic":
                self._derived.clear()
            self._derived[key] = RotaryEmbedding.build(
                self.head_dim, self.max_position_embeddings, base=self.base, scaling=self.params,
                partial_rotary_factor=self.rotary_dim / self.head_dim, max_position=rows, seq_len=seq_len)
        return self._derived[key]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin)`` on ``device`` (copied once per device, then cached)."""
        if device.type == "cpu":
            return self.cos, self.sin
        if device not in self._on_device:
            self._on_device[device] = (self.cos.to(device), self.sin.to(device))
        return self._on_device[device]


def _check_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding) -> None:
    if not isinstance(rope, RotaryEmbedding):
        raise TypeError(f"rope must be a RotaryEmbedding (RotaryEmbedding.build / .from_hf_config), got "
                        f"{type(rope).__name__}")
    for name, x in (("q", q), ("k", k)):
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
        if x.dim() != 3 or x.shape[2] != rope.head_dim:
            raise ValueError(f"{name} must be [tokens, heads, head_dim={rope.head_dim}], got {tuple(x.shape)}")
        if x.numel() and x.stride(2) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous (stride 1), got strides {x.stride()}; "
                             f"pass {name}.contiguous() (then use the returned tensor)")
    if k.dtype != q.dtype or k.device != q.device or positions.device != q.device:
        raise ValueError(f"q, k and positions must share a device and q, k a dtype; got q {q.dtype} on "
                         f"{q.device}, k {k.dtype} on {k.device}, positions on {positions.device}")
    if positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        raise TypeError(f"positions must be a 1-D int32/int64 tensor, got {positions.dtype} "
                        f"{tuple(positions.shape)}")
    if not q.shape[0] == k.shape[0] == positions.shape[0]:
        raise ValueError(f"q, k and positions must have the same number of tokens, got {q.shape[0]}, "
                         f"{k.shape[0]} and {positions.shape[0]}")
    if positions.numel():
        lo, hi = (int(v) for v in positions.aminmax())
        if lo < 0 or hi >= rope.max_position:
            raise ValueError(f"positions must be in [0, {rope.max_position}) (the table's rows), got [{lo}, {hi}]; "
                             f"build the RotaryEmbedding with max_position >= {hi + 1}"
                             + (f", or use rope.for_length({hi + 1})" if rope.rope_type == "dynamic" else ""))


def apply_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, *,
               interleaved: bool = False, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate the first ``rope.rotary_dim`` dims of every q and k head IN PLACE by its token's position.

    With ``r = rotary_dim``, ``h = r / 2``, ``c, s = rope.cos[p, i], rope.sin[p, i]``, each pair ``(a, b)``
    becomes ``(a c - b s, b c + a s)``. Pairs are ``(x[i], x[i + h])`` (``interleaved=False``: GPT-NeoX, Llama,
    transformers' ``rotate_half``) or ``(x[2i], x[2i + 1])`` (``interleaved=True``: GPT-J). Dims ``>= r`` are
    untouched. The math runs in float32; results are stored in the input dtype.

    Parameters
    ----------
    q : torch.Tensor float32/bfloat16/float16 ``[tokens, num_q_heads, head_dim]``
    k : torch.Tensor same dtype and device ``[tokens, num_kv_heads, head_dim]``
        Any strides whose last one is 1 (e.g. views into a fused qkv projection).
    positions : torch.Tensor int32/int64 ``[tokens]``
        Each in ``[0, rope.max_position)``.
    rope : RotaryEmbedding
    interleaved : bool
    backend : str
        ``"auto"``, ``"reference"``, ``"cpu"`` or ``"triton"``.

    Returns
    -------
    (q, k) : the same tensors, rotated.

    Example
    -------
    >>> rope = RotaryEmbedding.build(64, 4096)
    >>> q, k = torch.randn(5, 8, 64), torch.randn(5, 2, 64)
    >>> q, k = apply_rope(q, k, torch.arange(5), rope)
    """
    if torch.compiler.is_compiling():
        # The kernels are opaque to Dynamo and the position range check reads values: trace the custom op, whose
        # implementation runs this function (checks included) when the graph runs.
        from tessera.integrations import kernel_ops

        return kernel_ops.apply_rope(q, k, positions, rope, interleaved=interleaved, backend=backend)
    _check_qk(q, k, positions, rope)
    fn = registry.resolve("apply_rope", backend, q.device)
    if q.shape[0] == 0:
        return q, k
    return fn(q, k, positions, rope, interleaved)
