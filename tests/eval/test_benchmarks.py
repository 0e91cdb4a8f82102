"""A benchmark entry written as a path is that path (`opd.eval.benchmarks.load_benchmark`), never the built-in of the
same name; a missing one is an error naming it; a name and the path of the same shipped file are one benchmark
(`opd.names.benchmark_names`)."""

import pytest

from opd.data.prompts import DataError
from opd.eval.benchmarks import benchmark_path, load_benchmark
from opd.names import benchmark_names


@pytest.fixture
def user_math500(tmp_path, monkeypatch):
    """A folder `math500` in the working directory: the user's own one-problem set (a `datasets` save_to_disk)."""
    datasets = pytest.importorskip("datasets")
    monkeypatch.chdir(tmp_path)
    rows = [{"prompt": "What is 1 + 1?", "reward_model": {"ground_truth": "2"}}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "math500"))
    return tmp_path / "math500"


@pytest.mark.parametrize("spelling", ["./math500", "math500/", "{abs}"])
def test_a_path_that_looks_like_a_path_is_the_users_folder(user_math500, spelling):
    prompts = load_benchmark(spelling.format(abs=user_math500))
    assert [p.answer for p in prompts] == ["2"]


def test_a_bare_name_stays_the_built_in_one(user_math500):
    assert len(load_benchmark("math500")) == 500


@pytest.mark.parametrize("spelling", ["./aime24", "../aime24", "~/no-such-dir-for-opd/aime24", "sets/aime24.jsonl"])
def test_a_missing_path_is_an_error_naming_it_never_the_built_in(tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=f"benchmark '{spelling}': no such file or folder") as error:
        load_benchmark(spelling)
    assert "\n" not in str(error.value)


def test_a_name_and_the_path_of_its_shipped_file_are_one_benchmark():
    shipped = str(benchmark_path("math500"))
    with pytest.raises(ValueError, match="name one benchmark"):
        benchmark_names(["math500", shipped])
    with pytest.raises(ValueError, match="name one benchmark"):
        benchmark_names([shipped, "MATH-500"])
    assert benchmark_names(["./math500", "aime24"]) == ["math500", "aime24"]
