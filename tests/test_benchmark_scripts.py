"""The GPU benchmarks' own logic where a CPU can run it (their figures come from the GPU machines)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flash_full_splits_the_layers_over_tiers_and_reports_their_switches(tmp_path, monkeypatch):
    """flash_full.py --tiers 2 (here two tiers of one CPU, on the nano layout): the session is placed over two tiers,
    and each frontier reports its switches by mode with their share of the prefill's and the decode's time; without
    --tiers the one-device figures (a bare step's time) come instead."""
    flash_full = _script("flash_full")
    monkeypatch.setattr(flash_full, "copy_bandwidth", lambda backend: 1e9)  # a 2 GiB copy is not what is tested
    common = ["--config", "nano", "--backend", "numpy", "--path", str(tmp_path / "nano.gguf"), "--ctx-start", "64",
              "--ctx-max", "128", "--step-incr", "64", "--gen-tokens", "4", "--prefill-chunk", "32"]
    runs = {}
    for tiers in (2, 1):
        out = tmp_path / f"tiers{tiers}.json"
        assert flash_full.main([*common, "--tiers", str(tiers), "--json", str(out)]) == 0
        runs[tiers] = json.loads(out.read_text())
    split, one = runs[2], runs[1]
    assert split["tiers"] == 2 and "2 tiers" in split["placement"] and [r["ctx"] for r in split["rows"]] == [64, 128]
    for row in split["rows"]:
        assert row["switches"]["batch"] >= 1 and row["switches"]["decode"] >= 4, row  # a copying switch a step
        assert 0 <= row["prefill_switch_share"] < 1 and 0 <= row["decode_switch_share"] < 1, row
    assert "runtime" not in split["decode_step_ms"] and "graphs" not in split
    assert "placement" not in one and "switches" not in one["rows"][0] and one["decode_step_ms"]["runtime"] > 0
    for run in runs.values():  # process start to the model, to a 16-token prompt's first token, to the first row
        assert 0 < run["loaded_s"] < run["first_token_s"] < run["first_row_s"], run


def test_flash_full_writes_the_expert_layout_asked_for(tmp_path, monkeypatch):
    """--experts q2-q4 on the nano layout: the last six layers' pairs of ds4's q2-q4 file (all Q4_K), and the
    sweep runs on it."""
    from gguf import GGMLQuantizationType as Q

    from ds4lab.gguf_file import GGUFModelFile

    flash_full = _script("flash_full")
    monkeypatch.setattr(flash_full, "copy_bandwidth", lambda backend: 1e9)
    path, out = tmp_path / "nano-q2-q4.gguf", tmp_path / "out.json"
    assert flash_full.main(["--config", "nano", "--backend", "numpy", "--experts", "q2-q4", "--path", str(path),
                            "--ctx-start", "64", "--ctx-max", "64", "--gen-tokens", "2", "--json", str(out)]) == 0
    tensors = GGUFModelFile.open(path).tensors
    assert {tensors[f"blk.{il}.ffn_down_exps.weight"].qtype for il in range(6)} == {Q.Q4_K}
    assert json.loads(out.read_text())["experts"] == "q2-q4"


def test_flash_full_keeps_the_first_layers_asked_for(tmp_path, monkeypatch):
    """--layers 4 on the nano layout with ds4's q2-q4 experts: a 4-layer file of the layout's first four layers (their
    ratios and expert pairs), the sweep run on it and the count in the JSON; a count past the layout's is refused."""
    from ds4lab import config
    from ds4lab.gguf_file import load_model_file
    from ds4lab.testing import FLASH_EXPERT_LAYOUTS

    flash_full = _script("flash_full")
    monkeypatch.setattr(flash_full, "copy_bandwidth", lambda backend: 1e9)
    path, out = tmp_path / "nano4.gguf", tmp_path / "out.json"
    assert flash_full.main(["--config", "nano", "--backend", "numpy", "--experts", "q2-q4", "--layers", "4",
                            "--path", str(path), "--ctx-start", "64", "--ctx-max", "64", "--gen-tokens", "2",
                            "--json", str(out)]) == 0
    cfg, f = load_model_file(path)
    assert cfg.n_layer == 4 and cfg.compress_ratios[:4] == config.NANO.compress_ratios[:4]
    pairs = FLASH_EXPERT_LAYOUTS["q2-q4"][-6:][:4]
    assert [f.tensors[f"blk.{il}.ffn_down_exps.weight"].qtype.name for il in range(4)] == [d for _, d in pairs]
    assert json.loads(out.read_text())["layers"] == 4
    with pytest.raises(SystemExit):
        flash_full.main(["--config", "nano", "--layers", "7"])
