"""From ``data`` config to a dataset: embedded, JSONL or .bin/.idx, length-limited."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from .chat import LazyChatRenderer, chat_template_dir
from .embedded import build_embedded, cut_report
from .errors import DataError, DataFileError, DataNotFoundError
from .indexed import IndexedTokenDataset, indexed_exists, token_dtype
from .jsonl import InMemoryDataset, read_jsonl
from .overlong import LengthLimitedDataset
from .row_fields import RowFields
from .tokenizers import build_tokenizer

CROSS_ENTROPY = RowFields()


def build_dataset(data_cfg, fields: RowFields = CROSS_ENTROPY) -> tuple[LengthLimitedDataset, object]:
    """(dataset, tokenizer). The dataset never yields a sample over data.max_seq_length.

    ``fields`` (``row_fields.row_fields(cfg.loss)``): the policy-gradient fields the run reads,
    requires or refuses; by default a cross-entropy run's (rows carrying them are refused).

    With data.append_eod the tokenizer has an end-of-document id (byte: 256, vocabulary 257) and
    JSONL samples end with it; a .bin/.idx data set must already end every sample with it
    (tools/preprocess_data.py --append-eod), which is checked on a spread of samples.
    """
    append_eod = getattr(data_cfg, "append_eod", False)
    tokenizer = build_tokenizer(data_cfg.tokenizer, eod=append_eod)
    path = data_cfg.path
    if path == "embedded":
        if data_cfg.tokenizer != "byte":
            raise DataError("data.path=embedded is byte-level: set data.tokenizer=byte")
        if append_eod:
            raise DataError(
                "data.append_eod=true: the embedded data set has no end-of-document ids; use a JSONL file or a "
                "prefix written by tools/preprocess_data.py --append-eod"
            )
        cut_at = data_cfg.max_seq_length if getattr(data_cfg, "embedded_cut_lines", False) else None
        prefix = build_embedded(data_cfg.cache_dir, cut_at)
        base = IndexedTokenDataset(prefix)
        base.note = cut_report(prefix)
    elif path.endswith(".jsonl"):
        if not Path(path).is_file():
            raise DataNotFoundError(f"data.path: no such file {path}")
        chat = LazyChatRenderer(chat_template_dir(data_cfg.tokenizer))
        ignored: Counter = Counter()
        samples = list(
            read_jsonl(
                path, tokenizer, data_cfg.json_key, chat=chat, append_eod=append_eod, fields=fields, ignored=ignored
            )
        )
        if not samples:
            raise DataFileError(f"{path}: no samples (the file is empty or blank); point data.path at a data file")
        base = InMemoryDataset(samples, source=path, ignored_fields=ignored)
    elif indexed_exists(path):
        base = IndexedTokenDataset(path, fields)
        check_indexed_vocabulary(base, tokenizer, data_cfg.tokenizer)
    else:
        raise DataNotFoundError(
            f"data.path={path!r}: expected 'embedded', a .jsonl file, or the prefix of a .bin/.idx pair"
        )
    return LengthLimitedDataset(base, data_cfg.max_seq_length, data_cfg.overlong), tokenizer


def check_indexed_vocabulary(base: IndexedTokenDataset, tokenizer, spec: str, probes: int = 64) -> None:
    """Refuse a .bin/.idx pair written for a larger vocabulary than the tokenizer's (its ids would
    index past the embedding: an IndexError on CPU, a device-side assert on CUDA), and, when the
    tokenizer has an EOD id, one whose samples do not end with it. Reads ``probes`` tokens."""
    eod = getattr(tokenizer, "eod_id", None)
    # megatron-core's own writer switches to int32 from 65500 ids on (DType.optimal_dtype)
    need = 4 if tokenizer.vocab_size >= 65500 else np.dtype(token_dtype(tokenizer.vocab_size)).itemsize
    if base.token_itemsize > need:
        hint = (
            "; a byte-level set written with --append-eod holds id 256: set data.append_eod=true"
            if spec == "byte" and eod is None
            else ""
        )
        raise DataFileError(
            f"{base.source}: token ids stored in {base.token_itemsize} bytes, more than data.tokenizer={spec}'s "
            f"{tokenizer.vocab_size} ids need ({need}): it was written for another vocabulary{hint}"
        )
    if eod is not None:
        for i in np.unique(np.linspace(0, len(base) - 1, num=min(probes, len(base))).astype(np.int64)):
            if base.lengths[i] and base.last_token(i) != eod:
                raise DataFileError(
                    f"{base.source}: sample {int(i)} ends with id {base.last_token(i)}, not the end-of-document id "
                    f"{eod}, but data.append_eod=true: write the set with tools/preprocess_data.py --append-eod "
                    f"(or set data.append_eod=false)"
                )
