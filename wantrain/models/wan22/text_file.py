"""The UMT5 text encoder from one file (``model.text_encoder_file``), as ComfyUI and the original Wan repos ship it.

Two key layouts (facts: transformers' ``UMT5EncoderModel``; Wan's ``wan/modules/t5.py``, ``umt5_xxl``):

* transformers / ComfyUI (``umt5_xxl_fp16.safetensors``): ``shared.weight``,
  ``encoder.block.N.layer.0.SelfAttention.{q,k,v,o,relative_attention_bias}.weight``,
  ``encoder.block.N.layer.0.layer_norm.weight``, ``encoder.block.N.layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight``,
  ``encoder.block.N.layer.1.layer_norm.weight``, ``encoder.final_layer_norm.weight``;
* the original Wan repos (``models_t5_umt5-xxl-enc-bf16.pth``, a torch pickle read only with ``weights_only=True``):
  ``token_embedding.weight``, ``blocks.N.{norm1,norm2}.weight``, ``blocks.N.attn.{q,k,v,o}.weight``,
  ``blocks.N.pos_embedding.embedding.weight`` (UMT5: one relative bias per block), ``blocks.N.ffn.gate.0.weight``
  (the GELU branch, ``wi_0``), ``blocks.N.ffn.fc1.weight`` (``wi_1``), ``blocks.N.ffn.fc2.weight`` (``wo``),
  ``norm.weight``.

The architecture is read off the tensor shapes (width, layers, heads, buckets, feed-forward width, vocabulary), with
UMT5-XXL's gated GELU feed-forward; the tokenizer comes from ``model.tokenizer_path`` (or ``model.path``'s
``tokenizer/``). A file that is neither layout, or misses tensors, is refused in one line.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from wantrain.core.errors import UserError

_WAN_BLOCK = [
    (r"blocks\.(\d+)\.norm1\.weight", r"encoder.block.\1.layer.0.layer_norm.weight"),
    (r"blocks\.(\d+)\.attn\.([qkvo])\.weight", r"encoder.block.\1.layer.0.SelfAttention.\2.weight"),
    (r"blocks\.(\d+)\.pos_embedding\.embedding\.weight",
     r"encoder.block.\1.layer.0.SelfAttention.relative_attention_bias.weight"),
    (r"blocks\.(\d+)\.norm2\.weight", r"encoder.block.\1.layer.1.layer_norm.weight"),
    (r"blocks\.(\d+)\.ffn\.gate\.0\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_0.weight"),
    (r"blocks\.(\d+)\.ffn\.fc1\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wi_1.weight"),
    (r"blocks\.(\d+)\.ffn\.fc2\.weight", r"encoder.block.\1.layer.1.DenseReluDense.wo.weight"),
    (r"token_embedding\.weight", "shared.weight"),
    (r"norm\.weight", "encoder.final_layer_norm.weight"),
]
_WAN_RULES = [(re.compile(f"^{a}$"), b) for a, b in _WAN_BLOCK]


def read_state(path: Path, key: str) -> dict[str, torch.Tensor]:
    """The tensors of ``path``: safetensors, or a torch file read with ``weights_only=True`` (no code runs)."""
    import pickle

    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        raise UserError(f"model.{key} '{path}' does not exist")
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except (SafetensorError, pickle.UnpicklingError, OSError, RuntimeError, ValueError, EOFError) as exc:
        # safetensors, unpickling (weights_only refuses code) and zip errors: not a weights file wantrain reads
        raise UserError(f"model.{key} '{path}' is not a readable weights file ({_why(exc)})") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"model.{key} '{path}' holds no plain dict of tensors")
    return state


def _why(exc: Exception) -> str:
    """What went wrong reading a torch file, in a few words. A weights-only refusal is named by the object the
    file would have run (torch's own advice, to load it with weights_only=False, runs a stranger's code: never)."""
    import pickle
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    if isinstance(exc, pickle.UnpicklingError) or "Weights only load failed" in text:
        found = re.search(r"Unsupported (?:global|operand)[^\n.]*", text)
        what = f"; {found.group(0).strip()}" if found else ""
        return (f"it holds Python objects besides tensors{what}; wantrain reads weights only and never runs code "
                "from a model file: use a .safetensors file")
    return (text.strip().splitlines() or [type(exc).__name__])[0][:200]


def read_shapes(path: Path, key: str) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of ``path`` without reading the weights (a safetensors header, or a torch file
    memory-mapped with ``weights_only=True``)."""
    if path.suffix == ".safetensors" and path.is_file():
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt") as fh:
                return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118 (not a dict)
        except (SafetensorError, OSError) as exc:
            raise UserError(f"model.{key} '{path}' is not a readable safetensors file ({exc})") from None
    return {k: tuple(v.shape) for k, v in read_state(path, key).items()}


