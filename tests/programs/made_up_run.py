"""For tests/test_sites.py: a made-up torch release (made_up_releases.py) on the stand-in, its rows
in the package's tables from interpreter start (a ``.pth`` file the test writes). Imports as a
training script does, the release's new modules first, then every torch wrapper's package and
transformers; wraps an ABC-first module and a plain one with every torch wrapper; prints one JSON
line: the status when only the new modules were imported and at the end, per wrapper the row
the patch found, the probe's answer, the classes built and doctor's answer, and doctor's verdict.

    python tests/programs/made_up_run.py 99.1.0    # in the test's venv, whose stand-in torch is that release
"""

import abc
import importlib
import json
import sys
from typing import Any

import made_up_releases
import torch
import torch.nn

import fsdp_autopatch
from fsdp_autopatch import _doctor, _matrix, _patch, _sites


class Head(abc.ABC, torch.nn.Module):
    pass


class Plain(torch.nn.Module):
    pass


def wrapped(construction: _patch.Construction) -> dict[str, Any]:
    """What the API's entry, called as users call it, makes of each class."""
    site = construction.site
    entry = getattr(sys.modules[site.module], site.entry)
    classes: dict[str, Any] = {}
    for cls in (Head, Plain):
        module = cls()
        try:
            entry(module)
        except TypeError as error:
            classes[cls.__name__] = {"error": str(error)}
        else:
            classes[cls.__name__] = {"name": type(module).__name__,
                                     "is_wrapper": isinstance(module, construction.wrapper),
                                     "torch_bases": type(module).__bases__ == (construction.wrapper, cls)}
    return classes


release = made_up_releases.named(sys.argv[1])
for name in release.torch_modules:
    importlib.import_module(name)
at_new_modules = fsdp_autopatch.status().reason
apis = [api for api in _sites.APIS if _sites.distribution_of(api) == "torch"]
for api in apis:
    importlib.import_module(_sites.sites_of(api, _matrix.release(release.torch))[0].package)
import transformers  # noqa: E402, F401 (an affected release: the hooks decide)

wrappers: dict[str, Any] = {}
for api in apis:
    construction = _patch.resolve_api(api)
    doctor = _doctor.find_site(api, torch.__version__)
    wrappers[api] = {
        "row": construction and construction.site.key,
        "site": construction and construction.site.name,
        "probe": construction and _patch.probe(construction),
        "classes": construction and wrapped(construction),
        "doctor": {key: doctor[key] for key in ("known", "site_key", "fixed", "text")},
    }
report = _doctor.diagnose()
print(json.dumps({"at_new_modules": at_new_modules, "status": fsdp_autopatch.status().to_dict(),
                  "wrappers": wrappers, "doctor": {"outcome": report.outcome, "verdict": report.verdict}}))
