"""A Ray Serve replica's processes on this machine, for the benchmarks that kill one: found by
the title Ray gives a replica's worker among the descendants of a process we started (`make
dev`, a `ray start` node), and how busy each is (its tree's CPU, its open connections)."""

from __future__ import annotations

import re

import psutil


def is_replica_title(cmdline: list[str], deployment: str) -> bool:
    """Ray retitles a replica's worker `ray::ServeReplica:<app>:<deployment>[.<method>]`, or
    while it is created `ray::SERVE_REPLICA::<app>#<deployment>#<id>:ServeReplica:...`; the
    title may be padded with blanks, so look at the first word."""
    words = " ".join(cmdline).split()
    pattern = rf"ServeReplica:[^:#]+:{re.escape(deployment)}(\.\w+)?$"
    return bool(words) and words[0].startswith("ray::") and re.search(pattern, words[0]) is not None


def replica_processes(root_pid: int, deployment: str) -> list[psutil.Process]:
    """The replica actors of `deployment` (`LLMServer:<model>`) among `root_pid`'s descendants."""
    found = []
    for process in psutil.Process(root_pid).children(recursive=True):
        try:
            if is_replica_title(process.cmdline(), deployment):
                found.append(process)
        except psutil.NoSuchProcess:
            continue
    return found


def established(process: psutil.Process) -> int:
    """ESTABLISHED TCP connections of `process` (0 for one gone): HAProxy holds one to the replica
    per request in flight, beside the replica's own steady connections to Ray."""
    try:
        return sum(1 for c in process.net_connections(kind="tcp") if c.status == psutil.CONN_ESTABLISHED)
    except psutil.NoSuchProcess:
        return 0


def tree_cpu_s(process: psutil.Process) -> float:
    """CPU seconds of `process` and its descendants (its engine); 0 for one gone."""
    total = 0.0
    try:
        for member in (process, *process.children(recursive=True)):
            times = member.cpu_times()
            total += times.user + times.system
    except psutil.NoSuchProcess:
        pass
    return total
