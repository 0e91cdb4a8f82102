"""Run directories: the one place where a command that writes a directory claims it, locks it, compares the settings
saved in it with this run's, and resumes from it.

Two kinds of directory: a *run* (`opd distill`, `opd sft`, `opd demo`: refused when it holds anything, unless
`--resume` or `run.overwrite`, which moves it aside — never deletes it) and a *work* directory (`opd eval --out`,
`opd rollout --out`, `opd prompts score --out`, `opd pipeline run`'s `out_dir`: a rerun continues identical work
and refuses other settings). Both are held by one process at a time (`opd.io.DirectoryLock`). What may change
between a run and its resumption is one allow-list per command, `RESUMABLE`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel

from opd.config import RunSpec, flatten_dotted, save_config
from opd.io import (
    LOCK_FILE,
    DirectoryLock,
    atomic_write_json,
    atomic_write_text,
    name_step,
    pid_alive,
    read_json_object,
    read_manifest,
    read_yaml_mapping,
)
from opd.report.sinks import MetricsSink

_TRAINING = (
    "run.steps",
    "epochs",
    "run.save_every",
    "run.eval_every",
    "run.keep_last",
    "run.report",
    "run.samples_per_step",
    "run.tensorboard",
    "run.wandb_project",
    "run.resume",
    "run.overwrite",
    "run.allow_config_change",
    "run.out_dir",
    "run.name",
    "eval.*",
    "lora.merge",
    "student.device",
    "teacher.device",
    "model.device",
    "micro_batch_tokens",
    "score_batch_tokens",
    "gradient_checkpointing",
    "activation_budget",
    "compile",
    "run.deterministic",  # which kernels, not which math: like compile, bit-identical needs it unchanged
    "teacher_offload",
    # neither changes the math: which startup checks may fail, how long a served teacher is waited for
    "skip_checks",
    "teacher.retry_deadline",
)

RESUMABLE: dict[str, tuple[str, ...]] = {
    # They set the length, the bookkeeping, the periodic eval, where things run and how work is cut into
    # micro-batches; none changes the objective, the data or its order, the sampling or the optimizer. Memory knobs
    # (micro_batch_tokens, score_batch_tokens, gradient_checkpointing, activation_budget, compile) regroup the same
    # sums: a resume then equals an uninterrupted run up to float rounding; bit-identical needs them unchanged.
    "distill": _TRAINING,
    "sft": _TRAINING,
    # what does not change a finished prompt's samples
    "rollout": (
        "out",
        "num_workers",
        "devices",
        "batch_size",
        "model.device",
        "llamafactory",
        "dataset_name",
        "grade_timeout",
        "vllm.gpu_memory_utilization",
        "vllm.kv_cache_gb",
        "vllm.enforce_eager",
        "vllm.sleep",
    ),
    # identity.json holds only what decides the samples: nothing in it may change
    "eval": (),
}
"""Per command, the config keys a rerun or `--resume` may change (`name.*`: the whole section); every other key is
compared with the saved settings and a change is refused, naming the key, old → new."""

RESUMABLE_CHANGES = RESUMABLE["distill"]  # README's name for the trainers' list


class RunDirectoryError(ValueError):
    """The run directory cannot be used as asked (holds another run, is a file, is not writable); one line."""


def default_run_dir(command: str, out_dir: str | Path = "runs") -> Path:
    """`<out_dir>/<command>-<time>`: the directory of a run that was given no name."""
    return Path(out_dir) / f"{command}-{time.strftime('%Y%m%d-%H%M%S')}"


@contextmanager
def locked(directory: str | Path, command: str, *, console: Any = None) -> Iterator[Path]:
    """Hold the work directory `directory` (created if needed) for this process: a second process on it fails with
    one line naming the holder; a lock left by a killed process is taken over with a note on the console."""
    note = None if console is None else (lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
    with DirectoryLock(Path(directory), command, note=note):
        yield Path(directory)


def run_directory(run: RunSpec, command: str) -> Path:
    """`run.out_dir / run.name`, or `<command>-<time>` when the run has no name."""
    return Path(run.out_dir) / run.name if run.name else default_run_dir(command, run.out_dir)


@contextmanager
def claimed_run_dir(run_dir: Path, run: RunSpec, command: str, *, console: Any) -> Iterator[Path]:
    """Hold `run_dir` for one run: created if needed (and checked writable), locked against other processes
    (`opd.io.DirectoryLock`), and never shared with an earlier run — without `run.resume` a directory that holds
    anything refuses, unless `run.overwrite`, which moves it aside to `<name>.old-<time>` (never deletes it).
    Temp directories of interrupted checkpoint writes are removed. A directory this call created and that is still
    empty at the end (the run failed at startup) is removed again."""
    if run.resume and run.overwrite:
        raise RunDirectoryError(
            "run.resume and run.overwrite contradict each other: --resume continues the run in "
            f"{run_dir}, run.overwrite=true moves it aside to start anew; set one"
        )
    created = not run_dir.exists()
    try:
        lock = DirectoryLock(
            run_dir, command, note=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True)
        ).acquire()
    except FileExistsError:
        raise RunDirectoryError(
            f"{run_dir}: a file is in the way of the run directory (or of a parent); choose "
            f"another run.out_dir / run.name"
        ) from None
    except NotADirectoryError:
        raise RunDirectoryError(
            f"{run_dir}: a parent of the run directory is a file; choose another run.out_dir"
        ) from None
    except PermissionError:
        raise RunDirectoryError(f"{run_dir}: not writable (permission denied); choose another run.out_dir") from None
    try:
        held = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
        if held and not run.resume:
            checkpoints = complete_checkpoints(run_dir)
            what = (
                f"checkpoint {checkpoints[-1].name}"
                if checkpoints
                else ", ".join(held[:3]) + (", …" if len(held) > 3 else "")
            )
            if not run.overwrite:
                raise RunDirectoryError(
                    f"{run_dir} already holds a run ({what}); pass --resume (run.resume=true) to continue it, choose "
                    f"another run.name, or set run.overwrite=true to move it aside"
                )
            aside = aside_name(run_dir)
            os.replace(run_dir, aside)  # holding the old lock throughout: nobody starts in it meanwhile
            lock.moved(aside)
            run_dir.mkdir()
            new_lock = DirectoryLock(run_dir, command).acquire()
            lock.release()
            lock = new_lock
            console.print(f"run.overwrite: moved the earlier {run_dir} aside to {aside}", soft_wrap=True)
        remove_stale_temps(run_dir, note=lambda line: console.print(f"[yellow]{line}[/]", soft_wrap=True))
        yield run_dir
    finally:
        lock.release()
        if created:
            try:
                run_dir.rmdir()  # only when empty: a run that failed before writing anything leaves nothing behind
            except OSError:
                pass


def aside_name(path: Path) -> Path:
    """Where an existing output is moved instead of being replaced: `<name>.old-<time>` beside it (a free name)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    aside, number = path.with_name(f"{path.name}.old-{stamp}"), 1
    while aside.exists() or aside.is_symlink():
        number += 1
        aside = path.with_name(f"{path.name}.old-{stamp}-{number}")
    return aside


