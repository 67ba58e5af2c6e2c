"""The first hour, round 4 (issue 49), what was left: a peer's value for a wantrain key, a musubi-tuner prompt file,
the quickstart's pictures showing what the LoRA learned, a first line before the heavy imports, and console lines
with relative paths and readable numbers."""

from __future__ import annotations

import pytest

from tests.test_day_one_runs import workspace
from wantrain.cli.main import main

SHIFT_LINE = ('timestep_sampling = "shift" is musubi-tuner\'s; in wantrain it is model.timestep_sampling = "sigmoid", '
              "with model.sigmoid_scale = its sigmoid_scale (default 1.0) and model.shift = musubi-tuner's "
              "discrete_flow_shift")


@pytest.mark.parametrize("table", ["", "[train]\n", "[model]\n"])
def test_musubi_timestep_sampling_shift_is_named_as_sigmoid_with_model_shift_wherever_it_is_written(
        tmp_path, capsys, table):
    config = workspace(tmp_path)
    text = config.read_text()
    if table:
        assert table in text
        text = text.replace(table, f'{table}timestep_sampling = "shift"\n', 1)
    else:
        text = f'timestep_sampling = "shift"\n{text}'
    config.write_text(text)
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert SHIFT_LINE in err and "Traceback" not in err, err
    assert "belongs at" not in err  # not sent to model.timestep_sampling with a value it refuses
    assert main(["check", str(config), "--timestep_sampling", "shift"]) == 2  # musubi's command-line habit
    assert '--timestep_sampling shift is musubi-tuner\'s; wantrain\'s is --set model.timestep_sampling="sigmoid"' in (
        capsys.readouterr().err)


def test_every_peer_value_becomes_a_valid_wantrain_setting_and_is_in_config_md():
    import typing

    from tests.test_first_hour_round3 import schema_keys
    from wantrain.app.config import RunConfig
    from wantrain.app.migration import PEER_VALUES, table_markdown
    from wantrain.core.config import check_value

    keys = schema_keys(RunConfig)
    for key, values in PEER_VALUES.items():
        for value, spelled in values.items():
            for wkey, wvalue in spelled.becomes.items():
                assert wkey in keys and wkey.endswith(f".{key}")
                section, name = wkey.split(".")
                check_value(typing.get_type_hints(RunConfig)[section], name, wvalue, wkey)  # a value it accepts
            assert f'| `{key} = "{value}"` | {spelled.peer} |' in table_markdown()


STUB_TRAIN = """
import sys, types
stub = types.ModuleType("wantrain.app.train")
def train(*args, **kwargs):  # what `wantrain run` imports first that is heavy: was torch already loaded?
    print("torch imported before train:", "torch" in sys.modules, flush=True)
    raise SystemExit(0)
stub.train = train
sys.modules["wantrain.app.train"] = stub
from wantrain.cli.main import main
import wantrain.cli.run
print("torch imported with the CLI:", "torch" in sys.modules, flush=True)
main(["run", "examples/quickstart.toml"])
"""


def test_wantrain_run_prints_its_first_line_before_torch_is_imported():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", STUB_TRAIN], cwd=root, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    cli, first, loaded_torch, loaded, imported = done.stdout.splitlines()
    assert cli == "torch imported with the CLI: False"
    assert first == ("wantrain run: examples/quickstart.toml: loading torch and diffusers, then the model and the data "
                     "...")
    assert loaded_torch.startswith("wantrain run: torch 2.") and "loading diffusers" in loaded_torch  # a line a step
    assert loaded.startswith("wantrain run: libraries loaded (") and imported == "torch imported before train: True"


def test_console_lines_show_paths_under_the_working_directory_relative_and_floats_with_four_digits(
        tmp_path, monkeypatch, capsys):
    import json
    import logging
    from argparse import Namespace

    import structlog

    from wantrain.app.assemble import RunOutcome
    from wantrain.app.logs import close_log_file, configure_logging
    from wantrain.cli.run import summary

    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "runs" / "20260101_120000"
    handler = configure_logging(tmp_path / "log.jsonl")
    try:
        structlog.get_logger("wantrain.run").info("validation", loss=1.6088588058948516, run_dir=str(run_dir),
                                                  outside="/elsewhere/x", seconds=[8.774123, 0.5])
    finally:
        close_log_file(handler)
        logging.getLogger("wantrain").handlers.clear()
    err = capsys.readouterr().err
    assert "loss=1.609" in err and "run_dir=runs/20260101_120000" in err and "outside=/elsewhere/x" in err, err
    assert "1.6088588058948516" not in err and str(tmp_path) not in err
    kept = json.loads((tmp_path / "log.jsonl").read_text())
    assert (kept["loss"], kept["run_dir"]) == (1.6088588058948516, str(run_dir))  # the file keeps them whole
    outcome = RunOutcome("completed", None, 4, run_dir, (str(run_dir / "lora.safetensors"),),
                         str(run_dir / "checkpoints" / "step_000004"))
    _, lines = summary(outcome, Namespace(config="c.toml"))
    assert lines == ["wantrain: run completed after 4 steps; run directory: runs/20260101_120000",
                     "  runs/20260101_120000/lora.safetensors",
                     "  checkpoint: runs/20260101_120000/checkpoints/step_000004"]
    from wantrain.data.report import display_path

    assert display_path(tmp_path / "clips" / "a.mp4") == "clips/a.mp4"  # `check`'s dataset and file lines


