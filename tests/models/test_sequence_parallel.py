"""The one workaround ``wantrain.models.wan22.sequence`` carries for diffusers' context parallelism on a CPU,
checked on a fake process group (one process as rank 0 of 2; nothing is exchanged): diffusers 0.42.1 divides by
``torch.accelerator.device_count()`` (0 without an accelerator); ``enable_ulysses`` sets the parallelism up anyway.
When diffusers fixes it, the first assertion fails and the workaround can go."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from wantrain.models.wan22.sequence import enable_ulysses


@pytest.fixture
def fake_pair():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


def tiny_transformer():
    from diffusers import WanTransformer3DModel

    from wantrain.models.wan22.architecture import transformer_kwargs
    from wantrain.models.wan22.variants import VARIANTS

    return WanTransformer3DModel(**transformer_kwargs(VARIANTS["tiny-ti2v"]))


@pytest.mark.skipif(torch.accelerator.device_count() > 0, reason="the division by zero needs a machine without "
                    "an accelerator")
def test_diffusers_context_parallelism_divides_by_zero_on_a_cpu_and_enable_ulysses_does_not(fake_pair):
    from diffusers import ContextParallelConfig

    with pytest.raises(ZeroDivisionError):
        tiny_transformer().enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    transformer = enable_ulysses(tiny_transformer(), 2)
    assert transformer._parallel_config.context_parallel_config.ulysses_degree == 2
    assert torch.accelerator.device_count() == 0  # the workaround ends with the call
