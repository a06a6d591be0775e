"""Tiers over the ranks of an mx.distributed group: 2 and 3 processes on 127.0.0.1 (the ring backend over TCP,
started with mlx.launch) give the logits, KV state and sampled tokens of one process bit for bit; their gathered
checkpoint is the one process's DSV4 payload byte for byte and restores there, and one process's checkpoint
scatters back into them; a rank killed mid-step makes the others fail with the link's error, in seconds.

Every rank runs tests/distributed_worker.py; the reference runs here, with the same backend (MLX on the CPU)."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import ds4lab
from ds4lab import Checkpoint, Placement
from ds4lab.kv.layout import LAYER_FIELDS

mx = pytest.importorskip("mlx.core")
if not mx.distributed.is_available():
    pytest.skip("this MLX has no mx.distributed", allow_module_level=True)

from ds4lab.distributed import Ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from distributed_worker import CHUNK, CTX, N_AFTER, N_DECODE, PROMPT, SEED, SEED_AFTER  # noqa: E402

WORKER = Path(__file__).parent / "distributed_worker.py"
LAUNCH = Path(sys.executable).parent / "mlx.launch"  # MLX's launcher, beside this interpreter as pip installs it
if not LAUNCH.exists():
    LAUNCH = shutil.which("mlx.launch") or LAUNCH
TIMEOUT = 120  # seconds a whole launch may take before the test fails (about 10-20 s here)


def free_port(n: int) -> int:
    """A port p with p … p+n-1 free on 127.0.0.1 (the ring backend listens on one port per rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            p = s.getsockname()[1]
        if p + n < 65536 and all(_free(p + i) for i in range(n)):
            return p
    raise RuntimeError("no run of free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def env() -> dict:
    root = str(Path(__file__).parents[1])  # this checkout's ds4lab, whatever is installed
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
                OPENBLAS_NUM_THREADS="1")


def launch(n: int, model: Path, out: Path, plan: str) -> subprocess.CompletedProcess:
    """``mlx.launch --backend ring -n N`` running the worker; the whole process group is killed afterwards."""
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(n), "--starting-port", str(free_port(n)), "--",
           sys.executable, str(WORKER), str(model), str(out), plan]
    # stdin a pipe that stays empty: mlx.launch forwards its stdin and would spin on /dev/null's endless EOF
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env(), start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=TIMEOUT)
    finally:
        _kill_group(p.pid)
    return subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_one(model: ds4lab.Model):
    """The worker's prefill and first decode in one process: (session, logits after every step, tokens)."""
    sess = model.session(ctx=CTX, prefill_chunk=CHUNK)
    logits = [sess.logits for _ in sess.prefill(PROMPT)]
    decode = sess.decoder(seed=SEED)
    tokens = []
    for _ in range(N_DECODE):
        tokens.append(decode.step().token)
        logits.append(sess.logits)
    return sess, np.stack(logits), tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from ds4lab.testing import make_model
    from tests.conftest import CONFIGS

    cfg, kw = CONFIGS["nano"]
    return make_model(cfg, tmp_path_factory.mktemp("model") / "nano.gguf", seed=7, **kw)


@pytest.fixture(scope="module")
def reference(model_path, tmp_path_factory):
    """One process: the run, its final state and payload; the checkpoint after the prefill (``single.dsv4``, what
    the ranks scatter) and the decode from it."""
    model = ds4lab.load(model_path, backend="mlx", device="cpu")
    prefilled = model.session(ctx=CTX, prefill_chunk=CHUNK)
    prefilled.prefill(PROMPT).run(progress=False)
    single = prefilled.checkpoint().to_bytes()
    sess, logits, tokens = run_one(model)
    state = [{name: np.array(a) for name, a in zip(LAYER_FIELDS, layer.arrays()) if a is not None}
             for layer in sess._state.layers]
    payload = sess.checkpoint().to_bytes()
    prefilled.restore(Checkpoint.from_bytes(single, model.config))
    after = prefilled.decoder(seed=SEED_AFTER)
    after_tokens = [after.step().token for _ in range(N_AFTER)]
    return dict(model=model, logits=logits, tokens=tokens, state=state, payload=payload, single=single,
                after_tokens=after_tokens, after_logits=prefilled.logits, next_logits=next_logits(sess))


def next_logits(sess) -> np.ndarray:
    """The logits after one more (greedy) decode step."""
    sess.decoder(temperature=0).step()
    return sess.logits


