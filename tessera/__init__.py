"""Tessera: declarative attention kernels and LLM bring-up."""
__version__ = "0.1.0"
