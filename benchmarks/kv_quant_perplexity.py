"""Perplexity of one model with each KV cache format: float pages in the model's dtype, int8 and fp8 e4m3 pages.

Every window runs through a paged cache (``perplexity(kv_cache_dtype=)``, ``tessera.eval.cache_logits``), by
llama-perplexity's protocol, on the pydoc corpus. Both model dtypes are run: float32 (fp32 pages) and bfloat16
(bf16 pages, the baseline a quantized cache halves), with the same weights (the GGUF file's, packed as loaded by
default).

Usage::

    python benchmarks/kv_quant_perplexity.py [--model GGUF] [--ctx 512] [--chunks 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

from rich.console import Console
from rich.table import Table

from tessera.bench.machine import fingerprint
from tessera.eval.corpus import corpus_text
from tessera.eval.perplexity import perplexity
from tessera.models.load import load_model
from tessera.models.model import default_model_path

KV_FORMATS = (None, "int8", "fp8_e4m3")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=50)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    text = corpus_text("pydoc")
    rows = []
    for dtype in args.dtypes:
        model = load_model(args.model, dtype=dtype)
        base = None
        for kv in KV_FORMATS:
            start = time.perf_counter()
            r = perplexity(model, text, ctx=args.ctx, max_chunks=args.chunks, kv_cache_dtype=kv)
            base = r.ppl if kv is None else base
            rows.append({"model_dtype": dtype, "kv_format": kv or dtype, "ppl": r.ppl, "stderr": r.stderr,
                         "vs_float_kv": r.ppl / base - 1.0, "n_scored": r.n_scored,
                         "seconds": time.perf_counter() - start})
            print(rows[-1], flush=True)
    table = Table(title=f"perplexity by KV format, pydoc, ctx {args.ctx}, {args.chunks} windows")
    for col in ("model dtype", "KV pages", "PPL", "+/-", "vs float pages"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model_dtype"], r["kv_format"], f"{r['ppl']:.4f}", f"{r['stderr']:.4f}",
                      f"{100 * r['vs_float_kv']:+.2f}%")
    Console().print(table)
    if args.json:
        report = {"benchmark": "kv_quant_perplexity", "date": datetime.date.today().isoformat(),
                  "model": str(args.model or default_model_path()), "ctx": args.ctx, "chunks": args.chunks,
                  "corpus": "pydoc", "machine": fingerprint(), "results": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
