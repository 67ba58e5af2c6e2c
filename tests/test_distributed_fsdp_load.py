"""Loading a sharded expert from rank 0 (``model.parallel = "fsdp"``, ``core.parallel.sharding.load_from_rank0``): two
forked gloo ranks build the tiny TI2V twin the way ``wantrain run`` does under torchrun (rank 0 loads it whole on
the host, rank 1 builds it on ``meta``; both shard it per block and fill the shards from rank 0), and each measures
the bytes it allocates (tests/live_bytes.py) against the planner's load peak (``rank_plan.load_peak``). A second
pair starts the LoRA from a file (``lora.init_from``): rank 0 copies its values into the host copy, both ranks take
its alpha."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

LORA_RANK = 4
PLAN_TOLERANCE = 0.02
"""Relative difference allowed between rank 1's measured peak and the planner's (measured: 105,560 B against
105,456, 0.1 %; the expert whole with its LoRA is 157,344 B, the old path's peak 157,856)."""


def _build(rank: int | None, world: int, init_from: str | None = None) -> tuple[object, int]:
    """The adapter as ``wantrain run`` builds it (``rank`` None: one process, the old path) and the peak bytes its
    build and sharding allocated. ``init_from``: a LoRA file to start from (``lora.init_from``)."""
    from live_bytes import LiveBytes

    from wantrain.app.assemble import shard_experts
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    model = ModelConfig(variant="tiny-ti2v", parallel="fsdp")
    lora = LoraConfig(rank=LORA_RANK) if init_from is None else LoraConfig(rank=None, init_from=Path(init_from))
    with LiveBytes() as tracker:
        adapter = build_adapter(model, lora, seed=0, device=torch.device("cpu"), base_lr=1e-3,
                                shard_load=None if rank is None else "rank0" if rank == 0 else "meta")
        if rank is not None:
            shard_experts(adapter, torch.device("cpu"), world, None)
    return adapter, tracker.peak


def _rank(rank: int, world: int, store: str, out: str, init_from: str | None = None) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from wantrain.core.parallel.sharding import local_bytes
    from wantrain.models.wan22.export import lora_layers

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    adapter, peak = _build(rank, world, init_from)
    transformer = adapter.transformer_for(None)
    alphas = [layer.scaling for _, layer in lora_layers(transformer)]
    whole = get_model_state_dict(transformer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    buffers = {f"buffer/{n}": b.detach().clone() for n, b in transformer.named_buffers()}
    if rank == 0:
        save_file({k: v.contiguous() for k, v in {**whole, **buffers}.items()}, f"{out}/sharded.safetensors")
    record = {"peak": peak, "local": local_bytes(transformer), "host_sources": len(adapter.host_sources),
              "scalings": [dict(s) for s in alphas],
              "sharded": all(hasattr(p, "to_local") for p in transformer.parameters())}
    Path(f"{out}/rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("fsdp_load")
    _build(None, 1)  # diffusers and peft imported once, before the fork, not in every rank
    mp.start_processes(_rank, args=(2, str(out / "store"), str(out)), nprocs=2, start_method="fork")
    return out


@pytest.fixture(scope="module")
def from_a_file(tmp_path_factory) -> tuple[Path, str]:
    """Two ranks loading the twin with ``lora.init_from``: a LoRA file of random A, B and alpha 2 (rank 4)."""
    import torch.multiprocessing as mp

    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    out = tmp_path_factory.mktemp("fsdp_load_init")
    source = build_adapter(ModelConfig(variant="tiny-ti2v"), LoraConfig(rank=LORA_RANK, alpha=2.0), seed=3,
                           device=torch.device("cpu"), base_lr=1e-3)
    with torch.no_grad():
        for p in source.trainable_parameters():
            p.normal_()
    (file,) = source.saver(out, "src").save(step=1, final=True)
    mp.start_processes(_rank, args=(2, str(out / "store"), str(out), str(file)), nprocs=2, start_method="fork")
    return out, str(file)


def test_the_expert_loaded_from_rank_0_equals_the_one_loaded_whole(two_ranks):
    from safetensors.torch import load_file

    adapter, _ = _build(None, 1)
    reference = adapter.transformer_for(None)
    loaded = load_file(str(two_ranks / "sharded.safetensors"))
    expected = {**reference.state_dict(), **{f"buffer/{n}": b for n, b in reference.named_buffers()}}
    assert sorted(loaded) == sorted(expected)
    assert any(".lora_A." in k for k in loaded) and any("freqs_cos" in k for k in loaded)  # LoRA and RoPE too
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and loaded[key].equal(value), key


def test_no_rank_but_0_ever_holds_the_whole_expert_and_the_planner_gives_each_ranks_peak(two_ranks):
    from wantrain.models.wan22.rank_plan import load_peak

    r0, r1 = (json.loads((two_ranks / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["sharded"] and r1["sharded"] and r0["host_sources"] == r1["host_sources"] == 0  # source dropped
    plan = load_peak("tiny-ti2v", 2, LORA_RANK, dtype_name="fp32")
    _, old_peak = _build(None, 1)  # one process (and each rank before): the expert whole, the LoRA included
    assert r1["peak"] < 0.9 * plan.whole_expert <= old_peak
    assert abs(r1["peak"] - plan.per_gpu) <= PLAN_TOLERANCE * plan.per_gpu, (r1, plan)
    # rank 0: on a CPU its "device" is the host, which holds the source too (and sends its tensors without a copy)
    assert plan.rank0_host < r0["peak"] <= plan.rank0_host + plan.per_gpu, (r0, plan)


def test_a_lora_started_from_a_file_loads_sharded_as_in_one_process(from_a_file):
    from safetensors.torch import load_file

    from wantrain.models.wan22.export import lora_layers

    out, file = from_a_file
    adapter, _ = _build(None, 1, file)
    reference = adapter.transformer_for(None)
    loaded = load_file(str(out / "sharded.safetensors"))
    lora = {k: v for k, v in reference.state_dict().items() if ".lora_" in k}
    assert lora and all(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # the file's B, not zero
    for key, value in reference.state_dict().items():
        assert loaded[key].equal(value), key
    scalings = [dict(layer.scaling) for _, layer in lora_layers(reference)]
    for r in (0, 1):  # the file's alpha on both ranks (rank 1 built on meta)
        assert json.loads((out / f"rank{r}.json").read_text())["scalings"] == scalings == \
            [{"wantrain": 0.5}] * len(scalings)
