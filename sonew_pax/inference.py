"""A trained run for inference: its configuration, tokenizer and parameters, and sampling.

`load_run` restores a run directory; `sample` continues a prompt with it (``python -m
sonew_pax.sample`` is its command line; ``python -m sonew_pax.export_hf`` exports the run).

The run's ``config.gin`` (in MODEL_DIR) says which model and which tokenizer it trained; the
parameters of its newest intact checkpoint are read onto this process's first device, whatever
mesh wrote them (`checkpoints.Checkpoints.restore_params`, which writes nothing in MODEL_DIR).

Generation is one jitted program per prompt length: the prompt fills a key/value cache
(`sonew_pax.models.init_cache`), then a ``lax.scan`` draws one token per step, for a static
``max_new_tokens``. The prompt is preceded by the tokenizer's EOS id, which in training separates
documents, so the model reads the prompt as the start of a document. A sample ends at the first
EOS it draws. Temperature 0 (or ``top_k=1``) is greedy decoding.
"""

import dataclasses
import functools
from typing import Any

import gin
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# sonew_pax.loop registers gin's `train`, which every config.gin binds: so that files importing
# only sonew_pax.trainer (which registered `train` before the loop had a module) still parse.
import sonew_pax.loop  # noqa: F401
from sonew_pax import checkpoints, data, paths, train_state
from sonew_pax.errors import ConfigError, RunError
from sonew_pax.models import Transformer, TransformerConfig, init_cache
from sonew_pax.resume import CONFIG_FILE
from sonew_pax.train_state import PyTree


@dataclasses.dataclass(frozen=True)
class Run:
    """A trained run, restored for inference.

    Attributes:
      config: the model's configuration.
      params: its parameters (unboxed arrays on one device).
      tokenizer: the tokenizer it was trained with.
      step: the step of the checkpoint the parameters come from.
    """

    config: TransformerConfig
    params: PyTree
    tokenizer: data.Tokenizer
    step: int


def _bound_value(selector: str, default: Any) -> Any:
    """What the parsed gin config binds to ``selector`` (a reference called as gin would call
    it), or ``default`` where it binds nothing or None."""
    try:
        value = gin.query_parameter(selector)
    except ValueError:
        return default
    if isinstance(value, gin.config.ConfigurableReference):
        function = value.scoped_configurable_fn
        value = function() if value.evaluate else function
    return default if value is None else value


def read_run_config(model_dir: str) -> tuple[TransformerConfig, data.Tokenizer]:
    """The model configuration and the tokenizer that the run in ``model_dir`` trained with.

    Parses the run's ``config.gin`` in place of this process's gin config (cleared before and
    after).

    Args:
      model_dir: the run directory (a path or a URI).

    Returns:
      ``(model configuration, tokenizer)``.

    Raises:
      RunError: ``model_dir`` has no ``config.gin``, or its config names no model.
    """
    path = paths.model_dir(model_dir) / CONFIG_FILE
    if not path.exists():
        raise RunError(
            f"{path} does not exist: {model_dir} is not a run directory "
            "(python -m sonew_pax.train writes config.gin there)"
        )
    gin.clear_config()
    try:
        gin.parse_config(path.read_text())
        model_config = _bound_value("train.model_config", None)
        data_config = _bound_value("make_train_iterator.config", None) or data.DataConfig()
        tokenizer = data.get_tokenizer(data_config)
    finally:
        gin.clear_config()
    if not isinstance(model_config, TransformerConfig):
        raise RunError(f"{path} binds no TransformerConfig to train.model_config")
    return model_config, tokenizer


def load_run(model_dir: str) -> Run:
    """The configuration, tokenizer and newest intact parameters of the run in ``model_dir``.

    Args:
      model_dir: the run directory (a path or a URI).

    Returns:
      A `Run` whose parameters live on this process's first device.

    Raises:
      RunError: no ``config.gin``, no checkpoint, or no checkpoint that restores.
    """
    config, tokenizer = read_run_config(model_dir)
    example = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    abstract = train_state.strip_boxes(
        train_state.abstract_boxed_params(Transformer(config), example)
    )
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    target = jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=device), abstract
    )
    ckpts = checkpoints.Checkpoints(model_dir, async_save=False)
    try:
        step, params = ckpts.restore_params(target)
    finally:
        ckpts.close()
    return Run(config=config, params=params, tokenizer=tokenizer, step=step)


