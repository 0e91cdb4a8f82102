"""`VLLMScorer`: a `TeacherScorer` through an in-process vLLM engine's `prompt_logprobs` (`teacher.engine: vllm`).

Each rollout row (prompt + response) goes in as a prompt with `prompt_logprobs = K`; vLLM returns, at every position,
the log-prob of the actual next token and the K most likely ids, which serves the sampled-token log-probs and the
teacher's own top-k (`only_tch`, the forward-KL / JSD supports, the diagnostics). Log-probs at ids the caller chooses
(`requested_ids`: `only_stu`, `intersection`, `union`, …) only where the installed vLLM can score them at prompt
positions (`serves_requested_ids`, detected at start-up); `check_objective` turns what is not served into one line.
How vLLM normalises prompt log-probs, padding rows and the cost: docs/design.md, "opd.teacher.vllm_scorer".

Omitted: teacher_temperature ≠ 1 (vLLM's prompt log-probs use the raw logits), entropy (it needs the full
distribution; the entropy diagnostics are left out), sleep mode for the teacher (it scores every step).
"""

from __future__ import annotations

from typing import Any

import torch

from opd.objectives import strategy_spec
from opd.rollout.vllm_engine import EngineGuard, EngineOptions, config_rows, model_rows, push_weights, start_engine
from opd.teacher.base import InProcessScoring
from opd.types import Rollouts, TokenScores

ALTERNATIVES = (
    "use teacher.engine=local (an in-process HF teacher) or a teacher server (opd serve-teacher, teacher.url)"
)


def check_objective(objective: Any, *, serves_requested_ids: bool | None = None) -> None:
    """Raise a one-line `ValueError` when `objective` (an `ObjectiveSpec`) needs what a vLLM teacher cannot give:
    teacher_temperature ≠ 1, or log-probs at the student's top-k (top_k > 0 with a strategy that has student slots).
    serves_requested_ids: None before the engine has started (only the static checks run)."""
    if objective.teacher_temperature != 1.0:
        raise ValueError(
            f"teacher.engine=vllm scores with raw logits (prompt_logprobs): objective.teacher_temperature "
            f"must be 1.0, got {objective.teacher_temperature}; {ALTERNATIVES}"
        )
    needs_ids = objective.top_k > 0 and strategy_spec(objective.strategy).student_slots
    if needs_ids and serves_requested_ids is False:
        raise ValueError(
            f"teacher.engine=vllm: objective.strategy={objective.strategy} with top_k={objective.top_k} "
            f"needs the teacher's log-probs at the student's top-k ids, which this vLLM cannot score "
            f"(prompt_logprob_token_ids needs its V2 model runner); use strategy=only_tch or top_k=0, "
            f"or {ALTERNATIVES}"
        )


