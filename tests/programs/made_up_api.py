"""For tests/test_sites.py: a made-up torch release with a new API, ``made_up.wrap``, in a module
of its own, and the rows CONTRIBUTING's recipe adds for it (the API, its site, the module watched),
put in the tables before anything reads them. Imports as a training script does, wraps an
ABC-first module and a plain one, and prints one JSON line: the status, the classes, the probe's
answer and doctor's check of the new API.

    python tests/programs/made_up_api.py        # with the test's stand-in torch (and its made_up module)
"""

from fsdp_autopatch import _sites

API = "test-only made-up wrap"
MODULE = "torch.distributed._composable.test_only_made_up"
# The recipe's rows: the API, its Site, the module to watch.
_sites.APIS = (*_sites.APIS, API)
_sites.SITES = (*_sites.SITES, _sites.Site(API, (2, 99), MODULE, "wrap", ("MadeModule",), "Made",
                                           "_unimplemented_deepcopy", "cls_to_made_cls"))
_sites.WATCHED_MODULES = (*_sites.WATCHED_MODULES, MODULE)

import torch.distributed._composable.test_only_made_up as made_up  # noqa: E402
import transformers  # noqa: E402, F401 (an affected release: the hooks decide)
from made_up_report import wrap_and_report  # noqa: E402

from fsdp_autopatch import _doctor, _patch  # noqa: E402

wrap_and_report(made_up.wrap, made_up.MadeModule, lambda: _patch.resolve_api(API),
                lambda: _doctor.find_site(API, "2.99.0"))
