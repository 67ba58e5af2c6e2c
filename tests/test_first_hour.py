"""What a newcomer meets in the first hour (issue 29): a stop saves before anything else, ``check`` refuses a
missing model, ``cache`` keeps other configs' entries, the stop message names the real config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.test_end_to_end import copy_examples
from wantrain.cli.main import main

pytestmark = pytest.mark.slow

STOP_AT = """
from wantrain.core.events import OptimizerStepped
from wantrain.observers import Observer, on


class StopAt3(Observer):
    @on(OptimizerStepped)
    def stop(self, event, ctx):
        if event.step == 3:
            ctx.control.request_stop("test stop")
"""


def log_lines(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]


def test_a_stop_saves_first_and_skips_the_end_of_run_validation_and_samples(tmp_path, capsys):
    config = copy_examples(tmp_path, validation_and_samples=True)
    (tmp_path / "stop_observers.py").write_text(STOP_AT, encoding="utf-8")
    text = config.read_text().replace("[train]", '[observers]\nextra = ["stop_observers:StopAt3"]\n\n[train]')
    config.write_text(text, encoding="utf-8")
    code = main(["run", str(config), "--max-steps", "10", "--set", "observers.progress=false", "--allow-code"])
    assert code == 3
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert [p.name for p in (run_dir / "samples").glob("*.mp4")] == ["step_000000_00.mp4"]  # the baseline only
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "val/loss" in r] == [0]
    events = [x["event"] for x in log_lines(run_dir)]
    validations = [x for x in log_lines(run_dir) if x["event"] == "validation"]
    assert [x["step"] for x in validations] == [0]
    saved = events.index("lora_saved")
    assert events.index("validation skipped: stopping") < saved
    assert events.index("samples skipped: stopping") < saved
    assert (run_dir / "checkpoints" / "step_000003" / "complete.json").exists()
    err = capsys.readouterr().err
    resume = f"wantrain run {config} --set observers.progress=false --max-steps 10 --allow-code --resume auto"
    assert f"continue with: {resume}" in err  # the real config and overrides, not a literal CONFIG


def test_cache_keeps_other_configs_entries_and_prunes_only_on_request_saying_what_first(tmp_path, capsys):
    config = copy_examples(tmp_path)
    other = ["--set", "data.frames=[5]"]  # another config on the same data: shorter clips, other latents
    latents = tmp_path / "demo_data" / ".wantrain_cache" / "latents"
    assert main(["cache", str(config), *other]) == 0
    theirs = {p.name for p in latents.iterdir()}
    capsys.readouterr()
    assert main(["cache", str(config)]) == 0
    both = {p.name for p in latents.iterdir()}
    assert theirs < both  # nothing of the other config deleted
    out = capsys.readouterr().out
    unused = int(re.search(r"cache: (\d+) latents and 0 text embeddings \(.*\) in .* are not used by this config",
                           out).group(1))
    assert 0 < unused <= len(theirs)  # the images' latents are shared: the same in both configs
    assert f"`wantrain cache {config} --prune` deletes them" in out
    assert main(["cache", str(config), "--prune"]) == 0
    out = capsys.readouterr().out
    assert out.index(f"cache: removing {unused} latents") < out.index(f"cache: {unused} entries removed")
    assert len(list(latents.iterdir())) == len(both) - unused
    assert main(["cache", str(config)]) == 0  # everything this config uses is still there
    assert "0 latents and 0 text embeddings encoded" in capsys.readouterr().out


@pytest.mark.parametrize("override, expected", [
    ('model.path="does/not/exist"', "does/not/exist' is not a directory"),
    ('model.variant="t2v-a14b"', "model.path is required for t2v-a14b"),
])
def test_check_refuses_a_missing_model_as_run_does(tmp_path, capsys, override, expected):
    config = copy_examples(tmp_path)
    assert main(["check", str(config), "--set", override]) == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err
    assert main(["run", str(config), "--set", override]) == 2  # the same line from run
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


DOUBLE_CTRL_C = """
import os
import signal

from wantrain.core.events import OptimizerStepped
from wantrain.observers import Observer, on


class DoubleCtrlC(Observer):
    @on(OptimizerStepped)
    def press(self, event, ctx):
        if event.step == 3:
            os.kill(os.getpid(), signal.SIGINT)  # the first stops after this step
            os.kill(os.getpid(), signal.SIGINT)  # the second aborts at once
"""


def test_a_second_ctrl_c_aborts_with_code_130_logged_as_aborted(tmp_path, capsys):
    config = copy_examples(tmp_path)
    (tmp_path / "ctrl_c_observers.py").write_text(DOUBLE_CTRL_C, encoding="utf-8")
    text = config.read_text().replace("[train]", '[observers]\nextra = ["ctrl_c_observers:DoubleCtrlC"]\n\n[train]')
    config.write_text(text, encoding="utf-8")
    assert main(["run", str(config), "--max-steps", "10", "--set", "observers.progress=false",
                 "--allow-code"]) == 130
    (run_dir,) = (tmp_path / "runs").iterdir()
    ended = log_lines(run_dir)[-1]
    assert ended["event"] == "run_ended" and ended["status"] == "aborted"
    err = capsys.readouterr().err
    assert "wantrain run: aborted" in err and "Traceback" not in err
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


def test_inspect_lora_into_a_closed_pipe_stops_without_a_traceback(tmp_path):
    import os

    import prewarmed
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "lora.safetensors"
    save_file({f"diffusion_model.blocks.{i}.self_attn.q.{part}.weight": torch.zeros(4, 4)
               for i in range(40) for part in ("lora_A", "lora_B")}, str(path))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = prewarmed.Popen(["-m", "wantrain", "inspect-lora", str(path)], stdout=prewarmed.PIPE,
                           stderr=prewarmed.PIPE, env=env)
    proc.stdout.close()  # `| head` that has already gone: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_expert_switches_stay_in_log_jsonl_and_off_the_console(tmp_path, capsys):
    import structlog

    from wantrain.app.logs import close_log_file, configure_logging

    handler = configure_logging(tmp_path / "log.jsonl")
    log = structlog.get_logger("wantrain.run")
    log.info("expert_switched", step=11, previous="high_noise", expert="low_noise")
    log.info("run_started", total_steps=20)
    close_log_file(handler)
    err = capsys.readouterr().err
    assert "run_started" in err and "expert_switched" not in err
    assert [x["event"] for x in log_lines(tmp_path)] == ["expert_switched", "run_started"]


def test_importing_the_sampling_pipelines_logs_no_torchvision_notice(capfd):
    import subprocess
    import sys

    code = "from wantrain.models.wan22.architecture import wan_pipelines; wan_pipelines(); print('ok')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.strip() == "ok", done.stderr
    assert "torchvision" not in done.stderr and "CLIPImageProcessor" not in done.stderr
