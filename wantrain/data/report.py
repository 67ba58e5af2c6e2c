"""The pre-flight report (``wantrain check``) and the peak-VRAM estimate.

:class:`PreflightReport` is built by ``build_dataset`` before anything is decoded; decode-time verification
appends to ``verification`` while training runs (a clip re-bucketed or skipped), so the JSON written at the end of
a run holds what really happened.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs

_DTYPE_BYTES = {
    "fp32": 4.0, "float32": 4.0,
    "bf16": 2.0, "bfloat16": 2.0, "fp16": 2.0, "float16": 2.0,
    "fp8": 1.0, "float8": 1.0, "float8_e4m3fn": 1.0, "float8_e5m2": 1.0,
    "fp8_scaled": 1.0,  # plus 4 bytes of scale per output row: under 0.1 % of an A14B block
}

# Hidden width and block count of the DiT per VAE family (Wan 2.2 configs); tiny variants use _TINY_BLOCKS and a
# width derived from their parameter count.
_ARCH = {"wan2.1": (5120, 40), "wan2.2": (3072, 30)}
_TINY_BLOCKS = 2
_PARAMS_PER_BLOCK_PER_D2 = 13.4  # self-attn 4d^2 + cross-attn 4d^2 + FFN ~2*2.7d^2
# Bytes one DiT block keeps for its backward pass, per video token per unit of hidden width, by the dtype of the
# base weights. LoRA trains in fp32 on every base, and peft casts each LoRA layer's input to fp32 and keeps that
# copy; the fp32 norms keep fp32 inputs. Measured with saved_tensors_hooks on one real-width A14B block
# (d = 5120, 40 heads, ffn 13824) on a CPU: ``python bench/measure_block_activations.py --real``
# (docs/benchmarks.md), rounded up; tests/data/test_vram_estimate.py checks it against a measured block.
BLOCK_SAVED_BYTES_PER_TOKEN_PER_WIDTH = {"fp32": 81.0, "bf16": 79.0, "fp8": 79.0}
# ... and per text token per unit of width: the cross-attention's keys and values (and their LoRA inputs).
_BLOCK_SAVED_BYTES_PER_TEXT_TOKEN_PER_WIDTH = {"fp32": 17.0, "bf16": 17.0, "fp8": 17.0}
_ACTIVATION_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp8": 2.0}  # the dtype the blocks compute in (fp8 computes in bf16)
_ACT_BYTES_PER_TOKEN_PER_D = 44.0  # one block's live working set without autograd (sampling), Korthikanti et al.
_OVERHEAD_GB = 1.0  # CUDA context, cuBLAS workspaces
_FRAGMENTATION = 1.10  # allocator slack
_TEXT_TOKENS, _TEXT_DIM = 512, 4096  # umT5-XXL context, cached, on the device per batch
_UMT5_PARAMS = 5.7e9  # umT5-XXL encoder, in the compute dtype while encoding captions
_VAE_ENCODE_PARAMS = {"wan2.1": 127e6, "wan2.2": 705e6}  # fp32


def _family(base_dtype: str) -> str:
    """fp32 / bf16 / fp8 for every spelling :data:`_DTYPE_BYTES` knows (fp16 counts as bf16)."""
    size = _DTYPE_BYTES[base_dtype]
    return {4.0: "fp32", 2.0: "bf16", 1.0: "fp8"}[size]


def saved_bytes_per_token_per_width(base_dtype: str) -> float:
    """What one block keeps for backward per video token per unit of width on a ``base_dtype`` base (fp32 LoRA)."""
    return BLOCK_SAVED_BYTES_PER_TOKEN_PER_WIDTH[_family(base_dtype)]


def block_saved_bytes(tokens: float, width: float, base_dtype: str, *, text_tokens: float = _TEXT_TOKENS,
                      block_params: float = 0.0) -> float:
    """Bytes one block keeps for its backward pass at ``tokens`` video tokens (the whole batch) and ``text_tokens``
    text tokens. With fp8 storage the bf16 copies layerwise casting makes of the block's weights (``block_params``
    of them) are kept too: they are what the Linears saved."""
    family = _family(base_dtype)
    out = tokens * width * BLOCK_SAVED_BYTES_PER_TOKEN_PER_WIDTH[family]
    out += text_tokens * width * _BLOCK_SAVED_BYTES_PER_TEXT_TOKEN_PER_WIDTH[family]
    if family == "fp8":
        out += block_params * 2.0
    return out


def activation_bytes(tokens: float, width: float, blocks: int, base_dtype: str, gradient_checkpointing: bool, *,
                     text_tokens: float = _TEXT_TOKENS, block_params: float = 0.0) -> float:
    """Bytes the transformer's blocks keep for backward at the peak: every block's input plus one block recomputed
    (gradient checkpointing), or every block's saved tensors (without). The per-part function a planner calls."""
    per_block = block_saved_bytes(tokens, width, base_dtype, text_tokens=text_tokens, block_params=block_params)
    if gradient_checkpointing:
        return blocks * tokens * width * _ACTIVATION_BYTES[_family(base_dtype)] + per_block
    return blocks * per_block


