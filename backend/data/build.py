"""From ``data`` config to a dataset: embedded, JSONL or .bin/.idx, length-limited."""

from __future__ import annotations

from pathlib import Path

from .chat import LazyChatRenderer, chat_template_dir
from .embedded import build_embedded
from .errors import DataError, DataFileError, DataNotFoundError
from .indexed import IndexedTokenDataset, indexed_exists
from .jsonl import InMemoryDataset, read_jsonl
from .overlong import LengthLimitedDataset
from .tokenizers import build_tokenizer


def build_dataset(data_cfg) -> tuple[LengthLimitedDataset, object]:
    """(dataset, tokenizer). The dataset never yields a sample over data.max_seq_length."""
    tokenizer = build_tokenizer(data_cfg.tokenizer)
    path = data_cfg.path
    if path == "embedded":
        if data_cfg.tokenizer != "byte":
            raise DataError("data.path=embedded is byte-level: set data.tokenizer=byte")
        base = IndexedTokenDataset(build_embedded(data_cfg.cache_dir))
    elif path.endswith(".jsonl"):
        if not Path(path).is_file():
            raise DataNotFoundError(f"data.path: no such file {path}")
        chat = LazyChatRenderer(chat_template_dir(data_cfg.tokenizer))
        samples = list(read_jsonl(path, tokenizer, data_cfg.json_key, chat=chat))
        if not samples:
            raise DataFileError(f"{path}: no samples (the file is empty or blank); point data.path at a data file")
        base = InMemoryDataset(samples, source=path)
    elif indexed_exists(path):
        base = IndexedTokenDataset(path)
    else:
        raise DataNotFoundError(
            f"data.path={path!r}: expected 'embedded', a .jsonl file, or the prefix of a .bin/.idx pair"
        )
    return LengthLimitedDataset(base, data_cfg.max_seq_length, data_cfg.overlong), tokenizer
