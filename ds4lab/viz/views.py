"""Notebook views: anywidget models (front-end ESM/CSS in ``widgets/``, shipped in the wheel) with
ipywidgets controls around them. Each view's ``_repr_mimebundle_`` carries the live widget and a static
``text/html`` fallback (tables, coloured text, an inline PNG), so a saved notebook still shows it."""

from __future__ import annotations

import contextlib
import html

import ipywidgets as W
import numpy as np
import traitlets as t

from ..kv.checkpoint import state_to_payload
from ..kv.view import KVView
from .base import FollowingView, View, ViewModel, token_texts, widget_file
from .reduce import MAX_SIDE, colormap, png_base64, reduce_groups, to_uint8

PALETTE = ["#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9d9d9", "#9ecae1", "#a1d99b"]


# -- PrefillView ----------------------------------------------------------------------------------------
class PrefillModel(ViewModel):
    _esm = widget_file("prefill.js")
    tokens = t.List(t.Unicode()).tag(sync=True)
    first = t.Int(0).tag(sync=True)  # position the prefill starts from (earlier tokens were reused)
    bounds = t.List().tag(sync=True)  # [[start, end], ...] of every chunk, run or planned
    chunks = t.List().tag(sync=True)  # records of the chunks run
    done = t.Int(0).tag(sync=True)
    total = t.Int(0).tag(sync=True)
    chunk = t.Int(0).tag(sync=True)
    selected = t.Int(-1).tag(sync=True)


class PrefillView(View):
    """Step a chunked prefill chunk by chunk: ``.step()``, ``.run()`` (or the buttons); a slider selects a
    chunk (and scrubs a linked :class:`KVCacheView` to its checkpoint)."""

    def __init__(self, session, prompt, kv_view: "KVCacheView | None" = None):
        self.session = session
        self.prefill = session.prefill(prompt)
        self.kv_view = kv_view
        ids = self.prefill.ids
        bounds = [[s, e] for s, e in self.prefill.chunk_bounds()]
        self.model = PrefillModel(
            tokens=token_texts(session.model.tokenizer, ids),
            first=self.prefill.position,
            bounds=bounds,
            done=self.prefill.position,
            total=len(ids),
            chunk=session.geometry.step,
        )
        self.step_button = W.Button(description="step", tooltip="run the next chunk")
        self.run_button = W.Button(description="run", tooltip="run every remaining chunk")
        self.slider = W.IntSlider(value=0, min=0, max=max(len(bounds) - 1, 0), description="chunk", disabled=True)
        self.step_button.on_click(lambda _: self.step())
        self.run_button.on_click(lambda _: self.run())
        self.slider.observe(lambda ch: self.select(ch["new"]), names="value")
        self.widget = W.VBox([W.HBox([self.step_button, self.run_button, self.slider]), self.model])
        if kv_view is not None:
            kv_view.refresh()

    def __repr__(self) -> str:
        p = self.prefill
        return f"PrefillView({p.position}/{len(p.ids)} tokens, {len(p.chunks)} chunks run)"

    @property
    def chunks(self):
        return self.prefill.chunks

    def _record(self, chunk) -> dict:
        return dict(
            start=chunk.start,
            end=chunk.end,
            seconds=chunk.seconds,
            tokens_per_s=chunk.tokens_per_s,
            kv_bytes=chunk.kv_bytes,
        )

    def _update(self, chunk) -> None:
        m = self.model
        with m.hold_sync():
            m.chunks = m.chunks + [self._record(chunk)]
            m.done = chunk.end
            m.selected = len(m.chunks) - 1
        self.slider.disabled = False
        self.slider.max = max(len(self.model.bounds) - 1, 0)
        if self.slider.value != m.selected:
            self.slider.value = m.selected  # also selects (and scrubs the KV view)
        elif self.kv_view is not None:
            self.kv_view.refresh()
        self.step_button.disabled = self.run_button.disabled = self.prefill.remaining == 0

    def step(self):
        """Run the next chunk; returns its ``PrefillChunk``."""
        chunk = self.prefill.step()
        self._update(chunk)
        return chunk

    def run(self):
        """Run every remaining chunk, updating the view (and its progress bar) after each."""
        for chunk in self.prefill:
            self._update(chunk)
        return self.prefill.chunks

    def select(self, i: int) -> None:
        if not 0 <= i < len(self.prefill.chunks):
            return
        self.model.selected = i
        if self.kv_view is not None:
            c = self.prefill.chunks[i]
            self.kv_view.show(c.checkpoint, label=f"after chunk {i} (tokens {c.start}–{c.end - 1})")

    def static_html(self) -> str:
        m = self.model
        rows = "".join(
            f"<tr><td><span style='background:{PALETTE[i % len(PALETTE)]}'>&nbsp;&nbsp;</span> {i}</td>"
            f"<td>{c['start']}–{c['end'] - 1}</td><td>{c['end'] - c['start']}</td><td>{c['seconds'] * 1e3:.1f}</td>"
            f"<td>{c['tokens_per_s']:.0f}</td><td>{c['kv_bytes']:,}</td></tr>"
            for i, c in enumerate(m.chunks)
        )
        text, ci = [], 0
        for p, tok in enumerate(m.tokens):
            while ci < len(m.bounds) and p >= m.bounds[ci][1]:
                ci += 1
            bg = PALETTE[ci % len(PALETTE)] if m.first <= p < m.done else "transparent"
            text.append(f"<span style='background:{bg}' title='position {p}'>{html.escape(tok)}</span>")
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>Prefill: {m.done}/{m.total} tokens, "
            f"{len(m.chunks)}/{len(m.bounds)} chunks</b><table><tr><th>chunk</th><th>tokens</th><th>n</th>"
            f"<th>ms</th><th>tok/s</th><th>KV bytes</th></tr>{rows}</table>"
            "<div style='white-space:pre-wrap;max-height:12em;overflow:auto;border:1px solid #ddd'>"
            f"{''.join(text)}</div></div>"
        )


