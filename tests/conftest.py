"""Shared test fixtures: the tiny offline tokenizer and tiny random-weight models (built by `helpers`), the small
worlds of the end-to-end runs, and a console of fixed width for every test.

Use the fixtures (`tiny_tokenizer`, `tiny_llama`, `tiny_qwen3`, `tiny_model_dir`, `world`, `model_dirs`, `sft_data`)
or import the plain functions (`from helpers import make_tiny_tokenizer, make_tiny_model`) when a test needs a
variant, e.g. another vocab size.

Importing this module sets `torch.set_num_threads(1)` for the whole test session (tiny tensors run ~10x faster
without OpenMP wake-ups on the shared 2-core machine).

Without CUDA, importing this module also sets `TRITON_INTERPRET=1` (before anything imports Triton), so that the
Triton kernels, when Triton is installed, run through Triton's interpreter on CPU tensors and are tested here.

Every test runs with `COLUMNS` and `LINES` fixed (`fixed_console_size`): rich sizes its consoles from them before
the terminal's, so what a command prints wraps the same on every terminal and in every checkout path.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from helpers import CONSOLE_COLUMNS, SFT_QA, chat, make_tiny_model, make_tiny_tokenizer, write_jsonl

# Tests use tiny tensors: one intra-op thread avoids OpenMP wake-ups that make them ~10x slower on a busy 2-core box.
torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def fixed_console_size():
    """Rich reads COLUMNS/LINES when a console is made and when it measures itself; subprocesses inherit them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("COLUMNS", str(CONSOLE_COLUMNS))
        patch.setenv("LINES", "50")
        yield


@pytest.fixture(scope="session")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The shared tiny tokenizer (session-scoped: do not mutate it; call `make_tiny_tokenizer()` for your own)."""
    return make_tiny_tokenizer()


@pytest.fixture
def tiny_llama() -> PreTrainedModel:
    """A fresh tiny Llama (vocab 261, seed 0) per test, so tests may change its weights."""
    return make_tiny_model("llama")


@pytest.fixture
def tiny_qwen3() -> PreTrainedModel:
    """A fresh tiny Qwen3 (vocab 261, seed 0, QK-norm, tied embeddings off) per test."""
    return make_tiny_model("qwen3")


@pytest.fixture
def tiny_model_dir(tmp_path, tiny_tokenizer):
    """A directory holding `save_pretrained` weights of a tiny Llama and the tiny tokenizer, as on the Hub."""
    path = tmp_path / "tiny-llama"
    make_tiny_model("llama").save_pretrained(path)
    tiny_tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny student and teacher (same tokenizer, different weights) and a prompt set with answers, for
    `helpers.distill_config` (features/bad_inputs and features/test_distributed have worlds of their own)."""
    root = tmp_path_factory.mktemp("world")
    tokenizer = make_tiny_tokenizer()
    for name, seed in (("student", 0), ("teacher", 1)):
        make_tiny_model("qwen3", seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@pytest.fixture
def model_dirs(tmp_path):
    """A tiny Llama student (seed 0) and teacher (seed 1), each saved with the tiny tokenizer, by name."""
    tokenizer = make_tiny_tokenizer()
    dirs = {}
    for name, seed in (("student", 0), ("teacher", 1)):
        dirs[name] = tmp_path / name
        make_tiny_model("llama", seed=seed).save_pretrained(dirs[name])
        tokenizer.save_pretrained(dirs[name])
    return dirs


@pytest.fixture
def sft_data(tmp_path):
    return write_jsonl(tmp_path / "sft.jsonl", [{"messages": chat(q, a)} for q, a in SFT_QA * 3])


@pytest.fixture(scope="session", autouse=True)
def compile_cache_in_tmp(tmp_path_factory):
    """Runs that compile keep their artefacts (`opd.compile_cache`) in a folder of the session, never the user's
    ~/.cache; subprocesses inherit it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OPD_COMPILE_CACHE", str(tmp_path_factory.mktemp("opd-compile-cache")))
        yield


@pytest.fixture(scope="session")
def tool_user_dir(tmp_path_factory):
    """`tool_user_dir(**shape)`: the directory of `helpers_tools.train_tool_user(**shape)` (the tiny student trained to
    call the calculator), trained once per shape in a test session (the same weights each time: fixed seeds, one
    thread). Read-only: a test that changes the model copies it first."""
    from helpers_tools import train_tool_user

    built: dict[tuple, Path] = {}

    def get(**shape) -> Path:
        key = tuple(sorted(shape.items()))
        if key not in built:
            built[key] = train_tool_user(tmp_path_factory.mktemp("tool_user") / "model", **shape)
        return built[key]

    return get
