"""One expert per group of GPUs (``model.expert_groups = 2``) with what crosses the groups: sample videos whose
low-noise steps are relayed to the other group (``core.parallel.expert_relay``), on gloo ranks forked from the test
process (no fresh interpreter)."""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import attrs
import pytest
import torch
import torch.multiprocessing as mp

from tests.models.wan22_helpers import make_adapter
from tests.observers.test_stacked_loras import distillation_lora
from wantrain.core.adapter import evaluation_session
from wantrain.core.parallel.distributed import Topology
from wantrain.core.parallel.expert_groups import ExpertGroups, ExpertGroupSync
from wantrain.core.parallel.expert_relay import RelayedExpert
from wantrain.observers.evaluation import samples as samples_module
from wantrain.observers.evaluation.config import StackedLora
from wantrain.observers.evaluation.samples import SampleJob, SampleVideos


def _lora_filled(adapter, experts) -> None:
    """Give each expert's LoRA values of its own (a fresh LoRA's B is zero: the video would not show it)."""
    for expert in experts:
        g = torch.Generator().manual_seed(17 if expert == "high_noise" else 29)
        with torch.no_grad():
            for p in adapter.trainable_parameters(expert):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _jobs(text: torch.Tensor, stacked: Path) -> list[SampleJob]:
    """Guided (a negative pass on each expert) over 6 steps, both bands; the second video with a LoRA file stacked
    under both experts' (``sample.loras``)."""
    job = SampleJob(index=0, prompt_embeds=text, negative_embeds=text * 0, width=32, height=32, frames=5, seed=3,
                    steps=6, guidance_scale=2.0, guidance_scale_high_noise=3.0)
    return [job, attrs.evolve(job, index=1, loras=(StackedLora(path=stacked, strength=0.7),))]


def _recording(monkeypatch_like: dict) -> None:
    """Keep each video's last latents (``latents_image`` is called with them) in ``monkeypatch_like``."""
    original = samples_module.latents_image

    def keep(latents, height):
        monkeypatch_like.setdefault("latents", []).append(latents.detach().clone())
        return original(latents, height)

    samples_module.latents_image = keep


