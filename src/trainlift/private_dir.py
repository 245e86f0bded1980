"""Directories only this user controls: trainlift's state, and the node caches it reads back as its own (the
model staging cache, the tokenize-once data cache).

A directory trainlift creates is 0700. One already there must be a directory this user owns that no other user
may write: otherwise another user could have planted what trainlift would take for its own files (a model's
weights, tokenized rows, a head's record). One that others may only read is made 0700.
"""

from __future__ import annotations

import os
import pwd
import stat
import tempfile
from pathlib import Path

from trainlift.errors import TrainliftError

TMPDIR_FIX = "set TMPDIR to a directory of yours"


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def private_dir(path: str | os.PathLike, elsewhere: str) -> Path:
    """`path`, created 0700 unless it is there (missing parents get the default mode); one that is there must pass
    `check`. `elsewhere`: how the user points trainlift at another directory, for the refusal's fix."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    except OSError as exc:
        raise TrainliftError(f"cannot create {path}: {exc.strerror}", hint=elsewhere) from None
    check(path, elsewhere)
    return path


def check(path: Path, elsewhere: str) -> None:
    """Refuse, in one line, a `path` that another user owns (the directory, or a link to it), that is not a
    directory, or that its group or other users may write; a directory of this user's that others may read is
    made 0700."""
    me = os.geteuid()
    try:
        link, target = os.lstat(path), os.stat(path)
    except OSError as exc:
        raise TrainliftError(f"cannot use {path}: {exc.strerror}", hint=f"remove it, or {elsewhere}") from None
    other = next((st.st_uid for st in (link, target) if st.st_uid != me), None)
    if other is not None:
        raise TrainliftError(f"{path} is owned by {user_name(other)}, not by you ({user_name(me)}): trainlift will "
                             "not use a directory another user controls",
                             hint=f"have its owner or root remove it, or {elsewhere}")
    if not stat.S_ISDIR(target.st_mode):
        raise TrainliftError(f"{path} is not a directory", hint=f"remove it, or {elsewhere}")
    mode = stat.S_IMODE(target.st_mode)
    if mode & 0o022:
        raise TrainliftError(f"{path} is writable by users other than you (mode {mode:04o}): trainlift will not "
                             "trust what it holds", hint=f"remove it (rm -r {path}) if you did not make it, else "
                                                     f"chmod go-w {path}; or {elsewhere}")
    if mode & 0o077:
        os.chmod(path, 0o700)


def user_temp_dir() -> Path:
    """This user's directory in the system's temporary directory, `<tmp>/trainlift-<uid>`: a shared temporary
    directory lets anyone create a predictable name before this user does."""
    return private_dir(Path(tempfile.gettempdir()) / f"trainlift-{os.geteuid()}", TMPDIR_FIX)
