"""The output-path checks of `opd.rundir`: `claim_output_files` refuses, before anything is written, an output that is
an input, an existing file (without --overwrite), and two outputs that are one file."""

import pytest

from opd.rundir import claim_output_files


@pytest.mark.parametrize("spelling", ["{p}", "{d}/./kept.jsonl", "{d}/sub/../kept.jsonl", "{link}"])
def test_two_outputs_that_are_one_file_are_refused_before_anything_is_written(tmp_path, spelling):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "kept.jsonl"
    (tmp_path / "link.jsonl").symlink_to(path)
    other = spelling.format(p=path, d=tmp_path, link=tmp_path / "link.jsonl")
    with pytest.raises(ValueError, match="--report .* is the --out file too; one file cannot hold both") as error:
        claim_output_files({"--out": path, "--report": other}, {"--in": tmp_path / "in.jsonl"}, overwrite=True)
    assert "\n" not in str(error.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "sub"]  # nothing written, nothing moved


def test_an_existing_output_is_moved_aside_with_overwrite_only(tmp_path):
    out, report = tmp_path / "kept.jsonl", tmp_path / "kept.report.json"
    out.write_text("earlier\n")
    with pytest.raises(ValueError, match="the file exists"):
        claim_output_files({"--out": out, "--report": report}, {}, overwrite=False)
    assert out.read_text() == "earlier\n"
    claim_output_files({"--out": out, "--report": report}, {}, overwrite=True)
    assert not out.exists() and [p.read_text() for p in tmp_path.glob("kept.jsonl.old-*")] == ["earlier\n"]
