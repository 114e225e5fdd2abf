"""One prepared run for a lent NVIDIA GPU: check the triton kernels, then time them against SDPA and flex_attention.

In one call (budget: under 8 minutes) it

1. measures the card's copy bandwidth (``torch`` copy of 2 GiB: read + write bytes over time),
2. checks correctness of every kernel path against the float64 reference on fresh random inputs: prefill, chunked
   prefill, decode with split-KV, verification, paged with shuffled pages and partial last pages, every mask and
   score family, sinks, GQA, in fp32 / bf16 / fp16,
3. times causal bf16 prefill (S = 1k..16k, D = 64 and 128, GQA 32/8; B * S = 16k tokens) in TFLOP/s, and paged
   decode (batch 1..64, lengths 1k..32k, page size 16, shuffled pages) in GB/s of KV read, against torch SDPA and
   compiled flex_attention on the same inputs (SDPA and flex read contiguous K/V: their best case). Times are
   ``triton.testing.do_bench`` medians,
4. runs the engine end to end on the card (``LLM(backend="triton", device="cuda")``, SmolLM2-135M-Instruct in
   bf16): time to first token of a 128-token prompt, batch-1 decode tok/s, and 32 requests x 128 new tokens with 8
   in flight (aggregate tok/s), so a lent GPU measures tokens, not only kernels,
5. writes everything to JSON (``$OUT/gpu-<date>.json`` or ``--json``) and prints tables.

``--smoke`` runs the same code on tiny shapes on the CPU under ``TRITON_INTERPRET=1`` (set automatically when no GPU
is present), with a perf_counter median instead of CUDA events, so the script is known to work before GPU time is
spent. The test suite runs it.

Usage::

    python benchmarks/gpu.py [--smoke] [--json PATH] [--no-flex] [--budget-s 420]
    python benchmarks/gpu.py --tune     # time candidate launch configs, print entries for configs.TUNED
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tolerance table lives with the tests: one table for both

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402

from tessera.attention import (  # noqa: E402
    AttentionSpec,
    alibi,
    alibi_slopes,
    causal,
    custom_mask,
    custom_score,
    document,
    plan,
    sliding_window,
    softcap,
)
from tessera.backends import RaggedBatch  # noqa: E402
from tessera.backends.reference import varlen_attention_f64  # noqa: E402
from tests.attention.tolerances import LSE_FLOOR, rel_err, tolerance  # noqa: E402

HQ, HKV, PAGE = 32, 8, 16


# ---- timing ---------------------------------------------------------------------------------------------------------

def bench(fn: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Median milliseconds: ``do_bench`` (CUDA events, cache flush) on a GPU, perf_counter medians otherwise."""
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, smoke: bool) -> float:
    """GB/s of a device-to-device copy (bytes read + bytes written), the practical HBM ceiling for decode."""
    n = (1 << 20) if smoke else (1 << 30)  # 2 GiB of float16 on a GPU
    src = torch.randn(n, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src), device, reps=5)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


# ---- inputs ---------------------------------------------------------------------------------------------------------

def paged_batch(q_lens: list[int], kv_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
                device: torch.device, page: int = PAGE, gen: torch.Generator | None = None):
    """Queries, a shuffled page pool (plus spare pages of noise) and its table, and the same K/V packed densely."""
    gen = gen or torch.Generator().manual_seed(0)
    pages = [math.ceil(k / page) for k in kv_lens]
    n = sum(pages) + 2
    k_pages = torch.randn(n, page, hkv, d, generator=gen).to(dtype).to(device)
    v_pages = torch.randn(n, page, hkv, d, generator=gen).to(dtype).to(device)
    order = torch.randperm(n, generator=gen).to(torch.int32)
    table = torch.zeros(len(kv_lens), max(max(pages), 1), dtype=torch.int32)
    used = 0
    for s, p in enumerate(pages):
        table[s, :p] = order[used : used + p]
        used += p
    q = torch.randn(sum(q_lens), hq, d, generator=gen).to(dtype).to(device)
    return q, k_pages, v_pages, table.to(device)


# ---- 2. correctness -------------------------------------------------------------------------------------------------

def _dilated(b, h, q_pos, kv_pos):
    return (kv_pos <= q_pos) & ((q_pos - kv_pos) % 3 != 1)


