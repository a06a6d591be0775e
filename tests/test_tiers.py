"""Tier placement: results independent of the plan, the bytes each switch mode moves, memory accounting,
and the errors of plans that cannot run."""

import numpy as np
import pytest

import ds4lab
from ds4lab import Placement
from ds4lab.tiers import EMBED

PROMPT = np.random.default_rng(5).integers(0, 1000, 90).tolist()  # crosses the indexer at 67
CHUNK = 32
N_DECODE = 3
ALTERNATE = [0, 1] * 3


@pytest.fixture(scope="module", params=["numpy", "mlx"])
def model(request, model_paths):
    # MLX on its cpu device, as the "cpu" tiers of these plans: one device, so placements must not change
    # a bit (a GPU model's cpu tiers run other code; test_mlx_cpu_and_gpu_tiers covers that).
    return ds4lab.load(model_paths["nano"], backend=request.param, device="cpu" if request.param == "mlx" else None)


def run(model, placement, chunk=CHUNK, prompt=PROMPT, n_decode=N_DECODE):
    sess = model.session(ctx=128, prefill_chunk=chunk, placement=placement)
    chunks = sess.prefill(prompt).run(progress=False)
    decode = sess.decoder(seed=3)
    steps = [decode.step() for _ in range(n_decode)]
    return sess, chunks, steps


def state_arrays(sess):
    b = sess.model.backend
    return [b.to_numpy(a) for layer in sess._state.layers for a in layer.arrays() if a is not None]


def hidden_bytes(model, rows=1):
    cfg = model.config
    return rows * cfg.n_hc * cfg.n_embd * np.dtype(model.backend.np_dtype).itemsize


@pytest.fixture(scope="module")
def reference(model):
    return run(model, None)


PLACEMENTS = {
    "single": lambda: Placement.single(),
    "even2": lambda: Placement.even(2),
    "even3": lambda: Placement.even(3),
    "by_memory": lambda: Placement.by_memory([12 << 20, 8 << 20]),
    "alternate": lambda: Placement(layer_tiers=ALTERNATE),
    "alternate_one_device": lambda: Placement(layer_tiers=ALTERNATE, devices=["cpu", "cpu"]),
}


@pytest.mark.parametrize("name", PLACEMENTS)
def test_results_do_not_depend_on_the_placement(name, model, reference):
    ref, ref_chunks, ref_steps = reference
    sess, chunks, steps = run(model, PLACEMENTS[name]())
    assert [s.token for s in steps] == [s.token for s in ref_steps]
    assert np.array_equal(sess.logits, ref.logits)
    for got, want in zip(state_arrays(sess), state_arrays(ref), strict=True):
        assert np.array_equal(got, want)
    if name != "single":
        assert len(set(sess.placement.layer_tiers)) > 1


@pytest.mark.parametrize("chunk", [1, 7, 32, 64])
def test_batch_copies_the_chunk_once_per_boundary(chunk, model):
    sess, chunks, _ = run(model, Placement(layer_tiers=ALTERNATE), chunk=chunk, prompt=PROMPT[:70], n_decode=0)
    boundaries = sess.placement.boundaries
    assert boundaries == 5  # embed 0 | 0 1 0 1 0 1 | head 1: a copy before layers 1…5
    for c in chunks:
        copies = [s for s in c.tier_switches if s.mode == "batch"]
        assert [s.layer for s in copies] == [1, 2, 3, 4, 5]
        assert all(s.bytes == hidden_bytes(model, c.n_tokens) for s in copies)
        assert c.tier_bytes == boundaries * hidden_bytes(model, c.n_tokens)
    # Every chunk after the first starts with the switch from the head's tier back to the embedding's.
    starts = [s for c in chunks for s in c.tier_switches if s.mode == "no-copy"]
    assert [(s.layer, s.from_tier, s.to_tier, s.bytes) for s in starts] == [(EMBED, 1, 0, 0)] * (len(chunks) - 1)
    assert list(sess.tier_trace) == [s for c in chunks for s in c.tier_switches]
    assert [s.step for s in sess.tier_trace] == sorted(s.step for s in sess.tier_trace)


