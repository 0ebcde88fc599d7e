#!/usr/bin/env bash
# Host cost of two versions of the runtime on the same host: scripts/profile_launch.py run in alternating processes,
# ROUNDS times each, with the package of OLD_TREE (a folder holding unsparse/, kernels/ and configs/ of an older
# commit, e.g. made by `git archive <commit> unsparse kernels configs | tar -x -C outputs/ab_old`, and carried: it is
# git-ignored) and with this tree's. A host's speed moved by up to 1.6x between sessions (kernels/NOTES.md), so two
# versions compare only within one call. Writes $OUT/ab/{old,new}_<round>/launch_profile_*.json and a log per
# process; prints which package each side imported. The old side's results name OLD_COMMIT (default: OLD_TREE).
#
#     UNSPARSE_COMMIT=<sha> OLD_COMMIT=<old sha> bash scripts/profile_launch_ab.sh outputs/ab_old 4 \
#         --layer 3 64 224 --kernel 11 \
#         --stride 4 --padding 2 --batch 1 --dtype float16 --params '{...}' --modules --blocks 5 --runs 300
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
old_tree=$1 rounds=$2
shift 2
mkdir -p "$OUT/ab"
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        path=. commit=${UNSPARSE_COMMIT:-}
        [[ $side == old ]] && path=$old_tree commit=${OLD_COMMIT:-$old_tree}
        PYTHONPATH=$path python3 -P -c "import unsparse; print('$side', unsparse.__file__)"
        UNSPARSE_COMMIT=$commit PYTHONPATH=$path python3 scripts/profile_launch.py "$@" --out "$OUT/ab/${side}_$round" \
            >"$OUT/ab/${side}_$round.log" 2>&1 || echo "$side round $round failed (see its log)"
    done
done
