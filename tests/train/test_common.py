"""`run.deterministic` (`opd.train.common.deterministic_kernels`): what it switches on, and that it leaves the process
as it found it. The runs themselves: recipes/test_distill (a resume under it) and features/bad_inputs (a refused
cuBLAS setting); on a GPU, benchmarks/check_cuda.py's `deterministic` check."""

import os
import re

import pytest
import torch

from opd.train.common import check_run_trained, deterministic_kernels


def test_inside_deterministic_outside_as_before(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    torch.use_deterministic_algorithms(True, warn_only=True)  # a caller's own setting, restored whole
    try:
        with deterministic_kernels(True):
            assert torch.are_deterministic_algorithms_enabled()
            assert not torch.is_deterministic_algorithms_warn_only_enabled()  # errors, never silent variation
            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert torch.is_deterministic_algorithms_warn_only_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    finally:
        torch.use_deterministic_algorithms(False)
    with pytest.raises(KeyboardInterrupt), deterministic_kernels(True):
        raise KeyboardInterrupt
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with deterministic_kernels(False):
        assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


@pytest.mark.parametrize("workspace", [":16:8", ":4096:8"])
def test_a_deterministic_cublas_setting_of_the_caller_is_kept(workspace, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", workspace)
    with deterministic_kernels(True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == workspace
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == workspace
    assert not torch.are_deterministic_algorithms_enabled()


def test_another_cublas_setting_is_refused_before_anything_changes(monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2")
    with pytest.raises(ValueError, match=r"CUBLAS_WORKSPACE_CONFIG .*:4096:8 or :16:8.*':4096:2'"):
        with deterministic_kernels(True):
            pass
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels(False):  # off: not its business
        pass


def test_the_workspace_setting_is_made_once_and_kept(monkeypatch):
    """`deterministic_workspace` (what `opd pipeline` / `opd lab run` call before their first stage when a later one
    is deterministic): sets :4096:8 where unset and says so, keeps an accepted setting, refuses any other."""
    from opd.train.common import deterministic_workspace

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert deterministic_workspace() is True and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert deterministic_workspace() is False and os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    with deterministic_kernels(True):  # set before: the block leaves it set
        pass
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG"):
        deterministic_workspace()


def test_the_exact_nucleus_mass_compiles_to_the_eager_result():
    """The static engine compiles its sampling step (inductor) on a GPU, where inductor's own float scan ignores
    deterministic mode: there `nucleus_mass_before` sums integers, exact in any order. Compiled (inductor, here on
    the CPU) it equals the eager integer sums bit for bit: integer sums and power-of-two scalings are exact, so no
    rounding can differ between the two code paths (the one cast back to float32 rounds the same value)."""
    from opd.rollout.sampling import nucleus_mass_before

    probs_BV = torch.randn(4, 3000, generator=torch.Generator().manual_seed(0)).mul(3).softmax(-1)
    probs_BV = probs_BV.sort(-1, descending=True).values
    compiled = torch.compile(lambda p: nucleus_mass_before(p, exact=True), dynamic=False)
    assert torch.equal(compiled(probs_BV), nucleus_mass_before(probs_BV, exact=True))


def test_the_exact_nucleus_scan_stays_out_of_compiled_graphs():
    """The integer scan runs eagerly inside a compiled caller: inductor's split int64 scan failed to compile on an
    H100 (2 rows × 151,936, `benchmarks/check_cuda.py --only deterministic`), so no compiled graph may hold it; the
    rounding and scaling around it still compile."""
    from opd.rollout.sampling import nucleus_mass_before

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    probs_BV = torch.rand(2, 64, generator=torch.Generator().manual_seed(0)).softmax(-1).sort(-1, descending=True)[0]
    compiled = torch.compile(lambda p: nucleus_mass_before(p, exact=True), backend=record, dynamic=False)
    assert torch.equal(compiled(probs_BV), nucleus_mass_before(probs_BV, exact=True))
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert graphs and "round" in " ".join(targets) and not any("cumsum" in t for t in targets)


def test_the_labs_timed_sft_runs_under_the_flag(monkeypatch, tmp_path, tiny_model_dir, sft_data):
    """`opd lab run`'s SFT stages train through `sft_within_budget`, not `sft()`: it enters deterministic mode the
    same way, for its steps only (a spy on the real step reads the mode inside it)."""
    import opd.recipes.lab_sft as lab
    from helpers import sft_config

    seen, real_step = [], lab.sft_step
    monkeypatch.setattr(
        lab, "sft_step", lambda tr: seen.append(torch.are_deterministic_algorithms_enabled()) or real_step(tr)
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    for flag in (True, False):
        config = sft_config(
            tmp_path, tiny_model_dir, sft_data, "run.steps=2", f"run.name=d{flag}", f"run.deterministic={flag}"
        )
        _, record = lab.sft_within_budget(config, deadline=float("inf"), log_every=10**6)
        assert record["steps"] == 2
    assert seen == [True, True, False, False] and not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize(
    ("consecutive", "step", "steps_run", "says"),
    [
        (1, 1, 1, "every step of this run (1..1)"),  # the only step skipped
        (3, 7, 3, "every step of this run (5..7)"),  # a resumed run none of whose steps trained
        (2, 5, 5, "its last 2 steps (4..5)"),  # weights that diverged: every step after is skipped
    ],
)
def test_a_run_that_ends_on_skipped_steps_is_an_error(consecutive, step, steps_run, says):
    with pytest.raises(ValueError, match=re.escape(f"the run ended with {says} skipped")) as error:
        check_run_trained(consecutive, step, steps_run)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("consecutive", "step", "steps_run"), [(0, 5, 5), (1, 5, 5), (0, 0, 0)])
def test_a_run_that_ends_on_a_trained_step_or_one_transient_skip_passes(consecutive, step, steps_run):
    check_run_trained(consecutive, step, steps_run)
