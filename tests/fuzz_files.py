"""Structure-aware fuzzing of the files ds4lab reads: GGUF models, ``KVC`` ``.kv`` files and ``DSV4`` payloads.

The promise checked: every bad file is refused with an error that names the file and the key, tensor or
field; nothing hangs, crashes or loads quietly wrong.

How it works
------------
* **Seeds** (:func:`prepare`): GGUFs written by ``ds4lab.testing.make_model`` (a tiny config, the same with a
  ``general.alignment`` key, ``NANO`` with ``seed=3`` and, in the long run, the test suite's configs) and the
  embedded model; ``.kv`` files written by ``KVStore(dir).save(session.snapshot(), model)`` after a short prefill on
  backend="numpy" (raw f32 with the CRC trailer, 8-bit rows, zlib, and ds4's own format without a checksum);
  raw payloads from ``session.checkpoint().to_bytes()``.
* **Layouts** (:func:`gguf_layout`, :func:`kvc_layout`, :func:`payload_layout`): each seed is parsed here,
  independently of the readers, into named fields (``kv[deepseek4.block_count].value``,
  ``tensor[blk.0.attn_kv.weight].dim[1]``, ``kvc.payload_bytes``, ``payload.layer[2].comp`` ...), each with its
  offset, format, owner (the key or tensor an error should name) and whether it is *structural* (a length,
  count, type id, dims, offset, header field) or a *value*.
* **Mutations** (:func:`mutations`, Hypothesis strategies): set a field to an interesting value (0, 1, -1,
  2^31, 2^32-1, 2^63, 2^64-1, NaN/Inf/0/negative, type ids out of range, ARRAY as element type ...), replace
  bytes of a name or string, flip bytes at random (the field hit is looked up), truncate at a field boundary
  or anywhere, append bytes, swap fields or whole entries, delete / duplicate a field, insert bytes, turn the
  file into a FIFO, a directory or a symlink, load a ``.kv`` into another model or into a session of another
  context or chunk. GGUF tensor *data* is only cut or extended (a changed weight is another valid model). A
  ``.kv`` mutation may recompute the CRC trailer (``recrc``), so the structural checks behind the checksum are
  exercised too; on such a file (and on ds4's format, which has no checksum) a changed finite row is another
  valid state ("changed"), while the same change under an intact trailer must be refused.
* **Runner** (:class:`Pool`): each case runs in a worker process (``python -m tests.fuzz_files worker``) with
  a time limit; a worker killed by a signal is a crash, one past the limit a hang, and both are respawned.
  A GGUF case runs ``ds4lab inspect`` and ``ds4lab.load(path, backend="numpy")``, then (unless the config and
  every tensor are the seed's) the logits of an 8-token prompt; a ``.kv`` case runs ``ds4lab inspect``,
  ``KVFile.verify`` and ``KVStore.entries`` + ``Session.load`` into a fresh session; a payload case
  ``Checkpoint.from_bytes`` + ``Session.restore``.
* **Classification** (per case): ``refused`` (ModelFileError / KVFileError / PayloadError; ``named`` when the
  message starts with the file's path and names a key, tensor or field), ``unchanged`` (it loaded and gives
  the seed's logits / state), ``changed`` (a *value* field changed and the load gives another finite model or
  state: a different valid file), ``silent`` (a load that is quietly wrong: a structural field changed and the
  logits/state differ; non-finite logits or state; token ids >= vocab; a ``.kv`` damaged inside its CRC-32
  region that loads; a ``.kv`` loaded into another model), ``crash`` (any other exception, or a signal),
  ``hang`` (time limit).

Run
---
``python -m pytest tests/test_fuzz_files.py`` runs the short seeded run (CI); ``python -m pytest -m fuzz`` or
``python -m tests.fuzz_files --gguf 5000 --kv 3000`` the long one, which prints the table and every distinct
failure with a reproducer.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import io
import json
import math
import os
import pickle
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

# The fixed prompt whose logits tell one model from another (every seed's vocabulary has more than 384 ids).
PROMPT = (10, 57, 101, 163, 212, 258, 301, 377)
CASE_TIMEOUT_S = 10.0
SPECIAL_TIMEOUT_S = 3.0  # a FIFO or a directory must be refused at once
SPECIALS = ("fifo", "directory", "symlink to /dev/zero", "dangling symlink")
FAILURES = ("silent", "crash", "hang")

# Float metadata keys and KV rows: values a reader has to cope with.
_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-45, 3.4e38, -3.4e38, 1e30, -1e30, -1.0, 1.0, 1e-12, 65504.0)
_U_EDGES = (0, 1, 2, 3, 4, 7, 8, 255, 256, 2**16 - 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**62, 2**63 - 1, 2**63,
            2**64 - 1)
_S_EDGES = (0, 1, -1, 2, -2, 2**7 - 1, -2**7, 2**15 - 1, -2**15, 2**31 - 1, -2**31, 2**63 - 1, -2**63)


# ---------------------------------------------------------------------------------------------------------
# layouts


@dataclass(frozen=True)
class Field:
    """One field of a seed file: ``count`` elements of struct format ``fmt`` at ``offset`` (``fmt`` "bytes":
    ``count`` raw bytes)."""

    id: str
    owner: str  # the key, tensor or field name a refusal should mention ("" when there is none)
    kind: str
    offset: int
    fmt: str
    count: int = 1
    structural: bool = True

    @property
    def item(self) -> int:
        return 1 if self.fmt == "bytes" else struct.calcsize(self.fmt)

    @property
    def size(self) -> int:
        return self.item * self.count

    @property
    def end(self) -> int:
        return self.offset + self.size


@dataclass
class Layout:
    family: str  # gguf | kv | payload
    size: int
    fields: list[Field]
    entries: list[Field] = field(default_factory=list)  # whole metadata / tensor entries (gguf)
    swaps: list[tuple[str, str]] = field(default_factory=list)
    edit_end: int = 0  # flips, inserts and field edits stay below this offset (gguf: the data section)
    boundaries: list[int] = field(default_factory=list)  # truncation points (field starts, data starts)
    checksum: bool = False  # a .kv with the CRC-32 trailer
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_id = {f.id: f for f in self.fields + self.entries}
        self.by_kind: dict[str, list[Field]] = {}
        for f in self.fields:
            if f.size:
                self.by_kind.setdefault(f.kind, []).append(f)
        ordered = sorted((f for f in self.fields if f.size), key=lambda f: f.offset)
        self._starts = [f.offset for f in ordered]
        self._ordered = ordered
        if not self.edit_end:
            self.edit_end = self.size
        if not self.boundaries:
            self.boundaries = sorted({f.offset for f in ordered} | {f.end for f in ordered if f.end < self.size})
        self.set_kinds = sorted(k for k, fs in self.by_kind.items() if fs[0].fmt not in ("bytes",)
                                and not k.endswith(".data") and fs[0].offset < self.edit_end)
        self.bytes_kinds = sorted(k for k, fs in self.by_kind.items() if fs[0].fmt == "bytes" and k != "tensor.data")

    def field_at(self, offset: int) -> Field | None:
        i = bisect.bisect_right(self._starts, offset) - 1
        if i >= 0 and self._ordered[i].offset <= offset < self._ordered[i].end:
            return self._ordered[i]
        return None


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def gguf_layout(data: bytes) -> Layout:
    """Every field of a (valid) GGUF v3 file, parsed here from the format
    (docs/FORMATS.md, "GGUF model files"): header, each metadata key's length, name, type and value (array
    element type, count and elements; each string's length and bytes), each tensor entry's name length, name,
    n_dims, dims, type and offset, the padding and the tensor data."""
    from ds4lab.tokenizer import SPECIAL_TOKENS

    fields: list[Field] = []
    entries: list[Field] = []
    swaps: list[tuple[str, str]] = []
    u32 = lambda at: struct.unpack_from("<I", data, at)[0]  # noqa: E731
    u64 = lambda at: struct.unpack_from("<Q", data, at)[0]  # noqa: E731

    def add(*args, **kw) -> Field:
        f = Field(*args, **kw)
        fields.append(f)
        return f

    add("header.magic", "", "header.magic", 0, "bytes", 4)
    add("header.version", "", "header.version", 4, "<I")
    add("header.n_tensors", "", "header.count", 8, "<Q")
    add("header.n_kv", "", "header.count", 16, "<Q")
    swaps.append(("header.n_tensors", "header.n_kv"))
    n_tensors, n_kv = u64(8), u64(16)
    at = 24
    meta: dict[str, Any] = {}

    def string(prefix: str, owner: str, kind: str, at: int) -> tuple[int, str]:
        n = u64(at)
        text = data[at + 8:at + 8 + n].decode("utf-8", "replace")
        if text in SPECIAL_TOKENS:  # the tokenizer needs these: a kind of their own, so they are hit often
            kind = "special_token"
        add(f"{prefix}.len", owner, kind + ".len", at, "<Q")
        add(f"{prefix}.bytes", owner, kind + ".bytes", at + 8, "bytes", n, structural=False)
        return at + 8 + n, text

    for _ in range(n_kv):
        start = at
        n = u64(at)
        key = data[at + 8:at + 8 + n].decode("utf-8")
        p = f"kv[{key}]"
        add(f"{p}.len", key, "key.len", at, "<Q")
        add(f"{p}.name", key, "key.name", at + 8, "bytes", n, structural=False)
        at += 8 + n
        vtype = u32(at)
        add(f"{p}.type", key, "key.type", at, "<I")
        at += 4
        if vtype == _GGUF_STRING:
            at, meta[key] = string(f"{p}.value", key, "value.str", at)
        elif vtype == _GGUF_ARRAY:
            etype, count = u32(at), u64(at + 4)
            add(f"{p}.elem_type", key, "array.elem_type", at, "<I")
            add(f"{p}.count", key, "array.count", at + 4, "<Q")
            at += 12
            if etype == _GGUF_STRING:
                for j in range(count):
                    at, _ = string(f"{p}.elem[{j}]", key, "array.str", at)
            else:
                fmt = _GGUF_SCALARS[etype]
                add(f"{p}.elems", key, "array.elem", at, fmt, count, structural=False)
                meta[key] = struct.unpack_from(f"<{count}{fmt[1]}", data, at)
                at += struct.calcsize(fmt) * count
        else:
            fmt = _GGUF_SCALARS[vtype]
            add(f"{p}.value", key, "value.scalar", at, fmt, structural=False)
            meta[key] = struct.unpack_from(fmt, data, at)[0]
            at += struct.calcsize(fmt)
        entries.append(Field(f"{p}.entry", key, "kv.entry", start, "bytes", at - start))
    tensors = []
    for _ in range(n_tensors):
        start = at
        n = u64(at)
        name = data[at + 8:at + 8 + n].decode("utf-8")
        p = f"tensor[{name}]"
        add(f"{p}.name_len", name, "tensor.name_len", at, "<Q")
        add(f"{p}.name", name, "tensor.name", at + 8, "bytes", n, structural=False)
        at += 8 + n
        n_dims = u32(at)
        add(f"{p}.n_dims", name, "tensor.n_dims", at, "<I")
        at += 4
        dims = []
        for k in range(n_dims):
            add(f"{p}.dim[{k}]", name, "tensor.dim", at, "<Q")
            dims.append(u64(at))
            at += 8
        if n_dims >= 2:
            swaps.append((f"{p}.dim[0]", f"{p}.dim[1]"))
        add(f"{p}.type", name, "tensor.type", at, "<I")
        add(f"{p}.offset", name, "tensor.offset", at + 4, "<Q")
        tensors.append((name, u64(at + 4)))
        at += 12
        entries.append(Field(f"{p}.entry", name, "tensor.entry", start, "bytes", at - start))
    directory_end = at
    alignment = meta.get("general.alignment", 32)
    data_start = -(-directory_end // alignment) * alignment
    if data_start > directory_end:
        add("padding", "", "padding", directory_end, "bytes", data_start - directory_end, structural=False)
    boundaries = sorted({f.offset for f in fields} | {directory_end, data_start})
    for i, (name, off) in enumerate(tensors):
        end = data_start + tensors[i + 1][1] if i + 1 < len(tensors) else len(data)
        add(f"tensor[{name}].data", name, "tensor.data", data_start + off, "bytes", end - data_start - off,
            structural=False)
        boundaries += [data_start + off, data_start + off + (end - data_start - off) // 2]
    for a, b in zip(tensors, tensors[1:]):
        swaps.append((f"tensor[{a[0]}].offset", f"tensor[{b[0]}].offset"))
        swaps.append((f"tensor[{a[0]}].type", f"tensor[{b[0]}].type"))
    for a, b in zip(entries, entries[1:]):
        if a.kind == b.kind:
            swaps.append((a.id, b.id))
    scalar_keys = [f for f in fields if f.kind == "value.scalar"]
    for a, b in zip(scalar_keys, scalar_keys[1:]):
        if a.size == b.size:
            swaps.append((a.id, b.id))
    boundaries = sorted(b for b in set(boundaries) if 0 <= b < len(data))
    return Layout("gguf", len(data), fields, entries, swaps, data_start, boundaries,
                  meta={"data_start": data_start, "directory_end": directory_end})


# .kv: ds4's fixed header (kvfile.py's docstring) ------------------------------------------------------------

_KVC_HEADER = [  # id, offset, fmt, structural ("mutable": rewritten in place on every hit, outside the CRC)
    ("kvc.magic", 0, "3s", True), ("kvc.version", 3, "<B", True), ("kvc.quant", 4, "<B", False),
    ("kvc.reason", 5, "<B", False), ("kvc.ext", 6, "<B", True), ("kvc.model_id", 7, "<B", True),
    ("kvc.tokens", 8, "<I", True), ("kvc.hits", 12, "<I", "mutable"), ("kvc.ctx", 16, "<I", True),
    ("kvc.payload_abi", 20, "<B", True), ("kvc.created", 24, "<Q", False), ("kvc.last_used", 32, "<Q", "mutable"),
    ("kvc.payload_bytes", 40, "<Q", True), ("kvc.text_bytes", 48, "<I", True),
]
_MUTABLE = ((12, 16), (32, 40))
_PAYLOAD_HEADER = ("magic", "version", "ctx", "prefill_cap", "raw_cap", "raw_window", "comp_cap", "n_tokens",
                   "n_layer", "head_dim", "indexer_head_dim", "vocab", "raw_live")


def _payload_fields(data: bytes, cfg, base: int, size: int, q8: bool) -> list[Field]:
    from ds4lab.kv.payload import parse_layout

    lay = parse_layout(data, cfg, base=base, size=size, q8=q8)
    h = lay.header
    T, V, n_layer = h["n_tokens"], h["vocab"], h["n_layer"]
    out = [Field(f"payload.{name}", name, "payload.header", base + 4 * i, "<I")
           for i, name in enumerate(_PAYLOAD_HEADER)]
    out.append(Field("payload.tokens", "tokens", "payload.tokens", lay.tokens_offset, "<I", T, structural=False))
    out.append(Field("payload.logits", "logits", "payload.logits", lay.logits_offset, "<f", V, structural=False))
    out.append(Field("payload.counts.comp", "compressed row count", "payload.counts", lay.counts_offset, "<I", n_layer))
    out.append(Field("payload.counts.index", "indexer row count", "payload.counts", lay.counts_offset + 4 * n_layer,
                     "<I", n_layer))
    for il, arrays in enumerate(lay.layers):
        for name, arr in arrays.items():
            if arr is None or not arr.rows:
                continue
            fid, owner = f"payload.layer[{il}].{name}", f"layer {il} {name}"
            kind = "payload.rows" if name in ("raw", "comp", "index") else "payload.state"
            if arr.q8:
                out.append(Field(fid + ".scale", owner, "payload.q8scale", arr.offset, "<f", arr.rows, False))
                out.append(Field(fid + ".q", owner, "payload.q8", arr.offset + 4 * arr.rows, "<b",
                                 arr.rows * arr.width, False))
            else:
                out.append(Field(fid, owner, kind, arr.offset, "<f", arr.rows * arr.width, False))
    return out


def kvc_layout(data: bytes, cfg) -> Layout:
    """Every field of a (valid) ``KVC`` file: the fixed header, the text, the ``DSV4`` payload's header, tokens,
    logits, row counts and arrays (or a compressed stream's size and bytes) and the checksum trailer."""
    fields = [Field(fid, fid.split(".")[1], "kvc.header", off, fmt, structural=s is True)
              if s != "mutable" else Field(fid, fid.split(".")[1], "kvc.mutable", off, fmt, structural=False)
              for fid, off, fmt, s in _KVC_HEADER]
    ext = data[6]
    payload_bytes, text_bytes = struct.unpack_from("<Q", data, 40)[0], struct.unpack_from("<I", data, 48)[0]
    start = 52 + text_bytes
    fields.append(Field("kvc.text", "text", "kvc.text", 52, "bytes", text_bytes))
    if ext & (0x20 | 0x40):
        fields.append(Field("payload.zsize", "unpacked size", "payload.zsize", start, "<Q"))
        fields.append(Field("payload.zstream", "payload", "payload.zstream", start + 8, "bytes", payload_bytes - 8))
    else:
        fields += _payload_fields(data, cfg, start, payload_bytes, bool(ext & 0x10))
    end = start + payload_bytes
    if ext & 0x80:  # the writing model's fingerprint: "KFP" 1 and 16 bytes, before the checksum trailer
        fields.append(Field("kvc.fingerprint.magic", "fingerprint", "kvc.trailer", end, "bytes", 4))
        fields.append(Field("kvc.fingerprint", "fingerprint", "kvc.trailer", end + 4, "bytes", 16))
    checksum = bool(ext & 0x08)
    if checksum:
        fields.append(Field("kvc.trailer.magic", "checksum trailer", "kvc.trailer", len(data) - 8, "bytes", 4))
        fields.append(Field("kvc.trailer.crc", "checksum", "kvc.trailer", len(data) - 4, "<I"))
    swaps = [("kvc.tokens", "kvc.ctx"), ("kvc.created", "kvc.last_used"), ("kvc.hits", "kvc.tokens")]
    if not ext & 0x60:
        swaps += [("payload.ctx", "payload.prefill_cap"), ("payload.raw_cap", "payload.raw_window"),
                  ("payload.n_tokens", "payload.raw_live"), ("payload.head_dim", "payload.indexer_head_dim")]
    lay = Layout("kv", len(data), fields, swaps=swaps, checksum=checksum)
    return lay


def payload_layout(data: bytes, cfg) -> Layout:
    fields = _payload_fields(data, cfg, 0, len(data), False)
    swaps = [("payload.ctx", "payload.prefill_cap"), ("payload.raw_cap", "payload.raw_window"),
             ("payload.n_tokens", "payload.raw_live"), ("payload.head_dim", "payload.indexer_head_dim"),
             ("payload.comp_cap", "payload.raw_cap")]
    return Layout("payload", len(data), fields, swaps=swaps)


# ---------------------------------------------------------------------------------------------------------
# mutations


@dataclass(frozen=True)
class Mutation:
    """One change to a seed, by field id (stable across rebuilds of the seed), so it reads as a reproducer."""

    # set | bytes | rename | flip | truncate | append | swap | delete | duplicate | insert | special | other-model |
    # other-session
    op: str
    field: str = ""
    index: int = 0  # element of an array field / byte position in a bytes field / offset (flip, truncate, insert)
    value: Any = None
    recrc: bool = False  # .kv: recompute the CRC-32 trailer after the change

    def __str__(self) -> str:
        where = f"{self.field}[{self.index}]" if self.field and self.index else self.field
        v = self.value if not isinstance(self.value, bytes) or len(self.value) <= 16 else \
            self.value[:16] + b"...(%d bytes)" % len(self.value)
        text = f"{self.op} {where or ''} {'' if v is None else repr(v)}".replace("  ", " ").strip()
        if self.op in ("flip", "truncate", "insert"):
            text = f"{self.op} at {self.index}" + ("" if self.value is None else f" {self.value!r}")
        return text + (" +recrc" if self.recrc else "")


@dataclass(frozen=True)
class Hit:
    """What a mutation changed, as the classification needs it."""

    field: str
    owner: str
    kind: str
    structural: bool
    checksummed: bool = False  # a .kv byte covered by the CRC changed (and the CRC was not recomputed)
    description: str = ""


def _pack(fmt: str, value) -> bytes:
    if fmt == "bytes" or fmt.endswith("s"):
        return bytes(value)
    if fmt[-1] in "fd":
        return struct.pack(fmt, float(value))
    bits = struct.calcsize(fmt) * 8
    v = int(value)
    if fmt[-1].isupper():
        v &= (1 << bits) - 1
    else:
        v = (v + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))
    return struct.pack(fmt, v)


