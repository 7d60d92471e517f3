"""FSDP2's public package, as torch 2.6+ has it."""

from ._fully_shard import FSDPModule, fully_shard

__all__ = ["FSDPModule", "fully_shard"]
