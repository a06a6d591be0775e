"""The full 43-layer Flash model on one GPU: ds4-bench's frontier sweep on a file of the exact Flash q2 layout.

The file (81 GiB) is written sparse on the machine's local disk by ``ds4lab.testing.make_sparse_model``:
embeddings, routers, norms, hyper-connection and indexer weights seeded random (routing differs per token),
the routed experts and the big projections holes (zeros: the same bytes read, the same work done). Prints,
for one setting of ``prefill_matmul``, each frontier's prefill and decode tokens/s, the decode roofline from
the bytes a decoded token reads and the copy bandwidth measured in the same run, peak GPU memory, the time
from process start to the first row, (CuPy) the GPU time of a bare replay of each captured step's graph, and a
decode step's wall time in the sweep against a bare runtime step's.
``benchmarks/gpu_suite.sh flash`` runs float32, tf32 and f16.

    python benchmarks/flash_full.py --backend cupy [--prefill-matmul tf32] [--decode-matmul q8] [--ctx-max 8192]
        [--json out.json]
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
from gpu_slice import copy_bandwidth, gpu_memory, graph_report  # noqa: E402

import ds4lab  # noqa: E402
from ds4lab import bench, config, testing  # noqa: E402


def since_process_start() -> float:
    """Seconds since this process started (Linux: its start time in /proc, in clock ticks since boot)."""
    ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
    return float(Path("/proc/uptime").read_text().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def decode_bytes(model) -> int:
    """Bytes a decoded token reads: every tensor but the routed experts, the embedding table and the hash
    tables (a row each), plus the selected experts' gate, up and down in every layer."""
    cfg, tensors = model.config, model.file.tensors
    dense = sum(t.nbytes for n, t in tensors.items()
                if not n.endswith(("_exps.weight", "tid2eid.weight")) and n != "token_embd.weight")
    per_expert = sum(tensors[f"blk.0.ffn_{k}_exps.weight"].nbytes for k in ("gate", "up", "down")) // cfg.n_expert
    return dense + cfg.n_layer * cfg.n_expert_used * per_expert


def runtime_step_ms(model, sess, tokens, steps: int = 16) -> float:
    """Median milliseconds of a bare decode step from the session's state (the runtime's step and its logits on
    the host, no sampling or session bookkeeping): against the sweep's step, what the session adds."""
    state, walls = sess._state, []
    for i in range(steps):
        began = time.perf_counter()
        logits, state = model.runtime.forward_logits(np.array([tokens[i]]), state)
        model.backend.to_numpy(logits)
        walls.append(time.perf_counter() - began)
    return float(np.median(walls)) * 1e3


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cupy")
    p.add_argument("--prefill-matmul", default="float32", choices=["float32", "tf32", "f16"])
    p.add_argument("--decode-matmul", default="float32", choices=["float32", "q8"],
                   help="q8: the decode products on x quantized to int8 per block, as ds4's decode (ds4lab.load)")
    p.add_argument("--path", type=Path, default=Path("/tmp/flash.gguf"))
    p.add_argument("--ctx-start", type=int, default=2048)
    p.add_argument("--ctx-max", type=int, default=8192)
    p.add_argument("--step-incr", type=int, default=2048)
    p.add_argument("--gen-tokens", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=2048)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="decode by ds4's sampling with this temperature (default 0: ds4-bench's greedy argmax)")
    p.add_argument("--min-p", type=float, default=0.05, help="with --temperature above 0 (ds4's default 0.05)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    sampling = {"temperature": args.temperature, "min_p": args.min_p} if args.temperature > 0 else None
    out = {"setting": args.prefill_matmul, "decode_matmul": args.decode_matmul, "backend": args.backend,
           "sampling": sampling}
    if not args.path.exists():
        began = time.perf_counter()
        testing.make_sparse_model(config.FLASH, args.path, seed=1, filled=testing.routing_filled)
        out["file_written_s"] = time.perf_counter() - began
    model = ds4lab.load(args.path, backend=args.backend, prefill_matmul=args.prefill_matmul,
                        decode_matmul=args.decode_matmul)
    tokens = np.random.default_rng(0).integers(0, model.config.n_vocab - 7, args.ctx_max).tolist()
    sess = model.session(ctx=args.ctx_max + args.gen_tokens + 1, prefill_chunk=args.prefill_chunk, max_checkpoints=2)
    rows = []
    for row in bench.sweep(model, tokens, args.ctx_start, args.ctx_max, args.step_incr, 1.0, args.gen_tokens,
                           session=sess, sampling=sampling):
        if not rows:
            out["first_row_s"] = since_process_start()
        rows.append({"ctx": row.ctx_tokens, "prefill_tokens": row.prefill_tokens, "prefill_tps": row.prefill_tps,
                     "gen_tps": row.gen_tps})
        print(json.dumps(rows[-1]), flush=True)
    bandwidth = copy_bandwidth(model.backend)
    nbytes = decode_bytes(model)
    out.update(rows=rows, copy_bandwidth=bandwidth, decode_bytes=nbytes, roofline_tps=bandwidth / nbytes,
               roofline_share=[r["gen_tps"] * nbytes / bandwidth for r in rows], memory=gpu_memory(model.backend))
    if hasattr(model.runtime, "compiled"):  # the decode step's GPU time alone, against the sweep's wall time
        out["graphs"] = graph_report(model.runtime)
    out["decode_step_ms"] = {"sweep": 1e3 / rows[-1]["gen_tps"], "runtime": runtime_step_ms(model, sess, tokens)}
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
