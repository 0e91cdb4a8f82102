"""`opd pipeline run`: rollout → SFT → OPD → eval on tiny models, the final comparison, and stage skipping on rerun."""

import json

import pytest
import torch
import yaml
from typer.testing import CliRunner

from helpers import EOS_ID, make_tiny_model, make_tiny_tokenizer
from opd.cli import app


def _teacher_that_boxes(path, tokenizer, prompts):
    """A tiny teacher trained (seconds) to answer every prompt with `\\boxed{4}`: it passes rejection sampling."""
    model = make_tiny_model("qwen3", seed=3).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    target = tokenizer("\\boxed{4}")["input_ids"] + [EOS_ID]
    rows = []
    for text in prompts:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        rows.append((prompt_ids, target))
    for _ in range(120):
        for prompt_ids, target_ids in rows:
            ids = torch.tensor([prompt_ids + target_ids])
            labels = ids.clone()
            labels[:, : len(prompt_ids)] = -100
            model(ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.slow
def test_pipeline_end_to_end_and_skips_complete_stages(tmp_path):
    tokenizer = make_tiny_tokenizer()
    prompts = ["2+2=", "1+3=", "3+1="]
    _teacher_that_boxes(tmp_path / "teacher", tokenizer, prompts)
    make_tiny_model("qwen3", seed=0).save_pretrained(tmp_path / "student")
    tokenizer.save_pretrained(tmp_path / "student")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "answer": "4"}) + "\n" for p in prompts))
    spec = {"path": str(data), "answer_key": "answer", "max_prompt_length": 32}
    config = {
        "teacher": {"path": str(tmp_path / "teacher")},
        "student": {"path": str(tmp_path / "student")},
        "sft_prompts": spec,
        "opd_prompts": spec,
        "eval": {
            "benchmarks": [str(data)],
            "prompt_key": "prompt",
            "answer_key": "answer",
            "n": 2,
            "max_new_tokens": 12,
            "temperature": 0.5,
        },
        "out_dir": str(tmp_path / "pipe"),
        "rollout": {"n": 2, "temperature": 0.5, "max_new_tokens": 12},
        "sft": {
            "run": {"steps": 3, "report": False},
            "optim": {"lr": 1e-3},
            "examples_per_step": 2,
            "data": {"max_length": 64},
            "micro_batch_tokens": 256,
        },
        "distill": {
            "run": {"steps": 2, "report": False},
            "prompts_per_step": 2,
            "rollout": {"n": 2, "max_new_tokens": 8},
            "optim": {"lr": 1e-3},
            "micro_batch_tokens": 64,
        },
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))

    result = CliRunner().invoke(app, ["pipeline", "run", str(path)])
    assert result.exit_code == 0, result.output
    root = tmp_path / "pipe"
    for stage in ("rollout", "sft", "distill", "eval"):
        assert (root / stage / "STAGE_COMPLETE").exists(), stage
    assert sum(1 for _ in open(root / "rollout" / "rollouts.jsonl")) == 6
    summary = json.loads((root / "summary.json").read_text())["prompts"]
    assert set(summary) >= {"student", "sft", "opd", "teacher"}
    assert summary["teacher"] == 1.0  # the boxing teacher is right on every prompt
    assert "gap_recovery" in result.output

    # rerun: every stage is complete and skipped; the table is printed again
    result = CliRunner().invoke(app, ["pipeline", "run", str(path)])
    assert result.exit_code == 0, result.output
    assert result.output.count("already complete") == 4


def test_pipeline_stage_keys_are_validated_up_front(tmp_path):
    config = {
        "teacher": {"path": "t"},
        "student": {"path": "s"},
        "sft_prompts": {"path": "p"},
        "opd_prompts": {"path": "p"},
        "distill": {"objective": {"strategi": "union"}},
        "out_dir": str(tmp_path / "pipe"),
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["pipeline", "run", str(path)])
    assert result.exit_code != 0
    assert "pipeline stage 'distill': unknown config key 'objective.strategi'" in str(result.exception)


@pytest.mark.parametrize(
    ("distill", "culprit"),
    [
        ({"rollout": {"overlap": True}}, "objective.tis_cap"),
        ({"micro_batch_tokens": 8}, "micro_batch_tokens=8"),
        ({"rollout": {"max_batch_tokens": 8}}, "rollout.max_batch_tokens=8"),
    ],
)
def test_pipeline_checks_every_stage_before_the_first_runs(tmp_path, distill, culprit):
    """A fault in the distill section fails before the rollout stage (not after rollout and SFT have run)."""
    tokenizer = make_tiny_tokenizer()
    make_tiny_model("qwen3", seed=0).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "2+2=", "answer": "4"}) + "\n")
    spec = {"path": str(data), "answer_key": "answer", "max_prompt_length": 32}
    config = {
        "teacher": {"path": str(tmp_path / "model")},
        "student": {"path": str(tmp_path / "model")},
        "sft_prompts": spec,
        "opd_prompts": spec,
        "distill": distill,
        "out_dir": str(tmp_path / "pipe"),
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(app, ["pipeline", "run", str(path)])
    assert result.exit_code != 0 and culprit in str(result.exception), result.output
    assert "pipeline stage 'distill'" in str(result.exception)
    assert not (tmp_path / "pipe" / "rollout").exists()
