"""`megazoo generate --ep E` on an MoE model: E workers (x --tp), each holding 1/E of every MoE layer's routed experts
(read from the checkpoint: only its own), decode the same tokens in step and rank 0 prints. Greedy text equals
ep 1 and transformers' own generate() on the HF folder, token for token:

  * a tiny Mixtral (4 experts, top-2) converted to a checkpoint, at ep 2;
  * a tiny DeepSeek-V3 (latent attention decoded over the latent cache, sigmoid + bias routing over expert groups,
    shared experts, a dense first layer) from its HF folder, at ep 2 and at tp 2 x ep 2;

each as the command's torchrun workers run it: forked ranks calling the command's own work function with the
Topology the workers build (workers/local.tp_worker; the relaunch itself is `eval --ep`'s, tested under torchrun in
tests/eval/test_eval_ep.py and tests/eval/test_moe_eval.py).
"""

from __future__ import annotations

import argparse

import pytest
import torch
import transformers
from harness import run_distributed
from hf_helpers import random_hf_model, save_family_dir, tiny_hf_tokenizer, transformers_greedy_text

from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo

PROMPT = "def main():\n    return"
NEW = 10



def _parser() -> argparse.ArgumentParser:
    from megazoo.recipes.generate_cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser


def test_mixtral_generate_ep2_prints_what_ep1_and_transformers_print(tmp_path, capfd):
    """The checkpoint at ep 2 (each worker reads its own two experts), as `generate CKPT --ep 2`'s torchrun workers
    run it (workers/local.tp_worker builds Topology.build(dp=ep, tp=world / ep, ep=ep) and calls the command's
    `_decode_and_print`): rank 0 prints the text of ep 1, once; the relaunch forwards --ep."""
    from megazoo.recipes.generate_cli import _decode_and_print, _forwarded_argv

    hf, ckpt = save_family_dir("mixtral", tmp_path / "hf"), tmp_path / "ckpt"
    assert megazoo(["convert", "hf-to-megazoo", str(hf), "--out", str(ckpt)]) == 0
    capfd.readouterr()
    assert megazoo(["generate", "--hf", str(hf), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    ep1 = capfd.readouterr().out
    assert ep1 == transformers_greedy_text(hf, PROMPT, NEW) + "\n" and ep1.strip()
    args = _parser().parse_args([str(ckpt), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--ep", "2"])
    assert _parser().parse_args(_forwarded_argv(args)).ep == 2
    capfd.readouterr()
    run_distributed(lambda: _decode_and_print(args, Topology.build(dp=2, tp=1, ep=2)), 2)
    assert capfd.readouterr().out == ep1  # printed once, by rank 0


def _deepseek_dir(path):
    """A tiny random DeepseekV3ForCausalLM folder with its tokenizer: 8 routed experts (top-2 of 4 groups, 2
    chosen), 2 shared ones, the first layer dense, q compression; random norms, routers and routing biases."""
    config = transformers.DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=2, n_routed_experts=8,
        routed_scaling_factor=2.5, kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=12,
        qk_nope_head_dim=16, n_group=4, topk_group=2, num_experts_per_tok=2, first_k_dense_replace=1,
        max_position_embeddings=64, rms_norm_eps=1e-5, rope_parameters=dict(rope_type="default", rope_theta=1e4))
    model = random_hf_model(config, noise=0.3)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    model.save_pretrained(str(path))
    tiny_hf_tokenizer().save_pretrained(str(path))
    return path


def test_deepseek_latent_cache_generate_at_ep2_and_tp2_ep2(tmp_path, capsys):
    from megazoo.recipes.generate_cli import continuation

    hf = _deepseek_dir(tmp_path / "hf")

    def text(tp: int, ep: int) -> list[str]:
        args = _parser().parse_args(["--hf", str(hf), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--tp", str(tp),
                                  "--ep", str(ep), "--verbose"])
        return run_distributed(lambda: continuation(args, Topology.build(dp=ep, tp=tp, ep=ep)), tp * ep)

    assert megazoo(["generate", "--hf", str(hf), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--verbose"]) == 0
    captured = capsys.readouterr()
    assert "(latent cache: (kv_lora_rank 24 + qk_rope_head_dim 8) x 3 layers" in captured.err  # the latent cache
    ep1 = captured.out
    assert ep1 == transformers_greedy_text(hf, PROMPT, NEW) + "\n" and ep1.strip()
    assert text(1, 2) == [ep1[:-1]] * 2  # every rank decoded the same tokens
    assert text(2, 2) == [ep1[:-1]] * 4


def test_speculative_at_ep2_is_refused_before_any_worker(tmp_path, capsys, monkeypatch):
    """Self-speculative decoding keeps no agreement over the ep ranks (each would judge the drafts on its own
    logits): --speculative with --ep 2 is refused in this process, naming what is valid."""
    import megazoo.workers.supervisor as supervisor

    monkeypatch.setattr(supervisor, "launch_local", lambda *a, **k: pytest.fail("workers were started"))
    hf = _deepseek_dir(tmp_path / "hf")
    capsys.readouterr()  # transformers' save_pretrained progress
    assert megazoo(["generate", "--hf", str(hf), "--prompt", PROMPT, "--max-new-tokens", "2", "--ep", "2",
                    "--speculative"]) == 2
    err = capsys.readouterr().err
    assert "--speculative decodes at --ep 1 only (not 2)" in err and "valid: --ep 1" in err and err.count("\n") == 1
