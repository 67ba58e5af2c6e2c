"""The Wan 2.2 adapter provides every capability the built-in observers declare (``core.adapter``)."""

from __future__ import annotations

from tests.models.wan22_helpers import make_adapter
from wantrain.core.adapter import (
    AlphaChangeable,
    Evaluating,
    ModelAdapter,
    SamplingCapable,
    TextEncoding,
    TimestepPinning,
    ValidationCapable,
    check_needs,
)
from wantrain.observers.alpha.controller import AlphaController
from wantrain.observers.evaluation.samples import SampleVideos
from wantrain.observers.evaluation.validation import Validation


def test_the_wan22_adapter_has_every_capability_the_built_in_observers_need():
    adapter = make_adapter("tiny-t2v", gradient_checkpointing=False)
    for capability in (ModelAdapter, Evaluating, ValidationCapable, SamplingCapable, TextEncoding, TimestepPinning,
                       AlphaChangeable):
        assert isinstance(adapter, capability), capability.__name__
    for observer in (AlphaController, SampleVideos, Validation):
        check_needs(observer, adapter)  # raises MissingCapability otherwise
    assert adapter.boundary_ratio == adapter.spec.boundary_ratio is not None
