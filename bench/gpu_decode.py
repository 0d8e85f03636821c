"""bench/gpu.sh's decoding sections, through the Engine's `sample` (gpu_runtime/compute/decode: DecodeEngine on a
SlotCache, graphed on CUDA): the runtime's own path.

- `decode`: greedy tokens/s (EOS off, every row its full length) at each of `rows` sequences with no adapter (the
  base), one adapter (one run) and eight (8 runs' calls co-decoded), against transformers' `generate` on a plain
  copy of the model and a bench-local static-cache loop whose decode step is one CUDA graph (gpt-fast's shape: the
  proxy for a vLLM-class ceiling; eager where graphs cannot be captured, said in the line).
- `rl_step`: prompts × samples × tokens sampled (temperature 1), an importance-sampling forward_backward over them and
  an optim_step, split into sampling and training seconds, against the same step written by hand (HF generate on a
  PEFT model, the loss by hand, torch's AdamW).
"""

from __future__ import annotations

import inspect
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from benchlib import alternate, log, target
from gpu_box import Limit, sync, timed

PROMPT = 32


def prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 10_000) for _ in range(PROMPT)] for _ in range(count)]


def plain_model(path: str, engine: Any) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=engine.dtype).to(engine.device).eval()


def signal_sample(engine: Any, model: str, runs: list[str], rows: int, tokens: int, adapters: str) -> int:
    """One round of `rows` sequences through the Engine; the tokens it generated."""
    from sampling import generated, pump, submit

    common = {"max_tokens": tokens, "temperature": 0.0, "stop": [], "seed": 0}
    ids = prompts(rows, rows)
    if adapters == "none":
        futures = [submit(engine, "sample", base_model=model, user_id="u-base", prompt_tokens=ids, **common)]
    elif adapters == "one":
        futures = [submit(engine, "sample", run_id=runs[0], prompt_tokens=ids, **common)]
    else:
        share = rows // len(runs)
        futures = [submit(engine, "sample", run_id=run, prompt_tokens=ids[i * share:(i + 1) * share], **common)
                   for i, run in enumerate(runs)]
    return generated(pump(engine, futures))


def hf_generate(plain: Any, device: Any, rows: int, tokens: int) -> int:
    import torch

    ids = torch.tensor(prompts(rows, rows), device=device)
    with torch.no_grad():
        out = plain.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                             min_new_tokens=tokens, pad_token_id=0)
    return int(out[:, PROMPT:].numel())


def graphed_loop(plain: Any, device: Any, rows: int, tokens: int) -> tuple[float, bool, str | None]:
    """Seconds per token-step of a static-cache greedy loop, its step one CUDA graph where it captures."""
    import torch
    from transformers.cache_utils import StaticCache

    names = inspect.signature(plain.forward).parameters
    cache_arg = "cache" if "cache" in names else "past_key_values"
    with torch.no_grad():
        cache = StaticCache(config=plain.config, max_cache_len=PROMPT + 2 * tokens + 16)
        ids = torch.tensor(prompts(rows, rows), device=device)
        positions = torch.arange(PROMPT, device=device)[None].expand(rows, -1)
        extra = {"cache_position": positions[0]} if "cache_position" in names else {}
        logits = plain(input_ids=ids, position_ids=positions, use_cache=True, **{cache_arg: cache}, **extra).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        position = torch.full((rows, 1), PROMPT, device=device)

        def step() -> None:
            kw = {"cache_position": position[0]} if "cache_position" in names else {}
            out = plain(input_ids=token, position_ids=position, use_cache=True, **{cache_arg: cache}, **kw).logits
            token.copy_(out[:, -1].argmax(-1, keepdim=True))
            position.add_(1)

        run, graphed, why = step, False, None
        if device.type == "cuda":
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                run, graphed = graph.replay, True
            except Exception as exc:  # noqa: BLE001 - the eager static loop still measures; the line says why
                why = f"{type(exc).__name__}: {exc}"[:300]
                torch.cuda.synchronize()
        position.fill_(PROMPT + 3)
        seconds = timed(device, lambda: [run() for _ in range(tokens)])
    return seconds / tokens, graphed, why


