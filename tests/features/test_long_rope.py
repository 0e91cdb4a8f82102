"""RoPE whose table depends on the sequence length (longrope, dynamic NTK): one table per run (`opd.models.fix_rope`),
the same in the torch and static engines, the scorer (the trainer's forward), the served teacher and `opd distill`,
against a full-sequence reference that transformers itself computes at the run's length; the vLLM engine's
agreement or refusal (`opd.rollout.vllm_engine.rope_refusal`).

The reference: the unfixed model over each row right-padded to the run's length. A causal model's logits at a
position do not see the padding after it, and transformers picks the table from the forward's length: the table
`fix_rope` chose, computed by transformers' own switch rather than by the code under test.
"""

from __future__ import annotations

import copy
import io
import json
import math
from pathlib import Path

import pytest
import torch
from rich.console import Console
from transformers import LlamaConfig, LlamaForCausalLM

from helpers import EOS_ID, PAD_ID, TINY_VOCAB, make_tiny_tokenizer, server_in_thread
from opd.config import DistillConfig, ServeLimits, build_config
from opd.forward import forward_hidden, output_head
from opd.models import RopeChoice, fix_rope, fixed_rope, rope_choice, unfixed_rope
from opd.rollout import SamplingParams
from opd.rollout.base import GenerationOutput
from opd.rollout.batch import build_rollouts
from opd.rollout.static_engine import StaticGenerator, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator
from opd.rollout.vllm_engine import rope_refusal
from opd.scoring import candidate_logprobs_and_entropy
from opd.teacher.client import RemoteScorer
from opd.teacher.local import LocalScorer
from opd.teacher.server import service_for

ATOL = 1e-4
"""fp32 paths that compute the same table in another order (cached decode, one full forward, the static engine's
precomputed table) agree to ~1e-5 nats here, as in rollout/test_static_engine.py; a table switched by the length
moves these tiny models' log-probs by 0.3 nats and more."""
TOKEN = "test-token-0123456789abcdef"
HEAD_DIM = 8  # TINY hidden 32 / 4 heads
LONGROPE = {
    "rope_type": "longrope",
    "original_max_position_embeddings": 16,
    "short_factor": [1.0, 1.0, 1.0, 1.0],
    "long_factor": [1.0, 2.0, 4.0, 8.0],
}
DYNAMIC = {"rope_type": "dynamic", "factor": 4.0}
ROPES = {"longrope": (LONGROPE, 512), "dynamic": (DYNAMIC, 16)}  # (rope, max_position_embeddings)
PROMPTS = [[1, 2, 3, 4, 5, 6], [7, 8, 9]]
NEW = 40
LENGTH = 6 + NEW  # the run's longest sequence: past 16, the switch of both


