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
# .carry/ (git-ignored) is prepared on the development machine, from the repository root:
#
#     mkdir -p .carry/wheels .carry/fashion-mnist
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .carry/wheels omegaconf==2.3.1 PyYAML==6.0.3
#     .venv/bin/python -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .carry/wheels  # sdist only; pure Python
#     cp /usr/share/datasets/fashion-mnist/*.gz .carry/fashion-mnist/
#     .venv/bin/python -c "from unsparse.timeseries import export_series; export_series('co2', '.carry/co2.txt')"
#
# Environment: OUT (required), UNSPARSE_COMMIT (recommended), PRUNE_TABLE_TIMEOUT (seconds, default 560: the
# run is stopped before the device tool's 600-second limit so that this script still reports), and
# PRUNE_TABLE_ARGS (extra options for prune_table.py, e.g. "--budget quick" for a smoke run).
set -euo pipefail
: "${OUT:?OUT must name the folder for the results}"
cd "$(dirname "$0")/.."
for needed in .carry/wheels .carry/fashion-mnist .carry/co2.txt; do
    [[ -e $needed ]] || { echo "missing $needed: prepare .carry (see the top of $0) and carry it" >&2; exit 2; }
done
[[ -n ${UNSPARSE_COMMIT:-} ]] || echo "warning: UNSPARSE_COMMIT is not set; the results will name no commit" >&2

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry/wheels/*.whl
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 UNSPARSE_CACHE=/tmp/unsparse-cache
export UNSPARSE_COMMIT="${UNSPARSE_COMMIT:-}"
mkdir -p "$OUT"

run_table() {  # run_table OUTDIR [prune_table.py options...]: one table into OUTDIR, stopped before the limit
    local into=$1
    shift
    # shellcheck disable=SC2086  # PRUNE_TABLE_ARGS is a list of options
    timeout --signal=INT --kill-after=20 "${PRUNE_TABLE_TIMEOUT:-560}" \
        python3 scripts/prune_table.py --budget gpu --device cuda --data-root .carry/fashion-mnist \
        --series-file .carry/co2.txt --workdir "/tmp/prune_table/$(basename "$into")" --out "$into" --no-progress \
        ${PRUNE_TABLE_ARGS:-} "$@"
}

set -o pipefail
{
    nvidia-smi -L || true
    python3 -c 'import sys, torch, omegaconf; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.cuda.is_available(), "omegaconf", omegaconf.__version__)'
} 2>&1 | tee "$OUT/prune_table.log"
if (($# == 0)); then
    run_table "$OUT" 2>&1 | tee -a "$OUT/prune_table.log"
    exit
fi
# Jobs NAME:OPTIONS run at the same time on the one GPU (sharing lengthens each: four width-32 tables took about
# twice a lone table's time, so keep the jobs few enough to end inside PRUNE_TABLE_TIMEOUT); each writes
# $OUT/NAME.json (render its page with prune_table.py --render), and the logs are appended one after another.
status=0
for job in "$@"; do
    name=${job%%:*}
    # shellcheck disable=SC2086  # the options after NAME: are a list
    run_table "/tmp/prune_jobs/$name" ${job#*:} --note "This table ran at the same time as $(($# - 1)) other(s) on \
the same GPU ($*); its wall times include that sharing." >"/tmp/prune_jobs_$name.log" 2>&1 &
done
for job in "$@"; do
    wait -n || status=1
done
for job in "$@"; do
    name=${job%%:*}
    cp "/tmp/prune_jobs/$name/pruning_results.json" "$OUT/$name.json" || status=1
    { echo "===== $job"; cat "/tmp/prune_jobs_$name.log"; } >>"$OUT/prune_table.log"
done
exit $status
