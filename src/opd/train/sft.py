"""The SFT components: the per-token log-probs of the targets and the step's gradient (SPEC §5), used by `opd sft`
(`opd.recipes.sft`) and by `opd check`'s update timing.

An ordinary SFT loss: token-mean cross-entropy over the assistant tokens (end-of-turn included), the mean *global*
over the optimizer step (Σ over all its micro-batches / its number of target tokens), computed from hidden states
with the chunked `candidate_logprobs` so `[N, V]` float32 logits never exist. `packing_is_exact` tells whether a
model confines attention to each packed example.
"""

from __future__ import annotations

from typing import Any, cast

import torch

from opd.objectives import sft_loss
from opd.scoring import candidate_logprobs
from opd.train.common import autocast
from opd.types import Rollouts


def target_logprobs(
    net: torch.nn.Module, batch: Rollouts, *, packed: bool, vocab_size: int | None = None
) -> torch.Tensor:
    """[B, T] log-prob of every response token (grad flows when enabled), 0 at masked positions. One forward; the
    vocabulary projection is chunked (`candidate_logprobs` with the next tokens as the only candidates) over the
    first `vocab_size` output rows (None: all), as the OPD trainer scores the student."""
    from opd.forward import forward_hidden, output_head  # heavy (the Triton kernels, torch._dynamo)

    hidden = forward_hidden(net, batch, packing="packed" if packed else "padded")
    lp_N1 = candidate_logprobs(hidden.hidden_ND, output_head(net), hidden.targets_N[:, None], vocab_size=vocab_size)
    return hidden.to_grid(lp_N1[:, 0])


def forward_backward(
    net: torch.nn.Module,
    batch: Rollouts,
    *,
    micro_batch_tokens: int,
    packed: bool,
    autocast_dtype: torch.dtype | None = None,
    vocab_size: int | None = None,
) -> dict[str, torch.Tensor]:
    """Accumulate the gradient of the step's SFT loss over micro-batches; return its metrics (tensors, no sync).

    The loss is Σ_targets −log p / N with N the target tokens of the *whole* `batch` (SPEC §5), so the accumulated
    gradient equals that of one big batch whatever the micro-batch split. Train/eval mode is the caller's."""
    from opd.forward import needed_lengths, split_by_token_budget  # heavy (the Triton kernels, torch._dynamo)

    device = next(net.parameters()).device
    mask_BT = batch.response_mask
    num_tokens = mask_BT.sum().clamp(min=1).to(device)
    loss = torch.zeros((), device=device)
    lengths_B = needed_lengths(batch)
    for rows in split_by_token_budget(lengths_B, micro_batch_tokens, padded=not packed):
        micro = batch.select(rows)
        with autocast(device, autocast_dtype):
            lp_BT = target_logprobs(net, micro, packed=packed, vocab_size=vocab_size)
        micro_loss, _ = sft_loss(lp_BT, micro.response_mask.to(device), global_num_tokens=num_tokens)
        micro_loss.backward()
        loss += micro_loss.detach()
    return {"loss": loss, "tokens": mask_BT.sum(), "input_tokens": lengths_B.sum()}


@torch.no_grad()
def packing_is_exact(net: torch.nn.Module, *, tolerance: float | None = None) -> bool:
    """Whether packed rows give the same hidden states as padded ones on this model: transformers ≥ 5 confines
    attention to each example when position ids restart and no attention mask is given, but a model whose own mask
    code ignores that (custom remote code, older architectures) would silently mix examples."""
    from opd.forward import forward_hidden  # heavy (the Triton kernels, torch._dynamo)

    device = next(net.parameters()).device
    vocab = cast(Any, net).get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    ids_BL = torch.randint(0, vocab, (2, 12), generator=generator)
    lengths = torch.tensor([12, 7])
    attention_BL = torch.arange(12)[None] < lengths[:, None]
    batch = Rollouts(
        ids_BL.masked_fill(~attention_BL, 0),
        attention_BL,
        torch.tensor([2, 2]),
        ids_BL[:, 2:],
        attention_BL[:, 2:],
        torch.arange(2),
        torch.zeros(2, dtype=torch.bool),
    ).to(device)
    was_training = net.training
    net.eval()
    try:
        packed = forward_hidden(net, batch, packing="packed").hidden_ND.float()
        padded = forward_hidden(net, batch, packing="padded").hidden_ND.float()
    finally:
        net.train(was_training)
    if tolerance is None:
        tolerance = 1e-4 if packed.dtype == torch.float32 and next(net.parameters()).dtype == torch.float32 else 5e-2
    return bool((packed - padded).abs().max() <= tolerance * max(1.0, float(padded.abs().max())))
