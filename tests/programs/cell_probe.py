"""Run in a matrix cell's interpreter by tests/matrix.py: which models this transformers can
build, and their classes; with the Python, torch and transformers versions. One JSON line.

    FSDP_AUTOPATCH=0 python tests/programs/cell_probe.py
"""

import abc
import json
import sys

import torch
import transformers

from fsdp_autopatch import _verify

models = {}
for kind in _verify.MODELS:
    try:
        cls = type(_verify.build_model(kind))
    except Exception as error:
        models[kind] = {"available": False, "error": f"{type(error).__name__}: {error}"[:300]}
    else:
        models[kind] = {"available": True, "class": cls.__name__, "abc_in_mro": abc.ABC in cls.__mro__}
print(json.dumps({"python": sys.version.split()[0], "torch": torch.__version__,
                  "transformers": transformers.__version__, "models": models}))
