"""Compiling MLIR text with IREE, caching the binaries, and calling them through IREE's runtime.

A module compiles once per (text, IREE version, target): binaries are kept in memory and on disk under
``$TESSERA_CACHE_DIR/mlir`` (default ``~/.cache/tessera/mlir``), keyed by a hash of all three, so a new process, or
a new sequence length, never recompiles. The llvm-cpu target is this machine's CPU (``--iree-llvmcpu-target-cpu=host``)
and the key holds LLVM's name and features of that CPU, because the machines that share a home directory may differ.

Other targets (:data:`TARGETS`) compile the same text without running it: that is how the lowering is checked to reach
GPUs (cuda, rocm) and Vulkan from a machine that has none of them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tessera._atomic import exclusive, write_bytes_atomic

#: target name -> iree-compile flags (llvm-cpu runs here; the others are compile-only checks)
TARGETS: dict[str, tuple[str, ...]] = {
    "llvm-cpu": ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                 "--iree-llvmcpu-target-cpu=host"),
    # IREE 3.13's pip compiler answers sm_90 / sm_90a with "missing GPU target in #hal.executable.target" even for a
    # plain linalg module; sm_80 (Ampere) compiles, and the same PTX runs on Hopper.
    "cuda": ("--iree-hal-target-device=cuda", "--iree-cuda-target=sm_80"),
    "rocm": ("--iree-hal-target-device=hip", "--iree-rocm-target=gfx942"),
    "vulkan-spirv": ("--iree-hal-target-device=vulkan", "--iree-vulkan-target=rdna3"),
}
#: the kernels keep whole score tiles and accumulators in vectors on purpose; IREE's default guard against large
#: vectors (meant for its own tiling) would reject them
_CPU_EXTRA = ("--iree-llvmcpu-fail-on-large-vector=false",)


class CompileError(RuntimeError):
    """IREE rejected a module; the message holds its diagnostics and where the text was saved."""


def missing() -> list[str]:
    """Reasons the IREE compiler or runtime cannot be used here (empty when both import)."""
    reasons = []
    for module, package in (("iree.compiler", "iree-base-compiler"), ("iree.runtime", "iree-base-runtime")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            reasons.append(f"{module} is not installed (pip install {package}; pinned in pyproject.toml)")
    return reasons


def cache_dir() -> Path:
    root = os.environ.get("TESSERA_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tessera")
    return Path(root) / "mlir"


@functools.cache
def _compiler_version() -> str:
    from importlib import metadata

    return metadata.version("iree-base-compiler")


@functools.cache
def _host_key() -> str:
    from tessera.hw.isa import host_cpu_name, host_features

    return host_cpu_name() + ":" + ",".join(sorted(host_features()))


@dataclass
class CompileStats:
    """What compiling cost this process: compiles run, seconds spent, and cache hits (memory and disk)."""

    compiles: int = 0
    seconds: float = 0.0
    memory_hits: int = 0
    disk_hits: int = 0


STATS = CompileStats()
_LOCK = threading.Lock()
_BINARIES: dict[str, bytes] = {}


def compile_module(text: str, target: str = "llvm-cpu") -> bytes:
    """The IREE binary (a ``.vmfb``) of ``text`` for ``target``, from the caches when it was compiled before."""
    if target not in TARGETS:
        raise ValueError(f"unknown IREE target {target!r}; choose one of {sorted(TARGETS)}")
    flags = TARGETS[target] + (_CPU_EXTRA if target == "llvm-cpu" else ())
    host = _host_key() if target == "llvm-cpu" else ""
    key = hashlib.sha256("\0".join([text, _compiler_version(), target, host, *flags]).encode()).hexdigest()[:24]
    with _LOCK:
        if key in _BINARIES:
            STATS.memory_hits += 1
            return _BINARIES[key]
    path = cache_dir() / f"{target}-{key}.vmfb"
    with exclusive(path):  # concurrent processes (test workers) compile a module once
        if path.exists():
            binary = path.read_bytes()
            STATS.disk_hits += 1
        else:
            binary = _run_compiler(text, flags, path)
            write_bytes_atomic(path, binary)
    with _LOCK:
        _BINARIES[key] = binary
    return binary


def _run_compiler(text: str, flags: tuple[str, ...], path: Path) -> bytes:
    from iree.compiler import CompilerToolError, compile_str

    start = time.perf_counter()
    try:
        binary = compile_str(text, extra_args=list(flags))
    except CompilerToolError as err:
        saved = path.with_suffix(".failed.mlir")
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(text)
        raise CompileError(f"IREE could not compile the lowered module (text saved to {saved}):\n{err}") from None
    STATS.compiles += 1
    STATS.seconds += time.perf_counter() - start
    return binary


@functools.cache
def _runtime_config():
    import iree.runtime as rt

    # One task system per process: IREE's workers are its threads, one per core unless IREE is told otherwise.
    return rt.Config("local-task")


_FUNCTIONS: dict[tuple[str, str], Callable] = {}  # (binary digest, entry): texts that compile alike share one
_BY_TEXT: dict[tuple[str, str], Callable] = {}


def load_function(text: str, entry: str) -> Callable:
    """The compiled function ``entry`` of ``text`` on this CPU, callable with NumPy arrays (results stay as IREE
    device arrays: call ``.to_host()``)."""
    with _LOCK:  # the per-call path: a dict hit on the text itself (str caches its hash), no sha256 of text or binary
        fn = _BY_TEXT.get((text, entry))
    if fn is not None:
        return fn
    binary = compile_module(text)
    key = (hashlib.sha256(binary).hexdigest(), entry)
    with _LOCK:
        if key in _FUNCTIONS:
            _BY_TEXT[(text, entry)] = _FUNCTIONS[key]
            return _FUNCTIONS[key]
    import iree.runtime as rt

    config = _runtime_config()
    context = rt.SystemContext(config=config)
    context.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, binary))
    fn = context.modules.module[entry]
    with _LOCK:
        _FUNCTIONS[key] = fn
        _BY_TEXT[(text, entry)] = fn
    return fn


#: IREE's CPU device reads imported host memory in place; its buffers want this alignment
_ALIGN = 64


def as_device(tensor):
    """A CPU torch tensor as an IREE buffer view over the *same* memory (DLPack, no copy).

    Passing NumPy arrays instead makes IREE copy every input into its own buffers on each call, about 90 ms for the
    134 MB of keys and values of a 8 x 2048-token decode batch on a 2-core Zen 4, against 15 ms for the kernel itself.
    The tensor must stay alive and unchanged until the call's results are read.
    """
    from torch.utils import dlpack

    if tensor.numel() == 0:  # IREE's import of a zero-byte buffer crashes the process; refuse it with a reason
        raise ValueError(f"as_device: an empty tensor of shape {tuple(tensor.shape)} cannot be passed to IREE; "
                         "skip the call (its result is empty or zeros)")
    tensor = tensor.contiguous()
    if tensor.data_ptr() % _ALIGN:
        tensor = tensor.clone()
    return _runtime_config().device.from_dlpack_capsule(dlpack.to_dlpack(tensor))
