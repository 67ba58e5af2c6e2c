"""``wantrain check --gpus N`` under ``model.parallel = "fsdp"`` prints the load's peak (``rank_plan.load_peak``):
each GPU's shards and one tensor whole, and rank 0's host copy of the expert (docs/distributed.md, "Sharded base
weights"). At real size without weights: the plan is printed before the missing files are refused."""

from __future__ import annotations

from test_end_to_end import copy_examples

from wantrain.cli.main import main
from wantrain.models.wan22.memory import AdapterSpec

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


def test_check_plans_each_saves_gather_for_rank_0_and_for_the_other_gpus_under_fsdp(tmp_path, capsys):
    """Each save gathers the LoRA and AdamW state to rank 0 alone, one tensor at a time (``whole_to_writer``): rank
    0's GPU holds one tensor whole over its shards and its host the whole state (the issue's ~1.7 GiB at A14B rank
    32, twice while the checkpoint is written); every other GPU only a shard to send. DoRA's export gathers a frozen
    weight (bf16) the same way."""
    from wantrain.models.wan22.rank_plan import Layout, lora_shard_params, save_gather

    config = copy_examples(tmp_path)
    settings = [arg for item in A14B_FSDP for arg in ("--set", item)]
    assert main(["check", str(config), "--gpus", "8", *settings]) == 2
    out = capsys.readouterr().out
    gather = save_gather("t2v-a14b", Layout(gpus=8, shard_degree=8), 32)
    whole = lora_shard_params("t2v-a14b", 32, 1) * 12  # fp32 value + 2 AdamW moments
    assert gather.host == 2 * whole and 1.6 < whole / 2**30 < 1.8
    assert gather.writer_extra == 13824 * 32 * 4 and gather.other_extra == gather.writer_extra / 8  # an FFN factor
    assert gather.writer_peak - gather.writer_extra == gather.other_peak - gather.other_extra  # the same shards
    for line in gather.lines():
        assert line in out, out[-2000:]
    assert "save, every other GPU (sends its rows, gathers nothing): +0.2 MiB" in out
    dora = save_gather("t2v-a14b", Layout(gpus=8, shard_degree=8), 32, adapter=AdapterSpec("dora"))
    assert dora.writer_extra == 5120 * 13824 * 2 and dora.host == gather.host  # an FFN weight whole, bf16
    data_parallel = [arg for item in A14B_FSDP if "parallel" not in item for arg in ("--set", item)]
    assert main(["check", str(config), "--gpus", "8", *data_parallel]) == 2  # each GPU holds it whole: nothing
    assert "save, rank 0" not in capsys.readouterr().out


def test_a_vram_budget_under_fsdp_is_planned_per_gpu_with_the_shard(tmp_path, capsys):
    """``model.vram_budget_gb`` with ``model.parallel = "fsdp"`` (docs/distributed.md's example): bf16, no block
    swap; the recompute path and activation offload are chosen per GPU at the launch's shard degree, and a budget
    nothing fits is refused in one line with the smallest setting's figure per GPU."""
    config = copy_examples(tmp_path)
    settings = [arg for item in [*A14B_FSDP, "model.vram_budget_gb=40", "model.host_ram_budget_gb=512"]
                for arg in ("--set", item)]
    assert main(["check", str(config), "--gpus", "8", *settings]) == 2  # no weights: refused after the plan
    captured = capsys.readouterr()
    assert "per GPU under fsdp, 8 GPUs, FSDP over 8" in captured.out and "nothing fits" not in captured.err
    assert "plan per GPU at 768x512x1 (bf16 base, no block swap" in captured.out, captured.out[-2000:]
    assert main(["check", str(config), "--gpus", "2", *settings]) == 2
    err = capsys.readouterr().err
    assert ("model.vram_budget_gb = 40: under model.parallel = 'fsdp' (2 GPUs, FSDP over 2" in err
            and "needs 50.2 GiB per GPU" in err and "Traceback" not in err), err


def test_the_sharded_budget_takes_the_whole_block_recompute_before_the_lean_one_and_offload_last():
    """At 832x480x81 over 4 GPUs (cards per GPU: block 40.2, block + offload 28.3, lean 29.2, lean + offload 17.3
    GiB): each budget takes the first path that fits, on-device activations before offloaded ones."""
    from wantrain.models.wan22.rank_plan import Layout, plan_sharded, rank_estimate

    layout, size = Layout(gpus=4, shard_degree=4), dict(width=832, height=480, frames=81, rank=32)
    chosen = {budget: plan_sharded("t2v-a14b", budget, layout, base_dtype="bf16", **size)[0]
              for budget in (41, 30, 24)}
    assert [(e.settings.recompute, e.settings.offload_activations) for e in chosen.values()] == [
        ("block", False), ("block", True), ("lean", True)]
    assert all(e.settings.blocks_to_swap == 0 and e.settings.base_dtype == "bf16" for e in chosen.values())
    assert chosen[30].card_gib == rank_estimate("t2v-a14b", layout, settings=chosen[30].settings, **size).card_gib
    none, smallest = plan_sharded("t2v-a14b", 16, layout, base_dtype="bf16", **size)
    assert none is None and 17 < smallest.card_gib < 17.5 and smallest.settings.recompute == "lean"
    over = {n: plan_sharded("t2v-a14b", 37, Layout(gpus=n, shard_degree=n), base_dtype="bf16", **size)[0]
            for n in (4, 8)}
    assert over[4].settings.offload_activations and not over[8].settings.offload_activations  # 8: 36.6 GiB fits
