"""DPO with Signal's primitives: reference logprobs from `forward` on the base model alone, and the DPO gradient
handed to the run as cross-entropy weights with `reduction="sum"`.

For a pair (chosen c, rejected r) with policy and reference sequence logprobs pi and ref,
    z = beta * ((pi_c - ref_c) - (pi_r - ref_r)),   loss = -log sigmoid(z),
    d loss / d logprob(token of c) = -beta * sigmoid(-z),   of r: +beta * sigmoid(-z).
Cross-entropy with weights w is -sum(w * logprob), so weights w = -d loss / d logprob give exactly the DPO
gradient: beta * sigmoid(-z) on the chosen answer's tokens and its negative on the rejected one's. `sum` keeps
Signal from normalising them (the DPO loss is already per pair).

    SIGNAL_API_KEY=sk-... .venv/bin/python examples/dpo.py            # 10 steps on the default model
    SIGNAL_API_KEY=sk-... .venv/bin/python examples/dpo.py --steps 2  # the short version the tests run
"""

from __future__ import annotations

import argparse
import math
import os

from rewardsignal import SignalClient

PAIRS = [
    ("Q: What colour is the sky on a clear day?\nA:", " Blue.", " Green, always."),
    ("Q: How many legs does a spider have?\nA:", " Eight.", " Three."),
    ("Q: What is the capital of France?\nA:", " Paris.", " Berlin, I think."),
    ("Q: Is water wet?\nA:", " Yes, water makes things wet.", " No idea, ask someone else."),
]


def answer_logprob(output: dict, mask: list[float]) -> float:
    """A sequence's logprob: the sum over the answer's positions (weight 1 in the rendered datum)."""
    return sum(lp for lp, w in zip(output["logprobs"], mask) if w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=10, help="training steps")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO's beta: how far from the reference")
    parser.add_argument("--learning-rate", type=float, default=5e-4, help="AdamW's learning rate")
    parser.add_argument("--base-model", default=os.environ.get("SIGNAL_EXAMPLE_MODEL"),
                        help="a catalogue name (default: $SIGNAL_EXAMPLE_MODEL if set, else the server's default model)%(default).0s")
    parser.add_argument("--name", default="dpo example", help="the run's name on the dashboard")
    args = parser.parse_args()

    client = SignalClient()  # reads SIGNAL_API_KEY and SIGNAL_BASE_URL
    run = client.create_run(base_model=args.base_model, name=args.name, lora_r=8, learning_rate=args.learning_rate, seed=0)
    print(f"run {run.id}: {client.base_url}/runs/{run.id}", flush=True)
    items = [{"input": prompt, "output": answer} for prompt, chosen, rejected in PAIRS for answer in (chosen, rejected)]
    datums = run.render_datums(items)  # chosen, rejected, chosen, …: the exact token positions of each answer
    masks = [list(d["loss_fn_inputs"]["weights"]) for d in datums]
    reference = client.forward(datums, base_model=run.info["base_model"])  # the base alone: the DPO reference
    ref = [answer_logprob(o, m) for o, m in zip(reference["outputs"], masks)]
    for step in range(args.steps):
        policy = run.forward(datums)
        pi = [answer_logprob(o, m) for o, m in zip(policy["outputs"], masks)]
        weighted, losses, margins = [], [], []
        for i in range(0, len(datums), 2):
            z = args.beta * ((pi[i] - ref[i]) - (pi[i + 1] - ref[i + 1]))
            losses.append(math.log1p(math.exp(-z)))  # -log sigmoid(z)
            margins.append(z / args.beta)
            coefficient = args.beta / (1.0 + math.exp(z))  # beta * sigmoid(-z)
            for j, sign in ((i, 1.0), (i + 1, -1.0)):
                inputs = dict(datums[j]["loss_fn_inputs"])
                inputs["weights"] = [sign * coefficient * w for w in masks[j]]
                weighted.append({"model_input": datums[j]["model_input"], "loss_fn_inputs": inputs})
        run.forward_backward(weighted, loss_fn="cross_entropy", reduction="sum")
        run.optim_step()
        loss, margin = sum(losses) / len(losses), sum(margins) / len(margins)
        # The dashboard's loss chart is the weighted cross-entropy that carries the gradient, not the DPO loss:
        # these two are drawn on the run's page as charts of their own.
        run.log_metrics({"dpo_loss": loss, "dpo_margin": margin})
        print(f"step {step + 1}: DPO loss {loss:.4f}, "
              f"mean margin (chosen minus rejected, vs reference) {margin:.4f}", flush=True)


if __name__ == "__main__":
    main()