def _model(rope: dict, context: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        initializer_range=0.3,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="eager",
        rope_parameters={"rope_theta": 10000.0, **rope},
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = [EOS_ID, PAD_ID]
    model.generation_config.pad_token_id = PAD_ID
    return model


def _reference_logprobs(unfixed: torch.nn.Module, prompt: list[int], response: list[int], length: int) -> torch.Tensor:
    """log p(response | prompt) of the unfixed model over the row right-padded to `length` (float64 softmax)."""
    ids = prompt + response
    with torch.no_grad():
        logits = unfixed(torch.tensor([ids + [PAD_ID] * (length - len(ids))])).logits[0].double()
    lp = torch.log_softmax(logits, -1)
    return torch.stack([lp[len(prompt) - 1 + i, t] for i, t in enumerate(response)])


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_the_fixed_table_is_the_papers_formula_at_the_run_length(kind):
    """float64 formulas written here: longrope's long factors (Phi-3: 1 / (λ_i · θ^(2i/d))), dynamic NTK's base
    θ · (f·L/L₀ − (f − 1))^(d/(d−2)) at the run's length L; a run that stays within the switch keeps the short
    factors / the original base."""
    rope, context = ROPES[kind]
    model = _model(rope, context)
    shape = torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM
    if kind == "longrope":
        want = 1.0 / (torch.tensor(LONGROPE["long_factor"], dtype=torch.float64) * 10000.0**shape)
    else:
        base = 10000.0 * (4.0 * LENGTH / context - 3.0) ** (HEAD_DIM / (HEAD_DIM - 2))
        want = 1.0 / base**shape
    original = 1.0 / 10000.0**shape
    assert unfixed_rope(model) is not None
    choice = fix_rope(model, LENGTH)
    assert choice == RopeChoice(kind, 16, LENGTH) and fixed_rope(model) == choice and unfixed_rope(model) is None
    rotary = model.model.rotary_emb
    torch.testing.assert_close(rotary.inv_freq.double(), want, rtol=1e-6, atol=0)
    short = copy.deepcopy(model)
    fix_rope(short, 16)  # a fixed model is fixed again from its loaded type: the table of the new length
    torch.testing.assert_close(short.model.rotary_emb.inv_freq.double(), original, rtol=1e-6, atol=0)
    assert rope_choice(short.config, 16).setting == ("short factors" if kind == "longrope" else "original base")
    assert model.config.rope_parameters["rope_type"] == kind  # a checkpoint saves the model as it was loaded


def test_a_rope_of_the_position_only_is_left_alone():
    model = _model({"rope_type": "linear", "factor": 2.0}, 512)
    before = model.model.rotary_emb.inv_freq.clone()
    assert rope_choice(model.config, 4096) is None and fix_rope(model, 4096) is None
    assert torch.equal(model.model.rotary_emb.inv_freq, before) and fixed_rope(model) is None


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("engine", ["torch", "static"])
def test_engines_and_scorer_agree_with_the_full_sequence_reference(kind, engine):
    """Rows that cross the switch (6 + 40 tokens past 16): the engine's log-probs, the scorer's (`LocalScorer`),
    the update's (`opd.forward.forward_hidden` with grad, the chunked head) and the reference agree to fp32
    rounding. Without the fix the torch engine's cached decode disagrees with the reference (what this guards)."""
    rope, context = ROPES[kind]
    model = _model(rope, context)
    unfixed = copy.deepcopy(model)
    fix_rope(model, LENGTH)
    common = dict(eos_token_ids=[EOS_ID], pad_token_id=PAD_ID)
    assert unsupported_reason(unfixed) is not None and unsupported_reason(model) is None  # static: refused unfixed
    generator = TorchGenerator(model, **common) if engine == "torch" else StaticGenerator(model, kv_bucket=16, **common)
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=NEW, seed=0, return_logprobs=True, stop_at_eos=False)
    out = generator.generate(PROMPTS, params)
    rollouts = build_rollouts(PROMPTS, out, pad_id=PAD_ID, device=torch.device("cpu"))
    scored = LocalScorer(model, vocab_size=TINY_VOCAB).score(rollouts, top_k=0)
    model.train()  # the update's forward: grad mode, train mode (`opd.train.step`)
    hidden = forward_hidden(model, rollouts)
    update_N, _ = candidate_logprobs_and_entropy(hidden.hidden_ND, output_head(model), hidden.targets_N[:, None])
    update_lp = torch.zeros(rollouts.response_mask.shape, dtype=torch.float64)
    update_lp[hidden.rows_N, hidden.cols_N] = update_N[:, 0].detach().double()
    model.eval()
    for b, prompt in enumerate(PROMPTS):
        want = _reference_logprobs(unfixed, prompt, out.response_ids[b], LENGTH)
        engine_lp = torch.tensor(out.logprobs[b], dtype=torch.float64)
        scorer_lp = scored.sampled_logprobs[b][rollouts.response_mask[b].bool()].double()
        torch.testing.assert_close(engine_lp, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(scorer_lp, want, atol=ATOL, rtol=0)
        torch.testing.assert_close(update_lp[b][rollouts.response_mask[b].bool()], want, atol=ATOL, rtol=0)
    stale = TorchGenerator(unfixed, **common).generate(PROMPTS[:1], params)
    gap = _reference_logprobs(unfixed, PROMPTS[0], stale.response_ids[0], LENGTH) - torch.tensor(stale.logprobs[0])
    assert float(gap.abs().mean()) > 100 * ATOL


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_the_served_teacher_fixes_its_table_reports_it_and_the_client_checks_it(kind):
    """`opd serve-teacher`'s service on loopback: the model fixed at its max_positions, /info's `rope` says so, its
    scores equal the reference at that length; a client whose run needs the other table stops in one line."""
    rope, context = ROPES[kind]
    model = _model(rope, context)
    unfixed = copy.deepcopy(model)
    service = service_for(model, make_tiny_tokenizer(), ServeLimits(max_positions=LENGTH), name="tiny", device="cpu")
    assert service.info["rope"] == RopeChoice(kind, 16, LENGTH).to_info()
    prompts, responses = PROMPTS, [[11 + i for i in range(NEW)], [40 + i for i in range(NEW)]]
    output = GenerationOutput(responses, ["length"] * 2, [0, 1])
    rollouts = build_rollouts(prompts, output, pad_id=PAD_ID, device=torch.device("cpu"))
    with server_in_thread(service, TOKEN) as url:
        remote = RemoteScorer(url, token=TOKEN)
        try:
            remote.check_rope(LENGTH)  # the same table: no word
            scored = remote.score(rollouts, top_k=0)
            if kind == "longrope":  # a run within the original context needs the short factors
                with pytest.raises(ValueError, match=r"fixed its rope_type 'longrope' to its long factors") as stop:
                    remote.check_rope(12)
                assert "short factors" in str(stop.value) and "max_positions=12" in str(stop.value)
            else:  # dynamic: any other length past the switch is another base
                with pytest.raises(ValueError, match=rf"NTK base at {LENGTH} positions") as stop:
                    remote.check_rope(LENGTH + 10)
            assert "\n" not in str(stop.value)
        finally:
            remote.close()
    for b, prompt in enumerate(prompts):
        want = _reference_logprobs(unfixed, prompt, responses[b], LENGTH)
        got = scored.sampled_logprobs[b][rollouts.response_mask[b].bool()].double()
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_vllm_agrees_on_longrope_from_its_max_model_len_and_refuses_dynamic_by_name():
    """vLLM fixes longrope's table from its engine's max_model_len (default max_position_embeddings): it agrees when
    that lies on the run's side of original_max_position_embeddings; its dynamic NTK base is fixed at
    max_position_embeddings × factor whatever the run: refused."""
    longrope = _model(LONGROPE, 512).config
    assert rope_refusal(longrope, None, LENGTH) is None  # 512 and 46 are both past 16: long factors
    assert rope_refusal(longrope, 64, LENGTH) is None
    short = rope_refusal(longrope, None, 12)
    assert short is not None and "uses its long factors" in short and "vllm.max_model_len=12" in short
    assert rope_refusal(longrope, 16, 12) is None
    dynamic = rope_refusal(_model(DYNAMIC, 16).config, None, LENGTH)
    assert dynamic is not None and "rope_type 'dynamic'" in dynamic
    assert rope_refusal(_model({"rope_type": "default"}, 512).config, None, LENGTH) is None


def _pair(root: Path, rope: dict, context: int) -> Path:
    """A tiny student (seed 0) and teacher (seed 1) of one RoPE, each with the tiny tokenizer, and six prompts whose
    rendered length (23 tokens) with 24 new tokens crosses a switch at 32, as the issue's pair does."""
    tokenizer = make_tiny_tokenizer()
    for name, seed in (("student", 0), ("teacher", 1)):
        _model(rope, context, seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(6)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


PAIRS = {
    "longrope": ({**LONGROPE, "original_max_position_embeddings": 32}, 512),
    "dynamic": (DYNAMIC, 32),
}


def _distill_config(pair: Path, out: Path, *overrides: str) -> DistillConfig:
    options = {
        "student.path": str(pair / "student"),
        "teacher.path": str(pair / "teacher"),
        "data.path": str(pair / "prompts.jsonl"),
        "data.answer_key": "answer",
        "data.max_prompt_length": 32,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 24,
        "micro_batch_tokens": 64,
        "run.out_dir": str(out),
        "run.name": "run",
        "run.steps": 2,
        "run.report": False,
        "skip_checks": ["special_tokens"],
    }
    return build_config(DistillConfig, options=options, overrides=list(overrides))


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_distill_trains_a_length_dependent_pair_with_one_distribution(kind, tmp_path):
    """`opd distill` on the tiny pair whose rows cross the switch: both models fixed at the run's 56 tokens, the
    startup rows that compare generated with scored log-probs pass at that length, and it trains."""
    from opd.recipes.distill import distill

    pair = _pair(tmp_path / "pair", *PAIRS[kind])
    text = io.StringIO()
    console = Console(file=text, width=200)
    run = distill(_distill_config(pair, tmp_path / "runs"), console=console)
    printed = text.getvalue()
    assert f"student: rope_type '{kind}' fixed to its" in printed and f"teacher: rope_type '{kind}' fixed" in printed
    assert "self_distillation_zero pass" in printed and "generation_scoring pass" in printed
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["pg_loss"]) for r in rows)


