"""What each frozen-base storage costs in quality, per Linear of a real-width T2V-A14B block, against bf16.

The six Linear shapes of a block (self- and cross-attention q/k/v/out: 5120 x 5120; the FFN's 13824 x 5120 and
5120 x 13824), weights drawn as diffusers initialises them (kaiming-uniform, std = 1 / sqrt(3 x fan_in)) and then
given the outliers trained transformers have (an assumption: no real checkpoint may be downloaded here):

* ``rows``: every output row times a log-normal gain (sigma 0.5): the spread of channel magnitudes;
* ``columns``: on top, 0.5 % of the input channels (26 of 5120) times 10: the outlier features that make a row's
  absmax much larger than its typical weight.

For each storage (``fp8``: a plain float8_e4m3fn cast, as diffusers' layerwise casting stores it; ``fp8_scaled``:
one scale per row, ``fp8.py``; ``int8`` and ``nf4``: bitsandbytes codes with one absmax per 64 weights and the
outlier input channels scaled down, ``lowbit.py``; ``int8_unscaled`` / ``nf4_unscaled``: the same without the
column scales, for comparison; ``int8_rowwise``: bitsandbytes' per-row int8, for comparison only, not a
setting), on ``--tokens`` bf16 inputs x:

* ``output``: the relative error of the layer's output, ``||x Wq^T - x W^T|| / ||x W^T||`` (bf16 matmuls, the
  reference the bf16 base itself, whose own rounding is the floor);
* ``grad_cos``: the cosine between the gradient the layer passes back to its input (``g Wq`` for a random upstream
  gradient g: what every LoRA before it in the network receives) and bf16's. The gradient of the layer's own LoRA
  does not depend on its base weight (the LoRA is added to the output), so this is what a storage changes in the
  LoRA gradients, layer by layer.

JSON on stdout (the per-format worst layer and every layer). Runs on a CPU in a few minutes:

    python bench/measure_lowbit_error.py
    python bench/measure_lowbit_error.py --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import math

import torch

SHAPES = {"attn q/k/v/o": (5120, 5120), "ffn up": (13824, 5120), "ffn down": (5120, 13824)}
FORMATS = ("fp8", "fp8_scaled", "int8", "int8_unscaled", "int8_rowwise", "nf4", "nf4_unscaled")


def weight(shape: tuple[int, int], outliers: str, seed: int) -> torch.Tensor:
    out_features, in_features = shape
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)  # kaiming-uniform with a = sqrt(5), as nn.Linear initialises
    w = (torch.rand(shape, generator=g) * 2 - 1) * bound
    w *= torch.randn(out_features, 1, generator=g).mul(0.5).exp()  # log-normal row gains
    if outliers == "columns":
        cols = torch.randperm(in_features, generator=g)[: max(1, in_features // 200)]
        w[:, cols] *= 10.0
    return w.to(torch.bfloat16)


def stored(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """The bf16 weight a storage computes with."""
    from wantrain.models.wan22 import fp8, lowbit

    if fmt == "fp8":
        return w.to(torch.float8_e4m3fn).to(torch.bfloat16)
    if fmt == "fp8_scaled":
        q, s = fp8.quantise_rows(w)
        return fp8.dequantise(q, s, torch.bfloat16)
    if fmt == "int8_rowwise":
        bnb = lowbit._functional()
        q, s, _ = bnb.int8_vectorwise_quant(w.to(torch.float16))
        return (q.float() * s.float()[:, None] / 127).to(torch.bfloat16)
    if fmt.endswith("_unscaled"):  # bitsandbytes' blocks alone, no column scales (before issue 56's outlier fix)
        kind = fmt.removesuffix("_unscaled")
        codes, absmax = lowbit._quantise_whole(w, kind)
        return lowbit.dequantise(codes.reshape(-1), absmax, kind, tuple(w.shape), torch.bfloat16)
    codes, absmax, scale = lowbit.quantise(w, fmt)
    return lowbit.dequantise(codes, absmax, fmt, tuple(w.shape), torch.bfloat16, scale)


def measure(tokens: int, outliers: str) -> dict:
    rows = {}
    for i, (name, shape) in enumerate(SHAPES.items()):
        w = weight(shape, outliers, seed=i)
        g = torch.Generator().manual_seed(100 + i)
        x = torch.randn(tokens, shape[1], generator=g).to(torch.bfloat16)
        upstream = torch.randn(tokens, shape[0], generator=g).to(torch.bfloat16)
        exact = x.float() @ w.float().T  # float32: the reference every storage, bf16 included, is held to
        grad_exact = upstream.float() @ w.float()
        rows[name] = {}
        for fmt in ("bf16", *FORMATS):
            wq = w if fmt == "bf16" else stored(w, fmt)
            y = (x @ wq.T).float()
            grad = (upstream @ wq).float()
            rows[name][fmt] = {
                "output": ((y - exact).norm() / exact.norm()).item(),
                "grad_cos": torch.nn.functional.cosine_similarity(grad.flatten(), grad_exact.flatten(), dim=0).item(),
            }
    worst = {fmt: {"output": max(r[fmt]["output"] for r in rows.values()),
                   "grad_cos": min(r[fmt]["grad_cos"] for r in rows.values())} for fmt in ("bf16", *FORMATS)}
    return {"worst": worst, "layers": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(json.dumps({"tokens": args.tokens, "rows": measure(args.tokens, "rows"),
                      "columns": measure(args.tokens, "columns")}, indent=1))


if __name__ == "__main__":
    main()
