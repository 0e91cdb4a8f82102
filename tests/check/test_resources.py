"""`opd.check.resources`: the memory estimate and its check, every teacher counted where it lives."""

from __future__ import annotations

import torch

from opd import check as C


def test_memory_estimate_and_check(lab_teacher):
    from opd.recipes.demo import demo_config

    model = lab_teacher[0]
    small = C.estimate_memory(demo_config(), model, model, compute_dtype=torch.float32)["cpu"]
    big = C.estimate_memory(
        demo_config(["rollout.batch_size=512", "prompts_per_step=128"]), model, model, compute_dtype=torch.float32
    )["cpu"]
    assert big["kv_cache"] == 16 * small["kv_cache"] > 0  # rows = min(batch_size, prompts × n): 32 → 512
    params = sum(p.numel() for p in model.parameters())
    assert small["adamw_state"] == 2 * 4 * params and small["teacher_weights"] == 4 * params
    needs = {"cpu": small}
    total = sum(small.values())
    assert C.check_memory(needs, free={"cpu": 10 * total}).status == "pass"
    assert C.check_memory(needs, free={"cpu": int(total / 0.9)}).status == "warn"
    failed = C.check_memory(needs, free={"cpu": total // 2})
    assert failed.status == "fail" and failed.hard and failed.fix


def test_memory_estimate_counts_every_teacher_where_it_lives(lab_teacher):
    """Several teachers: each one's weights under its own name where they live, the scoring activations once (the
    largest: teachers score one after another); one teacher keeps its single `teacher_weights` entry."""
    from opd.recipes.demo import demo_config

    model = lab_teacher[0]
    bytes_ = sum(p.numel() * p.element_size() for p in model.parameters())
    one = C.estimate_memory(demo_config(), model, model, compute_dtype=torch.float32)["cpu"]
    two = C.estimate_memory(
        demo_config(), model, None, compute_dtype=torch.float32, teachers=[("a", model, True), ("b", model, False)]
    )["cpu"]
    assert one["teacher_weights"] == two["teacher_weights[a]"] == two["teacher_weights[b]"] == bytes_
    assert "teacher_weights" not in two and two["teacher_activations"] == one["teacher_activations"]
    assert sum(two.values()) == sum(one.values()) + bytes_
