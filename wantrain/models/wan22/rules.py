"""The refusal rules of the Wan 2.2 plug-in's sections, declared beside the code they protect (``core.problems``):
``[model]``'s keys among themselves (:func:`model_problems`), ``[lora]``'s (:func:`lora_problems`), and the adapter
type against the model's storage and layout (:func:`adapter_problems`, a rule across sections). The sections
(``models.wan22.config``) hand their problems to ``core.problems.refuse`` when they are built; ``app.preflight``
lists these functions in the one pre-flight pass and :data:`MODEL_RULES`, :data:`LORA_RULES` and
:data:`ADAPTER_RULES` in its declared rules (the source of docs/config.md's compose table)."""

from __future__ import annotations

import re
from typing import Any

import torch

from wantrain.core.problems import Problem, Rule
from wantrain.models.wan22.adapter_types import check_pattern
from wantrain.models.wan22.dtypes import QUANTISED_DTYPES
from wantrain.models.wan22.variants import VARIANTS
from wantrain.models.wan22.waiting import problems as waiting_problems

ModelConfig = LoraConfig = Any  # models.wan22.config's sections, which ask these rules (not imported: no circle)

R = Rule  # the rules of [model], declared beside the section they judge (core.problems)


MODEL_RULES = (
    OFFLOAD_DEVICE := R("offload-device", ("model.offload_device",), "an offload device that is not 'cpu' or 'cuda:N'"),
    SWAP_BEYOND_BLOCKS := R("swap-beyond-blocks", ("model.blocks_to_swap", "model.variant"),
                            "more blocks to swap than the variant has"),
    SWAP_NEEDS_CHECKPOINTING := R("swap-needs-checkpointing",
                                  ("model.blocks_to_swap", "model.gradient_checkpointing"),
                                  "block swap without gradient checkpointing",
                                  ("model.blocks_to_swap > 0", "model.gradient_checkpointing = false")),
    LEAN_NEEDS_CHECKPOINTING := R("lean-needs-checkpointing", ("model.recompute", "model.gradient_checkpointing"),
                                  "lean recompute without gradient checkpointing",
                                  ("model.recompute = lean", "model.gradient_checkpointing = false")),
    BUDGET_CHOOSES_SWAP := R("budget-chooses-swap",
                             ("model.vram_budget_gb", "model.blocks_to_swap", "model.offload_activations"),
                             "a VRAM budget beside the swap settings it chooses",
                             ("model.vram_budget_gb", "model.blocks_to_swap / offload_activations")),
    FP8_NEEDS_CHECKPOINTING := R("fp8-needs-checkpointing", ("model.base_dtype", "model.gradient_checkpointing"),
                                 "fp8 storage without gradient checkpointing",
                                 ("model.base_dtype = fp8", "model.gradient_checkpointing = false")),
    SAGE_CANNOT_TRAIN := R("sage-cannot-train", ("model.attention",), "SageAttention, which has no backward pass"),
    DYNAMIC_NEEDS_COMPILE := R("dynamic-needs-compile", ("model.compile_dynamic", "model.compile"),
                               "compile_dynamic without compile"),
    ONE_TRANSFORMER_KEYS := R("one-transformer-keys",
                              ("model.variant", "model.experts", "model.high_noise_file", "model.low_noise_file",
                               "model.lr_high_noise", "model.lr_low_noise"),
                              "an A14B expert key on a one-transformer variant"),
    TRANSFORMER_FILE_ON_A14B := R("transformer-file-on-a14b", ("model.variant", "model.transformer_file"),
                                  "model.transformer_file on a two-expert variant"),
    GROUPS_NEED_BOTH := R("expert-groups-need-both", ("model.expert_groups", "model.variant", "model.experts"),
                          "expert groups without two trained experts",
                          ("model.expert_groups > 1", "model.experts = one expert")),
    T_RANGE := R("timestep-range", ("model.min_t", "model.max_t", "model.experts", "model.variant"),
                 "a timestep range that is empty or outside the trained experts'"),
    SHARD_NEEDS_FSDP := R("shard-degree-needs-fsdp", ("model.shard_degree", "model.parallel"),
                          "model.shard_degree without model.parallel = 'fsdp'"),
    FSDP_MEMORY := R("fsdp-memory-settings",
                     ("model.parallel", "model.base_dtype"),
                     "fsdp with fp8 / quantised storage",
                     ("model.parallel = fsdp", "fp8")),
    SEQUENCE_HEADS := R("sequence-degree-heads", ("model.sequence_degree", "model.variant"),
                        "a sequence degree that does not divide the attention heads"),
    SEQUENCE_GROUPS := R("sequence-expert-groups", ("model.sequence_degree", "model.expert_groups"),
                         "a sequence degree inside expert groups",
                         ("model.sequence_degree > 1", "model.expert_groups > 1")),
    WAITING_DISK := R("waiting-expert-disk", ("model.waiting_expert", "model.experts", "model.expert_groups"),
                      "the waiting expert on disk where no expert waits (one expert, or expert groups)",
                      ("model.waiting_expert = disk", "one trained expert or model.expert_groups > 1")),
    CONTROL_VARIANT := R("control-variant",
                         ("model.condition", "model.vace_blocks", "model.variant"),
                         "a control setting its variant lacks (first_last off I2V, vace_blocks off VACE)"),
)


