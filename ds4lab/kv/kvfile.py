"""ds4's ``KVC`` file, the on-disk checkpoint of ds4-server's KV store
(docs/FORMATS.md, "KVC files and the KV store").

Layout, as ``ds4_kvstore_fill_header`` writes it and ``ds4_kvstore_read_header`` reads it
(ds4_kvstore.c:379-422 at 8d57664, 395-440 at b0309611), all little-endian::

     0 "KVC"          3 u8 version = 1      4 u8 routed-expert quant bits of the model (2 or 4)
     5 u8 reason      6 u8 ext flags        7 u8 model id (0 DeepSeek V4 Flash, 1 V4 PRO, 2 GLM 5.2)
     8 u32 tokens    12 u32 hits           16 u32 ctx_size      20 u8 payload ABI (0 or 2; + 0x80), 21-23 zero
    24 u64 created   32 u64 last_used      40 u64 payload_bytes
    48 u32 text_bytes, then the cache text, the payload (payload_bytes long), then optional trailers.

Two generations of ds4 wrote these files. Until 2026-05-26 byte 20 was reserved (0) and the payload was ``DSV4``
version 1; since e8e8779b byte 20 is the payload ABI, 2, and ds4 skips a file without it; the payload says version
2 (the same bytes for a DeepSeek V4 model). Byte 7 names the model since 04f151dc (2026-05-25; 0, Flash, before).
ds4lab reads both (:attr:`KVHeader.legacy`: ABI 0) and writes ABI 2 unless asked for the older form
(``payload_version=1``); its codec payloads (bits 4-6, which ds4 cannot load) add 0x80 to byte 20, so that a ds4
since e8e8779b skips them instead of finding them in a lookup, failing to load them and never storing its own
file for that text. A file is read only if the magic and version match, the ABI byte is 0 or 2 (+ 0x80 with a
codec bit), tokens != 0, payload_bytes != 0 and the quant byte is 2 or 4; reasons above 6 read as "unknown".
The payload is ds4's ``DSV4`` session payload (:mod:`.payload`); GLM 5.2's
(model id 2) lays its arrays out otherwise and is refused.

ds4 uses ext bits 0-2 (bit 0: the server's tool-id map trailer; bits 1-2: the key is visible transcript text) and,
since bfe070a2 (2026-05-24), bit 3 (ds4-agent's session title: a u32 length and the title right after the payload).
ds4lab's own bits, which ds4 never tests:

* bit 4 ``EXT_Q8``: KV rows (raw, compressed and indexer rows) are 8-bit: per array, a f32 scale per row
  (max |x| / 127) then the int8 rows. The pending compressor states and logits stay f32 (the scores hold
  -1e30 sentinels). Its ``DSV4`` header says version ``Q8_VERSION_BIT | v``, so ds4's loader refuses it at
  its first check instead of misreading it.
* bit 5 ``EXT_ZLIB`` / bit 6 ``EXT_ZSTD``: the payload (after 8-bit packing, if bit 4 is set) is a u64 with
  its unpacked size followed by a zlib (zstd) stream. ds4 refuses these at the payload magic.
* bit 7 ``EXT_FINGERPRINT``: the writing model's fingerprint (``model.file.fingerprint``, 32 hex digits: a digest
  of the GGUF's metadata, tensor directory and data samples) in a trailer. Two models of one configuration write
  payloads of the same shapes, so nothing else in ds4's format tells their files apart.
* The checksum: a CRC-32 of everything before it, the two fields that change in place (hits, last_used) read as
  zero. In a legacy file ext bit 3 (``EXT_CHECKSUM``) says it ends the file as an 8-byte trailer, "KCK", 1, u32
  CRC (a legacy file whose bit 3 is set but which does not end so is one of ds4-agent's of May 24-25: a title). In
  an ABI-2 file bit 3 is ds4's, so the checksum joins the fingerprint in one 28-byte trailer ending
  the file, flagged by bit 7: "KFP", 2, the 16-byte fingerprint (zeros: unknown), u32 flags (1: the CRC is
  there; 2: the state was edited, its rows no longer the ones its tokens give: ``ds4lab.kv.edit``), u32 CRC of
  everything before it.

In a legacy file the fingerprint trailer ("KFP", 1, 16 bytes) comes right after the payload, then the checksum.
ds4 reads nothing past the payload but its own trailers (bits 0 and 3), and accepts a file at least 52 + text +
payload long, so it loads ds4lab's files as its own. Not in the header: ds4 rewrites the header (hits,
last_used) through ``ds4_kvstore_fill_header``; not in a sidecar file: ds4's eviction and another process's rename
would not move it with the ``.kv``. A file without a fingerprint (what ds4-server writes) cannot be checked against
a model; the store loads it on ds4's rules and says so. ds4lab writes no tool-id map or title. ds4-server adds its
tool map to a file it loads by truncating at the payload: a ds4lab file then keeps its fingerprint and checksum bits
without their trailer, and reads as one without them (``Trailers.stripped``: "KTM" 1 right after the payload).

The quant byte keeps ds4's meaning (the model's routed experts, not the KV rows): ds4 refuses any other value.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import mmap
import os
import stat
import struct
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import FLASH, PRO
from .layout import LAYER_FIELDS, ROW_FIELDS
from .payload import (
    HEADER_BYTES,
    MAGIC,
    Q8_VERSION_BIT,
    VERSION,
    ArrayAt,
    PayloadError,
    PayloadLayout,
    check_version,
    parse_layout,
    payload_header,
)

try:
    import zstandard
except ImportError:  # optional: zstd payloads need the zstandard package
    zstandard = None
_CODEC_ERRORS = (zlib.error, ValueError, MemoryError) + ((zstandard.ZstdError,) if zstandard else ())

KVC_MAGIC = b"KVC"
KVC_VERSION = 1
FIXED_HEADER = 48
PREFIX_BYTES = FIXED_HEADER + 4  # the fixed header and u32 text_bytes
REASONS = ("unknown", "cold", "continued", "evict", "shutdown", "agent-system", "agent-session")
QUANT_BITS = (2, 4)
MODELS = {0: "DeepSeek V4 Flash", 1: "DeepSeek V4 PRO", 2: "GLM 5.2"}  # header byte 7 (ds4's ds4_variant)
DSV4_MODEL_IDS = frozenset({0, 1})  # the models whose payload is DSV4's layout (not GLM 5.2's, 2)
# header byte 20: the payload ABI ds4 wrote, and the DSV4 payload version it goes with (0: before e8e8779b)
PAYLOAD_VERSION_OF_ABI = {0: 1, 2: 2}
ABI_OF_PAYLOAD_VERSION = {v: abi for abi, v in PAYLOAD_VERSION_OF_ABI.items()}
# byte 20's top bit: a ds4lab codec payload (8-bit rows, zlib, zstd), which ds4 cannot load: since e8e8779b ds4
# skips any byte but 2, so such a file never stands in ds4-server's lookup (it would win the prefix, fail to load
# and stay, and ds4 would never store its own file for that text)
CODEC_ABI_MARK = 0x80

EXT_TOOL_MAP = 1 << 0
EXT_RESPONSES_VISIBLE = 1 << 1
EXT_THINKING_VISIBLE = 1 << 2
EXT_CHECKSUM = 1 << 3  # ds4lab's checksum in a legacy (ABI 0) file
EXT_SESSION_TITLE = 1 << 3  # ds4-agent's title in an ABI-2 file
EXT_Q8 = 1 << 4
EXT_ZLIB = 1 << 5
EXT_ZSTD = 1 << 6
EXT_FINGERPRINT = 1 << 7
EXT_NAMES = {EXT_TOOL_MAP: "tool-map", EXT_RESPONSES_VISIBLE: "responses-visible",
             EXT_THINKING_VISIBLE: "thinking-visible", EXT_CHECKSUM: "checksum or title", EXT_Q8: "q8",
             EXT_ZLIB: "zlib", EXT_ZSTD: "zstd", EXT_FINGERPRINT: "fingerprint"}
CODECS = {None: 0, "q8": EXT_Q8, "zlib": EXT_ZLIB, "zstd": EXT_ZSTD, "q8+zlib": EXT_Q8 | EXT_ZLIB,
          "q8+zstd": EXT_Q8 | EXT_ZSTD}

CHECKSUM_MAGIC = b"KCK\x01"
CHECKSUM_BYTES = 8
TOOL_MAP_MAGIC = b"KTM\x01"  # ds4-server's tool-id map trailer (ds4_server.c:8179-8181), version 1
FINGERPRINT_MAGIC = b"KFP\x01"
FINGERPRINT_DIGEST = 16  # the 32-hex model fingerprint, as bytes
FINGERPRINT_BYTES = len(FINGERPRINT_MAGIC) + FINGERPRINT_DIGEST
RECORD_MAGIC = b"KFP\x02"  # an ABI-2 file's trailer: the fingerprint, flags and the checksum
RECORD = struct.Struct("<4s16sII")
RECORD_CRC = 1  # its flag: the CRC field holds the checksum
RECORD_EDITED = 2  # its flag: the state was edited (Checkpoint.edits), which the payload cannot say
STATE_FIELDS = tuple(f for f in LAYER_FIELDS if f not in ROW_FIELDS)

_HEADER = struct.Struct("<3sBBBBBIIIIQQQI")
_MUTABLE = ((12, 16), (32, 40))  # hits and last_used: rewritten in place on every disk hit
_U64 = struct.Struct("<Q")


class KVFileError(ValueError):
    """A ``KVC`` file or payload that cannot be used; ``path``, ``field``, ``got``, ``expected`` say why."""

    def __init__(self, path, field: str, got, expected, message: str | None = None):
        text = message or f"{field} is {got}, expected {expected}"
        super().__init__(f"{path}: {text}")
        self.path, self.field, self.got, self.expected = path, field, got, expected

    @classmethod
    def of_payload(cls, path, error) -> "KVFileError":
        """The payload refusal ``error`` (a :class:`~ds4lab.kv.payload.PayloadError`) of the file at ``path``."""
        return cls(path, error.field, error.got, error.expected, str(error))


def reason_code(reason: str) -> int:
    if reason not in REASONS:
        raise ValueError(f"unknown KV store reason {reason!r}; expected one of {', '.join(REASONS)}")
    return REASONS.index(reason)


def ext_names(flags: int, legacy: bool = False) -> str:
    """The ext bits' names; bit 3 is ds4lab's checksum in a legacy file, ds4-agent's title in an ABI-2 one."""
    names = [("checksum" if legacy else "title") if bit == EXT_CHECKSUM else name
             for bit, name in EXT_NAMES.items() if flags & bit]
    unknown = flags & ~sum(EXT_NAMES)
    return ",".join(names + ([f"{unknown:#x}"] if unknown else [])) or "none"


