"""A fast reader of a GGUF file's header: metadata and tensor index parsed in one pass, tensor data memory-mapped.

gguf-py's ``GGUFReader`` builds a numpy memmap slice for every integer and every string of the header, which takes
seconds for a 49k-token vocabulary. This reader walks the same bytes with ``struct`` and reads numeric arrays with
one ``numpy.frombuffer`` each; a string array (the vocabulary, the merges) is a loop of slice-and-decode, about
0.3 microseconds a string. Every count and length is checked against the bytes left in the file before it is used,
so a hostile or truncated header raises :class:`GGUFFormatError` naming the file, the field and the limit instead
of allocating or looping on a claimed 2^60 entries.

Tensor data is not read: each :class:`TensorInfo` holds a numpy view of the mapped file (a private copy-on-write
mapping, so the views are writable and ``torch.from_numpy`` can share them without copying; a write stays in this
process's memory and never reaches the file). The mapping lives as long as any view of it does.

>>> f = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")
>>> f.metadata["general.architecture"], len(f.metadata["tokenizer.ggml.tokens"])
('llama', 49152)
>>> q = f.tensor_index["blk.0.attn_q.weight"]
>>> q.tensor_type.name, q.ne, q.shape, q.data.shape
('Q4_1', (576, 576), (576, 576), (576, 360))
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tessera.models.ggml_types import BLOCK_SIZES, GGMLType

MAGIC = b"GGUF"
#: versions 2 and 3 share one layout (64-bit counts and lengths); version 1 used 32-bit ones
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
#: ggml tensors have at most four dimensions (GGML_MAX_DIMS)
MAX_DIMS = 4
# magic, version, tensor count, key/value count
_HEADER = struct.Struct("<4sIQQ")

# GGUF value type id -> (name, struct format) of the scalar types; 8 is a string, 9 an array
_SCALARS = {0: ("UINT8", "<B"), 1: ("INT8", "<b"), 2: ("UINT16", "<H"), 3: ("INT16", "<h"), 4: ("UINT32", "<I"),
            5: ("INT32", "<i"), 6: ("FLOAT32", "<f"), 7: ("BOOL", "<?"), 10: ("UINT64", "<Q"), 11: ("INT64", "<q"),
            12: ("FLOAT64", "<d")}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_NUMPY = {t: np.dtype(fmt) for t, (_, fmt) in _SCALARS.items()}
# The fewest bytes one value of a type takes: what a claimed count is checked against (a string is its u64 length,
# an array its u32 item type and u64 count).
_MIN_BYTES = {**{t: struct.calcsize(fmt) for t, (_, fmt) in _SCALARS.items()}, _STRING: 8, _ARRAY: 12}
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a one-byte value
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8  # name length, n_dims, type, offset (a 0-d tensor, empty name)
# Types gguf-py reads as typed arrays; every other type is kept as its raw bytes (uint8), as gguf-py does.
_ELEMENT_DTYPES = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.F64: np.float64, GGMLType.I8: np.int8,
                   GGMLType.I16: np.int16, GGMLType.I32: np.int32, GGMLType.I64: np.int64}


class GGUFFormatError(ValueError):
    """The file is not a well-formed GGUF file: bad magic or version, truncated, or a header field out of bounds."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor index, with its data as a view of the mapped file.

    Attributes
    ----------
    name : str
    tensor_type : GGMLType
    ne : tuple[int, ...]
        Dimensions as GGUF lists them, fastest-varying first (``ne = (K, N)`` for an ``[N, K]`` matrix).
    offset : int
        Absolute byte offset of the data in the file.
    n_bytes : int
    data : numpy.ndarray
        The bytes at ``offset`` as gguf-py's ``ReaderTensor.data`` shows them: a typed array of shape ``shape`` for
        F32/F16/F64/I8/I16/I32/I64, else uint8 rows of ``ne[0] // block_size * type_size`` bytes.
    """

    name: str
    tensor_type: GGMLType
    ne: tuple[int, ...]
    offset: int
    n_bytes: int
    data: np.ndarray

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (numpy / torch) shape: ``ne`` reversed."""
        return tuple(reversed(self.ne))

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=object)) if self.ne else 1


