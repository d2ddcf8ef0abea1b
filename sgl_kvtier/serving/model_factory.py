"""Random-weight Qwen2 models and a matching tokenizer, made offline for tests, the demo and benchmarks.

Sizes with chosen KV geometry: ``tiny`` (end-to-end checks), ``bench`` (recompute clearly dearer than loading
on CPU) and ``kvheavy`` (128 KiB of KV per token in every dtype from a small hidden size: large pages, cheap
compute). The dtype defaults to ``auto`` (``hardware.choose_dtype``). The tokenizer is a byte-level BPE
trained in-process on synthetic words whose ``PROMPT_WORDS`` become single tokens, so
``make_prompt(n, seed)`` is exactly ``n`` tokens (checked through ``AutoTokenizer`` in a child process each
time a model is made). Weights are drawn with numpy as transformers initialises Qwen2 and written with
safetensors; files as transformers 5 writes them; no torch or transformers import; everything seeded. A
marker file records the spec (dtype included): the same spec reuses the directory, any other rebuilds it.

CLI: ``python -m sgl_kvtier.serving.model_factory DIR --size tiny [--dtype auto|bfloat16|float16|float32]``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from sgl_kvtier.serving.hardware import AUTO, DTYPE_BYTES, MARKER_NAME, choose_dtype

FACTORY_VERSION = 4
DEFAULT_DTYPE = AUTO  # hardware.choose_dtype: the machine's native dtype unless told otherwise
# transformers' `Qwen2Tokenizer` pre-tokenizer pattern (transformers.models.qwen2.tokenization_qwen2).
PRETOKENIZE_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                     r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
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


# The geometry in a 2-byte dtype (bfloat16, float16); `spec_for` gives float32's.
SPECS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(1024, 256, 512, 2, 4, 2, 64, 4096),
    # ~89M parameters: 8 x (3.1M attention + 7.9M MLP) + 1M tied embeddings.
    "bench": ModelSpec(1024, 1024, 2560, 8, 16, 8, 64, 8192),
    # 64 layers x 8 KV heads x 64 x (K, V) x 2 bytes = 128 KiB per token (8x `bench`), ~100M parameters.
    # head_dim must equal hidden_size / heads: SGLang's CPU attention path assumes it (a 256-wide model
    # with 16 heads of 64 crashed in set_kv_buffer).
    "kvheavy": ModelSpec(1024, 512, 512, 64, 8, 8, 64, 8192),
}
# float32: kvheavy halves its KV heads (GQA, 8 query heads over 4 KV heads) to keep 128 KiB of KV per token and
# per-layer; the layer count, hidden size and head_dim (= hidden / heads, as SGLang's CPU path needs) stay.
FLOAT32_SPECS: dict[str, ModelSpec] = {**SPECS, "kvheavy": dataclasses.replace(SPECS["kvheavy"], num_key_value_heads=4)}


def spec_for(size: str, dtype: str) -> ModelSpec:
    """The geometry of ``size`` in ``dtype`` (one of ``DTYPE_BYTES``)."""
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SPECS)}")
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; choose from {sorted(DTYPE_BYTES)}")
    return (FLOAT32_SPECS if DTYPE_BYTES[dtype] == 4 else SPECS)[size]


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
    bpe_trainer: Any = trainers.BpeTrainer  # untyped in tokenizers' stubs
    trainer = bpe_trainer(
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


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def _write_tokenizer(tok: Any, out: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja, as transformers 5 saves them."""
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "backend": "tokenizers", "eos_token": "<|im_end|>", "model_max_length": int(1e30),
        "pad_token": "<|endoftext|>", "tokenizer_class": "TokenizersBackend"})
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def _hf_config(spec: ModelSpec, dtype: str, eos: int, pad: int) -> dict[str, Any]:
    """config.json of a Qwen2ForCausalLM with `spec` (transformers 5's keys and defaults)."""
    return {
        **dataclasses.asdict(spec), "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "dtype": dtype,
        "attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": eos, "pad_token_id": pad,
        "hidden_act": "silu", "layer_types": ["full_attention"] * spec.num_hidden_layers, "max_window_layers": 28,
        "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "sliding_window": None, "tie_word_embeddings": True, "use_cache": True, "use_sliding_window": False,
    }


