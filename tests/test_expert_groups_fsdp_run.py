"""FSDP inside expert groups in ``wantrain run`` (``model.expert_groups = 2`` with ``model.parallel = "fsdp"``;
docs/distributed.md, "FSDP inside expert groups"): four gloo ranks launched by torchrun, forked from the prewarmed
server (``tests/test_distributed.py``'s ``torchrun``). Group 0 (ranks 0, 1) shards the tiny T2V twin's high-noise
expert over its two ranks, group 1 (ranks 2, 3) the low-noise one; each group loads from its leader."""

from __future__ import annotations

import pytest
from test_distributed import loras, metrics, only_run_dir, probe, torchrun, workspace  # noqa: F401  (the fixture)
from test_end_to_end import copy_examples

from wantrain.app.config import RunConfig
from wantrain.app.launch import check_parallel
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import UserError

SETTINGS = ["train.max_steps=4", "train.log_every=2", "checkpoint.every=2", "observers.progress=false",
            "optimizer.lr=3e-3", 'lora.save_dtype="fp32"', "faults.oom_at_steps=[]", 'model.parallel="fsdp"']
GROUPS = [*SETTINGS, "model.expert_groups=2"]
TOLERANCE = 0.0
"""Of each LoRA tensor against its two-rank one-expert FSDP run: a group's two ranks draw as that run's two ranks
(``core.parallel.expert_groups``) and FSDP2 reduce-scatters over a mesh of two in both, so the same operations in the
same order: the files are compared bit for bit (measured: equal)."""


BOTH = {"variant": "tiny-t2v", "parallel": "fsdp", "expert_groups": 2}


def test_fsdp_with_expert_groups_is_read_and_its_shard_degree_must_divide_a_group():
    cfg = structure(RunConfig, {"model": BOTH})
    assert cfg.model.parallel == "fsdp" and cfg.model.expert_groups == 2  # no longer refused when read
    assert check_parallel(cfg, 4) == []
    assert check_parallel(structure(RunConfig, {"model": {**BOTH, "shard_degree": 2}}), 8) == []  # HSDP in a group
    with pytest.raises(UserError, match=r"^model.shard_degree = 4 does not divide the 2 ranks of an expert group "
                                        r"\(4 ranks / model.expert_groups = 2\); use one of 1, 2 \(unset: all 2 of "
                                        r"the group\)$"):
        check_parallel(structure(RunConfig, {"model": {**BOTH, "shard_degree": 4}}), 4)
    with pytest.raises(UserError, match=r"^\[validation\] does not run with model.parallel = 'fsdp' inside "
                                        r"model.expert_groups = 2 yet"):
        check_parallel(structure(RunConfig, {"model": BOTH, "validation": {"enabled": True, "from_training": 2}}), 4)


