"""Resume end to end on the tiny real Wan model and the demo data: a run killed with SIGKILL (during training and
during a save), stopped by SIGTERM, or ended by the out-of-memory guard continues with `--resume auto` to the
same LoRA files, bit for bit, as a run that was never interrupted. Faults are injected with `[faults]`."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
from pathlib import Path

import prewarmed
import pytest
from inprocess import wantrain
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

STEPS = 60
SETTINGS = [
    f"train.max_steps={STEPS}", "train.log_every=2", "train.save_every=8", "checkpoint.every=4",
    "observers.progress=false", "observers.record_events=true", "optimizer.lr=3e-3",
]
EXPERTS = ("high_noise", "low_noise")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """The quickstart config and demo data in a scratch folder, with the cache filled once for every test."""
    tmp = tmp_path_factory.mktemp("resume")
    config = copy_examples(tmp)
    assert main(["cache", str(config)]) == 0
    return tmp


def fresh_copy(workspace: Path, tmp_path: Path) -> Path:
    """A config whose runs go to their own folder (sharing the filled cache)."""
    text = (workspace / "quickstart.toml").read_text().replace('output_dir = "runs"', f'output_dir = "{tmp_path}"')
    text = text.replace('path = "demo_data"', f'path = "{workspace / "demo_data"}"')
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "quickstart.toml"
    config.write_text(text)
    return config


def command(config: Path, *extra: str) -> list[str]:
    """``wantrain``'s arguments for a run of ``config`` with :data:`SETTINGS`."""
    args = ["run", str(config)]
    for item in SETTINGS:
        args += ["--set", item]
    return args + list(extra)


def only_run_dir(root: Path) -> Path:
    (run_dir,) = [d for d in root.iterdir() if d.is_dir()]
    return run_dir


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the run ended before {path} appeared: {proc.communicate()}"
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def first_checkpoint(root: Path, proc: subprocess.Popen) -> Path:
    deadline = time.monotonic() + 120
    while True:
        runs = [d for d in root.iterdir() if d.is_dir()] if root.exists() else []
        if runs and (runs[0] / "checkpoints" / "step_000004" / "complete.json").exists():
            return runs[0]
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.02)


def loras(run_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(run_dir.glob("quickstart*.safetensors"))}


def loss_series(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r.get("train/loss")) for r in rows]  # absent when every step of the interval was skipped


def resume(config: Path) -> subprocess.CompletedProcess:
    """``--resume auto`` in this process (``tests/inprocess.py``): the kills and signals are the subprocesses'."""
    return wantrain(*command(config, "--resume", "auto"))


@pytest.fixture(scope="module")
def reference(workspace, tmp_path_factory) -> Path:
    """The uninterrupted run everything is compared with."""
    tmp = tmp_path_factory.mktemp("reference")
    done = wantrain(*command(fresh_copy(workspace, tmp)))
    assert done.returncode == 0, done.stderr
    return only_run_dir(tmp)


def assert_same_as_reference(run_dir: Path, reference: Path, *, losses: bool = True) -> None:
    assert set(loras(run_dir)) == set(loras(reference))
    for name, content in loras(reference).items():
        assert loras(run_dir)[name] == content, name
    if losses:
        assert loss_series(run_dir) == loss_series(reference)


