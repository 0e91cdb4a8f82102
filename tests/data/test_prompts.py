"""Prompt loading (opd.data.prompts) and the shipped benchmarks (opd.eval.benchmarks). Offline; the shared data sets
are skipped when absent. Instruction templates and chat rendering: test_templates.py."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers_data import MESSAGES, needs_shared, one_line_error, shared
from opd.data.prompts import ROW_ID, DataError, load_prompts, save_prompts
from opd.data.templates import DAPO_PREFIX
from opd.eval.benchmarks import BENCHMARKS, benchmark_path, get_benchmark, list_benchmarks, load_benchmark
from opd.types import Prompt

# file, rows, start of the first prompt, ground truth of the first row
SHARED_FILES = [
    ("benchmarks/AIME24.parquet", 30, "Every morning Aya goes for a $9$-kilometer-long walk", "\\boxed{204}"),
    ("benchmarks/AIME25.parquet", 30, "Find the sum of all integer bases $b>9$", "70"),
    ("benchmarks/AMC23.parquet", 40, "Cities $A$ and $B$ are $45$ miles apart.", "27"),
    (
        "benchmarks/MATH-500.parquet",
        500,
        "Convert the point $(0,3)$ in rectangular coordinates",
        "\\left( 3, \\frac{\\pi}{2} \\right)",
    ),
    ("benchmarks/Minerva.parquet", 272, "Each of the two Magellan telescopes has a diameter", "1.6"),
    ("benchmarks/Olympiad-Bench.parquet", 674, "Xenia and Sergey play the following game.", "2"),
    ("train/dapo-math-17k.parquet", 17917, DAPO_PREFIX + "In triangle $ABC$, $\\sin \\angle A", "34"),
    ("train/deepmath-deduped.parquet", 14116, "Find \\( \\frac{dy}{dx} \\) at the point \\((0,1)\\)", "8"),
]


def verl_rows(n: int = 3) -> list[dict]:
    return [
        {
            "data_source": "toy",
            "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
            "ability": "math",
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra_info": {"index": f"toy-{i}", "split": "train"},
        }
        for i in range(n)
    ]


@needs_shared
@pytest.mark.parametrize("name,rows,start,answer", SHARED_FILES, ids=[f[0].split("/")[1] for f in SHARED_FILES])
def test_shared_files_load(name, rows, start, answer):
    prompts = shared(name)
    assert len(prompts) == rows
    assert prompts[0].text.startswith(start)
    assert prompts[0].answer == answer
    assert prompts[0].messages[-1]["role"] == "user"
    assert len({p.id for p in prompts}) == rows
    assert all(p.answer is not None for p in prompts)


@needs_shared
def test_shared_ids_and_sources():
    aime = shared("benchmarks/AIME24.parquet")
    assert (aime[0].id, aime[0].source, aime[0].meta["extra_info"]) == ("AIME24-0", "AIME24", {"split": "test"})
    deepmath = shared("train/deepmath-deduped.parquet")
    assert deepmath[0].id == "27136" and deepmath[0].source == "DeepMath-103K"
    assert "__index_level_0__" not in deepmath[0].meta  # pandas index artefact dropped


@needs_shared
@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_shipped_benchmark_matches_shared(name):
    shipped = load_benchmark(name)
    assert len(shipped) == BENCHMARKS[name].rows
    assert shipped == shared(f"benchmarks/{BENCHMARKS[name].file}")


def test_benchmark_names_and_stems():
    assert list_benchmarks() == ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]
    assert len(load_benchmark("MATH-500", limit=5)) == 5
    assert len(load_benchmark("Olympiad-Bench", limit=2)) == 2
    assert load_benchmark("AIME24")[0].answer == "\\boxed{204}"  # kept as released; the grader unwraps it
    assert benchmark_path("aime25").is_file()


def test_two_spellings_of_one_registry_benchmark_are_refused():
    """benchmark_names reads names as the registry does: each benchmark's name and file stem are one benchmark."""
    from opd.names import benchmark_names

    for name, bench in BENCHMARKS.items():
        spelling = Path(bench.file).stem  # MATH-500, Olympiad-Bench, AIME24, ...
        assert get_benchmark(spelling) is bench
        with pytest.raises(ValueError, match=rf"^'{name}' and '{spelling}' name one benchmark .*; list it once$"):
            benchmark_names([name, "aime25" if name != "aime25" else "aime24", spelling])
    assert benchmark_names(["math500", "AIME24", "aime25"]) == ["math500", "AIME24", "aime25"]