# -- fixed header ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class KVHeader:
    quant_bits: int
    reason: int
    ext_flags: int
    tokens: int
    hits: int
    ctx_size: int
    created: int
    last_used: int
    payload_bytes: int
    text_bytes: int
    version: int = KVC_VERSION
    model_id: int = 0
    payload_abi: int = ABI_OF_PAYLOAD_VERSION[VERSION]

    @property
    def legacy(self) -> bool:
        """Written by a ds4 before 2026-05-26 (or as it wrote them): no ABI byte, payload version 1; ext bit 3 is
        ds4lab's checksum (or, in ds4-agent's files of 2026-05-24 and 25, its title)."""
        return self.payload_abi & ~CODEC_ABI_MARK == 0

    @property
    def payload_version(self) -> int:
        return PAYLOAD_VERSION_OF_ABI[self.payload_abi & ~CODEC_ABI_MARK]

    def pack(self) -> bytes:
        """The fixed header and ``text_bytes``, as ``ds4_kvstore_fill_header`` writes them (bytes 21-23 zero)."""
        return _HEADER.pack(KVC_MAGIC, self.version, self.quant_bits, self.reason, self.ext_flags, self.model_id,
                            self.tokens, self.hits, self.ctx_size, self.payload_abi, self.created, self.last_used,
                            self.payload_bytes, self.text_bytes)

    @classmethod
    def unpack(cls, data, path) -> KVHeader:
        """Parse the first 52 bytes with ds4's checks; :class:`KVFileError` names the field."""
        if len(data) < PREFIX_BYTES:
            raise KVFileError(path, "header", f"{len(data)} bytes", f"at least {PREFIX_BYTES}", "truncated header: "
                              f"{len(data)} bytes, the fixed header and text length take {PREFIX_BYTES}")
        (magic, version, quant, reason, ext, model, tokens, hits, ctx, abi, created, last_used, payload_bytes,
         text_bytes) = _HEADER.unpack_from(data)
        if magic != KVC_MAGIC:
            raise KVFileError(path, "magic", magic, KVC_MAGIC, f"not a KVC file: magic is {magic!r}, expected b'KVC'")
        if version != KVC_VERSION:
            who = ("a newer ds4, or a fork of it, wrote it, which this ds4lab cannot read" if version > KVC_VERSION
                   else "no ds4 writes it")
            raise KVFileError(path, "version", version, KVC_VERSION,
                              f"version (header byte 3) is {version}, expected {KVC_VERSION}: {who}")
        abi &= 0xFF  # ds4 reads byte 20 alone
        base, codec = abi & ~CODEC_ABI_MARK, ext & (EXT_Q8 | EXT_ZLIB | EXT_ZSTD)
        if base not in PAYLOAD_VERSION_OF_ABI or (abi & CODEC_ABI_MARK and not codec):
            newer = ": a newer ds4 or a fork of it (forks write 3 and 4) wrote it, which this ds4lab cannot read" \
                if base > 2 else ""
            raise KVFileError(path, "payload_abi", abi, "0 or 2 (+ 0x80 with a codec bit)",
                              f"payload_abi (header byte 20) is {abi:#04x}, expected 0 (ds4 before 2026-05-26) or 2 "
                              f"(ds4 since), plus 0x80 for ds4lab's codec payloads (ext bits 4-6){newer}")
        if model not in DSV4_MODEL_IDS:
            name = f"{MODELS[model]}'s" if model in MODELS else "a model of a newer ds4's"
            raise KVFileError(path, "model_id", model, "0 (DeepSeek V4 Flash) or 1 (V4 PRO)",
                              f"model_id (header byte 7) is {model}: {name} KV state, whose payload ds4lab does not "
                              f"read (it reads DeepSeek V4's: 0 Flash, 1 PRO)")
        if quant not in QUANT_BITS:
            raise KVFileError(path, "quant_bits", quant, "2 or 4 (the model's routed-expert bits)")
        if tokens == 0:
            raise KVFileError(path, "tokens", 0, "at least 1")
        if payload_bytes == 0:  # ds4-agent's session stubs: a title and text, no KV state
            raise KVFileError(path, "payload_bytes", 0, "at least the 52-byte DSV4 header",
                              "payload_bytes is 0: the file holds no KV state (ds4-agent writes such session stubs)")
        return cls(quant, reason if reason < len(REASONS) else 0, ext, tokens, hits, ctx, created, last_used,
                   payload_bytes, text_bytes, version, model, abi)

    @property
    def payload_end(self) -> int:
        """Where the payload ends: ds4 reads nothing after it (but its tool-id map, bit 0, or title, bit 3)."""
        return PREFIX_BYTES + self.text_bytes + self.payload_bytes

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["reason"] = REASONS[self.reason]
        d["model"] = MODELS[self.model_id]
        return d


