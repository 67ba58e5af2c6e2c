"""Image conditioning: the 36-channel I2V-A14B input, and TI2V's clean, loss-free first latent frame."""

from __future__ import annotations

import torch
from wan22_helpers import make_adapter, raw_batch


def _capture_inputs(transformer):
    seen = {}

    def hook(module, args, kwargs):
        seen.update({k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)})

    return seen, transformer.register_forward_pre_hook(hook, with_kwargs=True)


def test_i2v_model_input_is_noisy_latents_then_mask_then_first_frame_latents():
    adapter = make_adapter("tiny-i2v", gradient_checkpointing=False)
    raw = raw_batch(batch_size=2)
    seen, handle = _capture_inputs(adapter.transformer_for("low_noise"))
    with torch.no_grad():
        adapter.loss(raw, "low_noise", torch.Generator().manual_seed(0))
    handle.remove()
    x = seen["hidden_states"]
    assert x.shape == (2, 36, 3, 4, 4)
    mask, first = x[:, 16:20], x[:, 20:36]
    assert torch.all(mask[:, :, 0] == 1) and torch.all(mask[:, :, 1:] == 0)
    # channels 20..35: the normalized VAE latents of [first training frame, zeros...] encoded as one clip
    vae = adapter._vae_model()
    clip = raw["pixels"].clone()
    clip[:, :, 1:] = 0
    z = vae.encode(clip).latent_dist.mode()
    mean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)
    assert torch.allclose(first, (z - mean) / std, atol=1e-5)
    assert not torch.allclose(first[:, :, 1:], torch.zeros_like(first[:, :, 1:]))  # zeros do not encode to zeros
    cached = adapter.encode_media(raw["pixels"])
    assert cached["cond_latents"].shape == (2, 20, 3, 4, 4)


def test_ti2v_i2v_sample_keeps_first_latent_frame_clean_with_zero_loss_weight():
    adapter = make_adapter("tiny-ti2v", i2v_probability=1.0, gradient_checkpointing=False)
    batch = adapter.encode_batch(raw_batch(size=64))
    transformer = adapter.transformer_for(None)
    seen, handle = _capture_inputs(transformer)
    with torch.no_grad():
        loss = adapter.loss(batch, None, torch.Generator().manual_seed(0))
    handle.remove()
    assert torch.equal(seen["hidden_states"][:, :, 0], batch["latents"][:, :, 0])  # clean conditioning frame
    tokens_per_frame = 2 * 2
    assert torch.all(seen["timestep"][:, :tokens_per_frame] == 0)
    assert torch.all(seen["timestep"][:, tokens_per_frame:] > 0)

    # Whatever the model predicts on latent frame 0 does not move the loss: its weight is zero.
    def shout_on_frame_0(module, args, output):
        pred = output[0].clone()
        pred[:, :, 0] += 1e3
        return (pred,)

    handle = transformer.register_forward_hook(shout_on_frame_0)
    with torch.no_grad():
        perturbed = adapter.loss(batch, None, torch.Generator().manual_seed(0))
    handle.remove()
    assert torch.allclose(loss, perturbed)


def test_ti2v_text_to_video_samples_and_single_frames_train_every_frame():
    adapter = make_adapter("tiny-ti2v", i2v_probability=0.0, gradient_checkpointing=False)
    for frames in (9, 1):
        batch = adapter.encode_batch(raw_batch(frames=frames, size=64))
        seen, handle = _capture_inputs(adapter.transformer_for(None))
        with torch.no_grad():
            adapter.loss(batch, None, torch.Generator().manual_seed(0))
        handle.remove()
        assert torch.all(seen["timestep"] > 0)
    always = make_adapter("tiny-ti2v", i2v_probability=1.0, gradient_checkpointing=False)
    batch = always.encode_batch(raw_batch(frames=1, size=64))  # an image: nothing would be left to train in i2v mode
    seen, handle = _capture_inputs(always.transformer_for(None))
    with torch.no_grad():
        always.loss(batch, None, torch.Generator().manual_seed(0))
    handle.remove()
    assert torch.all(seen["timestep"] > 0)
