"""Lossless verification of drafted tokens, and proof by counting that it is lossless.

A small "target" and a deliberately poor "draft" distribution over an 8-token vocabulary. Each of
200,000 rows drafts 4 tokens from the draft and verifies them with `rejection_sample`. The first
emitted token's histogram is compared with the target (it must match, however bad the draft is),
and the acceptance statistics are printed for both verification backends:

* ``backend="torch"``, the PyTorch reference, which runs everywhere;
* ``backend="triton"``, the Triton kernel. It runs on CUDA tensors, and on CPU tensors through
  Triton's interpreter, which reads ``TRITON_INTERPRET=1`` when Triton is first imported. This
  script sets that variable before importing anything (unless it is set already), so on a machine
  with the ``triton`` package (``pip install 'spark-generate[triton]'``) both backends run on the
  CPU; the interpreter is slow, so the Triton run takes fewer rows (about half a minute). Without
  Triton, the script says so and shows the PyTorch backend only.

    python examples/verification.py
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first import of triton

import torch

from spark_generate.kernels import rejection_sample
from spark_generate.kernels._availability import has_triton, triton_supports

VOCAB, BLOCK, ROWS = 8, 4, 200_000
TRITON_ROWS = 2_000  # the Triton interpreter on CPU runs one program per row, slowly
torch.manual_seed(0)
target = torch.randn(BLOCK + 1, VOCAB).mul(1.5).softmax(-1)  # p_j per slot (independent of the prefix here)
draft = torch.randn(BLOCK, VOCAB).mul(1.5).softmax(-1)  # q_j per slot: a different, poorer guess

target_probs = target.expand(ROWS, -1, -1).contiguous()
draft_probs = draft.expand(ROWS, -1, -1).contiguous()
draft_token_ids = torch.multinomial(draft, ROWS, replacement=True).T.contiguous()  # [ROWS, BLOCK]
num_draft_tokens = torch.full((ROWS,), BLOCK)

device = torch.device("cpu")
backends = ["torch"]
if triton_supports(device):
    backends.append("triton")
elif not has_triton():
    print("[triton] not shown: the triton package is not installed (pip install 'spark-generate[triton]')")
else:
    print(f"[triton] not shown: TRITON_INTERPRET={os.environ['TRITON_INTERPRET']!r}; run with TRITON_INTERPRET=1")
for backend in backends:
    rows = ROWS if backend == "torch" else TRITON_ROWS
    out, num_emitted = rejection_sample(
        target_probs[:rows], draft_probs[:rows], draft_token_ids[:rows], num_draft_tokens[:rows],
        seed=torch.arange(rows), positions=0, backend=backend,
    )  # fmt: skip
    print(
        f"[{backend}] {rows} rows: mean tokens per verification = {num_emitted.float().mean():.3f} "
        f"(accepted drafts + 1), all {BLOCK} drafts accepted in {(num_emitted == BLOCK + 1).float().mean():.1%}"
    )

out, num_emitted = rejection_sample(
    target_probs, draft_probs, draft_token_ids, num_draft_tokens, seed=torch.arange(ROWS), backend="torch"
)
first = torch.bincount(out[:, 0], minlength=VOCAB).float() / ROWS
print("\nfirst emitted token      target p_0      draft q_0")
for token in range(VOCAB):
    print(f"  {token}: {first[token]:.4f}            {target[0, token]:.4f}          {draft[0, token]:.4f}")
print(
    f"total variation to the target: {0.5 * (first - target[0]).abs().sum():.4f} (sampling noise ~0.003); "
    f"the draft alone is {0.5 * (draft[0] - target[0]).abs().sum():.4f} away"
)

greedy_out, greedy_n = rejection_sample(
    target_probs[:1], None, target[:BLOCK].argmax(-1)[None], num_draft_tokens[:1], greedy=True
)
print(
    f"\ngreedy: drafts equal to the target argmax are all accepted: {greedy_out[0].tolist()}, {greedy_n.item()} tokens"
)
