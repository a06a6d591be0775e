"""The ``ds4lab`` command, driven as a subprocess: run (one-shot and interactive), bench, inspect, errors.

Expected values come from the Python API on the same model and backend (same tokens for the same seed,
the same transcript reuse, the same KV byte accounting); the bench's library function is checked
against an independent session in-process.
"""

import csv
import importlib.util
import io
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import ds4lab
from ds4lab import bench
from ds4lab.cli import DEFAULT_SYSTEM
from ds4lab.cli.generate import TextPrinter
from ds4lab.kv.layout import Geometry
from ds4lab.kv.payload import payload_nbytes

FAST = ["--backend", "numpy", "--prefill-chunk", "64"]
STATS = re.compile(r"prompt (\d+) tokens \((\d+) reused, (\w+); (\d+) evaluated\), prefill [\d.]+ t/s, "
                   r"generation [\d.]+ t/s \((\d+) tokens, (\w+)\), KV (\d+) bytes")


def ds4lab_cmd(*args, input=None, timeout=120, python_code=None):
    env = {k: v for k, v in os.environ.items() if k != "DS4LAB_TRACEBACK"}
    env["PYTHONIOENCODING"] = "utf-8"
    cmd = [sys.executable, "-c", python_code] if python_code else [sys.executable, "-m", "ds4lab.cli"]
    return subprocess.run(cmd + [str(a) for a in args], check=False, input=input, capture_output=True, text=True,
                          encoding="utf-8", timeout=timeout, env=env)


def one_error_line(proc, code):
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr
    assert len([line for line in lines if "error" in line]) == 1, proc.stderr
    return lines[-1]


@pytest.fixture(scope="module")
def nano(model_paths):
    return model_paths["nano"]


@pytest.fixture(scope="module")
def nano_np(nano):
    return ds4lab.load(nano, backend="numpy")


def reply(text):
    return text if text.endswith("\n") else text + "\n"


