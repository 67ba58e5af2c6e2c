"""End to end on the tiny Wan model and the demo data: the quickstart trains with every optimizer type that runs on
the CPU, a stopped run resumed with ``--resume auto`` ends bitwise like the uninterrupted one, and 8-bit AdamW on
CUDA (the GPU check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.test_end_to_end import copy_examples
from wantrain.cli.main import main

pytestmark = pytest.mark.slow

LR = {"prodigy": 1.0, "adafactor": 3e-3, "adamw_schedulefree": 3e-3, "adamw8bit": 3e-3, "adamw": 3e-3}
COMMON = ["--set", "observers.progress=false", "--set", "train.log_every=5", "--set", "observers.tensorboard=false",
          "--set", "train.save_every=1000"]


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Path:
    return copy_examples(tmp_path_factory.mktemp("optimizers"))  # one cache shared by every run of this module


def losses(run_dir: Path) -> list[float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in rows if "train/loss" in r]  # not the quickstart's val/-only line at step 0


@pytest.mark.parametrize("kind", ["adamw", "adamw8bit", "prodigy", "adafactor", "adamw_schedulefree"])
def test_the_quickstart_trains_with_every_cpu_optimizer_type(examples, kind):
    out = examples.parent / f"runs_{kind}"
    code = main(["run", str(examples), "--max-steps", "30", "--set", f"optimizer.type={kind}",
                 "--set", f"optimizer.lr={LR[kind]}", "--set", f"run.output_dir='{out}'", *COMMON])
    assert code == 0
    (run_dir,) = out.iterdir()
    values = losses(run_dir)
    assert sum(values[-2:]) < sum(values[:2]), values  # the loss falls
    for expert in ("high_noise", "low_noise"):
        assert (run_dir / f"quickstart_{expert}.safetensors").stat().st_size > 0


STOPPER = '''
from wantrain.core.bus import Observer, on
from wantrain.core.events import OptimizerStepped

class StopAtTen(Observer):
    @on(OptimizerStepped)
    def stop(self, event, ctx):
        if event.step == 10:
            ctx.control.request_stop("test stop at 10")
'''


def test_resume_auto_after_a_stop_ends_bitwise_like_the_uninterrupted_run(examples):
    kind = "adamw_schedulefree"  # the type whose saves change the parameters (eval/train); the others are covered
    # bitwise at the trainer level (test_optimizer_resume.py)
    (examples.parent / "stopper_module.py").write_text(STOPPER, encoding="utf-8")
    common = ["--max-steps", "20", "--set", f"optimizer.type={kind}", "--set", f"optimizer.lr={LR[kind]}",
              "--set", "checkpoint.every=5", *COMMON]
    full_out, part_out = examples.parent / f"full_{kind}", examples.parent / f"part_{kind}"
    assert main(["run", str(examples), "--set", f"run.output_dir='{full_out}'", *common]) == 0
    assert main(["run", str(examples), "--set", f"run.output_dir='{part_out}'",
                 "--set", "observers.extra=['stopper_module:StopAtTen']", "--allow-code", *common]) == 3  # stopped
    assert main(["run", str(examples), "--resume", "auto", "--set", f"run.output_dir='{part_out}'", *common]) == 0
    (full,), (part,) = full_out.iterdir(), part_out.iterdir()
    for expert in ("high_noise", "low_noise"):
        a = load_file(full / f"quickstart_{expert}.safetensors")
        b = load_file(part / f"quickstart_{expert}.safetensors")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert losses(full)[-2:] == losses(part)[-2:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_quickstart_trains_with_adamw8bit_on_cuda(examples):
    out = examples.parent / "runs_cuda_8bit"
    assert main(["run", str(examples), "--max-steps", "40", "--set", "optimizer.type=adamw8bit",
                 "--set", "optimizer.lr=3e-3", "--set", "train.device=cuda", "--set", f"run.output_dir='{out}'",
                 *COMMON]) == 0
    (run_dir,) = out.iterdir()
    values = losses(run_dir)
    assert sum(values[-2:]) < sum(values[:2]), values