def _bias(score, b, h, q_pos, kv_pos):
    return score - 0.05 * (h + 1) * (q_pos - kv_pos).abs()


def correctness_cases(smoke: bool) -> list[dict]:
    """(name, spec builder, q_lens, kv_lens, dtype) covering every kernel path and variant family."""
    long = 300 if smoke else 3000
    mixed_q, mixed_kv = [37, 9, 1, 4, 1], [37, 70, long, 50, 1]
    decode_q, decode_kv = [1, 1, 3], [long, 17, long // 2 + 5]

    def doc(n):
        return document(torch.cumsum((torch.rand(n, generator=torch.Generator().manual_seed(1)) < 0.05).long(), 0))

    specs: list[tuple[str, Callable[[int, int, int], AttentionSpec]]] = [
        ("full", lambda hq, hkv, d: AttentionSpec(hq, hkv, d)),
        ("causal", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=causal())),
        ("window64", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=sliding_window(64))),
        ("document_causal", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=doc(long + 8) & causal())),
        ("custom_mask", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=custom_mask(_dilated))),
        ("softcap_causal", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=causal(), score=softcap(20.0))),
        ("alibi_causal", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=causal(), score=alibi(alibi_slopes(hq)))),
        ("custom_score", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=causal(), score=custom_score(_bias))),
        ("sinks_window", lambda hq, hkv, d: AttentionSpec(hq, hkv, d, mask=sliding_window(32),
                                                          sinks=torch.randn(hq) + 2.0)),
    ]
    cases = []
    for name, build in specs:
        cases.append({"name": f"{name}/mixed", "build": build, "q": mixed_q, "kv": mixed_kv, "dtype": torch.bfloat16})
        cases.append({"name": f"{name}/decode", "build": build, "q": decode_q, "kv": decode_kv, "dtype": torch.bfloat16})
    for dtype in (torch.float32, torch.float16):
        cases.append({"name": f"causal/mixed/{str(dtype)[6:]}", "build": specs[1][1], "q": mixed_q, "kv": mixed_kv,
                      "dtype": dtype})
    return cases


def oracle(spec, q, k_pages, v_pages, table, q_lens, kv_lens):
    """The float64 reference on the same (upcast) values, with each sequence's pages gathered densely."""
    ks, vs = [], []
    for s, kl in enumerate(kv_lens):
        pages = table[s, : math.ceil(kl / PAGE)].long()
        ks.append(k_pages[pages].reshape(-1, *k_pages.shape[2:])[:kl])
        vs.append(v_pages[pages].reshape(-1, *v_pages.shape[2:])[:kl])
    return varlen_attention_f64(q.double(), torch.cat(ks).double(), torch.cat(vs).double(),
                                RaggedBatch(tuple(q_lens), tuple(kv_lens)), spec)


def check_correctness(device: torch.device, smoke: bool) -> list[dict]:
    results = []
    shapes = [(4, 2, 64)] if smoke else [(32, 8, 128), (8, 1, 64), (6, 2, 80)]
    for hq, hkv, d in shapes:
        for case in correctness_cases(smoke):
            spec = case["build"](hq, hkv, d)
            q, kp, vp, table = paged_batch(case["q"], case["kv"], hq, hkv, d, case["dtype"], device,
                                           gen=torch.Generator().manual_seed(len(results)))
            out, lse = plan(spec, case["q"], case["kv"], table, PAGE, backend="triton").run(q, kp, vp, return_lse=True)
            ref, ref_lse = oracle(spec, q, kp, vp, table, case["q"], case["kv"])
            finite = torch.isfinite(ref_lse)
            err_out = rel_err(out.float(), ref.float())
            err_lse = rel_err(lse[finite], ref_lse[finite], LSE_FLOOR)
            ok = (err_out <= tolerance(case["dtype"]) and err_lse <= tolerance(case["dtype"])
                  and bool(torch.equal(torch.isinf(lse), torch.isinf(ref_lse))) and not bool(out.isnan().any()))
            results.append({"case": case["name"], "heads": f"{hq}/{hkv}", "head_dim": d, "dtype": str(case["dtype"]),
                            "err_out": err_out, "err_lse": err_lse, "ok": ok})
    return results


# ---- 3. timings ----------------------------------------------------------------------------------------------------

