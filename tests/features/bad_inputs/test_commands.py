"""The bad-input matrix: every `opd` command, fed what users get wrong, must fail with exit code 2 and exactly one
line on stderr that names the culprit (the file, the config key, the value) — never a traceback, never a silent
success, and (for all but a few cases that need the weights to find the fault) before any model is loaded.

Each case is a command line over a small world of good and broken inputs built once per session (tiny random-weight
models from `conftest`, prompt / SFT / response files, a LoRA checkpoint, run directories). Most cases run in-process
through `opd.cli.main` (cheap: the libraries are imported once), with stdout/stderr captured at the file-descriptor
level so library warnings count as stderr lines too; `test_real_stderr_is_one_line` runs a handful as subprocesses.

Unwritable outputs: tests may run as root, where a read-only directory is still writable, so the portable cases are
a path *under a regular file* (ENOTDIR) and a regular file where a directory is expected (EEXIST); the chmod case
runs only where chmod actually stops writes.

`OPD_MATRIX_TALLY=FILE pytest tests/features/bad_inputs` appends one JSON line per case (name, outcome, exit code,
stderr) to FILE: outcomes are clear / traceback / silent (exit 0) / unclear (non-zero, but several lines, the wrong
code or a line that does not name the culprit). That is how the counts in the issue were measured.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import run_in_process
from helpers_bad_inputs import (
    DEDUP,
    DEMO,
    DISTILL,
    EVAL,
    LAB,
    ROLLOUT,
    SCORE,
    SELECT,
    SFT,
    TEMPLATE,
    TINY_DISTILL,
    Case,
    classify,
    tally,
)

SRC = Path(__file__).resolve().parents[3] / "src"

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
    Case(
        "distill full_reverse_kl from scores",
        DISTILL + " objective.loss=full_reverse_kl teacher.answer=scores",
        ("full_reverse_kl", "teacher.answer"),
    ),
    Case(
        "distill exact-KL reward with top_k",
        DISTILL + " objective.token_reward=full_reverse_kl_next",
        ("token_reward", "top_k=0"),
    ),
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


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input(case: Case, env_world, monkeypatch, capfd, tmp_path):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id is looked up in the cache only: no retries, no network
    monkeypatch.chdir(tmp_path)  # anything written to a default location lands here
    world = {**env_world, "out": str(tmp_path / "out")}
    code, stderr, escaped = run_in_process(case.command(world), monkeypatch, capfd)
    culprits = case.culprits(world)
    outcome = classify(code, stderr, culprits, case.code, escaped)
    tally(case, outcome, code, (escaped or "") + stderr)
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

ONCE_ACCEPTED_CASES: list[Case] = [
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


@pytest.mark.parametrize("case", ONCE_ACCEPTED_CASES, ids=[c.name for c in ONCE_ACCEPTED_CASES])
def test_once_accepted_value_fails_in_one_line(case: Case, env_world, monkeypatch, capfd, tmp_path):
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
    tally(case, outcome, code, (escaped or "") + stderr)
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
    ranks under torchrun: tests/features/test_distributed.py."""
    import opd.cli

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(opd.cli, "_OTHER_RANK_WAIT_S", 0.01)
    code, stderr, escaped = run_in_process(["distill", "no_such.key=1"], monkeypatch, capfd)
    assert code == 2 and escaped is None
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no_such" in lines[0], stderr
    assert lines[0].startswith("error: rank 1: " if rank == "1" else "error: ") and "rank 0" not in lines[0]
