"""Facts about each Wan 2.2 variant (sources: ../shared/reference/wan22.md). Shared by the model and data code."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class VariantSpec:
    """What the trainer must know about a variant before any weights are loaded.

    ``boundary_ratio`` is None for single-transformer models. ``spatial_multiple`` is VAE stride x patch size
    (pixel sides must be multiples of it); frames are 4k+1 (``frame_multiple`` = 4, causal first frame).
    """

    name: str
    tiny: bool
    experts: tuple[str | None, ...]
    boundary_ratio: float | None
    target_fps: float
    spatial_multiple: int
    frame_multiple: int
    vae: str  # "wan2.1" (16 ch, stride 4x8x8) or "wan2.2" (48 ch, stride 4x16x16)
    latent_channels: int
    transformer_in_channels: int
    conditioning: str  # "t2v", "i2v" (36-channel input), "ti2v" (clean first latent frame), "vace" (control context)
    transformer_params: float  # per expert, for memory estimates
    lora_params_per_rank: float  # per expert, with the default 10 targets per block
    default_resolution: tuple[int, int]  # (width, height)
    default_frames: int
    text_len: int = 512  # tokens of the UMT5 prompt embedding (zero-padded past the prompt's length)
    num_layers: int = 40  # transformer blocks per expert (LoRA keys name blocks 0..num_layers-1)
    # VACE variants: the main blocks after which a VACE block's hint is added (one VACE block each), and the
    # channels of the control context (inactive + reactive latents, 2 x 16, and the 8x8-packed mask, 64)
    vace_layers: tuple[int, ...] = ()
    vace_in_channels: int = 0

    @property
    def vace(self) -> bool:
        return bool(self.vace_layers)

    @property
    def all_blocks(self) -> int:
        """Blocks per expert, main and VACE: what ``model.blocks_to_swap`` counts (``swap.run_order``)."""
        return self.num_layers + len(self.vace_layers)


def _spec(**kw: object) -> VariantSpec:
    return VariantSpec(**kw)  # type: ignore[arg-type]


_A14B = dict(
    target_fps=16.0, spatial_multiple=16, frame_multiple=4, vae="wan2.1", latent_channels=16,
    transformer_params=14.3e9, lora_params_per_rank=4.79e6, default_resolution=(832, 480), default_frames=81,
)
_5B = dict(
    num_layers=30, target_fps=24.0, spatial_multiple=32, frame_multiple=4, vae="wan2.2", latent_channels=48,
    transformer_params=5.0e9, lora_params_per_rank=2.52e6, default_resolution=(1280, 704), default_frames=121,
)
_TINY = dict(transformer_params=2.0e5, default_resolution=(64, 64), default_frames=9, text_len=16, num_layers=2)

VARIANTS: dict[str, VariantSpec] = {
    "t2v-a14b": _spec(name="t2v-a14b", tiny=False, experts=("high_noise", "low_noise"), boundary_ratio=0.875,
                      transformer_in_channels=16, conditioning="t2v", **_A14B),
    "i2v-a14b": _spec(name="i2v-a14b", tiny=False, experts=("high_noise", "low_noise"), boundary_ratio=0.900,
                      transformer_in_channels=36, conditioning="i2v", **_A14B),
    "ti2v-5b": _spec(name="ti2v-5b", tiny=False, experts=(None,), boundary_ratio=None,
                     transformer_in_channels=48, conditioning="ti2v", **_5B),
}
# Wan2.2-VACE-Fun-A14B: the two T2V-A14B experts with 8 VACE blocks each (hints after blocks 0, 5, ..., 35), as
# VACE-14B; the transformer reads T2V's 16 channels and the control context its 96.
VARIANTS["vace-t2v-a14b"] = attrs.evolve(VARIANTS["t2v-a14b"], name="vace-t2v-a14b", conditioning="vace",
                                         transformer_params=17.3e9, lora_params_per_rank=5.84e6,
                                         vace_layers=tuple(range(0, 40, 5)), vace_in_channels=96)
# Tiny twins: same structure (channels, expert pair, VAE kind, multiples), toy sizes.
VARIANTS["tiny-t2v"] = attrs.evolve(VARIANTS["t2v-a14b"], name="tiny-t2v", tiny=True, lora_params_per_rank=0.0,
                                    **_TINY)
VARIANTS["tiny-i2v"] = attrs.evolve(VARIANTS["i2v-a14b"], name="tiny-i2v", tiny=True, lora_params_per_rank=0.0,
                                    **_TINY)
VARIANTS["tiny-ti2v"] = attrs.evolve(VARIANTS["ti2v-5b"], name="tiny-ti2v", tiny=True, lora_params_per_rank=0.0,
                                     **_TINY)
VARIANTS["tiny-vace-t2v"] = attrs.evolve(VARIANTS["vace-t2v-a14b"], name="tiny-vace-t2v", tiny=True,
                                         lora_params_per_rank=0.0, **_TINY, vace_layers=(0, 1))


def variant_spec(name: str) -> VariantSpec:
    return VARIANTS[name]
