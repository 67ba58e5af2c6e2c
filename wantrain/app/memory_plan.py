"""The memory plan of a run (``wantrain check`` prints it; ``prepare`` runs with it): the device plan for the largest
bucket (with ``model.vram_budget_gb`` the planner's choice of dtype, block swap and activation offload), then the
host plan against the host RAM budget (:func:`plan_host`). Each writes its lines into the data report; a budget
nothing fits, a plan no device fits and a host that cannot hold the run are one-line ``UserError`` s (they depend
on the data's largest bucket, so they are judged once the data is probed, not with the config's rules)."""

from __future__ import annotations

import functools
from typing import Any

import attrs

from wantrain.core.errors import UserError
from wantrain.models.wan22.lora_files import resolve_init
from wantrain.models.wan22.variants import variant_spec
from wantrain.models.wan22.waiting import problems as waiting_problems
from wantrain.observers.evaluation.config import sample_size

LARGEST_DEVICE_GIB = 288.0
"""About the memory of the largest single accelerators sold (B300, MI355X: 288 GB): a plan that needs more with its
smallest setting fits no device, and is refused by ``check`` and ``run`` alike."""


def plan_memory(cfg: Any, data: Any, *, gpus: int | None = None) -> Any:
    """The ``[model]`` section the run trains with: with ``model.vram_budget_gb`` the planner's choice of
    ``base_dtype`` (when ``auto``), ``blocks_to_swap`` and ``offload_activations`` for the largest bucket, else the
    section as it is. With ``[sample]`` on, the plan covers sampling at the sample size too (the card needs the
    larger peak). The estimate, part by part, goes into ``data.report.memory_plan`` (``wantrain check`` prints it;
    the run's ``preflight.json``). A budget nothing fits is a one-line ``UserError`` naming the smallest setting
    and what would fit; so is a plan no device fits (:data:`LARGEST_DEVICE_GIB`)."""
    from wantrain.models.wan22.memory import AdapterSpec, MemorySettings, SampleSize, estimate, plan

    model = cfg.model
    buckets = data.report.buckets
    if not buckets:
        return model
    spec = variant_spec(model.variant)
    b = max(buckets, key=lambda r: (r.width * r.height * r.frames, r.frames))
    size = dict(width=b.width, height=b.height, frames=b.frames, rank=trained_rank(cfg), batch=cfg.train.batch_size,
                adapter=AdapterSpec.of(cfg.lora))
    if cfg.sample.enabled:
        size["sample"] = SampleSize(*sample_size(cfg.sample, spec), guidance=cfg.sample.guidance_scale > 1)
    dtype = model.base_dtype
    if dtype == "auto" and spec.tiny:
        dtype = "fp32"
    # model.recompute 'auto' without a budget is the whole block (recompute.py); with one the planner chooses
    recompute = "lean" if model.recompute == "lean" and model.gradient_checkpointing else "block"
    per_gpu = None  # under fsdp with a budget: the per-GPU plan it was held against
    if model.vram_budget_gb is None:
        settings = MemorySettings("bf16" if dtype == "auto" else dtype, model.blocks_to_swap, model.offload_activations,
                                  recompute)
        chosen = estimate(model.variant, settings, **size, attention=model.attention,
                          gradient_checkpointing=model.gradient_checkpointing)
        if chosen.device_gib > LARGEST_DEVICE_GIB and plan(model.variant, LARGEST_DEVICE_GIB, base_dtype=dtype,
                                                           **size)[0] is None:
            _, smallest = plan(model.variant, 0.0, base_dtype=dtype, **size)
            raise UserError(
                f"the largest bucket {b.width}x{b.height}x{b.frames} needs {smallest.device_gib:,.0f} GiB of device "
                f"memory even with the smallest setting ({smallest.settings.describe()}), more than any accelerator "
                f"has (the largest hold about {LARGEST_DEVICE_GIB:g} GiB); lower data.resolutions, data.frames, "
                "train.batch_size or lora.rank"
            )
    elif model.parallel == "fsdp":  # the budget holds per GPU, with the shard, and picks what fsdp runs with
        chosen, per_gpu = _plan_sharded(cfg, dtype, size, b, gpus)
        model = attrs.evolve(model, vram_budget_gb=None, offload_activations=chosen.settings.offload_activations,
                             blocks_to_swap=chosen.settings.blocks_to_swap,
                             recompute=chosen.settings.recompute if model.gradient_checkpointing else model.recompute,
                             base_dtype=model.base_dtype if dtype != "auto" else chosen.settings.base_dtype)
    else:
        chosen, smallest = plan(model.variant, model.vram_budget_gb, base_dtype=dtype, **size,
                                attention=model.attention,
                                recompute=model.recompute if model.gradient_checkpointing else "block",
                                low_bit=dtype == "auto" and _may_plan_low_bit(model))
        if chosen is None:
            raise UserError(
                f"model.vram_budget_gb = {model.vram_budget_gb:g}: nothing fits the largest bucket "
                f"{b.width}x{b.height}x{b.frames} (the smallest setting, {smallest.settings.describe()}, needs "
                f"{smallest.device_gib:.1f} GiB); {_what_fits(model.variant, model.vram_budget_gb, dtype, size)}"
            )
        model = attrs.evolve(model, vram_budget_gb=None, blocks_to_swap=chosen.settings.blocks_to_swap,
                             offload_activations=chosen.settings.offload_activations,
                             recompute=chosen.settings.recompute if model.gradient_checkpointing else model.recompute,
                             base_dtype=model.base_dtype if dtype != "auto" else chosen.settings.base_dtype)
    _record_plan(cfg, data, b, chosen, per_gpu)  # the device plan, should the host plan refuse
    # fsdp keeps the base in bf16: the host plan may not move it to fp8 or int8 / nf4 either
    model, chosen, host = plan_host(cfg, model, chosen, size, auto_dtype=dtype == "auto" and model.parallel != "fsdp",
                                    gpus=gpus)
    _record_plan(cfg, data, b, chosen, per_gpu)
    data.report.host_memory = host
    return model


