"""The contract between the core and a model family (``wantrain.models.wan22`` implements it).

The core knows nothing about Wan: it asks the adapter which expert a step trains, for the loss of a batch, and
for the parameter groups the optimizer sees (:class:`ModelAdapter`).

What observers use beyond that is declared as small capability protocols below. An observer names the ones it
needs in its class attribute ``needs`` (``needs = (ValidationCapable,)``); :func:`check_needs` refuses an adapter
that lacks one when the observer is attached (``Bus.attach`` with an adapter in its context, and the trainer's
construction for observers attached before), in one line naming the observer and the capability: not hours into
a run. Observers reach the model as ``ctx.adapter`` and use only what they declared; changes to the model or the
optimizer go through ``ctx.control`` (an alpha transition, experts brought in for an evaluation), which the core
carries out with the capabilities below.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from wantrain.core.errors import UserError


@runtime_checkable
class ModelAdapter(Protocol):
    """What the training loop needs from a model.

    ``experts`` lists the experts trained in this run in a fixed order (``("high_noise", "low_noise")``, one of
    them, or ``(None,)`` for a single-transformer model).
    """

    experts: tuple[str | None, ...]
    device: torch.device

    def param_groups(self) -> list[dict[str, Any]]:
        """Optimizer parameter groups: dicts with ``params``, ``lr`` and a unique ``name`` (``high_noise``, ...)."""
        ...

    def expert_for_step(self, step: int) -> str | None:
        """The expert trained at optimizer step ``step`` (1-based). Pure function of ``step``: resume-safe."""
        ...

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Make ``expert`` the trained one: move it (and its optimizer state) to the training device and move the
        other expert off it. Called by the core before the first step and at every switch."""
        ...

    def loss(self, batch: Mapping[str, Any], expert: str | None, generator: torch.Generator) -> torch.Tensor:
        """The scalar training loss of ``batch`` for ``expert`` (forward pass; no backward, no sync)."""
        ...

    def trainable_parameters(self, expert: str | None = None) -> Sequence[torch.nn.Parameter]:
        """LoRA parameters of ``expert`` (all trained experts when ``None``), in a stable order."""
        ...


class Saver(Protocol):
    """Writes the trained LoRA (the format is the model family's business, not the loop's)."""

    def save(self, step: int, final: bool) -> Sequence[str]:
        """Write the LoRA file(s) for ``step``; return the paths written."""
        ...


class NullSaver:
    """A saver that writes nothing (tests, LR-finder style runs)."""

    def save(self, step: int, final: bool) -> Sequence[str]:
        return ()


Batches = Iterable[Mapping[str, Any]]


# -- capabilities: what observers may need beyond ModelAdapter ----------------------------------------------------
@runtime_checkable
class Evaluating(Protocol):
    """The model can be evaluated between optimizer steps (the core's ``control.evaluation()`` uses it).

    ``active`` is the expert on the training device. ``evaluating()`` puts every trained transformer in eval mode
    under ``torch.no_grad`` and restores train mode after. ``activate`` is ModelAdapter's: the core calls it to
    bring experts in."""

    active: str | None

    def evaluating(self) -> AbstractContextManager[None]: ...

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None: ...


@runtime_checkable
class ValidationCapable(Evaluating, Protocol):
    """A fixed-timestep, fixed-noise loss (the validation observer)."""

    experts: tuple[str | None, ...]

    def expert_for_timestep(self, t: float) -> str | None:
        """The trained expert that owns timestep ``t`` in (0, 1), or ``"untrained"``."""
        ...

    def validation_loss(self, batch: Mapping[str, Any], t: float, noise: torch.Tensor) -> torch.Tensor:
        """0-dim device tensor; no host sync, no random draw. Inside ``evaluating()``, the owner of ``t`` active."""
        ...


@runtime_checkable
class SamplingCapable(Evaluating, Protocol):
    """Sample videos with the model's own pipeline (the sample observer).

    ``boundary_ratio``: the fraction of the timesteps at and above which the high-noise expert denoises (None: one
    transformer). ``load_vae()`` returns a fresh VAE (the caller drops it); ``sampling_pipeline`` builds the
    pipeline around the training transformers."""

    device: torch.device
    boundary_ratio: float | None

    def load_vae(self) -> Any: ...

    def sampling_pipeline(self, vae: Any, *, image_to_video: bool) -> Any: ...


