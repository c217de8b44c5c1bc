"""Recipes: TOML configs, their resolution, the training loop and the `megazoo` command line."""
