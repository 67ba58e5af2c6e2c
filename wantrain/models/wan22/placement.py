"""Where each expert's tensors live: the training device holds at most one expert, ever.

An A14B run has two 14B experts; only the one being trained (or evaluated) sits on the training device. Their
base weights are frozen, so each expert keeps one *waiting copy* of its base tensors (parameters and buffers) on
``model.offload_device`` (the host by default), made once when the model is built — the tensors it was loaded
into, or, when the training device is CUDA and the host memory allows (:func:`pin_budget`), copies of them carved
from a few pinned slabs (``pinned.py``: no power-of-two rounding). Then:

* moving an expert **out** drops its device copy of the base weights (the parameters point back at the waiting
  copy: nothing is copied) and copies only its LoRA parameters, their gradients and their optimizer state to the
  offload device;
* moving an expert **in** copies its base weights from the waiting copy (non-blocking when pinned) and its LoRA,
  gradients and optimizer state to the training device;
* :meth:`ExpertPlacement.activate` moves every other resident expert out *before* it moves the requested one in,
  so two experts never share the device (57 GB each in bf16 for A14B), in either switch direction and around
  every validation and sample round.

Optimizer state is placed as torch's ``Optimizer.load_state_dict`` places it
(``_process_value_according_to_param_policy``): every tensor follows its parameter, except a ``step`` of a group
that is neither ``fused`` nor ``capturable``, which stays where the optimizer keeps it (on the host). A fused or
capturable group's 0-dim ``step`` must sit on its parameter's device (the fused CUDA kernel reads it there).
bitsandbytes' paged state (tensors with ``is_paged``) is unified memory the driver pages by itself: it is left
where it is, so that it stays paged.

With one trained expert (or when the training and offload devices are the same) nothing ever moves and no
waiting copy is kept, unless the waiting expert waits on disk: with ``disk`` (``model.waiting_expert = "disk"``,
``waiting.py``) no waiting copy is kept at all; an expert moving out drops its base weights (``meta`` placeholders,
on any devices, the same device included) and one moving in reads them back from its waiting file, so the host
holds no frozen tensor of an expert that is not on the device. Its LoRA, gradients and optimizer state move as
above (they stay in memory). A run that trains one A14B expert and samples adds the other one as a *frozen* expert
(:meth:`ExpertPlacement.add_frozen`: no LoRA of its own to train, no optimizer state): it waits on the offload device
like an inactive trained expert, its waiting copy being the host tensors it was loaded into, and the same rules
hold for both. All transfers are issued from the host thread; a non-blocking host->device copy from pinned
memory is ordered before any kernel that reads it on the same stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from wantrain.core.devices import resolve_device, same_device
from wantrain.models.wan22 import pinned
from wantrain.models.wan22.single_file import trim_heap
from wantrain.models.wan22.waiting import WaitingOnDisk, qualified_names

_DROPPED = torch.device("meta")  # where the base weights of an expert waiting on disk are: nowhere (placeholders)
_PIN_SHARE = 0.5  # pin the waiting copies only if they fill at most this share of the host's memory


def pin_budget(host_ram_gb: float | None = None) -> int:
    """Bytes of waiting copies that may be pinned: half of the host's memory, ``host_ram_gb`` GiB
    (``model.host_ram_budget_gb``) or the physical memory (pinned pages cannot be swapped out; pinning both A14B
    experts on a 128 GB host would leave it nothing)."""
    if host_ram_gb is not None:
        return int(host_ram_gb * 2**30 * _PIN_SHARE)
    import psutil

    return int(psutil.virtual_memory().total * _PIN_SHARE)


def _name(expert: str | None) -> str:
    return f"{expert.replace('_', '-')} expert" if expert else "transformer"


def follows_parameter(key: str, value: Any, group: dict[str, Any] | None) -> bool:
    """Whether optimizer state ``key`` moves with its parameter (see the module docstring)."""
    if not isinstance(value, torch.Tensor) or getattr(value, "is_paged", False):
        return False
    return key != "step" or bool(group and (group.get("fused") or group.get("capturable")))


def _tensors(module: nn.Module, *, trainable: bool) -> Iterator[tuple[nn.Module, str, torch.Tensor, bool]]:
    """(owner, attribute, tensor, is_parameter) of ``module``'s trainable (LoRA) or frozen (base) tensors."""
    seen: set[int] = set()
    for owner in module.modules():
        for attr, param in owner._parameters.items():
            if param is not None and param.requires_grad == trainable and id(param) not in seen:
                seen.add(id(param))
                yield owner, attr, param, True
        if not trainable:
            for attr, buf in owner._buffers.items():
                if buf is not None and id(buf) not in seen:
                    seen.add(id(buf))
                    yield owner, attr, buf, False


