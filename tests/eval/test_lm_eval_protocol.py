"""`megazoo eval lambada|wikitext103 --protocol lm-eval` == lm-eval's own numbers (its `hf` model on the exported
weights, local copies of its lambada_openai and wikitext tasks) on a LAMBADA slice holding example 426, whose last
word follows a newline, and on WikiText pages; `--protocol megatron` (the default) is unchanged. Also: the
checkpoint's own tokenizer is used without --tokenizer, and mismatched data files are refused."""

from __future__ import annotations

import json

import pytest
from lm_eval_tasks import LAMBADA_SLICE, lm_eval_reference, offline

from megazoo.eval import lambada as megatron_lambada
from megazoo.eval.lm_eval_protocol import encode_pair, lambada_requests, score_pairs, wikitext_pages
from megazoo.eval.scoring import gpt_logits_fn
from megazoo.models.loading import load_gpt, open_checkpoint
from megazoo.parallel.topology import Topology
from megazoo.recipes.cli import main as megazoo

offline()


@pytest.fixture(scope="module")
def ref(tmp_path_factory, data_dir):
    return lm_eval_reference(tmp_path_factory, data_dir)


def _eval(task, ref, data, out, *extra):
    assert megazoo(["eval", task, "--checkpoint", str(ref["ckpts"]), "--data", str(data), "--json", str(out),
                    *extra]) == 0  # no --tokenizer: the checkpoint's own
    return json.loads(out.read_text())


def test_lambada_lm_eval_protocol_equals_lm_eval(ref, tmp_path, capsys):
    data = ref["root"] / "lambada_slice.jsonl"
    result = _eval("lambada", ref, data, tmp_path / "l.json", "--protocol", "lm-eval")
    theirs = ref["hf"]["results"]["lambada_openai"]
    assert result["protocol"] == "lm-eval" and result["num_examples"] == len(LAMBADA_SLICE)
    assert result["accuracy"] == theirs["acc,none"]
    assert result["ppl"] == pytest.approx(theirs["perplexity,none"], rel=1e-6)
    assert "lambada (lm-eval)" in capsys.readouterr().out
    # every example's log-likelihood, as lm-eval's hf model scored it
    ckpt = open_checkpoint(ref["ckpts"])
    tok = ckpt.tokenizer
    texts = [json.loads(line)["text"] for line in data.read_text(encoding="utf-8").splitlines()]
    pairs = [encode_pair(tok.encode, c, t, tok.eod_id) for c, t in lambada_requests(texts)]
    scored = score_pairs(gpt_logits_fn(load_gpt(ckpt, Topology.solo())), pairs, max_length=ckpt.cfg.n_positions,
                         pad_id=tok.eod_id)
    samples = sorted(ref["hf"]["samples"]["lambada_openai"], key=lambda s: s["doc_id"])
    for (ll, greedy, _), sample in zip(scored, samples, strict=True):
        assert abs(ll - sample["resps"][0][0][0]) <= 1e-5 and greedy == sample["resps"][0][0][1]
    # example 426: lm-eval's target is " of\n\nPower" (split on " "), Megatron's " Power" (split on whitespace)
    text = texts[426 - LAMBADA_SLICE.start]
    assert lambada_requests([text])[0][1] == " of\n\nPower"
    assert megatron_lambada.split_last_word(text)[1] == "Power"


def test_megatron_protocol_is_unchanged(ref, tmp_path):
    data = ref["root"] / "lambada_slice.jsonl"
    result = _eval("lambada", ref, data, tmp_path / "m.json")
    assert result["protocol"] == "megatron"
    ckpt = open_checkpoint(ref["ckpts"])
    direct = megatron_lambada.evaluate_lambada(
        gpt_logits_fn(load_gpt(ckpt, Topology.solo())), megatron_lambada.load_lambada(data, ckpt.tokenizer),
        context=ckpt.cfg.n_positions, pad_id=ckpt.tokenizer.eod_id, batch_size=4, model_name=ckpt.cfg.name)
    for key, value in direct.items():
        assert result[key] == (pytest.approx(value, rel=1e-12) if isinstance(value, float) else value), key
    lm = _eval("lambada", ref, data, tmp_path / "l.json", "--protocol", "lm-eval")
    assert lm["ppl"] != pytest.approx(result["ppl"], rel=1e-3)  # example 426 is scored on another target


def test_wikitext_lm_eval_protocol_equals_lm_eval(ref, tmp_path):
    result = _eval("wikitext103", ref, ref["root"] / "wiki_slice.raw", tmp_path / "w.json", "--protocol", "lm-eval")
    theirs = ref["hf"]["results"]["wikitext"]
    assert result["protocol"] == "lm-eval" and result["num_pages"] == 2
    for ours, key in (("word_perplexity", "word_perplexity,none"), ("byte_perplexity", "byte_perplexity,none"),
                      ("bits_per_byte", "bits_per_byte,none")):
        assert result[ours] == pytest.approx(theirs[key], rel=1e-6), ours


def test_pages_are_lm_evals_pages(data_dir):
    pages = wikitext_pages((data_dir / "wikitext103" / "wiki.test.raw").read_text(encoding="utf-8"))
    import re

    # lm-eval's wikitext (document level) test split: 62 pages, 241,335 words as its process_results counts them
    assert len(pages) == 62 and sum(len(re.split(r"\s+", page)) for page in pages) == 241_335
    assert pages[0].startswith(" = Robert Boulter = \n")


def test_mismatched_files_and_flags_are_refused(ref, tmp_path, capsys, data_dir):
    ckpt = str(ref["ckpts"])
    wiki, lamb = data_dir / "wikitext103" / "wiki.test.tokens", ref["root"] / "lambada_slice.jsonl"
    for argv, words in ((["wikitext103", "--data", lamb], ("JSON lines", "megazoo eval lambada")),
                        (["lambada", "--data", wiki], ("not JSON lines", "megazoo eval wikitext103")),
                        (["wikitext103", "--data", wiki, "--protocol", "lm-eval", "--stride", "8"],
                         ("--stride 8", "megatron only"))):
        assert megazoo(["eval", *map(str, argv), "--checkpoint", ckpt]) == 2
        err = capsys.readouterr().err
        assert all(word in err for word in words) and err.count("\n") == 1, err


def test_help_says_a_training_checkpoints_folder_works(capsys):
    with pytest.raises(SystemExit) as exit_info:
        megazoo(["eval", "lambada", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert exit_info.value.code == 0
    assert "checkpoints/ folder" in out and "--protocol" in out and "consolidated" not in out
    assert "the tokenizer the checkpoint records" in out
