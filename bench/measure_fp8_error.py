"""How far fp8 storage of the frozen base moves a real-width Wan block and the tiny model's training loss from bf16.

1. One real-width T2V-A14B block (width 5120, FFN 13824, 40 heads), as a one-block ``WanTransformer3DModel`` so
   that the block sees the real embeddings and modulation. Output relative error of the block,
   ``||y - y_bf16|| / ||y_bf16||``, and of its update ``y - x`` (what the branches add to the residual stream),
   for plain fp8 (diffusers' layerwise casting: ``base_dtype = "fp8"``), scaled fp8
   (``base_dtype = "fp8_scaled"``: one scale per output row) and, for comparison only, block-wise scales (one per
   1x128 piece of a row, musubi-tuner's kind; dequantised to bf16 here, not a wantrain setting).
   The real checkpoint's weight statistics are not known here (no weights may be downloaded), so two inits:
   * ``default``: diffusers/PyTorch's own init (every Linear kaiming-uniform, std = 1 / sqrt(3 x fan_in): 0.0081 for
     5120 inputs, 0.0049 for 13824);
   * ``row-spread``: the same with every output row of the block's Linears multiplied by a log-normal gain
     (sigma 1), standing in for the spread of channel magnitudes a trained network has (an assumption).
   Tokens: ``--tokens`` (default 1024: a 4x64x64 latent; the real 832x480x81 clip has 32 760, too slow for 2
   CPU cores in minutes; the error is a per-element ratio and does not depend much on the count).
2. The tiny model (tiny-t2v, high-noise expert, rank 4 LoRA): ``--steps`` AdamW steps on one batch of random video
   with bf16, fp8 and scaled fp8 storage from the same LoRA start and the same noise; the loss at every step and
   its largest difference from bf16.

Runs on a CPU (fp8 storage is allowed on the CPU here, as the tests allow it). JSON on stdout.

    python bench/measure_fp8_error.py                 # ~7-10 min on 2 shared cores, ~6 GB RAM
    python bench/measure_fp8_error.py --tokens 4096
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch

A14B = dict(width=5120, heads=40, ffn=13824)
BLOCK_COLUMNS = 128


def build_block_model(init: str, seed: int = 0):
    """A one-block T2V-A14B transformer in bf16 (fp32 modules kept), weights as ``init`` says."""
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    kwargs = dict(transformer_kwargs(VARIANTS["t2v-a14b"]), num_layers=1)
    assert kwargs["ffn_dim"] == A14B["ffn"] and kwargs["num_attention_heads"] == A14B["heads"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = WanTransformer3DModel(**kwargs)
        if init == "row-spread":
            with torch.no_grad():
                for module in model.blocks.modules():
                    if isinstance(module, torch.nn.Linear):
                        gain = torch.randn(module.out_features, 1).exp()  # log-normal, sigma 1
                        module.weight.mul_(gain)
    return cast_keeping_fp32_modules(model, torch.bfloat16).eval().requires_grad_(False)


def blockwise_dequantised(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` through E4M3 with one scale per 1 x BLOCK_COLUMNS piece of each row, back in bf16."""
    from wantrain.models.wan22.fp8 import FP8, FP8_MAX

    out, cols = weight.shape
    w = weight.float().reshape(out, cols // BLOCK_COLUMNS, BLOCK_COLUMNS)
    absmax = w.abs().amax(dim=2, keepdim=True)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return (q.float() * scale).reshape(out, cols).to(torch.bfloat16)


def storages(model):
    """{name: model} in each storage measured (built from one bf16 model)."""
    from wantrain.models.wan22.fp8 import to_scaled_fp8

    plain = copy.deepcopy(model)
    plain.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    scaled = to_scaled_fp8(copy.deepcopy(model))
    blockwise = copy.deepcopy(model)
    with torch.no_grad():
        for module in blockwise.blocks.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.data = blockwise_dequantised(module.weight.data)
    return {"fp8 (plain cast)": plain, "fp8_scaled (per row)": scaled, "block-wise 1x128 (comparison)": blockwise}


def block_output(model, latents, text, timestep) -> tuple[torch.Tensor, torch.Tensor]:
    """(the block's output, its update: output minus input, what the attention and FFN branches add to the
    residual stream, which carries the input through unchanged and so dilutes the output's error)."""
    captured = {}
    handle = model.blocks[0].register_forward_hook(lambda m, args, out: captured.update(x=args[0], y=out))
    with torch.no_grad():
        model(hidden_states=latents, timestep=timestep, encoder_hidden_states=text, return_dict=False)
    handle.remove()
    y = captured["y"].float()
    return y, y - captured["x"].float()


def measure_block(tokens: int, init: str) -> dict:
    side = 64
    frames = max(1, tokens // (side // 2) ** 2)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 16, frames, side, side, generator=g).to(torch.bfloat16)
    text = torch.randn(1, 512, 4096, generator=g).to(torch.bfloat16)
    timestep = torch.tensor([700.0])
    model = build_block_model(init)
    reference, reference_update = block_output(model, latents, text, timestep)
    out = {"tokens": frames * (side // 2) ** 2, "init": init, "relative_error_vs_bf16": {},
           "update_relative_error_vs_bf16": {}}
    for name, variant in storages(model).items():
        y, update = block_output(variant, latents, text, timestep)
        out["relative_error_vs_bf16"][name] = float((y - reference).norm() / reference.norm())
        out["update_relative_error_vs_bf16"][name] = float((update - reference_update).norm()
                                                           / reference_update.norm())
    return out


def measure_tiny(steps: int) -> dict:
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter
    from wantrain.models.wan22 import adapter as adapter_module

    adapter_module.FP8_DEVICE_TYPES = ("cuda", "cpu")
    g = torch.Generator().manual_seed(0)
    raw = {"pixels": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1,
           "captions": ["a red ball bouncing on the grass"]}
    losses = {}
    batch = None
    for dtype in ("bf16", "fp8", "fp8_scaled"):
        adapter = build_adapter(ModelConfig(variant="tiny-t2v", experts="high_noise", base_dtype=dtype),
                                LoraConfig(rank=4), seed=0, device=torch.device("cpu"), base_lr=1e-2)
        batch = batch or adapter.encode_batch(raw)  # the same cached batch for every storage
        optimizer = torch.optim.AdamW(adapter.param_groups(), weight_decay=0.0)
        generator = torch.Generator().manual_seed(1)
        series = []
        for _ in range(steps):
            loss = adapter.loss(batch, "high_noise", generator)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            series.append(loss.item())
        losses[dtype] = series
    ref = losses["bf16"]
    return {"steps": steps, "lr": 1e-2, "losses": losses,
            "max_abs_loss_difference_vs_bf16": {d: max(abs(a - b) for a, b in zip(s, ref, strict=True))
                                                for d, s in losses.items() if d != "bf16"},
            "mean_relative_loss_difference_vs_bf16": {
                d: sum(abs(a - b) / b for a, b in zip(s, ref, strict=True)) / steps
                for d, s in losses.items() if d != "bf16"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--init", choices=["default", "row-spread", "both"], default="both")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    result = {"block": [], "torch": torch.__version__, "threads": torch.get_num_threads()}
    for init in (["default", "row-spread"] if args.init == "both" else [args.init]):
        result["block"].append(measure_block(args.tokens, init))
        print(f"block ({init}) done after {time.perf_counter() - started:.0f} s", file=sys.stderr)
    result["tiny"] = measure_tiny(args.steps)
    result["seconds"] = round(time.perf_counter() - started, 1)
    json.dump(result, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
