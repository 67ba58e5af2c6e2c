"""Peak device memory of one LoRA training step of a real-size Wan 2.2 expert, traced on a CPU with fake tensors.

The expert is built on ``meta`` with the variant's real architecture (A14B: 40 blocks, width 5120), its parameters
re-created as fake tensors (``torch._subclasses.fake_tensor.FakeTensorMode``: shapes, dtypes and devices, no
memory) in the dtypes a run gives them (base in bf16, float8_e4m3fn with diffusers' layerwise casting or scaled
fp8 with its per-row scales, the ``_keep_in_fp32_modules`` in fp32, the rank-r LoRA in fp32), with wantrain's block
swap (a VACE variant's VACE blocks counted before its main blocks, as a run swaps them) and activation offload when
asked. One step (forward with gradient checkpointing, the flow-matching MSE, backward, AdamW with its state)
runs under a dispatch mode that counts the bytes of every live storage on the device: the peak is what the
tensors need, the quantity ``torch.cuda.max_memory_allocated`` reports, and what the planner's estimate
(``wantrain.models.wan22.memory``, what ``wantrain check`` prints) is checked against. With ``--flops`` the step
runs a second time under ``torch.utils.flop_counter.FlopCounterMode`` (``tflops``: the matmuls and attention of the
forward, the recompute and the backward, counted from the shapes; apart, because the counter changes what lives
when).

Choices that differ from a GPU:

* the "device" is a fake CPU (this torch has no CUDA, and fake CUDA tensors fail in indexing), and the host side of
  the swap and of the offload is ``meta`` (not counted);
* peft's LoHa and LoKr layers are put in eval mode: in training mode they draw ``torch.rand(1) > module_dropout``
  on the host on every forward, which a fake tensor cannot answer (with ``lora.dropout = 0`` the path is the same);
* attention is the CPU flash kernel's (output + logsumexp, as the CUDA flash/cuDNN kernels); the math kernel
  would materialise the score matrix;
* diffusers' layerwise-casting hook (fp8) casts with new Parameter objects instead of ``Module.to`` (which cannot
  convert fake parameters in place): the same bytes live at the same times;
* no allocator rounding or fragmentation (MemTracker rounds to 512 B; the caching allocator's reserved memory is
  more), no CUDA context, cuBLAS workspace or NCCL buffers.

    python bench/trace_memory.py                           # the table of docs/benchmarks.md (markdown + JSON)
    python bench/trace_memory.py --variant t2v-a14b --dtype fp8 --swap 20 --offload --size 832x480x81
    python bench/trace_memory.py --json out.json
    python bench/trace_memory.py --variant vace-t2v-a14b --dtype fp8_scaled --swap 44 --offload --size 832x480x81 \
        --recompute lean                                   # VACE: 4 of its 8 VACE blocks swapped too
    python bench/trace_memory.py --lora-type all --layers 2 --dtype bf16 --swap 0 --offload --size 832x480x81
                                                           # a row per adapter type (lora.type)
    python bench/trace_memory.py --recompute all --layers 2 --dtype bf16 --swap 0 --offload --flops
                                                           # a row per recompute path (model.recompute)
    python bench/trace_memory.py --sampling                # the sampling table (a no-grad denoising step with
                                                           # guidance, then the VAE decode)
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
import weakref
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode

from wantrain.models.wan22.architecture import transformer_kwargs
from wantrain.models.wan22.export import ADAPTER_NAME
from wantrain.models.wan22.fp8 import to_scaled_fp8
from wantrain.models.wan22.offload import ActivationOffload
from wantrain.models.wan22.recompute import use_recompute
from wantrain.models.wan22.swap import BlockSwap, swapped_blocks
from wantrain.models.wan22.variants import VARIANTS

DEVICE = torch.device("cpu")  # the fake device
HOST = torch.device("meta")  # the host side: not counted


def _cpu_flash_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_flop_count(query, key, value)


def _cpu_flash_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)


# FlopCounterMode counts the CUDA attention kernels only; the CPU flash kernel the trace runs does the same work
# (its formulas take the shapes, [batch, heads, tokens, head_dim]).
CPU_ATTENTION_FLOPS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
                       torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
                           _cpu_flash_backward_flops}


class LiveBytes(TorchDispatchMode):
    """Bytes of the live storages on ``device_type`` created by ops under this mode (plus those ``track`` is given);
    ``peak`` is the maximum over the ops. Storages are followed by weak references, so a tensor freed by Python or
    autograd leaves the count when it goes."""

    def __init__(self, device_type: str) -> None:
        super().__init__()
        self.device_type = device_type
        self.live = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def track(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        storage = tensor.untyped_storage()
        key = id(storage)
        ref = self._refs.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()
        self.live += nbytes
        self.peak = max(self.peak, self.live)

        def gone(_ref, nbytes=nbytes, key=key):
            self.live -= nbytes
            self._refs.pop(key, None)

        self._refs[key] = weakref.ref(storage, gone)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            self.track(tensor)
        return out


def _cast_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module.to(dtype=...)`` for fake parameters (``Module._apply`` swaps fake tensors in place, which fails once
    the fake mode's cache holds a weak reference to them): new Parameter objects of the same bytes."""
    for key, param in list(module._parameters.items()):
        if param is not None and param.is_floating_point() and param.dtype != dtype:
            module._parameters[key] = torch.nn.Parameter(param.detach().to(dtype), requires_grad=param.requires_grad)


