"""Which backend implements which kernel op, and how a call picks one.

Each backend's ``ops`` package (beside the module defining its class: :func:`tessera.backends.registry.ops_package`)
has one module per op family; every module ends with ``OPS = {"op_name": function}``. Nothing is imported until an
op is first called (then the backend's family modules are imported and their tables merged), so
``import tessera.kernels`` stays cheap, and a new accelerator's kernels are found from its backend folder alone.
Public functions in ``tessera.kernels`` validate their arguments, then call ``resolve(op, backend, device)`` and run
what it returns.

Selection under ``backend="auto"``: among the usable backends that run tensors of the call's device type and
implement the op, the highest priority wins (on CPU tensors the cpu backend, on CUDA tensors triton when it is
installed, else the float64 reference). The reference functions compute in float64 and return the API's output
dtype; their ``*_f64`` twins (tests' oracle) return float64.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Callable

from tessera.backends import registry as backends

_TABLES: dict[str, dict[str, Callable]] = {}
_LOCK = threading.Lock()
#: the backends registry's generation the cached tables and answers belong to
_SEEN = [backends.generation()]


def _drop_if_stale() -> None:
    """Forget cached tables and answers once a backend was registered, replaced or removed."""
    if _SEEN[0] != backends.generation():
        with _LOCK:
            _TABLES.clear()
            _RESOLVED.clear()
            _SEEN[0] = backends.generation()


def table(backend: str) -> dict[str, Callable]:
    """``op -> function`` of one backend, merged from its ``ops`` family modules (empty when it has none)."""
    _drop_if_stale()
    with _LOCK:
        if backend not in _TABLES:
            merged: dict[str, Callable] = {}
            try:
                package = importlib.import_module(backends.ops_package(backend))
            except ModuleNotFoundError:
                package = None
            for info in pkgutil.iter_modules(package.__path__) if package else []:
                if info.name.startswith("_"):
                    continue
                module = importlib.import_module(f"{package.__name__}.{info.name}")
                for op, fn in getattr(module, "OPS", {}).items():
                    if op in merged:
                        raise RuntimeError(f"kernel op {op!r} is defined twice in backend {backend!r}")
                    merged[op] = fn
            _TABLES[backend] = merged
        return _TABLES[backend]


def implementations(op: str) -> list[str]:
    """Backends that implement ``op``."""
    return [b for b in backends.names() if op in table(b)]


_RESOLVED: dict[tuple[str, str, str], Callable | None] = {}


def _device_type(device) -> str:
    return getattr(device, "type", None) or str(device).partition(":")[0]


def resolve(op: str, backend: str, device) -> Callable:
    """The implementation of ``op`` to run for tensors on ``device``.

    Raises ValueError for unknown backends or backends that lack the op (the message lists those that have it).
    Answers are cached per (op, backend, device type): decode-sized calls take a few microseconds in total.
    """
    _drop_if_stale()
    key = (op, backend, _device_type(device))
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _RESOLVED[key] = _resolve(op, backend, key[2])
    return fn


def resolve_optional(op: str, backend: str, device) -> Callable | None:
    """The backend's own implementation of an optional op (a fusion such as ``fused_decode_layers``), or None.

    Unlike :func:`resolve` nothing else stands in: an optional op replaces a sequence of other ops where a backend
    has a faster form, and the caller runs that sequence when this returns None. Under ``"auto"`` the backend is the
    highest-priority usable one for ``device``'s tensors, whether or not it has the op.
    """
    _drop_if_stale()
    key = ("?" + op, backend, _device_type(device))
    if key in _RESOLVED:
        return _RESOLVED[key]
    if backend == "auto":
        first = backends.by_priority(key[2])
        name = first[0].name if first else ""
    else:
        backends.get(backend)  # unknown names raise here
        name = backend
    fn = table(name).get(op) if name else None
    _RESOLVED[key] = fn
    return fn


def _resolve(op: str, backend: str, device_type: str) -> Callable:
    # Only the tables of the backends asked about are built: `implementations` imports every backend's op modules
    # (triton's import alone is ~0.13 s), which a CPU-only run never needs; it is called only to word an error.
    if backend == "auto":
        for candidate in backends.by_priority(device_type):
            fn = table(candidate.name).get(op)
            if fn is not None:
                return fn
        have = implementations(op)
        if not have:
            raise ValueError(f"no backend implements kernel op {op!r}")
        raise ValueError(f"no usable backend runs kernel op {op!r} on {device_type} tensors; backends that implement "
                         f"it: {have} (`tessera info` says why one is unusable)")
    backends.get(backend)  # unknown names raise here
    fn = table(backend).get(op)
    if fn is None:
        have = implementations(op)
        if not have:
            raise ValueError(f"no backend implements kernel op {op!r}")
        raise ValueError(f"backend {backend!r} does not implement {op!r}; backends that do: {have}")
    return fn