def _orig(data: bytes, f: Field, j: int = 0):
    if f.fmt == "bytes":
        return data[f.offset:f.end]
    if f.fmt.endswith("s"):
        return data[f.offset:f.end]
    return struct.unpack_from(f.fmt, data, f.offset + j * f.item)[0]


def plan(lay: Layout, data: bytes, m: Mutation) -> tuple[list[tuple[int, int, bytes]], Hit]:
    """The splices ``(start, end, new bytes)`` a mutation makes to ``data``, and what it hit."""
    f = lay.by_id.get(m.field) if m.field else None
    splices: list[tuple[int, int, bytes]] = []
    owner, kind, structural, what = (f.owner, f.kind, f.structural, m.field) if f else ("", m.op, True, m.op)
    if m.op == "set":
        at = f.offset + m.index * f.item
        splices.append((at, at + f.item, _pack(f.fmt, m.value)))
        what = f"{f.id}" + (f"[{m.index}]" if f.count > 1 and f.fmt != "bytes" else "")
        what += f" = {m.value!r} (was {_orig(data, f, m.index)!r})"
    elif m.op == "bytes":
        at = f.offset + min(m.index, max(f.size - 1, 0))
        new = bytes(m.value)[:max(f.end - at, 1)]
        splices.append((at, at + len(new), new))
        what = f"{f.id} byte {at - f.offset} = {new!r} (was {data[at:at + len(new)]!r})"
    elif m.op == "rename":  # a consistent rename: the length before the name changes with it
        other = lay.by_id[m.value]
        length = f.offset - 8
        splices.append((length, f.end, struct.pack("<Q", other.size) + data[other.offset:other.end]))
        what = f"{f.id} renamed to {data[other.offset:other.end]!r}"
    elif m.op == "flip":
        at = m.index
        mask = bytes(m.value)[: lay.size - at]
        splices.append((at, at + len(mask), bytes(a ^ b for a, b in zip(data[at:at + len(mask)], mask))))
        hit = lay.field_at(at)
        if hit is not None:
            owner, kind, structural = hit.owner, hit.kind, hit.structural
            what = f"{hit.id} (byte {at - hit.offset}) ^= {mask.hex()}"
        else:
            what = f"byte {at} ^= {mask.hex()}"
    elif m.op == "truncate":
        splices.append((m.index, lay.size, b""))
        hit = lay.field_at(m.index)
        owner = hit.owner if hit else ""
        what = f"truncated to {m.index} bytes (inside {hit.id if hit else 'the end'})"
        kind, structural = "truncate", True
    elif m.op == "append":
        splices.append((lay.size, lay.size, bytes(m.value)))
        what, kind, structural = f"{len(m.value)} bytes appended", "append", True
    elif m.op == "insert":
        splices.append((m.index, m.index, bytes(m.value)))
        hit = lay.field_at(m.index)
        owner = hit.owner if hit else ""
        what, kind, structural = f"{len(m.value)} bytes inserted at {m.index} ({hit.id if hit else ''})", "insert", True
    elif m.op == "swap":
        g = lay.by_id[m.value]
        a, b = sorted((f, g), key=lambda x: x.offset)
        if a.end == b.offset:
            splices.append((a.offset, b.end, data[b.offset:b.end] + data[a.offset:a.end]))
        else:
            splices += [(a.offset, a.end, data[b.offset:b.end]), (b.offset, b.end, data[a.offset:a.end])]
        owner, structural = f"{f.owner}|{g.owner}", f.structural or g.structural or f.kind.endswith("entry")
        kind, what = "swap", f"swap {f.id} <-> {g.id}"
    elif m.op == "delete":
        splices.append((f.offset, f.end, b""))
        structural, what = True, f"{f.id} deleted ({f.size} bytes)"
    elif m.op == "duplicate":
        splices.append((f.end, f.end, data[f.offset:f.end]))
        structural, what = True, f"{f.id} duplicated ({f.size} bytes)"
        if m.value:  # a whole entry with the header's count raised to match
            count = lay.by_id["header.n_kv" if f.kind == "kv.entry" else "header.n_tensors"]
            splices.append((count.offset, count.end, struct.pack("<Q", _orig(data, count) + 1)))
            what += f", {count.id} + 1"
    elif m.op == "special":
        what, kind, structural = f"the file is a {m.value}", "special", True
    elif m.op == "other-model":
        what, kind, structural = f"loaded into the model of {m.value}", "other-model", True
    elif m.op == "other-session":
        what, kind, structural = f"loaded into a session of ctx {m.value[0]}, chunk {m.value[1]}", "other-session", True
    else:
        raise ValueError(f"unknown mutation {m.op}")
    checksummed = False
    if lay.family == "kv" and lay.checksum and not m.recrc:
        checksummed = m.op == "special" or any(
            len(new) != end - start or any(a != b and not _mutable(start + i)
                                           for i, (a, b) in enumerate(zip(data[start:end], new)))
            for start, end, new in splices)
    if m.recrc:
        what += " (CRC recomputed)"
    return splices, Hit(m.field or m.op, owner, kind, bool(structural), checksummed, what)


