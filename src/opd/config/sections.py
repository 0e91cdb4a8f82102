"""The config sections shared by commands: models, teachers, prompt sets, sampling, objective, optimizer, run, eval.

Plain data (layer L0): pydantic models with typed, documented fields. Each command's own config, built from these,
lives in `opd.config.<command>`; loading YAML and `key=value` overrides lives in `opd.config.loader`. Bad values are
rejected, never rewritten.
"""

from __future__ import annotations

import re
import string
import urllib.parse
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from opd.names import EngineName, TeacherEngineName, benchmark_names


def _split_commas(value: Any) -> Any:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


CommaList = Annotated[list[str], BeforeValidator(_split_commas)]
"""A list of names that also accepts one comma-separated string (`aime24,amc23`), as the CLI passes it."""


def _reported_apart(benchmarks: list[str]) -> list[str]:
    benchmark_names(benchmarks)  # raises where two would share a name
    return benchmarks


BenchmarkList = Annotated[list[str], BeforeValidator(_split_commas), AfterValidator(_reported_apart)]
"""`CommaList` of benchmarks, each reported under its own name (`opd.names.benchmark_names`)."""


# ------------------------------------------------------------------------------------------------ names and bounds

NAME_MAX_CHARS = 64
_IDENTIFIER = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{NAME_MAX_CHARS - 1}}}")
# Names a file system refuses or treats as a device (Windows, case-insensitive, with any extension), and the files
# that sit beside a teacher's folder in `opd check --out` (`<out>/<name>/` next to `<out>/check.json`).
_RESERVED_NAMES = frozenset(
    ["con", "prn", "aux", "nul", *(f"com{i}" for i in range(1, 10)), *(f"lpt{i}" for i in range(1, 10))]
)
_RESERVED_FILES = frozenset(["check.json"])


def _identifier(value: str) -> str:
    """A name that becomes a folder or a file name (a teacher's `opd check` folder, a dataset file): letters, digits,
    '_', '-' and '.' (not first: no `.`, `..` or hidden name), at most NAME_MAX_CHARS, no reserved name."""
    accepted = (
        f"letters, digits, '_', '-' and '.', starting with a letter or digit, at most {NAME_MAX_CHARS} characters"
    )
    if not _IDENTIFIER.fullmatch(value):
        shown = repr(value) if len(value) <= NAME_MAX_CHARS else f"a name of {len(value)} characters"
        raise ValueError(f"a name is an identifier ({accepted}), got {shown}")
    if value.lower().split(".")[0] in _RESERVED_NAMES or value.lower() in _RESERVED_FILES:
        raise ValueError(f"{value!r} is a reserved file name; choose another name ({accepted})")
    return value


Identifier = Annotated[str, AfterValidator(_identifier)]
"""A name used as a folder or file name: validated at config load, never at the write that would use it."""


def _folder_name(value: str | None) -> str | None:
    """One folder name (`run.name`): not empty, `.` or `..`, no path separator or NUL, at most 128 characters, no
    reserved name (spaces and other characters stay allowed: it names nothing but the folder)."""
    if value is None:
        return None
    accepted = "one folder name (not empty, '.' or '..'; no '/' or '\\'), at most 128 characters"
    if value in ("", ".", "..") or any(c in value for c in "/\\\0") or len(value) > 128:
        shown = repr(value) if len(value) <= 128 else f"a name of {len(value)} characters"
        raise ValueError(f"{accepted}, got {shown} (put a path in run.out_dir)")
    if value.lower().split(".")[0] in _RESERVED_NAMES:
        raise ValueError(f"{value!r} is a reserved file name; choose another name")
    return value


FolderName = Annotated[str | None, AfterValidator(_folder_name)]

# The temperatures a config accepts: 0 where a key means greedy by it, else [MIN_TEMPERATURE, MAX_TEMPERATURE] for a
# teacher's and from MIN_TEMPERATURE up for a sampler's. τ divides logits in float32 (z / τ, then log_softmax). Below
# float32's smallest normal number, 1.2e-38, τ is not even representable (1e-40 is subnormal, 1e-300 rounds to 0, and
# z / 0 = inf: "probability tensor contains inf/nan"). Above it, log-probs at τ reach |Δz| / τ, with logit gaps Δz of
# trained models up to ~1e3, and the step squares and sums them over thousands of tokens (grad norms, reward
# variances), which float32 holds up to 3.4e38: (1e3 / τ)² · 1e4 < 3.4e38 needs τ > ~5e-15. The bound is the range a
# served teacher's wire accepts (opd.teacher.wire.MIN_TEMPERATURE / MAX_TEMPERATURE, test_sections.py keeps them
# equal), far inside that limit, so that one range holds for every teacher; at 1e-6 sampling is greedy for every
# practical purpose.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6


