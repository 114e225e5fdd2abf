"""Kernel-library ops of the reference backend: one module per op family, each ending with ``OPS = {name: fn}``."""
