"""Model families: each module defines ``FAMILY`` (its HF model types, config reader and weight names).

Adding a family is adding a module here; ``by_model_type`` finds it.
"""

from __future__ import annotations

import importlib
import pkgutil

from tessera.models.families.common import Family


def all_families() -> dict[str, Family]:
    """Family name -> Family, from every module of this package that defines ``FAMILY``."""
    out = {}
    for info in pkgutil.iter_modules(__path__):
        module = importlib.import_module(f"{__name__}.{info.name}")
        family = getattr(module, "FAMILY", None)
        if family is not None:
            out[family.name] = family
    return out


def by_model_type(model_type: str) -> Family:
    """The family that reads HF ``model_type``; ValueError listing the supported ones otherwise."""
    families = all_families()
    for family in families.values():
        if model_type in family.hf_model_types:
            return family
    supported = sorted(t for f in families.values() for t in f.hf_model_types)
    raise ValueError(f"unknown architecture (model_type {model_type!r}); supported: {supported}")
