"""The command-line flags of speculative decoding, shared by ``tessera generate`` and ``tessera serve``."""

from __future__ import annotations

import argparse


def add_speculative_flags(p: argparse.ArgumentParser) -> None:
    """``--speculative ngram|draft:PATH|self:FORMAT`` and ``--num-draft K``."""
    p.add_argument("--speculative", metavar="METHOD",
                   help="speculative decoding: 'ngram' (prompt lookup), 'draft:PATH' (a smaller model with the same "
                        "vocabulary) or 'self:FORMAT' (this model quantized to q4_0, q4_1 or q8_0); greedy output "
                        "is unchanged, sampled output keeps its distribution")
    p.add_argument("--num-draft", type=int, metavar="K",
                   help="most tokens drafted per step (1..7, default 4); fewer while drafts do not pay off")


def speculative_args(args: argparse.Namespace) -> dict:
    """The ``LLM`` keyword arguments the flags ask for (checked before any model loads)."""
    from tessera.engine.speculative.config import parse_speculative

    if args.num_draft is not None and args.speculative is None:
        raise ValueError("--num-draft needs --speculative (ngram, draft:PATH or self:FORMAT)")
    return {"speculative": parse_speculative(args.speculative, args.num_draft)}
