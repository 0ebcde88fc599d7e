#!/usr/bin/env bash
# The validation-split selection (scripts/prune_select.py) on a lent GPU machine, one candidate per job: the
# dense model is trained once, then every NAME:OPTIONS argument runs prune_select.py on a copy of it at the same
# time on the one GPU. At most 6 jobs: with selection.md and the log, the device returns 8 files (three jobs at
# a time finished a gpu_w32 resnet_small candidate each in 145-165 s). The device tool's call, from the repository
# root:
#
#     command: UNSPARSE_COMMIT=<full sha> PRUNE_SELECT_ARGS="--models resnet_small --fine-tune-lr 0.05" \
#              bash scripts/prune_select_gpu.sh "a01:--grid alpha=0.1" "a10:--grid alpha=1.0"
#     carry:   [".carry"]  (prepare it as scripts/device_jobs.sh says)
#
# PRUNE_SELECT_ARGS holds what every job shares (models, seed, budget, fine-tuning learning rates); the job
# options add the candidate's settings, one value per --grid (the options are split at spaces). Writes into
# $OUT: NAME.json per job (rewritten after every candidate, so a stopped job keeps what it finished),
# selection.md (the jobs joined into one table, the best per model marked) and prune_select.log. The jobs stop
# after PRUNE_SELECT_TIMEOUT seconds (default 540, inside the device tool's 600-second limit, dense training
# included).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_jobs.sh
source scripts/device_jobs.sh
carry_setup "$OUT/prune_select.log"
started=$SECONDS
# shellcheck disable=SC2086  # PRUNE_SELECT_ARGS is a list of options
python3 scripts/prune_select.py --dense-only --data-root .carry/fashion-mnist --workdir /tmp/prune_select/dense \
    ${PRUNE_SELECT_ARGS:-} 2>&1 | tee -a "$OUT/prune_select.log"

select_job() {  # select_job NAME [--grid ...]: one candidate on a copy of the dense models
    local name=$1
    shift
    cp -r /tmp/prune_select/dense "/tmp/prune_select/$name"
    # shellcheck disable=SC2086  # PRUNE_SELECT_ARGS is a list of options
    carry_job $((${PRUNE_SELECT_TIMEOUT:-540} - (SECONDS - started))) scripts/prune_select.py \
        "/tmp/prune_select/$name" "$name" ${PRUNE_SELECT_ARGS:-} "$@"
}
run_and_render select_job "$OUT/prune_select.log" scripts/prune_select.py selection.md "$@"
