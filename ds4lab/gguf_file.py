"""Reading and writing GGUF model files (spec/DS4_MODEL.md §2).

``GGUFModelFile.open`` maps a file with ``gguf.GGUFReader`` and exposes its metadata as plain Python
values and its tensors as raw bytes, without copying. ``load_model_file`` adds the ds4 checks: the
metadata must give a valid :class:`ModelConfig`, every tensor must have the shape and type that config
implies, and the tokenizer must match the vocabulary. ``write_gguf`` writes a file atomically.

Tensor data layout (``TensorInfo.data``): a read-only ``uint8`` view of the mapped file with shape
``tensor_byte_shape(shape, qtype)`` = ``(ne[-1], ..., ne[1], row_bytes)``, the higher GGUF dims in
reverse (NumPy) order followed by the bytes of one ``ne0`` row. A 1-D tensor is ``(row_bytes,)``; a 2-D
weight ``(out, row_bytes)``; a 3-D expert tensor ``(n_expert, out, row_bytes)``. This holds for every
type, including F32, F16 and I32.
"""

from __future__ import annotations

import math
import os
import re
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q

from .config import ModelConfig, ModelFileError

SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.I32})

_MAGIC = b"GGUF"
_VERSION = 3
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count
_TOKENS_KEY = "tokenizer.ggml.tokens"
_MERGES_KEY = "tokenizer.ggml.merges"
# Entries the reader adds to its field table that are header values, not metadata keys.
_HEADER_FIELDS = frozenset({"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"})


class _Malformed(Exception):
    """A problem found while reading; ``GGUFModelFile.open`` prefixes the path."""