def expected_switches(model, layer_ranks: list[int]) -> list[tuple]:
    """(step, layer, from rank, to rank, bytes) of every copying switch of the worker's steps, from the plan alone:
    the prefill's chunks, the decode's tokens and, after the scatter, the second decode's."""
    cfg = model.config
    units = [layer_ranks[0], *layer_ranks, layer_ranks[-1]]  # embedding with the first layer, head with the last
    rows = [min(CHUNK, len(PROMPT) - s) for s in range(0, len(PROMPT), CHUNK)] + [1] * (N_DECODE + N_AFTER)
    out = []
    for step, n in enumerate(rows):
        for u in range(1, len(units)):
            if units[u] != units[u - 1]:
                out.append((step, u - 1, units[u - 1], units[u], n * cfg.n_hc * cfg.n_embd * 4))
    return out


PLANS = {2: "pipeline", 3: "0,0,2,2,1,1"}  # over_ranks(); stages 0 → 2 → 1, the head on rank 1


@pytest.mark.parametrize("n", [2, 3])
def test_ranks_give_the_results_of_one_process(n, model_path, reference, tmp_path):
    model = reference["model"]
    (tmp_path / "single.dsv4").write_bytes(reference["single"])
    done = launch(n, model_path, tmp_path, PLANS[n])
    assert done.returncode == 0, done.stderr[-3000:]
    n_layer = model.config.n_layer
    layer_ranks = ([il * n // n_layer for il in range(n_layer)] if PLANS[n] == "pipeline"
                   else [int(r) for r in PLANS[n].split(",")])
    switches = expected_switches(model, layer_ranks)
    here = []
    for rank in range(n):
        got = np.load(tmp_path / f"rank{rank}.npz")
        # every step's logits, the sampled tokens: the same bits as one process on every rank
        assert np.array_equal(got["logits"], reference["logits"])
        assert got["tokens"].tolist() == reference["tokens"]
        # the rank holds its own layers' KV state, equal to one process's, and no other layer's
        own = sorted({int(k.split(".")[0]) for k in got.files if "." in k})
        assert own == [il for il in range(n_layer) if layer_ranks[il] == rank]
        for il in own:
            for name, want in reference["state"][il].items():
                assert np.array_equal(got[f"{il}.{name}"], want), (rank, il, name)
        # rank 0 refused to scatter a part: every rank raised its reason and kept its state
        assert "holds one part of a split state (rank 0 of" in str(got["refused"])
        assert str(got["refused"]).startswith("the checkpoint" if rank == 0 else f"rank {rank}: rank 0 refused")
        assert bool(got["unchanged"])
        # one process's checkpoint scattered from rank 0: the decode from it is one process's
        assert got["after_tokens"].tolist() == reference["after_tokens"]
        assert np.array_equal(got["after_logits"], reference["after_logits"])
        # every rank records every cross-rank switch of the plan, with its bytes
        trace = [tuple(s) for s in json.loads(str(got["trace"]))]
        copies = [(s[0], s[1], s[2], s[3], s[5]) for s in trace if s[4] != "no-copy"]  # tier t is rank t
        assert copies == switches
        assert all(s[4] == ("batch" if s[0] < 3 else "decode") for s in trace if s[4] != "no-copy")
        assert all(s[6] >= 0 for s in trace)
        # its TierView names this process's part and draws its own units solid, every other unit dashed
        assert str(got["view_part"]) == str(got["part"]) and str(got["part"]).startswith(f"rank {rank} of {n}")
        here.append(got["view_here"].tolist())  # embed, the layers, the head
        assert here[-1][1:-1] == [layer_ranks[il] == rank for il in range(n_layer)]
        assert int(got["view_dashed"]) == here[-1].count(False)
    assert all(sum(col) == 1 for col in zip(*here))  # each unit is solid on exactly one rank
    # the gathered checkpoint is one process's DSV4 payload, byte for byte, and restores into one process
    gathered = (tmp_path / "gathered.dsv4").read_bytes()
    assert gathered == reference["payload"]
    sess = model.session(ctx=CTX, prefill_chunk=CHUNK)
    sess.restore(Checkpoint.from_bytes(gathered, model.config))
    assert np.array_equal(sess.logits, reference["logits"][-1])
    assert np.array_equal(next_logits(sess), reference["next_logits"])


def test_a_killed_rank_fails_the_others_in_seconds(model_path, tmp_path):
    """Three ranks started by hand (as mlx.launch starts them: MLX_RANK and a ring hostfile), so that each one's
    exit and error is its own and not the launcher's SIGTERM: rank 1 kills itself in the middle of the first step
(a prefill chunk), once it has received the hidden state; ranks 2 and then 0 must fail on the link."""
    port = free_port(3)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{port + r}"] for r in range(3)]))
    procs = []
    began = time.monotonic()
    try:
        for rank in range(3):
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKER), str(model_path), str(tmp_path), "pipeline", "--kill-rank", "1"],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=dict(env(), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile)),
                process_group=procs[0].pid if procs else 0))
        results = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        _kill_group(procs[0].pid)
    elapsed = time.monotonic() - began
    assert procs[1].returncode == -signal.SIGKILL
    for rank in (0, 2):
        stderr = results[rank][1]
        assert procs[rank].returncode == 1, stderr[-2000:]
        assert "ds4lab.distributed.LinkError" in stderr and f"rank {rank}: step 0:" in stderr, stderr[-2000:]
        assert "has stopped (killed, or failed before this step)" in stderr
    assert not (tmp_path / "rank0.npz").exists()
    assert elapsed < 60, f"the survivors took {elapsed:.0f} s to fail"