def random_weights(spec: ModelSpec, seed: int, pad_token_id: int) -> dict[str, np.ndarray]:
    """float32 weights of a Qwen2ForCausalLM as transformers initialises one (tied LM head: not stored)."""
    rng = np.random.default_rng(seed)
    std, h = spec.initializer_range, spec.hidden_size
    q, kv = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std)).astype(np.float32)

    embed = normal(spec.vocab_size, h)
    embed[pad_token_id] = 0.0  # nn.Embedding(padding_idx=pad) keeps that row at zero
    weights = {"model.embed_tokens.weight": embed}
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.q_proj.bias": np.zeros(q, np.float32),
            p + "self_attn.k_proj.weight": normal(kv, h), p + "self_attn.k_proj.bias": np.zeros(kv, np.float32),
            p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.v_proj.bias": np.zeros(kv, np.float32),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.up_proj.weight": normal(spec.intermediate_size, h),
            p + "mlp.down_proj.weight": normal(h, spec.intermediate_size),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        })
    weights["model.norm.weight"] = np.ones(h, np.float32)
    return weights


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch's ``.to(bfloat16)``."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def save_safetensors(weights: dict[str, np.ndarray], path: Path, dtype: str) -> None:
    """Write float32 `weights` as `dtype` in safetensors format (numpy has no bfloat16: written as its bits)."""
    import safetensors
    import safetensors.numpy

    if dtype != "bfloat16":
        target = np.float16 if dtype == "float16" else np.float32
        safetensors.numpy.save_file({k: np.ascontiguousarray(v.astype(target)) for k, v in weights.items()}, path,
                                    metadata={"format": "pt"})
        return
    arrays = {k: to_bfloat16_bits(v) for k, v in weights.items()}  # kept alive while serialize_file reads them
    specs = {k: safetensors.TensorSpec(dtype="bfloat16", shape=list(a.shape), data_ptr=a.ctypes.data,
                                       data_len=a.nbytes) for k, a in arrays.items()}
    safetensors.serialize_file(specs, str(path), metadata={"format": "pt"})


def _write_model(spec: ModelSpec, seed: int, tok: Any, out: Path, dtype: str) -> int:
    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    _write_json(out / "config.json", _hf_config(spec, dtype, eos, pad))
    _write_json(out / "generation_config.json", {"_from_model_config": True, "eos_token_id": eos,
                                                 "output_attentions": False, "output_hidden_states": False,
                                                 "pad_token_id": pad, "use_cache": True})
    weights = random_weights(spec, seed, pad)
    save_safetensors(weights, out / "model.safetensors", dtype)
    return sum(int(w.size) for w in weights.values())


_CHECK_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
loaded = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps([type(loaded).__name__, *(len(loaded(text).input_ids) for text in json.loads(sys.stdin.read()))]))
"""


def _check_prompt_tokens(out: Path) -> None:
    """Fail unless SGLang's way of loading the tokenizer sees make_prompt(n) as exactly n tokens.

    `AutoTokenizer` imports torch, so it runs in a child Python process.
    """
    cases = ((1, 0), (900, 0), (4000, 1))
    done = subprocess.run([sys.executable, "-c", _CHECK_SCRIPT, str(out)], capture_output=True, text=True,
                          input=json.dumps([make_prompt(n, seed) for n, seed in cases]), timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"loading the tokenizer in {out} with AutoTokenizer failed:\n{done.stderr[-3000:]}")
    cls, *counts = json.loads(done.stdout.strip().splitlines()[-1])
    for (n, _), got in zip(cases, counts):
        if got != n:
            raise RuntimeError(f"{cls} from {out} gives {got} tokens for make_prompt({n})")


def _read_marker(out: Path) -> dict[str, Any] | None:
    try:
        marker: dict[str, Any] = json.loads((out / MARKER_NAME).read_text())
        return marker
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None


def make_model(directory: Path | str, size: str = "tiny", seed: int = 0, dtype: str = DEFAULT_DTYPE) -> Path:
    """Create (or reuse) a random-weight Qwen2 model + tokenizer of `size` in `directory`; returns it.

    `dtype` is the weights' and the KV cache's dtype (a factory model's server is given it as `--dtype`):
    one of `DTYPE_BYTES`, or `auto` for `hardware.choose_dtype`'s (the machine's native one, unless
    `KVTIER_MODEL_DTYPE` says otherwise). The geometry is `spec_for(size, dtype)`. Reuse needs a marker with
    the same spec, seed, dtype and factory version. A non-empty directory without our marker is refused
    rather than overwritten.
    """
    if size not in SPECS:
        raise ValueError(f"unknown size {size!r}; choose from {sorted(SPECS)}")
    choice = choose_dtype(dtype, source="make_model(dtype=...)")
    spec = spec_for(size, choice.dtype)
    out = Path(directory)
    wanted = {"factory_version": FACTORY_VERSION, "size": size, "seed": seed, "dtype": choice.dtype,
              "spec": dataclasses.asdict(spec)}
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
    params = _write_model(spec, seed, tok, out, choice.dtype)
    _check_prompt_tokens(out)
    (out / MARKER_NAME).write_text(json.dumps(
        {**wanted, "dtype_choice": choice.describe(), "parameters": params,
         "kv_bytes_per_token": spec.kv_bytes_per_token(DTYPE_BYTES[choice.dtype])}, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """The CLI: make (or reuse) a model and print its marker."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--size", choices=sorted(SPECS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=[AUTO, *sorted(DTYPE_BYTES)], default=DEFAULT_DTYPE,
                        help="auto: the machine's native dtype (bfloat16 with AVX512-BF16/AMX or a GPU, else float32)")
    args = parser.parse_args(argv)
    out = make_model(args.directory, args.size, args.seed, args.dtype)
    print(json.dumps({"path": str(out), **(_read_marker(out) or {})}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
