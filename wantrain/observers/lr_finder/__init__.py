"""The learning-rate range test (``[lr_finder]``, docs/lr_finder.md): the observer, its math, config and chart."""
