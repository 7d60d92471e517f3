from ._fully_shard import FSDPModule, fully_shard

__all__ = ["FSDPModule", "fully_shard"]
