"""Regional compilation (``model.compile``): ``torch.compile`` of each transformer block's ``forward``, not the model.

What is compiled and what is not:

* Each block's ``forward`` is replaced by one compiled function (every block runs the same code, so the 40 blocks of
  an A14B expert share one graph per input signature). The module's ``__call__`` stays eager, so its forward
  pre-hooks -- block swap's load and prefetch (``swap.py``) -- run outside the compiled region, and so does
  gradient checkpointing (diffusers calls ``checkpoint(block, ...)`` around the block: the recompute runs the same
  compiled forward). Activation offload's ``saved_tensors_hooks`` are entered around the whole transformer, outside.
* Patch embedding, time/text embedders, the output head and the loss stay eager: they are a few percent of the step.
* Parameters are graph inputs (dynamo's inlined ``nn.Module`` handling), so swapped blocks' fresh ``Parameter``
  objects and the moves of the expert placement do not recompile.
* LoRA's scale (alpha / rank) would be a Python float that dynamo specializes on: every alpha change (the alpha
  schedule, the alpha controller) would recompile. :func:`tensor_scaling` makes it a 0-dim float32 CPU tensor that
  ``AdapterType.set_alpha`` fills in place: one graph for every alpha, and reading it back (``float``) never syncs a
  device.

Shapes: ``dynamic`` None compiles static shapes and, when a second token count shows up (a second bucket), one
graph with a dynamic token dimension (torch's automatic dynamic shapes): at most two compiles per grad mode whatever
the number of buckets. True compiles dynamic from the start, False one graph per bucket shape.

Recompiles and graph breaks are dynamo's counters (:func:`compile_counts`); ``bench/bench_compile.py`` and the
tests read them. The compile cache (inductor's FX graph and AOTAutograd caches, Triton's kernels) lives in the
folder :func:`use_cache_dir` names, so a second run or a resume of the same shapes loads its kernels instead of
compiling them again.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import torch
from torch import nn

from wantrain.core.errors import UserError
from wantrain.core.problems import Problem, Rule, refuse

# dynamo's per-function graph limit (8 by default): grad on/off (training, validation), block 0's input without
# grad, static then dynamic shapes, the i2v/t2v forms, ... stay well under it; past it torch falls back to eager.
RECOMPILE_LIMIT = 64
BACKEND = "inductor"  # tests use "aot_eager" (dynamo and AOTAutograd without inductor's code generation)
CACHE_ENV = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@attrs.frozen
class CompilePlan:
    """What ``model.compile`` does to each expert (``wantrain check`` prints :meth:`lines`)."""

    mode: str  # "off", "default", "max-autotune-no-cudagraphs"
    dynamic: bool | None
    blocks: int
    cache_dir: Path | None = None

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def lines(self) -> list[str]:
        if not self.enabled:
            return ["compile: off (model.compile = 'off'; every block runs eagerly)"]
        shapes = {None: "static, then a dynamic token dimension from the second bucket shape on",
                  True: "dynamic token dimension (one graph for every bucket)",
                  False: "static (one compile per bucket shape)"}[self.dynamic]
        return [f"compile: torch.compile mode {self.mode!r} of each of the {self.blocks} transformer blocks per "
                "expert (one shared graph); embedders, head and loss eager",
                f"  shapes: {shapes}",
                "  outside the compiled region: block swap's copies, activation offload, gradient checkpointing",
                f"  cache: {self.cache_dir if self.cache_dir is not None else 'torch default (per user temp folder)'}",
                "  the first step of each expert (and of each new bucket shape) compiles: slower than the rest"]

    def to_json(self) -> dict:
        return {"mode": self.mode, "dynamic": self.dynamic, "blocks": self.blocks,
                "cache_dir": None if self.cache_dir is None else str(self.cache_dir)}


def use_cache_dir(folder: Path | None) -> Path | None:
    """Point inductor's and Triton's caches into ``folder`` (created) unless the user's environment already names
    them; returns the folder inductor uses. Call before the first compile."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    # inductor writes its default into the environment the first time it asks: that one is not the user's choice
    users = given is not None and os.path.abspath(given) != os.path.abspath(default_cache_dir())
    if folder is None:
        return Path(given) if users else None
    if not users:
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UserError(f"model.compile: cannot create the compile cache folder '{folder}' "
                            f"({exc.strerror or exc}); set data.cache_dir to a writable folder") from None
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
        if "TRITON_CACHE_DIR" not in os.environ:
            os.environ["TRITON_CACHE_DIR"] = str(folder / "triton")
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def tensor_scaling(transformer: nn.Module) -> None:
    """Turn each LoRA layer's ``scaling`` (alpha / rank, a float) into a 0-dim float32 CPU tensor, so that a compiled
    block takes it as an input instead of a constant (see the module docstring)."""
    from wantrain.models.wan22.export import ADAPTER_NAME

    for module in transformer.modules():
        scaling = getattr(module, "scaling", None)
        if isinstance(scaling, dict) and ADAPTER_NAME in scaling and not torch.is_tensor(scaling[ADAPTER_NAME]):
            scaling[ADAPTER_NAME] = torch.tensor(float(scaling[ADAPTER_NAME]), dtype=torch.float32)


