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
}

# Hidden width and block count of the DiT per VAE family (Wan 2.2 configs); tiny variants use _TINY_BLOCKS and a
# width derived from their parameter count.
_ARCH = {"wan2.1": (5120, 40), "wan2.2": (3072, 30)}
_TINY_BLOCKS = 2
_PARAMS_PER_BLOCK_PER_D2 = 13.4  # self-attn 4d^2 + cross-attn 4d^2 + FFN ~2*2.7d^2
_ACT_BYTES_PER_TOKEN_PER_D = 44.0  # bf16 activations kept by one block for backward (see docs/data.md)
_OVERHEAD_GB = 1.0  # CUDA context, cuBLAS workspaces
_FRAGMENTATION = 1.10  # allocator slack
_TEXT_TOKENS, _TEXT_DIM = 512, 4096  # umT5-XXL context, cached, on the device per batch


def estimate_peak_vram_gb(
    spec: Any, width: int, height: int, frames: int, rank: int, batch_size: int,
    base_dtype: str = "bf16", gradient_checkpointing: bool = True,
) -> float:
    """Estimated peak device memory (GiB) of one LoRA training step on latents and text embeddings from the cache.

    ``base_dtype``: ``fp32``, ``bf16``, ``fp16``, ``fp8`` (or the torch spellings), or ``auto`` (fp32 for tiny
    variants, bf16 for real ones, as ``[model] base_dtype`` means it).

    ``spec`` is a ``VariantSpec``. Formula (docs/data.md, "VRAM estimate"), with ``m = spec.spatial_multiple``,
    ``d`` the hidden width and ``n`` the number of blocks::

        weights     = transformer_params * bytes(base_dtype)          # one expert resident; the other offloaded
        lora        = rank * lora_params_per_rank * 16                # fp32 weight + grad + two AdamW moments
        tokens      = batch * ((frames - 1) / 4 + 1) * (height / m) * (width / m)
        per_block   = tokens * d * 44                                 # bf16 activations one block keeps
        activations = n * tokens * d * 2 + per_block   if gradient_checkpointing   (block inputs + one recompute)
                      n * per_block                      otherwise
        text        = batch * text_len * 4096 * 2                      # umT5 context (512 tokens)
        peak        = 1.10 * (weights + lora + activations + text) + 1 GiB

    A rough planning figure (expect +-25%); block swapping, fp8 activations and attention kernels are not modelled.
    """
    if base_dtype == "auto":  # the model section's default: fp32 for tiny variants, bf16 for real ones
        base_dtype = "fp32" if spec.tiny else "bf16"
    if base_dtype not in _DTYPE_BYTES:
        raise ValueError(f"unknown base_dtype {base_dtype!r}; expected one of {', '.join(sorted(_DTYPE_BYTES))}")
    m = spec.spatial_multiple
    if spec.tiny:
        n = getattr(spec, "num_layers", _TINY_BLOCKS)
        d = max(8.0, math.sqrt(spec.transformer_params / (n * _PARAMS_PER_BLOCK_PER_D2)))
    else:
        d, n = _ARCH.get(spec.vae, (5120, 40))
        n = getattr(spec, "num_layers", n)
    weights = spec.transformer_params * _DTYPE_BYTES[base_dtype]
    lora = rank * spec.lora_params_per_rank * 16.0
    latent_frames = (frames - 1) // spec.frame_multiple + 1
    tokens = batch_size * latent_frames * (height / m) * (width / m)
    per_block = tokens * d * _ACT_BYTES_PER_TOKEN_PER_D
    if gradient_checkpointing:
        activations = n * tokens * d * 2.0 + per_block
    else:
        activations = n * per_block
    text = batch_size * getattr(spec, "text_len", _TEXT_TOKENS) * _TEXT_DIM * 2.0
    total = _FRAGMENTATION * (weights + lora + activations + text) + _OVERHEAD_GB * 2**30
    return total / 2**30


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
    if spec.tiny:
        n = getattr(spec, "num_layers", _TINY_BLOCKS)
        d = max(8.0, math.sqrt(spec.transformer_params / (n * _PARAMS_PER_BLOCK_PER_D2)))
    else:
        d = _ARCH.get(spec.vae, (5120, 40))[0]
    weights = spec.transformer_params * _DTYPE_BYTES[base_dtype] + rank * spec.lora_params_per_rank * 16.0
    tokens = ((frames - 1) // spec.frame_multiple + 1) * (height / m) * (width / m)
    denoise = tokens * d * _ACT_BYTES_PER_TOKEN_PER_D
    decode = _VAE_PARAMS.get(spec.vae, 127e6) * 4.0 + width * height * _VAE_DECODE_BYTES_PER_PIXEL
    return (_FRAGMENTATION * (weights + max(denoise, decode)) + _OVERHEAD_GB * 2**30) / 2**30


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
    ignored_files: list[str] = attrs.field(factory=list)  # neither media (by extension) nor captions
    pixels_cropped_pct: float = 0.0
    frames_left_over_pct: float = 0.0
    source_frames_total: int = 0
    frames_left_over: int = 0
    steps_per_epoch: int = 0
    vram: dict[str, Any] = attrs.field(factory=dict)
    memory_plan: dict[str, Any] = attrs.field(factory=dict)  # wantrain.app.preflight.plan_memory, part by part
    verification: list[dict[str, Any]] = attrs.field(factory=list)  # appended while decoding

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
        lines.append(f"pixels cropped: {self.pixels_cropped_pct:.1f}% (resize to cover, then centre crop)")
        lines.append(f"frames left over: {self.frames_left_over_pct:.1f}% ({self.frames_left_over} of "
                     f"{self.source_frames_total} frames after retiming not in any clip)")
        changed = [r for r in self.retimed if r["frames"] != r["source_frames"]]
        if changed:
            lines.append(f"retimed videos: {len(changed)}")
            for r in changed[:max_listed]:
                lines.append(f"  {r['path']}: {r['source_frames']} frames at {r['source_fps']:g} fps -> "
                             f"{r['frames']} frames at {r['target_fps']:g} fps")
            if len(changed) > max_listed:
                lines.append(f"  ... and {len(changed) - max_listed} more (see the JSON report)")
        if self.frame_count_mismatches:
            lines.append(f"container frame counts that were wrong: {len(self.frame_count_mismatches)}")
            for r in self.frame_count_mismatches[:max_listed]:
                lines.append(f"  {r['path']}: container says {r['container_frames']}, stream holds {r['frames']}")
        if self.ignored_files:
            shown = ", ".join(Path(p).name for p in self.ignored_files[:5])
            more = f", ... ({len(self.ignored_files)} in all)" if len(self.ignored_files) > 5 else ""
            lines.append(f"ignored files (not a supported image or video extension): {shown}{more}")
        lines.append(f"skipped files: {len(self.skipped)}")
        for s in self.skipped:  # every one: this is the list a user acts on
            lines.append(f"  {s['path']}: {s['reason']}")
        if self.verification:
            lines.append(f"decode verification events: {len(self.verification)}")
            for v in self.verification[:max_listed]:
                lines.append(f"  {v['path']}: {v['action']} ({v['reason']})")
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
        return "\n".join(lines)
