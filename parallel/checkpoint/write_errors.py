"""What a failed checkpoint write says: disk full named as such, with the space needed and free (io.py)."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n} B"


def describe_write_error(err: BaseException, path: Path, needed: int) -> str:
    """One line for a failed write; disk full is named as such (torch's C++ writer says only 'iostream error')."""
    try:
        free = shutil.disk_usage(path.parent if path.parent.exists() else path.parent.parent).free
    except OSError:
        free = None
    full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
    full = full or (isinstance(err, RuntimeError) and ("iostream" in str(err) or "No space" in str(err)
                                                      or (free is not None and free < needed)))
    if full:
        return (f"no space left on device writing {path} (needed ~{_human(needed)}, "
                f"free {'?' if free is None else _human(free)})")
    return f"cannot write {path}: {type(err).__name__}: {err}"
