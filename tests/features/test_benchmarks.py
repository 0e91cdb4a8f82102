"""Every benchmark script runs on CPU with the tiny shape, in-process, and produces its table and JSON with both our
row and the alternative's (no timing assertions: CPU timings of tiny models say nothing). The rows that compare the
two paths' results (`max_err`, `loss_err`, `grad_err`, `lp_err`) must agree to float32 rounding."""

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import compile_decode_on_cpu

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str):
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(name: str, tmp_path, capsys, *args: str) -> tuple[dict, str]:
    out = tmp_path / f"{name}.json"
    data = load(name).main(["--shape", "tiny", "--device", "cpu", "--repeat", "1", "--out", str(out), *args])
    printed = capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(data, default=str))
    assert data["table"] in printed
    return data, printed


def run_compiling_decode(monkeypatch, name: str, tmp_path, capsys, *args: str) -> tuple[dict, str]:
    """`run` with the static engine's decode step compiled on the CPU as on CUDA (`compile_decode_on_cpu`) and
    dynamo's caches emptied first, so that the graphs a run's steps compile are all counted."""
    compile_decode_on_cpu(monkeypatch)
    torch._dynamo.reset()
    return run(name, tmp_path, capsys, *args)


def rows(data: dict) -> dict[str, dict]:
    by_name = {r["name"]: r for r in data["rows"]}
    for name, row in by_name.items():
        assert "error" not in row, (name, row.get("error"))
        assert row["tokens_per_s"] > 0 and row["peak_gib"] > 0
    return by_name


@pytest.mark.slow
def test_rollout(tmp_path, capsys):
    data, _ = run(
        "rollout",
        tmp_path,
        capsys,
        "--batches",
        "3,5",
        "--prompt-len",
        "5",
        "--new-tokens",
        "6",
        "--engines",
        "hf_generate,torch_engine,static_engine",
        "--engines-big",
        "static_engine",
    )
    got = rows(data)
    assert set(got) == {"hf_generate@3", "torch_engine@3", "static_engine@3", "static_engine@5"}
    assert got["hf_generate@3"]["tokens"] == got["static_engine@3"]["tokens"] == 3 * 6
    assert got["static_engine@3"]["speedup"] > 0 and got["static_engine@5"]["tokens"] == 5 * 6
    assert got["torch_engine@3"]["lp_err"] < 1e-4 and got["static_engine@3"]["lp_err"] < 1e-4


@pytest.mark.slow
def test_rollout_ragged_lengths_against_equal_lengths(tmp_path, capsys):
    """--lengths: every engine produces each row's drawn length exactly (generate() through its forced-EOS logits
    processor, ours through per-sample limits), and the [equal] row the same total at the mean length; the fp32
    drift table has one line per position bucket of each of our rows."""
    data, printed = run(
        "rollout",
        tmp_path,
        capsys,
        "--batches",
        "4",
        "--prompt-len",
        "5",
        "--lengths",
        "lognormal:mean=6,cap=14,sigma=0.8",
        "--engines",
        "hf_generate,static_engine",
        "--lp-reference",
        "fp32",
    )
    got = rows(data)
    assert set(got) == {f"{e}@4[{k}]" for e in ("hf_generate", "static_engine") for k in ("ragged", "equal")}
    lengths = load("rollout").draw_lengths("lognormal:mean=6,cap=14,sigma=0.8", 4, 512, 0)
    assert len(set(lengths)) > 1 and max(lengths) <= 14
    for engine in ("hf_generate", "static_engine"):
        ragged, equal = got[f"{engine}@4[ragged]"], got[f"{engine}@4[equal]"]
        assert ragged["tokens"] == sum(lengths) and ragged["max_len"] == max(lengths)
        assert equal["tokens"] == 4 * round(sum(lengths) / 4) and ragged["vs_equal"] > 0
    assert got["static_engine@4[ragged]"]["lp_err"] < 1e-4 and "engine vs fp32" in printed
    assert [b["positions"] for b in got["static_engine@4[ragged]"]["lp_drift"]] == ["[0, 128)"]


