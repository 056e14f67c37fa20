#!/usr/bin/env bash
# ResNet-50 throughput on the GPUs of this node: bf16 (fp16 on V100), channels_last, DDP,
# fed from JPEG shards generated on local disk with as many loader workers as the node allows.
# First a smoke pass over the precision matrix's GPU cells (ddp/fsdp x bf16/fp16 x ResNet-50/
# ViT-B/16, a few steps each: trains with finite losses, or is refused up front where the GPU
# cannot, e.g. bf16 on a V100). Then prints images/s, the data-wait fraction, peak memory and
# MFU against the GPU's published dense bf16 peak. Last, the LLM case (`hpctrain bench gpu-lm`):
# the largest GPT preset that fits, bf16, FSDP2 over the GPUs, compiled, on token shards;
# tokens/s, MFU, peak memory and data wait (--lm-preset gpt-1b for the issue's MFU goal).
# Runs the same on one H200 machine and on a Jean Zay node, from inside the job as ONE task
# (the script starts one process per visible GPU itself; on one GPU, ddp and fsdp run
# unwrapped: FSDP2 needs two GPUs or more):
#
#   tools/gpu_bench.sh                            # everything with defaults
#   tools/gpu_bench.sh --steps 500 --images 50000 --workers 8 --batch-size 192
#   tools/gpu_bench.sh --dry-run --images 200     # no GPU needed: plan, data, configs, command
#   tools/gpu_bench.sh --no-smoke                 # timings only (--smoke-steps N: steps per cell)
#   tools/gpu_bench.sh --lm-preset gpt-1b --lm-steps 200   # the LLM case's preset and length
#   tools/gpu_bench.sh --no-lm                    # ResNet-50 only
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
STEPS=300
IMAGES=""
IMAGE_SIZE=320
BATCH_SIZE=0
WORKERS=0
COMPILE=""
SMOKE=1
SMOKE_STEPS=3
LM=1
LM_PRESET=auto
LM_STEPS=100
WORK="${GPU_BENCH_DIR:-/tmp/hpctrain-gpu-bench-${USER:-$(id -un)}}"

usage() { sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'; exit "${1:-0}"; }
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --steps) STEPS="$2"; shift ;;
    --images) IMAGES="$2"; shift ;;
    --image-size) IMAGE_SIZE="$2"; shift ;;
    --batch-size) BATCH_SIZE="$2"; shift ;;
    --workers) WORKERS="$2"; shift ;;
    --compile) COMPILE="--compile" ;;
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

bench() { "$PYTHON" -m hpctrain.bench.gpu_vision "$@" --batch-size "$BATCH_SIZE" --workers "$WORKERS"; }

mkdir -p "$WORK"
PLAN="$(bench plan)"
NUM_GPUS="$("$PYTHON" -c 'import json,sys; print(json.loads(sys.argv[1])["num_gpus"])' "$PLAN")"
echo "plan: $PLAN"
if [[ "$NUM_GPUS" -eq 0 && "$DRY_RUN" -eq 0 ]]; then
  echo "gpu_bench.sh: no CUDA GPU visible (CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-unset}); use --dry-run to check the rest" >&2
  exit 1
fi
# Enough images that an epoch is many steps long on every GPU (epoch starts are not steady state).
: "${IMAGES:=$(( NUM_GPUS > 2 ? 10000 * NUM_GPUS : 20000 ))}"

echo "data: $IMAGES JPEG images of ${IMAGE_SIZE} px -> shards in $WORK/shards"
bench data "$WORK" --num-images "$IMAGES" --size "$IMAGE_SIZE"
bench config "$WORK" --steps "$STEPS" $COMPILE
NPROC=$(( NUM_GPUS > 0 ? NUM_GPUS : 1 ))
CMD=("$PYTHON" -m hpctrain train "$WORK/config.yaml" --nproc "$NPROC" --resume none)
echo "train: ${CMD[*]}"
LM_CMD=("$PYTHON" -m hpctrain bench gpu-lm --work "$WORK/lm" --preset "$LM_PRESET" --steps "$LM_STEPS")
if [[ "$DRY_RUN" -eq 1 ]]; then
  "$PYTHON" -m hpctrain config show "$WORK/config.yaml" >/dev/null
  if [[ "$SMOKE" -eq 1 ]]; then bench smoke "$WORK" --dry-run; fi
  if [[ "$LM" -eq 1 ]]; then echo "lm: ${LM_CMD[*]}"; fi
  echo "dry run: config valid; not training"
  exit 0