# -- KVCacheView ----------------------------------------------------------------------------------------
def kv_summary(config, geometry, kv: KVView, new_from: int | None = None, label: str = "") -> dict:
    """What the KV view draws, as JSON: per layer the ring's slot → position map, rows, pending tokens, bytes."""
    T = kv.n_tokens
    layers = []
    for lk in kv:
        slots = [-1] * geometry.raw_cap
        for p in range(max(0, T - geometry.raw_cap), T):
            slots[p % geometry.raw_cap] = p
        live = [int(lk.raw_positions[0]), int(lk.raw_positions[-1])] if len(lk.raw_positions) else [T, T - 1]
        R = lk.ratio
        pending = list(range(T - T % R, T)) if R else []
        layers.append(
            dict(
                layer=lk.layer,
                ratio=R,
                bytes=int(lk.nbytes),
                slots=slots,
                live=live,
                evicted=int(live[0]),
                n_comp=lk.n_comp,
                n_index=lk.n_index if config.has_indexer(lk.layer) else None,
                pending=pending,
            )
        )
    return dict(
        n_tokens=T,
        total_bytes=int(kv.nbytes),
        raw_cap=geometry.raw_cap,
        window=geometry.window,
        idx_topk=config.idx_topk,
        new_from=T if new_from is None else new_from,
        label=label,
        layers=layers,
    )


class KVCacheModel(ViewModel):
    _esm = widget_file("kvcache.js")
    data = t.Dict().tag(sync=True)


