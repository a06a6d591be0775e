"""Tiers on real CUDA GPUs with CuPy: each tier's layers, weights and KV state on its own GPU, NCCL sends (peer
copies without NCCL) between them, and the same results as one GPU. Needs two GPUs (the NCCL link's own test
one); skips with the reason otherwise."""

import numpy as np
import pytest

import ds4lab
from ds4lab import Placement
from ds4lab.testing import live_state_rows

pytestmark = pytest.mark.gpu

PROMPT = np.random.default_rng(5).integers(0, 1000, 90).tolist()
ALTERNATE = [0, 1] * 3


def cupy_gpus():
    """CuPy and the number of CUDA GPUs it sees; skips where CuPy is unavailable."""
    try:
        import cupy as cp

        return cp, cp.cuda.runtime.getDeviceCount()
    except Exception as e:
        pytest.skip(f"CuPy is unavailable: {e}")


@pytest.fixture(scope="module")
def two_gpus():
    cp, n = cupy_gpus()
    if n < 2:
        pytest.skip(f"needs two CUDA GPUs, found {n}")
    return cp


@pytest.fixture(scope="module")
def nccl_gpu():
    cp, n = cupy_gpus()
    from ds4lab.cuda.nccl_link import nccl_available

    if n < 1 or not nccl_available():
        pytest.skip(f"needs a CUDA GPU and NCCL (found {n} GPUs; NCCL installed: {nccl_available()})")
    return cp


def test_nccl_link_moves_arrays_bit_for_bit(nccl_gpu):
    """On one GPU its communicator sends to itself: every bit arrives, into new memory, whatever the dtype and
    layout; a GPU outside the link is refused by name."""
    cp = nccl_gpu
    from ds4lab.cuda.nccl_link import NcclLink

    link = NcclLink([0])
    rng = np.random.default_rng(1)
    for x in (cp.asarray(rng.standard_normal((3, 4, 257)).astype(np.float32)),
              cp.asarray(rng.integers(-9, 9, (5, 7)).astype(np.int32)),
              cp.asarray(rng.standard_normal((64, 6)).astype(np.float32))[::2, 1:]):  # not contiguous
        y = link.move(x, 0)
        assert y.data.ptr != x.data.ptr and y.dtype == x.dtype and y.shape == x.shape
        assert np.array_equal(cp.asnumpy(y), cp.asnumpy(x))
    with pytest.raises(ValueError, match="GPUs \\[0\\]: cannot move an array from GPU 0 to GPU 3"):
        link.move(x, 3)
    from ds4lab.cuda.nccl_link import link_for

    assert link_for((0,)) is None  # tiers on one GPU switch without a link


def run(model, placement):
    sess = model.session(ctx=128, prefill_chunk=32, placement=placement)
    chunks = sess.prefill(PROMPT).run(progress=False)
    steps = [s for s in sess.decoder(seed=3).stream(3)]
    return sess, chunks, steps


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "plain"])
@pytest.mark.parametrize("plan", ["even", "alternate"])
def test_two_gpus_give_the_results_of_one(two_gpus, model_paths, kernels, plan):
    cp = two_gpus
    model = ds4lab.load(model_paths["nano"], backend="cupy", kernels=kernels)
    ref, _, ref_steps = run(model, Placement.single("cuda:0"))
    placement = (Placement.even(2, devices=["cuda:0", "cuda:1"]) if plan == "even"
                 else Placement(layer_tiers=ALTERNATE, devices=["cuda:0", "cuda:1"]))
    sess, chunks, steps = run(model, placement)
    from ds4lab.cuda.nccl_link import nccl_available

    assert all((t.link is not None) == nccl_available() for t in sess.placement.tiers)  # NCCL where installed
    assert [s.token for s in steps] == [s.token for s in ref_steps]
    # Same GPU model, same kernels and library calls: the same bits.
    assert np.array_equal(sess.logits, ref.logits)
    for il, layer in enumerate(sess._state.layers):
        tier = sess.placement.tier_of(il)
        assert all(a.device.id == int(sess.placement.tiers[tier].device.split(":")[1])
                   for a in layer.arrays() if a is not None)
    # the rows a later step reads (a compiled step's copy of the state leaves the others as its memory held them)
    cfg = model.config
    got, want = (live_state_rows(s._state, cfg, cp.asnumpy) for s in (sess, ref))
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    # batch switches: one copy of the chunk's hidden state per boundary per chunk; decode: one token's
    hidden = model.config.n_hc * model.config.n_embd * 4
    for c in chunks:
        assert c.tier_bytes == sess.placement.boundaries * c.n_tokens * hidden
    for s in steps:
        assert sum(x.bytes for x in s.tier_switches) == sess.placement.boundaries * hidden
