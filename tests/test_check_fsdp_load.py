"""``wantrain check --gpus N`` under ``model.parallel = "fsdp"`` prints the load's peak (``rank_plan.load_peak``):
each GPU's shards and one tensor whole, and rank 0's host copy of the expert (docs/distributed.md, "Sharded base
weights"). At real size without weights: the plan is printed before the missing files are refused."""

from __future__ import annotations

import attrs
import pytest
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


def test_the_sharded_budget_takes_the_whole_block_recompute_before_the_lean_one_and_swaps_last():
    """At 832x480x81 over 4 GPUs (cards per GPU: block 40.2, block + offload 28.3, lean 29.2, lean + offload 17.3
    GiB): each budget takes the first recompute path in which something fits and in it, as the one-GPU planner, the
    setting that moves the fewest bytes over the host link: on-device activations, then offloaded ones, then block
    swap (FSDP2's CPU offload of the last blocks' shards) on top -- the fewest blocks that fit."""
    from wantrain.models.wan22.rank_plan import Layout, plan_sharded, rank_estimate

    layout, size = Layout(gpus=4, shard_degree=4), dict(width=832, height=480, frames=81, rank=32)
    chosen = {budget: plan_sharded("t2v-a14b", budget, layout, base_dtype="bf16", **size)[0]
              for budget in (41, 30, 24, 16)}
    assert [(e.settings.recompute, e.settings.offload_activations, e.settings.blocks_to_swap)
            for e in chosen.values()] == [("block", False, 0), ("block", True, 0), ("block", True, 26),
                                          ("lean", True, 9)]
    assert all(e.settings.base_dtype == "bf16" and e.card_gib <= b for b, e in chosen.items())
    for budget in (24, 16):  # one block fewer does not fit: the fewest swapped blocks that do
        fewer = attrs.evolve(chosen[budget].settings, blocks_to_swap=chosen[budget].settings.blocks_to_swap - 1)
        assert rank_estimate("t2v-a14b", layout, settings=fewer, **size).card_gib > budget
    assert chosen[30].card_gib == rank_estimate("t2v-a14b", layout, settings=chosen[30].settings, **size).card_gib
    none, smallest = plan_sharded("t2v-a14b", 10, layout, base_dtype="bf16", **size)
    assert none is None and 10 < smallest.card_gib < 10.5 and smallest.settings.recompute == "lean"
    assert smallest.settings.blocks_to_swap == 40  # every block's shards on the host
    over = {n: plan_sharded("t2v-a14b", 37, Layout(gpus=n, shard_degree=n), base_dtype="bf16", **size)[0]
            for n in (4, 8)}
    # 4 GPUs: 20 blocks' shards on the host move 6.6 GiB a step, fewer bytes than offloading the activations
    assert (over[4].settings.offload_activations, over[4].settings.blocks_to_swap) == (False, 20)
    assert over[4].link_bytes < rank_estimate("t2v-a14b", Layout(gpus=4, shard_degree=4), settings=attrs.evolve(
        over[4].settings, blocks_to_swap=0, offload_activations=True), **size).link_bytes
    assert (over[8].settings.offload_activations, over[8].settings.blocks_to_swap) == (False, 0)  # 36.6 GiB fits


def _part(out: str, name: str) -> float:
    """A part of ``check``'s plan per GPU (``    name: X GiB``), in GiB."""
    (line,) = [x for x in out.splitlines() if x.strip().startswith(f"{name}:")]
    return float(line.split(":")[1].split()[0])


def test_a_vram_budget_under_fsdp_swaps_blocks_when_nothing_else_fits_and_moves_their_shards_to_the_host(
        tmp_path, capsys):
    """Over 2 GPUs at 768x512x1 the smallest setting without swap needs 18.2 GiB per card: a 12 GiB budget takes
    block swap under fsdp (FSDP2's CPU offload of the last blocks' shards), the fewest blocks that fit. The GPU's
    weights drop by exactly those blocks' shards and its LoRA part by their LoRA state, which the host plan counts
    instead (``rank_offload.offloaded_shards``, with the pinned allocator's rounding on CUDA)."""
    from wantrain.models.wan22.memory import GIB
    from wantrain.models.wan22.rank_offload import offloaded_shards

    config = copy_examples(tmp_path)
    base = [*A14B_FSDP, "model.gradient_checkpointing=true", "model.host_ram_budget_gb=512"]

    def check(*extra: str) -> str:
        assert main(["check", str(config), "--gpus", "2", *(a for x in [*base, *extra] for a in ("--set", x))]) == 2
        captured = capsys.readouterr()
        assert "nothing fits" not in captured.err, captured.err
        return captured.out

    plain, swapped = check(), check("model.vram_budget_gb=12")
    assert "plan per GPU at 768x512x1 (bf16 base, no block swap" in plain
    assert "plan per GPU at 768x512x1 (bf16 base, 19 blocks swapped, activations on the device" in swapped
    frozen, lora, rounding = (x / GIB for x in offloaded_shards("t2v-a14b", 2, 19, 32))
    assert _part(plain, "weights (shard)") - _part(swapped, "weights (shard)") == pytest.approx(frozen, abs=0.011)
    assert _part(plain, "LoRA + optimizer") - _part(swapped, "LoRA + optimizer") == pytest.approx(lora, abs=0.011)
    (card,) = [float(x.split(" GiB per card")[0].rsplit(" ", 1)[1]) for x in swapped.splitlines()
               if "GiB per card" in x and "FSDP over 2" in x]
    assert card <= 12.0
    (host,) = [x for x in swapped.splitlines() if "offloaded blocks' shards + LoRA state (FSDP)" in x]
    assert float(host.split()[-2]) == pytest.approx(frozen + lora + rounding, abs=0.011)  # pinned: real model, CUDA
    assert "offloaded blocks' shards" not in plain
    assert "offloaded shards pinned (FSDP2)" in swapped and "offloaded shards pinned" not in plain

    def save_peak(out: str) -> float:  # every other GPU's peak at a save: its resident shards and one to send
        (line,) = [x for x in out.splitlines() if "save, every other GPU" in x]
        return float(line.rsplit(", ", 1)[1].split()[0])

    assert save_peak(plain) - save_peak(swapped) == pytest.approx(frozen + lora, abs=0.011)
    # docs/distributed.md's example ("Block swap under fsdp"): the same 19 blocks set by hand, the same plan per GPU
    explicit = check("model.blocks_to_swap=19")

    def per_gpu(out: str) -> list[str]:
        lines = out.splitlines()
        start = next(k for k, x in enumerate(lines) if x.startswith("plan per GPU at"))
        return lines[start:start + 8]

    assert per_gpu(explicit) == per_gpu(swapped) and card == 11.8
