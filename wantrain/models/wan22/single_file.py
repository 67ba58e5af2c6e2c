"""Single-file transformer checkpoints (original Wan or ComfyUI keys), streamed into the training dtype.

:func:`load_transformer` builds the transformer on ``meta`` from the variant's explicit architecture, then reads
the file one tensor at a time (``safetensors.safe_open``), casts each to the dtype it trains in (float32 for the
modules diffusers keeps in float32, ``_keep_in_fp32_modules``; the load dtype for everything else) and puts it in
place. The host therefore never holds the model in another dtype: diffusers' ``from_single_file`` builds float32
parameters and upcasts every tensor of a bf16 file (~57 GB for one A14B expert, plus the file's pages).

Checks, each one line naming the file (:class:`~wantrain.core.errors.UserError`), before any tensor is read:

* every parameter of the model must be in the file (else it would stay on ``meta``), and every tensor of the file
  must be used (a file of another model, or with parts diffusers would drop with a warning);
* ComfyUI ``fp8_scaled`` files: each float8 ``<layer>.weight`` comes with ``<layer>.scale_weight``, and the real
  weight is ``weight.float() * scale_weight``; the scale is applied exactly (in float32, one rounding to the
  training dtype) when it is one number or one per output row, else the file is refused. Their ``scaled_fp8``
  marker and ``scale_input`` tensors (activation scales for fp8 matmuls) carry no weight and are not used.
  Such a file with ``model.base_dtype = "fp8"`` (plain float8 storage, no scale) is refused: its weights would be
  quantised twice. With ``fp8_scaled=True`` (``model.base_dtype = "fp8_scaled"``) the blocks' Linear weights are
  not multiplied out: a float8 weight stays float8 with its own scale (1 without one), any other is quantised as it
  is read (``fp8.quantise_rows``), and the model comes back with those Linears as ``fp8.ScaledFp8Linear``.
  With ``low_bit`` (``model.base_dtype = "int8"`` / ``"nf4"``) each of those weights is quantised as it is read
  (``lowbit.quantise``, on ``quantise_on``: the training device where it is CUDA), from its training-dtype
  rounding, so no Linear is ever held in bf16 beside the next; the model comes back with those Linears as
  ``lowbit.LowBitLinear``, the codes those of loading in bf16 and quantising after (bit for bit).

Other sources stream through the same loop: ``reader`` (an object with this module's ``_Reader`` methods, e.g.
``sharded.ShardReader`` over a folder of shards), ``key_map`` (the file's names to diffusers', e.g. the identity for
a diffusers folder) and ``store`` (names kept in another storage dtype than they train in: the float8 Linears of
``model.base_dtype = "fp8"``, cast as each tensor arrives, so no bf16 copy of the model is ever whole). Tensors are
read in the file's order (a sharded folder opens each shard once). Building blocks: :func:`training_dtype`,
:func:`stream_into`.

Host memory: every source dtype into every storage dtype costs one copy of the model in its storage dtype plus a
window of the file. safetensors hands out each tensor as a view of its mapping of the whole file, and one live view
keeps every page of the file read so far in the process; so every tensor the model keeps is in memory of its own (a
copy where no conversion made one: the file's float8 weights and scales too), the reader reopens the file every
``_REOPEN_BYTES`` read, which lets the pages read so far go, and a conversion holds one tensor at a time (quantised
or multiplied out a few rows at a time: ``fp8.quantise_rows``, ``fp8.dequantise``). Peak RSS over the loaded expert
for each pair: ``bench/bench_single_file_load.py --matrix`` (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from wantrain.core.errors import UserError
from wantrain.models.wan22 import fp8, lowbit

SCALE_SUFFIX = ".scale_weight"
_FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_UNUSED_SUFFIXES = (".scale_input",)
_MARKERS = ("scaled_fp8",)
_REOPEN_BYTES = 256 << 20  # reopen the file after reading this much, so the mapping's pages leave the process (a
# window on top of the model; a reopen only re-reads the header, ~1 ms)


def training_dtype(model: nn.Module, name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype tensor ``name`` of ``model`` trains in: float32 inside a ``_keep_in_fp32_modules`` module."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    return torch.float32 if keep.intersection(name.split(".")) else dtype


def _set(model: nn.Module, name: str, value: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name)
    if attr in owner._parameters:
        owner._parameters[attr] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[attr] = value


def stream_into(model: nn.Module, names: Iterable[str], read: Callable[[str, torch.dtype], torch.Tensor],
                dtype: torch.dtype) -> nn.Module:
    """Fill ``model``'s tensors ``names`` (built on ``meta``) one at a time: ``read(name, training_dtype)`` returns
    the tensor in its storage dtype, in memory of its own; it replaces the meta tensor at once, so at most one tensor
    is in flight."""
    for name in names:
        _set(model, name, read(name, training_dtype(model, name, dtype)))
    return model


def wan_key_map(file_keys: Iterable[str]) -> dict[str, str]:
    """{diffusers tensor name: file key}, by diffusers' own Wan key conversion applied to the names alone."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    converted = convert_wan_transformer_to_diffusers({key: key for key in file_keys})
    return {new: old for new, old in converted.items() if isinstance(old, str)}


