"""Sessions: one live timeline of tokens, logits and KV state, advanced by step objects.

``sess.prefill(prompt)`` returns a :class:`Prefill` that evaluates one chunk per step (chunks end on
absolute multiples of the chunk size, as ds4 schedules them) and yields a :class:`PrefillChunk` record
per chunk; ``sess.decoder(...)`` returns a :class:`Decode` that samples with ds4's rules and evaluates
one token per step; ``sess.sync(tokens)`` brings the session to any prompt reusing what it can.

Every step computes a new state and only then replaces the session's (tokens, logits, state) in one
assignment, so an exception or a KeyboardInterrupt leaves the session at its last consistent point.
"""

from __future__ import annotations

import codecs
import dataclasses
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from tqdm.auto import tqdm

from .config import is_int
from .kv.checkpoint import Checkpoint, model_fingerprint, state_to_payload
from .kv.kvfile import KVFileError
from .kv.layout import KVState, env_int, expected_row_counts, new_state
from .kv.payload import PayloadError, payload_nbytes
from .kv.store import KVStore, prompt_text
from .kv.view import KVView
from .sampling import (
    DEFAULT_MIN_P,
    DEFAULT_TEMPERATURE,
    DEFAULT_TOP_K,
    DEFAULT_TOP_P,
    Rng,
    argmax_on_device,
    draw_params,
    exclude_mask,
    sample,
    sample_on_device,
    token_and_top_logprobs,
    weighted_rule,
)
from .tiers import Placement, TierRun, TierSwitch

TIER_TRACE_MAX = 100_000  # session.tier_trace keeps the latest switches only
RESUME_PREFILL_MIN = 4  # ds4: suffixes at least this long are prefilled in batch, shorter ones decoded


def resume_prefill_min() -> int:
    value = env_int("DS4_METAL_RESUME_PREFILL_MIN")
    return RESUME_PREFILL_MIN if value is None else value


class _TierTotals:
    """Totals of a step's tier switches (``tier_switches``)."""

    @property
    def tier_bytes(self) -> int:
        return sum(s.bytes for s in self.tier_switches)

    @property
    def tier_seconds(self) -> float:
        return sum(s.seconds for s in self.tier_switches)


@dataclass(frozen=True)
class PrefillChunk(_TierTotals):
    start: int  # absolute token range [start, end)
    end: int
    seconds: float
    kv_bytes: int  # DSV4 payload size of the state after the chunk
    rows: dict  # layer -> {"raw": n, "comp": n, "index": n} rows written by this chunk
    checkpoint: Checkpoint
    tier_switches: tuple[TierSwitch, ...] = ()  # this chunk's switches (see session.tier_trace)

    @property
    def n_tokens(self) -> int:
        return self.end - self.start

    @property
    def tokens_per_s(self) -> float:
        return self.n_tokens / self.seconds if self.seconds > 0 else float("inf")


@dataclass(frozen=True)
class DecodeStep(_TierTotals):
    token: int
    text: str  # the text this token completes (UTF-8 characters split across tokens wait for the rest)
    logprob: float
    top: list  # [(token, logprob)] of the most likely alternatives, best first
    position: int
    seconds: float
    tier_switches: tuple[TierSwitch, ...] = ()  # this token's switches (none for an unevaluated EOS)


class _Launched(NamedTuple):
    """A step queued on the device: its logits (there), new state and tier run, and the fetch of its logits."""

    logits: object
    state: KVState
    run: TierRun
    host: object  # Backend.fetch of the logits


@dataclass(frozen=True)
class _Pending:
    """The step a :class:`Decode` launched ahead: ``launched`` evaluates the token the device chose (``ids``,
    fetched) after the step whose new state is ``base``."""

    launched: _Launched
    ids: object
    base: KVState


@dataclass(frozen=True)
class SyncResult:
    source: str  # "live", "checkpoint", "disk" or "cold": where the reused prefix came from
    reused: int  # tokens not evaluated again
    evaluated: int