# -- run: one-shot ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["sampled", "greedy-raw"])
def test_run_streams_the_session_apis_tokens(mode, nano, nano_np):
    tk = nano_np.tokenizer
    if mode == "sampled":
        flags = ["--chat", "--nothink", "--temp", "0.8", "--top-k", "40", "--top-p", "0.95", "--min-p", "0.02",
                 "--seed", "5"]
        ids = tk.render_chat([{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": "Hello"}])
        sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.02, "seed": 5}
    else:
        flags = ["--raw", "--temp", "0"]
        ids = tk.encode("Hello")
        sampling = {"temperature": 0.0}
    proc = ds4lab_cmd("run", "-m", nano, "-p", "Hello", "-n", 24, "--ctx", 256, *FAST, *flags)
    assert proc.returncode == 0, proc.stderr

    sess = nano_np.session(ctx=256, prefill_chunk=64)
    sess.sync(ids)
    decode = sess.decoder(**sampling)
    steps = list(decode.stream(24))
    assert proc.stdout == reply("".join(s.text for s in steps))
    m = STATS.search(proc.stderr)
    assert m, proc.stderr
    assert m.groups() == (str(len(ids)), "0", "cold", str(len(ids)), str(len(steps)), decode.stop_reason,
                          str(sess.kv_bytes))
    assert "prefill: " in proc.stderr  # progress


def test_run_defaults_to_plain_text_without_a_chat_template(nano, nano_np):
    # The test models (and the embedded Shakespeare model) declare no tokenizer.chat_template.
    proc = ds4lab_cmd("run", "-m", nano, "-p", "ROMEO:", "-n", 4, "--temp", "0", *FAST)
    assert proc.returncode == 0, proc.stderr
    assert STATS.search(proc.stderr).group(1) == str(len(nano_np.tokenizer.encode("ROMEO:")))


def test_run_prompt_file_and_default_think_mode(nano, nano_np, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Tell me a story.")
    proc = ds4lab_cmd("run", "-m", nano, "--chat", "--prompt-file", prompt, "--system", "", "-n", 3, "--seed", 1,
                      *FAST)
    assert proc.returncode == 0, proc.stderr
    # nano has no chat template: its chat turn does not think unless asked (ds4's default, thinking, is a chat
    # model's), as serve's requests; it thought by default, and such a model never ends its reasoning
    ids = nano_np.tokenizer.render_chat([{"role": "user", "content": "Tell me a story."}], think=False)
    assert ids[-1] == nano_np.tokenizer.think_end_id
    assert STATS.search(proc.stderr).group(1) == str(len(ids))
    assert "think none" in proc.stderr
    proc = ds4lab_cmd("run", "-m", nano, "--chat", "--think", "--prompt-file", prompt, "--system", "", "-n", 3,
                      "--seed", 1, *FAST)
    assert proc.returncode == 0 and "think high" in proc.stderr, proc.stderr
    ids = nano_np.tokenizer.render_chat([{"role": "user", "content": "Tell me a story."}], think=True)
    assert ids[-1] == nano_np.tokenizer.think_id and STATS.search(proc.stderr).group(1) == str(len(ids))


def test_text_printer_formats_thinking():
    out = io.StringIO()
    p = TextPrinter(out, thinking=True, color=False)
    for piece in ["plan", " it", "</th", "ink>", "Answer", "<", "b>"]:
        p.write(piece)
    p.finish()
    assert out.getvalue() == "plan it\nAnswer<b>\n"
    out = io.StringIO()
    p = TextPrinter(out, thinking=False, color=False)
    p.write("a</think>b")
    p.finish()
    assert out.getvalue() == "a</think>b\n"


# -- run: interactive ------------------------------------------------------------------------------------

def test_interactive_turns_reuse_the_session(nano, nano_np):
    script = "Hello there\n/stats\nAnd now?\n/stats\n/quit\n"
    proc = ds4lab_cmd("run", "-m", nano, "--nothink", "--temp", "0", "-n", 8, "--ctx", 512, *FAST, input=script)
    assert proc.returncode == 0, proc.stderr
    turns = [m.groups() for m in STATS.finditer(proc.stderr)]
    assert len(turns) == 2

    # The same conversation through the session API: ds4's transcript (replies and an EOS kept verbatim).
    tk = nano_np.tokenizer
    sess = nano_np.session(ctx=512, prefill_chunk=64)
    first = tk.render_chat([{"role": "system", "content": DEFAULT_SYSTEM}, {"role": "user", "content": "Hello there"}])
    sess.sync(first)
    reply1 = list(sess.decoder(temperature=0).stream(8))
    second = (first + [s.token for s in reply1] + [tk.eos_id]
              + tk.render_chat([{"role": "user", "content": "And now?"}])[1:])
    result = sess.sync(second)
    reply2 = list(sess.decoder(temperature=0).stream(8))

    reused1 = len(first) + len(reply1)
    assert turns[0][:4] == (str(len(first)), "0", "cold", str(len(first)))
    assert turns[1][:4] == (str(len(second)), str(reused1), "live", str(len(second) - reused1))
    assert (result.source, result.reused) == ("live", reused1)
    assert turns[1][6] == str(sess.kv_bytes)
    text1, text2 = ("".join(s.text for s in r) for r in (reply1, reply2))
    assert f"> {reply(text1)}" in proc.stdout and f"> {reply(text2)}" in proc.stdout
    stats = [line for line in proc.stdout.splitlines() if "> session: " in line]
    assert f"turn 2: reused {reused1} (live), evaluated {len(second) - reused1}" in stats[1]
    assert f"transcript {len(second) + len(reply2) + 1} tokens" in stats[1]


def test_interactive_commands(nano, tmp_path):
    prompt = tmp_path / "q.txt"
    prompt.write_text("A question from a file")
    script = (f"/help\n/think-max\n/nothink\n/ctx 300\n/stats\n/ctx abc\n/read {prompt}\n/read {tmp_path / 'no.txt'}\n"
              "/bogus\n/think\n/stats\n/exit\n")
    proc = ds4lab_cmd("run", "-m", nano, "-n", 2, *FAST, input=script)
    assert proc.returncode == 0, proc.stderr
    out, err = proc.stdout, proc.stderr
    assert out.count("/read FILE") == 2  # the help at start and after /help
    assert "Thinking mode: high (Think Max needs ctx >= 393216)." in out
    assert "Thinking mode: none." in out and "Thinking mode: high." in out
    assert "New session: ctx 300" in out
    assert "session: 0/300 tokens" in out
    assert "/ctx needs an integer" in err
    assert f"{tmp_path / 'no.txt'}: No such file or directory" in err
    assert "unknown command: /bogus" in err
    assert len(STATS.findall(err)) == 1  # the /read turn
    assert "think high; turn 1: reused 0 (cold)" in out
    assert err.splitlines()[0].endswith("think none")  # nano has no chat template: no thinking until /think
    assert "Traceback" not in err


def test_interactive_ctrl_c_stops_generation(nano):
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    # A process that ignores SIGINT (one a shell started with '&', and so every process under it) passes that on to
    # its children across exec, where a handler would be reset to the default: the CLI then never sees the Ctrl+C.
    # A handler in this process while the CLI starts gives it the default, as a terminal's foreground process has.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "ds4lab.cli", "run", "-m", str(nano), "--nothink", "--temp",
                                 "0", "--ctx", "4096", *FAST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, encoding="utf-8", env=env)
    finally:
        signal.signal(signal.SIGINT, previous)
    # "ROMEO:" runs nano's greedy reply 877 tokens to its EOS ("Hello": 341), room for the signal to come mid-reply
    proc.stdin.write("ROMEO:\n/stats\n/quit\n")
    proc.stdin.close()
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(iter(lambda: proc.stdout.read(1), "")), daemon=True)
    reader.start()
    def generating() -> bool:  # the prompt is up and the reply has begun (no prompt yet: not begun)
        head, prompt, reply = "".join(out).rpartition("ds4lab> ")
        return bool(prompt) and len(reply) >= 10

    deadline = time.monotonic() + 180  # a loaded 2-core machine: the other test worker busy
    while time.monotonic() < deadline and not generating():
        time.sleep(0.05)
    assert generating(), f"no reply began in 180 s: {''.join(out)!r}"
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    reader.join(timeout=10)
    turn = STATS.search(err)
    assert turn and turn.group(6) == "interrupted" and int(turn.group(5)) > 0, err
    assert "session:" in "".join(out)  # back at the prompt: /stats ran after the interrupt
    assert "Traceback" not in err


# -- errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, code, message", [
    (["run", "--bogus"], 2, "unrecognized arguments: --bogus"),
    (["run", "-p", "x", "-n", "-5"], 2, "expected a positive integer, got '-5'"),
    (["run", "-p", "x", "--temp", "-1"], 2, "--temp: expected a number in [0, 100], got '-1'"),
    (["run", "-p", "x", "--top-p", "1.5"], 2, "--top-p"),
    (["run", "-p", "x", "--seed", "abc"], 2, "--seed"),
    (["run", "-p", "x", "--prompt-file", "f"], 2, "not allowed with argument"),
    (["run", "-p", "x", "--ctx", "1"], 2, "--ctx must be at least 3, got 1"),
    (["run", "-p", "x", "--ctx", "2"], 2, "--ctx must be at least 3, got 2"),  # a prompt token leaves no room
    (["run", "-p", "x", "--backend", "numpy", "--prefill-matmul", "tf32"], 2,
     "--prefill-matmul tf32 needs --backend cupy (got --backend numpy)"),
    (["run", "-p", "x", "--backend", "numpy", "--decode-matmul", "q8"], 2,
     "--decode-matmul q8 needs --backend cupy (got --backend numpy)"),
    (["bench", "--ctx-start", "0"], 2, "--ctx-start: expected a positive integer"),
    (["bench", "--step-mul", "0.5"], 2, "--step-mul"),
    (["bench", "--plot", "x.txt"], 2, "--plot needs a .png"),
    ([], 2, "required"),
])
def test_usage_errors(args, code, message):
    line = one_error_line(ds4lab_cmd(*args), code)
    assert message in line


