"""Peak memory of the test servers, for the suite's closing line (see ``pytest_terminal_summary`` in conftest)."""

from __future__ import annotations

server_peaks_kib: list[int] = []  # per stopped server: the sum of its processes' peak RSS (VmHWM)


def vm_hwm_kib(pid: int) -> int:
    """Peak resident set size of a live process (Linux /proc), 0 where unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def record_server(pids: list[int]) -> None:
    """Call just before stopping a server: its main process and descendants, all still alive."""
    server_peaks_kib.append(sum(vm_hwm_kib(p) for p in pids))
