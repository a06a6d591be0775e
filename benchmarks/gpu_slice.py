"""A full-width DeepSeek V4 Flash slice on a GPU: decode and prefill speed, where the time goes, and the
decode roofline.

The slice has the real dimensions (docs/FORMATS.md, "GGUF model files"), 6 layers with the real ratio
pattern 0,0,4,128,4,128 and 3 hash layers, the embedding and the full 129,280-row output head, and seeded
random weights in ds4's q2 layout (IQ2_XXS gate/up, Q2_K down, Q8_0 attention/shared/output, F16
elsewhere), built in memory (``ds4lab.testing.model_tensors`` with a few distinct rows repeated: the same
bytes to read, much faster to make). Per-layer figures extrapolate to the full model as 43 × layer + head.

Decode at a context C runs on a cache filled to C tokens with random rows (the same work as after a
real prefill of C tokens, without spending minutes prefilling). Prefill runs real chunks of 2048.

    python benchmarks/gpu_slice.py --backend cupy --json out.json
    python benchmarks/gpu_slice.py --backend cupy --plain        # the plain-ops path (no kernels)
    python benchmarks/gpu_slice.py --backend mlx                 # MLX's GPU back-end (CUDA or Metal)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace as dc_replace
from types import SimpleNamespace

import numpy as np

from ds4lab import ops
from ds4lab.backends import get_backend
from ds4lab.backends.block_weights import BlockLinear
from ds4lab.config import FLASH, NANO, replace
from ds4lab.gguf_file import TensorInfo, tensor_byte_shape
from ds4lab.kv.layout import Geometry, new_state
from ds4lab.model import transformer as transformer_module
from ds4lab.model.transformer import Transformer
from ds4lab.model.weights import Weights
from ds4lab.runtime import Runtime
from ds4lab.testing import model_tensors

SLICE = replace(FLASH, n_layer=6)  # ratios 0,0,4,128,4,128; the first 3 layers hash-routed
FULL_LAYERS = FLASH.n_layer
CHUNK = 2048


def build(cfg, backend_name: str, kernels: bool, tensors, prefill_matmul: str = "float32",
          decode_matmul: str = "float32") -> Runtime:
    """The slice's model and the runtime that runs it (``rt.model`` is the :class:`Transformer`)."""
    file = SimpleNamespace(tensors={n: TensorInfo(n, shape, q, raw.reshape(tensor_byte_shape(shape, q)))
                                    for n, shape, q, raw in tensors})
    backend = get_backend(backend_name, None, kernels, prefill_matmul, decode_matmul)
    # the plain path dequantizes experts on first use; keep them
    weights = Weights(file, backend, cfg.o_groups, cfg.o_lora, expert_cache_bytes=48 << 30)
    return Runtime(Transformer(cfg, weights, ops.Ops(backend), numerics="ds4"), backend)


def syncer(backend):
    if backend.name == "cupy":
        import cupy as cp

        return lambda *xs: cp.cuda.get_current_stream().synchronize()
    import mlx.core as mx

    def sync(*xs):
        mx.eval(*[x for x in xs if isinstance(x, mx.array)])
        mx.synchronize()

    return sync


def gpu_memory(backend) -> dict:
    """The GPU memory in use (CuPy: the current device's; MLX: active and peak); nothing for a host backend."""
    if backend.name not in ("cupy", "mlx"):
        return {}
    if backend.name == "cupy":
        import cupy as cp

        free, total = cp.cuda.runtime.memGetInfo()
        return {"pool_bytes": cp.get_default_memory_pool().total_bytes(), "device_used_bytes": total - free}
    import mlx.core as mx

    return {"active_bytes": mx.get_active_memory(), "peak_bytes": mx.get_peak_memory()}


