#!/usr/bin/env bash
# Build the GPU machine's offline wheelhouse (needs PyPI here; the GPU machine has no network):
#   bash tools/env/gpu_wheelhouse.sh [DIR]        # DIR defaults to gpu_wheelhouse/ (git-ignored)
# The GPU image (Python 3.12.3, torch 2.11.0+cu130; tools/env/gpu_image_packages.txt) lacks
# megatron-core, omegaconf and wandb. tools/env/gpu_wheelhouse.txt lists them and the dependencies the
# image lacks, pinned; this downloads exactly those (--no-deps: never torch, numpy or anything else
# the image has) as CPython 3.12 x86-64 Linux wheels, checks that every dependency of every wheel
# is in the folder or in the image, and writes DIR/MANIFEST.txt. Today: 24 wheels, 26.5 MiB
# (wandb alone 19.4 MiB); it refuses above 60 MiB, since the carried working tree may hold 64 MiB.
# Carry DIR to the GPU machine; tools/env/gpu_check.sh installs from it there (tools/env/gpu_install_offline.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="${1:-gpu_wheelhouse}"
limit_mib=60
# Any Python with pip works: pip downloads for the target named below, not for itself.
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi

# Requirement and flags per line of the list, comments stripped.
specs=$(awk '{ sub(/#.*/, "") } NF && $3 != "sdist" { print $1 }' tools/env/gpu_wheelhouse.txt)
sdists=$(awk '{ sub(/#.*/, "") } NF && $3 == "sdist" { print $1 }' tools/env/gpu_wheelhouse.txt)

mkdir -p "$dir"
# Start from an empty folder of wheels: two versions of one package would make the install pick
# either, and the check below refuses them.
rm -f "$dir"/*.whl "$dir/MANIFEST.txt"

# The image's interpreter: CPython 3.12, glibc new enough for manylinux_2_28. pip matches each
# manylinux tag exactly, so name every one the pinned wheels use (megatron-core: 2_24/2_28,
# pydantic-core and protobuf: 2014/2_17).
# shellcheck disable=SC2086  # one requirement a word
"$py" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dir" $specs

# Pure-Python packages published only as an sdist (none today; antlr4-python3-runtime 4.9.3 was
# one, for omegaconf 2.3): build a py3-none-any wheel here, which installs anywhere.
for spec in $sdists; do
  "$py" -m pip wheel --quiet --no-deps --no-binary=:all: -w "$dir" "$spec"
done

# Every declared wheel once, nothing undeclared, every dependency in the folder or the image.
"$py" tools/env/gpu_wheels.py verify "$dir"

bytes=$(cat "$dir"/*.whl | wc -c)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
grep -v '^#' "$dir/MANIFEST.txt" | awk -F'\t' '{ printf "  %-9s %6.2f MiB  %s\n", $3, $2 / 1048576, $1 }'
echo "gpu_wheelhouse: $(ls "$dir"/*.whl | wc -l) wheels, $mib MiB in $dir (limit $limit_mib MiB)"
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
  echo "gpu_wheelhouse: $mib MiB is over $limit_mib MiB: drop the optional (wandb) lines of tools/env/gpu_wheelhouse.txt" >&2
  exit 1
fi
