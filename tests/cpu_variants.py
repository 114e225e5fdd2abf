"""Test helpers for the cpu backend's kernel variants (``tessera.backends.cpu.variants``)."""

from __future__ import annotations

import pytest

from tessera.backends.cpu import variants
from tessera.hw import isa


def skip_unless_runs(family: str, name: str) -> None:
    """Skip the calling test unless this CPU executes ``family``'s variant ``name``."""
    lacking = isa.missing(next(v for v in variants.FAMILIES[family].variants if v.name == name).requires)
    if lacking:
        pytest.skip(f"this CPU lacks {lacking} for {family}={name}")