def _temperature(value: float | None) -> float | None:
    if value is not None and 0 < value < MIN_TEMPERATURE:
        raise ValueError(
            f"{value:g} is below {MIN_TEMPERATURE:g}, where logits / temperature break float32 arithmetic (use a "
            f"temperature ≥ {MIN_TEMPERATURE:g}; 0 for greedy where the key allows it)"
        )
    return value


def _teacher_temperature(value: float | None) -> float | None:
    if value is not None and value > MAX_TEMPERATURE:
        raise ValueError(
            f"{value:g} is above {MAX_TEMPERATURE:g}, the most a served teacher accepts (use a temperature in "
            f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}])"
        )
    return _temperature(value)


Temperature = Annotated[float, AfterValidator(_temperature)]
"""A sampling temperature: 0 (greedy, where the field allows it) or ≥ MIN_TEMPERATURE."""
TeacherTemperature = Annotated[float, AfterValidator(_teacher_temperature)]
"""A teacher's temperature τ_T: in [MIN_TEMPERATURE, MAX_TEMPERATURE], the range a served teacher accepts."""

# rollout.max_staleness: each step of staleness keeps one more prompts_per_step x n batch of samples in flight (memory,
# and a partial/lag_<k>_frac metric each step); asynchronous RL recipes use 1 to 4, and a sample older than a few
# steps is mostly restarted anyway. A larger value costs memory and logging without bound and buys nothing.
MAX_STALENESS = 16


_TOOL_NAME = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def _tool_name(value: str | None) -> str | None:
    if value is None or value in ("python", "calculator") or _TOOL_NAME.match(value):
        return value
    raise ValueError(f"must be python, calculator or an import path 'package.module:factory', got {value!r}")


ToolFormat = Literal["hermes", "markdown"]
TOOL_FORMAT_HELP = (
    "How the model writes tool calls: hermes (Qwen / Hermes <tool_call> JSON blocks) or markdown (a turn ending in a "
    "closed ```python block runs it with the python tool; Qwen2.5-Math / ToRA-style tool-integrated reasoning)."
)


def check_tool_format(tools: str | None, tool_format: str, prefix: str = "") -> None:
    """Refuse markdown with the calculator (its blocks carry code only); a user environment is checked at startup
    (`opd.tools.calls.check_tool_format`: it must offer a tool named python)."""
    if tool_format == "markdown" and tools == "calculator":
        raise ValueError(
            f"{prefix}tool_format=markdown: code blocks call the python tool, {prefix}tools=calculator has none; "
            f"use {prefix}tools=python or {prefix}tool_format=hermes"
        )


def _staleness(value: int) -> int:
    if value > MAX_STALENESS:
        raise ValueError(
            f"{value} is above {MAX_STALENESS}: each step of staleness keeps another prompts_per_step x rollout.n "
            f"samples in flight and logs another partial/lag metric (asynchronous RL uses 1 to 4); use 0 to "
            f"{MAX_STALENESS}"
        )
    return value


class Section(BaseModel):
    # allow_inf_nan=False: every float field of every config rejects NaN and ±inf with the key's name (a temperature
    # of inf samples uniformly, a NaN lr trains nothing, and neither is ever meant).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)


class ModelSpec(Section):
    """Where a model comes from and how it is placed."""

    path: str = Field(description="Hugging Face model id or local directory (save_pretrained layout).")
    dtype: str = Field("auto", description="auto (bf16 on GPU, fp32 on CPU), bf16, fp16 or fp32.")
    device: str = Field("auto", description="auto (cuda if present, else cpu), cpu, cuda, cuda:N.")
    trust_remote_code: bool = Field(False, description="Allow custom model code from the hub (off: safer).")
    attn_implementation: str | None = Field(
        None,
        description="sdpa, eager, flex_attention, flash_attention_2, opd_varlen (SDPA, with packed rows through "
        "FlashAttention varlen); None: library default, opd_varlen in place of sdpa on CUDA.",
    )


