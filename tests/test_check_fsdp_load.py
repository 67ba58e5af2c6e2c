"""``wantrain check --gpus N`` under ``model.parallel = "fsdp"`` prints the load's peak (``rank_plan.load_peak``):
each GPU's shards and one tensor whole, and rank 0's host copy of the expert (docs/distributed.md, "Sharded base
weights"). At real size without weights: the plan is printed before the missing files are refused."""

from __future__ import annotations

from test_end_to_end import copy_examples

from wantrain.cli.main import main

A14B_FSDP = ['model.variant="t2v-a14b"', 'model.path="/nonexistent"', 'model.experts="high_noise"',
             'model.parallel="fsdp"', "lora.rank=32", "validation.enabled=false", "sample.enabled=false"]


def test_check_prints_the_load_peak_per_gpu_and_rank_0s_host_under_fsdp(tmp_path, capsys):
    config = copy_examples(tmp_path)
    settings = [arg for item in A14B_FSDP for arg in ("--set", item)]
    assert main(["check", str(config), "--gpus", "8", *settings]) == 2  # no weights: refused after the plan
    out = capsys.readouterr().out
    assert ("load (FSDP over 8, from rank 0): 3.70 GiB per GPU at its peak (a whole expert: 27.24 GiB), rank 0's "
            "host 27.24 GiB") in out, out[-2000:]
    assert main(["check", str(config), "--gpus", "2", *settings]) == 2
    assert "load (FSDP over 2, from rank 0): 13.92 GiB per GPU" in capsys.readouterr().out
    data_parallel = [arg for item in A14B_FSDP if "parallel" not in item for arg in ("--set", item)]
    assert main(["check", str(config), "--gpus", "8", *data_parallel]) == 2  # nothing sharded, no load line
    assert "load (FSDP" not in capsys.readouterr().out
    # planned: FSDP inside expert groups, each group loading its expert from its first rank
    assert main(["check", str(config), "--gpus", "8", "--expert-groups", "2", "--shard-degree", "4",
                 *data_parallel]) == 2
    assert ("load (FSDP over 4, from each group's first rank): 7.11 GiB per GPU at its peak (a whole expert: "
            "27.24 GiB), each group leader's host 27.24 GiB") in capsys.readouterr().out
