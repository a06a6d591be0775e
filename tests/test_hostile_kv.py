"""Hostile and edge-case KV state (issue 22, KV side): non-regular files in a store, counters outside the
checksum at their limits, a full context, failed replacements, two models sharing one store, invalid token
ids, damaged files under ``inspect``, huge timestamps, another model's checkpoint, out-of-range payload
values and entries evicted between lookup and load. Every refusal names the file (where there is one) and
the field."""

import errno
import hashlib
import os
import re
import resource
import struct
import subprocess
import sys
import time
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest

import ds4lab
from ds4lab import cli
from ds4lab.config import NANO
from ds4lab.kv.kvfile import EXT_Q8, KVFile, KVFileError, pack_payload
from ds4lab.kv.payload import PayloadError, decode_payload, encode_payload, with_version
from ds4lab.kv.store import KVStore, KVStoreWarning
from ds4lab.testing import make_model
from tests.test_payload import random_payload
from tests.test_store import spec_header

ROOT = Path(__file__).resolve().parents[1]
IDS = np.random.default_rng(22).integers(0, 1000, 80).tolist()
U32_MAX, U64_MAX = 0xFFFFFFFF, 0xFFFFFFFFFFFFFFFF


@pytest.fixture(scope="module")
def emb():
    """The embedded model: 6 layers, vocab 2048, window 64."""
    return ds4lab.load(backend="numpy")


@pytest.fixture(scope="module")
def twins(tmp_path_factory):
    """Two models of the same configuration (NANO) with other weights."""
    root = tmp_path_factory.mktemp("twins")
    return tuple(ds4lab.load(make_model(NANO, root / f"{name}.gguf", seed=seed), backend="numpy")
                 for name, seed in (("a", 101), ("b", 202)))


def nano_payload(T=40, ctx=64, chunk=16, seed=1) -> bytes:
    return encode_payload(random_payload(NANO, T, ctx, chunk, seed=seed), NANO)


