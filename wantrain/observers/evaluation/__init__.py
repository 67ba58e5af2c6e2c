"""Evaluation during training (``[validation]``, ``[sample]``, docs/validation.md): validation loss at fixed
timesteps and noise, sample videos, and their config sections."""