def claim_output_files(
    outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None], *, overwrite: bool
) -> None:
    """The files a command writes whole (`opd prompts template` / `select`, `opd dedup`: a prompt set, a report),
    by option name: one that is an input (the same file after resolving `.`, `..` and links) is refused, as writing
    it would replace what is read; one that exists already — another command's file, or this one's from an earlier
    run — is refused in one line before any work, or with `overwrite` moved aside to `<name>.old-<time>` (never
    deleted). Two outputs that are one file are refused too: the second written would replace the first."""
    given = [(flag, Path(p)) for flag, p in outputs.items() if p is not None]
    for index, (flag, written) in enumerate(given):
        for other_flag, other in given[:index]:
            if written.resolve() == other.resolve():
                raise ValueError(
                    f"{flag} {written} is the {other_flag} file too; one file cannot hold both outputs: choose "
                    f"another {flag} path"
                )
    for flag, path in outputs.items():
        for in_flag, source in inputs.items():
            if path is not None and source is not None and Path(path).resolve() == Path(source).resolve():
                raise ValueError(
                    f"{flag} {path} is the {in_flag} file itself; writing it would replace the input: choose another "
                    f"{flag} path"
                )
    existing = [
        (flag, Path(p)) for flag, p in outputs.items() if p is not None and (Path(p).exists() or Path(p).is_symlink())
    ]
    for flag, path in existing:  # every refusal before the first move
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a directory; expected a file path here")
        if not overwrite:
            raise ValueError(
                f"{flag} {path}: the file exists; choose another path, or pass --overwrite to move it aside "
                f"(to {path.name}.old-<time>)"
            )
    for _, path in existing:
        path.rename(aside_name(path))