class VLLMSpec(Section):
    """vLLM engine options (`engine: vllm` for rollouts, evaluation, teacher rollout; `teacher.engine: vllm`)."""

    gpu_memory_utilization: float = Field(
        0.3,
        gt=0.0,
        le=1.0,
        description="GPU: fraction of the GPU's memory the engine may take (weights + KV cache), in (0, 1]; keep it "
        "small beside a trainer. Ignored when kv_cache_gb is set.",
    )
    kv_cache_gb: float | None = Field(
        None,
        gt=0.0,
        description="KV-cache size in GiB; None: 1 on CPU (vLLM's own default reserves 0.92 x RAM), by "
        "gpu_memory_utilization on GPU.",
    )
    enforce_eager: bool | None = Field(
        None,
        description="No torch.compile / CUDA graphs in the engine; None: on for CPU (compiling is slow there), "
        "off on GPU.",
    )
    sleep: bool | None = Field(
        None,
        description="Offload the engine's weights and KV cache while the trainer scores and updates (vLLM sleep "
        "level 1); None: on for distill where the platform supports it (CUDA; the CPU build ignores sleep).",
    )
    max_model_len: int | None = Field(
        None,
        ge=1,
        description="Longest prompt + response the engine accepts, in tokens; "
        "None: the model's max_position_embeddings.",
    )


STUDENT_INIT = "student_init"
"""`teachers[i].path` that makes the student's initial weights (student.path) the teacher."""
STUDENT = "student"
"""`teachers[i].path` that makes the live student (its current weights, updated every step) the teacher: scored
without grad by the student's own scorer, no second model loaded."""


class TeacherSpec(ModelSpec):
    """The teacher: a model loaded in process (`path`, scored by the local scorer or a vLLM engine), or one served by
    `opd serve-teacher` (`url`)."""

    # None with url: wider than ModelSpec.path on purpose (a field override pydantic allows)
    path: str | None = Field(  # type: ignore[assignment]
        None,
        description="Hugging Face model id or local directory; not needed with url (the "
        "server's /info names the model).",
    )
    engine: TeacherEngineName = Field(
        "local",
        description="With path: local = an in-process HF model (any strategy); vllm = an in-process vLLM engine "
        "scoring with prompt_logprobs (top_k=0 or strategy only_tch, teacher_temperature 1).",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")
    url: str | list[str] | None = Field(
        None,
        description="http://host:port of an `opd serve-teacher`, or a list of "
        "replicas (balanced by tokens in flight); None: load `path` in process.",
    )
    token_file: str | None = Field(
        None,
        description="File with the server's bearer token; None: the environment variable named by token_env, if set.",
    )
    token_env: str = Field(
        "OPD_TEACHER_TOKEN", description="Environment variable holding the token (never written into config.yaml)."
    )
    timeout: float = Field(300.0, gt=0, description="Seconds without an answer before a request is retried.")
    retry_deadline: float = Field(
        600.0,
        ge=0,
        description="Seconds a request keeps retrying an unreachable or busy "
        "server (e.g. while it restarts) before the run stops with an error.",
    )
    request_tokens: int = Field(
        16384, ge=1, description="Tokens per request; a larger batch is split into requests sent concurrently."
    )
    logprobs: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Wire dtype of the log-probs: float32 (exact) or bfloat16 (fewer bytes, ~3 significant digits).",
    )
    tokenizer: Literal["auto", "same", "cross"] = Field(
        "auto",
        description="auto: the student's token ids when the vocabularies agree, else the student's text under the "
        "teacher's own tokenizer (cross: in process, or served with tokenizer_path; the log says which); same: "
        "refuse another vocabulary; cross: always re-tokenize (README: cross-tokenizer distillation).",
    )
    tokenizer_path: str | None = Field(
        None,
        description="With url: the served teacher's tokenizer (local directory or hub id), which a cross teacher "
        "needs here to tokenize the student's text; its token → id map must hash to the server's /info vocab_hash "
        "(checked at startup). None: the served teacher scores the student's own ids.",
    )
    span_credit: Literal["prefix", "even", "last"] = Field(
        "even",
        description="A cross teacher's span log-prob on its student tokens: prefix (each token the teacher's own "
        "log-prob of its text, from the teacher's distribution inside the span; in-process teachers only), even (T/n "
        "each, the student's own log-prob kept per token) or last (the span's whole reward on its last token); "
        "docs/spec.md §9.",
    )
    answer: Literal["auto", "scores", "hidden"] = Field(
        "auto",
        description="What the teacher sends: scores (sampled, top-k and requested log-probs), or hidden (its final "
        "hidden states, E values a position, with its output head fetched once: the exact full distribution, every "
        "score computed here). auto: hidden where the objective needs the full distribution (full_* losses, "
        "token_reward=full_reverse_kl*), and for a served teacher where top-k scores would cost more bytes than "
        "hidden states (opd.teacher.base.crossover_k); else scores.",
    )
    hidden_dtype: Literal["bfloat16", "float16", "float32"] = Field(
        "bfloat16", description="Wire dtype of a served teacher's hidden states (answer=hidden)."
    )

    @model_validator(mode="after")
    def _path_or_url(self) -> TeacherSpec:
        if self.path == STUDENT:
            placed = [
                f"{name}={value}"
                for name, value, default in (
                    ("url", self.url, None),
                    ("engine", self.engine, "local"),
                    ("dtype", self.dtype, "auto"),
                    ("device", self.device, "auto"),
                    ("offload", bool(getattr(self, "offload", None)), False),  # a `teachers:` entry's
                    ("trust_remote_code", self.trust_remote_code, False),
                    ("attn_implementation", self.attn_implementation, None),
                    ("tokenizer", self.tokenizer, "auto"),
                    ("vllm", ",".join(sorted(self.vllm.model_fields_set)) or None, None),
                )
                if value != default
            ]
            if placed:
                raise ValueError(
                    f"{placed[0]} does not apply to path: {STUDENT}, which scores with the student itself "
                    f"(its weights, dtype and device); remove {placed[0].split('=')[0]}"
                )
        if self.path is None and self.url is None:
            raise ValueError("give teacher.path (a model to load) or teacher.url (an `opd serve-teacher`)")
        if self.tokenizer_path is not None and self.url is None:
            raise ValueError(
                "teacher.tokenizer_path names a served teacher's tokenizer (with teacher.url); a teacher loaded "
                "from teacher.path uses its own: remove tokenizer_path"
            )
        if self.url is not None and self.engine != "local":
            raise ValueError(
                f"teacher.url serves the teacher; teacher.engine={self.engine} applies to a teacher "
                f"loaded from teacher.path: set one of them"
            )
        if self.url is not None:
            loaded = [
                f"{name}={value}"
                for name, value, default in (
                    ("path", self.path, None),
                    ("device", self.device, "auto"),
                    ("dtype", self.dtype, "auto"),
                )
                if value != default
            ]
            if loaded:
                raise ValueError(
                    f"teacher.url serves the teacher; teacher.{loaded[0]} applies to a teacher loaded in process "
                    f"(the server chooses its model, device and dtype): set one of them"
                )
            for url in [self.url] if isinstance(self.url, str) else self.url:
                if "@" in urllib.parse.urlsplit(url).netloc:  # never echoed: the part before @ may be a password
                    raise ValueError(
                        "teacher.url: credentials in the URL (user:password@) are not accepted (they would be "
                        "printed and saved in config.yaml); give the token in teacher.token_file or token_env"
                    )
        return self


def _as_teacher_spec(value: Any) -> Any:
    """A plain `ModelSpec` given as a teacher (Python API) is read as the `TeacherSpec` with the same fields."""
    if isinstance(value, ModelSpec) and not isinstance(value, TeacherSpec):
        return value.model_dump(exclude_unset=True)
    return value


Teacher = Annotated[TeacherSpec, BeforeValidator(_as_teacher_spec)]


def route_text(value: Any) -> str:
    """A route value, or a prompt's column value, as routes compare it: text as it is (capitals matter), a number by
    its value (2, 2.0 and "2" are one value; 2.5 is "2.5"), true/false as True/False."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _as_strings(value: Any) -> Any:
    """Route values compare as text (`route_text`: a YAML `2` or `2.0` matches a column value 2, 2.0 or "2"); one
    value may stand alone. A mapping or a list as a value matches nothing a column holds: refused."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    for v in values:
        if isinstance(v, (dict, list)):
            raise ValueError(
                f"a route value is a text, a number or true/false, got {v!r}; to route on a field inside a "
                f"struct use route_key: column.field with values: [...]"
            )
    return [route_text(v) for v in values]


RouteValues = Annotated[list[str] | None, BeforeValidator(_as_strings)]


class TeacherRoute(Section):
    """Which prompts a teacher of `teachers:` scores: one of `data_source: [values]` (the prompt set's data_source
    column), `route_key: column` with `values: [...]` (any column, dotted keys reach into structs), or `default: true`
    (every prompt no other route takes)."""

    data_source: RouteValues = Field(None, description="The data_source values this teacher scores.")
    route_key: str | None = Field(None, description="A column of the prompt set; with values.")
    values: RouteValues = Field(None, description="The route_key values this teacher scores.")
    default: bool = Field(False, description="Score every prompt that no other teacher's route matches.")

    @model_validator(mode="after")
    def _one_form(self) -> TeacherRoute:
        forms = [self.data_source is not None, self.route_key is not None, self.default]
        if sum(forms) != 1:
            raise ValueError(
                "a route is one of data_source: [values], route_key: column + values: [...], default: true"
            )
        if (self.route_key is None) != (self.values is None):
            raise ValueError("route_key and values go together: route_key: column, values: [...]")
        return self

    def describe(self) -> str:
        """The route in one short phrase (startup table, errors)."""
        if self.default:
            return "default"
        if self.data_source is not None:
            return f"data_source in {self.data_source}"
        return f"{self.route_key} in {self.values}"