def _flex():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention, dynamic=False), create_block_mask


def time_prefill(device: torch.device, smoke: bool, use_flex: bool, deadline: float, reps: int) -> list[dict]:
    rows = []
    dims = [64] if smoke else [64, 128]
    lengths = [64, 128] if smoke else [1024, 2048, 4096, 8192, 16384]
    hq, hkv = (4, 2) if smoke else (HQ, HKV)
    tokens = 256 if smoke else 16384
    flex, block_mask_of = _flex() if use_flex else (None, None)
    for d in dims:
        for s in lengths:
            b = max(1, tokens // s)
            spec = AttentionSpec(hq, hkv, d, mask=causal())
            q, kp, vp, table = paged_batch([s] * b, [s] * b, hq, hkv, d, torch.bfloat16, device, page=s)
            p = plan(spec, [s] * b, [s] * b, table, s, backend="triton")
            flops = 4 * b * hq * d * s * (s + 1) / 2
            row: dict[str, Any] = {"batch": b, "seq": s, "head_dim": d, "flops": flops}
            row["tessera_ms"] = bench(lambda: p.run(q, kp, vp), device, reps)
            # SDPA / flex on the same values, laid out [B, H, S, D] (contiguous K/V: their best case)
            qd = q.view(b, s, hq, d).transpose(1, 2)
            kd = kp[table[:, 0].long()].transpose(1, 2)
            vd = vp[table[:, 0].long()].transpose(1, 2)
            row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True),
                                   device, reps)
            if flex is not None and time.monotonic() < deadline:
                bm = block_mask_of(lambda b_, h_, qi, ki: ki <= qi, None, None, s, s, device=str(device))
                flex(qd, kd, vd, block_mask=bm, enable_gqa=True)  # compile outside the timing
                row["flex_ms"] = bench(lambda: flex(qd, kd, vd, block_mask=bm, enable_gqa=True), device, reps)
            for key in ("tessera", "sdpa", "flex"):
                if f"{key}_ms" in row:
                    row[f"{key}_tflops"] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
            rows.append(row)
    return rows


def time_decode(device: torch.device, smoke: bool, use_flex: bool, deadline: float, reps: int,
                copy_gbs: float) -> list[dict]:
    rows = []
    batches = [1, 2] if smoke else [1, 8, 32, 64]
    lengths = [100, 300] if smoke else [1024, 4096, 8192, 16384, 32768]
    hq, hkv, d = (4, 2, 64) if smoke else (HQ, HKV, 128)
    flex, _ = _flex() if use_flex else (None, None)
    for b in batches:
        for length in lengths:
            spec = AttentionSpec(hq, hkv, d)
            q, kp, vp, table = paged_batch([1] * b, [length] * b, hq, hkv, d, torch.bfloat16, device)
            p = plan(spec, [1] * b, [length] * b, table, PAGE, backend="triton")
            kv_bytes = 2 * b * length * hkv * d * 2
            row: dict[str, Any] = {"batch": b, "kv_len": length, "kv_bytes": kv_bytes}
            row["tessera_ms"] = bench(lambda: p.run(q, kp, vp), device, reps)
            pages = math.ceil(length / PAGE)
            kd = kp[table[:, :pages].long()].reshape(b, -1, hkv, d)[:, :length].transpose(1, 2).contiguous()
            vd = vp[table[:, :pages].long()].reshape(b, -1, hkv, d)[:, :length].transpose(1, 2).contiguous()
            qd = q.view(b, 1, hq, d).transpose(1, 2)
            row["sdpa_ms"] = bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True), device, reps)
            if flex is not None and time.monotonic() < deadline:
                flex(qd, kd, vd, enable_gqa=True)
                row["flex_ms"] = bench(lambda: flex(qd, kd, vd, enable_gqa=True), device, reps)
            for key in ("tessera", "sdpa", "flex"):
                if f"{key}_ms" in row:
                    row[f"{key}_gbs"] = kv_bytes / (row[f"{key}_ms"] * 1e-3) / 1e9
            row["tessera_frac_of_copy"] = row["tessera_gbs"] / copy_gbs
            rows.append(row)
    return rows


# ---- optional: tuning ------------------------------------------------------------------------------------------------

