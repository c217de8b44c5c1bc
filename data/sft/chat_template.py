"""Chat templates: a conversation -> token ids plus a per-token loss mask (1 = an assistant token to train on).

A template is one function, render(messages, add_generation_prompt) -> text. It is the tokenizer's own
(`apply_chat_template` of a `transformers` tokenizer that has a `chat_template`) or one of the built-in ones
below, named in the recipe / on the command line (`chatml`, `llama3`), for tokenizers that have none.

Which tokens are trained is found the way TRL's completion-only path finds it, from the rendered text alone, so
any template works without `{% generation %}` markers: assistant message k spans the characters from
render(messages[:k], add_generation_prompt=True) to render(messages[:k + 1]). The header the model is prompted
with (`<|im_start|>assistant\\n`) is not trained; the reply and its end marker (`<|im_end|>\\n`) are, so the
model learns to stop. The whole text is tokenized once; a span starts at the first token where the tokens of the
text before it and of the whole text diverge (TRL's common-prefix rule: a token merged across the boundary
belongs to the reply).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

ROLES = ("system", "user", "assistant")

Messages = Sequence[dict]
Render = Callable[[Messages, bool], str]


class ChatTemplateError(ValueError):
    """A conversation the template cannot render or mask: the message says which message and why."""


def _chatml(messages: Messages, add_generation_prompt: bool) -> str:
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def _llama3(messages: Messages, add_generation_prompt: bool) -> str:
    # Llama 3's own template: the begin-of-text token once, then a header per message, content stripped.
    text = "<|begin_of_text|>" + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages)
    return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if add_generation_prompt else "")


BUILTIN_TEMPLATES: dict[str, Render] = {"chatml": _chatml, "llama3": _llama3}
TEMPLATE_CHOICES = ("auto", "tokenizer", *BUILTIN_TEMPLATES)  # auto: the tokenizer's own, else an error


def _hf_backend(tokenizer):
    """The `transformers` tokenizer behind one of ours (data/tokenizers/tokenizer.py: HFTokenizer), or None."""
    backend = getattr(tokenizer, "_backend", None)
    return backend if hasattr(backend, "apply_chat_template") else None


def has_own_template(tokenizer) -> bool:
    backend = _hf_backend(tokenizer)
    return backend is not None and bool(getattr(backend, "chat_template", None))


def resolve_template(tokenizer, name: str) -> tuple[str, Render]:
    """(the template's name as recorded in the dataset, render). `name`: one of TEMPLATE_CHOICES."""
    if name not in TEMPLATE_CHOICES:
        raise ChatTemplateError(f"chat template {name!r} is unknown; valid: {', '.join(TEMPLATE_CHOICES)}")
    if name in BUILTIN_TEMPLATES:
        return name, BUILTIN_TEMPLATES[name]
    if not has_own_template(tokenizer):
        raise ChatTemplateError(f"the tokenizer {getattr(tokenizer, 'source', '')} has no chat template of its own "
                                f"(template {name!r}); name a built-in one: {', '.join(BUILTIN_TEMPLATES)}")
    backend = _hf_backend(tokenizer)

    def render(messages: Messages, add_generation_prompt: bool) -> str:
        return backend.apply_chat_template(list(messages), tokenize=False,
                                           add_generation_prompt=add_generation_prompt)

    return "tokenizer", render


def chat_encoder(tokenizer) -> Callable[[str], list[int]]:
    """text -> ids with the template's markers read as the special tokens they are (a document's encode reads
    them as plain text). No BOS/EOS is added: the template writes what it wants."""
    backend = _hf_backend(tokenizer)
    if backend is not None:
        return lambda text: backend.encode(text, add_special_tokens=False)
    return tokenizer.encode  # tokenizers / sentencepiece: added special tokens are matched as they are


def check_messages(messages: object, *, need_reply: bool = True) -> list[dict]:
    """The messages as a list of {"role", "content"} dicts, or ChatTemplateError naming the message and field.
    need_reply: a training example (at least one assistant reply, none first); False: a prompt to answer."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError(f"'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, got "
                                f"{type(messages).__name__}" + ("" if messages else " (empty)"))
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"messages[{i}] is {type(message).__name__}, expected an object with 'role' and "
                                    "'content'")
        for key in ("role", "content"):
            if key not in message:
                raise ChatTemplateError(f"messages[{i}] has no '{key}' field")
            if not isinstance(message[key], str):
                raise ChatTemplateError(f"messages[{i}].{key} is {type(message[key]).__name__}, expected a string")
        if message["role"] not in ROLES:
            raise ChatTemplateError(f"messages[{i}].role {message['role']!r} is unknown; valid: {', '.join(ROLES)}")
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not need_reply:
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    if not assistants:
        raise ChatTemplateError("no assistant message: nothing to train on")
    if assistants[0] == 0:
        raise ChatTemplateError("messages[0] is an assistant message: a reply needs a message before it")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _token_boundary(encode, text: str, ids: list[int], char: int) -> int:
    """How many of `ids` (the tokens of `text`) lie wholly before text[:char]: the common prefix of the tokens
    of text[:char] and of the whole text. A token that merges across the boundary (GPT-2's BPE joins "\n\n"
    at the end of a header but not before a word) counts with the side after it, TRL's rule."""
    head = encode(text[:char])
    n = 0
    for a, b in zip(head, ids):
        if a != b:
            break
        n += 1
    return n


def encode_conversation(messages: Messages, render: Render, encode) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of a checked conversation; mask[i] = 1 for the tokens of the assistant replies."""
    text = render(messages, False)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt, through = render(messages[:k], True), render(messages[:k + 1], False)
        if not through.startswith(prompt) or not text.startswith(through):
            raise ChatTemplateError(f"the template renders messages[:{k}] differently alone than inside the whole "
                                    "conversation, so the reply's tokens cannot be found")
        spans.append((len(prompt), len(through)))
    ids = encode(text)
    mask = [0] * len(ids)
    for k, (start, end) in enumerate(spans):
        first, last = _token_boundary(encode, text, ids, start), _token_boundary(encode, text, ids, end)
        if last == first:
            raise ChatTemplateError(f"assistant reply {k} has no tokens")
        mask[first:last] = [1] * (last - first)
    return ids, mask


def encode_prompt(messages: Messages, render: Render, encode) -> list[int]:
    """The tokens a fine-tuned model answers from: the conversation so far plus the assistant header
    (add_generation_prompt), exactly the context its replies were trained in."""
    return encode(render(check_messages(messages, need_reply=False), True))


def chat_prompt(tokenizer, template: str, user_text: str) -> list[int]:
    """One user turn as a fine-tuned model's prompt, through the template its dataset was written with."""
    _, render = resolve_template(tokenizer, template)
    return encode_prompt([{"role": "user", "content": user_text}], render, chat_encoder(tokenizer))


def end_of_turn(render: Render) -> str:
    """The text a template writes right after an assistant reply (`<|im_end|>` for chatml, `<|eot_id|>` for
    llama3): what a fine-tuned model emits when its answer is done. Read from the template itself, so the
    tokenizer's own template works too: render one exchange and take what follows the reply, whitespace dropped."""
    reply = "\x00reply\x00"
    text = render([{"role": "user", "content": "q"}, {"role": "assistant", "content": reply}], False)
    return text[text.rindex(reply) + len(reply):].strip()


def cut_at_end_of_turn(text: str, marker: str) -> tuple[str, bool]:
    """(the answer before the first end-of-turn marker, whether the marker was there)."""
    if marker and marker in text:
        return text[:text.index(marker)], True
    return text, False
