"""Session-wide test setup."""

from __future__ import annotations

import os
import sys

# `make test` runs two xdist workers on two cores. torch's and Numba's OpenMP pools busy-wait after each parallel
# region by default, and two processes doing so starve each other (the attention tests run ~8x slower). Passive
# waiting must be chosen before the OpenMP runtime loads, i.e. before torch is imported.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tessera.backends import registered  # noqa: E402

# Load the built-in backends before any test module imports one backend's module directly, so that every
# registered backend is visible to the parametrizations (tests/backends/test_registry.py checks the import orders
# separately, in fresh interpreters).
registered()