@dataclass(frozen=True)
class Trailers:
    """What follows a file's payload, as :func:`read_trailers` found it."""

    title: bytes | None  # ds4-agent's session title (ext bit 3 of an ABI-2 file, or of its legacy files of May 24-25)
    fingerprint: str | None  # the writing model's, or None (ds4-server's files, or a writer that had none)
    end: int  # where the trailers ds4lab knows end: the file's size, but for ds4-server's tool-id map after them
    crc_at: int | None = None  # where ds4lab's CRC-32 is stored, None without one
    crc_covers: int = 0  # the CRC covers the file's bytes before this offset (hits and last_used read as zero)
    stripped: bool = False  # ds4-server replaced ds4lab's trailers with its tool-id map (it truncates at the payload)
    edited: bool = False  # the trailer's RECORD_EDITED flag


def read_trailers(header: KVHeader, size: int, read_at, path) -> Trailers:
    """Check a file of ``size`` bytes against ``header`` and find what follows its payload; ``read_at(offset, n)``
    returns the file's bytes there. After the payload come ds4's trailers (ds4-agent's title: a u32 length and the
    title; ds4-server's tool-id map, ``KTM`` 1) and ds4lab's (module docstring). ds4 needs the file to hold the
    header, text and payload; without a tool-id map (whose length only its own parser knows) ds4lab wants the exact
    size, so a stray or missing trailer shows."""
    ext, end = header.ext_flags, header.payload_end
    parts = [(f"{PREFIX_BYTES}", PREFIX_BYTES), ("text", header.text_bytes), ("payload", header.payload_bytes)]
    ours = ext & (EXT_FINGERPRINT | (EXT_CHECKSUM if header.legacy else 0))
    if ext & EXT_TOOL_MAP and ours and size >= end + 8 and bytes(read_at(end, 4)) == TOOL_MAP_MAGIC:
        # ds4-server added its map to a file ds4lab wrote: it truncated at the payload, so ds4lab's trailers are
        # gone with their bits left set (one damaged bit cannot make this: ds4lab never writes "KTM" there)
        return Trailers(None, None, end, stripped=True)
    # bit 3 of a legacy file: ds4lab's checksum where the file ends in its trailer, else ds4-agent's title
    title = bool(ext & EXT_SESSION_TITLE) and (not header.legacy or not (
        size >= end + CHECKSUM_BYTES and bytes(read_at(size - CHECKSUM_BYTES, 4)) == CHECKSUM_MAGIC))
    title_len = None
    if title:
        if size < end + 4:
            raise _size_error(path, size, parts + [("title length", 4)], "at least ")
        title_len = struct.unpack("<I", read_at(end, 4))[0]
        parts.append(("title", 4 + title_len))
    after_title = sum(n for _, n in parts)
    if header.legacy:
        parts += ([("fingerprint", FINGERPRINT_BYTES)] if ext & EXT_FINGERPRINT else []) + \
                 ([("checksum", CHECKSUM_BYTES)] if ext & EXT_CHECKSUM and not title else [])
    elif ext & EXT_FINGERPRINT:
        parts.append(("fingerprint and checksum", RECORD.size))
    want = sum(n for _, n in parts)
    if size < want or (size > want and not ext & EXT_TOOL_MAP):
        raise _size_error(path, size, parts)
    fingerprint, crc_at, covers, edited = None, None, 0, False
    if header.legacy:
        if ext & EXT_FINGERPRINT:
            fingerprint = parse_fingerprint(read_at(after_title, FINGERPRINT_BYTES), path)
        if ext & EXT_CHECKSUM and not title:
            trailer = bytes(read_at(want - CHECKSUM_BYTES, CHECKSUM_BYTES))
            if trailer[:4] != CHECKSUM_MAGIC:
                raise KVFileError(path, "checksum trailer", trailer[:4], CHECKSUM_MAGIC)
            crc_at, covers = want - 4, want - CHECKSUM_BYTES
    elif ext & EXT_FINGERPRINT:
        fingerprint, has_crc, _, edited = _parse_record(bytes(read_at(after_title, RECORD.size)), path)
        if has_crc:
            crc_at = covers = want - 4
    return Trailers(None if title_len is None else bytes(read_at(end + 4, title_len)), fingerprint, want, crc_at,
                    covers, edited=edited)


