"""Tiny random transformers checkpoints for parity tests (the PyTorch references)."""

from __future__ import annotations

import dataclasses
import pathlib

import jax
import torch
import transformers

# Variants the parity tests cover; each differs from the others in one architectural switch.
VARIANTS = {
    # Qwen3, untied head, GQA 2:1.
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    # A vocabulary of 8: exact token distributions are small enough for statistical tests.
    "qwen3_vocab8": dict(
        model_type="qwen3", vocab_size=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16
    ),
    "qwen3_tied": dict(
        model_type="qwen3",
        tie_word_embeddings=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    # head_dim (24) independent of hidden / heads (64 / 8 = 8), GQA 4:1.
    "qwen3_gqa4_headdim": dict(
        model_type="qwen3", num_attention_heads=8, num_key_value_heads=2, head_dim=24
    ),
    # Llama with Llama-3.1 rope scaling and attention/MLP biases.
    "llama": dict(
        model_type="llama", num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True
    ),
    "llama3_rope_bias": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters=dict(
            rope_type="llama3",
            rope_theta=10000.0,
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
}

# A wide initialisation makes next-token distributions peaked, so greedy decoding has clear winners
# (with transformers' default 0.02, random models produce near-ties that float noise flips).
_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    max_position_embeddings=2048,
    initializer_range=0.1,
)


def hf_config(variant: str) -> transformers.PretrainedConfig:
    kwargs = {**_COMMON, **VARIANTS[variant]}
    model_type = kwargs.pop("model_type")
    cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[model_type]
    return cls(**kwargs)


class CheckpointFactory:
    """Makes each variant (dense or hybrid) once: a saved directory and the torch model it was
    saved from."""

    def __init__(self, root: pathlib.Path):
        self.root = root
        self._made: dict[str, tuple[pathlib.Path, torch.nn.Module]] = {}

    def get(self, variant: str) -> tuple[pathlib.Path, torch.nn.Module]:
        if variant in HYBRID_VARIANTS and variant not in self._made:
            self._made[variant] = make_hybrid_checkpoint(self.root, variant)
        if variant not in self._made:
            torch.manual_seed(sum(map(ord, variant)))
            model = transformers.AutoModelForCausalLM.from_config(hf_config(variant)).float().eval()
            # transformers initialises norms to 1 and biases to 0; randomise them so that a missing
            # or misplaced norm or bias cannot go unnoticed.
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "norm" in name:
                        p.uniform_(0.5, 1.5)
                    elif name.endswith("bias"):
                        p.normal_(0.0, 0.1)
            path = self.root / variant
            model.save_pretrained(path)
            self._made[variant] = (path, model)
        return self._made[variant]


# The Qwen3.5 hybrid (transformers `Qwen3_5ForCausalLM`): Gated DeltaNet and gated-attention layers.
# Grouped value heads (2 key heads serve 4 value heads), Dk != Dv, conv window 4, RoPE on a quarter
# of each 16-channel head; layer 3 (the last) is linear so the final-normed tap is a DeltaNet one.
HYBRID_VARIANTS = {
    "qwen3_5": dict(
        layer_types=[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
        ],
    ),
    # A vocabulary of 8, for the statistical sampling test.
    "qwen3_5_vocab8": dict(
        vocab_size=8,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
    ),
    "qwen3_5_tied": dict(
        tie_word_embeddings=True,
        attention_bias=True,
        layer_types=["full_attention", "linear_attention", "full_attention"],
    ),
    # One kind of layer only: the other kind's stack and cache are empty.
    "qwen3_5_attention_only": dict(layer_types=["full_attention"] * 2),
    "qwen3_5_deltanet_only": dict(layer_types=["linear_attention"] * 2),
}
_HYBRID_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    # Dk = 16 rather than 8: random 8-channel keys are so correlated that the chunk's triangular
    # solve amplifies float noise (in transformers' fp32 reference as much as in ours).
    linear_key_head_dim=16,
    linear_value_head_dim=12,
    max_position_embeddings=2048,
    initializer_range=0.1,
)


def hybrid_hf_config(variant: str) -> transformers.PretrainedConfig:
    kwargs = {**_HYBRID_COMMON, **HYBRID_VARIANTS[variant]}
    kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    return transformers.Qwen3_5TextConfig(**kwargs)


def make_hybrid_checkpoint(
    root: pathlib.Path, variant: str
) -> tuple[pathlib.Path, torch.nn.Module]:
    """A saved tiny random Qwen3.5 text model and the torch model it was saved from."""
    torch.manual_seed(sum(map(ord, variant)))
    model = transformers.Qwen3_5ForCausalLM(hybrid_hf_config(variant)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # scales by w (initialised to 1)
                p.uniform_(0.5, 1.5)
            elif "norm" in name:  # zero-centred: the model scales by 1 + w
                p.uniform_(-0.5, 0.5)
            elif name.endswith("bias") and "dt_bias" not in name:
                p.normal_(0.0, 0.1)
    path = root / variant
    model.save_pretrained(path)
    return path, model


def with_target_norm(draft, target):
    """`draft` with the target's final norm: with `near_bigram(target)` and small draft layers,
    its drafts are accepted now and then."""
    params = {**draft.params, "norm": {"scale": target.params["norm"]["scale"]}}
    return dataclasses.replace(draft, params=params)


def near_bigram(target, scale=0.03):
    """`target` (a loaded `Target`) with its layers' residual contributions shrunk (attention's,
    Gated DeltaNet's and the MLP's output projections): next tokens depend mostly on the current
    token, which an untrained draft that shares the embedding, LM head and final norm partly
    predicts, so speculative rounds accept some drafts (a random pair would accept none, and
    outcome checks would hold whatever the block)."""

    def shrink(path, x):
        names = {getattr(key, "key", None) for key in path}
        return x * scale if names & {"o_proj", "out_proj", "down_proj"} else x

    return dataclasses.replace(
        target, params=jax.tree_util.tree_map_with_path(shrink, target.params)
    )
