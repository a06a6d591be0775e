"""Reading and writing GGUF model files (docs/FORMATS.md, "GGUF model files").

``GGUFModelFile.open`` maps a file and reads its directory itself, every count bounded by the bytes
left and every offset a Python int (files of 80+ GB), and exposes its metadata as plain Python values
and its tensors as raw bytes, without copying. ``load_model_file`` adds the ds4 checks: the
metadata must give a valid :class:`ModelConfig`, every tensor must have the shape and type that config
implies, and the tokenizer must match the vocabulary. ``GGUFModelFile.print_summary`` is what
``ds4lab inspect`` prints of a GGUF. ``write_gguf`` writes a file atomically (with ``gguf.GGUFWriter``
for the directory); a tensor given as None is left a hole of zeros, so a file of the real model's
layout costs only its small tensors on disk.

Tensor data layout (``TensorInfo.data``): a read-only ``uint8`` view of the mapped file with shape
``tensor_byte_shape(shape, qtype)`` = ``(ne[-1], ..., ne[1], row_bytes)``, the higher GGUF dims in
reverse (NumPy) order followed by the bytes of one ``ne0`` row. A 1-D tensor is ``(row_bytes,)``; a 2-D
weight ``(out, row_bytes)``; a 3-D expert tensor ``(n_expert, out, row_bytes)``. This holds for every
type, including F32, F16 and I32.
"""

from __future__ import annotations

import functools
import hashlib
import math
import mmap
import os
import re
import secrets
import shutil
import struct
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence, TextIO

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUFValueType, GGUFWriter
from gguf import GGMLQuantizationType as Q

from .config import ModelConfig, ModelFileError

# The largest metadata arrays are a vocabulary's tokens and merges (129,280 in Flash; 262,144 in the largest
# open models); a count far past that is damage, and reading it one element at a time would take minutes.
MAX_ARRAY_ELEMENTS = 1 << 22
MAX_STRING_BYTES = 1 << 24  # a chat template is a few KB; a token a few bytes
SHORT_FLOATS = 4096  # FLOAT32 arrays up to this long read as their shortest decimals (1e-6, not 9.99999997e-07)
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q2_K, Q.Q4_K, Q.IQ2_XXS, Q.MXFP4, Q.I32})

