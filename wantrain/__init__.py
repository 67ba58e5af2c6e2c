"""wantrain: a LoRA trainer for the Wan 2.2 video diffusion models, built on an event-driven core."""

__version__ = "0.1.0"