def test_runtime_errors(nano, tmp_path):
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    cases = [
        (["run", "-m", tmp_path / "missing.gguf", "-p", "x"], "missing.gguf: no such file"),
        (["run", "-m", not_gguf, "-p", "x"], "not a GGUF file"),
        (["run", "--prompt-file", tmp_path / "missing.txt"], f"--prompt-file {tmp_path / 'missing.txt'}: no such file"),
        (["run", "-m", nano, "-p", "a prompt longer than this context", "--ctx", 8, *FAST],
         "the context holds 8"),
        (["inspect", tmp_path / "missing.gguf"], "no such file"),
        (["inspect", not_gguf], "not a GGUF file"),
    ]
    for args, message in cases:
        line = one_error_line(ds4lab_cmd(*args), 1)
        assert message in line, (args, line)


def test_cupy_backend_without_a_cuda_gpu_is_one_clear_error(nano):
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            pytest.skip("a CUDA GPU is present: the cupy backend loads")
    except Exception:
        pass
    line = one_error_line(ds4lab_cmd("run", "-m", nano, "-p", "x", "--backend", "cupy"), 1)
    assert "the cupy backend needs CuPy and a CUDA GPU" in line
    line = one_error_line(ds4lab_cmd("run", "-p", "x", "--backend", "cupy", "--device", "gpu"), 2)
    assert "--device is for the mlx backend" in line