class KVCacheView(FollowingView):
    """The session's KV state layer by layer. With ``auto_refresh`` (the default) it refreshes itself after
    every prefill chunk and decode step of its session (through ``session.step_observers``); otherwise call
    ``refresh()``. ``show(checkpoint)`` or the slider scrubs through checkpoints without touching the session
    (the next step shows the live state again). The slider always names the state on display: it sits on the
    checkpoint holding the tokens shown, and reads "live" (no number) when no checkpoint of its list does.
    ``detach()`` stops the automatic refresh. A refresh reads the
    whole state (``session.kv``): on a long context that can cost more than the step itself, so pass
    ``auto_refresh=False`` (or ``detach()``) before a long generation."""

    def __init__(self, session, checkpoints=None, auto_refresh: bool = True):
        self.session = session
        self._checkpoints = [getattr(c, "checkpoint", c) for c in checkpoints or []]
        self._shown: tuple[tuple, int] = ((), 0)  # tokens of the state on display, and its first new position
        self._syncing = False  # the slider is being moved to the state on display: do not scrub
        self.model = KVCacheModel()
        self.slider = W.IntSlider(
            value=0,
            min=0,
            max=max(len(self._checkpoints) - 1, 0),
            description="checkpoint",
            disabled=not self._checkpoints,
        )
        self.slider.observe(self._slid, names="value")
        self.widget = W.VBox([self.slider, self.model])
        self.refresh()
        self._follow(auto_refresh)

    def __repr__(self) -> str:
        d = self.model.data
        return f"KVCacheView({d.get('n_tokens', 0)} tokens, {d.get('total_bytes', 0):,} bytes)"

    def _new_from(self, tokens: tuple) -> int:
        """First position to outline as new: the state on display again keeps its outline, an extension of
        it outlines what it adds, anything else is new throughout."""
        shown, new_from = self._shown
        if tokens == shown:
            return new_from
        return len(shown) if tokens[: len(shown)] == shown else 0

    def refresh(self) -> None:
        """Show the session's live state (the cells written since the state shown before outlined)."""
        sess = self.session
        tokens = tuple(sess.tokens)
        new_from = self._new_from(tokens)
        self.model.data = kv_summary(sess.model.config, sess.geometry, sess.kv, new_from, label="live")
        self._shown = (tokens, new_from)
        self._sync_slider()

    def show(self, checkpoint, label: str = "") -> None:
        """Show a checkpoint's state (the session is not changed)."""
        sess = self.session
        cfg, b = sess.model.config, sess.model.backend
        state = checkpoint.state_for(cfg, b, sess.geometry)
        logits = checkpoint.logits if checkpoint.logits is not None else np.zeros(cfg.n_vocab)
        kv = KVView(cfg, state_to_payload(cfg, b, state, checkpoint.tokens, logits))
        tokens = tuple(checkpoint.tokens)
        new_from = self._new_from(tokens)
        self.model.data = kv_summary(
            cfg, sess.geometry, kv, new_from, label=label or f"checkpoint at {len(checkpoint)} tokens"
        )
        self._shown = (tokens, new_from)
        self._sync_slider()

    def scrub_through(self, checkpoints) -> None:
        """Let the slider scrub through ``checkpoints`` (e.g. ``prefill.chunks`` or their ``.checkpoint``); the
        slider moves to the checkpoint of the state on display (after a prefill: the last chunk's)."""
        self._checkpoints = [getattr(c, "checkpoint", c) for c in checkpoints]
        with self._quiet():
            self.slider.max = max(len(self._checkpoints) - 1, 0)
        self.slider.disabled = not self._checkpoints
        self._sync_slider()

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
        """Put the slider on the checkpoint on display, or mark it "live" when the display is none of them."""
        i = self.shown_checkpoint
        with self._quiet():
            if i is not None:
                self.slider.value = i
            self.slider.description = "checkpoint" if i is not None or not self._checkpoints else "live"
            self.slider.readout = i is not None or not self._checkpoints

    def _slid(self, change) -> None:
        if not self._syncing:
            self.scrub(change["new"])

    def scrub(self, i: int) -> None:
        """Show checkpoint ``i`` of the slider's list (and put the slider on it)."""
        if 0 <= i < len(self._checkpoints):
            with self._quiet():
                self.slider.value = i
            self.show(self._checkpoints[i], label=f"checkpoint {i}")

    def static_html(self) -> str:
        d = self.model.data
        rows = "".join(
            f"<tr><td>{L['layer']}</td><td>{L['ratio'] or '—'}</td><td>{L['live'][0]}–{L['live'][1]}</td>"
            f"<td>{L['evicted']}</td><td>{L['n_comp'] if L['ratio'] else ''}</td>"
            f"<td>{'' if L['n_index'] is None else L['n_index']}</td><td>{len(L['pending']) if L['ratio'] else ''}</td>"
            f"<td>{L['bytes']:,}</td></tr>"
            for L in d.get("layers", [])
        )
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>KV cache: {d.get('n_tokens', 0)} tokens, "
            f"{d.get('total_bytes', 0):,} bytes ({d.get('label', '')})</b> — raw ring {d.get('raw_cap')} slots, "
            f"window {d.get('window')}<table><tr><th>layer</th><th>ratio</th><th>raw window</th><th>evicted</th>"
            f"<th>comp rows</th><th>indexer rows</th><th>pending</th><th>bytes</th></tr>{rows}</table></div>"
        )


