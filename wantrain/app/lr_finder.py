"""``wantrain run --lr-finder`` and ``--lr-finder-then-train``: the range test through the one run assembly.

:func:`run_lr_finder` is the mode ``wantrain.app.train`` picks when ``[lr_finder]`` is on:

1. The test is a run of its own, assembled by :meth:`~wantrain.app.assemble.PreparedRun.execute` like any other,
   with plain :class:`~wantrain.app.assemble.RunOptions`: a run directory ``<time>__lr_finder``
   (``<time>__<run_id>__lr_finder``), ``steps * steps_per_lr`` optimizer steps per trained expert with each
   expert's sweep in turn (:class:`SweepOrder`), every step logged, no LoRA files and no checkpoints, no
   validation or samples. The :class:`~wantrain.observers.lr_finder.observer.LrFinder` observer drives it.
   With ``noise = "probe"`` (the default) it measures each rung on a :class:`~wantrain.observers.lr_finder.
   observer.Probe` built here (:func:`build_probe`): the first ``probe_clips`` training clips in folder order (read
   like ``[validation]``'s ``from_training`` clips, cached right before the sweep), ``probe_timesteps`` timesteps
   per expert at the quantiles (k + 0.5) / N of the expert's training distribution, the run seed's fixed noise,
   and ``[validation]``'s own ``validate`` as the measurement.
2. ``--lr-finder``: that is all; the suggestions are printed and the process exits (0 when the sweep ran to its
   end or to its stop rule).
3. ``--lr-finder-then-train``: right before the sweep's first step the trainer's whole state is copied in memory
   (``copy_tree(trainer.state_dict())``: LoRA weights, optimizer and scheduler state, every random stream, the
   data position, the core's counters). After the sweep a normal run is assembled from the config with each
   expert's suggested LR (``model.lr_high_noise`` / ``model.lr_low_noise``, or ``optimizer.lr``) and ``[lr_finder]``
   switched off -- what its ``config.toml`` says, so re-running that file trains the same run -- and
   :func:`load_initial_state` loads the copy into its trainer before its first step (a ``before_run`` hook) and
   checks, tensor by tensor, that the LoRA weights and optimizer state equal the copy bitwise. The scheduler is
   the one exception: it is built for the new LR (the copy's schedule is at the same step but scaled to the old
   base LR). The continued run therefore computes exactly what a run started with the suggested LR computes
   (a test checks that).

One expert per group of GPUs (``model.expert_groups``): the groups sweep their experts side by side
(``LrFinder(concurrent=True)``: ``steps * steps_per_lr`` steps in all, each group setting its own expert's LR and
measuring its own probe), every rank judges every expert from the reduced metrics, and each group then trains its
expert with that expert's suggestion (every rank builds the same suggested config).
"""

from __future__ import annotations

import copy
from typing import Any

import attrs
import structlog
import torch

from wantrain.app.assemble import PreparedRun, RunOptions, RunOutcome, run_experts
from wantrain.app.run_plan import build_validation_data
from wantrain.core.checkpoint import copy_tree
from wantrain.core.parallel.expert_groups import ExpertGroupSync
from wantrain.data import ensure_cache
from wantrain.models.wan22.variants import variant_spec
from wantrain.observers.evaluation.validation import cached_batches, validate
from wantrain.observers.lr_finder.config import RUN_ID_SUFFIX
from wantrain.observers.lr_finder.observer import LrFinder, Probe, summary_lines
from wantrain.optimizers import TYPES

log = structlog.get_logger("wantrain.lr_finder")


