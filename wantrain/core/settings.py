"""Config sections the core itself reads: the run, the loop, the observers, checkpoints, faults. (The optimizer's
section is ``wantrain.optimizers.OptimizerConfig``.)"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from wantrain.core.config import Rule, above, at_least, between, section, setting
from wantrain.core.problems import bad_value, refuse
from wantrain.core.rundir import SAFE_NAME_RULE, is_safe_name

# run.name and run.run_id become parts of file and folder names: the same rule keeps both inside the output folder.
_SAFE_NAME = Rule(is_safe_name, SAFE_NAME_RULE)
MAX_STEPS = 10**9  # train.max_steps: a billion optimizer steps is no run that ends


@section(key="run")
class RunSection:
    """Where and how the run is written."""

    output_dir: Path = setting(Path("runs"), doc="Folder that receives one run directory per run.")
    run_id: str | None = setting(
        None, doc="Suffix of the run directory (`<time>__<run_id>`).", rule=_SAFE_NAME
    )
    name: str = setting(
        "lora", doc="Base name of the LoRA files (`<name>_high_noise.safetensors`, ...).", rule=_SAFE_NAME
    )
    seed: int = setting(
        0, doc="Seed of every random number in the run (model init, noise, timesteps, data order).",
        range=between(0, 2**63 - 1),  # what torch.manual_seed and torch.Generator.manual_seed accept
    )


@section(key="train")
class TrainConfig:
    """The training loop."""

    max_steps: int | None = setting(
        None, doc="Optimizer steps to train; unset: 100, or what `max_epochs` resolves to. Give `max_steps` or "
        "`max_epochs`, not both. At most a billion: more is no run that can end (at ten steps a second, three "
        "years), and a warmup or decay given as a share of it would keep the LR near 0.", range=between(1, MAX_STEPS))
    max_epochs: int | None = setting(
        None, doc="Train this many epochs of the data plan instead of `max_steps`; resolved to optimizer steps "
        "before anything is written (`wantrain check` prints it; docs/data.md).", range=between(1, MAX_STEPS))
    grad_accum: int = setting(1, doc="Micro-batches accumulated per optimizer step.", range=at_least(1))
    batch_size: int = setting(1, doc="Samples per micro-batch.", range=at_least(1))
    clip_grad_norm: float | None = setting(
        1.0, doc="Clip the global gradient L2 norm to this value before the optimizer step; unset disables.",
        range=above(0.0),
    )
    log_every: int = setting(10, doc="Log metrics every N optimizer steps (and at the last step).", range=at_least(1))
    save_every: int | None = setting(
        None, doc="Save the LoRA every N optimizer steps; unset saves at the end only.", range=at_least(1)
    )
    save_every_epochs: int | None = setting(
        None, doc="Save the LoRA every N epochs (the optimizer steps of the first N epochs) instead of `save_every`.",
        range=at_least(1))
    device: str = setting("auto", doc="`auto` (CUDA when available, else CPU), `cpu`, `cuda` or `cuda:N`.")
    max_consecutive_oom: int = setting(
        3, doc="Optimizer steps in a row skipped by out-of-memory errors after which the run stops with an "
        "emergency checkpoint (exit code 1).",
        range=at_least(1),
    )
    max_consecutive_nan: int = setting(
        5, doc="Optimizer steps in a row with a non-finite loss or gradient norm (each one is skipped) after which "
        "the run stops, keeping the last good checkpoint; checked at log steps.",
        range=at_least(1),
    )
    divergence_factor: float | None = setting(
        None, doc="Divergence guard for finite losses: stop the run (failed, exit code 1, the last good checkpoint "
        "kept) when, at a log step, the interval's mean loss (per expert) or the LoRA's L2 norm (`train/lora_norm`, "
        "logged while the guard is on) exceeds this multiple of its first logged value; unset: off (docs/resume.md).",
        range=above(1.0),
    )

    def __attrs_post_init__(self) -> None:
        """Its keys' problems together (``core.problems.refuse``: collected by the loader, raised in code), then
        the default length when neither is set."""
        found = []
        if self.max_steps is not None and self.max_epochs is not None:
            found.append(bad_value("train.max_epochs", f"config keys 'train.max_steps' = {self.max_steps} and "
                                   f"'train.max_epochs' = {self.max_epochs} are both set; give exactly one (the run "
                                   "length in optimizer steps or in epochs)"))
        if self.save_every is not None and self.save_every_epochs is not None:
            found.append(bad_value("train.save_every_epochs", "config keys 'train.save_every' and "
                                   "'train.save_every_epochs' are both set; give one"))
        refuse(found)
        if self.max_steps is None and self.max_epochs is None:
            object.__setattr__(self, "max_steps", 100)  # the default length

    @property
    def uses_epochs(self) -> bool:
        return self.max_epochs is not None or self.save_every_epochs is not None


@section(key="observers")
class ObserversConfig:
    """Built-in observers and users' own."""

    tensorboard: bool = setting(True, doc="Write TensorBoard event files into `<run_dir>/tensorboard`.")
    jsonl: bool = setting(True, doc="Write `<run_dir>/metrics.jsonl`, one JSON object per logged step.")
    progress: bool = setting(True, doc="Show a progress line (step/total, it/s, ETA, loss).")
    memory_probe: bool = setting(True, doc="Log RAM (and VRAM on CUDA) at each log step (`memory/*`).")
    norms: bool = setting(True, doc="Log the global parameter and gradient L2 norms at each log step.")
    record_events: bool = setting(
        True, doc="Record every event to `<run_dir>/events.jsonl` (for `wantrain replay`, docs/replay.md); about "
        "1 kB per optimizer step."
    )
    record_compression: Literal["none", "gzip"] = setting(
        "none", doc="`gzip` writes `events.jsonl.gz` instead (about 7 times smaller, flushed at every step)."
    )
    extra: list[str] = setting(
        factory=list, doc="Users' observer classes as `package.module:ClassName`, built with no arguments."
    )
    wandb: bool = setting(False, doc="Log metrics, sample videos and the config to Weights & Biases (the `wandb` "
                          "extra; docs/metrics.md, Weights & Biases).")
    wandb_project: str | None = setting(None, doc="wandb project; unset: wandb's default.")
    wandb_run_name: str | None = setting(None, doc="wandb run name; unset: the run directory's name.")
    wandb_tags: list[str] = setting(factory=list, doc="wandb tags of the run.")
    wandb_mode: Literal["online", "offline", "disabled"] | None = setting(
        None, doc="wandb mode (`offline` writes `<run_dir>/wandb/` only; `wandb sync` uploads it later); unset: "
        "wandb's default (`WANDB_MODE`, else online).")


