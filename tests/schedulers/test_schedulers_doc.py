import re
from pathlib import Path

import pytest

from wantrain.app.config import load_config
from wantrain.schedulers import build_scheduler

from .helpers_sched import run_steps, two_expert_optimizer
from .test_scheduler_config import SEED_DECAY, SEED_EXTERNAL

DOC = Path(__file__).resolve().parents[2] / "docs" / "schedulers.md"
TEXT = DOC.read_text()
TOML_BLOCKS = re.findall(r"```toml\n(.*?)```", TEXT, flags=re.S)


@pytest.mark.parametrize("index", range(len(TOML_BLOCKS)))
def test_every_toml_example_on_the_page_parses_and_builds(index, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(TOML_BLOCKS[index])
    cfg = load_config(path)
    opt = two_expert_optimizer()
    scheduler = build_scheduler(cfg.lr_scheduler, opt, total_steps=cfg.train.max_steps)
    lrs = run_steps(opt, scheduler, cfg.train.max_steps)
    assert all(0.0 <= lr <= 1e-4 for step in lrs for lr in step)


def test_page_shows_the_seed_examples_verbatim():
    assert SEED_DECAY in TOML_BLOCKS and SEED_EXTERNAL in TOML_BLOCKS


def test_every_plot_on_the_page_is_committed():
    images = re.findall(r"!\[[^\]]*\]\((img/[^)]+\.png)\)", TEXT)
    assert len(images) == 7
    for image in images:
        assert (DOC.parent / image).read_bytes()[:4] == b"\x89PNG"
