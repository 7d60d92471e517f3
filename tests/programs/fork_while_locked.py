"""A thread holds the hooks' lock, the patch's lock and the class records' lock when another
forks (tests/test_hooks.py): the child, which has no such thread, must still take them all
through the package's one fork handler. Prints the child's exit code: 0 when it could.

    FSDP_AUTOPATCH=0 python tests/programs/fork_while_locked.py
"""

import os
import signal
import threading

import site_stand_in as module

import fsdp_autopatch
from fsdp_autopatch import _classes, _hooks, _patch, _sites

fsdp_autopatch.register_fork_handler()  # as arm() does at start-up


class Original:
    pass


site = _sites.Site("stand-in API", (0,), module.__name__, "wrap", ("Wrapper",), "W", "deepcopy")
_patch.install(_patch.resolve(site))
held, release = threading.Event(), threading.Event()


def hold() -> None:
    with _hooks._lock, _patch._lock, _classes.records._lock:
        held.set()
        release.wait()


threading.Thread(target=hold, daemon=True).start()
held.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a deadlocked child dies of SIGALRM instead of hanging the test
    _hooks.current_status()
    built = module.wrap(Original())
    os._exit(0 if built.__bases__ == (module.Wrapper, Original) else 3)
_, code = os.waitpid(pid, 0)
release.set()
print(os.waitstatus_to_exitcode(code))
