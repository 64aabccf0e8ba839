"""The benchmark harness: methods side by side on prompt sets, as the field reports them.

    python -m jetspec_jax.bench --prompts ../shared/data/eval/gsm8k_test.jsonl --limit 20 \\
        --methods ar,jetspec++-J1 --draft DRAFT_DIR --temperatures 0,1 --out runs/bench

Per dataset, temperature and method: pooled tau (tokens per verification round), decode tokens/s,
the speedup over AR measured in the same run, per-phase times, and the field's correctness check
(greedy speculative output equals AR output, prompt by prompt). Results go to `results.jsonl`
(one summary per row), `samples.jsonl` (one line per prompt), `results.md` (a markdown table) and
`tau.png` / `speedup.png` (with matplotlib, the `bench` extra).

Modules: `methods` (method specs), `datasets` (prompt files → token ids), `runner` (timed runs and
summaries), `report` (JSONL, markdown, plots), `__main__` (the command line), `load` (a load
test of a running server: requests/s and p50/p99 latency at several concurrencies).
"""

from jetspec_jax.bench.methods import MethodSpec, parse_methods
from jetspec_jax.bench.runner import run_benchmark

__all__ = ["MethodSpec", "parse_methods", "run_benchmark"]