@pytest.mark.parametrize("early_stop", ["off", "on"])
def test_rollout_stream(tmp_path, capsys, early_stop):
    """The partial-rollout stream over the static engine with forced lognormal lengths: every trained sample has the
    length drawn when it started (also those continued over two segments or cut by an early stop), every started
    sample is trained or in flight, each step's trained tokens are its lag histogram; the [equal] row has the trained
    mean length; one bucket row per row count up to the slots."""
    spec = "lognormal:mean=6,cap=16,sigma=0.8"
    data, printed = run(
        "rollout_stream",
        tmp_path,
        capsys,
        *("--batches", "8", "--prompt-len", "5", "--lengths", spec, "--stream-steps", "4", "--bucket-steps", "32"),
        *("--early-stop", early_stop, "--sync-interval", "2"),
    )
    got = rows(data)
    stream, equal = got["stream[static_engine@8]"], got["static_engine@8[equal]"]
    assert (stream["cut_total"] > 0) == (early_stop == "on")
    assert stream["timed_steps"] == 2 and stream["segment"] == 8 and stream["vs_equal"] > 0
    assert stream["started_total"] == stream["trained_total"] + stream["dropped_total"] + stream["in_flight"]
    assert stream["dropped_total"] == 0  # segment × (S + 1) = cap: every sample ends before it is stale
    assert equal["tokens"] == 8 * round(stream["mean_len"])
    steps = data["steps"]
    assert [s["trained"] for s in steps] == [8] * 4 and all(s["calls"] >= 1 for s in steps)
    assert all(s["lag_0"] + s["lag_1"] == s["tokens"] == sum(s["lengths"]) for s in steps)
    drawn = load("rollout_stream").ForcedLengths(spec, 16, 0)
    first = sorted(drawn.draw() for _ in range(stream["started_total"]))
    trained = sorted(n for s in steps for n in s["lengths"])
    assert max(trained) > 8 and all(trained.count(n) <= first.count(n) for n in set(trained))
    sizes = [b["rows"] for b in data["buckets"]]
    # the powers of two below the slots, the slots, and every row count the stream's calls decoded at
    assert {1, 2, 4} <= set(sizes) and sizes[-1] == 8 and set(stream["bucket_steps"]) <= set(sizes)
    assert all(b["steps_timed"] == 32 for b in data["buckets"])
    assert data["steps_table"] in printed and data["bucket_table"] in printed


def test_rollout_stream_with_compiled_prefills(tmp_path, capsys):
    """--engine static_packed_compiled (rollout.compiled_prefill: packed prefills through the compiled layers, aot_eager
    on a CPU): the stream runs, and after the engine's prefill warm-up none of its steps compiles a graph, also those
    whose calls continue samples (a prompt plus its tokens so far); each step's JSON row holds the engine's rows."""
    data, _ = run(
        "rollout_stream",
        tmp_path,
        capsys,
        *("--batches", "8", "--prompt-len", "5", "--lengths", "lognormal:mean=6,cap=16,sigma=0.8"),
        *("--stream-steps", "3", "--bucket-steps", "0", "--sync-interval", "2", "--repeat", "1"),
        *("--engine", "static_packed_compiled", "--attention", "opd_varlen"),
    )
    stream = rows(data)["stream[static_packed_compiled@8]"]
    assert stream["trained_total"] == 3 * 8 and stream["vs_equal"] > 0
    assert [s["compiles"] for s in data["steps"]] == [0, 0, 0]
    assert any(s["calls"] > 1 or s["lag_1"] for s in data["steps"])  # samples continued across calls
    assert [s["rows"] for s in data["steps"]][-1] == stream["rows"]  # each step's JSON holds the rows so far