def _mutable(offset: int) -> bool:
    return any(lo <= offset < hi for lo, hi in _MUTABLE)


def is_noop(data: bytes, splices) -> bool:
    return all(data[s:e] == new for s, e, new in splices)


def apply(data: bytes, splices, recrc: bool = False) -> bytes:
    out = bytearray(data)
    for s, e, new in sorted(splices, key=lambda x: x[0], reverse=True):
        out[s:e] = new
    if recrc and len(out) >= 60 and out[6] & 0x08:
        from ds4lab.kv.kvfile import checksum, checksum_trailer

        out[-8:] = checksum_trailer(checksum(bytes(out[:52]), bytes(out[52:-8])))
    return bytes(out)


# Hypothesis strategies ---------------------------------------------------------------------------------

_OPS = {
    "gguf": ("set",) * 9 + ("bytes",) * 2 + ("rename", "flip", "flip", "flip", "truncate", "truncate", "append",
                                             "swap", "swap", "delete", "duplicate", "insert", "special"),
    "kv": ("set",) * 9 + ("bytes", "flip", "flip", "flip", "flip", "truncate", "truncate", "append", "swap", "swap",
                          "delete", "duplicate", "insert", "other-model", "other-session", "special"),
    "payload": ("set",) * 9 + ("flip", "flip", "flip", "truncate", "truncate", "append", "swap", "delete",
                               "duplicate", "insert", "other-session"),
}