def test_unknown_benchmark():
    with pytest.raises(DataError) as e:
        load_benchmark("aime2")
    one_line_error(
        e, "unknown benchmark 'aime2'", "aime24, aime25, amc23, math500, minerva, olympiadbench", "did you mean aime25"
    )


def test_benchmark_path_goes_through_load_prompts(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"problem": "2+2?", "answer": 4}) + "\n")
    prompts = load_benchmark(path, prompt_key="problem", answer_key="answer")
    assert (prompts[0].text, prompts[0].answer) == ("2+2?", "4")


def test_json_string_prompt_column(tmp_path):
    rows = verl_rows()
    for row in rows:
        row["prompt"] = json.dumps(row["prompt"])
        row["reward_model"] = json.dumps(row["reward_model"])  # a dotted key reaches into a JSON string too
    path = tmp_path / "s.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    prompts = load_prompts(path)
    assert prompts[1].messages == [{"role": "user", "content": "What is 1+1?"}]
    assert (prompts[1].answer, prompts[1].id, prompts[1].source) == ("2", "toy-1", "toy")
    assert prompts[1].meta["reward_model"] == {"style": "rule"}  # decoded, the consumed field removed
    assert load_prompts(save_prompts(prompts, tmp_path / "back.parquet")) == prompts


def test_jsonl_messages_and_plain_text(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in verl_rows()) + "\n\n")
    assert load_prompts(path) == load_prompts_from_rows(tmp_path, verl_rows())

    plain = tmp_path / "plain.jsonl"
    plain.write_text("\n".join(json.dumps({"prompt": t, "answer": a}) for t, a in [("[1] Hi?", 1), ("Bye?", 2)]))
    prompts = load_prompts(plain, answer_key="answer")
    assert prompts[0].messages == [{"role": "user", "content": "[1] Hi?"}]  # "[..." that is not JSON stays text
    assert [(p.id, p.answer, p.source) for p in prompts] == [("0", "1", "plain"), ("1", "2", "plain")]


def load_prompts_from_rows(tmp_path: Path, rows: list[dict]) -> list[Prompt]:
    path = tmp_path / "ref.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    return load_prompts(path)


def test_json_list_and_json_lines_named_json(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text(json.dumps(verl_rows()))
    lines = tmp_path / "lines.json"  # what `Dataset.to_json` writes
    lines.write_text("\n".join(json.dumps(r) for r in verl_rows()))
    assert load_prompts(listed) == load_prompts(lines) == load_prompts_from_rows(tmp_path, verl_rows())


def test_column_mapping_system_key_and_limit(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"uid": f"u{i}", "problem": f"P{i}", "answer": [f"{i}"], "sys": "Be brief.", "level": i} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    prompts = load_prompts(path, prompt_key="problem", answer_key="answer", id_key="uid", system_key="sys", limit=3)
    assert len(prompts) == 3
    assert prompts[2].messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "P2"}]
    assert (prompts[2].id, prompts[2].answer, prompts[2].meta) == ("u2", "2", {"level": 2})
    assert load_prompts(path, prompt_key="problem", answer_key=None, id_key=ROW_ID)[4].id == "4"


def test_save_to_disk_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list([{"problem": f"P{i}", "answer": str(i)} for i in range(4)])
    ds.save_to_disk(str(tmp_path / "single"))
    prompts = load_prompts(tmp_path / "single", prompt_key="problem", answer_key="answer")
    assert [(p.text, p.answer, p.id) for p in prompts][:2] == [("P0", "0", "0"), ("P1", "1", "1")]

    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dict"))
    assert len(load_prompts(tmp_path / "dict", prompt_key="problem", answer_key="answer", split="test")) == 4
    with pytest.raises(DataError) as e:
        load_prompts(tmp_path / "dict", prompt_key="problem", answer_key="answer", split="train")
    one_line_error(e, "no split 'train'", "available splits: test")


