#!/usr/bin/env bash
# vLLM beside opd's static engine on a GPU machine without network (issue 54): the CUDA build of vLLM 0.26.0 (the
# last release pinning torch==2.11.0; its kernels link libcudart.so.13, as the image's torch 2.11.0+cu130) and the
# dependencies the image lacks travel as one tar of wheels cut into parts (benchmarks/README.md, "vLLM on the GPU
# machine": the wheel list, what is left out and why).
#   bash benchmarks/vllm_gpu.sh download [DIR]        here (with network): the wheels below into DIR
#                                                     (default /work/vllm-gpu-wheels)
#   bash benchmarks/vllm_gpu.sh pack [WHEELS] [DEST]  here: tar WHEELS/*.whl (default
#                                                     /work/vllm-gpu-wheels), cut it into $SIZE parts (default 58m)
#                                                     vllm-wheels.tar.NN in DEST (default /tmp/vllm-gpu-parts), print
#                                                     the tar's sha256; send one part a call in $PARTS (default .xfer)
#   bash benchmarks/vllm_gpu.sh receive               move $PARTS/vllm-wheels.tar.* into $VW (default /tmp/v54)
#   bash benchmarks/vllm_gpu.sh join SHA              join the parts, check the sha256, unpack the wheels, then install
#   bash benchmarks/vllm_gpu.sh install               pip install --no-index --no-deps the wheels into $SITE (default
#                                                     /tmp/site, where real_pair_gpu.sh's pydantic and gguf go too),
#                                                     then check
#   bash benchmarks/vllm_gpu.sh check                 versions, `import vllm`, its CUDA kernels and flash-attention
#                                                     loaded against this torch, and vLLM's requirements not found
#   bash benchmarks/vllm_gpu.sh smoke                 a short side-by-side run at the 0.6B shape (its time on an H100
#                                                     unmeasured): both engines and scorers work before the long runs
#   bash benchmarks/vllm_gpu.sh bench NAME [ARGS]     in the background: vllm_side_by_side.py, NAME student (the real
#                                                     pair's student, $RP/student-hf, waited for), 1.7b (the qwen3-1.7b
#                                                     shape) or any other name with ARGS alone; ARGS go on (e.g.
#                                                     --batches 64); JSON and log in $VW/NAME.json, $VW/NAME.log
#   bash benchmarks/vllm_gpu.sh step STEPS [ARGS]     in the background: the real pair's whole step (run A of
#                                                     real_pair_gpu.sh: partial off) for STEPS steps with
#                                                     rollout.engine=static, then with rollout.engine=vllm, one
#                                                     process each; ARGS: more overrides for both
#   bash benchmarks/vllm_gpu.sh status | hold SECONDS the logs' tails; hold sleeps first, then packs the logs, JSON and
#                                                     the step runs' metrics into $OUT/v54.tgz (OUT default
#                                                     runs/benchmarks/v54; send the next call at
#                                                     once: the machine goes back after 30 s without one)
set -uo pipefail
VW=${VW:-/tmp/v54}
SITE=${SITE:-/tmp/site}
PARTS=${PARTS:-.xfer}
RP=${RP:-/tmp/rp}
mkdir -p "$VW"
# flashinfer is not carried (vLLM uses FlashAttention on an H100; its sampler is off for opd's processed log-probs);
# no network: no usage reports, no hub
export PYTHONPATH=$SITE:$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 \
    VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
