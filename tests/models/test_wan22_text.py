"""Text embeddings: prompts cleaned exactly like diffusers' Wan pipelines (issue 18.6), and text cache entries keyed
on everything that changes them (issue 18.2)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from wan22_helpers import make_adapter

from wantrain.data import DataConfig, build_dataset, ensure_cache
from wantrain.models.wan22.text import clean_prompt
from wantrain.models.wan22.variants import variant_spec

# curly quotes, full-width letters and punctuation, mojibake, double-escaped HTML, odd whitespace
UNICODE_CAPTIONS = [
    "“a red ball”，bouncing！",
    "ａ ｒｅｄ ｂａｌｌ ｏｎ ｔｈｅ ｇｒａｓｓ",
    "a dog in a cafÃ© &amp;amp; a cat",
    "  a\u00a0cat\u2003on\tthe\x1cgrass\n",
]


def test_prompts_are_cleaned_like_the_diffusers_wan_pipelines():
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean
    from diffusers.utils import is_ftfy_available

    assert is_ftfy_available()  # a dependency of wantrain, so the pipelines here clean with ftfy too
    for caption in UNICODE_CAPTIONS:
        assert clean_prompt(caption) == prompt_clean(caption)
    assert clean_prompt(UNICODE_CAPTIONS[1]) == "a red ball on the grass"


def test_text_embeddings_equal_the_pipelines_for_unicode_captions(tiny_dir):
    from diffusers import WanPipeline

    path = tiny_dir("tiny-t2v")
    pipe = WanPipeline.from_pretrained(str(path))
    adapter = make_adapter("tiny-t2v", path=str(path))
    ours = adapter.encode_text(UNICODE_CAPTIONS)["text_embeds"]
    with torch.no_grad():  # as at inference (with grad on, SDPA may take another kernel)
        theirs, _ = pipe.encode_prompt(UNICODE_CAPTIONS, do_classifier_free_guidance=False,
                                       max_sequence_length=adapter.spec.text_len, device=torch.device("cpu"))
    assert torch.equal(ours, theirs)
    plain = adapter.encode_text(["a red ball on the grass"])["text_embeds"]
    assert torch.equal(ours[1], plain[0])  # full-width letters tokenize like plain ones


def test_text_cache_is_not_shared_between_fp32_and_bf16_runs(tmp_path):
    pixels = np.zeros((32, 32, 3), np.uint8)
    Image.fromarray(pixels).save(tmp_path / "still.png")
    (tmp_path / "still.txt").write_text("a red ball")
    cfg = DataConfig(path=tmp_path, resolutions=[32])
    runs = {}
    for base_dtype in ("fp32", "bf16", "fp32"):
        data = build_dataset(cfg, spec=variant_spec("tiny-t2v"), seed=0, batch_size=1)
        adapter = make_adapter("tiny-t2v", base_dtype=base_dtype)
        stats = ensure_cache(data, adapter, remove_orphans=False)
        runs.setdefault(base_dtype, []).append((stats.latents_encoded, stats.texts_encoded))
        batch = next(data.batches(adapter))
        assert batch["text_embeds"].dtype == adapter.compute_dtype
    # the VAE runs in fp32 either way: latents are shared; each dtype encodes its own text once
    assert runs == {"fp32": [(1, 1), (0, 0)], "bf16": [(0, 1)]}


@pytest.mark.parametrize("other", [{"base_dtype": "bf16"}, {"variant": "tiny-i2v"}])
def test_text_identity_names_the_dtype_and_the_encoders(other):
    reference = make_adapter("tiny-t2v", base_dtype="fp32")
    changed = make_adapter(**{"variant": "tiny-t2v", **other})
    assert reference.text_identity != changed.text_identity
    assert reference.text_identity.startswith(reference.encoder_identity)
    assert make_adapter("tiny-t2v", base_dtype="fp32", experts="low_noise").text_identity == reference.text_identity
