"""The teacher server's wire format: pure encode/decode functions between bytes, small records and `Rollouts`.

No pickle anywhere: a message is a fixed prefix (b"OPDW", a version byte), a small JSON header and raw little-endian
arrays (int32 ids and lengths, uint8 masks, float32 or bfloat16 log-probs), each aligned to 8 bytes. Only the scored
positions travel: a request carries each row's tokens up to its last scored position, a response one record per
scored position, never the padded `[B, T]` grid. The message grammar, the arrays of a request and a response, and
the bytes per position: docs/design.md, "opd.teacher.wire".

Omitted on purpose: compression (ids and log-probs are high-entropy; it would cost more CPU than the wire saves on
the networks a teacher runs on), and streaming of partial results (a request is scored in one batch).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from opd.types import Rollouts, TokenScores

MAGIC = b"OPDW"
VERSION = 1
MAX_HEADER_BYTES = 1 << 16  # a header lists at most a few arrays: anything larger is not one of ours
_PREFIX = struct.Struct("<4sB3xI")  # magic, version, padding, header length
_DTYPES: dict[str, np.dtype] = {
    "int32": np.dtype("<i4"),
    "uint8": np.dtype("u1"),
    "float32": np.dtype("<f4"),
    "bfloat16": np.dtype("<u2"),
    "float16": np.dtype("<f2"),
}
LOGPROB_DTYPES = ("float32", "bfloat16")
HIDDEN_DTYPES = ("bfloat16", "float16", "float32")  # a hidden-state answer's and a head's wire dtypes
MAX_ARRAYS = 16  # a message carries at most a handful of arrays
MAX_DIMS = 4  # and none has more than a few dimensions
MAX_EXTENT = (1 << 31) - 1  # nor an extent beyond int32 (offsets into a message are int32 too)
MAX_HEADER_DEPTH = 8  # {"meta": {...}, "arrays": [[name, dtype, [sizes]]]} is 3 deep
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e6  # beyond them 1/temperature over- or underflows float32 logits
_WIRE_NAME = {torch.long: "int32", torch.bool: "uint8", torch.float32: "float32", torch.bfloat16: "bfloat16"}
_REQUEST_ARRAYS = {"row_lengths": 1, "prompt_lengths": 1, "tokens": 1, "mask": 1, "requested_ids": 2}


class WireError(ValueError):
    """A message that is not a valid opd teacher message; the text names the field and the value (one line)."""


@dataclass
class ScoreRequest:
    """A decoded request: rows of token ids with their scored positions (CPU tensors, long / bool).

    row_lengths [B], prompt_lengths [B], tokens [Σ row_lengths], mask [Σ response lengths], requested_ids [N, Q]
    (N: the scored positions, those the mask sets) or None: see docs/design.md.
    """

    row_lengths: torch.Tensor
    prompt_lengths: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    requested_ids: torch.Tensor | None = None
    top_k: int = 16
    temperature: float = 1.0
    with_entropy: bool = True
    logprobs: str = "float32"

    @property
    def num_rows(self) -> int:
        return int(self.row_lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.numel())

    @property
    def num_positions(self) -> int:
        return int(self.mask.sum())

    @property
    def key(self) -> tuple:
        """Requests with equal keys can be scored in one batch (same top-k, requested width, temperature, entropy)."""
        requested = None if self.requested_ids is None else int(self.requested_ids.shape[1])
        return self.top_k, requested, float(self.temperature), self.with_entropy


@dataclass
class ScoreResponse:
    """The scores of a request's scored positions, row-major (float32 or as decoded; ids long)."""

    sampled: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_logprobs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    requested_logprobs: torch.Tensor | None = None


# ------------------------------------------------------------------------------------------------ identity


