"""Model definitions: one GPT-style decoder and the preset registries of each family."""
