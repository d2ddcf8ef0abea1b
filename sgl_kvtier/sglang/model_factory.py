"""Random-weight Qwen2 models and a matching tokenizer, made offline for tests, the demo and benchmarks.

There is no model hub here, and tests need a model whose KV geometry we choose: `tiny` for
end-to-end checks, `bench` (~89M parameters, so a 4k-token prefill costs seconds on CPU and
recompute is visibly dearer than loading), and `kvheavy` (128 KiB of bf16 KV per token from a small
hidden size, so L3 pages are large while compute stays cheap).

The tokenizer is a byte-level BPE trained in-process on a synthetic corpus of CV-syllable words.
`PROMPT_WORDS` are frequent enough in that corpus to become single tokens, both bare and after a
space, so `make_prompt(n, seed)` yields exactly `n` tokens; this is checked through `AutoTokenizer`
(SGLang's own loading path) every time a model is made. Training uses the pre-tokenizer that
transformers' `Qwen2Tokenizer` imposes on load: for `model_type: qwen2`, transformers 5 swaps in
that class and its pre-tokenizer whatever tokenizer.json says.
Everything is seeded. A marker file records the spec, so a second `make_model` with the same spec
reuses the directory.

CLI: `python -m sgl_kvtier.sglang.model_factory DIR --size tiny`
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
from pathlib import Path
from typing import Any

FACTORY_VERSION = 3
MARKER_NAME = "kvtier_model_spec.json"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The Qwen2 geometry of one size; every field goes into config.json."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    # Ten times transformers' default: at 0.02 a random model repeats one token whatever the
    # prompt, so "same output after an L3 hit" would prove nothing. At 0.2 greedy output
    # varies with the context and the top-1 token leads the runner-up by a clear margin.
    initializer_range: float = 0.2

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """K and V bytes one token occupies in the KV cache, over all layers."""
        return self.num_hidden_layers * self.num_key_value_heads * self.head_dim * 2 * dtype_bytes


SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(1024, 256, 512, 2, 4, 2, 64, 4096),
    # ~89M parameters: 8 x (3.1M attention + 7.9M MLP) + 1M tied embeddings.
    "bench": ModelSpec(1024, 1024, 2560, 8, 16, 8, 64, 8192),
    # 64 layers x 8 KV heads x 64 x (K, V) x 2 bytes = 128 KiB per token (8x `bench`), ~100M parameters.
    # head_dim must equal hidden_size / heads: SGLang's CPU attention path assumes it (a 256-wide model
    # with 16 heads of 64 crashed in set_kv_buffer).
    "kvheavy": ModelSpec(1024, 512, 512, 64, 8, 8, 64, 8192),
}


def _corpus_words() -> tuple[list[str], list[str]]:
    """(prompt words, rare words): distinct 2-syllable pseudo-words, fixed by a seed."""
    rng = random.Random(1234)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"]
    words = [a + b for a in syllables for b in syllables]
    rng.shuffle(words)
    return sorted(words[:200]), words[200:3000]


PROMPT_WORDS, _RARE_WORDS = _corpus_words()


def make_prompt(n_tokens: int, seed: int = 0, model_dir: Path | str | None = None) -> str:
    """A text of exactly `n_tokens` tokens for this factory's tokenizer (checked if `model_dir` is given).

    Different seeds give different texts, hence different prefix-cache keys.
    """
    if n_tokens < 1:
        raise ValueError("n_tokens must be at least 1")
    rng = random.Random(seed)
    text = " ".join(rng.choice(PROMPT_WORDS) for _ in range(n_tokens))
    if model_dir is not None:
        got = count_tokens(model_dir, text)
        if got != n_tokens:
            raise RuntimeError(f"make_prompt: wanted {n_tokens} tokens, the tokenizer in {model_dir} gives {got}")
    return text


def count_tokens(model_dir: Path | str, text: str) -> int:
    """Token count of `text` as SGLang will see it (no special tokens are added by this tokenizer)."""
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json")).encode(text).ids)


def _train_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    rng = random.Random(99)
    # 80% prompt words: frequent enough that BPE merges each into one token before the vocab fills.
    # Short lines: the bare form (first word of a text) must be frequent enough to merge too.
    corpus = [
        " ".join(rng.choice(PROMPT_WORDS) if rng.random() < 0.8 else rng.choice(_RARE_WORDS) for _ in range(8))
        for _ in range(24000)
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer trained to {tok.get_vocab_size()} tokens, model expects {vocab_size}")
    multi = [w for w in PROMPT_WORDS for form in (w, " " + w) if len(tok.encode(form).ids) != 1]
    if multi:
        raise RuntimeError(f"{len(multi)} prompt words are not single tokens, e.g. {multi[:3]}")
    return tok


def _write_tokenizer(tok: Any, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))


def _write_model(spec: ModelSpec, seed: int, tok: Any, out: Path) -> int:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **dataclasses.asdict(spec),
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tok.token_to_id("<|im_end|>"),
        pad_token_id=tok.token_to_id("<|endoftext|>"),
    )
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out))
    return sum(p.numel() for p in model.parameters())


def _check_prompt_tokens(out: Path) -> None:
    """Fail unless SGLang's way of loading the tokenizer sees make_prompt(n) as exactly n tokens."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(str(out))
    for n, seed in ((1, 0), (900, 0), (4000, 1)):
        got = len(loaded(make_prompt(n, seed)).input_ids)
        if got != n:
            raise RuntimeError(f"{type(loaded).__name__} from {out} gives {got} tokens for make_prompt({n})")


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out / MARKER_NAME).read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None


def make_model(directory: Path | str, size: str = "tiny", seed: int = 0) -> Path:
    """Create (or reuse) a random-weight Qwen2 model + tokenizer of `size` in `directory`; returns it.

    Reuse needs a marker with the same spec, seed and factory version. A non-empty directory
    without our marker is refused rather than overwritten.
    """
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SPECS)}")
    spec = SPECS[size]
    out = Path(directory)
    wanted = {"factory_version": FACTORY_VERSION, "size": size, "seed": seed, "spec": dataclasses.asdict(spec)}
    marker = _read_marker(out)
    if marker is not None and {k: marker.get(k) for k in wanted} == wanted:
        return out
    if marker is None and out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty and holds no {MARKER_NAME}; refusing to overwrite it")
    out.mkdir(parents=True, exist_ok=True)
    # The marker goes last and is removed first, so an interrupted build is never reused.
    (out / MARKER_NAME).unlink(missing_ok=True)
    tok = _train_tokenizer(spec.vocab_size)
    _write_tokenizer(tok, out)
    params = _write_model(spec, seed, tok, out)
    _check_prompt_tokens(out)
    (out / MARKER_NAME).write_text(
        json.dumps({**wanted, "parameters": params, "kv_bytes_per_token_bf16": spec.kv_bytes_per_token()}, indent=2)
        + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", choices=sorted(SPECS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_model(args.directory, args.size, args.seed)
    print(json.dumps({"path": str(out), **(_read_marker(out) or {})}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
