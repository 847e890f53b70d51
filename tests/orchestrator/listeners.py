"""Every TCP port this process and its descendants listen on while a run goes (a thread sampling psutil), for the
tests that check where a run's ports are reachable from."""

from __future__ import annotations

import ipaddress
import threading
from typing import Iterable

import psutil


class Listeners:
    """`with Listeners() as seen:` ... `seen.ports`: {(address, process name): ports} of every listening TCP socket
    this process tree had at any sample (every `every_s` seconds, and once more at the end of the block)."""

    def __init__(self, every_s: float = 0.5) -> None:
        self.every_s = every_s
        self.ports: dict[tuple[str, str], set[int]] = {}
        self.by_pid: dict[int, set[tuple[str, int]]] = {}
        """pid -> (address, port) of each listening socket it had at a sample."""
        self._lock = threading.Lock()  # samples come from the thread and from `sample` called elsewhere
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="listeners")

    def __enter__(self) -> "Listeners":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.sample()

    def sample(self, pids: Iterable[int] = ()) -> None:
        """This process tree's listening sockets now, and those of `pids` (processes of a run known otherwise, e.g.
        from its process record, below this process or not)."""
        me = psutil.Process()
        try:
            procs = [me, *me.children(recursive=True)]
        except psutil.Error:
            procs = [me]
        for pid in set(pids) - {p.pid for p in procs}:
            try:
                procs.append(psutil.Process(pid))
            except psutil.Error:
                pass
        with self._lock:
            for proc in procs:
                try:
                    name = proc.name()
                    for conn in proc.net_connections(kind="tcp"):
                        if conn.status == psutil.CONN_LISTEN:
                            self.ports.setdefault((conn.laddr.ip, name), set()).add(conn.laddr.port)
                            self.by_pid.setdefault(proc.pid, set()).add((conn.laddr.ip, conn.laddr.port))
                except psutil.Error:  # gone meanwhile
                    pass

    def reachable_from_outside(self) -> list[str]:
        """'address:ports (process)' for each listener not on a loopback address."""
        return [f"{ip}:{sorted(ports)} ({name})" for (ip, name), ports in sorted(self.ports.items())
                if not is_loopback(ip)]


def is_loopback(ip: str) -> bool:
    """127.0.0.0/8, ::1, and IPv4 loopback written as IPv6 (`::ffff:127.0.0.1`: Ray's gRPC servers on a dual-stack
    socket), which Python 3.11's `is_loopback` does not count."""
    address = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback
