"""``attn_implementation="tessera"`` for Hugging Face transformers models.

>>> from tessera.integrations import transformers as tessera_hf
>>> tessera_hf.register()
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="tessera")

:func:`register` adds :func:`tessera_attention_forward` to transformers' ``AttentionInterface`` and, for its masks,
transformers' SDPA mask builder to ``AttentionMaskInterface`` under the same name (a 4-D boolean mask, or None when
the pattern is plain causal without padding). Each call maps the layer's settings onto an
:class:`~tessera.attention.AttentionSpec`:

==============================  ==========================================================================
transformers                    AttentionSpec
==============================  ==========================================================================
``module.is_causal`` / kwarg    ``mask=causal()``
``sliding_window=w``            ``mask=sliding_window(w)`` (causal within the last ``w`` positions)
``softcap=c``                   ``score=softcap(c)`` (Gemma 2: ``attn_logit_softcapping``)
``s_aux=sinks``                 ``sinks=sinks`` (gpt-oss), a tensor input: it gets a gradient when trained
``scaling``                     ``scale``
a 4-D ``attention_mask``        the built-in mask when it equals that pattern, else a mask reading the tensor
==============================  ==========================================================================

Padding: a mask that differs from the causal / window pattern (left or right padding, packed sequences) is applied
exactly through a mask that reads the tensor (a custom mask: no analytic tile skipping, planned every call). A
query row that transformers masks completely (a padding position) gets output 0, where transformers' eager path
averages every value row; no real position reads those rows.
"""

from __future__ import annotations

import dataclasses
import threading
import weakref

import torch

from tessera.attention import AttentionSpec, attention, causal, sliding_window
from tessera.attention import softcap as softcap_score
from tessera.attention.masks import Mask
from tessera.backends.base import AttentionRequest
from tessera.backends.registry import select

NAME = "tessera"


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run Tessera's attention in transformers models.

    Parameters
    ----------
    name : str
        The key to register (``"tessera"``).
    backend : str
        The Tessera backend every call uses (``"auto"``: the best usable one for the tensors' device).

    Returns
    -------
    str
        ``name``, to pass as ``attn_implementation``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # pragma: no cover - transformers is a test dependency
        raise ImportError("tessera.integrations.transformers needs the `transformers` package (pip install "
                          "transformers); AttentionInterface appeared in transformers 4.48") from exc

    def forward(module, query, key, value, attention_mask, **kwargs):
        return tessera_attention_forward(module, query, key, value, attention_mask, backend=backend, **kwargs)

    AttentionInterface.register(name, forward)
    # Without a mask function registered under the same name transformers passes no mask at all (padding lost).
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


def tessera_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """One attention call of a transformers layer, run by Tessera.

    Parameters
    ----------
    module : the attention module (read: ``is_causal``)
    query : ``[B, Hq, Sq, D]``; key, value : ``[B, Hkv, Skv, D]`` (transformers' layout, KV cache already appended)
    attention_mask : None, or ``[B, 1 | Hq, Sq, >= Skv]`` bool (True attends) or additive float (0 or very negative)
    dropout : must be 0 (Tessera has no attention dropout)
    scaling, sliding_window, softcap, s_aux, is_causal : the layer's settings (see the module docstring)
    backend : the Tessera backend

    Returns
    -------
    (out ``[B, Sq, Hq, D]`` in query's dtype, None): transformers' attention-function contract; attention weights are
    never materialized.
    """
    if dropout:
        raise ValueError(f"attn_implementation='tessera' has no attention dropout, got dropout={dropout}; set the "
                         "config's attention_dropout to 0 or call model.eval()")
    if kwargs.get("position_bias") is not None:
        raise ValueError("attn_implementation='tessera' does not take an additive position_bias (T5-style); use "
                         "'eager' or 'sdpa' for this model")
    if query.dim() != 4 or key.dim() != 4:
        raise ValueError(f"tessera attention: query/key must be [B, H, S, D], got {tuple(query.shape)} and "
                         f"{tuple(key.shape)}")
    causal_layer = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if attention_mask is None and causal_layer and 1 < query.shape[2] < key.shape[2]:
        # transformers drops the mask only when queries start at key 0 (a prefill into an empty static cache, whose
        # keys past the prompt are unused slots), the case SDPA's upper-left causal mask handles; Tessera's queries
        # sit at the LAST Sq positions, so drop the unused slots (what transformers' SDPA path does too).
        key, value = key[:, :, : query.shape[2]], value[:, :, : query.shape[2]]
    if torch.compiler.is_compiling():
        return _traced_forward(query, key, value, attention_mask, causal_layer, sliding_window, softcap, s_aux,
                               scaling, backend)
    return _eager_forward(query, key, value, attention_mask, causal_layer, sliding_window, softcap, s_aux, scaling,
                          backend)


def _eager_forward(query, key, value, attention_mask, causal_layer, sliding_window, softcap, s_aux, scaling,
                   backend) -> tuple[torch.Tensor, None]:
    bsz, hq, sq, d = query.shape
    hkv, skv = key.shape[1], key.shape[2]
    base = _base_mask(causal_layer, sliding_window)
    mask = base if attention_mask is None else _mask_from_tensor(attention_mask, base, bsz, hq, sq, skv)
    score = None if softcap is None else softcap_score(float(softcap))
    spec = AttentionSpec(hq, hkv, d, mask=mask, score=score, sinks=s_aux, scale=scaling)
    chosen = _backend_for(spec, query, backend)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), spec, backend=chosen)
    return out, None


