"""``triton``: NVIDIA GPUs through Triton kernels generated from the spec (kernels land with issue 4)."""

from __future__ import annotations

import importlib.util

import torch

from tessera.backends.base import register


class TritonBackend:
    name = "triton"
    priority = 20

    def available(self) -> list[str]:
        reasons = []
        if importlib.util.find_spec("triton") is None:
            reasons.append("the triton package is not installed")
        if not torch.cuda.is_available():
            reasons.append("no CUDA device (torch.cuda.is_available() is False)")
        reasons.append("attention kernels are not implemented yet (issue 4)")
        return reasons

    def why_not(self, request) -> list[str]:
        if request.device.type != "cuda":
            return [f"runs on CUDA tensors, got {request.device.type}"]
        return []

    def plan(self, spec, batch, layout):
        raise NotImplementedError("the triton attention kernels land with issue 4")

    def run(self, state, q, k_rows, v_rows, out, lse):
        raise NotImplementedError("the triton attention kernels land with issue 4")


BACKEND = register(TritonBackend())
