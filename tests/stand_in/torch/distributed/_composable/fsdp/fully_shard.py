from torch.distributed.fsdp import FSDPModule, fully_shard  # noqa: F401 (the 2.6+ shim)