def test_rollout_stream_warms_up_the_decode_step(tmp_path, capsys, monkeypatch):
    """The stream's engine with its decode step compiled (CUDA's, here through dynamo with aot_eager): before step 0
    the benchmark compiles it at every row count the stream's calls can meet, as the trainer's warm-up does, so that
    no step compiles (without the warm-up the first steps do: the test can fail)."""
    data, printed = run_compiling_decode(
        monkeypatch,
        "rollout_stream",
        tmp_path,
        capsys,
        *("--batches", "8", "--prompt-len", "5", "--lengths", "lognormal:mean=6,cap=16,sigma=0.8"),
        *("--stream-steps", "3", "--bucket-steps", "0", "--sync-interval", "2", "--repeat", "1"),
        *("--engine", "static_packed_compiled", "--attention", "opd_varlen"),
    )
    stream = rows(data)["stream[static_packed_compiled@8]"]
    assert stream["decode_warm_up_rows"] == [8, 4, 2, 1] and "decode step warmed up at 4 row counts" in printed
    assert set(stream["bucket_steps"]) <= set(stream["decode_warm_up_rows"])
    assert [s["compiles"] for s in data["steps"]] == [0, 0, 0]


def test_rollout_stream_configs(tmp_path, capsys):
    """--configs: several streams in one process, one row each with its own staleness, early stop and segment, the
    per-step rows labelled by their stream, the [equal] row once; a malformed config is one line."""
    data, printed = run(
        "rollout_stream",
        tmp_path,
        capsys,
        *("--batches", "8", "--prompt-len", "5", "--lengths", "lognormal:mean=6,cap=16,sigma=0.8"),
        *("--stream-steps", "3", "--stream-warmup", "2", "--bucket-steps", "0", "--sync-interval", "2"),
        *("--configs", "1/off,2/on,2/on/4"),
    )
    got = rows(data)
    names = ["S1 early off", "S2 early on", "S2 early on segment 4"]
    streams = [got[f"stream[static_engine@8 {n}]"] for n in names]
    assert [(s["max_staleness"], s["early_stop"], s["segment"]) for s in streams] == [
        (1, "off", 8),
        (2, "on", 16),
        (2, "on", 4),
    ]
    assert streams[0]["cut_total"] == 0 < streams[1]["cut_total"] and all(s["vs_equal"] > 0 for s in streams)
    assert [s["config"] for s in data["steps"]] == [n for n in names for _ in range(3)]
    assert sum(1 for name in got if name.endswith("[equal]")) == 1
    with pytest.raises(SystemExit, match="--configs: '2/x' is not"):
        load("rollout_stream").main(["--device", "cpu", "--shape", "tiny", "--configs", "2/x"])


def test_rollout_stream_warm_up_covers_the_backlog_of_the_start():
    """Left out of the tokens/s by default: the first max_staleness + 1 steps (at least 2), per stream (step S is the
    first to train tokens S steps old, the start's backlog); a stream with no timed step left is refused."""
    import argparse

    stream_configs = load("rollout_stream").stream_configs
    args = dict(configs="", stream_warmup=None, stream_steps=6, max_staleness=1, early_stop="off", segment=None)
    assert [c.stream_warmup for c in stream_configs(argparse.Namespace(**args))] == [2]
    configs = stream_configs(argparse.Namespace(**{**args, "configs": "0/off,2/on,3/on/4"}))
    assert [c.stream_warmup for c in configs] == [2, 3, 4]
    assert [c.stream_warmup for c in stream_configs(argparse.Namespace(**{**args, "stream_warmup": 1}))] == [1]
    with pytest.raises(SystemExit, match="--stream-steps 6 ≤ the stream's warm-up 6: no step timed"):
        stream_configs(argparse.Namespace(**{**args, "configs": "5/on"}))


