"""KVCacheView: a session's KV state — the raw ring (one ring buffer of positions, the same in every layer) and
per layer its compressed and indexer rows and the tokens of the group still pending (front-end
``widgets/kvcache.js``). "Window" means only the raw window (the last ``window`` positions a query sees); a
compressed row pools a *group* of ``ratio`` tokens."""

from __future__ import annotations

import contextlib
import html

import ipywidgets as W
import numpy as np
import traitlets as t

from ..kv.checkpoint import Checkpoint, model_fingerprint, state_to_payload
from ..kv.view import KVView
from .base import FollowingView, ViewModel, check_session, widget_module


def state_label(i: int, start: int, end: int) -> str:
    """The one name of the state after a prefill chunk, in titles, sliders and fallbacks."""
    return f"after chunk {i} (tokens {start}–{end - 1})"


def indexer_picks(indexer, layer: int, position: int, n_rows: int) -> list[int] | None:
    """The compressed rows (of the first ``n_rows``) the indexer of ``layer`` let the query at ``position``
    attend, from ``indexer``: a :class:`ds4lab.hooks.Capture` of ``indexer.topk`` (its last record of that
    position), or a function ``(layer, position) -> bool [rows] or None``. None where it does not hold them."""
    if indexer is None or position < 0:
        return None
    if callable(indexer) and not hasattr(indexer, "records"):
        row = indexer(layer, position)
    else:
        row = None
        for rec in reversed(indexer.records(f"blk.{layer}.indexer.topk")):
            hit = np.nonzero(np.asarray(rec.positions) == position)[0]
            if len(hit):
                row = rec.value[hit[-1]]
                break
    return None if row is None else np.nonzero(np.asarray(row, bool)[:n_rows])[0].tolist()


def kv_summary(config, geometry, kv: KVView, new_from: int | None = None, label: str = "", indexer=None) -> dict:
    """What the KV view draws, as JSON: the ring's slot → position map (the write pointer is the slot of the next
    position, where the context has one: ``full``; positions before ``evicted`` were overwritten), per layer its
    rows, pending tokens and bytes (``other_bytes``: the rest of the payload's total, its header, token ids and
    logits);
    positions from ``new_from`` on (default: none) are marked (orange) as written by the step shown. On a layer with an
    indexer, ``picked``: the compressed rows the last query (position ``n_tokens − 1``) attends, where
    ``indexer`` (see :func:`indexer_picks`) holds its choice, else None."""
    T = kv.n_tokens
    slots = [-1] * geometry.raw_cap
    for p in range(max(0, T - geometry.raw_cap), T):
        slots[p % geometry.raw_cap] = p
    layers = []
    for lk in kv:
        live = [int(lk.raw_positions[0]), int(lk.raw_positions[-1])] if len(lk.raw_positions) else [T, T - 1]
        R = lk.ratio
        pending = list(range(T - T % R, T)) if R else []
        layers.append(
            dict(
                layer=lk.layer,
                ratio=R,
                bytes=int(lk.nbytes),
                live=live,
                n_comp=lk.n_comp,
                n_index=lk.n_index if config.has_indexer(lk.layer) else None,
                picked=indexer_picks(indexer, lk.layer, T - 1, lk.n_comp) if config.has_indexer(lk.layer) else None,
                pending=pending,
            )
        )
    return dict(
        n_tokens=T,
        total_bytes=int(kv.nbytes),
        # the payload's bytes besides the layers': its header, the token ids and the next token's logits
        other_bytes=int(kv.nbytes) - sum(L["bytes"] for L in layers),
        n_vocab=config.n_vocab,
        full=T >= geometry.ctx,  # no next position: the write pointer names none
        raw_cap=geometry.raw_cap,
        window=geometry.window,
        slots=slots,
        pointer=T % geometry.raw_cap,
        evicted=max(0, T - geometry.raw_cap),
        idx_topk=config.idx_topk,
        new_from=T if new_from is None else new_from,
        label=label,
        layers=layers,
    )


def _other(d: dict) -> str:
    """The payload's bytes besides the layers' (the fallback's words; kvcache.js says the same)."""
    if not d.get("n_tokens"):
        return ("no token yet: these bytes are what a state holds from the start (the compressors' pending state on "
                "the compressed layers, the header, the logits)")
    return (f"the total: the layers below plus {d.get('other_bytes', 0):,} bytes for the header, the token ids "
            f"(4 B each) and the next token's logits (4 B × {d.get('n_vocab', 0):,})")


def _pointer(d: dict) -> str:
    return "the context is full" if d.get("full") else f"write pointer at slot {d.get('pointer')}"


class KVCacheModel(ViewModel):
    _esm = widget_module("kvcache.js", "hovertip.js", "text.js", "reserve.js")
    data = t.Dict().tag(sync=True)
    layers = t.List(t.Int(), allow_none=True, default_value=None).tag(sync=True)  # the layers drawn (None: all)
    compact = t.Bool(False).tag(sync=True)  # the ring's key and the bytes folded under one line


