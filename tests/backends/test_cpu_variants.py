"""cpu kernel variants: selection from the ISA, forcing by environment, and every ``qgemv`` variant this machine can
run against the float64 oracle of what it computes."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from tessera.backends.cpu import variants
from tessera.backends.cpu.ops import _qdot, _qdot_kernels
from tessera.backends.reference.ops.quant import dequantize_f64, qmatmul_f64
from tessera.hw import isa
from tessera.kernels import quant as Q
from tests.cpu_variants import skip_unless_runs
from tests.kernels.conftest import gen  # noqa: F401  (the seeded-generator fixture)
from tests.kernels.tolerances import assert_close_to_oracle

QGEMV = [v.name for v in variants.FAMILIES["qgemv"].variants]
FORMATS = [("int4", 32), ("int4", 64), ("int4", 128), ("int4_min", 32), ("int4_min", 128), ("int8", 32),
           ("int8", 128), ("int8", None)]


@pytest.fixture(autouse=True)
def _fresh_choices():
    """Choices are cached per environment; tests that fake the CPU's features must not see or leave stale ones."""
    variants.reset()
    yield
    variants.reset()


def _fake_features(monkeypatch, names: set[str]) -> None:
    monkeypatch.setattr(isa, "features", lambda: frozenset(names))
    variants.reset()


def _force(monkeypatch, spec: str) -> None:
    monkeypatch.setenv("TESSERA_CPU_VARIANTS", spec)




# ------------------------------------------------------------------------------------------------ selection
def test_every_family_ends_portable_and_chooses_something() -> None:
    for row in variants.explain():
        assert row["chosen"] in row["available"]
        assert variants.FAMILIES[row["family"]].variants[-1].requires == frozenset()


#: what an AVX512-VNNI CPU without AVX-VNNI reports (Ice Lake, Zen 4)
AVX512_VNNI = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"})


def test_a_variant_missing_a_feature_is_never_chosen(monkeypatch) -> None:
    _fake_features(monkeypatch, {"avx2"})
    assert variants.choose("qgemv").name == "avx2"
    _fake_features(monkeypatch, set())
    assert variants.choose("qgemv").name == "portable"
    _fake_features(monkeypatch, {"avx2", "avxvnni"})
    assert variants.choose("qgemv").name == "vnni"
    _fake_features(monkeypatch, AVX512_VNNI)
    assert variants.choose("qgemv").name == "vnni512"
    row = next(r for r in variants.explain() if r["family"] == "qgemv")
    assert row["chosen"] == "vnni512" and row["passed_over"] == []
    _fake_features(monkeypatch, AVX512_VNNI - {"avx512bw"})  # the 512-bit rows shift and negate bytes (AVX512-BW)
    assert variants.choose("qgemv").name == "avx2"
    _fake_features(monkeypatch, AVX512_VNNI | {"avxvnni"})  # Sapphire Rapids: both encodings, the wide rows first
    assert variants.choose("qgemv").name == "vnni512"


def test_kv_qk_selection_and_forcing(monkeypatch) -> None:
    """The int8 Q.K decode family: the 512-bit rows with AVX512-VNNI (+BW, VL), the 256-bit ones with AVX-VNNI, the
    float path elsewhere; ``portable`` forces the float path, and ``tessera info`` lists the family."""
    _fake_features(monkeypatch, AVX512_VNNI)
    assert variants.choose("kv_qk").name == "vnni512"
    _fake_features(monkeypatch, {"avx2", "avxvnni"})
    assert variants.choose("kv_qk").name == "vnni"
    _fake_features(monkeypatch, {"avx2", "avx512f"})
    assert variants.choose("kv_qk").name == "portable"
    row = next(r for r in variants.explain() if r["family"] == "kv_qk")
    assert row["chosen"] == "portable" and row["passed_over"][0].startswith("vnni512: lacks")
    _fake_features(monkeypatch, AVX512_VNNI | {"avxvnni"})
    _force(monkeypatch, "kv_qk=vnni")
    assert variants.choose("kv_qk").name == "vnni" and variants.choose("qgemv").name == "vnni512"
    _force(monkeypatch, "portable")
    assert variants.choose("kv_qk").name == "portable"
    _fake_features(monkeypatch, {"avx2"})
    _force(monkeypatch, "kv_qk=vnni512")
    with pytest.raises(RuntimeError, match="kv_qk=vnni512"):
        variants.choose("kv_qk")


