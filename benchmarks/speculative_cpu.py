"""Speculative decoding on the CPU: batch-1 decode tokens/s with and without a proposer, in the same run.

Cases (each against the same target without speculation, runs interleaved A B A B):

- ``ngram``: prompt lookup on the default SmolLM2 engine (Q4_1 projections packed);
- ``self:q4_1`` / ``self:q4_0``: the target de-quantized to fp32, drafting with its own weights quantized (q4_1 gives
  back the file's own Q4_1 values, so its drafts are the packed model's greedy tokens);
- ``draft``: the fp32 target with ``draft:PATH``, PATH a Q4_0 GGUF of the same model written by ``tessera quantize``
  (under ``~/.cache/tessera/bench``; no smaller checkpoint with SmolLM2's vocabulary can be downloaded here), so the
  draft-model proposer runs from a file as a user's would.

Each case runs two prompts, both through the chat template: a *repetitive* one (repeat a given paragraph, where the
n-gram lookup finds most tokens in the prompt) and an *open-ended* one (a story). Reported: decode tokens/s (tokens
after the first / time after the first), the ratio against the plain run, the acceptance rate and the mean tokens
per verified step. Greedy, EOS ignored.

``--check-greedy`` also runs 16 prompts x ``--max-tokens`` batched with each proposer and counts the prompts whose
tokens equal the plain engine's.

Usage::

    python benchmarks/speculative_cpu.py                      # ~6 minutes, writes benchmarks/results/speculative-*.json
    python benchmarks/speculative_cpu.py --quick              # 32 tokens, one repetition, no JSON
    python benchmarks/speculative_cpu.py --cases ngram --check-greedy
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see e2e_cpu.py: idle OpenMP threads must not spin here
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from tessera.bench.machine import fingerprint  # noqa: E402
from tessera.engine import LLM, SamplingParams  # noqa: E402
from tessera.engine.chat import render_chat  # noqa: E402
from tessera.models.load import load_model  # noqa: E402

PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the "
             "members agreed to move the children's section to the ground floor, to add two study rooms on the "
             "second floor, and to keep the reading garden open until nine in the evening during the summer. The "
             "treasurer reported that the repairs to the roof had cost less than expected, which left enough money "
             "to buy new chairs for the reading room and to extend the opening hours on Saturday mornings. The next "
             "meeting will take place on the first Monday of October, when the architect will present the final "
             "plans and the members will vote on the colour of the new front door.")
PROMPTS = {
    "repetitive": "Repeat the following text exactly, word for word:\n\n" + PARAGRAPH,
    "open-ended": "Write a short story about a dragon who learns to cook.",
}
CASES = {"ngram": ("packed", "ngram"), "self:q4_1": ("fp32", "self:q4_1"), "self:q4_0": ("fp32", "self:q4_0"),
         "draft": ("fp32", "draft:")}
DRAFT_FILE = Path.home() / ".cache" / "tessera" / "bench" / "smollm2-q4_0.gguf"
TOPICS = ["the ocean", "a robot", "winter", "a city at night", "bread", "a lighthouse", "mathematics", "trains",
          "a garden", "the moon", "music", "a mountain", "rain", "coffee", "a library", "birds"]


def _speculative(name: str) -> str:
    """The ``speculative=`` value of a case; the draft case writes its GGUF file first."""
    spec = CASES[name][1]
    if spec != "draft:":
        return spec
    if not DRAFT_FILE.exists():
        from tessera.models import default_model_path

        DRAFT_FILE.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "tessera", "quantize", str(default_model_path()), str(DRAFT_FILE),
                        "--type", "Q4_0"],
                       check=True)
    return f"draft:{DRAFT_FILE}"


def _decode_rate(out) -> float:
    return (len(out.token_ids) - 1) / (out.latency - out.time_to_first_token)


def _run_case(name: str, models: dict, prompts: dict[str, str], params: SamplingParams, reps: int,
              num_draft: int) -> list[dict]:
    target_kind, spec = CASES[name][0], _speculative(name)
    model = models[target_kind]
    plain = LLM(model, max_num_seqs=1)
    fast = LLM(model, max_num_seqs=1, speculative=spec, num_draft=num_draft)
    rows = []
    for label, prompt in prompts.items():
        plain.generate([prompt], params)  # warm both paths (kernels compile on first use)
        fast.generate([prompt], params)
        before = dict(fast.stats())
        a, b, same = [], [], True
        for _ in range(reps):
            pa = plain.generate([prompt], params)[0]
            pb = fast.generate([prompt], params)[0]
            a.append(_decode_rate(pa))
            b.append(_decode_rate(pb))
            same &= pa.token_ids == pb.token_ids
        after = fast.stats()
        drafted = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        steps = after["spec_num_steps"] - before["spec_num_steps"]
        rows.append({
            "case": name, "target": target_kind, "prompt": label, "plain_tok_s": statistics.median(a),
            "spec_tok_s": statistics.median(b), "ratio": statistics.median(b) / statistics.median(a),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "tokens_per_verified_step": (accepted + steps) / steps if steps else 1.0,
            "greedy_equal": same, "plain_runs": a, "spec_runs": b,
        })
    return rows


def _check_greedy(name: str, models: dict, max_tokens: int) -> dict:
    target_kind, spec = CASES[name][0], _speculative(name)
    model = models[target_kind]
    prompts = [render_chat(model.chat_template, [{"role": "user", "content": f"Write about {t}."}]) for t in TOPICS]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    plain = LLM(model, max_num_seqs=16).generate(prompts, params)
    fast = LLM(model, max_num_seqs=16, speculative=spec).generate(prompts, params)
    equal = [a.token_ids == b.token_ids for a, b in zip(plain, fast)]
    first = [next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
             for a, b in zip(plain, fast)]
    return {"case": name, "prompts": len(prompts), "equal": sum(equal), "first_difference": first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {list(CASES)}")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--check-greedy", action="store_true")
    ap.add_argument("--quick", action="store_true", help="32 tokens, one repetition, no JSON unless --json")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.max_tokens, args.reps = 32, 1
    cases = args.cases.split(",")
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"unknown case(s) {unknown}; choose from {list(CASES)}")
    console = Console()
    machine = fingerprint()
    console.print(f"{machine['cpu_model']}; batch-1 greedy decode, {args.max_tokens} new tokens, median of {args.reps}")
    models = {"packed": load_model(None)}
    if any(CASES[c][0] == "fp32" for c in cases):
        models["fp32"] = load_model(None, keep_quantized=False)
    prompts = {k: render_chat(models["packed"].chat_template, [{"role": "user", "content": v}])
               for k, v in PROMPTS.items()}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = [row for case in cases for row in _run_case(case, models, prompts, params, args.reps, args.num_draft)]
    table = Table("case", "target", "prompt", "plain tok/s", "spec tok/s", "ratio", "accept", "tok/step", "same")
    for r in rows:
        table.add_row(r["case"], r["target"], r["prompt"], f"{r['plain_tok_s']:.1f}", f"{r['spec_tok_s']:.1f}",
                      f"{r['ratio']:.2f}x", f"{r['acceptance_rate']:.0%}", f"{r['tokens_per_verified_step']:.2f}",
                      "yes" if r["greedy_equal"] else "NO")
    console.print(table)
    greedy = [_check_greedy(c, models, args.max_tokens) for c in cases] if args.check_greedy else []
    for g in greedy:
        console.print(f"greedy, 16 prompts x {args.max_tokens} tokens batched, {g['case']}: {g['equal']}/16 equal "
                      f"(first differing token per prompt: {g['first_difference']})")
    path = args.json or (None if args.quick else Path("benchmarks/results") /
                         f"speculative-cpu-{dt.date.today().isoformat()}.json")
    if path is not None:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        path.write_text(json.dumps({"date": dt.datetime.now().isoformat(timespec="seconds"), "commit": commit,
                                    "machine": machine, "max_tokens": args.max_tokens, "reps": args.reps,
                                    "num_draft": args.num_draft, "rows": rows, "greedy_check": greedy}, indent=1))
        console.print(f"wrote {path}")


if __name__ == "__main__":
    main()
