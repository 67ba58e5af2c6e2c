"""Padded rows weigh nothing, end to end (docs/distributed.md, "Every clip once"): two gloo ranks of 2 samples each
(a global batch of 4) train with ``data.remainder = "smaller_batch"``, so a bucket's last global batch holds 1 to 3
samples and ``TrainingData.rank_share`` repeats some to give every rank its 2 rows; one process with a batch of 4
trains the same plan, each short batch as it is. The repeated rows weigh 0 and the real ones ``ranks / size``
(``TrainingData.row_weights``): the two runs' losses and LoRA agree to float32 rounding (before: a short batch of 3
on 2 ranks weighed its samples 1/2, 1/4, 1/4)."""

from __future__ import annotations

import json
from pathlib import Path

import float32_bounds
import pytest
import test_distributed
from test_distributed import FSDP, LOSS_TOLERANCE, SETTINGS, in_process_run, metrics, only_run_dir, probe, torchrun

pytestmark = pytest.mark.slow

workspace = test_distributed.workspace  # its module fixture: the examples copied, the cache filled

STEPS = 8
SHORT = ["--max-steps", str(STEPS), "--set", "train.log_every=1", "--set", 'data.remainder="smaller_batch"']
LORA_DRIFT = float32_bounds.adamw_drift(STEPS, 3e-3)
"""The absolute bound on any LoRA element after 8 AdamW steps against one process (tests/float32_bounds.py)."""


def drawn(run_dir: Path) -> dict[int, int]:
    """Samples trained per step (the event log's BatchDrawn rows, padding left out)."""
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["step"]: len(e["samples"]) for e in events if e["_type"] == "BatchDrawn"}


def test_short_global_batches_padded_over_two_ranks_train_as_one_process(workspace):
    done = torchrun(workspace, "padded", *FSDP, *SHORT, "--set", "train.batch_size=2")
    assert done.returncode == 0, done.stderr[-3000:]
    single = in_process_run(workspace, "padded_one", *[x for item in SETTINGS for x in ("--set", item)], *FSDP,
                            *SHORT, "--set", "train.batch_size=4")
    two = only_run_dir(workspace / "padded")
    rows = drawn(two)
    assert rows == drawn(single) and any(n % 2 for n in rows.values()), rows  # a short batch 2 ranks pad
    split, one = metrics(two), metrics(single)
    assert [r["step"] for r in split] == [r["step"] for r in one] == list(range(1, STEPS + 1))
    assert [r["train/loss"] for r in split] == pytest.approx([r["train/loss"] for r in one], rel=LOSS_TOLERANCE)
    lora, expected = probe(workspace, "padded", 0)[1], probe(workspace, "padded_one", 0)[1]
    assert float32_bounds.largest_difference(lora, expected) <= LORA_DRIFT
