#!/usr/bin/env bash
# The GPU check, one command, under 8 minutes on one GPU:
#   bash tools/gpu_check.sh [OUT_DIR]
# 1. the GPU-only tests (flex backward on CUDA vs sdpa, a BF16 train step, te when it imports);
# 2. tools/bench_train.py on the GPU model (~250M parameters, BF16, FSDP2), three length sets.
# Figures go to OUT_DIR (default: $OUT, else gpu_check_out): gpu_tests.log, bench_gpu.json/.log,
# environment.txt, summary.txt. Exits 3 when no CUDA device is visible.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi

if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2> /dev/null; then
  echo "gpu_check: no CUDA device visible to $py (torch missing or a CPU build); nothing to check" | tee "$out/summary.txt"
  exit 3
fi
# Install what is missing beside the machine's own CUDA torch, never replacing it.
if ! "$py" -c "import megatron.core, omegaconf, tokenizers, pytest, hypothesis" 2> /dev/null; then
  torch_version=$("$py" -c "import torch; print(torch.__version__)")
  "$py" -m pip install -q -c <(echo "torch==$torch_version") -e ".[dev]" 2>&1 | tail -2
fi
{
  nvidia-smi || true
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$py" -c "from backend.megatron_compat import te_status; print('transformer_engine', te_status())"
} > "$out/environment.txt" 2>&1

status=0
timeout 240 "$py" -m pytest -q -rs tests/gpu 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 300 "$py" tools/bench_train.py --steps 3 --json --out "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log" || status=1
{
  echo "gpu tests: $(tail -n 1 "$out/gpu_tests.log")"
  grep -E "speedup vs mbs1|^device|^cost model" "$out/bench_gpu.log" || echo "bench: no result"
} | tee "$out/summary.txt"
exit $status