def tensor_byte_shape(shape: Sequence[int], qtype: Q) -> tuple[int, ...]:
    """The byte layout of a tensor with GGUF dims ``shape`` (ne0 first): ``(ne[-1], ..., ne[1], row_bytes)``."""
    block, type_size = GGML_QUANT_SIZES[qtype]
    ne0 = shape[0]
    if ne0 % block:
        raise ValueError(f"ne0 = {ne0} is not a multiple of the {qtype.name} block size {block}")
    return tuple(int(d) for d in reversed(shape[1:])) + (ne0 // block * type_size,)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF ne order, ne0 first
    qtype: Q
    data: np.ndarray  # uint8 view of the mapped file, shape tensor_byte_shape(shape, qtype)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass
class GGUFModelFile:
    path: Path
    metadata: dict[str, tuple[Any, str]]  # key -> (value, GGUFValueType name, "ARRAY[ELEM]" for arrays)
    tensors: dict[str, TensorInfo]
    alignment: int
    file_size: int

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFModelFile":
        """Map ``path`` read-only; raise :class:`ModelFileError` naming the file if it is not usable."""
        path = Path(path)
        try:
            file_size = _check_header(path)
            reader = _CheckedReader(path, "r")
            metadata = {f.name: _field_value(f) for f in reader.fields.values() if f.name not in _HEADER_FIELDS}
            tensors = {t.name: _tensor_info(reader, t) for t in reader.tensors}
        except _Malformed as e:
            raise ModelFileError(f"{path}: {e}") from None
        except Exception as e:  # whatever the reader trips over in a damaged file
            raise ModelFileError(f"{path}: damaged or truncated GGUF metadata or tensor directory "
                                 f"({type(e).__name__}: {e})") from e
        return cls(path, metadata, tensors, int(reader.alignment), file_size)


def load_model_file(path: str | os.PathLike) -> tuple[ModelConfig, GGUFModelFile]:
    """Open a ds4 GGUF and check it against its own metadata; returns (config, file) or raises."""
    file = GGUFModelFile.open(path)
    source = str(path)
    config = ModelConfig.from_metadata(file.metadata, source)
    config.validate_tensors({n: (t.shape, t.qtype) for n, t in file.tensors.items()}, source)
    _check_tokenizer(file.metadata, config.n_vocab, source)
    return config, file


def write_gguf(
    path: str | os.PathLike,
    metadata: Mapping[str, tuple[Any, str]],
    tensors: Iterable[tuple[str, Sequence[int], Q | str, np.ndarray]],
) -> Path:
    """Write a GGUF v3 file atomically: to a temporary file next to ``path``, then renamed over it.

    ``metadata`` maps key -> (value, type name) as :attr:`GGUFModelFile.metadata` gives it, and must
    contain ``general.architecture``. Each tensor is (name, GGUF dims ne0 first, type, raw uint8 bytes
    of size ``prod(tensor_byte_shape(dims, type))``, any shape). On failure nothing is left behind.
    """
    path = Path(path)
    arch, arch_type = metadata.get("general.architecture", (None, None))
    if arch_type != "STRING":
        raise ValueError("metadata needs general.architecture as a STRING")
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    writer = GGUFWriter(tmp, arch)
    try:
        _add_metadata(writer, metadata)
        for name, shape, qtype, raw in tensors:
            _add_tensor(writer, name, shape, qtype, raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, path)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return path


# -- reading -----------------------------------------------------------------------------------------


def _check_header(path: Path) -> int:
    """Refuse what the reader would misreport (it accepts v2 and cannot map an empty file); return the size."""
    if not path.exists():
        raise _Malformed("no such file")
    if not path.is_file():
        raise _Malformed("not a regular file")
    size = path.stat().st_size
    if size == 0:
        raise _Malformed("empty file")
    with path.open("rb") as f:
        head = f.read(_HEADER.size)
    if head[:4] != _MAGIC:
        raise _Malformed(f"not a GGUF file (magic {head[:4]!r}, expected {_MAGIC!r})")
    if len(head) < _HEADER.size:
        raise _Malformed(f"truncated GGUF header ({size} bytes)")
    _, version, n_tensors, n_keys = _HEADER.unpack(head)
    if version != _VERSION:
        raise _Malformed(f"GGUF version {version} is not supported (ds4 reads version {_VERSION} only)")
    # Every entry takes several bytes, so counts above the file size are garbage (and would make the
    # reader loop for a very long time).
    if n_tensors > size or n_keys > size:
        raise _Malformed(f"header claims {n_tensors} tensors and {n_keys} metadata keys, "
                         f"more than {size} bytes can hold")
    return size


class _CheckedReader(GGUFReader):
    """GGUFReader that checks each tensor's type and extent before the base class maps its data.

    The base class would otherwise fail on a truncated file with a bare reshape error.
    """

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        extents = sorted(_tensor_extent(f, start_offs, len(self.data), int(self.alignment)) for f in fields)
        for (start_a, end_a, name_a), (start_b, _, name_b) in zip(extents, extents[1:]):
            if start_b < end_a:
                raise _Malformed(f"tensor {name_a} needs {end_a - start_a} bytes by its shape and type, "
                                 f"but tensor {name_b} starts {start_b - start_a} bytes after it")
        super()._build_tensors(start_offs, fields)


def _tensor_extent(field, data_start: int, file_size: int, alignment: int) -> tuple[int, int, str]:
    """(start, end, name) of a tensor directory entry; refuses unknown types and data past the end."""
    _, name_data, _, dims, raw_type, offset = field.parts
    name = bytes(name_data).decode("utf-8", errors="replace")
    type_id = int(raw_type[0])
    try:
        qtype = Q(type_id)
    except ValueError:
        raise _Malformed(f"tensor {name} has unknown GGML type id {type_id}") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise _Malformed(f"tensor {name} has type {qtype.name}, which ds4lab does not read (supported: {names})")
    shape = [int(d) for d in dims]
    if not 1 <= len(shape) <= 4:
        raise _Malformed(f"tensor {name} has {len(shape)} dimensions, expected 1 to 4")
    try:
        nbytes = math.prod(tensor_byte_shape(shape, qtype))
    except ValueError as e:
        raise _Malformed(f"tensor {name}: {e}, so its byte size disagrees with its shape and type") from None
    rel = int(offset[0])
    if rel % alignment:
        raise _Malformed(f"tensor {name}: data offset {rel} is not a multiple of the alignment {alignment}")
    start = data_start + rel
    if start + nbytes > file_size:
        raise _Malformed(f"tensor {name}: data bytes {start}..{start + nbytes} extend past the end of the file "
                         f"({file_size} bytes); the file is truncated")
    return start, start + nbytes, name


def _tensor_info(reader: GGUFReader, t) -> TensorInfo:
    shape = tuple(int(d) for d in t.shape)
    qtype = Q(t.tensor_type)
    byte_shape = tensor_byte_shape(shape, qtype)
    data = reader.data[t.data_offset:t.data_offset + math.prod(byte_shape)].reshape(byte_shape)
    return TensorInfo(t.name, shape, qtype, data)


def _field_value(field) -> tuple[Any, str]:
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        # parts = [key length, key, value type, element type, count, ...]; reading the element type
        # here (not from field.types) also works for empty arrays.
        elem = GGUFValueType(int(field.parts[3][0]))
        values = field.contents()
        if elem == GGUFValueType.FLOAT32:
            values = [_f32(v) for v in values]
        return values, f"ARRAY[{elem.name}]"
    value = field.contents()
    return (_f32(value) if vtype == GGUFValueType.FLOAT32 else value), vtype.name


def _f32(value: float) -> float:
    """The shortest decimal that rounds to the same float32, so 1e-6 written as FLOAT32 reads back as 1e-6."""
    return float(str(np.float32(value)))


def _check_tokenizer(meta: Mapping[str, tuple[Any, str]], n_vocab: int, source: str) -> None:
    for key in (_TOKENS_KEY, _MERGES_KEY):
        if key not in meta:
            raise ModelFileError(f"{source}: metadata key {key} is missing")
        if meta[key][1] != "ARRAY[STRING]":
            raise ModelFileError(f"{source}: metadata key {key} has type {meta[key][1]}, expected ARRAY[STRING]")
    n_tokens = len(meta[_TOKENS_KEY][0])
    if n_tokens != n_vocab:
        raise ModelFileError(f"{source}: metadata key {_TOKENS_KEY} has {n_tokens} tokens, "
                             f"but deepseek4.vocab_size is {n_vocab}")


# -- writing -----------------------------------------------------------------------------------------


def _value_type(key: str, type_name: str) -> tuple[GGUFValueType, GGUFValueType | None]:
    """"UINT32" -> (UINT32, None); "ARRAY[FLOAT32]" -> (ARRAY, FLOAT32)."""
    m = re.fullmatch(r"ARRAY\[(\w+)\]", type_name)
    try:
        if m:
            return GGUFValueType.ARRAY, GGUFValueType[m.group(1)]
        vtype = GGUFValueType[type_name]
    except KeyError:
        vtype = None
    if vtype in (None, GGUFValueType.ARRAY):
        raise ValueError(f"metadata key {key}: unknown GGUF type name {type_name!r}")
    return vtype, None


def _add_metadata(writer: GGUFWriter, metadata: Mapping[str, tuple[Any, str]]) -> None:
    for key, (value, type_name) in metadata.items():
        if key == "general.architecture":
            continue  # the writer adds it from its arch argument
        vtype, sub_type = _value_type(key, type_name)
        if key == "general.alignment":
            if vtype != GGUFValueType.UINT32:
                raise ValueError(f"metadata key general.alignment has type {type_name}, expected UINT32")
            writer.add_custom_alignment(int(value))  # also pads the tensor data to it
        else:
            writer.add_key_value(key, list(value) if sub_type else value, vtype, sub_type)


def _add_tensor(writer: GGUFWriter, name: str, shape: Sequence[int], qtype: Q | str, raw: np.ndarray) -> None:
    qtype = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    shape = tuple(int(d) for d in shape)
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"tensor {name}: data must be raw uint8 bytes, got {raw.dtype}")
    try:
        byte_shape = tensor_byte_shape(shape, qtype)
    except ValueError as e:
        raise ValueError(f"tensor {name}: {e}") from None
    if raw.size != math.prod(byte_shape):
        raise ValueError(f"tensor {name}: {raw.size} bytes given, but shape {shape} of type {qtype.name} "
                         f"takes {math.prod(byte_shape)}")
    # GGUFWriter takes the NumPy (reversed) byte shape and derives ne from it and raw_dtype.
    writer.add_tensor(name, raw.reshape(byte_shape), raw_dtype=qtype)
