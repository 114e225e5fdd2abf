"""Kernel variants of the cpu backend, per op family, chosen from the CPU's instruction set.

Each family lists its variants best first. A variant names the ISA features it needs (:mod:`tessera.hw.isa`); the
first whose features are all present is chosen, so a variant that needs an instruction this CPU lacks is never
chosen (and never compiled: LLVM would abort on it). ``TESSERA_CPU_VARIANTS`` forces choices, so that tests run every
variant this machine can execute and a user can rule one out:

``TESSERA_CPU_VARIANTS=qgemv=avx2``             one family
``TESSERA_CPU_VARIANTS=portable``               every family's portable variant (what a baseline CPU runs)

Forcing a variant whose features are missing is an error that names them. :func:`explain` is what ``tessera info``
prints: per family, the chosen variant and why, and why each better one was passed over.

The ISA order is a guess about speed, not a measurement everywhere: on Zen 4 the two-instruction AVX2 dot product
runs as fast as the 256-bit ``VPDPBUSD`` or up to 10% faster (the 512-bit ``vnni512`` rows beat both there). So a
family listed in :data:`TUNED` also has a tunable, ``<family>_variant`` (:mod:`tessera.backends.cpu.tunables`), that ``tessera
tune`` sets to the variant it measured fastest on this machine; unforced, :func:`choose` takes that one when the CPU
can run it. Its default, ``auto``, keeps the ISA order. The environment variable still wins over the tuned choice.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from tessera.hw import isa


@dataclass(frozen=True, slots=True)
class Variant:
    """One implementation of an op family.

    Attributes
    ----------
    name : str
        What ``TESSERA_CPU_VARIANTS`` and ``tessera info`` call it.
    requires : frozenset of str
        ISA features (LLVM spelling) it executes.
    summary : str
        One line: what it does differently.
    """

    name: str
    requires: frozenset[str]
    summary: str


@dataclass(frozen=True, slots=True)
class Family:
    """An op family and its variants, best first; the last one is portable (needs nothing)."""

    name: str
    summary: str
    variants: tuple[Variant, ...]

    def __post_init__(self) -> None:
        if self.variants[-1].requires:
            raise ValueError(f"family {self.name!r}: the last variant must be portable (require no feature)")


#: what the bf16 GEMM variants need: AMX tiles, or AVX-512 bf16 dot products (torch's oneDNN uses either)
_AMX_BF16 = frozenset({"amx-tile", "amx-bf16"})
_AVX512_BF16 = frozenset({"avx512bf16"})
#: what the int8 dot-product variants need: 512-bit VPDPBUSD (with byte ops and 256-bit EVEX forms), or AVX-VNNI
_VNNI512 = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl", "avx512vnni"})
_AVX_VNNI = frozenset({"avx2", "avxvnni"})

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("qgemv", "quantized matmul at decode shapes (packed int4 / int8 weights and GGUF's block formats, M <= "
                    "the GEMV row limit)", (
        Variant("vnni512", _VNNI512,
                "x quantized to int8 per block of 32; two blocks per 512-bit VPDPBUSD for group-32 weights (GGUF "
                "Q4_0 / Q4_1 / Q8_0) and the K-quants (Q4_K / Q5_K / Q6_K), the 256-bit EVEX form for other groups "
                "and Q5_0 / Q5_1"),
        Variant("vnni", _AVX_VNNI,
                "x quantized to int8 per block of 32; u8 x s8 dot products with VPDPBUSD (AVX-VNNI, 256-bit)"),
        Variant("avx2", frozenset({"avx2"}),
                "x quantized to int8 per block of 32; u8 x s8 dot products with VPMADDUBSW + VPMADDWD"),
        Variant("portable", frozenset(),
                "float32 x: codes widened to float32 and FMA'd (exact weight-only semantics)"),
    )),
    Family("qgemm", "quantized matmul at prefill shapes (packed weights, more rows of x than the GEMV row limit)", (
        Variant("amx_bf16", _AMX_BF16,
                "each weight tile de-quantized to bf16 and multiplied with x rounded to bf16 by torch's bf16 GEMM "
                "(oneDNN, AMX tiles; float32 accumulation, output rounded to bf16)"),
        Variant("avx512_bf16", _AVX512_BF16,
                "as amx_bf16, torch's bf16 GEMM on AVX512-BF16 dot products (VDPBF16PS)"),
        Variant("fp32", frozenset(), "weight tiles de-quantized to float32 and NumPy's BLAS sgemm (exact weight-only "
                "semantics)"),
    )),
    Family("prefill_pv", "P.V product of the prefill tiles when K/V are stored in bfloat16", (
        Variant("amx_bf16", _AMX_BF16,
                "P rounded to bf16 and multiplied with the bf16 V tile by torch's bf16 GEMM (oneDNN, AMX tiles); "
                "the tile's output accumulated in float32"),
        Variant("avx512_bf16", _AVX512_BF16,
                "as amx_bf16, torch's bf16 GEMM on AVX512-BF16 dot products (VDPBF16PS)"),
        Variant("fp32", frozenset(), "P and V in float32 through NumPy's BLAS sgemm, as for every other dtype"),
    )),
    Family("kv_qk", "Q.K of decode attention over an int8 KV cache (fp8 and float KV caches always run the float "
                    "path)", (
        Variant("vnni512", _VNNI512,
                "each query row quantized to int8 per step (one float32 scale per token and head); 64 products per "
                "512-bit VPDPBUSD of the key codes biased to unsigned (k ^ 0x80) against the query codes, the bias "
                "removed as 128 * sum(q); head dims that are a multiple of 64"),
        Variant("vnni", _AVX_VNNI,
                "as vnni512 with the 256-bit VPDPBUSD (AVX-VNNI); head dims that are a multiple of 32"),
        Variant("portable", frozenset(),
                "key codes widened to float32 and FMA'd against the float32 query (no query rounding)"),
    )),
    Family("kv_pv", "P.V of decode attention over an int8 KV cache, inside the int8 Q.K kernel (with kv_qk=portable, "
                    "fp8 or float caches P.V is float)", (
        Variant("vnni512", _VNNI512,
                "each row's chunk of probabilities times value scales rounded to uint8 (one float32 scale per row "
                "and chunk); 4 keys' value codes interleaved per 32-bit lane, 64 products per 512-bit VPDPBUSD; "
                "head dims that are a multiple of 64"),
        Variant("vnni", _AVX_VNNI,
                "as vnni512 with the 256-bit VPDPBUSD (AVX-VNNI); head dims that are a multiple of 32"),
        Variant("float", frozenset(), "value codes widened to float32 and FMA'd with the float32 probabilities"),
    )),
    Family("simd", "vector width of the explicit-SIMD attention micro-kernels (decode, shared-prefix pass)", (
        Variant("avx512", frozenset({"avx512f"}), "16 float32 lanes per vector (one zmm)"),
        Variant("lanes8", frozenset(), "8 float32 lanes per vector (one ymm; LLVM splits it on narrower CPUs)"),
    )),
)}

PORTABLE = "portable"
_NAMES = {name: [v.name for v in family.variants] for name, family in FAMILIES.items()}
#: families whose variant ``tessera tune`` may choose by timing (the tunable ``<family>_variant``)
TUNED = ("qgemv",)
#: the tunable's value that keeps the ISA order
AUTO = "auto"


def _forced() -> dict[str, str]:
    """``TESSERA_CPU_VARIANTS`` parsed and checked: family -> variant name."""
    raw = os.environ.get("TESSERA_CPU_VARIANTS", "").strip()
    if not raw:
        return {}
    if raw == PORTABLE:
        return {name: fam.variants[-1].name for name, fam in FAMILIES.items()}
    forced = {}
    for part in raw.split(","):
        family, sep, variant = part.strip().partition("=")
        if not sep or family not in FAMILIES:
            raise ValueError(f"TESSERA_CPU_VARIANTS: expected 'family=variant,...' with a family of "
                             f"{sorted(FAMILIES)} (or the single word 'portable'), got {part.strip()!r}")
        if variant not in _NAMES[family]:
            raise ValueError(f"TESSERA_CPU_VARIANTS: family {family!r} has variants {_NAMES[family]}, got {variant!r}")
        forced[family] = variant
    return forced


def tuned_preference(family: str) -> str:
    """The variant ``tessera tune`` chose for ``family`` on this machine, or :data:`AUTO`."""
    if family not in TUNED:
        return AUTO
    from tessera.tuning import tuned  # not at import: the tuning modules import the cpu backend

    value = tuned(f"{family}_variant", None, AUTO)  # a memoized lookup: this runs on every choose()
    if value != AUTO and value not in _NAMES[family]:
        raise ValueError(f"{family}_variant = {value!r} (TESSERA_TUNE_{family.upper()}_VARIANT or the tuning cache): "
                         f"expected {AUTO!r} or one of {_NAMES[family]}")
    return value


def _pick(family: Family, forced: str | None, preferred: str = AUTO) -> tuple[Variant, str]:
    if forced is not None:
        variant = next(v for v in family.variants if v.name == forced)
        lacking = isa.missing(variant.requires)
        if lacking:
            raise RuntimeError(f"TESSERA_CPU_VARIANTS forces {family.name}={variant.name}, which needs {lacking}; "
                               f"this CPU ({isa.host_cpu_name()}, TESSERA_ISA={isa.cap()}) lacks them. Choose one "
                               f"of {available(family.name)}")
        return variant, "forced by TESSERA_CPU_VARIANTS"
    best = next(v for v in family.variants if not isa.missing(v.requires))
    if preferred != AUTO and preferred != best.name:
        variant = next(v for v in family.variants if v.name == preferred)  # a known name: tuned_preference checks
        if not isa.missing(variant.requires):
            return variant, f"tuned: `tessera tune` timed it faster here than {best.name} (the ISA order's pick)"
    for variant in family.variants:
        if not isa.missing(variant.requires):
            why = f"needs {sorted(variant.requires)}, all present" if variant.requires else "needs nothing"
            return variant, f"best available ({why})"
    raise AssertionError("unreachable: the last variant is portable")


_CHOICE: dict[tuple[str, str, str], Variant] = {}


#: bumped by :func:`reset`, so caches built on the choices (``ops._qdot``) know to rebuild
generation = 0


def reset() -> None:
    """Forget the cached choices (after the CPU's reported features change, which only tests do)."""
    global generation
    _CHOICE.clear()
    generation += 1


def choose(family: str) -> Variant:
    """The variant of ``family`` to run here (cached per environment setting; a dict lookup after the first call)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {sorted(FAMILIES)}")
    preferred = tuned_preference(family)
    key = (family, os.environ.get("TESSERA_CPU_VARIANTS", ""), os.environ.get("TESSERA_ISA", ""), preferred)
    hit = _CHOICE.get(key)
    if hit is None:
        hit = _pick(FAMILIES[family], _forced().get(family), preferred)[0]
        _CHOICE[key] = hit
    return hit


def available(family: str) -> list[str]:
    """Names of the variants of ``family`` this machine can execute, best first (what the tests iterate over)."""
    return [v.name for v in FAMILIES[family].variants if not isa.missing(v.requires)]


def explain() -> list[dict[str, object]]:
    """Per family: the chosen variant, why, and why each variant ranked above it was not chosen."""
    forced = _forced()
    rows = []
    for name, family in FAMILIES.items():
        variant, why = _pick(family, forced.get(name), tuned_preference(name))
        passed = []
        for better in family.variants:
            if better is variant:
                break
            lacking = isa.missing(better.requires)
            passed.append(f"{better.name}: lacks {lacking}" if lacking else
                          f"{better.name}: {'not forced' if name in forced else 'slower here (tuned)'}")
        rows.append({"family": name, "chosen": variant.name, "why": why, "passed_over": passed,
                     "summary": variant.summary, "available": available(name)})
    return rows