def test_distill_stops_at_startup_in_one_line_when_a_table_still_switches(tmp_path, monkeypatch):
    """The startup rows are what catches a mismatch of this kind (this variant or a future one): with the fix
    turned off, the teacher's self-distillation row and the student's generation row fail, naming the gap, and the
    run stops before its first step."""
    import opd.recipes.distill as recipe

    monkeypatch.setattr(recipe, "fix_rope", lambda model, length: None)
    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    with pytest.raises(ValueError, match=r"^opd check: self_distillation_zero failed \(mean \|t\(y\) − g\(y\)\| ") as e:
        recipe.distill(_distill_config(pair, tmp_path / "runs"))
    assert "\n" not in str(e.value) and "generation_scoring failed" in str(e.value)
    assert not list((tmp_path / "runs").glob("*/checkpoints/*"))


def test_distill_refuses_vllm_where_it_would_fix_another_table_before_any_model_loads(tmp_path, monkeypatch):
    """A dynamic-NTK student on the vLLM rollout engine, and a longrope teacher on vLLM whose max_model_len (default
    512) takes its long factors while the run's sequences (24 + 8 = 32 tokens) stay within 32: one line each, before
    vLLM or any model is loaded (the same refusals in the vLLM environment: tests/features/vllm/test_long_rope.py)."""
    import opd.recipes.distill as recipe
    import opd.teacher.registry as teachers

    for module in (recipe, teachers):  # the refusals come first: nothing of vLLM runs
        monkeypatch.setattr(module, "vllm_available", lambda: True)
    dynamic = _pair(tmp_path / "dynamic", *PAIRS["dynamic"])
    with pytest.raises(ValueError, match=r"^rollout.engine=vllm \(.*\): vLLM fixes rope_type 'dynamic'") as stop:
        recipe.distill(_distill_config(dynamic, tmp_path / "runs", "rollout.engine=vllm"))
    assert "\n" not in str(stop.value)
    longrope = _pair(tmp_path / "longrope", *PAIRS["longrope"])
    short = ("teacher.engine=vllm", "data.max_prompt_length=24", "rollout.max_new_tokens=8", "run.name=short")
    with pytest.raises(ValueError, match=r"^teacher .*: rope_type 'longrope': vLLM at max_model_len 512 uses") as stop:
        recipe.distill(_distill_config(longrope, tmp_path / "runs", *short))
    assert "its long factors" in str(stop.value) and "short factors" in str(stop.value)
    assert "vllm.max_model_len=32" in str(stop.value) and "\n" not in str(stop.value)


