"""The KV state of every layer, in ds4's fixed-capacity layout (docs/MODEL.md, "Where the KV state lives").

Per layer: the raw ring (``raw_cap`` rows, position p in slot p mod raw_cap), append-only compressed
rows (capacity ctx/R + 2), in ratio-4 layers append-only indexer rows (ctx/4 + 2), and the pending
compressor state of each compressor. Row counts are not stored: after T tokens a ratio-R layer holds
⌊T/R⌋ rows. Rows beyond the count, and ring slots outside the window, are never read: zero in a new state, as a
step left them or as memory held them in a compiled step's copy (ds4lab.runtime.compiled.live_rows). States are
immutable values; a step returns a new one.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np

from ..arch import NEG_INF, coff
from ..config import ModelConfig, ds4_model_id, is_int

DEFAULT_CHUNK = 2048  # ds4's prefill chunk on Metal and CUDA at 8d57664, the commit docs/MODEL.md follows
# ds4's since 9ba160ae where the prompt is longer: 4096 tokens for Flash, 8192 for Pro. A backend whose chunks run
# eagerly takes it (Backend.long_prefill_chunks: CuPy, where on an H100 chunks of 4096 prefilled 1.13-1.14x as fast as
# chunks of 2048, benchmarks/README.md); one that pads every chunk to the step (MLX on Metal) would compute twice the
# rows of a short prompt's chunk.
LONG_CHUNK = 4096
PRO_CHUNK = 8192
RAW_CAP_MAX = 8192  # the raw ring never exceeds this many rows (ds4.c:13946-13977)
# Initial value of the *_state_score arrays; kv states start at 0 (docs/FORMATS.md, "The DSV4 session payload").
STATE_SCORE_INIT = NEG_INF

# A layer's seven arrays, in the order the DSV4 payload stores them; the same names in LayerState and LayerPayload.
LAYER_FIELDS = ("raw", "comp", "comp_state_kv", "comp_state_score", "index", "index_state_kv", "index_state_score")
ROW_FIELDS = ("raw", "comp", "index")  # the KV rows; the other LAYER_FIELDS are the pending compressor states


@dataclass(frozen=True)
class Geometry:
    """Context size, prefill chunk and raw-ring capacity, sized as ds4 sizes them
    (docs/MODEL.md, "Where the KV state lives")."""

    ctx: int
    chunk: int  # the prefill chunk the session was created with (the payload's prefill_cap)
    raw_cap: int
    window: int
    comp_cap: int  # the payload header's session-wide compressed capacity

    @classmethod
    def for_context(cls, cfg: ModelConfig, ctx: int, chunk: int | None = None,
                    raw_cap: int | None = None, long_chunks: bool = False) -> "Geometry":
        """``chunk`` None: ds4's rule (:func:`chunk_from_env`), its later chunks with ``long_chunks``."""
        if not is_int(ctx):
            raise TypeError(f"ctx must be an integer, got {ctx!r}")
        if ctx < 2:
            raise ValueError(f"ctx must be at least 2, got {ctx}")
        if chunk is not None and not is_int(chunk):
            raise TypeError(f"prefill_chunk must be an integer, got {chunk!r}")
        # Python ints from here on: NumPy's have no bit_length (the RoPE tables' sizes) and may overflow
        ctx, chunk = int(ctx), None if chunk is None else int(chunk)
        raw_cap = None if raw_cap is None else int(raw_cap)
        if chunk is None:
            chunk = chunk_from_env(ctx, (PRO_CHUNK if ds4_model_id(cfg) == 1 else LONG_CHUNK) if long_chunks
                                   else DEFAULT_CHUNK)
        if chunk < 1:
            raise ValueError(f"prefill_chunk must be positive, got {chunk}")
        chunk = min(chunk, ctx)
        default_cap, window, comp_cap = graph_caps(cfg, ctx, chunk)
        if raw_cap is None:
            raw_cap = raw_cap_from_env()
        # ds4 keeps an override at the window or more; one slot more, so that a step can take a token (a ring of just
        # the window, smaller than the context, would take none: step 0)
        raw_cap = default_cap if raw_cap is None else max(min(window + 1, ctx), min(raw_cap, ctx, RAW_CAP_MAX))
        return cls(ctx=ctx, chunk=chunk, raw_cap=raw_cap, window=window, comp_cap=comp_cap)

    @property
    def step(self) -> int:
        """The most tokens one forward call may take: a chunk's rows and the window before it must
        fit in the ring together (ds4 caps resumed chunks at raw_cap the same way)."""
        return self.chunk if self.raw_cap >= self.ctx else min(self.chunk, self.raw_cap - self.window)


def chunk_from_env(ctx: int, default: int = DEFAULT_CHUNK) -> int:
    """ds4's prefill chunk for a context (ds4_default_prefill_cap_for_prompt, the context in the prompt's place):
    DS4_METAL_PREFILL_CHUNK, else ``default`` (:data:`DEFAULT_CHUNK`; :data:`LONG_CHUNK` or :data:`PRO_CHUNK` as
    ds4 chooses since 9ba160ae) where the context is longer, else the whole context; ds4's quirks included."""
    env = os.environ.get("DS4_METAL_PREFILL_CHUNK")
    if env is None:
        return default if ctx > default else ctx
    try:
        v = int(env)
    except ValueError:
        return ctx  # a non-numeric value disables chunking (ds4 skips the default too)
    return min(v, ctx) if v > 0 else ctx


