"""The attention kernel of the transformers (``model.attention``), through diffusers' attention dispatcher.

Each kernel name maps to one backend of ``diffusers.models.attention_dispatch`` (``set_attention_backend`` on the
transformer: every ``WanAttention`` processor then calls that backend); wantrain writes no kernel glue of its own.

=========  ==================  ===========================================================================
key        diffusers backend   needs
=========  ==================  ===========================================================================
sdpa       ``native``          nothing: ``torch.nn.functional.scaled_dot_product_attention``, which picks
                               its own kernel (flash, memory-efficient, cuDNN or math) per call
flash      ``flash``           the ``flash-attn`` package (2.x), a CUDA device, bf16 compute
xformers   ``xformers``        the ``xformers`` package, a CUDA device
sage       (refused)           SageAttention has no backward pass: the config refuses it for training
=========  ==================  ===========================================================================

flash-attn 3 is not offered: diffusers' FA3 backend (``_flash_3``, 0.42) registers no backward, so it cannot train.
:func:`check_kernel` is what ``wantrain check`` and the run call before anything loads: a missing package or a
device the kernel cannot run on is one line naming ``model.attention``.
"""

from __future__ import annotations

import importlib.util
import logging

import attrs
import torch
from torch import nn

from wantrain.core.errors import UserError
from wantrain.core.problems import Problem, Rule, refuse


@attrs.frozen
class Kernel:
    name: str  # the model.attention value
    backend: str  # diffusers' AttentionBackendName value
    package: str | None  # the importable module it needs (None: torch's own)
    install: str | None  # what to pip install
    cuda_only: bool
    describe: str


KERNELS: dict[str, Kernel] = {
    "sdpa": Kernel("sdpa", "native", None, None, False,
                   "PyTorch scaled_dot_product_attention, which picks flash, memory-efficient or math itself"),
    "flash": Kernel("flash", "flash", "flash_attn", "flash-attn", True, "flash-attn 2 (flash_attn_func)"),
    "xformers": Kernel("xformers", "xformers", "xformers", "xformers", True,
                       "xformers memory_efficient_attention"),
}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


KERNEL_RULES = (
    KERNEL_PACKAGE := Rule("attention-kernel-package", ("model.attention",), "a kernel whose package is missing"),
    KERNEL_CUDA_ONLY := Rule("attention-kernel-cuda-only", ("model.attention", "train.device"),
                             "a CUDA-only kernel on another device", ("model.attention = flash / xformers",
                                                                      "train.device = cpu")),
    FLASH_DTYPE := Rule("flash-dtype", ("model.attention", "model.base_dtype"), "flash attention computing in fp32",
                        ("model.attention = flash", "model.base_dtype = fp32")),
)


def kernel_problems(name: str, device: torch.device, compute_dtype: torch.dtype | None = None) -> list[Problem]:
    """What keeps ``model.attention = name`` from running on ``device``: its package missing, the device unable to
    run it, or (``compute_dtype`` given) a dtype it cannot compute in."""
    kernel = KERNELS.get(name)
    if kernel is None:  # the config's choices and its 'sage' rule let no other name through: a bug
        raise ValueError(f"model.attention = {name!r} is no kernel ({', '.join(KERNELS)})")
    out = []
    if kernel.package is not None and not _importable(kernel.package):
        out.append(KERNEL_PACKAGE.problem(f"model.attention = {name!r} needs the {kernel.install!r} package, which "
                                          f"is not installed; pip install {kernel.install}, or use model.attention "
                                          "= 'sdpa'"))
    if kernel.cuda_only and torch.device(device).type != "cuda":
        out.append(KERNEL_CUDA_ONLY.problem(f"model.attention = {name!r} runs on CUDA only (training device is "
                                            f"{torch.device(device).type}); use model.attention = 'sdpa'"))
    if name == "flash" and compute_dtype is not None and compute_dtype not in (torch.bfloat16, torch.float16):
        out.append(FLASH_DTYPE.problem(f"model.attention = 'flash' computes in bf16 or fp16 only (this run computes "
                                       f"in {str(compute_dtype)[6:]}); set model.base_dtype = 'bf16' or use "
                                       "model.attention = 'sdpa'"))
    return out


def check_kernel(name: str, device: torch.device, compute_dtype: torch.dtype | None = None) -> Kernel:
    """The kernel ``model.attention = name`` runs on ``device``; the problems of :func:`kernel_problems` refused
    (one line each)."""
    refuse(kernel_problems(name, device, compute_dtype))
    return KERNELS[name]


def use_kernel(transformer: nn.Module, kernel: Kernel) -> None:
    """Make every attention of ``transformer`` call ``kernel``. Set explicitly for ``sdpa`` too: a processor
    without a backend follows diffusers' process-wide active one, which the last ``set_attention_backend`` chose."""
    logger = logging.getLogger("diffusers.models.modeling_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)  # "Attention backends are an experimental feature": said once in the docs instead
    try:
        transformer.set_attention_backend(kernel.backend)
    except (RuntimeError, ValueError) as exc:  # diffusers' own requirement check (a package too old)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"model.attention = {kernel.name!r} cannot be used: {first[:200]}; use "
                        "model.attention = 'sdpa'") from None
    finally:
        logger.setLevel(level)


def kernel_in_use(transformer: nn.Module) -> str:
    """The diffusers backend the transformer's attention processors call (``native`` when none is set)."""
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_attention_backend"):
            backend = processor._attention_backend
            return "native" if backend is None else str(getattr(backend, "value", backend))
    return "native"
