"""Which backend implements which kernel op, and how a call picks one.

Each backend folder has an ``ops`` package with one module per op family; every module ends with
``OPS = {"op_name": function}``. Nothing is imported until an op is first called (then the backend's family modules
are imported and their tables merged), so ``import tessera.kernels`` stays cheap and a new accelerator adds its
kernels by adding one folder (no edit here). Public functions in ``tessera.kernels`` validate their arguments,
then call ``resolve(op, backend, device)`` and run what it returns.

Selection under ``backend="auto"``: CUDA tensors go to ``triton`` when it is usable, CPU tensors to ``cpu``, and any
device to ``reference`` when nothing else implements the op. The reference functions compute in float64 and return
the API's output dtype; their ``*_f64`` twins (tests' oracle) return float64.
"""

from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Callable

BACKENDS = ("reference", "cpu", "triton")
_TABLES: dict[str, dict[str, Callable]] = {}
_LOCK = threading.Lock()


def table(backend: str) -> dict[str, Callable]:
    """``op -> function`` of one backend, merged from its ``ops`` family modules (empty when it has none)."""
    with _LOCK:
        if backend not in _TABLES:
            merged: dict[str, Callable] = {}
            try:
                package = importlib.import_module(f"tessera.backends.{backend}.ops")
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
    return [b for b in BACKENDS if op in table(b)]


def _load(op: str, backend: str) -> Callable:
    return table(backend)[op]


def _triton_usable() -> bool:
    from tessera.backends import registered

    return not registered()["triton"].available()


_RESOLVED: dict[tuple[str, str, str], Callable] = {}


def resolve(op: str, backend: str, device) -> Callable:
    """The implementation of ``op`` to run for tensors on ``device``.

    Raises ValueError for unknown backends or backends that lack the op (the message lists those that have it).
    Answers are cached per (op, backend, device type): decode-sized calls take a few microseconds in total.
    """
    key = (op, backend, getattr(device, "type", str(device)))
    fn = _RESOLVED.get(key)
    if fn is None:
        fn = _RESOLVED[key] = _resolve(op, backend, device)
    return fn


def resolve_optional(op: str, backend: str, device) -> Callable | None:
    """The backend's own implementation of an optional op (a fusion such as ``fused_decode_layers``), or None.

    Unlike :func:`resolve` there is no fallback to ``reference``: an optional op replaces a sequence of other ops
    where a backend has a faster form, and the caller runs that sequence when this returns None. Under ``"auto"`` the
    backend is the one :func:`resolve` would pick for ``device``'s tensors (``cpu`` for CPU tensors, ``triton`` for
    CUDA ones when usable).
    """
    key = ("?" + op, backend, getattr(device, "type", str(device)))
    if key in _RESOLVED:
        return _RESOLVED[key]
    name = backend
    if backend == "auto":
        device_type = getattr(device, "type", str(device))
        name = {"cpu": "cpu", "cuda": "triton" if _triton_usable() else ""}.get(device_type, "")
    elif backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)} or 'auto'")
    fn = table(name).get(op) if name else None
    _RESOLVED[key] = fn
    return fn


def _resolve(op: str, backend: str, device) -> Callable:
    have = implementations(op)
    if not have:
        raise ValueError(f"no backend implements kernel op {op!r}")
    if backend == "auto":
        device_type = getattr(device, "type", str(device))
        if device_type == "cuda" and "triton" in have and _triton_usable():
            return _load(op, "triton")
        if device_type == "cpu" and "cpu" in have:
            return _load(op, "cpu")
        return _load(op, "reference")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {list(BACKENDS)} or 'auto'")
    if backend not in have:
        raise ValueError(f"backend {backend!r} does not implement {op!r}; backends that do: {have}")
    return _load(op, backend)