@contextlib.contextmanager
def fake_layerwise_casting():
    """diffusers' layerwise-casting hook, with its casts done by :func:`_cast_module` (same storages alive)."""
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    saved = LayerwiseCastingHook.pre_forward, LayerwiseCastingHook.post_forward

    def pre_forward(self, module, *args, **kwargs):
        _cast_module(module, self.compute_dtype)
        return args, kwargs

    def post_forward(self, module, output):
        _cast_module(module, self.storage_dtype)
        return output

    LayerwiseCastingHook.pre_forward, LayerwiseCastingHook.post_forward = pre_forward, post_forward
    try:
        yield
    finally:
        LayerwiseCastingHook.pre_forward, LayerwiseCastingHook.post_forward = saved


def parse_size(text: str) -> tuple[int, int, int]:
    width, height, frames = (int(v) for v in text.lower().split("x"))
    return width, height, frames


def build_fake_expert(variant: str, dtype: str, rank: int, fake: FakeTensorMode, layers: int | None = None,
                      lora_type: str = "lora", recompute: str = "block", peft_forward: bool = False):
    """The expert as a run holds it, with fake tensors on :data:`DEVICE` (``layers``: fewer blocks), its adapter of
    ``lora_type`` built by peft as a run builds it (``adapter_types.py``, the config's defaults otherwise) with the
    run's forwards (``adapter_forward.py``), or with peft's own when ``peft_forward``, its blocks recomputed as
    ``recompute`` says (``model.recompute``: ``recompute.py``)."""
    from wantrain.models.wan22.adapter_types import adapter_type, candidate_modules
    from wantrain.models.wan22.architecture import transformer_class
    from wantrain.models.wan22.config import LoraConfig

    spec = VARIANTS[variant]
    with torch.device("meta"):
        kwargs = transformer_kwargs(spec)
        if layers is not None:
            kwargs["num_layers"] = layers
            if spec.vace:  # VACE: hints after the first `layers` main blocks, as many VACE blocks
                kwargs["vace_layers"] = [k for k in kwargs["vace_layers"] if k < layers]
        model = transformer_class(spec)(**kwargs)
        model.requires_grad_(False)
        model.to(torch.bfloat16)
        if dtype == "fp8":
            model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        elif dtype == "fp8_scaled":  # float8 weights, per-row float32 scales (a buffer), bf16 biases
            to_scaled_fp8(model)
        elif dtype in ("int8", "nf4"):  # bitsandbytes codes + absmax (lowbit.py), dequantised in each forward
            from wantrain.models.wan22.lowbit import to_low_bit

            to_low_bit(model, dtype)
        model.enable_gradient_checkpointing()
        targets = candidate_modules(len(model.blocks), len(getattr(model, "vace_blocks", ())))
        model.add_adapter(adapter_type(lora_type).peft_config(LoraConfig(type=lora_type, rank=rank), targets),
                          adapter_name=ADAPTER_NAME)
        use_recompute(model, recompute)
    keep = set(model._keep_in_fp32_modules or ())
    if dtype in ("int8", "nf4"):  # the codebook the dequantisation reads: a real tensor, made outside the fake mode
        from wantrain.models.wan22.lowbit import _code

        _code(dtype, DEVICE)
    with fake:
        for name, module in model.named_modules():
            lora = f".{ADAPTER_NAME}" in f".{name}" or name.split(".")[-1] == ADAPTER_NAME
            for key, param in list(module._parameters.items()):
                if param is None:
                    continue
                is_lora = lora or key == ADAPTER_NAME or f".{ADAPTER_NAME}." in f".{name}.{key}"
                target = torch.float32 if is_lora or keep.intersection(name.split(".")) else param.dtype
                module._parameters[key] = torch.nn.Parameter(
                    torch.empty(param.shape, dtype=target, device=DEVICE), requires_grad=is_lora)
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device=DEVICE)
    model.train()
    from peft.tuners.lycoris_utils import LycorisLayer

    for module in model.modules():  # LoHa / LoKr draw ``torch.rand(1) > module_dropout`` per forward in training
        if isinstance(module, LycorisLayer):  # mode, which a fake tensor cannot answer; with dropout 0 the same
            module.training = False  # path runs in eval mode
    if not peft_forward:
        from wantrain.models.wan22 import adapter_forward

        adapter_forward.install(model)
    return model