def test_decode_copies_one_token_per_boundary(model):
    sess, _, steps = run(model, Placement.even(3))
    for step in steps:
        copies = [s for s in step.tier_switches if s.mode == "decode"]
        assert [(s.layer, s.from_tier, s.to_tier) for s in copies] == [(2, 0, 1), (4, 1, 2)]
        assert step.tier_bytes == 2 * hidden_bytes(model)
        assert step.tier_seconds >= 0


def test_no_copy_moves_nothing(model):
    sess, chunks, steps = run(model, Placement(layer_tiers=ALTERNATE, devices=["cpu", "cpu"]))
    assert sess.placement.boundaries == 0
    assert sess.tier_trace and all(s.mode == "no-copy" and s.bytes == 0 for s in sess.tier_trace)
    assert all(c.tier_bytes == 0 for c in chunks) and all(s.tier_bytes == 0 for s in steps)


def test_single_tier_never_switches(model, reference):
    ref, chunks, steps = reference
    assert not ref.tier_trace and all(not c.tier_switches for c in chunks + steps)


def test_memory_accounting(model):
    sess = model.session(ctx=128, prefill_chunk=CHUNK, placement=Placement.even(2))
    p = sess.placement
    assert sum(m.weights for m in p.memory) == sum(t.nbytes for t in model.file.tensors.values())
    itemsize = np.dtype(model.backend.np_dtype).itemsize
    assert sum(m.kv for m in p.memory) == sum(a.size for a in state_arrays(sess)) * itemsize
    assert [m.activations for m in p.memory] == [hidden_bytes(model, CHUNK)] * 2
    rows = p.table()
    assert [r["layer"] for r in rows] == list(range(-1, model.config.n_layer + 1))
    assert [r["tier"] for r in rows] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert "logical:1" in repr(p) and "layers 3-5, head" in repr(p)


def test_by_memory_splits_in_proportion(model):
    sess = model.session(ctx=128, prefill_chunk=CHUNK, placement=Placement.by_memory([30 << 20, 10 << 20]))
    p = sess.placement
    assert list(p.unit_tiers) == sorted(p.unit_tiers) and p.embed_tier == 0 and p.head_tier == 1
    assert p.memory[0].total > 2 * p.memory[1].total


@pytest.mark.parametrize("placement, message", [
    (lambda: Placement(layer_tiers=[0, 1]), "has 2 entries; the model has 6 layers"),
    (lambda: Placement(layer_tiers=[0, 0, 1, 1, 2, 2], devices=["cpu", "cpu"]),
     "layer 4 is on tier 2, but the plan has tiers 0…1 (one a device: 2 devices given)"),
    (lambda: Placement(layer_tiers=[0, 0, 1, 1, 1, 1], budgets=[1e9]),
     "layer 2 is on tier 1, but the plan has tiers 0…0 (one a budget: 1 budget given)"),
    (lambda: Placement(layer_tiers=[0, 0, 0, -1, 0, 0]), "3] is -1: a tier is a whole number >= 0"),
    (lambda: Placement(layer_tiers=[0] * 6, budgets=[1_000_000]), "tier 0 (logical:0) needs"),
    (lambda: Placement.by_memory([1 << 20, 1 << 20]), "the budgets leave"),
    (lambda: Placement.by_memory([20 << 20, 1000]), "tier 1's budget of 1,000 bytes"),
    (lambda: Placement.even(7), "7 tiers for 6 layers"),
    (lambda: Placement.single("tpu"), "unknown device 'tpu'"),
])
def test_plans_that_cannot_run_say_why(placement, message, model):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model.session(ctx=128, prefill_chunk=CHUNK, placement=placement())


def test_budget_error_names_the_bytes(model):
    with pytest.raises(ValueError) as err:
        model.session(ctx=128, prefill_chunk=CHUNK, placement=Placement(
            layer_tiers=[0, 0, 0, 1, 1, 1], budgets=[100 << 20, 1 << 20]))
    assert "tier 1" in str(err.value) and "budget is 1,048,576 bytes" in str(err.value)


