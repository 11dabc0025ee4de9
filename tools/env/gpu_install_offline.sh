#!/usr/bin/env bash
# Install the carried wheelhouse on the GPU machine, offline, beside the image's own packages:
#   bash tools/env/gpu_install_offline.sh [--wheelhouse DIR] [--python PY] [--target DIR]
# Defaults: gpu_wheelhouse/ (built by tools/env/gpu_wheelhouse.sh), $PYTHON else python3, .gpu_site/.
# Wheels go into the target folder (pip --target), never into the image: its torch 2.11.0+cu130
# and everything else stay as they are; callers put the folder first on PYTHONPATH, as
# tools/env/gpu_check.sh does. Which wheels: every `required` and `optional` line of
# tools/env/gpu_wheelhouse.txt, and a `floor` line only where this interpreter's copy is too old.
# No index, no configuration (that could name one), so nothing is fetched: a missing wheel stops it
# before pip starts, naming the package. Exit 0 when installed, 2 when not (never 3: gpu_check.sh
# keeps 3 for "no CUDA device"). About 10 s for the 26.5 MiB of wheels (no byte-compiling).
set -euo pipefail
cd "$(dirname "$0")/../.."
wheelhouse=gpu_wheelhouse
py="${PYTHON:-python3}"
target=.gpu_site
while [ $# -gt 0 ]; do
  case "$1" in
    --wheelhouse) wheelhouse="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --target) target="$2"; shift 2 ;;
    *) echo "gpu_install_offline: unknown argument $1 (--wheelhouse DIR, --python PY, --target DIR)" >&2; exit 2 ;;
  esac
done

# Which wheels, for this interpreter; names every missing required wheel and exits 2.
files=$("$py" tools/env/gpu_wheels.py plan "$wheelhouse") || exit 2
if [ -z "$files" ]; then
  echo "gpu_install_offline: nothing to install"
  exit 0
fi

# torch pinned to the installed build, so no wheel here can ever replace it (none names it today).
constraints=$(mktemp)
trap 'rm -f "$constraints"' EXIT
"$py" -c "import importlib.metadata as m; print('torch==' + m.version('torch'))" > "$constraints" 2> /dev/null || : > "$constraints"

# --isolated and PIP_CONFIG_FILE=/dev/null: no environment variable or pip.conf adds an index or
# a find-links folder; --no-index: no network at all.
# shellcheck disable=SC2086  # one wheel path a word
if ! log=$(PIP_CONFIG_FILE=/dev/null "$py" -m pip --isolated install --no-index --find-links "$wheelhouse" \
  --no-deps --no-compile --no-cache-dir --disable-pip-version-check --upgrade --target "$target" \
  -c "$constraints" $files 2>&1); then
  echo "$log" | tail -n 5 >&2
  echo "gpu_install_offline: pip could not install from $wheelhouse (above)" >&2
  exit 2
fi
echo "gpu_install_offline: installed $(echo "$files" | wc -l) wheels from $wheelhouse into $target"

# Every dependency of every declared package satisfied, as this interpreter sees them now.
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
"$py" tools/env/gpu_wheels.py check-installed || exit 2
"$py" -c "import megatron.core, omegaconf" || { echo "gpu_install_offline: megatron.core or omegaconf does not import" >&2; exit 2; }
