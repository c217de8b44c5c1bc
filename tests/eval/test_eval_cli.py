"""`megazoo eval ...` end to end (one process and a torchrun tp=2 job) and its errors for bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from cli_helpers import megazoo



def save_tiny(path, vocab=50257):
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=64, vocab_size=vocab, initializer_range=0.1)
    GPT2LMHeadModel(cfg).save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def paths(data_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf = save_tiny(root / "hf")
    for name in ("encoder.json", "vocab.bpe"):  # the model directory carries its tokenizer
        shutil.copy(data_dir / "gpt2_bpe" / name, hf / name)
    return {"hf": hf, "root": root, "wiki": data_dir / "wikitext103" / "wiki.test.tokens",
            "lambada": data_dir / "lambada" / "lambada_test.jsonl", "bpe": data_dir / "gpt2_bpe"}


def test_eval_both_tasks_write_json(paths, capsys):
    root = paths["root"]
    assert megazoo(["eval", "wikitext103", "--hf", paths["hf"], "--data", paths["wiki"], "--limit", 6,
                    "--stride", 16, "--json", root / "wiki.json"]) == 0
    wiki = json.loads((root / "wiki.json").read_text())
    assert wiki["num_scored_tokens"] == 64 + 5 * 16 and wiki["num_original_tokens"] == 245_566
    assert wiki["data_sha256"].startswith("56db52eb") and wiki["model"] == "hf" and wiki["stride"] == 16
    assert "wikitext103 | hf | ppl" in capsys.readouterr().out
    # The same model through transformers: the same numbers.
    assert megazoo(["eval", "wikitext103", "--hf", paths["hf"], "--data", paths["wiki"], "--limit", 6,
                    "--stride", 16, "--backend", "transformers", "--json", root / "wiki_hf.json"]) == 0
    assert json.loads((root / "wiki_hf.json").read_text())["ppl"] == pytest.approx(wiki["ppl"], rel=1e-6)

    assert megazoo(["convert", "hf-to-megazoo", paths["hf"], "--out", root / "ckpt"]) == 0
    assert megazoo(["eval", "lambada", "--checkpoint", root / "ckpt", "--tokenizer", paths["bpe"],
                    "--data", paths["lambada"], "--limit", 10, "--json", root / "lambada.json"]) == 0
    lambada = json.loads((root / "lambada.json").read_text())
    assert lambada["num_examples"] == 10 and lambada["num_examples_in_file"] == 5_153
    assert {"accuracy", "accuracy_last_token", "ppl"} <= lambada.keys()


def test_eval_tp2_through_torchrun(paths):
    root = paths["root"]
    common = ["eval", "lambada", "--hf", paths["hf"], "--data", paths["lambada"], "--limit", 8]
    assert megazoo(common + ["--json", root / "tp1.json"]) == 0
    assert megazoo(common + ["--tp", 2, "--json", root / "tp2.json"]) == 0
    tp1, tp2 = (json.loads((root / f"tp{n}.json").read_text()) for n in (1, 2))
    assert tp2["tp"] == 2 and tp2["nll_sum"] == pytest.approx(tp1["nll_sum"], rel=1e-6)
    assert tp2["num_correct"] == tp1["num_correct"]


def expect_error(argv, capsys, *fragments):
    assert megazoo(argv) == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert str(fragment) in err, err


def test_bad_inputs_fail_with_a_clear_message(paths, tmp_path, capsys):
    hf, wiki = paths["hf"], paths["wiki"]
    missing = tmp_path / "wiki.test.tokens"
    expect_error(["eval", "wikitext103", "--hf", hf, "--data", missing], capsys, missing, "not found")
    corrupt = tmp_path / "corrupt.tokens"
    corrupt.write_bytes(b"\xff\xfe\x00\x81" * 64)
    expect_error(["eval", "wikitext103", "--hf", hf, "--data", corrupt], capsys, corrupt, "not UTF-8")
    no_text = tmp_path / "bad.jsonl"
    no_text.write_text('{"text": "one two"}\n{"text": "three four"}\n{"sentence": "five"}\n')
    expect_error(["eval", "lambada", "--hf", hf, "--data", no_text], capsys, no_text, "line 3", '"text"')

    empty_tokenizer = tmp_path / "tok"
    empty_tokenizer.mkdir()
    expect_error(["eval", "lambada", "--hf", hf, "--data", paths["lambada"], "--tokenizer", empty_tokenizer],
                 capsys, empty_tokenizer, "vocab.json + merges.txt")
    bare_model = save_tiny(tmp_path / "bare")  # no tokenizer files and no --tokenizer
    expect_error(["eval", "lambada", "--hf", bare_model, "--data", paths["lambada"]], capsys, bare_model,
                 "--tokenizer")

    small_vocab = save_tiny(tmp_path / "small", vocab=1000)
    assert megazoo(["convert", "hf-to-megazoo", small_vocab, "--out", tmp_path / "small_ckpt"]) == 0
    expect_error(["eval", "wikitext103", "--checkpoint", tmp_path / "small_ckpt", "--tokenizer", paths["bpe"],
                  "--data", wiki, "--limit", 1], capsys, "1000", "50257", "does not match")
    expect_error(["eval", "lambada", "--checkpoint", tmp_path / "nowhere", "--data", paths["lambada"]],
                 capsys, tmp_path / "nowhere", "not a megazoo checkpoint")
    expect_error(["eval", "lambada", "--hf", hf, "--data", paths["lambada"], "--tp", 3], capsys, "--tp 3", "4")
    expect_error(["eval", "wikitext103", "--hf", hf, "--data", wiki, "--stride", 65], capsys, "--stride 65", "64")
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    (broken / "config.json").write_text("{not json")
    expect_error(["eval", "lambada", "--hf", broken, "--data", paths["lambada"]], capsys,
                 broken / "config.json", "cannot read HF config")
