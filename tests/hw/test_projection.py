"""The modelled tensor-parallel decode step (tessera.hw.projection), against numbers computed by hand."""

from __future__ import annotations

import pytest

from tessera.cli import main
from tessera.hw.devices import H200_SXM
from tessera.hw.links import NVLINK4
from tessera.hw.projection import LLAMA_70B, ModelShape, parse_devices, project_decode

# Llama-70B, bf16, 8 ranks. One layer: q, o 8192^2 each; k, v 8192 x 1024 each; gate, up, down 8192 x 28672 each
LAYER_PARAMS = 2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672  # 855,638,016
LAYER_S = LAYER_PARAMS * 2 / 8 / 4.8e12  # 213.9 MB per rank over 4.8 TB/s = 44.56 us
HEAD_S = 128256 * 8192 * 2 / 8 / 4.8e12  # 262.7 MB per rank = 54.72 us


def _all_reduce(batch: int) -> float:
    # ring over 8 ranks: 14 hops of 5 us, 14/8 of batch * 8192 * 2 bytes over 450 GB/s
    return 14 * 5e-6 + 14 / 8 * batch * 8192 * 2 / 450e9


@pytest.mark.parametrize("batch, tok_s, share", [(1, 67.43, 0.7559), (32, 2112.75, 0.7610)])
def test_llama_70b_on_8_h200(batch, tok_s, share):
    world, device = parse_devices("8xH200")
    assert (world, device) == (8, H200_SXM)
    p = project_decode(LLAMA_70B, device, world, batch)
    assert LLAMA_70B.layer_params == LAYER_PARAMS == 855_638_016
    assert p.link is NVLINK4 and p.all_reduces_per_step == 160 and p.all_reduce_bytes == batch * 16384
    assert p.layer_compute_s == pytest.approx(LAYER_S)  # memory-bound at both batches: FLOPs/peak is far smaller
    assert p.layer_comm_s == pytest.approx(2 * _all_reduce(batch))
    step = 80 * (LAYER_S + 2 * _all_reduce(batch)) + HEAD_S
    assert p.step_s == pytest.approx(step)
    assert p.tokens_per_s == pytest.approx(batch / step) == pytest.approx(tok_s, rel=1e-4)
    assert p.comm_share == pytest.approx(80 * 2 * _all_reduce(batch) / step) == pytest.approx(share, rel=1e-3)


def test_compute_bound_batch_takes_the_flops():
    # at batch 4096 a layer's 2 * 4096 * 855.6 M / 8 FLOPs over 989 TFLOP/s (1.13 ms) exceed its 44.6 us read
    p = project_decode(LLAMA_70B, H200_SXM, 8, 4096)
    assert p.layer_compute_s == pytest.approx(2 * 4096 * LAYER_PARAMS / 8 / 989e12)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="like '8xH200'"):
        parse_devices("eight H200")
    with pytest.raises(ValueError, match="known link"):
        parse_devices("2xcpu")
    with pytest.raises(ValueError, match="batch must be"):
        project_decode(LLAMA_70B, H200_SXM, 8, 0)
    with pytest.raises(ValueError, match="num_heads"):
        ModelShape("odd", 1, 100, 3, 1, 10, 10)


def test_cli_prints_the_model(capsys):
    from tessera.hw import projection
    from tessera.tools import profile

    assert profile.MODEL_SHAPES == tuple(projection.MODEL_SHAPES)  # the parser's copy of the choices
    assert main(["profile", "--project", "llama-70b", "--devices", "8xH200", "--batch", "1", "32"]) == 0
    out = capsys.readouterr().out
    assert "MODEL, not a measurement" in out and "67.4" in out and "2112.8" in out and "75.6%" in out
    assert main(["profile", "--project", "llama-70b", "--devices", "8xB200"]) == 2
