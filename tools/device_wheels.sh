#!/usr/bin/env bash
# Build .whl/ (repo root, git-ignored) with the wheels the GPU machine lacks, so that
# `pytest -m gpu`, the server tests and bench/e2e.py run there. That machine reaches no package
# registry; it has Python 3.12, torch 2.11, triton 3.6, numpy, numba, tokenizers 0.23.2,
# huggingface_hub 1.33.0, safetensors 0.8.0, jinja2, pillow, httpx, pytest, einops, click, typer,
# pyyaml and transformers 5.17 (the wrong version): /work/.library/device/KINDS.md.
#
# Install them there (every fresh machine), from the repo root:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# Usage here: tools/device_wheels.sh [--with-av]
#   --with-av also fetches PyAV (~36 MB: only the video tests need it, and they skip without
#   it). The working tree that travels to the GPU machine is limited to 64 MiB in all.
#
# --no-deps on both sides: every dependency the device lacks, or may hold too old, is pinned
# below to the version the tests pass with here (the transformers wheel's own needs -
# huggingface_hub >= 1.31, tokenizers < 0.24, safetensors >= 0.8 - are met there as it is).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=.whl

wheels=(
    transformers==5.23.0     # the numerical oracle (tests/oracle.py)
    regex==2026.11.19        # transformers needs >= 2025.10.22
    fla-core==0.6.0          # module `fla`: the KDA reference kernels of bench/kernels.py
    starlette==1.10.0        # the server
    uvicorn==0.54.0
    anyio==4.16.0            # starlette, openai (>= 4.10)
    h11==0.16.0              # uvicorn, httpcore2 (>= 0.16)
    openai==3.57.0           # the server tests' client
    httpx2==2.16.2           # openai's HTTP client
    httpcore2==2.16.2
    truststore==0.10.5
    idna==3.20               # httpx2 needs >= 3.18
    jiter==0.19.0
    sniffio==1.3.1
    pydantic==2.14.4
    pydantic_core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing_extensions==4.16.0  # pydantic needs >= 4.16
)
if [[ "${1:-}" == "--with-av" ]]; then
    wheels+=(av==18.1.0)
elif [[ $# -gt 0 ]]; then
    echo "usage: $0 [--with-av]" >&2
    exit 2
fi

rm -rf "$OUT"
mkdir -p "$OUT"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$OUT" "${wheels[@]}"

ls -l "$OUT"
total=$(du -cb "$OUT"/*.whl | tail -1 | cut -f1)
echo "$(ls "$OUT"/*.whl | wc -l) wheels, $((total / 1000000)) MB in $OUT"
if (( total > 40000000 )); then
    echo "warning: over 40 MB; the whole tree sent to the GPU machine must stay under 64 MiB" >&2
fi