# every wheel that travels (104, 357,027,797 bytes): vLLM and what it imports that the image lacks (the list, what is
# left out and why: benchmarks/README.md)
WHEELS=(
    agent_detector==2.0.0 aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated_doc==0.0.7
    annotated_types==0.8.0 anthropic==2.17.0 anyio==4.16.0 astor==0.8.1 attrs==26.1.0 blake3==1.0.11
    cachetools==8.0.3 cbor2==6.3.0 cffi==2.1.1 click==8.5.1 cloudpickle==3.1.3 compressed_tensors==0.17.0
    cryptography==51.0.1 depyf==0.20.0 detect_installer==0.2.1 dill==0.4.1 dnspython==2.9.2
    docstring_parser==0.18.0 einops==0.8.2 email_validator==2.4.0 fastapi==0.136.3 fastapi_cli==0.0.34
    fastapi_cloud_cli==0.28.0 fastar==0.12.0 frozenlist==1.8.0 h11==0.16.0 httpcore==1.0.9 httpcore2==2.17.0
    httptools==0.9.0 httpx==0.29.0 httpx2==2.17.0 idna==3.21 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0
    jmespath==1.1.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 lark==1.2.2 llguidance==1.7.6
    lm_format_enforcer==0.11.3 loguru==0.8.0 markdown_it_py==4.3.0 mcp==2.3.0 mcp_types==2.3.0 mdurl==0.1.2
    model_hosting_container_standards==0.1.16 msgspec==0.23.0 multidict==7.2.1 ninja==1.13.2 openai==3.63.0
    openai_harmony==0.0.8 opentelemetry_api==1.45.2 outlines_core==0.2.14 partial_json_parser==0.2.1.1.post7
    pillow==13.0.0 prometheus_client==0.26.0 prometheus_fastapi_instrumentator==8.1.0 propcache==0.5.4
    protobuf==6.33.6 py_cpuinfo==9.0.0 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5
    pydantic_settings==2.16.3 pygments==2.21.0 pyjwt==2.15.1 python_dotenv==1.2.4 python_json_logger==4.2.0
    python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rich==15.0.0 rich_toolkit==0.20.6 rignore==0.8.1
    rpds_py==2026.9.1 sentencepiece==0.2.3 sentry_sdk==3.0.1 setproctitle==1.3.8 shellingham==1.5.4 six==1.17.0
    sniffio==1.3.1 sse_starlette==3.7.1 starlette==1.10.0 supervisor==4.3.0 tabulate==0.10.0 tiktoken==0.14.0
    truststore==0.10.5 typer==0.29.3 typing_extensions==4.16.0 typing_inspection==0.4.5 uvicorn==0.55.0
    uvloop==0.23.0 vllm==0.26.0 watchfiles==1.3.0 websockets==17.4 xgrammar==0.2.7 yarl==1.25.1
)
background() {  # name, command...: run in a new session, log to $VW/name.log
    local name=$1
    shift
    echo "$*" >"$VW/$name.cmd"
    setsid nohup "$@" >"$VW/$name.log" 2>&1 </dev/null &
    echo "started $name: $*"
}
case ${1:-status} in
    download)  # here, with network: the wheels for Python 3.12 on x86-64 Linux into DIR (default /work/vllm-gpu-wheels)
        python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64 \
            --platform manylinux_2_26_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_31_x86_64 \
            -d "${2:-/work/vllm-gpu-wheels}" "${WHEELS[@]}" ;;
    pack)
        wheels=${2:-/work/vllm-gpu-wheels} dest=${3:-/tmp/vllm-gpu-parts}
        mkdir -p "$dest" && rm -f "$dest"/vllm-wheels.tar*
        # sorted names, no dates or owners: the same wheels give the same sha256
        (cd "$wheels" && tar cf "$dest/vllm-wheels.tar" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner \
            ./*.whl) || exit 1
        (cd "$dest" && split -b "${SIZE:-58m}" -d -a 2 vllm-wheels.tar vllm-wheels.tar. && sha256sum vllm-wheels.tar \
            && rm vllm-wheels.tar && ls -l vllm-wheels.tar.*) ;;
    receive)
        for f in "$PARTS"/vllm-wheels.tar.*; do [ -e "$f" ] && mv "$f" "$VW/"; done
        echo "$(ls "$VW" | grep -c '^vllm-wheels\.tar\.') parts in $VW" ;;
    join)
        cat $(ls "$VW"/vllm-wheels.tar.* | sort) >"$VW/wheels.tar.tmp" || exit 1
        echo "$2  $VW/wheels.tar.tmp" | sha256sum -c - || exit 1
        mkdir -p "$VW/wheels" && tar xf "$VW/wheels.tar.tmp" -C "$VW/wheels" && rm "$VW/wheels.tar.tmp" \
            "$VW"/vllm-wheels.tar.* && bash "$0" install ;;
    install)
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$VW"/wheels/*.whl \
            && bash "$0" check ;;
    check)
        python3 - <<'PY'
import importlib.metadata as md, sys, time
start = time.time()
import torch
import vllm
from vllm.platforms import current_platform
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__} "
      f"from {vllm.__file__}, platform {type(current_platform).__name__}, import {time.time() - start:.1f} s")
import vllm._custom_ops  # noqa: F401  the kernels (libcudart.so.13, this torch's ABI)
from vllm.vllm_flash_attn import flash_attn_varlen_func  # noqa: F401
from vllm import LLM, SamplingParams  # noqa: F401
print("kernels and flash-attention load; LLM imports")
left_out = {"torchaudio", "torchvision", "torchcodec", "pynvvideocodec", "flashinfer-python", "apache-tvm-ffi",
            "tilelang", "nvidia-cudnn-frontend", "nvtx", "fastsafetensors", "nvidia-cutlass-dsl", "quack-kernels",
            "tokenspeed-mla", "humming-kernels", "numba", "opencv-python-headless", "mistral-common",
            "opentelemetry-sdk", "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai"}
from packaging.requirements import Requirement
missing = []
for line in md.requires("vllm") or []:
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    name = requirement.name.lower().replace("_", "-")
    try:
        md.version(name)
    except md.PackageNotFoundError:
        if name not in left_out:
            missing.append(line)
print("vLLM requirements not found (beyond those left out on purpose):", missing or "none")
PY
        ;;
    smoke)
        python3 benchmarks/vllm_side_by_side.py --shape qwen3-0.6b --batches 16 --prompt-len 64 --new-tokens 128 \
            --lengths equal,lognormal:mean=96,cap=256 --score-batch 8 --score-response-len 256 --repeat 1 \
            --out "$VW/smoke.json" "${@:2}" ;;
    bench)
        background "$2" bash "$0" bench-fg "${@:2}" ;;
    bench-fg)
        name=$2 model=()
        case $name in
            student) until [ -d "$RP/student-hf" ]; do sleep 2; done; model=(--model-path "$RP/student-hf") ;;
            1.7b) model=(--shape qwen3-1.7b) ;;
        esac
        exec python3 benchmarks/vllm_side_by_side.py "${model[@]}" --out "$VW/$name.json" "${@:3}" ;;
    step)
        background step bash "$0" step-fg "${@:2}" ;;
    step-fg)  # one opd distill process per engine, back to back (real_pair_gpu.sh run-fg waits for both models)
        for engine in static vllm; do
            echo "step $engine from $(date +%s)"
            RP=$RP bash benchmarks/real_pair_gpu.sh run-fg A rollout.engine=$engine run.name=v54-step-$engine \
                run.steps="$2" run.save_every=100 run.eval_every=100 "eval.benchmarks=[]" "${@:3}" \
                >"$VW/step-$engine.log" 2>&1
            echo "step $engine ended at $(date +%s): exit status $?"
        done ;;
    status)
        for f in "$VW"/*.log; do [ -e "$f" ] && { echo "== $f"; tail -c 1500 "$f"; echo; }; done
        nvidia-smi --query-gpu=name,memory.used,utilization.gpu --format=csv 2>/dev/null || true ;;
    hold)
        sleep "$2"
        bash "$0" status | tail -c 3000
        OUT=${OUT:-runs/benchmarks/v54}
        mkdir -p "$OUT"
        (tar czf "$OUT/v54.tgz.tmp" $(ls -d "$VW"/*.log "$VW"/*.cmd "$VW"/*.json "$RP"/runs/v54-step-*/metrics.jsonl \
            "$RP"/runs/v54-step-*/config.yaml 2>/dev/null) && mv "$OUT/v54.tgz.tmp" "$OUT/v54.tgz")
        true ;;
    *) echo "unknown verb $1 (download, pack, receive, join, install, check, smoke, bench, step, status, hold)"; exit 2 ;;
esac
