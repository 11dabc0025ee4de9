"""Tokenizers: a built-in byte-level one (no files) and a Hugging Face ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path

from .errors import DataNotFoundError, TokenizerError


class ByteTokenizer:
    """UTF-8 bytes as token ids 0..255. Padding needs no id: padded positions are masked."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face fast tokenizer loaded from a local ``tokenizer.json`` (no hub access)."""

    def __init__(self, path: str | Path):
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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)


def build_tokenizer(spec: str):
    """``byte`` or the path of a tokenizer.json (or a folder holding one)."""
    if spec == "byte":
        return ByteTokenizer()
    if spec == "auto":  # the config loader resolves it; reaching here means an unresolved config
        raise TokenizerError("data.tokenizer=auto is resolved by backend.config.load_config; load the config with it")
    return HFTokenizer(spec)
