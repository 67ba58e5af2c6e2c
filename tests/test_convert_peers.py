"""``wantrain convert`` over the peers' published Wan example files (tests/peer_files/, each naming its source and
the date it was read): no traceback, every key mapped or named in a line, each setting meaning what it meant."""

from __future__ import annotations

import math
import shutil
import tomllib
from pathlib import Path

import pytest
import yaml

from wantrain.app.config import load_config
from wantrain.app.convert import convert
from wantrain.app.convert_musubi import command_line
from wantrain.cli.main import main

PEERS = Path(__file__).parent / "peer_files"


def _toml_keys(path: Path) -> set[str]:
    data = tomllib.loads(path.read_text())
    keys = {f"[general] {k}" for k in data.get("general", {})}
    keys |= {f"[[datasets]][{i}] {k}" for i, t in enumerate(data.get("datasets", [])) for k in t}
    return keys | {k for k in data if k not in ("general", "datasets")}


def _yaml_keys(table: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in table.items():
        if key == "datasets":
            keys |= {f"datasets[{i}].{k}" for i, d in enumerate(value) for k in d}
        elif isinstance(value, dict):
            keys |= _yaml_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys


def peer_keys(path: Path) -> set[str]:
    """Every key the peer's file sets, named as ``wantrain convert`` names it in its lines."""
    if path.suffix == ".sh":
        return {f"--{k}" for k in command_line(path.read_text())}
    if path.suffix == ".yaml":
        doc = yaml.safe_load(path.read_text())
        return _yaml_keys(doc["config"]["process"][0]) | {"config.name", "job"} | (set(doc) - {"job", "config"})
    return _toml_keys(path)


def converted(tmp_path: Path, capsys, name: str, *extra: str) -> tuple[dict, str]:
    for f in PEERS.iterdir():
        shutil.copy(f, tmp_path / f.name)
    out = tmp_path / f"{name}.wantrain.toml"
    assert main(["convert", str(tmp_path / name), *extra, "-o", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and "check will refuse" not in err, err
    load_config(out)  # check's key validation passes
    return tomllib.loads(out.read_text()), err


@pytest.mark.parametrize("name", ["musubi_wan22_args.toml", "musubi_wan22_command.sh", "musubi_high_noise_args.toml",
                                  "musubi_dataset_video.toml", "musubi_dataset_image.toml",
                                  "aitoolkit_wan22_14b_24gb.yaml", "aitoolkit_wan21_14b_24gb.yaml"])
def test_every_key_of_a_peer_example_is_mapped_or_named_in_a_line(name):
    c = convert(PEERS / name)
    missing = peer_keys(PEERS / name) - c.seen
    assert not missing, f"dropped without a line: {sorted(missing)}"
    if name.startswith("musubi_wan22"):  # and the dataset TOML its dataset_config names
        assert _toml_keys(PEERS / "musubi_dataset_video.toml") <= c.seen


def test_musubi_training_arguments_keep_their_meaning(tmp_path, capsys):
    out, err = converted(tmp_path, capsys, "musubi_wan22_args.toml")
    # no network_alpha is alpha 1 in musubi-tuner, not wantrain's alpha = rank (32 times larger at rank 32)
    assert (out["lora"]["rank"], out["lora"]["alpha"]) == (32, 1.0)
    assert "written, the peer's default: lora.alpha = 1.0" in err
    assert out["model"]["variant"] == "t2v-a14b"
    assert out["model"]["low_noise_file"].endswith("low_noise_14B_fp16.safetensors")
    assert out["model"]["high_noise_file"].endswith("high_noise_14B_fp16.safetensors")
    assert out["model"].get("experts", "both") == "both"
    assert (out["lr_scheduler"]["type"], out["lr_scheduler"]["warmup_steps"]) == ("cosine", 100)
    assert (out["optimizer"]["type"], out["optimizer"]["lr"], out["optimizer"]["weight_decay"],
            out["optimizer"]["beta2"]) == ("adamw8bit", 2e-4, 0.01, 0.99)
    assert (out["model"]["timestep_sampling"], out["model"]["shift"]) == ("sigmoid", 3.0)
    assert (out["train"]["max_epochs"], out["train"]["save_every_epochs"], out["run"]["seed"]) == (16, 1, 42)
    assert out["model"]["text_encoder_file"].endswith(".pth") and out["sample"]["every"] == 1000


def test_musubi_command_line_as_its_docs_print_it_converts_like_its_toml(tmp_path, capsys):
    out, err = converted(tmp_path, capsys, "musubi_wan22_command.sh")
    assert (out["model"]["variant"], out["lora"]["rank"], out["lora"]["alpha"]) == ("t2v-a14b", 32, 1.0)
    assert (out["optimizer"]["type"], out["optimizer"]["lr"], out["model"]["shift"]) == ("adamw8bit", 2e-4, 3.0)
    assert "--num_cpu_threads_per_process = 1: left out (an accelerate option" in err
    assert len(out["data"]["datasets"]) == 2  # its --dataset_config read too


def test_musubi_width_by_height_stays_one_area_and_each_dataset_keeps_its_settings(tmp_path, capsys):
    out, err = converted(tmp_path, capsys, "musubi_dataset_video.toml")
    first, second = out["data"]["datasets"]
    side = first["resolutions"][0]
    assert abs(side * side - 960 * 544) / (960 * 544) < 0.005  # the pixel count kept, not the short side's
    assert (first["path"], first["frames"], first["clip_mode"], first["caption_extension"]) == (
        "/path/to/video_dir", [1, 25, 45], "head", ".txt")
    assert (second["path"], second["repeats"], second["frames"], second["clip_mode"]) == (
        "/path/to/video_dir2", 2, [45], "head")
    assert "repeats" not in first and "clip_mode" in first
    assert 'frame_extraction = "full" (max_frames = 45): written as clip_mode = "head" with frames = [45]' in err
    assert "data.cache_dir: the datasets give" in err  # one cache for the run: said, not dropped
    assert "aspect_ratios" not in out["data"]  # enable_bucket: wantrain's buckets


def test_musubi_without_buckets_trains_the_resolutions_shape(tmp_path, capsys):
    out, _ = converted(tmp_path, capsys, "musubi_dataset_image.toml")
    assert out["data"]["aspect_ratios"] == [round(960 / 544, 4)]
    assert out["data"]["resolutions"] == [round(math.sqrt(960 * 544))]


def test_a_high_noise_only_musubi_run_trains_only_that_expert(tmp_path, capsys):
    out, err = converted(tmp_path, capsys, "musubi_high_noise_args.toml")
    model = out["model"]
    assert model["experts"] == "high_noise" and "low_noise_file" not in model
    assert model["high_noise_file"].endswith("high_noise_14B_fp16.safetensors")
    assert (model["min_t"], model["max_t"]) == (0.9, 1.0)
    assert model["timestep_sampling"] == "uniform"  # musubi-tuner's default "sigma", written out
    assert "preserve_distribution_shape = true: left out" in err


def test_ai_toolkit_wan22_example_converts_with_its_variant_buckets_and_optimizer(tmp_path, capsys):
    out, err = converted(tmp_path, capsys, "aitoolkit_wan22_14b_24gb.yaml")
    assert out["model"]["variant"] == "t2v-a14b" and out["model"]["experts"] == "both"
    assert out["data"]["resolutions"] == [512, 768, 1024]
    assert (out["optimizer"]["type"], out["optimizer"]["lr"], out["optimizer"]["weight_decay"]) == (
        "adamw8bit", 1e-4, 1e-4)
    assert (out["lora"]["rank"], out["lora"]["alpha"], out["data"]["caption_extension"]) == (32, 32, ".txt")
    sample = out["sample"]
    assert (sample["width"], sample["height"], sample["fps"], sample["guidance_scale"], sample["steps"]) == (
        1024, 1024, 16, 3.5, 25)
    assert sample["enabled"] and len(sample["prompts"]) == 2
    assert out["model"]["timestep_sampling"] == "uniform"  # its timestep_type 'linear'
    assert 'model.qtype = "uint4|' in err and "caption_ext" not in err


def test_ai_toolkit_wan21_example_is_named_as_a_model_wantrain_does_not_train(tmp_path, capsys):
    for f in PEERS.iterdir():
        shutil.copy(f, tmp_path / f.name)
    assert main(["convert", str(tmp_path / "aitoolkit_wan21_14b_24gb.yaml")]) == 0
    captured = capsys.readouterr()
    assert 'model.arch = "wan21": not a Wan 2.2 model wantrain trains' in captured.err
    assert "check will refuse the output: config key 'model.variant' = 'wan21'" in captured.err
    assert tomllib.loads(captured.out)["sample"]["frames"] == 37  # 40 is not 4k+1: said in a line
    assert "sample.num_frames = 40: sample.frames = 37" in captured.err


@pytest.mark.parametrize("name, text, expected", [
    ("diffusion_pipe_wan.toml", None, "is a diffusion-pipe config (micro_batch_size_per_gpu, pipeline_stages"),
    ("diffusion_pipe_dataset.toml", None, "is a diffusion-pipe config ([[directory]] tables)"),
    ("diffusion_pipe_dataset.toml", None, "its keys go to: resolutions -> data.resolutions (the same area budgets), "
                                          "frame_buckets -> data.frames, directory.path -> data.path"),
    ("diffusion_pipe_wan.toml", None, "epochs -> train.max_epochs, micro_batch_size_per_gpu -> train.batch_size"),
    ("broken.toml", "network_dim = 32\nlearning_rate = ", "is not valid TOML"),
    ("broken.yaml", "job: extension\nconfig:\n  name: [unclosed\n", "is not valid YAML at line"),
    ("odd.yaml", "- just\n- a list\n", "not an ai-toolkit job"),
    ("odd_dataset.toml", "general = 3\ndatasets = 4\n", "this file's are not tables"),
])
def test_a_file_convert_cannot_read_is_refused_in_one_line(tmp_path, capsys, name, text, expected):
    path = tmp_path / name
    if text is None:
        shutil.copy(PEERS / name, path)
    else:
        path.write_text(text)
    assert main(["convert", str(path)]) == 2
    captured = capsys.readouterr()
    assert expected in captured.err and "Traceback" not in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""  # nothing copied through


ODD_VALUES = ("x", -1, 0, 1.5, True, [], [1, "a"], {"k": 1}, "1e-4")


def _replaced(doc, path: tuple, value):
    """``doc`` with the value at ``path`` (keys and list indices) replaced by ``value``."""
    if not path:
        return value
    head, *rest = path
    if isinstance(doc, dict):
        return {k: _replaced(v, tuple(rest), value) if k == head else v for k, v in doc.items()}
    return [_replaced(v, tuple(rest), value) if i == head else v for i, v in enumerate(doc)]


def _paths(doc, prefix: tuple = ()):
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        yield (*prefix, key)
        yield from _paths(value, (*prefix, key))


@pytest.mark.parametrize("name", ["musubi_wan22_args.toml", "musubi_dataset_video.toml",
                                  "aitoolkit_wan22_14b_24gb.yaml", "aitoolkit_wan21_14b_24gb.yaml"])
def test_any_value_of_any_key_of_a_peer_example_converts_or_is_refused_in_one_line(name, tmp_path):
    """Never a traceback: every key of the example set to each of a few values of the wrong kind converts (the
    output serialises) or is refused with a one-line UserError."""
    import tomli_w

    from wantrain.app import convert_aitoolkit, convert_musubi
    from wantrain.app.conversion import Conversion
    from wantrain.core.errors import UserError

    path = PEERS / name
    doc = yaml.safe_load(path.read_text()) if path.suffix == ".yaml" else tomllib.loads(path.read_text())
    for where in list(_paths(doc)):
        for value in ODD_VALUES:
            c = Conversion()
            try:
                odd = _replaced(doc, where, value)
                if path.suffix == ".yaml":
                    convert_aitoolkit.convert_yaml(odd, c)
                elif "datasets" in doc:
                    convert_musubi.dataset_tables(odd, c)
                else:
                    convert_musubi.training_arguments(odd, c, tmp_path, None, "")
                tomli_w.dumps(c.config())
            except UserError as exc:
                assert "\n" not in str(exc)
            except Exception as exc:
                raise AssertionError(f"{name}: {where} = {value!r}: {type(exc).__name__}: {exc}") from exc
