"""Fixtures of the attention tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.attention.cases import seed_of


@pytest.fixture(scope="module")
def float_qk():
    """The cpu decode kernel's float Q.K path (``kv_qk=portable``) for a whole module: it de-quantizes K exactly and
    meets the quantized-KV tolerance class's tight rule; the int8 Q.K variants round the query too and have their own
    rule (``test_kv_qk8.py``). Use with ``pytestmark = pytest.mark.usefixtures("float_qk")``."""
    from tessera.backends.cpu import variants

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TESSERA_CPU_VARIANTS", "kv_qk=portable")
        variants.reset()
        yield
    variants.reset()


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id: fresh random inputs per test, reproducible across runs and workers."""
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))


# ---- the triton backend under TRITON_INTERPRET=1 ---------------------------------------------------------------------
# The interpreter runs kernels in Python, ~1 s per conformance case, so it gets a subset that still covers every
# mask and score family, sinks, GQA ratios, paged and ragged layouts, decode and prefill: all variants and shapes in
# float32, low precision on the families where rounding differs, and the generic hypothesis tests replaced by the
# smaller property test in tests/backends/test_triton.py. On a GPU (TESSERA_TEST_GPU=1) everything runs.
_HERE = Path(__file__).resolve().parent
_LOW_PRECISION_VARIANTS = {"causal", "softcap_causal", "alibi_causal", "sinks_causal", "document2d_causal",
                           "custom_dilated", "custom_score_bias", "gpt_oss_like"}


# ---- the mlir backend -------------------------------------------------------------------------------------------
# Each (mask structure, score structure, head dim) compiles one IREE module, ~0.9 s on a 2-core Zen 4, and the whole
# suite draws ~130 of them (~2.5 min cold). It gets every float32 case, the low-precision subset above (bf16 and fp16
# are widened to float32 on the host, so they exercise no other kernel), every variant on the ragged layout only (the
# dense one repeats each at head dim 80; test_shapes covers dense, MQA and head dim 80), and of the property tests
# the oracle match. TESSERA_TEST_MLIR=full runs everything (454 cases, 2.5 min cold on 2 workers, 30 s warm).
_MLIR_PROPERTY_TESTS = {"test_matches_oracle"}


def _mlir_keeps(item: pytest.Item, params: dict) -> bool:
    if os.environ.get("TESSERA_TEST_MLIR", "").lower() == "full":
        return True
    if item.module.__name__.endswith("test_properties"):
        return item.originalname in _MLIR_PROPERTY_TESTS
    layout = params.get("layout")
    if item.originalname == "test_variant" and getattr(layout, "dense", False):
        return False
    return _low_precision_subset(params)


def _interpreted_triton_keeps(item: pytest.Item, params: dict) -> bool:
    if item.get_closest_marker("slow") or item.module.__name__.endswith("test_properties"):
        return False
    return _low_precision_subset(params)


def _low_precision_subset(params: dict) -> bool:
    dtype = params.get("dtype", torch.float32)
    if dtype == torch.float32:
        return True
    variant = params.get("variant")
    if variant is not None:
        return variant.name in _LOW_PRECISION_VARIANTS
    shape = params.get("shape")
    return not isinstance(shape, tuple) or shape[2] >= 257  # low precision on the long decode/prefill shapes only


def _keeps(item: pytest.Item, triton_interpreted: bool) -> bool:
    if Path(str(item.path)).parent != _HERE:  # a conftest hook sees the whole session's items
        return True
    params = getattr(item, "callspec", None)
    params = params.params if params is not None else {}
    if params.get("backend") == "mlir":
        return _mlir_keeps(item, params)
    if params.get("backend") == "triton" and triton_interpreted:
        return _interpreted_triton_keeps(item, params)
    return True


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tessera.backends.triton.configs import interpreting

    triton_interpreted = interpreting()
    keep = [item for item in items if _keeps(item, triton_interpreted)]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[item for item in items if item not in keep])
        items[:] = keep