MUSUBI_PROMPTS = """# prompt 1: a cat
A cat walks on the grass, realistic style. --w 832 --h 480 --f 81 --d 42 --s 20 --l 6.0 --n blurry, low quality --g 6.0

A dog runs on the beach. --w 480 --h 832 --f 30 --fs 5.0 --i first.png
"""


def test_convert_turns_a_musubi_prompt_file_into_sample_prompts_naming_each_option_it_could_not_map(tmp_path, capsys):
    import tomllib

    from wantrain.app.config import load_config

    (tmp_path / "prompts.txt").write_text(MUSUBI_PROMPTS)
    assert main(["convert", str(tmp_path / "prompts.txt"), "-o", str(tmp_path / "sample.toml")]) == 0
    err = capsys.readouterr().err
    for line in ("prompts.txt line 2: --g 6.0: left out (embedded guidance, which Wan ignores; its CFG scale is --l)",
                 "prompts.txt line 4: --f 30: frames = 29 (wantrain samples 4k+1 frames)",
                 "prompts.txt line 4: --fs 5.0: left out (wantrain samples with the variant's flow shift"):
        assert f"wantrain convert: not mapped: {line}" in err, err
    config = workspace(tmp_path)  # pasted into a run config, as its first line says: every value valid
    assert "[sample]" not in config.read_text()
    config.write_text(config.read_text() + "\n" + (tmp_path / "sample.toml").read_text())
    cfg = load_config(config)
    first, second = cfg.sample.prompts
    assert (first.prompt, first.width, first.height, first.frames, first.seed, first.steps, first.guidance_scale,
            first.negative_prompt) == ("A cat walks on the grass, realistic style.", 832, 480, 81, 42, 20, 6.0,
                                       "blurry, low quality")
    assert (second.prompt, second.frames, second.steps, second.image.name) == ("A dog runs on the beach.", 29, None,
                                                                               "first.png")
    assert (cfg.sample.enabled, cfg.sample.steps) == (True, 20)  # musubi-tuner's default for the line without --s

    (tmp_path / "args.toml").write_text('network_dim = 16\nsample_prompts = "prompts.txt"\n')
    assert main(["convert", str(tmp_path / "args.toml")]) == 0
    out = tomllib.loads(capsys.readouterr().out)
    assert [p["prompt"] for p in out["sample"]["prompts"]] == ["A cat walks on the grass, realistic style.",
                                                              "A dog runs on the beach."]



def test_a_replay_beside_the_run_does_not_join_the_runs_list_of_the_page(tmp_path, monkeypatch, capsys):
    """Finding 8's "replay directories join the runs list" did not reproduce on the code this was written for (the
    replay folder holds replay_config.toml, no config.toml or events.jsonl): this keeps it so."""
    from tests.test_replay_log import _events, _record
    from wantrain.app.serve.rundata import list_runs
    from wantrain.core.events.log import event_log_path

    runs = tmp_path / "runs"
    run = runs / "20260101_120000"
    run.mkdir(parents=True)
    (run / "config.toml").write_text("[observers]\ntensorboard = false\n")
    _record(event_log_path(run), _events(4))
    monkeypatch.chdir(tmp_path)
    assert main(["replay", "runs/20260101_120000", "--observers", "jsonl"]) == 0  # the default place: beside it
    err = capsys.readouterr().err
    (replayed,) = [p for p in runs.iterdir() if p != run]
    assert f"into runs/{replayed.name}\n" in err, err  # the console's path: relative to the working directory
    assert (replayed / "metrics.jsonl").is_file()
    assert [r.run_dir for r in list_runs(runs)] == [run]  # the page's and `wantrain serve`'s runs list


def test_a_musubi_prompt_file_given_as_sample_prompts_is_refused_with_the_command_that_converts_it(tmp_path, capsys):
    config = workspace(tmp_path)
    config.write_text(config.read_text() + '\n[sample]\nenabled = true\nprompts = "prompts.txt"\n')
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert ("config key 'sample.prompts' = 'prompts.txt' has the wrong type; expected a list; a musubi-tuner prompt "
            "file? `wantrain convert prompts.txt` writes its prompts as the [sample] table to paste here") in err, err
