"""Every benchmark script runs on CPU with the tiny shape, in-process, and produces its table and JSON with both our
row and the alternative's (no timing assertions: CPU timings of tiny models say nothing). The rows that compare the
two paths' results (`max_err`, `loss_err`, `grad_err`, `lp_err`) must agree to float32 rounding."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, tmp_path, capsys, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    data = load(name).main(["--shape", "tiny", "--device", "cpu", "--repeat", "1", "--out", str(out), *args])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(data, default=str))
    assert data["table"] in printed
    return data, printed


def rows(data: dict) -> dict[str, dict]:
    by_name = {r["name"]: r for r in data["rows"]}
    for name, row in by_name.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0
    return by_name


@pytest.mark.slow
def test_rollout(tmp_path, capsys):
    data, _ = run("rollout", tmp_path, capsys, "--batches", "3,5", "--prompt-len", "5", "--new-tokens", "6",
                  "--engines", "hf_generate,torch_engine,static_engine", "--engines-big", "static_engine")
    got = rows(data)
    assert set(got) == {"hf_generate@3", "torch_engine@3", "static_engine@3", "static_engine@5"}
    assert got["hf_generate@3"]["tokens"] == got["static_engine@3"]["tokens"] == 3 * 6
    assert got["static_engine@3"]["speedup"] > 0 and got["static_engine@5"]["tokens"] == 5 * 6
    assert got["torch_engine@3"]["lp_err"] < 1e-4 and got["static_engine@3"]["lp_err"] < 1e-4


@pytest.mark.slow
def test_rollout_ragged_lengths_against_equal_lengths(tmp_path, capsys):
    """--lengths: every engine produces each row's drawn length exactly (generate() through its forced-EOS logits
    processor, ours through per-sample limits), and the [equal] row the same total at the mean length; the fp32
    drift table has one line per position bucket of each of our rows."""
    data, printed = run("rollout", tmp_path, capsys, "--batches", "4", "--prompt-len", "5",
                        "--lengths", "lognormal:mean=6,cap=14,sigma=0.8", "--engines", "hf_generate,static_engine",
                        "--lp-reference", "fp32")
    got = rows(data)
    assert set(got) == {f"{e}@4[{k}]" for e in ("hf_generate", "static_engine") for k in ("ragged", "equal")}
    lengths = load("rollout").draw_lengths("lognormal:mean=6,cap=14,sigma=0.8", 4, 512, 0)
    assert len(set(lengths)) > 1 and max(lengths) <= 14
    for engine in ("hf_generate", "static_engine"):
        ragged, equal = got[f"{engine}@4[ragged]"], got[f"{engine}@4[equal]"]
        assert ragged["tokens"] == sum(lengths) and ragged["max_len"] == max(lengths)
        assert equal["tokens"] == 4 * round(sum(lengths) / 4) and ragged["vs_equal"] > 0
    assert got["static_engine@4[ragged]"]["lp_err"] < 1e-4 and "engine vs fp32" in printed
    assert [b["positions"] for b in got["static_engine@4[ragged]"]["lp_drift"]] == ["[0, 128)"]


def test_teacher_score(tmp_path, capsys):
    data, _ = run("teacher_score", tmp_path, capsys, "--batch", "2", "--prompt-len", "4", "--response-len", "6")
    got = rows(data)
    assert set(got) == {"local_scorer[tiny]", "naive_full_logits[tiny]"}
    assert got["naive_full_logits[tiny]"]["max_err"] < 1e-4
    assert got["naive_full_logits[tiny]"]["topk_agree"] > 0.99


def test_teacher_score_ragged_rows_padded_and_packed(tmp_path, capsys):
    """Right-padded rows of different lengths: the padded sdpa row and the packed flex row (rows concatenated into one
    sequence) score the real positions as the naive path does, and tokens/s counts real tokens only."""
    data, printed = run("teacher_score", tmp_path, capsys, "--batch", "3", "--prompt-len", "4", "--response-len", "12",
                        "--ragged", "--attn", "sdpa,flex_attention")
    got = rows(data)
    assert set(got) == {"local_scorer[tiny]", "local_scorer[tiny, flex_attention]", "naive_full_logits[tiny]"}
    assert got["naive_full_logits[tiny]"]["max_err"] < 1e-4  # against the packed row, the last of ours
    assert got["local_scorer[tiny]"]["tokens"] < 3 * (4 + 12) and "ragged" in printed


def test_update(tmp_path, capsys):
    data, _ = run("update", tmp_path, capsys, "--batch", "2", "--prompt-len", "4", "--response-len", "6",
                  "--ckpt", "on,off")
    got = rows(data)
    assert set(got) == {f"{n}[ckpt {c}]" for n in ("chunked_candidates", "naive_full_logits") for c in ("on", "off")}
    for ckpt in ("on", "off"):
        naive = got[f"naive_full_logits[ckpt {ckpt}]"]
        assert naive["loss_err"] < 1e-5 and naive["grad_err"] < 1e-4


def test_update_ragged_rows(tmp_path, capsys):
    data, _ = run("update", tmp_path, capsys, "--batch", "3", "--prompt-len", "4", "--response-len", "12", "--ragged",
                  "--ckpt", "off")
    got = rows(data)
    naive = got["naive_full_logits[ckpt off]"]
    assert naive["loss_err"] < 1e-5 and naive["grad_err"] < 1e-4
    assert got["chunked_candidates[ckpt off]"]["tokens"] < 3 * (4 + 12)


@pytest.mark.slow
def test_opd_step(tmp_path, capsys):
    data, _ = run("opd_step", tmp_path, capsys, "--teacher-shape", "tiny", "--prompts", "2", "--n", "2",
                  "--prompt-len", "5", "--new-tokens", "6", "--engines", "torch_engine,static_engine")
    got = rows(data)
    assert set(got) == {"trl_gkd_recreated", "opd_step[torch_engine]", "opd_step[static_engine]"}
    for name in ("opd_step[torch_engine]", "opd_step[static_engine]"):
        assert {"rollout_s", "student_s", "teacher_s", "update_s", "memory_vs_trl", "speedup"} <= set(got[name])
