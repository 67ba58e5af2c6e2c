"""Every source dtype streams into every storage dtype (issue 33.4): the loader holds at most one tensor of the file
at a time and nothing of it after the load, so the reader's window bounds the file's pages in the process (peak RSS:
bench/bench_single_file_load.py --matrix). Before, ``base_dtype = "fp8_scaled"`` kept the tensors it did not convert
(biases, norms, the file's own float8 weights and scales) as views of the file's mapping, which held every page of
the file read so far: 2.9x the loaded expert."""

from __future__ import annotations

import weakref

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import save_file
from wan22_helpers import to_comfyui_keys

from wantrain.models.wan22 import fp8, single_file
from wantrain.models.wan22.architecture import transformer_kwargs
from wantrain.models.wan22.loading import fp8_stored
from wantrain.models.wan22.variants import VARIANTS

E4M3 = torch.float8_e4m3fn
_KWARGS = dict(transformer_kwargs(VARIANTS["tiny-t2v"]), ffn_dim=96)  # FFN rows of 32 and 96: scales differ by row


def _build():
    return WanTransformer3DModel(**_KWARGS)


def _block_linear(key: str, value: torch.Tensor) -> bool:
    return ".blocks." in key and key.endswith(".weight") and value.dim() == 2


def _file(tmp_path, source: str):
    """(a ComfyUI-keyed file of a random tiny transformer in ``source``, its tensors): ``bf16``/``fp16``/``fp32``,
    ``fp8`` (block Linears cast to float8, no scales) or ``fp8_scaled`` (block Linears in float8 with a scale per
    tensor, per output row for the FFN, plus ``scale_input`` and the marker, as ComfyUI writes them)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = _build().state_dict()
    plain = {"fp16": torch.float16, "fp32": torch.float32}.get(source, torch.bfloat16)
    tensors = {}
    for key, empty in to_comfyui_keys(meta).items():
        value = (torch.randn(empty.shape) * 0.05).to(plain)
        if source == "fp8" and _block_linear(key, value):
            value = value.to(E4M3)
        elif source == "fp8_scaled" and _block_linear(key, value):
            w = value.float()
            scale = (w.abs().amax(dim=1) if ".ffn." in key else w.abs().max()) / 448.0
            value = (w / (scale.reshape(-1, 1) if scale.dim() else scale)).to(E4M3)
            tensors[key[: -len(".weight")] + ".scale_weight"] = scale
            tensors[key[: -len(".weight")] + ".scale_input"] = torch.ones(())
        tensors[key] = value
    if source == "fp8_scaled":
        tensors["scaled_fp8"] = torch.zeros(0, dtype=E4M3)
    file = tmp_path / f"{source}.safetensors"
    save_file(tensors, str(file))
    return file, tensors


class _Pages(bytearray):
    """One tensor's bytes of the file, standing for its pages of safetensors' mapping (weakly referenceable)."""


class _TrackingReader:
    """``single_file._Reader`` whose tensors are views of buffers of their own, as safetensors' are views of its
    mapping of the file: a buffer lives while anything (the model, a scale kept aside) still views it. ``most`` is
    the largest number of earlier tensors alive when one is read; ``alive()`` those alive now."""

    def __init__(self, file):
        self.inner = single_file._Reader(file)
        self.refs: list[weakref.ref] = []
        self.reads = self.most = 0

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        self.inner.__exit__(*exc)

    def keys(self):
        return self.inner.keys()

    def shape_and_dtype(self, key):
        return self.inner.shape_and_dtype(key)

    def alive(self) -> int:  # no gc.collect(): a tensor only a reference cycle holds holds its pages until a
        return sum(ref() is not None for ref in self.refs)  # collection, in the loader too

    def get(self, key):
        self.most = max(self.most, self.alive())
        self.reads += 1
        tensor = self.inner.get(key)
        pages = _Pages(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        self.refs.append(weakref.ref(pages))
        return torch.frombuffer(pages, dtype=torch.uint8).view(tensor.dtype).reshape(tensor.shape)


def _load(file, storage: str, reader=None):
    dtype = torch.float32 if storage == "fp32" else torch.bfloat16  # what loading.py streams each storage through
    return single_file.load_transformer(file, "low_noise_file", "tiny-t2v", _build, dtype, reader=reader,
                                        store=fp8_stored(_build) if storage == "fp8" else None,
                                        fp8_scaled=storage == "fp8_scaled")


_PAIRS = [(source, storage) for source in ("bf16", "fp16", "fp32", "fp8", "fp8_scaled")
          for storage in ("bf16", "fp32", "fp8", "fp8_scaled") if (source, storage) != ("fp8_scaled", "fp8")]


@pytest.mark.parametrize(("source", "storage"), _PAIRS)
def test_the_loader_holds_at_most_one_tensor_of_the_file_and_none_after_the_load(tmp_path, source, storage):
    file, tensors = _file(tmp_path, source)
    reader = _TrackingReader(file)
    model = _load(file, storage, reader)
    assert reader.reads >= len(list(model.parameters()))  # every tensor came through the tracking reader
    # one earlier tensor at most: a float8 weight while its scale is read
    assert reader.most <= (1 if source == "fp8_scaled" else 0)
    assert reader.alive() == 0  # the model owns its memory: the file's mapping goes at the reader's next reopen


def _reference_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-tensor quantisation the loader did before it went row chunk by row chunk (fp8.py's formula)."""
    w = weight.to(torch.bfloat16).to(torch.float32)
    absmax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / 448.0, torch.ones_like(absmax))
    return (w / scale).clamp_(-448.0, 448.0).to(E4M3), scale


