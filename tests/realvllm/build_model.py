"""Build a tiny random-weight Llama and its tokenizer in a directory, with no hub access.

Run with the vLLM environment's Python (it has torch, transformers and tokenizers):
    python build_model.py OUT_DIR
The tokenizer is a byte-level BPE trained here on generated English-like text; the model has a few small
layers and a long position range, so prompts of tens of thousands of tokens fit. Same output for the same
arguments: the corpus and the weights are seeded.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = ["engine", "step", "prefill", "decode", "token", "request", "queue", "cache", "block", "batch", "chunk",
    "latency", "throughput", "scheduler", "model", "layer", "attention", "kernel", "memory", "bandwidth", "clock",
    "power", "tensor", "stream", "prompt", "answer", "time", "budget", "the", "a", "of", "to", "in", "and", "for",
    "on", "with", "by", "at", "from", "as", "is", "was", "are", "be", "this", "that", "it", "each", "every", "one",
    "two", "three", "long", "short", "fast", "slow", "first", "last", "next", "new", "old", "high", "low", "full",
    "empty", "open", "close", "start", "stop", "wait", "run"]
MAX_POSITIONS = 65_536


def corpus(lines: int, seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "." for _ in range(lines)]


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(corpus(5_000), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=MAX_POSITIONS)
    fast.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=True,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    (out / "stepline-tiny-model.json").write_text(json.dumps({"vocab": len(fast), "max_positions": MAX_POSITIONS}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
