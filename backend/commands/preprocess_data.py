#!/usr/bin/env python3
"""Turn a JSONL file, a Parquet file or an Arrow directory into a Megatron .bin/.idx data set
(plus loss mask / weight siblings).

    python tools/preprocess_data.py --input data.jsonl --output-prefix data/train --tokenizer byte
    python tools/preprocess_data.py --input shards/ --output-prefix data/train --tokenizer byte

--input may be a .jsonl file, a .parquet file, a directory of .parquet shards or a directory
written by datasets' save_to_disk; the rows are read one record batch at a time and written as
they come, so an input larger than memory converts.

Each line holds "text" (or --json-key) or "input_ids", and optionally per-token "loss_mask" and
"loss_weight"; or "messages" (role/content), rendered with the chat template of
--chat-template-dir (default: the --tokenizer directory), with the loss on assistant turns only:

    python tools/preprocess_data.py --input chat.jsonl --output-prefix data/chat --tokenizer checkpoints/Qwen3-4B

A malformed line or row (or a role or template that fails) stops the run with its file and line
or row number; nothing is written.

--append-eod (Megatron's) ends every document with the tokenizer's end-of-document id, a target
of the loss like any other token (its mask and weight repeat the document's last token's). For
--tokenizer byte that id is 256, outside the bytes: the vocabulary becomes 257 and the .bin holds
uint16. A Hugging Face tokenizer uses its eos token (tokenizer_config.json's eos_token beside
the tokenizer.json, else config.json's eos_token_id, else a usual name such as <|endoftext|>).
Train on the result with data.append_eod=true, which gives the tokenizer the same id.
"""

from __future__ import annotations

import argparse
import sys

from backend.data.arrow_rows import arrow_rows, is_arrow_source  # noqa: E402
from backend.data.chat import LazyChatRenderer, chat_template_dir  # noqa: E402
from backend.data.errors import DataError  # noqa: E402
from backend.data.indexed import write_indexed  # noqa: E402
from backend.data.jsonl import RowParser, jsonl_rows  # noqa: E402
from backend.data.tokenizers import build_tokenizer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--input", required=True, help="a .jsonl or .parquet file, or a directory of Parquet shards or save_to_disk"
    )
    p.add_argument("--output-prefix", required=True, help="writes PREFIX.bin and PREFIX.idx")
    p.add_argument("--tokenizer", default="byte", help="'byte', a tokenizer.json, or a HF tokenizer directory")
    p.add_argument("--chat-template-dir", help="HF tokenizer directory whose chat template renders 'messages' rows")
    p.add_argument("--json-key", default="text", help="field holding the text")
    p.add_argument(
        "--append-eod",
        action="store_true",
        help="end every document with the tokenizer's end-of-document id (byte: 256); train with data.append_eod=true",
    )
    args = p.parse_args(argv)
    tokens = 0
    try:
        tokenizer = build_tokenizer(args.tokenizer, eod=args.append_eod)
        chat = LazyChatRenderer(args.chat_template_dir or chat_template_dir(args.tokenizer))
        parse = RowParser(tokenizer, args.json_key, chat, append_eod=args.append_eod)
        rows = arrow_rows(args.input) if is_arrow_source(args.input) else jsonl_rows(args.input)

        def samples():
            nonlocal tokens
            for where, row in rows:
                for sample in parse(row, where):
                    tokens += len(sample.tokens)
                    yield sample

        count = write_indexed(args.output_prefix, samples(), tokenizer.vocab_size, empty_ok=False, source=args.input)
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    eod = f" (each ending in end-of-document id {tokenizer.eod_id})" if args.append_eod else ""
    print(f"wrote {count} samples, {tokens} tokens{eod} to {args.output_prefix}.bin/.idx")
    return 0


if __name__ == "__main__":
    sys.exit(main())
