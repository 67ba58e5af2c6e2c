"""wantrain.data: folders of images and videos with captions -> bucketed, cached training batches.

The lead's entry points::

    data = build_dataset(cfg.data, spec=variant_spec(cfg.model.variant), seed=cfg.run.seed,
                         batch_size=cfg.train.batch_size)
    print(data.report.format()); json.dump(data.report.to_json(), ...)
    for batch in data.batches(encoders):   # endless; batch["latents"], batch["text_embeds"], batch["bucket"], ...
        ...
    ensure_cache(data, encoders)           # `wantrain cache`

See docs/data.md.
"""

from wantrain.data.cache import CacheStats
from wantrain.data.clips import Clip, MediaEncoders
from wantrain.data.config import DataConfig, DatasetConfig
from wantrain.data.dataset import build_dataset
from wantrain.data.fingerprints import DataChanged  # registers the event type: every reader of a log knows it
from wantrain.data.report import PreflightReport
from wantrain.data.training import TrainingData, ensure_cache

__all__ = [
    "CacheStats", "Clip", "DataChanged", "DataConfig", "DatasetConfig", "MediaEncoders", "PreflightReport",
    "TrainingData", "build_dataset", "ensure_cache",
]
