#!/usr/bin/env bash
# The one command to run on a GPU machine (sized for about 7 minutes on one H200 and a few GB
# of disk; not yet timed on one: no GPU has been lent so far):
#   1. checks of what only a GPU can show (`python -m hpctrain.bench.gpu_checks`): SLURM's
#      signals to a live run's loader forkserver, flex attention compiled, train.deterministic
#      refused or warned;
#   2. the precision matrix's GPU cells (ddp/fsdp x bf16/fp16 x ResNet-50/ViT-B/16, a few steps
#      each: trains with finite losses, or is refused up front where the GPU cannot);
#   3. ResNet-50 (bf16, fp16 on V100; channels_last; DDP) fed from JPEG shards on local disk
#      with as many loader workers as the node allows: images/s, data-wait fraction, peak
#      memory, MFU against the GPU's published dense bf16 peak;
#   4. the LLM case (`hpctrain bench gpu-lm`): gpt-1b (--lm-preset), bf16, FSDP2 over the GPUs,
#      compiled, on token shards: tokens/s, MFU, peak memory, data wait;
#   5. LoRA/QLoRA memory: a marked place below, for when that benchmark exists.
# Every step prints one line per check or benchmark (`check ...`, `smoke ...`, `resnet50 ...`,
# `lm ...`); the last lines repeat them (WORK/summary.txt). No benchmark writes a checkpoint.
# Runs the same on one H200 machine and on a Jean Zay node, from inside the job as ONE task
# (the script starts one process per visible GPU itself; on one GPU, ddp and fsdp run
# unwrapped: FSDP2 needs two GPUs or more):
#
#   tools/gpu_bench.sh                            # everything with defaults
#   tools/gpu_bench.sh --steps 40                 # every case shorter (ResNet-50 and LLM)
#   tools/gpu_bench.sh --steps 500 --images 50000 --workers 8 --batch-size 192
#   tools/gpu_bench.sh --dry-run --images 200     # no GPU needed: each run's Trainer built on CPU
#   tools/gpu_bench.sh --no-checks --no-smoke     # the benchmarks only (--smoke-steps N: steps)
#   tools/gpu_bench.sh --lm-preset gpt-3b --lm-steps 200   # the LLM case's preset and length
#   tools/gpu_bench.sh --no-lm                    # no LLM case
#   srun -A abc@h100 -C h100 --nodes=1 --ntasks=1 --gres=gpu:4 --cpus-per-task=96 \
#        --hint=nomultithread -t 00:30:00 tools/gpu_bench.sh          # a Jean Zay H100 node
#
# Needs hpctrain's dependencies in $PYTHON (pip install -e . on a login node; no network is
# used on the compute node). Environment: GPU_BENCH_DIR (work folder, default
# /tmp/hpctrain-gpu-bench-$USER: local disk), PYTHON (default: the repo's .venv if present,
# else python3), HPCTRAIN_PEAK_TFLOPS (the peak of a GPU the table does not know).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then PYTHON="$REPO/.venv/bin/python"; else PYTHON=python3; fi
fi
if ! "$PYTHON" -c "import hpctrain" 2>/dev/null; then
  export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
fi

DRY_RUN=0
STEPS=200
IMAGES=""
IMAGE_SIZE=320
BATCH_SIZE=0
WORKERS=0
COMPILE=""
CHECKS=1
SMOKE=1
SMOKE_STEPS=3
LM=1
LM_PRESET=gpt-1b
LM_STEPS=""  # --lm-steps, else --steps when given, else 50
STEPS_GIVEN=""
WORK="${GPU_BENCH_DIR:-/tmp/hpctrain-gpu-bench-${USER:-$(id -un)}}"

usage() { sed -n '2,34p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --steps) STEPS="$2"; STEPS_GIVEN="$2"; shift ;;
    --images) IMAGES="$2"; shift ;;
    --image-size) IMAGE_SIZE="$2"; shift ;;
    --batch-size) BATCH_SIZE="$2"; shift ;;
    --workers) WORKERS="$2"; shift ;;
    --compile) COMPILE="--compile" ;;
    --no-checks) CHECKS=0 ;;
    --no-smoke) SMOKE=0 ;;
    --smoke-steps) SMOKE_STEPS="$2"; shift ;;
    --no-lm) LM=0 ;;
    --lm-preset) LM_PRESET="$2"; shift ;;
    --lm-steps) LM_STEPS="$2"; shift ;;
    --work) WORK="$2"; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gpu_bench.sh: unknown argument $1" >&2; usage 2 ;;
  esac
  shift
done
: "${LM_STEPS:=${STEPS_GIVEN:-50}}"

