"""Helpers shared by the test modules: the tiny offline tokenizer and tiny random-weight models, `opd` as a subprocess
(kill -9 and resume), and the small configs, files and measurements of the end-to-end runs. Fixtures built on them
live in conftest.py.

Nothing here touches the network. Everything is deterministic: the tokenizer is fully specified below, and model
weights come from a fixed seed drawn inside `torch.random.fork_rng` (the global RNG is left untouched).

The tokenizer (`make_tiny_tokenizer`) is byte-level with no merges, so every string round-trips exactly:
    ids 0..255   one token per byte (GPT-2 byte-to-unicode alphabet)
    256          <|endoftext|>   special; the pad token (as in Qwen)
    257          <|im_start|>    special
    258          <|im_end|>      special; the EOS token (as in Qwen instruct models)
    259          <think>         added, not special (Qwen3 keeps it in decoded text)
    260          </think>        added, not special
    len(tokenizer) == TINY_VOCAB == 261

Its chat template is a trimmed Qwen3 template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then with
`add_generation_prompt=True` `<|im_start|>assistant\n`, followed by `<think>\n\n</think>\n\n` when
`enable_thinking=False` (thinking on is the default, as in Qwen3). It omits Qwen3's tool-call blocks and its stripping
of earlier turns' reasoning.
"""

from __future__ import annotations

import io
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from pathlib import Path

import torch
import yaml
from rich.console import Console
from safetensors.torch import load_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import opd
from opd.cli import main
from opd.config import DataSpec, DistillConfig, ModelSpec, build_config
from opd.io import read_jsonl
from opd.objectives import full_reverse_kl
from opd.recipes.distill import distill
from opd.recipes.prompts import PromptScoreConfig
from opd.recipes.rollout import RolloutConfig
from opd.recipes.sft import SFTConfig
from opd.rollout import SamplingParams, make_generator
from opd.rollout.batch import build_rollouts
from opd.train.checkpoint import latest_checkpoint
from opd.types import Prompt, Rollouts

# ------------------------------------------------------------------------------------- tiny tokenizer and models

PAD_ID, IM_START_ID, EOS_ID, THINK_ID, END_THINK_ID = 256, 257, 258, 259, 260
TINY_VOCAB = 261

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable character map (what `pre_tokenizers.ByteLevel` emits)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def make_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """The 261-token byte-level tokenizer described in the module docstring, with the Qwen-like chat template."""
    vocab = {ch: byte for byte, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    # Added in id order; special tokens are never split and are dropped by decode(skip_special_tokens=True).
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    tok.add_tokens([AddedToken(t, special=False) for t in ("<think>", "</think>")])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        chat_template=CHAT_TEMPLATE,
    )
    # The ids above are part of the contract other tests rely on; fail loudly if a library change moves them.
    got = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    assert got == [PAD_ID, IM_START_ID, EOS_ID], got
    assert tokenizer.convert_tokens_to_ids(["<think>", "</think>"]) == [THINK_ID, END_THINK_ID]
    assert len(tokenizer) == TINY_VOCAB
    return tokenizer


