#!/usr/bin/env bash
# Several GPUs (issue 17) in one call: equivalence of `opd distill` / `opd sft` at N processes against one, checkpoints
# resumed at other world sizes, weak-scaling rows, and the teacher replicated per rank against a served one. Run from
# the repository root on a multi-GPU machine; JSON and logs go to ${OUT:-runs/benchmarks/multi_gpu}.
#   bash benchmarks/run_multi_gpu.sh [equiv|resume|scale|scale_paper|placement ...]     (default: all five)
# World sizes: every N of 1 2 4 8 that the machine's GPUs allow (SIZES="1 2" picks them). Keep NVLink multicast off
# (NCCL_NVLS_ENABLE=0, set below). On one GPU it runs what one GPU can: the N = 1 rows, and the served teacher on the
# students' own GPU (labelled so: that is not a placement, only a check of the path).
#
# Models: the equivalence and resume runs use the shipped lab student/teacher (real Hugging Face checkpoints and
# tokenizer, the real CLI through `multi_gpu.py run`, which only makes rollouts greedy); the scaling rows use
# random-weight Qwen3 shapes (`common.SHAPES`), as the other benchmarks.
set -uo pipefail
out=${OUT:-runs/benchmarks/multi_gpu}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TOKENIZERS_PARALLELISM=false
parts=${*:-equiv resume scale scale_paper placement}
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || { echo "no GPU visible (nvidia-smi -L)"; exit 1; }
sizes=${SIZES:-$(for n in 1 2 4 8; do [ "$n" -le "$gpus" ] && printf "%s " "$n"; done)}
largest=$(echo $sizes | tr ' ' '\n' | tail -1)
echo "GPUs: $gpus; world sizes: $sizes; $(python3 -c 'import torch; print("torch", torch.__version__)')"
status=0
filter='Warning|warnings.warn|^\s*$|━'

step() {  # name, time limit (s), command... ("launch N script args": python3 for N = 1, as a user runs it; torchrun
          # --nproc_per_node N otherwise)
    local name=$1 limit=$2 rc
    shift 2
    if [ "$1" = launch ]; then
        local n=$2
        shift 2
        if [ "$n" = 1 ]; then set -- python3 "$@"; else set -- torchrun --standalone --nproc_per_node "$n" "$@"; fi
    fi
    echo "=== $name: $*"
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    [ $rc = 0 ] || { status=1; echo "FAILED (rc $rc)"; }
    grep -v -E "$filter" "$out/$name.log" | tail -25
}

lab=$(python3 -c "from opd.lab import student_path as s, teacher_path as t, opd_prompts_path as p; print(s(), t(), p())")
read -r student teacher prompts <<< "$lab"
# 8 prompts × 4 samples a step divide by every N; lr 1e-4 (the lab demo's) moves the weights well above the bf16
# rounding noise in 3 steps, so equal weights mean something; eps 1e-4 keeps Adam from amplifying gradient entries
# at rounding-noise level, where the runs' float sums may differ in sign (tests/test_distributed.py does the same).
distill_args=(distill "student.path=$student" "teacher.path=$teacher" "data.path=$prompts" data.max_prompt_length=64
              prompts_per_step=8 rollout.n=4 rollout.max_new_tokens=64 optim.lr=1e-4 optim.eps=1e-4
              run.save_every=1 run.keep_last=3 run.eval_every=0 run.report=false "run.out_dir=$out/runs")
precisions=("fp32 student.dtype=fp32 teacher.dtype=fp32" "bf16 student.dtype=auto teacher.dtype=bf16")