def test_kv_pv_selection_and_forcing(monkeypatch) -> None:
    """The int8 P.V family follows the same ISA order as kv_qk; ``float`` is its portable end, and ``portable``
    forces it."""
    _fake_features(monkeypatch, AVX512_VNNI)
    assert variants.choose("kv_pv").name == "vnni512"
    _fake_features(monkeypatch, {"avx2", "avxvnni"})
    assert variants.choose("kv_pv").name == "vnni"
    _fake_features(monkeypatch, {"avx2", "avx512f"})
    assert variants.choose("kv_pv").name == "float"
    _fake_features(monkeypatch, AVX512_VNNI | {"avxvnni"})
    _force(monkeypatch, "kv_pv=float")
    assert variants.choose("kv_pv").name == "float" and variants.choose("kv_qk").name == "vnni512"
    _force(monkeypatch, "portable")
    assert variants.choose("kv_pv").name == "float"


def test_kv_qk_variant_is_part_of_the_kernel_signature(monkeypatch) -> None:
    """Each int8 Q.K variant reaches the kernels as its own ISA token, an argument of its own Numba type, so each is
    its own compiled specialization: forcing one never reuses another's machine code from the on-disk cache (whose
    directory is keyed only by what changes the float vector width)."""
    from numba import typeof

    from tessera.backends.cpu import decode_qk8
    from tessera.backends.cpu.ops._int8_simd import TOKENS

    assert typeof(TOKENS["vnni512"]) != typeof(TOKENS["vnni"])
    codes = np.zeros((1, 1, 128), np.int8)
    for name in variants.available("kv_qk"):
        _force(monkeypatch, f"kv_qk={name}")
        assert decode_qk8.qk_token(codes, 128) is (None if name == "portable" else TOKENS[name])


def test_isa_cap_imitates_older_machines(monkeypatch) -> None:
    monkeypatch.setenv("TESSERA_ISA", "baseline")
    assert isa.features() == frozenset() and variants.choose("qgemv").name == "portable"
    monkeypatch.setenv("TESSERA_ISA", "avx2")
    assert isa.features() <= isa.CAPS["avx2"]
    monkeypatch.setenv("TESSERA_ISA", "avx9")
    with pytest.raises(ValueError, match="TESSERA_ISA must be one of"):
        isa.features()


def test_forcing(monkeypatch) -> None:
    _force(monkeypatch, "portable")
    assert all(r["chosen"] == variants.FAMILIES[r["family"]].variants[-1].name for r in variants.explain())
    _force(monkeypatch, "qgemv=portable")
    assert variants.choose("qgemv").name == "portable"
    assert next(r for r in variants.explain() if r["family"] == "qgemv")["why"] == "forced by TESSERA_CPU_VARIANTS"
    for bad, match in [("qgemv", "expected 'family=variant"), ("nope=x", "expected 'family=variant"),
                       ("qgemv=fast", "has variants")]:
        _force(monkeypatch, bad)
        with pytest.raises(ValueError, match=match):
            variants.choose("qgemv")
    _fake_features(monkeypatch, set())
    _force(monkeypatch, "qgemv=avx2")
    with pytest.raises(RuntimeError, match=r"needs \['avx2'\]"):
        variants.choose("qgemv")



def test_a_tuned_variant_is_taken_where_the_cpu_runs_it(monkeypatch) -> None:
    """``tessera tune`` may find a variant below the ISA order's pick faster (AVX2 on Zen 4): ``qgemv_variant``
    makes it the choice, ``tessera info`` says why, the environment still wins, and a name the CPU cannot run leaves
    the ISA order in charge."""
    from tessera.tuning import overriding

    _fake_features(monkeypatch, AVX512_VNNI)
    assert variants.choose("qgemv").name == "vnni512"
    with overriding("qgemv_variant", "avx2"):
        assert variants.choose("qgemv").name == "avx2"
        row = next(r for r in variants.explain() if r["family"] == "qgemv")
        assert row["chosen"] == "avx2" and row["why"].startswith("tuned") and "vnni512" in row["why"]
        assert row["passed_over"] == ["vnni512: slower here (tuned)", "vnni: lacks ['avxvnni']"]
        _force(monkeypatch, "qgemv=vnni512")
        assert variants.choose("qgemv").name == "vnni512"
        monkeypatch.delenv("TESSERA_CPU_VARIANTS")
    with overriding("qgemv_variant", "vnni"):  # needs AVX-VNNI, which this (faked) CPU lacks
        assert variants.choose("qgemv").name == "vnni512"
    with overriding("qgemv_variant", "avx3"), pytest.raises(ValueError, match="expected 'auto' or one of"):
        variants.choose("qgemv")
    with overriding("qgemv_variant", variants.AUTO):
        assert variants.choose("qgemv").name == "vnni512"


