"""`opd distill` with `rollout.tools`: every rollout is an episode with an environment (opd.train.episodes).

- the environment's tokens are out of the loss: the step's loss equals a hand computation over the student's tokens
  only (plain forwards of the student and teacher over the whole episode), and so does the response length;
- GRPO grades the final turn; sampled-token and top-k objectives run on episodes;
- a malformed tool call is an error observation the student reads, and the step completes;
- `opd distill rollout.tools=calculator` runs from the command line and writes the episode metrics; a run of 2 steps
  equals a run of 1 step resumed to 2, bit for bit (a tiny student trained to call the calculator, so its episodes
  have several turns);
- a kill -9 while a step's episodes are in flight (a tool call unanswered), then `--resume`, equals a run never
  killed: the weights bit for bit, every metric but the wall-clock ones, the episodes themselves;
- `opd check`'s forecast samples the student's episodes with the run's environment and reports their turns,
  tool calls and errors;
- bad settings are refused in one line before any model loads (the python tool where the sandbox does not hold too).

The scripted student (`helpers_tools.ScriptedModel`) stands in for the student's sampling only: the step under test
scores, grades and trains on what it wrote with the real tiny student and teacher.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rich.console import Console
from transformers import AutoModelForCausalLM

from helpers import assert_same_weights, cli, dump, kill9, make_tiny_model, one_line, start, wait_for, without_timing
from helpers_tools import (
    ScriptedModel,
    calculator_then_answer,
    make_tool_tokenizer,
    python_then_answer,
    save_tool_model,
    write_tool_questions,
)
from opd.config import DistillConfig, build_config
from opd.io import LOCK_FILE, read_jsonl
from opd.recipes.distill import distill, setup
from opd.tools.environments import load_environment
from opd.tools.sandbox import ProbeResult, probe
from opd.train.checkpoint import latest_checkpoint
from opd.train.step import sample_rollouts, score_rollouts, step_metrics, step_targets, update_student


@pytest.fixture(scope="module")
def tool_world(tmp_path_factory, tool_user_dir):
    """A random tiny student and teacher, a student trained to call the calculator (`helpers_tools.train_tool_user`,
    shared by the session), and questions with answers, all with Qwen2.5's tool chat template."""
    root = tmp_path_factory.mktemp("tool_world")
    save_tool_model(make_tiny_model("qwen3", seed=0), root / "student")
    save_tool_model(make_tiny_model("qwen3", seed=1), root / "teacher")
    (root / "tool_user").symlink_to(tool_user_dir())
    write_tool_questions(root / "prompts.jsonl")
    return root


def _config(
    world: Path, tmp_path: Path, *overrides: str, student: str = "student", steps: int = 2, teacher: bool = True
) -> DistillConfig:
    options = {
        "student.path": str(world / student),
        "teacher.path": str(world / "teacher") if teacher else None,
        "data.path": str(world / "prompts.jsonl"),
        "data.answer_key": "answer",
        "data.max_prompt_length": 1024,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 256,
        "rollout.tools": "calculator",
        "micro_batch_tokens": 4096,
        "run.out_dir": str(tmp_path),
        "run.name": "run",
        "run.steps": steps,
        "run.report": False,
        "optim.lr": 1e-3,
    }
    return build_config(DistillConfig, options=options, overrides=list(overrides))


def _scripted_step(config: DistillConfig, policy):
    """One step of `config` whose student writes what `policy` says: (batch, metrics)."""
    _, batch, _, metrics = _scripted(config, policy)
    return batch, metrics


def _scripted(config: DistillConfig, policy):
    """`_scripted_step`, also giving the trainer and the step's scores: (trainer, batch, scores, metrics)."""
    tr = setup(config, Path(config.run.out_dir) / config.run.name)
    tr.engines.generator = ScriptedModel(tr.models.tokenizer, policy)
    device = torch.device("cpu")
    timings: dict = {}
    batch = sample_rollouts(tr, timings, device)
    scores = score_rollouts(tr, batch, timings, device)
    targets = step_targets(tr, batch, scores, device)
    result = update_student(tr, batch.rollouts, targets, timings, device)
    return tr, batch, scores, step_metrics(tr, batch, scores, targets, result, timings)


def _logprobs(model, input_ids: torch.Tensor) -> torch.Tensor:
    """[L-1] log-prob of each next token of one row under a plain forward of the model."""
    with torch.no_grad():
        logits = model(input_ids[None]).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, input_ids[1:, None])[:, 0]


def _same(metrics: dict, drop: str | None = None) -> dict:
    """A step's metrics but the wall-clock ones (and those whose name starts with `drop`): what equal runs share."""
    timing = ("episode/tool_seconds", "episode/tool_wall_seconds")
    return {k: v for k, v in without_timing(metrics).items() if k not in timing and not (drop and k.startswith(drop))}


# ------------------------------------------------------------------------------------------- the step's episodes


def test_the_loss_leaves_the_environments_tokens_out(tool_world, tmp_path):
    config = _config(tool_world, tmp_path, "objective.top_k=0")
    batch, metrics = _scripted_step(config, calculator_then_answer)
    episodes, rollouts = batch.episodes, batch.rollouts
    assert episodes is not None and episodes.turns == [2, 2, 2, 2] and metrics["episode/turns_mean"] == 2
    env_tokens = sum(m.count(True) for m in episodes.env_masks)
    assert env_tokens > 0 and metrics["episode/tool_calls_mean"] == 1 and metrics["episode/tool_errors"] == 0

    # by hand: token reward t − s at the student's tokens, read in the whole episode; loss = −mean over them
    rewards, everywhere = [], []
    teacher, student = (AutoModelForCausalLM.from_pretrained(tool_world / n).eval() for n in ("teacher", "student"))
    for b in range(rollouts.batch_size):
        p, mask = int(rollouts.prompt_lengths[b]), episodes.env_masks[b]
        ids = rollouts.input_ids[b, : p + len(mask)]
        gap = _logprobs(teacher, ids)[p - 1 :] - _logprobs(student, ids)[p - 1 :]
        rewards += [g for g, is_env in zip(gap.tolist(), mask) if not is_env]
        everywhere += gap.tolist()
    assert metrics["pg_loss"] == pytest.approx(-sum(rewards) / len(rewards), rel=1e-4, abs=1e-5)
    assert abs(-sum(everywhere) / len(everywhere) - metrics["pg_loss"]) > 1e-3  # with the env's tokens: another loss
    student_tokens = [m.count(False) for m in episodes.env_masks]
    assert metrics["response_length"] == pytest.approx(sum(student_tokens) / len(student_tokens))
    assert metrics["episode/student_tokens_mean"] == pytest.approx(metrics["response_length"])

    sample = read_jsonl(Path(config.run.out_dir) / "run" / "samples" / "step_1.jsonl")[0]
    assert sample["response"].startswith("So the answer") and "<tool_response>" in sample["episode"]
    assert sample["turns"] == 2 and sum(sample["env_mask"]) == episodes.env_masks[0].count(True)
    assert all(r == 0 for r, m in zip(sample["token_rewards"], sample["env_mask"]) if m)


def test_grpo_grades_the_final_turn(tool_world, tmp_path):
    def half_right(context: str) -> str:  # the first question's episodes answer wrong
        answer = calculator_then_answer(context)
        return answer.replace("{21}", "{20}") if "What is 3 * 7?" in context else answer

    config = _config(tool_world, tmp_path, "objective.advantage=grpo", teacher=False)
    batch, metrics = _scripted_step(config, half_right)
    assert metrics["rollout_accuracy"] == 0.5 and batch.episodes is not None
    assert metrics["episode/turns_mean"] == 2


@pytest.mark.parametrize(
    "objective", [["objective.top_k=4"], ["objective.loss=topk_kl", "objective.top_k=4"]], ids=["topk_pg", "topk_kl"]
)
def test_top_k_objectives_train_on_episodes(tool_world, tmp_path, objective):
    _, metrics = _scripted_step(_config(tool_world, tmp_path, *objective), calculator_then_answer)
    losses = [v for k, v in metrics.items() if k.endswith("_loss")]
    assert metrics["episode/turns_mean"] == 2 and losses and all(torch.isfinite(torch.tensor(losses)))
    assert metrics["grad_norm"] > 0 and metrics["overlap_ratio"] >= 0


def test_a_malformed_call_is_an_error_observation_and_the_step_completes(tool_world, tmp_path):
    def malformed_then_answers(context: str) -> str:
        if "<tool_response>" in context:
            assert "error" in context  # the student reads why its call failed
            return "\\boxed{0}"
        return "<tool_call>\n{not json\n</tool_call>"

    batch, metrics = _scripted_step(_config(tool_world, tmp_path), malformed_then_answers)
    assert metrics["episode/tool_errors"] == 4 and metrics["episode/turns_mean"] == 2
    assert batch.episodes is not None and all(m.count(True) for m in batch.episodes.env_masks)


def test_the_python_tool_runs_the_students_code_in_the_sandbox(tool_world, tmp_path, capsys):
    if not probe("namespaces").ok:
        pytest.skip(f"no namespaces sandbox here: {probe('namespaces').reason}")

    config = _config(tool_world, tmp_path, "rollout.tools=python", "objective.advantage=grpo", teacher=False)
    batch, metrics = _scripted_step(config, python_then_answer)
    assert metrics["rollout_accuracy"] == 1.0 and metrics["episode/tool_errors"] == 0
    assert metrics["episode/sandbox_refusals"] == 0 and metrics["episode/tool_seconds"] > 0
    assert batch.episodes is not None and batch.episodes.describe["sandbox"] == "namespaces"


def test_the_weak_sandbox_runs_only_when_named_and_is_said_and_recorded(tool_world, tmp_path):
    if not probe("rlimits-only").ok:
        pytest.skip(f"the python tool cannot run here: {probe('rlimits-only').reason}")
    config = _config(tool_world, tmp_path, "rollout.tools=python", "rollout.sandbox=rlimits-only")
    console = Console(record=True, width=200)
    setup(config, tmp_path / "run", console=console)
    assert "rollout.sandbox=rlimits-only: the model's code runs with resource limits only" in console.export_text()
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["rollout"]
    assert saved["tools"] == "python" and saved["sandbox"] == "rlimits-only"


def test_two_teachers_score_their_prompts_episodes(tool_world, tmp_path):
    config = _config(tool_world, tmp_path, "rollout.tools=null").model_dump(mode="json")
    config["teacher"], config["rollout"]["tools"] = None, "calculator"
    config["teachers"] = [
        {"name": "odd", "path": str(tool_world / "teacher"), "route": {"route_key": "kind", "values": ["b"]}},
        {"name": "even", "path": str(tool_world / "student"), "route": {"default": True}},
    ]
    config["objective"]["top_k"] = 0
    batch, metrics = _scripted_step(DistillConfig.model_validate(config), calculator_then_answer)
    assert metrics["episode/turns_mean"] == 2 and batch.episodes is not None
    for name in ("odd", "even"):  # each teacher's rows: its own metrics
        assert any(key.startswith(f"teacher/{name}/") for key in metrics), sorted(metrics)


def test_the_in_training_eval_runs_with_the_tools(tool_world, tmp_path):
    config = _config(
        tool_world,
        tmp_path,
        f"eval.benchmarks={tool_world / 'prompts.jsonl'}",
        "eval.prompt_key=prompt",
        "eval.answer_key=answer",
        "eval.n=1",
        "eval.limit=2",
        "eval.max_new_tokens=200",
        "run.eval_at_start=false",
        student="tool_user",
        steps=1,
    )
    run_dir = distill(config)
    results = json.loads((run_dir / "eval" / "step_1" / "results.json").read_text())
    assert results["tools"] == {"name": "calculator"}
    assert results["benchmarks"]["prompts"]["tools"]["tool_calls_mean"] > 0


# ------------------------------------------------------------------------------------- teachers with a view
ANSWER_VIEW = {"context_key": "answer"}  # "\n\n{answer}" appended to the teacher's user turn


def _view_config(world: Path, tmp_path: Path, teachers: list, *overrides: str, data: Path | None = None, **kw):
    """`_config` with `teachers` instead of its teacher (and `data` instead of the world's prompts)."""
    config = _config(world, tmp_path, "rollout.tools=null", *overrides, **kw).model_dump(mode="json")
    config["teacher"], config["rollout"]["tools"], config["teachers"] = None, "calculator", teachers
    if data is not None:
        config["data"]["path"] = str(data)
    return DistillConfig.model_validate(config)


