"""The frameworks that shard reward models and critics, run for real with and without the patch.

Collected only when asked for (``nox -f tests/noxfile.py -s stacks``, ``FSDP_AUTOPATCH_STACKS=1``
or ``pytest -m stacks``): they need accelerate, TRL, PEFT, datasets and verl installed.
"""