def _place(owner: nn.Module, attr: str, value: torch.Tensor, is_param: bool) -> torch.Tensor:
    """Put ``value`` in ``owner.attr``, keeping the Parameter object where torch allows (CPU<->CUDA); between
    tensor kinds (e.g. to ``meta``) a new Parameter replaces it. Returns what now sits there."""
    if not is_param:
        owner._buffers[attr] = value
        return value
    param = owner._parameters[attr]
    assert param is not None
    if torch._has_compatible_shallow_copy_type(param, value):
        param.data = value
        return param
    new = nn.Parameter(value, requires_grad=param.requires_grad)
    owner._parameters[attr] = new
    return new


class ExpertPlacement:
    """The placement of every expert's transformer: the trained ones (:meth:`add`) and one that only runs
    (:meth:`add_frozen`; see the module docstring). ``where[e]`` is the device of expert ``e``'s base weights;
    :meth:`resident` lists those on the training device."""

    def __init__(self, device: torch.device, offload_device: torch.device, *, pin_limit: int | None = None,
                 disk: WaitingOnDisk | None = None) -> None:
        """``pin_limit``: bytes of waiting copies that may be pinned (0: none; default :func:`pin_budget`).
        ``disk``: the waiting files: the waiting experts' base weights are read back from there instead of held
        (module docstring); the caller wrote each expert's file first (``WaitingOnDisk.keep``)."""
        self.device = resolve_device(device)  # cuda -> cuda:N: the device its tensors report
        self._offload_device = resolve_device(offload_device)
        self.where: dict[str | None, torch.device] = {}
        self._transformers: dict[str | None, nn.Module] = {}
        # expert -> [(owner, attribute, waiting copy, is_parameter)] of its base tensors
        self._waiting: dict[str | None, list[tuple[nn.Module, str, torch.Tensor, bool]]] = {}
        self.pinned = False
        self.sharded: set[str | None] = set()  # add_sharded's experts: on the device for good, never moved
        self.pin_limit = pin_limit
        self.disk = disk

    @property
    def offload_device(self) -> torch.device:
        return self._offload_device

    @offload_device.setter
    def offload_device(self, device: torch.device | str) -> None:
        self._offload_device = resolve_device(device)

    def _moves(self) -> bool:
        """Whether the training and offload devices differ (``cuda`` and ``cuda:0`` are one device)."""
        return not same_device(self.device, self.offload_device)

    def add(self, experts: dict[str | None, nn.Module], first: str | None) -> None:
        """Take the freshly built ``experts`` (base weights on the host) and put ``first`` on the training device.
        With more than one expert and distinct devices, the loaded tensors become the waiting copies."""
        if self.disk is not None:  # each one parked as it was built: the first is read back onto the device
            missing = [e for e in experts if self.where.get(e) != _DROPPED]
            if missing:
                raise ValueError(f"add: with the waiting expert on disk every expert is parked first ({missing})")
            self._move_in(first, None)
            return
        self._transformers = dict(experts)
        moves = len(experts) > 1 and self._moves()
        if moves:
            self.pinned = self._may_pin()
            for expert in experts:
                self._keep_waiting_copy(expert)
                self._move_trainable(expert, self.offload_device, None)
                self.where[expert] = self.offload_device
        else:
            for expert in experts:
                target = self.device if expert == first else self.offload_device
                self._move_base(expert, target)
                self._move_trainable(expert, target, None)
                self.where[expert] = target
        if moves:
            self._move_in(first, None)

    def park(self, expert: str | None, transformer: nn.Module) -> None:
        """With the waiting expert on disk (``disk``; its file written): take the freshly built ``transformer`` and
        drop its base weights at once (its LoRA to the offload device), so that no expert is held whole while the
        next one loads; :meth:`add` then reads the first one back onto the device."""
        assert self.disk is not None and expert in self.disk.files
        self._transformers[expert] = transformer
        self._move_trainable(expert, self.offload_device, None)
        self._move_base(expert, _DROPPED)
        self.where[expert] = _DROPPED
        trim_heap()

    def add_sharded(self, experts: dict[str | None, nn.Module]) -> None:
        """Take ``experts`` built on ``meta`` for ``model.parallel = "fsdp"``: sharding puts their shards on the
        training device (``core.parallel.sharding.load_from_rank0``) and they never move, so nothing moves here."""
        self._transformers = dict(experts)
        self.where.update(dict.fromkeys(experts, self.device))
        self.sharded.update(experts)

    def add_frozen(self, expert: str | None, transformer: nn.Module) -> None:
        """Add an expert that only runs, never trains (the other A14B expert, for sampling a run that trains one):
        ``transformer`` has no trainable tensor and its base weights are on the host. It waits off the device and
        comes in through :meth:`activate` like a trained expert. Its waiting copy is the tensors it was loaded
        into (one host copy); where the devices differ, an expert placed before without a waiting copy (the one
        trained expert, which never moved) gets one now, copied back once, so no later move copies base weights
        to the host."""
        if any(t.requires_grad for t in transformer.parameters()):
            raise ValueError(f"add_frozen: the {expert} expert has trainable parameters")
        self._transformers[expert] = transformer
        if not self._moves():  # nothing ever moves
            self._move_base(expert, self.device)
            self.where[expert] = self.device
            return
        if not self._waiting:
            self.pinned = self._may_pin()
        for e in self._transformers:
            if e not in self._waiting and e not in self.sharded:  # a sharded expert's shards stay where they are
                self._keep_waiting_copy(e)
        self.where[expert] = self.offload_device

    def _may_pin(self) -> bool:
        """Whether the waiting copies of every expert may be pinned: their slabs (``pinned.slab_bytes``) fit in
        :func:`pin_budget`."""
        total = sum(pinned.slab_bytes([t.numel() * t.element_size() for _, _, t, _ in _tensors(m, trainable=False)])
                    for m in self._transformers.values())
        limit = pin_budget() if self.pin_limit is None else self.pin_limit
        return pinned.pinnable(self.device) and 0 < total <= limit

    def _keep_waiting_copy(self, expert: str | None) -> None:
        """Make ``expert``'s waiting copy on the offload device (carved from pinned slabs if :attr:`pinned`,
        ``pinned.py``). Its tensors already there become the copy (pinned: copied into the slabs, tensor by tensor,
        each original dropped once copied); an expert off the device then points at its copy, one on the device
        keeps its device tensors."""
        on_device = self.where.get(expert) == self.device
        tensors = list(_tensors(self._transformers[expert], trainable=False))
        copies: list[torch.Tensor | None] = [None] * len(tensors)
        if self.pinned and self.offload_device.type == "cpu":
            slabs = pinned.PinnedSlabs(f"the {_name(expert)}'s waiting copy")
            for index, view in slabs.views([(tuple(t.shape), t.dtype) for _, _, t, _ in tensors]):
                owner, attr, tensor, is_param = tensors[index]
                if view is None:
                    view = tensor.to(self.offload_device)
                else:
                    view.copy_(tensor)
                if not on_device:
                    _place(owner, attr, view, is_param)
                copies[index] = view
            self.pinned = slabs.pinned  # the driver refused more pinned memory: pageable from here on
        else:
            for index, (owner, attr, tensor, is_param) in enumerate(tensors):
                copies[index] = tensor.to(self.offload_device)
                if not on_device:
                    _place(owner, attr, copies[index], is_param)
        self._waiting[expert] = [(owner, attr, copy, is_param)
                                 for (owner, attr, _, is_param), copy in zip(tensors, copies, strict=True)]

    def on_disk(self, expert: str | None) -> bool:
        """Whether ``expert`` waits on disk now (its base tensors are placeholders: ``disk``)."""
        return self.where.get(expert) == _DROPPED

    def resident(self) -> list[str | None]:
        """The experts whose base weights are on the training device and may leave it (at most one; sharded
        experts, 1/N of an expert each, stay beside it: the other expert of a sharded run comes in for samples)."""
        return [e for e, d in self.where.items() if same_device(d, self.device) and e not in self.sharded]

    def activate(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        """Put ``expert`` (base weights, LoRA, gradients, optimizer state) on the training device, after moving
        every other resident expert out. A no-op when it is there already. Synchronous except for the
        non-blocking host->device copies from pinned memory (ordered on the current stream)."""
        for other in self.resident():
            if other != expert:
                self._move_out(other, optimizer)
        where = self.where.get(expert)
        if where is None or not same_device(where, self.device):
            self._move_in(expert, optimizer)

    # -- moves -------------------------------------------------------------------------------------------------
    def _move_in(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        waiting = self._waiting.get(expert)
        if self.where.get(expert) == _DROPPED:
            self._read_base(expert)
        elif waiting is None:  # no waiting copy (one device, or an offload device changed after the build)
            self._move_base(expert, self.device)
        else:
            for owner, attr, copy, is_param in waiting:
                _place(owner, attr, copy.to(self.device, non_blocking=self.pinned), is_param)
        self._move_trainable(expert, self.device, optimizer)
        self.where[expert] = self.device

    def _move_out(self, expert: str | None, optimizer: torch.optim.Optimizer | None) -> None:
        waiting = self._waiting.get(expert)
        if self.disk is not None:
            self._move_base(expert, _DROPPED)
            self._move_trainable(expert, self.offload_device, optimizer)
            self.where[expert] = _DROPPED
            trim_heap()  # the freed tensors' pages go back to the system, not into glibc's heap
            return
        if waiting is None:
            self._move_base(expert, self.offload_device)
        else:
            for owner, attr, copy, is_param in waiting:  # drop the device copy: the waiting one is unchanged
                _place(owner, attr, copy, is_param)
        self._move_trainable(expert, self.offload_device, optimizer)
        self.where[expert] = self.offload_device

    def _move_base(self, expert: str | None, target: torch.device) -> None:
        """Every base tensor of ``expert`` to ``target`` (``meta``: dropped, an empty placeholder of its shape)."""
        for owner, attr, tensor, is_param in list(_tensors(self._transformers[expert], trainable=False)):
            _place(owner, attr, torch.empty_like(tensor, device="meta") if target == _DROPPED else tensor.to(target),
                   is_param)

    def _read_base(self, expert: str | None) -> None:
        """``expert``'s base tensors from its waiting file onto the training device, one tensor at a time."""
        assert self.disk is not None
        transformer = self._transformers[expert]
        name = qualified_names(transformer)
        with self.disk.reader(expert) as read:
            for owner, attr, _, is_param in list(_tensors(transformer, trainable=False)):
                _place(owner, attr, read(name(owner, attr)).to(self.device), is_param)

    def _move_trainable(self, expert: str | None, target: torch.device, optimizer: torch.optim.Optimizer | None
                        ) -> None:
        """The LoRA parameters of ``expert``, their gradients and optimizer state to ``target``; the optimizer's
        references are remapped where a move created new Parameter objects."""
        groups = {id(p): g for g in optimizer.param_groups for p in g["params"]} if optimizer is not None else {}
        remap: dict[int, nn.Parameter] = {}
        for owner, attr, param, _ in list(_tensors(self._transformers[expert], trainable=True)):
            state = optimizer.state.pop(param, None) if optimizer is not None else None
            grad, param.grad = param.grad, None
            new = _place(owner, attr, param.data.to(target), True)
            if grad is not None:
                new.grad = grad.to(target)
            if new is not param:
                remap[id(param)] = new
            if state is not None:
                group = groups.get(id(param))
                optimizer.state[new] = {k: v.to(target) if follows_parameter(k, v, group) else v
                                        for k, v in state.items()}
        if optimizer is not None and remap:
            for group in optimizer.param_groups:
                group["params"] = [remap.get(id(p), p) for p in group["params"]]


# -- one expert per group of GPUs (model.expert_groups; core.parallel.expert_groups) -----------------------------------
def expert_group_config(model: Any, lora: Any, group: int) -> tuple[Any, Any]:
    """The ``[model]`` and ``[lora]`` sections expert group ``group`` trains with ``model.expert_groups = 2``: the
    ``group``-th expert alone, exactly as a one-expert run of it (``experts = 'high_noise'`` / ``'low_noise'``), so
    its device holds that expert only and nothing ever swaps. Its band is the one it has with both experts: a
    ``min_t`` (which bounds the low-noise band) goes to the low-noise group only, a ``max_t`` to the high-noise
    one; the other expert's ``lora.init_from_*`` file is the other group's."""
    import attrs

    from wantrain.models.wan22.variants import VARIANTS

    expert = VARIANTS[model.variant].experts[group]
    other = "low_noise" if expert == "high_noise" else "high_noise"
    bounds = {"min_t": None} if expert == "high_noise" else {"max_t": None}
    mine = attrs.evolve(model, experts=expert, expert_groups=1, **bounds)
    return mine, attrs.evolve(lora, **{f"init_from_{other}": None})


def host_experts(model: Any, sampling: bool) -> tuple[tuple[Any, ...], tuple[str, ...]]:
    """(the experts one rank trains, those it loads for sampling only), as the host-memory plan counts them:
    with ``model.expert_groups`` > 1 one expert per rank (its group's; the A14B experts are the same size, so the
    first stands for either) and nothing loaded for sampling (the other group's expert is called there:
    ``core.parallel.expert_relay``); else the run's trained experts and, with ``[sample]`` on, the untrained one."""
    if model.expert_groups > 1:
        return model.trained_experts[:1], ()
    return model.trained_experts, model.untrained_experts if sampling else ()


def expert_group_lines(model: Any, gpus: int | None) -> list[str]:
    """``wantrain check``: where each expert trains with ``model.expert_groups`` > 1 (``[]`` otherwise), for a
    launch of ``gpus`` ranks (None: any multiple of the groups)."""
    count = model.expert_groups
    if count <= 1:
        return []
    from wantrain.models.wan22.variants import VARIANTS

    experts = VARIANTS[model.variant].experts
    lines = [f"placement: one expert per group of GPUs (model.expert_groups = {count}); each GPU holds only its "
             "group's expert and trains it every step, data parallel inside the group (the host memory above is "
             "per rank: its expert alone):"]
    if gpus is None or gpus % count:
        def at(g: int) -> str:
            return "0" if g == 0 else "W" if g == count else f"{g}W/{count}" if g > 1 else f"W/{count}"

        lines += [f"  {e}: group {g}, ranks {at(g)} .. {at(g + 1)} - 1 of a torchrun launch of W processes (W a "
                  f"multiple of {count}; check --gpus W names them)" for g, e in enumerate(experts)]
        return lines
    size = gpus // count
    for g, e in enumerate(experts):
        first, last = g * size, (g + 1) * size - 1
        lines.append(f"  {e}: rank{'s' if size > 1 else ''} {first}" + (f"..{last}" if size > 1 else "")
                     + f" (group {g}, {size} GPU{'s' if size > 1 else ''})")
    return lines
