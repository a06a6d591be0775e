"""The full 43-layer Flash model on one GPU: ds4-bench's frontier sweep on a file of the exact Flash q2 layout.

``--experts`` picks the routed experts of another of ds4's Flash files (``testing.FLASH_EXPERT_LAYOUTS``: q2-q4,
q4, mxfp4). The file (81 GiB for q2) is written sparse on the machine's local disk by
``ds4lab.testing.make_sparse_model``:
embeddings, routers, norms, hyper-connection and indexer weights seeded random (routing differs per token, and the
indexer's scores row to row), the routed experts and the big projections holes (zeros: the same bytes read, the
same work done). The sweep warms up first (``bench.sweep``'s warm-up: an untimed prefill of one chunk and 8
untimed decode steps, so the first frontier leaves out the graph captures and the chunk's one-time work; the
decode steps since 2026-12-06, the chunk since 2026-12-07: the first frontier's prefill included it). Prints, for one
setting of ``prefill_matmul``, each frontier's prefill and decode tokens/s, the decode roofline from the bytes a
decoded token reads and the copy bandwidth measured in the same run, peak GPU memory, the time from process start
to the model loaded, to the first token generated from a 16-token prompt (issue 25's cold start: load, kernels
compiled or read from their cache, a chunk, a decode step) and to the first row (each net of writing the file
where this process wrote it), (CuPy) the GPU time of a bare replay of each captured step's graph, and a decode
step's wall time in the sweep against a bare runtime step's.
``benchmarks/gpu_suite.sh flash`` runs float32, tf32 and f16.

``--tiers N`` splits the layers evenly over N tiers (``Placement.even``): on CuPy the GPUs cuda:0 … N-1, on
another backend N tiers of one device (``--config nano --backend numpy`` tries that on a CPU). It adds each
frontier's tier switches (``Session.tier_trace``: their seconds by mode, and their share of the prefill's and
the decode's wall time) and the memory of each GPU; the bare-step and graph figures are one GPU's only.

``--layers N`` keeps the layout's first N layers (full width): 30 of them (57 GiB) fit an H100, to compare two
commits' whole decode steps where no H200 is lent. Figures for the README come from all 43.

    python benchmarks/flash_full.py --backend cupy [--prefill-matmul tf32] [--decode-matmul q8] [--ctx-max 8192]
        [--tiers 2] [--layers 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_timeline import timeline  # noqa: E402
from gpu_slice import copy_bandwidth, gpu_memory, graph_report  # noqa: E402

import ds4lab  # noqa: E402
from ds4lab import bench, config, testing  # noqa: E402

FIRST_PROMPT = 16  # tokens of the prompt whose first generated token is timed from process start


def sparse_file(cfg, stem: str, layers: int | None, path: Path | None = None,
                experts=testing.FLASH_EXPERT_LAYOUTS["q2"]) -> tuple[Path, float | None]:
    """The synthetic file of ``cfg`` and the seconds its writing took (None where it existed): ``path``, else
    /tmp/<stem>[-<layers>l].gguf, the name decode_steps.py finds this script's file by."""
    path = path or Path(f"/tmp/{stem}{'' if layers is None else f'-{cfg.n_layer}l'}.gguf")
    if path.exists():
        return path, None
    began = time.perf_counter()
    testing.make_sparse_model(cfg, path, seed=1, filled=testing.routing_filled, expert_types=experts)
    return path, time.perf_counter() - began


def since_process_start() -> float:
    """Seconds since this process started (Linux: its start time in /proc, in clock ticks since boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def decode_bytes(model) -> int:
    """Bytes a decoded token reads: every tensor but the routed experts, the embedding table and the hash
    tables (a row each), plus the selected experts' gate, up and down in every layer (each layer's own types: the
    q2-q4 file's last layers are Q4_K)."""
    cfg, tensors = model.config, model.file.tensors
    dense = sum(t.nbytes for n, t in tensors.items()
                if not n.endswith(("_exps.weight", "tid2eid.weight")) and n != "token_embd.weight")
    experts = sum(tensors[f"blk.{il}.ffn_{k}_exps.weight"].nbytes for il in range(cfg.n_layer)
                  for k in ("gate", "up", "down"))
    return dense + experts // cfg.n_expert * cfg.n_expert_used


