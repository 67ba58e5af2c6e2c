"""LR finder on the tiny Wan model: wantrain's range test in its four `noise` modes, and torch-lr-finder on the same
model, data and optimizer. Reports the suggested LRs, how noisy each curve is, what each costs, and writes the
chart of the default mode to docs/img/lr_finder_tiny.png (with --chart).

    python bench/bench_lr_finder.py --seeds 0 1 2 --markdown [--chart]

Setup: examples/quickstart.toml (tiny-t2v, rank-8 LoRA, AdamW, the demo clips, batch size 1) with one expert
(`model.experts = "high_noise"`), 100 LRs from 1e-7 to 10, one step per LR. torch-lr-finder gets the same adapter
(its loss as the "model"), the same cached batches, an AdamW over the same LoRA parameters, and its defaults
(`smooth_f = 0.05`, `diverge_th = 5`, suggestion = steepest gradient after skipping 10 / 5 points).

Curve noise: "residual CV" -- the standard deviation of the raw rung losses around the running median of 9 LRs
the suggestions read (``lr_finder.math.running_median``), over its mean, over the whole sweep; "plateau CV": over
the LRs <= 1e-5 the weights barely move (under 1e-3 in total with AdamW), so the true loss is constant there and the
spread of the measured losses is measurement noise (standard deviation over mean). "Roughness": the residual's
standard deviation over the curve's total drop (lower is cleaner). "trusted" and "band": whether then-train would
follow the suggestion (no warning questions it) and its 90 % bootstrap band. The summary gives each mode's median
over the seeds and the spread of its suggestion over the seeds (max / min).

Cost: "probe fwd/LR" -- forward passes without grad per LR (`probe_clips x probe_timesteps` for `probe`, 0
otherwise); "s per LR" from the run log's start and end, and its ratio to `random` (same machine, same run of the
bench).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("MPLBACKEND", "Agg")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from wantrain.cli.main import main as cli  # noqa: E402
from wantrain.observers.lr_finder.math import running_median  # noqa: E402

N, START, END = 100, 1e-7, 10.0


def workspace(tmp: Path) -> Path:
    shutil.copytree(ROOT / "examples" / "demo_data", tmp / "demo_data",
                    ignore=shutil.ignore_patterns(".wantrain_cache"))
    text = (ROOT / "examples" / "quickstart.toml").read_text(encoding="utf-8").replace('"../runs"', '"runs"')
    text = text.replace('experts = "both"', 'experts = "high_noise"')
    text = text.replace("[validation]", "[validation]\nenabled = false\n", 1)
    text = text.replace("[sample]", "[sample]\nenabled = false\n", 1)
    text = "\n".join(x for x in text.splitlines() if x.strip() != "enabled = true")
    config = tmp / "bench.toml"
    config.write_text(text + "\n[observers]\nprogress = false\n", encoding="utf-8")
    assert cli(["cache", str(config)]) == 0
    return config


def curve_stats(lrs: list[float], raw: list[float]) -> dict[str, float]:
    plateau = [x for lr, x in zip(lrs, raw, strict=True) if lr <= 1e-5 and math.isfinite(x)]
    finite = [x for x in raw if math.isfinite(x)]
    smooth = [float(v) for v in running_median(finite)]
    drop = max(smooth) - min(smooth)
    resid = [a - b for a, b in zip(finite, smooth, strict=True)]
    return {"plateau_cv": statistics.pstdev(plateau) / statistics.fmean(plateau),
            "residual_cv": statistics.pstdev(resid) / statistics.fmean(smooth),
            "roughness": statistics.pstdev(resid) / drop if drop > 0 else math.inf}


BARE = ["observers.tensorboard=false", "observers.memory_probe=false", "observers.norms=false"]


def run_wantrain(config: Path, noise: str, seed: int, chart_to: Path | None, bare: bool = False) -> dict:
    from wantrain.app.train import train

    started = time.perf_counter()
    outcome = train(config, overrides=["lr_finder.enabled=true", f'lr_finder.noise="{noise}"', f"run.seed={seed}",
                                       f"lr_finder.steps={N}", f"lr_finder.start_lr={START}",
                                       f"lr_finder.end_lr={END}", *(BARE if bare else [])])
    total = time.perf_counter() - started
    run_dir = outcome.run_dir
    log = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines()]
    t = {x["event"]: x["timestamp"] for x in log if x["event"] in ("run_started", "run_ended")}
    from datetime import datetime

    sweep_s = (datetime.fromisoformat(t["run_ended"]) - datetime.fromisoformat(t["run_started"])).total_seconds()
    metrics = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    loop_s = sum(m.get("train/step_time_s", 0.0) for m in metrics)  # the steps themselves, outputs excluded
    rows = list(csv.DictReader((run_dir / "lr_finder.csv").open()))
    lrs, raw = [float(r["lr"]) for r in rows], [float(r["raw_loss"]) for r in rows]
    result = json.loads((run_dir / "lr_finder.json").read_text())["experts"]["high_noise"]
    if chart_to is not None:
        shutil.copy(run_dir / "lr_finder.png", chart_to)
    who = f"wantrain noise={noise}" + (" (TensorBoard, norms, memory observers off)" if bare else "")
    settings = json.loads((run_dir / "lr_finder.json").read_text())["settings"]
    probe_fwd = settings["probe_clips"] * settings["probe_timesteps"] if noise == "probe" else 0
    return {"who": who, "mode": noise, "seed": seed, "rungs": len(rows), "sweep_s": sweep_s, "loop_s": loop_s,
            "probe_fwd": probe_fwd,
            "total_s": total, **{k: result["suggestions"][k] for k in ("valley", "steepest", "minimum")},
            "default": result["suggested_lr"], "stop": result["stop_reason"], "warnings": result["warnings"],
            "trusted": not result.get("invalid"), "band": result.get("band"), **curve_stats(lrs, raw)}


def run_torch_lr_finder(config: Path, seed: int) -> dict:
    import matplotlib.pyplot as plt
    from torch_lr_finder import LRFinder, TrainDataLoaderIter

    from wantrain.app.assemble import build_optimizer, prepare
    from wantrain.app.config import load_config

    cfg = load_config(config, [f"run.seed={seed}"])
    prepared = prepare(cfg, config_dir=config.parent)
    adapter, expert = prepared.adapter, "high_noise"

    class LossModule(torch.nn.Module):
        """The adapter's loss as a module; the transformer is a submodule, so torch-lr-finder caches all of it."""

        def __init__(self) -> None:
            super().__init__()
            self.transformer = adapter.transformer_for(expert)
            self.generator = torch.Generator().manual_seed(seed)

        def forward(self, batch):
            return adapter.loss(batch, expert, self.generator)

    class StreamIter(TrainDataLoaderIter):
        def __init__(self, stream) -> None:
            self.data_loader, self._iterator, self.auto_reset = stream, iter(stream), False

        def inputs_labels_from_batch(self, batch):
            return batch, torch.zeros(())

    model = LossModule()
    optimizer = build_optimizer(cfg, adapter.param_groups(), prepared.device)
    finder = LRFinder(model, optimizer, lambda out, _labels: out, device="cpu")
    cached = finder.state_cacher.cached
    snapshot_bytes = sum(t.numel() * t.element_size() for t in cached["model"].values())
    started = time.perf_counter()
    finder.range_test(StreamIter(prepared.data.stream(adapter)), start_lr=START, end_lr=END, num_iter=N,
                      step_mode="exp")
    sweep_s = time.perf_counter() - started
    ax, steepest = finder.plot(skip_start=10, skip_end=5, suggest_lr=True, show_lr=None)
    plt.close(ax.figure)
    lrs, smooth = finder.history["lr"], finder.history["loss"]  # its "loss" is smoothed: s_i = f*x_i + (1-f)*s_i-1
    raw = [smooth[0]] + [(b - 0.95 * a) / 0.05 for a, b in zip(smooth, smooth[1:], strict=False)]
    finder.reset()
    lora_bytes = sum(p.numel() * p.element_size() for p in adapter.trainable_parameters(expert))
    return {"who": "torch-lr-finder", "mode": "torch-lr-finder", "seed": seed, "rungs": len(lrs),
            "sweep_s": sweep_s, "loop_s": sweep_s, "probe_fwd": 0,
            "total_s": math.nan,
            "valley": None, "steepest": steepest, "minimum": None, "default": steepest, "stop": None, "warnings": [],
            "trusted": None, "band": None,
            **curve_stats(lrs, raw), "snapshot_mb": snapshot_bytes / 2**20,
            "lora_mb": lora_bytes / 2**20}


def fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.3g}"
    return str(x)


def band(b) -> str:
    return "-" if not b else f"{b[0]:.3g}-{b[1]:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--modes", nargs="+", default=["probe", "fixed", "stratified", "random"])
    parser.add_argument("--no-torch-lr-finder", action="store_true")
    parser.add_argument("--chart", action="store_true", help="write docs/img/lr_finder_tiny.png (probe, first seed)")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--bare", action="store_true", help="also run `fixed` with the metric observers off")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        config = workspace(Path(tmp))
        for seed in args.seeds:
            for mode in args.modes:
                chart = ROOT / "docs" / "img" / "lr_finder_tiny.png" if args.chart and mode == "probe" and \
                    seed == args.seeds[0] else None
                rows.append(run_wantrain(config, mode, seed, chart))
                print(json.dumps(rows[-1]), file=sys.stderr)
            if args.bare:
                rows.append(run_wantrain(config, "fixed", seed, None, bare=True))
                print(json.dumps(rows[-1]), file=sys.stderr)
            if not args.no_torch_lr_finder:
                rows.append(run_torch_lr_finder(config, seed))
                print(json.dumps(rows[-1]), file=sys.stderr)
    if args.markdown:
        print("| finder | seed | LRs run | valley | steepest | minimum/10 | band | trusted | stop | residual CV | "
              "plateau CV | roughness | probe fwd/LR | sweep s | s per LR |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            stop = "diverged" if r["stop"] else "end"
            print(f"| {r['who']} | {r['seed']} | {r['rungs']} | {fmt(r['valley'])} | {fmt(r['steepest'])} | "
                  f"{fmt(r['minimum'])} | {band(r['band'])} | {fmt(r['trusted'])} | {stop} | "
                  f"{fmt(r['residual_cv'])} | {fmt(r['plateau_cv'])} | "
                  f"{fmt(r['roughness'])} | {r['probe_fwd']} | {r['sweep_s']:.1f} | {r['sweep_s'] / r['rungs']:.3f} |")
        print("\n| mode | median residual CV | median plateau CV | default suggestion over seeds | max/min | "
              "probe fwd/LR | s per LR / random's |")
        print("|---|---|---|---|---|---|---|")
        per_lr = {m: statistics.median(r["sweep_s"] / r["rungs"] for r in rows if r["mode"] == m)
                  for m in dict.fromkeys(r["mode"] for r in rows)}
        for mode in per_lr:
            mine = [r for r in rows if r["mode"] == mode]
            picks = [r["default"] for r in mine if r["default"]]
            spread = max(picks) / min(picks) if picks else math.nan
            ratio = per_lr[mode] / per_lr["random"] if "random" in per_lr else math.nan
            print(f"| {mode} | {fmt(statistics.median(r['residual_cv'] for r in mine))} | "
                  f"{fmt(statistics.median(r['plateau_cv'] for r in mine))} | "
                  f"{', '.join(fmt(p) for p in picks)} | {fmt(spread)} | {mine[0]['probe_fwd']} | {fmt(ratio)} |")
        for r in rows:
            if "snapshot_mb" in r:
                print(f"\ntorch-lr-finder state copy: {r['snapshot_mb']:.3f} MiB of model state (the LoRA alone is "
                      f"{r['lora_mb']:.2f} MiB)")
                break
    else:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
