"""TierView: the session's placement (embedding, layers, head coloured by tier), the tier switches of the
last step, and the bytes each step moved between tiers against what a full chunk would move. Front-end:
``widgets/tiers.js``."""

from __future__ import annotations

import html
import math

import ipywidgets as W
import numpy as np
import traitlets as t

from ..text_table import plural
from ..tiers import EMBED, unit_name
from .base import FollowingView, ViewModel, check_session, widget_module
from .palette import BATCH, DECODE, rgb
from .reduce import png_base64

# Pale tan, pink and grey, then paler and darker twins: no hue of a kind of row (palette.py: a teal read as green),
# and black text reads on each
TIER_PALETTE = ["#dfc27d", "#f1b6da", "#d9d9d9", "#f6e8c3", "#fde0ef", "#bababa", "#c7b299", "#e9a3c9"]
# the bounds' lines: black, dashed and dotted (a decode step's bars reach its bound: a grey line there was lost)
BATCH_BOUND, DECODE_BOUND = "#000000", "#000000"
NONE = "#d9d9d9"  # a step that moved nothing: a stub on the x axis
MAX_STEPS = 200  # steps kept for the bytes-per-step chart


def tier_colour(tier: int) -> str:
    return TIER_PALETTE[tier % len(TIER_PALETTE)]


def _budget(b) -> str:
    return "-" if b is None else f"{b:,}"


def _part_note(part: str) -> str:
    return (f"this process: {part}; the dashed units run in the other processes, which send the hidden state "
            "on at each switch")


def _switch_record(s, n_layer: int) -> dict:
    return dict(step=s.step, layer=s.layer, unit=unit_name(s.layer, n_layer), from_tier=s.from_tier,
                to_tier=s.to_tier, mode=s.mode, bytes=int(s.bytes), seconds=float(s.seconds))


class TierModel(ViewModel):
    _esm = widget_module("tiers.js", "hovertip.js", "text.js")
    rule = t.Unicode("").tag(sync=True)
    part = t.Unicode("").tag(sync=True)  # a plan over processes: this rank and its units ("" in one process)
    units = t.List().tag(sync=True)  # placement.table() rows with their colour and whether this process runs them
    tiers = t.List().tag(sync=True)  # per tier: device, weights, kv, activations, total, budget, colour
    boundaries = t.Int(0).tag(sync=True)  # copying switches per step
    row_bytes = t.Int(0).tag(sync=True)  # one token's hidden state: n_hc × n_embd floats
    chunk = t.Int(0).tag(sync=True)  # the prefill chunk (rows of a batch switch at most)
    last_step = t.Int(-1).tag(sync=True)
    trace = t.List().tag(sync=True)  # the last step's switches
    steps = t.List().tag(sync=True)  # per step: step, bytes, seconds, switches, copies, mode (latest MAX_STEPS)


