"""The explicit architectures of every variant (diffusers constructor arguments), and the tiny random twins.

Real numbers come from diffusers' ``convert_wan_to_diffusers.py`` and the official Wan 2.2 configs (see
shared/reference/wan22.md §1.1-1.4). They are used to load single-file checkpoints, for which diffusers'
auto-detection only knows Wan 2.1. The tiny twins keep the structure (channels, expert pair, VAE kind, patch
sizes, RoPE split) at toy width so that a whole run fits in seconds on a CPU; they are built offline, from the
run seed, with an in-memory tokenizer.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from wantrain.models.wan22.variants import VariantSpec

_COMMON = dict(
    patch_size=(1, 2, 2), attention_head_dim=128, freq_dim=256, text_dim=4096, eps=1e-6, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
    pos_embed_seq_len=None,
)
_REAL_TRANSFORMERS: dict[str, dict[str, Any]] = {
    "t2v-a14b": dict(_COMMON, in_channels=16, out_channels=16, num_layers=40, num_attention_heads=40, ffn_dim=13824),
    "i2v-a14b": dict(_COMMON, in_channels=36, out_channels=16, num_layers=40, num_attention_heads=40, ffn_dim=13824),
    "ti2v-5b": dict(_COMMON, in_channels=48, out_channels=48, num_layers=30, num_attention_heads=24, ffn_dim=14336),
}
# head_dim 12 keeps diffusers' RoPE split valid (h = w = 2*(12//6) = 4, t = 4).
_TINY_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=256, ffn_dim=32,
    num_layers=2, eps=1e-6, cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=None,
    added_kv_proj_dim=None, rope_max_seq_len=32, pos_embed_seq_len=None,
)

# Wan 2.1 VAE normalisation (16 channels), used by the 14B models and by the tiny 16-channel twins.
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

_TINY_VAE = {
    "wan2.1": dict(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                   temperal_downsample=[False, True, True], latents_mean=WAN21_LATENTS_MEAN,
                   latents_std=WAN21_LATENTS_STD),
    "wan2.2": dict(base_dim=3, z_dim=48, in_channels=12, out_channels=12, is_residual=True, patch_size=2,
                   dim_mult=[1, 1, 1, 1], num_res_blocks=1, scale_factor_spatial=16, scale_factor_temporal=4,
                   temperal_downsample=[False, True, True], latents_mean=[0.0] * 48, latents_std=[1.0] * 48),
}
_TINY_TEXT_ENCODER = dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
                          dropout_rate=0.0)

# Words of typical captions, so that tiny runs see distinct token ids for distinct prompts.
_TINY_WORDS = (
    "a an the of in on at with and to from by for is are its his her their this that red green blue yellow "
    "black white orange purple pink brown gray dark bright small large big tiny old young man woman person "
    "people child dog cat bird horse car bus train boat plane tree trees flower grass water sea ocean river "
    "lake sky cloud clouds sun moon star night day city street road room house building wall window door table "
    "chair light fire snow rain forest mountain field beach sand rock ball face hand hands eyes hair camera "
    "walking running jumping flying swimming sitting standing dancing moving turning falling rising slowly "
    "quickly close view shot scene video image frame motion pan zoom left right up down over under through "
    "around toward away square circle shape background foreground moves rotates spinning bouncing smooth"
).split()
TINY_VOCAB: tuple[str, ...] = ("<pad>", "</s>", "<unk>", *dict.fromkeys(_TINY_WORDS))


def transformer_kwargs(spec: VariantSpec) -> dict[str, Any]:
    """Constructor arguments of ``spec``'s transformer class (:func:`transformer_class`; one expert). A VACE
    variant adds ``vace_layers`` (a list, as diffusers' config.json has it) and ``vace_in_channels``."""
    if spec.tiny:
        kwargs = dict(_TINY_TRANSFORMER, in_channels=spec.transformer_in_channels, out_channels=spec.latent_channels)
    else:
        kwargs = dict(_REAL_TRANSFORMERS["t2v-a14b" if spec.vace else spec.name])
    if spec.vace:
        kwargs.update(vace_layers=list(spec.vace_layers), vace_in_channels=spec.vace_in_channels)
    return kwargs


def planner_kwargs(spec: VariantSpec) -> dict[str, Any]:
    """``WanTransformer3DModel`` arguments the memory planner builds on ``meta`` for ``spec``'s block shapes: the
    transformer's own (:func:`transformer_kwargs`), except that a VACE variant's VACE blocks count as main blocks of
    the same shape (``num_layers`` + one per VACE layer): their LoRA, recompute and checkpointed inputs are a main
    block's. Their weights are counted on the real class (``memory.stored_meta_build``): each VACE block's
    ``proj_out`` (and the first one's ``proj_in``) is dim x dim, 7 % of a main block's weights."""
    kwargs = transformer_kwargs(spec)
    if spec.vace:
        kwargs.pop("vace_layers")
        kwargs.pop("vace_in_channels")
        kwargs["num_layers"] += len(spec.vace_layers)
    return kwargs


def transformer_class(spec: VariantSpec) -> type:
    """diffusers' transformer class of ``spec``: ``WanVACETransformer3DModel`` for the VACE variants (the main
    blocks of ``WanTransformer3DModel`` plus ``vace_blocks``), else ``WanTransformer3DModel``."""
    from diffusers import WanTransformer3DModel, WanVACETransformer3DModel

    return WanVACETransformer3DModel if spec.vace else WanTransformer3DModel


def transformer_defaults(spec: VariantSpec | None = None) -> dict[str, Any]:
    """diffusers' defaults of the transformer constructor of ``spec`` (``WanTransformer3DModel`` without one):
    what a config.json key left out means."""
    import inspect

    from diffusers import WanTransformer3DModel

    cls = transformer_class(spec) if spec is not None else WanTransformer3DModel
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def _seeded(seed: int, part: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{part}".encode()).digest()[:6], "little")


def tiny_config_hash(spec: VariantSpec) -> str:
    """Hash of the tiny encoders' architecture (part of the tiny ``encoder_identity``)."""
    blob = json.dumps([_TINY_VAE[spec.vae], _TINY_TEXT_ENCODER, TINY_VOCAB, spec.text_len], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_transformer(spec: VariantSpec, seed: int, expert: str | None):
    """A random tiny transformer; the same (seed, expert) always gives the same weights (float32)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seeded(seed, f"transformer:{expert}"))
        return transformer_class(spec)(**transformer_kwargs(spec)).eval()


def cast_keeping_fp32_modules(transformer, dtype: torch.dtype):
    """Give every floating parameter and buffer the dtype ``from_pretrained(torch_dtype=dtype)`` gives it: float32
    in the modules diffusers keeps in float32 (``_keep_in_fp32_modules``: RoPE, time embedder, modulation tables,
    norm1-3), ``dtype`` everywhere else, whatever dtype each tensor had before (an fp16 single file included)."""
    keep = set(getattr(transformer, "_keep_in_fp32_modules", None) or ())
    for name, tensor in [*transformer.named_parameters(), *transformer.named_buffers()]:
        if tensor.is_floating_point():
            target = torch.float32 if keep.intersection(name.split(".")) else dtype
            if tensor.dtype != target:
                tensor.data = tensor.data.to(target)
    return transformer


def tiny_vae(spec: VariantSpec, seed: int):
    from diffusers import AutoencoderKLWan

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seeded(seed, "vae"))
        return AutoencoderKLWan(**_TINY_VAE[spec.vae]).eval()


def tiny_tokenizer(spec: VariantSpec):
    """A word-level tokenizer over :data:`TINY_VOCAB` (lower-cased, ``</s>`` appended), built in memory."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(TINY_VOCAB)}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", vocab["</s>"])])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", model_max_length=spec.text_len
    )