class VLLMScorer(InProcessScoring):
    """`TeacherScorer` over an in-process vLLM engine (see the module docstring for what it serves).

    model_path:     the teacher's directory or hub id; vLLM loads it
    vocab_size:     the shared tokenizer range; ids ≥ it are padding rows, never in the top-k. None: all rows
    options:        `EngineOptions`
    max_top_k:      the largest top_k `score` will be asked for (vLLM's max_logprobs is sized from it)
    max_batch_size: rows scored together (max_num_seqs)
    """

    serves_requested_ids: bool  # set at start-up: whether the installed vLLM can score requested ids

    def __init__(
        self,
        model_path: str,
        *,
        vocab_size: int | None = None,
        options: EngineOptions | None = None,
        max_top_k: int = 16,
        max_batch_size: int = 256,
    ) -> None:
        options = options or EngineOptions()
        self.rows = config_rows(model_path, trust_remote_code=options.trust_remote_code)
        if vocab_size is not None and vocab_size > self.rows:
            raise ValueError(f"VLLMScorer vocab_size={vocab_size} exceeds the model's {self.rows} output rows")
        self.vocab_size = vocab_size or self.rows
        self.num_padding = self.rows - self.vocab_size
        self.llm = start_engine(
            model_path, options, max_num_seqs=max_batch_size, max_logprobs=max_top_k + self.num_padding + 1
        )
        self.guard = EngineGuard(self.llm, "teacher.engine vllm")
        if model_rows(self.llm) != self.rows:
            raise RuntimeError(f"vLLM's model has {model_rows(self.llm)} output rows, its config {self.rows}")
        from vllm import SamplingParams

        self.serves_requested_ids = (
            "prompt_logprob_token_ids" in getattr(SamplingParams, "__struct_fields__", ())
            or hasattr(SamplingParams, "prompt_logprob_token_ids")
        ) and bool(getattr(self.llm.llm_engine.vllm_config, "use_v2_model_runner", False))
        self.serves_entropy = False

    def sync_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Not used by the trainer (the teacher is frozen); here for a caller that swaps teachers."""
        with self.guard.call():
            push_weights(self.llm, weights)

    def score(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> TokenScores:
        """`TokenScores` [B, T, ...] aligned with `rollouts.response_ids`, zero at masked positions, float32, on the
        rollouts' device; `entropy` is None (not served, see the module docstring). After a call that failed inside the
        engine every later call raises at once (`opd.rollout.vllm_engine.EngineGuard`)."""
        from vllm import SamplingParams, TokensPrompt

        if top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = no top-k), got {top_k}")
        if temperature != 1.0:
            raise ValueError(
                f"VLLMScorer scores at temperature 1 only (vLLM's prompt log-probs use the raw logits), "
                f"got {temperature}; {ALTERNATIVES}"
            )
        if requested_ids is not None and not self.serves_requested_ids:
            raise ValueError(
                f"VLLMScorer cannot score requested ids with this vLLM (prompt_logprob_token_ids needs "
                f"its V2 model runner); {ALTERNATIVES}"
            )
        device = rollouts.response_ids.device
        mask_BT = rollouts.response_mask.bool().cpu()
        B, T = mask_BT.shape
        prompt_B = rollouts.prompt_lengths.cpu().tolist()
        lengths_B = mask_BT.sum(-1).tolist()
        ids_BL = rollouts.input_ids.cpu()
        wanted = top_k + self.num_padding
        prompts, params, live = [], [], []
        for b in range(B):
            if lengths_B[b] == 0:
                continue
            end = prompt_B[b] + lengths_B[b]
            extra: dict[str, Any] = {}
            if requested_ids is not None:
                extra = dict(
                    prompt_logprob_token_ids=requested_ids[b, : lengths_B[b]].cpu().tolist(),
                    prompt_logprob_start=prompt_B[b] - 1,
                )
            prompts.append(TokensPrompt(prompt_token_ids=ids_BL[b, :end].tolist()))
            params.append(
                SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=max(wanted, 0), detokenize=False, **extra)
            )
            live.append(b)
        with self.guard.call(requests=True):
            results = self.llm.generate(prompts, params, use_tqdm=False) if prompts else []

        sampled_BT = torch.zeros(B, T)
        topk_ids_BTK = torch.zeros(B, T, top_k, dtype=torch.long)  # [B, T, 0] when top_k = 0: left out below
        topk_lp_BTK = torch.zeros(B, T, top_k)
        requested_BTQ = None if requested_ids is None else torch.zeros(requested_ids.shape)
        for b, result in zip(live, results):
            start, tokens = prompt_B[b], ids_BL[b]
            for t in range(lengths_B[b]):
                position = result.prompt_logprobs[start + t]  # {id: Logprob} predicting token start + t
                sampled_BT[b, t] = position[int(tokens[start + t])].logprob
                if top_k:
                    best = sorted(((lp.logprob, i) for i, lp in position.items() if i < self.vocab_size), reverse=True)[
                        :top_k
                    ]
                    topk_ids_BTK[b, t] = torch.tensor([i for _, i in best], dtype=torch.long)
                    topk_lp_BTK[b, t] = torch.tensor([lp for lp, _ in best])
            if requested_BTQ is not None:
                scored = torch.as_tensor(result.prompt_token_id_logprobs, dtype=torch.float32)
                requested_BTQ[b, : lengths_B[b]] = scored[: lengths_B[b]]

        topk_ids, topk_lp = (topk_ids_BTK, topk_lp_BTK) if top_k else (None, None)
        return TokenScores(sampled_BT, topk_ids, topk_lp, None, requested_BTQ).to(device)

    def close(self) -> None:
        """Shut the engine down now (idempotent; otherwise at exit), as `VLLMGenerator.close`."""
        self.llm.llm_engine.engine_core.shutdown()
