"""``tessera quantize SRC OUT --type TYPE``: write a model as a GGUF file in one quantized type.

SRC is a Hugging Face directory (safetensors) or a GGUF file; the model is loaded de-quantized to float32 and
written by :func:`tessera.models.gguf_write.write_gguf` in llama.cpp's conventions, so llama.cpp, transformers and
Tessera read it back. The tokenizer goes along: a GGUF source's ``tokenizer.*`` keys as they are, a directory's
byte-level BPE ``tokenizer.json`` converted (:func:`tessera.models.gguf_tokenizer.gguf_tokenizer_keys`); other
tokenizers are left out with a warning. The file is written next to OUT and renamed into place, so a failure
leaves no half-written OUT behind; an existing OUT needs ``--force``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any


def add_parser(commands: Any) -> None:
    # the types are checked by write_gguf: importing it here would load torch for every command's --help
    p = commands.add_parser("quantize", help="write a model (Hugging Face directory or GGUF) as a quantized GGUF",
                            description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a Hugging Face directory with config.json and safetensors, or a .gguf file")
    p.add_argument("output", help="the .gguf file to write")
    p.add_argument("--type", dest="qtype", default="Q8_0", type=str.upper,
                   help="the type of projections, experts and the embedding: F32, F16, BF16, Q8_0 (default), Q4_0, "
                        "Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, or llama.cpp's mixes Q4_K_M and Q5_K_M (Q6_K for "
                        "attn_v / ffn_down in some layers and the output table); norms stay F32")
    p.add_argument("--force", action="store_true", help="replace OUTPUT if it exists")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from tessera.models import load_model
    from tessera.models.gguf_reader import read_gguf
    from tessera.models.gguf_write import write_gguf

    from tessera.models.gguf_write import WRITABLE_TYPES

    if args.qtype not in WRITABLE_TYPES:
        raise ValueError(f"tessera quantize: --type {args.qtype} is not writable; choose one of {list(WRITABLE_TYPES)}")
    source, output = Path(args.source), Path(args.output)
    if output.exists() and not args.force:
        raise ValueError(f"tessera quantize: {output} exists; pass --force to replace it")
    if output.resolve() == source.resolve():
        raise ValueError("tessera quantize: OUTPUT is the source file; write to another path")
    start = time.perf_counter()
    model = load_model(source, dtype="float32", keep_quantized=False)
    tokenizer = _tokenizer_keys(source, model)
    partial = output.with_name(f".{output.name}.partial")
    try:
        write_gguf(partial, model.config, model.weights, qtype=args.qtype, tokenizer=tokenizer,
                   name=source.stem if source.is_file() else source.name)
        os.replace(partial, output)
    finally:
        partial.unlink(missing_ok=True)
    types = Counter(t.tensor_type.name for t in read_gguf(output).tensor_index.values())
    size = output.stat().st_size
    print(f"wrote {output} ({size / 2 ** 20:.1f} MiB, {model.config.family}) in {time.perf_counter() - start:.1f} s: "
          + ", ".join(f"{n} {t}" for t, n in types.most_common()), file=sys.stderr)
    return 0


def _tokenizer_keys(source: Path, model: Any) -> dict[str, Any]:
    from tessera.models.gguf_reader import read_gguf
    from tessera.models.gguf_tokenizer import UnsupportedTokenizer, gguf_tokenizer_keys

    if source.is_file():
        return {k: v for k, v in read_gguf(source).metadata.items() if k.startswith("tokenizer.")}
    path = source / "tokenizer.json"
    if not path.is_file():
        warnings.warn(f"{source} has no tokenizer.json: the GGUF file is written without a tokenizer", stacklevel=2)
        return {}
    try:
        keys = gguf_tokenizer_keys(json.loads(path.read_text(encoding="utf-8")))
    except UnsupportedTokenizer as err:
        warnings.warn(f"{path}: {err}", stacklevel=2)
        return {}
    template = model.chat_template
    config_path = source / "tokenizer_config.json"
    if template is None and config_path.is_file():
        template = json.loads(config_path.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, str):
        keys["tokenizer.chat_template"] = template
    return keys