def _size_error(path, size: int, parts, relation: str = "") -> KVFileError:
    total = sum(n for _, n in parts)
    what = " + ".join(name if name == str(n) else f"{name} {n}" for name, n in parts)
    return KVFileError(path, "file size", size, f"{relation}{total} = {what}")


def _parse_record(record: bytes, path) -> tuple[str | None, bool, int, bool]:
    """(fingerprint or None, whether the CRC is there, the CRC, whether the state was edited) of an ABI-2 file's
    28-byte trailer."""
    if len(record) != RECORD.size or record[:4] != RECORD_MAGIC:
        raise KVFileError(path, "fingerprint trailer", bytes(record[:4]), RECORD_MAGIC)
    _, digest, flags, crc = RECORD.unpack(record)
    # a damaged flags field must not turn the checksum off: without the CRC flag the CRC field is zero
    if flags & ~(RECORD_CRC | RECORD_EDITED) or (not flags & RECORD_CRC and crc != 0):
        raise KVFileError(path, "trailer flags", f"{flags} with CRC field {crc:#010x}",
                          "1 or 3, or 0 or 2 with a zero CRC field")
    return (digest.hex() if any(digest) else None), bool(flags & RECORD_CRC), crc, bool(flags & RECORD_EDITED)


def checksum(head, *parts) -> int:
    """CRC-32 of a file's first 52 bytes (``head``, with the in-place fields hits and last_used read as zero)
    followed by ``parts`` (the rest up to the trailer)."""
    head = bytearray(head[:PREFIX_BYTES])
    for lo, hi in _MUTABLE:
        head[lo:hi] = bytes(hi - lo)
    crc = zlib.crc32(head)
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


def _stored_checksum(buf, trailers: Trailers) -> tuple[int, int] | None:
    """``(stored CRC, where the bytes it covers end)`` of a whole file ``buf`` whose trailers are ``trailers``, or
    None without a CRC."""
    return None if trailers.crc_at is None else (struct.unpack_from("<I", buf, trailers.crc_at)[0],
                                                 trailers.crc_covers)


def _checksum_from_the_end(buf, path) -> tuple[int, int] | None:
    """The same for a file whose header or trailers do not parse (``inspect`` of a damaged file): read from its
    end as its ABI byte and ext flags say, or None when they say it has none."""
    if len(buf) < 21:
        return None
    ext, legacy = buf[6], buf[20] & ~CODEC_ABI_MARK == 0
    if legacy and ext & EXT_CHECKSUM:
        if len(buf) < PREFIX_BYTES + CHECKSUM_BYTES:
            raise KVFileError(path, "checksum trailer", f"a {len(buf)}-byte file", f"at least {PREFIX_BYTES + 8} bytes")
        end = len(buf) - CHECKSUM_BYTES
        if bytes(buf[end:end + 4]) != CHECKSUM_MAGIC:
            raise KVFileError(path, "checksum trailer", bytes(buf[end:end + 4]), CHECKSUM_MAGIC)
        return struct.unpack_from("<I", buf, end + 4)[0], end
    if not legacy and ext & EXT_FINGERPRINT:
        if len(buf) < PREFIX_BYTES + RECORD.size:
            raise KVFileError(path, "fingerprint trailer", f"a {len(buf)}-byte file",
                              f"at least {PREFIX_BYTES + RECORD.size} bytes")
        _, has_crc, crc, _ = _parse_record(bytes(buf[len(buf) - RECORD.size:]), path)
        return (crc, len(buf) - 4) if has_crc else None
    return None


