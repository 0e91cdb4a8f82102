"""Nothing lost, nothing mixed: every command that writes state, through its command line.

- `opd merge` refuses to write over anything that is not empty (or moves it aside with --overwrite), and so do
  `opd prompts template` / `select` and `opd dedup` over an existing output file;
- a new `opd distill` / `opd sft` into a run directory that holds a run refuses (or moves it aside with
  run.overwrite), so two runs never mix and keep-last pruning only ever removes checkpoints of the run itself;
- eval sets, output paths and writability fail at startup, before any training; the final checkpoint is written
  before the final eval, so a failing (or killed) eval loses no training;
- an exclusive lock per directory: a second process on the same directory fails with one line naming the directory
  and the pid that holds it (distill, sft, eval, rollout, prompts score, pipeline);
- stale checkpoint temp directories are removed at startup; a failed checkpoint write removes its partial copy and
  says how much space it needed;
- `--resume` refuses a changed config unless `--allow-config-change`, and keeps the earlier config as
  config.step_N.yaml;
- checkpoints carry a manifest (sizes, sha256); a truncated or corrupt newest checkpoint is skipped with a warning;
- `kill -9` in the middle of each of distill, sft, eval, rollout and prompts score, then the same command again:
  the result equals an uninterrupted run.

The kill tests start the real CLI as a subprocess (one torch thread, like the in-process runs, so that both compute
exactly the same), stop it mid-run (SIGSTOP: it keeps its lock), run the same command in this process through the
CLI's `main()` (refused: the lock), kill -9 the subprocess and rerun in-process. The other tests call `main()`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from helpers import (
    SFT_QA,
    assert_same_weights,
    chat,
    cli,
    distill_config,
    dump,
    eval_args,
    interrupt_with_a_second_process,
    kill9,
    make_prompts,
    one_line,
    run_opd,
    score_config,
    sft_config,
    start,
    subprocess_env,
    tiny_rollout_config,
    wait_for,
    write_jsonl,
    write_prompts,
)
from opd.io import LOCK_FILE, DirectoryLock, DirectoryLocked, read_jsonl
from opd.recipes.distill import distill
from opd.recipes.sft import sft
from opd.train.checkpoint import MANIFEST, latest_checkpoint, save_checkpoint, verify_checkpoint

# --------------------------------------------------------------------------------------------------- helpers


def lock_holder(directory: Path) -> int | None:
    try:
        return json.loads((directory / LOCK_FILE).read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


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
    # the issue's case: the old run's step_4/step_6 would sort as newer than the new run's step_2 (keep-last pruned
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


# ------------------------------------------------------------------------------------- 6. resume config check


def test_resume_with_a_changed_objective_refuses_naming_each_key(capsys, world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    saved = (run_dir / "config.yaml").read_text()
    yaml_path = dump(distill_config(world, tmp_path, "objective.top_k=4", "rollout.n=3", steps=2), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert "objective.top_k: 16 → 4" in line and "rollout.n: 2 → 3" in line and "--allow-config-change" in line
    assert (run_dir / "config.yaml").read_text() == saved and len(read_jsonl(run_dir / "metrics.jsonl")) == 1

    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    assert (run_dir / "config.step_1.yaml").read_text() == saved  # the settings of steps 1..1
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["objective"]["top_k"] == 4


def test_resume_may_extend_a_run_and_keeps_the_config_history(capsys, world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    saved = (run_dir / "config.yaml").read_text()
    yaml_path = dump(distill_config(world, tmp_path, "run.save_every=7", "eval.n=3", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert (run_dir / "config.step_1.yaml").read_text() == saved
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]


def test_resume_cannot_go_back(capsys, world, tmp_path):
    distill(distill_config(world, tmp_path, steps=2))
    yaml_path = dump(distill_config(world, tmp_path, steps=1), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert "run.steps=1" in line and "step_2" in line


def test_sft_resume_with_another_learning_rate_refuses(capsys, tmp_path, tiny_model_dir, sft_data):
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s"))
    yaml_path = dump(
        sft_config(
            tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s", "optim.lr=0.5", "examples_per_step=2"
        ),
        tmp_path / "c.yaml",
    )
    line = one_line(*cli(capsys, "sft", "--config", yaml_path, "--resume")[::2])
    assert "optim.lr: 1e-05 → 0.5" in line and "examples_per_step: 4 → 2" in line
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err


# ------------------------------------------------------------------------------------- 7. checkpoint manifests


def test_manifest_lists_every_file_with_size_and_hash(world, tmp_path):
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    checkpoint = run_dir / "checkpoints" / "step_1"
    manifest = json.loads((checkpoint / MANIFEST).read_text())["files"]
    assert set(manifest) == {p.name for p in checkpoint.iterdir()} - {MANIFEST}
    assert manifest["model.safetensors"]["bytes"] == (checkpoint / "model.safetensors").stat().st_size
    assert len(manifest["trainer_state.pt"]["sha256"]) == 64


@pytest.mark.parametrize("damage", ["truncate_weights", "flip_state_byte", "remove_state"])
def test_resume_falls_back_past_a_damaged_newest_checkpoint(capsys, world, tmp_path, damage):
    straight = distill(distill_config(world, tmp_path / "a", "run.save_every=2", steps=4))
    run_dir = distill(distill_config(world, tmp_path / "b", "run.save_every=2", steps=4))
    newest = run_dir / "checkpoints" / "step_4"
    if damage == "truncate_weights":
        with open(newest / "model.safetensors", "r+b") as handle:
            handle.truncate(1000)
    elif damage == "flip_state_byte":  # same size: only the sha256 sees it
        data = bytearray((newest / "trainer_state.pt").read_bytes())
        data[len(data) // 2] ^= 0xFF
        (newest / "trainer_state.pt").write_bytes(bytes(data))
    else:
        (newest / "trainer_state.pt").unlink()
    yaml_path = dump(distill_config(world, tmp_path / "b", "run.save_every=2", steps=4), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0, err
    assert "step_4 is incomplete or corrupt" in out and "resumed from" in out and "step_2" in out
    assert_same_weights(straight / "checkpoints" / "step_4", newest)
    assert verify_checkpoint(newest, hashes=True) is None


def test_checkpoint_without_a_manifest_still_resumes(capsys, world, tmp_path):
    """Checkpoints written before manifests existed: COMPLETE marker + trainer state, accepted unverified."""
    straight = distill(distill_config(world, tmp_path / "a", steps=2))
    run_dir = distill(distill_config(world, tmp_path / "b", steps=1))
    (run_dir / "checkpoints" / "step_1" / MANIFEST).unlink()
    assert latest_checkpoint(run_dir).name == "step_1"
    yaml_path = dump(distill_config(world, tmp_path / "b", steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0 and "resumed from" in out, err
    assert_same_weights(straight / "checkpoints" / "step_2", run_dir / "checkpoints" / "step_2")


# ------------------------------------------------------------------------- 8. kill -9 and a second process


@pytest.mark.slow
def test_distill_kill9_resumes_exactly_and_refuses_a_second_process(capsys, world, tmp_path):
    # a long run (constant lr: its length does not change the steps it makes), killed after its first checkpoint,
    # then resumed to 6 steps: equal to a straight 6-step run
    yaml_path = dump(
        distill_config(world, tmp_path, "run.save_every=2", "run.keep_last=null", steps=500), tmp_path / "c.yaml"
    )
    run_dir, log = tmp_path / "run", tmp_path / "a.log"
    a = start(log, "distill", "--config", yaml_path)
    wait_for(a, lambda: (run_dir / "checkpoints" / "step_2").is_dir(), log, "the first checkpoint")
    interrupt_with_a_second_process(capsys, run_dir, a, "distill", "--config", yaml_path, "--resume")
    steps = max(6, int(latest_checkpoint(run_dir).name.split("_")[1]) + 2)
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", f"run.steps={steps}")
    assert code == 0, err
    assert f"lock left by pid {a.pid}" in out
    straight = distill(distill_config(world, tmp_path / "ref", "run.save_every=2", steps=steps))
    assert_same_weights(straight / "checkpoints" / f"step_{steps}", run_dir / "checkpoints" / f"step_{steps}")
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert metrics[-1]["reward_mean"] == read_jsonl(straight / "metrics.jsonl")[-1]["reward_mean"]
    assert not list((run_dir / "checkpoints").glob(".*")) and not (run_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_sft_kill9_resumes_exactly_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir, sft_data):
    common = [
        "run.save_every=2",
        "run.keep_last=null",
        "optim.schedule=constant",
        "optim.warmup_ratio=0",
        "optim.lr=1e-2",
    ]
    yaml_path = dump(
        sft_config(tmp_path, tiny_model_dir, sft_data, *common, "run.steps=500", "run.name=s"), tmp_path / "c.yaml"
    )
    run_dir, log = tmp_path / "runs" / "s", tmp_path / "a.log"
    a = start(log, "sft", "--config", yaml_path)
    wait_for(a, lambda: (run_dir / "checkpoints" / "step_2").is_dir(), log, "the first checkpoint")
    interrupt_with_a_second_process(capsys, run_dir, a, "sft", "--config", yaml_path)
    steps = max(6, int(latest_checkpoint(run_dir).name.split("_")[1]) + 2)
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", f"run.steps={steps}")
    assert code == 0, err
    straight = sft(sft_config(tmp_path, tiny_model_dir, sft_data, *common, f"run.steps={steps}", "run.name=ref"))
    assert_same_weights(straight / "checkpoints" / f"step_{steps}", run_dir / "checkpoints" / f"step_{steps}")
    losses = [[m["loss"] for m in read_jsonl(d / "metrics.jsonl")] for d in (straight, run_dir)]
    assert losses[0] == losses[1] and len(losses[0]) == steps


@pytest.mark.slow
def test_eval_kill9_rerun_is_identical_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir):
    rows = [{"problem": f"What is {i} + {i}? Put the answer in \\boxed{{}}.", "answer": str(2 * i)} for i in range(16)]
    problems = write_jsonl(tmp_path / "toy.jsonl", rows)
    out, log = tmp_path / "out", tmp_path / "a.log"
    args = eval_args(tiny_model_dir, problems, out)
    a = start(log, *args)
    wait_for(
        a,
        lambda: (out / "samples.jsonl").is_file() and (out / "samples.jsonl").stat().st_size > 0,
        log,
        "the first graded chunk",
    )
    interrupt_with_a_second_process(capsys, out, a, *args)
    code, _, err = cli(capsys, *args)
    assert code == 0, err
    code, _, err = cli(capsys, *eval_args(tiny_model_dir, problems, tmp_path / "ref"))  # uninterrupted, in-process
    assert code == 0, err
    key = lambda r: (r["problem_id"], r["sample"])  # noqa: E731
    resumed, straight = read_jsonl(out / "samples.jsonl"), read_jsonl(tmp_path / "ref" / "samples.jsonl")
    assert {key(r): r["response"] for r in resumed} == {key(r): r["response"] for r in straight}
    assert len({key(r) for r in resumed}) == 32
    results = [json.loads((d / "results.json").read_text())["benchmarks"] for d in (out, tmp_path / "ref")]
    assert results[0] == results[1]


@pytest.mark.slow
def test_rollout_kill9_rerun_is_identical_and_refuses_a_second_process(capsys, tmp_path, tiny_model_dir):
    prompts = write_prompts(tmp_path / "many.jsonl", 12)
    config = tiny_rollout_config(tmp_path, tiny_model_dir, "out", **{"data.path": str(prompts)})
    yaml_path, out, log = dump(config, tmp_path / "c.yaml"), tmp_path / "out", tmp_path / "a.log"
    a = start(log, "rollout", "--config", yaml_path)
    shard = out / "shards" / "rank_0.jsonl"
    wait_for(a, lambda: shard.is_file() and shard.stat().st_size > 0, log, "the first batch")
    interrupt_with_a_second_process(capsys, out, a, "rollout", "--config", yaml_path)
    code, stdout, err = cli(capsys, "rollout", "--config", yaml_path)
    assert code == 0 and "resuming" in stdout, err
    reference = dump(
        tiny_rollout_config(tmp_path, tiny_model_dir, "ref", **{"data.path": str(prompts)}), tmp_path / "r.yaml"
    )
    code, _, err = cli(capsys, "rollout", "--config", reference)  # uninterrupted, in-process
    assert code == 0, err
    for name in ("rollouts.jsonl", "rejected.jsonl"):
        assert read_jsonl(out / name) == read_jsonl(tmp_path / "ref" / name), name
    assert len(read_jsonl(out / "rejected.jsonl")) == 24


@pytest.mark.slow
def test_prompts_score_kill9_rerun_is_identical_and_refuses_a_second_process(tmp_path, model_dirs, capsys):
    # capsys after model_dirs: its setup (transformers' "Writing model shards" bars, on when no `opd` ran before in
    # this process) is not read as the commands' output
    from opd.data.prompts import save_prompts

    data = save_prompts(make_prompts(12), tmp_path / "set.jsonl")
    out, log = tmp_path / "scores" / "scores.jsonl", tmp_path / "a.log"
    yaml_path = dump(score_config(model_dirs, data, out), tmp_path / "c.yaml")
    a = start(log, "prompts", "score", "--config", yaml_path)
    wait_for(a, lambda: out.is_file() and out.stat().st_size > 0, log, "the first scored batch")
    interrupt_with_a_second_process(capsys, out.parent, a, "prompts", "score", "--config", yaml_path)
    code, _, err = cli(capsys, "prompts", "score", "--config", yaml_path)
    assert code == 0, err
    ref = tmp_path / "ref" / "scores.jsonl"
    code, _, err = cli(
        capsys, "prompts", "score", "--config", dump(score_config(model_dirs, data, ref), tmp_path / "r.yaml")
    )
    assert code == 0, err
    assert read_jsonl(out) == read_jsonl(ref) and len(read_jsonl(out)) == 12


# ---------------------------------------------------------------- issue 22: what a resume restores is what runs


def _optimizer_groups(checkpoint: Path) -> list[dict]:
    state = torch.load(checkpoint / "trainer_state.pt", map_location="cpu", weights_only=False)
    return [{k: v for k, v in g.items() if k != "params"} for g in state["optimizer"]["param_groups"]]


def test_resume_with_a_changed_optimizer_runs_the_new_values(capsys, world, tmp_path):
    """--allow-config-change optim.lr=… (and weight decay, betas): config.yaml says it, so the optimizer runs it."""
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    changed = ("optim.lr=0.1", "optim.weight_decay=0.3", "optim.betas=[0.8,0.99]", "optim.eps=1e-6")
    yaml_path = dump(distill_config(world, tmp_path, *changed, steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    assert "optim.lr: 0.001 → 0.1" in out and "optim.weight_decay: 0.01 → 0.3" in out
    decay, no_decay = _optimizer_groups(run_dir / "checkpoints" / "step_2")
    assert decay["lr"] == decay["initial_lr"] == 0.1 and no_decay["lr"] == 0.1
    assert decay["weight_decay"] == 0.3 and no_decay["weight_decay"] == 0.0
    assert tuple(decay["betas"]) == (0.8, 0.99) and decay["eps"] == 1e-6
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-3, 0.1]


def test_sft_resume_with_a_changed_lr_runs_it(capsys, tmp_path, tiny_model_dir, sft_data):
    flat = ("optim.schedule=constant", "optim.warmup_ratio=0")
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s", *flat))
    yaml_path = dump(
        sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s", "optim.lr=0.5", *flat),
        tmp_path / "c.yaml",
    )
    code, _, err = cli(capsys, "sft", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0, err
    run_dir = tmp_path / "runs" / "s"
    assert [g["lr"] for g in _optimizer_groups(run_dir / "checkpoints" / "step_2")] == [0.5, 0.5]
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-5, 0.5]


def test_logged_lr_is_the_one_the_step_used(world, tmp_path):
    """With warmup the first step runs at lr/warmup: metrics.jsonl says so (not the next step's lr)."""
    run_dir = distill(distill_config(world, tmp_path, "optim.warmup_steps=4", steps=2))
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-3 / 4, 2e-3 / 4]


