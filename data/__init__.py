"""Data for megazoo: tokenizers (tokenizer.py, gpt2_bpe.py, sentencepiece_tokenizer.py, and tokenizer_loading.py,
the one loader of a user's tokenizer spec), the stdlib demo corpus, fixed-length token samples and the batch sampler
(token_dataset.py, batches.py), Megatron-style indexed datasets with GPT samples and blending (indexed_dataset.py,
gpt_dataset.py, blending.py), and `megazoo preprocess` (preprocess.py).

Nothing is imported here: import each name from the module that defines it, so that a light module (the command
line's argument tables, a tokenizer) never pays for torch.
"""
