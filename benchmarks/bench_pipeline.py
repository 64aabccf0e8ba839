"""The two pipeline forms side by side: memory each device holds, and decode speed.

With the embedded SmolLM2-135M-Instruct target and a JetSpec++ draft with an adapter (a checkpoint
given by --draft, else random: the hit rates are then meaningless, the sizes and the per-round
costs are not), foresight B, greedy:

    memory      bytes each device holds for the loop: weights and loop state (caches, buffers),
                from the trees each form places (`pipeline.replicated_weights` + the replicated
                state; `pipeline_mpmd.draft_stage_target_params`, the proposer's params and state)
    speed       per prompt (batch 1): decode tokens/s of the single-device foresight round,
                pipeline="spmd" and pipeline="mpmd" (medians); every output checked equal to AR's

On a CPU host the script splits the CPU into two virtual devices that share its cores (and memory
bandwidth): the speed rows show each form's overhead and what overlap the cores allow, not the
gain on two accelerators.

    python benchmarks/bench_pipeline.py [--draft DIR] [--num-prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

# Before any computation: a CPU host gets two virtual devices (accelerator hosts use theirs).
jax.config.update("jax_num_cpu_devices", 2)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BENCHMARKS_MD,
    changed_flags,
    machine_line,
    write_section,
)
from jetspec_jax import DecodingOptions  # noqa: E402
from jetspec_jax.adapter import init_adapter  # noqa: E402
from jetspec_jax.bench.datasets import load_dataset  # noqa: E402
from jetspec_jax.decoding.pipeline_mpmd import DraftSide, draft_stage_target_params  # noqa: E402
from jetspec_jax.decoding.results import pooled_hit_rate  # noqa: E402
from jetspec_jax.decoding.session import resolve_proposer  # noqa: E402
from jetspec_jax.decoding.speculative import prefill_speculative  # noqa: E402
from jetspec_jax.decoding.state import Requests  # noqa: E402
from jetspec_jax.flag_paths import require_paths  # noqa: E402
from jetspec_jax.sampling import RowSampling, SamplingParams  # noqa: E402

FORMS = (("single device", None), ("spmd", "spmd"), ("mpmd", "mpmd"))
MB = 1 << 20


def nbytes(tree) -> int:
    """Bytes of a tree of arrays or `ShapeDtypeStruct`s."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def foresight_rule(draft) -> str:
    """Outcome scores with the draft's calibration when it has one ("calibrated" refuses a draft
    without: the random draft has none)."""
    return "calibrated" if draft.calibration is not None else "uncalibrated"


