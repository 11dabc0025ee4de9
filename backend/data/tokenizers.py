"""Tokenizers: a built-in byte-level one (no files) and a Hugging Face ``tokenizer.json``.

End of document (``data.append_eod``, ``tools/preprocess_data.py --append-eod``): ``eod_id`` is
the id appended after every document, or None when the tokenizer was built without one.

- byte: bytes are 0..255, so the EOD is a 257th id, 256, and only a tokenizer built with
  ``eod=True`` has it: its ``vocab_size`` is then 257 (the model's embedding pads 257 to 384 rows
  instead of 256, and a ``.bin`` needs uint16 instead of uint8). Without EOD nothing changes.
- Hugging Face: the model's own end-of-sequence token, found in this order: ``eos_token`` of the
  ``tokenizer_config.json`` beside the ``tokenizer.json``, ``eos_token_id`` of the ``config.json``
  beside it, then the first of the usual names (``<|endoftext|>``, ``</s>``, ...) that the
  vocabulary holds. The vocabulary does not grow.
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import DataNotFoundError, TokenizerError

BYTE_EOD_ID = 256
# End-of-sequence spellings of common model families, tried when no config names the token.
_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255 (and 256 = end of document when built with ``eod=True``).
    Padding needs no id: padded positions are masked."""

    name = "byte"

    def __init__(self, eod: bool = False):
        self.eod_id = BYTE_EOD_ID if eod else None
        self.vocab_size = 257 if eod else 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], *, specials: bool = False) -> str:
        """The text of ``ids``; with ``specials`` the end-of-document id shows as ``<eod>``."""
        text = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return text + "<eod>" * sum(i == 256 for i in ids) if specials else text


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local ``tokenizer.json`` (no hub access)."""

    def __init__(self, path: str | Path, eod: bool = False):
        from tokenizers import Tokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise DataNotFoundError(f"data.tokenizer: no tokenizer.json at {path}")
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust library raises plain Exception for JSON and schema errors
            raise TokenizerError(
                f"{path}: not a valid Hugging Face tokenizer.json ({e}); fix the file or set data.tokenizer "
                f"(byte, or the path of a tokenizer.json)"
            ) from None
        self.name = str(path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eod_id = self._find_eos(path) if eod else None

    def _find_eos(self, path: Path) -> int:
        """The end-of-sequence id (see the module docstring for where it is looked up)."""
        tried = []
        config = path.parent / "tokenizer_config.json"
        if config.is_file():
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):  # {"content": "</s>", ...} in older files
                eos = eos.get("content")
            if isinstance(eos, str) and (found := self._tok.token_to_id(eos)) is not None:
                return found
            tried.append(f"eos_token {eos!r} of {config}")
        model_config = path.parent / "config.json"
        if model_config.is_file():
            eos_id = json.loads(model_config.read_text(encoding="utf-8")).get("eos_token_id")
            if isinstance(eos_id, list) and eos_id:
                eos_id = eos_id[0]
            if isinstance(eos_id, int) and 0 <= eos_id < self.vocab_size:
                return eos_id
            tried.append(f"eos_token_id {eos_id!r} of {model_config}")
        for name in _EOS_NAMES:
            if (found := self._tok.token_to_id(name)) is not None:
                return found
        tried.append("the tokens " + ", ".join(_EOS_NAMES))
        raise TokenizerError(
            f"{path}: no end-of-document token for data.append_eod / --append-eod (tried {'; '.join(tried)}); "
            f"put an eos_token in a tokenizer_config.json beside it"
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], *, specials: bool = False) -> str:
        """The text of ``ids``; with ``specials``, special tokens (``<|im_end|>``) are kept."""
        return self._tok.decode(ids, skip_special_tokens=not specials)


def build_tokenizer(spec: str, *, eod: bool = False):
    """``byte`` or the path of a tokenizer.json (or a folder holding one); ``eod=True`` gives it
    an end-of-document id (``eod_id``), as data.append_eod needs."""
    if spec == "byte":
        return ByteTokenizer(eod=eod)
    if spec == "auto":  # the config loader resolves it; reaching here means an unresolved config
        raise TokenizerError("data.tokenizer=auto is resolved by backend.config.load_config; load the config with it")
    return HFTokenizer(spec, eod=eod)
