"""A compile warm-up's artefacts kept between runs, so that a second start or a `--resume` skips inductor's code
generation: after the warm-up, `torch.compiler.save_cache_artifacts` (the FX graphs, AOTAutograd entries and
autotuning results this process produced or loaded) goes to `<root>/<key>/`; before the next warm-up with the same
key, `torch.compiler.load_cache_artifacts` puts them back into torch's own caches, and inductor finds each graph there.

The key (`compile_key`) is a digest of what the graphs depend on: the caller's parts (the models' configs, dtypes,
shapes) and the versions of torch, triton, transformers and Python, the device, and opd's own source. A changed key
is a new directory, so it compiles afresh; and since torch's caches key each graph by its own content, a key too
fine costs a compile and one too coarse a larger file, never a wrong graph. Dynamo still traces every function on a
warm start; what the cache skips is inductor's compilation of what it traced (the split: docs/performance.md).

Where: `$OPD_COMPILE_CACHE` (off, 0, false or none: no cache), else `$XDG_CACHE_HOME/opd/compile`, else
`~/.cache/opd/compile`. Each directory holds `key.json` (the parts, for a reader) and `artifacts-*.bin`: a run that
compiled something new writes all it compiled and loaded as one file and removes the files that one holds (a run
that loaded everything adds nothing; two runs at once may leave two files, both loaded next time). A lock file
orders the writers and readers of one key across processes, and every file is written to a temporary name and
renamed. Left out on purpose: pruning old keys (delete the folder), and a shared remote cache (torch's own
`fx_graph_remote_cache` does that)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opd.io import atomic_path, atomic_write_text

__all__ = ["CacheReport", "cache_root", "compile_key", "opd_source_digest", "persisted"]

OFF = frozenset({"off", "0", "false", "none", "no"})


def cache_root() -> Path | None:
    """Where compile caches live: `$OPD_COMPILE_CACHE`, `$XDG_CACHE_HOME/opd/compile` or `~/.cache/opd/compile`;
    None when `$OPD_COMPILE_CACHE` switches the cache off."""
    override = os.environ.get("OPD_COMPILE_CACHE")
    if override is not None and override.strip():
        return None if override.strip().lower() in OFF else Path(override).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "opd" / "compile"


def opd_source_digest() -> str:
    """sha256 of opd's Python source (every `.py` file of the package, with its path): any code change is a new
    key, the simple rule that cannot miss a change a graph depends on."""
    package = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*.py")):
        digest.update(str(path.relative_to(package)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment(device: torch.device | None) -> dict[str, Any]:
    """The key's parts that come from this machine: versions of what compiles, and the device it compiles for."""
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "torch_git": getattr(torch.version, "git_version", None),
        "python": platform.python_version(),
        "opd_source": opd_source_digest(),
    }
    for name in ("triton", "transformers"):
        module = sys.modules.get(name)
        if module is None:
            with contextlib.suppress(ImportError):
                module = __import__(name)
        out[name] = getattr(module, "__version__", None)
    if device is not None:
        out["device"] = device.type
        if device.type == "cuda" and torch.cuda.is_available():
            out["device_name"] = torch.cuda.get_device_name(device)
            out["capability"] = list(torch.cuda.get_device_capability(device))
            out["cuda"] = torch.version.cuda
    return out


def compile_key(parts: Mapping[str, Any], device: torch.device | None = None) -> tuple[str, dict[str, Any]]:
    """(the key, 24 hex digits, and everything it digests): `parts` (JSON-able: configs, dtypes as strings, shapes)
    with this machine's `environment`."""
    full = {"parts": dict(parts), "environment": environment(device)}
    text = json.dumps(full, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24], full


@dataclass
class CacheReport:
    """What one warm-up found and left in the cache: torch's counters over it (graphs dynamo traced; inductor's FX
    graphs and AOTAutograd entries found in its caches, hits, or compiled, misses), the artefacts loaded before it and
    saved after, and its seconds."""

    key: str | None = None
    path: Path | None = None
    loaded: int = 0
    saved: int = 0
    graphs: int = 0
    fx_hits: int = 0
    fx_misses: int = 0
    aot_hits: int = 0
    aot_misses: int = 0
    seconds: float = 0.0
    dynamo_seconds: float = 0.0
    backend_seconds: float = 0.0
    error: str | None = None

    def metrics(self) -> dict[str, float]:
        """The warm-up's `compile/*` metrics: seconds, graphs traced, of inductor's graphs those loaded from a cache
        (this one's or torch's own) and those compiled, and where the seconds went: in dynamo (`dynamo_s`: tracing
        plus its backend) and of it in the backend (`backend_s`: AOTAutograd and inductor, compiling or loading);
        the rest ran the warm-up's graphs."""
        return {
            "compile/warm_up_s": self.seconds,
            "compile/warm_up_graphs": self.graphs,
            "compile/cache_hits": self.fx_hits,
            "compile/cache_misses": self.fx_misses,
            "compile/dynamo_s": self.dynamo_seconds,
            "compile/backend_s": self.backend_seconds,
        }

    def describe(self) -> str:
        """One line: "compile cache <path>: N graphs loaded, M compiled (K artefacts loaded, J saved)" or why none."""
        if self.path is None:
            where = "compile cache off (OPD_COMPILE_CACHE)" if self.error is None else f"compile cache: {self.error}"
        else:
            where = f"compile cache {self.path}"
        return (
            f"{where}: {self.fx_hits} inductor graph{'s' if self.fx_hits != 1 else ''} loaded, {self.fx_misses} "
            f"compiled ({self.loaded} artefacts loaded, {self.saved} saved); {self.dynamo_seconds:.1f} s in dynamo, "
            f"{self.backend_seconds:.1f} s of it in its backend"
        )


