"""PrefillView: one stepper for a chunked prefill — step / run / scrub the chunks, the prompt with the chunk shown
highlighted, and beside it the KV cache after that chunk and the mask of what its queries see in one layer
(front-end ``widgets/prefill.js``, with :class:`~ds4lab.viz.kv_view.KVCacheView` and
:class:`~ds4lab.viz.mask_view.MaskView`)."""

from __future__ import annotations

import html

import ipywidgets as W
import traitlets as t

from ..config import is_int
from ..text_table import layer_kind
from ..visibility import key_groups, step_mask
from . import palette
from .base import View, ViewModel, check_session, token_texts, widget_module
from .kv_view import KVCacheView, state_label
from .mask_view import PREFILL_SIZE_PX, MaskView

# The chunks in the prompt: bands of two greys in turn. Every hue means something in the views beside them (blue
# the raw window, green the compressed rows, salmon dropped, yellow pending, orange written by the chunk shown), so
# a chunk tinted blue or green read as one of those; the chunk's number is in the table and the tooltip.
PALETTE = ["#e0e0e0", "#b9b9b9"]  # apart enough on a projector


class PrefillModel(ViewModel):
    _esm = widget_module("prefill.js", "hovertip.js", "text.js")
    chunk_colours = t.List(t.Unicode(), PALETTE).tag(sync=True)  # shared with the fallback (static_html)
    tokens = t.List(t.Unicode()).tag(sync=True)
    first = t.Int(0).tag(sync=True)  # position the prefill starts from (earlier tokens were reused)
    bounds = t.List().tag(sync=True)  # [[start, end], ...] of every chunk, run or planned
    chunks = t.List().tag(sync=True)  # records of the chunks run
    done = t.Int(0).tag(sync=True)
    total = t.Int(0).tag(sync=True)
    chunk = t.Int(0).tag(sync=True)
    selected = t.Int(-1).tag(sync=True)  # the chunk shown (-1: none run yet)
    pick_request = t.Int(-1).tag(sync=True)  # a chunk's row clicked in the table (-1 again once it is shown)
    note = t.Unicode("").tag(sync=True)  # why a step did nothing (all run; the session moved on)


def default_layer(config) -> int:
    """The layer a PrefillView shows first: one with the indexer (the richest mask), else compressed, else 0."""
    layers = range(config.n_layer)
    return next((i for i in layers if config.has_indexer(i)), next((i for i in layers if config.ratio(i)), 0))


