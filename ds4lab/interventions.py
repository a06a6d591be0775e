"""Interventions: change what the model computes at named hook points, for the steps run inside a ``with`` block.

In the spirit of TransformerLens's hooks and nnsight's edits: an :class:`Edit` names an editable point of
:mod:`ds4lab.hooks` (``blk.{il}.attn.state``, ``attn.sinks``, ``attn.comp_visible``, ``attn.heads``,
``moe.experts``) and a function ``fn(value, site) -> new value`` (None: leave it). ``sess.intervene(edits)``
registers them on that session only (other sessions of the model are untouched), its steps run eagerly
while the block is open (an observer turns compiled steps off), and every step inside sees the edits::

    with sess.intervene([ablate_sink(2), replace_experts(4, [0, 5])]) as iv:
        sess.prefill(ids).run()
    iv.logits                      # the next-token logits the block ended with
    logit_diff(sess, ids, [ablate_sink(2)])   # clean against edited, last token: gains, losses, KL

Named edits for the five cases: :func:`ablate_sink` (a head's sink logit to −inf: the sink takes no mass),
:func:`ablate_rows` (compressed rows masked before the softmax: their attention mass goes to the other keys),
:func:`force_topk` (each query attends exactly the given compressed rows, among those it can see),
:func:`patch_row` (a raw or compressed row of the KV state taken from another prompt's checkpoint), and
:func:`replace_experts` (a token's routed experts, weighted by the router's probabilities of those experts).

What the block leaves behind (the decision): nothing, by default. At its end the session is restored to the
state it had at the start, and the checkpoints its steps kept are dropped, so the next step equals that of a
session that never intervened, bit for bit. The block's result stays readable on the :class:`Intervention`
(``iv.logits``, ``iv.tokens``, ``iv.checkpoint``: a checkpoint marked with the edits). With ``keep=True``
the session keeps the edited state, and says so: ``sess.edits`` lists the edits, checkpoints taken from it
carry them (``Checkpoint.edits``), ``sync`` never reuses it, and its ``kv_store`` never saves it (a store entry
would be restored as the state of its text). An edit that never applied inside its block (rows that did not
exist yet, positions or queries that no step reached) is reported with a warning when the block ends.

Checkpoint edits (rows overwritten in a saved state, saved as a ``.kv`` file) are in :mod:`ds4lab.kv.edit`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from .config import is_int
from .kv.checkpoint import Checkpoint, model_fingerprint
from .kv.edit import checkpoint_row
from .model.transformer import EDITABLE, Replace


@dataclass(frozen=True)
class Site:
    """Where an edit runs: the point's full name, its layer, the step's first position and real rows, the model."""

    point: str
    layer: int
    pos0: int
    n_valid: int
    model: object

    def numpy(self, x) -> np.ndarray:
        return np.asarray(self.model.backend.to_numpy(x))

    def floats(self, a: np.ndarray):
        """A host array as the backend's float array."""
        return self.model.backend.asarray(a)

    def array(self, a: np.ndarray):
        """A host array (ids, masks) as a backend array of its own type."""
        return self.model.backend.xp.array(a)

    def query_positions(self, n_rows: int) -> np.ndarray:
        """Absolute position of each of a step's ``n_rows`` rows; padding rows look like the last real one."""
        return np.minimum(self.pos0 + np.arange(n_rows), self.pos0 + self.n_valid - 1)


@dataclass(frozen=True)
class Edit:
    """``fn(value, site)`` at the points ``point`` matches (``blk.{il}.attn.sinks``; ``*`` allowed in the layer),
    returning the value the model uses instead (``value`` itself: applied, nothing changed), or None where there is
    nothing for it to edit (it did not apply). ``label`` says what it does; ``check(model)`` raises a ValueError
    naming the value when the edit cannot apply to a model."""

    point: str
    fn: Callable
    label: str
    check: Callable | None = None

    def __post_init__(self):
        parts = self.point.split(".")
        if len(parts) < 3 or parts[0] != "blk" or ".".join(parts[2:]) not in EDITABLE:
            raise ValueError(f"{self.point!r} is not an editable hook point: expected blk.{{layer}}.POINT with POINT "
                             f"one of {', '.join(EDITABLE)}")


