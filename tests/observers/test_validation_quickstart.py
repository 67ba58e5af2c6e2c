"""The quickstart's [validation] and [sample] sections: its run writes readable mp4 samples and the val/ series;
the example of docs/validation.md is a valid config."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest

from wantrain.app.config import load_config
from wantrain.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "examples" / "quickstart.toml"


@pytest.mark.slow
def test_quickstart_run_writes_sample_videos_and_the_val_series(tmp_path):
    import av

    from tests.test_end_to_end import copy_examples

    config = copy_examples(tmp_path, validation_and_samples=True)
    code = main(["run", str(config), "--max-steps", "10", "--run-id", "qs", "--set", "observers.progress=false"])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    frames = tomllib.loads(QUICKSTART.read_text())["sample"]["frames"]
    videos = sorted((run_dir / "samples").glob("*.mp4"))
    assert [v.name for v in videos] == ["step_000000_00.mp4", "step_000010_00.mp4"]  # baseline and the end
    for video in videos:
        with av.open(str(video)) as container:
            assert sum(1 for _ in container.decode(video=0)) == frames
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {x["step"]: x["val/loss"] for x in lines if "val/loss" in x}
    assert sorted(val) == [0, 10] and val[0] != val[10]
    assert {"val/loss/high_noise", "val/loss/low_noise", "val/loss/t_0.5"} <= set(lines[-1])


def test_docs_validation_example_is_a_valid_config(tmp_path):
    text = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "data"\n' + example, encoding="utf-8")
    cfg = load_config(config)
    assert cfg.validation.enabled and cfg.validation.from_training == 4
    assert cfg.validation.timesteps == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert cfg.sample.enabled and cfg.sample.frames == 9 and cfg.sample.steps == 8
    quick = load_config(QUICKSTART)
    assert quick.validation.enabled and quick.sample.enabled
