"""One rank of the tests in test_distributed.py, started on every rank of a group (``mlx.launch`` or by hand).

``python distributed_worker.py MODEL OUT PLAN [--kill-rank R]``: a session placed over the group's ranks
(PLAN: "pipeline" for ``Placement.over_ranks()``, or comma-separated layer ranks), the prompt of the tests
prefilled and decoded; each rank writes what it saw to ``OUT/rank{r}.npz`` (logits after every step, the
sampled tokens, its own layers' KV arrays, its tier trace, what its TierView shows). Rank 0 also writes the
gathered checkpoint to ``OUT/gathered.dsv4`` and offers its own part to scatter (every rank must refuse it);
then it scatters ``OUT/single.dsv4`` (written by the test from one process) and every rank decodes on from it. With
``--kill-rank R`` rank R kills itself (SIGKILL) in the middle of the first step, when it enters its first layer.
"""

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np

import ds4lab
from ds4lab import Checkpoint, Placement
from ds4lab.kv.layout import LAYER_FIELDS

PROMPT = np.random.default_rng(5).integers(0, 1000, 90).tolist()
CTX, CHUNK = 128, 32
SEED, N_DECODE = 3, 3  # the first decode
SEED_AFTER, N_AFTER = 4, 2  # the decode after the scatter


def placement(plan: str) -> Placement:
    if plan == "pipeline":
        return Placement.over_ranks()
    ranks = [int(r) for r in plan.split(",")]
    return Placement(layer_tiers=ranks, devices=[f"rank:{r}" for r in range(max(ranks) + 1)])


def kill_mid_step(model) -> None:
    """SIGKILL this process when it enters its first layer (the previous stage's hidden state received)."""
    model.runtime._attention = lambda *args: os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    model_path, out, plan = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    kill_rank = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[4] == "--kill-rank" else None
    model = ds4lab.load(model_path, backend="mlx", device="cpu")
    sess = model.session(ctx=CTX, prefill_chunk=CHUNK, placement=placement(plan))
    rank = sess.placement.ranks.rank
    if kill_rank == rank:
        kill_mid_step(model)
    logits = []
    for _ in sess.prefill(PROMPT):
        logits.append(sess.logits)
    decode = sess.decoder(seed=SEED)
    tokens = []
    for _ in range(N_DECODE):
        tokens.append(decode.step().token)
        logits.append(sess.logits)
    own = {f"{il}.{name}": np.array(a) for il, layer in enumerate(sess._state.layers)
           for name, a in zip(LAYER_FIELDS, layer.arrays()) if a is not None}
    whole = sess.gather()
    if rank == 0:
        (out / "gathered.dsv4").write_bytes(whole.to_bytes())
    try:  # rank 0 offers its own part: refused on every rank, the session unchanged
        sess.scatter(sess.checkpoint() if rank == 0 else None)
        refused = ""
    except ValueError as e:
        refused = str(e)
    unchanged = sess.tokens == PROMPT + tokens and np.array_equal(sess.logits, logits[-1])
    single = Checkpoint.from_bytes((out / "single.dsv4").read_bytes(), model.config) if rank == 0 else None
    sess.scatter(single)
    after = sess.decoder(seed=SEED_AFTER)
    after_tokens = [after.step().token for _ in range(N_AFTER)]
    trace = [list(vars(s).values()) for s in sess.tier_trace]
    from ds4lab.viz import TierView  # what this rank's TierView shows: its part, its units solid, the others dashed

    view = TierView(sess)
    np.savez(out / f"rank{rank}.npz", logits=np.stack(logits), tokens=tokens, after_tokens=after_tokens,
             after_logits=sess.logits, trace=json.dumps(trace), part=sess.placement.part, refused=refused,
             unchanged=unchanged, view_part=view.model.part, view_here=[u["here"] for u in view.model.units],
             view_dashed=view.static_html().count("border-style:dashed"), **own)


if __name__ == "__main__":
    main()
