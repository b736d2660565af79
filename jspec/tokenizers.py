"""Tokenizers: text to token ids and back, with the end-of-sequence id a response stops at.

`bytes` (`ByteTokenizer`) is the toy demo's: no file, any model of at least 257 tokens. A real
policy brings its `tokenizer.json` (`HFTokenizer`, through the `tokenizers` library) and, beside
it, the `tokenizer_config.json` of a Hugging Face checkpoint, which names its end and padding
tokens. `load` takes either, as `rl.tokenizer` and `rl.eos_token` name them (or the policy
checkpoint's own files); `save` writes a tokenizer beside an exported model, so a serving engine
loads the pair.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from jspec.config import ConfigError

TOKENIZER = "tokenizer.json"
SPECIAL_TOKENS = "tokenizer_config.json"


class ByteTokenizer:
    """Bytes are tokens 0..255; 256 ends a sequence. Needs a model vocabulary of at least 257."""

    vocab_size = 257
    eos_id = 256
    pad_id = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer (`tokenizer.json` of a real checkpoint); responses
    end at `eos_token`, prompts are padded with `pad_token` (the end token when None)."""

    def __init__(self, path: str | pathlib.Path, eos_token: str, pad_token: str | None = None):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as error:  # noqa: BLE001 - the library raises its own plain Exception
            raise ConfigError(
                f"{path} is not a tokenizer.json that the tokenizers library reads ({error})."
            ) from None
        self.eos_token, self.pad_token = eos_token, pad_token or eos_token
        ids = {t: self._tok.token_to_id(t) for t in (self.eos_token, self.pad_token)}
        if missing := [t for t, i in ids.items() if i is None]:
            raise ConfigError(f"the token {missing[0]!r} is not in the tokenizer at {path}.")
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_id, self.pad_id = ids[self.eos_token], ids[self.pad_token]

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        ids = list(ids)
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self._tok.decode([i for i in ids if i >= 0])

    def save(self, directory: str | pathlib.Path) -> None:
        """`tokenizer.json` and a `tokenizer_config.json` naming the end and padding tokens."""
        root = pathlib.Path(directory)
        root.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(root / TOKENIZER))
        special = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
        }
        (root / SPECIAL_TOKENS).write_text(json.dumps(special, indent=2) + "\n")


def special_tokens(directory: pathlib.Path) -> dict[str, str]:
    """The end and padding tokens a checkpoint's `tokenizer_config.json` names ({} without one)."""
    path = directory / SPECIAL_TOKENS
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON ({error}).") from None
    # a token is its string, or {"content": string, ...} in older files
    token = lambda v: v.get("content") if isinstance(v, dict) else v
    return {k: token(raw[k]) for k in ("eos_token", "pad_token") if raw.get(k) is not None}


def load(
    name: str | None, eos_token: str | None = None, checkpoint: pathlib.Path | None = None
) -> ByteTokenizer | HFTokenizer:
    """`bytes`, or the tokenizer.json at path `name` (None: the policy `checkpoint`'s, or `bytes`
    without one) ending responses at `eos_token` (None: the one its tokenizer_config.json names)."""
    if name is None and checkpoint is None:
        name = "bytes"
    if name == "bytes":
        return ByteTokenizer()
    path = checkpoint / TOKENIZER if name is None else pathlib.Path(name)
    if not path.is_file():
        where = (
            f"the policy checkpoint {checkpoint} has no {TOKENIZER}"
            if name is None
            else (f"rl.tokenizer={name!r} is not a file")
        )
        raise ConfigError(
            f"{where}; name a tokenizer.json with rl.tokenizer=PATH (a Hugging Face checkpoint's, "
            "or train_code_lm's run directory's), or 'bytes' for the byte tokenizer."
        )
    special = special_tokens(path.parent)
    eos_token = eos_token or special.get("eos_token")
    if eos_token is None:
        raise ConfigError(
            f"rl.tokenizer={str(path)!r} needs rl.eos_token, the token that ends a response (e.g. "
            "'<|endoftext|>' for Qwen3 base models, '<|im_end|>' for their chat turns), as no "
            f"{SPECIAL_TOKENS} beside it names one."
        )
    return HFTokenizer(path, eos_token, special.get("pad_token"))
