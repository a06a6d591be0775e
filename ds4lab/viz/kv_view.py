"""KVCacheView: a session's KV state layer by layer — the raw ring, compressed and indexer rows, pending tokens
(front-end ``widgets/kvcache.js``)."""

from __future__ import annotations

import contextlib

import ipywidgets as W
import numpy as np
import traitlets as t

from ..kv.checkpoint import state_to_payload
from ..kv.view import KVView
from .base import FollowingView, ViewModel, widget_file


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
