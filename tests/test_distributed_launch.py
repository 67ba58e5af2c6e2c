"""Launches of ``wantrain run`` by torchrun itself, as docs/distributed.md tells a user to (the other files of
tests/test_distributed*.py launch ranks through ``test_distributed.torchrun``): the quickstart with its validation
and samples on 2 ranks against one process, and the multi-node command with both "nodes" on localhost. Split from
tests/test_distributed.py to keep each file that launches ranks under a minute on 2 cores."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import prewarmed
import pytest
from test_distributed import ROOT, free_port, loras, metrics, only_run_dir
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow


def launcher(workspace: Path, *args: str) -> list[str]:
    """A torchrun command line (``args``: its options) running the quickstart copy in ``workspace``."""
    return [sys.executable, "-m", "torch.distributed.run", *args, "-m", "wantrain", "run",
            str(workspace / "quickstart.toml"), "--set", "observers.progress=false"]


def test_the_quickstart_runs_under_torchrun_with_its_validation_and_samples(tmp_path):
    """`torchrun --nproc_per_node 2 -m wantrain run examples/quickstart.toml`, shortened: one run directory with the
    val/ series and the samples; every rank's MetricsLogged has the same names; the step-0 validation (before any
    training, so the same model on both sides) equals a one-process run's up to the float64 sum's order."""
    config = copy_examples(tmp_path, validation_and_samples=True)
    shutil.copy(ROOT / "tests" / "distributed_probe.py", tmp_path / "distributed_probe.py")
    steps = ["--max-steps", "4"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANTRAIN_PROBE_DIR": str(tmp_path / "probe")}
    done = subprocess.run(
        launcher(tmp_path, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()))
        + steps + ["--set", 'observers.extra=["distributed_probe:RankProbe"]', "--allow-code"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    assert sorted(p.name for p in (run_dir / "samples").glob("*.mp4")) == ["step_000000_00.mp4",
                                                                           "step_000004_00.mp4"]
    lines = metrics(run_dir)
    val = {r["step"]: r for r in lines if "val/loss" in r}
    assert sorted(val) == [0, 4] and {"val/loss/high_noise", "val/loss/t_0.5"} <= set(val[4])
    record0, record1 = (json.loads((tmp_path / "probe" / f"rank{r}.json").read_text()) for r in (0, 1))
    assert record0["keys"] == record1["keys"] and len(record0["keys"]) >= 2
    logged = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    validations = [x for x in logged if x["event"] == "validation"]  # the set's size, not rank 0's share
    assert validations and all(x["clips"] == 4 and x["clips_this_rank"] == 2 for x in validations), validations

    assert main(["run", str(config), "--max-steps", "1", "--set", "sample.enabled=false",
                 "--set", f'run.output_dir="{tmp_path / "one"}"', "--set", "observers.progress=false"]) == 0
    one = {r["step"]: r for r in metrics(only_run_dir(tmp_path / "one")) if "val/loss" in r}
    for name, value in one[0].items():
        if name.startswith("val/"):
            assert val[0][name] == pytest.approx(value, rel=1e-12, abs=0), name


def test_two_torchrun_launchers_meet_through_a_c10d_rendezvous_as_two_nodes(tmp_path):
    """docs/distributed.md's multi-node command, both "machines" on localhost: two launchers of one process each
    (`--nnodes 2`, c10d rendezvous, gloo) train one run, of a DoRA (a non-LoRA type under torchrun: its magnitude
    vectors are trained and exported like the LoRA matrices)."""
    copy_examples(tmp_path)
    port = free_port()
    # the launchers and their workers fork from the prewarmed server (the rendezvous is what this test is about)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PREWARMED_SERVER": prewarmed.server()}
    command = ["-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
               "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "wantrain-test",
               str(ROOT / "tests" / "prewarmed_relay.py"), "-m", "wantrain", "run", str(tmp_path / "quickstart.toml"),
               "--set", "observers.progress=false", "--max-steps", "2", "--set", 'lora.type="dora"']
    nodes = [prewarmed.Popen(command, cwd=tmp_path, env=env, stdout=prewarmed.PIPE, stderr=prewarmed.PIPE,
                             text=True) for _ in range(2)]
    results = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, results, strict=True):
        assert node.returncode == 0, err[-3000:]
    run_dir = only_run_dir(tmp_path / "runs")
    assert [r["step"] for r in metrics(run_dir)][-1] == 2
    exported = loras(run_dir)
    assert sorted(exported) == ["quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"]
    for tensors in exported.values():
        assert any(k.endswith(".dora_scale") for k in tensors), sorted(tensors)[:4]
