"""The RL loop's prompts: a JSONL file of ``prompt`` (text) or ``messages`` (chat) rows, each
also carrying whatever fields its reward function reads (an answer, test cases, ...).

Every row is checked when the loop starts, before anything is generated: a row that is not an
object, has neither field, has an empty prompt or one over ``data.max_seq_length`` stops the
loop with an error naming the file and line. ``messages`` are rendered with the tokenizer's chat
template and its generation prompt (``add_generation_prompt``), so the response follows the
assistant header the template writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from backend.data.chat import ChatRenderer, chat_template_dir
from backend.data.errors import DataFormatError, DataNotFoundError
from backend.data.jsonl import jsonl_rows


@dataclass
class Prompt:
    text: str  # what the reward sees as the prompt (the rendered chat for messages rows)
    token_ids: list[int]
    row: dict  # the JSONL row, as read
    where: str  # FILE:LINE, for messages


def read_prompts(path: str | Path, tokenizer, data_cfg, *, max_new_tokens: int) -> list[Prompt]:
    """Every prompt of ``path``, tokenised, in file order (see the module docstring)."""
    path = Path(path)
    if not str(path):
        raise DataNotFoundError("rl.prompts: not set; point it at a JSONL file of prompt rows")
    if not path.is_file():
        raise DataNotFoundError(f"rl.prompts: no such file {path}")
    renderer = None
    prompts = []
    for where, row in jsonl_rows(path):
        if not isinstance(row, dict):
            raise DataFormatError(f"{where}: expected a JSON object with 'prompt' or 'messages'")
        if "prompt" in row:
            text = row["prompt"]
            if not isinstance(text, str) or not text:
                raise DataFormatError(f"{where}: 'prompt' must be a non-empty string")
            ids = list(tokenizer.encode(text))
        elif "messages" in row:
            if renderer is None:
                template_dir = chat_template_dir(data_cfg.tokenizer)
                if template_dir is None:
                    raise DataFormatError(
                        f"{where}: a 'messages' prompt needs a chat template: set data.tokenizer to a Hugging Face "
                        f"tokenizer directory that has one (data.tokenizer={data_cfg.tokenizer})"
                    )
                renderer = ChatRenderer(template_dir)
            text, ids = renderer.generation_prompt(row["messages"], where)
        else:
            raise DataFormatError(f"{where}: no 'prompt' or 'messages' field (keys: {', '.join(row) or 'none'})")
        if not ids:
            raise DataFormatError(f"{where}: the prompt has no tokens")
        if len(ids) + max_new_tokens > data_cfg.max_seq_length:
            raise DataFormatError(
                f"{where}: the prompt's {len(ids)} tokens plus rl.max_new_tokens={max_new_tokens} exceed "
                f"data.max_seq_length={data_cfg.max_seq_length}; shorten it or raise data.max_seq_length"
            )
        prompts.append(Prompt(text=text, token_ids=ids, row=row, where=where))
    if not prompts:
        raise DataFormatError(f"{path}: no prompts (the file is empty or blank); point rl.prompts at a prompt file")
    return prompts
