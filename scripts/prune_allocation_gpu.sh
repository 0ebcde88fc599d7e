#!/usr/bin/env bash
# The allocation ablation (scripts/prune_allocation.py) on a lent GPU machine, one seed per job, all jobs at the
# same time on the one GPU. The device tool's call, from the repository root:
#
#     command: UNSPARSE_COMMIT=<full sha> PRUNE_ALLOCATION_ARGS="--evolutionary epsilon=0.005 --fine-tune-lr 0.05" \
#              bash scripts/prune_allocation_gpu.sh "s0:--seed 0" "s1:--seed 1" "s2:--seed 2"
#     carry:   [".carry"]  (prepare it as scripts/device_jobs.sh says)
#
# Writes into $OUT: NAME.json per job (rewritten after every arm), allocation.md (the jobs joined) and
# prune_allocation.log. At most 6 jobs. The jobs stop after PRUNE_ALLOCATION_TIMEOUT seconds (default 560).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_jobs.sh
source scripts/device_jobs.sh
carry_setup "$OUT/prune_allocation.log"

allocation_job() {  # allocation_job NAME [prune_allocation.py options...]
    local name=$1
    shift
    # shellcheck disable=SC2086  # PRUNE_ALLOCATION_ARGS is a list of options
    carry_job "${PRUNE_ALLOCATION_TIMEOUT:-560}" scripts/prune_allocation.py "/tmp/prune_allocation/$name" "$name" \
        ${PRUNE_ALLOCATION_ARGS:-} "$@"
}
run_and_render allocation_job "$OUT/prune_allocation.log" scripts/prune_allocation.py allocation.md "$@"
