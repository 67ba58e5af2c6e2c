"""Nothing lost, nothing silent, end to end on the tiny real Wan model: one process per run directory, a full disk
or a read-only run directory as one line (exit code 1: the run failed) with the last checkpoint intact and
resumable, and signals during saves. The storage cases run on real small file systems (a tmpfs mounted as root:
``tests/core/small_fs.py``; skipped with the reason where mounting is not permitted)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import tomllib
from pathlib import Path

import prewarmed
import pytest
from core.small_fs import fill, read_only_bind, remount, small_tmpfs
from inprocess import wantrain
from test_end_to_end import copy_examples

from wantrain.cli.main import main
from wantrain.core.checkpoint import latest_complete

pytestmark = pytest.mark.slow

SETTINGS = ["train.log_every=2", "train.save_every=8", "checkpoint.every=4", "observers.progress=false",
            "observers.record_events=true", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The quickstart config and demo data, the cache filled once for every test (as tests/test_resume.py's)."""
    tmp = tmp_path_factory.mktemp("storage")
    assert main(["cache", str(copy_examples(tmp))]) == 0
    return tmp


def config_in(workspace: Path, output_dir: Path) -> Path:
    """A quickstart config whose runs go to ``output_dir`` (the cache stays in the workspace)."""
    text = (workspace / "quickstart.toml").read_text()
    text = text.replace('output_dir = "runs"', f'output_dir = "{output_dir}"')
    text = text.replace('path = "demo_data"', f'path = "{workspace / "demo_data"}"')
    config = workspace / f"config_{abs(hash(str(output_dir)))}.toml"
    config.write_text(text)
    return config


def args(config: Path, steps: int, *extra: str) -> list[str]:
    out = ["run", str(config), "--max-steps", str(steps)]
    for item in SETTINGS:
        out += ["--set", item]
    return out + list(extra)


def run_dirs(root: Path) -> list[Path]:
    return sorted(d for d in root.iterdir() if d.is_dir() and d.name[:1].isdigit())


def temporaries(run_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if ".tmp" in p.name)


def assert_one_line(err: str, *parts: str) -> str:
    assert "Traceback" not in err and "Logging error" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("wantrain run: error: "), err
    for part in parts:
        assert part in last, last
    return last


def subprocess_run(config: Path, steps: int, *extra: str) -> subprocess.CompletedProcess:
    """A run as a subprocess would give it (exit code, stdout, stderr), in this process (``tests/inprocess.py``):
    the live runs that are signalled or made read-only are real subprocesses."""
    return wantrain(*args(config, steps, *extra))


# -- one writer per run directory ------------------------------------------------------------------------------------
def test_resume_auto_on_a_live_run_is_refused_naming_its_pid_and_the_live_run_loses_nothing(workspace, tmp_path,
                                                                                            capsys):
    config = config_in(workspace, tmp_path)
    live = prewarmed.Popen(["-m", "wantrain.cli.main", *args(config, 400)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path.is_dir() and run_dirs(tmp_path)
                   and (run_dirs(tmp_path)[0] / "checkpoints" / "step_000008" / "complete.json").exists()):
            assert live.poll() is None and time.monotonic() < deadline, live.stderr.read()
            time.sleep(0.05)
        capsys.readouterr()
        assert main(args(config, 400, "--resume", "auto")) == 2
        err = capsys.readouterr().err
        assert_one_line(err, f"is in use by process {live.pid}")
        live.send_signal(signal.SIGTERM)
        _, live_err = live.communicate(timeout=300)
    finally:
        live.kill()
    assert live.returncode == 3, live_err
    (run_dir,) = run_dirs(tmp_path)
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("superseded")]
    best, _ = latest_complete(run_dir / "checkpoints")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == best.step  # the live run's metrics up to its stop are all there
    steps = [json.loads(x)["step"] for x in (run_dir / "events.jsonl").read_text().splitlines()
             if '"OptimizerStepped"' in x]
    assert steps == list(range(1, best.step + 1))  # its events too, once each


