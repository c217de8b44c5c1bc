"""Megatron-LM 8.3B, Turing-NLG 17B, 100B-class, GPT-3 175B and 1T presets (GPT-2 vocabulary, GPT-2 block)."""

from megazoo.models.config import ModelConfig

PRESETS = (
    # Shoeybi et al. 2019, table 1: 72 layers, hidden 3072, 32 heads, 1024 positions.
    ModelConfig("megatron-8.3b", n_layer=72, n_head=32, d_model=3072, n_positions=1024),
    # Microsoft Turing-NLG (2020): 78 layers, hidden 4256, 28 heads, 1024 positions: 17.18 B parameters.
    ModelConfig("tnlg-17b", n_layer=78, n_head=28, d_model=4256, n_positions=1024),
    # ZeRO (Rajbhandari et al. 2020) 100B-class model: 125 layers, hidden 8192 (~101 B parameters).
    ModelConfig("gpt-100b", n_layer=125, n_head=64, d_model=8192, n_positions=2048),
    # GPT-3 175B (Brown et al. 2020): 96 layers, hidden 12288, 96 heads, 2048 positions.
    ModelConfig("gpt3-175b", n_layer=96, n_head=96, d_model=12288, n_positions=2048),
    # The trillion-parameter shape of Narayanan et al. 2021 ("Efficient Large-Scale Language Model Training on GPU
    # Clusters Using Megatron-LM", table 1): 128 layers, hidden 25600, 160 heads, 2048 positions; with the GPT-2
    # vocabulary (the paper: 51,200) 1,008,014,617,600 parameters. Target of recipes/gpt-1t.toml (DeepSpeed's 3D
    # parallelism announcement, 2020: a trillion parameters on ~800 V100s).
    ModelConfig("gpt-1t", n_layer=128, n_head=160, d_model=25600, n_positions=2048),
)
