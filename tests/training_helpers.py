"""Helpers for the training tests: a tiny chat model folder (byte-level BPE tokenizer with a ChatML template +
a tiny random Llama) and small chat datasets."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WORDS = ("the cat sat on a mat and the dog ran to the park while birds sang songs about rivers hills trees "
         "numbers one two three four five six seven eight nine ten what why how when where who please tell me "
         "story about code python jax medusa heads tokens fast slow").split()


def chat_records(n: int, seed: int = 0, turns: int = 1) -> list[dict]:
    """ShareGPT-format records with short random conversations."""
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        conv = []
        for _ in range(turns):
            conv.append({"from": "human", "value": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(2, 8)))})
            conv.append({"from": "gpt", "value": " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 30)))})
        out.append({"id": f"c{i}", "conversations": conv})
    return out


def write_json(path: Path, records) -> Path:
    path.write_text(json.dumps(records, indent=1))
    return path


def build_tiny_chat_model(folder: Path, seed: int = 0, **overrides) -> Path:
    """A tiny Llama (vocab 320) with a byte-level BPE tokenizer trained on WORDS and a ChatML template."""
    import torch
    import transformers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([" ".join(WORDS)] * 20 + ["user assistant system\n"] * 20, trainer)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    vocab = max(len(tok), 320)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    torch.manual_seed(seed)
    kw = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=None, eos_token_id=eos,
              pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    kw.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder
