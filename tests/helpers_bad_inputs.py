"""The world and the cases' machinery of the bad-input matrix (tests/features/bad_inputs/): the world of good and
broken inputs (`build_world`), `Case`, the command lines every case starts from, and how an outcome is classified
and tallied (`OPD_MATRIX_TALLY`, see test_commands.py)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from helpers import make_tiny_model, make_tiny_tokenizer

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


def tally(case: Case, outcome: str, code, stderr: str) -> None:
    path = os.environ.get("OPD_MATRIX_TALLY")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"case": case.name, "outcome": outcome, "code": code, "stderr": stderr[-2000:]}) + "\n")
