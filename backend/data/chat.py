"""Chat data: JSONL rows of ``messages`` rendered with the checkpoint's chat template, with a loss
mask that is 1 only on the assistant turns' tokens.

    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}

The template comes from the tokenizer directory: ``chat_template.jinja`` if present, else the
``chat_template`` key of ``tokenizer_config.json`` (a string, or a list of named templates of
which ``default`` is used). It runs in transformers' sandboxed Jinja environment; the tokenizer is
loaded with ``local_files_only`` and never with remote code.

Which tokens are the assistant's:

- Templates with ``{% generation %}`` ... ``{% endgeneration %}`` blocks mark them exactly:
  ``apply_chat_template(..., return_assistant_tokens_mask=True, return_dict=True)``.
- Other templates (most released ones): for assistant message k, the text rendered for
  ``messages[:k]`` with the generation prompt is where its turn starts and the text rendered for
  ``messages[:k+1]`` is where it ends (so the end-of-turn marker, e.g. ``<|im_end|>``, is trained
  and the role header is not). The spans are compared in characters, not token prefixes, because
  BPE may merge across a turn boundary; each token overlapping a span is masked in, which is the
  rule transformers applies to generation blocks (both paths give the same mask, tested).
- Templates that rewrite earlier turns (Qwen3's drops the reasoning of assistant turns before the
  last user message; others add or move a system preamble) are used as released. Each assistant
  turn is trained exactly as the model produces it at that point of the conversation: the prompt
  is ``messages[:k]`` rendered with the generation prompt, the target the turn's new tokens and
  its end-of-turn marker as rendered for ``messages[:k+1]``. When the template renders the whole
  conversation with every earlier turn unchanged (prefix-stable), all turns share one sample; when
  it does not, the conversation becomes one sample per assistant turn (``render_turns``), so no
  turn is trained in a form the model never sees at inference (Qwen3's reasoning is trained on
  the turn that carries it, and earlier turns appear in later prompts as the template shows them).
  The cost is the prompt repeated per turn; the start-up summary counts the samples.

Every error names the JSONL file and line, or the template file and line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from backend.data.jsonl import DataFormatError, parse_json_line
from backend.data.sample import Sample

ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(DataFormatError):
    """A missing or failing chat template; the message names the file (and line) or the row."""


def _template_source(tokenizer_dir: Path) -> tuple[str, str]:
    """(template text, where it came from)."""
    jinja = tokenizer_dir / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config = tokenizer_dir / "tokenizer_config.json"
    if config.is_file():
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str) and template:
            return template, f"{config} (chat_template)"
    where = (
        f"{config} has no 'chat_template' and there is no chat_template.jinja"
        if config.is_file()
        else "neither chat_template.jinja nor tokenizer_config.json"
    )
    raise ChatTemplateError(
        f"{tokenizer_dir}: no chat template ({where}); chat 'messages' rows need a chat model's tokenizer "
        "(or write plain 'text' rows)"
    )


class ChatRenderer:
    """Renders message lists to (token ids, assistant loss mask) with one tokenizer and template."""

    def __init__(self, tokenizer_dir: str | Path):
        from transformers import AutoTokenizer

        self.dir = Path(tokenizer_dir)
        self.template, self.template_source = _template_source(self.dir)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(
                str(self.dir), local_files_only=True, trust_remote_code=False
            )
        except Exception as e:
            raise ChatTemplateError(f"{self.dir}: cannot load the tokenizer: {type(e).__name__}: {e}") from None
        if not getattr(self.tokenizer, "is_fast", False):
            raise ChatTemplateError(f"{self.dir}: a fast tokenizer (tokenizer.json) is needed for token offsets")
        self.tokenizer.chat_template = self.template
        self.uses_generation_blocks = bool(_GENERATION.search(self.template))
        self._check_syntax()

    def _check_syntax(self) -> None:
        from jinja2 import TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"])
        try:
            # generation blocks are transformers' extension; plain Jinja must still parse the rest
            env.parse(_GENERATION.sub("", re.sub(r"\{%-?\s*endgeneration\s*-?%\}", "", self.template)))
        except TemplateSyntaxError as e:
            line = f":{e.lineno}" if not self.template_source.endswith(")") else f" line {e.lineno}"
            raise ChatTemplateError(f"{self.template_source}{line}: chat template syntax error: {e.message}") from None

    def _render(self, messages: list[dict], where: str, **kwargs) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        except Exception as e:  # jinja errors, raise_exception() in the template
            raise ChatTemplateError(
                f"{where}: chat template ({self.template_source}) failed: {type(e).__name__}: {e}"
            ) from None

    def render(self, messages, where: str = "messages") -> tuple[list[int], list[int]]:
        """(token ids, loss mask) of a conversation that renders as one sample (see ``render_turns``)."""
        turns = self.render_turns(messages, where)
        if len(turns) != 1:
            raise ChatTemplateError(
                f"{where}: the chat template ({self.template_source}) rewrites earlier turns, so this conversation "
                f"is {len(turns)} samples, one per assistant turn (render_turns)"
            )
        return turns[0]

    def render_turns(self, messages, where: str = "messages") -> list[tuple[list[int], list[int]]]:
        """[(token ids, loss mask)]: one sample, or one per assistant turn when the template rewrites
        earlier turns (module docstring); ``where`` prefixes errors (FILE:LINE or FILE: row N)."""
        _check_messages(messages, where)
        if self.uses_generation_blocks:
            try:
                out = self.tokenizer.apply_chat_template(
                    messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
                )
            except Exception as e:
                raise ChatTemplateError(
                    f"{where}: chat template ({self.template_source}) failed: {type(e).__name__}: {e}"
                ) from None
            turns = [(list(out["input_ids"]), [int(m) for m in out["assistant_masks"]])]
        else:
            turns = self._render_by_prefixes(messages, where)
        if not any(any(mask) for _, mask in turns):
            raise DataFormatError(f"{where}: the conversation has no assistant tokens to train on")
        return turns

    def generation_prompt(self, messages, where: str = "messages") -> tuple[str, list[int]]:
        """(text, token ids) of ``messages`` followed by the template's generation prompt: what a
        sampler continues with the assistant's reply (an RL loop's prompt)."""
        _check_messages(messages, where)
        text = self._render(messages, where, add_generation_prompt=True)
        return text, list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _render_by_prefixes(self, messages: list[dict], where: str) -> list[tuple[list[int], list[int]]]:
        full = self._render(messages, where)
        turns = []  # (text the turn is the last of, its span there)
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start = self._render(messages[:k], where, add_generation_prompt=True) if k else ""
            end = self._render(messages[: k + 1], where)
            if not end.startswith(start):
                raise ChatTemplateError(
                    f"{where}: message {k}: the chat template ({self.template_source}) renders the conversation up "
                    "to this assistant turn without the prompt it renders for generating it, so the turn cannot be "
                    "located; add {% generation %} ... {% endgeneration %} around assistant content"
                )
            turns.append((end, (len(start), len(end))))
        if all(full.startswith(end) for end, _ in turns):  # prefix-stable: one sample holds every turn
            return [self._masked(full, [span for _, span in turns])]
        return [self._masked(end, [span]) for end, span in turns]

    def _masked(self, text: str, spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """``text``'s tokens and a mask of 1 on each token overlapping a span (in characters)."""
        enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mask = [int(any(e > s0 and b < s1 for s0, s1 in spans)) for b, e in enc["offset_mapping"]]
        return list(enc["input_ids"]), mask