def _compare(buf, found, path) -> None:
    if found is None:
        return
    stored, end = found
    actual = checksum(buf[:PREFIX_BYTES], memoryview(buf)[PREFIX_BYTES:end])
    if stored != actual:
        raise KVFileError(path, "checksum", f"{actual:#010x}", f"{stored:#010x} (stored)",
                          f"checksum mismatch: the file's CRC-32 is {actual:#010x}, the trailer says {stored:#010x}")


def checksum_status(buf, path) -> tuple[str, str]:
    """The checksum of a whole file ``buf``, for ``inspect`` and the store: ``("ok", …)``, ``("mismatch", …)`` or
    ``("none", …)``. Where the header or trailers do not parse, it is read from the file's end (a damaged file's
    checksum still says so); never raises."""
    try:
        try:
            found = _stored_checksum(buf, read_trailers(KVHeader.unpack(buf, path), len(buf),
                                                        lambda at, n: bytes(buf[at:at + n]), path))
        except KVFileError:
            found = _checksum_from_the_end(buf, path)
        _compare(buf, found, path)
    except KVFileError as e:
        detail = str(e).removeprefix(f"{path}: ").removeprefix("checksum mismatch: ")  # said once, as MISMATCH
        return "mismatch", f"MISMATCH: {detail} (the file is damaged)"
    if found is None:
        return "none", ("none (the file has no checksum: ds4-server's files have none, nor do files written with "
                        "checksum=False; the contents were not verified)")
    return "ok", f"ok (CRC-32 {found[0]:#010x} of everything before it, hits and last_used read as zero)"


def _digest(fingerprint: str) -> bytes:
    try:
        digest = bytes.fromhex(fingerprint)
    except (TypeError, ValueError):
        digest = b""
    if len(digest) != FINGERPRINT_DIGEST:
        raise ValueError(f"a model fingerprint is {2 * FINGERPRINT_DIGEST} hex digits, got {fingerprint!r}")
    return digest


def parse_fingerprint(trailer: bytes, path) -> str:
    """The fingerprint in a legacy file's 20-byte ``EXT_FINGERPRINT`` trailer; :class:`KVFileError` if it is not
    one."""
    if len(trailer) != FINGERPRINT_BYTES or trailer[:4] != FINGERPRINT_MAGIC:
        raise KVFileError(path, "fingerprint trailer", bytes(trailer[:4]), FINGERPRINT_MAGIC)
    return bytes(trailer[4:]).hex()


def read_file_trailers(fd: int, header: KVHeader, path) -> Trailers:
    """:func:`read_trailers` of an open file."""
    return read_trailers(header, os.fstat(fd).st_size, lambda at, n: os.pread(fd, n, at), path)


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kv_file_parts(text: bytes, payload: bytes, *, tokens: int, ctx: int, quant_bits: int, reason: str = "unknown",
                  codec_flags: int = 0, fingerprint: str | None = None, with_checksum: bool = True,
                  now: int | None = None, payload_version: int = VERSION,
                  model_id: int = 0, edited: bool = False) -> tuple[KVHeader, tuple[bytes, ...]]:
    """A file's header and its bytes in file order: header, ``text``, ``payload`` (in its stored form, ``codec_flags``
    saying which; ``DSV4`` version ``payload_version``, which sets the header's ABI byte), then the trailers of the
    fingerprint (given one) and, ``with_checksum``, of the CRC (module docstring); created and last_used are ``now``
    (default: the current time); ``model_id`` is header byte 7 (:data:`MODELS`: 0 Flash, 1 Pro); ``edited`` sets the
    trailer's RECORD_EDITED flag (a legacy file has no field for it)."""
    check_version(payload_version)
    if not codec_flags & (EXT_ZLIB | EXT_ZSTD):  # a stored payload starts with its DSV4 header: it must agree
        magic, version = struct.unpack_from("<II", payload) if len(payload) >= 8 else (None, None)
        if magic != MAGIC or version & 0xFF != payload_version:
            raise ValueError(f"the payload is not DSV4 version {payload_version}: its header says magic "
                             f"{magic if magic is None else hex(magic)}, version {version}")
    legacy = ABI_OF_PAYLOAD_VERSION[payload_version] == 0
    if legacy and edited:
        raise ValueError(f"an edited state cannot be marked so in a DSV4 version {payload_version} file (its trailers "
                         f"have no field for it); write version {VERSION}")
    digest = _digest(fingerprint) if fingerprint is not None else None
    if legacy:
        ours = (EXT_CHECKSUM if with_checksum else 0) | (EXT_FINGERPRINT if digest else 0)
    else:
        ours = EXT_FINGERPRINT if digest or with_checksum or edited else 0
    now = int(time.time()) if now is None else now
    abi = ABI_OF_PAYLOAD_VERSION[payload_version] | (CODEC_ABI_MARK if codec_flags else 0)
    if model_id not in DSV4_MODEL_IDS:
        raise ValueError(f"model_id {model_id}: ds4lab writes DeepSeek V4 state, 0 (Flash) or 1 (Pro)")
    header = KVHeader(quant_bits, reason_code(reason), codec_flags | ours, tokens, 0, ctx, now, now, len(payload),
                      len(text), model_id=model_id, payload_abi=abi)
    head = header.pack()
    if legacy:
        fp = FINGERPRINT_MAGIC + digest if digest else b""
        crc = (CHECKSUM_MAGIC + struct.pack("<I", checksum(head, text, payload, fp)),) if with_checksum else ()
        return header, (head, text, payload, fp, *crc)
    if not ours:
        return header, (head, text, payload)
    flags = (RECORD_CRC if with_checksum else 0) | (RECORD_EDITED if edited else 0)
    record = RECORD.pack(RECORD_MAGIC, digest or bytes(FINGERPRINT_DIGEST), flags, 0)
    crc = checksum(head, text, payload, record[:-4]) if with_checksum else 0
    return header, (head, text, payload, record[:-4] + struct.pack("<I", crc))


