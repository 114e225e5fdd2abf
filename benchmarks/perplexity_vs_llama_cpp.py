"""Perplexity of the default SmolLM2 GGUF by ``tessera perplexity`` and by llama.cpp's ``llama-perplexity``, on the
same file, context and number of chunks.

Steps:

1. the pydoc corpus (:func:`tessera.eval.corpus.pydoc_corpus`) is written to a UTF-8 file;
2. when ``llama-tokenize`` is built, both tokenizations of that file are compared id by id;
3. ``llama-perplexity -m MODEL -f FILE -c CTX --chunks N -t THREADS`` runs (skipped, with a message, when the binary
   is missing: ``make peers`` builds it);
4. ``python -m tessera perplexity FILE --ctx CTX --chunks N --json ...`` runs with the same number of threads, then
   again with ``--dequantize`` (float32 weights holding the codes' exact values: the figure both quantized
   computations approximate; ``--no-dequantized`` skips it);
5. the figures, the relative difference, the CPU model and the date go to a JSON file.

Usage::

    python benchmarks/perplexity_vs_llama_cpp.py                 # 50 chunks of 512: a few minutes on 2 cores
    python benchmarks/perplexity_vs_llama_cpp.py --chunks 4 --json /tmp/ppl.json   # a smoke run
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tessera.bench import peers
from tessera.bench.machine import fingerprint
from tessera.eval.corpus import corpus_fingerprint, pydoc_corpus, write_corpus
from tessera.hw import probes
from tessera.models.model import default_model_path

RESULTS = Path(__file__).resolve().parent / "results"
#: the agreement the two tools must reach on the same file, context and chunks (relative, on PPL)
TARGET = 0.01


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the SmolLM2-135M-Instruct Q4_1 GGUF)")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-bin", default=None,
                    help=f"directory of llama-perplexity (default $TESSERA_LLAMA_CPP_BIN or {peers.DEFAULT_BIN_DIR})")
    ap.add_argument("--dequantized", action=argparse.BooleanOptionalAction, default=True,
                    help="also run Tessera with --dequantize (default on)")
    ap.add_argument("--corpus-file", default=None, help="where to write the corpus (default: a temporary file)")
    ap.add_argument("--json", default=None,
                    help="where to write the results (default benchmarks/results/perplexity-<model>-<date>.json)")
    args = ap.parse_args(argv)
    model = Path(args.model) if args.model else default_model_path()
    bin_dir = Path(args.llama_cpp_bin or os.environ.get("TESSERA_LLAMA_CPP_BIN") or peers.DEFAULT_BIN_DIR)
    with tempfile.TemporaryDirectory(prefix="tessera-ppl-") as scratch:
        corpus = Path(args.corpus_file) if args.corpus_file else Path(scratch) / "pydoc.txt"
        text = pydoc_corpus()
        write_corpus(text, corpus)
        print(f"corpus: {corpus} ({corpus.stat().st_size} bytes)", file=sys.stderr)
        record: dict[str, Any] = {
            "date": dt.date.today().isoformat(), "model": str(model), "ctx": args.ctx, "chunks": args.chunks,
            "threads": args.threads, "corpus": {"name": "pydoc", **corpus_fingerprint(text)},
            "machine": fingerprint(),
        }
        record["tokenization"] = compare_tokens(bin_dir, model, corpus, text)
        record["llama_cpp"] = run_llama(bin_dir, model, corpus, args)
        record["tessera"] = run_tessera(model, corpus, args, Path(scratch) / "tessera.json")
        if args.dequantized:
            record["tessera_dequantized"] = run_tessera(model, corpus, args, Path(scratch) / "float.json",
                                                        ["--dequantize"])
    record["agreement"] = agreement(record["tessera"], record["llama_cpp"])
    if "tessera_dequantized" in record:  # how far each quantized computation lands from the float one
        f32 = record["tessera_dequantized"]["ppl"]
        record["relative_to_dequantized"] = {name: record[name]["ppl"] / f32 - 1 for name in ("tessera", "llama_cpp")
                                             if "ppl" in record[name]}
    out = Path(args.json) if args.json else RESULTS / f"perplexity-{_short(model)}-{record['date']}.json"
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(summary(record), file=sys.stderr)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def compare_tokens(bin_dir: Path, model: Path, corpus: Path, text: str) -> dict[str, Any]:
    """Tessera's token ids of the corpus against ``llama-tokenize``'s (skipped when it is not built)."""
    binary = bin_dir / "llama-tokenize"
    if not os.access(binary, os.X_OK):
        return {"skipped": f"{binary} not built"}
    from tessera.eval.perplexity import tokenize
    from tessera.models.load import load_model

    ours = tokenize(load_model(model).tokenizer, text)
    # perplexity's own tokenization: no escape processing, control tokens' text as text
    cmd = [str(binary), "-m", str(model), "-f", str(corpus), "--ids", "--no-escape", "--no-parse-special",
           "--log-disable"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True, env=peers.peer_env())
    theirs = json.loads(proc.stdout)
    first_diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    return {"tessera_tokens": len(ours), "llama_cpp_tokens": len(theirs), "identical": ours == theirs,
            "first_difference": first_diff, "command": " ".join(cmd)}


def run_llama(bin_dir: Path, model: Path, corpus: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``llama-perplexity``'s final estimate, running values and wall time (or why it was skipped)."""
    binary = bin_dir / "llama-perplexity"
    if not os.access(binary, os.X_OK):
        print(f"llama-perplexity not found in {bin_dir}: skipping llama.cpp. {peers.MISSING_HINT}", file=sys.stderr)
        return {"skipped": f"{binary} not built (make peers)"}
    cmd = [str(binary), "-m", str(model), "-f", str(corpus), "-c", str(args.ctx), "--chunks", str(args.chunks),
           "-t", str(args.threads)]
    print("running " + " ".join(cmd), file=sys.stderr)
    before = _cpu_snapshot()
    # llama.cpp in its own environment: Tessera's thread-pool settings would slow its OpenMP threads (peers.py)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=peers.peer_env())
    seconds, others = _elapsed(before)
    log = proc.stdout + proc.stderr
    final = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if proc.returncode != 0 or final is None:
        raise RuntimeError(f"llama-perplexity failed (exit {proc.returncode}):\n{log[-3000:]}")
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    build = bin_dir / "peer-build.json"
    return {"ppl": float(final.group(1)), "stderr": float(final.group(2)),
            "n_chunks": int(chunks.group(1)) if chunks else None,
            "running": [float(v) for v in re.findall(r"\[\d+\]([0-9.]+),", log)],
            "seconds": seconds, "others_busy_fraction": others, "command": " ".join(cmd),
            "build": json.loads(build.read_text()).get("source") if build.is_file() else None}


