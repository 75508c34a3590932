"""Files only their owner may read: passwords, keys and certificates' private halves.

Written whole or not at all (a reader never sees half a key), never through a symlink, with
mode 0600 from the moment they exist (not chmod-ed after a window in which others could open
them).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def _open_new(path: Path) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)


def write_private(path: Path, data: str | bytes) -> None:
    """Replace ``path`` with ``data``, mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with os.fdopen(_open_new(tmp), "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def create_private(path: Path, data: str) -> str:
    """``path``'s text if it exists, else ``data`` written there first: of processes racing to
    make it, one wins and all read what it wrote."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.new")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    with os.fdopen(_open_new(tmp), "w") as f:
        f.write(data)
    try:
        os.link(tmp, path)  # fails if another process made it first
    except FileExistsError:
        pass
    finally:
        tmp.unlink()
    return path.read_text()


def private_dir(path: Path) -> Path:
    """``path`` as a folder only its owner may enter (made if missing, tightened if not)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.chmod(0o700)
    return path
