"""`opd sft`: whole runs (run directory, exact resume, LoRA + merge, learning from scratch) on tiny models, and its
config's defaults and contradictions. Its data: tests/data/test_sft.py; its loss and packing:
tests/train/test_sft.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import sft_config, write_jsonl
from opd.config import ConfigError, build_config
from opd.recipes.sft import SFTConfig, check_config, sft


def test_sft_run_writes_the_run_directory(tmp_path, tiny_model_dir, sft_data):
    bench = write_jsonl(
        tmp_path / "bench.jsonl",
        [{"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}}],
    )
    config = sft_config(
        tmp_path,
        tiny_model_dir,
        sft_data,
        "run.steps=2",
        "run.name=e2e",
        "run.report=true",
        "data.packing=packed",
        f"eval.benchmarks=[{bench}]",
        "eval.n=2",
        "eval.max_new_tokens=4",
    )
    run_dir = sft(config)
    assert {"config.yaml", "metrics.jsonl", "report.html", "checkpoints", "eval"} <= {p.name for p in run_dir.iterdir()}
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1, 2, 2]  # evals before the first step and at the end
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "epoch"} <= metrics[2].keys()
    assert metrics[2]["epoch"] == pytest.approx(8 / 12)
    assert "eval/bench/avg@2" in metrics[0] and (run_dir / "eval" / "step_0" / "results.json").is_file()
    assert "eval/bench/avg@2" in metrics[3] and (run_dir / "eval" / "step_2" / "results.json").is_file()
    checkpoint = run_dir / "checkpoints" / "step_2"
    files = {p.name for p in checkpoint.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "trainer_state.pt", "COMPLETE"} <= files
    AutoModelForCausalLM.from_pretrained(checkpoint)


@pytest.mark.parametrize("lora", [False, True])
def test_resume_is_bit_identical(tmp_path, tiny_model_dir, sft_data, lora):
    extra = ["lora.enabled=true", "lora.r=4", "lora.dropout=0.3", "lora.merge=false"] if lora else []
    full = sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=4",
            "run.save_every=2",
            "run.keep_last=null",
            "optim.lr=1e-2",
            "run.name=full",
            *extra,
        )
    )
    # an interrupted run: the same directory as it was right after the step-2 checkpoint, then resumed
    resumed = tmp_path / "runs" / "resumed"
    shutil.copytree(full, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_4")
    sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=4",
            "run.save_every=2",
            "run.keep_last=null",
            "optim.lr=1e-2",
            "run.name=resumed",
            "run.resume=true",
            *extra,
        )
    )
    weights = "adapter_model.safetensors" if lora else "model.safetensors"
    a = (full / "checkpoints" / "step_4" / weights).read_bytes()
    assert a == (resumed / "checkpoints" / "step_4" / weights).read_bytes()
    losses = [
        [json.loads(line)["loss"] for line in (d / "metrics.jsonl").read_text().splitlines()] for d in (full, resumed)
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 4


def test_lora_trains_adapters_only_and_merges(tmp_path, tiny_model_dir, sft_data):
    from peft import PeftModel

    run_dir = sft(
        sft_config(
            tmp_path,
            tiny_model_dir,
            sft_data,
            "run.steps=2",
            "run.name=lora",
            "optim.lr=3e-2",
            "lora.enabled=true",
            "lora.r=4",
            "lora.target_modules=[q_proj, v_proj, down_proj]",
        )
    )
    checkpoint = run_dir / "checkpoints" / "step_2"
    names = {p.name for p in checkpoint.iterdir()}
    assert "adapter_model.safetensors" in names and "model.safetensors" not in names and "tokenizer.json" in names
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    merged = AutoModelForCausalLM.from_pretrained(run_dir / "merged")  # no peft needed
    changed = {n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])}
    assert changed and all(n.rsplit(".", 2)[-2] in ("q_proj", "v_proj", "down_proj") for n in changed)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), checkpoint).eval()
    ids = torch.tensor([list(range(40, 80))])
    with torch.no_grad():
        # Two code paths: merged weights W + s·BA against W·x + s·B(A·x). Both float32, summed in another order over
        # the hidden size and the layers: a few float32 ulps of |logit| (eps 1.2e-7 · √(d · layers) · |logit| is
        # ~1e-5 here; 1.4e-5 was seen on 2 cores), so 1e-4 absolute plus 1e-5 relative, far below a wrong merge.
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, atol=1e-4, rtol=1e-5)


def test_sft_learns_from_scratch(tmp_path, tiny_model_dir, sft_data):
    run_dir = sft(
        sft_config(
            tmp_path, tiny_model_dir, sft_data, "run.steps=30", "run.name=learn", "optim.lr=1e-2", "run.save_every=0"
        )
    )
    losses = [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and sum(losses[-3:]) / 3 < 0.1 * losses[0], losses


def test_config_defaults_and_contradictions():
    base = ["model.path=m", "data.path=d.jsonl"]
    config = build_config(SFTConfig, overrides=base)
    assert config.data.path == ["d.jsonl"] and config.optim.lr == 1e-5 and config.optim.schedule == "cosine"
    with pytest.raises(ConfigError, match="lora.dropout"):
        build_config(SFTConfig, overrides=[*base, "lora.dropout=1.5"])
    with pytest.raises(ValueError, match=r"either epochs \(2.0\) or run.steps \(10\)"):
        check_config(build_config(SFTConfig, overrides=[*base, "epochs=2", "run.steps=10"]))
    with pytest.raises(ValueError, match="micro_batch_tokens=100 is smaller than data.max_length=4096"):
        check_config(build_config(SFTConfig, overrides=[*base, "micro_batch_tokens=100"]))
