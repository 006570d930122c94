"""The seeded random-weight Mixture-of-Experts model the local context serves.

A tiny Qwen3-MoE (transformers ``Qwen3MoeConfig`` / ``Qwen3MoeForCausalLM``: hidden 128, 2
layers, 8 experts, top-2, vocab 2048) with random weights drawn from a fixed seed, and a
byte-level BPE tokenizer trained here with ``tokenizers`` on a corpus generated here from the same
seed (no download anywhere). ``initializer_range`` is 0.1: with the default 0.02 greedy decoding
answers nothing but newlines (reference/TOOLCHAIN.md).

Builds are byte-identical for the same seed and library versions, and cached under
``<repo>/.cache/models/<config-hash>/``, the hash covering the model spec, the seed, the
builder version and the versions of torch / transformers / tokenizers (the things that decide the
bytes). A build goes into a temporary folder beside the cache entry and is renamed into place, so
a half-built model is never taken for a cached one.

The stage calls the command line through the door (recorded; a replay never builds)::

    python -m lib.engines.models build --seed 0 [--out CACHE_ROOT]

which prints one JSON object on stdout: model_dir, config_hash, built (False when cached),
build_s, and the model's shape (experts, top-k, parameters).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = REPO_ROOT / ".cache" / "models"
BUILDER_VERSION = 2  # bump on any change to how the bytes are made that the identity misses
BUILD_RECORD = "build.json"  # written last, inside the temporary folder, before the rename

# The model's shape. Changing anything here changes the hash, hence the cache entry.
MODEL_SPEC: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "initializer_range": 0.1,
    "tie_word_embeddings": False,
}
# engine='vllm': the default model's per-layer shape (Qwen3-30B-A3B: 128 experts, top-8, hidden
# 2048, MoE intermediate 768, head_dim 128, 32 query / 4 KV heads), random weights in bf16; the
# layer count is a parameter (few by default: the all-to-all per layer is what is measured, not
# the depth). Same tokenizer and corpus as the tiny model.
VLLM_SPEC: dict[str, Any] = {
    **MODEL_SPEC,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
}
FLAVORS = {"tiny": (MODEL_SPEC, "float32"), "vllm": (VLLM_SPEC, "bfloat16")}
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"
# ChatML, as Qwen models use; content may be a string or OpenAI-style parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{ part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS_SENTENCES = 3000


# ---- identity ----------------------------------------------------------------------------------
def library_versions() -> dict[str, str]:
    """The installed distributions' versions, read from their metadata (the same strings as
    their modules' __version__, e.g. '2.13.0+cpu') without importing them: importing torch and
    transformers took 3 of the 3.4 s a cached `build` costs, and every serving stage calls it."""
    return {name: metadata.version(name) for name in ("torch", "transformers", "tokenizers")}


def model_spec(flavor: str = "tiny", layers: int | None = None) -> dict[str, Any]:
    """The config of `flavor` ('tiny' for transformers serve, 'vllm'), `layers` decoder layers
    (None: the flavor's own, 2)."""
    if flavor not in FLAVORS:
        raise ValueError(f"flavor {flavor!r} is not one of {', '.join(FLAVORS)}")
    spec = dict(FLAVORS[flavor][0])
    if layers is not None:
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(f"layers {layers!r} is not an integer >= 1")
        spec["num_hidden_layers"] = layers
    return spec


def build_identity(seed: int, flavor: str = "tiny", layers: int | None = None) -> dict[str, Any]:
    """Everything that decides the built bytes. The tiny flavor's identity carries no flavor key,
    so its cache entries made before the vLLM flavor existed keep their hash."""
    identity = {"builder_version": BUILDER_VERSION, "seed": int(seed),
                "model": model_spec(flavor, layers),
                "special_tokens": SPECIAL_TOKENS, "eos_token": EOS_TOKEN,
                "chat_template": CHAT_TEMPLATE, "corpus_sha256": corpus_digest(seed),
                "libraries": library_versions()}
    if flavor != "tiny":
        identity["flavor"] = flavor
        identity["dtype"] = FLAVORS[flavor][1]
    return identity


def corpus_digest(seed: int) -> str:
    """The tokenizer's training text, hashed: an edit to the generator changes the identity."""
    return hashlib.sha256("\n".join(corpus(seed)).encode()).hexdigest()


def config_hash(seed: int, flavor: str = "tiny", layers: int | None = None) -> str:
    text = json.dumps(build_identity(seed, flavor, layers), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ---- the corpus --------------------------------------------------------------------------------
_WORDS = (
    "the a an of to and in is it that for on with as by at from this be are was were or not "
    "expert experts router piece pieces model models layer layers batch dispatch combine send "
    "receive node nodes rank ranks cluster network buffer memory kernel latency throughput "
    "request requests server client answer question time first second third cache block "
    "attention hidden state value key query weight weights gate gates sparse dense mixture "
    "parallel pipeline tensor data pass fail skip evidence record replay run runs stage stages "
    "measure measured fast slow small large many few every each some other one two three four "
    "five six seven eight nine ten hundred thousand million red green blue river mountain city "
    "garden window paper letter music story morning evening night day week year people person "
    "hand house water light sound word words number numbers line lines book books road field "
    "make makes made take takes took give gives gave find finds found think thinks thought "
    "see sees saw know knows knew come comes came go goes went say says said tell tells told "
    "read reads write writes wrote open opens opened close closes closed keep keeps kept "
    "quickly slowly carefully always never often sometimes today tomorrow yesterday here there"
).split()
_SYLLABLES = "ka lo mi ne su ta ri po ve zu an el or ix um".split()
_PUNCT = [".", ".", ".", "?", "!", ",", ";", ":"]


def corpus(seed: int, sentences: int = CORPUS_SENTENCES) -> list[str]:
    """Deterministic training text: sentences of English words, made-up words, numbers, code."""
    rng = random.Random(f"lib.models.corpus:{seed}")
    lines = []
    for _ in range(sentences):
        n = rng.randint(4, 18)
        words = []
        for _ in range(n):
            roll = rng.random()
            if roll < 0.75:
                words.append(rng.choice(_WORDS))
            elif roll < 0.88:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))))
            elif roll < 0.95:
                words.append(str(rng.randint(0, 10 ** rng.randint(1, 5))))
            else:
                words.append(rng.choice(["x = 1", "f(x)", "a_b", "[0]", "{k: v}", "C++", "#1"]))
        sentence = " ".join(words)
        sentence = sentence[0].upper() + sentence[1:] + rng.choice(_PUNCT)
        if rng.random() < 0.1:
            sentence = sentence + "\n"
        lines.append(sentence)
    return lines


