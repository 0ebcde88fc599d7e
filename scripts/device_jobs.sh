# Sourced by the scripts that run pruning work on a lent GPU machine (scripts/prune_table_gpu.sh,
# scripts/prune_select_gpu.sh, scripts/prune_allocation_gpu.sh): python3 with torch/torchvision/numpy, no network,
# no omegaconf, no Debian Fashion-MNIST package. .carry/ (git-ignored) supplies them; prepare it on the development
# machine, from the repository root:
#
#     mkdir -p .carry/wheels .carry/fashion-mnist
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#         --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#         -d .carry/wheels omegaconf==2.3.1 PyYAML==6.0.3
#     .venv/bin/python -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 -w .carry/wheels  # sdist only; pure Python
#     for f in /usr/share/datasets/fashion-mnist/*.gz; do  # xz: 4.4 MB smaller than Debian's gzip files
#         zcat "$f" | xz -9e >".carry/fashion-mnist/$(basename "$f" .gz).xz"; done
#     .venv/bin/python -c "from unsparse.timeseries import export_series; export_series('co2', '.carry/co2.txt')"

# carry_setup LOG: check .carry, install its wheels under /tmp/site, export PYTHONPATH and friends, and start LOG
# with the GPU, Python, torch and omegaconf versions. Needs OUT; warns when UNSPARSE_COMMIT is unset (the device
# copy has no .git, so results name their commit from it).
carry_setup() {
    : "${OUT:?OUT must name the folder for the results}"
    local needed
    for needed in .carry/wheels .carry/fashion-mnist .carry/co2.txt; do
        [[ -e $needed ]] || { echo "missing $needed: prepare .carry (see scripts/device_jobs.sh) and carry it" >&2
            exit 2; }
    done
    [[ -n ${UNSPARSE_COMMIT:-} ]] || echo "warning: UNSPARSE_COMMIT is not set; the results will name no commit" >&2
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .carry/wheels/*.whl
    export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1 UNSPARSE_CACHE=/tmp/unsparse-cache
    export UNSPARSE_COMMIT="${UNSPARSE_COMMIT:-}"
    mkdir -p "$OUT"
    {
        nvidia-smi -L || true
        python3 -c 'import sys, torch, omegaconf; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.cuda.is_available(), "omegaconf", omegaconf.__version__)'
    } 2>&1 | tee "$1"
}

# run_jobs RUNNER LOG NAME:OPTIONS...: run `RUNNER NAME OPTIONS...` for every job at the same time on the one GPU
# (sharing lengthens each: four width-32 tables took about twice a lone table's time), wait for all, copy each
# job's /tmp/device_jobs/NAME.json (the RUNNER writes it, also when stopped early) to $OUT/NAME.json and append
# the jobs' output to LOG. At most 7 jobs: the device returns 8 files. Each job gets an equal share of the CPU
# cores as its thread count (OMP_NUM_THREADS; 16 threads in each of six jobs on 16 cores starved them all).
# Returns 1 if any job or copy failed.
run_jobs() {
    local runner=$1 log=$2 job name status=0
    shift 2
    mkdir -p /tmp/device_jobs
    OMP_NUM_THREADS=$(($(nproc) / $# > 0 ? $(nproc) / $# : 1))
    export OMP_NUM_THREADS
    for job in "$@"; do
        name=${job%%:*}
        # shellcheck disable=SC2086  # the options after NAME: are a list
        "$runner" "$name" ${job#*:} >"/tmp/device_jobs/$name.log" 2>&1 &
    done
    for job in "$@"; do
        wait -n || status=1
    done
    for job in "$@"; do
        name=${job%%:*}
        cp "/tmp/device_jobs/$name.json" "$OUT/$name.json" || status=1
        { echo "===== $job"; cat "/tmp/device_jobs/$name.log"; } >>"$log"
    done
    return $status
}

# carry_job SECONDS SCRIPT WORKDIR NAME [options...]: the Python SCRIPT on the carried Fashion-MNIST, working in
# WORKDIR, its JSON at /tmp/device_jobs/NAME.json (where run_jobs collects it); interrupted (SIGINT, so it writes
# what it finished) after SECONDS and killed 20 s later.
carry_job() {
    local seconds=$1 script=$2 workdir=$3 name=$4
    shift 4
    timeout --signal=INT --kill-after=20 "$seconds" python3 "$script" --data-root .carry/fashion-mnist \
        --workdir "$workdir" --out "/tmp/device_jobs/$name.json" "$@"
}

# run_and_render RUNNER LOG SCRIPT PAGE NAME:OPTIONS...: run_jobs, then render_jobs; returns 1 if a job failed
# (the page is written from the jobs that left a JSON either way).
run_and_render() {
    local runner=$1 log=$2 script=$3 page=$4 status=0
    shift 4
    run_jobs "$runner" "$log" "$@" || status=1
    render_jobs "$script" "$page" "$@"
    return $status
}

# render_jobs SCRIPT PAGE NAME:OPTIONS...: join the $OUT/NAME.json files the jobs left (the others are skipped) into
# $OUT/PAGE with `python3 SCRIPT --render JSON... --out $OUT/PAGE`; nothing when no job left one.
render_jobs() {
    local script=$1 page=$2 job names=()
    shift 2
    for job in "$@"; do
        if [[ -e $OUT/${job%%:*}.json ]]; then
            names+=("$OUT/${job%%:*}.json")
        fi
    done
    if ((${#names[@]})); then
        python3 "$script" --render "${names[@]}" --out "$OUT/$page"
    fi
}
