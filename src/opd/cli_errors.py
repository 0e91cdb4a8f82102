"""Error translation for the `opd` command line: a user error (a bad option, config, data file or path) as one
line that names what is wrong and where, and click's own error classes. `opd.cli.main` prints the line; a bug (any
other exception) keeps its traceback. No command logic lives here."""

from __future__ import annotations

import errno
import importlib
from pathlib import Path
from typing import Any

import typer
from pydantic import ValidationError


def click_errors() -> tuple[tuple, tuple, tuple]:
    """(usage errors, no-arguments-help errors, aborts) of the click that typer runs on: its vendored copy
    (`typer._click`, newer typer) and the click package (older typer)."""
    modules = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass

    def classes(attr: str) -> tuple:
        return tuple(dict.fromkeys(getattr(m, attr) for m in modules if hasattr(m, attr)))

    return classes("ClickException"), classes("NoArgsIsHelpError"), (*classes("Abort"), typer.Abort)


def usage_line(error: Any) -> str:
    """click's usage error (bad option, missing argument, unknown command) as one line with where to look."""
    message = " ".join(error.format_message().split())
    ctx = getattr(error, "ctx", None)
    return f"{message} (see '{ctx.command_path} --help')" if ctx is not None else message


def user_error_line(error: BaseException) -> str | None:
    """The one-line message for an error the user can fix, or None for a bug (which keeps its traceback)."""
    if isinstance(error, OSError):
        return os_error_line(error)
    if type(error).__name__ == "SafetensorError":  # not caught where a file is known: still say what it is
        return f"a .safetensors file is corrupt or truncated ({_one_line(error)}); re-download or re-save it"
    if isinstance(error, RuntimeError) and "PytorchStreamReader" in str(error):  # torch.load of a truncated file
        return f"a torch checkpoint file is corrupt or truncated ({_one_line(error)[:200]}); re-save or re-download it"
    if isinstance(error, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({_one_line(error)}); convert it to UTF-8"
    if isinstance(error, ValueError):
        return _one_line(error)
    return None


def _one_line(error: BaseException) -> str:
    """The message on one line: pydantic's multi-line validation errors become their first error."""
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{error.title}: {where + ': ' if where else ''}{first['msg']}, got {first.get('input')!r}"
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    return "; ".join(lines) if lines else type(error).__name__


def os_error_line(error: OSError) -> str:
    """An OS error as `<path>: <what is wrong there>`. Where a rename failed, the destination is the path the user
    named (the source is our hidden temp file); where a parent 'is not a directory', the regular file that is in
    the way is named."""
    if error.errno is None or error.filename is None:
        return _one_line(error)
    path = str(error.filename2 if error.filename2 is not None else error.filename)
    code = error.errno
    if code == errno.ENOTDIR:
        blocker = next((p for p in [Path(path), *Path(path).parents] if p.exists() and not p.is_dir()), None)
        if blocker is not None and str(blocker) != path:
            return f"{path}: {blocker} is a file, not a directory; choose an output path outside it"
        return f"{path}: not a directory; expected a directory here"
    reasons = {
        errno.ENOENT: "no such file or directory",
        errno.EACCES: "permission denied; choose a location you may write to (or fix its permissions)",
        errno.EPERM: "operation not permitted; choose a location you may write to (or fix its permissions)",
        errno.EROFS: "the file system is read-only; choose an output path on a writable one",
        errno.ENOSPC: "no space left on the device; free space there or choose another location",
        errno.EDQUOT: "disk quota exceeded; free space there or choose another location",
        errno.EISDIR: "is a directory; expected a file path here",
        errno.ENOTEMPTY: "is a non-empty directory; choose another path",
        errno.ENAMETOOLONG: "the name is too long",
        errno.EMFILE: "too many open files",
    }
    if code == errno.EEXIST:
        kind = "a file" if Path(path).is_file() else "a directory" if Path(path).is_dir() else "something"
        return f"{path}: already exists as {kind}; expected {'a directory' if kind == 'a file' else 'a new path'} here"
    return f"{path}: {reasons.get(code) or error.strerror or _one_line(error)}"
