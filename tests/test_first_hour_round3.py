"""The first hour, round 3 (issue 39): no expert exported untrained without a word, `--max-steps` shortening an
epoch config, a peer trainer's config or a folder given as the config, and the rough edges a new user met."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_day_one_runs import workspace
from wantrain.cli.main import main

EPOCHS = {"max_steps = 8\n": "max_epochs = 1\n", "switch_every = 2\n": "switch_every = 10\n"}


def epoch_config(tmp_path: Path) -> Path:
    """6 images, batch 2: one epoch is 3 optimizer steps, shorter than switch_every = 10."""
    config = workspace(tmp_path)
    text = config.read_text()
    for old, new in EPOCHS.items():
        assert old in text
        text = text.replace(old, new)
    config.write_text(text)
    return config


def test_an_epoch_run_that_would_leave_an_expert_untrained_is_refused_by_check_and_run(tmp_path, capsys):
    config = epoch_config(tmp_path)
    for command in ("check", "run"):
        assert main([command, str(config)]) == 2
        err = capsys.readouterr().err
        assert ("train.max_epochs = 1 is 3 optimizer steps with model.switch_every = 10: the low_noise expert gets no "
                "optimizer step") in err, err
        assert "model.switch_every <= 1" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()
    assert main(["check", str(config), "--set", "model.switch_every=1"]) == 0  # each expert gets steps
    assert "warning:" not in capsys.readouterr().out


def test_max_steps_shortens_an_epoch_config_and_an_untrained_expert_is_named_in_one_line(tmp_path, capsys):
    config = epoch_config(tmp_path)
    assert main(["check", str(config), "--set", "train.max_steps=2"]) == 0
    out = capsys.readouterr().out
    warning = ("warning: train.max_steps = 2 with model.switch_every = 10: the low_noise expert gets no optimizer "
               "step and its LoRA would be saved untrained (all-zero)")
    assert warning in out
    assert main(["run", str(config), "--max-steps", "2"]) == 0  # no "both are set": the smoke run replaces epochs
    (run_dir,) = (tmp_path / "runs").iterdir()
    logged = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    notes = [x["note"] for x in logged if x["event"] == "config_warning"]
    assert len(notes) == 1 and "the low_noise expert gets no optimizer step" in notes[0]
    assert [x["step"] for x in logged if x["event"] == "run_ended"] == [2]
    kept = (run_dir / "config.toml").read_text()
    assert "max_steps = 2" in kept and "max_epochs" not in kept  # what this run trained, for a resume


@pytest.mark.parametrize("value", ['"/proc/wantrain_cache"', '"a_file"'])
def test_a_cache_dir_that_cannot_be_written_is_one_line_from_check_cache_and_run(tmp_path, capsys, value,
                                                                                 monkeypatch):
    config = workspace(tmp_path)
    monkeypatch.chdir(tmp_path)  # a --set path is the shell's: relative to the current directory (issue 59)
    (tmp_path / "a_file").write_text("not a folder")
    for command in ("check", "cache", "run"):
        assert main([command, str(config), "--set", f"data.cache_dir={value}"]) == 2
        err = capsys.readouterr().err
        assert "data.cache_dir '" in err and "cannot be written" in err and "Traceback" not in err, err
        assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


# -- coming from musubi-tuner or ai-toolkit -----------------------------------------------------------------------
MUSUBI_DATASET = """
[general]
resolution = [960, 544]
caption_extension = ".txt"
batch_size = 1
enable_bucket = true

[[datasets]]
video_directory = "/data/clips"
cache_directory = "/data/cache"
target_frames = [1, 25, 45]
frame_extraction = "head"
num_repeats = 2
"""

MUSUBI_ARGS = """
network_dim = 32
network_alpha = 16
learning_rate = 2e-4
max_train_steps = 1000
"""

AI_TOOLKIT = """
job: extension
config:
  name: "my_lora"
  process:
    - type: 'sd_trainer'
      trigger_word: "p3r5on"
      network:
        type: "lora"
        linear: 32
        linear_alpha: 32
      datasets:
        - folder_path: "/path/to/clips"
          shuffle_tokens: false