bench() { "$PYTHON" -m hpctrain.bench.gpu_vision "$@" --batch-size "$BATCH_SIZE" --workers "$WORKERS"; }

mkdir -p "$WORK"
SUMMARY="$WORK/summary.txt"
: > "$SUMMARY"
FAILED=0
# Run a step, keep its result lines (those starting with one of the prefixes) for the summary,
# and remember a failure without stopping: the next steps still measure.
step() {
  local prefixes="$1"; shift
  local rc
  set +e
  "$@" 2>&1 | tee "$WORK/step.log"
  rc="${PIPESTATUS[0]}"
  set -e
  grep -E "^($prefixes)" "$WORK/step.log" >> "$SUMMARY" || true
  if [[ "$rc" -ne 0 ]]; then
    FAILED=1
    echo "FAILED (exit $rc): $*" >> "$SUMMARY"
  fi
}

# ==== LoRA / QLoRA memory (#40) ================================================================
# Peak GPU memory (torch.cuda.max_memory_allocated), step time and checkpoint size of a full,
# a LoRA (rank 8, bf16 base) and a QLoRA (NF4 base) fine-tune step of a gpt-1b-shaped Llama on
# one GPU, each in a fresh process (`hpctrain bench lora --device cuda`; QLoRA needs torchao:
# pip install 'hpctrain[qlora]'). GPU_BENCH_LORA=0 skips it; GPU_BENCH_LORA_PRESET picks
# another preset. Its CPU twin runs in CI (tests/bench/test_lora_bench.py).
lora_memory_case() {
  if [[ "${GPU_BENCH_LORA:-1}" -ne 1 ]]; then
    echo "lora: skipped (GPU_BENCH_LORA=0)" | tee -a "$SUMMARY"
  elif [[ "$DRY_RUN" -eq 1 ]]; then
    echo "lora: GPU only (hpctrain bench lora --device cuda); not in a dry run" | tee -a "$SUMMARY"
  else
    step "lora" "$PYTHON" -m hpctrain bench lora --device cuda \
      --preset "${GPU_BENCH_LORA_PRESET:-gpt-1b}" --vocab 128256 --seq-len 2048 --batch-size 1 \
      --steps 5 --warmup 2 --qlora --work "$WORK/lora"
  fi
}
# ===============================================================================================

PLAN="$(bench plan)"
NUM_GPUS="$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["num_gpus"])' "$PLAN")"
echo "plan: $PLAN"
if [[ "$NUM_GPUS" -eq 0 && "$DRY_RUN" -eq 0 ]]; then
  echo "gpu_bench.sh: no CUDA GPU visible (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}); use --dry-run to check the rest" >&2
  exit 1
fi
# Enough images that an epoch is many steps long on every GPU (epoch starts are not steady state).
: "${IMAGES:=$(( NUM_GPUS > 2 ? 10000 * NUM_GPUS : 12000 ))}"
NPROC=$(( NUM_GPUS > 0 ? NUM_GPUS : 1 ))
if [[ "$NPROC" -eq 1 ]]; then
  # One process: inside a job step with several tasks, SLURM_NTASKS would make it wait for
  # ranks that never come; say explicitly that this is a world of one.
  export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1
fi
# One intra-op thread per rank: the loader workers get the cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

echo "data: $IMAGES JPEG images of ${IMAGE_SIZE} px -> shards in $WORK/shards"
bench data "$WORK" --num-images "$IMAGES" --size "$IMAGE_SIZE"
bench config "$WORK" --steps "$STEPS" $COMPILE
LM_CMD=("$PYTHON" -m hpctrain bench gpu-lm --work "$WORK/lm" --preset "$LM_PRESET" --steps "$LM_STEPS")
LM_LINES="gpu_bench lm: |tokens/s|data wait|peak memory|MFU"

if [[ "$DRY_RUN" -eq 1 ]]; then
  # Each run's Trainer built on the CPU as it will start (checks, plan, model on meta, loaders).
  if [[ "$CHECKS" -eq 1 ]]; then step "check " "$PYTHON" -m hpctrain.bench.gpu_checks "$WORK" --dry-run; fi
  if [[ "$SMOKE" -eq 1 ]]; then step "smoke " bench smoke "$WORK" --dry-run; fi
  step "resnet50 " bench check "$WORK"
  if [[ "$LM" -eq 1 ]]; then step "lm " "${LM_CMD[@]}" --dry-run; fi
  lora_memory_case
  echo "== summary"; cat "$SUMMARY"
  if [[ "$FAILED" -ne 0 ]]; then echo "gpu_bench.sh: dry run FAILED (above)" >&2; exit 1; fi
  echo "dry run: config valid; not training"
  exit 0
