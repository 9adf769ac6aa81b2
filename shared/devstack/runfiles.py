"""The files a server keeps in the data directory (`run/<name>.pid`, `logs/<name>.log`), written atomically."""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o644) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.chmod(mode)
    os.replace(tmp, path)


def read_pid_file(path: Path) -> tuple[int, dict[str, int]] | None:
    """The pid and named ports of `<data_dir>/run/<name>.pid`, or None if missing or unreadable."""
    try:
        lines = path.read_text().split()
        pid = int(lines[0])
        ports = {k: int(v) for k, _, v in (line.partition("=") for line in lines[1:])}
    except (OSError, ValueError, IndexError):
        return None
    return pid, ports


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(text[-lines:])
