"""The Wan 2.2 model family: T2V-A14B, I2V-A14B, TI2V-5B and their tiny random twins (docs/models.md).

Public API used by the core, the data code and the CLI::

    build_adapter(model, lora, *, seed, device, base_lr) -> Wan22Adapter
    check_model_files(model)   # the model-file checks of build_adapter, loading nothing (wantrain check)
    Wan22Adapter, VariantSpec, VARIANTS, variant_spec, ModelConfig, LoraConfig
"""

from __future__ import annotations

from pathlib import Path

import torch

from wantrain.models.wan22.adapter import Wan22Adapter
from wantrain.models.wan22.config import LoraConfig, ModelConfig
from wantrain.models.wan22.loading import WeightSource
from wantrain.models.wan22.variants import VARIANTS, VariantSpec, variant_spec

__all__ = ["VARIANTS", "LoraConfig", "ModelConfig", "VariantSpec", "Wan22Adapter", "build_adapter", "build_encoders",
           "check_model_files", "variant_spec"]


def build_adapter(
    model: ModelConfig, lora: LoraConfig, *, seed: int, device: torch.device, base_lr: float,
    shard_load: str | None = None, waiting_folder: Path | None = None,
) -> Wan22Adapter:
    """Load (or, for tiny variants without a path, randomly build from ``seed``) the trained transformers, add one
    LoRA per trained expert, and return the adapter. The VAE and text encoder are not loaded until first used.
    ``shard_load`` (``model.parallel = "fsdp"`` under torchrun): the transformers are built on ``meta``, to be
    sharded and filled from rank 0 (``core.parallel.sharding.load_from_rank0``); ``"rank0"`` also loads them whole on
    the host as the source (``adapter.host_sources``), ``"meta"`` (the other ranks) reads no weight.
    ``waiting_folder``: where ``model.waiting_expert = "disk"`` writes the experts' waiting files (``waiting.py``;
    the run gives ``waiting_experts/`` of its cache folder).

    Raises ``UserError`` (one line) for a missing/incomplete model directory, a bad single file, or fp8 on CPU.
    """
    return Wan22Adapter(model, lora, seed=seed, device=torch.device(device), base_lr=base_lr, shard_load=shard_load,
                        waiting_folder=waiting_folder)


def check_model_files(model: ModelConfig, *, sampling: bool = False) -> None:
    """The checks ``build_adapter`` makes before loading anything -- ``model.path`` (or the single files) exists
    and holds every part the run needs, each transformer config matches the variant -- with the same one-line
    ``UserError``; reads only config files. With ``sampling`` (``[sample]`` on), also the other A14B expert's
    source when only one is trained, as ``Wan22Adapter.add_sampling_expert`` checks it. ``wantrain check`` runs
    them, so it refuses what ``run`` would."""
    source = WeightSource(model, seed=0)
    source.check_expert_files()  # tensor names only: a VAE given as an expert file is refused here, as run does
    for expert in model.untrained_experts if sampling else ():
        source.check_expert(expert, "needed to sample with one trained expert")


def build_encoders(model: ModelConfig, lora: LoraConfig, *, seed: int, device: torch.device) -> Wan22Adapter:
    """What filling the cache needs and nothing more: the VAE and the text encoder (loaded on first use, on
    ``device``) with the identities cache keys are made of; no transformer is loaded (``wantrain cache``). Text
    embeddings come out in the dtype training computes in (bf16 for ``base_dtype = "fp8"``, on any device)."""
    return Wan22Adapter(model, lora, seed=seed, device=torch.device(device), base_lr=0.0, transformers=False)
