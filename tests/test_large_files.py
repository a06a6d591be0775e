"""Files of the real Flash size: the full 43-layer layout (81 GiB) written sparse, its big tensors holes.

Every real Flash GGUF is over 80 GB, so offsets past 4 GiB (and 8 GiB) must stay exact from the moment they
are read: numpy 2 refuses to add them to a uint32 (the gguf reader's alignment type), which once made every
real file unopenable. The values past the marks are checked against gguf's own reader and against the bytes
the writer was given.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFReader

from ds4lab import config, testing
from ds4lab.gguf_file import GGUFModelFile

GiB = 1 << 30
# Small tensors get seeded random bytes; everything else (experts, projections, embeddings) is a hole.
SMALL = ("norm.weight", "attn_sinks.weight", "_scale.weight", "_base.weight", "exp_probs_b.bias")


def small(name: str) -> bool:
    return name.endswith(SMALL)


def sparse_files_work(folder) -> bool:
    """Whether ``folder``'s file system keeps holes (else the layout would cost 81 GiB of disk)."""
    probe = folder / "probe"
    with probe.open("wb") as f:
        f.truncate(GiB)
    used = probe.stat().st_blocks * 512
    probe.unlink()
    return used < 1 << 20


@pytest.fixture(scope="module")
def flash_layout(tmp_path_factory):
    folder = tmp_path_factory.mktemp("flash")
    if not sparse_files_work(folder):
        pytest.skip(f"{folder}'s file system does not keep holes; the Flash layout would take 81 GiB of disk")
    path = testing.make_sparse_model(config.FLASH, folder / "flash.gguf", seed=1, filled=small, alignment=64)
    yield path
    path.unlink()


def test_the_flash_layout_is_sparse_and_past_8_gib(flash_layout):
    st = flash_layout.stat()
    assert st.st_size > 80 * GiB and st.st_blocks * 512 < 64 << 20
    f = GGUFModelFile.open(flash_layout)
    assert f.alignment == 64 and f.metadata["general.alignment"] == (64, "UINT32")
    assert len(f.tensors) == 1328  # ds4's Flash file: 43 layers, router biases in the 40 top-k layers
    starts = sorted(t.data.ctypes.data - f.tensors["token_embd.weight"].data.ctypes.data for t in f.tensors.values())
    assert starts[-1] > 8 * GiB and any(4 * GiB < s < 8 * GiB for s in starts)
    assert all(type(d) is int for t in f.tensors.values() for d in t.shape)


@pytest.fixture(scope="module")
def gguf_readers_tensors(flash_layout):
    """gguf's own reader (slow: about 10 s for the 129,280-token vocabulary) as an independent oracle."""
    return {t.name: t for t in GGUFReader(flash_layout).tensors}


@pytest.mark.parametrize("name, past", [("blk.2.attn_norm.weight", 4 * GiB), ("blk.42.ffn_norm.weight", 8 * GiB),
                                        ("blk.30.exp_probs_b.bias", 8 * GiB)])
def test_values_past_the_marks_match_gguf_and_the_writer(flash_layout, gguf_readers_tensors, name, past):
    f = GGUFModelFile.open(flash_layout)
    ours, theirs = f.tensors[name], gguf_readers_tensors[name]
    assert theirs.data_offset > past
    assert ours.data.ctypes.data - f.tensors["token_embd.weight"].data.ctypes.data > past - 4096
    written = next(raw for n, _, _, raw in testing.model_tensors(
        config.FLASH, 1, router_bias_layers=range(3, 43), filled=lambda n: n == name) if n == name)
    assert ours.data.tobytes() == theirs.data.tobytes() == written.tobytes()
    assert np.frombuffer(ours.data, "<f4").std() > 0.05  # real values, not the holes' zeros


