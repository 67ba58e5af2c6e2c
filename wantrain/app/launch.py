"""The refusals of a launch: ``train.device`` against this machine, and each parallel layout (``model.parallel``
/ ``shard_degree``, ``model.sequence_degree``, ``model.expert_groups``) against the ranks of the launch, with what
evaluation cannot run under it. Each is a ``problems(cfg, machine)`` function (``core.problems``) that
``app.preflight`` asks with the others, once, before anything is loaded or written; the layouts themselves are
applied in ``app.assemble`` (``shard_experts``, ``split_sequences``) over the core's distributed modules."""

from __future__ import annotations

from typing import Any

import torch

from wantrain.core.problems import Machine, Problem, Rule, refuse

LAUNCH_RULES = (
    DEVICE_NAME := Rule("device-name", ("train.device",), "a train.device that is not a device"),
    NO_CUDA := Rule("device-no-cuda", ("train.device",), "train.device = 'cuda' on a machine without a CUDA GPU"),
    SHARD_DIVIDES := Rule("shard-degree-divides", ("model.shard_degree", "model.parallel", "model.expert_groups"),
                          "a shard degree that does not divide the ranks (of an expert group)"),
    SEQUENCE_LAUNCH := Rule("sequence-degree-launch", ("model.sequence_degree",),
                            "a sequence degree that one process or the ranks cannot split"),
    GROUPS_LAUNCH := Rule("expert-groups-launch", ("model.expert_groups",),
                          "expert groups that the launch's processes cannot split"),
    EVALUATION_LAYOUT := Rule("evaluation-under-layout",
                              ("validation.enabled", "sample.enabled", "model.parallel", "model.expert_groups"),
                              "[validation] or [sample] under torchrun fsdp inside expert groups",
                              ("[validation] / [sample]", "model.parallel = fsdp with expert_groups > 1 (torchrun)")),
    LR_FINDER_RESUME := Rule("lr-finder-resume", ("lr_finder.enabled",), "the LR finder with --resume",
                             ("LR finder", "--resume")),
    SEQUENCE_BUCKETS := Rule("sequence-degree-buckets", ("model.sequence_degree", "data.resolutions", "data.frames"),
                             "a bucket whose tokens the sequence degree does not divide"),
)


def device_problems(cfg: Any, machine: Machine) -> list[Problem]:
    """``train.device`` names a device, and one this machine has (``wantrain check`` plans for the machine the
    run will have: there CUDA on a machine without it is a note, :func:`device_note`)."""
    name = cfg.train.device
    if name == "auto":
        return []
    try:
        device = torch.device(name)
    except RuntimeError:
        return [DEVICE_NAME.problem(f"config key 'train.device' = {name!r} is not a device",
                                    "use 'auto', 'cpu' or 'cuda[:N]'")]
    if device.type == "cuda" and not machine.cuda and not machine.planning:
        return [NO_CUDA.problem("config key 'train.device' asks for CUDA but no CUDA GPU is available",
                                "use 'auto' or 'cpu'")]
    return []


def device_note(cfg: Any, machine: Machine) -> str | None:
    """``wantrain check``'s one line when the config trains on CUDA and this machine has none: the plan is for
    the card the run will have, and ``run`` here would refuse."""
    if str(cfg.train.device).startswith("cuda") and not machine.cuda:
        return ("this machine has no CUDA GPU, so it cannot run this config (train.device = "
                f"{cfg.train.device!r}); the plan is for the GPU the run will have (wantrain run refuses here)")
    return None


