"""What `--resume` reads back from a run directory, damaged: a checkpoint's MANIFEST.json of the wrong shape is an
unverifiable checkpoint (skipped, never a traceback), a config.yaml that does not parse or is not a mapping is one
line naming it. The same readers (`opd.io`) serve `opd report` (tests/report/test_report.py)."""

from __future__ import annotations

import pytest

from helpers import cli, distill_config, dump, one_line
from opd.recipes.distill import distill


@pytest.mark.parametrize(
    "manifest",
    ['{"files": [1, 2]}', '{"files": {"model.safetensors": 5}}', '{"files": {"x": {"bytes": "many"}}}', "[]"],
    ids=["files a list", "entry a number", "bytes a string", "a list"],
)
def test_resume_past_a_manifest_of_the_wrong_shape(capsys, world, tmp_path, manifest, monkeypatch):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    run_dir = distill(distill_config(world, tmp_path, "run.save_every=1", steps=2))
    (run_dir / "checkpoints" / "step_2" / "MANIFEST.json").write_text(manifest)
    yaml_path = dump(distill_config(world, tmp_path, "run.save_every=1", steps=2), tmp_path / "c.yaml")
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume")
    assert code == 0 and "Traceback" not in err, err
    assert "step_2 is incomplete or corrupt" in out and "step_1" in out


@pytest.mark.parametrize("content", ["run: [1, 2\n", "- 1\n- 2\n"], ids=["unparsable", "a list"])
def test_resume_with_a_damaged_config_yaml_is_one_line(capsys, world, tmp_path, content, monkeypatch):
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    run_dir = distill(distill_config(world, tmp_path, steps=1))
    (run_dir / "config.yaml").write_text(content)
    yaml_path = dump(distill_config(world, tmp_path, steps=2), tmp_path / "c.yaml")
    line = one_line(*cli(capsys, "distill", "--config", yaml_path, "--resume")[::2])
    assert str(run_dir / "config.yaml") in line


class _RunsCode:
    """An object whose unpickling would run code (touch a file): what a hostile trainer_state.pt could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import pathlib

        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def test_a_trainer_state_that_would_run_code_is_refused_without_running_it(tmp_path):
    """trainer_state.pt loads with weights_only (tensors, containers, numpy's RNG state): a pickled callable is a
    one-line error naming the file, and the callable never runs."""
    import torch

    from opd.train.checkpoint import load_trainer_state

    checkpoint = tmp_path / "checkpoints" / "step_2"
    checkpoint.mkdir(parents=True)
    marker = tmp_path / "ran"
    state = {"step": 2, "rng": {}, "optimizer": {}, "scheduler": {}, "sampler": {}, "x": _RunsCode(marker)}
    torch.save(state, checkpoint / "trainer_state.pt")
    with pytest.raises(ValueError, match=r"trainer_state.pt: not loadable") as error:
        load_trainer_state(checkpoint)
    assert "\n" not in str(error.value) and not marker.exists()
