"""JSONL data: one JSON object a line, with text or token ids, optional loss mask and weight.

    {"text": "..."}                                  tokenised with data.tokenizer
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "loss_weight": [0.0, 0.5, 0.5]}
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    {"input_ids": [...], "loss_mask": [...], "advantages": 0.7, "old_logprobs": [null, -0.3, ...]}

The policy-gradient fields (``advantages``, ``old_logprobs``, ``ref_logprobs``; ``row_fields``)
are read, required or refused as the caller's ``RowFields`` says (a cross-entropy run refuses
them); any other field is counted in ``ignored`` and trained on by nothing.

``messages`` rows are rendered with the tokenizer directory's chat template (``chat.py``), the
loss on assistant turns only; the renderer is passed in by the caller (it needs transformers).

Any malformed line stops the load with an error naming the file and the line.

With ``append_eod`` (data.append_eod, Megatron's --append-eod) every sample gets the tokenizer's
end-of-document id after its last token, text and ``input_ids`` rows alike. The EOD is a
prediction target: its loss mask and weight are those of the row's last token (1 without a mask),
so a row whose tail is masked out keeps its EOD masked out too.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from .errors import DataFormatError
from .row_fields import PASS_THROUGH, RowFields, check_row_keys, parse_field
from .sample import Sample

__all__ = ["DataFormatError", "InMemoryDataset", "RowParser", "jsonl_rows", "read_jsonl"]


def _int_list(value, what: str, where: str, limit: int | None = None, hint: str = "") -> np.ndarray:
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise DataFormatError(f"{where}: '{what}' must be a list of integers")
    try:
        arr = np.asarray(value, dtype=np.int64)
    except OverflowError:  # e.g. an id of 10**30: no int64 holds it, so no vocabulary does
        bad = next(v for v in value if not -(2**63) <= v < 2**63)
        span = f"outside [0, {limit}){hint}" if limit is not None else "too large for a 64-bit integer"
        raise DataFormatError(f"{where}: '{what}' holds {bad}, {span}") from None
    if len(arr) and (arr.min() < 0 or (limit is not None and arr.max() >= limit)):
        raise DataFormatError(f"{where}: '{what}' holds ids outside [0, {limit}){hint}")
    return arr


def read_jsonl(path: str | Path, tokenizer, json_key: str = "text", chat=None, **options) -> Iterator[Sample]:
    """Yield the Samples of each non-blank line of ``path`` (``options``: ``RowParser``'s)."""
    parse = RowParser(tokenizer, json_key, chat, **options)
    for where, row in jsonl_rows(path):
        yield from parse(row, where)


def jsonl_rows(path: str | Path) -> Iterator[tuple[str, object]]:
    """(``FILE:LINE``, the decoded JSON value) for each non-blank line of ``path``."""
    path = Path(path)
    # Bytes, decoded line by line: invalid UTF-8 then names its line instead of failing the file.
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataFormatError(
                    f"{where}: not valid UTF-8 ({e.reason}, byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the "
                    f"line); fix the file given as data.path"
                ) from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write
            if not line.strip():
                continue
            yield where, parse_json_line(line, where)


def parse_json_line(line: str, where: str):
    """``line`` (its line ending left out) decoded, or a DataFormatError at ``where`` that says what
    is wrong in words: a line that ends inside a string or before its closing bracket says so
    (json's own "Invalid control character at" / "Expecting ',' delimiter at column 1" point at
    the newline, not at the cause)."""
    line = line.rstrip("\r\n")
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        if e.msg.startswith("Unterminated string"):
            what = f"a string opened at column {e.colno} is never closed (a missing '\"')"
        elif e.pos >= len(line.rstrip()):
            what = "the line ends before the JSON value does (a missing closing '}' or ']')"
        else:
            what = f"{e.msg} at column {e.colno}"
        raise DataFormatError(f"{where}: not valid JSON: {what}") from None


class RowParser:
    """One row (a dict of fields, from JSONL, Parquet or Arrow) -> its Samples, validated the same
    way whatever the file format; every error names ``where`` (the file and line or row).

    ``fields``: which policy fields to read, require or refuse (default: read whatever is there,
    for tools that pass rows through). ``ignored``: counts the rows of each field nothing reads.
    ``chat``: a ``chat.ChatRenderer`` (or ``chat.LazyChatRenderer``) for ``messages`` rows; None
    refuses them, naming the row and what to set. ``append_eod``: each sample ends in the
    tokenizer's EOD id (the tokenizer must be built with one: ``build_tokenizer(..., eod=True)``).
    """

    def __init__(
        self,
        tokenizer,
        json_key: str = "text",
        chat=None,
        *,
        append_eod: bool = False,
        fields: RowFields = PASS_THROUGH,
        ignored: Counter | None = None,
        vocab: int | None = None,
    ):
        """``vocab``: ids a row's input_ids may hold (default the tokenizer's; an RL worker passes
        the rows its model's softmax covers, which a sampler may draw past the tokenizer's ids)."""
        self.vocab = vocab or tokenizer.vocab_size
        self.eod_id = getattr(tokenizer, "eod_id", None)
        if append_eod and self.eod_id is None:
            raise ValueError(f"append_eod needs a tokenizer built with an end-of-document id ({tokenizer.name})")
        self.tokenizer, self.json_key, self.chat = tokenizer, json_key, chat
        self.append_eod, self.fields, self.ignored = append_eod, fields, ignored
        self.vocab_hint = f" (the vocabulary of data.tokenizer={getattr(tokenizer, 'name', '?')})"

    def __call__(self, row, where: str) -> list[Sample]:
        tokenizer, json_key, fields = self.tokenizer, self.json_key, self.fields
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}: expected a JSON object, got {type(row).__name__}")
        check_row_keys(row, fields, where, json_key, self.ignored)
        if "messages" in row:
            if self.chat is None:
                raise DataFormatError(
                    f"{where}: a 'messages' row needs a chat template: set data.tokenizer (or --tokenizer) to a "
                    f"Hugging Face tokenizer directory with one (data.tokenizer={getattr(tokenizer, 'name', '?')})"
                )
            if "loss_mask" in row:
                raise DataFormatError(f"{where}: 'loss_mask' is derived from 'messages' (assistant turns only)")
            return [
                self._sample({**row, "loss_mask": mask}, np.asarray(ids, dtype=np.int64), where)
                for ids, mask in self.chat.render_turns(row["messages"], where)
            ]
        if "input_ids" in row:
            tokens = _int_list(row["input_ids"], "input_ids", where, self.vocab, self.vocab_hint)
        elif json_key in row:
            if not isinstance(row[json_key], str):
                raise DataFormatError(f"{where}: '{json_key}' must be a string")
            tokens = np.asarray(tokenizer.encode(row[json_key]), dtype=np.int64)
        else:
            raise DataFormatError(
                f"{where}: no '{json_key}', 'input_ids' or 'messages' field (keys: {', '.join(row) or 'none'}); "
                f"a row holds text under '{json_key}' (data.json_key), token ids, or chat messages"
            )
        return [self._sample(row, tokens, where)]

    def _sample(self, row: dict, tokens: np.ndarray, where: str) -> Sample:
        if len(tokens) == 0:
            raise DataFormatError(f"{where}: the sample has no tokens")
        mask = weight = None
        if "loss_mask" in row:
            mask = _int_list(row["loss_mask"], "loss_mask", where).astype(np.uint8)
            if len(mask) != len(tokens) or mask.max(initial=0) > 1:
                raise DataFormatError(f"{where}: 'loss_mask' needs {len(tokens)} entries of 0 or 1, one per token")
        if "loss_weight" in row:
            w = row["loss_weight"]
            if not isinstance(w, list) or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in w):
                raise DataFormatError(f"{where}: 'loss_weight' must be a list of numbers")
            try:
                weight = np.asarray(w, dtype=np.float32)
            except OverflowError:  # an integer beyond any float
                weight = np.full(len(w), np.inf, dtype=np.float32)
            if len(weight) != len(tokens) or not np.all(np.isfinite(weight)):
                raise DataFormatError(f"{where}: 'loss_weight' needs {len(tokens)} finite numbers, one per token")
        policy = {
            name: parse_field(name, row[name], len(tokens), mask, where) for name in self.fields.read if name in row
        }
        sample = Sample(tokens=tokens, loss_mask=mask, loss_weight=weight, **policy)
        return sample.appended(self.eod_id) if self.append_eod else sample


class InMemoryDataset:
    """Samples held in memory (JSONL sources, tests)."""

    def __init__(self, samples: list[Sample], source: str, ignored_fields: dict[str, int] | None = None):
        self.samples = samples
        self.source = source
        self.ignored_fields = dict(ignored_fields or {})  # row field -> rows carrying it, read by nothing
        self.lengths = np.array([len(s.tokens) for s in samples], dtype=np.int64)
        self.loss_token_counts = np.array([s.loss_tokens() for s in samples], dtype=np.int64)
        self.has_loss_weight = any(s.loss_weight is not None for s in samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        return self.samples[int(index)]
