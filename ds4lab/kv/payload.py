"""The ds4 session payload (``DSV4``, versions 1 and 2): the saved KV state of one checkpoint.

Documented in docs/MODEL.md, "Where the KV state lives" (the state per layer, the pending compressor
state) and docs/FORMATS.md, "The DSV4 session payload" (the payload, its byte sizes). ds4 reference:
ds4.c:15736-15761 (constants), 15836-15880 (state and payload sizes),
16107-16320 (``ds4_session_payload_bytes`` and the writer), 16327-16656 (the loader).

ds4 wrote version 1 until 2026-05-26 and writes version 2 since (e8e8779b, "bump the session payload ABI": a
version a ds4 built before refuses, for a DeepSeek V4 model the same bytes; ds4's KVC header says which in its
byte 20). ds4lab reads both and writes version 2 unless asked for 1 (:data:`VERSIONS`).

The format is byte-identical to ds4's for every config, Flash or tiny: 13 little-endian u32
header fields (magic, version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, T, n_layer, head_dim,
indexer head dim, vocab, raw_live), then ``u32[T]`` tokens, ``f32[vocab]`` logits, ``u32[n_layer]``
compressed-row counts, ``u32[n_layer]`` indexer-row counts, and per layer: ``raw_live`` raw rows in
logical order; if ratio != 0 the compressed rows, ``attn_state_kv``, ``attn_state_score``; if ratio == 4
the indexer rows, ``index_state_kv``, ``index_state_score``. No field is added for small models: the
header already carries every dimension the body depends on, and the per-layer compression ratios are
not in the file (ds4 takes them from the model; here they come from ``cfg``), exactly as in ds4.

One parser, :func:`parse_layout`, checks a payload and locates its arrays without reading or copying
them; the loader (:func:`decode_payload`) and the ``KVC`` file reader (:class:`~ds4lab.kv.kvfile.KVFile`,
lazily, on a memory map, 8-bit rows included) both use it. For a session it makes every check ds4's
loader makes, with ds4's message first and then the field and both values, plus checks ds4 does not
make: each layer's row counts must be the ones the token count implies, ⌊T/ratio⌋ (0 where the layer has no
such rows), every token id must be below ``vocab`` and every logit finite (:func:`check_values`), and, when
the arrays are read (:func:`decode_payload`), every KV row and compressor state value finite. The writer
applies the same checks, so ds4lab never writes a payload it would refuse.

A full context is a legal state: ds4-server decodes until ``T == ctx`` and may store it then. ds4's loader
refuses ``T >= ctx`` of the *session* it loads into (one slot must stay free to generate, ds4.c:16487), and
so does :func:`parse_layout` for a session; it never compares ``T`` with the payload's own ``ctx``, so a
full-context payload loads into any larger session that passes the other checks. Checked against itself
(no session), a payload may hold up to its own ``ctx`` tokens.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

import numpy as np

from ..config import FLASH, PRO, ds4_ratio
from .layout import (
    LAYER_FIELDS,
    ROW_FIELDS,
    expected_row_counts,
    graph_caps,
    layer_comp_cap,
    layer_state_shapes,
    raw_live_rows,
    state_values,
)

MAGIC = 0x34565344  # "DSV4" little-endian
VERSION = 2  # what ds4lab writes unless told: ds4's since e8e8779b (2026-05-26)
VERSIONS = {1: "ds4 before 2026-05-26 (e8e8779b)", 2: "ds4 since 2026-05-26 (e8e8779b)"}
HEADER_FIELDS = 13
HEADER_BYTES = 4 * HEADER_FIELDS
Q8_VERSION_BIT = 0x100  # ds4lab's payload with 8-bit KV rows (KVC ext bit 4) says version 0x100 | v: ds4 refuses it


_U32_MAX = 0xFFFFFFFF
_HEADER_NAMES = ("magic", "version", "ctx", "prefill_cap", "raw_cap", "raw_window", "comp_cap", "n_tokens",
                 "n_layer", "head_dim", "indexer_head_dim", "vocab", "raw_live")


class PayloadError(ValueError):
    """A payload that cannot be loaded; ``field``, ``got`` and ``expected`` say what and why."""

    def __init__(self, message: str, field: str = "", got=None, expected=None):
        super().__init__(message)
        self.field = field
        self.got = got
        self.expected = expected


@dataclass
class LayerPayload:
    """The saved state of one layer; float32 arrays, ``None`` where the layer kind has no such state.

    ``raw [raw_live, head_dim]`` holds positions T−raw_live … T−1 in that order. Ratio ≠ 0 layers have
    ``comp [⌊T/R⌋, head_dim]`` and the compressor frontier ``comp_state_kv/score [coff·R, coff·head_dim]``
    (coff = 2 for ratio 4: rows 0-3 the previous window, 4-7 the current one). Ratio-4 layers also have
    ``index [⌊T/4⌋, idx_dim]`` and ``index_state_kv/score [8, 2·idx_dim]``.
    """

    raw: np.ndarray
    comp: np.ndarray | None = None
    comp_state_kv: np.ndarray | None = None
    comp_state_score: np.ndarray | None = None
    index: np.ndarray | None = None
    index_state_kv: np.ndarray | None = None
    index_state_score: np.ndarray | None = None


@dataclass
class Payload:
    """One checkpoint: the header values that are not model dimensions, tokens, logits and layer states."""

    ctx: int
    prefill_cap: int
    raw_cap: int
    raw_window: int
    comp_cap: int
    tokens: np.ndarray  # uint32 [T]
    logits: np.ndarray  # float32 [vocab]
    layers: list[LayerPayload]
    version: int = VERSION  # 1 or 2 (VERSIONS): the same bytes for the ds4 that reads them

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def raw_live(self) -> int:
        """Raw rows stored per layer: min(raw_window, raw_cap, T) (``session_raw_live_rows``, ds4.c:15852)."""
        return raw_live_rows(self.n_tokens, self.raw_window, self.raw_cap)


# -- sizes and shapes ---------------------------------------------------------------------------------

def payload_nbytes(cfg, n_tokens: int, raw_window: int | None = None, raw_cap: int | None = None) -> int:
    """Serialized size of a checkpoint of ``n_tokens`` tokens, from the config alone
    (docs/FORMATS.md, "The DSV4 session payload").

    raw_live = min(raw_window, raw_cap, T); raw_window defaults to ``cfg.swa`` (ds4 uses min(swa, ctx),
    which gives the same raw_live since T ≤ ctx), raw_cap to no limit (ds4's rings hold ≥ raw_window).
    Equals ``ds4_session_payload_bytes`` (ds4.c:16107) with ⌊T/R⌋ rows per layer.
    """
    T = int(n_tokens)
    raw_live = raw_live_rows(T, cfg.swa if raw_window is None else raw_window, raw_cap)
    return HEADER_BYTES + 4 * T + 4 * cfg.n_vocab + 2 * 4 * cfg.n_layer + 4 * state_values(cfg, T, raw_live)


# -- writer -------------------------------------------------------------------------------------------

def _u32(value, what: str) -> int:
    v = int(value)
    if not 0 <= v <= _U32_MAX:
        raise ValueError(f"payload {what} is {v}, which does not fit a u32")
    return v


def _f32_bytes(arr, shape, what: str) -> bytes:
    if not isinstance(arr, np.ndarray):
        raise ValueError(f"{what} must be a numpy array, got {type(arr).__name__}")
    if arr.shape != tuple(shape):
        raise ValueError(f"{what} has shape {arr.shape}, expected {tuple(shape)}")
    if not np.issubdtype(arr.dtype, np.floating):
        raise ValueError(f"{what} has dtype {arr.dtype}, expected float32")
    out = np.ascontiguousarray(arr, dtype="<f4")
    _check_finite(out, what, ValueError)  # the loader refuses a non-finite value: never write one
    return out.tobytes()


def _check_finite(arr: np.ndarray, what: str, error=PayloadError) -> None:
    """Raise ``error`` naming ``what[row, col]`` (or ``what[i]``) at the first NaN or infinity of ``arr``."""
    if arr.size and not np.isfinite(arr).all():
        at = tuple(int(i) for i in np.argwhere(~np.isfinite(arr))[0])
        field = f"{what}[{', '.join(map(str, at))}]"
        raise _err(error, f"KV checkpoint has a non-finite value: {field} is {float(arr[at])}, expected a finite "
                          f"value", field, float(arr[at]), "a finite value")


def encode_payload(p: Payload, cfg) -> bytes:
    """Serialize ``p`` exactly as ``ds4_session_save_payload`` does (ds4.c:16129-16324), with ``p.version``.

    Every array is checked against ``cfg`` first (ValueError naming the layer and field): presence by
    layer kind, row width, state shape and row counts (raw_live raw rows, ⌊T/R⌋ compressed/indexer rows).
    Float arrays of another float dtype are converted to float32.
    """
    tokens = np.asarray(p.tokens)
    if tokens.ndim != 1 or (tokens.size and not np.issubdtype(tokens.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > _U32_MAX):
        raise ValueError("tokens must fit u32")
    T = int(tokens.size)
    if p.raw_window < 1 or p.raw_cap < 1:
        raise ValueError(f"raw_window ({p.raw_window}) and raw_cap ({p.raw_cap}) must be positive")
    if len(p.layers) != cfg.n_layer:
        raise ValueError(f"payload has {len(p.layers)} layers, config has n_layer={cfg.n_layer}")
    raw_live = p.raw_live
    check_version(p.version)
    header = [MAGIC, p.version, p.ctx, p.prefill_cap, p.raw_cap, p.raw_window, p.comp_cap, T,
              cfg.n_layer, cfg.head_dim, cfg.idx_dim, cfg.n_vocab, raw_live]
    header = [_u32(v, name) for v, name in zip(header, _HEADER_NAMES)]

    check_values(tokens, np.zeros(0, np.float32), cfg.n_vocab)  # never write what the loader refuses
    logits = _f32_bytes(p.logits, (cfg.n_vocab,), "logits")
    parts = [np.asarray(header, dtype="<u4").tobytes(), tokens.astype("<u4").tobytes(), logits]
    counts = np.zeros((2, cfg.n_layer), dtype="<u4")
    body = []
    for il, layer in enumerate(p.layers):
        if not isinstance(layer, LayerPayload):
            raise ValueError(f"layer {il} is a {type(layer).__name__}, expected LayerPayload")
        shapes = layer_state_shapes(cfg, il, T, raw_live)
        counts[0, il], counts[1, il] = expected_row_counts(cfg, il, T)
        for field in LAYER_FIELDS:
            arr, shape = getattr(layer, field), shapes[field]
            what = f"layer {il} (ratio {cfg.ratio(il)}) {field}"
            if shape is None:
                if arr is not None:
                    raise ValueError(f"{what} must be None: this layer kind has no such state")
                continue
            if arr is None:
                raise ValueError(f"{what} is missing, expected shape {shape}")
            body.append(_f32_bytes(arr, shape, what))
    parts.append(counts.tobytes())
    parts.extend(body)
    return b"".join(parts)


# -- layout: the one parser ----------------------------------------------------------------------------

@dataclass(frozen=True)
class ArrayAt:
    """One float array of a payload at ``offset`` in its buffer: f32 rows, or (``q8``) a f32 scale per row
    then the int8 rows (the KV rows of ds4lab's 8-bit payloads, version ``Q8_VERSION_BIT | v``)."""

    offset: int
    rows: int
    width: int
    q8: bool = False

    @property
    def nbytes(self) -> int:
        return self.rows * (4 + self.width) if self.q8 else 4 * self.rows * self.width

    def read(self, buf) -> np.ndarray:
        """A float32 ``[rows, width]`` view of ``buf`` (f32 rows), or the dequantized rows (``q8``)."""
        if not self.q8:
            return np.frombuffer(buf, "<f4", self.rows * self.width, self.offset).reshape(self.rows, self.width)
        scale = np.frombuffer(buf, "<f4", self.rows, self.offset)
        q = np.frombuffer(buf, np.int8, self.rows * self.width, self.offset + 4 * self.rows)
        return q.reshape(self.rows, self.width) * scale[:, None]


@dataclass(frozen=True)
class PayloadLayout:
    """Where everything is in one payload at ``buf[base:base + size]``, as :func:`parse_layout` found it."""

    header: dict  # the 13 header fields by name (HEADER_NAMES)
    ratios: tuple[int, ...]  # the per-layer compression ratios the row counts were checked against
    base: int
    size: int
    layers: tuple[dict[str, ArrayAt | None], ...]  # LAYER_FIELDS -> array, per layer

    @property
    def tokens_offset(self) -> int:
        return self.base + HEADER_BYTES

    @property
    def logits_offset(self) -> int:
        return self.tokens_offset + 4 * self.header["n_tokens"]

    @property
    def counts_offset(self) -> int:
        return self.logits_offset + 4 * self.header["vocab"]

    def tokens(self, buf) -> np.ndarray:
        return np.frombuffer(buf, "<u4", self.header["n_tokens"], self.tokens_offset)

    def logits(self, buf) -> np.ndarray:
        return np.frombuffer(buf, "<f4", self.header["vocab"], self.logits_offset)


def _fail(msg: str, field: str, got, expected, relation: str = "expected") -> PayloadError:
    return PayloadError(f"{msg}: {field} is {got}, {relation} {expected}", field, got, expected)


def byte_view(data) -> memoryview:
    """``data`` (bytes, bytearray, memoryview, mmap, numpy array or memmap) as flat bytes, without a copy."""
    try:
        return memoryview(data).cast("B")
    except TypeError as e:
        raise PayloadError(f"session payload is not a contiguous byte buffer: {e}") from None


class _Cursor:
    """Walks ``size`` bytes from ``base``; ``take`` returns where a field starts, or reports it truncated."""

    def __init__(self, base: int, size: int):
        self.base, self.size, self.off = base, size, 0

    @property
    def remaining(self) -> int:
        return self.size - self.off

    def take(self, nbytes: int, what: str) -> int:
        # payload_read_bytes / payload_read_u32 (ds4.c:15795-15830) check the remaining byte count first.
        if nbytes > self.remaining:
            raise PayloadError(f"truncated session payload: {what} needs {nbytes} bytes at offset {self.off}, "
                               f"only {self.remaining} left", what, self.remaining, nbytes)
        at = self.base + self.off
        self.off += nbytes
        return at


def check_version(version: int) -> None:
    """Refuse a payload version ds4lab does not write (ValueError naming it and the ones it does)."""
    if version not in VERSIONS:
        raise ValueError(f"payload version {version!r} is not one ds4 reads; expected "
                         + " or ".join(f"{v} ({who})" for v, who in VERSIONS.items()))


def _read_header(mv: memoryview, cur: _Cursor, q8: bool, version: int | None) -> dict:
    h = dict(zip(_HEADER_NAMES, struct.unpack_from(f"<{HEADER_FIELDS}I", mv, cur.take(HEADER_BYTES, "header"))))
    msg = "unsupported session payload version"  # ds4.c:16337
    if h["magic"] != MAGIC:
        raise _fail(msg, "magic", f"{h['magic']:#010x}", f"{MAGIC:#010x} ('DSV4')")
    bit = Q8_VERSION_BIT if q8 else 0
    wanted = [bit | v for v in ((version,) if version is not None else VERSIONS)]
    if h["version"] not in wanted:
        readable = [f"{bit | v} ({VERSIONS[v]})" for v in VERSIONS]
        newer = " (a newer ds4's: this ds4lab cannot read it)" if h["version"] & 0xFF > max(VERSIONS) else ""
        raise _fail(msg + newer, "version", h["version"], " or ".join(
            readable if version is None else [f"{bit | version} (what the KVC header's payload ABI byte says)"]))
    return h


def payload_header(data, q8: bool = False, version: int | None = None) -> dict:
    """The 13 header fields of a payload by name, after the size, magic and version checks (``version``: the one
    it must have, 1 or 2; default either)."""
    mv = byte_view(data)
    return _read_header(mv, _Cursor(0, len(mv)), q8, version)


def with_version(data, version: int) -> bytes:
    """A payload's bytes under another ``version`` (1 or 2, :data:`VERSIONS`): the same layout, one field rewritten.
    Nothing else is checked here; the payload is as good as it was."""
    check_version(version)
    out = bytearray(data)
    if len(out) < HEADER_BYTES or struct.unpack_from("<I", out)[0] != MAGIC:
        raise ValueError("not a DSV4 session payload (no 'DSV4' magic in its first 4 bytes)")
    struct.pack_into("<I", out, 4, (struct.unpack_from("<I", out, 4)[0] & Q8_VERSION_BIT) | version)
    return bytes(out)


def infer_ratios(n_tokens: int, n_comp, n_index, like=None) -> tuple[int, ...]:
    """Per-layer compression ratios from the row counts (the file does not store them); where the counts do
    not tell (no rows yet), the schedule of ``like`` (ds4's Flash or Pro, whose first two layers differ: 0 and 128;
    default: Pro for a payload of Pro's 61 layers, else Flash) for a model of its depth, else Flash's schedule."""
    n_layer = len(n_comp)
    like = like or (PRO if n_layer == PRO.n_layer else FLASH)
    out = []
    for il, (nc, ni) in enumerate(zip(n_comp, n_index)):
        if ni:
            out.append(4)
        elif nc:
            out.append(128)
        else:
            possible = [0] + [r for r in (4, 128) if n_tokens < r]
            ratio = like.compress_ratios[il] if n_layer == like.n_layer else ds4_ratio(il)
            out.append(ratio if ratio in possible else 0)
    return tuple(out)


def _count_field(index: int, n_layer: int) -> str:
    kind, il = divmod(index, n_layer)
    return f"layer {il} {('compressed', 'indexer')[kind]} row count"


def parse_layout(buf, cfg=None, *, ctx: int | None = None, prefill_cap: int | None = None, base: int = 0,
                 size: int | None = None, q8: bool = False, full_ok: bool = False,
                 version: int | None = None, like=None) -> PayloadLayout:
    """Check a payload at ``buf[base:base + size]`` (default: to the end) and locate every array in it.

    Nothing is read but the header and the row counts, nothing is copied, and every size is checked
    against the bytes available before it is used, so a damaged header never makes us allocate or loop
    on garbage. Raises :class:`PayloadError` on the first failure.

    With ``ctx`` and ``prefill_cap`` (and ``cfg``), the payload is checked for a session of that context
    and chunk, as ``ds4_session_load_payload`` does (graph path, ds4.c:16327-16656), check by check.
    Without them it is checked against itself: its own context, ring and compressed capacity.
    ``cfg`` gives the layer dimensions and per-layer ratios; without it the ratios are inferred from the
    row counts (:func:`infer_ratios`; ``like``: the ds4 model whose schedule fills in layers with no rows yet, the
    one a KVC file's header names; default: by the payload's depth). ``q8``: a payload whose KV rows
    (:data:`ROW_FIELDS`) are 8-bit (version ``Q8_VERSION_BIT | v``). ``full_ok``: the session is the one that
    wrote it (its own ctx), which held ``T == ctx`` legally; ds4's rule (``T < ctx``) is for a session that is to
    go on generating. ``version``: the one the payload must have (a KVC file's header says it), else 1 or 2.

    The chunk the payload was written with (``prefill_cap``) need not be the session's: ds4 has ignored it since
    bb543791 (2026-05-23, "scratch scheduling capacity, not durable KV layout"); the raw rows are stored in
    position order and land in the session's own ring (:func:`~ds4lab.kv.checkpoint.layer_from_payload`).
    """
    session = ctx is not None or prefill_cap is not None
    if session and (cfg is None or ctx is None or prefill_cap is None):
        raise TypeError("checking a payload for a session needs cfg, ctx and prefill_cap")
    mv = byte_view(buf)
    cur = _Cursor(base, len(mv) - base if size is None else size)
    h = _read_header(mv, cur, q8, version)
    T, n_layer, s_ctx, s_window = h["n_tokens"], h["n_layer"], h["ctx"], h["raw_window"]

    # ds4.c:16487
    msg = "KV checkpoint does not fit current context"
    if session and s_ctx > ctx:
        raise _fail(msg, "ctx", s_ctx, f"the current context {ctx}", "larger than")
    limit = ctx if session else s_ctx
    if session and T >= ctx and not (full_ok and T == ctx == s_ctx):  # ds4's rule: one slot stays free
        raise _fail(msg, "n_tokens", T, f"less than the current context {ctx}")
    if T > limit:  # checked against itself: a full context (T = ctx) is a state a session reaches
        raise _fail(msg, "n_tokens", T, f"at most the saved context {limit}")
    # ds4.c:16491
    if cfg is not None:
        msg = "KV checkpoint was written for a different DS4 layout"
        for field, want in (("n_layer", cfg.n_layer), ("head_dim", cfg.head_dim),
                            ("indexer_head_dim", cfg.idx_dim), ("vocab", cfg.n_vocab)):
            if h[field] != want:
                raise _fail(msg, field, h[field], want)
    else:  # no model to compare with (inspect): sizes of 0 would shift every field after them into nonsense
        for field in ("n_layer", "head_dim", "indexer_head_dim", "vocab"):
            if h[field] == 0:
                raise _fail("KV checkpoint header is not a DS4 layout", field, 0, "at least 1")
    ring, comp_cap = h["raw_cap"], h["comp_cap"]
    if session:
        # ds4.c:16497 (since bb543791 the window alone: prefill_cap is not compared)
        msg = "KV checkpoint graph chunk layout does not match current runtime"
        cur_raw_cap, cur_window, cur_comp_cap = graph_caps(cfg, ctx, prefill_cap)
        if s_window != cur_window:
            raise _fail(msg, "raw_window", s_window, f"{cur_window} = min(swa {cfg.swa}, ctx {ctx})")
        ring = min(ring, cur_raw_cap)
    # ds4.c:16504-16509; raw_live <= the current ring is implied (every ring holds >= raw_window rows).
    msg = "KV checkpoint raw ring layout does not match current context"
    for field in ("raw_cap", "raw_window"):
        if h[field] == 0:
            raise _fail(msg, field, 0, "at least 1")
    raw_live, want_live = h["raw_live"], min(T, s_window)
    if raw_live != want_live:
        raise _fail(msg, "raw_live", raw_live, f"{want_live} = min(n_tokens {T}, raw_window {s_window})")
    if raw_live > ring:
        raise _fail(msg, "raw_live", raw_live, f"raw_cap {ring}", "larger than")
    # ds4.c:16511
    if session and comp_cap > cur_comp_cap:
        raise _fail("KV checkpoint compressed cache is larger than current context", "comp_cap", comp_cap,
                    f"the current capacity {cur_comp_cap}", "larger than")

    cur.take(4 * T, "tokens")
    cur.take(4 * h["vocab"], "logits")
    if 8 * n_layer > cur.remaining:  # name the first row count that is cut
        fits = cur.remaining // 4
        cur.take(4 * fits, "row counts")
        cur.take(4, _count_field(fits, n_layer))
    # Python ints: a count in arithmetic must not wrap as a uint32 would
    counts = np.frombuffer(mv, "<u4", 2 * n_layer, cur.take(8 * n_layer, "row counts")).reshape(2, n_layer).tolist()
    inferred = cfg is None
    if inferred:
        # a config carrying only what the layout depends on (dataclasses.replace: no checks on file values)
        cfg = dataclasses.replace(FLASH, n_layer=n_layer, head_dim=h["head_dim"], idx_dim=h["indexer_head_dim"],
                                  n_vocab=h["vocab"], compress_ratios=infer_ratios(T, counts[0], counts[1], like))
    for kind, label in ((0, "compressed"), (1, "indexer")):
        for il in range(n_layer):
            field, n = _count_field(kind * n_layer + il, n_layer), counts[kind][il]
            cap = min(comp_cap, layer_comp_cap(cfg, il, limit))
            if n > cap:  # ds4.c:16538 / 16549
                raise _fail(f"KV checkpoint has invalid {label} row count", field, n, f"capacity {cap}", "larger than")
            want = expected_row_counts(cfg, il, T)[kind]
            if n != want:  # stricter than ds4: the count must be the one T implies
                R = cfg.ratio(il)
                how = f"floor(n_tokens {T} / ratio {R})" if want else f"no {label} rows on a ratio-{R} layer"
                if inferred:
                    how += " (inferred ratio; pass the model's config if it is not ds4's)"
                raise _fail(f"KV checkpoint has invalid {label} row count", field, n, f"{want} = {how}")

    layers = []
    for il in range(n_layer):
        arrays: dict[str, ArrayAt | None] = {}
        for field, shape in layer_state_shapes(cfg, il, T, raw_live).items():
            if shape is not None:
                arr = ArrayAt(cur.base + cur.off, shape[0], shape[1], q8 and field in ROW_FIELDS)
                cur.take(arr.nbytes, f"layer {il} {field}")
            else:
                arr = None
            arrays[field] = arr
        layers.append(arrays)
    if cur.remaining:  # ds4.c:16640
        raise PayloadError(f"KV checkpoint has trailing payload bytes: {cur.remaining} bytes after offset {cur.off}, "
                           f"expected 0", "trailing", cur.remaining, 0)
    lay = PayloadLayout(h, tuple(cfg.ratio(il) for il in range(n_layer)), base, cur.size, tuple(layers))
    check_values(lay.tokens(mv), lay.logits(mv), h["vocab"], PayloadError)
    return lay


def check_values(tokens, logits, vocab: int, error=ValueError) -> None:
    """Beyond ds4 (which trusts them): every token id below ``vocab`` and every logit finite. The first bad
    one is named by its index (``tokens[i]``, ``logits[i]``); reads 4·(T + vocab) bytes, nothing else."""
    tokens, logits = np.asarray(tokens), np.asarray(logits)
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab)) if tokens.size else ()
    if len(bad):
        i = int(bad[0])
        field = f"tokens[{i}]"
        raise _err(error, f"KV checkpoint has an invalid token id: {field} is {int(tokens[i])}, expected less than "
                          f"vocab {vocab}", field, int(tokens[i]), f"less than vocab {vocab}")
    bad = np.flatnonzero(~np.isfinite(logits))
    if len(bad):
        i = int(bad[0])
        field = f"logits[{i}]"
        raise _err(error, f"KV checkpoint has an invalid logit: {field} is {float(logits[i])}, expected a finite "
                          f"value", field, float(logits[i]), "a finite value")


