"""Fingerprints of models: of a model directory's files (every byte, cached per file) and of the weights of a module
in memory; and of tokenized data (`data_fingerprint`). They identify work (an eval's samples, a teacher's scores, a
checkpoint's teacher manifest, a rollout's prompts), so that a rerun on other weights or data is noticed; they are not
a defence against a forged file."""

from __future__ import annotations

import hashlib
import json
import time
from array import array
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

_MODEL_FILE_SUFFIXES = (".json", ".safetensors", ".bin", ".pt", ".pth", ".model", ".txt", ".jinja", ".py", ".tiktoken")
_HASH_CHUNK = 8 << 20
_RACY_NS = 2_000_000_000  # a file modified this recently may change again within its mtime's tick: never cached
_file_hashes: dict[tuple[str, int, int, int], str] = {}  # (path, size, mtime_ns, inode) -> digest, this process


def data_fingerprint(rows: Iterable[tuple[Sequence[int], Any]]) -> str:
    """sha256 of data as a command sees it, rows of (token ids, anything JSON-able: the answer, the target mask):
    what a trainer's `--resume` compares, so that a data file regenerated in place (same path, same row count) is not
    consumed from the old sampler position, and what `opd rollout` records of its prompts."""
    digest = hashlib.sha256()
    for ids, extra in rows:
        digest.update(len(ids).to_bytes(8, "little"))
        digest.update(array("q", ids).tobytes())
        digest.update(json.dumps(extra, default=str, separators=(",", ":")).encode() + b"\n")
    return digest.hexdigest()


def prompt_digest(messages: Sequence[dict[str, Any]]) -> str:
    """16 hex digits of the sha256 of a prompt's chat messages: what `opd prompts score` stores in each record and a
    resumed run compares, so that a prompt edited under the same id is never left with the old prompt's score."""
    text = json.dumps(list(messages), sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_fingerprint(path: str) -> str | None:
    """A short hash of a model directory's config, tokenizer and weight files, every byte of each (cached per file by
    path, size, mtime and inode, so a re-evaluation does not hash again). None for a hub id not in the local cache."""
    root = _local_model_dir(path)
    if root is None:
        return None
    digest = hashlib.sha256()
    for file in sorted(root.iterdir()):
        if file.is_file() and file.suffix in _MODEL_FILE_SUFFIXES:
            digest.update(f"{file.name}\0{file_digest(file)}\0".encode())
    return digest.hexdigest()[:16]


def weights_fingerprint(model: Any) -> str:
    """A short hash of the weights of a module in memory (every parameter and buffer: name, dtype, shape, bytes): what
    a trainer's in-run eval evaluates, which the model's path does not identify once training has changed it."""
    digest = hashlib.sha1()
    tensors = [*model.named_parameters(), *model.named_buffers()]
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach()
        if hasattr(data, "to_local"):  # a DTensor shard (FSDP outside `gathered`): this rank's part
            data = data.to_local()
        # a copy of our own: `.numpy()` marks a storage non-resizable, and FSDP frees the unsharded parameters'
        # storages (a device tensor's `.cpu()` is that copy already; hashlib reads the array's buffer in place)
        data = data.cpu().contiguous() if data.device.type != "cpu" else data.clone().contiguous()
        digest.update(f"{name}\0{data.dtype}\0{tuple(data.shape)}\0".encode())
        if data.numel():
            digest.update(data.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def _local_model_dir(path: str) -> Path | None:
    local = Path(path).expanduser()
    if local.is_dir():
        return local
    try:  # a hub id: its snapshot in the local cache, without the network
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=str(path), local_files_only=True))
    except Exception:
        return None


def file_digest(file: Path) -> str:
    """SHA-1 of every byte of `file` (its cost: docs/performance.md; not a defence against a forged file, a fingerprint
    of work), remembered by (path, size, mtime_ns, inode) for this process unless the file was modified in the last
    seconds."""
    stat = file.stat()
    key = (str(file.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    if key in _file_hashes:
        return _file_hashes[key]
    started = time.time_ns()
    digest = hashlib.sha1(str(stat.st_size).encode())
    with open(file, "rb") as handle:
        while chunk := handle.read(_HASH_CHUNK):
            digest.update(chunk)
    value = digest.hexdigest()
    after = file.stat()
    unchanged = (after.st_size, after.st_mtime_ns, after.st_ino) == key[1:]
    if unchanged and started - stat.st_mtime_ns > _RACY_NS:
        _file_hashes[key] = value
    return value
