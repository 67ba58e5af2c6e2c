"""``model.compile`` through the paths a whole run takes, on the quickstart (tiny-t2v, both experts, the demo data),
in this process (``tests/inprocess.py``) with the ``aot_eager`` backend (dynamo and AOTAutograd: the graphs, guards
and breaks inductor would get, without its code generation; tests/models/test_wan22_compile.py has the one
inductor test):

* ``--lr-finder-then-train`` with validation and samples, eager and compiled: the finder's sweep (its losses and
  suggestion), the restore before training (``lr_finder_state_restored``), the training losses, the validation
  losses and the sample videos of the compiled run equal the eager run's; dynamo reports 0 graph breaks.
* resume: the compiled run's own ``config.toml`` (the suggested LR, the finder off; validation and samples off) run
  again, stopped after step 3 and resumed, ends with the LoRA files of the uninterrupted compiled run, byte for byte.

torchrun (two gloo ranks, compiled): tests/test_distributed.py."""

from __future__ import annotations

import csv
import json
import shutil
import tomllib
from pathlib import Path

import av
import numpy as np
import pytest
import torch._dynamo
from inprocess import wantrain
from PIL import Image
from test_end_to_end import copy_examples

from wantrain.models.wan22 import compile as wan_compile
from wantrain.models.wan22.compile import compile_counts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["train.max_steps=4", "train.log_every=1", "checkpoint.every=2", "model.switch_every=2",
            "observers.progress=false", "validation.every=2", "validation.from_training=2", "sample.every=4",
            "sample.steps=2", "lr_finder.steps=6", "lr_finder.burn_in=2", "lr_finder.probe_clips=1",
            "lr_finder.probe_timesteps=2", "optimizer.lr=3e-3"]
REL = 1e-5
"""Relative tolerance of every compiled figure against eager's. Measured: equal bit for bit (aot_eager runs the same
aten ops on the CPU); the room is for a float rounding a future torch may move."""
PROBE = ["--set", 'observers.extra=["distributed_probe:RankProbe"]', "--allow-code"]
QUIET = ["--set", "validation.enabled=false", "--set", "sample.enabled=false"]
"""The resumed runs without validation and samples (each a compile of its own; validation does not change training,
tests/observers/test_validation.py): their LoRA still equals the uninterrupted compiled run's, which had both."""


def run(config: Path, out: Path, *extra: str) -> None:
    args = ["run", str(config), "--set", f'run.output_dir="{out}"']
    for item in SETTINGS:
        args += ["--set", item]
    done = wantrain(*args, *extra)
    assert done.returncode == 0, done.stderr[-3000:]


