"""Tessera's MLIR path: attention specs lowered to MLIR's upstream dialects and compiled by IREE.

- :mod:`tessera.mlir.trace`: masks and score functions as ``arith``/``math``/``vector`` ops (traced or translated).
- :mod:`tessera.mlir.attention_kernel`: a spec as a FlashAttention-style ``scf``/``vector`` loop in one IREE
  dispatch, over the kv tiles the plan keeps (the llvm-cpu kernel).
- :mod:`tessera.mlir.attention_linalg`: the same spec as linalg ops on tensors, the form IREE's GPU pipelines (cuda,
  rocm, vulkan-spirv) accept; :mod:`tessera.backends.mlir.targets` picks the lowering per target.
- :mod:`tessera.mlir.iree_compile`: IREE compilation for llvm-cpu (run here) and GPU targets (compile-only), with
  in-memory and on-disk caches.
- :mod:`tessera.mlir.op_kernels`: the kernel library's ops as dynamic-shape linalg modules.
- :mod:`tessera.mlir.dialect`, :mod:`~tessera.mlir.capture`, :mod:`~tessera.mlir.passes`, :mod:`~tessera.mlir.dump`:
  the ``tessera`` dialect (xDSL), decoder capture, fusion and annotation passes and ``tessera mlir dump``.
- :mod:`tessera.mlir.schedule`: block-sparse schedules (the kv tiles each q tile visits), shared by the planner and
  the ``block-sparse-schedule`` pass.
- :mod:`tessera.mlir.lower_graph`: a captured layer as one IREE module.

The ``mlir`` backend (:mod:`tessera.backends.mlir`) runs these kernels. Nothing here imports IREE until a module is
compiled.
"""