class Session:
    """A live timeline on a model: ``tokens``, ``logits`` (for the next token) and the KV state."""

    def __init__(self, model, ctx: int = 4096, prefill_chunk: int | None = None, max_checkpoints: int = 16,
                 kv_store=None, placement: Placement | None = None):
        if kv_store is not None and not isinstance(kv_store, KVStore):
            raise TypeError(f"kv_store must be a ds4lab.KVStore (KVStore(folder)), got {kv_store!r}")
        if placement is not None and not isinstance(placement, Placement):
            raise TypeError(f"placement must be a ds4lab.Placement (Placement.even(...), ...), got {placement!r}")
        self.model = model
        self.kv_store = kv_store  # a ds4lab.KVStore: disk checkpoints as ds4-server writes and reads them
        try:
            self._state: KVState = model.new_state(ctx, prefill_chunk)
        except MemoryError:
            raise MemoryError(f"ctx {ctx}: the session's KV state does not fit in memory; ask for a smaller ctx "
                              f"(the model's context is {model.config.context_length or 'not given'})") from None
        self.geometry = self._state.geometry
        # The resolved plan; every step's switches go to tier_trace, steps counted from 0.
        self.placement = (placement or Placement.single()).resolve(model, self._state)
        self._state = self.placement.place_state(self._state)
        self._part = self.placement.part  # this process's part of a state split over ranks, else None
        if kv_store is not None and self._part is not None:
            raise ValueError("a kv_store saves whole states: on a session placed over ranks save from rank 0 what "
                             "Session.gather() returns there (docs/DISTRIBUTED.md)")
        self.tier_trace: deque[TierSwitch] = deque(maxlen=TIER_TRACE_MAX)
        self._tier_step = 0
        self._active_tier = self.placement.embed_tier
        self.tokens: list[int] = []
        self.logits: np.ndarray | None = None
        self._edits: tuple[str, ...] = ()  # what shaped the live state besides its tokens (Session.edits)
        self._active_edits: tuple[str, ...] = ()  # the edits of the interventions whose block is open
        self.checkpoints: deque[Checkpoint] = deque(maxlen=max_checkpoints)
        # Called as fn(record) after every evaluated step, once the session holds its result: the
        # PrefillChunk or DecodeStep, or None for a token that sync() appended without sampling. Views
        # refresh themselves through it; an exception raised by one propagates to the step's caller.
        self.step_observers: list = []

    def __repr__(self) -> str:
        g = self.geometry
        return f"Session({len(self.tokens)}/{g.ctx} tokens, chunk {g.chunk}, raw ring {g.raw_cap})"

    @property
    def ctx(self) -> int:
        return self.geometry.ctx

    @property
    def tier_steps(self) -> int:
        """Steps evaluated so far, counted as ``tier_trace`` numbers them (the next step is this number)."""
        return self._tier_step

    @property
    def prefill_chunk(self) -> int:
        return self.geometry.chunk

    @property
    def edits(self) -> tuple[str, ...]:
        """What made the live state other than the model's state of its tokens: the edits of a restored edited
        checkpoint (:mod:`ds4lab.kv.edit`) and of the interventions its steps ran under (kept with
        ``intervene(..., keep=True)``); empty for a clean state. An edited state is never saved to the
        ``kv_store``, and its checkpoints are never reused by ``sync``."""
        return self._edits

    # -- state ----------------------------------------------------------------------------------------
    def _commit(self, tokens: list[int], logits, state: KVState, run: TierRun | None = None,
                edits: tuple[str, ...] = ()) -> None:
        if run is None:  # a state from elsewhere (restore, reset); a forward pass leaves layers on their tiers
            state = self.placement.place_state(state)
        self.tokens, self.logits, self._state = tokens, logits, state
        self._ahead = None  # a step launched ahead follows the state it was launched after: no other
        self._edits = edits if run is None else self._edits + tuple(e for e in self._active_edits
                                                                     if e not in self._edits)
        if run is not None:
            self.tier_trace.extend(run.switches)
            self._active_tier = run.active
            self._tier_step += 1

    def _stepped(self, record) -> None:
        for observer in tuple(self.step_observers):
            observer(record)

    # Called as fn(name, value) at the hook points of every step this session runs while set (ds4lab.hooks.Capture
    # sets it for its with block); each step hands it to the model's runtime, so sessions capture independently.
    hook_observer = None

    def _end_observer(self, observer, previous) -> None:
        """At the end of the block that set ``observer``, put ``previous`` back; refused, with nothing changed,
        while a block opened inside it is still open (closed in this order, that one would put this block's
        observer back after it: edits applied past their block)."""
        if self.hook_observer != observer:  # bound methods: equal, not the same object
            raise RuntimeError("a capture or intervention opened inside this block is still open: close it first")
        self.hook_observer = previous

    # The step a Decode launched ahead of the live state (a _Pending), kept here so that any change of the state
    # drops it (_commit) with the device memory of its state.
    _ahead = None

    def _eval(self, tokens: list[int], mode: str):
        """Run ``tokens`` after the live state, switching tiers in ``mode`` ("decode", or "batch": a prefill
        chunk); returns (logits of the last token, new state, the step's :class:`TierRun`)."""
        return self._finish(self._launch(tokens, mode))

    def _launch(self, tokens: list[int], mode: str, after: _Launched | None = None, device_ids=None) -> _Launched:
        """:meth:`_eval` up to its wait: the step is queued on the device (a GPU backend runs it meanwhile), and the
        copy of its logits to the host after it. ``after``: a step launched and not yet committed, which this one
        follows (its state, not the live one); ``device_ids``: the tokens' ids on the device (their values in
        ``tokens`` are then placeholders)."""
        self.model.file.check_unchanged()  # a stat a step: a cut file would SIGBUS, a rewritten one mislead
        if after is None:
            run, state = TierRun(self.placement, mode, self._tier_step, self._active_tier), self._state
        else:
            run, state = TierRun(self.placement, mode, self._tier_step + 1, after.run.active), after.state
        logits, state = self.model.runtime.forward_logits(np.asarray(tokens), state, tiers=run,
                                                          observer=self.hook_observer, prefill=mode == "batch",
                                                          device_ids=device_ids)
        with run.scope():
            host = self.model.backend.fetch(logits)
        return _Launched(logits, state, run, host)

    def _finish(self, launched: _Launched):
        """The launched step's logits on the host, once the device has computed them."""
        with launched.run.scope():
            logits = launched.host.result()
        return np.asarray(logits[0], dtype=np.float32), launched.state, launched.run

    def capture(self, points, layers=None, heads=None, queries=None):
        """``with sess.capture(["blk.2.attn.scores", ...], layers=, heads=, queries=) as cap:`` records the
        named hook points of this session's steps run inside it (see :mod:`ds4lab.hooks`)."""
        from .hooks import Capture

        return Capture(self, points, layers=layers, heads=heads, queries=queries)

    def intervene(self, edits, keep: bool = False):
        """``with sess.intervene([ablate_sink(2), ...]) as iv:`` runs this session's steps inside the block with
        the edits applied at their hook points (see :mod:`ds4lab.interventions`); at the block's end the session
        is back where it was unless ``keep``."""
        from .interventions import Intervention

        return Intervention(self, edits, keep=keep)

    def snapshot(self) -> Checkpoint:
        """The current state as a :class:`Checkpoint` of this model, not kept for ``sync`` (nothing is copied:
        states are immutable values, so a step cannot change it)."""
        return Checkpoint(tuple(self.tokens), self.logits, self._state, config=self.model.config,
                          backend=self.model.backend, fingerprint=model_fingerprint(self.model), edits=self._edits,
                          part=self._part)

    def checkpoint(self) -> Checkpoint:
        """The current state (:meth:`snapshot`), also kept for ``sync``."""
        cp = self.snapshot()
        self.checkpoints.append(cp)
        return cp

    def restore(self, cp: Checkpoint) -> None:
        """Make ``cp`` the live state. A checkpoint of another model (another layer count or config, or another
        model fingerprint where the checkpoint knows one) is refused with a :class:`PayloadError` naming both
        values, and a payload is checked against this session (ds4's loader rules); the session is unchanged
        on any refusal. On a session placed over ranks this process keeps its own layers of a whole checkpoint
        (nothing moves between ranks: every rank restores the same one), or takes back a part it checkpointed."""
        if not isinstance(cp, Checkpoint):
            raise TypeError(f"restore takes a Checkpoint (Session.checkpoint(), ds4lab.kv.edit.load_kv(path, model), "
                            f"Checkpoint.from_bytes), got {type(cp).__name__}")
        if cp.part is not None and cp.part != self._part:
            raise ValueError(f"the checkpoint holds one part of a split state ({cp.part}); this session's part is "
                             f"{self._part or 'the whole state'}: restore a whole checkpoint (Session.gather's)")
        state = cp.state_for(self.model.config, self.model.backend, self.geometry, model_fingerprint(self.model))
        self._commit(list(cp.tokens), None if cp.logits is None else np.array(cp.logits), state, edits=cp.edits)

    def gather(self, cp: Checkpoint | None = None) -> Checkpoint | None:
        """``cp`` (default: the live state) whole: on a session placed over ranks every rank calls it with its own
        part of the same checkpoint, and rank 0 gets one checkpoint of every rank's layers (its ``to_bytes()`` is
        the ``DSV4`` payload; a ``KVStore`` on rank 0 can save it), the others None. Elsewhere ``cp`` itself."""
        cp = self.snapshot() if cp is None else cp
        if self._part is None:
            return cp
        if cp.part != self._part:
            raise ValueError(f"gather takes this session's own checkpoints ({self._part}); this one holds "
                             f"{cp.part or 'a whole state'}")
        from .distributed_kv import gather

        return gather(self.placement, self.model, cp)

    def scatter(self, cp: Checkpoint | None) -> None:
        """Make rank 0's whole checkpoint ``cp`` the live state of every rank, each keeping its own layers; every
        rank calls it (what ranks other than 0 pass is not read). Rank 0 checks ``cp`` as :meth:`restore` does and,
        when it refuses it, every rank raises the reason and stays unchanged. Elsewhere :meth:`restore`."""
        if self._part is None:
            self.restore(cp)
            return
        from .distributed_kv import scatter

        tokens, logits, state, edits = scatter(self.placement, self.model, self.geometry, cp)
        self._commit(tokens, logits, state, edits=edits)

    def reset(self) -> None:
        self._commit([], None, new_state(self.model.config, self.model.backend, self.geometry))

    @property
    def kv(self) -> KVView:
        if self._part is not None:
            raise ValueError(f"this process holds one part of the KV state ({self._part}): gather it with "
                             "Session.gather() on every rank and read the whole one on rank 0")
        payload = state_to_payload(self.model.config, self.model.backend, self._state, self.tokens,
                                   self.logits if self.logits is not None else np.zeros(self.model.config.n_vocab))
        return KVView(self.model.config, payload)

    @property
    def kv_bytes(self) -> int:
        return payload_nbytes(self.model.config, len(self.tokens), self.geometry.window, self.geometry.raw_cap)

    # -- prefill and sync -----------------------------------------------------------------------------
    def prompt_ids(self, prompt) -> list[int]:
        """The prompt's token ids, checked before anything touches the session: integers, each in
        ``[0, n_vocab)`` (a ValueError names the first bad one and its position), fewer than ``ctx``."""
        if not isinstance(prompt, str):
            check_token_ids(prompt, self.model.config.n_vocab)
        ids = self.model.token_ids(prompt).tolist()
        if len(ids) >= self.ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens; the context holds {self.ctx} and one slot "
                             "must stay free to generate")
        return ids

    def prefill(self, prompt) -> "Prefill":
        """Prefill ``prompt`` (ids, or text tokenized plain) from the live state if it is a prefix of it,
        otherwise from zero."""
        ids = self.prompt_ids(prompt)
        if ids[: len(self.tokens)] != self.tokens:
            self._store_evicted()
            self.reset()
        return Prefill(self, ids)

    def sync(self, prompt, on_chunk=None) -> SyncResult:
        """Bring the session to exactly ``prompt``, as ds4 does, and better: extend the live state when
        it is a prefix (batched from ds4's resume threshold, token by token below it); otherwise restore
        the longest kept checkpoint that is a prefix and extend that; otherwise, with a ``kv_store``, the
        longest stored prefix on disk; otherwise prefill from zero. An edited live state or checkpoint
        (:attr:`edits`) is never reused. ``on_chunk(PrefillChunk)`` is called after each chunk of a batched prefill
        (for progress displays)."""
        ids = self.prompt_ids(prompt)
        source = "live"
        if ids[: len(self.tokens)] != self.tokens or not self.tokens or self._edits:  # an edited state: not reused
            best = max((cp for cp in self.checkpoints if 0 < len(cp) <= len(ids) and list(cp.tokens) == ids[: len(cp)]
                        and cp.logits is not None and not cp.edits), key=len, default=None)
            if best is not None:
                self.restore(best)
                source = "checkpoint"
            else:
                self._store_evicted()
                if self._store_restore(ids):
                    source = "disk"
                else:
                    self.reset()
                    source = "cold"
        reused = len(self.tokens)
        suffix = ids[reused:]
        if not suffix:
            if self.logits is None:  # a restored payload without logits
                raise ValueError("the session has no logits for this prompt")
            return SyncResult(source, reused, 0)
        threshold = resume_prefill_min()
        if threshold > 0 and len(suffix) >= threshold or not self.tokens:
            for chunk in Prefill(self, ids):
                if on_chunk is not None:
                    on_chunk(chunk)
        else:
            for token in suffix:
                logits, state, run = self._eval([token], "decode")
                self._commit(self.tokens + [token], logits, state, run)
                self._store_step()
                self._stepped(None)
        return SyncResult(source, reused, len(suffix))

    # -- disk store (ds4-server's policy, docs/FORMATS.md, "KVC files and the KV store"; in ds4lab.kv.store) --
    def _store_step(self) -> None:
        """After every prefill chunk and decoded token: a "continued" checkpoint whenever the token count is a
        multiple of the store's continued step (aligned to this session's chunk step unless the store says)."""
        store = self.kv_store
        if store is None or self._edits:  # an edited state is not the state of its text
            return
        step = store.continued_step(self.geometry.step)
        if step > 0 and len(self.tokens) % step == 0:
            store.save(self.snapshot(), self.model, reason="continued")  # none below the store's min_tokens

    def _store_evicted(self) -> None:
        """Before a cold prefill or a disk load replaces the live state: save it as "evict"."""
        if self.kv_store is not None and self.tokens and not self._edits:
            self.kv_store.save(self.snapshot(), self.model, reason="evict")

    def _store_restore(self, ids: list[int]) -> bool:
        """``sync``'s disk path: restore the longest stored prefix of ``ids`` whose token ids are ``ids``' own
        (the store's :meth:`~ds4lab.kv.store.KVStore.best_prefix`); False when there is none."""
        store = self.kv_store
        found = store.best_prefix(ids, self.model, self.geometry) if store is not None else None
        if found is None:
            return False
        entry, cp = found
        self.restore(cp)
        store.mark_loaded(entry)
        return True

    def load(self, entry, prompt=None, *, store=None) -> SyncResult | None:
        """Restore a stored ``entry`` (a :class:`~ds4lab.kv.store.KVEntry` of ``store``, default this session's
        ``kv_store``) and, given ``prompt`` (token ids, a string or bytes), prefill only what follows the stored
        prefix: the stored token ids, then ``prompt``'s own ids after them when they match, otherwise the
        rendered-chat tokenization of the text after the stored bytes (ds4's rule; docs/FORMATS.md, "KVC files
        and the KV store"). Returns the :class:`SyncResult` with source "disk", or None, the session untouched,
        when there is nothing to load: ``entry`` None (``store.lookup`` found no prefix) or its file gone (evicted
        by another process since the lookup). The live state is saved as "evict" first, as before a disk load
        in ``sync``, when ``store`` is this session's ``kv_store``. A refusal names the file:
        a ValueError when the entry's text is not a prefix of ``prompt``'s, a :class:`~ds4lab.KVFileError` when
        the file is damaged, another model's, not restorable here (ds4's loader rules), or its text is not the
        text of its token ids; a refused entry leaves the session unchanged."""
        store = self.kv_store if store is None else store
        if store is None:
            raise ValueError("no KV store to load from: pass store= or create the session with kv_store=")
        if entry is None:
            return None
        model = self.model
        text = b""
        if prompt is not None:
            text = prompt_text(prompt, model.tokenizer)
            if not entry.prefix_of(text):
                raise ValueError(f"{entry.path}: its text is not a prefix of the prompt")
        cp = store.load(entry, model.config, model_fingerprint(model), tokenizer=model.tokenizer)
        if cp is None:
            return None
        if store is self.kv_store:
            self._store_evicted()
        try:
            self.restore(cp)
        except PayloadError as e:  # made for another session geometry or model
            raise KVFileError.of_payload(entry.path, e) from e
        store.mark_loaded(entry)
        ids = list(cp.tokens)
        if prompt is None:
            suffix = []
        elif not isinstance(prompt, (str, bytes)) and [int(t) for t in prompt[:len(ids)]] == ids:
            suffix = [int(t) for t in prompt[len(ids):]]
        else:
            suffix = model.tokenizer.encode_rendered(text[entry.text_bytes:].decode("utf-8"))
        return dataclasses.replace(self.sync(ids + suffix), source="disk")

    # -- generation -----------------------------------------------------------------------------------
    def decoder(self, temperature: float = DEFAULT_TEMPERATURE, top_k: int = DEFAULT_TOP_K,
                top_p: float = DEFAULT_TOP_P, min_p: float = DEFAULT_MIN_P, seed: int | None = None,
                top: int = 5, exclude=()) -> "Decode":
        """A :class:`Decode` from the live state. ``exclude``: token ids never sampled (ds4-bench's
        ``argmax_excluding(EOS)``); the reported logprobs stay those of the model."""
        return Decode(self, temperature, top_k, top_p, min_p, seed, top, exclude)

    def generate(self, prompt, max_tokens: int = 128, chat: bool = True, think: bool | str = False,
                 system: str | None = None, progress: bool = False, **sampling) -> str:
        """Sync to ``prompt`` (a string is rendered as one user chat turn unless ``chat=False``; token
        ids are used as given) and return the text of up to ``max_tokens`` sampled tokens."""
        if isinstance(prompt, str) and chat:
            messages = [{"role": "system", "content": system}] if system else []
            messages.append({"role": "user", "content": prompt})
            prompt = self.model.tokenizer.render_chat(messages, think=think)
        self.sync(prompt)
        decode = self.decoder(**sampling)
        steps = decode.stream(max_tokens)
        return "".join(step.text for step in (tqdm(steps, total=max_tokens, disable=not progress)))


