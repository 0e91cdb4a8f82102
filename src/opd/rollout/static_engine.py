"""`StaticGenerator`: the `TorchGenerator` contract with a static KV cache and a decode step replayed as CUDA graphs.

Why: at RL batch sizes decoding a 0.6B–4B model is bound by launching kernels from Python (~2,000 launches per step
through `model.generate()` or `TorchGenerator`), not by the GPU. Replaying one captured graph per step removes the
launches; compiling the two elementwise-heavy halves of a decoder layer and the sampling with `torch.compile`, fusing
weights and calling one attention kernel cut the number of kernels per step (at 28 small layers, that number sets
the step time, not the memory traffic).

How a chunk runs (chunking, seeding, eval mode and no_grad come from `TorchGenerator.generate`):
1. Prefill every distinct prompt once through the Hugging Face model (left-padded, `TorchGenerator._prefill`), then
   copy its keys/values into one static cache per layer, `[R, H_kv, S, D_h]` in the compute dtype, one row per sample
   (prefix sharing: the n samples of a prompt are n copies of one prefill). Slots `[0, W)` hold the prompts, slot
   `W + t` decode token t.
2. Build the step's weights (`fuse_weights`): per layer one q/k/v and one gate/up matrix, o_proj with its input
   columns in the head order SDPA writes, and every other weight, in the compute dtype (autocast's if autocast is on,
   else the parameters'), rebuilt for every chunk so that optimizer updates between calls are seen. The decode step
   then runs without autocast: no weight is cast at every step.
3. Token 0 is sampled from the prefill logits. Each later step runs our own decode forward: RMSNorm, one q/k/v GEMM,
   q/k-norm and RoPE from a precomputed table (one compiled function), then attention. On CUDA (`attention="auto"`)
   that is the Triton kernel `opd.kernels.decode_attention`: it writes the step's keys/values into the cache and
   reads only each row's valid slots, whose bounds it takes from device tensors, so one graph serves every step of
   the chunk. Otherwise ("sdpa", the CPU default) the cache write is two index copies and one SDPA call runs over the
   first S_b slots with a 0/-inf mask (S_b = the step's length rounded up to `kv_bucket`, one graph per bucket; the
   G = H / H_kv query heads of a kv head are SDPA's query positions). Then o-projection, MLP and the next layer's
   input norm (the second compiled function), head, sampling (the third).
4. Sampling is Gumbel-max, `argmax(z / τ + g)` with g = -log(-log u), which draws exactly from softmax(z / τ) after the
   same top-k / top-p filter as `TorchGenerator`; u comes from the call's seeded `torch.Generator`, written into a
   buffer before each replay (the graph itself holds no random state). Finished rows, lengths, tokens and log-probs
   are updated on the device; the host looks at them every `sync_interval` steps only (one sync each).

Measured on one H200 (2026-11-30, torch 2.11, random Qwen3-0.6B shape, bf16, 64 prompts × 512 new tokens, prompt
128; `benchmarks/rollout.py`, docs/performance.md): 26.6k–27.2k tok/s (2.35–2.41 ms a step), against 17.7k with SDPA
attention, 1.9k for `TorchGenerator`, 2.1k–2.4k for `model.generate` without cuDNN attention and 1.3k–2.2k with its
default kernel choice, in the same process; 47.3k–47.8k tok/s at 256 rows. Reported log-probs agree with a
teacher-forced forward as closely as `TorchGenerator`'s do (mean |Δ| 7e-3, bf16). With SDPA the cache write stays
outside the compiled function on purpose: inside it, the step measured twice as slow (most likely a copy of the whole
cache tensor per layer; not profiled).

Scope: decoder-only Llama / Qwen2 / Qwen3 layouts (pre-norm, SiLU gated MLP, optional q/k-norm, full attention,
static RoPE). Anything else (sliding windows, dynamic RoPE, other families) raises at construction unless
`fallback=True`, which then runs `TorchGenerator`'s loop. On CPU the same decode step runs eagerly (this is what the
CPU tests check against `TorchGenerator`); graphs and compilation are CUDA-only.

Omitted: dropping finished rows (static shapes; a row that finished keeps computing until the chunk ends or every row
has finished), a paged cache, speculative decoding, shared-prefix (cascade) attention for the n samples of a prompt
(each row reads its own copy of the prompt's keys/values). `flex_attention`'s decoding path was tried on the H200:
4× slower than SDPA at 64 rows, and its graph capture failed at 256 rows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

import torch
import torch.nn.functional as F

from opd.kernels import decode_attention as triton_attention
from opd.rollout.base import SamplingParams
from opd.rollout.torch_engine import TorchGenerator, filter_logits

_SUPPORTED = ("llama", "qwen2", "qwen3")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm exactly as the HF Llama/Qwen modules compute it (float32 statistics, weight applied after the cast)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _project(h_RD: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
             sizes: list[int]) -> Sequence[torch.Tensor]:
    """Projections of h sharing an input: one GEMM whose output is split into `sizes` when `weights` is one fused
    matrix, else one GEMM per weight. [R, D] → one [R, size] per projection."""
    if len(weights) == 1:
        return F.linear(h_RD, weights[0], biases[0]).split(sizes, dim=-1)
    return [F.linear(h_RD, w, b) for w, b in zip(weights, biases)]


def _attn_in(h_RD, w_qkv, b_qkv, qn_w, kn_w, eps, cos_R1D, sin_R1D, heads: int, kv_heads: int, dh: int):
    """q/k/v projections, q/k-norm and RoPE for one normed token per row: [R, D] → q [R, H, Dh], k and v
    [R, Hkv, Dh]. The caller writes k and v into the cache: inside a compiled function the in-place write to the
    whole cache tensor measured slower on an H200 (torch 2.11) than two separate small copy kernels."""
    rows = h_RD.shape[0]
    q, k, v = _project(h_RD, w_qkv, b_qkv, [heads * dh, kv_heads * dh, kv_heads * dh])
    q, k, v = q.reshape(rows, heads, dh), k.reshape(rows, kv_heads, dh), v.reshape(rows, kv_heads, dh)
    if qn_w is not None:
        q, k = _rms(q, qn_w, eps), _rms(k, kn_w, eps)
    return _rotate(q, cos_R1D, sin_R1D), _rotate(k, cos_R1D, sin_R1D), v


def _attn_out(x_RD, attn_RE, wo, bo, ln_w, eps, w_gu, b_gu, wd, bd, next_ln_w, next_eps):
    """o-projection + residual, post-attention norm, SiLU-gated MLP + residual, then the next layer's input norm (the
    final norm after the last layer), so that the residual add and that norm fuse: [R, D] → (x [R, D], normed x)."""
    x_RD = _residual_add(x_RD, F.linear(attn_RE, wo, bo))
    h_RD = _rms(x_RD, ln_w, eps)
    gate_RI, up_RI = _project(h_RD, w_gu, b_gu, [wd.shape[1], wd.shape[1]])
    x_RD = _residual_add(x_RD, F.linear(F.silu(gate_RI) * up_RI, wd, bd))
    return x_RD, _rms(x_RD, next_ln_w, next_eps)


def _residual_add(x_RD: torch.Tensor, y_RD: torch.Tensor) -> torch.Tensor:
    """x + y computed in float32 and rounded once: bit-identical to a bf16/fp16 add (which computes in float32 too).
    Spelled this way because inductor rewrites `x + mm(a, b)` into `addmm(x, a, b)`, whose 2-D input costs a copy of x
    and a slower GEMM per residual add; here the add fuses into the following RMSNorm kernel instead."""
    return (x_RD.float() + y_RD.float()).to(x_RD.dtype)


def _attend_sdpa(q_RKGD, keys_RKSD, values_RKSD, bias_RKGS, scaling: float) -> torch.Tensor:
    """Grouped-query attention of one token per row as one SDPA call: the G query heads sharing a kv head are its
    query positions (no causal mask among them: all see the same slots). bias: 0 / -inf, q's dtype. → [R, Hkv, G, Dh]"""
    return F.scaled_dot_product_attention(q_RKGD, keys_RKSD, values_RKSD, attn_mask=bias_RKGS, scale=scaling)