def test_constructor_errors():
    for n in (0, 2.5, True, "2"):  # 2.5 made 3 tiers, True 1, "2" a comparison error
        with pytest.raises(ValueError, match=f"n_tiers must be a whole number, at least 1, got {n!r}"):
            Placement.even(n)
    with pytest.raises(ValueError, match=r"layer_tiers\[2\] is 1.5: a tier is a whole number"):
        Placement([0, 0, 1.5, 1, 1, 1])  # was cut to 1
    with pytest.raises(TypeError, match="devices is a list of device names, one a tier, got the string 'cp'"):
        Placement.even(2, devices="cp")  # read as devices 'c' and 'p'
    for budgets in ([float("nan")], [-1, -1], []):
        with pytest.raises(ValueError, match="budgets must be positive byte counts"):
            Placement([0] * 6, budgets=budgets)
    with pytest.raises(TypeError, match="budgets is a list of byte counts"):
        Placement.by_memory(1 << 30)
    assert Placement.by_memory([1e9, 2e9]).budgets == (1_000_000_000, 2_000_000_000)
    with pytest.raises(ValueError, match="3 devices for 2 tiers"):
        Placement.even(2, devices=["cpu"] * 3)
    with pytest.raises(ValueError, match="budgets must be positive"):
        Placement.by_memory([0])
    with pytest.raises(RuntimeError, match="not resolved"):
        Placement.even(2).table()


def test_mlx_cpu_and_gpu_tiers(model_paths):
    mx = pytest.importorskip("mlx.core")
    if not mx.is_available(mx.gpu):
        pytest.skip("MLX has no GPU here")
    m = ds4lab.load(model_paths["nano"], backend="mlx", device="gpu")
    ref, _, _ = run(m, Placement.single("gpu"))

    def forced(placement):  # the GPU's tokens, each decoded as a step: a sampled token may flip on 1e-3
        sess = m.session(ctx=128, prefill_chunk=CHUNK, placement=placement)
        sess.prefill(PROMPT).run(progress=False)
        for end in range(len(PROMPT) + 1, len(ref.tokens) + 1):
            sess.sync(ref.tokens[:end])
        return sess

    # Two devices' code differs (GPU kernels, CPU plain ops) in summation order, and an FP8 row rounding
    # can flip on it: the H200 showed 4.4e-4 at most on logits of magnitude ~3.
    tol = 1e-3 * np.abs(ref.logits).max()
    sess = forced(Placement(layer_tiers=ALTERNATE, devices=["gpu", "cpu"]))
    assert sess.placement.boundaries == 5 and sess.tier_trace
    np.testing.assert_allclose(sess.logits, ref.logits, rtol=0, atol=tol)
    assert sess.logits.argmax() == ref.logits.argmax()
    # One tier on the device without kernels, decoded op by op: the CPU's results, those of a model loaded there.
    # (Against the GPU's they can differ past a near-tie: the H200 had 0.095 at the prompt's last token on logits of
    # magnitude 3.6; MLX on the CPU against NumPy 1.14 at the prompt's 72nd token, which layer 4 routes to another
    # expert, its FFN input 8e-4 apart after layer 3's attention.)
    cpu = forced(Placement.single("cpu"))
    m = ds4lab.load(model_paths["nano"], backend="mlx", device="cpu")  # last: MLX's default device is now the CPU
    np.testing.assert_allclose(cpu.logits, forced(None).logits, rtol=0, atol=1e-6 * np.abs(ref.logits).max())


