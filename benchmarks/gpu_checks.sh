#!/usr/bin/env bash
# The project's GPU checks and benchmarks, each under its own time limit (a lent GPU comes for
# minutes). Sections are written into a copy of docs/BENCHMARKS.md in $OUT (copy it back over
# docs/BENCHMARKS.md) as each shape is measured, so a step cut at its limit keeps its rows; each
# step's log goes beside it.
#
#     OUT=/tmp/gpu_out bash benchmarks/gpu_checks.sh [STEP...]    # default: every step, in order
#
# Steps and the time each needed on an H200 on 2026-12-04 (jax 0.11.2; compiling dominates):
#     draft_attention      checks ~40 s + 15 shapes ~20 s each: ~5 min
#     pallas_lowerings     6 shapes ~20 s each: ~2 min
#     delta_rule           checks > 3 min (one compile took 2 min 41 s) + 6 shapes: > 5 min
#     kernels_end_to_end   6 settings ~70 s each: ~7 min
# Together they exceed one 10-minute call: run them in two, e.g. `draft_attention
# pallas_lowerings`, then `delta_rule kernels_end_to_end`. The scripts import the repository
# directly (no install); of its dependencies, the H200 image lacked only `gguf` (pure Python:
# carry its wheel and put it on PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?set OUT to a folder for the logs and the BENCHMARKS.md copy}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false TF_CPP_MIN_LOG_LEVEL=2
python=${PYTHON:-python3}
[[ -f "$out/BENCHMARKS.md" ]] || cp docs/BENCHMARKS.md "$out/BENCHMARKS.md"

declare -A limit=([draft_attention]=300 [pallas_lowerings]=150 [delta_rule]=330
    [kernels_end_to_end]=450)
declare -A script=([draft_attention]=bench_draft_attention.py
    [pallas_lowerings]=bench_pallas_lowerings.py [delta_rule]=bench_delta_rule.py
    [kernels_end_to_end]=bench_kernels_end_to_end.py)
steps=("$@")
((${#steps[@]})) || steps=(draft_attention pallas_lowerings delta_rule kernels_end_to_end)
for name in "${steps[@]}"; do
    [[ -n "${script[$name]:-}" ]] || { echo "unknown step $name (one of ${!script[*]})"; exit 2; }
done

{ nvidia-smi -L; "$python" -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 |
    tee "$out/env.log"
for name in "${steps[@]}"; do
    start=$SECONDS
    timeout "${limit[$name]}" "$python" "benchmarks/${script[$name]}" --out "$out/BENCHMARKS.md" \
        >"$out/$name.log" 2>&1
    echo "== $name: rc $? in $((SECONDS - start)) s (limit ${limit[$name]} s)"
    grep -E "^(ok|FAIL)|Error|error:|ms" "$out/$name.log" | tail -n 30
done