def _width_and_blocks(spec: Any) -> tuple[float, int]:
    if spec.tiny:
        n = getattr(spec, "num_layers", _TINY_BLOCKS)
        return max(8.0, math.sqrt(spec.transformer_params / (n * _PARAMS_PER_BLOCK_PER_D2))), n
    d, n = _ARCH.get(spec.vae, (5120, 40))
    return float(d), getattr(spec, "num_layers", n)


def _base_dtype(spec: Any, base_dtype: str) -> str:
    if base_dtype == "auto":  # the model section's default: fp32 for tiny variants, bf16 for real ones
        base_dtype = "fp32" if spec.tiny else "bf16"
    if base_dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown base_dtype {base_dtype!r}; expected one of {', '.join(sorted(_DTYPE_BYTES))}")
    return base_dtype


def estimate_parts(spec: Any, width: int, height: int, frames: int, rank: int, batch_size: int,
                   base_dtype: str = "bf16", gradient_checkpointing: bool = True) -> dict[str, float]:
    """The estimate part by part, in bytes before allocator slack and overhead: ``weights`` (one expert),
    ``lora`` (fp32 weight, gradient, two AdamW moments), ``activations`` (:func:`activation_bytes`), ``text``
    (the batch's cached umT5 context), and three phases: ``training`` (their sum), ``expert_switch`` (one
    expert with its LoRA and optimizer state: the outgoing expert leaves before the other arrives) and
    ``encoders`` (umT5 in the compute dtype and the VAE in fp32 while ``wantrain cache`` or a run fills the
    cache; their activations are not counted)."""
    base_dtype = _base_dtype(spec, base_dtype)
    d, n = _width_and_blocks(spec)
    m = spec.spatial_multiple
    weights = spec.transformer_params * _DTYPE_BYTES[base_dtype]
    lora = rank * spec.lora_params_per_rank * 16.0
    latent_frames = (frames - 1) // spec.frame_multiple + 1
    tokens = batch_size * latent_frames * (height / m) * (width / m)
    text_len = getattr(spec, "text_len", _TEXT_TOKENS)
    activations = activation_bytes(tokens, d, n, base_dtype, gradient_checkpointing, text_tokens=batch_size * text_len,
                                   block_params=spec.transformer_params / n)
    text = batch_size * text_len * _TEXT_DIM * 2.0
    encoders = 0.0 if spec.tiny else (_UMT5_PARAMS * _ACTIVATION_BYTES[_family(base_dtype)]
                                      + _VAE_ENCODE_PARAMS.get(spec.vae, 127e6) * 4.0)
    return {"weights": weights, "lora": lora, "activations": activations, "text": text,
            "training": weights + lora + activations + text, "expert_switch": weights + lora,
            "encoders": encoders}


