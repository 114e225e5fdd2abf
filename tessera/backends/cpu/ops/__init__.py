"""Kernel-library ops of the cpu backend: one module per op family, each ending with ``OPS = {name: fn}``."""
