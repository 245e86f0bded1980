"""trainlift's per-user state directory: $TRAINLIFT_HOME, default ~/.trainlift, private to this user."""

from __future__ import annotations

import os
from pathlib import Path

from trainlift.private_dir import private_dir


def trainlift_home() -> Path:
    """The directory, created 0700 on first use; refused when another user owns it or may write it."""
    return private_dir(Path(os.environ.get("TRAINLIFT_HOME", "~/.trainlift")).expanduser(),
                       elsewhere="set TRAINLIFT_HOME to a directory of yours")
