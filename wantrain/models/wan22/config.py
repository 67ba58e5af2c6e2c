"""Config sections of the Wan 2.2 model family: ``[model]`` and ``[lora]`` (documented in docs/models.md).

Cross-key rules (an expert the variant lacks, a ``min_t`` outside the trained expert's range, a single-file key
for the wrong variant) are declared in ``models.wan22.rules`` and asked when the section is built, so a bad config
is refused at load time, every problem at once.
Whether files exist is checked later, by :func:`wantrain.models.wan22.build_adapter`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from wantrain.core.config import above, at_least, between, section, setting
from wantrain.core.problems import refuse
from wantrain.models.wan22.dtypes import FP8_DTYPES, LOW_BIT_DTYPES, QUANTISED_DTYPES
from wantrain.models.wan22.rules import lora_problems, model_problems
from wantrain.models.wan22.variants import VARIANTS

__all__ = ["FP8_DTYPES", "LOW_BIT_DTYPES", "QUANTISED_DTYPES", "LoraConfig", "ModelConfig"]


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
        doc="Storage dtype of the frozen base transformer: `auto` is fp32 for tiny variants and for real ones the "
        "first of bf16, fp8, int8, nf4 whose plan fits the card (`vram_budget_gb`) and the host RAM (int8 and nf4 "
        "only with bitsandbytes installed, gradient checkpointing on and compile off; `wantrain check` names the "
        "choice); `fp8` casts the blocks' Linears to float8_e4m3fn and computes in bf16; `fp8_scaled` stores them "
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
        "(docs/models.md, Memory). A VACE variant's VACE blocks run first and count before its main blocks "
        "(vace-t2v-a14b: 0..48; above 40 VACE blocks are swapped too). Needs gradient checkpointing.",
        range=at_least(0),
    )
    offload_activations: bool = setting(
        False, doc="Keep what autograd saves for the backward pass (with gradient checkpointing: every block's "
        "input) in host memory; it comes back when the backward pass needs it.",
    )
    vram_budget_gb: float | None = setting(
        None, doc="Usable device memory to plan for, in GiB (what the card has free, not its label: less on a card "
        "that drives a display): picks `blocks_to_swap`, `offload_activations`, (with `recompute = \"auto\"`) the "
        "whole-block or the lean recompute and (with `base_dtype = \"auto\"`) the storage (bf16, fp8, int8, nf4) "
        "so that the largest bucket fits with attention's backward buffer, a fragmentation margin and the CUDA "
        "context (docs/models.md, Memory); a budget nothing fits is refused before the run starts. Leave "
        "`blocks_to_swap` and `offload_activations` unset with it.", range=above(0.0),
    )

    host_ram_budget_gb: float | None = setting(
        None, doc="Host memory (RAM) to plan for, in GiB: `wantrain check` and the run compare the host plan (every "
        "host copy, pinned buffer and phase: docs/models.md, Host memory) with it, choose a smaller storage "
        "(with `base_dtype = \"auto\"`), the waiting expert on disk and pageable copies when RAM is short, and "
        "refuse a plan that does not fit in one line before the run starts. Unset: this machine's available RAM. "
        "Set it to plan for another machine.", range=above(0.0),
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
