"""Typed configuration for every command: pydantic models, a YAML file, dotted `key=value` overrides.

A config is plain data. Precedence (later wins): model defaults < `--config file.yaml` < explicit CLI options <
positional `key=value` overrides. Unknown keys and wrong types fail at once with the dotted key's name and a
close-match suggestion; bad values are rejected, never rewritten. The resolved config is saved into the run dir.
"""

from __future__ import annotations

import difflib
import urllib.parse
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from opd.io import atomic_write_text
from opd.names import EngineName, TeacherEngineName, benchmark_names

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(ValueError):
    """A config problem, described in one line that names the key, the value and what is accepted."""


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

    path: str | None = Field(
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


def _as_strings(value: Any) -> Any:
    """Route values compare as strings (a YAML `2` matches a column value 2 or "2"); one value may stand alone."""
    if value is None:
        return None
    values = value if isinstance(value, list) else [value]
    return [str(v) for v in values]


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


class TeacherView(Section):
    """What a teacher sees beyond the student's prompt: a context column (e.g. the reference solution) appended to
    the last user message for this teacher only. The response token ids stay the student's."""

    context_key: str = Field(
        description="Column with the teacher-only context (dotted keys reach into structs; `answer`: the prompt's "
        "ground truth)."
    )
    context_template: str = Field(
        "\n\n{context}", description="How the context is appended to the teacher's user message; holds {context}."
    )

    @model_validator(mode="after")
    def _has_placeholder(self) -> TeacherView:
        if "{context}" not in self.context_template:
            raise ValueError(f"view.context_template must hold {{context}}, got {self.context_template!r}")
        return self


class TeacherEntry(TeacherSpec):
    """One teacher of `teachers:`: a model as `teacher:` has it (path, url or engine; dtype, device), a name, its
    own temperature and offload, and the route of the prompts it scores."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9_.-]+$", description="Names the teacher in metrics (teacher/<name>/...) and messages."
    )
    temperature: float | None = Field(
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


class EvalConfig(Section):
    """`opd eval`: sample n answers per benchmark problem, grade them, report avg@n / pass@k / maj@n."""

    model: ModelSpec | None = Field(None, description="The model to sample from; None with `responses` set.")
    responses: str | None = Field(None, description="Grade this JSONL of existing generations instead of sampling.")
    benchmarks: BenchmarkList = Field(
        default_factory=lambda: ["aime24", "aime25", "amc23", "math500"],
        description="Built-in names (aime24, aime25, amc23, math500, minerva, olympiadbench) or file paths, "
        "reported under the file's stem (folder-stem where two files share a stem).",
    )
    prompt_key: str = Field("prompt", description="Prompt column of benchmark files given by path.")
    answer_key: str = Field("reward_model.ground_truth", description="Answer column of benchmark files given by path.")
    template: str = Field("keep", description="Instruction template applied to every problem (see DataSpec.template).")
    enable_thinking: bool | None = Field(None, description="Chat template thinking switch; None: template default.")
    max_prompt_length: int = Field(2048, ge=1, description="Longer prompts are dropped with a count in the log.")
    n: int = Field(16, ge=1, description="Samples per problem.")
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    max_new_tokens: int = Field(4096, ge=1, description="Longest response; longer ones count as truncated.")
    batch_size: int = Field(64, ge=1, description="Sequences generated together (prompts × n).")
    limit: int | None = Field(None, ge=1, description="Evaluate only the first N problems of each benchmark.")
    seed: int = Field(0, description="Sampling seed; the same seed reproduces the samples.")
    out: str | None = Field(
        None, description="Output directory; None: runs/eval-<timestamp>. Rerunning into it resumes."
    )
    timeout: float = Field(
        5.0,
        gt=0,
        description="Wall-time budget in seconds of one response's symbolic grading (imports and worker start-up "
        "included); a comparison that runs out counts as wrong.",
    )
    on_missing_answer: Literal["error", "skip"] = Field(
        "error",
        description="A benchmark row (or --responses line) without a ground truth: error (one line naming it) or skip "
        "(dropped, counted).",
    )
    engine: EngineName = Field(
        "auto",
        description="Generation engine (opd.rollout.registry): auto | torch | static | vllm (loads the model itself; "
        "needs the vllm extra).",
    )
    vllm: VLLMSpec = Field(default_factory=VLLMSpec, description="Engine options when engine=vllm.")


# --------------------------------------------------------------------------------------------- loading / merging


def _all_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        keys.append(prefix + name)
        for candidate in _field_models(field.annotation):
            keys.extend(_all_keys(candidate, prefix + name + "."))
    return keys


def _field_models(annotation: Any) -> list[type[BaseModel]]:
    args = getattr(annotation, "__args__", None) or ()
    found = [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
    for arg in args:
        found.extend(_field_models(arg))
    return found


def _suggest(key: str, model_cls: type[BaseModel]) -> str:
    matches = difflib.get_close_matches(key, _all_keys(model_cls), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` → ("a.b", parsed value); the value is read as YAML so `1e-6`, `true`, `[a, b]` work."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. sampling.temperature=0.7)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads "1e-6" as a string
    return key, value


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return any(c in text.lower() for c in "e.") and text.strip().lower() not in {"nan", "inf", "-inf"}


def flatten_dotted(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}: nested config data as dotted keys (the inverse of `set_dotted`)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text; expected a UTF-8 YAML file") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def build_config(
    model_cls: type[Model],
    *,
    config_file: str | Path | None = None,
    options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> Model:
    """Merge defaults < YAML file < CLI options (dotted keys, None = not given) < `key=value` overrides; validate."""
    data: dict = read_yaml(config_file) if config_file else {}
    for key, value in (options or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return validate_config(model_cls, data)


def validate_config(model_cls: type[Model], data: dict) -> Model:
    try:
        return model_cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, model_cls)) from None


def _describe(error: ValidationError, model_cls: type[BaseModel]) -> str:
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(part) for part in first["loc"] if not str(part).startswith("function-"))
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'{_suggest(key, model_cls)}"
    if first["type"] == "missing":
        return f"config key '{key}' is required ({_field_description(model_cls, key)})"
    if first["type"] == "value_error" and "error" in first.get("ctx", {}):  # a model validator's own sentence
        return f"config key '{key}': {first['ctx']['error']}" if key else str(first["ctx"]["error"])
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return f"config key '{key}': {first['msg']}, got {shown}"


def _field_description(model_cls: type[BaseModel], key: str) -> str:
    cls: Any = model_cls
    field = None
    for part in key.split("."):
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return "see --help"
        models = _field_models(field.annotation)
        cls = models[0] if models else None
    return (field.description or "see --help") if field else "see --help"


def save_config(config: BaseModel, run_dir: str | Path) -> Path:
    """Save the fully resolved config as `run_dir/config.yaml`."""
    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


# ------------------------------------------------------------------------------------------------ training


class SamplingSpec(Section):
    """Rollout sampling of the student during training."""

    n: int = Field(4, ge=1, description="Rollouts per prompt (the paper: 4).")
    temperature: float = Field(
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
        description="Static engine: run its packed prefills through the student's compiled decoder layers (1.56-1.72x "
        "the prefill tokens/s on an H100, docs/performance.md), warmed up before the first step with the layers; "
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
    max_staleness: int = Field(
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


class ObjectiveSpec(Section):
    """What the token rewards, advantages and loss compute (SPEC §2–§4)."""

    top_k: int = Field(16, ge=0, description="Top-k candidates per position; 0 = sampled-token OPD.")
    strategy: Literal["only_stu", "only_tch", "intersection", "union", "union-intersection"] = Field(
        "only_stu", description="Which candidate ids get a reward (SPEC §2 table)."
    )
    weight: Literal["student_p", "teacher_p", "none"] = Field("student_p", description="Slot weights (SPEC §2).")
    teacher_temperature: float = Field(1.0, gt=0.0, description="τ_T: scales the teacher's logits only.")
    advantage: Literal["token_reward", "grpo", "token_reward+grpo", "token_grpo"] = Field(
        "token_reward", description="Advantage estimator (SPEC §3); grpo needs no teacher."
    )
    outcome_weight: float = Field(1.0, ge=0.0, description="λ in token_reward+grpo.")
    loss: Literal["pg", "topk_kl", "full_reverse_kl", "forward_kl", "jsd"] = Field(
        "pg", description="pg: the paper's policy gradient on token rewards; others: extension objectives (SPEC §4)."
    )
    jsd_beta: float = Field(0.5, ge=0.0, le=1.0, description="β of the generalised JSD (loss=jsd).")
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
    name: str | None = Field(None, description="Run directory name; None: <command>-<time>.")
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
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus mass.")
    max_new_tokens: int = Field(4096, ge=1, description="Longest response.")
    limit: int | None = Field(None, ge=1, description="First N problems of each benchmark.")
    prompt_key: str = Field("prompt", description="Prompt column of benchmark files given by path.")
    answer_key: str = Field("reward_model.ground_truth", description="Answer column of benchmark files given by path.")
    on_missing_answer: Literal["error", "skip"] = Field(
        "error",
        description="A benchmark row without a ground truth: error (one line naming it) or skip (dropped, counted).",
    )


class DistillConfig(Section):
    """`opd distill`: on-policy distillation (and the GRPO baseline) of a student from a teacher."""

    student: ModelSpec
    teacher: Teacher | None = Field(
        None, description="The teacher (local `path` or served `url`); not needed for advantage=grpo."
    )
    teachers: list[TeacherEntry] = Field(
        default_factory=list,
        description="Several teachers, each scoring the prompts its route matches (every prompt exactly one "
        "teacher); the single `teacher:` is the one-teacher form.",
    )
    data: DataSpec
    rollout: SamplingSpec = Field(default_factory=SamplingSpec)
    objective: ObjectiveSpec = Field(default_factory=ObjectiveSpec)
    optim: OptimSpec = Field(default_factory=OptimSpec)
    run: RunSpec = Field(default_factory=RunSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    prompts_per_step: int = Field(64, ge=1, description="Prompts per optimizer step (× rollout.n sequences).")
    micro_batch_tokens: int = Field(16384, ge=1, description="Token budget of one forward/backward micro-batch.")
    score_batch_tokens: int = Field(
        32768, ge=1, description="Token budget of one no-grad scoring forward (teacher and student)."
    )
    teacher_offload: bool = Field(False, description="Keep the teacher on CPU except while it scores.")
    gradient_checkpointing: bool | None = Field(
        None,
        description="Recompute every layer's activations in backward to save memory. None: on CUDA, selective "
        "when the layers are compiled (see activation_budget), else full; off on CPU.",
    )
    activation_budget: float = Field(
        0.5,
        gt=0,
        le=1,
        description="Selective checkpointing (compiled layers, gradient_checkpointing None): keep at "
        "most this fraction of the activations, recompute the cheap rest in backward; 1 = keep all.",
    )
    compile: bool | None = Field(
        None,
        description="torch.compile the decoder layers of student and teacher (scoring and update); None: on for "
        "CUDA with one process.",
    )
    skip_checks: CommaList = Field(
        default_factory=list,
        description="Startup checks (`opd check`'s tokenizers, scoring, resources rows) not to "
        "run or not to stop on: row names (e.g. determinism), group names, or all; empty: run them all.",
    )

    # Cross-field checks that need only the config: they fail at load time, before any model is read. Checks that need
    # the number of processes or the data stay in `opd.recipes.distill.setup`, and so does the micro-batch budget
    # against data.max_prompt_length (configs built in code, e.g. the benchmarks', leave that length nominal).
    def teacher_entries(self) -> list[TeacherEntry]:
        """The run's teachers as a list: `teachers:`, or the single `teacher:` as a one-element list (name
        "teacher", every prompt), or none. Temperature and offload are resolved from the objective and
        teacher_offload where an entry leaves them None."""
        if self.teachers:
            entries = self.teachers
        elif self.teacher is not None:
            entries = [TeacherEntry(name="teacher", **self.teacher.model_dump(exclude_unset=True))]
        else:
            return []
        return [
            entry.model_copy(
                update={
                    "temperature": self.objective.teacher_temperature
                    if entry.temperature is None
                    else entry.temperature,
                    # the live student has nothing of its own to offload
                    "offload": False
                    if entry.path == STUDENT
                    else self.teacher_offload
                    if entry.offload is None
                    else entry.offload,
                    "route": entry.route or TeacherRoute(default=True),
                    # the student's frozen initial weights as the teacher (self-distillation)
                    "path": self.student.path if entry.path == STUDENT_INIT else entry.path,
                }
            )
            for entry in entries
        ]

    @model_validator(mode="after")
    def _teachers_fit(self) -> DistillConfig:
        if self.teachers and self.teacher is not None:
            raise ValueError("give teacher (one teacher) or teachers (a list), not both")
        names = [t.name for t in self.teachers]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"teachers: the name {name!r} is given twice; each teacher needs its own name")
        if len(self.teachers) > 1:
            for index, entry in enumerate(self.teachers):
                if entry.route is None:
                    raise ValueError(
                        f"teachers[{index}] ({entry.name}) needs a route: data_source: [...], route_key + values, "
                        f"or default: true"
                    )
        defaults = [t.name for t in self.teachers if t.route is not None and t.route.default]
        if len(defaults) > 1:
            raise ValueError(f"teachers: {', '.join(defaults)} are all default; at most one teacher is the default")
        return self

    @model_validator(mode="after")
    def _objective_fits(self) -> DistillConfig:
        obj = self.objective
        if obj.advantage != "grpo" and self.teacher is None and not self.teachers:
            raise ValueError(
                f"objective.advantage={obj.advantage} needs a teacher: pass --teacher (or teacher.path=...)"
            )
        if obj.advantage == "token_grpo" and obj.top_k:
            raise ValueError("objective.advantage=token_grpo is sampled-token only: set objective.top_k=0")
        if obj.loss == "full_reverse_kl":
            raise ValueError(
                "objective.loss=full_reverse_kl needs the teacher's full distribution in the grad pass "
                "and is only available as opd.objectives.full_reverse_kl; use pg, topk_kl, forward_kl "
                "or jsd"
            )
        if obj.loss == "topk_kl" and obj.top_k == 0:  # a one-token support renormalises to KL = 0: nothing would learn
            raise ValueError("objective.loss=topk_kl needs a top-k support: set objective.top_k > 0 (e.g. 16)")
        if obj.loss != "pg" and obj.advantage != "token_reward":
            raise ValueError(f"objective.loss={obj.loss} uses no advantages; leave objective.advantage=token_reward")
        return self

    @model_validator(mode="after")
    def _served_teacher_stays_served(self) -> DistillConfig:
        if self.teacher_offload and self.teacher is not None and self.teacher.path == STUDENT:
            raise ValueError(
                f"teacher_offload=true does not apply to teacher.path: {STUDENT}, which scores with the student "
                f"itself; remove teacher_offload"
            )
        if self.teacher_offload and self.teacher is not None and self.teacher.url is not None:
            raise ValueError(
                "teacher_offload=true moves an in-process teacher to CPU between scorings; a served teacher "
                "(teacher.url) stays where its server put it: set one of them"
            )
        return self

    @model_validator(mode="after")
    def _rollouts_fit(self) -> DistillConfig:
        if self.rollout.overlap and self.objective.tis_cap is None:
            raise ValueError(
                "rollout.overlap=true trains on rollouts sampled one step earlier: it needs "
                "objective.tis_cap (e.g. 2.0) to correct them, and one process"
            )
        if self.rollout.partial and self.rollout.overlap and self.rollout.max_staleness < 1:
            raise ValueError(
                "rollout.partial=true with rollout.overlap=true samples every token one step ahead of its update: it "
                f"needs rollout.max_staleness >= 1 (got {self.rollout.max_staleness})"
            )
        if self.rollout.partial and self.rollout.max_staleness > 0 and self.objective.tis_cap is None:
            raise ValueError(
                f"rollout.partial=true with rollout.max_staleness={self.rollout.max_staleness} trains on tokens "
                "sampled by earlier weights: it needs objective.tis_cap (e.g. 2.0) to correct them, or "
                "rollout.max_staleness=0"
            )
        if self.run.deterministic and self.rollout.engine == "vllm":
            raise ValueError(
                "run.deterministic=true covers torch's kernels, not vLLM's (its batches, and so its samples, vary "
                "from run to run): set rollout.engine=auto (or torch/static), or run.deterministic=false"
            )
        vllm_teachers = [entry.name for entry in self.teacher_entries() if entry.engine == "vllm"]
        if self.run.deterministic and vllm_teachers:
            raise ValueError(
                f"run.deterministic=true covers torch's kernels, not vLLM's: teacher {vllm_teachers[0]} has "
                f"engine=vllm; set its engine=local, or run.deterministic=false"
            )
        return self
