"""The application layer: the one assembly of a run and its modes (train, LR finder, replay), the root config
schema, the table of built-in observers and logging setup. Imports anything below it, never ``wantrain.cli``."""
