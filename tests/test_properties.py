"""Property-based differential test: any forward the analysis fuses must compute what it did.

Hypothesis writes forwards that interleave the three projection calls with
statements that read, alias, rebind or mutate the input. Whatever the analysis
decides, a fused result must give the original's outputs; a refusal is always
acceptable. This finds orderings the hand-written hazard cases miss.
"""

import importlib
import sys

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fusegen.build import build
from tests.test_hazards import MODULE

BETWEEN = [
    "h = x.view(-1)",
    "h = x[:, 1:]",
    "h = x.transpose(1, 2)",
    "a, b = x.chunk(2, dim=-1)",
    "h = a",
    "h.add_(1)",
    "a.mul_(3)",
    "x.mul_(2)",
    "x[0] = 0",
    "torch.relu_(x)",
    "x = x + 1",
    "x, y = y, x",
    "y = x",
    "y = torch.sigmoid(x)",
    "n = x.shape[-1] + x.size(0)",
    "h = self.act(x)",
    "h = self.act(h)",
    "torch.add(h, 1, out=h)",
]
CALLS = ["q = self.q_proj(x)", "k = self.k_proj(x)", "v = self.v_proj(x)"]
PRELUDE = ["h = x * 1", "a = x * 1", "b = x * 1", "y = x * 1", "n = 0"]
RETURN = "return q + torch.cat([k, v], dim=-1) + h.sum() + a.sum() + b.sum() + x.sum() + y.sum() + n"


@st.composite
def forwards(draw):
    statements = draw(st.lists(st.sampled_from(BETWEEN), min_size=0, max_size=6))
    calls = draw(st.permutations(CALLS))
    for call in calls:
        statements.insert(draw(st.integers(0, len(statements))), call)
    return PRELUDE + statements + [RETURN]


COUNTER = iter(range(10**6))


@settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=forwards())
def test_fused_forwards_compute_what_the_original_computes(tmp_path, monkeypatch, body):
    name = f"prop_{next(COUNTER)}"
    package = tmp_path / "property_cases"
    package.mkdir(exist_ok=True)
    (package / "__init__.py").touch()
    forward = "\n".join(f"        {line}" for line in body)
    source = MODULE.replace("{model_type}", name).replace("{init}", "        self.act = nn.Tanh()")
    (package / f"{name}.py").write_text(source.replace("{forward}", forward))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        result = build(f"property_cases.{name}")
        if result.text is None:
            return  # refused: always acceptable
        (package / f"fused_{name}.py").write_text(result.text)
        original_module = importlib.import_module(f"property_cases.{name}")
        fused_module = importlib.import_module(f"property_cases.fused_{name}")
        torch.manual_seed(0)
        original = original_module.ToyForCausalLM(original_module.ToyConfig()).eval()
        original.save_pretrained(tmp_path / name)
        fused = fused_module.FusedToyForCausalLM.from_pretrained(tmp_path / name).eval()
        input_ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expected = original(input_ids).logits
            actual = fused(input_ids).logits
        assert torch.allclose(expected, actual, atol=1e-5, rtol=1e-6, equal_nan=True), "\n".join(body)
    finally:
        for module in [m for m in sys.modules if m.startswith("property_cases")]:
            del sys.modules[module]
