"""``wantrain run --lr-finder`` and ``--lr-finder-then-train`` end to end on the tiny Wan model and the demo data,
with the config example of docs/lr_finder.md."""

from __future__ import annotations

import json
import re
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_end_to_end import copy_examples
from wantrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "lr_finder.md"


def doc_example() -> str:
    block = re.search(r"<!-- lr-finder-example:start -->\s*```toml\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert block, "docs/lr_finder.md lost its config example"
    return block.group(1)


def test_docs_example_is_a_valid_lr_finder_table():
    from wantrain.app.config import RunConfig
    from wantrain.core.config import structure

    cfg = structure(RunConfig, tomllib.loads(doc_example()))
    assert cfg.lr_finder.enabled and cfg.lr_finder.noise == "probe"


def test_lr_finder_with_resume_is_refused_before_anything_is_written(tmp_path, capsys):
    config = copy_examples(tmp_path)
    code = main(["run", str(config), "--lr-finder", "--resume", "auto"])
    assert code == 2
    assert "cannot run with --resume" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The demo data with its cache filled once for the module (the runs below only read it)."""
    tmp = tmp_path_factory.mktemp("lr_finder")
    config = copy_examples(tmp)
    keep = {"clip_000", "clip_001", "clip_002", "clip_003", "image_000", "image_001"}
    for path in (tmp / "demo_data").iterdir():  # a few samples are plenty: the cache fill is the slow part
        if path.stem not in keep:
            path.unlink()
    example = doc_example().replace("steps = 100", "steps = 8").replace("burn_in = 10", "burn_in = 2")
    text = config.read_text(encoding="utf-8").replace("max_steps = 400", "max_steps = 4")
    text = text.replace("switch_every = 10", "switch_every = 2") + "\n" + example
    config.write_text(text + "\n[observers]\nprogress = false\nnorms = false\nmemory_probe = false\n",
                      encoding="utf-8")
    assert main(["cache", str(config)]) == 0
    return tmp


@pytest.mark.slow
def test_cli_lr_finder_with_the_seeds_flags_writes_chart_csv_and_no_lora_or_checkpoint(workspace, capsys):
    config = workspace / "quickstart.toml"
    code = main(["run", str(config), "--lr_finder", "--lr_finder_steps", "6", "--lr_finder_start", "1e-6",
                 "--lr_finder_end", "1", "--run-id", "seedflags"])
    out = capsys.readouterr().out
    assert code == 0
    (run_dir,) = [d for d in (workspace / "runs").iterdir() if d.name.endswith("__seedflags__lr_finder")]
    assert not list(run_dir.glob("*.safetensors")) and not (run_dir / "checkpoints").exists()
    assert (run_dir / "lr_finder.png").stat().st_size > 10_000
    rows = (run_dir / "lr_finder.csv").read_text().splitlines()
    assert len(rows) == 1 + 2 * 6  # header + one row per rung of each expert
    summary = json.loads((run_dir / "lr_finder.json").read_text())
    assert set(summary["experts"]) == {"high_noise", "low_noise"}
    assert summary["settings"]["start_lr"] == 1e-6 and summary["settings"]["end_lr"] == 1.0
    assert "lr_finder [high_noise]: suggested LR" in out and "lr_finder [low_noise]: suggested LR" in out
    assert "<- default" in out


@pytest.mark.slow
def test_then_train_continues_exactly_like_a_run_started_with_the_suggested_lr(workspace, capsys):
    config = workspace / "quickstart.toml"
    runs = workspace / "runs"
    code = main(["run", str(config), "--lr-finder-then-train", "--run-id", "continued"])
    assert code == 0
    (finder_dir,) = [d for d in runs.iterdir() if d.name.endswith("__continued__lr_finder")]
    (trained_dir,) = [d for d in runs.iterdir() if d.name.endswith("__continued")]
    assert not list(finder_dir.glob("*.safetensors"))
    finder = json.loads((finder_dir / "lr_finder.json").read_text())["experts"]
    resolved = tomllib.loads((trained_dir / "config.toml").read_text())
    printed = capsys.readouterr().out
    for expert in ("high_noise", "low_noise"):  # the suggestion, or the config's LR when a warning invalidates it
        if finder[expert]["invalid"]:
            assert resolved["model"].get(f"lr_{expert}") is None and resolved["optimizer"]["lr"] == 2e-3
            assert f"lr_finder [{expert}]: not training with the suggestion (" in printed
        else:
            assert resolved["model"][f"lr_{expert}"] == finder[expert]["suggested_lr"]
    assert resolved["lr_finder"]["enabled"] is False and resolved["lr_finder"]["then_train"] is False
    log = [json.loads(x) for x in (trained_dir / "log.jsonl").read_text().splitlines()]
    restored = [x for x in log if x["event"] == "lr_finder_state_restored"]
    assert restored and restored[0]["tensors_compared"] > 0

    # the same config, started directly with those LRs (what the trained run's config.toml says)
    shutil.copy(trained_dir / "config.toml", workspace / "direct.toml")
    assert main(["run", str(workspace / "direct.toml"), "--run-id", "direct"]) == 0
    (direct_dir,) = [d for d in runs.iterdir() if d.name.endswith("__direct")]
    for expert in ("high_noise", "low_noise"):
        a = load_file(trained_dir / f"quickstart_{expert}.safetensors")
        b = load_file(direct_dir / f"quickstart_{expert}.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), expert
    assert [json.loads(x)["train/loss"] for x in (trained_dir / "metrics.jsonl").read_text().splitlines()] == \
        [json.loads(x)["train/loss"] for x in (direct_dir / "metrics.jsonl").read_text().splitlines()]


def test_cli_flags_and_the_seeds_spellings_set_the_lr_finder_table():
    import argparse

    from wantrain.app.config import RunConfig, apply_overrides
    from wantrain.cli.run import add_arguments, lr_finder_overrides
    from wantrain.core.config import structure

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dashed = parser.parse_args(["c.toml", "--lr-finder", "--lr-finder-steps", "30", "--lr-finder-start", "1e-6",
                                "--lr-finder-end", "0.5", "--lr-finder-mode", "linear"])
    seed = parser.parse_args(["c.toml", "--lr_finder", "--lr_finder_steps", "30", "--lr_finder_start", "1e-6",
                              "--lr_finder_end", "0.5", "--lr-finder-mode", "linear"])
    assert lr_finder_overrides(dashed) == lr_finder_overrides(seed)
    cfg = structure(RunConfig, apply_overrides({}, lr_finder_overrides(seed)))
    f = cfg.lr_finder
    assert (f.enabled, f.then_train, f.steps, f.start_lr, f.end_lr, f.mode) == (True, False, 30, 1e-6, 0.5, "linear")
    then = parser.parse_args(["c.toml", "--lr-finder-then-train"])
    assert structure(RunConfig, apply_overrides({}, lr_finder_overrides(then))).lr_finder.active


@pytest.mark.parametrize(("table", "message"), [
    ({"start_lr": 1.0, "end_lr": 0.1}, "lr_finder.start_lr = 1 must be below lr_finder.end_lr = 0.1"),
    ({"steps": 20, "burn_in": 20}, "lr_finder.burn_in = 20 must be below lr_finder.steps = 20"),
    ({"smoothing": 1.0}, "lr_finder.smoothing = 1 must be below 1"),
    ({"noise": "fixd"}, "did you mean 'fixed'"),
])
def test_bad_lr_finder_settings_are_refused_in_one_line(table, message):
    from wantrain.app.config import RunConfig
    from wantrain.core.config import ConfigError, structure

    with pytest.raises(ConfigError, match=re.escape(message)):
        structure(RunConfig, {"lr_finder": table})


def test_lr_finder_with_an_optimizer_that_sets_its_own_step_size_is_refused(tmp_path, capsys):
    config = copy_examples(tmp_path)
    assert main(["run", str(config), "--lr-finder", "--set", 'optimizer.type="prodigy"',
                 "--set", "optimizer.lr=1.0"]) == 2  # Prodigy's documented multiplier: the finder's own refusal
    assert "estimates its own step size" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
