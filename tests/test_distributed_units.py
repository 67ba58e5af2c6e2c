"""The model-free pieces of data parallelism, in one process: topology detection, per-rank seeds, the data shard of
each rank, the per-rank checkpoint view, the no-pickle state encoding and the resume refusal."""

from __future__ import annotations

import pytest
import torch
from test_end_to_end import copy_examples

from wantrain.app.config import RunConfig
from wantrain.app.launch import check_parallel
from wantrain.app.resume import ResumePoint, check_resume_world_size
from wantrain.cli.main import main
from wantrain.core.config import structure
from wantrain.core.errors import ConfigError, UserError
from wantrain.core.parallel.distributed import (
    PER_RANK_STATE,
    SingleProcess,
    _decode_tree,
    _encode_tree,
    checkpoint_world_size,
    detect_topology,
    rank_view,
)


def test_topology_comes_from_torchruns_environment():
    assert detect_topology({}).world_size == 1 and detect_topology({}).is_main
    t = detect_topology({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"})
    assert (t.rank, t.world_size, t.local_rank, t.is_main, t.distributed) == (3, 4, 1, False, True)


def test_each_rank_draws_the_rows_of_its_samples_in_the_global_batch():
    """Every rank seeds with the run seed and keeps its rows of the global batch's draws (Wan22Adapter.loss): the
    positions are those of its slice, a sample that dropped out of the batch leaves its position unused, and a
    short global batch is padded as rank_share pads it."""
    from types import SimpleNamespace

    from wantrain.data.training import TrainingData

    class Report:
        buckets, steps_per_epoch, verification = [], 0, []

    clips = [SimpleNamespace(path=f"clip{i}.mp4", active=False) for i in range(6)]
    data = TrainingData(clips, Report(), batch_size=2, remainder="drop", shuffle=False, seed=0, spec=None)
    samples = [(i, "text") for i in range(6)]
    draws = []
    for rank in range(3):
        data.shard(rank, 3)
        share = data.rank_share(samples)
        draws.append(data.global_draws(6, share, [f"clip{i}.mp4" for i, _ in share]))
    assert draws == [((0, 1), 6), ((2, 3), 6), ((4, 5), 6)]
    data.shard(1, 3)
    assert data.global_draws(6, samples[2:4], ["clip3.mp4"]) == ((3,), 6)  # clip 2 failed to decode
    data.shard(2, 3)  # a short global batch of 2: rank 2 repeats the first sample, and its draws
    assert data.global_draws(2, [samples[0]], ["clip0.mp4"]) == ((0,), 2)


def test_each_rank_trains_its_slice_of_the_global_batch(tmp_path):
    from wantrain.data.training import TrainingData

    class Report:
        buckets, steps_per_epoch, verification = [], 0, []

    data = TrainingData([], Report(), batch_size=2, remainder="drop", shuffle=False, seed=0, spec=None)
    shares = []
    for rank in range(3):
        data.shard(rank, 3)
        assert data.plan_batch_size == 6
        shares.append(data.rank_share([10, 11, 12, 13, 14, 15]))
    assert shares == [[10, 11], [12, 13], [14, 15]]
    short = []
    for rank in range(3):
        data.shard(rank, 3)
        short.append(data.rank_share([7, 8]))
    assert short == [[7], [8], [7]]  # a short global batch: every rank still gets a sample


def test_a_rank_restores_the_shared_state_and_its_own():
    tree = {"model": "shared", "train_state": "rank0", "ranks": [{"train_state": "rank0"}, {"train_state": "rank1"}]}
    assert rank_view(tree, 1) == {"model": "shared", "train_state": "rank1"}
    assert checkpoint_world_size(tree) == 2 and checkpoint_world_size({"model": 1}) == 1
    assert rank_view({"model": 1}, 0) == {"model": 1}


def test_per_rank_state_travels_as_json_and_safetensors():
    tree = {"generator": torch.arange(5, dtype=torch.uint8), "data": {"epoch": 2, "carry": [[1, 2]]},
            "metrics": {"sums": {"train/loss": {"total": torch.tensor(1.5), "count": 2}}}}
    back = _decode_tree(_encode_tree(tree))
    assert back["generator"].equal(tree["generator"]) and back["data"] == tree["data"]
    assert back["metrics"]["sums"]["train/loss"]["total"].item() == 1.5
    assert set(PER_RANK_STATE) >= {"generator", "rng", "data"}


def test_one_process_exchanges_nothing():
    sync = SingleProcess()
    values = {"train/loss": 0.5}
    assert sync.reduce_metrics(values) is values and sync.agree_step("out of memory", None) == "out of memory"
    tree = {"model": 1}
    assert sync.gather_state(tree) is tree


def test_resuming_with_another_number_of_ranks_is_refused(tmp_path):
    point = ResumePoint(tmp_path / "step_000004", tmp_path, 4, {"ranks": [{}, {}]}, {})
    check_resume_world_size(point, 2)
    with pytest.raises(UserError, match=r"written by 2 processes .* this run has 1; resume with 2 processes"):
        check_resume_world_size(point, 1)
    with pytest.raises(UserError, match=r"written by one process \(wantrain run\) and this run has 4"):
        check_resume_world_size(ResumePoint(tmp_path, tmp_path, 4, {"model": {}}, {}), 4)


def two_forked_ranks(worker, tmp_path) -> None:
    """Run ``worker(rank, store, out)`` on two gloo ranks forked from this test process, which has imported torch
    and wantrain already: a spawned rank pays ~15 s of imports on the 2-core machine, a fork nothing."""
    import torch.multiprocessing as mp

    mp.start_processes(worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2, start_method="fork")


def _worker(rank: int, store: str, out: str) -> None:
    import json

    import torch.distributed as dist

    from wantrain.core.control import Control
    from wantrain.core.parallel.distributed import ProcessGroupSync, Topology

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sync = ProcessGroupSync(Topology(rank=rank, world_size=2), torch.device("cpu"))
    # metrics: rank 1 lacks one name; memory/* is the maximum, the rest the mean
    values = {"train/loss": 1.0 + rank, "memory/ram_gb": 4.0 + rank}
    if rank == 0:
        values["train/loss/high_noise"] = 3.0
    reduced = sync.reduce_metrics(values)
    # gradients: averaged in place; a non-finite loss on rank 1 reaches rank 0
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.full((3,), float(rank + 1))
    nonfinite = torch.tensor(float(rank == 1))  # rank 1's losses were not finite
    sync.average_gradients([p], nonfinite)
    # decisions: an out-of-memory error on rank 1 and a save request on rank 0 reach both
    control = Control()
    ended = sync.agree_step("out of memory" if rank == 1 else None, control)
    if rank == 0:
        control.request_save("observer")
    sync.agree_requests(control)
    text = sync.broadcast_text("path:/runs/x" if rank == 0 else None)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"reduced": reduced, "grad": p.grad.tolist(), "nonfinite": nonfinite.item(), "ended": ended,
                   "save": control.take_save_request(), "stop": sync.should_stop(control), "text": text}, fh)
    dist.destroy_process_group()