def test_distill_refuses_a_served_teacher_fixed_to_another_table_in_one_line(tmp_path):
    """`opd serve-teacher` on the pair's teacher at its default max_positions (512: long factors); a run whose
    sequences stay within 32 tokens needs the short ones: the client's /info check stops it before any step."""
    from opd.models import load_model
    from opd.recipes.distill import distill

    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    teacher, tokenizer = load_model(str(pair / "teacher"), dtype="fp32", device="cpu")
    service = service_for(teacher, tokenizer, ServeLimits(), name="teacher", device="cpu")
    short = ("data.max_prompt_length=24", "rollout.max_new_tokens=8", "teacher.path=null")
    with server_in_thread(service, None) as url:
        config = _distill_config(pair, tmp_path / "runs", *short, f"teacher.url={url}")
        with pytest.raises(ValueError, match=r"fixed its rope_type 'longrope' to its long factors") as stop:
            distill(config)
    assert "max_positions=32" in str(stop.value) and "\n" not in str(stop.value)
    assert not list((tmp_path / "runs").glob("*/checkpoints/*"))


def test_opd_check_scores_the_table_distill_trains_with(tmp_path):
    """`opd check` fixes the pair as distill does: the teacher's own samples, run to the run's length past the
    switch, get the log-probs it sampled them with (without the fix: 1.3 nats/token apart on this pair)."""
    from opd.recipes.check import run_check

    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    report = run_check(
        _distill_config(pair, tmp_path / "runs"),
        n=1,
        prompts_sample=2,
        out=tmp_path / "check",
        skip=["forecast", "resources", "tokenizers"],
        console=Console(file=io.StringIO(), width=200),
    )
    rows = {r.name: r for r in report.results}
    assert rows["self_distillation_zero"].status == "pass", rows["self_distillation_zero"]


