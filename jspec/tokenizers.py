"""Tokenizers: text to token ids and back, with the end-of-sequence id a response stops at.

`bytes` (`ByteTokenizer`) is the toy demo's: no file, any model of at least 257 tokens. A real
policy brings its `tokenizer.json` (`HFTokenizer`, through the `tokenizers` library), named with
the token that ends a response. `load` takes either, as `rl.tokenizer` and `rl.eos_token` name
them.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from jspec.config import ConfigError


class ByteTokenizer:
    """Bytes are tokens 0..255; 256 ends a sequence. Needs a model vocabulary of at least 257."""

    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json` of a real checkpoint)."""

    def __init__(self, path: str | pathlib.Path, eos_token: str):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library raises its own plain Exception
            raise ConfigError(
                f"{path} is not a tokenizer.json that the tokenizers library reads ({error})."
            ) from None
        eos = self._tok.token_to_id(eos_token)
        if eos is None:
            raise ConfigError(f"eos_token={eos_token!r} is not in the tokenizer at {path}.")
        self.vocab_size, self.eos_id = self._tok.get_vocab_size(), eos

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode([i for i in ids if i >= 0])


def load(name: str, eos_token: str | None = None) -> ByteTokenizer | HFTokenizer:
    """`bytes`, or the tokenizer.json at path `name` ending responses at `eos_token`."""
    if name == "bytes":
        return ByteTokenizer()
    path = pathlib.Path(name)
    if not path.is_file():
        raise ConfigError(
            f"rl.tokenizer={name!r} is not a file; name a tokenizer.json (a Hugging Face "
            "checkpoint's, or train_code_lm's run directory's), or 'bytes' for the byte tokenizer."
        )
    if eos_token is None:
        raise ConfigError(
            f"rl.tokenizer={name!r} needs rl.eos_token, the token that ends a response (e.g. "
            "'<|endoftext|>' for Qwen3 base models, '<|im_end|>' for their chat turns)."
        )
    return HFTokenizer(path, eos_token)
