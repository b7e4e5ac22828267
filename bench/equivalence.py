"""Print max abs logit diff and greedy agreement, original vs fused, llama and qwen2 (tiny random configs).

Run from the repository root: python bench/equivalence.py. The same cases are asserted in tests/test_equivalence.py.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import tempfile

import torch

from fusegen.testkit import MODELS, load_pair, max_diff, model_classes, save_random, small_config

for name in MODELS:
    cc, oc, _ = model_classes(name)
    for kv in (4, 2, 1):
        for attn in ("eager", "sdpa"):
            d = tempfile.mkdtemp()
            save_random(oc, small_config(cc, num_key_value_heads=kv), d)
            o, f = load_pair(d, attn_implementation=attn)
            x = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))
            with torch.no_grad():
                diff = max_diff(o(x).logits, f(x).logits)
            g = torch.equal(
                o.generate(x[:1, :5], max_new_tokens=16, min_new_tokens=16, do_sample=False),
                f.generate(x[:1, :5], max_new_tokens=16, min_new_tokens=16, do_sample=False),
            )
            print(f"{name} kv={kv} {attn}: max abs diff {diff:.2e}, greedy16 identical={g}")