@runtime_checkable
class ExpertServing(Protocol):
    """An expert called for another rank (``model.expert_groups``: its group's leader serves rank 0's sampling
    pipeline, ``core.parallel.expert_relay``). ``transformer_for(expert)`` is the module the pipeline would call."""

    def transformer_for(self, expert: str | None) -> Any: ...


@runtime_checkable
class LoraStacking(Protocol):
    """LoRA files applied under the trained LoRA while sampling (``[sample] loras``): ``stacked_loras(loras)`` is a
    context manager inside which they act (never trained or saved); ``check_stacked_loras(loras)`` reads them and
    returns one line per file with keys that match no module."""

    def stacked_loras(self, loras: Any) -> Any: ...

    def check_stacked_loras(self, loras: Any) -> list[str]: ...


@runtime_checkable
class TextEncoding(Protocol):
    """Prompt embeddings (what the sample observer's builder encodes before the encoders are released)."""

    def encode_text(self, captions: list[str]) -> dict[str, torch.Tensor]: ...

    def release_encoders(self) -> None: ...


@runtime_checkable
class TimestepPinning(Protocol):
    """Place the next forward pass's timesteps at a quantile instead of drawing them (the LR finder's
    stratified noise). One call, one forward pass; device state only."""

    def set_timestep_quantile(self, quantile: float) -> None: ...


@runtime_checkable
class AlphaChangeable(Protocol):
    """Change a LoRA's alpha between optimizer steps (carried out by the core on ``control.set_lora_alpha``)."""

    def change_lora_alpha(self, alpha: float, expert: str | None, optimizer: torch.optim.Optimizer | None = None,
                          *, preserve_output: bool = True) -> None: ...


@contextlib.contextmanager
def evaluation_session(adapter: Evaluating, optimizer: torch.optim.Optimizer | None = None, *,
                       moved: Callable[[], None] | None = None) -> Iterator[Callable[[str | None], None]]:
    """What ``control.evaluation()`` opens (the trainer binds it with its optimizer): ``adapter.evaluating()``,
    yielding ``bring_in(expert)``, which activates ``expert`` (its optimizer state moves with it); on exit the
    expert active at the start is activated again, then ``moved()`` runs (the trainer forgets the parameter lists
    it keeps per expert: a move may replace Parameters)."""
    training = adapter.active

    def bring_in(expert: str | None) -> None:
        adapter.activate(expert, optimizer)

    try:
        with adapter.evaluating():
            yield bring_in
    finally:
        adapter.activate(training, optimizer)
        if moved is not None:
            moved()


class MissingCapability(UserError):
    """An observer needs a capability the model adapter lacks (raised when the observer is attached)."""


def check_needs(observer: Any, adapter: Any, *, needs: Sequence[type] | None = None) -> None:
    """Raise :class:`MissingCapability` when ``adapter`` lacks a capability ``observer.needs`` lists (or
    ``needs``: what a builder uses before the observer exists). Nothing to check without an adapter (replay, tests
    of events alone)."""
    if adapter is None:
        return
    for capability in getattr(observer, "needs", ()) if needs is None else needs:
        if not isinstance(adapter, capability):
            missing = [name for name in _members(capability) if not hasattr(adapter, name)]
            name = observer if isinstance(observer, str) else getattr(observer, "name", type(observer).__name__)
            raise MissingCapability(
                f"observer {name} needs {capability.__name__} ({', '.join(missing) or 'its members'}), which the "
                f"model adapter {type(adapter).__name__} does not provide; disable the observer or use a model "
                "that has it")


def _members(protocol: type) -> list[str]:
    names: list[str] = []
    for klass in reversed(protocol.__mro__):
        if klass in (object, Protocol, Any) or not getattr(klass, "_is_protocol", False):
            continue
        for name in (*getattr(klass, "__annotations__", {}), *vars(klass)):
            if not name.startswith("_") and name not in names:
                names.append(name)
    return names
