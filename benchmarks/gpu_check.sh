#!/usr/bin/env bash
# The GPU check, in one command on a bare machine with one CUDA GPU and no network. The
# table's rows come first, each beside `infinity estimate`; the checks that ran before on a
# GPU come last, with the time left:
#   machine        the GPU, CPU, RAM, disk and the torch it has;
#   ds_build       (in the background from the start) DeepSpeed installed from .gpu-wheels
#                  (benchmarks/gpu_wheels.sh fills it; no network), its CPU-Adam and async
#                  I/O built there: each "ready in N s" or "FAILED: <why>" (ds_build.log);
#   install        Infinity from this working tree, its C++ extensions built there;
#   aio            `infinity bench aio` on the local disk (the estimate's disk rates);
#   throughput     gpu_throughput.py: llama-1b full fine-tune, bf16, 4 x 2048, activation
#                  checkpointing, state in RAM (+ a torch.profiler trace of step 2);
#   deepspeed      gpu_deepspeed.py: the same 1B, shape and config through DeepSpeed ZeRO-3,
#                  parameters and optimizer state offloaded to the CPU;
#   throughput_big llama-13b LoRA r=16 placed by the planner (base resident on the GPU),
#                  llama-7b full fine-tune placed by the planner within 100 GiB of RAM;
#   throughput_nvme llama-1b with both tiers on NVMe (2 steps: ~50 GB of disk traffic each);
#   deepspeed_nvme the DeepSpeed 1B with both offloads on NVMe (2 steps);
#   cuda_tests, smoke (tiny model against plain PyTorch), torchrun (one rank, NCCL), suite.
# Each phase runs under its own limit, cut to the time left of GPU_CHECK_BUDGET_S (default
# 530 s). Everything goes to $OUT (default: a new temporary directory): gpu_check.log,
# plan.txt, ds_build.log, aio.json, throughput*.json, deepspeed*.json, profile-*.json.gz,
# cuda_tests.xml, smoke.json, suite.xml, summary.json.
#
# The call to make when a GPU is lent (fill .gpu-wheels first: bash benchmarks/gpu_wheels.sh):
#   run(command="OUT=$OUT GPU_CHECK_BUDGET_S=530 bash benchmarks/gpu_check.sh",
#       carry=[".gpu-wheels"], timeout_s=600)
# What it will run, phase by phase, without running it:
#   GPU_CHECK_LIST_ONLY=1 bash benchmarks/gpu_check.sh
# The dry run on the CPU device (tiny cases of every row; DeepSpeed from the wheel folder in
# its own environment, with DeepSpeed's CPU accelerator):
#   GPU_CHECK_DEVICE=cpu PYTHON=/path/to/venv/bin/python GPU_CHECK_DS_PYTHON=/tmp/ds/bin/python \
#       GPU_CHECK_WHEELS=/tmp/wheels-311 bash benchmarks/gpu_check.sh
#
# GPU_CHECK_PHASES (e.g. "install,throughput") runs only the named phases; GPU_CHECK_LIMITS
# (e.g. "ds_build=900,deepspeed=600") sets phases' limits;
# GPU_CHECK_THROUGHPUT_CASES and GPU_CHECK_SMOKE_CASES choose those cases;
# GPU_CHECK_BENCH_AIO names an earlier `bench aio --json` file to use instead of the aio
# phase's; GPU_CHECK_NVME is the swap directory (default /tmp/infinity-nvme); PYTHON the
# interpreter (default python3); GPU_CHECK_DS_PYTHON the one DeepSpeed is installed into
# (default PYTHON); GPU_CHECK_WHEELS the wheel folder (default .gpu-wheels).
set -u
cd "$(dirname "$0")/.."
if [[ -n ${GPU_CHECK_LIST_ONLY:-} ]]; then OUT=${OUT:-'$OUT'}; else OUT=${OUT:-$(mktemp -d)}; fi
BUDGET_S=${GPU_CHECK_BUDGET_S:-530}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
ALL=machine,ds_build,install,aio,throughput,deepspeed,throughput_big,throughput_nvme
ALL+=,deepspeed_nvme,cuda_tests,smoke,torchrun,suite
PHASES=${GPU_CHECK_PHASES:-$ALL}
PY=${PYTHON:-python3}
DSPY=${GPU_CHECK_DS_PYTHON:-$PY}
WHEELS=$(realpath -m "${GPU_CHECK_WHEELS:-.gpu-wheels}")
NVME=${GPU_CHECK_NVME:-/tmp/infinity-nvme}
START=$(date +%s)
[[ -n ${GPU_CHECK_LIST_ONLY:-} ]] || mkdir -p "$OUT" "$NVME"
export PYTHONUNBUFFERED=1 INFINITY_ACCELERATOR=$DEVICE PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
declare -A RC SECONDS_TAKEN BG_PID BG_T0
NAMES=() LIMITS=() CMDS=()

