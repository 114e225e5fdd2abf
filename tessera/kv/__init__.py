"""Paged KV cache storage (torch) and its page manager (plain Python).

``BlockManager`` imports without torch, so a scheduler built on it stays torch-free; ``PagedKVCache`` loads torch
only when first accessed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessera.kv.block_manager import AllocationResult, BlockManager, OutOfPagesError

if TYPE_CHECKING:
    from tessera.kv.cache import PagedKVCache

__all__ = ["AllocationResult", "BlockManager", "OutOfPagesError", "PagedKVCache"]


def __getattr__(name: str) -> Any:
    if name == "PagedKVCache":
        from tessera.kv.cache import PagedKVCache

        return PagedKVCache
    raise AttributeError(f"module 'tessera.kv' has no attribute {name!r}")
