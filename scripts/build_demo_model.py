"""Build the demo model: a small random-weight Llama with a locally trained tokenizer.

Offline and in seconds. Its output is noise; it exists so that every code path (tokenizer, chat
template, safetensors loading, KV cache, sampling, detokenization) is the real one without a
download. Usage: ``python scripts/build_demo_model.py [OUTPUT_DIR]`` (default ``models/demo``).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = """
the of and to in is that it was for on are as with his they at be this from have or by one
had not but what all were when we there can an your which their said if do will each about
how up out them then she many some so these would other into has more her two like him see
time could no make than first been its who now people my made over did down only way find
use may water long little very after words called just where most know model token stream
batch device queue worker redis request answer Ascend NPU inference server hello world
assistant user system
""".split()  # noqa: SIM905 - a word list reads better as text
CJK = "你好世界推理服务模型请求流式文本生成昇腾我是一个助手数学学生爱好"


def corpus(lines: int, seed: int = 0) -> list[str]:
    """Pseudo-English and Chinese lines: enough to train merges, including multi-byte characters."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.append("".join(rng.choice(CJK) for _ in range(rng.randint(2, 8))))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 10_000)))
        out.append(" ".join(words) + rng.choice([".", "?", "!", ","]))
    return out


def build_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(20_000), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


# SentencePiece byte-fallback layouts, as transformers converts them to tokenizer.json: "llama2" (Llama 2,
# Mistral up to v0.3, Phi-3: a "▁" prepended, the first space stripped when decoding) and "gemma" (no
# prepended "▁"). Characters outside the learned alphabet are encoded as their UTF-8 bytes, `<0xNN>`.
SENTENCEPIECE_LAYOUTS = ("llama2", "gemma")
SENTENCEPIECE_SPECIALS = ["<unk>", "<s>", "</s>"]


def build_sentencepiece_tokenizer(vocab_size: int, layout: str):
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    if layout == "llama2":
        normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    else:
        normalizer = normalizers.Replace(" ", "▁")
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    learner = Tokenizer(models.BPE(unk_token="<unk>"))
    learner.normalizer = normalizer
    # A small alphabet, most CJK characters outside it: they take the byte-fallback path.
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SENTENCEPIECE_SPECIALS, limit_alphabet=90)
    learner.train_from_iterator(corpus(20_000), trainer=trainer)
    learned = json.loads(learner.to_str())["model"]
    bytes_tokens = [f"<0x{b:02X}>" for b in range(256)]
    order = SENTENCEPIECE_SPECIALS + bytes_tokens
    order += [t for t, _ in sorted(learned["vocab"].items(), key=lambda item: item[1]) if t not in order]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learned["merges"]]
    tok = Tokenizer(
        models.BPE({t: i for i, t in enumerate(order)}, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence(steps)
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=2048,
    )


def build_model(tokenizer, hidden: int, layers: int, seed: int, vocab_size: int = 0):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=max(len(tokenizer), vocab_size),
        hidden_size=hidden,
        intermediate_size=hidden * 4,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    return LlamaForCausalLM(config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", nargs="?", default="models/demo", type=Path)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--tokenizer",
        choices=("byte-level", *SENTENCEPIECE_LAYOUTS),
        default="byte-level",
        help="byte-level BPE (GPT-2, Llama 3, Qwen), or a SentencePiece byte-fallback layout",
    )
    parser.add_argument(
        "--model-vocab-size",
        type=int,
        default=0,
        help="the model's vocabulary, when larger than what the tokenizer learns from its small corpus "
        "(for benchmarks: ids past the tokenizer's decode to nothing)",
    )
    args = parser.parse_args(argv)

    if args.tokenizer == "byte-level":
        tokenizer = build_tokenizer(args.vocab_size)
    else:
        tokenizer = build_sentencepiece_tokenizer(args.vocab_size, args.tokenizer)
    model = build_model(tokenizer, args.hidden_size, args.layers, args.seed, args.model_vocab_size)
    args.output.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.output)
    model.save_pretrained(args.output, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    print(f"demo model ({params / 1e6:.1f}M random parameters, noise output) written to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
