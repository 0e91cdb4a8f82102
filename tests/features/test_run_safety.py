"""Nothing lost, nothing mixed: every command that writes state, through its command line. Resumes, checkpoint
manifests and `kill -9`: test_resume.py.

- `opd merge` refuses to write over anything that is not empty (or moves it aside with --overwrite), and so do
  `opd prompts template` / `select` and `opd dedup` over an existing output file;
- a new `opd distill` / `opd sft` into a run directory that holds a run refuses (or moves it aside with
  run.overwrite), so two runs never mix and keep-last pruning only ever removes checkpoints of the run itself;
- eval sets, output paths and writability fail at startup, before any training; the final checkpoint is written
  before the final eval, so a failing (or killed) eval loses no training;
- an exclusive lock per directory: a second process on the same directory fails with one line naming the directory
  and the pid that holds it (distill, sft, eval, rollout, prompts score, pipeline);
- stale checkpoint temp directories are removed at startup; a failed checkpoint write removes its partial copy and
  says how much space it needed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    cli,
    distill_config,
    dump,
    kill9,
    make_prompts,
    one_line,
    run_opd,
    sft_config,
    snapshot,
    start,
    subprocess_env,
    wait_for,
    write_jsonl,
)
from opd.io import LOCK_FILE, DirectoryLock, DirectoryLocked, read_jsonl
from opd.recipes.distill import distill
from opd.recipes.sft import sft
from opd.train.checkpoint import latest_checkpoint, save_checkpoint, verify_checkpoint

# --------------------------------------------------------------------------------------------------- helpers


def lock_holder(directory: Path) -> int | None:
    try:
        return json.loads((directory / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------------------------------------- 1. opd merge


@pytest.fixture(scope="module")
def lora_checkpoint(tmp_path_factory):
    """A LoRA checkpoint of a 1-step `opd sft` run on a tiny model."""
    from helpers import make_tiny_model, make_tiny_tokenizer

    root = tmp_path_factory.mktemp("lora")
    model_dir = root / "base"
    make_tiny_model("llama").save_pretrained(model_dir)
    make_tiny_tokenizer().save_pretrained(model_dir)
    data = write_jsonl(
        root / "sft.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}] * 4,
    )
    run_dir = sft(
        sft_config(
            root, model_dir, data, "run.steps=1", "run.name=lora", "lora.enabled=true", "lora.r=2", "lora.merge=false"
        )
    )
    return run_dir / "checkpoints" / "step_1"


def test_merge_refuses_an_existing_file(capsys, tmp_path, lora_checkpoint):
    out = tmp_path / "out"
    out.write_text("my notes")
    line = one_line(*cli(capsys, "merge", lora_checkpoint, out)[::2])
    assert str(out) in line and "--overwrite" in line
    assert out.read_text() == "my notes"


@pytest.mark.parametrize("command", ["prompts template", "prompts select", "dedup"])
def test_file_outputs_are_refused_or_moved_aside_never_replaced(capsys, tmp_path, command):
    """A prompt set (and dedup's report) written whole: an existing file at the output path is refused in one line
    before any work, untouched; with --overwrite it is moved aside to <name>.old-<time>, every byte kept; the output
    given as the input itself is refused even with --overwrite (it would be moved away before being read)."""
    from opd.data.prompts import load_prompts, save_prompts
    from opd.eval.prompt_scores import PromptScore

    prompts = make_prompts(4)
    data = save_prompts(prompts, tmp_path / "set.jsonl")
    scores = tmp_path / "scores.jsonl"
    scores.write_text(
        "".join(json.dumps(PromptScore(p.id, overlap_ratio=0.1 * i).to_json()) + "\n" for i, p in enumerate(prompts))
    )
    out = tmp_path / "out.jsonl"
    args = {
        "prompts template": ["prompts", "template", "--in", str(data), "--template", "boxed"],
        "prompts select": ["prompts", "select", "--in", str(data), "--scores", str(scores), "--top", "2"],
        "dedup": ["dedup", "--in", str(data)],
    }[command]
    existing = [out] + ([tmp_path / "out.report.json"] if command == "dedup" else [])
    for path in existing:
        path.write_text("my notes\n")
        line = one_line(*cli(capsys, *args, "--out", str(out))[::2])
        assert f"{path}: the file exists" in line and "--overwrite" in line, line
        assert path.read_text() == "my notes\n"
        path.unlink()
    for path in existing:
        path.write_text("my notes\n")
    code, _, err = cli(capsys, *args, "--out", str(out), "--overwrite")
    assert code == 0, err
    assert len(load_prompts(out)) >= 2
    for path in existing:
        (aside,) = tmp_path.glob(f"{path.name}.old-*")
        assert aside.read_text() == "my notes\n"
    line = one_line(*cli(capsys, *args, "--out", str(data), "--overwrite")[::2])
    assert "is the --in file itself" in line and len(load_prompts(data)) == 4


def test_merge_refuses_a_non_empty_directory(capsys, tmp_path, lora_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("unrelated")
    line = one_line(*cli(capsys, "merge", lora_checkpoint, out)[::2])
    assert "non-empty directory" in line and "--overwrite" in line
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "unrelated"


def test_merge_overwrite_moves_the_old_one_aside(capsys, tmp_path, lora_checkpoint):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("unrelated")
    code, _, err = cli(capsys, "merge", lora_checkpoint, out, "--overwrite")
    assert code == 0, err
    AutoModelForCausalLM.from_pretrained(out)
    (aside,) = tmp_path.glob("out.old-*")
    assert (aside / "keep.txt").read_text() == "unrelated" and str(aside) in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", aside.name]  # no temp directory left


def test_merge_into_an_empty_directory(capsys, tmp_path, lora_checkpoint):
    out = tmp_path / "out"
    out.mkdir()
    code, _, err = cli(capsys, "merge", lora_checkpoint, out)
    assert code == 0, err
    assert (out / "model.safetensors").is_file() and not list(tmp_path.glob("out.old-*"))


# ----------------------------------------------------------------------------------- 2. one run per directory


def test_new_distill_into_a_run_directory_refuses(capsys, world, tmp_path):
    first = distill(distill_config(world, tmp_path, "run.save_every=2", "run.keep_last=2", steps=6))
    before = snapshot(first)
    # the case: the old run's step_4/step_6 would sort as newer than the new run's step_2 (keep-last pruned
    # the new one), its metrics.jsonl would be replaced, and a later --resume would continue the old run
    yaml_path = dump(
        distill_config(world, tmp_path, "run.save_every=2", "run.keep_last=2", steps=2), tmp_path / "c.yaml"
    )
    line = one_line(*cli(capsys, "distill", "--config", yaml_path)[::2])
    assert str(first) in line and "--resume" in line and "run.name" in line and "run.overwrite=true" in line
    assert snapshot(first) == before


def test_new_sft_into_a_run_directory_refuses(capsys, tmp_path, tiny_model_dir, sft_data):
    run_dir = sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=one"))
    before = snapshot(run_dir)
    yaml_path = dump(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=one"), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "sft", "--config", yaml_path)[::2])
    assert str(run_dir) in line and "--resume" in line and "run.overwrite=true" in line
    assert snapshot(run_dir) == before


def test_overwrite_moves_the_old_run_aside(capsys, world, tmp_path):
    first = distill(distill_config(world, tmp_path, steps=2))
    (first / "my_notes.txt").write_text("keep me")
    before = snapshot(first)
    yaml_path = dump(distill_config(world, tmp_path, steps=1), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "run.overwrite=true")
    assert code == 0, err
    (aside,) = tmp_path.glob("run.old-*")
    assert snapshot(aside) == before and "moved the earlier" in out
    assert [m["step"] for m in read_jsonl(first / "metrics.jsonl")] == [1]
    assert latest_checkpoint(first).name == "step_1"


def test_resume_and_overwrite_contradict(capsys, world, tmp_path):
    yaml_path = dump(distill_config(world, tmp_path), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume", "run.overwrite=true")[::2])
    assert "run.resume and run.overwrite" in line


def test_pruning_never_removes_a_newer_checkpoint(tmp_path):
    """keep-last removes only steps before the one being saved: a newer step directory (from a resume that fell
    back past it) is replaced when its step comes, never a reason to delete what was just written."""
    model = torch.nn.Linear(2, 2)
    model.save_pretrained = lambda path, **_: (Path(path).mkdir(parents=True), torch.save({}, Path(path) / "w.pt"))
    for step in (2, 5):
        save_checkpoint(tmp_path, step, model=model, tokenizer=None, trainer_state={}, keep_last=None)
    save_checkpoint(tmp_path, 3, model=model, tokenizer=None, trainer_state={}, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_3", "step_5"]


# ------------------------------------------------------------------------------------ 3. fail before training


def test_distill_unknown_eval_benchmark_fails_before_training(capsys, world, tmp_path):
    yaml_path = dump(
        distill_config(world, tmp_path, "eval.benchmarks=[aime2O24]", "run.save_every=0"), tmp_path / "c.yaml"
    )
    line = one_line(*cli(capsys, "distill", "--config", yaml_path)[::2])
    assert "aime2O24" in line and "eval.benchmarks" in line
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_sft_eval_set_with_a_bad_column_fails_before_training(capsys, tmp_path, tiny_model_dir, sft_data):
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"question": "1+1?", "answer": "2"}])
    yaml_path = dump(
        sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s", f"eval.benchmarks=[{bench}]"),
        tmp_path / "c.yaml",
    )
    line = one_line(*cli(capsys, "sft", "--config", yaml_path)[::2])
    assert "bench.jsonl" in line
    assert not (tmp_path / "runs" / "s").exists()


def test_run_directory_blocked_by_a_file(capsys, world, tmp_path):
    (tmp_path / "run").write_text("a file, not a directory")
    yaml_path = dump(distill_config(world, tmp_path), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path)[::2])
    assert str(tmp_path / "run") in line and "file" in line
    assert (tmp_path / "run").read_text() == "a file, not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_read_only_out_dir(capsys, world, tmp_path):
    parent = tmp_path / "ro"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        yaml_path = dump(distill_config(world, parent), tmp_path / "c.yaml")
        line = one_line(*cli(capsys, "distill", "--config", yaml_path)[::2])
        assert "not writable" in line
    finally:
        parent.chmod(0o700)


@pytest.mark.slow
def test_kill_during_the_final_eval_loses_no_training(capsys, world, tmp_path):
    """save_every=0 (the demo's setting): the final checkpoint is written before the final eval, so a run killed (or
    failing) there keeps its training; --resume then redoes the unfinished eval and finishes the run."""
    bench = write_jsonl(tmp_path / "bench.jsonl", [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(12)])
    cfg = distill_config(
        world,
        tmp_path,
        "run.save_every=0",
        f"eval.benchmarks=[{bench}]",
        "eval.answer_key=answer",
        "eval.n=2",
        "eval.max_new_tokens=6",
        "rollout.batch_size=4",
        steps=2,
    )
    yaml_path, run_dir, log = dump(cfg, tmp_path / "c.yaml"), tmp_path / "run", tmp_path / "a.log"
    a = start(log, "distill", "--config", yaml_path)
    wait_for(a, lambda: (run_dir / "eval" / "step_2" / "config.yaml").exists(), log, "the final eval")
    kill9(a)
    assert verify_checkpoint(run_dir / "checkpoints" / "step_2", hashes=True) is None
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert (run_dir / "eval" / "step_2" / "results.json").is_file()
    assert any("eval/bench/avg@2" in m for m in read_jsonl(run_dir / "metrics.jsonl"))


# ------------------------------------------------------------------------------------------------- 4. locking


def test_lock_names_the_holder_and_is_released(tmp_path):
    directory = tmp_path / "d"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from opd.io import DirectoryLock; "
            "DirectoryLock(sys.argv[1], 'eval').acquire(); print('held', flush=True); time.sleep(60)",
            str(directory),
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            DirectoryLocked,
            match=rf"{re.escape(str(directory))} is in use by another opd process "
            rf"\(pid {holder.pid} on .*, opd eval, started ",
        ):
            DirectoryLock(directory, "distill").acquire()
    finally:
        holder.kill()
        holder.wait()
    notes = []
    with DirectoryLock(directory, "distill", note=notes.append):  # the dead holder's file is taken over, with a note
        assert lock_holder(directory) == os.getpid()
        with DirectoryLock(directory, "eval"):  # nested in one process: fine
            pass
        assert lock_holder(directory) == os.getpid()
    assert len(notes) == 1 and f"pid {holder.pid}" in notes[0] and "not running" in notes[0]
    assert not (directory / LOCK_FILE).exists()


def test_lock_is_released_when_the_command_fails(capsys, world, tmp_path):
    first = distill(distill_config(world, tmp_path, steps=1))
    yaml_path = dump(distill_config(world, tmp_path, "objective.top_k=4", steps=2), tmp_path / "c.yaml")
    one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])  # refused: the config changed
    assert not (first / LOCK_FILE).exists()


def test_pipeline_holds_its_directory(capsys, tmp_path):
    root = tmp_path / "pipe"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from opd.io import DirectoryLock; "
            "DirectoryLock(sys.argv[1], 'pipeline').acquire(); print('held', flush=True); "
            "time.sleep(60)",
            str(root),
        ],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        path = _pipeline_yaml(tmp_path, root)
        line = one_line(*cli(capsys, "pipeline", "run", path)[::2])
        assert str(root) in line and f"pid {holder.pid}" in line
    finally:
        holder.kill()
        holder.wait()


def _pipeline_yaml(tmp_path: Path, root: Path, **extra) -> Path:
    spec = {"path": str(tmp_path / "prompts.jsonl")}
    config = {
        "teacher": {"path": "t"},
        "student": {"path": "s"},
        "sft_prompts": spec,
        "opd_prompts": spec,
        "out_dir": str(root),
        "stages": [],
        **extra,
    }
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_pipeline_rerun_with_another_recipe_refuses(capsys, tmp_path):
    root = tmp_path / "pipe"
    assert cli(capsys, "pipeline", "run", _pipeline_yaml(tmp_path, root))[0] == 0
    line = one_line(*cli(capsys, "pipeline", "run", _pipeline_yaml(tmp_path, root, stages=["eval"]))[::2])
    assert "eval.benchmarks is empty" in line  # `stages` may change: the eval stage ran (and needs benchmarks)
    line = one_line(*cli(capsys, "pipeline", "run", _pipeline_yaml(tmp_path, root, distill={"run": {"steps": 7}}))[::2])
    assert "distill.run.steps" in line and str(root) in line


# ----------------------------------------------------------------------- 5. temp directories and write failures


def test_stale_checkpoint_temps_are_removed_on_resume(capsys, world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = run_dir / "checkpoints"
    for name in (f".tmp-step_2-{dead.pid}", f".old-step_1-{dead.pid}", ".tmp-step_2-1"):  # pid 1 is alive
        (root / name).mkdir()
        (root / name / "model.safetensors").write_bytes(b"\0" * 1000)
    (root / "notes.txt").write_text("mine")
    yaml_path = dump(distill_config(world, tmp_path, steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert sorted(p.name for p in root.iterdir()) == [".tmp-step_2-1", "notes.txt", "step_1", "step_2"]
    assert out.count("interrupted checkpoint write") == 2


@pytest.mark.slow
def test_full_disk_while_checkpointing_is_one_line_and_leaves_no_partial_copy(world, tmp_path):
    """A real failing write (the file-size limit of the process, like a full disk: the write syscall fails)."""
    import resource

    limit = 64 << 10  # the tiny model's weights are ~140 KB; everything else the run writes is smaller than this

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # fail the write (EFBIG) instead of killing the process
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    yaml_path = dump(distill_config(world, tmp_path, "run.save_every=1", steps=2), tmp_path / "c.yaml")
    result = run_opd("distill", "--config", yaml_path, preexec_fn=small_files)
    line = one_line(result.returncode, "\n".join(s for s in result.stderr.splitlines() if "Writing model" not in s))
    root = tmp_path / "run" / "checkpoints"
    assert "could not write checkpoint step_1" in line and str(root) in line and "needs about" in line, line
    assert "File too large" in line
    assert list(root.iterdir()) == []


def _check_args(world, out: Path) -> list[str]:
    return [
        "check", "--student", str(world / "student"), "--teacher", str(world / "teacher"),
        "--prompts", str(world / "prompts.jsonl"), "--out", str(out), "--n", "1", "--prompts-sample", "2",
        "data.max_prompt_length=32", "rollout.max_new_tokens=4", "micro_batch_tokens=64",
    ]  # fmt: skip


def test_check_out_takes_the_directory_lock(capsys, world, tmp_path):
    """A second `opd check --out DIR` while one runs refuses (check.json is never replaced)."""
    out = tmp_path / "check"
    holder = subprocess.Popen(
        [sys.executable, "-c", f"from opd.io import DirectoryLock; DirectoryLock({str(out)!r}, 'check').acquire(); "
         "print('held', flush=True); import time; time.sleep(600)"],
        stdout=subprocess.PIPE, env=subprocess_env(), text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        line = one_line(*cli(capsys, *_check_args(world, out))[::2])
        assert str(out) in line and "in use by another opd process" in line and f"pid {holder.pid}" in line
        assert not (out / "check.json").exists()
    finally:
        holder.kill()
        holder.wait()


def test_check_out_not_writable_fails_before_the_checks(capsys, world, tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("")
    code, out, err = cli(capsys, *_check_args(world, blocker / "check"))
    assert str(blocker) in one_line(code, err) and "opd check:" not in out  # no check ran


def test_a_lock_of_a_live_process_that_holds_none_is_described_as_such(capsys, world, tmp_path):
    """A lock file naming a running pid that holds no lock (an ended run whose pid was reused): taken over, and
    the note does not claim the process is not running."""
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    (run_dir / LOCK_FILE).write_text(json.dumps({"pid": os.getppid(), "command": "distill"}) + "\n")
    yaml_path = dump(distill_config(world, tmp_path, steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert f"pid {os.getppid()}" in out and "running but no longer holds it" in out and "not running" not in out
