"""A suite for the CLI tests: two cheap cases whose speed a test controls through ``SLOW``."""

from __future__ import annotations

import time

import torch

from tessera.bench.harness import Case
from tessera.kernels.norms import rms_norm

#: names of cases to slow down deliberately (8 ms of sleep instead of 2)
SLOW: set[str] = set()


def cases(quick: bool):
    x, w = torch.randn(16, 512), torch.randn(512)

    def make(name: str):
        def run():
            # Every case sleeps, so its time is the sleep's, not a ~0.1 ms kernel's: on a busy 2-core VM the bare
            # kernel's time moved by more than the compare threshold between two runs, and the control case was
            # flagged as a regression.
            time.sleep(0.008 if name in SLOW else 0.002)
            return rms_norm(x, w, 1e-6, backend="cpu")
        return run

    for name in ("rms_norm a", "rms_norm b"):
        yield Case("fake", name, make(name), lambda: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) * w,
                   "torch", 0.0, 2.0 * x.numel() * 4, "fp32", {"phase": "decode", "context": 16}, reps=15)
