"""One optimizer step, from the gradient's side: what flows where, how micro-batches add up, what each process draws.

None of these shows in the loss value or the weights of a short run, since AdamW is nearly blind to
the scale of a gradient and every process's loss looks alike; each would lower what a head learns:

* the confidence head learns ``1 - TV`` as a *target*: its BCE must send no gradient into the draft
  logits (it would pull the draft towards whatever the confidence head currently believes);
* with gradient accumulation, the gradient an optimizer step sees is the *mean* over its
  micro-batches, the same as one micro-batch's when they are all alike;
* under data parallelism every process draws its own anchors: processes that drew the same ones
  would train on the same blocks of every document they share.
"""

import torch
from accelerate import Accelerator
from test_losses import two_slot_block
from test_training import VOCAB, settings, tiny_head, tiny_target

import spark_generate.training.trainer as trainer_module
from spark_generate.training import LossWeights, TokenDataset, Trainer, dspark_loss


def test_the_confidence_target_sends_no_gradient_into_the_draft_logits():
    draft, _, target, labels = two_slot_block()
    draft.requires_grad_()
    confidence = torch.full((1, 2), 1.0, requires_grad=True)  # away from the optimum: BCE has a slope in its target
    confidence_only = LossWeights(ce=0.0, l1=0.0, confidence=1.0)
    terms = dspark_loss(draft, confidence, target, labels, torch.tensor([[True, True]]), confidence_only)
    terms.total.backward()
    assert not terms.acceptance.requires_grad
    assert confidence.grad.abs().min() > 0
    torch.testing.assert_close(draft.grad, torch.zeros_like(draft), rtol=0, atol=0)


def identical_documents(num_sequences: int = 4, length: int = 16) -> TokenDataset:
    """Copies of one document: every micro-batch and every process's shard holds the same tokens."""
    ids = tuple(torch.randint(2, VOCAB, (length,), generator=torch.Generator().manual_seed(3)).tolist())
    return TokenDataset((ids,) * num_sequences, ((0,) * 4 + (1,) * (length - 4),) * num_sequences, "one document")


def step_gradients(tmp_path, monkeypatch, accumulation: int) -> list[torch.Tensor]:
    """The head's gradients as the optimizer step receives them, after one step of alike micro-batches."""
    target = tiny_target()
    config = settings(tmp_path, num_steps=1, batch_size=1, gradient_accumulation_steps=accumulation, num_anchors=64)
    trainer = Trainer(tiny_head(target), target, identical_documents(), config)
    seen = []
    clip = trainer.accelerator.clip_grad_norm_

    def recording_clip(parameters, max_norm):
        parameters = list(parameters)
        seen.extend(parameter.grad.clone() for parameter in parameters)
        return clip(parameters, max_norm)

    monkeypatch.setattr(trainer.accelerator, "clip_grad_norm_", recording_clip)
    trainer.train()
    return seen


def test_accumulated_gradients_are_the_mean_over_micro_batches(tmp_path, monkeypatch):
    """All anchors of one document in every micro-batch: two accumulated micro-batches give one's gradient."""
    one = step_gradients(tmp_path / "one", monkeypatch, accumulation=1)
    two = step_gradients(tmp_path / "two", monkeypatch, accumulation=2)
    assert len(one) == len(two) > 0
    assert sum(float(gradient.abs().sum()) for gradient in one) > 0
    for single, accumulated in zip(one, two, strict=True):
        torch.testing.assert_close(accumulated, single, rtol=1e-5, atol=1e-7)


class OneOfTwoProcesses(Accelerator):
    """A process of a two-process run, as the trainer sees it (nothing is launched: the gradient stays local)."""

    def __init__(self, index: int):
        self.index = index
        super().__init__()

    @property
    def process_index(self) -> int:
        return self.index

    @property
    def num_processes(self) -> int:
        return 2


def test_each_process_draws_its_own_anchors(tmp_path, monkeypatch):
    """Both processes get the same documents; 3 anchors among 11 candidates each time must differ between them."""
    draws: dict[int, list[list[int]]] = {0: [], 1: []}
    sample = trainer_module.sample_anchors
    for index in (0, 1):

        def recording_sample(loss_mask, num_anchors, generator, index=index):
            anchors = sample(loss_mask, num_anchors, generator)
            draws[index].append(anchors.positions.tolist())
            return anchors

        monkeypatch.setattr(trainer_module, "sample_anchors", recording_sample)
        target = tiny_target()
        config = settings(tmp_path / str(index), num_steps=1, batch_size=1, num_anchors=3)
        Trainer(tiny_head(target), target, identical_documents(), config, accelerator=OneOfTwoProcesses(index)).train()
    assert len(draws[0]) == len(draws[1]) == 2  # two micro-batches
    assert draws[0] != draws[1]
