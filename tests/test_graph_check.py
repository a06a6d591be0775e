"""The graph tests (``ds4lab run --graph-test`` and its family, :mod:`ds4lab.graph_check`): on this CPU the kernels
are the CUDA kernels' bodies compiled for the CPU (the emulator), compared with the same backend's plain ops; a
kernel made wrong on purpose must fail at its own stage; the command line's refusals name what is missing."""

import numpy as np
import pytest

from ds4lab import graph_check as G
from ds4lab.cli import main
from tests.conftest import CONFIGS, emulated_model

PROMPT = "First Citizen:\nBefore we proceed any further, hear me speak."


@pytest.fixture(scope="module")
def pair(model_paths):
    path = model_paths["nano"]
    return emulated_model(path, kernels=True), emulated_model(path, kernels=False)


def test_decode_test_compares_every_point_of_layer_0_and_passes(pair):
    fast, plain = pair
    report = G.decode_test(fast, plain, token=5)
    names = [s.stage for s in report.stages]
    for point in ("attn_norm", "attn.q", "attn.kv_in", "attn.out", "ffn_norm", "moe.router", "moe.experts", "moe.out"):
        assert f"blk.0.{point}" in names
    assert all(n.startswith("blk.0.") for n in names[:-2]) and names[-2:] == [
        "logits (eager, hooks on)", "logits (as it runs)"]
    assert report.passed, str(report)
    # the two paths really ran apart: float32 sums in other orders differ in their last bits somewhere
    assert max(s.max_abs for s in report.stages) > 0
    assert str(report).splitlines()[-1] == "graph-test: PASS"


def test_full_test_has_a_line_per_layer(pair):
    fast, plain = pair
    report = G.full_test(fast, plain, token=5)
    assert [s.stage.split(" (")[0] for s in report.stages[:-2]] == [f"layer {il:>2}" for il in
                                                                   range(CONFIGS["nano"][0].n_layer)]
    assert report.passed, str(report)


def test_prompt_test_compares_chunks_kv_and_a_decode_step(pair):
    fast, plain = pair
    ids = fast.tokenizer.encode(PROMPT)[:10]
    report = G.prompt_test(fast, plain, ids, ctx=16, prefill_chunk=4)
    names = [s.stage for s in report.stages]
    assert names[:3] == ["chunk [0, 4) logits", "chunk [4, 8) logits", "chunk [8, 10) logits"]
    assert sum(n.startswith("layer") and " KV " in n for n in names) == fast.config.n_layer
    assert names[-2:] == ["greedy token", "decode step logits"]
    assert report.passed, str(report)
    assert "in chunks of 4, ctx 16" in report.setup


def _break_rmsnorm(monkeypatch, model):
    """``model``'s rmsnorm off by 1% (an instance attribute: the plain model's ops are another object)."""
    right = model.transformer.ops.rmsnorm
    monkeypatch.setattr(model.transformer.ops, "rmsnorm", lambda x, eps, weight=None: right(x, eps, weight) * 1.01)


def test_a_wrong_kernel_fails_at_its_stage(pair, monkeypatch):
    fast, plain = pair
    _break_rmsnorm(monkeypatch, fast)
    report = G.decode_test(fast, plain, token=5)
    monkeypatch.undo()
    failed = {s.stage for s in report.failed}
    # attn_norm comes out of hc_pre's launch; q's low-rank input is the first rmsnorm of its own
    assert "blk.0.attn.q_lora" in failed and "blk.0.attn_norm" not in failed and not report.passed
    q_lora = next(s for s in report.stages if s.stage == "blk.0.attn.q_lora")
    assert q_lora.rel == pytest.approx(0.01, rel=1e-3)
    assert "FAIL" in str(report).splitlines()[-1]
    assert "--numerics exact" in str(report)  # the hint that tells rounding flips from a wrong kernel
    assert G.decode_test(fast, plain, token=5).passed  # and the right kernel is back