def test_prefill_packed_and_padded_place_the_same_prompts(tmp_path, capsys):
    """Every layout places every prompt; packed cuts its forwards by real tokens, padded by rows × the longest, so
    padded needs at least as many forwards; the compiled layers' packed prefill cuts them as the eager one."""
    data, printed = run(
        "prefill",
        tmp_path,
        capsys,
        "--samples",
        "6",
        "--prompt-lengths",
        "8:64",
        "--prefill-tokens",
        "128",
        "--compiled",
    )
    got = rows(data)
    assert set(got) == {"packed", "padded", "packed_compiled"} and "opd_varlen attention" in printed
    assert 1 <= got["packed"]["prefills"] <= got["padded"]["prefills"]
    assert got["packed_compiled"]["prefills"] == got["packed"]["prefills"]


def test_decode_attention_refuses_bad_lengths_before_the_device():
    """decode_attention.py times CUDA kernels only; its length arguments are checked first, each in one line."""
    main = load("decode_attention").main
    with pytest.raises(SystemExit, match=r"^--ragged 'lognormal:oops': expected lognormal"):
        main(["--lengths", "ragged", "--ragged", "lognormal:oops"])
    with pytest.raises(SystemExit, match=r"^--lengths '5,x': expected comma-separated integers or `ragged`"):
        main(["--lengths", "5,x"])


def test_teacher_score(tmp_path, capsys):
    data, _ = run("teacher_score", tmp_path, capsys, "--batch", "2", "--prompt-len", "4", "--response-len", "6")
    got = rows(data)
    assert set(got) == {"local_scorer[tiny]", "naive_full_logits[tiny]"}
    assert got["naive_full_logits[tiny]"]["max_err"] < 1e-4
    assert got["naive_full_logits[tiny]"]["topk_agree"] > 0.99


def test_teacher_score_ragged_rows_padded_and_packed(tmp_path, capsys):
    """Right-padded rows of different lengths: the padded sdpa row and the packed flex row (rows concatenated into one
    sequence) score the real positions as the naive path does, and tokens/s counts real tokens only."""
    data, printed = run(
        "teacher_score",
        tmp_path,
        capsys,
        "--batch",
        "3",
        "--prompt-len",
        "4",
        "--response-len",
        "12",
        "--ragged",
        "--attn",
        "sdpa,flex_attention",
    )
    got = rows(data)
    assert set(got) == {"local_scorer[tiny]", "local_scorer[tiny, flex_attention]", "naive_full_logits[tiny]"}
    assert got["naive_full_logits[tiny]"]["max_err"] < 1e-4  # against the packed row, the last of ours
    assert got["local_scorer[tiny]"]["tokens"] < 3 * (4 + 12) and "ragged" in printed


def test_update(tmp_path, capsys):
    data, _ = run(
        "update", tmp_path, capsys, "--batch", "2", "--prompt-len", "4", "--response-len", "6", "--ckpt", "on,off"
    )
    got = rows(data)
    assert set(got) == {f"{n}[ckpt {c}]" for n in ("chunked_candidates", "naive_full_logits") for c in ("on", "off")}
    for ckpt in ("on", "off"):
        naive = got[f"naive_full_logits[ckpt {ckpt}]"]
        assert naive["loss_err"] < 1e-5 and naive["grad_err"] < 1e-4


def test_update_ragged_rows(tmp_path, capsys):
    data, _ = run(
        "update",
        tmp_path,
        capsys,
        "--batch",
        "3",
        "--prompt-len",
        "4",
        "--response-len",
        "12",
        "--ragged",
        "--ckpt",
        "off",
    )
    got = rows(data)
    naive = got["naive_full_logits[ckpt off]"]
    assert naive["loss_err"] < 1e-5 and naive["grad_err"] < 1e-4
    assert got["chunked_candidates[ckpt off]"]["tokens"] < 3 * (4 + 12)


