"""lib.engines.models: the seeded MoE and its tokenizer, built for real (a few seconds each)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lib.engines import models
from lib.core.door import REPO_ROOT


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    return models.build(0, tmp_path_factory.mktemp("models-a"))


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def test_rebuild_is_byte_identical(built, tmp_path):
    again = models.build(0, tmp_path)
    assert again["built"] and built["built"]
    assert again["config_hash"] == built["config_hash"]
    first, second = _files(Path(built["model_dir"])), _files(Path(again["model_dir"]))
    assert {"model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json",
            "generation_config.json", "chat_template.jinja", "build.json"} <= set(first)
    assert first.keys() == second.keys()
    for name in first:
        assert first[name] == second[name], f"{name} differs between two builds of seed 0"


def test_cache_hit_does_not_rebuild(built):
    root = Path(built["model_dir"]).parent
    again = models.build(0, root)
    assert again["built"] is False
    assert again["model_dir"] == built["model_dir"]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")], "temp build left"


def test_hash_covers_seed_and_spec():
    assert models.config_hash(0) == models.config_hash(0)
    assert models.config_hash(0) != models.config_hash(1)
    assert len(models.config_hash(0)) == 16


def test_model_is_the_specified_moe(built):
    config = json.loads((Path(built["model_dir"]) / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe"
    assert config["num_local_experts"] == 8 and config["num_experts_per_tok"] == 2
    assert config["hidden_size"] == 128 and config["num_hidden_layers"] == 2
    assert config["vocab_size"] == 2048 and config["initializer_range"] == 0.1
    assert built["num_experts"] == 8 and built["parameters"] > 500_000


def test_tokenizer_chat_template_and_greedy_output(built):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["model_dir"])
    assert tok.eos_token == models.EOS_TOKEN
    assert len(tok) == 2048
    text = "Expert 7 sends tokens to rank 1."
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                     add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    parts = tok.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
        add_generation_prompt=True, tokenize=False)
    assert parts == prompt
    model = AutoModelForCausalLM.from_pretrained(built["model_dir"])
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    reply = tok.decode(out[0, ids.shape[1]:])
    assert reply.strip(), "greedy output is only whitespace (initializer_range too small?)"


def test_cli_prints_json_and_uses_the_cache(built):
    root = Path(built["model_dir"]).parent
    done = subprocess.run([sys.executable, "-m", "lib.engines.models", "build", "--seed", "0",
                           "--out", str(root)], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["model_dir"] == built["model_dir"]
    assert info["config_hash"] == built["config_hash"] and info["built"] is False


def test_the_identity_names_the_versions_the_modules_report():
    """The cache key reads versions from the distributions' metadata (no import: a cached build
    answers in a fraction of a second); they are the strings the imported modules report, so a
    cached model is the one these libraries would build."""
    import tokenizers
    import torch
    import transformers

    assert models.library_versions() == {"torch": torch.__version__,
                                         "transformers": transformers.__version__,
                                         "tokenizers": tokenizers.__version__}
