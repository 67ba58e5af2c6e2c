"""``model.sequence_degree`` (Ulysses in ``wantrain run``, docs/distributed.md): what is refused, and when. Each
refusal is one line naming the key and what would work, before anything is written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_end_to_end import copy_examples

from wantrain.app.config import RunConfig
from wantrain.app.launch import check_parallel, check_sequence_buckets
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError, UserError

T2V = {"variant": "tiny-t2v", "sequence_degree": 2}


@pytest.mark.parametrize(("keys", "says"), [
    ({"model": {**T2V, "sequence_degree": 4}},
     "model.sequence_degree = 4 does not divide the 2 attention heads of tiny-t2v (Ulysses gives each GPU whole "
     "heads); use one of 1, 2"),
    ({"model": {**T2V, "expert_groups": 2}}, "does not work with model.expert_groups = 2 yet"),
])
def test_a_sequence_degree_is_refused_with_what_it_does_not_work_with_when_the_config_is_read(keys, says):
    with pytest.raises(ConfigError) as refused:
        structure(RunConfig, keys)
    assert says in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
    assert structure(RunConfig, {"model": T2V}).model.sequence_degree == 2  # alone: fine
    assert structure(RunConfig, {"model": {**T2V, "base_dtype": "nf4"}}).model.base_dtype == "nf4"  # low-bit codes too
    # with fsdp too (the sequence groups folded into the shard dimension); its other refusals still hold
    assert structure(RunConfig, {"model": {**T2V, "experts": "high_noise", "parallel": "fsdp"}}).model.parallel \
        == "fsdp"


def test_a_sequence_degree_must_divide_the_launch_and_evaluation_runs_with_it():
    cfg = structure(RunConfig, {"model": T2V})
    assert check_parallel(cfg, 2) == [] and check_parallel(cfg, 4) == []  # 4: two sequence groups, data parallel
    with pytest.raises(UserError, match=r"^model.sequence_degree = 2 splits each clip over 2 GPUs and needs a "
                                        r"torchrun launch of a multiple of 2 ranks \(this run is one process\)"):
        check_parallel(cfg, 1)
    with pytest.raises(UserError, match=r"^model.sequence_degree = 2 does not divide the 3 ranks of this launch"):
        check_parallel(cfg, 3)
    # the ranks of a sequence group evaluate together (tests/test_distributed_fsdp_evaluation.py runs it)
    for section, keys in (("validation", {"enabled": True, "from_training": 2}),
                          ("sample", {"enabled": True, "prompts": ["a cat"]})):
        assert check_parallel(structure(RunConfig, {"model": T2V, section: keys}), 2) == []


def test_a_bucket_whose_tokens_do_not_split_over_the_degree_is_refused_naming_it():
    cfg = structure(RunConfig, {"model": T2V})
    row = SimpleNamespace  # a preflight report's bucket row: width, height, frames
    check_sequence_buckets(cfg, [row(width=64, height=64, frames=9)])  # 3 x 4 x 4 = 48 tokens: 24 a GPU
    with pytest.raises(UserError, match=r"^bucket 48x48x9 has 27 tokens per clip, which model.sequence_degree = 2 "
                                        r"does not divide"):
        check_sequence_buckets(cfg, [row(width=64, height=64, frames=9), row(width=48, height=48, frames=9)])
    check_sequence_buckets(structure(RunConfig, {"model": {"variant": "tiny-t2v"}}), [row(width=48, height=48,
                                                                                           frames=9)])


def test_run_and_check_refuse_such_a_bucket_before_anything_is_written(tmp_path, capsys, monkeypatch):
    config = copy_examples(tmp_path)
    odd = ["--set", "model.sequence_degree=2", "--set", "data.resolutions=[48]"]  # 48x48: 3 x 3 tokens a frame
    assert main(["check", str(config), *odd]) == 2
    err = capsys.readouterr().err.strip()
    assert "has 9 tokens per clip, which model.sequence_degree = 2 does not divide" in err, err
    lines = err.splitlines()  # every bucket that does not divide, one line each (the 1-frame and the 9-frame one)
    assert lines[0].endswith("2 problems in the config, all of them:") and "Traceback" not in err, err
    assert [line.split()[2] for line in lines[1:]] == ["48x48x1", "48x48x9"], err
    monkeypatch.setenv("WORLD_SIZE", "2")  # rank 0 of a torchrun launch of 2: refused before the process group
    monkeypatch.setenv("RANK", "0")
    assert main(["run", str(config), *odd]) == 2
    err = capsys.readouterr().err.strip()
    assert "tokens per clip, which model.sequence_degree = 2 does not divide" in err and len(err.splitlines()) == 3
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "demo_data").rglob("*.safetensors"))  # nothing cached either


def test_check_plans_the_configs_sequence_degree_as_trainable(tmp_path, capsys):
    config = copy_examples(tmp_path)
    assert main(["check", str(config), "--gpus", "4", "--set", "model.sequence_degree=2",
                 "--set", "data.resolutions=[32]"]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs, Ulysses over 2" in out and "trainable under torchrun" in out, out[-2000:]


def test_check_plans_fsdp_with_a_sequence_degree_as_trainable_with_the_weights_over_every_gpu(tmp_path, capsys):
    """``check --gpus 4`` of fsdp with sequence degree 2: the weights sharded over all 4 GPUs (2 data-parallel x 2
    sequence), the activations over the 2 of a sequence group, and the layout trainable."""
    from wantrain.models.wan22.rank_plan import Layout, rank_estimate

    config = copy_examples(tmp_path)
    assert main(["check", str(config), "--gpus", "4", "--set", "model.sequence_degree=2", "--set",
                 'model.parallel="fsdp"', "--set", 'model.experts="high_noise"', "--set",
                 "data.resolutions=[32]"]) == 0
    out = capsys.readouterr().out
    assert "4 GPUs, FSDP over 4, Ulysses over 2, 2 data-parallel replicas" in out, out[-2000:]
    assert "trainable under torchrun" in out and "not yet trainable" not in out, out[-2000:]
    size = {"width": 832, "height": 480, "frames": 81, "rank": 32}
    both = rank_estimate("t2v-a14b", Layout(gpus=4, shard_degree=4, sequence_degree=2), **size).parts
    sequence = rank_estimate("t2v-a14b", Layout(gpus=4, sequence_degree=2), **size).parts
    sharded = rank_estimate("t2v-a14b", Layout(gpus=4, shard_degree=4), **size).parts
    assert both["weights (shard)"] == sharded["weights (shard)"] < sequence["weights (shard)"] / 3.9
    assert both["checkpointed inputs"] == sequence["checkpointed inputs"] == sharded["checkpointed inputs"] / 2


def test_a_bucket_whose_clips_reference_image_adds_a_latent_frame_the_degree_does_not_split_is_refused():
    """Found by the control-LoRA work: VACE prepends a reference image's latent frame, so 48x48x5 (2 latent frames
    of 3 x 3 tokens: 18, 9 a GPU) has 27 tokens with a ``.ref`` beside a clip; diffusers' split then failed
    mid-run. The same bucket without a reference is fine."""
    cfg = structure(RunConfig, {"model": {"variant": "tiny-vace-t2v", "sequence_degree": 2}})
    row = SimpleNamespace(width=48, height=48, frames=5)
    plain = SimpleNamespace(width=48, height=48, frames=5, controls={"control": "a.control.mp4"})
    referenced = SimpleNamespace(width=48, height=48, frames=5, controls={"ref": "a.ref.png"})
    check_sequence_buckets(cfg, [row], [plain])
    with pytest.raises(UserError, match=r"^bucket 48x48x5 has 27 tokens per clip with its clips' reference image, "
                                        r"which model.sequence_degree = 2 does not divide"):
        check_sequence_buckets(cfg, [row], [plain, referenced])
