"""Which attention lowering each IREE target gets.

IREE's pipelines differ in what they accept. The llvm-cpu pipeline compiles the hand-scheduled loop kernel
(:mod:`tessera.mlir.attention_kernel`: one dispatch, a sequential tile loop per work item over the plan's kv tiles),
which is what the ``mlir`` backend runs. The GPU pipelines (cuda, rocm, vulkan-spirv) distribute linalg ops to threads
themselves and refuse a dispatch that is already a loop nest, so they get the linalg-on-tensors form of the same spec
(:mod:`tessera.mlir.attention_linalg`). Adding a target is one entry here and one in
:data:`tessera.mlir.iree_compile.TARGETS` (its iree-compile flags).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessera.attention.spec import AttentionSpec


@dataclass(frozen=True)
class Target:
    """One IREE target as the MLIR path sees it.

    Parameters
    ----------
    name : str
        The key of :data:`tessera.mlir.iree_compile.TARGETS` (its iree-compile flags).
    attention : str
        ``"loop"`` (:func:`tessera.mlir.attention_kernel.lower_attention`) or ``"linalg"``
        (:func:`tessera.mlir.attention_linalg.lower_attention_linalg`).
    runs_here : bool
        Whether this machine can run the binaries (else the target is a compile-only check).
    """

    name: str
    attention: str
    runs_here: bool


TARGETS: dict[str, Target] = {
    "llvm-cpu": Target("llvm-cpu", "loop", True),
    "cuda": Target("cuda", "linalg", False),
    "rocm": Target("rocm", "linalg", False),
    "vulkan-spirv": Target("vulkan-spirv", "linalg", False),
}
ATTENTION_LOWERINGS = ("loop", "linalg")


def target(name: str) -> Target:
    """The descriptor of IREE target ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown IREE target {name!r}; choose one of {sorted(TARGETS)}") from None


#: the keyword options each lowering takes (``kv_tile``: keys per kv tile in both; None = all keys at once in linalg)
OPTIONS = {"loop": ("key_layout", "kv_element", "rows", "kv_tile"), "linalg": ("kv_tile",)}


def lower_attention_for(spec: AttentionSpec, name: str, lowering: str | None = None, **options):
    """The attention kernel of ``spec`` in the form target ``name`` compiles.

    ``lowering`` overrides the target's choice (``"linalg"`` on llvm-cpu is how the GPU form is checked against the
    float64 oracle on a machine without a GPU). ``options`` go to the lowering (:data:`OPTIONS`). Raises
    :class:`~tessera.mlir.trace.UntranslatableError` when the mask or score cannot be translated.
    """
    lowering = target(name).attention if lowering is None else lowering
    if lowering not in ATTENTION_LOWERINGS:
        raise ValueError(f"lowering must be one of {ATTENTION_LOWERINGS}, got {lowering!r}")
    unknown = sorted(set(options) - set(OPTIONS[lowering]))
    if unknown:
        raise ValueError(f"the {lowering} lowering takes the options {OPTIONS[lowering]}, not {unknown}")
    if lowering == "loop":
        from tessera.mlir.attention_kernel import lower_attention

        return lower_attention(spec, **options)
    from tessera.mlir.attention_linalg import lower_attention_linalg

    return lower_attention_linalg(spec, **options)
