"""`opd rollout`: rejection sampling of teacher answers, driven by a scripted `Generator` over the tiny byte-level
tokenizer (so every rejection reason is triggered on purpose), plus real tiny-model runs in one and two processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import EOS_ID, tiny_rollout_config, write_prompts
from opd.config import ConfigError, build_config
from opd.eval.degeneracy import DegeneracySpec, degeneracy_reasons
from opd.io import read_jsonl
from opd.recipes.rollout import REASONS, RolloutConfig, check_response, teacher_rollout
from opd.rollout.base import GenerationOutput, Generator

GOOD = "Adding the two numbers gives four.\n\\boxed{4}"


class ScriptedGenerator:
    """Replies from a script: per prompt marker ("<q0>", ...) a queue of (text, finish_reason), one consumed per
    generated row in row order. "stop" replies end with EOS; "length" replies do not. Records every call."""

    def __init__(self, tokenizer, script: dict[str, list[tuple[str, str]]], fail_on_call: int | None = None):
        self.tokenizer = tokenizer
        self.queues = {marker: list(replies) for marker, replies in script.items()}
        self.calls: list[dict] = []
        self.fail_on_call = fail_on_call

    # the rest of the Generator protocol: nothing to hold, free or check
    def release(self) -> None: ...
    def close(self) -> None: ...
    def check_fits(self, prompt_tokens, new_tokens, *, reserve_bytes=0, names=()) -> None: ...

    def generate(self, prompt_ids, params):
        if self.fail_on_call is not None and len(self.calls) + 1 == self.fail_on_call:
            raise KeyboardInterrupt("simulated interruption")
        responses, finishes, groups, rows = [], [], [], []
        for p, ids in enumerate(prompt_ids):
            text = self.tokenizer.decode(ids)
            marker = next(m for m in self.queues if m in text)
            for _ in range(params.n):
                reply, finish = self.queues[marker].pop(0)
                body = self.tokenizer.encode(reply, add_special_tokens=False)
                responses.append(body + ([EOS_ID] if finish == "stop" else []))
                finishes.append(finish)
                groups.append(p)
                rows.append(marker)
        self.calls.append({"rows": rows, "n": params.n, "seed": params.seed})
        return GenerationOutput(response_ids=responses, finish_reasons=finishes, group_ids=groups)

    def sync_weights(self) -> None:
        pass


def make_config(tmp_path: Path, prompts: Path, **overrides) -> RolloutConfig:
    options = {
        "model.path": "scripted",
        "data.path": str(prompts),
        "out": str(tmp_path / "out"),
        "max_attempts": 3,
        "data.template": "keep",
        **overrides,
    }
    return build_config(RolloutConfig, options=options)


def run(tmp_path, tokenizer, script, count=None, **overrides):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = write_prompts(tmp_path / "prompts.jsonl", count or len(script))
    config = make_config(tmp_path, prompts, **overrides)
    generator = ScriptedGenerator(tokenizer, script)
    out = teacher_rollout(config, generator=generator, tokenizer=tokenizer)
    return out, generator


# ------------------------------------------------------------------------------------------------ the checks


def test_scripted_generator_is_a_generator(tiny_tokenizer):
    assert isinstance(ScriptedGenerator(tiny_tokenizer, {}), Generator)


@pytest.mark.parametrize(
    "text, finish, expected",
    [
        (GOOD, "stop", []),
        (GOOD, "length", ["truncated"]),
        ("Adding gives four.", "stop", ["no_answer"]),
        ("The result is clear.\nAnswer: 4", "stop", []),
        (
            "".join(f"Let me check this again carefully.\nstep {k}\n" for k in range(12)) + "\\boxed{4}",
            "stop",
            ["repeated_line"],
        ),
        ("Hmm " + "A" * 100 + "\n\\boxed{4}", "stop", ["token_run"]),
        ("abcdefghij" * 20 + "\n\\boxed{4}", "stop", ["repeated_block"]),
        ("Let me check this again carefully.\n" * 12 + "\\boxed{4}", "stop", ["repeated_line", "repeated_block"]),
        ("0000000000" * 10, "length", ["truncated", "no_answer", "token_run"]),
    ],
)
def test_check_response_reasons(tiny_tokenizer, text, finish, expected):
    config = RolloutConfig(model={"path": "m"}, data={"path": "p"}, out="o")
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    check = check_response(text, ids, finish, "4", config)
    assert check.reasons == expected
    if not expected:
        assert check.extracted == "4" and check.correct is True


def test_degeneracy_thresholds_are_configurable_and_can_be_off(tiny_tokenizer):
    text = "abcdefghij" * 20
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    assert degeneracy_reasons(text, ids, DegeneracySpec()) == ["repeated_block"]
    assert degeneracy_reasons(text, ids, DegeneracySpec(block_repeats=0)) == []
    assert degeneracy_reasons(text, ids, DegeneracySpec(block_min_tokens=500)) == []
    assert degeneracy_reasons(text, ids, DegeneracySpec(block_max_tokens=9)) == []  # the block is 10 tokens
    runs = "x" * 30
    assert degeneracy_reasons(runs, tiny_tokenizer.encode(runs), DegeneracySpec(token_run=30)) == ["token_run"]
    assert degeneracy_reasons(runs, tiny_tokenizer.encode(runs), DegeneracySpec(token_run=31)) == []
    lines = "\n".join(["short"] * 50 + ["a line long enough to count"] * 3)
    assert degeneracy_reasons(lines, [1, 2, 3], DegeneracySpec()) == []  # short lines never count
    assert degeneracy_reasons(lines, [1, 2, 3], DegeneracySpec(line_repeats=3)) == ["repeated_line"]
    with pytest.raises(ConfigError, match="degeneracy.token_run"):
        build_config(
            RolloutConfig, options={"model.path": "m", "data.path": "p", "out": "o", "degeneracy.token_run": -1}
        )


# ------------------------------------------------------------------------------------------------ rejection loop


def test_every_reason_through_the_loop_and_exhaustion(tiny_tokenizer, tmp_path):
    script = {
        "<q0>": [(GOOD, "length"), ("no answer here", "stop"), ("Hmm " + "A" * 80 + " \\boxed{4}", "stop")],
        "<q1>": [("abcdefghij" * 20 + " \\boxed{4}", "stop"), (GOOD, "stop")],
    }
    out, generator = run(tmp_path, tiny_tokenizer, script)
    accepted = read_jsonl(out / "rollouts.jsonl")
    rejected = read_jsonl(out / "rejected.jsonl")
    assert [r["prompt_id"] for r in accepted] == ["p1"] and [r["prompt_id"] for r in rejected] == ["p0"]
    assert rejected[0]["rejections"] == [["truncated"], ["no_answer"], ["token_run"]]
    assert rejected[0]["attempts"] == 3 and rejected[0]["last_response"].startswith("Hmm AAA")
    assert accepted[0]["attempts"] == 2 and accepted[0]["rejections"] == [["repeated_block"]]
    # Retries re-sample only the rejected rows, one row each, with a fresh seed per attempt.
    assert [c["rows"] for c in generator.calls] == [["<q0>", "<q1>"], ["<q0>", "<q1>"], ["<q0>"]]
    assert len({c["seed"] for c in generator.calls}) == 3
    assert all(not queue for queue in generator.queues.values())


def test_retry_succeeds_and_record_layout(tiny_tokenizer, tmp_path):
    script = {"<q0>": [("Hmm " + "A" * 80 + " \\boxed{4}", "stop"), (GOOD, "stop")], "<q1>": [(GOOD, "stop")]}
    out, _ = run(tmp_path, tiny_tokenizer, script, **{"data.template": "boxed"})
    records = read_jsonl(out / "rollouts.jsonl")
    assert [(r["prompt_id"], r["attempts"]) for r in records] == [("p0", 2), ("p1", 1)]
    first = records[0]
    assert first["rejections"] == [["token_run"]] and first["source"] == "toy" and first["answer"] == "4"
    assert [m["role"] for m in first["messages"]] == ["user", "assistant"]
    assert first["messages"][0]["content"].startswith("<q0> What is 2+2?")
    assert first["messages"][0]["content"].endswith("\\boxed{}.")  # the instruction template is part of the data
    assert first["messages"][1]["content"] == GOOD
    assert first["correct"] is True and first["extracted"] == "4" and "accepted" not in first
    assert (out / "config.yaml").exists() and not read_jsonl(out / "rejected.jsonl")


def test_require_correct(tiny_tokenizer, tmp_path):
    wrong = "So it is five.\n\\boxed{5}"
    script = {"<q0>": [(wrong, "stop"), (GOOD, "stop")]}
    out, _ = run(tmp_path / "lenient", tiny_tokenizer, script)
    record = read_jsonl(out / "rollouts.jsonl")[0]
    assert record["attempts"] == 1 and record["correct"] is False
    out, _ = run(tmp_path / "strict", tiny_tokenizer, script, require_correct=True)
    record = read_jsonl(out / "rollouts.jsonl")[0]
    assert record["attempts"] == 2 and record["rejections"] == [["wrong"]] and record["correct"] is True


def test_require_correct_needs_ground_truth(tiny_tokenizer, tmp_path):
    prompts = tmp_path / "bare.jsonl"
    prompts.write_text(json.dumps({"problem": "<q0> 2+2?"}) + "\n")
    config = make_config(tmp_path, prompts, require_correct=True, **{"data.prompt_key": "problem"})
    config.data.answer_key = None  # on the command line: data.answer_key=null
    with pytest.raises(ValueError, match="require_correct needs a ground truth"):
        teacher_rollout(config, generator=ScriptedGenerator(tiny_tokenizer, {}), tokenizer=tiny_tokenizer)


def test_acceptance_stats(tiny_tokenizer, tmp_path, capsys):
    script = {
        "<q0>": [(GOOD, "stop"), (GOOD, "length"), (GOOD, "stop")],  # sample 0 ok; sample 1 ok on attempt 2
        "<q1>": [
            ("nothing", "stop"),
            ("nothing", "length"),
            ("nothing", "stop"),
            ("nothing", "stop"),
            ("nothing", "stop"),
            ("nothing", "stop"),
        ],
    }
    out, _ = run(tmp_path, tiny_tokenizer, script, n=2)
    stats = json.loads((out / "stats.json").read_text())
    # q0: s0 @1, s1 @2 (truncated once). q1: both exhausted: 3 attempts each, all no_answer, one also truncated.
    assert stats["samples"] == 4 and stats["accepted"] == 2 and stats["exhausted"] == 2
    assert stats["attempts"] == 1 + 2 + 3 + 3
    assert stats["accepted_at_attempt"] == {"1": 1, "2": 1}
    assert stats["rejections"] == {
        "truncated": 2,
        "no_answer": 6,
        "repeated_line": 0,
        "token_run": 0,
        "repeated_block": 0,
        "malformed_call": 0,
        "wrong": 0,
    }
    assert stats["rejection_rate"]["no_answer"] == pytest.approx(6 / 9)
    assert stats["acceptance_rate"] == 0.5 and stats["attempt_acceptance_rate"] == pytest.approx(2 / 9)
    assert set(stats["rejections"]) == set(REASONS)
    printed = capsys.readouterr().out
    assert "no_answer" in printed and "accepted 2/4 samples" in printed
    records = read_jsonl(out / "rollouts.jsonl")
    assert [(r["prompt_id"], r["sample"]) for r in records] == [("p0", 0), ("p0", 1)]


# ------------------------------------------------------------------------------------------------ resume


def test_resume_after_interruption(tiny_tokenizer, tmp_path):
    """4 prompts in batches of 2: the run dies in the second batch; the rerun regenerates only that batch, with
    the same generate calls (seeds) as an uninterrupted run, and writes each sample exactly once."""
    script = {f"<q{i}>": [(GOOD, "stop")] for i in range(4)}
    prompts = write_prompts(tmp_path / "prompts.jsonl", 4)
    config = make_config(tmp_path, prompts, batch_size=2)
    crashing = ScriptedGenerator(tiny_tokenizer, script, fail_on_call=2)
    with pytest.raises(KeyboardInterrupt):
        teacher_rollout(config, generator=crashing, tokenizer=tiny_tokenizer)
    out = Path(config.out)
    assert not (out / "rollouts.jsonl").exists()
    log = out / "shards" / "rank_0.jsonl"
    assert [r["prompt_id"] for r in read_jsonl(log)] == ["p0", "p1"]
    with open(log, "a") as handle:  # a crash inside the next append leaves a partial line
        handle.write('{"prompt_id": "p2", "sam')

    resumed = ScriptedGenerator(tiny_tokenizer, {m: list(r) for m, r in script.items() if m in ("<q2>", "<q3>")})
    teacher_rollout(config, generator=resumed, tokenizer=tiny_tokenizer)
    records = read_jsonl(out / "rollouts.jsonl", skip_partial_last_line=False)
    assert [(r["prompt_id"], r["sample"]) for r in records] == [(f"p{i}", 0) for i in range(4)]
    assert [c["rows"] for c in resumed.calls] == [["<q2>", "<q3>"]]

    fresh = ScriptedGenerator(tiny_tokenizer, script)
    teacher_rollout(make_config(tmp_path / "fresh", prompts, batch_size=2), generator=fresh, tokenizer=tiny_tokenizer)
    assert resumed.calls[0]["seed"] == fresh.calls[1]["seed"]
    fresh_records = read_jsonl(tmp_path / "fresh" / "out" / "rollouts.jsonl")
    assert fresh_records == records

    # A finished run reruns as a no-op; a rerun asking for different samples is refused.
    idle = ScriptedGenerator(tiny_tokenizer, {})
    teacher_rollout(config, generator=idle, tokenizer=tiny_tokenizer)
    assert idle.calls == [] and read_jsonl(out / "rollouts.jsonl") == records
    with pytest.raises(ValueError, match="temperature"):
        teacher_rollout(
            make_config(tmp_path, prompts, batch_size=2, temperature=0.5), generator=idle, tokenizer=tiny_tokenizer
        )


def test_rerun_on_other_model_files_or_prompts_is_refused(tiny_tokenizer, tmp_path):
    """The output records what its samples come from (identity.json): a rerun into it after the model's files or the
    prompts changed at the same paths is refused in one line, before any sample, instead of mixing two models' or
    two datasets' samples; a directory with samples and no identity.json is refused too."""
    script = {f"<q{i}>": [(GOOD, "stop")] for i in range(2)}
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"weights": 1}')
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2)
    config = make_config(tmp_path, prompts, **{"model.path": str(model)})
    teacher_rollout(config, generator=ScriptedGenerator(tiny_tokenizer, script), tokenizer=tiny_tokenizer)
    out = Path(config.out)
    identity = json.loads((out / "identity.json").read_text())
    assert set(identity) == {"model_files", "prompts_sha256"} and identity["model_files"] is not None
    idle = ScriptedGenerator(tiny_tokenizer, {})
    teacher_rollout(config, generator=idle, tokenizer=tiny_tokenizer)  # the same work: nothing to do
    assert idle.calls == []

    (model / "config.json").write_text('{"weights": 2}')
    with pytest.raises(ValueError, match="holds a rollout made with another model_files: '"):
        teacher_rollout(config, generator=idle, tokenizer=tiny_tokenizer)
    (model / "config.json").write_text('{"weights": 1}')
    prompts.write_text(prompts.read_text().replace('"ground_truth": "4"', '"ground_truth": "5"', 1))
    with pytest.raises(ValueError, match="holds a rollout made with another prompts_sha256: '"):
        teacher_rollout(config, generator=idle, tokenizer=tiny_tokenizer)
    (out / "identity.json").unlink()
    with pytest.raises(
        ValueError, match="holds a rollout but no identity.json .an older opd wrote it.: whether the model"
    ):
        teacher_rollout(config, generator=idle, tokenizer=tiny_tokenizer)
    assert idle.calls == []