# -- bench ----------------------------------------------------------------------------------------------

def test_bench_sweep_256_to_4096(nano, nano_np, tmp_path):
    """The acceptance sweep; prints its wall time (on ds4's prompt, the checkout's data/promessi_sposi.txt)."""
    out = tmp_path / "bench.csv"
    began = time.perf_counter()
    proc = ds4lab_cmd("bench", "-m", nano, "--ctx-start", 256, "--ctx-max", 4096, "--step-mul", 2, "--gen-tokens", 4,
                      "--prefill-chunk", 512, "--csv", out)
    seconds = time.perf_counter() - began
    print(f"bench 256..4096: {seconds:.1f} s")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    rows = list(csv.DictReader(out.open()))
    assert tuple(rows[0].keys()) == bench.CSV_COLUMNS
    assert [int(r["ctx_tokens"]) for r in rows] == [256, 512, 1024, 2048, 4096]
    assert [int(r["prefill_tokens"]) for r in rows] == [256, 256, 512, 1024, 2048]
    assert all(int(r["gen_tokens"]) == 4 and float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0 for r in rows)
    geo = Geometry.for_context(nano_np.config, 4096 + 4 + 1, 512)
    assert [int(r["kvcache_bytes"]) for r in rows] == [
        payload_nbytes(nano_np.config, f, geo.window, geo.raw_cap) for f in (256, 512, 1024, 2048, 4096)]
    peaks = [int(r["peak_rss_bytes"]) for r in rows]
    assert peaks == sorted(peaks) and peaks[0] > 0
    assert "5 frontiers 256..4096" in proc.stderr


def test_bench_library_agrees_with_a_session(nano_np):
    """Each row's KV bytes and greedy probe against a second session walked by hand through sync()."""
    eos = nano_np.tokenizer.eos_id
    tokens, _ = bench.prompt_tokens(nano_np, None, min_tokens=200)
    sess = nano_np.session(ctx=200 + 6 + 1, prefill_chunk=32, max_checkpoints=2)
    rows = list(bench.sweep(nano_np, tokens, ctx_start=40, ctx_max=200, step_incr=80, gen_tokens=6, session=sess))
    assert [r.ctx_tokens for r in rows] == [40, 120, 200] == bench.frontiers(40, 200, 80)
    assert sess.tokens == tokens[:200]  # the probe was rolled back

    ref = nano_np.session(ctx=207, prefill_chunk=32)
    for row in rows:
        ref.sync(tokens[:row.ctx_tokens])
        cp = ref.checkpoint()
        assert row.kvcache_bytes == ref.kv.nbytes == len(cp.to_bytes()) == ref.kv_bytes
        probe = []
        for _ in range(6):
            logits = ref.logits.copy()
            logits[eos] = -np.inf
            probe.append(int(np.argmax(logits)))
            ref.sync(ref.tokens + probe[-1:])
        assert row.probe == tuple(probe)
        ref.restore(cp)
    assert [r.prefill_tokens for r in rows] == [40, 80, 80]
    assert bench.read_csv(bench.to_csv(rows))[2]["kvcache_bytes"] == rows[2].kvcache_bytes

    sampling = dict(temperature=1.0, min_p=0.05, seed=4)  # a sampled probe: the decoder's, from the frontier
    sess = nano_np.session(ctx=207, prefill_chunk=32, max_checkpoints=2)
    (row,) = bench.sweep(nano_np, tokens, ctx_start=40, ctx_max=40, gen_tokens=6, session=sess, sampling=sampling)
    ref.sync(tokens[:40])
    want = tuple(s.token for s in ref.decoder(top=1, exclude=[eos], **sampling).stream(6))
    assert row.probe == want != rows[0].probe