_RUN_RECORDS = frozenset({"metrics.jsonl", "samples", "checkpoints"})


def resume_checkpoint(
    run_dir: Path, run: RunSpec, console: Any, config: BaseModel | None = None, *, command: str = "distill"
) -> Path | None:
    """The newest verified checkpoint of `run_dir` when `run.resume` is set: None, with a note, when the directory
    holds nothing yet; a RunDirectoryError when it holds a run but no checkpoint verifies (never a silent restart
    over its metrics and samples). A newest checkpoint that fails verification (truncated, corrupt) is skipped with
    a warning. With `config`, the saved config.yaml is compared first (`check_resumed_config`)."""
    if not run.resume:
        return None
    skipped: list[str] = []

    def warn(line: str) -> None:
        skipped.append(line)
        console.print(f"[yellow]warning: {line}[/]", soft_wrap=True)

    checkpoint = latest_checkpoint(run_dir, hashes=True, warn=warn)
    if checkpoint is None:
        # what a restart from step 0 would rewrite; other entries (the demo's before-training evals) are no run
        held = sorted(p.name for p in run_dir.iterdir() if p.name in _RUN_RECORDS) if run_dir.is_dir() else []
        if held:
            newest = f" (the newest: {skipped[0].removesuffix(_FALLING_BACK)})" if skipped else ""
            raise RunDirectoryError(
                f"--resume: {run_dir} holds a run ({', '.join(held[:3])}{', …' if len(held) > 3 else ''}) but no "
                f"checkpoint that verifies{newest}; nothing was changed. Start another run.name, or set "
                f"run.overwrite=true (without --resume) to move it aside and start anew"
            )
        console.print(f"[yellow]run.resume: {run_dir} holds no run yet; starting from scratch[/]", soft_wrap=True)
    elif config is not None:
        check_resumed_config(config, run_dir, step=int(checkpoint.name.split("_")[-1]), command=command)
    return checkpoint


def check_resumed_config(config: BaseModel, run_dir: Path, *, step: int, command: str = "distill") -> None:
    """Refuse a resume whose config differs from the saved `config.yaml` in a key outside `RESUMABLE[command]` (one
    line naming each changed key, old → new), unless `run.allow_config_change`. Also refuse a run.steps below the
    checkpoint's step."""
    run = config.run  # type: ignore[attr-defined]  # every command's config (a BaseModel) has a run section
    total = getattr(run, "steps", None)
    if total is not None and total < step:
        raise RunDirectoryError(
            f"run.steps={total} but {run_dir} holds checkpoint step_{step}: a resume cannot go "
            f"back; raise run.steps, or start another run.name"
        )
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file() or run.allow_config_change:
        return
    _, saved = read_yaml_mapping(saved_path)  # unparsable or not a mapping: one line naming the file
    try:  # read with today's schema, so fields added since are compared at their defaults
        saved = type(config).model_validate(saved).model_dump(mode="json")
    except ValueError:
        pass  # a config of an older layout: compare the keys both have
    changed = [
        f"{key}: {_short(old)} → {_short(new)}"
        for key, old, new in config_changes(saved, config.model_dump(mode="json"))
        if not is_resumable(key, RESUMABLE[command])
    ]
    if changed:
        raise RunDirectoryError(
            f"--resume of {run_dir} (step {step}) with a changed config: {'; '.join(changed)}. Resume with the saved "
            f"settings ({saved_path}), pass --allow-config-change (run.allow_config_change=true) to continue anyway, "
            f"or start another run.name"
        )


