"""The CPU kernel emulator itself: its barriers order a group's threads, a missing barrier shows up as a
wrong result, and threads that wait at different barriers stop the process with the kernel's name
(a GPU would hang or read garbage)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

import ds4lab
from ds4lab.mlx_kernels.cpu import compile_module, compiler, launch
from ds4lab.mlx_kernels.dialects import _SYNCS, SOURCES, KernelSpec
from ds4lab.testing import live_state_rows

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++20 compiler here for the CPU kernel emulator")

# Thread t of a group writes its x into group-shared memory and reads back what thread t - 1 wrote.
NEIGHBOUR = """GROUP_SHARED float buf[64];
uint t = THREAD_IN_GROUP, row = GROUP_ID_X * GROUP_THREADS;
buf[t] = x[row + t];
#if SYNC
GROUP_BARRIER();
#endif
y[row + t] = t > 0u ? buf[t - 1u] : -1.0f;
"""


def _spec(tmp_path, name, body, **defines):
    path = tmp_path / f"{name}.body"
    path.write_text(body)
    return KernelSpec(name, str(path), (("x", "float32"),), (("y", "float32"),), defines)


@pytest.mark.parametrize("sync", [1, 0])
def test_a_barrier_orders_the_groups_threads_and_its_absence_shows(tmp_path, sync):
    spec = _spec(tmp_path, f"neighbour_{sync}", NEIGHBOUR, SYNC=sync)
    groups, threads = 2, 64
    x = np.arange(1, groups * threads + 1, dtype=np.float32)
    y = np.zeros_like(x)
    launch(compile_module([spec]), spec, (groups, 1), threads, [x, y])
    want = np.where(np.arange(x.size) % threads == 0, -1.0, np.roll(x, 1)).astype(np.float32)
    if sync:
        np.testing.assert_array_equal(y, want)
    else:  # the second group runs its threads last to first: each reads its neighbour's slot before it is written
        np.testing.assert_array_equal(y[:threads], want[:threads])
        assert np.count_nonzero(y[threads:] != want[threads:]) == threads - 1


def test_threads_waiting_at_different_barriers_stop_with_the_kernels_name(tmp_path):
    body = "if (THREAD_IN_GROUP == 0u) GROUP_BARRIER();\ny[THREAD_IN_GROUP] = 1.0f;\n"
    spec = _spec(tmp_path, "divergent", body)
    compile_module([spec])
    script = (
        "import numpy as np\n"
        "from ds4lab.mlx_kernels.cpu import compile_module, launch\n"
        "from ds4lab.mlx_kernels.dialects import KernelSpec\n"
        f"spec = KernelSpec('divergent', {spec.body!r}, (('x', 'float32'),), (('y', 'float32'),))\n"
        "launch(compile_module([spec]), spec, (1, 1), 64, [np.zeros(64, np.float32), np.zeros(64, np.float32)])\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0
    assert "kernel divergent: the group's threads wait at different barriers" in run.stderr


def test_a_launch_past_a_kernels_launch_bounds_is_refused_as_cuda_would(tmp_path):
    """A spec's launch_bounds reach the CUDA module as __launch_bounds__, and the emulator refuses a group wider than
    them (CUDA fails such a launch), so a launcher that outgrows them fails in the CPU suite first."""
    from ds4lab.mlx_kernels import specs as S
    from ds4lab.mlx_kernels.dialects import cuda_module_source

    spec = _spec(tmp_path, "bounded", "y[THREAD_IN_GROUP] = x[THREAD_IN_GROUP];\n")
    spec = KernelSpec(spec.name, spec.body, spec.inputs, spec.outputs, launch_bounds=(32, 4))
    assert "__launch_bounds__(32, 4) bounded(" in cuda_module_source([spec])
    lib = compile_module([spec])
    x = np.arange(64, dtype=np.float32)
    y = np.zeros(64, np.float32)
    launch(lib, spec, (1, 1), 32, [x, y])
    assert np.array_equal(y[:32], x[:32])
    with pytest.raises(ValueError, match="bounded: 64 threads a group, past its launch bounds' 32"):
        launch(lib, spec, (1, 1), 64, [x, y])
    assert S.INDEXER_SCORES.launch_bounds == (S.INDEXER_GROUP, S.INDEXER_GROUPS_PER_SM)


def test_every_shared_helper_that_waits_is_known_to_the_launcher():
    """A kernel runs without fibers unless its body names one of ``_SYNCS``: a helper in common.h that
    waits (directly or through another helper) must be in that list."""
    chunks = re.split(r"^(?=DEVICE_FN )", (SOURCES / "common.h").read_text(), flags=re.M)  # one helper each
    helpers = dict(re.match(r"DEVICE_FN\s+\w+\s+(\w+)\((.*)", c, flags=re.S).groups() for c in chunks[1:])
    assert "lane_line_sum" in helpers and "dq_q8_0" in helpers
    waiting = {name for name, body in helpers.items() if any(s in body for s in _SYNCS)}
    assert waiting <= set(_SYNCS), f"helpers that wait but are missing from _SYNCS: {waiting - set(_SYNCS)}"


def test_a_checked_branch_refuses_what_a_side_stream_could_not_do():
    """The emulator's branch runs in order but refuses a launch that reads a branch's output before its join, or
    that reads, inside the branch, an output made on the main stream after the fork."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.ops import Ops

    backend = EmulatedBackend()
    ops, k = Ops(backend), backend.kernels
    x = k.rmsnorm(np.ones((1, 64), np.float32), 1e-6)  # made before the fork
    side = ops.branch(1, True)
    with side:
        y = k.rmsnorm(x, 1e-6)
    with pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(y[:, 1:], 1e-6)  # a view of the branch's output, on the main stream
    z = k.rmsnorm(x, 1e-6)
    with side, pytest.raises(RuntimeError, match="after the branch's fork"):
        k.rmsnorm(z, 1e-6)
    with side:
        k.rmsnorm(y, 1e-6)  # its own outputs: in order on its stream
    side.join()
    np.testing.assert_array_equal(k.rmsnorm(y, 1e-6), k.rmsnorm(z, 1e-6))
    with side:
        w = k.rmsnorm(x, 1e-6)  # launched after the join
    with pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(w, 1e-6)
    side.join()
    k.rmsnorm(w, 1e-6)
    assert ops.branch(1, False).__class__.__name__ == "InOrder"  # an observer: everything in order


