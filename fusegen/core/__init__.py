"""The layer below the compiler and the fusion kinds, above the runtime: what both speak.

- `plan`: the plans, refusals, vetoes and outcomes the stages pass between them and the kinds return;
- `traced`: the traced class a kind matches in (`Trace`);
- `astutil`: helpers on the syntax tree of a class (parse, find, replace, blocks, loops and scopes);
- `vocabulary`: the one set of pure, in-place and reflective names the analyses trust or fear.

Imports point one way: tools -> compiler -> fusions -> core -> runtime (`tests/test_layering.py`).
"""
