"""The package version, in core so that every layer can read it without importing ``wantrain/__init__``."""

__version__ = "0.1.0"