def estimate_peak_vram_gb(
    spec: Any, width: int, height: int, frames: int, rank: int, batch_size: int,
    base_dtype: str = "bf16", gradient_checkpointing: bool = True,
) -> float:
    """Estimated peak device memory (GiB) of a LoRA training run on latents and text embeddings from the cache:
    the largest phase of :func:`estimate_parts` with allocator slack and the CUDA context.

    ``base_dtype``: ``fp32``, ``bf16``, ``fp16``, ``fp8`` (or the torch spellings), or ``auto`` (fp32 for tiny
    variants, bf16 for real ones, as ``[model] base_dtype`` means it).

    ``spec`` is a ``VariantSpec``. Formula (docs/data.md, "VRAM estimate"), with ``m = spec.spatial_multiple``,
    ``d`` the hidden width, ``n`` the number of blocks and ``S`` the measured bytes a block keeps per token per
    unit of width (:data:`BLOCK_SAVED_BYTES_PER_TOKEN_PER_WIDTH`: 81 fp32, 79 bf16 or fp8 base)::

        weights     = transformer_params * bytes(base_dtype)          # one expert resident; the other offloaded
        lora        = rank * lora_params_per_rank * 16                # fp32 weight + grad + two AdamW moments
        tokens      = batch * ((frames - 1) / 4 + 1) * (height / m) * (width / m)
        per_block   = tokens * d * S + text tokens * d * 17 (+ the block's weights in bf16 for fp8)
        activations = n * tokens * d * bytes(compute) + per_block   if gradient_checkpointing
                      n * per_block                                   otherwise
        text        = batch * text_len * 4096 * 2                     # umT5 context (512 tokens)
        peak        = 1.10 * max(weights + lora + activations + text, expert switch, encoders) + 1 GiB

    A planning figure; block swapping, activation offload and attention kernels' workspaces are not modelled.
    """
    parts = estimate_parts(spec, width, height, frames, rank, batch_size, base_dtype, gradient_checkpointing)
    peak = max(parts["training"], parts["expert_switch"], parts["encoders"])
    return (_FRAGMENTATION * peak + _OVERHEAD_GB * 2**30) / 2**30


_VAE_PARAMS = {"wan2.1": 127e6, "wan2.2": 705e6}  # fp32 while decoding samples
_VAE_DECODE_BYTES_PER_PIXEL = 4 * 96 * 4.0 * 4  # 4 frames per causal chunk x 96 channels x fp32 x ~4 live tensors