class PrefillView(View):
    """Step a chunked prefill chunk by chunk: ``.step()``, ``.run()`` (or the buttons); the slider scrubs the
    chunks run, one control for the title, the table, the prompt, the KV cache and the mask together.
    The chunk table beside the prompt; under them, side by side where both fit, the KV cache after the chunk shown
    (``kv_view``, made here compact and without a slider of its own unless given; a view given keeps its slider,
    and moved onto one of the chunks it moves this view) with the rows it wrote marked, and the mask of what
    each of its queries sees in ``layer`` (``mask_view``; the layer picker changes it). The indexer's choices are
    captured while stepping (``capture_indexer``).

    The widget and code cells drive one prefill: ``step()`` once every chunk is run returns the last chunk and
    says so in the view; once the session moved on (a decode, another prefill) the view can only scrub."""

    def __init__(self, session, prompt, kv_view=None, layer: int | None = None, capture_indexer: bool = True):
        check_session(session, "PrefillView")
        cfg = session.model.config
        # every argument checked before session.prefill, which moves the session onto the prompt
        self.layer = default_layer(cfg) if layer is None else cfg.check_layer(layer)
        if kv_view is not None and not (isinstance(kv_view, KVCacheView) and kv_view.session is session):
            raise ValueError("kv_view must be a KVCacheView of this session (KVCacheView(session, ...)), got "
                             f"{type(kv_view).__name__}" + (" of another session" if isinstance(kv_view, KVCacheView)
                                                            else ""))
        self.session = session
        self.prefill = session.prefill(prompt)
        if not self.prefill.remaining:  # a view of no chunk could never step: say why now, not at the first step
            raise ValueError(f"the session already holds all {len(self.prefill.ids)} tokens of this prompt: nothing "
                             "to prefill; step it on a new session (model.session(...)) or a longer prompt")
        self._indexer_layers = [i for i in range(cfg.n_layer) if cfg.has_indexer(i)] if capture_indexer else []
        self._topk: list[dict] = []  # per chunk run: layer -> its captured indexer.topk
        bounds = [[s, e] for s, e in self.prefill.chunk_bounds()]
        self.model = PrefillModel(
            tokens=token_texts(session.model.tokenizer, self.prefill.ids),
            first=self.prefill.position,
            bounds=bounds,
            done=self.prefill.position,
            total=len(self.prefill.ids),
            chunk=session.geometry.step,
        )
        # the KV view made here has no slider of its own: its states are the chunks, and the slider "show" above
        # drives it with the prompt, the table and the mask (two sliders would let them show different chunks)
        self.kv_view = kv_view if kv_view is not None else KVCacheView(session, layers=[self.layer], slider=False,
                                                                       indexer=self.picked_rows, compact=True)
        self._own_kv = kv_view is None
        if not self._own_kv:  # a view given keeps its slider: moved onto one of these chunks, the whole view follows
            self.kv_view.slider.observe(self.guarded(self._kv_slid), names="value")
        start, end = bounds[0]
        self.mask_view = MaskView(step_mask(cfg, session.geometry, self.layer, start, end - start),
                                  label=f"chunk 0 (tokens {start}–{end - 1}), not run yet", size_px=PREFILL_SIZE_PX)
        self._plan_mask()
        # the controls' widths: one line of them fits an output of 960 px (JupyterLab at 1400 px); narrower, it wraps
        narrow = {"description_width": "40px"}
        self.step_button = W.Button(description="step", tooltip="run the next chunk", layout=W.Layout(width="90px"))
        self.run_button = W.Button(description="run", tooltip="run every remaining chunk",
                                   layout=W.Layout(width="90px"))
        self.slider = W.IntSlider(value=0, min=0, max=0, description="show", readout=False, disabled=True,
                                  style=narrow, layout=W.Layout(width="260px"))
        self.state = W.HTML("<span class='ds4-note'>no chunk run yet</span>",
                            layout=W.Layout(width="290px", overflow="hidden"))
        self.layer_pick = W.Dropdown(options=[(self._layer_name(cfg, i), i) for i in range(cfg.n_layer)],
                                     value=self.layer, description="layer", style=narrow,
                                     layout=W.Layout(width="210px"))
        self.step_button.on_click(self.guarded(lambda _: self.step()))
        self.run_button.on_click(self.guarded(lambda _: self.run()))
        self.slider.observe(self.guarded(lambda ch: self.select(ch["new"])), names="value")
        self.model.observe(self.guarded(self._on_pick), names="pick_request")
        self.layer_pick.observe(self.guarded(lambda ch: self.show_layer(ch["new"])), names="value")
        # rows that wrap where the output is too narrow for them (a laptop with the file browser open), nothing cut
        # off (views.css, .ds4-beside); the KV cache and the mask wrap in reverse, so the mask's line goes over the
        # KV cache's, close under the slider that scrubs it (under the taller KV cache it was 850 px down, out of
        # view while scrubbing); in reverse, flex-end is the lines' top
        controls = W.HBox([self.step_button, self.run_button, self.slider, self.state, self.layer_pick],
                          layout=W.Layout(flex_flow="row wrap"))
        beside = W.HBox([self.kv_view.widget, self.mask_view.widget],
                        layout=W.Layout(flex_flow="row wrap-reverse", align_items="flex-end"))
        beside.add_class("ds4-beside")
        self.widget = W.VBox([controls, self.model, beside])
        self._buttons()

    @staticmethod
    def _layer_name(cfg, i: int) -> str:
        return f"{i}: {layer_kind(cfg.ratio(i))}" + (", indexer" if cfg.has_indexer(i) else "")

    def __repr__(self) -> str:
        p = self.prefill
        return f"PrefillView({self.model.done}/{len(p.ids)} tokens, {len(p.chunks)} chunks run)"

    @property
    def chunks(self):
        return self.prefill.chunks

    def _moved_on(self) -> bool:
        tokens = self.session.tokens
        return list(tokens) != self.prefill.ids[: len(tokens)]

    def picked_rows(self, layer: int, position: int):
        """The rows the indexer of ``layer`` let the query at ``position`` attend, from the chunk of this view that
        ran it, or None where no chunk here captured it. Given as a KVCacheView's ``indexer=``, it marks them for
        a state's last query, as this view's own KV view does."""
        for c, topk in zip(self.prefill.chunks, self._topk):
            if c.start <= position < c.end and layer in topk:
                return topk[layer][position - c.start]
        return None

    def _buttons(self) -> None:
        done = self.prefill.remaining <= 0 or self._moved_on()
        self.step_button.disabled = self.run_button.disabled = done

    def _refuse(self, why: str):
        """A step this view cannot run: ``why`` in the view, its buttons off, raised (in the widget, the error line)."""
        self.model.note = why
        self._buttons()
        raise RuntimeError(why)

    def _run_one(self):
        if self._moved_on():
            self._refuse(f"the session moved on ({len(self.session.tokens)} tokens, not this prompt's first ones): "
                         "this view can only scrub the chunks it ran")
        if self._indexer_layers:
            with self.session.capture(["indexer.topk"], layers=self._indexer_layers) as cap:
                chunk = self.prefill.step()
            self._topk.append({i: cap[f"blk.{i}.indexer.topk"] for i in self._indexer_layers
                               if f"blk.{i}.indexer.topk" in cap})
        else:
            chunk = self.prefill.step()
            self._topk.append({})
        m = self.model
        with m.hold_sync():
            m.chunks = m.chunks + [self._record(chunk)]
            m.done = chunk.end
            m.note = ""
        return chunk

    def _record(self, chunk) -> dict:
        return dict(start=chunk.start, end=chunk.end, seconds=chunk.seconds, tokens_per_s=chunk.tokens_per_s,
                    kv_bytes=chunk.kv_bytes)

    def _all_run(self):
        """Every chunk is run: the last one, said in the view (a step then is no error: the widget's run and a
        code cell's step may both have been asked)."""
        n = len(self.prefill.chunks)
        if not n:  # the session took the whole prompt after this view was made (another prefill of it): none ran here
            self._refuse(f"the session holds this prompt's {len(self.prefill.ids)} tokens, prefilled elsewhere: this "
                         "view ran none of its chunks")
        self.model.note = f"all {n} chunks are run: showing {self._label(n - 1)}"
        self.select(n - 1)
        return self.prefill.chunks[-1]

    def step(self):
        """Run the next chunk and show it; returns its ``PrefillChunk`` (the last one once all are run)."""
        if self.prefill.remaining <= 0:
            return self._all_run()
        chunk = self._run_one()
        self._show_latest()
        return chunk

    def run(self):
        """Run every remaining chunk, then show the last; returns every chunk record."""
        if self.prefill.remaining <= 0:
            self._all_run()
            return self.prefill.chunks
        while self.prefill.remaining > 0:
            self._run_one()
        self._show_latest()
        return self.prefill.chunks

    def _show_latest(self) -> None:
        n = len(self.prefill.chunks)
        self.slider.max = max(n - 1, 0)
        self.slider.disabled = n < 2
        if self._own_kv or not self.kv_view.checkpoints:
            self.kv_view.scrub_through(self.prefill.chunks)
        self.select(n - 1)
        self._buttons()

    def _kv_slid(self, change) -> None:
        """The slider of a KV view given moved: when it shows one of this prefill's chunks, show that chunk."""
        cps = self.kv_view.checkpoints
        if not 0 <= change["new"] < len(cps):
            return
        i = next((j for j, c in enumerate(self.prefill.chunks) if c.checkpoint is cps[change["new"]]), None)
        if i is not None and i != self.model.selected:
            self.select(i)

    def _on_pick(self, change) -> None:
        """A run chunk's row clicked: shown, as the slider shows it."""
        if change["new"] >= 0:
            self.model.pick_request = -1
            if change["new"] < len(self.prefill.chunks):
                self.select(change["new"])

    def _label(self, i: int) -> str:
        c = self.prefill.chunks[i]
        return state_label(i, c.start, c.end)

    def select(self, i: int) -> None:
        """Show the state after chunk ``i`` (of those run): the prompt's chunk, the KV cache, the mask."""
        if not is_int(i):
            raise TypeError(f"select takes a chunk's number, got {i!r}")
        if not 0 <= i < len(self.prefill.chunks):
            raise IndexError(f"chunk {i} is not run: {len(self.prefill.chunks)} chunks of this prefill are")
        c = self.prefill.chunks[i]
        self.model.selected = i
        if self.slider.value != i:
            self.slider.value = i  # its observer comes back here with the same i
            return
        self.state.value = f"<b style='white-space:nowrap'>{html.escape(self._label(i))}</b>"
        self.kv_view.show(c.checkpoint, label=self._label(i), new_from=c.start)
        self._show_mask()

    def show_layer(self, layer: int) -> None:
        """Draw ``layer`` in the mask (and in the KV view made here)."""
        self.layer = self.session.model.config.check_layer(layer)
        if self.layer_pick.value != self.layer:
            self.layer_pick.value = self.layer
        if self._own_kv:
            self.kv_view.model.layers = [self.layer]
        self._show_mask()

    def _plan_mask(self) -> None:
        """Size the mask for every chunk of every layer (its cells and its image), so scrubbing the chunks and
        picking another layer keep both: a layer's triangles drawn at the scale of the others'."""
        cfg, geometry = self.session.model.config, self.session.geometry
        self.mask_view.model.plan = [key_groups(cfg, geometry, il, s, e - s) for il in range(cfg.n_layer)
                                     for s, e in self.model.bounds]

    def _show_mask(self) -> None:
        i = self.model.selected
        sess = self.session
        if i < 0:
            m = self.mask_view.mask
            self.mask_view.show(step_mask(sess.model.config, sess.geometry, self.layer, m.pos0, len(m.queries)),
                                self.mask_view.model.label)
            return
        c = self.prefill.chunks[i]
        mask = step_mask(sess.model.config, sess.geometry, self.layer, c.start, c.n_tokens,
                         self._topk[i].get(self.layer))
        self.mask_view.show(mask, label=f"chunk {i} (tokens {c.start}–{c.end - 1})")

    def static_html(self) -> str:
        m = self.model
        mark = f" style='font-weight:600;text-decoration:underline 2px {palette.ACCENT}'"  # the chunk shown, as live
        rows = "".join(
            f"<tr{mark if i == m.selected else ''}><td><span style='background:"
            f"{PALETTE[i % len(PALETTE)]}'>&nbsp;&nbsp;</span> {i}</td>"
            f"<td>{c['start']}–{c['end'] - 1}</td><td>{c['end'] - c['start']}</td><td>{c['seconds'] * 1e3:.1f}</td>"
            f"<td>{c['tokens_per_s']:.0f}</td><td>{c['kv_bytes']:,}</td></tr>"
            for i, c in enumerate(m.chunks)
        )
        text, ci = [], 0
        for p, tok in enumerate(m.tokens):
            while ci < len(m.bounds) and p >= m.bounds[ci][1]:
                ci += 1
            bg = PALETTE[ci % len(PALETTE)] if m.first <= p < m.done else "transparent"
            cur = f";text-decoration:underline 2px {palette.ACCENT}" if ci == m.selected else ""  # the chunk shown
            text.append(f"<span style='background:{bg}{cur}' title='position {p}'>{html.escape(tok)}</span>")
        shown = " · shown: " + html.escape(self._label(m.selected)) if m.selected >= 0 else ""
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>Prefill: {m.done}/{m.total} tokens, "
            f"{len(m.chunks)}/{len(m.bounds)} chunks run{shown}</b><table><tr><th>chunk</th><th>tokens</th><th>n</th>"
            f"<th>ms</th><th>tok/s</th><th>KV bytes</th></tr>{rows}</table>"
            "<div style='white-space:pre-wrap;max-height:8em;overflow:auto;border:1px solid #ddd'>"
            f"{''.join(text)}</div><div style='display:flex;gap:12px;align-items:flex-start'>"
            f"{self.kv_view.static_html()}{self.mask_view.static_html()}</div></div>"
        )