def tune(device: torch.device, smoke: bool, reps: int) -> list[dict]:
    """Time candidate launch configs (causal bf16 prefill at S=8k, paged decode B=32 at 8k) and print TUNED entries."""
    from tessera.backends.triton import configs as C

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    prefill_candidates = [C.LaunchConfig(m, n, w, st) for m, n, w, st in
                          [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 64, 4, 3), (128, 32, 8, 4)]]
    decode_candidates = [C.LaunchConfig(16, n, w, st) for n, w, st in [(64, 4, 3), (128, 4, 2), (32, 4, 4), (64, 8, 3)]]
    if smoke:
        prefill_candidates, decode_candidates = prefill_candidates[:2], decode_candidates[:2]
    results = []
    for d in ([64] if smoke else [64, 128]):
        s_len, b_len = (64, 300) if smoke else (8192, 8192)
        hq, hkv = (4, 2) if smoke else (HQ, HKV)
        base = C.default_configs(d, sms)
        best: dict[str, tuple[float, object]] = {}
        for phase, candidates in (("prefill", prefill_candidates), ("decode", decode_candidates)):
            for cand in candidates:
                cfg = C.Configs(cand if phase == "prefill" else base.prefill, cand if phase == "decode" else base.decode,
                                base.target_programs, base.min_tiles_per_split)
                C.TUNED[(name, d)] = cfg
                try:
                    if phase == "prefill":
                        spec = AttentionSpec(hq, hkv, d, mask=causal())
                        q, kp, vp, table = paged_batch([s_len], [s_len], hq, hkv, d, torch.bfloat16, device, page=s_len)
                        p = plan(spec, [s_len], [s_len], table, s_len, backend="triton")
                    else:
                        batch = 2 if smoke else 32
                        spec = AttentionSpec(hq, hkv, d)
                        q, kp, vp, table = paged_batch([1] * batch, [b_len] * batch, hq, hkv, d, torch.bfloat16, device)
                        p = plan(spec, [1] * batch, [b_len] * batch, table, PAGE, backend="triton")
                    ms = bench(lambda: p.run(q, kp, vp), device, reps)
                except Exception as exc:  # a config that does not compile or fit is simply not a candidate
                    ms = float("inf")
                    print(f"  {phase} D={d} {cand}: failed ({type(exc).__name__}: {exc})")
                results.append({"phase": phase, "head_dim": d, "config": str(cand), "ms": ms})
                if ms < best.get(phase, (float("inf"), None))[0]:
                    best[phase] = (ms, cand)
        C.TUNED.pop((name, d), None)
        if len(best) == 2:
            print(f"TUNED[({name!r}, {d})] = Configs(prefill={best['prefill'][1]}, decode={best['decode'][1]}, "
                  f"target_programs={base.target_programs}, min_tiles_per_split={base.min_tiles_per_split})")
    return results


# ---- 4. report ------------------------------------------------------------------------------------------------------

