"""Files tokenline derives once from a checkpoint file it cannot read as it is (a GGUF file's metadata,
a Mistral `tekken.json`), kept in a directory of their own that the API and the workers both read.

The directory sits beside the file (`.<file name>.<size>-<mtime>.tokenline/`) where that directory is
writable, else under `~/.cache/tokenline/<kind>/`; its name carries the file's size and modification
time, so a replaced file gets a new one. One made beside the file is found there also once the
directory is mounted read-only (a container's). Concurrent processes make it once (a file lock), and
a directory is complete only once its marker file is there.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

COMPLETE = ".complete"


def derived_once(file: Path, kind: str, derive: Callable[[Path], None]) -> Path:
    """The directory derived from `file`, made by `derive(directory)` if no complete one is there
    (`derive` writes into a fresh directory, which replaces the old one once it is whole)."""
    stat = file.stat()
    name = f".{file.name}.{stat.st_size}-{int(stat.st_mtime)}.tokenline"
    beside = file.parent / name
    if (beside / COMPLETE).is_file():
        return beside
    where = beside if os.access(file.parent, os.W_OK) else Path.home() / ".cache" / "tokenline" / kind / name
    if (where / COMPLETE).is_file():
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    with open(where.parent / f"{where.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (where / COMPLETE).is_file():
            partial = where.with_name(where.name + ".partial")
            shutil.rmtree(partial, ignore_errors=True)
            partial.mkdir()
            derive(partial)
            (partial / COMPLETE).touch()
            shutil.rmtree(where, ignore_errors=True)
            partial.rename(where)
    return where