def model_problems(model: ModelConfig) -> list[Problem]:
    """Every problem of the ``[model]`` keys among themselves (the section refuses them when built, and the
    config loader reports them beside the document's other problems)."""
    spec = VARIANTS[model.variant]
    out = [*_parallel_problems(model), *_sequence_problems(model)]
    try:
        offload = torch.device(model.offload_device)
    except (RuntimeError, ValueError):
        offload = None
    if offload is None or offload.type == "meta":
        out.append(OFFLOAD_DEVICE.problem(f"model.offload_device = {model.offload_device!r} is not a usable device",
                                          "use 'cpu' or 'cuda:N'"))
    if model.blocks_to_swap > spec.all_blocks:
        vace = f" ({spec.num_layers} main + {len(spec.vace_layers)} VACE)" if spec.vace else ""
        out.append(SWAP_BEYOND_BLOCKS.problem(
            f"model.blocks_to_swap = {model.blocks_to_swap} exceeds the {spec.all_blocks} blocks{vace} of "
            f"{model.variant}; use 0..{spec.all_blocks}"))
    if model.blocks_to_swap and not model.gradient_checkpointing:
        out.append(SWAP_NEEDS_CHECKPOINTING.problem(
            "model.blocks_to_swap needs model.gradient_checkpointing = true (without it every block's weights "
            "stay referenced until the backward pass and the swap saves nothing)", "set it, or blocks_to_swap = 0"))
    if model.recompute == "lean" and not model.gradient_checkpointing:
        out.append(LEAN_NEEDS_CHECKPOINTING.problem(
            "model.recompute = 'lean' is a way of recomputing checkpointed blocks and needs "
            "model.gradient_checkpointing = true; set it, or model.recompute = 'auto'"))
    if model.vram_budget_gb is not None and (model.blocks_to_swap or model.offload_activations):
        out.append(BUDGET_CHOOSES_SWAP.problem(
            "model.vram_budget_gb chooses blocks_to_swap and offload_activations itself",
            "remove those two keys or the budget"))
    if model.base_dtype in QUANTISED_DTYPES and not model.gradient_checkpointing:
        # fp8 and low-bit storages compute each Linear from a bf16 copy of its weight, and autograd keeps that
        # copy for the backward in every block: more memory than bf16 storage (tests/data/test_vram_estimate.py)
        out.append(FP8_NEEDS_CHECKPOINTING.problem(
            f"model.base_dtype = '{model.base_dtype}' with model.gradient_checkpointing = false keeps a bf16 copy "
            "of every frozen Linear for the backward (more memory than 'bf16'); set gradient_checkpointing = "
            "true or base_dtype = 'bf16'"))
    if model.attention == "sage":
        out.append(SAGE_CANNOT_TRAIN.problem(
            "model.attention = 'sage' cannot train: SageAttention has no backward pass (its int8 Q/K forward is "
            "for inference), so the LoRA on the attention's projections would get no gradient; use 'sdpa', "
            "'flash' or 'xformers'"))
    if model.compile_dynamic is not None and model.compile == "off":
        out.append(DYNAMIC_NEEDS_COMPILE.problem(
            "model.compile_dynamic applies to a compiled model; set model.compile = 'default' or "
            "'max-autotune-no-cudagraphs', or remove model.compile_dynamic"))
    if spec.boundary_ratio is None:
        if model.experts != "both":
            out.append(ONE_TRANSFORMER_KEYS.problem(
                f"model.experts = {model.experts!r} is not valid for {model.variant}: it has one transformer; "
                "leave model.experts at 'both'", keys=("model.experts", "model.variant")))
        for key in ("high_noise_file", "low_noise_file", "lr_high_noise", "lr_low_noise"):
            if getattr(model, key) is not None:
                out.append(ONE_TRANSFORMER_KEYS.problem(
                    f"model.{key} applies to the two-expert A14B variants, not to {model.variant}",
                    f"remove model.{key}", keys=(f"model.{key}", "model.variant")))
    elif model.transformer_file is not None:
        out.append(TRANSFORMER_FILE_ON_A14B.problem(
            f"model.transformer_file is for ti2v variants; for {model.variant} use model.high_noise_file / "
            "model.low_noise_file", ""))
    if model.expert_groups > 1 and (spec.boundary_ratio is None or model.experts != "both"):
        out.append(GROUPS_NEED_BOTH.problem(
            f"model.expert_groups = {model.expert_groups} gives each of the two A14B experts its own GPUs: "
            + (f"{model.variant} has one transformer" if spec.boundary_ratio is None
               else f"model.experts = {model.experts!r} trains one") + "; set model.expert_groups = 1"
            + ("" if spec.boundary_ratio is None else " or model.experts = 'both'")))
    from wantrain.models.wan22.control import problems as control_problems

    out += [WAITING_DISK.problem(line) for line in waiting_problems(model)]
    out += [CONTROL_VARIANT.problem(line) for line in control_problems(model)]
    out.extend(_timestep_problems(model, spec.boundary_ratio))
    return out


