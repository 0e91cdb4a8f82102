"""Which teacher scorer a run uses: one registry by name, the only place that builds a `TeacherScorer` from a config.

Every command that scores with a teacher (`opd distill`, `opd prompts score`) asks `load_teacher`; each placement is
one builder in the `_SCORERS` table below and one module beside it: local (`LocalScorer`, an in-process model),
served (`teacher.url`: `RemoteScorer` of one or several `opd serve-teacher`s) and vllm (`VLLMScorer`, the vllm
extra; sampled-token and the teacher's own top-k only). The config's names are `opd.names.TeacherEngineName`,
checked at import; the shape is `opd.rollout.registry`'s (docs/design.md, "opd.teacher.registry"). The tokenizer
check (SPEC §1: the teacher scores the student's token ids) happens here for every placement, with the same
one-line error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

import torch

from opd.config import ModelSpec, TeacherEntry, TeacherRoute
from opd.config.sections import route_text
from opd.data.prompts import MISSING, get_field
from opd.models import check_tokenizer_compatibility, load_model, load_tokenizer, resolve_device, resolve_dtype
from opd.names import TeacherEngineName
from opd.objectives.diagnostics import diagnostic_top_k
from opd.rollout.vllm_engine import config_rows, engine_options, vllm_available
from opd.teacher.base import TeacherScorer
from opd.teacher.client import remote_scorer
from opd.teacher.local import LocalScorer
from opd.teacher.vllm_scorer import VLLMScorer, check_objective
from opd.types import Prompt


@dataclass
class Teacher:
    """A ready teacher.

    scorer: what the trainer calls
    module: the in-process model behind a local scorer (compiled, offloaded and moved by the trainer); None when the
            teacher runs elsewhere
    vocab:  the `VocabInfo` the student and this teacher share (`opd.models.check_tokenizer_compatibility`)
    """

    scorer: TeacherScorer
    module: torch.nn.Module | None
    vocab: Any


@dataclass
class TeacherRequest:
    """What a caller knows when it asks for a teacher (`load_teacher`'s arguments). Builders take what they need.

    spec:                 the teacher config (`TeacherSpec`; a plain `ModelSpec` is a local teacher)
    student_tokenizer:    the student's tokenizer, which the teacher's must equal
    student_rows:         rows of the student's output layer
    student_device:       where the student is (an in-process teacher goes beside it unless told otherwise)
    world_size:           processes of the run (torchrun)
    offload:              keep an in-process teacher on the CPU (the trainer moves it to the GPU while it scores)
    max_tokens_per_batch: the local scorer's forward budget
    objective:            the `ObjectiveSpec` the scores are for (a vLLM teacher checks it can serve it);
                          None: unchecked
    max_batch_size:       rows a vLLM teacher scores together
    """

    spec: ModelSpec
    student_tokenizer: Any
    student_rows: int
    student_device: torch.device
    world_size: int = 1
    offload: bool = False
    max_tokens_per_batch: int = 32768
    objective: Any = None
    max_batch_size: int = 256


@dataclass
class RoutedTeacher:
    """One teacher of a run (`DistillConfig.teacher_entries`), ready: its entry (name, route, temperature, offload)
    and the loaded `Teacher`."""

    entry: TeacherEntry
    teacher: Teacher
    prompt_ids: list[list[int]] | None = None  # with a view: every prompt's ids as this teacher sees it
    cross: Any = None  # another vocabulary: its `opd.teacher.cross_vocab.CrossVocab` (prompt_ids: its own rendering)

    @property
    def name(self) -> str:
        return self.entry.name


def route_prompts(prompts: list[Prompt], entries: list[TeacherEntry]) -> list[int]:
    """The index into `entries` of the teacher of every prompt: the one whose route matches it, else the default
    one. A prompt that no route matches (and no default), or that two routes match, is a one-line error naming the
    prompt and the routes."""
    default = [i for i, e in enumerate(entries) if e.route is None or e.route.default]
    routes = "; ".join(f"{e.name}: {(e.route or TeacherRoute(default=True)).describe()}" for e in entries)
    out = []
    for prompt in prompts:
        matched = [i for i, e in enumerate(entries) if e.route is not None and _matches(e.route, prompt)]
        if len(matched) > 1:
            raise ValueError(
                f"prompt {prompt.id} matches the routes of {' and '.join(entries[i].name for i in matched)} "
                f"(routes: {routes}); give every prompt exactly one teacher"
            )
        if not matched and not default:
            raise ValueError(
                f"prompt {prompt.id} (data_source {prompt.source!r}) matches no teacher's route (routes: {routes}); "
                f"add its value to a route or give one teacher route: {{default: true}}"
            )
        out.append(matched[0] if matched else default[0])
    return out


def view_prompts(prompts: list[Prompt], entry: TeacherEntry, mine: list[bool]) -> list[Prompt]:
    """The prompts as `entry`'s view shows them: its context column appended to the last user message of every
    prompt routed to it (`mine`); the others unchanged. A routed prompt without the context is a one-line error."""
    view = entry.view
    if view is None:
        return prompts
    out = []
    for prompt, routed in zip(prompts, mine):
        if not routed:
            out.append(prompt)
            continue
        value = prompt.answer if view.context_key == "answer" else get_field(prompt.meta, view.context_key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is MISSING or value is None or not str(value).strip():
            raise ValueError(
                f"prompt {prompt.id} has no {view.context_key!r} for teacher {entry.name}'s view "
                f"(view.context_key); give every prompt routed to it that column"
            )
        messages = [dict(m) for m in prompt.messages]
        last = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=len(messages) - 1)
        messages[last]["content"] = messages[last].get("content", "") + view.context_template.format(context=value)
        out.append(Prompt(prompt.id, messages, prompt.answer, prompt.source, dict(prompt.meta)))
    return out


def route_value(route: TeacherRoute, prompt: Prompt) -> str | None:
    """The value of the prompt's column that `route` reads, as a string (None when the prompt has no such column)."""
    key = "data_source" if route.data_source is not None else route.route_key
    if key == "data_source":
        return prompt.source
    if key == "id":
        return prompt.id
    value = get_field(prompt.meta, str(key))
    return None if value is MISSING or value is None else route_text(value)


def _matches(route: TeacherRoute, prompt: Prompt) -> bool:
    if route.default:
        return False
    values = route.data_source if route.data_source is not None else route.values
    return route_value(route, prompt) in (values or [])


def scorer_names() -> list[str]:
    """Every placement `load_teacher` builds."""
    return list(_SCORERS)


def resolve_scorer(spec: ModelSpec) -> str:
    """The placement `spec` means: "served" with `teacher.url`, else `teacher.engine` (local for a plain
    `ModelSpec`)."""
    if getattr(spec, "url", None) is not None:
        return "served"
    engine = getattr(spec, "engine", "local")
    if engine not in _SCORERS:
        raise ValueError(f"teacher scorer must be one of {', '.join(scorer_names())}, got {engine!r}")
    return engine


def model_key(entry: TeacherEntry) -> str:
    """What identifies the model an entry loads: entries with equal keys share one loaded teacher. A served teacher's
    key is its name (its own scorer and connections)."""
    if resolve_scorer(entry) == "served":
        return f"served:{entry.name}"
    return repr(sorted(entry.model_dump(exclude={"name", "temperature", "route", "view"}).items()))


def load_teacher(
    spec: ModelSpec,
    *,
    student_tokenizer: Any,
    student_rows: int,
    student_device: torch.device,
    world_size: int = 1,
    offload: bool = False,
    max_tokens_per_batch: int = 32768,
    objective: Any = None,
    max_batch_size: int = 256,
) -> Teacher:
    """Build the teacher `spec` describes (the placements: the module docstring; the arguments: `TeacherRequest`)."""
    request = TeacherRequest(
        spec=spec,
        student_tokenizer=student_tokenizer,
        student_rows=student_rows,
        student_device=student_device,
        world_size=world_size,
        offload=offload,
        max_tokens_per_batch=max_tokens_per_batch,
        objective=objective,
        max_batch_size=max_batch_size,
    )
    return build_teacher(request)


def build_teacher(request: TeacherRequest) -> Teacher:
    """`load_teacher` for a caller that already holds its `TeacherRequest`."""
    return _SCORERS[resolve_scorer(request.spec)](request)


def load_teacher_module(request: TeacherRequest) -> tuple[Any, Any]:
    """(model, tokenizer) of an in-process teacher, placed as `request` says: beside the student unless its spec
    places it, on the CPU when offloaded."""
    spec = request.spec
    device = teacher_device(spec, request.student_device, request.world_size)
    dtype = resolve_dtype(spec.dtype, resolve_device(device))
    return load_model(
        spec.path,
        dtype=dtype,
        device="cpu" if request.offload else device,
        trust_remote_code=spec.trust_remote_code,
        attn_implementation=spec.attn_implementation,
    )


def check_teacher_tokenizer(spec: ModelSpec, student_tokenizer: Any) -> Any:
    """Cheap, before any model loads: the teacher's tokenizer must equal the student's (one-line error otherwise).
    A served teacher is asked for its /info (waiting for the server like any request)."""
    if resolve_scorer(spec) == "served":
        scorer = remote_scorer(spec)
        try:
            return scorer.check_tokenizer(student_tokenizer)
        finally:
            scorer.close()

    teacher_tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
    return check_tokenizer_compatibility(student_tokenizer, teacher_tokenizer)


def teacher_device(spec: ModelSpec, student_device: torch.device, world_size: int) -> str:
    """Where an in-process teacher goes: its own `device`, else beside each rank's student under torchrun, else a
    second GPU when there is one, else the student's device."""
    if spec.device != "auto":
        return spec.device
    if world_size > 1:
        return str(student_device)  # a full teacher copy next to each rank's student shard
    if torch.cuda.device_count() > 1:
        return "cuda:1"  # the teacher on its own GPU when there is one
    return "auto"


def check_teacher_serves(spec: ModelSpec, objective: Any) -> None:
    """Cheap, before any model loads: a one-line error when the teacher's engine cannot give what `objective` (an
    `ObjectiveSpec`) needs. The local scorer serves everything; a served teacher is asked for its /info: each step
    asks it for the top-k of `diagnostic_top_k` and as many requested ids (the student's top-k)."""
    if resolve_scorer(spec) == "served":
        k = diagnostic_top_k(objective.top_k)
        scorer = remote_scorer(spec)
        try:
            too_wide, url = scorer.width_error(k, k if scorer.serves_requested_ids else 0), scorer.replicas[0].url
        finally:
            scorer.close()
        if too_wide is not None:
            diagnostics = "" if objective.top_k else f" (the diagnostics' top-{k})"
            raise ValueError(
                f"objective.top_k={objective.top_k}{diagnostics} is more than the teacher at {url} serves: "
                f"{too_wide}; serve it with max_top_k and max_requested_ids of at least {k}"
                + (", or lower objective.top_k" if objective.top_k else "")
            )
    if resolve_scorer(spec) == "vllm":
        if not vllm_available():
            raise ValueError("teacher.engine=vllm needs the vllm package (README: vLLM); or use teacher.engine=local")
        check_objective(objective)


def _local(request: TeacherRequest) -> Teacher:
    module, tokenizer = load_teacher_module(request)
    vocab = check_tokenizer_compatibility(
        request.student_tokenizer,
        tokenizer,
        student_vocab_size=request.student_rows,
        teacher_vocab_size=module.get_output_embeddings().weight.shape[0],
    )
    # ids beyond the tokenizer are embedding padding rows: never a top-k candidate (SPEC §1)
    scorer = LocalScorer(module, max_tokens_per_batch=request.max_tokens_per_batch, vocab_size=vocab.tokenizer_size)
    return Teacher(scorer=scorer, module=module, vocab=vocab)


def _served(request: TeacherRequest) -> Teacher:
    """Nothing loads here: the server holds the model."""
    scorer = remote_scorer(request.spec)
    return Teacher(
        scorer=scorer,
        module=None,
        vocab=scorer.check_tokenizer(request.student_tokenizer, student_rows=request.student_rows),
    )


def _vllm(request: TeacherRequest) -> Teacher:
    spec, objective = request.spec, request.objective
    tokenizer = load_tokenizer(spec.path, trust_remote_code=spec.trust_remote_code)
    vocab = check_tokenizer_compatibility(
        request.student_tokenizer,
        tokenizer,
        student_vocab_size=request.student_rows,
        teacher_vocab_size=config_rows(spec.path, trust_remote_code=spec.trust_remote_code),
    )
    options = engine_options(getattr(spec, "vllm", None), spec)
    top_k = diagnostic_top_k(getattr(objective, "top_k", 0) or 0)  # what the trainer asks for, diagnostics included
    scorer = VLLMScorer(
        spec.path,
        vocab_size=vocab.tokenizer_size,
        options=options,
        max_top_k=top_k,
        max_batch_size=request.max_batch_size,
    )
    if objective is not None:
        check_objective(objective, serves_requested_ids=scorer.serves_requested_ids)
    return Teacher(scorer=scorer, module=None, vocab=vocab)


_SCORERS: dict[str, Callable[[TeacherRequest], Teacher]] = {"local": _local, "served": _served, "vllm": _vllm}
if set(get_args(TeacherEngineName)) != set(_SCORERS) - {"served"}:  # the config's type and this table agree
    raise ImportError(
        f"opd.names.TeacherEngineName {get_args(TeacherEngineName)} and the scorer table {list(_SCORERS)} differ"
    )
