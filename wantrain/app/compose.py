"""The compose tables of the docs, generated from the refusals the code declares: docs/config.md's list of every
pair the pre-flight refuses (:func:`compose_markdown`, from the rules' ``pair``)."""

from __future__ import annotations

from wantrain.app.preflight import declared_rules


def compose_markdown() -> str:
    """docs/config.md's table of what composes with what, generated from the rules that refuse a pair
    (``app.preflight.declared_rules``; a test keeps the page equal to it)."""
    rows = sorted((r for r in declared_rules() if r.pair is not None), key=lambda r: (r.pair[0], r.pair[1]))
    lines = ["## What composes with what", "",
             "Every pair of settings the pre-flight refuses (generated from the capabilities' declared rules; any",
             "pair not listed composes). `wantrain check` reports each one it finds, with the others, before",
             "anything is loaded or written; the rule id names the rule in the code.", "",
             "| setting | does not compose with | rule | why |", "|---|---|---|---|"]
    lines += [f"| {r.pair[0]} | {r.pair[1]} | `{r.id}` | {r.summary} |" for r in rows]
    return "\n".join(lines) + "\n"