def run_tessera(model: Path, corpus: Path, args: argparse.Namespace, out: Path,
                extra: list[str] | None = None) -> dict[str, Any]:
    """``tessera perplexity`` (with ``extra`` flags) in a fresh process with ``--threads`` threads: its JSON record
    and wall time."""
    extra = extra or []
    cmd = [sys.executable, "-m", "tessera", "perplexity", str(corpus), "--model", str(model), "--ctx", str(args.ctx),
           "--chunks", str(args.chunks), "--json", str(out), *extra]
    print("running " + " ".join(cmd), file=sys.stderr)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "NUMBA_NUM_THREADS": str(args.threads)}
    before = _cpu_snapshot()
    subprocess.run(cmd, check=True, env=env)
    seconds, others = _elapsed(before)
    record = json.loads(out.read_text())
    result = record["result"]
    return {"ppl": result["ppl"], "stderr": result["stderr"], "n_chunks": result["n_chunks"],
            "n_tokens": result["n_tokens"], "n_scored": result["n_scored"], "add_bos": result["add_bos"],
            "running": [r["ppl"] for r in result["running"]], "seconds_windows": result["seconds"],
            "seconds": seconds, "others_busy_fraction": others, "settings": record["settings"],
            "command": f"tessera perplexity {corpus} --model {model} --ctx {args.ctx} --chunks {args.chunks} "
                       f"--json OUT{''.join(' ' + e for e in extra)} (OMP_NUM_THREADS={args.threads} "
                       f"NUMBA_NUM_THREADS={args.threads})"}


