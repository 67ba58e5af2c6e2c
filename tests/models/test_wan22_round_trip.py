"""Exported LoRA files load into diffusers' own Wan pipelines and reproduce the training-time model exactly."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
from wan22_helpers import make_adapter, raw_batch, train_steps

CASES = {"tiny-t2v": "WanPipeline", "tiny-i2v": "WanImageToVideoPipeline", "tiny-ti2v": "WanPipeline"}


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _inputs(adapter, expert):
    spec = adapter.spec
    g = torch.Generator().manual_seed(3)
    channels = spec.transformer_in_channels
    size = 8 if spec.vae == "wan2.1" else 4
    hidden = torch.randn(2, channels, 3, size, size, generator=g)
    text = torch.randn(2, spec.text_len, 32, generator=g)
    if spec.conditioning == "ti2v":  # per-token timesteps, first frame clean as in TI2V i2v
        tokens = (size // 2) ** 2
        per_frame = torch.tensor([[0.0, 500.0, 500.0], [700.0, 700.0, 700.0]])
        timestep = per_frame.repeat_interleave(tokens, dim=1)
    else:
        timestep = torch.tensor([950.0, 990.0]) if expert == "high_noise" else torch.tensor([100.0, 600.0])
    return dict(hidden_states=hidden, timestep=timestep, encoder_hidden_states=text, return_dict=False)


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(CASES))
def test_exported_lora_loaded_by_diffusers_pipeline_matches_training_model(variant, tiny_dir, tmp_path):
    import diffusers

    path = tiny_dir(variant)
    # rank != alpha, so a loader that ignored alpha (scale 1) or applied it twice could not pass.
    adapter = make_adapter(variant, path=str(path), rank=4, alpha=7.0, switch_every=1, lora={"save_dtype": "fp32"},
                           gradient_checkpointing=False)
    train_steps(adapter, adapter.encode_batch(raw_batch()), steps=2 * len(adapter.experts), lr=2e-2)
    for expert in adapter.experts:
        b_norm = sum(p.abs().sum() for n, p in adapter.transformer_for(expert).named_parameters() if "lora_B" in n)
        assert b_norm > 0, f"LoRA B of {expert} is still zero; the round trip would prove nothing"
    files = adapter.saver(tmp_path, "demo").save(step=4, final=True)

    pipe = getattr(diffusers, CASES[variant]).from_pretrained(str(path), local_files_only=True)
    records = _Records()
    logging.getLogger("diffusers").addHandler(records)
    logging.getLogger("peft").addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for file, expert in zip(files, adapter.experts, strict=True):
                pipe.load_lora_weights(file, load_into_transformer_2=expert == "low_noise")
    finally:
        logging.getLogger("diffusers").removeHandler(records)
        logging.getLogger("peft").removeHandler(records)
    problems = [m for m in records.messages + [str(w.message) for w in caught]
                if any(s in m.lower() for s in ("unexpected", "not loaded", "missing", "not found"))]
    assert problems == []

    worst = 0.0
    for expert in adapter.experts:
        ours = adapter.transformer_for(expert).eval()
        theirs = pipe.transformer_2 if expert == "low_noise" else pipe.transformer
        kwargs = _inputs(adapter, expert)
        with torch.no_grad():
            expected = ours(**kwargs)[0]
            got = theirs(**kwargs)[0]
            base = theirs(**kwargs, attention_kwargs={"scale": 0.0})[0]
        worst = max(worst, (expected - got).abs().max().item())
        assert (expected - base).abs().max().item() > 1e-3, "the LoRA has no visible effect; test is vacuous"
    print(f"{variant}: round-trip max abs diff {worst:.2e}")
    assert worst <= 1e-5, f"max abs diff {worst:.2e}"
