"""Generate with a DSpark head on a tiny random model: same tokens as plain generate(), plus statistics.

The target is a random 4-layer Llama and the head is untrained, so almost every draft is rejected:
this shows the API and the guarantee (greedy output identical to plain decoding; sampled output
reproducible from a seed), not a speed-up. With a real target and its trained head, replace the
two model lines by ``DSparkForCausalLM.from_pretrained(target_id)`` and ``assistant=head_id``.

    python examples/generate_tiny.py
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spark_generate import DSparkForCausalLM
from spark_generate.heads import DSparkHead

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
)  # fmt: skip
target = LlamaForCausalLM(config).eval()
head = DSparkHead.from_target(target, num_draft_layers=1, block_size=4).eval()
model = DSparkForCausalLM(target)

prompts = torch.randint(2, 256, (2, 8))
plain = target.generate(prompts, do_sample=False, max_new_tokens=24)
out = model.generate(prompts, assistant=head, do_sample=False, max_new_tokens=24, return_dict_in_generate=True)
print("greedy output identical to plain generate():", torch.equal(plain, out.sequences))
print(out.dspark_stats.summary())

sampled = model.generate(
    prompts, assistant=head, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=24, seed=7
)
again = model.generate(prompts, assistant=head, do_sample=True, temperature=0.8, top_p=0.9, max_new_tokens=24, seed=7)
print("sampled output reproducible from its seed:", torch.equal(sampled, again))
