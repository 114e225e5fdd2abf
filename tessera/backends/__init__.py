"""Hardware backends. Each folder implements the same op set and passes the same conformance suite."""

from tessera.backends.base import AttentionRequest, Backend, BackendUnavailableError, RaggedBatch
from tessera.backends.registry import register, registered, resolve_device, select, unregister

__all__ = ["AttentionRequest", "Backend", "BackendUnavailableError", "RaggedBatch", "register", "registered",
           "resolve_device", "select", "unregister"]
