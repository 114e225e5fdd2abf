"""The command-line flags that choose how a GGUF file's quantized weights are held, shared by every subcommand that
loads a model."""

from __future__ import annotations

import argparse

from tessera.kv.formats import KV_CACHE_DTYPES


def add_weight_flags(p: argparse.ArgumentParser) -> None:
    """``--keep-quantized`` / ``--dequantize`` (mutually exclusive); neither: packed where the type allows."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--keep-quantized", action="store_true",
                       help="GGUF: every quantized projection must stay packed (an error for types that cannot); "
                            "by default Q4_0/Q4_1/Q8_0/Q5_0/Q5_1/Q4_K/Q5_K/Q6_K stay packed and other types "
                            "are de-quantized")
    group.add_argument("--dequantize", action="store_true",
                       help="GGUF: de-quantize every weight to --dtype (transformers' numerics, slower decode)")


def keep_quantized(args: argparse.Namespace) -> bool | None:
    """The ``keep_quantized`` argument of :func:`tessera.models.load_model` the flags ask for."""
    if args.keep_quantized:
        return True
    return False if args.dequantize else None


def add_kv_cache_flag(p: argparse.ArgumentParser) -> None:
    """``--kv-cache-dtype``: the engine's ``kv_cache_dtype`` (default: K/V pages in the model's dtype)."""
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="quantize K/V pages as they are written (a float16 scale per token and head): about half "
                        "the bytes of bf16 pages, so twice the tokens in the same memory; default: the model's dtype")