def test_a_gpu_models_cpu_tier_decides_its_own_steps(monkeypatch, tmp_path):
    """Whether a decode step is one compiled call is decided on the device of the tier that runs it: an MLX GPU
    model placed whole on its "cpu" tier has no kernels there, so its steps run op by op (deciding on the GPU
    sent them to the whole step, whose embedding lookup on the device the cpu tier lacks), and it never runs a
    call traced on the GPU (compiled calls are kept per device). Simulated on the CPU: MLX's launches answered by
    the emulator outside a tier's scope, none inside it."""
    import contextlib

    from ds4lab import tiers
    from ds4lab.backends.mlx_backend import MLXBackend
    from ds4lab.config import NANO
    from ds4lab.testing import make_model
    from tests.conftest import emulated_model
    from tests.test_gpu_kernels import _mlx_emulated_kernels

    found, why = _mlx_emulated_kernels()
    if found is None:
        pytest.skip(why)
    model = emulated_model(make_model(NANO, tmp_path / "nano.gguf", seed=1), mlx_kernels=found[0])
    in_cpu_tier = []

    @contextlib.contextmanager
    def scope(self):
        in_cpu_tier.append(True)
        try:
            yield
        finally:
            in_cpu_tier.pop()

    def device(self=None):
        return "cpu" if in_cpu_tier else "gpu"

    def compile(fn, carry=None, family=None):  # a call runs on the device it was traced on, as MLX's traces must
        traced_on = device()

        def call(*args, live=None, written=None):
            assert device() == traced_on, f"a call traced on the {traced_on} ran on the {device()}"
            return fn(*args)
        return call

    monkeypatch.setattr(MLXBackend, "kernels", property(lambda self: None if in_cpu_tier else self._kernels))
    monkeypatch.setattr(MLXBackend, "device_key", device)
    monkeypatch.setattr(tiers.MLXDeviceTier, "scope", scope)
    monkeypatch.setattr(model.backend, "compile", compile)
    model.runtime.compile = True
    assert model.runtime.whole(1)  # on the "GPU"
    ids = list(range(41))
    for placement in (None, Placement.single("cpu")):  # the GPU's compiled calls first, then the cpu tier's
        sess = model.session(ctx=128, prefill_chunk=32, placement=placement)
        sess.sync(ids[:40])
        sess.sync(ids)  # a decode step
        assert np.isfinite(sess.logits).all()
    assert {key[-1] for key in model.runtime.compiled} == {"gpu", "cpu"}
    assert not any(key[0] == "step" and key[-1] == "cpu" for key in model.runtime.compiled)


def test_mlx_kernels_stay_off_a_cpu_tier():
    """A GPU model's "cpu" tier runs the plain ops: MLX's custom kernels exist only on GPUs (seen on the
    H200 as "[custom_kernel] Only supports the GPU"), and its weights are its own float copies."""
    mx = pytest.importorskip("mlx.core")
    from ds4lab.backends.mlx_backend import MLXBackend

    class GpuKernels:
        device = mx.gpu

    b = MLXBackend("cpu", kernels=False)
    b._kernels = GpuKernels()
    with mx.stream(mx.cpu):
        assert b.kernels is None and b.device_key() == str(mx.Device(mx.cpu))
    if mx.is_available(mx.gpu):
        with mx.stream(mx.gpu):
            assert b.kernels is b._kernels and b.device_key() == str(mx.Device(mx.gpu))


def test_a_model_keeps_its_device_when_the_default_moves(monkeypatch, tmp_path):
    """An MLX model runs its steps on the device it was loaded for after another model, loaded since for another
    device, moved MLX's default device (``ds4lab.load(..., device="cpu")`` sets it for the process; the H200 ran a
    GPU model's steps on the CPU then): its work runs in its backend's scope. Simulated on the CPU: the model's
    kernels (answered by the emulator) exist only inside its scope, as a GPU model's exist only on the GPU."""
    import contextlib

    from ds4lab.backends.mlx_backend import MLXBackend
    from ds4lab.config import NANO
    from ds4lab.testing import make_model
    from tests.conftest import emulated_model
    from tests.test_gpu_kernels import _mlx_emulated_kernels

    found, why = _mlx_emulated_kernels()
    if found is None:
        pytest.skip(why)
    model = emulated_model(make_model(NANO, tmp_path / "nano.gguf", seed=1), mlx_kernels=found[0])
    ids = list(range(41))

    def logits():
        sess = model.session(ctx=128, prefill_chunk=32)
        sess.sync(ids[:40])
        sess.sync(ids)  # a decode step
        return sess.logits

    want = logits()  # the kernels wherever the model asks for them
    inside, model_scope = [], MLXBackend.scope

    @contextlib.contextmanager
    def scope(self):
        inside.append(self)
        try:
            with model_scope(self):
                yield
        finally:
            inside.pop()

    monkeypatch.setattr(MLXBackend, "scope", scope)
    monkeypatch.setattr(MLXBackend, "kernels", property(lambda self: self._kernels if self in inside else None))
    np.testing.assert_array_equal(logits(), want)
