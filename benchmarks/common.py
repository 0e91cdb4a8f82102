"""Shared pieces of the benchmarks: model shapes, timing, peak memory, bounds, the printed table and the JSON file.

Every benchmark runs our path and the alternative in one process on the same inputs, prints one table and writes one
JSON file (rewritten after every row, so a run cut short by a timeout keeps what it measured).

Shapes are Qwen3 configurations with random weights (built from `Qwen3Config`, never downloaded): "tiny" for CPU
tests, "qwen3-0.6b" / "qwen3-1.7b" / "qwen3-4b" for GPUs. Random weights give near-uniform next-token distributions,
so responses almost never end early: every sample runs to max_new_tokens, which is what a throughput benchmark wants.

Bounds (GPU only; the H200 numbers are datasheet / measured leads, override with --peak-tflops / --peak-tbps):
    decode (bandwidth):  every step reads all weights once → tokens/s ≤ rows · BW / weight bytes
    scoring (compute):   2 · params · tokens FLOPs forward        → tokens/s ≤ peak / (2 · params)
    update (compute):    6 · params · tokens FLOPs forward+backward → MFU = 6 · params · tokens/s / peak
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# vocab 151936 rows, of which the Qwen3 tokenizer uses 151669 (the rest are embedding padding)
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-1.7b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "qwen3-4b": dict(
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
}
# Other families at their released shapes (random weights; issue 23's per-family rows). "family" names the
# transformers classes (`FAMILY_CLASSES`); the rest is the config. Gemma 3 1B (5 sliding layers of 512 per global
# one, two RoPE bases), Mistral 7B v0.1 (a 4,096 window on every layer), Phi-3-mini-4k (fused qkv / gate-up, a
# 2,047 window, head size 96), and Qwen3-30B-A3B's layers (128 experts, 8 per token) cut to 12 of its 48 so that a
# row of every engine fits the device time of one run.
SHAPES.update(
    {
        "gemma3-1b": dict(
            family="gemma3",
            vocab_size=262144,
            hidden_size=1152,
            intermediate_size=6912,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            query_pre_attn_scalar=256,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
            },
            tie_word_embeddings=True,
        ),
        "mistral-7b": dict(
            family="mistral",
            vocab_size=32000,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            sliding_window=4096,
            tie_word_embeddings=False,
        ),
        "phi3-mini": dict(
            family="phi3",
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=96,
            sliding_window=2047,
            tie_word_embeddings=False,
        ),
        "qwen3-moe-30b-a3b-12l": dict(
            family="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=12,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            tie_word_embeddings=False,
        ),
    }
)
FAMILY_CLASSES = {
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}
TOKENIZER_SIZE = {"tiny": 500, "qwen3-0.6b": 151669, "qwen3-1.7b": 151669, "qwen3-4b": 151669}
TOKENIZER_SIZE.update({"gemma3-1b": 262144, "mistral-7b": 32000, "phi3-mini": 32011, "qwen3-moe-30b-a3b-12l": 151669})
EOS_ID = {"tiny": 2, "gemma3-1b": 1, "mistral-7b": 2, "phi3-mini": 32000}  # Qwen3's <|im_end|> elsewhere
PAD_ID = {"tiny": 1, "gemma3-1b": 0, "mistral-7b": 0, "phi3-mini": 32000}  # Qwen3's <|endoftext|> elsewhere

# (dense bf16 FLOP/s, memory bandwidth bytes/s) by device-name substring. H200: 790 TFLOP/s measured on random data
# in this workplace (KINDS.md); 4.8 TB/s datasheet (a device-to-device copy measured 4.3).
PEAKS = {"H200": (790e12, 4.8e12), "H100": (790e12, 3.35e12)}


def eos_id(shape: str) -> int:
    return EOS_ID.get(shape, 151645)


def pad_id(shape: str) -> int:
    return PAD_ID.get(shape, 151643)


def base_parser(description: str, default_shape: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--shape", default=default_shape, choices=sorted(SHAPES), help="model shape (random weights)")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cuda, cpu")
    parser.add_argument("--out", default=None, help="JSON output path; default runs/benchmarks/<name>-<shape>.json")
    parser.add_argument("--repeat", type=int, default=3, help="timed repetitions per row (median reported), ≥ 1")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs before timing, ≥ 0")
    parser.add_argument("--seed", type=int, default=0, help="seed of weights and inputs")
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the dense bf16 peak (TFLOP/s)")
    parser.add_argument("--peak-tbps", type=float, default=None, help="override the memory bandwidth (TB/s)")
    return parser


def add_rollout_arguments(parser: argparse.ArgumentParser, *, new_tokens: int, lengths: str, lengths_help: str) -> None:
    """The options of a rollout job that rollout.py and vllm_side_by_side.py share: a saved model, rows per call, the
    prompt's and the response's lengths (what --lengths takes is each benchmark's own: lengths_help)."""
    parser.add_argument("--model-path", default=None, help="a saved model directory instead of a random --shape")
    parser.add_argument("--batches", default="64,256", help="comma-separated rows per rollout call")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per row")
    parser.add_argument("--new-tokens", type=int, default=new_tokens, help="generated tokens per row (--lengths equal)")
    parser.add_argument("--lengths", default=lengths, help=lengths_help)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def peaks(device: torch.device, args: argparse.Namespace) -> tuple[float | None, float | None]:
    """(FLOP/s, bytes/s) of the device: command-line overrides, else the table above, else unknown (None)."""
    flops = bw = None
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, (f, b) in PEAKS.items():
            if key in name:
                flops, bw = f, b
    if args.peak_tflops:
        flops = args.peak_tflops * 1e12
    if args.peak_tbps:
        bw = args.peak_tbps * 1e12
    return flops, bw


def attention_name(name: str, device: torch.device) -> str:
    """A transformers attention name, "opd_varlen" (registered here), or "auto": what `opd.models.load_model` picks
    (opd_varlen on CUDA, else sdpa)."""
    from opd.kernels import varlen_attention

    varlen_attention.register()
    if name == "auto":
        return varlen_attention.ATTENTION if varlen_attention.kernel_available(device) else "sdpa"
    return name


def build_model(
    shape: str, *, dtype: torch.dtype, device: torch.device, seed: int = 0, attn_implementation: str = "sdpa"
) -> torch.nn.Module:
    """A random-weight causal LM of `shape` (Qwen3, or the family its entry names), initialised directly on `device`
    (fast on a GPU), in eval mode.

    attn_implementation: see `attention_name`."""
    import transformers

    attn_implementation = attention_name(attn_implementation, device)
    spec = dict(SHAPES[shape])
    config_class, model_class = FAMILY_CLASSES.get(spec.pop("family", None), ("Qwen3Config", "Qwen3ForCausalLM"))
    if config_class == "Qwen3Config":
        spec.update(rope_theta=1_000_000)
    config = getattr(transformers, config_class)(
        **spec,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        eos_token_id=eos_id(shape),
        pad_token_id=pad_id(shape),
        bos_token_id=None,
        attn_implementation=attn_implementation,
    )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        with torch.device(device):
            model = getattr(transformers, model_class)(config)
    model.generation_config.eos_token_id = eos_id(shape)
    model.generation_config.pad_token_id = pad_id(shape)
    return keep_rope_float32(model, lambda: model.to(dtype)).eval()


def keep_rope_float32(model: torch.nn.Module, cast: Callable[[], Any]):
    """Run `cast` (a `.to(dtype)` of the model, which casts buffers too) and put RoPE's float32 `inv_freq` back, as
    `from_pretrained(dtype=...)` and `opd.models.load_model` leave it. Rounded to bf16 (up to 0.4% off), the rotation
    angles drift linearly with the position: on CPU (4 layers, head size 128) that alone took the bf16 forward's
    mean |Δ log-prob| from a float32 forward from 5e-3 at positions < 128 to 4.9e-2 at 3072–4096, against a flat
    4.5e-3 with float32 frequencies (`docs/performance.md`). Returns cast's result."""
    rotary = model.get_decoder().rotary_emb
    # every `*inv_freq` buffer (Gemma 3 keeps one per layer type)
    saved = {name: b.float().clone() for name, b in rotary.named_buffers(recurse=False) if name.endswith("inv_freq")}
    out = cast()
    for name, inv_freq in saved.items():
        setattr(rotary, name, inv_freq.to(getattr(rotary, name).device))
    return out


def param_count(model: torch.nn.Module) -> int:
    """Parameters counted once (tied input/output embeddings once): the matmul parameters of a tied model. Of a
    mixture of experts, the parameters a token passes through: each expert block counts top_k / experts of itself."""
    total = sum(p.numel() for p in model.parameters())
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if experts:
        per_token = config.num_experts_per_tok / experts
        for module in model.modules():
            block = getattr(module, "experts", None)
            if isinstance(block, torch.nn.Module):
                total -= round(sum(p.numel() for p in block.parameters()) * (1 - per_token))
    return total


def param_bytes(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Bytes of the weights as the forward reads them (`dtype`, e.g. bf16 under autocast; None = as stored)."""
    return sum(p.numel() * (dtype.itemsize if dtype else p.element_size()) for p in model.parameters())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float:
    """Peak memory since `reset_memory`: CUDA allocated bytes; on CPU the process's peak RSS (never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 2**20 if sys.platform != "darwin" else kib / 2**30


def profiled(fn: Callable[[], Any], device: torch.device, *, row_limit: int = 10) -> dict[str, Any]:
    """fn() once under torch.profiler. Returns its result, the wall seconds, the seconds of kernel time (CUDA; None
    elsewhere) and a table of the ops or kernels that took the most time (device time on CUDA, CPU time elsewhere):
    kernel seconds far below the wall mean the host, not the GPU, sets the pace."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as trace:
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        wall = time.perf_counter() - start
    averages = trace.key_averages()
    kernel_s, table = None, None
    for key in ("self_device_time_total", "self_cuda_time_total") if cuda else ():
        try:
            table = averages.table(sort_by=key, row_limit=row_limit, max_name_column_width=70)
        except (AttributeError, KeyError, ValueError):
            continue
        # the kernels' own events (kineto gives them the device's type); an op's row repeats its kernels' time
        kernels = [e for e in averages if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", 0)]
        kernel_s = sum(getattr(event, key) for event in kernels) / 1e6
        break
    if table is None:
        table = averages.table(sort_by="self_cpu_time_total", row_limit=row_limit, max_name_column_width=70)
    return {"result": result, "wall_s": wall, "kernel_s": kernel_s, "table": table}


def measure(
    fn: Callable[[], Any], device: torch.device, *, warmup: int, repeat: int, warmup_fn: Callable[[], Any] | None = None
) -> dict[str, Any]:
    """Run `warmup_fn` (default fn; e.g. a shorter generation) `warmup` times untimed, then fn `repeat` times timed
    (synchronising the device around each).
    Returns seconds (median, all), first-call seconds (includes compilation / capture), peak memory (GiB, during the
    timed runs and warm-up) and the last result."""
    reset_memory(device)
    first = None
    result = None
    for i in range(warmup):
        sync(device)
        start = time.perf_counter()
        result = (warmup_fn or fn)()
        sync(device)
        if i == 0:
            first = time.perf_counter() - start
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        result = fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return {
        "seconds": statistics.median(times),
        "all_seconds": times,
        "first_call_seconds": first,
        "peak_gib": peak_gib(device),
        "result": result,
    }


class Report:
    """Rows of one benchmark, printed as a table and written as JSON (after every row)."""

    def __init__(self, name: str, args: argparse.Namespace, device: torch.device, **meta: Any):
        import transformers

        self.name, self.device = name, device
        out = args.out or Path("runs") / "benchmarks" / f"{name}-{args.shape}.json"
        self.path = Path(out)
        self.data: dict[str, Any] = {
            "benchmark": name,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]) if sys.argv else name,
            "argv": vars(args),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            **meta,
            "rows": [],
        }

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        self.data["rows"].append(row)
        self.write()
        status = row.get("error") or (f"{row['tokens_per_s']:,.0f} tok/s" if "tokens_per_s" in row else "done")
        print(f"[{self.name}] {row['name']}: {status}", flush=True)
        return row

    def run_row(self, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Call fn (which returns the row's fields); an exception becomes the row's `error` (others still run)."""
        try:
            row = {"name": name, **fn()}
        except Exception as error:  # OOM, a compile failure: record it and carry on with the other rows
            traceback.print_exc()
            row = {"name": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        reset_memory(self.device)
        return self.add(row)

    def write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=2, default=str))
        os.replace(tmp, self.path)

    def table(self, columns: list[tuple[str, str, str]]) -> str:
        """Markdown table of the rows (see `markdown_table`)."""
        return markdown_table(self.data["rows"], columns)

    def finish(self, columns: list[tuple[str, str, str]], notes: list[str] = ()) -> dict[str, Any]:
        text = self.table(columns)
        self.data["table"] = text
        self.data["notes"] = list(notes)
        self.write()
        header = (
            f"\n## {self.name}  ({self.data['device']}, torch {self.data['torch']}, transformers "
            f"{self.data['transformers']}, {self.data['date']})"
        )
        print(header, text, *notes, f"JSON: {self.path}", sep="\n", flush=True)
        return self.data


def markdown_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Markdown table: columns are (header, row key, format spec); missing values print as '—'."""
    lines = ["| " + " | ".join(h for h, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = []
        for _, key, spec in columns:
            value = row.get(key)
            if key == "name" and row.get("error"):
                cells.append(f"{value} (failed: {row['error'][:80]})")
            elif value is None:
                cells.append("—")
            else:
                cells.append(format(value, spec) if spec else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def speedups(rows: list[dict], baseline: str) -> None:
    """Add `speedup` (tokens/s over the baseline row's) to every row that has tokens/s."""
    base = next((r.get("tokens_per_s") for r in rows if r["name"] == baseline), None)
    for row in rows:
        if base and row.get("tokens_per_s"):
            row["speedup"] = row["tokens_per_s"] / base


def random_rollouts(
    batch: int,
    prompt_len: int,
    response_len: int,
    vocab: int,
    device: torch.device,
    seed: int,
    pad: int,
    ragged: bool = False,
):
    """A `Rollouts` batch of random ids: every row prompt_len prompt + response_len response tokens, all real; with
    `ragged`, row b's response has a length drawn uniformly from [response_len / 4, response_len] (seeded) and is
    right-padded, as rollouts that stop at EOS are."""
    from opd.types import Rollouts

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, prompt_len + response_len), generator=g)
    lengths = (
        torch.randint(max(1, response_len // 4), response_len + 1, (batch,), generator=g)
        if ragged
        else torch.full((batch,), response_len)
    )
    response_mask = torch.arange(response_len)[None] < lengths[:, None]
    attention_mask = torch.cat([torch.ones(batch, prompt_len, dtype=torch.bool), response_mask], dim=1)
    ids = ids.masked_fill(~attention_mask, pad)
    return Rollouts(
        input_ids=ids,
        attention_mask=attention_mask,
        prompt_lengths=torch.full((batch,), prompt_len, dtype=torch.long),
        response_ids=ids[:, prompt_len:].clone(),
        response_mask=response_mask,
        group_ids=torch.arange(batch),
        truncated=lengths == response_len,
    ).to(device)


# ------------------------------------------------------------------------------------------ ragged lengths, bounds


class LengthDist:
    """Response lengths drawn per row (`parse_lengths`): `sample(count, seed)` → a list of ints in [1, cap]."""

    def __init__(self, kind: str, cap: int, mean: float | None = None, sigma: float = 1.0):
        self.kind, self.cap, self.mean, self.sigma = kind, cap, mean, sigma

    def sample(self, count: int, seed: int) -> list[int]:
        if self.kind == "fixed":
            return [self.cap] * count
        import math

        g = torch.Generator().manual_seed(seed)
        mu = math.log(self.mean) - self.sigma**2 / 2  # the uncapped lognormal's mean is `mean`
        x = torch.exp(mu + self.sigma * torch.randn(count, generator=g, dtype=torch.float64))
        return x.round().clamp(1, self.cap).long().tolist()

    def __repr__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.cap}"
        return f"lognormal:mean={self.mean:g},cap={self.cap},sigma={self.sigma:g}"


def forced_stop_rule(stop_when, stops_here):
    """The stream's stop rule (`opd.rollout.base.StopRule`) as an engine under forced lengths must ask it: a row the
    engine ends at its forced length with "length", which the benchmark then reports as "stop" (standing in for the
    EOS), is "stop" to the rule too. `stops_here[i]`: whether row i's limit in this call is where it stops."""
    if stop_when is None:
        return None
    return lambda finished: stop_when(
        ["stop" if r == "length" and stops_here[i] else r for i, r in enumerate(finished)]
    )


def parse_lengths(spec: str) -> LengthDist:
    """`lognormal:mean=1500,cap=7168[,sigma=1.0]` (lognormal with that mean before capping, σ of its log; rounded,
    clamped to [1, cap]) or `fixed:N` (every row N tokens). Bad specs raise ValueError naming the accepted forms."""
    accepted = "lognormal:mean=M,cap=C[,sigma=S] or fixed:N"
    kind, _, rest = spec.partition(":")
    try:
        if kind == "fixed":
            cap = int(rest)
            if cap >= 1:
                return LengthDist("fixed", cap)
        elif kind == "lognormal":
            fields = dict(part.split("=", 1) for part in rest.split(",") if part)
            unknown = set(fields) - {"mean", "cap", "sigma"}
            mean, cap, sigma = float(fields["mean"]), int(fields["cap"]), float(fields.get("sigma", 1.0))
            if not unknown and mean >= 1 and cap >= 1 and sigma > 0:
                return LengthDist("lognormal", cap, mean, sigma)
    except (KeyError, ValueError):
        pass
    raise ValueError(f"--lengths {spec!r}: expected {accepted} (M ≥ 1, C ≥ 1, S > 0)")


def kv_bytes_per_token(shape: str, dtype_bytes: int = 2) -> int:
    """Keys + values of one token over all layers (the decode cache in bf16)."""
    c = SHAPES[shape]
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * dtype_bytes


def kv_token_reads(prompt_lengths: list[int], response_lengths: list[int]) -> int:
    """Cached tokens read to decode these rows: token t of a row reads its prompt's and its t earlier tokens' keys and
    values (multiply by the bytes per cached token)."""
    return sum(p * r + r * (r - 1) // 2 for p, r in zip(prompt_lengths, response_lengths))


def opd_step_bound(
    *,
    student_params: int,
    teacher_params: int,
    student_weight_bytes: int,
    kv_bytes_per_token: int,
    prompt_lengths: list[int],
    response_lengths: list[int],
    peak_flops: float,
    bandwidth: float,
) -> dict[str, float]:
    """Seconds an OPD step needs at least on a device of `peak_flops` (dense bf16) and `bandwidth` (bytes/s):
    - decode at the memory bandwidth: the longest response takes that many sequential steps, each reading every
      student weight once; token t of a row reads the keys/values of its prompt and its t earlier tokens;
    - teacher and student scoring at 2 · params FLOPs and the update at 6 · params FLOPs per scored position (prompt +
      response; attention FLOPs and the prefill are left out: a lower bound).
    Returns decode_s, teacher_s, student_s, update_s and total_s (their sum: the phases run one after another)."""
    steps = max(response_lengths, default=0)
    kv_reads = kv_token_reads(prompt_lengths, response_lengths)
    positions = sum(prompt_lengths) + sum(response_lengths)
    out = {
        "decode_s": (student_weight_bytes * steps + kv_bytes_per_token * kv_reads) / bandwidth,
        "teacher_s": 2 * teacher_params * positions / peak_flops,
        "student_s": 2 * student_params * positions / peak_flops,
        "update_s": 6 * student_params * positions / peak_flops,
    }
    out["total_s"] = sum(out.values())
    return out
