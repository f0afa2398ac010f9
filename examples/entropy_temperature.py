"""Entropy-driven temperature: each step reads the snapshot's entropy and sets the sampler's
temperature from it before drawing — sure steps stay nearly greedy, open steps explore.

`set_sampler_params` keeps the random stream, so a temperature that changes every step
still draws along one stream (seeded runs repeat exactly), and only the temperature is
rebuilt (no penalty history replay). The default model, no arguments.

usage: python examples/entropy_temperature.py
"""

from __future__ import annotations

import asyncio
import math

import kvfork

PROMPT = "Once upon a time, in a village by the mountains,"


def temperature_for(entropy: float, low: float = 0.3, high: float = 1.2) -> float:
    """Low temperature when the model is sure (entropy near 0), up to `high` when the
    distribution is wide (entropy of ~5 nats or more)."""
    return low + (high - low) * min(entropy / 5.0, 1.0)


async def generate(seed: int = 7, max_tokens: int = 40) -> tuple[str, list[float]]:
    """(text, the temperature used at each step)."""
    async with kvfork.create_context(kvfork.default_model_path(), n_seq_max=1) as ctx:
        params = kvfork.SamplingParams(seed=seed)
        b = kvfork.Branch.create(ctx, 0, params)
        await b.prefill(ctx.tokenize(PROMPT))
        temps, pieces = [], []
        for _ in range(max_tokens):
            t = temperature_for(b.entropy())
            b.set_sampler_params(kvfork.SamplingParams(seed=seed, temperature=t))
            temps.append(t)
            token = await b.produce()
            if token.is_stop:
                break
            await b.commit(token)
            pieces.append(token.text)
        return "".join(pieces), temps


async def main() -> None:
    text, temps = await generate()
    print(PROMPT + text)
    mean = sum(temps) / len(temps)
    spread = math.sqrt(sum((t - mean) ** 2 for t in temps) / len(temps))
    print(
        f"\n{len(temps)} steps, temperature {min(temps):.2f}..{max(temps):.2f} "
        f"(mean {mean:.2f}, sd {spread:.2f})"
    )


if __name__ == "__main__":
    asyncio.run(main())
