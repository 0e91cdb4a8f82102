"""Compiled layers never recompile after the warm-up (`opd.train.step.warm_up`), and the warm-up changes nothing.

The layers compile with `aot_eager` here (dynamo's graph capture and guards, no code generation: the recompiles are
the same as inductor's, seconds cheaper on CPU). The padded SDPA path is the one a CPU runs; the packed one is the
GPU's (`benchmarks/check_cuda.py` counts its graphs there)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import compile_decode_on_cpu, distill_config, string_console
from opd.io import read_jsonl
from opd.models import compile_layers
from opd.recipes.distill import setup, train
from opd.rollout import SamplingParams, memory
from opd.rollout.static_engine import StaticGenerator
from opd.train.optim import adamw_state_bytes
from opd.train.step import CompileLog, Trainer, compiled_graphs, decode_warm_up_rows, describe_compiles, warm_up

# Prompts of many lengths and a micro-batch budget that splits the batch unevenly: the steps meet rows of one, of
# equal and of different lengths, with and without grad.
ROWS = [{"prompt": "1+" * (1 + i % 7) + "=", "answer": str(i)} for i in range(12)]


def _trainer(world, tmp_path, *overrides, compiled=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = distill_config(
        world,
        tmp_path,
        f"data.path={prompts}",
        "prompts_per_step=3",
        "rollout.n=3",
        "rollout.max_new_tokens=12",
        "data.max_prompt_length=40",
        "micro_batch_tokens=110",
        *overrides,
        steps=4,
    )
    tr = setup(cfg, tmp_path / "run", console=string_console())
    if compiled:
        compile_layers(tr.models.student, True, backend="aot_eager")
        for routed in tr.models.teachers:
            if routed.teacher.module is not None:
                compile_layers(routed.teacher.module, True, backend="aot_eager")
    tr.models.compiled_layers = True
    return tr


# (prompt index, response length) per row: batches of layouts in an order where each brings one the earlier ones
# did not (ragged rows of two prompts, then one row, rows of equal length, more rows, near-equal rows).
LAYOUTS = (
    ((0, 5), (6, 11)),
    ((3, 7),),
    ((2, 9), (2, 9)),
    ((1, 2), (5, 12), (4, 1), (0, 8)),
    ((6, 10), (6, 11), (6, 12)),
)


def _steps_on(tr, layouts):
    """The scoring, targets and update phases (optimizer step included) on batches of the given layouts."""
    from opd.rollout.base import GenerationOutput
    from opd.rollout.batch import build_rollouts
    from opd.train.step import Batch, score_rollouts, step_targets, update_student

    cpu, graphs = torch.device("cpu"), []
    for rows in layouts:
        responses = [[7 + (i * 13 + t) % 200 for t in range(n)] for i, (_, n) in enumerate(rows)]
        output = GenerationOutput(responses, ["length"] * len(rows), list(range(len(rows))))
        prompt_ids = [tr.data.prompt_ids[index] for index, _ in rows]
        rollouts = build_rollouts(prompt_ids, output, pad_id=tr.models.tokenizer.pad_token_id)
        batch = Batch([index for index, _ in rows], rollouts, policy_lag=0)
        scores = score_rollouts(tr, batch, {}, cpu)
        update_student(tr, rollouts, step_targets(tr, batch, scores, cpu), {}, cpu)
        graphs.append(compiled_graphs())
    return graphs


def test_no_layout_compiles_after_the_warm_up(world, tmp_path):
    torch._dynamo.reset()
    tr = _trainer(world, tmp_path)
    assert warm_up(tr, torch.device("cpu")) > 0  # the layers did compile: the count below is not vacuous
    after_warm_up = compiled_graphs()
    assert _steps_on(tr, LAYOUTS) == [after_warm_up] * len(LAYOUTS)


def test_no_layout_compiles_after_the_warm_up_where_the_model_packs(world, tmp_path):
    """The GPU's layouts (opd_varlen: ragged rows packed, near-equal ones padded under a mask) with responses shorter
    than the warm-up's near-equal rows (20, 21, 22): its rows must still differ in length, or a masked batch of
    near-equal rows compiles at the first step."""
    torch._dynamo.reset()
    tr = _trainer(world, tmp_path, "student.attn_implementation=opd_varlen", "teacher.attn_implementation=opd_varlen")
    assert warm_up(tr, torch.device("cpu")) > 0
    after_warm_up = compiled_graphs()
    assert _steps_on(tr, LAYOUTS) == [after_warm_up] * len(LAYOUTS)


def test_layouts_compile_without_the_warm_up(world, tmp_path):
    """The test above can fail: without the warm-up, batches after the first compile graphs of their own."""
    torch._dynamo.reset()
    tr = _trainer(world, tmp_path)
    graphs = _steps_on(tr, LAYOUTS)
    assert graphs[0] > 0 and graphs[-1] > graphs[0], graphs


def test_a_compiled_run_compiles_only_in_its_warm_up(world, tmp_path):
    torch._dynamo.reset()
    tr = _trainer(world, tmp_path)
    console = string_console()
    train(tr, console=console)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    graphs = [row["compile/graphs"] for row in rows]
    assert len(graphs) == 4 and graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs
    assert [row["compile/step_graphs"] for row in rows] == [0] * 4
    assert "compiled" in console.file.getvalue()  # the warm-up's line
    assert " ".join(console.file.getvalue().split()).count("step 1 compiled") == 0


def test_a_step_that_compiles_says_what_and_why(world, tmp_path, monkeypatch):
    """Without the warm-up the steps compile, and the run prints, after each step that did, how many graphs and which
    functions compiled again with the guard that failed (what a warm-up left out, named)."""
    torch._dynamo.reset()
    monkeypatch.setattr("opd.recipes.distill.warm_up", lambda tr, device, decode_rows=None: 0)
    tr = _trainer(world, tmp_path)
    console = string_console()
    train(tr, console=console)
    text = " ".join(console.file.getvalue().split())  # rich wraps at the console's width
    assert "step 1 compiled " in text and "; recompiled: " in text and "(modeling_" in text, text[-3000:]
    step_graphs = [row["compile/step_graphs"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert step_graphs[0] > 0 and f"step 1 compiled {step_graphs[0]} graph" in text, (step_graphs, text[-3000:])


def test_the_compile_log_names_the_function_and_the_guard():
    def scaled_sum(x, scale):
        return (x * scale).sum(-1)

    compiled = torch.compile(scaled_sum, dynamic=False, backend="aot_eager")
    log = CompileLog()
    assert describe_compiles(*log.take()) is None
    compiled(torch.ones(4, 3), 1.0)
    assert describe_compiles(*log.take()) == "1 graph"  # a first compile: no guard failed
    compiled(torch.ones(4, 3), 1.0)
    assert describe_compiles(*log.take()) is None
    compiled(torch.ones(8, 3), 1.0)
    news = describe_compiles(*log.take())
    assert news is not None and news.startswith("1 graph; recompiled: scaled_sum (test_step.py:"), news
    assert "size mismatch at index 0. expected 4, actual 8" in news
    compiled(torch.ones(8, 3), 2.0)
    assert "scale == 1.0" in (describe_compiles(*log.take()) or "")


def _static_engine_trainer(world, tmp_path, monkeypatch, partial: bool) -> tuple[Trainer, StaticGenerator]:
    """A trainer on the static engine, its decode step compiled on the CPU as on CUDA (`compile_decode_on_cpu`),
    dynamo's caches emptied; with rollout.partial when `partial`."""
    compile_decode_on_cpu(monkeypatch)
    torch._dynamo.reset()
    extra = ("rollout.partial=true", "objective.tis_cap=2.0") if partial else ()
    tr = _trainer(world, tmp_path, "rollout.engine=static", *extra)
    assert isinstance(tr.engines.generator, StaticGenerator)
    return tr, tr.engines.generator