RUNTIME_STEPS = 16  # runtime_step_ms's steps, from the last frontier: the session holds room for them


def runtime_step_ms(model, sess, tokens, steps: int = RUNTIME_STEPS) -> float:
    """Median milliseconds of a bare decode step from the session's state (the runtime's step and its logits on
    the host, no sampling or session bookkeeping): against the sweep's step, what the session adds."""
    state, walls = sess._state, []
    for i in range(steps):
        began = time.perf_counter()
        logits, state = model.runtime.forward_logits(np.array([tokens[i]]), state)
        model.backend.to_numpy(logits)
        walls.append(time.perf_counter() - began)
    return float(np.median(walls)) * 1e3


def device_memory(backend, n_devices: int) -> list[dict]:
    """gpu_memory of each of the first ``n_devices`` GPUs (CuPy), or the backend's one figure elsewhere."""
    if backend.name != "cupy":
        return [gpu_memory(backend)]
    import cupy as cp

    out = []
    for i in range(n_devices):
        with cp.cuda.Device(i):
            out.append(gpu_memory(backend))
    return out


def switch_shares(switches, row) -> dict:
    """A frontier's tier switches: how many and their seconds by mode, and the batch (prefill) and decode switches'
    share of the prefill's and the decode's wall time."""
    counts, seconds = {}, {}
    for s in switches:
        counts[s.mode] = counts.get(s.mode, 0) + 1
        seconds[s.mode] = seconds.get(s.mode, 0.0) + s.seconds
    return {"switches": counts, "switch_s": seconds,
            "prefill_switch_share": seconds.get("batch", 0.0) / row.prefill_seconds if row.prefill_seconds else None,
            "decode_switch_share": seconds.get("decode", 0.0) / row.gen_seconds if row.gen_seconds else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy")
    p.add_argument("--prefill-matmul", default="float32", choices=["float32", "tf32", "f16"])
    p.add_argument("--decode-matmul", default="float32", choices=["float32", "q8"],
                   help="q8: the decode products on x quantized to int8 per block, as ds4's decode (ds4lab.load)")
    p.add_argument("--experts", default="q2", choices=list(testing.FLASH_EXPERT_LAYOUTS),
                   help="the routed experts of which of ds4's Flash files (q4 and mxfp4 need more than one H200)")
    p.add_argument("--path", type=Path, default=None,
                   help="the file (default /tmp/<config>.gguf for q2, else /tmp/<config>-<experts>.gguf)")
    p.add_argument("--ctx-start", type=int, default=2048)
    p.add_argument("--ctx-max", type=int, default=8192)
    p.add_argument("--step-incr", type=int, default=2048)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="default: the library's, ds4's rule (4096 tokens where the context is longer)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="decode by ds4's sampling with this temperature (default 0: ds4-bench's greedy argmax)")
    p.add_argument("--min-p", type=float, default=0.05, help="with --temperature above 0 (ds4's default 0.05)")
    p.add_argument("--tiers", type=int, default=1,
                   help="split the layers evenly over this many tiers (CuPy: GPUs cuda:0 ... N-1)")
    p.add_argument("--config", default="flash", choices=("flash", "nano"),
                   help="nano: a small model of the same layout, to try the script on a CPU")
    p.add_argument("--layers", type=int, default=None,
                   help="the layout's first N layers only, at least its hash layers (default all): 30 fit an H100")
    p.add_argument("--timeline", type=int, default=0, metavar="STEPS",
                   help="after the sweep, STEPS greedy decode steps with CUDA events around each graph replay "
                        "(decode_timeline.py: where a step's wall time goes beside its graph; CuPy, one tier)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiers < 1:
        p.error(f"--tiers must be at least 1, not {args.tiers}")
    if args.timeline and (args.backend != "cupy" or args.tiers != 1 or args.timeline < 2):
        p.error("--timeline needs --backend cupy, one tier and at least 2 steps")
    sampling = {"temperature": args.temperature, "min_p": args.min_p} if args.temperature > 0 else None
    out = {"setting": args.prefill_matmul, "decode_matmul": args.decode_matmul, "backend": args.backend,
           "sampling": sampling, "tiers": args.tiers}
    cfg = config.FLASH if args.config == "flash" else config.NANO
    experts = testing.FLASH_EXPERT_LAYOUTS[args.experts]
    per_layer = not isinstance(experts[0], str)  # one pair a layer: the last layers' pairs for a smaller model
    if per_layer:
        experts = experts[-cfg.n_layer:]
    if args.layers is not None:
        if not cfg.n_hash_layer <= args.layers <= cfg.n_layer:  # (the layout's hash layers kept)
            p.error(f"--layers must be {cfg.n_hash_layer} to {cfg.n_layer}, not {args.layers}")
        cfg = config.replace(cfg, n_layer=args.layers)
        experts = experts[:cfg.n_layer] if per_layer else experts
    out["layers"] = cfg.n_layer
    stem = f"{args.config}{'' if args.experts == 'q2' else '-' + args.experts}"
    out["experts"] = args.experts
    args.path, written = sparse_file(cfg, stem, args.layers, args.path, experts)
    if written is not None:
        out["file_written_s"] = written
    model = ds4lab.load(args.path, backend=args.backend, prefill_matmul=args.prefill_matmul,
                        decode_matmul=args.decode_matmul)
    written = out.get("file_written_s", 0.0)  # the process's times below leave the file's writing out
    out["loaded_s"] = since_process_start() - written
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, args.ctx_max).tolist()
    placement = None
    if args.tiers > 1:
        devices = [f"cuda:{i}" for i in range(args.tiers)] if args.backend == "cupy" else None
        placement = ds4lab.Placement.even(args.tiers, devices=devices)
    first = model.session(ctx=FIRST_PROMPT + 1, prefill_chunk=args.prefill_chunk, placement=placement)
    first.prefill(tokens[:FIRST_PROMPT]).run(progress=False)
    first.decoder(temperature=0.0).step(more=False)  # sampled from the prompt's logits, then evaluated
    out["first_token_s"] = since_process_start() - written
    del first
    room = max(args.gen_tokens, RUNTIME_STEPS, args.timeline)  # the decode steps after the last frontier
    sess = model.session(ctx=args.ctx_max + room + 1, prefill_chunk=args.prefill_chunk,
                         max_checkpoints=2, placement=placement)
    out["prefill_chunk"] = sess.geometry.chunk
    rows, seen = [], 0
    for row in bench.sweep(model, tokens, args.ctx_start, args.ctx_max, args.step_incr, 1.0, args.gen_tokens,
                           session=sess, sampling=sampling):
        if not rows:
            out["first_row_s"] = since_process_start() - written
        rows.append({"ctx": row.ctx_tokens, "prefill_tokens": row.prefill_tokens, "prefill_tps": row.prefill_tps,
                     "gen_tps": row.gen_tps})
        if placement is not None:  # the switches since the last row (the trace keeps far more than a sweep makes)
            switches = list(sess.tier_trace)[seen:]
            seen = len(sess.tier_trace)
            rows[-1].update(switch_shares(switches, row))
        print(json.dumps(rows[-1]), flush=True)
    bandwidth = copy_bandwidth(model.backend)
    nbytes = decode_bytes(model)
    out.update(rows=rows, copy_bandwidth=bandwidth, decode_bytes=nbytes, roofline_tps=bandwidth / nbytes,
               roofline_share=[r["gen_tps"] * nbytes / bandwidth for r in rows])
    if placement is None:
        out["memory"] = gpu_memory(model.backend)
        if hasattr(model.runtime, "compiled"):  # the decode step's GPU time alone, against the sweep's wall time
            out["graphs"] = graph_report(model.runtime)
        out["decode_step_ms"] = {"sweep": 1e3 / rows[-1]["gen_tps"], "runtime": runtime_step_ms(model, sess, tokens)}
        if args.timeline:
            out["timeline_ms"] = timeline(sess, args.timeline)
    else:  # a bare runtime step and a graph's replay run on one device: only the sweep's step here
        out["placement"] = repr(sess.placement)
        out["memory"] = device_memory(model.backend, args.tiers)
        out["decode_step_ms"] = {"sweep": 1e3 / rows[-1]["gen_tps"]}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
