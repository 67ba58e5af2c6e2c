"""Ulysses sequence parallelism in ``wantrain run`` (``model.sequence_degree``, docs/distributed.md): two gloo ranks
under torchrun split every clip's tokens of the tiny T2V twin (both experts) and train what one process trains with
the same config: the ranks of the sequence group share the samples and the draws, their gradients are summed."""

from __future__ import annotations

from pathlib import Path

import float32_bounds
import pytest
from safetensors.torch import load_file
from test_distributed import (
    LOSS_TOLERANCE,
    grads,
    in_process_run,
    metrics,
    only_run_dir,
    probe,
    torchrun,
    worst_relative,
)
from test_end_to_end import copy_examples

ROOT_TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow

GRAD_TOLERANCE = float32_bounds.GRAD
"""Of the first step's gradients, per tensor (max |a - b| / max |b|): each attention sums its heads, and the group
its tokens' shares, in another order than one process (measured: 1.02e-6 and 1.13e-6 on two machines;
tests/float32_bounds.py derives the bound)."""
LORA_DRIFT = float32_bounds.adamw_drift(2, 3e-3)
"""The absolute bound on any element of the final LoRA after 4 AdamW steps, 2 per expert (tests/float32_bounds.py):
2.3e-6; measured 5.7e-8 (once 6.2e-5 of a lora_B's own largest element, two steps from zero)."""

SEQUENCE = ["train.max_steps=4", "train.log_every=1", "checkpoint.every=100", "observers.progress=false",
            "optimizer.lr=3e-3", "model.switch_every=2", "faults.oom_at_steps=[]", "data.resolutions=[32]"]
"""4 steps, both experts; 32x32 area buckets, whose tokens per clip are all even (2 to 12: 16x32x9 is 3 latent
frames of 1 x 2 tokens), as the degree needs (the quickstart's 48x80x9 has 45)."""


def test_a_two_rank_sequence_parallel_run_equals_the_one_process_run(tmp_path):
    """Degree 2 on 2 ranks (one sequence group, a global batch of 1) against one process of batch 1, 4 steps
    switching experts after 2: the same losses and first gradients within 1e-6 and the same LoRA within the
    AdamW tolerance of tests/test_distributed.py; both ranks end with the same LoRA."""
    copy_examples(tmp_path)
    (tmp_path / "distributed_probe.py").write_text((ROOT_TESTS / "distributed_probe.py").read_text())
    done = torchrun(tmp_path, "sequence", settings=[*SEQUENCE, "model.sequence_degree=2"])
    assert done.returncode == 0, done.stderr[-3000:]
    single = in_process_run(tmp_path, "single", *[x for item in SEQUENCE for x in ("--set", item)])
    split, one = metrics(only_run_dir(tmp_path / "sequence")), metrics(single)
    assert [r["step"] for r in split] == [r["step"] for r in one] == [1, 2, 3, 4]
    assert [r["train/loss"] for r in split] == pytest.approx([r["train/loss"] for r in one], rel=LOSS_TOLERANCE)
    assert worst_relative(grads(tmp_path, "sequence"), grads(tmp_path, "single")) <= GRAD_TOLERANCE
    (_, rank0), (_, rank1) = probe(tmp_path, "sequence", 0), probe(tmp_path, "sequence", 1)
    assert all(rank0[k].equal(rank1[k]) for k in rank0)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in rank0.items())  # both experts trained
    assert float32_bounds.largest_difference(rank0, probe(tmp_path, "single", 0)[1]) <= LORA_DRIFT
    exported = load_file(str(only_run_dir(tmp_path / "sequence") / "quickstart_low_noise.safetensors"))
    assert exported  # rank 0 wrote the files as a one-process run does