def agreement(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """Relative difference of the final and running PPLs (None when llama.cpp was skipped)."""
    if "ppl" not in theirs:
        return {"relative_difference": None, "within_target": None, "target": TARGET}
    rel = abs(ours["ppl"] - theirs["ppl"]) / theirs["ppl"]
    running = [abs(a - b) / b for a, b in zip(ours["running"], theirs["running"])]
    return {"relative_difference": rel, "within_target": rel <= TARGET, "target": TARGET,
            "max_running_relative_difference": max(running) if running else None,
            "same_chunks": ours["n_chunks"] == theirs["n_chunks"]}


def summary(record: dict[str, Any]) -> str:
    ours, theirs, agree = record["tessera"], record["llama_cpp"], record["agreement"]
    lines = [f"{record['machine']['cpu_model']}, {record['threads']} threads, ctx {record['ctx']}, "
             f"{ours['n_chunks']} chunks, {ours['n_tokens']} tokens in the corpus",
             f"  tessera    PPL = {ours['ppl']:.4f} +/- {ours['stderr']:.5f}  ({ours['seconds']:.1f} s, others used "
             f"{ours['others_busy_fraction']:.0%} of the CPUs)"]
    if "tessera_dequantized" in record:
        f32 = record["tessera_dequantized"]
        lines.append(f"  tessera --dequantize  PPL = {f32['ppl']:.4f} +/- {f32['stderr']:.5f}  "
                     f"({f32['seconds']:.1f} s, others used {f32['others_busy_fraction']:.0%} of the CPUs)")
    if "ppl" in theirs:
        lines.append(f"  llama.cpp  PPL = {theirs['ppl']:.4f} +/- {theirs['stderr']:.5f}  ({theirs['seconds']:.1f} s, "
                     f"others used {theirs['others_busy_fraction']:.0%} of the CPUs)")
        lines.append(f"  relative difference {agree['relative_difference']:.3%} (target {TARGET:.0%})")
    else:
        lines.append(f"  llama.cpp  {theirs['skipped']}")
    return "\n".join(lines)


def _cpu_snapshot() -> tuple[float, tuple[float, float] | None, float]:
    """(wall clock, machine-wide busy CPU seconds, CPU seconds of this process and its finished children)."""
    own = os.times()
    return time.perf_counter(), probes.cpu_seconds(), own.user + own.system + own.children_user + own.children_system


def _elapsed(before: tuple[float, tuple[float, float] | None, float]) -> tuple[float, float]:
    """Seconds since ``before`` and the fraction of the machine other processes used meanwhile (the child just run
    counts as ours): a shared machine's load explains a slow run."""
    start, busy_before, mine_before = before
    wall, busy_after, mine_after = _cpu_snapshot()
    seconds = wall - start
    if busy_before is None or busy_after is None or seconds <= 0:
        return seconds, 0.0
    others = (busy_after[0] - busy_before[0]) - (mine_after - mine_before)
    return seconds, min(1.0, max(0.0, others / (seconds * (os.cpu_count() or 1))))


def _short(model: Path) -> str:
    """A file-name tag for the model: 'smollm2' for the default, else the file's stem, lower-case."""
    stem = model.stem.lower()
    return "smollm2" if stem.startswith("smollm2") else re.sub(r"[^a-z0-9._-]+", "-", stem)


if __name__ == "__main__":
    sys.exit(main())
