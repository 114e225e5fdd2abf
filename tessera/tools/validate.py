"""``tessera validate``: our model against transformers on the same tokens, layer by layer.

Both models run the same token ids; the table compares every hidden state (embeddings, each layer's output, the
final-normed output: Hugging Face's ``output_hidden_states`` order) by max abs error, norm-relative error and cosine
similarity, then the final logits by KL divergence (reference || ours) and top-1 agreement. The exit status is
non-zero when a tolerance is exceeded.

transformers loads the same path by default (it de-quantizes GGUF files itself). ``--reference`` names another
checkpoint for it instead: the Hugging Face directory a GGUF file was made from, for the files whose keys
transformers' GGUF reader ignores (``rope_freqs``, yarn, Gemma 2's caps and query scale, MoE widths), or to measure
what a quantized file costs against its float source.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:  # torch loads when the command runs, not when the CLI parser is built
    import torch

#: per dtype: max norm-relative error of the final logits, max mean KL (nats), min top-1 agreement
TOLERANCES = {"float32": (1e-4, 1e-6, 0.999), "bfloat16": (5e-2, 5e-3, 0.95), "float16": (1e-2, 1e-3, 0.98)}
DEFAULT_PROMPT = "The capital of France is Paris. The capital of Germany is"


@dataclass
class Row:
    name: str
    max_abs: float
    rel: float
    cosine: float


def compare(ours: torch.Tensor, ref: torch.Tensor, name: str) -> Row:
    import torch

    a, b = ours.double().flatten(), ref.double().flatten()
    rel = float((a - b).abs().max() / max(float(b.abs().max()), 1e-12))
    cos = float(torch.nn.functional.cosine_similarity(a, b, dim=0))
    return Row(name, float((a - b).abs().max()), rel, cos)


def reference_model(path: Path, dtype: torch.dtype):
    """transformers' model for the same checkpoint (it dequantizes GGUF files itself)."""
    from transformers import AutoModelForCausalLM

    if path.is_file():
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def token_ids(model, prompt: str, seq: int) -> torch.Tensor:
    import torch

    if model.tokenizer is not None:
        ids = model.tokenizer.encode(prompt).ids
        if ids:
            return torch.tensor([ids])
    return torch.randint(0, model.config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))


def validate(path: str | Path | None, dtype: str = "float32", prompt: str = DEFAULT_PROMPT, seq: int = 32,
             backend: str = "auto", reference: str | Path | None = None) -> dict:
    """Run both models; return the per-layer rows, logits metrics and whether every tolerance holds.

    ``reference`` is the checkpoint transformers runs (default: ``path`` itself)."""
    import torch

    from tessera.models import default_model_path, load_model

    path = Path(path) if path is not None else default_model_path()
    ours = load_model(path, dtype=dtype, backend=backend, keep_quantized=False)  # the weights transformers uses
    ids = token_ids(ours, prompt, seq)
    hidden: list[torch.Tensor] = []
    logits = ours.logits(ids, hidden_states=hidden)
    ref_path = Path(reference) if reference is not None else path
    if not ref_path.exists():
        raise FileNotFoundError(f"validate: the reference {ref_path} does not exist; pass a Hugging Face directory "
                                "or a .gguf file")
    ref_model = reference_model(ref_path, getattr(torch, dtype))
    with torch.no_grad():
        ref = ref_model(ids, output_hidden_states=True)
    names = ["embeddings"] + [f"layer {i}" for i in range(len(hidden) - 2)] + ["last layer + final norm"]
    rows = [compare(a, b, n) for a, b, n in zip(hidden, ref.hidden_states, names)]
    ref_logits = ref.logits.float()
    logp, ref_logp = torch.log_softmax(logits.double(), -1), torch.log_softmax(ref_logits.double(), -1)
    kl = float((ref_logp.exp() * (ref_logp - logp)).sum(-1).mean())
    top1 = float((logits.argmax(-1) == ref_logits.argmax(-1)).float().mean())
    final = compare(logits, ref_logits, "logits")
    max_rel, max_kl, min_top1 = TOLERANCES[dtype]
    ok = final.rel <= max_rel and kl <= max_kl and top1 >= min_top1
    return {"path": str(path), "reference": str(ref_path), "dtype": dtype, "tokens": ids.shape[1], "rows": [asdict(r) for r in rows + [final]],
            "kl": kl, "top1": top1, "tolerances": {"rel": max_rel, "kl": max_kl, "top1": min_top1}, "ok": ok}


def print_report(report: dict, console: Console | None = None) -> None:
    console = console or Console(width=120)
    against = "" if report.get("reference", report["path"]) == report["path"] else f" vs {report['reference']}"
    table = Table(title=f"tessera validate {report['path']}{against} ({report['dtype']}, {report['tokens']} tokens)")
    for col in ("hidden state", "max |ours - ref|", "relative", "cosine"):
        table.add_column(col, justify="right")
    for r in report["rows"]:
        table.add_row(r["name"], f"{r['max_abs']:.3e}", f"{r['rel']:.3e}", f"{r['cosine']:.8f}")
    console.print(table)
    tol = report["tolerances"]
    verdict = "[green]PASS[/green]" if report["ok"] else "[red]FAIL[/red]"
    console.print(f"logits: KL(ref || ours) = {report['kl']:.3e} (<= {tol['kl']:g}), top-1 agreement "
                  f"{100 * report['top1']:.1f}% (>= {100 * tol['top1']:g}%), relative error "
                  f"{report['rows'][-1]['rel']:.3e} (<= {tol['rel']:g}): {verdict}")


def add_parser(commands) -> None:
    p = commands.add_parser("validate", help="compare a model with transformers, layer by layer")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", choices=list(TOLERANCES), default="float32")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--backend", default="auto")
    p.add_argument("--reference", help="the checkpoint transformers runs instead of --model (e.g. the Hugging Face "
                                       "directory a GGUF file was made from)")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    report = validate(args.model, args.dtype, args.prompt, backend=args.backend, reference=args.reference)
    print_report(report)
    return 0 if report["ok"] else 1