"""


@pytest.mark.parametrize("name, text, expected", [
    ("dataset.toml", MUSUBI_DATASET, ['is a musubi-tuner dataset config ([general], [[datasets]])',
                                      'put [data] path = "/data/clips"', "target_frames -> data.frames",
                                      "num_repeats -> data.repeats", "cache_directory -> data.cache_dir"]),
    ("args.toml", MUSUBI_ARGS, ["holds musubi-tuner training arguments", "network_dim -> lora.rank",
                                "learning_rate -> optimizer.lr", "max_train_steps -> train.max_steps"]),
    ("train.yaml", AI_TOOLKIT, ["is an ai-toolkit config (job/config/process, YAML)", "trigger_word -> "
                                "data.caption_prefix", "linear -> lora.rank", "folder_path -> data.path"]),
])
def test_a_peer_trainers_config_given_as_the_config_says_where_its_keys_go(tmp_path, capsys, name, text, expected):
    config = tmp_path / name
    config.write_text(text)
    assert main(["check", str(config)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "docs/config.md" in err, err
    for part in expected:
        assert part in err, (part, err)


def test_a_folder_given_as_the_config_says_it_is_a_folder_and_what_to_do(tmp_path, capsys):
    (tmp_path / "myclips").mkdir()
    assert main(["run", str(tmp_path / "myclips")]) == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path / 'myclips'}' is a folder, not a config file" in err
    assert f'copy examples/quickstart.toml, set [data] path = "{tmp_path / "myclips"}"' in err
    assert "does not exist" not in err


@pytest.mark.parametrize("key, value, wantrain_key", [
    ("lora.network_dim", "32", "lora.rank"), ("lora.network_alpha", "16", "lora.alpha"),
    ("lora.network_weights", '"x.safetensors"', "lora.init_from"),
    ("data.trigger_word", '"ohwx"', "data.caption_prefix"), ("data.video_jsonl_file", '"a.jsonl"', "data.metadata"),
    ("train.gradient_accumulation_steps", "4", "train.grad_accum"),
    ("optimizer.learning_rate", "1e-4", "optimizer.lr"), ("train.max_train_steps", "10", "train.max_steps"),
    ("data.shuffle_tokens", "true", "data.tag_shuffles"),
])
def test_a_key_from_another_trainer_gets_the_wantrain_key_that_does_the_same(tmp_path, capsys, key, value,
                                                                              wantrain_key):
    config = workspace(tmp_path)
    assert main(["check", str(config), "--set", f"{key}={value}"]) == 2
    err = capsys.readouterr().err
    assert f"unknown config key '{key}': '{key.split('.')[-1]}' is " in err
    assert f"wantrain's key for it is '{wantrain_key}'" in err, err
    assert "'data.shuffle'" not in err  # shuffling batches is another thing


def schema_keys(cls, prefix: str = "") -> set[str]:
    import typing

    import attrs

    out = set()
    hints = typing.get_type_hints(cls)
    for f in attrs.fields(cls):
        out.add(prefix + f.name)
        tp = hints[f.name]
        for inner in (tp, *typing.get_args(tp), *(a for t in typing.get_args(tp) for a in typing.get_args(t))):
            if isinstance(inner, type) and attrs.has(inner):
                out |= schema_keys(inner, f"{prefix}{f.name}.")
    return out


def test_every_wantrain_key_of_the_migration_table_exists_and_the_table_is_in_config_md():
    from wantrain.app.config import RunConfig
    from wantrain.app.migration import PEER_KEYS

    keys = schema_keys(RunConfig)
    assert "data.datasets.path" in keys and "lora.alpha_schedule.enabled" in keys  # the walk reaches nested tables
    missing = {peer: e.wantrain for peer, e in PEER_KEYS.items() if e.wantrain not in keys}
    assert not missing
    assert not {peer for peer, e in PEER_KEYS.items() if peer == e.wantrain.rsplit(".", 1)[-1]}  # a real rename
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    assert "## Coming from musubi-tuner or ai-toolkit" in text
    for peer, e in PEER_KEYS.items():
        assert f"| `{peer}` | {e.peer} | `{e.wantrain}` |" in text


# -- the rough edges -----------------------------------------------------------------------------------------------
def test_the_run_log_names_no_expert_for_ti2v_and_marks_a_replayed_save_as_the_recorded_runs(tmp_path):
    from structlog.testing import capture_logs

    from wantrain.core.bus import Bus
    from wantrain.core.context import Context, DeviceMetrics, Live
    from wantrain.core.control import Control
    from wantrain.core.events import CheckpointSaved, RunStarted
    from wantrain.core.state import TrainState
    from wantrain.observers.run_log import RunLog

    def logged(adapter, experts):
        bus = Bus(Context(control=Control(), state=TrainState(), metrics=DeviceMetrics(), live=Live(),
                          run_dir=tmp_path, adapter=adapter))
        bus.attach(RunLog())
        with capture_logs() as logs:
            bus.emit(RunStarted(step=0, run_dir=str(tmp_path), total_steps=4, grad_accum=1, experts=experts,
                                log_every=1))
            bus.emit(CheckpointSaved(step=4, paths=("/runs/a/lora.safetensors",), final=True, reason="end"))
        return logs

    live = logged(object(), (None,))
    assert "experts" not in live[0] and "single" not in str(live)  # TI2V-5B: one transformer, no experts
    assert live[1]["event"] == "lora_saved"
    assert logged(object(), ("high_noise", "low_noise"))[0]["experts"] == ["high_noise", "low_noise"]
    replayed = logged(None, (None,))  # wantrain replay: no live model; the files are the recorded run's
    assert replayed[1]["event"] == "recorded_lora_saved" and replayed[1]["paths"] == ["/runs/a/lora.safetensors"]


def test_inspect_lora_on_a_checkpoint_says_it_is_one_and_names_the_lora_files(tmp_path, capsys):
    import torch
    from safetensors.torch import save_file

    run_dir = tmp_path / "run"
    checkpoint = run_dir / "checkpoints" / "step_000004"
    checkpoint.mkdir(parents=True)
    save_file({"generator": torch.zeros(4, dtype=torch.uint8)}, checkpoint / "tensors.safetensors")
    (checkpoint / "state.json").write_text("{}")
    save_file({"x": torch.zeros(1)}, run_dir / "t_high_noise.safetensors")
    for target in (checkpoint / "tensors.safetensors", checkpoint):
        assert main(["inspect-lora", str(target)]) == 2
        err = capsys.readouterr().err
        assert f"'{target}' is a resumable checkpoint" in err and "not a LoRA file" in err
        assert f"inspect one of the run's LoRA files: {run_dir / 't_high_noise.safetensors'}" in err
        assert "generator" not in err


def test_a_pth_that_holds_code_is_refused_without_torchs_advice_to_run_it(tmp_path):
    import torch

    from wantrain.core.errors import UserError
    from wantrain.models.wan22.vae_file import check_vae_file

    file = tmp_path / "Wan2.1_VAE.pth"
    torch.save({"x": object()}, file)
    with pytest.raises(UserError) as caught:
        check_vae_file(file, latent_channels=16)
    message = str(caught.value)
    assert message.startswith(f"model.vae_file '{file}' is not a readable weights file (it holds Python objects")
    assert "use a .safetensors file" in message
    assert "weights_only" not in message and "trust" not in message and "\x1b" not in message


def test_the_progress_line_names_the_alpha_phase(tmp_path):
    import io

    from tests.observers.test_alpha_runs import BASE, SCHEDULE
    from wantrain.app.config import load_config
    from wantrain.app.observers import build_observers
    from wantrain.core.events import MetricsLogged
    from wantrain.observers.progress import ProgressLine

    config = tmp_path / "run.toml"
    config.write_text(BASE.format(steps=30).replace("progress = false", "progress = true")
                      + SCHEDULE.format(enabled="true"))
    (tmp_path / "demo_data").mkdir()
    (line,) = [o for o in build_observers(load_config(config), tmp_path) if isinstance(o, ProgressLine)]
    line._stream = io.StringIO()
    line.on_metrics_logged(MetricsLogged(step=15, expert="high_noise", values={"alpha/phase": 1.0}, elapsed_s=1.0,
                                         total_steps=30), None)
    assert "alpha phase 1 (balance)" in line.render()


def test_skipped_files_are_warned_once_by_kind_with_validation_from_the_training_clips(tmp_path):
    import shutil

    from structlog.testing import capture_logs

    from wantrain.app.config import load_config
    from wantrain.app.preflight import dataset
    from wantrain.app.run_plan import build_validation_data
    from wantrain.models.wan22.variants import variant_spec

    demo = Path(__file__).resolve().parents[1] / "examples" / "demo_data"
    data = tmp_path / "data"
    data.mkdir()
    for name in ("clip_000", "clip_001"):
        for suffix in (".mp4", ".txt"):
            shutil.copy(demo / f"{name}{suffix}", data / f"{name}{suffix}")
    (data / "list.jsonl").write_text('{"video": "clip_000.mp4", "caption": "a"}\n{"video": "gone.mp4", '
                                     '"caption": "b"}\nnot json\n')
    config = tmp_path / "run.toml"
    config.write_text('[model]\nvariant = "tiny-i2v"\n[data]\nmetadata = "data/list.jsonl"\nframes = [5]\n'
                      'resolutions = [32]\n[validation]\nenabled = true\nfrom_training = 1\n')
    cfg = load_config(config)
    with capture_logs() as logs:
        dataset(cfg)
        build_validation_data(cfg, variant_spec("tiny-i2v"), 0)
    warned = [x for x in logs if x["event"] == "data.files_skipped"]
    assert len(warned) == 1, warned  # the validation clips come from the training data: counted once
    assert warned[0]["count"] == 2
    assert warned[0]["reasons"] == {"does not exist": 1, "not a JSON object": 1}  # no 'line 2', no path


def test_the_report_shows_flat_memory_below_the_top_edge_and_one_legend_beside_the_loss_panel(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from tests.observers.test_report import write_metrics
    from wantrain.app import report as dashboard

    write_metrics(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    with_alpha = []
    for line in lines[:-1]:
        record = json.loads(line)
        record["alpha/linear_alpha/high_noise"] = 4.0 + record["alpha/phase"] * 3
        record["alpha/linear_alpha/low_noise"] = 4.0 + record["alpha/phase"] * 3
        with_alpha.append(json.dumps(record))
    (tmp_path / "metrics.jsonl").write_text("\n".join(with_alpha) + "\n")
    _, records = dashboard.load_records(tmp_path)
    fig = dashboard.build_report(records)
    FigureCanvasAgg(fig).draw()
    memory = fig.axes[4]
    top = max(v for line in memory.get_lines() for v in line.get_ydata())
    assert memory.get_ylim()[1] >= 1.1 * top  # the flat 4.5 GiB line is inside the frame, not on it
    loss, twin = fig.axes[0], dashboard.alpha_axis(fig)
    legends = [ax.get_legend() for ax in (loss, twin) if ax.get_legend() is not None]
    assert len(legends) == 1
    labels = [t.get_text() for t in legends[0].get_texts()]
    assert {"high_noise (EMA 0.9)", "alpha phase 1", "alpha high_noise", "alpha low_noise"} <= set(labels)
    box, panel = legends[0].get_window_extent(), loss.get_window_extent()
    assert box.x0 >= panel.x1  # beside the panel: it covers no curve


# -- the docs a newcomer reads -------------------------------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_lists_every_docs_page_and_says_how_to_run_under_torchrun():
    readme = (ROOT / "README.md").read_text()
    listed = readme[readme.index("## Documentation"):]
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if f"(docs/{p.name})" not in listed]
    assert not missing
    assert "torchrun --nproc_per_node N -m wantrain run CONFIG" in listed


def test_data_md_names_every_key_a_dataset_table_may_set():
    import attrs

    from wantrain.data.config import DatasetConfig

    text = (ROOT / "docs" / "data.md").read_text()
    paragraph = text[text.index("Several folders (the full form)"):].split("```")[0]
    missing = [f.name for f in attrs.fields(DatasetConfig) if f"`{f.name}`" not in paragraph]
    assert not missing


def test_the_wandb_key_points_to_the_page_that_documents_it_and_benchmarks_count_no_tests():
    config = (ROOT / "docs" / "config.md").read_text()
    (row,) = [line for line in config.splitlines() if line.startswith("| `wandb` |")]
    assert "docs/metrics.md" in row and "## Weights & Biases" in (ROOT / "docs" / "metrics.md").read_text()
    import re

    assert not re.search(r"\d+ passed", (ROOT / "docs" / "benchmarks.md").read_text())  # a count goes stale


def test_the_t2v_example_states_the_memory_estimate_and_how_a_24_gb_card_fits():
    from wantrain.models.wan22.memory import MemorySettings, estimate

    header = "".join(line for line in (ROOT / "examples" / "t2v_a14b.toml").read_text().splitlines(True)
                     if line.startswith("#"))
    size = dict(width=832, height=480, frames=81, rank=32, batch=1, gradient_checkpointing=True)
    fp8 = estimate("t2v-a14b", MemorySettings("fp8", 0, False), **size).device_gib
    swapped = estimate("t2v-a14b", MemorySettings("bf16", 40, True), **size).device_gib
    assert f"~{fp8:.0f} GiB with base_dtype = \"fp8\"" in header
    assert f"~{swapped:.1f} GiB" in header and swapped < 24
    assert "blocks_to_swap" in header and "vram_budget_gb" in header
