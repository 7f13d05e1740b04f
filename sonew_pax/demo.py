"""``make demo``: train configs/tiny.gin into a fresh directory and show what it wrote.

    python -m sonew_pax.demo --model_dir=/tmp/sonew-demo

A 0.4M-parameter byte-level transformer, tridiagonal SONew, the embedded Shakespeare corpus:
a couple of minutes on a 2-core CPU. Prints the loss at the start and the end, where the
checkpoints, metrics, TensorBoard events and configs are, and what the trained model writes after
a Shakespeare prompt (`sonew_pax.inference`).
"""

import json
import pathlib
from collections.abc import Sequence

from absl import app, flags

from sonew_pax import inference, loop, train
from sonew_pax.metrics import METRICS_FILE

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Where the demo run writes.", required=True)
PROMPT = "ROMEO:"


def summary(model_dir: pathlib.Path) -> str:
    """What the run left in ``model_dir``: loss first -> last, eval loss, and the files."""
    records = [json.loads(line) for line in (model_dir / METRICS_FILE).read_text().splitlines()]
    first, last = records[0], records[-1]
    evals = [r for r in records if "eval_loss" in r]
    lines = [
        f"Training loss: {first['loss']:.3f} at step {first['step']} -> "
        f"{last['loss']:.3f} at step {last['step']}",
    ]
    if evals:
        lines.append(
            f"Held-out loss: {evals[0]['eval_loss']:.3f} at step {evals[0]['step']} -> "
            f"{evals[-1]['eval_loss']:.3f} at step {evals[-1]['step']} "
            f"(perplexity {evals[-1]['eval_perplexity']:.1f})"
        )
    lines += [
        f"Outputs in {model_dir}:",
        f"  {METRICS_FILE:<20} one JSON line per step (loss, learning_rate, grad_norm, eval_*)",
        "  train/ eval/         TensorBoard events:  tensorboard --logdir " + str(model_dir),
        "  checkpoint_<step>/   params, optimizer state, data position (rerun to resume)",
        "  config.gin           the operative gin config",
        "  model-info.txt       parameter and optimizer-state shapes, partition specs, counts",
    ]
    return "\n".join(lines)


def samples(model_dir: pathlib.Path, count: int = 2, max_new_tokens: int = 120) -> str:
    """``count`` continuations of `PROMPT` by the run's newest checkpoint, one block each."""
    run = inference.load_run(str(model_dir))
    texts = inference.sample(
        run, PROMPT, num_samples=count, max_new_tokens=max_new_tokens, temperature=0.8, top_k=20
    )
    blocks = [f"--- sample {i + 1} ---\n{PROMPT}{text}" for i, text in enumerate(texts)]
    command = f"python -m sonew_pax.sample --model_dir={model_dir} --prompt={PROMPT!r}"
    return "\n".join([f"The model at step {run.step} continues {PROMPT!r} ({command}):", *blocks])


def main(argv: Sequence[str]) -> None:
    """Runs tiny.gin into --model_dir and prints the summary and two samples."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    model_dir = pathlib.Path(_MODEL_DIR.value).resolve()
    train.quiet_library_logs()
    train.parse_gin(["tiny.gin"], [f"MODEL_DIR = {json.dumps(str(model_dir))}"], [])
    loop.train()
    print(summary(model_dir), flush=True)
    print(samples(model_dir), flush=True)


if __name__ == "__main__":
    app.run(main)
