"""Tunables and the hot-path lookup :func:`tuned`.

A :class:`Tunable` is a constant of the code whose best value depends on the machine: a row count up to which one
kernel beats another, a tile size. It declares its default (the constant the code used before it was tunable), the
candidates worth trying and how to time them; ``tessera tune`` (:mod:`tessera.tuning.search`) measures them and
writes the winner to the machine's cache file, and :func:`tuned` hands it to the code.

Lookup order for ``tuned(name, shape_class)``:

1. ``TESSERA_TUNE_<NAME>`` (e.g. ``TESSERA_TUNE_QUANT_GEMV_MAX_M=32``, or per shape class
   ``int4=32,int8=16``): forced, even with tuning off;
2. ``TESSERA_TUNING=off``: the default;
3. the value ``tessera tune`` chose on this machine (cache file);
4. the default.

The environment and the cache file are read on the first lookup of each (name, shape class) and memoized for the
process; :func:`reset` forgets them (tests, or after changing the environment).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from tessera.tuning import cache
from tessera.tuning.fingerprint import digest, fingerprint

#: value types a tunable may have (what JSON and an environment variable can carry unambiguously)
VALUE_TYPES = (bool, int, float, str)
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_OFF = ("off", "0", "false", "no")
_ON = ("", "on", "1", "true", "yes")


@dataclass(frozen=True)
class Crossover:
    """How to time the two code paths a threshold chooses between, at one point ``m`` of the grid.

    The search times both paths at every candidate value ``m`` (interleaved, several rounds) and chooses the
    threshold from where the fast path stops winning; timing the two paths beats timing each threshold, which would
    re-measure the same paths once per candidate.

    Attributes
    ----------
    below : callable ``(m, shape_class) -> seconds``
        One timed call of the path the code takes at or below the threshold (e.g. the packed GEMV for ``m`` rows).
    above : callable ``(m, shape_class) -> seconds``
        One timed call of the other path.
    inclusive : bool
        True if the code takes ``below`` when ``m <= value`` (``if m <= threshold``), False for ``m < value``.
    unit : str
        What ``m`` counts, for tables ("rows", "bytes", "multiply-adds").
    names : (str, str)
        What to call the two paths in reports ("packed GEMV", "BLAS tiles").
    """

    below: Callable[[int, str | None], float]
    above: Callable[[int, str | None], float]
    inclusive: bool = True
    unit: str = "m"
    names: tuple[str, str] = ("below", "above")

    def uses_below(self, m: int, value: int) -> bool:
        """Whether the code takes the ``below`` path at ``m`` with the threshold at ``value``."""
        return m <= value if self.inclusive else m < value


@dataclass(frozen=True)
class Tunable:
    """One tunable constant.

    Parameters
    ----------
    name : str
        Lower-case identifier (``[a-z][a-z0-9_]*``); the environment override is ``TESSERA_TUNE_<NAME>``.
    default : value or mapping shape class -> value
        What the code uses until tuned (the former constant). A mapping gives each shape class its own default.
    candidates : tuple
        Values the search tries (the default is always tried too). For a crossover: the grid of ``m``.
    measure : callable ``(candidate, shape_class) -> seconds``, optional
        One timed run with ``candidate`` in effect. Exactly one of ``measure`` and ``crossover`` is given.
    shape_classes : tuple of str or None
        The classes of shapes that get their own value (``(None,)``: one value for all).
    doc : str
        One or two sentences: what the value decides (shown by ``tessera tune --show``).
    crossover : Crossover, optional
        For a threshold between two code paths: time the paths instead of the thresholds.
    """

    name: str
    default: Any
    candidates: tuple[Any, ...]
    measure: Callable[[Any, str | None], float] | None = None
    shape_classes: tuple[str | None, ...] = (None,)
    doc: str = ""
    crossover: Crossover | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"Tunable name must match {_NAME.pattern}, got {self.name!r}")
        if (self.measure is None) == (self.crossover is None):
            raise ValueError(f"Tunable {self.name!r}: give exactly one of measure= and crossover=")
        if not self.shape_classes or len(set(self.shape_classes)) != len(self.shape_classes):
            raise ValueError(f"Tunable {self.name!r}: shape_classes must be non-empty and unique, "
                             f"got {self.shape_classes!r}")
        object.__setattr__(self, "candidates", tuple(self.candidates))
        if not self.candidates:
            raise ValueError(f"Tunable {self.name!r}: candidates must not be empty")
        if isinstance(self.default, Mapping):
            missing = [c for c in self.shape_classes if c not in self.default]
            if missing:
                raise ValueError(f"Tunable {self.name!r}: the default mapping has no value for shape classes "
                                 f"{missing}")
        kind = self.value_type
        if kind not in VALUE_TYPES:
            raise TypeError(f"Tunable {self.name!r}: values must be one of {[t.__name__ for t in VALUE_TYPES]}, "
                            f"the default is a {kind.__name__}")
        values = [*self.candidates, *(self.default_for(c) for c in self.shape_classes)]
        bad = [v for v in values if type(v) is not kind]
        if bad:
            raise TypeError(f"Tunable {self.name!r}: every candidate and default must be a {kind.__name__} like the "
                            f"default, got {bad!r}")
        if self.crossover is not None and kind is not int:
            raise TypeError(f"Tunable {self.name!r}: a crossover threshold must be an int")

    @property
    def value_type(self) -> type:
        """The type of the tunable's values (the default's)."""
        first = self.default[self.shape_classes[0]] if isinstance(self.default, Mapping) else self.default
        return type(first)

    @property
    def env_var(self) -> str:
        """The environment variable that forces this tunable: ``TESSERA_TUNE_<NAME>``."""
        return f"TESSERA_TUNE_{self.name.upper()}"

    def default_for(self, shape_class: str | None) -> Any:
        """The default value of ``shape_class``; ValueError for a class the tunable does not know."""
        if shape_class not in self.shape_classes:
            raise ValueError(f"tunable {self.name!r} has no shape class {shape_class!r}; it has "
                             f"{list(self.shape_classes)}")
        return self.default[shape_class] if isinstance(self.default, Mapping) else self.default

    def parse(self, text: str, source: str) -> Any:
        """``text`` as a value of this tunable; ValueError naming ``source``, the expected type and the candidates."""
        kind = self.value_type
        stripped = text.strip()
        try:
            if kind is bool:
                if stripped.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value: Any = stripped.lower() in ("true", "1")
            else:
                value = kind(stripped)
        except ValueError:
            raise ValueError(f"{source}={text!r}: expected a {kind.__name__} for tunable {self.name!r} "
                             f"(candidates: {', '.join(map(str, self.candidates))})") from None
        if kind in (int, float) and value <= 0 and all(c > 0 for c in self.candidates):
            raise ValueError(f"{source}={text!r}: tunable {self.name!r} needs a positive {kind.__name__} "
                             f"(candidates: {', '.join(map(str, self.candidates))})")
        return value


_TUNABLES: dict[str, Tunable] = {}
_builtins_loaded = False
_builtins_loading = False
#: guards the registry and the entries; re-entrant because the built-in modules register while it is held
_lock = threading.RLock()
#: (name, shape class) -> the tuned or forced value, or _DEFAULT: the hot path's data structure
_MEMO: dict[tuple[str, str | None], Any] = {}
#: (name, shape class) -> the registered default, for lookups that pass no default of their own
_DEFAULTS: dict[tuple[str, str | None], Any] = {}
#: the cache file's entries (None until the first lookup reads it), plus results recorded in this process
_entries: cache.Entries | None = None


def register(tunable: Tunable, replace: bool = False) -> Tunable:
    """Add ``tunable`` to the registry (``replace=True`` swaps an existing one of the same name) and return it."""
    with _lock:
        if tunable.name in _TUNABLES and not replace and _TUNABLES[tunable.name] is not tunable:
            raise ValueError(f"a tunable named {tunable.name!r} is already registered")
        _TUNABLES[tunable.name] = tunable
        _forget(tunable.name)
    return tunable


def unregister(name: str) -> None:
    """Remove a tunable (tests register toy ones)."""
    with _lock:
        _TUNABLES.pop(name, None)
        _forget(name)


def tunables() -> dict[str, Tunable]:
    """Every registered tunable, built-in ones included, in registration order (the order ``tessera tune`` runs:
    a tunable may rely on those before it, e.g. the crossover of the quantized GEMV times the tiled path with the
    tile size already tuned)."""
    _load_builtins()
    return dict(_TUNABLES)


def get(name: str) -> Tunable:
    """The tunable ``name``; KeyError naming the registered ones if there is none."""
    if name not in _TUNABLES:
        _load_builtins()
    try:
        return _TUNABLES[name]
    except KeyError:
        raise KeyError(f"no tunable named {name!r}; registered: {', '.join(sorted(_TUNABLES)) or 'none'}") from None


def tuned(name: str, shape_class: str | None = None, default: Any = None) -> Any:
    """The value of tunable ``name`` for ``shape_class`` on this machine: forced, tuned or default.

    This is the hot-path lookup (called by kernels on every decode step). After the first call for a given
    ``(name, shape_class)`` it is one dict lookup and an identity test: 0.16-0.25 us per call on this machine (AMD
    EPYC, 2 cores, Python 3.11; best of 9 ``timeit`` runs of 2 x 10^5 calls while a compile job shared the cores; an
    empty Python function call measured 0.05 us then), i.e. ~30 us per decode token at ~120 lookups.
    tests/tuning/test_registry.py holds it under 1 us. It never measures anything: a shape class that was never tuned
    gets the default at once, never a stall; ``tessera tune`` is the only place searches run.

    Parameters
    ----------
    name : str
        A registered tunable (see :func:`tunables`).
    shape_class : str or None
        One of the tunable's shape classes (``None`` for tunables with one value).
    default : optional
        The value to use when nothing is tuned or forced. Call sites pass their module constant, so the constant
        stays the single source of the default (and a test that patches it still takes effect); without it, the
        tunable's registered default applies.

    Raises
    ------
    KeyError
        No tunable ``name`` (on the first lookup).
    ValueError
        An unknown shape class, a malformed ``TESSERA_TUNE_<NAME>`` or ``TESSERA_TUNING`` (on the first lookup).
    """
    try:
        value = _MEMO[name, shape_class]
    except KeyError:
        value = _resolve(name, shape_class)
    if value is _DEFAULT:
        return _DEFAULTS[name, shape_class] if default is None else default
    return value


def _resolve(name: str, shape_class: str | None) -> Any:
    value, source, _ = lookup(name, shape_class)
    if source in ("default", "off"):
        _DEFAULTS[name, shape_class] = value
        value = _DEFAULT
    _MEMO[name, shape_class] = value
    return value


def lookup(name: str, shape_class: str | None = None) -> tuple[Any, str, dict[str, Any] | None]:
    """``(value, source, cache entry or None)`` without memoizing; ``source`` is ``"forced"``, ``"off"``,
    ``"tuned"`` or ``"default"`` (what ``tessera tune --show`` and ``tessera info`` report)."""
    tunable = get(name)
    default = tunable.default_for(shape_class)
    forced = _forced(tunable, shape_class)
    if forced is not None:
        return forced, "forced", None
    if not tuning_enabled():
        return default, "off", None
    entry = entries().get(name, {}).get(cache.class_key(shape_class))
    if entry is None:
        return default, "default", None
    chosen = entry.get("chosen")
    if type(chosen) is not tunable.value_type:
        warnings.warn(f"ignoring the tuning cache entry {name}[{cache.class_key(shape_class)}] in {current_path()}: "
                      f"its value {chosen!r} is not a {tunable.value_type.__name__}; the default {default!r} "
                      "applies", RuntimeWarning, stacklevel=4)
        return default, "default", None
    return chosen, "tuned", entry


def tuning_enabled() -> bool:
    """False when ``TESSERA_TUNING`` is ``off`` (or ``0``/``false``/``no``): lookups then return defaults."""
    raw = os.environ.get("TESSERA_TUNING", "")
    if raw.strip().lower() in _OFF:
        return False
    if raw.strip().lower() in _ON:
        return True
    raise ValueError(f"TESSERA_TUNING={raw!r}: expected 'off' (defaults everywhere) or 'on' (the default: use "
                     "this machine's tuned values)")


def _forced(tunable: Tunable, shape_class: str | None) -> Any:
    """The value ``TESSERA_TUNE_<NAME>`` forces for ``shape_class``, or None.

    ``"32"`` forces every shape class; ``"int4=32,int8=16"`` forces the named classes only (``*`` for ``None``).
    """
    raw = os.environ.get(tunable.env_var)
    if raw is None or not raw.strip():
        return None
    if "=" not in raw:
        return tunable.parse(raw, tunable.env_var)
    known = {cache.class_key(c) for c in tunable.shape_classes}
    for part in raw.split(","):
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or key not in known:
            raise ValueError(f"{tunable.env_var}={raw!r}: expected VALUE or CLASS=VALUE[,CLASS=VALUE...] with "
                             f"CLASS one of {sorted(known)}; got {part.strip()!r}")
        if key == cache.class_key(shape_class):
            return tunable.parse(text, f"{tunable.env_var} ({key})")
    return None


def current_path() -> Path:
    """This machine's cache file (it may not exist yet)."""
    return cache.cache_path(digest())