def layout_problems(cfg: Any, machine: Machine) -> list[Problem]:
    """The parallel layouts against the ``machine.world_size`` ranks of this launch (1 without torchrun): each
    degree must divide the ranks, expert groups need a multiple of their count, and [validation] / [sample] do not
    run with fsdp inside expert groups yet (the serving group's ranks would have to follow its leader's calls)."""
    model, world = cfg.model, machine.world_size
    if machine.planning and world == 1:  # `wantrain check` without --gpus: the launch is not known yet
        return []
    out = []
    degree = model.sequence_degree
    if degree > 1 and world == 1:
        out.append(SEQUENCE_LAUNCH.problem(
            f"model.sequence_degree = {degree} splits each clip over {degree} GPUs and needs a torchrun launch of a "
            f"multiple of {degree} ranks (this run is one process); launch it with torchrun --nproc_per_node "
            f"{degree}, or set sequence_degree = 1"))
    elif degree > 1 and world % degree:
        out.append(SEQUENCE_LAUNCH.problem(
            f"model.sequence_degree = {degree} does not divide the {world} ranks of this launch; launch a multiple "
            f"of {degree} ranks, or set sequence_degree to a divisor of {world}"))
    groups = model.expert_groups
    if groups > 1 and (world < groups or world % groups) and not machine.planning:
        started = "one process" if world == 1 else f"{world} processes"
        out.append(GROUPS_LAUNCH.problem(
            f"model.expert_groups = {groups} needs a torchrun launch of a multiple of {groups} processes (one group of "
            f"GPUs per expert), and this run has {started}; launch with torchrun --nproc_per_node {groups} (or "
            f"{2 * groups}, ...) or set model.expert_groups = 1"))
    if model.parallel != "fsdp" or world == 1:
        return out
    if groups > 1 and world % groups == 0:  # FSDP inside each expert group: the degree divides the group
        size = world // groups
        shard = model.shard_degree or size
        if size % shard:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            out.append(SHARD_DIVIDES.problem(
                f"model.shard_degree = {shard} does not divide the {size} ranks of an expert group ({world} ranks / "
                f"model.expert_groups = {groups}); use one of {', '.join(map(str, divisors))} (unset: all {size} of "
                "the group)", ""))
    shard = model.shard_degree or world
    if groups <= 1 and world % shard:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        out.append(SHARD_DIVIDES.problem(
            f"model.shard_degree = {shard} does not divide the {world} ranks of this launch; use one of "
            f"{', '.join(map(str, divisors))} (unset: all {world})"))
    if groups > 1:  # the serving group's other ranks would have to follow its leader's calls (not built)
        out.extend(_evaluation_problems(cfg, f"model.parallel = 'fsdp' inside model.expert_groups = {groups}",
                                        "the other expert's group serves rank 0's calls from its leader alone, "
                                        "and its sharded forward needs every rank of the group",
                                        ("validation", "sample")))
    return out


def _evaluation_problems(cfg: Any, layout: str, why: str, sections: tuple[str, ...]) -> list[Problem]:
    """Each of ``sections`` ([validation], [sample]) enabled under ``layout``, which it does not run with yet."""
    return [EVALUATION_LAYOUT.problem(
        f"[{section}] does not run with {layout} yet ({why}); set {section}.enabled = false, or evaluate the saved "
        "LoRA in a one-process run", keys=(f"{section}.enabled",)) for section in sections
        if getattr(cfg, section).enabled]


def lr_finder_launch_problems(cfg: Any, machine: Machine) -> list[Problem]:
    """The LR finder starts a fresh run: not with ``--resume``."""
    if cfg.lr_finder.active and machine.resuming:
        return [LR_FINDER_RESUME.problem(
            "the LR finder (--lr-finder, lr_finder.enabled / then_train) cannot run with --resume: it starts from a "
            "fresh run; resume without it (a then-train run's config.toml holds the suggested LR)", "")]
    return []


def parallel_notes(cfg: Any, world_size: int) -> list[str]:
    """The warnings a run logs about its layout: ``fsdp`` in one process trains unsharded (the same arithmetic: a
    checkpoint of either resumes in the other)."""
    if cfg.model.parallel == "fsdp" and world_size == 1:
        return ["model.parallel = 'fsdp' in one process: nothing to shard, the run trains unsharded (launch it "
                "with torchrun --nproc_per_node N to shard the weights over N GPUs)"]
    return []


def check_parallel(cfg: Any, world_size: int) -> list[str]:
    """:func:`layout_problems` for ``world_size`` ranks refused (one line each), else :func:`parallel_notes`
    (``wantrain check --gpus N`` asks this before it plans)."""
    refuse(layout_problems(cfg, Machine(world_size=world_size)))
    return parallel_notes(cfg, world_size)


def sequence_bucket_problems(cfg: Any, buckets: Any, clips: Any = ()) -> list[Problem]:
    """Every bucket's tokens per clip (latent frames x latent height x latent width over the patch) must split
    evenly over ``model.sequence_degree`` GPUs: each bucket that does not, named. A clip of ``clips`` with a
    reference image (VACE's ``.ref``) has one latent frame more than its bucket: its bucket is judged with it too."""
    from wantrain.models.wan22.memory import tokens_of
    from wantrain.models.wan22.variants import variant_spec

    degree = cfg.model.sequence_degree
    if degree == 1:
        return []
    spec = variant_spec(cfg.model.variant)
    referenced = {(c.width, c.height, c.frames) for c in clips if "ref" in getattr(c, "controls", {})}
    out = []
    for row in buckets:
        tokens = tokens_of(spec, row.width, row.height, row.frames, 1)
        with_ref = tokens + tokens_of(spec, row.width, row.height, 1, 1)  # the reference's own latent frame
        has_ref = (row.width, row.height, row.frames) in referenced
        bad = tokens if tokens % degree else with_ref if has_ref and with_ref % degree else None
        if bad is not None:
            whose = " with its clips' reference image" if bad == with_ref and tokens % degree == 0 else ""
            out.append(SEQUENCE_BUCKETS.problem(
                f"bucket {row.width}x{row.height}x{row.frames} has {bad} tokens per clip{whose}, which "
                f"model.sequence_degree = {degree} does not divide (each GPU takes an equal share); change "
                "data.resolutions or data.frames so every bucket's tokens divide, or the degree"))
    return out


