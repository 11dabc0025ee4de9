#!/usr/bin/env bash
# The GPU check, one command, under 10 minutes on one H200 with no network:
#   bash tools/env/gpu_check.sh [OUT_DIR]
# 0. No CUDA device visible: exit 3 with the reason, before anything else (so CPU machines stop here).
# 1. megatron-core, omegaconf and wandb, when the image lacks them, from the carried gpu_wheelhouse/
#    (build it with tools/env/gpu_wheelhouse.sh where there is network), offline, into .gpu_site/
#    beside the image's packages (tools/env/gpu_install_offline.sh); a missing wheel: exit 2, naming it.
# 2. The steps at the bottom, each under its timeout, all under one budget (GPU_CHECK_BUDGET_S,
#    550 s; the probe, install and environment add about 30 s): the GPU-only tests (flex backward on
#    CUDA vs sdpa, packed rows on flex and TE, a BF16 train step, TE when it imports, GPT-OSS
#    sinks + sliding windows + MoE on flex (FP32) and on TE's softmax_type="learnable" (BF16)), the
#    FlexAttention compile count with and without shape buckets and the MoE experts' grouped GEMM
#    against a per-expert loop (tools/bench/bench_moe_experts.py), the memory probe and adversarial steps
#    at its budget, tools/bench_train.py on the GPU
#    model (~250M parameters, BF16, FSDP2: micro-batch size 1, fixed safe, sort-and-stride, dynamic
#    padded and packed on three length sets), and the same arms on the exact Qwen3-4B architecture
#    (random weights, the short set), and the policy loss's check (tools/compare_arms.py with
#    loss.type=policy on synthetic rollouts, the ~250M model in BF16: fixed micro-batch size 1 vs
#    dynamic padded vs packed; objective, gradient and update agreement), and one RL weight sync of
#    the ~250M model timed (tools/bench/bench_weight_sync.py).
# Files in OUT_DIR (default: $OUT, else gpu_check_out), at most 8 (what the device returns):
# environment.txt (with the install log), NAME.log per step (bench_qwen3_4b's JSON is in its log),
# bench_gpu.json, summary.txt (<= 30 lines).
# Exit: 0 every step passed, 1 a step failed, timed out or was skipped, 2 install failed, 3 no CUDA.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$out"
if [ -n "${PYTHON:-}" ]; then py="$PYTHON"; elif [ -x .venv/bin/python ]; then py=.venv/bin/python; else py=python3; fi
wheelhouse="${WHEELHOUSE:-gpu_wheelhouse}"
site=.gpu_site
budget_s="${GPU_CHECK_BUDGET_S:-550}"

# 0. CUDA first, with the reason; nothing else may run (or fail) before it.
if ! reason=$("$py" -c "
import sys
try:
    import torch
except Exception as e:  # ImportError, or a CUDA build whose libraries fail to load
    sys.exit(f'torch does not import ({e})')
if not torch.cuda.is_available():
    sys.exit(f'torch {torch.__version__} sees no CUDA device (built for CUDA {torch.version.cuda})')
" 2>&1); then
  echo "gpu_check: no CUDA device visible to $py: ${reason:-$py did not run}; nothing to check" | tee "$out/summary.txt"
  exit 3
fi

# 1. The carried wheels first on the path, then this checkout (no install of the package itself:
# an editable install would need setuptools' build step, this needs nothing).
export PYTHONPATH="$PWD/$site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
install_log="(megatron-core, omegaconf and wandb import: nothing installed)"
if ! "$py" -c "import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('megatron.core', 'omegaconf', 'wandb'))))" 2> /dev/null; then
  if ! install_log=$(bash tools/env/gpu_install_offline.sh --wheelhouse "$wheelhouse" --python "$py" --target "$site" 2>&1); then
    echo "$install_log" >&2
    { echo "gpu_check: offline install from $wheelhouse failed (exit 2):"; echo "$install_log" | tail -n 8; } | tee "$out/summary.txt"
    exit 2
  fi
fi
# Facts for the record; none of them may stop the check.
{
  nvidia-smi || true
  "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" || true
  "$py" -c "
import importlib.metadata as m
for n in ('megatron-core', 'omegaconf', 'wandb', 'transformers', 'triton'):
    try:
        print(n, m.version(n))
    except m.PackageNotFoundError:
        print(n, 'not installed')
" || true
  "$py" -c "from backend.megatron_compat import te_status; print('transformer_engine', te_status())" || true
  echo "$install_log"
} > "$out/environment.txt" 2>&1

# 2. Steps. step NAME TIMEOUT_S COMMAND...: runs it under min(TIMEOUT_S, budget left), output to
# the console and $out/NAME.log, one result line for the summary. Adding a check is one line below;
# keep the files in $out at 8 or fewer.
status=0
deadline=$((SECONDS + budget_s))
results=$(mktemp)
trap 'rm -f "$results"' EXIT
step() {
  local name=$1 limit=$2 left=$((deadline - SECONDS)) t0=$SECONDS rc=0 verdict last
  shift 2
  if [ "$left" -lt 30 ]; then
    echo "$name: SKIPPED, the $budget_s s budget is spent" >> "$results"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  echo "== $name (timeout $limit s): $*"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.log" || rc=$?
  case $rc in
    0) verdict=ok ;;
    124 | 137) verdict="TIMED OUT after $limit s" ;;
    *) verdict="FAILED (exit $rc)" ;;
  esac
  [ "$rc" -eq 0 ] || status=1
  last=$(grep -v '^\s*$' "$out/$name.log" | tail -n 1 | cut -c1-160 || true)
  echo "$name: $verdict in $((SECONDS - t0)) s${last:+; $last}" >> "$results"
}

