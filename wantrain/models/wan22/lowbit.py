"""Low-bit storage of the frozen base Linears through bitsandbytes (``model.base_dtype = "int8"`` or ``"nf4"``,
docs/models.md "Memory").

The same Linears as fp8 (:func:`fp8.targets`: every Linear inside the blocks) are stored as bitsandbytes codes with
one float32 absmax per block of :data:`BLOCK` consecutive weights of a row (64 of its inputs), and dequantised just
in time in each forward (``bitsandbytes.functional.dequantize_*``), rounded once to the input's dtype, then
``F.linear``; the LoRA (peft wraps a :class:`LowBitLinear` as any ``nn.Linear``) adds its update on top.

Outlier input channels: a column of the weight whose largest entry is above :data:`OUTLIER_FACTOR` times the median
column's is divided by its :func:`column_scale` (a bf16 value, float32 buffer, one per input channel) before it is
quantised, and the dequantised weight is multiplied back by it, in place, in the forward. Without it such a channel
sets the absmax of every 64-weight block it falls in and the other 63 weights lose their precision; measured on
real-width layers with 0.5 % of the input channels x10, int8's output error goes from 1.06 % to 0.71 % and nf4's
from 12.69 % to 7.85 % (bench/measure_lowbit_error.py); weights without such channels get scales of 1, codes
unchanged. Cost: 4 bytes per input channel and one elementwise multiply of the weight per forward.

* ``int8``: bitsandbytes' blockwise 8-bit quantisation (``quantize_blockwise``: one byte per weight, an index into
  its signed dynamic code of 256 values, scaled by the block's absmax): 1.06 bytes per weight. Chosen over the
  symmetric per-row int8 (``int8_vectorwise_quant``, what its int8 matmul uses) by measurement: on a real-width
  layer whose weights have outlier input channels a row's absmax is the outlier's, and per-row int8 moved the
  output by 6.5 % where 64-weight blocks moved it 0.9 % (bench/measure_lowbit_error.py, docs/models.md).
* ``nf4``: bitsandbytes' 4-bit NormalFloat (``quantize_4bit``, two weights per byte, 64-weight blocks): 0.56 bytes
  per weight.

Why bitsandbytes rather than torchao: it is a dependency already (the 8-bit optimizers' extra; without it these
storages are a one-line error), its quantise and
dequantise run on the CPU as well as CUDA (the tiny-twin tests run on a CPU), and both formats are plain tensors
(``uint8`` codes and ``float32`` absmax) that block swap, the expert placement, the waiting file and the checkpoint
move and write like any frozen tensor. No fused low-bit matmul is used: the weight is dequantised to bf16 and the
matmul is bf16's, so the activations are never quantised (the LoRA's gradients see only the weight's error).

The codes are the Linear's frozen ``weight_codes`` parameter (``uint8``: ``[out, in]`` for int8, ``[out, in / 2]``
for nf4), the absmax its ``weight_absmax`` buffer and the column scales its ``weight_column_scale`` one; the bias
stays in the compute dtype. Its ``weight`` is a stand-in that holds no memory (a bf16 scalar expanded to
``[out, in]`` on the codes' device): what peft reads of a base layer's weight (its shape for LoHa's and LoKr's
factors, its device) is right, and its values (zeros) are never computed with: DoRA, the only adapter that reads the
base weight outside the forward, reads :meth:`LowBitLinear.dequantised_rows` instead (``adapter_types.base_rows``),
a few rows at a time, the values the forward computes with.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from wantrain.core.errors import UserError

LOW_BIT_DTYPES = ("int8", "nf4")
# What each quantised storage costs per Linear of a real-width A14B block against the exact (float32) product, the
# worst of its six shapes, measured by bench/measure_lowbit_error.py (256 tokens; docs/models.md, Memory): relative
# output error with log-normal row gains, the same with 0.5 % outlier input channels (x10), and the cosine of the
# gradient the layer passes back to its input (what the LoRAs before it receive) with those outliers. bf16's own
# rounding: 0.17 %, cosine 0.99998.
BASE_ERROR = {"fp8": (0.0899, 0.0751, 0.99727), "fp8_scaled": (0.0257, 0.0266, 0.99964),
              "int8": (0.0070, 0.0071, 0.99996), "nf4": (0.0914, 0.0785, 0.99699)}
BLOCK = 64  # weights per absmax: 64 consecutive inputs of one output row
ABSMAX_NAME = "weight_absmax"
SCALE_NAME = "weight_column_scale"
# An input channel whose largest weight is above this many times the median channel's is scaled down to it before
# quantising (and the dequantised weight scaled back): the outlier input channels trained transformers have would
# otherwise set the absmax of every 64-weight block they fall in (bench/measure_lowbit_error.py: int8 1.06 % ->
# 0.71 %, nf4 12.69 % -> 7.85 % with 0.5 % of the channels x10; without outliers no channel is scaled)
OUTLIER_FACTOR = 2.0
BYTES_PER_WEIGHT = {"int8": 1.0 + 4.0 / BLOCK, "nf4": 0.5 + 4.0 / BLOCK}
# On the CPU a weight is quantised this many weights at a time (whole rows): bitsandbytes' CPU nf4 quantiser (0.50)
# allocates ~14 bytes of float32 working copies per weight (VmHWM over a 13824 x 5120 weight: 1.0 GB at once)
CPU_CHUNK_WEIGHTS = 1 << 22


def _functional():
    """bitsandbytes' functional module, imported quietly (it logs about optional CPU kernels it cannot fetch)."""
    quiet = logging.getLogger("bitsandbytes")
    level, quiet.level = quiet.level, logging.ERROR
    try:
        import bitsandbytes.functional as bnb_functional
    except ImportError as exc:  # an optional dependency (the "optimizers" extra)
        raise UserError(f"model.base_dtype = 'int8' / 'nf4' needs bitsandbytes >= 0.45 ({exc}); install it (pip "
                        "install 'wantrain[optimizers]') or use base_dtype = 'bf16' / 'fp8_scaled'") from None
    finally:
        quiet.level = level
    return bnb_functional