def _forward64(model, ids: list[int], start: int) -> torch.Tensor:
    """float64 log-probs of ids[start:] under a plain forward of `model` (a float64 copy) over all of `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor(ids)[None]).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0][start - 1 :]


def _models64(world: Path, *names: str) -> dict:
    return {n: AutoModelForCausalLM.from_pretrained(world / n, torch_dtype=torch.float64).eval() for n in names}


def _episode(batch, b: int) -> tuple[list[int], torch.Tensor]:
    """Row b's episode (every token after the prompt, the environment's included) and its student-token mask."""
    assert batch.episodes is not None
    env = torch.tensor(batch.episodes.env_masks[b])
    return batch.rollouts.response_ids[b, : len(env)].tolist(), ~env


def test_a_view_that_renders_what_a_plain_teacher_reads_scores_bit_for_bit_as_it(tool_world, tmp_path):
    """A teacher whose view appends each prompt's answer reads, on the same episodes, exactly what a teacher without
    a view reads when the student's prompts already end with the answer: the same prompt ids (both rendered with the
    calculator offered), then the same episode tokens, in tensors of the same shape. It is the same forward on the
    same inputs, so its scores are equal bit for bit. (The token rewards differ by the student's term only: the
    student reads its own prompt, with or without the answer.)"""
    holding = tmp_path / "holding.jsonl"
    rows = read_jsonl(tool_world / "prompts.jsonl")
    holding.write_text("".join(json.dumps({**r, "prompt": f"{r['prompt']}\n\n{r['answer']}"}) + "\n" for r in rows))
    teacher = str(tool_world / "teacher")
    plain = _view_config(
        tool_world, tmp_path / "a", [{"name": "t", "path": teacher}], "objective.top_k=4", data=holding
    )
    viewed = _view_config(
        tool_world, tmp_path / "b", [{"name": "t", "path": teacher, "view": ANSWER_VIEW}], "objective.top_k=4"
    )
    tr_a, batch_a, scores_a, _ = _scripted(plain, calculator_then_answer)
    tr_b, batch_b, scores_b, _ = _scripted(viewed, calculator_then_answer)
    assert batch_a.indices == batch_b.indices and batch_b.episodes is not None
    assert all(m.count(True) for m in batch_b.episodes.env_masks)  # every episode holds the calculator's answer
    ra, rb = batch_a.rollouts, batch_b.rollouts
    assert torch.equal(ra.response_ids, rb.response_ids) and torch.equal(ra.response_mask, rb.response_mask)
    views = tr_b.models.teachers[0].prompt_ids
    assert views is not None
    for i in batch_b.indices:
        assert views[i] == tr_a.data.prompt_ids[i] != tr_b.data.prompt_ids[i]
    ta, tb = scores_a.teacher, scores_b.teacher
    assert ta is not None and tb is not None
    assert torch.equal(ta.sampled_logprobs, tb.sampled_logprobs)
    assert torch.equal(ta.topk_ids, tb.topk_ids) and torch.equal(ta.topk_logprobs, tb.topk_logprobs)


def test_a_views_context_changes_only_the_teachers_prompt_and_it_scores_the_episode_after_it(tool_world, tmp_path):
    """The teacher reads its view of the prompt (the answer appended to the user turn, rendered with the calculator
    offered as the student's prompt is), then the episode's tokens unchanged; its scores at the student's tokens are
    those of a plain float64 forward over that concatenation (float32 against float64 on a tiny model: 1e-5), and the
    loss is −mean(teacher − student) over the student's tokens."""
    teachers = [{"name": "t", "path": str(tool_world / "teacher"), "view": ANSWER_VIEW}]
    config = _view_config(tool_world, tmp_path, teachers, "objective.top_k=0")
    tr, batch, scores, metrics = _scripted(config, calculator_then_answer)
    models = _models64(tool_world, "teacher", "student")
    tokenizer, tools = make_tool_tokenizer(), load_environment("calculator").start({}).tools
    views, rewards, blind = tr.models.teachers[0].prompt_ids, [], []
    assert views is not None and scores.teacher is not None
    for b in range(batch.rollouts.batch_size):
        index = batch.indices[int(batch.rollouts.group_ids[b])]
        prompt, own = tr.data.prompts[index], tr.data.prompt_ids[index]
        messages = [dict(m) for m in prompt.messages]
        messages[-1]["content"] += f"\n\n{prompt.answer}"
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        view = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert views[index] == view
        # only the prompt differs: the student's ids with the context's inserted inside the user turn
        k = next(i for i, (x, y) in enumerate(zip(own, view)) if x != y)
        tail = len(own) - k
        assert view[-tail:] == own[k:] and tokenizer.decode(view[k:-tail]) == f"\n\n{prompt.answer}"
        episode, student_BT = _episode(batch, b)
        assert batch.rollouts.input_ids[b, : len(own) + len(episode)].tolist() == own + episode
        t = _forward64(models["teacher"], view + episode, len(view))
        got = scores.teacher.sampled_logprobs[b, : len(episode)].double()
        assert torch.allclose(got[student_BT], t[student_BT], rtol=0, atol=1e-5)
        s = _forward64(models["student"], own + episode, len(own))
        rewards += (t - s)[student_BT].tolist()
        blind += (_forward64(models["teacher"], own + episode, len(own)) - s)[student_BT].tolist()
    assert metrics["pg_loss"] == pytest.approx(-sum(rewards) / len(rewards), rel=1e-4, abs=1e-5)
    assert abs(sum(blind) / len(blind) - sum(rewards) / len(rewards)) > 1e-3  # the context moved the rewards


def _assert_scored_under_views(tr, batch, scores, models: list, contexts: list[str]) -> set[int]:
    """Every row's teacher scores at the student's tokens are those of a float64 forward of its teacher's model
    (`models[owner]`) over that teacher's view (the student's prompt with `contexts[owner]` and the prompt's answer
    inside the user turn) then the episode (float32 against float64 on a tiny model: 1e-5). → the owners seen."""
    tokenizer, owners = make_tool_tokenizer(), set()
    assert scores.teacher is not None
    for b in range(batch.rollouts.batch_size):
        index = batch.indices[int(batch.rollouts.group_ids[b])]
        owner, prompt = tr.data.prompt_teacher[index], tr.data.prompts[index]
        routed = tr.models.teachers[owner]
        assert routed.prompt_ids is not None
        view, own = routed.prompt_ids[index], tr.data.prompt_ids[index]
        context = contexts[owner].format(context=prompt.answer)
        assert tokenizer.decode(view) == tokenizer.decode(own).replace("?<|im_end|>", f"?{context}<|im_end|>")
        episode, student_BT = _episode(batch, b)
        t = _forward64(models[owner], view + episode, len(view))
        got = scores.teacher.sampled_logprobs[b, : len(episode)].double()
        assert torch.allclose(got[student_BT], t[student_BT], rtol=0, atol=1e-5), routed.name
        owners.add(owner)
    return owners


def test_routed_teachers_and_the_live_student_score_episodes_under_their_own_views(tool_world, tmp_path):
    """Two routed teachers with views, one of them the live student (OPSD: `path: student` with a view): each row
    is scored by its prompt's teacher over that teacher's view, with the tools, then the episode."""
    teachers = [
        {"name": "odd", "path": str(tool_world / "teacher"), "route": {"route_key": "kind", "values": ["b"]}},
        {"name": "self", "path": "student", "route": {"default": True}},
    ]
    contexts = ["\n\n{context}", " (the answer is {context})"]
    for entry, template in zip(teachers, contexts):
        entry["view"] = {"context_key": "answer", "context_template": template}
    config = _view_config(tool_world, tmp_path, teachers, "objective.top_k=0", "prompts_per_step=4")
    tr, batch, scores, metrics = _scripted(config, calculator_then_answer)
    models = _models64(tool_world, "teacher", "student")  # the live student scores before its update
    owners = _assert_scored_under_views(tr, batch, scores, [models["teacher"], models["student"]], contexts)
    assert owners == {0, 1} and metrics["episode/turns_mean"] == 2
    for name in ("odd", "self"):
        assert any(key.startswith(f"teacher/{name}/") for key in metrics), sorted(metrics)


def test_a_full_vocabulary_teacher_reads_its_view_of_the_episode(tool_world, tmp_path):
    """objective.loss=full_reverse_kl: the teacher answers with hidden states (`score_full_teacher`), taken over its
    view then the episode as any teacher's scores are."""
    teachers = [{"name": "t", "path": str(tool_world / "teacher"), "view": ANSWER_VIEW}]
    config = _view_config(tool_world, tmp_path, teachers, "objective.loss=full_reverse_kl", "objective.top_k=0")
    tr, batch, scores, metrics = _scripted(config, calculator_then_answer)
    assert scores.teacher_hidden_BTE is not None and torch.isfinite(torch.tensor(metrics["full_reverse_kl_loss"]))
    models = _models64(tool_world, "teacher")
    assert _assert_scored_under_views(tr, batch, scores, [models["teacher"]], ["\n\n{context}"]) == {0}


# ----------------------------------------------------------------------------------------- the command line


def test_distill_with_the_calculator_writes_episode_metrics_and_resumes_exactly(capsys, tool_world, tmp_path):
    one = dump(_config(tool_world, tmp_path / "a", student="tool_user", steps=1), tmp_path / "one.yaml")
    code, out, err = cli(capsys, "distill", "--config", one)
    assert code == 0, err
    assert "rollout.tools: episodes of up to 4 turns" in out
    code, out, err = cli(capsys, "distill", "--config", one, "--resume", "run.steps=2")
    assert code == 0 and "resumed from" in out, err
    straight = distill(_config(tool_world, tmp_path / "b", student="tool_user", steps=2))
    resumed = tmp_path / "a" / "run"
    assert_same_weights(straight / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2] and [_same(m) for m in ma] == [_same(m) for m in mb]
    assert all(m["episode/tool_calls_mean"] > 0 and m["episode/turns_mean"] > 1 for m in mb), mb
    assert all(m["episode/env_tokens_mean"] > 0 for m in mb)
    assert yaml.safe_load((resumed / "config.yaml").read_text())["rollout"]["tools"] == "calculator"


def test_distill_with_a_teacher_view_and_the_calculator_resumes_exactly(capsys, tool_world, tmp_path):
    """`opd distill` with rollout.tools=calculator and a teacher with a view, from the command line: 2 steps as 1
    step resumed to 2, bit for bit as a straight run of 2; the view's context moves the step's rewards."""
    teachers = [{"name": "t", "path": str(tool_world / "teacher"), "view": ANSWER_VIEW}]
    one = dump(_view_config(tool_world, tmp_path / "a", teachers, student="tool_user", steps=1), tmp_path / "one.yaml")
    code, out, err = cli(capsys, "distill", "--config", one)
    assert code == 0, err
    assert "rollout.tools: episodes of up to 4 turns" in out
    code, out, err = cli(capsys, "distill", "--config", one, "--resume", "run.steps=2")
    assert code == 0 and "resumed from" in out, err
    straight = distill(_view_config(tool_world, tmp_path / "b", teachers, student="tool_user", steps=2))
    resumed = tmp_path / "a" / "run"
    assert_same_weights(straight / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2] and [_same(m) for m in ma] == [_same(m) for m in mb]
    assert all(m["episode/tool_calls_mean"] > 0 and m["episode/env_tokens_mean"] > 0 for m in mb), mb
    blind = distill(
        _view_config(tool_world, tmp_path / "c", [{**teachers[0], "view": None}], student="tool_user", steps=1)
    )
    first = read_jsonl(blind / "metrics.jsonl")[0]
    assert first["episode/student_tokens_mean"] == mb[0]["episode/student_tokens_mean"]  # the same episodes
    assert first["reward_mean"] != mb[0]["reward_mean"]  # scored under another prompt


# ---------------------------------------------------------------------------- kill -9 with episodes in flight
HOLD_ENVIRONMENT = """
import os
import time
from pathlib import Path

from opd.tools.environments import Calculator


class HoldEpisode:
    def __init__(self, episode):
        self.episode, self.tools = episode, episode.tools

    def answer(self, call):
        hold = os.environ.get("OPD_TEST_HOLD")
        if hold and (Path(hold) / "checkpoints" / "step_1").is_dir():
            (Path(hold) / "episodes_in_flight").write_text(call.name)
            while True:  # until kill -9
                time.sleep(60)
        return self.episode.answer(call)

    @property
    def done(self):
        return self.episode.done

    def close(self):
        self.episode.close()


class HoldCalculator:
    def start(self, row):
        return HoldEpisode(Calculator().start(row))

    def describe(self):
        return {"name": "calculator"}
"""


HOLD = "rollout.tools=opd_hold_env:HoldCalculator"


def _killed_in_a_tool_call(monkeypatch, tool_world: Path, tmp_path: Path, overrides: tuple, waiting_for: str):
    """`opd distill` of the tool user (`overrides`, 500 steps, into tmp_path/a) started in a subprocess whose
    HoldCalculator holds the first tool call after step 1's checkpoint, killed -9 there: (process, its config's
    path, its run directory). The test's environment stays importable for this process's later runs."""
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "opd_hold_env.py").write_text(HOLD_ENVIRONMENT)
    monkeypatch.syspath_prepend(str(modules))  # this process's runs (the resume, the straight run)
    monkeypatch.setenv("PYTHONPATH", f"{modules}:{os.environ.get('PYTHONPATH', '')}")
    config = _config(tool_world, tmp_path / "a", *overrides, student="tool_user", steps=500)
    yaml_path, run_dir, log = dump(config, tmp_path / "a.yaml"), tmp_path / "a" / "run", tmp_path / "a.log"
    monkeypatch.setenv("OPD_TEST_HOLD", str(run_dir))
    process = start(log, "distill", "--config", yaml_path)
    monkeypatch.delenv("OPD_TEST_HOLD")
    wait_for(process, (run_dir / "episodes_in_flight").is_file, log, waiting_for)
    kill9(process)
    return process, yaml_path, run_dir


