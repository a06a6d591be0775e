"""PrefillView: step a chunked prefill chunk by chunk, the prompt coloured by chunk (front-end
``widgets/prefill.js``)."""

from __future__ import annotations

import html

import ipywidgets as W
import traitlets as t

from .base import View, ViewModel, token_texts, widget_file

PALETTE = ["#c6dbef", "#c7e9c0", "#fdd0a2", "#dadaeb", "#fcbba1", "#d9d9d9", "#9ecae1", "#a1d99b"]


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

    def __init__(self, session, prompt, kv_view=None):
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
