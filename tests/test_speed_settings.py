"""model.attention and model.compile through the CLI: `check` prints the kernel and the compile plan (and its
JSON, what the run writes as preflight.json, carries them); a kernel or setting the machine cannot run is refused
by `check` and `run` in one line, exit 2, before anything is written."""

from __future__ import annotations

import json

import pytest
from test_end_to_end import copy_examples

from wantrain.cli.main import main
from wantrain.models.wan22 import attention


def test_check_prints_the_attention_kernel_and_the_compile_plan(tmp_path, capsys):
    config = copy_examples(tmp_path)
    report = tmp_path / "report.json"
    assert main(["check", str(config), "--set", 'model.compile="default"', "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert "attention: sdpa (PyTorch scaled_dot_product_attention" in out
    assert "compile: torch.compile mode 'default' of each of the 2 transformer blocks per expert" in out
    speed = json.loads(report.read_text())["speed"]
    assert speed["attention"] == "sdpa" and speed["attention_backend"] == "native"
    assert speed["compile"]["mode"] == "default" and speed["compile"]["cache_dir"].endswith("torch_compile")


REFUSED = {
    "sage": (['model.attention="sage"'], "model.attention = 'sage' cannot train: SageAttention has no backward"),
    "xformers missing": (['model.attention="xformers"'], "model.attention = 'xformers' needs the 'xformers' package"),
    "flash on a CPU": (['model.attention="flash"', 'train.device="cpu"'],
                       "model.attention = 'flash' runs on CUDA only"),
    "dynamic without compile": (["model.compile_dynamic=true"], "model.compile_dynamic applies to a compiled model"),
}


@pytest.mark.parametrize("command", ["check", "run"])
@pytest.mark.parametrize("name", REFUSED)
def test_a_kernel_or_compile_setting_the_machine_cannot_run_is_refused_before_anything_is_written(
        tmp_path, capsys, monkeypatch, command, name):
    sets, message = REFUSED[name]
    installed = name == "flash on a CPU"  # installed or not, the CPU refuses flash; xformers is "not installed"
    monkeypatch.setattr(attention, "_importable", lambda module: installed)
    config = copy_examples(tmp_path)
    code = main([command, str(config), *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert message in err and "Traceback" not in err
    # one line, or every problem found in the pass (xformers on a CPU: missing and CUDA-only; flash on the tiny
    # model's fp32: CUDA-only and its dtype), one line each under their count
    lines = err.splitlines()
    assert len(lines) == 1 or lines[0].endswith(f"{len(lines) - 1} problems in the config, all of them:"), err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
