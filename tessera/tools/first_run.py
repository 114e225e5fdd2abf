"""A first run that does not wait for the compiler.

A backend whose kernels compile on the machine that runs them (the cpu backend's Numba kernels: minutes on an empty
cache, mostly the fused decode layer) can name a *quick-start* backend that runs the same model at once without
compiling anything (``quick_start_backend``, e.g. the float64 reference), and a directory tied to its compiled kernels
for the current sources on this machine (``warm_marker_dir()``). Then ``tessera generate``, run as the program:

1. asks whether ``tessera warmup`` has completed for this kind of model (:func:`model_kind`) since the kernel sources
   last changed: a marker file in that directory (:func:`is_warm`);
2. if not, starts ``tessera warmup`` for the model in the background (:func:`start_background_warmup`; a lock file
   keeps it to one at a time), and serves this one request on the quick-start backend, saying so;
3. later runs find the marker and run the compiled kernels from the start.

The background warm-up outlives the command that started it, on purpose: it is the compile the first run would
otherwise have waited for, and it writes only the kernel cache and its marker. Its output goes to a log beside the
marker. ``--wait-for-kernels`` (or a backend without these hooks) keeps the compile in the foreground.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: the lock a running background warm-up holds, and its log, inside the backend's marker directory
LOCK_NAME = "warmup.lock"
LOG_NAME = "warmup.log"


def model_kind(model: Any) -> str:
    """What decides which kernels a model compiles: its family, float dtype, and the (format, scale dtype) of every
    packed weight. Two models of one kind share every kernel specialization the warm-up compiles."""
    from tessera.kernels.quant import QuantizedWeight, StackedWeight

    held = [p for w in model.weights.values() for p in (w.parts if isinstance(w, StackedWeight) else (w,))]
    # ggml block formats (Q5_0 ... Q6_K) keep their scales inside the blocks: scales is None
    packed = sorted({f"{w.fmt}/{None if w.scales is None else w.scales.dtype}" for w in held
                     if isinstance(w, QuantizedWeight)})
    config = model.config
    features = (config.family, str(model.dtype), config.norm, config.activation, str(config.qk_norm),
                str(config.post_norms), *packed)
    return hashlib.sha256("|".join(features).encode()).hexdigest()[:16]


def marker_dir(backend: Any) -> Path | None:
    """The backend's marker directory, or None when it compiles nothing or cannot tell where its kernels live."""
    method = getattr(backend, "warm_marker_dir", None)
    return method() if method is not None else None


def is_warm(backend: Any, kind: str) -> bool | None:
    """Whether a warm-up for models of ``kind`` completed with the current kernel sources on this machine; None when
    the backend cannot say (then the caller compiles in the foreground, as before)."""
    directory = marker_dir(backend)
    if directory is None or not getattr(backend, "quick_start_backend", None):
        return None
    return (directory / kind).exists()


def mark_warm(backend: Any, kind: str) -> None:
    """Record that every kernel a model of ``kind`` needs is now compiled (called by ``tessera warmup``)."""
    directory = marker_dir(backend)
    if directory is None:
        return
    try:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / kind).touch()
    except OSError:  # a read-only cache: later runs take the quick-start path again, and are still correct
        pass


def warmup_running(backend: Any) -> bool:
    """Whether a background warm-up holds the lock now."""
    directory = marker_dir(backend)
    if directory is None or not (directory / LOCK_NAME).exists():
        return False
    with open(directory / LOCK_NAME, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                return True
            raise
        fcntl.flock(f, fcntl.LOCK_UN)
    return False


def hold_lock(backend: Any) -> object | None:
    """Take the warm-up lock for this process's life (``tessera warmup --background``); None when another process
    holds it (it is already compiling) or there is no marker directory."""
    directory = marker_dir(backend)
    if directory is None:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    f = open(directory / LOCK_NAME, "a")  # noqa: SIM115 - kept open: the lock lasts as long as the process
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    return f


def start_background_warmup(backend: Any, argv: list[str]) -> tuple[int, Path] | None:
    """Start ``tessera warmup --background ARGV`` detached from this process (its own session, no terminal), logging
    to the marker directory; returns its pid and log path, or None when one is already running or it cannot start."""
    directory = marker_dir(backend)
    if directory is None or warmup_running(backend):
        return None
    directory.mkdir(parents=True, exist_ok=True)
    log = directory / LOG_NAME
    try:
        with open(log, "w") as out:
            child = subprocess.Popen([sys.executable, "-m", "tessera", "warmup", "--background", *argv],
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=dict(os.environ))
    except OSError:
        return None
    return child.pid, log


def warmup_argv(args: Any) -> list[str]:
    """The ``tessera warmup`` arguments naming the same model, dtype, placement and weight flags as ``args``."""
    argv = ["--dtype", args.dtype, "--backend", args.backend]
    if args.model:
        argv += ["--model", str(args.model)]
    if args.device:
        argv += ["--device", str(args.device)]
    if getattr(args, "keep_quantized", False):
        argv.append("--keep-quantized")
    if getattr(args, "dequantize", False):
        argv.append("--dequantize")
    return argv


def effective_backend(name: str, device: Any) -> Any:
    """The backend object that runs a model loaded with ``backend=name`` on ``device``: under ``"auto"`` the
    highest-priority usable backend for the device's type."""
    from tessera.backends import registry

    if name != "auto":
        return registry.get(name)
    found = registry.by_priority(device.type)
    if not found:
        raise ValueError(f"no usable backend runs {device.type} tensors; `tessera info` lists them and why")
    return found[0]