def _layer_check(layer: int, need: str | None = None):
    """A check that ``layer`` exists and, by ``need``, has compressed rows ("comp") or an indexer ("indexer")."""
    def check(model):
        cfg = model.config
        cfg.check_layer(layer)
        R = cfg.ratio(layer)
        if need == "comp" and not R:
            raise ValueError(f"layer {layer} has no compressed rows (ratio 0: raw window only)")
        if need == "indexer" and not cfg.has_indexer(layer):
            raise ValueError(f"layer {layer} has no indexer (ratio {R}); ablate_rows masks the rows of any "
                             "compressed layer")
    return check


def _rows(rows, what: str = "rows") -> np.ndarray:
    """Row, head or position numbers: a non-empty list of whole numbers >= 0 (True or 1.7 is not one: the cast
    read them as 1), refused by ``what`` otherwise (an empty list edited nothing, and said nothing)."""
    items = list(np.atleast_1d(np.asarray(rows, dtype=object)).ravel()) if np.ndim(rows) <= 1 else None
    if items is None or not all(is_int(i) and i >= 0 for i in items):
        raise ValueError(f"{what} must be whole numbers >= 0, got {rows!r:.80}")
    if not items:
        raise ValueError(f"{what} is empty: the edit would change nothing")
    return np.asarray(items, dtype=np.int64)


def _mask(rows: np.ndarray, n: int) -> np.ndarray:
    m = np.zeros(n, bool)
    m[rows[rows < n]] = True
    return m


# -- the named edits --------------------------------------------------------------------------------------
def ablate_sink(layer: int, heads=None) -> Edit:
    """Layer ``layer``'s sink logit to −inf for ``heads`` (default all): the softmax runs over the keys alone."""
    sel = None if heads is None else _rows(heads, "heads")

    def fn(value, site):
        s = site.numpy(value).astype(np.float64)
        s[slice(None) if sel is None else sel] = -np.inf
        return site.floats(s)

    def check(model):
        cfg = model.config
        _layer_check(layer)(model)
        if sel is not None and (sel >= cfg.n_head).any():
            raise ValueError(f"heads {sel.tolist()}: this model has heads 0 … {cfg.n_head - 1}")

    which = "every head" if sel is None else f"heads {sel.tolist()}"
    return Edit(f"blk.{layer}.attn.sinks", fn, f"blk.{layer} sink ablated ({which})", check)


def ablate_rows(layer: int, rows=None) -> Edit:
    """Layer ``layer``'s compressed ``rows`` (default all) masked out before the softmax, for every query."""
    sel = None if rows is None else _rows(rows)

    def fn(value, site):
        m = site.numpy(value).astype(bool)
        written = (int(site.query_positions(m.shape[0]).max()) + 1) // site.model.config.ratio(layer)
        if not (written if sel is None else (sel < written).any()):
            return None  # none of the rows is written yet (the mask spans the capacity): nothing to edit
        keep = np.zeros(m.shape[1], bool) if sel is None else ~_mask(sel, m.shape[1])
        return site.array(m & keep)

    which = "every compressed row" if sel is None else f"compressed rows {sel.tolist()}"
    return Edit(f"blk.{layer}.attn.comp_visible", fn, f"blk.{layer} {which} ablated", _layer_check(layer, "comp"))


