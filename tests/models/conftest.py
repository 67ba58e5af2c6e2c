"""Fixtures of the model tests (helpers live in wan22_helpers.py, imported by name)."""

from __future__ import annotations

import pytest

from wantrain.models.wan22.architecture import write_tiny_diffusers_dir
from wantrain.models.wan22.variants import VARIANTS


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """``tiny_dir("tiny-i2v")`` -> a diffusers pipeline directory of that tiny variant (seed 7), written once."""
    made = {}

    def get(variant: str):
        if variant not in made:
            path = tmp_path_factory.mktemp(variant)
            write_tiny_diffusers_dir(VARIANTS[variant], 7, path)
            made[variant] = path
        return made[variant]

    return get