def test_the_tuned_variant_reaches_the_kernels(monkeypatch) -> None:
    """The token the packed matmul runs follows the tuned choice (its cache is keyed by it)."""
    from tessera.tuning import overriding

    skip_unless_runs("qgemv", "avx2")
    assert _qdot.chosen_token() is _qdot._TOKENS[variants.available("qgemv")[0]]
    with overriding("qgemv_variant", "avx2"):
        assert _qdot.chosen_token() is _qdot._TOKENS["avx2"]
    assert _qdot.chosen_token() is _qdot._TOKENS[variants.available("qgemv")[0]]

# ------------------------------------------------------------------------------------------------ the quantizer
def test_activation_quantizer_matches_float64(gen: torch.Generator) -> None:
    x = torch.randn(5, 160, generator=gen) * torch.rand(5, 1, generator=gen).add(0.01)
    x[1, 32:64] = 0  # an all-zero block: scale 0, codes 0
    x[2, 70] = -x[2, 64:96].abs().max() * 2  # the block's extreme is negative: code -127
    xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
    blocks = x.double().reshape(5, 5, 32)
    d = blocks.abs().amax(-1) / 127
    torch.testing.assert_close(torch.from_numpy(xd).double(), d, rtol=1e-6, atol=0)
    exact = blocks / torch.where(d > 0, d, 1).unsqueeze(-1)
    codes = torch.from_numpy(xq).double().reshape(5, 5, 32)
    assert bool(((codes - exact).abs() <= 0.5 + 1e-4).all())  # round to nearest (ties may go either way)
    assert xq[2, 70] == -127 and not xq[1, 32:64].any() and xd[1, 1] == 0
    torch.testing.assert_close(torch.from_numpy(xs).double(), (codes * d.unsqueeze(-1)).sum(-1), rtol=1e-5, atol=1e-6)
    # the dequantized activation is within half a step of x
    x_deq = _qdot.quantized_activation(x).double()
    assert bool(((x_deq - x.double()).abs() <= d.repeat_interleave(32, 1) / 2 * (1 + 1e-5) + 1e-9).all())


# ------------------------------------------------------------------------------------------------ every variant
@pytest.mark.parametrize("variant", QGEMV)
@pytest.mark.parametrize("fmt,group_size", FORMATS)
@pytest.mark.parametrize("m,n", [(0, 5), (1, 1), (1, 37), (3, 37), (5, 37), (8, 70)])  # 4-row blocks + tails
def test_qgemv_variant_matches_oracle(variant: str, fmt: str, group_size: int | None, m: int, n: int, monkeypatch,
                                      gen: torch.Generator) -> None:
    """The cpu qmatmul under each variant: int8-activation variants against the float64 product of their own
    quantized activation (fp32 tolerance), and within the activation-quantization bound of the exact product."""
    skip_unless_runs("qgemv", variant)
    _force(monkeypatch, f"qgemv={variant}")
    k = 3 * (group_size or 32) + (64 if group_size is None else 0)  # odd group counts; per channel: K = 160
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    qw = Q.quantize(w, fmt, group_size)
    x = torch.randn(m, k, generator=gen)
    out = Q.qmatmul(x, qw, backend="cpu")
    exact = qmatmul_f64(x, qw)
    if variant == "portable":
        assert_close_to_oracle(out, exact, torch.float32, f"{variant} {fmt}/{group_size}", reduction=True)
        return
    assert_close_to_oracle(out, qmatmul_f64(_qdot.quantized_activation(x), qw), torch.float32,
                           f"{variant} {fmt}/{group_size} vs its quantized x", reduction=True)
    # against the exact product: each x entry moved by at most half its block's step d / 2, so every output is
    # within |W| @ (d / 2) (plus float32 rounding); a deterministic bound, not a statistical one
    if m:
        step = x.double().reshape(m, -1, 32).abs().amax(-1) / 127
        bound = dequantize_f64(qw).abs() @ (step / 2).repeat_interleave(32, 1).T
        slack = 1e-5 * (dequantize_f64(qw).abs() @ x.double().abs().T)
        assert bool(((out.double() - exact).abs() <= (bound + slack).T).all()), f"{variant}: beyond the step bound"