_MAGIC = b"GGUF"
_VERSION = 3
_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor count, metadata key count
_TOKENS_KEY = "tokenizer.ggml.tokens"
_MERGES_KEY = "tokenizer.ggml.merges"


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
    identity: tuple[int, int, int] = (0, 0, 0)  # (inode, size, mtime in ns) when opened

    @classmethod
    def open(cls, path: str | os.PathLike) -> "GGUFModelFile":
        """Map ``path`` read-only; raise :class:`ModelFileError` naming the file if it is not usable."""
        path = Path(path)
        mapped, problem = None, None
        try:
            _check_header(path)
            with path.open("rb") as f:  # one open: the size, the identity and the mapping are of one file
                st = os.fstat(f.fileno())
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            file_size, identity = len(mapped), _identity(st)
            metadata, entries, directory_end = _Directory(mapped, file_size).read()
            alignment = _alignment(metadata)
            tensors = _tensors(mapped, entries, _align(directory_end, alignment), alignment, file_size)
        except _Malformed as e:
            problem = str(e)
        except OSError as e:  # a failed open or mmap (no address space, I/O error) is not damage in the file
            problem = f"cannot map the file ({e.strerror or e})"
        if problem is not None:  # raised outside the handler, so no frame keeps the mapping alive
            if mapped is not None:
                mapped.close()
            raise ModelFileError(f"{path}: {problem}")
        return cls(path, metadata, tensors, alignment, file_size, identity)

    def check_unchanged(self) -> None:
        """Raise :class:`ModelFileError` if the file was truncated, replaced or written since it was opened: its
        weights are read through the mapping, so a truncated file would kill the process (SIGBUS) on the next
        read of a cut page, and one written in place would change the weights under a live KV state."""
        try:
            now = _identity(self.path.stat())
        except OSError as e:
            raise ModelFileError(f"{self.path}: the model file is gone since it was loaded ({e.strerror}); "
                                 f"load it again") from None
        if now != self.identity:
            what = (f"its size went from {self.identity[1]:,} to {now[1]:,} bytes" if now[1] != self.identity[1]
                    else "it was replaced" if now[0] != self.identity[0] else "it was written to")
            raise ModelFileError(f"{self.path}: the model file changed since it was loaded ({what}); "
                                 f"load it again to use the new file")


    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of what makes this model this model: its metadata, its tensor directory and the first and last
        64 bytes of every tensor's data (one tensor's end and the next one's start share a page). Two files of the
        same configuration with other weights differ in it; checkpoints and the KV store carry it. Made on first
        use: it touches a page or two of every tensor."""
        h = hashlib.sha256()
        h.update(repr(sorted(self.metadata.items())).encode())
        for name, t in self.tensors.items():
            flat = t.data.reshape(-1)
            h.update(f"{name}:{t.shape}:{t.qtype.name}:{flat.size}".encode())
            h.update(flat[:64].tobytes())
            h.update(flat[-64:].tobytes())
        return h.hexdigest()[:32]

    def print_summary(self, out: TextIO | None = None) -> str | None:
        """What ``ds4lab inspect FILE.gguf`` prints (to ``out``, default stdout): the header, every metadata key,
        the model config the metadata gives, the tensor table with types and bytes, the bytes by type. Returns why
        the file is not a valid ds4 model (its config or tensors do not fit), or None."""

        def say(text: str = "") -> None:
            print(text, file=out)

        total = sum(t.nbytes for t in self.tensors.values())
        # open() refuses every version but _VERSION
        say(f"{self.path}: GGUF v{_VERSION}, {self.file_size:,} bytes, {len(self.metadata)} metadata keys, "
            f"{len(self.tensors)} tensors ({total:,} bytes of tensor data), alignment {self.alignment}")

        say("\nmetadata")
        width = max((len(k) for k in self.metadata), default=0)
        for key, (value, type_name) in self.metadata.items():
            say(f"  {key:<{width}}  {type_name:<14} {_show_value(value, type_name)}")

        say("\nconfig")
        problem = None
        try:
            cfg = model_config(self, str(self.path))
        except ValueError as e:
            problem = str(e)
            say(f"  not a valid ds4 model: {problem}")
        else:
            for field in fields(cfg):
                say(f"  {field.name:<26} {getattr(cfg, field.name)}")
            ratios = [cfg.ratio(il) for il in range(cfg.n_layer)]
            say(f"  {'(layer ratios)':<26} {ratios}")

        say("\ntensors")
        name_w = max((len(n) for n in self.tensors), default=4)
        say(f"  {'name':<{name_w}}  {'type':<8} {'shape (ne0 first)':<22} {'bytes':>14}")
        by_type: dict[str, list[int]] = {}
        for name, t in self.tensors.items():
            shape = " x ".join(str(d) for d in t.shape)
            say(f"  {name:<{name_w}}  {t.qtype.name:<8} {shape:<22} {t.nbytes:>14,}")
            acc = by_type.setdefault(t.qtype.name, [0, 0])
            acc[0] += 1
            acc[1] += t.nbytes
        say("\nby type")
        for type_name, (count, nbytes) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
            say(f"  {type_name:<8} {count:5d} tensors {nbytes:>16,} bytes")
        say(f"  {'total':<8} {len(self.tensors):5d} tensors {total:>16,} bytes")
        return problem


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """What tells a file's contents apart over time: inode, size, modification time (ns)."""
    return st.st_ino, st.st_size, st.st_mtime_ns


def model_config(file: GGUFModelFile, source: str) -> ModelConfig:
    """The configuration of ``file``'s metadata, checked against its tensors (a ModelFileError names the key or
    tensor). ds4's speculative-decoding add-on (its MTP/DSpark support GGUF: tensors ``mtp.N.*`` and no layers of
    its own) is named as such rather than reported as a model with missing tensors."""
    if any(n.startswith("mtp.") for n in file.tensors) and "blk.0.attn_norm.weight" not in file.tensors:
        raise ModelFileError(f"{source}: ds4's MTP/DSpark support file (tensors mtp.*, no model layers): an add-on "
                             f"of a Flash model for ds4's speculative decoding (--mtp), not a model of its own; "
                             f"ds4lab runs the main model file and not speculative decoding")
    config = ModelConfig.from_metadata(file.metadata, source)
    config.validate_tensors({n: (t.shape, t.qtype) for n, t in file.tensors.items()}, source)
    return config


