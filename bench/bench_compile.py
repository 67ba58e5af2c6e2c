"""``model.compile`` and ``model.attention`` on the CPU: compiled vs eager step time on the tiny twin, the compile
cache's effect on a second process, and the FLOPs of one real-size A14B training step (counted, not run).

    python bench/bench_compile.py steps [--steps 12] [--types lora,lokr,loha,dora] [--swap]
    python bench/bench_compile.py cache          # two fresh processes, one cache folder: first-step times
    python bench/bench_compile.py flops [--size 832x480x81] [--layers 40]

``steps``: for each ``lora.type``, one adapter eager and one compiled with inductor (``model.compile =
"default"``) on tiny-t2v (one expert, AdamW, one cached 9x32x32 batch, gradient checkpointing; ``--swap``: one
block swapped and activation offload on); per setting the first step's time (the compile), the median of the
others, their ratio (compiled / eager), the largest relative loss difference over the steps, and dynamo's graph
and graph-break counts. ``cache``: the same compiled step in two fresh processes sharing a cache folder: the
second's first step against the first's (target <= 25 %). ``flops``: one expert's training step at the given
size under ``FakeTensorMode`` (no memory, no compute) inside ``FlopCounterMode``: forward, backward and
checkpointing's recompute, with the attention part apart. Compiling and the kernel choice change how the same
FLOPs are executed (fusion, memory traffic), not their count: one count serves every setting. Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def _adapter(kind: str, compile_mode: str, swap: bool):
    from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter

    memory = dict(blocks_to_swap=1, offload_activations=True, pin_host_copies=False) if swap else {}
    return build_adapter(ModelConfig(variant="tiny-t2v", compile=compile_mode, **memory),
                         LoraConfig(rank=4, type=kind), seed=0, device=torch.device("cpu"), base_lr=1e-3)


def _batch(adapter):
    g = torch.Generator().manual_seed(0)
    pixels = torch.rand(1, 3, 9, 32, 32, generator=g) * 2 - 1
    return adapter.encode_batch({"pixels": pixels, "captions": ["a red ball bouncing on the grass"]})


def timed_steps(kind: str, compile_mode: str, steps: int, swap: bool) -> tuple[list[float], list[float]]:
    """(seconds of each optimizer step, losses) of ``steps`` steps."""
    adapter = _adapter(kind, compile_mode, swap)
    batch = _batch(adapter)
    optimizer = torch.optim.AdamW(adapter.param_groups(), lr=1e-2, weight_decay=0.0)
    generator = torch.Generator().manual_seed(1)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = adapter.loss(batch, "high_noise", generator)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    return times, losses


def bench_steps(types: list[str], steps: int, swap: bool) -> list[dict]:
    from wantrain.models.wan22.compile import compile_counts

    rows = []
    for kind in types:
        eager_t, eager_l = timed_steps(kind, "off", steps, swap)
        before = compile_counts()
        comp_t, comp_l = timed_steps(kind, "default", steps, swap)
        after = compile_counts()
        eager_med, comp_med = statistics.median(eager_t[1:]), statistics.median(comp_t[1:])
        rows.append({"lora_type": kind, "swap_and_offload": swap, "steps": steps,
                     "eager_first_s": round(eager_t[0], 3), "eager_median_s": round(eager_med, 4),
                     "compiled_first_s": round(comp_t[0], 2), "compiled_median_s": round(comp_med, 4),
                     "compiled_over_eager": round(comp_med / eager_med, 3),
                     "max_rel_loss_diff": max(abs(a - b) / abs(a) for a, b in zip(eager_l, comp_l, strict=True)),
                     "graphs": after["graphs"] - before["graphs"],
                     "graph_breaks": after["graph_breaks"] - before["graph_breaks"]})
    return rows


_CACHE_CHILD = """
import json, sys, time, torch
sys.path.insert(0, {bench!r})
from pathlib import Path
from bench_compile import _adapter, _batch
from wantrain.models.wan22.compile import use_cache_dir
use_cache_dir(Path({cache!r}))
adapter = _adapter("lora", "default", False)
batch = _batch(adapter)
start = time.perf_counter()
adapter.loss(batch, "high_noise", torch.Generator().manual_seed(1)).backward()
first = time.perf_counter() - start
start = time.perf_counter()
adapter.loss(batch, "high_noise", torch.Generator().manual_seed(1)).backward()
print(json.dumps({{"first_step_s": first, "second_step_s": time.perf_counter() - start}}))
"""


def bench_cache() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHINDUCTOR_", "TRITON_"))}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as folder:
        code = _CACHE_CHILD.format(bench=str(ROOT / "bench"), cache=str(Path(folder) / "torch_compile"))
        runs = []
        for _ in range(2):
            done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    return {"first_process": first, "second_process": second,
            "second_first_step_over_first": round(second["first_step_s"] / first["first_step_s"], 3)}


def bench_flops(size: tuple[int, int, int], layers: int | None, rank: int) -> dict:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(ROOT / "bench"))
    from trace_memory import DEVICE, build_fake_expert

    from wantrain.models.wan22.variants import VARIANTS

    spec = VARIANTS["t2v-a14b"]
    width, height, frames = size
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    model = build_fake_expert("t2v-a14b", "bf16", rank, fake, layers)
    latent = (1, 16, 1 + (frames - 1) // 4, height // 8, width // 8)
    with fake:
        x = torch.empty(latent, dtype=torch.bfloat16, device=DEVICE)
        text = torch.empty(1, spec.text_len, 4096, dtype=torch.bfloat16, device=DEVICE)
        t = torch.empty(1, dtype=torch.float32, device=DEVICE)
        with FlopCounterMode(display=False) as forward:
            pred = model(hidden_states=x, timestep=t, encoder_hidden_states=text, return_dict=False)[0]
        with FlopCounterMode(display=False) as backward:  # with checkpointing: the recompute and the backward
            pred.float().pow(2).mean().backward()

    def split(counter) -> tuple[float, float]:
        counts = counter.get_flop_counts().get("Global", {})
        attention = sum(v for op, v in counts.items() if "attention" in str(op))
        return float(sum(counts.values())), float(attention)

    (fwd, fwd_attn), (bwd, bwd_attn) = split(forward), split(backward)
    n = layers or spec.num_layers
    tokens = latent[2] * latent[3] * latent[4] // 4
    counted = fwd_attn + bwd_attn
    # The CPU's fused attention op has no FLOP formula in FlopCounterMode (it counts 0): attention is added from
    # its shapes, 4 x tokens x keys x width per forward (Q K^T and A V; self- and cross-attention), x4 per step
    # with checkpointing (forward, recompute, and a backward of twice the forward).
    width_d = 5120
    attention = 0.0 if counted else 4.0 * 4 * tokens * (tokens + spec.text_len) * width_d * n
    return {"variant": "t2v-a14b", "size": f"{width}x{height}x{frames}", "layers": n, "lora_rank": rank,
            "tokens": tokens, "forward_tflop_counted": round(fwd / 1e12, 1),
            "backward_with_recompute_tflop_counted": round(bwd / 1e12, 1),
            "attention_counted_tflop": round(counted / 1e12, 1),
            "attention_from_shapes_tflop": round(attention / 1e12, 1),
            "step_tflop": round((fwd + bwd + attention) / 1e12, 1),
            "settings": "every model.compile x model.attention setting: the same FLOPs, executed differently"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("steps", "cache", "flops"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--types", default="lora,lokr,loha,dora")
    parser.add_argument("--swap", action="store_true", help="one block swapped, activation offload on")
    parser.add_argument("--size", default="832x480x81", help="WIDTHxHEIGHTxFRAMES (flops)")
    parser.add_argument("--layers", type=int, help="fewer blocks (flops)")
    parser.add_argument("--rank", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.what == "steps":
        out = bench_steps(args.types.split(","), args.steps, args.swap)
    elif args.what == "cache":
        out = bench_cache()
    else:
        w, h, f = (int(v) for v in args.size.lower().split("x"))
        out = bench_flops((w, h, f), args.layers, args.rank)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
