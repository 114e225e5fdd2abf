"""tessera's GGUF reader and de-quantizer against gguf-py (the oracle), and the reader's errors on malformed or
hostile headers: each names the file and the field, and none allocates or loops on a claimed count."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from tessera.models import CheckpointError, load_model
from tessera.models.gguf import load_gguf
from tessera.models.gguf_dequant import dequantize
from tessera.models.gguf_reader import GGUFFormatError, read_gguf

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType

# key -> (value, GGUF type, array item type): one of every scalar type, strings, and arrays of each kind
METADATA = {
    "t.u8": (200, V.UINT8, None), "t.i8": (-7, V.INT8, None), "t.u16": (60000, V.UINT16, None),
    "t.i16": (-30000, V.INT16, None), "t.u32": (4_000_000_000, V.UINT32, None),
    "t.i32": (-2_000_000_000, V.INT32, None), "t.f32": (0.1, V.FLOAT32, None), "t.bool": (True, V.BOOL, None),
    "t.u64": (2**63 + 5, V.UINT64, None), "t.i64": (-(2**62), V.INT64, None), "t.f64": (1e-300, V.FLOAT64, None),
    "t.str": ("héllo 世界 🙂", V.STRING, None), "t.empty_str": ("", V.STRING, None),
    "t.tokens": (["<s>", "Ġthe", "", "naïve", "🙂", "a b"], V.ARRAY, V.STRING),
    "t.scores": ([0.5, -1.25, 3.0], V.ARRAY, V.FLOAT32), "t.types": ([1, 3, 4, 1], V.ARRAY, V.INT32),
    "t.flags": ([True, False, True], V.ARRAY, V.BOOL), "t.big": ([2**64 - 1, 0], V.ARRAY, V.UINT64),
    "t.f64s": ([1.5, -2.25], V.ARRAY, V.FLOAT64), "t.i16s": ([-1, 2, -3], V.ARRAY, V.INT16),
}


def write_all_types(path: Path, alignment: int | None = None) -> Path:
    """A GGUF with every metadata value type and tensors of float, integer and quantized types, 1- to 3-D."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment:
        w.add_custom_alignment(alignment)
    for key, (value, vtype, sub) in METADATA.items():
        w.add_key_value(key, value, vtype, sub)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f32_1d", x[0].copy())
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("f32_3d", rng.standard_normal((2, 3, 32)).astype(np.float32))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.add_tensor("i8", np.arange(-8, 8, dtype=np.int8))
    w.add_tensor("bf16", gguf.quants.quantize(x, Q.BF16), raw_dtype=Q.BF16)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        w.add_tensor(qtype.name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    block, nbytes = gguf.GGML_QUANT_SIZES[Q.Q4_K]  # gguf-py cannot quantize K-quants: random blocks, small scales
    w.add_tensor("Q4_K", rng.integers(0, 64, (8, 256 // block * nbytes), dtype=np.uint8), raw_dtype=Q.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64], ids=["default-alignment", "alignment-64"])
def test_reader_matches_gguf_py(tmp_path, alignment):
    path = write_all_types(tmp_path / "all.gguf", alignment)
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    theirs = {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(theirs)
    for key, value in theirs.items():
        assert ours.metadata[key] == value and type(ours.metadata[key]) is type(value), key
    for key, (value, vtype, _) in METADATA.items():
        if vtype != V.FLOAT32 and not (vtype == V.ARRAY and key == "t.scores"):
            assert ours.metadata[key] == value, key
    assert ours.data_offset == ref.data_offset and ours.alignment == ref.alignment
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for mine, t in zip(ours.tensors, ref.tensors):
        assert (mine.tensor_type, mine.ne, mine.offset, mine.n_bytes) == \
            (t.tensor_type, tuple(t.shape.tolist()), t.data_offset, t.n_bytes), t.name
        assert mine.data.dtype == t.data.dtype and mine.data.shape == t.data.shape, t.name
        assert np.array_equal(mine.data.view(np.uint8), t.data.view(np.uint8)), t.name


def test_reader_matches_gguf_py_on_smollm2():
    from tessera.models.model import default_model_path

    try:
        path = default_model_path()
    except FileNotFoundError as err:
        pytest.skip(str(err))
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    for key, field in ref.fields.items():
        if not key.startswith("GGUF."):
            assert ours.metadata[key] == field.contents(), key
    for mine, t in zip(ours.tensors, ref.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.offset) == (t.name, t.tensor_type, t.data_offset)
        assert mine.ne == tuple(t.shape.tolist()) and np.array_equal(mine.data, t.data), t.name


def test_ggml_types_match_gguf_py():
    from tessera.models.ggml_types import BLOCK_SIZES, GGMLType

    assert {t.name: int(t) for t in GGMLType} == {t.name: int(t) for t in Q}
    assert {t.name: size for t, size in BLOCK_SIZES.items()} == {t.name: s for t, s in gguf.GGML_QUANT_SIZES.items()}


def test_loading_a_gguf_file_does_not_import_gguf_py(tmp_path):
    """gguf-py's import costs ~0.1 s of start-up; the loader needs it only for types it has no rule for."""
    import subprocess
    import sys

    path = write_all_types(tmp_path / "all.gguf")
    code = ("import sys; from tessera.models.gguf_reader import read_gguf; from tessera.models.gguf_dequant import "
            f"dequantize; t = read_gguf({str(path)!r}).tensor_index['Q8_0']; dequantize(t.data, t.tensor_type, "
            "t.shape); print('gguf' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_nested_arrays(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "n.gguf"), "llama")
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_array("t.nested_str", [["a", "bc"], ["d"]])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    meta = read_gguf(tmp_path / "n.gguf").metadata
    assert meta["t.nested"] == [[1, 2], [3]] and meta["t.nested_str"] == [["a", "bc"], ["d"]]


def test_tensor_views_are_copy_on_write(tmp_path):
    """The loader's float32 weights share the file's pages, and writing to one never reaches the file."""
    path = write_all_types(tmp_path / "all.gguf")
    before = path.read_bytes()
    f32 = read_gguf(path).tensor_index["f32"]
    view = torch.from_numpy(f32.data)
    view.zero_()
    assert path.read_bytes() == before
    assert np.array_equal(read_gguf(path).tensor_index["f32"].data, gguf.GGUFReader(path).tensors[0].data)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K],
                         ids=lambda q: q.name)
def test_dequantize_bit_equal_to_gguf_py(tmp_path, qtype):
    path = write_all_types(tmp_path / "all.gguf")
    name = {Q.F32: "f32", Q.F16: "f16", Q.BF16: "bf16"}.get(qtype, qtype.name)
    t = read_gguf(path).tensor_index[name]
    ref = np.asarray(gguf.quants.dequantize(t.data, qtype), dtype=np.float32).reshape(t.shape)
    got = dequantize(t.data, qtype, t.shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == t.shape
    assert np.array_equal(got.numpy().view(np.uint32), ref.view(np.uint32))


# ---------------------------------------------------------------------------------------------- hostile headers
def kv_bytes(key: str, vtype: int, payload: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", vtype) + payload


def header(n_tensors: int, n_kv: int, version: int = 3, magic: bytes = b"GGUF") -> bytes:
    return magic + struct.pack("<IQQ", version, n_tensors, n_kv)


def tensor_entry(name: str, ne: tuple[int, ...], qtype: int, offset: int) -> bytes:
    return (struct.pack("<Q", len(name)) + name.encode() + struct.pack("<I", len(ne)) +
            struct.pack(f"<{len(ne)}Q", *ne) + struct.pack("<IQ", qtype, offset))


ARCH = kv_bytes("general.architecture", 8, struct.pack("<Q", 5) + b"llama")


def one_tensor_file(entry: bytes, data: bytes = b"\0" * 256) -> bytes:
    body = header(1, 1) + ARCH + entry
    return body + b"\0" * (-len(body) % 32) + data


HOSTILE = {
    # name: (file bytes, regex the message must match besides the file name)
    "tensor-count-2^60": (header(2**60, 0) + b"\0" * 64, r"tensor_count claims 1152921504606846976 tensor index "
                                                         r"entries, but the 64 bytes left in the file hold at most 2"),
    "kv-count-2^60": (header(0, 2**60) + b"\0" * 64, r"kv_count claims 1152921504606846976 key/value pairs, but the "
                                                     r"64 bytes left in the file hold at most 4"),
    "array-count-2^60": (header(0, 1) + kv_bytes("a.tokens", 9, struct.pack("<IQ", 8, 2**60)) + b"\0" * 40,
                         r"length of metadata array 'a.tokens' claims 1152921504606846976 items, but the 40 bytes"),
    "string-length-2^60": (header(0, 1) + kv_bytes("a.name", 8, struct.pack("<Q", 2**60)) + b"abc",
                           r"the value of metadata key 'a.name' needs 1152921504606846976 bytes at offset \d+, but "
                           r"the file ends at \d+"),
    "key-length-2^60": (header(0, 1) + struct.pack("<Q", 2**60) + b"\0" * 16,
                        r"a metadata key needs 1152921504606846976 bytes"),
    "unknown-value-type": (header(0, 1) + kv_bytes("a.x", 99, b"\0" * 8), r"metadata key 'a.x' has value type 99"),
    "unknown-array-item-type": (header(0, 1) + kv_bytes("a.x", 9, struct.pack("<IQ", 42, 1)) + b"\0" * 8,
                                r"metadata array 'a.x' has item type 42"),
    "duplicate-key": (header(0, 2) + kv_bytes("a.x", 4, b"\1\0\0\0") * 2, r"metadata key 'a.x' appears twice"),
    "bad-alignment": (header(0, 1) + kv_bytes("general.alignment", 4, struct.pack("<I", 24)),
                      r"general.alignment = 24 is not a power of two"),
    "alignment-type": (header(0, 1) + kv_bytes("general.alignment", 10, struct.pack("<Q", 32)),
                       r"general.alignment has value type 10, it must be UINT32"),
    "bad-utf8": (header(0, 1) + kv_bytes("a.x", 8, struct.pack("<Q", 2) + b"\xff\xfe"),
                 r"the value of metadata key 'a.x' at byte \d+ is not valid UTF-8"),
    "bad-utf8-in-array": (header(0, 1) + kv_bytes("a.t", 9, struct.pack("<IQQ", 8, 1, 1) + b"\xff"),
                          r"string 0 of metadata array 'a.t' is not valid UTF-8"),
    "string-array-truncated": (header(0, 1) + kv_bytes("a.t", 9, struct.pack("<IQQ", 8, 2, 3) + b"abc" +
                                                       struct.pack("<Q", 9) + b"de"),
                               r"string 1 of metadata array 'a.t' runs past the end of the file"),
    "too-many-dims": (one_tensor_file(tensor_entry("w", (32, 1, 1, 1, 1), 0, 0)),
                      r"tensor 'w' claims 5 dimensions; ggml tensors have at most 4"),
    "unknown-tensor-type": (one_tensor_file(tensor_entry("w", (32,), 77, 0)), r"tensor 'w' has ggml type 77"),
    "tensor-past-end": (one_tensor_file(tensor_entry("w", (64, 2**40), 0, 0)),
                        r"tensor 'w' \(F32, ne = \[64, 1099511627776\]\) needs bytes \d+\.\.\d+, but the file has "
                        r"\d+; it is truncated"),
    "misaligned-tensor": (one_tensor_file(tensor_entry("w", (8,), 0, 4)),
                          r"tensor 'w' starts at data offset 4, not a multiple of the file's alignment 32"),
    "partial-block": (one_tensor_file(tensor_entry("w", (40,), int(Q.Q8_0), 0)),
                      r"tensor 'w' \(Q8_0\) has rows of 40 values, not a multiple of the type's block of 32"),
    "duplicate-tensor": (header(2, 0) + tensor_entry("w", (8,), 0, 0) * 2 + b"\0" * 64,
                         r"tensor 'w' appears twice in the tensor index"),
    "version-1": (header(0, 0, version=1), r"GGUF version field is 0x1; supported versions: \[2, 3\]"),
    "big-endian": (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), r"the file is big-endian"),
    "bad-magic": (b"GGML" + b"\0" * 40, r"is not a GGUF file: it starts with b'GGML'"),
    "empty": (b"", r"is not a GGUF file: it starts with b''"),
    "header-truncated": (b"GGUF\3\0\0\0", r"is truncated: 8 bytes, a GGUF header takes 24"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_header_raises_a_clear_error(tmp_path, case):
    data, message = HOSTILE[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFFormatError, match=message) as err:
        read_gguf(path)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("case", ["tensor-count-2^60", "kv-count-2^60", "unknown-value-type", "bad-magic"])
def test_load_model_reports_header_errors_as_checkpoint_errors(tmp_path, case):
    """What the user sees through load_model: a CheckpointError (a ValueError) naming the file, never a KeyError."""
    data, message = HOSTILE[case]
    path = tmp_path / f"{case}.gguf"
    path.write_bytes(data)
    with pytest.raises(CheckpointError, match=message) as err:
        load_model(path)
    assert isinstance(err.value, ValueError) and str(path) in str(err.value)


def test_every_truncation_raises_a_format_error(tmp_path):
    """A file cut anywhere (header, metadata, tensor index, data) raises GGUFFormatError and nothing else."""
    full = write_all_types(tmp_path / "all.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    parsed = read_gguf(tmp_path / "all.gguf")
    data_end = max(t.offset + t.n_bytes for t in parsed.tensors)  # the writer pads the file after the last tensor
    for end in sorted({*range(0, parsed.data_offset, 7), parsed.data_offset + 1, data_end - 1}):
        cut.write_bytes(full[:end])
        with pytest.raises(GGUFFormatError, match="cut.gguf"):
            read_gguf(cut)


def test_corrupted_headers_never_raise_anything_else(tmp_path):
    """Random byte changes in the header either parse or raise GGUFFormatError (no KeyError, IndexError,
    OverflowError or MemoryError)."""
    full = bytearray(write_all_types(tmp_path / "all.gguf").read_bytes())
    header_end = read_gguf(tmp_path / "all.gguf").data_offset
    rng = np.random.default_rng(1)
    bad = tmp_path / "bad.gguf"
    for _ in range(300):
        data = bytearray(full)
        for at in rng.integers(4, header_end, size=int(rng.integers(1, 4))):
            data[at] = int(rng.integers(0, 256))
        bad.write_bytes(bytes(data))
        try:
            read_gguf(bad)
        except GGUFFormatError:
            pass


def test_load_gguf_rejects_truncated_tensor_data(tmp_path):
    from tests.models.test_gguf import write_tiny

    path = write_tiny(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"t\.gguf: tensor 'blk\.1\.ffn_down\.weight' .* it is truncated"):
        load_gguf(path)
