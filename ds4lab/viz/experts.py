"""ExpertView: the router's choices layer by layer, as a histogram of tokens per expert, from a capture of
``blk.{il}.moe.experts``. Hash layers (the first ``n_hash_layer``) route by a fixed table indexed by the token
id, the others by the learned router's top-k; the view marks which is which. Front-end: ``widgets/experts.js``."""

from __future__ import annotations

import html
from collections import Counter

import ipywidgets as W
import numpy as np
import traitlets as t

from ..session import check_token_ids
from . import palette
from .base import View, ViewModel, token_texts, widget_module
from .reduce import png_base64

HASH_COLOUR, LEARNED_COLOUR = palette.rgb(palette.HASH_ROUTED), palette.rgb(palette.LEARNED_ROUTED)


def expert_counts(capture, n_expert: int | None = None) -> dict[int, np.ndarray]:
    """Tokens routed to each expert, per layer captured at ``blk.{il}.moe.experts``: ``{layer: int64
    [n_expert]}``, a token counted once for each distinct expert it was routed to."""
    n_expert = capture.cfg.n_expert if n_expert is None else n_expert
    out = {}
    for name in capture.names:
        if not name.endswith(".moe.experts"):
            continue
        experts = np.asarray(capture[name], dtype=np.int64).reshape(-1, np.shape(capture[name])[-1])
        routed = np.zeros((len(experts), n_expert), bool)
        routed[np.arange(len(experts))[:, None], experts] = True
        out[int(name.split(".")[1])] = routed.sum(axis=0).astype(np.int64)
    return dict(sorted(out.items()))


def capture_prefill(session, prompt, layers=None):
    """Prefill ``prompt`` on ``session`` inside a capture of ``moe.experts`` and return the capture. Only the
    tokens the prefill evaluates are captured: a prompt that extends the session's live tokens runs (and
    captures) its new suffix only."""
    with session.capture(["moe.experts"], layers=layers) as cap:
        session.prefill(prompt).run(progress=False)
    return cap


class ExpertModel(ViewModel):
    _esm = widget_module("experts.js", "hovertip.js")
    n_expert = t.Int(0).tag(sync=True)
    k = t.Int(0).tag(sync=True)  # experts per token
    layers = t.List().tag(sync=True)  # [{layer, hash, n_tokens, counts [n_expert], top: [[[text, n], ...] per expert]}]
    show = t.Unicode("all").tag(sync=True)  # "all", "hash" or "learned" layers
    common_scale = t.Bool(True).tag(sync=True)  # one y scale for every layer, or each layer its own


