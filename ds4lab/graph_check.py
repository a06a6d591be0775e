"""The graph tests of ds4 (``--metal-graph-test``, ``--metal-graph-full-test``, ``--metal-graph-prompt-test``) for
ds4lab: one model run twice on the user's own device, through ds4lab's kernels (and compiled steps) and through
its plain ops, compared stage by stage with PASS/FAIL against stated tolerances.

ds4 compares its Metal graph with its CPU path. Here the plain-ops path plays the CPU's part: the same backend and
device, the reference formulas of :mod:`ds4lab.ops` instead of the kernels. The kernels cannot be run on the
machines ds4lab is developed on when they are Metal's, so this is how a Mac user checks them, and what goes into
a bug report. Three tests, as ds4 has:

- :func:`decode_test`: one decode step of the prompt's first token at position 0, every hook point of layer 0
  (ds4's "layer0 diffs") and the logits, eager and compiled.
- :func:`full_test`: the same step through every layer: the worst point of each layer, and the logits.
- :func:`prompt_test`: the prompt prefilled in chunks (``DS4_METAL_PREFILL_CHUNK``, raw ring sized by
  ``DS4_METAL_GRAPH_RAW_CAP`` as ds4 reads them), the last token's logits after each chunk, every layer's KV
  state after the prompt, then one greedy decode step.

A stage's error is max |fast − plain| / max |plain| (relative to the stage's largest value, as ds4lab's backend
tests measure); choices (experts, indexer selections, greedy tokens) must be equal.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from .kv.checkpoint import layer_to_payload
from .kv.layout import LAYER_FIELDS

# Both paths compute in the backend's float (float32 on the GPUs) and differ by summation order: 1e-3 of a stage's
# largest value is the bound ds4lab's GPU tests hold against float64 for whole models. In ds4 numerics a last-bit
# difference before an FP8 or FP4 store (a KV row, an indexer key) now and then rounds a whole step apart, and the
# rows read back carry that step on: there a stage passes with at most FLIP_SHARE of its values beyond the bound. A
# kernel that is wrong puts most of a stage's values beyond it; the max |Δ| column shows any single one.
STAGE_RTOL = 1e-3
LOGITS_RTOL = 1e-3
FLIP_SHARE = 0.02
# A flip is at most one rounding step of the largest value: 1/8 of it in FP8 (e4m3's 3 mantissa bits), 1/2 in FP4
# (the indexer's keys). A NaN or an infinity is never a flip.
FLIP_BOUND = 0.125
FP4_FIELDS = ("index",)
CHOICES = ("moe.experts", "indexer.topk")  # discrete: equal or not
SKIPPED = ("span", "attn.state", "attn.scores")  # bookkeeping and inputs, not results of the step


@dataclass(frozen=True)
class StageDiff:
    """One compared stage: its largest absolute difference, the plain path's largest magnitude and the tolerance
    on their ratio (0: must be equal). ``over`` of its ``size`` values are further apart than ``rtol`` of the
    largest; with ``share`` set (ds4 numerics) up to that share of the values may be, if none is further apart
    than ``bound`` of the largest (rounding flips)."""

    stage: str
    max_abs: float
    max_ref: float
    rtol: float
    note: str = ""
    over: int = 0
    size: int = 0
    share: float | None = None
    bound: float = FLIP_BOUND

    @property
    def rel(self) -> float:
        if self.max_ref > 0:
            return self.max_abs / self.max_ref
        return 0.0 if self.max_abs == 0 else float("inf")

    @property
    def ok(self) -> bool:
        if self.rtol == 0:
            return self.max_abs == 0
        if self.rel <= self.rtol:
            return True
        return self.share is not None and self.over <= self.share * self.size and self.rel <= self.bound

    def line(self) -> str:
        rel = "equal" if self.rtol == 0 and self.ok else f"{self.rel:.2e}"
        tol = "equal" if self.rtol == 0 else f"{self.rtol:.0e}"
        note = self.note
        if self.over and self.share is not None:
            note = f"{self.over}/{self.size} values over tol (up to {self.share:.0%} may be: rounding flips)"
        return f"{self.stage:<34} {self.max_abs:>10.3e} {self.max_ref:>10.3e} {rel:>9} {tol:>6}  " \
               f"{'PASS' if self.ok else 'FAIL'}" + (f"  {note}" if note else "")


@dataclass
class GraphReport:
    test: str  # "graph-test", "graph-full-test" or "graph-prompt-test"
    setup: str  # one line: what ran
    stages: list[StageDiff]
    numerics: str = "ds4"

    @property
    def passed(self) -> bool:
        return all(s.ok for s in self.stages)

    @property
    def failed(self) -> list[StageDiff]:
        return [s for s in self.stages if not s.ok]

    def __str__(self) -> str:
        head = f"{'stage':<34} {'max |Δ|':>10} {'max |ref|':>10} {'rel':>9} {'tol':>6}"
        verdict = "PASS" if self.passed else f"FAIL ({len(self.failed)} of {len(self.stages)} stages)"
        lines = [f"ds4lab {self.test}: {self.setup}", head, *(s.line() for s in self.stages)]
        if not self.passed and self.numerics == "ds4":
            lines.append("note: in ds4 numerics the FP8/FP4 rounding flips of the stores can grow over a prompt, the "
                         "more so with random weights; --numerics exact (no stores rounded) tells them from a wrong "
                         "kernel")
        return "\n".join([*lines, f"{self.test}: {verdict}"])


def compare(stage: str, got, want, rtol: float, note: str = "", share: float | None = None,
            bound: float = FLIP_BOUND) -> StageDiff:
    """``got`` (the kernels' path) against ``want`` (the plain path); ``share`` and ``bound``: see
    :class:`StageDiff`. NaN on both sides counts as equal (an empty score, as the plain path makes it too)."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise ValueError(f"{stage}: the kernels' path gave shape {got.shape}, the plain path {want.shape}")
    if got.dtype == bool or want.dtype == bool:
        got, want = got.astype(np.int64), want.astype(np.int64)
    got, want = got.astype(np.float64), want.astype(np.float64)
    same = (got == want) | (np.isnan(got) & np.isnan(want))  # equal infinities (empty scores) count as equal
    with np.errstate(invalid="ignore"):  # a NaN or an infinity on one side only is an infinite difference
        diff = np.where(same, 0.0, np.abs(got - want))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_ref = float(np.abs(want[np.isfinite(want)]).max(initial=0.0))
    over = int((diff > rtol * max_ref).sum())
    return StageDiff(stage, float(diff.max(initial=0.0)), max_ref, rtol, note, over, diff.size, share, bound)


class _Recorder:
    """An observer of the runtime's hook points that keeps the selected layers' values as NumPy arrays."""

    def __init__(self, backend, layers):
        self.backend, self.layers, self.values = backend, set(layers), {}

    def __call__(self, name: str, value):
        parts = name.split(".")
        if parts[0] == "blk":
            il, point = int(parts[1]), ".".join(parts[2:])
            if il not in self.layers or point in SKIPPED:
                return None
        self.values[name] = np.asarray(self.backend.to_numpy(value))
        return None


def _pair_setup(fast, plain) -> None:
    if plain.backend.name != fast.backend.name:
        raise ValueError(f"the plain path runs on {plain.backend.name}, the other on {fast.backend.name}: compare "
                         "one backend")
    if fast.config != plain.config:
        raise ValueError("the two models differ: load the same file twice (kernels=True and kernels=False)")
    if fast.backend.kernels is None:
        raise ValueError(f"the {fast.backend.name} backend has no kernels here: there is nothing to compare "
                         "(the graph tests check ds4lab's GPU kernels: MLX on a Mac or CUDA, or CuPy)")
    if plain.backend.kernels is not None:
        raise ValueError("the plain path's model runs kernels: load it with kernels=False")


def _step(model, tokens, state, prefill: bool, observer=None):
    """One step of ``tokens`` after ``state``: (the last token's logits as float32 NumPy, the new state)."""
    logits, state = model.runtime.forward_logits(np.asarray(tokens), state, observer=observer, prefill=prefill)
    model.backend.eval(logits)
    return np.asarray(model.backend.to_numpy(logits), dtype=np.float32)[0], state


def _decode_step(model, token: int, observer):
    return _step(model, [token], model.new_state(2, 1), False, observer)[0]


def _step_stages(fast, plain, token: int, layers) -> tuple[dict, dict, list[StageDiff]]:
    """One decode step through both paths, recorded at ``layers``; the logits of the eager step (recorded) and
    of the step as it runs without hooks (compiled where the backend compiles)."""
    rec_f, rec_p = _Recorder(fast.backend, layers), _Recorder(plain.backend, layers)
    want = _decode_step(plain, token, rec_p)
    got_eager = _decode_step(fast, token, rec_f)
    got = _decode_step(fast, token, None)
    logits = [compare("logits (eager, hooks on)", got_eager, want, LOGITS_RTOL),
              compare("logits (as it runs)", got, want, LOGITS_RTOL,
                      note="" if got.argmax() == want.argmax() else "greedy tokens differ")]
    return rec_f.values, rec_p.values, logits


def _flips(model) -> float | None:
    """The share of a stage's values that may round a step apart: none without the FP8/FP4 stores."""
    return None if model.numerics == "exact" else FLIP_SHARE


def _layer_diffs(model, got: dict, want: dict, il: int) -> list[StageDiff]:
    """Every recorded point of layer ``il``: choices equal, values within the stage tolerance."""
    out = []
    for name in want:
        if name.startswith(f"blk.{il}."):
            exact = name.split(".", 2)[-1] in CHOICES
            out.append(compare(name, got[name], want[name], 0) if exact else
                       compare(name, got[name], want[name], STAGE_RTOL, share=_flips(model)))
    return out


def _setup(fast, what: str) -> str:
    from .backends import backend_label

    return f"{fast.path.name}, {backend_label(fast.backend)}, {fast.numerics} numerics, {what}"


def decode_test(fast, plain, token: int) -> GraphReport:
    """ds4's ``--metal-graph-test``: layer 0's stages and the logits for one decode step of ``token``."""
    _pair_setup(fast, plain)
    got, want, logits = _step_stages(fast, plain, token, [0])
    stages = _layer_diffs(fast, got, want, 0)
    return GraphReport("graph-test", _setup(fast, f"token {token} as a decode step at position 0"), stages + logits,
                       fast.numerics)


def full_test(fast, plain, token: int) -> GraphReport:
    """ds4's ``--metal-graph-full-test``: the same decode step through every layer; each layer's worst point."""
    _pair_setup(fast, plain)
    n_layer = fast.config.n_layer
    got, want, logits = _step_stages(fast, plain, token, range(n_layer))
    stages = []
    for il in range(n_layer):
        diffs = _layer_diffs(fast, got, want, il)
        failing = [d for d in diffs if not d.ok]
        worst = failing[0] if failing else max(diffs, key=lambda d: d.rel)
        note = f"{len(failing)} of {len(diffs)} points fail" if failing else ""
        stages.append(replace(worst, stage=f"layer {il:>2} (worst: {worst.stage.split('.', 2)[-1]})", note=note))
    return GraphReport("graph-full-test", _setup(fast, f"token {token} as a decode step at position 0, "
                                                       f"{n_layer} layers"), stages + logits, fast.numerics)


def _layer_state(model, state, il: int) -> dict:
    """Layer ``il``'s state as a .kv payload holds it: the rows a later step reads (a compiled step's copy of the
    state may leave the others out: runtime.compiled.live_rows)."""
    saved = layer_to_payload(model.config, model.backend, il, state.layers[il], state.n_past, state.geometry)
    return {f: getattr(saved, f) for f in LAYER_FIELDS if getattr(saved, f, None) is not None}


def prompt_test(fast, plain, ids, ctx: int | None = None, prefill_chunk: int | None = None) -> GraphReport:
    """ds4's ``--metal-graph-prompt-test``: ``ids`` prefilled in chunks through both paths as a session runs them
    (compiled where the backend compiles): the last token's logits after each chunk, every layer's KV state
    after the prompt, then one greedy decode step."""
    _pair_setup(fast, plain)
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError("the graph prompt test needs a non-empty prompt")
    ctx = ctx or len(ids) + 2
    if len(ids) + 1 >= ctx:
        raise ValueError(f"the prompt has {len(ids)} tokens; the context of {ctx} leaves no room for a decode step")
    states = {m: m.new_state(ctx, prefill_chunk) for m in (fast, plain)}
    geo = states[fast].geometry
    stages, last = [], {}
    for start in range(0, len(ids), geo.step):
        chunk = np.asarray(ids[start:start + geo.step])
        for m in (fast, plain):
            last[m], states[m] = _step(m, chunk, states[m], True)
        stages.append(compare(f"chunk [{start}, {start + len(chunk)}) logits", last[fast], last[plain], LOGITS_RTOL))
    for il in range(fast.config.n_layer):
        got, want = _layer_state(fast, states[fast], il), _layer_state(plain, states[plain], il)
        diffs = [compare(f, got[f], want[f], STAGE_RTOL, share=_flips(fast), bound=0.5 if f in FP4_FIELDS
                         else FLIP_BOUND) for f in want]
        worst = max(diffs, key=lambda d: (not d.ok, d.over / max(d.size, 1), d.rel))
        stages.append(replace(worst, stage=f"layer {il:>2} KV (worst: {worst.stage})"))
    token = int(last[plain].argmax())
    stages.append(compare("greedy token", int(last[fast].argmax()), token, 0))
    after = {m: _step(m, [token], states[m], False)[0] for m in (fast, plain)}
    stages.append(compare("decode step logits", after[fast], after[plain], LOGITS_RTOL))
    what = f"{len(ids)} prompt tokens in chunks of {geo.step}, ctx {geo.ctx}, raw ring {geo.raw_cap} rows"
    return GraphReport("graph-prompt-test", _setup(fast, what), stages, fast.numerics)
