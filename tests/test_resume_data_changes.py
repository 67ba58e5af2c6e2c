"""Changed data never resumes silently (docs/resume.md, What a resume checks): a checkpoint carries the content and
caption fingerprints of every medium (`wantrain.data.fingerprints`); a resume on an edited caption or a video
replaced under the same name is refused naming the file, unless `--allow-data-changes`, which trains on and records
the change in the event log; files added or removed are refused naming them. The tiny Wan model, the demo data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_end_to_end import copy_examples
from test_resume_damage import resume_copy

from wantrain.cli.main import main
from wantrain.core.events.log import read
from wantrain.data.fingerprints import DataChanged

pytestmark = pytest.mark.slow

SETTINGS = ["--set", "checkpoint.every=2", "--set", "train.log_every=1", "--set", "observers.progress=false",
            "--set", "observers.record_events=true"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A workspace (config, demo data with a filled cache) and a 2-step run with a checkpoint at step 2."""
    workspace = tmp_path_factory.mktemp("data_changes")
    config = copy_examples(workspace)
    assert main(["run", str(config), "--max-steps", "2", *SETTINGS]) == 0
    return workspace


@pytest.fixture
def copy(finished: Path, tmp_path: Path):
    """(config, data folder, run directory): a copy of the run under tmp_path whose config trains on the workspace's
    data folder (the resolved config names it; a moved folder would be a changed config). A test edits that folder;
    it is restored afterwards, file times included."""
    (original,) = (finished / "runs").iterdir()
    config, run_dir = resume_copy((finished, original), tmp_path)
    data = finished / "demo_data"
    shutil.copytree(data, tmp_path / "data_backup", symlinks=True)
    try:
        yield config, data, run_dir
    finally:
        shutil.rmtree(data)
        shutil.copytree(tmp_path / "data_backup", data, symlinks=True)


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*")) if p.is_file()}


def resume(config: Path, *extra: str) -> int:
    return main(["run", str(config), "--max-steps", "3", *SETTINGS, "--resume", "auto", *extra])


def refusal(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_checkpoint_records_every_mediums_content_and_caption_fingerprint(finished):
    (run_dir,) = (finished / "runs").iterdir()
    state = json.loads((run_dir / "checkpoints" / "step_000002" / "state.json").read_text())
    recorded = state["meta"]["data_files"]
    media = sorted(str(p) for p in (finished / "demo_data").iterdir() if p.suffix in (".mp4", ".png"))
    assert sorted(recorded) == media and all(len(v) == 2 for v in recorded.values())


@pytest.mark.parametrize("change", ["caption", "content"])
def test_a_changed_file_is_refused_naming_it_and_touches_nothing(copy, capsys, change):
    config, data, run_dir = copy
    if change == "caption":
        (data / "clip_003.txt").write_text("an edited caption")
    else:
        shutil.copy(data / "clip_005.mp4", data / "clip_003.mp4")  # another video under the same name
    before = files(run_dir)
    capsys.readouterr()
    assert resume(config) == 2
    err = refusal(capsys)
    named = f"{data / 'clip_003.txt'} (caption of clip_003.mp4)" if change == "caption" else \
        f"{data / 'clip_003.mp4'} (content)"  # the file that changed: the caption's own, for a caption (issue 49)
    assert named in err and "1 file(s) changed" in err
    assert "--allow-data-changes" in err
    assert files(run_dir) == before


@pytest.mark.parametrize("change", ["added", "removed"])
def test_added_and_removed_files_are_named(copy, capsys, change):
    config, data, _ = copy
    if change == "added":
        shutil.copy(data / "clip_005.mp4", data / "clip_100.mp4")
        shutil.copy(data / "clip_005.txt", data / "clip_100.txt")
        named = data / "clip_100.mp4"
    else:
        (data / "clip_004.mp4").unlink()
        (data / "clip_004.txt").unlink()
        named = data / "clip_004.mp4"
    capsys.readouterr()
    assert resume(config, "--allow-data-changes") == 2  # the override is for changed files, not the clip list
    err = refusal(capsys)
    assert f"{change}: {named}" in err


def test_allow_data_changes_trains_on_and_records_the_changed_files(copy):
    config, data, run_dir = copy
    (data / "clip_003.txt").write_text("an edited caption")
    assert resume(config, "--allow-data-changes") == 0
    changed = [e for e in read(run_dir) if isinstance(e, DataChanged)]
    assert len(changed) == 1
    assert changed[0].changed == (f"{data / 'clip_003.txt'} (caption of clip_003.mp4)",)
    assert changed[0].checkpoint.endswith("step_000002") and changed[0].step == 2
    # the new checkpoint carries the data as it is now: the next resume has nothing to allow
    assert main(["run", str(config), "--max-steps", "4", *SETTINGS, "--resume", str(run_dir)]) == 0  # completed


def test_max_steps_below_the_checkpoints_step_is_refused_in_one_line(finished, tmp_path, capsys):
    (original,) = (finished / "runs").iterdir()
    config, run_dir = resume_copy((finished, original), tmp_path)
    before = files(run_dir)
    capsys.readouterr()
    assert main(["run", str(config), "--max-steps", "1", *SETTINGS, "--resume", "auto"]) == 2
    err = refusal(capsys)
    assert "train.max_steps = 1 is below the step of checkpoint" in err and "(2)" in err and "--max-steps 3" in err
    assert files(run_dir) == before
