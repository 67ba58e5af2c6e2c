"""The core's multi-process parts: how ranks exchange (``distributed``), how sharded tensors are gathered and
rebuilt (``sharding``), the expert-per-group layout (``expert_groups``) and its relay of sampling requests to the
serving rank (``expert_relay``). Imports only core."""