def test_sigkill_at_a_random_moment_then_resume_auto_gives_the_same_loras_and_losses(workspace, reference, tmp_path):
    config = fresh_copy(workspace, tmp_path)
    delay = random.Random(time.time_ns()).uniform(0.0, 1.5)
    proc = prewarmed.Popen(["-m", "wantrain", *command(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    run_dir = first_checkpoint(tmp_path, proc)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = resume(config)
    assert done.returncode == 0, (delay, done.stderr)
    assert only_run_dir(tmp_path) == run_dir  # the same run directory, no new one
    assert_same_as_reference(run_dir, reference)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    steps = [e["step"] for e in events if e["_type"] == "OptimizerStepped"]
    assert steps == sorted(set(steps)) == list(range(1, STEPS + 1)), delay  # cut back: no step twice


KILL_DURING_SAVE = """
import os, signal, sys
import safetensors.torch as st
original, calls = st.save_file, [0]
def save_file(*args, **kwargs):
    result = original(*args, **kwargs)
    calls[0] += 1
    if calls[0] == int(os.environ["KILL_AT_SAVE_CALL"]):
        os.kill(os.getpid(), signal.SIGKILL)  # the file is written, not yet renamed into place
    return result
st.save_file = save_file
from wantrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("call, torn", [(3, "LoRA file"), (4, "checkpoint")])
def test_sigkill_during_a_save_leaves_nothing_half_written_and_resume_auto_skips_the_torn_save(
        workspace, reference, tmp_path, call, torn):
    # save calls: step 4 checkpoint (1); step 8 LoRA high (2), LoRA low (3), checkpoint (4)
    driver = tmp_path / "driver.py"
    driver.write_text(KILL_DURING_SAVE)
    config = fresh_copy(workspace, tmp_path / "runs")
    killed = prewarmed.run([driver, *command(config)], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "KILL_AT_SAVE_CALL": str(call)})
    assert killed.returncode == -signal.SIGKILL
    run_dir = only_run_dir(tmp_path / "runs")
    leftovers = [p.name for p in [*run_dir.glob(".*tmp-*"), *(run_dir / "checkpoints").glob(".*tmp-*")]]
    assert len(leftovers) == 1, leftovers
    # killed before the rename: the step-8 file is absent (LoRA case) or complete, never half-written
    assert (run_dir / "quickstart_step000008_low_noise.safetensors").exists() == (torn == "checkpoint")
    done = resume(config)
    assert done.returncode == 0, done.stderr
    if torn == "checkpoint":
        assert "skipped torn checkpoint" in done.stderr
    assert not [*run_dir.glob(".*tmp-*"), *(run_dir / "checkpoints").glob(".*tmp-*")]
    assert_same_as_reference(run_dir, reference)


def test_sigterm_stops_with_exit_code_3_and_a_checkpoint_that_resumes_to_the_same_loras(workspace, reference,
                                                                                        tmp_path):
    config = fresh_copy(workspace, tmp_path)
    proc = prewarmed.Popen(["-m", "wantrain", *command(config)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    run_dir = first_checkpoint(tmp_path, proc)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 3, stderr
    stopped_at = loss_series(run_dir)[-1][0]
    assert stopped_at < STEPS and (run_dir / "checkpoints" / f"step_{stopped_at:06d}" / "complete.json").exists()
    assert "--resume auto" in stderr
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert log[-1]["event"] == "run_ended" and log[-1]["status"] == "stopped"
    done = resume(config)
    assert done.returncode == 0, done.stderr
    assert_same_as_reference(run_dir, reference, losses=False)  # the stop logged its partial interval
    assert stopped_at in [s for s, _ in loss_series(run_dir)]


CACHE_SIGNAL = """
import os, signal, sys
import wantrain.app.assemble as assemble  # where a run calls it (imported already in a prewarmed fork)
original = assemble.ensure_cache
def ensure_cache(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return original(*args, **kwargs)
assemble.ensure_cache = ensure_cache
from wantrain.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_signal_while_the_cache_fills_stops_cleanly_before_the_run_directory_exists(workspace, tmp_path):
    """One process fills the cache before the experts load, in prepare(): a signal there stops with code 3 and one
    reason, and no run directory is made (docs/resume.md)."""
    driver = tmp_path / "driver.py"
    driver.write_text(CACHE_SIGNAL)
    config = fresh_copy(workspace, tmp_path / "runs")
    done = prewarmed.run([driver, *command(config)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr and "stopped after 0 steps" in done.stderr
    assert "SIGTERM before the first step, while the cache filled (before the run directory was made" in done.stderr
    assert not (tmp_path / "runs").exists() or not any(d.is_dir() for d in (tmp_path / "runs").iterdir())


# -- in-process: guards and refusals -----------------------------------------------------------------------------
def run_in_process(config: Path, *extra: str) -> int:
    args = ["run", str(config)]
    for item in SETTINGS:
        args += ["--set", item]
    return main(args + list(extra))


def test_ten_percent_of_micro_steps_out_of_memory_completes_and_reports_the_skips(workspace, tmp_path):
    config = fresh_copy(workspace, tmp_path)
    code = run_in_process(config, "--set", "faults.oom_probability=0.1", "--set", "faults.seed=3",
                          "--set", "train.grad_accum=2", "--set", "train.max_consecutive_oom=10")
    assert code == 0
    run_dir = only_run_dir(tmp_path)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/lr" in r]  # not the quickstart's val/-only line at step 0
    assert rows[-1]["step"] == STEPS and rows[-1]["train/skipped_steps"] >= 4
    assert all(r["train/loss"] is not None for r in rows)  # no NaN anywhere (written as null)
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert sum(1 for x in log if x["event"] == "out_of_memory") == rows[-1]["train/skipped_steps"]


def test_out_of_memory_on_k_steps_in_a_row_ends_failed_with_an_emergency_checkpoint_that_resumes(workspace,
                                                                                               tmp_path, capsys):
    config = fresh_copy(workspace, tmp_path)
    faults = ["--set", "faults.oom_at_steps=[13, 14, 15]", "--set", "train.max_consecutive_oom=3"]
    assert run_in_process(config, *faults) == 1
    run_dir = only_run_dir(tmp_path)
    emergency = run_dir / "checkpoints" / "step_000015"
    assert (emergency / "complete.json").exists()
    assert json.loads((emergency / "state.json").read_text())["meta"]["reason"] == "emergency: out of memory"
    assert not (run_dir / "quickstart_high_noise.safetensors").exists()  # no final LoRA for a failed run
    assert run_in_process(config, *faults, "--resume", "auto") == 0
    assert loss_series(run_dir)[-1][0] == STEPS


def test_nan_losses_are_skipped_and_too_many_in_a_row_stop_keeping_the_last_good_checkpoint(workspace, tmp_path):
    config = fresh_copy(workspace, tmp_path)
    assert run_in_process(config, "--set", "faults.nan_at_steps=[9, 10]") == 0
    run_dir = only_run_dir(tmp_path)
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/lr" in r}  # not the quickstart's val/-only line at step 0
    assert rows[10]["train/nan_skipped_steps"] == 2 and rows[STEPS]["train/skipped_steps"] == 2
    # the interval of steps 9-10 had no finite loss: not measured (absent), never NaN; every other one is finite
    assert "train/loss" not in rows[10] and all(r["train/loss"] is not None for s, r in rows.items() if s != 10)
    from safetensors.torch import load_file

    for expert in EXPERTS:
        assert all(t.float().isfinite().all() for t in load_file(run_dir / f"quickstart_{expert}.safetensors").values())

    other = tmp_path / "again"
    other.mkdir()
    config = fresh_copy(workspace, other)
    assert run_in_process(config, "--set", "faults.nan_at_steps=[17, 18, 19, 20]",
                          "--set", "train.max_consecutive_nan=3") == 1
    run_dir = only_run_dir(other)
    assert [p.name for p in sorted((run_dir / "checkpoints").iterdir())] == ["step_000012", "step_000016"]
    # resumed from the last good checkpoint (after the "fix": here, no more injected NaNs), it completes
    assert run_in_process(config, "--set", "train.max_consecutive_nan=3", "--resume", "auto") == 0
    assert loss_series(run_dir)[-1][0] == STEPS


def test_an_incompatible_checkpoint_is_refused_naming_the_keys_and_a_changed_lr_warns(workspace, tmp_path,
                                                                                       capsys):
    config = fresh_copy(workspace, tmp_path)
    assert run_in_process(config, "--set", "train.max_steps=8") == 0
    run_dir = only_run_dir(tmp_path)
    before = {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    capsys.readouterr()
    code = run_in_process(config, "--set", "lora.rank=4", "--set", "model.switch_every=5", "--resume", str(run_dir))
    err = capsys.readouterr().err
    assert code == 2 and "lora.rank: 8 -> 4" in err and "model.switch_every: 10 -> 5" in err
    assert len(err.strip().splitlines()) == 1
    assert {p.name: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before  # nothing touched
    code = run_in_process(config, "--set", "optimizer.lr=1e-3", "--set", "train.max_steps=10", "--resume",
                          str(run_dir))
    assert code == 0 and "resuming with a changed optimizer.lr: 0.003 -> 0.001" in capsys.readouterr().err
    assert loss_series(run_dir)[-1][0] == 10
    assert (run_dir / "config.until_step_000008.toml").exists()


def test_resume_with_nothing_to_resume_from_is_one_line(workspace, tmp_path, capsys):
    config = fresh_copy(workspace, tmp_path)
    assert run_in_process(config, "--resume", "auto") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no complete checkpoint of a run named 'quickstart'" in err
    assert not list(tmp_path.glob("2*"))


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(workspace, tmp_path, monkeypatch,
                                                                                 capsys):
    import errno

    import safetensors.torch

    original, calls = safetensors.torch.save_file, []

    def full_disk(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:  # call 1: step 4's checkpoint; call 2: step 8's first LoRA file
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)
        return original(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    config = fresh_copy(workspace, tmp_path)
    capsys.readouterr()
    assert run_in_process(config) == 1  # failed (README's exit codes): the input was fine
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("wantrain run: error: cannot write LoRA file") and "No space left on device" in err[-1]
    run_dir = only_run_dir(tmp_path)
    assert [p.name for p in (run_dir / "checkpoints").iterdir()] == ["step_000004"]
    assert not list(run_dir.glob(".*tmp-*"))  # the partial file is gone
    monkeypatch.undo()
    assert run_in_process(config, "--resume", "auto") == 0


def test_the_faults_example_in_docs_resume_md_is_a_valid_config(tmp_path):
    import re

    from wantrain.app.config import load_config

    docs = (Path(__file__).resolve().parents[1] / "docs" / "resume.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", docs, re.S)
    assert len(blocks) == 3
    config = tmp_path / "c.toml"
    config.write_text("[data]\npath = '.'\n" + "\n".join(b for b in blocks if "[train]" not in b))
    cfg = load_config(config)
    guard = [b for b in blocks if "[train]" in b]  # the divergence guard's example
    assert len(guard) == 1
    config.write_text("[data]\npath = '.'\n" + guard[0])
    assert load_config(config).train.divergence_factor == 10
    assert cfg.faults.oom_at_steps == [13, 14, 15] and cfg.checkpoint.keep_every == 500
    assert cfg.faults.kill_at_steps == [12] and cfg.faults.kill_phase == "step"
