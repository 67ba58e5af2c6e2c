"""Following the config through the calls from ``app.assemble.prepare`` (issue 59): how often control returns from a
lower layer to a higher one, and how often the pre-flight is entered from the assembly:

    PYTHONPATH=. python bench/trace_preflight.py [--config examples/quickstart.toml] [--in-pass]

What it counts (the issue does not write its own method down; this is the one the figures in its closing note use):

* ``sys.setprofile`` records every Python call made while ``prepare()`` runs on the config (the tiny model: it
  loads and fills the demo data's cache in a temporary copy of the config's folder).
* A call *follows the config* when one of its arguments is a config section (a wantrain attrs class named
  ``...Config`` or ``...Section``). A section's own methods and properties are the config itself, not a step
  through a layer, and are not counted.
* The layers (docs/architecture.md) are core 0, the plug-ins (models, data, optimizers, schedulers) 1, observers 2,
  app 3, cli 4. A *return to a higher layer* is a call that follows the config, made from a module of a higher
  layer into one of a lower layer (whose return hands control back up), counted once per distinct called function
  (``returns_to_a_higher_layer``) and per call (``returns_per_call``).
* Calls made under the one pre-flight pass are counted apart (``inside_the_pass``): the pass is
  ``app.run_plan.plan_run`` (the run's pre-flight, which asks every capability in turn by design: the rules, the
  data, the plans) and ``app.preflight.problems`` / ``config_problems`` (the rules alone, which the config
  loader also asks). ``--in-pass`` lists those functions too.
* The pre-flight is *entered* once per call that follows the config from ``app/assemble.py`` into a pre-flight
  module (:data:`PREFLIGHT`). Prints JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

LAYERS = {"core": 0, "models": 1, "data": 1, "optimizers": 1, "schedulers": 1, "observers": 2, "app": 3, "cli": 4}
PREFLIGHT = tuple(f"wantrain/app/{name}.py" for name in
                  ("preflight", "run_plan", "launch", "memory_plan", "device_plan", "notes"))
"""The pre-flight's modules: the pass, the run's pre-flight, and the plans and checks they ask."""
PASS = {("wantrain/app/run_plan.py", "plan_run"), ("wantrain/app/preflight.py", "problems"),
        ("wantrain/app/preflight.py", "config_problems")}


def layer_of(filename: str) -> int | None:
    parts = Path(filename).parts
    if "wantrain" not in parts:
        return None
    rest = parts[parts.index("wantrain") + 1:]
    return LAYERS.get(rest[0]) if rest else None


def is_section(value) -> bool:
    kind = type(value)
    return kind.__module__.startswith("wantrain") and kind.__name__.endswith(("Config", "Section"))


def follows_config(frame) -> bool:
    """A function given a config section (not a section's own method or property: that is the config itself)."""
    code = frame.f_code
    names = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
    if names and names[0] == "self" and is_section(frame.f_locals.get("self")):
        return False
    return any(is_section(frame.f_locals.get(name)) for name in names)


def inside_the_pass(frame) -> bool:
    """Whether ``frame`` runs under the one pre-flight pass (:data:`PASS`)."""
    while frame is not None:
        code = frame.f_code
        if any(code.co_filename.endswith(path) and code.co_name == name for path, name in PASS):
            return True
        frame = frame.f_back
    return False


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="examples/quickstart.toml")
    parser.add_argument("--in-pass", action="store_true", help="list the functions the one pass calls too")
    args = parser.parse_args()
    from wantrain.app.assemble import prepare
    from wantrain.app.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(args.config).resolve()
        shutil.copytree(source.parent, Path(tmp) / "examples", ignore=shutil.ignore_patterns(".wantrain_cache"))
        config = Path(tmp) / "examples" / source.name
        cfg = load_config(config)
        returns: dict[str, int] = {}
        in_pass: dict[str, int] = {}
        entered = []

        def profile(frame, event, arg):
            if event != "call":
                return
            caller = frame.f_back
            if caller is None:
                return
            low, high = layer_of(frame.f_code.co_filename), layer_of(caller.f_code.co_filename)
            if low is None or high is None or not follows_config(frame):
                return
            name = f"{Path(frame.f_code.co_filename).relative_to(Path(frame.f_code.co_filename).parents[2])}:" \
                   f"{frame.f_code.co_name}"
            if low < high:
                counted = in_pass if inside_the_pass(frame) else returns
                counted[name] = counted.get(name, 0) + 1
            if caller.f_code.co_filename.endswith("wantrain/app/assemble.py") and \
                    frame.f_code.co_filename.endswith(PREFLIGHT):
                entered.append(name)

        sys.setprofile(profile)
        try:
            prepared = prepare(cfg, config_dir=config.parent)
        finally:
            sys.setprofile(None)
        prepared.release()
    print(json.dumps({"config": args.config, "returns_to_a_higher_layer": len(returns),
                      "returns_per_call": sum(returns.values()), "functions": sorted(returns),
                      "preflight_entered": len(entered), "preflight_calls": entered,
                      "inside_the_pass": {"functions": len(in_pass), "calls": sum(in_pass.values()),
                                          **({"list": sorted(in_pass)} if args.in_pass else {})}}, indent=2))


if __name__ == "__main__":
    main()
