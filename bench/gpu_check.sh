#!/usr/bin/env bash
# The one prepared GPU check: run on the device machine from the repository
# root. Checks every implementation against its reference, tunes ours within
# a budget, times everything side by side, and prints the table last.
#   bash bench/gpu_check.sh            (results under $OUT/gpu_check, else results/)
# TUNE_BUDGET_S (default 6) is the tuning budget per op call and implementation
# (0: none; below, what a budget buys). DEADLINE_S (default 400) stops tuning after that many
# seconds and skips what is left a minute later, so one call fits the device's
# 10-minute command limit; results.json and tuned.json are rewritten after every
# workload. ONLY="ragged_dot,attention" reruns just those workloads. SKIP_AFTER_S
# skips workloads started after that many seconds (default DEADLINE_S + 60), and
# NO_DISPATCH=1 leaves out the timing of small calls against the dispatch floor,
# NO_PROFILE=1 the small model's profile (0 or unset: kept); SMOKE=1 runs tiny shapes
# in interpret mode (on a CPU: how the tests run this script). A kernel that hangs (a check run past
# 120 s, a timed run past its timeout) or loses the device ends the workloads: its row
# says which, the rest are skipped, and the tables are printed. Then the next call can
# leave that implementation out: LEAVE_OUT=attention.pallas_mosaic_gpu (comma-separated).
# HARD_LIMIT_S (default 570) ends the run then whatever runs, so nothing costs more
# device time than the plan allows.
# Afterwards, on the development machine: python bench/land_gpu_check.py <files_at>/gpu_check
# ships the confirmed configs and records the run (its docstring says what else).
#
# With 15 minutes of device time (counted from the ask until the give-back, a start of
# 1-2 minutes and the idle time between calls included), two calls of at most about
# 390 and 300 seconds, each given the tool's timeout_s a little above its hard limit:
#   1. TUNE_BUDGET_S=0 SKIP_AFTER_S=310 HARD_LIMIT_S=390 bash bench/gpu_check.sh    (the dispatch and
#      batch checks, then every workload it reaches checked and timed with its heuristic
#      configs; untuned)
#   2. TUNE_BUDGET_S=10 DEADLINE_S=180 SKIP_AFTER_S=240 HARD_LIMIT_S=300 NO_DISPATCH=1 NO_PROFILE=1 ONLY="=ragged_dot G=8 M=8192 K=4096 N=14336 fwd+bwd,=attention B=2 T=8192 H=16 D=128 causal fwd+bwd,=rms_norm (8192, 8192) fwd+bwd" bash bench/gpu_check.sh
#      (tunes the speed targets: a fwd+bwd workload tunes its forward calls too)
# then give the machine back at once, and land each call's results (each call gets its
# own $OUT). An ONLY part that names no workload stops the run before anything runs.
# The budget pays for compiles and timings only (a worker's start and the call's inputs
# and reference come before it), but a Mosaic GPU compile takes seconds: a budget of a
# few seconds may measure the heuristic alone, and land ships no such entry.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-results}/gpu_check"
mkdir -p "$out"
python="${PYTHON:-python3}"  # the device image's; the tests give theirs
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1  # the log under $OUT keeps every line even if the call is cut short
# Tuning measures in worker processes (Autotuner(isolate=True)); leave them room.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.5}"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv || true
# The GPU's own target config as XLA sees it (about a second): committed as
# bench/h200_target_config.txtpb, it makes `make compile-h200` compile exactly for this
# card.
XLA_FLAGS="--xla_dump_to=/tmp/xla_target --xla_dump_hlo_module_re=target_probe" "$python" -c "
import jax, jax.numpy as jnp
def target_probe(x): return x + 1
print(jax.__version__, jax.devices())
jax.jit(target_probe)(jnp.ones(8)).block_until_ready()" \
  && cp /tmp/xla_target/*target_probe*gpu_target_config.pbtxt "$out/h200_target_config.pbtxt" || true
# A switch is on where its variable is set to anything but 0 (NO_DISPATCH=0 keeps it).
switches=()
[[ "${NO_DISPATCH:-0}" != 0 ]] && switches+=(--no-dispatch)
[[ "${NO_PROFILE:-0}" != 0 ]] && switches+=(--no-profile)
[[ "${SMOKE:-0}" != 0 ]] && switches+=(--smoke)
"$python" bench/gpu_check.py --out "$out" --tune-budget-s "${TUNE_BUDGET_S:-6}" \
  --deadline-s "${DEADLINE_S:-400}" ${SKIP_AFTER_S:+--skip-after-s "$SKIP_AFTER_S"} \
  --hard-limit-s "${HARD_LIMIT_S:-570}" ${switches[@]+"${switches[@]}"} \
  --only "${ONLY:-}" --leave-out "${LEAVE_OUT:-}" 2>&1 | tee "$out.log"