fi

if [[ "$NPROC" -eq 1 ]]; then
  # One process: inside a job step with several tasks, SLURM_NTASKS would make it wait for
  # ranks that never come; say explicitly that this is a world of one.
  export RANK=0 LOCAL_RANK=0 WORLD_SIZE=1 LOCAL_WORLD_SIZE=1
fi
SMOKE_RC=0
if [[ "$SMOKE" -eq 1 ]]; then
  echo "smoke: the precision matrix's GPU cells, $SMOKE_STEPS steps each on $NPROC GPU(s)"
  bench smoke "$WORK" --steps "$SMOKE_STEPS" || SMOKE_RC=$?
fi

rm -rf "$WORK/run"
# One intra-op thread per rank: the loader workers get the cores.
OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${CMD[@]}"
bench report "$WORK"
echo "report: $WORK/report.json"
if [[ "$LM" -eq 1 ]]; then
  echo "lm: ${LM_CMD[*]}"
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${LM_CMD[@]}" || SMOKE_RC=$?
  if [[ "$NPROC" -gt 1 ]]; then
    # The same LLM run under HSDP (one node: the same as FSDP2) and FSDP2 x TP 2 (#27).
    for MESH in "--strategy hsdp" "--tp-degree 2"; do
      echo "lm: ${LM_CMD[*]} $MESH"
      # shellcheck disable=SC2086
      OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "${LM_CMD[@]}" $MESH --work "$WORK/lm-${MESH##* }" || SMOKE_RC=$?
    done
  fi
  # Greedy decoding with the KV cache against transformers' generate on one GPU (#41; fp32,
  # outputs compared token for token): the issue's CPU goal, measured where serving runs.
  GEN_CMD=("$PYTHON" -m hpctrain bench generate --device cuda --layers 12 --batches 1,16 --new-tokens 64)
  echo "generate: ${GEN_CMD[*]}"
  "${GEN_CMD[@]}" || SMOKE_RC=$?
fi

# ---- LoRA and QLoRA memory (issue 40) -----------------------------------------------------
# Peak GPU memory (torch.cuda.max_memory_allocated), step time and checkpoint size of a full,
# a LoRA (rank 8, bf16 base) and a QLoRA (NF4 base) fine-tune step of a gpt-1b-shaped Llama
# on one GPU, each run in a fresh process (hpctrain bench lora --device cuda; the QLoRA case
# needs torchao: pip install 'hpctrain[qlora]'). GPU_BENCH_LORA=0 skips it;
# GPU_BENCH_LORA_PRESET picks another preset.
if [[ "${GPU_BENCH_LORA:-1}" -eq 1 && "$DRY_RUN" -eq 0 ]]; then
  LORA_CMD=("$PYTHON" -m hpctrain bench lora --device cuda --preset "${GPU_BENCH_LORA_PRESET:-gpt-1b}"
            --vocab 128256 --seq-len 2048 --batch-size 1 --steps 5 --warmup 2 --qlora --work "$WORK")
  echo "lora: ${LORA_CMD[*]}"
  "${LORA_CMD[@]}" || SMOKE_RC=$?  # one process: cuda:0
fi
# ---- end of the LoRA block -----------------------------------------------------------------

if [[ "$SMOKE_RC" -ne 0 ]]; then echo "gpu_bench.sh: smoke cells FAILED (above)" >&2; fi
exit "$SMOKE_RC"
