"""The model families the runtime serves (issue 32), by the catalogue's `family` field: each has a tiny random model
in tests/helpers/tiny_families.py that trains, samples, co-batches and exports through the live server. Torch-free:
the server refuses a catalogue naming any other family when it loads, saying what is missing, never at the first call.
"""

from __future__ import annotations

# family → the transformers model types it covers (what the tests build)
SERVED_FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("llama",),
    "mistral": ("mistral",),
    "qwen": ("qwen2",),  # Qwen2 and Qwen2.5
    "qwen3": ("qwen3",),
    "qwen3_moe": ("qwen3_moe",),
    # Qwen3.5: Gated DeltaNet (linear-attention) layers between full-attention ones; the MoE's experts have a shared one
    "qwen3_5": ("qwen3_5_text", "qwen3_5"),
    "qwen3_5_moe": ("qwen3_5_moe_text", "qwen3_5_moe"),
    "gemma": ("gemma2",),
    "gemma3": ("gemma3_text",),
    "gpt_oss": ("gpt_oss",),
    "olmo": ("olmo3",),
    "phi3": ("phi3",),
}
# Mixture-of-experts families: the catalogue must give their expert shape (`experts:`) and `active_parameters`.
MOE_FAMILIES = frozenset({"qwen3_moe", "qwen3_5_moe", "gpt_oss"})


def family_problem(family: str) -> str | None:
    """Why the runtime cannot serve `family`, or None when it can."""
    if family in SERVED_FAMILIES:
        return None
    return (f"family {family!r} has no tested support in the runtime (served: {', '.join(sorted(SERVED_FAMILIES))}); "
            "a new family needs a tiny model of it in tests/helpers/tiny_families.py passing tests/gpu_runtime/"
            "test_families.py, then its name in gpu_runtime/contract/families.py")