@pytest.mark.slow
def test_opd_step(tmp_path, capsys):
    data, _ = run(
        "opd_step",
        tmp_path,
        capsys,
        "--teacher-shape",
        "tiny",
        "--prompts",
        "2",
        "--n",
        "2",
        "--prompt-len",
        "5",
        "--new-tokens",
        "6",
        "--engines",
        "torch_engine,static_engine",
        "--skip-trl",
        "--variants",
        "default,bf16_state,overlap,partial,partial_overlap,partial_early_stop,partial_s2_early_stop",
    )
    got = rows(data)
    variants = ("", ", bf16_state", ", overlap", ", partial", ", partial_overlap", ", partial_early_stop")
    variants += (", partial_s2_early_stop",)
    assert set(got) == {f"opd_step[{e}{v}]" for e in ("torch_engine", "static_engine") for v in variants}
    for name, row in got.items():
        assert {"student_s", "teacher_s", "update_s"} <= set(row)
        assert ("rollout_wait_s" if "overlap" in name else "rollout_s") in row  # overlap: made during the last step
        if "partial" in name:  # other calls, other samples: here one sampled EOS at its 5th token
            assert 2 * 2 * 5 <= row["tokens"] <= 2 * 2 * 6, name
        else:
            assert row["tokens"] == 2 * 2 * 6, name  # random weights never stop early (EOS is 1 id of 500)
    assert got["opd_step[static_engine, overlap]"]["policy_lag"] == 1  # the timed step trains on rollouts made ahead
    assert got["opd_step[static_engine, partial_overlap]"]["policy_lag"] == 1
    assert "policy_lag" in got["opd_step[static_engine]"] and got["opd_step[static_engine]"]["policy_lag"] == 0


@pytest.mark.slow
def test_opd_step_real_trl_rows(tmp_path, capsys):
    """TRL 1.16's DistillationTrainer and GKDTrainer, defaults and fastest settings, one timed step each, counting
    the same generated tokens as our row."""
    pytest.importorskip("trl")
    data, printed = run(
        "opd_step",
        tmp_path,
        capsys,
        "--teacher-shape",
        "tiny",
        "--prompts",
        "2",
        "--n",
        "2",
        "--prompt-len",
        "5",
        "--new-tokens",
        "6",
        "--warmup",
        "0",
        "--trl-warmup",
        "0",
        "--trl-repeat",
        "1",
    )
    got = rows(data)
    trl = {f"trl_{t}[{s}]" for t in ("distill", "gkd") for s in ("defaults", "fastest")}
    assert set(got) == trl | {"opd_step[static_engine]"}
    for name in trl:
        assert got[name]["tokens"] == 2 * 2 * 6 and len(got[name]["step_seconds"]) == 1
        assert got[name]["gradient_checkpointing"] == name.endswith("[defaults]")  # TRL 1.16's default: on
    assert got["trl_gkd[defaults]"]["micro_batch"] == 4 and got["trl_gkd[fastest]"]["micro_batch"] == 4
    assert got["opd_step[static_engine]"]["speedup"] > 0 and "× fastest TRL: against trl_" in printed


@pytest.mark.slow
def test_opd_step_warm_up_lengths_reach_the_background_engine(tmp_path, capsys):
    """--warmup-lengths with rollout.overlap: the background engine makes the next step's batch, so both warm-up steps
    train short rows (3 tokens) and the timed one the timed lengths (8), made during the last warm-up step."""
    common = ("--shape", "tiny", "--teacher-shape", "tiny", "--prompts", "2", "--n", "2", "--new-tokens", "8")
    data, _ = run(
        "opd_step",
        tmp_path,
        capsys,
        *common,
        "--variants",
        "overlap",
        "--skip-trl",
        "--lengths",
        "fixed:8",
        "--warmup-lengths",
        "fixed:3",
        "--warmup",
        "2",
    )
    row = rows(data)["opd_step[static_engine, overlap]"]
    assert row["step_tokens"] == [4 * 3, 4 * 3, 4 * 8] and row["tokens"] == 4 * 8