# ------------------------------------------------------------------------------------------------ LlamaFactory


def test_llamafactory_layout(tiny_tokenizer, tmp_path):
    prompts = write_prompts(tmp_path / "prompts.jsonl", 2, system="You are a careful mathematician.")
    config = make_config(tmp_path, prompts, llamafactory=True, dataset_name="teacher_sft")
    script = {"<q0>": [(GOOD, "stop")], "<q1>": [(GOOD, "stop")]}
    out = teacher_rollout(config, generator=ScriptedGenerator(tiny_tokenizer, script), tokenizer=tiny_tokenizer)
    info = json.loads((out / "llamafactory" / "dataset_info.json").read_text())
    assert info == {
        "teacher_sft": {
            "file_name": "teacher_sft.json",
            "formatting": "sharegpt",
            "columns": {"messages": "conversations", "system": "system"},
            "tags": {"role_tag": "from", "content_tag": "value", "user_tag": "human", "assistant_tag": "gpt"},
        }
    }
    rows = json.loads((out / "llamafactory" / "teacher_sft.json").read_text())
    assert len(rows) == 2
    assert rows[0]["system"] == "You are a careful mathematician." and rows[1]["system"] == ""
    assert [turn["from"] for turn in rows[0]["conversations"]] == ["human", "gpt"]
    assert rows[0]["conversations"][0]["value"] == "<q0> What is 2+2?"
    assert rows[0]["conversations"][1]["value"] == GOOD
    sft = read_jsonl(out / "rollouts.jsonl")
    assert [m["role"] for m in sft[0]["messages"]] == ["system", "user", "assistant"]


