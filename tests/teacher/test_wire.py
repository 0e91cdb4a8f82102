"""The served teacher's wire format (`opd.teacher.wire`): requests and responses round-trip, bytes per position,
and malformed or inconsistent messages are refused."""

from __future__ import annotations

import pytest
import torch

from helpers_served_teacher import V, random_rollouts
from opd.teacher import wire

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

# ------------------------------------------------------------------------------------------------ wire format


def test_wire_request_round_trip_is_exact():
    rollouts = random_rollouts(0, 6)
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 5))
    request = wire.request_from_rollouts(
        rollouts, requested, top_k=7, temperature=0.7, with_entropy=False, logprobs="bfloat16"
    )
    decoded = wire.decode_request(wire.encode_request(request))
    for name in ("row_lengths", "prompt_lengths", "tokens", "mask", "requested_ids"):
        assert torch.equal(getattr(decoded, name), getattr(request, name).to(getattr(decoded, name).dtype)), name
    assert (decoded.top_k, decoded.temperature, decoded.with_entropy, decoded.logprobs) == (7, 0.7, False, "bfloat16")
    rebuilt, grid = wire.rollouts_from_requests([decoded])
    mask = rollouts.response_mask
    scored = mask.any(1)
    assert torch.equal(rebuilt.response_mask.sum(1), mask.sum(1) * scored)
    assert torch.equal(rebuilt.response_ids[rebuilt.response_mask], rollouts.response_ids[mask])
    assert torch.equal(grid[rebuilt.response_mask], requested[mask])


@pytest.mark.parametrize("logprobs, atol", [("float32", 0.0), ("bfloat16", 2**-8)])  # bf16: 8 mantissa bits
def test_wire_response_round_trip(logprobs, atol):
    g = torch.Generator().manual_seed(1)
    response = wire.ScoreResponse(
        -torch.rand(9, generator=g) * 5,
        torch.randint(0, 1000, (9, 4), generator=g),
        -torch.rand(9, 4, generator=g),
        torch.rand(9, generator=g),
        -torch.rand(9, 3, generator=g),
    )
    decoded = wire.decode_response(wire.encode_response(response, logprobs))
    assert torch.equal(decoded.topk_ids, response.topk_ids)
    for name in ("sampled", "topk_logprobs", "entropy", "requested_logprobs"):
        x, y = getattr(decoded, name), getattr(response, name)
        assert x.dtype == torch.float32
        assert torch.allclose(x, y, rtol=atol, atol=0), name
    empty = wire.decode_response(wire.encode_response(wire.ScoreResponse(torch.zeros(0))))
    assert empty.sampled.shape == (0,) and empty.topk_ids is None


def test_wire_bytes_per_position_match_the_docstring():
    rollouts = random_rollouts(2, 4, max_prompt=1, max_response=40)
    positions = int(rollouts.response_mask.sum())
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 16))
    request = wire.request_from_rollouts(rollouts, requested)
    request_bytes = len(wire.encode_request(request))
    response = wire.ScoreResponse(
        torch.zeros(positions),
        torch.zeros(positions, 16, dtype=torch.long),
        torch.zeros(positions, 16),
        torch.zeros(positions),
        torch.zeros(positions, 16),
    )
    # per position: request 69 B + 4 B per prompt token (one here); response 200 B fp32, 132 B bf16 (+ headers)
    assert 69 * positions < request_bytes <= 73 * positions + 400
    assert 200 * positions < len(wire.encode_response(response)) <= 200 * positions + 400
    assert 132 * positions < len(wire.encode_response(response, "bfloat16")) <= 132 * positions + 400


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:5], "shorter than"),
        (lambda b: b"XXXX" + b[4:], "not an opd teacher message"),
        (lambda b: b[:4] + bytes([9]) + b[5:], "unknown wire version 9"),
        (lambda b: b[:-3], "needs"),
        (lambda b: b + b"\0" * 8, "bytes after the last array"),
        (lambda b: b[:12] + b"\xff" + b[13:], "not valid UTF-8 JSON"),
    ],
)
def test_wire_rejects_malformed_messages(mutate, message):
    body = wire.encode_request(wire.request_from_rollouts(random_rollouts(3, 2), None))
    with pytest.raises(wire.WireError, match=message):
        wire.decode_request(mutate(body))


def test_wire_rejects_inconsistent_arrays():
    ok = wire.request_from_rollouts(random_rollouts(4, 3), None)
    bad = wire.ScoreRequest(ok.row_lengths, ok.prompt_lengths, ok.tokens[:-1], ok.mask)
    with pytest.raises(wire.WireError, match="tokens: .* row_lengths add up to"):
        wire.decode_request(wire.encode_request(bad))
    bad = wire.ScoreRequest(ok.row_lengths, ok.row_lengths + 1, ok.tokens, ok.mask)
    with pytest.raises(wire.WireError, match="prompt_lengths: row 0"):
        wire.decode_request(wire.encode_request(bad))
    bad = wire.ScoreRequest(
        ok.row_lengths, ok.prompt_lengths, ok.tokens, ok.mask, torch.zeros(ok.num_positions + 1, 2, dtype=torch.long)
    )
    with pytest.raises(wire.WireError, match="requested_ids: shape"):
        wire.decode_request(wire.encode_request(bad))
