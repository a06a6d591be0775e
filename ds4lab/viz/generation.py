"""GenerationView: a sampled generation streamed token by token, each token coloured by its log-probability,
its top-k alternatives on hover. The widget's front-end is ``widgets/generation.js``."""

from __future__ import annotations

import asyncio
import contextlib
import html
import math
import time

import ipywidgets as W
import traitlets as t

from ..config import is_int
from .base import View, ViewModel, check_session, token_texts, widget_module

CONTEXT_SHOWN = 256  # context tokens shown (greyed) before the generated text
# The pace box's choices, seconds at least between two tokens of a run: a class watching a following view (the KV
# ring turning) sees nothing at the embedded model's hundreds of tokens a second
PACES = (("full speed", 0.0), ("10 tokens/s", 0.1), ("4 tokens/s", 0.25), ("1 token/s", 1.0))

# Background of a generated token by the probability the model gave it: (lowest log-probability, colour), the last
# entry for everything below. Sampled text is mostly made of tokens the model found plausible but not certain (a
# seeded generation of the embedded model: median p 0.03, 90% of tokens under 0.15), so the bins are spaced by
# half decades from 30% down to 0.3%, blue (likely) through grey to orange (surprising): any two bins stay apart for
# a reader with deuteranopia or protanopia too, and dark text keeps 4.5:1 on each (tests/test_views_extra.py).
# The front-end reads the same table (the ``scale`` trait).
LOGPROB_SCALE = (
    (math.log(0.3), "#4393c3"),
    (math.log(0.1), "#b3d4e8"),
    (math.log(0.03), "#d9d9d9"),  # grey, yet a tint a reader tells from the page's white (#ececec was not)
    (math.log(0.01), "#fdd0a2"),
    (math.log(0.003), "#fdae6b"),
    (None, "#f16913"),
)
# the probability of the model's own softmax (ds4's logprobs), not of the sampler's temperature and top-p
LEGEND_TITLE = ("colour: the probability the model gave each sampled token (its softmax, before temperature and top-p; "
                "hover: its alternatives) ")
STATUS = {
    "stop": "stopped (stop button or .stop()): run or step for more",
    "error": "stopped by an error",
    "eos": "end of sequence",
    "ctx": "the context is full",
    "interrupted": "interrupted (the session keeps every token generated before the interrupt)",
    "length": "paused: run or step for more",
}


class Controls(View):
    """A GenerationView's buttons and boxes alone (``view.controls``), to show again right over a view that follows
    the session: a row of its own holding the same widgets, so either row drives the one generation."""

    def __init__(self, view: GenerationView):
        self.view = view
        self.widget = W.HBox(view.row.children)
        self.widget.add_class("ds4-view")  # a view of its own where it is shown (the notebooks' browser tests)

    def __repr__(self) -> str:
        return f"Controls of {self.view!r}"

    def static_html(self) -> str:
        return ("<div class='ds4-view' style='font:12px monospace'>[run] [step] [stop] tokens, pace: the "
                "GenerationView's buttons, live once this cell runs (after the page is reloaded, run it again)</div>")


def _pace_seconds(pace) -> float:
    if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 <= pace <= 60:
        raise ValueError(f"pace must be the seconds between two tokens, from 0 to 60, got {pace!r}")
    return float(pace)


def _end_at_wait(steps) -> None:
    """End the generation loop ``steps`` where it waits, as an interrupt during a token ends it (every token kept,
    the status and buttons set)."""
    with contextlib.suppress(StopIteration):
        steps.throw(KeyboardInterrupt)


def logprob_colour(logprob: float) -> str:
    for lowest, colour in LOGPROB_SCALE:
        if lowest is None or logprob >= lowest:
            return colour
    return LOGPROB_SCALE[-1][1]


