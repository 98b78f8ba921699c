"""Train a byte-level BPE with Hugging Face ``tokenizers``, or load a tokenizer.json."""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from rayllm.errors import DataError
from rayllm.io.redact import display_uri

EOS = "<|endoftext|>"


def train_bpe(texts: Iterable[str], vocab_size: int, special_tokens: list[str] | None = None) -> Tokenizer:
    """A GPT-2 style byte-level BPE; EOS is id 0, any other special tokens follow it."""
    specials = [EOS, *[t for t in special_tokens or [] if t != EOS]]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def load(json_text: str, source: str) -> Tokenizer:
    try:
        return Tokenizer.from_str(json_text)
    except Exception as e:
        raise DataError(f"tokenizer {display_uri(str(source))} is not a valid tokenizer.json ({e})") from None


def eos_id(tokenizer: Tokenizer) -> int:
    """The id that separates documents: EOS, else the first special token the file declares."""
    for name in (EOS, "</s>", "<eos>", "<|end_of_text|>"):
        token_id = tokenizer.token_to_id(name)
        if token_id is not None:
            return token_id
    raise DataError(
        f"the tokenizer has no end-of-text token (looked for {EOS}, </s>, <eos>, <|end_of_text|>); "
        "add one as a special token"
    )