def per_second(device: Any, fn: Callable[[], int]) -> float:
    """Tokens a second of `fn`, which returns the tokens it generated."""
    made: list[int] = []
    seconds = timed(device, lambda: made.append(fn()))
    return round(made[0] / seconds, 1)


def decode(engine: Any, model: str, path: str, rows_list: tuple[int, ...], tokens: int, limit: Limit) -> dict[str, Any]:
    runs = [f"dec-{i}" for i in range(8)]
    for i, run in enumerate(runs):
        engine.create_run(run, f"ud{i}", model, {"r": 16, "alpha": 32}, seed=i)
    plain = plain_model(path, engine)
    out: dict[str, Any] = {"prompt_tokens": PROMPT, "new_tokens": tokens, "by_rows": {}}
    checks: dict[str, Any] = {}
    group_s = 0.0
    for rows in rows_list:  # the most telling first: a count whose group would pass the limit is left out, said so
        if limit.left() < 1.2 * group_s:
            out["by_rows"][str(rows)] = {"skipped": f"{limit.left():.0f} s left in the limit, the last count took {group_s:.0f} s"}
            continue
        started = time.monotonic()
        line: dict[str, Any] = {}
        for adapters in ("none", "one", "eight"):
            if adapters == "eight" and rows < len(runs):
                continue
            signal_sample(engine, model, runs, rows, 4, adapters)  # warm-up: captures this bucket's graphs
            line[f"signal_{adapters}"] = per_second(engine.device, partial(signal_sample, engine, model, runs, rows,
                                                                           tokens, adapters))
        hf_generate(plain, engine.device, rows, 4)
        line["hf_generate"] = per_second(engine.device, partial(hf_generate, plain, engine.device, rows, tokens))
        per_step, graphed, why = graphed_loop(plain, engine.device, rows, tokens)
        line["static_loop"] = round(rows / per_step, 1)
        line["static_loop_graphed"] = graphed
        if why:
            line["static_loop_graph_error"] = why
        line["one_vs_generate"] = round(line["signal_one"] / line["hf_generate"], 3)
        line["none_vs_static_loop"] = round(line["signal_none"] / line["static_loop"], 3)
        if "signal_eight" in line:
            line["eight_vs_one"] = round(line["signal_eight"] / line["signal_one"], 3)
        out["by_rows"][str(rows)] = line
        group_s = time.monotonic() - started
        log(f"decode at {rows} rows ({group_s:.1f} s): {line}")
        if rows == max(rows_list):
            checks = {"one_vs_generate": target(line["one_vs_generate"], ">=", 3.0),
                      "none_vs_static_loop": target(line["none_vs_static_loop"], ">=", 0.7)}
            if "eight_vs_one" in line:
                checks["eight_vs_one"] = target(line["eight_vs_one"], ">=", 0.8)
    for run in runs:
        engine.delete_run(run)
    out["unit"] = "generated tokens per second, all rows together"
    out["targets"] = checks
    return out


