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
from opd.scoring import score_hidden
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
        rollouts' device. requested_ids: [B, T, R] long (values at masked positions are ignored)."""
        if top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = no top-k), got {top_k}")
        out_device = rollouts.response_ids.device
        device = model_device(self.model)
        batch = rollouts.to(device)
        requested_BTR = None if requested_ids is None else requested_ids.to(device)
        B, T = batch.response_ids.shape
        zeros = dict(device=device, dtype=torch.float32)
        sampled_BT = torch.zeros(B, T, **zeros)
        topk_ids_BTK = torch.zeros(B, T, top_k, dtype=torch.long, device=device) if top_k else None
        topk_lp_BTK = torch.zeros(B, T, top_k, **zeros) if top_k else None
        entropy_BT = torch.zeros(B, T, **zeros) if with_entropy else None
        requested_lp_BTR = None if requested_BTR is None else torch.zeros(requested_BTR.shape, **zeros)

        packed = uses_packing(self.model, self.packing)
        groups = split_by_token_budget(needed_lengths(batch).cpu(), self.max_tokens_per_batch, padded=not packed)
        was_training = self.model.training
        self.model.eval()
        # no_grad rather than inference_mode: the student is trained afterwards, and inference tensors created in
        # buffers (e.g. a dynamic RoPE's inv_freq update) would break its later backward.
        try:
            with torch.no_grad():
                head = output_head(self.model)
                head_device = head.weight.device  # not `device` when a device map spreads the layers
                for rows_b in groups:
                    rows_b = rows_b.to(device)
                    part = forward_hidden(
                        self.model, batch.select(rows_b), packing=self.packing, through_root=self.through_root
                    )
                    b_N, t_N = rows_b[part.rows_N], part.cols_N  # back to rows of the whole batch
                    scores = score_hidden(
                        part.hidden_ND.to(head_device),
                        head,
                        targets_N=part.targets_N.to(head_device),
                        top_k=top_k,
                        requested_ids_NR=None if requested_BTR is None else requested_BTR[b_N, t_N].to(head_device),
                        temperature=temperature,
                        vocab_size=self.vocab_size,
                        with_entropy=with_entropy,
                        chunk_size=self.chunk_size,
                    )
                    scores = TokenScores(
                        *(
                            None if x is None else x.to(device)
                            for x in (
                                scores.sampled_logprobs,
                                scores.topk_ids,
                                scores.topk_logprobs,
                                scores.entropy,
                                scores.requested_logprobs,
                            )
                        )
                    )
                    sampled_BT[b_N, t_N] = scores.sampled_logprobs.float()
                    if top_k:
                        topk_ids_BTK[b_N, t_N] = scores.topk_ids
                        topk_lp_BTK[b_N, t_N] = scores.topk_logprobs.float()
                    if with_entropy:
                        entropy_BT[b_N, t_N] = scores.entropy.float()
                    if requested_lp_BTR is not None:
                        requested_lp_BTR[b_N, t_N] = scores.requested_logprobs.float()
        finally:
            self.model.train(was_training)

        def back(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(out_device)

        return TokenScores(
            back(sampled_BT), back(topk_ids_BTK), back(topk_lp_BTK), back(entropy_BT), back(requested_lp_BTR)
        )

    def close(self) -> None:
        """Nothing to do: the model is the caller's."""
