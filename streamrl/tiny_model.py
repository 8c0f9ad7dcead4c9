"""Build a random-initialised causal LM with a locally trained tokenizer and a chat template.

No model hub is reachable from these machines, so tests, demos and benchmarks build their models
here. ``tiny`` is small enough for vLLM on a 2-core CPU; the named shapes reproduce the layer sizes of
real models (weights random) for GPU throughput measurements.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}<|im_start|>tool\n{{ message['content'] }}<|im_end|>\n"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}<|im_start|>assistant\n"
    "{% if message['content'] %}{{ message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}<tool_call>{{ call['function'] | tojson }}</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

SHAPES: dict[str, dict[str, int | float]] = {
    # hidden, layers, heads, kv heads, intermediate
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        vocab_size=2048,
    ),
    "qwen2.5-0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "qwen2.5-1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
        vocab_size=151936,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
        vocab_size=152064,
    ),
}

_WORDS = [
    "the",
    "a",
    "an",
    "of",
    "to",
    "and",
    "in",
    "is",
    "was",
    "for",
    "on",
    "that",
    "with",
    "as",
    "by",
    "at",
    "from",
    "it",
    "this",
    "be",
    "are",
    "or",
    "have",
    "not",
    "but",
    "what",
    "all",
    "were",
    "when",
    "we",
    "there",
    "can",
    "your",
    "which",
    "their",
    "said",
    "if",
    "do",
    "will",
    "each",
    "about",
    "how",
    "up",
    "out",
    "them",
    "then",
    "she",
    "many",
    "some",
    "so",
    "these",
    "would",
    "other",
    "into",
    "has",
    "more",
    "her",
    "two",
    "like",
    "him",
    "see",
    "time",
    "could",
    "no",
    "make",
    "than",
    "first",
    "been",
    "its",
    "who",
    "now",
    "people",
    "my",
    "made",
    "over",
    "did",
    "down",
    "only",
    "way",
    "find",
    "use",
    "may",
    "water",
    "long",
    "little",
    "very",
    "after",
    "words",
    "called",
    "just",
    "where",
    "most",
    "know",
    "get",
    "through",
    "back",
    "much",
    "before",
    "go",
    "good",
    "new",
    "write",
    "our",
    "used",
    "me",
    "man",
    "too",
    "any",
    "day",
    "same",
    "right",
    "look",
    "think",
    "also",
    "around",
    "another",
    "came",
    "come",
    "work",
    "three",
    "word",
    "must",
    "because",
    "does",
    "part",
    "even",
    "place",
    "well",
    "such",
    "here",
    "take",
    "why",
    "help",
    "put",
    "different",
    "away",
    "again",
    "off",
    "went",
    "old",
    "number",
    "great",
    "tell",
    "men",
    "say",
    "small",
    "every",
    "found",
    "still",
    "between",
    "name",
    "should",
    "home",
    "big",
    "give",
    "air",
    "line",
    "set",
    "own",
    "under",
    "read",
    "last",
    "never",
    "us",
    "left",
    "end",
    "along",
    "while",
    "might",
    "next",
    "sound",
    "below",
    "saw",
    "something",
    "thought",
    "both",
    "few",
    "those",
    "always",
    "show",
    "large",
    "often",
    "together",
    "asked",
    "house",
    "world",
    "going",
    "want",
    "school",
    "important",
    "until",
    "form",
    "food",
    "keep",
    "children",
    "feet",
    "land",
    "side",
    "without",
    "boy",
    "once",
    "animal",
    "life",
    "enough",
    "took",
    "four",
    "head",
    "above",
    "kind",
    "began",
    "almost",
    "live",
    "page",
    "got",
    "earth",
    "need",
    "far",
    "hand",
    "high",
    "year",
    "mother",
    "light",
    "country",
    "father",
    "let",
    "night",
    "picture",
    "being",
    "study",
    "second",
    "soon",
    "story",
    "since",
    "white",
    "ever",
    "paper",
    "hard",
    "near",
    "sentence",
    "better",
    "best",
    "across",
    "during",
    "today",
    "however",
    "sure",
    "knew",
    "try",
    "told",
    "young",
    "sun",
    "thing",
    "whole",
    "hear",
    "example",
    "heard",
    "several",
    "change",
    "answer",
    "room",
    "sea",
    "against",
    "top",
    "turned",
    "learn",
    "point",
    "city",
    "play",
    "toward",
    "five",
    "himself",
    "usually",
    "money",
    "seen",
    "car",
    "morning",
    "yes",
    "no",
    "true",
    "false",
    "add",
    "sum",
    "plus",
    "minus",
    "times",
    "equals",
    "result",
    "tool",
    "call",
    "calculator",
    "board",
    "move",
    "win",
    "lose",
    "draw",
    "player",
    "opponent",
    "position",
    "row",
    "column",
    "cell",
    "empty",
    "game",
    "turn",
    "answer",
    "question",
    "user",
    "assistant",
    "system",
    "please",
    "reply",
    "with",
    "only",
    "one",
    "letter",
    "digit",
    "word",
    "count",
    "color",
    "red",
    "green",
    "blue",
    "yellow",
    "black",
]


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        kind = rng.random()
        if kind < 0.5:
            lines.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16))).capitalize() + ".")
        elif kind < 0.8:
            a, b = rng.randint(0, 999), rng.randint(0, 999)
            op = rng.choice("+-*")
            lines.append(f"What is {a} {op} {b}? {eval(f'{a}{op}{b}')}")
        else:
            lines.append(
                json.dumps(
                    {
                        "name": rng.choice(["add", "multiply", "move"]),
                        "arguments": {"a": rng.randint(0, 99), "b": rng.randint(0, 99)},
                    }
                )
            )
    return lines


def train_tokenizer(vocab_size: int = 2048, seed: int = 0):
    """A byte-level BPE tokenizer trained on a synthetic corpus (words, numbers, JSON tool calls)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(20_000, seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(
    out_dir: str | Path,
    shape: str = "tiny",
    *,
    seed: int = 0,
    vocab_size: int | None = None,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
) -> Path:
    """Write config, random weights (safetensors), tokenizer and generation config to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    dims = dict(SHAPES[shape])
    tokenizer = train_tokenizer(vocab_size=min(int(dims["vocab_size"]), 2048), seed=seed)
    vocab = vocab_size or int(dims.pop("vocab_size"))
    dims.pop("vocab_size", None)
    vocab = max(vocab, len(tokenizer))
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab,
        max_position_embeddings=max_position_embeddings,
        rope_theta=10000.0,
        tie_word_embeddings=shape == "tiny",
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.eos_token_id,
        torch_dtype=dtype,
        **dims,
    )
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    ).save_pretrained(out)
    return out


def random_adapter(model_dir: Path, out_dir: Path, *, seed: int, rank: int = 8, scale: float = 0.5) -> Path:
    """A LoRA adapter (q_proj, v_proj) on ``model_dir`` whose B matrices are random, so that each seed
    changes the model's outputs. Written with peft, loadable by vLLM (the hot-swap tests and benchmark)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for pname, param in peft_model.named_parameters():
            if "lora_B" in pname:
                param.normal_(0.0, scale)
    peft_model.save_pretrained(out_dir)
    return Path(out_dir)