# Under torch.compile the eager path above cannot be traced: Dynamo cannot build an AttentionSpec (a frozen, slotted
# dataclass) inside a graph. Without a mask tensor the spec depends only on constants, so a constant-result function
# registers it while tracing and the graph holds `tessera::attention` with its handle. A mask tensor's values decide
# the spec's mask, and a graph cannot read them: that call runs eagerly (a graph break).
_eager_forward_outside_graph = torch.compiler.disable(_eager_forward,
                                                      reason="tessera: a 4-D attention_mask picks the spec's mask "
                                                             "by value; that layer call runs eagerly")


def _traced_forward(query, key, value, attention_mask, causal_layer, sliding_window, softcap, s_aux, scaling,
                    backend) -> tuple[torch.Tensor, None]:
    if attention_mask is not None:
        return _eager_forward_outside_graph(query, key, value, attention_mask, causal_layer, sliding_window, softcap,
                                            s_aux, scaling, backend)
    handle = _constant_spec_handle(int(query.shape[1]), int(key.shape[1]), int(query.shape[3]), causal_layer,
                                   None if sliding_window is None else int(sliding_window),
                                   None if softcap is None else float(softcap),
                                   None if scaling is None else float(scaling))
    out, _ = torch.ops.tessera.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), s_aux,
                                         handle, backend)
    return out, None


@torch.compiler.assume_constant_result
def _constant_spec_handle(hq: int, hkv: int, d: int, causal_layer: bool, window: int | None, cap: float | None,
                          scale: float | None) -> int:
    from tessera.integrations.attention_ops import attention_op  # noqa: F401  (registers the op before it is traced)
    from tessera.integrations.spec_handles import register_spec

    score = None if cap is None else softcap_score(cap)
    return register_spec(AttentionSpec(hq, hkv, d, mask=_base_mask(causal_layer, window), score=score, scale=scale))


_CHOSEN: dict[tuple, str] = {}


def _backend_for(spec: AttentionSpec, query: torch.Tensor, backend: str) -> str:
    """The backend ``"auto"`` picks for this layer, remembered per (device, dtype, spec structure).

    Selection asks every registered backend whether it can run the spec, and some answer by probing their
    installation (``importlib.util.find_spec``): ~0.15 ms per call measured here, 30 calls per generated token.
    The answer depends only on the key, so it is asked once. Specs without a structure key are selected per call.
    """
    if backend != "auto":
        return backend
    structure = (spec if spec.sinks is None else dataclasses.replace(spec, sinks=None)).structure_key()
    if structure is None:
        return backend
    key = (query.device, query.dtype, structure)
    name = _CHOSEN.get(key)
    if name is None:
        name = _CHOSEN[key] = select(AttentionRequest(spec, query.dtype, query.device), "auto").name
    return name


def _base_mask(causal_layer: bool, window: int | None) -> Mask | None:
    if window is not None:
        if not causal_layer:
            raise ValueError("attn_implementation='tessera': a bidirectional sliding window is not supported; only "
                             "causal sliding windows (Mistral, Gemma 2, gpt-oss) map onto sliding_window(w)")
        return sliding_window(int(window))
    return causal() if causal_layer else None


