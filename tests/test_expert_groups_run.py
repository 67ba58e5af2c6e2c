"""One expert per group of GPUs (``model.expert_groups = 2``) with what crosses the groups: sample videos whose
low-noise steps are relayed to the other group (``core.expert_relay``), on gloo ranks forked from the test process
(no fresh interpreter)."""

from __future__ import annotations

import datetime
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.multiprocessing as mp

from tests.models.wan22_helpers import make_adapter
from wantrain.core.adapter import evaluation_session
from wantrain.core.distributed import Topology
from wantrain.core.expert_groups import ExpertGroups, ExpertGroupSync
from wantrain.core.expert_relay import RelayedExpert
from wantrain.observers.evaluation import samples as samples_module
from wantrain.observers.evaluation.samples import SampleJob, SampleVideos


def _lora_filled(adapter, experts) -> None:
    """Give each expert's LoRA values of its own (a fresh LoRA's B is zero: the video would not show it)."""
    for expert in experts:
        g = torch.Generator().manual_seed(17 if expert == "high_noise" else 29)
        with torch.no_grad():
            for p in adapter.trainable_parameters(expert):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def _job(text: torch.Tensor) -> SampleJob:
    """Guided (a negative pass on each expert) over 6 steps, both bands."""
    return SampleJob(index=0, prompt_embeds=text, negative_embeds=text * 0, width=32, height=32, frames=5, seed=3,
                     steps=6, guidance_scale=2.0, guidance_scale_high_noise=3.0)


def _recording(monkeypatch_like: dict) -> None:
    """Keep each round's last latents (``latents_image`` is called with them) in ``monkeypatch_like``."""
    original = samples_module.latents_image

    def keep(latents, height):
        monkeypatch_like["latents"] = latents.detach().clone()
        return original(latents, height)

    samples_module.latents_image = keep


def _sampling_rank(rank: int, store: str, out: str, reference: dict, text: torch.Tensor) -> None:
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
    observer = SampleVideos(out_dir=Path(out) / f"rank{rank}", jobs=[_job(text)] if rank == 0 else [], every=1,
                            fps=16, sync=sync)
    ctx = SimpleNamespace(adapter=adapter, control=SimpleNamespace(evaluation=lambda: evaluation_session(adapter)),
                          state=SimpleNamespace(expert=expert), metrics=None)
    observer._round(3, ctx)
    torch.save({"latents": kept.get("latents"), "calls": sync.relays()["low_noise"].calls,
                "resident": adapter.placement.resident(), "active": adapter.active}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_a_sample_across_two_expert_groups_equals_the_one_process_two_expert_sample_bit_for_bit(tmp_path):
    torch.set_num_threads(1)  # the ranks compute single-threaded: the same reduction order as this reference
    both = make_adapter("tiny-t2v", gradient_checkpointing=False)
    _lora_filled(both, ("high_noise", "low_noise"))
    text = both.encode_text(["a red ball"])["text_embeds"]
    kept: dict = {}
    original = samples_module.latents_image
    try:
        _recording(kept)
        SampleVideos(out_dir=tmp_path / "one", jobs=[_job(text)], every=1, fps=16).sample(3, both)
    finally:
        samples_module.latents_image = original
    reference = {e: {k: v.clone() for k, v in both.transformer_for(e).state_dict().items()}
                 for e in ("high_noise", "low_noise")}
    mp.start_processes(_sampling_rank, args=(str(tmp_path / "store"), str(tmp_path), reference, text), nprocs=2,
                       start_method="fork")
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert torch.equal(rank0["latents"], kept["latents"])  # bit for bit
    assert (tmp_path / "rank0" / "step_000003_00.mp4").exists() and not (tmp_path / "rank1").exists()
    # 6 steps at boundary 0.875: the low-noise ones went to rank 1, twice each (the guided and the negative pass)
    assert rank1["calls"] == rank0["calls"] > 0 and rank1["calls"] % 2 == 0
    # rank 0's own expert stayed on the device throughout and is the active one again
    assert rank0["resident"] == ["high_noise"] and rank0["active"] == "high_noise"
