"""The lean optimizer state (`optim.state_dtype: bf16`, `opd.train.optim.AdamW16`) against torch's float32 AdamW, and
the optimizer choice of `build_optimizer`."""

import copy

import pytest
import torch

from helpers import make_tiny_model
from opd.config import ConfigError, DistillConfig, OptimSpec, validate_config
from opd.train import optim
from opd.train.optim import AdamW16, build_optimizer


def _loss(model, batch_BT):
    return model(input_ids=batch_BT, labels=batch_BT).loss


def _train(model, optimizer, steps: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        batch_BT = torch.randint(0, 261, (4, 12), generator=g)
        _loss(model, batch_BT).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _pair(lr: float):
    model = make_tiny_model("qwen3")
    reference, lean = model, copy.deepcopy(model)
    spec = OptimSpec(lr=lr)
    return (
        reference,
        build_optimizer(reference.parameters(), spec),
        lean,
        build_optimizer(lean.parameters(), spec.model_copy(update={"state_dtype": "bf16"})),
    )


def test_first_step_is_torch_adamw_exactly():
    """Step 1 updates from the unrounded float32 moments: the formula (decoupled weight decay, bias corrections,
    eps) must give torch's AdamW to float32 rounding."""
    reference, ref_opt, lean, lean_opt = _pair(lr=1e-3)
    start = _flat(reference)
    _train(reference, ref_opt, 1)
    _train(lean, lean_opt, 1)
    delta_ref, delta_lean = _flat(reference) - start, _flat(lean) - start
    assert torch.allclose(delta_lean, delta_ref, rtol=1e-4, atol=1e-9)  # ~1e-7 of |w| ≈ 0.3: float32 rounding


def test_lean_state_tracks_fp32_over_20_steps_at_paper_lr():
    """20 steps at lr 1e-6 (the paper's) on the same batches. Tolerance: bf16 keeps 8 significant bits, so each
    stored moment is off by ≤ 2^-9 (exp_avg, nearest) or < 2^-8 (exp_avg_sq, stochastic) relative; the step
    m̂ / √v̂ inherits ≲ 0.4% per element, and the 20-step displacement averages those errors: ≤ 1% of it."""
    reference, ref_opt, lean, lean_opt = _pair(lr=1e-6)
    start = _flat(reference)
    _train(reference, ref_opt, 20)
    _train(lean, lean_opt, 20)
    delta_ref, delta_lean = _flat(reference) - start, _flat(lean) - start
    assert (delta_lean - delta_ref).norm() / delta_ref.norm() < 1e-2
    for p_ref, p_lean in zip(reference.parameters(), lean.parameters()):
        s_ref, s_lean = ref_opt.state[p_ref], lean_opt.state[p_lean]
        assert s_lean["exp_avg"].dtype == s_lean["exp_avg_sq"].dtype == torch.bfloat16
        assert int(s_lean["step"]) == int(s_ref["step"]) == 20
        for key in ("exp_avg", "exp_avg_sq"):
            ref, got = s_ref[key], s_lean[key].float()
            assert (got - ref).norm() / ref.norm().clamp(min=1e-30) < 1e-2, key


def _second_moment_after(steps: int, store) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg_sq of AdamW16 (with `store` writing it) and of torch's AdamW after `steps` synthetic gradients whose
    scale drops 4× a third of the way in: v must fall from ~1 towards 1/16."""
    torch.manual_seed(0)
    lean_p = torch.nn.Parameter(torch.zeros(1 << 14))
    ref_p = torch.nn.Parameter(torch.zeros(1 << 14))
    lean = AdamW16([lean_p], lr=1e-6, weight_decay=0.0)
    ref = torch.optim.AdamW([ref_p], lr=1e-6, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    original = optim.store_bf16_stochastic
    optim.store_bf16_stochastic = store
    try:
        for t in range(steps):
            grad = torch.randn(1 << 14, generator=g) * (1.0 if t < steps // 3 else 0.25)
            lean_p.grad, ref_p.grad = grad.clone(), grad.clone()
            lean.step()
            ref.step()
    finally:
        optim.store_bf16_stochastic = original
    return lean.state[lean_p]["exp_avg_sq"].float(), ref.state[ref_p]["exp_avg_sq"]


@pytest.mark.slow
def test_stochastic_rounding_keeps_the_second_moment_moving():
    """With β2 = 0.999 a step moves exp_avg_sq by ~0.1%, below half a bf16 spacing: rounded to nearest it stays
    near its old value (here ~1 instead of the true ~0.2 after 2,000 steps of smaller gradients); stochastically
    rounded it follows float32. Tolerance 2% on the mean ratio: each element carries ~5% of dither noise (the
    sum of ~500 steps' rounding errors at 0.2% each), averaged over 16,384 elements."""
    stochastic, reference = _second_moment_after(3000, optim.store_bf16_stochastic)
    assert abs((stochastic / reference).mean() - 1) < 0.02
    nearest, reference = _second_moment_after(3000, lambda out, x, seed: out.copy_(x))
    assert (nearest / reference).mean() > 2  # the failure stochastic rounding fixes


def test_stochastic_rounding_is_unbiased_and_deterministic():
    x = torch.full((1 << 16,), 1.0 + 2**-10)  # between the bf16 neighbours 1 and 1 + 2^-7, at 1/8 of the gap
    out = torch.empty_like(x, dtype=torch.bfloat16)
    optim.store_bf16_stochastic(out, x.clone(), seed=3)
    values = set(out.float().unique().tolist())
    assert values == {1.0, 1.0 + 2**-7}
    assert abs(out.float().mean().item() - (1.0 + 2**-10)) < 2**-7 * 0.01
    again = torch.empty_like(out)
    optim.store_bf16_stochastic(again, x.clone(), seed=3)
    assert torch.equal(out, again)


def test_lean_state_resumes_exactly():
    """A checkpointed AdamW16 (state dict) continues bit-identically: the dither is a function of the step."""
    model = make_tiny_model("qwen3")
    spec = OptimSpec(lr=1e-3, state_dtype="bf16")
    opt = build_optimizer(model.parameters(), spec)
    _train(model, opt, 3)
    resumed_model = copy.deepcopy(model)
    resumed_opt = build_optimizer(resumed_model.parameters(), spec)
    resumed_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    _train(model, opt, 2, seed=5)
    _train(resumed_model, resumed_opt, 2, seed=5)
    assert torch.equal(_flat(model), _flat(resumed_model))


def test_build_optimizer_choices():
    model = make_tiny_model("qwen3")
    plain = build_optimizer(model.parameters(), OptimSpec())
    assert type(plain) is torch.optim.AdamW and not plain.defaults.get("fused")  # CPU: foreach, as before
    fused = build_optimizer(model.parameters(), OptimSpec(fused=True))
    assert fused.defaults["fused"] is True
    assert isinstance(build_optimizer(model.parameters(), OptimSpec(state_dtype="bf16")), AdamW16)
    with pytest.raises(ConfigError, match="optim.state_dtype"):
        validate_config(
            DistillConfig, {"student": {"path": "s"}, "data": {"path": "d"}, "optim": {"state_dtype": "fp16"}}
        )
