"""The bad-input matrix: every `opd` command, fed what users get wrong, must fail with exit code 2 and exactly one
line on stderr that names the culprit (the file, the config key, the value) — never a traceback, never a silent
success, and (for all but a few cases that need the weights to find the fault) before any model is loaded.

Each case is a command line over a small world of good and broken inputs built once per module (tiny random-weight
models from `conftest`, prompt / SFT / response files, a LoRA checkpoint, run directories). Most cases run in-process
through `opd.cli.main` (cheap: the libraries are imported once), with stdout/stderr captured at the file-descriptor
level so library warnings count as stderr lines too; `test_real_stderr_is_one_line` runs a handful as subprocesses.

Unwritable outputs: tests may run as root, where a read-only directory is still writable, so the portable cases are
a path *under a regular file* (ENOTDIR) and a regular file where a directory is expected (EEXIST); the chmod case
runs only where chmod actually stops writes.

`OPD_MATRIX_TALLY=FILE pytest tests/test_bad_inputs.py` appends one JSON line per case (name, outcome, exit code,
stderr) to FILE: outcomes are clear / traceback / silent (exit 0) / unclear (non-zero, but several lines, the wrong
code or a line that does not name the culprit). That is how the counts in the issue were measured.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import make_tiny_model, make_tiny_tokenizer, run_in_process

SRC = Path(__file__).resolve().parents[2] / "src"


# ------------------------------------------------------------------------------------------------------ the world


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _prompt_rows(answers: list[str] | None = None) -> list[dict]:
    answers = answers if answers is not None else [str(2 + k) for k in range(4)]
    return [
        {
            "prompt": [{"role": "user", "content": f"What is 1 + {1 + k}?"}],
            "data_source": "toy",
            "reward_model": {"ground_truth": a},
            "extra_info": {"index": k},
        }
        for k, a in enumerate(answers)
    ]


def _sft_row(user: str = "What is 1 + 1?", answer: object = "It is \\boxed{2}.", role: str = "assistant") -> dict:
    return {"messages": [{"role": "user", "content": user}, {"role": role, "content": answer}]}


def _mkdir(w: dict, name: str, path: Path) -> Path:
    path.mkdir()
    w[name] = path
    return path


def build_world(root: Path) -> dict[str, str]:
    """Every input the cases use, by name → path (str). Built once per module: ~2 s."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from peft import LoraConfig, get_peft_model

    w: dict[str, Path] = {"root": root, "out": root / "out"}
    tok = make_tiny_tokenizer()
    model = w["model"] = root / "model"
    make_tiny_model("llama").save_pretrained(model)
    tok.save_pretrained(model)
    qwen = w["qwen"] = root / "qwen3-base"
    make_tiny_model("qwen3").save_pretrained(qwen)
    tok.save_pretrained(qwen)
    wide = w["wide"] = root / "wide-llama-base"
    make_tiny_model("llama", hidden_size=48, intermediate_size=96).save_pretrained(wide)
    tok.save_pretrained(wide)

    _mkdir(w, "empty_dir", root / "empty-dir")
    _mkdir(w, "config_only", root / "config-only")
    shutil.copy(model / "config.json", w["config_only"])
    for key, source in (("no_tokenizer", qwen), ("no_tokenizer_llama", model)):  # Qwen's gets a 1-token stub
        _mkdir(w, key, root / key.replace("_", "-"))
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            shutil.copy(source / name, w[key])
    shutil.copytree(model, w.setdefault("corrupt_weights", root / "corrupt-weights"))
    weights = w["corrupt_weights"] / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])  # a truncated download
    shutil.copytree(model, w.setdefault("corrupt_bin", root / "corrupt-bin"))
    (w["corrupt_bin"] / "model.safetensors").unlink()
    (w["corrupt_bin"] / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not really a zip archive" * 20)

    lora = w["lora"] = root / "lora-ckpt"
    lora_config = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")  # as `opd sft` makes
    peft_model = get_peft_model(make_tiny_model("llama"), lora_config)
    peft_model.save_pretrained(lora)
    tok.save_pretrained(lora)
    adapter_config = json.loads((lora / "adapter_config.json").read_text())
    (lora / "adapter_config.json").write_text(json.dumps({**adapter_config, "base_model_name_or_path": str(model)}))
    shutil.copytree(lora, w.setdefault("lora_corrupt", root / "lora-corrupt"))
    adapter = w["lora_corrupt"] / "adapter_model.safetensors"
    adapter.write_bytes(adapter.read_bytes()[:100])

    w["prompts"] = _jsonl(root / "prompts.jsonl", _prompt_rows())
    pq.write_table(pa.Table.from_pylist(_prompt_rows()), w.setdefault("prompts_parquet", root / "prompts.parquet"))
    w["dedup_in"] = _jsonl(root / "dedup-in.jsonl", _prompt_rows())
    w["empty_answers"] = _jsonl(root / "empty-answers.jsonl", _prompt_rows([""] * 4))
    rows = _prompt_rows()
    rows[1]["prompt"][0]["content"] = ""
    w["empty_content"] = _jsonl(root / "empty-content.jsonl", rows)
    w["id_prompts"] = _jsonl(
        root / "id-prompts.jsonl",
        [{"id": f"q-{k}", "question": f"What is {k} + {k}?", "answer": str(2 * k)} for k in range(4)],
    )
    # ground truths and run directories that other parts of issue 12 made errors (safety, evalgrade)
    rows = _prompt_rows()
    rows[2]["reward_model"]["ground_truth"] = None
    w["null_answers"] = _jsonl(root / "null-answers.jsonl", rows)
    rows = _prompt_rows()
    rows[1]["reward_model"]["ground_truth"] = True
    w["bool_answers"] = _jsonl(root / "bool-answers.jsonl", rows)
    rows = _prompt_rows()
    rows[3]["extra_info"]["index"] = 0  # the id of row 0, with another answer
    w["dup_ids"] = _jsonl(root / "dup-ids.jsonl", rows)
    w["bench_null"] = _jsonl(
        root / "bench-null.jsonl", [{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": None}}]
    )
    busy = w["busy"] = root / "busy-runs"
    for name in ("d", "s"):
        (busy / name).mkdir(parents=True)
        (busy / name / "notes.txt").write_text("an earlier run's file\n")
    w["empty"] = root / "empty.jsonl"
    w["empty"].write_text("")
    w["not_utf8"] = root / "not-utf8.jsonl"
    w["not_utf8"].write_bytes(b'{"prompt": "caf\xe9 \xff\xfe", "answer": "1"}\n')
    w["bad_json"] = root / "bad-json.jsonl"
    w["bad_json"].write_text(json.dumps(_prompt_rows()[0]) + "\n{not json\n" + json.dumps(_prompt_rows()[1]) + "\n")
    w["bad_parquet"] = root / "bad.parquet"
    w["bad_parquet"].write_bytes(b"PAR1 this is not a parquet file PAR1")
    _mkdir(w, "plain_dir", root / "plain-dir")
    (w["plain_dir"] / "notes.txt").write_text("not a dataset\n")
    w["afile"] = root / "afile.txt"
    w["afile"].write_text("a regular file\n")

    w["sft"] = _jsonl(root / "sft.jsonl", [_sft_row() for _ in range(4)])
    w["sft_role"] = _jsonl(root / "sft-role.jsonl", [_sft_row(), _sft_row(role="bot")])
    w["sft_empty_answer"] = _jsonl(root / "sft-empty-answer.jsonl", [_sft_row(), _sft_row(answer="")])
    w["sft_empty_user"] = _jsonl(root / "sft-empty-user.jsonl", [_sft_row(), _sft_row(user="  ")])
    w["sft_bool"] = _jsonl(root / "sft-bool.jsonl", [{"instruction": "Is 2 even?", "output": True}])
    w["sft_no_assistant"] = _jsonl(root / "sft-no-assistant.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    w["sft_layout"] = _jsonl(root / "sft-layout.jsonl", [{"text": "just text"}])
    w["sft_sharegpt"] = _jsonl(
        root / "sft-sharegpt.jsonl",
        [{"conversations": [{"from": "human", "value": "hi"}, {"from": "robot", "value": "hello"}]}],
    )

    w["bench"] = _jsonl(root / "bench.jsonl", [{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}])
    w["bench_cols"] = _jsonl(root / "bench-cols.jsonl", [{"question": "What is 1 + 1?", "answer": "2"}])
    w["responses"] = _jsonl(root / "responses.jsonl", [{"response": "\\boxed{2}", "answer": "2"}])
    w["no_response"] = _jsonl(root / "no-response.jsonl", [{"text": "\\boxed{2}", "answer": "2"}])
    w["no_answer"] = _jsonl(root / "no-answer.jsonl", [{"response": "\\boxed{2}"}])
    w["list_lines"] = _jsonl(root / "list-lines.jsonl", [[1, 2]])

    w["scores"] = _jsonl(root / "scores.jsonl", [{"id": str(k), "n": 4, "overlap_ratio": 0.1 * k} for k in range(4)])
    w["scores_bad"] = root / "scores-bad.jsonl"
    w["scores_bad"].write_text("garbage\n" + json.dumps({"id": "0"}) + "\n")

    for name, metrics in (
        ("run", '{"step": 1, "loss": 1.0}\n{"step": 2, "loss": 0.5}\n'),
        ("run_corrupt", '{"step": 1, "loss": 1.0}\n{"step": 2, "lo\n{"step": 3, "loss": 0.2}\n'),
    ):
        _mkdir(w, name, root / name.replace("_", "-"))
        (w[name] / "metrics.jsonl").write_text(metrics)
    _mkdir(w, "run_not_utf8", root / "run-not-utf8")
    (w["run_not_utf8"] / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 1.0}\n{"step": 2, "note": "\xff"}\n')

    w["bad_yaml"] = root / "bad.yaml"
    w["bad_yaml"].write_text("n: [1, 2\n")
    w["list_yaml"] = root / "list.yaml"
    w["list_yaml"].write_text("- n\n- 4\n")
    pipeline = {
        "teacher": {"path": str(model)},
        "student": {"path": str(model)},
        "sft_prompts": {"path": str(w["prompts"])},
        "opd_prompts": {"path": str(w["prompts"])},
        "out_dir": str(root / "out" / "pipeline"),
        "stages": ["rollout"],
        "rollout": {"max_new_tokens": 4},
    }
    variants = {
        "pipeline": pipeline,
        "pipeline_no_teacher": {k: v for k, v in pipeline.items() if k != "teacher"},
        "pipeline_typo": {**pipeline, "distill": {"objective": {"top_kk": 4}}},
        "pipeline_out_file": {**pipeline, "out_dir": str(w["afile"])},
        "pipeline_stages": {**pipeline, "stages": ["rollout", "bogus_stage"]},
        "pipeline_inf": {**pipeline, "rollout": {"max_new_tokens": 4, "temperature": float("inf")}},
    }
    import yaml

    for name, data in variants.items():
        w[name] = root / f"{name.replace('_', '-')}.yaml"
        w[name].write_text(yaml.safe_dump(data))
    return {k: str(v) for k, v in w.items()}


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    return build_world(tmp_path_factory.mktemp("bad-inputs"))


# ------------------------------------------------------------------------------------------------------ the cases


@dataclass(frozen=True)
class Case:
    """argv and culprit hold `{name}` placeholders filled from the world; culprit: substrings the line must hold."""

    name: str
    argv: str
    culprit: tuple[str, ...]
    code: int = 2
    # the class of fault the case guards against (scripts/bad_input_matrix.py counts outcomes by it): one-line (a
    # bad value or file: one line naming it), security, silent-wrong, data-loss, traceback, misleading,
    # late-error, damaged (a run directory's file read back)
    kind: str = "one-line"

    def command(self, world: dict[str, str]) -> list[str]:
        import shlex

        return [part.format_map(world) for part in shlex.split(self.argv)]

    def culprits(self, world: dict[str, str]) -> list[str]:
        return [c.format_map(world) for c in self.culprit]


# Small budgets everywhere, so that a case that is (wrongly) accepted finishes in seconds and is counted as silent.
EVAL = "eval --model {model} --benchmarks {bench} --out {out}/eval --n 1 --max-new-tokens 4"
TINY_DISTILL = "--steps 1 prompts_per_step=2 rollout.max_new_tokens=4 data.max_prompt_length=64 micro_batch_tokens=256"
DISTILL = "distill --student {model} --teacher {model} --prompts {prompts} --out-dir {out} --name d " + TINY_DISTILL
SFT = (
    "sft --model {model} --data {sft} --name s run.out_dir={out} examples_per_step=2 data.max_length=256 "
    "micro_batch_tokens=256"
)
ROLLOUT = "rollout --model {model} --prompts {prompts} --out {out}/rollout --max-new-tokens 4"
SCORE = (
    "prompts score --student {model} --teacher {model} --in {prompts} --out {out}/scores/s.jsonl --n 1 "
    "--max-new-tokens 4"
)
DEMO = "demo --out-dir {out} --steps 1 --limit 2"
LAB = "lab run topk --out-dir {out}/lab --steps 1 eval.limit=2"
SELECT = "prompts select --in {prompts} --scores {scores} --out {out}/selected.jsonl"
TEMPLATE = "prompts template --in {prompts} --template boxed --out {out}/templated.jsonl"
DEDUP = "dedup --in {prompts} --out {out}/dedup/kept.jsonl"
MODEL_CASES = [  # (label, --model value, culprit) for every command that loads a model
    ("missing dir", "{root}/no-such-model", "no-such-model"),
    ("empty dir", "{empty_dir}", "empty-dir"),
    ("config without weights or tokenizer", "{config_only}", "config-only"),
    ("no tokenizer files", "{no_tokenizer}", "no tokenizer files in {no_tokenizer}"),
    ("no tokenizer files (llama)", "{no_tokenizer_llama}", "no tokenizer files in {no_tokenizer_llama}"),
    ("truncated safetensors", "{corrupt_weights}", "model.safetensors"),
    ("corrupt torch zip", "{corrupt_bin}", "pytorch_model.bin"),
    ("hub id not found, offline", "nonexistent-org/nonexistent-model-xyz", "nonexistent-org/nonexistent-model-xyz"),
]

CASES: list[Case] = [
    # ------------------------------------------------------------------------------------------------ opd eval
    *[
        Case(f"eval --model {label}", EVAL.replace("{model}", value), (culprit,))
        for label, value, culprit in MODEL_CASES
    ],
    Case("eval --responses missing", "eval --responses {root}/no-such.jsonl --out {out}/e", ("no-such.jsonl",)),
    Case("eval --responses is a folder", "eval --responses {plain_dir} --out {out}/e", ("{plain_dir}", "folder")),
    Case("eval --responses not UTF-8", "eval --responses {not_utf8} --out {out}/e", ("{not_utf8}", "UTF-8")),
    Case("eval --responses bad JSON line", "eval --responses {bad_json} --out {out}/e", ("{bad_json}", "2")),
    Case("eval --responses empty", "eval --responses {empty} --out {out}/e", ("{empty}",)),
    Case(
        "eval --responses no response field",
        "eval --responses {no_response} --out {out}/e",
        ("{no_response}", "response"),
    ),
    Case(
        "eval --responses no answer field",
        "eval --responses {no_answer} --out {out}/e",
        ("{no_answer}", "ground-truth"),
    ),
    Case("eval --responses lines not objects", "eval --responses {list_lines} --out {out}/e", ("{list_lines}",)),
    Case("eval --benchmarks ''", "eval --model {model} --benchmarks '' --out {out}/e", ("benchmarks",)),
    Case("eval --benchmarks unknown", "eval --model {model} --benchmarks bogusbench --out {out}/e", ("bogusbench",)),
    Case(
        "eval --benchmarks missing file",
        "eval --model {model} --benchmarks {root}/no-such.jsonl --out {out}/e",
        ("no-such.jsonl",),
    ),
    Case(
        "eval --benchmarks wrong columns",
        "eval --model {model} --benchmarks {bench_cols} --out {out}/e",
        ("{bench_cols}", "prompt"),
    ),
    Case("eval --n 0", EVAL + " --n 0", ("'n'", "0")),
    Case("eval --n abc", EVAL + " --n abc", ("--n", "integer")),
    Case("eval temperature=inf", EVAL + " temperature=inf", ("temperature", "inf")),
    Case("eval --temperature nan", EVAL + " --temperature nan", ("temperature", "nan")),
    Case("eval --top-p 1.5", EVAL + " --top-p 1.5", ("top_p", "1.5")),
    Case("eval --dtype bogus", EVAL + " --dtype bogus", ("dtype", "bogus")),
    Case("eval --device cuda:7", EVAL + " --device cuda:7", ("cuda:7",)),
    Case("eval --template bogus", EVAL + " --template bogus", ("bogus",)),
    Case("eval --limit 0", EVAL + " --limit 0", ("limit",)),
    Case("eval --out is a file", "eval --model {model} --benchmarks {bench} --out {afile}", ("{afile}",)),
    Case("eval --out under a file", "eval --model {model} --benchmarks {bench} --out {afile}/sub", ("{afile}",)),
    Case("eval --config missing", EVAL + " --config {root}/no-such.yaml", ("no-such.yaml",)),
    Case("eval --config not YAML", EVAL + " --config {bad_yaml}", ("{bad_yaml}",)),
    Case("eval --config a list", EVAL + " --config {list_yaml}", ("{list_yaml}",)),
    Case("eval --config not UTF-8", EVAL + " --config {not_utf8}", ("{not_utf8}", "UTF-8")),
    Case("eval unknown key", EVAL + " tempreature=0.5", ("tempreature",)),
    Case("eval override without =", EVAL + " temperature0.5", ("temperature0.5",)),
    Case("eval --model and --responses", EVAL + " --responses {responses}", ("--model", "--responses")),
    Case("eval neither --model nor --responses", "eval --benchmarks {bench} --out {out}/e", ("--model", "--responses")),
    # --------------------------------------------------------------------------------------------- opd distill
    *[
        Case(f"distill --student {label}", DISTILL.replace("--student {model}", f"--student {value}"), (culprit,))
        for label, value, culprit in MODEL_CASES[:6]
    ],
    Case(
        "distill --teacher missing dir",
        DISTILL.replace("--teacher {model}", "--teacher {root}/no-such-teacher"),
        ("no-such-teacher",),
    ),
    Case(
        "distill --teacher with another tokenizer",
        DISTILL.replace("--teacher {model}", "--teacher {lab_teacher}"),
        ("token",),
    ),
    Case("distill unknown eval.benchmarks", DISTILL + " eval.benchmarks=bogusbench", ("bogusbench",)),
    Case(  # issue 22 item 4: the password would be printed in every retry line and saved in config.yaml
        "distill teacher.url with user:password@",
        DISTILL.replace("--teacher {model} ", "") + " teacher.url=http://me:s3cret@127.0.0.1:1",
        ("teacher.url", "credentials"),
        kind="security",
    ),
    Case(  # issue 22 item 5: contradictory teacher settings were ignored
        "distill teacher.url with teacher.path",
        DISTILL + " teacher.url=http://127.0.0.1:1",
        ("teacher.path",),
        kind="silent-wrong",
    ),
    Case(
        "distill teacher.url with teacher_offload",
        DISTILL.replace("--teacher {model} ", "") + " teacher.url=http://127.0.0.1:1 teacher_offload=true",
        ("teacher_offload",),
        kind="silent-wrong",
    ),
    Case(
        "distill into a non-empty run dir",
        DISTILL.replace("--out-dir {out}", "--out-dir {busy}"),
        ("{busy}/d", "--resume"),
    ),
    Case("distill --prompts null answer", DISTILL.replace("{prompts}", "{null_answers}"), ("{null_answers}",)),
    Case("distill --prompts bool answer", DISTILL.replace("{prompts}", "{bool_answers}"), ("{bool_answers}",)),
    Case("distill --prompts duplicate ids, other answers", DISTILL.replace("{prompts}", "{dup_ids}"), ("{dup_ids}",)),
    Case(
        "eval --benchmarks null answer",
        "eval --model {model} --benchmarks {bench_null} --out {out}/e",
        ("{bench_null}",),
    ),
    Case(
        "sft into a non-empty run dir", SFT.replace("run.out_dir={out}", "run.out_dir={busy}"), ("{busy}/s", "--resume")
    ),
    Case("distill --prompts missing", DISTILL.replace("{prompts}", "{root}/no-such.parquet"), ("no-such.parquet",)),
    Case("distill --prompts empty", DISTILL.replace("{prompts}", "{empty}"), ("{empty}",)),
    Case("distill --prompts not UTF-8", DISTILL.replace("{prompts}", "{not_utf8}"), ("{not_utf8}",)),
    Case("distill --prompts bad JSON line", DISTILL.replace("{prompts}", "{bad_json}"), ("{bad_json}", "line 2")),
    Case("distill --prompts corrupt parquet", DISTILL.replace("{prompts}", "{bad_parquet}"), ("{bad_parquet}",)),
    Case("distill --prompts a plain folder", DISTILL.replace("{prompts}", "{plain_dir}"), ("{plain_dir}",)),
    Case(
        "distill --prompts empty message content",
        DISTILL.replace("{prompts}", "{empty_content}"),
        ("{empty_content}", "content"),
    ),
    Case("distill data.prompt_key missing", DISTILL + " data.prompt_key=problem", ("problem",)),
    Case("distill data.answer_key missing", DISTILL + " data.answer_key=solution", ("solution",)),
    Case(
        "distill prompt_key is the answer column",
        DISTILL + " data.prompt_key=reward_model.ground_truth",
        ("prompt_key", "reward_model.ground_truth"),
    ),
    Case(
        "distill prompt_key is the id column",
        DISTILL.replace("{prompts}", "{id_prompts}") + " data.prompt_key=id data.answer_key=answer",
        ("prompt_key", "'id'"),
    ),
    Case("distill objective.strategy bogus", DISTILL + " objective.strategy=bogus", ("objective.strategy", "bogus")),
    Case("distill --strategy bogus", DISTILL + " --strategy bogus", ("objective.strategy", "bogus")),
    Case("distill objective.top_k=-1", DISTILL + " objective.top_k=-1", ("objective.top_k", "-1")),
    Case("distill rollout.temperature=inf", DISTILL + " rollout.temperature=inf", ("rollout.temperature", "inf")),
    Case("distill rollout.temperature=nan", DISTILL + " rollout.temperature=nan", ("rollout.temperature", "nan")),
    Case("distill --lr nan", DISTILL + " --lr nan", ("optim.lr", "nan")),
    Case("distill optim.lr=inf", DISTILL + " optim.lr=inf", ("optim.lr", "inf")),
    Case(
        "distill teacher_temperature=inf",
        DISTILL + " objective.teacher_temperature=.inf",
        ("objective.teacher_temperature", "inf"),
    ),
    Case("distill clip_ratio_c=inf", DISTILL + " objective.clip_ratio_c=inf", ("objective.clip_ratio_c", "inf")),
    Case("distill optim.betas with nan", DISTILL + " 'optim.betas=[0.9, .nan]'", ("optim.betas", "nan")),
    Case("distill activation_budget=nan", DISTILL + " activation_budget=nan", ("activation_budget", "nan")),
    Case(
        "distill grpo, every answer empty",
        "distill --student {model} --prompts {empty_answers} --advantage grpo --out-dir {out} --name g " + TINY_DISTILL,
        ("{empty_answers}", "answer"),
    ),
    Case(
        "distill grpo without answers",
        "distill --student {model} --prompts {prompts} --advantage grpo --out-dir {out} --name g data.answer_key=null "
        + TINY_DISTILL,
        ("answer_key",),
    ),
    Case("distill prompts_per_step > prompts", DISTILL + " prompts_per_step=100", ("prompts_per_step",)),
    Case("distill --steps 0", DISTILL + " --steps 0", ("run.steps",)),
    Case("distill micro_batch_tokens too small", DISTILL + " micro_batch_tokens=10", ("micro_batch_tokens",)),
    Case("distill token_grpo with top_k", DISTILL + " --advantage token_grpo", ("token_grpo", "top_k")),
    Case("distill full_reverse_kl", DISTILL + " objective.loss=full_reverse_kl", ("full_reverse_kl",)),
    Case("distill student.device=cuda:7", DISTILL + " student.device=cuda:7", ("cuda:7",)),
    Case("distill eval.n=0", DISTILL + " eval.n=0", ("eval.n",)),
    Case("distill run.keep_last=0", DISTILL + " run.keep_last=0", ("run.keep_last",)),
    Case("distill --out-dir is a file", DISTILL.replace("--out-dir {out}", "--out-dir {afile}"), ("{afile}",)),
    Case("distill --out-dir under a file", DISTILL.replace("--out-dir {out}", "--out-dir {afile}/runs"), ("{afile}",)),
    # ------------------------------------------------------------------------------------------------- opd sft
    *[
        Case(f"sft --model {label}", SFT.replace("--model {model}", f"--model {value}"), (culprit,))
        for label, value, culprit in MODEL_CASES[:6]
    ],
    Case("sft --data missing", SFT.replace("{sft}", "{root}/no-such.jsonl"), ("no-such.jsonl",)),
    Case("sft --data empty", SFT.replace("{sft}", "{empty}"), ("{empty}",)),
    Case("sft --data not UTF-8", SFT.replace("{sft}", "{not_utf8}"), ("{not_utf8}",)),
    Case("sft --data bad JSON line", SFT.replace("{sft}", "{bad_json}"), ("{bad_json}", "line 2")),
    Case("sft --data corrupt parquet", SFT.replace("{sft}", "{bad_parquet}"), ("{bad_parquet}",)),
    Case("sft --data a plain folder", SFT.replace("{sft}", "{plain_dir}"), ("{plain_dir}",)),
    Case("sft --data unknown layout", SFT.replace("{sft}", "{sft_layout}"), ("{sft_layout}", "layout")),
    Case("sft --data unknown role", SFT.replace("{sft}", "{sft_role}"), ("{sft_role}", "record 1", "'bot'")),
    Case("sft --data empty answer", SFT.replace("{sft}", "{sft_empty_answer}"), ("{sft_empty_answer}", "record 1")),
    Case("sft --data blank user turn", SFT.replace("{sft}", "{sft_empty_user}"), ("{sft_empty_user}", "record 1")),
    Case("sft --data bool answer", SFT.replace("{sft}", "{sft_bool}"), ("{sft_bool}", "output")),
    Case(
        "sft --data no assistant turn", SFT.replace("{sft}", "{sft_no_assistant}"), ("{sft_no_assistant}", "assistant")
    ),
    Case("sft --data sharegpt unknown speaker", SFT.replace("{sft}", "{sft_sharegpt}"), ("{sft_sharegpt}", "robot")),
    Case("sft data.format bogus", SFT + " data.format=bogus", ("data.format", "bogus")),
    Case("sft --epochs 0", SFT + " --epochs 0", ("epochs",)),
    Case("sft epochs=inf", SFT + " epochs=inf", ("epochs", "inf")),
    Case("sft --epochs and run.steps", SFT + " --epochs 1 run.steps=2", ("epochs", "run.steps")),
    Case("sft --lr nan", SFT + " --lr nan", ("optim.lr", "nan")),
    Case("sft lora.alpha=nan", SFT + " lora.alpha=nan", ("lora.alpha", "nan")),
    Case("sft optim.warmup_ratio=1", SFT + " optim.warmup_ratio=1", ("optim.warmup_ratio",)),
    Case("sft data.max_length=1", SFT + " data.max_length=1", ("data.max_length",)),
    Case("sft examples_per_step > examples", SFT + " examples_per_step=100", ("examples_per_step",)),
    Case("sft run.out_dir under a file", SFT.replace("run.out_dir={out}", "run.out_dir={afile}/runs"), ("{afile}",)),
    # ----------------------------------------------------------------------------------------------- opd merge
    Case("merge onto a non-empty OUT", "merge {lora} {plain_dir}", ("{plain_dir}", "--overwrite")),
    Case("merge a checkpoint without adapter", "merge {model} {out}/merged", ("{model}", "adapter_config.json")),
    Case("merge a missing checkpoint", "merge {root}/no-such-ckpt {out}/merged", ("no-such-ckpt",)),
    Case("merge --dtype bogus", "merge {lora} {out}/merged --dtype bogus", ("bogus",)),
    Case("merge onto another architecture", "merge {lora} {out}/merged --base {qwen}", ("{qwen}", "qwen3", "llama")),
    Case("merge onto other layer sizes", "merge {lora} {out}/merged --base {wide}", ("{wide}",)),
    Case("merge --base missing", "merge {lora} {out}/merged --base {root}/no-such-base", ("no-such-base",)),
    Case(
        "merge --base truncated weights", "merge {lora} {out}/merged --base {corrupt_weights}", ("model.safetensors",)
    ),
    Case("merge truncated adapter", "merge {lora_corrupt} {out}/merged", ("adapter_model.safetensors",)),
    Case("merge out under a file", "merge {lora} {afile}/merged", ("{afile}",)),
    # --------------------------------------------------------------------------------------------- opd rollout
    *[
        Case(f"rollout --model {label}", ROLLOUT.replace("--model {model}", f"--model {value}"), (culprit,))
        for label, value, culprit in MODEL_CASES[:5]
    ],
    Case("rollout --prompts missing", ROLLOUT.replace("{prompts}", "{root}/no-such.jsonl"), ("no-such.jsonl",)),
    Case(
        "rollout --prompts empty message content", ROLLOUT.replace("{prompts}", "{empty_content}"), ("{empty_content}",)
    ),
    Case("rollout --out is a file", ROLLOUT.replace("{out}/rollout", "{afile}"), ("{afile}",)),
    Case("rollout --out under a file", ROLLOUT.replace("{out}/rollout", "{afile}/r"), ("{afile}",)),
    Case("rollout --thinking maybe", ROLLOUT + " --thinking maybe", ("thinking", "maybe")),
    Case("rollout --n 0", ROLLOUT + " --n 0", ("'n'",)),
    Case("rollout temperature=inf", ROLLOUT + " temperature=inf", ("temperature", "inf")),
    Case("rollout grade_timeout=nan", ROLLOUT + " grade_timeout=nan", ("grade_timeout", "nan")),
    Case(
        "rollout --require-correct without answers", ROLLOUT + " --require-correct data.answer_key=null", ("require",)
    ),
    Case("rollout num_workers=0", ROLLOUT + " num_workers=0", ("num_workers",)),
    Case("rollout devices do not match workers", ROLLOUT + " num_workers=2 'devices=[cpu]'", ("devices",)),
    Case("rollout --template bogus", ROLLOUT + " --template bogus", ("bogus",)),
    Case("rollout --prompt-key missing", ROLLOUT + " --prompt-key problem", ("problem",)),
    Case("rollout degeneracy.token_run=-1", ROLLOUT + " degeneracy.token_run=-1", ("degeneracy.token_run",)),
    # ----------------------------------------------------------------------------------------------- opd dedup
    Case("dedup --in missing", "dedup --in {root}/no-such.jsonl --out {out}/d.jsonl", ("no-such.jsonl",)),
    Case("dedup --in empty", "dedup --in {empty} --out {out}/d.jsonl", ("{empty}",)),
    Case("dedup --in not UTF-8", "dedup --in {not_utf8} --out {out}/d.jsonl", ("{not_utf8}",)),
    Case("dedup --out equals --in", "dedup --in {dedup_in} --out {dedup_in}", ("--out", "{dedup_in}")),
    Case(
        "dedup --out equals --in, another spelling",
        "dedup --in {dedup_in} --out {root}/./plain-dir/../dedup-in.jsonl",
        ("--out", "dedup-in.jsonl"),
    ),
    Case(
        "dedup --out equals --against",
        "dedup --in {prompts} --against {dedup_in} --out {dedup_in}",
        ("--out", "{dedup_in}"),
    ),
    Case("dedup --out suffix", "dedup --in {prompts} --out {out}/kept.txt", ("kept.txt",)),
    Case("dedup --minhash-threshold 2", DEDUP + " --minhash-threshold 2", ("minhash", "2")),
    Case("dedup --minhash-threshold nan", DEDUP + " --minhash-threshold nan", ("minhash", "nan")),
    Case("dedup --against missing", DEDUP + " --against {root}/no-such-b.jsonl", ("no-such-b.jsonl",)),
    Case("dedup --prompt-key missing", DEDUP + " --prompt-key problem", ("problem",)),
    Case("dedup --out under a file", "dedup --in {prompts} --out {afile}/kept.jsonl", ("{afile}",)),
    Case("dedup --report is a folder", DEDUP + " --report {plain_dir}", ("{plain_dir}",)),
    Case("dedup without --out", "dedup --in {prompts}", ("--out",)),
    # ---------------------------------------------------------------------------------------- opd prompts ...
    Case("prompts template bogus", TEMPLATE.replace("boxed", "bogus"), ("bogus",)),
    Case(
        "prompts template custom without {problem}", TEMPLATE.replace("boxed", "'custom:Solve it.'"), ("{{problem}}",)
    ),
    Case("prompts template --in missing", TEMPLATE.replace("{prompts}", "{root}/no-such.jsonl"), ("no-such.jsonl",)),
    Case("prompts template --in corrupt parquet", TEMPLATE.replace("{prompts}", "{bad_parquet}"), ("{bad_parquet}",)),
    Case("prompts template --out suffix", TEMPLATE.replace("templated.jsonl", "templated.txt"), ("templated.txt",)),
    Case(
        "prompts template --out under a file",
        TEMPLATE.replace("{out}/templated.jsonl", "{afile}/t.jsonl"),
        ("{afile}",),
    ),
    Case(
        "prompts template --out is a folder", TEMPLATE.replace("{out}/templated.jsonl", "{plain_dir}"), ("{plain_dir}",)
    ),
    Case(
        "prompts template prompt column is the answer",
        TEMPLATE + " --prompt-key reward_model.ground_truth",
        ("prompt_key", "reward_model.ground_truth"),
    ),
    Case(
        "prompts score --student missing",
        SCORE.replace("--student {model}", "--student {root}/no-such-model"),
        ("no-such-model",),
    ),
    Case(
        "prompts score --student no tokenizer",
        SCORE.replace("--student {model}", "--student {no_tokenizer}"),
        ("no tokenizer files in {no_tokenizer}",),
    ),
    Case("prompts score --out not JSONL", SCORE.replace("s.jsonl", "s.txt"), ("s.txt",)),
    Case("prompts score --n 0", SCORE + " --n 0", ("'n'",)),
    Case("prompts score temperature=inf", SCORE + " temperature=inf", ("temperature", "inf")),
    Case(
        "prompts score --in missing", SCORE.replace("--in {prompts}", "--in {root}/no-such.jsonl"), ("no-such.jsonl",)
    ),
    Case(
        "prompts score teacher with another tokenizer",
        SCORE.replace("--teacher {model}", "--teacher {lab_teacher}"),
        ("token",),
    ),
    Case("prompts score --out under a file", SCORE.replace("{out}/scores/s.jsonl", "{afile}/s.jsonl"), ("{afile}",)),
    Case(
        "prompts select --scores missing",
        SELECT.replace("{scores}", "{root}/no-such-scores.jsonl"),
        ("no-such-scores.jsonl",),
    ),
    Case("prompts select --scores not JSON", SELECT.replace("{scores}", "{scores_bad}"), ("{scores_bad}",)),
    Case("prompts select --scores a folder", SELECT.replace("{scores}", "{plain_dir}"), ("{plain_dir}",)),
    Case("prompts select --top 2.5", SELECT + " --top 2.5", ("top", "2.5")),
    Case("prompts select --top 0", SELECT + " --top 0", ("top",)),
    Case("prompts select --by bogus", SELECT + " --by bogus", ("bogus",)),
    Case("prompts select --ratio 1", SELECT + " --mix-with {prompts} --ratio 1", ("ratio",)),
    Case("prompts select --ratio nan", SELECT + " --mix-with {prompts} --ratio nan", ("ratio", "nan")),
    Case("prompts select --mix-with missing", SELECT + " --mix-with {root}/no-such-mix.jsonl", ("no-such-mix.jsonl",)),
    Case("prompts select --out under a file", SELECT.replace("{out}/selected.jsonl", "{afile}/s.jsonl"), ("{afile}",)),
    # -------------------------------------------------------------------------------------------- opd pipeline
    Case("pipeline run missing config", "pipeline run {root}/no-such.yaml", ("no-such.yaml",)),
    Case("pipeline run not YAML", "pipeline run {bad_yaml}", ("{bad_yaml}",)),
    Case("pipeline run without teacher", "pipeline run {pipeline_no_teacher}", ("teacher",)),
    Case("pipeline run stage key typo", "pipeline run {pipeline_typo}", ("distill", "top_kk")),
    Case("pipeline run unknown stage", "pipeline run {pipeline_stages}", ("stages", "bogus_stage")),
    Case("pipeline run rollout temperature inf", "pipeline run {pipeline_inf}", ("rollout", "temperature", "inf")),
    Case("pipeline run out_dir is a file", "pipeline run {pipeline_out_file}", ("{afile}",)),
    Case("pipeline run unknown override", "pipeline run {pipeline} bogus_key=1", ("bogus_key",)),
    # ---------------------------------------------------------------------------------------------- opd report
    Case("report a folder without metrics", "report {plain_dir}", ("{plain_dir}", "metrics.jsonl")),
    Case("report a missing run", "report {root}/no-such-run", ("no-such-run",)),
    Case("report a regular file", "report {afile}", ("{afile}",)),
    Case("report corrupt metrics line", "report {run_corrupt}", ("{run_corrupt}/metrics.jsonl", "2")),
    Case("report metrics not UTF-8", "report {run_not_utf8}", ("{run_not_utf8}/metrics.jsonl", "UTF-8")),
    Case("report --out under a file", "report {run} --out {afile}/r.html", ("{afile}",)),
    # ------------------------------------------------------------------------------------------------ opd demo
    Case("demo --steps 0", DEMO + " --steps 0", ("run.steps",)),
    Case("demo --limit 0", DEMO + " --limit 0", ("eval.limit",)),
    Case("demo unknown key", DEMO + " bogus_key=1", ("bogus_key",)),
    Case("demo rollout.temperature=inf", DEMO + " rollout.temperature=inf", ("rollout.temperature", "inf")),
    Case("demo eval.benchmarks empty", DEMO + " eval.benchmarks=[]", ("eval.benchmarks",)),
    Case("demo --config missing", DEMO + " --config {root}/no-such.yaml", ("no-such.yaml",)),
    Case("demo --out-dir is a file", DEMO.replace("--out-dir {out}", "--out-dir {afile}"), ("{afile}",)),
    # --------------------------------------------------------------------------------------------- opd lab run
    Case("lab run unknown experiment", LAB.replace("topk", "bogus_experiment"), ("bogus_experiment",)),
    Case("lab run unknown variant", LAB + " --only bogus_variant", ("bogus_variant",)),
    Case("lab run one unknown variant of two", LAB + " --only only_stu_k16,bogus_variant", ("bogus_variant",)),
    Case("lab run --steps 0", LAB + " --steps 0", ("run.steps",)),
    Case("lab run unknown key", LAB + " bogus_key=1", ("bogus_key",)),
    Case(
        "lab run --out-dir under a file", LAB.replace("{out}/lab", "{afile}/lab") + " --only only_stu_k16", ("{afile}",)
    ),
    # ------------------------------------------------------------------------------------------------- any
    Case("unknown command", "nosuchcommand", ("nosuchcommand",)),
    Case("unknown option", "eval --bogus-option 1", ("--bogus-option",)),
]


# ------------------------------------------------------------------------------------------------------ running


def classify(code: int | None, stderr: str, culprits: list[str], expected_code: int, escaped: str | None) -> str:
    """clear | traceback | silent | unclear (see the module docstring)."""
    if escaped is not None or "Traceback (most recent call last)" in stderr:
        return "traceback"
    if not code:
        return "silent"
    lines = [line for line in stderr.splitlines() if line.strip()]
    if code == expected_code and len(lines) == 1 and all(c in lines[0] for c in culprits):
        return "clear"
    return "unclear"


def _tally(case: Case, outcome: str, code, stderr: str) -> None:
    path = os.environ.get("OPD_MATRIX_TALLY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case.name, "outcome": outcome, "code": code, "stderr": stderr[-2000:]}) + "\n")


@pytest.fixture(scope="module")
def env_world(world):
    from opd.lab import teacher_path

    return {**world, "lab_teacher": str(teacher_path())}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, env_world, monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the cache only: no retries, no network
    monkeypatch.chdir(tmp_path)  # anything written to a default location lands here
    world = {**env_world, "out": str(tmp_path / "out")}
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    _tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"


PIPELINE_DETERMINISTIC = "pipeline run {pipeline} stages=[rollout,distill] distill.run.deterministic=true"


@pytest.mark.parametrize(
    "command",
    [
        DISTILL + " run.deterministic=true",
        SFT + " run.deterministic=true",
        PIPELINE_DETERMINISTIC,
        DEMO + " run.deterministic=true",
        LAB + " run.deterministic=true",
    ],
    ids=["distill", "sft", "pipeline", "demo", "lab"],
)
def test_deterministic_refuses_a_cublas_setting_torch_does_not_accept(command, env_world, monkeypatch, capfd, tmp_path):
    """run.deterministic with CUBLAS_WORKSPACE_CONFIG set to a non-deterministic workspace: one line naming both,
    before the run directory exists (torch would raise at the first cuBLAS call, mid-run, on a GPU); a pipeline
    whose distill stage asks for it, before its rollout stage runs; the demo and the lab, before their evaluations."""
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    monkeypatch.chdir(tmp_path)
    world = {**env_world, "out": str(tmp_path / "out")}
    case = Case("deterministic", command, ("CUBLAS_WORKSPACE_CONFIG", ":4096:2"))
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    assert classify(code, stderr, case.culprits(world), 2, escaped) == "clear", (escaped or "") + stderr
    assert "run.deterministic" in stderr
    assert not (tmp_path / "out").exists() and not (Path(world["root"]) / "out" / "pipeline" / "rollout").exists()


@pytest.mark.parametrize("engine", ["rollout.engine=vllm", "teacher.engine=vllm"])
def test_deterministic_refuses_vllm_engines(engine, env_world, monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    world = {**env_world, "out": str(tmp_path / "out")}
    culprit = "rollout.engine" if engine.startswith("rollout") else "teacher teacher has engine=vllm"
    case = Case("deterministic vllm", f"{DISTILL} run.deterministic=true {engine}", (culprit,))
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    assert classify(code, stderr, case.culprits(world), 2, escaped) == "clear", (escaped or "") + stderr
    assert "run.deterministic" in stderr and not (tmp_path / "out").exists()


def test_unwritable_directory(env_world, monkeypatch, capfd, tmp_path):
    """A read-only output directory (only where chmod stops this process from writing: not as root)."""
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        try:
            (locked / "probe").write_text("")
        except PermissionError:
            pass
        else:
            pytest.skip("chmod does not stop writes here (root); the under-a-file cases cover unwritable outputs")
        monkeypatch.delenv("OPD_DEBUG", raising=False)
        argv = [
            "prompts",
            "template",
            "--in",
            env_world["prompts"],
            "--template",
            "boxed",
            "--out",
            str(locked / "t.jsonl"),
        ]
        code, stderr, escaped = run_in_process(argv, monkeypatch, capfd)
        assert classify(code, stderr, [str(locked), "permission"], 2, escaped) == "clear", stderr
    finally:
        locked.chmod(0o755)


def test_debug_shows_the_traceback(env_world, monkeypatch, capfd, tmp_path):
    """OPD_DEBUG=1 re-raises the error the one-liner describes."""
    from opd.cli import main

    monkeypatch.setenv("OPD_DEBUG", "1")
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "opd",
            "eval",
            "--model",
            str(tmp_path / "no-such-model"),
            "--benchmarks",
            env_world["bench"],
            "--out",
            str(tmp_path / "e"),
        ],
    )
    with pytest.raises(Exception, match="no-such-model"):
        main()


SUBPROCESS_CASES = [
    "eval --model missing dir",
    "distill rollout.temperature=inf",
    "dedup --out equals --in",
    "eval --n abc",
]


@pytest.mark.slow
def test_real_stderr_is_one_line(env_world, tmp_path):
    """The same guarantees on a real process's stderr (no capture layer in between)."""
    cases = {c.name: c for c in CASES}
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "HF_HUB_OFFLINE": "1"}
    env.pop("OPD_DEBUG", None)
    world = {**env_world, "out": str(tmp_path / "out")}
    for name in SUBPROCESS_CASES:
        case = cases[name]
        result = subprocess.run(
            [sys.executable, "-m", "opd.cli", *case.command(world)],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        outcome = classify(result.returncode, result.stderr, case.culprits(world), case.code, None)
        assert outcome == "clear", f"{name}: {outcome} (exit {result.returncode}):\n{result.stderr}"


def test_matrix_covers_every_command():
    commands = {
        " ".join(c.argv.split()[:2]) if c.argv.split()[0] in ("prompts", "pipeline", "lab") else c.argv.split()[0]
        for c in CASES
    }
    wanted = {
        "eval",
        "distill",
        "sft",
        "merge",
        "rollout",
        "dedup",
        "prompts template",
        "prompts score",
        "prompts select",
        "pipeline run",
        "report",
        "demo",
        "lab run",
    }
    assert wanted <= commands, wanted - commands
    assert len(CASES) >= 80


@pytest.mark.parametrize(
    "code, filename, filename2, expected",
    [
        ("ENOSPC", "{root}/out/metrics.jsonl", None, "{root}/out/metrics.jsonl: no space left on the device"),
        ("EACCES", "{root}/out", None, "{root}/out: permission denied"),
        ("EROFS", "{root}/out", None, "{root}/out: the file system is read-only"),
        ("EDQUOT", "{root}/out/x", None, "{root}/out/x: disk quota exceeded"),
        ("EEXIST", "{afile}", None, "{afile}: already exists as a file; expected a directory"),
        ("ENOTDIR", "{afile}/sub/x.json", None, "{afile}/sub/x.json: {afile} is a file, not a directory"),
        ("EISDIR", "{root}/.plain-dir.tmp", "{plain_dir}", "{plain_dir}: is a directory; expected a file path"),
    ],
)
def test_os_errors_name_the_path_and_the_problem(world, code, filename, filename2, expected):
    """One place (`opd.cli.main`) turns every OSError into `<path>: <what is wrong>`; a rename names its destination
    (the source is our hidden temp file). ENOSPC and friends cannot be provoked portably, so they are raised here."""
    import errno

    from opd.cli import os_error_line

    number = getattr(errno, code)
    error = OSError(
        number,
        os.strerror(number),
        filename.format_map(world),
        None,
        None if filename2 is None else filename2.format_map(world),
    )
    assert os_error_line(error).startswith(expected.format_map(world))


def test_disk_full_mid_command_is_one_line(env_world, monkeypatch, capfd, tmp_path):
    """ENOSPC where a command writes its output: one line naming the file, exit 2."""
    import errno

    import opd.report.report

    def full(path, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(opd.report.report, "atomic_write_text", full)
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, stderr, escaped = run_in_process(
        ["report", env_world["run"], "--out", str(tmp_path / "r.html")], monkeypatch, capfd
    )
    assert classify(code, stderr, [str(tmp_path / "r.html"), "no space left"], 2, escaped) == "clear", stderr


def test_unreachable_hub_fails_fast_in_one_line(monkeypatch, tmp_path):
    """A Hub id while the Hub cannot be reached (here: a closed local port as the endpoint): one line at once,
    instead of transformers' minute of retries with a warning line per retry."""
    import time

    from huggingface_hub import constants

    from opd.models import ModelLoadError, load_tokenizer

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(key, raising=False)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError, match="nonexistent-org/nonexistent-model-xyz.*not reachable") as error:
        load_tokenizer("nonexistent-org/nonexistent-model-xyz")
    assert time.perf_counter() - start < 10 and "\n" not in str(error.value)


def test_written_files_get_the_umask_mode(env_world, monkeypatch, capfd, tmp_path):
    """Files and directories a command writes have the user's umask mode (0644 / 0755 under umask 022), never the
    0600 of a temp file made with mkstemp and renamed into place."""
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    mask = os.umask(0)
    os.umask(mask)
    out = tmp_path / "written"
    for argv in (
        ["prompts", "template", "--in", env_world["prompts"], "--template", "boxed", "--out", f"{out}/t.parquet"],
        ["prompts", "template", "--in", env_world["prompts"], "--template", "boxed", "--out", f"{out}/t.jsonl"],
        ["dedup", "--in", env_world["prompts"], "--out", f"{out}/dedup/kept.parquet"],
        ["eval", "--responses", env_world["responses"], "--out", f"{out}/eval"],
        ["report", env_world["run"], "--out", f"{out}/report"],
        ["merge", env_world["lora"], f"{out}/merged"],
    ):
        code, stderr, escaped = run_in_process(argv, monkeypatch, capfd)
        assert code == 0 and escaped is None, f"{argv}: {escaped or stderr}"
    modes = {str(p.relative_to(out)): p.stat().st_mode & 0o777 for p in [out, *out.rglob("*")]}
    assert len(modes) > 10
    wrong = {
        name: oct(mode)
        for name, mode in modes.items()
        if mode != (0o777 & ~mask if (out / name).is_dir() else 0o666 & ~mask)
    }
    assert not wrong, f"umask {oct(mask)}: {wrong}"


# ------------------------------------------------------------------------- issue 22: values that were accepted

ISSUE_22_CASES: list[Case] = [
    Case(
        "distill optim.fused with bf16 state",
        DISTILL + " optim.fused=true optim.state_dtype=bf16",
        ("fused", "bf16"),
        kind="silent-wrong",
    ),
    Case(
        "distill max_batch_tokens below a sequence",
        DISTILL + " rollout.max_batch_tokens=16",
        ("max_batch_tokens=16",),
        kind="silent-wrong",
    ),
    Case(
        "distill max_new_tokens beyond the context",
        DISTILL + " rollout.max_new_tokens=600 micro_batch_tokens=1024",
        ("rollout.max_new_tokens=600", "512"),
        kind="silent-wrong",
    ),
    Case(
        "distill --prompts a symlink loop",
        DISTILL.replace("{prompts}", "{loop}"),
        ("{loop}", "symbolic link loop"),
        kind="misleading",
    ),
    Case("demo --threads -1", DEMO + " --threads -1", ("--threads", "-1"), kind="traceback"),
    Case("lab run --threads -1", LAB + " --threads -1", ("--threads", "-1"), kind="traceback"),
    Case("lab build --threads -1", "lab build {out}/build --threads -1", ("--threads", "-1"), kind="traceback"),
]


@pytest.mark.parametrize("case", ISSUE_22_CASES, ids=[c.name for c in ISSUE_22_CASES])
def test_bad_input_issue_22(case: Case, env_world, monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    loop = tmp_path / "loop.jsonl"
    loop.symlink_to(tmp_path / "loop2.jsonl")
    (tmp_path / "loop2.jsonl").symlink_to(loop)
    world = {**env_world, "out": str(tmp_path / "out"), "loop": str(loop)}
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    _tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"


def test_disk_full_in_an_atomic_write_names_the_file(env_world, monkeypatch, capfd, tmp_path):
    """ENOSPC raised by the OS while the temp file is written (no file name on the error): the line names the file
    the command was writing, not only `[Errno 28] No space left on device`."""
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, stderr, escaped = run_in_process(
        ["report", env_world["run"], "--out", str(tmp_path / "r.html")], monkeypatch, capfd
    )
    culprits = [str(tmp_path / "r.html"), "no space left"]
    assert classify(code, stderr, culprits, 2, escaped) == "clear", (escaped, stderr)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_user_error_under_torchrun_is_printed_by_rank_0(rank, monkeypatch, capfd):
    """Under torchrun (RANK, WORLD_SIZE) a user error is one line from rank 0 (issue 22 item 15); another rank waits
    for torchrun to end it, and only a rank that failed alone prints, naming itself. Every rank exits 2. Two real
    ranks under torchrun: tests/test_distributed.py."""
    import opd.cli

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(opd.cli, "_OTHER_RANK_WAIT_S", 0.01)
    code, stderr, escaped = run_in_process(["distill", "no_such.key=1"], monkeypatch, capfd)
    assert code == 2 and escaped is None
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no_such" in lines[0], stderr
    assert lines[0].startswith("error: rank 1: " if rank == "1" else "error: ") and "rank 0" not in lines[0]


# ---------------------------------------------------- issue 22 item 13: damaged run directories, read back

# Real runs made once per module (2 steps, a checkpoint, samples and an in-run eval at every step), copied into each
# case's tmp_path as {runs}/d (distill) and {runs}/s (sft) and damaged there; `opd report` reads them, `--resume`
# continues them to step 3 with the settings they were made with.
BASE_DISTILL = (
    "distill --student {model} --teacher {model} --prompts {prompts} --out-dir {runs} --name d "
    "prompts_per_step=2 rollout.max_new_tokens=4 data.max_prompt_length=64 micro_batch_tokens=256 run.save_every=1 "
    "run.samples_per_step=2 eval.benchmarks={bench} eval.n=1 eval.max_new_tokens=4 run.eval_every=1 run.report=false"
)
BASE_SFT = (
    "sft --model {model} --data {sft} --name s run.out_dir={runs} examples_per_step=2 data.max_length=256 "
    "micro_batch_tokens=256 run.save_every=1 run.report=false"
)
REPORT_D = "report {runs}/d --out {out}/r.html"
RESUME_D = BASE_DISTILL + " --steps 3 --resume"
RESUME_S = BASE_SFT + " run.steps=3 --resume"
DIR = object()  # damage: a directory where the file was
STEP = "99999999999999999999999"  # a step number no run reaches (and beyond int64)


@dataclass(frozen=True)
class Damaged(Case):
    """A Case run on a copy of the module's real runs after `damage`: (path under {runs}, content) pairs; content is
    text, bytes, DIR, or a callable of the path; a `*` in the path is each match. `remanifest`: the checkpoints'
    MANIFEST.json rewritten after the damage (a manifest that agrees with damaged files)."""

    damage: tuple = ()
    remanifest: bool = False
    kind: str = "damaged"

    def apply(self, runs: Path) -> None:
        from opd.rundir import MANIFEST, write_manifest

        for pattern, content in self.damage:
            for path in sorted(runs.glob(pattern)) if "*" in pattern else [runs / pattern]:
                if path.is_dir():
                    shutil.rmtree(path)
                elif path.exists():
                    path.unlink()
                path.parent.mkdir(parents=True, exist_ok=True)
                if content is DIR:
                    path.mkdir()
                elif callable(content):
                    content(path)
                elif isinstance(content, bytes):
                    path.write_bytes(content)
                else:
                    path.write_text(content)
                if self.remanifest and path.parent.parent.name == "checkpoints":
                    (path.parent / MANIFEST).unlink()
                    write_manifest(path.parent)


def _torch_save(value):
    def save(path: Path) -> None:
        import torch

        torch.save(value, path)

    return save


METRICS = "metrics.jsonl"
GOOD_RESULTS = '{"benchmarks": {"bench": {"avg@1": 0.5}}}'
_DAMAGE = {  # label → (path under the run, content, culprits beyond the file's path)
    "metrics.jsonl line a list": (
        METRICS,
        '{"step": 1, "loss": 1.0}\n[1, 2]\n{"step": 2, "loss": 0.5}\n',
        (":2", "list"),
    ),
    "metrics.jsonl line a number": (METRICS, '{"step": 1, "loss": 1.0}\n5\n{"step": 2, "loss": 0.5}\n', (":2",)),
    "metrics.jsonl step a string": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": "two", "loss": 0.5}\n', ("'two'",)),
    "metrics.jsonl step absurd": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": 1e300, "loss": 0.5}\n', ("1e+300",)),
    "metrics.jsonl step negative": (METRICS, '{"step": 1, "loss": 1.0}\n{"step": -5, "loss": 0.5}\n', ("-5",)),
    "samples line a list": ("samples/step_2.jsonl", "[1, 2]\n", (":1",)),
    "samples file a directory": ("samples/step_2.jsonl", DIR, ("directory",)),
    "samples step name absurd": (f"samples/step_{STEP}.jsonl", '{"step": 1}\n', ("not a step number",)),
    "eval results a list": ("eval/step_2/results.json", "[1, 2]", ("list",)),
    "eval results of another shape": ("eval/step_2/results.json", '{"benchmarks": [1]}', ("eval results",)),
    "eval results not JSON": ("eval/step_2/results.json", '{"bench', ("JSON",)),
    "eval step name absurd": (f"eval/step_{STEP}/results.json", GOOD_RESULTS, ("not a step number",)),
    "teacher eval results a list": ("eval/teacher/results.json", "[]", ("list",)),
    "teachers.json a list": ("teachers.json", "[]", ("list",)),
    "config.yaml unparsable": ("config.yaml", "run: [1, 2\n", ("YAML",)),
    "config.yaml a list": ("config.yaml", "- 1\n- 2\n", ("mapping",)),
    "config.yaml empty": ("config.yaml", "", ("mapping",)),
    "config.yaml a directory": ("config.yaml", DIR, ("directory",)),
    "config.yaml not UTF-8": ("config.yaml", b"run: \xff\n", ("UTF-8",)),
    "every MANIFEST.json a list": ("checkpoints/*/MANIFEST.json", "[]", ("MANIFEST.json", "no checkpoint")),
    "checkpoint step name absurd": (f"checkpoints/step_{STEP}", DIR, ("not a step number",)),
    "trainer_state.pt garbage": ("checkpoints/*/trainer_state.pt", b"garbage", ("not loadable",)),
    "trainer_state.pt a list": ("checkpoints/*/trainer_state.pt", _torch_save([1, 2]), ("not a trainer state",)),
    "model.safetensors garbage": ("checkpoints/*/model.safetensors", b"garbage", ("model.safetensors",)),
}
_REPORTED = [
    label for label in _DAMAGE if "MANIFEST" not in label and not label.startswith(("checkpoint", "trainer", "model."))
]
_RESUMED = [
    label
    for label in _DAMAGE
    if label not in ("samples file a directory", "teachers.json a list", "teacher eval results a list")
]  # (a resume rewrites teachers.json, and the others are the report's cases above, read the same way)
_RESUMED_SFT = [
    "metrics.jsonl line a list",
    "metrics.jsonl step absurd",
    "config.yaml a list",
    "every MANIFEST.json a list",
    "checkpoint step name absurd",
    "trainer_state.pt garbage",
]


def _damaged(command: str, argv: str, run: str, label: str) -> Damaged:
    where, content, culprits = _DAMAGE[label]
    culprit = where.replace("*", "step_2") if "MANIFEST" not in where else ""
    if STEP in culprit:  # the line names the file or directory whose name holds the absurd step
        culprit = culprit[: culprit.index(STEP) + len(STEP)] + (".jsonl" if culprit.endswith(".jsonl") else "")
    located = f"{{runs}}/{run}/{culprit}".rstrip("/")
    if where.startswith("checkpoints/*") and "MANIFEST" not in where:
        located = f"{{runs}}/{run}/checkpoints/step_2/{where.rsplit('/', 1)[1]}"
    return Damaged(
        f"{command}: {label}",
        argv,
        (located, *culprits),
        damage=((f"{run}/{where}", content),),
        remanifest=where.startswith("checkpoints/*") and "MANIFEST" not in where,
    )


DAMAGED_CASES: list[Damaged] = [
    *[_damaged("report", REPORT_D, "d", label) for label in _REPORTED],
    *[_damaged("distill --resume", RESUME_D, "d", label) for label in _RESUMED],
    *[_damaged("sft --resume", RESUME_S, "s", label) for label in _RESUMED_SFT],
]


@pytest.fixture(scope="module")
def base_runs(env_world, tmp_path_factory):
    """The real runs every damaged case copies: distill and sft, 2 steps each, made through the CLI."""
    runs = tmp_path_factory.mktemp("base-runs")
    world = {**env_world, "runs": str(runs)}
    mp = pytest.MonkeyPatch()
    try:
        for argv in (BASE_DISTILL + " --steps 2", BASE_SFT + " run.steps=2"):
            import shlex
            import traceback

            from opd.cli import main

            mp.setattr(sys, "argv", ["opd", *[part.format_map(world) for part in shlex.split(argv)]])
            try:
                main()
            except SystemExit as exit_:
                assert not exit_.code, f"{argv}: exit {exit_.code}"
            except BaseException:  # noqa: BLE001
                pytest.fail(traceback.format_exc())
    finally:
        mp.undo()
    return runs


@pytest.mark.parametrize("case", DAMAGED_CASES, ids=[c.name for c in DAMAGED_CASES])
def test_damaged_run_directory(case: Damaged, env_world, base_runs, monkeypatch, capfd, tmp_path):
    """Each file a command reads back from a run directory, damaged: one line naming it, exit 2, no traceback, and
    (for a resume) before the run changes anything in it."""
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.chdir(tmp_path)
    runs = tmp_path / "runs"
    shutil.copytree(base_runs, runs)
    case.apply(runs)
    metrics_before = {p: p.read_bytes() for p in runs.glob("*/metrics.jsonl") if p.is_file()}
    world = {**env_world, "out": str(tmp_path / "out"), "runs": str(runs)}
    capfd.readouterr()
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    _tally(case, outcome, code, (escaped or "") + stderr)
    assert outcome == "clear", f"{outcome} (exit {code}), wanted one line naming {culprits}:\n{escaped or ''}{stderr}"
    assert {p: p.read_bytes() for p in metrics_before} == metrics_before  # refused before anything was rewritten
    assert not (runs / "d" / "checkpoints" / "step_3").exists() and not (runs / "s" / "checkpoints" / "step_3").exists()
