"""A second device on a CPU-only machine, for placement tests: ``meta`` plays the accelerator and the CPU the host.

Inside :class:`MetaAsDevice`, copies from ``meta`` to the CPU give zeros of the right shape and dtype (a meta
tensor holds no data), so code that moves tensors both ways runs unchanged; every copy between the two is
recorded as ``(direction, bytes)`` and ``on_device_tensor`` (if given) is called whenever an op creates a tensor
on the simulated device. Values are meaningless: use it to check where tensors are and what travels, never
numbers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
DEVICE = torch.device("meta")
HOST = torch.device("cpu")


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class MetaAsDevice(TorchDispatchMode):
    def __init__(self, on_device_tensor: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.on_device_tensor = on_device_tensor
        self.copies: list[tuple[str, int]] = []  # ("to_host" | "to_device", bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._to_copy.default:
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
            if src.type == "meta" and dst.type == "cpu":
                self.copies.append(("to_host", _nbytes(args[0])))
                return torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype)
            if src.type == "cpu" and dst.type == "meta":
                self.copies.append(("to_device", _nbytes(args[0])))
        if func is _aten.copy_.default and args[1].device.type != args[0].device.type:
            if args[1].device.type == "meta":
                self.copies.append(("to_host", _nbytes(args[1])))
                return args[0].zero_()
            self.copies.append(("to_device", _nbytes(args[1])))
        out = func(*args, **kwargs)
        if self.on_device_tensor is not None:
            outs = out if isinstance(out, tuple | list) else (out,)
            if any(isinstance(o, torch.Tensor) and o.device.type == "meta" for o in outs):
                self.on_device_tensor()
        return out

    def bytes(self, direction: str) -> int:
        return sum(n for d, n in self.copies if d == direction)