def load_model_file(path: str | os.PathLike) -> tuple[ModelConfig, GGUFModelFile]:
    """Open a ds4 GGUF and check it against its own metadata; returns (config, file) or raises."""
    file = GGUFModelFile.open(path)
    source = str(path)
    config = model_config(file, source)
    _check_tokenizer(file.metadata, config.n_vocab, source)
    return config, file


def write_gguf(
    path: str | os.PathLike,
    metadata: Mapping[str, tuple[Any, str]],
    tensors: Iterable[tuple[str, Sequence[int], Q | str, np.ndarray | None]],
) -> Path:
    """Write a GGUF v3 file atomically: to a temporary file next to ``path``, then renamed over it.

    ``metadata`` maps key -> (value, type name) as :attr:`GGUFModelFile.metadata` gives it, and must
    contain ``general.architecture``. Each tensor is (name, GGUF dims ne0 first, type, raw uint8 bytes
    of size ``prod(tensor_byte_shape(dims, type))``, any shape), or None for a tensor of zero bytes left as
    a hole in a sparse file. On failure nothing is left behind; a ``path`` that exists and is not a
    regular file is refused.
    """
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: exists and is not a regular file; refusing to replace it")
    given, path = path, Path(os.path.realpath(path))  # through a symlink: its file is replaced, the link stays
    arch, arch_type = metadata.get("general.architecture", (None, None))
    if arch_type != "STRING":
        raise ValueError("metadata needs general.architecture as a STRING")
    tensors = [_checked_tensor(*t) for t in tensors]
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    writer = GGUFWriter(tmp, arch)
    try:
        _add_metadata(writer, metadata)
        for name, qtype, byte_shape, _ in tensors:
            writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensor_data(writer.fout[0], tensors, writer.data_alignment)
        writer.close()
        os.replace(tmp, path)
    except BaseException as e:
        try:
            writer.close()  # flushes what is buffered: on a full disk it fails again
        except OSError:
            pass
        free = shutil.disk_usage(path.parent).free  # before the unlink gives the partial file's space back
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # numpy's "N requested and M written" names no file
            why = e.strerror or str(e)
            if not e.errno and free < 1 << 20:  # numpy says not why: a full disk
                why += f" (no space left on the device: {free:,} bytes free)"
            raise OSError(e.errno, f"writing {given}: {why}") if e.errno else OSError(f"writing {given}: {why}") from e
        raise
    return given


def _write_tensor_data(f, tensors: list, alignment: int) -> None:
    """The data section after the directory: each tensor at the next multiple of ``alignment``, as
    ``GGUFWriter`` places it; a tensor without bytes is skipped by seeking, so it reads as zeros."""
    start = _align(f.tell(), alignment)
    at = 0
    for _, _, byte_shape, raw in tensors:
        if raw is not None:
            f.seek(start + at)
            raw.tofile(f)
        at = _align(at + math.prod(byte_shape), alignment)
    f.truncate(start + at)  # the padding after the last tensor; a trailing hole too


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


