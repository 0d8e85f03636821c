"""The packed datum's saving: GraphQL coercion of a large batch as typed lists against base64 strings.

    .venv/bin/python bench/packed_items.py [--rows 64] [--tokens 2048] [--rounds 5] [--threads 1]

A batch of `rows` RL datums of `tokens` positions each (model_input, target_tokens, advantages, logprobs), typed
(four lists of numbers per datum) against packed (`rewardsignal.pack_datum`: four base64 strings). Each side goes
through the server's variable coercion (graphql-core's `coerce_input_value` on `[BatchItem!]!`, the step that costs
about 1 µs per list element) and the runtime's render (`Renderer.render_batch`; the packed side decodes its base64
there). Rounds alternate which side goes first; medians are reported. Target: the packed side's coercion + render
takes at most half the typed side's.
"""

from __future__ import annotations

import argparse
import random
import time

from benchlib import apply_threads, emit, log, median, target


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    apply_threads(args.threads)
    from app.schema import schema
    from gpu_runtime.compute.batches import Renderer
    from gpu_runtime.contract import batch_from_dicts
    from graphql import GraphQLList, GraphQLNonNull, coerce_input_value
    from rewardsignal import pack_datum
    from rewardsignal.client import _batch as graphql_batch

    class NoTokenizer:  # datums need no tokenizer: only the vocabulary size is read
        eos_token_id = 0

    rng = random.Random(0)
    datums = [{"model_input": [rng.randrange(49152) for _ in range(args.tokens)],
               "loss_fn_inputs": {"target_tokens": [rng.randrange(49152) for _ in range(args.tokens)],
                                  "advantages": [rng.uniform(-1, 1) for _ in range(args.tokens)],
                                  "logprobs": [rng.uniform(-5, 0) for _ in range(args.tokens)]}} for _ in range(args.rows)]
    sides = {"typed": graphql_batch(datums), "packed": graphql_batch([pack_datum(d) for d in datums])}
    item_type = GraphQLNonNull(GraphQLList(GraphQLNonNull(schema._schema.get_type("BatchItem"))))  # type: ignore[type-var]  # get_type is Optional; BatchItem exists
    renderer = Renderer(NoTokenizer(), vocab_size=49152, max_length=args.tokens + 1)  # type: ignore[arg-type]  # duck-typed
    runtime_items = {"typed": datums, "packed": [pack_datum(d) for d in datums]}
    seconds: dict[str, list[float]] = {"typed": [], "packed": []}
    render_seconds: dict[str, list[float]] = {"typed": [], "packed": []}
    for round_ in range(args.rounds):
        order = ["typed", "packed"] if round_ % 2 == 0 else ["packed", "typed"]
        for side in order:
            started = time.perf_counter()
            coerce_input_value(sides[side], item_type)
            seconds[side].append(time.perf_counter() - started)
            started = time.perf_counter()
            renderer.render_batch(batch_from_dicts(runtime_items[side]), args.rows, "importance_sampling")
            render_seconds[side].append(time.perf_counter() - started)
        log(f"round {round_ + 1}: typed {seconds['typed'][-1]:.3f}s, packed {seconds['packed'][-1]:.4f}s")
    typed, packed = median(seconds["typed"]), median(seconds["packed"])
    elements = args.rows * args.tokens * 4
    emit({
        "bench": "packed_items", "rows": args.rows, "tokens": args.tokens, "rounds": args.rounds,
        "coerce_typed_seconds": round(typed, 4), "coerce_packed_seconds": round(packed, 5),
        "typed_us_per_element": round(typed / elements * 1e6, 3),
        "render_typed_seconds": round(median(render_seconds["typed"]), 4),
        "render_packed_seconds": round(median(render_seconds["packed"]), 4),
        "packed_over_typed": target((packed + median(render_seconds["packed"]))
                                    / (typed + median(render_seconds["typed"])), "<=", 0.5,
                                    "coercion + render, packed / typed"),
    })


if __name__ == "__main__":
    main()
