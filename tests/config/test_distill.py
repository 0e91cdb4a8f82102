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