# ---- building ----------------------------------------------------------------------------------
def train_tokenizer(seed: int, vocab_size: int):
    """A byte-level BPE tokenizer trained on `corpus(seed)`, wrapped for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None,
        model_max_length=MODEL_SPEC["max_position_embeddings"],
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _build_into(folder: Path, seed: int, flavor: str = "tiny",
                layers: int | None = None) -> dict[str, Any]:
    import torch
    from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    spec, dtype = model_spec(flavor, layers), FLAVORS[flavor][1]
    tokenizer = train_tokenizer(seed, spec["vocab_size"])
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    config = Qwen3MoeConfig(**spec, eos_token_id=eos_id, pad_token_id=pad_id,
                            bos_token_id=None, dtype=dtype)
    torch.manual_seed(seed)
    # weights drawn in float32 from the seed, then cast: the draw is the same for every dtype
    model = Qwen3MoeForCausalLM(config).to(getattr(torch, dtype)).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, do_sample=False, max_new_tokens=64)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    return {"parameters": int(parameters), "num_experts": spec["num_experts"],
            "num_experts_per_tok": spec["num_experts_per_tok"],
            "vocab_size": spec["vocab_size"], "eos_token_id": eos_id,
            "num_hidden_layers": spec["num_hidden_layers"], "flavor": flavor, "dtype": dtype}


def build(seed: int, out: Path | str | None = None, flavor: str = "tiny",
          layers: int | None = None) -> dict[str, Any]:
    """Build (or find in the cache) the model for `seed`; returns its description."""
    root = Path(out) if out else DEFAULT_CACHE
    root = root.resolve()
    digest = config_hash(seed, flavor, layers)
    target = root / digest
    started = time.monotonic()
    built = False
    if not (target / BUILD_RECORD).is_file():
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{digest}-", dir=root))
        os.chmod(tmp, 0o755)
        try:
            shape = _build_into(tmp, seed, flavor, layers)
            record = {"config_hash": digest, "identity": build_identity(seed, flavor, layers),
                      **shape}
            (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
            try:
                os.rename(tmp, target)  # atomic; fails when another build won the race
                built = True
            except OSError:
                if not (target / BUILD_RECORD).is_file():
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    record = json.loads((target / BUILD_RECORD).read_text())
    return {"model_dir": str(target), "config_hash": digest, "built": built,
            "build_s": round(time.monotonic() - started, 3), "seed": int(seed),
            "parameters": record["parameters"], "num_experts": record["num_experts"],
            "num_experts_per_tok": record["num_experts_per_tok"],
            "vocab_size": record["vocab_size"],
            **({"flavor": flavor, "num_hidden_layers": record["num_hidden_layers"]}
               if flavor != "tiny" else {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lib.engines.models",
                                     description="Build the seeded random-weight MoE model.")
    commands = parser.add_subparsers(dest="command", required=True)
    b = commands.add_parser("build", help="build (or find cached) and print it as JSON")
    b.add_argument("--seed", type=int, required=True, help="seed of the weights and tokenizer")
    b.add_argument("--out", help=f"cache root; the model goes to OUT/<config-hash>/ "
                                 f"(default {DEFAULT_CACHE})")
    b.add_argument("--flavor", choices=sorted(FLAVORS), default="tiny",
                   help="tiny (transformers serve on CPU) or vllm (the default model's "
                        "per-layer shape, bf16)")
    b.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    b.add_argument("--hash-only", action="store_true", help="print the config hash, build nothing")
    args = parser.parse_args(argv)
    if args.seed < 0:
        parser.error("--seed must be >= 0")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be >= 1")
    if args.hash_only:
        print(json.dumps({"config_hash": config_hash(args.seed, args.flavor, args.layers)}))
        return 0
    print(json.dumps(build(args.seed, args.out, args.flavor, args.layers), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
