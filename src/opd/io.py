"""File helpers shared by every command: atomic writes and JSONL that survives interruption.

Everything a run writes goes through here, so that an interrupted run never leaves a half-written file where a
complete one is expected: whole files are written to a temp file in the same directory, then renamed.
"""

from __future__ import annotations

import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator


_UMASK = os.umask(0)
os.umask(_UMASK)


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it is renamed onto `path`, else removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if Path(tmp).is_file():  # mkstemp makes 0600 files; give the result the usual umask-based mode
            os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def give_umask_modes(directory: str | Path) -> None:
    """Give every file under `directory` the mode a plain `open()` would (0644 under umask 022), and every directory
    0755: libraries that write through their own temp files (safetensors' `save_file`) leave 0600 behind."""
    for root, dirs, files in os.walk(directory):
        for name in files:
            os.chmod(os.path.join(root, name), 0o666 & ~_UMASK)
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o777 & ~_UMASK)
    os.chmod(directory, 0o777 & ~_UMASK)


def atomic_write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())


def atomic_write_json(path: str | Path, data: Any) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Write a whole JSONL file atomically."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def append_jsonl(path: str | Path, records: Iterable[dict]) -> None:
    """Append records, one line each, flushed to disk. A crash can at worst leave one partial last line, which
    `read_jsonl` skips, so appended logs (metrics, per-sample results) stay usable and resumable."""
    lines = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    if not lines:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        handle.write(lines)
        handle.flush()
        os.fsync(handle.fileno())


def read_jsonl(path: str | Path, *, skip_partial_last_line: bool = True) -> list[dict]:
    """Read a JSONL file; a malformed line raises ValueError naming file and line, except a partial *last* line
    (an interrupted append), which is dropped."""
    path = Path(path)
    lines = read_text(path).splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if skip_partial_last_line and number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
    return records


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content; a file that is not UTF-8 is a ValueError naming it and the first bad byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}); "
                         f"expected a UTF-8 file") from None


def repair_jsonl(path: str | Path) -> None:
    """Drop a partial last line left by an interrupted append, so that appending can continue cleanly."""
    path = Path(path)
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data[: data.rfind(b"\n") + 1]
        with atomic_path(path) as tmp:
            tmp.write_bytes(keep)
