"""What the target verifies each round once rows finish: nothing more for them.

Finished rows leave the batch only together (a quarter of it at least, since selecting rows copies
the whole KV cache); until then they ride along in every forward. They must ride along as a single
token: a finished row that kept verifying its drafts would widen the padded block of every round
for nothing, while its tokens are never committed. Widths are counted with a forward hook on the
target, under a schedule that gives all of a block to the row that finishes and none to the others.
"""

import torch
from test_generation import PAD, prompts, tiny_head, tiny_target
from transformers import StoppingCriteria, StoppingCriteriaList

from spark_generate import decode

PROMPT_LENGTH = 7


class StopsTheUnpaddedRow(StoppingCriteria):
    """Ends the only row of :func:`prompts` without left padding (row 0) once it holds ``length`` tokens."""

    def __init__(self, length: int):
        self.length = length

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return (input_ids[:, 0] != PAD) & (input_ids.shape[1] >= self.length)


def whole_block_for_the_first_row(confidence_logits, num_rows: int, num_draft_tokens: int) -> torch.Tensor:
    """A schedule: row 0 verifies every draft, the others none."""
    return torch.tensor([num_draft_tokens] + [0] * (num_rows - 1))


def test_a_finished_row_riding_along_verifies_nothing():
    """Row 0 of 5 stops after its first round; every later forward is one token wide."""
    target = tiny_target("llama")
    input_ids, attention_mask = prompts(5, length=PROMPT_LENGTH)
    widths = []
    hook = target.register_forward_pre_hook(
        lambda module, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        out = target.generate(
            input_ids, attention_mask=attention_mask, do_sample=False, max_new_tokens=8, custom_generate=decode,
            dspark_head=tiny_head(target), dspark_schedule=whole_block_for_the_first_row,
            stopping_criteria=StoppingCriteriaList([StopsTheUnpaddedRow(PROMPT_LENGTH + 2)]),
            return_dict_in_generate=True,
        )  # fmt: skip
    finally:
        hook.remove()
    rounds = widths[1:]  # after the prefill
    assert int(out.dspark_stats.num_rounds[0]) == 1 and len(rounds) == 7
    assert rounds == [5] + [1] * 6