def write_file_atomic(path: Path, parts) -> None:
    """Write ``parts`` to a temporary file beside ``path``, fsync it and rename it over ``path``: a failed or
    interrupted write (an OSError, Ctrl+C) leaves no temporary file and whatever ``path`` held before. Through a
    symlink, the file it names is replaced and the link stays."""
    given, path = path, Path(os.path.realpath(path))
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}")
    size = sum(len(p) for p in parts)
    try:
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
            written = os.fstat(f.fileno()).st_size
        if written != size:
            raise OSError(f"wrote {written} bytes, expected {size}")
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.filename == str(tmp):  # the user's path, not the temporary one beside it
            raise type(e)(e.errno, e.strerror, str(given)) from None
        raise


def open_regular(path, mode: str = "rb"):
    """Open ``path`` (``mode`` "rb" or "r+b") as a file object only if it is a regular file (a symlink to one is
    fine). The open never blocks (O_NONBLOCK: a FIFO without a writer would wait for one) and the type is
    checked on the open descriptor before anything is read: a FIFO, a device such as ``/dev/zero`` (which
    never ends) or a directory raises :class:`KVFileError` naming the file and its type."""
    flags = (os.O_RDWR if mode == "r+b" else os.O_RDONLY) | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), f"mode {st.st_mode:#o}")
            raise KVFileError(path, "file type", kind, "a regular file",
                              f"not a regular file: it is {kind}; a KV cache file is a regular file")
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


# -- payload codecs -------------------------------------------------------------------------------------

def _quantize(x: np.ndarray) -> bytes:
    scale = (np.abs(x).max(axis=1) / 127).astype("<f4")
    q = np.round(x / np.where(scale > 0, scale, 1)[:, None])
    return scale.tobytes() + np.clip(q, -127, 127).astype(np.int8).tobytes()


def _relayout(buf, layout: PayloadLayout, version: int, convert) -> bytes:
    """Rewrite a payload with another header version, each KV-row array converted by ``convert(f32 rows)``."""
    head = bytearray(buf[layout.base:layout.counts_offset + 8 * len(layout.ratios)])
    struct.pack_into("<I", head, 4, version)
    parts = [bytes(head)]
    for arrays in layout.layers:
        for field in LAYER_FIELDS:
            arr = arrays[field]
            if arr is None:
                continue
            if field in ROW_FIELDS:
                parts.append(convert(arr.read(buf).astype(np.float32)))
            else:
                parts.append(bytes(buf[arr.offset:arr.offset + arr.nbytes]))
    return b"".join(parts)


def _compress(data: bytes, flags: int) -> bytes:
    if flags & EXT_ZSTD:
        if zstandard is None:
            raise RuntimeError("zstd KV payloads need the zstandard package (pip install zstandard)")
        return _U64.pack(len(data)) + zstandard.ZstdCompressor().compress(data)
    return _U64.pack(len(data)) + zlib.compress(data)


MAX_UNPACKED_BYTES = 1 << 40  # far above a 1M-token Flash payload (12.8 GB); a larger size field is damage


def _decompress(data, flags: int, path) -> bytes:
    codec = "zstd" if flags & EXT_ZSTD else "zlib"
    if len(data) < 8:
        raise KVFileError(path, f"{codec} payload", f"{len(data)} bytes", "at least the 8-byte unpacked size")
    (size,) = _U64.unpack_from(data)
    if not HEADER_BYTES <= size <= MAX_UNPACKED_BYTES:
        raise KVFileError(path, f"{codec} unpacked size", size,
                          f"between the {HEADER_BYTES}-byte DSV4 header and {MAX_UNPACKED_BYTES} bytes")
    if flags & EXT_ZSTD and zstandard is None:
        raise KVFileError(path, "ext flags", "zstd", "a codec this install reads (pip install zstandard)")
    try:
        if flags & EXT_ZSTD:
            out = zstandard.ZstdDecompressor().decompress(bytes(data[8:]), max_output_size=size)
        else:  # the DSV4 header first: a size field past what its dimensions allow is refused before a zlib bomb
            d = zlib.decompressobj()
            head = d.decompress(data[8:], HEADER_BYTES)
            bound = _payload_bound(head, bool(flags & EXT_Q8), path)
            if size > bound:
                raise KVFileError(path, f"{codec} unpacked size", size,
                                  f"at most {bound}, the largest payload its header's dimensions allow")
            out = head + d.decompress(d.unconsumed_tail, size - len(head))
            if not d.eof or d.unconsumed_tail or d.unused_data:
                raise zlib.error("the stream does not end where the payload does")
    except _CODEC_ERRORS as e:
        raise KVFileError(path, f"{codec} payload", "undecodable", "a valid stream", f"{codec} payload: {e}") from None
    if len(out) != size:
        raise KVFileError(path, f"{codec} payload", f"{len(out)} bytes unpacked", f"{size} (its size field)")
    return out


