#!/usr/bin/env bash
# The pruning table (scripts/prune_table.py) with its `gpu` budget, on a lent GPU machine: one CUDA GPU,
# python3 with torch/torchvision/numpy, no network, no omegaconf, no Debian Fashion-MNIST package (statsmodels
# is not relied on either). One command, from the repository root, well inside 8 minutes (the budget's
# estimate is about 4; see BUDGETS in scripts/prune_table.py); the device tool's call:
#
#     command: UNSPARSE_COMMIT=<full sha of the commit under test> bash scripts/prune_table_gpu.sh
#     carry:   [".carry"]
#
# Writes into $OUT (3 files): pruning_results.md and pruning_results.json (both rewritten after every model,
# so a run stopped early keeps what it finished) and prune_table.log (everything printed). Copy the first two
# to docs/ to publish them. The commit comes from $UNSPARSE_COMMIT (the device copy has no .git).
#
# With arguments NAME:OPTIONS, one table per argument runs concurrently on the same GPU, e.g. two seeds split
# by model: bash scripts/prune_table_gpu.sh "s1a:--seed 1 --models autoencoder1d vgg_small" \
#     "s1b:--seed 1 --models resnet_small"; each writes $OUT/NAME.json (at most 7 jobs: the device returns 8
# files); their pages note that they shared the GPU, as their wall times include it.
#
# .carry/ (git-ignored): see scripts/device_jobs.sh for how to prepare it.
#
# Environment: OUT (required), UNSPARSE_COMMIT (recommended), PRUNE_TABLE_TIMEOUT (seconds, default 560: the
# run is stopped before the device tool's 600-second limit so that this script still reports), and
# PRUNE_TABLE_ARGS (extra options for prune_table.py, e.g. "--budget quick" for a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/device_jobs.sh
source scripts/device_jobs.sh
carry_setup "$OUT/prune_table.log"

run_table() {  # run_table OUTDIR [prune_table.py options...]: one table into OUTDIR, stopped before the limit
    local into=$1
    shift
    # shellcheck disable=SC2086  # PRUNE_TABLE_ARGS is a list of options
    timeout --signal=INT --kill-after=20 "${PRUNE_TABLE_TIMEOUT:-560}" \
        python3 scripts/prune_table.py --budget gpu --device cuda --data-root .carry/fashion-mnist \
        --series-file .carry/co2.txt --workdir "/tmp/prune_table/$(basename "$into")" --out "$into" --no-progress \
        ${PRUNE_TABLE_ARGS:-} "$@"
}

if (($# == 0)); then
    run_table "$OUT" 2>&1 | tee -a "$OUT/prune_table.log"
    exit
fi

table_job() {  # table_job NAME [options...]: one of several tables, its JSON at /tmp/device_jobs/NAME.json
    local name=$1 status=0
    shift
    run_table "/tmp/prune_jobs/$name" "$@" --note "This table ran at the same time as $((JOBS - 1)) other(s) on \
the same GPU ($JOB_LIST); its wall times include that sharing." || status=$?
    cp "/tmp/prune_jobs/$name/pruning_results.json" "/tmp/device_jobs/$name.json"
    return $status
}
JOBS=$# JOB_LIST="$*"
run_jobs table_job "$OUT/prune_table.log" "$@"