# ------------------------------------------------------------------------------------- eval, rollout, prompts score


def _greedy_reference(unfixed: torch.nn.Module, prompt: list[int], new: int, length: int) -> list[int]:
    """The greedy answer of the unfixed model, each step one full forward over the row right-padded to `length`
    (the table of the run's length, as in `_reference_logprobs`), up to EOS."""
    ids: list[int] = list(prompt)
    for _ in range(new):
        with torch.no_grad():
            logits = unfixed(torch.tensor([ids + [PAD_ID] * (length - len(ids))])).logits[0, len(ids) - 1]
        ids.append(int(logits[:TINY_VOCAB].argmax()))
        if ids[-1] in (EOS_ID, PAD_ID):
            break
    return ids[len(prompt) :]


def _spy_generations(monkeypatch, module) -> list[tuple[list[int], list[int]]]:
    """Every (prompt ids, response ids) that the generators `module.make_generator` builds return, in order."""
    seen: list[tuple[list[int], list[int]]] = []
    build = module.make_generator

    def spying(*args, **kwargs):
        generator = build(*args, **kwargs)
        generate = generator.generate

        def recorded(prompt_ids, params):
            out = generate(prompt_ids, params)
            rows = [list(p) for p in prompt_ids for _ in range(params.n)]
            seen.extend(zip(rows, [list(r) for r in out.response_ids]))
            return out

        generator.generate = recorded
        return generator

    monkeypatch.setattr(module, "make_generator", spying)
    return seen


def _assert_greedy_is_the_reference(pair: Path, seen: list[tuple[list[int], list[int]]], length: int) -> None:
    from opd.models import load_model

    unfixed, _ = load_model(str(pair / "student"), dtype="fp32", device="cpu")
    assert seen and any(len(p) + len(r) > 32 for p, r in seen)  # rows that cross the switch
    for prompt, response in seen:
        assert response == _greedy_reference(unfixed, prompt, length - 32, length)


