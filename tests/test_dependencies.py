"""What wantrain needs at run time is declared: blinker (the bus dispatches through its signals), accelerate
(diffusers' ``from_pretrained`` keeps ``_keep_in_fp32_modules`` in float32 only with ``low_cpu_mem_usage``, which
needs accelerate) and a diffusers that keeps RoPE in float32 under bf16 (0.40 and later)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _floors() -> dict[str, tuple[int, ...]]:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        match = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9.]+)", dep)
        if match:
            out[match.group(1).lower()] = tuple(int(x) for x in match.group(2).split("."))
    return out


def test_accelerate_is_declared_and_diffusers_keeps_rope_in_float32():
    floors = _floors()
    assert "accelerate" in floors
    assert floors["diffusers"] >= (0, 40)


def test_blinker_is_declared_the_bus_dispatches_through_its_signals():
    import blinker

    from wantrain.core.bus import Bus

    assert _floors()["blinker"] >= (1, 9)  # the version the bus is tested with (Signal.set_class: 1.7)
    assert isinstance(Bus().signal("grads_ready"), blinker.NamedSignal)
