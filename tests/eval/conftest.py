"""Fixtures of the perplexity tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """``(directory, Tessera model, transformers model)`` of the tiny random Llama of :mod:`tests.eval.tiny`."""
    pytest.importorskip("transformers")
    from tests.eval.tiny import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