def time_engine(device: torch.device, smoke: bool) -> dict:
    """Tokens through the whole engine: TTFT, batch-1 decode and 32-request throughput (``--smoke``: a tiny random
    Llama, two requests of a few tokens, under the interpreter)."""
    import tempfile

    from tessera.engine import LLM, SamplingParams

    if smoke:
        import transformers

        from tests.models.helpers import save_tiny

        path = Path(tempfile.mkdtemp(prefix="gpu-smoke-llama-"))
        save_tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig(
            vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128), path)
        model, prompt_len, new, requests, in_flight = str(path), 12, 4, 2, 2
    else:
        model, prompt_len, new, requests, in_flight = None, 128, 128, 32, 8  # None: the default SmolLM2 GGUF
    llm = LLM(model, dtype="bfloat16", backend="triton", device=device, max_num_seqs=in_flight)
    vocab = llm.model.config.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prompt() -> list[int]:
        return torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()

    greedy = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    llm.generate([prompt()], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # compile kernels
    one = llm.generate([prompt()], greedy)[0]
    decode_s = one.latency - one.time_to_first_token
    t0 = time.perf_counter()
    outs = llm.generate([prompt() for _ in range(requests)], greedy)
    wall = time.perf_counter() - t0
    row = {
        "model": "tiny random llama" if smoke else "SmolLM2-135M-Instruct (default GGUF)", "dtype": "bfloat16",
        "prompt_tokens": prompt_len, "ttft_ms": one.time_to_first_token * 1e3,
        "decode_tok_s": (len(one.token_ids) - 1) / decode_s if decode_s > 0 else float("nan"),
        "requests": requests, "in_flight": in_flight, "new_tokens": new,
        "throughput_tok_s": sum(len(o.token_ids) for o in outs) / wall,
    }
    print(f"engine ({row['model']}): TTFT {row['ttft_ms']:.1f} ms, decode {row['decode_tok_s']:.1f} tok/s, "
          f"{requests} x {new} tokens with {in_flight} in flight {row['throughput_tok_s']:.0f} tok/s")
    return row


def _print_table(title: str, rows: list[dict], cols: list[str]) -> None:
    print(f"\n{title}")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r.get(c, float('nan')):>14.4g}" if isinstance(r.get(c), float) else f"{str(r.get(c, '-')):>14}"
                        for c in cols))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Triton backend: correctness and speed on one GPU")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes; runs on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--json", help="output path (default: $OUT/gpu-<date>.json, else benchmarks/results/)")
    ap.add_argument("--no-flex", action="store_true", help="skip flex_attention (its compiles take time)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting flex comparisons after this")
    ap.add_argument("--tune", action="store_true", help="only time candidate launch configs and print TUNED entries")
    args = ap.parse_args(argv)

    start = time.monotonic()
    deadline = start + args.budget_s
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.smoke:
        ap.error("no CUDA device: run with --smoke (tiny shapes through the Triton interpreter)")
    import triton

    reps = 3 if args.smoke else 0
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (TRITON_INTERPRET=1)",
        "torch": torch.__version__, "triton": triton.__version__, "smoke": args.smoke,
    }
    if args.tune:
        report["tuning"] = tune(device, args.smoke, reps)
        args.json = args.json or str((Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" /
                                      "results") / f"gpu-tune-{report['date']}.json")
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        return 0
    report["copy_gbs"] = copy_bandwidth(device, args.smoke)
    print(f"{report['device']}: copy bandwidth {report['copy_gbs']:.0f} GB/s")

    report["correctness"] = check_correctness(device, args.smoke)
    bad = [r for r in report["correctness"] if not r["ok"]]
    print(f"correctness: {len(report['correctness']) - len(bad)}/{len(report['correctness'])} cases within tolerance")
    for r in bad:
        print(f"  FAILED {r}")

    use_flex = not args.no_flex
    report["prefill"] = time_prefill(device, args.smoke, use_flex, deadline, reps)
    _print_table("causal bf16 prefill (TFLOP/s)", report["prefill"],
                 ["batch", "seq", "head_dim", "tessera_tflops", "sdpa_tflops", "flex_tflops"])
    report["decode"] = time_decode(device, args.smoke, use_flex, deadline, reps, report["copy_gbs"])
    _print_table("paged bf16 decode (GB/s of KV)", report["decode"],
                 ["batch", "kv_len", "tessera_gbs", "sdpa_gbs", "flex_gbs", "tessera_frac_of_copy"])

    try:  # the kernels' numbers above must land even if the engine run fails
        report["engine"] = time_engine(device, args.smoke)
    except Exception as err:  # noqa: BLE001
        report["engine"] = {"error": f"{type(err).__name__}: {err}"}
        print(f"engine run failed: {report['engine']['error']}")

    targets = {}
    pre = [r for r in report["prefill"] if r["seq"] == 8192 and r["head_dim"] == 128]
    if pre:
        targets["prefill_8k_d128_tflops"] = {"value": pre[0]["tessera_tflops"], "target": 350.0}
    dec = [r for r in report["decode"] if r["batch"] == 32 and r["kv_len"] == 8192]
    if dec:
        targets["decode_b32_8k_frac_of_copy"] = {"value": dec[0]["tessera_frac_of_copy"], "target": 0.75}
    report["targets"] = targets
    report["elapsed_s"] = time.monotonic() - start

    out = args.json
    if out is None:
        folder = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benchmarks" / "results"
        out = str(folder / f"gpu{'-smoke' if args.smoke else ''}-{report['date']}.json")
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(f"\ntargets: {json.dumps(targets)}\nwrote {out} in {report['elapsed_s']:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
