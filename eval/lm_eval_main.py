"""`megazoo-lm-eval ARGS`: lm-eval's own command line, with megazoo's model registered, so that

    megazoo-lm-eval --model megazoo --model_args checkpoint=runs/demo/checkpoints --tasks lambada_openai

works as `lm_eval --model hf ...` does. lm-eval 0.4 finds models only in its registry, filled by imports (it has
no plugin entry points), so plain `lm_eval --model megazoo` cannot see a model it never imported: this script
imports megazoo's adapter (eval/harness_model.py registers it as "megazoo") and hands every argument to lm-eval.
`megazoo eval harness` is the same adapter with megazoo's flags, tensor parallelism and checks.
"""

from __future__ import annotations

import sys

from megazoo.eval.harness import EXTRA_HINT


def main() -> int:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print(f"megazoo-lm-eval: error: {EXTRA_HINT}", file=sys.stderr)
        return 2
    import megazoo.eval.harness_model  # noqa: F401  (registers "megazoo" with lm-eval)

    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
