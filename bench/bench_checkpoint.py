"""Checkpoint cost and the non-finite guard's two paths, on the tiny Wan model (not a test: timing lives here).

1. Checkpoint write and read: ``Trainer.state_dict()`` -> ``write_checkpoint`` (atomic, fsync'ed) and
   ``read_checkpoint`` + ``Trainer.load_state_dict`` for the tiny-t2v twin (both experts, rank 8, fused AdamW),
   medians of ``--repeats`` writes; then the write throughput on a synthetic tree of ``--synthetic-mb`` MB of fp32
   tensors, to extrapolate to an A14B LoRA's checkpoint (12 bytes per LoRA parameter), with the time of the
   integrity check alone (sha256 of every file, what both the write and the read pay) and of a verified read.
2. Non-finite guard: median optimizer-step time with the fused AdamW (the guard hands the kernel ``found_inf``: no
   host sync) against a foreach AdamW (the fallback reads one boolean per step), interleaved rounds. On a CPU a
   "sync" costs nothing, so this shows the guard's arithmetic; on a GPU run it with ``--device cuda``.

    python bench/bench_checkpoint.py
    python bench/bench_checkpoint.py --device cuda --steps 50
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from wantrain.core.checkpoint import read_checkpoint, verify_checkpoint, write_checkpoint
from wantrain.core.loop import LoopSettings, Trainer
from wantrain.models.wan22 import LoraConfig, ModelConfig, build_adapter


def tiny_trainer(device: str, fused: bool, steps: int) -> Trainer:
    model = ModelConfig(variant="tiny-t2v", experts="both", switch_every=10, gradient_checkpointing=False)
    adapter = build_adapter(model, LoraConfig(rank=8, alpha=8), seed=0, device=torch.device(device), base_lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batch = adapter.encode_batch({"pixels": torch.rand(1, 3, 9, 64, 64, generator=g) * 2 - 1,
                                  "captions": ["a red ball bouncing on the grass"]})
    adapter.release_encoders()
    opt = torch.optim.AdamW(adapter.param_groups(), lr=1e-3, fused=fused, foreach=None if fused else True)
    return Trainer(adapter=adapter, batches=itertools.repeat(batch), optimizer=opt,
                   settings=LoopSettings(max_steps=steps, log_every=10, clip_grad_norm=1.0))


def checkpoint_figures(device: str, repeats: int, synthetic_mb: int) -> dict:
    trainer = tiny_trainer(device, True, 20)
    trainer.run()
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            start = time.perf_counter()
            path = write_checkpoint(Path(tmp), i, trainer.state_dict())
            writes.append(time.perf_counter() - start)
            start = time.perf_counter()
            trainer.load_state_dict(read_checkpoint(path).tree)
            reads.append(time.perf_counter() - start)
        size = sum(p.stat().st_size for p in path.iterdir())
        n = synthetic_mb * 2**20 // 4 // 64
        tree = {"model": {f"w{i}": torch.randn(64, n // 64) for i in range(64)}}
        synth, verify, read = [], [], []
        for i in range(3):
            start = time.perf_counter()
            written = write_checkpoint(Path(tmp) / "synthetic", i, tree)
            synth.append(time.perf_counter() - start)
            start = time.perf_counter()
            verify_checkpoint(written)  # what the integrity check costs: the same hashing the write did
            verify.append(time.perf_counter() - start)
            start = time.perf_counter()
            read_checkpoint(written)  # verifies, then loads and checks every tensor reference
            read.append(time.perf_counter() - start)
    return {"tiny_checkpoint_bytes": size, "tiny_write_s_median": statistics.median(writes),
            "tiny_read_and_restore_s_median": statistics.median(reads),
            "synthetic_mb": synthetic_mb, "synthetic_write_s_median": statistics.median(synth),
            "write_mb_per_s": synthetic_mb / statistics.median(synth),
            "synthetic_checksums_s_median": statistics.median(verify),
            "checksum_share_of_write": statistics.median(verify) / statistics.median(synth),
            "synthetic_read_s_median": statistics.median(read)}


def guard_figures(device: str, steps: int, rounds: int) -> dict:
    times: dict[str, list[float]] = {"fused (device skip)": [], "foreach (host read per step)": []}
    for _ in range(rounds):
        for name, fused in (("fused (device skip)", True), ("foreach (host read per step)", False)):
            trainer = tiny_trainer(device, fused, steps)
            start = time.perf_counter()
            trainer.run()
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    out = {f"step_s_median[{k}]": statistics.median(v) for k, v in times.items()}
    fused, host = (statistics.median(v) for v in times.values())
    out["ratio_host_over_fused"] = host / fused
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--synthetic-mb", type=int, default=256)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = {"machine": platform.processor() or platform.machine(), "torch": torch.__version__,
              "device": args.device, **checkpoint_figures(args.device, args.repeats, args.synthetic_mb),
              **guard_figures(args.device, args.steps, args.rounds)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
