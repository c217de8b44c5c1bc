"""DeepSeek-V2/V3 and Kimi K2: multi-head latent attention (mla.py), YaRN rope scaling (yarn.py), the checks of
their config fields (fields.py, checks.py), the presets (presets.py) and multi-token prediction (mtp.py,
mtp_hf.py). The MoE routing they use is models/moe/'s
(`moe_router = "sigmoid_bias"`). Kept import-light: models/config.py imports fields.py from here."""
