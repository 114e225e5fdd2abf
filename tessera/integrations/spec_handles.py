"""A process-wide table of attention specs, so a torch op schema carries an integer instead of Python callables.

A torch custom op takes tensors and scalars only, but an :class:`~tessera.attention.AttentionSpec` holds masks and
score functions (Python objects, user callables). The op therefore takes ``spec_handle: int``, an index into this
table; the op's implementation looks the spec up again.

The spec stored under a handle never has sinks: sinks are a tensor (often a learned parameter) and travel to the op
as a tensor argument, so they can be graph inputs and receive gradients.

Lifetime: entries are kept for the life of the process, because a compiled graph holds the integer and may run at
any later time. Specs that describe the same computation (:meth:`AttentionSpec.structure_key` equal, after removing
sinks) share one entry, so a model that builds a fresh ``AttentionSpec(..., mask=causal())`` per call adds nothing.
A spec without a structure key (custom masks or score functions, document ids, ALiBi slopes) gets an entry per spec
object: build such specs once (a module attribute), not once per call. :func:`release` drops an entry.
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from tessera.attention.spec import AttentionSpec

_LOCK = threading.Lock()
_SPECS: dict[int, AttentionSpec] = {}
#: structure key (sinks removed) -> handle
_BY_STRUCTURE: dict[tuple, int] = {}
#: id(spec as given) -> (handle, the spec itself, kept alive so that its id is never reused by another object)
_BY_IDENTITY: dict[int, tuple[int, AttentionSpec]] = {}
_NEXT = [0]


def without_sinks(spec: AttentionSpec) -> AttentionSpec:
    """``spec`` with ``sinks=None`` (the spec itself when it has none)."""
    return spec if spec.sinks is None else dataclasses.replace(spec, sinks=None)


def register_spec(spec: AttentionSpec) -> int:
    """The handle of ``spec`` (sinks removed), registering it on first sight.

    Parameters
    ----------
    spec : AttentionSpec

    Returns
    -------
    int
        A handle ``>= 0``; :func:`lookup_spec` returns the spec without sinks.
    """
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"register_spec: expected an AttentionSpec, got {type(spec).__name__}")
    base = without_sinks(spec)
    key = base.structure_key()
    with _LOCK:
        if key is not None:
            handle = _BY_STRUCTURE.get(key)
            if handle is None:
                handle = _new_entry(base)
                _BY_STRUCTURE[key] = handle
            return handle
        hit = _BY_IDENTITY.get(id(spec))
        if hit is not None:
            return hit[0]
        handle = _new_entry(base)
        _BY_IDENTITY[id(spec)] = (handle, spec)
        return handle


def _new_entry(base: AttentionSpec) -> int:
    handle = _NEXT[0]
    _NEXT[0] += 1
    _SPECS[handle] = base
    return handle


@torch.compiler.assume_constant_result
def spec_handle(spec: AttentionSpec) -> int:
    """:func:`register_spec` as seen by ``torch.compile``: Dynamo runs it once while tracing and bakes the integer into
    the graph (guarding on the spec object), so the table lookup never becomes part of the graph."""
    return register_spec(spec)


def lookup_spec(handle: int, sinks: torch.Tensor | None = None) -> AttentionSpec:
    """The spec registered under ``handle``, with ``sinks`` put back when given.

    Raises
    ------
    KeyError
        When ``handle`` was never registered or was released.
    """
    try:
        base = _SPECS[handle]
    except KeyError:
        raise KeyError(
            f"no AttentionSpec is registered under handle {handle}; handles come from "
            "tessera.integrations.spec_handles.register_spec (a released handle cannot be used again)"
        ) from None
    return base if sinks is None else dataclasses.replace(base, sinks=sinks)


def release(handle: int) -> None:
    """Forget the spec under ``handle`` (graphs compiled with it fail with a KeyError afterwards)."""
    with _LOCK:
        _SPECS.pop(handle, None)
        for key in [k for k, h in _BY_STRUCTURE.items() if h == handle]:
            del _BY_STRUCTURE[key]
        for key in [k for k, (h, _) in _BY_IDENTITY.items() if h == handle]:
            del _BY_IDENTITY[key]


def num_registered() -> int:
    """How many specs the table holds (tests and leak checks read it)."""
    return len(_SPECS)