# ------------------------------------------------------------------------------------------------ real model


def test_tiny_model_end_to_end(tmp_path, tiny_model_dir):
    """A random tiny Llama never writes an answer in 6 tokens: every sample is exhausted, with its reasons."""
    out = teacher_rollout(tiny_rollout_config(tmp_path, tiny_model_dir, "single"))
    rejected = read_jsonl(out / "rejected.jsonl")
    assert read_jsonl(out / "rollouts.jsonl") == []
    assert [(r["prompt_id"], r["sample"]) for r in rejected] == [(f"p{i}", s) for i in range(5) for s in range(2)]
    assert all(len(r["rejections"]) == 2 and all("no_answer" in a for a in r["rejections"]) for r in rejected)
    assert rejected[0]["prompt"][-1]["content"] == "<q0> What is 2+2?"
    stats = json.loads((out / "stats.json").read_text())
    assert stats["attempts"] == 20 and stats["accepted"] == 0 and stats["rejections"]["no_answer"] == 20
    assert stats["rejections"]["truncated"] == sum(a.count("truncated") for r in rejected for a in r["rejections"])
    assert stats["rejections"]["truncated"] > 0


@pytest.mark.slow
def test_two_workers_match_one(tmp_path, tiny_model_dir):
    """Two spawned CPU workers over disjoint batches produce exactly the single-process result, in prompt order."""
    single = teacher_rollout(tiny_rollout_config(tmp_path, tiny_model_dir, "single"))
    sharded = teacher_rollout(tiny_rollout_config(tmp_path, tiny_model_dir, "sharded", num_workers=2))
    assert sorted(p.name for p in (sharded / "shards").iterdir()) == ["rank_0.jsonl", "rank_1.jsonl"]
    by_rank = [{r["prompt_id"] for r in read_jsonl(sharded / "shards" / f"rank_{k}.jsonl")} for k in range(2)]
    assert by_rank == [{"p0", "p2", "p4"}, {"p1", "p3"}]  # batches of one prompt (batch_size 2 // n 2), round robin
    assert read_jsonl(sharded / "rejected.jsonl") == read_jsonl(single / "rejected.jsonl")
    assert json.loads((sharded / "stats.json").read_text())["attempts"] == 20