@pytest.mark.parametrize("partial", [False, True])
def test_the_static_engines_decode_step_compiles_only_in_the_warm_up(world, tmp_path, monkeypatch, partial):
    """The rollout engine's compiled decode step (CUDA's, here on the CPU through dynamo with aot_eager) is warmed up
    at every row count the run's calls can meet (`decode_warm_up_rows`): with rollout.partial any count up to the
    samples in flight, whose calls vary. No step compiles after the warm-up."""
    tr, _ = _static_engine_trainer(world, tmp_path, monkeypatch, partial)
    # 3 prompts × 3: 9 samples a call, 16 rows; partial: up to 18 in flight (two batches), 32 rows
    assert decode_warm_up_rows(tr) == ([32, 16, 8, 4, 2, 1] if partial else [16, 8, 4])
    console = string_console()
    after, graphs = _graphs_after_warm_up_and_per_step(tr, tmp_path, console)
    assert graphs == [after] * 4, (after, graphs)
    assert "the rollout engine's decode step at" in " ".join(console.file.getvalue().split())


@pytest.mark.parametrize("partial", [False, True])
def test_a_decode_step_capped_by_memory_compiles_only_in_the_warm_up(world, tmp_path, monkeypatch, partial):
    """A device whose free memory caps the calls below the rows their samples ask for once AdamW's first step has
    allocated its moments (after the warm-up): the warm-up compiles the decode step at the capped counts too
    (`StaticGenerator.capped_rows` with the moments reserved), so no step compiles after it. Without the reserve it
    would predict from the memory before the moments exist, and step 1 would compile (the test can fail). The figure
    also loses the gradients' bytes while they exist: the warm-up's update pass leaves them, no step's rollout has
    them, and sized with them the warm-up missed the steps' count (9 graphs in step 1)."""
    tr, engine = _static_engine_trainer(world, tmp_path, monkeypatch, partial)
    engine.fuse_weights = False  # the figure below does not see the weight copies a call builds
    lengths, new = [len(ids) for ids in tr.data.prompt_ids], tr.config.rollout.max_new_tokens
    cost = engine.row_cost(max(lengths), new)
    moments, total = adamw_state_bytes(tr.models.student.parameters()), 80 * 2**30
    assert moments > 6 * cost.row_bytes  # without the reserve the prediction would start at 16 rows or more
    room = memory.margin_bytes(total) + cost.fixed_bytes + 11 * cost.row_bytes + cost.row_bytes // 2

    def free(device):  # a device's figure: what the optimizer and the gradients hold is not free
        held = sum(t.numel() * t.element_size() for s in tr.optimization.optimizer.state.values() for t in s.values())
        held += sum(
            p.grad.numel() * p.grad.element_size() for p in tr.models.student.parameters() if p.grad is not None
        )
        return room + moments - held, total

    engine.free_memory = free
    rows = decode_warm_up_rows(tr)
    assert 11 in rows and (32 if partial else 16) in rows, rows
    after, graphs = _graphs_after_warm_up_and_per_step(tr, tmp_path)
    assert graphs == [after] * 4, (after, graphs)
    assert engine.stats["rows"] <= 12  # the calls ran capped


