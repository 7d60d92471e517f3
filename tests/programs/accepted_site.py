"""For tests/test_api.py: composable DDP's stand-in site, edited so that CPython accepts torch's
own class for an ABC module there (as CPython 3.15 does everywhere), replicates a user's
``Generic[T]``-first module, which CPython refuses on every version. Prints one JSON line.

    python tests/programs/accepted_site.py        # with the test's stand-in torch and transformers
"""

import json
import typing

import torch.distributed._composable.replicate as ddp
import torch.nn
import transformers  # noqa: F401 (an affected release: the hooks decide)

import fsdp_autopatch

T = typing.TypeVar("T")


class GenericHead(typing.Generic[T], torch.nn.Module):
    pass


module = GenericHead()
try:
    ddp.replicate(module)
except TypeError as error:
    outcome = str(error)
else:
    outcome = type(module).__name__
print(json.dumps({"status": fsdp_autopatch.status().to_dict(), "outcome": outcome}))
