"""The waiting expert on disk (``model.waiting_expert = "disk"``): between switches the A14B expert that is not
training holds no frozen base tensor in host memory; they are read back from a file when it comes in.

The file is the expert's frozen tensors exactly as the run holds them (its storage format: bf16, fp8 and its
scales, fp32 norms), in the safetensors layout, written once into ``waiting_experts/`` of the cache folder when
the experts are built. Its name is a hash of what decides its content (:meth:`WaitingOnDisk.path`): the weights'
source (the files' paths, sizes and modification times, or the tiny twin's seed), the expert, ``model.base_dtype``
and :data:`FORMAT`; a file already there whose tensor names, shapes and dtypes match is used as it is (a second run
or a resume writes nothing). It is written tensor by tensor (never more than one tensor in flight beside the
model) into a temporary name and renamed into place, so a file cut short is never read.

Reading memory-maps it (``safetensors.safe_open``): the page cache keeps it while the host has room, so a switch
costs a disk read only where RAM is short. Values come back bit for bit as written, so a run with the waiting
expert on disk is bitwise the run with it resident (tests/test_waiting_expert_runs.py).

What it costs, as the plan counts it (``memory.WaitingRead``): the trained expert's frozen bytes per switch, read
at :data:`DEFAULT_READ_RATE` unless measured, every ``model.switch_every`` steps.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import torch
from torch import nn

FORMAT = 2  # bump when what the file holds for the same source changes (2: int8 / nf4 column scales)
DEFAULT_READ_RATE = 2e9  # bytes per second: a SATA-class NVMe's sustained read, the planning figure
# A fast card's training throughput, to state what the reads cost in steps per hour: 40 % of an H100's 989 TFLOP/s
# dense bf16 (docs/benchmarks.md, "Compute per step"); a 16-24 GB card is several times slower, so the reads cost it
# a smaller share
REFERENCE_FLOPS_PER_SECOND = 0.4 * 989e12
_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.int8: "I8", torch.uint8: "U8",
           torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.bool: "BOOL"}

GIB = 2**30
Entry = tuple[str, nn.Module, str, bool, torch.Tensor]  # (qualified name, owner, attribute, is_parameter, tensor)


def problems(model, waiting: str | None = None) -> list[str]:
    """What ``model.waiting_expert`` (or ``waiting`` in its place) refuses in ``model`` (a ``ModelConfig``), one
    line each: ``disk`` moves the expert that waits between switches, so it needs two experts trained in one process
    (``experts = "both"`` on an A14B variant, ``expert_groups = 1``: with expert groups each rank holds its own
    expert and nothing waits)."""
    if (waiting or model.waiting_expert) != "disk":
        return []
    if len(model.trained_experts) < 2:
        return [f"model.waiting_expert = 'disk' applies to a run that trains both A14B experts ({model.variant}, "
                f"experts = {model.experts!r}: no expert waits); set waiting_expert = 'auto' or 'resident'"]
    if model.expert_groups > 1:
        return [f"model.waiting_expert = 'disk' does nothing with model.expert_groups = {model.expert_groups} (each "
                "group holds its own expert: none waits); set waiting_expert = 'auto' or 'resident'"]
    return []


@attrs.frozen
class SwitchRead:
    """What the waiting expert on disk costs the run (``model.waiting_expert = "disk"``): ``bytes`` read from its
    waiting file at each switch, at ``rate`` bytes per second (``measured``, or the stated default), every
    ``switch_every`` optimizer steps."""

    bytes: float
    rate: float
    switch_every: int
    measured: bool = False
    step_flops: float | None = None  # FLOPs of one training step (memory.step_flops), for the steps per hour

    @property
    def reference_step_seconds(self) -> float | None:
        """Seconds of one step at :data:`REFERENCE_FLOPS_PER_SECOND` (None without ``step_flops``)."""
        return self.step_flops / REFERENCE_FLOPS_PER_SECOND if self.step_flops else None

    def fewer_steps_per_hour(self, step_seconds: float) -> float:
        """The share of steps per hour the reads cost at ``step_seconds`` a step (0.05: 5 % fewer)."""
        return self.seconds_per_step / (step_seconds + self.seconds_per_step)

    @property
    def seconds(self) -> float:
        """Seconds one switch reads, where the page cache does not hold the file (the worst case)."""
        return self.bytes / self.rate

    @property
    def seconds_per_step(self) -> float:
        return self.seconds / self.switch_every

    def steps_per_hour(self, step_seconds: float) -> float:
        """Optimizer steps per hour at ``step_seconds`` a step, with the reads (one every ``switch_every``)."""
        return 3600.0 / (step_seconds + self.seconds_per_step)

    def line(self) -> str:
        rate = f"{self.rate / 1e9:g} GB/s ({'measured' if self.measured else 'assumed'})"
        return (f"  waiting expert on disk: {self.bytes / GIB:.2f} GiB read at each switch, {self.seconds:.1f} s at "
                f"{rate}, every {self.switch_every} steps (model.switch_every): +{self.seconds_per_step:.2f} s per "
                "step where the page cache does not hold it" + self._steps_per_hour())

    def _steps_per_hour(self) -> str:
        step = self.reference_step_seconds
        if step is None:
            return ""
        return (f"; a step is {self.step_flops / 1e15:.1f} PFLOP, {step:.0f} s at "
                f"{REFERENCE_FLOPS_PER_SECOND / 1e12:.0f} TFLOP/s (40 % of an H100's dense bf16 peak): "
                f"{100 * self.fewer_steps_per_hour(step):.1f} % fewer steps per hour there, less on a slower card")

    def to_json(self) -> dict[str, Any]:
        return {"bytes_per_switch": self.bytes, "read_rate": self.rate, "measured": self.measured,
                "switch_every": self.switch_every, "seconds_per_switch": self.seconds,
                "seconds_per_step": self.seconds_per_step}


def frozen_entries(transformer: nn.Module) -> list[Entry]:
    """Every frozen tensor of ``transformer`` (parameters without grad, and buffers), each once, by qualified name
    in module order: what the waiting file holds. Tensors on ``meta`` or absent (``None``) are left out."""
    seen: set[int] = set()
    out: list[Entry] = []
    for prefix, owner in transformer.named_modules():
        for attr, param in owner._parameters.items():
            if param is not None and not param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                out.append((f"{prefix}.{attr}" if prefix else attr, owner, attr, True, param))
        for attr, buf in owner._buffers.items():
            if buf is not None and id(buf) not in seen:
                seen.add(id(buf))
                out.append((f"{prefix}.{attr}" if prefix else attr, owner, attr, False, buf))
    return out


def qualified_names(transformer: nn.Module) -> Callable[[nn.Module, str], str]:
    """(owner, attribute) -> the qualified name :func:`frozen_entries` gives that tensor."""
    prefixes = {id(m): p for p, m in transformer.named_modules()}

    def name(owner: nn.Module, attr: str) -> str:
        prefix = prefixes[id(owner)]
        return f"{prefix}.{attr}" if prefix else attr

    return name


class WaitingOnDisk:
    """The waiting files of one run's experts in ``folder`` (module docstring): ``files`` maps each expert kept to
    its file, ``written`` lists those this process wrote (the others were there already)."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.files: dict[str | None, Path] = {}
        self.written: list[Path] = []

    def path(self, identity: str, expert: str | None, storage: str) -> Path:
        """The file of ``expert`` loaded from the source ``identity`` in ``storage`` (``model.base_dtype``)."""
        key = f"{identity}:{expert}:{storage}:format={FORMAT}"
        return self.folder / f"{expert or 'transformer'}-{hashlib.sha256(key.encode()).hexdigest()[:24]}.safetensors"

    def keep(self, expert: str | None, identity: str, storage: str, transformer: nn.Module) -> Path:
        """Write ``transformer``'s frozen tensors (all on the host) to ``expert``'s file unless a matching one is
        there; returns its path."""
        path = self.path(identity, expert, storage)
        self.files[expert] = path
        entries = frozen_entries(transformer)
        header = _header([(name, t) for name, *_, t in entries])
        if path.is_file() and _read_header(path) == header:
            return path
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + f".{os.getpid()}.partial")
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        with open(partial, "wb") as fh:
            fh.write(struct.pack("<Q", len(text)) + text)
            for *_, tensor in entries:  # one tensor at a time: no second copy of the expert
                fh.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(partial, path)
        self.written.append(path)
        return path

    @contextlib.contextmanager
    def reader(self, expert: str | None) -> Iterator[Callable[[str], torch.Tensor]]:
        """A function name -> the tensor as :meth:`keep` wrote it (a host tensor), over the memory-mapped file."""
        from safetensors import safe_open

        with safe_open(str(self.files[expert]), framework="pt", device="cpu") as handle:
            yield handle.get_tensor