@pytest.mark.parametrize("partial", [False, True])
def test_a_decode_step_capped_by_a_token_budget_compiles_only_in_the_warm_up(world, tmp_path, monkeypatch, partial):
    """A binding rollout.max_batch_tokens caps the calls below the rows their samples ask for, each width of call to
    its own count: the warm-up compiles those counts too (`StaticGenerator.capped_rows`), so no step compiles after
    it (before, only the memory's caps were predicted and step 1 compiled)."""
    tr, engine = _static_engine_trainer(world, tmp_path, monkeypatch, partial)
    lengths, new = [len(ids) for ids in tr.data.prompt_ids], tr.config.rollout.max_new_tokens
    engine.max_batch_tokens = 6 * (max(lengths) + new)  # 6 rows of the widest call, more of narrower ones
    rows = decode_warm_up_rows(tr)
    assert 6 in rows, rows
    after, graphs = _graphs_after_warm_up_and_per_step(tr, tmp_path)
    assert graphs == [after] * 4, (after, graphs)
    assert engine.stats["rows"] < (32 if partial else 16)  # the calls ran capped


def test_an_episodes_later_turns_meet_only_the_warmed_up_row_counts(world, tmp_path, monkeypatch):
    """rollout.tools: a step's episodes run in one session of the engine, and a later turn continues only the
    episodes that called a tool, any count from 1 to the step's samples. Every such call runs (its live-row buckets
    included) at row counts of `decode_warm_up_rows` for the run, so none compiles after the warm-up. Before, a turn
    of 1 or 2 episodes ran on 1 or 2 rows, which the warm-up never compiled (an H100's step 1 recompiled the decode
    step)."""
    compile_decode_on_cpu(monkeypatch)
    torch._dynamo.reset()
    tr = _trainer(world, tmp_path, "rollout.engine=static", "rollout.tools=calculator", "rollout.max_new_tokens=4")
    engine = tr.engines.generator
    assert isinstance(engine, StaticGenerator) and engine.row_buckets and engine.round_rows is None
    warm = set(decode_warm_up_rows(tr))
    samples = tr.config.prompts_per_step * tr.config.rollout.n
    assert warm == {16, 8, 4}, warm  # 9 samples: 16 rows and its buckets
    prompts = [tr.data.prompt_ids[i % len(tr.data.prompt_ids)] for i in range(samples)]
    params = SamplingParams(n=1, max_new_tokens=4, seed=3)
    engine.warm_up_decode(prompts[0], params, sorted(warm, reverse=True))
    before = compiled_graphs()
    session = engine.session()
    engine.generate(prompts, params, session=session, keys=list(range(samples)))  # the first turn
    met = {}
    for k in range(1, samples + 1):
        engine.generate(prompts[:k], params, session=session, keys=list(range(k)))
        met[k] = {engine.stats["rows"], *engine.stats["bucket_steps"]}
    session.close()
    assert all(rows <= warm for rows in met.values()), {k: rows - warm for k, rows in met.items() if rows - warm}
    assert compiled_graphs() == before  # nothing compiled after the warm-up