def _timestep_problems(model: ModelConfig, boundary: float | None) -> list[Problem]:
    """``model.min_t`` / ``max_t`` against each other and the trained experts' bands."""
    if model.min_t is not None and model.max_t is not None and model.min_t >= model.max_t:
        return [T_RANGE.problem(f"model.min_t = {model.min_t:g} must be below model.max_t = {model.max_t:g}", "")]
    out = []
    low, high = _trained_range(boundary, model.experts)
    for key in ("min_t", "max_t"):
        value = getattr(model, key)
        if value is not None and not (low <= value <= high):
            out.append(T_RANGE.problem(
                f"model.{key} = {value:g} lies outside the range of the trained expert(s) "
                f"({model.experts}: {low:g}..{high:g}); use a value in that range"))
    if model.experts == "both" and boundary is not None:
        if model.min_t is not None and model.min_t >= boundary:
            out.append(T_RANGE.problem(
                f"model.min_t = {model.min_t:g} leaves the low-noise expert nothing to train (its range ends "
                f"at the boundary {boundary:g}); with experts = 'both' min_t bounds the low-noise band"))
        if model.max_t is not None and model.max_t <= boundary:
            out.append(T_RANGE.problem(
                f"model.max_t = {model.max_t:g} leaves the high-noise expert nothing to train (its range "
                f"starts at the boundary {boundary:g}); with experts = 'both' max_t bounds the high-noise band"))
    return out