class ExpertView(View):
    """Tokens routed to each expert, one histogram per layer (hash-routed layers marked), from a
    :class:`ds4lab.hooks.Capture` of ``moe.experts``; or give a session and a ``prompt`` to capture over a
    prefill of it (see :func:`capture_prefill`, and :meth:`from_prompt`).

    ``counts[layer]`` is an int array ``[n_expert]``: how many captured tokens the layer sent to each expert
    (a token counts once per distinct expert, so each layer's counts sum to ``k × tokens``). ``hash_layers``
    lists the captured layers that route by the token-id hash table. Hovering a bar lists the tokens the
    expert got most often. ``tokens`` (ids by absolute position) defaults to the session's live tokens when
    the view is made; pass them when the session has since moved to another prompt.
    """

    def __init__(self, source, prompt=None, layers=None, tokens=None, top_tokens: int = 3):
        from ..hooks import Capture

        if isinstance(source, Capture):
            if prompt is not None:
                raise TypeError("give a prompt with a session, not with a capture")
            capture = source
        elif prompt is not None and hasattr(source, "capture"):
            capture = capture_prefill(source, prompt, layers)
        else:
            raise TypeError("ExpertView takes a Capture of 'moe.experts', or a session and a prompt")
        self.capture = capture
        sess = capture.session
        cfg = sess.model.config
        self.config = cfg
        self.counts = expert_counts(capture, cfg.n_expert)
        if layers is not None:
            keep = {int(il) for il in np.atleast_1d(layers)}
            self.counts = {il: c for il, c in self.counts.items() if il in keep}
        if not self.counts:
            raise ValueError("the capture holds no expert choices: capture 'moe.experts' over a prefill or decode")
        self.hash_layers = [il for il in self.counts if cfg.is_hash_layer(il)]
        if tokens is not None:
            check_token_ids(tokens, cfg.n_vocab, then="give the ids the capture ran on")
        ids = np.asarray(sess.tokens if tokens is None else tokens, dtype=np.int64)
        tok = sess.model.tokenizer
        layer_records = []
        for il, counts in self.counts.items():
            name = f"blk.{il}.moe.experts"
            pos = capture.positions(name)
            experts = np.asarray(capture[name]).reshape(len(pos), -1)
            known = pos < len(ids)  # positions the token list covers
            token_ids = ids[pos[known]]
            top = []
            for e in range(cfg.n_expert):
                if counts[e] == 0 or top_tokens <= 0:
                    top.append([])
                    continue
                rows = (experts[known] == e).any(axis=1)
                common = Counter(token_ids[rows].tolist()).most_common(top_tokens)
                top.append([[text, n] for text, (_, n) in zip(token_texts(tok, [i for i, _ in common]), common)])
            layer_records.append(dict(layer=il, hash=bool(cfg.is_hash_layer(il)), n_tokens=int(len(experts)),
                                      counts=[int(c) for c in counts], top=top))
        # the saved view's title (the live one counts the layers its filter shows: widgets/experts.js)
        self.title = (f"router: tokens per expert, {len(layer_records)} layers × {cfg.n_expert} experts, "
                      f"{cfg.n_expert_used} per token; {cfg.n_hash_layer} hash layer(s)")
        self.model = ExpertModel(
            n_expert=cfg.n_expert,
            k=cfg.n_expert_used,
            layers=layer_records,
        )
        self.show_select = W.Dropdown(options=[("all layers", "all"), ("hash layers", "hash"),
                                               ("learned-router layers", "learned")], value="all", description="show")
        self.scale_box = W.Checkbox(value=True, description="one scale for all layers", indent=False)
        W.link((self.show_select, "value"), (self.model, "show"))
        W.link((self.scale_box, "value"), (self.model, "common_scale"))
        self.widget = W.VBox([W.HBox([self.show_select, self.scale_box]), self.model])

    @classmethod
    def from_prompt(cls, session, prompt, layers=None, top_tokens: int = 3) -> "ExpertView":
        """Capture ``moe.experts`` over a prefill of ``prompt`` on ``session`` and show it."""
        return cls(session, prompt, layers=layers, top_tokens=top_tokens)

    def __repr__(self) -> str:
        n = self.model.layers[0]["n_tokens"] if self.model.layers else 0
        return f"ExpertView({len(self.counts)} layers, {n} tokens, hash layers {self.hash_layers})"

    def image(self, layers=None, bar_height: int = 24, bar_width: int | None = None) -> np.ndarray:
        """The histograms of ``layers`` (all by default) as one RGB image, a strip per layer, bars light grey
        on hash layers and dark grey elsewhere, all on one scale."""
        n_expert = self.config.n_expert
        bw = bar_width or max(1, min(12, 512 // n_expert))
        vmax = max(max(int(c.max()) for c in self.counts.values()), 1)
        layers = list(self.counts) if layers is None else list(layers)
        strip = bar_height + 4
        img = np.full((strip * len(layers), n_expert * bw, 3), 255, np.uint8)
        for row, il in enumerate(layers):
            top = row * strip + 2
            img[top + bar_height, :] = (180, 180, 180)
            colour = HASH_COLOUR if il in self.hash_layers else LEARNED_COLOUR
            for e, c in enumerate(self.counts[il]):
                h = int(round(bar_height * c / vmax))
                if h:
                    img[top + bar_height - h : top + bar_height, e * bw : e * bw + max(bw - (bw > 2), 1)] = colour
        return img

    def static_html(self) -> str:
        rows = []
        for L in self.model.layers:
            c = np.asarray(L["counts"])
            busiest = int(c.argmax())
            mean = c.sum() / len(c)
            strip = png_base64(self.image([L["layer"]]))
            rows.append(
                f"<tr><td>{L['layer']}</td><td>{'<b>hash</b>' if L['hash'] else 'learned'}</td>"
                f"<td><img alt='tokens per expert, layer {L['layer']}' src='data:image/png;base64,{strip}'/></td>"
                f"<td>{L['n_tokens']}</td><td>{int((c > 0).sum())}/{len(c)}</td><td>{busiest} ({int(c[busiest])})</td>"
                f"<td>{(c.max() / mean if mean else 0):.2f}</td></tr>"
            )
        vmax = max(int(c.max()) for c in self.counts.values())
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>{html.escape(self.title)}</b><br>"
            f"bars: tokens routed to experts 0…{self.config.n_expert - 1} (one scale, 0…{vmax}); light grey = "
            "hash-routed layer, dark grey = learned router<table><tr><th>layer</th><th>routing</th><th>histogram</th>"
            "<th>tokens</th>"
            f"<th>experts used</th><th>busiest (tokens)</th><th>max/mean load</th></tr>{''.join(rows)}</table></div>"
        )

    def _repr_png_(self):
        from .reduce import png_bytes

        return png_bytes(self.image())
