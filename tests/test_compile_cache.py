"""The compile cache: where it lives, what its key holds, and (slow: inductor on CPU, in fresh processes) that a second
process with the same key loads its graphs from it while a changed key compiles them again. Hits and misses are
torch's counters, never times."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import distill_config, string_console, subprocess_env
from opd import compile_cache
from opd.compile_cache import cache_root, compile_key, persisted
from opd.io import read_jsonl
from opd.models import compile_layers
from opd.recipes.distill import setup, train
from opd.train.compiles import warm_up_cache_parts

# One compiled function, run inside `persisted` in a process of its own; prints the report's counters as JSON.
PROBE = """
import json, sys, torch
from pathlib import Path
from opd.compile_cache import persisted

def body(x, w):
    return torch.nn.functional.silu(x @ w) * x.sum(-1, keepdim=True)

parts = json.loads(sys.argv[2])
dtype = getattr(torch, parts["dtype"])
with persisted(parts, root=Path(sys.argv[1])) as report:
    x, w = torch.randn(4, 8, dtype=dtype), torch.randn(8, 8, dtype=dtype)
    torch.compile(body, dynamic=False)(x, w)
names = ("key", "loaded", "saved", "graphs", "fx_hits", "fx_misses", "dynamo_seconds", "backend_seconds")
print(json.dumps({name: getattr(report, name) for name in names}))
"""


def _probe(root: Path, inductor_dir: Path, **parts) -> dict:
    """Run PROBE in a fresh process whose torch caches start empty (its own TORCHINDUCTOR_CACHE_DIR): a hit can only
    come from the opd cache under root."""
    env = {**subprocess_env(), "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir), "TRITON_CACHE_DIR": str(inductor_dir)}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(root), json.dumps(parts)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_process_loads_the_graphs_and_a_changed_key_compiles_them_again(tmp_path):
    root = tmp_path / "opd-compile"
    cold = _probe(root, tmp_path / "inductor-1", dtype="float32", code="a")
    assert cold["graphs"] == 1 and cold["fx_misses"] >= 1 and cold["fx_hits"] == 0 and cold["saved"] >= 1
    assert 0 < cold["backend_seconds"] <= cold["dynamo_seconds"]  # the split of the warm-up's seconds
    assert (root / cold["key"] / "key.json").exists() and list((root / cold["key"]).glob("artifacts-*.bin"))

    warm = _probe(root, tmp_path / "inductor-2", dtype="float32", code="a")
    assert warm["key"] == cold["key"] and warm["loaded"] >= 1
    assert warm["fx_hits"] >= 1 and warm["fx_misses"] == 0 and warm["saved"] == 0  # nothing new: no second file
    assert len(list((root / cold["key"]).glob("artifacts-*.bin"))) == 1

    for changed in ({"dtype": "float32", "code": "b"}, {"dtype": "float64", "code": "a"}):  # same graph / new dtype
        other = _probe(root, tmp_path / f"inductor-{changed['code']}-{changed['dtype']}", **changed)
        assert other["key"] != cold["key"] and other["loaded"] == 0
        assert other["fx_misses"] >= 1 and other["fx_hits"] == 0


def test_the_cache_root_follows_the_override_xdg_and_the_off_switch(monkeypatch, tmp_path):
    monkeypatch.delenv("OPD_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "opd" / "compile"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "opd" / "compile"
    monkeypatch.setenv("OPD_COMPILE_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    for off in ("off", "0", "False", "none"):
        monkeypatch.setenv("OPD_COMPILE_CACHE", off)
        assert cache_root() is None


def test_the_key_changes_with_every_part_and_the_environment(monkeypatch):
    parts = {"student": {"hidden_size": 64}, "dtype": "torch.bfloat16", "rows": [8, 4]}
    key, full = compile_key(parts, torch.device("cpu"))
    assert compile_key(dict(parts), torch.device("cpu"))[0] == key  # deterministic
    assert full["environment"]["torch"] == torch.__version__ and full["environment"]["device"] == "cpu"
    for changed in ({"dtype": "torch.float32"}, {"rows": [8]}, {"student": {"hidden_size": 128}}):
        assert compile_key({**parts, **changed}, torch.device("cpu"))[0] != key
    monkeypatch.setattr(compile_cache, "opd_source_digest", lambda: "another version of the code")
    assert compile_key(parts, torch.device("cpu"))[0] != key


def test_off_switch_loads_and_saves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("OPD_COMPILE_CACHE", "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with persisted({"a": 1}) as report:
        pass
    assert report.path is None and report.key is None and report.loaded == report.saved == 0
    assert "off" in report.describe() and not any(tmp_path.iterdir())


def test_an_unwritable_cache_costs_the_speed_not_the_run(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with persisted({"a": 1}, root=blocked) as report:
        pass
    assert report.path is None and report.error is not None and "not read" in report.describe()


def test_a_save_writes_through_a_temporary_name_keeps_the_key_beside_and_replaces_what_it_holds(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (b"artefacts", _Info()))
    _, full = compile_key({"a": 1})
    older = tmp_path / "artifacts-1-1.bin"
    older.write_bytes(b"old")
    assert compile_cache._save(tmp_path, full, {older: frozenset({("inductor", "k1")})}) == 2
    names = sorted(path.name for path in tmp_path.iterdir())
    assert names[0] == ".lock" and names[1].startswith("artifacts-") and names[2] == "key.json" and len(names) == 3
    assert json.loads((tmp_path / "key.json").read_text())["parts"] == {"a": 1}
    assert (tmp_path / names[1]).read_bytes() == b"artefacts"  # the older file, held in the new one, is gone
    assert compile_cache._save(tmp_path, full, {tmp_path / names[1]: compile_cache._keys(_Info())}) == 0  # no news


class _Info:
    artifacts = {"inductor": ["k1"], "aot_autograd": ["k2"]}


@pytest.mark.slow
def test_a_compiled_run_logs_its_warm_up_and_the_cache_once(world, tmp_path, monkeypatch):
    """`opd distill`'s warm-up runs inside the cache: its seconds and hits are on the first step's line only, and the
    console names the cache (the layers compile with aot_eager here: nothing for inductor's caches, no file)."""
    monkeypatch.setenv("OPD_COMPILE_CACHE", str(tmp_path / "cache"))
    torch._dynamo.reset()
    cfg = distill_config(world, tmp_path, "prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=6", steps=2)
    tr = setup(cfg, tmp_path / "run", console=string_console())
    compile_layers(tr.models.student, True, backend="aot_eager")
    tr.models.compiled_layers = True
    console = string_console()
    train(tr, console=console)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert rows[0]["compile/warm_up_graphs"] > 0 and rows[0]["compile/warm_up_s"] > 0
    assert rows[0]["compile/cache_hits"] == rows[0]["compile/cache_misses"] == 0  # aot_eager: inductor never ran
    assert not any(key.startswith("compile/warm_up") for key in rows[1])
    text = " ".join(console.file.getvalue().split())
    assert f"compile cache {tmp_path / 'cache'}" in text, text[-2000:]


def test_a_resume_has_the_key_of_the_run_it_resumes(world, tmp_path):
    """The key's parts name the student's architecture, not the path it was loaded from: a run started from a copy of
    the model (as a resume loads its checkpoint) has the same key, so its warm-up loads the first run's graphs."""
    import shutil

    shutil.copytree(world / "student", tmp_path / "checkpoint")
    keys = []
    for name, student in (("a", world / "student"), ("b", tmp_path / "checkpoint")):
        cfg = distill_config(world, tmp_path / name, f"student.path={student}")
        keys.append(compile_key(warm_up_cache_parts(setup(cfg, tmp_path / name / "run", console=string_console())))[0])
    assert keys[0] == keys[1]
    other = distill_config(world, tmp_path / "c", "rollout.max_new_tokens=7")
    assert (
        compile_key(warm_up_cache_parts(setup(other, tmp_path / "c" / "run", console=string_console())))[0] != keys[0]
    )