def _err(error, message: str, field: str, got, expected) -> Exception:
    return PayloadError(message, field, got, expected) if error is PayloadError else error(message)


# -- loader -------------------------------------------------------------------------------------------

def decode_payload(data, cfg, ctx: int | None = None, prefill_cap: int | None = None) -> Payload:
    """Parse a payload for a session of ``ctx`` tokens and chunk ``prefill_cap`` on model ``cfg`` (default:
    the ones in its own header, i.e. the session that wrote it, which may have held a full context: ``T == ctx``
    passes then, and only then). ``cfg`` None infers the layer layout from the header and row counts
    (:func:`infer_ratios`).

    Mirrors ``ds4_session_load_payload`` (graph path, ds4.c:16327-16656) check by check (:func:`parse_layout`)
    and raises :class:`PayloadError` on the first failure; nothing is returned unless the whole buffer parsed.
    The arrays are copies: the result does not alias ``data``.
    """
    mv = byte_view(data)
    if cfg is None:  # the layout inferred from the payload itself, checked against its own header
        if ctx is not None or prefill_cap is not None:
            raise TypeError("checking a payload for a session of another ctx or prefill_cap needs the model's cfg")
        lay = parse_layout(mv)
    else:
        own = ctx is None  # checked against the session that wrote it: a full context is what it held
        if ctx is None or prefill_cap is None:
            h = payload_header(mv)
            ctx = h["ctx"] if ctx is None else ctx
            prefill_cap = h["prefill_cap"] if prefill_cap is None else prefill_cap
        lay = parse_layout(mv, cfg, ctx=ctx, prefill_cap=prefill_cap, full_ok=own)
    h = lay.header
    layers = [LayerPayload(**{f: None if a is None else np.array(a.read(mv), dtype=np.float32)
                              for f, a in arrays.items()}) for arrays in lay.layers]
    for il, layer in enumerate(layers):  # beyond ds4: a NaN or infinity in a KV row or state would spread
        for f in LAYER_FIELDS:
            if getattr(layer, f) is not None:
                _check_finite(getattr(layer, f), f"layer {il} {f}")
    return Payload(ctx=h["ctx"], prefill_cap=h["prefill_cap"], raw_cap=h["raw_cap"], raw_window=h["raw_window"],
                   comp_cap=h["comp_cap"], tokens=lay.tokens(mv).astype(np.uint32),
                   logits=lay.logits(mv).astype(np.float32), layers=layers, version=h["version"])