@pytest.mark.parametrize("source", ["bf16", "fp32", "fp8", "fp8_scaled"])
def test_scaled_fp8_storage_holds_the_same_bytes_as_before_it_streamed(tmp_path, monkeypatch, source):
    """Byte-equal, not within rounding: a bf16/fp32 file's Linears quantised per row (through bf16) as the whole
    tensor was; a float8 file's weights as they are, with the file's scale (1 for plain fp8)."""
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 100)  # several row chunks per weight (a row is 32 or 96 elements)
    file, tensors = _file(tmp_path, source)
    model = _load(file, "fp8_scaled")
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, fp8.ScaledFp8Linear):
            continue
        key = next(iter(to_comfyui_keys({f"{name}.weight": torch.empty(0)})))
        raw = tensors[key]
        if source in ("fp8", "fp8_scaled"):
            want = raw
            scale = tensors.get(key[: -len(".weight")] + ".scale_weight", torch.ones(()))
            want_scale = scale.float().reshape(-1, 1).expand(raw.shape[0], 1)
        else:
            want, want_scale = _reference_rows(raw)
        assert module.weight.dtype == E4M3 and torch.equal(module.weight.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(module.weight_scale, want_scale)
        checked += 1
    assert checked == 10 * _KWARGS["num_layers"]


@pytest.mark.parametrize("storage", ["bf16", "fp32"])
def test_an_fp8_scaled_file_multiplied_out_row_chunk_by_row_chunk_is_the_whole_tensor_product(tmp_path, monkeypatch,
                                                                                             storage):
    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 100)
    file, tensors = _file(tmp_path, "fp8_scaled")
    state = _load(file, storage).state_dict()
    dtype = torch.float32 if storage == "fp32" else torch.bfloat16
    for name, key in (("blocks.0.attn1.to_q.weight", "blocks.0.self_attn.q"),  # one scale
                      ("blocks.1.ffn.net.0.proj.weight", "blocks.1.ffn.0")):  # one per row
        weight, scale = (tensors[f"model.diffusion_model.{key}.{part}"] for part in ("weight", "scale_weight"))
        product = weight.float() * (scale.reshape(-1, 1) if scale.dim() else scale)
        assert state[name].dtype == dtype and torch.equal(state[name], product.to(dtype))


def test_quantising_a_few_rows_at_a_time_keeps_only_one_chunk_in_float32(monkeypatch):
    """fp8.quantise_rows allocates its result and one chunk's float32 copies, never the whole weight in float32
    (a 13824 x 5120 A14B FFN weight is 283 MB in float32): the loader's peak stays the model plus one tensor."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        most = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple | list) else (out,):
                if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.dim() == 2:
                    Largest.most = max(Largest.most, t.numel())
            return out

    monkeypatch.setattr(fp8, "_CHUNK_ELEMENTS", 1000)
    weight = torch.randn(300, 100, dtype=torch.bfloat16)
    with Largest():
        q, scale = fp8.quantise_rows(weight)
    assert Largest.most <= 1000 and scale.shape == (300, 1)
    want, want_scale = _reference_rows(weight)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8)) and torch.equal(scale, want_scale)


def test_the_memory_planners_meta_count_quantises_each_weight_in_one_piece():
    """The planner counts fp8_scaled weights by converting a ``meta`` build (``memory.weight_bytes``): row chunks
    there only multiply meta ops (an A14B count went from 2 s to 16 s), so a meta weight is one chunk while a real
    one of the same shape is several."""
    shape = (13824, 5120)  # an A14B FFN weight
    assert fp8.row_chunks(torch.empty(shape, device="meta")) == [slice(0, shape[0])]
    assert len(fp8.row_chunks(torch.empty(1).expand(shape))) > 1  # a real weight (no memory: an expanded view)
    weight, scale = fp8.quantise_rows(torch.empty(shape, device="meta"))
    assert weight.is_meta and weight.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (shape[0], 1)


@pytest.mark.parametrize(("source", "kind"), [("bf16", "int8"), ("fp8_scaled", "nf4")])
def test_a_low_bit_base_is_quantised_as_the_file_streams_and_equals_quantising_a_bf16_load(tmp_path, monkeypatch,
                                                                                          source, kind):
    """``model.base_dtype = "int8"`` / ``"nf4"``: each block Linear's weight is quantised as soon as it is read, so
    when a weight is quantised no other block Linear's weight is held in bf16 (before, the whole expert loaded in
    bf16 and was quantised after: 26.6 GiB for an A14B expert); the codes are those of that bf16 load, bit for
    bit."""
    from wantrain.models.wan22 import lowbit

    file, _ = _file(tmp_path, source)
    built: list[torch.nn.Module] = []
    held: list[int] = []
    quantise = lowbit.quantise

    def build():
        built.append(_build())
        return built[-1]

    def watched(weight, kind, device=None):
        model = built[-1]
        held.append(sum(not model.get_parameter(n).is_meta for n in fp8.target_weights(model)))
        return quantise(weight, kind, device)

    monkeypatch.setattr(lowbit, "quantise", watched)
    streamed = single_file.load_transformer(file, "low_noise_file", "tiny-t2v", build, torch.bfloat16,
                                            low_bit=kind)
    assert len(held) == 10 * _KWARGS["num_layers"] and max(held) == 0  # every weight quantised, none held in bf16
    monkeypatch.setattr(lowbit, "quantise", quantise)
    reference = lowbit.to_low_bit(_load(file, "bf16"), kind)
    want = reference.state_dict()
    got = streamed.state_dict()
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and torch.equal(got[name], value), name
    assert sum(isinstance(m, lowbit.LowBitLinear) for m in streamed.modules()) == 10 * _KWARGS["num_layers"]
