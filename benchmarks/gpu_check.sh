#!/usr/bin/env bash
# The GPU check, in one command on a bare machine with one CUDA GPU and no network:
#   1. the machine (GPU, CPU, RAM, disk) and the torch it has;
#   2. Infinity installed from this working tree, its C++ extensions built there;
#   3. the suite's CUDA tests (those that skip without CUDA);
#   4. `infinity bench aio` on the local disk (the estimate's disk rates);
#   5. benchmarks/gpu_smoke.py: the tiny model on both tiers against plain PyTorch, the 1B
#      with both tiers on NVMe against the CPU device, NVMe bytes against the estimate;
#   6. benchmarks/gpu_throughput.py: a 1B full fine-tune in bf16 (state in RAM; both tiers on
#      NVMe), a 1B LoRA r=16 placed by the planner (the base in RAM, gathered on the GPU
#      once), a 1B with accumulation 8 placed by the planner (its gradient sums kept on the
#      GPU) and a 7B LoRA r=16 with the base on NVMe, telemetry beside the estimate, and a
#      torch.profiler trace of the 1B's second step (state in RAM);
#   7. a one-rank torchrun (NCCL) of the tiny model;
#   8. with the time left, the whole suite on the GPU (the "auto" device is CUDA there).
# Each phase has its own time limit so the whole fits GPU_CHECK_BUDGET_S (default 450 s).
# Everything goes to $OUT (default: a new temporary directory): gpu_check.log, aio.json,
# smoke.json, throughput.json, profile-llama-1b.json.gz, cuda_tests.xml, suite.xml, summary.json.
#
#   OUT=/tmp/out bash benchmarks/gpu_check.sh            # on the GPU machine
#   GPU_CHECK_DEVICE=cpu bash benchmarks/gpu_check.sh    # dry run on the CPU device
#
# GPU_CHECK_PHASES (e.g. "install,smoke") runs only the named phases; GPU_CHECK_SMOKE_CASES
# and GPU_CHECK_THROUGHPUT_CASES choose the cases; GPU_CHECK_BENCH_AIO names an earlier
# `bench aio --json` file to use instead of the aio phase's; GPU_CHECK_NVME is the swap
# directory (default /tmp/infinity-nvme), PYTHON the interpreter (default python3).
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
BUDGET_S=${GPU_CHECK_BUDGET_S:-450}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
PHASES=${GPU_CHECK_PHASES:-machine,install,cuda_tests,aio,smoke,throughput,torchrun,suite}
PY=${PYTHON:-python3}
NVME=${GPU_CHECK_NVME:-/tmp/infinity-nvme}
START=$(date +%s)
mkdir -p "$OUT" "$NVME"
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
export PYTHONUNBUFFERED=1 INFINITY_ACCELERATOR=$DEVICE PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A RC SECONDS_TAKEN

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
want() { [[ ",$PHASES," == *",$1,"* ]]; }

# phase NAME LIMIT_S COMMAND...: run COMMAND under min(LIMIT_S, time left), record rc and time.
phase() {
    local name=$1 limit=$2 t0
    shift 2
    want "$name" || return 0
    ((limit > $(left) - 5)) && limit=$(($(left) - 5))
    if ((limit < 10)); then
        echo "== $name: skipped, $(left) s of the budget left"
        RC[$name]=skipped
        return 0
    fi
    echo "== $name (limit ${limit} s, $(date -u +%H:%M:%S))"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c '"$@"' bash "$@"
    RC[$name]=$?
    SECONDS_TAKEN[$name]=$(($(date +%s) - t0))
    echo "== $name: rc ${RC[$name]} in ${SECONDS_TAKEN[$name]} s"
}

machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>/dev/null || echo "no nvidia-smi"
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
    free -g | head -2
    df -h "$NVME" /dev/shm | cat
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
}

install() {  # pip's editable install, else the extensions built in place (PYTHONPATH has .)
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . ||
        "$PY" setup.py -q build_ext --inplace
    "$PY" -c "import infinity._aio, infinity._cpu_adam; print('extensions built')"
}