@pytest.mark.parametrize("variant", [v for v in QGEMV if v != "portable"])
@pytest.mark.parametrize("fmt", ["int4", "int4_min", "int8"])
def test_qgemv_kernels_write_every_output(variant: str, fmt: str, gen: torch.Generator) -> None:
    """Raw kernels into a NaN-poisoned output, serial and parallel, rows not a multiple of 4 or of ROWS, long K;
    seven x rows: one block of four sharing each weight block, then three one at a time."""
    skip_unless_runs("qgemv", variant)
    token = _qdot._TOKENS[variant]
    n, k = 2 * _qdot_kernels.ROWS + 3, 2048 + 32
    qw = Q.quantize(torch.randn(n, k, generator=gen), fmt, 32)
    x = torch.randn(7, k, generator=gen)
    want = qmatmul_f64(_qdot.quantized_activation(x), qw)
    for serial in (True, False):
        got = _qdot.qmatmul(x, qw, token, serial)
        assert not torch.isnan(got).any()
        assert_close_to_oracle(got, want, torch.float32, f"{variant} serial={serial}", reduction=True)
    poisoned = np.full((7, n), np.nan, np.float32)
    xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
    if fmt == "int8":
        _qdot_kernels.gemv_int8(token, xq, xd, *_qdot.weight_arrays(qw), poisoned)
    else:
        _qdot_kernels.gemv_int4(token, xq, xd, xs, *_qdot.weight_arrays(qw), poisoned)
    assert not np.isnan(poisoned).any()


@pytest.mark.parametrize("variant", [v for v in QGEMV if v != "portable"])
@pytest.mark.parametrize("fmt", ["int4", "int4_min", "int8"])
@pytest.mark.parametrize("k", [32, 64 + 32, 576, 1536 + 32])  # 1 block, odd counts, SmolLM2's widths
def test_qgemv_rows_do_not_depend_on_their_neighbours(variant: str, fmt: str, k: int, gen: torch.Generator) -> None:
    """A token's output row is bit-identical whether it runs alone or among other rows (four-row blocks, pairs,
    tails): speculative verification and batched decode must reproduce a lone decode's greedy token exactly."""
    skip_unless_runs("qgemv", variant)
    token = _qdot._TOKENS[variant]
    qw = Q.quantize(torch.randn(37, k, generator=gen), fmt, 32)
    x = torch.randn(9, k, generator=gen)
    together = _qdot.qmatmul(x, qw, token, True)
    for m in range(9):
        alone = _qdot.qmatmul(x[m:m + 1], qw, token, True)
        assert torch.equal(together[m], alone[0]), f"{variant} {fmt} K={k}: row {m} differs in a batch of 9"
        if m + 5 <= 9:
            assert torch.equal(_qdot.qmatmul(x[m:m + 5], qw, token, True)[0], alone[0])


