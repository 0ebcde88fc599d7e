#!/usr/bin/env bash
# Host cost of two versions of the runtime on the same host: scripts/profile_launch.py run in alternating processes,
# ROUNDS times each, with the package of OLD_TREE (a folder holding unsparse/, kernels/ and configs/ of an older
# commit, e.g. made by `git archive <commit> unsparse kernels configs | tar -x -C outputs/ab_old`, and carried: it is
# git-ignored) and with this tree's. A host's speed moved by up to 1.6x between sessions (kernels/NOTES.md), so two
# versions compare only within one call. Writes $OUT/ab/{old,new}_<round>/launch_profile_*.json and a log per
# process; refuses an OLD_TREE that python3 would not import from. The old side's results name OLD_COMMIT
# (default: OLD_TREE). Exits 1 if any process failed.
#
#     UNSPARSE_COMMIT=<sha> OLD_COMMIT=<old sha> bash scripts/profile_launch_ab.sh outputs/ab_old 4 \
#         --layer 3 64 224 --kernel 11 \
#         --stride 4 --padding 2 --batch 1 --dtype float16 --params '{...}' --modules --blocks 5 --runs 300
set -euo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?OUT must name the folder for the results}"
old_tree=$1 rounds=$2
shift 2
[[ -d $old_tree/unsparse ]] || { echo "OLD_TREE $old_tree (relative to the repository root) holds no unsparse/" >&2
    exit 2; }
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "ROUNDS must be a positive integer, got $rounds" >&2; exit 2; }
[[ $(PYTHONPATH=$old_tree python3 -P -c "import unsparse; print(unsparse.__file__)") == "$(realpath "$old_tree")"/* ]] \
    || { echo "python3 does not import unsparse from $old_tree (an installed copy comes first?)" >&2; exit 2; }
mkdir -p "$OUT/ab"
failed=0
for round in $(seq 1 "$rounds"); do
    for side in old new; do
        path=. commit=${UNSPARSE_COMMIT:-}
        [[ $side == old ]] && path=$old_tree commit=${OLD_COMMIT:-$old_tree}
        UNSPARSE_COMMIT=$commit PYTHONPATH=$path python3 scripts/profile_launch.py "$@" --out "$OUT/ab/${side}_$round" \
            >"$OUT/ab/${side}_$round.log" 2>&1 || { echo "$side round $round failed (see its log)" >&2; failed=1; }
    done
done
exit $failed