def test_opd_step_paper_mode_forces_ragged_lengths(tmp_path, capsys):
    """`--paper` with tiny shapes: every row ends at its drawn length (EOS forced), chunks of --rollout-rows rows,
    and the step is set against the physical bound (peaks given explicitly: CPU has none)."""
    data, _ = run(
        "opd_step",
        tmp_path,
        capsys,
        "--paper",
        "--shape",
        "tiny",
        "--teacher-shape",
        "tiny",
        "--prompts",
        "3",
        "--n",
        "2",
        "--prompt-len",
        "5",
        "--new-tokens",
        "24",
        "--rollout-rows",
        "4",
        "--lengths",
        "lognormal:mean=8,cap=24,sigma=0.8",
        "--warmup",
        "0",
        "--peak-tflops",
        "1",
        "--peak-tbps",
        "0.01",
    )
    row = rows(data)["opd_step[static_engine]"]
    sys.path.insert(0, str(BENCHMARKS))
    from common import parse_lengths

    seed = None  # the step's rollout seed, as opd_step derives it for step 0
    from opd.train.step import _step_seed

    seed = _step_seed(0, 0)
    drawn = parse_lengths("lognormal:mean=8,cap=24,sigma=0.8").sample(6, seed)
    assert row["tokens"] == sum(drawn) and len(set(drawn)) > 1
    assert row["bound_total_s"] > 0 and row["vs_bound"] == pytest.approx(row["seconds"] / row["bound_total_s"])


def test_opd_step_warms_up_the_engines_decode_step(tmp_path, capsys, monkeypatch):
    """The step's engine with its decode step compiled (CUDA's, here through dynamo with aot_eager), behind the
    benchmark's length-forcing wrapper: the trainer's warm-up compiles it at the calls' row counts, so that neither
    the warm-up step nor the timed step compiles (the paper step on an H100 compiled it in both before: the test
    can fail)."""
    data, _ = run_compiling_decode(
        monkeypatch,
        "opd_step",
        tmp_path,
        capsys,
        *("--paper", "--shape", "tiny", "--teacher-shape", "tiny", "--prompts", "3", "--n", "2"),
        *("--prompt-len", "5", "--new-tokens", "12", "--rollout-rows", "4", "--compile", "on", "--attn", "opd_varlen"),
        *("--lengths", "lognormal:mean=6,cap=12,sigma=0.8", "--warmup-lengths", "lognormal:mean=3,cap=6,sigma=0.8"),
        *("--warmup", "1", "--repeat", "1", "--peak-tflops", "1", "--peak-tbps", "0.01"),
    )
    row = rows(data)["opd_step[static_engine]"]
    assert row["warm_up_graphs"] > 0
    assert (row["warm_step_graphs"], row["timed_step_graphs"]) == (0, 0), row


def test_opd_step_bound_counts_the_trained_rows(tmp_path, capsys):
    """With rollout.overlap or rollout.partial the rows a step trains do not come from the engine's last call (that
    one makes the next batch, or continues samples): the bound counts the trained rows' response tokens."""
    data, _ = run(
        "opd_step",
        tmp_path,
        capsys,
        *("--paper", "--shape", "tiny", "--teacher-shape", "tiny", "--prompts", "2", "--n", "2"),
        *("--prompt-len", "5", "--new-tokens", "24", "--lengths", "lognormal:mean=8,cap=24,sigma=0.8"),
        *("--warmup", "1", "--repeat", "1", "--peak-tflops", "1", "--peak-tbps", "0.01"),
        *("--variants", "default,overlap,partial_s2,partial_overlap"),
    )
    got = rows(data)
    for variant in ("", ", overlap", ", partial_s2", ", partial_overlap"):
        row = got[f"opd_step[static_engine{variant}]"]
        assert row["bound_tokens"] == row["tokens"], variant


