"""The product README's "Train Your First Model", runnable against your own Signal server.

    make serve                      # prints SIGNAL_API_KEY=sk-... on first start
    export SIGNAL_API_KEY=sk-...    # the line it printed
    .venv/bin/python examples/first_model.py

The README's snippet, with SIGNAL_EXAMPLE_MODEL to pick another base; the default model is the offline SmolLM2-135M.
"""

import os

from rewardsignal import SignalClient

# Reads SIGNAL_API_KEY, and SIGNAL_BASE_URL (default http://localhost:8000): no placeholder to override them.
client = SignalClient()

# List available models
models = client.list_models()
print(f"Available models: {models}")

# Create a training run
run = client.create_run(
    base_model=os.environ.get("SIGNAL_EXAMPLE_MODEL", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    name="first model",
    lora_r=32,
    lora_alpha=64,
    learning_rate=3e-4,
)
print(f"Run {run.id}: {client.base_url}/runs/{run.id}")

# Prepare training data
batch = [
    {"input": "The quick brown fox jumps over the lazy dog."},
    {"output": "Machine learning is transforming technology."},
]

# Training loop
for step in range(10):
    # Forward-backward pass
    result = run.forward_backward(batch=batch)
    print(f"Step {step}: Loss = {result['loss']:.4f}")

    # Optimizer step
    run.optim_step()

    # Sample from model every 5 steps
    if step % 5 == 0:
        samples = run.sample(
            prompts=["The meaning of life is"],
            temperature=0.7,
        )
        print(f"Sample: {samples['outputs'][0]}")

# Save final model
artifact = run.save_state(mode="adapter", push_to_hub=False)
print(f"Saved to: {artifact['checkpoint_path']}")
