"""The engine registry: one place maps names to engines; "auto" picks per device and layout."""

import pytest
import torch

from helpers import make_tiny_model
from opd.config import ModelSpec, VLLMSpec
from opd.rollout import Generator, SamplingParams, engine_names, make_generator
from opd.rollout.registry import resolve_engine, vllm_arguments
from opd.rollout.static_engine import StaticGenerator
from opd.rollout.torch_engine import TorchGenerator
from opd.rollout.vllm_engine import EngineOptions, VLLMGenerator
from opd.teacher.base import TeacherScorer, start_scoring
from opd.teacher.client import RemoteScorer
from opd.teacher.local import LocalScorer
from opd.teacher.registry import scorer_names
from opd.teacher.vllm_scorer import VLLMScorer
from opd.types import Rollouts


def test_names_and_auto_on_cpu(tiny_tokenizer):
    model = make_tiny_model("qwen3")
    assert engine_names()[:3] == ["auto", "torch", "static"]
    assert resolve_engine("auto", model) == "torch"  # no CUDA graphs on CPU
    assert type(make_generator(model, tiny_tokenizer)) is TorchGenerator
    assert type(make_generator(model, tiny_tokenizer, engine="static")) is StaticGenerator


def test_engines_agree_greedily_and_take_the_tokenizer_ids(tiny_tokenizer):
    model = make_tiny_model("qwen3")
    params = SamplingParams(n=2, temperature=0, max_new_tokens=6)
    outputs = [
        make_generator(model, tiny_tokenizer, engine=name).generate([[5, 6, 7], [9]], params)
        for name in ("torch", "static")
    ]
    assert outputs[0].response_ids == outputs[1].response_ids
    engine = make_generator(model, tiny_tokenizer, engine="torch")
    assert engine.pad_token_id == tiny_tokenizer.pad_token_id and engine.vocab_size == len(tiny_tokenizer)


def test_unknown_engine_names_the_choices(tiny_tokenizer):
    with pytest.raises(ValueError, match="one of auto, torch, static"):
        make_generator(make_tiny_model("llama"), tiny_tokenizer, engine="fast")


def test_batch_limits_and_the_fit_check_reach_both_engines(tiny_tokenizer):
    """rollout.max_batch_tokens goes through make_generator; check_generation_fits asks the engine (a fake free-memory
    figure: one byte less than a row needs fails, naming the settings) and passes engines without a memory rule."""
    from opd.rollout import memory
    from opd.rollout.registry import check_generation_fits

    model = make_tiny_model("qwen3")
    total = 2**34
    for name in ("torch", "static"):
        engine = make_generator(
            model,
            tiny_tokenizer,
            engine=name,
            max_batch_tokens=500,
            free_memory=lambda device: (memory.margin_bytes(total) + 50 * 2**20, total),
        )
        assert engine.max_batch_tokens == 500
        check_generation_fits(engine, prompt_tokens=8, new_tokens=16)
        with pytest.raises(ValueError, match=r"at most rollout\.max_new_tokens=\d+ fits after a 8-token prompt"):
            check_generation_fits(
                engine, prompt_tokens=8, new_tokens=10**6, names=("data.max_prompt_length", "rollout.max_new_tokens")
            )
    check_generation_fits(object(), prompt_tokens=8, new_tokens=10**9)


def test_max_batch_tokens_is_a_checked_config_key():
    from opd.config import SamplingSpec

    assert SamplingSpec().max_batch_tokens is None and SamplingSpec(max_batch_tokens=4096).max_batch_tokens == 4096
    with pytest.raises(ValueError, match="max_batch_tokens"):
        SamplingSpec(max_batch_tokens=0)


def _members(protocol: type) -> list[str]:
    return sorted(name for name in (*vars(protocol), *protocol.__annotations__) if not name.startswith("_"))


def test_every_engine_and_scorer_implements_every_protocol_member(tiny_tokenizer):
    """Callers call every member directly (no getattr): each registered engine and teacher scorer defines all of them
    (a no-op where it has nothing to do), taking every argument the protocol names."""
    import inspect

    engines = {"torch": TorchGenerator, "static": StaticGenerator, "vllm": VLLMGenerator}
    scorers = {"local": LocalScorer, "served": RemoteScorer, "vllm": VLLMScorer}
    assert engine_names() == ["auto", *engines] and scorer_names() == list(scorers)
    assert _members(Generator) == ["check_fits", "close", "generate", "release", "sync_weights"]
    assert _members(TeacherScorer) == ["close", "score", "score_async", "serves_requested_ids"]
    for protocol, classes in ((Generator, engines), (TeacherScorer, scorers)):
        for cls in classes.values():
            for name in _members(protocol):
                if name in protocol.__annotations__:  # an attribute: on the class, or declared and set by __init__
                    assert hasattr(cls, name) or name in cls.__annotations__, (cls, name)
                    continue
                wanted = inspect.signature(getattr(protocol, name)).parameters
                given = inspect.signature(getattr(cls, name)).parameters
                for parameter in wanted.values():
                    assert parameter.name in given and given[parameter.name].kind == parameter.kind, (cls, name)

    model = make_tiny_model("qwen3")
    for name in ("torch", "static"):
        engine = make_generator(model, tiny_tokenizer, engine=name)
        assert isinstance(engine, Generator)
        engine.check_fits(8, 16)  # CPU: no memory rule
        engine.release()
        engine.close()
    scorer = LocalScorer(model, vocab_size=len(tiny_tokenizer))
    assert isinstance(scorer, TeacherScorer) and scorer.serves_requested_ids
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    rollouts = Rollouts(
        ids,
        torch.ones_like(ids, dtype=torch.bool),
        torch.tensor([3]),
        ids[:, 3:],
        torch.ones(1, 3, dtype=torch.bool),
        torch.tensor([0]),
        torch.tensor([False]),
    )
    requested = torch.tensor([[[1, 2], [3, 4], [5, 6]]])
    pending, direct = (
        start_scoring(scorer, rollouts, top_k=4, requested_ids=requested),
        scorer.score(rollouts, top_k=4, requested_ids=requested),
    )
    for field in ("sampled_logprobs", "topk_ids", "topk_logprobs", "entropy", "requested_logprobs"):
        assert torch.equal(getattr(pending.result(), field), getattr(direct, field)), field
    scorer.close()


def test_vllm_arguments_come_from_the_config_sections():
    model = ModelSpec(path="m", dtype="bf16", trust_remote_code=True)
    arguments = vllm_arguments(VLLMSpec(gpu_memory_utilization=0.5, max_model_len=64), model)
    assert arguments == dict(
        model_path="m",
        engine_options=EngineOptions(
            dtype="bf16", gpu_memory_utilization=0.5, max_model_len=64, trust_remote_code=True
        ),
    )
    assert vllm_arguments(None, model, model_path="/resolved")["engine_options"] == EngineOptions(
        dtype="bf16", trust_remote_code=True
    )
    assert vllm_arguments(None, model, model_path="/resolved")["model_path"] == "/resolved"
