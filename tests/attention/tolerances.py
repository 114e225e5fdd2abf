"""The one tolerance table per dtype, the error measure it bounds, and the check of a result against the oracle.

Error measure
-------------
For outputs, the *norm-relative* error::

    err(out, ref) = max |out - ref| / max(max |ref|, OUT_FLOOR)

over every element, with ``out`` upcast to float64 and ``ref`` the float64 oracle computed from the *same*
low-precision inputs upcast to float64 (so input rounding is not charged to the backend). Attention outputs are
convex combinations of value rows, so ``max |ref|`` is the natural scale; the floor only matters when every row is
(nearly) zero.

For the log-sum-exp, the same measure with floor ``LSE_FLOOR = 1``: an absolute error where ``|lse| <= 1``,
relative beyond. It is taken over the positions where the oracle's lse is finite; ``-inf`` positions (fully masked
rows without sinks) must match exactly, and no NaN or ``+inf`` may appear anywhere.
"""

from __future__ import annotations

import torch

#: Largest allowed norm-relative error, per storage dtype (outputs and lse alike).
TOLERANCES: dict[torch.dtype, float] = {
    torch.float32: 2e-4,
    torch.bfloat16: 3e-2,
    torch.float16: 5e-3,
}
OUT_FLOOR = 1e-3
LSE_FLOOR = 1.0


def tolerance(dtype: torch.dtype) -> float:
    """The tolerance of a storage dtype (KeyError names the dtypes the table knows)."""
    try:
        return TOLERANCES[dtype]
    except KeyError:
        raise KeyError(f"no tolerance for {dtype}; the table has {list(TOLERANCES)}") from None


def rel_err(actual: torch.Tensor, expected: torch.Tensor, floor: float = OUT_FLOOR) -> float:
    """``max |actual - expected| / max(max |expected|, floor)`` in float64 (0.0 for empty tensors)."""
    if expected.numel() == 0:
        return 0.0
    a, e = actual.double(), expected.double()
    return float((a - e).abs().max() / max(float(e.abs().max()), floor))


def _worst(actual: torch.Tensor, expected: torch.Tensor) -> str:
    diff = (actual.double() - expected.double()).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    return f"worst at {idx}: got {float(actual[idx]):.6g}, expected {float(expected[idx]):.6g}"


def assert_matches_oracle(
    out: torch.Tensor,
    lse: torch.Tensor,
    ref_out: torch.Tensor,
    ref_lse: torch.Tensor,
    dtype: torch.dtype,
    context: str = "",
) -> None:
    """Assert a backend's ``(out, lse)`` matches the float64 oracle's ``(ref_out, ref_lse)``.

    Checks dtypes and shapes, that ``out`` is finite everywhere, that rows the oracle leaves exactly zero (fully
    masked rows) are exactly zero, the ``-inf`` pattern of lse exactly, and both errors against ``tolerance(dtype)``.
    """
    tol = tolerance(dtype)
    where = f" [{context}]" if context else ""
    assert out.dtype == dtype, f"out dtype {out.dtype}, expected the input dtype {dtype}{where}"
    assert lse.dtype == torch.float32, f"lse dtype {lse.dtype}, expected float32{where}"
    assert out.shape == ref_out.shape, f"out shape {tuple(out.shape)}, expected {tuple(ref_out.shape)}{where}"
    assert lse.shape == ref_lse.shape, f"lse shape {tuple(lse.shape)}, expected {tuple(ref_lse.shape)}{where}"

    bad = ~torch.isfinite(out)
    assert not bad.any(), f"{int(bad.sum())} non-finite output elements, first at {bad.nonzero()[0].tolist()}{where}"
    assert not lse.isnan().any() and not lse.isposinf().any(), f"lse has NaN or +inf{where}"
    ref_neg = ref_lse.isneginf()
    mismatch = ref_neg != lse.isneginf()
    if mismatch.any():
        first = tuple(mismatch.nonzero()[0].tolist())
        raise AssertionError(f"lse -inf pattern differs at {int(mismatch.sum())} positions, first {list(first)} "
                             f"(got {float(lse[first])}, expected {float(ref_lse[first])}){where}")

    zero_rows = (ref_out == 0).all(dim=-1)  # fully masked rows (with or without sinks)
    leaked = zero_rows & (out != 0).any(dim=-1)
    assert not leaked.any(), (
        f"{int(leaked.sum())} fully masked rows are not exactly 0, first {leaked.nonzero()[0].tolist()}{where}")

    err = rel_err(out, ref_out)
    assert err <= tol, f"out error {err:.3g} > {tol:g} for {dtype}; {_worst(out, ref_out)}{where}"
    finite = ~ref_neg
    lse_err = rel_err(lse[finite], ref_lse[finite], LSE_FLOOR)
    assert lse_err <= tol, (
        f"lse error {lse_err:.3g} > {tol:g} for {dtype}; {_worst(lse[finite], ref_lse[finite])}{where}"
    )
