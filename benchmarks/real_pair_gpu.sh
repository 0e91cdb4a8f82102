#!/usr/bin/env bash
# Issue 24's field check on a GPU machine without network: the real pair (../shared/notes/real-pair.md) distilled at
# 4,096 new tokens with rollout.partial off (A) and on (B), configs/opd_qwen2.5_coder_0.5b_from_1.5b_4k.yaml.
# The machine keeps its files only while it is held, so everything lives in $RP (default /tmp/rp) and every long job
# runs in the background (setsid), outliving the call that started it; `status` shows the logs.
#   bash benchmarks/real_pair_gpu.sh receive        move DIR/*.part.* (DIR: $PARTS, default .xfer) into $RP
#   bash benchmarks/real_pair_gpu.sh join NAME SHA  join NAME.part.* into NAME.gguf, check its sha256, convert it to
#                                                   $RP/NAME-hf (bf16) in the background (needs the gguf package)
#   bash benchmarks/real_pair_gpu.sh eval | A | B   start the baseline MATH-500 eval (greedy, 4,096) / run A / run B,
#                                                   A and B once both models are converted (so either can be started
#                                                   with the last `join`), passing further KEY=VALUE overrides on,
#                                                   e.g. run.steps=20
#   bash benchmarks/real_pair_gpu.sh AB SECONDS     in the background: once both models are converted, A then B in the
#                                                   foreground of one job, A given A_SHARE percent (default 50) of the
#                                                   SECONDS left then, B the rest, each stopped (SIGTERM) at its share;
#                                                   further KEY=VALUE overrides go to both
#   bash benchmarks/real_pair_gpu.sh wave SECONDS   issues 51, 52 and 54 at 1,024 new tokens (the real-pair note's protocol),
#                                                   in the background, stopped at SECONDS: the students' MATH-500 at step
#                                                   0 (0.5B and Gemma 3 270M, `join gemma SHA` converts it; the sha256 is
#                                                   in ../shared/tools/gemma3_270m.sh) while the teacher converts, then
#                                                   W52A (top-16 only_stu, 40 steps, cold compile cache), W52B
#                                                   (objective.loss=full_reverse_kl, 40 steps, the cache warm: the second
#                                                   start) and X51 (Gemma 3 270M <- the 1.5B teacher, tokenizer cross,
#                                                   plain-text boxed template, WAVE_X51_STEPS steps, default 20), each
#                                                   with MATH-500 at its end; WAVE_EVAL0=0 skips the step-0
#                                                   evaluations, WAVE_EVAL=0 the runs' own, WAVE_W52_STEPS (40) sets
#                                                   W52A's and W52B's steps (a short budget: steps and memory only);
#                                                   WAVE_RUNS picks and orders the runs (default "W52A W52B X51"),
#                                                   among them S52S, S52H and S52F: the teacher served on loopback
#                                                   (`opd serve-teacher` on the same GPU), top-16 with answer=scores,
#                                                   top-16 with answer=hidden, full_reverse_kl (hidden), each
#                                                   WAVE_S52_STEPS (8) steps without an evaluation, and B52:
#                                                   benchmarks/teacher_bytes.py at E 1,536 and 2,560 (bytes-E.log);
#                                                   T53: the python tool (issue 53), WAVE_T53_STEPS (40) steps, with
#                                                   tools in its MATH-500 (and at step 0 with WAVE_T53_EVAL0=1)
#   bash benchmarks/real_pair_gpu.sh sandbox        the sandbox's probe on this host, and the boot's whole stderr
#   bash benchmarks/real_pair_gpu.sh status         the logs' tails and the GPU's use
#   bash benchmarks/real_pair_gpu.sh hold SECONDS   sleep, then status, and pack the logs and each run's metrics,
#                                                   config and evaluations into $OUT/rp.tgz (one file: what comes
#                                                   back from $OUT is at most 8 files, 2 folders down): send the next
#                                                   hold at once (the machine goes back after 30 s without a call,
#                                                   with everything here)
# NAME is student or teacher (the sha256 values are in ../shared/tools/real_pair.sh); DAPO-Math-17k is read from
# $DATA (default $PARTS/dapo-math-17k.parquet, copied into $RP on the first call that carries it).
set -uo pipefail
RP=${RP:-/tmp/rp}
PARTS=${PARTS:-.xfer}
mkdir -p "$RP"
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=160
opd=(python3 -c "import sys; from opd.cli import main; sys.argv[0] = 'opd'; sys.exit(main())")  # no install needed
background() {  # name, command...: run in a new session, log to $RP/name.log
    local name=$1
    shift
    echo "$*" >"$RP/$name.cmd"
    setsid nohup "$@" >"$RP/$name.log" 2>&1 </dev/null &
    echo "started $name: $*"
}
wait_for_models() { until [ -d "$RP/student-hf" ] && [ -d "$RP/teacher-hf" ]; do sleep 2; done; }
wait_for() { until [ -d "$RP/$1" ]; do sleep 2; done; }
serve_teacher() {  # once: `opd serve-teacher` of the teacher on this GPU at 127.0.0.1:8765, waited for (1: it died)
    pgrep -f "serve-teache[r]" >/dev/null || background serve "${opd[@]}" serve-teacher --model "$RP/teacher-hf" --device cuda
    until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8765/info', timeout=2)" 2>/dev/null; do
        pgrep -f "serve-teache[r]" >/dev/null || { echo "the teacher server exited: $(tail -n 1 "$RP/serve.log")"; return 1; }
        sleep 2
    done
    echo "teacher served from $(date +%s)"
}
run=(-c configs/opd_qwen2.5_coder_0.5b_from_1.5b_4k.yaml student.path="$RP/student-hf" teacher.path="$RP/teacher-hf"
    data.path="${DATA:-$RP/dapo-math-17k.parquet}" "eval.benchmarks=[math500]" run.out_dir="$RP/runs"
    run.eval_at_start=false rollout.batch_size=512)  # A and B differ in rollout.partial alone
