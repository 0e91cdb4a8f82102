"""Score rollouts with an in-process Hugging Face causal LM: the teacher, and the student's no-grad pass
(`LocalScorer`, the `TeacherScorer` every other scorer is compared with). The forward over the response positions
is `opd.forward`'s; the chunked projection `opd.scoring`'s, so neither `[B, L, V]` logits nor a `[B, T, V]` float32
tensor ever exist.
"""

from __future__ import annotations

import torch

from opd.forward import (  # the names below stay importable from here
    PACK_MIN_PADDING,
    Packing,
    ResponseHidden,
    check_output_head,
    forward_hidden,
    model_device,
    needed_lengths,
    output_head,
    split_by_token_budget,
    uses_packing,
)
from opd.scoring import OutputHead, score_hidden
from opd.teacher.base import InProcessScoring
from opd.types import Rollouts, TokenScores

__all__ = [
    "PACK_MIN_PADDING",
    "LocalScorer",
    "Packing",
    "ResponseHidden",
    "check_output_head",
    "forward_hidden",
    "needed_lengths",
    "output_head",
    "split_by_token_budget",
    "uses_packing",
]


class LocalScorer(InProcessScoring):
    """`TeacherScorer` over an in-process HF causal LM (teacher, or the student without grad).

    model:                any HF causal LM; put in eval mode while scoring, its previous mode restored after
    vocab_size:           shared vocabulary range (tokenizer compatibility check); rows beyond are padding. None = all
    max_tokens_per_batch: input tokens per forward (the micro-batch budget; padded rows count at the longest length)
    packing:              "auto" | "packed" | "padded", see `uses_packing`
    chunk_size:           positions per vocabulary chunk; None = by the `opd.scoring.CHUNK_BYTES` budget
    device:               move the model there first (e.g. the teacher on its own GPU); None = leave it. Inputs go
                          to the model's device; results come back on the rollouts' device
    check_head:           verify once that the output head is one `output_head` reproduces (a 4-token forward)
    through_root:         run the model's own forward instead of its body (FSDP2), see `forward_hidden`
    """

    serves_requested_ids = True  # the whole distribution is at hand: any ids

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        vocab_size: int | None = None,
        max_tokens_per_batch: int = 16384,
        packing: Packing = "auto",
        chunk_size: int | None = None,
        device: torch.device | str | None = None,
        check_head: bool = True,
        through_root: bool = False,
    ):
        if max_tokens_per_batch < 1:
            raise ValueError(f"max_tokens_per_batch must be ≥ 1, got {max_tokens_per_batch}")
        uses_packing(model, packing)  # validates the value
        if device is not None:
            model.to(device)
        self.model = model
        self.vocab_size = vocab_size
        self.max_tokens_per_batch = max_tokens_per_batch
        self.packing: Packing = packing
        self.chunk_size = chunk_size
        self.through_root = through_root
        output_head(model).restricted(vocab_size)  # validates vocab_size against the head
        if check_head:
            check_output_head(model, through_root=through_root)

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
        rollouts' device. requested_ids: [B, T, Q] long (values at masked positions are ignored).

        1. zero grids for every asked output, on the model's device (`_zero_scores`);
        2. the rows split into micro-batches by the token budget; each one forward and scored (`_score_rows`),
           in eval mode and without gradient, the model's previous mode restored after;
        3. the grids back on the rollouts' device.
        """
        if top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = no top-k), got {top_k}")
        out_device = rollouts.response_ids.device
        device = model_device(self.model)
        batch = rollouts.to(device)
        requested_BTQ = None if requested_ids is None else requested_ids.to(device)
        out = _zero_scores(batch.response_ids.shape, top_k, with_entropy, requested_BTQ, device)

        packed = uses_packing(self.model, self.packing)
        groups = split_by_token_budget(needed_lengths(batch).cpu(), self.max_tokens_per_batch, padded=not packed)
        was_training = self.model.training
        self.model.eval()
        # no_grad rather than inference_mode: the student is trained afterwards, and inference tensors created in
        # buffers (e.g. a dynamic RoPE's inv_freq update) would break its later backward.
        try:
            with torch.no_grad():
                head = output_head(self.model)
                for rows_b in groups:
                    rows_b = rows_b.to(device)
                    self._score_rows(batch, rows_b, head, out, requested_BTQ, top_k, temperature, with_entropy)
        finally:
            self.model.train(was_training)
        return out.to(out_device)

    def _score_rows(
        self,
        batch: Rollouts,
        rows_b: torch.Tensor,
        head: OutputHead,
        out: TokenScores,
        requested_BTQ: torch.Tensor | None,
        top_k: int,
        temperature: float,
        with_entropy: bool,
    ) -> None:
        """Forward the rows `rows_b` of `batch` (one micro-batch), score their response positions and write the
        scores into the grids of `out` (on `batch`'s device)."""
        head_device = head.weight.device  # not the inputs' device when a device map spreads the layers
        part = forward_hidden(self.model, batch.select(rows_b), packing=self.packing, through_root=self.through_root)
        b_N, t_N = rows_b[part.rows_N], part.cols_N  # back to rows of the whole batch
        scores = score_hidden(
            part.hidden_ND.to(head_device),
            head,
            targets_N=part.targets_N.to(head_device),
            top_k=top_k,
            requested_ids_NQ=None if requested_BTQ is None else requested_BTQ[b_N, t_N].to(head_device),
            temperature=temperature,
            vocab_size=self.vocab_size,
            with_entropy=with_entropy,
            chunk_size=self.chunk_size,
        ).to(rows_b.device)
        out.sampled_logprobs[b_N, t_N] = scores.sampled_logprobs.float()
        for grid, values in (
            (out.topk_ids, scores.topk_ids),
            (out.topk_logprobs, scores.topk_logprobs),
            (out.entropy, scores.entropy),
            (out.requested_logprobs, scores.requested_logprobs),
        ):
            if grid is not None and values is not None:
                grid[b_N, t_N] = values.to(grid.dtype)

    def hidden_states(self, rollouts: Rollouts) -> torch.Tensor:
        """[B, T, E] the final (normed) hidden state that predicts each response token, in the model's dtype, zero
        at masked positions, on the rollouts' device (`HiddenStateSource`): the same forward as `score`, without the
        head. Micro-batched by the token budget, eval mode and no grad, the previous mode restored after."""
        out_device = rollouts.response_ids.device
        device = model_device(self.model)
        batch = rollouts.to(device)
        head = output_head(self.model)
        B, T = batch.response_ids.shape
        hidden_BTE = torch.zeros(B, T, head.weight.shape[1], dtype=head.weight.dtype, device=device)
        packed = uses_packing(self.model, self.packing)
        groups = split_by_token_budget(needed_lengths(batch).cpu(), self.max_tokens_per_batch, padded=not packed)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                for rows_b in groups:
                    rows_b = rows_b.to(device)
                    part = forward_hidden(
                        self.model, batch.select(rows_b), packing=self.packing, through_root=self.through_root
                    )
                    hidden_BTE[rows_b[part.rows_N], part.cols_N] = part.hidden_ND.to(hidden_BTE.dtype)
        finally:
            self.model.train(was_training)
        return hidden_BTE.to(out_device)

    def output_head(self) -> OutputHead:
        """The model's output head over the shared range (`vocab_size`; views of its weights, no copy)."""
        return output_head(self.model).restricted(self.vocab_size)

    def close(self) -> None:
        """Nothing to do: the model is the caller's."""


def _zero_scores(
    shape_BT: torch.Size,
    top_k: int,
    with_entropy: bool,
    requested_BTQ: torch.Tensor | None,
    device: torch.device,
) -> TokenScores:
    """Zero `TokenScores` grids of shape [B, T, ...] on `device`, float32 (top-k ids long); None where not asked."""
    B, T = shape_BT
    return TokenScores(
        torch.zeros(B, T, dtype=torch.float32, device=device),
        torch.zeros(B, T, top_k, dtype=torch.long, device=device) if top_k else None,
        torch.zeros(B, T, top_k, dtype=torch.float32, device=device) if top_k else None,
        torch.zeros(B, T, dtype=torch.float32, device=device) if with_entropy else None,
        None if requested_BTQ is None else torch.zeros(requested_BTQ.shape, dtype=torch.float32, device=device),
    )