def test_kill9_with_episodes_in_flight_resumes_exactly(capsys, monkeypatch, tool_world, tmp_path):
    common = (HOLD, "run.save_every=1", "run.keep_last=null")
    process, yaml_path, run_dir = _killed_in_a_tool_call(
        monkeypatch, tool_world, tmp_path, common, "a tool call of step 2's episodes"
    )
    assert latest_checkpoint(run_dir).name == "step_1" and [
        m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")
    ] == [1]

    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "run.steps=3")
    assert code == 0 and "resumed from" in out and f"lock left by pid {process.pid}" in out, err
    straight = distill(_config(tool_world, tmp_path / "b", *common, student="tool_user", steps=3))
    assert_same_weights(straight / "checkpoints" / "step_3", run_dir / "checkpoints" / "step_3")
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2, 3] and [_same(m) for m in ma] == [_same(m) for m in mb]
    assert all(m["episode/tool_calls_mean"] > 0 and m["episode/turns_mean"] > 1 for m in mb), mb
    samples = [read_jsonl(d / "samples" / "step_2.jsonl") for d in (straight, run_dir)]
    assert [s["episode"] for s in samples[0]] == [s["episode"] for s in samples[1]]
    assert not (run_dir / LOCK_FILE).exists() and not list((run_dir / "checkpoints").glob(".*"))
    assert "opd_hold_env" in sys.modules  # the runs of this process used the test's environment