def test_sft_logged_lr_is_the_one_the_step_used(tmp_path, tiny_model_dir, sft_data):
    run_dir = sft(
        sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "optim.warmup_steps=2", "optim.schedule=constant")
    )
    assert [m["lr"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1e-5 / 2, 1e-5]


def test_resume_refuses_a_prompt_file_regenerated_in_place(capsys, world, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text((world / "prompts.jsonl").read_text())
    run_dir = distill(distill_config(world, tmp_path, f"data.path={data}", steps=1))
    metrics = (run_dir / "metrics.jsonl").read_text()
    rows = [{"prompt": f"{i}*{i}=", "answer": str(i * i)} for i in range(6)]  # the same row count
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml_path = dump(distill_config(world, tmp_path, f"data.path={data}", steps=2), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert str(data) in line and "changed" in line and "--allow-config-change" in line
    assert (run_dir / "metrics.jsonl").read_text() == metrics
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--allow-config-change")
    assert code == 0 and "continuing on the new data" in out, err


def test_sft_resume_refuses_changed_training_data(capsys, tmp_path, tiny_model_dir, sft_data):
    sft(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=1", "run.name=s"))
    rows = [{"messages": chat(q, a + "!")} for q, a in SFT_QA * 3]
    sft_data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    yaml_path = dump(sft_config(tmp_path, tiny_model_dir, sft_data, "run.steps=2", "run.name=s"), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "sft", "--config", yaml_path, "--resume")[::2])
    assert str(sft_data) in line and "changed" in line


@pytest.mark.parametrize("damage", ["remove_checkpoints", "corrupt_only_checkpoint"])
def test_resume_without_a_verifiable_checkpoint_is_an_error(capsys, world, tmp_path, damage):
    run_dir = distill(distill_config(world, tmp_path, "run.keep_last=1", steps=1))
    if damage == "remove_checkpoints":
        shutil.rmtree(run_dir / "checkpoints")
    else:
        (run_dir / "checkpoints" / "step_1" / "trainer_state.pt").write_bytes(b"damaged")
    before = snapshot(run_dir)
    yaml_path = dump(distill_config(world, tmp_path, "run.keep_last=1", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    line = [ln for ln in err.splitlines() if ln.strip()][-1]
    assert code == 2 and "Traceback" not in err and "no checkpoint that verifies" in line and str(run_dir) in line
    assert snapshot(run_dir) == before  # metrics.jsonl and samples/ untouched


def test_resume_of_a_run_not_started_yet_starts_it(capsys, world, tmp_path):
    yaml_path = dump(distill_config(world, tmp_path, steps=1), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0 and "holds no run yet" in out, err


def test_consecutive_skipped_steps_stop_the_run(capsys, world, tmp_path):
    """Every step skipped for a non-finite gradient norm: an error after optim.max_skipped_steps, not exit 0."""
    yaml_path = dump(
        distill_config(world, tmp_path, "optim.lr=1e30", "optim.max_skipped_steps=2", steps=6), tmp_path / "c.yaml"
    )
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--skip-check", "all")
    line = one_line(code, err)
    assert "consecutive steps skipped" in line and "optim.max_skipped_steps=2" in line


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


def test_settings_that_do_not_change_the_math_are_resumable(capsys, world, tmp_path):
    distill(distill_config(world, tmp_path, steps=1))
    yaml_path = dump(distill_config(world, tmp_path, "skip_checks=[forecast]", steps=2), tmp_path / "c.yaml")
    code, _, err = cli(capsys, "distill", "--config", yaml_path, "--resume", "--skip-check", "forecast")
    assert code == 0, err