def test_check_prints_which_ranks_load_and_shard_each_expert(tmp_path, capsys):
    config = copy_examples(tmp_path)
    layout = ["--set", "model.expert_groups=2", "--set", 'model.parallel="fsdp"', "--set", "model.shard_degree=2"]
    assert main(["check", str(config), *layout, "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    assert "high_noise: loaded on rank 0, sharded over ranks 0..1 and 2..3 (2 copies, replicated: HSDP)" in out
    assert "low_noise: loaded on rank 4, sharded over ranks 4..5 and 6..7" in out
    assert "8 GPUs, one expert per group of 4, FSDP over 2 x 2 replicas" in out and "trainable under torchrun" in out
    assert main(["check", str(config), *layout[:4], "--gpus", "4"]) == 0  # unset: the whole group of 2
    out = capsys.readouterr().out
    assert "low_noise: loaded on rank 2, sharded over ranks 2..3, each rank holding 1/2 of it" in out
    assert "4 GPUs, one expert per group of 2, FSDP over 2" in out
    assert main(["check", str(config), *layout[:4], "--set", "model.shard_degree=4", "--gpus", "4"]) == 2
    assert "does not divide the 2 ranks of an expert group" in capsys.readouterr().err


@pytest.fixture(scope="module")
def grouped(workspace):  # noqa: F811
    done = torchrun(workspace, "groups_fsdp", settings=GROUPS, nproc=4)
    assert done.returncode == 0, done.stderr[-3000:]
    return only_run_dir(workspace / "groups_fsdp")


@pytest.mark.slow
def test_four_ranks_sharding_each_expert_in_its_group_train_what_two_one_expert_fsdp_runs_train(
        workspace, grouped):  # noqa: F811
    got = loras(grouped)
    assert sorted(got) == ["quickstart_high_noise.safetensors", "quickstart_low_noise.safetensors"]
    lines = metrics(grouped)
    for expert in ("high_noise", "low_noise"):
        name = f"quickstart_{expert}.safetensors"
        done = torchrun(workspace, f"one_{expert}", settings=[*SETTINGS, f'model.experts="{expert}"'], nproc=2)
        assert done.returncode == 0, done.stderr[-3000:]
        reference = only_run_dir(workspace / f"one_{expert}")
        expected = loras(reference)[name]
        assert any(".lora_B." in k and v.abs().max() > 0 for k, v in expected.items())  # it trained
        assert sorted(got[name]) == sorted(expected)
        for key, value in expected.items():
            assert float((got[name][key] - value).abs().max()) <= TOLERANCE * float(value.abs().max()), (name, key)
        # each group's logged loss is its one-expert run's, step for step
        assert [(r["step"], r[f"train/loss/{expert}"]) for r in lines] == \
            [(r["step"], r["train/loss"]) for r in metrics(reference)]
        # the group's two ranks held the rows the reference's two ranks held: about half of the expert's LoRA each
        group = 2 * ("high_noise", "low_noise").index(expert)
        shards = [probe(workspace, "groups_fsdp", group + r)[1] for r in (0, 1)]
        for r in (0, 1):
            mine, theirs = shards[r], probe(workspace, f"one_{expert}", r)[1]
            assert sorted(mine) == sorted(theirs) and all(k.startswith(f"{expert}/") for k in mine)
            assert all(mine[k].equal(theirs[k]) for k in theirs), (expert, r)
        held = [sum(t.numel() for t in s.values()) for s in shards]
        assert abs(held[0] - held[1]) <= 0.05 * sum(held), held
    for rank in (1, 2, 3):  # the leader of group 1 (rank 2) sent its files to rank 0, which wrote them
        assert probe(workspace, "groups_fsdp", rank)[0]["writes"] == [], rank


@pytest.mark.slow
def test_a_stop_on_rank_3_resumes_at_the_same_world_size_bitwise(workspace, grouped):  # noqa: F811
    """Rank 3 (the low-noise group's second rank) asks to stop after step 2: every rank stops with the checkpoint
    of step 2; ``--resume auto`` on four ranks ends with the uninterrupted run's LoRA files, bit for bit."""
    stopped = torchrun(workspace, "groups_fsdp_resumed", settings=GROUPS, nproc=4,
                       env={"WANTRAIN_PROBE_STOP_AT": "2", "WANTRAIN_PROBE_STOP_RANK": "3"})
    assert stopped.returncode == 1 and "exitcode  : 3" in stopped.stderr, stopped.stderr[-3000:]
    run_dir = only_run_dir(workspace / "groups_fsdp_resumed")
    assert (run_dir / "checkpoints" / "step_000002" / "complete.json").exists()
    assert not (run_dir / "checkpoints" / "step_000004").exists()
    # on another number of ranks: refused in one line (each rank's group and data shard follow from the world size)
    other = torchrun(workspace, "groups_fsdp_resumed", "--resume", "auto", settings=GROUPS, nproc=2)
    refusal = [line for line in other.stderr.splitlines() if line.startswith("wantrain run: error:")]
    assert "exitcode  : 2" in other.stderr and len(set(refusal)) == 1, other.stderr[-3000:]  # each rank's one line
    assert "was written by 4 processes (torchrun, 4 ranks in all) and this run has 2" in refusal[0]
    assert "with model.expert_groups = 2 each rank's group and data follow from the number of ranks" in refusal[0]
    resumed = torchrun(workspace, "groups_fsdp_resumed", "--resume", "auto", settings=GROUPS, nproc=4)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    expected, got = loras(grouped), loras(run_dir)
    assert sorted(got) == sorted(expected)
    for name, tensors in expected.items():
        for key, value in tensors.items():
            assert value.equal(got[name][key]), (name, key)
    losses = [{k: v for k, v in r.items() if k.startswith("train/loss")} for r in metrics(grouped)]
    assert [{k: v for k, v in r.items() if k.startswith("train/loss")} for r in metrics(run_dir)] == losses