@pytest.mark.parametrize("variant", [v for v in QGEMV if v != "portable"])
@pytest.mark.parametrize("fmt", ["int4", "int4_min", "int8"])
def test_qgemv_every_block_count(variant: str, fmt: str, gen: torch.Generator) -> None:
    """Group-32 rows of 1 to 9 blocks: the 512-bit rows take blocks four, then two at a time and finish an odd one
    on 256-bit vectors, so every count modulo 4 and the one-block row are checked; one x row and five (a block of
    four sharing each weight pair, then one). int8 codes of -128 (GGUF Q8_0 allows them; the 512-bit dot has no
    VPSIGNB and negates the activation instead) included. Outputs NaN-poisoned, serial and parallel."""
    skip_unless_runs("qgemv", variant)
    token = _qdot._TOKENS[variant]
    for blocks in range(1, 10):
        k = 32 * blocks
        qw = Q.quantize(torch.randn(19, k, generator=gen), fmt, 32)
        if fmt == "int8":
            qw.data[::3, ::5] = -128
        for m in (1, 5):
            x = torch.randn(m, k, generator=gen)
            want = qmatmul_f64(_qdot.quantized_activation(x), qw)
            xq, xd, xs = _qdot_kernels.quantize_activations(x.numpy())
            for kernel in ((_qdot_kernels.gemv_int8_serial, _qdot_kernels.gemv_int8) if fmt == "int8" else
                           (_qdot_kernels.gemv_int4_serial, _qdot_kernels.gemv_int4)):
                got = np.full((m, 19), np.nan, np.float32)
                head = (token, xq, xd) if fmt == "int8" else (token, xq, xd, xs)
                kernel(*head, *_qdot.weight_arrays(qw), got)
                assert_close_to_oracle(torch.from_numpy(got), want, torch.float32,
                                       f"{variant} {fmt} K={k} M={m} {kernel.__name__}", reduction=True)


@pytest.mark.parametrize("variant", QGEMV)
@pytest.mark.parametrize("fmt,group_size", [("int4", 32), ("int4_min", 32), ("int8", 32), ("int4", 64),
                                            ("int4_min", 128), ("int8", 128), ("int8", None)])
def test_qgemv_float16_scales(variant: str, fmt: str, group_size: int | None, monkeypatch,
                              gen: torch.Generator) -> None:
    """GGUF keeps its blocks' scales (and Q4_1 mins) in float16; every kernel widens them where it reads them. The
    same weight with those values as float32 scales must give the same product (odd block counts: the 512-bit rows'
    256-bit tail reads one scale alone), one x row and five, and M=20 (the tiled path's bf16 de-quantization)."""
    skip_unless_runs("qgemv", variant)
    _force(monkeypatch, f"qgemv={variant}")
    k = 5 * (group_size or 32) + (64 if group_size is None else 0)
    qw = Q.quantize(torch.randn(23, k, generator=gen), fmt, group_size)
    half = dataclasses.replace(qw, scales=qw.scales.half(),
                               mins=None if qw.mins is None else qw.mins.half())
    wide = dataclasses.replace(half, scales=half.scales.float(), mins=None if half.mins is None else half.mins.float())
    assert half.nbytes < wide.nbytes
    assert torch.equal(Q.dequantize(half, backend="cpu"), Q.dequantize(wide, backend="cpu"))
    for m in (1, 5, 20):
        x = torch.randn(m, k, generator=gen)
        # M <= 8 runs the variant's GEMV (int8-activation variants see their quantized x); M = 20 the bf16 tiles
        x_seen = _qdot.quantized_activation(x) if variant != "portable" and m <= 8 else x
        oracle = qmatmul_f64(x_seen, wide)
        tolerance = torch.bfloat16 if m > 8 else torch.float32  # the tiles round x and w to bf16
        for qw_ in (half, wide):  # equal to float32 rounding (the two compile separately; fastmath may reorder)
            assert_close_to_oracle(Q.qmatmul(x, qw_, backend="cpu"), oracle, tolerance,
                                   f"{variant} {fmt}/{group_size} M={m}", reduction=True)


def test_unsupported_weights_fall_back_to_float(monkeypatch, gen: torch.Generator) -> None:
    """fp8 weights and K that is not a multiple of 32 take the float kernels under any variant."""
    _force(monkeypatch, f"qgemv={variants.available('qgemv')[0]}")
    for qw in (Q.quantize(torch.randn(9, 64, generator=gen), "fp8_e4m3"),
               Q.quantize(torch.randn(9, 40, generator=gen), "int8")):
        assert _qdot.unsupported(qw) is not None
        x = torch.randn(2, qw.shape[1], generator=gen)
        assert_close_to_oracle(Q.qmatmul(x, qw, backend="cpu"), qmatmul_f64(x, qw), torch.float32, qw.fmt,
                               reduction=True)


