"""A process's identity beyond its pid: pid plus start time, so a reused pid is not mistaken
for the daemon that had it (nor is a zombie: its state is read too)."""

from __future__ import annotations


def process_start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), or None
    if there is no such live process (gone, or a zombie awaiting its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: fields resume after the last ')'
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_same_process_alive(pid: int, start_time: int) -> bool:
    return process_start_time(pid) == start_time