def _without_module_dropout(layer: nn.Module):
    """peft's LoKr/LoHa ``forward`` for wantrain's adapters, without the module-dropout draw: peft draws
    ``torch.rand(1)`` from the global RNG at every call and branches on it (a graph break in every block), though the
    draw only matters with module dropout, which wantrain refuses for these types (``LoraConfig``). The rest is
    peft's forward as it is: the base layer, plus each active adapter's delta, cast back to the input dtype."""
    def forward(x, *args, **kwargs):
        if layer.disable_adapters or layer.merged:
            return type(layer).forward(layer, x, *args, **kwargs)
        result = layer.base_layer(x, *args, **kwargs)
        for adapter in layer.active_adapters:
            if adapter in layer._available_adapters:
                result = result + layer._get_delta_activations(adapter, x, *args, **kwargs)
        return result.to(x.dtype)
    return forward


def _traceable_peft() -> None:
    """Let dynamo trace peft's DoRA without a graph break: peft's ``dequantize_module_weight`` asks
    ``type(weight).__module__.startswith("torchao.")``, a string method on a class attribute that dynamo does not
    trace. In the graph it is replaced by the same function for the weights wantrain has (plain parameters, no
    HQQ/torchao/bitsandbytes quantization); eager calls keep peft's own."""
    from peft.utils import integrations

    original = integrations.dequantize_module_weight
    if getattr(original, "_wantrain_traceable", False):
        return

    @torch.compiler.substitute_in_graph(original, skip_signature_check=True)
    def plain_weight(module: nn.Module) -> torch.Tensor:
        return module.weight

    original._wantrain_traceable = True