def test_bench_warms_up_untimed_and_leaves_the_rows_as_they_were(nano_np):
    """``warmup`` decode steps run after the sequence's first chunk (32 tokens here) before the first frontier, and
    the session is emptied after them: the first frontier is prefilled from zero and every row's probe is a cold
    sweep's."""
    tokens, _ = bench.prompt_tokens(nano_np, None, min_tokens=60)
    sess = nano_np.session(ctx=60 + 6 + 1, prefill_chunk=32, max_checkpoints=2)
    decoders, resets, restores = [], [], []
    decoder, reset, restore = sess.decoder, sess.reset, sess.restore
    sess.decoder = lambda *a, **k: decoders.append(len(sess.tokens)) or decoder(*a, **k)
    sess.reset = lambda: resets.append(len(sess.tokens)) or reset()
    sess.restore = lambda cp: restores.append(len(cp)) or restore(cp)
    rows = list(bench.sweep(nano_np, tokens, ctx_start=40, ctx_max=60, step_incr=20, gen_tokens=6, session=sess,
                            warmup=3))
    assert decoders == [32, 40, 60] and resets[-1] == 32 + 3  # (prefill also resets an empty session)
    # only the frontiers' snapshots are restored (the first frontier restored the warm-up's tokens and evaluated
    # 24 where its row said 40: a prefill rate 1.7x too high)
    assert restores == [40, 60]
    cold = list(bench.sweep(nano_np, tokens, ctx_start=40, ctx_max=60, step_incr=20, gen_tokens=6, warmup=0))
    assert [(r.prefill_tokens, r.probe) for r in rows] == [(r.prefill_tokens, r.probe) for r in cold]
    assert [r.prefill_tokens for r in rows] == [40, 20]
    with pytest.raises(bench.BenchError, match="warmup must be 0 or more decode steps, got -1"):
        next(bench.sweep(nano_np, tokens, ctx_start=40, ctx_max=60, gen_tokens=6, warmup=-1))


def test_bench_frontiers_follow_ds4():
    assert bench.frontiers(2048, 8192) == [2048, 4096, 6144, 8192]
    assert bench.frontiers(100, 1000, step_incr=300) == [100, 400, 700, 1000]
    assert bench.frontiers(256, 4096, step_mul=2) == [256, 512, 1024, 2048, 4096]
    assert bench.frontiers(3, 10, step_mul=1.1) == [3, 4, 5, 6, 7, 8, 9, 10]  # at least +1
    with pytest.raises(bench.BenchError):
        bench.check_sweep(10, 20, 5, 1.0, 8, ctx_alloc=28)


def test_bench_csv_on_stdout_from_a_prompt_file(nano, tmp_path, monkeypatch, nano_np):
    text = tmp_path / "text.txt"
    text.write_text(bench.BUILTIN_TEXT * 2)
    proc = ds4lab_cmd("bench", "-m", nano, "--prompt-file", text, "--ctx-start", 32, "--ctx-max", 100,
                      "--step-incr", 40, "-n", 2, *FAST)
    assert proc.returncode == 0, proc.stderr
    rows = bench.read_csv(proc.stdout)
    assert [(r["ctx_tokens"], r["prefill_tokens"], r["gen_tokens"]) for r in rows] == [(32, 32, 2), (72, 40, 2),
                                                                                       (100, 28, 2)]
    short = one_error_line(ds4lab_cmd("bench", "-m", nano, "--prompt-file", text, "--ctx-max", 4096, *FAST), 1)
    assert "need at least --ctx-max (4096)" in short
    # Without the checkout's data/ (a wheel), the built-in text repeats to the length the sweep needs.
    monkeypatch.setattr(bench, "default_prompt_path", lambda: None)
    ids, source = bench.prompt_tokens(nano_np, None, min_tokens=5000)
    assert len(ids) >= 5000 and "built-in" in source


