"""`opd.rollout.batch.build_rollouts`: the layout of the rollouts built from an engine's output."""

from __future__ import annotations

import pytest
import torch

from helpers import EOS_ID, PAD_ID
from opd.rollout.base import GenerationOutput
from opd.rollout.batch import build_rollouts


def test_build_rollouts_layout():
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    output = GenerationOutput(
        response_ids=[[11, EOS_ID], [12, 13, 14, 15], [16], [17, 18, EOS_ID]],
        finish_reasons=["stop", "length", "length", "stop"],
        group_ids=[0, 0, 1, 1],
        logprobs=[[-0.1, -0.2], [-0.3, -0.4, -0.5, -0.6], [-0.7], [-0.8, -0.9, -1.0]],
    )
    r = build_rollouts(prompts, output, pad_id=PAD_ID)
    P = PAD_ID
    assert r.input_ids.tolist() == [
        [1, 2, 3, 11, EOS_ID, P, P, P],
        [1, 2, 3, 12, 13, 14, 15, P],
        [4, 5, 6, 7, 8, 16, P, P],
        [4, 5, 6, 7, 8, 17, 18, EOS_ID],
    ]
    assert r.attention_mask.sum(-1).tolist() == [5, 7, 6, 8] and r.attention_mask.dtype == torch.bool
    assert r.response_ids.tolist() == [[11, EOS_ID, P, P], [12, 13, 14, 15], [16, P, P, P], [17, 18, EOS_ID, P]]
    assert r.response_mask.sum(-1).tolist() == [2, 4, 1, 3] and r.response_mask.dtype == torch.bool
    assert r.prompt_lengths.tolist() == [3, 3, 5, 5] and r.group_ids.tolist() == [0, 0, 1, 1]
    assert r.truncated.tolist() == [False, True, True, False]
    assert r.rollout_logprobs[1].tolist() == pytest.approx([-0.3, -0.4, -0.5, -0.6])
    assert r.rollout_logprobs[2, 1:].tolist() == [0.0, 0.0, 0.0]
    # The token at response_positions + 1 is the response token those logits predict.
    positions = r.response_positions()
    following = r.input_ids.gather(1, (positions + 1).clamp(max=r.input_ids.shape[1] - 1))
    assert torch.equal(following[r.response_mask], r.response_ids[r.response_mask])
    with pytest.raises(ValueError, match="row 0 has 2 response tokens but 1 logprobs"):
        build_rollouts(prompts, GenerationOutput([[1, 2]], ["stop"], [0], [[-1.0]]), pad_id=P)
    with pytest.raises(ValueError, match=r"group_ids\[0\] = 2"):
        build_rollouts(prompts, GenerationOutput([[1]], ["stop"], [2]), pad_id=P)
