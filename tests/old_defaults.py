"""The defaults this project had before it took Megatron-LM's. The tests written
against them pass them explicitly, so that each keeps checking what it was written for; those
that resume a run take OLD_DEFAULTS_WITH_DROPOUT (a resume must be bitwise with dropout on too).
(The SwiGLU width now rounds down as Megatron's does; tests whose hidden size would round it
to 0 pass --ffn-hidden-size.) The defaults later took Megatron's learned absolute positions and linear
biases: the old tests pass --position-embedding-type rope --disable-bias-linear."""

from megatron_zpp.config import ModelConfig

# Megatron's default dropout (--hidden-dropout 0.1 --attention-dropout 0.1) kept: what the resume tests run with
OLD_DEFAULTS_WITH_DROPOUT = (
    "--normalization RMSNorm --swiglu --position-embedding-type rope --disable-bias-linear --weight-decay 0.1 "
    "--adam-beta2 0.95 --min-lr 3e-5 --lr-decay-style cosine --lr-wsd-decay-style linear --log-interval 1 "
    "--eval-iters 2"
).split()
# dropout off: for the tests that compare a layout with another (or with a reference), whose masks must differ
DROPOUT_OFF = "--hidden-dropout 0 --attention-dropout 0".split()
OLD_DEFAULTS = OLD_DEFAULTS_WITH_DROPOUT + DROPOUT_OFF

OLD_MODEL = dict(
    normalization="RMSNorm",
    activation="swiglu",
    position_embedding_type="rope",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)


def old_model(**kw) -> ModelConfig:
    """A ModelConfig with the old model defaults; `num_query_groups` turns GQA on, as it did."""
    if kw.get("num_query_groups") is not None:
        kw.setdefault("group_query_attention", True)
    return ModelConfig(**{**OLD_MODEL, **kw})
