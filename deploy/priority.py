"""Scheduling priority of the deployment's processes.

Ray starts its worker processes at nice 15, and on Linux niceness belongs to each thread: a
process that renices only the thread it runs on keeps Ray's threads (an async actor's event
loop among them) at 15. Against ranks computing at nice 0 such a thread gets a few percent
of a core, so every request and output batch that passes through it waits behind the
forward. And a rank's OpenMP threads stall at every barrier while one of them is preempted,
so ranks too run at normal priority.

Where the kernel groups processes by session (autogroup, the default of desktop and many
server kernels), it shares the cores between sessions first, and nice values count only
within a session. A Ray head in a session of its own, its ranks always runnable, then keeps
threads of other sessions (the client that started it, an HTTP server in another terminal,
kernel workers) from a core for long stretches, unless its session yields (a positive
session niceness; README, "Every process of a deployment runs at normal priority").
"""
from __future__ import annotations

import logging
import os

__all__ = ["restore_priority", "set_session_niceness", "session_niceness"]

log = logging.getLogger("tierserve.priority")

_TASKS = "/proc/self/task"


def restore_priority() -> None:
    """Every thread of this process to normal priority (threads started later inherit it from
    the thread that starts them), where we may."""
    try:
        tids = [int(t) for t in os.listdir(_TASKS)] if os.path.isdir(_TASKS) else [0]
    except OSError:
        tids = [0]
    try:
        for tid in tids:
            try:
                if os.getpriority(os.PRIO_PROCESS, tid) > 0:
                    os.setpriority(os.PRIO_PROCESS, tid, 0)
            except ProcessLookupError:  # the thread ended meanwhile
                continue
    except OSError as e:  # lowering niceness needs CAP_SYS_NICE or RLIMIT_NICE
        log.warning("could not restore normal scheduling priority (%s); requests may wait "
                    "behind the forward on busy machines", e)


def _autogroup(pid: int | str) -> str:
    return f"/proc/{pid}/autogroup"


def set_session_niceness(pid: int | str, nice: int) -> bool:
    """The nice value of the autogroup (session) `pid` belongs to; False where there are no
    autogroups or we may not set it."""
    try:
        with open(_autogroup(pid), "w") as f:
            f.write(str(nice))
        return True
    except OSError:
        return False


def session_niceness(pid: int | str) -> int | None:
    """The nice value of `pid`'s autogroup, or None where there are none."""
    try:
        with open(_autogroup(pid)) as f:
            return int(f.read().rsplit("nice", 1)[1])
    except (OSError, IndexError, ValueError):
        return None
