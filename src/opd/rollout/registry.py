"""Which generation engine runs: one registry by name, the only place that knows every engine.

Every caller asks `make_generator(engine, ...)` for a `Generator`: torch (`TorchGenerator`), static
(`StaticGenerator`), vllm (`VLLMGenerator`, the vllm extra) or auto (static on CUDA for a supported layout, else
torch, with one line on stderr naming what the static engine cannot run; the table: docs/design.md,
"opd.rollout.registry"). Adding an engine is one module, one builder in the `_ENGINES` table below and its name in
`opd.names.EngineName` (checked at import); no engine module imports another, and vLLM itself is imported only when
its engine is built. `opd.teacher.registry` has the same shape.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, get_args

import torch
from transformers import AutoConfig, GenerationConfig

from opd.config import ModelSpec, VLLMSpec
from opd.models import eos_token_ids
from opd.names import EngineName
from opd.rollout import vllm_engine
from opd.rollout.base import Generator
from opd.rollout.static_engine import StaticGenerator, unsupported_reason
from opd.rollout.torch_engine import TorchGenerator


@dataclass
class EngineRequest:
    """What a caller knows when it asks for an engine. Engines take what they need and ignore the rest.

    model:            the in-process Hugging Face module (the trainer's student, a loaded model); None when the
                      engine loads its own copy from `model_path`
    tokenizer:        its tokenizer: EOS ids, pad id and the sampling range (`len(tokenizer)`) come from it
    model_path:       the model's directory or hub id, for engines that load weights themselves
    max_batch_size:   most sequences decoded together, ≥ 1
    max_batch_tokens: most KV-cache tokens at once (rows × (prompt + max_new_tokens)); None: the engine's own rule
                      (the in-process engines: as many rows as fit in the device memory free at each call)
    vocab_size:       ids ≥ vocab_size are never sampled (embedding padding rows); None: len(tokenizer)
    options:          engine-specific keyword arguments, passed through
    """

    model: torch.nn.Module | None
    tokenizer: Any
    model_path: str | None = None
    max_batch_size: int = 64
    max_batch_tokens: int | None = None
    vocab_size: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


def engine_names() -> list[str]:
    """Every name `make_generator` accepts, "auto" first."""
    return ["auto", *_ENGINES]


def resolve_engine(engine: str, model: torch.nn.Module | None) -> str:
    """The concrete engine `engine` means for `model`: "auto" → "static" on CUDA for a supported layout, else
    "torch"."""
    if engine != "auto":
        if engine not in _ENGINES:
            raise ValueError(f"rollout engine must be one of {', '.join(engine_names())}, got {engine!r}")
        return engine
    if model is None:
        raise ValueError("engine 'auto' needs the in-process model to choose between torch and static")
    if not _static_pays(model):
        return "torch"
    reason = unsupported_reason(model)
    if reason is None:
        return "static"
    print(
        f"note: engine auto: the static engine cannot run {type(model).__name__}: {reason}; "
        "using the torch engine (decoding will be slower)",
        file=sys.stderr,
    )
    return "torch"


def _static_pays(model: torch.nn.Module) -> bool:
    """Whether "auto" would pick the static engine for a supported layout: the model is on CUDA."""
    return next(model.parameters()).device.type == "cuda"


def make_generator(
    model: torch.nn.Module | None,
    tokenizer: Any,
    *,
    engine: str = "auto",
    model_path: str | None = None,
    max_batch_size: int = 64,
    max_batch_tokens: int | None = None,
    vocab_size: int | None = None,
    **options: Any,
) -> Generator:
    """The `Generator` named `engine` (see the module docstring) for `model` / `model_path`, with EOS ids, pad id and
    the sampling range taken from `tokenizer`."""
    name = resolve_engine(engine, model)
    request = EngineRequest(
        model=model,
        tokenizer=tokenizer,
        model_path=model_path,
        max_batch_size=max_batch_size,
        max_batch_tokens=max_batch_tokens,
        vocab_size=vocab_size,
        options=options,
    )
    return _ENGINES[name](request)


def check_generation_fits(
    generator: Generator,
    *,
    prompt_tokens: int,
    new_tokens: int,
    reserve_bytes: int = 0,
    names: tuple[str, str] = ("prompt length", "max_new_tokens"),
) -> None:
    """Raise ValueError (one line saying what would fit) when the engine cannot hold even one sequence of
    prompt_tokens + new_tokens in the device memory free now, less reserve_bytes (memory that will be resident before
    the first call, e.g. optimizer state). Engines without a memory rule (their own server, a CPU) pass. Call it under
    the autocast that generation will run under. names: the settings to name in the message."""
    if isinstance(generator, Generator):  # every engine; anything else has no memory rule
        generator.check_fits(prompt_tokens, new_tokens, reserve_bytes=reserve_bytes, names=names)


def vllm_arguments(vllm: VLLMSpec | None, model: ModelSpec, *, model_path: str | None = None) -> dict[str, Any]:
    """`make_generator`'s arguments for engine vllm from the config sections: the path vLLM loads (`model.path`, or
    model_path where the caller resolved it) and the `EngineOptions` of `vllm_engine.engine_options`."""
    return dict(model_path=model_path or model.path, engine_options=vllm_engine.engine_options(vllm, model))


def check_vllm_rope(
    spec: ModelSpec, vllm: VLLMSpec | None, run_length: int, what: str, *, path: str | None = None
) -> None:
    """Before vLLM starts: a model whose RoPE depends on the length must get from vLLM the table the run's longest
    sequence `run_length` fixes (`opd.models.fix_rope`; `vllm_engine.rope_refusal`), or a one-line ValueError naming
    `what` (the engine's setting). `path`: the files, where the caller resolved `spec.path`."""
    try:
        hf_config = AutoConfig.from_pretrained(path or spec.path, trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError):  # loading it says what is wrong, in one line
        return
    reason = vllm_engine.rope_refusal(hf_config, getattr(vllm, "max_model_len", None), run_length)
    if reason is not None:
        raise ValueError(f"{what} ({spec.path}): {reason}")


def _in_process(request: EngineRequest) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model and the arguments both in-process engines take, from the request's model and tokenizer."""
    if request.model is None:
        raise ValueError("the torch and static engines run an in-process model; none was given")
    return request.model, dict(
        eos_token_ids=eos_token_ids(request.model, request.tokenizer),
        pad_token_id=request.tokenizer.pad_token_id,
        vocab_size=request.vocab_size or len(request.tokenizer),
        max_batch_size=request.max_batch_size,
        max_batch_tokens=request.max_batch_tokens,
        **request.options,
    )


def _torch(request: EngineRequest) -> Generator:
    model, arguments = _in_process(request)
    return TorchGenerator(model, **arguments)


def _static(request: EngineRequest) -> Generator:
    model, arguments = _in_process(request)
    reason = unsupported_reason(model)
    if reason is not None:
        raise ValueError(
            f"engine 'static' cannot run {type(model).__name__}: {reason}; use engine 'auto' or 'torch' "
            "(the torch engine runs it, decoding more slowly)"
        )
    return StaticGenerator(model, **arguments)


def _vllm(request: EngineRequest) -> Generator:
    """options: `engine_options` (an `EngineOptions`), `weights_fn` (full weights for the sync under torchrun) and
    `eos_token_ids` (else from the tokenizer and the model directory's configs)."""
    if request.model_path is None:
        raise ValueError("engine 'vllm' loads the model itself and needs its path (model_path)")
    options = dict(request.options)
    eos = options.pop("eos_token_ids", None)
    if eos is None:
        eos = _eos_ids_from_path(request.model_path, request.tokenizer, request.model)
    engine_options = options.pop("engine_options", None) or vllm_engine.EngineOptions()
    return vllm_engine.VLLMGenerator(
        request.model_path,
        eos_token_ids=eos,
        max_batch_size=request.max_batch_size,
        vocab_size=request.vocab_size or len(request.tokenizer),
        options=engine_options,
        module=request.model,
        weights_fn=options.pop("weights_fn", None),
        **options,
    )


def _eos_ids_from_path(path: str, tokenizer: Any, model: torch.nn.Module | None) -> list[int]:
    """`opd.models.eos_token_ids` from the in-process model when there is one, else from the directory's config and
    generation config (no weights loaded)."""
    if model is not None:
        return eos_token_ids(model, tokenizer)
    config = AutoConfig.from_pretrained(path)
    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        generation = None
    return eos_token_ids(SimpleNamespace(config=config, generation_config=generation), tokenizer)


_ENGINES: dict[str, Callable[[EngineRequest], Generator]] = {"torch": _torch, "static": _static, "vllm": _vllm}
if set(get_args(EngineName)) != {"auto", *_ENGINES}:  # the config's type and this table name the same engines
    raise ImportError(f"opd.names.EngineName {get_args(EngineName)} and the engine table {list(_ENGINES)} differ")