def fake_block_swap(model: torch.nn.Module, swap: int, on_copy=None) -> BlockSwap:
    """wantrain's block swap of the last ``swap`` blocks in run order (``swap.swapped_blocks``: a VACE model's VACE
    blocks count before its main blocks), their frozen parameters and buffers (fp8_scaled's scales) first moved to
    the uncounted host device (the host copies)."""
    blocks, swapped = swapped_blocks(model, swap)
    for k in swapped:
        for module in blocks[k].modules():
            for key, param in list(module._parameters.items()):
                if param is not None and not param.requires_grad:
                    module._parameters[key] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=HOST), requires_grad=False)
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device=HOST)
    return BlockSwap(model, blocks, swapped, DEVICE, ring=2, on_copy=on_copy)


def trace(variant: str = "t2v-a14b", dtype: str = "bf16", swap: int = 0, offload: bool = False,
          size: tuple[int, int, int] = (832, 480, 81), rank: int = 32, batch: int = 1,
          layers: int | None = None, lora_type: str = "lora", count_flops: bool = False,
          recompute: str = "block", peft_forward: bool = False) -> dict:
    """Peak live device bytes of one training step of ``variant`` (one expert), in GiB, with the parts at rest;
    with ``count_flops`` its FLOPs instead (``tflops``; the bytes of that trace are not the step's)."""
    spec = VARIANTS[variant]
    width, height, frames = size
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    start = time.perf_counter()
    with fake_layerwise_casting():  # the hooks keep the methods they find when registered
        model = build_fake_expert(variant, dtype, rank, fake, layers, lora_type, recompute, peft_forward)
    blocks = model.blocks
    copies: list[int] = []
    with fake:
        if swap:
            fake_block_swap(model, swap, on_copy=copies.append)
        lora = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(lora, lr=1e-4, foreach=True)
        for p in lora:  # steady state: AdamW's moments exist before the step
            optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
        counter = LiveBytes(DEVICE.type)
        for tensor in [*model.parameters(), *model.buffers()]:
            counter.track(tensor)
        for state in optimizer.state.values():
            for tensor in state.values():
                counter.track(tensor)
        at_rest = counter.live
        offloaded: list[int] = []  # bytes of every tensor the offload sends to the host
        offloader = ActivationOffload(DEVICE, HOST, on_pack=offloaded.append) if offload else None
        frames_latent = (frames - 1) // spec.frame_multiple + 1
        stride = spec.spatial_multiple // 2  # the VAE's (the patch is 2x2)
        shape = (batch, spec.transformer_in_channels, frames_latent, height // stride, width // stride)
        # FLOPs in a trace of their own: FlopCounterMode changes what lives when (+0.24 GiB on one A14B block)
        flops = FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) if count_flops else None
        with counter, flops or contextlib.nullcontext():
            x0 = torch.empty(shape, dtype=torch.float32, device=DEVICE)
            text = torch.empty(batch, spec.text_len, 4096, dtype=torch.bfloat16, device=DEVICE)
            timestep = torch.full((batch,), 500.0, device=DEVICE)
            target = torch.empty(x0.shape[0], spec.latent_channels, *x0.shape[2:], device=DEVICE)
            control = {}  # VACE: the control context at the latent size (models/wan22/control.py)
            if spec.vace:
                control["control_hidden_states"] = torch.empty(batch, spec.vace_in_channels, *shape[2:],
                                                               dtype=torch.bfloat16, device=DEVICE)
            with offloader.active() if offloader else contextlib.nullcontext():
                pred = model(hidden_states=x0.to(torch.bfloat16), timestep=timestep, encoder_hidden_states=text,
                             return_dict=False, **control)[0].to(torch.float32)
            loss = ((pred - target) ** 2).mean()
            del pred
            loss.backward()
            del loss
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    tokens = batch * frames_latent * (height // spec.spatial_multiple) * (width // spec.spatial_multiple)
    return {"variant": variant, "dtype": dtype, "swap": swap, "offload": offload,
            "size": f"{width}x{height}x{frames}", "rank": rank, "lora_type": lora_type, "batch": batch,
            "recompute": recompute, "layers": len(blocks), "tokens": tokens,
            "adapter_params": sum(p.numel() for p in lora),
            "at_rest_gib": at_rest / 2**30, "peak_gib": counter.peak / 2**30,
            "tflops": flops.get_total_flops() / 1e12 if flops else None,
            "seconds": round(time.perf_counter() - start, 1), "block_copies": len(copies),
            "offloaded_bytes": offloaded}


def build_fake_vae(variant: str, fake: FakeTensorMode):
    """The variant's VAE in fp32 (as the sample observer loads it), with fake tensors on :data:`DEVICE`."""
    from diffusers import AutoencoderKLWan

    from wantrain.models.wan22.architecture import _TINY_VAE
    from wantrain.models.wan22.memory import REAL_VAE

    spec = VARIANTS[variant]
    with torch.device("meta"):
        vae = AutoencoderKLWan(**(_TINY_VAE[spec.vae] if spec.tiny else REAL_VAE[spec.vae]))
    with fake:
        for module in vae.modules():
            for key, param in list(module._parameters.items()):
                if param is not None:
                    module._parameters[key] = torch.nn.Parameter(
                        torch.empty(param.shape, dtype=torch.float32, device=DEVICE), requires_grad=False)
            for key, buffer in list(module._buffers.items()):
                if buffer is not None:
                    module._buffers[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device=DEVICE)
    return vae.eval()


def trace_sampling(variant: str = "t2v-a14b", dtype: str = "bf16", swap: int = 0,
                   size: tuple[int, int, int] = (832, 480, 81), rank: int = 32, guidance: bool = True,
                   layers: int | None = None) -> dict:
    """Peak live device bytes (GiB) of sampling one video as the sample observer does (diffusers' Wan pipeline):
    the expert with its LoRA and the optimizer's moments (no gradients: they are freed after each step), the VAE in
    fp32; one denoising step (no autograd; with ``guidance`` the conditional and the unconditional pass one after
    the other, as the pipeline runs them, and their combination), then the VAE decode of the latents and the
    pipeline's scaling of the frames. ``denoise_gib`` and ``decode_gib`` are the two phases' peaks."""
    spec = VARIANTS[variant]
    width, height, frames = size
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    start = time.perf_counter()
    with fake_layerwise_casting():
        model = build_fake_expert(variant, dtype, rank, fake, layers)
    model.eval()
    vae = build_fake_vae(variant, fake)
    blocks = model.blocks
    with fake:
        if swap:
            fake_block_swap(model, swap)
        counter = LiveBytes(DEVICE.type)
        for tensor in [*model.parameters(), *model.buffers(), *vae.parameters(), *vae.buffers()]:
            counter.track(tensor)
        moments = [torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(2)]
        for tensor in moments:
            counter.track(tensor)
        at_rest = counter.live
        frames_latent = (frames - 1) // spec.frame_multiple + 1
        stride = spec.spatial_multiple // 2
        shape = (1, spec.latent_channels, frames_latent, height // stride, width // stride)
        with torch.no_grad(), counter:
            latents = torch.empty(shape, dtype=torch.float32, device=DEVICE)
            text = torch.empty(1, spec.text_len, 4096, dtype=torch.bfloat16, device=DEVICE)
            negative = torch.empty(1, spec.text_len, 4096, dtype=torch.bfloat16, device=DEVICE)
            timestep = torch.full((1,), 500.0, device=DEVICE)
            extra = shape[1:] if spec.transformer_in_channels == spec.latent_channels else None
            latent_in = latents.to(torch.bfloat16)
            if extra is None:  # I2V: the image condition concatenated on the channels
                cond_shape = (1, spec.transformer_in_channels - spec.latent_channels, *shape[2:])
                latent_in = torch.cat([latent_in, torch.empty(cond_shape, dtype=torch.bfloat16)], dim=1)
            pred = model(hidden_states=latent_in, timestep=timestep, encoder_hidden_states=text, return_dict=False)[0]
            if guidance:
                uncond = model(hidden_states=latent_in, timestep=timestep, encoder_hidden_states=negative,
                               return_dict=False)[0]
                pred = uncond + 5.0 * (pred - uncond)
                del uncond
            latents = latents - 0.05 * pred.float()  # the scheduler's step
            del pred, latent_in, text, negative
            denoise = counter.peak
            counter.peak = counter.live
            video = vae.decode(latents, return_dict=False)[0]
            video = (video / 2 + 0.5).clamp(0, 1)  # the video processor, before the frames go to the host
            del video
            decode = counter.peak
    return {"variant": variant, "dtype": dtype, "swap": swap, "size": f"{width}x{height}x{frames}", "rank": rank,
            "guidance": guidance, "layers": len(blocks), "at_rest_gib": at_rest / 2**30,
            "denoise_gib": denoise / 2**30, "decode_gib": decode / 2**30, "peak_gib": max(denoise, decode) / 2**30,
            "seconds": round(time.perf_counter() - start, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="t2v-a14b", choices=sorted(VARIANTS))
    parser.add_argument("--dtype", choices=("bf16", "fp8", "fp8_scaled", "int8", "nf4"))
    parser.add_argument("--swap", type=int)
    parser.add_argument("--offload", action="store_true", default=None)
    parser.add_argument("--size", type=parse_size, help="WIDTHxHEIGHTxFRAMES")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--lora-type", choices=("lora", "loha", "lokr", "dora", "all"), default="lora",
                        help="the adapter type (lora.type; 'all': one row per type)")
    parser.add_argument("--recompute", choices=("block", "lean", "all"), default="block",
                        help="model.recompute ('all': a row per path)")
    parser.add_argument("--layers", type=int, help="fewer blocks than the variant has (a quick check)")
    parser.add_argument("--peft-forward", action="store_true",
                        help="peft's own LoKr/LoHa/DoRA forwards instead of the run's (adapter_forward.py)")
    parser.add_argument("--flops", action="store_true", help="also count the step's FLOPs (a second trace)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sampling", action="store_true", help="trace sampling instead of a training step")
    args = parser.parse_args(argv)
    dtypes = [args.dtype] if args.dtype else ["bf16", "fp8"]
    swaps = [args.swap] if args.swap is not None else [0, 20, 38]
    offloads = [args.offload] if args.offload is not None else [False, True]
    sizes = [args.size] if args.size else [(832, 480, 81), (1280, 720, 81)]
    rows = []
    if args.sampling:
        for size, dtype, swap in itertools.product(sizes, dtypes, swaps):
            row = trace_sampling(args.variant, dtype, swap, size, args.rank, layers=args.layers)
            row.update(compare_sampling(row))
            rows.append(row)
            print(json.dumps(row), flush=True)
        print(markdown_sampling(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return 0
    types = ["lora", "loha", "lokr", "dora"] if args.lora_type == "all" else [args.lora_type]
    paths = ["block", "lean"] if args.recompute == "all" else [args.recompute]
    for size, dtype, swap, offload, lora_type, path in itertools.product(sizes, dtypes, swaps, offloads, types,
                                                                         paths):
        if lora_type == "dora" and dtype == "fp8":
            continue  # refused by the config: peft's DoRA reads the base weights outside their forward
        row = trace(args.variant, dtype, swap, offload, size, args.rank, layers=args.layers, lora_type=lora_type,
                    recompute=path, peft_forward=args.peft_forward)
        if args.flops:
            row["tflops"] = trace(args.variant, dtype, swap, offload, size, args.rank, layers=args.layers,
                                  lora_type=lora_type, count_flops=True, recompute=path,
                                  peft_forward=args.peft_forward)["tflops"]
        row.update(compare(row))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(markdown(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


def compare(row: dict) -> dict:
    """The planner's estimate of the same configuration and its error against the trace."""
    from wantrain.models.wan22.memory import GIB, AdapterSpec, MemorySettings, estimate

    width, height, frames = parse_size(row["size"])
    est = estimate(row["variant"], MemorySettings(row["dtype"], row["swap"], row["offload"], row["recompute"]),
                   width=width,
                   height=height, frames=frames, rank=row["rank"], batch=row["batch"],
                   layers=row["layers"] if row["layers"] != VARIANTS[row["variant"]].num_layers else None,
                   adapter=AdapterSpec(row["lora_type"]))
    return {"estimate_gib": est.allocated / GIB, "error_pct": 100 * (est.allocated / GIB / row["peak_gib"] - 1)}


def compare_sampling(row: dict) -> dict:
    """The planner's sampling estimate of the same configuration and its error against the trace."""
    from wantrain.models.wan22.memory import GIB, MemorySettings, SampleSize, estimate

    width, height, frames = parse_size(row["size"])
    est = estimate(row["variant"], MemorySettings(row["dtype"], row["swap"]), width=width, height=height,
                   frames=frames, rank=row["rank"], sample=SampleSize(width, height, frames, row["guidance"]),
                   layers=row["layers"] if row["layers"] != VARIANTS[row["variant"]].num_layers else None)
    return {"estimate_gib": est.sampling_allocated / GIB,
            "error_pct": 100 * (est.sampling_allocated / GIB / row["peak_gib"] - 1)}


def markdown_sampling(rows: list[dict]) -> str:
    lines = ["| size | base | swapped | traced denoise GiB | traced decode GiB | traced peak GiB | estimate GiB "
             "| error |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['dtype']} | {r['swap']} | {r['denoise_gib']:.2f} | {r['decode_gib']:.2f} | "
                     f"{r['peak_gib']:.2f} | {r['estimate_gib']:.2f} | {r['error_pct']:+.1f} % |")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    lines = ["| size | adapter | base | swapped | offload | recompute | traced peak GiB | estimate GiB | error | TFLOP "
             "| trace s |",
             "|---|---|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['lora_type']} | {r['dtype']} | {r['swap']} | "
                     f"{'on' if r['offload'] else 'off'} | {r['recompute']} | {r['peak_gib']:.2f} | "
                     f"{r['estimate_gib']:.2f} | {r['error_pct']:+.1f} % | {r['tflops'] or 0:.1f} | {r['seconds']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