# ------------------------------------------------------------------------------------ partial rollouts (episodes)


def test_partial_episodes_at_no_staleness_are_the_synchronous_step(tool_world, tmp_path):
    """rollout.partial with max_staleness=0 continues each episode one turn a call within its step: the same engine
    calls, seeds and cuts as a step without rollout.partial, so the same episodes, metrics and weights, bit for bit."""
    plain = distill(_config(tool_world, tmp_path / "plain", student="tool_user"))
    partial = distill(
        _config(
            tool_world, tmp_path / "partial", "rollout.partial=true", "rollout.max_staleness=0", student="tool_user"
        )
    )
    assert_same_weights(plain / "checkpoints" / "step_2", partial / "checkpoints" / "step_2")
    # the engine's own work differs by design: the plain step continues each episode's cache (a session), the
    # partial stream prefills a carried episode again at each call; what it counts is not part of the step's math
    engine_work = ("episode/repeated_prefill_tokens", "episode/wasted_prefill_tokens")

    def same(m: dict) -> dict:
        return {k: v for k, v in _same(m, "partial/").items() if k not in engine_work}

    ma, mb = read_jsonl(plain / "metrics.jsonl"), read_jsonl(partial / "metrics.jsonl")
    assert [same(m) for m in ma] == [same(m) for m in mb]
    assert all("partial/calls" in m for m in mb)
    assert all(m["episode/repeated_prefill_tokens"] == 0 for m in ma)  # the session kept every cache
    assert all(m["episode/repeated_prefill_tokens"] > 0 for m in mb)
    assert all(m["episode/tool_calls_mean"] > 0 and m["episode/turns_mean"] > 1 for m in mb), mb