def tiny_text_encoder(spec: VariantSpec, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(_seeded(seed, "text_encoder"))
        config = UMT5Config(vocab_size=len(TINY_VOCAB), pad_token_id=0, eos_token_id=1, **_TINY_TEXT_ENCODER)
        return UMT5EncoderModel(config).eval()


def vace_pipeline() -> type:
    """diffusers' ``WanVACEPipeline`` (imported quietly, as :func:`wan_pipelines`)."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        from diffusers import WanVACEPipeline
    finally:
        hf_logging.set_verbosity(level)
    return WanVACEPipeline


def wan_pipelines() -> tuple[type, type]:
    """diffusers' ``WanPipeline`` and ``WanImageToVideoPipeline``. Importing the second makes transformers log, once,
    that ``CLIPImageProcessor`` falls back to its PIL twin when torchvision is not installed; wantrain never builds
    that processor (``image_processor=None``: Wan 2.2 has no CLIP image branch), so the notice is kept quiet."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        from diffusers import WanImageToVideoPipeline, WanPipeline
    finally:
        hf_logging.set_verbosity(level)
    return WanPipeline, WanImageToVideoPipeline


def write_tiny_diffusers_dir(spec: VariantSpec, seed: int, path) -> None:
    """Write a complete tiny diffusers pipeline directory (what ``WanPipeline.from_pretrained`` reads).

    Used by tests and by anyone who wants to see the layout wantrain expects from a real model directory.
    """
    from diffusers import UniPCMultistepScheduler

    WanPipeline, WanImageToVideoPipeline = wan_pipelines()
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                        flow_shift=5.0 if spec.vae == "wan2.2" else 3.0)
    parts = dict(tokenizer=tiny_tokenizer(spec), text_encoder=tiny_text_encoder(spec, seed), vae=tiny_vae(spec, seed),
                 scheduler=scheduler)
    if spec.boundary_ratio is None:
        pipe = WanPipeline(**parts, transformer=tiny_transformer(spec, seed, None), expand_timesteps=True)
    else:
        cls = {"i2v": WanImageToVideoPipeline, "vace": vace_pipeline()}.get(spec.conditioning, WanPipeline)
        extra = dict(image_encoder=None, image_processor=None) if spec.conditioning == "i2v" else {}
        pipe = cls(**parts, **extra, transformer=tiny_transformer(spec, seed, "high_noise"),
                   transformer_2=tiny_transformer(spec, seed, "low_noise"), boundary_ratio=spec.boundary_ratio)
    pipe.save_pretrained(str(path), safe_serialization=True)
