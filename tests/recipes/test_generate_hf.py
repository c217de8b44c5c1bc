"""`megazoo generate --hf DIR` reads every family `megazoo convert` reads (models/hf/families.py): on tiny random HF
Llama, Qwen2 and Mistral folders its greedy text equals `megazoo generate` on the converted checkpoint and
transformers' own greedy generate() on the folder, stopped at the tokenizer's end of text alike."""

from __future__ import annotations

import pytest
import transformers
from hf_helpers import save_family_dir, transformers_greedy_text

from megazoo.recipes.cli import main as megazoo

PROMPT = "def main():\n    return"
NEW = 10



@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_generate_hf_equals_the_converted_checkpoint_and_transformers(family, tmp_path, capsys):
    hf, ckpt = save_family_dir(family, tmp_path / "hf"), tmp_path / "ckpt"
    assert megazoo(["convert", "hf-to-megazoo", str(hf), "--out", str(ckpt)]) == 0
    capsys.readouterr()
    assert megazoo(["generate", "--hf", str(hf), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    ours = capsys.readouterr().out
    assert megazoo(["generate", str(ckpt), "--prompt", PROMPT, "--max-new-tokens", str(NEW)]) == 0
    assert capsys.readouterr().out == ours
    assert ours == transformers_greedy_text(hf, PROMPT, NEW) + "\n" and ours.strip()


def test_generate_needs_one_model(tmp_path, capsys):
    hf = save_family_dir("qwen2", tmp_path / "hf")
    assert megazoo(["generate", str(tmp_path), "--hf", str(hf), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "give the model as CKPT (a megazoo checkpoint) or --hf DIR, one of the two" in capsys.readouterr().err
    (hf / "config.json").write_text('{"model_type": "bert"}')
    assert megazoo(["generate", "--hf", str(hf), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    assert "model_type 'bert' cannot be converted; valid: deepseek_v3, deepseek_v2, gpt2, llama, qwen2, mistral" in capsys.readouterr().err


CHATML_JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_generate_chat_takes_the_folders_own_template(tmp_path, capsys):
    """A bare --chat on a folder whose tokenizer carries a chat template renders with it: the same text as the
    built-in ChatML the template spells out; without one, --chat says how to name one."""
    hf = save_family_dir("llama", tmp_path / "hf")
    common = ["generate", "--hf", str(hf), "--prompt", "def main", "--max-new-tokens", str(NEW)]
    assert megazoo([*common, "--chat"]) == 2
    assert "its tokenizer has none: name one, --chat chatml | llama3" in capsys.readouterr().err
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf))
    tokenizer.chat_template = CHATML_JINJA
    tokenizer.save_pretrained(str(hf))
    assert megazoo([*common, "--chat"]) == 0
    own = capsys.readouterr().out
    assert megazoo([*common, "--chat", "chatml"]) == 0
    assert capsys.readouterr().out == own and own.strip()
    assert megazoo([*common]) == 0  # the plain continuation of the same words is another text
    assert capsys.readouterr().out != own
