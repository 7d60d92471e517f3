"""A prepared interpreter for the tests: started once, it imports what every prepared case
imports first (torch's FSDP2, transformers, the tiny models' module), then forks a child per case.

    python tests/programs/prepared.py REPLY_FD

Each case is a program file of tests/ or code, run in a forked child as ``python program args``
or ``python -c code`` would run it: its own ``__main__``, argv, environment, working directory,
stdout and stderr files, exit code, ``atexit`` handlers and non-daemon threads joined at the end.
What the child cannot have is a fresh start: the start-up files ran, and both packages were
imported, in this process, with the environment it was started with. So it serves the cases that
begin by importing FSDP2 and transformers and are about what happens next (sharding, training,
classes, side effects), never those about start-up or import order, which keep a fresh
interpreter (``conftest.run_program``). Nothing else is imported ahead: a case's status lists
the sites a fresh interpreter would list after the same imports.

Requests are JSON lines on stdin; replies JSON lines on ``REPLY_FD``: ``{"ready": true}`` once
the imports are done, then per case ``{"pid": N}`` and ``{"returncode": N}``. stdin at its end
(the test process gone) ends this process.
"""

from __future__ import annotations

import atexit
import builtins
import importlib
import json
import os
import runpy
import sys
import threading
import traceback
from typing import Any, TextIO

from fsdp_autopatch import FSDP2_PACKAGES

FSDP2_PACKAGE = FSDP2_PACKAGES[0]

# What every prepared case imports first (FSDP2 imports composable DDP too), the tiny models'
# module (tests/programs/scenario.py, fsdp_autopatch._verify) and the package's proof.
PREPARED_IMPORTS = (FSDP2_PACKAGE, "transformers", "transformers.models.qwen2.modeling_qwen2",
                    "fsdp_autopatch._verify")


def prepare() -> None:
    for name in PREPARED_IMPORTS:
        importlib.import_module(name)


def exit_code(error: SystemExit) -> int:
    """What the interpreter would exit with for ``raise SystemExit(error.code)``."""
    if error.code is None:
        return 0
    if isinstance(error.code, int):
        return error.code
    print(error.code, file=sys.stderr)
    return 1


def run_case(request: dict[str, Any]) -> None:
    """In the forked child: become the case's process, run it, exit with its code."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)  # never the requests' pipe
    os.close(null)
    sys.stdin = open(0, closefd=False)
    code = 0
    try:
        if "code" in request:
            sys.argv = ["-c", *request["args"]]
            sys.path[0] = ""
            namespace = {"__name__": "__main__", "__builtins__": builtins}
            exec(compile(request["code"], "<string>", "exec"), namespace)
        else:
            sys.argv = [request["program"], *request["args"]]
            sys.path[0] = os.path.dirname(request["program"])
            runpy.run_path(request["program"], run_name="__main__")
    except SystemExit as error:
        code = exit_code(error)
    except BaseException:  # as the interpreter would: the traceback, exit 1
        traceback.print_exc()
        code = 1
    # What an interpreter does on its way out: join non-daemon threads, run atexit handlers.
    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def reply(channel: TextIO, **message: Any) -> None:
    channel.write(json.dumps(message) + "\n")
    channel.flush()


def main() -> None:
    channel = os.fdopen(int(sys.argv[1]), "w")
    prepare()
    reply(channel, ready=True)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            run_case(request)
        reply(channel, pid=pid)
        _, status = os.waitpid(pid, 0)
        reply(channel, returncode=os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