@functools.lru_cache(maxsize=8)
def _code(kind: str, device: torch.device) -> torch.Tensor:
    """The 256 (int8) or 16 (nf4) values the codes index, on ``device``."""
    bnb = _functional()
    probe = torch.zeros(BLOCK, dtype=torch.float32, device=device)
    _, state = bnb.quantize_blockwise(probe, blocksize=BLOCK) if kind == "int8" else \
        bnb.quantize_4bit(probe, blocksize=BLOCK, quant_type="nf4")
    return state.code


def column_scale(weight: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each input channel (column) of ``weight`` ``[out, in]``: a column whose largest weight
    is more than :data:`OUTLIER_FACTOR` times the median column's is divided down to that, others keep 1. The values
    are bf16's (the forward multiplies the bf16 dequantised weight by them exactly as the quantiser divided)."""
    largest = torch.maximum(weight.amax(dim=0), -weight.amin(dim=0)).to(torch.float32)  # no |weight| copy
    return (largest / (OUTLIER_FACTOR * largest.median())).clamp(min=1.0).to(torch.bfloat16).to(torch.float32)


def quantise(weight: torch.Tensor, kind: str, device: torch.device | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(uint8 codes, float32 absmax per :data:`BLOCK` weights, float32 scale per input channel) of ``weight``
    ``[out, in]`` in ``kind``: the codes are of ``weight / column_scale`` (module docstring), computed on ``device``
    (default: the weight's; a CUDA device quantises an A14B expert in seconds where a CPU takes minutes) and
    returned on the weight's device. On ``meta`` only the shapes."""
    out_features, in_features = weight.shape
    shape = (out_features, in_features if kind == "int8" else in_features // 2)
    if weight.is_meta:
        return (torch.empty(shape, dtype=torch.uint8, device="meta"),
                torch.empty(weight.numel() // BLOCK, dtype=torch.float32, device="meta"),
                torch.empty(in_features, dtype=torch.float32, device="meta"))
    work = weight.to(device) if device is not None else weight
    scale = column_scale(work)
    rows = _chunk_rows(work)
    # a few rows at a time (the CPU quantisers' float32 working copies are several times the weight): each block of
    # 64 lies inside one row, so the codes and absmax are the whole tensor's, bit for bit
    codes = torch.empty(shape, dtype=torch.uint8, device=work.device)
    absmax = torch.empty(weight.numel() // BLOCK, dtype=torch.float32, device=work.device)
    per_row = in_features // BLOCK if rows < out_features else 0
    for start in range(0, out_features, rows):
        stop = min(start + rows, out_features)
        part_codes, part_absmax = _quantise_whole(work[start:stop].to(torch.float32) / scale, kind)
        codes[start:stop] = part_codes.reshape(stop - start, shape[1])
        if per_row:
            absmax[start * per_row:stop * per_row] = part_absmax
        else:
            absmax.copy_(part_absmax)
    return codes.to(weight.device), absmax.to(weight.device), scale.to(weight.device)


def _quantise_whole(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    bnb = _functional()
    if kind == "int8":
        codes, state = bnb.quantize_blockwise(weight.contiguous(), blocksize=BLOCK)
    else:
        codes, state = bnb.quantize_4bit(weight.contiguous(), blocksize=BLOCK, quant_type="nf4")
    return codes, state.absmax.to(torch.float32)


def _chunk_rows(weight: torch.Tensor) -> int:
    """Rows quantised at once: every row on CUDA (its working copies are on the card), else about
    :data:`CPU_CHUNK_WEIGHTS` weights' worth of whole rows where a row is whole blocks of 64 (else every row)."""
    out_features, in_features = weight.shape
    if weight.device.type == "cuda" or in_features % BLOCK:
        return out_features
    return max(1, CPU_CHUNK_WEIGHTS // in_features)


def dequantise(codes: torch.Tensor, absmax: torch.Tensor, kind: str, shape: tuple[int, int],
               dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The weight ``[out, in]`` in ``dtype`` from its codes and absmax (bitsandbytes' own dequantisation), times
    its input channels' ``scale`` (in place, in ``dtype``: no second copy)."""
    weight = _dequantise_codes(codes, absmax, kind, shape, dtype)
    return weight if scale is None else weight.mul_(scale.to(dtype))


# One opaque operator for the compiled blocks (``model.compile``): dynamo would otherwise trace into bitsandbytes'
# Python wrappers and this module's cached codebook and break the graph at each Linear; here it sees one op whose
# fake implementation gives the weight's shape and dtype, and the eager implementation is :func:`dequantise`, so a
# compiled step computes the same values as an eager one
@torch.library.custom_op("wantrain::low_bit_dequantise", mutates_args=())
def _dequantise_op(codes: torch.Tensor, absmax: torch.Tensor, scale: torch.Tensor, kind: str, out_features: int,
                   in_features: int, dtype: torch.dtype) -> torch.Tensor:
    return dequantise(codes, absmax, kind, (out_features, in_features), dtype, scale)


@_dequantise_op.register_fake
def _(codes, absmax, scale, kind, out_features, in_features, dtype):
    return codes.new_empty((out_features, in_features), dtype=dtype)


def _dequantise_codes(codes: torch.Tensor, absmax: torch.Tensor, kind: str, shape: tuple[int, int],
                      dtype: torch.dtype) -> torch.Tensor:
    bnb = _functional()
    state = bnb.QuantState(absmax=absmax, shape=torch.Size(shape), code=_code(kind, codes.device), blocksize=BLOCK,
                           quant_type="nf4" if kind == "nf4" else None, dtype=dtype)
    if kind == "int8":
        return bnb.dequantize_blockwise(codes, state).reshape(shape)
    return bnb.dequantize_4bit(codes.reshape(-1, 1), state)


class LowBitLinear(nn.Linear):
    """An ``nn.Linear`` whose frozen ``weight`` is bitsandbytes ``uint8`` codes of ``kind`` with a float32
    ``weight_absmax`` buffer. Built by :func:`to_low_bit`."""

    def __init__(self, codes: torch.Tensor, absmax: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 shape: tuple[int, int], kind: str) -> None:
        nn.Module.__init__(self)  # not nn.Linear.__init__: it would allocate a weight of its own
        self.out_features, self.in_features = shape
        self.kind = kind
        self.weight_codes = nn.Parameter(codes, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.register_buffer(ABSMAX_NAME, absmax)
        self.register_buffer(SCALE_NAME, scale)

    @property
    def weight(self) -> torch.Tensor:
        """A stand-in of the weight's shape on the codes' device, holding no memory (module docstring)."""
        return torch.zeros((), dtype=torch.bfloat16, device=self.weight_codes.device).expand(
            self.out_features, self.in_features)

    def dequantised(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``[out, in]`` as it computes, in ``dtype``."""
        return _dequantise_op(self.weight_codes, self.weight_absmax, self.weight_column_scale, self.kind,
                              self.out_features, self.in_features, dtype)

    def dequantised_rows(self, rows: slice, dtype: torch.dtype) -> torch.Tensor:
        """Output rows ``rows`` (a step-1 slice) of :meth:`dequantised`, bit for bit, dequantising only them where a
        row is whole blocks of :data:`BLOCK` (a block never crosses a row), else the whole weight first."""
        start, stop, _ = rows.indices(self.out_features)
        if self.in_features % BLOCK:
            return self.dequantised(dtype)[start:stop]
        per_row = self.in_features // BLOCK
        return _dequantise_op(self.weight_codes[start:stop], self.weight_absmax[start * per_row:stop * per_row],
                              self.weight_column_scale, self.kind, max(0, stop - start), self.in_features, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantised(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind} (bitsandbytes)"


@torch.no_grad()
def to_low_bit(model: nn.Module, kind: str, compute_dtype: torch.dtype = torch.bfloat16,
               device: torch.device | None = None,
               quantised: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None) -> nn.Module:
    """Replace every Linear of ``fp8.targets`` by a :class:`LowBitLinear` of ``kind``, in place, one at a time (the
    extra memory is one Linear's), quantising on ``device`` (see :func:`quantise`). ``quantised``: (codes, absmax)
    by ``<linear>.weight`` name, quantised already as the file streamed (``single_file.load_transformer``; those
    Linears' weights are on ``meta``), taken out of the dict as used. Biases go to ``compute_dtype``. Call before
    the LoRA is added. Works on ``meta`` (the memory planner counts bytes)."""
    from wantrain.models.wan22.fp8 import targets

    if kind not in LOW_BIT_DTYPES:
        raise ValueError(f"low-bit storage is one of {LOW_BIT_DTYPES}, not {kind!r}")
    for name in targets(model):
        linear = model.get_submodule(name)
        if isinstance(linear, LowBitLinear):
            continue
        done = quantised.pop(f"{name}.weight", None) if quantised is not None else None
        codes, absmax, scale = done if done is not None else quantise(linear.weight.data, kind, device)
        bias = linear.bias.data.to(compute_dtype) if linear.bias is not None else None
        parent, _, attr = name.rpartition(".")
        layer = LowBitLinear(codes, absmax, scale, bias, (linear.out_features, linear.in_features), kind)
        setattr(model.get_submodule(parent), attr, layer)
    return model


def error_line(base_dtype: str) -> str | None:
    """``check``'s line on what ``base_dtype`` costs in quality (:data:`BASE_ERROR`), None for bf16 / fp32."""
    figures = BASE_ERROR.get(base_dtype)
    if figures is None:
        return None
    rows, columns, cosine = figures
    return (f"  base quality: {base_dtype} moves a real-width A14B Linear's output {100 * rows:.2f} % from exact "
            f"({100 * columns:.2f} % with outlier input channels; bf16: 0.17 %), input-gradient cosine {cosine:.5f} "
            "(bench/measure_lowbit_error.py)")
