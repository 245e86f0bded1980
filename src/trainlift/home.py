"""trainlift's per-user state directory: $TRAINLIFT_HOME, default ~/.trainlift, private to this user; and this
user's home, which an empty $HOME does not move to `/`."""

from __future__ import annotations

import os
import pwd
from pathlib import Path

from trainlift.private_dir import private_dir


def user_home() -> Path:
    """$HOME unless it is unset or empty, else this user's home in the password database."""
    return Path(os.environ.get("HOME", "").strip() or pwd.getpwuid(os.geteuid()).pw_dir)


def expand_user(path: str) -> Path:
    """`path` with a leading `~` as this user's home (`user_home`); `~other` as Python expands it."""
    if path == "~" or path.startswith("~/"):
        return user_home() / path[2:]
    return Path(path).expanduser()


def trainlift_home() -> Path:
    """The directory, created 0700 on first use; refused when another user owns it or may write it. An empty
    TRAINLIFT_HOME counts as unset (it would make the working directory trainlift's home, and private)."""
    configured = os.environ.get("TRAINLIFT_HOME", "").strip()
    return private_dir(expand_user(configured) if configured else user_home() / ".trainlift",
                       elsewhere="set TRAINLIFT_HOME to a directory of yours")