def test_compare_rules():
    assert G.compare("x", [1.0, -np.inf], [1.0, -np.inf], 1e-3).max_abs == 0  # equal infinities are equal
    one_sided = G.compare("x", [np.nan, 1.0], [0.5, 1.0], 1e-3)
    assert one_sided.max_abs == np.inf and not one_sided.ok
    assert G.compare("x", [2.0, 1.0005], [2.0, 1.0], 1e-3).ok  # 5e-4 of the largest value 2
    assert not G.compare("x", [2.0, 1.003], [2.0, 1.0], 1e-3).ok
    assert not G.compare("experts", [3, 1], [1, 3], 0).ok and G.compare("experts", [1, 3], [1, 3], 0).ok
    flips = G.compare("raw", np.r_[np.ones(199), 1.1], np.ones(200), 1e-3, share=0.02)  # 1 of 200: 0.5%
    assert flips.over == 1 and flips.ok and "1/200 values over tol" in flips.line()
    assert not G.compare("raw", np.r_[np.ones(195), [1.1] * 5], np.ones(200), 1e-3, share=0.02).ok  # 2.5%
    assert not G.compare("raw", np.r_[np.ones(199), 1.5], np.ones(200), 1e-3).ok  # exact numerics: no flips
    assert not G.compare("q", np.r_[np.ones(199), np.nan], np.ones(200), 1e-3, share=0.02).ok  # a NaN never flips
    assert not G.compare("q", np.r_[np.ones(199), 2.0], np.ones(200), 1e-3, share=0.02).ok  # a step of 1, not 1/8
    assert G.compare("index", np.r_[np.ones(199), 1.4], np.ones(200), 1e-3, share=0.02, bound=0.5).ok  # FP4's step
    assert G.compare("x", [0.0, 1.0], [0.0, 0.0], 1e-3).rel == np.inf  # a difference from an all-zero stage
    with pytest.raises(ValueError, match=r"x: the kernels' path gave shape \(2,\), the plain path \(3,\)"):
        G.compare("x", [1, 2], [1, 2, 3], 1e-3)


def test_the_pair_must_be_kernels_against_plain(pair, model_paths):
    fast, plain = pair
    with pytest.raises(ValueError, match="the plain path's model runs kernels"):
        G.decode_test(fast, fast, 5)
    with pytest.raises(ValueError, match="has no kernels here"):
        G.decode_test(plain, plain, 5)
    with pytest.raises(ValueError, match="the two models differ"):
        G.decode_test(fast, emulated_model(model_paths["mixed"], kernels=False), 5)


def test_the_command_runs_the_test_and_exits_by_its_verdict(pair, monkeypatch, capsys):
    fast, plain = pair
    from ds4lab.cli import run as run_cli

    loaded, asked = iter([fast, plain]), []

    def load(args):  # what each load was asked: (kernels off?, prefill_matmul)
        asked.append((args.no_kernels, args.prefill_matmul))
        return next(loaded)

    monkeypatch.setattr(run_cli, "load_model", load)
    assert main(["run", "--graph-test", "-p", PROMPT]) == 0
    out = capsys.readouterr()
    assert "graph-test: PASS" in out.out and "--graph-test on the prompt's first token" in out.err
    # the default ("auto": TF32 chunks on CuPy) checks the kernels in float32; the plain ops are float32 always
    assert asked == [(False, "float32"), (True, "float32")]
    loaded, asked[:] = iter([fast, plain]), []
    assert main(["run", "--graph-test", "--prefill-matmul", "tf32", "-p", PROMPT]) == 0
    assert asked == [(False, "tf32"), (True, "float32")]
    capsys.readouterr()

    _break_rmsnorm(monkeypatch, fast)
    loaded = iter([fast, plain])
    assert main(["run", "--graph-full-test", "-p", PROMPT]) == 1
    assert "graph-full-test: FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["run", "--graph-test"], "--graph-test needs a prompt (-p or --prompt-file)"),
    (["run", "--graph-prompt-test", "--no-kernels", "-p", "x"], "drop --no-kernels"),
    (["run", "--graph-full-test", "--backend", "numpy", "-p", "x"], "the numpy backend runs none here (no GPU)"),
])
def test_the_command_refuses_what_it_cannot_check(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_only_one_graph_test_at_a_time(capsys):
    with pytest.raises(SystemExit) as e:
        main(["run", "--graph-test", "--graph-full-test", "-p", "x"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
