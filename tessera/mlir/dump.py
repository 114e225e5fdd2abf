"""``tessera mlir dump``: a model layer captured as ``tessera`` IR, the IR after each pass, and the lowered kernel of
its attention op.

::

    tessera mlir dump                                   # SmolLM2 layer 0, 16 tokens, every pass
    tessera mlir dump --model m.gguf --layer 3 --tokens 128 --passes fuse-rope,attention-layout{kv=head}
    tessera mlir dump --module                          # ... then the whole layer as one IREE module (lower_graph)

Only the model's config is read (GGUF metadata or ``config.json``), never its weights. This module imports
nothing heavy at import time, so ``tessera --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

#: kernel key layout (``lower_attention``) for each ``kv_layout`` attribute; absent: the kernel's default
KEY_LAYOUT = {"token": "tokens", "head": "tiles", None: "tiles"}


def add_parser(commands: Any) -> None:
    """Register ``tessera mlir dump`` on the CLI's subcommands."""
    mlir = commands.add_parser("mlir", help="the tessera MLIR dialect: capture, passes, lowering")
    sub = mlir.add_subparsers(title="mlir commands", required=True)
    p = sub.add_parser("dump", help="print a layer's tessera IR, the IR after each pass, and its attention kernel",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a .gguf file or a Hugging Face directory (default: SmolLM2-135M)")
    p.add_argument("--layer", type=int, default=0, help="which decoder layer (default 0)")
    p.add_argument("--tokens", type=int, default=16, help="the token count T of the batch (default 16)")
    p.add_argument("--passes", default="all",
                   help="'all' (default), 'none', or a comma list such as fuse-rope,attention-layout{kv=head}")
    p.add_argument("--dtype", default="f32", choices=("f32", "bf16", "f16"), help="element type (default f32)")
    p.add_argument("--module", action="store_true",
                   help="end with the whole layer lowered to one IREE module (float32 only) instead of the attention "
                        "kernel alone")
    p.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    dump(read_config(args.model), args.layer, args.tokens, args.passes, dtype=args.dtype, whole_module=args.module)
    return 0


def read_config(path: str | Path | None = None) -> Any:
    """The :class:`~tessera.models.ModelConfig` of a GGUF file or Hugging Face directory (None: SmolLM2-135M),
    without loading weights."""
    from tessera.models import hf
    from tessera.models.gguf import config_from_gguf, open_reader
    from tessera.models.model import default_model_path

    path = Path(path) if path is not None else default_model_path()
    if path.is_dir():
        return hf.read_config(path)[2]
    if not path.is_file():
        raise FileNotFoundError(f"tessera mlir dump: {path} does not exist; pass --model with a .gguf file or a "
                                "Hugging Face directory")
    reader = open_reader(path)
    return config_from_gguf(reader.metadata, reader.tensor_index, path)[2]


def dump(config: Any, layer: int = 0, tokens: int = 16, passes: str = "all", out: TextIO | None = None,
         dtype: str = "f32", whole_module: bool = False) -> None:
    """Print layer ``layer`` of ``config`` captured for ``tokens`` tokens, the IR after each of ``passes``, and the
    lowered kernel text of its ``tessera.attention`` (with the key layout its ``kv_layout`` asks for), or with
    ``whole_module`` the layer lowered to one IREE module (:func:`tessera.mlir.lower_graph.lower_graph`)."""
    from tessera.mlir.capture import capture_layer
    from tessera.mlir.dialect import context
    from tessera.mlir.passes import parse_passes

    out = out or sys.stdout
    parsed = parse_passes(passes)  # before capturing: a typo in --passes fails fast
    module = capture_layer(config, layer, tokens, dtype)
    print(f"// ---- captured: layer {layer} of a {config.family} model, T = {tokens}, {dtype}", file=out)
    print(module, file=out)
    ctx = context()
    for p in parsed:
        p.apply(ctx, module)
        print(f"// ---- after {p.spec(include_default=True)}", file=out)
        print(module, file=out)
    if whole_module:
        from tessera.mlir.lower_graph import lower_graph

        print("// ---- the layer as one IREE module (lower_graph)", file=out)
        print(lower_graph(module).text, file=out)
        return
    print(attention_kernel_text(module, tokens), file=out)


def attention_kernel_text(module: Any, tokens: int = 16) -> str:
    """A header line and the :func:`~tessera.mlir.attention_kernel.lower_attention` text of the module's (first)
    ``tessera.attention``, its spec rebuilt from the op's attributes; rows per item from the
    ``mlir_attention_rows`` tunable, keys per tile from the op's block-sparse schedule (else the tunable)."""
    from tessera.backends.mlir import tunables  # noqa: F401  (registers the tunables read here)
    from tessera.mlir.attention_kernel import KV_TILE, ROWS, lower_attention
    from tessera.mlir.dialect import AttentionOp, attention_schedule, attention_spec
    from tessera.tuning import tuned

    op = next((o for o in module.walk() if isinstance(o, AttentionOp)), None)
    if op is None:
        raise ValueError("tessera mlir dump: the module has no tessera.attention op to lower")
    spec = attention_spec(op, tokens, placeholders=True)
    layout = op.kv_layout.data if op.kv_layout is not None else None
    key_layout = KEY_LAYOUT[layout]
    element = str(op.k.type.element_type) if key_layout == "tokens" else "f32"
    schedule = attention_schedule(op)
    kv_tile = schedule.kv_tile if schedule is not None else tuned("mlir_attention_kv_tile", None, KV_TILE)
    kernel = lower_attention(spec, key_layout=key_layout, kv_element=element,
                             rows=tuned("mlir_attention_rows", None, ROWS), kv_tile=kv_tile)
    return (f"// ---- lowered attention kernel: {spec!r}, key layout {key_layout!r} (kv_layout {layout!r}), "
            f"kv element {element}, padded head dim {kernel.head_dim_padded}\n{kernel.text}")
