"""The model and task both RL benchmarks share (``tools/bench/bench_rl_vs_trl.py``,
``tools/bench/profile_rl_step.py``): random Hugging Face Qwen3 models of named shapes with a
byte-level BPE tokenizer trained on the task's prompts, and the GRPO demo's task.
"""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SIZES = {
    "tiny": dict(
        num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    ),
    "medium": dict(
        num_hidden_layers=4, hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4
    ),
}
PROMPTS = REPO / "configs" / "grpo_demo" / "prompts.jsonl"
REWARD = f"{REPO / 'configs' / 'grpo_demo' / 'reward.py'}:reward"


def parse_size(text: str) -> tuple[str, dict]:
    """``NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS`` -> (name, Qwen3 config fields)."""
    name, _, numbers = text.partition("=")
    values = [int(x) for x in numbers.split(",")]
    if not name or len(values) != 5:
        raise ValueError(f"--size {text!r}: expected NAME=LAYERS,HIDDEN,FFN,HEADS,KV_HEADS")
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")
    return name, dict(zip(keys, values))


def build_model(out: Path, shape: dict, prompts: Path = PROMPTS, seed: int = 0) -> Path:
    """A random Qwen3 of ``shape`` with a byte-level BPE tokenizer trained on the prompts (its
    vocabulary sizes the model), initialised from ``seed``."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rows = [json.loads(line) for line in prompts.read_text().splitlines() if line.strip()]
    texts = [r["prompt"] + " " + " ".join(str(v) for k, v in r.items() if k != "prompt") for r in rows]
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    cfg = transformers.Qwen3Config(
        vocab_size=len(fast),
        head_dim=shape["hidden_size"] // shape["num_attention_heads"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        **shape,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    fast.save_pretrained(out)
    return out
