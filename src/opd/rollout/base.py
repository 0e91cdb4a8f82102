"""The generation interface every engine implements (torch, static, vLLM: `opd.rollout.registry`), and the capability
of continuing sequences across calls that the in-process engines add (`Continues`, `Session`). Engines know token
ids only: chat templating and decoding happen in the caller."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. Invalid values raise `ValueError` naming the field, its legal range and the value given;
    nothing is silently rewritten."""

    n: int = 1
    """Samples per prompt, ≥ 1. Outputs are prompt-major: prompt 0's n samples first."""
    temperature: float = 1.0
    """Softmax temperature, ≥ 0. 0 means greedy (argmax) decoding."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]. 1.0 disables it."""
    top_k: int = 0
    """Sample only among the k most likely tokens, ≥ 0. 0 disables it."""
    max_new_tokens: int = 1024
    """Longest response in tokens, ≥ 1. A response that reaches it without EOS is reported as truncated."""
    stop_at_eos: bool = True
    """Stop a sample at its first EOS token (kept in the response). False generates max_new_tokens always."""
    seed: int | None = None
    """Seed of the engine's own `torch.Generator`; the same seed and inputs give the same outputs. None: random."""
    return_logprobs: bool = False
    """Also return the log-prob of every sampled token under the sampling distribution (after temperature)."""

    def __post_init__(self) -> None:
        checks = [
            ("n", self.n >= 1, "an integer ≥ 1"),
            ("temperature", self.temperature >= 0, "≥ 0 (0 = greedy)"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, "an integer ≥ 0 (0 = off)"),
            ("max_new_tokens", self.max_new_tokens >= 1, "an integer ≥ 1"),
        ]
        for name, ok, legal in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} must be {legal}, got {getattr(self, name)!r}")


@dataclass
class GenerationOutput:
    """Results for P prompts × n samples, flattened prompt-major (index = prompt * n + sample).

    response_ids:   per sample, the generated token ids (EOS included when the sample stopped on it)
    finish_reasons: per sample, "stop" (EOS) or "length" (hit max_new_tokens)
    group_ids:      per sample, the index of its prompt
    logprobs:       per sample, one float per response token, or None when not asked for
    """

    response_ids: list[list[int]]
    finish_reasons: list[str]
    group_ids: list[int]
    logprobs: list[list[float]] | None = None

    @property
    def truncated(self) -> list[bool]:
        return [reason == "length" for reason in self.finish_reasons]

    def state_dict(self) -> dict:
        """The fields by name, as the trainer state holds rollouts generated ahead or in flight (`from_state`)."""
        return {
            "response_ids": self.response_ids,
            "finish_reasons": self.finish_reasons,
            "group_ids": self.group_ids,
            "logprobs": self.logprobs,
        }

    @classmethod
    def from_state(cls, state: dict) -> GenerationOutput:
        """The output `state_dict` gave (other keys of `state` are the holder's)."""
        return cls(state["response_ids"], state["finish_reasons"], state["group_ids"], state["logprobs"])


StopRule = Callable[[Sequence["str | None"]], bool]
"""`generate(..., stop_when=rule)`: the engine calls `rule(finished)` when samples have ended, finished[i] being
sample i's finish reason ("stop", "length") once it has ended and None while it decodes or waits; True ends the call
there: every sample still decoding returns its tokens so far and every sample still waiting none, both with finish
reason "length" (the call's own limit). Engines that cannot end a call early (vLLM) run it to its end: a rule asks,
never requires (the partial-rollout stream uses it, `opd.train.stream`)."""


@runtime_checkable
class Generator(Protocol):
    """Prompts (token ids) in, n sampled continuations each out. Every member is implemented by every engine, a no-op
    where there is nothing to do, so callers call them directly."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, *, stop_when: StopRule | None = None
    ) -> GenerationOutput: ...

    def sync_weights(self) -> None:
        """Called by the trainer after each optimizer step. Engines that share the trainer's module do nothing;
        engines holding their own copy (vLLM, a compiled graph) refresh it here."""
        ...

    def check_fits(
        self,
        prompt_tokens: int,
        new_tokens: int,
        *,
        reserve_bytes: int = 0,
        names: tuple[str, str] = ("prompt length", "max_new_tokens"),
    ) -> None:
        """Raise ValueError (one line saying what would fit) when not even one sequence of prompt_tokens + new_tokens
        fits in the device memory free now, less reserve_bytes (memory resident before the first call, e.g. optimizer
        state). Engines without a memory rule (their own memory budget, a CPU) pass. names: the settings the message
        names. Call it under the autocast that generation will run under."""
        ...

    def release(self) -> None:
        """Called after each rollout: free what the engine holds between calls (caches, weight copies) so that
        scoring and the update have the memory. Engines that keep nothing between calls do nothing."""
        ...

    def close(self) -> None:
        """Shut the engine down now (idempotent). Engines that own nothing beyond the caller's module do nothing."""
        ...


class Session(Protocol):
    """Sequences that go on across the `generate` calls of the engine that opened it (`Continues.session`), each
    under a key the caller chooses: an episode's turns. `generate(contexts, params, session=..., keys=...)`: a
    context for a key the session holds extends it (the engine's earlier context, its response and what was appended
    since: the environment's answer); the engine keeps each sequence's cache between calls and prefills only what it
    does not hold (the longest common prefix of what it holds and the new context is reused).

    Results are those of the same call without the session (the same chunks or rows, the same random draws) up to
    floating-point rounding: the reused keys and values were computed by the earlier call's decode steps rather than
    by one prefill of the whole context (float32: log-probs within ~1e-5; a sampled token differs only when a draw
    falls within that distance of its boundary). A session's calls are deterministic: the same calls give the same
    outputs bit for bit. The session goes through `generate`, so wrappers that pass its options on (a step's call
    counter) see every call."""

    def end(self, keys: Iterable[Hashable]) -> None:
        """Free these sequences' caches: they will not be continued (keys not held are ignored)."""
        ...

    def close(self) -> None:
        """Free every cache the session holds (idempotent)."""
        ...

    @property
    def prefilled_tokens(self) -> int:
        """Tokens the engine's prefill forwards have run in this session's calls so far, counted where they run."""
        ...

    @property
    def held_bytes(self) -> int:
        """Bytes of the caches held now between calls."""
        ...


@runtime_checkable
class Continues(Protocol):
    """The capability of an engine that continues a sequence after appended tokens without prefilling it again
    (`TorchGenerator`, `StaticGenerator`). Callers that run turns (`opd.rollout.episodes`) use it when an engine
    has it and hand the whole context to `Generator.generate` otherwise (vLLM, whose own prefix cache reuses it)."""

    def session(self) -> Session:
        """A new session; close it when its sequences are done (its caches take device memory until then)."""
        ...

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        stop_when: StopRule | None = None,
        session: Session | None = None,
        keys: Sequence[Hashable] | None = None,
    ) -> GenerationOutput:
        """`Generator.generate`; with a session this engine opened, prompt_ids[i] continues (or starts) the sequence
        of keys[i] (one distinct key per prompt; params.n must be 1)."""
        ...
