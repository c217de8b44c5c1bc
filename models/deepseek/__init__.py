"""DeepSeek-V3's model pieces (issue 41): multi-token prediction (mtp.py)."""