def memory_rows(target, draft, foresight: int, batch: int, capacity: int, max_output: int):
    """`[(form, device 0 (weights, state), device 1 (weights, state))]` in bytes."""
    rule = foresight_rule(draft)
    options = DecodingOptions(
        "jetspec++", foresight=foresight, foresight_rule=rule, pipeline="mpmd"
    )
    proposer, params = resolve_proposer(target, draft, options)
    requests = Requests(
        max_new_tokens=jnp.full((batch,), max_output, jnp.int32),
        stop_token_ids=jnp.full((batch, 1), -1, jnp.int32),
        sampling=RowSampling.from_params([SamplingParams()] * batch),
    )
    prompts = jnp.ones((batch, 64), jnp.int32)
    state = jax.eval_shape(
        lambda: prefill_speculative(
            target.params,
            params,
            prompts,
            jnp.full((batch,), 64, jnp.int32),
            requests,
            config=target.config,
            proposer=proposer,
            capacity=capacity,
            max_output=max_output,
        )
    )
    both = nbytes(target.params) + nbytes(params)
    decode_side = nbytes(state.replace(proposer=None))
    d = state.decode
    mirror = nbytes(DraftSide(None, state.sequence, d.last_token, d.cache.lengths, d.done))
    draft_weights = nbytes(draft_stage_target_params(target.params, proposer.first_target_layer))
    return [
        ("spmd", (both, nbytes(state)), (both, nbytes(state))),
        (
            "mpmd",
            (nbytes(target.params), decode_side),
            (draft_weights + nbytes(params), nbytes(state.proposer) + mirror),
        ),
    ]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft", default=None, help="JetSpec++ checkpoint (default: random)")
    parser.add_argument("--set", default="gsm8k_test", help="a name in ../shared/data/eval/")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--foresight", type=int, default=4)
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS_MD)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    for flag in ("num_prompts", "max_new_tokens", "foresight"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    path = ROOT.parent / "shared" / "data" / "eval" / f"{args.set}.jsonl"
    try:  # not after the target's load
        require_paths("--set", [path])
        require_paths("--draft", [args.draft], directory=True)
    except FileNotFoundError as e:
        parser.error(str(e))

    target = jetspec_jax.load_target(None)
    if args.draft:
        draft = jetspec_jax.load_draft(args.draft, target)
        draft_name = f"`{args.draft}`"
    else:
        draft = jetspec_jax.init_draft(target, variant="jetspec++", num_layers=2, seed=0)
        draft = draft.with_adapter(init_adapter(draft))
        draft_name = "random (2 layers, default adapter)"
    prompts = load_dataset(path, target.tokenizer, limit=args.num_prompts).prompts
    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=[])

    rule = foresight_rule(draft)
    forms = {
        label: dict(
            draft=draft, method="jetspec++", foresight=args.foresight, foresight_rule=rule,
            pipeline=form,
        )
        for label, form in FORMS
    }  # fmt: skip
    for kwargs in forms.values():
        jetspec_jax.generate(target, prompts[0], **kwargs, **common)  # compile
    results = {label: [] for label in forms}
    differ = collections.Counter()
    for ids in prompts:  # every form on prompt i before any on prompt i + 1: drift hits all alike
        want = jetspec_jax.generate(target, ids, **common).tokens
        for label, kwargs in forms.items():
            results[label].append(jetspec_jax.generate(target, ids, **kwargs, **common))
            differ[label] += results[label][-1].tokens != want
    if any(differ.values()):
        for label, count in differ.items():
            print(f"error: {label}: {count} of {len(prompts)} outputs differ from AR's", flush=True)
        sys.exit(1)
    speeds, hits = {}, {}
    for label, runs in results.items():
        speeds[label] = statistics.median(r.decode_tokens_per_second for r in runs)
        hits[label] = pooled_hit_rate(runs)  # rounds after each prompt's first
        print(f"{label}: {speeds[label]:.1f} tokens/s, hit rate {hits[label]:.2f}", flush=True)

    batch, max_output = 4, 256
    capacity = 64 + max_output + draft.config.block_size
    memory = memory_rows(target, draft, args.foresight, batch, capacity, max_output)
    single = speeds["single device"]
    lines = [
        "## The two pipeline forms: memory per device and decode speed",
        "",
        f"- Machine: {machine_line()}; {len(jax.devices())} devices"
        + (" (the CPU split in two, sharing its cores)" if jax.default_backend() == "cpu" else ""),
        f"- Command: `python benchmarks/bench_pipeline.py{changed_flags(args, _parser())}`",
        f"- Setup: SmolLM2-135M-Instruct (float32), draft {draft_name}, JetSpec++ J0 with "
        f"foresight B={args.foresight} ({rule}), greedy; memory for a batch of {batch} rows, "
        f"64 prompt + {max_output} new tokens; speed: {len(prompts)} {args.set} prompts, batch 1, "
        f"{args.max_new_tokens} new tokens, the forms side by side prompt by prompt, median decode "
        "tokens/s; all outputs equal AR's.",
        "",
        "| form | device 0 weights (MB) | device 0 state (MB) | device 1 weights (MB) "
        "| device 1 state (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for form, (w0, s0), (w1, s1) in memory:
        lines.append(f"| {form} | {w0 / MB:.1f} | {s0 / MB:.1f} | {w1 / MB:.1f} | {s1 / MB:.1f} |")
    lines += [
        "",
        "| form | decode tokens/s | vs single device | foresight hit rate |",
        "|---|---:|---:|---:|",
    ]
    for label, _ in FORMS:
        lines.append(
            f"| {label} | {speeds[label]:.1f} | {speeds[label] / single:.2f} | {hits[label]:.2f} |"
        )
    body = "\n".join(lines)
    print(body)
    write_section("bench_pipeline", body, args.out)


if __name__ == "__main__":
    main()
