"""Statistical losslessness: speculative sampling draws from the target's distribution.

On a target with 8 tokens, the first five generated tokens of 16384 requests (distinct seeds) are
compared with their exact distributions computed from the target, every prefix enumerated (token
2 ~ sum_t p(t | prompt) p(. | prompt, t), ...). With blocks of 4, token 2 is the target's own draw
at round 1's anchor whatever the drafts; tokens 3..5 are accepted drafts or the bonus after a
rejection, and then round 2 from the rolled-back cache: they carry the verification. Each token's
Pearson chi-square (degrees of freedom: its support - 1) is held to its 1 - 0.001/5 quantile
(Bonferroni: the tokens of a row are dependent), so a correct sampler fails with probability
< 0.001; `test_the_statistic_detects_a_two_percent_error` shows by simulation that a 2%
total-variation error in one token fails it (its docstring: how the power depends on the error's
shape). On the Qwen3.5 hybrid most rows reject in round 1,
so their later tokens follow a Gated DeltaNet rollback.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import numpy as np
import pytest
from scipy import stats

import jetspec_jax
from jetspec_jax.sampling import RowSampling, SamplingParams, filter_logits

N = 16384
PROMPT = [3, 1, 4, 1, 5]
BLOCK = 4
NUM_TOKENS = BLOCK + 1  # the anchor's draw, then everything round 1's verification decides
FALSE_ALARM = 1e-3


def _bound(dof: int, tests: int = NUM_TOKENS) -> float:
    """The chi-square quantile one of `tests` tokens must stay under (Bonferroni)."""
    return float(stats.chi2.ppf(1 - FALSE_ALARM / tests, dof))


def _exact(target, prompt, params: SamplingParams, num_tokens: int) -> list[np.ndarray]:
    """Exact distributions of each of the first `num_tokens` generated tokens, from one forward
    of every continuation `s` of `num_tokens - 1` tokens (one compiled program): the model is
    causal, so position k of `s` on reads p(. | prompt, s[:k]), and token k+1's distribution is
    the sum over prefixes s[:k] of their probabilities times it (e.g. token 2 ~ sum_t p(t |
    prompt) p(. | prompt, t)), each prefix held by vocab**(num_tokens - 1 - k) rows."""
    vocab = target.config.vocab_size
    rest = np.asarray(list(itertools.product(range(vocab), repeat=num_tokens - 1)), np.int32)
    rows = np.concatenate([np.tile(np.asarray(prompt, np.int32), (len(rest), 1)), rest], axis=1)
    logits = target.logits(rows)[:, len(prompt) - 1 :]  # [rows, num_tokens, V]
    row = RowSampling.from_params([params] * len(rows))
    filtered = filter_logits(logits, row.temperature, row.top_k, row.top_p)
    p = np.asarray(jax.nn.softmax(filtered, axis=-1)).astype(np.float64)
    marginals, prefix = [], np.ones(len(rows))  # each row's probability of its first k tokens
    for k in range(num_tokens):
        marginals.append(prefix @ p[:, k] / vocab ** (num_tokens - 1 - k))
        if k < num_tokens - 1:
            prefix = prefix * p[np.arange(len(rows)), k, rest[:, k]]
    return marginals


def _sample(target, method: str, params: SamplingParams, num_tokens: int):
    """The first `num_tokens` tokens of N requests for `PROMPT` (seeds 0..N-1) with a random
    draft of `method`, and the drafts each accepted in round 1: `[N, num_tokens]`, `[N]`. The
    prompts are prefilled at their own width (a prefill chunk of `len(PROMPT)`), not padded to
    the 16 positions of the smallest length bucket: a third of the prefill's work for N rows."""
    draft = jetspec_jax.init_draft(target, variant=method, block_size=BLOCK, init_std=0.5, seed=7)
    results = jetspec_jax.generate_batch(
        target,
        [PROMPT] * N,
        draft=draft,
        method=method,
        max_new_tokens=num_tokens,
        sampling=[dataclasses.replace(params, seed=s) for s in range(N)],
        stop_token_ids=[],
        prefill_chunk=len(PROMPT),
    )
    tokens = np.asarray([r.tokens for r in results])
    return tokens, np.asarray([r.outcomes[0][0] for r in results])


def _chi2(samples, probs) -> tuple[float, int]:
    """Pearson's statistic of `samples` against `probs`, and its degrees of freedom."""
    counts = np.bincount(samples, minlength=len(probs))
    assert np.all(counts[probs == 0] == 0), "a token outside the support was drawn"
    kept = probs > 0
    expected = probs[kept] * len(samples)
    return float(np.sum((counts[kept] - expected) ** 2 / expected)), int(kept.sum()) - 1


def _check_tokens(tokens, marginals) -> None:
    for i, probs in enumerate(marginals):
        chi2, dof = _chi2(tokens[:, i], probs)
        assert chi2 < _bound(dof), (f"token {i + 1}", chi2, dof)


@pytest.mark.parametrize(
    "method, temperature, top_p", [("jetspec++", 1.0, 0.9), ("dflash", 0.7, 1.0)]
)
def test_speculative_samples_follow_the_target_distribution(
    checkpoints, method, temperature, top_p
):
    target = jetspec_jax.load_target(checkpoints.get("qwen3_vocab8")[0])
    params = SamplingParams(temperature=temperature, top_p=top_p)
    tokens, accepted = _sample(target, method, params, NUM_TOKENS)
    assert 0.05 < np.mean(accepted > 0) < 0.95, "the test needs both acceptances and rejections"
    _check_tokens(tokens, _exact(target, PROMPT, params, NUM_TOKENS))


def test_speculative_samples_on_a_hybrid_target_follow_its_distribution(checkpoints):
    """Qwen3.5 hybrid: most rows reject in round 1, so their later tokens are drawn from Gated
    DeltaNet states rolled back to the committed prefix. This checks the sampling law on the
    hybrid's decode path, not the rollback itself: a recurrent state left un-rolled-back passed
    it (2026-12-06), while the greedy `test_qwen3_5_rollback.py` fails on it at once."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3_5_vocab8")[0])
    params = SamplingParams(temperature=1.0)
    tokens, accepted = _sample(target, "jetspec", params, NUM_TOKENS)
    assert 0.5 < np.mean(accepted == 0) < 0.95, "most rows must reject, and roll back, in round 1"
    _check_tokens(tokens, _exact(target, PROMPT, params, NUM_TOKENS))


def test_the_statistic_detects_a_two_percent_error():
    """Power check: samples of one token off by TV 0.02, moved from the four least likely of 8
    tokens (mass 0.15) to the others in proportion, fail the bound of `_check_tokens` for 7
    degrees of freedom (power ~0.99 by the noncentral chi-square). The least visible 2% error,
    split between halves of mass 1/2, would fail it ~65% of the time; 3% ~99.8%."""
    rng = np.random.default_rng(0)
    probs = rng.random(8) ** 2
    probs = probs / probs.sum()
    low, high = np.argsort(probs)[:4], np.argsort(probs)[4:]
    off = probs.copy()
    off[high] += 0.02 * probs[high] / probs[high].sum()
    off[low] -= 0.02 * probs[low] / probs[low].sum()
    failures = sum(_chi2(rng.choice(8, N, p=off), probs)[0] > _bound(7) for _ in range(50))
    assert failures >= 45
