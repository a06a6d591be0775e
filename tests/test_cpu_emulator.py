"""The CPU kernel emulator itself: its barriers order a group's threads, a missing barrier shows up as a
wrong result, and threads that wait at different barriers stop the process with the kernel's name
(a GPU would hang or read garbage)."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest

from ds4lab.mlx_kernels.cpu import compile_module, compiler, launch
from ds4lab.mlx_kernels.dialects import _SYNCS, SOURCES, KernelSpec

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
    assert ops.branch(1, False).__class__.__name__ == "InOrder"  # an observer: everything in order


def test_a_decode_step_branches_on_the_emulator(model_paths, monkeypatch):
    """A decode step of a compressed, indexed model opens the model's branches on the emulator (and its launches pass
    the checks above): the KV side and the indexer's in attention layers, the shared expert and the routed up
    projection in each FFN half."""
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
    n_layer = model.config.n_layer
    assert len(made) == 4 * n_layer and all(b.joined for b in made)
