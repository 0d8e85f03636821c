"""A tiny random model of each family the catalogue serves (issue 32): transformers' own config and model classes,
SmolLM2's real tokenizer, weights large enough that soft-capping changes logprobs, and a sliding window (where the
family has one) shorter than the tests' sequences. A new family is one line of FAMILIES."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers

from tests.helpers.tiny_model import smollm2_tokenizer

WINDOW = 4  # tokens: every test sequence is longer, so the sliding-window layers see a different context
SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 256}
SLIDING = ["sliding_attention", "full_attention"]  # one layer of each
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
          "layer_types": ["linear_attention", "full_attention"]}

# catalogue family (gpu_runtime/contract/families.py) → (config class, model class, its own settings over SHAPE)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": WINDOW}),
    "qwen": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 4, **MOE}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                      "intermediate_size": 32, "sliding_window": WINDOW,
                                                      "layer_types": SLIDING}),
    # The newest Qwen generation: Gated DeltaNet (linear-attention) layers between full ones; the MoE's shared expert.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {"head_dim": 16, **LINEAR}),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {
        "head_dim": 16, "num_experts": 4, **MOE, "shared_expert_intermediate_size": 32, **LINEAR}),
    "gemma": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW,
                                                    "final_logit_softcapping": 3.0, "attn_logit_softcapping": 5.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": WINDOW, "layer_types": SLIDING,
                                                        "final_logit_softcapping": 3.0}),
    "olmo": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": WINDOW, "layer_types": SLIDING}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
}
MOE_FAMILIES = ("qwen3_moe", "qwen3_5_moe", "gpt_oss")
INIT_STD = 0.08  # weights this large give logits of a few units: a cap of 3 changes them, fp32 still agrees to 1e-4


def build_family(family: str, path: str | Path, tokenizer_cache: str | Path, seed: int = 0) -> str:
    """Write a tiny `family` model + SmolLM2's tokenizer to `path`, loadable by AutoModelForCausalLM."""
    path = Path(path)
    tokenizer = smollm2_tokenizer(tokenizer_cache)
    config_name, model_name, own = FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True, initializer_range=INIT_STD, **{**SHAPE, **own})
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config)
    with torch.no_grad():  # some families initialise experts and routers to zero or tiny: every weight gets a spread
        for name, param in model.named_parameters():
            if param.dim() >= 2 and "embed" not in name:
                param.normal_(0.0, INIT_STD * (3.0 if "router" in name or name.endswith("mlp.gate.weight") else 1.0))
    if path.exists():
        shutil.rmtree(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def catalog_entry(family: str, path: str) -> dict[str, Any]:
    """The tiny model's catalogue entry (served from `path:`); a MoE family's with its expert shape and active share."""
    entry: dict[str, Any] = {"name": f"tiny-{family}", "path": path, "family": family, "parameters": 3_000_000,
                             "offline": True}
    if family in MOE_FAMILIES:
        config = json.loads((Path(path) / "config.json").read_text())
        entry["active_parameters"] = 2_000_000
        entry["experts"] = {"experts": config.get("num_experts") or config["num_local_experts"],
                            "active_experts": config["num_experts_per_tok"], "hidden": config["hidden_size"],
                            "intermediate": config.get("moe_intermediate_size") or config["intermediate_size"],
                            "layers": config["num_hidden_layers"]}
    return entry