def step_record(tokenizer, step) -> dict:
    """What the front-end shows of one ``DecodeStep`` (JSON): the token, the text it completed, its own bytes
    as text, its log-probability and its top-k alternatives (best first)."""
    eos = step.token == tokenizer.eos_id
    return dict(
        token=int(step.token),
        text=step.text,
        piece=token_texts(tokenizer, [step.token])[0],
        logprob=float(step.logprob),
        position=int(step.position),
        seconds=float(step.seconds),
        eos=bool(eos),
        top=[dict(token=int(tok), text=token_texts(tokenizer, [tok])[0], logprob=float(lp)) for tok, lp in step.top],
    )


def _percent(logprob: float) -> str:
    return f"{100 * math.exp(logprob):.2g}%"


def scale_labels(scale=LOGPROB_SCALE) -> list[str]:
    """The legend's label of each bin of ``scale``: "≥ 30%", "10–30%", …, "< 0.3%"."""
    out, above = [], None
    for lowest, _ in scale:
        if lowest is None:
            out.append(f"< {_percent(above)}")
        else:
            out.append(f"≥ {_percent(lowest)}" if above is None else f"{_percent(lowest)}–{_percent(above)}")
        above = lowest
    return out


def _alternatives(record: dict) -> str:
    return ", ".join(f"{a['text']!r} {math.exp(a['logprob']):.2f}" for a in record["top"])


class GenerationModel(ViewModel):
    _esm = widget_module("generation.js", "text.js", "reserve.js")
    context = t.List(t.Unicode()).tag(sync=True)  # texts of the last context tokens, shown greyed
    context_skipped = t.Int(0).tag(sync=True)  # earlier context tokens not shown
    records = t.List(t.Dict()).tag(sync=True)  # one per generated token: see step_record
    status = t.Unicode("").tag(sync=True)
    scale = t.List().tag(sync=True)  # LOGPROB_SCALE as [[lowest logprob or null, colour, legend label], ...]
    top = t.Int(5).tag(sync=True)  # alternatives a step keeps (the decoder's top): the panel's room before a token


