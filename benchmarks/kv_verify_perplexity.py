"""Perplexity of teacher-forced verify steps over a paged KV cache: what rounding the P.V weights to 8 bits costs.

Each window's first half is one prefill step; its second half is fed ``--step`` tokens at a time, as a speculative
verify step feeds its drafts, through the decode kernels over the cache. The loss is counted on the second half.
SmolLM2-135M has 9 query heads over 3 kv heads, so a step of 3 tokens gives the int8 decode kernel 9 query rows
per kv head, where its P.V runs in int8 dot products (``kv_pv``, from 8 rows); ``kv_pv=float`` forces the float
P.V over the same int8 pages. bf16 pages are the baseline.

Usage::

    python benchmarks/kv_verify_perplexity.py [--model GGUF] [--ctx 256] [--chunks 20] [--step 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os

import torch

from tessera.backends.cpu import variants
from tessera.bench.machine import fingerprint
from tessera.eval.corpus import corpus_text
from tessera.eval.perplexity import cut_windows
from tessera.models.load import load_model
from tessera.models.paged import StepBatch, forward_step, new_cache

#: (label, KV cache dtype, TESSERA_CPU_VARIANTS)
RUNS = (("bf16 pages", None, ""), ("int8 pages, float P.V", "int8", "kv_pv=float"),
        ("int8 pages, int8 P.V", "int8", ""))


@torch.no_grad()
def window_nll(model, cache, window: torch.Tensor, step: int, page_size: int) -> tuple[float, int]:
    """Summed negative log-likelihood of the window's second half, and how many tokens it counts."""
    ctx = window.numel()
    half = ctx // 2
    table = torch.arange(cache.num_pages, dtype=torch.int32).view(1, -1)

    def slots(a: int, b: int) -> torch.Tensor:
        pos = torch.arange(a, b)
        return table[0, pos // page_size].long() * page_size + pos % page_size

    logits = [forward_step(model, cache, StepBatch(window[:half], [half], [half], table, slots(0, half)),
                           all_logits=True)[-1:]]
    for a in range(half, ctx - 1, step):
        b = min(a + step, ctx - 1)
        logits.append(forward_step(model, cache, StepBatch(window[a:b], [b - a], [b], table, slots(a, b)),
                                   all_logits=True, fused=False))
    # logits of positions half-1 .. ctx-2 predict tokens half .. ctx-1
    lp = torch.log_softmax(torch.cat(logits).double(), dim=-1)
    target = window[half:ctx]
    return float(-lp[torch.arange(target.numel()), target].sum()), int(target.numel())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ctx", type=int, default=256)
    parser.add_argument("--chunks", type=int, default=20)
    parser.add_argument("--step", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    model = load_model(args.model, dtype=args.dtype)
    windows = cut_windows(model, corpus_text("pydoc"), ctx=args.ctx, max_chunks=args.chunks).ids
    page_size = 16
    rows = []
    for label, kv, forced in RUNS:
        os.environ["TESSERA_CPU_VARIANTS"] = forced
        variants.reset()
        cache = new_cache(model, math.ceil(args.ctx / page_size), page_size, kv)
        nll, n = 0.0, 0
        for w in windows:
            a, b = window_nll(model, cache, w, args.step, page_size)
            nll, n = nll + a, n + b
        rows.append({"run": label, "kv_cache_dtype": kv or args.dtype, "variants": forced, "ppl": math.exp(nll / n),
                     "tokens": n})
        print(f"{label:24s} PPL {rows[-1]['ppl']:.4f} over {n} tokens")
    base = rows[0]["ppl"]
    for r in rows:
        r["vs_bf16"] = r["ppl"] / base - 1
        print(f"{r['run']:24s} {100 * r['vs_bf16']:+.2f}% vs bf16 pages")
    if args.json:
        report = {"benchmark": "kv_verify_perplexity", "date": datetime.date.today().isoformat(),
                  "machine": fingerprint(), "model": str(args.model or "SmolLM2-135M-Instruct"), "dtype": args.dtype,
                  "ctx": args.ctx, "chunks": len(windows), "step": args.step, "results": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