class SweepOrder:
    """The model adapter as the finder's run sees it: each trained expert's whole sweep in turn (steps
    ``1..n`` the first expert, ``n+1..2n`` the second), instead of alternating every ``switch_every`` steps.
    Everything else is the adapter's own."""

    def __init__(self, adapter: Any, steps_per_expert: int) -> None:
        self._adapter = adapter
        self.steps_per_expert = steps_per_expert

    def __getattr__(self, name: str) -> Any:
        return getattr(self._adapter, name)

    def expert_for_step(self, step: int) -> str | None:
        experts = self._adapter.experts
        return experts[((step - 1) // self.steps_per_expert) % len(experts)]


def probe_timesteps(adapter: Any, expert: str | None, count: int) -> tuple[float, ...]:
    """``count`` timesteps at the quantiles (k + 0.5) / count of ``expert``'s training timestep distribution (the
    adapter's ``sampler`` and ``bands``: shift, band and sampling method included), in (0, 1)."""
    import torch

    t = adapter.sampler.sample(count, adapter.bands[expert], torch.Generator(), torch.device("cpu"),
                               quantile=0.5 / count)
    return tuple(sorted(float(x) for x in t))


def probe_data(cfg: Any) -> Any:
    """The probe's clips: the first ``lr_finder.probe_clips`` training clips in folder order, one per batch (the
    ``[validation]`` ``from_training`` reading of the data). Decodes nothing."""
    n = cfg.lr_finder.probe_clips
    v = attrs.evolve(cfg.validation, path=None, from_training=n, max_clips=n)
    return build_validation_data(attrs.evolve(cfg, validation=v), variant_spec(cfg.model.variant), cfg.run.seed)


def build_probe(cfg: Any, adapter: Any, data: Any) -> Probe:
    """The probe of ``noise = "probe"`` on ``data`` (:func:`probe_data`), cached here if the training cache did
    not cover it (the encoders are released again after)."""
    ensure_cache(data, adapter, remove_orphans=False)
    adapter.release_encoders()
    batches = cached_batches(data, adapter)
    timesteps = {e: probe_timesteps(adapter, e, cfg.lr_finder.probe_timesteps) for e in adapter.experts}
    log.info("lr_finder_probe", clips=len(batches), timesteps={e or "lora": list(t) for e, t in timesteps.items()})
    return Probe(batches=batches, timesteps=timesteps, seed=cfg.run.seed, evaluate=validate)


def load_initial_state(trainer: Any, tree: dict[str, Any]) -> int:
    """Load the state copied before the sweep into ``trainer`` (before its first step) and check that every LoRA
    and optimizer-state tensor now equals the copy bitwise; returns how many tensors were compared. The scheduler
    is left as built (for the suggested LR), the finder run's observers' state is not carried over."""
    tree = {**tree, "scheduler": None, "observers": {}}
    trainer.load_state_dict(tree)
    now = trainer.state_dict()
    compared = 0
    for part in ("model", "optimizer"):
        mismatched = []
        for path, (a, b) in _paired_tensors(now[part], tree[part], part).items():
            compared += 1
            if a.shape != b.shape or not torch.equal(a, b.to(a.device)):
                mismatched.append(path)
        if mismatched:
            raise RuntimeError(f"the state restored after the LR finder's sweep differs from the copy taken before "
                               f"it in {len(mismatched)} tensors, e.g. {mismatched[0]}")
    log.info("lr_finder_state_restored", tensors_compared=compared)
    return compared


def _paired_tensors(a: Any, b: Any, path: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Tensors of two trees with the same structure, by path. Raises ``RuntimeError`` where the structures differ."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise RuntimeError(f"restored state differs from the copy at {path} (tensor vs. not)")
        return {path: (a, b)}
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            diff = sorted(map(str, set(a) ^ set(b)))
            raise RuntimeError(f"restored state differs from the copy at {path}: keys {diff}")
        for key in a:
            out.update(_paired_tensors(a[key], b[key], f"{path}/{key}"))
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            out.update(_paired_tensors(x, y, f"{path}/{i}"))
    return out


def configured_lr(cfg: Any, expert: str | None) -> float:
    """The LR the config gives ``expert``'s parameter group (``model.lr_<expert>`` if set, else ``optimizer.lr``)."""
    own = getattr(cfg.model, f"lr_{expert}", None) if expert is not None else None
    return float(cfg.optimizer.lr if own is None else own)


def training_lrs(cfg: Any, experts: tuple[str | None, ...], results: dict[str | None, Any]
                 ) -> tuple[dict[str | None, float], list[str]]:
    """The LR each expert trains with after the sweep: its suggestion when ``trusted``; else the config's, with one
    line saying so (the first invalidating warning as the reason). Returns (trusted LRs, the fallback lines)."""
    lrs, fallbacks = {}, []
    kind = getattr(cfg.optimizer, "type", None)
    spec = TYPES.get(kind) if kind is not None else None
    lr_max = spec.lr_max if spec is not None else None  # the config refuses more (optimizers.registry)
    for expert in experts:
        result = results.get(expert)
        too_large = (result is not None and result.trusted and lr_max is not None and result.suggested_lr > lr_max)
        if result is not None and result.trusted and not too_large:
            lrs[expert] = result.suggested_lr
            continue
        configured = configured_lr(cfg, expert)
        why = result.invalid[0] if result is not None and result.invalid else "the sweep gave no suggestion"
        if too_large:
            why = (f"the suggestion {result.suggested_lr:.3g} is above {lr_max:g}, more than "
                   f"optimizer.type = {kind!r} accepts")
        fallbacks.append(f"lr_finder [{expert or 'lora'}]: not training with the suggestion ({why}); training "
                         f"with the config's LR {configured:.3g}")
        log.warning("lr_finder_fallback", expert=expert or "lora", lr=configured, reason=why)
    return lrs, fallbacks


def suggested_config(cfg: Any, lrs: dict[str | None, float]) -> Any:
    """``cfg`` with the given experts' LRs (the trusted suggestions; the others keep the config's) and
    ``[lr_finder]`` off."""
    changes: dict[str, Any] = {}
    model = cfg.model
    for expert, lr in lrs.items():
        if expert is None:
            changes["optimizer"] = attrs.evolve(cfg.optimizer, lr=lr)
        else:
            model = attrs.evolve(model, **{f"lr_{expert}": lr})
    return attrs.evolve(cfg, model=model, lr_finder=attrs.evolve(cfg.lr_finder, enabled=False, then_train=False),
                        **changes)


def suggested_plain(plain: dict[str, Any], lrs: dict[str | None, float]) -> dict[str, Any]:
    """The run's config as given (``PreparedRun.plain``: with ``model.expert_groups``, every group's, not the rank's
    one-expert view) with :func:`suggested_config`'s changes: what the trained run's ``config.toml`` says."""
    out = copy.deepcopy(plain)
    for expert, lr in lrs.items():
        if expert is None:
            out["optimizer"]["lr"] = lr
        else:
            out["model"][f"lr_{expert}"] = lr
    out["lr_finder"] = {**out["lr_finder"], "enabled": False, "then_train": False}
    return out


def run_lr_finder(prepared: PreparedRun) -> RunOutcome:
    """Run the range test of ``prepared`` (its config has ``[lr_finder]`` on) and, with ``then_train``, the training
    that follows it."""
    cfg, adapter = prepared.cfg, prepared.adapter
    experts = run_experts(prepared.sync, adapter)  # with model.expert_groups every group's, not only this rank's
    concurrent = isinstance(prepared.sync, ExpertGroupSync)  # the groups sweep side by side
    finder = LrFinder(cfg.lr_finder, experts=experts, grad_accum=cfg.train.grad_accum,
                      tensorboard=cfg.observers.tensorboard, concurrent=concurrent)
    clips = probe_data(cfg) if cfg.lr_finder.noise == "probe" else None
    snapshot: dict[str, Any] = {}

    def before_sweep(trainer: Any) -> None:
        if clips is not None:
            finder.probe = build_probe(cfg, adapter, clips)
        if prepared.sync.is_main:  # torchrun: every rank sweeps and decides alike (identical logged losses)
            finder.run_dir = trainer.ctx.run_dir  # only rank 0 writes the sweep's files
        if cfg.lr_finder.then_train:
            snapshot["tree"] = copy_tree(trainer.state_dict())

    sweep = RunOptions(
        run_id_suffix=RUN_ID_SUFFIX, observers=[finder], saves=False, evaluation=False, before_run=before_sweep,
        without=("alpha",),  # the sweep's LRs are no training: no alpha phases (then-train's run has them)
        loop=attrs.evolve(cfg.train, max_steps=finder.total_steps, log_every=1, save_every=None,
                         divergence_factor=None),  # the sweep diverges on purpose: its own stop rule ends it
        model_view=None if concurrent else lambda model: SweepOrder(model, finder.steps_per_expert),
    )
    outcome = prepared.execute(sweep)
    summary = tuple(summary_lines(finder.results))
    status, reason = outcome.status, outcome.reason
    if finder.finished and status == "stopped":
        status = "completed"  # the finder's own stop is how a sweep ends
    outcome = attrs.evolve(outcome, status=status, reason=reason, lr_finder=summary, lr_finder_dir=outcome.run_dir)
    if not cfg.lr_finder.then_train or status != "completed":
        return outcome
    lrs, fallbacks = training_lrs(cfg, experts, finder.results)
    summary = (*summary, *fallbacks)
    new_cfg = suggested_config(cfg, lrs)
    # The adapter was built for the old LR; it now serves the new config (param_groups() reads these two).
    adapter.base_lr = new_cfg.optimizer.lr
    adapter.model_config = new_cfg.model
    log.info("lr_finder_then_train", finder_run=str(outcome.run_dir),
             lrs={e or "lora": lrs.get(e, configured_lr(cfg, e)) for e in experts})
    follow = PreparedRun(new_cfg, suggested_plain(prepared.plain, lrs), prepared.config_dir, prepared.device,
                         prepared.data, adapter, prepared.extra_observers, sync=prepared.sync,
                         validation_data=prepared.validation_data, config_file=prepared.config_file)
    trained = follow.execute(RunOptions(before_run=lambda trainer: load_initial_state(trainer, snapshot["tree"])))
    return attrs.evolve(trained, lr_finder=summary, lr_finder_dir=outcome.run_dir)