def _check_messages(messages, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise DataFormatError(f"{where}: 'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise DataFormatError(f"{where}: message {i} must be an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise DataFormatError(f"{where}: message {i} has role {m.get('role')!r} (allowed: {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str):
            raise DataFormatError(f"{where}: message {i} ({m['role']}) needs 'content' as a string")


def chat_template_dir(tokenizer_spec: str) -> Path | None:
    """The directory whose chat template goes with ``data.tokenizer`` (a directory, or the one
    holding a tokenizer.json); None for the byte tokenizer."""
    if tokenizer_spec in ("byte", "auto"):
        return None
    path = Path(tokenizer_spec)
    return path if path.is_dir() else path.parent


class LazyChatRenderer:
    """A ChatRenderer made on the first ``messages`` row: plain-text data never needs transformers."""

    def __init__(self, tokenizer_dir: str | Path | None):
        self.dir = tokenizer_dir
        self._renderer: ChatRenderer | None = None

    def render_turns(self, messages, where: str = "messages") -> list[tuple[list[int], list[int]]]:
        if self.dir is None:
            raise DataFormatError(
                f"{where}: a 'messages' row needs a chat template: set data.tokenizer (or --chat-template-dir) "
                "to a Hugging Face tokenizer directory that has one"
            )
        if self._renderer is None:
            self._renderer = ChatRenderer(self.dir)
        return self._renderer.render_turns(messages, where)


def read_chat_jsonl(path: str | Path, renderer: ChatRenderer) -> Iterator[Sample]:
    """Samples (tokens, loss_mask) of each non-blank line of ``path`` (one per conversation, or one
    per assistant turn for a template that rewrites earlier turns)."""
    path = Path(path)
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = parse_json_line(line, where)
            if not isinstance(row, dict) or "messages" not in row:
                raise DataFormatError(f"{where}: expected an object with 'messages'")
            for ids, mask in renderer.render_turns(row["messages"], where):
                yield Sample(tokens=np.asarray(ids, dtype=np.int64), loss_mask=np.asarray(mask, dtype=np.int64))