class FakeGroup:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.parametrize("size, src, dst, path", [
    (2, 0, 1, [0, 1]), (2, 1, 0, [1, 0]), (3, 2, 0, [2, 0]), (4, 0, 2, [0, 1, 2]), (4, 3, 0, [3, 0]),
    (5, 1, 4, [1, 0, 4]), (5, 4, 1, [4, 0, 1]), (4, 2, 2, [2]),
])
def test_arrays_go_round_the_ring_the_shorter_way(size, src, dst, path):
    assert Ranks(FakeGroup(0, size)).path(src, dst) == path


def test_plans_over_ranks_that_cannot_run_say_why(reference, tmp_path):
    model = reference["model"]
    with pytest.raises(ValueError, match=r"tier 'rank:1': the group has 1 rank\(s\), 0…0; start every rank with "
                                         "mlx.launch"):
        model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.even(2, devices=["rank:0", "rank:1"]))
    with pytest.raises(ValueError, match="mix ranks and devices"):
        model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.even(2, devices=["rank:0", "cpu"]))
    numpy_model = ds4lab.load(reference["model"].path, backend="numpy")
    with pytest.raises(ValueError, match="need the mlx backend, not numpy"):
        numpy_model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.over_ranks())
    with pytest.raises(ValueError, match="a kv_store saves whole states"):
        model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.over_ranks(),
                      kv_store=ds4lab.KVStore(tmp_path))


def test_a_part_of_a_split_state_stays_with_its_session(reference):
    """One process as a group of one: its state is a part (rank 0 of 1), which serializes only gathered and
    restores only into its own session; gather and scatter give the whole state and take it back."""
    model = reference["model"]
    sess = model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.over_ranks())
    sess.prefill(PROMPT).run(progress=False)
    cp = sess.checkpoint()
    assert cp.part == sess.placement.part == "rank 0 of 1 (embed, layers 0-5, head; over_ranks(1))"
    with pytest.raises(ValueError, match="Session.gather"):
        cp.to_bytes()
    with pytest.raises(ValueError, match="restore a whole checkpoint"):
        model.session(ctx=CTX, prefill_chunk=CHUNK).restore(cp)
    with pytest.raises(ValueError, match="this process holds one part of the KV state"):
        sess.kv
    whole = sess.gather()
    assert whole.part is None and whole.to_bytes() == reference["single"]
    other = model.session(ctx=CTX, prefill_chunk=CHUNK, placement=Placement.over_ranks())
    other.scatter(whole)
    assert other.tokens == PROMPT and np.array_equal(other.logits, sess.logits)
    with pytest.raises(ValueError, match="holds one part of a split state"):
        other.scatter(cp)


class RecordingRanks(Ranks):
    """A rank of a fake group whose sends and receives are recorded instead of made."""

    def __init__(self, rank: int, size: int):
        super().__init__(FakeGroup(rank, size))
        self.calls = []

    def _send(self, x, dst, what):
        self.calls.append(("send", dst))

    def _recv(self, shape, dtype, src, what):
        self.calls.append(("recv", src))
        return f"from {src}"


def test_a_move_is_relayed_by_the_ranks_between_and_a_share_goes_round_the_ring():
    """What each of 4 ranks does to move an array from rank 0 to rank 2 (relayed by rank 1, the ring backend
    sending only to neighbours) and to share rank 2's array with every rank (2 → 3 → 0 → 1). A 4-rank run of the
    worker with the plan 0,2,2,1,3,0 (moves 0 → 2 and 1 → 3) matched one process bit for bit by hand; CI runs 2 and
    3 ranks, where every pair is neighbours."""
    moved, shared = {}, {}
    for rank in range(4):
        r = RecordingRanks(rank, 4)
        x, seconds = r.move("x" if rank == 0 else None, 0, 2, (1,), None, "test")
        moved[rank] = (r.calls, x)
        r.calls = []
        shared[rank] = (r.calls, r.share("y" if rank == 2 else None, 2, (1,), None, "test"))
    assert moved == {0: ([("send", 1)], None), 1: ([("recv", 0), ("send", 2)], None), 2: ([("recv", 1)], "from 1"),
                     3: ([], None)}
    assert shared == {2: ([("send", 3)], "y"), 3: ([("recv", 2), ("send", 0)], "from 2"),
                      0: ([("recv", 3), ("send", 1)], "from 3"), 1: ([("recv", 0)], "from 0")}
