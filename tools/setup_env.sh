#!/usr/bin/env bash
# Create (or reuse) .venv and install the backend with its dev extras.
# torch is installed first and pinned: an unpinned torch, or a package that asks for a newer
# one, pulls a multi-GB CUDA build. Everything after it is installed with the pin as a constraint.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
EXTRAS="${EXTRAS:-dev}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
want="${TORCH_PIN#torch==}"
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '${want%%+*}')" 2>/dev/null; then
  "$VENV/bin/python" -m pip install -q "$TORCH_PIN"
fi
constraints="$(mktemp)"
echo "$TORCH_PIN" > "$constraints"
"$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[$EXTRAS]"
rm -f "$constraints"
