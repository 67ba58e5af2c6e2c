"""How an optimizer's per-parameter state follows a reparametrisation ``B' = B / c`` (an alpha transition with
``preserve_output``: c = α′/α, so the output ``(α′/r)·B′A`` equals ``(α/r)·BA`` and every gradient of ``B′`` is
``c`` times the old one).

Each map scales the state as if the parameter's gradients had always been ``c`` times larger, so the optimizer's
next update of ``B′`` is the one it would have made on ``B`` (in the output: ``c`` times as large -- Adam's step
is scale-free) -- exact up to the optimizer's ``eps``:

=====================  ==================================================================================
``adam``               torch Adam/AdamW (fused, foreach): ``exp_avg`` × c, ``exp_avg_sq`` and ``max_exp_avg_sq`` × c²
``sgd``                torch SGD: ``momentum_buffer`` × c (its update grows by c, c² in the output)
``adam8bit``           bitsandbytes AdamW8bit: the block scales ``absmax1`` × c and ``absmax2`` × c² (a block's
                       values are ``qmap[code] · absmax``; the shared ``qmap`` is never touched); tensors under
                       ``min_8bit_size`` keep fp32 ``state1`` × c and ``state2`` × c²
``adafactor``          transformers Adafactor: ``exp_avg_sq_row`` and ``exp_avg_sq_col`` × c² each (their
                       product over the row mean is the factored second moment: × c²), ``exp_avg_sq`` × c² for
                       1-D tensors; ``exp_avg`` (an EMA of normalised updates) and ``RMS`` unchanged
``schedulefree``       schedulefree AdamWScheduleFree: ``z`` ÷ c (the stored weight is ``y``, a mix of ``x`` and
                       ``z``, all divided by c), ``exp_avg_sq`` × c²
=====================  ==================================================================================

Prodigy has no such map (its step size ``d`` is one estimate over A and B together): ``preserve_output`` is
refused for it when the config is read. Which map an optimizer uses is its ``state_kind`` attribute (set by
``wantrain.optimizers.build_optimizer``) or, for a plain torch Adam/AdamW/SGD, its class.

:func:`check_rescalable` raises before anything is changed (the adapter checks every layer's state first, then
rescales), so a failure cannot leave a model half rescaled.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# kind -> {state key: power of c}; keys not listed are refused unless they are 0-dim (counters such as `step`)
# or listed in _KEPT
STATE_MAPS: dict[str, dict[str, int]] = {
    "adam": {"exp_avg": 1, "exp_avg_sq": 2, "max_exp_avg_sq": 2},
    "sgd": {"momentum_buffer": 1},
    "adam8bit": {"absmax1": 1, "absmax2": 2, "state1": 1, "state2": 2},
    "adafactor": {"exp_avg_sq_row": 2, "exp_avg_sq_col": 2, "exp_avg_sq": 2},
    "schedulefree": {"z": -1, "exp_avg_sq": 2},
}
_KEPT: dict[str, tuple[str, ...]] = {
    "adam8bit": ("qmap1", "qmap2"),  # the shared quantization maps
    "adafactor": ("exp_avg", "RMS"),  # an EMA of normalised updates; the parameter's RMS, recomputed every step
}
_QUANTIZED = ("state1", "state2")  # adam8bit: uint8 codes when the block scales exist, else fp32 values


def state_kind(optimizer: Any) -> str | None:
    """The map an optimizer's state follows (None: none known)."""
    kind = getattr(optimizer, "state_kind", None)
    if kind is not None:
        return kind
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return "adam"
    if isinstance(optimizer, torch.optim.SGD):
        return "sgd"
    return None


def check_rescalable(kind: str | None, state: Mapping[str, Any]) -> None:
    """Raise ``TypeError`` (naming the key) when ``state`` has a tensor the ``kind`` map cannot scale."""
    if not state:
        return
    if kind not in STATE_MAPS:
        raise TypeError(f"no known way to rescale this optimizer's state for an alpha change (state keys "
                        f"{sorted(state)}); use transition = 'jump' or one of the optimizers of docs/optimizers.md")
    powers, kept = STATE_MAPS[kind], _KEPT.get(kind, ())
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in kept:
            continue
        if key not in powers:
            raise TypeError(f"cannot rescale optimizer state {key!r} ({kind} map: "
                            f"{', '.join(sorted(powers))}) for an alpha change")
        if kind == "adam8bit" and key in _QUANTIZED and not value.is_floating_point() and \
                f"absmax{key[-1]}" not in state:
            raise TypeError(f"8-bit optimizer state {key!r} has no block scales (absmax{key[-1]}) to rescale")


def rescale_state(kind: str | None, state: dict[str, Any], factor: float) -> None:
    """Scale ``state`` in place for gradients ``factor`` times larger (see the module docstring); call
    :func:`check_rescalable` on every parameter's state first. Device ops only."""
    if not state:
        return
    powers, kept = STATE_MAPS[kind], _KEPT.get(kind, ())
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or key in kept:
            continue
        if kind == "adam8bit" and key in _QUANTIZED and not value.is_floating_point():
            continue  # quantized codes: their block scales (absmax) carry the factor
        value.mul_(factor ** powers[key])