def _payload_bound(head: bytes, q8: bool, path) -> int:
    """The most bytes a payload with this ``DSV4`` header can take: every layer counted with the largest
    arrays any ratio gives (ratio-4 rows and indexer rows, ratio-128 pending states)."""
    try:
        h = payload_header(head, q8)
    except PayloadError as e:
        raise KVFileError(path, f"payload {e.field}", e.got, e.expected, f"payload: {e}") from None
    T, L, D, Di = h["n_tokens"], h["n_layer"], h["head_dim"], h["indexer_head_dim"]
    layer = 4 * h["raw_live"] * D + 4 * (T // 4) * (D + Di) + 1024 * D + 128 * Di
    return HEADER_BYTES + 4 * T + 4 * h["vocab"] + 8 * L + L * layer


def pack_payload(payload: bytes, config, flags: int) -> bytes:
    """The stored form of a ``DSV4`` payload under the codec bits of ``flags`` (:data:`CODECS`)."""
    if flags & EXT_Q8:
        layout = parse_layout(payload, config)
        payload = _relayout(payload, layout, Q8_VERSION_BIT | layout.header["version"], _quantize)
    if flags & (EXT_ZLIB | EXT_ZSTD):
        payload = _compress(payload, flags)
    return payload


def _stamp(t: int) -> str:
    """A Unix time as local date and time; a value no date can show (the fields are u64, outside the checksum:
    anything may be there) is printed raw with a note."""
    if not t:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return f"{t} (raw value, not a date: out of range for this platform's clock)"


# -- the file -------------------------------------------------------------------------------------------

class KVFileLayer:
    """One layer's saved state; arrays are read from the file (f32 views, 8-bit rows dequantized) on access."""

    def __init__(self, buf, index: int, ratio: int, arrays: dict[str, ArrayAt | None]):
        self._buf, self._arrays = buf, arrays
        self.index, self.ratio = index, ratio
        self.n_raw = arrays["raw"].rows
        self.n_comp = arrays["comp"].rows if arrays["comp"] else 0
        self.n_index = arrays["index"].rows if arrays["index"] else 0

    def _read(self, field: str) -> np.ndarray | None:
        arr = self._arrays[field]
        return None if arr is None else arr.read(self._buf)

    @property
    def raw(self) -> np.ndarray:
        """``[raw_live, head_dim]``: positions T−raw_live … T−1 in order."""
        return self._read("raw")

    @property
    def compressed(self) -> np.ndarray | None:
        return self._read("comp")

    @property
    def indexer(self) -> np.ndarray | None:
        return self._read("index")

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The pending compressor state(s) by ``DSV4`` field name (empty on ratio-0 layers)."""
        return {f: self._read(f) for f in STATE_FIELDS if self._arrays[f] is not None}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays.values() if a is not None)

    def __repr__(self) -> str:
        return (f"KVFileLayer({self.index}: ratio {self.ratio}, raw {self.n_raw}, comp {self.n_comp}, "
                f"index {self.n_index})")


class KVFile:
    """A ``KVC`` file, opened without a model: fixed header, cache text, ``DSV4`` header and per-layer arrays.

    ``KVFile.open(path)`` maps the file read-only and checks its structure (header, sizes, the payload's
    header and row counts); arrays are read only when asked for, so a 1 GB file opens at once.
    ``verify()`` checks the CRC-32 trailer, when the file has one. Compressed payloads are unpacked on open.
    """

    def __init__(self, buf, path, config=None):
        self.path = path
        self.file_size = len(buf)
        hdr = KVHeader.unpack(buf, path)
        trailers = read_trailers(hdr, self.file_size, lambda at, n: bytes(buf[at:at + n]), path)
        if hdr.ext_flags & EXT_TOOL_MAP and self.file_size > trailers.end:
            # what follows must be ds4-server's map, not bytes that bit 0 (one damaged ext byte) lets pass unread
            at = trailers.end
            magic = bytes(buf[at:at + len(TOOL_MAP_MAGIC)])
            if magic != TOOL_MAP_MAGIC or self.file_size - at < 8:
                raise KVFileError(path, "tool map trailer", magic, TOOL_MAP_MAGIC,
                                  f"tool map trailer: the ext flags' bit 0 says ds4-server's tool-id map follows at "
                                  f"byte {at}, but it starts with {magic!r} ({self.file_size - at} bytes), expected "
                                  f"{TOOL_MAP_MAGIC!r} and a u32 count")
        self._hdr = hdr
        self._buf = buf
        self.text_bytes = bytes(buf[PREFIX_BYTES:PREFIX_BYTES + hdr.text_bytes])
        start = PREFIX_BYTES + hdr.text_bytes
        codec = hdr.ext_flags & (EXT_ZLIB | EXT_ZSTD)
        if codec:
            data = _decompress(memoryview(buf)[start:start + hdr.payload_bytes], hdr.ext_flags, path)
            self._payload_buf, base, size = data, 0, len(data)
        else:
            self._payload_buf, base, size = buf, start, hdr.payload_bytes
        try:  # the DSV4 payload, checked against itself (and ``config``) by the one payload parser
            q8 = bool(hdr.ext_flags & EXT_Q8)
            self._layout = parse_layout(self._payload_buf, config, base=base, size=size, q8=q8,
                                        version=hdr.payload_version, like=PRO if hdr.model_id == 1 else FLASH)
        except PayloadError as e:
            raise KVFileError(path, f"payload {e.field}", e.got, e.expected, f"payload: {e}") from None
        for field, payload_field in (("tokens", "n_tokens"), ("ctx_size", "ctx")):  # ds4 writes both from the session
            if getattr(hdr, field) != self._layout.header[payload_field]:
                raise KVFileError(path, field, getattr(hdr, field),
                                  f"{self._layout.header[payload_field]} (the payload's {payload_field})")
        self.layers = [KVFileLayer(self._payload_buf, il, r, a)
                       for il, (r, a) in enumerate(zip(self._layout.ratios, self._layout.layers))]
        self.fingerprint: str | None = trailers.fingerprint
        """The writing model's fingerprint (``EXT_FINGERPRINT``), or None: a file ds4-server wrote, which cannot
        be checked against a model."""
        self.title: str | None = None if trailers.title is None else trailers.title.decode("utf-8", "replace")
        """ds4-agent's session title (ext bit 3 of its files), or None."""
        self.edited: bool = trailers.edited
        """The writer marked the state edited (``ds4lab.kv.edit``): its rows are not the ones its tokens give."""
        self._trailers = trailers

    @classmethod
    def open(cls, path: str | os.PathLike, config=None) -> KVFile:
        """Open and check a file; anything but a regular file (a FIFO, a device) is refused without blocking."""
        path = Path(path)
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size < PREFIX_BYTES:
                return cls(f.read(size), path, config)  # too short to map; the header check reports it
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return cls(buf, path, config)

    @property
    def header(self) -> dict:
        return self._hdr.as_dict()

    @property
    def text(self) -> str:
        return self.text_bytes.decode("utf-8", errors="replace")

    @property
    def sha1(self) -> str:
        """The store key: SHA-1 of the cache text (the file's name in a store)."""
        return hashlib.sha1(self.text_bytes).hexdigest()

    @property
    def payload_header(self) -> dict:
        return dict(self._layout.header)

    @property
    def ratios(self) -> tuple[int, ...]:
        return self._layout.ratios

    @property
    def token_ids(self) -> np.ndarray:
        return self._layout.tokens(self._payload_buf)

    @property
    def logits(self) -> np.ndarray:
        return self._layout.logits(self._payload_buf)

    def payload(self) -> bytes:
        """The ``DSV4`` payload as ds4 stores it (f32), unpacked from 8-bit rows and zlib/zstd if needed."""
        if self._hdr.ext_flags & EXT_Q8:
            version = self._layout.header["version"] & ~Q8_VERSION_BIT
            return _relayout(self._payload_buf, self._layout, version, lambda x: x.astype("<f4").tobytes())
        base = self._layout.base
        return bytes(self._payload_buf[base:base + self._layout.size])

    def verify(self) -> None:
        """Check the checksum, when the file has one (reads the whole file); :class:`KVFileError` if it does not
        match."""
        _compare(self._buf, _stored_checksum(self._buf, self._trailers), self.path)

    def checksum_status(self) -> tuple[str, str]:
        """``("ok" | "mismatch" | "none", what to print)``: the checksum verified (reads the whole file)."""
        return checksum_status(self._buf, self.path)

    def summary(self) -> str:
        """What ``ds4lab inspect FILE.kv`` prints: header, sizes, the ``DSV4`` header, rows per layer, text."""
        h, p = self._hdr, self._layout.header
        codec = "+".join(n for bit, n in ((EXT_Q8, "8-bit rows"), (EXT_ZLIB, "zlib"), (EXT_ZSTD, "zstd"))
                         if h.ext_flags & bit) or "raw f32"
        if self._payload_buf is not self._buf:
            codec += f", {len(self._payload_buf):,} unpacked"
        t = self._trailers
        title = 0 if t.title is None else 4 + len(t.title)
        ours = t.end - h.payload_end - title  # ds4lab's trailers' bytes
        trailer = ((f" + title {title}" if title else "")
                   + (f" + fingerprint and checksum {ours}" if ours else "")
                   + (" (ds4lab's trailers replaced by ds4-server's tool-id map)" if t.stripped else "")
                   + (f" + tool-id map {self.file_size - t.end}" if self.file_size > t.end else ""))
        generation = ("payload ABI 0 (ds4 before 2026-05-26)" if h.legacy else
                      f"payload ABI {h.payload_abi} (ds4 since 2026-05-26)")
        fingerprint = self.fingerprint or ("none (no fingerprint trailer, as in ds4-server's files: which model "
                                           "wrote it cannot be checked)")
        preview = repr(self.text[:80]) + (" …" if len(self.text) > 80 else "")  # escaped once, by repr
        quant = "Q4_K routed experts" if h.quant_bits == 4 else "routed experts not Q4_K"
        # the header names a model family; the payload's layer count tells the model itself
        model = MODELS[h.model_id]
        if p["n_layer"] != {0: FLASH.n_layer, 1: PRO.n_layer}.get(h.model_id, p["n_layer"]):
            model = f"id {h.model_id}: {model}'s architecture, a {p['n_layer']}-layer model"
        dsv4 = [f"{k} {v:#x}" if k == "magic" else f"{k} {v}" for k, v in p.items()]
        lines = [
            f"{self.path}: {self.file_size:,} bytes",
            f"KVC v{h.version}, {generation}, model {model}",
            f"reason {REASONS[h.reason]}, tokens {h.tokens}, hits {h.hits}, ctx {h.ctx_size}, ext {h.ext_flags:#04x} "
            f"({ext_names(h.ext_flags, h.legacy)})",
            f"model quant byte {h.quant_bits} ({quant}: ds4 writes 4 for Q4_K experts, 2 for any other type)",
            f"created {_stamp(h.created)}, last used {_stamp(h.last_used)}",
            f"sizes: header {PREFIX_BYTES} + text {h.text_bytes:,} + payload {h.payload_bytes:,} ({codec}){trailer}",
            f"model fingerprint {fingerprint}" + (" · the state was edited (its rows are not its tokens')"
                                                  if self.edited else ""),
            "DSV4 " + ", ".join(dsv4[:7]),
            "     " + ", ".join(dsv4[7:]),
            "layer ratio  raw  comp index        bytes",
            *(f"{lk.index:5d} {lk.ratio:5d} {lk.n_raw:4d} {lk.n_comp:5d} {lk.n_index:5d} {lk.nbytes:12,d}"
              for lk in self.layers),
            f"text: {preview}",
            *([f"session title: {self.title!r}"] if self.title is not None else []),
        ]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"KVFile({self.path}: {self._hdr.tokens} tokens, {len(self.layers)} layers, "
                f"{REASONS[self._hdr.reason]}, {self.file_size:,} bytes)")
