"""tessera.hw.devices and tessera.hw.roofline: hand-checked numbers, the ridge point, NPU parameters flowing through."""

from __future__ import annotations

import pytest

from tessera.hw import devices, roofline
from tessera.hw.devices import Device

# A round-number device: 1 TFLOP/s fp32, 100 GB/s, so the ridge point is 10 FLOP/byte.
TOY = Device(name="toy", kind="cpu", peak_flops={"fp32": 1e12}, mem_bw=1e11, sram_bytes=0, source="test")


def test_predict_seconds_takes_the_slower_roof() -> None:
    assert roofline.predict_seconds(2e12, 1e9, TOY) == pytest.approx(2.0)       # compute: 2 s vs 0.01 s
    assert roofline.predict_seconds(1e9, 5e11, TOY) == pytest.approx(5.0)       # memory: 0.001 s vs 5 s
    assert roofline.predict_seconds(0, 0, TOY) == 0.0


def test_bound_switches_at_the_ridge_point() -> None:
    assert roofline.ridge_point(TOY) == pytest.approx(10.0)
    nbytes = 1e9
    assert roofline.bound(9.99 * nbytes, nbytes, TOY) == "memory"
    assert roofline.bound(10.0 * nbytes, nbytes, TOY) == "compute"
    assert roofline.bound(10.01 * nbytes, nbytes, TOY) == "compute"
    # at the ridge both roofs give the same time
    assert roofline.predict_seconds(10 * nbytes, nbytes, TOY) == pytest.approx(nbytes / TOY.mem_bw)


def test_attainable_flops_and_intensity() -> None:
    assert roofline.arithmetic_intensity(100.0, 50.0) == 2.0
    assert roofline.arithmetic_intensity(1.0, 0.0) == float("inf")
    assert roofline.attainable_flops(2.0, TOY) == pytest.approx(2e11)          # on the memory slope
    assert roofline.attainable_flops(1000.0, TOY) == pytest.approx(1e12)       # flat compute roof
    with pytest.raises(ValueError, match="intensity"):
        roofline.attainable_flops(-1.0, TOY)


def test_matmul_cost_hand_checked() -> None:
    # x [3, 5] @ w[7, 5].T fp32: 2*3*7*5 = 210 FLOPs; (35 + 15 + 21) * 4 = 284 bytes
    assert roofline.matmul_cost(3, 7, 5, 4, 4) == (210.0, 284.0)
    # a packed int4 weight at 0.5625 bytes per element, bf16 activations, fp32 out
    assert roofline.matmul_cost(1, 64, 32, 0.5625, 2, out_bytes_per_elem=4) == (4096.0, 64 * 32 * 0.5625 + 64 + 256)