def check_text_encoder_file(path: Path) -> None:
    """Refuse (one line) a file that is not a UMT5 encoder in either layout, from its header."""
    shapes = read_shapes(path, "text_encoder_file")
    _architecture(to_transformers_keys(shapes, path), path)


def to_transformers_keys(state: dict[str, Any], path: Path) -> dict[str, Any]:
    """``state`` (tensors, or shapes) under ``UMT5EncoderModel``'s names (either layout in; ComfyUI's extra
    non-weight keys dropped)."""
    if "shared.weight" in state or "encoder.embed_tokens.weight" in state:
        out = {k: v for k, v in state.items() if k.startswith(("shared.", "encoder."))}
        out.setdefault("shared.weight", out.get("encoder.embed_tokens.weight"))
        return out
    if "token_embedding.weight" not in state:
        example = next(iter(state), "nothing")
        raise UserError(f"model.text_encoder_file '{path}' is not a UMT5 encoder (no shared.weight or "
                        f"token_embedding.weight; first key {example!r})")
    out = {}
    for name, value in state.items():
        for pattern, target in _WAN_RULES:
            if pattern.match(name):
                out[pattern.sub(target, name)] = value
                break
        else:
            raise UserError(f"model.text_encoder_file '{path}': key {name!r} is not part of Wan's UMT5 encoder")
    return out


def _architecture(shapes: dict[str, tuple[int, ...]], path: Path) -> dict[str, int]:
    """``UMT5Config`` sizes read off the tensor shapes (transformers' names)."""
    try:
        vocab, width = shapes["shared.weight"]
        layers = 1 + max(int(m.group(1)) for k in shapes if (m := re.match(r"encoder\.block\.(\d+)\.", k)))
        buckets, heads = shapes["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]
        inner = shapes["encoder.block.0.layer.0.SelfAttention.q.weight"][0]
        ffn = shapes["encoder.block.0.layer.1.DenseReluDense.wi_0.weight"][0]
    except (KeyError, ValueError, TypeError) as exc:
        raise UserError(f"model.text_encoder_file '{path}' is missing UMT5 tensors ({exc})") from None
    return dict(vocab_size=vocab, d_model=width, d_kv=inner // heads, d_ff=ffn, num_layers=layers, num_heads=heads,
                relative_attention_num_buckets=buckets)


def load_text_encoder(path: Path, dtype: torch.dtype):
    """A ``UMT5EncoderModel`` in ``dtype`` (eval mode) with the weights of ``path``. A safetensors file (ComfyUI's
    ``umt5_xxl_fp16.safetensors``) is streamed tensor by tensor into ``dtype`` onto a ``meta`` build (the reader of
    ``single_file.py``, which reopens the file every 256 MiB), so the host never holds the file's copy and the cast
    copy at once (2 x 10.6 GiB for UMT5-XXL); a ``.pth`` is read with ``torch.load(mmap=True, weights_only=True)``."""
    from transformers import UMT5Config, UMT5EncoderModel

    path = Path(path).expanduser()
    if path.suffix == ".safetensors":
        names = to_transformers_keys({k: k for k in read_shapes(path, "text_encoder_file")}, path)
        shapes = to_transformers_keys(read_shapes(path, "text_encoder_file"), path)
    else:
        state = to_transformers_keys(read_state(path, "text_encoder_file"), path)
        shapes = {k: tuple(v.shape) for k, v in state.items()}
    config = UMT5Config(**_architecture(shapes, path), feed_forward_proj="gated-gelu", dropout_rate=0.0,
                        pad_token_id=0, eos_token_id=1)
    with torch.device("meta"):
        model = UMT5EncoderModel(config)
    if path.suffix == ".safetensors":
        from wantrain.models.wan22.single_file import _Reader

        names.pop("encoder.embed_tokens.weight", None)  # tied to shared.weight: set from it below
        unexpected = sorted(set(names) - set(model.state_dict()))
        with _Reader(path) as reader:
            for name in [n for n in names if n not in unexpected]:
                model.load_state_dict({name: reader.get(names[name]).to(dtype)}, strict=False, assign=True)
        model.encoder.embed_tokens.weight = model.shared.weight
        missing = sorted(k for k, v in model.state_dict().items() if v.is_meta)
    else:
        state["encoder.embed_tokens.weight"] = state["shared.weight"]
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        what = f"missing {missing[0]}" if missing else f"unexpected {unexpected[0]}"
        raise UserError(f"model.text_encoder_file '{path}' does not fit a UMT5 encoder of its own shapes ({what}, "
                        f"{len(missing)} missing and {len(unexpected)} unexpected tensors)")
    return model.to(dtype).eval()
