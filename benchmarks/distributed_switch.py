"""What a tier switch between processes costs over the link (loopback on one host): the hidden state's trip from
one rank to the next, against a decode step and a prefill chunk of the same model in one process, and the steps
of a session placed over the ranks (ds4lab.distributed). Start every rank with mlx.launch:

    mlx.launch --backend ring -n 2 -- python benchmarks/distributed_switch.py [--json out.json]

Rank 0 prints the table (and writes the JSON). The link figures are ping-pongs (half the median round trip) of
the arrays a switch sends: one token's hidden state (decode), a chunk's (batch), the head's logits that every
rank receives, and the same for the full Flash's sizes (n_hc × n_embd = 4 × 4096, 129,280 logits, 2048-token
chunks). The one-process steps run on rank 0 while the other ranks wait: with one tier (the whole step as one
compiled call) and with two logical tiers (layer by layer, the code path the ranks run). The shares divide a
switch's one-way link time by the step over the ranks and by the two-tier step of one process. On one host the
ranks share its cores, and a rank waiting on the ring backend still uses some CPU (about 0.3 of a core measured
here), so the steps over ranks are slower than the link alone explains.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

import ds4lab
from ds4lab import Placement
from ds4lab.config import FLASH, NANO, replace
from ds4lab.testing import make_model

CONFIGS = {"nano": NANO, "wide": replace(NANO, n_embd=1024, q_lora=512, o_lora=512, ff_exp=1024, n_vocab=4096)}


def one_way(group, shape, repeat: int) -> dict:
    """Half the fastest and half the median round trip of a float32 array of ``shape`` between ranks 0 and 1
    (seconds), after one untimed trip; arrays over 1 MiB make 5 trips. Other ranks idle. On a loaded host the
    median is mostly the wait for the other process to be scheduled; the fastest trip is closer to the link."""
    rank, x = group.rank(), mx.zeros(shape, dtype=mx.float32)
    mx.eval(x)
    trips = []
    for _ in range(1 + (repeat if x.nbytes <= 1 << 20 else 5)):
        began = time.perf_counter()
        if rank == 0:
            mx.eval(mx.distributed.send(x, 1, group=group, stream=mx.cpu))
            mx.eval(mx.distributed.recv(shape, mx.float32, 1, group=group, stream=mx.cpu))
        elif rank == 1:
            y = mx.distributed.recv(shape, mx.float32, 0, group=group, stream=mx.cpu)
            mx.eval(mx.distributed.send(y, 0, group=group, stream=mx.cpu))
        trips.append(time.perf_counter() - began)
    return dict(min=float(np.min(trips[1:])) / 2, median=float(np.median(trips[1:])) / 2)


def barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.zeros((1,)), group=group, stream=mx.cpu))


def steps(model, placement, prompt, chunk: int, n_decode: int) -> dict:
    """Seconds per prefill chunk and per decode step (after a warm-up run of the same steps), and this rank's
    seconds in the switches that carried the hidden state, per step."""
    for warm in (True, False):
        sess = model.session(ctx=len(prompt) + n_decode + 1, prefill_chunk=chunk, placement=placement)
        chunks = sess.prefill(prompt).run(progress=False)
        decoded = list(sess.decoder(temperature=0).stream(n_decode))
    full = [c for c in chunks if c.n_tokens == chunk]

    def median(values) -> float:
        return float(np.median(list(values)))

    def switch_s(record) -> float:
        return sum(s.seconds for s in record.tier_switches if s.mode != "no-copy")

    return dict(chunk_s=median(c.seconds for c in full), decode_s=median(s.seconds for s in decoded),
                chunk_switch_s=median(map(switch_s, full)), decode_switch_s=median(map(switch_s, decoded)),
                tokens=[s.token for s in decoded])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="nano", choices=CONFIGS)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--decode", type=int, default=16)
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--json")
    args = p.parse_args(argv)
    group = mx.distributed.init()
    if group.size() < 2:
        raise SystemExit("start it on two or more ranks: mlx.launch --backend ring -n 2 -- python " + __file__)
    rank, cfg = group.rank(), CONFIGS[args.config]
    with tempfile.TemporaryDirectory() as tmp:  # every rank writes the same seeded file (hosts share no disk)
        model = ds4lab.load(make_model(cfg, Path(tmp) / "model.gguf", seed=0), backend="mlx", device="cpu")
        prompt = np.random.default_rng(0).integers(0, cfg.n_vocab, args.prompt).tolist()
        hidden, flash = (cfg.n_hc, cfg.n_embd), (FLASH.n_hc, FLASH.n_embd)
        link = {name: one_way(group, shape, args.repeat) for name, shape in [
            ("decode hidden", (1, *hidden)), ("chunk hidden", (args.chunk, *hidden)), ("logits", (1, cfg.n_vocab)),
            ("Flash decode hidden", (1, *flash)), ("Flash 2048-row chunk", (2048, *flash)),
            ("Flash logits", (1, FLASH.n_vocab))]}
        one = tiered = None
        if rank == 0:
            one = steps(model, Placement.single(), prompt, args.chunk, args.decode)
            tiered = steps(model, Placement.even(2), prompt, args.chunk, args.decode)
        barrier(group)
        split = steps(model, Placement.over_ranks(group), prompt, args.chunk, args.decode)
    if rank != 0:
        return
    assert split["tokens"] == one["tokens"], "the ranks decoded other tokens than one process"
    shares = {f"{name} ({stat}) / {step} {kind}": link[name][stat] / steps_[f"{kind}_s"]
              for name, kind in [("decode hidden", "decode"), ("logits", "decode"), ("chunk hidden", "chunk")]
              for stat in ("min", "median")
              for step, steps_ in [("over ranks", split), ("one process, two tiers", tiered)]}
    report = dict(config=args.config, ranks=group.size(), chunk=args.chunk, link_s=link, one_process=one,
                  one_process_two_tiers=tiered, over_ranks=split, shares=shares)
    print(f"{args.config} model over {group.size()} ranks, {args.chunk}-token chunks, loopback:")
    for name, s in link.items():
        print(f"  link, one way: {name:<22} fastest {s['min'] * 1e6:10.1f} µs   median {s['median'] * 1e6:10.1f} µs")
    for name, r in [("one process, one tier", one), ("one process, two tiers", tiered), ("over ranks", split)]:
        print(f"  {name:<23} decode step {r['decode_s'] * 1e3:8.2f} ms   chunk {r['chunk_s'] * 1e3:8.2f} ms")
    print(f"  rank 0's own seconds in the hidden state's switch, per step: {split['decode_switch_s'] * 1e6:.0f} µs "
          f"decode, {split['chunk_switch_s'] * 1e6:.0f} µs chunk")
    for name, share in shares.items():
        print(f"  share: {name:<60} {share:8.3%}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
