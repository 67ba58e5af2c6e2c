"""``core.parallel.expert_groups`` on four gloo ranks (two groups of two, forked from the test process): what travels
inside a group (the LoRA's start from the group's leader, the averaged gradients, the non-finite flag) and what travels
across all ranks (the metrics; the state and LoRA files that reach rank 0)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from wantrain.core.errors import UserError
from wantrain.core.parallel.distributed import LEADER_KEY, Topology, rank_view
from wantrain.core.parallel.expert_groups import ExpertGroups, expert_groups_of


def _worker(rank: int, store: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from wantrain.core.parallel.expert_groups import ExpertGroupSync, GroupSaver

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=4,
                            timeout=datetime.timedelta(seconds=60))
    groups = ExpertGroups(2, Topology(rank=rank, world_size=4))
    sync = ExpertGroupSync.start(groups.topology, torch.device("cpu"), groups=groups,
                                 experts=("high_noise", "low_noise"))
    lora = torch.nn.Parameter(torch.full((3,), float(rank)))
    sync.broadcast_parameters([lora])
    start = lora.detach().clone()
    lora.grad = torch.full((3,), float(rank + 1))
    nonfinite = torch.tensor(1.0 if rank == 3 else 0.0)
    sync.average_gradients([lora], nonfinite)
    metrics = sync.reduce_metrics({f"train/loss/{sync.experts[groups.group]}": float(rank),
                                   "train/grad_norm": 3.0 + groups.group, "train/nan_streak_max": 2.0 * groups.group,
                                   "train/lr": 0.1 * (groups.group + 1)})
    tree = sync.gather_state({"model": {"w": lora.detach() + 10 * groups.group}, "train_state": {"step": rank}})
    written: list[str] = []
    saver = GroupSaver(sync, lambda step, final: [(f"{sync.experts[groups.group]}_{step}.safetensors",
                                                   {"w": torch.full((2,), float(rank))}, {"rank": str(rank)})],
                       lambda name, tensors, metadata: written.append((name, tensors["w"].tolist(), metadata))
                       or name)
    paths = saver.save(7, False)
    views = [rank_view(tree, r) for r in range(4)] if tree is not None else None
    with open(f"{out}.{rank}", "w") as fh:
        json.dump({"start": start.tolist(), "grad": lora.grad.tolist(), "nonfinite": float(nonfinite),
                   "metrics": metrics, "paths": paths, "written": written,
                   "leaders": [r.get(LEADER_KEY) for r in tree["ranks"]] if tree is not None else None,
                   "views": [[v["model"]["w"].tolist(), v["train_state"]["step"]] for v in views] if views else None},
                  fh)
    dist.destroy_process_group()


def test_two_groups_of_two_ranks_average_inside_their_group_and_rank_0_receives_every_experts_state(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_worker, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=4,
                       start_method="fork")
    r = [json.loads((tmp_path / f"out.{rank}").read_text()) for rank in range(4)]
    assert [x["start"] for x in r] == [[0.0] * 3, [0.0] * 3, [2.0] * 3, [2.0] * 3]  # each group's leader's LoRA
    assert [x["grad"] for x in r] == [[1.5] * 3, [1.5] * 3, [3.5] * 3, [3.5] * 3]  # means of 1, 2 and of 3, 4
    assert [x["nonfinite"] for x in r] == [0.0, 0.0, 1.0, 1.0]  # rank 3's bad loss skips its group's step only
    # each group's figures under its expert; the whole model's norm from both (sqrt(3^2 + 4^2)), not their mean;
    # the worst non-finite streak; the first group's LR as train/lr
    assert all(x["metrics"] == {"train/loss/high_noise": 0.5, "train/loss/low_noise": 2.5,
                                "train/grad_norm": 5.0, "train/grad_norm/high_noise": 3.0,
                                "train/grad_norm/low_noise": 4.0, "train/nan_streak_max": 2.0,
                                "train/nan_streak_max/high_noise": 0.0, "train/nan_streak_max/low_noise": 2.0,
                                "train/lr": 0.1, "train/lr/high_noise": 0.1, "train/lr/low_noise": 0.2} for x in r)
    # rank 0 writes the leaders' files (ranks 0 and 2), in group order; the others write nothing
    assert r[0]["paths"] == ["high_noise_7.safetensors", "low_noise_7.safetensors"]
    assert r[0]["written"] == [["high_noise_7.safetensors", [0.0, 0.0], {"rank": "0"}],
                               ["low_noise_7.safetensors", [2.0, 2.0], {"rank": "2"}]]
    assert all(x["paths"] == [] and x["written"] == [] for x in r[1:])
    # the checkpoint: the leaders' whole state, the others' own streams and their leader
    assert r[0]["leaders"] == [None, 0, None, 2]
    assert r[0]["views"] == [[[0.0] * 3, 0], [[0.0] * 3, 1], [[12.0] * 3, 2], [[12.0] * 3, 3]]


@pytest.mark.parametrize(("world", "words"), [(1, "and this run has one process"), (3, "and this run has 3 processes")])
def test_a_launch_that_cannot_split_into_the_expert_groups_is_refused_in_one_line(world, words):
    with pytest.raises(UserError) as refused:
        expert_groups_of(2, Topology(rank=0, world_size=world, local_rank=0))
    text = str(refused.value)
    assert "model.expert_groups = 2 needs a torchrun launch of a multiple of 2 processes" in text and words in text
    assert "\n" not in text
    assert expert_groups_of(1, Topology(rank=0, world_size=world)) is None


@pytest.mark.parametrize(("overrides", "words"), [
    (['sample.other_expert_lora="x.safetensors"'], "config key 'sample.other_expert_lora' does nothing with model."),
    (['model.variant="tiny-ti2v"'], "tiny-ti2v has one transformer; set model.expert_groups = 1"),
    (['model.experts="low_noise"'], "model.experts = 'low_noise' trains one; set model.expert_groups = 1 or"),
])
def test_what_expert_groups_cannot_run_is_refused_when_the_config_is_read(overrides, words):
    from pathlib import Path

    from wantrain.app.config import load_config
    from wantrain.core.config import ConfigError

    quickstart = Path(__file__).resolve().parents[2] / "examples" / "quickstart.toml"  # [sample], [validation] on
    with pytest.raises(ConfigError) as refused:
        load_config(quickstart, ["model.expert_groups=2", *overrides])
    assert words in str(refused.value) and "\n" not in str(refused.value), str(refused.value)


def _relay_rank(rank: int, store: str, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from wantrain.core.parallel.expert_relay import ExpertRelay

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    relay = ExpertRelay(lambda: None, rank, 1, "low_noise", torch.device("cpu"))

    def expert(*, x: torch.Tensor, scale: float, t: torch.Tensor) -> tuple[torch.Tensor]:
        if scale < 0:
            raise ValueError("a negative scale")
        return (x * scale + t,)

    result: dict = {}
    try:
        if rank == 0:
            x = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
            t = torch.tensor(0.5).expand(2, 1)  # stride 0, as the pipelines' timesteps
            result["out"] = relay.call(x=x, scale=2.0, t=t)[0].float().tolist()
            try:
                relay.call(x=x, scale=-1.0, t=t)
            except RuntimeError as exc:
                result["error"] = str(exc)
            result["after"] = relay.call(x=x, scale=1.0, t=t)[0].float().tolist()  # the loop still serves
            relay.done()
        else:
            try:
                relay.serve(expert)
            except ValueError as exc:
                result["raised"] = str(exc)
        result["calls"] = relay.calls
    finally:
        with open(f"{out}.{rank}", "w") as fh:
            json.dump(result, fh)
        dist.destroy_process_group()


def test_a_relayed_call_returns_the_serving_ranks_output_and_its_error_fails_both_ranks_without_a_hang(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_relay_rank, args=(str(tmp_path / "store"), str(tmp_path / "out")), nprocs=2,
                       start_method="fork")
    caller, server = (json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1))
    assert caller["out"] == [[0.5, 2.5, 4.5], [6.5, 8.5, 10.5]]  # bf16 in, computed there, bf16 back
    assert caller["after"] == [[0.5, 1.5, 2.5], [3.5, 4.5, 5.5]]
    assert caller["error"] == ("the low_noise expert on rank 1 failed on a relayed call: ValueError: a negative "
                               "scale")
    assert server["raised"] == "a negative scale"  # raised on the serving rank once rank 0 said done
    assert caller["calls"] == server["calls"] == 2


def _failing_server(rank: int, store: str, out: str, point: str) -> None:
    """Rank 0 sends a video's context and calls the expert twice; rank 1 fails at ``point`` (module test below)."""
    import datetime

    import torch.distributed as dist

    from wantrain.core.parallel.expert_relay import ExpertRelay

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    relay = ExpertRelay(lambda: None, rank, 1, "low_noise", torch.device("cpu"))
    result: dict = {"errors": []}
    try:
        if rank == 0:
            relay.context(loras=[["missing.safetensors", 1.0, "low_noise"]])
            for _ in range(2):
                try:
                    relay.call(x=torch.ones(2))
                except RuntimeError as exc:
                    result["errors"].append(str(exc))
            relay.done()
        else:
            if point == "inputs":
                relay.device = "no such device"  # type: ignore[assignment] -- copying the inputs there fails

            def context(values: dict) -> None:
                if point == "context":
                    raise FileNotFoundError("stacked LoRA missing.safetensors")

            def expert(*, x: torch.Tensor) -> tuple[torch.Tensor]:
                return (x * 2,)

            try:
                with relay.serving():
                    if point == "bring_in":
                        raise MemoryError("bringing the low_noise expert in")
                    relay.serve(expert, context=context)
            except Exception as exc:
                result["raised"] = f"{type(exc).__name__}: {exc}"
    finally:
        with open(f"{out}.{rank}", "w") as fh:
            json.dump(result, fh)
        dist.destroy_process_group()


@pytest.mark.parametrize(("point", "cause"), [
    ("bring_in", "MemoryError: bringing the low_noise expert in"),
    ("context", "FileNotFoundError: stacked LoRA missing.safetensors"),
    ("inputs", "RuntimeError:"),
])
def test_a_serving_rank_that_fails_anywhere_in_a_round_tells_rank_0_and_neither_waits(tmp_path, point, cause):
    """Each failure point of the serving rank outside its expert (issue #57): rank 0's calls get the cause, the
    server raises it once done arrives, and both processes end (a hang fails the join's timeout)."""
    import torch.multiprocessing as mp

    spawned = mp.start_processes(_failing_server, args=(str(tmp_path / "store"), str(tmp_path / "out"), point),
                                 nprocs=2, start_method="fork", join=False)
    deadline = time.monotonic() + 60
    while not spawned.join(timeout=1):
        if time.monotonic() > deadline:
            for process in spawned.processes:
                process.kill()
            pytest.fail(f"a rank still waits 60 s after the {point} failure")
    caller, server = (json.loads((tmp_path / f"out.{rank}").read_text()) for rank in (0, 1))
    assert len(caller["errors"]) == 2 and all(cause in e for e in caller["errors"]), caller
    assert server["raised"].startswith(cause), server

