"""Adapter types (``lora.type``) at their defaults: trainable parameters and file size per expert, and the step
time of each on the tiny model against LoRA (CPU, one torch thread):

    python bench/bench_adapter_types.py [--rounds 7] [--steps 10] [--rank 16]

Parameters per expert for the real variants are counted from the layer shapes (the 10 Linears of every block)
with peft's own LoKr factorization; the file size is parameters x 2 bytes (bf16, the default ``save_dtype``) plus
the float32 ``alpha`` (and DoRA's ``dora_scale``) per module. For the tiny twin the file is written and measured.
Step time: each type keeps its own adapter (tiny-t2v, one expert, AdamW, one cached 9x32x32 batch, no gradient
checkpointing); a round is ``--steps`` optimizer steps; the order of the types rotates every round; the ratio is
the median over rounds of (type's round time / LoRA's round time in the same round). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

TYPES = ("lora", "lokr", "loha", "dora")
# per block: (in, out) of the 10 adapted Linears (q, k, v, o of self- and cross-attention; ffn.0, ffn.2)
SHAPES = {
    "t2v-a14b": (40, [(5120, 5120)] * 8 + [(5120, 13824), (13824, 5120)]),
    "ti2v-5b": (30, [(3072, 3072)] * 8 + [(3072, 14336), (14336, 3072)]),
}


def _lokr_params(d_in: int, d_out: int, rank: int) -> int:
    from peft.tuners.lokr.layer import factorization

    in_m, in_n = factorization(d_in, -1)
    out_l, out_k = factorization(d_out, -1)
    w1 = out_l * in_m  # full unless lokr_decompose_both
    w2 = out_k * in_n if rank >= max(out_k, in_n) / 2 else rank * (out_k + in_n)
    return w1 + w2


def counted(kind: str, rank: int, blocks: int, shapes: list[tuple[int, int]]) -> tuple[int, int]:
    """(trainable parameters, file bytes) of one expert."""
    params = extra = 0
    for d_in, d_out in shapes:
        params += {"lora": rank * (d_in + d_out), "dora": rank * (d_in + d_out) + d_out,
                   "loha": 2 * rank * (d_in + d_out), "lokr": _lokr_params(d_in, d_out, rank)}[kind]
        extra += 4 + (4 * d_out if kind == "dora" else 0)  # alpha; dora_scale [out, 1] float32
    if kind == "dora":
        params_file = params - sum(d_out for _, d_out in shapes)  # the magnitude is written as dora_scale
    else:
        params_file = params
    return blocks * params, blocks * (2 * params_file + extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    out: dict = {"rank": args.rank, "per_expert": {}, "tiny": {}}
    for variant, (blocks, shapes) in SHAPES.items():
        out["per_expert"][variant] = {k: dict(zip(("params", "file_bytes"), counted(k, args.rank, blocks, shapes),
                                                  strict=True)) for k in TYPES}
    adapters, optimizers = {}, {}
    g = torch.Generator().manual_seed(0)
    raw = {"pixels": torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1, "captions": ["a red ball"]}
    batch = None
    for kind in TYPES:
        adapter = build_adapter(ModelConfig(variant="tiny-t2v", experts="high_noise", gradient_checkpointing=False),
                                LoraConfig(type=kind, rank=args.rank), seed=0, device=torch.device("cpu"),
                                base_lr=1e-3)
        batch = batch or adapter.encode_batch(raw)
        adapters[kind], optimizers[kind] = adapter, torch.optim.AdamW(adapter.param_groups(), fused=True)
        with tempfile.TemporaryDirectory() as tmp:
            (file,) = adapter.saver(Path(tmp), "bench").save(step=0, final=True)
            size = Path(file).stat().st_size
        out["tiny"][kind] = {"params": sum(p.numel() for p in adapter.trainable_parameters()), "file_bytes": size}
    generator = torch.Generator().manual_seed(1)
    times: dict[str, list[float]] = {k: [] for k in TYPES}
    for r in range(args.rounds + 1):  # round 0 warms up
        order = TYPES[r % len(TYPES):] + TYPES[:r % len(TYPES)]
        for kind in order:
            adapter, optimizer = adapters[kind], optimizers[kind]
            start = time.perf_counter()
            for _ in range(args.steps):
                adapter.loss(batch, "high_noise", generator).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if r:
                times[kind].append(time.perf_counter() - start)
    for kind in TYPES:
        ratios = [t / base for t, base in zip(times[kind], times["lora"], strict=True)]
        out["tiny"][kind].update(step_ms_median=1e3 * statistics.median(times[kind]) / args.steps,
                                 ratio_to_lora_median=statistics.median(ratios),
                                 ratio_to_lora_quartiles=statistics.quantiles(ratios, n=4)[::2])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