def test_two_ranks_agree_on_metrics_gradients_and_decisions(tmp_path):
    import json

    two_forked_ranks(_worker, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["reduced"] == r1["reduced"] == {"train/loss": 1.5, "memory/ram_gb": 5.0, "train/loss/high_noise": 3.0}
    assert r0["grad"] == r1["grad"] == [1.5, 1.5, 1.5]
    assert r0["nonfinite"] == r1["nonfinite"] == 1.0
    assert r0["ended"] == r1["ended"] == "out of memory"
    assert r0["save"] == "observer" and r1["save"] == "save requested on another rank"
    assert r0["stop"] is r1["stop"] is False
    assert r0["text"] == r1["text"] == "path:/runs/x"


def _save_gather_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from wantrain.core.parallel.sharding import whole_to_writer

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    DTensor.full_tensor = None  # an all-gather would fail: FSDP's layouts travel by one gather to the writer
    value = torch.arange(15, dtype=torch.float32).view(5, 3)  # 5 rows on 2 ranks: 3 and 2 (padded to 3)
    flat, hsdp = init_device_mesh("cpu", (2,)), init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    got = {"rows": whole_to_writer(distribute_tensor(value, flat, [Shard(0)])),
           "columns": whole_to_writer(distribute_tensor(value, flat, [Shard(1)]), torch.bfloat16),
           "copies": whole_to_writer(distribute_tensor(value, hsdp, [Replicate(), Shard(0)]))}
    if rank == 0:
        save_file(got, out)
    else:
        assert all(t.is_meta and t.shape == value.shape for t in got.values()), got
        assert got["columns"].dtype == torch.bfloat16
    dist.destroy_process_group()


def test_a_save_gathers_sharded_tensors_to_the_writing_rank_alone(tmp_path):
    """``whole_to_writer``: rank 0 gets each tensor whole on the CPU (uneven rows, columns, HSDP's copies); rank 1
    only empty ``meta`` tensors of the shape, and no rank all-gathers."""
    from safetensors.torch import load_file

    two_forked_ranks(_save_gather_worker, tmp_path)
    got, value = load_file(str(tmp_path / "out")), torch.arange(15, dtype=torch.float32).view(5, 3)
    assert got["rows"].equal(value) and got["copies"].equal(value)
    assert got["columns"].equal(value.to(torch.bfloat16))


def test_a_restored_shard_stays_on_the_device_of_the_parameter_it_belongs_to(tmp_path):
    """``sharding.like`` (a resume's optimizer state and LoRA, cut to this rank's shard): a parameter FSDP2 keeps
    on the host while the mesh is CUDA's (block swap under fsdp) must get its state on the host too, not on the
    mesh's device. On the CPU the stand-in for "another device than the mesh's" is ``meta``."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from wantrain.core.parallel.sharding import like

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        value = torch.arange(12.0).view(4, 3)
        elsewhere = DTensor.from_local(torch.empty(4, 3, device="meta"), mesh, [Shard(0)], run_check=False)
        moved = like(value, elsewhere)
        assert moved.to_local().device.type == "meta" and moved.shape == value.shape
        here = like(value, DTensor.from_local(torch.empty(4, 3), mesh, [Shard(0)], run_check=False))
        assert here.to_local().equal(value)  # on the mesh's device: the rows themselves
    finally:
        dist.destroy_process_group()



def test_the_docs_batch_example_is_a_valid_config(tmp_path):
    import re
    from pathlib import Path

    from wantrain.app.config import load_config

    text = (Path(__file__).resolve().parents[1] / "docs" / "distributed.md").read_text()
    snippet = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    (tmp_path / "c.toml").write_text(snippet)
    cfg = load_config(tmp_path / "c.toml", [])
    assert (cfg.train.batch_size, cfg.train.grad_accum, cfg.optimizer.lr) == (1, 2, 2e-4)


def test_the_initial_lora_broadcast_sends_only_tensors_on_the_groups_device(monkeypatch):
    """An NCCL group has no CPU backend: the offloaded expert's LoRA (on the host) must travel through the group's
    device. ``meta`` plays the GPU (tests/simulated_device.py); the broadcast stub checks where each tensor is."""
    import torch.distributed as dist

    from tests.simulated_device import DEVICE, MetaAsDevice
    from wantrain.core.parallel.distributed import ProcessGroupSync, Topology

    sent = []
    monkeypatch.setattr(dist, "broadcast",
                        lambda tensor, src, group=None: sent.append((tensor.device, tensor.numel())))
    with MetaAsDevice():
        active = [torch.nn.Parameter(torch.zeros(3, 2, device=DEVICE))]
        offloaded = [torch.nn.Parameter(torch.ones(4, 2)), torch.nn.Parameter(torch.ones(5)),
                     torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))]
        ProcessGroupSync(Topology(rank=1, world_size=2), DEVICE).broadcast_parameters(active + offloaded)
    assert {device for device, _ in sent} == {DEVICE}
    assert sorted(n for _, n in sent) == [2, 6, 13]  # the active tensor, then one buffer per dtype
    assert {p.device.type for p in offloaded} == {"cpu"}  # rank 0's values copied back where they live


def _cache_worker(rank: int, store: str, out: str) -> None:
    import os
    import time

    import torch.distributed as dist

    from wantrain.core.parallel.distributed import ProcessGroupSync, Topology

    os.environ.update(MASTER_ADDR="127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=__import__("datetime").timedelta(seconds=2))
    sync = ProcessGroupSync.start(Topology(rank=rank, world_size=2), torch.device("cpu"))
    if rank == 0:
        time.sleep(5)  # rank 0 encodes the uncached clips alone, longer than the group's collective timeout
    sync.wait_for_rank0()
    with open(f"{out}.{rank}", "w") as fh:
        fh.write("waited")
    dist.destroy_process_group()


def test_the_other_ranks_wait_for_rank0_filling_the_cache_past_the_collective_timeout(tmp_path):
    two_forked_ranks(_cache_worker, tmp_path)
    assert [(tmp_path / f"out.{r}").read_text() for r in (0, 1)] == ["waited", "waited"]


BUSY_S = 5.0
GROUP_TIMEOUT_S = 2.0


def _waiting_worker(rank: int, store: str, out: str) -> None:
    import datetime
    import json
    import time

    import torch.distributed as dist

    from wantrain.core.parallel.distributed import ProcessGroupSync, Topology

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    sync = ProcessGroupSync(Topology(rank=rank, world_size=2), torch.device("cpu"))
    # validation sums: every rank's share added up, the same numbers on both ranks
    sums = sync.sum_values([0.25 + rank, 1.0])
    started = time.monotonic()
    if rank == 0:
        time.sleep(BUSY_S)  # rank 0 samples, longer than the default group's timeout
    sync.wait_for_rank0()  # built without start(): the patient group is created here, by rank 0 5 s late
    waited = time.monotonic() - started
    sync.barrier()  # the default group still works afterwards
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"sums": sums, "waited": waited}, fh)
    dist.destroy_process_group()


def test_other_ranks_wait_for_rank_0s_samples_past_the_process_groups_timeout(tmp_path):
    import json

    two_forked_ranks(_waiting_worker, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1))
    assert r0["sums"] == r1["sums"] == [1.5, 2.0]
    assert r1["waited"] >= BUSY_S - 1.0 > GROUP_TIMEOUT_S  # rank 1 waited the whole time, without timing out


def test_check_prints_the_plan_per_gpu_of_a_layout_and_refuses_a_sequence_degree_not_dividing_the_heads(
        tmp_path, capsys):
    from test_end_to_end import copy_examples

    from wantrain.cli.main import main

    config = copy_examples(tmp_path)
    assert main(["check", str(config), "--gpus", "4", "--expert-groups", "2", "--shard-degree", "2",
                 "--sequence-degree", "2"]) == 0
    out = capsys.readouterr().out
    assert "plan per GPU at " in out and "4 GPUs, one expert per group of 2, FSDP over 2, Ulysses over 2" in out
    assert "weights (shard)" in out and "sequence exchange" in out
    assert main(["check", str(config), "--gpus", "4", "--sequence-degree", "4"]) == 2  # the tiny twin has 2 heads
    err = capsys.readouterr().err
    assert "sequence degree 4 does not divide the 2 attention heads of tiny-t2v" in err and "Traceback" not in err
    fsdp = ["--set", 'model.experts="high_noise"', "--set", 'model.parallel="fsdp"']
    assert main(["check", str(config), "--gpus", "4", *fsdp]) == 0  # the config's layout: FSDP over every GPU
    assert "4 GPUs, FSDP over 4" in capsys.readouterr().out
    assert main(["check", str(config), "--gpus", "4", *fsdp, "--set", "model.shard_degree=3"]) == 2
    assert "model.shard_degree = 3 does not divide the 4 ranks" in capsys.readouterr().err


# -- model.parallel = "fsdp": what is refused, and when -------------------------------------------------------------
TI2V = {"variant": "tiny-ti2v", "parallel": "fsdp"}


@pytest.mark.parametrize(("keys", "says"), [
    ({"model": {**TI2V, "base_dtype": "fp8_scaled"}}, "base_dtype = 'fp8_scaled' (quantised storage)"),
    ({"model": {"variant": "tiny-ti2v", "shard_degree": 2}}, "model.shard_degree applies to model.parallel = 'fsdp'"),
])
def test_fsdp_refuses_what_it_cannot_shard_yet_when_the_config_is_read(keys, says):
    with pytest.raises(ConfigError) as refused:
        structure(RunConfig, keys)
    assert says in str(refused.value) and "\n" not in str(refused.value)
    assert structure(RunConfig, {"model": {**TI2V, "shard_degree": 2}}).model.shard_degree == 2  # alone: fine
    # what runs sharded now (tests/test_distributed_fsdp_evaluation.py, test_distributed_fsdp_compose.py)
    structure(RunConfig, {"model": {**TI2V, "compile": "default"}})
    structure(RunConfig, {"model": {"variant": "tiny-t2v", "parallel": "fsdp"}})  # both experts
    structure(RunConfig, {"model": TI2V, "lora": {"type": "dora"}})
    structure(RunConfig, {"model": {**TI2V, "vram_budget_gb": 20.0}})  # it plans per GPU (test_check_fsdp_load.py)
    assert structure(RunConfig, {"model": {**TI2V, "blocks_to_swap": 2}}).model.blocks_to_swap == 2  # FSDP2's offload


def test_fsdp_against_the_launch_one_process_trains_unsharded_and_a_degree_must_divide_the_ranks():
    cfg = structure(RunConfig, {"model": TI2V})
    assert "trains unsharded" in check_parallel(cfg, 1)[0]
    assert check_parallel(cfg, 4) == []
    assert check_parallel(structure(RunConfig, {"model": {**TI2V, "shard_degree": 2}}), 4) == []  # HSDP: 2 x 2
    with pytest.raises(UserError, match=r"^model.shard_degree = 3 does not divide the 4 ranks of this launch; use "
                                        r"one of 1, 2, 4 \(unset: all 4\)$"):
        check_parallel(structure(RunConfig, {"model": {**TI2V, "shard_degree": 3}}), 4)
    validation = {"enabled": True, "from_training": 2}
    assert check_parallel(structure(RunConfig, {"model": TI2V, "validation": validation}), 2) == []
    groups = {"variant": "tiny-t2v", "parallel": "fsdp", "expert_groups": 2}  # the serving group would follow
    with pytest.raises(UserError, match=r"^\[validation\] does not run with model.parallel = 'fsdp' inside "
                                        r"model.expert_groups = 2 yet"):
        check_parallel(structure(RunConfig, {"model": groups, "validation": validation}), 2)
    assert check_parallel(structure(RunConfig, {"model": {"variant": "tiny-t2v"}}), 3) == []  # dp: nothing to check


def test_a_shard_degree_not_dividing_the_ranks_is_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    config = copy_examples(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    code = main(["run", str(config), "--set", 'model.experts="high_noise"', "--set", 'model.parallel="fsdp"',
                 "--set", "model.shard_degree=3"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "shard_degree = 3 does not divide the 4 ranks" in err, err
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "demo_data").rglob("*.safetensors"))


def test_a_sharded_run_resumes_on_fewer_ranks_and_on_more(tmp_path):
    point = ResumePoint(tmp_path / "step_000004", tmp_path, 4, {"ranks": [{}, {}, {}, {}]}, {})
    assert "this run has 2: the LoRA, optimizer, schedule and counters continue exactly; the random streams of " \
           "ranks 2..3 end" in check_resume_world_size(point, 2, sharded=True)
    two = ResumePoint(tmp_path, tmp_path, 4, {"ranks": [{}, {}]}, {})
    assert "random streams of rank 1 end" in check_resume_world_size(two, 1, sharded=True)
    assert "this run has 3: the LoRA, optimizer, schedule and counters continue exactly; rank 2 continues rank 0's " \
           "random streams" in check_resume_world_size(two, 3, sharded=True)
    assert "ranks 2..7 continue rank 0's random streams" in check_resume_world_size(two, 8, sharded=True)
    with pytest.raises(UserError, match=r"resume with 4 processes .* \(model.parallel = 'fsdp' resumes on another"):
        check_resume_world_size(point, 2)  # data parallel: refused as before
    with pytest.raises(UserError, match=r"resume with 2 processes"):
        check_resume_world_size(two, 4)


def test_a_rank_new_to_a_checkpoint_restores_rank_0s_counters():
    tree = {"model": {"w": 1}, "ranks": [{"data": {"entry": 3}, "generator": "g0"},
                                         {"data": {"entry": 3}, "generator": "g1"}]}
    assert rank_view(tree, 1)["generator"] == "g1"
    assert rank_view(tree, 3) == {"model": {"w": 1}, "data": {"entry": 3}, "generator": "g0"}


def test_the_padded_rows_of_a_short_global_batch_weigh_nothing():
    """3 clips on 2 ranks of batch 2 (issue #57): rank 1 repeats clip 0 to step with rank 0. Each rank's loss is
    the weighted sum of its rows' losses and the ranks' gradients are averaged, so a sample's weight in the global
    loss is the sum of its rows' weights over the ranks, divided by the ranks: 1/3 each (before: 1/2, 1/4, 1/4)."""
    from types import SimpleNamespace

    from wantrain.data.training import TrainingData

    class Report:
        buckets, steps_per_epoch, verification = [], 0, []

    clips = [SimpleNamespace(path=f"clip{i}.mp4", active=False, start=0, frames=9) for i in range(3)]
    data = TrainingData(clips, Report(), batch_size=2, remainder="drop", shuffle=False, seed=0, spec=None)
    samples = [(i, "text") for i in range(3)]
    weight = {0: 0.0, 1: 0.0, 2: 0.0}
    for rank in range(2):
        data.shard(rank, 2)
        share = data.rank_share(samples)
        rows = data.row_weights(3, share, [f"clip{i}.mp4" for i, _ in share])
        for (i, _), w in zip(share, rows, strict=True):
            weight[i] += w / 2
    assert weight == pytest.approx({0: 1 / 3, 1: 1 / 3, 2: 1 / 3})
    assert data.row_weights(4, samples[:2], ["clip0.mp4", "clip1.mp4"]) is None  # a full global batch: no weights
    # the event log's rows: every rank's, padding left out
    assert data.trained_samples(samples) == (
        (0, "clip0.mp4", 0, 9), (0, "clip1.mp4", 0, 9), (1, "clip2.mp4", 0, 9))


def test_the_rest_of_an_epoch_is_regrouped_for_another_global_batch_each_sample_once():
    from wantrain.data.regroup import regroup, remaining_samples

    plan = [((32, 32, 9), [0, 1]), ((16, 16, 1), [5, 6]), ((32, 32, 9), [2, 3]), ((16, 16, 1), [7])]
    rest = remaining_samples(plan, 1, {(32, 32, 9): [4]})  # one global batch of 2 trained; sample 4 was carried
    assert rest == {(16, 16, 1): [5, 6, 7], (32, 32, 9): [2, 3, 4]}
    tail = regroup(rest, 3, seed=7, epoch=0, shuffle=True)
    assert sorted(i for _, idx in tail for i in idx) == [2, 3, 4, 5, 6, 7]  # each remaining sample once
    assert all(len(idx) <= 3 and len({(key, i) for i in idx}) == len(idx) for key, idx in tail)
    assert sorted(len(idx) for _, idx in regroup(rest, 2, seed=7, epoch=0, shuffle=False)) == [1, 1, 2, 2]