def test_a_branch_forked_from_a_branch_reaches_the_main_stream_through_it():
    """A branch made inside another forks from that one's stream: it may read what its parent made before the fork
    (not what the main stream made after the parent's fork), and the main stream may read its outputs once it has
    joined its parent and the parent has joined after it."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.ops import Ops

    backend = EmulatedBackend()
    ops, k = Ops(backend), backend.kernels
    x = k.rmsnorm(np.ones((1, 64), np.float32), 1e-6)
    outer = ops.branch(1, True)
    late = k.rmsnorm(x, 1e-6)  # main, after the outer fork
    with outer:
        y = k.rmsnorm(x, 1e-6)
        inner = ops.branch(1, True)
    with inner:
        z = k.rmsnorm(y, 1e-6)  # the parent's output, made before the inner fork
        with pytest.raises(RuntimeError, match="after the branch's fork"):
            k.rmsnorm(late, 1e-6)
    outer.join()
    inner.join()  # after its parent joined the main stream: the main stream does not wait for it
    with pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(z, 1e-6)
    outer.join()  # the parent joins again, after the inner branch
    np.testing.assert_array_equal(k.rmsnorm(z, 1e-6), k.rmsnorm(k.rmsnorm(y, 1e-6), 1e-6))
    first = ops.branch(1, True)
    with first:
        made = k.rmsnorm(x, 1e-6)
    second = ops.branch(1, True)  # forked before the first joins: it does not wait for it
    first.join()
    with second, pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(made, 1e-6)
    second.join()


def test_a_branch_ordered_after_another_reads_what_that_one_made_before():
    """``a.after(b)``: a's later launches may read b's outputs made so far (a side stream waiting on the other's
    event), not those b makes after it, and the main stream still reads them only after b's join."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.ops import Ops

    backend = EmulatedBackend()
    ops, k = Ops(backend), backend.kernels
    x = k.rmsnorm(np.ones((1, 64), np.float32), 1e-6)
    a, b = ops.branch(1, True), ops.branch(1, True)
    with b:
        y = k.rmsnorm(x, 1e-6)
    with a, pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(y, 1e-6)
    a.after(b)
    with b:
        late = k.rmsnorm(y, 1e-6)
    with a:
        z = k.rmsnorm(y, 1e-6)
        with pytest.raises(RuntimeError, match="before its join"):
            k.rmsnorm(late, 1e-6)
    with pytest.raises(RuntimeError, match="before its join"):
        k.rmsnorm(y, 1e-6)  # the main stream waits for neither
    a.join()
    b.join()
    np.testing.assert_array_equal(k.rmsnorm(z, 1e-6), k.rmsnorm(late, 1e-6))


