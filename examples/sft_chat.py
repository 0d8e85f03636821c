"""Supervised fine-tuning on chat messages: the server renders each conversation with the model's chat template
and trains on the assistant turns only (through their end-of-turn token).

    SIGNAL_API_KEY=sk-... .venv/bin/python examples/sft_chat.py            # 20 steps on the default model
    SIGNAL_API_KEY=sk-... .venv/bin/python examples/sft_chat.py --steps 2  # the short version the tests run
"""

from __future__ import annotations

import argparse
import os

from rewardsignal import SignalClient

CONVERSATIONS = [
    [{"role": "system", "content": "You are Signal's tour guide. Answer in one short sentence."},
     {"role": "user", "content": "What does Signal train?"},
     {"role": "assistant", "content": "LoRA adapters on open base models, driven by your own training loop."}],
    [{"role": "user", "content": "Which primitives does it have?"},
     {"role": "assistant", "content": "forward_backward, forward, optim_step, sample, save_state and load_state."}],
    [{"role": "user", "content": "Can I run it myself?"},
     {"role": "assistant", "content": "Yes: one command starts the server on your machine."},
     {"role": "user", "content": "And on GPUs in the cloud?"},
     {"role": "assistant", "content": "Yes, on Modal, with the same API."}],
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--learning-rate", type=float, default=3e-4, help="AdamW's learning rate")
    parser.add_argument("--base-model", default=os.environ.get("SIGNAL_EXAMPLE_MODEL"),
                        help="a catalogue name (default: $SIGNAL_EXAMPLE_MODEL if set, else the server's default model)%(default).0s")
    parser.add_argument("--name", default="sft chat example", help="the run's name on the dashboard")
    args = parser.parse_args()

    client = SignalClient()  # reads SIGNAL_API_KEY and SIGNAL_BASE_URL
    run = client.create_run(base_model=args.base_model, name=args.name, lora_r=16, learning_rate=args.learning_rate, seed=0)
    print(f"run {run.id}: {client.base_url}/runs/{run.id}", flush=True)
    batch = [{"messages": conversation} for conversation in CONVERSATIONS]
    trained = run.render_datums(batch)
    print(f"assistant tokens trained on: {[int(sum(d['loss_fn_inputs']['weights'])) for d in trained]}")
    for step in range(args.steps):
        result = run.forward_backward(batch)
        run.optim_step()
        print(f"step {step + 1}: loss {result['loss']:.4f} over {result['num_tokens']} tokens", flush=True)
    # The same chat form it trained on: the server renders it with the base's chat template, as /v1 does.
    answer = run.sample(messages=[{"role": "user", "content": "What does Signal train?"}], max_tokens=24,
                        temperature=0.0)
    print(f"sample: {answer['outputs'][0]!r}")


if __name__ == "__main__":
    main()