_CROSS_COMPILE = r"""
import sys
from llvmlite import binding as llvm, ir
from tessera.backends.cpu.ops import _int8_simd as S

llvm.initialize_native_target(); llvm.initialize_native_asmprinter()
for cpu, features in [("sapphirerapids", ""), ("icelake-server", ""), ("alderlake", "")]:
    mod = ir.Module(name="m")
    v = ir.VectorType(ir.IntType(8), 32)
    fn = ir.Function(mod, ir.FunctionType(S._V32x8, [v, v]), name="f")
    b = ir.IRBuilder(fn.append_basic_block())
    b.ret(S._emit_dot_u8s8(b, "vnni", *fn.args))
    target = llvm.Target.from_triple(llvm.get_process_triple())
    tm = target.create_target_machine(cpu=cpu, features=features, opt=2)
    asm = tm.emit_assembly(llvm.parse_assembly(str(mod)))
    assert "vpdpbusd" in asm, (cpu, asm)
    print(cpu, "ok")
"""


def test_vnni_variant_compiles_for_vnni_targets() -> None:
    """The VNNI dot product selects ``VPDPBUSD`` for AVX-VNNI (Alder Lake), AVX512-VNNI (Ice Lake) and both
    (Sapphire Rapids) targets: checked by compiling to assembly, on any host (run in a subprocess because an LLVM
    selection failure aborts the process)."""
    done = subprocess.run([sys.executable, "-c", _CROSS_COMPILE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("ok") == 3


def test_a_variant_failing_its_self_check_is_replaced(monkeypatch) -> None:
    """A variant whose kernels disagree with the float64 oracle on first use is dropped for the next one, with a
    warning (the VNNI kernels cannot be run on CPUs without VNNI, so this guards machines nobody tested on)."""
    best = variants.available("qgemv")[0]
    if _qdot._TOKENS[best] is None:
        pytest.skip("no int8-activation variant on this CPU")
    assert _qdot.self_check(_qdot._TOKENS[best]) is None
    monkeypatch.setattr(_qdot, "_CHECKED", {})
    monkeypatch.setattr(_qdot, "_CHOSEN", {})
    monkeypatch.setattr(_qdot, "_passed_before", lambda name, kind: False)  # a pass another run remembered
    monkeypatch.setattr(_qdot, "self_check", lambda isa, kind: "simulated mismatch")
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        token = _qdot.chosen_token()
    assert token is None  # every int8 variant "failed": the portable float kernels run


def test_fused_layer_roof_follows_its_isa_argument():
    """The profile puts a fused decoder layer on the int8 roof when an ISA token runs its packed projections, wherever
    the token sits in the kernel's arguments (it is followed by ``n_workers``), and on the model dtype's otherwise."""
    from tessera.backends.cpu import peaks
    from tessera.backends.cpu.ops._int8_simd import AVX2

    from tessera.backends.cpu.decode_layer import layer_list
    from tessera.backends.cpu.kernel_args import LayerNorms, LayerWeights

    packed = (np.zeros((4, 16), np.uint8), np.ones((4, 1), np.float32), np.zeros((4, 1), np.float32), True, 32)
    x = np.zeros((1, 32), np.float32)
    norms = LayerNorms(x, x, x, x, x, x)
    packed_layers = layer_list([(LayerWeights(packed, x, x, x, x, x, x, x), norms)])
    float_layers = layer_list([(LayerWeights(x, x, x, x, x, x, x, x), norms)])
    assert peaks.roof_of("fused_decoder_layers", (x, x, packed_layers, x, AVX2, 2)) == "int8"
    assert peaks.roof_of("fused_decoder_layers", (x, x, packed_layers, x, None, 2)) is None
    assert peaks.roof_of("fused_decoder_layers", (x, x, float_layers, x, AVX2, 1)) is None  # float projections only


# ------------------------------------------------------------------------------------------------ prefill P.V
@pytest.mark.parametrize("variant", [v.name for v in variants.FAMILIES["prefill_pv"].variants])
@pytest.mark.parametrize("mask", ["causal", "window_softcap"])
def test_prefill_pv_variant_matches_oracle(variant: str, mask: str, monkeypatch) -> None:
    """bf16 prefill through the BLAS tiles under each ``prefill_pv`` variant this CPU runs: GQA 6:2, odd lengths, a
    cached prefix and kv runs longer than one tile (so the float32 accumulation across bf16 tiles is exercised),
    against the float64 oracle on the same bf16 inputs."""
    from tessera.attention import AttentionSpec, causal, sliding_window, softcap
    from tessera.backends.cpu import prefill
    from tests.attention.cases import check_against_oracle, seed_of, varlen_layout

    skip_unless_runs("prefill_pv", variant)
    _force(monkeypatch, f"prefill_pv={variant}")
    assert prefill._bf16_pv(torch.bfloat16) == (variant != "fp32") and not prefill._bf16_pv(torch.float32)
    layout = varlen_layout([131, 77], [131, 2 * prefill.KV_TILE + 45], hq=6, hkv=2, d=64)
    kw = {"mask": causal()} if mask == "causal" else {"mask": sliding_window(300) & causal(), "score": softcap(20.0)}
    gen = torch.Generator().manual_seed(seed_of(f"prefill_pv {variant} {mask}"))
    seen = []
    update = prefill._State.update
    monkeypatch.setattr(prefill._State, "update", lambda self, p, v, v_bf16=None: (seen.append(v_bf16 is not None),
                                                                                    update(self, p, v, v_bf16)))
    check_against_oracle("cpu", layout, AttentionSpec(6, 2, 64, **kw), torch.bfloat16, gen, f"prefill_pv={variant}")
    assert seen and set(seen) == {variant != "fp32"}, "the tiles did not take the variant's P.V path"


# ------------------------------------------------------------------------------------------------ prefill qgemm
QGEMM = [v.name for v in variants.FAMILIES["qgemm"].variants]


@pytest.mark.parametrize("variant", QGEMM)
@pytest.mark.parametrize("fmt,group_size", FORMATS + [("fp8_e4m3", None)])
def test_qgemm_variant_matches_oracle(variant: str, fmt: str, group_size: int | None, monkeypatch,
                                      gen: torch.Generator) -> None:
    """The tiled prefill path (more rows than the GEMV takes) under each ``qgemm`` variant this CPU runs, against
    the float64 product with the de-quantized weights: fp32 within the fp32 tolerance, the bf16 variants (x, the
    weight tile and the output each rounded to bf16 once) within the bf16 one. N spans two tiles and a partial one;
    a NaN-poisoned output catches unwritten columns."""
    from tessera.backends.cpu.ops import quant as cpu_quant

    skip_unless_runs("qgemm", variant)
    _force(monkeypatch, f"qgemm={variant}")
    monkeypatch.setenv("TESSERA_TUNE_QUANT_TILE_N", "256")
    k = 3 * (group_size or 32) + (64 if group_size is None else 0)
    n = 2 * 256 + 37
    w = torch.randn(n, k, generator=gen) * torch.rand(n, 1, generator=gen).add(0.1)
    qw = Q.quantize(w, fmt, group_size)
    x = torch.randn(150, k, generator=gen)
    monkeypatch.setattr(torch, "empty", lambda *shape, **kw: torch.full(  # poison every fresh output buffer
        shape[0] if len(shape) == 1 and isinstance(shape[0], tuple) else shape, float("nan"), **kw)
        if kw.get("dtype", torch.float32) == torch.float32 else torch.zeros(*shape, **kw))
    out = cpu_quant._gemm_tiled(x, qw)
    monkeypatch.undo()
    dtype = torch.float32 if variant == "fp32" else torch.bfloat16
    assert_close_to_oracle(out, qmatmul_f64(x, qw), dtype, f"qgemm={variant} {fmt}/{group_size}", reduction=True)


@pytest.mark.parametrize("fmt,group_size", [("int4", 32), ("int4", 128), ("int4_min", 64), ("int8", 32), ("int8", None)])
def test_bf16_dequantization_rounds_once(fmt: str, group_size: int | None, gen: torch.Generator) -> None:
    """The bf16 tiles' de-quantizer: the float32 weight rounded to bf16 once (round to nearest even, as torch's
    conversion), a NaN scale giving NaN, rows from an offset, every element written."""
    from tessera.backends.cpu.ops import quant as cpu_quant
    from tessera.backends.reference.ops.quant import dequantize_in

    qw = Q.quantize(torch.randn(13, 3 * (group_size or 32), generator=gen), fmt, group_size)
    qw.scales[4, 0] = float("nan")
    got = cpu_quant._bf16_tile(qw, 3, 11).T  # [8, K]
    want = dequantize_in(qw, torch.float32)[3:11].to(torch.bfloat16)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    # one rounding of the float32 weight; float32 rounding of ``q * s + off`` (fused or not) may move a tie by one
    # bf16 step, never more
    torch.testing.assert_close(got[~got.isnan()].float(), want[~want.isnan()].float(), rtol=2 ** -8, atol=0)


_KIND_ONLY = r"""
import torch
from tessera.backends.cpu.ops import _qdot, _qdot_kernels as kernels
from tessera.kernels.quant import from_gguf
import numpy as np

rng = np.random.default_rng(0)
blocks = rng.integers(0, 256, size=(8, 2, 20), dtype=np.uint8)
blocks[..., 0:4] = np.array([0.01, 0.002], np.float16).view(np.uint8)  # finite float16 scale and min
qw = from_gguf(blocks, "Q4_1", (8, 64))
_qdot._passed_before = lambda name, kind: False  # check now, even if an earlier run remembered a pass
token = _qdot.chosen_token(qw)
if token is None:
    print("portable")
else:
    # gemv_int4(isa, xq, xd, xs, packed, scales, offsets, has_min, group, out) and, under vnni512, the row-panel
    # gemv_panel(isa, xq, xd, xs, codes, scales, offsets, out): the scales' and offsets' types
    from tessera.backends.cpu.ops import _qdot_panel as panel
    sigs = [*kernels.gemv_int4.signatures, *panel.gemv_panel.signatures]
    scale_types = {str(sig[i]) for sig in sigs for i in (5, 6)}
    print("int8 kernels:", len(kernels.gemv_int8.signatures), "scales:", sorted(scale_types))
"""


def test_the_self_check_compiles_only_the_kinds_a_model_runs() -> None:
    """Choosing the variant for a GGUF Q4_1 weight (float16 scales and mins) self-checks the int4-with-mins kernels
    with float16 scales only: no float32-scale or int8 specialization a GGUF model never runs is compiled (on an
    empty kernel cache each one costs 5-30 s). Run in a fresh process, where no other test compiled them."""
    done = subprocess.run([sys.executable, "-c", _KIND_ONLY], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout.strip()
    if out == "portable":
        pytest.skip("no int8-activation variant on this CPU")
    # float16 scales reach the kernels as their bits (int16 views, widened in registers)
    assert out == "int8 kernels: 0 scales: ['array(int16, 2d, C)']", out


def test_a_self_check_pass_is_remembered_per_cpu_and_a_failure_is_not(monkeypatch, tmp_path) -> None:
    """A variant that passed is not checked again by a later process (the verdict file beside the compiled kernels,
    keyed by CPU, variant and weight kind); a damaged file means checking again, and a failure is never written."""
    path = tmp_path / "verdicts.json"
    monkeypatch.setattr(_qdot, "_verdicts_path", lambda: path)
    calls = []

    def check(isa, kind, result=None):
        calls.append(kind)
        return result

    kind = ("int4_min", torch.float16)
    monkeypatch.setattr(_qdot, "_CHECKED", {})
    monkeypatch.setattr(_qdot, "self_check", check)
    assert _qdot._passes("vnni", kind) and len(calls) == 1
    monkeypatch.setattr(_qdot, "_CHECKED", {})  # a new process
    assert _qdot._passes("vnni", kind) and len(calls) == 1  # read from the file
    assert _qdot._passes("vnni", ("int8", torch.float16)) and len(calls) == 2  # another kind is checked
    recorded = json.loads(path.read_text())
    assert len(recorded) == 2 and all(key.endswith(("|int4_min|torch.float16", "|int8|torch.float16"))
                                      for key in recorded)

    path.write_text("{not json")
    monkeypatch.setattr(_qdot, "_CHECKED", {})
    assert _qdot._passes("vnni", kind) and len(calls) == 3  # damaged: checked again, and rewritten
    assert len(json.loads(path.read_text())) == 1

    monkeypatch.setattr(_qdot, "_CHECKED", {})
    monkeypatch.setattr(_qdot, "self_check", lambda isa, kind: "simulated mismatch")
    with pytest.warns(RuntimeWarning, match="failed its self-check"):
        assert not _qdot._passes("avx2", kind)
    assert not any("|avx2|" in key for key in json.loads(path.read_text()))
