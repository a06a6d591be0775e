"""The views given what a careless notebook cell gives them: another object than a session, a layer, head, chunk or
position the model or capture does not have, another model's checkpoints or KV view. Each is refused naming the
argument, before anything changes (a PrefillView that refused a layer had already moved its session onto the new
prompt), and a view never shows something other than what was asked (a head not captured showed another one)."""

import re

import numpy as np
import pytest

pytest.importorskip("anywidget")
import ds4lab  # noqa: E402
from ds4lab.kv.checkpoint import PayloadError  # noqa: E402
from ds4lab.viz import (  # noqa: E402
    AttentionView,
    ExpertView,
    GenerationView,
    KVCacheView,
    MaskView,
    PrefillView,
    TierView,
)

PROMPT = "ROMEO: But soft, what light through yonder window breaks? It is the east, and Juliet is the sun."


@pytest.fixture(scope="module")
def model():
    return ds4lab.load(backend="numpy")


@pytest.fixture
def sess(model):
    s = model.session(ctx=256, prefill_chunk=32)
    s.sync(PROMPT)
    return s


def _unchanged(sess):
    """A check that ``sess`` still holds what it held when this was called."""
    tokens, logits = list(sess.tokens), np.array(sess.logits)

    def check():
        assert list(sess.tokens) == tokens and np.array_equal(sess.logits, logits)
    return check


@pytest.mark.parametrize("view", [PrefillView, GenerationView, KVCacheView, TierView])
def test_a_model_given_for_a_session_is_named(model, view):
    args = (model, PROMPT) if view is PrefillView else (model,)
    with pytest.raises(TypeError, match=f"{view.__name__} takes a session \\(model.session\\(...\\)\\), not Model"):
        view(*args)


def test_prefill_view_checks_its_arguments_before_it_moves_the_session(model, sess):
    check = _unchanged(sess)
    with pytest.raises(ValueError, match=r"layer 99 is not a layer of this model \(0…5\)"):
        PrefillView(sess, "JULIET: another prompt altogether", layer=99)
    check()
    with pytest.raises(TypeError, match="layer must be a layer number, got 2.9"):
        PrefillView(sess, "JULIET: another prompt altogether", layer=2.9)
    check()
    other = model.session(ctx=256, prefill_chunk=32)
    with pytest.raises(ValueError, match="kv_view must be a KVCacheView of this session .* of another session"):
        PrefillView(sess, "JULIET: another prompt altogether", kv_view=KVCacheView(other))
    check()
    view = PrefillView(sess, "JULIET: another prompt altogether")
    view.step()
    layer = view.layer
    with pytest.raises(ValueError, match="layer 99 is not a layer"):
        view.show_layer(99)
    assert view.layer == layer == view.layer_pick.value
    with pytest.raises(TypeError, match="select takes a chunk's number, got '0'"):
        view.select("0")


@pytest.fixture(scope="module")
def heads_cap(model):
    s = model.session(ctx=256, prefill_chunk=64)
    with s.capture(["attn.scores"], layers=[2, 3], heads=[2, 3]) as cap:
        s.prefill(PROMPT).run(progress=False)
    return cap


def test_attention_view_shows_the_head_asked_for_or_refuses(heads_cap):
    """``head`` is the head's number everywhere (the constructor took it as an index into the captured heads:
    head=3 showed head 2, head=1 showed head 3, head=99 the first)."""
    amap = heads_cap.attention(2)
    assert AttentionView(heads_cap, layer=2).head == 2  # default: the first captured
    view = AttentionView(heads_cap, layer=2, head=3)
    assert view.head == 3 == view.head_select.value
    np.testing.assert_array_equal(view.weights(), amap.weights[:, 1, :])
    for head in (1, -1, 99):
        with pytest.raises(ValueError, match=rf"head {head} was not captured in layer 2 \(heads \[2, 3\]\)"):
            AttentionView(heads_cap, layer=2, head=head)
    for head in (2.0, "2", True):
        with pytest.raises(TypeError, match=rf"head must be a head's number, got {head!r}"):
            AttentionView(heads_cap, layer=2, head=head)
    for layer in (2.0, True):
        with pytest.raises(TypeError, match=rf"layer must be a layer number, got {layer!r}"):
            AttentionView(heads_cap, layer=layer)
    with pytest.raises(ValueError, match="head 1 was not captured"):
        view.show(2, 1)
    assert view.head == 3
    view.layer_select.value = 3  # a layer picked keeps the head shown
    assert (view.layer, view.head) == (3, 3)
    with pytest.raises(TypeError, match=r"zoom: queries is a pair of indices \(start, end\), got 5"):
        view.zoom(queries=5)
    with pytest.raises(TypeError, match=r"zoom: keys is a pair of indices \(start, end\), got \(True, 3\)"):
        view.zoom(keys=(True, 3))  # read as (1, 3) before


