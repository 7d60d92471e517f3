"""A spec of a watched module, found before its import (``importlib.util.find_spec``), then
pickled and deep-copied, for tests/test_startup.py; one JSON line: the copies' loaders' types.

    python tests/programs/spec_copies.py
"""

import copy
import importlib.util
import json
import pickle

spec = importlib.util.find_spec("torch.distributed.fsdp")
assert spec is not None
copies = {"pickled": pickle.loads(pickle.dumps(spec)), "deep-copied": copy.deepcopy(spec)}
print(json.dumps({how: [type(found.loader).__name__, found.name, found.origin == spec.origin]
                  for how, found in copies.items()}))
