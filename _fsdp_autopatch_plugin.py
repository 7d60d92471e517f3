"""torch's plugin route: arms the package in interpreters that never read its ``.pth`` file.

From torch 2.5 the last step of ``import torch`` loads every entry point of the group
``torch.backends`` and calls it (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off for all of
them). The group is meant for out-of-tree device backends; this package uses it for the one
thing its ``.pth`` line does, calling ``arm()``, so that ``pip install --target`` directories on
``PYTHONPATH`` and images that strip ``.pth`` files are fixed too. Where the ``.pth`` line already
ran, ``arm()`` returns at once: arming happens once.

torch turns anything that loading or calling an entry point raises into a failed ``import
torch``, for everyone in the environment. So this module sits at the root of site-packages, apart
from the package (like setuptools' ``_distutils_hack``): loading it imports only ``os`` and ``sys``, even
where the package is broken or half removed. ``autoload`` catches everything, prints nothing, keeps
what it caught in ``error`` (``status()`` names it), and imports only the start-up module, which
arms with the standard library: wrapt and the hooks load later, when FSDP2, composable DDP or
transformers is imported, as under the ``.pth``.
"""

import os
import sys

PACKAGE = "fsdp_autopatch"
# The switch and its off values, as the start-up module spells them (tests/test_startup.py keeps
# the spellings in step): read here first, so that a disabled interpreter imports nothing of the
# package on this route either.
MODE_VARIABLE = "FSDP_AUTOPATCH"
OFF_VALUES = ("0", "off", "false", "no", "disable")
# What arming caught here ("<type>: <message>"), where the package itself could not keep it.
error = None


def autoload() -> None:
    """The entry point torch calls (torch's own word for it: device backend autoload)."""
    global error
    try:
        if os.environ.get(MODE_VARIABLE, "").strip().lower() in OFF_VALUES:
            return
        package = sys.modules.get(PACKAGE)
        if package is not None and not hasattr(package, "arm"):
            # torch ran the entry point while the start-up module itself was being imported
            # (an import hook that imports torch first): it arms when its import ends.
            package.arm_when_imported = True  # type: ignore[attr-defined]
            return
        import fsdp_autopatch

        fsdp_autopatch.arm(fsdp_autopatch.PLUGIN_ROUTE)
    except Exception as caught:  # import torch must never fail because of this package
        error = f"{type(caught).__name__}: {caught}"
