"""Reading a GGUF file's header: its metadata and where each tensor's bytes are, checked against the file.

A GGUF is: the magic `GGUF`, a version (2 or 3), the tensor and key counts, the key/value metadata
(typed values; strings and arrays carry their lengths), one record per tensor (name, dimensions with
the fastest-moving first, ggml type, offset into the data section), then the data section at the next
multiple of `general.alignment` (32 by default). Everything is little-endian.

Why not `gguf.GGUFReader` (llama.cpp's own reader, which the `gguf` package ships and whose type table
this module uses): it builds a numpy view for every string of every array, 5 s for the 100k tokenizer
strings of a 98 MB model on this project's 2-core CI machine, where this reader takes a tenth of a
second. And MLX's own reader (`mx.load(path)`) reads every tensor into memory at once and maps the file
without checking it first: a truncated file would fault on the read past its end (SIGBUS), not raise.
So nothing reads tensor bytes before `read_header` has checked that every tensor lies inside the file.

Every problem is a `GgufError` with one line that names the file's fault (not a GGUF, truncated, a
tensor past the end, an unknown type), never a struct or numpy traceback.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# Bounds no real file comes near; a garbled count must fail on them, not allocate its value.
MAX_TENSORS = 1 << 20
MAX_KEYS = 1 << 20
MAX_DIMS = 4

_SCALARS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"), GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"), GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"), GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"), GGUFValueType.BOOL: struct.Struct("<?"),
    GGUFValueType.UINT64: struct.Struct("<Q"), GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_NUMPY: dict[GGUFValueType, str] = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class GgufError(Exception):
    """A file that is not a GGUF this reader can use; the message is one line about the file."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy / MLX order: the slowest-moving dimension first
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(frozen=True, slots=True)
class GgufHeader:
    path: Path
    version: int
    metadata: dict[str, Any]  # numbers and strings as Python values, arrays as lists
    tensors: tuple[GgufTensor, ...]
    file_bytes: int

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise GgufError(f"{self.path.name}: no general.architecture in its metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


@dataclass(frozen=True, slots=True)
class Strings:
    """A string array read without its strings (`strings=False`): only how many there are."""

    count: int

    def __len__(self) -> int:
        return self.count


class _Cursor:
    """Reads values off the mapped header; any read past the end is a truncated file."""

    def __init__(self, view: memoryview, name: str, strings: bool) -> None:
        self.view = view
        self.pos = 0
        self.name = name
        self.strings = strings

    def _need(self, count: int) -> None:
        if count < 0 or self.pos + count > len(self.view):
            raise GgufError(f"{self.name}: truncated (the header ends past the file's {len(self.view)} bytes)")

    def unpack(self, fmt: struct.Struct) -> Any:
        self._need(fmt.size)
        (value,) = fmt.unpack_from(self.view, self.pos)
        self.pos += fmt.size
        return value

    def skip_string(self) -> None:
        length = self.unpack(_U64)
        self._need(length)
        self.pos += length

    def string(self) -> str:
        length = self.unpack(_U64)
        self._need(length)
        raw = bytes(self.view[self.pos:self.pos + length])
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")  # a vocabulary may hold partial byte sequences

    def value(self, kind: int) -> Any:
        value_type = _value_type(kind, self.name)
        if value_type is GGUFValueType.STRING:
            return self.string()
        if value_type is GGUFValueType.ARRAY:
            item = _value_type(self.unpack(_U32), self.name)
            count = self.unpack(_U64)
            if item in _NUMPY:
                width = np.dtype(_NUMPY[item]).itemsize
                self._need(count * width)
                array = np.frombuffer(self.view, dtype=_NUMPY[item], count=count, offset=self.pos)
                self.pos += count * width
                return array.tolist()
            if count > len(self.view):  # each element takes at least a byte
                raise GgufError(f"{self.name}: truncated (an array of {count} values in a smaller file)")
            if item is GGUFValueType.STRING and not self.strings:
                for _ in range(count):
                    self.skip_string()
                return Strings(count)
            return [self.value(item) for _ in range(count)]
        return self.unpack(_SCALARS[value_type])


def _value_type(kind: int, name: str) -> GGUFValueType:
    try:
        return GGUFValueType(kind)
    except ValueError:
        raise GgufError(f"{name}: unknown metadata value type {kind} (garbled, or a newer GGUF)") from None


def tensor_type(kind: int, name: str, tensor: str) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(kind)
    except ValueError:
        raise GgufError(f"{name}: tensor {tensor} has unknown ggml type {kind}") from None
    if qtype not in GGML_QUANT_SIZES:
        raise GgufError(f"{name}: tensor {tensor} has ggml type {qtype.name}, which has no block size")
    return qtype


def tensor_nbytes(qtype: GGMLQuantizationType, shape: tuple[int, ...], name: str, tensor: str) -> int:
    """Bytes of a tensor of `shape` (numpy order) in `qtype`'s blocks, along the last dimension."""
    block, size = GGML_QUANT_SIZES[qtype]
    if not shape or shape[-1] % block:
        raise GgufError(f"{name}: tensor {tensor} of {qtype.name} has {shape[-1] if shape else 0} columns, "
                        f"not a multiple of its {block}-value blocks")
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    return rows * (shape[-1] // block) * size


def parse_header(view: memoryview, path: Path, *, strings: bool = True) -> GgufHeader:
    """The checked header; `strings=False` keeps only the count of each string array (the tokenizer's
    hundreds of thousands of tokens and merges), for a listing that needs sizes, not the vocabulary."""
    name = path.name
    cur = _Cursor(view, name, strings)
    if len(view) < 4 or bytes(view[:4]) != MAGIC:
        raise GgufError(f"{name}: not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.unpack(_U32)
    if version not in VERSIONS:
        if int.from_bytes(version.to_bytes(4, "little"), "big") in VERSIONS:  # a big-endian file's version
            raise GgufError(f"{name}: a big-endian GGUF, which MLX cannot use")
        raise GgufError(f"{name}: GGUF version {version}; versions {VERSIONS[0]} and {VERSIONS[-1]} are read")
    tensor_count, key_count = cur.unpack(_U64), cur.unpack(_U64)
    if tensor_count > MAX_TENSORS or key_count > MAX_KEYS:
        raise GgufError(f"{name}: garbled header ({tensor_count} tensors, {key_count} metadata keys)")
    metadata: dict[str, Any] = {}
    for _ in range(key_count):
        key = cur.string()
        metadata[key] = cur.value(cur.unpack(_U32))
    records = []
    for _ in range(tensor_count):
        tensor = cur.string()
        dims = cur.unpack(_U32)
        if not 1 <= dims <= MAX_DIMS:
            raise GgufError(f"{name}: tensor {tensor} has {dims} dimensions")
        shape = tuple(reversed([cur.unpack(_U64) for _ in range(dims)]))
        records.append((tensor, shape, tensor_type(cur.unpack(_U32), name, tensor), cur.unpack(_U64)))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GgufError(f"{name}: general.alignment {alignment!r} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for tensor, shape, qtype, offset in records:
        nbytes = tensor_nbytes(qtype, shape, name, tensor)
        start = data_start + offset
        if start + nbytes > len(view):
            raise GgufError(f"{name}: truncated (tensor {tensor} ends at byte {start + nbytes}, "
                            f"the file has {len(view)})")
        tensors.append(GgufTensor(tensor, qtype, shape, start, nbytes))
    return GgufHeader(path, version, metadata, tuple(tensors), len(view))


@contextmanager
def opened(path: Path, *, strings: bool = True) -> Iterator[tuple[GgufHeader, memoryview]]:
    """The file mapped read-only: its checked header, and a view of its bytes for the tensors'
    (valid inside the block only)."""
    try:
        handle = open(path, "rb")
    except OSError as exc:
        raise GgufError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    with handle:
        try:
            mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise GgufError(f"{path.name}: not a GGUF file (it is empty)") from None
        except OSError as exc:
            raise GgufError(f"{path}: cannot be read ({exc.strerror or type(exc).__name__})") from None
        view = memoryview(mapped)
        try:
            yield parse_header(view, path, strings=strings), view
        finally:
            try:
                view.release()
                mapped.close()
            except BufferError:  # a numpy view of a tensor is still held: the map closes when it goes
                pass


def read_header(path: Path, *, strings: bool = True) -> GgufHeader:
    """The checked header alone (the file is closed again)."""
    with opened(path, strings=strings) as (header, _):
        return header


def tensor_data(view: memoryview, tensor: GgufTensor) -> np.ndarray:
    """The tensor's raw bytes (uint8, not copied): rows of its blocks."""
    return np.frombuffer(view, dtype=np.uint8, count=tensor.nbytes, offset=tensor.offset)


__all__ = ["GgufError", "GgufHeader", "GgufTensor", "Strings", "opened", "parse_header", "read_header", "tensor_data",
           "tensor_nbytes"]
