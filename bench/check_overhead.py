"""The before-stop check of the default observers' cost (issue 62): the quickstart trained with the default observers
and with them turned off, counted in CPU instructions under callgrind; exits 1 when off / on is under the target.

Run it when an observer, the loop or the bus changed (a few minutes on 2 cores; valgrind needed)::

    python bench/check_overhead.py                 # quickstart, log_every 10, 10 and 30 steps, target 0.99
    python bench/check_overhead.py --steps 10 --log-every 10 --target 0.99 --keep /tmp/cg

What is compared (``examples/quickstart.toml``, one torch thread, ``PYTHONHASHSEED=0``):

* ``on``: a default ``wantrain run`` of it: RunLog, MemoryProbe, Norms, TensorBoardWriter, JsonlMetrics,
  ProgressLine, the event journal (``observers.record_events``) and the ComfyUI workflow beside the final save.
* ``off``: the same with ``observers.memory_probe``, ``norms``, ``tensorboard``, ``jsonl``, ``progress`` and
  ``record_events`` set to false (RunLog and the workflow stay: no switch turns them off).

Both with ``train.log_every`` = ``--log-every``, ``[validation]`` and ``[sample]`` off (their rounds run at step 0
and at the last step whatever the length, and would only slow valgrind down) and no save but the final one. Each
is a whole run (``PreparedRun.execute``) of N and of 3N steps, counted from the first event to the last; the
per-step figure is the difference over 2N steps, so the run's start and end (files opened, the final save, the
flush) cancel. Work an observer does every N seconds (MemoryProbe's scan of ``/proc``, TensorBoard's flush) is set
to happen once per run, as valgrind's ~50x slower clock would otherwise trigger it ~50x too often. Building the
model and the data (``prepare``) and a warm-up run of each variant are not counted. The same code counted in two
processes gave observer costs 0.11 M instructions per step apart (each run loads data and builds a model, so the C
heap differs more than in ``bench_overhead.py``): a ratio within 0.003 of the target is noise; rerun, or use
``--steps 20``."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.toml"
DEFAULT_OBSERVER_SWITCHES = ("memory_probe", "norms", "tensorboard", "jsonl", "progress", "record_events")
VARIANTS = ("off", "on")


def verdict(per_step: dict[str, float], target: float) -> tuple[float, bool]:
    """(off / on, passed) from instructions per step of the two variants; passed when the ratio reaches
    ``target`` (observers cost at most ``1 - target`` of a step)."""
    if per_step["on"] <= 0 or per_step["off"] <= 0:
        raise ValueError(f"instructions per step must be positive, got {per_step}")
    ratio = per_step["off"] / per_step["on"]
    return ratio, ratio >= target


def overrides(variant: str, steps: int, log_every: int, output_dir: Path) -> list[str]:
    """The quickstart's ``--set`` list for one counted run."""
    out = [f"run.output_dir={output_dir}", f"train.max_steps={steps}", f"train.log_every={log_every}",
           "train.save_every=1000000", "validation.enabled=false", "sample.enabled=false"]
    if variant == "off":
        out += [f"observers.{key}=false" for key in DEFAULT_OBSERVER_SWITCHES]
    return out


def _once_per_run(bus) -> None:
    """Timed work (MemoryProbe's child scan, TensorBoard's flush) once per run, not at valgrind's slowed clock."""
    for observer in bus.observers:
        for attr in ("children_refresh_s", "flush_secs"):
            if hasattr(observer, attr):
                setattr(observer, attr, float("inf"))


def run_once(variant: str, steps: int, log_every: int, tmp: Path, control=None, name: str | None = None,
             real_clock: bool = False) -> None:
    """Prepare (not counted) and execute one quickstart run; with ``control``, counted from just before the first
    event to the end and dumped under ``name``."""
    import torch

    from wantrain.app.assemble import RunOptions, prepare
    from wantrain.app.config import load_config

    torch.set_num_threads(1)
    cfg = load_config(QUICKSTART, overrides(variant, steps, log_every, tmp / "runs"))
    prepared = prepare(cfg, config_dir=QUICKSTART.parent)

    def before_run(trainer) -> None:
        if not real_clock:
            _once_per_run(trainer.bus)
        if control is not None:
            control("-i", "on")
            control("-z")

    outcome = prepared.execute(RunOptions(before_run=before_run))
    if control is not None:
        control("-d", name)
        control("-i", "off")
    if outcome.status != "completed":
        raise SystemExit(f"the {variant} run ended {outcome.status}: {outcome.reason}")


def child(args) -> None:
    from callgrind import Control

    control = Control()
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        sys.stderr = devnull  # the progress line and the run log: counted, but not shown
        for variant in VARIANTS:  # warm-up: imports, first calls, the data cache
            run_once(variant, args.log_every, args.log_every, Path(tmp) / f"warm-{variant}")
        for k in (1, 3):
            for variant in VARIANTS:
                run_once(variant, k * args.steps, args.log_every, Path(tmp) / f"{variant}-{k}", control,
                         f"{variant}@{k}", real_clock=args.real_clock)


def parent(args, argv: list[str]) -> int:
    from callgrind import run_counted

    dumps = run_counted(__file__, [*argv, "--child"], keep=args.keep)
    missing = [f"{v}@{k}" for v in VARIANTS for k in (1, 3) if f"{v}@{k}" not in dumps]
    if missing:
        print(f"check_overhead: no count for {', '.join(missing)} (did the child fail? run it with --child)",
              file=sys.stderr)
        return 2
    per_step = {v: (dumps[f"{v}@3"] - dumps[f"{v}@1"]) / (2 * args.steps) for v in VARIANTS}
    ratio, passed = verdict(per_step, args.target)
    print(json.dumps({"config": str(QUICKSTART.relative_to(REPO)), "log_every": args.log_every,
                      "steps": [args.steps, 3 * args.steps],
                      "instructions_per_step": {v: round(n) for v, n in per_step.items()},
                      "observers_per_step": round(per_step["on"] - per_step["off"]),
                      "off_over_on": round(ratio, 4), "target": args.target, "passed": passed}, indent=1))
    if not passed:
        print(f"check_overhead: FAILED: observers off / on = {ratio:.4f} < {args.target} (the default observers "
              f"cost {per_step['on'] - per_step['off']:.0f} instructions per step)", file=sys.stderr)
        return 1
    print(f"check_overhead: passed: observers off / on = {ratio:.4f} >= {args.target}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="N: runs of N and 3N steps are counted")
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.99, help="least observers-off / observers-on ratio")
    parser.add_argument("--keep", metavar="DIR", help="copy the callgrind dumps into DIR (callgrind_annotate)")
    parser.add_argument("--real-clock", action="store_true",
                        help="leave timed work on the wall clock (diagnosis only: the count then depends on the "
                             "machine's speed and load)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    if args.child:
        child(args)
        return 0
    return parent(args, argv)


if __name__ == "__main__":
    sys.exit(main())