def check_sequence_buckets(cfg: Any, buckets: Any, clips: Any = ()) -> None:
    """:func:`sequence_bucket_problems` refused."""
    refuse(sequence_bucket_problems(cfg, buckets, clips))
def planned_layout(cfg: Any, **degrees: int) -> Any:
    """``wantrain check --gpus N ...``'s layout (``rank_plan.Layout``), checked against the model: one line naming
    what is wrong (a sequence degree not dividing the heads, ...)."""
    from wantrain.models.wan22.rank_plan import Layout, check_layout

    layout = Layout(**degrees)
    check_layout(cfg.model.variant, layout)
    return layout


def expert_group_lines(cfg: Any, gpus: int | None) -> list[str]:
    """``wantrain check``: with ``model.expert_groups``, which ranks train which expert (``models.wan22.placement``);
    with ``model.parallel = "fsdp"`` too, which ranks shard each expert and which rank loads it."""
    from wantrain.models.wan22.placement import expert_group_lines as lines
    from wantrain.models.wan22.variants import VARIANTS

    out = lines(cfg.model, gpus)
    count = cfg.model.expert_groups
    if not out or cfg.model.parallel != "fsdp" or gpus is None or gpus % count:
        return out
    size = gpus // count
    degree = cfg.model.shard_degree or size
    out.append(f"sharding: FSDP inside each expert group (model.parallel = 'fsdp', {degree} GPU(s) per copy of the "
               "expert); each group loads its expert from its first rank, the others start on meta:")
    for g, expert in enumerate(VARIANTS[cfg.model.variant].experts):
        first = g * size
        copies = [f"{c}..{c + degree - 1}" if degree > 1 else str(c) for c in range(first, first + size, degree)]
        out.append(f"  {expert}: loaded on rank {first}, sharded over ranks " + " and ".join(copies)
                   + (f" ({len(copies)} copies, replicated: HSDP)" if len(copies) > 1 else "")
                   + f", each rank holding 1/{degree} of it")
    return out


def layout_lines(cfg: Any, report: Any, layout: Any) -> list[str]:
    """``wantrain check --gpus N ...``: the plan per GPU of ``layout`` (``models.wan22.rank_plan``) for the largest
    bucket of ``report`` (a ``preflight_report``), part by part. ``wantrain run`` trains the data-parallel, the
    FSDP (``model.parallel``), the expert-group (``model.expert_groups``) and the sequence-parallel
    (``model.sequence_degree``, data parallel across the groups) layouts under torchrun, FSDP with a sequence
    degree and FSDP inside expert groups; expert groups with a sequence degree are planned only
    (docs/distributed.md)."""
    from wantrain.app.memory_plan import trained_rank
    from wantrain.models.wan22.memory import AdapterSpec, MemorySettings
    from wantrain.models.wan22.rank_plan import rank_estimate

    bucket = (report.memory_plan or {}).get("bucket")
    if bucket is None:
        return []
    width, height, frames = (int(x) for x in bucket.split("x"))
    # planned as the one-GPU plan was: its settings (dtype, swap, offload, recompute), adapter type and kernel
    settings = MemorySettings(**report.memory_plan["settings"]) if "settings" in report.memory_plan else None
    estimate = rank_estimate(cfg.model.variant, layout, width=width, height=height, frames=frames,
                             rank=trained_rank(cfg), batch=cfg.train.batch_size, settings=settings,
                             adapter=AdapterSpec.of(cfg.lora), attention=cfg.model.attention,
                             gradient_checkpointing=cfg.model.gradient_checkpointing)
    # wantrain run trains data parallel, fsdp (model.parallel), expert groups and Ulysses, each alone, Ulysses with
    # fsdp (the sequence groups folded into the shard dimension) and fsdp inside expert groups
    runs = layout.expert_groups == 1 or layout.sequence_degree == 1
    status = "trainable under torchrun" if runs else "planned, not yet trainable"
    described = settings.describe() if settings is not None else "bf16 base, no block swap"
    lines = [f"plan per GPU at {bucket} ({described}; {status}: docs/distributed.md):",
             *("  " + line for line in estimate.lines())]
    if layout.shard_degree > 1:  # the load's peak: each GPU's shards and one whole tensor, rank 0's host copy
        from wantrain.models.wan22.rank_plan import load_peak, save_gather

        lines.append("  " + load_peak(cfg.model.variant, layout.shard_degree, trained_rank(cfg)).line(
            layout.shard_degree, layout.expert_groups))
        gather = save_gather(cfg.model.variant, layout, trained_rank(cfg), adapter=AdapterSpec.of(cfg.lora),
                             blocks_to_swap=settings.blocks_to_swap if settings is not None else 0)
        lines += ["  " + line for line in gather.lines()]  # each save: rank 0 gathers, the other GPUs send
    return lines
