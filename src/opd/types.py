"""Small data records that move between layers. Tensors only below `train/`; nothing here knows about files."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Prompt:
    """One prompt of a prompt set.

    messages: chat messages `[{"role": ..., "content": ...}]`, the last one the user turn.
    answer:   ground truth for rule-based grading: a string, a list of strings (any of them is correct), or None
              when the set has none.
    """

    id: str
    messages: list[dict[str, str]]
    answer: str | list[str] | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def text(self) -> str:
        """The content of the last user message (the problem plus any instruction)."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                return message.get("content", "")
        return self.messages[-1].get("content", "") if self.messages else ""


@dataclass
class Rollouts:
    """A batch of B = prompts × n sampled responses, in the layout the scorers and the trainer share.

    input_ids:       [B, L] long, prompt + response, right-padded with the pad id
    attention_mask:  [B, L] bool, True on prompt and response tokens
    prompt_lengths:  [B] long, number of prompt tokens of each row
    response_ids:    [B, T] long, the response tokens left-aligned (T = longest response), pad elsewhere
    response_mask:   [B, T] bool, True on response tokens, EOS included; everything after it False
    group_ids:       [B] long, index of the prompt each row answers (rows of one group are the n samples)
    truncated:       [B] bool, the response hit max_new_tokens without EOS
    rollout_logprobs:[B, T] float or None, log-probs the generation engine reported for the sampled tokens
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    truncated: torch.Tensor
    rollout_logprobs: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def response_positions(self) -> torch.Tensor:
        """[B, T] long: index into input_ids of the position whose logits predict each response token."""
        t = torch.arange(self.response_ids.shape[1], device=self.input_ids.device)
        return self.prompt_lengths[:, None] - 1 + t[None, :]

    def to(self, device: torch.device | str) -> Rollouts:
        moved = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Rollouts(**moved)

    def select(self, rows: torch.Tensor | list[int]) -> Rollouts:
        """The sub-batch of the given rows (all tensors indexed along dim 0)."""
        rows = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)
        picked = {k: (v[rows] if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Rollouts(**picked)


@dataclass
class TokenScores:
    """What a model says about every response position of a `Rollouts` batch; all `[B, T, ...]`, aligned with
    `Rollouts.response_ids`, zero at masked positions. Log-probs are over the full vocabulary at the scoring
    temperature (SPEC §1), float32.

    sampled_logprobs:   [B, T]    log-prob of the sampled token
    topk_ids:           [B, T, K] long, ids of the K largest logits (None when K = 0)
    topk_logprobs:      [B, T, K] their log-probs, descending
    entropy:            [B, T]    entropy of the full distribution (None when not asked for)
    requested_logprobs: [B, T, Q] log-probs at ids the caller asked for (e.g. the student's top-k), or None
    exact:              [B, T] bool, a cross-vocabulary teacher's positions whose top-k log-probs are exact (SPEC §9;
                        elsewhere `sampled_logprobs` carries its span signal); None: every position (one vocabulary)
    """

    sampled_logprobs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    requested_logprobs: torch.Tensor | None = None
    exact: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> TokenScores:
        """The same scores with every tensor on `device` (None stays None)."""

        def moved(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device)

        return TokenScores(
            self.sampled_logprobs.to(device),
            moved(self.topk_ids),
            moved(self.topk_logprobs),
            moved(self.entropy),
            moved(self.requested_logprobs),
            moved(self.exact),
        )
