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


# Tiny random HF models of each family `megazoo convert` reads (no download).
FAMILY_VOCAB = 300
_FAMILY_COMMON = dict(vocab_size=FAMILY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5)


DENSE_FAMILIES = ("llama", "mistral", "qwen2")
MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3", "qwen3_moe")


def tiny_family_config(family: str, width: int = 64, vocab: int = FAMILY_VOCAB, positions: int = 64):
    """The tiny HF config of `family` that every conversion test builds on: 4 query heads over 2 key/value heads,
    FFN widths as fractions of `width`, and each family's own twist (llama3 rope scaling, qkv bias and a tied head,
    a sliding window, routed / shared experts, q/k norms, dense layers among the MoE ones)."""
    import transformers

    half, ff = width // 2, width * 3 // 2
    common = dict(vocab_size=vocab, hidden_size=width, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=positions, rms_norm_eps=1e-5)
    default_rope = dict(rope_type="default", rope_theta=10000.0)
    configs = {
        "llama": lambda: transformers.LlamaConfig(**common, intermediate_size=ff, num_hidden_layers=2,
                                                  tie_word_embeddings=False, rope_parameters=dict(
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=16)),
        "qwen2": lambda: transformers.Qwen2Config(**common, intermediate_size=ff, num_hidden_layers=2,
                                                  tie_word_embeddings=True,
                                                  rope_parameters=dict(rope_type="default", rope_theta=1000000.0)),
        "mistral": lambda: transformers.MistralConfig(**common, intermediate_size=ff, num_hidden_layers=2,
                                                      tie_word_embeddings=False, sliding_window=6,
                                                      rope_parameters=default_rope),
        "mixtral": lambda: transformers.MixtralConfig(**common, intermediate_size=half, num_hidden_layers=2,
                                                      num_local_experts=4, num_experts_per_tok=2,
                                                      rope_parameters=default_rope),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**common, intermediate_size=ff, moe_intermediate_size=half,
                                                         num_hidden_layers=3, num_experts=4, num_experts_per_tok=2,
                                                         head_dim=half, norm_topk_prob=False, mlp_only_layers=[1],
                                                         rope_parameters=default_rope),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**common, intermediate_size=ff, moe_intermediate_size=half,
                                                         shared_expert_intermediate_size=width * 3 // 4,
                                                         num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
                                                         decoder_sparse_step=2, rope_parameters=default_rope),
        "qwen3": lambda: transformers.Qwen3Config(**common, intermediate_size=ff, num_hidden_layers=2, head_dim=half,
                                                  tie_word_embeddings=True, rope_parameters=default_rope),
    }
    return configs[family]()


def random_hf_model(config, seed: int = 0, noise: float = 0.1):
    """The HF model of `config` with random biases, norm weights and router rows as well (HF initialises them to 0
    / 1 / small), so a dropped or misplaced one would show; eager attention, in eval mode."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or ".gate." in name or name.endswith("gate.weight"):
                p.add_(torch.randn_like(p) * noise)
    return model.eval()


def tiny_family_model(family: str, seed: int = 0, noise: float = 0.1, **config):
    """A random tiny HF model of `family` (tiny_family_config's), biases and norms random too."""
    return random_hf_model(tiny_family_config(family, **config), seed, noise)


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


def safetensors_state(folder) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `folder` (one dict; shards merged)."""
    from safetensors import safe_open

    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({name: f.get_tensor(name) for name in f.keys()})
    return out


def save_family_dir(family: str, path):
    """An HF folder of `family` with its tokenizer, as downloaded models come."""
    tiny_family_model(family).save_pretrained(str(path))
    tiny_hf_tokenizer().save_pretrained(str(path))
    return path


def transformers_greedy_text(hf_dir, prompt: str, new_tokens: int) -> str:
    """transformers' greedy generate() on an HF folder (eager attention, fp32), decoded up to its first eos: what
    `megazoo generate` must print for the same prompt."""
    import transformers

    from megazoo.data.tokenizers.loading import load_tokenizer
    tokenizer = load_tokenizer(f"hf:{hf_dir}")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    ids, eos = tokenizer.encode(prompt), tokenizer.eod_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=eos,
                             pad_token_id=eos)[0, len(ids):].tolist()
    return tokenizer.decode(out[:out.index(eos)] if eos in out else out)