def run_isolated(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` in a child process with 4 GiB of address space: a read that never ends fails there quickly,
    a blocking open times out (subprocess.TimeoutExpired fails the test)."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                          preexec_fn=limit, cwd=ROOT)


# -- 2: only regular files are entries; KVFile.open refuses anything else without blocking -------------

def test_fifo_and_device_in_a_store_block_nothing(tmp_path):
    store = KVStore(tmp_path, min_tokens=1)
    good = store.put(b"a good entry", nano_payload(), tokens=40, ctx=64, quant_bits=2)
    fifo, zero = tmp_path / ("a" * 40 + ".kv"), tmp_path / ("b" * 40 + ".kv")
    os.mkfifo(fifo)
    os.symlink("/dev/zero", zero)
    code = f"""
import warnings
from pathlib import Path
from ds4lab.kv.store import KVStore
from ds4lab.kv.kvfile import KVFile, KVFileError
d = Path({str(tmp_path)!r})
with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    store = KVStore(d, min_tokens=1)
    print("ENTRIES", sorted(e.path.name for e in store.entries()))
    print("LOOKUP", store.lookup(b"a good entry and more").path.name)
    store.put(b"another entry", open({str(good.path)!r}, "rb").read()[52 + 12:-8], tokens=40, ctx=64, quant_bits=2)
    print("ENTRIES", len(store.entries()))
for w in seen:
    print("WARN", w.message)
for p in ({str(fifo)!r}, {str(zero)!r}):
    try:
        KVFile.open(p)
        print("OPENED", p)
    except KVFileError as e:
        print("REFUSED", e.field, "|", e)
"""
    proc = run_isolated(code)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert f"ENTRIES {[good.path.name]}" in out and "ENTRIES 2" in out
    assert f"LOOKUP {good.path.name}" in out
    refused = [line for line in out.splitlines() if line.startswith("REFUSED")]
    assert len(refused) == 2 and "OPENED" not in out
    for line, path, kind in zip(refused, (fifo, zero), ("FIFO", "character device")):
        assert line.startswith("REFUSED file type |") and str(path) in line and kind in line, line
        assert "regular file" in line
    warned = [line for line in out.splitlines() if line.startswith("WARN")]
    assert any(fifo.name in w and "regular file" in w for w in warned), warned


# -- 3: hits and last_used (outside the checksum) may hold any value -----------------------------------

def test_counters_outside_the_checksum_never_crash(emb, tmp_path):
    store = KVStore(tmp_path, min_tokens=16)
    s = emb.session(ctx=64, prefill_chunk=16)
    s.sync(IDS[:40])
    entry = store.save(s.snapshot(), s.model)
    for hits in (U32_MAX, U32_MAX - 1, 2**31, 0):
        for last_used in (U64_MAX, 2**63, 2**62, 0):
            with open(entry.path, "r+b") as f:
                f.seek(12)
                f.write(struct.pack("<I", hits))
                f.seek(32)
                f.write(struct.pack("<Q", last_used))
            kf = KVFile.open(entry.path)
            kf.verify()  # both fields are outside the CRC
            assert str(last_used) in kf.summary()
            assert store.evict() == [] and np.isfinite(store.stats().effective_hits[entry.sha])
            assert store.lookup(IDS[:41], model=emb).path == entry.path
            t = emb.session(ctx=64, prefill_chunk=16, kv_store=store)
            assert t.sync(IDS[:41]).source == "disk"  # loads and counts a hit: hits + 1 saturates
            header = KVFile.open(entry.path).header
            assert header["hits"] == min(hits + 1, U32_MAX)
            assert abs(header["last_used"] - time.time()) < 60
    assert entry.path.exists()


# -- 4: a full context is saved and loaded ------------------------------------------------------------

def test_a_full_context_is_saved_and_loaded(emb, tmp_path):
    """ds4's loader refuses T ≥ the *current* ctx only (ds4.c:16487); it never compares T with the saved ctx.
    A full state (T = ctx) therefore loads as a file and restores into a larger session, as in ds4."""
    store = KVStore(tmp_path, min_tokens=16, continued_interval=64)  # a continued save at 64 tokens
    s = emb.session(ctx=64, prefill_chunk=16, kv_store=store)
    s.sync(IDS[:56])
    d = s.decoder(temperature=0)
    list(d.stream(20))
    assert len(s.tokens) == 64 and d.stop_reason == "ctx"
    full = s.checkpoint()
    (entry,) = [e for e in store.entries() if e.tokens == 64]
    assert KVFile.open(entry.path).header["reason"] == "continued"
    KVFile.open(entry.path, emb.config).verify()
    cp = store.load(entry, emb.config)
    assert len(cp) == 64 and entry.path.exists()  # loaded, not refused and deleted
    assert len(ds4lab.Checkpoint.from_bytes(full.to_bytes(), emb.config)) == 64
    # kept: a compatible file for the same text
    assert store.save(s.snapshot(), s.model, reason="shutdown").path == entry.path

    nxt = int(np.argmax(s.logits))
    bigger = emb.session(ctx=128, prefill_chunk=16, kv_store=store)
    r = bigger.sync(s.tokens + [nxt])
    assert (r.source, r.reused, r.evaluated) == ("disk", 64, 1)
    ref = emb.session(ctx=128, prefill_chunk=16)
    ref.restore(full)  # through the payload: another geometry
    ref.sync(s.tokens + [nxt])
    assert np.array_equal(bigger.logits, ref.logits)
    assert entry.path.exists()

    same = emb.session(ctx=64, prefill_chunk=16)
    same.restore(full)  # the live state itself
    assert same.tokens == s.tokens
    # ds4's rule for a session of the same ctx: one slot must stay free (kept; the store never offers it there)
    with pytest.raises(PayloadError, match="n_tokens is 64, expected less than the current context 64"):
        emb.session(ctx=64, prefill_chunk=16).restore(cp)


# -- 5: write, then rename: a failed replacement keeps the old file ------------------------------------

def test_a_failed_replacement_keeps_the_old_entry(tmp_path, monkeypatch):
    store = KVStore(tmp_path, min_tokens=1)
    old = store.put(b"the same text", nano_payload(ctx=128), tokens=40, ctx=128, quant_bits=2)
    before = old.path.read_bytes()

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.warns(KVStoreWarning, match="No space left"):  # a smaller-ctx save replaces it (ds4's rule)
        assert store.put(b"the same text", nano_payload(ctx=64), tokens=40, ctx=64, quant_bits=2) is None
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == [old.path.name] and old.path.read_bytes() == before
    new = store.put(b"the same text", nano_payload(ctx=64), tokens=40, ctx=64, quant_bits=2)
    assert new.path == old.path and KVFile.open(new.path).header["ctx_size"] == 64
    assert sorted(os.listdir(tmp_path)) == [old.path.name]


def test_a_replacement_killed_mid_write_keeps_the_old_entry(tmp_path):
    """SIGKILL while the replacing file is being written: the old file is whole, the temporary goes at the next open."""
    store = KVStore(tmp_path, min_tokens=1)
    old = store.put(b"the same text", nano_payload(ctx=128), tokens=40, ctx=128, quant_bits=2)
    before = old.path.read_bytes()
    ready = tmp_path.parent / f"{tmp_path.name}.ready"
    code = f"""
import os, time
from pathlib import Path
from ds4lab.kv.store import KVStore
from tests.test_hostile_kv import nano_payload

def stall(fd):
    Path({str(ready)!r}).touch()
    time.sleep(120)

os.fsync = stall
KVStore({str(tmp_path)!r}, min_tokens=1).put(b"the same text", nano_payload(ctx=64), tokens=40, ctx=64, quant_bits=2)
"""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the writer did not reach its fsync"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()
    assert old.path.read_bytes() == before
    assert any(".tmp." in n for n in os.listdir(tmp_path))  # it died mid-write
    store = KVStore(tmp_path, min_tokens=1)
    assert sorted(os.listdir(tmp_path)) == [old.path.name]
    assert len(store.load(old, NANO)) == 40


# -- 8: the model fingerprint in store files and live checkpoints ---------------------------------------

def test_a_store_shared_by_two_models_of_one_config_serves_each_its_own(twins, tmp_path):
    a, b = twins
    assert a.config == b.config and a.file.fingerprint != b.file.fingerprint
    store = KVStore(tmp_path, min_tokens=16)
    sa = a.session(ctx=64, prefill_chunk=16)
    sa.sync(IDS[:40])
    entry = store.save(sa.snapshot(), sa.model)
    kf = KVFile.open(entry.path, a.config)
    kf.verify()
    assert kf.fingerprint == entry.fingerprint == a.file.fingerprint
    assert a.file.fingerprint in kf.summary()
    # ds4's file first (header, text, payload: what ds4 reads), then ds4lab's trailers, which ds4 never reads
    data = entry.path.read_bytes()
    end = 52 + entry.text_bytes + entry.header.payload_bytes
    assert data[52 + entry.text_bytes:end] == sa.checkpoint().to_bytes()
    # an ABI-2 file (byte 20): one 28-byte trailer, "KFP", 2, the fingerprint, flags 1 (the CRC follows), the CRC
    assert data[20] == 2 and data[6] & 0x88 == 0x80 and len(data) == end + 28
    assert data[end:end + 4] == b"KFP\x02" and data[end + 4:end + 20] == bytes.fromhex(a.file.fingerprint)
    assert struct.unpack_from("<II", data, end + 20) == (1, zlib.crc32(data[:12] + bytes(4) + data[16:32] + bytes(8)
                                                                      + data[40:end + 24]))

    assert store.lookup(IDS[:40], model=b) is None and store.lookup(IDS[:40], model=a).path == entry.path
    sb = b.session(ctx=64, prefill_chunk=16, kv_store=store)
    r = sb.sync(IDS[:41])
    ref = b.session(ctx=64, prefill_chunk=16)
    ref.sync(IDS[:41])
    assert r.source == "cold" and np.array_equal(sb.logits, ref.logits)
    with pytest.warns(KVStoreWarning, match="another model"), \
            pytest.raises(KVFileError, match=f"{a.file.fingerprint}.*{b.file.fingerprint}") as ei:
        store.load(entry, b.config, fingerprint=b.file.fingerprint)
    assert ei.value.field == "model fingerprint" and str(entry.path) in str(ei.value)
    assert entry.path.exists()  # another model's file is left alone
    assert a.session(ctx=64, prefill_chunk=16, kv_store=store).sync(IDS[:41]).source == "disk"
    with pytest.raises(PayloadError, match=f"{a.file.fingerprint}.*{b.file.fingerprint}") as ei:
        store.save(sa.snapshot(), b)  # a's checkpoint is not stored as b's
    assert ei.value.field == "model fingerprint" and [e.path for e in store.entries()] == [entry.path]


def test_live_checkpoints_and_payloads_refuse_another_models_state(twins):
    a, b = twins
    sa = a.session(ctx=64, prefill_chunk=16)
    chunks = sa.prefill(IDS[:40]).run(progress=False)
    sb = b.session(ctx=64, prefill_chunk=16)
    sb.sync(IDS[:20])
    tokens = list(sb.tokens)
    for cp in (sa.checkpoint(), chunks[0].checkpoint,
               ds4lab.Checkpoint.from_bytes(sa.checkpoint().to_bytes(), a.config, fingerprint=a.file.fingerprint)):
        assert cp.fingerprint == a.file.fingerprint
        with pytest.raises(PayloadError, match=f"{a.file.fingerprint}.*{b.file.fingerprint}") as ei:
            sb.restore(cp)
        assert ei.value.field == "model fingerprint" and sb.tokens == tokens
        with pytest.raises(PayloadError, match="model fingerprint"):
            cp.state_for(b.config, b.backend, sb.geometry, fingerprint=b.file.fingerprint)
    # bare DSV4 bytes carry no fingerprint (ds4's format has no field for it): they cannot be checked
    bare = ds4lab.Checkpoint.from_bytes(sa.checkpoint().to_bytes(), a.config)
    assert bare.fingerprint is None
    sb.restore(bare)
    assert sb.tokens == IDS[:40]


def test_a_ds4_server_file_without_fingerprint_loads_with_a_warning(twins, tmp_path):
    a, b = twins
    sa = a.session(ctx=64, prefill_chunk=16)
    sa.sync(IDS[:40])
    text = b"".join(a.tokenizer.token_bytes(t) for t in IDS[:40])
    store = KVStore(tmp_path, min_tokens=16, checksum=False)
    entry = store.put(text, sa.checkpoint().to_bytes(), tokens=40, ctx=64, quant_bits=2)  # ds4-server's bytes
    assert entry.fingerprint is None and KVFile.open(entry.path).fingerprint is None
    assert len(entry.path.read_bytes()) == 52 + len(text) + entry.header.payload_bytes
    sb = b.session(ctx=64, prefill_chunk=16, kv_store=store)
    with pytest.warns(KVStoreWarning, match="no model fingerprint.*cannot check") as seen:
        assert sb.sync(IDS[:40]).source == "disk"
    assert any(entry.path.name in str(w.message) for w in seen)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVStoreWarning)  # said once per file
        assert b.session(ctx=64, prefill_chunk=16, kv_store=store).sync(IDS[:40]).source == "disk"
    assert "none" in KVFile.open(entry.path).summary().split("model fingerprint")[1].splitlines()[0]


def test_load_kv_checks_the_checksum_and_the_model(twins, tmp_path):
    """A lone .kv file read by load_kv is checked as a store checks one: Checkpoint.from_bytes(kf.payload()) took
    a damaged file and another model's of the same shape without a word."""
    from ds4lab.kv.edit import load_kv, save_kv

    a, b = twins
    sa = a.session(ctx=64, prefill_chunk=16)
    sa.prefill(IDS[:40]).run(progress=False)
    kf = save_kv(sa.checkpoint(), tmp_path / "a.kv", a)
    cp = load_kv(kf.path, a)
    assert list(cp.tokens) == IDS[:40] and cp.fingerprint == a.file.fingerprint
    with pytest.raises(KVFileError, match=f"{a.file.fingerprint}.*{b.file.fingerprint}") as ei:
        load_kv(kf.path, b)
    assert ei.value.field == "model fingerprint" and str(kf.path) in str(ei.value)
    data = bytearray(kf.path.read_bytes())
    data[len(data) // 2] ^= 0x01  # a payload byte (the payload is most of the file): the checksum fails
    flipped = tmp_path / "flipped.kv"
    flipped.write_bytes(bytes(data))
    with pytest.raises(KVFileError, match="checksum") as ei:
        load_kv(flipped, a)
    assert str(flipped) in str(ei.value)


# -- 11: invalid token ids are refused before the session is touched -----------------------------------

@pytest.mark.parametrize("bad,position,shown", [
    ([5, -1], 1, "-1"), ([7, 2048], 1, "2048"), ([3, 4, 2**40], 2, str(2**40)), ([1, 2.5], 1, "2.5"),
    ([1, "x"], 1, "'x'"), ([0, 2**70], 1, str(2**70)), (np.array([9, 2**64 - 1], dtype=np.uint64), 1, str(2**64 - 1)),
])
def test_invalid_token_ids_leave_the_session_alone(emb, tmp_path, bad, position, shown):
    store = KVStore(tmp_path, min_tokens=16)
    s = emb.session(ctx=64, prefill_chunk=16, kv_store=store)
    s.sync(IDS[:30])
    tokens, logits = list(s.tokens), s.logits.copy()
    for call in (s.sync, s.prefill):
        with pytest.raises(ValueError, match=rf"token {position} is {re.escape(shown)}(?![0-9])") as ei:
            call(bad)
        assert "2048" in str(ei.value)  # the vocabulary size
        assert s.tokens == tokens and np.array_equal(s.logits, logits)
    assert store.entries() == []  # and nothing was saved as "evict" either


# -- 12 and 13: inspect verifies the checksum and prints any timestamp ---------------------------------

def inspect(path, capsys):
    code = cli.main(["inspect", str(path)])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_inspect_verifies_the_checksum(tmp_path, capsys):
    store = KVStore(tmp_path / "c", min_tokens=1)
    entry = store.put(b"inspected text", nano_payload(), tokens=40, ctx=64, quant_bits=2)
    code, out, _ = inspect(entry.path, capsys)
    assert code == 0 and "checksum: ok" in out
    data = bytearray(entry.path.read_bytes())
    data[-9] ^= 0x40  # the last payload byte: the structure still parses
    entry.path.write_bytes(bytes(data))
    code, out, err = inspect(entry.path, capsys)
    assert code != 0 and "tokens 40" in out and "layer ratio" in out  # printed what it could
    assert "checksum: MISMATCH" in out and "Traceback" not in err
    assert "MISMATCH: checksum mismatch" not in out  # said once
    plain = KVStore(tmp_path / "p", min_tokens=1, checksum=False)
    entry = plain.put(b"inspected text", nano_payload(), tokens=40, ctx=64, quant_bits=2)
    code, out, _ = inspect(entry.path, capsys)
    assert code == 0 and "checksum: none" in out


def test_inspect_reads_no_checksum_from_a_file_cut_short(tmp_path, capsys):
    """A .kv file cut short (or one shorter than the fixed header) has no trailer at its end: inspect says it read
    none, rather than a verdict on whatever bytes end it, and the one error line names the file's size."""
    store = KVStore(tmp_path / "c", min_tokens=1)
    entry = store.put(b"inspected text", nano_payload(), tokens=40, ctx=64, quant_bits=2)
    data = entry.path.read_bytes()
    for cut, said in ((5000, "the file's size is not the one its header gives"), (30, "30 bytes, fewer than")):
        path = tmp_path / f"cut{cut}.kv"
        path.write_bytes(data[:cut])
        code, out, err = inspect(path, capsys)
        assert code != 0 and f"checksum: not read ({said}" in out and "MISMATCH" not in out, out
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


def test_huge_timestamps_are_printed_raw(tmp_path, capsys):
    payload = nano_payload()
    text = b"from the far future"
    path = tmp_path / (hashlib.sha1(text).hexdigest() + ".kv")
    for created, last_used in ((2**62, U64_MAX), (2**63, 2**62), (U64_MAX, 0)):
        path.write_bytes(spec_header(40, len(payload), len(text), ctx=64, created=created, last_used=last_used)
                         + text + payload)
        summary = KVFile.open(path).summary()
        assert f"created {created} (" in summary and "not a date" in summary
        code, out, _ = inspect(path, capsys)
        assert code == 0 and f"created {created} (" in out
    store = KVStore(tmp_path, min_tokens=1)
    assert len(store.load(store.lookup(text + b"!"), NANO)) == 40


# -- 14: another model's layer count is a clear error --------------------------------------------------

def test_a_checkpoint_of_another_layer_count_is_a_clear_error(emb, model_paths):
    four = ds4lab.load(model_paths["q4k"], backend="numpy")
    s = emb.session(ctx=24, prefill_chunk=8)
    s.sync(IDS[:15])
    t = four.session(ctx=24, prefill_chunk=8)
    assert s.geometry == t.geometry and four.config.n_layer == 4 and emb.config.n_layer == 6
    cp = s.checkpoint()
    for checkpoint in (cp, ds4lab.Checkpoint(cp.tokens, cp.logits, cp.state)):  # with and without its config
        with pytest.raises(PayloadError, match="n_layer is 6, expected 4") as ei:
            t.restore(checkpoint)
        assert ei.value.field == "n_layer" and t.tokens == []


# -- 16: token ids and logits are checked ---------------------------------------------------------------

def test_payload_values_out_of_range_are_refused(tmp_path):
    good = nano_payload()
    tokens_at, logits_at = 52, 52 + 4 * 40
    bad_token = bytearray(good)
    struct.pack_into("<I", bad_token, tokens_at + 4 * 3, 1024)  # NANO's vocab is 1024
    bad_logit = bytearray(good)
    struct.pack_into("<f", bad_logit, logits_at + 4 * 5, float("nan"))
    inf_logit = bytearray(good)
    struct.pack_into("<f", inf_logit, logits_at + 4 * 7, float("inf"))
    text = b"out of range"
    for data, field, got in ((bad_token, "tokens[3]", "1024"), (bad_logit, "logits[5]", "nan"),
                             (inf_logit, "logits[7]", "inf")):
        data = bytes(data)
        for load in (lambda d: decode_payload(d, NANO), lambda d: decode_payload(d, None),
                     lambda d: ds4lab.Checkpoint.from_bytes(d, NANO)):
            with pytest.raises(PayloadError, match=rf"{field.replace('[', '.').replace(']', '.')} is {got}") as ei:
                load(data)
            assert ei.value.field == field
        path = tmp_path / "bad.kv"  # a .kv file without the checksum: only the value checks catch it
        path.write_bytes(spec_header(40, len(data), len(text), ctx=64) + text + data)
        with pytest.raises(KVFileError, match=str(path)) as ei:
            KVFile.open(path)
        assert ei.value.field == f"payload {field}"
    p = random_payload(NANO, 40, 64, 16)
    p.tokens[3] = 1024
    with pytest.raises(ValueError, match=r"tokens\[3\] is 1024"):
        encode_payload(p, NANO)
    p = random_payload(NANO, 40, 64, 16)
    p.logits[5] = np.nan
    with pytest.raises(ValueError, match=r"logits\[5\] is nan"):
        encode_payload(p, NANO)


# -- 15: a refusal met by the store names the file and the field ---------------------------------------

def test_a_store_refusal_names_the_file_and_the_field(emb, tmp_path):
    """Files a store cannot read but that are not damaged (a newer ds4's payload or header, another model family's
    KV state) are reported, naming the file and the field, and kept: they are someone else's, not garbage."""
    store = KVStore(tmp_path, min_tokens=16, checksum=False)  # as ds4-server writes them: no CRC to break
    s = emb.session(ctx=64, prefill_chunk=16)
    s.sync(IDS[:40])
    entry = store.save(s.snapshot(), s.model)
    good = entry.path.read_bytes()
    at = 52 + entry.text_bytes + 4  # the DSV4 payload's version
    for offset, value, field in ((at, 3, "version"), (3, 2, "version"), (20, 3, "payload_abi"), (7, 2, "model_id")):
        data = bytearray(good)
        data[offset] = value
        entry.path.write_bytes(bytes(data))
        with pytest.warns(KVStoreWarning) as seen:  # a store of its own (reporting each file afresh), whose scan
            store = KVStore(tmp_path, min_tokens=16, checksum=False)  # may already meet the file
            assert emb.session(ctx=64, prefill_chunk=16, kv_store=store).sync(IDS[:41]).source == "cold"
        assert any(str(entry.path) in str(w.message) and field in str(w.message) for w in seen), \
            [str(w.message) for w in seen]
        assert entry.path.read_bytes() == bytes(data)  # kept as it was
        with pytest.raises(KVFileError, match="newer ds4|GLM 5.2") as ei:
            KVFile.open(entry.path)
        assert ei.value.field.removeprefix("payload ") == field
    # the same bytes in a file ds4lab's checksum covers are damage, not another writer's file: removed
    checked = KVStore(tmp_path / "crc", min_tokens=16)
    entry = checked.save(s.snapshot(), s.model)
    good = entry.path.read_bytes()
    for offset, value in ((at, 3), (20, 3), (7, 2)):
        data = bytearray(good)
        data[offset] = value
        entry.path.write_bytes(bytes(data))
        with pytest.warns(KVStoreWarning):
            store = KVStore(tmp_path / "crc", min_tokens=16)
            assert emb.session(ctx=64, prefill_chunk=16, kv_store=store).sync(IDS[:41]).source == "cold"
        assert not entry.path.exists(), offset
        entry = checked.save(s.snapshot(), s.model)


# -- 19: an entry evicted between lookup and load is a miss --------------------------------------------

def test_an_entry_removed_between_lookup_and_load_is_a_miss(emb, tmp_path):
    store = KVStore(tmp_path, min_tokens=16)
    s = emb.session(ctx=64, prefill_chunk=16)
    s.sync(IDS[:40])
    store.save(s.snapshot(), s.model)
    entry = store.lookup(IDS[:45], model=emb)
    os.unlink(entry.path)  # another process evicted it
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVStoreWarning)
        assert store.load(entry, emb.config) is None
        t = emb.session(ctx=64, prefill_chunk=16)
        t.sync(IDS[:10])
        assert t.load(entry, IDS[:45], store=store) is None
    assert t.tokens == IDS[:10]


# -- beyond the list, found by tests/test_fuzz_files.py: non-finite KV values, a damaged ext byte ----------

def test_non_finite_kv_rows_and_states_are_refused():
    from ds4lab.kv.payload import parse_layout

    good = nano_payload()
    lay = parse_layout(good, NANO)
    for il, field, at, value in ((0, "raw", (2, 3), float("nan")), (2, "comp", (1, 0), float("inf")),
                                 (2, "index_state_score", (5, 7), float("-inf"))):
        arr = lay.layers[il][field]
        bad = bytearray(good)
        struct.pack_into("<f", bad, arr.offset + 4 * (at[0] * arr.width + at[1]), value)
        name = f"layer {il} {field}[{at[0]}, {at[1]}]"
        for load in (lambda d: decode_payload(d, NANO), lambda d: ds4lab.Checkpoint.from_bytes(d, NANO)):
            with pytest.raises(PayloadError, match=re.escape(f"{name} is {value}")) as ei:
                load(bytes(bad))
            assert ei.value.field == name
    p = random_payload(NANO, 40, 64, 16)
    p.layers[0].raw[2, 3] = np.inf
    with pytest.raises(ValueError, match=re.escape("raw[2, 3] is inf")):
        encode_payload(p, NANO)


def test_a_damaged_ext_byte_cannot_turn_the_checksum_off(tmp_path):
    """Bit 0 (ds4-server's tool map) lets bytes follow the payload; with bit 3 cleared the checksum trailer would
    pass as a map and nothing would be verified. The map must start with ds4's "KTM" 1."""
    store = KVStore(tmp_path, min_tokens=1)
    entry = store.put(b"a checked file", nano_payload(), tokens=40, ctx=64, quant_bits=2, fingerprint="ab" * 16)
    data = bytearray(entry.path.read_bytes())
    data[52 + entry.text_bytes + 52 + 8] ^= 1  # damage inside the CRC region: token 2 (still below vocab)
    for ext in (1, 3):
        data[6] = ext
        entry.path.write_bytes(bytes(data))
        with pytest.raises(KVFileError, match="tool map trailer") as ei:
            KVFile.open(entry.path)
        assert ei.value.field == "tool map trailer" and str(entry.path) in str(ei.value)
        with pytest.warns(KVStoreWarning), pytest.raises(KVFileError, match="tool map"):
            store.load(store.entries()[0], NANO)
        store = KVStore(tmp_path, min_tokens=1)
    # ds4-server's own map after its payload is fine
    ds4 = tmp_path / "ds4"
    ds4.mkdir()
    payload, text = nano_payload(), b"with a tool map"
    path = ds4 / (hashlib.sha1(text).hexdigest() + ".kv")
    path.write_bytes(spec_header(40, len(payload), len(text), ctx=64, ext=1) + text + payload
                     + b"KTM\x01" + struct.pack("<I", 0))
    assert len(KVFile.open(path).token_ids) == 40


def test_a_zlib_bomb_is_refused_by_its_header_before_it_is_unpacked(tmp_path):
    """A small zlib .kv whose size field claims far more than its DSV4 header's dimensions allow once unpacked
    about a GB before the payload was checked."""
    import zlib

    from ds4lab.kv.kvfile import EXT_ZLIB, KVFileError, _decompress
    from ds4lab.kv.payload import HEADER_BYTES

    model = ds4lab.load(backend="numpy")
    sess = model.session(ctx=128, prefill_chunk=64)
    sess.sync(list(range(40)))
    entry = ds4lab.KVStore(tmp_path / "store", min_tokens=1, compression="zlib").save(sess.snapshot(), model)
    good = entry.path.read_bytes()
    (payload_bytes,), (text_bytes,) = struct.unpack_from("<Q", good, 40), struct.unpack_from("<I", good, 48)
    start = 52 + text_bytes
    stored = good[start:start + payload_bytes]
    payload_head = zlib.decompress(stored[8:])[:HEADER_BYTES]
    claimed = 600 << 20
    bomb = struct.pack("<Q", claimed) + zlib.compress(payload_head + bytes(claimed - HEADER_BYTES), 9)
    assert len(bomb) < 1 << 20
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(KVFileError, match="zlib unpacked size.*largest payload"):
        _decompress(bomb, EXT_ZLIB, tmp_path / "bomb.kv")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10  # KB: nothing unpacked


# -- ds4's files since 2026-05-26 (payload ABI 2): agent titles, model ids, stubs, the trailer's flags ------

def test_newer_ds4_files_open_with_their_title_and_model(tmp_path, capsys):
    """ds4-agent's session files carry a title after the payload (ext bit 3 in an ABI-2 file); byte 7 names the
    model; a stub without a payload, a legacy header over a version-2 payload, and a damaged trailer flag are
    refused by name."""
    payload, text, title = nano_payload(), b"an agent session", "Arden, act two".encode()
    path = tmp_path / (hashlib.sha1(text).hexdigest() + ".kv")
    body = text + payload + struct.pack("<I", len(title)) + title
    for model, name in ((0, "DeepSeek V4 Flash"), (1, "DeepSeek V4 PRO")):
        path.write_bytes(spec_header(40, len(payload), len(text), ctx=64, reason=6, ext=8, model=model) + body)
        kf = KVFile.open(path)
        assert kf.title == "Arden, act two" and len(kf.token_ids) == 40 and kf.header["model"] == name
        assert "session title: 'Arden, act two'" in kf.summary() and "(title)" in kf.summary()
        code, out, _ = inspect(path, capsys)
        # a NANO payload under either id: the header's family, the payload's own size
        assert code == 0 and f"model id {model}: {name}'s architecture, a 6-layer model" in out
        assert "payload ABI 2" in out
    path.write_bytes(spec_header(40, len(payload), len(text), ctx=64, reason=6, ext=8) + body[:-1])
    with pytest.raises(KVFileError, match=r"file size is .* title 18") as ei:
        KVFile.open(path)
    assert ei.value.field == "file size"
    path.write_bytes(spec_header(40, 0, len(text), ctx=64, reason=6, ext=8) + text + body[len(text) + len(payload):])
    with pytest.raises(KVFileError, match="payload_bytes is 0: the file holds no KV state"):
        KVFile.open(path)
    path.write_bytes(spec_header(40, len(payload), len(text), ctx=64, abi=0) + text + payload)
    with pytest.raises(KVFileError, match=r"version is 2, expected 1 \(what the KVC header") as ei:
        KVFile.open(path)
    assert ei.value.field == "payload version"
    # the trailer's flags: clearing the CRC flag leaves a CRC behind, which is refused, not skipped
    store = KVStore(tmp_path / "s", min_tokens=1)
    entry = store.put(b"checked", payload, tokens=40, ctx=64, quant_bits=2, fingerprint="cd" * 16)
    data = bytearray(entry.path.read_bytes())
    assert KVFile.open(entry.path).fingerprint == "cd" * 16 and data[-8] == 1
    data[-8] = 0
    entry.path.write_bytes(bytes(data))
    with pytest.raises(KVFileError, match="trailer flags") as ei:
        KVFile.open(entry.path)
    assert ei.value.field == "trailer flags"


def test_files_ds4_rewrote_or_wrote_before_the_abi_byte_open(tmp_path):
    """ds4-server adds its tool-id map to any file it loads by truncating at the payload: a ds4lab file then has its
    fingerprint and checksum bits left without their trailer, and opens without them; ds4-agent wrote titles in
    ext bit 3 two days before byte 20 said ABI 2, where a legacy file's bit 3 is ds4lab's checksum."""
    payload = nano_payload()
    store = KVStore(tmp_path, min_tokens=1)
    entry = store.put(b"rewritten", payload, tokens=40, ctx=64, quant_bits=2, fingerprint="ef" * 16)
    data = bytearray(entry.path.read_bytes()[:entry.header.payload_end])
    data[6] |= 1  # ext bit 0: ds4-server's map follows
    entry.path.write_bytes(bytes(data) + b"KTM\x01" + struct.pack("<I", 0))
    kf = KVFile.open(entry.path)
    assert kf.fingerprint is None and kf.title is None and kf.checksum_status()[0] == "none"
    assert "replaced by ds4-server's tool-id map" in kf.summary() and len(kf.token_ids) == 40
    kf.verify()
    # a legacy (ABI 0) ds4-agent file with its title in bit 3, and a legacy ds4lab file with its checksum there
    legacy, text, title = with_version(payload, 1), b"agent, May 25", b"Arden"
    path = tmp_path / (hashlib.sha1(text).hexdigest() + ".kv")
    path.write_bytes(spec_header(40, len(legacy), len(text), ctx=64, reason=6, ext=8, abi=0, model=0) + text + legacy
                     + struct.pack("<I", len(title)) + title)
    kf = KVFile.open(path)
    assert kf.title == "Arden" and kf.checksum_status()[0] == "none" and "(checksum)" in kf.summary()
    old = KVStore(tmp_path / "old", min_tokens=1, payload_version=1)
    entry = old.put(b"legacy, checked", legacy, tokens=40, ctx=64, quant_bits=2)
    kf = KVFile.open(entry.path)
    assert kf.title is None and kf.checksum_status()[0] == "ok" and entry.path.read_bytes()[-8:-4] == b"KCK\x01"
    # ds4lab's codec payloads say so in byte 20 (0x80 | ABI): ds4 since e8e8779b skips them; without a codec bit
    # the mark is damage
    packed = KVStore(tmp_path / "q8", min_tokens=1, compression="q8")
    entry = packed.put(b"packed", pack_payload(payload, NANO, EXT_Q8), tokens=40, ctx=64, quant_bits=2,
                       codec_flags=EXT_Q8)
    data = bytearray(entry.path.read_bytes())
    assert data[20] == 0x82 and len(KVFile.open(entry.path).token_ids) == 40
    data[6] &= ~EXT_Q8
    entry.path.write_bytes(bytes(data))
    with pytest.raises(KVFileError, match="payload_abi .* is 0x82") as ei:
        KVFile.open(entry.path)
    assert ei.value.field == "payload_abi"


def test_a_hit_rewrites_hits_and_last_used_alone(tmp_path):
    """mark_loaded writes the two fields in place: a reason this ds4lab does not know (read as unknown) and the
    header's other bytes stay as the writer left them."""
    store = KVStore(tmp_path, min_tokens=1, checksum=False)
    entry = store.put(b"a hit", nano_payload(), tokens=40, ctx=64, quant_bits=2)
    data = bytearray(entry.path.read_bytes())
    data[5], data[21] = 9, 7  # a newer ds4's reason, a reserved byte
    entry.path.write_bytes(bytes(data))
    entry = store.entries()[0]
    assert entry.header.reason == 0  # read as "unknown"
    store.mark_loaded(entry)
    after = entry.path.read_bytes()
    assert after[:12] + after[16:32] + after[40:] == bytes(data[:12] + data[16:32] + data[40:])
    assert struct.unpack_from("<I", after, 12)[0] == 1


@pytest.mark.parametrize("field", ["n_layer", "head_dim", "indexer_head_dim", "vocab"])
def test_a_header_size_of_zero_is_named_without_a_model(field):
    """Read without a model (inspect), a header whose layer count, widths or vocabulary is 0 is named as such (a
    vocabulary of 0 shifted the row counts onto the logits: "layer 0 compressed row count is 3230597403")."""
    data = bytearray(nano_payload())
    struct.pack_into("<I", data, 4 * ("n_layer", "head_dim", "indexer_head_dim", "vocab").index(field) + 32, 0)
    with pytest.raises(PayloadError, match=rf"KV checkpoint header is not a DS4 layout: {field} is 0, expected at "
                                           "least 1") as ei:
        decode_payload(bytes(data), None)
    assert ei.value.field == field


def test_patch_row_refuses_a_checkpoint_of_another_models_weights(twins):
    """patch_row checked its source's configuration only: a checkpoint of a model of the same shape with other
    weights patched its rows in silently, where patch_rows, restore and save_kv refuse it by fingerprint."""
    from ds4lab.interventions import patch_row

    a, b = twins
    sa, sb = a.session(ctx=64, prefill_chunk=16), b.session(ctx=64, prefill_chunk=16)
    sa.sync(IDS[:40])
    sb.sync(IDS[:40])
    tokens, layer = list(sb.tokens), next(il for il in range(NANO.n_layer) if NANO.ratio(il))
    with pytest.raises(PayloadError, match=f"{a.file.fingerprint}.*{b.file.fingerprint}"):
        sb.intervene([patch_row(layer, sa.checkpoint(), comp=1)])
    assert sb.tokens == tokens and sb.edits == ()
    with pytest.warns(UserWarning, match="never applied"):  # its own model's: taken (no step runs in the block)
        with sb.intervene([patch_row(layer, sb.checkpoint(), comp=1)]):
            pass


def test_an_interrupted_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    """write_file_atomic removed its temporary file on an OSError only: Ctrl+C in the fsync left x.kv.tmp.<pid>."""
    from ds4lab.kv import kvfile

    target = tmp_path / "x.kv"
    target.write_bytes(b"before")

    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvfile.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        kvfile.write_file_atomic(target, [b"after"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.kv"] and target.read_bytes() == b"before"


def test_a_failed_write_names_the_path_asked_for(tmp_path):
    """A save into a missing folder named its temporary file (x.kv.tmp.<pid>), which the user never gave."""
    from ds4lab.kv import kvfile

    target = tmp_path / "missing" / "x.kv"
    with pytest.raises(FileNotFoundError) as ei:
        kvfile.write_file_atomic(target, [b"data"])
    assert ei.value.filename == str(target) and ".tmp." not in str(ei.value)


def test_a_write_through_a_symlink_replaces_its_file_and_keeps_the_link(tmp_path):
    """The rename put a regular file where the link was and left the file it named as it was."""
    from ds4lab.kv import kvfile

    (tmp_path / "real.kv").write_bytes(b"before")
    link = tmp_path / "link.kv"
    link.symlink_to("real.kv")
    kvfile.write_file_atomic(link, [b"after"])
    assert link.is_symlink() and (tmp_path / "real.kv").read_bytes() == b"after"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.kv", "real.kv"]