@pytest.mark.parametrize("batch_size", [1, 6])
def test_opd_eval_generates_with_the_table_of_its_longest_sequence_whatever_the_batch(
    batch_size, tmp_path, monkeypatch
):
    """`opd eval --model` on the tiny longrope student: its greedy answers (32 + 24 tokens at most, past the switch
    at 32) are the reference's at 56 tokens, alone in a batch or all six together (without the fix the cached
    decode switches tables mid-answer)."""
    import opd.eval.sampling as sampling
    from opd.config import EvalConfig, ModelSpec
    from opd.recipes.eval import evaluate

    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    seen = _spy_generations(monkeypatch, sampling)
    config = EvalConfig(
        model=ModelSpec(path=str(pair / "student"), device="cpu", dtype="fp32"),
        benchmarks=[str(pair / "prompts.jsonl")],
        prompt_key="prompt",
        answer_key="answer",
        n=1,
        temperature=0.0,
        max_prompt_length=32,
        max_new_tokens=24,
        batch_size=batch_size,
        out=str(tmp_path / "eval"),
    )
    evaluate(config, console=Console(file=io.StringIO()))
    assert len(seen) == 6
    _assert_greedy_is_the_reference(pair, seen, 56)


@pytest.mark.parametrize("batch_size", [1, 6])
def test_opd_rollout_samples_with_the_table_of_its_longest_sequence_whatever_the_batch(
    batch_size, tmp_path, monkeypatch
):
    """`opd rollout` on the tiny longrope model, greedy: every attempt is the reference's answer at 56 tokens."""
    import opd.rollout
    from opd.config.rollout import RolloutConfig
    from opd.recipes.rollout import teacher_rollout

    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    seen = _spy_generations(monkeypatch, opd.rollout)
    options = {
        "model.path": str(pair / "student"),
        "model.device": "cpu",
        "model.dtype": "fp32",
        "data.path": str(pair / "prompts.jsonl"),
        "data.answer_key": "answer",
        "data.max_prompt_length": 32,
        "out": str(tmp_path / "rollout"),
        "n": 1,
        "max_attempts": 1,
        "temperature": 0.0,
        "max_new_tokens": 24,
        "batch_size": batch_size,
    }
    teacher_rollout(build_config(RolloutConfig, options=options), console=Console(file=io.StringIO()))
    assert len(seen) == 6
    _assert_greedy_is_the_reference(pair, seen, 56)