def _record_plan(cfg: Any, data: Any, b: Any, chosen: Any, per_gpu: Any = None) -> None:
    lines = chosen.lines()
    if cfg.model.vram_budget_gb is not None:  # the budget is the usable memory the card figure is held against
        budget = cfg.model.vram_budget_gb
        card, where = ((per_gpu.card_gib, f"per GPU under fsdp, {per_gpu.layout.describe()}: {per_gpu.card_gib:.2f} "
                        "GiB planned; ") if per_gpu is not None else (chosen.device_gib, ""))
        lines.append(f"  {'usable memory':<28} {budget:7.2f} GiB (model.vram_budget_gb; {where}"
                     f"{budget - card:.2f} GiB of it to spare)")
    data.report.memory_plan = {"budget_gib": cfg.model.vram_budget_gb, "bucket": f"{b.width}x{b.height}x{b.frames}",
                               "lines": lines, **chosen.to_json()}


def _plan_sharded(cfg: Any, dtype: str, size: dict, b: Any, gpus: int | None) -> tuple[Any, Any]:
    """``model.vram_budget_gb`` under ``model.parallel = "fsdp"``: (the one-GPU estimate of the settings chosen,
    for the report and the host plan; the per-GPU estimate they were chosen by) (``rank_plan.plan_sharded``: bf16;
    the recompute path, activation offload and block swap -- FSDP2's CPU offload of the shards -- planned per GPU of
    the launch's shard degree, in the one-GPU planner's order). Nothing that fits is a one-line ``UserError``."""
    from wantrain.models.wan22.memory import estimate
    from wantrain.models.wan22.rank_plan import Layout, plan_sharded

    model = cfg.model
    ranks, _ = _ranks_on_host(gpus)
    groups = max(model.expert_groups, 1)
    layout = Layout(gpus=ranks, expert_groups=groups, shard_degree=model.shard_degree or max(ranks // groups, 1),
                    sequence_degree=model.sequence_degree)
    recompute = model.recompute if model.gradient_checkpointing else "block"
    shape = {k: v for k, v in size.items() if k != "sample"}  # the plan per GPU is the training step's
    per_gpu, smallest = plan_sharded(model.variant, model.vram_budget_gb, layout,
                                     base_dtype="bf16" if dtype == "auto" else dtype, recompute=recompute,
                                     attention=model.attention, gradient_checkpointing=model.gradient_checkpointing,
                                     **shape)
    if per_gpu is None:
        raise UserError(
            f"model.vram_budget_gb = {model.vram_budget_gb:g}: under model.parallel = 'fsdp' ({layout.describe()}) "
            f"nothing fits the largest bucket {b.width}x{b.height}x{b.frames} (the smallest setting fsdp runs with, "
            f"{smallest.settings.describe()}, needs {smallest.card_gib:.1f} GiB per GPU); raise the budget, shard "
            "over more GPUs, or lower data.resolutions, data.frames, train.batch_size or lora.rank")
    chosen = estimate(model.variant, per_gpu.settings, **size, attention=model.attention,
                      gradient_checkpointing=model.gradient_checkpointing)
    return chosen, per_gpu


def plan_host(cfg: Any, model: Any, chosen: Any, size: dict, *, auto_dtype: bool,
              gpus: int | None = None) -> tuple[Any, Any, dict]:
    """Fit the host plan to the host RAM budget (``model.host_ram_budget_gb``, else this machine's available RAM):
    the VRAM plan ``chosen`` as it is, then (``base_dtype = "auto"``) its fp8 counterpart, each pinned and then
    pageable; then (``model.waiting_expert = "auto"`` with two trained experts) the same with the waiting expert on
    disk; then (``auto``, where :func:`_may_plan_low_bit`) int8 and nf4 alike, resident then on disk. Returns
    (the model section to run with, the device estimate, the host lines for ``check``); nothing that fits is a
    one-line ``UserError`` naming the smallest plan and what would fit."""
    from wantrain.models.wan22.memory import AUTO_LOW_BIT, GIB, auto_dtypes, available_host_bytes, estimate, plan

    stated = model.host_ram_budget_gb
    budget = stated * GIB if stated is not None else available_host_bytes()
    where = (f"model.host_ram_budget_gb = {stated:g}" if stated is not None
             else f"this machine's available RAM ({budget / GIB:.1f} GiB)")

    low_bit = auto_dtype and _may_plan_low_bit(model)

    @functools.cache
    def option(dtype: str | None) -> tuple[Any, Any] | None:
        """(the model section, its device estimate) with the base stored in ``dtype`` (None: as planned), planned
        once, when first reached; None where that storage does not apply or does not fit the card."""
        if dtype is None:
            return model, chosen
        # fp8 and int8 / nf4 shrink the host copies of the blocks' Linears (they need gradient checkpointing); each
        # only after the storage the card's plan took (base_dtype = "auto": memory.auto_dtypes' order)
        later = auto_dtypes(True)
        planned = chosen.settings.base_dtype
        if not (auto_dtype and model.gradient_checkpointing and planned in later
                and later.index(dtype) > later.index(planned)):
            return None
        if cfg.model.vram_budget_gb is not None:
            est, _ = plan(model.variant, cfg.model.vram_budget_gb, base_dtype=dtype, **size,
                          attention=chosen.attention_kernel, recompute=cfg.model.recompute)
        else:
            est = estimate(model.variant, attrs.evolve(chosen.settings, base_dtype=dtype), **size,
                           attention=chosen.attention_kernel)
        if est is None:
            return None
        return attrs.evolve(model, base_dtype=dtype, blocks_to_swap=est.settings.blocks_to_swap,
                            offload_activations=est.settings.offload_activations,
                            recompute=est.settings.recompute), est

    # the waiting expert on disk (models/wan22/waiting.py) after the resident plans of the same storages: each switch
    # then reads an expert from the disk; the low-bit storages (base_dtype = "auto") only where no bf16 / fp8 plan
    # fits, with the waiting expert on disk included (they cost quality or speed at every step)
    wait = ("resident", "disk") if model.waiting_expert == "auto" and not waiting_problems(model, "disk") \
        else (model.waiting_expert,)
    pins = (True, False) if model.pin_host_copies else (False,)
    storages = [(None, "fp8"), AUTO_LOW_BIT if low_bit else ()]
    order = [(waiting, dtype) for group in storages for waiting in wait for dtype in group]

    tried = []
    for waiting, dtype in order:
        planned = option(dtype)
        if planned is None:
            continue
        stored, device_est = planned
        for pin in pins:
            candidate = attrs.evolve(stored, pin_host_copies=pin, waiting_expert=waiting)
            est = host_estimate_of(cfg, candidate, device_est.settings, size, gpus=gpus)
            tried.append((candidate, est))
            if est.peak <= budget:
                changes = _host_changes(model, candidate)
                head = [f"  budget {budget / GIB:.2f} GiB ({where}): fits"
                        + (f" with {changes} (the plan as configured needs {tried[0][1].peak / GIB:.1f} GiB)"
                           if changes else "")]
                return candidate, device_est, {"budget_gib": budget / GIB, "lines": head + est.lines(),
                                               "cuda": _trains_on_cuda(cfg, model), **est.to_json()}
    first, smallest = tried[0], min(tried, key=lambda t: t[1].peak)
    best = _host_changes(model, smallest[0])
    raise UserError(
        f"host memory: the run needs {first[1].peak / GIB:.1f} GiB of RAM at its peak ({first[1].peak_phase}; "
        f"largest part: {first[1].dominant}) but {where} is {budget / GIB:.1f} GiB; "
        + (f"the smallest plan ({best}) needs {smallest[1].peak / GIB:.1f} GiB; " if best else "")
        + "free RAM, train one expert (model.experts), use fewer frames, or set model.host_ram_budget_gb for the "
        f"machine that will run it (at least {smallest[1].peak / GIB:.1f})"
    )


def _may_plan_low_bit(model: Any) -> bool:
    """Whether ``base_dtype = "auto"`` may take int8 / nf4 for ``model``: bitsandbytes is installed and the blocks
    are checkpointed (as for fp8)."""
    from wantrain.models.wan22.memory import low_bit_available

    return model.gradient_checkpointing and low_bit_available()


def _host_changes(configured: Any, chosen: Any) -> str:
    """What the host plan changed in the (VRAM-planned) model section ``configured``, in config keys (empty:
    nothing)."""
    out = []
    if chosen.base_dtype != configured.base_dtype:
        out.append(f'base_dtype = "{chosen.base_dtype}"')
    if chosen.pin_host_copies != configured.pin_host_copies:
        out.append("pin_host_copies = false")
    if chosen.waiting_expert == "disk" and configured.waiting_expert != "disk":
        out.append('waiting_expert = "disk"')
    return " and ".join(out)


def _trains_on_cuda(cfg: Any, model: Any) -> bool:
    """A real model is taken to train on CUDA unless ``train.device`` says otherwise (pinned copies)."""
    device = str(cfg.train.device)
    return device.startswith("cuda") or (device == "auto" and not variant_spec(model.variant).tiny)


def host_estimate_of(cfg: Any, model: Any, settings: Any, size: dict, *, gpus: int | None = None) -> Any:
    """The run's host memory, part by part (``memory.host_estimate``): the encoders are counted as loaded (they
    are not when every clip and caption is cached already and [sample] is off), in the order the run loads them:
    in one process before the experts (``app.assemble.encode_before_the_experts``), under torchrun after them; the
    pin budget is half of ``model.host_ram_budget_gb`` (else of the machine's memory), as the placement takes it.
    The figures are one rank's; with ranks (``gpus``, or torchrun's ``LOCAL_WORLD_SIZE`` per machine) the
    machine's sum follows (:func:`_ranks_on_host`), and under ``model.parallel = "fsdp"`` the loading rank (rank 0,
    or each expert group's leader) holds the expert whole while loading, the others none of it."""
    from wantrain.core.parallel.distributed import detect_topology
    from wantrain.models.wan22.memory import host_estimate
    from wantrain.models.wan22.placement import host_experts, pin_budget

    # sampling with one trained A14B expert loads the other one frozen (adapter.add_sampling_expert); with expert
    # groups each rank holds one expert and the other group's is relayed (a torchrun launch: encoders after)
    experts, other = host_experts(model, cfg.sample.enabled)
    launched = detect_topology().distributed or model.expert_groups > 1
    ranks, on_host = _ranks_on_host(gpus)
    launched = launched or ranks > 1
    load: dict[str, Any] = {}
    if model.parallel == "fsdp" and ranks > 1:
        from wantrain.models.wan22.rank_plan import load_peak

        groups = max(model.expert_groups, 1)
        group = max(ranks // groups, 1)
        source = load_peak(model.variant, model.shard_degree or group, size["rank"],
                           dtype_name="fp32" if settings.base_dtype == "fp32" else "bf16").rank0_host
        # the leaders on the first machine: ranks 0, group, 2 x group ... below the ranks it holds
        load = dict(load_source=source, loaders_on_host=min(groups, -(-on_host // group)))
        if settings.blocks_to_swap:  # FSDP2 offloads the swapped blocks' shards: 1/degree of them on each rank's host
            from wantrain.models.wan22.rank_offload import offloaded_shards

            frozen, lora, rounding = offloaded_shards(model.variant, model.shard_degree or group,
                                                      settings.blocks_to_swap, size["rank"])
            pinned = rounding if _trains_on_cuda(cfg, model) and model.pin_host_copies else 0.0
            load["offloaded_shards"] = len(experts) * (frozen + lora + pinned)  # each of this rank's experts
            settings = attrs.evolve(settings, blocks_to_swap=0)  # no one-GPU swap copies
    return host_estimate(model.variant, settings, experts=experts, cuda=_trains_on_cuda(cfg, model),
                         sampling_only=other, pin=model.pin_host_copies,
                         pin_budget=pin_budget(model.host_ram_budget_gb), encoders_first=not launched,
                         ranks_on_host=on_host, waiting=model.waiting_expert, switch_every=model.switch_every,
                         **load, **{k: v for k, v in size.items() if k != "sample"})


def _ranks_on_host(gpus: int | None) -> tuple[int, int]:
    """(ranks in all, ranks on the first machine): ``check --gpus N`` plans N ranks on one machine; under torchrun
    its ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE``; else one process."""
    import os

    from wantrain.core.parallel.distributed import detect_topology

    if gpus is not None:
        return gpus, gpus
    world = detect_topology().world_size
    return world, int(os.environ.get("LOCAL_WORLD_SIZE", world) or world) if world > 1 else 1


def _what_fits(variant: str, budget: float, dtype: str, size: dict) -> str:
    """What would fit ``budget``: fewer frames (training or, when training alone fits, sampling) with the smallest
    setting, or a budget."""
    from wantrain.models.wan22.memory import plan

    sample = size.get("sample")
    if sample is not None and plan(variant, budget, base_dtype=dtype, **{**size, "sample": None})[0] is not None:
        _, smallest = plan(variant, 0.0, base_dtype=dtype, **size)
        head = (f"training fits but sampling does not ([sample] {sample.describe()} needs "
                f"{smallest.sampling_gib:.1f} GiB at best)")
        for f in range(sample.frames - 4, 0, -4):
            if plan(variant, budget, base_dtype=dtype, **{**size, "sample": attrs.evolve(sample, frames=f)})[0]:
                return f"{head}; sample.frames = {f} would fit, or a budget of {_smallest_budget(variant, dtype, size)}"
        return f"{head}; a smaller sample.width/height or a budget of {_smallest_budget(variant, dtype, size)}"
    width, height, frames = size["width"], size["height"], size["frames"]
    for f in range(frames - 4, 0, -4):
        if plan(variant, budget, base_dtype=dtype, **{**size, "frames": f})[0] is not None:
            return f"{f} frames at {width}x{height} would fit, or a budget of {_smallest_budget(variant, dtype, size)}"
    return f"a budget of {_smallest_budget(variant, dtype, size)} would fit"


def _smallest_budget(variant: str, dtype: str, size: dict) -> str:
    from wantrain.models.wan22.memory import plan

    _, smallest = plan(variant, 0.0, base_dtype=dtype, **size)
    return f"{smallest.device_gib:.1f} GiB"


def trained_rank(cfg: Any) -> int:
    """The LoRA rank the run trains at: ``lora.rank``, or the rank of the ``lora.init_from*`` files (their headers)."""
    if cfg.lora.starts_from_files:
        lora, _ = resolve_init(cfg.lora, cfg.model)
        return lora.rank
    return cfg.lora.rank