class _Directory:
    """GGUF v3's metadata and tensor directory, read from the mapped bytes (docs/FORMATS.md, "GGUF model files").

    Every value is a Python int, float, bool or str from the moment it is read, so offsets past 4 GiB stay
    exact; every count is checked against the bytes left in the file before anything is read for it, so a
    damaged length fails at once instead of looping or allocating for ever."""

    def __init__(self, mapped: mmap.mmap, size: int):
        self.buf, self.size, self.at = mapped, size, _HEADER.size
        self.where = "the header"  # what is being read, named by every error

    def read(self) -> tuple[dict[str, tuple[Any, str]], list[tuple[str, tuple[int, ...], int, int]], int]:
        """(metadata, tensor entries (name, dims, type id, offset), where the directory ends)."""
        _, _, n_tensors, n_keys = _HEADER.unpack_from(self.buf, 0)
        metadata: dict[str, tuple[Any, str]] = {}
        for i in range(n_keys):
            self.where = f"metadata key #{i}"
            key = self.string()
            self.where = f"metadata key {key}"
            if key in metadata:
                raise self.bad("appears twice")
            metadata[key] = self.value(self.value_type())
        entries, names = [], set()
        for i in range(n_tensors):
            self.where = f"tensor directory entry #{i}"
            name = self.string()
            self.where = f"tensor {name}"
            if name in names:
                raise self.bad("appears twice in the tensor directory")
            names.add(name)
            n_dims = self.scalar("<I")
            if not 1 <= n_dims <= 4:
                raise self.bad(f"has {n_dims} dimensions, expected 1 to 4")
            dims = tuple(self.scalar("<Q") for _ in range(n_dims))
            type_id, offset = self.scalar("<I"), self.scalar("<Q")
            entries.append((name, dims, type_id, offset))
        return metadata, entries, self.at

    def bad(self, what: str) -> _Malformed:
        return _Malformed(f"{self.where} {what}")

    def take(self, n: int) -> int:
        """Step over ``n`` bytes; returns where they start."""
        if n > self.size - self.at:
            raise self.bad(f"needs {n} bytes at offset {self.at}, but the file ends at {self.size}: "
                           f"it is truncated or damaged")
        at, self.at = self.at, self.at + n
        return at

    def scalar(self, fmt: str):
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > MAX_STRING_BYTES:  # zeros of a sparse file are valid UTF-8: a damaged length would read GBs
            raise self.bad(f"holds a string of {n} bytes; ds4lab reads strings of at most {MAX_STRING_BYTES:,}")
        at = self.take(n)
        try:
            return self.buf[at:at + n].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.bad(f"holds a string that is not UTF-8 ({e.reason} at its byte {e.start})") from None

    def value_type(self) -> GGUFValueType:
        type_id = self.scalar("<I")
        try:
            return GGUFValueType(type_id)
        except ValueError:
            raise self.bad(f"has unknown value type id {type_id}") from None

    def value(self, vtype: GGUFValueType) -> tuple[Any, str]:
        if vtype == GGUFValueType.STRING:
            return self.string(), vtype.name
        if vtype != GGUFValueType.ARRAY:
            return _python_value(vtype, self.scalar(_SCALAR_FORMATS[vtype])), vtype.name
        elem, count = self.value_type(), self.scalar("<Q")
        if elem == GGUFValueType.ARRAY:
            raise self.bad("is an array of arrays, which no ds4 key is")
        least = 8 if elem == GGUFValueType.STRING else struct.calcsize(_SCALAR_FORMATS[elem])  # bytes an element
        if count > (self.size - self.at) // least:
            raise self.bad(f"claims {count} {elem.name} elements, more than the {self.size - self.at} bytes "
                           f"left in the file can hold")
        if count > MAX_ARRAY_ELEMENTS:  # zeros (a sparse file's holes) would read as billions of empty strings
            raise self.bad(f"claims {count} {elem.name} elements; ds4lab reads metadata arrays of at most "
                           f"{MAX_ARRAY_ELEMENTS:,} (a vocabulary is about 130,000)")
        if elem == GGUFValueType.STRING:
            values = [self.string() for _ in range(count)]
        else:
            raw = np.frombuffer(self.buf, np.dtype(_SCALAR_FORMATS[elem]), count, self.take(count * least))
            if count > SHORT_FLOATS and elem == GGUFValueType.FLOAT32:  # exact values; no time per element
                values = raw.tolist()
            else:
                values = [_python_value(elem, v) for v in raw.tolist()]
        return values, f"ARRAY[{elem.name}]"


_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<B",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


def _python_value(vtype: GGUFValueType, v):
    if vtype == GGUFValueType.FLOAT32:
        return _f32(v)
    return bool(v) if vtype == GGUFValueType.BOOL else v


def _alignment(metadata: Mapping[str, tuple[Any, str]]) -> int:
    if "general.alignment" not in metadata:
        return GGUF_DEFAULT_ALIGNMENT
    value, vtype = metadata["general.alignment"]
    if vtype != "UINT32":
        raise _Malformed(f"metadata key general.alignment has type {vtype}, expected UINT32")
    if value <= 0 or value & (value - 1):
        raise _Malformed(f"metadata key general.alignment is {value}, expected a power of two")
    return value