PARTIAL = ("rollout.partial=true", "rollout.max_staleness=1", "rollout.partial_segment=40", "objective.tis_cap=2")


def test_kill9_with_partial_episodes_in_flight_resumes_exactly(capsys, monkeypatch, tool_world, tmp_path):
    """rollout.partial: episodes outlive their step. A kill -9 during a later step's tool call, then `--resume`,
    equals a run never killed; and so does a run stopped at step 1, whose checkpoint carries an episode with the
    environment's answer in it and its next turn begun, resumed: the carried episodes come back from the checkpoint
    (tokens, answers, log-probs, versions, counts), their environments restarted and replayed."""
    common = (HOLD, "run.save_every=1", "run.keep_last=null", *PARTIAL)
    process, yaml_path, run_dir = _killed_in_a_tool_call(
        monkeypatch, tool_world, tmp_path, common, "a tool call after step 1's checkpoint"
    )
    killed_at = latest_checkpoint(run_dir)
    assert killed_at is not None and killed_at.name != "step_4"
    in_flight = torch.load(killed_at / "trainer_state.pt", weights_only=False)["partial_stream"]["samples"]
    assert any(s["finish"] is None and s["tokens"] for s in in_flight)  # episodes in flight, mid-turn

    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "run.steps=4")
    assert code == 0 and "resumed from" in out, err
    straight = distill(_config(tool_world, tmp_path / "b", *common, student="tool_user", steps=4))
    stopped = dump(_config(tool_world, tmp_path / "c", *common, student="tool_user", steps=1), tmp_path / "c.yaml")
    assert cli(capsys, "distill", "--config", stopped)[0] == 0
    carried = torch.load(tmp_path / "c" / "run" / "checkpoints" / "step_1" / "trainer_state.pt", weights_only=False)
    assert any(
        s["finish"] is None and any(s["episode"]["env_mask"]) and s["episode"]["history"]
        for s in carried["partial_stream"]["samples"]
    )  # an episode carried with the environment's answer in it
    assert cli(capsys, "distill", "--config", stopped, "--resume", "run.steps=2")[0] == 0
    ma = read_jsonl(straight / "metrics.jsonl")
    for resumed, steps in ((run_dir, 4), (tmp_path / "c" / "run", 2)):
        assert_same_weights(straight / "checkpoints" / f"step_{steps}", resumed / "checkpoints" / f"step_{steps}")
        mb = read_jsonl(resumed / "metrics.jsonl")
        assert [m["step"] for m in mb] == list(range(1, steps + 1)) and [_same(m) for m in ma[:steps]] == [
            _same(m) for m in mb
        ]
        for step in range(1, steps + 1):
            samples = [read_jsonl(d / "samples" / f"step_{step}.jsonl") for d in (straight, resumed)]
            assert [s["episode"] for s in samples[0]] == [s["episode"] for s in samples[1]]
    assert any(m["partial/mean_lag"] > 0 for m in ma)  # episodes trained after the step that started them
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("partial", [(), PARTIAL[:3]], ids=["overlap", "overlap+partial"])
def test_overlapped_episodes_resume_exactly(capsys, tool_world, tmp_path, partial):
    """rollout.overlap: the next step's episodes (their tool calls too) are generated during this step, from the
    weights before its update, and trained a step later; the checkpoint holds them, so a run stopped at step 1 and
    resumed equals a run never stopped (with rollout.partial too: the stream's batch built ahead)."""
    common = ("rollout.overlap=true", "objective.tis_cap=2", "run.save_every=1", *partial)
    straight = distill(_config(tool_world, tmp_path / "b", *common, student="tool_user", steps=3))
    stopped = dump(_config(tool_world, tmp_path / "a", *common, student="tool_user", steps=1), tmp_path / "a.yaml")
    assert cli(capsys, "distill", "--config", stopped)[0] == 0
    code, out, err = cli(capsys, "distill", "--config", stopped, "--resume", "run.steps=3")
    assert code == 0 and "resumed from" in out, err
    resumed = tmp_path / "a" / "run"
    assert_same_weights(straight / "checkpoints" / "step_3", resumed / "checkpoints" / "step_3")
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(resumed / "metrics.jsonl")
    assert [m["step"] for m in mb] == [1, 2, 3] and [_same(m) for m in ma] == [_same(m) for m in mb]
    assert all(m["episode/tool_calls_mean"] > 0 and m["episode/env_tokens_mean"] > 0 for m in mb), mb
    assert all(m["policy_lag"] >= 1 for m in mb[1:])  # steps 2 and 3 trained episodes generated a step ahead
    for step in (1, 2, 3):
        samples = [read_jsonl(d / "samples" / f"step_{step}.jsonl") for d in (straight, resumed)]
        assert [s["episode"] for s in samples[0]] == [s["episode"] for s in samples[1]]


