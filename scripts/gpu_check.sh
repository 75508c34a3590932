#!/usr/bin/env bash
# GPU check of the hook: one prepared run on a machine with an NVIDIA GPU and PyTorch (world size 1;
# NCCL refuses two ranks on one GPU), at most 8 minutes (GH_CHECK_BUDGET_S, default 460 s, shared
# out by scripts/gpu_check_plan.sh: each step keeps what the later ones need; one the budget cannot
# give its need is skipped and says so). Each step writes its JSON (and its log)
# under $OUT/gpu_check (or a fresh directory it prints when OUT is unset); the summary goes to
# result.json there and, last, to stdout as RESULT {json}.
#   train    a short training loop unhooked, hooked in monitor mode and in profile mode: records,
#            completion marks, GPU timings, one GEMM benchmark through the pause path, ms per step,
#            host time per all_reduce call; the GPU memory each process holds (nvidia-smi
#            --query-compute-apps, and cudaMemGetInfo) and the PCI bus id the hook recorded;
#   capture  a CUDA graph captured in global mode of all-reduces while another thread calls NCCL on
#            a communicator of its own, unhooked, in monitor and in profile mode: the capture holds
#            and replays, nothing of the hook goes into it, the other thread's calls keep their
#            marks and times;
#   gputime  an out-of-place all-reduce (64 MiB, on a communicator made through the hook) behind
#            ~50 ms of torch.cuda._sleep: pending on the GPU, its GPU start ~50 ms after the enqueue
#            and a real GPU duration (a one-rank in-place all-reduce launches nothing);
#   async    a collective queued behind a 50 ms GPU spin, and one hung on the GPU by
#            cuStreamWaitValue32 with the tracker's hang watch run by a watcher process;
#   driver   the hook in a process without a shared CUDA runtime (real NCCL and the driver only,
#            no torch): marks and profile times through the driver API, the bus id it records;
#   nvml     real NVML through the agent's sampler, or through ctypes where pydantic or pynvml is
#            missing (a bare PyTorch image): every GPU's health and PCI bus id, against nvidia-smi;
#   profiler the hook loaded into real NCCL as its profiler plugin through PyTorch (one rank):
#            the interface NCCL took, the events received per class with the default mask and in
#            profile mode (the costly classes on), bound to the interposer's comm table;
#   pause    scripts/gpu_check_pause.py: a coalesced reduce-scatter and a self batch_isend_irecv
#            whose marks clear after GroupEnd and whose group-only communicator a targeted pause
#            parks; a benchmark send with no receiver (on the split benchmark communicator), then
#            training going on; a 25 s pause against a 20 s process-group timeout: cut, the job lives.
# Exits non-zero with a clear message when something needed is missing or a check fails.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3 || true)"; fi
fi
fail() { echo "gpu_check: $*" >&2; echo "RESULT {\"ok\": false, \"error\": \"$*\"}"; exit 1; }

[[ -n "$PY" ]] || fail "no python3 found"
command -v nvidia-smi >/dev/null 2>&1 || fail "nvidia-smi not found: this check needs an NVIDIA GPU machine"
nvidia-smi -L >/dev/null 2>&1 || fail "nvidia-smi sees no GPU"
"$PY" -c "import torch" >/dev/null 2>&1 || fail "PyTorch is not importable by $PY (pip install torch)"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || fail "torch.cuda.is_available() is False"
"$PY" -c "import torch.distributed as d, sys; sys.exit(0 if d.is_nccl_available() else 1)" \
  || fail "this PyTorch has no NCCL backend"
"$PY" -c "import numpy" >/dev/null 2>&1 || fail "numpy is not importable by $PY"
command -v make >/dev/null 2>&1 && command -v cc >/dev/null 2>&1 || fail "make and a C compiler are needed"

make -s -C "$ROOT/native" hook >/dev/null || fail "building the hook failed"
HOOK="$ROOT/native/build/libgreyhound_hook.so"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
if [[ -n "${OUT:-}" ]]; then RES="$OUT/gpu_check"; else RES="$(mktemp -d)/gpu_check"; fi
mkdir -p "$RES"
BUDGET="${GH_CHECK_BUDGET_S:-460}"
SECONDS=0

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GREYHOUND_SHM_DIR="$WORK/shm" MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1
export GH_STEPS="${GH_STEPS:-300}"

# One step: $1 = name (its need and limit are in gpu_check_plan.sh), $2 = hooked (1|0), then the
# command. Its last stdout line (JSON) goes to $RES/<name>.json, the rest to <name>.log; a step the
# budget cannot give its need, that fails or prints no JSON leaves {"ok": false, ...} there.
# shellcheck source=gpu_check_plan.sh
source "$ROOT/scripts/gpu_check_plan.sh"
step() {
  local name=$1 hooked=$2 port limit
  shift 2
  limit=$(gh_check_timeout "$name" "$SECONDS" "$BUDGET")
  if (( limit == 0 )); then
    echo "{\"ok\": false, \"skipped\": \"the ${BUDGET} s budget would not hold it\"}" > "$RES/$name.json"
    echo "gpu_check: $name skipped (budget)" >&2
    return 0
  fi
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  local preload=""
  [[ "$hooked" == 1 ]] && preload="$HOOK"
  local t0=$SECONDS rc=0
  MASTER_PORT=$port GREYHOUND_JOB_ID="gpu-$name" LD_PRELOAD="$preload" \
    timeout "$limit" "$@" > "$RES/$name.log" 2>&1 || rc=$?
  local last
  last=$(tail -1 "$RES/$name.log" 2>/dev/null || true)
  last=${last#RESULT }  # a script that ends with RESULT {json}
  if "$PY" -c 'import json, sys; json.loads(sys.argv[1])' "$last" 2>/dev/null; then
    echo "$last" > "$RES/$name.json"
  else
    echo "{\"ok\": false, \"error\": \"exit $rc without a result (see $name.log)\"}" > "$RES/$name.json"
  fi
  echo "gpu_check: $name done in $((SECONDS - t0)) s (exit $rc)" >&2
}

TRAIN="$ROOT/scripts/gpu_check_train.py"
GH_CHECK=train GH_MODE=none step base 0 "$PY" "$TRAIN"
GH_CHECK=train GH_MODE=monitor step monitor 1 "$PY" "$TRAIN"
GH_CHECK=train GH_MODE=profile step profile 1 "$PY" "$TRAIN"
GH_CHECK=capture GH_MODE=none step capture_base 0 "$PY" "$TRAIN"
GH_CHECK=capture GH_MODE=monitor step capture_monitor 1 "$PY" "$TRAIN"
GH_CHECK=capture GH_MODE=profile step capture_profile 1 "$PY" "$TRAIN"
GH_CHECK=gputime step gputime 1 "$PY" "$TRAIN"
GH_CHECK=async GH_MODE=monitor step async 1 "$PY" "$TRAIN"
step driver 1 "$PY" "$ROOT/scripts/gpu_check_driver.py"
step nvml 0 "$PY" "$ROOT/scripts/gpu_check_nvml.py"
# The hook named as real NCCL's profiler plugin (the preloaded instance: one ring for both).
NCCL_PROFILER_PLUGIN="$HOOK" step profiler 1 "$PY" "$ROOT/scripts/gpu_check_profiler.py"

# The pause script starts its own hooked PyTorch child (its parent plays the agent, unhooked) and
# writes its rings and its child's log under $RES/pause.
step pause 0 "$PY" "$ROOT/scripts/gpu_check_pause.py" --out "$RES/pause"

"$PY" "$ROOT/scripts/gpu_check_summary.py" "$RES"
