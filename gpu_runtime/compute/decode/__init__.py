"""A decode engine: slot KV cache, one batched sampler, continuous batching (standalone: torch and transformers)."""