class _MaskCache:
    """The last mask tensor seen and what it became: transformers passes one mask object to every layer of a type
    in a forward, so the comparison against the built-in pattern runs once per forward and layer type."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: list[tuple[weakref.ref, int, object, Mask | None]] = []

    def get(self, tensor: torch.Tensor, base_key: object):
        with self._lock:
            for ref, version, key, result in self._entries:
                if ref() is tensor and version == tensor._version and key == base_key:
                    return True, result
        return False, None

    def put(self, tensor: torch.Tensor, base_key: object, result: Mask | None) -> None:
        with self._lock:
            self._entries = [e for e in self._entries if e[0]() is not None][-3:]
            self._entries.append((weakref.ref(tensor), tensor._version, base_key, result))


_CACHE = _MaskCache()


def _mask_from_tensor(mask: torch.Tensor, base: Mask | None, bsz: int, hq: int, sq: int, skv: int) -> Mask | None:
    """The spec's mask for transformers' 4-D ``mask``: ``base`` when the tensor is exactly its pattern, else a mask
    that reads the tensor."""
    if mask.dim() != 4 or mask.shape[0] not in (1, bsz) or mask.shape[1] not in (1, hq) or mask.shape[2] != sq \
            or mask.shape[3] < skv:
        raise ValueError(f"tessera attention: attention_mask must be [B, 1 or Hq, Sq, >= Skv] = "
                         f"[{bsz}, 1 or {hq}, {sq}, >= {skv}], got {tuple(mask.shape)}")
    base_key = (None if base is None else base.structure_key(), bsz, hq, sq, skv)
    hit, result = _CACHE.get(mask, base_key)
    if hit:
        return result
    keep = _as_bool(mask[..., :skv])
    expected = _pattern(base, sq, skv, keep.device)
    result = base if bool((keep == expected).all()) else _TensorMask(keep, skv - sq)
    _CACHE.put(mask, base_key, result)
    return result


def _as_bool(mask: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return mask
    if not mask.dtype.is_floating_point:
        raise TypeError(f"tessera attention: attention_mask must be bool or an additive float mask, got {mask.dtype}")
    # transformers' additive masks hold 0 (attend) or the dtype's minimum (masked); anything else is a bias, which
    # a mask cannot express.
    masked = mask <= torch.finfo(mask.dtype).min / 2
    if not bool(((mask == 0) | masked).all()):
        raise ValueError("tessera attention: the additive attention_mask carries a bias (values other than 0 and "
                         "-inf/min); Tessera applies masks and score functions, not additive biases. Use a bool mask, "
                         "or 'eager' / 'sdpa' for this model")
    return ~masked


def _pattern(base: Mask | None, sq: int, skv: int, device: torch.device) -> torch.Tensor:
    """The keep pattern ``[Sq, Skv]`` of ``base`` with queries at the last ``Sq`` positions."""
    q_pos = torch.arange(skv - sq, skv, device=device).view(-1, 1)
    kv_pos = torch.arange(skv, device=device).view(1, -1)
    if base is None:
        return torch.ones(sq, skv, dtype=torch.bool, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return torch.broadcast_to(base.evaluate(zero, zero, q_pos, kv_pos), (sq, skv))


class _TensorMask(Mask):
    """Keep ``keep[b, h or 0, q_pos - offset, kv_pos]``: transformers' own 4-D mask, applied as it is.

    ``keep`` is bool ``[B or 1, Hq or 1, Sq, Skv]``; ``offset = Skv - Sq`` maps Tessera's absolute query positions
    to the mask's query rows.
    """

    batch_dependent = True

    def __init__(self, keep: torch.Tensor, offset: int) -> None:
        self.keep = keep
        self.offset = offset
        self.head_dependent = keep.shape[1] > 1

    def evaluate(self, b, h, q_pos, kv_pos):
        keep = self.keep.to(q_pos.device)
        bi = b if keep.shape[0] > 1 else torch.zeros_like(b)
        hi = h if self.head_dependent else torch.zeros_like(h)
        return keep[bi, hi, q_pos - self.offset, kv_pos]

    def check_lengths(self, num_seqs: int, kv_lens: list[int], dense: bool) -> None:
        if self.keep.shape[0] not in (1, num_seqs):
            raise ValueError(f"attention_mask has batch {self.keep.shape[0]}, the attention call {num_seqs}")

    def __repr__(self) -> str:
        return f"transformers_mask(<{tuple(self.keep.shape)}>)"


__all__ = ["NAME", "register", "tessera_attention_forward"]
