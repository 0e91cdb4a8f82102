"""The forward pass of a Hugging Face causal LM over the response positions of rollouts: the one place that runs a
model body for scoring or for the trainer's grad pass and picks the response positions (response token t of row b is
predicted by the hidden state at `prompt_lengths[b] - 1 + t`), in micro-batches of a token budget, rows right-padded
or packed into one sequence (`uses_packing`); and the model's vocabulary head (`output_head`). The chunked
projection of those hidden states is `opd.scoring`'s. Used by the teacher/student scorer (`opd.teacher.local`) and
by the student's update (`opd.train.step`, `opd.train.sft`).

Omitted: KV-cache reuse of shared prompts across the n samples of a group (simple, but a second code path);
left-padded inputs; heads other than those `output_head` recognises (it raises, see `check_output_head`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from opd.kernels import varlen_attention
from opd.scoring import OutputHead
from opd.types import Rollouts

Packing = Literal["auto", "packed", "padded"]


def output_head(model: torch.nn.Module) -> OutputHead:
    """The vocabulary projection of an HF causal LM: output embedding weight (+ bias), logit scale and soft-cap.

    Recognised post-processing: `final_logit_softcapping` (Gemma 2/3), a float `logit_scale` on the model (Cohere),
    `logits_scaling` as a divisor (Granite). `check_output_head` verifies the result against the model's own logits.
    """
    hf: Any = model  # an HF model: its methods, config and attributes are not on nn.Module's type
    embeddings = hf.get_output_embeddings()
    if embeddings is None or not isinstance(getattr(embeddings, "weight", None), torch.Tensor):
        raise NotImplementedError(f"{type(model).__name__} has no output embedding with a weight to score with")
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    scale = 1.0
    if isinstance(getattr(model, "logit_scale", None), (int, float)):
        scale = float(hf.logit_scale)
    if str(getattr(config, "model_type", "")).startswith("granite") and getattr(config, "logits_scaling", None):
        scale = 1.0 / float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return OutputHead(embeddings.weight, getattr(embeddings, "bias", None), scale, softcap)


@torch.no_grad()
def check_output_head(model: torch.nn.Module, head: OutputHead | None = None, *, through_root: bool = False) -> None:
    """Raise `NotImplementedError` unless `head` reproduces the model's own logits on a 4-token input (catches heads
    with post-processing that `output_head` does not know, which would otherwise give silently wrong scores)."""
    head = head or output_head(model)
    device = model_device(model)
    ids_1L = (torch.arange(4, device=device) % head.weight.shape[0])[None]
    was_training = model.training
    model.eval()
    try:
        reference_LV = model(input_ids=ids_1L, use_cache=False).logits[0].float()
        hidden_LD = _run_body(model, ids_1L, None, None, through_root)[0]
    finally:
        model.train(was_training)
    hidden_LD = hidden_LD.to(head.weight.device)  # a device map may put the body's end and the head apart
    ours_LV = torch.nn.functional.linear(hidden_LD, head.weight, head.bias).float().to(reference_LV.device)
    ours_LV = ours_LV * head.logit_scale
    if head.softcap is not None:
        ours_LV = head.softcap * torch.tanh(ours_LV / head.softcap)
    # bf16 heads may round the scale/cap steps differently from us: allow a few bf16 ulps of the logit range.
    relative = 1e-4 if head.weight.dtype in (torch.float32, torch.float64) else 3e-2
    tol = relative * max(1.0, float(reference_LV.abs().max()))
    error = float((ours_LV - reference_LV).abs().max())
    if not error <= tol:
        raise NotImplementedError(
            f"{type(model).__name__}: logits rebuilt from the final hidden state differ from the model's by "
            f"{error:.3g} (tolerance {tol:.3g}); its output head has post-processing that "
            f"opd.teacher.local.output_head does not know"
        )


@dataclass
class ResponseHidden:
    """Final (normed) hidden states at the selected response positions of a batch, flattened.

    hidden_ND:  [N, D] model dtype, on the model's device; carries grad when computed with grad
    rows_N:     [N] long, row b in the batch of each hidden state
    cols_N:     [N] long, response position t of each hidden state
    targets_N:  [N] long, the response token at (b, t), i.e. the token the hidden state predicts
    grid_shape: (B, T), the response grid the indices refer to
    """

    hidden_ND: torch.Tensor
    rows_N: torch.Tensor
    cols_N: torch.Tensor
    targets_N: torch.Tensor
    grid_shape: tuple[int, int]

    def to_grid(self, values_N: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """Scatter `[N, ...]` values into a `[B, T, ...]` grid filled with `fill` elsewhere (differentiable)."""
        grid = values_N.new_full((*self.grid_shape, *values_N.shape[1:]), fill)
        return grid.index_put((self.rows_N, self.cols_N), values_N)


# "auto" packs a batch only when padding would be at least this share of its tokens: on rows without padding the
# padded SDPA batch measured faster (docs/performance.md)
PACK_MIN_PADDING = 0.1


def uses_packing(model: torch.nn.Module, packing: Packing = "auto") -> bool:
    """Whether `forward_hidden` may pack rows for this model: "auto" packs for varlen/flash/flex attention only, and
    then only batches with at least `PACK_MIN_PADDING` padding."""
    if packing not in ("auto", "packed", "padded"):
        raise ValueError(f"packing must be 'auto', 'packed' or 'padded', got {packing!r}")
    if packing != "auto":
        return packing == "packed"
    implementation = str(getattr(model.config, "_attn_implementation", None) or "")
    return "flash" in implementation or "flex" in implementation or implementation == varlen_attention.ATTENTION


def needed_lengths(rollouts: Rollouts, positions_mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """[B] long: input tokens each row must run through the model so that every selected response position has its
    hidden state (last selected position + 1; later tokens cannot influence it). 0 for rows with nothing selected."""
    mask_BT = rollouts.response_mask if positions_mask_BT is None else positions_mask_BT
    positions_BT = rollouts.response_positions()
    if mask_BT.shape[1] == 0:
        return torch.zeros(mask_BT.shape[0], dtype=torch.long, device=mask_BT.device)
    return torch.where(mask_BT.bool(), positions_BT + 1, 0).amax(dim=1)


def split_by_token_budget(lengths_B: torch.Tensor, max_tokens: int, *, padded: bool) -> list[torch.Tensor]:
    """Row groups (each a [b] long index tensor, on CPU) whose forward stays within `max_tokens` input tokens:
    Σ lengths when packed, rows × longest when padded (rows sorted by length so padding stays small). A row longer
    than the budget goes alone. Rows of length 0 are left out."""
    lengths = lengths_B.tolist()
    order = [b for b, n in enumerate(lengths) if n > 0]
    if padded:
        order.sort(key=lambda b: -lengths[b])  # stable: equal lengths keep their order
    groups: list[list[int]] = []
    current: list[int] = []
    longest, total = 0, 0
    for b in order:
        n = lengths[b]
        cost = (len(current) + 1) * max(longest, n) if padded else total + n
        if current and cost > max_tokens:
            groups.append(current)
            current, longest, total = [], 0, 0
        current.append(b)
        longest, total = max(longest, n), total + n
    if current:
        groups.append(current)
    return [torch.tensor(g, dtype=torch.long) for g in groups]


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _run_body(model, input_ids, attention_mask, position_ids, through_root: bool, **kwargs) -> torch.Tensor:
    """[b, L, D] final normed hidden states; no vocabulary projection. kwargs go to the model's forward."""
    body = model.get_decoder()
    kwargs.update(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    if not through_root:
        return body(**kwargs).last_hidden_state
    # Through the root module (FSDP2: its pre-forward unshards the embedding, final norm and head), capturing the
    # body's output with a hook; logits_to_keep=1 makes the head's own projection one position per row.
    captured: dict[str, torch.Tensor] = {}
    handle = body.register_forward_hook(lambda _module, _args, output: captured.update(h=output.last_hidden_state))
    try:
        model(**kwargs, logits_to_keep=1)
    finally:
        handle.remove()
    return captured["h"]


def forward_hidden(
    model: torch.nn.Module,
    rollouts: Rollouts,
    *,
    positions_mask_BT: torch.Tensor | None = None,
    packing: Packing = "auto",
    through_root: bool = False,
) -> ResponseHidden:
    """Run the model body over `rollouts` (one forward, no micro-batching; grad mode and train/eval mode are the
    caller's) and return the hidden states at the selected response positions.

    positions_mask_BT: [B, T] bool, the positions wanted; default `rollouts.response_mask`.
    packing:           see `uses_packing` (docs/design.md); both layouts give the same hidden states.
    through_root:      call the model's own forward (logits for one position per row) instead of the body directly,
                       for wrappers whose root forward must run (FSDP2); same result.
    Only the tokens up to the last selected position run; rows with no selected position are skipped.
    The returned tensors live on the model's device.
    """
    device = model_device(model)
    batch = rollouts.to(device)
    mask_BT = (batch.response_mask if positions_mask_BT is None else positions_mask_BT.to(device)).bool()
    B, T = batch.response_ids.shape
    grid_shape = (B, T)
    rows_N, cols_N = mask_BT.nonzero(as_tuple=True)
    targets_N = batch.response_ids[rows_N, cols_N]
    lengths_B = needed_lengths(batch, mask_BT)
    if rows_N.numel() == 0:
        weight = output_head(model).weight
        empty = torch.zeros(0, weight.shape[1], dtype=weight.dtype, device=device)
        return ResponseHidden(empty, rows_N, cols_N, targets_N, grid_shape)

    # Rows must be contiguous from position 0 (right padding) and cover every selected position.
    attention_BL = batch.attention_mask.bool()
    real_B = attention_BL.sum(1)
    if not bool((attention_BL.long().cumprod(1).sum(1) == real_B).all() and (lengths_B <= real_B).all()):
        raise ValueError(
            "rollouts must be right-padded (attention_mask a prefix of each row) and cover every "
            "selected response position"
        )
    positions_N = batch.response_positions()[rows_N, cols_N]

    live_b = (lengths_B > 0).nonzero(as_tuple=True)[0]  # rows with something to score
    lengths_b = lengths_B[live_b]
    max_len = int(lengths_b.max())
    ids_bL = batch.input_ids[live_b, :max_len]
    slot_B = torch.full_like(lengths_B, -1)
    slot_B[live_b] = torch.arange(live_b.numel(), device=device)  # row b -> its index among live rows

    pack = uses_packing(model, packing)
    if pack and packing == "auto":
        pack = int(lengths_b.sum()) <= (1 - PACK_MIN_PADDING) * max_len * lengths_b.numel()
    if pack:
        keep_bL = torch.arange(max_len, device=device)[None] < lengths_b[:, None]
        position_ids_1L = torch.arange(max_len, device=device).expand_as(keep_bL)[keep_bL][None]
        implementation = getattr(model.config, "_attn_implementation", None)
        varlen = implementation == varlen_attention.ATTENTION
        row_kwargs = varlen_attention.packed_kwargs(lengths_b, max_len) if varlen else {}
        hidden_LD = _run_body(
            model,
            ids_bL[keep_bL][None],
            row_kwargs.pop("attention_mask", None),
            position_ids_1L,
            through_root,
            **row_kwargs,
        )[0]
        offsets_b = torch.cumsum(lengths_b, 0) - lengths_b
        hidden_ND = hidden_LD[offsets_b[slot_B[rows_N]] + positions_N]
    else:
        attention_bL = torch.arange(max_len, device=device)[None] < lengths_b[:, None]
        hidden_bLD = _run_body(model, ids_bL, attention_bL.long(), None, through_root)
        hidden_ND = hidden_bLD[slot_B[rows_N], positions_N]
    return ResponseHidden(hidden_ND, rows_N, cols_N, targets_N, grid_shape)
