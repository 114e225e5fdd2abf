"""``mlir``: attention lowered through MLIR's upstream dialects and compiled by IREE for this CPU.

Importing this package imports neither IREE nor xDSL; they load when a kernel is first lowered.
"""

from tessera.backends.mlir.backend import MlirBackend

__all__ = ["MlirBackend"]
