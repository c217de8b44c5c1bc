"""Packed SFT rows: labels, positions, the block-diagonal mask, and a packed batch's loss equal to the sum of its
examples run one by one (fp64, 1e-10) on a tiny GPT-2-style and a tiny Llama-style model."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from megazoo.data.sft.packing import IGNORE_INDEX, ExampleList, SFTRows, example_targets, pack_rows
from megazoo.models.packing import Segments
from megazoo.models.presets import get_preset
from megazoo.models.transformer import GPT
from megazoo.models.weights import init_weights
from megazoo.parallel.topology import Topology

SEQ = 24


def _examples(vocab: int, lengths=(7, 12, 5, 9, 3, 15, 6), seed: int = 0) -> ExampleList:
    rng = np.random.default_rng(seed)
    ids, masks = [], []
    for n in lengths:
        ids.append(rng.integers(1, vocab, n).tolist())
        prompt = int(rng.integers(1, n))  # the first `prompt` tokens are the prompt, the rest the response
        masks.append([0] * prompt + [1] * (n - prompt))
    return ExampleList(ids, masks)


def test_example_targets_are_next_response_tokens_only():
    ids, mask = np.array([5, 6, 7, 8, 9]), np.array([0, 0, 1, 1, 1])
    assert example_targets(ids, mask).tolist() == [-100, 7, 8, 9, -100]


def test_pack_rows_best_fit_and_padding_fallback():
    lengths = [7, 12, 5, 9, 3, 15, 6]
    rows = pack_rows(lengths, SEQ)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= SEQ for row in rows)
    assert len(rows) == 3  # 57 tokens in 24-token rows: 3 is the fewest possible
    assert pack_rows(lengths, SEQ, packing=False) == [[i] for i in range(len(lengths))]
    with pytest.raises(ValueError, match="example 1 has 30 tokens, more than seq_len 24"):
        pack_rows([4, 30], SEQ)


def test_rows_hold_every_example_with_its_own_targets():
    examples = _examples(50)
    rows = SFTRows(examples, SEQ)
    inputs, targets, segments = rows.batch(list(range(len(rows))))
    seen = 0
    for r, row in enumerate(rows.rows):
        at = 0
        for segment, i in enumerate(row, start=1):
            ids, mask = examples.example(i)
            n = len(ids)
            assert inputs[r, at:at + n].tolist() == ids.tolist()
            assert targets[r, at:at + n].tolist() == example_targets(ids, mask).tolist()
            assert (segments[r, at:at + n] == segment).all()
            at, seen = at + n, seen + 1
        assert (segments[r, at:] == 0).all() and (targets[r, at:] == IGNORE_INDEX).all()
    assert seen == len(examples)
    stats = rows.stats()
    assert stats.tokens == int(examples.lengths.sum()) and stats.rows == 3
    assert SFTRows(examples, SEQ, packing=False).stats().fill < stats.fill


def test_segments_restart_positions_and_confine_attention():
    seg = torch.tensor([[1, 1, 1, 2, 2, 0, 0]])
    layout = Segments.from_ids(seg)
    assert layout.positions.tolist() == [[0, 1, 2, 0, 1, 0, 1]]
    mask = layout.dense_mask()[0, 0]
    assert mask[4].tolist() == [False, False, False, True, True, False, False]  # sees its own example only
    assert mask[2].tolist() == [True, True, True, False, False, False, False]
    assert mask[6].tolist() == [False] * 5 + [True, True]  # padding sees padding: no empty softmax row
    windowed = Segments.from_ids(seg, sliding_window=2).dense_mask()[0, 0]
    assert layout.runs == ((0, 0, 3), (0, 3, 5), (0, 5, 7)) and layout.cu_seqlens.tolist() == [0, 3, 5, 7]
    assert windowed[2].tolist() == [False, True, True, False, False, False, False]


def _model(preset: str, **overrides) -> GPT:
    cfg = dataclasses.replace(get_preset(preset), n_layer=2, n_head=4, d_model=32, n_positions=64, vocab_size=96,
                              dropout=0.0, attn_dropout=0.0, **overrides)
    if cfg.d_ff:
        cfg = dataclasses.replace(cfg, d_ff=64)
    model = GPT(cfg, Topology.solo(), dtype=torch.float64)
    init_weights(model, 0)
    return model.eval()


def _loss_sum(model: GPT, inputs, targets, segment_ids=None) -> torch.Tensor:
    logits = model(inputs, segment_ids=segment_ids)
    return model.loss(logits, targets) * (targets != IGNORE_INDEX).sum()


@pytest.mark.parametrize("preset, overrides", [
    ("gpt2-tiny", {}),  # LayerNorm, learned positions, multi-head, tied
    ("llama-tiny", {"n_kv_head": 2}),  # RMSNorm, rotary, SwiGLU, grouped-query, untied
    ("llama-tiny", {"n_kv_head": 2, "sliding_window": 4}),  # the window applies within each example
    ("deepseek-tiny", {}),  # latent attention (its rotary key restarts too), sigmoid-routed experts
    ("deepseek-tiny", {"q_lora_rank": 0, "n_experts": 0}),  # latent attention without q compression, dense
])
def test_packed_loss_equals_sum_of_examples_one_by_one(preset, overrides):
    model = _model(preset, **overrides)
    examples = _examples(model.cfg.vocab_size)
    rows = SFTRows(examples, SEQ)
    inputs, targets, segments = rows.batch(list(range(len(rows))))
    packed = _loss_sum(model, inputs, targets, segments)
    alone = sum(_loss_sum(model, torch.from_numpy(ids)[None], torch.from_numpy(example_targets(ids, mask))[None])
                for ids, mask in map(examples.example, range(len(examples))))
    torch.testing.assert_close(packed, alone, rtol=1e-10, atol=1e-10)
    # Without the segments the same rows would let examples see each other: the test can fail.
    with torch.no_grad():
        assert abs(float(_loss_sum(model, inputs, targets)) - float(alone)) > 1e-6


def test_packed_gradients_equal_examples_one_by_one():
    model = _model("llama-tiny", n_kv_head=2)
    examples = _examples(model.cfg.vocab_size, lengths=(6, 9, 4, 8))
    rows = SFTRows(examples, SEQ)
    _loss_sum(model, *rows.batch(list(range(len(rows))))).backward()
    packed = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    for i in range(len(examples)):
        ids, mask = examples.example(i)
        _loss_sum(model, torch.from_numpy(ids)[None], torch.from_numpy(example_targets(ids, mask))[None]).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(packed[name], param.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_segments_reject_decoding_cache_and_bad_shapes():
    with pytest.raises(ValueError, match=r"segment ids must be \(batch, sequence\)"):
        Segments.from_ids(torch.ones(5, dtype=torch.long))
    model = _model("gpt2-tiny")
    from megazoo.models.generation.kv_cache import KVCache
    with pytest.raises(ValueError, match="decoding cache"):
        model(torch.ones(1, 4, dtype=torch.long), cache=object.__new__(KVCache),
              segment_ids=torch.ones(1, 4, dtype=torch.long))


def test_packed_rows_with_multi_token_prediction_are_refused_in_training():
    """MTP's targets are the row shifted by 1 + k: they would cross from one example into the next."""
    model = _model("deepseek-tiny", mtp_depth=1).train()
    ids = torch.ones(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"multi-token prediction \(model.mtp_depth = 1\) in training"):
        model(ids, segment_ids=ids)
    model.eval()(ids, segment_ids=ids)  # evaluation does not run the MTP modules


def test_packed_rows_under_activation_checkpointing_equal_plain():
    """The checkpointed blocks get the segments again on recomputation: same loss and gradients as without."""
    model = _model("llama-tiny", n_kv_head=2)
    rows = SFTRows(_examples(model.cfg.vocab_size, lengths=(6, 9, 4, 8)), SEQ)
    batch = rows.batch(list(range(len(rows))))
    grads = []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        model.train()
        loss = _loss_sum(model, *batch)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-12, atol=0)
    for name, grad in grads[0][1].items():
        torch.testing.assert_close(grads[1][1][name], grad, rtol=1e-12, atol=1e-14, msg=name)