def trim_heap() -> None:
    """Give the free pages inside glibc's heap back to the system (``malloc_trim``; a no-op elsewhere). The tensors
    converted and freed one by one while loading are under glibc's mmap threshold once it has risen (up to 32 MiB),
    so they live in the heap, between the tensors kept, and their free pages stayed in RSS: an fp32 file into fp8
    storage peaked at 1.53x the expert (8 narrow blocks), 1.14x with the heap trimmed at each window."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


class _Reader:
    """Tensors of one safetensors file by key, reopening the file every ``_REOPEN_BYTES`` read so that the pages
    of the mapping do not pile up in the process."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self._handle: Any = None
        self._context: Any = None
        self._read = 0

    def __enter__(self) -> _Reader:
        self._open()
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    def _open(self) -> None:
        from safetensors import safe_open

        self._context = safe_open(str(self.file), framework="pt")
        self._handle = self._context.__enter__()
        self._read = 0

    def _close(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
        self._context = self._handle = None

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def shape_and_dtype(self, key: str) -> tuple[list[int], str]:
        piece = self._handle.get_slice(key)
        return list(piece.get_shape()), piece.get_dtype()

    def get(self, key: str) -> torch.Tensor:
        if self._read > _REOPEN_BYTES:
            self._close()
            trim_heap()
            self._open()
        tensor = self._handle.get_tensor(key)
        self._read += tensor.numel() * tensor.element_size()
        return tensor


def load_transformer(file: Path, setting: str, variant: str, build: Callable[[], nn.Module],
                     dtype: torch.dtype, *, reader: Any = None,
                     key_map: Callable[[Iterable[str]], dict[str, str]] | None = None,
                     store: Mapping[str, torch.dtype] | None = None, fp8_scaled: bool = False,
                     low_bit: str | None = None, quantise_on: torch.device | None = None) -> nn.Module:
    """The transformer in ``file`` (``setting`` is the config key naming it, for messages), built by ``build``
    (called under ``torch.device("meta")``) and streamed into ``dtype`` (see the module docstring; ``reader``,
    ``key_map``, ``store``, ``fp8_scaled``, ``low_bit`` and ``quantise_on`` there)."""
    from safetensors import SafetensorError

    where = f"model.{setting} '{file}'"
    with torch.device("meta"):
        model = build()
    kept_in_fp8 = fp8.target_weights(model) if fp8_scaled else set()
    fp8_scales: dict[str, torch.Tensor] = {}
    quantised_low_bit = fp8.target_weights(model) if low_bit else set()
    low_bit_codes: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    try:
        with reader if reader is not None else _Reader(file) as reader:
            keys = reader.keys()
            scales, mapping = _file_mapping(keys, key_map)
            _check_keys(model, mapping, where, variant)
            scale_of = {mapping_name: scales[key] for mapping_name, key in mapping.items() if key in scales}
            for name, scale_key in scale_of.items():
                _check_scale(reader, mapping[name], scale_key, where)
            if store and any(store.get(name) in _FLOAT8 for name in scale_of):
                raise UserError(
                    f"{where} is a ComfyUI fp8_scaled file: model.base_dtype = 'fp8' would cast its dequantised "
                    "weights to float8 again without a scale (quantised twice); use base_dtype = 'fp8_scaled' (keeps "
                    "the file's float8 weights and their scales) or 'bf16'"
                )

            def read(name: str, target: torch.dtype) -> torch.Tensor:
                key = mapping[name]
                raw = reader.get(key)
                want = model.get_parameter(name) if _is_param(model, name) else model.get_buffer(name)
                if tuple(raw.shape) != tuple(want.shape):
                    raise UserError(f"{where} does not fit the {variant} transformer ({key} has shape "
                                    f"{tuple(raw.shape)}, the model needs {tuple(want.shape)}); is this the "
                                    "right model?")
                if name in kept_in_fp8:  # scaled fp8 storage: the file's fp8 and scale as they are, or quantised
                    if raw.dtype == fp8.FP8:
                        fp8_scales[name] = (_scale(reader, scale_of[name]) if name in scale_of
                                            else torch.ones(()))
                        value = raw
                    else:  # from the training dtype's rounding, whatever the source stores (same scales)
                        value, fp8_scales[name] = fp8.quantise_rows(raw, via=dtype)
                elif name in scale_of:  # fp8_scaled: the real weight is weight * scale, computed in float32
                    value = _multiplied(raw, _scale(reader, scale_of[name]), target)
                elif store and name in store:  # through the training dtype, as the folder path rounds them
                    value = _cast_through(raw, target, store[name])
                else:
                    value = raw.to(target)
                if name in quantised_low_bit:  # int8 / nf4: quantised now, from the training dtype's rounding
                    low_bit_codes[name] = lowbit.quantise(value, low_bit, quantise_on)
                    return torch.empty(value.shape, dtype=value.dtype, device="meta")  # replaced below
                # in memory of its own: a tensor read zero-copy keeps the whole file's mapping (and every page of
                # it read so far) alive, past the reader's window and after the load
                return value.clone() if value is raw else value

            order = {key: i for i, key in enumerate(keys)}
            stream_into(model, sorted(mapping, key=lambda name: order[mapping[name]]), read, dtype)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{where} is not a readable safetensors file ({exc})") from None
    _rebuild_derived_buffers(model)
    if fp8_scaled:
        fp8.to_scaled_fp8(model, fp8_scales, compute_dtype=dtype)
    if low_bit:
        lowbit.to_low_bit(model, low_bit, compute_dtype=dtype, quantised=low_bit_codes)
    return model.eval()


def check_transformer_keys(file: Path, setting: str, variant: str, build: Callable[[], nn.Module], *,
                           reader: Any = None,
                           key_map: Callable[[Iterable[str]], dict[str, str]] | None = None) -> None:
    """What :func:`load_transformer` refuses first -- a file whose tensor names are not the transformer's (a VAE or
    a text encoder given as an expert file, a partial file) -- from the header alone, with the same one line;
    ``build`` runs on ``meta``, so nothing is loaded (``wantrain check``)."""
    from safetensors import SafetensorError

    where = f"model.{setting} '{file}'"
    with torch.device("meta"):
        model = build()
    try:
        with reader if reader is not None else _Reader(file) as opened:
            _, mapping = _file_mapping(opened.keys(), key_map)
    except (SafetensorError, OSError) as exc:
        raise UserError(f"{where} is not a readable safetensors file ({exc})") from None
    _check_keys(model, mapping, where, variant)


def _file_mapping(keys: list[str], key_map: Callable[[Iterable[str]], dict[str, str]] | None,
                  ) -> tuple[dict[str, str], dict[str, str]]:
    """({weight key: its scale key}, {model tensor name: file key}) of a file's tensor names."""
    scales = {k[: -len(SCALE_SUFFIX)] + ".weight": k for k in keys if k.endswith(SCALE_SUFFIX)}
    ignored = {k for k in keys if k.endswith(_UNUSED_SUFFIXES) or k.rsplit(".", 1)[-1] in _MARKERS}
    orphans = sorted(s for w, s in scales.items() if w not in keys)  # a scale without its weight
    weights = [k for k in keys if k not in ignored and k not in scales.values()]
    return scales, (key_map or wan_key_map)(weights + orphans)


def _scale(reader: Any, key: str) -> torch.Tensor:
    """The float32 scale ``key`` of an fp8_scaled file, in memory of its own (never a view of the file)."""
    return reader.get(key).to(torch.float32, copy=True)


def _multiplied(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``weight.float() * scale`` (one scale, or one per output row) rounded once to ``dtype``, a few rows at a time
    for a matrix (``fp8.dequantise``): the float32 product of the whole tensor is never held."""
    if weight.dim() == 2:
        return fp8.dequantise(weight, scale.reshape(-1, 1).expand(weight.shape[0], 1), dtype)
    factor = scale.reshape(-1, *([1] * (weight.dim() - 1))) if scale.numel() > 1 else scale.reshape(())
    return weight.to(torch.float32).mul_(factor).to(dtype)


def _cast_through(tensor: torch.Tensor, via: torch.dtype, dtype: torch.dtype) -> torch.Tensor:
    """``tensor.to(via).to(dtype)`` a few rows at a time: the only allocation the size of the tensor is the result
    (a whole copy in ``via`` freed right after would leave a hole in the heap with each tensor)."""
    if tensor.dim() == 0:
        return tensor.to(via).to(dtype)
    out = torch.empty(tensor.shape, dtype=dtype)
    for piece in fp8.row_chunks(tensor):
        out[piece] = tensor[piece].to(via)
    return out


def _is_param(model: nn.Module, name: str) -> bool:
    owner_name, _, attr = name.rpartition(".")
    return attr in model.get_submodule(owner_name)._parameters


def _check_keys(model: nn.Module, mapping: Mapping[str, str], where: str, variant: str) -> None:
    persistent = set(model.state_dict())
    missing = sorted(persistent - set(mapping))
    unused = sorted(set(mapping) - persistent)
    if missing or unused:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensors of the model are not in the file, e.g. {missing[0]!r}")
        if unused:
            parts.append(f"{len(unused)} tensors of the file are not in the model, e.g. {mapping[unused[0]]!r}")
        raise UserError(f"{where} does not fit the {variant} transformer: {'; '.join(parts)}; use a complete "
                        f"{variant} transformer file (original Wan or ComfyUI keys)")


def _check_scale(reader: _Reader, weight_key: str, scale_key: str, where: str) -> None:
    weight_shape, _ = reader.shape_and_dtype(weight_key)
    scale_shape, _ = reader.shape_and_dtype(scale_key)
    numel = 1
    for n in scale_shape:
        numel *= n
    per_row = bool(weight_shape) and numel == weight_shape[0] and all(n == 1 for n in scale_shape[1:])
    if numel != 1 and not per_row:
        raise UserError(f"{where} has fp8 scales of shape {tuple(scale_shape)} for {weight_key} of shape "
                        f"{tuple(weight_shape)}; only one scale per tensor or per output row can be applied: "
                        "convert the file to bf16 first")


def _rebuild_derived_buffers(model: nn.Module) -> None:
    """Buffers not in a state dict (RoPE's frequency tables) are computed in ``__init__``; on ``meta`` they hold
    nothing, so the modules that own them are built again on the CPU."""
    for name, module in list(model.named_modules()):
        if not any(b.is_meta for b in module.buffers(recurse=False)):
            continue
        if type(module).__name__ != "WanRotaryPosEmbed":
            raise RuntimeError(f"{name}: a buffer computed at construction that the loader does not know")
        fresh = type(module)(module.attention_head_dim, module.patch_size, module.max_seq_len)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, fresh)
