"""One A14B expert on a GPU: seconds per optimizer step, model FLOP utilisation and peak VRAM, with random weights.

Not a test; needs no checkpoint. Builds one expert of the ``t2v-a14b`` architecture (``wantrain.models.wan22``'s
diffusers constructor arguments: 40 layers, dim 5120) with random bf16 weights, adds the same LoRA wantrain adds
(rank 32 on the attention and FFN projections, LoRA weights in fp32) and trains it on random latents and text
embeddings with the flow-matching loss, fused AdamW and gradient clipping, as a wantrain step does:

* the memory settings of issue 24 at 480x832, 81 frames (latents 16x21x60x104, 32 760 tokens), gradient
  checkpointing: base ``bf16`` or ``fp8`` (stored in float8_e4m3fn, computed in bf16, as ``base_dtype = "fp8"``)
  x ``model.blocks_to_swap`` 0 / 20 / 38 (wantrain's ``BlockSwap``: the frozen tensors of the last N blocks in
  pinned host memory, a ring of two device slots, copies on a side stream) x ``model.offload_activations`` off /
  on (wantrain's ``ActivationOffload``, with its prefetch). Settings are named ``bf16``, ``bf16-swap20``,
  ``fp8-swap38-offload``, ...; ``--settings`` picks some (default: those twelve; any ``bf16|fp8[-swapN][-offload]``
  is accepted, e.g. the 24 GB plan's).
* For each: s/step (median of the timed steps, after warm-up) and its ratio to ``bf16`` with nothing swapped
  (issue 24's target: <= 1.15 for the 24 GB plan's setting), MFU, peak allocated and reserved VRAM and the
  planner's estimate of the allocated peak (``wantrain.models.wan22.memory``), and the host<->device traffic:
  bytes copied per step (counted by the swap's and the offload's callbacks), the link's measured pinned
  host->device bandwidth, and the copy time per step at that bandwidth against the step (the copies overlap the
  compute when the prefetch works; the s/step ratio shows what is left).

MFU = model FLOPs per step / step time / the GPU's peak dense bf16 FLOP/s. Model FLOPs per step =
2 x F_linear + 3 x F_attention, from one forward counted with ``torch.utils.flop_counter.FlopCounterMode``: the
forward plus a backward with respect to activations only (the frozen base weights get no weight gradient, so a
Linear's backward is 1x its forward; the LoRA weight gradients are negligible), while attention's backward costs
2x its forward (dQ, dK, dV and the recomputed scores). The forward recomputed by gradient checkpointing is not
counted, as usual for MFU. The peak comes from ``--peak-tflops`` or a table of known GPUs.

The model is built on ``meta`` in its storage dtypes (bf16, or float8 Linears for ``fp8``; ``fp8_scaled``: bf16
quantised per row into wantrain's ``ScaledFp8Linear``; ``int8`` / ``nf4``: into bitsandbytes codes,
``lowbit.LowBitLinear``; these three unswapped) and materialised afterwards with random weights
drawn on the device, one generator per tensor from a fixed seed (:func:`fill_random`; swapped blocks' tensors are
copied to the host from there), and the peak-memory counter is reset after the build: the peak is that of
training. Every setting of a variant has the same weights and inputs, so a bf16 setting run after plain ``bf16``
reports its first step's loss and LoRA gradients against plain's (``same_as_bf16``). ``--variant`` (``i2v-a14b``:
36 input channels, the 20 past the latents a fixed random condition; ``ti2v-5b``: 48-channel latents, stride 16;
``vace-t2v-a14b``: the T2V expert with its 8 VACE blocks, a fixed random 96-channel control context, blocks swapped
in run order, VACE blocks first) and ``--size`` pick another model and video; a setting ending in ``-lean`` uses
``model.recompute = "lean"``. ``--cap-gib`` counts the CUDA context (``context_gib``) in the cap.

    python bench/gpu_step.py                       # every setting on cuda:0, JSON on stdout (~15 min on an H200)
    python bench/gpu_step.py --settings bf16,bf16-swap38-offload --steps 3
    python bench/gpu_step.py --smoke               # tiny model, tiny shapes, on the CPU: checks the script runs
    python bench/gpu_step.py --settings bf16,bf16-compile,bf16-flash,bf16-xformers   # issue 44's rows

A setting name may end in ``-compile`` (``model.compile = "default"``) and ``-flash`` / ``-xformers``
(``model.attention``); the row then has ``compile``, ``attention`` and ``first_step_s`` (the compiling step).

Never run on a GPU by its author (written on a machine without one); ``--smoke`` was run on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time

import torch

from wantrain.models.wan22.adapter_types import candidate_modules
from wantrain.models.wan22.architecture import cast_keeping_fp32_modules, transformer_class, transformer_kwargs
from wantrain.models.wan22.export import ADAPTER_NAME, LORA_TARGET_REGEX
from wantrain.models.wan22.offload import ActivationOffload
from wantrain.models.wan22.recompute import use_recompute
from wantrain.models.wan22.swap import BlockSwap, swapped_blocks
from wantrain.models.wan22.variants import VARIANTS

# dense bf16 tensor FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100 SXM": 989.0, "H100 PCIe": 756.0, "H100": 989.0, "H20": 148.0,
                    "A100": 312.0, "L40S": 362.0, "L40": 181.0, "A6000": 155.0, "RTX 4090": 165.0, "A10G": 70.0}


def latent_shape(height: int, width: int, frames: int, variant: str = "t2v-a14b") -> tuple[int, int, int, int, int]:
    """The VAE latents of one clip: Wan 2.1's 16 channels, time /4 (+1), space /8 (A14B); Wan 2.2's 48 channels,
    space /16 (TI2V-5B)."""
    spec = VARIANTS[variant]
    stride = spec.spatial_multiple // 2  # spatial_multiple is the VAE's stride times the 2x2 patch
    return (1, spec.latent_channels, (frames - 1) // spec.frame_multiple + 1, height // stride, width // stride)


def fill_random(model, device: torch.device, seed: int, *, lora: bool = False) -> None:
    """Random weights drawn on ``device`` with one generator per tensor seeded from ``seed`` and the tensor's index,
    then copied to wherever the tensor lives (the host for swapped blocks) in its storage dtype: every placement of
    the same architecture gets the same weights (the plain and the swapped run compare their gradients), and the
    host never draws ~14 B random numbers on one core. Small normal for matrices, ones/zeros for norms and biases;
    ``lora``: only the LoRA tensors, all small normal (B not zero: the gradients of A are compared too)."""
    with torch.no_grad():
        for index, (name, p) in enumerate(model.named_parameters()):
            is_lora = f".{ADAPTER_NAME}." in name
            if is_lora != lora:
                continue
            g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + index)
            if p.dim() >= 2 or is_lora:
                value = torch.randn(p.shape, generator=g, device=device).mul_(0.01 if is_lora else 0.02)
                p.copy_(value)  # cast to the storage dtype (float8 included) and, for host tensors, copied there
                del value
            elif "norm" in name or name.endswith("scale_shift_table"):
                p.fill_(1.0 if "weight" in name else 0.0)
            else:
                p.zero_()


def build_expert(device: torch.device, *, tiny: bool, fp8: bool, checkpointing: bool, rank: int, swap: int = 0,
                 variant: str = "t2v-a14b", storage: str | None = None, seed: int = 0, recompute: str = "block"):
    """One expert of ``variant`` with random weights (:func:`fill_random`), built on ``meta`` in its storage dtypes
    and only then materialised: the frozen tensors of the last ``swap`` blocks straight on the host (where
    ``BlockSwap`` keeps them), everything else on ``device``. The device never holds the model in another dtype,
    nor a swapped block outside the ring (a 24 GiB card could not hold the 28.6 GB bf16 expert even for a moment).
    ``storage`` ``"fp8_scaled"``: bf16 weights quantised per output row into ``ScaledFp8Linear`` (``base_dtype =
    "fp8_scaled"``), ``"int8"`` / ``"nf4"``: into bitsandbytes codes (``lowbit.LowBitLinear``), after materialising,
    so only with ``swap = 0``. A VACE variant (``WanVACETransformer3DModel``): its blocks counted in run order for
    the swap (``swap.swapped_blocks``: VACE blocks first), its LoRA on the VACE blocks too (``model.vace_blocks =
    "lora"``). ``recompute``: ``model.recompute`` (``lean``: ``recompute.use_recompute``)."""
    from peft import LoraConfig

    spec = VARIANTS[model_variant(variant, tiny)]
    kwargs = transformer_kwargs(spec)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    with torch.device("meta"):
        model = cast_keeping_fp32_modules(transformer_class(spec)(**kwargs), dtype)
        if fp8:  # the Linears' storage becomes float8 while still on meta
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
    blocks, swapped = swapped_blocks(model, swap)
    host_blocks = {id(m) for k in swapped for m in blocks[k].modules()}
    for module in model.modules():
        module.to_empty(device="cpu" if id(module) in host_blocks else device, recurse=False)
    fill_random(model, device, seed)
    if storage is not None:
        from wantrain.models.wan22.fp8 import to_scaled_fp8
        from wantrain.models.wan22.lowbit import to_low_bit

        assert not swap and not fp8, f"{storage} is built on the device, unswapped"
        compute = torch.bfloat16 if device.type == "cuda" else torch.float32
        if storage == "fp8_scaled":
            to_scaled_fp8(model, compute_dtype=compute)
        else:
            to_low_bit(model, storage, compute_dtype=compute)
    # RoPE frequencies are buffers computed in __init__: rebuild them on the device (to_empty left them blank)
    model.rope = type(model.rope)(model.rope.attention_head_dim, model.rope.patch_size,
                                  model.rope.max_seq_len).to(device)
    model.requires_grad_(False)
    if checkpointing:
        model.enable_gradient_checkpointing()
    targets = candidate_modules(spec.num_layers, len(spec.vace_layers)) if spec.vace else LORA_TARGET_REGEX
    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=targets, init_lora_weights=True),
                      adapter_name=ADAPTER_NAME)
    use_recompute(model, recompute)
    for name, p in model.named_parameters():
        if f".{ADAPTER_NAME}." in name:  # LoRA follows its base layer's device: all of it goes to the device
            p.data = p.data.float().to(device)
            p.requires_grad_(True)
    fill_random(model, device, seed, lora=True)
    return model.train(), spec, dtype


# -- model.compile and model.attention (issue 44): a setting name may end in "-compile" (model.compile = "default")
# and/or "-flash" / "-xformers" (model.attention), e.g. "bf16-compile", "bf16-flash", "bf16-swap20-compile-flash".
# Both are applied after the FLOPs are counted (the count is the same for every kernel and for compiled blocks).
SPEED_SUFFIXES = ("-compile", "-flash", "-xformers")


def split_speed(name: str) -> tuple[str, bool, str]:
    """(the memory setting's name, compiled, attention kernel) of a setting name."""
    compiled, kernel = False, "sdpa"
    for suffix in SPEED_SUFFIXES:
        if suffix in name:
            name = name.replace(suffix, "")
            compiled, kernel = (True, kernel) if suffix == "-compile" else (compiled, suffix[1:])
    return name, compiled, kernel


def apply_speed(model, name: str, device: torch.device) -> dict:
    """The setting's attention kernel and compiled blocks, as wantrain's adapter applies them."""
    from wantrain.models.wan22.attention import check_kernel, use_kernel
    from wantrain.models.wan22.compile import compile_blocks

    _, compiled, kernel = split_speed(name)
    use_kernel(model, check_kernel(kernel, device))
    if compiled:
        compile_blocks(model, "default", None)
    return {"compile": "default" if compiled else "off", "attention": kernel}


def settings_table(smoke: bool) -> dict[str, dict]:
    """Setting name -> (fp8, blocks_to_swap, offload). Smoke: the tiny twin's two blocks, fp32 on the CPU."""
    if smoke:
        return {"bf16": dict(fp8=False, swap=0, offload=False), "bf16-swap1": dict(fp8=False, swap=1, offload=False),
                "bf16-swap1-offload": dict(fp8=False, swap=1, offload=True),
                "fp8_scaled": dict(fp8=False, swap=0, offload=False, storage="fp8_scaled")}
    out = {}
    for fp8 in (False, True):
        for swap in (0, 20, 38):
            for offload in (False, True):
                name = ("fp8" if fp8 else "bf16") + (f"-swap{swap}" if swap else "") + ("-offload" if offload else "")
                out[name] = dict(fp8=fp8, swap=swap, offload=offload)
    return out


def parse_setting(name: str, blocks: int) -> dict | None:
    """``bf16``, ``fp8-swap38``, ``bf16-swap39-offload``, ``bf16-swap38-offload-lean``, ``fp8_scaled``, ``int8``,
    ``nf4``, ... -> (fp8, blocks_to_swap, offload, storage, recompute); None if not one (``fp8_scaled``, ``int8`` and
    ``nf4`` are built on the device: no swap). ``-lean``: ``model.recompute = "lean"``."""
    import re

    match = re.fullmatch(r"(bf16|fp8_scaled|fp8|int8|nf4)(?:-swap(\d+))?(-offload)?(-lean)?", name)
    built_on_device = match is not None and match.group(1) in ("fp8_scaled", "int8", "nf4")
    if match is None or int(match.group(2) or 0) > blocks or (built_on_device and match.group(2)):
        return None
    return dict(fp8=match.group(1) == "fp8", swap=int(match.group(2) or 0), offload=bool(match.group(3)),
                storage=match.group(1) if built_on_device else None, recompute="lean" if match.group(4) else "block")


def swap_blocks(model, swap: int, device: torch.device, on_copy) -> BlockSwap | None:
    """Put the frozen tensors of the last ``swap`` blocks (in run order: ``swap.swapped_blocks``) on the host and hand
    them to wantrain's BlockSwap."""
    if not swap:
        return None
    blocks, swapped = swapped_blocks(model, swap)
    on_device = [k for k in swapped for t in blocks[k].parameters() if not t.requires_grad and t.device.type != "cpu"]
    assert not on_device, f"blocks {sorted(set(on_device))} were built on the device (build_expert(swap=...))"
    return BlockSwap(model, blocks, swapped, device, ring=2, on_copy=on_copy)


def link_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Pinned host->device bytes per second (median of three copies of ``nbytes``); on a CPU a plain copy."""
    pinned = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(3):
        if pinned:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        target.copy_(host, non_blocking=pinned)
        if pinned:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    del host, target
    return nbytes / statistics.median(times)


def planned(setting: dict, shape: tuple[int, int, int], rank: int, variant: str):
    """The planner's estimate (``wantrain.models.wan22.memory``) of the setting: its ``training_peak`` is the
    allocated peak with attention's backward buffer (what ``max_memory_allocated`` sees on CUDA; ``wantrain check``
    prints it part by part), its ``link_bytes`` the bytes over the host link per step."""
    from wantrain.models.wan22.memory import MemorySettings, estimate

    height, width, frames = shape
    tiny = variant.startswith("tiny-")
    dtype = "fp32" if tiny else ("fp8" if setting["fp8"] else setting.get("storage") or "bf16")
    return estimate(variant, MemorySettings(dtype, setting["swap"], setting["offload"],
                                            setting.get("recompute", "block")),
                    width=width, height=height, frames=frames, rank=rank)


def model_flops(counts: dict) -> tuple[float, float]:
    """(linear FLOPs, attention FLOPs) of one forward from ``FlopCounterMode.get_flop_counts()["Global"]``."""
    attention = sum(v for op, v in counts.items() if "attention" in str(op))
    return sum(counts.values()) - attention, attention


def model_variant(variant: str, tiny: bool) -> str:
    """The variant built: ``variant``'s tiny twin with ``tiny`` (``t2v-a14b`` -> ``tiny-t2v``, ``vace-t2v-a14b`` ->
    ``tiny-vace-t2v``)."""
    return "tiny-" + variant.removesuffix("-a14b").removesuffix("-5b") if tiny else variant


def run_config(name: str, device: torch.device, *, tiny: bool, fp8: bool, shape: tuple[int, int, int],
               steps: int, warmup: int, rank: int, peak_tflops: float | None, swap: int = 0,
               offload: bool = False, bandwidth: float | None = None, cap_gib: float | None = None,
               variant: str = "t2v-a14b", storage: str | None = None, first_grads: dict | None = None,
               recompute: str = "block") -> dict:
    """One setting's steps and figures (JSON-ready). ``first_grads``, when given, receives the LoRA gradients of
    the first step (before clipping) on the host, and the result its loss: runs of the same variant and seed
    have the same weights and inputs, so a placement that moves data wrongly shows as a different gradient."""
    context_gib = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
        # a smaller card on a larger one: allocations past the cap raise out-of-memory (1.0: no cap). The card's
        # memory also holds the CUDA context and the libraries' workspaces, outside PyTorch's allocator: the cap
        # is the card less what is used outside the allocator now
        free, total = torch.cuda.mem_get_info(device)
        outside = total - free - torch.cuda.memory_reserved(device)
        context_gib = round(outside / 2**30, 3)
        fraction = (cap_gib * 2**30 - outside) / total if cap_gib else 1.0
        torch.cuda.set_per_process_memory_fraction(min(1.0, max(fraction, 0.0)), device)
    model, spec, dtype = build_expert(device, tiny=tiny, fp8=fp8, checkpointing=True, rank=rank, swap=swap,
                                      variant=variant, storage=storage, recompute=recompute)
    traffic = {"bytes": 0}
    block_bytes: dict[int, int] = {}

    def on_block(k: int) -> None:
        traffic["bytes"] += block_bytes[k]

    swapper = swap_blocks(model, swap, device, on_block)
    if swapper is not None:
        for k, entries in swapper._host.items():
            block_bytes[k] = sum(h.numel() * h.element_size() for *_, h in entries)

    def on_moved(*args: int) -> None:
        traffic["bytes"] += args[-1]

    # (the tiny twin's tensors are all under the default 1 MiB floor: offload them all)
    offloader = ActivationOffload(device, on_pack=on_moved, on_copy_back=on_moved,
                                  min_bytes=0 if tiny else 1 << 20) if offload else None
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    g = torch.Generator(device=device).manual_seed(0)
    latents = torch.randn(latent_shape(*shape, variant=variant), generator=g, device=device)
    latents = latents[:, : model.config.out_channels]
    # I2V: the channels past the noisy latents are the image condition (mask and encoded first frame), fixed
    condition = torch.randn(1, model.config.in_channels - latents.shape[1], *latents.shape[2:], generator=g,
                            device=device)
    text = torch.randn(1, spec.text_len, model.config.text_dim, generator=g, device=device, dtype=dtype)
    # VACE: a fixed random control context (control latents and packed mask) at the latents' size
    control = {"control_hidden_states": torch.randn(1, spec.vace_in_channels, *latents.shape[2:], generator=g,
                                                    device=device).to(dtype)} if spec.vace else {}

    def loss_fn() -> torch.Tensor:
        t = torch.rand(1, generator=g, device=device)
        noise = torch.randn(latents.shape, generator=g, device=device)
        x_t = (1 - t.view(1, 1, 1, 1, 1)) * latents + t.view(1, 1, 1, 1, 1) * noise
        with offloader.active() if offloader is not None else contextlib.nullcontext():
            pred = model(hidden_states=torch.cat([x_t, condition], 1).to(dtype), timestep=t * 1000,
                         encoder_hidden_states=text, return_dict=False, **control)[0].float()
        return ((pred - (noise - latents)) ** 2).mean()

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        loss_fn()
    forward_flops = counter.get_total_flops()
    linear_flops, attention_flops = model_flops(counter.get_flop_counts().get("Global", {}))
    # frozen base: the backward computes input gradients only (linear: 1x forward) but attention's backward is
    # 2x its forward (dQ, dK, dV and the recomputed scores); the checkpointing recompute is not counted
    step_flops = 2 * linear_flops + 3 * attention_flops
    speed = apply_speed(model, name, device)
    if device.type == "cuda":  # the peak of the training steps, not of building the model
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for i in range(warmup + steps):
        sync()
        if i == warmup:
            traffic["bytes"] = 0  # the timed steps' traffic only
        start = time.perf_counter()
        loss = loss_fn()
        loss.backward()
        if i == 0 and first_grads is not None:  # a warm-up step: its syncs and copies are not timed
            first_loss = loss.item()
            first_grads.update({n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
                                if p.grad is not None})
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        elapsed = time.perf_counter() - start
        if i == 0:
            first_s = elapsed  # with "-compile": the step that compiles
        if i >= warmup:
            times.append(elapsed)
    s_per_step = statistics.median(times)
    out = {"config": name, "variant": variant, "latents": list(latents.shape),
           "tokens": int(latents.shape[2] * latents.shape[3] * latents.shape[4] // 4),
           "lora_rank": rank, "fp8_base": fp8, "blocks_to_swap": swap, "offload_activations": offload,
           "recompute": recompute,
           "gradient_checkpointing": True, "steps_timed": steps, **speed, "first_step_s": round(first_s, 2),
           "s_per_step": round(s_per_step, 4), "forward_tflops": round(forward_flops / 1e12, 3),
           "forward_attention_tflops": round(attention_flops / 1e12, 3), "step_tflops": round(step_flops / 1e12, 3),
           "trainable_params": sum(p.numel() for p in params), "final_loss": loss.item()}
    if peak_tflops:
        out["mfu"] = round(step_flops / s_per_step / (peak_tflops * 1e12), 4)
        out["peak_tflops"] = peak_tflops
    out["link_bytes_per_step"] = traffic["bytes"] / steps
    if bandwidth:
        copy_s = out["link_bytes_per_step"] / bandwidth
        out.update(copy_s_per_step=round(copy_s, 4), copy_fraction_of_step=round(copy_s / s_per_step, 4))
    if first_grads is not None:
        out["first_step_loss"] = first_loss
    out["memory_cap_gib"], out["context_gib"] = cap_gib, context_gib
    est = planned({"fp8": fp8, "swap": swap, "offload": offload, "storage": storage, "recompute": recompute},
                  shape, rank,
                  model_variant(variant, tiny))
    out["planned_allocated_gib"] = round(est.training_peak / 2**30, 2)
    out["planned_link_bytes_per_step"] = est.link_bytes
    if device.type == "cuda":
        out["peak_vram_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
        out["peak_vram_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 2)
        out["planned_vs_measured"] = round(out["planned_allocated_gib"] / out["peak_vram_gib"], 3)
    return out


def compare_first_steps(loss_a: float, grads_a: dict, loss_b: float, grads_b: dict) -> dict:
    """How far run b's first step is from run a's: the loss's relative difference, and the LoRA gradients' relative
    L2 distance (all tensors together) and the largest one tensor has; a tensor missing from either is counted."""
    names = sorted(set(grads_a) | set(grads_b))
    missing = [n for n in names if n not in grads_a or n not in grads_b]
    diff = sum(float((grads_a[n] - grads_b[n]).pow(2).sum()) for n in names if n not in missing)
    norm = sum(float(grads_a[n].pow(2).sum()) for n in names if n not in missing)
    worst = max((float((grads_a[n] - grads_b[n]).norm() / grads_a[n].norm().clamp_min(1e-30))
                 for n in names if n not in missing), default=0.0)
    return {"loss_rel_diff": abs(loss_b - loss_a) / max(abs(loss_a), 1e-30),
            "grad_rel_l2": (diff / max(norm, 1e-30)) ** 0.5, "grad_worst_tensor_rel_l2": worst,
            "tensors": len(names), "missing": len(missing)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--settings", help="comma-separated setting names (default: all; see the docstring)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 TFLOP/s (default: from a table)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny-t2v twin, tiny shapes, on the CPU (checks that the script runs)")
    parser.add_argument("--variant", default="t2v-a14b", choices=("t2v-a14b", "i2v-a14b", "ti2v-5b", "vace-t2v-a14b"))
    parser.add_argument("--size", default="832x480x81", help="video WIDTHxHEIGHTxFRAMES (default 832x480x81)")
    parser.add_argument("--cap-gib", type=float, help="emulate a card of this many GiB for every setting but plain "
                        "bf16 (torch.cuda.set_per_process_memory_fraction), e.g. 24 for a 4090")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else args.device)
    peak = args.peak_tflops
    info = {"device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        gpu = torch.cuda.get_device_name(device)
        info["gpu"] = gpu
        peak = peak or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    table = settings_table(args.smoke)
    wanted = args.settings.split(",") if args.settings else list(table)
    blocks = VARIANTS[model_variant(args.variant, args.smoke)].all_blocks  # VACE: its VACE blocks too
    for w in wanted:
        setting = table.get(w) or parse_setting(split_speed(w)[0], blocks)
        if setting is None:
            parser.error(f"unknown setting {w!r}; use bf16|fp8|fp8_scaled|int8|nf4[-swapN][-offload][-lean] with N <= "
                         f"{blocks} (fp8_scaled, int8, nf4: no swap), e.g. "
                         f"{', '.join(table)}")
        table[w] = setting
    bandwidth = link_bandwidth(device, 1 << 20 if args.smoke else 1 << 30)
    info["link_bytes_per_s"] = round(bandwidth)
    try:
        width, height, frames = (int(v) for v in args.size.lower().split("x"))
    except ValueError:
        parser.error(f"--size {args.size!r}: use WIDTHxHEIGHTxFRAMES, e.g. 832x480x81")
    shape = (64, 64, 9) if args.smoke else (height, width, frames)
    results = []
    plain_grads: dict = {}
    for name in wanted:
        grads: dict = {}
        results.append(run_config(name, device, tiny=args.smoke, shape=shape, rank=args.rank if not args.smoke else 4,
                                  steps=args.steps if not args.smoke else 1, warmup=args.warmup if not args.smoke
                                  else 1, peak_tflops=peak, bandwidth=bandwidth, variant=args.variant,
                                  cap_gib=None if name == "bf16" else args.cap_gib, first_grads=grads, **table[name]))
        if name == "bf16":
            plain_grads, plain_loss = grads, results[-1]["first_step_loss"]
        elif plain_grads and name.startswith("bf16-"):  # the same weights and inputs, only placed differently
            results[-1]["same_as_bf16"] = compare_first_steps(plain_loss, plain_grads,
                                                              results[-1]["first_step_loss"], grads)
        del grads
        print(json.dumps(results[-1]), file=sys.stderr, flush=True)  # progress, in case the run is cut short
        gc.collect()  # the swap's hooks hold the model in reference cycles: free it before the next setting
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base = next((r for r in results if r["config"] == "bf16"), None)
    if base is not None:
        for r in results:
            r["s_per_step_vs_bf16"] = round(r["s_per_step"] / base["s_per_step"], 3)
    print(json.dumps({**info, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
