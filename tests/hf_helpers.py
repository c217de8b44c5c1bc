"""A random tiny Hugging Face GPT-2 (no download) for the interop, fine-tuning and reproduce tests."""

from __future__ import annotations

import torch
from transformers import GPT2Config, GPT2LMHeadModel

VOCAB = 50257


def tiny_hf_model(seed: int = 0, vocab: int = VOCAB) -> GPT2LMHeadModel:
    """A random 2-layer GPT-2; a wide init (std 0.1) gives peaked logits, so mismatches would show."""
    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=128, vocab_size=vocab, initializer_range=0.1)
    return GPT2LMHeadModel(cfg).eval()


# Tiny random Llama-style HF models of each family `megazoo convert` reads (no download): grouped-query attention,
# untied (llama, mistral) or tied (qwen2) heads, qkv bias (qwen2), llama3 rope scaling, a sliding window (mistral).
FAMILY_VOCAB = 300
_FAMILY_COMMON = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


def tiny_family_model(family: str, seed: int = 0):
    """A random tiny HF LlamaForCausalLM / Qwen2ForCausalLM / MistralForCausalLM, biases and norms random too."""
    import transformers

    configs = {
        "llama": lambda: transformers.LlamaConfig(**_FAMILY_COMMON, tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)),
        "qwen2": lambda: transformers.Qwen2Config(**_FAMILY_COMMON, tie_word_embeddings=True,
                                                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        "mistral": lambda: transformers.MistralConfig(**_FAMILY_COMMON, tie_word_embeddings=False, sliding_window=6,
                                                      rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
    }
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(configs[family]())
    with torch.no_grad():  # HF initialises biases to 0 and norms to 1: random ones, so a dropped one would show
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def tiny_hf_tokenizer(special=("<s>", "</s>")):
    """A byte-level BPE of fewer than FAMILY_VOCAB ids with bos / eos, as an HF fast tokenizer (trained here)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=list(special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def main():\n    return tokens\n", "the quick brown fox jumps over the dog"] * 20,
                            trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=special[0], eos_token=special[1])


def save_family_dir(family: str, path):
    """An HF folder of `family` with its tokenizer, as downloaded models come."""
    tiny_family_model(family).save_pretrained(str(path))
    tiny_hf_tokenizer().save_pretrained(str(path))
    return path
