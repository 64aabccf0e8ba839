"""Timed runs of every method on every prompt, and their per-dataset summaries.

Prompts run one at a time (batch 1: the latency setting the field reports), side by side: every
method decodes prompt i (AR first) before any decodes prompt i + 1, so load that comes and goes on
a shared machine falls on all methods alike and speedups compare like with like. Compilation is
excluded (ahead-of-time per shape bucket, timed apart); `warmup` untimed runs per method first
settle allocations. With temperature > 0 the seed of prompt i is i for every method: a lossless
method then draws exactly the AR tokens too.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import tqdm

from jetspec_jax.bench.datasets import Dataset
from jetspec_jax.bench.methods import MethodSpec
from jetspec_jax.console import bar_disabled
from jetspec_jax.decoding.request_checks import check_budget
from jetspec_jax.decoding.session import resolve_proposer
from jetspec_jax.generate import generate

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Sample:
    """One prompt under one method and temperature."""

    dataset: str
    prompt_id: str
    method: str
    temperature: float
    prompt_tokens: int
    new_tokens: int
    rounds: int  # target forwards after the prefill
    tau: float
    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float
    finish_reason: str
    matches_ar: bool | None  # speculative methods: tokens equal AR's (same seed); None for AR
    foresight_hits: int | None  # hits in the rounds after the first (None: no foresight)


@dataclasses.dataclass(frozen=True)
class Summary:
    """One (dataset, temperature, method) row.

    Attributes:
        tau: pooled: all committed tokens after the first / all verification rounds (1.0 when
            every prompt's first token was its only one, as `GenerationResult.tau` reads it).
        decode_tokens_per_second: pooled over the dataset's decode time.
        speedup: decode tokens/s over AR's on the same prompts (this run).
        prefill_ms: mean prefill time per prompt.
        round_ms: mean time of one target forward (AR) / verification round (speculative).
        matches_ar: prompts whose output equals AR's, of `prompts` (sampled: with the same
            seed, which a lossless method draws exactly as AR does); None for AR itself.
        foresight_hit_rate: pooled over the rounds after each prompt's first (the first cannot
            hit); None for methods without foresight.
    """

    dataset: str
    temperature: float
    method: str
    prompts: int
    new_tokens: int
    tau: float
    decode_tokens_per_second: float
    speedup: float
    prefill_ms: float
    round_ms: float
    compile_seconds: float
    matches_ar: int | None
    foresight_hit_rate: float | None


def run_benchmark(
    target,
    datasets: Sequence[Dataset],
    methods: Sequence[MethodSpec],
    drafts: dict,
    *,
    temperatures: Sequence[float] = (0.0,),
    max_new_tokens: int = 256,
    warmup: int = 1,
    show_progress: bool | None = None,
    on_sample: Callable[[Sample], None] | None = None,
) -> tuple[list[Sample], list[Summary]]:
    """Runs every method on every prompt at every temperature.

    Args:
        target: the loaded target.
        datasets: encoded prompt sets.
        methods: what to compare; must include "ar" (the baseline).
        drafts: draft per variant (`MethodSpec.method`), which serves that variant's methods.
        temperatures: 0 = greedy.
        max_new_tokens: budget per prompt.
        warmup: untimed runs of each dataset's first prompt per method and temperature.
        show_progress: a tqdm bar over the timed runs; None: only on a terminal.
        on_sample: called with each sample as it is measured (to keep what an interrupted run
            finished).

    Returns:
        `(samples, summaries)`.

    Raises:
        ValueError: no "ar" among the methods, a method its draft cannot serve, a prompt too
            long for `max_new_tokens` more tokens, or a repeated dataset name, method or
            temperature (their rows would merge; all checked before any run).
    """
    if not any(m.method == "ar" for m in methods):
        raise ValueError("the methods must include 'ar', the baseline of the speedups")
    for what, names in (
        ("dataset", [data.name for data in datasets]),
        ("method", [m.name for m in methods]),
        ("temperature", list(temperatures)),
    ):
        repeated = sorted({str(n) for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(
                f"{what} {', '.join(repeated)} given twice: the summary rows are keyed by "
                "(dataset, temperature, method), so their results would merge"
            )
    # Every pairing (an adapter for -R/-F, two devices for a pipeline, a draft that fits the
    # target) and every prompt's budget is checked before any run: a bad one fails at once, not
    # after hours of runs whose results would then go unwritten.
    for m in methods:
        if m.speculative and m.method not in drafts:
            raise ValueError(f"method {m.name!r} needs a {m.method!r} draft")
        try:
            resolve_proposer(target, drafts[m.method] if m.speculative else None, m.options)
        except ValueError as e:
            raise ValueError(f"method {m.name!r}: {e}") from None
    for data in datasets:
        for prompt_id, prompt in zip(data.ids, data.prompts, strict=True):
            try:
                check_budget(target.config, len(prompt), max_new_tokens)
            except ValueError as e:
                raise ValueError(f"{data.name} prompt {prompt_id!r}: {e}") from None
    # AR first: the other methods' greedy tokens are checked against it.
    ordered = sorted(methods, key=lambda m: m.method != "ar")
    samples: list[Sample] = []
    runs = len(temperatures) * len(methods) * sum(len(data.prompts) for data in datasets)
    progress = tqdm.tqdm(
        total=runs,
        desc="bench",
        unit="run",  # a method on a prompt at a temperature
        disable=bar_disabled(show_progress),
    )
    with progress:
        for temperature in temperatures:
            for data in datasets:
                settings = dict(temperature=temperature, max_new_tokens=max_new_tokens)
                samples += _side_by_side(
                    target, data, ordered, drafts, settings, warmup, progress, on_sample
                )
    return samples, summarize(samples, baseline=ordered[0].name)


def _side_by_side(
    target, data, methods, drafts, settings, warmup, progress, on_sample
) -> list[Sample]:
    """Every method on prompt i (the first of `methods` is AR) before any on prompt i + 1."""

    def one(m: MethodSpec, i: int):
        draft = drafts[m.method] if m.speculative else None
        options = dataclasses.asdict(m.options)
        return generate(target, data.prompts[i], draft=draft, **options, **settings, seed=i)

    temperature = settings["temperature"]
    logger.info("%s, T=%g: %d prompts", data.name, temperature, len(data.prompts))
    for m in methods:
        for _ in range(warmup):
            one(m, 0)
    samples = []
    for i, prompt_id in enumerate(data.ids):
        for m in methods:
            progress.set_postfix_str(f"{data.name} T={temperature:g} {m.name}")
            result = one(m, i)
            if m.method == "ar":
                ar_tokens, matches = result.tokens, None
            else:
                matches = result.tokens == ar_tokens
            samples.append(_sample(data.name, prompt_id, m, temperature, result, matches))
            if on_sample is not None:
                on_sample(samples[-1])
            progress.update()
    return samples


def _sample(dataset: str, prompt_id: str, m: MethodSpec, temperature, result, matches) -> Sample:
    t = result.timing
    return Sample(
        dataset=dataset,
        prompt_id=prompt_id,
        method=m.name,
        temperature=temperature,
        prompt_tokens=result.prompt_length,
        new_tokens=len(result.tokens),
        rounds=max(len(result.acceptance_lengths) - 1, 0),
        tau=result.tau,
        prefill_seconds=t.prefill_seconds,
        decode_seconds=t.decode_seconds,
        compile_seconds=t.compile_seconds,
        finish_reason=result.finish_reason,
        matches_ar=matches,
        # The first round cannot hit: nothing was drafted ahead for it.
        foresight_hits=sum(result.foresight_hits[1:]) if m.options.foresight else None,
    )


def summarize(samples: Sequence[Sample], baseline: str = "ar") -> list[Summary]:
    """Pooled per-(dataset, temperature, method) rows, in first-seen order; speedups are over
    the method named `baseline` (0.0 where it has no row)."""
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        groups.setdefault((s.dataset, s.temperature, s.method), []).append(s)
    rates = {key: _rate(group) for key, group in groups.items()}
    summaries = []
    for (dataset, temperature, method), group in groups.items():
        decoded = sum(max(s.new_tokens - 1, 0) for s in group)
        rounds = sum(s.rounds for s in group)
        decode_seconds = sum(s.decode_seconds for s in group)
        ar_rate = rates.get((dataset, temperature, baseline))
        checked = [s.matches_ar for s in group if s.matches_ar is not None]
        summaries.append(
            Summary(
                dataset=dataset,
                temperature=temperature,
                method=method,
                prompts=len(group),
                new_tokens=sum(s.new_tokens for s in group),
                # No rounds: every prompt stopped at the prefill's token, tau 1.0 as each
                # sample's (0.0 only without any token).
                tau=decoded / rounds if rounds else float(any(s.new_tokens for s in group)),
                decode_tokens_per_second=rates[(dataset, temperature, method)],
                speedup=rates[(dataset, temperature, method)] / ar_rate if ar_rate else 0.0,
                prefill_ms=1e3 * sum(s.prefill_seconds for s in group) / len(group),
                round_ms=1e3 * decode_seconds / rounds if rounds else 0.0,
                compile_seconds=sum(s.compile_seconds for s in group),
                matches_ar=sum(checked) if checked else None,
                foresight_hit_rate=_hit_rate(group),
            )
        )
    return summaries


def _rate(group: Sequence[Sample]) -> float:
    decoded = sum(max(s.new_tokens - 1, 0) for s in group)
    seconds = sum(s.decode_seconds for s in group)
    return decoded / seconds if seconds > 0 else 0.0


def _hit_rate(group: Sequence[Sample]) -> float | None:
    if any(s.foresight_hits is None for s in group):
        return None
    chances = sum(max(s.rounds - 1, 0) for s in group)
    return sum(s.foresight_hits for s in group) / chances if chances else 0.0
