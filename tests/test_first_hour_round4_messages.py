"""The first hour, round 4 (issue 49), findings 7 and 8: what the page, the LR finder, `check` and the console say
is true and says it the same way everywhere."""

from __future__ import annotations

import numpy as np

from wantrain.observers.lr_finder.math import suggest
from wantrain.observers.lr_finder.observer import LrFinderResult, summary_lines


def grid(n: int = 61) -> list[float]:
    return [float(x) for x in np.logspace(-6, 1, n)]


def test_the_lr_finder_does_not_advise_the_probe_it_already_measured_on():
    """Finding 7: a flat sweep measured on the probe said "use lr_finder.noise = 'probe'"."""
    lrs = grid()
    flat = [1.0 + 0.01 * ((-1) ** k) for k in range(len(lrs))]
    probed = suggest(lrs, flat, beta=0.0, probe=True).warnings
    drawn = suggest(lrs, flat, beta=0.0).warnings
    assert probed and all("noise = 'probe'" not in w for w in probed), probed
    assert any("steps_per_lr" in w for w in probed), probed
    assert any("noise = 'probe'" in w for w in drawn), drawn  # the other noise modes still get the advice


def test_the_minimum_suggestion_is_named_a_tenth_of_the_lowest_loss_lr_as_on_the_chart():
    """Finding 7: `minimum 1` printed beside "the lowest loss is at LR 10"; only the PNG said "minimum / 10"."""
    result = LrFinderResult(step=9, expert=None, suggestions={"valley": 3.79, "steepest": 0.08, "minimum": 1.0},
                            default="minimum", suggested_lr=1.0, stop_reason=None,
                            warnings=("the lowest loss is at the end of the sweep (LR 10)",), rungs=20)
    lines = summary_lines({None: result})
    assert lines[0] == "lr_finder [lora]: suggested LR 1 (minimum / 10)", lines
    assert "  minimum / 10 1  <- default" in lines and not any(x.startswith("  minimum  ") for x in lines), lines
