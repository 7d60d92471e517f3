"""``python -m fsdp_autopatch``: the same command line as the ``fsdp-autopatch`` script."""

import sys

from fsdp_autopatch._cli import main

sys.exit(main())
