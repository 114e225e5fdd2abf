"""Score functions: values of the built-ins and the ALiBi slopes."""

from __future__ import annotations

import pytest
import torch

from tessera.attention import alibi, alibi_slopes, custom_score, softcap


@pytest.mark.parametrize("num_heads", [1, 2, 4, 8, 16])
def test_alibi_slopes_powers_of_two(num_heads: int) -> None:
    """For 2**n heads the slopes are the geometric sequence 2**(-8/n * i), i = 1 .. n (ALiBi paper)."""
    expected = torch.tensor([2.0 ** (-8.0 / num_heads * i) for i in range(1, num_heads + 1)])
    slopes = alibi_slopes(num_heads)
    assert slopes.dtype == torch.float32 and slopes.shape == (num_heads,)
    torch.testing.assert_close(slopes, expected)


def test_alibi_slopes_other_counts() -> None:
    """Other counts take the slopes of the next lower power of two, then every other slope of the next higher."""
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]))
    torch.testing.assert_close(alibi_slopes(3), torch.tensor([2.0**-4, 2.0**-8, 2.0**-2]))
    s12 = alibi_slopes(12)
    torch.testing.assert_close(s12[:8], alibi_slopes(8))
    torch.testing.assert_close(s12[8:], alibi_slopes(16)[0::2][:4])


def test_builtin_score_values() -> None:
    s = torch.linspace(-100, 100, 41, dtype=torch.float64).view(1, 1, -1)
    b, h = torch.tensor(0), torch.arange(2).view(-1, 1, 1)
    q_pos, kv_pos = torch.tensor(20).view(1, 1, 1), torch.arange(41).view(1, 1, -1)
    capped = softcap(30.0).apply(s, b, h, q_pos, kv_pos)
    torch.testing.assert_close(capped, 30.0 * torch.tanh(s / 30.0).expand_as(capped))
    assert float(capped.abs().max()) < 30.0
    slopes = torch.tensor([0.5, -0.25])
    biased = alibi(slopes).apply(s, b, h, q_pos, kv_pos)
    torch.testing.assert_close(biased, s + slopes.view(-1, 1, 1).double() * (kv_pos - q_pos))
    doubled = custom_score(lambda sc, b_, h_, q_, k_: sc * 2).apply(s, b, h, q_pos, kv_pos)
    torch.testing.assert_close(doubled, s * 2)