def copy_bandwidth(backend, nbytes: int = 2 << 30) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    sync = syncer(backend)
    if backend.name == "cupy":
        import cupy as cp

        a, b = cp.ones(nbytes // 4, dtype=cp.float32), cp.empty(nbytes // 4, dtype=cp.float32)

        def copy():
            b[...] = a
    else:
        import mlx.core as mx

        a = mx.ones((nbytes // 4,), dtype=mx.float32)
        mx.eval(a)

        def copy():
            mx.eval(a + 0)
    copy()
    sync()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / min(times)


def filled_state(rt: Runtime, n_past: int, ctx: int, seed: int = 0):
    """A cache holding ``n_past`` tokens of random rows (rows beyond the counts stay zero)."""
    b, cfg = rt.backend, rt.model.cfg
    state = new_state(cfg, b, Geometry.for_context(cfg, ctx, CHUNK))
    rng = np.random.default_rng(seed)
    layers = []
    for il, layer in enumerate(state.layers):
        R = cfg.ratio(il)

        def rows(shape, filled):
            a = np.zeros(shape, dtype=np.float32)
            a[:filled] = rng.standard_normal((min(filled, shape[0]), shape[1]), dtype=np.float32)
            return b.asarray(a)

        new = dc_replace(layer, raw=rows(layer.raw.shape, layer.raw.shape[0]))
        if R:
            new = dc_replace(new, comp=rows(layer.comp.shape, n_past // R))
        if cfg.has_indexer(il):
            new = dc_replace(new, index=rows(layer.index.shape, n_past // R))
        layers.append(new)
    return dc_replace(state, layers=tuple(layers), n_past=n_past)


def step(rt: Runtime, tokens, state, sync):
    logits, state = rt.forward_logits(tokens, state)
    sync(logits)
    return state, logits


def ends_no_window(key) -> bool:
    """Whether the compiled call ``key`` (Runtime.compiled's) runs the chunks that end no compressor's window: a
    decode step's usual call (one in 4 steps ends a ratio-4 window and takes another)."""
    return key[4] == () if key[0] == "step" else key[0] == "ffn" or not key[1]


def graph_report(rt: Runtime) -> dict:
    """How the compiled steps ran: CUDA graphs captured and capture failures (CuPy). ``replay_ms_total``: the GPU
    time of the graphs of a step that ends no window, one sum per set of shapes captured."""
    graphs = {key: g for key, g in rt.compiled.items() if hasattr(g, "captures")}
    replays = {key: [round(s * 1e3, 4) for s in g.replay_seconds()] for key, g in graphs.items()}
    return {"steps": len(graphs), "captures": sum(g.captures for g in graphs.values()),
            "failures": sorted({f for g in graphs.values() for f in g.failures.values()}),
            "replay_ms": {str(key): r for key, r in replays.items()},  # per compiled call, one per shapes captured
            "replay_ms_total": [round(sum(ms), 3) for ms in zip(*(r for key, r in replays.items()
                                                                   if r and ends_no_window(key)))]}


def last_replay_s(rt: Runtime, key) -> float | None:
    """GPU seconds of one bare replay of the CUDA graph the compiled call ``key`` (without its device) captured last
    on the current device (CuPy), or None where the call is not a captured graph."""
    g = rt.compiled.get((*key, rt.backend.device_key()))
    return g.replay_seconds()[-1] if getattr(g, "captures", 0) else None


def decode_speed(rt: Runtime, context: int, steps: int, sync) -> dict:
    """Median seconds of a decode step, and of the same step without the head (the head's share is the
    difference: inside a CUDA graph it has no time of its own to measure). Where the steps are CUDA graphs,
    also their GPU time alone (``gpu_step_s``, ``gpu_body_s`` without the head) and the host's share of a
    step (``host_s``: the step's wall time less its graph's)."""
    state = filled_state(rt, context, context + 2 * steps + 8)
    rng = np.random.default_rng(1)
    cfg = rt.model.cfg

    def median_step(run) -> float:
        nonlocal state
        times = []
        for i in range(steps + 2):
            t0 = time.perf_counter()
            state = run(rng.integers(0, cfg.n_vocab, 1), state)
            if i >= 2:  # the first steps upload weights, compile kernels and capture graphs
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    step_s = median_step(lambda ids, st: step(rt, ids, st, sync)[0])

    def no_head(ids, st):
        X, st = rt.forward(ids, st)
        sync(X)
        return st

    body_s = median_step(no_head)
    out = {"context": context, "step_s": step_s, "tokens_per_s": 1 / step_s, "head_s": step_s - body_s}
    # the graphs of a step that ends no window (three steps in four; the median step is one of them)
    gpu_step_s, gpu_body_s = (last_replay_s(rt, ("step", 1, 1, head, ())) for head in (True, False))
    if gpu_step_s is not None and gpu_body_s is not None:
        out.update(gpu_step_s=gpu_step_s, gpu_body_s=gpu_body_s, host_s=step_s - gpu_step_s,
                   gpu_layer_ms=gpu_body_s / cfg.n_layer * 1e3)
    return out


def prefill_speed(rt: Runtime, n_tokens: int, sync) -> dict:
    cfg = rt.model.cfg
    state = new_state(cfg, rt.backend, Geometry.for_context(cfg, n_tokens + 1, CHUNK))
    ids = np.random.default_rng(2).integers(0, cfg.n_vocab, n_tokens)
    chunks = []
    for start in range(0, n_tokens, CHUNK):
        t0 = time.perf_counter()
        state, _ = step(rt, ids[start:start + CHUNK], state, sync)
        chunks.append(time.perf_counter() - t0)
    steady = statistics.median(chunks[1:]) if len(chunks) > 1 else chunks[0]
    return {"tokens": n_tokens, "seconds": sum(chunks), "tokens_per_s": n_tokens / sum(chunks), "chunk_s": chunks,
            "steady_tokens_per_s": CHUNK / steady}  # a later chunk's rate: the first grows memory pools


class Profile:
    """Synchronised timers around the parts of a step: attention core, the rest of the attention half
    (projections, HC, compressor, indexer, RoPE, FP8/FP4 simulation), routed experts, the rest of the
    FFN half (router, shared expert, HC), and the head."""

    def __init__(self, rt: Runtime, sync):
        self.rt, self.sync, self.totals = rt, sync, {}
        self._saved = {}

    def _wrap(self, owner, name: str, label: str):
        fn = getattr(owner, name)
        self._saved[(owner, name)] = (fn, name in vars(owner))

        def timed(*args, **kw):
            self.sync()
            t0 = time.perf_counter()
            out = fn(*args, **kw)
            self.sync(*(out if isinstance(out, tuple) else (out,)))
            self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - t0
            return out

        setattr(owner, name, timed)

    def __enter__(self):
        rt, t = self.rt, self.rt.model
        self._compile, rt.compile = rt.compile, False  # MLX cannot synchronise inside a compiled function
        self._wrap(t.ops, "attend", "attention core")
        self._wrap(t, "attention_block", "attention half")
        self._wrap(transformer_module, "routed_experts_gathered", "routed experts")
        self._wrap(transformer_module, "routed_experts", "routed experts")
        self._wrap(t, "ffn_block", "ffn half")
        self._wrap(t, "head", "head")
        return self

    def __exit__(self, *exc):
        for (owner, name), (fn, own) in self._saved.items():
            if own:
                setattr(owner, name, fn)
            else:  # a method found on the class: drop the instance's wrapper
                delattr(owner, name)
        self.rt.compile = self._compile

    def breakdown(self) -> dict:
        tot = self.totals
        return {
            "attention core": tot.get("attention core", 0.0),
            "attention projections + HC + compressor + indexer": tot.get("attention half", 0.0)
            - tot.get("attention core", 0.0),
            "routed experts": tot.get("routed experts", 0.0),
            "router + shared expert + HC": tot.get("ffn half", 0.0) - tot.get("routed experts", 0.0),
            "head": tot.get("head", 0.0),
        }


def profiled_decode(rt: Runtime, context: int, sync, steps: int = 4) -> dict:
    state = filled_state(rt, context, context + steps + 8)
    rng = np.random.default_rng(3)
    n_vocab = rt.model.cfg.n_vocab
    state, _ = step(rt, rng.integers(0, n_vocab, 1), state, sync)
    with Profile(rt, sync) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _ = step(rt, rng.integers(0, n_vocab, 1), state, sync)
        wall = (time.perf_counter() - t0) / steps
    parts = {k: v / steps for k, v in prof.breakdown().items()}
    parts["synchronised step"] = wall
    return parts


def decode_bytes(cfg, tensors, context: int) -> int:
    """Bytes a decode step must read: every weight it uses in its stored type (the selected experts
    only, one embedding row), plus the KV rows its attention reads (float32 here)."""
    total = 0
    for name, shape, _, raw in tensors:
        if name == "token_embd.weight":
            total += raw.nbytes // shape[-1]
        elif "_exps." in name:
            total += raw.nbytes // cfg.n_expert * cfg.n_expert_used
        elif "tid2eid" in name:
            total += raw.nbytes // shape[-1]
        else:
            total += raw.nbytes
    D = cfg.head_dim
    for il in range(cfg.n_layer):
        R = cfg.ratio(il)
        total += min(context, cfg.swa) * D * 4
        if R == 4:
            total += min(context // 4, cfg.idx_topk) * D * 4 + (context // 4) * cfg.idx_dim * 4
        elif R:
            total += (context // R) * D * 4
    return total


def per_layer(cfg, d: dict) -> dict:
    """A layer's share of the slice's decode step (wall time less the head, over the layers), and the full
    model's step. Where the step is one CUDA graph the estimate is 43 × the graph's GPU time per layer +
    the head + the host's share of a step, which does not grow with the layers (the state passes from one
    replay to the next as one span); otherwise 43 × the wall time per layer + the head."""
    layer = (d["step_s"] - d["head_s"]) / cfg.n_layer
    if "gpu_body_s" in d:
        full = FULL_LAYERS * d["gpu_body_s"] / cfg.n_layer + d["gpu_step_s"] - d["gpu_body_s"] + d["host_s"]
    else:
        full = FULL_LAYERS * layer + d["head_s"]
    return {"layer_ms": layer * 1e3, "full_model_step_ms": full * 1e3, "full_model_tokens_per_s": 1 / full,
            "full_model_layer_ms": full / FULL_LAYERS * 1e3}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cupy", choices=("cupy", "mlx"))
    p.add_argument("--plain", action="store_true", help="the plain-ops path (kernels off)")
    p.add_argument("--decode-ctx", type=int, nargs="*", default=[4096, 32768])
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill", type=int, nargs="*", default=[8192, 32768])
    p.add_argument("--json", help="write the results here")
    p.add_argument("--cprofile", type=int, default=0, metavar="STEPS",
                   help="profile STEPS decode steps at the first --decode-ctx (cProfile), print the top, exit")
    p.add_argument("--gather-all", action="store_true",
                   help="prefill the attention output's groups gathered too (qgemm, not per-group GEMMs)")
    p.add_argument("--dense-qgemm", action="store_true",
                   help="prefill dense linears through qgemm (not dequantize + GEMM)")
    p.add_argument("--no-attn-chunk", action="store_true",
                   help="prefill attention through the plain ops' GEMMs around a score tensor (not attend_chunk)")
    p.add_argument("--tf32", action="store_true", help="prefill_matmul='tf32' (chunk products on TF32 operands)")
    p.add_argument("--no-compile", action="store_true", help="MLX: run the attention step eagerly")
    p.add_argument("--config", default="flash", choices=("flash", "nano"),
                   help="nano: a small model of the same shape, to try the script on a CPU")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    cfg = SLICE if args.config == "flash" else NANO
    tensors = model_tensors(cfg, seed=0, distinct_rows=8)
    built_s = time.perf_counter() - t0
    prefill_matmul = "tf32" if args.tf32 else "float32"
    rt = build(cfg, args.backend, not args.plain, tensors, prefill_matmul)
    if args.gather_all:
        rt.model.gather_max_pairs = float("inf")
    BlockLinear.qgemm_chunks = args.dense_qgemm
    ops.ATTN_CHUNK_KERNEL = not args.no_attn_chunk
    if args.no_compile:
        rt.compile = False
    sync = syncer(rt.backend)
    out = {"backend": args.backend, "device": getattr(rt.backend, "device", "?"), "kernels": not args.plain,
           "gather_all": args.gather_all, "dense_qgemm": args.dense_qgemm, "compile": rt.compile,
           "attn_chunk": ops.ATTN_CHUNK_KERNEL, "prefill_matmul": prefill_matmul,
           "weights_bytes": int(sum(r.nbytes for *_, r in tensors)), "build_s": built_s}
    out["copy_bandwidth_Bps"] = bw = copy_bandwidth(rt.backend)
    print(f"{args.backend} kernels={not args.plain} tf32={args.tf32} gather_all={args.gather_all} "
          f"dense_qgemm={args.dense_qgemm} "
          f"compile={rt.compile}: "
          f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)

    t0 = time.perf_counter()
    first = new_state(cfg, rt.backend, Geometry.for_context(cfg, CHUNK + 1, CHUNK))
    step(rt, np.arange(CHUNK) % cfg.n_vocab, first, sync)
    out["first_chunk_s"] = time.perf_counter() - t0  # weight upload + kernel compilation + one chunk
    print(f"first {CHUNK}-token chunk of this process: {out['first_chunk_s']:.1f} s", flush=True)

    if args.cprofile:
        import cProfile
        import pstats

        ctx = args.decode_ctx[0]
        state = filled_state(rt, ctx, ctx + args.cprofile + 8)
        for i in range(2):  # the first step runs eagerly, the second captures CUDA graphs (CuPy)
            state, _ = step(rt, np.array([i]), state, sync)
        print("graphs:", graph_report(rt))
        with cProfile.Profile() as prof:
            for i in range(args.cprofile):
                state, _ = step(rt, np.array([i + 2]), state, sync)
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        state = filled_state(rt, CHUNK, 2 * CHUNK + 1)
        with Profile(rt, sync) as parts, cProfile.Profile() as prof:
            t0 = time.perf_counter()
            step(rt, np.arange(CHUNK) % cfg.n_vocab, state, sync)
            wall = time.perf_counter() - t0
        print(f"one {CHUNK}-token prefill chunk: {wall:.3f} s;",
              ", ".join(f"{k} {v:.3f} s" for k, v in parts.breakdown().items()))
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return

    out["decode"] = []
    for ctx in args.decode_ctx:
        d = decode_speed(rt, ctx, args.decode_steps, sync)
        prof = profiled_decode(rt, ctx, sync)
        need = decode_bytes(cfg, tensors, ctx)
        d.update(profile_s=prof, bytes_read=need, roofline_s=need / bw, roofline_fraction=need / bw / d["step_s"])
        d.update(per_layer(cfg, d))
        out["decode"].append(d)
        print(f"decode @ {ctx}: {d['tokens_per_s']:.1f} tok/s ({d['step_s'] * 1e3:.2f} ms; "
              f"{d['layer_ms']:.3f} ms/layer, head {d['head_s'] * 1e3:.2f} ms; "
              f"roofline {d['roofline_s'] * 1e3:.2f} ms = {100 * d['roofline_fraction']:.1f}%); 43 layers: "
              f"{d['full_model_step_ms']:.2f} ms, {d['full_model_tokens_per_s']:.1f} tok/s, "
              f"{d['full_model_layer_ms']:.3f} ms/layer all in", flush=True)
        if "gpu_step_s" in d:
            print(f"  GPU time of the step's graph {d['gpu_step_s'] * 1e3:.2f} ms ({d['gpu_layer_ms']:.3f} ms/layer, "
                  f"head {(d['gpu_step_s'] - d['gpu_body_s']) * 1e3:.2f} ms); the host's share "
                  f"{d['host_s'] * 1e3:.2f} ms", flush=True)
        print("  " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in prof.items()), flush=True)
    out["graphs"] = graph_report(rt)
    print("graphs:", out["graphs"], flush=True)
    out["prefill"] = []
    for n in args.prefill:
        r = prefill_speed(rt, n, sync)
        r["us_per_layer_token"] = r["seconds"] / n / cfg.n_layer * 1e6
        r["steady_us_per_layer_token"] = 1e6 / r["steady_tokens_per_s"] / cfg.n_layer
        out["prefill"].append(r)
        print(f"prefill {n}: {r['tokens_per_s']:.0f} tok/s ({r['us_per_layer_token']:.1f} us per layer per token, "
              f"head included); after the first chunk {r['steady_tokens_per_s']:.0f} tok/s "
              f"({r['steady_us_per_layer_token']:.1f} us)", flush=True)
    out["memory"] = gpu_memory(rt.backend)
    print("memory:", out["memory"], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
