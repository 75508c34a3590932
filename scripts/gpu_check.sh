#!/usr/bin/env bash
# GPU check of the hook (issues 3 and 10): on a machine with an NVIDIA GPU and PyTorch, build the
# hook and run single-rank PyTorch NCCL processes (scripts/gpu_check_train.py):
#   train  a short training loop unhooked, hooked in monitor mode and in profile mode: records,
#          completion marks, GPU timings, one GEMM benchmark through the pause path (after the
#          drain), ms per step and host time per all_reduce call in each mode;
#   async  (a) a collective queued behind a ~50 ms GPU spin: host time in the call, pending mark,
#          GPU start and duration from profile mode; (b) a collective hung on the GPU
#          (cuStreamWaitValue32 on a flag): pending and ageing in the comm table while the
#          training thread waits in a stream synchronisation, the tracker's hang-watch core run
#          on it when importable, and released by the flag;
#   nvml   real NVML through the node agent's sampler (scripts/gpu_check_nvml.py): every GPU's
#          clocks, throttle reasons, temperature, power, ECC, PCIe, NVLink idle and under a GEMM
#          loop, Xid events, cross-checked with nvidia-smi (about 10 s).
# Prints a summary and, last, RESULT {json}. About two minutes; at most 4 x 100 s + 60 s (under 8 min). Exits non-zero with a clear message
# when something needed is missing or a check fails.
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

# One run; $1 = label, $2 = check (train|async), $3 = mode (none|monitor|profile). Prints its JSON.
run() {
  local label=$1 check=$2 mode=$3 port
  port=$("$PY" -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
  local preload=""
  [[ "$mode" != none ]] && preload="$HOOK"
  MASTER_PORT=$port GREYHOUND_JOB_ID="gpu-$label" GH_CHECK="$check" GH_MODE="$mode" LD_PRELOAD="$preload" \
    timeout 100 "$PY" "$ROOT/scripts/gpu_check_train.py" || { echo "gpu_check: run '$label' failed" >&2; return 1; }
}

base=$(run base train none | tail -1) || fail "the unhooked training run failed"
mon=$(run monitor train monitor | tail -1) || fail "the monitor-mode training run failed"
prof=$(run profile train profile | tail -1) || fail "the profile-mode training run failed"
asy=$(run async async monitor | tail -1) || fail "the asynchronous-timeline run failed"
"$PY" -c "import pynvml" >/dev/null 2>&1 || fail "pynvml is not importable by $PY (pip install nvidia-ml-py)"
nvml_out=$(timeout 60 "$PY" "$ROOT/scripts/gpu_check_nvml.py" 2>&1) || true
echo "$nvml_out" | sed '$d'
nvml=$(echo "$nvml_out" | tail -1)
"$PY" -c 'import json, sys; json.loads(sys.argv[1])' "$nvml" 2>/dev/null \
  || nvml='{"ok": false, "error": "the NVML step printed no result"}'
"$PY" - "$base" "$mon" "$prof" "$asy" "$nvml" <<'PYEOF'
import json, sys
base, mon, prof, asy, nvml = (json.loads(a) for a in sys.argv[1:])
q, h = asy["queued"], asy["hang"]
train_ok = (mon["records"] > 0 and mon["gpu_marks"] == 1 and prof["gpu_done"] > 0 and prof["gemm_ok"])
res = {
    "ok": bool(train_ok and q["ok"] and h["ok"] and nvml["ok"]),
    "train_ok": train_ok, "queued_ok": q["ok"], "hang_ok": h["ok"], "nvml_ok": nvml["ok"],
    "ms_per_step_unhooked": base["ms_per_step"],
    "ms_per_step_monitor": mon["ms_per_step"],
    "ms_per_step_profile": prof["ms_per_step"],
    "overhead_monitor_pct": round(100 * (mon["ms_per_step"] / base["ms_per_step"] - 1), 3),
    "overhead_profile_pct": round(100 * (prof["ms_per_step"] / base["ms_per_step"] - 1), 3),
    "us_per_allreduce_unhooked": base["us_per_allreduce_call"],
    "us_added_per_call_monitor": round(mon["us_per_allreduce_call"] - base["us_per_allreduce_call"], 3),
    "us_added_per_call_profile": round(prof["us_per_allreduce_call"] - base["us_per_allreduce_call"], 3),
    "allreduce_records_monitor": mon["records"],
    "marks_monitor": {k: mon.get(k) for k in ("gpu_marks", "marks_behind", "marks_lost")},
    "profiled_records_with_gpu_times": prof["gpu_done"],
    "median_gpu_allreduce_us": prof["gpu_us_median"],
    "gemm_benchmark_ns": prof["gemm_ns"], "gemm_drain_ns": prof["gemm_drain_ns"],
    "queued": q, "hang": h, "device": prof["device"], "nvml": nvml,
}
print(f"training: unhooked {base['ms_per_step']:.3f} ms/step; monitor {mon['ms_per_step']:.3f}; "
      f"profile {prof['ms_per_step']:.3f}; GPU-timed all-reduces: {prof['gpu_done']}; GEMM "
      f"{'ok' if prof['gemm_ok'] else 'FAILED'} after a {prof['gemm_drain_ns']} ns drain")
print(f"host time per all_reduce: {base['us_per_allreduce_call']} us unhooked, "
      f"+{res['us_added_per_call_monitor']} us with the monitor-mode mark, "
      f"+{res['us_added_per_call_profile']} us in profile mode")
qm, qp = q["monitor"], q["profile"]
print(f"(a) queued behind 50 ms: {qm['host_ms_in_all_reduce']} ms in all_reduce on the host, pending "
      f"on the GPU: {qm['pending_while_queued']}; profile: GPU start {qp.get('gpu_start_after_enqueue_ms')} ms "
      f"after enqueue, {qp.get('gpu_duration_ms')} ms on the GPU -> {'ok' if q['ok'] else 'FAILED'}")
print(f"(b) hung on the GPU: pending seq {h.get('pending_seq_seen')} ageing {h.get('pending_age_first_s')} -> "
      f"{h.get('pending_age_last_s')} s, host inside NCCL in {h.get('host_inside_nccl_samples')} samples, "
      f"training thread blocked {h.get('blocked_in_sync_s')} s; hang watch: {h.get('hang_watch')} -> "
      f"{'ok' if h['ok'] else 'FAILED: ' + str(h.get('error', ''))}")
print(f"nvml: {nvml.get('gpus', 0)} GPU(s), {nvml.get('ms_per_sample_all_gpus')} ms per sample, "
      f"absent fields {nvml.get('absent_fields')}, nvidia-smi agrees {nvml.get('nvidia_smi_agrees')} -> "
      f"{'ok' if nvml['ok'] else 'FAILED: ' + str(nvml.get('error', ''))}")
print("RESULT " + json.dumps(res))
sys.exit(0 if res["ok"] else 1)
PYEOF
