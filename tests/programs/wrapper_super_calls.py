"""Which names the wrapper classes of the installed torch's (and megatron-fsdp's) sites look up
through zero-argument ``super()``, per method, for tests/test_sites.py; one JSON line.

    python tests/programs/wrapper_super_calls.py

The fix gives no mirror to a module class that defines a method the wrapper's same-named method
reaches with ``super()``; that covers every case only while the wrappers call ``super()`` for
their own name alone, which this reads from their bytecode.
"""

import dis
import importlib
import json

from fsdp_autopatch import _sites


def super_names(code):
    """The attribute names ``code`` looks up as ``super().name`` (3.11's LOAD_GLOBAL super, a call
    with no arguments, LOAD_ATTR or LOAD_METHOD; 3.12+'s LOAD_SUPER_ATTR)."""
    names, after_super = [], False
    for instruction in dis.get_instructions(code):
        if instruction.opname == "LOAD_SUPER_ATTR":
            names.append(instruction.argval)
        elif instruction.opname == "LOAD_GLOBAL" and instruction.argval == "super":
            after_super = True
        elif after_super and instruction.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            names.append(instruction.argval)
            after_super = False
    return names


report = {}
for site in _sites.SITES:
    try:
        module = importlib.import_module(site.module)
    except ImportError:
        continue
    wrapper = next((getattr(module, name) for name in site.wrappers if hasattr(module, name)), None)
    if not isinstance(wrapper, type):
        continue
    for cls in wrapper.__mro__[:-1]:
        for name, value in vars(cls).items():
            function = getattr(value, "__func__", value)
            code = getattr(function, "__code__", None)
            if code is not None and "__class__" in code.co_freevars:
                report[f"{cls.__module__}.{cls.__qualname__}.{name}"] = super_names(code)
print(json.dumps(report))
