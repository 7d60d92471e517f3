"""``fsdp-autopatch verify`` where no temporary directory can be used, as in a container whose
root is read-only, for tests/test_cli.py:

    python tests/programs/no_temp_dir.py [VERIFY ARGS]

Python's tempfile tries TMPDIR, TEMP, TMP, /tmp, /var/tmp, /usr/tmp and the working directory
(``tempfile._candidate_tempdir_list``), and raises FileNotFoundError("No usable temporary
directory found in [...]") when it can write in none: here every one it would try is a
directory that does not exist.
"""

import sys
import tempfile

tempfile.tempdir = None
tempfile._candidate_tempdir_list = lambda: ["/nonexistent/tmp", "/nonexistent/var/tmp"]  # type: ignore[attr-defined]

from fsdp_autopatch._cli import main  # noqa: E402

sys.exit(main(["verify", *sys.argv[1:]]))
