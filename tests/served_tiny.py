"""The engine the server tests serve: the tiny random model, sampled per request, lookup drafting of K tokens in 4
slots."""

from specjax.decoding.engine import Engine
from specjax.drafters import NgramDrafter
from specjax.io.loading import tiny_random_model

MODEL = tiny_random_model()
NAME = "tiny"
CONTEXT = 256
K = 3


def served_engine() -> Engine:
    return Engine(
        MODEL.weights,
        MODEL.cfg,
        drafter=NgramDrafter(),
        num_draft_tokens=K,
        slots=4,
        max_context=CONTEXT,
        sampled=True,
        eos_ids=MODEL.eos_ids,
    )