@dataclass(frozen=True)
class GGUFFile:
    """A parsed GGUF header.

    Attributes
    ----------
    path : Path
    version : int
    metadata : dict[str, Any]
        Key -> value in file order: int, float, bool, str, or a list of them for an array (nested lists for
        arrays of arrays), the values gguf-py's ``ReaderField.contents()`` gives.
    tensors : tuple[TensorInfo, ...]
        The tensor index in file order (as gguf-py's ``GGUFReader.tensors``).
    alignment : int
    data_offset : int
        Where the tensor data section starts (tensor offsets are relative to it in the file, absolute here).
    """

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: tuple[TensorInfo, ...]
    alignment: int
    data_offset: int
    #: the private mapping the tensors' views point into (None for a file read another way)
    mapping: mmap.mmap | None = None

    def release_pages(self) -> None:
        """Drop the mapping's pages from this process's resident set once the weights that needed copies have them.

        The mapping is private and nothing has written to it, so the kernel simply re-reads from the file (or the
        page cache) any page a view still touches: the views stay valid, and only what they read comes back. Called
        by the loader right after it gathers the weights; never after a weight that is a view could have been
        written (a written page is the process's own, and this would drop the write)."""
        if self.mapping is not None and hasattr(mmap, "MADV_DONTNEED"):
            try:
                self.mapping.madvise(mmap.MADV_DONTNEED)
            except (OSError, ValueError):  # an advice the platform refuses costs only memory
                pass

    @property
    def tensor_index(self) -> dict[str, TensorInfo]:
        """Tensor name -> entry."""
        return {t.name: t for t in self.tensors}


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of the GGUF file at ``path`` and map its tensor data.

    Raises
    ------
    FileNotFoundError
        No file at ``path``.
    GGUFFormatError
        Bad magic, unsupported version or byte order, a count, length or offset beyond the file's end, an unknown
        value or tensor type, a duplicate key or tensor name, or a misaligned tensor; the message names the file
        and the field.
    """
    path = Path(path)
    with path.open("rb") as f:
        size = f.seek(0, 2)
        if size < _HEADER.size:
            f.seek(0)
            magic = f.read(4)
            if magic != MAGIC:
                raise GGUFFormatError(f"{path} is not a GGUF file: it starts with {magic!r}, a GGUF file with "
                                      f"{MAGIC!r}")
            raise GGUFFormatError(f"{path} is truncated: {size} bytes, a GGUF header takes {_HEADER.size}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return _Parser(path, buf).parse()


class _Parser:
    """A cursor over the mapped bytes; every read checks the bytes it needs are there."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.size, self.pos = path, buf, len(buf), 0

    # ------------------------------------------------------------------------------------------------ structure
    def parse(self) -> GGUFFile:
        magic, version, n_tensors, n_kv = _HEADER.unpack_from(self.buf, 0)
        if magic != MAGIC:
            raise GGUFFormatError(f"{self.path} is not a GGUF file: it starts with {magic!r}, a GGUF file with "
                                  f"{MAGIC!r}")
        if version not in SUPPORTED_VERSIONS:
            swapped = version & 0xFFFF == 0  # a big-endian writer's version reads as 0x0N000000 here
            raise GGUFFormatError(
                f"{self.path}: GGUF version field is {version:#x}; " + (
                    "the file is big-endian, and only little-endian GGUF files are read" if swapped else
                    f"supported versions: {list(SUPPORTED_VERSIONS)}"))
        self.pos = _HEADER.size
        self._check_count("header field tensor_count", n_tensors, _MIN_TENSOR_BYTES, "tensor index entries")
        self._check_count("header field kv_count", n_kv, _MIN_KV_BYTES, "key/value pairs")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string("a metadata key")
            value_type = self._u32(f"the type of metadata key {key!r}")
            value = self._value(value_type, key)
            if key in metadata:
                raise GGUFFormatError(f"{self.path}: metadata key {key!r} appears twice; the file is corrupt")
            metadata[key] = value
            if key == "general.alignment" and value_type != _UINT32:
                raise GGUFFormatError(f"{self.path}: general.alignment has value type {value_type}, it must be "
                                      f"UINT32 ({_UINT32})")
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{self.path}: general.alignment = {alignment} is not a power of two")
        index = [self._tensor_entry() for _ in range(n_tensors)]
        data_offset = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, offset in index:
            if name in tensors:
                raise GGUFFormatError(f"{self.path}: tensor {name!r} appears twice in the tensor index")
            tensors[name] = self._tensor(name, ne, type_id, offset, data_offset, alignment)
        return GGUFFile(self.path, version, metadata, tuple(tensors.values()), alignment, data_offset, self.buf)

    def _tensor_entry(self) -> tuple[str, tuple[int, ...], int, int]:
        name = self._string("a tensor name")
        n_dims = self._u32(f"n_dims of tensor {name!r}")
        if n_dims > MAX_DIMS:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} claims {n_dims} dimensions; ggml tensors have at "
                                  f"most {MAX_DIMS}")
        self._need(8 * n_dims + 12, f"the shape, type and offset of tensor {name!r}")
        ne = struct.unpack_from(f"<{n_dims}Q", self.buf, self.pos)
        type_id, offset = struct.unpack_from("<IQ", self.buf, self.pos + 8 * n_dims)
        self.pos += 8 * n_dims + 12
        return name, ne, type_id, offset

    def _tensor(self, name: str, ne: tuple[int, ...], type_id: int, offset: int, data_offset: int,
                alignment: int) -> TensorInfo:
        try:
            qtype = GGMLType(type_id)
            block, type_size = BLOCK_SIZES[qtype]
        except (ValueError, KeyError):
            raise GGUFFormatError(f"{self.path}: tensor {name!r} has ggml type {type_id}, which is not a known "
                                  f"type (known: {[t.name for t in GGMLType]})") from None
        row = ne[0] if ne else 1
        if row % block:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} ({qtype.name}) has rows of {row} values, not a "
                                  f"multiple of the type's block of {block}")
        n_elements = 1
        for n in ne:
            n_elements *= n
        n_bytes = n_elements // block * type_size
        start = data_offset + offset
        if offset % alignment:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} starts at data offset {offset}, not a multiple of "
                                  f"the file's alignment {alignment}")
        if start + n_bytes > self.size:
            raise GGUFFormatError(f"{self.path}: tensor {name!r} ({qtype.name}, ne = {list(ne)}) needs bytes "
                                  f"{start}..{start + n_bytes}, but the file has {self.size}; it is truncated")
        dtype = _ELEMENT_DTYPES.get(qtype)
        if dtype is not None:
            data = np.frombuffer(self.buf, dtype, n_elements, start).reshape(tuple(reversed(ne)) or ())
        else:
            shape = (*reversed(ne[1:]), row // block * type_size)
            data = np.frombuffer(self.buf, np.uint8, n_bytes, start).reshape(shape)
        return TensorInfo(name, qtype, tuple(int(n) for n in ne), start, n_bytes, data)

    # ------------------------------------------------------------------------------------------------ values
    def _value(self, value_type: int, key: str) -> Any:
        scalar = _SCALARS.get(value_type)
        if scalar is not None:
            size = _MIN_BYTES[value_type]
            self._need(size, f"the value of metadata key {key!r}")
            (value,) = struct.unpack_from(scalar[1], self.buf, self.pos)
            self.pos += size
            return value
        if value_type == _STRING:
            return self._string(f"the value of metadata key {key!r}")
        if value_type == _ARRAY:
            return self._array(key)
        raise GGUFFormatError(f"{self.path}: metadata key {key!r} has value type {value_type}, which is not a GGUF "
                              f"value type (0-12)")

    def _array(self, key: str) -> list[Any]:
        self._need(12, f"the item type and count of metadata array {key!r}")
        item_type, count = struct.unpack_from("<IQ", self.buf, self.pos)
        self.pos += 12
        if item_type not in _MIN_BYTES:
            raise GGUFFormatError(f"{self.path}: metadata array {key!r} has item type {item_type}, which is not a "
                                  f"GGUF value type (0-12)")
        self._check_count(f"the length of metadata array {key!r}", count, _MIN_BYTES[item_type], "items")
        if item_type in _NUMPY:  # one read for the whole array
            dtype = _NUMPY[item_type]
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if item_type == _STRING:
            return self._strings(count, key)
        return [self._array(f"{key}[{i}]") for i in range(count)]

    def _strings(self, count: int, key: str) -> list[str]:
        """``count`` length-prefixed strings: the loop a vocabulary takes (~15 ms for 49k tokens)."""
        buf, pos, size = self.buf, self.pos, self.size
        unpack = struct.Struct("<Q").unpack_from
        out: list[str] = []
        append = out.append
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    break
                append(buf[pos:pos + n].decode("utf-8"))
                pos += n
        except struct.error:  # a length prefix past the end: reported below as a short array
            pass
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"{self.path}: string {len(out)} of metadata array {key!r} is not valid UTF-8 "
                                  f"({err.reason} at byte {err.start})") from None
        if len(out) < count:
            raise GGUFFormatError(f"{self.path}: string {len(out)} of metadata array {key!r} runs past the end of "
                                  f"the file ({size} bytes); the file is truncated or corrupt")
        self.pos = pos
        return out

    def _string(self, what: str) -> str:
        n = self._u64(f"the length of {what}")
        self._need(n, what)
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise GGUFFormatError(f"{self.path}: {what} at byte {self.pos - n} is not valid UTF-8 "
                                  f"({err.reason})") from None

    def _u32(self, what: str) -> int:
        self._need(4, what)
        (value,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return value

    def _u64(self, what: str) -> int:
        self._need(8, what)
        (value,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return value

    # ------------------------------------------------------------------------------------------------ bounds
    def _need(self, n: int, what: str) -> None:
        if self.pos + n > self.size:
            raise GGUFFormatError(f"{self.path}: {what} needs {n} bytes at offset {self.pos}, but the file ends at "
                                  f"{self.size}; it is truncated or corrupt")

    def _check_count(self, field: str, count: int, min_bytes: int, things: str) -> None:
        """A claimed count must fit in the bytes left: each item takes at least ``min_bytes``."""
        limit = (self.size - self.pos) // min_bytes
        if count > limit:
            raise GGUFFormatError(f"{self.path}: {field} claims {count} {things}, but the "
                                  f"{self.size - self.pos} bytes left in the file hold at most {limit} (each takes "
                                  f"at least {min_bytes} bytes); the file is truncated or corrupt")
