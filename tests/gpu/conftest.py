"""GPU-suite fixtures."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _restore_tf32_flags():
    """A Trainer turns TF32 on for the whole process (train.tf32, default true); without this, every later fp32
    reference in the same pytest process ran on TF32 (seen on an H100: attention references off by 4.5e-4, a
    resume test at 1.9e-5 against 1e-5). Each test gets the flags it started with back."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
