#!/usr/bin/env bash
# GPU check of the hook (issue 3): on a machine with an NVIDIA GPU and PyTorch, build the hook,
# run a short single-rank PyTorch NCCL training loop unhooked, hooked in monitor mode and hooked
# in profile mode, check that records carry real GPU timings, run one GEMM benchmark through the
# pause path, and print the overhead versus no hook as the last line: RESULT {json}.
# Under 5 minutes. Exits non-zero with a clear message when something needed is missing.
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

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export GREYHOUND_SHM_DIR="$WORK/shm" MASTER_ADDR=127.0.0.1 RANK=0 WORLD_SIZE=1
export GH_STEPS="${GH_STEPS:-300}"

# One training run; $1 = label, $2 = mode (none|monitor|profile). Prints "<label> <ms/step>".
train() {
  local label=$1 mode=$2 port
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  local preload=""
  [[ "$mode" != none ]] && preload="$HOOK"
  MASTER_PORT=$port GREYHOUND_JOB_ID="gpu-$label" GH_MODE="$mode" LD_PRELOAD="$preload" \
    timeout 200 "$PY" "$ROOT/scripts/gpu_check_train.py" || { echo "gpu_check: run '$label' failed" >&2; return 1; }
}

base=$(train base none | tail -1) || fail "the unhooked training run failed"
mon=$(train monitor monitor | tail -1) || fail "the monitor-mode training run failed"
prof=$(train profile profile | tail -1) || fail "the profile-mode training run failed"
"$PY" - "$base" "$mon" "$prof" <<'PYEOF'
import json, sys
base, mon, prof = (json.loads(a) for a in sys.argv[1:])
ok = mon["records"] > 0 and prof["gpu_done"] > 0 and prof["gemm_ok"]
res = {
    "ok": ok,
    "ms_per_step_unhooked": base["ms_per_step"],
    "ms_per_step_monitor": mon["ms_per_step"],
    "ms_per_step_profile": prof["ms_per_step"],
    "overhead_monitor_pct": round(100 * (mon["ms_per_step"] / base["ms_per_step"] - 1), 3),
    "overhead_profile_pct": round(100 * (prof["ms_per_step"] / base["ms_per_step"] - 1), 3),
    "allreduce_records_monitor": mon["records"],
    "profiled_records_with_gpu_times": prof["gpu_done"],
    "median_gpu_allreduce_us": prof["gpu_us_median"],
    "gemm_benchmark_ns": prof["gemm_ns"],
    "device": prof["device"],
}
print(f"unhooked {base['ms_per_step']:.3f} ms/step; monitor {mon['ms_per_step']:.3f}; "
      f"profile {prof['ms_per_step']:.3f}; GPU-timed all-reduces: {prof['gpu_done']}")
print("RESULT " + json.dumps(res))
sys.exit(0 if ok else 1)
PYEOF