def entries() -> cache.Entries:
    """This machine's cached entries (read on first use, warnings included), plus those recorded in this process."""
    global _entries
    if _entries is None:
        _entries = cache.load(current_path(), fingerprint())
    return _entries


def record(name: str, shape_class: str | None, entry: dict[str, Any]) -> None:
    """Make ``entry`` (a search result, see :mod:`tessera.tuning.search`) this process's cached value for
    ``(name, shape_class)``; the next lookup returns its ``chosen``. Writing the file is the caller's job."""
    with _lock:
        entries().setdefault(name, {})[cache.class_key(shape_class)] = entry
        _forget(name)


def reset() -> None:
    """Forget memoized lookups and the cached entries: the next lookup re-reads the environment and the file."""
    global _entries
    with _lock:
        _MEMO.clear()
        _DEFAULTS.clear()
        _entries = None


@contextlib.contextmanager
def overriding(name: str, value: Any, shape_class: Any = ...) -> Iterator[None]:
    """Make ``tuned(name, ...)`` return ``value`` inside the block (for one shape class, or all by default).

    Measurements use it to run the code with a candidate in effect; it is not thread-safe against lookups of the
    same name on other threads (they may see the candidate).
    """
    tunable = get(name)
    classes = tunable.shape_classes if shape_class is ... else (shape_class,)
    saved = {c: _MEMO.get((name, c), _MISSING) for c in classes}
    for c in classes:
        _MEMO[name, c] = value
    try:
        yield
    finally:
        for c, old in saved.items():
            if old is _MISSING:
                _MEMO.pop((name, c), None)
            else:
                _MEMO[name, c] = old


