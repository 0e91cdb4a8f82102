"""Atomic checkpoints with everything needed for an exact resume.

`checkpoints/step_N/` holds Hugging Face `save_pretrained` weights + tokenizer (loadable by any tool) and
`trainer_state.pt` (optimizer, scheduler, RNG states, sampler position, metric history). A checkpoint is written
into a hidden temp directory and renamed into place only when complete, with a `COMPLETE` marker inside, so a
kill during writing leaves the previous checkpoint as the newest loadable one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from opd.io import give_umask_modes

COMPLETE = "COMPLETE"
STATE_FILE = "trainer_state.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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
        torch.cuda.set_rng_state_all(state["cuda"])


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
    """Write `run_dir/checkpoints/step_{step}` atomically and prune older ones beyond `keep_last`.
    state_dict: the weights to write instead of the module's own (FSDP: the gathered full state dict)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    tmp = root / f".tmp-step_{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True, state_dict=state_dict)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    torch.save({**trainer_state, "step": step, "rng": rng_state()}, tmp / STATE_FILE)
    give_umask_modes(tmp)  # safetensors writes its files 0600
    (tmp / COMPLETE).write_text(f"{step}\n")
    if final.exists():  # re-saving the same step (e.g. after a resume): move the old one aside first
        old = root / f".old-step_{step}-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    if keep_last:
        for stale in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(stale, ignore_errors=True)
    return final


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoint directories, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_DIR.match(path.name)
        if match and (path / COMPLETE).exists() and (path / STATE_FILE).exists():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    checkpoints = complete_checkpoints(run_dir)
    return checkpoints[-1] if checkpoints else None


def load_trainer_state(checkpoint: str | Path) -> dict:
    """The trainer state of a checkpoint; RNG states are restored by the caller with `set_rng_state`."""
    return torch.load(Path(checkpoint) / STATE_FILE, map_location="cpu", weights_only=False)