def _context_template(template: str) -> str:
    """`template`, or ValueError (one line) unless it is a `str.format` template whose only field is `{context}`,
    used at least once: `{{`/`}}` stand for literal braces, so `"{{context}}"` holds no
    field at all (the teacher would see the literal text), and `{source}`, `{0}`, `{context!r}` or a lone brace would
    fail (or differ) only when the first prompt is rendered."""
    accepted = "text holding {context} (the only field; {{ and }} for literal braces)"
    shown = repr(template) if len(template) <= 200 else f"a template of {len(template)} characters"
    try:
        fields = [(name, spec, conversion) for _, name, spec, conversion in string.Formatter().parse(template)]
    except ValueError as error:  # a lone { or }
        raise ValueError(f"{error} in {shown}; accepted: {accepted}") from None
    used = [(name, spec, conversion) for name, spec, conversion in fields if name is not None]
    for name, spec, conversion in used:
        if name != "context" or spec or conversion:
            field = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise ValueError(f"unknown field {field} in {shown}; accepted: {accepted}")
    if not used:
        raise ValueError(f"no {{context}} field in {shown}; accepted: {accepted}")
    return template


ContextTemplate = Annotated[str, AfterValidator(_context_template)]


class TeacherView(Section):
    """What a teacher sees beyond the student's prompt: a context column (e.g. the reference solution) appended to
    the last user message for this teacher only. The response token ids stay the student's."""

    context_key: str = Field(
        description="Column with the teacher-only context (dotted keys reach into structs; `answer`: the prompt's "
        "ground truth)."
    )
    context_template: ContextTemplate = Field(
        "\n\n{context}", description="How the context is appended to the teacher's user message; holds {context}."
    )


class TeacherEntry(TeacherSpec):
    """One teacher of `teachers:`: a model as `teacher:` has it (path, url or engine; dtype, device), a name, its
    own temperature and offload, and the route of the prompts it scores."""

    name: Identifier = Field(
        description="Names the teacher in metrics (teacher/<name>/...), messages and its `opd check` folder: "
        f"letters, digits, '_', '-', '.' (not first), at most {NAME_MAX_CHARS} characters."
    )
    temperature: TeacherTemperature | None = Field(
        None, gt=0.0, description="τ_T of this teacher; None: objective.teacher_temperature."
    )
    offload: bool | None = Field(
        None, description="Keep this teacher on CPU except while it scores; None: teacher_offload."
    )
    route: TeacherRoute | None = Field(None, description="The prompts it scores; None only for a single teacher (all).")
    view: TeacherView | None = Field(None, description="Teacher-only context appended to its prompt; None: none.")


class DataSpec(Section):
    """A prompt set and how to read and render it."""

    path: str = Field(description="Parquet / JSONL / JSON file, a `save_to_disk` dataset dir, or a hub dataset id.")
    prompt_key: str = Field(
        "prompt", description="Column with the prompt: chat messages or plain text. Dotted keys reach into structs."
    )
    answer_key: str | None = Field(
        "reward_model.ground_truth", description="Column with the ground truth; None: the set has none."
    )
    id_key: str | None = Field(
        None, description="Column with a stable prompt id; None: extra_info.index, else the row number."
    )
    split: str = Field("train", description="Split of a Hugging Face dataset.")
    template: str = Field(
        "keep", description="Instruction template: keep | dapo | boxed | custom:<text with {problem}>."
    )
    enable_thinking: bool | None = Field(
        None, description="Passed to the chat template (Qwen3 thinking on/off); None: template default."
    )
    max_prompt_length: int = Field(1024, ge=1, description="Longest rendered prompt in tokens.")
    on_overflow: Literal["filter", "error"] = Field(
        "filter", description="Longer prompts are dropped (and counted) or an error."
    )
    limit: int | None = Field(None, ge=1, description="Use only the first N prompts; None: all.")
    on_missing_answer: Literal["error", "skip", "keep"] = Field(
        "error",
        description="A row without a ground truth (null, absent, empty) while answer_key is set: error "
        "(one line naming the row), skip (dropped, counted in the log) or keep "
        "(no answer; OPD without GRPO needs none).",
    )