class _Sentinel:
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"


_MISSING = _Sentinel("missing")
#: memoized for a (name, shape class) that is neither tuned nor forced: the caller's default applies
_DEFAULT = _Sentinel("default")


def _forget(name: str) -> None:
    for key in [k for k in _MEMO if k[0] == name]:
        del _MEMO[key]


def tunable_modules() -> list[ModuleType]:
    """Each usable backend's tunables module (``Backend.tunables_module``: it registers the backend's tunables on
    import and may offer ``release_inputs()``), imported."""
    from tessera.backends import registry as backends  # loaded at the first lookup: kernels call tuned() early

    names = [getattr(b, "tunables_module", None) for b in backends.registered().values() if not b.available()]
    return [importlib.import_module(name) for name in names if name]


def _load_builtins() -> None:
    """Import the backends' :func:`tunable_modules` once, so a kernel module can call ``tuned`` without importing
    the (heavier) module that declares its measurements. Another thread's first lookup waits for the imports to
    finish; a lookup made by the importing thread itself (while the modules register) returns at once."""
    global _builtins_loaded, _builtins_loading
    if _builtins_loaded:
        return
    with _lock:
        if _builtins_loaded or _builtins_loading:
            return
        _builtins_loading = True
        try:
            tunable_modules()
            _builtins_loaded = True
        finally:
            _builtins_loading = False