def env_int(name: str) -> int | None:
    """An integer environment variable (None when unset); anything else is an error naming it."""
    env = os.environ.get(name)
    if env is None:
        return None
    try:
        return int(env)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {env!r}") from None


def raw_cap_from_env() -> int | None:
    return env_int("DS4_METAL_GRAPH_RAW_CAP")


def pending_state(backend, ratio: int, width: int):
    """A compressor's pending state before any token: ``coff·R`` rows of kv 0 and score −1e30."""
    xp, rows = backend.xp, coff(ratio) * ratio
    return (xp.zeros((rows, width), dtype=backend.dtype),
            xp.full((rows, width), STATE_SCORE_INIT, dtype=backend.dtype))


# -- sizes and shapes (docs/FORMATS.md, "The DSV4 session payload") ----------------------------------

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
    shapes: dict[str, tuple[int, int] | None] = dict.fromkeys(LAYER_FIELDS)
    shapes["raw"] = (raw_live, cfg.head_dim)
    if R:
        shapes["comp"] = (n_comp, cfg.head_dim)
        shapes["comp_state_kv"] = shapes["comp_state_score"] = (coff(R) * R, cfg.compressor_width(il, cfg.head_dim))
    if cfg.has_indexer(il):
        shapes["index"] = (n_index, cfg.idx_dim)
        shapes["index_state_kv"] = shapes["index_state_score"] = (coff(R) * R, cfg.compressor_width(il, cfg.idx_dim))
    return shapes


def state_values(cfg, n_tokens: int, raw_live: int) -> int:
    """Values every layer's arrays hold after ``n_tokens`` tokens with ``raw_live`` raw rows (the sum of
    :func:`layer_state_shapes` over the layers): what a DSV4 payload stores besides its header, tokens and logits."""
    return sum(shape[0] * shape[1] for il in range(cfg.n_layer)
               for shape in layer_state_shapes(cfg, il, n_tokens, raw_live).values() if shape is not None)


@dataclass(frozen=True)
class LayerState:
    raw: object  # [raw_cap, head_dim] ring
    comp: object | None = None  # [ctx/R + 2, head_dim]
    comp_state_kv: object | None = None  # [coff·R, coff·head_dim] pending kv
    comp_state_score: object | None = None  # [coff·R, coff·head_dim] pending scores (gate + APE)
    index: object | None = None  # [ctx/4 + 2, idx_dim]
    index_state_kv: object | None = None  # [8, 2·idx_dim]
    index_state_score: object | None = None

    def arrays(self) -> tuple:
        return tuple(getattr(self, f.name) for f in fields(self))

    @classmethod
    def from_arrays(cls, arrays) -> "LayerState":
        return cls(*arrays)


class PackedLayers(Sequence):
    """Every layer's state as one run of arrays (a CUDA graph replay's outputs), made into
    :class:`LayerState` values only when read. A compiled decode step hands the run to the next step
    whole, so a step that nothing reads the layers of makes no object per layer and array."""

    def __init__(self, arrays: Sequence, n_layer: int, unflatten: Callable[[Sequence], tuple[LayerState, ...]]):
        self.arrays, self._n, self._unflatten, self._layers = arrays, n_layer, unflatten, None

    def _get(self) -> tuple[LayerState, ...]:
        if self._layers is None:
            self._layers = self._unflatten(self.arrays)
        return self._layers

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):
        return self._get()[i]

    def __iter__(self):
        return iter(self._get())


@dataclass(frozen=True)
class KVState:
    layers: Sequence[LayerState]  # a tuple, or PackedLayers
    n_past: int
    geometry: Geometry

    def to_backend(self, backend) -> "KVState":
        """The same state as arrays of ``backend`` (e.g. a float64 reference state continued in MLX)."""
        def convert(x):
            return None if x is None else backend.asarray(np.asarray(x))

        layers = tuple(LayerState.from_arrays([convert(a) for a in layer.arrays()]) for layer in self.layers)
        return replace(self, layers=layers)


def new_state(cfg: ModelConfig, backend, geometry: Geometry) -> KVState:
    with backend.scope():  # zeros made on the model's device
        return _new_state(cfg, backend, geometry)


def _new_state(cfg: ModelConfig, backend, geometry: Geometry) -> KVState:
    xp, dt = backend.xp, backend.dtype
    layers = []
    for il in range(cfg.n_layer):
        R = cfg.ratio(il)
        layer = LayerState(raw=xp.zeros((geometry.raw_cap, cfg.head_dim), dtype=dt))
        if R:
            kv, sc = pending_state(backend, R, cfg.compressor_width(il, cfg.head_dim))
            rows = layer_comp_cap(cfg, il, geometry.ctx)
            layer = replace(layer, comp=xp.zeros((rows, cfg.head_dim), dtype=dt), comp_state_kv=kv,
                            comp_state_score=sc)
        if cfg.has_indexer(il):
            kv, sc = pending_state(backend, R, cfg.compressor_width(il, cfg.idx_dim))
            rows = layer_comp_cap(cfg, il, geometry.ctx)
            layer = replace(layer, index=xp.zeros((rows, cfg.idx_dim), dtype=dt), index_state_kv=kv,
                            index_state_score=sc)
        layers.append(layer)
    return KVState(tuple(layers), 0, geometry)
