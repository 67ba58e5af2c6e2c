"""Data-parallel training under torchrun, end to end: two processes with gloo on the CPU train the tiny real Wan
model on the demo data (docs/distributed.md). Three launches share the filled cache: an uninterrupted run with an
out-of-memory error injected on rank 1 only, a run that rank 1 alone asks to stop, and its resume. A one-process
run with the same global batch is the reference: every rank draws its rows of the global batch's timesteps and
noise, so the runs agree to rounding."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import float32_bounds
import prewarmed
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from test_end_to_end import copy_examples

from wantrain.cli.main import main

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 12
OOM_STEP = 3
STOP_STEP = 6
SETTINGS = [
    f"train.max_steps={STEPS}", "train.log_every=2", "checkpoint.every=4", "observers.progress=false",
    "optimizer.lr=3e-3", "model.switch_every=4", f"faults.oom_at_steps=[{OOM_STEP}]",
]
LOSS_TOLERANCE = float32_bounds.LOSS
"""Relative tolerance of each logged loss against the one-process run with the same global batch: every rank draws
the global batch's timesteps and noise from the run seed and keeps its rows, so the two runs see the same samples
and draws; only the rounding of a batch of 1 against a batch of 2 differs (tests/float32_bounds.py derives the
bounds). Measured: at most 7.6e-8."""
GRAD_TOLERANCE = float32_bounds.GRAD
"""Of the first step's gradients (max |a - b| / max |b| over the tensors) against the one-process run's."""
LORA_DRIFT = float32_bounds.adamw_drift(float32_bounds.steps_of_one_expert(STEPS, 4), 3e-3)
"""The absolute bound on any element of the final LoRA against the one-process run's after the AdamW steps of the
expert that trains most (8 of the 12 at ``switch_every`` 4, lr 3e-3): 9.1e-6; measured 3.6e-7 on an Intel Xeon
(1.7e-6 of the largest element, the figure an AMD EPYC measured 1.15e-6 of and the first machine 7.2e-7)."""


def worst_relative(got: dict, expected: dict) -> float:
    """max over the tensors of max |got - expected| / max |expected| (the same names on both sides)."""
    assert sorted(got) == sorted(expected) and expected
    return max(float((got[k] - expected[k]).abs().max() / expected[k].abs().max()) if expected[k].abs().max() > 0
               else float(got[k].abs().max() > 0) for k in expected)  # a zero tensor (lora_A's first gradient)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_script(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node 2 tests/SCRIPT ARGS`` on 127.0.0.1, the ranks forked from the prewarmed server,
    with ``tests/`` importable (the FSDP and Ulysses twins)."""
    command = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), str(ROOT / "tests" / "prewarmed_relay.py"),
               str(ROOT / "tests" / script), *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "PREWARMED_SERVER": prewarmed.server()}
    return prewarmed.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("distributed")
    config = copy_examples(tmp)
    shutil.copy(ROOT / "tests" / "distributed_probe.py", tmp / "distributed_probe.py")
    assert main(["cache", str(config)]) == 0
    return tmp


