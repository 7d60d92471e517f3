"""fully_shard from racing threads, for tests/test_concurrency.py: per round, two threads per
class shard models of two classes at once (the affected transformers heads first, then fresh
ABC classes of a user's); one JSON line with the status and, per round, the classes built.

    python tests/programs/shard_in_threads.py ROUNDS
"""

import abc
import json
import sys
import threading
import types

import torch
import torch.distributed as dist
import torch.distributed.fsdp
import torch.distributed.fsdp._fully_shard._fully_shard as site
import transformers  # noqa: F401 (an affected release arms the patch)
from torch.distributed.fsdp import FSDPModule, fully_shard

import fsdp_autopatch
from fsdp_autopatch import _verify

ROUNDS = int(sys.argv[1])
COPIES = 2  # models per class: threads race on one class as well as across classes
mesh = _verify.init_process_group()


def user_heads(round_):
    # Fresh classes each round, so every round's first fully_shard misses the class cache.
    def body(namespace):
        def __init__(self):
            torch.nn.Module.__init__(self)
            self.linear = torch.nn.Linear(4, 4)

        namespace["__init__"] = __init__
        namespace["forward"] = lambda self, x: self.linear(x)

    return [types.new_class(f"Head{round_}x{k}", (abc.ABC, torch.nn.Module), exec_body=body)
            for k in range(2)]


def shard_together(models):
    barrier = threading.Barrier(len(models))
    outcomes = [None] * len(models)

    def worker(index):
        barrier.wait()
        try:
            fully_shard(models[index], mesh=mesh)
            outcomes[index] = ""
        except Exception as error:
            outcomes[index] = f"{type(error).__name__}: {error}"

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(models))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


rounds = []
for round_ in range(ROUNDS):
    if round_ == 0:
        # The transformers heads that inherit abc.ABC: two different classes.
        kinds = ["token-classification", "sequence-classification"]
        models = [_verify.build_model(kind) for kind in kinds for _ in range(COPIES)]
    else:
        models = [cls() for cls in user_heads(round_) for _ in range(COPIES)]
    originals = [type(model) for model in models]
    outcomes = shard_together(models)
    by_original = {}
    for original, model in zip(originals, models):
        by_original.setdefault(original, set()).add(type(model))
    sharded = all(outcome == "" for outcome in outcomes)
    trained = False
    if sharded and round_ == 0:
        for kind, model in zip(kinds, models[::COPIES]):
            model(**_verify.make_batch(kind, 0)).loss.backward()
        trained = True
    rounds.append({
        "errors": [outcome for outcome in outcomes if outcome],
        "originals": len(by_original),
        "wrappers_per_original": sorted(len(wrappers) for wrappers in by_original.values()),
        "distinct_wrappers": len(set().union(*by_original.values())),
        "cached": sharded and all(
            site.cls_to_fsdp_cls.get(original) is next(iter(wrappers))
            for original, wrappers in by_original.items()),
        "fsdp_modules": sharded and all(
            isinstance(model, FSDPModule) and type(model).__mro__[2] is original
            for original, model in zip(originals, models)),
        "trained": trained,
    })
dist.destroy_process_group()
print(json.dumps({"status": fsdp_autopatch.status().to_dict(), "rounds": rounds}))