@pytest.mark.parametrize("suffix", [".html", ".png"])
def test_bench_plot(suffix, nano, tmp_path):
    pytest.importorskip("altair")
    if suffix == ".png":
        pytest.importorskip("vl_convert")
    out = tmp_path / f"speed{suffix}"
    proc = ds4lab_cmd("bench", "-m", nano, "--ctx-start", 32, "--ctx-max", 64, "--step-incr", 32, "-n", 2,
                      "--plot", out, *FAST)
    assert proc.returncode == 0, proc.stderr
    if suffix == ".png":
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    else:
        assert "prefill" in out.read_text() and "vega" in out.read_text().lower()
        # the page opens offline: Vega's scripts in it, no CDN (with vl-convert, the bench extra's), or says so
        offline = importlib.util.find_spec("vl_convert") is not None
        assert ("cdn.jsdelivr" not in out.read_text()) == offline
        assert ("will load Vega from a CDN" in proc.stderr) == (not offline), proc.stderr


def test_bench_plot_html_without_vl_convert_says_it_needs_the_network(nano, tmp_path):
    """Without vl-convert the page loads Vega from a CDN (Altair's default): said before the sweep, and the page
    still written."""
    pytest.importorskip("altair")
    code = ("import sys; sys.modules['vl_convert'] = None; from ds4lab.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "speed.html"
    proc = ds4lab_cmd("bench", "-m", nano, "--ctx-start", 32, "--ctx-max", 64, "--step-incr", 32, "-n", 2,
                      "--plot", out, *FAST, python_code=code)
    assert proc.returncode == 0, proc.stderr
    assert "warning: --plot speed.html will load Vega from a CDN when opened" in proc.stderr
    assert "cdn.jsdelivr" in out.read_text()


def test_bench_plot_without_altair_is_one_clear_error(nano, tmp_path):
    code = ("import sys; sys.modules['altair'] = None; from ds4lab.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    proc = ds4lab_cmd("bench", "-m", nano, "--plot", tmp_path / "x.html", python_code=code)
    assert "pip install -e '.[bench]'" in one_error_line(proc, 1)


# -- inspect --------------------------------------------------------------------------------------------

def test_inspect_gguf(nano, nano_np):
    proc = ds4lab_cmd("inspect", nano)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    f = nano_np.file
    total = sum(t.nbytes for t in f.tensors.values())
    assert f"GGUF v3, {f.file_size:,} bytes, {len(f.metadata)} metadata keys, {len(f.tensors)} tensors" in out
    assert re.search(r"general\.architecture\s+STRING\s+'deepseek4'", out)
    assert re.search(r"tokenizer\.ggml\.tokens\s+ARRAY\[STRING\]\s+1024 items", out)
    assert re.search(rf"n_layer\s+{nano_np.config.n_layer}\n", out)
    for name, t in list(f.tensors.items())[:: len(f.tensors) // 7]:
        shape = " x ".join(map(str, t.shape))
        assert re.search(rf"{re.escape(name)}\s+{t.qtype.name}\s+{shape}\s+{t.nbytes:,}\n", out), name
    assert re.search(rf"total\s+{len(f.tensors)} tensors\s+{total:,} bytes", out)


@pytest.mark.parametrize("abi,version", [(2, 2), (0, 1)])  # ds4 since 2026-05-26, and before
def test_inspect_kv_file(nano_np, tmp_path, abi, version):
    pytest.importorskip("ds4lab.kv.store")
    from ds4lab.kv.payload import with_version

    sess = nano_np.session(ctx=128, prefill_chunk=64)
    text = "To be, or not to be"
    sess.sync(nano_np.tokenizer.encode(text))
    payload = with_version(sess.checkpoint().to_bytes(), version)
    raw = text.encode()
    # KVC file (docs/FORMATS.md, "KVC files and the KV store"): 48-byte header (byte 20 the payload ABI), text length
    # and text, DSV4 payload.
    header = b"KVC" + bytes([1, 2, 1, 0, 0]) + struct.pack("<IIIIQQQ", len(sess.tokens), 0, 128, abi, 1, 1,
                                                            len(payload))
    path = tmp_path / "cache.kv"
    path.write_bytes(header + struct.pack("<I", len(raw)) + raw + payload)
    proc = ds4lab_cmd("inspect", path)
    assert proc.returncode == 0, proc.stderr
    assert str(len(sess.tokens)) in proc.stdout