# -- AttentionView --------------------------------------------------------------------------------------
class AttentionModel(ViewModel):
    _esm = widget_file("attention.js")
    title = t.Unicode("").tag(sync=True)
    buf = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols], weight / vmax · 255, max-pooled
    marks = t.Bytes(b"").tag(sync=True)  # uint8 [rows, cols]: 1 dropped by the indexer, 2 selected
    rows = t.Int(0).tag(sync=True)
    cols = t.Int(0).tag(sync=True)
    row_factor = t.Int(1).tag(sync=True)
    col_factor = t.Int(1).tag(sync=True)
    vmax = t.Float(0.0).tag(sync=True)
    groups = t.List().tag(sync=True)
    row_labels = t.List(t.Unicode()).tag(sync=True)
    col_labels = t.List(t.Unicode()).tag(sync=True)


def _span_label(items, f, fmt) -> list[str]:
    return [fmt(items[i : i + f]) for i in range(0, len(items), f)]


class AttentionView(View):
    """Heatmap of one layer and head of a :class:`ds4lab.hooks.Capture` (or an ``AttentionMap``): queries
    down, keys across in three groups (raw window | compressed rows | sink); max-pooled to at most
    ``max_side`` × ``max_side`` and sent as a uint8 buffer."""

    def __init__(self, source, layer: int | None = None, head: int = 0, max_side: int = MAX_SIDE, tokens=None):
        from ..hooks import AttentionMap, Capture

        self.max_side = max_side
        if isinstance(source, Capture):
            self._maps = {}
            self._capture = source
            self.layers = sorted({int(n.split(".")[1]) for n in source.names if n.endswith(".attn.scores")})
            tok = source.session.model.tokenizer
            self.tokens = token_texts(tok, source.session.tokens) if tokens is None else tokens
        elif isinstance(source, AttentionMap):
            self._maps, self._capture, self.layers = {source.layer: source}, None, [source.layer]
            self.tokens = tokens
        else:
            raise TypeError("AttentionView takes a Capture (with attn.scores) or an AttentionMap")
        if not self.layers:
            raise ValueError("the capture holds no attention maps: capture 'attn.scores'")
        self.layer = self.layers[0] if layer is None else layer
        self.model = AttentionModel()
        amap = self.map(self.layer)
        self.layer_select = W.Dropdown(options=self.layers, value=self.layer, description="layer")
        self.head_select = W.Dropdown(
            options=[int(h) for h in amap.heads],
            value=int(amap.heads[head]) if head < len(amap.heads) else int(amap.heads[0]),
            description="head",
        )
        self.head = self.head_select.value
        self.layer_select.observe(lambda ch: self.show(ch["new"], self.head), names="value")
        self.head_select.observe(lambda ch: self.show(self.layer, ch["new"]), names="value")
        self.widget = W.VBox([W.HBox([self.layer_select, self.head_select]), self.model])
        self.show(self.layer, self.head)

    def __repr__(self) -> str:
        m = self.model
        return (f"AttentionView(layer {self.layer}, head {self.head}: {m.rows}×{m.cols} cells, "
                f"pooled ×{m.row_factor}/×{m.col_factor})")

    def map(self, layer: int):
        if layer not in self._maps:
            self._maps[layer] = self._capture.attention(layer)
        return self._maps[layer]

    def _tok(self, p: int) -> str:
        if self.tokens is None or not 0 <= p < len(self.tokens):
            return ""
        return " " + repr(self.tokens[p])

    def reduced(self, layer: int, head: int):
        """(uint8 [rows, cols], marks [rows, cols], row factor, col factor, vmax, groups) for one head."""
        amap = self.map(layer)
        h = int(np.nonzero(amap.heads == head)[0][0])
        w = amap.weights[:, h, :]
        groups = [("raw", amap.n_raw), ("comp", amap.n_comp), ("sink", 1)]
        red, fr, fc, spans = reduce_groups(w, groups, self.max_side, self.max_side)
        img, vmax = to_uint8(red)
        mark = np.zeros(w.shape)
        mark[:, amap.groups["comp"]] = np.where(amap.selected, 2, np.where(amap.candidates, 1, 0))
        mred, _, _, _ = reduce_groups(mark, groups, self.max_side, self.max_side)
        return img, np.maximum(mred, 0).astype(np.uint8), fr, fc, vmax, spans

    def show(self, layer: int, head: int) -> None:
        amap = self.map(layer)
        if head not in amap.heads:
            head = int(amap.heads[0])
        self.layer, self.head = layer, head
        img, marks, fr, fc, vmax, spans = self.reduced(layer, head)
        qs = [int(q) for q in amap.queries]
        row_labels = _span_label(
            qs, fr, lambda b: f"query {b[0]}{self._tok(b[0])}" if len(b) == 1 else f"queries {b[0]}–{b[-1]}"
        )
        raw = [int(p) for p in amap.raw_positions]
        win = amap.comp_windows
        col_labels = (
            _span_label(raw, fc, lambda b: f"raw t{b[0]}{self._tok(b[0])}" if len(b) == 1 else f"raw t{b[0]}–t{b[-1]}")
            + _span_label(
                list(range(amap.n_comp)),
                fc,
                lambda b: (
                    f"comp row {b[0]} (tokens {win[b[0]][0]}–{win[b[0]][1]})"
                    if len(b) == 1
                    else f"comp rows {b[0]}–{b[-1]} (tokens {win[b[0]][0]}–{win[b[-1]][1]})"
                ),
            )
            + ["sink"]
        )
        m = self.model
        with m.hold_sync():
            m.title = (
                f"layer {layer} (ratio {amap.ratio or '—'}), head {head}: {len(qs)} queries × "
                f"{amap.n_raw} raw | {amap.n_comp} compressed | sink"
            )
            m.rows, m.cols = img.shape
            m.row_factor, m.col_factor, m.vmax = fr, fc, vmax
            m.groups = [dict(name=n, start=s, stop=e) for n, s, e in spans]
            m.row_labels, m.col_labels = row_labels, col_labels
            m.buf, m.marks = img.tobytes(), marks.tobytes()

    def static_html(self) -> str:
        m = self.model
        img = np.frombuffer(m.buf, np.uint8).reshape(m.rows, m.cols)
        rgb = colormap(img)
        marks = np.frombuffer(m.marks, np.uint8).reshape(m.rows, m.cols)
        rgb[(marks == 1) & (img == 0)] = (252, 187, 161)
        scale = max(1, min(6, 720 // max(m.rows, m.cols, 1)))
        groups = " | ".join(f"{g['name']} {g['stop'] - g['start']}" for g in m.groups)
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>{html.escape(m.title)}</b><br>"
            f"<img alt='attention heatmap' style='image-rendering:pixelated;width:{m.cols * scale}px;"
            f"height:{m.rows * scale}px' src='data:image/png;base64,{png_base64(rgb)}'/><br>"
            f"{m.rows}×{m.cols} cells, max-pooled ×{m.row_factor} queries ×{m.col_factor} keys; weight 0…{m.vmax:.3g}; "
            f"columns: {groups}</div>"
        )

    def _repr_png_(self):
        from .reduce import png_bytes

        img = np.frombuffer(self.model.buf, np.uint8).reshape(self.model.rows, self.model.cols)
        return png_bytes(colormap(img))
