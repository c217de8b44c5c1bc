"""GPT-2 presets (Radford et al. 2019), plus a tiny one for tests and the demo."""

from megazoo.models.config import ModelConfig

PRESETS = (
    ModelConfig("gpt2-tiny", n_layer=4, n_head=4, d_model=128, n_positions=256),
    ModelConfig("gpt2-117m", n_layer=12, n_head=12, d_model=768),
    ModelConfig("gpt2-345m", n_layer=24, n_head=16, d_model=1024),
    ModelConfig("gpt2-774m", n_layer=36, n_head=20, d_model=1280),
    ModelConfig("gpt2-1.5b", n_layer=48, n_head=25, d_model=1600),
)
