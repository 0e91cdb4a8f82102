"""`DistillConfig` (`opd.config.distill`): its defaults are the paper's."""

from opd.config import DistillConfig, build_config


def test_paper_defaults():
    cfg = build_config(DistillConfig, options={"student.path": "s", "teacher.path": "t", "data.path": "d"})
    assert (cfg.objective.top_k, cfg.objective.strategy, cfg.objective.weight) == (16, "only_stu", "student_p")
    assert (cfg.rollout.temperature, cfg.rollout.n, cfg.optim.lr) == (1.0, 4, 1e-6)
    assert (cfg.objective.loss_agg_mode, cfg.objective.advantage, cfg.prompts_per_step) == (
        "token-mean",
        "token_reward",
        64,
    )
    assert (cfg.optim.betas, cfg.optim.weight_decay, cfg.optim.grad_clip, cfg.optim.schedule) == (
        (0.9, 0.999),
        0.01,
        1.0,
        "constant",
    )


def test_full_vocabulary_objectives_resolve_and_refuse():
    import pytest

    base = {"student.path": "s", "teacher.path": "t", "data.path": "d"}
    cfg = build_config(DistillConfig, options={**base, "objective.loss": "full_jsd"})
    assert cfg.needs_full_distribution() and cfg.teacher_entries()[0].answer == "hidden"  # auto resolved
    assert build_config(DistillConfig, options=base).teacher_entries()[0].answer == "auto"
    for options, culprit in [
        ({"objective.loss": "full_reverse_kl", "teacher.answer": "scores"}, "teacher.answer=hidden"),
        ({"objective.loss": "full_forward_kl", "teacher.engine": "vllm"}, "engine=vllm"),
        ({"objective.token_reward": "full_reverse_kl"}, "objective.top_k=0"),
        ({"objective.token_reward": "full_reverse_kl_next", "objective.top_k": 0, "objective.loss": "jsd"}, "loss=pg"),
    ]:
        with pytest.raises(ValueError, match=culprit):
            build_config(DistillConfig, options={**base, **options})
    two = {
        "student.path": "s",
        "data.path": "d",
        "objective.loss": "full_reverse_kl",
        "teachers": [
            {"name": "a", "path": "t", "route": {"default": True}},
            {"name": "b", "path": "u", "route": {"data_source": ["x"]}},
        ],
    }
    with pytest.raises(ValueError, match="takes one teacher"):
        build_config(DistillConfig, options=two)


def test_markdown_tool_calls_need_the_python_tool():
    import pytest

    base = {"student.path": "s", "teacher.path": "t", "data.path": "d", "rollout.tools": "python"}
    assert build_config(DistillConfig, options=base).rollout.tool_format == "hermes"
    assert build_config(DistillConfig, options={**base, "rollout.tool_format": "markdown"}).rollout.tool_format == (
        "markdown"
    )
    with pytest.raises(ValueError, match="rollout.tool_format=markdown: .*rollout.tools=calculator"):
        build_config(DistillConfig, options={**base, "rollout.tools": "calculator", "rollout.tool_format": "markdown"})
    with pytest.raises(ValueError, match="tool_format"):
        build_config(DistillConfig, options={**base, "rollout.tool_format": "json"})
