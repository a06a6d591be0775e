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


def test_compare_summary_gives_this_trees_step_over_each_others_pass_by_pass(tmp_path):
    """compare_summary.py on the flash_<tree>[_pass<k>].json files of a compare run: "this" first in each pass, the
    others by name, "this"'s replay-to-replay time over theirs (none for a run without a timeline), and each
    frontier's decode / prefill tokens/s; a folder without such files is an error that says what to run."""
    summary = _script("compare_summary")

    def write(name, step, rows, timeline=True):
        data = {"layers": 30, "rows": [{"ctx": c, "gen_tps": g, "prefill_tps": p} for c, g, p in rows]}
        if timeline:
            data["timeline_ms"] = {"replay_to_replay": step, "graph": step - 0.1, "copy_out": 0.05}
        (tmp_path / f"flash_{name}.json").write_text(json.dumps(data))

    write("this", 5.5, [(2048, 100.0, 1300.0), (4096, 180.0, 1450.0)])
    write("main", 5.0, [(4096, 200.0, 1500.0)])
    write("this_pass2", 6.0, [(4096, 170.0, 1400.0)])
    write("main_pass2", 4.8, [(4096, 205.0, 1510.0)])
    write("old", 0, [(4096, 150.0, 1000.0)], timeline=False)
    lines = summary.table(tmp_path).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    assert [(c[0], c[1]) for c in cells] == [("this", "1"), ("main", "1"), ("old", "1"), ("this", "2"),
                                             ("main", "2")]
    assert [c[4] for c in cells] == ["", "1.100", "", "", "1.250"]
    assert cells[0][7:] == ["100.0 / 1,300", "180.0 / 1,450"] and cells[1][7:] == ["", "200.0 / 1,500"]
    assert cells[2][3] == "" and cells[3][3] == "6.000"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no flash_"):
        summary.table(empty)


def test_decode_steps_times_every_step_of_each_frontier(tmp_path, capsys):
    """decode_steps.py on the nano layout (numpy): a line per frontier, as many step times as asked, the slowest
    steps named by their positions after the frontier."""
    decode_steps = _script("decode_steps")
    path = tmp_path / "nano.gguf"
    assert decode_steps.main(["--config", "nano", "--path", str(path), "--frontier", "48", "64", "--steps", "8"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["frontier"] for r in rows] == [48, 64] and path.exists()
    for r in rows:
        assert len(r["slowest"]) == 8 and all(r["frontier"] <= pos < r["frontier"] + 8 for pos, _ in r["slowest"])
        assert len(r["by_16"]) == 1 and r["percentiles_ms"][0] <= r["percentiles_ms"][3]


@pytest.mark.parametrize("script", sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                                          if "__main__" in p.read_text()))  # the scripts, not their modules
def test_every_script_reads_its_help_without_a_gpu(script):
    """``python benchmarks/X.py --help`` on a machine without CuPy (the README and benchmarks/README.md name their
    flags): four CuPy-only scripts imported CuPy first and ended in a traceback."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "usage:" in done.stdout, done.stderr[-500:]
