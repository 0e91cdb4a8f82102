"""Atomic, verified checkpoints with everything needed for an exact resume.

`checkpoints/step_N/` holds Hugging Face `save_pretrained` weights + tokenizer (loadable by any tool),
`trainer_state.pt` (optimizer, scheduler, RNG states, sampler position, metric history), a `COMPLETE` marker and,
written last, `MANIFEST.json` (name, size and sha256 of every other file). A checkpoint is written into a hidden temp
directory and renamed into place only when complete, so a kill leaves the previous one the newest loadable one.
Choosing and verifying checkpoints (`latest_checkpoint`, the manifest) is `opd.rundir`'s; the write, the
verification and the older layout in full: docs/design.md, "opd.train.checkpoint".
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from opd.io import checked_step, give_umask_modes, name_step
from opd.rundir import (  # the checkpoint directories on disk: names, manifest, verification, listing
    COMPLETE,
    MANIFEST,
    STATE_FILE,
    checkpoint_step,
    complete_checkpoints,
    format_size,
    latest_checkpoint,
    remove_stale_temps,
    verify_checkpoint,
    write_manifest,
)

# the directory functions live in opd.rundir; they stay importable from here
__all__ = [
    "COMPLETE",
    "MANIFEST",
    "STATE_FILE",
    "CheckpointWriteError",
    "latest_checkpoint",
    "load_trainer_state",
    "remove_stale_temps",
    "rng_state",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
    "write_manifest",
]


class CheckpointWriteError(OSError, ValueError):
    """Writing a checkpoint failed (disk full, file too large, read-only); the message is one line (a ValueError, so
    the CLI prints it without a traceback)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # one state per device the saving process saw: a resume on a host (or under torchrun with
        # CUDA_VISIBLE_DEVICES) that sees fewer devices restores those it has
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    *,
    model: torch.nn.Module,
    tokenizer: Any,
    trainer_state: dict,
    keep_last: int | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write `run_dir/checkpoints/step_{step}` atomically (manifest last) and prune older ones beyond `keep_last`.
    state_dict: the weights to write instead of the module's own (FSDP: the gathered full state dict).

    Pruning only ever removes complete checkpoints of steps *before* this one: a newer step directory (left by a
    resume that fell back past a corrupt checkpoint) is replaced when its step is saved again, never pruned."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        cast(Any, model).save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
        give_umask_modes(tmp)  # safetensors writes its files 0600
        (tmp / COMPLETE).write_text(f"{step}\n")
        write_manifest(tmp)
    except BaseException as error:  # also a KeyboardInterrupt: never leave a partial copy behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(error, Exception) and _is_write_failure(error):
            needed = _tensor_bytes(state_dict if state_dict is not None else model.state_dict()) + _tensor_bytes(
                trainer_state
            )
            free = shutil.disk_usage(root).free
            raise CheckpointWriteError(
                f"could not write checkpoint step_{step} into {root} ({_reason(error)}): it needs about "
                f"{format_size(needed)}, {format_size(free)} free there; the partial copy was removed. "
                "Free space (or lower run.keep_last) and rerun with --resume"
            ) from None
        raise
    if final.exists():  # re-saving the same step (e.g. after a resume): move the old one aside first
        old = root / f".old-step_{step}-{os.getpid()}"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep_last:
        earlier = [path for path in complete_checkpoints(run_dir) if checkpoint_step(path) < step]
        for stale in earlier[: max(0, len(earlier) - (keep_last - 1))]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


_STATE_KEYS = ("step", "rng", "optimizer", "scheduler", "sampler")  # what every trainer saves and restores


def load_trainer_state(checkpoint: str | Path, *, mmap: bool = False) -> dict:
    """The trainer state of a checkpoint; RNG states are restored by the caller with `set_rng_state`. A file that
    does not load, is not a trainer state, or names another step than its directory is a ValueError naming it (its
    manifest can agree with damage written before it: a copy, a disk that lies). `mmap`: the tensors stay in the
    file until read (a look at the state's small entries before any model loads costs no optimizer-sized read)."""
    path = Path(checkpoint) / STATE_FILE
    advice = f"the checkpoint is damaged: move {checkpoint} out of the run directory to resume from an earlier one"
    try:
        # weights_only: tensors, containers and numpy's RNG state only; a run directory from elsewhere cannot make
        # torch.load run code
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except OSError:
        raise
    except Exception as error:  # pickle, zip and torch errors alike: the bytes are not a state torch.save wrote
        raise ValueError(f"{path}: not loadable ({type(error).__name__}: {str(error)[:120]}); {advice}") from None
    missing = [key for key in _STATE_KEYS if key not in state] if isinstance(state, dict) else list(_STATE_KEYS)
    if missing:
        raise ValueError(f"{path}: not a trainer state (no {', '.join(missing)}); {advice}")
    step = checked_step(state["step"], str(path))
    if step != name_step(Path(checkpoint)):
        raise ValueError(f"{path}: says step {step}, its directory is {Path(checkpoint).name}; {advice}")
    return state


# -------------------------------------------------------------------------------------------------- helpers


def _numpy_rng_globals() -> list:
    """What unpickling `np.random.get_state()` needs (an ndarray of uint32): the only non-torch objects we save."""
    core: Any = np._core if hasattr(np, "_core") else np.core  # numpy 2 renamed np.core
    multiarray = core.multiarray
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors inside a (nested) state: what writing it needs, give or take the file headers."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _is_write_failure(error: Exception) -> bool:
    """An OS-level write failure, as raised directly or wrapped by torch.save / safetensors."""
    if isinstance(error, OSError):
        return True
    text = str(error)
    return any(
        s in text
        for s in (
            "No space left",
            "file write failed",
            "File too large",
            "StorageFull",
            "Read-only file system",
            "Disk quota",
            "IoError",
            "unexpected pos",
        )
    )


def _reason(error: Exception) -> str:
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    for phrase in ("No space left on device", "File too large", "Read-only file system", "Disk quota exceeded"):
        if phrase in str(error):
            return phrase
    return str(error).strip().splitlines()[-1][:120] if str(error).strip() else type(error).__name__
