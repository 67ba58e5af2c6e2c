"""The training core: loop, bus, control, state, config machinery and run directory.

``wantrain.core`` imports nothing from ``wantrain.observers``, ``wantrain.models``, ``wantrain.data`` or
``wantrain.cli``; those plug into it through events, the control object and the adapter protocol.
"""
