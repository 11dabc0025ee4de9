"""Chat-template rendering with an assistant-only loss mask, on a tokenizer built here (no hub)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import transformers  # noqa: E402,F401  (a dev dependency: a missing one fails, never skips)

from backend.data.chat import ChatRenderer, ChatTemplateError, read_chat_jsonl  # noqa: E402
from backend.data.jsonl import DataFormatError  # noqa: E402

PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
GENERATION = (
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
    "{% generation %}{{ m.content }}<|im_end|>\n{% endgeneration %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Rewrites history: earlier assistant turns lose their text before "</think>" (as Qwen3's does).
UNSTABLE = (
    "{% for m in messages %}{% if m.role == 'assistant' and not loop.last %}"
    "<|im_start|>assistant\n{{ m.content.split('</think>')[-1] }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "four"},
    {"role": "user", "content": "and three plus three"},
    {"role": "assistant", "content": "six, of course"},
]


def _tokenizer_dir(tmp_path, template: str, where: str = "jinja"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [m["content"] for m in CONVERSATION] + ["assistant user system", "hello world"] * 5
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
    out = tmp_path / f"tok_{where}"
    fast.save_pretrained(out)
    for stale in ("chat_template.jinja",):
        (out / stale).unlink(missing_ok=True)
    if where == "jinja":
        (out / "chat_template.jinja").write_text(template)
    else:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        cfg["chat_template"] = template
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def _assistant_text(renderer, ids, mask):
    """Decoded runs of masked tokens."""
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(renderer.tokenizer.decode(cur))
            cur = []
    if cur:
        runs.append(renderer.tokenizer.decode(cur))
    return runs


@pytest.mark.parametrize("where", ["jinja", "config"])
def test_prefix_rendering_masks_assistant_turns_only(tmp_path, where):
    r = ChatRenderer(_tokenizer_dir(tmp_path, PLAIN, where))
    assert not r.uses_generation_blocks
    ids, mask = r.render(CONVERSATION)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    assert r.tokenizer.decode(ids) == r.tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    # The answer and its end-of-turn marker are trained; role headers and user text are not.
    assert _assistant_text(r, ids, mask) == ["four<|im_end|>\n", "six, of course<|im_end|>\n"]


def test_generation_blocks_give_the_same_mask(tmp_path):
    plain = ChatRenderer(_tokenizer_dir(tmp_path, PLAIN, "jinja"))
    (tmp_path / "g").mkdir()
    gen = ChatRenderer(_tokenizer_dir(tmp_path / "g", GENERATION, "jinja"))
    assert gen.uses_generation_blocks
    assert gen.render(CONVERSATION) == plain.render(CONVERSATION)


def test_history_rewriting_template_is_refused(tmp_path):
    r = ChatRenderer(_tokenizer_dir(tmp_path, UNSTABLE, "jinja"))
    convo = [dict(m) for m in CONVERSATION]
    convo[2]["content"] = "hmm</think>four"
    with pytest.raises(ChatTemplateError, match=r"rows.jsonl:7: message 2: .* not prefix-stable"):
        r.render(convo, "rows.jsonl:7")


def test_jsonl_rows_and_errors_name_file_and_line(tmp_path):
    r = ChatRenderer(_tokenizer_dir(tmp_path, PLAIN, "jinja"))
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": CONVERSATION}, {"messages": CONVERSATION[:3]}]
    path.write_text("\n".join(json.dumps(x) for x in rows) + "\n\n")
    samples = list(read_chat_jsonl(path, r))
    assert len(samples) == 2 and samples[1].loss_mask.dtype == np.int64
    assert samples[1].loss_tokens() == int(samples[1].loss_mask[1:].sum()) > 0

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"messages": [{"role": "robot", "content": "x"}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: message 0 has role 'robot'"):
        list(read_chat_jsonl(bad, r))
    bad.write_text(json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:1: .*no assistant tokens"):
        list(read_chat_jsonl(bad, r))


def test_template_failures_name_the_template(tmp_path):
    with pytest.raises(ChatTemplateError, match=r"chat_template.jinja:2: chat template syntax error"):
        ChatRenderer(_tokenizer_dir(tmp_path, "{% for m in messages %}\n{{ m.content }\n", "jinja"))
    (tmp_path / "b").mkdir()
    r = ChatRenderer(
        _tokenizer_dir(
            tmp_path / "b",
            "{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}{% endif %}" + PLAIN,
            "jinja",
        )
    )
    with pytest.raises(ChatTemplateError, match=r"rows.jsonl:3: chat template .* system first"):
        r.render(CONVERSATION[1:], "rows.jsonl:3")
    (tmp_path / "c").mkdir()
    none = _tokenizer_dir(tmp_path / "c", PLAIN, "jinja")
    (none / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatRenderer(none)


def test_messages_rows_in_training_data_and_preprocess(tmp_path):
    """A JSONL with ``messages`` trains directly (data.path) and through tools/preprocess_data.py,
    with the same tokens and assistant-only masks; a bad row names file and line."""
    from types import SimpleNamespace

    from backend.data.build import build_dataset
    from backend.data.indexed import IndexedTokenDataset
    from tests.helpers.hf_tiny import save_tiny_tokenizer
    from tools.preprocess_data import main as preprocess

    tok = save_tiny_tokenizer(tmp_path / "tok", PLAIN)
    rows = tmp_path / "chat.jsonl"
    rows.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"text": "hello world"}) + "\n")
    data_cfg = SimpleNamespace(
        tokenizer=str(tok), path=str(rows), json_key="text", max_seq_length=512, overlong="error", cache_dir=""
    )
    dataset, _ = build_dataset(data_cfg)
    direct = dataset[0]
    expected_ids, expected_mask = ChatRenderer(tok).render(CONVERSATION)
    assert direct.tokens.tolist() == expected_ids and direct.loss_mask.tolist() == expected_mask
    assert dataset[1].loss_mask is None  # plain text rows keep training on every token

    assert preprocess(["--input", str(rows), "--output-prefix", str(tmp_path / "pre"), "--tokenizer", str(tok)]) == 0
    indexed = IndexedTokenDataset(str(tmp_path / "pre"))  # kept alive: samples view its memory map
    pre = indexed[0]
    assert pre.tokens.tolist() == expected_ids and pre.loss_mask.tolist() == expected_mask

    rows.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + json.dumps({"messages": [{"role": "bot"}]}) + "\n")
    with pytest.raises(DataFormatError, match=r"chat.jsonl:2: message 0 has role 'bot'"):
        build_dataset(data_cfg)
    data_cfg.tokenizer = "byte"
    with pytest.raises(DataFormatError, match=r"chat.jsonl:1: a 'messages' row needs a chat template"):
        build_dataset(data_cfg)