def torchrun(workspace: Path, name: str, *extra: str, env: dict[str, str] | None = None,
             settings: list[str] = SETTINGS, nproc: int = 2) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node NPROC -m wantrain run`` on 127.0.0.1, runs under ``workspace/name``: torchrun and
    its ranks forked from the prewarmed server (``tests/prewarmed.py``, ``tests/prewarmed_relay.py``; the quickstart
    and two-node tests below launch ``torchrun -m wantrain`` itself)."""
    args = ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(ROOT / "tests" / "prewarmed_relay.py"),
            "-m", "wantrain", "run", str(workspace / "quickstart.toml"),
            "--set", f'run.output_dir="{workspace / name}"', "--set", "faults.oom_ranks=[1]",
            "--set", 'observers.extra=["distributed_probe:RankProbe"]', "--allow-code"]
    for item in settings:
        args += ["--set", item]
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "WANTRAIN_PROBE_DIR": str(workspace / f"{name}_probe"),
               "WANTRAIN_PROBE_WATCH": str(workspace / name), "PREWARMED_SERVER": prewarmed.server(), **(env or {})}
    return prewarmed.run(args + list(extra), cwd=workspace, env=environ, capture_output=True, text=True, timeout=600)


def probe(workspace: Path, name: str, rank: int) -> tuple[dict, dict]:
    folder = workspace / f"{name}_probe"
    return (json.loads((folder / f"rank{rank}.json").read_text()),
            load_file(str(folder / f"rank{rank}.safetensors")))


def only_run_dir(root: Path) -> Path:
    (run_dir,) = [d for d in root.iterdir() if d.is_dir()]
    return run_dir


def loras(run_dir: Path) -> dict[str, dict]:
    return {p.name: load_file(str(p)) for p in sorted(run_dir.glob("*.safetensors"))}


@pytest.fixture(scope="module")
def uninterrupted(workspace: Path) -> Path:
    done = torchrun(workspace, "full")
    assert done.returncode == 0, done.stderr[-3000:]
    return only_run_dir(workspace / "full")


def in_process_run(workspace: Path, name: str, *args: str) -> Path:
    """``wantrain run`` of the quickstart copy in this process, under ``workspace/name``, with the probe writing to
    ``workspace/name_probe`` (the final LoRA in fp32, the first step's gradients)."""
    command = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{workspace / name}"',
               "--set", 'observers.extra=["distributed_probe:RankProbe"]', "--allow-code", *args]
    os.environ["WANTRAIN_PROBE_DIR"] = str(workspace / f"{name}_probe")
    try:
        assert main(command) == 0
    finally:
        del os.environ["WANTRAIN_PROBE_DIR"]
    return only_run_dir(workspace / name)


@pytest.fixture(scope="module")
def one_process(workspace: Path) -> Path:
    """The same run in one process with the global batch (2 samples per step)."""
    return in_process_run(workspace, "single", "--set", "train.batch_size=2",
                          *[x for item in SETTINGS for x in ("--set", item)])


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_ranks_end_with_identical_lora_weights(workspace, uninterrupted):
    record0, weights0 = probe(workspace, "full", 0)
    record1, weights1 = probe(workspace, "full", 1)
    assert record0["status"] == record1["status"] == "completed"
    assert weights0.keys() == weights1.keys() and len(weights0) > 0
    for key, value in weights0.items():
        assert value.equal(weights1[key]), key
    # and they are what rank 0 wrote as the final LoRA checkpoint state
    assert any(not v.equal(0 * v) for v in weights0.values())


def test_only_rank_0_writes_the_run_directory(workspace, uninterrupted):
    record1, _ = probe(workspace, "full", 1)
    assert record1["writes"] == []  # rank 1 opened nothing for writing under the output folder
    assert [d.name for d in (workspace / "full").iterdir()] == [uninterrupted.name]  # one run directory
    lines = metrics(uninterrupted)
    assert [r["step"] for r in lines] == list(range(2, STEPS + 1, 2))  # one line per log step, not one per rank
    assert len(list((uninterrupted / "tensorboard").rglob("events.out.tfevents.*"))) == 1
    assert sorted(loras(uninterrupted)) == ["quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"]


