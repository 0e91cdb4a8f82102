#!/usr/bin/env bash
# The GPU measurement of docs/performance.md in one call: the CUDA correctness checks, then every benchmark at the
# real shapes. Run from the repository root on the GPU machine; JSON and logs go to ${OUT:-runs/benchmarks/gpu}.
#   bash benchmarks/run_gpu.sh [check|attention|rollout|teacher|update|step|step_full|lean|paper|packing ...]
#   (default: all; the TRL rows of `step` need the wheels of benchmarks/README.md installed first)
#   bash benchmarks/run_gpu.sh determinism   (run.deterministic: a run and its resume bit for bit on the GPU, ~7 min)
#   bash benchmarks/run_gpu.sh server   (the served teacher; not in the default: needs starlette and uvicorn)
#   bash benchmarks/run_gpu.sh stream   (the partial-rollout stream with early stop, without and with segments, in one
#                                        process: issue 24; not in the default, ~9 minutes)
#   bash benchmarks/run_gpu.sh attention_ragged   (decode attention over rows of unequal lengths, by splits)
#   bash benchmarks/run_gpu.sh prefill   (the static engine's prefill of long continued samples, packed against
#                                         padded, with each layout's top CUDA kernels)
#   bash benchmarks/run_gpu.sh stream_packed, stream_padded, stream_compiled   (the stream with each prefill layout,
#                                         the last through the compiled layers: rollout.compiled_prefill; a call each)
set -uo pipefail
out=${OUT:-runs/benchmarks/gpu}
mkdir -p "$out"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
parts=${*:-check attention rollout teacher update step step_full lean paper packing}
status=0
run() {  # name, time limit (s), command...
    local name=$1 limit=$2
    shift 2
    echo "=== $name: $*"
    timeout "$limit" "$@" 2>&1 | grep -v -E "Warning|warnings.warn|^\s*$" | tee "$out/$name.log" || status=1
}
for part in $parts; do
    case $part in
        check) run check_cuda 200 python3 benchmarks/check_cuda.py --out "$out/check_cuda.json" ;;
        attention) run decode_attention 120 python3 benchmarks/decode_attention.py \
            --out "$out/decode_attention.json" ;;
        rollout) run rollout 240 python3 benchmarks/rollout.py --batches 64,256 --repeat 1 \
            --engines hf_generate,hf_generate_nocudnn,torch_engine,static_sdpa,static_compile \
            --engines-big static_sdpa,static_compile --out "$out/rollout.json" ;;
        teacher) run teacher_score 200 python3 benchmarks/teacher_score.py --shapes qwen3-1.7b,qwen3-4b \
            --torch-topk --repeat 5 --out "$out/teacher_score.json" ;;
        update) run update 130 python3 benchmarks/update.py --shape qwen3-0.6b --ckpt selective,on,off \
            --out "$out/update.json" ;;
        step) run opd_step 420 python3 benchmarks/opd_step.py --warmup 3 --repeat 3 --out "$out/opd_step.json" ;;
        step_full) run opd_step_full 150 python3 benchmarks/opd_step.py --warmup 3 --repeat 3 --ckpt on --skip-trl \
            --out "$out/opd_step_full.json" ;;
        lean) run opd_step_lean 240 python3 benchmarks/opd_step.py --warmup 2 --repeat 2 --skip-trl \
            --variants default,foreach,bf16_state,micro4k,lean,lean_offload,ckpt_on --out "$out/opd_step_lean.json" ;;
        paper) run opd_step_paper 300 python3 benchmarks/opd_step.py --paper --out "$out/opd_step_paper.json" ;;
        packing) run teacher_ragged 200 python3 benchmarks/teacher_score.py --shapes qwen3-1.7b --ragged \
                --attn sdpa,opd_varlen --compile on --out "$out/teacher_ragged.json"
            run update_ragged 200 python3 benchmarks/update.py --shape qwen3-0.6b --ragged --attn sdpa,opd_varlen \
                --compile on --ckpt selective --out "$out/update_ragged.json" ;;
        attention_ragged) run decode_attention_ragged 120 python3 benchmarks/decode_attention.py --rows 160,64 \
            --lengths ragged,1700 --ragged lognormal:mean=1700,cap=7168 --splits auto,1,2,4,8,16 \
            --out "$out/decode_attention_ragged.json" ;;
        stream) run rollout_stream 560 python3 benchmarks/rollout_stream.py --shape qwen3-0.6b --batches 256 \
            --lengths lognormal:mean=1500,cap=7168 --stream-steps 5 --repeat 1 --bucket-steps 0 --phase-times \
            --configs 2/on,2/on/2389 --out "$out/rollout_stream.json" ;;
        prefill) run prefill 300 python3 benchmarks/prefill.py --shape qwen3-0.6b --samples 64 \
            --prompt-lengths 128:7296 --profile --compiled --out "$out/prefill.json" ;;
        stream_packed | stream_padded | stream_compiled)  # a call each (~6 minutes): the same stream, its prefills
            # packed, padded, or packed through the compiled layers (rollout.compiled_prefill)
            engine=static_compile; [ "$part" = stream_packed ] && engine=static_packed
            [ "$part" = stream_compiled ] && engine=static_packed_compiled
            run "rollout_$part" 560 python3 benchmarks/rollout_stream.py --shape qwen3-0.6b --batches 256 \
                --lengths lognormal:mean=1500,cap=7168 --stream-steps 6 --repeat 1 --bucket-steps 0 --phase-times \
                --configs 2/on --engine "$engine" --out "$out/rollout_$part.json" ;;
        determinism) run check_deterministic 560 python3 benchmarks/check_cuda.py --only deterministic \
            --out "$out/check_deterministic.json" ;;
        server) run teacher_server 290 python3 benchmarks/teacher_server.py --shapes qwen3-1.7b,qwen3-4b \
            --clients 1,4 --warmup 1 --repeat 3 --out "$out/teacher_server.json" ;;
        *) echo "unknown part $part (check, determinism, attention, rollout, teacher, update, step, step_full, lean, paper, packing, attention_ragged, prefill, stream, stream_packed, stream_padded, stream_compiled, server)"
           exit 2 ;;
    esac
done
exit $status
