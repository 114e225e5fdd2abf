"""Which backends exist, loaded lazily by name, and how a request or a model picks one.

A backend is a class in its own folder under ``tessera/backends/`` (or in any importable package); this registry
knows it only as a ``"module:Class"`` string, so backend modules never import the registry and nothing is imported
before a backend is first asked for. Adding a backend is its folder plus one line in :data:`BUILT_IN`; a backend
outside this tree calls :func:`register` or ships an entry point in the ``tessera.backends`` group
(``name = "package.module:Class"``).

Its kernel ops live in the ``ops`` package beside the module that defines the class (``backend.ops_package`` when
the class names another): :mod:`tessera.kernels.registry` reads them from there.
"""

from __future__ import annotations

import importlib
import threading
from importlib import metadata

import torch

from tessera.backends.base import AttentionRequest, Backend, BackendUnavailableError

#: name -> "module:Class" of the backends that ship with Tessera
BUILT_IN: dict[str, str] = {
    "reference": "tessera.backends.reference.attention:ReferenceBackend",
    "cpu": "tessera.backends.cpu.backend:CpuBackend",
    "triton": "tessera.backends.triton.backend:TritonBackend",
    "mlir": "tessera.backends.mlir.backend:MlirBackend",
}
ENTRY_POINT_GROUP = "tessera.backends"

_ADDED: dict[str, str | Backend] = {}
_LOADED: dict[str, Backend] = {}
_LOCK = threading.RLock()
#: bumped by every register / unregister, so caches keyed by backend name (the kernel op tables) know to drop
_GENERATION = 0


def register(name: str, target: str | Backend, *, replace: bool = False) -> None:
    """Make a backend known under ``name``: a ``"module:Class"`` string (imported on first use) or an instance.

    Raises ValueError when ``name`` is taken (pass ``replace=True`` to swap it, e.g. in a test) or ``target`` is
    neither form.
    """
    if not isinstance(name, str) or not name or name == "auto":
        raise ValueError(f"register: a backend name must be a non-empty str other than 'auto', got {name!r}")
    if isinstance(target, str) and ":" not in target:
        raise ValueError(f"register: {target!r} is not 'module:Class'")
    with _LOCK:
        if name in _known() and not replace:
            raise ValueError(f"register: backend {name!r} already exists; pass replace=True to swap it")
        _ADDED[name] = target
        _LOADED.pop(name, None)
        _bump()


def unregister(name: str) -> None:
    """Forget a backend added with :func:`register` (built-ins stay)."""
    with _LOCK:
        _ADDED.pop(name, None)
        _LOADED.pop(name, None)
        _bump()


def generation() -> int:
    """A counter that changes whenever the set of backends changes (:func:`register`, :func:`unregister`)."""
    return _GENERATION


def _bump() -> None:
    global _GENERATION
    _GENERATION += 1


def names() -> list[str]:
    """Every known backend name, without importing any backend."""
    return sorted(_known())


def get(name: str) -> Backend:
    """The backend called ``name`` (imported and instantiated once)."""
    with _LOCK:
        if name not in _LOADED:
            known = _known()
            if name not in known:
                raise ValueError(f"unknown backend {name!r}; choose one of {sorted(known)} or 'auto'")
            target = known[name]
            _LOADED[name] = _instantiate(name, target) if isinstance(target, str) else target
        return _LOADED[name]


def registered() -> dict[str, Backend]:
    """All backends by name (each imported on first use)."""
    return {name: get(name) for name in names()}


def device_types(backend: Backend) -> tuple[str, ...]:
    """The torch device types ``backend`` runs on (``("cpu",)`` when it does not say)."""
    method = getattr(backend, "device_types", None)
    return tuple(method()) if method is not None else ("cpu",)


def ops_package(name: str) -> str:
    """The module path of ``name``'s kernel op package."""
    backend = get(name)
    return getattr(backend, "ops_package", None) or type(backend).__module__.rpartition(".")[0] + ".ops"


def by_priority(device_type: str | None = None) -> list[Backend]:
    """Usable backends, highest priority first; only those running ``device_type`` tensors when it is given."""
    found = [b for b in registered().values() if not b.available()
             and (device_type is None or device_type in device_types(b))]
    return sorted(found, key=lambda b: -b.priority)


def select(request: AttentionRequest, name: str = "auto") -> Backend:
    """The backend named ``name``, or under ``"auto"`` the highest-priority backend that can serve ``request``."""
    if name != "auto":
        backend = get(name)
        reasons = backend.available() + backend.why_not(request)
        if reasons:
            raise BackendUnavailableError(f"backend {name!r} cannot run {request.spec!r}: " + "; ".join(reasons))
        return backend
    refusals: list[str] = []
    for backend in sorted(registered().values(), key=lambda b: -b.priority):
        reasons = backend.available() + backend.why_not(request)
        if not reasons:
            return backend
        refusals.append(f"  {backend.name}: " + "; ".join(reasons))
    raise BackendUnavailableError(
        f"no backend can run {request.spec!r} on {request.device} with {request.dtype}:\n" + "\n".join(refusals)
    )


def parse_device(device: str | torch.device, owner: str = "") -> torch.device:
    """``device`` as a ``torch.device``; ValueError naming ``owner`` (the API that took it) when torch cannot parse
    it."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        where = f"{owner}: " if owner else ""
        raise ValueError(f"{where}device must be a torch device such as 'cpu' or 'cuda:0', got {device!r} "
                         f"({err})") from None


def resolve_device(backend: str, device: str | torch.device | None = None) -> torch.device:
    """The device a model, its KV cache and every tensor the engine allocates live on.

    Parameters
    ----------
    backend : a registered backend's name, or ``"auto"`` (ops and attention then follow the tensors' device).
    device : None for the backend's default (its first :meth:`Backend.device_types`; ``"cpu"`` under ``"auto"``), or
        a device the backend runs on (``"cuda"``, ``"cuda:1"``, ``torch.device("cpu")``).

    Raises
    ------
    ValueError : an unknown backend, an unparsable device, or a device the backend does not run on.
    RuntimeError : a CUDA device on a machine where ``torch.cuda.is_available()`` is False.
    """
    types = () if backend == "auto" else device_types(get(backend))
    resolved = parse_device(types[0] if device is None and types else "cpu" if device is None else device)
    if types and resolved.type not in types:
        raise ValueError(f"backend {backend!r} runs on {' or '.join(types)} tensors, got device {str(resolved)!r}; "
                         f"pass device={types[0]!r}, or backend='auto' to let each op follow the tensors' device")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"device {str(resolved)!r} was asked for but torch.cuda.is_available() is False on this "
                           "machine; install a CUDA build of torch or use device='cpu'")
    return resolved


def _known() -> dict[str, str | Backend]:
    return {**BUILT_IN, **_entry_points(), **_ADDED}


_ENTRY_POINTS: dict[str, str] | None = None


def _entry_points() -> dict[str, str]:
    global _ENTRY_POINTS
    if _ENTRY_POINTS is None:
        _ENTRY_POINTS = {ep.name: ep.value for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)}
    return _ENTRY_POINTS


def _instantiate(name: str, target: str) -> Backend:
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as err:
        raise ImportError(f"backend {name!r}: cannot load {target!r} ({type(err).__name__}: {err})") from err
    backend = cls()
    if getattr(backend, "name", None) != name:
        raise ValueError(f"backend {target!r} is registered as {name!r} but calls itself {backend.name!r}")
    return backend
