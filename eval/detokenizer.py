"""WikiText detokenization: undo the dataset's word-level tokenization before GPT-2 BPE.

WikiText-103's `.tokens` files are whitespace-tokenized ("it 's", "1 @,@ 000", "( foo )"). GPT-2 never saw such
text, so zero-shot perplexity is measured on text turned back into ordinary prose. The rules and their ORDER are
those of Megatron-LM's `tasks/zeroshot_gpt/detokenizer.py` (`wikitext_detokenizer`), the reference of published
GPT-2 / Megatron WikiText-103 numbers: on the test file, GPT-2 BPE of the result is 270,330 tokens.
Changing a rule changes the token count and the reported perplexity, so this is deliberately a literal table.
"""

from __future__ import annotations

import re

# (pattern, replacement, is_regex), applied in order to the whole file as one string.
WIKITEXT_RULES: tuple[tuple[str, str, bool], ...] = (
    # contractions: "players '" -> "players'"
    ("s '", "s'", False),
    # Megatron's rule, kept as is for identical counts: the slashes are literal, so it only rewrites the
    # (never seen) text "/' <digit>/" into the literal "/'[0-9]/".
    (r"/' [0-9]/", r"/'[0-9]/", True),
    # number separators: "1 @,@ 000" -> "1,000", "3 @.@ 5" -> "3.5", "state @-@ of" -> "state-of"
    (" @-@ ", "-", False),
    (" @,@ ", ",", False),
    (" @.@ ", ".", False),
    # punctuation keeps its following space but loses the preceding one
    (" : ", ": ", False),
    (" ; ", "; ", False),
    (" . ", ". ", False),
    (" ! ", "! ", False),
    (" ? ", "? ", False),
    (" , ", ", ", False),
    # brackets and quotes hug their contents (non-greedy: the nearest closing mark)
    (r"\(\s*([^\)]*?)\s*\)", r"(\1)", True),
    (r"\[\s*([^\]]*?)\s*\]", r"[\1]", True),
    (r"{\s*([^}]*?)\s*}", r"{\1}", True),
    (r"\"\s*([^\"]*?)\s*\"", r'"\1"', True),
    (r"'\s*([^']*?)\s*'", r"'\1'", True),
    # section headings "= = Title = =" -> "== Title =="; longest first
    ("= = = =", "====", False),
    ("= = =", "===", False),
    ("= =", "==", False),
    # degree sign, line edges, the "N" number placeholder, possessive 's
    (" \N{DEGREE SIGN} ", "\N{DEGREE SIGN}", False),
    (" \n", "\n", False),
    ("\n ", "\n", False),
    (" N ", " 1 ", False),
    (" 's", "'s", False),
)

_COMPILED = tuple((re.compile(pattern) if is_regex else pattern, replacement, is_regex)
                  for pattern, replacement, is_regex in WIKITEXT_RULES)


def wikitext_detokenize(text: str) -> str:
    """Megatron-LM's WikiText detokenization of `text` (normally the whole file at once)."""
    for pattern, replacement, is_regex in _COMPILED:
        text = pattern.sub(replacement, text) if is_regex else text.replace(pattern, replacement)
    return text
