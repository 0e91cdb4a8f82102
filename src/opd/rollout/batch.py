"""Turn a `GenerationOutput` (lists of token ids) into the padded `Rollouts` tensors the scorers and trainer share.

Rows are prompts × n; prompt then response, right-padded (`opd.types.Rollouts` gives the shapes, docs/design.md
"opd.rollout.batch" the layout): response token t of row b sits at input_ids[b, prompt_lengths[b] + t], predicted by
position prompt_lengths[b] + t - 1 (`Rollouts.response_positions()`).

Omitted: packing several rows into one sequence (the trainer's micro-batching decides that) and left padding (every
consumer here runs full forwards, where right padding keeps each row's positions 0..len-1 without position_ids).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opd.rollout.base import GenerationOutput
from opd.types import Rollouts


def build_rollouts(
    prompt_ids: Sequence[Sequence[int]],
    output: GenerationOutput,
    *,
    pad_id: int,
    device: torch.device | str | None = None,
) -> Rollouts:
    """`Rollouts` for the P prompts `prompt_ids` and the B samples of `output` (row b answers prompt
    output.group_ids[b]). Tensors are built on the CPU and moved to `device` (None: stay on the CPU).
    rollout_logprobs is [B, T] float32 (0 past each response) when `output.logprobs` is set, else None."""
    num_rows = len(output.response_ids)
    if len(output.group_ids) != num_rows or len(output.finish_reasons) != num_rows:
        raise ValueError(
            f"GenerationOutput has {num_rows} responses but {len(output.group_ids)} group_ids and "
            f"{len(output.finish_reasons)} finish_reasons; they must match"
        )
    for b, g in enumerate(output.group_ids):
        if not 0 <= g < len(prompt_ids):
            raise ValueError(f"group_ids[{b}] = {g} is not a prompt index in [0, {len(prompt_ids)})")
    if output.logprobs is not None:
        for b, (lps, ids) in enumerate(zip(output.logprobs, output.response_ids)):
            if len(lps) != len(ids):
                raise ValueError(f"row {b} has {len(ids)} response tokens but {len(lps)} logprobs; they must match")

    prompt_lengths = [len(prompt_ids[g]) for g in output.group_ids]
    response_lengths = [len(r) for r in output.response_ids]
    width = max((p + r for p, r in zip(prompt_lengths, response_lengths)), default=0)
    steps = max(response_lengths, default=0)

    input_ids_BL = torch.full((num_rows, width), pad_id, dtype=torch.long)
    attention_mask_BL = torch.zeros((num_rows, width), dtype=torch.bool)
    response_ids_BT = torch.full((num_rows, steps), pad_id, dtype=torch.long)
    response_mask_BT = torch.zeros((num_rows, steps), dtype=torch.bool)
    logprobs_BT = torch.zeros((num_rows, steps), dtype=torch.float32) if output.logprobs is not None else None
    for b, (g, response) in enumerate(zip(output.group_ids, output.response_ids)):
        p, r = prompt_lengths[b], response_lengths[b]
        input_ids_BL[b, : p + r] = torch.as_tensor(list(prompt_ids[g]) + list(response), dtype=torch.long)
        attention_mask_BL[b, : p + r] = True
        response_ids_BT[b, :r] = torch.as_tensor(response, dtype=torch.long)
        response_mask_BT[b, :r] = True
        if logprobs_BT is not None and output.logprobs is not None:
            logprobs_BT[b, :r] = torch.as_tensor(output.logprobs[b], dtype=torch.float32)

    rollouts = Rollouts(
        input_ids=input_ids_BL,
        attention_mask=attention_mask_BL,
        prompt_lengths=torch.as_tensor(prompt_lengths, dtype=torch.long),
        response_ids=response_ids_BT,
        response_mask=response_mask_BT,
        group_ids=torch.as_tensor(list(output.group_ids), dtype=torch.long),
        truncated=torch.as_tensor(output.truncated, dtype=torch.bool),
        rollout_logprobs=logprobs_BT,
    )
    return rollouts.to(device) if device is not None else rollouts


def random_rollouts(
    prompt_ids: Sequence[int],
    response_lengths: Sequence[int],
    *,
    vocab_size: int,
    pad_id: int,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Rollouts:
    """One prompt answered by responses of uniformly random tokens of the given lengths: a batch of a chosen layout
    (rows of equal or different lengths) for compiling the forwards that will see it (`opd.train.step.warm_up`,
    `opd serve-teacher`). Never trained on; the tokens are drawn from their own seeded generator."""
    generator = torch.Generator().manual_seed(seed)
    responses = [torch.randint(vocab_size, (n,), generator=generator).tolist() for n in response_lengths]
    rows = len(responses)
    output = GenerationOutput(responses, ["length"] * rows, [0] * rows)
    return build_rollouts([prompt_ids], output, pad_id=pad_id, device=device)
