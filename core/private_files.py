"""Files only their owner can read: conversations and their KV are private (directories 0700, files 0600).

Modes are set when a file or directory is created, and tightened on ones that exist already (a data
directory made by an older version with the default umask)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_MODE, FILE_MODE = 0o700, 0o600


def private_dir(path: Path | str) -> Path:
    path = Path(path).expanduser()
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    if stat.S_IMODE(path.stat().st_mode) != DIR_MODE:
        path.chmod(DIR_MODE)
    return path


def private_file(path: Path | str) -> Path:
    """Create `path` empty if it does not exist; either way readable and writable by its owner only."""
    path = Path(path).expanduser()
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
    if stat.S_IMODE(path.stat().st_mode) != FILE_MODE:
        path.chmod(FILE_MODE)
    return path


def open_private(path: Path | str, mode: str = "wb"):
    """open() for writing a new private file (truncated if it exists)."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE), mode)
