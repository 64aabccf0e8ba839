"""jetspec_jax: JetSpec++ speculative decoding in JAX.

Public API:
    load_target(path=None, dtype="float32") -> Target
    load_draft(path, target) / init_draft(target, *, seed=0, **architecture) -> Draft
    default_draft_dir() -> Path (the JetSpec++ checkpoint shipped for the default target)
    generate(target, prompt_ids, *, draft=None, ..., **decoding) -> GenerationResult
        (`**decoding`: the fields of DecodingOptions, `method="ar"` and the rest; every entry
        point takes them so)
    generate_batch(target, prompts, *, ...) -> list[GenerationResult]
    generate_as_completed(target, prompts, *, max_batch_size=8, ...) -> iterator of
        (index, GenerationResult) as each prompt finishes (continuous batching)
    stream(target, prompt_ids, *, chunk_steps=8, ...) -> TokenStream (chunks of new token ids)
    DecodingOptions (how a batch is decoded: the entry points' `**decoding` as one value, the
        form the server and `DecodeSession` take), SamplingParams, CheckpointError
"""

from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.default_model import default_draft_dir
from jetspec_jax.draft import Draft, init_draft, load_draft
from jetspec_jax.generate import (
    METHODS,
    GenerationResult,
    Timing,
    TokenStream,
    generate,
    generate_as_completed,
    generate_batch,
    stream,
)
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.target import Target, load_target

__all__ = [
    "METHODS",
    "CheckpointError",
    "DecodingOptions",
    "Draft",
    "GenerationResult",
    "SamplingParams",
    "Target",
    "Timing",
    "TokenStream",
    "default_draft_dir",
    "generate",
    "generate_as_completed",
    "generate_batch",
    "init_draft",
    "load_draft",
    "load_target",
    "stream",
]