def tokenizer_fingerprints(tokenizer) -> dict[str, str]:
    """sha256 hashes of a tokenizer's token→id map (added tokens included) and of its chat template, as /info reports
    them: equal maps give equal hashes on any host."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: (kv[1], kv[0]))
    template = getattr(tokenizer, "chat_template", None)
    return {"vocab_hash": _sha256(vocab), "chat_template_hash": _sha256(template)}


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------ framing


def encode_message(kind: str, meta: dict, arrays: list[tuple[str, torch.Tensor, str]]) -> bytes:
    """Frame `arrays` ((name, tensor, wire dtype) with dtype in int32 | uint8 | float32 | bfloat16) as one message."""
    listed, payloads = [], []
    for name, tensor, dtype in arrays:
        listed.append([name, dtype, list(tensor.shape)])
        payloads.append(_to_bytes(tensor, dtype))
    header = json.dumps({"kind": kind, "meta": meta, "arrays": listed}, separators=(",", ":")).encode()
    parts = [_PREFIX.pack(MAGIC, VERSION, len(header)), header]
    offset = _PREFIX.size + len(header)
    for payload in payloads:
        parts.append(b"\0" * (-offset % 8))
        offset += -offset % 8
        parts.append(payload)
        offset += len(payload)
    return b"".join(parts)


def decode_message(data: bytes | bytearray | memoryview) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(kind, meta, {name: tensor}) of a message; tensors are CPU copies (long for int32, bool for uint8, float32 or
    bfloat16 for the float dtypes). Raises `WireError` naming what is wrong."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        raise WireError(f"body: {len(view)} bytes is shorter than the {_PREFIX.size}-byte message prefix")
    magic, version, header_length = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise WireError(f"body: not an opd teacher message (starts with {bytes(magic)!r}, expected {MAGIC!r})")
    if version != VERSION:
        raise WireError(f"version: unknown wire version {version}; this side speaks version {VERSION}")
    if header_length > MAX_HEADER_BYTES or _PREFIX.size + header_length > len(view):
        raise WireError(
            f"header: length {header_length} exceeds the message ({len(view)} bytes) or the "
            f"{MAX_HEADER_BYTES}-byte limit"
        )
    try:
        header = json.loads(bytes(view[_PREFIX.size : _PREFIX.size + header_length]))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise WireError("header: not valid UTF-8 JSON") from None
    except RecursionError:
        raise WireError(f"header: nested deeper than {MAX_HEADER_DEPTH} levels") from None
    if _depth(header) > MAX_HEADER_DEPTH:
        raise WireError(f"header: nested deeper than {MAX_HEADER_DEPTH} levels")
    if (
        not isinstance(header, dict)
        or not isinstance(header.get("kind"), str)
        or not isinstance(header.get("meta"), dict)
        or not isinstance(header.get("arrays"), list)
    ):
        raise WireError("header: expected an object with 'kind' (string), 'meta' (object) and 'arrays' (list)")
    if len(header["arrays"]) > MAX_ARRAYS:
        raise WireError(f"header.arrays: {len(header['arrays'])} arrays, at most {MAX_ARRAYS}")
    arrays: dict[str, torch.Tensor] = {}
    offset = _PREFIX.size + header_length
    for entry in header["arrays"]:
        if not (
            isinstance(entry, list)
            and len(entry) == 3
            and isinstance(entry[0], str)
            and entry[1] in _DTYPES
            and isinstance(entry[2], list)
            and len(entry[2]) <= MAX_DIMS
            and all(type(n) is int and 0 <= n <= MAX_EXTENT for n in entry[2])
        ):
            raise WireError(
                f"header.arrays: entry {str(entry)[:80]} is not [name, dtype in "
                f"{'|'.join(_DTYPES)}, [at most {MAX_DIMS} sizes in 0..{MAX_EXTENT}]]"
            )
        name, dtype, shape = entry
        if name in arrays:
            raise WireError(f"header.arrays: {name!r} listed twice")
        offset += -offset % 8
        nbytes = math.prod(shape) * _DTYPES[dtype].itemsize  # Python ints: no int64 overflow, no wrap to zero
        if offset + nbytes > len(view):
            raise WireError(f"{name}: shape {shape} needs {nbytes} bytes but only {max(0, len(view) - offset)} remain")
        arrays[name] = _from_bytes(view[offset : offset + nbytes], dtype, shape)
        offset += nbytes
    if offset != len(view):
        raise WireError(f"body: {len(view) - offset} bytes after the last array")
    return header["kind"], header["meta"], arrays


def _depth(value) -> int:
    """How deeply `value` (parsed JSON) nests lists and objects (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, (list, dict)):
            deepest = max(deepest, level)
            if level <= MAX_HEADER_DEPTH:
                stack.extend((child, level + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _expect(name: str, tensor: torch.Tensor, dtype: str, dims: int) -> None:
    """WireError unless `tensor` came as `dtype` with `dims` dimensions (what the server scores, checked before any
    request is merged with others)."""
    got = _WIRE_NAME.get(tensor.dtype, str(tensor.dtype))
    if got != dtype:
        raise WireError(f"{name}: dtype {got}, expected {dtype}")
    if tensor.dim() != dims:
        raise WireError(f"{name}: expected {dims} dimension{'s' * (dims > 1)}, got shape {list(tensor.shape)}")


def _to_bytes(tensor: torch.Tensor, dtype: str) -> bytes:
    tensor = tensor.detach().to("cpu").contiguous()
    if dtype == "bfloat16":
        return tensor.to(torch.bfloat16).view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    if dtype == "int32":
        info = torch.iinfo(torch.int32)
        if tensor.numel() and (int(tensor.min()) < info.min or int(tensor.max()) > info.max):
            raise WireError(
                f"a value outside int32 cannot be sent as int32 (range {int(tensor.min())}..{int(tensor.max())})"
            )
        tensor = tensor.to(torch.int32)
    elif dtype == "uint8":
        tensor = tensor.to(torch.uint8)
    elif dtype == "float16":
        tensor = tensor.to(torch.float16)
    else:
        tensor = tensor.to(torch.float32)
    return tensor.numpy().astype(_DTYPES[dtype], copy=False).tobytes()


def _from_bytes(buffer: memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    array = np.frombuffer(buffer, dtype=_DTYPES[dtype]).reshape(shape)
    if dtype == "bfloat16":
        return torch.from_numpy(array.astype(np.int16)).view(torch.bfloat16)  # astype: native order, writable copy
    native = {"int32": np.int64, "uint8": np.bool_, "float32": np.float32}[dtype]
    if dtype == "float16":
        return torch.from_numpy(array.astype(np.float16))  # native order, writable copy; stays float16
    if dtype == "uint8" and array.size and array.max() > 1:
        raise WireError(f"a mask holds {int(array.max())}; masks are 0 or 1")
    return torch.from_numpy(array.astype(native))


# ------------------------------------------------------------------------------------------------ requests


def encode_request(request: ScoreRequest) -> bytes:
    if request.logprobs not in LOGPROB_DTYPES:
        raise WireError(f"logprobs: must be one of {', '.join(LOGPROB_DTYPES)}, got {request.logprobs!r}")
    meta = {
        "top_k": request.top_k,
        "temperature": request.temperature,
        "with_entropy": request.with_entropy,
        "logprobs": request.logprobs,
    }
    arrays = [
        ("row_lengths", request.row_lengths, "int32"),
        ("prompt_lengths", request.prompt_lengths, "int32"),
        ("tokens", request.tokens, "int32"),
        ("mask", request.mask, "uint8"),
    ]
    if request.requested_ids is not None:
        arrays.append(("requested_ids", request.requested_ids, "int32"))
    return encode_message("score", meta, arrays)


def decode_request(data: bytes | bytearray | memoryview) -> ScoreRequest:
    """A `ScoreRequest` whose arrays are consistent with each other; raises `WireError` naming the field otherwise.
    (Limits and the vocabulary range are the server's to check: they depend on its settings and model.)"""
    kind, meta, arrays = decode_message(data)
    if kind != "score":
        raise WireError(f"kind: expected 'score', got {kind!r}")
    for name in arrays:
        if name not in _REQUEST_ARRAYS:
            raise WireError(f"{name}: not an array of a request (expected {', '.join(_REQUEST_ARRAYS)})")
    for name, dims in _REQUEST_ARRAYS.items():
        if name not in arrays:
            if name == "requested_ids":
                continue
            raise WireError(f"{name}: missing from the request")
        _expect(name, arrays[name], "uint8" if name == "mask" else "int32", dims)
    top_k: Any = meta.get("top_k")  # untrusted JSON values, checked below
    temperature: Any = meta.get("temperature")
    with_entropy, logprobs = meta.get("with_entropy"), meta.get("logprobs", "float32")
    if type(top_k) is not int or top_k < 0:
        raise WireError(f"top_k: expected an integer ≥ 0, got {top_k!r}")
    if type(temperature) not in (int, float) or not MIN_TEMPERATURE <= temperature <= MAX_TEMPERATURE:
        raise WireError(
            f"temperature: expected a number in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {temperature!r}"
        )
    if type(with_entropy) is not bool:
        raise WireError(f"with_entropy: expected true or false, got {with_entropy!r}")
    if logprobs not in LOGPROB_DTYPES:
        raise WireError(f"logprobs: expected one of {', '.join(LOGPROB_DTYPES)}, got {logprobs!r}")
    rows, prompts, tokens, mask = (arrays[n] for n in ("row_lengths", "prompt_lengths", "tokens", "mask"))
    if bool((rows < 0).any()):
        b = int((rows < 0).nonzero()[0])
        raise WireError(f"row_lengths: row {b} has length {int(rows[b])}; expected ≥ 0")
    if rows.shape != prompts.shape:
        raise WireError(f"prompt_lengths: {prompts.numel()} values for {rows.numel()} rows")
    bad = ((prompts < 1) | (prompts > rows)) & ~((rows == 0) & (prompts == 0))  # an empty row sends nothing
    if bool(bad.any()):
        b = int(bad.nonzero()[0])
        raise WireError(
            f"prompt_lengths: row {b} has prompt length {int(prompts[b])} for {int(rows[b])} tokens; "
            f"expected 1 ≤ prompt length ≤ row length (or 0 for an empty row)"
        )
    if int(rows.sum()) != tokens.numel():
        raise WireError(f"tokens: {tokens.numel()} values but row_lengths add up to {int(rows.sum())}")
    if int((rows - prompts).sum()) != mask.numel():
        raise WireError(
            f"mask: {mask.numel()} values but the rows have {int((rows - prompts).sum())} response positions"
        )
    requested = arrays.get("requested_ids")
    if requested is not None and (requested.dim() != 2 or requested.shape[0] != int(mask.sum())):
        raise WireError(
            f"requested_ids: shape {list(requested.shape)}, expected [{int(mask.sum())} scored positions, Q]"
        )
    return ScoreRequest(rows, prompts, tokens, mask, requested, top_k, float(temperature), with_entropy, logprobs)


def request_from_rollouts(
    rollouts: Rollouts,
    requested_ids_BTQ: torch.Tensor | None = None,
    *,
    top_k: int = 16,
    temperature: float = 1.0,
    with_entropy: bool = True,
    logprobs: str = "float32",
) -> ScoreRequest:
    """The request that asks for the scores of every `response_mask` position of `rollouts` (rows are sent up to
    their last scored position; a row with none sends no tokens). requested_ids_BTQ: [B, T, Q] or None."""
    r = rollouts.to("cpu")
    mask_BT = r.response_mask.bool()
    T = mask_BT.shape[1]
    scored_B = (
        torch.where(mask_BT, torch.arange(T) + 1, 0).amax(1) if T else torch.zeros(len(mask_BT), dtype=torch.long)
    )
    prompt_B = torch.where(scored_B > 0, r.prompt_lengths, 0)
    length_B = prompt_B + scored_B
    L = r.input_ids.shape[1]
    if bool((length_B > L).any()):
        raise ValueError(
            "rollouts: a scored response position lies beyond input_ids (prompt_lengths + response "
            "positions must fit the row)"
        )
    keep_BL = torch.arange(L)[None] < length_B[:, None]
    keep_BT = torch.arange(T)[None] < scored_B[:, None]
    requested = None
    if requested_ids_BTQ is not None:
        requested = requested_ids_BTQ.to("cpu")[mask_BT]
    return ScoreRequest(
        length_B,
        prompt_B,
        r.input_ids[keep_BL],
        mask_BT[keep_BT],
        requested,
        top_k,
        float(temperature),
        with_entropy,
        logprobs,
    )


def rollouts_from_requests(requests: list[ScoreRequest]) -> tuple[Rollouts, torch.Tensor | None]:
    """The requests' rows as one right-padded `Rollouts` batch (rows in request order; pad id 0, masked) and their
    requested ids as a [B, T, Q] grid (zeros off the scored positions), or None when the requests carry none."""
    rows = torch.cat([q.row_lengths for q in requests])
    prompts = torch.cat([q.prompt_lengths for q in requests])
    tokens = torch.cat([q.tokens for q in requests])
    B, L = rows.numel(), int(rows.max()) if rows.numel() else 0
    keep_BL = torch.arange(L)[None] < rows[:, None]
    input_ids = torch.zeros(B, L, dtype=torch.long)
    input_ids[keep_BL] = tokens
    response_B = rows - prompts
    T = int(response_B.max()) if B else 0
    keep_BT = torch.arange(T)[None] < response_B[:, None]
    mask_BT = torch.zeros(B, T, dtype=torch.bool)
    mask_BT[keep_BT] = torch.cat([q.mask for q in requests])
    # response token t of row b is input token P_b + t (right padding: index L-1 stands in past the row, masked)
    index_BT = (prompts[:, None] + torch.arange(T)[None]).clamp(max=max(L - 1, 0))
    response_ids = (
        torch.where(keep_BT, input_ids.gather(1, index_BT), 0) if B and T else torch.zeros(B, T, dtype=torch.long)
    )
    rollouts = Rollouts(
        input_ids=input_ids,
        attention_mask=keep_BL,
        prompt_lengths=prompts,
        response_ids=response_ids,
        response_mask=mask_BT,
        group_ids=torch.arange(B),
        truncated=torch.zeros(B, dtype=torch.bool),
    )
    requested = [q.requested_ids for q in requests if q.requested_ids is not None]
    if len(requested) < len(requests):
        return rollouts, None
    grid_BTQ = torch.zeros(B, T, requested[0].shape[1], dtype=torch.long)
    grid_BTQ[mask_BT] = torch.cat(requested)
    return rollouts, grid_BTQ


# ------------------------------------------------------------------------------------------------ responses


def encode_response(response: ScoreResponse, logprobs: str = "float32") -> bytes:
    if logprobs not in LOGPROB_DTYPES:
        raise WireError(f"logprobs: must be one of {', '.join(LOGPROB_DTYPES)}, got {logprobs!r}")
    arrays = [("sampled", response.sampled, logprobs)]
    for name, value, dtype in (
        ("topk_ids", response.topk_ids, "int32"),  # top-k ids and log-probs come together
        ("topk_logprobs", response.topk_logprobs, logprobs),
        ("entropy", response.entropy, logprobs),
        ("requested_logprobs", response.requested_logprobs, logprobs),
    ):
        if value is not None:
            arrays.append((name, value, dtype))
    return encode_message("scores", {"positions": int(response.sampled.numel())}, arrays)


def decode_response(data: bytes | bytearray | memoryview) -> ScoreResponse:
    """A `ScoreResponse` with float32 log-probs (bf16 ones widened) and long ids; `WireError` when malformed."""
    kind, meta, arrays = decode_message(data)
    if kind != "scores" or "sampled" not in arrays:
        raise WireError(f"kind: expected a 'scores' message with 'sampled', got {kind!r} with {sorted(arrays)}")
    floats = {k: (v.float() if v.is_floating_point() else v) for k, v in arrays.items()}
    N = floats["sampled"].shape[0]
    for name, value in floats.items():
        if value.shape[0] != N:
            raise WireError(f"{name}: {value.shape[0]} positions, 'sampled' has {N}")
    return ScoreResponse(
        floats["sampled"],
        floats.get("topk_ids"),
        floats.get("topk_logprobs"),
        floats.get("entropy"),
        floats.get("requested_logprobs"),
    )


def response_from_scores(scores: TokenScores, mask_BT: torch.Tensor) -> ScoreResponse:
    """The `mask_BT` positions of `scores` ([B, T, ...] grids), row-major."""
    mask_BT = mask_BT.bool()

    def pick(x: torch.Tensor | None) -> torch.Tensor | None:
        return None if x is None else x[mask_BT]

    return ScoreResponse(
        scores.sampled_logprobs[mask_BT],
        pick(scores.topk_ids),
        pick(scores.topk_logprobs),
        pick(scores.entropy),
        pick(scores.requested_logprobs),
    )


def split_response(response: ScoreResponse, counts: list[int]) -> list[ScoreResponse]:
    """Cut a batch's response into consecutive pieces of `counts` positions (one per merged request)."""
    sampled = response.sampled.split(counts)
    fields = [response.topk_ids, response.topk_logprobs, response.entropy, response.requested_logprobs]
    pieces = [None if f is None else f.split(counts) for f in fields]
    return [ScoreResponse(sampled[i], *(None if p is None else p[i] for p in pieces)) for i in range(len(counts))]


# ------------------------------------------------------------------------------------------------ hidden states


def encode_hidden(hidden_NE: torch.Tensor, dtype: str = "bfloat16") -> bytes:
    """A hidden-state answer: the [N, E] final hidden states of a request's scored positions, row-major, in `dtype`
    (one of `HIDDEN_DTYPES`)."""
    if dtype not in HIDDEN_DTYPES:
        raise WireError(f"hidden dtype: must be one of {', '.join(HIDDEN_DTYPES)}, got {dtype!r}")
    return encode_message("hidden", {"positions": int(hidden_NE.shape[0])}, [("hidden", hidden_NE, dtype)])


def decode_hidden(data: bytes | bytearray | memoryview, positions: int, width: int) -> torch.Tensor:
    """The [N, E] hidden states of a hidden-state answer, in their wire dtype; `WireError` in one line unless it is
    one, of exactly `positions` × `width` (a wrongly shaped or oversized answer is refused before any use)."""
    kind, _, arrays = decode_message(data)
    if kind != "hidden" or set(arrays) != {"hidden"}:
        raise WireError(f"kind: expected a 'hidden' message with 'hidden', got {kind!r} with {sorted(arrays)}")
    hidden = arrays["hidden"]
    if tuple(hidden.shape) != (positions, width) or not hidden.is_floating_point():
        raise WireError(
            f"hidden: shape {list(hidden.shape)} ({hidden.dtype}), expected [{positions} scored positions, {width}] "
            f"floats"
        )
    return hidden


def encode_head(
    weight_VE: torch.Tensor, bias_V: torch.Tensor | None, meta: dict, dtype: str
) -> bytes:  # the output head, once per client
    """The teacher's output head: weight [V, E] (and bias [V]) in `dtype`; `meta` carries logit_scale, softcap,
    vocab_size, vocab_hash, dtype and head_hash for the client's checks."""
    arrays = [("weight", weight_VE, dtype)]
    if bias_V is not None:
        arrays.append(("bias", bias_V, dtype))
    return encode_message("head", meta, arrays)


def decode_head(data: bytes | bytearray | memoryview) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """(weight [V, E], bias [V] or None, meta) of a head message; `WireError` when it is not one."""
    kind, meta, arrays = decode_message(data)
    if kind != "head" or "weight" not in arrays or not set(arrays) <= {"weight", "bias"}:
        raise WireError(f"kind: expected a 'head' message with 'weight', got {kind!r} with {sorted(arrays)}")
    weight, bias = arrays["weight"], arrays.get("bias")
    if weight.dim() != 2 or (bias is not None and tuple(bias.shape) != (weight.shape[0],)):
        raise WireError(
            f"head: weight {list(weight.shape)}, bias {None if bias is None else list(bias.shape)}; expected [V, E] "
            f"and [V]"
        )
    return weight, bias, meta