def test_hub_id_without_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets → ImportError
    with pytest.raises(DataError) as e:
        load_prompts("someone/some-set")
    one_line_error(e, "pip install datasets")


@pytest.mark.parametrize("suffix", [".parquet", ".jsonl"])
def test_save_prompts_round_trip(tmp_path, suffix):
    prompts = load_prompts_from_rows(tmp_path, verl_rows())
    prompts.append(Prompt("odd", [{"role": "system", "content": "S"}, *MESSAGES], None, "other", {"tag": 1}))
    path = save_prompts(prompts, tmp_path / "out" / f"set{suffix}")
    assert load_prompts(path, on_missing_answer="keep") == prompts  # "odd" has no answer (default: an error)
    assert not [p for p in path.parent.iterdir() if p.name != path.name]  # no temp file left behind
    if suffix == ".parquet":
        row = pq.read_table(path).slice(0, 1).to_pylist()[0]
        assert row["reward_model"] == {"ground_truth": "0", "style": "rule"}
        assert pq.read_table(path).column("reward_model").type.names == ["ground_truth", "style"]
        assert row["extra_info"] == {"index": "toy-0", "split": "train"}


@needs_shared
def test_save_prompts_round_trip_real(tmp_path):
    prompts = shared("benchmarks/MATH-500.parquet")
    assert load_prompts(save_prompts(prompts, tmp_path / "m.parquet")) == prompts


def test_missing_column_names_it_and_suggests(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"problem": "x", "answer": "1"}) + "\n")
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problme", answer_key="answer")
    one_line_error(e, str(path), "'problme'", "available: problem, answer", "prompt_key='problem'")
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem")  # default answer_key absent
    one_line_error(e, "'reward_model.ground_truth'", "answer_key=None")


def test_unreadable_and_unknown_files(tmp_path):
    corrupt = tmp_path / "bad.parquet"
    corrupt.write_bytes(b"not a parquet file at all")
    with pytest.raises(DataError) as e:
        load_prompts(corrupt)
    one_line_error(e, str(corrupt), "cannot read it as parquet")
    broken = tmp_path / "bad.jsonl"
    broken.write_text('{"prompt": "ok"}\n{"prompt": \n')
    with pytest.raises(DataError) as e:
        load_prompts(broken, answer_key=None)
    one_line_error(e, "line 2 is not JSON")
    odd = tmp_path / "x.txt"
    odd.write_text("hello")
    with pytest.raises(DataError) as e:
        load_prompts(odd)
    one_line_error(e, "unknown file type '.txt'", ".parquet, .jsonl")
    with pytest.raises(DataError) as e:
        load_prompts(tmp_path / "missing.parquet")
    one_line_error(e, "no such file")
    with pytest.raises(DataError) as e:
        load_prompts(tmp_path)
    one_line_error(e, "not a `datasets` save_to_disk output")


def test_empty_set(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError) as e:
        load_prompts(empty)
    one_line_error(e, str(empty), "empty")
    with pytest.raises(DataError):
        save_prompts([], tmp_path / "e.parquet")


def test_bad_rows(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "fine", "id": 1}, {"prompt": 7, "id": 2}]))
    with pytest.raises(DataError) as e:
        load_prompts(path, answer_key=None)
    one_line_error(e, "row 1", "'prompt'", "7", "expected a string or a non-empty list")
    path.write_text("\n".join(json.dumps(r) for r in [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 1}]))
    with pytest.raises(DataError) as e:
        load_prompts(path, answer_key=None)
    one_line_error(e, "id '1' of row 1", "repeats row 0", "id_key='#row'")


def _rows(path, answers):
    path.write_text("\n".join(json.dumps({"problem": f"P{i}", "answer": a}) for i, a in enumerate(answers)) + "\n")
    return path