def test_load_keeps_the_weights_mapped(flash_layout):
    """``load(backend="numpy")`` opens the 81 GiB file on a 24 GB machine: nothing dequantized up front, and
    a weight past the 8 GiB mark reads as written. Memory: the process's own (anonymous) resident memory where
    Linux reports it; pages of the mapped file count in the resident set as the page cache happens to map them
    around what is read (2.1-2.4 GB seen on a CI machine, 143 MB alone), and they are not copies of weights."""
    code = ("import pathlib, resource, sys, numpy as np, ds4lab\n"
            "m = ds4lab.load(sys.argv[1], backend='numpy')\n"
            "print(m.config.n_layer, m.config.n_vocab, m.config.n_expert)\n"
            "print(np.asarray(m.transformer.layers[42].ffn_norm).astype('<f4').tobytes().hex())\n"
            "status = pathlib.Path('/proc/self/status')\n"
            "anon = [ln.split()[1] for ln in status.read_text().splitlines() if ln.startswith('RssAnon:')]"
            " if status.exists() else []\n"
            "peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # bytes on macOS, KiB elsewhere\n"
            "print(int(anon[0]) // 1024 if anon else peak >> (20 if sys.platform == 'darwin' else 10))\n")
    run = subprocess.run([sys.executable, "-c", code, str(flash_layout)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    dims, values, rss_mb = run.stdout.split()[:3], run.stdout.split()[3], int(run.stdout.split()[4])
    assert dims == ["43", "129280", "256"]
    raw = GGUFModelFile.open(flash_layout).tensors["blk.42.ffn_norm.weight"].data.tobytes()
    assert bytes.fromhex(values) == raw
    assert rss_mb < 2048, f"loading took {rss_mb} MB of memory: weights were read, not mapped"


def test_inspect_reads_the_flash_layout(flash_layout):
    env = dict(os.environ, PYTHONIOENCODING="utf-8")
    run = subprocess.run([sys.executable, "-m", "ds4lab.cli", "inspect", str(flash_layout)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr
    head = run.stdout.splitlines()[0]
    assert f"{flash_layout.stat().st_size:,} bytes" in head and "1328 tensors" in head and "alignment 64" in head
    assert "43 layers" in run.stdout or "n_layer" in run.stdout


@pytest.mark.parametrize("name", ["q2-q4", "q4", "mxfp4", "pro-q2"])
def test_ds4s_other_flash_files_open(tmp_path, name):
    """ds4's other Flash files (testing.FLASH_EXPERT_LAYOUTS) and DeepSeek V4 Pro's q2 file (61 layers, 430 GB),
    which ds4 runs since 2026-07."""
    if not sparse_files_work(tmp_path):
        pytest.skip(f"{tmp_path}'s file system does not keep holes")
    import ds4lab

    cfg = config.PRO if name == "pro-q2" else config.FLASH
    expert_types = testing.FLASH_EXPERT_LAYOUTS[name.removeprefix("pro-")]
    path = testing.make_sparse_model(cfg, tmp_path / f"{name}.gguf", filled=small, expert_types=expert_types)
    try:
        model = ds4lab.load(path, backend="numpy")
        assert model.config == cfg and config.ds4_model_id(model.config) == (name == "pro-q2")
        types = testing._layer_expert_types(expert_types, cfg.n_layer)
        tensors = model.file.tensors
        for il in (0, 36, 37, cfg.n_layer - 1):
            assert (tensors[f"blk.{il}.ffn_gate_exps.weight"].qtype, tensors[f"blk.{il}.ffn_down_exps.weight"].qtype) \
                == types[il]
    finally:
        path.unlink()


def test_a_numpy_session_of_the_flash_layout_says_it_outgrows_memory(flash_layout, monkeypatch):
    """Run on the numpy backend, the Flash file's dense weights become float64 as steps use them: about 51 GiB
    (50.5 GiB of weights but the experts and the embedding, 0.5 GiB of expert cache). A helper's run on the 24 GB
    machine was killed for memory after 89 s without a word; the first session says so now."""
    import warnings

    import ds4lab
    import ds4lab.engine as engine

    monkeypatch.setattr(engine, "available_memory", lambda: 24_000_000_000)
    model = ds4lab.load(flash_layout, backend="numpy")
    with pytest.warns(UserWarning, match=r"flash\.gguf on the numpy backend keeps its weights as float64 once used: "
                                         r"about 51\.0 GiB, where this machine has 22\.4 GiB available"):
        model.session(ctx=64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.session(ctx=64)  # said once a model
