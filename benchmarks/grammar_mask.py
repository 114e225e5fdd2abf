"""Grammar engines for structured output, compared on SmolLM2's 49k vocabulary; and the mask's share of a decode step.

Part 1 (``--engines``): llguidance, xgrammar and outlines-core each build their tokenizer state from the same token
bytes (``tessera.engine.structured.vocab.token_bytes``), compile one JSON schema (nested objects, an array, an
enum, bounded numbers, optional fields) and then follow a valid document of that schema token by token: at each
token, the time to compute the allowed-token bitmask and to advance past the token. Reported per engine: tokenizer
setup, schema compile, and mask time per token (median, p90, mean) over ``--repeat`` passes.

Part 2 (``--parts share``): 8 requests on SmolLM2 (Q4_1 packed, the default engine), all constrained by the schema,
greedy, stepped one ``LLM.step`` at a time; the steps in which all 8 decode together (each has its first token, none
has finished) are timed, and the engine's counters (``Runner.structured.timers``) give the mask's parts in the same
steps: computing the bitmasks (on a worker, during the forward), waiting for them after the forward, setting the
banned logits to -inf, moving the grammars on. The share on the step's critical path is (wait + apply + advance) /
step time; the share had the masks not been overlapped, (compute + apply + advance) / step time. The same batch
unconstrained (``ignore_eos``) gives the step time without masks over as many steps, and the constrained batch again
with the masks filled after the forward (``StructuredDecoder.overlap = False``). ``--rounds`` alternates the modes
and keeps each one's least disturbed round.

Usage::

    .venv/bin/python benchmarks/grammar_mask.py                     # both parts (~4 minutes), JSON to results/
    .venv/bin/python benchmarks/grammar_mask.py --parts engines --repeat 3

xgrammar and outlines-core are not dependencies of Tessera; part 1 skips an engine that is not installed
(``pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2 outlines-core==0.2.14``; ``--no-deps``
because xgrammar requires torch, transformers and triton, which must not be replaced).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from tessera.engine.structured.vocab import TokenBytes, token_bytes
from tessera.models.gguf import open_reader, read_metadata
from tessera.models.gguf_tokenizer import build_tokenizer
from tessera.models.model import default_model_path

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
DOCUMENT = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "role": "editor", "score": 0.75,
            "tags": ["math", "engines", "poetry"],
            "address": {"street": "12 St James's Square", "city": "London", "zip": "01234"}}
PROMPT = ("<|im_start|>user\nDescribe a fictional person as JSON with name, age, email, role, score, tags and "
          "address.<|im_end|>\n<|im_start|>assistant\n")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    return next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")),
                "unknown")


def summary(seconds: list[float], per_pass: int) -> dict[str, Any]:
    """Median / p90 / mean over every pass, and the mean of the first pass alone (lazy construction shows there)."""
    us = sorted(s * 1e6 for s in seconds)
    return {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))],
            "mean_us": statistics.fmean(us), "first_pass_mean_us": statistics.fmean(seconds[:per_pass]) * 1e6,
            "tokens": len(us)}


# ------------------------------------------------------------------------------------------------ engines
def bench_llguidance(tb: TokenBytes, eos: int, doc_ids: list[int], repeat: int, encode: Any) -> dict[str, Any]:
    import llguidance
    import llguidance.torch as llt

    from tessera.engine.structured.compiler import JSON_OPTIONS, build_ll_tokenizer

    t0 = time.perf_counter()
    tokenizer = build_ll_tokenizer(tb, [eos], encode)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=JSON_OPTIONS)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - t0
    assert not matcher.is_error(), matcher.get_error()
    mask = llt.allocate_token_bitmask(1, len(tb.tokens))
    times = []
    for _ in range(repeat):
        matcher = llguidance.LLMatcher(tokenizer, grammar)
        for t in doc_ids:
            start = time.perf_counter()
            llt.fill_next_token_bitmask(matcher, mask)
            ok = matcher.consume_token(t)
            times.append(time.perf_counter() - start)
            assert ok and bool((mask[0, t // 32] >> (t % 32)) & 1), f"llguidance refused token {t}"
        assert matcher.is_accepting()
    return {"version": _version("llguidance"), "tokenizer_setup_s": setup, "schema_compile_s": compile_s,
            "mask_and_advance": summary(times, len(doc_ids))}


def bench_xgrammar(tb: TokenBytes, eos: int, doc_ids: list[int], repeat: int, encode: Any) -> dict[str, Any]:
    import xgrammar

    t0 = time.perf_counter()
    info = xgrammar.TokenizerInfo(tb.tokens, xgrammar.VocabType.RAW, vocab_size=len(tb.tokens),
                                  stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - t0
    mask = xgrammar.allocate_token_bitmask(1, len(tb.tokens))
    times = []
    for _ in range(repeat):
        matcher = xgrammar.GrammarMatcher(compiled)
        for t in doc_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(mask)
            ok = matcher.accept_token(t)
            times.append(time.perf_counter() - start)
            assert ok, f"xgrammar refused token {t}"
    return {"version": _version("xgrammar"), "tokenizer_setup_s": setup, "schema_compile_s": compile_s,
            "mask_and_advance": summary(times, len(doc_ids))}


def bench_outlines(tb: TokenBytes, eos: int, doc_ids: list[int], repeat: int, encode: Any) -> dict[str, Any]:
    import outlines_core

    t0 = time.perf_counter()
    mapping: dict[bytes, list[int]] = {}
    for i, b in enumerate(tb.tokens):
        if b and i != eos:
            mapping.setdefault(b, []).append(i)
    vocabulary = outlines_core.Vocabulary(eos, mapping)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    index = outlines_core.Index(regex, vocabulary)
    compile_s = time.perf_counter() - t0
    mask = torch.zeros((len(tb.tokens) + 31) // 32, dtype=torch.int32)
    times = []
    for _ in range(repeat):
        guide = outlines_core.Guide(index)
        for t in doc_ids:
            start = time.perf_counter()
            guide.write_mask_into(mask.data_ptr(), mask.numel(), 4)
            guide.advance(t)
            times.append(time.perf_counter() - start)
    return {"version": _version("outlines_core"), "tokenizer_setup_s": setup, "schema_compile_s": compile_s,
            "mask_and_advance": summary(times, len(doc_ids)), "note": "regular expressions only (a JSON schema becomes one); "
                                                         "no context-free grammars"}


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package.replace("_", "-"))


def engines(repeat: int) -> dict[str, Any]:
    tokenizer = build_tokenizer(read_metadata(open_reader(default_model_path())))
    tb = token_bytes(tokenizer)
    eos = 2
    doc_ids = tokenizer.encode(json.dumps(DOCUMENT, separators=(",", ":")), add_special_tokens=False).ids
    out: dict[str, Any] = {"vocab_size": len(tb.tokens), "document_tokens": len(doc_ids)}
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar),
                     ("outlines_core", bench_outlines)):
        try:
            out[name] = fn(tb, eos, doc_ids, repeat, lambda text: tokenizer.encode(text, add_special_tokens=False).ids)
        except ImportError as err:
            out[name] = {"skipped": f"not installed ({err})"}
        r = out[name]
        if "mask_and_advance" in r:
            m = r["mask_and_advance"]
            print(f"{name:14s} setup {r['tokenizer_setup_s']:.3f} s  compile {r['schema_compile_s']:.3f} s  "
                  f"mask+advance median {m['median_us']:.1f} us  p90 {m['p90_us']:.1f} us  mean {m['mean_us']:.1f} us  "
                  f"(first pass {m['first_pass_mean_us']:.1f} us)")
        else:
            print(f"{name:14s} {r}")
    return out


# ---------------------------------------------------------------------------------------------- decode share
def _decode_window(llm: Any, prompts: list[str], params: Any) -> dict[str, Any]:
    """Run ``prompts`` to the end, timing every step taken while all of them decode together (every sequence has
    its first token and none has finished: pure batch-``len(prompts)`` decode steps)."""
    seqs = [llm.add_request(p, params) for p in prompts]
    timers = llm.runner.structured.timers
    before: dict[str, float] | None = None
    after: dict[str, float] | None = None
    step_s: list[float] = []
    while llm.has_unfinished():
        full = all(s.output_ids for s in seqs) and not any(s.is_finished for s in seqs)
        if full and before is None:
            before = dict(timers)
        start = time.perf_counter()
        llm.step()
        elapsed = time.perf_counter() - start
        if full and not any(s.is_finished for s in seqs):  # the window ends with the first finish
            step_s.append(elapsed)
            after = dict(timers)
    window = {k: after[k] - before[k] for k in timers} if before is not None and after is not None else {}
    return {"steps": len(step_s), "step_s": step_s,
            "step_ms_median": statistics.median(step_s) * 1e3 if step_s else None,
            "step_ms_mean": statistics.fmean(step_s) * 1e3 if step_s else None, "step_s_total": sum(step_s),
            "timers": window, "outputs": [s.output() for s in seqs]}


def share(batch: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """The mask's share of a batch-``batch`` decode step on SmolLM2 (Q4_1 packed, the default)."""
    from tessera.engine import LLM, SamplingParams

    llm = LLM(max_num_seqs=batch)
    prompts = [PROMPT.replace("fictional", f"fictional (#{i})") for i in range(batch)]
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=max_tokens, json_schema=SCHEMA)
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, json_schema=SCHEMA))  # warm-up
    result: dict[str, Any] = {"batch": batch, "max_tokens": max_tokens, "rounds": rounds}
    modes = (("unconstrained", plain, True), ("json_schema", constrained, True),
             ("json_schema_not_overlapped", constrained, False))
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in modes}
    for _ in range(rounds):  # alternating, so that load from other processes falls on every mode alike
        for name, params, overlap in modes:
            llm.runner.structured.overlap = overlap
            runs[name].append(_decode_window(llm, prompts, params))
    # the constrained requests finish early (their JSON is complete); the unconstrained steps are compared over
    # as many steps from the start, so that both hold the same context lengths
    window = min(r["steps"] for name, _, _ in modes[1:] for r in runs[name])
    for r in runs["unconstrained"]:
        r["step_ms_median"] = statistics.median(r["step_s"][:window]) * 1e3
    for name, _, _ in modes:
        run = min(runs[name], key=lambda r: r["step_ms_median"])  # the least disturbed round
        run.pop("step_s")
        run["step_ms_median_per_round"] = [r["step_ms_median"] for r in runs[name]]
        t = run.pop("timers")
        outs = run.pop("outputs")
        entry = {**run, **{k: t.get(k, 0.0) for k in ("mask_s", "wait_s", "apply_s", "advance_s")}}
        if name != "unconstrained" and run["steps"]:
            total = run["step_s_total"]
            # the masks are computed on a worker during the forward: the step pays for the wait, the -inf fill and
            # the grammar advance; the compute itself is reported too, as if it were not overlapped
            entry["mask_share_critical_path"] = (t["wait_s"] + t["apply_s"] + t["advance_s"]) / total
            entry["mask_share_if_serial"] = (t["mask_s"] + t["apply_s"] + t["advance_s"]) / total
            entry["step_time_vs_unconstrained"] = run["step_ms_median"] / result["unconstrained"]["step_ms_median"]
            import jsonschema

            entry["valid_outputs"] = sum(_valid(o.text, jsonschema) for o in outs)
            entry["finish_reasons"] = [o.finish_reason for o in outs]
        result[name] = entry
        line = (f"{name:14s} {run['steps']} batch-{batch} decode steps, median {run['step_ms_median']:.2f} ms "
                f"(rounds: {', '.join(f'{m:.1f}' for m in run['step_ms_median_per_round'])})")
        if "mask_share_critical_path" in entry:
            line += (f"; mask on the critical path {100 * entry['mask_share_critical_path']:.2f}% of the step "
                     f"({100 * entry['mask_share_if_serial']:.2f}% if not overlapped); step time "
                     f"{entry['step_time_vs_unconstrained']:.3f}x unconstrained; valid JSON "
                     f"{entry['valid_outputs']}/{batch}")
        print(line)
    return result


def _valid(text: str, jsonschema: Any) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", default="engines,share", help="comma-separated: engines, share")
    parser.add_argument("--repeat", type=int, default=5, help="passes over the document per engine")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each mode (part 2)")
    parser.add_argument("--json", default=None, help="output path (default benchmarks/results/grammar-mask-DATE.json)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    parts = set(args.parts.split(","))
    today = dt.date.today().isoformat()
    report: dict[str, Any] = {"date": today, "cpu": cpu_model(), "torch_threads": torch.get_num_threads(),
                              "command": "python benchmarks/grammar_mask.py " + " ".join(
                                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if v is not None),
                              "schema": SCHEMA}
    if "engines" in parts:
        report["engines"] = engines(args.repeat)
    if "share" in parts:
        report["decode_share"] = share(args.batch, args.max_tokens, args.rounds)
    path = Path(args.json or Path(__file__).parent / "results" / f"grammar-mask-{today}.json")
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
