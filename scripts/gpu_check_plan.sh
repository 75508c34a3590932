# The steps of scripts/gpu_check.sh in the order they run, sourced by it: each with the seconds it
# needs (what a normal run of it takes, with room) and the most it may take. The needs add up to
# less than the budget (GH_CHECK_BUDGET_S, 460 s; the build before and the summary after bring the
# whole run under 8 minutes), and each step runs with what is left less the needs of the steps
# after it: a step that overruns eats into the slack, never into a later step's need, so no step
# is skipped for want of time (the limits alone add up to more than the budget).
#   name              need  limit
GH_CHECK_PLAN="
base                  30    90
monitor               30    90
profile               30    90
capture_base          20    60
capture_monitor       20    60
capture_profile       20    60
gputime               20    60
async                 45    100
driver                20    60
nvml                  10    60
profiler              30    60
pause                 100   150
"
GH_CHECK_STEP_GAP=2  # seconds between two steps (a port probe, the result's check)

# The timeout step $1 gets when $2 seconds of budget $3 are spent; 0 when it cannot have its need.
gh_check_timeout() {
  local name=$1 spent=$2 budget=$3 seen=0 need=0 limit=0 later=0 n d l
  while read -r n d l; do
    [[ -z "$n" ]] && continue
    if (( seen )); then later=$((later + d + GH_CHECK_STEP_GAP)); fi
    if [[ "$n" == "$name" ]]; then seen=1; need=$d; limit=$l; fi
  done <<< "$GH_CHECK_PLAN"
  (( seen )) || { echo 0; return; }
  local left=$((budget - spent - later))
  (( left > limit )) && left=$limit
  (( left < need )) && left=0
  echo "$left"
}