# -- a full disk, a read-only run directory ---------------------------------------------------------------------------
def test_a_full_disk_mid_run_is_one_line_exit_2_with_the_last_checkpoint_intact_and_resumable(workspace, tmp_path):
    # a checkpoint takes ~230 KiB, a LoRA file 24 KiB: two checkpoints fit, the third (written before the oldest is
    # pruned) does not
    with small_tmpfs(tmp_path / "disk", "640k") as disk:
        config = config_in(workspace, disk)
        done = subprocess_run(config, 60)
        assert done.returncode == 1, done.stderr
        assert_one_line(done.stderr, "No space left on device", "free there", str(disk))
        (run_dir,) = run_dirs(disk)
        assert temporaries(run_dir) == []
        best, torn = latest_complete(run_dir / "checkpoints")
        assert best is not None and torn == []
        remount(disk, "size=16m")
        resumed = subprocess_run(config, 60, "--resume", "auto")
        assert resumed.returncode == 0, resumed.stderr
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert rows[-1]["step"] == 60 and (run_dir / "quickstart_low_noise.safetensors").exists()


def test_a_resume_on_a_full_disk_keeps_config_toml_so_a_later_resume_finds_the_run(workspace, tmp_path):
    """The finding: config.toml was renamed to config.until_step_N.toml and the new one written 0 bytes; after
    space was freed, --resume auto found "no complete checkpoint"."""
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        config = config_in(workspace, disk)
        assert subprocess_run(config, 8).returncode == 0
        (run_dir,) = run_dirs(disk)
        before = (run_dir / "config.toml").read_bytes()
        filler = fill(disk)
        done = subprocess_run(config, 12, "--resume", str(run_dir))  # a changed max_steps: the old config is kept
        assert done.returncode == 1, done.stderr
        assert_one_line(done.stderr, "No space left on device")
        assert (run_dir / "config.toml").read_bytes() == before
        assert tomllib.loads(before.decode())["run"]["name"] == "quickstart"
        filler.unlink()
        resumed = subprocess_run(config, 12, "--resume", str(run_dir))  # completed: continued on purpose
        assert resumed.returncode == 0, resumed.stderr
        assert (run_dir / "config.until_step_000008.toml").read_bytes() == before
        assert tomllib.loads((run_dir / "config.toml").read_text())["train"]["max_steps"] == 12


