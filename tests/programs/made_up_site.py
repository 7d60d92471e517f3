"""For tests/test_sites.py: a torch release (made up, on the stand-in) that moves composable
DDP's class construction into a helper of another module with parameters of its own, and the
one ``Site`` row that follows it, put first in the table before anything reads it. Imports as a
training script does, replicates an ABC-first module and a plain one, and prints one JSON line:
the status, the classes built, the probe's answer and doctor's check at the made-up site.

    python tests/programs/made_up_site.py        # with the test's stand-in torch and transformers
"""

from fsdp_autopatch import _sites

# The helper's parameters, named in the order of _sites.HELPER_ROLES.
HELPER = ("torch.distributed._composable_state", "_wrap_class",
          ("targets", "cache", "wrapper_cls", "name_prefix", "deepcopy_fn"))
MADE_UP = _sites.Site(_sites.DDP_REPLICATE, (2, 13), _sites.DDP_MODULE, "replicate", ("DDP",), "DDP",
                      "unimplemented_deepcopy", builder=HELPER)
_sites.SITES = (MADE_UP, *_sites.SITES)

import torch  # noqa: E402
import torch.distributed._composable.replicate as ddp  # noqa: E402
import transformers  # noqa: E402, F401 (an affected release: the hooks decide)
from made_up_report import wrap_and_report  # noqa: E402

from fsdp_autopatch import _doctor, _patch  # noqa: E402

wrap_and_report(ddp.replicate, ddp.DDP, lambda: _patch.resolve(MADE_UP),
                lambda: _doctor.find_site(_sites.DDP_REPLICATE, torch.__version__))
