"""trainlift's per-user state directory: $TRAINLIFT_HOME, default ~/.trainlift."""

from __future__ import annotations

import os
from pathlib import Path


def trainlift_home() -> Path:
    return Path(os.environ.get("TRAINLIFT_HOME", "~/.trainlift")).expanduser()