fi

if [[ "$CHECKS" -eq 1 ]]; then
  echo "checks: what only a GPU shows"
  step "check " "$PYTHON" -m hpctrain.bench.gpu_checks "$WORK"
fi
if [[ "$SMOKE" -eq 1 ]]; then
  echo "smoke: the precision matrix's GPU cells, $SMOKE_STEPS steps each on $NPROC GPU(s)"
  step "smoke " bench smoke "$WORK" --steps "$SMOKE_STEPS"
fi

# Issue #39, what only a GPU shows: the health probe's GPU count (CUDA's driver API through
# ctypes, resilience/probe.py) against torch's, and NCCL's init log as the fabric check reads it
# (distributed/fabric.py: its "Using network X" line; one rank is enough to print it).
"$PYTHON" - <<'PY' || SMOKE_RC=$?
import os, pathlib, tempfile
import torch, torch.distributed as dist
from hpctrain.distributed.fabric import nccl_log_env, network_in_log
from hpctrain.resilience.probe import visible_gpus
seen, torch_count = visible_gpus(), torch.cuda.device_count()
print(f"check probe-gpus: {'ok' if seen == torch_count else 'FAILED'} (probe {seen}, torch {torch_count})")
folder = pathlib.Path(tempfile.mkdtemp(prefix="hpctrain-nccl-"))
os.environ.update(nccl_log_env({}, folder), MASTER_ADDR="127.0.0.1", MASTER_PORT="29517")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
dist.all_reduce(torch.ones(1, device="cuda"))
dist.destroy_process_group()
text = "".join(p.read_text(errors="replace") for p in folder.glob("*.log"))
network = network_in_log(text)
print(f"check nccl-network-line: {'ok' if network else 'FAILED'} (Using network {network}; {len(text.splitlines())} log lines)")
raise SystemExit(0 if network and seen == torch_count else 1)
PY

rm -rf "$WORK/run"
echo "train: $PYTHON -m hpctrain train $WORK/config.yaml --nproc $NPROC --resume none"
step "resnet50 " "$PYTHON" -m hpctrain train "$WORK/config.yaml" --nproc "$NPROC" --resume none
step "gpu_bench: |images/s|data wait|peak memory|MFU" bench report "$WORK"
echo "report: $WORK/report.json"
# Issue #39 part 4 on a GPU: the run's goodput adds up, and the loop leaves little unaccounted
# (steps only queue GPU work: their time arrives with the syncs of the logged steps).
step "check goodput" "$PYTHON" - "$WORK/run" <<'PY'
import sys
from hpctrain.resilience.goodput_report import describe, run_goodput
goodput = run_goodput(sys.argv[1])
print("\n".join(describe(goodput)))
parts, total = goodput.part_hours(), goodput.allocated_hours
ok = abs(sum(parts.values()) - total) <= 0.02 * total and parts["productive"] > 0
ok = ok and 0 <= parts["loop_overhead"] <= 0.05 * total
print(f"check goodput-adds-up: {'ok' if ok else 'FAILED'} (loop overhead "
      f"{100 * parts['loop_overhead'] / max(total, 1e-12):.1f} % of {total:.4f} {goodput.unit})")
raise SystemExit(0 if ok else 1)
PY
if [[ "$LM" -eq 1 ]]; then
  echo "lm: ${LM_CMD[*]}"
  step "$LM_LINES" "${LM_CMD[@]}"
  if [[ "$NPROC" -gt 1 ]]; then
    # The same LLM run under HSDP (one node: the same as FSDP2) and FSDP2 x TP 2 (#27).
    for MESH in "--strategy hsdp" "--tp-degree 2"; do
      echo "lm: ${LM_CMD[*]} $MESH"
      # shellcheck disable=SC2086
      step "$LM_LINES" "${LM_CMD[@]}" $MESH --work "$WORK/lm-${MESH##* }"
    done
  fi
  # Greedy decoding with the KV cache against transformers' generate on one GPU (#41; fp32,
  # outputs compared token for token): the issue's CPU goal, measured where serving runs.
  GEN_CMD=("$PYTHON" -m hpctrain bench generate --device cuda --layers 12 --batches 1,16 --new-tokens 64)
  echo "generate: ${GEN_CMD[*]}"
  step "generate|hpctrain|batch" "${GEN_CMD[@]}"
fi

lora_memory_case

echo "== summary"; cat "$SUMMARY"
if [[ "$FAILED" -ne 0 ]]; then echo "gpu_bench.sh: some checks or cases FAILED (above)" >&2; fi
exit "$FAILED"