class KVCacheView(FollowingView):
    """The session's KV state: the raw ring buffer and per layer the compressed rows. It shows the state at the
    moment it was made; ``refresh()`` shows the session's state now, and ``follow=True`` does that after every
    prefill chunk and decode step (through ``session.step_observers``; a refresh reads the whole state, which on a
    long context can cost more than the step). ``show(checkpoint)`` or the slider scrubs through checkpoints
    without touching the session; the title names the state on display ("after chunk i (tokens a–b)" for a
    prefill's chunks). Cells written by the step shown are marked in orange; a fresh view marks what its slider's
    checkpoint added (nothing without one).
    ``layers`` picks the layers drawn (default all). ``indexer``: where the indexer's choice of the state's last
    query is known, its layers mark the compressed rows that query attends and those it dropped: a
    :class:`ds4lab.hooks.Capture` of ``indexer.topk`` that holds the last position (or a function, see
    :func:`indexer_picks`); the session itself does not keep that choice. ``slider=False``: the view shows no
    slider of its own, whatever it scrubs through (a view that embeds it, such as the PrefillView, drives it with
    its own control); ``scrub`` and ``show`` still work. ``compact=True`` folds the ring's key and the byte count
    under one line (a view beside another, as in the PrefillView, where the key took 25 lines of a narrow column)."""

    def __init__(self, session, checkpoints=None, follow: bool = False, layers=None, slider: bool = True,
                 indexer=None, compact: bool = False):
        if not (indexer is None or callable(indexer) or hasattr(indexer, "records")):
            raise TypeError(f"indexer= is a capture of indexer.topk (sess.capture(['indexer.topk'], ...)) or a "
                            f"function (layer, position) -> rows; got {type(indexer).__name__} {indexer!r:.40}")
        check_session(session, "KVCacheView")
        cfg = session.model.config
        if layers is not None:
            layers = list(layers) if isinstance(layers, (list, tuple, range, np.ndarray)) else [layers]
            layers = [cfg.check_layer(il, f"layers[{i}]") for i, il in enumerate(layers)]
        self.session = session
        self.indexer = indexer
        self.has_slider = bool(slider)
        self._checkpoints, self._labels = [], []
        self._shown: tuple[tuple, int] = ((), 0)  # tokens of the state on display, and its first new position
        self._syncing = False  # the slider is being moved to the state on display: do not scrub
        self.model = KVCacheModel(layers=layers, compact=bool(compact))
        self.slider = W.IntSlider(value=0, min=0, max=0, description="state", disabled=True)
        self.slider.observe(self.guarded(self._slid), names="value")
        self.widget = W.VBox([self.slider, self.model] if self.has_slider else [self.model])
        self.scrub_through(checkpoints or [])
        self.refresh()
        # a fresh view outlines what its checkpoint on display added to the one before (as the slider does), else
        # nothing
        i = self.shown_checkpoint
        new_from = len(self._shown[0]) if i is None else len(self._checkpoints[i - 1].tokens) if i else 0
        self._shown = (self._shown[0], new_from)
        self.model.data = dict(self.model.data, new_from=new_from)
        self._follow(follow)

    def __repr__(self) -> str:
        d = self.model.data
        return f"KVCacheView({d.get('n_tokens', 0)} tokens, {d.get('total_bytes', 0):,} bytes, {d.get('label', '')})"

    def _new_from(self, tokens: tuple) -> int:
        """First position to outline as new: the state on display again keeps its outline, an extension of
        it outlines what it adds, anything else is new throughout."""
        shown, new_from = self._shown
        if tokens == shown:
            return new_from
        return len(shown) if tokens[: len(shown)] == shown else 0

    def refresh(self) -> None:
        """Show the session's state now (the cells written since the state shown before marked)."""
        sess = self.session
        tokens = tuple(sess.tokens)
        new_from = self._new_from(tokens)
        self.model.data = kv_summary(sess.model.config, sess.geometry, sess.kv, new_from,
                                     label="of the session", indexer=self.indexer)
        self._shown = (tokens, new_from)
        self._sync_slider()

    def show(self, checkpoint, label: str = "", new_from: int | None = None) -> None:
        """Show a checkpoint's state (the session is not changed); ``new_from``: the first position to outline
        as written by the step shown (default: what it adds to the state shown before)."""
        sess = self.session
        cfg, b = sess.model.config, sess.model.backend
        checkpoint = getattr(checkpoint, "checkpoint", checkpoint)
        state = checkpoint.state_for(cfg, b, sess.geometry)
        logits = checkpoint.logits if checkpoint.logits is not None else np.zeros(cfg.n_vocab)
        kv = KVView(cfg, state_to_payload(cfg, b, state, checkpoint.tokens, logits))
        tokens = tuple(checkpoint.tokens)
        new_from = self._new_from(tokens) if new_from is None else new_from
        self.model.data = kv_summary(cfg, sess.geometry, kv, new_from, label=label or f"{len(checkpoint)} tokens",
                                     indexer=self.indexer)
        self._shown = (tokens, new_from)
        self._sync_slider()

    def scrub_through(self, checkpoints) -> None:
        """Let the slider scrub through ``checkpoints`` (a prefill's chunks, or checkpoints); the slider moves to
        the checkpoint of the state on display (after a prefill: the last chunk's)."""
        states = [getattr(c, "checkpoint", c) for c in checkpoints]
        sess = self.session
        for i, c in enumerate(states):  # refused here, the view unchanged, not when the slider reaches it
            if not isinstance(c, Checkpoint):
                raise TypeError(f"checkpoints[{i}] is a {type(c).__name__}: give checkpoints (sess.checkpoint(), "
                                "store.load) or a prefill's chunks")
            c.check_fits(sess.model.config, sess.geometry, model_fingerprint(sess.model))
        self._checkpoints = states
        # the slider's number is the chunk's (or checkpoint's) in the title: "after chunk 2 (tokens 128–155)"
        self.slider.description = "chunk" if all(hasattr(c, "checkpoint") for c in checkpoints) else "checkpoint"
        self._labels = [state_label(i, c.start, c.end) if hasattr(c, "checkpoint") else
                        f"checkpoint {i} ({len(c)} tokens)" for i, c in enumerate(checkpoints)]
        with self._quiet():
            self.slider.max = max(len(self._checkpoints) - 1, 0)
        self.slider.disabled = len(self._checkpoints) < 2
        # nothing to scrub, or a view without a slider of its own (another control drives it): no slider shown
        self.slider.layout.display = None if self.has_slider and len(self._checkpoints) >= 2 else "none"
        self._sync_slider()

    @property
    def checkpoints(self) -> tuple:
        """The checkpoints the slider scrubs through."""
        return tuple(self._checkpoints)

    @property
    def shown_checkpoint(self) -> int | None:
        """Index in the slider's checkpoints of the state on display (the slider's own when it holds those
        tokens, else the last one that does), or None when none does."""
        tokens, cps = self._shown[0], self._checkpoints

        def holds(i):
            return len(cps[i].tokens) == len(tokens) and tuple(cps[i].tokens) == tokens

        if 0 <= self.slider.value < len(cps) and holds(self.slider.value):
            return self.slider.value
        return next((i for i in range(len(cps) - 1, -1, -1) if holds(i)), None)

    @contextlib.contextmanager
    def _quiet(self):
        """Moves of the slider in this block follow the display: they do not scrub."""
        was, self._syncing = self._syncing, True
        try:
            yield
        finally:
            self._syncing = was

    def _sync_slider(self) -> None:
        """Put the slider on the checkpoint on display (its number the title's)."""
        i = self.shown_checkpoint
        if i is not None:
            with self._quiet():
                self.slider.value = i
            if self.model.data.get("label") != self._labels[i]:
                self.model.data = dict(self.model.data, label=self._labels[i])

    def _slid(self, change) -> None:
        if not self._syncing:
            self.scrub(change["new"])

    def scrub(self, i: int) -> None:
        """Show checkpoint ``i`` of the slider's list (and put the slider on it), outlining what it added to
        the checkpoint before it."""
        if not 0 <= i < len(self._checkpoints):
            raise IndexError(f"checkpoint {i} is not one of the {len(self._checkpoints)} this view scrubs through")
        with self._quiet():
            self.slider.value = i
        self.show(self._checkpoints[i], label=self._labels[i],
                  new_from=len(self._checkpoints[i - 1].tokens) if i else 0)

    def _attended(self, L: dict) -> str:
        """How many compressed rows the state's last query attends, in words (the fallback's table)."""
        k = self.session.model.config.idx_topk
        if not L["ratio"]:
            return ""
        if not L["n_comp"]:
            return "none yet"  # "all 0" read as a count of rows attended
        if L["n_index"] is None or L["n_comp"] <= k:
            return f"all {L['n_comp']}"
        if L["picked"] is None:
            return f"top {k} (which ones: not captured)"
        return f"{len(L['picked'])} of {L['n_comp']}, the indexer's pick"

    def static_html(self) -> str:
        d = self.model.data
        drawn = self.model.layers
        rows = "".join(
            f"<tr><td>{L['layer']}</td><td>{L['ratio'] or '—'}</td><td>{L['live'][0]}–{L['live'][1]}</td>"
            f"<td>{L['n_comp'] if L['ratio'] else ''}</td>"
            f"<td>{'' if L['n_index'] is None else L['n_index']}</td><td>{self._attended(L)}</td>"
            f"<td>{len(L['pending']) if L['ratio'] else ''}</td><td>{L['bytes']:,}</td></tr>"
            for L in d.get("layers", []) if drawn is None or L["layer"] in drawn
        )
        ev = d.get("evicted", 0)
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>KV cache {html.escape(d.get('label', ''))}: "
            f"{d.get('n_tokens', 0)} tokens, {d.get('total_bytes', 0):,} bytes</b> ({_other(d)}) — raw ring of "
            f"{d.get('raw_cap')} slots ({_pointer(d)}"
            f"{f', positions 0–{ev - 1} overwritten' if ev else ''}), raw window {d.get('window')}"
            "<table><tr><th>layer</th><th>ratio</th><th>in the raw window</th><th>comp rows</th>"
            "<th>indexer rows</th><th>comp rows the last query attends</th><th>pending in group</th><th>bytes</th>"
            f"</tr>{rows}</table></div>"
        )
