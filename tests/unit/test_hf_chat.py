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


def _tokenizer_dir(tmp_path, template: str, where: str = "jinja", specials=("<|im_start|>", "<|im_end|>"), bos=None):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=list(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = [m["content"] for m in CONVERSATION] + ["assistant user system", "hello world"] * 5
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=specials[-1], bos_token=bos)
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


# Behaves like Qwen3's released template: a system preamble when the conversation has none, tool
# results as user turns, and the reasoning of assistant turns before the last user message dropped.
QWEN_LIKE = (
    "{% if messages[0].role != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}{% if m.role == 'assistant' %}{% set content = m.content %}"
    "{% if loop.index0 < ns.last_user and '</think>' in content %}"
    "{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
    "<|im_start|>assistant\n{{ content }}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
AGENT = [
    {"role": "user", "content": "what is two plus two"},
    {"role": "assistant", "content": "<think>add</think>\n\nfour"},
    {"role": "user", "content": "and three plus three"},
    {"role": "assistant", "content": "<think>use the tool</think>call plus"},
    {"role": "tool", "content": "6"},
    {"role": "assistant", "content": "<think>it said 6</think>\n\nsix, of course"},
]


def test_a_template_that_rewrites_earlier_turns_trains_each_turn_as_generated(tmp_path):
    """Each assistant turn is one sample: the prompt as the template renders it when that turn is
    generated, the loss on the turn (reasoning included) and its end-of-turn marker."""
    r = ChatRenderer(_tokenizer_dir(tmp_path, QWEN_LIKE, "jinja"))
    turns = r.render_turns(AGENT, "rows.jsonl:7")
    assert len(turns) == 3
    decode = r.tokenizer.decode
    for (ids, mask), k in zip(turns, (1, 3, 5)):
        assert decode(ids) == r.tokenizer.apply_chat_template(AGENT[: k + 1], tokenize=False)
        assert _assistant_text(r, ids, mask) == [AGENT[k]["content"] + "<|im_end|>\n"]
    # Later prompts hold earlier turns as the template shows them then: the first answer's
    # reasoning is gone once a later user message follows, and a preamble opens every sample.
    last = decode(turns[2][0])
    assert "<think>add</think>" not in last and "<|im_start|>assistant\nfour<|im_end|>" in last
    assert all(decode(ids).startswith("<|im_start|>system\nYou are helpful.") for ids, _ in turns)
    assert "<tool_response>\n6\n</tool_response>" in last
    with pytest.raises(ChatTemplateError, match=r"rows.jsonl:7: .* rewrites earlier turns, so this conversation is 3"):
        r.render(AGENT, "rows.jsonl:7")
    # A conversation the template renders without rewriting stays one sample.
    assert len(r.render_turns(AGENT[:2])) == 1


# Llama 3.1's released format: a system header with its knowledge and today's dates first, role
# headers, <|eot_id|> ending each turn.
LLAMA3 = (
    "{{ bos_token }}{% if messages[0].role == 'system' %}{% set system = messages[0].content %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
    "Today Date: 26 Jul 2024\n\n{{ system }}<|eot_id|>"
    "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content | trim }}<|eot_id|>"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_llama3_format_masks_each_answer_and_its_end_of_turn(tmp_path):
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    r = ChatRenderer(_tokenizer_dir(tmp_path, LLAMA3, "jinja", specials=specials, bos="<|begin_of_text|>"))
    turns = r.render_turns(CONVERSATION)
    assert len(turns) == 1
    ids, mask = turns[0]
    assert r.tokenizer.decode(ids).startswith("<|begin_of_text|><|start_header_id|>system")
    assert _assistant_text(r, ids, mask) == ["four<|eot_id|>", "six, of course<|eot_id|>"]
    tokens = [r.tokenizer.convert_ids_to_tokens(i) for i, m in zip(ids, mask) if m]
    assert tokens.count("<|eot_id|>") == 2 and "<|end_header_id|>" not in tokens


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

    from backend.commands.preprocess_data import main as preprocess
    from backend.data.build import build_dataset
    from backend.data.indexed import IndexedTokenDataset
    from tests.helpers.hf_tiny import save_tiny_tokenizer

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


def test_rows_that_became_more_samples_are_reported(tmp_path):
    """A rewriting template turns one JSONL row into one sample per assistant turn; the dataset's
    note (shown in the start-up summary) says how many rows became how many samples."""
    from types import SimpleNamespace

    from backend.data.build import build_dataset

    tok = _tokenizer_dir(tmp_path, QWEN_LIKE, "jinja")
    rows = tmp_path / "agent.jsonl"
    rows.write_text(json.dumps({"messages": AGENT}) + "\n" + json.dumps({"messages": AGENT[:2]}) + "\n")
    data_cfg = SimpleNamespace(
        tokenizer=str(tok), path=str(rows), json_key="text", max_seq_length=512, overlong="error", cache_dir=""
    )
    dataset, _ = build_dataset(data_cfg)
    assert len(dataset) == 4
    assert dataset.note == "2 rows as 4 samples: one per assistant turn where the chat template rewrites earlier turns"