def _cast_in_graph(layer: nn.Linear, dtype: torch.dtype):
    """The forward of a Linear that ``model.base_dtype = "fp8"`` stores in float8 (diffusers' layerwise casting),
    for a compiled block: the same computation -- weight and bias cast to the compute dtype, then ``F.linear`` --
    with the casts in the graph. Layerwise casting's hooks instead convert the module's parameters in place before
    and after each call (``module.to``), a mutation of module state that the compiled graph does not replay: the
    gradient checkpointing recompute then saves the float8 weight where the forward saved its bf16 copy, and the
    backward fails. The stored parameters stay float8 either way."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.to(dtype)
        return torch.nn.functional.linear(x, layer.weight.to(dtype), bias)
    return forward


def _layerwise_casting(module: nn.Module):
    registry = getattr(module, "_diffusers_hook", None)
    return None if registry is None else registry.get_hook("layerwise_casting")


def compile_blocks(transformer: nn.Module, mode: str, dynamic: bool | None) -> int:
    """Compile the ``forward`` of each of ``transformer.blocks`` (one compiled function shared by all blocks) and,
    in a VACE variant, of each of its ``vace_blocks`` (one function of their own); returns how many blocks.
    Compilation itself happens on the first call; a compiler failure then is a ``UserError`` naming
    ``model.compile`` (:func:`_one_line`), not inductor's traceback."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit,
                                                           RECOMPILE_LIMIT * 4)
    tensor_scaling(transformer)
    _traceable_peft()
    stacks = [list(transformer.blocks), list(getattr(transformer, "vace_blocks", ()))]
    for module in (m for blocks in stacks for block in blocks for m in block.modules()):
        dropout = getattr(module, "module_dropout", None)
        if isinstance(dropout, dict) and hasattr(module, "_get_delta_activations"):  # peft's LyCORIS layers
            if any(dropout.values()):
                raise UserError("model.compile cannot trace LyCORIS module dropout (a random branch per call); "
                                "remove it or set model.compile = 'off'")
            module.forward = _without_module_dropout(module)
        casting = _layerwise_casting(module)
        if casting is not None:  # model.base_dtype = "fp8": only the blocks' Linears are cast (ModelMixin's rule)
            if type(module) is not nn.Linear:
                raise UserError(f"model.compile cannot trace diffusers' layerwise casting of a "
                                f"{type(module).__name__} (model.base_dtype = 'fp8'); use model.base_dtype = "
                                "'fp8_scaled' or model.compile = 'off'")
            module.forward = _cast_in_graph(module, casting.compute_dtype)
    options = {"mode": None if mode == "default" else mode} if BACKEND == "inductor" else {}

    def bound(compiled, block: nn.Module):
        def forward(*args, **kwargs):
            try:
                return compiled(block, *args, **kwargs)
            except torch._dynamo.exc.BackendCompilerFailed as exc:
                raise UserError(_one_line(mode, exc)) from None
        return forward

    for blocks in (b for b in stacks if b):
        compiled = torch.compile(type(blocks[0]).forward, backend=BACKEND, dynamic=dynamic, **options)
        for block in blocks:
            block.forward = bound(compiled, block)  # an instance attribute: __call__ (and its hooks) stay eager
    return sum(len(b) for b in stacks)


def _one_line(mode: str, exc: BaseException) -> str:
    cause = exc.__cause__ or getattr(exc, "inner_exception", None) or exc
    text = str(cause).strip().splitlines()
    first = next((line for line in text if line.strip()), type(cause).__name__)
    return (f"model.compile = {mode!r}: torch.compile failed on a transformer block ({type(cause).__name__}: "
            f"{first[:200]}); set model.compile = 'off' to train without it")


COMPILE_RULES = (
    COMPILER_MISSING := Rule("compiler-missing", ("model.compile", "train.device"),
                             "a compile the device's toolchain cannot do (Triton on CUDA, a C++ compiler on the CPU)"),
)


def compiler_problems(mode: str, device: torch.device) -> list[Problem]:
    """A compile the device's toolchain cannot do: inductor needs Triton on CUDA and a C++ compiler on the CPU."""
    import importlib.util
    import shutil

    if mode == "off" or BACKEND != "inductor":
        return []
    if torch.device(device).type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return [COMPILER_MISSING.problem(
                f"model.compile = {mode!r} on CUDA needs the 'triton' package (inductor's GPU code generator), which "
                "is not installed; pip install triton, or set model.compile = 'off'")]
    elif not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")):
        return [COMPILER_MISSING.problem(f"model.compile = {mode!r} on the CPU needs a C++ compiler (g++ or clang++) "
                                         "on PATH; install one, or set model.compile = 'off'")]
    return []


def check_compiler(mode: str, device: torch.device) -> None:
    """Refuse, in one line naming ``model.compile``, what :func:`compiler_problems` finds."""
    refuse(compiler_problems(mode, device))


def is_compiled(block: nn.Module) -> bool:
    return "forward" in vars(block)


def compile_counts() -> dict[str, int]:
    """Dynamo's process-wide counters: ``graphs`` (compiled graphs so far), ``graph_breaks``, ``recompiles``
    (guard failures that compiled again). Host integers; differences between two calls count one stretch."""
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "graph_breaks": int(sum(counters["graph_break"].values())),
            "recompiles": int(sum(counters["recompiles"].values())) if "recompiles" in counters else 0}


def compiled_blocks(transformers: Iterator[nn.Module]) -> int:
    return sum(is_compiled(b) for t in transformers for b in getattr(t, "blocks", ()))
