"""``wantrain check CONFIG``: the pre-flight data report (buckets, skipped files, waste, steps, VRAM estimate).

First the pre-flight ``wantrain run`` makes before loading anything (every capability's problems at once, one line
each, exit code 2), then the files it reads (model files, users' observers, the [validation]/[sample] files). It
plans for the machine the run will have: without the weights, without the data (from the config's buckets) and,
for ``train.device = "cuda"``, on a machine without CUDA (``--vram-gb``: the card to plan for). Probes and plans only
(no decoding, no model loaded) unless ``--verify`` asks for every clip to be decoded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wantrain.cli.common import add_config_arguments, load_run_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--vram-gb", type=float, default=None, metavar="GIB",
                        help="plan for a card of this much usable memory (as model.vram_budget_gb: the planner picks "
                        "block swap, activation offload and fp8 storage to fit it), e.g. the GPU you will rent")
    parser.add_argument("--verify", action="store_true",
                        help="decode every clip to verify frame counts (slow on large datasets)")
    layout = parser.add_argument_group("plan per GPU of a multi-GPU layout (docs/distributed.md)")
    layout.add_argument("--gpus", type=int, default=None, metavar="N", help="GPUs in all")
    layout.add_argument("--expert-groups", type=int, default=None, metavar="E",
                        help="2: one A14B expert per group of GPUs (default: the config's model.expert_groups)")
    layout.add_argument("--shard-degree", type=int, default=1, metavar="S",
                        help="FSDP over S GPUs of a group (default: the config's model.parallel/shard_degree)")
    layout.add_argument("--sequence-degree", type=int, default=None, metavar="Q",
                        help="Ulysses over Q GPUs of a group (must divide the attention heads; default: the "
                        "config's model.sequence_degree)")


def run(args: argparse.Namespace) -> int:
    from wantrain.app.notes import alpha_schedule_lines
    from wantrain.app.preflight import MissingModelFiles, NoUsableSample, preflight_report
    from wantrain.core.errors import UserError

    cfg = load_run_config(args)
    if args.vram_gb is not None:  # the card to plan for, in place of the config's budget or settings
        cfg = plan_for_card(cfg, args.vram_gb)
    layout = None
    if args.gpus is not None:  # refused first, before the data is probed
        from wantrain.app.launch import check_parallel, planned_layout

        for line in check_parallel(cfg, args.gpus):  # model.parallel against N ranks, as `wantrain run` would
            print(f"warning: {line}")
        groups = args.expert_groups if args.expert_groups is not None else cfg.model.expert_groups
        shard_degree = args.shard_degree
        if cfg.model.parallel == "fsdp" and shard_degree == 1 and args.gpus > 1:  # the config's layout
            shard_degree = cfg.model.shard_degree or args.gpus // max(groups, 1)  # expert groups: each group's
        sequence = args.sequence_degree if args.sequence_degree is not None else cfg.model.sequence_degree
        layout = planned_layout(cfg, gpus=args.gpus, expert_groups=groups,
                                shard_degree=shard_degree, sequence_degree=sequence)
    try:
        report = preflight_report(cfg, verify=args.verify, config_dir=Path(args.config).parent, gpus=args.gpus)
    except NoUsableSample as exc:  # the report is what the user needs: every skipped and ignored file
        _print(exc.report, args.json)
        raise UserError(exc.summary + " (every file is listed above)") from None
    except MissingModelFiles as exc:  # weights not downloaded yet: the plan is the answer to "will it fit?"
        _print(exc.report, args.json)
        _print_placement(cfg, args.gpus)
        _print_layout(cfg, exc.report, layout)
        raise UserError(str(exc)) from None
    _print(report, args.json)
    for line in alpha_schedule_lines(cfg):
        print(line)
    _print_placement(cfg, args.gpus)
    _print_layout(cfg, report, layout)
    return 0


def plan_for_card(cfg, gib: float):
    """``--vram-gb``: the config with ``model.vram_budget_gb = gib`` (the planner then chooses the block swap and
    activation offload the config set, which a budget replaces)."""
    import attrs

    model = attrs.evolve(cfg.model, vram_budget_gb=gib, blocks_to_swap=0, offload_activations=False)
    return attrs.evolve(cfg, model=model)


def _print_placement(cfg, gpus) -> None:
    """``model.expert_groups``: which ranks train which expert (and, sharded, which load and shard it)."""
    from wantrain.app.launch import expert_group_lines

    for line in expert_group_lines(cfg, gpus):
        print(line)


def _print_layout(cfg, report, layout) -> None:
    """``--gpus N``: the plan per GPU of the layout, the load's peak under FSDP included."""
    if layout is not None:
        from wantrain.app.launch import layout_lines

        print("\n".join(layout_lines(cfg, report, layout)))


def _print(report, json_path: Path | None) -> None:
    print(report.format())
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(report.to_json(), indent=2) + "\n")