def sample_logits(
    logits: jax.Array, rng: jax.Array, temperature: float, top_k: int | None
) -> jax.Array:
    """One token id per row of ``logits`` [batch, vocab].

    Args:
      logits: unnormalised log-probabilities.
      rng: the key of the draw.
      temperature: divides the logits; 0 takes the argmax (greedy).
      top_k: draw among the ``top_k`` most likely ids only; None or 0: among all.

    Returns:
      int32 [batch].
    """
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if top_k:
        kth = lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits / temperature, axis=-1).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("config", "vocab_size", "max_new_tokens", "temperature", "top_k")
)
def generate(
    params: PyTree,
    prompt: jax.Array,
    rng: jax.Array,
    *,
    config: TransformerConfig,
    vocab_size: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
) -> jax.Array:
    """Continues each row of ``prompt`` by ``max_new_tokens`` tokens drawn from the model.

    The prompt fills the key/value cache in one pass; a ``lax.scan`` then feeds each drawn token
    back, one position per step.

    Args:
      params: the model's parameters.
      prompt: int32 [batch, prompt length]; prompt length + max_new_tokens <= config.max_len.
      rng: the key of the draws (step ``i`` uses its ``i``-th split).
      config: the model's configuration.
      vocab_size: draw only ids below it (the tokenizer's vocabulary; the model's may be larger).
      max_new_tokens: tokens drawn per row.
      temperature: see `sample_logits`.
      top_k: see `sample_logits`.

    Returns:
      int32 [batch, max_new_tokens].
    """
    model = Transformer(config)
    batch, length = prompt.shape

    def forward(cache: PyTree, tokens: jax.Array) -> tuple[PyTree, jax.Array]:
        logits, mutated = model.apply(
            {"params": params, "cache": cache}, tokens, decode=True, mutable=["cache"]
        )
        return mutated["cache"], logits[:, -1, :vocab_size]

    def draw(logits: jax.Array, key: jax.Array) -> jax.Array:
        return sample_logits(logits, key, temperature, top_k)

    def step(carry: tuple[PyTree, jax.Array], key: jax.Array):
        cache, token = carry
        cache, logits = forward(cache, token[:, None])
        token = draw(logits, key)
        return (cache, token), token

    keys = jax.random.split(rng, max_new_tokens)
    cache, logits = forward(init_cache(config, batch, length + max_new_tokens), prompt)
    first = draw(logits, keys[0])
    _, rest = lax.scan(step, (cache, first), keys[1:])
    return jnp.concatenate([first[:, None], rest.T], axis=1)


def check_sampling(
    temperature: float, top_k: int | None, max_new_tokens: int, num_samples: int
) -> None:
    """Raises `ConfigError` naming a sampling setting that cannot work (before anything is
    restored)."""
    if temperature < 0:
        raise ConfigError(f"--temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ConfigError(f"--top_k must be >= 0 (0: no limit), got {top_k}")
    if max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens must be >= 1, got {max_new_tokens}")
    if num_samples < 1:
        raise ConfigError(f"--num_samples must be >= 1, got {num_samples}")


def sample(
    run: Run,
    prompt: str,
    *,
    num_samples: int = 1,
    max_new_tokens: int = 100,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """``num_samples`` continuations of ``prompt`` (the text after it, up to the first EOS).

    Args:
      run: the restored run (`load_run`).
      prompt: the text to continue (may be empty).
      num_samples: continuations drawn together, each with its own randomness.
      max_new_tokens: tokens drawn per continuation.
      temperature: see `sample_logits`.
      top_k: see `sample_logits`.
      seed: seeds the draws.

    Returns:
      The continuations' texts.

    Raises:
      ConfigError: a setting that cannot work, or a prompt and continuation longer than the
        model's max_len.
    """
    check_sampling(temperature, top_k, max_new_tokens, num_samples)
    tokenizer = run.tokenizer
    ids = np.concatenate([[tokenizer.eos_id], tokenizer.encode(prompt)]).astype(np.int32)
    if len(ids) + max_new_tokens > run.config.max_len:
        raise ConfigError(
            f"the prompt ({len(ids) - 1} tokens, plus EOS before it) and --max_new_tokens "
            f"({max_new_tokens}) exceed the model's max_len ({run.config.max_len})"
        )
    tokens = generate(
        run.params,
        jnp.tile(jnp.asarray(ids)[None], (num_samples, 1)),
        jax.random.key(seed),
        config=run.config,
        vocab_size=tokenizer.vocab_size,
        max_new_tokens=max_new_tokens,
        temperature=float(temperature),
        top_k=top_k or None,
    )
    texts = []
    for row in np.asarray(tokens):
        ends = np.flatnonzero(row == tokenizer.eos_id)
        texts.append(tokenizer.decode(row[: ends[0]] if ends.size else row))
    return texts
