"""The device a run trains on and what it runs there: ``train.device`` resolved (``auto``: CUDA when this machine
has it), the dtype the blocks compute in, the attention kernel and the compile plan (:func:`speed_plan`), and the
folders in the data's cache that the compile cache and the waiting experts use."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from wantrain.app.launch import device_problems
from wantrain.core.problems import Machine, refuse
from wantrain.models.wan22.variants import variant_spec


def compute_dtype(model: Any) -> torch.dtype:
    """The dtype the blocks compute in: fp32 for ``base_dtype = "fp32"`` (and ``auto`` on a tiny twin), else bf16."""
    fp32 = model.base_dtype == "fp32" or (model.base_dtype == "auto" and variant_spec(model.variant).tiny)
    return torch.float32 if fp32 else torch.bfloat16


def planned_device(name: str) -> torch.device:
    """The device the run trains on, as planned: ``auto`` is CUDA where this machine has it; a named device as
    named, whether or not this machine has it (``device_problems`` judges that)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else torch.device(name)


def resolve_device(name: str) -> torch.device:
    """``train.device`` as a device (``auto``: CUDA when this machine has it); its problems
    (:func:`app.launch.device_problems`) refused."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    refuse(device_problems(SimpleNamespace(train=SimpleNamespace(device=name)), Machine.here()))
    return torch.device(name)


def speed_plan(cfg: Any, data: Any, device: torch.device) -> dict[str, Any]:
    """The attention kernel (``model.attention``) and the compile plan (``model.compile``) of a run on ``device``,
    into ``data.report.speed`` (``check`` prints its lines; the run's ``preflight.json``). A kernel whose package is
    missing or that the device cannot run, or a compile the toolchain cannot do, was reported by the pre-flight
    (:func:`problems`) already; refused here too for a caller in code. The compile cache is ``torch_compile/`` in the
    data's cache folder."""
    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.attention import check_kernel
    from wantrain.models.wan22.compile import CompilePlan, check_compiler

    model = cfg.model
    spec = variant_spec(model.variant)
    fp32 = model.base_dtype == "fp32" or (model.base_dtype == "auto" and spec.tiny)
    kernel = check_kernel(model.attention, device, torch.float32 if fp32 else torch.bfloat16)
    check_compiler(model.compile, device)
    cache = compile_cache_dir(data) if model.compile != "off" else None
    plan = CompilePlan(model.compile, model.compile_dynamic, transformer_kwargs(spec)["num_layers"], cache)
    speed = {"attention": kernel.name, "attention_backend": kernel.backend, "compile": plan.to_json(),
             "lines": [f"attention: {kernel.name} ({kernel.describe}; diffusers backend '{kernel.backend}')",
                       *plan.lines()]}
    data.report.speed = speed
    return speed


def compile_cache_dir(data: Any) -> Path | None:
    """``torch_compile/`` in the cache folder of the run's first clip (``data.cache_dir`` or the dataset's
    ``.wantrain_cache``); None without clips."""
    clips = getattr(data, "clips", None)
    return Path(clips[0].cache_dir) / "torch_compile" if clips else None


def waiting_experts_dir(data: Any) -> Path | None:
    """``waiting_experts/`` in the cache folder of the run's first clip: where ``model.waiting_expert = "disk"``
    keeps the experts' waiting files (``models/wan22/waiting.py``)."""
    clips = getattr(data, "clips", None)
    return Path(clips[0].cache_dir) / "waiting_experts" if clips else None