def _sampling_rank(rank: int, store: str, out: str, reference: dict, text: torch.Tensor, stacked: Path) -> None:
    import faulthandler

    import torch.distributed as dist

    faulthandler.dump_traceback_later(120, exit=True)  # a hang fails the test
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    groups = ExpertGroups(2, Topology(rank=rank, world_size=2))
    sync = ExpertGroupSync.start(groups.topology, torch.device("cpu"), groups=groups,
                                 experts=("high_noise", "low_noise"))
    expert = ("high_noise", "low_noise")[rank]
    adapter = make_adapter("tiny-t2v", experts=expert, gradient_checkpointing=False)
    adapter.transformer_for(expert).load_state_dict(reference[expert])  # the one-process run's expert, LoRA too
    if rank == 0:
        adapter.add_relayed_expert("low_noise", RelayedExpert(sync.relays()["low_noise"]))
    kept: dict = {}
    _recording(kept)
    observer = SampleVideos(out_dir=Path(out) / f"rank{rank}", jobs=_jobs(text, stacked) if rank == 0 else [], every=1,
                            fps=16, sync=sync)
    ctx = SimpleNamespace(adapter=adapter, control=SimpleNamespace(evaluation=lambda: evaluation_session(adapter)),
                          state=SimpleNamespace(expert=expert), metrics=None)
    observer._round(3, ctx)
    torch.save({"latents": kept.get("latents", []), "calls": sync.relays()["low_noise"].calls,
                "resident": adapter.placement.resident(), "active": adapter.active}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_sample_across_two_expert_groups_equals_the_one_process_two_expert_sample_bit_for_bit(tmp_path):
    torch.set_num_threads(1)  # the ranks compute single-threaded: the same reduction order as this reference
    both = make_adapter("tiny-t2v", gradient_checkpointing=False)
    _lora_filled(both, ("high_noise", "low_noise"))
    text = both.encode_text(["a red ball"])["text_embeds"]
    stacked = distillation_lora(tmp_path / "stacked.safetensors", both.transformer_for("high_noise"))
    kept: dict = {}
    original = samples_module.latents_image
    try:
        _recording(kept)
        SampleVideos(out_dir=tmp_path / "one", jobs=_jobs(text, stacked), every=1, fps=16).sample(3, both)
    finally:
        samples_module.latents_image = original
    reference = {e: {k: v.clone() for k, v in both.transformer_for(e).state_dict().items()}
                 for e in ("high_noise", "low_noise")}
    mp.start_processes(_sampling_rank, args=(str(tmp_path / "store"), str(tmp_path), reference, text, stacked),
                       nprocs=2, start_method="fork")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert len(rank0["latents"]) == len(kept["latents"]) == 2
    for got, one_process in zip(rank0["latents"], kept["latents"], strict=True):
        assert torch.equal(got, one_process)  # bit for bit, the stacked LoRA acting on rank 1's expert too
    assert not torch.equal(kept["latents"][0], kept["latents"][1])
    assert (tmp_path / "rank0" / "step_000003_00.mp4").exists() and not (tmp_path / "rank1").exists()
    # 6 steps at boundary 0.875: the low-noise ones went to rank 1, twice each (the guided and the negative pass)
    assert rank1["calls"] == rank0["calls"] > 0 and rank1["calls"] % 4 == 0
    assert not any(m._forward_hooks for m in both.transformer_for("low_noise").modules())
    # rank 0's own expert stayed on the device throughout and is the active one again
    assert rank0["resident"] == ["high_noise"] and rank0["active"] == "high_noise"


# -- a whole run: four ranks, two per expert ---------------------------------------------------------------------------
RUN_SETTINGS = ["train.max_steps=4", "train.log_every=2", "observers.progress=false", "checkpoint.enabled=false",
                "optimizer.lr=3e-3"]
"""The expert-group run and its references. Inside a group of two ranks, rank ``r`` draws as rank ``r mod 2`` of a
two-rank data-parallel run of that expert (``core.parallel.expert_groups``) and the group's gradients are averaged as
that run's are (one all-reduce of two), so the LoRA files are compared byte for byte (tolerance 0)."""


def _launch_rank(rank: int, world: int, port: int, args: list[str], out: str) -> None:
    import faulthandler
    import os

    from wantrain.cli.main import main

    faulthandler.dump_traceback_later(240, exit=True)  # a hang fails the test
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    Path(f"{out}.{rank}").write_text(str(main(args)))


def _launch(workspace: Path, name: str, world: int, settings: list[str]) -> Path:
    """``wantrain run`` on ``world`` gloo ranks forked from the test process; the run directory."""
    launch_ranks(workspace, name, world, settings)
    (run_dir,) = [d for d in (workspace / name).iterdir() if d.is_dir()]
    return run_dir


def launch_ranks(workspace: Path, name: str, world: int, settings: list[str], flags: tuple[str, ...] = (),
                 code: str = "") -> None:
    """``wantrain run`` of ``workspace``'s quickstart into ``workspace / name`` on ``world`` gloo ranks forked from
    the test process (with :data:`RUN_SETTINGS`, then ``settings``, and the command line's ``flags``: ``--resume
    DIR``, ...); every rank must exit 0 (their exit codes go to ``workspace / (name + code + ".code.<rank>")``)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["run", str(workspace / "quickstart.toml"), *flags, "--set", f'run.output_dir="{workspace / name}"']
    for item in [*RUN_SETTINGS, *settings]:
        args += ["--set", item]
    codes = workspace / f"{name}{code}.code"
    mp.start_processes(_launch_rank, args=(world, port, args, str(codes)), nprocs=world, start_method="fork")
    assert [Path(f"{codes}.{r}").read_text() for r in range(world)] == ["0"] * world, name


def test_four_ranks_two_per_expert_train_what_two_data_parallel_one_expert_runs_train_and_sample_across(tmp_path):
    import json

    from safetensors.torch import load_file
    from test_end_to_end import copy_examples

    from wantrain.cli.main import main

    config = copy_examples(tmp_path, validation_and_samples=True)
    for extra in (tmp_path / "demo_data").glob("clip_01*"):  # fewer clips to cache (10 and 4 images)
        extra.unlink()
    assert main(["cache", str(config)]) == 0
    groups = _launch(tmp_path, "groups", 4, ["model.expert_groups=2", "sample.every=4", "validation.every=4",
                                             "sample.steps=4", "validation.from_training=2"])
    for expert in ("high_noise", "low_noise"):
        reference = _launch(tmp_path, expert, 2, [f'model.experts="{expert}"', "sample.enabled=false",
                                                  "validation.enabled=false"])
        name = f"quickstart_{expert}.safetensors"
        assert (groups / name).read_bytes() == (reference / name).read_bytes(), expert
        assert load_file(str(groups / name))  # a real file, not two empty ones
    # samples at step 0 and the last step, written by rank 0 with the low-noise steps relayed to rank 2
    assert sorted(p.name for p in (groups / "samples").glob("*.mp4")) == ["step_000000_00.mp4", "step_000004_00.mp4"]
    lines = [json.loads(x) for x in (groups / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r for r in lines if "val/loss" in r}
    assert sorted(val) == [0, 4] and {"val/loss/high_noise", "val/loss/low_noise"} <= set(val[4])
    # step 0's validation (both groups' timesteps, each on its group's share of the clips) is one process's
    assert main(["run", str(config), "--max-steps", "1", "--set", "sample.enabled=false", "--set",
                 "validation.from_training=2", "--set", f'run.output_dir="{tmp_path / "one"}"', "--set",
                 "observers.progress=false"]) == 0
    (one,) = [d for d in (tmp_path / "one").iterdir() if d.is_dir()]
    one_val = next(json.loads(x) for x in (one / "metrics.jsonl").read_text().splitlines() if '"val/loss"' in x)
    names = [n for n in one_val if n.startswith("val/")]
    assert len(names) > 3 and {n: val[0][n] for n in names} == pytest.approx({n: one_val[n] for n in names},
                                                                              rel=1e-12, abs=0)
    logged = [r for r in lines if "train/grad_norm" in r]
    assert logged
    for r in logged:  # the whole model's norm from both groups' (not their mean)
        parts = r["train/grad_norm/high_noise"] ** 2 + r["train/grad_norm/low_noise"] ** 2
        assert abs(r["train/grad_norm"] - parts ** 0.5) <= 1e-12 * r["train/grad_norm"], r