def test_a_run_directory_made_read_only_mid_run_is_one_line_and_resumes_once_writable(workspace, tmp_path):
    config = config_in(workspace, tmp_path)
    proc = prewarmed.Popen(["-m", "wantrain.cli.main", *args(config, 400)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not (run_dirs(tmp_path) and (run_dirs(tmp_path)[0] / "checkpoints" / "step_000004").exists()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)
        (run_dir,) = run_dirs(tmp_path)
        with read_only_bind(run_dir):
            _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert_one_line(err, "Read-only file system", str(run_dir))
    assert latest_complete(run_dir / "checkpoints")[0] is not None
    resumed = subprocess_run(config, 16, "--resume", "auto")
    assert resumed.returncode == 0, resumed.stderr
    assert temporaries(run_dir) == []


def test_a_data_folder_the_cache_cannot_be_written_in_is_one_line_naming_data_cache_dir(workspace, tmp_path):
    with small_tmpfs(tmp_path / "data", "16m") as data:
        subprocess.run(["cp", "-r", str(workspace / "demo_data"), str(data)], check=True)
        for cached in data.rglob(".wantrain_cache"):
            subprocess.run(["rm", "-rf", str(cached)], check=True)
        remount(data, "ro")
        text = (workspace / "quickstart.toml").read_text().replace('output_dir = "runs"',
                                                                    f'output_dir = "{tmp_path / "runs"}"')
        config = tmp_path / "q.toml"
        config.write_text(text.replace('path = "demo_data"', f'path = "{data / "demo_data"}"'))
        done = subprocess_run(config, 4)
        assert done.returncode == 2, done.stderr
        assert_one_line(done.stderr, "Read-only file system", "data.cache_dir", str(data / "demo_data"))


# -- signals during saves -------------------------------------------------------------------------------------------
def test_a_sigterm_during_a_save_writes_that_step_once(workspace, tmp_path, monkeypatch):
    """The finding: the stop saved the step it arrived in again (LoRA files and checkpoint twice inside the
    preemption grace period)."""
    import safetensors.torch

    original, written = safetensors.torch.save_file, []

    def save_file(tensors, filename, metadata=None):
        written.append(Path(filename).name)
        if len(written) == 2:  # step 8's first LoRA file: the preemption arrives mid-save
            os.kill(os.getpid(), signal.SIGTERM)
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    config = config_in(workspace, tmp_path)
    assert main(args(config, 20)) == 3
    assert len(written) == 4, written  # step 4's checkpoint; step 8's two LoRA files and checkpoint: once
    (run_dir,) = run_dirs(tmp_path)
    assert not list(run_dir.glob("quickstart_*_noise.safetensors")) or \
        sorted(p.name for p in run_dir.glob("quickstart*.safetensors")) == [
            "quickstart_step000008_high_noise.safetensors", "quickstart_step000008_low_noise.safetensors"]
    assert latest_complete(run_dir / "checkpoints")[0].step == 8


def test_a_second_ctrl_c_between_the_renames_of_a_checkpoint_leaves_it_complete(workspace, tmp_path, monkeypatch,
                                                                                 capsys):
    """The finding: the only complete copy was left as .step_N.old-PID, which the next resume deleted."""
    config = config_in(workspace, tmp_path)
    assert main(args(config, 8)) == 0
    (run_dir,) = run_dirs(tmp_path)
    import wantrain.core.checkpoint as checkpoint

    real_replace = os.replace

    def replace(src, dst):
        real_replace(src, dst)
        if Path(src).name == "step_000008":  # the old copy moved aside; the new one not yet in place
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)

    monkeypatch.setattr(checkpoint.os, "replace", replace)
    # a completed run resumed at its end (named on purpose) saves step 8 again
    assert main(args(config, 8, "--resume", str(run_dir))) == 130
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step_000008" in err and "nothing was saved" not in err
    best, torn = latest_complete(run_dir / "checkpoints")
    assert best is not None and best.path.name == "step_000008" and torn == []
    assert main(args(config, 10, "--resume", str(run_dir))) == 0


def test_a_second_ctrl_c_during_the_stops_checkpoint_says_what_was_saved(workspace, tmp_path, monkeypatch, capsys):
    """The finding: "nothing was saved after the last checkpoint" although the stop's LoRA files were written."""
    import safetensors.torch

    from wantrain.core.loop import Trainer

    original_save, original_due = safetensors.torch.save_file, Trainer._save_if_due

    def save_if_due(self, step):
        original_due(self, step)
        if step == 6:
            os.kill(os.getpid(), signal.SIGINT)  # the first Ctrl-C: stop after step 6

    def save_file(tensors, filename, metadata=None):
        if ".step_000006.tmp-" in str(filename):
            os.kill(os.getpid(), signal.SIGINT)  # the second, while the stop's checkpoint is written
        return original_save(tensors, filename, metadata=metadata)

    monkeypatch.setattr(Trainer, "_save_if_due", save_if_due)
    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    config = config_in(workspace, tmp_path)
    capsys.readouterr()
    assert main(args(config, 20)) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    (run_dir,) = run_dirs(tmp_path)
    assert "nothing was saved" not in err and "at step 6" in err
    assert str(run_dir / "quickstart_low_noise.safetensors") in err  # the stop's LoRA files were written
    assert str(run_dir / "checkpoints" / "step_000004") in err  # and step 4 is what resume continues from
    assert latest_complete(run_dir / "checkpoints")[0].step == 4 and temporaries(run_dir) == []


def test_one_ctrl_c_while_the_run_directory_is_set_up_stops_with_exit_code_3(workspace, tmp_path, monkeypatch,
                                                                              capsys):
    """docs/resume.md: a signal before the first step stops cleanly with code 3 (it was 130 in the moments between
    the run directory's creation and the signal handler)."""
    import wantrain.app.assemble as assemble

    original = assemble.write_config_source

    def write_config_source(run_dir, *rest):
        os.kill(os.getpid(), signal.SIGINT)
        return original(run_dir, *rest)

    monkeypatch.setattr(assemble, "write_config_source", write_config_source)
    config = config_in(workspace, tmp_path)
    assert main(args(config, 4)) == 3
    assert "stopped after 0 steps" in capsys.readouterr().err
    (run_dir,) = run_dirs(tmp_path)
    assert (run_dir / "preflight.json").exists() and (run_dir / "config.toml").exists()
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "run_ended" and log[-1]["status"] == "stopped"
