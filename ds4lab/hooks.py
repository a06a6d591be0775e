"""Named hook points and capture: look inside a prefill or decode step, and only where asked.

The model's blocks call ``emit(name, value)`` at named points when a call is given an observer
(:class:`ds4lab.runtime.Runtime`, ``observer=``); without one nothing is emitted and the compiled steps run
as usual. A :class:`Capture` registers its observer on its session (``Session.hook_observer``) for the
duration of a ``with`` block; the session's steps run eagerly then, and the capture keeps what was
selected. Other sessions of the same model are not affected, and a capture inside another's ``with``
block passes every point on to the outer one as well::

    with sess.capture(["attn.scores", "moe.experts", "head.logits"], layers=[2, 4], heads=[0],
                      queries=range(200, 264)) as cap:
        prefill.step()
    amap = cap.attention(2)         # an AttentionMap: raw keys | compressed rows | sink
    cap["blk.2.moe.experts"]        # [Q, k] for the selected queries, over every captured step

Points (``{il}`` a layer index; a point given without ``blk.{il}.`` applies to each selected layer). The
points marked *edit* can also be changed, by :mod:`ds4lab.interventions` (``sess.intervene``): what the edit
returns replaces the model's value for the steps run inside its ``with`` block.

=================================  =========================================================================
``blk.{il}.attn.state``            *edit* the layer's KV state before the step (a ``LayerState``: raw ring,
                                   compressed and indexer rows, pending compressor states); captured as a
                                   dict of NumPy arrays
``blk.{il}.attn.sinks``            *edit* the sink logit of each head ``[H]`` (−inf: no sink)
``blk.{il}.attn_norm``             attention input after the norm ``[T, E]``
``blk.{il}.attn.q_lora``           query low-rank state ``[T, q_lora]``
``blk.{il}.attn.q``                queries before RoPE ``[T, H, D]``
``blk.{il}.attn.kv_in``            the token's KV row before RoPE and storage ``[T, D]``
``blk.{il}.indexer.scores``        indexer score of every compressed row ``[T, rows]``
``blk.{il}.indexer.topk``          rows the indexer lets each query attend ``[T, rows]`` (bool)
``blk.{il}.attn.comp_visible``     *edit* the compressed rows each query attends, after the indexer
                                   ``[T, rows]`` (bool; a row left out is masked before the softmax)
``blk.{il}.attn.scores``           materialised attention map (see :class:`AttentionMap`)
``blk.{il}.attn.out``              attention output before the inverse RoPE ``[T, H, D]``
``blk.{il}.attn.heads``            *edit* attention output after the inverse RoPE ``[T, H, D]``
``blk.{il}.attn_compressor.kv|score|rows``     compressor projections, and the rows after the step
``blk.{il}.indexer_compressor.kv|score|rows``  the same for the indexer's compressor
``blk.{il}.hc_attn.post|comb``     hyper-connection gates and Sinkhorn mix before attention
``blk.{il}.hc_ffn.post|comb``      the same before the FFN
``blk.{il}.ffn_norm``              FFN input after the norm ``[T, E]``
``blk.{il}.moe.router``            router probabilities ``[T, n_expert]``
``blk.{il}.moe.experts``           *edit* chosen experts ``[T, k]`` (other ids are weighted by the router's
                                   probabilities of those experts, renormalised as the model does)
``blk.{il}.moe.weights``           their weights ``[T, k]``
``blk.{il}.moe.out``               the routed experts' weighted sum ``[T, E]`` (without the shared expert)
``head.logits``                    logits of the step's last token ``[1, vocab]``
=================================  =========================================================================

Per-token values keep only the rows of the selected ``queries`` (absolute positions); values
with a head axis keep only the selected ``heads``. Patterns may use ``*`` (``blk.*.moe.experts``).
A capture records the values the model used: inside an intervention's block, the edited ones.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import numpy as np

from .kv.layout import LAYER_FIELDS
from .model.transformer import Replace

POINTS = (
    "attn.state",
    "attn.sinks",
    "attn_norm",
    "attn.q_lora",
    "attn.q",
    "attn.kv_in",
    "attn.scores",
    "attn.out",
    "attn.heads",
    "indexer.scores",
    "indexer.topk",
    "attn.comp_visible",
    "attn_compressor.kv",
    "attn_compressor.score",
    "attn_compressor.rows",
    "indexer_compressor.kv",
    "indexer_compressor.score",
    "indexer_compressor.rows",
    "hc_attn.post",
    "hc_attn.comb",
    "hc_ffn.post",
    "hc_ffn.comb",
    "ffn_norm",
    "moe.router",
    "moe.experts",
    "moe.weights",
    "moe.out",
)
HEAD_AXIS = ("attn.q", "attn.out", "attn.heads")  # per-token values whose axis 1 is the head
# state, not one row per query
NOT_PER_TOKEN = ("attn.state", "attn.sinks", "attn_compressor.rows", "indexer_compressor.rows")


@dataclass
class Record:
    name: str
    step: int  # which forward call of the capture (0, 1, …)
    positions: np.ndarray  # absolute positions of the rows kept (per-token values)
    value: object


@dataclass
class AttentionMap:
    """Attention weights of selected queries and heads of one layer, over three labelled key groups.

    ``weights[q, h, k]`` sums to 1 over ``k`` (the sink takes mass but has no value). Columns:
    ``raw`` (the raw-window rows, by absolute position, ``raw_positions``), ``comp`` (compressed rows
    ``comp_rows``; row c pools tokens ``comp_windows[c]``) and one ``sink`` column. ``keys`` holds the
    raw and compressed rows (keys are the values), so ``output()`` = Σ_k weights·keys reproduces the
    fused path's ``attn.out``. ``candidates`` marks compressed rows a query could see before the
    indexer, ``selected`` those it was allowed to attend (equal where the indexer is inactive).
    """

    layer: int
    ratio: int
    heads: np.ndarray
    queries: np.ndarray  # absolute positions
    raw_positions: np.ndarray
    comp_rows: np.ndarray
    weights: np.ndarray  # [Q, H, n_raw + n_comp + 1]
    keys: np.ndarray  # [n_raw + n_comp, D]
    candidates: np.ndarray  # [Q, n_comp] bool
    selected: np.ndarray  # [Q, n_comp] bool
    groups: dict = field(default_factory=dict)  # name -> slice of the columns

    @property
    def n_raw(self) -> int:
        return len(self.raw_positions)

    @property
    def n_comp(self) -> int:
        return len(self.comp_rows)

    @property
    def comp_windows(self) -> list[tuple[int, int]]:
        """Token range [first, last] that compressed row c pools (ratio 4 overlaps the previous window)."""
        R = self.ratio
        back = R if R == 4 else 0
        return [(max(0, int(c) * R - back), int(c) * R + R - 1) for c in self.comp_rows]

    def group(self, name: str) -> np.ndarray:
        return self.weights[..., self.groups[name]]

    def labels(self) -> list[str]:
        """A short label per key column: ``t12`` (raw position), ``c3[8-15]`` (compressed row), ``sink``."""
        return (
            [f"t{p}" for p in self.raw_positions]
            + [f"c{c}[{a}-{b}]" for c, (a, b) in zip(self.comp_rows, self.comp_windows)]
            + ["sink"]
        )

    def output(self) -> np.ndarray:
        """Σ_k weights[q, h, k] · keys[k] → ``[Q, H, D]``: the attention output before inverse RoPE."""
        return np.einsum("qhk,kd->qhd", self.weights[..., :-1], self.keys)

    def __repr__(self) -> str:
        return (
            f"AttentionMap(layer {self.layer}, heads {[int(h) for h in self.heads]}, {len(self.queries)} queries "
            f"[{self.queries.min() if len(self.queries) else '-'}…{self.queries.max() if len(self.queries) else '-'}], "
            f"keys: {self.n_raw} raw | {self.n_comp} compressed | sink)"
        )


def _select(spec, n: int, what: str | None = None) -> np.ndarray | None:
    """The sorted indices ``spec`` names (an int, a slice of ``range(n)`` or an iterable); with ``what`` each must be
    one of ``0 … n - 1``, else a ValueError names it (a layer or head that does not exist recorded nothing)."""
    if spec is None:
        return None
    if isinstance(spec, (int, np.integer)):
        spec = [spec]
    if isinstance(spec, slice):
        spec = range(n)[spec]
    out = np.asarray(sorted(set(int(i) for i in spec)), dtype=np.int64)
    if what is not None and out.size and not (0 <= out[0] and out[-1] < n):
        bad = out[0] if out[0] < 0 else out[-1]
        raise ValueError(f"{what} {bad} does not exist: this model's are 0 … {n - 1}")
    return out


def _check_point(point: str, n_layer: int) -> None:
    """Refuse a hook point name that no step emits (a misspelling recorded nothing): a name of POINTS, alone or as
    ``blk.N.<name>`` of a layer N of the model, or ``head.logits``; a name with a glob character passes as it is."""
    if any(c in point for c in "*?["):
        return
    name = point
    if point.startswith("blk."):
        il, _, name = point[4:].partition(".")
        if not il.isdigit() or int(il) >= n_layer:
            raise ValueError(f"hook point {point!r}: layer {il!r} is not a layer of this model (0 … {n_layer - 1})")
    if name not in POINTS and point != "head.logits":
        raise ValueError(f"unknown hook point {point!r}; the points are head.logits and, per layer, "
                         f"{', '.join(POINTS)}")


class Capture:
    """Context manager that records the selected hook points of every forward call made inside it."""

    def __init__(self, session, points, layers=None, heads=None, queries=None):
        self.session = session
        cfg = session.model.config
        self.cfg = cfg
        self.layers = _select(layers, cfg.n_layer, "layer")
        self.heads = _select(heads, cfg.n_head, "head")
        self.queries = None if queries is None else set(_select(queries, 1 << 62).tolist())
        if isinstance(points, str):
            points = [points]
        layer_ids = range(cfg.n_layer) if self.layers is None else self.layers
        self.patterns = []
        for pt in points:
            _check_point(pt, cfg.n_layer)
            if pt.startswith("blk.") or pt.startswith("head."):
                self.patterns.append(pt)
            else:
                self.patterns.extend(f"blk.{il}.{pt}" for il in layer_ids)
        self._records: list[Record] = []
        self._step = -1
        self._span: dict[int, tuple[int, int]] = {}
        self._prev_observer = None
        self._active = False

    # -- context manager ------------------------------------------------------------------------------
    def __enter__(self) -> "Capture":
        self._prev_observer = self.session.hook_observer
        self.session.hook_observer = self._observe
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        if self._active:
            self.session._end_observer(self._observe, self._prev_observer)
            self._active = False

    # -- recording ------------------------------------------------------------------------------------
    def _wanted(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.patterns)

    def _np(self, x):
        return np.asarray(self.session.model.backend.to_numpy(x))

    def _rows(self, il: int, n_rows: int) -> tuple[np.ndarray, np.ndarray]:
        """(row indices into the chunk, their absolute positions) of the selected real queries."""
        pos0, n_valid = self._span[il]
        pos = pos0 + np.arange(min(n_rows, n_valid))
        keep = np.ones(len(pos), bool) if self.queries is None else np.isin(pos, list(self.queries))
        return np.nonzero(keep)[0], pos[keep]

    def _observe(self, name: str, value):
        """Record ``name`` if selected; returns the :class:`Replace` of an outer observer (an intervention), if any."""
        out = None
        if self._prev_observer is not None:
            out = self._prev_observer(name, value)
            value = out.value if isinstance(out, Replace) else value
        self._record(name, value)
        return out if isinstance(out, Replace) else None

    def _record(self, name: str, value) -> None:
        if name == "head.logits":
            if self._wanted(name):
                self._record_head(value)
            return
        parts = name.split(".")
        il, point = int(parts[1]), ".".join(parts[2:])
        if point == "span":
            if il == 0:
                self._step += 1
            self._span[il] = (int(np.asarray(value[0])), int(np.asarray(value[1])))
            return
        if self.layers is not None and il not in self.layers or not self._wanted(name):
            return
        if point == "attn.scores":
            self._records.append(self._attention_record(il, name, value))
            return
        if point == "attn.state":
            value = {f: None if a is None else self._np(a) for f, a in zip(LAYER_FIELDS, value.arrays())}
            self._records.append(Record(name, self._step, np.zeros(0, np.int64), value))
            return
        v = self._np(value)
        if point in NOT_PER_TOKEN:
            pos0, n_valid = self._span[il]
            self._records.append(Record(name, self._step, pos0 + np.arange(n_valid), v))
            return
        idx, pos = self._rows(il, v.shape[0])
        v = v[idx]
        if point in HEAD_AXIS and self.heads is not None:
            v = v[:, self.heads]
        self._records.append(Record(name, self._step, pos, v))

    def _record_head(self, logits) -> None:
        pos0, n_valid = self._span.get(self.cfg.n_layer - 1, (0, 0))
        pos = np.array([pos0 + n_valid - 1])
        if self.queries is None or int(pos[0]) in self.queries:
            self._records.append(Record("head.logits", self._step, pos, self._np(logits)))

    def _attention_record(self, il: int, name: str, d: dict) -> Record:
        """Materialise the selected queries × heads of one layer's attention, next to the fused path."""
        q = self._np(d["q"])
        idx, pos = self._rows(il, q.shape[0])
        heads = np.arange(q.shape[1]) if self.heads is None else self.heads
        q = q[idx][:, heads]
        keys = self._np(d["keys"])
        visible = self._np(d["visible"])[idx]
        sinks = self._np(d["sinks"])[heads]
        n_raw = int(d["n_raw"])
        s = np.einsum("thd,nd->thn", q, keys) * float(d["scale"])
        s = np.where(visible[:, None, :], s, -np.inf)
        m = np.maximum(s.max(axis=-1), sinks[None, :]) if s.shape[-1] else np.broadcast_to(sinks, s.shape[:2])
        e = np.exp(s - m[:, :, None])
        e_sink = np.exp(sinks[None, :] - m)
        den = e_sink + e.sum(axis=-1)
        w = np.concatenate([e, e_sink[:, :, None]], axis=-1) / den[:, :, None]
        comp_cand = d.get("comp_candidates")
        R = int(d["ratio"])
        if comp_cand is not None:
            cand = self._np(comp_cand)[idx]
            sel = visible[:, n_raw:]
        else:
            cand = sel = np.zeros((len(idx), 0), bool)
        part = dict(
            weights=w,
            keys=keys,
            n_raw=n_raw,
            slot_pos=self._np(d["slot_pos"]).astype(np.int64),
            visible=visible,
            candidates=cand,
            selected=sel,
            heads=heads,
            ratio=R,
        )
        return Record(name, self._step, pos, part)

    # -- reading --------------------------------------------------------------------------------------
    def records(self, name: str | None = None) -> list[Record]:
        return [r for r in self._records if name is None or r.name == name]

    @property
    def names(self) -> list[str]:
        return sorted({r.name for r in self._records})

    def positions(self, name: str) -> np.ndarray:
        recs = self.records(name)
        return np.concatenate([r.positions for r in recs]) if recs else np.zeros(0, np.int64)

    def __getitem__(self, name: str) -> np.ndarray:
        """Every captured step's value of ``name``, concatenated along the query axis."""
        recs = self.records(name)
        if not recs:
            raise KeyError(f"nothing captured at {name!r}; captured: {', '.join(self.names) or 'nothing'}")
        if name.endswith(".attn.scores"):
            raise KeyError(f"use cap.attention({name.split('.')[1]}) for attention maps")
        if ".".join(name.split(".")[2:]) in NOT_PER_TOKEN:  # state after the last step
            return recs[-1].value
        return np.concatenate([r.value for r in recs], axis=0)

    def __contains__(self, name: str) -> bool:
        return any(r.name == name for r in self._records)

    def attention(self, layer: int) -> AttentionMap:
        """The attention map of ``layer`` over every captured step, keys merged by identity (raw rows by
        position, compressed rows by index): a whole prefill's queries in one map."""
        recs = self.records(f"blk.{layer}.attn.scores")
        if not recs:
            raise KeyError(f"no attention captured for layer {layer}: capture 'blk.{layer}.attn.scores'")
        raw_pos: set[int] = set()
        n_comp = 0
        for r in recs:
            p = r.value
            vis_raw = p["visible"][:, : p["n_raw"]].any(axis=0)
            raw_pos.update(p["slot_pos"][vis_raw].tolist())
            if p["candidates"].shape[1]:
                cols = np.nonzero(p["candidates"].any(axis=0))[0]
                n_comp = max(n_comp, int(cols.max()) + 1 if len(cols) else 0)
        raw_positions = np.array(sorted(raw_pos), dtype=np.int64)
        comp_rows = np.arange(n_comp)
        col_of = {int(p): i for i, p in enumerate(raw_positions)}
        nr, nc = len(raw_positions), n_comp
        D = recs[0].value["keys"].shape[1]
        H = len(recs[0].value["heads"])
        Q = sum(len(r.positions) for r in recs)
        W = np.zeros((Q, H, nr + nc + 1))
        K = np.zeros((nr + nc, D))
        cand = np.zeros((Q, nc), bool)
        sel = np.zeros((Q, nc), bool)
        row = 0
        for r in recs:
            p = r.value
            q = len(r.positions)
            slots = np.nonzero(p["slot_pos"] >= 0)[0]
            slots = slots[np.isin(p["slot_pos"][slots], raw_positions)]
            cols = np.array([col_of[int(p["slot_pos"][s])] for s in slots], dtype=np.int64)
            W[row : row + q, :, cols] = p["weights"][:, :, slots]
            K[cols] = p["keys"][slots]
            if nc:
                W[row : row + q, :, nr : nr + nc] = p["weights"][:, :, p["n_raw"] : p["n_raw"] + nc]
                K[nr : nr + nc] = p["keys"][p["n_raw"] : p["n_raw"] + nc]
                cand[row : row + q] = p["candidates"][:, :nc]
                sel[row : row + q] = p["selected"][:, :nc]
            W[row : row + q, :, -1] = p["weights"][:, :, -1]
            row += q
        groups = {"raw": slice(0, nr), "comp": slice(nr, nr + nc), "sink": slice(nr + nc, nr + nc + 1)}
        return AttentionMap(
            layer,
            recs[0].value["ratio"],
            np.asarray(recs[0].value["heads"], dtype=np.int64),
            self.positions(f"blk.{layer}.attn.scores"),
            raw_positions,
            comp_rows,
            W,
            K,
            cand,
            sel,
            groups,
        )

    def __repr__(self) -> str:
        steps = self._step + 1
        return f"Capture({len(self._records)} records over {steps} forward calls: {', '.join(self.names[:6])}" + (
            ", …)" if len(self.names) > 6 else ")"
        )


def capture(session, points, layers=None, heads=None, queries=None) -> Capture:
    return Capture(session, points, layers=layers, heads=heads, queries=queries)