def test_a_decode_step_branches_on_the_emulator(model_paths, monkeypatch):
    """A decode step of a compressed, indexed model opens the model's branches on the emulator (and its launches pass
    the checks above): the hyper-connection mixer's matrix in each half, the raw ring's, the compressors' and the
    indexer's compressor's in attention layers, the indexer's queries' where it selects rows, the shared expert and
    the routed up projection in each FFN half."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from tests.conftest import emulated_model

    model = emulated_model(model_paths["nano"])
    made = []
    real = EmulatedBackend.branch
    monkeypatch.setattr(EmulatedBackend, "branch", lambda self: made.append(real(self)) or made[-1])
    sess = model.session(ctx=64, prefill_chunk=32)
    sess.prefill(list(range(1, 20))).run(progress=False)
    assert made == []  # a chunk of more than 16 rows runs in order
    list(sess.decoder(temperature=0.0).stream(1))
    cfg = model.config
    indexed = [il for il in range(cfg.n_layer) if cfg.has_indexer(il)]
    assert indexed and all(sess._state.layers[il].index.shape[0] > cfg.idx_topk for il in indexed)  # they select
    assert len(made) == 7 * cfg.n_layer + len(indexed) and all(b.joined for b in made)


class _CarriedStep:
    """What a CUDA graph with ``carry`` does (:mod:`ds4lab.cuda.graphs`), on the emulator: the carried inputs are copied
    into arrays only the step holds, which the ops may write in place while it runs (``donated``), and the caller gets
    copies of the outputs, of the carried ones only the ``live`` rows (the rest NaN here, where a graph's outputs hold
    whatever their memory held). Given ``written``, a carried output is the caller's copy of two calls back (of the
    family, ``made``), as a graph's recycled buffer is, with only the rows packing.stale_rows names copied into it:
    a row a step changes outside ``written`` would reach the next step as it was. ``written_in_place`` counts the
    carried outputs that came back in their input's memory, ``recycled`` those made from an older copy."""

    def __init__(self, backend, fn, carry, made):
        self.backend, self.fn, self.carry, self.made = backend, fn, carry, made
        self.written_in_place = self.recycled = 0

    def __call__(self, *args, live=None, written=None):
        from ds4lab.backends.packing import stale_rows

        i, j = self.carry
        k = len(args) - i
        own = [np.array(a) for a in args[i:]]
        self.backend.own = {a.ctypes.data: a for a in own}
        try:
            out = self.fn(*args[:i], *own)
        finally:
            self.backend.own = {}
        self.written_in_place += sum(o.ctypes.data == a.ctypes.data for o, a in zip(out[j:], own))
        out = [np.array(o) for o in out]
        made = self.made  # (the carried outputs, live, written) of the family's last calls, each given the last's
        if made and not all(a is b for a, b in zip(args[i:], made[-1][0], strict=True)):
            made.clear()  # a state from elsewhere: no older copy holds its rows
        older = made[-2] if len(made) == 2 and None not in (live, written, made[-1][2]) else None
        for m, (o, ranges) in enumerate(zip(out[j:j + k], live or ())):
            stale = None if older is None else stale_rows(ranges, older[1][m], [made[-1][2][m], written[m]])
            if stale is not None:
                copy = older[0][m].copy()
                for a, b in stale:
                    copy[a:b] = o[a:b]
                o[...] = copy
                self.recycled += 1
            if ranges is not None:
                o[_outside(ranges, len(o))] = np.nan
        made.append((out[j:j + k], live, written))
        del made[:-2]
        return tuple(out)


def _outside(ranges, n: int) -> np.ndarray:
    """The rows of n outside the row ranges ``((start, stop), ...)`` (runtime.compiled.live_rows'), as a mask."""
    dead = np.ones(n, bool)
    for start, stop in ranges:
        dead[start:stop] = False
    return dead


def _carrying(model):
    """``model`` (on the emulator) with its decode steps compiled as :class:`_CarriedStep` calls."""
    from ds4lab.backends.emulated_backend import EmulatedBackend
    from ds4lab.runtime import Runtime

    class Carrying(EmulatedBackend):
        can_compile, compiled_rows, compiles_ffn, own, made = True, 16, True, {}, {}

        def compile(self, fn, carry=None, family=None):
            return _CarriedStep(self, fn, carry, [] if family is None else self.made.setdefault(id(family), []))

        def donated(self, x) -> bool:
            a = self.own.get(x.ctypes.data)
            return a is not None and a.shape == x.shape and a.dtype == x.dtype

    model.backend.__class__ = Carrying
    model.runtime = Runtime(model.transformer, model.backend)
    return model