def run_dirs(out: Path) -> tuple[Path, Path]:
    """(the finder's run directory, the training run's)."""
    finder = [d for d in out.iterdir() if d.name.endswith("__lr_finder")]
    train = [d for d in out.iterdir() if d.is_dir() and d not in finder]
    assert len(finder) == len(train) == 1, sorted(out.iterdir())
    return finder[0], train[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("compiled_runs")
    config = copy_examples(tmp, validation_and_samples=True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(wan_compile, "BACKEND", "aot_eager")
        torch._dynamo.reset()
        run(config, tmp / "eager", "--lr-finder-then-train")
        before = compile_counts()
        run(config, tmp / "compiled", "--lr-finder-then-train", "--set", 'model.compile="default"')
        after = compile_counts()
        # the compiled run again from its config.toml, stopped after step 3 (tests/distributed_probe.py), resumed
        resume = tmp / "resume"
        resume.mkdir()
        shutil.copy(run_dirs(tmp / "compiled")[1] / "config.toml", resume / "config.toml")
        shutil.copy(ROOT / "tests" / "distributed_probe.py", resume / "distributed_probe.py")
        patch.setenv("WANTRAIN_PROBE_STOP_AT", "3")
        patch.setenv("WANTRAIN_PROBE_STOP_RANK", "0")
        stopped = wantrain("run", str(resume / "config.toml"), "--set", f'run.output_dir="{resume / "runs"}"', *PROBE,
                           *QUIET)
        patch.delenv("WANTRAIN_PROBE_STOP_AT")
        resumed = wantrain("run", str(resume / "config.toml"), "--set", f'run.output_dir="{resume / "runs"}"',
                           *PROBE, *QUIET, "--resume", "auto")
    torch._dynamo.reset()
    return {"tmp": tmp, "counts": {k: after[k] - before[k] for k in after}, "stopped": stopped, "resumed": resumed}


def rows(path: Path) -> list[dict]:
    with path.open() as f:
        return list(csv.DictReader(f))


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def frames(video: Path) -> np.ndarray:
    with av.open(str(video)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.int16)


def test_a_compiled_lr_finder_then_train_run_with_validation_and_samples_equals_eager(runs):
    (eager_finder, eager), (finder, compiled) = run_dirs(runs["tmp"] / "eager"), run_dirs(runs["tmp"] / "compiled")
    assert runs["counts"]["graph_breaks"] == 0 and runs["counts"]["graphs"] >= 2, runs["counts"]
    # the sweep: every rung's loss, and so the suggested LRs the training runs were built with
    expected, got = rows(eager_finder / "lr_finder.csv"), rows(finder / "lr_finder.csv")
    assert len(got) == len(expected) == 12
    for a, b in zip(got, expected, strict=True):
        assert (a["expert"], a["lr"]) == (b["expert"], b["lr"])
        assert float(a["raw_loss"]) == pytest.approx(float(b["raw_loss"]), rel=REL)
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=REL)
    suggested = [[x["suggested_lr"] for x in lines(d / "log.jsonl") if x["event"] == "lr_finder_result"]
                 for d in (eager_finder, finder)]
    assert suggested[1] == suggested[0] and len(suggested[0]) == 2
    # the training runs were built alike: their resolved configs differ in the output folder and model.compile only
    resolved = [tomllib.loads((d / "config.toml").read_text()) for d in (eager, compiled)]
    assert resolved[1]["model"].pop("compile") == "default" and resolved[0]["model"].pop("compile") == "off"
    for config in resolved:
        del config["run"]["output_dir"]
    assert resolved[1] == resolved[0]
    # the restore, then the training and validation losses
    assert "lr_finder_state_restored" in {x["event"] for x in lines(compiled / "log.jsonl")}
    want, have = lines(eager / "metrics.jsonl"), lines(compiled / "metrics.jsonl")
    assert [r["step"] for r in have] == [r["step"] for r in want]
    names = [n for r in want for n in r if n.startswith(("train/loss", "val/"))]
    assert any(n.startswith("val/") for n in names)
    for a, b in zip(have, want, strict=True):
        for name in b:
            if name.startswith(("train/loss", "val/")):
                assert a[name] == pytest.approx(b[name], rel=REL), (a["step"], name)
    # the samples (step 0 and the last step): the sampled latents' pictures equal, and the videos the same up to
    # H.264's own amplification: a frame one 8-bit level off can flip the encoder's choice for a block, which then
    # decodes several levels apart (measured: 0.2 % of the values more than one level apart, at most 9, mean
    # 0.007, depending on PYTHONHASHSEED, on f47fedc too); a wrong sample moves most values by tens of levels
    videos = sorted(p.name for p in (eager / "samples").glob("*.mp4"))
    assert videos == sorted(p.name for p in (compiled / "samples").glob("*.mp4")) and len(videos) == 2
    for name in videos:
        pictures = [np.asarray(Image.open(d / "samples" / name.replace(".mp4", "_latents.png")))
                    for d in (compiled, eager)]
        assert np.array_equal(*pictures), name
        apart = np.abs(frames(compiled / "samples" / name) - frames(eager / "samples" / name))
        assert (apart > 1).mean() <= 0.01 and apart.mean() <= 0.05, (name, (apart > 1).mean(), apart.mean())


def test_a_compiled_run_stopped_and_resumed_equals_the_uninterrupted_compiled_run(runs):
    assert runs["stopped"].returncode == 3, runs["stopped"].stderr[-3000:]
    assert runs["resumed"].returncode == 0, runs["resumed"].stderr[-3000:]
    (run_dir,) = (runs["tmp"] / "resume" / "runs").iterdir()
    assert (run_dir / "checkpoints" / "step_000003" / "complete.json").exists()
    uninterrupted = run_dirs(runs["tmp"] / "compiled")[1]
    expected = {p.name: p.read_bytes() for p in uninterrupted.glob("quickstart*.safetensors")}
    assert len(expected) == 2
    assert {p.name: p.read_bytes() for p in run_dir.glob("quickstart*.safetensors")} == expected
    losses = {r["step"]: r["train/loss"] for r in lines(run_dir / "metrics.jsonl") if "train/loss" in r}
    assert losses == {r["step"]: r["train/loss"] for r in lines(uninterrupted / "metrics.jsonl") if "train/loss" in r}