def test_opd_step_profile_runs_one_more_step_with_its_phases_profiled(tmp_path, capsys):
    """`--profile`: a step after the timed ones with its scoring and update under torch.profiler, each phase's wall
    time and top ops printed and kept; the timed row is unchanged by it (one timed step, its own tokens)."""
    data, printed = run(
        "opd_step",
        tmp_path,
        capsys,
        *("--teacher-shape", "tiny", "--prompts", "2", "--n", "2", "--prompt-len", "5", "--new-tokens", "6"),
        *("--skip-trl", "--warmup", "1", "--profile"),
    )
    row = rows(data)["opd_step[static_engine]"]
    assert set(row["profile"]) == {"score_rollouts", "update_student"}
    for phase, found in row["profile"].items():
        assert found["wall_s"] > 0 and found["kernel_s"] is None  # no kernels on the CPU
        assert "aten::mm" in found["table"]  # the ops that ran under the profiler, by CPU time
        assert f"opd_step[static_engine]: {phase} of one more step under the profiler: wall" in printed
    assert len(row["step_seconds"]) == 1 and row["tokens"] == 2 * 2 * 6


def test_forced_lengths_hold_across_the_calls_of_a_partial_sample():
    """rollout.partial continues a sample over several calls (its prompt plus its tokens so far as a longer prompt):
    the benchmark's generator keeps the length drawn at the sample's first call, EOS at its end below the cap."""
    from opd.rollout import GenerationOutput, SamplingParams

    class Counting:  # an engine that writes 7s up to each row's own max_new_tokens
        def generate(self, prompt_ids, params, max_new_tokens_per_sample, stop_when=None):
            ids = [[7] * length for length in max_new_tokens_per_sample]
            return GenerationOutput(ids, ["length"] * len(ids), [i // params.n for i in range(len(ids))], None)

    sys.path.insert(0, str(BENCHMARKS))
    from common import parse_lengths

    lengths = parse_lengths("lognormal:mean=6,cap=12,sigma=1.0")
    bench = load("opd_step").BenchGenerator(Counting(), eos=0, cap=12, lengths=lengths)
    prompts, params = [[1, 2], [3, 4]], SamplingParams(n=2, max_new_tokens=12, seed=5, return_logprobs=False)
    drawn = lengths.sample(4, 5)
    assert [len(r) for r in bench.generate(prompts, params).response_ids] == drawn  # one call of the cap: as before
    out = bench.generate(prompts, SamplingParams(n=2, max_new_tokens=3, seed=5, return_logprobs=False))
    tokens, done = [list(ids) for ids in out.response_ids], [r == "stop" for r in out.finish_reasons]
    for call in range(1, 5):  # as the stream continues them: one prefix per unfinished sample, 3 tokens a call
        running = [i for i in range(4) if not done[i] and len(tokens[i]) < 12]
        prefixes = [prompts[i // 2] + tokens[i] for i in running]
        out = bench.generate(prefixes, SamplingParams(n=1, max_new_tokens=3, seed=5 + call, return_logprobs=False))
        for i, ids, reason in zip(running, out.response_ids, out.finish_reasons):
            tokens[i] += ids
            done[i] = reason == "stop"
    assert [len(t) for t in tokens] == drawn and max(drawn) > 3  # some took several calls
    assert all((t[-1] == 0) == (len(t) < 12) for t in tokens)


def test_parse_lengths():
    sys.path.insert(0, str(BENCHMARKS))
    from common import parse_lengths

    dist = parse_lengths("lognormal:mean=1500,cap=7168")
    sample = dist.sample(20_000, seed=0)
    assert max(sample) == 7168 and min(sample) >= 1
    assert 1300 < sum(sample) / len(sample) < 1500  # mean 1,500 before the cap; the cap trims the tail
    assert sample == dist.sample(20_000, seed=0) != dist.sample(20_000, seed=1)
    assert parse_lengths("fixed:7").sample(3, seed=1) == [7, 7, 7]
    for bad in ("lognormal:mean=0,cap=5", "lognormal:cap=5", "gamma:mean=3", "fixed:x", "lognormal:mean=3,cap=5,mu=1"):
        with pytest.raises(ValueError, match="expected lognormal:mean=M,cap=C"):
            parse_lengths(bad)


def test_opd_step_bound():
    """Two rows: prompt 2 + response 3, prompt 1 + response 1. Decode: 3 sequential steps × 10 weight bytes, KV
    reads (2 + 3 + 4) + 1 = 10 tokens × 4 bytes; 7 scored positions at 2·P FLOPs (teacher 5, student 2) and 6·P."""
    sys.path.insert(0, str(BENCHMARKS))
    from common import opd_step_bound

    bound = opd_step_bound(
        student_params=2,
        teacher_params=5,
        student_weight_bytes=10,
        kv_bytes_per_token=4,
        prompt_lengths=[2, 1],
        response_lengths=[3, 1],
        peak_flops=7.0,
        bandwidth=2.0,
    )
    assert bound["decode_s"] == pytest.approx((3 * 10 + 10 * 4) / 2.0)
    assert bound["teacher_s"] == pytest.approx(2 * 5 * 7 / 7.0)
    assert bound["student_s"] == pytest.approx(2 * 2 * 7 / 7.0)
    assert bound["update_s"] == pytest.approx(6 * 2 * 7 / 7.0)
    assert bound["total_s"] == pytest.approx(35 + 10 + 4 + 12)


@pytest.mark.slow
def test_teacher_server(tmp_path, capsys):
    """Local vs served (a server subprocess on the same random weights): every row runs, fp32 results equal."""
    data, _ = run(
        "teacher_server",
        tmp_path,
        capsys,
        "--batch",
        "2",
        "--prompt-len",
        "4",
        "--response-len",
        "6",
        "--clients",
        "1,2",
        "--warmup",
        "1",
        "--threads",
        "1",
    )
    got = {r["name"]: r for r in data["rows"]}
    assert set(got) == {
        "local[tiny]",
        "served[tiny, 1 client]",
        "served[tiny, 2 clients]",
        "served[tiny, 1 client, bf16 wire]",
    }
    for name, row in got.items():
        assert "error" not in row and row["tokens_per_s"] > 0, (name, row.get("error"))
    # one request per call, scored in a forward of the same shape as the local one: equal up to fp32 rounding
    assert got["served[tiny, 1 client]"]["max_err"] < 1e-5 and got["served[tiny, 2 clients]"]["max_err"] < 1e-5
    assert 200 < got["served[tiny, 1 client]"]["bytes_per_position"] < 400


@pytest.mark.slow
def test_teacher_bytes(capsys):
    """Every answer's row (in process and loopback) and the analytic table print; the wire bytes are the formula's."""
    rows = load("teacher_bytes").main(
        [
            "--vocab",
            "512",
            "--hidden",
            "32",
            "--batch",
            "2",
            "--prompt-len",
            "4",
            "--response-len",
            "6",
            "--repeats",
            "1",
        ]
    )
    printed = capsys.readouterr().out
    assert (
        len(rows) == 8 and "crossover K" in printed and "| real pair teacher (E 1,536) | 200 | 72 | 3,072 |" in printed
    )
    by_name = {(r["where"], r["name"]): r for r in rows}
    assert by_name[("loopback HTTP", "top-16 ids + log-probs")]["bytes"] > 200  # + the message header, per position
    assert all(r.get("pps", 1) > 0 for r in rows)


def test_full_vocab_loss_times_both_paths_and_checks_the_bf16_gradients(capsys):
    data = load("full_vocab_loss").main(
        ["--positions", "64", "--vocab", "512", "--student-dim", "16", "--teacher-dim", "24", "--repeat", "1",
         "--device", "cpu"]
    )  # fmt: skip
    printed = capsys.readouterr().out
    assert [row["name"] for row in data["rows"]] == ["top-16 (17 ids + entropy)", "full_reverse_kl"]
    assert "| full_reverse_kl |" in printed
    assert data["errors"]["d hidden"] < 3e-2 and data["errors"]["d weight"] < 3e-2  # bf16 rounding, not a bug