def test_kv_cache_view_refuses_layers_and_checkpoints_it_cannot_show(sess, model_paths):
    with pytest.raises(ValueError, match=r"layers\[1\] 99 is not a layer of this model"):
        KVCacheView(sess, layers=[0, 99])
    with pytest.raises(ValueError, match=r"layers\[0\] -1 is not a layer"):
        KVCacheView(sess, layers=-1)
    with pytest.raises(TypeError, match=r"layers\[0\] must be a layer number, got True"):
        KVCacheView(sess, layers=[True, 2])
    with pytest.raises(TypeError, match=r"layers\[1\] must be a layer number, got 2.5"):
        KVCacheView(sess, layers=[1, 2.5])
    with pytest.raises(TypeError, match=r"checkpoints\[0\] is a int"):
        KVCacheView(sess, checkpoints=[1, 2])
    other = ds4lab.load(model_paths["nano"], backend="numpy").session(ctx=256, prefill_chunk=32)
    other.sync([1, 2, 3, 4])
    with pytest.raises(PayloadError, match="KV checkpoint was written for another model configuration: n_vocab"):
        KVCacheView(sess, checkpoints=[other.checkpoint()])
    assert KVCacheView(sess, layers=[np.int64(1)]).model.layers == [1]
    # a checkpoint of this model that no session of this context can hold: refused at once, the view unchanged
    model = sess.model
    longer = model.session(ctx=512, prefill_chunk=32)
    longer.sync(model.tokenizer.encode(PROMPT * 4))
    view = KVCacheView(sess, checkpoints=sess.checkpoints)
    before = (view.checkpoints, view.slider.max)
    with pytest.raises(PayloadError, match="does not fit current context: ctx is 512"):
        view.scrub_through([*sess.checkpoints, longer.checkpoint()])
    assert (view.checkpoints, view.slider.max) == before


def test_mask_of_a_step_must_be_one_the_session_can_take(sess):
    with pytest.raises(ValueError, match=r"within the context of 256, got pos0=10000, n=4"):
        MaskView.of_step(sess, 2, 10000, 4)
    with pytest.raises(ValueError, match=r"within the context of 256, got pos0=0, n=1000000"):
        MaskView.of_step(sess, 2, 0, 10**6)  # (tried to allocate 233 GiB)
    with pytest.raises(TypeError, match="layer must be a layer number, got '2'"):
        MaskView.of_step(sess, "2", 0, 4)
    with pytest.raises(TypeError, match="layer must be a layer number, got 2.5"):
        MaskView.of_step(sess, 2.5, 0, 4)
    assert MaskView.of_step(sess, 2, 252, 4).mask.pos0 == 252  # the context's last positions
    mask = MaskView.of_step(sess, 2, 0, 4).mask
    for bad, message in (((720,), "size_px is (720,): expected two numbers of px (keys, queries)"),
                         (720, "size_px is 720: expected two numbers of px (keys, queries)"),
                         ((0, 300), "size_px[0] must be a whole number of px, at least 1, got 0"),
                         ((720.5, 300), "size_px[0] must be a whole number of px, at least 1, got 720.5"),
                         (("720", 300), "size_px[0] must be a whole number of px, at least 1, got '720'"),
                         ((720, True), "size_px[1] must be a whole number of px, at least 1, got True")):
        with pytest.raises(ValueError, match=re.escape(message)):
            MaskView(mask, size_px=bad)
    assert MaskView(mask, size_px=(400, 200)).model.size_px == [400, 200]


def test_generation_and_expert_views_refuse_counts_and_ids_out_of_range(sess):
    for bad in (-5, 0, 2.5, True):
        with pytest.raises(ValueError, match=f"max_tokens must be a whole number of tokens, 1 or more, got {bad!r}"):
            GenerationView(sess, max_tokens=bad)
    with sess.capture(["moe.experts"], layers=[0]) as cap:
        sess.prefill(PROMPT + " More.").run(progress=False)
    for tokens in ([-1] * 10, [10**9] * 10):
        with pytest.raises(ValueError, match=rf"token 0 is {tokens[0]}: token ids are integers in \[0, 2048\) .*; "
                                             "give the ids the capture ran on"):
            ExpertView(cap, tokens=tokens)