def check_token_ids(prompt, n_vocab: int, then: str = "nothing was evaluated") -> None:
    """Raise ValueError naming the first element of ``prompt`` that is not an integer token id below ``n_vocab``
    (its message ending with what ``then`` came of it)."""
    arr = np.asarray(prompt) if not isinstance(prompt, np.ndarray) else prompt
    if arr.ndim != 1 or arr.size == 0:
        return  # Model.token_ids reports the shape
    if np.issubdtype(arr.dtype, np.integer):  # fast path: one comparison per id, no Python ints
        bad = np.flatnonzero((arr < 0) | (arr >= n_vocab))
        if not bad.size:
            return
        i = int(bad[0])
        value = repr(int(arr[i]))
    else:  # floats, strings, objects (e.g. ints beyond 64 bits): the first element that is not a valid id
        items = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)  # as given, not as numpy casts
        i, value = next(((i, t) for i, t in enumerate(items)
                         if not is_int(t) or not 0 <= t < n_vocab),
                        (None, None))
        if i is None:
            return
        value = repr(value)
    raise ValueError(f"token {i} is {value}: token ids are integers in [0, {n_vocab}) for this model's vocabulary "
                     f"of {n_vocab}; {then}")


class Prefill:
    """One prompt's prefill, one chunk per step. Iterate it, call ``step()``, or ``run()`` to finish."""

    def __init__(self, session: Session, ids: list[int]):
        self.session = session
        self.ids = ids
        self.chunks: list[PrefillChunk] = []

    @property
    def position(self) -> int:
        return len(self.session.tokens)

    @property
    def remaining(self) -> int:
        return len(self.ids) - self.position

    def chunk_bounds(self) -> list[tuple[int, int]]:
        """The chunks still to run: each ends at the next absolute multiple of the chunk size."""
        step, out, pos = self.session.geometry.step, [], self.position
        while pos < len(self.ids):
            end = min(len(self.ids), (pos // step + 1) * step)
            out.append((pos, end))
            pos = end
        return out

    def __len__(self) -> int:
        """Chunks in the whole prefill: those already run and those left."""
        return len(self.chunks) + len(self.chunk_bounds())

    def __iter__(self):
        while self.remaining > 0:
            yield self.step()

    def step(self) -> PrefillChunk:
        sess = self.session
        if self.remaining <= 0:
            raise RuntimeError("the prefill is complete")
        if self.ids[: self.position] != sess.tokens:
            raise RuntimeError("the session moved on since this prefill was created; start a new one")
        start, end = self.chunk_bounds()[0]
        began = time.perf_counter()
        logits, state, run = sess._eval(self.ids[start:end], "batch")  # the runtime pads where chunks compile
        seconds = time.perf_counter() - began
        sess._commit(self.ids[:end], logits, state, run)
        cfg = sess.model.config
        rows = {}
        for il in range(cfg.n_layer):
            (comp_before, index_before), (comp_after, index_after) = (
                expected_row_counts(cfg, il, n) for n in (start, end))
            rows[il] = {"raw": end - start, "comp": comp_after - comp_before, "index": index_after - index_before}
        chunk = PrefillChunk(start, end, seconds, sess.kv_bytes, rows, sess.checkpoint(), tuple(run.switches))
        self.chunks.append(chunk)
        sess._store_step()
        sess._stepped(chunk)
        return chunk

    def run(self, progress: bool = True) -> list[PrefillChunk]:
        """Run the remaining chunks with a progress bar (tokens); returns every chunk record."""
        with tqdm(total=len(self.ids), initial=self.position, unit="tok", disable=not progress,
                  desc="prefill") as bar:
            for chunk in self:
                bar.update(chunk.n_tokens)
        return self.chunks


class Decode:
    """Sampled generation from the session's logits, one token per ``step()``.

    On a backend whose launches run beside the host (CuPy), greedy decoding (temperature ≤ 0) and ds4's default
    rule (a positive temperature with min_p, no top_k, no top_p cut: :func:`ds4lab.sampling.weighted_rule`) run
    one step ahead: each step also launches the next one, its token chosen on the device from the logits still
    there (the argmax, or the draw from the uniform the host's generator will give next), so the GPU computes it
    while the host reads this step's logits, sums their log-probabilities and returns. The next ``step()`` samples
    on the host as always and uses that launch only if it evaluated the same token after the same state, with
    nothing observing the session (else it is dropped: states are never modified, so nothing needs undoing). The
    cost: the step launched after the last one (``step(more=False)`` and :meth:`stream`'s last step launch none)
    runs for nothing, and while one is pending (the session keeps it until its state changes) the device holds a
    third copy of the state."""

    def __init__(self, session: Session, temperature, top_k, top_p, min_p, seed, top: int, exclude=()):
        self.session = session
        self.exclude = np.asarray(sorted(set(int(t) for t in exclude)), dtype=np.int64)
        vocab = session.model.config.n_vocab
        bad = [int(t) for t in self.exclude if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"exclude: token ids must be in [0, {vocab}), got {bad[:5]}")
        self.params = dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
        self.rng = Rng(seed) if seed is not None else Rng.from_time()
        self.top = top
        self.stop_reason: str | None = None
        self._text = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # how the device chooses the token of a step launched ahead: ds4's argmax, its rule 2 (the defaults), or not
        self._choose_ahead = ("argmax" if np.float32(temperature) <= 0 else
                              "weights" if weighted_rule(temperature, top_k, top_p) else None)
        self._exclude_on_device = None  # the excluded ids on the device, made at the first step launched ahead

    def _launched_ahead(self, token: int) -> _Launched | None:
        """The step launched ahead, if it evaluates ``token`` after the live state and nothing observes the step now
        (a capture or an intervention begun since runs it anew, eagerly)."""
        sess = self.session
        pending, sess._ahead = sess._ahead, None
        if pending is None or pending.base is not sess._state or sess.hook_observer is not None:
            return None
        return pending.launched if int(pending.ids.result()[0]) == token else None

    def _launch_ahead(self, launched: _Launched) -> _Pending | None:
        """The step after ``launched``, launched now on the token the device chooses from its logits (the argmax, or
        ds4's default rule's draw), where the backend runs it beside the host and the step is one compiled call."""
        sess = self.session
        model = sess.model
        if (self._choose_ahead is None or not model.backend.asynchronous or sess.hook_observer is not None
                or launched.state.n_past + 1 > sess.ctx or not model.runtime.whole(1, launched.run)):
            return None
        try:
            with launched.run.scope():
                ids = self._choose_on_device(launched.logits)
                fetched = model.backend.fetch(ids)
            ahead = sess._launch([0], "decode", after=launched, device_ids=ids)
        except MemoryError:  # no room for a third state beside the live and the launched ones: this step goes on
            return None
        return _Pending(ahead, fetched, launched.state)

    def _choose_on_device(self, logits):
        """The token the device chooses from ``logits [1, V]`` for the step launched ahead (int32 ``[1]``): one
        kernel launch where the backend has kernels, else the array library's operations."""
        backend = self.session.model.backend
        xp, kernels = backend.xp, backend.kernels
        draw = None
        if self._choose_ahead != "argmax":  # the uniform the host's next sample will draw (the generator stays)
            draw = (np.float32(self.rng.copy().uniform()), self.params["temperature"], self.params["min_p"])
        if self.exclude.size and self._exclude_on_device is None:  # once a decode: as the kernel reads them, or ids
            host = exclude_mask(self.exclude, logits.shape[-1]) if kernels is not None else self.exclude
            self._exclude_on_device = xp.asarray(host.astype(np.int32))
        if kernels is not None:
            params = None if draw is None else backend.upload([draw_params(*draw)])[0]
            return kernels.next_token(logits, self._exclude_on_device, params)
        if draw is None:
            return argmax_on_device(xp, logits, self._exclude_on_device)
        return sample_on_device(xp, logits, draw[0], draw[1], draw[2], self._exclude_on_device)

    def step(self, more: bool = True, greedy: bool = False) -> DecodeStep:
        """Sample the next token and evaluate it. An EOS is returned but not evaluated, and ends the
        decode (``stop_reason == "eos"``). ``more``: whether another step will likely follow (it is then launched
        ahead where it can be, see the class). ``greedy``: this step's token is the argmax, whatever the sampling
        (no draw from the generator; ds4-server samples a tool block's tags so)."""
        sess = self.session
        if self.stop_reason is not None:
            raise RuntimeError(f"this decode has stopped ({self.stop_reason})")
        if sess.logits is None:
            raise RuntimeError("the session has no logits yet: prefill or sync a prompt first")
        if len(sess.tokens) >= sess.ctx:
            self.stop_reason = "ctx"
            raise RuntimeError(f"the context of {sess.ctx} tokens is full")
        began = time.perf_counter()
        current = sess.logits
        rng_state = self.rng.state
        choices = current
        if self.exclude.size:
            choices = current.copy()
            choices[self.exclude] = -np.inf
        token = sample(choices, rng=self.rng, **(dict(self.params, temperature=0.0) if greedy else self.params))
        position = len(sess.tokens)
        if token == sess.model.tokenizer.eos_id:
            self.stop_reason, sess._ahead = "eos", None
            logprob, alternatives = token_and_top_logprobs(current, token, self.top)
            return DecodeStep(token, "", logprob, alternatives, position, time.perf_counter() - began)
        try:
            launched = self._launched_ahead(token) or sess._launch([token], "decode")
            ahead = self._launch_ahead(launched) if more else None
            # the log-sum-exp over the vocabulary (most of a step's host work) while the device runs the step
            logprob, alternatives = token_and_top_logprobs(current, token, self.top)
            logits, state, run = sess._finish(launched)
        except BaseException:
            self.rng.state = rng_state  # after an interrupt the same draw happens again
            raise
        sess._commit(sess.tokens + [token], logits, state, run)
        sess._ahead = ahead
        sess._store_step()
        text = self._text.decode(sess.model.tokenizer.token_bytes(token))
        step = DecodeStep(token, text, logprob, alternatives, position, time.perf_counter() - began,
                          tuple(run.switches))
        sess._stepped(step)
        return step

    def stream(self, n: int):
        """Up to ``n`` steps; stops at EOS (not yielded) and when the context is full."""
        for i in range(n):
            if len(self.session.tokens) >= self.session.ctx:
                self.stop_reason = "ctx"
                return
            step = self.step(more=i + 1 < n)
            if self.stop_reason == "eos":
                return
            yield step
        if self.stop_reason is None:
            self.stop_reason = "length"
