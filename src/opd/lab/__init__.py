"""The lab: a synthetic arithmetic task, a real HF tokenizer, and a tiny teacher/student pair shipped in the package.

`opd demo` distills the shipped student from the shipped teacher on CPU in a few minutes (`opd.recipes.demo`);
`opd lab build` retrains both from a seed (`opd.lab.build`); `opd lab run NAME` runs small replications
(`opd.recipes.lab`). The paths below point into the installed package (`opd/lab/assets`).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

TEST_SET: dict[str, Any] = dict(n=300, steps=(1, 5), split="test", seed=0, max_abs=99)
"""The held-out test set: `make_problems(**TEST_SET)` (written to assets/data/test.jsonl)."""
OPD_PROMPTS: dict[str, Any] = dict(n=2000, steps=(1, 5), split="train", seed=2, max_abs=99)
"""The OPD training prompts (assets/data/opd_prompts.jsonl): train split, so disjoint from the test set."""
SFT_SET: dict[str, Any] = dict(n=60000, steps=(1, 5), split="train", seed=0, max_abs=99)
"""The SFT problems both shipped models were trained on (forward-style solutions)."""


def assets_dir() -> Path:
    """The directory of the shipped lab assets (models, data, manifest.json)."""
    return Path(str(resources.files("opd.lab").joinpath("assets")))


def teacher_path() -> Path:
    """The shipped teacher: a save_pretrained directory with the lab tokenizer."""
    return assets_dir() / "teacher"


def student_path() -> Path:
    """The shipped student: a save_pretrained directory with the lab tokenizer."""
    return assets_dir() / "student"


def rewrite_teacher_path() -> Path:
    """The shipped rewrite-style teacher (the `style` replication's mismatched teacher; `opd lab build --only
    rewrite_teacher` makes one): a save_pretrained directory with the lab tokenizer."""
    return assets_dir() / "rewrite_teacher"


def specialist_path(domain: str) -> Path:
    """A shipped MOPD specialist (configs/lab_mopd.yaml; `opd lab build --only specialist_add,specialist_mul` makes
    them): the teacher fine-tuned to be accurate on its own domain (`add`: problems whose first operation is + or -,
    `mul`: *; `opd.lab.build.DOMAINS`) and systematically wrong on the other."""
    if domain not in ("add", "mul"):
        raise ValueError(f"domain must be 'add' or 'mul', got {domain!r}")
    return assets_dir() / f"specialist_{domain}"


def test_set_path() -> Path:
    """The held-out test set (verl-layout JSONL: prompt messages, reward_model.ground_truth), read by `opd eval`."""
    return assets_dir() / "data" / "test.jsonl"


def opd_prompts_path() -> Path:
    """The OPD training prompts (verl-layout JSONL), disjoint from the test set."""
    return assets_dir() / "data" / "opd_prompts.jsonl"


def mopd_prompts_path() -> Path:
    """The OPD prompts with data_source `opd_lab/add` or `opd_lab/mul` by their first operation (the MOPD routes of
    configs/lab_mopd.yaml; `opd.lab.build.mopd_prompt_rows` of opd_prompts.jsonl, nothing else changed)."""
    return assets_dir() / "data" / "mopd_prompts.jsonl"


def mopd_test_set_path() -> Path:
    """The test set with the same data_source as `mopd_prompts_path` (`mopd_prompt_rows` of test.jsonl): routed like
    the training prompts, so that configs/lab_mopd.yaml's in-run eval is also split per teacher."""
    return assets_dir() / "data" / "mopd_test.jsonl"


def manifest_path() -> Path:
    """manifest.json: per model its config, parameter count, training recipe and measured test accuracy."""
    return assets_dir() / "manifest.json"
