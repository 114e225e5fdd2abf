"""The mlir backend's kernel ops: linalg modules from :mod:`tessera.mlir.op_kernels`, compiled by IREE for this CPU.

Each family module ends with ``OPS = {...}`` (:mod:`tessera.kernels.registry`). Ops compute in float32: other
dtypes are widened on the host and results rounded back, so a bfloat16 model pays a widening copy of each weight per
call on this backend.
"""
