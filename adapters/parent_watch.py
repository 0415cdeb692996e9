"""Run a command that dies with its parent: `python -m adapters.parent_watch PARENT_PID -- CMD ...`.

Sets the Linux parent-death signal (SIGTERM) on itself, checks the parent is still the one that
started it, then execs CMD, which inherits the setting. So an instance the console launched stops
by itself when the console dies in any way — SIGKILL and a closed terminal included — without
the console having to run any code. Elsewhere (no prctl) CMD runs unguarded and the console's
pid files (adapters/orphans.py) let the next console find it.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def guard_parent_death() -> bool:
    """Ask the kernel to SIGTERM this process when its parent dies; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m adapters.parent_watch PARENT_PID -- CMD [ARG...]")
    parent = int(argv[0])
    guard_parent_death()
    if os.getppid() != parent:  # the parent died before the guard was set: do not start at all
        sys.exit(f"parent {parent} is gone; not starting {argv[2]}")
    try:
        os.execvp(argv[2], argv[2:])
    except OSError as e:
        sys.exit(f"cannot run {argv[2]!r}: {e.strerror}")


if __name__ == "__main__":
    main(sys.argv[1:])
