"""The one tolerance table of the kernel-library tests, per storage dtype, and the comparison against float64.

``err = max |out - ref| / max(max |ref|, floor)`` with ``ref`` the float64 oracle computed from the same
(low-precision) inputs upcast; quantized ops compare against the oracle of the *dequantized* weights, so only the
kernel's arithmetic is charged.
"""

from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 1e-5,
    torch.bfloat16: 1.6e-2,
    torch.float16: 2e-3,
}
#: Reductions over long rows (matmul, norms over 4096+) accumulate more rounding: this factor widens fp32 only.
FP32_REDUCTION_SLACK = 20.0
FLOOR = 1e-6


def rel_err(out: torch.Tensor, ref: torch.Tensor, floor: float = FLOOR) -> float:
    if ref.numel() == 0:
        return 0.0
    o, r = out.double(), ref.double()
    return float((o - r).abs().max() / max(float(r.abs().max()), floor))


def assert_close_to_oracle(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "",
                           reduction: bool = False) -> None:
    """Assert ``out`` (any dtype) matches the float64 ``ref`` within the dtype's tolerance; NaN never passes."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{what}: NaN in output"
    tol = TOLERANCES[dtype] * (FP32_REDUCTION_SLACK if reduction and dtype == torch.float32 else 1.0)
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: norm-relative error {err:.3g} > {tol:.3g} ({dtype})"