@section(key="checkpoint")
class CheckpointConfig:
    """Resumable checkpoints (`<run_dir>/checkpoints/step_NNNNNN/`; see docs/resume.md)."""

    enabled: bool = setting(True, doc="Write a checkpoint with every LoRA save, at a stop and at the end.")
    every: int | None = setting(
        None, doc="Also write a checkpoint every N optimizer steps (without LoRA files); unset: only with saves.",
        range=at_least(1),
    )
    keep_last: int | None = setting(
        2, doc="Keep the newest N checkpoints; unset keeps all. LoRA files are never removed.", range=at_least(1)
    )
    keep_every: int | None = setting(
        None, doc="Also keep every checkpoint whose step is a multiple of N.", range=at_least(1)
    )


@section(key="faults")
class FaultsConfig:
    """Fault injection, a testing aid: makes out-of-memory errors and NaN losses happen on purpose to exercise the
    guards and resume. Not part of the config hash that resume compares."""

    oom_at_steps: list[int] = setting(factory=list, doc="Optimizer steps whose first micro-step runs out of memory.")
    oom_probability: float = setting(
        0.0, doc="Probability that any micro-step runs out of memory (seeded by `faults.seed` and the micro-step).",
        range=between(0.0, 1.0),
    )
    oom_phase: Literal["forward", "backward", "optimizer"] = setting(
        "forward", doc="Where the injected out-of-memory error is raised."
    )
    nan_at_steps: list[int] = setting(factory=list, doc="Optimizer steps whose loss is NaN.")
    oom_ranks: list[int] = setting(
        factory=list, doc="Under torchrun: the ranks on which the out-of-memory faults happen (empty: every rank)."
    )
    seed: int = setting(0, doc="Seed of `oom_probability`.", range=at_least(0))
    kill_at_steps: list[int] = setting(
        factory=list, doc="Optimizer steps at which the process kills itself with SIGKILL (resume tests)."
    )
    kill_phase: Literal["step", "after_checkpoint"] = setting(
        "step", doc="Where the kill happens: at the start of the step's first forward pass, or right after the "
        "step's checkpoint is renamed into place (before its `CheckpointSaved` event)."
    )

    @property
    def active(self) -> bool:
        return bool(self.oom_at_steps or self.oom_probability > 0 or self.nan_at_steps or self.kill_at_steps)