def estimate_sampling_vram_gb(spec: Any, width: int, height: int, frames: int, rank: int,
                              base_dtype: str = "bf16") -> float:
    """Estimated peak device memory (GiB) of generating one sample video during training (``[sample]``).

    One expert is resident at a time (the other is swapped in at the boundary, as in training), with its LoRA and
    optimizer state; the denoiser keeps no activations for backward, so one block's working set is the largest
    live activation; the VAE (fp32) decodes in causal 4-frame chunks after the denoiser. Formula::

        weights     = transformer_params * bytes(base_dtype) + rank * lora_params_per_rank * 16
        denoise     = tokens * d * 44                 # one block's working set (tokens as in the training estimate)
        decode      = vae_params * 4 + width * height * 4 * 96 * 4 * 4
        peak        = 1.10 * (weights + max(denoise, decode)) + 1 GiB

    As rough as the training estimate (expect +-25%).
    """
    if base_dtype == "auto":
        base_dtype = "fp32" if spec.tiny else "bf16"
    m = spec.spatial_multiple
    d, _ = _width_and_blocks(spec)
    weights = spec.transformer_params * _DTYPE_BYTES[base_dtype] + rank * spec.lora_params_per_rank * 16.0
    tokens = ((frames - 1) // spec.frame_multiple + 1) * (height / m) * (width / m)
    denoise = tokens * d * _ACT_BYTES_PER_TOKEN_PER_D
    decode = _VAE_PARAMS.get(spec.vae, 127e6) * 4.0 + width * height * _VAE_DECODE_BYTES_PER_PIXEL
    return (_FRAGMENTATION * (weights + max(denoise, decode)) + _OVERHEAD_GB * 2**30) / 2**30


def display_path(path: str | Path) -> str:
    """``path`` for one report line: as it is, or quoted with escapes (``'a\\nb.mp4'``) when it holds a character
    that is not printable (a newline would split the line)."""
    text = str(path)
    return text if text.isprintable() else repr(text)


@attrs.define
class BucketRow:
    width: int
    height: int
    frames: int
    clips: int  # distinct clips
    samples: int  # clips x repeats: what one epoch trains
    batches: int  # micro-batches in the first epoch
    remainder: int  # samples that do not fill a batch in the first epoch


@attrs.define
class PreflightReport:
    """Everything ``wantrain check`` prints. ``to_json()`` is the machine form written into the run directory."""

    variant: str
    target_fps: float | None
    retime: str
    batch_size: int
    remainder_policy: str
    datasets: list[dict[str, Any]] = attrs.field(factory=list)
    buckets: list[BucketRow] = attrs.field(factory=list)
    skipped: list[dict[str, str]] = attrs.field(factory=list)  # {"path", "reason"}
    retimed: list[dict[str, Any]] = attrs.field(factory=list)  # per video: source frames/fps -> frames
    frame_count_mismatches: list[dict[str, Any]] = attrs.field(factory=list)  # container header vs demuxed
    clip_modes: list[str] = attrs.field(factory=list)
    ignored_files: list[dict[str, str]] = attrs.field(factory=list)  # {"path", "reason"}: not media, hidden, ...
    pixels_cropped_pct: float = 0.0
    frames_left_over_pct: float = 0.0
    source_frames_total: int = 0
    frames_left_over: int = 0
    steps_per_epoch: int = 0
    vram: dict[str, Any] = attrs.field(factory=dict)
    memory_plan: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.preflight.plan_memory, part by part
    host_memory: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.preflight.host_memory, part by part
    verification: list[dict[str, Any]] = attrs.field(factory=list)  # appended while decoding
    # texts per medium, distinct texts to encode, expected share of samples trained with the empty prompt
    captions: dict[str, Any] = attrs.field(factory=dict)
    # epoch keys resolved to optimizer steps (filled by the run assembly / `wantrain check`, wantrain.app.epochs)
    epochs: dict[str, Any] = attrs.field(factory=dict)
    # what the run loads from where, one line per part (filled by `wantrain check`; a problem is its one line)
    model_files: list[str] = attrs.field(factory=list)

    def set_captions(self, clips: list[Any]) -> None:
        """Fill :attr:`captions` from the clips (``Clip.texts``, ``caption_dropout``, ``repeats``)."""
        per_medium: dict[str, int] = {}
        for c in clips:
            per_medium[str(c.path)] = len(c.texts)
        samples = sum(c.repeats for c in clips)
        dropped = sum(c.repeats * c.caption_dropout for c in clips)
        texts = {t for c in clips for t in c.texts}
        if dropped:
            texts.add("")
        counts = list(per_medium.values()) or [0]
        self.captions = {
            "variants_min": min(counts), "variants_max": max(counts),
            "variants_mean": round(sum(counts) / len(counts), 3), "distinct_texts": len(texts),
            "dropped_pct": round(100.0 * dropped / samples, 3) if samples else 0.0,
            "dropout": sorted({c.caption_dropout for c in clips}),
        }

    @property
    def clips(self) -> int:
        return sum(b.clips for b in self.buckets)

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self, recurse=True)
        out["clips"] = self.clips
        out["samples_per_epoch"] = sum(b.samples for b in self.buckets)
        return out

    def format(self, max_listed: int = 20) -> str:
        """The human report. Every skipped file is listed; retimed videos, frame-count mismatches and verification
        events are listed up to ``max_listed`` each (all of them are in ``to_json()``)."""
        lines: list[str] = []
        fps = f"{self.target_fps:g} fps" if self.target_fps else "source rate"
        lines.append(f"wantrain data check: variant {self.variant}, clips retimed to {fps} ({self.retime}), "
                     f"clip mode {'/'.join(self.clip_modes) or '-'}")
        for ds in self.datasets:
            lines.append(f"  dataset {ds['path']}: {ds['videos']} videos, {ds['images']} images, {ds['clips']} clips, "
                         f"repeats {ds['repeats']}, {ds['skipped']} skipped")
        lines.append("")
        lines.append(f"buckets (width x height x frames), batch size {self.batch_size}, "
                     f"remainder {self.remainder_policy}:")
        lines.append(f"  {'bucket':>16} {'clips':>6} {'samples':>8} {'batches':>8} {'remainder':>9}")
        for b in self.buckets:
            name = f"{b.width}x{b.height}x{b.frames}"
            lines.append(f"  {name:>16} {b.clips:>6} {b.samples:>8} {b.batches:>8} {b.remainder:>9}")
        samples = sum(b.samples for b in self.buckets)
        lines.append(f"  {'total':>16} {self.clips:>6} {samples:>8} {self.steps_per_epoch:>8}")
        lines.append("")
        lines.append(f"steps per epoch: {self.steps_per_epoch} micro-batches")
        if self.epochs:
            e = self.epochs
            per = ", ".join(str(n) for n in e["micro_batches"])
            lines.append(f"epochs: the first is {e['steps_per_epoch']} optimizer steps (micro-batches per epoch: "
                         f"{per}; grad_accum {e['grad_accum']})")
            for key in ("max_epochs", "save_every_epochs", "validation.every_epochs", "sample.every_epochs"):
                if key in e:
                    name = key if "." in key else f"train.{key}"
                    target = {"max_epochs": "train.max_steps", "save_every_epochs": "train.save_every"}.get(
                        key, key.replace("every_epochs", "every"))
                    lines.append(f"  {name} = {e[key]['epochs']} -> {target} = {e[key]['steps']}")
        if self.captions:
            c = self.captions
            spread = (f"{c['variants_min']}" if c["variants_min"] == c["variants_max"] else
                      f"{c['variants_mean']:g} on average ({c['variants_min']}-{c['variants_max']})")
            rates = ", ".join(f"{d:g}" for d in c["dropout"])
            lines.append(f"captions: {spread} per medium, {c['distinct_texts']} distinct texts to encode; "
                         f"{c['dropped_pct']:.1f}% of samples trained with the empty prompt "
                         f"(caption_dropout {rates})")
        lines.append(f"pixels cropped: {self.pixels_cropped_pct:.1f}% (resize to cover, then centre crop)")
        lines.append(f"frames left over: {self.frames_left_over_pct:.1f}% ({self.frames_left_over} of "
                     f"{self.source_frames_total} frames after retiming not in any clip)")
        changed = [r for r in self.retimed if r["frames"] != r["source_frames"]]
        if changed:
            lines.append(f"retimed videos: {len(changed)}")
            for r in changed[:max_listed]:
                lines.append(f"  {display_path(r['path'])}: {r['source_frames']} frames at {r['source_fps']:g} fps -> "
                             f"{r['frames']} frames at {r['target_fps']:g} fps")
            if len(changed) > max_listed:
                lines.append(f"  ... and {len(changed) - max_listed} more (see the JSON report)")
        if self.frame_count_mismatches:
            lines.append(f"container frame counts that were wrong: {len(self.frame_count_mismatches)}")
            for r in self.frame_count_mismatches[:max_listed]:
                lines.append(f"  {display_path(r['path'])}: container says {r['container_frames']}, "
                             f"stream holds {r['frames']}")
        lines.append(f"ignored files: {len(self.ignored_files)}")
        for s in self.ignored_files:  # every one: a file a user expected to train must be findable here
            lines.append(f"  {display_path(s['path'])}: {s['reason']}")
        lines.append(f"skipped files: {len(self.skipped)}")
        for s in self.skipped:  # every one: this is the list a user acts on
            lines.append(f"  {display_path(s['path'])}: {s['reason']}")
        if self.verification:
            lines.append(f"decode verification events: {len(self.verification)}")
            for v in self.verification[:max_listed]:
                lines.append(f"  {display_path(v['path'])}: {v['action']} ({v['reason']})")
        if self.model_files:
            lines.append("model files:")
            lines.extend(f"  {line}" for line in self.model_files)
        if self.vram:
            v = self.vram
            lines.append("")
            lines.append(f"estimated peak VRAM: {v['gb']:.1f} GiB (largest bucket {v['width']}x{v['height']}x"
                         f"{v['frames']}, rank {v['rank']}, batch {v['batch_size']}, {v['base_dtype']} weights, "
                         f"gradient checkpointing {'on' if v['gradient_checkpointing'] else 'off'}; "
                         "formula in docs/data.md)")
            if "sampling_gb" in v:
                lines.append(f"estimated peak VRAM while sampling: {v['sampling_gb']:.1f} GiB ({v['sampling_size']}, "
                             f"[sample]; one expert resident; formula in docs/validation.md); the run needs "
                             f"{max(v['gb'], v['sampling_gb']):.1f} GiB")
        if self.memory_plan:
            plan = self.memory_plan
            chosen = plan["settings"]
            head = f"memory plan for {plan['bucket']}, one expert resident"
            head += f", budget {plan['budget_gib']:g} GiB" if plan["budget_gib"] is not None else " (settings as given)"
            lines.append("")
            lines.append(f"{head}: {chosen['base_dtype']} base, {chosen['blocks_to_swap']} blocks swapped, activation "
                         f"offload {'on' if chosen['offload_activations'] else 'off'} (docs/models.md, Memory):")
            lines.extend(plan["lines"])
        if self.host_memory:
            lines.append("")
            lines.append("host memory (RAM), part by part (docs/models.md, Host memory):")
            lines.extend(self.host_memory["lines"])
        return "\n".join(lines)
