#!/usr/bin/env bash
# Wheels for the GPU window (tools/gpu_campaign.py): the packages the project needs that the
# lent H100 machine lacks, for ITS interpreter (CPython 3.12, x86-64, glibc manylinux), into
# build/gpu_wheels/ (ignored by git; `build/` is in .gitignore), and their size.
#
#   bash tools/gpu_wheels.sh [--with-pyarrow] [DIR]
#
# That machine has no package index, Python 3.12 and torch 2.11 (CUDA 13), and already holds
# transformers 5.17, tokenizers 0.23, safetensors, pyyaml, numpy, pandas, pyarrow, fsspec,
# huggingface-hub, xxhash, psutil, pytest and hypothesis (/work/.library/device/KINDS.md).
# So it gets only what is missing, at the versions this project is tested with on CPU:
# - megatron-core 0.16.1: the CPU stack's pin; its cp312 wheel needs torch>=2.6 (2.11 is
#   fine). It is a platform wheel (a small C++ dataset helper), hence --python-version 3.12
#   and the manylinux platforms. 0.17-0.19 also have cp312 wheels but are untested here.
# - datasets 5.2.0 (the prompt loader) with dill and multiprocess (pins of datasets), and
#   fsspec 2026.9.0 (datasets refuses newer; the image's fsspec version is unknown).
# - math-verify, latex2sympy2_extended, antlr4 runtime: the `math` reward's default backend
#   (the tiny recipes use `fast`, so only a run with the default needs them).
# --with-pyarrow adds pyarrow 26.0.1 (~45 MB) for an image whose pyarrow is older than
# datasets' >=24 (the campaign's `env` part reports the image's version).
#
# A call of the device tool then carries DIR and installs it first:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site build/gpu_wheels/*.whl && export PYTHONPATH=/tmp/site
# Everything carried in one call (working tree + wheels) must stay under 64 MiB.
set -euo pipefail

with_pyarrow=0
if [[ "${1:-}" == "--with-pyarrow" ]]; then
    with_pyarrow=1
    shift
fi
dir="${1:-build/gpu_wheels}"
py="${PYTHON:-python3}"
if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; fi

packages=(
    megatron-core==0.16.1
    datasets==5.2.0
    dill==0.4.1
    multiprocess==0.70.19
    fsspec==2026.9.0
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2
)
if [[ $with_pyarrow == 1 ]]; then packages+=(pyarrow==26.0.1); fi

mkdir -p "$dir"
# --only-binary with an explicit interpreter and platform: pip picks the wheels that machine
# can install, never this machine's (Python 3.11 here). antlr4's runtime ships only an sdist
# on some indexes; `pip wheel` below builds it (pure Python) when download finds no wheel.
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)
for pkg in "${packages[@]}"; do
    if ! "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]/#/--platform=}" -d "$dir" "$pkg" 2>/dev/null; then
        echo "gpu_wheels: no cp312 wheel of $pkg on the index: building a pure-Python one"
        "$py" -m pip wheel -q --no-deps -w "$dir" "$pkg"
    fi
done
# One version of each package: two stop the whole install there.
dupes=$(ls "$dir"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z-' 'a-z_' | sort | uniq -d)
if [[ -n "$dupes" ]]; then
    echo "gpu_wheels: $dir holds two versions of: $dupes (remove the older)" >&2
    exit 1
fi
ls -1 "$dir"
size=$(du -sm "$dir" | cut -f1)
echo "gpu_wheels: $dir: $(ls "$dir"/*.whl | wc -l) wheels, ${size} MiB (a device call carries at most 64 MiB, working tree included)"
