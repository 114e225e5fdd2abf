"""Kernel-library ops of the triton backend: one module per op family, each ending with ``OPS = {name: fn}``."""