def force_topk(layer: int, rows, queries=None) -> Edit:
    """The indexer's choice in layer ``layer`` replaced by ``rows``: each query (at the absolute ``queries``
    positions; default all) attends exactly those of ``rows`` it can see (row c is visible from position
    (c+1)·R − 1 on: a row not written yet stays masked)."""
    sel = _rows(rows)
    at = None if queries is None else _rows(queries, "queries")

    def fn(value, site):
        m = site.numpy(value).astype(bool)
        C, n = m.shape
        pos = site.query_positions(C)
        here = np.ones(C, bool) if at is None else np.isin(pos, at)
        if not here.any():
            return None  # none of the queries is in this step
        R = site.model.config.ratio(layer)
        forced = (np.arange(n)[None, :] < ((pos + 1) // R)[:, None]) & _mask(sel, n)[None, :]
        return site.array(np.where(here[:, None], forced, m))

    who = "" if at is None else f" at positions {at.tolist()}"
    return Edit(f"blk.{layer}.attn.comp_visible", fn, f"blk.{layer} indexer top-k forced to rows {sel.tolist()}{who}",
                _layer_check(layer, "indexer"))


def patch_row(layer: int, source: Checkpoint, *, raw: int | None = None, comp: int | None = None,
              index: int | None = None) -> Edit:
    """One KV row of layer ``layer`` replaced, in the state each step starts from, by ``source``'s row (another
    prompt's checkpoint of the model): the raw row of absolute position ``raw``, or compressed row ``comp``, or
    indexer row ``index``. A step whose state does not hold that row yet leaves it (the row is patched from the
    first step that finds it, and steps after carry it on)."""
    given = [(k, v) for k, v in (("raw", raw), ("comp", comp), ("index", index)) if v is not None]
    if len(given) != 1:
        raise ValueError(f"patch_row takes exactly one of raw=, comp=, index=; got {dict(given) or 'none'}")
    kind, at = given[0][0], int(given[0][1])
    row = checkpoint_row(source, layer, kind, at)

    def fn(state, site):
        held = getattr(state, kind)
        if kind == "raw":
            slot = at % held.shape[0]
            present = site.pos0 - held.shape[0] <= at < site.pos0
        else:
            slot, present = at, at < site.pos0 // site.model.config.ratio(layer)
        if not present:
            return None
        array = site.numpy(held).copy()
        array[slot] = row
        return dataclasses.replace(state, **{kind: site.floats(array)})

    def check(model):  # the fingerprint too: a model of the same shape with other weights is another model
        source.check_model(model.config, model_fingerprint(model))

    what = f"raw position {at}" if kind == "raw" else f"{kind} row {at}"
    return Edit(f"blk.{layer}.attn.state", fn, f"blk.{layer} {what} patched from a {len(source)}-token checkpoint",
                check)


def replace_experts(layer: int, experts, positions=None) -> Edit:
    """The routed experts of layer ``layer`` replaced by ``experts`` (``n_expert_used`` distinct ids) for the
    tokens at the absolute ``positions`` (default every token); their weights are the router's probabilities
    of those experts, normalised as the model normalises its own choice."""
    ids = _rows(experts, "experts")
    at = None if positions is None else _rows(positions, "positions")

    def fn(value, site):
        chosen = site.numpy(value).astype(np.int64)
        pos = site.pos0 + np.arange(chosen.shape[0])
        here = slice(None) if at is None else np.isin(pos, at)
        if at is not None and not here.any():
            return None  # none of the positions is in this step
        new = chosen.copy()
        new[here] = ids
        return value if np.array_equal(new, chosen) else new  # the router's own choice: the model's own value

    def check(model):
        cfg = model.config
        _layer_check(layer)(model)
        if ids.shape != (cfg.n_expert_used,) or len(set(ids.tolist())) != len(ids) or not (
                (0 <= ids) & (ids < cfg.n_expert)).all():
            raise ValueError(f"experts {ids.tolist()}: expected {cfg.n_expert_used} distinct ids in "
                             f"[0, {cfg.n_expert})")

    who = "" if at is None else f" at positions {at.tolist()}"
    return Edit(f"blk.{layer}.moe.experts", fn, f"blk.{layer} experts replaced by {ids.tolist()}{who}", check)


# -- the block --------------------------------------------------------------------------------------------
def _edit_list(edits) -> list[Edit]:
    """Edits given as one :class:`Edit`, a list of them, or a dict ``{point: Edit or fn(value, site)}``."""
    if isinstance(edits, Edit):
        return [edits]
    if isinstance(edits, dict):
        out = []
        for point, e in edits.items():
            if isinstance(e, Edit):
                if e.point != point:
                    raise ValueError(f"the edit for {point!r} is one for {e.point!r}")
                out.append(e)
            elif callable(e):
                out.append(Edit(point, e, f"{point} edited by {getattr(e, '__name__', 'a function')}"))
            else:
                raise TypeError(f"the edit for {point!r} is {e!r}: expected an Edit or a function (value, site)")
        return out
    out = list(edits)
    for e in out:
        if not isinstance(e, Edit):
            raise TypeError(f"{e!r} is not an Edit: give Edits (ablate_sink(...), ...) or a dict {{point: fn}}")
    return out


class Intervention:
    """``with sess.intervene(edits, keep=False) as iv:``: the session's steps inside the block run with ``edits``
    (see the module's docstring for what the block leaves behind). ``applied[i]`` counts the times edit i
    changed a value; ``checkpoint``, ``tokens`` and ``logits`` are the state the block ended in."""

    def __init__(self, session, edits, keep: bool = False):
        self.session = session
        self.edits = _edit_list(edits)
        if not self.edits:
            raise ValueError("an intervention needs at least one edit")
        for e in self.edits:
            if e.check is not None:
                e.check(session.model)
        self.keep = keep
        self.applied = [0] * len(self.edits)
        self.checkpoint: Checkpoint | None = None
        self._span: dict[int, tuple[int, int]] = {}

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(e.label for e in self.edits)

    @property
    def tokens(self) -> tuple[int, ...]:
        return self._result().tokens

    @property
    def logits(self) -> np.ndarray | None:
        return self._result().logits

    def _result(self) -> Checkpoint:
        if self.checkpoint is None:
            raise RuntimeError("the intervention's block has not ended yet: read sess.logits inside it")
        return self.checkpoint

    def __enter__(self) -> "Intervention":
        if hasattr(self, "_entry"):  # a second block read the first's logits and added to its counts
            raise RuntimeError("an Intervention runs one block: make another with sess.intervene(...)")
        s = self.session
        self._entry = s.snapshot()
        self._kept = {id(cp) for cp in s.checkpoints}
        self._prev_observer, s.hook_observer = s.hook_observer, self._observe
        self._prev_active, s._active_edits = s._active_edits, s._active_edits + self.labels
        return self

    def __exit__(self, exc_type, *exc) -> None:
        s = self.session
        s._end_observer(self._observe, self._prev_observer)
        s._active_edits = self._prev_active
        self.checkpoint = s.snapshot()
        if not self.keep:
            s.restore(self._entry)
            kept = [cp for cp in s.checkpoints if id(cp) in self._kept or not cp.edits]
            s.checkpoints.clear()
            s.checkpoints.extend(kept)
        if exc_type is None:
            for e, n in zip(self.edits, self.applied):
                if n == 0:
                    warnings.warn(f"the edit '{e.label}' never applied inside its block (no step reached "
                                  f"{e.point}, or what it edits did not exist yet)", stacklevel=2)

    def _observe(self, name: str, value):
        """The observer: apply the edits matching ``name``, then pass the value on to an outer observer; returns
        the :class:`Replace` the model uses where an edit applied."""
        parts = name.split(".")
        out = None
        if parts[0] == "blk":
            il = int(parts[1])
            if parts[2] == "span":
                self._span[il] = (int(np.asarray(value[0])), int(np.asarray(value[1])))
            for i, e in enumerate(self.edits):
                if fnmatch.fnmatchcase(name, e.point):
                    new = e.fn(value, Site(name, il, *self._span[il], self.session.model))
                    if new is not None:
                        value, out = new, Replace(new)
                        self.applied[i] += 1
        if self._prev_observer is not None:
            outer = self._prev_observer(name, value)
            out = outer if isinstance(outer, Replace) else out
        return out

    def __repr__(self) -> str:
        state = "open" if self.checkpoint is None else f"ended at {len(self.checkpoint)} tokens"
        return f"Intervention({'; '.join(self.labels)}; {state})"


# -- the logit difference ---------------------------------------------------------------------------------
def _softmax64(logits) -> np.ndarray:
    z = np.asarray(logits, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


@dataclass(frozen=True)
class LogitDiff:
    """The next-token logits after a prompt, clean and under edits, and what changed: ``kl`` (KL(clean ‖ edited),
    nats), ``gained(n)`` and ``lost(n)`` (the tokens whose probability rose or fell most)."""

    clean: np.ndarray
    edited: np.ndarray
    labels: tuple[str, ...]
    tokenizer: object = dataclasses.field(repr=False)
    top: int = 5

    @property
    def p_clean(self) -> np.ndarray:
        return _softmax64(self.clean)

    @property
    def p_edited(self) -> np.ndarray:
        return _softmax64(self.edited)

    @property
    def kl(self) -> float:
        p, q = self.p_clean, self.p_edited
        nz = p > 0
        return float(np.sum(p[nz] * (np.log(p[nz]) - np.log(q[nz]))))

    @property
    def max_abs_logit_change(self) -> float:
        return float(np.max(np.abs(self.edited.astype(np.float64) - self.clean)))

    def _rows(self, order: np.ndarray, n: int) -> list[tuple[int, str, float, float]]:
        p, q = self.p_clean, self.p_edited
        return [(int(t), self.tokenizer.decode([int(t)]), float(p[t]), float(q[t])) for t in order[:n]]

    def gained(self, n: int | None = None) -> list[tuple[int, str, float, float]]:
        """(token, text, p clean, p edited) of the ``n`` tokens whose probability rose most."""
        return self._rows(np.argsort(-(self.p_edited - self.p_clean), kind="stable"), n or self.top)

    def lost(self, n: int | None = None) -> list[tuple[int, str, float, float]]:
        """The same for the ``n`` tokens whose probability fell most."""
        return self._rows(np.argsort(self.p_edited - self.p_clean, kind="stable"), n or self.top)

    def __repr__(self) -> str:
        def best(p):
            t = int(np.argmax(p))
            return f"{self.tokenizer.decode([t])!r} ({p[t]:.3f})"

        lines = [f"edits: {'; '.join(self.labels)}",
                 f"KL(clean ‖ edited) = {self.kl:.3g} nats; largest logit change {self.max_abs_logit_change:.3g}",
                 f"top token: clean {best(self.p_clean)}, edited {best(self.p_edited)}"]
        for title, rows in (("gained", self.gained()), ("lost", self.lost())):
            lines.append(f"{title}: " + ", ".join(f"{text!r} {a:.3f}→{b:.3f}" for _, text, a, b in rows))
        return "\n".join(lines)


def logit_diff(session, prompt, edits, start: int = 0, top: int = 5) -> LogitDiff:
    """Evaluate ``prompt`` twice on ``session``, clean and with ``edits``, and compare the next-token logits.

    The first ``start`` tokens are evaluated clean once and shared (a :func:`patch_row` edit needs rows there to
    patch); the tokens after them run clean, then under the edits, as prefill chunks. The session is left as it
    was."""
    ids = session.prompt_ids(prompt)
    if not 0 <= start < len(ids):
        raise ValueError(f"start is {start}: it must leave at least one of the prompt's {len(ids)} tokens to evaluate")
    entry = session.snapshot()
    try:
        if session.edits:
            session.reset()
        if start:
            session.prefill(ids[:start]).run(progress=False)
        else:
            session.reset()
        base = session.snapshot()
        session.prefill(ids).run(progress=False)
        clean = session.logits
        session.restore(base)
        with session.intervene(edits) as iv:
            session.prefill(ids).run(progress=False)
    finally:
        session.restore(entry)
    return LogitDiff(clean, iv.logits, iv.labels, session.model.tokenizer, top)