case ${1:-status} in
    receive)
        for f in "$PARTS"/*.part.*; do [ -e "$f" ] && mv "$f" "$RP/"; done
        [ -f "$PARTS/dapo-math-17k.parquet" ] && cp "$PARTS/dapo-math-17k.parquet" "$RP/"
        echo "$(ls "$RP" | grep -c '\.part\.') parts in $RP: $(ls "$RP" | tr '\n' ' ' | cut -c1-400)" ;;
    join)
        name=$2 sha=$3
        cat $(ls "$RP/$name".part.* | sort) >"$RP/$name.gguf.tmp" || exit 1
        echo "$sha  $RP/$name.gguf.tmp" | sha256sum -c - || exit 1
        mv "$RP/$name.gguf.tmp" "$RP/$name.gguf" && rm "$RP/$name".part.*
        cat >"$RP/convert.py" <<'PY'
import os, sys, time
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
rp, name = sys.argv[1:3]
start, gguf, out = time.time(), f"{name}.gguf", os.path.join(rp, f"{name}-hf")
tokenizer = AutoTokenizer.from_pretrained(rp, gguf_file=gguf)
model = AutoModelForCausalLM.from_pretrained(rp, gguf_file=gguf, dtype=torch.float32)
config = model.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
bf16 = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
bf16.load_state_dict(model.state_dict())
bf16.save_pretrained(out + ".tmp")
tokenizer.save_pretrained(out + ".tmp")
os.replace(out + ".tmp", out)
print(f"wrote {out} in {time.time() - start:.0f} s")
PY
        background "convert-$name" python3 "$RP/convert.py" "$RP" "$name" ;;
    eval)
        background eval0 "${opd[@]}" eval --model "$RP/student-hf" --benchmarks math500 --n 1 --temperature 0 \
            --max-new-tokens 4096 --batch-size 512 --template boxed --out "$RP/eval0" ;;
    A | B)
        background "run-$1" bash "$0" run-fg "$@" ;;
    run-fg)  # A's or B's job: the run, once both models are there
        wait_for_models
        exec "${opd[@]}" distill "${run[@]}" rollout.partial=$([ "$2" = B ] && echo true || echo false) \
            run.name="opd-real-pair-4k-$2" "${@:3}" ;;
    AB)
        background chain bash "$0" chain-fg "${@:2}" ;;
    chain-fg)  # AB's job: A then B, each stopped at its share of the time left once the models are there
        end=$(($(date +%s) + $2))
        wait_for_models
        for r in A B; do
            percent=${A_SHARE:-50}
            [ $r = B ] && percent=100
            share=$(((end - $(date +%s)) * percent / 100))
            echo "run $r from $(date +%s) for $share s"
            timeout -s TERM "$share" bash "$0" run-fg $r run.save_every=100 run.eval_every=100 "${@:3}" \
                >"$RP/run-$r.log" 2>&1  # run-fg execs the run, so the signal reaches it
            status=$?
            echo "run $r ended at $(date +%s): exit status $status (124: stopped at its share)"
        done ;;
    wave)
        background wave bash "$0" wave-fg "${@:2}" ;;
    wave-fg)  # wave's job: every step stopped (SIGTERM) at the end time
        end=$(($(date +%s) + $2)) WAVE_EVAL=${WAVE_EVAL:-1}
        left() { echo $((end - $(date +%s))); }
        short=(rollout.partial=false rollout.max_new_tokens=1024 eval.max_new_tokens=1024 run.save_every=100)
        evalk=(--benchmarks math500 --n 1 --temperature 0 --max-new-tokens 1024 --batch-size 512 --template boxed)
        if [ "${WAVE_EVAL0:-1}" = 1 ]; then
            wait_for student-hf
            echo "eval0 student from $(date +%s)"
            timeout -s TERM "$(left)" "${opd[@]}" eval --model "$RP/student-hf" "${evalk[@]}" \
                --out "$RP/eval0-student" >"$RP/eval0-student.log" 2>&1
            wait_for gemma-hf
            echo "eval0 gemma from $(date +%s)"
            timeout -s TERM "$(left)" "${opd[@]}" eval --model "$RP/gemma-hf" "${evalk[@]}" --out "$RP/eval0-gemma" \
                >"$RP/eval0-gemma.log" 2>&1
        fi
        wait_for_models
        case " ${WAVE_RUNS:-X51} " in *" X51 "*) wait_for gemma-hf ;; esac
        steps=${WAVE_W52_STEPS:-40} xsteps=${WAVE_X51_STEPS:-20} noeval=()
        [ "$WAVE_EVAL" = 0 ] && noeval=("eval.benchmarks=[]")
        for r in ${WAVE_RUNS:-W52A W52B X51}; do
            if [ "$r" = B52 ]; then  # the teacher-answer bytes and throughput at the real pair's and the paper's shapes
                for e in 1536 2560; do
                    timeout -s TERM "$(left)" python3 benchmarks/teacher_bytes.py --vocab 151936 --hidden $e \
                        --device cuda --dtype bfloat16 --batch 16 --prompt-len 128 --response-len 1024 \
                        >"$RP/bytes-$e.log" 2>&1
                done
                continue
            fi
            case $r in
                W52A)  # WAVE_W52A_STEPS and WAVE_W52A_EVAL=0: a shorter top-16 run for its step time and memory alone
                    extra=(run.name=w52-topk16 run.steps=${WAVE_W52A_STEPS:-$steps} run.eval_every=0)
                    [ "${WAVE_W52A_EVAL:-1}" = 0 ] && extra+=("eval.benchmarks=[]") ;;
                W52B) extra=(run.name=w52-full-rkl objective.loss=full_reverse_kl run.steps=$steps
                    run.eval_every=$((steps * WAVE_EVAL))) ;;
                X51) extra=(student.path="$RP/gemma-hf" teacher.tokenizer=cross run.name=x51-gemma-cross
                    run.steps=$xsteps run.eval_every=$((xsteps * WAVE_EVAL))) ;;
                S52S | S52H | S52F)  # the teacher served on loopback (started once, on the same GPU), no evaluation
                    serve_teacher || continue
                    answer=$([ $r = S52S ] && echo scores || echo hidden)
                    extra=(teacher.path=null teacher.url=http://127.0.0.1:8765 teacher.answer=$answer
                        run.name=s52-served-${answer}$([ $r = S52F ] && echo -full-rkl)
                        run.steps=${WAVE_S52_STEPS:-8} run.eval_every=100 "eval.benchmarks=[]")
                    [ $r = S52F ] && extra+=(objective.loss=full_reverse_kl) ;;
                T53)  # issue 53: episodes with the sandboxed python tool, evaluated with it (WAVE_T53_EVAL0=1: at step 0 too)
                    # WAVE_T53_TEMPLATE: data.template of the run and its evaluations, WAVE_T53_FORMAT its
                    # rollout.tool_format. Under the boxed instruction and hermes the 0.5B student called the tool in
                    # 4 % of episodes at step 1 and never by step 4 (H100, 2026-12-07); it writes ```python blocks when
                    # asked to run code (docs/agents.md), hence the defaults
                    t53_template='custom:{problem} Write Python code and run it with the python tool to compute the answer, then put your final answer within \boxed{}.'
                    extra=(run.name=t53-tools-python rollout.tools=python rollout.max_turns=4
                        "data.template=${WAVE_T53_TEMPLATE:-$t53_template}"
                        "rollout.tool_format=${WAVE_T53_FORMAT:-markdown}"
                        run.steps=${WAVE_T53_STEPS:-40} run.eval_every=$((${WAVE_T53_STEPS:-40} * WAVE_EVAL))
                        run.eval_at_start=$([ "${WAVE_T53_EVAL0:-0}" = 1 ] && echo true || echo false)) ;;
            esac
            echo "run $r from $(date +%s) for $(left) s"
            timeout -s TERM "$(left)" "${opd[@]}" distill "${run[@]}" "${short[@]}" "${extra[@]}" "${noeval[@]}" "${@:3}" \
                >"$RP/run-$r.log" 2>&1
            echo "run $r ended at $(date +%s): exit status $? (124: stopped at the end time)"
        done
        pkill -f "serve-teacher" || true ;;
    sandbox)  # why the namespaces sandbox starts or not on this host: the probe, then the boot's whole stderr
        # first, what every verb imports that the GPU image may lack (carried in .whl: benchmarks/README.md)
        python3 -c "import pydantic, gguf, starlette, uvicorn, anyio; print('imports: pydantic, gguf, starlette, uvicorn, anyio')"
        id; uname -r; cat /proc/sys/user/max_user_namespaces 2>&1; which unshare setpriv mount pivot_root
        for d in / /usr /tmp /proc /dev "$(python3 -c 'import sys; print(sys.prefix)')" "$PWD"; do
            findmnt -no TARGET,FSTYPE,OPTIONS -T "$d" | cut -c1-200
        done
        awk '$5 ~ "^/proc/"' /proc/self/mountinfo | head -20  # a masked /proc makes a new proc mount fail
        python3 - <<'PY'
import sys, tempfile
from opd.tools.sandbox import Sandbox, SandboxLimits, probe
print(probe())
with tempfile.TemporaryDirectory() as work:
    r = Sandbox(mode="namespaces", limits=SandboxLimits(cpu_seconds=10, wall_seconds=30)).run_python("print(1)", work)
    print("exit", r.exit_code, r.killed, "stdout", r.stdout[-400:], "stderr", r.stderr[-2000:], sep="\n")
print(sys.prefix, sys.base_prefix)
PY
        ;;
    status)
        for f in "$RP"/*.log; do [ -e "$f" ] && { echo "== $f"; tail -c 1200 "$f"; echo; }; done
        nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv 2>/dev/null || true ;;
    hold)  # returns early once a started wave has ended (the machine then goes back after its idle release)
        for ((waited = 0; waited < $2; waited += 5)); do
            sleep 5
            [ -f "$RP/wave.cmd" ] && ! pgrep -f "real_pair_gpu.sh wave-fg" >/dev/null && break
        done
        bash "$0" status | grep -v '\[__recompiles\]' | tail -c 2500
        mkdir -p "$OUT"
        (cd "$RP" && tar czf "$OUT/rp.tgz.tmp" $(ls -d *.log *.cmd runs/*/metrics.jsonl runs/*/config.yaml runs/*/eval \
            eval0 eval0-* 2>/dev/null) && mv "$OUT/rp.tgz.tmp" "$OUT/rp.tgz")
        true ;;
    *) echo "unknown verb $1 (receive, join, eval, A, B, AB, wave, sandbox, status, hold)"; exit 2 ;;
esac