class TierView(FollowingView):
    """The layer stack of ``session.placement`` coloured by tier, the switch trace of the last step (from
    ``session.tier_trace``) and the bytes moved per step, drawn against ``boundaries × chunk × row_bytes`` (a
    batch step of a full chunk) and ``boundaries × row_bytes`` (a decode step).

    ``refresh()`` reads the steps run since; with ``follow=True`` the view does it after every
    step of its session. ``steps`` (the trait) holds the latest ``MAX_STEPS`` steps, including steps that
    switched nothing (0 bytes).
    """

    def __init__(self, session, follow: bool = False):
        check_session(session, "TierView")
        self.session = session
        p = session.placement
        cfg = session.model.config
        self.n_layer = cfg.n_layer
        self._seen = -1  # last step read from the trace
        self._totals: dict[int, dict] = {}
        itemsize = np.dtype(session.model.backend.np_dtype).itemsize
        here = [p.is_local(m.tier) for m in p.memory]  # over processes, this rank's tier only
        self.model = TierModel(
            rule=p.rule,
            part=p.part or "",
            units=[dict(row, colour=tier_colour(row["tier"]), here=here[row["tier"]]) for row in p.table()],
            tiers=[dict(tier=m.tier, device=m.device, weights=m.weights, kv=m.kv, activations=m.activations,
                        total=m.total, budget=m.budget, colour=tier_colour(m.tier), here=here[m.tier])
                   for m in p.memory],
            boundaries=p.boundaries,
            row_bytes=cfg.n_hc * cfg.n_embd * itemsize,
            chunk=session.geometry.step,
        )
        self.refresh_button = W.Button(description="refresh", tooltip="read the steps run since")
        self.refresh_button.on_click(self.guarded(lambda _: self.refresh()))
        self.widget = W.VBox([self.refresh_button, self.model])
        self.refresh()
        self._follow(follow)

    def _follow(self, follow: bool) -> None:
        super()._follow(follow)
        self._show_following(follow)

    def detach(self) -> None:
        super().detach()
        self._show_following(False)

    def _show_following(self, follow: bool) -> None:
        """A following view redraws after every step: its button, with nothing left to read, says so instead."""
        self.refresh_button.disabled = follow
        self.refresh_button.description = "following" if follow else "refresh"
        self.refresh_button.tooltip = "redrawn after each step of the session" if follow else "read the steps run since"

    def __repr__(self) -> str:
        m = self.model
        return (f"TierView({m.rule}: {plural(len(m.tiers), 'tier')}, {plural(m.boundaries, 'boundary', 'boundaries')}, "
                f"last step {m.last_step})")

    @property
    def batch_bound(self) -> int:
        """Bytes a batch step of a full chunk copies: one chunk of hidden states per boundary."""
        return self.model.boundaries * self.model.chunk * self.model.row_bytes

    @property
    def decode_bound(self) -> int:
        """Bytes a decode step copies: one token's hidden state per boundary."""
        return self.model.boundaries * self.model.row_bytes

    def refresh(self) -> None:
        """Read the switches of the steps run since the last refresh."""
        sess = self.session
        new = []
        for s in reversed(sess.tier_trace):
            if s.step <= self._seen:
                break
            new.append(s)
        new.reverse()
        last = sess.tier_steps - 1
        if last <= self._seen:
            return
        first = max(self._seen + 1, last + 1 - MAX_STEPS)
        for step in range(first, last + 1):
            self._totals[step] = dict(step=step, bytes=0, seconds=0.0, switches=0, copies=0, mode="none")
        for s in new:
            d = self._totals.get(s.step)
            if d is None:
                continue
            d["bytes"] += int(s.bytes)
            d["seconds"] += float(s.seconds)
            d["switches"] += 1
            if s.mode != "no-copy":
                d["copies"] += 1
                d["mode"] = s.mode
            elif d["mode"] == "none":
                d["mode"] = "no-copy"
        for step in [k for k in self._totals if k < last + 1 - MAX_STEPS]:
            del self._totals[step]
        self._seen = last
        m = self.model
        with m.hold_sync():
            m.last_step = last
            m.trace = [_switch_record(s, self.n_layer) for s in new if s.step == last]
            m.steps = [dict(d) for d in self._totals.values()]

    def image(self, height: int = 120, width: int = 480) -> np.ndarray:
        """Bytes per step as bars (batch dark grey, decode grey; a step that moved nothing a pale stub) on a log y axis
        from :meth:`image_range`'s bottom to its top (as the live chart's: a decode step's bytes are a chunk's
        /64 on Flash, lost on a linear axis), black lines at the batch and the decode bounds, ``width`` pixels shared
        by the steps."""
        steps = self.model.steps
        lo, top = self.image_range()
        bw = max(1, width // max(len(steps), 1))
        img = np.full((height + 1, max(len(steps), 1) * bw, 3), 255, np.uint8)
        colours = {"batch": rgb(BATCH), "decode": rgb(DECODE)}

        def y(b):  # pixels above the x axis
            return int(round(height * (math.log2(b) - math.log2(lo)) / (math.log2(top) - math.log2(lo))))

        for i, d in enumerate(steps):
            h = y(d["bytes"]) if d["bytes"] > 0 else 2
            colour = colours.get(d["mode"], rgb(NONE)) if d["bytes"] > 0 else rgb(NONE)
            img[height - h : height, i * bw : i * bw + max(bw - (bw > 2), 1)] = colour
        for b, colour in ((self.batch_bound, rgb(BATCH_BOUND)), (self.decode_bound, rgb(DECODE_BOUND))):
            if b:
                img[height - y(b), :] = colour
        img[height, :] = (120, 120, 120)
        return img

    def image_range(self) -> tuple[int, int]:
        """The bytes at the bottom and top of :meth:`image`'s log y axis: powers of two around the bounds and the
        steps (below the smallest by one, above the largest with room), like the live chart's axis (which also
        snaps them to its tick step)."""
        values = [v for v in (self.batch_bound, self.decode_bound, *(d["bytes"] for d in self.model.steps)) if v > 0]
        e0 = math.floor(math.log2(min(values, default=1))) - 1
        e1 = max(math.ceil(math.log2(max(values, default=2) * 1.2)), e0 + 1)
        return 2 ** e0, 2 ** e1

    def stack_html(self) -> str:
        """The units as coloured spans, in order, with the last step's switches between them."""
        by_unit = {}
        for s in self.model.trace:
            by_unit.setdefault(s["layer"], []).append(s)
        out = []
        for u in self.model.units:
            for s in by_unit.get(u["layer"], []):
                colour = "#737373" if s["mode"] == "no-copy" else "#252525"
                out.append(f"<span style='color:{colour}'> →{s['mode']} {s['bytes']:,} B→ </span>")
            label = u["unit"] if u["layer"] in (EMBED, self.n_layer) else f"L{u['layer']}"
            away = "" if u["here"] else ";opacity:0.45;border-style:dashed"  # run by another process
            out.append(f"<span data-unit='{u['layer']}' data-tier='{u['tier']}' style='background:{u['colour']};"
                       f"border:1px solid #999;padding:1px 4px{away}' title='{html.escape(u['unit'])}: "
                       f"tier {u['tier']} ({html.escape(u['device'])})'>{html.escape(label)}</span>")
        return " ".join(out)

    def static_html(self) -> str:
        m = self.model
        lo, top = self.image_range()
        mine = " (this process)" if m.part else ""
        tiers = "".join(
            f"<tr><td><span style='background:{d['colour']}'>&nbsp;&nbsp;</span> {d['tier']}</td>"
            f"<td>{html.escape(d['device'])}{mine if d['here'] else ''}</td><td>{d['weights']:,}</td>"
            f"<td>{d['kv']:,}</td>"
            f"<td>{d['activations']:,}</td><td>{d['total']:,}</td><td>{_budget(d['budget'])}</td></tr>"
            for d in m.tiers
        )
        trace = "".join(
            f"<tr><td>{s['unit']}</td><td>{s['from_tier']} → {s['to_tier']}</td><td>{s['mode']}</td>"
            f"<td>{s['bytes']:,}</td><td>{s['seconds'] * 1e6:.0f}</td></tr>"
            for s in m.trace
        ) or "<tr><td colspan='5'>no switches</td></tr>"
        steps = "".join(
            f"<tr><td>{d['step']}</td><td>{d['mode']}</td><td>{d['copies']}</td><td>{d['bytes']:,}</td>"
            f"<td>{d['bytes'] // (d['copies'] * m.row_bytes) if d['copies'] else 0}</td>"
            f"<td>{d['bytes'] / self.batch_bound if self.batch_bound else 0:.3f}</td></tr>"
            for d in m.steps[-12:]
        )
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>Tiers: {html.escape(m.rule)}, "
            f"{plural(len(m.tiers), 'tier')}, "
            f"{plural(m.boundaries, 'copying boundary', 'copying boundaries')} per step</b>"
            + (f"<div>{html.escape(_part_note(m.part))}</div>" if m.part else "")
            + f"<div style='margin:4px 0;line-height:2'>{self.stack_html()}</div>"
            "<table><tr><th>tier</th><th>device</th><th>weights</th><th>KV</th><th>activations</th><th>total</th>"
            f"<th>budget</th></tr>{tiers}</table>"
            f"<b>last step ({m.last_step}) switches</b><table><tr><th>before</th><th>tiers</th><th>mode</th>"
            f"<th>bytes</th><th>µs</th></tr>{trace}</table>"
            f"<b>bytes moved per step</b> (a dark grey bar a prefill chunk's copies, a grey one a decode step's; "
            f"upper line: a full chunk, "
            f"{plural(m.chunk, 'row')} × {m.row_bytes:,} B"
            f" × {plural(m.boundaries, 'boundary', 'boundaries')} = {self.batch_bound:,} B; lower line: a decode "
            f"step, {self.decode_bound:,} B)<br>"
            f"<div style='display:flex;align-items:stretch;gap:4px'><div style='display:flex;flex-direction:column;"
            f"justify-content:space-between;text-align:right'><span>{top:,} B</span><span>bytes moved"
            f"<br>(log)</span><span>{lo:,} B</span></div>"
            f"<img alt='bytes per step' src='data:image/png;base64,{png_base64(self.image())}'/>"
            f"</div><div>steps {m.steps[0]['step'] if m.steps else 0} … {m.last_step}, one bar each</div>"
            "<table><tr><th>step</th><th>mode</th><th>copies</th><th>bytes</th><th>rows per copy</th>"
            f"<th>of full chunk</th></tr>{steps}</table></div>"
        )
