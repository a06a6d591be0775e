"""``ds4lab serve`` under load, and its overhead against the same work through the Python API.

    python benchmarks/server_load.py [--requests 200] [--concurrency 8] [--max-tokens 8] [--conversations 4]
                                     [--backend numpy] [-m MODEL] [--ctx 1024] [--prefill-chunk 64]

Starts ``ds4lab serve`` as a child process on a free port of 127.0.0.1 (a disk KV cache in a temporary folder,
checkpoints from 64 tokens) and sends ``--requests`` streamed chat
requests, ``--concurrency`` at a time, with the real ``openai`` client: ``--conversations`` conversations that
share a system prompt, each request a new user message of one of them. It prints requests/s, completion
tokens/s, time to first token (median, 90th percentile, max), the cache hit rate (cached prompt tokens over
prompt tokens, from ``usage``) and the 503s.

Then the overhead: the same requests one at a time through the server, and through one ``Session`` of the
Python API (``sync`` then ``decoder(seed=).stream``, as the server's worker does), in the same order. The ratios
of their time to first token and tokens/s are the server's cost: HTTP, JSON, SSE, the queue and the thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai

import ds4lab

ROOT = Path(__file__).resolve().parents[1]
SYSTEM = (ROOT / "data" / "tinyshakespeare.txt").read_text()[:400]


def start_server(args, kv_dir: str) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ds4lab.cli", "serve", "--backend", args.backend, "--ctx", str(args.ctx),
           "--prefill-chunk", str(args.prefill_chunk), "--port", "0", "--queue-size", str(args.concurrency * 2),
           "--nothink", "--kv-disk-dir", kv_dir, "--kv-cache-min-tokens", "64"]
    if args.model:
        cmd += ["-m", args.model]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    for line in proc.stderr:
        if "serving " in line:
            url = line.split("serving ")[1].split("/v1")[0]
            break
    else:
        raise SystemExit(f"ds4lab serve exited with {proc.wait()}")
    threading.Thread(target=proc.stderr.read, daemon=True).start()
    for _ in range(600):
        try:
            httpx.get(url + "/v1/models", timeout=2)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.05)
    raise SystemExit("ds4lab serve did not answer")


def messages(i: int, conversations: int) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Scene {i % conversations}, take {i}."}]


def one_request(client, name: str, i: int, args) -> dict:
    began = time.perf_counter()
    first, usage = None, None
    try:
        stream = client.chat.completions.create(model=name, messages=messages(i, args.conversations),
                                                max_tokens=args.max_tokens, seed=i, stream=True,
                                                stream_options={"include_usage": True})
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content is not None \
                    and chunk.choices[0].delta.role is None:
                first = time.perf_counter() - began
            usage = chunk.usage or usage
    except openai.APIStatusError as e:
        return {"status": e.status_code}
    return {"status": 200, "ttft": first, "seconds": time.perf_counter() - began, "usage": usage}


def through_api(model, args, requests) -> list[dict]:
    """The same requests on one session of the Python API, one at a time, as the worker runs them; the first
    only warms the session up (the shared system prompt), as the load before them did the server's."""
    sess = model.session(ctx=args.ctx, prefill_chunk=args.prefill_chunk)
    out = []
    for i in [0, *requests]:
        ids = model.tokenizer.render_chat(messages(i, args.conversations), think=False)
        began = time.perf_counter()
        sess.sync(ids)
        sess.checkpoint()
        first, tokens = None, 0
        for _ in sess.decoder(seed=i, top=1).stream(args.max_tokens):
            first = first or time.perf_counter() - began
            tokens += 1
        out.append({"ttft": first, "seconds": time.perf_counter() - began, "tokens": tokens})
    return out[1:]


def summary(label: str, results: list[dict], seconds: float) -> dict:
    ok = [r for r in results if r["status"] == 200]
    ttft = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    tokens = sum(r["usage"].completion_tokens for r in ok)
    prompt = sum(r["usage"].prompt_tokens for r in ok)
    cached = sum(r["usage"].prompt_tokens_details.cached_tokens for r in ok)
    print(f"{label}: {len(ok)}/{len(results)} served ({len(results) - len(ok)} refused with 503) in {seconds:.1f} s: "
          f"{len(ok) / seconds:.2f} requests/s, {tokens / seconds:.1f} tokens/s; TTFT median "
          f"{statistics.median(ttft):.3f} s, p90 {ttft[int(0.9 * (len(ttft) - 1))]:.3f} s, max {ttft[-1]:.3f} s; "
          f"cache hit rate {cached / max(prompt, 1):.1%} of {prompt} prompt tokens")
    return {"ttft": statistics.median(ttft), "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--overhead-requests", type=int, default=16, help="requests of the one-at-a-time comparison")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("-m", "--model", default=None, help="GGUF file (default: the embedded model)")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--prefill-chunk", type=int, default=64)
    args = ap.parse_args()

    kv = tempfile.TemporaryDirectory(prefix="ds4lab-kv-")
    proc, url = start_server(args, kv.name)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        began = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            results = list(pool.map(lambda i: one_request(client, name, i, args), range(args.requests)))
        summary(f"load ({args.concurrency} concurrent)", results, time.perf_counter() - began)
        n = args.overhead_requests
        began = time.perf_counter()
        serial = [one_request(client, name, args.requests + i, args) for i in range(n)]
        server = summary("server, one at a time", serial, time.perf_counter() - began)
    finally:
        proc.terminate()
        proc.wait(60)
        kv.cleanup()
    model = ds4lab.load(args.model, backend=args.backend)
    api = through_api(model, args, range(args.requests, args.requests + n))
    api_seconds = sum(r["seconds"] for r in api)
    api_ttft = statistics.median(r["ttft"] for r in api if r["ttft"] is not None)
    api_tps = sum(r["tokens"] for r in api) / api_seconds
    print(f"Python API, one at a time: {n} requests in {api_seconds:.1f} s: {api_tps:.1f} tokens/s; TTFT median "
          f"{api_ttft:.3f} s")
    print(f"server overhead: TTFT x{server['ttft'] / api_ttft:.2f}, tokens/s x{server['tokens_per_s'] / api_tps:.2f} "
          "(server over API)")


if __name__ == "__main__":
    main()