_PHASES = {"dynamo_seconds": "_compile.compile_inner", "backend_seconds": "OutputGraph.call_user_compiler"}


def _phase_seconds() -> dict[str, float]:
    """Seconds this process spent so far in dynamo and in its backend (torch's own timers, process-wide); zeros
    where this torch does not report them."""
    try:
        names, values = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
        times: dict[str, Any] = dict(zip(names, values, strict=True))
        return {field: float(times.get(name, 0.0)) for field, name in _PHASES.items()}
    except Exception:  # a private API: its shape may change between torch versions
        return dict.fromkeys(_PHASES, 0.0)


def _counts() -> dict[str, int]:
    counters = torch._dynamo.utils.counters
    return {
        "graphs": int(counters["stats"]["unique_graphs"]),
        "fx_hits": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_misses": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_hits": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_misses": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }


@contextlib.contextmanager
def _locked(directory: Path, exclusive: bool) -> Iterator[None]:
    """An advisory lock on the key's directory across processes (shared to read, exclusive to write); none where
    the platform has no fcntl."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(directory / ".lock", "a+b") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _keys(info: Any) -> frozenset[tuple[str, str]]:
    """The (type, key) of every artefact in a `torch.compiler.CacheInfo`."""
    return frozenset((kind, key) for kind, keys in info.artifacts.items() for key in keys)


def _write_bytes(path: Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def _load(directory: Path) -> dict[Path, frozenset[tuple[str, str]]]:
    """Load every artefact file of the key's directory into torch's caches; returns each file's artefacts."""
    files = {}
    with _locked(directory, exclusive=False):
        for path in sorted(directory.glob("artifacts-*.bin")):
            info = torch.compiler.load_cache_artifacts(path.read_bytes())
            files[path] = _keys(info) if info is not None else frozenset()
    return files


def _save(directory: Path, full_key: dict[str, Any], files: dict[Path, frozenset[tuple[str, str]]]) -> int:
    """This process's artefacts (what it compiled and what it loaded) as one new file, unless the files loaded hold
    them all already; files whose artefacts the new one holds are removed. Returns the artefacts written."""
    result = torch.compiler.save_cache_artifacts()
    if result is None:
        return 0
    data, info = result
    keys = _keys(info)
    if keys <= frozenset().union(*files.values()):
        return 0
    with _locked(directory, exclusive=True):
        if not (directory / "key.json").exists():
            atomic_write_text(directory / "key.json", json.dumps(full_key, indent=1, sort_keys=True, default=str))
        _write_bytes(directory / f"artifacts-{time.time_ns()}-{os.getpid()}.bin", data)
        for path, held in files.items():
            if held <= keys:
                path.unlink(missing_ok=True)
    return len(keys)


@contextlib.contextmanager
def persisted(
    parts: Mapping[str, Any], device: torch.device | None = None, *, root: Path | None = None
) -> Iterator[CacheReport]:
    """Run a compile warm-up inside: its artefacts are loaded from the cache of `compile_key(parts, device)` before
    and saved there after, when the warm-up compiled anything new. The yielded report is filled in on exit (its
    counters are torch's, process-wide: run nothing else that compiles meanwhile). A cache that cannot be read or
    written costs the warm-up its speed, never the run: the report's `error` says why."""
    directory = root if root is not None else cache_root()
    report = CacheReport()
    full: dict[str, Any] = {}
    files: dict[Path, frozenset[tuple[str, str]]] = {}
    if directory is not None:
        report.key, full = compile_key(parts, device)
        report.path = directory / report.key
        try:
            report.path.mkdir(parents=True, exist_ok=True)
            files = _load(report.path)
            report.loaded = len(frozenset().union(*files.values()))
        except (OSError, RuntimeError) as error:
            report.error, report.path = f"not read ({error})", None
    start, phases, clock = _counts(), _phase_seconds(), time.perf_counter()
    yield report
    report.seconds = time.perf_counter() - clock
    for name, value in _phase_seconds().items():
        setattr(report, name, value - phases[name])
    for name, value in _counts().items():
        setattr(report, name, value - start[name])
    if report.path is not None and (report.fx_misses or report.aot_misses):
        try:
            report.saved = _save(report.path, full, files)
        except (OSError, RuntimeError) as error:
            report.error = f"not written ({error})"
