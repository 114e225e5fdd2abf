"""Fixtures of the integration tests."""

from __future__ import annotations

import pytest
import torch

from tests.attention.cases import seed_of


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A generator seeded from the test id (reproducible across runs and xdist workers)."""
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))
