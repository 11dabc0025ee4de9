"""Rows handed over in memory (an RL loop's rollouts) -> a dataset, validated exactly as a file's.

The RL worker (``backend.rl.PolicyWorker``) takes rows as Python dicts with the JSONL row fields
(``input_ids``, ``loss_mask``, ``loss_weight``, ``advantages``, ``old_logprobs``,
``ref_logprobs``, or ``text`` / ``messages``). They go through the same ``RowParser`` as a JSONL
line, so a bad row gets the same message, naming ``rows[i]`` and the field instead of a file and
line. Numpy arrays and torch tensors are accepted wherever a list is (converted with ``tolist``,
so NaN stays NaN: allowed where the loss mask is 0, refused at a loss token).

A row's tokens are trained as given: no end-of-document id is appended (a rollout ends where the
sampler stopped, with its EOS when it produced one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .chat import LazyChatRenderer, chat_template_dir
from .errors import DataFormatError
from .jsonl import InMemoryDataset, RowParser
from .overlong import LengthLimitedDataset
from .row_fields import PASS_THROUGH, RowFields


def _plain(value):
    """numpy arrays and torch tensors (and their scalars) as Python lists and numbers."""
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) and not isinstance(value, str) else value


def rows_dataset(
    rows: Sequence[dict],
    tokenizer,
    data_cfg,
    *,
    fields: RowFields = PASS_THROUGH,
    limit: bool = True,
    source: str = "rows",
    vocab: int | None = None,
):
    """The rows as a dataset in the caller's order (``limit``: ``data.max_seq_length`` and
    ``data.overlong`` apply as to a file, each truncation or drop counted in ``.report``).
    Every error names ``rows[i]`` and the field."""
    if not isinstance(rows, Sequence) or isinstance(rows, str | bytes | dict):
        raise DataFormatError(f"{source}: expected a list of row dicts, got {type(rows).__name__}")
    if not rows:
        raise DataFormatError(f"{source}: no rows")
    chat = LazyChatRenderer(chat_template_dir(data_cfg.tokenizer))
    ignored: Counter = Counter()
    parse = RowParser(tokenizer, data_cfg.json_key, chat, fields=fields, ignored=ignored, vocab=vocab)
    samples = []
    for i, row in enumerate(rows):
        where = f"{source}[{i}]"
        if isinstance(row, dict):
            row = {k: _plain(v) for k, v in row.items()}
        parsed = parse(row, where)
        if len(parsed) != 1:
            raise DataFormatError(
                f"{where}: 'messages' rendered as {len(parsed)} samples (the chat template rewrites earlier turns); "
                f"give one sample per row (input_ids) so results keep the caller's order"
            )
        samples.extend(parsed)
    base = InMemoryDataset(samples, source=source, ignored_fields=ignored)
    if not limit:
        return base
    return LengthLimitedDataset(base, data_cfg.max_seq_length, data_cfg.overlong)
