"""The one boundary for output files: checked before the work starts, written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from specs.errors import SpecError

CREATED_DIRECTORIES: list[Path] = []  # by check_writable in this process (absolute)


def remove_created_directories() -> None:
    """Remove the directories check_writable created that are still empty, deepest first (a command that failed
    leaves nothing behind but what it wrote)."""
    for directory in sorted(set(CREATED_DIRECTORIES), key=lambda d: len(d.parts), reverse=True):
        with contextlib.suppress(OSError):  # not empty, or gone
            directory.rmdir()
    CREATED_DIRECTORIES.clear()


def check_no_file_above(path: Path, flag: str) -> None:
    """Refuse `path` when a directory above it is a regular file (`--out README.md/plan.json`): mkdir said only
    "File exists", naming neither the file nor what is wrong with it."""
    file_above = next((directory for directory in path.parents if directory.is_file()), None)
    if file_above is not None:
        raise SpecError(flag, str(path), f"{file_above} is a file, not a directory")


def check_writable(path: str | Path, flag: str = "--out") -> Path:
    """Fail now, not after minutes of work, when `path` cannot be written: its directory is created if missing and
    must accept a new file; an existing directory or unwritable file at `path` is refused."""
    path = Path(path)
    if path.is_dir():
        raise SpecError(flag, str(path), "is a directory; expected a file name")
    check_no_file_above(path, flag)
    directory = path.parent
    missing = [d for d in (directory.absolute(), *directory.absolute().parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise SpecError(flag, str(path), f"cannot create its directory: {err.strerror or err}") from None
    CREATED_DIRECTORIES.extend(missing)  # deepest first
    if not os.access(directory, os.W_OK | os.X_OK):
        raise SpecError(flag, str(path), f"directory {directory} is not writable")
    if path.exists() and not os.access(path, os.W_OK):
        raise SpecError(flag, str(path), "exists and is not writable")
    # what the permission bits do not tell (root passes them; /proc refuses anyway): try, leaving nothing behind
    try:
        if path.is_file():
            with open(path, "ab"):
                pass
        elif not path.exists():
            handle, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=directory)
            os.close(handle)
            os.unlink(probe)
    except OSError as err:
        raise SpecError(flag, str(path), f"cannot write: {err.strerror or err}") from None
    return path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write UTF-8 text through a temporary file in the same directory and a rename, so readers never see a torn
    file and a failure (e.g. a full disk) leaves the previous file in place. Character devices such as /dev/null
    or /dev/stdout are written directly."""
    path = Path(path)
    if path.exists() and not path.is_file():
        _write_direct(path, text)
        return

    def write(temporary: Path) -> None:
        with open(temporary, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())

    write_atomic(path, write)


def write_atomic(path: Path, write: Callable[[Path], None], suffix: str = ".tmp") -> None:
    """`write(temporary)` into a temporary file beside `path`, then the rename over it: the file's mode is the old
    file's, or a new file's under the umask (not the temporary's 0600); a failure names `path` and leaves the
    previous file in place."""
    directory = path.parent if str(path.parent) else Path(".")
    temporary = None
    try:
        handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix, dir=directory)
        os.close(handle)
        temporary = Path(name)
        write(temporary)
        if path.exists():
            os.chmod(temporary, path.stat().st_mode & 0o777)
        else:
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(temporary, 0o666 & ~umask)
        os.replace(temporary, path)
        temporary = None
    except OSError as err:
        raise SpecError(str(path), "", f"cannot write: {err.strerror or err}") from None
    finally:
        if temporary is not None and temporary.exists():
            temporary.unlink()


def _write_direct(path: Path, text: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as err:
        raise SpecError(str(path), "", f"cannot write: {err.strerror or err}") from None