class SamplingSpec(Section):
    """Rollout sampling of the student during training."""

    n: int = Field(4, ge=1, description="Rollouts per prompt (the paper: 4).")
    temperature: Temperature = Field(
        1.0, gt=0.0, description="Student sampling temperature τ_S; also scales the student's log-probs (SPEC §1)."
    )
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="Nucleus mass; 1.0 = off (on-policy rewards assume full-support sampling)."
    )
    max_new_tokens: int = Field(
        1024, ge=1, description="Longest rollout in tokens; longer ones are truncated and counted."
    )
    batch_size: int = Field(256, ge=1, description="Sequences the generation engine runs together.")
    max_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Most KV-cache tokens the engine holds at once, counted as rows × (longest prompt + "
        "max_new_tokens); None = as many rows (≤ batch_size) as fit in the GPU memory free at each generation call.",
    )
    engine: EngineName = Field(
        "auto",
        description="auto: the static-KV-cache CUDA-graph engine on a GPU (one process), the torch engine otherwise; "
        "vllm: an in-process vLLM engine, weights pushed after every step (needs the vllm extra).",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")
    compiled_prefill: bool = Field(
        False,
        description="Static engine: run its packed prefills through the student's compiled decoder layers (faster "
        "prefills: docs/performance.md), warmed up before the first step with the layers; "
        "needs the static engine, compiled layers and opd_varlen attention (CUDA). Off: eager prefills.",
    )
    overlap: bool = Field(
        False,
        description="Generate step t+1's rollouts while step t scores and updates (one step of policy lag, from "
        "a bf16 snapshot of the step-t weights), corrected by truncated importance weights against the engine's own "
        "log-probs: needs objective.tis_cap. One process only; off: every step samples from its own weights.",
    )
    partial: bool = Field(
        False,
        description="Partial rollouts: samples are generated by segments (partial_segment tokens a call) and may "
        "finish under later weights; each step trains on prompts_per_step finished groups, oldest drawn first, and "
        "carries the rest (opd.train.stream). Needs objective.tis_cap when max_staleness > 0. One process only. With "
        "rollout.overlap the next step's batch is built during this step, from its weights (max_staleness >= 1).",
    )
    max_staleness: Annotated[int, AfterValidator(_staleness)] = Field(
        1,
        ge=0,
        description="rollout.partial: the most steps between a trained token's sampling weights and the update; a "
        "sample older than this is restarted (counted in partial/dropped). 0: the synchronous step.",
    )
    partial_segment: int | None = Field(
        None,
        ge=1,
        description="rollout.partial: the most new tokens per sample per generation call; None: max_new_tokens "
        "// (max_staleness + 1), with rollout.overlap // max_staleness, at least 1 (with max_staleness = 0 the whole "
        "max_new_tokens); with partial_early_stop and a divisor of 3 or more, the whole max_new_tokens (the stop rule "
        "ends calls; opd.train.stream.default_segment).",
    )
    partial_early_stop: bool = Field(
        False,
        description="rollout.partial: end a generation call as soon as the step can close (prompts_per_step groups "
        "finished and every sample at its last step of staleness finished) instead of at the end of its segment; "
        "the samples still decoding keep their tokens and continue in a later call (counted in partial/cut_total). "
        "The static and torch engines; vLLM runs each call to its end.",
    )
    tools: Annotated[str | None, AfterValidator(_tool_name)] = Field(
        None,
        description="Episodes with tools: each rollout is a conversation with this environment (python, calculator "
        "or package.module:factory), the teacher scores the student's tokens in the whole episode and the "
        "environment's tokens are left out of the loss. None: one answer per rollout.",
    )
    sandbox: Literal["namespaces", "rlimits-only"] = Field(
        "namespaces",
        description="How the python tool isolates code: namespaces (probed at startup; the run is refused where it "
        "does not hold) or rlimits-only (resource limits, no isolation; only when named, and said at startup).",
    )
    max_turns: int = Field(4, ge=1, description="rollout.tools: generation turns per episode (the last one answers).")
    tool_format: ToolFormat = Field("hermes", description="rollout.tools: " + TOOL_FORMAT_HELP)
    max_episode_tokens: int | None = Field(
        None,
        ge=1,
        description="rollout.tools: the most tokens after the prompt per episode, the student's and the "
        "environment's; at most max_new_tokens (the length engines and trainer are sized for). None: max_new_tokens.",
    )
    max_turn_tokens: int | None = Field(
        None, ge=1, description="rollout.tools: the most tokens per student turn; None: max_episode_tokens."
    )
    tool_workers: int | None = Field(
        None,
        ge=1,
        description="rollout.tools: threads answering the episodes' tool calls; None: one per episode, at most 32.",
    )
    tool_timeout_s: float | None = Field(
        None,
        gt=0,
        description="rollout.tools: a turn's tool calls not answered within this many seconds become error "
        "observations; None: the environment's own limits only (the python tool's sandbox wall time).",
    )

    @model_validator(mode="after")
    def _tool_format_has_tool(self) -> SamplingSpec:
        check_tool_format(self.tools, self.tool_format, "rollout.")
        return self


class ObjectiveSpec(Section):
    """What the token rewards, advantages and loss compute (SPEC §2–§4)."""

    top_k: int = Field(16, ge=0, description="Top-k candidates per position; 0 = sampled-token OPD.")
    strategy: Literal["only_stu", "only_tch", "intersection", "union", "union-intersection"] = Field(
        "only_stu", description="Which candidate ids get a reward (SPEC §2 table)."
    )
    weight: Literal["student_p", "teacher_p", "none"] = Field("student_p", description="Slot weights (SPEC §2).")
    teacher_temperature: TeacherTemperature = Field(1.0, gt=0.0, description="τ_T: scales the teacher's logits only.")
    advantage: Literal["token_reward", "grpo", "token_reward+grpo", "token_grpo"] = Field(
        "token_reward", description="Advantage estimator (SPEC §3); grpo needs no teacher."
    )
    outcome_weight: float = Field(1.0, ge=0.0, description="λ in token_reward+grpo.")
    loss: Literal["pg", "topk_kl", "full_reverse_kl", "forward_kl", "jsd", "full_forward_kl", "full_jsd"] = Field(
        "pg",
        description="pg: the paper's policy gradient on token rewards; others: extension objectives (SPEC §4); "
        "full_*: the exact divergence over the whole vocabulary, from the teacher's hidden states and head.",
    )
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="β of the generalised JSD (loss=jsd or full_jsd).")
    token_reward: Literal["log_ratio", "full_reverse_kl", "full_reverse_kl_next"] = Field(
        "log_ratio",
        description="loss=pg, top_k=0: the sampled token's reward. log_ratio: the paper's log q − log p of the "
        "token; full_reverse_kl: −KL(p‖q) exact at its position (a baseline: zero expected gradient, SPEC §4); "
        "full_reverse_kl_next: −KL(p‖q) exact at the next position (the state the token leads to).",
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        Field(
            "token-mean",
            description="How position losses are aggregated; token-mean is global over the optimizer batch.",
        )
    )
    clip_ratio_low: float = Field(0.2, ge=0.0, description="PPO ε_low.")
    clip_ratio_high: float = Field(0.2, ge=0.0, description="PPO ε_high.")
    clip_ratio_c: float = Field(3.0, gt=1.0, description="Dual-clip constant c for negative advantages.")
    kl_coef: float = Field(
        0.0, ge=0.0, description="Coefficient of a KL penalty to a frozen reference (0 = off, no reference loaded)."
    )
    kl_type: Literal["k1", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator for kl_coef.")
    entropy_coef: float = Field(0.0, ge=0.0, description="Entropy bonus coefficient (0 = off).")
    tis_cap: float | None = Field(
        None, gt=0.0, description="Truncated importance weight cap for rollouts from another engine; None = off."
    )


class OptimSpec(Section):
    lr: float = Field(1e-6, gt=0.0, description="Peak learning rate (the paper: 1e-6).")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    weight_decay: float = Field(0.01, ge=0.0, description="AdamW weight decay.")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon.")
    grad_clip: float = Field(1.0, gt=0.0, description="Global grad-norm clip; a non-finite norm skips the step.")
    schedule: Literal["constant", "cosine", "linear"] = Field("constant", description="LR schedule after warmup.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup steps from 0 to lr.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of cosine/linear decay as a fraction of lr.")
    state_dtype: Literal["fp32", "bf16"] = Field(
        "fp32",
        description="Storage of AdamW's two moments (the master weights stay as loaded): fp32 (8 bytes a "
        "parameter), or bf16 (4 bytes; exp_avg rounded to nearest, exp_avg_sq stochastically: "
        "`opd.train.optim.AdamW16`).",
    )
    fused: bool | None = Field(
        None,
        description="fp32 state: torch's fused AdamW kernel, which allocates no parameter-sized temporaries "
        "(foreach does: 4 bytes a parameter at every step). None: fused when every parameter is a plain CUDA tensor "
        "(not FSDP-sharded), else foreach.",
    )
    max_skipped_steps: int = Field(
        10,
        ge=0,
        description="Stop the run (an error) after this many consecutive steps skipped for a non-finite gradient "
        "norm; 0: never stop.",
    )

    @model_validator(mode="after")
    def _fused_state(self) -> OptimSpec:
        if self.fused and self.state_dtype == "bf16":
            raise ValueError(
                "optim.fused=true is torch's fused kernel for fp32 moments; optim.state_dtype=bf16 uses opd's "
                "AdamW16, which has no fused kernel: set one of them"
            )
        return self


class RunSpec(Section):
    """Where a run writes and how long it goes."""

    out_dir: str = Field("runs", description="Parent directory of run directories.")
    name: FolderName = Field(
        None, description="Run directory name (one folder, under out_dir); None: <command>-<time>."
    )
    seed: int = Field(0, description="Seed of data order, sampling and initialisation.")
    deterministic: bool = Field(
        False,
        description="Deterministic GPU kernels (torch.use_deterministic_algorithms, cuBLAS workspace "
        ":4096:8; opd.train.common.deterministic_kernels), so that a run and its resume, or two runs of one "
        "config, can agree bit for bit on a GPU (same hardware and software) as they do on a CPU without it; "
        "this process's kernels only (not a served teacher's; vLLM engines are refused); slower. A run and its "
        "resume agreed bit for bit on an H100 (benchmarks/check_cuda.py --only deterministic; its cost is not "
        "measured). Off: a GPU backward (e.g. attention's atomic adds) varies in its last bits, and two runs part "
        "from the first update on.",
    )
    steps: int = Field(100, ge=1, description="Optimizer steps (one per rollout batch).")
    save_every: int = Field(50, ge=0, description="Checkpoint every N steps (and at the end); 0 = only at the end.")
    keep_last: int | None = Field(2, ge=1, description="Keep the newest N checkpoints; None: keep all.")
    eval_every: int = Field(
        0, ge=0, description="Evaluate every N steps (and at the end when eval is configured); 0 = only at the end."
    )
    eval_at_start: bool = Field(
        True,
        description="Also evaluate before the first step (eval/step_0: the model before training, the report's "
        "'before'); only when eval is configured and not when resuming.",
    )
    resume: bool = Field(False, description="Continue from the newest complete checkpoint of the run directory.")
    overwrite: bool = Field(
        False,
        description="A new run into a run directory that holds anything moves the old "
        "directory aside to <name>.old-<time> (never deletes it); off: such a run is refused.",
    )
    allow_config_change: bool = Field(
        False,
        description="Let --resume continue with settings that change the math "
        "or data order (objective, rollout, data, optim, seed, models); off: refused, "
        "naming each changed key (opd.rundir.RESUMABLE lists the free ones).",
    )
    samples_per_step: int = Field(4, ge=0, description="Decoded rollouts with per-token rewards written to samples/.")
    tensorboard: bool = Field(False, description="Also log to TensorBoard (needs the tensorboard package).")
    wandb_project: str | None = Field(None, description="Also log to this W&B project (needs wandb).")
    report: bool = Field(True, description="Write plots and report.html at the end of the run.")


class EvalSpec(Section):
    """Periodic evaluation inside training (the `opd eval` machinery)."""

    benchmarks: BenchmarkList = Field(
        default_factory=list, description="Benchmarks to evaluate; empty = no evaluation."
    )
    n: int = Field(4, ge=1, description="Samples per problem.")
    temperature: Temperature = Field(0.7, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus mass.")
    max_new_tokens: int = Field(4096, ge=1, description="Longest response.")
    limit: int | None = Field(None, ge=1, description="First N problems of each benchmark.")
    prompt_key: str = Field("prompt", description="Prompt column of benchmark files given by path.")
    answer_key: str = Field("reward_model.ground_truth", description="Answer column of benchmark files given by path.")
    on_missing_answer: Literal["error", "skip"] = Field(
        "error",
        description="A benchmark row without a ground truth: error (one line naming it) or skip (dropped, counted).",
    )
