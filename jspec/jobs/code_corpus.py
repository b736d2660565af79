"""The corpus of `jspec.jobs.train_code_lm`: Python source files split into training and held-out
files by a hash of their paths, a byte-level BPE tokenizer trained on the training files (its last
id the end-of-file token), the files as token streams, and batches of packed rows of whole files,
the same batch for the same index in every run.
"""

from __future__ import annotations

import json
import pathlib
import sysconfig
import zlib
from typing import NamedTuple

import jax
import numpy as np

from jspec import mesh as mesh_lib
from jspec.config import ConfigError
from jspec.jobs import trainer

EOS = "<eos>"


def python_files(roots: list[str] | None, max_bytes: int) -> list[tuple[str, str]]:
    """(path, text) of the .py files under `roots`, in path order, up to `max_bytes` in all."""
    if not roots:
        paths = sysconfig.get_paths()
        roots = sorted({paths["stdlib"], paths["purelib"]})
    files, total = [], 0
    for root in roots:
        for path in sorted(pathlib.Path(root).rglob("*.py")):
            try:
                text = path.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip() and total < max_bytes:
                files.append((str(path), text))
                total += len(text)
    if not files:
        raise ConfigError(f"no .py files under {roots}; pass --roots with folders of Python code.")
    return files


def split(files, heldout: int) -> tuple[list[str], list[str]]:
    """Training and held-out texts: a file is held out when the hash of its path says so."""
    out = ([], [])
    for path, text in files:
        out[zlib.crc32(path.encode()) % heldout == 0].append(text)
    if not all(out):
        raise ConfigError(
            f"{len(files)} files give {len(out[0])} training and {len(out[1])} held-out files "
            f"(one in --heldout={heldout}); raise --max-bytes or name more --roots."
        )
    return out


def train_tokenizer(texts: list[str], vocab_size: int, path: pathlib.Path):
    """A byte-level BPE tokenizer of `vocab_size` ids (the last is `EOS`), saved to `path`; the
    one already at `path` if an earlier run wrote it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if path.is_file():
        tok = Tokenizer.from_file(str(path))
        if tok.get_vocab_size() != vocab_size:
            raise ConfigError(
                f"{path} holds a tokenizer of {tok.get_vocab_size()} ids, not model.vocab_size="
                f"{vocab_size}: its run directory was begun with another vocabulary; pass "
                f"model.vocab_size={tok.get_vocab_size()}, or use another --run-dir."
            )
        return tok
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens([EOS])
    if tok.get_vocab_size() != vocab_size:
        raise ConfigError(
            f"the corpus gives a tokenizer of {tok.get_vocab_size()} ids, not model.vocab_size="
            f"{vocab_size}; use a larger corpus or a smaller vocabulary."
        )
    tok.save(str(path))
    return tok


def token_stream(tok, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """All texts as one stream of ids, each file ended by EOS, and the file index of each id."""
    eos = tok.token_to_id(EOS)
    ids = [e.ids + [eos] for e in tok.encode_batch(texts, add_special_tokens=False)]
    doc = np.concatenate([np.full(len(x), i, np.int32) for i, x in enumerate(ids)])
    return np.concatenate([np.asarray(x, np.int32) for x in ids]), doc


def rows(stream, doc, starts: np.ndarray, t: int, mesh) -> dict[str, jax.Array]:
    """Packed rows of t ids from `starts`, split over `mesh`'s data axis: segment ids number the
    files of a row from 1, positions restart at each file's first id in the row."""
    idx = starts[:, None] + np.arange(t)
    d = doc[idx]
    seg = d - d[:, :1] + 1
    starts_file = np.diff(d, prepend=-1, axis=1) != 0
    first = np.maximum.accumulate(np.where(starts_file, np.arange(t), 0), axis=1)
    batch = dict(tokens=stream[idx], segment_ids=seg, positions=np.arange(t) - first)
    placed = mesh_lib.sharding(mesh, ("batch", None))
    return {k: jax.device_put(v.astype(np.int32), placed) for k, v in batch.items()}


def sampler(stream, doc, t: int, batch: int, seed: int, mesh):
    """batches(i): `batch` rows of t ids from random starts, the same for the same i."""
    high = len(stream) - t
    if high <= 0:
        raise ConfigError(f"the corpus holds {len(stream)} tokens, fewer than --seq-len={t}.")
    starts = lambda i: np.random.default_rng([seed, i]).integers(0, high, batch)
    return lambda i: rows(stream, doc, starts(i), t, mesh)


class Corpus(NamedTuple):
    """The training and held-out token streams (ids, file of each id), the held-out texts and
    the held-out bytes per token."""

    train: tuple[np.ndarray, np.ndarray]
    heldout: tuple[np.ndarray, np.ndarray]
    heldout_texts: list[str]
    bytes_per_token: float


def check_corpus(files: list[tuple[str, str]], path: pathlib.Path) -> None:
    """The corpus a run began with (its files, their characters, a hash of their paths), written
    to `path` the first time and checked at every later start: the default --roots (this
    Python's stdlib and site-packages) change with an install, and a resumed run would read
    another stream than its checkpoints were trained on, with a tokenizer trained on other files."""
    seen = {
        "files": len(files),
        "chars": sum(len(text) for _, text in files),
        "paths_crc32": zlib.crc32("\n".join(name for name, _ in files).encode()),
    }
    if not path.is_file():
        path.write_text(json.dumps(seen))
        return
    began = json.loads(path.read_text())
    if began != seen:
        raise ConfigError(
            f"the corpus is not the one this run began with ({began['files']} files of "
            f"{began['chars']:,} characters then, {seen['files']} of {seen['chars']:,} now, "
            f"{path}): --roots or the Python install under the default roots changed; pass the "
            "--roots the run read, or use another --run-dir."
        )


def read_corpus(args, vocab_size: int, run: pathlib.Path, limits: trainer.Limits) -> Corpus:
    """The corpus of --roots split into training and held-out files, tokenized by the tokenizer
    trained on the training files (`run`/tokenizer.json)."""
    files = python_files(args.roots, args.max_bytes)
    check_corpus(files, run / "corpus.json")
    train_texts, heldout_texts = split(files, args.heldout)
    tok = train_tokenizer(train_texts, vocab_size, run / "tokenizer.json")
    train, heldout = token_stream(tok, train_texts), token_stream(tok, heldout_texts)
    bytes_per_token = sum(map(len, map(str.encode, heldout_texts))) / len(heldout[0])
    print(
        f"corpus: {len(train_texts)} training files ({len(train[0]):,} tokens), "
        f"{len(heldout_texts)} held out ({len(heldout[0]):,} tokens, "
        f"{bytes_per_token:.2f} bytes a token) {limits.stamp()}",
        flush=True,
    )
    return Corpus(train, heldout, heldout_texts, bytes_per_token)
