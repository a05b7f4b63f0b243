"""One run at a time per output folder: a lock file naming the owner, taken before any work.

Note [Folder locks]
~~~~~~~~~~~~~~~~~~~
Two ``compare`` (or ``sweep``) commands writing into one ``--out-dir`` would each print and publish
the other's results as their own. :func:`owned_folder` creates ``FOLDER/.megatron_ring.lock``
atomically (``O_CREAT | O_EXCL``) holding the owner's pid, host and command, and removes it when the
block ends. A second command finds the file and is refused, naming the owner, unless that owner is
gone: a lock whose pid no longer runs on this host (a command killed with SIGKILL leaves its lock
behind) is taken over. A lock written on another host is never taken over (its pid means nothing
here); the message says which file to remove.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from megatron_ring.runtime.parent_watch import pid_alive

LOCK_FILE = ".megatron_ring.lock"


class FolderBusy(ValueError):
    """The folder is owned by another live run (a ValueError: a usage error of the second command)."""


def _take(lock: Path, field: str) -> None:
    record = {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)}
    for _ in range(2):  # a stale lock is removed once, then taken
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                owner = json.loads(lock.read_text())
            except (OSError, ValueError):
                owner = {}
            same_host = owner.get("host") == socket.gethostname()
            if same_host and isinstance(owner.get("pid"), int) and not pid_alive(owner["pid"]):
                lock.unlink(missing_ok=True)
                continue
            raise FolderBusy(f"{field} = {str(lock.parent)!r} is in use by another run (pid {owner.get('pid')} on "
                             f"{owner.get('host')}: {owner.get('command', '?')!r}); give another folder, or remove "
                             f"{str(lock)!r} if that run is gone") from None
        with os.fdopen(fd, "w") as sink:
            json.dump(record, sink)
        return
    raise FolderBusy(f"{field} = {str(lock.parent)!r}: its lock {str(lock)!r} could not be taken")


@contextlib.contextmanager
def owned_folder(folder: Path, *, field: str) -> Iterator[Path]:
    """``folder`` (created) owned by this process inside the block (Note [Folder locks]); FolderBusy naming
    ``field`` and the other owner when another live run holds it."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / LOCK_FILE
    _take(lock, field)
    try:
        yield folder
    finally:
        with contextlib.suppress(OSError):
            if json.loads(lock.read_text()).get("pid") == os.getpid():
                lock.unlink()
