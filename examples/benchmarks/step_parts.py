"""Where one engine step's time goes, for the step shapes of a tenant flood (in-process).

``LLMEngine.timing`` splits each step into ``schedule_s`` (the scheduler), ``prepare_s`` (the
runner's input arrays), ``forward_s`` (the model's layers and the LM head), ``sample_s`` and
``output_s`` (the scheduler's update, detokenizing and the ``StepOutput``s). This runs,
on one ``LLMEngine`` (SmolLM2-135M's shape with dummy weights, ``--layers`` of its 30,
``--threads``, 8 seats, ``fair``), rounds of four step shapes, interleaved so that the host's
varying load weighs on each alike:

- ``solo``: a light request's 12-token prefill alone (its first step when nothing else runs);
- ``decodes``: the heavy tenant's 7 decodes;
- ``mixed``: the 7 heavy decodes and the 12-token prefill in one step (a light request's
  first step before the first step alone, ``FairPolicy.hold_back``);
- ``alone``: the 12-token prefill while the heavy tenant floods, with the first step alone
  (the heavy decodes sit it out).

Printed per shape: the mean milliseconds of each part per step, and the load average at the
start and the end. The gateway's part (SSE, event loop) is not here: the tenant-flood
benchmark's ``walk=`` figures and a py-spy sample of the server cover it.

    python -m examples.benchmarks.step_parts [--rounds 30] [--layers 2] [--threads 1]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefixgate.engine.config import EngineConfig
from prefixgate.engine.llm_engine import LLMEngine
from prefixgate.engine.sampling_params import SamplingParams

PARTS = ("step_s", "schedule_s", "prepare_s", "forward_s", "sample_s", "output_s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default=str(Path(__file__).parents[2].parent / "shared/models/smollm2-135m-shape"),
    )
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args(argv)
    cfg = EngineConfig(
        model=args.model,
        load_format="dummy",
        hf_overrides={"num_hidden_layers": args.layers},
        threads=args.threads,
        max_num_seqs=8,
        scheduling_policy="fair",
    )
    engine = LLMEngine(cfg)
    heavy = SamplingParams(max_tokens=4096, temperature=0, ignore_eos=True)
    light = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    totals = {shape: dict.fromkeys(PARTS, 0.0) for shape in ("solo", "decodes", "mixed", "alone")}
    counts = dict.fromkeys(totals, 0)
    n = 0

    tokens = dict.fromkeys(totals, 0)

    def computed() -> int:
        st = engine.stats()
        return st["prompt_tokens_prefilled"] + st["tokens_decoded"]

    def timed(shape: str) -> None:
        before, done = dict(engine.timing), computed()
        engine.step()
        for k in PARTS:
            totals[shape][k] += engine.timing[k] - before[k]
        counts[shape] += 1
        tokens[shape] += computed() - done

    def light_request() -> str:
        nonlocal n
        n += 1
        rid = f"l{n}"
        engine.add_request(rid, list(range(100 + n % 50, 112 + n % 50)), light, tenant="light")
        return rid

    print(f"load average {Path('/proc/loadavg').read_text().strip()}")
    light_request()  # warm-up
    while engine.has_unfinished_requests():
        engine.step()
    for i in range(8):  # the heavy tenant: 8 long requests hold every seat
        engine.add_request(f"h{i}", list(range(200 + i, 230 + i)), heavy, tenant="heavy")
    for _ in range(3):
        engine.step()
    for _ in range(args.rounds):
        # decodes: 8 heavy rows (7 after the first displacement)
        timed("decodes")
        # alone: a light request displaces a heavy one and runs its first step alone
        light_request()
        timed("alone")
        engine.step()  # the heavy decodes again (never two held steps in a row)
        # mixed: the same with the first step alone off
        engine.scheduler.policy.first_step_alone = False
        light_request()
        timed("mixed")
        engine.scheduler.policy.first_step_alone = True
        engine.step()
    for i in range(8):
        engine.abort_request(f"h{i}")
    # solo: the light prefill with nothing else running
    for _ in range(args.rounds):
        light_request()
        timed("solo")
        while engine.has_unfinished_requests():
            engine.step()
    print(
        f"{'shape':8} "
        + " ".join(f"{k.removesuffix('_s'):>9}" for k in PARTS)
        + "  (ms/step) tokens/step"
    )
    for shape, parts in totals.items():
        c = max(1, counts[shape])
        ms = " ".join(f"{1000 * parts[k] / c:9.2f}" for k in PARTS)
        print(f"{shape:8} {ms}  {tokens[shape] / c:10.1f}")
    print(f"load average {Path('/proc/loadavg').read_text().strip()}")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