def config_changes(old: dict, new: dict) -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) for every leaf that differs; a key absent on one side is skipped (a field
    added or removed between versions), a leaf on one side that is a section on the other (`teacher: null` → a
    teacher) is a change of that key."""
    flat_old, flat_new = flatten_dotted(old), flatten_dotted(new)
    changes = []
    for key in sorted(set(flat_old) | set(flat_new)):
        if key in flat_old and key in flat_new:
            if flat_old[key] != flat_new[key]:
                changes.append((key, flat_old[key], flat_new[key]))
        elif key in flat_old and any(k.startswith(key + ".") for k in flat_new):
            changes.append((key, flat_old[key], "{…}"))
        elif key in flat_new and any(k.startswith(key + ".") for k in flat_old):
            changes.append((key, "{…}", flat_new[key]))
    return changes


def is_resumable(key: str, allowed: Collection[str]) -> bool:
    """Whether dotted `key` is in the allow-list `allowed` (an exact key, or `section.*` for a whole section)."""
    return any(key == entry or (entry.endswith(".*") and key.startswith(entry[:-1])) for entry in allowed)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def open_run(config: BaseModel, run_dir: Path, run: RunSpec, *, resume_step: int | None):
    """Create the run directory, save the resolved config, and open the metrics sink (which drops lines of steps
    after `resume_step`: they are recomputed). On a resume, a saved config.yaml that differs from the new one is kept
    as `config.step_<resume_step>.yaml` (the settings of the steps up to there)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if resume_step is not None:
        from opd.report.report import check_run_files  # here: it imports matplotlib, which only a resume needs

        check_run_files(run_dir)  # damage read back at the end (the report) is one line now, nothing changed yet
        keep_config_history(config, run_dir, resume_step)
    save_config(config, run_dir)
    return MetricsSink(
        run_dir,
        tensorboard=run.tensorboard,
        wandb_project=run.wandb_project,
        config=config.model_dump(mode="json"),
        resume_step=resume_step,
    )


def keep_config_history(config: BaseModel, run_dir: Path, step: int) -> Path | None:
    """Copy `run_dir/config.yaml` to `config.step_<step>.yaml` (…`.2.yaml` when that exists) when it differs from
    `config`; return the copy."""
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    text = saved.read_text()
    if text == yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False):
        return None
    copy, number = run_dir / f"config.step_{step}.yaml", 1
    while copy.exists() and copy.read_text() != text:
        number += 1
        copy = run_dir / f"config.step_{step}.{number}.yaml"
    atomic_write_text(copy, text)
    return copy


def check_same_work(
    out: str | Path, saved: dict[str, Any], current: dict[str, Any], *, what: str, command: str | None = None
) -> None:
    """Resume the work in `out` only with the settings it was made with.

    `saved` / `current`: flat dotted dicts (`flatten_dotted`) of what made the work and of this run. The first key
    of `saved` (in its order) outside `RESUMABLE[command]` whose values differ raises ValueError, one line naming it,
    old → new. Keys `saved` lacks (written by an older opd) are not compared. Used by `opd rollout` and `opd eval`.
    """
    allowed = RESUMABLE[command] if command else ()
    for key, value in saved.items():
        if not is_resumable(key, allowed) and value != current.get(key):
            raise ValueError(
                f"{out} holds {what} made with another {key}: {value!r} → {current.get(key)!r} in "
                f"this run; use another --out, or the same settings to resume"
            )


def check_identity(path: Path, identity: dict[str, Any], *, resuming: bool, out: Path, what: str) -> None:
    """What a command's output is made from beyond its config (model files' fingerprints, ...), kept in `path`
    (`identity.json`): written before the first record of new work; a rerun that finds work (`resuming`) must find
    the same (`check_same_work`), and finding none means an older opd wrote the work: refused, one line, as whether
    its inputs changed cannot be told. Used by `opd rollout` and `opd prompts score` (`opd eval` keeps its own)."""
    if not resuming:
        atomic_write_json(path, identity)
        return
    if not path.is_file():
        raise ValueError(
            f"{out} holds {what} but no {path.name} (an older opd wrote it): whether the model files or the inputs "
            "changed since cannot be told; use another --out"
        )
    check_same_work(out, read_json_object(path), identity, what=what)