def make_tiny_model(
    kind: str = "llama",
    vocab_size: int = TINY_VOCAB,
    *,
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 64,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.3,
    seed: int = 0,
) -> PreTrainedModel:
    """A random-weight causal LM ("llama" or "qwen3") in fp32 eval mode on CPU, ~50k parameters by default.

    `initializer_range` is larger than HF's 0.02 so that next-token distributions are peaked (greedy decoding has no
    near-ties, sampling with different seeds visibly differs). EOS is 258 (plus 256 in the generation config, as Qwen
    lists both), pad is 256. Attention is "eager" so results do not depend on which SDPA kernel is picked.
    """
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        initializer_range=initializer_range,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attn_implementation="eager",
    )
    if kind == "llama":
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    elif kind == "qwen3":
        config, cls = Qwen3Config(head_dim=hidden_size // num_heads, **common), Qwen3ForCausalLM
    else:
        raise ValueError(f"kind must be 'llama' or 'qwen3', got {kind!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
    model.generation_config.eos_token_id = [EOS_ID, PAD_ID]
    model.generation_config.pad_token_id = PAD_ID
    return model.float().eval()


def make_rollouts(prompt_lens, response_lens, T, vocab, seed=0, pad=0) -> Rollouts:
    """Right-padded rows: prompt then response; `response_lens[b]` valid response tokens (0 = empty response)."""
    g = torch.Generator().manual_seed(seed)
    B, L = len(prompt_lens), max(p + T for p in prompt_lens)
    input_ids = torch.full((B, L), pad, dtype=torch.long)
    attention = torch.zeros(B, L, dtype=torch.bool)
    response_ids = torch.full((B, T), pad, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        toks = torch.randint(1, vocab, (p + r,), generator=g)
        input_ids[b, : p + r] = toks
        attention[b, : p + r] = True
        response_ids[b, :r] = toks[p:]
        response_mask[b, :r] = True
    return Rollouts(
        input_ids,
        attention,
        torch.tensor(prompt_lens),
        response_ids,
        response_mask,
        torch.arange(B),
        torch.zeros(B, dtype=torch.bool),
    )


# -------------------------------------------------------------------------------------------- console and files

# Wide enough that no line a test looks into wraps (paths under a long checkout or tmp dir included); conftest gives
# every test COLUMNS=CONSOLE_COLUMNS, so the consoles the commands make for themselves are this wide too.
CONSOLE_COLUMNS = 1000


def string_console() -> Console:
    """A console of fixed width writing into a string: `console.file.getvalue()`."""
    return Console(file=io.StringIO(), width=CONSOLE_COLUMNS)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------- opd on the command line, kill -9 and resume
# The kill tests start the real CLI as a subprocess (`start`), wait for a file it writes (`wait_for`), stop or kill it
# (`pause`, `kill9`) and rerun the command in this process (`cli`).

SRC = str(Path(opd.__file__).resolve().parents[1])


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run `opd ARGS` in-process through `main()` (the CLI's error mapping included): (exit code, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["opd", *map(str, args)]
    try:
        main()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err


def run_in_process(argv: list[str], monkeypatch, capfd) -> tuple[int | None, str, str | None]:
    """`opd ARGV` in-process through `main()`, stderr read at the file-descriptor level: (exit code, stderr, traceback
    of an exception that escaped `main`, as the user would see it). The exit code is 1 when one escaped."""
    monkeypatch.setattr(sys, "argv", ["opd", *argv])
    code, escaped = 0, None
    try:
        main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except BaseException:  # noqa: BLE001 - what the user would see as a traceback
        escaped = traceback.format_exc()
        code = 1
    return code, capfd.readouterr().err, escaped


def one_line(code: int, err: str) -> str:
    """The single line of a user error: exit code 2, one non-empty stderr line, no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


def dump(config, path: Path) -> Path:
    """A config as the YAML a user would pass with --config."""
    path.write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path


def subprocess_env() -> dict:
    """The environment of an `opd` subprocess: this checkout's sources first, one torch thread as the in-process
    reference runs (conftest), so that both compute the same, bit for bit."""
    return {
        **os.environ,
        "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
    }


def start(log: Path, *args: str) -> subprocess.Popen:
    """`opd ARGS` as a subprocess in its own session (so kill -9 reaches any child); output goes to `log`."""
    handle = open(log, "w")
    return subprocess.Popen(
        [sys.executable, "-m", "opd.cli", *map(str, args)],
        stdout=handle,
        stderr=subprocess.STDOUT,
        env=subprocess_env(),
        start_new_session=True,
    )


def run_opd(*args: str, timeout: float = 600, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "opd.cli", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def wait_for(process: subprocess.Popen, condition, log: Path, what: str, timeout: float = 300) -> None:
    """Poll `condition()` until true; fails (with the log's tail) if the process ends first or after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if process.poll() is not None:
            raise AssertionError(f"process ended (rc {process.returncode}) before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.01)


def pause(process: subprocess.Popen) -> None:
    """SIGSTOP: the process keeps its lock (and its half-done work) but makes no progress until killed."""
    assert process.poll() is None, "the process finished before it could be stopped"
    os.killpg(process.pid, signal.SIGSTOP)


def kill9(process: subprocess.Popen) -> None:
    """SIGKILL to the process's whole session, then reap it."""
    assert process.poll() is None, "the process finished before it could be killed"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def interrupt_with_a_second_process(capsys, directory: Path, holder: subprocess.Popen, *args: str) -> None:
    """Stop `holder` mid-run, run the same command on its directory in this process (exit 2, one line naming the
    directory and the holder's pid), then `kill -9` the holder."""
    pause(holder)
    line = one_line(*cli(capsys, *args)[::2])
    assert str(directory) in line and f"pid {holder.pid}" in line, line
    kill9(holder)


@contextmanager
def server_in_thread(service, token: str | None, port: int = 0):
    """`opd serve-teacher`'s server for `service` on a loopback thread of this process; yields its URL, always
    stopped."""
    from opd.teacher.server import bind, make_server, url_of

    sock = bind("127.0.0.1", port)
    server = make_server(service, token)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "in-process server did not start"
            time.sleep(0.02)
        yield url_of(sock)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


def checkpoint_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    """The two checkpoints' weights are bit-identical."""
    wa, wb = checkpoint_weights(a), checkpoint_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------------ opd distill runs


def distill_config(world, tmp_path, *overrides, teacher=True, steps=2) -> DistillConfig:
    """A 2-step run on the `world` fixture's tiny student, teacher and prompts (conftest)."""
    options = {
        "student.path": str(world / "student"),
        "data.path": str(world / "prompts.jsonl"),
        "teacher.path": str(world / "teacher") if teacher else None,
        "data.answer_key": "answer",
        "data.max_prompt_length": 32,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 6,
        "micro_batch_tokens": 64,
        "run.out_dir": str(tmp_path),
        "run.name": "run",
        "run.steps": steps,
        "run.report": False,
        "optim.lr": 1e-3,
    }
    return build_config(DistillConfig, options=options, overrides=list(overrides))


# besides the time/* keys: what differs between equal runs (gpu/busy_frac: CUDA only)
TIMING_METRICS = ("tokens_per_second", "wall_time", "gpu/busy_frac")


def without_timing(metrics: dict) -> dict:
    """One metrics row without its wall-clock figures: what two runs of the same computation must agree on."""
    return {k: v for k, v in metrics.items() if not k.startswith("time/") and k not in TIMING_METRICS}


def kill9_distill_after_step_2(world, tmp_path: Path, *overrides: str) -> tuple[Path, float, Path]:
    """A long `opd distill` (500 steps, a checkpoint every step; constant lr, so its length does not change the steps
    it makes) killed -9 at a random moment after its step_2 checkpoint: (its config file, the delay, its latest
    checkpoint). The run directory is tmp_path / "run"."""
    config = distill_config(world, tmp_path, *overrides, "run.save_every=1", "run.keep_last=null", steps=500)
    yaml_path = dump(config, tmp_path / "c.yaml")
    run_dir, log = tmp_path / "run", tmp_path / "a.log"
    process = start(log, "distill", "--config", yaml_path)
    wait_for(process, lambda: (run_dir / "checkpoints" / "step_2").is_dir(), log, "the second checkpoint")
    delay = random.uniform(0, 1)
    time.sleep(delay)  # where the kill lands is not what is tested: any moment must resume exactly
    kill9(process)
    return yaml_path, delay, latest_checkpoint(run_dir)


def assert_resume_equals_straight(
    capsys, world, tmp_path: Path, yaml_path: Path, steps: int, *overrides: str, note: object = None
) -> None:
    """`opd distill --resume` of the killed run (`kill9_distill_after_step_2`) to `steps` equals a straight run of
    `overrides` to `steps`: the weights bit for bit and every step's metrics but the wall-clock ones. `note` goes
    into the assertion messages (what the kill depended on)."""
    code, out, err = cli(capsys, "distill", "--config", yaml_path, "--resume", f"run.steps={steps}")
    assert code == 0, err
    assert "resumed from" in out, (note, out)
    straight = distill(distill_config(world, tmp_path / "ref", *overrides, "run.save_every=1", steps=steps))
    run_dir = tmp_path / "run"
    assert_same_weights(straight / "checkpoints" / f"step_{steps}", run_dir / "checkpoints" / f"step_{steps}")
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in mb] == list(range(1, steps + 1))
    assert [without_timing(m) for m in ma] == [without_timing(m) for m in mb], note


def latest_weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def train_to_prefer(path: Path, prompt_ids: list[int], target_ids: list[int], steps: int) -> None:
    """A model pushed by `steps` Adam steps of SFT toward one fixed continuation of the prompt (seconds on CPU):
    150 steps make the teacher; 5 steps from the same init make a student that is near it but clearly off."""
    model = make_tiny_model("qwen3", seed=5).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[:, : len(prompt_ids)] = -100
    for _ in range(steps):
        loss = model(ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval().save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)


def reverse_kl(student_dir: Path, teacher_dir: Path, prompt_ids: list[int], samples: int = 32) -> float:
    """Exact token-mean KL(student ‖ teacher) over the full vocabulary on the student's own samples."""
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    tokenizer = make_tiny_tokenizer()
    params = SamplingParams(n=samples, max_new_tokens=6, seed=11)
    output = make_generator(student, tokenizer).generate([prompt_ids], params)
    rollouts = build_rollouts([prompt_ids], output, pad_id=tokenizer.pad_token_id)
    positions = rollouts.response_positions().clamp(max=rollouts.input_ids.shape[1] - 1)
    with torch.no_grad():
        s = student(rollouts.input_ids, attention_mask=rollouts.attention_mask).logits
        t = teacher(rollouts.input_ids, attention_mask=rollouts.attention_mask).logits
    mask = rollouts.response_mask

    def gather(logits):
        return torch.gather(logits, 1, positions[..., None].expand(-1, -1, logits.shape[-1]))[mask]

    kl = full_reverse_kl(gather(s), gather(t), torch.ones(int(mask.sum()), dtype=torch.bool))
    return float(kl.sum() / mask.sum())


def distill_toward_a_trained_teacher(world, tmp_path, *overrides) -> tuple[float, float]:
    """The learning check: a teacher trained to answer "7*6=" with "42" (`train_to_prefer`, 150 steps), a student near
    it (5 steps), 20 steps of `opd distill` on that one prompt with `overrides`. The student's reverse KL to the
    teacher (`reverse_kl`) before and after."""
    from opd.recipes.distill import distill

    tokenizer = make_tiny_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "7*6="}], tokenize=False, add_generation_prompt=True
    )
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    target_ids = tokenizer("42")["input_ids"] + [EOS_ID]
    train_to_prefer(tmp_path / "teacher", prompt_ids, target_ids, steps=150)
    train_to_prefer(tmp_path / "student", prompt_ids, target_ids, steps=5)
    write_jsonl(tmp_path / "p.jsonl", [{"prompt": "7*6=", "answer": "42"}])
    cfg = distill_config(
        world,
        tmp_path,
        "prompts_per_step=1",
        "rollout.n=8",
        "optim.lr=3e-3",
        "run.save_every=0",
        *overrides,
        steps=20,
    )
    cfg.student.path, cfg.teacher.path = str(tmp_path / "student"), str(tmp_path / "teacher")
    cfg.data.path = str(tmp_path / "p.jsonl")
    before = reverse_kl(tmp_path / "student", tmp_path / "teacher", prompt_ids)
    after = reverse_kl(latest_checkpoint(distill(cfg)), tmp_path / "teacher", prompt_ids)
    return before, after


# ------------------------------------------------------------------------------------------------ opd sft runs

SFT_QA = [("what is 2+3?", "5"), ("name a colour", "red"), ("reverse abc", "cba"), ("say hi", "hi there")]


def chat(question, answer):
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def sft_config(tmp_path, model_dir, data, *overrides):
    return build_config(
        SFTConfig,
        overrides=[
            f"model.path={model_dir}",
            f"data.path={data}",
            f"run.out_dir={tmp_path / 'runs'}",
            "examples_per_step=4",
            "run.report=false",
            *overrides,
        ],
    )


# ------------------------------------------------------------------------------------- opd eval, rollout, prompts


def eval_args(model_dir, problem_file, out):
    return [
        "eval",
        "--model",
        str(model_dir),
        "--benchmarks",
        str(problem_file),
        "--prompt-key",
        "problem",
        "--answer-key",
        "answer",
        "--n",
        "2",
        "--max-new-tokens",
        "6",
        "--batch-size",
        "4",
        "--out",
        str(out),
        "--temperature",
        "1.0",
        "--top-p",
        "1.0",
    ]


def write_prompts(path: Path, count: int, *, system: str | None = None) -> Path:
    """`count` verl-layout prompts "<q{i}> What is 2+2?" (answer 4) for `opd rollout`."""
    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"<q{i}> What is 2+2?"}]
        if system and i == 0:
            messages.insert(0, {"role": "system", "content": system})
        rows.append(
            {
                "prompt": messages,
                "reward_model": {"ground_truth": "4"},
                "extra_info": {"index": f"p{i}"},
                "data_source": "toy",
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def tiny_rollout_config(tmp_path, model_dir, name, **overrides) -> RolloutConfig:
    prompts = write_prompts(tmp_path / "prompts.jsonl", 5)
    options = {
        "model.path": str(model_dir),
        "model.device": "cpu",
        "data.path": str(prompts),
        "out": str(tmp_path / name),
        "n": 2,
        "max_attempts": 2,
        "max_new_tokens": 6,
        "batch_size": 2,
        "data.enable_thinking": "off",
        **overrides,
    }
    return build_config(RolloutConfig, options=options)


def make_prompts(count: int, prefix: str = "p") -> list[Prompt]:
    return [
        Prompt(f"{prefix}{i}", [{"role": "user", "content": f"What is {i} + {i}?"}], str(2 * i), source=prefix)
        for i in range(count)
    ]


SMALL_SCORING = dict(n=2, top_k=4, max_new_tokens=6, batch_size=2)


def score_config(dirs, data: Path, out: Path, **over) -> PromptScoreConfig:
    return PromptScoreConfig(
        student=ModelSpec(path=str(dirs["student"])),
        teacher=ModelSpec(path=str(dirs["teacher"])),
        data=DataSpec(path=str(data)),
        out=str(out),
        seed=2,
        **(SMALL_SCORING | over),
    )


def compile_decode_on_cpu(monkeypatch) -> None:
    """`StaticGenerator`'s decode step compiled on the CPU as on CUDA, through dynamo's graph capture and guards
    without code generation (torch.compile's default backend becomes `aot_eager`: the same recompiles as inductor's,
    seconds cheaper), one process-wide set as there."""
    import torch

    from opd.rollout import static_engine

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_(fn, **{"backend": "aot_eager", **kwargs}))
    monkeypatch.setattr(static_engine, "_COMPILED", None)
    monkeypatch.setattr(static_engine.StaticGenerator, "compiles_decode", lambda self: self.compile is not False)
    monkeypatch.setattr(static_engine.StaticGenerator, "_compiles", lambda self, on_cuda: self.compile is not False)


def snapshot(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}
