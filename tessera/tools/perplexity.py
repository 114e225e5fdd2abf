"""``tessera perplexity FILE``: a model's perplexity over a text file, by llama.cpp's ``llama-perplexity`` protocol
(:mod:`tessera.eval.perplexity`): non-overlapping windows of ``--ctx`` tokens, the second half of each scored, BOS
at the start of each window when the vocabulary adds one.

The file is read as ``llama-perplexity -f`` reads it (UTF-8, one trailing newline dropped), so the two tools score
the same tokens. ``--corpus pydoc`` measures the standard library's help text instead of a file, and
``--write-corpus PATH`` writes that text to PATH (then exits) for ``llama-perplexity -f PATH``. A progress bar shows
the running estimate; the final line reads like llama.cpp's: ``Final estimate: PPL = X +/- Y``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.tools.placement_flags import add_placement_flags
from tessera.tools.weight_flags import add_kv_cache_flag, add_weight_flags, keep_quantized

if TYPE_CHECKING:  # the CLI parser imports this module; torch loads only when the command runs
    from tessera.eval.perplexity import RunningPPL

#: the choices of ``--corpus`` (tessera.eval.corpus.CORPORA, spelled here so the parser imports nothing)
CORPORA = ("pydoc",)


def add_parser(commands: Any) -> None:
    p = commands.add_parser("perplexity", help="perplexity over a text file, by llama-perplexity's protocol",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("file", nargs="?", help="UTF-8 text file (or --corpus)")
    p.add_argument("--corpus", choices=CORPORA,
                   help="measure a built-in text instead of FILE: pydoc = the standard library's help topics")
    p.add_argument("--write-corpus", metavar="PATH",
                   help="write the --corpus text to PATH as UTF-8 and exit (for llama-perplexity -f PATH)")
    p.add_argument("--ctx", type=int, default=512, help="tokens per window (llama-perplexity -c; default 512)")
    p.add_argument("--chunks", type=int, default=None,
                   help="evaluate at most N windows (llama-perplexity --chunks; default: all whole windows)")
    p.add_argument("--batch", type=int, default=1, help="windows per forward pass (default 1)")
    p.add_argument("--model", help="GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct GGUF)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--json", metavar="OUT", help="write the result, running values included, to OUT as JSON")
    add_placement_flags(p)
    add_weight_flags(p)
    add_kv_cache_flag(p)
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tessera.eval.corpus import corpus_fingerprint, corpus_text, read_text, write_corpus

    err = Console(stderr=True)
    if args.write_corpus:
        if args.corpus is None:
            raise ValueError("--write-corpus needs --corpus NAME (the text to write)")
        path = write_corpus(corpus_text(args.corpus), args.write_corpus)
        err.print(f"wrote the {args.corpus} corpus to {path} ({path.stat().st_size} bytes)", highlight=False)
        return 0
    if (args.file is None) == (args.corpus is None):
        raise ValueError("pass a text FILE or --corpus NAME (exactly one)")
    text = read_text(args.file) if args.file is not None else corpus_text(args.corpus)

    from tessera.eval.perplexity import perplexity
    from tessera.models.load import load_model
    from tessera.models.model import default_model_path

    with err.status("loading the model..."):
        model = load_model(args.model, dtype=args.dtype, backend=args.backend, keep_quantized=keep_quantized(args),
                           device=args.device)
    with _ProgressBar(err) as bar:
        result = perplexity(model, text, ctx=args.ctx, max_chunks=args.chunks, batch=args.batch, on_chunk=bar.update,
                            kv_cache_dtype=args.kv_cache_dtype)
    print(",".join(f"[{r.chunks}]{r.ppl:.4f}" for r in result.running))
    print(f"Final estimate: PPL = {result.ppl:.4f} +/- {result.stderr:.5f}")
    err.print(f"{result.n_chunks} chunks of {result.ctx} tokens ({result.n_tokens} in the text, {result.n_scored} "
              f"scored, BOS {'on' if result.add_bos else 'off'}) in {result.seconds:.1f} s "
              f"(+ {result.tokenize_seconds:.2f} s tokenizing)", highlight=False)
    if args.json:
        record = {"result": result.to_dict(), "model": str(args.model or default_model_path()),
                  "text": {"file": args.file, "corpus": args.corpus, **corpus_fingerprint(text)},
                  "settings": _settings(args, model)}
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0


def _settings(args: argparse.Namespace, model: Any) -> dict[str, Any]:
    """How the model ran: what a figure depends on besides the text and the protocol."""
    import torch

    import tessera

    return {"ctx": args.ctx, "chunks": args.chunks, "batch": args.batch, "dtype": args.dtype,
            "backend": args.backend, "device": str(model.device), "keep_quantized": keep_quantized(args),
            "kv_cache_dtype": args.kv_cache_dtype,
            "torch_threads": torch.get_num_threads(), "tessera": tessera.__version__, "argv": sys.argv[1:]}


class _ProgressBar:
    """A rich progress bar over the windows, with the running PPL and its standard error."""

    def __init__(self, console: Any) -> None:
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self._progress = Progress(TextColumn("perplexity"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  TimeRemainingColumn(), TextColumn("{task.fields[estimate]}"), console=console)
        self._task: Any = None

    def __enter__(self) -> _ProgressBar:
        self._progress.__enter__()
        # no total until the text is tokenized: the bar pulses until the first window is scored
        self._task = self._progress.add_task("perplexity", total=None, estimate="tokenizing, first window...")
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(*exc)

    def update(self, running: RunningPPL, total: int) -> None:
        """The ``on_chunk`` hook of :func:`tessera.eval.perplexity.perplexity`."""
        self._progress.update(self._task, total=total, completed=running.chunks,
                              estimate=f"PPL {running.ppl:.4f} +/- {running.stderr:.4f}")