class GenerationView(View):
    """Stream a sampled generation from ``session``: every token coloured by its log-probability, its top-k
    alternatives (with probabilities) on hover.

    ``prompt`` (text, or token ids) is synced onto the session before the first token (a string is rendered
    as a chat turn when ``chat`` is true, by default when the model has a chat template, as the CLI does);
    without one the generation continues the session's live state. ``sampling`` goes to
    ``session.decoder(...)`` (``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``top`` = how many
    alternatives each step keeps). Python: ``.step()`` samples one token and returns its ``DecodeStep``,
    ``.run(n)`` up to ``n`` tokens (``max_tokens`` by default) and returns their ``DecodeStep`` list,
    ``.stop()`` asks a running loop to stop before its next token; ``.steps`` and ``.text`` hold everything
    generated so far. ``pace``: seconds at least between two tokens of a run (0: as fast as they come; the pace box
    offers the :data:`PACES`), so that a class can follow a view that redraws after every step; ``.controls`` is
    the row of buttons and boxes alone, to show again right over such a view. The buttons do the
    same: run, step, stop; a button that cannot act now is disabled (stop while nothing runs, run and step while a
    run goes or once the generation has ended).

    Stopping. ``.run(n)`` is synchronous: it runs in the kernel, which handles messages from the browser
    only between cells and callbacks, so a click on stop during a ``run`` called from a cell waits until the
    cell ends (``run`` clears the flag when it starts, so the late click does not stop the next run either).
    The run button instead starts :meth:`arun` as a task on the kernel's event loop (ipykernel has one): it
    yields after every token, the kernel handles the stop click (or any other message) in between, and the
    run ends before its next token. Use ``await view.arun(n)`` in a cell for the same from Python. While such
    a run goes, other cells run between its tokens; one that moves the session ends it with an error in the
    status line. Where there is no event loop the run button runs synchronously. Interrupting the kernel (■)
    during a synchronous ``run`` also stops it cleanly: the run catches the interrupt and keeps every token
    generated before it (a step is atomic, so the session and the view stay consistent).
    """

    def __init__(self, session, prompt=None, max_tokens: int = 64, chat: bool | None = None, pace: float = 0.0,
                 **sampling):
        check_session(session, "GenerationView")
        if not is_int(max_tokens) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a whole number of tokens, 1 or more, got {max_tokens!r}")
        _pace_seconds(pace)  # refused before the view takes the session
        self.session = session
        self.max_tokens = int(max_tokens)
        tok = session.model.tokenizer
        self.prompt_ids: list[int] | None = None
        if prompt is not None:
            if isinstance(prompt, str) and (session.model.is_chat if chat is None else chat):
                prompt = tok.render_chat([{"role": "user", "content": prompt}])
            self.prompt_ids = session.prompt_ids(prompt)
        self.decode = session.decoder(**sampling)
        self.steps: list = []
        self.stop_reason: str | None = None  # why the last run ended: "length", "stop", "eos", "ctx", "interrupted"
        self._stop = False
        self._task = None  # the run the run button started, on the kernel's event loop
        self._started = False
        self._in_run = False  # inside run()/arun(): a step leaves the status at "running"
        self._tokens_after: list[int] | None = None  # the session's tokens after this view's last step
        self.model = GenerationModel(scale=[[lo, c, label] for (lo, c), label in
                                                  zip(LOGPROB_SCALE, scale_labels())], top=self.decode.top)
        self._show_context(self.prompt_ids if self.prompt_ids is not None else session.tokens)
        self.n_input = W.BoundedIntText(value=self.max_tokens, min=1, max=session.ctx, description="tokens",
                                        layout=W.Layout(width="180px"))
        self.run_button = W.Button(description="run", tooltip="generate up to this many tokens")
        self.step_button = W.Button(description="step", tooltip="generate one token")
        self.stop_button = W.Button(description="stop", tooltip="stop a run before its next token")
        self.pace_input = W.Dropdown(options=PACES, value=0.0, description="pace", layout=W.Layout(width="200px"))
        self.pace = pace
        self.run_button.on_click(self.guarded(lambda _: self._run_clicked()))
        self.step_button.on_click(self.guarded(lambda _: None if self.running else self._clicked(self.step)))
        self.stop_button.on_click(self.guarded(lambda _: self.stop()))
        self.row = W.HBox([self.run_button, self.step_button, self.stop_button, self.n_input, self.pace_input])
        self.widget = W.VBox([self.row, self.model])
        self.controls = Controls(self)
        self.model.status = "ready" if self.prompt_ids is not None or session.logits is not None else (
            "the session has no logits: give a prompt, or prefill the session first")
        if self.full:
            self.model.status = (f"the context of {session.ctx} tokens is full: make a new session "
                                 f"(model.session(ctx=...)) or give a prompt")
        self._stoppable = False  # inside arun(): the kernel handles a stop click between tokens
        self._update_buttons()

    def __repr__(self) -> str:
        return f"GenerationView({len(self.steps)} tokens generated, {self.model.status})"

    @property
    def pace(self) -> float:
        """Seconds at least between two tokens of a run (the pace box)."""
        return self.pace_input.value

    @pace.setter
    def pace(self, seconds: float) -> None:
        seconds = _pace_seconds(seconds)
        if not any(seconds == s for _, s in self.pace_input.options):
            self.pace_input.options = (*self.pace_input.options, (f"{seconds:g} s a token", float(seconds)))
        self.pace_input.value = float(seconds)

    @property
    def text(self) -> str:
        """The generated text so far."""
        return "".join(s.text for s in self.steps)

    def _show_context(self, ids) -> None:
        ids = list(ids)
        with self.model.hold_sync():
            self.model.context = token_texts(self.session.model.tokenizer, ids[-CONTEXT_SHOWN:])
            self.model.context_skipped = max(0, len(ids) - CONTEXT_SHOWN)

    def _clicked(self, action) -> None:
        try:
            action()
        except RuntimeError as e:  # a stopped decode, a full context: say so in the view
            self.model.status = str(e)

    def _ready(self) -> None:
        sess = self.session
        if not self._started:
            if self.prompt_ids is not None:
                self.model.status = f"syncing the prompt ({len(self.prompt_ids)} tokens)"
                sess.sync(self.prompt_ids)
                if self._in_run:
                    self.model.status = "running"
            self._show_context(sess.tokens)
            self._started = True
        elif sess.tokens != self._tokens_after:
            raise RuntimeError("the session moved on since this view's last token; start a new GenerationView")

    @property
    def full(self) -> bool:
        """Whether the session's context is full for this view's next token (before a prompt is synced, only a view
        that continues the session knows)."""
        sess = self.session
        return (self._started or self.prompt_ids is None) and len(sess.tokens) >= sess.ctx

    @property
    def ended(self) -> bool:
        """Whether the generation cannot go on: an EOS was sampled, or the context is full."""
        return self.decode.stop_reason is not None or self.full

    def _update_buttons(self) -> None:
        """Enable what can act now: run and step while idle (until the generation ends), stop while a run that
        can be stopped goes (one started by the run button, or ``await view.arun()``: the kernel handles the
        click between its tokens; a synchronous ``run`` from a cell would see the click only after it ends)."""
        busy = self._in_run
        self.run_button.disabled = self.step_button.disabled = busy or self.ended
        self.stop_button.disabled = not (busy and self._stoppable)

    def step(self):
        """Sample and evaluate one token; returns its ``DecodeStep`` (an EOS is returned, shown, and ends the
        generation)."""
        self._ready()
        step = self.decode.step()
        self._tokens_after = list(self.session.tokens)
        self.steps.append(step)
        m = self.model
        with m.hold_sync():
            m.records = m.records + [step_record(self.session.model.tokenizer, step)]
            # the title counts the tokens ("Generation: 44 tokens — <status>"): the status says what goes on
            if self.decode.stop_reason == "eos":
                m.status = STATUS["eos"]
            else:
                m.status = "running" if self._in_run else STATUS["length"]
        if self.decode.stop_reason == "eos":
            self.stop_reason = "eos"
        self._update_buttons()
        return step

    def stop(self) -> None:
        """Ask a running ``run`` to stop before its next token."""
        self._stop = True

    def _steps(self, n: int | None, out: list):
        """The generation loop shared by :meth:`run` and :meth:`arun`: appends each step to ``out``, and between two
        tokens yields the seconds to wait (the pace; arun hands the event loop over there even at 0)."""
        n = self.n_input.value if n is None else int(n)
        self._stop = False
        self.stop_reason = None
        self.model.status = "running"
        self._in_run = True
        self._update_buttons()
        try:
            while len(out) < n:
                if out and not (self._stop or self.ended):  # a wait between two tokens: none after the last
                    yield self.pace
                if self._stop:
                    self.stop_reason = "stop"
                    break
                if self.decode.stop_reason is not None:
                    self.stop_reason = self.decode.stop_reason
                    break
                if self.full:
                    self.stop_reason = "ctx"
                    break
                out.append(self.step())
            else:
                self.stop_reason = "length"
        except KeyboardInterrupt:
            self.stop_reason = "interrupted"
        except Exception as e:
            self.stop_reason = "error"
            self.model.status = f"stopped by an error: {e}"
            self._in_run = self._stoppable = False
            self._update_buttons()
            raise
        finally:
            self._in_run = False
            self._stoppable = False
        if self.decode.stop_reason == "eos":
            self.stop_reason = "eos"
        self.model.status = STATUS.get(self.stop_reason, STATUS["length"])
        self._update_buttons()

    def _check_idle(self) -> None:
        if self.running:
            raise RuntimeError("a run started by the run button is still going: stop it (button or .stop()) first")

    @property
    def running(self) -> bool:
        """Whether a run started by the run button (a task on the kernel's event loop) is going."""
        return self._task is not None and not self._task.done()

    def run(self, n: int | None = None) -> list:
        """Generate up to ``n`` tokens (the ``tokens`` box, ``max_tokens`` at first), stopping early at a stop
        request, an EOS, a full context or a kernel interrupt; returns this run's ``DecodeStep`` list."""
        self._check_idle()
        out: list = []
        steps = self._steps(n, out)
        for wait in steps:
            try:
                time.sleep(wait)
            except KeyboardInterrupt:
                _end_at_wait(steps)
        return out

    async def arun(self, n: int | None = None) -> list:
        """:meth:`run` as a coroutine that yields to the event loop after every token, so that the kernel
        handles the stop button (and other cells) between tokens: ``await view.arun(100)`` in a cell, or what
        the run button starts when the kernel runs an event loop."""
        out: list = []
        self._stoppable = True
        steps = self._steps(n, out)
        for wait in steps:
            try:
                await self._wait(wait)
            except KeyboardInterrupt:
                _end_at_wait(steps)
            except asyncio.CancelledError:  # the task cancelled: the view says so, then the task ends
                _end_at_wait(steps)
                raise
        return out

    async def _wait(self, seconds: float) -> None:
        """The pace between two tokens, in slices: a stop click ends the wait, not only the run after it."""
        end = time.monotonic() + seconds
        while True:
            await asyncio.sleep(max(0.0, min(0.1, end - time.monotonic())))
            if self._stop or time.monotonic() >= end:
                return

    def _run_clicked(self) -> None:
        if self.running:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no event loop (a plain Python caller): run here
            self._clicked(self.run)
            return
        self._task = loop.create_task(self._arun_quietly())

    async def _arun_quietly(self) -> None:
        try:
            await self.arun()
        except Exception:  # already shown in the status line; a task's exception would only be logged
            pass

    def static_html(self) -> str:
        m = self.model
        context = html.escape("".join(m.context))
        spans = []
        for r in m.records:
            alts = "\n".join(f"{a['text']!r}  p={math.exp(a['logprob']):.3f}  (logprob {a['logprob']:.2f})"
                             for a in r["top"])
            title = (f"position {r['position']}: token {r['token']} {r['piece']!r}, p={math.exp(r['logprob']):.3f} "
                     f"(logprob {r['logprob']:.2f})\n" + alts)
            text = "⟨eos⟩" if r["eos"] else (r["text"] or "·")
            spans.append(f"<span style='background:{logprob_colour(r['logprob'])};box-shadow:inset -1px 0 #fff' "
                         f"title='{html.escape(title)}'>{html.escape(text)}</span>")
        legend = LEGEND_TITLE + "<span style='white-space:nowrap'>" + " ".join(
            f"<span style='background:{c}'>&nbsp;{label}&nbsp;</span>"
            for (_, c), label in zip(LOGPROB_SCALE, scale_labels())) + "</span>"
        skipped = f"… {m.context_skipped} tokens … " if m.context_skipped else ""
        rows = "".join(
            f"<tr><td>{r['position']}</td><td>{html.escape(repr(r['piece']))}</td><td>{math.exp(r['logprob']):.3f}</td>"
            f"<td style='text-align:left'>{html.escape(_alternatives(r))}</td></tr>"
            for r in m.records[-20:]
        )
        return (
            f"<div class='ds4-view' style='font:12px monospace'><b>Generation: {len(m.records)} tokens — "
            f"{html.escape(m.status)}</b><br>{legend}"
            "<div style='white-space:pre-wrap;max-height:16em;overflow:auto;border:1px solid #ddd;padding:4px'>"
            f"<span style='color:#767676'>{html.escape(skipped)}{context}</span>{''.join(spans)}</div>"
            f"<table><tr><th>position</th><th>token</th><th>p</th><th>top alternatives</th></tr>{rows}</table></div>"
        )
