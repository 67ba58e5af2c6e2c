"""Which device a tensor is on, compared the way the hardware sees it.

``torch.device("cuda")`` and a CUDA tensor's ``.device`` (``cuda:0``) compare unequal in torch, though they are the
same GPU: code that asks "is this tensor on my device?" with ``==`` silently answers no on every CUDA run configured
with ``train.device = "cuda"``. Block swap, activation offload and the expert placement ask that question through
:func:`same_device` (and keep their device as :func:`resolve_device` gives it), never with ``==`` on raw devices.
"""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with the index a tensor made there reports: CUDA without an index is the current CUDA device
    (``cuda:0`` where CUDA is not available, as a fake CUDA tensor reports); other types are returned as they are.
    Does not initialise CUDA beyond asking for the current device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    """Whether ``a`` and ``b`` are one device: CUDA devices by their resolved index (``cuda`` is the current one),
    other types as torch compares them (``cpu`` and ``cpu:0`` stay distinct: tests use the pair as two devices)."""
    return resolve_device(a) == resolve_device(b)
