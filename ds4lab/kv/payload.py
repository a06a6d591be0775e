"""The ds4 session payload (``DSV4``, version 1): the saved KV state of one checkpoint.

Spec: DS4_RUNTIME.md §2 (state per layer, §2.4 pending compressor state, §2.6 byte sizes) and §3.2
(the payload). ds4 reference: ds4.c:15736-15761 (constants), 15836-15880 (state and payload sizes),
16107-16320 (``ds4_session_payload_bytes`` and the writer), 16327-16656 (the loader).

The format is byte-identical to ds4's version 1 for every config, Flash or tiny: 13 little-endian u32
header fields (magic, version, ctx, prefill_cap, raw_cap, raw_window, comp_cap, T, n_layer, head_dim,
indexer head dim, vocab, raw_live), then ``u32[T]`` tokens, ``f32[vocab]`` logits, ``u32[n_layer]``
compressed-row counts, ``u32[n_layer]`` indexer-row counts, and per layer: ``raw_live`` raw rows in
logical order; if ratio != 0 the compressed rows, ``attn_state_kv``, ``attn_state_score``; if ratio == 4
the indexer rows, ``index_state_kv``, ``index_state_score``. No field is added for small models: the
header already carries every dimension the body depends on, and the per-layer compression ratios are
not in the file (ds4 takes them from the model; here they come from ``cfg``), exactly as in ds4.

The loader (:func:`decode_payload`) makes every check ds4's loader makes, with ds4's message first and
then the field and both values, plus one stricter check ds4 does not make: each layer's row counts must
be the ones the token count implies, ⌊T/ratio⌋ (0 where the layer has no such rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x34565344  # "DSV4" little-endian
VERSION = 1
HEADER_FIELDS = 13
HEADER_BYTES = 4 * HEADER_FIELDS
RAW_CAP_MAX = 8192  # the raw ring never exceeds this many rows (ds4.c:13946-13977)
STATE_SCORE_INIT = -1e30  # initial value of the *_state_score tensors (§2.4); kv states start at 0

# The seven per-layer arrays in file order.
LAYER_FIELDS = ("raw", "comp", "comp_state_kv", "comp_state_score", "index", "index_state_kv", "index_state_score")

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

    @property
    def n_tokens(self) -> int:
        return int(len(self.tokens))

    @property
    def raw_live(self) -> int:
        """Raw rows stored per layer: min(raw_window, raw_cap, T) (``session_raw_live_rows``, ds4.c:15852)."""
        return raw_live_rows(self.n_tokens, self.raw_window, self.raw_cap)


# -- sizes and shapes ---------------------------------------------------------------------------------

def raw_live_rows(n_tokens: int, raw_window: int, raw_cap: int | None = None) -> int:
    rows = raw_window
    if raw_cap is not None:
        rows = min(rows, raw_cap)
    return min(rows, n_tokens)


def graph_caps(cfg, ctx: int, prefill_cap: int) -> tuple[int, int, int]:
    """``(raw_cap, raw_window, comp_cap)`` of a graph session (ds4.c:13946-13977, 8697-8718).

    raw_window = min(swa, ctx); raw_cap = min(align_up(min(raw_window + prefill_cap, ctx), 256), 8192),
    at least raw_window and at most ctx; comp_cap = ctx / smallest nonzero ratio + 2.
    """
    ctx = max(int(ctx), 1)
    raw_window = max(min(cfg.swa, ctx), 1)
    wanted = max(min(raw_window + max(int(prefill_cap), 1), ctx), 1)
    wanted = min((wanted + 255) // 256 * 256, RAW_CAP_MAX)
    raw_cap = min(max(wanted, raw_window), ctx)
    return raw_cap, raw_window, comp_cap_for(cfg, ctx)


def comp_cap_for(cfg, ctx: int) -> int:
    """The session-wide compressed capacity ``comp_cap`` (ds4.c:8711-8718): ctx / min nonzero ratio + 2."""
    ratios = [cfg.ratio(il) for il in range(cfg.n_layer) if cfg.ratio(il)]
    min_ratio = min(ratios) if ratios else max(ctx, 1)
    return max(ctx // min_ratio + 2, 2)


def layer_comp_cap(cfg, il: int, ctx: int) -> int:
    """Rows one layer can hold (``layer_comp_cap``, ds4.c:8719-8726): ctx / ratio + 2, or 0 for ratio 0."""
    R = cfg.ratio(il)
    return max(ctx // R + 2, 2) if R else 0


def expected_row_counts(cfg, il: int, n_tokens: int) -> tuple[int, int]:
    """``(n_comp, n_index)`` after ``n_tokens`` tokens: ⌊T/R⌋ compressed rows, ⌊T/4⌋ indexer rows on ratio 4."""
    R = cfg.ratio(il)
    n_comp = n_tokens // R if R else 0
    n_index = n_tokens // R if cfg.has_indexer(il) else 0
    return n_comp, n_index


def layer_state_shapes(cfg, il: int, n_tokens: int, raw_live: int) -> dict[str, tuple[int, int] | None]:
    """The shape of each of :data:`LAYER_FIELDS` for layer ``il`` (``None`` where the layer has none).

    State shapes follow ``layer_attn_state_bytes``/``layer_index_state_bytes`` (ds4.c:15836-15844).
    """
    R = cfg.ratio(il)
    n_comp, n_index = expected_row_counts(cfg, il, n_tokens)
    coff = 2 if R == 4 else 1
    shapes: dict[str, tuple[int, int] | None] = dict.fromkeys(LAYER_FIELDS)
    shapes["raw"] = (raw_live, cfg.head_dim)
    if R:
        shapes["comp"] = (n_comp, cfg.head_dim)
        shapes["comp_state_kv"] = shapes["comp_state_score"] = (coff * R, cfg.compressor_width(il, cfg.head_dim))
    if cfg.has_indexer(il):
        shapes["index"] = (n_index, cfg.idx_dim)
        shapes["index_state_kv"] = shapes["index_state_score"] = (coff * R, cfg.compressor_width(il, cfg.idx_dim))
    return shapes


def payload_nbytes(cfg, n_tokens: int, raw_window: int | None = None, raw_cap: int | None = None) -> int:
    """Serialized size of a checkpoint of ``n_tokens`` tokens, from the config alone (§2.6).

    raw_live = min(raw_window, raw_cap, T); raw_window defaults to ``cfg.swa`` (ds4 uses min(swa, ctx),
    which gives the same raw_live since T < ctx), raw_cap to no limit (ds4's rings hold ≥ raw_window).
    Equals ``ds4_session_payload_bytes`` (ds4.c:16107) with ⌊T/R⌋ rows per layer.
    """
    T = int(n_tokens)
    raw_live = raw_live_rows(T, cfg.swa if raw_window is None else raw_window, raw_cap)
    total = HEADER_BYTES + 4 * T + 4 * cfg.n_vocab + 2 * 4 * cfg.n_layer
    for il in range(cfg.n_layer):
        for shape in layer_state_shapes(cfg, il, T, raw_live).values():
            if shape is not None:
                total += 4 * shape[0] * shape[1]
    return total


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
    return np.ascontiguousarray(arr, dtype="<f4").tobytes()


def encode_payload(p: Payload, cfg) -> bytes:
    """Serialize ``p`` exactly as ``ds4_session_save_payload`` does (ds4.c:16129-16324).

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
    header = [MAGIC, VERSION, p.ctx, p.prefill_cap, p.raw_cap, p.raw_window, p.comp_cap, T,
              cfg.n_layer, cfg.head_dim, cfg.idx_dim, cfg.n_vocab, raw_live]
    header = [_u32(v, name) for v, name in zip(header, _HEADER_NAMES)]

    parts = [np.asarray(header, dtype="<u4").tobytes(), tokens.astype("<u4").tobytes(),
             _f32_bytes(p.logits, (cfg.n_vocab,), "logits")]
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


# -- loader -------------------------------------------------------------------------------------------

class _Reader:
    def __init__(self, data):
        try:
            self.mv = memoryview(data).cast("B")
        except TypeError as e:
            raise PayloadError(f"session payload is not a contiguous byte buffer: {e}") from None
        self.off = 0

    @property
    def remaining(self) -> int:
        return len(self.mv) - self.off

    def take(self, nbytes: int, what: str) -> memoryview:
        # payload_read_bytes / payload_read_u32 (ds4.c:15795-15830) check the remaining byte count first.
        if nbytes > self.remaining:
            raise PayloadError(f"truncated session payload: {what} needs {nbytes} bytes at offset {self.off}, "
                               f"only {self.remaining} left", what, self.remaining, nbytes)
        out = self.mv[self.off:self.off + nbytes]
        self.off += nbytes
        return out

    def u32s(self, n: int, what: str) -> np.ndarray:
        return np.frombuffer(self.take(4 * n, what), dtype="<u4").astype(np.uint32)

    def f32s(self, shape, what: str) -> np.ndarray:
        n = shape[0] * shape[1] if len(shape) == 2 else shape[0]
        return np.frombuffer(self.take(4 * n, what), dtype="<f4").astype(np.float32).reshape(shape)


def _fail(msg: str, field: str, got, expected, relation: str = "expected") -> PayloadError:
    return PayloadError(f"{msg}: {field} is {got}, {relation} {expected}", field, got, expected)


def decode_payload(data, cfg, ctx: int, prefill_cap: int) -> Payload:
    """Parse a payload for a session of ``ctx`` tokens and chunk ``prefill_cap`` on model ``cfg``.

    Mirrors ``ds4_session_load_payload`` (graph path, ds4.c:16327-16656) check by check and raises
    :class:`PayloadError` on the first failure; nothing is returned unless the whole buffer parsed.
    """
    r = _Reader(data)
    h = [int(v) for v in r.u32s(HEADER_FIELDS, "header")]
    (magic, version, s_ctx, s_prefill, s_raw_cap, s_window, s_comp_cap, T,
     n_layer, head_dim, idx_dim, vocab, s_raw_live) = h

    # ds4.c:16337
    msg = "unsupported session payload version"
    if magic != MAGIC:
        raise _fail(msg, "magic", f"{magic:#010x}", f"{MAGIC:#010x} ('DSV4')")
    if version != VERSION:
        raise _fail(msg, "version", version, VERSION)
    # ds4.c:16487
    msg = "KV checkpoint does not fit current context"
    if s_ctx > ctx:
        raise _fail(msg, "ctx", s_ctx, f"the current context {ctx}", "larger than")
    if T >= ctx:
        raise _fail(msg, "n_tokens", T, f"less than the current context {ctx}", "expected")
    # ds4.c:16491
    msg = "KV checkpoint was written for a different DS4 layout"
    for field, got, want in (("n_layer", n_layer, cfg.n_layer), ("head_dim", head_dim, cfg.head_dim),
                             ("indexer_head_dim", idx_dim, cfg.idx_dim), ("vocab", vocab, cfg.n_vocab)):
        if got != want:
            raise _fail(msg, field, got, want)
    # ds4.c:16497
    msg = "KV checkpoint graph chunk layout does not match current runtime"
    if s_prefill != prefill_cap:
        raise _fail(msg, "prefill_cap", s_prefill, prefill_cap)
    cur_raw_cap, cur_window, cur_comp_cap = graph_caps(cfg, ctx, prefill_cap)
    if s_window != cur_window:
        raise _fail(msg, "raw_window", s_window, f"{cur_window} = min(swa {cfg.swa}, ctx {ctx})")
    # ds4.c:16504-16509; raw_live <= the current ring is implied (every ring holds >= raw_window rows).
    msg = "KV checkpoint raw ring layout does not match current context"
    if s_raw_cap == 0:
        raise _fail(msg, "raw_cap", 0, "at least 1")
    want_live = min(T, s_window)
    if s_raw_live != want_live:
        raise _fail(msg, "raw_live", s_raw_live, f"{want_live} = min(n_tokens {T}, raw_window {s_window})")
    if s_raw_live > s_raw_cap or s_raw_live > cur_raw_cap:
        raise _fail(msg, "raw_live", s_raw_live, f"raw_cap {min(s_raw_cap, cur_raw_cap)}", "larger than")
    # ds4.c:16511
    if s_comp_cap > cur_comp_cap:
        raise _fail("KV checkpoint compressed cache is larger than current context", "comp_cap", s_comp_cap,
                    f"the current capacity {cur_comp_cap}", "larger than")

    tokens = r.u32s(T, "tokens")
    logits = r.f32s((vocab,), "logits")
    for kind, label in ((0, "compressed"), (1, "indexer")):
        for il in range(n_layer):
            field = f"layer {il} {label} row count"
            n = int(r.u32s(1, field)[0])
            cap = min(s_comp_cap, layer_comp_cap(cfg, il, ctx))
            if n > cap:  # ds4.c:16538 / 16549
                raise _fail(f"KV checkpoint has invalid {label} row count", field, n, f"capacity {cap}", "larger than")
            want = expected_row_counts(cfg, il, T)[kind]
            if n != want:  # stricter than ds4: the count must be the one T implies
                R = cfg.ratio(il)
                how = f"floor(n_tokens {T} / ratio {R})" if want else f"no {label} rows on a ratio-{R} layer"
                raise _fail(f"KV checkpoint has invalid {label} row count", field, n, f"{want} = {how}")

    layers = []
    for il in range(n_layer):
        shapes = layer_state_shapes(cfg, il, T, s_raw_live)
        arrays = {f: (None if s is None else r.f32s(s, f"layer {il} {f}")) for f, s in shapes.items()}
        layers.append(LayerPayload(**arrays))
    if r.remaining:  # ds4.c:16640
        raise PayloadError(f"KV checkpoint has trailing payload bytes: {r.remaining} bytes after offset {r.off}, "
                           f"expected 0", "trailing", r.remaining, 0)
    return Payload(ctx=s_ctx, prefill_cap=s_prefill, raw_cap=s_raw_cap, raw_window=s_window, comp_cap=s_comp_cap,
                   tokens=tokens, logits=logits, layers=layers)
