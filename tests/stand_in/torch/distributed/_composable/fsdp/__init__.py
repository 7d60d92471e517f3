"""torch 2.4 - 2.5's FSDP2 package, kept in 2.6+ as a shim that re-exports fully_shard."""

from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["FSDPModule", "fully_shard"]
