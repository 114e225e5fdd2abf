"""A GGUF model's resident memory against its file size: what ``load_model`` and a few forward passes add to the
process.

The kernels' compiled code belongs to the process, not to the model, so the script first runs ``--warm-with`` (a
small model of the same kind: same family and packed formats) through two forward passes; then it reads the
resident set (``VmRSS``), loads ``--model``, runs two forward passes over four tokens (so every weight page the
decode reads is resident), and reads it again. The CPU model and the date head the output.

Usage::

    python benchmarks/gguf_memory.py --model llama1b-q4_k.gguf --warm-with smollm2-q4_k.gguf
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
from pathlib import Path


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmRSS"))
    return int(line.split()[1]) / 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="the .gguf file to measure")
    ap.add_argument("--warm-with", type=Path, help="a small .gguf of the same kind, run first (default: --model)")
    args = ap.parse_args(argv)

    import torch

    from tessera.hw.probes import cpu_model, num_cores
    from tessera.models.load import load_model

    ids = torch.tensor([[1, 2, 3, 4]])
    print(f"{dt.date.today()}  {cpu_model()}, {num_cores()} cores")
    warm = load_model(args.warm_with or args.model)
    with torch.no_grad():
        warm.logits(ids), warm.logits(ids)
    del warm
    gc.collect()
    before = resident_mib()
    model = load_model(args.model)
    loaded = resident_mib()
    with torch.no_grad():
        model.logits(ids), model.logits(ids)
    after = resident_mib()
    size = args.model.stat().st_size / 2 ** 20
    print(f"{args.model} ({size:.0f} MiB): resident {before:.0f} MiB before, {loaded:.0f} after load_model, "
          f"{after:.0f} after two forward passes")
    print(f"the model holds {after - before:.0f} MiB = {(after - before) / size:.2f}x its file")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