for part in $parts; do
    case $part in
    equiv)
        # fp32 compares at an absolute tolerance (float reduction order only); bf16 autocast relative to how far the
        # weights moved (greedy rollouts may fork where two tokens' bf16 logits tie: the table says so if they did)
        for precision in "${precisions[@]}"; do
            read -r tag settings <<< "$precision"
            for n in $sizes; do
                step "distill_${tag}_n$n" 300 launch "$n" benchmarks/multi_gpu.py run "${distill_args[@]}" \
                    run.steps=3 "run.name=distill_${tag}_n$n" $settings
            done
            tolerance=$([ "$tag" = fp32 ] && echo "--atol 1e-5" || echo "--rel 0.05")
            runs=$(for n in $sizes; do [ "$n" = 1 ] || printf "%s " "$out/runs/distill_${tag}_n$n"; done)
            [ -n "$runs" ] && step "compare_distill_$tag" 120 python3 benchmarks/multi_gpu.py compare \
                "$out/runs/distill_${tag}_n1" $runs --initial "$student" $tolerance
        done
        # opd sft on the lab teacher's own answers (`opd rollout`, rejection-sampled), the same global batch at each N
        step sft_data 300 python3 -m opd.cli rollout --model "$teacher" --prompts "$prompts" --out "$out/sft_data" \
            --n 1 --max-new-tokens 64 --require-correct --batch-size 256 data.limit=512
        for n in $sizes; do
            step "sft_n$n" 300 launch "$n" benchmarks/multi_gpu.py run sft "model.path=$student" model.dtype=fp32 \
                "data.path=$out/sft_data/rollouts.jsonl" run.steps=3 examples_per_step=32 data.max_length=256 micro_batch_tokens=2048 \
                optim.lr=1e-4 optim.eps=1e-4 run.save_every=1 run.keep_last=3 run.report=false \
                "run.out_dir=$out/runs" "run.name=sft_n$n"
        done
        runs=$(for n in $sizes; do [ "$n" = 1 ] || printf "%s " "$out/runs/sft_n$n"; done)
        [ -n "$runs" ] && step compare_sft 120 python3 benchmarks/multi_gpu.py compare "$out/runs/sft_n1" $runs \
            --initial "$student" --atol 1e-5
        ;;
    resume)
        # saved at N = 2 after step 2 (step 1 where only one GPU: the path of another world size needs two), resumed
        # to step 3 at N = 1 and at the largest N, against the uninterrupted fp32 run of `equiv` (run it first)
        first=$([ "$gpus" -ge 2 ] && echo 2 || echo 1)
        step "resume_saved_n$first" 300 launch "$first" benchmarks/multi_gpu.py run "${distill_args[@]}" run.steps=2 \
            "run.name=resume_n$first" student.dtype=fp32 teacher.dtype=fp32
        resumed=""
        for n in $(echo 1 "$largest" | tr ' ' '\n' | sort -un); do
            rm -rf "$out/runs/resume_${first}_to_$n"
            cp -r "$out/runs/resume_n$first" "$out/runs/resume_${first}_to_$n"
            step "resume_${first}_to_$n" 300 launch "$n" benchmarks/multi_gpu.py run "${distill_args[@]}" run.steps=3 \
                "run.name=resume_${first}_to_$n" student.dtype=fp32 teacher.dtype=fp32 run.resume=true
            resumed+="$out/runs/resume_${first}_to_$n "
        done
        step compare_resume 120 python3 benchmarks/multi_gpu.py compare "$out/runs/distill_fp32_n1" $resumed \
            --initial "$student" --atol 1e-5
        ;;
    scale)  # weak scaling, 8 prompts × 4 per rank on the 0.6B/1.7B shapes, responses ragged ≤ 1,024
        for n in $sizes; do
            step "scale_small_n$n" 400 launch "$n" benchmarks/multi_gpu.py scale --shape qwen3-0.6b \
                --teacher-shape qwen3-1.7b --prompts-per-rank 8 --new-tokens 1024 \
                --lengths lognormal:mean=400,cap=1024 --out "$out/scale.json"
        done
        ;;
    scale_paper)  # 4 × 4 per rank on 1.7B/4B with the paper's long tail (lognormal mean 1,500, cap 7,168)
        for n in $sizes; do
            step "scale_paper_n$n" 580 launch "$n" benchmarks/multi_gpu.py scale --shape qwen3-1.7b \
                --teacher-shape qwen3-4b --prompts-per-rank 4 --new-tokens 7168 \
                --lengths lognormal:mean=1500,cap=7168 --warmup 1 --repeat 1 --out "$out/scale.json"
        done
        ;;
    placement)
        # the served teacher (`opd serve-teacher`'s code path, benchmarks/teacher_server.py --serve) on the GPU after
        # the students' N; with one GPU it shares the students' GPU (a check of the path, not a placement)
        for n in $sizes; do
            if [ $((n + 1)) -le "$gpus" ]; then server_gpu=$n; label="served"; else server_gpu=0; label="served-same-gpu"; fi
            [ "$label" = served-same-gpu ] && [ "$n" -gt 1 ] && continue
            CUDA_VISIBLE_DEVICES=$server_gpu python3 benchmarks/teacher_server.py --serve --shape qwen3-1.7b \
                --device cuda --batch 32 --prompt-len 128 --response-len 1024 > "$out/server_n$n.log" 2>&1 &
            server=$!
            url=""
            for _ in $(seq 240); do
                url=$(grep -o "listening on [^ ]*" "$out/server_n$n.log" | head -1 | cut -d' ' -f3)
                [ -n "$url" ] && break
                kill -0 $server 2>/dev/null || break
                sleep 1
            done
            if [ -z "$url" ]; then echo "server did not start"; tail -20 "$out/server_n$n.log"; status=1; continue; fi
            visible=$(seq -s, 0 $((n - 1)))
            CUDA_VISIBLE_DEVICES=$visible step "placement_n$n" 400 launch "$n" benchmarks/multi_gpu.py scale \
                --shape qwen3-0.6b --teacher-shape qwen3-1.7b --prompts-per-rank 8 --new-tokens 1024 \
                --lengths lognormal:mean=400,cap=1024 --teacher-url "$url" --label "qwen3-0.6b ← qwen3-1.7b ($label)" \
                --teacher-gpus $([ "$label" = served ] && echo 1 || echo 0) --out "$out/scale.json"
            kill $server 2>/dev/null
            wait $server 2>/dev/null
        done
        ;;
    *) echo "unknown part $part (equiv resume scale scale_paper placement)"; status=1 ;;
    esac
done
[ -f "$out/scale.json" ] && python3 benchmarks/multi_gpu.py table "$out/scale.json" | tee "$out/scale.md"
exit $status