def test_attention_cost_prefill_is_the_causal_half_and_decode_reads_the_kv() -> None:
    hq, hkv, d = 4, 2, 8
    flops, nbytes = roofline.attention_cost(16, 16, hq, hkv, d, 4)
    assert flops == 4 * (16 * 17 // 2) * hq * d
    assert nbytes == (2 * 16 * hq + 2 * 16 * hkv) * d * 4
    full, _ = roofline.attention_cost(16, 16, hq, hkv, d, 4, causal=False)
    assert full == 4 * 16 * 16 * hq * d
    # decode: one query sees all 100 keys; bytes are q + out + K + V
    flops, nbytes = roofline.attention_cost([1], [100], hq, hkv, d, 2)
    assert flops == 4 * 100 * hq * d
    assert nbytes == (2 * hq + 2 * 100 * hkv) * d * 2
    # ragged batch = the sum of its sequences; a chunk after a cached prefix sees the prefix
    both = roofline.attention_cost([16, 1], [16, 100], hq, hkv, d, 2)
    one, two = roofline.attention_cost(16, 16, hq, hkv, d, 2), roofline.attention_cost(1, 100, hq, hkv, d, 2)
    assert both == (one[0] + two[0], one[1] + two[1])
    assert roofline.attention_cost(2, 10, 1, 1, 1, 1)[0] == 4 * (9 + 10)
    with pytest.raises(ValueError, match="q_len <= kv_len"):
        roofline.attention_cost(5, 4, hq, hkv, d, 2)


def test_norm_and_elementwise_costs() -> None:
    assert roofline.norm_cost(2, 8, 4) == (64.0, (2 * 16 + 8) * 4.0)
    assert roofline.norm_cost(2, 8, 4, residual=True) == (80.0, (4 * 16 + 8) * 4.0)
    assert roofline.elementwise_cost(20, 10, 2, flops_per_elem=5) == (50.0, 60.0)


def test_datasheet_devices() -> None:
    h100, h200 = devices.get("h100"), devices.get("H200")
    assert h100.peak_flops["bf16"] == 989e12 and h100.peak_flops["fp8"] == 1979e12
    assert h100.mem_bw == 3.35e12 and h200.mem_bw == 4.8e12
    assert h200.peak_flops == h100.peak_flops and h100.sram_bytes >= 50e6
    # a 1x8192x8192 bf16 GEMV is memory bound on both; the H200 finishes it 4.8/3.35 times sooner
    flops, nbytes = roofline.matmul_cost(1, 8192, 8192, 2, 2)
    t100, t200 = (roofline.predict_seconds(flops, nbytes, dev, "bf16") for dev in (h100, h200))
    assert roofline.bound(flops, nbytes, h100, "bf16") == "memory"
    assert t100 / t200 == pytest.approx(4.8 / 3.35)
    with pytest.raises(KeyError, match="no peak for dtype"):
        h100.peak("fp4")
    with pytest.raises(ValueError, match="unknown device"):
        devices.get("tpu")


def test_npu_parameters_flow_through() -> None:
    npu = devices.hypothetical_npu(sram_mib=32, mem_bw_gbps=1000, matrix_tflops=50)
    assert npu.kind == "npu" and npu.sram_bytes == 32 * 2**20
    assert npu.mem_bw == 1e12 and npu.peak_flops["bf16"] == 50e12
    assert roofline.ridge_point(npu, "bf16") == pytest.approx(50.0)
    assert roofline.predict_seconds(50e12, 1.0, npu, "bf16") == pytest.approx(1.0)
    assert devices.get("npu", mem_bw_gbps=200).mem_bw == 2e11
    default = devices.get("npu")
    assert default.sram_bytes == 64 * 2**20 and default.mem_bw == 400e9 and default.peak_flops["bf16"] == 200e12


def test_this_cpu_comes_from_the_ceilings(monkeypatch: pytest.MonkeyPatch) -> None:
    from tessera.hw import Ceilings, ceilings

    fake = Ceilings(gemm_fp32_gflops=100.0, read_gbps=20.0, read_method="torch.sum", cpu_model="Test CPU",
                    num_cores=2, torch_threads=2, torch_version="x", isa=(), gemm_size=64, read_bytes=1024,
                    measured_at="2026-01-01T00:00:00+00:00", measure_seconds=1.0, others_busy=0.0)
    monkeypatch.setattr(ceilings, "get_ceilings", lambda: fake)
    cpu = devices.this_cpu()
    assert cpu.kind == "cpu" and cpu.peak_flops == {"fp32": 100e9, "bf16": 100e9} and cpu.mem_bw == 20e9
    assert "measured on this machine 2026-01-01" in cpu.source and cpu.sram_bytes >= 0


def test_device_validates() -> None:
    with pytest.raises(ValueError, match="kind"):
        Device(name="x", kind="fpga", peak_flops={"fp32": 1.0}, mem_bw=1.0, sram_bytes=0)
    with pytest.raises(ValueError, match="unknown dtype key"):
        Device(name="x", kind="cpu", peak_flops={"float32": 1.0}, mem_bw=1.0, sram_bytes=0)
    with pytest.raises(ValueError, match="mem_bw"):
        Device(name="x", kind="cpu", peak_flops={"fp32": 1.0}, mem_bw=0.0, sram_bytes=0)


def test_cpu_cache_bytes_dedupes_shared_caches(tmp_path) -> None:
    for cpu in range(2):
        for index, (level, size, shared) in enumerate((("1", "32K", str(cpu)), ("2", "1024K", str(cpu)),
                                                        ("3", "32M", "0-1"))):
            d = tmp_path / f"cpu{cpu}" / "cache" / f"index{index}"
            d.mkdir(parents=True)
            (d / "level").write_text(level)
            (d / "size").write_text(size)
            (d / "shared_cpu_list").write_text(shared)
    assert devices._cpu_cache_bytes(2, tmp_path) == 2 * 2**20 + 32 * 2**20