@pytest.mark.parametrize("backend", ["numpy", "emulated"])
def test_a_decode_step_that_ends_no_window_leaves_the_pooling_out_and_changes_nothing(model_paths, monkeypatch,
                                                                                       backend):
    """Decode steps over positions 120…129 of nano (ratio-4 windows end at 123 and 127, a ratio-128 one at 127): the
    compressors pool only at the steps that end one of their windows, and the logits and every state array are
    those of steps that pool at every step (runtime.tables.ending made to name every ratio), bit for bit: on the
    float64 reference and on the emulated kernels."""
    from ds4lab.ops import Ops
    from ds4lab.runtime import tables
    from tests.conftest import emulated_model

    ids = np.random.default_rng(9).integers(0, 500, 130)
    pooled_at, real = [], Ops.compress_chunk
    monkeypatch.setattr(Ops, "compress_chunk", lambda self, *a: pooled_at.append(a[4]) or real(self, *a))
    runs = []
    for always in (False, True):
        if always:
            monkeypatch.setattr(tables, "ending", lambda ratios, pos0, n: tuple(sorted(set(ratios))))
        model = (ds4lab.load(model_paths["nano"], backend="numpy") if backend == "numpy"
                 else emulated_model(model_paths["nano"]))
        state = model.new_state(160, 64)
        for start in (0, 64):  # two chunks, the second of 56 real rows
            _, state = model.runtime.forward(ids[start:min(start + 64, 120)], state, prefill=True)
        pooled_at.clear()
        logits = []
        for t in ids[120:]:
            step_logits, state = model.runtime.forward_logits(np.array([t]), state)
            logits.append(np.asarray(step_logits))
        runs.append((logits, [np.asarray(a) for layer in state.layers for a in layer.arrays() if a is not None],
                     [int(p) for p in pooled_at]))
    (got, got_state, pooled), (want, want_state, pooled_always) = runs
    cfg = model.config
    compressors = {il: (1 + cfg.has_indexer(il)) * (cfg.ratio(il) != 0) for il in range(cfg.n_layer)}
    ends = {123: (4,), 127: (4, 128)}
    assert pooled == [p for p in range(120, 130) for il in range(cfg.n_layer) if cfg.ratio(il) in ends.get(p, ())
                      for _ in range(compressors[il])]
    assert len(pooled_always) == 10 * sum(compressors.values())
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(np.array_equal(g, w) for g, w in zip(got_state, want_state, strict=True))


def test_a_decode_step_that_carries_its_state_writes_it_in_place_and_changes_nothing(model_paths):
    """Decode steps compiled with ``carry`` on the emulator (the ring, the compressed rows and the compressors' pending
    states written in place by the in-place kernels, in the step's own copy of the state) give the eager steps' logits
    and states bit for bit, and the state a step was given is unchanged after it."""
    from tests.conftest import emulated_model

    eager, carried = emulated_model(model_paths["nano"]), _carrying(emulated_model(model_paths["nano"]))
    ids = np.random.default_rng(5).integers(0, eager.config.n_vocab - 7, 26)
    states = []
    for model in (eager, carried):
        state = model.new_state(64, 32)
        _, state = model.runtime.forward(ids[:19], state, prefill=True)  # a chunk of more than 16 rows: eager
        got = []
        for t in ids[19:]:
            before = [np.array(a) for layer in state.layers for a in layer.arrays() if a is not None]
            logits, new = model.runtime.forward_logits(np.array([t]), state)
            after = [a for layer in state.layers for a in layer.arrays() if a is not None]
            assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(after, before))
            got.append(np.asarray(logits))
            state = new
        states.append((got, live_state_rows(state, model.config)))
    (want, want_state), (got, got_state) = states
    assert all(np.array_equal(g, w) for g, w in zip(got, want)) and len(got) == 7
    assert all(np.array_equal(g, w) for g, w in zip(got_state, want_state))
    # positions 19…25: the steps at 19 and 23 end a ratio-4 window, none a ratio-128 one: two compiled steps
    steps = {key[4]: g for key, g in carried.runtime.compiled.items() if key[:4] == ("step", 1, 1, True)}
    assert set(steps) == {(), (4,)}
    cfg = carried.config
    # a layer's ring, its compressed rows (ratio ≠ 0) and its indexer's rows (where it has an indexer): in place when
    # written, and in place when left as they were (a step that ends none of their windows); and each compressor's
    # pending state (kv and scores) in a step that ends none of its windows (compress_state_in_place)
    per_step = sum(1 + (cfg.ratio(il) != 0) + (cfg.ratio(il) != 0 and cfg.has_indexer(il)) for il in range(cfg.n_layer))
    pending = sum(2 * (1 + cfg.has_indexer(il)) for p in range(19, 26) for il in range(cfg.n_layer)
                  if cfg.ratio(il) != 0 and (p + 1) % cfg.ratio(il) != 0)
    assert pending > 0
    assert sum(g.written_in_place for g in steps.values()) == 7 * per_step + pending > 7 * cfg.n_layer
    # from the third step on, the caller's copy of each ring, compressed and indexer array was the copy of two steps
    # back with only the rows packing.stale_rows names copied into it
    assert sum(g.recycled for g in steps.values()) == 5 * per_step


