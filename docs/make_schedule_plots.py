"""Regenerate the schedule plots of docs/schedulers.md: ``python docs/make_schedule_plots.py``.

Each plot comes from the same code as ``wantrain schedule`` (the real scheduler, stepped once per optimizer step).
The configs here are the ones shown on the page; tests/schedulers/test_schedulers_doc.py checks that every TOML
example of the page parses and builds.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from wantrain.app.config import RunConfig
from wantrain.core.config import structure
from wantrain.schedulers.preview import plot, sample

IMG = Path(__file__).resolve().parent / "img"

# name -> (config, base LR of each group)
EXAMPLES: dict[str, tuple[str, dict[str, float]]] = {
    "schedule_constant": (
        """
[train]
max_steps = 1000
[lr_scheduler]
type = "constant"
warmup_steps = 50
""",
        {"lora": 1e-4},
    ),
    "schedule_linear": (
        """
[train]
max_steps = 1000
[lr_scheduler]
type = "linear"
warmup_steps = 0.05
end_factor = 0.1
""",
        {"lora": 1e-4},
    ),
    "schedule_cosine": (
        """
[train]
max_steps = 1000
[lr_scheduler]
type = "cosine"
warmup_steps = 100
eta_min = 1e-6
""",
        {"lora": 1e-4},
    ),
    "schedule_warm_restarts_decay": (
        """
[train]
max_steps = 2000
[lr_scheduler]
type = "cosine_annealing_warm_restarts_decay"
warmup_steps = 50
T_0 = 200
T_mult = 1.5
gamma = 0.7
eta_min = 1e-6
""",
        {"high_noise": 1e-4, "low_noise": 5e-5},
    ),
    "schedule_cycle_limit": (
        """
[train]
max_steps = 1000
[lr_scheduler]
type = "cosine_annealing_warm_restarts_decay"
T_0 = 200
gamma = 0.8
eta_min = 1e-5
cycle_limit = 3
""",
        {"lora": 1e-4},
    ),
    "schedule_seed_decay": (
        """
[train]
max_steps = 4000
[lr_scheduler_config]
type = 'cosine_annealing_warm_restarts_decay'
T_0 = 1000
T_mult = 1
eta_min = 1e-7
gamma = 0.9  # Decay factor for restarts
""",
        {"lora": 1e-4},
    ),
    "schedule_seed_external": (
        """
[train]
max_steps = 100
[lr_scheduler_config]
type = 'external'
class = 'torch.optim.lr_scheduler.StepLR'
step_size = 30
gamma = 0.1
""",
        {"lora": 1e-4},
    ),
}


def main() -> None:
    for name, (text, base_lrs) in EXAMPLES.items():
        cfg = structure(RunConfig, tomllib.loads(text))
        total = cfg.train.max_steps
        lrs = sample(cfg.lr_scheduler, base_lrs, total)
        print(plot(cfg.lr_scheduler, lrs, total, IMG / f"{name}.png"))


if __name__ == "__main__":
    main()
