"""Paged KV cache storage and its page manager."""

from tessera.kv.cache import PagedKVCache

__all__ = ["PagedKVCache"]
