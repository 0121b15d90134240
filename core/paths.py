"""Where the suite keeps what it derives on this machine, outside the repository: checkpoints
put together from parts, rendered corpora, kernels built for this CPU."""

from __future__ import annotations

import os
from pathlib import Path


def cache_folder() -> Path:
    """~/.cache/apps, or $XDG_CACHE_HOME/apps."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "apps"