@pytest.mark.parametrize("kind", sorted(PAIRS))
def test_opd_prompts_score_scores_both_models_with_the_table_of_its_longest_sequence(kind, tmp_path, monkeypatch):
    """`opd prompts score` on the tiny pair: the student's and the teacher's log-probs of the student's rollouts (24
    new tokens after 23, past the switch at 32) are the reference's at 56 tokens, each model's own. (Unfixed, a
    scorer's forward takes the table of its padded batch, 47 tokens here: longrope's long factors, as at 56, but
    another dynamic NTK base.)"""
    import opd.recipes.prompts as recipe
    from opd.config import DataSpec, ModelSpec
    from opd.config.prompts import PromptScoreConfig
    from opd.models import load_model

    pair = _pair(tmp_path / "pair", *PAIRS[kind])
    scored = []
    score = recipe.score_prompts
    monkeypatch.setattr(
        recipe, "score_prompts", lambda *a, **k: score(*a, **k, on_scored=lambda *batch: scored.append(batch))
    )
    config = PromptScoreConfig(
        student=ModelSpec(path=str(pair / "student"), device="cpu", dtype="fp32"),
        teacher=ModelSpec(path=str(pair / "teacher"), device="cpu", dtype="fp32"),
        data=DataSpec(path=str(pair / "prompts.jsonl"), answer_key="answer", max_prompt_length=32),
        out=str(tmp_path / "scores" / "scores.jsonl"),
        n=1,
        top_k=4,
        max_new_tokens=24,
        batch_size=3,
    )
    recipe.score_prompt_file(config, console=Console(file=io.StringIO()))
    assert len(scored) == 2
    for name, which in (("student", 2), ("teacher", 3)):
        unfixed, _ = load_model(str(pair / name), dtype="fp32", device="cpu")
        for batch in scored:
            rollouts, scores = batch[1], batch[which]
            for b in range(rollouts.response_mask.shape[0]):
                mask = rollouts.response_mask[b].bool()
                prompt = rollouts.input_ids[b][: int(rollouts.prompt_lengths[b])].tolist()
                response = rollouts.response_ids[b][mask].tolist()
                want = _reference_logprobs(unfixed, prompt, response, 56)
                torch.testing.assert_close(scores.sampled_logprobs[b][mask].double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("evaluated", [False, True])
def test_opd_sft_fixes_the_table_at_its_longest_sequence(evaluated, tmp_path):
    """`opd sft`'s model: fixed at the training bound `data.max_length` (24: short factors), or at its periodic
    eval's prompt + response where that is longer (32 + 24: long factors, the table its eval samples with)."""
    from opd.config.sft import SFTConfig
    from opd.recipes.sft import _load_net

    pair = _pair(tmp_path / "pair", *PAIRS["longrope"])
    overrides = [
        f"model.path={pair / 'student'}",
        "model.device=cpu",
        f"data.path={pair / 'prompts.jsonl'}",
        "data.max_length=24",
        "micro_batch_tokens=64",
        f"run.out_dir={tmp_path / 'runs'}",
    ]
    if evaluated:
        bench = f"eval.benchmarks=[{pair / 'prompts.jsonl'}]"
        overrides += [bench, "eval.max_prompt_length=32", "eval.max_new_tokens=24"]
    net, _, _ = _load_net(build_config(SFTConfig, overrides=overrides), None)
    choice = fixed_rope(net)
    assert choice == RopeChoice("longrope", 32, 56 if evaluated else 24) and unfixed_rope(net) is None
    assert choice.setting == ("long factors" if evaluated else "short factors")


def test_eval_rollout_and_prompts_score_refuse_vllm_where_it_would_fix_another_table(tmp_path):
    """The vLLM check of distill (`opd.rollout.registry.check_vllm_rope`) before vLLM starts, in one line each: a
    dynamic-NTK model on `opd eval`, `opd rollout` and `opd prompts score` with engine=vllm."""
    from opd.config import DataSpec, EvalConfig, ModelSpec
    from opd.config.prompts import PromptScoreConfig
    from opd.config.rollout import RolloutConfig
    from opd.eval.sampling import _load_generator
    from opd.recipes.prompts import _load_models
    from opd.recipes.rollout import _load_teacher

    pair = _pair(tmp_path / "pair", *PAIRS["dynamic"])
    student = ModelSpec(path=str(pair / "student"), device="cpu")
    data = {"data.path": str(pair / "prompts.jsonl"), "data.answer_key": "answer"}
    options = {"model.path": student.path, "engine": "vllm", "out": str(tmp_path / "out"), **data}
    rollout = build_config(RolloutConfig, options=options)
    score = PromptScoreConfig(
        student=student,
        teacher=ModelSpec(path=str(pair / "teacher")),
        data=DataSpec(path=data["data.path"], answer_key="answer"),
        out=str(tmp_path / "scores.jsonl"),
        engine="vllm",
    )
    for load in (
        lambda: _load_generator(EvalConfig(model=student, benchmarks=["math500"], engine="vllm")),
        lambda: _load_teacher(rollout, "cpu"),
        lambda: _load_models(score, make_tiny_tokenizer()),
    ):
        with pytest.raises(ValueError, match=r"^engine=vllm \(.*student\): vLLM fixes rope_type 'dynamic'") as stop:
            load()
        assert "\n" not in str(stop.value)
