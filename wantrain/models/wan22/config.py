"""Config sections of the Wan 2.2 model family: ``[model]`` and ``[lora]`` (documented in docs/models.md).

Cross-key rules (an expert the variant lacks, a ``min_t`` outside the trained expert's range, a single-file key
for the wrong variant) are checked when the section is built, so a bad config fails at load time with one line.
Whether files exist is checked later, by :func:`wantrain.models.wan22.build_adapter`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import torch

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.problems import Problem, Rule, refuse
from wantrain.models.wan22.adapter_types import check_pattern
from wantrain.models.wan22.lowbit import problems as low_bit_problems
from wantrain.models.wan22.variants import VARIANTS
from wantrain.models.wan22.waiting import problems as waiting_problems

FP8_DTYPES = ("fp8", "fp8_scaled")  # base dtypes that store the blocks' Linears in float8_e4m3fn
LOW_BIT_DTYPES = ("int8", "nf4")  # ... as bitsandbytes codes (lowbit.py)
QUANTISED_DTYPES = FP8_DTYPES + LOW_BIT_DTYPES  # compute from a dequantised bf16 copy of each Linear


@section
class ModelConfig:
    """The Wan 2.2 model to train: variant, weights, experts, timestep sampling and memory options."""

    variant: str = setting(
        "tiny-t2v",
        doc="Model variant; the `tiny-*` twins are random toy models with the same structure (no weights needed).",
        choices=tuple(VARIANTS),
    )
    path: Path | None = setting(
        None,
        doc="Local diffusers-format model directory (`transformer/`, `transformer_2/`, `vae/`, `text_encoder/`, "
        "`tokenizer/`). Required for real variants; a tiny variant with a path loads it instead of random weights.",
    )
    high_noise_file: Path | None = setting(
        None, doc="Single-file (original Wan or ComfyUI keys) .safetensors of the A14B high-noise expert, or the "
        "original repos' `high_noise_model/` folder of shards with its index; replaces `transformer/`.",
    )
    low_noise_file: Path | None = setting(
        None, doc="Single-file .safetensors (or `low_noise_model/` folder of shards) of the A14B low-noise expert; "
        "replaces `transformer_2/`.",
    )
    transformer_file: Path | None = setting(
        None, doc="Single-file .safetensors (or folder of shards) of the TI2V-5B transformer; replaces "
        "`transformer/`.",
    )
    vae_file: Path | None = setting(
        None, doc="The Wan 2.1 VAE as one file in the original layout (ComfyUI's `wan_2.1_vae.safetensors`, the "
        "original repos' `Wan2.1_VAE.pth`, read with weights_only); replaces `vae/`.")
    text_encoder_file: Path | None = setting(
        None, doc="UMT5 as one file: transformers/ComfyUI keys (`umt5_xxl_fp16.safetensors`) or the original repos' "
        "`models_t5_umt5-xxl-enc-bf16.pth` (read with weights_only); replaces `text_encoder/`.")
    tokenizer_path: Path | None = setting(
        None, doc="A local folder with the UMT5 tokenizer's files (the original repos' `google/umt5-xxl/`); "
        "replaces `tokenizer/`. With every part given as a file or folder, `model.path` is not needed.")
    experts: Literal["both", "high_noise", "low_noise"] = setting(
        "both", doc="A14B experts to train (single-transformer variants accept only `both`)."
    )
    switch_every: int = setting(
        10, doc="With `experts = \"both\"`, the trained expert alternates every N optimizer steps.",
        range=at_least(1),
    )
    expert_groups: int = setting(
        1, doc="Under torchrun with `experts = \"both\"` (A14B): 2 splits the ranks into one group per expert (ranks "
        "0..W/2-1 train the high-noise expert, the rest the low-noise one; data parallel inside a group), each "
        "holding only its expert on its GPU and training it every step; 1 alternates the experts on every rank "
        "(docs/distributed.md, One expert per GPU).", range=between(1, 2),
    )
    lr_high_noise: float | None = setting(
        None, doc="Learning rate of the high-noise LoRA; unset uses `optimizer.lr`.", range=above(0.0)
    )
    lr_low_noise: float | None = setting(
        None, doc="Learning rate of the low-noise LoRA; unset uses `optimizer.lr`.", range=above(0.0)
    )
    timestep_sampling: Literal["uniform", "logit_normal", "sigmoid"] = setting(
        "logit_normal",
        doc="Distribution of t before the shift: uniform, sigmoid(N(logit_mean, logit_std)), or "
        "sigmoid(sigmoid_scale * N(0, 1)).",
    )
    logit_mean: float = setting(0.0, doc="Mean of the normal in `logit_normal` sampling.")
    logit_std: float = setting(1.0, doc="Standard deviation of the normal in `logit_normal` sampling.",
                               range=above(0.0))
    sigmoid_scale: float = setting(1.0, doc="Scale of the normal in `sigmoid` sampling.", range=above(0.0))
    shift: float = setting(1.0, doc="Timestep shift s: t' = s*t / (1 + (s-1)*t).", range=above(0.0))
    min_t: float | None = setting(
        None, doc="Lowest t trained (0-1 units, after the shift); must lie in the trained expert's range.",
        range=between(0.0, 1.0),
    )
    max_t: float | None = setting(
        None, doc="Highest t trained (0-1 units, after the shift); must lie in the trained expert's range.",
        range=between(0.0, 1.0),
    )
    i2v_probability: float = setting(
        0.5, doc="TI2V only: chance that a sample trains image-to-video (clean first latent frame, excluded "
        "from the loss) instead of text-to-video. Single-frame samples always train text-to-video.",
        range=between(0.0, 1.0),
    )
    condition: Literal["first_frame", "first_last"] = setting(
        "first_frame", doc="I2V-A14B: what each clip is conditioned on: its first frame (`first_frame`), or its "
        "first and last frames (`first_last`: first-last-frame video, as diffusers' `last_image`).",
    )
    vace_blocks: Literal["lora", "frozen"] = setting(
        "lora", doc="VACE variants: `lora` adapts the VACE blocks' Linears as well as the main blocks' (what "
        "`lora.include` / `lora.exclude` select among both); `frozen` leaves the VACE blocks as they are.",
    )
    gradient_checkpointing: bool = setting(True, doc="Recompute transformer activations in the backward pass.")
    recompute: Literal["auto", "block", "lean"] = setting(
        "auto", doc="How each checkpointed block is recomputed in the backward pass (with gradient checkpointing; "
        "docs/models.md, Memory): `block` recomputes the whole block and keeps everything its backward needs at "
        "once; `lean` recomputes the self-attention, the cross-attention and the FFN (over token chunks) each in "
        "its own backward, keeping bf16 inputs instead of float32 copies: about 2.5x less memory for one block, "
        "about 26 % more FLOPs per step. `auto`: with `vram_budget_gb` the planner takes `lean` only where "
        "`block` does not fit; without a budget, `block`.",
    )
    base_dtype: Literal["auto", "fp32", "bf16", "fp8", "fp8_scaled", "int8", "nf4"] = setting(
        "auto",
        doc="Storage dtype of the frozen base transformer: `auto` is fp32 for tiny variants and bf16 for real "
        "ones; `fp8` casts the blocks' Linears to float8_e4m3fn and computes in bf16; `fp8_scaled` stores them "
        "in float8_e4m3fn with one float32 scale per output row (max|row|/448; a ComfyUI fp8_scaled file keeps "
        "its own) and computes in bf16: less error than `fp8`, same memory (both CUDA only); `int8` and `nf4` store "
        "them as bitsandbytes' blockwise 8-bit codes (1.06 bytes a weight) or 4-bit NormalFloat (0.56 bytes a "
        "weight), one float32 absmax per 64 weights, dequantised to bf16 in each forward (CPU or CUDA; "
        "docs/models.md, Memory).",
    )
    offload_device: str = setting(
        "cpu", doc="Where the inactive expert and its optimizer state wait while the other one trains."
    )
    blocks_to_swap: int = setting(
        0, doc="Transformer blocks (the last N of each expert) whose frozen base weights stay in host memory and "
        "visit the device one block ahead of use, in the forward pass and in gradient checkpointing's recompute "
        "(docs/models.md, Memory). Needs gradient checkpointing.", range=at_least(0),
    )
    offload_activations: bool = setting(
        False, doc="Keep what autograd saves for the backward pass (with gradient checkpointing: every block's "
        "input) in host memory; it comes back when the backward pass needs it.",
    )
    vram_budget_gb: float | None = setting(
        None, doc="Usable device memory to plan for, in GiB (what the card has free, not its label: less on a card "
        "that drives a display): picks `blocks_to_swap`, `offload_activations`, (with `recompute = \"auto\"`) the "
        "whole-block or the lean recompute and (with `base_dtype = \"auto\"`) bf16 or fp8 so that the largest "
        "bucket fits with attention's backward buffer, a fragmentation margin and the CUDA context (docs/models.md, "
        "Memory); a budget nothing fits is refused before the run starts. Leave "
        "`blocks_to_swap` and `offload_activations` unset with it.", range=above(0.0),
    )

    host_ram_budget_gb: float | None = setting(
        None, doc="Host memory (RAM) to plan for, in GiB: `wantrain check` and the run compare the host plan (every "
        "host copy, pinned buffer and phase: docs/models.md, Host memory) with it, choose fp8 storage (with "
        "`base_dtype = \"auto\"`) and pageable copies when RAM is short, and refuse a plan that does not fit in "
        "one line before the run starts. Unset: this machine's available RAM. Set it to plan for another "
        "machine.", range=above(0.0),
    )
    waiting_expert: Literal["auto", "resident", "disk"] = setting(
        "auto", doc="With `experts = \"both\"` (A14B): where the frozen base of the expert not training waits "
        "between switches. `resident`: a copy in host memory (fast switches); `disk`: nowhere in memory, read back at "
        "each switch from a copy in its storage format that the run writes once into `waiting_experts/` of the cache "
        "folder (memory-mapped: the page cache keeps it while RAM allows); its LoRA and optimizer state stay in "
        "memory, and the run is bitwise the resident one. `auto`: the host plan takes `resident` where it fits "
        "`host_ram_budget_gb`, else `disk` (docs/models.md, Host memory).",
    )
    pin_host_copies: bool = setting(
        True, doc="Pin the host copies that travel to CUDA (swapped blocks, the waiting expert, offloaded "
        "activations) so that their copies run asynchronously; the host plan turns it off when pinned memory "
        "would not fit `host_ram_budget_gb`. Pinning the driver refuses falls back to pageable memory.",
    )

    compile: Literal["off", "default", "max-autotune-no-cudagraphs"] = setting(
        "off", doc="torch.compile each transformer block (regional compilation: the blocks, not the whole model) "
        "with this mode: `default` (inductor's kernels), `max-autotune-no-cudagraphs` (also benchmarks matmul "
        "and convolution configurations: a longer first step). Block swap, activation offload and gradient "
        "checkpointing stay outside the compiled region; the first steps (and each new bucket shape) compile, "
        "into the compile cache under the cache folder (docs/models.md, Compile).",
    )
    compile_dynamic: bool | None = setting(
        None, doc="With `model.compile`: compile the token dimension as dynamic (`true`: one graph for every "
        "bucket), static (`false`: one compile per bucket shape), or, unset, static until a second shape shows up "
        "and dynamic from then on (torch's automatic dynamic shapes).",
    )
    attention: Literal["sdpa", "flash", "xformers", "sage"] = setting(
        "sdpa", doc="Attention kernel, through diffusers' attention dispatcher: `sdpa` (PyTorch's "
        "scaled_dot_product_attention, which picks its own flash, memory-efficient or math kernel), `flash` "
        "(the flash-attn 2 package, CUDA, bf16), `xformers` (xformers' memory-efficient attention, CUDA); `sage` "
        "is refused for training (SageAttention quantizes Q and K to int8 in its forward and has no backward "
        "pass: the LoRA on the attention's projections would get no gradient).",
    )

    parallel: Literal["dp", "fsdp"] = setting(
        "dp", doc="Under torchrun: `dp` keeps a whole expert on every GPU and averages the LoRA gradients (data "
        "parallel); `fsdp` shards each block's frozen weights and the LoRA over the GPUs with FSDP2 (`fully_shard` "
        "per block), so an expert that does not fit one card fits a few (docs/distributed.md). In one process "
        "`fsdp` trains unsharded, with a warning.",
    )
    shard_degree: int | None = setting(
        None, doc="With `parallel = \"fsdp\"`: how many GPUs share one copy of the weights (unset: all of them). "
        "Fewer than the world size is HSDP: shard inside a group of `shard_degree` ranks (a node), replicate "
        "across groups; it must divide the number of ranks.", range=at_least(1),
    )

    sequence_degree: int = setting(
        1, doc="Under torchrun: how many GPUs share each clip's tokens (Ulysses sequence parallelism through "
        "diffusers' context parallelism; each attention trades tokens for heads, so it must divide the attention "
        "heads, the number of ranks, and every bucket's token count). The ranks of one sequence group train the "
        "same samples; data parallelism runs across the groups (docs/distributed.md, Sequence parallelism). With "
        "`parallel = \"fsdp\"` the weights are sharded over every rank, sequence groups included.",
        range=at_least(1),
    )

    def __attrs_post_init__(self) -> None:
        refuse(model_problems(self))

    @property
    def boundary_ratio(self) -> float | None:
        """The timestep at which the high-noise expert takes over (None: one transformer)."""
        return VARIANTS[self.variant].boundary_ratio

    @property
    def trained_experts(self) -> tuple[str | None, ...]:
        """The experts this config trains, in the fixed order high_noise, low_noise (or ``(None,)``)."""
        spec = VARIANTS[self.variant]
        if spec.boundary_ratio is None:
            return (None,)
        return spec.experts if self.experts == "both" else (self.experts,)

    @property
    def untrained_experts(self) -> tuple[str, ...]:
        """The A14B expert this config does not train (``()`` with both trained or one transformer): with
        ``[sample]`` on, it is loaded frozen to sample its timesteps (``Wan22Adapter.add_sampling_expert``)."""
        return tuple(e for e in VARIANTS[self.variant].experts if e is not None and e not in self.trained_experts)


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
                     ("model.parallel", "model.blocks_to_swap", "model.vram_budget_gb", "model.base_dtype"),
                     "fsdp with block swap, a VRAM budget or fp8 storage",
                     ("model.parallel = fsdp", "block swap, vram_budget_gb, fp8")),
    SEQUENCE_HEADS := R("sequence-degree-heads", ("model.sequence_degree", "model.variant"),
                        "a sequence degree that does not divide the attention heads"),
    SEQUENCE_MEMORY := R("sequence-memory-settings", ("model.sequence_degree", "model.base_dtype"),
                         "a sequence degree with int8 / nf4 storage (not verified)",
                         ("model.sequence_degree > 1", "model.base_dtype = int8 or nf4")),
    SEQUENCE_GROUPS := R("sequence-expert-groups", ("model.sequence_degree", "model.expert_groups"),
                         "a sequence degree inside expert groups",
                         ("model.sequence_degree > 1", "model.expert_groups > 1")),
    WAITING_DISK := R("waiting-expert-disk", ("model.waiting_expert", "model.experts", "model.expert_groups"),
                      "the waiting expert on disk where no expert waits (one expert, or expert groups)",
                      ("model.waiting_expert = disk", "one trained expert or model.expert_groups > 1")),
    LOW_BIT_COMPILE := R("low-bit-compile", ("model.base_dtype", "model.compile"),
                         "int8 / nf4 storage inside compiled blocks (not verified on a GPU yet)",
                         ("model.base_dtype = int8 or nf4", "model.compile")),
    CONTROL_VARIANT := R("control-variant",
                         ("model.condition", "model.vace_blocks", "model.variant", "model.parallel",
                          "model.sequence_degree"),
                         "a control setting its variant lacks (first_last off I2V, vace_blocks off VACE), or VACE "
                         "under fsdp or a sequence degree"),
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
    if model.blocks_to_swap > spec.num_layers:
        out.append(SWAP_BEYOND_BLOCKS.problem(
            f"model.blocks_to_swap = {model.blocks_to_swap} exceeds the {spec.num_layers} blocks of "
            f"{model.variant}; use 0..{spec.num_layers}"))
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
    out += [LOW_BIT_COMPILE.problem(line) for line in low_bit_problems(model)]
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
    # experts = "both": each expert is sharded and stays on the device (1/N of it per GPU), nothing alternates
    clash = _memory_clash(model, "parallel = 'dp'", " (sharding is what makes the blocks fit)")
    if clash is not None:
        return [FSDP_MEMORY.problem(f"model.parallel = 'fsdp' does not work with {clash[0]} yet", clash[1])]
    return []


def _memory_clash(model: ModelConfig, undo: str, swap_note: str = "") -> tuple[str, str] | None:
    """The first memory-saving key ``model`` sets that a several-GPU layout does not work with yet (block swap, a
    VRAM budget, fp8 storage), as (the key and its value, how to resolve it: change it or ``undo``). Compile works
    with both layouts."""
    if model.blocks_to_swap:
        return f"model.blocks_to_swap = {model.blocks_to_swap}", f"set blocks_to_swap = 0{swap_note} or {undo}"
    if model.vram_budget_gb is not None:
        return (f"model.vram_budget_gb = {model.vram_budget_gb:g} (it picks block swap and fp8 storage)",
                f"remove vram_budget_gb or set {undo}")
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
    # graph at its attention), block swap, fp8 storage and a VRAM budget (which picks those two) run as in one process
    if model.base_dtype in LOW_BIT_DTYPES:
        return [SEQUENCE_MEMORY.problem(
            f"model.sequence_degree = {degree} does not work with model.base_dtype = '{model.base_dtype}' yet "
            "(bitsandbytes' low-bit Linears under a split sequence are not verified)",
            "set base_dtype = 'bf16', 'fp8' or 'fp8_scaled', or sequence_degree = 1")]
    return []


def _trained_range(boundary: float | None, experts: str) -> tuple[float, float]:
    if boundary is None or experts == "both":
        return 0.0, 1.0
    return (boundary, 1.0) if experts == "high_noise" else (0.0, boundary)


@section
class LoraConfig:
    """The adapters: one per trained expert on the 10 Linears of every block, or those `include` / `exclude`
    select (see docs/models.md). `type` picks LoRA, LoKr, LoHa or DoRA (``adapter_types.py``)."""

    type: Literal["lora", "lokr", "loha", "dora"] = setting(
        "lora", doc="Adapter type: `lora`, `lokr` (Kronecker product), `loha` (Hadamard product) or `dora` (LoRA "
        "with a trained magnitude per output row); exported in the LyCORIS keys ComfyUI loads (docs/models.md).")
    lokr_factor: int = setting(
        -1, doc="LoKr only: the size of the first Kronecker factor (`lokr_w1` is factor x factor); -1 picks the "
        "divisors nearest the square root of each layer's sizes.", range=at_least(-1))
    lokr_decompose_both: bool = setting(
        False, doc="LoKr only: also decompose the first factor into two rank-`rank` matrices when it is large "
        "enough (`lokr_w1_a`, `lokr_w1_b`).")
    include: list[str] = setting(
        factory=list, doc="Regular expressions selecting the adapted modules among the 10 Linears of every block, "
        "searched in diffusers names (`blocks.3.attn1.to_q`) and original Wan names (`blocks.3.self_attn.q`); "
        "empty: all of them. Each must match some module.")
    exclude: list[str] = setting(
        factory=list, doc="Regular expressions (as `include`) of modules left without an adapter.")
    rank: int | None = setting(
        None, doc="LoRA rank; unset: 16, or the rank of the `init_from` file(s).", range=at_least(1))
    alpha: float | None = setting(
        None, doc="LoRA alpha; the LoRA output is scaled by alpha/rank. Unset means alpha = rank (scale 1).",
        range=above(0.0),
    )
    dropout: float = setting(0.0, doc="Dropout on the LoRA input during training.", range=between(0.0, 0.99))
    save_dtype: Literal["bf16", "fp32"] = setting("bf16", doc="dtype of the LoRA matrices in the saved files.")
    plus_lr_ratio: float | None = setting(
        None, doc="LoRA+: the B matrices train at this multiple of the LR of the A matrices, in a parameter group "
        "of their own per expert (`<group>_B`, e.g. `high_noise_B`); unset: one LR per expert.", range=above(0.0))
    init_from: Path | None = setting(
        None, doc="Start the LoRA from this file (wantrain, ComfyUI, diffusers or musubi-tuner keys): the TI2V-5B "
        "LoRA, or the one expert an A14B run trains. Rank and alpha are read from it; the optimizer starts fresh.")
    init_from_high_noise: Path | None = setting(
        None, doc="A14B: start the high-noise expert's LoRA from this file (as `init_from`).")
    init_from_low_noise: Path | None = setting(
        None, doc="A14B: start the low-noise expert's LoRA from this file (as `init_from`).")

    def __attrs_post_init__(self) -> None:
        if self.rank is None and not self.starts_from_files:
            object.__setattr__(self, "rank", 16)  # unset and no file to read it from: the default
        refuse(lora_problems(self))

    @property
    def starts_from_files(self) -> bool:
        """Some ``init_from*`` key names a file (rank and alpha then come from it, ``lora_files.resolve_init``)."""
        return any(v is not None for v in (self.init_from, self.init_from_high_noise, self.init_from_low_noise))

    @property
    def effective_alpha(self) -> float:
        """The alpha the LoRA starts with (alpha = rank when unset). The run config's ``[lora]`` section
        (``wantrain.app.config.LoraSection``) adds the alpha schedule, whose first phase sets it instead."""
        return float(self.rank) if self.alpha is None else float(self.alpha)


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
    DORA_FP8 := R("dora-fp8", ("lora.type", "model.base_dtype"), "DoRA on fp8 or low-bit storage",
                  ("lora.type = dora", "model.base_dtype = fp8, fp8_scaled, int8 or nf4")),
    MODULES_MATCH := R("modules-match", ("lora.include", "lora.exclude", "model.variant"),
                       "include/exclude patterns that select no module of the variant"),
)


def adapter_problems(cfg: Any) -> list[Problem]:
    """The adapter (``[lora]``) against the model it adapts: DoRA reads the base weights outside their forward
    pass, which fp8 storage does not dequantize (FSDP's shards are gathered there: ``adapter_types.DoRA``);
    ``include`` / ``exclude`` must select among the variant's module names."""
    lora, model, out = cfg.lora, cfg.model, []
    if lora.type == "dora" and model.base_dtype in QUANTISED_DTYPES:  # "auto" plans bf16 for DoRA
        out.append(DORA_FP8.problem(
            f"lora.type = 'dora' reads the base weights outside their forward pass, which fp8 and low-bit "
            f"storage do not dequantize there (model.base_dtype = '{model.base_dtype}'); set "
            "model.base_dtype = 'bf16' or use another lora.type"))
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
    (``app.preflight.plan_memory``). ``rank`` None: read from an ``init_from`` file later."""
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