@pytest.mark.parametrize(
    "missing, written",
    [
        (None, "null"),
        ("", "an empty string"),
        ("   ", "an empty string"),
        ([], "[] (no non-empty entry)"),
        ([None, ""], "[None, ''] (no"),
    ],
)
def test_missing_answer_is_an_error_naming_file_row_and_column(tmp_path, missing, written):
    path = _rows(tmp_path / "p.jsonl", ["1", missing, "3"])
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem", answer_key="answer")
    one_line_error(e, str(path), "row 1 (id '1')", "field 'answer'", written, "on_missing_answer=skip")


def test_missing_answer_skip_and_keep(tmp_path, caplog):
    path = tmp_path / "p.jsonl"
    path.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"problem": "P0", "answer": "1"},
                {"problem": "P1"},
                {"problem": "P2", "answer": None},
                {"problem": "P3", "answer": 4},
                {"problem": "P4", "answer": float("nan")},
            ]
        )
        + "\n"
    )
    with caplog.at_level("WARNING", logger="opd.data.prompts"):
        prompts = load_prompts(path, prompt_key="problem", answer_key="answer", on_missing_answer="skip")
    assert [(p.id, p.answer) for p in prompts] == [("0", "1"), ("3", "4")]
    assert "skipped 3 of 5 rows without a ground truth" in caplog.text and "first: row 1" in caplog.text
    kept = load_prompts(path, prompt_key="problem", answer_key="answer", on_missing_answer="keep")
    assert [p.answer for p in kept] == ["1", None, None, "4", None]
    with pytest.raises(DataError) as e:
        load_prompts(
            _rows(tmp_path / "none.jsonl", [None, ""]),
            prompt_key="problem",
            answer_key="answer",
            on_missing_answer="skip",
        )
    one_line_error(e, "every row's 'answer' is empty")
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem", answer_key="answer", on_missing_answer="drop")
    one_line_error(e, "on_missing_answer must be one of error, skip, keep", "'drop'")


def test_list_answer_stays_a_list_and_grades_as_any_of(tmp_path):
    from opd.eval.grading import grade

    path = _rows(tmp_path / "p.jsonl", [["1", "2"], [3], ["x", None, 5], "4"])
    prompts = load_prompts(path, prompt_key="problem", answer_key="answer")
    assert [p.answer for p in prompts] == [["1", "2"], "3", ["x", "5"], "4"]  # not the string "['1', '2']"
    assert grade("so \\boxed{2}", prompts[0].answer).correct and not grade("\\boxed{3}", prompts[0].answer).correct
    # saved and loaded back unchanged (a column of strings and lists is written as lists)
    for suffix in (".parquet", ".jsonl"):
        again = load_prompts(save_prompts(prompts, tmp_path / f"saved{suffix}"))
        assert [p.answer for p in again] == [p.answer for p in prompts]


@pytest.mark.parametrize("value", [True, False, {"a": 1}, [["1"]], [True]])
def test_bool_and_nested_answers_are_refused(tmp_path, value):
    path = _rows(tmp_path / "p.jsonl", ["1", value])
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem", answer_key="answer")
    one_line_error(e, str(path), "row 1", "field 'answer'", "expected a string, a number or a list of them")


def test_duplicate_ids_name_both_answers(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [{"id": "a", "problem": "P", "answer": "1"}, {"id": "a", "problem": "P", "answer": "2"}]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem", answer_key="answer")
    one_line_error(e, "id 'a' of row 1", "repeats row 0", "answer '1' there, '2' here", "ids must be unique")
    rows[1]["answer"] = "1"  # the same answer: still two rows under one id, refused (which one would be meant?)
    path.write_text("\n".join(json.dumps(r) for r in rows))
    with pytest.raises(DataError) as e:
        load_prompts(path, prompt_key="problem", answer_key="answer")
    one_line_error(e, "repeats row 0 (the same answer)")


def test_benchmark_loader_passes_the_missing_answer_option(tmp_path):
    path = _rows(tmp_path / "b.jsonl", ["1", None])
    with pytest.raises(DataError):
        load_benchmark(path, prompt_key="problem", answer_key="answer")
    assert len(load_benchmark(path, prompt_key="problem", answer_key="answer", on_missing_answer="skip")) == 1
    assert all(p.answer for name in BENCHMARKS for p in load_benchmark(name))  # every shipped answer is present