def test_a_recycled_copy_of_the_state_takes_the_ring_slots_a_step_overwrote(model_paths, monkeypatch):
    """A ring of 33 slots for the window's 32 (DS4_METAL_GRAPH_RAW_CAP), so that every other decode step past position
    33 writes a slot that the copy of two steps back held live: decode steps compiled with ``carry`` on the emulator,
    the caller's copies made from those of two steps back with only the rows packing.stale_rows names (the live rows
    not live then, and runtime.compiled.written_rows' since), give the eager steps' logits and live state bit for bit
    over 48 positions."""
    from tests.conftest import emulated_model

    monkeypatch.setenv("DS4_METAL_GRAPH_RAW_CAP", "33")
    eager, carried = emulated_model(model_paths["nano"]), _carrying(emulated_model(model_paths["nano"]))
    ids = np.random.default_rng(6).integers(0, eager.config.n_vocab - 7, 48)
    runs = []
    for model in (eager, carried):
        state = model.new_state(64, 32)
        assert (state.geometry.raw_cap, state.geometry.window, state.geometry.step) == (33, 32, 1)
        logits = []
        for t in ids:
            step_logits, state = model.runtime.forward_logits(np.array([t]), state)
            logits.append(np.asarray(step_logits))
        runs.append((logits, live_state_rows(state, model.config)))
    (want, want_state), (got, got_state) = runs
    assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(np.array_equal(g, w) for g, w in zip(got_state, want_state, strict=True))
    steps = [g for key, g in carried.runtime.compiled.items() if key[:4] == ("step", 1, 1, True)]
    assert sum(g.recycled for g in steps) >= 46 * carried.config.n_layer  # every ring from the third step on


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, min_p=0.05, seed=3)],
                         ids=["greedy", "ds4-default-rule"])
def test_a_decode_launches_its_next_step_ahead_and_gives_the_same_steps(model_paths, monkeypatch, sampling):
    """Greedy decoding and ds4's default sampling rule, on a backend that runs beside the host, launch each next step
    ahead on the token chosen on the device (here the emulator with carried steps, marked asynchronous): the steps,
    their log-probabilities and the logits are those of the plain decode; a step's last launches nothing ahead; a
    launch ahead that no longer follows the live state (a restore between steps, a capture begun) is dropped."""
    from ds4lab.session import Decode, Session
    from tests.conftest import emulated_model

    ahead, plain = _carrying(emulated_model(model_paths["nano"])), emulated_model(model_paths["nano"])
    ahead.backend.asynchronous = True
    made, launches = [], []
    real, launch = Decode._launch_ahead, Session._launch
    monkeypatch.setattr(Decode, "_launch_ahead", lambda self, launched: made.append(real(self, launched)) or made[-1])
    monkeypatch.setattr(Session, "_launch", lambda self, *a, **k: launches.append(self.model) or launch(self, *a, **k))
    ids = list(np.random.default_rng(6).integers(0, plain.config.n_vocab - 7, 19))
    runs = []
    for model in (ahead, plain):
        sess = model.session(ctx=64, prefill_chunk=32)
        sess.sync(ids)
        exclude = [int(np.argmax(sess.logits))]  # the first greedy choice, never taken
        decode = sess.decoder(top=2, exclude=exclude, **sampling)
        steps = [decode.step() for _ in range(3)]
        cp = sess.checkpoint()
        steps.append(decode.step())
        assert (sess._ahead is not None) == (model is ahead)  # held by the session, with its state's memory
        sess.restore(cp)  # the step launched ahead follows the state before the restore's: dropped with it
        assert sess._ahead is None
        steps.append(decode.step())
        with sess.capture(["blk.0.attn_norm"]) as cap:  # begun after a launch ahead: the step runs observed
            steps.append(decode.step(more=False))
        assert cap["blk.0.attn_norm"].shape[0] == 1
        runs.append(([(s.token, s.logprob, s.top) for s in steps], sess.logits, exclude[0]))
    (got, got_logits, excluded), (want, want_logits, _) = runs
    assert got == want and np.array_equal(got_logits, want_logits) and excluded not in [s[0] for s in got]
    if sampling["temperature"] == 0:
        assert got[4] == got[3]  # greedy after the restore: the same token, evaluated anew
    # a launch ahead after each of the first five steps (none after the last) here, none on the plain backend
    assert len(made) == 2 * 5 and sum(m is not None for m in made) == 5
    # the first step, five ahead, the steps after the restore and in the capture launched anew: 8 launches, 6 steps
    assert launches.count(ahead) == 1 + 8 and launches.count(plain) == 1 + 6  # + the prompt's prefill