# the GPU's layout (opd_varlen) with the static engine's prefills through the compiled layers
COMPILED_PREFILL = (
    "student.attn_implementation=opd_varlen",
    "teacher.attn_implementation=opd_varlen",
    "rollout.engine=static",
    "compile=true",
    "rollout.compiled_prefill=true",
)


def _graphs_after_warm_up_and_per_step(tr, tmp_path, console=None) -> tuple[int, list[int]]:
    warm_up(tr, torch.device("cpu"))  # `train` warms up again: nothing left to compile
    after = compiled_graphs()
    train(tr, console=console or string_console())
    return after, [row["compile/graphs"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")]


@pytest.mark.parametrize("partial", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_compiled_prefills_compile_only_in_the_warm_up(world, tmp_path, partial):
    """rollout.compiled_prefill: the static engine's prefills run the compiled layers, and the warm-up builds their
    graphs too, so a run's prefills (with rollout.partial also its continued samples', prompt plus tokens so far)
    compile nothing after it."""
    torch._dynamo.reset()
    extra = ("rollout.partial=true", "objective.tis_cap=2.0") if partial else ()
    tr = _trainer(world, tmp_path, *COMPILED_PREFILL, *extra)
    assert isinstance(tr.engines.generator, StaticGenerator) and tr.engines.generator.compiled_prefill
    after, graphs = _graphs_after_warm_up_and_per_step(tr, tmp_path)
    assert graphs == [after] * 4, (after, graphs)


@pytest.mark.slow
def test_compiled_prefills_compile_in_the_steps_without_their_warm_up(world, tmp_path, monkeypatch):
    """The test above can fail: with the prefills left out of the warm-up, the first step compiles their graphs."""
    torch._dynamo.reset()
    monkeypatch.setattr(StaticGenerator, "warm_up_prefill", lambda self, prompt_ids: 0)
    tr = _trainer(world, tmp_path, *COMPILED_PREFILL)
    after, graphs = _graphs_after_warm_up_and_per_step(tr, tmp_path)
    assert graphs[0] > after, (after, graphs)


@pytest.mark.parametrize(
    "overrides, why",
    [
        ((), "the rollout engine is 'torch' (rollout.engine=auto)"),
        (("rollout.engine=static",), "the student's layers are not compiled (compile=None, device cpu)"),
        (("rollout.engine=static", "compile=true"), "the student's attention is 'sdpa'"),
    ],
)
def test_compiled_prefill_is_refused_where_it_cannot_act(world, tmp_path, overrides, why):
    """One line naming the setting and what is missing, before any step: a compiled prefill needs the static
    engine, compiled layers and packed (opd_varlen) attention."""
    cfg = distill_config(world, tmp_path, "rollout.compiled_prefill=true", *overrides)
    with pytest.raises(ValueError) as error:
        setup(cfg, tmp_path / "run", console=string_console())
    assert str(error.value) == (
        "rollout.compiled_prefill=true needs the static engine, compiled layers and opd_varlen attention (a GPU): "
        f"{why}; set rollout.compiled_prefill=false"
    )


def test_the_warm_up_changes_nothing(world, tmp_path):
    """A run that warms up ends with the same weights and metrics, bit for bit, as one that does not: gradients
    reset, no optimizer step, every random stream as before (eager layers: the same computation both ways)."""
    runs = {}
    for warmed in (True, False):
        tr = _trainer(world, tmp_path / str(warmed), "objective.kl_coef=0.1", compiled=False)
        tr.models.compiled_layers = warmed
        train(tr, console=string_console())
        metrics = [
            {k: v for k, v in m.items() if not k.startswith(("time/", "compile/")) and k != "tokens_per_second"}
            for m in read_jsonl(tmp_path / str(warmed) / "run" / "metrics.jsonl")
        ]
        runs[warmed] = (metrics, {k: v.clone() for k, v in tr.models.student.state_dict().items()})
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(runs[True][1][k], runs[False][1][k]) for k in runs[False][1])


@pytest.mark.parametrize("buckets", [True, False], ids=["warmed", "not-warmed"])
def test_the_heads_row_buckets_compile_only_in_the_warm_up(world, tmp_path, monkeypatch, buckets):
    """The vocabulary head's per-chunk functions (compiled on CUDA; here on the CPU with aot_eager) pad a call's
    positions to a power-of-two row bucket, so a step scoring more positions in one call than any warm-up batch
    meets a bucket of its own (an H100, 2026-12-06: 4 graphs in step 1 of a 16-sample run). The warm-up compiles
    every bucket the steps can reach (`warm_up_row_buckets`); without it the first step compiles (the test can fail)."""
    import opd.scoring as scoring

    torch._dynamo.reset()
    for name, value in (
        ("_COMPILE_DEVICES", ("cuda", "cpu")),
        ("_COMPILED", {}),
        ("_MET", {}),
        ("_BACKEND", "aot_eager"),
    ):
        monkeypatch.setattr(scoring, name, value)
    if not buckets:
        monkeypatch.setattr("opd.train.step.warm_up_row_buckets", lambda max_rows: 0)
    overrides = ("prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=48", "micro_batch_tokens=16384")
    tr = _trainer(world, tmp_path, *overrides, compiled=False)
    train(tr, console=string_console())
    step_graphs = [row["compile/step_graphs"] for row in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(step_graphs) == 4 and scoring._MET
    assert (step_graphs == [0] * 4) if buckets else step_graphs[0] > 0, step_graphs