_VALUE_KINDS = ("value.scalar", "array.elem", "payload.header", "payload.tokens", "kvc.header")


def _values(f: Field, orig, lay: Layout):
    from hypothesis import strategies as st

    fmt = f.fmt
    if f.kind in ("key.type", "array.elem_type"):
        return st.integers(0, 13) | st.sampled_from([9, 13, 14, 255, 2**31, 2**32 - 1])
    if f.kind == "tensor.type":
        return st.integers(0, 41) | st.sampled_from([2**16, 2**31, 2**32 - 1])
    if f.kind == "tensor.n_dims":
        return st.integers(0, 6) | st.sampled_from([2**31, 2**32 - 1])
    if f.kind == "payload.tokens":
        vocab = lay.meta.get("vocab", 1)
        return st.sampled_from([0, 1, vocab - 1, vocab, vocab + 1, 2**31, 2**32 - 1]) | st.integers(0, 2**32 - 1)
    if fmt[-1] in "fd":
        width = 32 if fmt[-1] == "f" else 64
        near = [-orig, 2 * orig, orig / 2, orig + 1] if math.isfinite(orig) else []
        return st.sampled_from(_FLOATS + tuple(near)) | st.floats(width=width)
    if fmt.endswith("s"):
        return st.binary(min_size=f.item, max_size=f.item)
    bits = struct.calcsize(fmt) * 8
    if fmt[-1].isupper():
        top = (1 << bits) - 1
        near = [orig + d for d in (-8, -1, 1, 8)] + [orig * 2, orig // 2, orig << 32]
        if f.id == "kvc.ext":
            near += [orig ^ (1 << b) for b in range(8)]
        edges = sorted({v & top for v in _U_EDGES + tuple(v for v in near if v >= 0)})
        return st.sampled_from(edges) | st.integers(0, top)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    edges = sorted({min(max(v, lo), hi) for v in _S_EDGES + (orig - 1, orig + 1, -orig)})
    return st.sampled_from(edges) | st.integers(lo, hi)


def mutations(lay: Layout, data: bytes, others: tuple[str, ...] = ()):
    """A Hypothesis strategy of :class:`Mutation` for one seed (``others``: models a .kv may be loaded into)."""
    from hypothesis import strategies as st

    ops = tuple(op for op in _OPS[lay.family] if op != "other-model" or others)
    renames = {k: [f.id for f in lay.by_kind.get(k, [])] for k in ("key.name", "tensor.name")}
    dup_fields = [f for f in lay.fields if f.size and f.offset < lay.edit_end and f.size <= 4096] + lay.entries
    swaps = [s for s in lay.swaps if s[0] in lay.by_id and s[1] in lay.by_id]
    inserts = [b for b in lay.boundaries if b <= lay.edit_end]
    # the fields whose values a model or a state is made of, three times as often as the others
    set_kinds = [k for k in lay.set_kinds for _ in range(3 if k in _VALUE_KINDS else 1)]

    @st.composite
    def one(draw) -> Mutation:
        op = draw(st.sampled_from(ops))
        recrc = lay.checksum and draw(st.integers(0, 9)) < 4
        if op == "set":
            f = draw(st.sampled_from(lay.by_kind[draw(st.sampled_from(set_kinds))]))
            j = draw(st.integers(0, f.count - 1)) if f.count > 1 else 0
            v = draw(_values(f, _orig(data, f, j), lay))
            return Mutation("set", f.id, j, v, recrc and f.kind != "kvc.trailer")
        if op == "bytes":
            f = draw(st.sampled_from(lay.by_kind[draw(st.sampled_from(lay.bytes_kinds))]))
            pos = draw(st.integers(0, f.size - 1))
            new = draw(st.sampled_from([b"\xff", b"\x00", b"\xc3", b"\x80", b"\xed\xa0\x80"])
                       | st.binary(min_size=1, max_size=4))
            return Mutation("bytes", f.id, pos, new, recrc and f.kind != "kvc.trailer")
        if op == "rename":
            kind = draw(st.sampled_from([k for k, v in renames.items() if len(v) > 1]))
            a, b = draw(st.sampled_from(renames[kind])), draw(st.sampled_from(renames[kind]))
            return Mutation("rename", a, 0, b)
        if op == "flip":
            at = draw(st.integers(0, lay.edit_end - 1))
            mask = bytes(draw(st.lists(st.integers(1, 255), min_size=1, max_size=4)))
            return Mutation("flip", "", at, mask, recrc)
        if op == "truncate":
            at = draw(st.sampled_from(lay.boundaries) | st.integers(0, lay.size - 1))
            return Mutation("truncate", "", at)
        if op == "append":
            tail = draw(st.binary(min_size=1, max_size=64)
                        | st.sampled_from([b"\0", b"\0" * 8, b"\0" * 32, b"\0" * 4096, data[:64], data[-64:]]))
            return Mutation("append", "", 0, tail)
        if op == "insert":
            at = draw(st.sampled_from(inserts))
            return Mutation("insert", "", at, draw(st.binary(min_size=1, max_size=8)))
        if op == "swap":
            a, b = draw(st.sampled_from(swaps))
            return Mutation("swap", a, 0, b, recrc)
        if op in ("delete", "duplicate"):
            f = draw(st.sampled_from(dup_fields))
            bump = op == "duplicate" and f.kind.endswith("entry") and draw(st.booleans())
            return Mutation(op, f.id, 0, bump or None, recrc)
        if op == "other-model":
            return Mutation("other-model", "", 0, draw(st.sampled_from(others)))
        if op == "other-session":  # the seed's own model, another context or chunk
            ctx, chunk = lay.meta["ctx"], lay.meta["chunk"]
            return Mutation("other-session", "", 0, draw(st.sampled_from(
                [(ctx, chunk // 2), (ctx, chunk * 2), (ctx * 2, chunk), (ctx // 2, chunk), (ctx - 1, chunk)])))
        if op == "special":
            return Mutation("special", "", 0, draw(st.sampled_from(SPECIALS)))
        raise AssertionError(op)

    return one()


# ---------------------------------------------------------------------------------------------------------
# seeds


TINY_ARGS = dict(n_layer=4, compress_ratios=(0, 4, 128, 4), swiglu_clamp=(10.0, 7.0, 10.0, 10.0), n_embd=64,
                 head_dim=96, value_dim=96, n_rot=32, idx_dim=32, swa=16, idx_topk=8, o_groups=1, n_head=2,
                 q_lora=32, o_lora=32, n_expert=4, n_expert_used=2, ff_exp=32, n_hc=2, n_hash_layer=1, idx_heads=2,
                 n_vocab=384, context_length=1024)


@dataclass
class Seed:
    name: str
    family: str  # gguf | kv | payload
    path: str
    weight: int = 1  # how often the strategies pick it
    model: str = ""  # kv / payload: the GGUF it belongs to
    ctx: int = 0
    chunk: int = 0
    baseline: str = ""  # kv / payload: the restored state, re-serialized
    filename: str = ""  # kv: <sha1>.kv


def _kv_text(model, n: int) -> list[int]:
    from ds4lab.testing import default_tokenizer_text

    return model.tokenizer.encode(default_tokenizer_text()[:4000])[:n]


def prepare(root: Path, long: bool = False) -> list[Seed]:
    """Write the seeds under ``root`` (GGUFs, .kv files, payloads and their baselines); returns them and writes
    ``root/seeds.json`` for the workers."""
    import ds4lab
    from ds4lab.config import NANO, replace
    from ds4lab.testing import make_model

    root.mkdir(parents=True, exist_ok=True)
    tiny = make_model(replace(NANO, **TINY_ARGS), root / "tiny.gguf", seed=3, dense_type="Q8_0",
                      expert_types=("F16", "F16"))
    nano = make_model(NANO, root / "nano.gguf", seed=3)
    embedded = ds4lab.default_model_path()
    seeds = [Seed("tiny", "gguf", str(tiny), 5), Seed("tiny-align64", "gguf", str(_realigned(tiny, 64)), 1),
             Seed("nano", "gguf", str(nano), 2), Seed("embedded", "gguf", str(embedded), 3)]
    if long:
        from tests.conftest import CONFIGS

        for i, (name, (cfg, kw)) in enumerate(CONFIGS.items()):
            if name != "nano":
                seeds.append(Seed(f"conftest-{name}", "gguf", str(make_model(cfg, root / f"{name}.gguf", seed=7 + i,
                                                                             **kw)), 1))
    # (model, its GGUF, ctx, chunk, tokens): the tiny model's 149 tokens fill ratio-4 and ratio-128 rows and wrap
    # its 16-row window; the embedded model's are a short prefill (CI) or one past a ratio-128 row (long run)
    kv_plan = [("tiny", tiny, 256, 64, 149), ("embedded", embedded, 256 if long else 128, 64, 140 if long else 40)]
    for model_name, model_path, ctx, chunk, n in kv_plan:
        model = ds4lab.load(model_path, backend="numpy")
        sess = model.session(ctx=ctx, prefill_chunk=chunk)
        sess.prefill(_kv_text(model, n)).run(progress=False)
        codecs = [("raw", None, True), ("q8", "q8", True), ("zlib", "zlib", True), ("ds4", None, False)]
        if model_name == "embedded" and not long:
            codecs = codecs[:1]
        for codec_name, codec, checksum in codecs:
            d = root / f"kv-{model_name}-{codec_name}"
            store = ds4lab.KVStore(d, min_tokens=1, checksum=checksum, compression=codec)
            entry = store.save(sess.snapshot(), sess.model)
            seed = Seed(f"kv-{model_name}-{codec_name}", "kv", str(entry.path), 3 if codec_name == "raw" else 1,
                        str(model_path), ctx, chunk, filename=entry.path.name)
            seed.baseline = str(d.with_suffix(".baseline"))
            scratch = Path(tempfile.mkdtemp(dir=root))
            Path(seed.baseline).write_bytes(kv_load(model, seed, scratch, entry.path.read_bytes()))
            seeds.append(seed)
        p = root / f"payload-{model_name}.dsv4"
        p.write_bytes(sess.checkpoint().to_bytes())
        seed = Seed(f"payload-{model_name}", "payload", str(p), 2, str(model_path), ctx, chunk)
        seed.baseline = str(p.with_suffix(".baseline"))
        Path(seed.baseline).write_bytes(payload_load(model, seed, p.read_bytes()))
        seeds.append(seed)
    (root / "seeds.json").write_text(json.dumps([asdict(s) for s in seeds], indent=1))
    return seeds


def _realigned(path: Path, alignment: int) -> Path:
    """The same model with a ``general.alignment`` key (its tensors padded to it)."""
    from ds4lab.gguf_file import GGUFModelFile, write_gguf

    f = GGUFModelFile.open(path)
    out = path.with_name(f"{path.stem}-align{alignment}.gguf")
    return write_gguf(out, {**f.metadata, "general.alignment": (alignment, "UINT32")},
                      [(n, t.shape, t.qtype, t.data) for n, t in f.tensors.items()])


def load_layouts(seeds: list[Seed]) -> dict[str, tuple[Layout, bytes]]:
    """Each seed's layout and bytes (the parent draws mutations from them)."""
    from ds4lab.gguf_file import load_model_file

    out = {}
    configs: dict[str, Any] = {}
    for s in seeds:
        data = Path(s.path).read_bytes()
        if s.family == "gguf":
            out[s.name] = (gguf_layout(data), data)
            continue
        if s.model not in configs:
            configs[s.model] = load_model_file(s.model)[0]
        cfg = configs[s.model]
        lay = kvc_layout(data, cfg) if s.family == "kv" else payload_layout(data, cfg)
        lay.meta.update(vocab=cfg.n_vocab, ctx=s.ctx, chunk=s.chunk)
        out[s.name] = (lay, data)
    return out


# ---------------------------------------------------------------------------------------------------------
# loading a case (in a worker)


def _snapshot(session) -> bytes:
    """The session's tokens, logits and state as a DSV4 payload (what a load must reproduce)."""
    from ds4lab.kv.checkpoint import Checkpoint

    cp = Checkpoint(tuple(session.tokens), session.logits, session._state, config=session.model.config,
                    backend=session.model.backend)
    return cp.to_bytes()


def kv_load(model, seed: Seed, case_dir: Path, file_bytes: bytes | None) -> bytes:
    """The store's way in: list the directory, load the entry into a fresh session (``Session.load``)."""
    import warnings

    import ds4lab

    if file_bytes is not None:
        (case_dir / seed.filename).write_bytes(file_bytes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ds4lab.KVStoreWarning)
        store = ds4lab.KVStore(case_dir, min_tokens=1)
        entry = next(e for e in store.entries() if e.path.name == seed.filename)
        session = model.session(ctx=seed.ctx, prefill_chunk=seed.chunk)
        session.load(entry, store=store)
    return _snapshot(session)


def payload_load(model, seed: Seed, data: bytes) -> bytes:
    from ds4lab.kv.checkpoint import Checkpoint

    session = model.session(ctx=seed.ctx, prefill_chunk=seed.chunk)
    session.restore(Checkpoint.from_bytes(data, model.config))
    return _snapshot(session)


_NAMES_GGUF = re.compile(r"metadata key|tensor|deepseek4\.|general\.|tokenizer\.|header|magic|version|GGUF|"
                         r"alignment|bytes follow|empty file|not a regular file|no such file")


def _named(message: str, path: str, field_name: str | None, family: str) -> bool:
    """The refusal starts with the file's path and names a key, tensor or field."""
    if family == "payload":  # bytes, no file: the PayloadError's field must be in its message
        return bool(field_name) and field_name in message
    if not message.startswith(f"{path}: "):
        return False
    rest = message[len(path) + 2:]
    if family == "gguf":
        return bool(_NAMES_GGUF.search(rest))
    if field_name:
        name = field_name.removeprefix("payload ")
        return name in rest
    return bool(re.search(r"header|magic|version|size|checksum|payload|tokens|text|field", rest))


class Worker:
    """Runs cases, one at a time, for the parent's :class:`Pool` (``python -m tests.fuzz_files worker DIR``)."""

    def __init__(self, seeds_dir: Path, work_dir: Path):
        import numpy as np

        import ds4lab  # noqa: F401  (imported before the first case, so its time is not a case's)
        from ds4lab.kv.checkpoint import Checkpoint  # noqa: F401

        self.np = np
        self.seeds_dir, self.work_dir = seeds_dir, work_dir
        self.seeds: dict[str, Seed] = {}
        self.data: dict[str, bytes] = {}
        self.models: dict[str, Any] = {}
        self.logits: dict[str, Any] = {}

    def seed(self, name: str) -> Seed:
        if name not in self.seeds:
            self.seeds = {s["name"]: Seed(**s) for s in json.loads((self.seeds_dir / "seeds.json").read_text())}
        return self.seeds[name]

    def model(self, path: str):
        import ds4lab

        if path not in self.models:
            self.models[path] = ds4lab.load(path, backend="numpy")
        return self.models[path]

    def bytes_of(self, seed: Seed) -> bytes:
        if seed.name not in self.data:
            self.data[seed.name] = Path(seed.path).read_bytes()
        return self.data[seed.name]

    def run(self, case_id: int, seed_name: str, m: Mutation, splices, hit: Hit) -> dict:
        seed = self.seed(seed_name)
        case_dir = self.work_dir / f"case-{case_id:06d}"
        case_dir.mkdir(parents=True)
        try:
            data = apply(self.bytes_of(seed), splices, m.recrc)
            return getattr(self, f"run_{seed.family}")(seed, case_dir, data, m, hit)
        finally:
            shutil.rmtree(case_dir, ignore_errors=True)

    def _write(self, path: Path, data: bytes, m: Mutation) -> None:
        if m.op != "special":
            path.write_bytes(data)
        elif m.value == "fifo":
            os.mkfifo(path)
        elif m.value == "directory":
            path.mkdir()
        elif m.value == "symlink to /dev/zero":
            path.symlink_to("/dev/zero")
        elif m.value == "dangling symlink":
            path.symlink_to(path.with_name("nowhere"))

    # GGUF: ds4lab.load + the logits of PROMPT; `ds4lab inspect` too ------------------------------------------
    def run_gguf(self, seed: Seed, case_dir: Path, data: bytes, m: Mutation, hit: Hit) -> dict:
        import ds4lab
        from ds4lab.config import ModelFileError

        np = self.np
        path = case_dir / "model.gguf"
        self._write(path, data, m)
        problem = _inspect(path)
        if problem is not None:
            return problem
        try:
            model = ds4lab.load(path, backend="numpy")
        except ModelFileError as e:
            return _result("refused", "load", e, named=_named(str(e), str(path), None, "gguf"),
                           exact=not hit.owner or any(o and o in str(e) for o in hit.owner.split("|")))
        except Exception as e:  # noqa: BLE001
            return _result("crash", "load", e)
        base = self.model(seed.path)
        same = model.config == base.config and list(model.file.tensors) == list(base.file.tensors) and all(
            t.shape == b.shape and t.qtype == b.qtype and np.array_equal(t.data, b.data)
            for t, b in zip(model.file.tensors.values(), base.file.tensors.values()))
        if same:  # the transformer reads nothing but the config and the tensors
            return _result("unchanged", "load")
        try:
            logits = model.logits(list(PROMPT))
        except ModelFileError as e:
            return _result("refused", "logits", e, named=_named(str(e), str(path), None, "gguf"))
        except Exception as e:  # noqa: BLE001
            return _result("crash", "logits", e)
        if seed.name not in self.logits:
            self.logits[seed.name] = base.logits(list(PROMPT))
        if not np.isfinite(logits).all():
            return _result("silent", "logits", reason="non-finite logits")
        if np.array_equal(logits, self.logits[seed.name]):
            return _result("unchanged", "logits")
        if hit.structural:
            return _result("silent", "logits", reason="a structural field changed and the logits differ")
        return _result("changed", "logits", reason="a value changed: another valid model")

    # .kv: `ds4lab inspect` (KVFile.open, summary, verify), then the store's load into a session ----------------
    def run_kv(self, seed: Seed, case_dir: Path, data: bytes, m: Mutation, hit: Hit) -> dict:
        import warnings

        import ds4lab
        from ds4lab.kv.kvfile import KVFile, KVFileError
        from ds4lab.kv.payload import PayloadError

        path = case_dir / seed.filename
        self._write(path, data, m)
        inspect_error = None
        problem = _inspect(path)
        if problem is not None:
            return problem
        try:
            if path.is_file():  # as `inspect` does; the store's scan meets the rest
                KVFile.open(path).verify()
        except KVFileError as e:
            inspect_error = e
        except OSError as e:
            if e.filename != str(path):
                return _result("crash", "verify", e)
        except Exception as e:  # noqa: BLE001
            return _result("crash", "verify", e)
        model = self.model(m.value if m.op == "other-model" else seed.model)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                store = ds4lab.KVStore(case_dir, min_tokens=1)
                entries = [e for e in store.entries() if e.path.name == seed.filename]
                if not entries:  # skipped by the scan: its warning is the refusal
                    texts = [str(w.message) for w in caught if issubclass(w.category, ds4lab.KVStoreWarning)]
                    text = next((t for t in texts if str(path) in t), "; ".join(texts))
                    text = text.removeprefix("skipped KV store file: ")
                    if not text and not path.exists():  # a dangling link: as absent as a file removed meanwhile
                        return _result("refused", "scan", message=f"{path}: absent", named=True)
                    field_name = getattr(inspect_error, "field", None)
                    named = _named(text, str(path), field_name, "kv") or (  # an OSError's text quotes the path
                        m.op == "special" and str(path) in text)
                    return _result("refused", "scan", message=text or "(skipped without a warning)",
                                   error="KVStoreWarning", named=named)
                session = self.session(model, seed, m)
                session.load(entries[0], store=store)
        except (KVFileError, PayloadError) as e:
            return _result("refused", "load", e, named=_named(str(e), str(path), e.field, "kv"),
                           exact=not hit.owner or hit.owner in str(e))
        except Exception as e:  # noqa: BLE001
            return _result("crash", "load", e)
        return self._judge_state(seed, model, _snapshot(session), hit, m)

    def run_payload(self, seed: Seed, case_dir: Path, data: bytes, m: Mutation, hit: Hit) -> dict:
        from ds4lab.kv.checkpoint import Checkpoint
        from ds4lab.kv.payload import PayloadError

        model = self.model(seed.model)
        try:
            session = self.session(model, seed, m)
            session.restore(Checkpoint.from_bytes(data, model.config))
        except PayloadError as e:
            return _result("refused", "load", e, named=_named(str(e), "", e.field, "payload"),
                           exact=not hit.owner or hit.owner in str(e))
        except Exception as e:  # noqa: BLE001
            return _result("crash", "load", e)
        return self._judge_state(seed, model, _snapshot(session), hit, m)

    def _judge_state(self, seed: Seed, model, state: bytes, hit: Hit, m: Mutation) -> dict:
        from ds4lab.kv.payload import parse_layout

        np = self.np
        if m.op == "other-model":
            return _result("silent", "load", reason="a file of another model loaded")
        if hit.checksummed:
            return _result("silent", "load", reason="damage inside the CRC-32 region loaded")
        got = _contents(parse_layout(state, model.config), state)
        if got == _contents(parse_layout(base := Path(seed.baseline).read_bytes(), model.config), base):
            return _result("unchanged", "load")  # the same tokens, logits and rows (a session's geometry aside)
        tokens, *arrays = (np.frombuffer(b, "<u4" if i == 0 else "<f4") for i, b in enumerate(got))
        for i, a in enumerate(arrays):
            if not np.isfinite(a).all():
                bad = "NaN" if np.isnan(a).any() else "Inf"
                return _result("silent", "load", reason=f"{bad} loaded in the {'KV state' if i else 'logits'}")
        if tokens.size and int(tokens.max()) >= model.config.n_vocab:
            return _result("silent", "load", reason="token ids >= vocab loaded")
        if hit.structural:
            return _result("silent", "load", reason="a structural field changed and the state differs")
        return _result("changed", "load", reason="a value changed: another valid state")

    def session(self, model, seed: Seed, m: Mutation):
        ctx, chunk = m.value if m.op == "other-session" else (seed.ctx, seed.chunk)
        return model.session(ctx=ctx, prefill_chunk=chunk)


def _contents(lay, buf) -> tuple[bytes, ...]:
    """A payload's tokens, logits and arrays (dequantized), as bytes: what a restore reproduces."""
    import numpy as np

    arrays = [a.read(buf) for layer in lay.layers for a in layer.values() if a is not None]
    return (lay.tokens(buf).tobytes(), lay.logits(buf).tobytes(),
            *(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays))


def _inspect(path: Path) -> dict | None:
    """``ds4lab inspect FILE`` (its output discarded): None, or the crash / the refusal that does not name the file.
    Its refusals (ModelFileError, KVFileError, and the CLI's own ValueError / OSError) must start with the path."""
    from argparse import Namespace

    from ds4lab.cli.inspect_file import inspect_command
    from ds4lab.config import ModelFileError
    from ds4lab.kv.kvfile import KVFileError

    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            inspect_command(Namespace(file=path))
    except (ModelFileError, KVFileError) as e:
        if not str(e).startswith(f"{path}: "):
            return _result("refused", "inspect", e, named=False)
    except (ValueError, OSError) as e:  # the CLI's own refusals name the file; a bare one from deeper down is a crash
        if not (str(e).startswith(f"{path}: ") or getattr(e, "filename", None) == str(path)):
            return _result("crash", "inspect", e)
    except Exception as e:  # noqa: BLE001
        return _result("crash", "inspect", e)
    return None


def _result(outcome: str, where: str, exc: BaseException | None = None, *, named: bool | None = None,
            exact: bool | None = None, reason: str = "", message: str = "", error: str = "") -> dict:
    out = {"outcome": outcome, "where": where, "reason": reason, "named": named, "exact": exact,
           "error": error or (type(exc).__name__ if exc else ""), "message": message or (str(exc) if exc else "")}
    if exc is not None and outcome == "crash":
        out["traceback"] = "".join(traceback.format_exception(exc)[-4:])[-2000:]
    return out


def _send(stream, obj) -> None:
    blob = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(blob)) + blob)
    stream.flush()


def _recv(stream):
    head = stream.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    blob = stream.read(n)
    if len(blob) < n:
        return None
    return pickle.loads(blob)


def worker_main(seeds_dir: str, work_dir: str) -> None:
    import faulthandler
    import resource
    import warnings

    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a case prints goes to the worker's log, not into the protocol
    faulthandler.enable()
    warnings.simplefilter("ignore")
    worker = Worker(Path(seeds_dir), Path(work_dir))
    # A runaway allocation is a MemoryError (a crash), not the machine's OOM killer: 6 GiB above what the imports
    # mapped (GPU runtimes reserve much address space).
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (mapped + (6 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
    _send(out, {"ready": os.getpid()})
    while True:
        msg = _recv(sys.stdin.buffer)
        if msg is None:
            return
        t0 = time.perf_counter()
        try:
            res = worker.run(*msg)
        except Exception as e:  # noqa: BLE001  (the harness itself failed: report it as a crash of the case)
            res = _result("crash", "harness", e)
        res["seconds"] = round(time.perf_counter() - t0, 3)
        _send(out, res)


# ---------------------------------------------------------------------------------------------------------
# the pool (in the parent)


class _Proc:
    def __init__(self, pool: "Pool", k: int):
        self.k = k
        self.dir = pool.work / f"w{k}-{time.monotonic_ns()}"
        self.dir.mkdir(parents=True)
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
        self.log = open(pool.work / f"worker-{k}.log", "ab")
        self.p = subprocess.Popen([sys.executable, "-m", "tests.fuzz_files", "worker", str(pool.seeds_dir),
                                   str(self.dir)], cwd=REPO, env=env, stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log)
        self.busy = None  # (case record, deadline)
        self.ready = False

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
        self.p.wait()
        for s in (self.p.stdin, self.p.stdout):
            with contextlib.suppress(OSError):
                s.close()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Pool:
    """Worker processes running cases with a time limit; ``results`` holds one record per case."""

    def __init__(self, seeds_dir: Path, workers: int = 2, timeout: float = CASE_TIMEOUT_S, work: Path | None = None):
        self.seeds_dir = Path(seeds_dir)
        self.work = Path(work or tempfile.mkdtemp(prefix="ds4lab-fuzz-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.timeout = timeout
        self.procs = [_Proc(self, k) for k in range(workers)]
        self.results: list[dict] = []
        self._next = 0
        self.startup_failures = 0

    def submit(self, seed: str, family: str, m: Mutation, splices, hit: Hit) -> None:
        record = {"id": self._next, "family": family, "seed": seed, "mutation": m, "hit": hit}
        self._next += 1
        while True:
            free = [p for p in self.procs if p.busy is None and p.ready]
            if free:
                break
            self._poll(block=True)
        proc = free[0]
        limit = SPECIAL_TIMEOUT_S if m.op == "special" else self.timeout
        proc.busy = (record, time.monotonic() + limit, limit)
        try:
            _send(proc.p.stdin, (record["id"], seed, m, splices, hit))
        except (BrokenPipeError, OSError):
            pass  # the worker died; _poll sees its EOF

    def drain(self) -> list[dict]:
        while any(p.busy for p in self.procs):
            self._poll(block=True)
        return self.results

    def _poll(self, block: bool) -> None:
        now = time.monotonic()
        waiting = list(self.procs)  # an idle worker's EOF (it died between cases) is seen too
        deadlines = [p.busy[1] for p in waiting if p.busy] + [now + 120]
        timeout = max(0.0, min(deadlines) - now) if block else 0.0
        ready, _, _ = select.select([p.p.stdout for p in waiting], [], [], timeout)
        for p in list(self.procs):
            if p.p.stdout in ready:
                msg = _recv(p.p.stdout)
                if msg is None:  # died: a signal (or an exit) in the middle of a case
                    code = p.p.wait()
                    if not p.ready:
                        self.startup_failures += 1
                        if self.startup_failures > 3:
                            raise RuntimeError(f"fuzz workers die at startup; see {self.work}/worker-{p.k}.log")
                    if p.busy:
                        what = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
                        self._finish(p, {"outcome": "crash", "where": "process", "error": what,
                                         "message": what + "; see " + str(self.work / f'worker-{p.k}.log')})
                    self._respawn(p)
                elif "ready" in msg:
                    p.ready = True
                else:
                    self._finish(p, msg)
            elif p.busy and time.monotonic() > p.busy[1]:
                self._finish(p, {"outcome": "hang", "where": "process", "error": "timeout",
                                 "message": f"no answer within {p.busy[2]:g} s"})
                self._respawn(p)

    def _finish(self, p: _Proc, res: dict) -> None:
        record = p.busy[0]
        p.busy = None
        record.update(res)
        self.results.append(record)

    def _respawn(self, p: _Proc) -> None:
        p.kill()
        self.procs[self.procs.index(p)] = _Proc(self, p.k)

    def close(self) -> None:
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.p.stdin.close()
        for p in self.procs:
            try:
                p.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            p.kill()


# ---------------------------------------------------------------------------------------------------------
# driving it with Hypothesis


def fuzz(pool: Pool, seeds: list[Seed], layouts: dict, families: tuple[str, ...], n: int, *,
         seed: int | None = None) -> list[dict]:
    """Run ``n`` Hypothesis-drawn cases on the seeds of ``families`` through ``pool`` (``seed`` None:
    derandomized, the CI run). No-op mutations are discarded (``assume``); returns this run's records."""
    from hypothesis import HealthCheck, Phase, assume, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    chosen = [s for s in seeds if s.family in families]
    models = sorted({s.path for s in seeds if s.family == "gguf" and s.name in ("tiny", "embedded")})
    strategies = {}
    for s in chosen:
        lay, data = layouts[s.name]
        others = tuple(p for p in models if p != s.model) if s.family == "kv" else ()
        strategies[s.name] = mutations(lay, data, others)
    weighted = [s.name for s in chosen for _ in range(s.weight)]
    family = {s.name: s.family for s in chosen}
    start = len(pool.results)

    @settings(max_examples=n, derandomize=seed is None, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(st.sampled_from(weighted).flatmap(lambda name: st.tuples(st.just(name), strategies[name])))
    def run(case):
        name, m = case
        lay, data = layouts[name]
        splices, hit = plan(lay, data, m)
        assume(m.op in ("special", "other-model", "other-session") or not is_noop(data, splices))
        pool.submit(name, family[name], m, splices, hit)

    if seed is not None:
        run = hseed(seed)(run)
    run()
    pool.drain()
    return pool.results[start:]


def run_case(pool: Pool, layouts: dict, seeds: list[Seed], seed_name: str, m: Mutation) -> dict:
    """One given case through the pool (the regression tests)."""
    lay, data = layouts[seed_name]
    splices, hit = plan(lay, data, m)
    family = next(s.family for s in seeds if s.name == seed_name)
    start = len(pool.results)
    pool.submit(seed_name, family, m, splices, hit)
    pool.drain()
    return pool.results[start]


# ---------------------------------------------------------------------------------------------------------
# reporting


def failed(r: dict) -> bool:
    return r["outcome"] in FAILURES or (r["outcome"] == "refused" and not r.get("named"))


def table(results: list[dict]) -> str:
    lines = [f"{'':8} {'tried':>6} {'refused':>8} {'(named)':>8} {'unchanged':>9} {'changed':>8} {'silent':>6} "
             f"{'crashes':>7} {'hangs':>5}  {'pinpointed':>10}"]
    for fam in ("gguf", "kv", "payload"):
        rs = [r for r in results if r["family"] == fam]
        if not rs:
            continue
        c = Counter(r["outcome"] for r in rs)
        named = sum(1 for r in rs if r["outcome"] == "refused" and r.get("named"))
        exact = [r for r in rs if r["outcome"] == "refused" and r.get("exact") is not None]
        pin = f"{sum(1 for r in exact if r['exact'])}/{len(exact)}"
        lines.append(f"{fam:8} {len(rs):6d} {c['refused']:8d} {named:8d} {c['unchanged']:9d} {c['changed']:8d} "
                     f"{c['silent']:6d} {c['crash']:7d} {c['hang']:5d}  {pin:>10}")
    lines.append("changed: a value field changed and the load gives another finite model/state (a different valid "
                 "file); pinpointed: refusals naming the very key/tensor/field hit, of those where one is known")
    return "\n".join(lines)


def _signature(r: dict) -> tuple:
    msg = re.sub(r"/\S+?(\.gguf|\.kv)\b", "<file>", r.get("message", ""))
    msg = re.sub(r"0x[0-9a-f]+|-?\d+(\.\d+)?(e[-+]?\d+)?", "N", msg)
    msg = re.sub(r"'[^']*'|b'[^']*'|\"[^\"]*\"", "S", msg)[:90]
    what = r.get("reason") if r["outcome"] == "silent" else msg
    return r["family"], r["outcome"] if r["outcome"] != "refused" else "unnamed refusal", r.get("where"), \
        r.get("error"), what, r["hit"].kind if r["outcome"] == "silent" else ""


def distinct_failures(results: list[dict]) -> list[tuple[tuple, int, dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        if failed(r):
            groups.setdefault(_signature(r), []).append(r)
    return [(k, len(v), min(v, key=lambda r: len(str(r["mutation"])))) for k, v in groups.items()]


def describe(r: dict) -> str:
    m, hit = r["mutation"], r["hit"]
    outcome = r["outcome"].upper() + (" WITHOUT NAMING THE FILE AND FIELD" if r["outcome"] == "refused"
                                       and not r.get("named") else "")
    lines = [f"[{r['family']}:{r['seed']}] {outcome} in {r.get('where')}"
             f"{': ' + r['error'] if r.get('error') else ''}{' (' + r['reason'] + ')' if r.get('reason') else ''}",
             f"    mutation: {m}",
             f"    field:    {hit.description}",
             f"    repro:    run_case(pool, layouts, seeds, {r['seed']!r}, {m!r})"]
    if r.get("message"):
        lines.append(f"    message:  {r['message'][:400]}")
    if r.get("traceback"):
        lines += ["    | " + line for line in r["traceback"].strip().splitlines()[-4:]]
    return "\n".join(lines)


def report(results: list[dict]) -> str:
    out = [table(results)]
    fails = distinct_failures(results)
    if fails:
        out.append(f"\n{len(fails)} distinct failures (one smallest reproducer each):")
        for _, count, r in sorted(fails, key=lambda x: (x[0][0], x[0][1], -x[1])):
            out.append(f"\n({count} case{'s' if count > 1 else ''}) " + describe(r))
    return "\n".join(out)


def run_long(n_gguf: int, n_kv: int, *, workers: int | None = None, seed: int = 0, root: Path | None = None,
             timeout: float = CASE_TIMEOUT_S, log=print) -> list[dict]:
    """The long run: seeds (the test configs too), then ``n_gguf`` GGUF and ``n_kv`` .kv/payload cases."""
    root = Path(root or tempfile.mkdtemp(prefix="ds4lab-fuzz-long-"))
    workers = workers or os.cpu_count() or 2
    t0 = time.monotonic()
    pool = Pool(root / "seeds", workers, timeout, work=root / "work")
    try:
        seeds = prepare(root / "seeds", long=True)
        layouts = load_layouts(seeds)
        log(f"seeds ready in {time.monotonic() - t0:.0f} s: " + ", ".join(s.name for s in seeds))
        results = []
        if n_gguf:
            results += fuzz(pool, seeds, layouts, ("gguf",), n_gguf, seed=seed)
            log(f"GGUF: {len(results)} cases at {time.monotonic() - t0:.0f} s")
        if n_kv:
            n_payload = n_kv // 4
            results += fuzz(pool, seeds, layouts, ("kv",), n_kv - n_payload, seed=seed)
            results += fuzz(pool, seeds, layouts, ("payload",), n_payload, seed=seed)
            log(f"KV: {len(results)} cases in all at {time.monotonic() - t0:.0f} s")
    finally:
        pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["worker"]:
        worker_main(argv[1], argv[2])
        return 0
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz_files", description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=int, default=5000, help="GGUF cases (default 5000)")
    ap.add_argument("--kv", type=int, default=3000, help=".kv and payload cases (default 3000; a quarter payloads)")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: the CPU count)")
    ap.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    ap.add_argument("--timeout", type=float, default=CASE_TIMEOUT_S, help="seconds a case may take (default 10)")
    ap.add_argument("--dir", type=Path, default=None, help="where seeds, worker logs and the report go")
    ap.add_argument("--json", type=Path, default=None, help="write every case's record here")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    results = run_long(args.gguf, args.kv, workers=args.workers, seed=args.seed, root=args.dir, timeout=args.timeout)
    print(report(results))
    print(f"\n{len(results)} cases in {time.monotonic() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps([{**{k: v for k, v in r.items() if k not in ("mutation", "hit")},
                                          "mutation": str(r["mutation"]), "mutation_repr": repr(r["mutation"]),
                                          "hit": asdict(r["hit"])} for r in results], indent=1))
    return 1 if any(failed(r) for r in results) else 0


if __name__ == "__main__":
    if str(REPO) not in sys.path:  # run as a script (python tests/fuzz_files.py): `tests` is a package of REPO
        sys.path.insert(0, str(REPO))
    sys.exit(main())
