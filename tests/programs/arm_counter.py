"""Copied into a throwaway site-packages as ``_arm_counter`` by tests/test_startup.py. Sorted ahead
of fsdp_autopatch.pth: counts the calls of arm() (by whichever file makes them) and the passes
over site-packages (CPython 3.11 reads a venv's site-packages twice).
"""

calls = 0
passes = 0


def wrap_arm():
    import fsdp_autopatch

    real = fsdp_autopatch.arm
    if getattr(real, "counted", False):
        return

    def arm():
        global calls
        calls += 1
        real()

    arm.counted = True
    fsdp_autopatch.arm = arm