# ------------------------------------------------------------------------------------------------ opd check


def test_opd_check_forecasts_from_the_students_episodes(capsys, tool_world, tmp_path):
    config = _config(tool_world, tmp_path, student="tool_user")
    out = tmp_path / "check"
    args = ["--config", dump(config, tmp_path / "c.yaml"), "--out", out, "--n", "2", "--prompts-sample", "4"]
    code, stdout, err = cli(capsys, "check", *args)
    assert code in (0, 3), err
    report = json.loads((out / "check.json").read_text())
    values = report["forecast"]["values"]
    assert values["tools"] == "calculator" and values["rollouts"] == 8
    # the tool user's episodes: its calculator call, the answer, then its own words
    assert values["episode_turns_mean"] > 1 and values["episode_tool_calls_mean"] > 0
    assert values["episode_tool_errors_mean"] >= 0
    row = next(r for r in report["results"] if r["name"] == "forecast")
    assert "from episodes with tools=calculator" in row["detail"] and "tool calls" in row["detail"]


# ------------------------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.tools=shell"], "rollout.tools"),
        (
            [
                "rollout.tools=calculator",
                "rollout.partial=true",
                "rollout.partial_early_stop=true",
                "objective.tis_cap=2",
            ],
            "rollout.partial_early_stop",
        ),
        (["rollout.tools=calculator", "rollout.max_episode_tokens=999"], "rollout.max_episode_tokens=999"),
        (["rollout.tools=calculator", "rollout.max_turn_tokens=300"], "rollout.max_turn_tokens=300"),
        (["rollout.tools=calculator", "rollout.max_turns=0"], "rollout.max_turns"),
        (["rollout.tools=python", "rollout.sandbox=none"], "rollout.sandbox"),
        (["rollout.tools=calculator", "teacher.tokenizer=cross"], "tokenizer=cross"),
    ],
)
def test_bad_tool_settings_are_one_line_errors(capsys, tool_world, tmp_path, overrides, expected):
    config = _config(tool_world, tmp_path, "rollout.tools=null").model_dump(mode="json")
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    line = one_line(*cli(capsys, "distill", "--config", path, *overrides)[::2])
    assert expected in line, line
    assert not (tmp_path / "run").exists()


def test_a_teacher_with_a_view_runs_with_tools_and_a_cross_one_stays_refused(capsys, tool_world, tmp_path):
    config = _config(tool_world, tmp_path, "rollout.tools=null").model_dump(mode="json")
    config["teacher"], config["rollout"]["tools"] = None, "calculator"
    config["teachers"] = [{"name": "t", "path": str(tool_world / "teacher"), "view": {"context_key": "answer"}}]
    assert DistillConfig.model_validate(config).teacher_entries()[0].view is not None
    config["teachers"][0]["tokenizer"] = "cross"  # a cross teacher with a view: its own refusal, unchanged
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    line = one_line(*cli(capsys, "distill", "--config", path)[::2])
    assert "rollout.tools: teacher t has tokenizer=cross; a cross-vocabulary teacher does not score episodes" in line
    assert not (tmp_path / "run").exists()


def test_python_is_refused_before_any_model_loads_where_the_sandbox_does_not_hold(
    capsys, monkeypatch, tool_world, tmp_path
):
    monkeypatch.setattr("opd.eval.tools.probe", lambda mode: ProbeResult(mode, False, "no user namespaces"))
    no_weights = tmp_path / "tokenizer_only"  # a model load would fail here with another message
    make_tool_tokenizer().save_pretrained(no_weights)
    config = _config(tool_world, tmp_path, f"student.path={no_weights}", "rollout.tools=python")
    line = one_line(*cli(capsys, "distill", "--config", dump(config, tmp_path / "c.yaml"))[::2])
    assert line.startswith("error: rollout.tools=python: ") and "no user namespaces" in line
    assert "rollout.sandbox=rlimits-only" in line and "--sandbox" not in line


def test_a_user_environment_that_cannot_import_is_one_line(capsys, tool_world, tmp_path):
    config = _config(tool_world, tmp_path, "rollout.tools=no_such_module_opd:Env")
    line = one_line(*cli(capsys, "distill", "--config", dump(config, tmp_path / "c.yaml"))[::2])
    assert line.startswith("error: rollout.tools") and "no_such_module_opd" in line
