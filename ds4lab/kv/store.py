"""The on-disk KV store: ds4-server's ``KVC`` directory (docs/FORMATS.md, "KVC files and the KV store";
ds4's ds4_kvstore.c, ds4_server.c).

Files are ``<dir>/<sha1 of the cache text>.kv`` (:mod:`.kvfile`); the cache text is the stored tokens' bytes.
A lookup re-lists the directory, keeps the entries whose text is a byte prefix of the prompt (SHA-1 of the
prompt's first L bytes equals the name) and takes the longest, ties to more tokens; the stored token ids stay
authoritative. A load rewrites the header with hits + 1 and last_used = now and keeps the file whatever its length
(ds4 since 24fa85ea; before, it deleted a loaded file over ``cold_max_tokens``). Eviction removes the lowest
``(eff + 1) · tokens / file_size`` first, ``eff = hits · 2^(−age/half_life)`` (0 below 0.01), until the
files fit the budget; the file just written is protected. (All as docs/FORMATS.md, "KVC files and the KV store",
describes it.)

The store deals in checkpoints (:class:`~.checkpoint.Checkpoint`), their token ids and text, and entries; it
never sees a session. :meth:`KVStore.save` stores a checkpoint, :meth:`KVStore.best_prefix` finds the stored
checkpoint to resume token ids from, :meth:`KVStore.load` reads one entry, :meth:`KVStore.mark_loaded` records a
restore (hits, or consuming a long file). What it needs of the model (tokenizer, routed quant bits, config,
fingerprint) is passed in, or comes from the checkpoint (tokens, context, fingerprint). Sessions created with
``kv_store=store`` hold ds4-server's policy (docs/FORMATS.md, the same section): they save "continued"
checkpoints when the live token count reaches a multiple of :meth:`KVStore.continued_step`
(``ceil(continued_interval / align) · align``, align defaulting to the session's chunk step, as ds4-server's 2048
was its chunk), save the live state as "evict" before a cold prefill or a disk load replaces it, and look here in
``sync`` when no in-memory checkpoint is a prefix; ``Session.load(entry, prompt)`` restores a chosen entry.

Beyond ds4: writes are fsynced before the rename; files carry a CRC-32 trailer by default; payloads may be
stored 8-bit and/or zlib/zstd compressed (``compression=``); a damaged file is reported (a
:class:`KVStoreWarning` and ``stats().bad_files``) and skipped, and removed when loading proves it damaged.
Only regular files are entries (a FIFO or a device named like one is reported and never opened for reading
in a way that blocks). A file replacing another for the same text is written, fsynced and renamed over it:
a failed write leaves the old file as it was.

Files carry the writing model's fingerprint (``model.file.fingerprint``, the ``EXT_FINGERPRINT`` trailer of
:mod:`.kvfile`): a lookup for a model skips the files of another model, and loading one for a model refuses
it (kept: it is not damaged). A file without one, as ds4-server writes them, cannot be checked: it is
loaded on ds4's rules (layout, quant byte, chunk layout) with a :class:`KVStoreWarning`, once per file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import numbers
import os
import re
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from gguf import GGMLQuantizationType

from ..config import ds4_model_id
from .checkpoint import Checkpoint, model_fingerprint
from .kvfile import (
    CODECS,
    EXT_RESPONSES_VISIBLE,
    EXT_THINKING_VISIBLE,
    PREFIX_BYTES,
    REASONS,
    KVFile,
    KVFileError,
    KVHeader,
    checksum_status,
    kv_file_parts,
    open_regular,
    pack_payload,
    read_file_trailers,
    reason_code,
    write_file_atomic,
)
from .layout import Geometry
from .payload import VERSION, PayloadError, check_version, with_version

DEFAULT_BUDGET_MB = 4096  # DS4_KVSTORE_DEFAULT_MB
HIT_HALF_LIFE_S = 6 * 60 * 60  # DS4_KVSTORE_HIT_HALF_LIFE_SECONDS
MIN_EFFECTIVE_HITS = 0.01  # KV_CACHE_MIN_EFFECTIVE_HITS
DEFAULT_MIN_TOKENS = 512
DEFAULT_COLD_MAX_TOKENS = 30000
DEFAULT_CONTINUED_INTERVAL = 10000

_NAME = re.compile(r"([0-9a-fA-F]{40})\.kv")
_TMP = re.compile(r"[0-9a-fA-F]{40}\.kv\.tmp\.(\d+)")
_LAYOUT_FIELDS = frozenset({"n_layer", "head_dim", "indexer_head_dim", "vocab"})  # another model's file
# refused but not damaged: left alone ("token text": ids another tokenizer renders differently; "version",
# "payload_abi", "model_id": what another ds4, or another model family, wrote)
_KEEP_FIELDS = _LAYOUT_FIELDS | {"model fingerprint", "file type", "token text", "version", "payload_abi", "model_id"}
_VISIBLE_TEXT = EXT_RESPONSES_VISIBLE | EXT_THINKING_VISIBLE  # ds4's key is visible transcript, not token text
_U32_MAX = 0xFFFFFFFF


EDITED_IN_FILE = "edited before it was saved (the file says so; what the edits were, it does not keep)"


def checked_checkpoint(kf: KVFile, config, fingerprint: str | None, tokenizer=None) -> Checkpoint:
    """The checkpoint of an opened file after the checks a load makes: its checksum (:meth:`KVFile.verify`), its
    model fingerprint against ``fingerprint`` (the loading model's) where both are known and, with ``tokenizer``
    (the loading model's), its text against the text of its token ids (ds4-server's key, unless the file says its
    key is visible transcript text). The checkpoint carries the file's fingerprint, and an edit where the file says
    its state was edited (a session restored from it says so, and a store refuses to keep it). A
    :class:`KVFileError` or :class:`PayloadError` otherwise."""
    kf.verify()
    if fingerprint is not None and kf.fingerprint is not None and kf.fingerprint != fingerprint:
        raise KVFileError(kf.path, "model fingerprint", kf.fingerprint, f"{fingerprint} (this model's)",
                          f"written by another model: its model fingerprint is {kf.fingerprint}, this "
                          f"model's is {fingerprint}")
    cp = Checkpoint.from_bytes(kf.payload(), config, fingerprint=kf.fingerprint)
    if kf.edited:
        cp = dataclasses.replace(cp, edits=(EDITED_IN_FILE,))
    if tokenizer is not None and not kf.header["ext_flags"] & _VISIBLE_TEXT:
        _check_token_text(kf.path, kf.text_bytes, token_text(tokenizer, cp.tokens), len(cp))
    return cp


class KVStoreWarning(UserWarning):
    """A store file that was skipped or removed, or a save that failed."""


@dataclass(frozen=True)
class KVEntry:
    """One file of the store, as the directory scan read it (header only)."""

    sha: str
    path: Path
    file_size: int
    header: KVHeader
    fingerprint: str | None = None  # the writing model's (None: a ds4-server file, which cannot be checked)

    @property
    def tokens(self) -> int:
        return self.header.tokens

    @property
    def text_bytes(self) -> int:
        return self.header.text_bytes

    def prefix_of(self, text: bytes) -> bool:
        """Whether this entry's text is a byte prefix of ``text`` (the SHA-1 of its first ``text_bytes`` bytes is
        the entry's name)."""
        return self.text_bytes <= len(text) and hashlib.sha1(text[:self.text_bytes]).hexdigest() == self.sha


def effective_hits(entry: KVEntry, now: int, half_life_s: float = HIT_HALF_LIFE_S) -> float:
    """``hits · 2^(−(now − last_used)/half_life)``, 0 below 0.01 or without a timestamp (ds4_kvstore.c:498-506)."""
    hits = float(entry.header.hits)
    used_at = entry.header.last_used or entry.header.created
    if used_at == 0:
        return 0.0
    if now > used_at:
        hits *= 2.0 ** (-(now - used_at) / half_life_s)
        if hits < MIN_EFFECTIVE_HITS:
            return 0.0
    return hits


# ds4 since ec6a82aa (2026-05-26): files a person or a shutdown meant to keep ("cold", "evict", "shutdown") score
# twice a routine "continued" waypoint, and a waypoint the incoming file extends (same model and quant, written for a
# context at least the incoming one's: the incoming file loads wherever it does) scores 0.05 + 0.45·h of its score,
# h = eff / (eff + 1) (ds4_kvstore.c's KV_CACHE_ANCHOR_REASON_SCORE_FACTOR and KV_CACHE_CONTINUED_PREFIX_*_FACTOR).
ANCHOR_REASONS = frozenset({REASONS.index("cold"), REASONS.index("evict"), REASONS.index("shutdown")})
ANCHOR_FACTOR = 2.0
SUPERSEDED_MIN_FACTOR, SUPERSEDED_HIT_FACTOR = 0.05, 0.45


@dataclass(frozen=True)
class Incoming:
    """The file a store is making room for, as eviction weighs the files it supersedes
    (``ds4_kvstore_eviction_context``)."""

    text: bytes
    model_id: int
    quant_bits: int
    ctx: int
    reject_different_quant: bool

    def supersedes(self, entry: KVEntry) -> bool:
        """Whether ``entry`` is a "continued" waypoint on this file's path that this file serves as widely: its
        text a strict prefix of ours, the same model (and quant where quants are kept apart), written for a context
        at least ours (a file loads in sessions of its context or more: ours loads wherever it does;
        ``kv_cache_incoming_supersedes_continued``)."""
        h = entry.header
        return (h.reason == REASONS.index("continued") and 0 < h.text_bytes < len(self.text)
                and h.model_id == self.model_id
                and not (self.reject_different_quant and h.quant_bits != self.quant_bits)
                and self.ctx <= h.ctx_size and entry.prefix_of(self.text))


def eviction_score(entry: KVEntry, now: int, half_life_s: float = HIT_HALF_LIFE_S,
                   incoming: Incoming | None = None) -> float:
    """ds4's ``(eff + 1) · tokens / file_size``, weighed by the file's reason and by what ``incoming`` supersedes;
    lower goes first (``ds4_kvstore_entry_eviction_score``)."""
    if entry.file_size == 0:
        return 0.0
    eff = effective_hits(entry, now, half_life_s)
    score = (eff + 1.0) * entry.header.tokens / entry.file_size
    if entry.header.reason in ANCHOR_REASONS:
        score *= ANCHOR_FACTOR
    if incoming is not None and incoming.supersedes(entry):
        score *= SUPERSEDED_MIN_FACTOR + SUPERSEDED_HIT_FACTOR * (eff / (eff + 1.0))
    return score


def routed_quant_bits(model) -> int:
    """The header's quant byte: 4 if layer 0's routed gate experts are Q4_K, else 2 (ds4.c:15980-15985)."""
    gate = model.file.tensors["blk.0.ffn_gate_exps.weight"]
    return 4 if gate.qtype == GGMLQuantizationType.Q4_K else 2


def token_text(tokenizer, ids) -> bytes:
    """The cache text of a token sequence: its tokens' bytes (``ds4_kvstore_render_tokens_text``)."""
    return b"".join(tokenizer.token_bytes(int(t)) for t in ids)


def prompt_text(prompt, tokenizer=None) -> bytes:
    """The cache text of a prompt: bytes as they are, a string's UTF-8, token ids rendered with ``tokenizer``."""
    if isinstance(prompt, bytes):
        return prompt
    if isinstance(prompt, str):
        return prompt.encode()
    if tokenizer is None:
        raise ValueError("a prompt of token ids needs model= to render its text")
    return token_text(tokenizer, prompt)


def _check_token_text(path: Path, stored: bytes, rendered: bytes, n_tokens: int) -> None:
    """Refuse a file whose text is not the text of its token ids (:class:`KVFileError`, field "token text")."""
    if stored == rendered:
        return
    at = next((i for i, (a, b) in enumerate(zip(stored, rendered)) if a != b), min(len(stored), len(rendered)))
    raise KVFileError(path, "token text", f"{len(stored)} bytes", f"the {len(rendered)} bytes of its token ids",
                      f"token text: the file's text ({len(stored)} bytes) is not the text of its {n_tokens} token "
                      f"ids ({len(rendered)} bytes with this model's tokenizer), first differing at byte {at}")


@dataclass(frozen=True)
class KVStoreStats:
    entries: int
    bytes: int
    budget_bytes: int
    lookups: int  # requests that looked in the store
    hits: int  # requests that found an entry (lookup, best_prefix: a session's sync)
    request_hit_rate: float  # hits / lookups
    query_tokens: int  # prompt tokens of the lookups whose length in tokens is known
    hit_tokens: int  # tokens those lookups found stored (vLLM's and llama.cpp's prefix-cache count)
    token_hit_rate: float  # hit_tokens / query_tokens
    effective_hits: dict  # sha -> decayed hits, now
    saves: int  # files written
    skipped: int  # saves refused for the budget (ds4's policy skips below min_tokens are not counted)
    write_errors: int
    evictions: int
    bad_files: int  # damaged, foreign or incompatible files met (each reported once)


def make_store_dir(path) -> Path:
    """A KV store's directory, made with its parents where it is not, for its owner alone (its files hold the
    prompts' text); a file of its name is refused (NotADirectoryError, with no errno: the store's own refusal)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path}: the KV store's directory exists and is not a directory")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


class KVStore:
    """A directory of ``KVC`` files with ds4-server's lookup, hit decay, eviction and write policy.

    ``payload_version``: the ``DSV4`` version of the files it writes, 2 (ds4 since 2026-05-26, e8e8779b) or 1 (for
    a ds4 built before, which refuses 2; a newer one skips 1). It reads both."""

    def __init__(self, dir: str | os.PathLike, budget_mb: float = DEFAULT_BUDGET_MB, *,
                 min_tokens: int = DEFAULT_MIN_TOKENS, cold_max_tokens: int = DEFAULT_COLD_MAX_TOKENS,
                 continued_interval: int = DEFAULT_CONTINUED_INTERVAL, align: int | None = None,
                 half_life_s: float = HIT_HALF_LIFE_S, reject_different_quant: bool = False,
                 compression: str | None = None, checksum: bool = True, payload_version: int = VERSION):
        check_version(payload_version)
        if compression not in CODECS:
            raise ValueError(f"compression must be one of {', '.join(map(repr, CODECS))}, got {compression!r}")
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        if budget_mb is not None and (isinstance(budget_mb, bool) or not isinstance(budget_mb, numbers.Real)
                                      or not 0 <= budget_mb < float("inf")):
            raise ValueError(f"budget_mb must be a number of megabytes, 0 or more (0: the default), got {budget_mb!r}")
        self.dir = make_store_dir(dir)
        self.budget_bytes = int((budget_mb or DEFAULT_BUDGET_MB) * 1024 * 1024)
        self.min_tokens = min_tokens
        self.cold_max_tokens = cold_max_tokens
        self.continued_interval = continued_interval
        self.align = align
        self.half_life_s = half_life_s
        self.reject_different_quant = reject_different_quant
        self.codec_flags = CODECS[compression]
        self.checksum = checksum
        self.payload_version = payload_version
        self._counts = dict.fromkeys(("lookups", "hits", "query_tokens", "hit_tokens", "saves", "skipped",
                                      "write_errors", "evictions"), 0)
        self._reported: set = set()
        self._unverified: set = set()  # files without a fingerprint already reported as such
        self._remove_stale_temporaries()
        self.evict()

    def __repr__(self) -> str:
        return f"KVStore({self.dir}, budget {self.budget_bytes / 2**20:g} MiB)"

    # -- scanning -------------------------------------------------------------------------------------
    def entries(self) -> list[KVEntry]:
        """Every usable file, from a fresh directory listing (ds4 re-lists on every lookup and eviction)."""
        try:
            names = os.listdir(self.dir)
        except OSError as e:
            self._warn(f"{self.dir}: cannot list the KV store: {e}")
            return []
        out = []
        for name in names:
            m = _NAME.fullmatch(name)
            if m is None:
                continue
            path = self.dir / name
            try:
                with open_regular(path) as f:  # a FIFO or a device is refused before any read
                    size = os.fstat(f.fileno()).st_size
                    header = KVHeader.unpack(f.read(PREFIX_BYTES), path)
                    fingerprint = read_file_trailers(f.fileno(), header, path).fingerprint
            except FileNotFoundError:  # removed by another process since the listing
                continue
            except (KVFileError, OSError) as e:
                if getattr(e, "field", None) in _KEEP_FIELDS and _damaged(path):  # a damaged byte, not a writer's
                    _unlink(path)
                self._bad(path, e)
                continue
            out.append(KVEntry(m.group(1).lower(), path, size, header, fingerprint))
        return out

    def _bad(self, path: Path, error: Exception) -> None:
        try:
            st = path.stat()
            key = (path.name, st.st_size, st.st_mtime_ns)
        except OSError:
            key = (path.name, str(error))
        if key not in self._reported:
            self._reported.add(key)
            text = str(error)
            self._warn(f"skipped KV store file: {text if str(path) in text else f'{path}: {text}'}")

    @staticmethod
    def _warn(message: str) -> None:
        warnings.warn(message, KVStoreWarning, stacklevel=3)

    def _remove_stale_temporaries(self) -> None:
        """Temporaries of writers that died (a crash mid-write leaves ``<name>.tmp.<pid>``, never a real name)."""
        for name in os.listdir(self.dir):
            m = _TMP.fullmatch(name)
            if m is None or int(m.group(1)) == os.getpid():
                continue
            try:
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                _unlink(self.dir / name)
            except (PermissionError, OverflowError):
                pass

    # -- eviction -------------------------------------------------------------------------------------
    def evict(self, extra_bytes: int = 0, incoming: Incoming | None = None, keep: str | None = None,
              replacing: str | None = None) -> list[KVEntry]:
        """Delete the lowest-scoring files until the rest and ``extra_bytes`` more fit the budget; returns them in
        deletion order (``ds4_kvstore_evict``). :meth:`put` calls it before it writes, with the new file's size
        and ``incoming`` (so the new file is never its own victim, and the waypoints it extends go first); nothing
        is deleted for a file larger than the whole budget. ``keep`` (a sha) counts but is never a victim;
        ``replacing`` (the sha a write will rename over) neither counts nor is a victim (ds4 deletes it first)."""
        if extra_bytes > self.budget_bytes:
            return []
        entries = [e for e in self.entries() if e.sha != replacing]
        total = sum(e.file_size for e in entries)
        entries = [e for e in entries if e.sha != keep]
        now = int(time.time())
        evicted = []
        while total > self.budget_bytes - extra_bytes and entries:
            # min() keeps the first of equal keys, as ds4's scan does
            victim = min(entries, key=lambda e: (eviction_score(e, now, self.half_life_s, incoming),
                                                 e.header.last_used))
            entries.remove(victim)
            try:
                os.unlink(victim.path)
            except FileNotFoundError:
                pass  # another process removed it: it no longer counts either
            except OSError as e:
                self._warn(f"{victim.path}: cannot evict: {e}")
                break
            else:
                evicted.append(victim)
                self._counts["evictions"] += 1
            total -= victim.file_size
        return evicted

    # -- writing --------------------------------------------------------------------------------------
    def continued_step(self, chunk_step: int) -> int:
        """ds4-server's spacing of "continued" checkpoints: ``⌈continued_interval / align⌉ · align`` tokens,
        ``align`` defaulting to ``chunk_step`` (the session's chunk step, as ds4-server's 2048 was its chunk); 0 when
        ``continued_interval`` is 0 (none). A session stores one whenever its token count is a multiple of it
        (``ds4_kvstore_continued_store_target``, ds4_kvstore.c:684-702)."""
        align = self.align or chunk_step
        return -(-self.continued_interval // align) * align if self.continued_interval > 0 else 0

    def save(self, checkpoint: Checkpoint, model, reason: str = "shutdown") -> KVEntry | None:
        """Store ``checkpoint`` (e.g. ``Session.snapshot()``) of ``model`` under the text of its tokens (rendered
        with ``model``'s tokenizer), in the store's codec, with ``model``'s routed quant byte, the checkpoint's
        context and model fingerprint. Returns the entry (a compatible file already stored for that text is kept
        as it is), or None: below ``min_tokens`` or without logits (ds4's policy, silently), over the budget or
        on a write error (a :class:`KVStoreWarning` says why). A checkpoint of another model is refused
        (:class:`~.payload.PayloadError` naming the field, :meth:`Checkpoint.check_model`), and so is an edited one
        (a ValueError: its ``edits`` are not the state of its text; :func:`ds4lab.kv.edit.save_kv` writes it)."""
        reason_code(reason)
        cp = checkpoint
        cp.check_model(model.config, model_fingerprint(model))
        if cp.edits:
            raise ValueError(f"this checkpoint is edited ({'; '.join(cp.edits)}): a store entry would be restored as "
                             "the state of its text; write it with ds4lab.kv.edit.save_kv(checkpoint, path, model)")
        if len(cp) < self.min_tokens or cp.logits is None:
            return None
        try:
            payload = pack_payload(with_version(cp.to_bytes(), self.payload_version), model.config, self.codec_flags)
        except ValueError as e:  # e.g. a non-finite logit: never write what the loader refuses
            self._counts["write_errors"] += 1
            self._warn(f"KV store did not save {len(cp)} tokens: {e}")
            return None
        return self.put(token_text(model.tokenizer, cp.tokens), payload, tokens=len(cp), ctx=cp.ctx,
                        quant_bits=routed_quant_bits(model), reason=reason, codec_flags=self.codec_flags,
                        fingerprint=cp.fingerprint, model_id=ds4_model_id(model.config))

    def put(self, text: bytes, payload: bytes, *, tokens: int, ctx: int, quant_bits: int,
            reason: str = "unknown", codec_flags: int = 0, fingerprint: str | None = None,
            model_id: int = 0) -> KVEntry | None:
        """Write one file atomically: temporary file, fsync, rename (``ds4_kvstore_store_live_prefix_text``,
        ds4_kvstore.c:876-1079); the store's one writer (:meth:`save` packs a checkpoint and calls it; call it
        for a payload already in stored form, e.g. ds4-server's bytes). ``payload`` is in its stored form,
        ``codec_flags`` (:data:`CODECS`) say which.
        ``fingerprint``: the writing model's (``model.file.fingerprint``), kept in a trailer ds4 never reads;
        ``model_id``: header byte 7 (0 Flash, 1 Pro: :func:`ds4lab.config.ds4_model_id`). The
        payload is ``DSV4`` version :attr:`payload_version` (the header's ABI byte follows it).

        A file already stored for the text is kept when compatible (ds4's rule, plus: written by the same model,
        or by an unknown one); otherwise the new file is renamed over it only once it is written and synced, so
        a failed write leaves it as it was (ds4 deletes it first)."""
        header, parts = kv_file_parts(text, payload, tokens=tokens, ctx=ctx, quant_bits=quant_bits, reason=reason,
                                      codec_flags=codec_flags, fingerprint=fingerprint, with_checksum=self.checksum,
                                      payload_version=self.payload_version, model_id=model_id)
        size = sum(len(part) for part in parts)
        if size + -(-size // 100) > self.budget_bytes:  # 1% headroom (ds4_kvstore.c:738-748)
            self._counts["skipped"] += 1
            self._warn(f"KV store skipped {tokens} tokens: the file would be {size / 2**20:.2f} MiB "
                       f"({(size + -(-size // 100)) / 2**20:.2f} MiB with 1% headroom), over the budget of "
                       f"{self.budget_bytes / 2**20:.2f} MiB")
            return None
        sha = hashlib.sha1(text).hexdigest()
        path = self.dir / f"{sha}.kv"
        existing = self._existing_compatible(path, sha, text, quant_bits, ctx, fingerprint, model_id)
        if existing is not None:
            return existing
        self.evict(size, Incoming(text, model_id, quant_bits, ctx, self.reject_different_quant), replacing=sha)
        try:
            write_file_atomic(path, parts)
        except OSError as e:
            self._counts["write_errors"] += 1
            kept = "; the file already stored for this text is kept as it was" if os.path.lexists(path) else ""
            self._warn(f"{path}: KV store write failed, nothing stored{kept}: {e}")
            return None
        try:  # the rename is durable once the folder is synced; the file is in place either way
            _fsync_dir(self.dir)
        except OSError as e:
            self._warn(f"{self.dir}: the KV store folder could not be synced after writing {path.name}: {e}")
        self._counts["saves"] += 1
        # Another process may have written while this one did: ds4 leaves the excess to its next store, here the
        # store is back within its budget when put returns.
        self.evict(keep=sha)
        return KVEntry(sha, path, size, header, fingerprint)

    def _existing_compatible(self, path: Path, sha: str, text: bytes, quant_bits: int, ctx: int,
                             fingerprint: str | None = None, model_id: int = 0) -> KVEntry | None:
        """ds4 keeps a file already stored for this text if it is of the same model id, its quant is acceptable,
        its ctx is at most ours and its text is ours (``kv_cache_existing_compatible``); here also only if no
        other model wrote it. Otherwise None: the caller's rename replaces it once the new file is written
        (ds4 unlinks it first, so a failed write would lose both)."""
        try:
            with open_regular(path) as f:
                size = os.fstat(f.fileno()).st_size
                header = KVHeader.unpack(f.read(PREFIX_BYTES), path)
                theirs = read_file_trailers(f.fileno(), header, path).fingerprint
                stored = f.read(header.text_bytes)
        except (KVFileError, OSError):  # absent or unreadable: the rename replaces it
            return None
        if (header.model_id != model_id or (self.reject_different_quant and header.quant_bits != quant_bits)
                or header.ctx_size > ctx or stored != text
                or (fingerprint is not None and theirs is not None and theirs != fingerprint)):
            return None
        return KVEntry(sha, path, size, header, theirs)

    # -- lookup and load ------------------------------------------------------------------------------
    def candidates(self, text: bytes, ctx: int | None = None, quant_bits: int | None = None,
                   fingerprint: str | None = None, model_id: int | None = None) -> list[KVEntry]:
        """Entries whose text is a byte prefix of ``text``, best first: longest text, then most tokens
        (``ds4_kvstore_find_text_prefix``). With ``fingerprint`` (the model's), files another model wrote are left
        out; files without a fingerprint (ds4-server's) stay in. With ``model_id`` (header byte 7), files of
        another model family are left out, as ds4 does."""
        out = []
        for e in self.entries():
            h = e.header
            if h.tokens < self.min_tokens or (ctx is not None and h.ctx_size > ctx):
                continue
            if model_id is not None and h.model_id != model_id:
                continue
            if self.reject_different_quant and quant_bits is not None and h.quant_bits != quant_bits:
                continue
            if fingerprint is not None and e.fingerprint is not None and e.fingerprint != fingerprint:
                continue
            if e.prefix_of(text):
                out.append(e)
        return sorted(out, key=lambda e: (-e.header.text_bytes, -e.header.tokens))

    def lookup(self, prompt, *, model=None, ctx: int | None = None) -> KVEntry | None:
        """The entry with the longest stored prefix of ``prompt``: bytes, a string (UTF-8) or token ids
        (rendered with ``model``'s tokenizer). ``ctx`` drops entries written for a larger context."""
        tokenizer = model.tokenizer if model is not None else None
        text = prompt_text(prompt, tokenizer)
        if isinstance(prompt, bytes):
            n_tokens = None
        elif isinstance(prompt, str):
            n_tokens = len(tokenizer.encode(prompt)) if tokenizer is not None else None
        else:
            n_tokens = len(prompt)
        found = self.candidates(text, ctx, *((routed_quant_bits(model), model_fingerprint(model),
                                              ds4_model_id(model.config)) if model is not None else ()))
        self._count(n_tokens, found[0].tokens if found else 0)
        return found[0] if found else None

    def best_prefix(self, ids, model, geometry: Geometry) -> tuple[KVEntry, Checkpoint] | None:
        """The stored checkpoint to resume ``ids`` from in a session of ``geometry`` on ``model``: the longest
        stored prefix (:meth:`candidates` of the ids' text) that loads, whose token ids are exactly ``ids``' own
        and that such a session can restore (:meth:`Checkpoint.check_fits`, ds4's loader rules); None when none
        does. Counts a lookup (and its tokens); the caller restores the checkpoint and then calls
        :meth:`mark_loaded`. Files that cannot serve are skipped: damaged ones removed, another model's or
        another session geometry's kept, all reported (:class:`KVStoreWarning`)."""
        ids = [int(t) for t in ids]
        fingerprint = model_fingerprint(model)
        found = None
        for entry in self.candidates(token_text(model.tokenizer, ids), geometry.ctx, routed_quant_bits(model),
                                     fingerprint, ds4_model_id(model.config)):
            if entry.tokens > len(ids):
                continue
            try:
                cp = self.load(entry, model.config, fingerprint, tokenizer=model.tokenizer)
                if cp is None or list(cp.tokens) != ids[:len(cp)]:
                    continue  # removed since the scan; or the same bytes tokenized differently
                cp.check_fits(model.config, geometry, fingerprint)
            except OSError:  # unreadable
                continue
            except KVFileError:  # damaged (removed) or another model's (kept): reported by load
                continue
            except PayloadError as e:  # made for another session geometry (ds4's loader rules): kept
                self._bad(entry.path, KVFileError.of_payload(entry.path, e))
                continue
            found = entry, cp
            break
        self._count(len(ids), len(found[1]) if found else 0)
        return found

    def load(self, entry: KVEntry, config, fingerprint: str | None = None, *, tokenizer=None) -> Checkpoint | None:
        """Read and check one file (plain reads, as ds4) and return its checkpoint, counting no hit (the caller
        does, with :meth:`mark_loaded`, once it has restored it), or None when the file is gone (another process
        evicted or consumed it since the lookup: a miss). A file proven damaged (structure, checksum, text hash,
        token count, values) is removed; one written for another model (layout, or ``fingerprint``: the loading
        model's, refused when the file carries another) is kept; both raise :class:`KVFileError`. With
        ``tokenizer`` (the loading model's), the file's text must be the text of its token ids (ds4-server's
        key, unless the file says its key is visible transcript text), else it is refused and kept (its
        tokens may be another tokenizer's). A file without a fingerprint (ds4-server's) cannot be checked: it
        loads, with a :class:`KVStoreWarning` the first time when ``fingerprint`` is given. The checkpoint
        carries the file's fingerprint."""
        buf = None
        try:
            try:
                with open_regular(entry.path) as f:
                    buf = f.read()
            except FileNotFoundError:
                return None
            kf = KVFile(buf, entry.path, config)
            if kf.sha1 != entry.sha:
                raise KVFileError(entry.path, "text", f"SHA-1 {kf.sha1}", f"{entry.sha} (the file's name)")
            cp = checked_checkpoint(kf, config, fingerprint, tokenizer)
        except (KVFileError, PayloadError) as e:
            # another model's or another ds4's file is left alone, unless ds4lab's own checksum proves it damaged
            damaged = buf is not None and checksum_status(buf, entry.path)[0] == "mismatch"
            if e.field.removeprefix("payload ") not in _KEEP_FIELDS or damaged:
                _unlink(entry.path)
            self._bad(entry.path, e)
            if isinstance(e, KVFileError):
                raise
            raise KVFileError.of_payload(entry.path, e) from e
        if fingerprint is not None and kf.fingerprint is None:
            self._unverifiable(entry)
        return cp

    def _unverifiable(self, entry: KVEntry) -> None:
        key = (entry.path.name, entry.header.created, entry.file_size)
        if key not in self._unverified:
            self._unverified.add(key)
            self._warn(f"{entry.path}: loaded a KV cache file with no model fingerprint (as ds4-server writes "
                       f"them): ds4lab cannot check which model wrote it; it was checked on ds4's rules only "
                       f"(layout, quant byte, chunk layout)")

    def mark_loaded(self, entry: KVEntry) -> None:
        """Record that ``entry``'s checkpoint was restored: hits + 1 and last_used = now (``ds4_kvstore_touch_file``,
        ds4_kvstore.c:467-484). The file stays whatever its length, as in ds4 since 24fa85ea ("the cold-prompt save
        limit no longer deletes deeper cold or continued checkpoints after their first restore"): eviction alone
        reclaims files; ``cold_max_tokens`` bounds the cold saves only."""
        try:
            with open_regular(entry.path, "r+b") as f:
                now = KVHeader.unpack(f.read(PREFIX_BYTES), entry.path)
                same = (now.created, now.tokens, now.text_bytes, now.payload_bytes)
                if same != (entry.header.created, entry.tokens, entry.text_bytes, entry.header.payload_bytes):
                    return  # replaced by another writer since the scan
                # the two fields alone, in place (outside the checksum; every other byte stays as written, a
                # reason or reserved byte this ds4lab does not know included); hits saturates at the u32 maximum
                # (ds4's u32 wraps to 0)
                f.seek(12)
                f.write(struct.pack("<I", min(now.hits + 1, _U32_MAX)))
                f.seek(32)
                f.write(struct.pack("<Q", int(time.time())))
        except (OSError, KVFileError):
            pass

    def _count(self, query_tokens: int | None, hit_tokens: int) -> None:
        c = self._counts
        c["lookups"] += 1
        c["hits"] += hit_tokens > 0
        if query_tokens is not None:
            c["query_tokens"] += query_tokens
            c["hit_tokens"] += hit_tokens

    # -- stats ----------------------------------------------------------------------------------------
    def stats(self) -> KVStoreStats:
        entries = self.entries()
        c = self._counts
        now = int(time.time())
        return KVStoreStats(
            entries=len(entries), bytes=sum(e.file_size for e in entries), budget_bytes=self.budget_bytes,
            lookups=c["lookups"], hits=c["hits"], request_hit_rate=c["hits"] / c["lookups"] if c["lookups"] else 0.0,
            query_tokens=c["query_tokens"], hit_tokens=c["hit_tokens"],
            token_hit_rate=c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0,
            effective_hits={e.sha: effective_hits(e, now, self.half_life_s) for e in entries},
            saves=c["saves"], skipped=c["skipped"], write_errors=c["write_errors"], evictions=c["evictions"],
            bad_files=len(self._reported))


def _damaged(path: Path) -> bool:
    """Whether ds4lab's checksum proves the file damaged (reads it whole: only for a header refused as another
    writer's, which a flipped bit in byte 7 or 20 can fake)."""
    try:
        with open_regular(path) as f:
            return checksum_status(f.read(), path)[0] == "mismatch"
    except (OSError, KVFileError):
        return False


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
