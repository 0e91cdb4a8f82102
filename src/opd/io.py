"""File helpers shared by every command: atomic writes, JSONL that survives interruption, and the exclusive lock
of a directory of state.

Everything a run writes goes through here, so that an interrupted run never leaves a half-written file where a
complete one is expected: whole files are written to a temp file in the same directory, then renamed. Every command
that writes a directory of state (distill, sft, eval, rollout, prompts score, pipeline) holds `DirectoryLock` on it,
so two processes never write one directory.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # errors of a write that did not fit


@contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside `path`; when the block succeeds it is renamed onto `path`, else removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix or ".tmp")
    os.close(fd)
    try:
        try:
            yield Path(tmp)
        except OSError as error:  # disk full while writing the temp file: name the file being written
            if error.errno in _FULL and error.filename in (None, tmp, str(tmp)):
                raise OSError(error.errno, error.strerror, str(path)) from None
            raise
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


def read_jsonl_objects(path: str | Path, *, skip_partial_last_line: bool = True) -> list[tuple[int, dict]]:
    """(line number, record) of a JSONL file of JSON objects, as a command reads back what it wrote: a line that is
    not an object (a list, a number) is a ValueError naming the file and line; a partial last line is dropped."""
    path = Path(path)
    lines = read_text(path).splitlines()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if skip_partial_last_line and number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: not a JSON object but {_kind(record)}")
        records.append((number, record))
    return records


MAX_STEP = 10**12  # a step number beyond any run: a damaged line or file name, never a step
_STEP_NAME = re.compile(r"^step_(\d+)$")


def checked_step(value: object, where: str) -> int:
    """`value` as a step number (an integer 0 … MAX_STEP; an integral float as written by other tools), else a
    ValueError naming `where` (a file, a file and line)."""
    if isinstance(value, float) and value.is_integer() and abs(value) <= MAX_STEP:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_STEP:
        raise ValueError(f"{where}: step {value!r} is not a step number (an integer 0 … {MAX_STEP})")
    return value


def read_step_records(path: str | Path) -> list[tuple[int, dict]]:
    """(line number, record) of a per-step log (`metrics.jsonl`): `read_jsonl_objects`, and every record's "step"
    a step number (made an int), else a ValueError naming the file and line. What `opd report` plots and what
    `--resume` keeps are read by this one function."""
    path = Path(path)
    records = read_jsonl_objects(path)
    for number, record in records:
        record["step"] = checked_step(record.get("step"), f"{path}:{number}")
    return records


def name_step(path: str | Path) -> int | None:
    """The step of a run file or directory named `step_<N>` (a checkpoint, samples/step_N.jsonl, eval/step_N); None
    for another name; a step beyond any run (damage, or not ours) is a ValueError naming the path."""
    path = Path(path)
    match = _STEP_NAME.match(path.stem if path.suffix in (".json", ".jsonl") else path.name)
    if match is None:
        return None
    digits = match.group(1)
    if len(digits) > len(str(MAX_STEP)) or int(digits) > MAX_STEP:
        raise ValueError(
            f"{path}: step {digits} is not a step number (an integer 0 … {MAX_STEP}); a damaged or foreign "
            f"file: move it out of the run directory"
        )
    return int(digits)


def read_json_object(path: str | Path) -> dict:
    """A JSON file holding one object (results, manifests, identities): anything else is a ValueError naming it."""
    path = Path(path)
    try:
        data = json.loads(read_text(path))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not valid JSON ({error.msg} at line {error.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object but {_kind(data)}")
    return data


def read_yaml_mapping(path: str | Path) -> tuple[str, dict]:
    """(text, mapping) of a YAML file that must hold a mapping (a run's config.yaml); else a ValueError naming it."""
    import yaml

    path = Path(path)
    text = read_text(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as error:
        where = getattr(error, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ValueError(f"{path}: not valid YAML{at}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a mapping of settings but {_kind(data)}")
    return text, data


def read_manifest(path: str | Path) -> dict[str, dict]:
    """The `files` of a checkpoint's MANIFEST.json ({name: {"bytes": int, "sha256": str}}); another shape is a
    ValueError naming the file and what is wrong."""
    path = Path(path)
    files = read_json_object(path).get("files")
    if not isinstance(files, dict):
        raise ValueError(f'{path}: no "files" mapping (name → {{"bytes", "sha256"}})')
    for name, entry in files.items():
        size = entry.get("bytes") if isinstance(entry, dict) else None
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 or not isinstance(digest, str):
            raise ValueError(f'{path}: entry {name!r} is not {{"bytes": a size, "sha256": a digest}}')
    return files


def _kind(value: object) -> str:
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def read_text(path: str | Path) -> str:
    """A UTF-8 text file's content; a file that is not UTF-8 is a ValueError naming it and the first bad byte."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{data[error.start]:02x} on line {line}); expected a UTF-8 file"
        ) from None


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


# ------------------------------------------------------------------------------------------------------ locking

LOCK_FILE = ".opd.lock"
"""Name of the lock file inside a locked directory (JSON: pid, host, command, start time)."""


class DirectoryLocked(ValueError):
    """Another running process holds the lock of the directory (one line naming the directory and its pid)."""


class DirectoryLock:
    """An exclusive lock on a directory of state: `<directory>/.opd.lock`, held with `fcntl.flock` and holding the
    pid, host, command and start time of its owner.

    The kernel drops a flock when its process dies (also on `kill -9`), so a lock file left behind by a dead process
    is taken over, with a note naming that pid. The file is removed on release (`with`, or `release()`: also when
    the block raises). Within one process the lock nests: taking it again on a directory this process already holds
    just counts (the pipeline, the demo and the trainers' in-run evals call one another in-process).

    Omitted: locking on file systems without flock support (some FUSE mounts); there the lock file is still written
    and read, but a second process is not refused.
    """

    _held: dict[str, DirectoryLock] = {}

    def __init__(self, directory: str | Path, command: str, *, note: Callable[[str], None] | None = None):
        self.directory = Path(directory)
        self.command = command
        self.note = note or _note
        self._fd: int | None = None
        self._key = ""
        self._depth = 0

    def acquire(self) -> DirectoryLock:
        """Take the lock, creating the directory if needed; raise `DirectoryLocked` when another process holds it."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = str(self.directory.resolve())
        outer = DirectoryLock._held.get(self._key)
        if outer is not None:
            outer._depth += 1
            self._fd, self._depth = -1, 1  # a nested hold: releasing it only counts down the outer one
            return self
        path = self.directory / LOCK_FILE
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise DirectoryLocked(
                    f"{self.directory} is in use by another opd process ({_describe(holder)}); "
                    f"wait for it to finish, or use another directory"
                ) from None
            except OSError:
                pass  # no flock on this file system: the lock file is advisory only (see the class docstring)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the previous holder removed the file between our open and flock: take the new one
        previous = _read_holder(fd)
        if previous.get("pid"):
            alive = previous.get("host") in (None, socket.gethostname()) and pid_alive(int(previous["pid"]))
            state = (
                "which is running but no longer holds it (the lock of an ended run; its pid now names another process)"
                if alive
                else "which is not running"
            )
            self.note(f"{self.directory}: taking over the lock left by {_describe(previous)}, {state}")
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.command,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        self._fd, self._depth = fd, 1
        DirectoryLock._held[self._key] = self
        return self

    def moved(self, directory: str | Path) -> None:
        """Record that the locked directory was renamed to `directory` while held (so its path is free again)."""
        if self._fd not in (None, -1):
            DirectoryLock._held.pop(self._key, None)
            self.directory = Path(directory)
            self._key = str(self.directory.resolve())
            DirectoryLock._held[self._key] = self

    def release(self) -> None:
        """Drop the lock and remove its file."""
        if self._fd is None:
            return
        if self._fd == -1:  # nested
            outer = DirectoryLock._held.get(self._key)
            if outer is not None:
                outer._depth -= 1
            self._fd = None
            return
        self._depth -= 1
        if self._depth > 0:
            return
        DirectoryLock._held.pop(self._key, None)
        path = self.directory / LOCK_FILE
        try:
            if os.stat(path).st_ino == os.fstat(self._fd).st_ino:
                path.unlink()  # while still holding the flock: nobody can take a lock on a file about to vanish
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> DirectoryLock:
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (ValueError, OSError):
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "pid not yet recorded"
    where = f" on {holder['host']}" if holder.get("host") else ""
    what = f", opd {holder['command']}" if holder.get("command") else ""
    since = f", started {holder['started']}" if holder.get("started") else ""
    return f"pid {holder['pid']}{where}{what}{since}"


def _note(line: str) -> None:
    print(f"note: {line}", file=sys.stderr)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
