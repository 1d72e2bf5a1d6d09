#!/usr/bin/env bash
# Fills a folder with what installs DeepSpeed, the peer of the GPU check, without a network:
# DeepSpeed's source (the sdist: its C++ ops, CPU-Adam among them, are built on the machine
# that runs it) and the wheels of its dependencies for one Python version, plus pip,
# setuptools and wheel to build the sdist with. Never torch, never a CUDA/nvidia package:
# the GPU machine's own torch is the one DeepSpeed must build against.
#
#   bash benchmarks/gpu_wheels.sh                       # .gpu-wheels, for Python 3.12
#   bash benchmarks/gpu_wheels.sh /tmp/wheels-311 3.11  # the same set for a local dry run
#
# The folder is git-ignored and travels to the GPU machine beside the working tree; there
# `benchmarks/gpu_check.sh` installs it with
#   python -m pip install --no-index --find-links .gpu-wheels --no-build-isolation deepspeed
# (DeepSpeed's setup.py imports torch, so it builds in the machine's environment).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.gpu-wheels}
PYVER=${2:-3.12}
DEEPSPEED=${DEEPSPEED_VERSION:-0.19.8}
PIP=${PIP:-python3 -m pip}
# DeepSpeed's requirements/requirements.txt less torch, with pydantic's own dependencies,
# pinned to what was tested; pip keeps what the machine has already (numpy, with its
# transformers). psutil is abi3 (one wheel for every CPython 3).
WHEELS=(numpy==2.2.6 hjson==3.1.0 msgpack==1.1.1 ninja==1.13.0 py-cpuinfo==9.0.0 psutil==7.0.0
    packaging==25.0 tqdm==4.67.1 einops==0.8.1 pydantic==2.11.7 pydantic-core==2.33.2
    annotated-types==0.7.0 typing-inspection==0.4.1 typing-extensions==4.14.1
    pip==25.1.1 setuptools==80.9.0 wheel==0.45.1)
mkdir -p "$DEST"
$PIP download --quiet --no-deps --no-binary :all: -d "$DEST" "deepspeed==$DEEPSPEED"
$PIP download --quiet --no-deps --only-binary=:all: --python-version "$PYVER" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 -d "$DEST" "${WHEELS[@]}"
# libaio's headers and library for DeepSpeed's async I/O (its NVMe offload), from the
# distribution's packages: the library needs only libc, so it loads on the GPU machine's
# distribution too; gpu_check.sh points the compiler and the loader at $DEST/libaio.
debs=$(mktemp -d)
if (cd "$debs" && apt-get download -q libaio-dev libaio1 >/dev/null 2>&1); then
    for deb in "$debs"/*.deb; do dpkg-deb -x "$deb" "$debs/root"; done
    mkdir -p "$DEST/libaio/include" "$DEST/libaio/lib"
    cp "$debs"/root/usr/include/libaio.h "$DEST/libaio/include/"
    cp -L "$debs"/root/usr/lib/*/libaio.so* "$DEST/libaio/lib/"  # files, not links
else
    echo "gpu_wheels: apt-get download libaio-dev libaio1 failed: DeepSpeed's NVMe offload will not build"
fi
rm -rf "$debs"
if ls "$DEST" | grep -Ei '^(torch|nvidia|triton)'; then
    echo "gpu_wheels: $DEST holds a torch/CUDA package; remove it (the GPU machine has its own)"
    exit 1
fi
du -sh "$DEST"
ls "$DEST"