def _parallel_problems(model: ModelConfig) -> list[Problem]:
    """``model.parallel = "fsdp"`` against the keys it cannot work with yet (read time, before anything exists)."""
    if model.parallel != "fsdp":
        if model.shard_degree is not None:
            return [SHARD_NEEDS_FSDP.problem("model.shard_degree applies to model.parallel = 'fsdp'; set parallel = "
                                             "'fsdp' or remove model.shard_degree")]
        return []
    # compile runs under fsdp: each block's compiled forward sees the gathered weights (FSDP2's hooks stay eager);
    # experts = "both": each expert is sharded and stays on the device (1/N of it per GPU), nothing alternates;
    # blocks_to_swap: the last N blocks' shards live on the host (FSDP2's CPU offload, app.assemble.shard_experts)
    clash = _memory_clash(model, "parallel = 'dp'")
    if clash is not None:
        return [FSDP_MEMORY.problem(f"model.parallel = 'fsdp' does not work with {clash[0]} yet", clash[1])]
    return []


def _memory_clash(model: ModelConfig, undo: str) -> tuple[str, str] | None:
    """The memory-saving key ``model`` sets that a several-GPU layout does not work with yet (fp8 or quantised
    storage: FSDP2 shards and all-gathers plain tensors, and a quantised weight is a tensor subclass with its scales
    that no all-gather of it is written for), as (the key and its value, how to resolve it: change it or ``undo``).
    Compile and block swap work with both layouts; a VRAM budget under fsdp chooses only what fsdp runs with
    (``app.memory_plan``)."""
    if model.base_dtype in QUANTISED_DTYPES:
        return f"model.base_dtype = '{model.base_dtype}' (quantised storage)", f"set base_dtype = 'bf16' or {undo}"
    return None


def _sequence_problems(model: ModelConfig) -> list[Problem]:
    """``model.sequence_degree`` against the model's heads and the keys it does not work with yet (read time)."""
    degree = model.sequence_degree
    if degree == 1:
        return []
    from wantrain.models.wan22.architecture import transformer_kwargs

    heads = transformer_kwargs(VARIANTS[model.variant])["num_attention_heads"]
    if heads % degree:
        valid = ", ".join(str(d) for d in range(1, heads + 1) if heads % d == 0)
        return [SEQUENCE_HEADS.problem(f"model.sequence_degree = {degree} does not divide the {heads} attention "
                                       f"heads of {model.variant} (Ulysses gives each GPU whole heads); use one of "
                                       f"{valid}")]
    if model.expert_groups > 1:
        return [SEQUENCE_GROUPS.problem(f"model.sequence_degree = {degree} does not work with model.expert_groups "
                                        f"= {model.expert_groups} yet", "set expert_groups = 1 or sequence_degree = 1")]
    # Ulysses leaves the weights whole on every rank: compile (diffusers' context-parallel hooks break each block's
    # graph at its attention), block swap, fp8 and int8 / nf4 storage and a VRAM budget (which picks those) run as in
    # one process (tests/test_distributed_ulysses_memory.py)
    return []


def _trained_range(boundary: float | None, experts: str) -> tuple[float, float]:
    if boundary is None or experts == "both":
        return 0.0, 1.0
    return (boundary, 1.0) if experts == "high_noise" else (0.0, boundary)


LORA_RULES = (
    LOKR_FACTOR_ZERO := R("lokr-factor-zero", ("lora.lokr_factor",), "a LoKr factor of 0"),
    LOKR_KEYS := R("lokr-keys-on-other-type", ("lora.type", "lora.lokr_factor", "lora.lokr_decompose_both"),
                   "a LoKr key on another adapter type"),
    DROPOUT_ON_PRODUCTS := R("dropout-on-lokr-loha", ("lora.type", "lora.dropout"), "input dropout on LoKr or LoHa",
                             ("lora.type = lokr / loha", "lora.dropout > 0")),
    PLUS_ON_PRODUCTS := R("lora-plus-on-lokr-loha", ("lora.type", "lora.plus_lr_ratio"), "LoRA+ on LoKr or LoHa",
                          ("lora.type = lokr / loha", "lora.plus_lr_ratio")),
    MODULE_PATTERN := R("module-pattern", ("lora.include", "lora.exclude"), "an include/exclude pattern that is "
                        "not a regular expression"),
)