@contextlib.contextmanager
def lending(transformer: nn.Module, read: Callable[[str], torch.Tensor],
            device: torch.device) -> Iterator[Callable[[nn.Module], None]]:
    """``lend(block)``: the frozen tensors of ``block`` (a submodule of ``transformer``, an expert waiting on disk:
    its own are ``meta`` placeholders) read from its file by ``read`` (:meth:`WaitingOnDisk.reader`) onto
    ``device``, the block lent before given its placeholders back; at the end every placeholder is back. What DoRA's
    export of the waiting expert reads (its base rows), one block at a time."""
    name = qualified_names(transformer)
    lent: list[Entry] = []

    def give_back() -> None:
        for _, owner, attr, is_param, placeholder in lent:
            (owner._parameters if is_param else owner._buffers)[attr] = placeholder
        lent.clear()

    def lend(block: nn.Module) -> None:
        give_back()
        for entry in frozen_entries(block):
            _, owner, attr, is_param, placeholder = entry
            value = read(name(owner, attr)).to(device)
            if is_param:
                owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
            else:
                owner._buffers[attr] = value
            lent.append(entry)

    try:
        yield lend
    finally:
        give_back()


def _header(named: list[tuple[str, torch.Tensor]]) -> dict:
    header: dict = {}
    offset = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    return header


def _read_header(path: Path) -> dict | None:
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error):
        return None
    header.pop("__metadata__", None)
    return header