torchrun_tiny() {
    local dir
    dir=$(mktemp -d -p "$NVME")
    "$PY" -c "import random; random.seed(0); w=['gather','release','nvme','adam']
open('$dir/c.txt','w').write(' '.join(random.choice(w) for _ in range(20000)))"
    mkdir -p "$dir/swap"
    "$PY" -m torch.distributed.run --nproc-per-node 1 -m infinity.cli.main train --model tiny \
        --data "$dir/c.txt" --byte-tokens --steps 3 --seq-len 64 --micro-batch 2 \
        --nvme "$dir/swap" --placement nvme --save-dir "$dir/run" --no-progress &&
        tail -1 "$dir/run/metrics.jsonl"
    local rc=$?
    rm -rf "$dir"
    return $rc
}
# Checkpoints go to a tmpfs when it has room: a 1B checkpoint is ~15-18 GB of disk time.
SCRATCH=$NVME
shm_free_g=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [[ -n "$shm_free_g" ]] && ((shm_free_g >= 48)); then SCRATCH=/dev/shm; fi

export -f machine install torchrun_tiny
export PY NVME
phase machine 30 machine
phase install 150 install
phase cuda_tests 120 "$PY" -m pytest -q -rs -p no:cacheprovider -k cuda tests/ \
    --junitxml="$OUT/cuda_tests.xml"
phase aio 60 "$PY" -m infinity.cli.main bench aio --path "$NVME" --size 2G \
    --block-size 1M,8M --queue-depth 32 --threads 1 --repeats 1 --json "$OUT/aio.json"
AIO_FILE=${GPU_CHECK_BENCH_AIO:-$OUT/aio.json}
AIO_FLAG=()
[[ -s "$AIO_FILE" ]] && AIO_FLAG=(--bench-aio "$AIO_FILE")
SMOKE_CASES=${GPU_CHECK_SMOKE_CASES:-tiny,1b}
[[ $DEVICE == cpu ]] && SMOKE_CASES=tiny
phase smoke 200 "$PY" benchmarks/gpu_smoke.py --device "$DEVICE" --nvme "$NVME" \
    --scratch "$SCRATCH" --cases "$SMOKE_CASES" "${AIO_FLAG[@]}" --json "$OUT/smoke.json"
THROUGHPUT=(--cases "${GPU_CHECK_THROUGHPUT_CASES:-1b-ram,1b-nvme,1b-lora-planned,1b-accum8-planned,7b-lora}" --steps 3
    --timeout "${GPU_CHECK_CASE_TIMEOUT:-110}" --profile-to "$OUT" --profile-cases 1b-ram)
[[ $DEVICE == cpu ]] && THROUGHPUT=(--cases tiny-ram,tiny-nvme,tiny-lora,tiny-lora-planned --seq-len 64
    --micro-batch 2 --steps 3 --timeout 60 --profile-to "$OUT" --profile-cases tiny-ram)
phase throughput "${GPU_CHECK_THROUGHPUT_S:-340}" "$PY" -m benchmarks.gpu_throughput --device "$DEVICE" --nvme "$NVME" \
    --scratch "$SCRATCH" "${THROUGHPUT[@]}" "${AIO_FLAG[@]}" --json "$OUT/throughput.json"

phase torchrun 60 torchrun_tiny
phase suite 900 "$PY" -m pytest -q -p no:cacheprovider -n 8 --timeout 120 tests/ \
    --junitxml="$OUT/suite.xml"

{
    echo "{"
    first=1
    for name in "${!RC[@]}"; do
        ((first)) || echo ","
        first=0
        printf '  "%s": {"rc": "%s", "seconds": "%s"}' "$name" "${RC[$name]}" \
            "${SECONDS_TAKEN[$name]:-0}"
    done
    printf '\n}\n'
} >"$OUT/summary.json"
echo "== gpu_check: $(($(date +%s) - START)) s; phases: $(tr -d '\n ' <"$OUT/summary.json")"
