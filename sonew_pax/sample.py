r"""Text from a trained run: its newest checkpoint continues a prompt.

    python -m sonew_pax.sample --model_dir=/tmp/tiny --prompt="ROMEO:" \
      --temperature=0.8 --top_k=40 --max_new_tokens=100 --num_samples=2

Restores the run in MODEL_DIR onto this process's first device, whatever mesh trained it, with
the model and tokenizer its ``config.gin`` names, and prints each sample after the prompt; see
`sonew_pax.inference` for how the tokens are drawn. Temperature 0 (or ``--top_k=1``) is greedy.
A MODEL_DIR without ``config.gin`` or without a checkpoint, or settings that cannot work, print
one line ``error: ...`` and exit with status 1, as ``python -m sonew_pax.train`` does.
"""

import sys
from collections.abc import Sequence

from absl import app, flags

from sonew_pax import inference, train
from sonew_pax.errors import RunError

_MODEL_DIR = flags.DEFINE_string("model_dir", None, "The run directory.", required=True)
_PROMPT = flags.DEFINE_string("prompt", "", "The text to continue.")
_TEMPERATURE = flags.DEFINE_float("temperature", 1.0, "Softmax temperature; 0: greedy.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Draw among the k most likely tokens; 0: all.")
_MAX_NEW_TOKENS = flags.DEFINE_integer("max_new_tokens", 100, "Tokens drawn per sample.")
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the draws.")
_NUM_SAMPLES = flags.DEFINE_integer("num_samples", 1, "Samples drawn together.")


def main(argv: Sequence[str]) -> None:
    """absl entry point: restore the run, print each sample after the prompt."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    train.quiet_library_logs()
    try:
        inference.check_sampling(
            _TEMPERATURE.value, _TOP_K.value, _MAX_NEW_TOKENS.value, _NUM_SAMPLES.value
        )
        run = inference.load_run(_MODEL_DIR.value)
        texts = inference.sample(
            run,
            _PROMPT.value,
            num_samples=_NUM_SAMPLES.value,
            max_new_tokens=_MAX_NEW_TOKENS.value,
            temperature=_TEMPERATURE.value,
            top_k=_TOP_K.value,
            seed=_SEED.value,
        )
    except RunError as error:
        sys.exit(f"error: {error}")
    for index, text in enumerate(texts):
        print(f"--- sample {index + 1} (step {run.step}) ---\n{_PROMPT.value}{text}", flush=True)


if __name__ == "__main__":
    app.run(main)