def rl_step(engine: Any, model: str, path: str, count: int, samples: int, tokens: int, rounds: int,
            limit: Limit) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model
    from rl_step import reward
    from sampling import pump, submit

    from gpu_runtime.compute.lora.wrap import linear_module_names
    from gpu_runtime.contract import default_target_modules

    run, r = "rl", 16
    engine.create_run(run, "u-rl", model, {"r": r, "alpha": 2 * r}, seed=0)
    ids = prompts(count, 7)

    def signal(seed: int) -> tuple[float, float]:
        start = time.perf_counter()
        sampled = pump(engine, [submit(engine, "sample", run_id=run, prompt_tokens=ids, num_samples=samples,
                                       max_tokens=tokens, temperature=1.0, stop=[], seed=seed)])[0]
        sampling = time.perf_counter() - start
        rows = [(prompt, answer) for prompt, group in zip(ids, sampled["sequences"]) for answer in group]
        rewards = [reward(answer["tokens"]) for _, answer in rows]
        batch = []
        for (prompt, answer), adv in zip(rows, advantages_for(rewards, samples)):
            full, before = prompt + answer["tokens"], len(prompt) - 1
            batch.append({"model_input": full[:-1], "loss_fn_inputs": {
                "target_tokens": full[1:], "logprobs": [0.0] * before + list(answer["logprobs"]),
                "advantages": [0.0] * before + [adv] * len(answer["tokens"])}})
        start = time.perf_counter()
        engine.forward_backward(run, batch, loss_fn="importance_sampling")
        engine.optim_step(run, {"learning_rate": 1e-5})
        sync(engine.device)
        return sampling, time.perf_counter() - start

    base = plain_model(path, engine)
    targets = default_target_modules(linear_module_names(base))
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets,
                                           task_type="CAUSAL_LM"))
    params = [p for p in peft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5, fused=engine.device.type == "cuda")
    device = engine.device
    input_ids = torch.tensor([p for p in ids for _ in range(samples)], device=device)

    def by_hand(seed: int) -> tuple[float, float]:
        torch.manual_seed(seed)
        start = time.perf_counter()
        with torch.no_grad():
            out = peft.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True,
                                temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=tokens, min_new_tokens=tokens,
                                output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        completion = out.sequences[:, PROMPT:]
        sampler = torch.log_softmax(torch.stack(out.logits, 1).float(), -1).gather(-1, completion[..., None]).squeeze(-1)
        sync(device)
        sampling = time.perf_counter() - start
        start = time.perf_counter()
        rewards = [reward(row.tolist()) for row in completion]
        adv = torch.tensor(advantages_for(rewards, samples), device=device)[:, None].expand_as(sampler)
        logits = peft(input_ids=out.sequences[:, :-1]).logits.float()
        logprobs = torch.log_softmax(logits[:, PROMPT - 1:], -1).gather(-1, completion[..., None]).squeeze(-1)
        loss = -(torch.exp(logprobs - sampler) * adv).sum() / adv.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        return sampling, time.perf_counter() - start

    seeds = iter(range(1_000))
    split: dict[str, list[tuple[float, float]]] = {"signal": [], "by_hand": []}

    def side(name: str, fn: Callable[[int], tuple[float, float]]) -> Callable[[], None]:
        def step() -> None:
            took = fn(next(seeds))
            split[name].append(took)
            log(f"rl {name}: sampling {took[0]:.2f} s, training {took[1]:.2f} s")
        return step

    timing = alternate({"signal": side("signal", signal), "by_hand": side("by_hand", by_hand)}, rounds,
                       deadline=limit.deadline)
    split = {name: values[1:] for name, values in split.items()}  # the first of each warmed up
    engine.delete_run(run)
    mean = {name: (sum(s for s, _ in v) / len(v), sum(t for _, t in v) / len(v)) for name, v in split.items()}
    total = {name: s + t for name, (s, t) in mean.items()}
    ratio = total["by_hand"] / total["signal"]
    return {"prompts": count, "samples": samples, "new_tokens": tokens, "lora_r": r,
            "timed_rounds": len(timing.seconds["signal"]),
            "split_seconds": {name: {"sampling": round(s, 3), "training": round(t, 3), "total": round(s + t, 3)}
                        for name, (s, t) in mean.items()},
            "sampling_speedup": round(mean["by_hand"][0] / mean["signal"][0], 3),
            "training_speedup": round(mean["by_hand"][1] / mean["signal"][1], 3),
            "by_hand_over_signal": round(ratio, 3), "targets": {"vs_by_hand": target(ratio, ">=", 1.5)}}


def advantages_for(rewards: list[float], group: int) -> list[float]:
    """Reward minus its group's mean (rl_step.advantages fixes its group at 4)."""
    out = []
    for i in range(0, len(rewards), group):
        chunk = rewards[i:i + group]
        out += [x - sum(chunk) / len(chunk) for x in chunk]
    return out
