"""How much of a run went to getting kernels ready: compiling them, or loading them from Numba's on-disk cache.

The cpu backend's kernels compile on first use (tens of seconds each on a cold cache) and later load from the
cache (milliseconds each). Both happen inside the first call that needs the kernel, so a tokens/s figure that
includes that call measures the compiler, not the kernel. :func:`kernel_clock` listens to Numba's events and records
every top-level span Numba held its compiler lock (a cache load or a compile, with whatever it compiled for itself)
and, separately, every top-level compile; a caller subtracts :meth:`KernelClock.seconds` over its own time window
from the wall time it reports, and shows :meth:`KernelClock.compile_seconds` as compile time.

>>> with kernel_clock(on_compile=lambda name: print("compiling", name)) as clock:
...     llm.generate(["Hello"])
>>> clock.compile_seconds(), clock.seconds()
(0.0, 0.21)
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache

_LOCK_EVENT, _COMPILE_EVENT = "numba:compiler_lock", "numba:compile"


@dataclass(frozen=True)
class Span:
    """One top-level stretch of Numba work: ``name`` is the compiled function's name, or "" for a cache load or
    other work under the compiler lock."""

    start: float
    end: float
    name: str = ""


@dataclass
class KernelClock:
    """Spans of kernel preparation seen while the clock was installed (``time.perf_counter`` seconds)."""

    locked: list[Span] = field(default_factory=list)
    compiled: list[Span] = field(default_factory=list)
    on_compile: Callable[[str], None] | None = None
    on_compiled: Callable[[Span], None] | None = None

    def seconds(self, start: float = -math.inf, end: float = math.inf) -> float:
        """Seconds within ``[start, end]`` spent compiling or loading kernels."""
        return _overlap(self.locked, start, end)

    def compile_seconds(self, start: float = -math.inf, end: float = math.inf) -> float:
        """Seconds within ``[start, end]`` spent compiling (cache misses only)."""
        return _overlap(self.compiled, start, end)

    def compile_count(self) -> int:
        return len(self.compiled)


def _overlap(spans: list[Span], start: float, end: float) -> float:
    return sum(max(0.0, min(s.end, end) - max(s.start, start)) for s in spans)


@lru_cache(maxsize=1)
def _listener_class() -> type:
    """A Numba event listener keeping per-thread nesting depth, so only outermost events become spans (built on
    first use: Numba's ``register`` wants a subclass of its ``Listener``, and importing Numba costs ~0.3 s)."""
    from numba.core import event

    class _Listener(event.Listener):
        def __init__(self, clock: KernelClock, kind: str) -> None:
            self.clock, self.kind = clock, kind
            self.local = threading.local()

        def _stack(self) -> list[float]:
            return self.local.__dict__.setdefault("stack", [])

        def on_start(self, ev) -> None:
            stack = self._stack()
            stack.append(time.perf_counter())
            if len(stack) == 1 and self.kind == _COMPILE_EVENT and self.clock.on_compile is not None:
                self.clock.on_compile(_name(ev))

        def on_end(self, ev) -> None:
            stack = self._stack()
            if not stack:  # installed while an event was open: its start was not seen
                return
            start = stack.pop()
            if stack:
                return
            if self.kind == _LOCK_EVENT:
                self.clock.locked.append(Span(start, time.perf_counter()))
                return
            span = Span(start, time.perf_counter(), _name(ev))
            self.clock.compiled.append(span)
            if self.clock.on_compiled is not None:
                self.clock.on_compiled(span)

    return _Listener


def _name(event) -> str:
    dispatcher = (event.data or {}).get("dispatcher")
    func = getattr(dispatcher, "py_func", None)
    return getattr(func, "__qualname__", None) or getattr(dispatcher, "__qualname__", None) or str(dispatcher)


@contextmanager
def kernel_clock(on_compile: Callable[[str], None] | None = None,
                 on_compiled: Callable[[Span], None] | None = None) -> Iterator[KernelClock]:
    """Record kernel preparation while the block runs.

    Parameters
    ----------
    on_compile : called with a function's name when a top-level compile starts (e.g. to show a progress line).
    on_compiled : called with its :class:`Span` when it ends.
    """
    from numba.core import event

    clock = KernelClock(on_compile=on_compile, on_compiled=on_compiled)
    listeners = [(kind, _listener_class()(clock, kind)) for kind in (_LOCK_EVENT, _COMPILE_EVENT)]
    for kind, listener in listeners:
        event.register(kind, listener)
    try:
        yield clock
    finally:
        for kind, listener in listeners:
            event.unregister(kind, listener)
