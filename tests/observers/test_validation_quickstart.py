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
    # each round's motion and its ratio to the training clips' (measured once, before training)
    moved = [x for x in lines if "samples/motion" in x]
    assert [x["step"] for x in moved] == [0, 10] and all(x["samples/motion/00"] == x["samples/motion"] for x in moved)
    clips = [x["samples/motion"] / x["samples/motion_ratio"] for x in moved]
    assert clips[0] > 0.1 and clips[1] == pytest.approx(clips[0])  # the demo clips move; one figure


def test_docs_validation_example_is_a_valid_config(tmp_path):
    text = (ROOT / "docs" / "validation.md").read_text(encoding="utf-8")
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-t2v"\n[data]\npath = "data"\n' + example, encoding="utf-8")
    cfg = load_config(config)
    assert cfg.validation.enabled and cfg.validation.from_training == 4
    assert cfg.validation.timesteps == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert cfg.sample.enabled and cfg.sample.frames == 9 and cfg.sample.steps == 8
    from wantrain.models.wan22.variants import VARIANTS
    from wantrain.observers.evaluation.config import check_sections

    plain, own = cfg.sample.resolved(VARIANTS["tiny-t2v"])
    assert (plain.width, plain.frames, plain.seed) == (64, 9, 42 + 0)
    assert (own.width, own.height, own.frames, own.seed, own.guidance_scale) == (96, 64, 5, 7, 2.0)
    check_sections(cfg.validation, cfg.sample, VARIANTS["tiny-t2v"], ("high_noise", "low_noise"))
    quick = load_config(QUICKSTART)
    assert quick.validation.enabled and quick.sample.enabled


@pytest.mark.slow
def test_the_quickstart_switched_to_i2v_samples_from_a_clips_first_frame_shown_beside_the_result(tmp_path):
    """`--set model.variant=tiny-i2v` without images: each prompt's first frame is the first validation clip's,
    named in the log, and the TensorBoard strip shows it left of the sampled frames."""
    import io

    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_end_to_end import copy_examples
    from wantrain.data.media import fit

    config = copy_examples(tmp_path, validation_and_samples=True)
    code = main(["run", str(config), "--max-steps", "1", "--set", "model.variant=tiny-i2v",
                 "--set", "observers.progress=false"])
    assert code == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(v.name for v in (run_dir / "samples").glob("*.mp4")) == ["step_000000_00.mp4",
                                                                            "step_000001_00.mp4"]
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    (chosen,) = [x for x in log if x["event"] == "sample_first_frame"]
    first_clip = sorted((tmp_path / "demo_data").glob("clip_*.mp4"))[0]
    assert chosen["source"] == f"{first_clip} (frame 0)" and "validation clip" in chosen["reason"]

    (events,) = (run_dir / "tensorboard").glob("*.samples")
    acc = EventAccumulator(str(events), size_guidance={"images": 0})
    acc.Reload()
    strip = np.asarray(Image.open(io.BytesIO(acc.Images("samples/00")[-1].encoded_image_string)).convert("RGB"))
    frames, side = 9, 64
    assert strip.shape == (side, side + 4 + 8 * side, 3)  # first frame, a gap, 8 of the 9 frames
    import av

    with av.open(str(first_clip)) as container:
        frame = next(container.decode(video=0)).to_image()
    assert np.array_equal(strip[:, :side], fit(frame, side, side))  # PNG in TensorBoard: lossless
    assert frames == tomllib.loads(QUICKSTART.read_text())["sample"]["frames"]


@pytest.mark.slow
def test_the_quickstart_training_one_expert_writes_samples(tmp_path):
    """`--set model.experts=low_noise`: the high-noise steps of each sample run that expert's base weights."""
    from tests.test_end_to_end import copy_examples

    config = copy_examples(tmp_path, validation_and_samples=True)
    assert main(["run", str(config), "--max-steps", "1", "--set", "model.experts=low_noise",
                 "--set", "observers.progress=false"]) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert sorted(v.name for v in (run_dir / "samples").glob("*.mp4")) == ["step_000000_00.mp4",
                                                                            "step_000001_00.mp4"]
    assert sorted(p.name for p in run_dir.glob("*.safetensors")) == ["quickstart_low_noise.safetensors"]
