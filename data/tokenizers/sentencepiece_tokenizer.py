"""SentencePiece (BPE or unigram) behind the `Tokenizer` protocol: train on a user corpus, save, load.

Models trained here are lossless: decode(encode(s)) == s for every string. That takes a trainer setup unlike
sentencepiece's defaults (which normalise text with NFKC and squeeze whitespace):

- `normalization_rule_name="identity"`, `add_dummy_prefix=False`, `remove_extra_whitespaces=False`: the text is
  kept as it is, leading and repeated spaces included;
- `byte_fallback=True`: a character the vocabulary lacks becomes its UTF-8 bytes (`<0x..>` pieces), never `<unk>`;
- "\\n" is a user-defined piece, so newlines survive (training reads one line per sentence and never sees them);
- the eod `<|endoftext|>` is a *control* symbol: like `BPETokenizer`, a literal "<|endoftext|>" inside a document
  is plain text, never a document boundary (a user-defined symbol would be matched in the text). Sentencepiece
  decodes control ids to "", so `decode` writes the eod token's text itself;
- sentencepiece writes spaces as "▁" (U+2581), so a literal "▁" in the text would come back as a space: `encode`
  writes it as its three byte pieces instead.

Training is deterministic: the same texts, settings and `num_threads` give the same model file (the thread
count is fixed, not the machine's core count, because sentencepiece's result depends on it).
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import sentencepiece as spm

from megazoo.data.fileio import write_new_file
from megazoo.data.tokenizers.tokenizer import EOD_TOKEN

MODEL_TYPES = ("bpe", "unigram")
SPACE_MARK = "\u2581"  # "▁": sentencepiece's whitespace symbol
MAX_SENTENCE_CHARS = 4096  # longer lines are cut into pieces this long; sentencepiece skips over-long sentences
MAX_SENTENCES = 10_000_000  # sentencepiece holds its sentences in memory: a larger corpus is sampled (seeded)
_PROBE = "  a\tb\n c  "  # leading, repeated and trailing whitespace, a tab and a newline


class SentencePieceTokenizer:
    """A `sentencepiece.SentencePieceProcessor` with an end-of-document id.

    eod is the `<|endoftext|>` piece when the model has one (models trained here), else the model's eos
    (e.g. `</s>` of a model trained elsewhere).
    """

    def __init__(self, processor: spm.SentencePieceProcessor, source: str = "<in memory>") -> None:
        eod_id = processor.piece_to_id(EOD_TOKEN)
        if processor.id_to_piece(eod_id) != EOD_TOKEN:  # piece_to_id gives unk for an unknown piece
            eod_id = processor.eos_id()
        if eod_id < 0:
            raise ValueError(f"sentencepiece model {source} has neither a {EOD_TOKEN!r} piece nor an eos piece "
                             "to use as the end-of-document id")
        self._sp = processor
        self._eod_id = eod_id
        self.source = source
        # Escaping a literal "▁" (see the module docstring) is right only for a lossless model, one that adds
        # no dummy prefix and keeps whitespace as it is; a model trained elsewhere is left exactly as it is.
        self._escape_space_mark = (processor.piece_to_id("<0xE2>") != processor.unk_id()
                                   and processor.encode("a", out_type=str)[:1] == ["a"]
                                   and processor.decode(processor.encode(_PROBE)) == _PROBE)
        if self._escape_space_mark:
            self._space_mark_ids = [processor.piece_to_id(f"<0x{b:02X}>") for b in SPACE_MARK.encode()]

    @classmethod
    def load(cls, path: str | Path) -> SentencePieceTokenizer:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"sentencepiece model not found: {path}")
        try:
            processor = spm.SentencePieceProcessor(model_file=str(path))
        except (OSError, RuntimeError) as error:
            raise ValueError(f"{path} is not a valid sentencepiece model: {error}") from error
        return cls(processor, source=str(path))

    @classmethod
    def from_bytes(cls, model: bytes, source: str = "<in memory>") -> SentencePieceTokenizer:
        return cls(spm.SentencePieceProcessor(model_proto=model), source=source)

    @classmethod
    def train(
        cls,
        texts_or_files: Iterable[str | os.PathLike],
        vocab_size: int,
        model_prefix: str | Path | None = None,
        model_type: str = "bpe",
        *,
        num_threads: int = 1,
        character_coverage: float = 0.9995,
    ) -> SentencePieceTokenizer:
        """Train a lossless model (module docstring) on an iterable of texts (str) and/or text files (Path).

        The iterable is consumed once, so a corpus can be streamed; each text is split into lines (sentences).
        With `model_prefix`, writes PREFIX.model and PREFIX.vocab (refusing to overwrite either). Characters
        outside `character_coverage` of the corpus get no piece of their own: byte fallback encodes them.
        """
        if model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is invalid: use one of {', '.join(MODEL_TYPES)}")
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        paths = None
        if model_prefix is not None:
            paths = output_paths(model_prefix)
            for path in paths:  # fail before the (possibly long) training, not after it
                if path.exists():
                    raise FileExistsError(f"{path} already exists; not overwriting it")
        sentences = _Sentences(texts_or_files)
        model = io.BytesIO()
        # A generator-only run: sentencepiece loads the sentences, then samples MAX_SENTENCES of them when
        # there are more, seeded here so that sampling is reproducible.
        spm.set_random_generator_seed(0)
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences), model_writer=model, vocab_size=vocab_size, model_type=model_type,
                byte_fallback=True, control_symbols=[EOD_TOKEN], user_defined_symbols=["\n"],
                normalization_rule_name="identity", add_dummy_prefix=False, remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, split_digits=False, character_coverage=character_coverage,
                unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1,  # eod is the control symbol above; no bos/pad
                max_sentence_length=4 * MAX_SENTENCE_CHARS, input_sentence_size=MAX_SENTENCES,
                shuffle_input_sentence=True, num_threads=num_threads, minloglevel=2,
            )
        except RuntimeError as error:
            if sentences.error is not None:  # our reader failed (bad input line): report that, not the wrapper
                raise sentences.error from None
            # e.g. "Vocabulary size too high (5000). Please set it to a value <= 264." for a tiny corpus
            message = str(error).split("] ", 1)[-1].strip().replace(" with --character_coverage option", "")
            raise ValueError(f"sentencepiece training failed (vocab_size {vocab_size}, model_type {model_type}, "
                             f"{sentences.count} sentences): {message}") from error
        tokenizer = cls.from_bytes(model.getvalue())
        if paths is not None:
            tokenizer.save(paths[0].with_suffix(""))
        return tokenizer

    def save(self, model_prefix: str | Path) -> tuple[Path, Path]:
        """Write PREFIX.model (what `load` reads) and PREFIX.vocab (piece<TAB>score per line, for people)."""
        model_path, vocab_path = output_paths(model_prefix)
        vocab = "".join(f"{self._sp.id_to_piece(i)}\t{self._sp.get_score(i):g}\n" for i in range(self.vocab_size))
        write_new_file(model_path, self._sp.serialized_model_proto())
        write_new_file(vocab_path, vocab.encode("utf-8"))
        self.source = str(model_path)
        return model_path, vocab_path

    @property
    def eod_id(self) -> int:
        return self._eod_id

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        if not (self._escape_space_mark and SPACE_MARK in text):
            return self._sp.encode(text)
        ids: list[int] = []
        for i, part in enumerate(text.split(SPACE_MARK)):
            if i:
                ids += self._space_mark_ids
            ids += self._sp.encode(part)
        return ids

    def decode(self, ids: list[int]) -> str:
        # Control pieces decode to "": cut at each eod and put its text back, so decode(encode(a) + [eod] +
        # encode(b)) == a + "<|endoftext|>" + b, as with the BPE tokenizers.
        parts, start = [], 0
        ids = [int(i) for i in ids]
        for position, token in enumerate(ids):
            if token == self._eod_id:
                parts.append(self._sp.decode(ids[start:position]))
                start = position + 1
        parts.append(self._sp.decode(ids[start:]))
        return EOD_TOKEN.join(parts)


def output_paths(model_prefix: str | Path) -> tuple[Path, Path]:
    """(PREFIX.model, PREFIX.vocab); a prefix given with its ".model" suffix is accepted too."""
    prefix = Path(model_prefix)
    if prefix.suffix == ".model":
        prefix = prefix.with_suffix("")
    return prefix.with_name(prefix.name + ".model"), prefix.with_name(prefix.name + ".vocab")


class _Sentences:
    """Training sentences from texts and files, streamed: each non-blank line, cut to MAX_SENTENCE_CHARS.

    It keeps the first exception its source raised, because sentencepiece turns an exception inside its
    iterator into a RuntimeError whose text is all that is left of it.
    """

    def __init__(self, texts_or_files: Iterable[str | os.PathLike]) -> None:
        self._source = texts_or_files
        self.error: BaseException | None = None
        self.count = 0

    def __iter__(self) -> Iterator[str]:
        try:
            for item in self._source:
                for line in _lines(item):
                    line = line.rstrip("\r\n")
                    for start in range(0, len(line), MAX_SENTENCE_CHARS):
                        piece = line[start:start + MAX_SENTENCE_CHARS]
                        if piece.strip():
                            self.count += 1
                            yield piece
        except Exception as error:
            self.error = error
            raise


def _lines(item: str | os.PathLike) -> Iterator[str]:
    if isinstance(item, str):
        yield from item.splitlines()
        return
    if not isinstance(item, os.PathLike):
        raise TypeError(f"training input must be a str (text) or a path (file), got {type(item).__name__}")
    path = Path(item)
    if not path.is_file():
        raise FileNotFoundError(f"training file not found: {path}")
    with open(path, encoding="utf-8") as f:
        yield from f