def _align(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


ABSURD_BYTES = 1 << 50  # a tensor's extent past any model file: its directory entry is damaged


def _tensors(mapped: mmap.mmap, entries: list, data_start: int, alignment: int,
             file_size: int) -> dict[str, TensorInfo]:
    """Each entry's data as a read-only view of the mapping, once its type and extent are checked and the
    tensors are known to tile the data section in directory order: each at the aligned end of the one before,
    the file ending with the last. A type or shape changed in the directory leaves a gap or an overlap."""
    whole = np.frombuffer(mapped, dtype=np.uint8)
    tensors, expected, before = {}, 0, "the directory"
    for name, dims, type_id, offset in entries:
        qtype, byte_shape = _entry_layout(name, dims, type_id)
        nbytes = math.prod(byte_shape)
        if offset % alignment:
            raise _Malformed(f"tensor {name}: data offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > file_size:
            # a shape or offset past any real file (a damaged directory) is not a file cut short
            why = ("the file is truncated" if max(nbytes, offset) < ABSURD_BYTES else
                   f"its dims {list(dims)} or its offset {offset} ask for more than a pebibyte: the tensor "
                   "directory is damaged")
            raise _Malformed(f"tensor {name}: data bytes {start}..{start + nbytes} extend past the end of the file "
                             f"({file_size} bytes); {why}")
        if offset != expected:
            raise _Malformed(f"tensor {name}: its data starts at offset {offset}, but tensor {before} before it ends "
                             f"at {expected} by its shape and type: one of them disagrees with the data written")
        expected, before = _align(offset + nbytes, alignment), name
        tensors[name] = TensorInfo(name, dims, qtype, whole[start:start + nbytes].reshape(byte_shape))
    end = data_start + expected
    if file_size > end:
        raise _Malformed(f"{file_size - end} bytes follow the last tensor's data (which ends at byte {end}): "
                         f"a type or shape in the tensor directory disagrees with the data, or data was appended")
    return tensors


def _entry_layout(name: str, dims: tuple[int, ...], type_id: int) -> tuple[Q, tuple[int, ...]]:
    """A directory entry's type and byte shape (:func:`tensor_byte_shape`), or the reason it has none."""
    try:
        qtype = Q(type_id)
    except ValueError:
        raise _Malformed(f"tensor {name} has unknown GGML type id {type_id}") from None
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise _Malformed(f"tensor {name} has type {qtype.name}, which ds4lab does not read (supported: {names})")
    if 0 in dims:
        raise _Malformed(f"tensor {name} has an empty dimension: {dims}")
    try:
        return qtype, tensor_byte_shape(dims, qtype)
    except ValueError as e:
        raise _Malformed(f"tensor {name}: {e}, so its byte size disagrees with its shape and type") from None


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


# -- the summary -------------------------------------------------------------------------------------


def _show_value(value, type_name: str) -> str:
    """A metadata value in one short cell of the summary: an array as its length and first six items."""
    if type_name.startswith("ARRAY"):
        items = list(value)
        shown = ", ".join(_short(v) for v in items[:6])
        return f"[{shown}]" if len(items) <= 6 else f"{len(items)} items: [{shown}, ...]"
    return _short(value)


def _short(value, limit: int = 60) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


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


def _checked_tensor(name: str, shape: Sequence[int], qtype: Q | str, raw: np.ndarray | None):
    """``(name, type, byte shape, raw bytes in that shape or None)``, or a ValueError naming the tensor."""
    qtype = Q[qtype] if isinstance(qtype, str) else Q(qtype)
    shape = tuple(int(d) for d in shape)
    try:
        byte_shape = tensor_byte_shape(shape, qtype)
    except ValueError as e:
        raise ValueError(f"tensor {name}: {e}") from None
    if raw is None:
        return name, qtype, byte_shape, None
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise ValueError(f"tensor {name}: data must be raw uint8 bytes, got {raw.dtype}")
    if raw.size != math.prod(byte_shape):
        raise ValueError(f"tensor {name}: {raw.size} bytes given, but shape {shape} of type {qtype.name} "
                         f"takes {math.prod(byte_shape)}")
    return name, qtype, byte_shape, np.ascontiguousarray(raw).reshape(byte_shape)