def test_an_out_of_memory_error_on_rank_1_skips_the_step_on_both_ranks(workspace, uninterrupted):
    record0, _ = probe(workspace, "full", 0)
    record1, _ = probe(workspace, "full", 1)
    skipped0 = [(step, reason) for step, skipped, reason in record0["steps"] if skipped]
    skipped1 = [(step, reason) for step, skipped, reason in record1["steps"] if skipped]
    assert skipped0 == skipped1 == [(OOM_STEP, "out of memory")]
    assert record0["losses"] == record1["losses"]  # the reduced metrics are identical on both ranks
    log = [json.loads(line) for line in (uninterrupted / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log if r["event"] == "out_of_memory"] == []  # the error happened on rank 1 only
    assert metrics(uninterrupted)[-1]["train/skipped_steps"] == 1


def grads(workspace: Path, name: str, rank: int = 0) -> dict:
    return load_file(str(workspace / f"{name}_probe" / f"rank{rank}_grads.safetensors"))


def test_a_two_rank_run_equals_the_one_process_run_with_the_same_global_batch(workspace, uninterrupted,
                                                                                 one_process):
    """Two ranks of batch 1 and one process of batch 2, both experts, an out-of-memory error at step 3 (on rank 1
    alone in the two-rank run: rank 0 drew for that step and rewinds): the same samples and draws, so the same
    losses, the same first gradients and, after 11 AdamW steps, the same LoRA within the tolerances above."""
    two, one = metrics(uninterrupted), metrics(one_process)
    assert [r["step"] for r in two] == [r["step"] for r in one]
    # the interval holding the out-of-memory step is left out: rank 0 computed that step's loss before the step
    # was skipped and logs it (the losses computed are the ones logged), the one process did not reach it
    counted = [i for i, r in enumerate(one) if not r["step"] - 2 < OOM_STEP <= r["step"]]
    assert len(counted) == len(one) - 1
    assert [two[i]["train/loss"] for i in counted] == pytest.approx([one[i]["train/loss"] for i in counted],
                                                                     rel=LOSS_TOLERANCE)
    assert worst_relative(grads(workspace, "full"), grads(workspace, "single")) <= GRAD_TOLERANCE
    final = probe(workspace, "full", 0)[1]
    assert float32_bounds.largest_difference(final, probe(workspace, "single", 0)[1]) <= LORA_DRIFT
    assert metrics(uninterrupted)[-1]["train/skipped_steps"] == metrics(one_process)[-1]["train/skipped_steps"] == 1


def test_a_stop_on_rank_1_stops_both_and_the_resumed_run_equals_the_uninterrupted_one(workspace, uninterrupted):
    stopped = torchrun(workspace, "resumed", env={"WANTRAIN_PROBE_STOP_AT": str(STOP_STEP),
                                                  "WANTRAIN_PROBE_STOP_RANK": "1"})
    # rank 0 exits 3 (stopped); torchrun reports any non-zero code of a worker as its own exit code 1
    assert stopped.returncode == 1 and "wantrain: run stopped after 6 steps" in stopped.stderr, stopped.stderr[-3000:]
    assert "exitcode  : 3" in stopped.stderr
    record0, _ = probe(workspace, "resumed", 0)
    assert record0["status"] == "stopped" and record0["steps"][-1][0] == STOP_STEP  # rank 0 stopped with rank 1
    run_dir = only_run_dir(workspace / "resumed")
    assert (run_dir / "checkpoints" / f"step_{STOP_STEP:06d}" / "complete.json").exists()

    resumed = torchrun(workspace, "resumed", "--resume", "auto", env={"WANTRAIN_PROBE_DIR": str(workspace / "r2")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert only_run_dir(workspace / "resumed") == run_dir
    expected, got = loras(uninterrupted), loras(run_dir)
    assert sorted(expected) == sorted(got)
    for name, tensors in expected.items():
        for key, value in tensors.items():
            assert value.equal(got[name][key]), (name, key)
    losses = {r["step"]: r["train/loss"] for r in metrics(run_dir)}
    assert losses == {r["step"]: r["train/loss"] for r in metrics(uninterrupted)}


def test_a_compiled_two_rank_run_equals_the_eager_one(workspace, uninterrupted):
    """``model.compile`` under torchrun (dynamo's ``eager`` backend in each rank, tests/distributed_probe.py: the
    graphs, guards and breaks of the compiled blocks beside the process group; AOTAutograd's part is the one-process
    tests' in tests/test_compiled_runs.py, at half this launch's cost): the same losses and final LoRA weights as
    the eager two-rank run, the skipped step included, and 0 graph breaks."""
    done = torchrun(workspace, "compiled", "--set", 'model.compile="default"',
                    env={"WANTRAIN_PROBE_COMPILE_BACKEND": "eager"})
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        (record, weights), (eager, eager_weights) = probe(workspace, "compiled", rank), probe(workspace, "full", rank)
        assert record["compile"]["graph_breaks"] == 0 and record["compile"]["graphs"] >= 2, record["compile"]
        assert record["steps"] == eager["steps"] and record["losses"].keys() == eager["losses"].keys()
        for step, loss in eager["losses"].items():
            assert record["losses"][step] == pytest.approx(loss, rel=1e-5), step
        for key, value in eager_weights.items():
            assert torch.allclose(weights[key], value, rtol=1e-5, atol=1e-7), key


def test_resuming_with_another_number_of_processes_is_refused(workspace, uninterrupted, capsys):
    args = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{workspace / "full"}"',
            "--resume", str(only_run_dir(workspace / "full"))]  # completed: named on purpose
    for item in SETTINGS:
        args += ["--set", item]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "was written by 2 processes (torchrun, 2 ranks in all) and this run has 1" in err
    assert "Traceback" not in err


def test_the_lr_finder_sweeps_on_both_ranks_and_rank_0_writes_its_files(workspace):
    done = torchrun(workspace, "finder", "--lr-finder", "--lr-finder-steps", "8", "--set", "lr_finder.burn_in=2",
                    "--set", "faults.oom_at_steps=[]")
    assert done.returncode == 0, done.stderr[-3000:]
    # only rank 0 prints the summary (issue 29): one suggestion per expert, once; both ranks decide from the same
    # reduced losses (the probes' records below)
    lines = [line for line in done.stdout.splitlines() if "suggested LR" in line]  # (warnings may follow each)
    assert len(lines) == len(set(lines)) == 2, lines
    (run_dir,) = (workspace / "finder").iterdir()
    assert (run_dir / "lr_finder.csv").exists() and (run_dir / "lr_finder.json").exists()
    record1, _ = probe(workspace, "finder", 1)
    assert record1["writes"] == []
    record0, _ = probe(workspace, "finder", 0)
    assert record0["losses"] == record1["losses"] and len(record0["losses"]) == 16


# -- one expert per GPU (model.expert_groups = 2) ----------------------------------------------------------------------
GROUP_SETTINGS = ["train.max_steps=6", "train.log_every=2", "checkpoint.every=4", "observers.progress=false"]
"""The expert-group run and its two one-expert references: the same seed, data and schedule. Rank 0 (group 0)
draws as a one-process run of the high-noise expert and rank 1 (group 1) as one of the low-noise expert (the run
seed, the whole data stream: ``core.parallel.expert_groups``), so the LoRA files are compared byte for byte
(tolerance 0)."""


def one_expert_run(workspace: Path, expert: str) -> Path:
    args = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{workspace / expert}"',
            "--set", f'model.experts="{expert}"']
    for item in GROUP_SETTINGS:
        args += ["--set", item]
    assert main(args) == 0
    return only_run_dir(workspace / expert)


def test_one_expert_per_gpu_stops_resumes_and_equals_two_one_expert_runs(workspace):
    """Two ranks, one expert each: rank 1 (the low-noise group) asks to stop after step 4, both stop with a
    checkpoint; the resumed run's files equal those of two one-process runs of one expert each, bytes and losses."""
    settings = [*GROUP_SETTINGS, "model.expert_groups=2"]
    stopped = torchrun(workspace, "groups", settings=settings,
                       env={"WANTRAIN_PROBE_STOP_AT": "4", "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert stopped.returncode == 1 and "run stopped after 4 steps" in stopped.stderr, stopped.stderr[-3000:]
    run_dir = only_run_dir(workspace / "groups")
    assert (run_dir / "checkpoints" / "step_000004" / "complete.json").exists()
    resumed = torchrun(workspace, "groups", "--resume", "auto", settings=settings,
                       env={"WANTRAIN_PROBE_DIR": str(workspace / "groups_probe2")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for folder in ("groups_probe", "groups_probe2"):  # rank 1's expert reached rank 0, which wrote its file
        assert json.loads((workspace / folder / "rank1.json").read_text())["writes"] == []
    got = {p.name: p.read_bytes() for p in run_dir.glob("*.safetensors")}
    assert sorted(got) == ["quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"]
    lines = metrics(run_dir)
    for expert in ("high_noise", "low_noise"):
        reference = one_expert_run(workspace, expert)
        name = f"quickstart_{expert}.safetensors"
        assert got[name] == (reference / name).read_bytes(), expert
        # each group's logged loss is its one-expert run's, step for step
        assert [(r["step"], r[f"train/loss/{expert}"]) for r in lines] == \
            [(r["step"], r["train/loss"]) for r in metrics(reference)]
    started = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if '"run_started"' in x]
    assert started and all(x["experts"] == ["high_noise", "low_noise"] for x in started)


def test_expert_groups_in_one_process_are_refused_before_the_run_directory_exists(workspace, capsys):
    args = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{workspace / "alone"}"',
            "--set", "model.expert_groups=2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.expert_groups = 2 needs a torchrun launch of a multiple of 2 processes" in err, err
    assert "Traceback" not in err and not (workspace / "alone").exists()


def test_check_prints_which_ranks_train_which_expert(workspace, capsys):
    assert main(["check", str(workspace / "quickstart.toml"), "--set", "model.expert_groups=2", "--gpus", "4"]) == 0
    out = capsys.readouterr().out
    assert "high_noise: ranks 0..1 (group 0, 2 GPUs)" in out and "low_noise: ranks 2..3 (group 1, 2 GPUs)" in out
    assert "one expert per group of 2" in out  # the plan per GPU of that layout


# -- sharded base weights: model.parallel = "fsdp" (docs/distributed.md, issue 46) ------------------------------------
FSDP = ["--max-steps", "4", "--set", 'model.experts="high_noise"', "--set", "checkpoint.every=2",
        "--set", "faults.oom_at_steps=[]", "--set", 'lora.save_dtype="fp32"',
        "--set", "train.divergence_factor=100"]  # the guard on (it never trips here): train/lora_norm is logged
SHARDED = ["--set", 'model.parallel="fsdp"']
FSDP_LORA_DRIFT = float32_bounds.adamw_drift(4, 3e-3)
"""The absolute bound on the LoRA of the 4 high-noise steps below against one process of their global batch
(tests/float32_bounds.py): 4.6e-6."""
FSDP_TOLERANCE = 1e-6
"""Of each exported LoRA tensor, max |a - b| / max |b| (fp32) between the sharded and the data-parallel run with the
same draws: the gradients are reduce-scattered instead of all-reduced, and the norms summed from shards (measured:
0.0 on the tiny model, 2 ranks)."""


@pytest.fixture(scope="module")
def fsdp_runs(workspace: Path) -> dict[str, Path]:
    """Three launches of the same 4 steps on 2 ranks: data parallel (the reference), and FSDP stopped by rank 1
    after step 2 (a copy of that run directory is kept for the one-process resume) and resumed."""
    done = torchrun(workspace, "dp", *FSDP)
    assert done.returncode == 0, done.stderr[-3000:]
    stopped = torchrun(workspace, "fsdp", *FSDP, *SHARDED,
                       env={"WANTRAIN_PROBE_STOP_AT": "2", "WANTRAIN_PROBE_STOP_RANK": "1"})
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    run_dir = only_run_dir(workspace / "fsdp")
    copy = workspace / "fsdp_one" / run_dir.name
    shutil.copytree(run_dir, copy)
    resumed = torchrun(workspace, "fsdp", *FSDP, *SHARDED, "--resume", "auto",
                       env={"WANTRAIN_PROBE_DIR": str(workspace / "fsdp_resumed_probe")})
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return {"dp": only_run_dir(workspace / "dp"), "fsdp": run_dir, "stopped_copy": copy}


def test_an_fsdp_run_equals_the_data_parallel_run_with_the_same_draws_and_each_rank_holds_half(workspace,
                                                                                               fsdp_runs):
    sharded, reference = loras(fsdp_runs["fsdp"]), loras(fsdp_runs["dp"])
    assert sorted(sharded) == sorted(reference) == ["quickstart_high_noise.safetensors"]
    final = sharded["quickstart_high_noise.safetensors"]
    assert any(".lora_B." in k and final[k].abs().max() > 0 for k in final)  # it trained (B starts at zero)
    assert worst_relative(final, reference["quickstart_high_noise.safetensors"]) <= FSDP_TOLERANCE
    assert [r["train/loss"] for r in metrics(fsdp_runs["fsdp"])] == pytest.approx(
        [r["train/loss"] for r in metrics(fsdp_runs["dp"])], rel=FSDP_TOLERANCE)
    # the LoRA norm of a sharded run: its shards' norms reduced over the ranks, the whole LoRA's norm
    norms = [[r["train/lora_norm"] for r in metrics(fsdp_runs[k]) if "train/lora_norm" in r] for k in ("fsdp", "dp")]
    assert norms[0] and norms[0] == pytest.approx(norms[1], rel=FSDP_TOLERANCE)
    # the same file as data parallel's export (names, dtypes, metadata): what ComfyUI loads from either
    name = "quickstart_high_noise.safetensors"
    with safe_open(str(fsdp_runs["fsdp"] / name), "pt") as a, safe_open(str(fsdp_runs["dp"] / name), "pt") as b:
        assert a.metadata() == b.metadata()
    assert all(v.dtype == torch.float32 for v in final.values())
    # each rank held its own rows of every LoRA tensor, half of the bytes, and rank 1 wrote nothing
    shards = [load_file(str(workspace / "fsdp_resumed_probe" / f"rank{r}.safetensors")) for r in (0, 1)]
    whole = probe(workspace, "dp", 0)[1]  # data parallel: each rank's whole final LoRA
    assert sorted(shards[0]) == sorted(whole)
    for key, value in whole.items():
        assert torch.cat([shards[0][key], shards[1][key]]).equal(value), key
    held = [sum(t.numel() for t in s.values()) for s in shards]
    assert abs(held[0] - held[1]) <= 0.05 * sum(held), held
    assert probe(workspace, "fsdp", 1)[0]["writes"] == []


def test_an_fsdp_run_stopped_on_rank_1_resumes_bitwise(workspace, fsdp_runs):
    """The reference is the uninterrupted data-parallel run: on 2 ranks FSDP's reduce-scatter averages the two
    gradients exactly as the all-reduce does ((a + b) / 2, no other order), so the stopped and resumed sharded run
    must give its checkpoint and its LoRA bit for bit; any state the stop or the resume lost would show."""
    record0, _ = probe(workspace, "fsdp", 0)
    assert record0["status"] == "stopped" and record0["steps"][-1][0] == 2  # rank 0 stopped with rank 1
    step2 = [load_file(str(fsdp_runs[name] / "checkpoints" / "step_000002" / "tensors.safetensors"))
             for name in ("stopped_copy", "dp")]
    shared = [k for k in step2[1] if not k.startswith("ranks")]
    assert any("exp_avg" in k for k in shared) and sorted(shared) == sorted(
        k for k in step2[0] if not k.startswith("ranks"))
    for key in shared:
        assert step2[0][key].equal(step2[1][key]), key
    expected, got = loras(fsdp_runs["dp"]), loras(fsdp_runs["fsdp"])
    for name, tensors in expected.items():
        for key, value in tensors.items():
            assert value.equal(got[name][key]), (name, key)
    assert [r["train/loss"] for r in metrics(fsdp_runs["fsdp"])] == [r["train/loss"] for r in metrics(fsdp_runs["dp"])]


def test_fsdp_saves_gather_the_lora_and_adamw_state_to_rank_0_alone(workspace, fsdp_runs):
    """The stopped run's saves (LoRA file and checkpoint at step 2) and the resumed run's (step 4): rank 1 sends its
    rows to rank 0 and never makes a LoRA or AdamW tensor whole; its only whole tensors are the norms' scalars. Rank
    0's files are data parallel's bit for bit (the test above)."""
    smallest = min(t.numel() for t in loras(fsdp_runs["dp"])["quickstart_high_noise.safetensors"].values() if t.dim())
    for name in ("fsdp", "fsdp_resumed"):
        count, largest = probe(workspace, name, 1)[0]["whole"]
        assert count > 0 and largest == 1 < smallest, (name, count, largest, smallest)


def test_a_two_rank_fsdp_checkpoint_resumes_in_one_process_with_the_same_state(workspace, fsdp_runs, capsys):
    """One process resumes the 2-rank checkpoint of step 2 (the stop's) and ends at once (max_steps = 2): the
    LoRA, AdamW's moments and the counters it saves again are the ones the two ranks wrote, and the LoRA file it
    writes is theirs."""
    run_dir = fsdp_runs["stopped_copy"]
    before = load_file(str(run_dir / "checkpoints" / "step_000002" / "tensors.safetensors"))
    stopped_lora = load_file(str(run_dir / "quickstart_high_noise.safetensors"))  # the stop's save, at step 2
    args = ["run", str(workspace / "quickstart.toml"), "--set", f'run.output_dir="{run_dir.parent}"']
    for item in [*SETTINGS, "faults.oom_at_steps=[]"]:
        args += ["--set", item]
    assert main([*args, *FSDP, *SHARDED, "--max-steps", "2", "--resume", str(run_dir)]) == 0
    assert "resumes on fewer ranks" not in capsys.readouterr().err
    notes = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    assert any("written by 2 processes" in n.get("note", "") for n in notes if n["event"] == "config_warning")
    after = load_file(str(run_dir / "checkpoints" / "step_000002" / "tensors.safetensors"))
    shared = [k for k in before if not k.startswith("ranks")]
    assert any("exp_avg" in k for k in shared) and any("lora_B" in k for k in shared)
    for key in shared:
        assert before[key].equal(after[key]), key
    final = load_file(str(run_dir / "quickstart_high_noise.safetensors"))  # written again, by one process
    assert sorted(final) == sorted(stopped_lora) and all(final[k].equal(v) for k, v in stopped_lora.items())


def test_data_parallel_and_fsdp_two_rank_runs_equal_the_one_process_run_of_their_global_batch(workspace, fsdp_runs):
    """The 4 steps of the dp and fsdp launches above, in one process with their global batch of 2: the same
    losses, first gradients (fsdp: its two ranks' rows together) and final LoRA, within the tolerances of the
    first test of this file."""
    single = in_process_run(workspace, "fsdp_single", *[x for item in SETTINGS for x in ("--set", item)], *FSDP,
                            "--set", "train.batch_size=2")
    one = [r["train/loss"] for r in metrics(single)]
    reference = loras(single)["quickstart_high_noise.safetensors"]
    expected = grads(workspace, "fsdp_single")
    assert worst_relative(grads(workspace, "dp"), expected) <= GRAD_TOLERANCE
    shards = [grads(workspace, "fsdp", rank) for rank in (0, 1)]
    assert worst_relative({k: torch.cat([shards[0][k], shards[1][k]]) for k in shards[0]}, expected) <= GRAD_TOLERANCE
    for name in ("dp", "fsdp"):
        assert [r["train/loss"] for r in metrics(fsdp_runs[name])] == pytest.approx(one, rel=LOSS_TOLERANCE), name
        assert float32_bounds.largest_difference(loras(fsdp_runs[name])["quickstart_high_noise.safetensors"],
                                                 reference) <= FSDP_LORA_DRIFT, name
