"""`infinity train --eval-data FILE [--eval-every N]`: the validation loss of the model as it
trains.

Owns the validation set (the file tokenized with the run's tokenizer into its own token
cache, read in file order), when an evaluation is due, and its record in metrics.jsonl:
{"step": N, "eval_loss": x, "eval_perplexity": y, "eval_tokens": n}. The forwards run through
the engine under torch.no_grad(): no gradients, no optimizer traffic, and no step's telemetry.

[Note: the Trainer's evaluation] `InfinityTrainer.evaluate()` stays transformers' own loop
(`Trainer.evaluation_loop`); the engine enters it only through
`InfinityTrainer.prediction_step`, whose forward gathers the parameters as the one here does.
The two losses are different numbers on purpose: the Trainer's eval_loss is the mean over
samples of each batch's mean (each batch's loss repeated per sample and gathered with
accelerate's `gather_for_metrics`, non-finite values dropped), beside its metrics, callbacks
and predictions; this one is the mean over every label of the --eval-data file. Routing the
Trainer through `evaluate` below would change its eval_loss, and sharing one loop would mean
writing transformers' evaluation loop again for the loss-only case. So the project has one
evaluation loop of its own, this one, and uses transformers' as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from infinity.data import PackedDataset
from infinity.data.sequential import sequential_batches
from infinity.run.step import causal_lm_loss, model_inputs

IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class EvalResult:
    """The validation set's token-weighted mean loss after `step` optimizer steps."""

    step: int
    loss: float
    tokens: int
    """How many labels the loss averages (labels of -100 are not counted)."""

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss) if self.loss < 700 else math.inf  # exp overflows past ~709

    def record(self) -> dict:
        """The line in metrics.jsonl (`report` turns eval_loss into eval/loss)."""
        return {
            "step": self.step,
            "eval_loss": self.loss,
            "eval_perplexity": self.perplexity,
            "eval_tokens": self.tokens,
        }

    def describe(self) -> str:
        return (
            f"eval at step {self.step}: loss {self.loss:.4f}, perplexity "
            f"{self.perplexity:.4g} over {self.tokens} tokens"
        )


def due(step: int, every: int | None, steps: int) -> bool:
    """Whether an evaluation follows optimizer step `step`: at each multiple of `every`
    (counted from step 0, so a resumed run keeps the schedule) and after the last step."""
    return step == steps or bool(every) and step % every == 0


def evaluate(engine, data: PackedDataset, micro_batch: int) -> EvalResult:
    """Mean cross-entropy over every label of `data`, in file order, `micro_batch`
    sequences per forward; the module is in eval mode meanwhile, then back as it was."""
    was_training = engine.training
    engine.eval()
    total, count = 0.0, 0
    try:
        with torch.no_grad():
            for input_ids, labels, positions in sequential_batches(data, micro_batch):
                n = int((labels != IGNORE_INDEX).sum())
                if n == 0:
                    continue
                logits = engine(**model_inputs(input_ids, positions)).logits
                loss = causal_lm_loss(logits, labels)
                total += float(loss) * n  # a batch's mean, weighted by its labels
                count += n
    finally:
        engine.train(was_training)
    if count == 0:
        raise ValueError(
            "the validation data has no label to compute a loss on; give --eval-data a file "
            "with text in it"
        )
    return EvalResult(step=engine.global_steps, loss=total / count, tokens=count)
