"""`ContinuousBatch`: a `DecodeSession` whose finished rows take new requests, named by keys.

The bookkeeping of continuous batching, shared by the server's scheduler and
`generate_as_completed`: which request (key) each row holds, which finished requests have been
answered (their rows are free), and admission into the free rows: first the rows answered
requests left, then the batch's unused padding rows, in order (`DecodeSession.admit_many`).

    batch = ContinuousBatch(DecodeSession(...), keys)   keys: one per request of the session
    batch.start()
    loop:  batch.poll()          new tokens per key
           batch.cancel(key)     stop a request at the next chunk boundary
           batch.take_finished() results of the requests done since; their rows become free
           batch.admit(key, ...) a new request in the first free row (if `batch.fits` it)
           batch.admit_many([...]) several, prefilled together
           batch.advance(steps)  until `batch.done`
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from jetspec_jax.decoding.results import GenerationResult, Timing
from jetspec_jax.decoding.session import GREEDY, DecodeSession
from jetspec_jax.sampling import SamplingParams


class ContinuousBatch:
    """Rows of one `DecodeSession`, each holding the request of a key (any hashable; each key
    once at a time). Not thread-safe: one thread drives it, as its session."""

    def __init__(self, session: DecodeSession, keys: Sequence[Hashable]):
        """Takes over `session`'s rows.

        Args:
            session: a new session (not started), one request per row.
            keys: one per request of `session`, in row order, all different.

        Raises:
            ValueError: not one key per request, or a key twice.
        """
        if len(keys) != session.num_rows:
            raise ValueError(f"{len(keys)} keys for a session of {session.num_rows} requests")
        if len(set(keys)) != len(keys):
            raise ValueError("a key is given twice: each names one request")
        self.session = session
        self._keys = list(keys)  # the key of each row's latest request
        self._answered = [False] * len(keys)  # its result was taken: the row is free

    def start(self) -> None:
        """The session's prefill (every first request commits its first token)."""
        self.session.start()

    def poll(self) -> list[tuple[Hashable, list[int]]]:
        """`(key, new tokens)` of every request that committed tokens since the last poll."""
        new = self.session.poll()
        return [(self._keys[row], tokens) for row, tokens in enumerate(new) if tokens]

    def cancel(self, key: Hashable) -> None:
        """Stops `key`'s request at the next chunk boundary (if it still runs).

        Raises:
            ValueError: `key` holds no row (never admitted, or its result was taken).
        """
        row = self._row(key)
        if not self.session.row_done[row]:
            self.session.cancel(row)

    def running(self) -> list[Hashable]:
        """The keys of requests not finished at the last poll."""
        done = self.session.row_done
        return [key for row, key in enumerate(self._keys) if not done[row]]

    def take_finished(self) -> list[tuple[Hashable, GenerationResult]]:
        """`(key, result)` of every request done at the last poll and not taken yet; their rows
        are free from then on."""
        finished = []
        for row, done in enumerate(self.session.row_done):
            if done and not self._answered[row]:
                self._answered[row] = True
                finished.append((self._keys[row], self.session.result(row)))
        return finished

    @property
    def free_rows(self) -> int:
        """Rows a request can be admitted into: those of taken results, and unused padding."""
        unused = self.session.batch_size - len(self._keys)
        return sum(self._answered) + unused

    def fits(self, prompt_length: int, max_new_tokens: int) -> bool:
        """Whether such a request fits the session's shapes (`DecodeSession.fits`)."""
        return self.session.fits(prompt_length, max_new_tokens)

    def admit(
        self,
        key: Hashable,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> None:
        """Starts `key`'s request in the first free row: `admit_many` of one request."""
        self.admit_many([(key, prompt, max_new_tokens, sampling)])

    def admit_many(
        self, requests: Sequence[tuple[Hashable, Sequence[int], int, SamplingParams]]
    ) -> None:
        """Starts each `(key, prompt, max_new_tokens, sampling)` request in the next free row,
        prefilled together (`DecodeSession.admit_many`).

        Raises:
            ValueError: fewer free rows than requests, a key twice or holding a row already, or
                the session refuses a request (see `DecodeSession.admit_many`); then none is
                admitted.
        """
        keys = [key for key, *_ in requests]
        if len(set(keys)) != len(keys):
            raise ValueError(f"keys {keys}: a key is given twice")
        for key in keys:
            if self._rows_of(key):
                raise ValueError(f"{key!r} holds a row already")
        if len(requests) > self.free_rows:
            raise ValueError(
                f"no free row for {len(requests) - self.free_rows} of the {len(requests)} "
                f"requests in the batch of {self.session.batch_size}"
            )
        answered = [row for row, done in enumerate(self._answered) if done]
        unused = range(len(self._keys), self.session.batch_size)
        rows = (answered + list(unused))[: len(requests)]
        self.session.admit_many(
            rows,
            [prompt for _, prompt, _, _ in requests],
            max_new_tokens=[budget for _, _, budget, _ in requests],
            sampling=[sampling for *_, sampling in requests],
        )
        for row, key in zip(rows, keys, strict=True):
            if row == len(self._keys):
                self._keys.append(key)
                self._answered.append(False)
            else:
                self._keys[row], self._answered[row] = key, False

    @property
    def done(self) -> bool:
        """Every request had finished at the last poll."""
        return self.session.done

    def advance(self, max_steps: int) -> None:
        """`DecodeSession.advance`."""
        self.session.advance(max_steps)

    @property
    def timing(self) -> Timing:
        """The session's times so far."""
        return self.session.timing

    def _row(self, key: Hashable) -> int:
        """The row holding `key`'s request; ValueError if none does."""
        rows = self._rows_of(key)
        if not rows:
            raise ValueError(f"{key!r} holds no row")
        return rows[0]

    def _rows_of(self, key: Hashable) -> list[int]:
        """The rows whose request of `key` was not taken yet (at most one)."""
        return [row for row, k in enumerate(self._keys) if k == key and not self._answered[row]]
