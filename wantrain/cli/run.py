"""``wantrain run CONFIG``: assemble the parts a config describes and hand them to the core's Trainer.

Order matters for the user: everything that can fail on bad input (config, data, model files, observers) is
checked before the run directory is created, so a typo never leaves an empty run behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import structlog
import torch

from wantrain.cli.common import add_config_arguments
from wantrain.core.errors import UserError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--run-id", help="suffix of the run directory: letters, digits, '.', '_' or '-'")
    parser.add_argument("--max-steps", type=int, help="optimizer steps to train (overrides train.max_steps)")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(
            f"config key 'train.device' = {name!r} is not a device; use 'auto', 'cpu' or 'cuda[:N]'"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("config key 'train.device' asks for CUDA but no CUDA GPU is available; use 'auto' or 'cpu'")
    return device


@contextmanager
def stop_on_signals(control: Any) -> Iterator[None]:
    """First Ctrl-C / SIGTERM asks for a clean stop (the LoRA is saved); a second Ctrl-C interrupts at once."""
    previous = {}

    def handler(signum: int, frame: Any) -> None:
        if control.stop_requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        control.request_stop(f"signal {signal.Signals(signum).name}")
        print(f"\nwantrain: {signal.Signals(signum).name} received; stopping after this step "
              "(Ctrl-C again to abort without saving)", file=sys.stderr)

    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(ValueError):  # not the main thread (tests): no handler
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run(args: argparse.Namespace) -> int:
    from wantrain.config import load_config

    overrides = list(args.set or [])
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    if args.run_id is not None:
        overrides.append(f"run.run_id={json.dumps(args.run_id)}")
    cfg = load_config(args.config, overrides)
    result = train(cfg, config_dir=Path(args.config).resolve().parent)
    print(f"wantrain: run {result['status']} after {result['steps']} steps; run directory: {result['run_dir']}",
          file=sys.stderr)
    for path in result["saved"]:
        print(f"  {path}", file=sys.stderr)
    return 0 if result["status"] in ("completed", "stopped") else 1


def write_preflight(run_dir: Path, data: Any) -> None:
    tmp = run_dir / "preflight.json.tmp"
    tmp.write_text(json.dumps(data.report.to_json(), indent=2), encoding="utf-8")
    tmp.replace(run_dir / "preflight.json")


def train(cfg: Any, *, config_dir: Path | None = None) -> dict[str, Any]:
    """Run the training a validated config describes. Returns status, steps, run_dir and saved paths."""
    import tomli_w

    from wantrain.cli.logs import close_log_file, configure_logging
    from wantrain.config import to_plain
    from wantrain.core.bus import Bus
    from wantrain.core.loop import LoopSettings, Trainer
    from wantrain.core.rundir import create_run_dir, sanitize_run_id
    from wantrain.data import build_dataset, ensure_cache
    from wantrain.models.wan22 import build_adapter
    from wantrain.models.wan22.variants import variant_spec
    from wantrain.observers import build_observers, resolve_extra_observers
    from wantrain.observers.event_recorder import EventRecorder
    from wantrain.schedulers import build_scheduler

    if cfg.run.run_id is not None:
        sanitize_run_id(cfg.run.run_id)
    torch.manual_seed(cfg.run.seed)
    device = resolve_device(cfg.train.device)
    spec = variant_spec(cfg.model.variant)
    data = build_dataset(cfg.data, spec=spec, seed=cfg.run.seed, batch_size=cfg.train.batch_size)
    adapter = build_adapter(cfg.model, cfg.lora, seed=cfg.run.seed, device=device, base_lr=cfg.optimizer.lr)
    plain = to_plain(cfg)
    extra_observers = resolve_extra_observers(cfg, config_dir)

    run_dir = create_run_dir(cfg.run.output_dir, cfg.run.run_id)
    (run_dir / "config.toml").write_text(tomli_w.dumps(plain), encoding="utf-8")
    data.set_vram_estimate(rank=cfg.lora.rank, base_dtype=cfg.model.base_dtype,
                           gradient_checkpointing=cfg.model.gradient_checkpointing)
    write_preflight(run_dir, data)
    log_handler = configure_logging(run_dir / "log.jsonl")
    try:
        # Encode what the cache lacks before the first step, then free the VAE and the text encoder: training reads
        # latents and embeddings from the cache only (nothing is loaded when everything is cached already).
        stats = ensure_cache(data, adapter, remove_orphans=False)
        adapter.release_encoders()
        structlog.get_logger("wantrain.run").info(
            "cache_ready", latents_hit=stats.latents_hit, latents_encoded=stats.latents_encoded,
            texts_hit=stats.texts_hit, texts_encoded=stats.texts_encoded, clips_failed=stats.clips_failed,
        )
        optimizer = torch.optim.AdamW(
            adapter.param_groups(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1, cfg.optimizer.beta2),
            eps=cfg.optimizer.eps, weight_decay=cfg.optimizer.weight_decay,
            foreach=True,
        )
        scheduler = build_scheduler(cfg.lr_scheduler, optimizer, total_steps=cfg.train.max_steps)
        bus = Bus()
        for observer in build_observers(cfg, run_dir, extra=extra_observers, hparams=plain):
            bus.attach(observer)
        if cfg.observers.record_events:
            EventRecorder(run_dir / "events.jsonl").attach_to(bus)
        trainer = Trainer(
            adapter=adapter, batches=data.batches(adapter), optimizer=optimizer, scheduler=scheduler,
            saver=adapter.saver(run_dir, cfg.run.name), settings=LoopSettings.from_config(cfg.train), bus=bus,
            run_dir=run_dir, config=cfg, seed=cfg.run.seed,
        )
        with stop_on_signals(trainer.control):
            result = trainer.run()
    finally:
        write_preflight(run_dir, data)  # again: decoding may have verified (re-bucketed, skipped) clips
        close_log_file(log_handler)
    return {"status": result.status, "reason": result.reason, "steps": result.steps, "run_dir": str(run_dir),
            "saved": list(result.saved)}