def lora_problems(lora: LoraConfig) -> list[Problem]:
    """Every problem of the ``[lora]`` keys among themselves."""
    out = []
    if lora.lokr_factor == 0:
        out.append(LOKR_FACTOR_ZERO.problem("config key 'lora.lokr_factor' = 0 is not a factor",
                                            "use -1 (near the square root) or a size >= 1"))
    if lora.type != "lokr":
        for key, default in (("lokr_factor", -1), ("lokr_decompose_both", False)):
            if getattr(lora, key) != default:
                out.append(LOKR_KEYS.problem(f"config key 'lora.{key}' applies to lora.type = 'lokr', not to "
                                             f"'{lora.type}'; remove it or set lora.type = 'lokr'",
                                             keys=("lora.type", f"lora.{key}")))
    if lora.type in ("lokr", "loha") and lora.dropout:
        out.append(DROPOUT_ON_PRODUCTS.problem(
            f"config key 'lora.dropout' is LoRA's input dropout; lora.type = '{lora.type}' has none (peft's module "
            "dropout draws from the global RNG); set lora.dropout = 0"))
    if lora.type in ("lokr", "loha") and lora.plus_lr_ratio is not None:
        out.append(PLUS_ON_PRODUCTS.problem(
            f"config key 'lora.plus_lr_ratio' (LoRA+) sets the LR of LoRA's B matrices; lora.type = '{lora.type}' "
            "has none; remove it or use lora.type 'lora' or 'dora'"))
    for key in ("include", "exclude"):
        for pattern in getattr(lora, key):
            problem = check_pattern(f"lora.{key}", pattern)
            if problem:
                out.append(MODULE_PATTERN.problem(problem, keys=(f"lora.{key}",)))
    return out


ADAPTER_RULES = (
    MODULES_MATCH := R("modules-match", ("lora.include", "lora.exclude", "model.variant"),
                       "include/exclude patterns that select no module of the variant"),
)


def adapter_problems(cfg: Any) -> list[Problem]:
    """The adapter (``[lora]``) against the model it adapts: DoRA reads the base weights outside their forward
    pass (an fp8 or low-bit base is dequantised for it: ``adapter_types.base_rows``; FSDP's shards are gathered
    there: ``adapter_types.DoRA``); ``include`` / ``exclude`` must select among the variant's module names."""
    lora, model, out = cfg.lora, cfg.model, []
    if lora.include or lora.exclude:  # against the variant's module names, before anything is written
        from wantrain.core.errors import UserError
        from wantrain.models.wan22.adapter_types import candidate_modules, select_modules

        try:
            spec = VARIANTS[model.variant]
            select_modules(candidate_modules(spec.num_layers, len(spec.vace_layers)), lora.include, lora.exclude)
        except UserError as exc:
            out.append(MODULES_MATCH.problem(str(exc)))
        except re.error:  # a pattern that is no regular expression: the [lora] rule module-pattern says so
            pass
    return out


def check_rank(variant: str, rank: int | None) -> str | None:
    """A warning line for a LoRA rank wider than the layers it adapts, else None: on a Linear of ``in`` by ``out``
    features a rank above ``min(in, out)`` adds parameters (and memory) but no capacity. The narrowest Linear a Wan
    LoRA targets is the attention's, ``heads x head_dim`` wide (its feed-forward is wider). A warning, not a
    refusal: a config written for one variant and tried on a smaller one (the examples on their tiny twins) still
    trains; a rank so wide that no device holds its plan (``lora.rank = 1000000000``) is refused by the memory plan
    (``app.memory_plan.plan_memory``). ``rank`` None: read from an ``init_from`` file later."""
    if rank is None:
        return None
    from wantrain.models.wan22.architecture import transformer_kwargs

    kwargs = transformer_kwargs(VARIANTS[variant])
    width = min(kwargs["num_attention_heads"] * kwargs["attention_head_dim"], kwargs["ffn_dim"])
    if rank <= width:
        return None
    return (f"config key 'lora.rank' = {rank} is wider than the layers it adapts: the narrowest Linear a LoRA of "
            f"model.variant = {variant!r} targets has {width} features, and a rank above min(in, out) adds "
            f"parameters but no capacity; ranks 1 to {width} use them all")
