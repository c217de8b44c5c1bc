"""`megazoo convert megazoo-to-hf` on a trained checkpoint with its own 4,096-token BPE: the tokenizer it records is
written as a Hugging Face tokenizer (AutoTokenizer, same ids), its end-of-text id becomes bos / eos / pad (no
out-of-vocabulary 50256), generate() stops at EOS; sentencepiece models trained by megazoo export too; the output
appears whole or not at all."""

from __future__ import annotations

import argparse
import json
import logging
import warnings

import pytest
import torch
from trained_tiny import VOCAB, trained_checkpoints

from megazoo.data.tokenizers.sentencepiece_tokenizer import SentencePieceTokenizer
from megazoo.models.generation.generate import full_logits
from megazoo.models.hf.convert_cli import register
from megazoo.models.loading import load_gpt, open_checkpoint
from megazoo.parallel.topology import Topology

TEXT = "import os\n\ndef main(argv):\n    return {'a': [1, 2.5]}  # caf\u00e9 \u00fcber\n"


def convert(argv) -> int:
    parser = argparse.ArgumentParser(prog="megazoo")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    ckpts = trained_checkpoints(tmp_path_factory)
    out = tmp_path_factory.mktemp("export") / "hf"
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", out]) == 0
    return ckpts, out


def test_autotokenizer_loads_the_trained_tokenizer_with_the_same_ids(exported):
    from transformers import AutoTokenizer

    ckpts, out = exported
    ours = open_checkpoint(ckpts).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(out))
    assert len(theirs) == VOCAB == ours.vocab_size
    assert theirs.encode(TEXT, add_special_tokens=False) == ours.encode(TEXT)
    assert theirs.decode(ours.encode(TEXT)) == TEXT
    assert theirs.eos_token_id == theirs.bos_token_id == theirs.pad_token_id == ours.eod_id
    # a class both transformers majors load (5.x saves "TokenizersBackend", which 4.x does not have; the project
    # declares transformers>=4.40): checked by hand under 4.57 too (closing note of issue 26)
    assert json.loads((out / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    config = json.loads((out / "config.json").read_text())
    generation = json.loads((out / "generation_config.json").read_text())
    for record in (config, generation):
        assert record["bos_token_id"] == record["eos_token_id"] == record["pad_token_id"] == ours.eod_id < VOCAB


def test_exported_model_computes_ours_and_generate_stops_at_eos(exported, caplog):
    from transformers import AutoTokenizer, GPT2LMHeadModel

    ckpts, out = exported
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING):
        warnings.simplefilter("error")  # e.g. "bos_token_id must be None or an integer within the vocabulary"
        model = GPT2LMHeadModel.from_pretrained(str(out)).eval()
    assert "bos_token_id" not in caplog.text
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok.encode(TEXT)])
    ckpt = open_checkpoint(ckpts)
    with torch.no_grad():
        ref = full_logits(load_gpt(ckpt, Topology.solo()), ids)
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-5, atol=1e-5)
        # Make end-of-text the likeliest next token everywhere: the final LayerNorm outputs its bias, a vector
        # only the EOS row of the (tied) embedding aligns with.
        eos = tok.eos_token_id
        direction = torch.randn(model.config.n_embd, generator=torch.Generator().manual_seed(0))
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.copy_(direction)
        model.transformer.wte.weight[eos] = 50 * direction / direction.norm() ** 2
        generated = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert generated[0, ids.shape[1]:].tolist() == [eos]  # one token, EOS, then it stopped


def test_sentencepiece_tokenizer_exports_with_the_same_ids(exported, tmp_path, data_dir):
    from transformers import AutoTokenizer

    ckpts, _ = exported
    wiki = (data_dir / "wikitext103" / "wiki.valid.tokens").read_text(encoding="utf-8").splitlines()[:600]
    corpus = [TEXT * 3, *wiki]
    for kind in ("bpe", "unigram"):
        sp = SentencePieceTokenizer.train(corpus, 400, tmp_path / f"sp_{kind}", model_type=kind)
        out = tmp_path / f"hf_{kind}"
        assert convert(["convert", "megazoo-to-hf", ckpts, "--out", out, "--tokenizer",
                        tmp_path / f"sp_{kind}.model"]) == 0
        theirs = AutoTokenizer.from_pretrained(str(out))
        assert theirs.encode(TEXT, add_special_tokens=False) == sp.encode(TEXT)
        assert theirs.eos_token_id == sp.eod_id
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == sp.eod_id


def test_output_is_whole_or_absent(exported, tmp_path, capsys, monkeypatch):
    import megazoo.models.hf.tokenizer_export as hf_tokenizer

    ckpts, _ = exported
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", existing]) == 2
    assert "not empty" in capsys.readouterr().err and (existing / "keep.txt").read_text() == "mine"

    def broken(*args, **kwargs):
        raise ValueError("disk trouble while writing the tokenizer")

    monkeypatch.setattr(hf_tokenizer, "save_hf_tokenizer", broken)
    out = tmp_path / "out"
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", out]) == 2
    assert "disk trouble" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == [existing]  # no half-written or temporary folder
    monkeypatch.undo()
    # the retry is not blocked; --tokenizer takes a trained tokenizers .json file (here the run's own)
    trained_json = next((ckpts.parent / "data_cache").glob("stdlib-*/tokenizer.json"))
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", out, "--tokenizer", trained_json]) == 0
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()


def test_bad_tokenizer_is_refused_before_reading_weights(exported, tmp_path, capsys):
    ckpts, _ = exported
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", tmp_path / "o", "--tokenizer",
                    tmp_path / "missing.json"]) == 2
    assert "missing.json" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert convert(["convert", "megazoo-to-hf", ckpts, "--out", tmp_path / "o", "--tokenizer", "none"]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config.get("bos_token_id") is None and not (tmp_path / "o" / "tokenizer.json").exists()


def test_exported_folder_and_files_are_readable_by_others(exported):
    # The export is staged in a mkdtemp folder (0700) and renamed: it must come out with the umask's modes, like
    # any folder the user makes, or shared storage breaks (another user cannot load the model).
    import os
    import stat
    _, out = exported
    umask = os.umask(0o022)
    os.umask(umask)
    for path in [out, *out.iterdir()]:
        expected = (0o777 if path.is_dir() else 0o666) & ~umask
        assert stat.S_IMODE(path.stat().st_mode) == expected, path