# add NAME LIMIT_S COMMAND: one phase of the plan (COMMAND is a bash string); a NAME=S in
# GPU_CHECK_LIMITS replaces LIMIT_S (a dry run on a slow machine builds for minutes).
add() {
    [[ ",$PHASES," == *",$1,"* ]] || return 0
    local limit=$2 override=",${GPU_CHECK_LIMITS:-},"
    [[ $override == *",$1="* ]] && limit=${override#*,"$1"=} && limit=${limit%%,*}
    NAMES+=("$1") LIMITS+=("$limit") CMDS+=("$3")
}

# plan DEVICE: the phases, their limits and their commands for that device.
plan() {
    local dev=$1 tp=(--device "$1" --nvme "$NVME" --scratch "$SCRATCH" --steps 3 @AIO@)
    local ds=("$DSPY" benchmarks/gpu_deepspeed.py --device "$dev")
    local rows=${GPU_CHECK_THROUGHPUT_CASES:-1b-ram} big=13b-lora-resident,7b-full nv=1b-nvme
    local smoke=${GPU_CHECK_SMOKE_CASES:-tiny}
    if [[ $dev == cpu ]]; then  # the same phases on tiny cases of each row's kind
        rows=tiny-ram big=tiny-lora-planned,tiny-planned nv=tiny-nvme smoke=tiny
        tp+=(--seq-len 64 --micro-batch 2 --timeout 90)
        ds+=(--model tiny --seq-len 64 --micro-batch 2)
    else
        ds+=(--model llama-1b)
    fi
    NAMES=() LIMITS=() CMDS=()
    add machine 30 machine
    add ds_build 240 "ds_build $dev"
    add install 120 install
    add aio 40 "$PY -m infinity.cli.main bench aio --path $NVME --size 2G --block-size 8M \
--queue-depth 32 --threads 1 --repeats 1 --json $OUT/aio.json"
    add throughput 110 "$PY -m benchmarks.gpu_throughput ${tp[*]} --cases $rows \
--profile-to $OUT --profile-cases ${rows%%,*} --json $OUT/throughput.json"
    add deepspeed 110 "ds_env ${ds[*]} --steps 3 --offload cpu --json $OUT/deepspeed.json"
    add throughput_big 260 "$PY -m benchmarks.gpu_throughput ${tp[*]} --cases $big \
--json $OUT/throughput_big.json"
    add throughput_nvme 120 "$PY -m benchmarks.gpu_throughput ${tp[*]} --cases $nv \
--json $OUT/throughput_nvme.json"
    add deepspeed_nvme 100 "ds_env ${ds[*]} --steps 2 --offload nvme --nvme $NVME \
--json $OUT/deepspeed_nvme.json"
    add cuda_tests 60 "$PY -m pytest -q -rs -p no:cacheprovider -k cuda tests/ \
--junitxml=$OUT/cuda_tests.xml"
    add smoke 90 "$PY benchmarks/gpu_smoke.py --device $dev --nvme $NVME --scratch $SCRATCH \
--cases $smoke @AIO@ --json $OUT/smoke.json"
    add torchrun 40 torchrun_tiny
    add suite 900 "$PY -m pytest -q -p no:cacheprovider -n 8 --timeout 120 tests/ \
--junitxml=$OUT/suite.xml"
}

print_plan() {  # what a run on DEVICE will run, in order, with each phase's limit
    echo "== the plan on the $1 device (budget $BUDGET_S s; ds_build runs beside the phases up to throughput)"
    for i in "${!NAMES[@]}"; do
        printf '  %-16s %4s s  %s\n' "${NAMES[$i]}" "${LIMITS[$i]}" "${CMDS[$i]//@AIO@/[--bench-aio $AIO_FILE]}"
    done
}

left() { echo $((BUDGET_S - ($(date +%s) - START))); }

# phase NAME LIMIT_S COMMAND: run COMMAND under min(LIMIT_S, time left), record rc and time.
phase() {
    local name=$1 limit=$2 t0
    ((limit > $(left) - 5)) && limit=$(($(left) - 5))
    if ((limit < 10)); then
        echo "== $name: skipped, $(left) s of the budget left"
        RC[$name]=skipped
        return 0
    fi
    echo "== $name (limit ${limit} s, $(date -u +%H:%M:%S)): $3"
    t0=$(date +%s)
    timeout --kill-after=10 "$limit" bash -c "$3"
    RC[$name]=$?
    SECONDS_TAKEN[$name]=$(($(date +%s) - t0))
    echo "== $name: rc ${RC[$name]} in ${SECONDS_TAKEN[$name]} s"
}

# The DeepSpeed build runs beside the first phases (compilers and the disk bench, not the
# timed rows); `join` waits for it before the first timed row.
start_bg() {
    echo "== $1 started in the background (limit $2 s, $(date -u +%H:%M:%S)): $3"
    BG_T0[$1]=$(date +%s)
    timeout --kill-after=10 "$2" bash -c "$3" >"$OUT/$1.log" 2>&1 &
    BG_PID[$1]=$!
}
join() {
    [[ -n ${BG_PID[$1]:-} ]] || return 0
    wait "${BG_PID[$1]}"
    RC[$1]=$?
    SECONDS_TAKEN[$1]=$(($(date +%s) - BG_T0[$1]))
    unset "BG_PID[$1]"
    grep -E "^(deepspeed op|ds_build|Successfully|ERROR)" "$OUT/$1.log" | sed 's/^/  /'
    echo "== $1: rc ${RC[$1]} in ${SECONDS_TAKEN[$1]} s (log: $OUT/$1.log)"
}

machine() {
    nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
        --format=csv 2>/dev/null || echo "no nvidia-smi"
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-200
    free -g | head -2
    df -h "$NVME" /dev/shm | cat
    "$PY" -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
    command -v g++ ninja nvcc || true
}

install() {  # pip's editable install, else the extensions built in place (PYTHONPATH has .)
    "$PY" -m pip install --no-deps --no-build-isolation --no-index -q -e . ||
        "$PY" setup.py -q build_ext --inplace
    "$PY" -c "import infinity._aio, infinity._cpu_adam; print('extensions built')"
}

# ds_env COMMAND...: COMMAND with what DeepSpeed's JIT builds need: the interpreter's scripts
# folder on PATH (ninja), one extensions folder for the build and the runs, DeepSpeed's
# accelerator, and the carried libaio (headers and library) for its async I/O.
ds_env() {
    local scripts aio=$WHEELS/libaio
    scripts=$("$DSPY" -c "import sysconfig; print(sysconfig.get_path('scripts'))")
    export PATH=$scripts:$PATH TORCH_EXTENSIONS_DIR=$NVME/ds-extensions DS_ACCELERATOR=$DEVICE
    export MAX_JOBS=$(nproc)
    if [[ -d $aio ]]; then
        export CPATH=$aio/include${CPATH:+:$CPATH} LIBRARY_PATH=$aio/lib${LIBRARY_PATH:+:$LIBRARY_PATH}
        export CFLAGS="-I$aio/include" LDFLAGS="-L$aio/lib" LD_LIBRARY_PATH=$aio/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    fi
    "$@"
}

# ds_build DEVICE: DeepSpeed from the wheel folder into DSPY's environment (pip run from its
# carried wheel: the machine's environment may have none), then its ops built.
ds_build() {
    local pip
    pip=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | head -1)
    [[ -n $pip ]] || { echo "ds_build: FAILED: no pip wheel in $WHEELS; run benchmarks/gpu_wheels.sh"; return 1; }
    # DeepSpeed's setup.py imports torch: it builds in this environment, with its setuptools.
    "$DSPY" -c "import setuptools" 2>/dev/null ||
        "$DSPY" "$pip/pip" install --no-index --find-links "$WHEELS" -q setuptools wheel
    "$DSPY" "$pip/pip" install --no-index --find-links "$WHEELS" --no-build-isolation -q \
        deepspeed || { echo "ds_build: FAILED: pip install deepspeed from $WHEELS (above)"; return 1; }
    "$DSPY" -c "import deepspeed; print('ds_build: deepspeed', deepspeed.__version__)"
    ds_env "$DSPY" benchmarks/gpu_deepspeed.py --device "$1" --offload nvme --nvme "$NVME" \
        --build-only --json "$OUT/ds_build.json"
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
# The runs are stopped before their final checkpoint, but `infinity train` checks the room
# for it first: the 7B full row needs 94 GB there (the GPU machine's /dev/shm has 128 GiB).
SCRATCH=$NVME
shm_free_g=$(df -BG --output=avail /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
if [[ -n "$shm_free_g" ]] && ((shm_free_g >= 48)); then SCRATCH=/dev/shm; fi
# The estimate's disk rates: the aio phase's, once it has run (or an earlier file).
AIO_FILE=${GPU_CHECK_BENCH_AIO:-$OUT/aio.json}
if [[ -n ${GPU_CHECK_LIST_ONLY:-} ]]; then
    plan "$DEVICE"
    print_plan "$DEVICE"
    exit 0
fi
exec > >(tee -a "$OUT/gpu_check.log") 2>&1
if [[ $DEVICE == cpu ]]; then  # the dry run says what the GPU run will run, with its defaults
    (
        GPU_CHECK_LIMITS= GPU_CHECK_PHASES= PHASES=$ALL BUDGET_S=530 PY=python3 DSPY=python3
        NVME=/tmp/infinity-nvme OUT='$OUT' SCRATCH='$SCRATCH' AIO_FILE='$OUT/aio.json'
        plan cuda
        print_plan cuda
    ) | tee "$OUT/plan_cuda.txt"
fi
plan "$DEVICE"
print_plan "$DEVICE" | tee "$OUT/plan.txt"
export -f machine install torchrun_tiny ds_env ds_build
export PY DSPY NVME OUT WHEELS DEVICE SCRATCH
for i in "${!NAMES[@]}"; do
    name=${NAMES[$i]}
    case $name in
    ds_build) start_bg ds_build "${LIMITS[$i]}" "${CMDS[$i]}" && continue ;;
    throughput* | deepspeed*) join ds_build ;;
    esac
    aio_flag=
    [[ -s "$AIO_FILE" ]] && aio_flag="--bench-aio $AIO_FILE"
    phase "$name" "${LIMITS[$i]}" "${CMDS[$i]//@AIO@/$aio_flag}"
done
join ds_build

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
