"""Local copies of lm-eval's task yamls (the Hugging Face hub is unreachable in tests): lambada_openai and
wikitext as lm-eval 0.4 ships them, with `dataset_path: json` over files written here, plus a small
multiple-choice task and a small generate_until task. Data comes from ../shared/data (a LAMBADA slice holding
example 426, whose last word follows a newline; WikiText's raw test pages)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from megazoo.eval.lm_eval_protocol import wikitext_pages

LAMBADA_SLICE = range(420, 428)  # holds example 426 ("... some kind of\n\nPower")
WIKI_PAGES = slice(28, 30)  # two short pages of the raw test file (the first is a 113-character split artifact)

LAMBADA_YAML = """task: lambada_openai
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood
test_split: test
doc_to_text: "{{{{text.split(' ')[:-1]|join(' ')}}}}"
doc_to_target: "{{{{' '+text.split(' ')[-1]}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""

WIKITEXT_YAML = """task: wikitext
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: !function preprocess_wikitext.wikitext_detokenizer
process_results: !function preprocess_wikitext.process_results
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 2.0
"""

MC_YAML = """task: mc_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""

GEN_YAML = """task: gen_local
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""

MC_DOCS = [
    {"question": "import os\nos.path.", "choices": ["join(a, b)", "banana split", "))))"], "answer": 0},
    {"question": "def __init__(self", "choices": ["):", ", *args, **kwargs):", " = 3"], "answer": 1},
    {"question": "for i in", "choices": [" range(n):", " the morning", " 12 12 12"], "answer": 0},
    {"question": "return", "choices": [" None", " ((", " def def"], "answer": 0},
    {"question": "try:\n    x = f()\n", "choices": ["except ValueError:", "finally weather", "if if"], "answer": 0},
]
GEN_DOCS = [{"prompt": "def main(", "target": "):"}, {"prompt": "import os\nimport ", "target": "sys"},
            {"prompt": "class Foo(object):\n    def ", "target": "__init__"}]


def offline() -> None:
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"


def write_tasks(root: Path, data_dir: Path) -> Path:
    """Write the task yamls and their data under root/tasks; returns that folder (lm-eval's include path)."""
    import lm_eval

    tasks = root / "tasks"
    tasks.mkdir(parents=True)
    texts = [json.loads(line)["text"] for line in
             (data_dir / "lambada" / "lambada_test.jsonl").read_text(encoding="utf-8").splitlines()]
    lambada = root / "lambada_slice.jsonl"
    lambada.write_text("".join(json.dumps({"text": texts[i]}) + "\n" for i in LAMBADA_SLICE), encoding="utf-8")
    pages = wikitext_pages((data_dir / "wikitext103" / "wiki.test.raw").read_text(encoding="utf-8"))
    wiki = root / "wikitext_pages.jsonl"
    wiki.write_text("".join(json.dumps({"page": page}) + "\n" for page in pages[WIKI_PAGES]), encoding="utf-8")
    # the same pages as raw text, for `megazoo eval wikitext103 --protocol lm-eval`
    (root / "wiki_slice.raw").write_text("\n".join(pages[WIKI_PAGES]), encoding="utf-8")
    mc, gen = root / "mc.jsonl", root / "gen.jsonl"
    mc.write_text("".join(json.dumps(doc) + "\n" for doc in MC_DOCS))
    gen.write_text("".join(json.dumps(doc) + "\n" for doc in GEN_DOCS))
    # lm-eval's own page scoring functions beside the wikitext yaml (its !function reference)
    shutil.copy(Path(lm_eval.__file__).parent / "tasks" / "wikitext" / "preprocess_wikitext.py", tasks)
    for name, template, data in (("lambada_openai", LAMBADA_YAML, lambada), ("wikitext", WIKITEXT_YAML, wiki),
                                 ("mc_local", MC_YAML, mc), ("gen_local", GEN_YAML, gen)):
        (tasks / f"{name}.yaml").write_text(template.format(data=data))
    return tasks


_REFERENCE: dict[str, dict] = {}
TASKS = ["lambada_openai", "wikitext", "mc_local", "gen_local"]


def lm_eval_reference(tmp_path_factory, data_dir) -> dict:
    """Once per session: the trained tiny checkpoint exported to Hugging Face, the local tasks, and lm-eval's
    results (with samples) for its own `hf` model on the export and for the megazoo adapter on the checkpoint."""
    if not _REFERENCE:
        offline()
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
        from trained_tiny import trained_checkpoints

        import megazoo.eval.harness_model  # noqa: F401  (registers "megazoo" with lm-eval)
        from megazoo.recipes.cli import main as megazoo

        ckpts = trained_checkpoints(tmp_path_factory)
        root = tmp_path_factory.mktemp("lm-eval")
        tasks = write_tasks(root, data_dir)
        assert megazoo(["convert", "megazoo-to-hf", str(ckpts), "--out", str(root / "hf")]) == 0
        manager = TaskManager(include_path=str(tasks), include_defaults=False)
        common = dict(tasks=TASKS, task_manager=manager, log_samples=True, bootstrap_iters=0)
        hf = lm_eval.simple_evaluate(model=HFLM(pretrained=str(root / "hf"), batch_size=4, device="cpu"), **common)
        ours = lm_eval.simple_evaluate(model="megazoo", model_args=f"checkpoint={ckpts}", batch_size=4, **common)
        _REFERENCE.update(ckpts=ckpts, root=root, tasks=tasks, hf=hf, ours=ours)
    return _REFERENCE