step gpu_tests 150 "$py" -m pytest -q -rs -p no:cacheprovider tests/gpu
# kernels, then the memory probe (train.max_tokens_per_gpu=auto) on the ~250M model in BF16 and on the
# exact Qwen3-4B architecture (random weights: the recipe without its checkpoint), the latter also with
# full activation recomputation (its b falls; its budget rises), one JSON line each; then adversarial
# steps at the ~250M model's resolved budget under set_per_process_memory_fraction(0.5): windows of
# only 2,048-token rows, one among short rows, only short rows (tools/bench/memory_adversary.py: exit 1
# if a step measures over its prediction; "1.15x over" says the budget leaves no large slack).
probe_250m="model.hidden_size=1024 model.num_layers=16 model.num_attention_heads=16 model.num_query_groups=4"
step kernels_memory 230 bash -c "'$py' tools/bench/flex_compile_count.py --steps 4 && '$py' tools/bench/bench_moe_experts.py \
  && '$py' tools/probe_memory.py configs/quickstart.yaml $probe_250m train.precision=bf16 --json \
  && '$py' tools/probe_memory.py configs/qwen3_4b_dynamic.yaml 'model.hf_checkpoint=\"\"' data.tokenizer=byte --json \
  && '$py' tools/probe_memory.py configs/qwen3_4b_dynamic.yaml 'model.hf_checkpoint=\"\"' data.tokenizer=byte \
     model.recompute_granularity=full --json \
  && '$py' tools/bench/memory_adversary.py configs/quickstart.yaml $probe_250m train.precision=bf16 data.max_seq_length=2048 \
     train.global_batch_size=256 --fraction 0.5 --steps 12"
step bench_gpu 120 "$py" tools/bench_train.py --steps 3 --out "$out/bench_gpu.json"
# One RL weight sync of the ~250M model on the GPU, timed (the stream gathered from FSDP2 and loaded into
# the generator, against the file round trip): seconds and bytes per sync in its JSON. The servers'
# NCCL sync needs a second GPU (tests/gpu/test_vllm_server_nccl.py, in gpu_tests above, says so).
step weight_sync 45 "$py" tools/bench/bench_weight_sync.py configs/grpo_demo.yaml $probe_250m --repeats 2 --json
step bench_qwen3_4b 100 "$py" tools/bench_train.py --recipe configs/qwen3_4b_dynamic.yaml --sets short --steps 2 --scale 0.25 --json
rl_tmp=$(mktemp -d)
trap 'rm -rf "$results" "$rl_tmp"' EXIT
policy_model="model.hidden_size=1024 model.num_layers=16 model.num_attention_heads=16 model.num_query_groups=4"
policy_loss="loss.type=policy loss.ratio_clip_high=0.28 loss.kl_coef=0.001 loss.entropy_coef=0.001"
policy_data="data.path=$rl_tmp/rollouts.jsonl data.valid_fraction=0 train.eval_interval=0 train.global_batch_size=32"
step policy_arms 110 bash -c "'$py' -m backend.bench.rl_rows --out '$rl_tmp/rollouts.jsonl' --count 64 --max-len 1024 \
  && '$py' tools/compare_arms.py configs/quickstart.yaml --packed --nproc 1 --steps 2 --out-dir '$rl_tmp/arms' \
  $policy_model $policy_data $policy_loss train.precision=bf16 train.max_tokens_per_gpu=16384 checkpoint.interval=0"

files=$(find "$out" -maxdepth 1 -type f ! -name summary.txt | wc -l)
{
  echo "gpu_check: exit $status, $SECONDS s; $(grep -m1 '^torch ' "$out/environment.txt")"
  cat "$results"
  grep -hE "^device |^cost model|speedup vs mbs1|^flex compile|^experts speedup" "$out"/*.log || echo "bench: no result lines"
  grep -h '"max_tokens_per_gpu"' "$out/kernels_memory.log" 2> /dev/null | cut -c1-200 || true
  grep -hE "^(long|singleton|short) |prediction$" "$out/kernels_memory.log" 2> /dev/null || true
  # one line per policy arm: "policy fixed vs packed: loss_rel_diff=... grad_cosine=... ..."
  awk '/^-- fixed vs/ { arm = $4 } /^(loss_rel_diff|grad_cosine|update_cosine|rel_update_diff) / { v[arm] = v[arm] " " $1 "=" $2 }
    END { for (a in v) print "policy fixed vs " a ":" v[a] }' "$out/policy_arms.log" 2> /dev/null || true
  [ "$files" -lt 8 ] || echo "gpu_check: $((files + 1)) files in $out; the device returns only 8"
} > "$out/summary.txt"
sed -i '31,$d' "$out/summary.txt" # at most 30 lines (a head -n 30 pipe could kill the block with SIGPIPE)
cat "$out/summary.txt"
exit $status
