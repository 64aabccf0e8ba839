"""Tiny tokenizers for the tiny random checkpoints (which ship none), so text endpoints work.

`char_tokenizer()`: one token per printable ASCII character (32..125) plus three special tokens,
97 ids in all: the vocabulary of the tiny models. `with_tokenizer(src, dst)` copies a checkpoint
and adds it (with a short chat template, or none, and `<|im_end|>` as end of sequence).
`metaspace_tokenizer()`: SentencePiece-style, one token per character or word-start space.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

SPECIALS = ["<unk>", "<|im_start|>", "<|im_end|>"]
EOS_ID = 2
# Short on purpose: chat prompts stay within the smallest prompt-length bucket (16).
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'][0] }}:{{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>a:{% endif %}"
)


def char_tokenizer(chat: bool = True) -> transformers.PreTrainedTokenizerFast:
    """A character-level tokenizer of 97 ids (unknown characters map to `<unk>`); `chat`: with
    `CHAT_TEMPLATE`, else without a chat template."""
    chars = [chr(c) for c in range(32, 126)]
    vocab = {token: i for i, token in enumerate(SPECIALS + chars)}
    assert len(vocab) == 97
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()  # characters concatenate, no spaces between tokens
    tokenizer.add_special_tokens(SPECIALS)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="<unk>",
        eos_token="<|im_end|>",
        chat_template=CHAT_TEMPLATE if chat else None,
    )


def metaspace_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """SentencePiece-style: words carry a leading '▁' that decodes to a space, except at the
    start of a text (so decoding a window that starts mid-text drops a space)."""
    pieces = ["<unk>", "▁"] + [chr(c) for c in range(33, 127)]
    tokenizer = Tokenizer(
        models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=[], unk_token="<unk>")
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def with_tokenizer(src: pathlib.Path, dst: pathlib.Path, *, chat: bool = True) -> pathlib.Path:
    """A copy of the checkpoint `src` at `dst` with the character tokenizer (`chat`: with its chat
    template, else without one) and EOS `<|im_end|>`."""
    if not dst.exists():
        shutil.copytree(src, dst)
        char_tokenizer(chat).save_pretrained(dst)
        generation = dst / "generation_config.json"
        config = json.loads(generation.read_text()) if generation.exists() else {}
        config["eos_token_id"] = EOS_ID
        generation.write_text(json.dumps(config))
    return dst
