"""Compile the attention kernels for a GPU architecture without a GPU: PTX, SASS resources, shared memory.

Triton's wheel carries ptxas, so ``triton.compile`` can target ``sm_90`` on any machine. The test suite uses this to
prove the kernels (and generated mask/score helpers) compile for Hopper and fit its shared memory, which the
interpreter cannot show; kernel engineers use it to read the PTX of a variant::

    python -m tessera.backends.triton.aot --arch 90 --head-dim 128 --dtype bfloat16 --mask causal --ptx out.ptx

Must run with ``TRITON_INTERPRET`` unset (interpreted functions cannot be compiled).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from tessera.attention import AttentionSpec, causal, sliding_window, softcap
from tessera.backends.triton import codegen, prelude
from tessera.backends.triton.configs import LaunchConfig, default_configs

_TT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
HOPPER_SMEM_BYTES = 232_448  # per block, opt-in maximum on H100/H200


@dataclass
class CompiledInfo:
    kernel: str
    arch: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    shared_bytes: int
    registers: int  # per thread (-1 when cuobjdump is unavailable)
    spill_bytes: int  # local memory per thread: > 0 means register spills
    ptx_lines: int
    tensor_core_op: str  # "wgmma" (Hopper), "mma" (Ampere-style) or "" (none: the dots run on CUDA cores)


def compile_attention(spec: AttentionSpec, dtype: torch.dtype, cfg: LaunchConfig, heads: int, arch: int = 90,
                      ptx_path: str | None = None) -> CompiledInfo:
    """Compile ``attention_kernel`` for ``spec`` at one launch config for ``sm_<arch>``."""
    import triton
    from triton.backends.compiler import GPUTarget

    from tessera.backends.triton.kernels import attention_kernel

    variant = codegen.generate(spec)
    module = codegen.load(variant.source) if variant.source else None
    t = _TT[dtype]
    ptrs = {"Q": t, "K": t, "V": t, "KS": "fp16", "VS": "fp16", "OUT": t, "LSE": "fp32", "PART_OUT": "fp32", "PART_LSE": "fp32", "SINKS": "fp32",
            "ITEMS": "i32", "TILES": "i32", "ROW_BASE": "i32", "AUX_I": "i32", "AUX_F": "fp32"}
    signature = {name: "*" + ty for name, ty in ptrs.items()}
    for name in ("row_base_stride", "block_size", "stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt",
                 "stride_vh", "stride_st", "stride_ot", "stride_oh", "stride_lt"):
        signature[name] = "i32"
    signature["sm_scale"] = "fp32"
    d = spec.head_dim
    constexprs = {
        "MASK_FN": module.mask_fn if variant.has_mask else prelude.keep_all,
        "SCORE_FN": module.score_fn if variant.has_score else prelude.identity_score,
        "HAS_MASK": variant.has_mask, "HAS_SCORE": variant.has_score, "HAS_SINKS": spec.sinks is not None,
        "HEAD_DIM": d, "BLOCK_D": max(16, 1 << (d - 1).bit_length()), "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "HEADS": heads, "DOT_PRECISION": "ieee" if dtype == torch.float32 else "tf32", "DOT_UPCAST": False,
        "KV_QUANT": 0,
    }
    for name in constexprs:
        signature[name] = "constexpr"
    src = triton.compiler.ASTSource(fn=attention_kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ptx = compiled.asm["ptx"]
    if ptx_path:
        with open(ptx_path, "w") as f:
            f.write(ptx)
    registers, spills = _resource_usage(compiled.asm.get("cubin", b""))
    op = "wgmma" if "wgmma.mma_async" in ptx else ("mma" if "mma.sync" in ptx else "")
    return CompiledInfo("attention_kernel", arch, cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                        int(compiled.metadata.shared), registers, spills, ptx.count("\n"), op)


def _resource_usage(cubin: bytes) -> tuple[int, int]:
    """Registers and local (spill) bytes per thread, read with the cuobjdump that ships in Triton's wheel."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not cubin or not os.path.exists(tool):
        return -1, -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    reg, local = re.search(r"REG:(\d+)", text), re.search(r"LOCAL:(\d+)", text)
    return (int(reg.group(1)) if reg else -1), (int(local.group(1)) if local else -1)


def _spec_from_args(args: argparse.Namespace) -> AttentionSpec:
    mask = {"none": None, "causal": causal(), "window": sliding_window(4096)}[args.mask]
    return AttentionSpec(args.q_heads, args.kv_heads, args.head_dim, mask=mask,
                         score=softcap(50.0) if args.softcap else None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    p.add_argument("--mask", choices=["none", "causal", "window"], default="causal")
    p.add_argument("--softcap", action="store_true")
    p.add_argument("--phase", choices=["prefill", "decode"], default="prefill")
    p.add_argument("--ptx", help="write the PTX here")
    args = p.parse_args(argv)
    spec = _spec_from_args(args)
    configs = default_configs(args.head_dim, sms=132)
    cfg = configs.prefill if args.phase == "prefill" else configs.decode
    info = compile_attention(spec, getattr(torch, args.dtype), cfg, min(spec.group_size, cfg.block_m), args.arch,
                             args.ptx)
    json.dump(asdict(info), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
