"""The mlir backend's kernel-op modules on an NVIDIA GPU through IREE's CUDA runtime, against torch on the same card.

Two halves, because the IREE compiler wheel is too large to travel to a lent GPU machine while the runtime is not:

    python benchmarks/mlir_gpu.py --compile DIR     # here: op_kernels.py modules -> DIR/<op>.vmfb (cuda, sm_80 PTX)
    python benchmarks/mlir_gpu.py --run DIR         # on the GPU machine (iree-base-runtime + torch): check and time

``--run`` checks each op against torch on fresh random inputs (float32, odd sizes), times both (median of CUDA-synced
wall times; IREE's calls include its host round trip), and writes ``$OUT/mlir-gpu-<date>.json`` (or ``--json``).
The attention kernel is not part of it: its dispatch does not compile for GPU targets yet (docs/mlir.md).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import time
from pathlib import Path

MODULES = {  # name -> (op_kernels function, its arguments, entry point)
    "rms_norm": ("rms_norm", (), "rms_norm"),
    "silu_and_mul": ("gated_activation", ("silu",), "gated"),
    "matmul": ("matmul", (False,), "matmul"),
    "rope": ("rope", (False,), "rope"),
    "embed": ("embed", (), "embed"),
}


def compile_all(folder: Path) -> None:
    from tessera.mlir import iree_compile, op_kernels

    folder.mkdir(parents=True, exist_ok=True)
    for name, (fn, fn_args, _) in MODULES.items():
        binary = iree_compile.compile_module(getattr(op_kernels, fn)(*fn_args), "cuda")
        (folder / f"{name}.vmfb").write_bytes(binary)
        print(f"{name}: {len(binary)} bytes")


def _median_ms(fn, reps: int = 20) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_all(folder: Path, out: str | None) -> None:
    import iree.runtime as rt
    import numpy as np
    import torch

    config = rt.Config("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []

    def load(name: str):
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, (folder / f"{name}.vmfb").read_bytes()))
        return ctx.modules.module[MODULES[name][2]]

    def dev(x: torch.Tensor):
        return rt.asdevicearray(config.device, x.numpy())

    n, h, k_dim, out_dim, inter = 257, 4096, 4096, 4096, 11008
    cases = {}
    x = torch.randn(n, h, generator=gen)
    w = torch.randn(h, generator=gen)
    cases["rms_norm"] = ((dev(x), dev(w), 1e-5, 0.0),
                         lambda xc, wc: xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5) * wc, (x, w))
    gu = torch.randn(n, 2 * inter, generator=gen)
    cases["silu_and_mul"] = ((dev(gu),), lambda g: torch.nn.functional.silu(g[:, :inter]) * g[:, inter:], (gu,))
    a, b = torch.randn(n, k_dim, generator=gen), torch.randn(out_dim, k_dim, generator=gen) / 64
    cases["matmul"] = ((dev(a), dev(b), 1.0), lambda p, q: p @ q.T, (a, b))
    q, ang = torch.randn(n, 32, 128, generator=gen), torch.randn(n, 64, generator=gen)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()

    def rope_ref(qc, c, s):
        o = qc.clone()
        x1, x2 = qc[..., :64], qc[..., 64:]
        o[..., :64] = x1 * c[:, None] - x2 * s[:, None]
        o[..., 64:] = x2 * c[:, None] + x1 * s[:, None]
        return o
    cases["rope"] = ((dev(q), dev(cos), dev(sin)), rope_ref, (q, cos, sin))
    table, ids = torch.randn(32000, h, generator=gen), torch.randint(0, 32000, (n,), generator=gen)
    cases["embed"] = ((dev(ids), dev(table), 1.0), lambda i, t: t[i], (ids, table))

    for name, (iree_args, reference, torch_args) in cases.items():
        fn = load(name)
        got = torch.from_numpy(np.asarray(fn(*iree_args).to_host()))
        on_gpu = [t.cuda() for t in torch_args]
        want = reference(*on_gpu).cpu()
        err = float((got - want).abs().max() / max(float(want.abs().max()), 1e-6))
        iree_ms = _median_ms(lambda: fn(*iree_args))
        torch_ms = _median_ms(lambda: reference(*on_gpu))
        rows.append({"op": name, "rel_err": err, "ok": err < 1e-4, "iree_ms": iree_ms, "torch_ms": torch_ms,
                     "ratio_iree_over_torch": iree_ms / torch_ms})
        print(f"{name:14s} rel err {err:.2e}  iree {iree_ms:8.3f} ms  torch {torch_ms:8.3f} ms")
    report = {"date": dt.date.today().isoformat(), "card": torch.cuda.get_device_name(0), "target": "cuda sm_80 PTX",
              "iree_runtime": rt.__version__ if hasattr(rt, "__version__") else "3.13.0", "rows": rows}
    path = out or str(Path(os.environ.get("OUT", ".")) / f"mlir-gpu-{report['date']}.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print("wrote", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = ap.add_mutually_exclusive_group(required=True)
    group.add_argument("--compile", metavar="DIR")
    group.add_argument("--run", metavar="DIR")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.compile:
        compile_all(Path(args.compile))
    else:
        run_all(Path(args.run), args.json)


if __name__ == "__main__":
    main()
