"""Session-wide test setup."""

from __future__ import annotations

import os
import sys

# `make test` runs two xdist workers on two cores. torch's and Numba's OpenMP pools busy-wait after each parallel
# region by default, and two processes doing so starve each other (the attention tests run ~8x slower). Passive
# waiting must be chosen before the OpenMP runtime loads, i.e. before torch is imported.
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "0")  # not tessera's bounded spin: two test workers share the cores
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # the same for OpenBLAS's threads (tessera/__init__.py)

# Kernel thresholds take their defaults, whatever `tessera tune` cached on this machine: tests that pick a code path
# by patching a module constant stay deterministic (tests/tuning sets its own environment).
os.environ.setdefault("TESSERA_TUNING", "off")

# Without a GPU, the triton backend's kernels run on CPU tensors through Triton's interpreter, so the conformance
# suite covers them everywhere (tests/attention/conftest.py picks the subset that fits the CI budget). Triton reads
# the switch when kernels are decorated, i.e. on the backend's first use, which comes after this line.
if os.environ.get("TESSERA_TEST_GPU", "0") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tessera.backends import registered  # noqa: E402

# Load the built-in backends before any test module imports one backend's module directly, so that every
# registered backend is visible to the parametrizations (tests/backends/test_registry.py checks the import orders
# separately, in fresh interpreters).
registered()