def _attend_matmul(q_RKGD, keys_RKSD, values_RKSD, bias_RKGS, scaling: float) -> torch.Tensor:
    """`_attend_sdpa` spelled out (the reference): scores, float32 softmax, weighted sum of values."""
    scores_RKGS = torch.matmul(q_RKGD, keys_RKSD.transpose(2, 3)) * scaling
    probs_RKGS = torch.softmax(scores_RKGS + bias_RKGS, dim=-1, dtype=torch.float32).to(q_RKGD.dtype)
    return torch.matmul(probs_RKGS, values_RKSD)


_ATTENTION: dict[str, Callable] = {"sdpa": _attend_sdpa, "matmul": _attend_matmul}
_ATTENTION_CHOICES = ("auto", "triton", *_ATTENTION)


def _sample(logits_RV: torch.Tensor, noise_RN: torch.Tensor | None, temperature: float, vocab_size: int,
            top_k: int, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row among ids < vocab_size: Gumbel-max `argmax(filter(z / τ) - log(-log u))`, which draws from
    softmax of the filtered z / τ; greedy `argmax z` at τ = 0 (noise None, top-k/top-p ignored).
    logits [R, V ≥ vocab_size], uniform noise u [R, ≥ vocab_size] → (tokens [R] long, log-probs [R] float32).
    The log-prob is log_softmax(z / τ) over ids < vocab_size at the token, before top-k/top-p filtering."""
    scaled_RN = logits_RV[:, :vocab_size].float()  # a prefix slice: column indices stay token ids
    if temperature == 0:
        tokens_R = scaled_RN.argmax(dim=-1)
    else:
        scaled_RN = scaled_RN / temperature
        filtered_RN = filter_logits(scaled_RN, top_k, top_p) if top_k > 0 or top_p < 1.0 else scaled_RN
        gumbel_RN = -torch.log(-torch.log(noise_RN[:, :vocab_size]))  # u = 0 gives -inf: never chosen, as it should
        tokens_R = _split_argmax(filtered_RN + gumbel_RN)
    logprobs_R = scaled_RN.gather(-1, tokens_R[:, None]).squeeze(-1) - _split_logsumexp(scaled_RN)
    return tokens_R, logprobs_R


_SPLIT = 64  # pieces per row of the vocabulary reductions below


def _split_rows(x_RN: torch.Tensor) -> torch.Tensor:
    """[R, N] → [R, _SPLIT, ⌈N / _SPLIT⌉], padded with -inf. The sampling reductions run over these pieces first, so
    that the argmax and the log-sum-exp fuse into one kernel over R × _SPLIT pieces rather than two over R rows of
    151k entries (compiled, 64 rows, H200 profile: one 71 µs kernel and a small second stage, instead of 73 + 20 µs)."""
    width = -(-x_RN.shape[-1] // _SPLIT)
    return F.pad(x_RN, (0, width * _SPLIT - x_RN.shape[-1]), value=float("-inf")).view(x_RN.shape[0], _SPLIT, width)


def _split_argmax(x_RN: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) in two stages (per piece, then over pieces): [R, N] → [R] long. (Ties may pick another maximum.)"""
    pieces_RPW = _split_rows(x_RN)
    best_RP, where_RP = pieces_RPW.max(dim=-1)
    piece_R1 = best_RP.argmax(dim=-1, keepdim=True)
    return (piece_R1 * pieces_RPW.shape[-1] + where_RP.gather(-1, piece_R1)).squeeze(-1)


def _split_logsumexp(x_RN: torch.Tensor) -> torch.Tensor:
    """x.logsumexp(-1) in two stages: [R, N] → [R]."""
    return _split_rows(x_RN).logsumexp(dim=-1).logsumexp(dim=-1)


def _cast(tensor: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """tensor in dtype: itself when it already is (or dtype is None), else a copy."""
    return tensor if tensor is None or dtype is None else tensor.to(dtype)


def _projection_weights(linears: Sequence[torch.nn.Linear], dtype: torch.dtype | None) -> tuple[tuple, tuple]:
    """(weights, biases) of Linear layers sharing an input, as `_project` takes them: the modules' own tensors, one
    per layer (dtype None), or one row-wise concatenation in dtype (a copy; a missing bias becomes zeros)."""
    weights, biases = tuple(m.weight for m in linears), tuple(m.bias for m in linears)
    if dtype is None:
        return weights, biases
    fused_weight = torch.cat([w.to(dtype) for w in weights])
    if all(b is None for b in biases):
        return (fused_weight,), (None,)
    fused_bias = torch.cat([w.new_zeros(w.shape[0], dtype=dtype) if b is None else b.to(dtype)
                            for w, b in zip(weights, biases)])
    return (fused_weight,), (fused_bias,)


@dataclass
class _Layer:
    """One decoder layer's step arguments (`_attn_in`'s weights, `_attn_out`'s weights and next norm) and its cache."""

    attn_in: tuple
    attn_out: tuple
    keys: torch.Tensor  # [R, Hkv, S, Dh]
    values: torch.Tensor


def _head_dim(model: torch.nn.Module) -> int:
    attention = model.get_decoder().layers[0].self_attn
    return attention.q_proj.weight.shape[0] // model.config.num_attention_heads


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why `StaticGenerator` cannot run `model` with its own decode step, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED:
        return f"model_type {model_type!r} is not one of {', '.join(_SUPPORTED)}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} is not silu"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "some layers use sliding-window attention"
    if getattr(config, "use_sliding_window", False):
        return "use_sliding_window is on"
    body = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(body, "rotary_emb", None)
    if rotary is None or not hasattr(body, "layers") or not hasattr(body, "norm"):
        return "the decoder has no rotary_emb / layers / norm"
    if getattr(rotary, "rope_type", "default") == "dynamic":
        return "dynamic RoPE scaling changes with the sequence length"
    head = model.get_output_embeddings()
    if getattr(model, "logit_scale", None) is not None or getattr(config, "final_logit_softcapping", None):
        return "the output head has a logit scale or soft-cap"
    if head is None or not isinstance(head, torch.nn.Linear):
        return "the output head is not a Linear layer"
    return None


class StaticGenerator(TorchGenerator):
    """`Generator` with a static KV cache and CUDA-graph decode steps; same arguments and results contract as
    `TorchGenerator` (prompt-major outputs, EOS kept, log-probs before top-k/top-p filtering, seeded).

    kv_bucket:    with "sdpa" / "matmul" attention, decode steps attend over the cache rounded up to a multiple of
                  this many slots (one graph each); smaller buckets read less cache per step but capture more graphs,
                  ≥ 1. Unused by the Triton kernel, which reads each row's exact slots
    cuda_graphs:  capture and replay the decode step (CUDA only); None = on CUDA
    compile:      `torch.compile` the two halves of a layer and the sampling (CUDA only; the first call per batch
                  shape pays the compile); None = on CUDA, falling back to the plain step with a warning if compilation
                  fails. Results agree with the uncompiled step to bf16 rounding
    fuse_weights: True = per chunk, build one q/k/v and one gate/up matrix per layer and cast every weight the step
                  uses to the compute dtype once (autocast's dtype when autocast is on at generate time, else the
                  parameters'), then decode without autocast. Extra memory while a chunk runs: the concatenations are
                  copies, and so is o_proj with its input columns reordered to the layout SDPA writes (together
                  about 80% of the layer weights: 0.7 GB for Qwen3-0.6B in bf16); with float32 parameters under
                  bf16 autocast every weight is copied once in bf16 (1.2 GB for Qwen3-0.6B), and the residual
                  stream is bf16 as in a bf16 model (autocast keeps it float32).
                  False = one GEMM per projection on the module's own tensors, under the caller's autocast
    attention:    "auto" = "triton" on CUDA when Triton is installed and the head size is a power of two in
                  [16, 256], else "sdpa"; "triton" = the split-KV kernel
                  `opd.kernels.decode_attention` (CUDA, or CPU under Triton's interpreter: the tests); "sdpa" = one
                  masked `scaled_dot_product_attention` call per layer; "matmul" = explicit matmul / float32 softmax /
                  matmul (the reference; more kernels)
    fallback:     for a model this engine does not cover (`unsupported_reason`), run `TorchGenerator`'s loop instead
                  of raising
    The other arguments are `TorchGenerator`'s; compact_fraction is unused (rows are never dropped). The static cache
    is in the compute dtype whatever fuse_weights is.

    Results depend on the chunk's row count as `TorchGenerator`'s do, and differ from `TorchGenerator`'s samples
    for the same seed (another sampling algorithm, the same distribution).
    """

    def __init__(self, model: torch.nn.Module, *, kv_bucket: int = 128, cuda_graphs: bool | None = None,
                 compile: bool | None = None, fuse_weights: bool = True,
                 attention: Literal["auto", "triton", "sdpa", "matmul"] = "auto", fallback: bool = False,
                 sync_interval: int = 32, **kwargs: Any) -> None:
        super().__init__(model, sync_interval=sync_interval, **kwargs)
        if kv_bucket < 1:
            raise ValueError(f"StaticGenerator kv_bucket must be an integer ≥ 1, got {kv_bucket!r}")
        if attention not in _ATTENTION_CHOICES:
            raise ValueError(f"StaticGenerator attention must be one of {', '.join(_ATTENTION_CHOICES)}, "
                             f"got {attention!r}")
        if attention == "triton" and not triton_attention.available(self.device):
            raise ValueError(f"StaticGenerator attention='triton' needs Triton and a CUDA model (device {self.device}, "
                             f"Triton {'installed' if triton_attention.triton else 'not installed'}); use 'auto'")
        self.kv_bucket = kv_bucket
        self.cuda_graphs = cuda_graphs
        self.compile = compile
        self.fuse_weights = fuse_weights
        self.attention = attention
        self.reason = unsupported_reason(model)
        if self.reason is not None and not fallback:
            raise NotImplementedError(f"StaticGenerator cannot run {type(model).__name__}: {self.reason} "
                                      "(pass fallback=True to use TorchGenerator's loop)")
        if attention == "triton" and self.reason is None and not triton_attention.supports(_head_dim(model)):
            raise ValueError(f"StaticGenerator attention='triton' needs a power-of-two head size in [16, 256], this "
                             f"model's is {_head_dim(model)}; use 'auto'")
        self._compiled: tuple[Callable, Callable, Callable] | None = None

    def _step_fns(self, on_cuda: bool) -> tuple[Callable, Callable, Callable]:
        """(attn_in, attn_out, sample): compiled on CUDA unless compile=False, else the plain functions."""
        if not (on_cuda and self.compile is not False):
            return _attn_in, _attn_out, _sample
        if self._compiled is None:
            self._compiled = tuple(torch.compile(fn, dynamic=False) for fn in (_attn_in, _attn_out, _sample))
        return self._compiled

    def _generate_chunk(self, prompts, counts, params: SamplingParams, generator: torch.Generator):
        if self.reason is not None:
            return super()._generate_chunk(prompts, counts, params, generator)
        return _StaticRun(self, prompts, counts, params, generator).run()


class _StaticRun:
    """The state of one chunk: step weights, static cache, device-side step counters and outputs, the decode step and
    its graphs."""

    def __init__(self, engine: StaticGenerator, prompts, counts, params: SamplingParams, generator: torch.Generator):
        self.engine, self.params, self.generator = engine, params, generator
        model = engine.model
        self.device = device = engine.device
        body, head = model.get_decoder(), model.get_output_embeddings()
        config = model.config
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        kernel_ok = triton_attention.available(device) and triton_attention.supports(_head_dim(model))
        auto = "triton" if kernel_ok and device.type == "cuda" else "sdpa"
        self.attention = auto if engine.attention == "auto" else engine.attention
        self.attend = _ATTENTION.get(self.attention)

        # The compute dtype is what the GEMMs run in: autocast's when the caller enabled it, else the parameters'.
        self.autocast = torch.is_autocast_enabled(device.type)
        self.dtype = dtype = (torch.get_autocast_dtype(device.type) if self.autocast
                              else body.layers[0].self_attn.q_proj.weight.dtype)
        self.fused = engine.fuse_weights
        shadow = dtype if self.fused else None  # None: the module's own tensors

        cache, mask_PL, logits_PV = engine._prefill(prompts, device)
        source_R = torch.repeat_interleave(torch.arange(len(prompts), device=device),
                                           torch.as_tensor(counts, device=device))
        self.rows, self.width, self.steps = source_R.numel(), mask_PL.shape[1], params.max_new_tokens
        self.capacity = self.width + self.steps  # slots; the last sampled token is never fed back, so one spare

        # Step weights (read now, so a chunk sees the latest optimizer step) and static cache filled from the prefill.
        input_norms = [layer.input_layernorm for layer in body.layers] + [body.norm]  # layer i's next norm: i + 1
        self.first_norm = (_cast(input_norms[0].weight, shadow), input_norms[0].variance_epsilon)
        self.embed_VD = _cast(body.embed_tokens.weight, shadow)
        tied = head.weight is body.embed_tokens.weight
        self.head_w, self.head_b = (self.embed_VD if tied else _cast(head.weight, shadow)), _cast(head.bias, shadow)
        self.layers: list[_Layer] = []
        for i, layer in enumerate(body.layers):
            attn, mlp, post, following = layer.self_attn, layer.mlp, layer.post_attention_layernorm, input_norms[i + 1]
            qn, kn = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
            w_qkv, b_qkv = _projection_weights((attn.q_proj, attn.k_proj, attn.v_proj), shadow)
            w_gu, b_gu = _projection_weights((mlp.gate_proj, mlp.up_proj), shadow)
            ins = (w_qkv, b_qkv, None if qn is None else _cast(qn.weight, shadow),
                   None if kn is None else _cast(kn.weight, shadow), input_norms[i].variance_epsilon)
            w_o = _cast(attn.o_proj.weight, shadow)
            if shadow is not None:  # input columns in (G, Hkv) head order, see `_decode_step` (a copy when G > 1)
                w_o = w_o.unflatten(1, (self.kv_heads, self.heads // self.kv_heads, -1)).transpose(1, 2).flatten(1)
            outs = (w_o, _cast(attn.o_proj.bias, shadow), _cast(post.weight, shadow),
                    post.variance_epsilon, w_gu, b_gu, _cast(mlp.down_proj.weight, shadow),
                    _cast(mlp.down_proj.bias, shadow), _cast(following.weight, shadow), following.variance_epsilon)
            keys_PHWD, values_PHWD = _cached_kv(cache, i)
            shape = (self.rows, keys_PHWD.shape[1], self.capacity, keys_PHWD.shape[3])
            keys = torch.zeros(shape, dtype=dtype, device=device)
            values = torch.zeros(shape, dtype=dtype, device=device)
            keys[:, :, : self.width] = keys_PHWD[source_R]
            values[:, :, : self.width] = values_PHWD[source_R]
            self.layers.append(_Layer(ins, outs, keys, values))
            self.scaling = attn.scaling
        del cache

        # RoPE table over every slot position, computed by the model's own rotary module (float32, cast per step).
        positions_1S = torch.arange(self.capacity, device=device)[None]
        probe = torch.zeros(1, dtype=torch.float32, device=device)
        cos_1SD, sin_1SD = body.rotary_emb(probe, positions_1S)
        self.cos_SD, self.sin_SD = cos_1SD[0].float(), sin_1SD[0].float()

        # Device-side state, all static buffers the graphs read and write.
        prompt_mask_RW = mask_PL[source_R].bool()
        slots_S = torch.arange(self.capacity, device=device)
        self.prompt_valid_RS = torch.zeros(self.rows, self.capacity, dtype=torch.bool, device=device)
        self.prompt_valid_RS[:, : self.width] = prompt_mask_RW
        self.decode_region_S = slots_S >= self.width
        self.slots_S = slots_S
        self.position_R = prompt_mask_RW.sum(-1)  # the next fed token's position
        self.start_R = self.width - self.position_R  # first real prompt slot (prompts are left-padded)
        self.slot_1 = torch.full((1,), self.width, dtype=torch.long, device=device)  # where the next fed token goes
        self.col_1 = torch.ones(1, dtype=torch.long, device=device)  # output column the next step writes
        self.tokens_R = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.finished_R = torch.zeros(self.rows, dtype=torch.bool, device=device)
        self.lengths_R = torch.zeros(self.rows, dtype=torch.long, device=device)
        self.out_ids_RT = torch.full((self.rows, self.steps), engine.pad_token_id, dtype=torch.long, device=device)
        self.out_lps_RT = torch.zeros((self.rows, self.steps), dtype=torch.float32, device=device)
        self.eos_E = torch.as_tensor(engine.eos_token_ids or [-1], dtype=torch.long, device=device)
        self.vocab = min(engine.vocab_size or logits_PV.shape[-1], logits_PV.shape[-1])  # sampled ids are < vocab
        self.noise_RN = None if params.temperature == 0 else torch.zeros(self.rows, self.vocab, device=device)
        self.logits_RV = logits_PV[source_R]

    # ------------------------------------------------------------------ one step

    def _sample_and_record(self, logits_RV: torch.Tensor, col_1: torch.Tensor, sample: Callable) -> None:
        """Sample one token per row and write it (and its log-prob) into column col_1; no host sync."""
        params, engine = self.params, self.engine
        tokens_R, logprobs_R = sample(logits_RV, self.noise_RN, params.temperature, self.vocab, params.top_k,
                                      params.top_p)
        alive_R = ~self.finished_R
        self.out_ids_RT.index_copy_(1, col_1, torch.where(alive_R, tokens_R, engine.pad_token_id)[:, None])
        self.out_lps_RT.index_copy_(1, col_1, torch.where(alive_R, logprobs_R, 0.0)[:, None])
        self.lengths_R.add_(alive_R.long())
        if params.stop_at_eos:
            self.finished_R.logical_or_(alive_R & (tokens_R[:, None] == self.eos_E[None]).any(-1))
        self.tokens_R.copy_(tokens_R)

    def _decode_step(self, span: int, fns: tuple[Callable, Callable, Callable]) -> None:
        """Feed tokens_R at slot slot_1, attending over the first `span` slots; sample into column col_1; advance."""
        attn_in, attn_out, sample = fns
        rows, heads, kv_heads = self.rows, self.heads, self.kv_heads
        x_RD = F.embedding(self.tokens_R, self.embed_VD)
        h_RD = _rms(x_RD, *self.first_norm)
        cos_R1D = self.cos_SD[self.position_R][:, None].to(x_RD.dtype)
        sin_R1D = self.sin_SD[self.position_R][:, None].to(x_RD.dtype)
        triton_kernel = self.attend is None  # reads slots [start_R, slot_1] itself: no mask
        if not triton_kernel:
            # One mask for every layer; SDPA's memory-efficient kernel wants it in q's dtype with every dimension
            # (expand is a view).
            valid_RS = self.prompt_valid_RS[:, :span] | (self.decode_region_S[:span]
                                                         & (self.slots_S[:span] <= self.slot_1))
            bias_RKGS = torch.zeros(valid_RS.shape, dtype=self.dtype, device=self.device).masked_fill_(
                ~valid_RS, float("-inf"))[:, None, None].expand(rows, kv_heads, heads // kv_heads, span)
        for layer in self.layers:
            q_RHD, k_RKD, v_RKD = attn_in(h_RD, *layer.attn_in, cos_R1D, sin_R1D, heads, kv_heads,
                                          layer.keys.shape[-1])
            # Grouped-query attention without repeating the cache: query head h uses kv head h // (heads / kv_heads).
            # (The cast is a no-op on fused weights; under autocast q/k-norm and RoPE return float32.)
            q_RKGD = q_RHD.to(self.dtype).reshape(rows, kv_heads, heads // kv_heads, -1)
            if triton_kernel:  # the kernel also writes k and v into the cache at slot_1
                attn_RKGD = triton_attention.decode_attention(q_RKGD, layer.keys, layer.values, self.start_R,
                                                              self.slot_1, self.scaling, k_RKD, v_RKD)
            else:
                layer.keys.index_copy_(2, self.slot_1, k_RKD[:, :, None].to(layer.keys.dtype))
                layer.values.index_copy_(2, self.slot_1, v_RKD[:, :, None].to(layer.values.dtype))
                attn_RKGD = self.attend(q_RKGD, layer.keys[:, :, :span], layer.values[:, :, :span], bias_RKGS,
                                        self.scaling)
            # SDPA's memory-efficient kernel (and the Triton kernel) writes [R, G, Hkv, Dh] and returns a transposed
            # view: flattened in that order it needs no copy (fused o-proj columns are permuted to match); the
            # module's own o-proj needs (Hkv, G) order.
            if self.fused:
                attn_RE = attn_RKGD.transpose(1, 2).reshape(rows, -1)
            else:
                attn_RE = attn_RKGD.reshape(rows, -1)
            x_RD, h_RD = attn_out(x_RD, attn_RE, *layer.attn_out)
        logits_RV = F.linear(h_RD, self.head_w, self.head_b)
        self._sample_and_record(logits_RV, self.col_1, sample)
        self.position_R.add_(1)
        self.slot_1.add_(1)
        self.col_1.add_(1)

    # ------------------------------------------------------------------ the loop

    def _span(self, t: int) -> int:
        """Slots step t (feeding the token of column t - 1) attends over, rounded up to the bucket (the whole cache for
        the Triton kernel, which reads the step's length on the device: one graph for the chunk)."""
        if self.attend is None:
            return self.capacity
        needed = self.width + t
        bucket = self.engine.kv_bucket
        return min(self.capacity, -(-needed // bucket) * bucket)

    def _capture(self, spans: list[int], fns) -> dict[int, Any]:
        """One CUDA graph of the decode step per span. Warm-up runs change the state, so it is saved and restored."""
        state = [self.position_R, self.slot_1, self.col_1, self.tokens_R, self.finished_R, self.lengths_R]
        saved = [s.clone() for s in state]
        graphs, pool = {}, torch.cuda.graph_pool_handle()
        try:
            for span in spans:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):  # compiled functions compile on their first call, outside the capture
                        self._decode_step(span, fns)
                        for s, v in zip(state, saved):
                            s.copy_(v)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._decode_step(span, fns)
                graphs[span] = graph
        finally:
            for s, v in zip(state, saved):
                s.copy_(v)
        return graphs

    def run(self) -> tuple[list[list[int]], list[list[float]], list[str]]:
        engine = self.engine
        on_cuda = self.device.type == "cuda"
        fns = engine._step_fns(on_cuda)
        use_graphs = on_cuda and engine.cuda_graphs is not False and self.steps > 1
        # Fused weights are already in the compute dtype: decode without autocast. Otherwise under the caller's
        # autocast, with its weight cache off while capturing (cached casts would be freed after the capture); warm-up
        # runs and captures share this state so that compiled functions are not recompiled during a capture.
        amp = torch.autocast(self.device.type, dtype=torch.get_autocast_dtype(self.device.type),
                             enabled=self.autocast and not self.fused, cache_enabled=not use_graphs)
        with amp:
            return self._decode_all(fns, use_graphs)

    def _decode_all(self, fns, use_graphs: bool) -> tuple[list[list[int]], list[list[float]], list[str]]:
        """Token 0 from the prefill logits, then one decode step (or graph replay) per token; the chunk's results."""
        params, engine = self.params, self.engine
        if self.noise_RN is not None:
            self.noise_RN.uniform_(generator=self.generator)
        self._sample_and_record(self.logits_RV, torch.zeros(1, dtype=torch.long, device=self.device), fns[2])
        del self.logits_RV
        spans = sorted({self._span(t) for t in range(1, self.steps)})
        graphs = {}
        if use_graphs:
            try:
                graphs = self._capture(spans, fns)
            except Exception as error:  # compile=None: a failing torch.compile falls back to the plain step
                if engine.compile is not None or fns[0] is _attn_in:
                    raise
                warnings.warn(f"StaticGenerator: torch.compile of the decode step failed ({type(error).__name__}: "
                              f"{error}); decoding without it", RuntimeWarning, stacklevel=3)
                engine._compiled = fns = (_attn_in, _attn_out, _sample)
                graphs = self._capture(spans, fns)
        for t in range(1, self.steps):
            if params.stop_at_eos and t % engine.sync_interval == 0 and bool(self.finished_R.all()):  # host sync
                break
            if self.noise_RN is not None:
                self.noise_RN.uniform_(generator=self.generator)
            span = self._span(t)
            if use_graphs:
                graphs[span].replay()
            else:
                self._decode_step(span, fns)
        lengths, finished = self.lengths_R.tolist(), self.finished_R.tolist()
        ids_rows = self.out_ids_RT.tolist()
        lps_rows = self.out_lps_RT.tolist() if params.return_logprobs else [[] for _ in range(self.rows)]
        responses = [row[:n] for row, n in zip(ids_rows, lengths)]
        logprobs = [row[:n] for row, n in zip(lps_rows, lengths)]
        reasons = ["stop" if done else "length" for done in finished]
        return responses, logprobs, reasons


def _cached_kv(cache: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [P, Hkv, W, Dh] of one layer of a transformers `DynamicCache` (5.x layers or 4.x lists)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]
