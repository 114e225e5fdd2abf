"""``--backend`` and ``--device``: which backend runs a command's model, and where its tensors live."""

from __future__ import annotations

import argparse


def add_placement_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="auto",
                   help="kernel and attention backend: auto, cpu, reference, triton, or any registered one "
                        "(`tessera info` lists them and why one is unusable)")
    p.add_argument("--device", default=None,
                   help="where weights, KV cache and activations live, e.g. cpu, cuda, cuda:1 "
                        "(default: the backend's own device; cpu under auto)")