def _poison_what_no_step_reads(state, cfg) -> int:
    """NaN into every row of ``state`` (a CPU state, written in place) outside runtime.compiled.live_rows: the raw
    ring's slots outside the window, the compressed and indexer rows from the count on; returns the rows poisoned."""
    from ds4lab.runtime.compiled import live_rows, present

    arrays = [a for layer in state.layers for a in present(layer)]
    ranges = live_rows(cfg, state.geometry, state.n_past)
    assert len(ranges) == len(arrays)
    poisoned = 0
    for a, live in zip(arrays, ranges):
        if live is None:
            continue
        dead = _outside(live, len(a))
        a[dead] = np.nan
        poisoned += int(dead.sum())
    return poisoned


@pytest.mark.parametrize("attn_chunk", [True, False], ids=["attend_chunk", "reference-attend"])
def test_the_kernels_never_read_ring_slots_past_the_window_nor_rows_past_the_count(model_paths, monkeypatch,
                                                                                   attn_chunk):
    """What a step's kernels read of the state: runtime.compiled.live_rows' rows (the raw ring's slots of the window,
    the compressed and indexer rows below the count, the pending states), nothing more. With every other row set to
    NaN before each chunk and each decode step (chunks of 32 and decode past the ring's wrap: a ring of 100 slots
    and a window of 32), the logits of every step are those of the untouched run, bit for bit (what lets a GPU copy
    of a state leave those rows out). Also with a chunk's attention through the reference (ops.ATTN_CHUNK_KERNEL
    off), which reads the keys no query sees as zeros."""
    from ds4lab import ops
    from tests.conftest import emulated_model

    monkeypatch.setattr(ops, "ATTN_CHUNK_KERNEL", attn_chunk)
    # a ring of 100 slots (ds4's DS4_METAL_GRAPH_RAW_CAP): wrapped in the fourth chunk, whose window (positions
    # 96-127 before the fifth) straddles its end; with 256 slots and chunks of 32 no window did, in 288 tokens
    monkeypatch.setenv("DS4_METAL_GRAPH_RAW_CAP", "100")
    runs = []
    for poison in (False, True):
        model = emulated_model(model_paths["nano"])
        sess = model.session(ctx=200, prefill_chunk=32)
        assert sess.geometry.raw_cap == 100 and sess.geometry.window == 32
        logits, poisoned = [], 0
        prefill = sess.prefill(np.random.default_rng(11).integers(0, 1000, 160).tolist())
        while prefill.remaining > 0:  # five chunks of 32: 40 compressed rows on the ratio-4 layers, top-k 16
            if poison and sess.tokens:
                poisoned += _poison_what_no_step_reads(sess._state, model.config)
            prefill.step()
            logits.append(sess.logits.copy())
        decode = sess.decoder(temperature=0.0)
        for _ in range(12):  # positions 160-171: the ring wrapped; ratio-4 windows end on the way
            if poison:
                poisoned += _poison_what_no_step_reads(sess._state, model.config)
            decode.step(more=False)
            logits.append(sess.logits.copy())
        runs.append((logits, poisoned))
    (plain, _), (poisoned_logits, poisoned) = runs
    assert poisoned > 0 and len(plain) == 5 + 12
    assert all(np.array_equal(a, b) for a, b in zip(plain, poisoned_logits))
