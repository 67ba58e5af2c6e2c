"""Ulysses sequence parallelism for long clips through diffusers' own context parallelism (docs/distributed.md,
"Sequence parallelism"): each GPU of a sequence group holds ``1/degree`` of a clip's tokens; in each attention an
all-to-all trades tokens for heads, so every GPU attends over the whole sequence with ``heads / degree`` heads
(the degree must divide the heads: ``rank_plan.check_layout`` refuses another).

``diffusers`` 0.42.1 picks the rank's device as ``rank % torch.accelerator.device_count()``
(``ModelMixin._resolve_parallel_config``): a division by zero on a machine without an accelerator, where gloo ranks
run on the CPU. :func:`cpu_device_count_workaround` is the one place that works around it (a device count of at
least 1 while the parallelism is set up); it changes nothing where an accelerator exists.

The gradients: each GPU back-propagates through its own tokens only, so a trainable parameter's gradient is the
sum of the group's (:func:`sum_sequence_gradients`), as data parallelism's is their mean.

In ``wantrain run`` (``model.sequence_degree``, :func:`split_sequences`) the ranks form a (dp, ring, ulysses) mesh
of ``(world / degree, 1, degree)``: consecutive ranks share a clip, and the trainer's one gradient all-reduce sums
over every rank and divides by the data-parallel size (``ProcessGroupSync.split_sequences``), the sum over each
sequence group and the mean over the groups at once."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn


@contextlib.contextmanager
def cpu_device_count_workaround() -> Iterator[None]:
    """``torch.accelerator.device_count()`` is at least 1 inside (diffusers 0.42.1 divides a rank by it)."""
    real = torch.accelerator.device_count
    torch.accelerator.device_count = lambda: max(real(), 1)
    try:
        yield
    finally:
        torch.accelerator.device_count = real


def vace_cp_plan() -> dict[str, Any]:
    """diffusers' context-parallel plan of ``WanTransformer3DModel``, for a ``WanVACETransformer3DModel`` (which has
    none of its own): the same splits (RoPE's output, the main blocks' input at ``blocks.0``, the output gathered at
    ``proj_out``), and VACE block 0's two token inputs split the same way: the patch-embedded video tokens and the
    control tokens (padded to the same length before it). The later VACE blocks carry the split control tokens on,
    and each VACE block's hint is then its rank's tokens of the hidden state it is added to; the text is not split
    (as for Wan)."""
    from diffusers import WanTransformer3DModel
    from diffusers.models._modeling_parallel import ContextParallelInput

    tokens = ContextParallelInput(split_dim=1, expected_dims=3, split_output=False)
    return {**WanTransformer3DModel._cp_plan,
            "vace_blocks.0": {"hidden_states": tokens, "control_hidden_states": tokens}}


def enable_ulysses(transformer: nn.Module, degree: int, *, mesh: Any = None) -> nn.Module:
    """Split ``transformer``'s sequence over ``degree`` ranks (diffusers' ``ContextParallelConfig(ulysses_degree=
    degree)``, on ``mesh`` when given, else on every rank of the default group), in place. Its inputs are whole on
    every rank and its output is gathered whole again (diffusers' plan for Wan; a VACE transformer:
    :func:`vace_cp_plan`)."""
    from diffusers import ContextParallelConfig

    config = ContextParallelConfig(ulysses_degree=degree, mesh=mesh)
    plan = vace_cp_plan() if hasattr(transformer, "vace_blocks") else None
    with cpu_device_count_workaround():
        transformer.enable_parallelism(config=config, cp_plan=plan)
    return transformer


def sum_sequence_gradients(params: Sequence[nn.Parameter], group: Any = None) -> None:
    """Add up the gradients of ``params`` over the sequence group ``group`` (None: the default group), in place:
    one all-reduce per parameter with a gradient."""
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)


def split_sequences(adapter: Any, device: torch.device, world_size: int, degree: int) -> Any:
    """``model.sequence_degree`` under torchrun: Ulysses over ``degree`` consecutive ranks on every trained expert
    of ``adapter``, on the (dp, ring, ulysses) mesh of ``(world_size / degree, 1, degree)`` ranks (created here, a
    collective: every rank calls it at the same point). Returns the mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world_size // degree, 1, degree), mesh_dim_names=("dp", "ring", "ulysses"))
    for expert in adapter.experts:
        enable_ulysses(adapter.transformer_for(expert), degree, mesh=mesh)
    return mesh
