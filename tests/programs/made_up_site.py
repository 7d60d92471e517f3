"""For tests/test_sites.py: a torch release (made up, on the stand-in) that moves composable
DDP's class construction into a helper of another module with parameters of its own, and the
one ``Site`` row that follows it, put first in the table before anything reads it. Imports as a
training script does, replicates an ABC-first module and a plain one, and prints one JSON line:
the status, the classes built, the probe's answer and doctor's check at the made-up site.

    python tests/programs/made_up_site.py        # with the test's stand-in torch and transformers
"""

import abc
import json

from fsdp_autopatch import _sites

# The helper's parameters, named in the order of _sites.HELPER_ROLES.
HELPER = ("torch.distributed._composable_state", "_wrap_class",
          ("targets", "cache", "wrapper_cls", "name_prefix", "deepcopy_fn"))
MADE_UP = _sites.Site(_sites.DDP_REPLICATE, (2, 13), _sites.DDP_MODULE, "replicate", ("DDP",), "DDP",
                      "unimplemented_deepcopy", builder=HELPER)
_sites.SITES = (MADE_UP, *_sites.SITES)

import torch.distributed._composable.replicate as ddp  # noqa: E402
import torch.nn  # noqa: E402
import transformers  # noqa: E402, F401 (an affected release: the hooks decide)

import fsdp_autopatch  # noqa: E402
from fsdp_autopatch import _doctor, _patch  # noqa: E402


class Head(abc.ABC, torch.nn.Module):
    pass


class Plain(torch.nn.Module):
    pass


classes = {}
for cls in (Head, Plain):
    module = cls()
    try:
        ddp.replicate(module)
    except TypeError as error:
        classes[cls.__name__] = {"error": str(error)}
    else:
        classes[cls.__name__] = {"name": type(module).__name__, "is_ddp": isinstance(module, ddp.DDP),
                                 "torch_bases": type(module).__bases__ == (ddp.DDP, cls)}
construction = _patch.resolve(MADE_UP)
print(json.dumps({
    "status": fsdp_autopatch.status().to_dict(),
    "classes": classes,
    "resolved": construction is not None,
    "probe": construction and _patch.probe(construction),
    "doctor": _doctor.find_site(_sites.DDP_REPLICATE, torch.__version__),
}))