# ------------------------------------------------------------- checkpoint directories on disk
# (what a checkpoint holds and how it is written: opd.train.checkpoint)

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.pt"
MANIFEST = "MANIFEST.json"
_FALLING_BACK = "; falling back to the previous one"  # the end of latest_checkpoint's warning for each skipped one
_TEMP_DIR = re.compile(r"^\.(tmp|old)-step_\d+-(\d+)$")


def write_manifest(directory: Path) -> Path:
    """Write `directory/MANIFEST.json`: {"files": {name: {"bytes", "sha256"}}} of every file beside it, each fsynced
    first, so that the manifest (written last, then fsynced) implies complete, durable files."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MANIFEST)
    with ThreadPoolExecutor(max_workers=min(8, len(files) or 1)) as pool:  # hashlib releases the GIL
        digests = list(pool.map(_sha256_and_sync, files))
    entries = {str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": d} for p, d in zip(files, digests)}
    path = directory / MANIFEST
    with open(path, "w") as handle:
        json.dump({"files": entries}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    return path


def verify_checkpoint(path: str | Path, *, hashes: bool = False) -> str | None:
    """None when `path` is a complete checkpoint, else why not (one short phrase). Sizes are always checked against
    the manifest, sha256 digests when `hashes`. A checkpoint without a manifest (written before manifests existed)
    passes when its COMPLETE marker and trainer state exist."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        if (path / COMPLETE).is_file() and (path / STATE_FILE).is_file():
            return None
        return "no MANIFEST.json"
    try:
        entries = read_manifest(manifest)  # any other shape: unreadable, never a traceback
    except (ValueError, OSError):
        return f"unreadable {MANIFEST}"
    for name, entry in entries.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']}"
        if hashes and file_sha256(file) != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    if STATE_FILE not in entries:
        return f"no {STATE_FILE}"
    return None


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Checkpoint directories that claim to be complete (a manifest, or the legacy COMPLETE marker + trainer
    state), oldest first. Not verified: see `latest_checkpoint`."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = name_step(path)  # step_<N>; an absurd N is one line naming the directory
        if step is not None and (
            (path / MANIFEST).is_file() or ((path / COMPLETE).exists() and (path / STATE_FILE).exists())
        ):
            found.append((step, path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(
    run_dir: str | Path, *, hashes: bool = False, warn: Callable[[str], None] | None = None
) -> Path | None:
    """The newest checkpoint that verifies (`verify_checkpoint`); each newer one that does not is skipped with a
    one-line warning through `warn` (default: stderr)."""
    warn = warn or (lambda line: print(f"warning: {line}", file=sys.stderr))
    root = Path(run_dir) / "checkpoints"
    steps = (
        sorted(((step, p) for p in root.iterdir() if (step := name_step(p)) is not None), reverse=True)
        if root.is_dir()
        else []
    )
    for _, path in steps:
        problem = verify_checkpoint(path, hashes=hashes)
        if problem is None:
            return path
        warn(f"checkpoint {path} is incomplete or corrupt ({problem}){_FALLING_BACK}")
    return None


def remove_stale_temps(run_dir: str | Path, note: Callable[[str], None] | None = None) -> list[Path]:
    """Remove `checkpoints/.tmp-step_*-<pid>` and `.old-step_*-<pid>` left by writers that were killed (their pid is
    not running, or is this process's own: nothing is being written yet when a run starts). Call it holding the run
    directory's lock. Returns what was removed."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    removed = []
    for path in sorted(root.iterdir()):
        match = _TEMP_DIR.match(path.name)
        if match and path.is_dir() and (int(match.group(2)) == os.getpid() or not pid_alive(int(match.group(2)))):
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
            if note is not None:
                note(f"removed {path}, left by an interrupted checkpoint write ({format_size(size)})")
    return removed


def checkpoint_step(path: Path) -> int:
    step = name_step(path)
    if step is None:
        raise ValueError(f"{path}: not a checkpoint directory (step_<N>)")
    return step


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(16 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _sha256_and_sync(path: Path) -> str:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())
    return file_sha256(path)


def format_size(num_bytes: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.1f} {unit}"
    return f"{num_bytes} bytes"
